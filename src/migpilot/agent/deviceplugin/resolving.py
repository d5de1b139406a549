"""Which pod an Allocate of ``nvidia.com/gpu`` serves, and which MIG instances its container gets.

Why it exists: the kubelet's Allocate names device IDs, never the pod. On a node serving unified
requests (``docs/unified.md``) the plugin advertises one ``nvidia.com/gpu`` device per MIG
instance set aside for unified pods (on a node in mode ``mps``, per MPS slice: an :class:`Instance`
then stands for the slice), and a container must get the instances the planner reserved for *its*
pod, not whichever devices the kubelet picked. The kubelet admits the pods bound to
its node one at a time, in creation order, and calls Allocate once per container and resource
(init containers first), so at most one pod of the node is being allocated at any moment.
:func:`resolve` applies that rule: the request is for the first pod, in the kubelet's order
(creation time, namespace, name), that is bound, not finished, not fully allocated by the
ledger, and whose next container asks for as many GPUs as the request names. A unified pod's
container then gets instances from those reserved for the pod (or already handed to it);
another pod (a whole-GPU request, NVIDIA's) gets the devices the kubelet picked, which must not
be instances set aside for unified pods.

The rule is right whenever the pods bound to the node and not yet allocated are told apart by
it (the controller lets unified pods go to a node so that they are); the caller resolves one
Allocate at a time and records each in the ledger before answering, so two concurrent
Allocates never take the same pod, and :func:`resolve` never hands out an instance the ledger
gave to another pod.

Also here: :func:`gpu_pod` reads a pod (raw JSON) into the :class:`GpuPod` the rule needs,
:func:`set_aside` says which instances form the unified pool, and :func:`preferred` steers
GetPreferredAllocation towards the devices Allocate will hand out, so that what the kubelet
records (and PodResources lists) is what the container got.

Sans-IO: no clock, no socket, no gRPC, no Kubernetes client; raw JSON and values in, values out.
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.mig import profiles
from migpilot.planning import quantities, snapshot, unified
from migpilot.sharing import mps as sharing_mps

TERMINATED = frozenset({"Succeeded", "Failed"})
"""Pod phases whose containers hold no device any more."""
UNIFIED_RESOURCES = unified.UNIFIED_RESOURCES
"""Resources that make a container's ``nvidia.com/gpu`` a unified request."""


@dataclass(frozen=True, slots=True)
class PodAllocation:
    """What Allocate handed to the containers of one pod (``nvidia.com/gpu``)."""

    uid: str
    """The pod's ``metadata.uid`` (a later pod of the same name is another pod); may be
    empty when unknown."""
    unified: bool
    """A unified pod: ``containers`` hold MIG UUIDs (or MPS slice IDs) kept for it while it
    lives."""
    containers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    """``(container name, device IDs)`` in the order they were allocated."""

    @property
    def done(self) -> frozenset[str]:
        """The containers allocated."""
        return frozenset(name for name, _ in self.containers)

    @property
    def devices(self) -> frozenset[str]:
        """Every device handed to the pod."""
        return frozenset(i for _, ids in self.containers for i in ids)

    def adding(self, container: str, device_ids: tuple[str, ...]) -> PodAllocation:
        """This allocation with ``container``'s devices (replacing an earlier answer)."""
        kept = tuple((n, ids) for n, ids in self.containers if n != container)
        return PodAllocation(self.uid, self.unified, (*kept, (container, device_ids)))


@dataclass(frozen=True, slots=True)
class Container:
    """One container of a pod that asks for ``nvidia.com/gpu`` (one Allocate call)."""

    name: str
    init: bool
    """An init container: it runs before the others, which may reuse its devices."""
    count: int
    """``nvidia.com/gpu`` it asks for (> 0)."""
    ask: unified.GpuAsk | None = None
    """Its unified ask (memory, cores), for choosing among the pod's instances; ``None`` for
    a whole-GPU container."""


@dataclass(frozen=True, slots=True)
class GpuPod:
    """A pod bound to the node that asks for ``nvidia.com/gpu``, as the rule needs it."""

    namespace: str
    name: str
    uid: str
    created: str
    """``metadata.creationTimestamp`` (RFC 3339: sorts as text)."""
    containers: tuple[Container, ...]
    """Those asking for ``nvidia.com/gpu``, in the kubelet's order: init containers, then the
    others, each in spec order."""
    unified: bool
    """Served from the unified pool (MIG instances); else a whole-GPU request."""
    pending: bool = True
    """Phase ``Pending`` (or none yet): admission may still be ahead. A running or finished
    pod was admitted already; it is never the one an Allocate serves."""

    @property
    def key(self) -> str:
        """``namespace/name``, as ``reservedFor`` names a pod."""
        return f"{self.namespace}/{self.name}"

    @property
    def order(self) -> tuple[str, str, str]:
        """The kubelet's admission order: oldest first, then namespace and name."""
        return (self.created, self.namespace, self.name)


is_unified = unified.is_unified
"""Whether migpilot serves the pod's ``nvidia.com/gpu`` (the webhook's rule, one function)."""


def gpu_pod(doc: Mapping[str, Any]) -> GpuPod | None:
    """A pod (raw JSON) as :func:`resolve` sees it; ``None`` when no container asks for
    ``nvidia.com/gpu``. A malformed ask is a :class:`~migpilot.errors.MigpilotError` naming
    the field."""
    meta = doc.get("metadata") or {}
    spec = doc.get("spec") or {}
    where = f"pod {meta.get('namespace', '')}/{meta.get('name', '')}"
    annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}
    parts = [
        (part == "initContainers", i, c)
        for part in ("initContainers", "containers")
        for i, c in enumerate(spec.get(part) or ())
    ]
    resources = [snapshot.container_resources(c) for _, _, c in parts]
    pod_unified = is_unified(resources, annotations)
    found: list[Container] = []
    for (init, i, c), res in zip(parts, resources, strict=True):
        at = f"{where}.{'initContainers' if init else 'containers'}[{i}]"
        if pod_unified:
            ask = unified.parse_container(res, where=at)
            if ask is not None:
                found.append(Container(str(c.get("name", "")), init, ask.count, ask))
        elif unified.GPU in res:
            count = quantities.amount(res[unified.GPU], where=f"{at}.{unified.GPU}")
            if count > 0:
                found.append(Container(str(c.get("name", "")), init, count))
    if not found:
        return None
    phase = (doc.get("status") or {}).get("phase") or "Pending"
    return GpuPod(
        namespace=str(meta.get("namespace", "")),
        name=str(meta.get("name", "")),
        uid=str(meta.get("uid") or ""),
        created=str(meta.get("creationTimestamp") or ""),
        containers=tuple(found),
        unified=pod_unified,
        pending=phase == "Pending",
    )


def terminated(doc: Mapping[str, Any]) -> bool:
    """Whether a pod (raw JSON) has finished: its devices are free."""
    return (doc.get("status") or {}).get("phase") in TERMINATED


@dataclass(frozen=True, slots=True)
class Instance:
    """A MIG instance, or an MPS slice, reserved for a pod (or handed to it).

    A slice (on an MPS-mode GPU, ``docs/modes.md``) has :attr:`memory_gb` set; its ``start``
    is then its id in the GpuLayout, its ``profile`` empty and its ``uuid`` its device ID
    (``<gpu-uuid>::mps-<id>``)."""

    gpu: int
    start: int
    profile: str
    uuid: str | None
    """``None``: the spec reserves it but it does not exist (yet), or the slice is not
    served (yet)."""
    model: profiles.GpuModel | None = None
    """The GPU's model, to match a container's ask; ``None`` when unknown."""
    memory_gb: int | None = None
    """An MPS slice's memory in whole GB; ``None`` for a MIG instance."""
    cores: int | None = None
    """An MPS slice's compute share in percent (``None``: all of the GPU)."""
    replica: bool = False
    """A time-slicing replica (``start``: its id, ``uuid``: ``<gpu-uuid>::<id>``)."""

    @property
    def is_slice(self) -> bool:
        """An MPS slice, not a MIG instance."""
        return self.memory_gb is not None

    def __str__(self) -> str:
        if self.replica:
            return f"GPU {self.gpu} replica {self.start}"
        if self.memory_gb is not None:
            return f"GPU {self.gpu} MPS slice {self.start} ({self.memory_gb} GB)"
        return f"GPU {self.gpu} {self.profile}@{self.start}"


def mps_slice(
    gpu: int,
    slice_id: int,
    memory_gb: int,
    *,
    uuid: str | None,
    model: profiles.GpuModel | None = None,
    cores: int | None = None,
) -> Instance:
    """The :class:`Instance` that stands for an MPS slice."""
    return Instance(gpu, slice_id, "", uuid, model, memory_gb, cores)


def time_slice(
    gpu: int, replica: int, *, uuid: str | None, model: profiles.GpuModel | None = None
) -> Instance:
    """The :class:`Instance` that stands for a time-slicing replica (the whole GPU, shared)."""
    return Instance(gpu, replica, "", uuid, model, replica=True)


@dataclass(frozen=True, slots=True)
class Decision:
    """Allocate serves ``container`` of ``pod``: it gets ``device_ids``."""

    pod: GpuPod
    container: Container
    device_ids: tuple[str, ...]
    """MIG UUIDs (or an MPS slice ID) for a unified pod; the kubelet's picks for a whole-GPU
    pod."""
    taken_from: tuple[str, ...] = ()
    """A unified pod bound with nothing reserved for it: the pods whose reservations its
    devices were (:func:`resolve`); empty otherwise."""


@dataclass(frozen=True, slots=True)
class NoPod:
    """No known pod waits for such an Allocate (the caller may read the pods again)."""

    message: str


@dataclass(frozen=True, slots=True)
class Refusal:
    """The pod is known and cannot be served: the Allocate fails with ``message``."""

    message: str


Resolution = Decision | NoPod | Refusal


@dataclass(frozen=True, slots=True)
class Inputs:
    """What :func:`resolve` needs besides the ledger, as the agent knows it now."""

    pods: tuple[GpuPod, ...]
    """The pods bound to the node that ask for ``nvidia.com/gpu`` (not finished)."""
    reservations: Mapping[str, tuple[Instance, ...]]
    """Pod key -> the instances reserved for it (or already handed to it)."""
    pool: frozenset[str]
    """MIG UUIDs and MPS slice IDs advertised as ``nvidia.com/gpu`` for unified pods."""


def candidate(
    size: int,
    pods: Iterable[GpuPod],
    allocated: Mapping[str, PodAllocation],
) -> tuple[GpuPod, Container] | None:
    """The pod and container an Allocate of ``size`` devices serves (the rule in the module
    docstring), or ``None``."""
    for pod in sorted(pods, key=lambda p: p.order):
        if not pod.pending:
            continue
        done = _allocation_of(pod, allocated)
        names = done.done if done is not None else frozenset()
        nxt = next((c for c in pod.containers if c.name not in names), None)
        if nxt is not None and nxt.count == size:
            return pod, nxt
    return None


def _allocation_of(pod: GpuPod, allocated: Mapping[str, PodAllocation]) -> PodAllocation | None:
    """The ledger's entry for ``pod``; an entry of an older pod of that name does not count."""
    entry = allocated.get(pod.key)
    if entry is None or (entry.uid and pod.uid and entry.uid != pod.uid):
        return None
    return entry


def resolve(
    *,
    requested: Sequence[str],
    pods: Iterable[GpuPod],
    reservations: Mapping[str, Sequence[Instance]],
    allocated: Mapping[str, PodAllocation],
    pool: Collection[str],
    busy: Collection[str] = (),
    bound: Collection[str] | None = None,
) -> Resolution:
    """What one container's Allocate of the devices ``requested`` (the kubelet's picks) gets.

    ``reservations``: pod key -> the instances the GpuLayout spec reserves for it;
    ``allocated``: the ledger (every entry is a live pod's); ``pool``: the MIG UUIDs advertised
    as ``nvidia.com/gpu`` for unified pods; ``busy``: devices handed out otherwise (under a
    ``nvidia.com/mig-*`` resource) and not yet released, never given to a unified pod;
    ``bound``: the keys of the pods bound to the node (``None``: those of ``pods``), whose
    reservations a unified pod bound without one never takes (:func:`_unreserved`).
    """
    pods = tuple(pods)
    found = candidate(len(requested), pods, allocated)
    if found is None:
        return NoPod(
            f"no pod bound to this node is waiting for {len(requested)} {unified.GPU} "
            "(pending, a container asking for that many not yet allocated)"
        )
    pod, container = found
    if not pod.unified:
        taken = [i for i in requested if i in pool]
        if taken:
            return Refusal(
                f"pod {pod.key} asks for whole GPUs ({unified.GPU} without gpumem or gpucores) "
                f"but the kubelet picked {', '.join(taken)}, MIG instances set aside for unified "
                "pods"
            )
        return Decision(pod, container, tuple(requested))
    reserved = reservations.get(pod.key)
    instead = functools.partial(
        _unreserved,
        pod,
        container,
        requested=requested,
        reservations=reservations,
        bound={p.key for p in pods} if bound is None else bound,
        allocated=allocated,
        pool=pool,
        busy=busy,
    )
    if not reserved:
        return instead()
    answer = _unified(pod, container, reserved=reserved, allocated=allocated, busy=busy)
    others = _taken(pod, allocated, busy)
    if isinstance(answer, Refusal) and any(i.uuid in others for i in reserved):
        # Another pod took what was reserved for this one (bound with nothing reserved, the
        # reservation dropped too late): served as such a pod is, rather than failed.
        alternative = instead()
        if isinstance(alternative, Decision):
            return alternative
    return answer


def _taken(pod: GpuPod, allocated: Mapping[str, PodAllocation], busy: Collection[str]) -> set[str]:
    """Devices another pod holds (the ledger's other entries, ``busy``)."""
    mine = _allocation_of(pod, allocated)
    others = {
        uuid
        for key, entry in allocated.items()
        if key != pod.key or entry is not mine
        for uuid in entry.devices
    }
    others.update(busy)
    return others


def _given(pod: GpuPod, container: Container, allocated: Mapping[str, PodAllocation]) -> set[str]:
    """What ``pod``'s other containers hold that ``container`` may not get too: containers
    other than init ones never share an instance; init containers run first and alone, and the
    others may reuse what they had (as the kubelet reuses their devices)."""
    mine = _allocation_of(pod, allocated)
    init = {c.name for c in pod.containers if c.init}
    if container.init or mine is None:
        return set()
    return {u for name, ids in mine.containers if name not in init for u in ids}


def _unreserved(
    pod: GpuPod,
    container: Container,
    *,
    requested: Sequence[str],
    reservations: Mapping[str, Sequence[Instance]],
    bound: Collection[str],
    allocated: Mapping[str, PodAllocation],
    pool: Collection[str],
    busy: Collection[str],
) -> Resolution:
    """A unified pod bound with nothing reserved for it: created while the webhook was down (it
    fails open), so kube-scheduler bound it alone, counting ``nvidia.com/gpu`` the pool
    advertises for reserved pods. A real kubelet fails the pod's admission on a refused
    Allocate (UnexpectedAdmissionError, phase Failed) and nothing reserves for a bound pod in
    time, so it is served now, as a MIG pod bound ungated is served by the kubelet's pick: with
    pool devices that fit its ask and no pod holds, taken from reservations of pods not bound
    to this node (those are planned again: the controller drops a reservation whose instance
    another pod uses, ``controller/pinning.stolen``), the kubelet's picks first, then the
    smallest. Never an instance reserved for a pod bound here: that pod's Allocate comes next.
    Refused, naming the ask, when none fits. Also for a pod whose reserved instances another
    pod took (one bound so, before the controller dropped the reservation it robbed): its own
    free ones first, then as above, rather than a refusal that fails it."""
    not_here = {
        i.uuid: key
        for key, insts in reservations.items()
        if key == pod.key or key not in bound
        for i in insts
        if i.uuid is not None and i.uuid in pool and not i.replica
    }
    taken = _taken(pod, allocated, busy) | _given(pod, container, allocated)
    found = {
        i.uuid: i
        for key, insts in reservations.items()
        for i in insts
        if i.uuid is not None
        and not_here.get(i.uuid) == key
        and i.uuid not in taken
        and _fits(i, container.ask)
    }
    picked = set(requested)
    chosen = sorted(
        found.values(),
        key=lambda i: (
            not_here.get(i.uuid or "") != pod.key,
            i.uuid not in picked,
            _rank(i, container.ask),
        ),
    )
    if len(chosen) < container.count:
        ask = container.ask.text() if container.ask is not None else f"gpu {container.count}"
        return Refusal(
            f"pod {pod.key}: no MIG instance is reserved for it on this node, nor any MPS slice "
            "or time-slicing replica (the GpuLayout spec names none with reservedFor), and the "
            f"unified pool has {len(chosen)} free that serve its container {container.name} "
            f"({ask}) of the {container.count} it asks for (bound without migpilot: created "
            "while the webhook was down?)"
        )
    return Decision(
        pod,
        container,
        tuple(i.uuid for i in chosen[: container.count] if i.uuid is not None),
        taken_from=tuple(
            sorted({not_here[i.uuid] for i in chosen[: container.count] if i.uuid} - {pod.key})
        ),
    )


def _fits(inst: Instance, ask: unified.GpuAsk | None) -> bool:
    """Whether ``inst`` (a MIG instance of a known model, or an MPS slice) serves ``ask``."""
    if ask is None or inst.replica:
        return False
    if inst.is_slice:
        return _slice_fits(inst, ask)
    profile = _profile(inst.model, inst.profile)
    return (
        inst.model is not None and profile is not None and unified.serves(ask, inst.model, profile)
    )


def _unified(
    pod: GpuPod,
    container: Container,
    *,
    reserved: Sequence[Instance],
    allocated: Mapping[str, PodAllocation],
    busy: Collection[str],
) -> Resolution:
    others = _taken(pod, allocated, busy)
    what = _kind(reserved)
    missing = [str(i) for i in reserved if i.uuid is None]
    if missing:
        verb = (
            "are not served" if all(i.is_slice or i.replica for i in reserved) else "do not exist"
        )
        return Refusal(f"pod {pod.key}: the {what} reserved for it {verb}: {', '.join(missing)}")
    held = [str(i) for i in reserved if i.uuid in others]
    if held:
        return Refusal(
            f"pod {pod.key}: the {what} reserved for it are allocated to another pod: "
            f"{', '.join(held)}"
        )
    given = _given(pod, container, allocated)
    free = [i for i in reserved if i.uuid not in given]
    if len(free) < container.count:
        return Refusal(
            f"pod {pod.key}: container {container.name} asks for {container.count} "
            f"{unified.GPU}, {len(free)} of the {_noun(reserved)} reserved for it are left "
            f"({', '.join(str(i) for i in free) or 'none'})"
        )
    chosen = sorted(free, key=lambda i: _rank(i, container.ask))[: container.count]
    # Every reserved instance has a UUID here (``missing`` refused the others).
    return Decision(pod, container, tuple(i.uuid for i in chosen if i.uuid is not None))


def _kind(reserved: Sequence[Instance]) -> str:
    """``MIG instances``, ``MPS slices``, ``time-slicing replicas``, or those found joined
    by ``and``."""
    names = {"replica": "time-slicing replicas", "slice": "MPS slices", "mig": "MIG instances"}
    kinds = {_what(i) for i in reserved}
    return " and ".join(names[k] for k in ("mig", "slice", "replica") if k in kinds)


def _what(inst: Instance) -> str:
    return "replica" if inst.replica else "slice" if inst.is_slice else "mig"


def _noun(reserved: Sequence[Instance]) -> str:
    """``instances``, ``slices`` or ``replicas``, as :func:`_kind` without the kind's name."""
    kinds = {_what(i) for i in reserved}
    if kinds == {"slice"}:
        return "slices"
    return "replicas" if kinds == {"replica"} else "instances"


def _rank(inst: Instance, ask: unified.GpuAsk | None) -> tuple[int, int, int, int, int]:
    """The instance the container should get first: the profile the planner would pick for
    its ask, then one that serves it, smallest first, then any (the planner's reservation is
    trusted over this module's reading of the ask). A slice: one that serves the ask first,
    then the smallest."""
    model, place = inst.model, inst.gpu * 100 + inst.start
    if inst.memory_gb is not None:
        memory, cores = inst.memory_gb * 1024, inst.cores if inst.cores is not None else 100
        return (1, 0 if _slice_fits(inst, ask) else 1, memory, cores, place)
    profile = _profile(model, inst.profile)
    if model is None or profile is None:
        return (1, 1, 0, 0, place)
    memory, compute = profile.memory_mib or 0, profile.compute_slices
    name = unified.profile_for(ask, model) if ask is not None else None
    need = _profile(model, name)
    fits = need is not None and memory >= (need.memory_mib or 0) and compute >= need.compute_slices
    return (0 if name == inst.profile else 1, 0 if fits else 1, memory, compute, place)


def _slice_fits(inst: Instance, ask: unified.GpuAsk | None) -> bool:
    """Whether an MPS slice serves a container's ask (memory in MiB or as a share of the GPU's
    memory, compute share); unknown (no ask, no model for a share) counts as serving."""
    if ask is None or inst.memory_gb is None:
        return True
    have = inst.memory_gb * 1024
    if ask.memory_mib is not None and have < ask.memory_mib:
        return False
    if ask.memory_percent is not None and inst.model is not None:
        total = sharing_mps.memory_gb(inst.model) * 1024
        if have * 100 < ask.memory_percent * total:
            return False
    cores = inst.cores if inst.cores is not None else 100
    return ask.cores_percent is None or cores >= ask.cores_percent


def _profile(model: profiles.GpuModel | None, name: str | None) -> profiles.Profile | None:
    if model is None or name is None:
        return None
    try:
        return model.profile_named(name)
    except errors.UnknownProfileError:
        return None


def set_aside(
    *,
    reservations: Mapping[str, Sequence[Instance]],
    unified_pods: Collection[str],
    allocated: Mapping[str, PodAllocation],
    existing: Collection[str],
) -> frozenset[str]:
    """The unified pool: MIG UUIDs and MPS slice IDs (of ``existing`` devices) reserved for a
    unified pod or handed by Allocate to a unified pod still alive (every ledger entry is)."""
    out = {
        i.uuid
        for key, insts in reservations.items()
        if key in unified_pods
        for i in insts
        if i.uuid is not None
    }
    out.update(u for entry in allocated.values() if entry.unified for u in entry.devices)
    return frozenset(u for u in out if u in existing)


def preferred(
    resolution: Resolution,
    *,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
    pool: Collection[str],
) -> tuple[str, ...]:
    """The devices GetPreferredAllocation should put first (as must-include) for the pod
    Allocate will serve: a unified pod's own instances, or devices outside the unified pool
    for a whole-GPU pod. The caller packs the rest as usual."""
    must = list(dict.fromkeys(must_include))
    if not isinstance(resolution, Decision):
        return tuple(must)
    offered = set(available)
    if resolution.pod.unified:
        wanted = [i for i in resolution.device_ids if i in offered and i not in must]
    else:
        wanted = [i for i in available if i not in pool and i not in must]
    return (*must, *wanted[: max(size - len(must), 0)])
