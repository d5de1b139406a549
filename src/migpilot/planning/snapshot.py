"""Cluster snapshots: what the planner sees (nodes, their GPUs and MIG instances, pending pods).

A snapshot is also a user-facing file format (version 1, YAML or JSON) so that anyone can ask the
planner what it would do for a cluster without running one:

.. code-block:: yaml

    version: 1
    policy: binpack                 # optional node policy: binpack (default) or spread
    gpuPolicy: spread               # optional GPU policy: spread (default) or binpack
    nodes:
      - name: node-0
        labels: {zone: a}
        taints: [{key: k, value: v, effect: NoSchedule}]
        unschedulable: false
        allocatable: {cpu: "64", memory: 512Gi}      # free for pending pods; absent: unlimited
        capacity: {cpu: "96", memory: 768Gi}         # optional: the whole node, for the scores
        gpus:
          - model: NVIDIA A100-SXM4-80GB             # any catalog alias
            instances:
              - {profile: 3g.40gb, start: 4, used: true}
    pods:
      - name: p1
        namespace: default
        priority: 0
        requests: {nvidia.com/mig-1g.10gb: 2, cpu: "4", memory: 8Gi}
        nodeSelector: {zone: a}
        affinity: {nodeAffinity: {requiredDuringSchedulingIgnoredDuringExecution: ...}}
        tolerations: [{key: k, operator: Equal, value: v, effect: NoSchedule}]
      - name: p2                    # a unified (HAMi-style) request: the planner picks the slice
        requests: {nvidia.com/gpu: 1, nvidia.com/gpumem: 8000, cpu: "2"}
        annotations: {nvidia.com/use-gputype: H100, hami.io/gpu-scheduler-policy: binpack}
      - name: p3                    # a whole-GPU pod: served only on dynamic nodes
        requests: {nvidia.com/gpu: 1, cpu: "8"}

A node labelled ``migpilot.io/mig-mode: dynamic`` (or given ``dynamic: true``, which adds the
label) may have an idle GPU's MIG mode switched (``docs/migmode.md``); its GPUs may be whole
(``mig: false``, with ``used: true`` when a pod holds or has reserved the whole GPU).

A pod asks either for MIG resources by name (``nvidia.com/mig-<profile>``, as a device plugin
advertises them) or for a *unified* request (:mod:`migpilot.planning.unified`: ``nvidia.com/gpu``
with ``nvidia.com/gpumem``, ``nvidia.com/gpumem-percentage`` or ``nvidia.com/gpucores``, or with
the annotation ``nvidia.com/vgpu-mode: mig``), which :meth:`Pod.profiles_on` resolves per GPU
model, or, in the file, for whole GPUs (``nvidia.com/gpu: N`` alone, read by
:func:`whole_gpu_requests` into :attr:`Snapshot.whole_pods`). :func:`pod_requests` and
:func:`container_requests` are the one parser of pod requests: the file, the simulator's traces
and the controller's Kubernetes pods all build them there.

:func:`parse` turns the decoded document into frozen values and rejects bad input with one line
that names the place (``pods[2].requests: ...``). Pure: it is given data, never a path.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from migpilot import digits, errors
from migpilot.mig import catalog, layouts, profiles
from migpilot.planning import interpod, modes, quantities, scoring
from migpilot.planning import unified as unifying
from migpilot.planning.interpod import read_mapping as _mapping
from migpilot.planning.interpod import read_only_fields as _only
from migpilot.planning.interpod import read_sequence as _sequence

K = TypeVar("K", bound=Hashable)

SNAPSHOT_VERSION = 1
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"

Policy = scoring.Policy
"""Binpack or spread (:class:`migpilot.planning.scoring.Policy`), for nodes and for GPUs."""


@dataclass(frozen=True, slots=True)
class Taint:
    """A node taint."""

    key: str
    value: str
    effect: str
    """NoSchedule, PreferNoSchedule or NoExecute."""


@dataclass(frozen=True, slots=True)
class Toleration:
    """A pod toleration, with Kubernetes' matching rules."""

    key: str
    """Empty with operator Exists tolerates every taint."""
    operator: str
    """Equal or Exists."""
    value: str
    effect: str
    """Empty matches every effect."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """A node selector requirement of a required node-affinity term."""

    key: str
    operator: str
    """In, NotIn, Exists, DoesNotExist, Gt or Lt."""
    values: tuple[str, ...]
    field: bool = False
    """A ``matchFields`` requirement: on the node's ``metadata.name`` (the only field a node
    selector may name, with In or NotIn and one value), not on a label."""


@dataclass(frozen=True, slots=True)
class ExistingInstance:
    """A MIG instance that exists on a GPU now."""

    profile: str
    """Canonical profile name on the GPU's model."""
    start: int
    used: bool
    """Allocated to a pod or reserved: the planner must never destroy or move it."""

    @property
    def instance(self) -> layouts.Instance:
        """The instance without its used flag."""
        return layouts.Instance(self.start, self.profile)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of a node and its current MIG instances."""

    index: int
    model: profiles.GpuModel
    instances: tuple[ExistingInstance, ...]
    mps: tuple[modes.MpsSlice, ...] = ()
    """On a node in mode ``mps``: its MPS memory slices (:mod:`migpilot.planning.modes`)."""
    replicas: int = 0
    """On a node in mode ``time-slicing``: the replicas the GPU is advertised as."""
    replicas_used: int = 0
    """Of :attr:`replicas`, those held by pods or reserved."""
    mig: bool = True
    """Its current MIG mode; ``False``: a whole GPU (MIG off), which only a node labelled
    ``migpilot.io/mig-mode=dynamic`` (:attr:`Node.dynamic`) lists (``docs/migmode.md``)."""
    whole_taken: bool = False
    """A whole GPU held by a pod or reserved for one: its mode is never switched."""
    layout: layouts.Layout = field(init=False, compare=False, repr=False)
    """The current layout (used and free instances), derived."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layout", layouts.Layout.of(i.instance for i in self.instances))


@dataclass(frozen=True, slots=True)
class Resources:
    """CPU and memory amounts."""

    cpu_milli: int
    memory_bytes: int


@dataclass(frozen=True, slots=True)
class Node:
    """A node with MIG-capable GPUs."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[Taint, ...]
    unschedulable: bool
    allocatable: Resources | None
    """CPU and memory left for the pending pods; ``None`` means not constrained."""
    gpus: tuple[Gpu, ...]
    capacity: Resources | None = None
    """The node's whole CPU and memory, for the policy scores (:mod:`scoring`); ``None``: taken
    as :attr:`allocatable`, so only the plan's own pods count as use."""
    mode: modes.Mode = modes.Mode.MIG
    """How the node shares its GPUs (label ``migpilot.io/mode``; absent: ``mig``)."""
    dynamic: bool = False
    """Labelled ``migpilot.io/mig-mode=dynamic``: an idle GPU's MIG mode may be switched, and its
    whole GPUs (MIG off) are listed too (:mod:`migpilot.planning.dynamic`)."""


@dataclass(frozen=True, slots=True)
class MigRequest:
    """``count`` instances of a profile, as the pod names it: a pod asking for
    ``nvidia.com/mig-1g.10gb.me`` asks for ``1g.10gb+me``, on any GPU whose device plugin
    advertises exactly that resource."""

    profile: str
    """Canonical profile name (the resource name less ``nvidia.com/mig-``, ``.me`` as ``+me``)."""
    count: int


Demand = tuple[tuple[MigRequest, ...], unifying.UnifiedRequest | None]
"""What a pod asks of GPUs, as one hashable value: its MIG requests by name, or its unified
request (pods with equal demands need the same instances on every model)."""


@dataclass(frozen=True, slots=True)
class Pod:
    """A pod waiting for MIG resources."""

    name: str
    namespace: str
    priority: int
    mig: tuple[MigRequest, ...]
    """MIG instances asked for by name; empty for a unified pod."""
    cpu_milli: int
    memory_bytes: int
    node_selector: Mapping[str, str]
    affinity: tuple[tuple[Requirement, ...], ...]
    """Required node affinity: OR of terms, each an AND of requirements; empty: no constraint."""
    tolerations: tuple[Toleration, ...]
    unified: unifying.UnifiedRequest | None = None
    """A unified (HAMi-style) request, resolved per GPU model; ``None`` for a MIG pod."""
    node_policy: Policy | None = None
    """``hami.io/node-scheduler-policy``; ``None``: the snapshot's :attr:`Snapshot.policy`."""
    gpu_policy: Policy | None = None
    """``hami.io/gpu-scheduler-policy``; ``None``: the snapshot's :attr:`Snapshot.gpu_policy`."""
    mps: tuple[modes.MpsRequest, ...] = ()
    """MPS slices asked for by name (``nvidia.com/gpu-<N>gb``); then :attr:`mig` is empty and
    :attr:`unified` is ``None``."""
    terms: interpod.PodTerms = interpod.NO_TERMS
    """Its labels, required pod (anti-)affinity and hard topology spread constraints
    (:mod:`migpilot.planning.podaffinity` applies them)."""
    whole: int = 0
    """A whole-GPU pod (``nvidia.com/gpu: N``, no gpumem, cores or percentage): the ``N`` whole
    GPUs (MIG off) it asks for; then :attr:`mig`, :attr:`mps` are empty and :attr:`unified` is
    ``None``. Such pods are in :attr:`Snapshot.whole_pods`, never in :attr:`Snapshot.pods`."""
    dra: bool = False
    """It asks through DRA ResourceClaims of ``mig.migpilot.io`` (``docs/dra.md``): kube-scheduler
    allocates its placement from the devices a node in DRA mode (label
    ``migpilot.io/mode=dra``) publishes, so only such a node serves it, and such a node serves
    no other pod (:func:`migpilot.planning.constraints.rejection`)."""

    @property
    def key(self) -> str:
        """``namespace/name``, unique in a snapshot."""
        return f"{self.namespace}/{self.name}"

    @property
    def demand(self) -> Demand:
        """What the pod asks of GPUs (hashable: planners group pods by it)."""
        return (self.mig, self.unified)

    @property
    def count(self) -> int:
        """MIG instances asked for in all."""
        if self.unified is not None:
            return self.unified.count
        return sum(r.count for r in self.mig) + sum(r.count for r in self.mps)

    @property
    def parts(self) -> tuple[int, ...]:
        """Instances per part of the request: per MIG request line, or per container of a
        unified request (each part gets one profile per model: :meth:`parts_on`)."""
        if self.unified is not None:
            return tuple(a.count for a in self.unified.asks)
        return tuple(r.count for r in self.mig)

    def parts_on(self, model: profiles.GpuModel) -> tuple[str | None, ...]:
        """Per part (:attr:`parts`), the profile that serves it on ``model`` (``None``: none)."""
        return parts_on(self.demand, model)

    def profiles_on(self, model: profiles.GpuModel) -> tuple[str, ...] | None:
        """The canonical profile names this pod needs on ``model``, or ``None`` if not offered."""
        return resolve_demand(self.demand, model)

    def served_in(self, mode: modes.Mode) -> bool:
        """Whether a node in ``mode`` may serve this pod (:func:`modes.serves`: what it asks,
        and its ``nvidia.com/vgpu-mode``)."""
        return modes.serves(
            mode,
            mig=bool(self.mig),
            mps=bool(self.mps),
            unified_request=self.unified is not None,
            unified_mode=self.unified.mode if self.unified is not None else None,
        )

    def needed_mode(self) -> str:
        """The node modes that serve this pod, as reasons write them."""
        return modes.needed_mode(
            mig=bool(self.mig),
            mps=bool(self.mps),
            unified_mode=self.unified.mode if self.unified is not None else None,
        )

    def policies(self, snap: Snapshot) -> tuple[Policy, Policy]:
        """The node and GPU policies this pod is placed by in ``snap``."""
        return (self.node_policy or snap.policy, self.gpu_policy or snap.gpu_policy)

    def request_text(self) -> str:
        """The request as people write it: ``2 x 1g.10gb + 3g.40gb`` or ``gpu 1, gpumem 8000``."""
        if self.whole:
            return f"{self.whole} whole GPU{'s' if self.whole > 1 else ''}"
        if self.unified is not None:
            return self.unified.text()
        if self.mps:
            return " + ".join(
                f"{r.count} x {r.resource}" if r.count > 1 else r.resource for r in self.mps
            )
        return " + ".join(
            f"{r.count} x {r.profile}" if r.count > 1 else r.profile for r in self.mig
        )


def resource_name(profile: str) -> str:
    """The extended resource the device plugin advertises for a canonical profile name
    (mixed strategy: ``1g.10gb+me`` -> ``nvidia.com/mig-1g.10gb.me``)."""
    return MIG_RESOURCE_PREFIX + profile.replace("+", ".")


def mig_profile(resource: str) -> str:
    """The canonical profile name a MIG resource name stands for, exactly.

    ``nvidia.com/mig-1g.10gb.me`` -> ``1g.10gb+me``. kube-scheduler matches resource names as
    strings, so only the spelling the device plugin advertises is accepted: no other case, no
    ``+``, no compute-instance profile. Raise :class:`SnapshotError` naming the problem.
    """
    if not resource.startswith(MIG_RESOURCE_PREFIX):
        raise errors.SnapshotError(f"{resource} is not a MIG resource (nvidia.com/mig-<profile>)")
    try:
        parsed = profiles.parse_profile_name(resource)
    except errors.UnknownProfileError as err:
        raise errors.SnapshotError(str(err)) from None
    if parsed.compute is not None and parsed.compute != parsed.g:
        raise errors.SnapshotError(
            f"{resource} is a compute-instance profile; migpilot manages whole GPU "
            f"instances (ask for {resource_name(parsed.canonical)})"
        )
    canonical = parsed.canonical
    if resource != resource_name(canonical):
        raise errors.SnapshotError(
            f"{resource} is not a resource name any device plugin advertises "
            f"(did you mean {resource_name(canonical)}?)"
        )
    return canonical


def _counted(value: Any, where: str) -> int:
    """A whole number of instances (an int, or a string of digits as quantities are)."""
    if isinstance(value, bool):
        count = None
    elif isinstance(value, int):
        count = value
    elif isinstance(value, str) and digits.is_digits(value.strip()):
        count = int(value)
    else:
        count = None
    if count is None or count < 0:
        raise errors.SnapshotError(f"{where}: expected a whole number of instances, got {value!r}")
    return count


@dataclass(frozen=True, slots=True)
class Requests:
    """What a pod asks for, as the planner sees it."""

    mig: tuple[MigRequest, ...]
    """MIG instances by canonical profile name, sorted, counts > 0; empty for a unified pod."""
    cpu_milli: int
    memory_bytes: int
    unified: unifying.UnifiedRequest | None = None
    """The unified request, for a pod that makes one (then :attr:`mig` is empty)."""
    node_policy: Policy | None = None
    """From ``hami.io/node-scheduler-policy`` (any pod may carry it)."""
    gpu_policy: Policy | None = None
    """From ``hami.io/gpu-scheduler-policy``."""
    mps: tuple[modes.MpsRequest, ...] = ()
    """MPS slices by size (``nvidia.com/gpu-<N>gb``), sorted, counts > 0."""
    whole: int = 0
    """Whole GPUs (``nvidia.com/gpu: N`` of a pod that is not unified): :func:`whole_requests`
    builds such requests; the parsers above refuse them."""


def whole_requests(gpus: int, *, cpu_milli: int, memory_bytes: int) -> Requests:
    """The requests of a whole-GPU pod (``nvidia.com/gpu: gpus``, MIG off), served only on
    nodes labelled ``migpilot.io/mig-mode=dynamic``. Raise naming the count when it is not
    at least 1."""
    if gpus < 1:
        raise errors.SnapshotError(f"a whole-GPU pod asks for at least 1 GPU, got {gpus}")
    return Requests(mig=(), cpu_milli=cpu_milli, memory_bytes=memory_bytes, whole=gpus)


def whole_gpu_requests(
    resources: Mapping[str, Any], *, where: str, annotations: Mapping[str, Any] | None = None
) -> Requests | None:
    """The requests of a whole-GPU pod given as one mapping (``{nvidia.com/gpu: 1, cpu: "8"}``:
    ``nvidia.com/gpu`` without gpumem, gpumem-percentage or gpucores, and no
    ``nvidia.com/vgpu-mode``), the snapshot file's and the traces' form; ``None`` for any other
    pod (:func:`pod_requests` reads it). Raise naming the field when it asks for anything else
    of GPUs besides, or for no GPU."""
    annotations = annotations or {}
    if unifying.GPU not in resources or unifying.VGPU_MODE in annotations:
        return None
    if any(k in resources for k in unifying.UNIFIED_RESOURCES):
        return None
    others = sorted(
        str(k) for k in resources if str(k).startswith("nvidia.com/") and k != unifying.GPU
    )
    if others:
        raise errors.SnapshotError(
            f"{where}: a whole-GPU pod ({unifying.GPU} without {unifying.GPUMEM}) asks for no "
            f"other GPU resource, but this one also asks for {others[0]}"
        )
    count = _counted(resources[unifying.GPU], f"{where}.{unifying.GPU}")
    if count < 1:
        raise errors.SnapshotError(
            f"{where}.{unifying.GPU}: a whole-GPU pod asks for at least 1 GPU, got {count}"
        )
    cpu = cpu_milli(resources["cpu"], where=f"{where}.cpu") if "cpu" in resources else 0
    mem = memory_bytes(resources["memory"], where=f"{where}.memory") if "memory" in resources else 0
    return whole_requests(count, cpu_milli=cpu, memory_bytes=mem)


_UNIFIED_RESOURCES = (
    unifying.GPU,
    unifying.GPUMEM,
    unifying.GPUMEM_PERCENT,
    unifying.GPUCORES,
)


def pod_requests(
    resources: Mapping[str, Any], *, where: str, annotations: Mapping[str, Any] | None = None
) -> Requests:
    """A pod's resource requests given as one mapping, as if of one container
    (``{nvidia.com/mig-1g.10gb: 2, cpu: "4", memory: 8Gi}``, or ``{nvidia.com/gpu: 1,
    nvidia.com/gpumem: 8000}``), with its annotations: the snapshot file's and the traces' form.

    :func:`container_requests` is the same parser for a pod's containers; errors name the field
    under ``where``.
    """
    return _requests([(where, resources)], [], annotations or {}, where=where)


def container_resources(container: Any) -> dict[str, Any]:
    """One container (raw Kubernetes JSON) as the mapping :func:`container_requests` reads: its
    resources as kube-scheduler counts them, limits overridden by requests. Anything not a
    mapping reads as no resources."""
    c = container if isinstance(container, Mapping) else {}
    res = c.get("resources")
    res = res if isinstance(res, Mapping) else {}
    limits, requests = res.get("limits"), res.get("requests")
    return {
        **(limits if isinstance(limits, Mapping) else {}),
        **(requests if isinstance(requests, Mapping) else {}),
    }


def container_requests(
    containers: Sequence[Mapping[str, Any]],
    *,
    where: str,
    annotations: Mapping[str, Any] | None = None,
    init_containers: Sequence[Mapping[str, Any]] = (),
    overhead: Mapping[str, Any] | None = None,
) -> Requests:
    """A Kubernetes pod's requests from its containers (each a resource -> quantity mapping,
    requests over limits), its overhead and annotations: the controller's form.

    CPU, memory and MIG resources count as kube-scheduler counts them (:func:`scheduled`); a
    unified request is read per container (:func:`migpilot.planning.unified.parse`), init
    containers may not make one.
    """
    return _requests(
        [(f"{where}.containers[{i}]", c) for i, c in enumerate(containers)],
        [(f"{where}.initContainers[{i}]", c) for i, c in enumerate(init_containers)],
        annotations or {},
        overhead=overhead,
        where=where,
    )


def _amounts(
    resources: Mapping[str, Any], where: str
) -> tuple[dict[str, int], dict[int, int], int, int]:
    """One container's MIG instances per profile, MPS slices per size (GB), CPU (millicores) and
    memory (bytes); other ``nvidia.com/`` resources than the unified ones are rejected, the rest
    ignored."""
    mig: dict[str, int] = {}
    mps: dict[int, int] = {}
    cpu = mem = 0
    for key, value in resources.items():
        if not isinstance(key, str):
            raise errors.SnapshotError(f"{where}: resource names must be strings")
        if key == "cpu":
            cpu = cpu_milli(value, where=f"{where}.cpu")
        elif key == "memory":
            mem = memory_bytes(value, where=f"{where}.memory")
        elif key.startswith(MIG_RESOURCE_PREFIX):
            try:
                profile = mig_profile(key)
            except errors.SnapshotError as err:
                raise errors.SnapshotError(f"{where}: {err}") from None
            count = _counted(value, f"{where}.{key}")
            if count:
                mig[profile] = mig.get(profile, 0) + count
        elif modes.is_mps_resource(key):
            gb = modes.mps_gb(key, where=where)
            count = _counted(value, f"{where}.{key}")
            if count:
                mps[gb] = mps.get(gb, 0) + count
        elif key.startswith("nvidia.com/") and key not in _UNIFIED_RESOURCES:
            raise errors.SnapshotError(
                f"{where}: {key} is not a MIG resource (expected nvidia.com/mig-<profile>) "
                f"nor a unified one ({', '.join(_UNIFIED_RESOURCES)})"
            )
    return mig, mps, cpu, mem


def _flat(
    mig: Mapping[str, int], mps: Mapping[int, int], cpu: int, mem: int
) -> dict[tuple[str, object], int]:
    """One container's amounts, keyed for :func:`scheduled`."""
    out: dict[tuple[str, object], int] = {("cpu", None): cpu, ("memory", None): mem}
    out.update({("mig", p): n for p, n in mig.items()})
    out.update({("mps", gb): n for gb, n in mps.items()})
    return out


def scheduled(
    containers: Sequence[Mapping[K, int]],
    init: Sequence[Mapping[K, int]] = (),
    overhead: Mapping[K, int] | None = None,
) -> dict[K, int]:
    """kube-scheduler's count of a pod's amounts, per resource: the larger of its containers'
    sum and any one of its init containers' amount (they run one at a time, before the
    containers), plus the pod's overhead (its RuntimeClass's). The one place this rule is
    written: the request parser, the controller's totals and the stand-in kubelet use it."""
    summed: dict[K, int] = {}
    init_max: dict[K, int] = {}
    for c in containers:
        for k, n in c.items():
            summed[k] = summed.get(k, 0) + n
    for c in init:
        for k, n in c.items():
            init_max[k] = max(init_max.get(k, 0), n)
    total = {k: max(summed.get(k, 0), init_max.get(k, 0)) for k in {*summed, *init_max}}
    for k, n in (overhead or {}).items():
        total[k] = total.get(k, 0) + n
    return total


def scheduled_amounts(
    containers: Sequence[Mapping[str, Any]],
    *,
    init_containers: Sequence[Mapping[str, Any]] = (),
    overhead: Mapping[str, Any] | None = None,
    where: str,
) -> dict[str, int]:
    """A Kubernetes pod's amounts as kube-scheduler counts them (:func:`scheduled`), any pod:
    CPU in millicores, memory in bytes, each ``nvidia.com/`` resource as a count; other
    resources are not modelled. Containers as :func:`container_resources` reads them; errors
    name the field under ``where``."""

    def amounts(resources: Mapping[str, Any], at: str) -> dict[str, int]:
        return {
            str(k): amount(str(k), v, where=f"{at}.{k}")
            for k, v in resources.items()
            if k in ("cpu", "memory") or str(k).startswith("nvidia.com/")
        }

    return scheduled(
        [amounts(c, f"{where}.containers[{i}]") for i, c in enumerate(containers)],
        [amounts(c, f"{where}.initContainers[{i}]") for i, c in enumerate(init_containers)],
        amounts(overhead or {}, f"{where}.overhead"),
    )


def amount(name: str, value: Any, *, where: str) -> int:
    """One amount of resource ``name`` as kube-scheduler counts it: CPU in millicores, memory
    in bytes, anything else (``nvidia.com/`` devices and counters) as a count."""
    if name == "cpu":
        return cpu_milli(value, where=where)
    if name == "memory":
        return memory_bytes(value, where=where)
    return quantities.amount(value, where=where)


def _requests(
    containers: Sequence[tuple[str, Mapping[str, Any]]],
    init: Sequence[tuple[str, Mapping[str, Any]]],
    annotations: Mapping[str, Any],
    *,
    overhead: Mapping[str, Any] | None = None,
    where: str,
) -> Requests:
    """The one parser behind :func:`pod_requests` and :func:`container_requests`."""
    overhead = overhead if isinstance(overhead, Mapping) else {}
    if not isinstance(annotations, Mapping):
        raise errors.SnapshotError(f"{where}: annotations must be a mapping")
    for at, resources in init:
        if any(resources.get(k) is not None for k in _UNIFIED_RESOURCES):
            raise errors.SnapshotError(
                f"{at}: an init container may not ask for {unifying.GPU} (HAMi serves only "
                "containers)"
            )
    extra: dict[tuple[str, object], int] = {}
    if overhead.get("cpu") is not None:
        extra[("cpu", None)] = cpu_milli(overhead["cpu"], where=f"{where}.overhead.cpu")
    if overhead.get("memory") is not None:
        extra[("memory", None)] = memory_bytes(overhead["memory"], where=f"{where}.overhead.memory")
    total = scheduled(
        [_flat(*_amounts(resources, at)) for at, resources in containers],
        [_flat(*_amounts(resources, at)) for at, resources in init],
        extra,
    )
    mig = {p: n for (kind, p), n in total.items() if kind == "mig" and isinstance(p, str) and n}
    mps = {gb: n for (kind, gb), n in total.items() if kind == "mps" and isinstance(gb, int) and n}
    cpu, mem = total.get(("cpu", None), 0), total.get(("memory", None), 0)
    node_policy, gpu_policy = unifying.parse_policies(annotations, where=where)
    request = unifying.parse_labelled(containers, annotations, where=where)
    if request is not None:
        if not unifying.is_unified([r for _, r in containers], annotations):
            raise errors.SnapshotError(
                f"{where}: {unifying.GPU} without {unifying.GPUMEM}, {unifying.GPUMEM_PERCENT} "
                f"or {unifying.GPUCORES} asks for whole GPUs, which NVIDIA's device plugin "
                f"serves (annotate the pod {unifying.VGPU_MODE}: {unifying.MIG_MODE} to have "
                "migpilot serve it with MIG instances)"
            )
        if mig or mps:
            kind = "nvidia.com/mig-*" if mig else "nvidia.com/gpu-<N>gb"
            raise errors.SnapshotError(
                f"{where}: the pod asks for both {kind} and {unifying.GPU}; ask for "
                "one or the other"
            )
    elif mig and mps:
        raise errors.SnapshotError(
            f"{where}: the pod asks for both nvidia.com/mig-* and nvidia.com/gpu-<N>gb (MIG and "
            "MPS slices are served by nodes in different modes); ask for one or the other"
        )
    elif not mig and not mps:
        raise errors.SnapshotError(
            f"{where}: the pod requests no MIG resource (nvidia.com/mig-...), no MPS slice "
            f"(nvidia.com/gpu-<N>gb) and no unified one ({unifying.GPU} with {unifying.GPUMEM})"
        )
    return Requests(
        tuple(MigRequest(p, n) for p, n in sorted(mig.items())),
        cpu,
        mem,
        unified=request,
        node_policy=node_policy,
        gpu_policy=gpu_policy,
        mps=tuple(modes.MpsRequest(gb, n) for gb, n in sorted(mps.items())),
    )


@functools.lru_cache(maxsize=256)
def advertised(model: profiles.GpuModel) -> frozenset[str]:
    """The canonical names of the profiles a GPU of ``model`` can be asked for by name: each is
    advertised by the device plugin as :func:`resource_name` of it."""
    return frozenset(p.name for p in model.profiles)


def offered(model: profiles.GpuModel, profile: str) -> bool:
    """Whether a pod asking for ``profile`` (canonical) can be served by a GPU of ``model``:
    only by an instance the device plugin advertises under exactly the requested name."""
    return profile in advertised(model)


@functools.lru_cache(maxsize=16384)
def resolve_demand(demand: Demand, model: profiles.GpuModel) -> tuple[str, ...] | None:
    """What a pod of ``demand`` needs on ``model`` (profile names, sorted), ``None`` if
    ``model`` cannot serve it: its MIG requests by exact name, or its unified request resolved
    (:func:`migpilot.planning.unified.resolve`)."""
    mig, request = demand
    if request is not None:
        return unifying.resolve(request, model)
    if not mig:
        return None  # an MPS pod (nvidia.com/gpu-<N>gb): no MIG instance serves it
    return resolve_request(mig, model)


@functools.lru_cache(maxsize=16384)
def parts_on(demand: Demand, model: profiles.GpuModel) -> tuple[str | None, ...]:
    """Per part of ``demand`` (:attr:`Pod.parts`), the profile serving it on ``model``."""
    mig, request = demand
    if request is not None:
        return unifying.by_ask(request, model)
    names = advertised(model)
    return tuple(r.profile if r.profile in names else None for r in mig)


def clear_caches() -> None:
    """Forget resolved requests (plans are the same with or without)."""
    resolve_request.cache_clear()
    resolve_demand.cache_clear()
    parts_on.cache_clear()
    unifying.resolve.cache_clear()
    unifying.profile_for.cache_clear()


@functools.lru_cache(maxsize=16384)
def resolve_request(
    mig: tuple[MigRequest, ...], model: profiles.GpuModel
) -> tuple[str, ...] | None:
    """A MIG request as profile names of ``model`` (sorted), ``None`` if ``model`` does not
    advertise every requested resource under exactly its name."""
    names = advertised(model)
    out: list[str] = []
    for req in mig:
        if req.profile not in names:
            return None
        out.extend([req.profile] * req.count)
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the planner needs to know about a cluster at one moment."""

    nodes: tuple[Node, ...]
    pods: tuple[Pod, ...]
    policy: Policy = scoring.DEFAULT_NODE_POLICY
    """The node policy of pods that name none."""
    gpu_policy: Policy = scoring.DEFAULT_GPU_POLICY
    """The GPU policy of pods that name none."""
    outside: tuple[Node, ...] = ()
    """Nodes without GPUs the planner serves (file: ``otherNodes``): their labels and taints
    count for pod affinity and topology spread, and pods are bound there."""
    bound: tuple[interpod.BoundPod, ...] = ()
    """Pods bound to nodes now (file: ``boundPods``), for pod affinity and topology spread."""
    namespaces: Mapping[str, Mapping[str, str]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """Namespace labels by name (file: ``namespaces: {name: {labels: ...}}``), for namespace
    selectors (every namespace also has ``kubernetes.io/metadata.name``)."""
    whole_pods: tuple[Pod, ...] = ()
    """Pending whole-GPU pods (:attr:`Pod.whole`), planned only on dynamic nodes by
    :mod:`migpilot.planning.dynamic`; the other planners never see them."""
    models: tuple[profiles.GpuModel, ...] = field(default=(), compare=False)
    """Distinct GPU models present, in first-seen order (derived)."""

    def __post_init__(self) -> None:
        if not self.models:
            seen: dict[str, profiles.GpuModel] = {}
            for n in self.nodes:
                for g in n.gpus:
                    seen.setdefault(g.model.id, g.model)
            object.__setattr__(self, "models", tuple(seen.values()))


# --------------------------------------------------------------------------- quantities

parse_quantity = quantities.parse_quantity


def cpu_milli(value: Any, *, where: str) -> int:
    """CPU quantity in millicores (rounded up, as Kubernetes does; at most 2**63-1)."""
    return quantities.amount(value, where=where, scale=1000)


def memory_bytes(value: Any, *, where: str) -> int:
    """Memory quantity in bytes (rounded up; at most 2**63-1)."""
    return quantities.amount(value, where=where)


# --------------------------------------------------------------------------- parsing


def _str(value: Any, where: str, *, required: bool = True) -> str:
    if not required and (value is None or value == ""):
        return ""
    if not isinstance(value, str | int | float) or isinstance(value, bool) or value == "":
        raise errors.SnapshotError(f"{where}: expected a non-empty string")
    return str(value)


def _int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.SnapshotError(f"{where}: expected an integer, got {value!r}")
    return value


def _labels(value: Any, where: str) -> Mapping[str, str]:
    raw = _mapping(value, where)
    out: dict[str, str] = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not k:
            raise errors.SnapshotError(f"{where}: label keys must be non-empty strings")
        if isinstance(v, bool):
            v = str(v).lower()
        if v is None or not isinstance(v, str | int | float):
            raise errors.SnapshotError(f"{where}.{k}: label values must be strings")
        out[k] = str(v)
    return MappingProxyType(out)


_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def taint(raw: Any, where: str) -> Taint:
    """A taint from its Kubernetes form (``{key, value, effect}``); ``where`` names it in errors."""
    d = _mapping(raw, where)
    _only(d, {"key", "value", "effect"}, where)
    effect = _str(d.get("effect"), f"{where}.effect")
    if effect not in _EFFECTS:
        raise errors.SnapshotError(
            f"{where}.effect: {effect!r} is not one of {', '.join(_EFFECTS)}"
        )
    return Taint(
        _str(d.get("key"), f"{where}.key"),
        _str(d.get("value"), f"{where}.value", required=False),
        effect,
    )


def toleration(raw: Any, where: str) -> Toleration:
    """A toleration from its Kubernetes form; ``where`` names it in errors."""
    d = _mapping(raw, where)
    _only(d, {"key", "operator", "value", "effect", "tolerationSeconds"}, where)
    op = _str(d.get("operator", "Equal"), f"{where}.operator")
    if op not in ("Equal", "Exists"):
        raise errors.SnapshotError(f"{where}.operator: {op!r} is not Equal or Exists")
    key = _str(d.get("key"), f"{where}.key", required=False)
    value = _str(d.get("value"), f"{where}.value", required=False)
    if op == "Exists" and value:
        raise errors.SnapshotError(f"{where}: operator Exists takes no value")
    if not key and op != "Exists":
        raise errors.SnapshotError(f"{where}: an empty key needs operator Exists")
    effect = _str(d.get("effect"), f"{where}.effect", required=False)
    if effect and effect not in _EFFECTS:
        raise errors.SnapshotError(
            f"{where}.effect: {effect!r} is not one of {', '.join(_EFFECTS)}"
        )
    return Toleration(key, op, value, effect)


_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt")
NODE_NAME_FIELD = "metadata.name"
"""The one node field a ``matchFields`` requirement may name."""


def _requirement(raw: Any, where: str) -> Requirement:
    d = _mapping(raw, where)
    _only(d, {"key", "operator", "values"}, where)
    op = _str(d.get("operator"), f"{where}.operator")
    if op not in _OPERATORS:
        raise errors.SnapshotError(
            f"{where}.operator: {op!r} is not one of {', '.join(_OPERATORS)}"
        )
    values = tuple(
        _str(v, f"{where}.values") for v in _sequence(d.get("values"), f"{where}.values")
    )
    if op in ("In", "NotIn") and not values:
        raise errors.SnapshotError(f"{where}: operator {op} needs values")
    if op in ("Exists", "DoesNotExist") and values:
        raise errors.SnapshotError(f"{where}: operator {op} takes no values")
    if op in ("Gt", "Lt") and (len(values) != 1 or not re.fullmatch(r"-?[0-9]+", values[0])):
        raise errors.SnapshotError(f"{where}: operator {op} needs one integer value")
    return Requirement(_str(d.get("key"), f"{where}.key"), op, values)


def node_affinity(raw: Any, where: str) -> tuple[tuple[Requirement, ...], ...]:
    d = _mapping(raw, where)
    _only(d, {"nodeAffinity", "podAffinity", "podAntiAffinity"}, where)
    # The pod parts are read by interpod.pod_terms.
    na = _mapping(d.get("nodeAffinity"), f"{where}.nodeAffinity")
    _only(
        na,
        {
            "requiredDuringSchedulingIgnoredDuringExecution",
            "preferredDuringSchedulingIgnoredDuringExecution",
        },
        f"{where}.nodeAffinity",
    )
    w = f"{where}.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    req = _mapping(na.get("requiredDuringSchedulingIgnoredDuringExecution"), w)
    _only(req, {"nodeSelectorTerms"}, w)
    terms: list[tuple[Requirement, ...]] = []
    for i, term in enumerate(_sequence(req.get("nodeSelectorTerms"), f"{w}.nodeSelectorTerms")):
        tw = f"{w}.nodeSelectorTerms[{i}]"
        t = _mapping(term, tw)
        _only(t, {"matchExpressions", "matchFields"}, tw)
        exprs = _sequence(t.get("matchExpressions"), f"{tw}.matchExpressions")
        fields = _sequence(t.get("matchFields"), f"{tw}.matchFields")
        terms.append(
            tuple(_requirement(e, f"{tw}.matchExpressions[{j}]") for j, e in enumerate(exprs))
            + tuple(_field_requirement(f, f"{tw}.matchFields[{j}]") for j, f in enumerate(fields))
        )
    return tuple(terms)


def _field_requirement(raw: Any, where: str) -> Requirement:
    """A ``matchFields`` requirement, as the apiserver validates it: ``metadata.name`` with In
    or NotIn and exactly one value."""
    req = _requirement(raw, where)
    if req.key != NODE_NAME_FIELD:
        raise errors.SnapshotError(
            f"{where}.key: {req.key!r} is not a node field (only {NODE_NAME_FIELD} is)"
        )
    if req.operator not in ("In", "NotIn") or len(req.values) != 1:
        raise errors.SnapshotError(
            f"{where}: a node field selector takes In or NotIn with exactly one value"
        )
    return Requirement(req.key, req.operator, req.values, field=True)


def _resources(raw: Any, where: str) -> Resources | None:
    if raw is None:
        return None
    d = _mapping(raw, where)
    cpu = cpu_milli(d["cpu"], where=f"{where}.cpu") if "cpu" in d else 2**62
    mem = memory_bytes(d["memory"], where=f"{where}.memory") if "memory" in d else 2**62
    return Resources(cpu, mem)


def _gpu(
    raw: Any, index: int, where: str, mode: modes.Mode = modes.Mode.MIG, *, dynamic: bool = False
) -> Gpu:
    d = _mapping(raw, where)
    _only(
        d, {"model", "instances", "index", "mps", "replicas", "replicasUsed", "mig", "used"}, where
    )
    try:
        model = catalog.resolve_gpu(_str(d.get("model"), f"{where}.model"))
    except errors.UnknownGpuError as err:
        raise errors.SnapshotError(f"{where}.model: {err}") from None
    insts: list[ExistingInstance] = []
    for j, r in enumerate(_sequence(d.get("instances"), f"{where}.instances")):
        iw = f"{where}.instances[{j}]"
        e = _mapping(r, iw)
        _only(e, {"profile", "start", "used"}, iw)
        try:
            prof = model.resolve_profile(_str(e.get("profile"), f"{iw}.profile")).name
        except errors.UnknownProfileError as err:
            raise errors.SnapshotError(f"{iw}.profile: {err}") from None
        used = e.get("used", False)
        if not isinstance(used, bool):
            raise errors.SnapshotError(f"{iw}.used: expected true or false")
        insts.append(ExistingInstance(prof, _int(e.get("start"), f"{iw}.start"), used))
    reason = layouts.violation(model, [i.instance for i in insts])
    if reason is not None:
        raise errors.SnapshotError(f"{where}: current instances are not a valid layout: {reason}")
    idx = d.get("index", index)
    if insts and mode is not modes.Mode.MIG:
        raise errors.SnapshotError(
            f"{where}.instances: a GPU of a node in mode {mode.value} has no MIG instances"
        )
    slices = _slices(d.get("mps"), model, mode, f"{where}.mps")
    replicas, replicas_used = _replicas(d, mode, where)
    mig, whole_taken = _whole(d, where, dynamic=dynamic, instances=bool(insts))
    return Gpu(
        _int(idx, f"{where}.index"),
        model,
        tuple(sorted(insts, key=lambda i: i.start)),
        mps=slices,
        replicas=replicas,
        replicas_used=replicas_used,
        mig=mig,
        whole_taken=whole_taken,
    )


def _whole(
    d: Mapping[str, Any], where: str, *, dynamic: bool, instances: bool
) -> tuple[bool, bool]:
    """A GPU's ``mig`` (its MIG mode, default on) and ``used`` (a whole GPU held or reserved)."""
    mig = d.get("mig", True)
    if not isinstance(mig, bool):
        raise errors.SnapshotError(f"{where}.mig: expected true or false")
    used = d.get("used", False)
    if not isinstance(used, bool):
        raise errors.SnapshotError(f"{where}.used: expected true or false")
    if not mig and not dynamic:
        raise errors.SnapshotError(
            f"{where}.mig: a whole GPU (mig: false) is listed only on a node labelled "
            f"{modes.MIG_MODE_LABEL}={modes.DYNAMIC_MIG} (or dynamic: true)"
        )
    if not mig and instances:
        raise errors.SnapshotError(
            f"{where}.instances: a whole GPU (mig: false) has no MIG instances"
        )
    if used and mig:
        raise errors.SnapshotError(
            f"{where}.used: only a whole GPU (mig: false) is used as a whole; a MIG GPU's use "
            "is its instances' (instances[].used)"
        )
    return mig, used


def mps_slice(raw: Any, where: str) -> modes.MpsSlice:
    """One MPS slice from its file form (``{id, memoryGB, cores?, used?, reservedFor?}``)."""
    e = _mapping(raw, where)
    _only(e, {"id", "memoryGB", "cores", "used", "reservedFor"}, where)
    gb = _int(e.get("memoryGB"), f"{where}.memoryGB")
    if gb < 1:
        raise errors.SnapshotError(f"{where}.memoryGB: a slice needs at least 1 GB, got {gb}")
    cores = e.get("cores")
    if cores is not None:
        cores = _int(cores, f"{where}.cores")
        if not 1 <= cores <= 100:
            raise errors.SnapshotError(f"{where}.cores: expected 1-100 (percent), got {cores}")
    used = e.get("used", False)
    if not isinstance(used, bool):
        raise errors.SnapshotError(f"{where}.used: expected true or false")
    return modes.MpsSlice(
        id=_int(e.get("id"), f"{where}.id"),
        memory_gb=gb,
        cores=cores,
        used=used,
        reserved_for=_str(e.get("reservedFor"), f"{where}.reservedFor", required=False),
    )


def _slices(
    raw: Any, model: profiles.GpuModel, mode: modes.Mode, where: str
) -> tuple[modes.MpsSlice, ...]:
    items = _sequence(raw, where)
    if items and mode is not modes.Mode.MPS:
        raise errors.SnapshotError(
            f"{where}: a GPU of a node in mode {mode.value} has no MPS slices"
        )
    slices = tuple(mps_slice(r, f"{where}[{j}]") for j, r in enumerate(items))
    problem = modes.slices_problem(model, slices)
    if problem is not None:
        raise errors.SnapshotError(f"{where}: {problem}")
    return tuple(sorted(slices, key=lambda s: s.id))


def _replicas(d: Mapping[str, Any], mode: modes.Mode, where: str) -> tuple[int, int]:
    if mode is not modes.Mode.TIME_SLICING:
        for name in ("replicas", "replicasUsed"):
            if name in d:
                raise errors.SnapshotError(
                    f"{where}.{name}: only GPUs of a node in mode time-slicing have replicas"
                )
        return 0, 0
    if "replicas" not in d:
        raise errors.SnapshotError(f"{where}: a time-slicing GPU needs replicas (>= 1)")
    replicas = _int(d["replicas"], f"{where}.replicas")
    if replicas < 1:
        raise errors.SnapshotError(f"{where}.replicas: expected at least 1, got {replicas}")
    used = _int(d.get("replicasUsed", 0), f"{where}.replicasUsed")
    if not 0 <= used <= replicas:
        raise errors.SnapshotError(
            f"{where}.replicasUsed: expected 0-{replicas} (the GPU's replicas), got {used}"
        )
    return replicas, used


def _node(raw: Any, where: str) -> Node:
    d = _mapping(raw, where)
    _only(
        d,
        {"name", "labels", "taints", "unschedulable", "allocatable", "capacity", "gpus", "dynamic"},
        where,
    )
    name = _str(d.get("name"), f"{where}.name")
    unsched = d.get("unschedulable", False)
    if not isinstance(unsched, bool):
        raise errors.SnapshotError(f"{where}.unschedulable: expected true or false")
    labels = _labels(d.get("labels"), f"{where}.labels")
    try:
        mode = modes.node_mode(labels, node=name)
    except errors.SnapshotError as err:
        raise errors.SnapshotError(f"{where}.labels: {err}") from None
    labels, dynamic = _dynamic(d, labels, mode, where)
    gpus = tuple(
        _gpu(g, i, f"{where}.gpus[{i}]", mode, dynamic=dynamic)
        for i, g in enumerate(_sequence(d.get("gpus"), f"{where}.gpus"))
    )
    if len({g.index for g in gpus}) != len(gpus):
        raise errors.SnapshotError(f"{where}.gpus: two GPUs share an index")
    return Node(
        name=name,
        mode=mode,
        labels=labels,
        taints=tuple(
            taint(t, f"{where}.taints[{i}]")
            for i, t in enumerate(_sequence(d.get("taints"), f"{where}.taints"))
        ),
        unschedulable=unsched,
        allocatable=_resources(d.get("allocatable"), f"{where}.allocatable"),
        gpus=gpus,
        capacity=_resources(d.get("capacity"), f"{where}.capacity"),
        dynamic=dynamic,
    )


def _dynamic(
    d: Mapping[str, Any], labels: Mapping[str, str], mode: modes.Mode, where: str
) -> tuple[Mapping[str, str], bool]:
    """A node's labels and whether it is dynamic: labelled ``migpilot.io/mig-mode: dynamic``, as
    the controller reads it, or ``dynamic: true``, which adds that label (selectors see it as
    on the cluster)."""
    labelled = modes.dynamic_mig(labels)
    field_ = d.get("dynamic")
    if field_ is not None and not isinstance(field_, bool):
        raise errors.SnapshotError(f"{where}.dynamic: expected true or false")
    if field_ is False and labelled:
        raise errors.SnapshotError(
            f"{where}.dynamic: false, but the node is labelled "
            f"{modes.MIG_MODE_LABEL}={modes.DYNAMIC_MIG}"
        )
    if not (field_ or labelled):
        return labels, False
    if mode is not modes.Mode.MIG:
        at = f"{where}.dynamic" if field_ else f"{where}.labels"
        raise errors.SnapshotError(
            f"{at}: only a node in mode mig may switch its GPUs' MIG mode (this one is in mode "
            f"{mode.value})"
        )
    if not labelled:
        labels = MappingProxyType({**labels, modes.MIG_MODE_LABEL: modes.DYNAMIC_MIG})
    return labels, True


def planned_pod(
    *,
    name: str,
    namespace: str,
    requests: Requests,
    priority: int = 0,
    node_selector: Mapping[str, str] | None = None,
    affinity: tuple[tuple[Requirement, ...], ...] = (),
    tolerations: tuple[Toleration, ...] = (),
    terms: interpod.PodTerms = interpod.NO_TERMS,
) -> Pod:
    """A pod as the planner reads it, from its parsed :class:`Requests` (MIG instances, MPS
    slices, a unified request, CPU and memory as kube-scheduler counts them, the scheduling
    policies it names) and where it may run. The one builder of a :class:`Pod`: the snapshot
    file's reader, the controller and the simulator all go through it."""
    return Pod(
        name=name,
        namespace=namespace,
        priority=priority,
        mig=requests.mig,
        unified=requests.unified,
        node_policy=requests.node_policy,
        gpu_policy=requests.gpu_policy,
        mps=requests.mps,
        cpu_milli=requests.cpu_milli,
        memory_bytes=requests.memory_bytes,
        node_selector=MappingProxyType(dict(node_selector or {})),
        affinity=affinity,
        tolerations=tolerations,
        terms=terms,
        whole=requests.whole,
    )


def _pod(raw: Any, where: str) -> Pod:
    d = _mapping(raw, where)
    _only(
        d,
        {
            "name",
            "namespace",
            "priority",
            "requests",
            "annotations",
            "nodeSelector",
            "affinity",
            "tolerations",
            "labels",
            "topologySpreadConstraints",
        },
        where,
    )
    name = _str(d.get("name"), f"{where}.name")
    namespace = _str(d.get("namespace", "default"), f"{where}.namespace")
    resources = _mapping(d.get("requests"), f"{where}.requests")
    annotations = _labels(d.get("annotations"), f"{where}.annotations")
    req = whole_gpu_requests(resources, where=f"{where}.requests", annotations=annotations)
    if req is None:
        req = pod_requests(resources, where=f"{where}.requests", annotations=annotations)
    priority = d.get("priority", 0)
    return planned_pod(
        name=name,
        namespace=namespace,
        priority=_int(priority, f"{where}.priority"),
        requests=req,
        node_selector=_labels(d.get("nodeSelector"), f"{where}.nodeSelector"),
        affinity=node_affinity(d.get("affinity"), f"{where}.affinity"),
        tolerations=tuple(
            toleration(t, f"{where}.tolerations[{i}]")
            for i, t in enumerate(_sequence(d.get("tolerations"), f"{where}.tolerations"))
        ),
        terms=interpod.pod_terms(
            affinity=d.get("affinity"),
            spread=d.get("topologySpreadConstraints"),
            labels_=_labels(d.get("labels"), f"{where}.labels"),
            namespace=namespace,
            where=where,
        ),
    )


def _bound_pod(raw: Any, where: str, nodes: Mapping[str, Node]) -> interpod.BoundPod:
    """A pod already bound: ``{name, namespace, node, labels, affinity}`` (only its required
    pod anti-affinity is read from ``affinity``: it is what keeps other pods away)."""
    d = _mapping(raw, where)
    _only(d, {"name", "namespace", "node", "labels", "affinity", "terminating"}, where)
    node = _str(d.get("node"), f"{where}.node")
    if node not in nodes:
        raise errors.SnapshotError(
            f"{where}.node: no node {node!r} in nodes or otherNodes (a bound pod's node gives "
            "its topology)"
        )
    namespace = _str(d.get("namespace", "default"), f"{where}.namespace")
    own = _labels(d.get("labels"), f"{where}.labels")
    aff = _mapping(d.get("affinity"), f"{where}.affinity")
    _only(aff, {"nodeAffinity", "podAffinity", "podAntiAffinity"}, f"{where}.affinity")
    terms = interpod.pod_terms(
        affinity={"podAntiAffinity": aff.get("podAntiAffinity")},
        spread=None,
        labels_=own,
        namespace=namespace,
        where=where,
    )
    terminating = d.get("terminating", False)
    if not isinstance(terminating, bool):
        raise errors.SnapshotError(f"{where}.terminating: expected true or false")
    return interpod.BoundPod(
        name=_str(d.get("name"), f"{where}.name"),
        namespace=namespace,
        node=node,
        labels=own,
        anti_affinity=terms.anti_affinity,
        terminating=terminating,
    )


def _other_node(raw: Any, where: str) -> Node:
    """A node the planner places nothing on (no GPU it serves): its labels and taints make and
    limit topology domains, and pods bound there count."""
    d = _mapping(raw, where)
    _only(d, {"name", "labels", "taints", "unschedulable"}, where)
    unsched = d.get("unschedulable", False)
    if not isinstance(unsched, bool):
        raise errors.SnapshotError(f"{where}.unschedulable: expected true or false")
    return Node(
        name=_str(d.get("name"), f"{where}.name"),
        labels=_labels(d.get("labels"), f"{where}.labels"),
        taints=tuple(
            taint(t, f"{where}.taints[{i}]")
            for i, t in enumerate(_sequence(d.get("taints"), f"{where}.taints"))
        ),
        unschedulable=unsched,
        allocatable=None,
        gpus=(),
    )


def parse(document: Any, *, source: str = "snapshot") -> Snapshot:
    """Build a snapshot from a decoded YAML/JSON document; raise :class:`SnapshotError`."""
    try:
        return _parse(document)
    except errors.SnapshotError as e:
        raise errors.SnapshotError(f"{source}: {e}") from None
    except (errors.UnknownGpuError, errors.UnknownProfileError) as e:
        raise errors.SnapshotError(f"{source}: {e}") from None


def _parse(document: Any) -> Snapshot:
    d = _mapping(document, "snapshot")
    _only(
        d,
        {
            "version",
            "policy",
            "gpuPolicy",
            "nodes",
            "pods",
            "otherNodes",
            "boundPods",
            "namespaces",
        },
        "snapshot",
    )
    if "version" not in d:
        raise errors.SnapshotError("missing 'version' (this format is version 1)")
    if type(d["version"]) is not int or d["version"] != SNAPSHOT_VERSION:
        raise errors.SnapshotError(f"unsupported version {d['version']!r} (expected 1)")
    policies: list[Policy] = []
    for name, default in (
        ("policy", scoring.DEFAULT_NODE_POLICY),
        ("gpuPolicy", scoring.DEFAULT_GPU_POLICY),
    ):
        text = d.get(name, default.value)
        try:
            policies.append(Policy(text))
        except ValueError:
            raise errors.SnapshotError(f"{name}: {text!r} is not binpack or spread") from None
    policy, gpu_policy = policies
    nodes = tuple(_node(n, f"nodes[{i}]") for i, n in enumerate(_sequence(d.get("nodes"), "nodes")))
    outside = tuple(
        _other_node(n, f"otherNodes[{i}]")
        for i, n in enumerate(_sequence(d.get("otherNodes"), "otherNodes"))
    )
    names = [n.name for n in nodes + outside]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise errors.SnapshotError(f"nodes: node name {dup!r} appears twice")
    by_name = {n.name: n for n in nodes + outside}
    bound = tuple(
        _bound_pod(p, f"boundPods[{i}]", by_name)
        for i, p in enumerate(_sequence(d.get("boundPods"), "boundPods"))
    )
    namespaces: dict[str, Mapping[str, str]] = {}
    for k, v in _mapping(d.get("namespaces"), "namespaces").items():
        ns = _mapping(v, f"namespaces.{k}")
        _only(ns, {"labels"}, f"namespaces.{k}")
        namespaces[str(k)] = _labels(ns.get("labels"), f"namespaces.{k}.labels")
    every_pod = tuple(_pod(p, f"pods[{i}]") for i, p in enumerate(_sequence(d.get("pods"), "pods")))
    pods = tuple(p for p in every_pod if not p.whole)
    whole_pods = tuple(p for p in every_pod if p.whole)
    keys = [p.key for p in every_pod]
    if len(set(keys)) != len(keys):
        dup = next(k for k in keys if keys.count(k) > 1)
        raise errors.SnapshotError(f"pods: pod {dup!r} appears twice")
    every = [b.key for b in bound] + keys
    if len(set(every)) != len(every):
        dup = next(k for k in every if every.count(k) > 1)
        raise errors.SnapshotError(f"boundPods: pod {dup!r} appears twice (bound or pending)")
    return Snapshot(
        nodes=nodes,
        pods=pods,
        policy=policy,
        gpu_policy=gpu_policy,
        outside=outside,
        bound=bound,
        namespaces=MappingProxyType(namespaces),
        whole_pods=whole_pods,
    )


def to_document(snap: Snapshot) -> dict[str, Any]:
    """The snapshot as a version-1 document (inverse of :func:`parse`, for generators/tests)."""

    def res(r: Resources | None) -> dict[str, Any] | None:
        if r is None:
            return None
        return {"cpu": f"{r.cpu_milli}m", "memory": str(r.memory_bytes)}

    nodes = []
    for n in snap.nodes:
        nd: dict[str, Any] = {"name": n.name}
        if n.labels:
            nd["labels"] = dict(n.labels)
        if n.taints:
            nd["taints"] = [
                {"key": t.key, "effect": t.effect} | ({"value": t.value} if t.value else {})
                for t in n.taints
            ]
        if n.unschedulable:
            nd["unschedulable"] = True
        if n.allocatable is not None:
            nd["allocatable"] = res(n.allocatable)
        if n.capacity is not None:
            nd["capacity"] = res(n.capacity)
        if n.dynamic:
            nd["dynamic"] = True
        nd["gpus"] = [_gpu_document(g) for g in n.gpus]
        nodes.append(nd)
    pods = []
    for p in (*snap.pods, *snap.whole_pods):
        reqs: dict[str, Any] = {resource_name(r.profile): r.count for r in p.mig}
        if p.whole:
            reqs[unifying.GPU] = p.whole
        reqs.update({r.resource: r.count for r in p.mps})
        annotations: dict[str, str] = {}
        if p.unified is not None:
            reqs.update(_unified_document(p.unified))
            if p.unified.use_models:
                annotations[unifying.USE_TYPE] = ",".join(p.unified.use_models)
            if p.unified.nouse_models:
                annotations[unifying.NOUSE_TYPE] = ",".join(p.unified.nouse_models)
            if p.unified.mode is not None:
                annotations[unifying.VGPU_MODE] = p.unified.mode
            elif not unifying.is_unified([reqs], {}):
                annotations[unifying.VGPU_MODE] = unifying.MIG_MODE
        if p.node_policy is not None:
            annotations[unifying.NODE_POLICY] = p.node_policy.value
        if p.gpu_policy is not None:
            annotations[unifying.GPU_POLICY] = p.gpu_policy.value
        if p.cpu_milli:
            reqs["cpu"] = f"{p.cpu_milli}m"
        if p.memory_bytes:
            reqs["memory"] = str(p.memory_bytes)
        pd: dict[str, Any] = {"name": p.name, "namespace": p.namespace, "requests": reqs}
        if p.priority:
            pd["priority"] = p.priority
        if annotations:
            pd["annotations"] = annotations
        if p.node_selector:
            pd["nodeSelector"] = dict(p.node_selector)
        if p.affinity:
            pd["affinity"] = {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [_term_document(term) for term in p.affinity]
                    }
                }
            }
        if p.terms.labels:
            pd["labels"] = dict(p.terms.labels)
        pod_parts = interpod.affinity_document(p.terms)
        if pod_parts:
            pd.setdefault("affinity", {}).update(pod_parts)
        spread = interpod.spread_documents(p.terms)
        if spread:
            pd["topologySpreadConstraints"] = spread
        if p.tolerations:
            pd["tolerations"] = [
                {k: v for k, v in (("key", t.key), ("operator", t.operator), ("value", t.value),
                                   ("effect", t.effect)) if v}
                for t in p.tolerations
            ]  # fmt: skip
        pods.append(pd)
    doc: dict[str, Any] = {"version": SNAPSHOT_VERSION, "policy": snap.policy.value}
    if snap.gpu_policy is not scoring.DEFAULT_GPU_POLICY:
        doc["gpuPolicy"] = snap.gpu_policy.value
    doc |= {"nodes": nodes, "pods": pods}
    if snap.outside:
        doc["otherNodes"] = [
            {"name": n.name}
            | ({"labels": dict(n.labels)} if n.labels else {})
            | (
                {"taints": [{"key": t.key, "value": t.value, "effect": t.effect} for t in n.taints]}
                if n.taints
                else {}
            )
            | ({"unschedulable": True} if n.unschedulable else {})
            for n in snap.outside
        ]
    if snap.bound:
        doc["boundPods"] = [
            {"name": b.name, "namespace": b.namespace, "node": b.node}
            | ({"labels": dict(b.labels)} if b.labels else {})
            | (
                {
                    "affinity": interpod.affinity_document(
                        interpod.PodTerms(anti_affinity=b.anti_affinity)
                    )
                }
                if b.anti_affinity
                else {}
            )
            | ({"terminating": True} if b.terminating else {})
            for b in snap.bound
        ]
    if snap.namespaces:
        doc["namespaces"] = {k: {"labels": dict(v)} for k, v in snap.namespaces.items()}
    return doc


def _gpu_document(g: Gpu) -> dict[str, Any]:
    """One GPU as the file writes it (MPS slices and replicas only where the GPU has them)."""
    out: dict[str, Any] = {
        "index": g.index,
        "model": g.model.id,
        "instances": [
            {"profile": i.profile, "start": i.start, "used": i.used} for i in g.instances
        ],
    }
    if g.mps:
        out["mps"] = [
            {"id": s.id, "memoryGB": s.memory_gb, "used": s.used}
            | ({"cores": s.cores} if s.cores is not None else {})
            | ({"reservedFor": s.reserved_for} if s.reserved_for else {})
            for s in g.mps
        ]
    if g.replicas:
        out["replicas"] = g.replicas
        out["replicasUsed"] = g.replicas_used
    if not g.mig:
        out["mig"] = False
        if g.whole_taken:
            out["used"] = True
    return out


def _unified_document(request: unifying.UnifiedRequest) -> dict[str, Any]:
    """A unified request as one container's resources (the file's ``requests``). The file holds
    one container per pod, so a request of several containers cannot be written."""
    if len(request.asks) != 1:
        raise errors.SnapshotError(
            f"a unified request of {len(request.asks)} containers cannot be written as one "
            "pod's requests"
        )
    ask = request.asks[0]
    out: dict[str, Any] = {unifying.GPU: ask.count}
    if ask.memory_mib is not None:
        out[unifying.GPUMEM] = ask.memory_mib
    if ask.memory_percent is not None:
        out[unifying.GPUMEM_PERCENT] = ask.memory_percent
    if ask.cores_percent is not None:
        out[unifying.GPUCORES] = ask.cores_percent
    return out


def _term_document(term: tuple[Requirement, ...]) -> dict[str, Any]:
    """One node selector term as the file (and Kubernetes) writes it."""
    out: dict[str, Any] = {}
    for kind, field_ in (("matchExpressions", False), ("matchFields", True)):
        reqs = [
            {"key": r.key, "operator": r.operator, "values": list(r.values)}
            if r.values
            else {"key": r.key, "operator": r.operator}
            for r in term
            if r.field is field_
        ]
        if reqs or (kind == "matchExpressions" and not term):
            out[kind] = reqs
    return out
