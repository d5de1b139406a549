"""The DRA claims a new pod names, read from the API server at admission, within a bound.

Why it exists: a pod's ``spec.resourceClaims`` names ResourceClaims and ResourceClaimTemplates;
only those objects say whether the pod asks for migpilot's devices (class ``mig.migpilot.io``),
which decides whether the webhook gates it (:mod:`migpilot.webhook.admission`). The apiserver
waits for the webhook (``timeoutSeconds``: 5) before it creates the pod, so the reads must stay
short whatever the pod names: each read has the client's timeout (1 s), the reads of one review
stop after ``budget_s`` (2 s; what is left is told as not read), and what was found is kept for
``cache_s`` (5 s, at most ``max_entries`` objects) so that a Deployment's replicas, made from
one template, cost one read. What was not found, or not read, is not kept: a template created a
moment after its first pod is read for the next one.

A found object is kept for a few seconds only, and by name: a template deleted and made again
with another class inside that time would be judged by the old one. The harmful mistake is
gating a pod of another driver (the controller would not let it go), so the time is short.

The claims reader of the webhook, beside the Lease's (:mod:`migpilot.webhook.leases`, which
makes the client they share): it reads through anything that answers a get as the shared
client and the in-memory API server do (:class:`migpilot.webhook.leases.Getter`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from migpilot.kube import objects
from migpilot.webhook import admission, leases

_log = logging.getLogger("migpilot.webhook")

CACHE_S = 5.0
"""Seconds a found claim or template is reused before it is read again."""
BUDGET_S = 2.0
"""Seconds the reads of one review may take; the claims not read by then count as not read."""
MAX_ENTRIES = 1024
"""Most objects kept; the least recently used goes first."""


class ClaimReader:
    """Reads the claims and templates :func:`admission.to_read` names, with a small cache.
    Thread-safe: the server's connection threads share it."""

    def __init__(
        self,
        api: leases.Getter,
        *,
        cache_s: float = CACHE_S,
        budget_s: float = BUDGET_S,
        max_entries: int = MAX_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._cache_s = cache_s
        self._budget_s = budget_s
        self._max_entries = max_entries
        self._clock = clock
        self._lock = threading.Lock()
        self._kept: collections.OrderedDict[admission.ClaimRef, tuple[float, Mapping[str, Any]]] = (
            collections.OrderedDict()
        )
        self.reads = 0
        """Reads sent to the API server (for tests and logs)."""

    def read(
        self, refs: Iterable[admission.ClaimRef]
    ) -> dict[admission.ClaimRef, admission.ClaimLookup]:
        """Each of ``refs`` as read now, or from the cache; never raises."""
        started = self._clock()
        out: dict[admission.ClaimRef, admission.ClaimLookup] = {}
        for ref in refs:
            kept = self._kept_document(ref)
            if kept is not None:
                out[ref] = admission.ClaimLookup(kept)
            elif self._clock() - started >= self._budget_s:
                out[ref] = admission.ClaimLookup(
                    problem=f"not read: the reads of this pod's claims took {self._budget_s:g} s"
                )
            else:
                out[ref] = self._read(ref)
        return out

    def _kept_document(self, ref: admission.ClaimRef) -> Mapping[str, Any] | None:
        with self._lock:
            entry = self._kept.get(ref)
            if entry is None:
                return None
            read_at, document = entry
            if not 0 <= self._clock() - read_at < self._cache_s:  # a clock gone back: stale too
                del self._kept[ref]
                return None
            self._kept.move_to_end(ref)
            return document

    def _read(self, ref: admission.ClaimRef) -> admission.ClaimLookup:
        kind = objects.Kind.RESOURCECLAIMTEMPLATES if ref.template else objects.Kind.RESOURCECLAIMS
        self.reads += 1
        try:
            document = self._api.get(kind, ref.name, namespace=ref.namespace)
        except Exception as err:  # any failure is "not read": the pod is then not gated
            why = str(err).splitlines()[0] if str(err) else type(err).__name__
            _log.warning("cannot read %s (its pod is not gated for it): %s", ref.label, why)
            return admission.ClaimLookup(problem=f"not read: {why[:200]}")
        if document is None:
            return admission.ClaimLookup()
        with self._lock:
            self._kept[ref] = (self._clock(), document)
            self._kept.move_to_end(ref)
            while len(self._kept) > self._max_entries:
                self._kept.popitem(last=False)
        return admission.ClaimLookup(document)
