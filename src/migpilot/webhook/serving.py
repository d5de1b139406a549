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

The serving certificate is reloaded when its files change (:class:`CertReloader`): cert-manager
renews the Secret, the kubelet swaps the mounted files, and new connections get the new
certificate without a restart. Without that, the old certificate would be served until it
expired, and from then on every webhook call would fail TLS verification and fail open: pods
created ungated, migpilot bypassed with no error anywhere but the apiserver's log. A pair that
does not load (the key written before the certificate, a truncated file) keeps the last good
one, with a warning, and is tried again at the next check.

May import the pure core and the rest of the webhook; not the agent, nor a Kubernetes client
(that is :mod:`~migpilot.webhook.leases`' job).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any

from migpilot import errors
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
    cert_check_s: float = 10.0
    """Seconds between two looks at the certificate files for a rotation; default 10."""


def tls_context(tls: TlsSettings) -> ssl.SSLContext:
    """The server's TLS context: TLS 1.2 or later, the configured certificate."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    return context


_Stamp = tuple[tuple[int, int, int], ...]


def _stamp(tls: TlsSettings) -> _Stamp:
    """What changes when either file is replaced: (inode, size, mtime) of each, links followed
    (the kubelet swaps a Secret volume's ``..data`` link, so the files are new inodes)."""
    out = []
    for path in (tls.cert_file, tls.key_file):
        st = os.stat(path)
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


class CertReloader:
    """The TLS context of the serving certificate as its files are now (see the module).

    :meth:`context` is called for every new connection; it looks at the files at most every
    ``check_s`` seconds (a ``stat`` of each) and builds a new context only when they changed.
    The first load happens here and raises :class:`~migpilot.errors.MigpilotError` naming the
    files: a bad certificate must stop the server's start.
    Thread-safe."""

    def __init__(
        self,
        tls: TlsSettings,
        *,
        check_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._tls = tls
        self._check_s = check_s
        self._clock = clock
        self._lock = threading.Lock()
        try:
            self._loaded = _stamp(tls)
            self._context = tls_context(tls)
        except (OSError, ssl.SSLError) as err:
            raise errors.MigpilotError(
                f"the serving certificate {tls.cert_file} and key {tls.key_file} do not load: "
                f"{getattr(err, 'strerror', None) or err}"
            ) from None
        self._checked = clock()
        self._failed: _Stamp | None = None
        self.reloads = 0
        """Certificates loaded since the first (for tests and logs)."""

    def context(self) -> ssl.SSLContext:
        """The context to serve the next connection with."""
        with self._lock:
            now = self._clock()
            if now - self._checked >= self._check_s:
                self._checked = now
                self._check()
            return self._context

    def _check(self) -> None:
        try:
            stamp = _stamp(self._tls)
        except OSError as err:
            self._warn(None, f"cannot read it ({err.strerror or err})")
            return
        if stamp == self._loaded:
            return
        try:
            context = tls_context(self._tls)
        except (OSError, ssl.SSLError) as err:
            self._warn(stamp, str(err))
            return
        self._context, self._loaded, self._failed = context, stamp, None
        self.reloads += 1
        _log.info("serving certificate %s reloaded (changed on disk)", self._tls.cert_file)

    def _warn(self, stamp: _Stamp | None, why: str) -> None:
        if stamp is None or stamp != self._failed:
            _log.warning(
                "serving certificate %s / %s changed but does not load (%s); serving the last "
                "good one, trying again in %g s",
                self._tls.cert_file,
                self._tls.key_file,
                why,
                self._check_s,
            )
        self._failed = stamp


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
        certs: CertReloader,
        freshness: leases.Freshness,
        connection_timeout_s: float,
    ) -> None:
        self.certs = certs
        self.freshness = freshness
        self.connection_timeout_s = connection_timeout_s
        self._open: set[ssl.SSLSocket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the connection's thread: the TLS handshake, then HTTP."""
        request.settimeout(self.connection_timeout_s)
        try:
            conn = self.certs.context().wrap_socket(request, server_side=True)
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

    def __init__(
        self,
        settings: Settings,
        *,
        freshness: leases.Freshness,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.certs = CertReloader(settings.tls, check_s=settings.cert_check_s, clock=clock)
        self._server = _Server(
            (settings.host, settings.port),
            certs=self.certs,
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
