"""The webhook's metrics, read from its registry after real requests through
:class:`~migpilot.webhook.serving.WebhookServer` on loopback (TLS from a throwaway CA): each
review counted once by path and outcome (allowed, patched, denied, bad_request, error) with its
duration; probes and unknown paths not counted; connections refused at the bound and cut at the
deadline; certificate reloads; and the plain-HTTP endpoint serving them with its probes."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from migpilot import errors
from migpilot.kube import memory as kubememory
from migpilot.kube import objects as kubeobjects
from migpilot.webhook import leases, serving
from migpilot.webhook import metrics as wm
from tests.kube import certs

LEASE: dict[str, Any] = {
    "metadata": {"name": "migpilot-controller", "namespace": "migpilot-system"},
    "spec": {
        "holderIdentity": "controller-0",
        "renewTime": "1970-01-01T00:01:40Z",
        "leaseDurationSeconds": 15,
    },
}
MUTATE, VALIDATE = serving.MUTATE_PATH, serving.VALIDATE_PATH


def _review(uid: str, resources: dict[str, Any]) -> bytes:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": uid},
        "spec": {"containers": [{"name": "app", "resources": {"requests": resources}}]},
    }
    request = {
        "uid": uid,
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "operation": "CREATE",
        "object": pod,
    }
    document = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request}
    return json.dumps(document).encode()


MIG = _review("u-mig", {"nvidia.com/mig-1g.10gb": "1"})
CPU = _review("u-cpu", {"cpu": "1"})
MALFORMED_UNIFIED = _review("u-bad", {"nvidia.com/gpumem": "8000"})  # needs nvidia.com/gpu


class Served:
    """A running webhook, its client side and its metrics."""

    def __init__(self, server: serving.WebhookServer, ca: Path) -> None:
        self.server = server
        self.context = ssl.create_default_context(cafile=ca)
        self.metrics = server.metrics

    def tls(self) -> ssl.SSLSocket:
        raw = socket.create_connection(("127.0.0.1", self.server.port), timeout=10)
        return self.context.wrap_socket(raw, server_hostname="127.0.0.1")

    def exchange(self, raw: bytes) -> bytes:
        """Send ``raw`` on a new connection; what the server answers until it closes."""
        with self.tls() as conn:
            conn.sendall(raw)
            data = b""
            while chunk := conn.recv(65536):
                data += chunk
            return data

    def post(self, path: str, body: bytes) -> int:
        """POST ``body`` (``Connection: close``); the status code."""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        answer = self.exchange(head + body)
        return int(answer.split(b" ", 2)[1])

    def count(self, path: str, outcome: str) -> float:
        got = self.metrics.registry.get_sample_value(
            "migpilot_webhook_requests_total", {"path": path, "outcome": outcome}
        )
        assert got is not None, (path, outcome)
        return got

    def counts(self) -> dict[tuple[str, str], float]:
        """(path, outcome) -> requests, the ones not 0."""
        out = {}
        for path in wm.PATHS:
            for outcome in wm.Outcome:
                if n := self.count(path, outcome.value):
                    out[(path, outcome.value)] = n
        return out

    def observed(self, path: str) -> float:
        got = self.metrics.registry.get_sample_value(
            "migpilot_webhook_request_duration_seconds_count", {"path": path}
        )
        assert got is not None, path
        return got

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        got = self.metrics.registry.get_sample_value(name, labels or {})
        assert got is not None, name
        return got


def _eventually(check: Callable[[], object], what: str, timeout: float = 10.0) -> None:
    """Until ``check()`` holds: a request is counted in the server's thread just after its
    answer is written, so the client may read the answer a moment before the count moves."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def _settings(pair: certs.KeyPair, **limits: Any) -> serving.Settings:
    return serving.Settings(
        tls=serving.TlsSettings(cert_file=pair.cert, key_file=pair.key),
        host="127.0.0.1",
        port=0,
        connection_timeout_s=5.0,
        **limits,
    )


def _freshness() -> leases.Freshness:
    api = kubememory.InMemoryServer()
    api.put(kubeobjects.Kind.LEASES, LEASE)
    lease = leases.KubeLease(api, name="migpilot-controller", namespace="migpilot-system")
    return leases.Freshness(lease, cache_s=2.0, clock=lambda: 100.0)


@pytest.fixture
def issued(tmp_path: Path) -> tuple[certs.CertificateAuthority, certs.KeyPair]:
    ca = certs.CertificateAuthority(tmp_path)
    return ca, ca.issue("webhook", common_name="migpilot-webhook", server_ips=("127.0.0.1",))


@pytest.fixture
def served(issued: tuple[certs.CertificateAuthority, certs.KeyPair]) -> Iterator[Served]:
    ca, pair = issued
    with serving.WebhookServer(_settings(pair), freshness=_freshness()) as server:
        yield Served(server, ca.pair.cert)


# --- the pure part --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "want"),
    [
        ({"uid": "u", "allowed": True}, wm.Outcome.ALLOWED),
        ({"uid": "u", "allowed": True, "patchType": "JSONPatch", "patch": "W3t9XQ=="}, "patched"),
        ({"uid": "u", "allowed": True, "patch": ""}, wm.Outcome.ALLOWED),
        ({"uid": "u", "allowed": False, "status": {"code": 422}}, wm.Outcome.DENIED),
        ({"uid": "u"}, wm.Outcome.DENIED),  # the apiserver reads a missing "allowed" as false
    ],
)
def test_a_reviews_outcome_is_what_its_response_says(response: dict[str, Any], want: str) -> None:
    assert wm.review_outcome(response) == want


def test_every_series_exists_from_the_start_at_zero() -> None:
    figures = wm.WebhookMetrics()
    value = figures.registry.get_sample_value
    for path in (MUTATE, VALIDATE):
        for outcome in ("allowed", "denied", "patched", "bad_request", "error"):
            labels = {"path": path, "outcome": outcome}
            assert value("migpilot_webhook_requests_total", labels) == 0.0, labels
        assert value("migpilot_webhook_request_duration_seconds_count", {"path": path}) == 0.0
    for name in ("refused", "timed_out"):
        assert value(f"migpilot_webhook_connections_{name}_total") == 0.0
    for outcome in ("loaded", "failed"):
        labels = {"outcome": outcome}
        assert value("migpilot_webhook_certificate_reloads_total", labels) == 0.0
    assert b"# TYPE migpilot_webhook_requests_total counter" in figures.exposition()
    # Its own registry: a second one starts at 0 whatever the first counted.
    figures.observe_request(MUTATE, wm.Outcome.PATCHED, 0.002)
    again = wm.WebhookMetrics()
    assert (
        again.registry.get_sample_value(
            "migpilot_webhook_requests_total", {"path": MUTATE, "outcome": "patched"}
        )
        == 0.0
    )


# --- requests through the server ------------------------------------------------------------


def test_each_review_is_counted_once_by_path_and_outcome(served: Served) -> None:
    assert served.post(MUTATE, MIG) == 200  # gated: patched
    assert served.post(MUTATE, CPU) == 200  # not a MIG pod: allowed as it is
    assert served.post(VALIDATE, MALFORMED_UNIFIED) == 200  # refused: denied
    assert served.post(VALIDATE, CPU) == 200
    assert served.post(VALIDATE, b"{not json") == 400
    want = {
        (MUTATE, "patched"): 1.0,
        (MUTATE, "allowed"): 1.0,
        (VALIDATE, "denied"): 1.0,
        (VALIDATE, "allowed"): 1.0,
        (VALIDATE, "bad_request"): 1.0,
    }
    _eventually(lambda: served.counts() == want, f"the counts {want}")
    # One duration per review, on its path; each took something, far under the deadline.
    assert (served.observed(MUTATE), served.observed(VALIDATE)) == (2.0, 3.0)
    took = served.value("migpilot_webhook_request_duration_seconds_sum", {"path": MUTATE})
    assert 0 < took < 5
    assert served.value("migpilot_webhook_connections_timed_out_total") == 0


def test_requests_that_are_not_reviews_are_not_counted(served: Served) -> None:
    assert b"200 OK" in served.exchange(
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    assert served.post("/other", CPU) == 404
    assert b"404" in served.exchange(b"GET /mutate-pods HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert served.post(MUTATE, CPU) == 200  # the next review is, and only it
    _eventually(lambda: served.counts() == {(MUTATE, "allowed"): 1.0}, "the one review counted")
    assert served.observed(MUTATE) + served.observed(VALIDATE) == 1


@pytest.mark.parametrize(
    "head",
    [
        b"POST /mutate-pods HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",  # 411
        b"POST /mutate-pods?timeout=5s HTTP/1.1\r\nContent-Length: 99999999999\r\n"
        b"Connection: close\r\n\r\n",  # 413
    ],
    ids=["no-length", "too-large"],
)
def test_a_body_the_server_will_not_read_is_a_bad_request(served: Served, head: bytes) -> None:
    answer = served.exchange(head)
    assert answer.split(b" ", 2)[1] in (b"411", b"413")
    _eventually(lambda: served.counts() == {(MUTATE, "bad_request"): 1.0}, "one bad request")


def test_a_client_gone_before_its_body_is_whole_is_an_error(served: Served) -> None:
    head = b"POST /validate-pods HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n"
    with served.tls() as conn:
        conn.sendall(head + CPU[:50])
    _eventually(lambda: served.counts() == {(VALIDATE, "error"): 1.0}, "the error counted")
    assert served.observed(VALIDATE) == 1
    assert served.value("migpilot_webhook_connections_timed_out_total") == 0


def test_connections_over_the_bound_are_counted_refused(
    issued: tuple[certs.CertificateAuthority, certs.KeyPair],
) -> None:
    ca, pair = issued
    with serving.WebhookServer(
        _settings(pair, max_connections=1), freshness=_freshness()
    ) as server:
        hook = Served(server, ca.pair.cert)
        with hook.tls():  # holds the only slot (its handshake done: served)
            extra = [
                socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(5)
            ]
            try:
                for conn in extra:  # each closed at accept, unserved
                    assert conn.recv(1) == b""
            finally:
                for conn in extra:
                    conn.close()
        assert server.refused == 5
        assert hook.value("migpilot_webhook_connections_refused_total") == 5


@pytest.fixture
def hurried(issued: tuple[certs.CertificateAuthority, certs.KeyPair]) -> Iterator[Served]:
    """A webhook whose requests must be whole within 0.5 s."""
    ca, pair = issued
    settings = _settings(pair, request_timeout_s=0.5)
    with serving.WebhookServer(settings, freshness=_freshness()) as server:
        yield Served(server, ca.pair.cert)


def _response(conn: socket.socket) -> bytes:
    """One whole response read from a kept-alive connection (its head, then its body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    [length] = [line.split(b":")[1] for line in head.split(b"\r\n") if b"Content-Length" in line]
    while len(body) < int(length):
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def _cut(conn: socket.socket) -> None:
    """Wait until the server closes ``conn`` (the test fails after 10 s)."""
    conn.settimeout(10)
    with contextlib.suppress(ConnectionError, ssl.SSLError):  # closed without a TLS goodbye
        assert conn.recv(1) == b""


def test_a_review_whose_body_comes_too_slowly_is_cut_counted_and_an_error(
    hurried: Served,
) -> None:
    head = b"POST /mutate-pods HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n"
    with hurried.tls() as conn:
        conn.sendall(head + MIG[:20])  # and nothing more
        _cut(conn)
    _eventually(
        lambda: hurried.value("migpilot_webhook_connections_timed_out_total") == 1, "the cut"
    )
    _eventually(lambda: hurried.counts() == {(MUTATE, "error"): 1.0}, "the review's error")
    took = hurried.value("migpilot_webhook_request_duration_seconds_sum", {"path": MUTATE})
    assert 0.3 <= took < 5  # it lasted until its deadline


def test_a_connection_that_never_sends_a_request_is_cut_and_counted(hurried: Served) -> None:
    with hurried.tls() as conn:  # handshake done, then silence: the first request's deadline
        _cut(conn)
    raw = socket.create_connection(("127.0.0.1", hurried.server.port), timeout=10)
    with raw:  # not even a TLS handshake
        _cut(raw)
    _eventually(
        lambda: hurried.value("migpilot_webhook_connections_timed_out_total") == 2, "both cuts"
    )
    assert hurried.counts() == {}  # no request line: not a review


def test_an_idle_kept_alive_connection_closed_is_not_a_timeout(
    issued: tuple[certs.CertificateAuthority, certs.KeyPair],
) -> None:
    ca, pair = issued
    settings = serving.Settings(
        tls=serving.TlsSettings(cert_file=pair.cert, key_file=pair.key),
        host="127.0.0.1",
        port=0,
        connection_timeout_s=0.3,
    )
    with serving.WebhookServer(settings, freshness=_freshness()) as server:
        hook = Served(server, ca.pair.cert)
        head = f"POST {MUTATE} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(CPU)}\r\n\r\n"
        with hook.tls() as conn:
            conn.sendall(head.encode() + CPU)
            assert _response(conn).startswith(b"HTTP/1.1 200")
            _cut(conn)  # idle past the idle timeout: closed
        _eventually(lambda: hook.counts() == {(MUTATE, "allowed"): 1.0}, "the review")
        assert hook.value("migpilot_webhook_connections_timed_out_total") == 0


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _swap(target: certs.KeyPair, source: certs.KeyPair, *, key: bool = True) -> None:
    pairs = [(source.cert, target.cert)] + ([(source.key, target.key)] if key else [])
    for new, old in pairs:
        staged = old.with_suffix(".new")
        staged.write_bytes(new.read_bytes())
        staged.replace(old)


def test_certificate_reloads_are_counted_by_outcome(tmp_path: Path) -> None:
    ca = certs.CertificateAuthority(tmp_path)
    served_pair = ca.issue("served", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    renewed = ca.issue("renewed", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    clock = _Clock()
    settings = _settings(served_pair, cert_check_s=10.0)
    with serving.WebhookServer(settings, freshness=_freshness(), clock=clock) as server:
        hook = Served(server, ca.pair.cert)

        def reloads() -> dict[str, float]:
            return {
                o: hook.value("migpilot_webhook_certificate_reloads_total", {"outcome": o})
                for o in ("loaded", "failed")
            }

        _swap(served_pair, renewed, key=False)  # the certificate renewed, its key not yet
        clock.now += 10.0
        hook.tls().close()  # a new connection: the files are looked at
        assert reloads() == {"loaded": 0, "failed": 1}
        clock.now += 10.0
        hook.tls().close()
        assert reloads() == {"loaded": 0, "failed": 2}  # each check of the broken pair
        _swap(served_pair, renewed)
        clock.now += 10.0
        hook.tls().close()
        assert reloads() == {"loaded": 1, "failed": 2}
        clock.now += 10.0
        hook.tls().close()  # unchanged: not loaded again
        assert reloads() == {"loaded": 1, "failed": 2}
        assert server.certs.reloads == 1


# --- the plain-HTTP endpoint ----------------------------------------------------------------


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read().decode()


def test_the_metrics_port_serves_the_series_and_probes_that_ask_the_server(
    issued: tuple[certs.CertificateAuthority, certs.KeyPair],
) -> None:
    ca, pair = issued
    settings = _settings(pair, metrics_port=0, metrics_host="127.0.0.1")
    server = serving.WebhookServer(settings, freshness=_freshness())
    endpoint = serving.serve_metrics(server, settings)
    assert endpoint is not None and endpoint.port not in (0, server.port)
    try:
        assert _get(endpoint.port, "/healthz") == (503, "the HTTPS server is not started yet\n")
        assert _get(endpoint.port, "/readyz")[0] == 503
        server.start()
        assert _get(endpoint.port, "/healthz") == (200, "ok\n")
        assert _get(endpoint.port, "/readyz") == (200, "ok\n")
        assert Served(server, ca.pair.cert).post(MUTATE, MIG) == 200
        want = f'migpilot_webhook_requests_total{{outcome="patched",path="{MUTATE}"}} 1.0'
        _eventually(lambda: want in _get(endpoint.port, "/metrics")[1], "the patched review")
        server.stop()
        assert _get(endpoint.port, "/healthz") == (503, "the HTTPS server is stopped\n")
        assert _get(endpoint.port, "/readyz") == (503, "the HTTPS listener is closed\n")
    finally:
        server.stop()
        endpoint.close()


def test_no_metrics_port_serves_nothing_and_a_taken_one_is_a_clear_error(
    issued: tuple[certs.CertificateAuthority, certs.KeyPair],
) -> None:
    _, pair = issued
    with serving.WebhookServer(_settings(pair), freshness=_freshness()) as server:
        assert serving.serve_metrics(server, _settings(pair)) is None
        taken = _settings(pair, metrics_port=server.port, metrics_host="127.0.0.1")
        with pytest.raises(errors.MigpilotError, match=r"^cannot serve metrics on 127\.0\.0\.1:"):
            serving.serve_metrics(server, taken)
