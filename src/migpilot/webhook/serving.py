"""The webhook's HTTPS server: ``POST /mutate-pods``, ``POST /validate-pods``, ``GET /healthz``.

A thin shell: it decodes the AdmissionReview and calls a pure function, encoding its answer:
for ``/mutate-pods`` it asks :mod:`migpilot.webhook.leases` whether the controller is alive and
calls :func:`migpilot.webhook.admission.review` (which gates, never refuses); for
``/validate-pods`` it calls :func:`migpilot.webhook.validation.review` (which refuses a
malformed unified request, whether or not the controller is alive: the request is malformed
either way). A body that is not JSON, or JSON nested deeper than Python's parser recurses
(a 100 KB run of ``[``), is answered ``400`` with a one-line reason: the apiserver never sends
one, and the connection must not drop unanswered. A review that is JSON but not what the API
promises gets an allowing review with a message, as the pure functions give.

The standard library's threading HTTP server, one thread per connection, so the apiserver's
concurrent calls are served at once; the TLS handshake runs in the connection's thread (not in
the accept loop, where one slow client would stall every other). HTTP/1.1 keep-alive, because
the apiserver reuses its connections. Stopping the server also closes the connections it holds,
so a stopped webhook is really gone (the apiserver then fails open).

Bounded, because anyone who reaches the port can call it: at most ``max_connections``
connections are served at once (one more is closed at accept, before its TLS handshake, so no
thread is started for it), and each request has a deadline for the whole of it, from its first
byte (for a new connection, from the accept: the handshake counts) to the last byte of its body
(:class:`_DeadlineReader`): a client sending a byte a second is cut at the deadline, however
short each pause. A maintained ASGI server (uvicorn) would give the same limits, but not the
per-connection choice of certificate that :class:`CertReloader` needs, and a new runtime
dependency; the limits here are a semaphore and a socket timeout recomputed before each read.

The serving certificate is reloaded when its files change (:class:`CertReloader`): cert-manager
renews the Secret, the kubelet swaps the mounted files, and new connections get the new
certificate without a restart. Without that, the old certificate would be served until it
expired, and from then on every webhook call would fail TLS verification and fail open: pods
created ungated, migpilot bypassed with no error anywhere but the apiserver's log. A pair that
does not load (the key written before the certificate, a truncated file) keeps the last good
one, with a warning, and is tried again at the next check.

Measured (:mod:`migpilot.webhook.metrics`): each review request is counted once, by path and
outcome, with its duration, where the handler finishes it (:meth:`_Handler.handle_one_request`);
connections refused at accept, connections cut at the deadline and certificate reloads where
they happen. With ``metrics_port`` set, :func:`run` serves them over plain HTTP on a port of
their own (:mod:`migpilot.probes`, beside ``/healthz`` and ``/readyz``), apart from the TLS
port, as controller-runtime serves a webhook's: a scrape or a probe never takes one of the
``max_connections`` the apiserver needs.

May import the pure core and the rest of the webhook; not the agent, nor a Kubernetes client
(that is :mod:`~migpilot.webhook.leases`' job).
"""

from __future__ import annotations

import contextlib
import io
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

from migpilot import errors, logs, probes
from migpilot.webhook import admission, claims, leases, registering, reviews, validation
from migpilot.webhook import metrics as webhook_metrics

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
    """Seconds a kept-alive connection may wait idle for its next request; default 30."""
    request_timeout_s: float = 10.0
    """Seconds a whole request may take, from its first byte to its body's last (for a new
    connection, from the accept, TLS handshake included); a slower client is cut off; default
    10 (the apiserver gives up on a webhook call after its ``timeoutSeconds``, 5)."""
    max_connections: int = 64
    """Connections served at once; one more is closed at accept, unserved; default 64."""
    cert_check_s: float = 10.0
    """Seconds between two looks at the certificate files for a rotation; default 10."""
    metrics_port: int | None = None
    """Plain-HTTP port of ``/metrics``, ``/healthz`` and ``/readyz`` (0 picks a free one);
    ``None`` (default): not served."""
    metrics_host: str = "0.0.0.0"
    """Address of the metrics port; default all IPv4 addresses."""


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
        on_reload: Callable[[webhook_metrics.CertOutcome], None] = lambda outcome: None,
    ) -> None:
        self._tls = tls
        self._check_s = check_s
        self._clock = clock
        self._on_reload = on_reload
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
            self._on_reload(webhook_metrics.CertOutcome.FAILED)
            return
        if stamp == self._loaded:
            return
        try:
            context = tls_context(self._tls)
        except (OSError, ssl.SSLError) as err:
            self._warn(stamp, str(err))
            self._on_reload(webhook_metrics.CertOutcome.FAILED)
            return
        self._context, self._loaded, self._failed = context, stamp, None
        self.reloads += 1
        self._on_reload(webhook_metrics.CertOutcome.LOADED)
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


class _DeadlineReader(io.RawIOBase):
    """The connection's reads, each with a timeout of what is left of the request's deadline
    (or, between requests, of the idle timeout): a socket timeout alone bounds one read, and a
    client sending a byte a second never meets it."""

    def __init__(
        self, sock: socket.socket, *, idle_s: float, clock: Callable[[], float], deadline: float
    ) -> None:
        self._sock = sock
        self._idle_s = idle_s
        self._clock = clock
        self.deadline: float | None = deadline
        """When the request being read must be whole; ``None`` between requests."""
        self.timed_out = False
        """Whether a read of the request running timed out (the connection is then cut); the
        handler reads and clears it when the request ends."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        timeout = self._idle_s
        if self.deadline is not None:
            left = self.deadline - self._clock()
            if left <= 0:
                self.timed_out = True
                raise TimeoutError("the request took longer than its deadline")
            timeout = min(timeout, left)
        self._sock.settimeout(timeout)
        try:
            return self._sock.recv_into(buffer)
        except TimeoutError:
            # Between requests it is the idle timeout: a kept-alive connection closed, not cut.
            self.timed_out = self.deadline is not None
            raise

    def left_s(self) -> float:
        """Seconds left before the deadline (the idle timeout when none is running)."""
        if self.deadline is None:
            return self._idle_s
        return max(0.0, self.deadline - self._clock())


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server
    _reader: _DeadlineReader
    _buffered: io.BufferedReader
    _review: str | None
    """The review path of the request being served; ``None`` when it is not a review."""
    _outcome: webhook_metrics.Outcome
    """How the request being served ended: :attr:`~webhook_metrics.Outcome.ERROR` until an
    answer is written."""

    def setup(self) -> None:
        super().setup()
        self.rfile.close()  # replaced: the same socket, read against the request's deadline
        self._reader = _DeadlineReader(
            self.connection,
            idle_s=self.server.connection_timeout_s,
            clock=self.server.clock,
            deadline=self.server.first_deadline(),
        )
        self._buffered = io.BufferedReader(self._reader)
        self.rfile = self._buffered

    def handle_one_request(self) -> None:
        if self._reader.deadline is None:  # kept alive: idle until the next request's first byte
            try:
                if not self._buffered.peek(1):
                    self.close_connection = True
                    return
            except TimeoutError:
                self.close_connection = True
                return
            self._reader.deadline = self.server.clock() + self.server.request_timeout_s
        started = self.server.clock()
        self._review, self._outcome = None, webhook_metrics.Outcome.ERROR
        try:
            super().handle_one_request()  # a timeout in it is caught there: the connection ends
        finally:
            self._reader.deadline = None
            self._measure(started)

    def _measure(self, started: float) -> None:
        """The one place a request is counted, however it ended (answered, cut at the deadline,
        the client gone, an error): its outcome and duration if it was a review, and whether it
        was cut at the deadline."""
        if self._reader.timed_out:
            self._reader.timed_out = False
            self.server.metrics.observe_timed_out()
        if self._review is not None:
            took = self.server.clock() - started
            self.server.metrics.observe_request(self._review, self._outcome, took)

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
        self._review = path
        bad = webhook_metrics.Outcome.BAD_REQUEST
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._reply(bad, 411, b"Content-Length required", "text/plain")
            return
        if not 0 <= length <= MAX_BODY_BYTES:
            self._reply(bad, 413, b"request too large", "text/plain")
            return
        body = self.rfile.read(length)  # TimeoutError past the deadline: the connection ends
        if len(body) < length:
            self.close_connection = True
            return  # the client closed before sending its body whole
        try:
            document, answer = _answer(
                path, body, freshness=self.server.freshness, reader=self.server.reader
            )
        except _BadRequestError as err:
            _log.debug("review %s: 400: %s", path, err)
            self._reply(bad, 400, f"{err}\n".encode(), "text/plain")
            return
        response = answer.get("response", {})
        if _log.isEnabledFor(logging.DEBUG):  # the line is only read with -v: no cost without
            pod, node = reviews.pod_and_node(document)
            _log.debug(
                "review %s %s: %s",
                path,
                response.get("uid"),
                _said(path, response),
                extra=logs.about(pod=pod, node=node),
            )
        outcome = webhook_metrics.review_outcome(response)
        self._reply(outcome, 200, json.dumps(answer).encode(), "application/json")

    def _reply(
        self, outcome: webhook_metrics.Outcome, code: int, body: bytes, content_type: str
    ) -> None:
        """Answer a review; it ends as ``outcome`` once the answer is written."""
        self._send(code, body, content_type)
        self._outcome = outcome

    def _send(self, code: int, body: bytes, content_type: str) -> None:
        self.connection.settimeout(max(self._reader.left_s(), 0.001))  # a reader that never reads
        try:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except TimeoutError:
            self._reader.timed_out = True  # the answer not taken before the deadline: cut
            raise

    def log_message(self, format: str, *args: Any) -> None:
        _log.debug("%s " + format, self.address_string(), *args)


class _BadRequestError(Exception):
    """The body cannot be read as JSON; carries the one-line reason sent with the 400."""


def _answer(
    path: str,
    body: bytes,
    *,
    freshness: leases.Freshness,
    reader: claims.ClaimReader | None = None,
) -> tuple[Any, Any]:
    """The decoded review and the AdmissionReview answering it on ``path``; raises
    :class:`_BadRequestError`. A pod's DRA claims are read with ``reader`` when reading them
    can change the answer (none read without one: such a pod is not gated)."""
    try:
        document = json.loads(body)
    except RecursionError:
        raise _BadRequestError(
            "the body is JSON nested too deeply to read (an AdmissionReview is a few levels deep)"
        ) from None
    except UnicodeDecodeError:
        raise _BadRequestError("the body is not UTF-8 JSON") from None
    except ValueError as err:
        raise _BadRequestError(f"the body is not JSON ({err})") from None
    try:
        if path == MUTATE_PATH:
            lease = freshness.state()
            wanted = admission.to_read(
                document, lease_fresh=lease.fresh, gate_whole=lease.dynamic_mig
            )
            found = reader.read(wanted) if wanted and reader is not None else {}
            return document, admission.review(
                document, lease_fresh=lease.fresh, gate_whole=lease.dynamic_mig, claims=found
            )
        return document, validation.review(document)
    except RecursionError:  # a value nested deep enough that telling of it recursed too far
        raise _BadRequestError("the review holds a value nested too deeply to read") from None


def _said(path: str, response: Any) -> str:
    if path == MUTATE_PATH:
        return "patched" if "patch" in response else "-"
    return "allowed" if response.get("allowed") else "refused"


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        *,
        certs: CertReloader,
        freshness: leases.Freshness,
        settings: Settings,
        metrics: webhook_metrics.WebhookMetrics,
        reader: claims.ClaimReader | None = None,
    ) -> None:
        self.certs = certs
        self.freshness = freshness
        self.reader = reader
        self.metrics = metrics
        self.connection_timeout_s = settings.connection_timeout_s
        self.request_timeout_s = settings.request_timeout_s
        self.clock = time.monotonic  # deadlines are real time, whatever clock the certificates use
        self.max_connections = settings.max_connections
        self.refused = 0
        """Connections closed at accept because ``max_connections`` were being served."""
        self._slots = threading.BoundedSemaphore(settings.max_connections)
        self._refused_told = -1.0
        self._accepted = threading.local()
        self._open: set[ssl.SSLSocket] = set()
        self._open_lock = threading.Lock()
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accept loop: a thread for the connection if a slot is free, else close it."""
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.metrics.observe_refused()
            now = self.clock()
            if self._refused_told < 0 or now - self._refused_told >= 10.0:
                self._refused_told = now
                _log.warning(
                    "%d connections open, the most served at once: closing new ones unserved "
                    "(%d so far)",
                    self.max_connections,
                    self.refused,
                )
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def first_deadline(self) -> float:
        """The deadline of the connection's first request (set at accept, in its thread)."""
        return float(self._accepted.deadline)

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the connection's thread: the TLS handshake, then HTTP."""
        deadline = self.clock() + self.request_timeout_s
        self._accepted.deadline = deadline
        # The handshake is one call: the timeout bounds all of it, not each read.
        request.settimeout(min(self.connection_timeout_s, self.request_timeout_s))
        try:
            conn = self.certs.context().wrap_socket(request, server_side=True)
        except (OSError, ssl.SSLError) as err:
            _log.debug("TLS handshake with %s failed: %s", client_address, err)
            if isinstance(err, TimeoutError):  # the first request's deadline ran out in it
                self.metrics.observe_timed_out()
            return
        with self._open_lock:
            self._open.add(conn)
        try:
            _Handler(conn, client_address, self)  # reads against the deadline (_DeadlineReader)
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
    """The HTTPS server, started in a background thread; stop it with :meth:`stop`. It counts
    into ``metrics`` (a :class:`~migpilot.webhook.metrics.WebhookMetrics` of its own when none
    is given)."""

    def __init__(
        self,
        settings: Settings,
        *,
        freshness: leases.Freshness,
        clock: Callable[[], float] = time.monotonic,
        metrics: webhook_metrics.WebhookMetrics | None = None,
        reader: claims.ClaimReader | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else webhook_metrics.WebhookMetrics()
        self.certs = CertReloader(
            settings.tls,
            check_s=settings.cert_check_s,
            clock=clock,
            on_reload=self.metrics.observe_cert_reload,
        )
        if settings.max_connections < 1:
            raise errors.MigpilotError(
                f"max_connections must be at least 1, got {settings.max_connections}"
            )
        self._server = _Server(
            (settings.host, settings.port),
            certs=self.certs,
            freshness=freshness,
            settings=settings,
            metrics=self.metrics,
            reader=reader,
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.1},  # how long stop() may wait for the loop to notice
            name="migpilot-webhook",
            daemon=True,
        )
        self._stopped = False

    @property
    def refused(self) -> int:
        """Connections closed at accept, unserved, because the most were open."""
        return self._server.refused

    @property
    def port(self) -> int:
        """The port it listens on (the one picked, when settings asked for 0)."""
        return int(self._server.server_address[1])

    def not_alive(self) -> str | None:
        """The liveness probe (:mod:`migpilot.probes`): ``None`` while the serving thread runs."""
        if self._thread.is_alive():
            return None
        if self._stopped:
            return "the HTTPS server is stopped"
        if self._thread.ident is None:
            return "the HTTPS server is not started yet"
        return "the HTTPS server's thread has ended"

    def not_ready(self) -> str | None:
        """The readiness probe: ``None`` once the TLS listener is bound, a certificate loaded
        (both done before the server exists: a bad pair stops the start) and the serving
        thread accepting."""
        if self._server.socket.fileno() < 0:
            return "the HTTPS listener is closed"
        return self.not_alive()

    def start(self) -> WebhookServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, close open connections, release the port."""
        self._stopped = True
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join()
        self._server.close_connections()
        self._server.server_close()

    def __enter__(self) -> WebhookServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_metrics(server: WebhookServer, settings: Settings) -> probes.Endpoint | None:
    """``/metrics``, ``/healthz`` and ``/readyz`` of ``server`` on ``settings.metrics_port``
    over plain HTTP (``None`` when it is ``None``); a port that cannot be bound is a
    :class:`~migpilot.errors.MigpilotError` naming it."""
    if settings.metrics_port is None:
        return None
    try:
        endpoint = probes.Endpoint(
            server.metrics.registry,
            port=settings.metrics_port,
            address=settings.metrics_host,
            live=server.not_alive,
            ready=server.not_ready,
        )
    except OSError as err:
        raise errors.MigpilotError(
            f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
            f"{err.strerror or err}"
        ) from None
    _log.info("metrics on http://%s:%d/metrics", settings.metrics_host, endpoint.port)
    return endpoint


def run(settings: Settings) -> None:
    """Serve until SIGTERM or SIGINT: the ``migpilot webhook`` command."""
    api = leases.connect(settings.lease.kubeconfig)
    source = leases.KubeLease(api, name=settings.lease.name, namespace=settings.lease.namespace)
    freshness = leases.Freshness(source, cache_s=settings.lease.cache_s)
    reader = claims.ClaimReader(api)
    stopping = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with contextlib.ExitStack() as stack:
            server = stack.enter_context(
                WebhookServer(settings, freshness=freshness, reader=reader)
            )
            endpoint = serve_metrics(server, settings)
            if endpoint is not None:
                stack.callback(endpoint.close)
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
