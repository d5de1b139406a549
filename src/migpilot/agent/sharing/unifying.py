"""The agent's half of unified requests (``docs/unified.md``): the ``nvidia.com/gpu`` pool, what
Allocate resolves pods with, and the node counters kube-scheduler checks.

Why it exists: kube-scheduler and the kubelet admit a pod asking ``nvidia.com/gpu`` with
``nvidia.com/gpumem`` (HAMi's spelling) only if the node advertises those resources, and the
kubelet's Allocate never says which pod it serves. So:

- :class:`UnifiedPool` keeps the *pool*: the MIG instances (or MPS slices, below) the GpuLayout spec
  reserves for a unified pod, or that Allocate handed to one still alive. :meth:`UnifiedPool.update`
  (every pass) puts them in the view the device plugin advertises (``NodeDevices.unified``: one
  ``nvidia.com/gpu`` device each, no longer ``nvidia.com/mig-<profile>``), after releasing the
  ledger entries of pods that are gone (the pod watch says so and a read of the pod confirms it). A
  reservation is for a unified pod when the spec says so (``resource: nvidia.com/gpu``, written by
  the controller, which knows the pod), so a pass reads no pod from the API.
  :meth:`UnifiedPool.inputs` gives Allocate the node's pods (read again from the API when asked: the
  watch may lag the kubelet) and the reservations; :meth:`UnifiedPool.used_by` says which pod each
  allocated instance went to (the GpuLayout status reports it, so the controller knows a unified pod
  is allocated). A bound unified pod's reservation is remembered while the pod lives, so a spec that
  drops it before Allocate leaves the pod its instances (:meth:`UnifiedPool.in_use` keeps them).
- :class:`NodeCounters` writes ``nvidia.com/gpumem`` (MiB: the sum over the node's MIG GPUs of
  :func:`unified.memory_mib`, over its GPUs serving MPS slices of their memory, and over its
  time-slicing GPUs of their memory times their replicas), ``nvidia.com/gpumem-percentage`` and
  ``nvidia.com/gpucores`` (100 per such GPU, per replica on a time-slicing one) into the
  Node's capacity and allocatable, kept in step with the GPUs. They never bind: every unified
  pod gets instances (or a slice) at least as large as its ask.

On a node in mode ``mps`` (``docs/modes.md``) the spec reserves MPS slices (``resource:
nvidia.com/gpu``) for unified pods instead of MIG instances; the pool holds them the same way,
by device ID (``<gpu-uuid>::mps-<id>``), as :class:`resolving.Instance` values that stand for
slices, and the plugin answers their Allocate with the slice's MPS settings. On a node whose
sharing config time-slices its GPUs, the spec keeps replicas (``spec.gpus[].replicas``, always for
unified pods); the pool holds each as ``<gpu-uuid>::<id>``, the device ID of that replica, which
the sharing config advertises as ``nvidia.com/gpu`` already (:mod:`timeslicing`).

A shell module: the API through :class:`~kubeapi.NodeApi`, the pods through
:class:`~boundpods.PodBook`; it imports neither a Kubernetes client nor gRPC (import-linter).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

from migpilot import errors, logs
from migpilot.agent.cluster import boundpods, kubeapi
from migpilot.agent.deviceplugin import devices, resolving
from migpilot.agent.rules import changes
from migpilot.agent.sharing import timeslicing
from migpilot.api import gpulayouts
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects
from migpilot.mig import profiles
from migpilot.planning import unified
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

_log = logging.getLogger(__name__)

COUNTERS = (unified.GPUMEM, unified.GPUMEM_PERCENT, unified.GPUCORES)
"""The node counters, in the order they are logged."""

_Position = tuple[int, int, str]
"""(GPU index, start, profile) of an instance; (GPU index, slice id, ``""``) of an MPS slice;
(GPU index, replica id, :data:`_REPLICA`) of a time-slicing replica."""
_REPLICA = "::"
"""The profile of a replica's position (no profile is named so)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _Spot:
    """A MIG instance or an MPS slice the spec reserves for a pod."""

    at: _Position
    memory_gb: int | None = None
    """A slice's size in the spec; ``None`` for an instance."""
    cores: int | None = None
    """A slice's compute share in the spec."""


class Allocations(Protocol):
    """Who knows what Allocate handed to pods: the device plugin's ledger, or the simulated
    kubelet's assignments."""

    def pod_allocations(self) -> Mapping[str, resolving.PodAllocation]:
        """Pod key -> what its containers got."""
        ...

    def pods_version(self) -> int:
        """Changes whenever :meth:`pod_allocations` does."""
        ...

    def release_pods(self, pods: Sequence[str]) -> None:
        """These pods are gone: their instances are free."""
        ...


class NoAllocations:
    """Nothing was handed out (until the plugin or the stand-in is attached)."""

    def pod_allocations(self) -> Mapping[str, resolving.PodAllocation]:
        """None."""
        return {}

    def pods_version(self) -> int:
        """Never changes."""
        return 0

    def release_pods(self, pods: Sequence[str]) -> None:
        """Nothing to release."""


class UnifiedPool:
    """The instances set aside for unified pods on one node, and Allocate's inputs (see the
    module). Thread-safe: the agent's pass and Allocate's threads call it."""

    def __init__(
        self,
        api: kubeapi.NodeApi,
        *,
        node: str,
        pods: boundpods.PodBook,
        spec: Callable[[], gpulayouts.LayoutSpec | None],
        allocated: Allocations | None = None,
        sharing: Callable[[], sharing_config.Config] = lambda: sharing_config.EMPTY,
    ) -> None:
        self._api = api
        self._sharing = sharing
        self.node = node
        self._book = pods
        self._spec = spec
        self._allocated: Allocations = allocated if allocated is not None else NoAllocations()
        self._lock = threading.RLock()
        self._view = devices.NodeDevices(gpus=())
        self._pool: frozenset[str] = frozenset()
        self._remembered: dict[str, tuple[_Spot, ...]] = {}
        """Bound unified pod -> the instances (and slices) the spec last reserved for it."""

    def attach(self, allocated: Allocations) -> None:
        """Take hand-outs from ``allocated`` (the plugin, made after the pool)."""
        with self._lock:
            self._allocated = allocated

    # -- the pass ------------------------------------------------------------------------------
    def update(self, view: devices.NodeDevices) -> devices.NodeDevices:
        """``view`` with the pool set aside, after releasing the allocations of pods gone."""
        self._release_gone()
        with self._lock:
            self._view = view
            reserved = self._reserved(view)
            pool = resolving.set_aside(
                reservations=reserved,
                unified_pods=self._unified_pods() & set(reserved),
                allocated=self._allocated.pod_allocations(),
                existing=set(self._by_position(view).values()),
            )
            if pool != self._pool:
                _log.info("Node %s: %d MIG instance(s) and MPS slice(s) set aside for unified "
                          "pods, advertised as %s", self.node, len(pool),
                          devices.FULL_GPU_RESOURCE, extra=logs.about(node=self.node))  # fmt: skip
            self._pool = pool
        return dataclasses.replace(view, unified=pool)

    def fingerprint(self) -> Hashable:
        """Changes when Allocate handed something out or a pod that holds instances went (a
        pass is then due: the status reports it, the pool changes)."""
        allocated = self._allocated.pod_allocations()
        live = self._live()
        gone = frozenset(k for k, a in allocated.items() if not _alive(a, live.get(k)))
        return (self._allocated.pods_version(), gone)

    # -- Allocate's inputs ---------------------------------------------------------------------
    def inputs(self, *, fresh: bool) -> resolving.Inputs:
        """The pods bound to the node (read from the API when ``fresh``; the watch's otherwise
        or when the API fails), the reservations and the pool."""
        pods = [p.gpu for p in self._book.pods(self.node) if p.gpu is not None]
        if fresh:
            try:
                docs = self._api.list_pods(node=self.node).items
            except kube_errors.KubeApiError as err:
                _log.warning("Node %s: pods not read again (%s); using the pod watch's",
                             self.node, err, extra=logs.about(node=self.node))  # fmt: skip
            else:
                pods = [p for p in (_gpu_pod(d) for d in docs) if p is not None]
        with self._lock:
            return resolving.Inputs(tuple(pods), self._reserved(self._view), self._pool)

    def used_by(self) -> dict[str, str]:
        """MIG UUID (or MPS slice device ID) -> the unified pod (``namespace/name``) Allocate
        handed it to."""
        return {
            uuid: key
            for key, a in self._allocated.pod_allocations().items()
            if a.unified
            for uuid in a.devices
        }

    def in_use(self) -> frozenset[str]:
        """Instances (and MPS slices) the spec no longer reserves for a bound unified pod,
        remembered for it until it is allocated (and while it lives): never destroyed (a
        slice: still served)."""
        spec = self._spec()
        listed = _positions(spec)
        with self._lock:
            by_pos = self._by_position(self._view)
            return frozenset(
                uuid
                for key, found in self._remembered.items()
                if key not in listed
                for spot in found
                if (uuid := by_pos.get(spot.at)) is not None
            )

    def profiles_for(self, pod: boundpods.BoundPod) -> tuple[str, ...]:
        """The profiles a bound unified pod holds or is about to get (its reserved or
        allocated instances; without any, its asks resolved on the node's first MIG GPU
        model that serves them), for ``holding.BoundPodsHold``. A pod served by MPS slices
        holds no profile: ``()`` (its slices are kept by the spec, the ledger and
        :meth:`in_use`, and a node without MIG GPUs resolves nothing)."""
        if pod.gpu is None or not pod.gpu.unified:
            return ()
        with self._lock:
            mine = self._reserved(self._view).get(pod.key, ())
            models = [g.model for g in self._view.gpus if g.mig_enabled]
        if mine:
            return tuple(sorted(i.profile for i in mine if not i.is_slice and not i.replica))
        request = unified.UnifiedRequest(
            tuple(c.ask for c in pod.gpu.containers if c.ask is not None and not c.init)
        )
        for model in models:
            found = unified.resolve(request, model)
            if found is not None:
                return found
        return ()

    # -- internals -----------------------------------------------------------------------------
    def _live(self) -> dict[str, resolving.GpuPod]:
        return {p.key: p.gpu for p in self._book.pods(self.node) if p.gpu is not None}

    def _release_gone(self) -> None:
        """Release ledger entries whose pods the watch no longer shows, once a read of each
        confirms it is gone (deleted, finished, or another pod of that name)."""
        if not self._book.synced:
            return
        live = self._live()
        gone: list[str] = []
        for key, a in self._allocated.pod_allocations().items():
            if _alive(a, live.get(key)):
                continue
            namespace, _, name = key.partition("/")
            try:
                doc = self._api.get_pod(namespace, name)
            except kube_errors.KubeApiError as err:
                _log.warning("Node %s: pod %s not read (%s); its allocation is kept", self.node,
                             key, err, extra=logs.about(pod=key, node=self.node))  # fmt: skip
                continue
            if (
                doc is None
                or resolving.terminated(doc)
                or objects.node_name_of(doc) != self.node
                or (a.uid and _uid(doc) != a.uid)
            ):
                gone.append(key)
        if gone:
            self._allocated.release_pods(gone)

    def _reserved(self, view: devices.NodeDevices) -> dict[str, tuple[resolving.Instance, ...]]:
        """Pod key -> its instances: those the spec reserves (or last reserved, for a unified
        pod bound here) and those Allocate handed it. Under the lock.

        A unified pod's reservation is remembered from the first time it is seen (the pod may
        be bound and its reservation dropped between two passes) and forgotten once the spec
        no longer reserves for it and it is not bound here (re-planned, gone, elsewhere)."""
        positions = {k: list(v) for k, v in _positions(self._spec()).items()}
        live = self._live()
        unified_pods = self._unified_pods()
        for key in list(self._remembered):
            if key not in live and key not in positions:
                del self._remembered[key]
        for key, spots in positions.items():
            if key in unified_pods:
                self._remembered[key] = tuple(spots)
        for key, kept in self._remembered.items():
            positions.setdefault(key, list(kept))
        by_pos = self._by_position(view)
        models = {g.index: g.model for g in view.gpus}
        served = view.slice_device_ids()
        replica_at = {uuid: at for at, uuid in by_pos.items() if at[2] == _REPLICA}
        out: dict[str, list[resolving.Instance]] = {
            key: [_instance(spot, by_pos.get(spot.at), models, served) for spot in found]
            for key, found in positions.items()
        }
        by_uuid = {m.uuid: m for m in view.mig_devices}
        for key, a in self._allocated.pod_allocations().items():
            have = {i.uuid for i in out.get(key, ())}
            for uuid in sorted(a.devices if a.unified else ()):
                if uuid in have:
                    continue
                m, sl = by_uuid.get(uuid), served.get(uuid)
                if m is not None:
                    out.setdefault(key, []).append(
                        resolving.Instance(
                            m.gpu_index, m.start, m.profile.name, uuid, models.get(m.gpu_index)
                        )
                    )
                elif sl is not None:
                    spot = _Spot((sl.gpu_index, sl.id, ""), sl.memory_gb, sl.cores)
                    out.setdefault(key, []).append(_instance(spot, uuid, models, served))
                elif (at := replica_at.get(uuid)) is not None:
                    out.setdefault(key, []).append(_instance(_Spot(at), uuid, models, served))
        return {k: tuple(v) for k, v in out.items()}

    def _by_position(self, view: devices.NodeDevices) -> dict[_Position, str]:
        """Where each MIG device, served MPS slice and time-slicing replica is -> its device
        ID."""
        out = _by_position(view)
        uuids = {g.index: g.uuid for g in view.gpus}
        for index, ids in timeslicing.replica_ids(view, self._sharing()).items():
            for ident in ids:
                out[(index, ident, _REPLICA)] = timeslicing.device_id(uuids[index], ident)
        return out

    def _unified_pods(self) -> set[str]:
        """The pods whose reservations are for unified pods: the spec names their resource
        ``nvidia.com/gpu`` (the controller knows the pod), or the pod bound here is unified."""
        spec = self._spec()
        gpus = spec.gpus if spec is not None else ()
        kept = [(i.reserved_for, i.resource) for g in gpus for i in g.instances]
        kept += [(sl.reserved_for, sl.resource) for g in gpus for sl in g.mps]
        # A replica is kept for unified pods only: the controller names no resource.
        kept += [(r.reserved_for, gpulayouts.UNIFIED_RESOURCE) for g in gpus for r in g.replicas]
        out = {
            pod
            for pod, resource in kept
            if pod is not None and resource == gpulayouts.UNIFIED_RESOURCE
        }
        out.update(k for k, p in self._live().items() if p.unified)
        return out


def _gpu_pod(doc: Mapping[str, Any]) -> resolving.GpuPod | None:
    if resolving.terminated(doc):
        return None
    try:
        return resolving.gpu_pod(doc)
    except errors.MigpilotError:
        return None  # the pod watch logs it (boundpods.PodBook)


def _uid(doc: Mapping[str, Any]) -> str:
    return str((doc.get("metadata") or {}).get("uid") or "")


def _alive(entry: resolving.PodAllocation, pod: resolving.GpuPod | None) -> bool:
    """Whether the pod the watch shows is the one ``entry`` was made for."""
    return pod is not None and (not entry.uid or not pod.uid or entry.uid == pod.uid)


def _positions(spec: gpulayouts.LayoutSpec | None) -> dict[str, tuple[_Spot, ...]]:
    """Pod key -> the instances, MPS slices and time-slicing replicas the spec reserves for it."""
    out: dict[str, list[_Spot]] = {}
    for g in spec.gpus if spec is not None else ():
        for i in g.instances:
            if i.reserved_for is not None:
                out.setdefault(i.reserved_for, []).append(_Spot((g.index, i.start, i.profile)))
        for sl in g.mps:
            if sl.reserved_for is not None:
                spot = _Spot((g.index, sl.id, ""), sl.memory_gb, sl.cores)
                out.setdefault(sl.reserved_for, []).append(spot)
        for r in g.replicas:
            out.setdefault(r.reserved_for, []).append(_Spot((g.index, r.id, _REPLICA)))
    return {k: tuple(v) for k, v in out.items()}


def _by_position(view: devices.NodeDevices) -> dict[_Position, str]:
    """Where each MIG device and served MPS slice is -> its device ID."""
    out = {(m.gpu_index, m.start, m.profile.name): m.uuid for m in view.mig_devices}
    out.update({(s.gpu_index, s.id, ""): i for i, s in view.slice_device_ids().items()})
    return out


def _instance(
    spot: _Spot,
    uuid: str | None,
    models: Mapping[int, profiles.GpuModel],
    served: Mapping[str, devices.MpsSlice],
) -> resolving.Instance:
    """The instance (or slice: with the size it is served with, else the spec's; or replica) at
    ``spot``."""
    g, start, profile = spot.at
    if profile == _REPLICA:
        return resolving.time_slice(g, start, uuid=uuid, model=models.get(g))
    if spot.memory_gb is None:
        return resolving.Instance(g, start, profile, uuid, models.get(g))
    now = served.get(uuid) if uuid is not None else None
    gb, cores = (now.memory_gb, now.cores) if now is not None else (spot.memory_gb, spot.cores)
    return resolving.mps_slice(g, start, gb, uuid=uuid, model=models.get(g), cores=cores)


# --- the node counters -------------------------------------------------------------------------


def counters(
    view: devices.NodeDevices,
    *,
    mps_node: bool = False,
    replicas: Mapping[int, int] | None = None,
) -> dict[str, int]:
    """The node-level resources a unified pod's ask is checked against: memory in MiB (each
    MIG GPU's :func:`unified.memory_mib`; each GPU with MIG disabled that serves MPS slices,
    or every such GPU on a node in mode ``mps`` (``mps_node``: its slices may come and go, the
    counters stay), its :func:`sharing_mps.memory_gb` x 1024, which its slices sum to at most), and
    100 per such GPU for percentage and cores. A GPU the sharing config time-slices
    (``replicas``: GPU index -> its replicas, :func:`timeslicing.replica_ids`) counts ``replicas``
    times: its replicas share the whole GPU without isolation, each a pod may ask up to all of
    (the planner's cap, :func:`sharing_mps.memory_gb` x 1024, as for a slice), so the asks of the
    pods on it may sum past its memory and kube-scheduler must not refuse them."""
    shared = replicas or {}
    mig = [g for g in view.gpus if g.mig_enabled]
    sliced = [g for g in view.gpus if not g.mig_enabled and (mps_node or view.slices_on(g.index))]
    timed = [
        (g, shared[g.index])
        for g in view.gpus
        if not g.mig_enabled and g not in sliced and shared.get(g.index, 0) > 0
    ]
    count = len(mig) + len(sliced) + sum(n for _, n in timed)
    return {
        unified.GPUMEM: sum(unified.memory_mib(g.model) for g in mig)
        + sum(sharing_mps.memory_gb(g.model) * 1024 for g in sliced)
        + sum(sharing_mps.memory_gb(g.model) * 1024 * n for g, n in timed),
        unified.GPUMEM_PERCENT: 100 * count,
        unified.GPUCORES: 100 * count,
    }


class NodeCounters:
    """A pass listener: writes :func:`counters` into the Node's capacity and allocatable when
    they change (a merge patch of those keys only; API failures are logged and retried at the
    next pass)."""

    def __init__(
        self,
        api: kubeapi.NodeApi,
        *,
        node: str,
        mps_node: Callable[[], bool] = lambda: False,
        sharing: Callable[[], sharing_config.Config] = lambda: sharing_config.EMPTY,
    ) -> None:
        self._api = api
        self._node = node
        self._mps_node = mps_node
        self._sharing = sharing
        self._published: dict[str, str] | None = None
        self._settled = True

    @property
    def settled(self) -> bool:
        """Whether the last pass's counters are in the Node (its patch did not fail)."""
        return self._settled

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Patch the Node when the counters changed."""
        reps = {i: len(ids) for i, ids in timeslicing.replica_ids(view, self._sharing()).items()}
        found = counters(view, mps_node=self._mps_node(), replicas=reps)
        want = {k: str(v) for k, v in found.items()}
        if want == self._published:
            self._settled = True
            return
        try:
            self._api.patch_node_resources(self._node, dict(want))
        except kube_errors.KubeApiError as err:
            _log.error("Node %s: unified counters not published: %s", self._node, err,
                       extra=logs.about(node=self._node))  # fmt: skip
            self._settled = False
            return
        self._published, self._settled = want, True
        _log.info("Node %s: published %s", self._node,
                  ", ".join(f"{k}={want[k]}" for k in COUNTERS),
                  extra=logs.about(node=self._node))  # fmt: skip
