"""The HTTP endpoint of a long-running migpilot process: ``/metrics``, ``/healthz``, ``/readyz``.

Why it exists: the kubelet restarts a container whose liveness probe fails and keeps traffic
and rollouts waiting on its readiness probe, but a process that only serves Prometheus metrics
answers 200 even when its main loop is wedged (a driver call that never returns, a deadlock).
The controller and the agent each serve their metrics here, beside two probes that ask the
process itself: ``/healthz`` fails (503, with the reason) when the main loop has not gone round
for too long, ``/readyz`` until the process has what it needs to act (the controller's caches
synced, the agent's first pass done). Any other path is 404; ``/metrics`` (and ``/``, as
``prometheus_client`` serves it) is the registry's text exposition.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import prometheus_client

Check = Callable[[], "str | None"]
"""A probe: ``None`` when healthy, else the reason it is not (sent in the 503's body)."""

HEALTH_PATH = "/healthz"
READY_PATH = "/readyz"
METRICS_PATH = "/metrics"


def ok() -> str | None:
    """A probe that always passes."""
    return None


class Heartbeat:
    """When a loop last went round, and whether that was too long ago (thread-safe enough: one
    float written by the loop, read by the server)."""

    def __init__(self, clock: Callable[[], float], *, stall_s: float) -> None:
        if stall_s <= 0:
            raise ValueError(f"stall_s must be more than 0, got {stall_s}")
        self._clock = clock
        self.stall_s = stall_s
        self._at = clock()

    def beat(self) -> None:
        """The loop went round."""
        self._at = self._clock()

    def check(self) -> str | None:
        """``None`` while the last beat is at most :attr:`stall_s` old."""
        since = self._clock() - self._at
        if since > self.stall_s:
            return f"the main loop has not gone round for {since:.0f} s (limit {self.stall_s:g} s)"
        return None


class Watches:
    """Which list/watch loops are down now, and since when (thread-safe: the agent's watches
    run in threads, the server reads from its own). ``/healthz`` fails while any is down, as
    client-go's informers report health from the watch itself: a process whose watch died
    serves from a cache that no longer changes."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._down: dict[str, tuple[float, str]] = {}

    def down(self, name: str, why: str) -> None:
        """The watch ``name`` failed (``why``); it stays down until :meth:`up`."""
        with self._lock:
            since = self._down.get(name, (self._clock(), ""))[0]
            self._down[name] = (since, why)

    def up(self, name: str) -> None:
        """The watch ``name`` listed again: it serves."""
        with self._lock:
            self._down.pop(name, None)

    def down_for(self) -> float:
        """Seconds the longest-down watch has been down (0 when all are up)."""
        with self._lock:
            oldest = min((since for since, _ in self._down.values()), default=None)
        return 0.0 if oldest is None else self._clock() - oldest

    def check(self) -> str | None:
        """``None`` while every watch is up, else which are down and why."""
        with self._lock:
            down = sorted(self._down.items())
        if not down:
            return None
        now = self._clock()
        return "; ".join(
            f"watch of {name} down for {now - since:.0f} s: {why}" for name, (since, why) in down
        )


def all_of(*checks: Check) -> Check:
    """One probe from several: the first problem found, ``None`` when all pass."""

    def check() -> str | None:
        for one in checks:
            problem = one()
            if problem is not None:
                return problem
        return None

    return check


def app(
    registry: prometheus_client.CollectorRegistry, *, live: Check, ready: Check
) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """The WSGI application behind :class:`Endpoint`."""
    metrics = prometheus_client.make_wsgi_app(registry)

    def handle(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO") or "/"
        if path in (HEALTH_PATH, READY_PATH):
            try:
                problem = (live if path == HEALTH_PATH else ready)()
            except Exception as err:  # a probe that fails is a failed probe, not a crash
                problem = f"the probe failed: {err}"
            status = "200 OK" if problem is None else "503 Service Unavailable"
            body = b"ok\n" if problem is None else f"{problem}\n".encode()
            start_response(status, [("Content-Type", "text/plain; charset=utf-8")])
            return [body]
        if path in (METRICS_PATH, "/"):
            result: Iterable[bytes] = metrics(environ, start_response)
            return result
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"no such path: {path}; try {METRICS_PATH}, {HEALTH_PATH}, {READY_PATH}\n".encode()]

    return handle


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """Probes every few seconds are not news."""


class Endpoint:
    """``/metrics``, ``/healthz`` and ``/readyz`` served from a thread until :meth:`close`."""

    def __init__(
        self,
        registry: prometheus_client.CollectorRegistry,
        *,
        port: int,
        address: str = "0.0.0.0",
        live: Check = ok,
        ready: Check = ok,
    ) -> None:
        self._server = make_server(
            address,
            port,
            app(registry, live=live, ready=ready),
            server_class=_Server,
            handler_class=_QuietHandler,
        )
        self.port: int = self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="migpilot-http", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop serving and free the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
