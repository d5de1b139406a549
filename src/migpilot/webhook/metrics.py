"""The webhook's Prometheus metrics, on a registry of its own.

Why it exists: the webhook fails open, so a webhook that answers nothing useful (every pod let
through ungated because the controller's Lease is stale, a flood of malformed bodies, clients
cut at the deadline, connections turned away at the ``--max-connections`` bound, a certificate
rotation that does not load) looks, from the apiserver's side, like a webhook that works. These
series say which it is. A registry of its own, never the global default, so several servers
(tests) can live in one process. This module defines the series and the pure rule that names a
review's outcome; :mod:`migpilot.webhook.serving` calls :meth:`WebhookMetrics.observe_request`
once per review request, where its handler finishes it, and counts the connection events where
they happen. No clock: the caller gives the durations.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import prometheus_client

from migpilot.webhook import registering

PATHS = (registering.MUTATE_PATH, registering.VALIDATE_PATH)
"""The review paths, the only values of the ``path`` label (bounded, whatever clients send)."""

REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: a review takes about a millisecond (a Lease read, when its cache is stale, a few);
the apiserver gives up at the webhook's ``timeoutSeconds`` (5), the server at its request
deadline (``--request-timeout``, 10)."""


class Outcome(enum.StrEnum):
    """How one review request ended (the ``outcome`` label)."""

    ALLOWED = "allowed"
    """Answered 200, allowed, with no patch."""
    DENIED = "denied"
    """Answered 200, refused (``/validate-pods``: a malformed unified request)."""
    PATCHED = "patched"
    """Answered 200, allowed with a non-empty patch (``/mutate-pods``: the gate added)."""
    BAD_REQUEST = "bad_request"
    """Answered 4xx: no Content-Length, a body too large, a body that is not JSON."""
    ERROR = "error"
    """Not answered: the client went away or was cut at the deadline before its answer, or
    answering failed."""


class CertOutcome(enum.StrEnum):
    """How one try to load a changed serving certificate ended (the ``outcome`` label)."""

    LOADED = "loaded"
    FAILED = "failed"


def review_outcome(response: Mapping[str, Any]) -> Outcome:
    """The outcome of a review answered 200 with ``response`` (the AdmissionReview's
    ``response``): refused, allowed with a patch that changes something, or allowed."""
    if response.get("allowed") is not True:
        return Outcome.DENIED
    if response.get("patch"):
        return Outcome.PATCHED
    return Outcome.ALLOWED


class WebhookMetrics:
    """The webhook's metrics on their own registry. Every method is cheap (a lock held for an
    addition) and safe from any thread: the request threads and the accept loop call them."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = prometheus_client.Counter(
            "migpilot_webhook_requests",
            "Admission review requests on the review paths, by path and how each ended "
            "(allowed, denied, patched, bad_request, error).",
            ["path", "outcome"],
            registry=r,
        )
        self.request_seconds = prometheus_client.Histogram(
            "migpilot_webhook_request_duration_seconds",
            "Time one review request took on its connection, from reading its request line to "
            "its answer written (or the request given up).",
            ["path"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.refused = prometheus_client.Counter(
            "migpilot_webhook_connections_refused",
            "Connections closed at accept, unserved, because --max-connections were being served.",
            registry=r,
        )
        self.timed_out = prometheus_client.Counter(
            "migpilot_webhook_connections_timed_out",
            "Connections cut because a request (for a new connection, its TLS handshake "
            "included) did not arrive whole within --request-timeout, or stalled longer than "
            "--idle-timeout inside it.",
            registry=r,
        )
        self.cert_reloads = prometheus_client.Counter(
            "migpilot_webhook_certificate_reloads",
            "Tries to load the serving certificate after its files changed: loaded, or failed "
            "(counted at each check while the pair does not load; the last good one is served).",
            ["outcome"],
            registry=r,
        )
        # Every series from the start, at 0: a rate() over a path or an outcome that has not
        # happened yet reads 0, not "no data".
        for path in PATHS:
            self.request_seconds.labels(path=path)
            for outcome in Outcome:
                self.requests.labels(path=path, outcome=outcome.value)
        for cert in CertOutcome:
            self.cert_reloads.labels(outcome=cert.value)

    def observe_request(self, path: str, outcome: Outcome, seconds: float) -> None:
        """One review request on ``path`` (one of :data:`PATHS`) ended as ``outcome`` after
        ``seconds``."""
        self.requests.labels(path=path, outcome=outcome.value).inc()
        self.request_seconds.labels(path=path).observe(max(0.0, seconds))

    def observe_refused(self) -> None:
        """A connection was closed at accept: the most were being served."""
        self.refused.inc()

    def observe_timed_out(self) -> None:
        """A connection was cut at its request's deadline."""
        self.timed_out.inc()

    def observe_cert_reload(self, outcome: CertOutcome) -> None:
        """A changed serving certificate was loaded, or did not load."""
        self.cert_reloads.labels(outcome=outcome.value).inc()

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)
