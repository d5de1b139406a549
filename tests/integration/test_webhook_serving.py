"""The webhook's HTTPS server on loopback with a certificate from a throwaway CA: health, the
review round trip on both paths (gating on /mutate-pods, refusing a malformed unified request on
/validate-pods), malformed bodies still allowed, keep-alive, concurrent clients (one stuck before
its TLS handshake blocks nobody), and stop() really closing open connections."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import ssl
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from migpilot import errors
from migpilot.webhook import leases, serving
from tests.kube import certs

LEASE = {
    "spec": {
        "holderIdentity": "controller-0",
        "renewTime": "1970-01-01T00:01:40Z",
        "leaseDurationSeconds": 15,
    }
}


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
    def __init__(self, server: serving.WebhookServer, lease: leases.StaticLease, ca: Path) -> None:
        self.server = server
        self.lease = lease
        self.context = ssl.create_default_context(cafile=ca)

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
    lease = leases.StaticLease(LEASE)
    freshness = leases.Freshness(lease, cache_s=2.0, clock=lambda: 100.0)
    settings = serving.Settings(
        tls=serving.TlsSettings(cert_file=pair.cert, key_file=pair.key),
        host="127.0.0.1",
        port=0,
        connection_timeout_s=5.0,
    )
    with serving.WebhookServer(settings, freshness=freshness) as server:
        yield Webhook(server, lease, ca.pair.cert)


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
    assert webhook.lease.reads == 0  # refusing does not depend on the controller


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
        status, answer = webhook.post(b"{not json", conn, path="/validate-pods")
        assert status == 200
        assert answer["response"]["allowed"] is True
        assert "not validated" in answer["response"]["status"]["message"]
    finally:
        conn.close()


def test_missing_lease_lets_mig_pods_through(webhook: Webhook) -> None:
    webhook.lease.lease = None  # before the first request: nothing cached yet
    status, answer = webhook.post(_review("u-1", {"nvidia.com/mig-1g.10gb": "1"}))
    assert status == 200
    assert answer["response"] == {"uid": "u-1", "allowed": True}
    assert webhook.lease.reads == 1


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[]", b""])
def test_malformed_bodies_are_allowed_with_a_message(webhook: Webhook, body: bytes) -> None:
    status, answer = webhook.post(body)
    assert status == 200
    assert answer["response"]["allowed"] is True
    assert "admitted without a gate" in answer["response"]["status"]["message"]


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
    assert webhook.lease.reads == 1  # cached


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
    lease = leases.StaticLease(LEASE)
    freshness = leases.Freshness(lease, cache_s=2.0, clock=lambda: 100.0)
    with serving.WebhookServer(settings, freshness=freshness, clock=clock) as server:
        webhook = Webhook(server, lease, ca.pair.cert)
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
    lease = leases.StaticLease(LEASE)
    with pytest.raises(errors.MigpilotError, match=r"^the serving certificate .*a\.crt and key "):
        serving.WebhookServer(settings, freshness=leases.Freshness(lease, cache_s=2.0))
