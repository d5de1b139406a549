"""What ``migpilot status`` shows: the cluster's GPUs, who holds each device, and the pods
waiting, read from raw Kubernetes objects into one frozen :class:`Status`.

Why it exists: an admin's first question is "what is on my GPUs and why is my pod waiting?".
The answer is spread over four kinds of object: the GpuLayouts (instances and MPS slices and
their state, the reservations in the spec, ``usedBy`` in the status for unified pods), the Nodes
(``migpilot.io/mode``, GFD's labels, allocatable replicas), the Pods (what each asks and where it
is bound) and the controller's Events (why a pod waits). :func:`survey` joins them; the CLI
(``cli/status_cmd.py``) only reads the objects and renders the result, and :func:`to_json` is
the documented ``-o json`` schema (``docs/controller.md``, "migpilot status").

A holder is never made up: a device's pod comes from the spec's ``reservedFor``, the status's
``usedBy``, or, for an instance or slice a ``nvidia.com/mig-*`` (or ``nvidia.com/gpu-<N>gb``)
pod took, from the pods bound to the node when exactly one of them asks for that profile;
otherwise the holder is ``unknown`` and the candidates are listed. Utilisation is shown only
when a source gives it (``utilization``, by device UUID or by ``namespace/pod``); without one
it is absent, never zero.

Pure: no client, no clock, no I/O. May import :mod:`migpilot.api`, :mod:`migpilot.planning`,
:mod:`migpilot.mig`, :mod:`migpilot.errors` and the controller's pure reading
(:mod:`migpilot.controller.observing`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.api import gpulayouts, gpulayouts_wire
from migpilot.controller import observing
from migpilot.planning import modes, quantities, snapshot

CONTROLLER_COMPONENT = "migpilot-controller"
"""The ``source.component`` of the controller's Events (``controller/kube.py``)."""
SCHEMA_VERSION = 1
"""``-o json``'s ``schemaVersion``: raised when a field changes meaning or goes away."""
PRODUCT_LABEL = "nvidia.com/gpu.product"
COUNT_LABEL = "nvidia.com/gpu.count"
REPLICAS_LABEL = "nvidia.com/gpu.replicas"
WHOLE_GPU = "nvidia.com/gpu"
RENAMED_GPU = "nvidia.com/gpu.shared"
"""``nvidia.com/gpu`` replicas renamed by the sharing config (``renameByDefault``, or a
``rename`` to this name): counted with the node's replicas, though the agent does not report
them per GPU (they are not the unified pods')."""
PLANNED = "planned"
"""A device's state when the spec lists it and the agent does not report it (yet)."""
FREE_REPLICA, USED_REPLICA = "free", "used"
REPLICA_PROFILE = "replica"
"""A time-slicing replica's profile, as the metrics name it (``migpilot_instances``)."""


class DeviceKind(enum.StrEnum):
    """What a device is."""

    MIG = "mig"
    """A MIG instance (``nvidia.com/mig-<profile>``, or ``nvidia.com/gpu`` for a unified pod)."""
    MPS = "mps"
    """An MPS slice (``nvidia.com/gpu-<N>gb``)."""
    REPLICA = "replica"
    """A time-slicing replica of a whole GPU (one ``nvidia.com/gpu`` device, ``<uuid>::<id>``)."""


class Holding(enum.StrEnum):
    """How the pod holding a device is known."""

    RESERVED_FOR = "reservedFor"
    """The GpuLayout spec keeps the device for the pod (state ``reserved``, or ``used`` by the
    pod it was reserved for, bound to this node)."""
    USED_BY = "usedBy"
    """The agent reports the pod it handed the device to (unified pods, MPS slices)."""
    INFERRED = "inferred"
    """The only pod bound to the node that asks for this profile, not named by another device."""
    UNKNOWN = "unknown"
    """In use, but nothing says by which pod (see the candidates)."""


@dataclass(frozen=True, slots=True)
class Device:
    """One MIG instance, MPS slice or time-slicing replica on a GPU."""

    kind: DeviceKind
    profile: str
    """A MIG profile (``1g.10gb``), ``mps-<N>gb`` for an MPS slice, or ``replica``."""
    slot: int
    """The instance's start memory slot, or the slice's or replica's id."""
    uuid: str | None
    """MIG device UUID (``None`` while creating, for a planned instance, a slice or a replica)."""
    state: str
    """free, reserved, used, creating, destroying (the agent's), or planned (the spec's only)."""
    pod: str | None = None
    """``namespace/name`` of the holder, when known."""
    holding: Holding | None = None
    """How :attr:`pod` is known; ``None`` for a device nobody holds or is kept for."""
    candidates: tuple[str, ...] = ()
    """With :attr:`Holding.UNKNOWN`: the pods bound to the node that ask for this profile."""
    utilization: float | None = None
    """The holder's GPU utilisation, 0-1, from the utilisation source; ``None``: not known."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of a node and its devices."""

    index: int
    model: str | None
    uuid: str | None
    devices: tuple[Device, ...]


@dataclass(frozen=True, slots=True)
class Replicas:
    """Shares of whole GPUs on a node in mode ``time-slicing`` (or ``none``): kube-scheduler
    counts them per node (``nvidia.com/gpu`` allocatable), so no GPU index is known per pod."""

    per_gpu: int | None
    """``nvidia.com/gpu.replicas`` (GFD's label); ``None`` when absent."""
    total: int
    """The node's allocatable ``nvidia.com/gpu`` (and ``nvidia.com/gpu.shared``, renamed)."""
    used: int
    """What the pods bound to the node ask for (``nvidia.com/gpu``, ``nvidia.com/gpu.shared``)."""
    pods: tuple[str, ...]
    """Those pods, by ``namespace/name``."""


@dataclass(frozen=True, slots=True)
class NodeStatus:
    """One GPU node."""

    name: str
    model: str | None
    """The GPUs' product names (joined by ``, `` when they differ); ``None``: unknown."""
    mode: str
    """The ``migpilot.io/mode`` label (absent: ``mig``), as written even when not valid."""
    gpu_count: int
    gpus: tuple[Gpu, ...]
    reported: bool
    """The agent has written the GpuLayout's status."""
    problem: str | None = None
    """What an admin should look at: an unknown mode, an unreadable GpuLayout, the layout's
    ``Ready`` condition false, or a GpuLayout without a Node."""
    replicas: Replicas | None = None


@dataclass(frozen=True, slots=True)
class Pending:
    """A pod waiting for migpilot."""

    pod: str
    asks: tuple[str, ...]
    """``resource: count`` per GPU resource it asks for (or why its ask cannot be read)."""
    gated: bool
    """Gated by ``migpilot.io/plan``."""
    created: str
    reason: str | None
    """The reason of the latest Event the controller recorded on the pod; ``None``: none yet."""
    message: str | None
    event_type: str | None
    """``Normal`` or ``Warning``."""


@dataclass(frozen=True, slots=True)
class Status:
    """The cluster as ``migpilot status`` shows it."""

    nodes: tuple[NodeStatus, ...]
    pending: tuple[Pending, ...]
    utilization_source: str | None = None
    """Where utilisation came from; ``None``: no source, and no utilisation is shown."""


# --------------------------------------------------------------------------- reading


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _int(value: Any) -> int | None:
    try:
        return int(str(value))
    except ValueError:
        return None


def _asked(doc: Mapping[str, Any], resource: str) -> int:
    """What a pod's containers ask of ``resource`` in all (0 when unreadable)."""
    total = 0
    for c in _map(doc.get("spec")).get("containers") or ():
        value = snapshot.container_resources(c).get(resource)
        if value is None:
            continue
        try:
            total += quantities.amount(value, where=resource)
        except errors.MigpilotError:
            return 0
    return total


@dataclass(frozen=True, slots=True)
class _Event:
    key: str
    uid: str
    when: tuple[str, int]
    reason: str
    message: str
    type: str


def _events(docs: Iterable[Mapping[str, Any]]) -> dict[str, _Event]:
    """The latest controller Event per pod (``namespace/name``)."""
    latest: dict[str, _Event] = {}
    for doc in docs:
        meta = _map(doc.get("metadata"))
        source = _map(doc.get("source")).get("component") or doc.get("reportingComponent")
        obj = _map(doc.get("involvedObject"))
        if source != CONTROLLER_COMPONENT or obj.get("kind") != "Pod":
            continue
        key = f"{obj.get('namespace') or 'default'}/{obj.get('name', '')}"
        stamp = str(
            doc.get("lastTimestamp") or doc.get("eventTime") or meta.get("creationTimestamp") or ""
        )
        event = _Event(
            key=key,
            uid=str(obj.get("uid") or ""),
            when=(stamp, _int(meta.get("resourceVersion")) or 0),
            reason=str(doc.get("reason") or ""),
            message=str(doc.get("message") or ""),
            type=str(doc.get("type") or ""),
        )
        if key not in latest or event.when >= latest[key].when:
            latest[key] = event
    return latest


def _layouts(docs: Iterable[Mapping[str, Any]]) -> dict[str, gpulayouts.GpuLayout | str]:
    """GpuLayouts by name, or why one cannot be read."""
    out: dict[str, gpulayouts.GpuLayout | str] = {}
    for doc in docs:
        name = str(_map(doc.get("metadata")).get("name", ""))
        try:
            out[name] = gpulayouts_wire.parse(doc)
        except errors.MigpilotError as err:
            out[name] = f"GpuLayout cannot be read: {err}"
    return out


def _is_gpu_node(view: observing.NodeView) -> bool:
    return (
        modes.MODE_LABEL in view.labels
        or COUNT_LABEL in view.labels
        or any(k.startswith("nvidia.com/") and v for k, v in view.allocatable.items())
    )


# --------------------------------------------------------------------------- holders


@dataclass
class _Bound:
    """The pods bound to one node (not done), with what they ask."""

    views: list[observing.PodView]
    docs: dict[str, Mapping[str, Any]]


def _candidates(bound: _Bound, *, kind: DeviceKind, profile: str) -> list[str]:
    out = []
    for v in bound.views:
        if v.unified:
            continue
        if kind is DeviceKind.MIG and v.mig.get(profile):
            out.append(v.key)
        gb = profile.removeprefix("mps-").removesuffix("gb")
        if kind is DeviceKind.MPS and v.mps.get(f"{modes.MPS_RESOURCE_PREFIX}{gb}gb"):
            out.append(v.key)
        if kind is DeviceKind.REPLICA and _asked(bound.docs[v.key], WHOLE_GPU):
            out.append(v.key)  # NVIDIA-style: kube-scheduler gave it a replica
    return sorted(out)


def _resolve(
    devices: list[Device], bound: _Bound, utilization: Mapping[str, float] | None
) -> tuple[Device, ...]:
    """Holders for the used devices nothing names, and each holder's utilisation."""
    named = {d.pod for d in devices if d.pod is not None}
    out = []
    for d in devices:
        if d.state == gpulayouts.InstanceState.USED.value and d.pod is None:
            cands = _candidates(bound, kind=d.kind, profile=d.profile)
            cands = [p for p in cands if p not in named]
            if len(cands) == 1:
                d = dataclasses.replace(d, pod=cands[0], holding=Holding.INFERRED)
            else:
                d = dataclasses.replace(d, holding=Holding.UNKNOWN, candidates=tuple(cands))
        elif d.state == gpulayouts.InstanceState.RESERVED.value and d.pod is None:
            d = dataclasses.replace(d, holding=Holding.UNKNOWN)  # the spec no longer says for whom
        if utilization is not None:
            # The device's own reading first (a MIG UUID), else its holder's (one device).
            found = utilization.get(d.uuid) if d.uuid is not None else None
            if found is None and d.pod is not None:
                found = utilization.get(d.pod)
            if found is not None:
                d = dataclasses.replace(d, utilization=found)
        out.append(d)
    return tuple(out)


def _held(
    *, state: str, used_by: str | None, reserved_for: str | None, bound: _Bound
) -> tuple[str | None, Holding | None]:
    if used_by is not None:
        return used_by, Holding.USED_BY
    if reserved_for is not None and (
        state in (gpulayouts.InstanceState.RESERVED.value, PLANNED)
        or (state == gpulayouts.InstanceState.USED.value and reserved_for in bound.docs)
    ):
        return reserved_for, Holding.RESERVED_FOR
    return None, None


def _gpus(layout: gpulayouts.GpuLayout, bound: _Bound) -> list[tuple[Gpu, list[Device]]]:
    specs = {g.index: g for g in layout.spec.gpus}
    statuses = {g.index: g for g in layout.status.gpus} if layout.status else {}
    out = []
    for index in sorted({*specs, *statuses}):
        spec, status = specs.get(index), statuses.get(index)
        wanted = {(i.start, i.profile): i for i in spec.instances} if spec else {}
        sliced = {s.id: s for s in spec.mps} if spec else {}
        devices: list[Device] = []
        seen: set[tuple[int, str]] = set()
        for inst in status.instances if status else ():
            seen.add((inst.start, inst.profile))
            want = wanted.get((inst.start, inst.profile))
            pod, how = _held(
                state=inst.state.value,
                used_by=inst.used_by,
                reserved_for=want.reserved_for if want else None,
                bound=bound,
            )
            state, uuid = inst.state.value, inst.uuid
            devices.append(Device(DeviceKind.MIG, inst.profile, inst.start, uuid, state, pod, how))
        for key, want in sorted(wanted.items()):
            if key not in seen:
                pod, how = _held(
                    state=PLANNED, used_by=None, reserved_for=want.reserved_for, bound=bound
                )
                devices.append(
                    Device(DeviceKind.MIG, want.profile, want.start, None, PLANNED, pod, how)
                )
        seen_ids: set[int] = set()
        for sl in status.mps if status else ():
            seen_ids.add(sl.id)
            want_sl = sliced.get(sl.id)
            pod, how = _held(
                state=sl.state.value,
                used_by=sl.used_by,
                reserved_for=want_sl.reserved_for if want_sl else None,
                bound=bound,
            )
            profile = f"mps-{sl.memory_gb}gb"
            devices.append(Device(DeviceKind.MPS, profile, sl.id, None, sl.state.value, pod, how))
        for sid, want_sl in sorted(sliced.items()):
            if sid not in seen_ids:
                pod, how = _held(
                    state=PLANNED, used_by=None, reserved_for=want_sl.reserved_for, bound=bound
                )
                profile = f"mps-{want_sl.memory_gb}gb"
                devices.append(Device(DeviceKind.MPS, profile, sid, None, PLANNED, pod, how))
        devices += _replica_devices(
            status.replicas if status else (), spec.replicas if spec else (), bound
        )
        model = status.model if status else (spec.model if spec else None)
        out.append((Gpu(index, model, status.uuid if status else None, ()), devices))
    return out


def _replica_devices(
    reported: Iterable[gpulayouts.ReplicaStatus],
    kept: Iterable[gpulayouts.ReplicaSpec],
    bound: _Bound,
) -> list[Device]:
    """A GPU's time-slicing replicas as the agent reports them, with the pod the spec keeps
    each for, as MPS slices are shown; a replica kept and not reported is ``planned``."""
    wanted = {r.id: r for r in kept}
    out = []
    for r in reported:
        want = wanted.pop(r.id, None)
        pod, how = _held(
            state=r.state.value,
            used_by=r.used_by,
            reserved_for=want.reserved_for if want else None,
            bound=bound,
        )
        out.append(Device(DeviceKind.REPLICA, REPLICA_PROFILE, r.id, None, r.state.value, pod, how))
    for rid, want in sorted(wanted.items()):
        pod, how = _held(state=PLANNED, used_by=None, reserved_for=want.reserved_for, bound=bound)
        out.append(Device(DeviceKind.REPLICA, REPLICA_PROFILE, rid, None, PLANNED, pod, how))
    return out


def _replicas(view: observing.NodeView, bound: _Bound) -> Replicas:
    def asked(doc: Mapping[str, Any]) -> int:
        return _asked(doc, WHOLE_GPU) + _asked(doc, RENAMED_GPU)

    pods = sorted(k for k, doc in bound.docs.items() if asked(doc))
    return Replicas(
        per_gpu=_int(view.labels.get(REPLICAS_LABEL, "")),
        total=view.allocatable.get(WHOLE_GPU, 0) + view.allocatable.get(RENAMED_GPU, 0),
        used=sum(asked(bound.docs[k]) for k in pods),
        pods=tuple(pods),
    )


# --------------------------------------------------------------------------- the survey


def _node(
    name: str,
    *,
    view: observing.NodeView | None,
    layout: gpulayouts.GpuLayout | str | None,
    bound: _Bound,
    utilization: Mapping[str, float] | None,
) -> NodeStatus:
    labels = view.labels if view is not None else {}
    mode = labels.get(modes.MODE_LABEL, modes.Mode.MIG.value)
    problems: list[str] = []
    if view is None:
        problems.append("no Node of this name (a GpuLayout left behind)")
    try:
        parsed_mode: modes.Mode | None = modes.node_mode(labels, node=name)
    except errors.MigpilotError as err:
        parsed_mode = None
        problems.append(str(err))
    gpus: list[Gpu] = []
    reported = False
    if isinstance(layout, str):
        problems.append(layout)
    elif layout is not None:
        reported = layout.status is not None
        for gpu, devices in _gpus(layout, bound):
            resolved = _resolve(devices, bound, utilization)
            gpus.append(Gpu(gpu.index, gpu.model, gpu.uuid, resolved))
        for c in layout.status.conditions if layout.status else ():
            if c.type == gpulayouts.READY and c.status is not gpulayouts.ConditionStatus.TRUE:
                problems.append(f"{c.reason}: {c.message}" if c.message else c.reason)
    models = sorted({g.model for g in gpus if g.model})
    model = ", ".join(models) if models else labels.get(PRODUCT_LABEL)
    count = len(gpus) or _int(labels.get(COUNT_LABEL, "")) or 0
    sharing = parsed_mode in (modes.Mode.TIME_SLICING, modes.Mode.NONE) and view is not None
    return NodeStatus(
        name=name,
        model=model,
        mode=mode,
        gpu_count=count,
        gpus=tuple(gpus),
        reported=reported,
        problem="; ".join(problems) or None,
        replicas=_replicas(view, bound) if sharing and view is not None else None,
    )


def _asks(view: observing.PodView) -> tuple[str, ...]:
    if view.ignored is not None or (view.problem is not None and view.pod is None):
        return (f"unreadable: {view.ignored or view.problem}",)
    out = [f"{snapshot.MIG_RESOURCE_PREFIX}{p}: {n}" for p, n in sorted(view.mig.items())]
    out += [f"{r}: {n}" for r, n in sorted(view.mps.items())]
    if view.unified:
        out.append(f"{WHOLE_GPU}: {view.gpus} (unified)")
    return tuple(out)


def _pending(view: observing.PodView, event: _Event | None) -> Pending | None:
    if view.node or view.done:
        return None
    gated = observing.GATE in view.gates
    if not gated and not view.is_mig:
        return None
    if event is not None and event.uid and view.uid and event.uid != view.uid:
        event = None  # said of an earlier pod of the same name
    return Pending(
        pod=view.key,
        asks=_asks(view),
        gated=gated,
        created=view.created,
        reason=event.reason if event else None,
        message=event.message if event else None,
        event_type=event.type if event else None,
    )


def survey(
    *,
    layouts: Iterable[Mapping[str, Any]],
    nodes: Iterable[Mapping[str, Any]],
    pods: Iterable[Mapping[str, Any]],
    events: Iterable[Mapping[str, Any]],
    utilization: Mapping[str, float] | None = None,
    utilization_source: str | None = None,
) -> Status:
    """The cluster's GPUs and waiting pods from raw objects as the API lists them.

    ``utilization`` (0-1, by device UUID, else by ``namespace/pod``) fills each device's
    utilisation, from ``utilization_source`` (e.g. a Prometheus URL); without it no utilisation
    is shown. Never raises on what tenants or a broken agent wrote: a bad object becomes a
    node's :attr:`NodeStatus.problem`, an unreadable ask a pending pod's."""
    pod_docs = [_map(p) for p in pods]
    views = [observing.pod_view(p) for p in pod_docs]
    bound: dict[str, _Bound] = {}
    for view, doc in zip(views, pod_docs, strict=True):
        if view.node and not view.done:
            b = bound.setdefault(view.node, _Bound([], {}))
            b.views.append(view)
            b.docs[view.key] = doc
    node_views = {v.name: v for v in map(observing.node_view, map(_map, nodes))}
    parsed = _layouts(map(_map, layouts))
    names = sorted({*parsed, *(n for n, v in node_views.items() if _is_gpu_node(v))})
    node_rows = tuple(
        _node(
            n,
            view=node_views.get(n),
            layout=parsed.get(n),
            bound=bound.get(n, _Bound([], {})),
            utilization=utilization,
        )
        for n in names
    )
    said = _events(map(_map, events))
    pending = [p for v in views if (p := _pending(v, said.get(v.key))) is not None]
    pending.sort(key=lambda p: (p.created, p.pod))
    return Status(
        nodes=node_rows,
        pending=tuple(pending),
        utilization_source=utilization_source if utilization is not None else None,
    )


# --------------------------------------------------------------------------- JSON


def _device_json(d: Device) -> dict[str, Any]:
    return {
        "kind": d.kind.value,
        "profile": d.profile,
        "slot": d.slot,
        "uuid": d.uuid,
        "state": d.state,
        "pod": d.pod,
        "holder": d.holding.value if d.holding is not None else None,
        "candidates": list(d.candidates),
        "utilization": d.utilization,
    }


def _node_json(n: NodeStatus) -> dict[str, Any]:
    r = n.replicas
    return {
        "name": n.name,
        "model": n.model,
        "mode": n.mode,
        "gpuCount": n.gpu_count,
        "reported": n.reported,
        "problem": n.problem,
        "gpus": [
            {
                "index": g.index,
                "model": g.model,
                "uuid": g.uuid,
                "devices": [_device_json(d) for d in g.devices],
            }
            for g in n.gpus
        ],
        "replicas": None
        if r is None
        else {"perGpu": r.per_gpu, "total": r.total, "used": r.used, "pods": list(r.pods)},
    }


def to_json(status: Status) -> dict[str, Any]:
    """The ``-o json`` document (schema in ``docs/controller.md``, "migpilot status")."""
    return {
        "schemaVersion": SCHEMA_VERSION,
        "utilizationSource": status.utilization_source,
        "nodes": [_node_json(n) for n in status.nodes],
        "pending": [
            {
                "pod": p.pod,
                "asks": list(p.asks),
                "gated": p.gated,
                "created": p.created,
                "reason": p.reason,
                "message": p.message,
                "eventType": p.event_type,
            }
            for p in status.pending
        ],
    }


def counts(node: NodeStatus) -> dict[tuple[str, str], int]:
    """Devices by (profile, state) on a node, for the summary line."""
    out: dict[tuple[str, str], int] = {}
    for g in node.gpus:
        for d in g.devices:
            out[(d.profile, d.state)] = out.get((d.profile, d.state), 0) + 1
    return out
