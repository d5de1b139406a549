"""The GpuLayout custom resource (``gpulayouts.migpilot.io``, ``v1alpha1``) as pure values.

One GpuLayout per GPU node, cluster-scoped, named after the node. The controller owns ``spec``
(the instances each GPU should hold, some reserved for a pending pod) and writes it with
server-side apply as ``migpilot-controller``; the node agent owns ``status`` (the instances that
exist and their state) and writes it through the status subresource as ``migpilot-agent``. Both
shells share these types, so there is one model of the object.

This module holds the resource's identity, its frozen dataclasses and enums, and what can be
read off them (:func:`used_by`, :func:`allocated`); the instance lifecycle is one table,
:data:`TRANSITIONS` (``docs/gpulayout.md``). Its wire format, the JSON the API server holds
(parsing, writing, the patches each writer sends), is :mod:`migpilot.api.gpulayouts_wire`.

Pure core: imports nothing of migpilot (below even the planner's types); no Kubernetes client,
no clock (condition timestamps are handed in as text).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

GROUP = "migpilot.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "GpuLayout"
PLURAL = "gpulayouts"
CRD_NAME = f"{PLURAL}.{GROUP}"
CONTROLLER_FIELD_MANAGER = "migpilot-controller"
"""Server-side apply field manager of ``spec``."""
AGENT_FIELD_MANAGER = "migpilot-agent"
"""Server-side apply field manager of ``status``."""
LEADER_ANNOTATION = "migpilot.io/leader"
"""The controller that last wrote ``spec`` (its Lease identity): who acted, as a fact on the
API server (all controllers share one field manager, so managedFields cannot tell)."""
TERM_ANNOTATION = "migpilot.io/leader-term"
"""The Lease's ``leaseTransitions`` when that controller took it: its term as leader."""
UNIFIED_RESOURCE = "nvidia.com/gpu"
"""What an instance kept for a unified pod is advertised as (``spec...instances[].resource``)."""
READY = "Ready"
"""The condition type the ``Ready`` printer column shows."""
PLAN_LISTED = "PlanListed"
"""The status condition of a node in DRA mode: ``True`` when its agent lists the spec's free
placements first in its ResourceSlices (``observedGeneration``: of that spec), ``False`` when it
lists nothing first (the controller's Lease stale to it, or the slices not written). The
controller lets a pod it steers to the node go only while it is ``True`` (``docs/dra.md``)."""


class InstanceState(enum.StrEnum):
    """What the agent reports about one MIG instance that exists (or is being made)."""

    FREE = "free"
    """Exists, unallocated and unreserved: the only state the planner may destroy or hand out."""
    USED = "used"
    """Allocated to a container (the device plugin or the kubelet's PodResources says so)."""
    RESERVED = "reserved"
    """Kept for the pending pod the spec's ``reservedFor`` names."""
    CREATING = "creating"
    """Being created by the agent; no UUID yet."""
    DESTROYING = "destroying"
    """Being destroyed by the agent (it was free); gone at the next report."""


UNTOUCHABLE = frozenset({InstanceState.USED, InstanceState.RESERVED, InstanceState.CREATING})
"""States the planner must neither destroy nor hand to another pod."""


@dataclass(frozen=True, slots=True)
class Transition:
    """One allowed change of an instance's state between two agent reports."""

    before: InstanceState | None
    """``None``: the instance was not listed."""
    after: InstanceState | None
    """``None``: the instance is no longer listed."""
    why: str


_S = InstanceState
TRANSITIONS: tuple[Transition, ...] = (
    Transition(None, _S.CREATING, "the spec lists an instance that does not exist"),
    Transition(None, _S.FREE, "found at agent start, or made outside migpilot (static mode)"),
    Transition(None, _S.USED, "found in use at agent start"),
    Transition(None, _S.RESERVED, "found at agent start and reserved by the spec"),
    Transition(_S.CREATING, _S.FREE, "created"),
    Transition(_S.CREATING, _S.RESERVED, "created for the pod the spec reserves it for"),
    Transition(_S.CREATING, None, "creation failed; the agent retries from scratch"),
    Transition(_S.FREE, _S.RESERVED, "the controller reserved it for a pending pod"),
    Transition(_S.FREE, _S.USED, "a pod took it without a reservation (kube-scheduler alone)"),
    Transition(_S.FREE, _S.DESTROYING, "the spec no longer lists it"),
    Transition(_S.RESERVED, _S.USED, "the reserved pod was bound and got it"),
    Transition(_S.RESERVED, _S.FREE, "the reservation was dropped (pod deleted or re-planned)"),
    Transition(_S.USED, _S.FREE, "its pod ended"),
    Transition(_S.DESTROYING, None, "destroyed"),
    Transition(_S.DESTROYING, _S.FREE, "the destroy failed; the instance is still there"),
)
"""The instance lifecycle. Only a free instance becomes destroying; the CRD enforces that edge
with a CEL transition rule, so even a confused agent cannot report an instance in use as being
destroyed."""
_ALLOWED = frozenset((t.before, t.after) for t in TRANSITIONS)


def transition_allowed(before: InstanceState | None, after: InstanceState | None) -> bool:
    """Whether an instance may go from ``before`` to ``after`` (unchanged is always allowed)."""
    return before == after or (before, after) in _ALLOWED


class ConditionStatus(enum.StrEnum):
    """A condition's status, as ``metav1.Condition`` spells it."""

    TRUE = "True"
    FALSE = "False"
    UNKNOWN = "Unknown"


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class InstanceSpec:
    """An instance the controller wants on a GPU."""

    profile: str
    """Canonical profile name (``3g.40gb``, ``1g.10gb+me``)."""
    start: int
    """First memory slot."""
    reserved_for: str | None = None
    """``namespace/name`` of the pending pod this instance is kept for; ``None``: not reserved."""
    resource: str | None = None
    """The extended resource the agent advertises the reserved instance under:
    :data:`UNIFIED_RESOURCE` when it is kept for a unified pod (``docs/unified.md``); ``None``:
    its MIG profile's own resource. Only with ``reserved_for``."""


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """An MPS memory slice the controller wants on a GPU of a node in mode ``mps``
    (``docs/modes.md``): an MPS client's share, held to ``memory_gb`` by
    ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and to ``cores`` by
    ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``."""

    id: int
    """Stable within its GPU."""
    memory_gb: int
    cores: int | None = None
    """Compute share in percent, 1-100; ``None``: unlimited."""
    reserved_for: str | None = None
    """``namespace/name`` of the pending pod this slice is kept for; ``None``: not reserved."""
    resource: str | None = None
    """:data:`UNIFIED_RESOURCE` when the slice is kept for a unified pod (``nvidia.com/gpu``
    with ``gpumem``, ``docs/unified.md``): the agent advertises it as ``nvidia.com/gpu``;
    ``None``: as ``nvidia.com/gpu-<N>gb``. Only with ``reserved_for``."""


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """A time-slicing replica the controller keeps for a unified pod on a GPU of a node in mode
    ``time-slicing`` (``docs/modes.md``): the replica (NVIDIA's sharing config advertises each
    GPU as ``replicas`` ``nvidia.com/gpu`` devices, ``<gpu-uuid>::<id>``) the pod's Allocate
    gets. Only reserved replicas are listed: the replicas themselves are the sharing config's."""

    id: int
    """The replica's number on its GPU (the ``::<id>`` of its device ID)."""
    reserved_for: str
    """``namespace/name`` of the pending unified pod it is kept for."""


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """The instances the controller wants on one GPU, by start (or its MPS slices, by id)."""

    index: int
    model: str | None
    """The GPU model (informative; when given, profiles and the layout are checked against it)."""
    instances: tuple[InstanceSpec, ...]
    mps: tuple[SliceSpec, ...] = ()
    """On a node in mode ``mps``: the GPU's MPS slices (then it has no MIG instances)."""
    replicas: tuple[ReplicaSpec, ...] = ()
    """On a node in mode ``time-slicing``: the replicas kept for unified pods, by id."""
    mig: bool | None = None
    """The MIG mode the GPU should have, on a node labelled ``migpilot.io/mig-mode=dynamic``
    (``docs/migmode.md``); ``None``: keep the mode it has. ``False`` holds no instances."""
    reserved_for: str | None = None
    """``namespace/name`` of the pending whole-GPU pod (``nvidia.com/gpu: N`` without gpumem)
    this GPU is kept for, whole: only with ``mig`` ``False`` and nothing on the GPU
    (``docs/migmode.md``); ``None``: not reserved."""


@dataclass(frozen=True, slots=True)
class LayoutSpec:
    """The controller's half: the target layout of each GPU, by index."""

    gpus: tuple[GpuSpec, ...]


@dataclass(frozen=True, slots=True)
class InstanceStatus:
    """An instance the agent reports."""

    profile: str
    start: int
    uuid: str | None
    """MIG device UUID; ``None`` only while creating."""
    state: InstanceState
    used_by: str | None = None
    """``namespace/name`` of the unified pod the agent's Allocate handed it to (state
    ``used`` only; ``docs/unified.md``). ``None``: not known to be a unified pod's (a
    ``nvidia.com/mig-*`` pod's instance, or a unified pod not yet allocated)."""


@dataclass(frozen=True, slots=True)
class SliceStatus:
    """An MPS slice the agent serves (advertised as one ``nvidia.com/gpu-<N>gb`` device)."""

    id: int
    memory_gb: int
    cores: int | None
    state: InstanceState
    """``free``, ``reserved`` (kept for a pod by the spec) or ``used`` (a pod holds it)."""
    used_by: str | None = None
    """``namespace/name`` of the pod holding it, when the agent knows (state ``used`` only)."""


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """A time-slicing replica the agent advertises (one ``nvidia.com/gpu`` device,
    ``<gpu-uuid>::<id>``, on a node in mode ``time-slicing``)."""

    id: int
    state: InstanceState
    """``free``, ``reserved`` (the spec keeps it for a pod, none holds it) or ``used``."""
    used_by: str | None = None
    """``namespace/name`` of the pod holding it, when the agent knows (state ``used`` only)."""


SLICE_STATES = frozenset({InstanceState.FREE, InstanceState.RESERVED, InstanceState.USED})
"""The states a slice may report: it is made and removed with the daemon's bookkeeping, never
``creating`` or ``destroying``."""


@dataclass(frozen=True, slots=True)
class MigModeStatus:
    """A GPU's MIG mode as NVML reports it (``nvmlDeviceGetMigMode``): ``pending`` differs from
    ``current`` while a change waits for a GPU reset."""

    current: bool
    pending: bool


@dataclass(frozen=True, slots=True)
class GpuStatus:
    """One GPU as the agent sees it, and its instances by start (or its MPS slices, by id)."""

    index: int
    model: str
    """Product name as NVML reports it (any catalog alias)."""
    uuid: str
    instances: tuple[InstanceStatus, ...]
    mps: tuple[SliceStatus, ...] = ()
    replicas: tuple[ReplicaStatus, ...] = ()
    """On a node in mode ``time-slicing``: every replica of the GPU, by id (how many the sharing
    config makes of it, and which pod holds each)."""
    mig_mode: MigModeStatus | None = None
    """On a node labelled ``migpilot.io/mig-mode=dynamic``: the GPU's MIG mode (``None``
    elsewhere: a mode the agent never changes is not reported)."""


@dataclass(frozen=True, slots=True)
class Condition:
    """A ``metav1.Condition``."""

    type: str
    status: ConditionStatus
    reason: str
    message: str
    last_transition_time: str
    """RFC 3339 text, given by the shell (the core has no clock)."""
    observed_generation: int | None = None


@dataclass(frozen=True, slots=True)
class Summary:
    """The counts ``kubectl get gpulayouts`` shows (derived from the GPUs; never stored apart)."""

    gpus: int
    instances: int
    free: int


@dataclass(frozen=True, slots=True)
class LayoutStatus:
    """The agent's half: what exists on the node."""

    observed_generation: int | None
    """The spec generation the agent last acted on."""
    gpus: tuple[GpuStatus, ...]
    conditions: tuple[Condition, ...] = ()

    @property
    def summary(self) -> Summary:
        """Counts for the printer columns."""
        insts = [i for g in self.gpus for i in g.instances]
        free = sum(i.state is InstanceState.FREE for i in insts)
        return Summary(len(self.gpus), len(insts), free)


@dataclass(frozen=True, slots=True)
class GpuLayout:
    """One node's GpuLayout object."""

    name: str
    """The node's name."""
    spec: LayoutSpec
    status: LayoutStatus | None = None
    """``None`` until the agent first reports."""
    generation: int | None = None
    """``metadata.generation`` as the apiserver set it (read-only)."""


# --------------------------------------------------------------------------- unified pods


def used_by(layout: GpuLayout) -> dict[str, tuple[tuple[int, int, str], ...]]:
    """Pod ``namespace/name`` -> the instances ((GPU, start, profile), sorted) the status
    reports handed to it by the agent's Allocate (``usedBy``; unified pods only)."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    for g in layout.status.gpus if layout.status is not None else ():
        for i in g.instances:
            if i.used_by is not None:
                out.setdefault(i.used_by, []).append((g.index, i.start, i.profile))
    return {pod: tuple(sorted(found)) for pod, found in out.items()}


def allocated(layout: GpuLayout, pod: str) -> bool:
    """Whether the unified pod ``pod`` (``namespace/name``) has been allocated on this node:
    the status reports some instance, MPS slice or time-slicing replica ``usedBy`` it, and every
    one the spec still reserves for it is among them (a pod whose containers are allocated one
    by one is allocated once the last one is). The controller may then drop the pod's
    reservations and let the next unified pod go to the node (``docs/unified.md``)."""
    status = layout.status.gpus if layout.status is not None else ()
    have: set[tuple[object, ...]] = {("instance", *i) for i in used_by(layout).get(pod, ())}
    have |= {("slice", g.index, sl.id) for g in status for sl in g.mps if sl.used_by == pod}
    have |= {("replica", g.index, r.id) for g in status for r in g.replicas if r.used_by == pod}
    if not have:
        return False
    spec = layout.spec.gpus
    wanted: set[tuple[object, ...]] = {
        ("instance", g.index, i.start, i.profile)
        for g in spec
        for i in g.instances
        if i.reserved_for == pod
    }
    wanted |= {("slice", g.index, sl.id) for g in spec for sl in g.mps if sl.reserved_for == pod}
    wanted |= {
        ("replica", g.index, r.id) for g in spec for r in g.replicas if r.reserved_for == pod
    }
    return wanted <= have
