"""The pods bound to the node(s) the agent follows, as its pod watch shows them.

Why it exists: the agent needs to know which pods on its node ask for MIG resources, MPS slices or
``nvidia.com/gpu`` before the kubelet says which devices they got: their counts keep instances from
being destroyed (:mod:`~migpilot.agent.cluster.holding`), the unified pool resolves Allocate from
them (:mod:`~migpilot.agent.sharing.unifying`), and on a KWOK node the stand-in kubelet
(:mod:`migpilot.kwok.standin`) hands them devices. :class:`PodBook` keeps them, fed by
:func:`~migpilot.agent.cluster.watching.follow`; :func:`bound_pod` reads one pod (pure).

A shell module: it reads raw pods handed to it and imports no Kubernetes client.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors, logs
from migpilot.agent.deviceplugin import devices, resolving
from migpilot.kube import objects
from migpilot.planning import quantities, snapshot

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BoundPod:
    """A live pod bound to a node, asking for MIG resources or for ``nvidia.com/gpu``."""

    namespace: str
    name: str
    node: str
    """The node it is bound to (``spec.nodeName``)."""
    created: str
    """``metadata.creationTimestamp`` (RFC 3339: sorts as text)."""
    requests: tuple[tuple[str, int], ...]
    """``(resource, count)`` per MIG resource and MPS slice size, sorted by resource."""
    gpu: resolving.GpuPod | None = None
    """Its ``nvidia.com/gpu`` containers (a unified pod, or a whole-GPU one), ``None`` when
    it asks for none."""
    uid: str = ""
    """``metadata.uid`` (its processes' cgroups name it: ``agent/usage.py``)."""
    claims: tuple[str, ...] = ()
    """The names of its DRA ResourceClaims (:func:`pod_claims`), which a kubelet prepares
    before the pod starts (on a KWOK node, the fleet's stand-in: ``migpilot.kwok.drakubelet``)."""

    @property
    def key(self) -> str:
        """``namespace/name``, as ``reservedFor`` names a pod."""
        return f"{self.namespace}/{self.name}"

    @property
    def order(self) -> tuple[str, str, str]:
        """Who is served first: the oldest, then by namespace and name."""
        return (self.created, self.namespace, self.name)


def bound_pod(doc: Mapping[str, Any]) -> BoundPod | None:
    """A pod (raw JSON) as the stand-in sees it; ``None`` when it holds no device (not bound,
    terminated, no MIG request, no ``nvidia.com/gpu``, no DRA claim). A bad request is a
    :class:`MigpilotError`."""
    meta = doc.get("metadata") or {}
    node = objects.node_name_of(doc)
    if not node or resolving.terminated(doc):
        return None
    spec = doc.get("spec") or {}
    where = f"pod {meta.get('namespace', '')}/{meta.get('name', '')}"
    gpu = resolving.gpu_pod(doc)
    total = {k: v for k, v in _mig_amounts(spec, where).items() if k not in _GPU_FAMILY}
    claims = pod_claims(doc)
    if not any(total.values()) and gpu is None and not claims:
        return None
    asked = (
        snapshot.pod_requests(total, where=where)  # checks the names, one line each
        if any(total.values())
        else None
    )
    requests = (
        [] if asked is None else [(snapshot.resource_name(r.profile), r.count) for r in asked.mig]
    )
    requests += [] if asked is None else [(r.resource, r.count) for r in asked.mps]
    return BoundPod(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        node=node,
        created=str(meta.get("creationTimestamp") or ""),
        requests=tuple(sorted(requests)),
        gpu=gpu,
        uid=str(meta.get("uid") or ""),
        claims=claims,
    )


def pod_claims(doc: Mapping[str, Any]) -> tuple[str, ...]:
    """The names of the ResourceClaims a pod (raw JSON) uses, as the kubelet finds them: the
    ``resourceClaimName`` of an entry of ``spec.resourceClaims``, or for an entry naming a
    template the claim ``status.resourceClaimStatuses`` names (none yet, or ``null``: the
    template made no claim for it). Each once, in the spec's order; anything not shaped as the
    API says is skipped."""
    spec, status = doc.get("spec"), doc.get("status")
    entries = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    made = status.get("resourceClaimStatuses") if isinstance(status, Mapping) else None
    by_entry = {
        s.get("name"): s.get("resourceClaimName")
        for s in (made if isinstance(made, list) else ())
        if isinstance(s, Mapping)
    }
    found: dict[str, None] = {}
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, Mapping):
            continue
        name = entry.get("resourceClaimName")
        if name is None and entry.get("resourceClaimTemplateName") is not None:
            name = by_entry.get(entry.get("name"))
        if isinstance(name, str) and name:
            found[name] = None
    return tuple(found)


_GPU_FAMILY = frozenset({devices.FULL_GPU_RESOURCE, *resolving.UNIFIED_RESOURCES})
"""``nvidia.com/gpu`` and the resources that qualify it (read by :func:`resolving.gpu_pod`)."""


def _mig_amounts(spec: Mapping[str, Any], where: str) -> dict[str, int]:
    """Per ``nvidia.com/`` resource, what kube-scheduler counts (:func:`snapshot.scheduled`:
    limits, overridden by requests where both are given)."""

    def amounts(part: str) -> list[dict[str, int]]:
        return [
            {
                str(name): quantities.amount(value, where=f"{where}.{part}[{i}].{name}")
                for name, value in snapshot.container_resources(container).items()
                if str(name).startswith("nvidia.com/")
            }
            for i, container in enumerate(spec.get(part) or ())
        ]

    return snapshot.scheduled(amounts("containers"), amounts("initContainers"))


class PodBook:
    """The pods holding devices on the nodes followed, as the pod watch last showed them.

    Fed by :func:`watching.follow` (:meth:`listed`, :meth:`changed`); ``on_change`` is told the
    node whose pods changed (the fleet wakes that node's pass). Thread-safe.
    """

    def __init__(self, *, on_change: Callable[[str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._by_node: dict[str, dict[str, BoundPod]] = {}
        self._where: dict[str, str] = {}
        self._versions: dict[str, int] = {}
        self._on_change = on_change
        self._bad: set[str] = set()
        self._synced = False

    @property
    def synced(self) -> bool:
        """Whether a list has filled it (before that, the node's pods are unknown)."""
        with self._lock:
            return self._synced

    def listed(self, docs: Sequence[Mapping[str, Any]]) -> None:
        """Replace everything with the pods of a list."""
        pods = [p for p in (self._read(d) for d in docs) if p is not None]
        with self._lock:
            before = {node: dict(pods) for node, pods in self._by_node.items()}
            self._by_node, self._where = {}, {}
            self._synced = True
            for pod in pods:
                self._by_node.setdefault(pod.node, {})[pod.key] = pod
                self._where[pod.key] = pod.node
            touched = {
                n for n in {*before, *self._by_node} if before.get(n) != self._by_node.get(n)
            }
            for node in touched:
                self._versions[node] = self._versions.get(node, 0) + 1
        self._tell(touched)

    def changed(self, event: objects.WatchEvent) -> None:
        """Apply one watch event."""
        meta = event.object.get("metadata") or {}
        key = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
        pod = None if event.type is objects.EventType.DELETED else self._read(event.object)
        touched: set[str] = set()
        with self._lock:
            old_node = self._where.pop(key, None)
            if old_node is not None:
                old = self._by_node[old_node].pop(key)
                if old != pod:
                    touched.add(old_node)
                if not self._by_node[old_node]:
                    del self._by_node[old_node]
            if pod is not None:
                self._by_node.setdefault(pod.node, {})[key] = pod
                self._where[key] = pod.node
                if old_node != pod.node:
                    touched.add(pod.node)
            for node in touched:
                self._versions[node] = self._versions.get(node, 0) + 1
        self._tell(touched)

    def pods(self, node: str) -> tuple[BoundPod, ...]:
        """The node's pods, oldest first."""
        with self._lock:
            found = tuple(self._by_node.get(node, {}).values())
        return tuple(sorted(found, key=lambda p: p.order))

    def version(self, node: str) -> int:
        """A number that changes whenever the node's pods change."""
        with self._lock:
            return self._versions.get(node, 0)

    def _read(self, doc: Mapping[str, Any]) -> BoundPod | None:
        try:
            return bound_pod(doc)
        except errors.MigpilotError as err:
            text = str(err)
            if text not in self._bad:  # once per problem; the watch repeats it at every change
                self._bad.add(text)
                meta = doc.get("metadata") or {}
                pod = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
                _log.warning(
                    "%s; it gets no device",
                    text,
                    extra=logs.about(pod=pod, node=objects.node_name_of(doc)),
                )
            return None

    def _tell(self, nodes: set[str]) -> None:
        if self._on_change is not None:
            for node in sorted(nodes):
                self._on_change(node)
