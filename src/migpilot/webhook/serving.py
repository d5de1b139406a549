"""The webhook's HTTPS server: ``POST /mutate-pods``, ``POST /validate-pods``, ``GET /healthz``.

A thin shell: it decodes the AdmissionReview and calls a pure function, encoding its answer:
for ``/mutate-pods`` it asks :mod:`migpilot.webhook.leases` whether the controller is alive and
calls :func:`migpilot.webhook.admission.review` (which gates, never refuses); for
``/validate-pods`` it calls :func:`migpilot.webhook.validation.review` (which refuses a
malformed unified request, whether or not the controller is alive: the request is malformed
either way). It never answers an admission request with an HTTP error: a body that is not JSON
gets an allowing review with a message, as the pure functions give for any malformed review.

The standard library's threading HTTP server, one thread per connection, so the apiserver's
concurrent calls are served at once; the TLS handshake runs in the connection's thread (not in
the accept loop, where one slow client would stall every other). HTTP/1.1 keep-alive, because
the apiserver reuses its connections. Stopping the server also closes the connections it holds,
so a stopped webhook is really gone (the apiserver then fails open).

May import the pure core and the rest of the webhook; not the agent, nor a Kubernetes client
(that is :mod:`~migpilot.webhook.leases`' job).
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import ssl
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from migpilot.webhook import admission, leases, registering, validation

_log = logging.getLogger("migpilot.webhook")

MUTATE_PATH = registering.MUTATE_PATH
VALIDATE_PATH = registering.VALIDATE_PATH
HEALTH_PATH = "/healthz"
MAX_BODY_BYTES = 8 << 20
"""Largest AdmissionReview accepted; a pod is at most ~1.5 MiB in etcd."""


@dataclass(frozen=True)
class TlsSettings:
    cert_file: Path
    """PEM serving certificate (chain) the apiserver verifies against the caBundle."""
    key_file: Path
    """PEM private key of ``cert_file``."""


@dataclass(frozen=True)
class LeaseSettings:
    name: str = "migpilot-controller"
    """The controller's Lease (coordination.k8s.io/v1); default ``migpilot-controller``."""
    namespace: str = "migpilot-system"
    """Namespace of the Lease; default ``migpilot-system``."""
    cache_s: float = 2.0
    """Seconds a Lease read is reused before reading it again; default 2."""
    kubeconfig: Path | None = None
    """Kubeconfig to read the Lease with; None (default) means the in-cluster service account."""


@dataclass(frozen=True)
class Settings:
    tls: TlsSettings
    """The serving certificate and key."""
    lease: LeaseSettings = field(default_factory=LeaseSettings)
    """Which Lease says the controller is alive, and how often to read it."""
    host: str = "0.0.0.0"
    """Address to listen on; default all IPv4 addresses."""
    port: int = 9443
    """TCP port to listen on (0 picks a free one); default 9443."""
    connection_timeout_s: float = 30.0
    """Seconds a connection may stay idle (or take for its TLS handshake); default 30."""


def tls_context(tls: TlsSettings) -> ssl.SSLContext:
    """The server's TLS context: TLS 1.2 or later, the configured certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        if self.path == HEALTH_PATH:
            self._send(200, b"ok", "text/plain")
        else:
            self._send(404, b"not found", "text/plain")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0]
        if path not in (MUTATE_PATH, VALIDATE_PATH):
            self._send(404, b"not found", "text/plain")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._send(411, b"Content-Length required", "text/plain")
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self._send(413, b"request too large", "text/plain")
            return
        body = self.rfile.read(length)
        document: Any
        try:
            document = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            document = None  # review() answers it as malformed, allowing
        if path == MUTATE_PATH:
            answer = admission.review(document, lease_fresh=self.server.freshness.fresh())
            response = answer.get("response", {})
            said = "patched" if "patch" in response else "-"
        else:
            answer = validation.review(document)
            response = answer.get("response", {})
            said = "allowed" if response.get("allowed") else "refused"
        _log.debug("review %s %s: %s", path, response.get("uid"), said)
        self._send(200, json.dumps(answer).encode(), "application/json")

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s " + format, self.address_string(), *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        context: ssl.SSLContext,
        freshness: leases.Freshness,
        connection_timeout_s: float,
    ) -> None:
        self.context = context
        self.freshness = freshness
        self.connection_timeout_s = connection_timeout_s
        self._open: set[ssl.SSLSocket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the connection's thread: the TLS handshake, then HTTP."""
        request.settimeout(self.connection_timeout_s)
        try:
            conn = self.context.wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as err:
            _log.debug("TLS handshake with %s failed: %s", client_address, err)
            return
        with self._open_lock:
            self._open.add(conn)
        try:
            _Handler(conn, client_address, self)  # timeout: the socket's, set above
        except OSError as err:  # the peer went away, or stop() closed the connection
            _log.debug("connection from %s ended: %s", client_address, err)
        finally:
            with self._open_lock:
                self._open.discard(conn)
            self.shutdown_request(conn)

    def close_connections(self) -> None:
        with self._open_lock:
            conns = list(self._open)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


class WebhookServer:
    """The HTTPS server, started in a background thread; stop it with :meth:`stop`."""

    def __init__(self, settings: Settings, *, freshness: leases.Freshness) -> None:
        self._server = _Server(
            (settings.host, settings.port),
            context=tls_context(settings.tls),
            freshness=freshness,
            connection_timeout_s=settings.connection_timeout_s,
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how long stop() may wait for the loop to notice
            name="migpilot-webhook",
            daemon=True,
        )

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, when settings asked for 0)."""
        return int(self._server.server_address[1])

    def start(self) -> WebhookServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close open connections, release the port."""
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.close_connections()
        self._server.server_close()

    def __enter__(self) -> WebhookServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run(settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT: the ``migpilot webhook`` command."""
    source = leases.KubeLease.connect(
        settings.lease.kubeconfig, name=settings.lease.name, namespace=settings.lease.namespace
    )
    freshness = leases.Freshness(source, cache_s=settings.lease.cache_s)
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with WebhookServer(settings, freshness=freshness) as server:
            _log.info(
                "serving %s and %s on %s:%d (Lease %s/%s)",
                MUTATE_PATH,
                VALIDATE_PATH,
                settings.host,
                server.port,
                settings.lease.namespace,
                settings.lease.name,
            )
            stopping.wait()
            _log.info("stopping")
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
