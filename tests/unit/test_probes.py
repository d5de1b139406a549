"""The HTTP endpoint of the controller and the agent: /metrics, /healthz, /readyz over real HTTP."""

from __future__ import annotations

import urllib.error
import urllib.request

import prometheus_client
import pytest

from migpilot import probes


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.read().decode()


def test_a_heartbeat_fails_once_the_loop_has_stalled_longer_than_the_limit() -> None:
    clock = _Clock()
    beat = probes.Heartbeat(clock, stall_s=30)
    assert beat.check() is None
    clock.now += 30
    assert beat.check() is None
    clock.now += 1
    assert beat.check() == "the main loop has not gone round for 31 s (limit 30 s)"
    beat.beat()
    assert beat.check() is None
    with pytest.raises(ValueError, match="stall_s"):
        probes.Heartbeat(clock, stall_s=0)


def test_the_endpoint_serves_metrics_and_probes_that_ask_the_process() -> None:
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("migpilot_things", "things", registry=registry).inc(3)
    clock = _Clock()
    beat = probes.Heartbeat(clock, stall_s=10)
    state = {"ready": "not yet listed: pods"}

    def broken() -> str | None:
        raise RuntimeError("boom")

    endpoint = probes.Endpoint(
        registry, port=0, address="127.0.0.1", live=beat.check, ready=lambda: state["ready"]
    )
    try:
        port = endpoint.port
        assert _get(port, "/healthz") == (200, "ok\n")
        assert _get(port, "/readyz") == (503, "not yet listed: pods\n")
        state["ready"] = None  # type: ignore[assignment]
        assert _get(port, "/readyz") == (200, "ok\n")
        clock.now += 11
        status, body = _get(port, "/healthz")
        assert status == 503 and "11 s" in body
        for path in ("/metrics", "/"):
            status, body = _get(port, path)
            assert status == 200 and "migpilot_things_total 3.0" in body
        status, body = _get(port, "/nope")
        assert status == 404 and "/healthz" in body
    finally:
        endpoint.close()
    failing = probes.Endpoint(registry, port=0, address="127.0.0.1", live=broken)
    try:
        assert _get(failing.port, "/healthz") == (503, "the probe failed: boom\n")
    finally:
        failing.close()
