"""Whether the controller is alive: its Lease, read from the API server and cached for a moment.

Why it exists: the webhook gates MIG pods only while a controller holds a fresh Lease, so a dead
controller never strands new pods. The apiserver calls the webhook for every pod it creates;
reading the Lease on each call would double that traffic, so the Lease is re-read at most every
``cache_s`` seconds and its freshness judged at each call against the clock.

The Lease also says whether some node is labelled ``migpilot.io/mig-mode=dynamic``
(:func:`migpilot.api.leases.dynamic_mig`): only then, and only while fresh, are whole-GPU pods
gated too (:meth:`Freshness.state`).

A Lease that is not there counts as "not fresh" at once: the webhook then fails open, as its
``failurePolicy: Ignore`` does. Any other error reading it (timeout, forbidden, TLS) keeps the
last Lease read, still judged against the clock: a controller that really stopped renewing goes
stale when its Lease says, but one read that timed out on a busy API server does not let pods
through ungated (they would take instances reserved for pods already pinned, which could then
never run: ``docs/webhook.md``). With no Lease read yet, an error fails open. The reading and
caching are the shells' one Lease reader (:mod:`migpilot.kube.leasereader`), which the agents
on DRA nodes use too.

The module of the webhook that makes its client, through the shared boundary
(:mod:`migpilot.kube`; :func:`connect`, shared with the DRA claims reader
:mod:`migpilot.webhook.claims`): :class:`KubeLease` reads the Lease from anything that answers a
get as the lightkube client (:class:`migpilot.kube.client.Client`) and the in-memory API server
of the unit tests (:class:`migpilot.kube.memory.InMemoryServer`) both do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from migpilot.api import leases as api_leases
from migpilot.kube import client, errors, leasereader, objects

_log = logging.getLogger("migpilot.webhook")

READ_TIMEOUT_S = 1.0
"""How long one read of the Lease may take: well inside the webhook's 2 s timeout."""


class LeaseSource(Protocol):
    """Where the controller's Lease comes from."""

    def read(self) -> Mapping[str, Any]:
        """The Lease as a coordination.k8s.io/v1 dict; raises on any failure."""
        ...


class Getter(Protocol):
    """Reads one object from an API server (:class:`migpilot.kube.client.Client` and
    :class:`migpilot.kube.memory.InMemoryServer` are ones)."""

    def get(
        self, kind: objects.Kind, name: str, *, namespace: str | None = None
    ) -> Mapping[str, Any] | None:
        """The object, ``None`` when there is none; raises on any other failure."""
        ...


def connect(kubeconfig: Path | None) -> client.Client:
    """The webhook's client (from ``kubeconfig``, or in-cluster when None), each read bounded
    by :data:`READ_TIMEOUT_S`; the Lease and the DRA claims (:mod:`migpilot.webhook.claims`)
    are read through it."""
    return client.Client.connect(kubeconfig, timeout_s=READ_TIMEOUT_S)


class KubeLease:
    """The Lease ``namespace/name`` read from the Kubernetes API."""

    def __init__(self, api: Getter, *, name: str, namespace: str) -> None:
        self._api = api
        self._name = name
        self._namespace = namespace

    @classmethod
    def connect(cls, kubeconfig: Path | None, *, name: str, namespace: str) -> KubeLease:
        """A source with its own client: from ``kubeconfig``, or in-cluster when None."""
        return cls(connect(kubeconfig), name=name, namespace=namespace)

    def read(self) -> Mapping[str, Any]:
        lease = self._api.get(objects.Kind.LEASES, self._name, namespace=self._namespace)
        if lease is None:
            raise errors.NotFoundError(f"Lease {self._namespace}/{self._name} not found")
        return lease


@dataclass(frozen=True, slots=True)
class LeaseState:
    """What the webhook reads of the controller's Lease at one call."""

    fresh: bool
    """Some controller holds it fresh: MIG and unified pods are gated."""
    dynamic_mig: bool
    """Fresh, and some node is labelled ``migpilot.io/mig-mode=dynamic``: whole-GPU pods are
    gated too."""


class Freshness:
    """Answers "is the controller's Lease fresh now?", reading the source at most every
    ``cache_s`` seconds of ``clock`` (seconds since the Unix epoch), through the shells' one
    Lease reader (:class:`~migpilot.kube.leasereader.LeaseReader`: a Lease not found is not
    fresh at once; any other failed read keeps the last one read, judged by its renew time).
    Thread-safe."""

    def __init__(
        self,
        source: LeaseSource,
        *,
        cache_s: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._reader = leasereader.LeaseReader(source.read, cache_s=cache_s, clock=clock)
        self._lock = threading.Lock()
        self._last: bool | None = None
        self._last_dynamic = False

    def fresh(self) -> bool:
        """Whether the Lease is fresh now (:attr:`LeaseState.fresh`)."""
        return self.state().fresh

    def state(self) -> LeaseState:
        """The Lease's freshness now, and whether it says some node is dynamic."""
        lease, now = self._reader.current()
        fresh = lease is not None and api_leases.fresh(lease, now)
        dynamic = fresh and lease is not None and api_leases.dynamic_mig(lease)
        with self._lock:
            if fresh != self._last:
                _log.info("controller Lease %s: MIG pods are %s", *_said(fresh))
                self._last = fresh
            if dynamic != self._last_dynamic:
                _log.info(
                    "controller Lease: whole-GPU pods are %s",
                    "gated (a node is labelled for dynamic MIG mode)" if dynamic else "not gated",
                )
                self._last_dynamic = dynamic
        return LeaseState(fresh, dynamic)


def _said(fresh: bool) -> tuple[str, str]:
    return ("fresh", "gated") if fresh else ("missing or stale", "not gated")
