"""The webhook's HTTPS server on loopback with a certificate from a throwaway CA: health, the
review round trip on both paths (gating on /mutate-pods, refusing a malformed unified request on
/validate-pods), bodies that are not JSON (or nested too deep to read) answered 400, reviews that
are JSON but malformed still allowed, keep-alive, concurrent clients (one stuck before its TLS
handshake blocks nobody), the limits (slow clients cut at the request's deadline, connections
over the most closed unserved), and stop() really closing open connections."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from migpilot import errors
from migpilot.kube import memory as kubememory
from migpilot.kube import objects as kubeobjects
from migpilot.webhook import claims, leases, serving
from tests.kube import certs

LEASE = {
    "metadata": {"name": "migpilot-controller", "namespace": "migpilot-system"},
    "spec": {
        "holderIdentity": "controller-0",
        "renewTime": "1970-01-01T00:01:40Z",
        "leaseDurationSeconds": 15,
    },
}


def _stored_lease(server: kubememory.InMemoryServer) -> leases.KubeLease:
    """The controller's Lease as the webhook reads it, from ``server`` (with :data:`LEASE`)."""
    server.put(kubeobjects.Kind.LEASES, LEASE)
    return leases.KubeLease(server, name="migpilot-controller", namespace="migpilot-system")


def _review(uid: str, resources: dict[str, Any]) -> bytes:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": uid},
        "spec": {"containers": [{"name": "app", "resources": {"requests": resources}}]},
    }
    document = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "object": pod,
        },
    }
    return json.dumps(document).encode()


class Webhook:
    def __init__(
        self, server: serving.WebhookServer, api: kubememory.InMemoryServer, ca: Path
    ) -> None:
        self.server = server
        self.api = api
        """The API server the webhook reads the controller's Lease from."""
        self.context = ssl.create_default_context(cafile=ca)

    @property
    def lease_reads(self) -> int:
        """How many times the webhook read the Lease."""
        return self.api.requests["get", kubeobjects.Kind.LEASES]

    def connect(self) -> http.client.HTTPSConnection:
        return http.client.HTTPSConnection(
            "127.0.0.1", self.server.port, context=self.context, timeout=10
        )

    def post(
        self,
        body: bytes,
        conn: http.client.HTTPSConnection | None = None,
        *,
        path: str = "/mutate-pods",
    ) -> tuple[int, Any]:
        own = conn is None
        conn = conn or self.connect()
        try:
            conn.request("POST", path, body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            data = response.read()
            return response.status, json.loads(data)
        finally:
            if own:
                conn.close()


@pytest.fixture
def webhook(tmp_path: Path) -> Iterator[Webhook]:
    ca = certs.CertificateAuthority(tmp_path)
    pair = ca.issue("webhook", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    api = kubememory.InMemoryServer()
    freshness = leases.Freshness(_stored_lease(api), cache_s=2.0, clock=lambda: 100.0)
    settings = serving.Settings(
        tls=serving.TlsSettings(cert_file=pair.cert, key_file=pair.key),
        host="127.0.0.1",
        port=0,
        connection_timeout_s=5.0,
    )
    reader = claims.ClaimReader(api)
    with serving.WebhookServer(settings, freshness=freshness, reader=reader) as server:
        yield Webhook(server, api, ca.pair.cert)


def test_healthz_and_unknown_paths(webhook: Webhook) -> None:
    conn = webhook.connect()
    try:
        conn.request("GET", "/healthz")
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b"ok")
        conn.request("GET", "/nope")  # same connection: keep-alive
        response = conn.getresponse()
        assert response.status == 404
        response.read()
    finally:
        conn.close()


def test_mig_pod_is_patched_and_plain_pod_is_not(webhook: Webhook) -> None:
    status, answer = webhook.post(_review("u-mig", {"nvidia.com/mig-1g.10gb": "1"}))
    assert status == 200
    response = answer["response"]
    assert response["uid"] == "u-mig"
    assert response["allowed"] is True
    patch = json.loads(base64.b64decode(response["patch"]))
    assert patch[0] == {
        "op": "add",
        "path": "/spec/schedulingGates",
        "value": [{"name": "migpilot.io/plan"}],
    }
    status, answer = webhook.post(_review("u-cpu", {"cpu": "1"}))
    assert status == 200
    assert answer["response"] == {"uid": "u-cpu", "allowed": True}


def _dra_review(uid: str, template: str) -> bytes:
    document = json.loads(_review(uid, {}))
    document["request"]["namespace"] = "team"
    document["request"]["object"]["spec"]["resourceClaims"] = [
        {"name": "gpu", "resourceClaimTemplateName": template}
    ]
    return json.dumps(document).encode()


def test_a_dra_pod_is_patched_when_its_template_asks_for_migpilots_class(
    webhook: Webhook,
) -> None:
    for name, device_class in (("ours", "mig.migpilot.io"), ("theirs", "gpu.example.com")):
        request = {"name": "gpu", "exactly": {"deviceClassName": device_class}}
        webhook.api.put(
            kubeobjects.Kind.RESOURCECLAIMTEMPLATES,
            {
                "metadata": {"name": name, "namespace": "team"},
                "spec": {"spec": {"devices": {"requests": [request]}}},
            },
        )
    status, answer = webhook.post(_dra_review("u-dra", "ours"))
    assert status == 200 and "patch" in answer["response"]
    status, answer = webhook.post(_dra_review("u-other", "theirs"))
    assert status == 200 and answer["response"] == {"uid": "u-other", "allowed": True}
    status, answer = webhook.post(_dra_review("u-none", "later"))
    assert status == 200 and "patch" not in answer["response"]
    assert "ResourceClaimTemplate team/later not found" in answer["response"]["warnings"][0]


def test_a_unified_pod_is_patched(webhook: Webhook) -> None:
    status, answer = webhook.post(
        _review("u-uni", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8k"})
    )
    assert status == 200
    patch = json.loads(base64.b64decode(answer["response"]["patch"]))
    assert patch[0]["value"] == [{"name": "migpilot.io/plan"}]


@pytest.mark.parametrize(
    ("resources", "message"),
    [
        (
            {"nvidia.com/gpumem": "8000"},
            "spec.containers[0].resources.nvidia.com/gpumem: needs nvidia.com/gpu",
        ),
        (
            {"nvidia.com/gpu": "1", "nvidia.com/gpucores": "150"},
            "spec.containers[0].resources.nvidia.com/gpucores: 150 is outside 1 to 100",
        ),
    ],
)
def test_a_malformed_unified_request_is_refused_on_validate(
    webhook: Webhook, resources: dict[str, Any], message: str
) -> None:
    status, answer = webhook.post(_review("u-bad", resources), path="/validate-pods")
    assert status == 200
    response = answer["response"]
    assert response["uid"] == "u-bad"
    assert response["allowed"] is False
    assert response["status"]["code"] == 422
    assert message in response["status"]["message"]
    assert webhook.lease_reads == 0  # refusing does not depend on the controller


def test_good_and_other_pods_are_allowed_on_validate(webhook: Webhook) -> None:
    conn = webhook.connect()
    try:
        for uid, resources in [
            ("u-good", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8k"}),
            ("u-cpu", {"cpu": "1"}),
            ("u-mig", {"nvidia.com/mig-1G.10GB": "1"}),  # warned of by /mutate-pods, not refused
        ]:
            status, answer = webhook.post(_review(uid, resources), conn, path="/validate-pods")
            assert status == 200
            assert answer["response"] == {"uid": uid, "allowed": True}
        status, answer = webhook.post(b"[]", conn, path="/validate-pods")
        assert status == 200
        assert answer["response"]["allowed"] is True
        assert "not validated" in answer["response"]["status"]["message"]
    finally:
        conn.close()


def test_missing_lease_lets_mig_pods_through(webhook: Webhook) -> None:
    # before the first request: nothing cached yet
    webhook.api.delete(kubeobjects.Kind.LEASES, "migpilot-system/migpilot-controller")
    status, answer = webhook.post(_review("u-1", {"nvidia.com/mig-1g.10gb": "1"}))
    assert status == 200
    assert answer["response"] == {"uid": "u-1", "allowed": True}
    assert webhook.lease_reads == 1


@pytest.mark.parametrize("body", [b"[]", b"{}", b"null", b'{"kind": "AdmissionReview"}'])
def test_malformed_reviews_are_allowed_with_a_message(webhook: Webhook, body: bytes) -> None:
    status, answer = webhook.post(body)
    assert status == 200
    assert answer["response"]["allowed"] is True
    assert "admitted without a gate" in answer["response"]["status"]["message"]


def _post_raw(webhook: Webhook, body: bytes, path: str) -> tuple[int, bytes]:
    conn = webhook.connect()
    try:
        conn.request("POST", path, body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


_DEEP = b"[" * 100_000 + b"]" * 100_000


@pytest.mark.parametrize("path", ["/mutate-pods", "/validate-pods"])
@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", b"the body is not JSON"),
        (b"", b"the body is not JSON"),
        (b'{"a": "\xc3\x28"}', b"not UTF-8 JSON"),
        (_DEEP, b"nested too deeply"),
        (b'{"a": ' * 50_000 + b"1" + b"}" * 50_000, b"nested too deeply"),
    ],
    ids=["not-json", "empty", "not-utf8", "deep-list", "deep-object"],
)
def test_a_body_that_is_not_json_is_answered_400(
    webhook: Webhook, path: str, body: bytes, reason: bytes
) -> None:
    status, text = _post_raw(webhook, body, path)
    assert status == 400
    assert reason in text
    # The server is still whole: the next review is served.
    assert webhook.post(_review("u-after", {"cpu": "1"}), path=path)[0] == 200


def test_a_review_holding_a_deeply_nested_value_is_answered(webhook: Webhook) -> None:
    """Deep enough to decode, and then shown in a message: answered, never dropped."""
    depth = 900  # under the decoder's recursion limit
    nested = json.loads("[" * depth + "]" * depth)
    document = json.loads(_review("u-deep", {"nvidia.com/gpu": "1"}))
    resources = document["request"]["object"]["spec"]["containers"][0]["resources"]
    resources["requests"]["nvidia.com/gpumem"] = nested
    body = json.dumps(document).encode()
    for path in ("/mutate-pods", "/validate-pods"):
        status, text = _post_raw(webhook, body, path)
        assert status in (200, 400), text
        if status == 200:
            assert json.loads(text)["response"]["uid"] == "u-deep"


def test_concurrent_requests_while_a_client_stalls_before_tls(webhook: Webhook) -> None:
    stalled = socket.create_connection(("127.0.0.1", webhook.server.port))  # never handshakes
    try:
        with ThreadPoolExecutor(max_workers=16) as pool:
            results = list(
                pool.map(
                    lambda i: webhook.post(_review(f"u-{i}", {"nvidia.com/mig-3g.40gb": 1})),
                    range(64),
                )
            )
    finally:
        stalled.close()
    assert [a["response"]["uid"] for _, a in results] == [f"u-{i}" for i in range(64)]
    assert all(status == 200 and "patch" in a["response"] for status, a in results)
    assert webhook.lease_reads == 1  # cached


def test_stop_closes_kept_alive_connections(webhook: Webhook) -> None:
    conn = webhook.connect()
    try:
        assert webhook.post(_review("u-1", {"cpu": "1"}), conn)[0] == 200
        webhook.server.stop()
        with pytest.raises((OSError, http.client.HTTPException)):
            webhook.post(_review("u-2", {"cpu": "1"}), conn)
    finally:
        conn.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", webhook.server.port), timeout=2).close()


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _served_cert(webhook: Webhook) -> bytes:
    """The certificate (DER) a new TLS connection is served."""
    conn = webhook.connect()
    try:
        conn.connect()
        assert isinstance(conn.sock, ssl.SSLSocket)
        der = conn.sock.getpeercert(binary_form=True)
        assert der is not None
        return der
    finally:
        conn.close()


def _der(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def _swap(target: certs.KeyPair, source: certs.KeyPair, *, key: bool = True) -> None:
    """Replace the served files as a renewal does (new files renamed over the old)."""
    pairs = [(source.cert, target.cert)] + ([(source.key, target.key)] if key else [])
    for new, old in pairs:
        staged = old.with_suffix(".new")
        staged.write_bytes(new.read_bytes())
        staged.replace(old)


def test_a_rotated_certificate_is_served_without_a_restart(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """cert-manager renews the Secret and the kubelet swaps the files: new connections get the
    new certificate after the next check; a pair that does not load (the certificate renewed
    before its key) keeps the last good one, with a warning, until the pair is whole."""
    ca = certs.CertificateAuthority(tmp_path)
    served = ca.issue("served", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    first = served.cert.read_bytes()
    renewed = ca.issue("renewed", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    clock = _Clock()
    settings = serving.Settings(
        tls=serving.TlsSettings(cert_file=served.cert, key_file=served.key),
        host="127.0.0.1",
        port=0,
        connection_timeout_s=5.0,
        cert_check_s=10.0,
    )
    api = kubememory.InMemoryServer()
    freshness = leases.Freshness(_stored_lease(api), cache_s=2.0, clock=lambda: 100.0)
    with serving.WebhookServer(settings, freshness=freshness, clock=clock) as server:
        webhook = Webhook(server, api, ca.pair.cert)
        original = ssl.PEM_cert_to_DER_cert(first.decode())
        assert _served_cert(webhook) == original

        # The certificate is renewed, its key not yet: the pair does not load.
        _swap(served, renewed, key=False)
        assert _served_cert(webhook) == original  # not looked at before the interval
        clock.now += 10.0
        with caplog.at_level("WARNING", logger="migpilot.webhook"):
            assert _served_cert(webhook) == original
            assert _served_cert(webhook) == original
        warnings = [r for r in caplog.records if "does not load" in r.getMessage()]
        assert len(warnings) == 1, "one warning per broken pair, not per connection"
        assert server.certs.reloads == 0

        # The key follows: the next check loads the renewed pair; reviews still work.
        _swap(served, renewed)
        clock.now += 10.0
        assert _served_cert(webhook) == _der(renewed.cert)
        assert server.certs.reloads == 1
        status, answer = webhook.post(_review("u-after", {"nvidia.com/mig-1g.10gb": "1"}))
        assert status == 200 and answer["response"]["uid"] == "u-after"

        # Unchanged files are not loaded again.
        clock.now += 100.0
        assert _served_cert(webhook) == _der(renewed.cert)
        assert server.certs.reloads == 1


def test_a_certificate_that_does_not_load_stops_the_start(tmp_path: Path) -> None:
    ca = certs.CertificateAuthority(tmp_path)
    pair = ca.issue("a", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    other = ca.issue("b", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    settings = serving.Settings(
        tls=serving.TlsSettings(cert_file=pair.cert, key_file=other.key), port=0
    )
    lease = _stored_lease(kubememory.InMemoryServer())
    with pytest.raises(errors.MigpilotError, match=r"^the serving certificate .*a\.crt and key "):
        serving.WebhookServer(settings, freshness=leases.Freshness(lease, cache_s=2.0))


# --- limits: the whole request's deadline, the most connections served at once ---------------


@pytest.fixture
def limited(tmp_path: Path) -> Iterator[Webhook]:
    """A webhook with a short deadline (1 s) and room for two connections."""
    ca = certs.CertificateAuthority(tmp_path)
    pair = ca.issue("webhook", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    api = kubememory.InMemoryServer()
    freshness = leases.Freshness(_stored_lease(api), cache_s=2.0, clock=lambda: 100.0)
    settings = serving.Settings(
        tls=serving.TlsSettings(cert_file=pair.cert, key_file=pair.key),
        host="127.0.0.1",
        port=0,
        connection_timeout_s=30.0,
        request_timeout_s=1.0,
        max_connections=2,
    )
    with serving.WebhookServer(settings, freshness=freshness) as server:
        yield Webhook(server, api, ca.pair.cert)


def _tls(webhook: Webhook) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", webhook.server.port), timeout=10)
    return webhook.context.wrap_socket(raw, server_hostname="127.0.0.1")


def _trickle(conn: socket.socket, data: bytes, *, every_s: float, within_s: float) -> float:
    """Send ``data`` a byte every ``every_s`` until the server cuts the connection; the seconds
    it took. Fails if the server has not cut it after ``within_s``."""
    started = time.monotonic()
    for byte in data:
        try:
            conn.sendall(bytes([byte]))
        except OSError:
            return time.monotonic() - started
        if time.monotonic() - started > within_s:
            break
        time.sleep(every_s)
    # Everything sent, or time is up: the server must have closed its end by now.
    conn.settimeout(max(0.1, within_s - (time.monotonic() - started)))
    try:
        got = conn.recv(4096)
    except TimeoutError:
        pytest.fail(f"the connection was not cut within {within_s} s")
    except OSError:
        return time.monotonic() - started
    assert got == b"", f"the slow request was answered: {got!r}"
    return time.monotonic() - started


_SLOW_BODY = _review("u-slow", {"nvidia.com/mig-1g.10gb": "1"})


@pytest.mark.parametrize("part", ["headers", "body"])
def test_a_client_sending_a_byte_at_a_time_is_cut_at_the_deadline(
    limited: Webhook, part: str
) -> None:
    """Slowloris: each byte comes well inside the idle timeout (30 s), but the whole request
    has 1 s. The request would take 40 s; the connection is cut long before."""
    head = (
        f"POST /mutate-pods HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(_SLOW_BODY)}\r\n\r\n"
    ).encode()
    conn = _tls(limited)
    try:
        if part == "body":
            conn.sendall(head)
            data = _SLOW_BODY
        else:
            data = head + _SLOW_BODY
        took = _trickle(conn, data[:400], every_s=0.1, within_s=15.0)
    finally:
        conn.close()
    assert took >= 0.9  # not before its deadline
    # Served again as soon as the slow one is gone.
    assert limited.post(_review("u-next", {"cpu": "1"}))[0] == 200


def test_a_client_trickling_its_tls_handshake_is_cut_at_the_deadline(limited: Webhook) -> None:
    conn = socket.create_connection(("127.0.0.1", limited.server.port), timeout=10)
    try:
        hello = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)) * 2
        _trickle(conn, hello, every_s=0.1, within_s=15.0)
    finally:
        conn.close()


def test_a_kept_alive_connection_gets_a_fresh_deadline_per_request(limited: Webhook) -> None:
    """The deadline runs from a request's first byte: waiting idle between requests (up to the
    idle timeout) is not held against the next one."""
    conn = limited.connect()
    try:
        assert limited.post(_review("u-1", {"cpu": "1"}), conn)[0] == 200
        time.sleep(1.5)  # longer than the deadline, shorter than the idle timeout
        assert limited.post(_review("u-2", {"cpu": "1"}), conn)[0] == 200
    finally:
        conn.close()


def _closed_unserved(conn: socket.socket) -> bool:
    """Whether the server closed ``conn`` without a TLS handshake."""
    try:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        context.wrap_socket(conn).close()
    except (OSError, ssl.SSLError):
        return True
    return False


def test_connections_over_the_most_are_closed_unserved(limited: Webhook) -> None:
    """Two connections held open (kept alive, idle): a third, and many more, are closed at
    accept without a thread each; once one of the two goes, new connections are served."""
    threads_before = threading.active_count()
    held = [limited.connect() for _ in range(2)]
    try:
        for n, conn in enumerate(held):
            assert limited.post(_review(f"u-{n}", {"cpu": "1"}), conn)[0] == 200
        extra = [
            socket.create_connection(("127.0.0.1", limited.server.port), timeout=10)
            for _ in range(30)
        ]
        try:
            assert all(_closed_unserved(conn) for conn in extra)
        finally:
            for conn in extra:
                conn.close()
        assert limited.server.refused == 30
        assert threading.active_count() <= threads_before + 2
        with pytest.raises((OSError, http.client.HTTPException)):
            limited.post(_review("u-over", {"cpu": "1"}))
    finally:
        held[0].close()
    try:
        deadline = time.monotonic() + 10
        while True:  # the server notices the close at its next read
            try:
                assert limited.post(_review("u-again", {"cpu": "1"}))[0] == 200
                break
            except (OSError, http.client.HTTPException):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    finally:
        held[1].close()


def test_limit_settings_are_checked(tmp_path: Path) -> None:
    ca = certs.CertificateAuthority(tmp_path)
    pair = ca.issue("a", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    settings = serving.Settings(
        tls=serving.TlsSettings(cert_file=pair.cert, key_file=pair.key), port=0, max_connections=0
    )
    lease = _stored_lease(kubememory.InMemoryServer())
    with pytest.raises(errors.MigpilotError, match="max_connections must be at least 1"):
        serving.WebhookServer(settings, freshness=leases.Freshness(lease, cache_s=2.0))
