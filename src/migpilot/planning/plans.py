"""Plans: what a planner decided, as data (target layouts, ordered actions, pod placements).

Every planner (fast, exact and the baselines) returns a :class:`Plan` made by :func:`build`, so
the actions are always derived the same way from the target layouts: per GPU, destroy what the
target drops (lowest start first), then create what it adds (largest first, the creation order
that always works with explicit placements). Applying a plan is the node agent's job.

GPUs of nodes in mode ``mps`` are planned as MPS memory slices (:mod:`migpilot.planning.sharing`):
their targets are :class:`MpsGpuPlan`, their actions :class:`SliceAction` (remove, then create,
each with its reason), and a pod placed there gets :class:`AssignedShare` values (a slice, or on a
time-slicing GPU one replica). A plan of a MIG-only snapshot has none of them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from migpilot.mig import layouts, profiles
from migpilot.planning import modes, snapshot


class Op(enum.StrEnum):
    """What an action does to one MIG instance."""

    DESTROY = "destroy"
    CREATE = "create"


@dataclass(frozen=True, slots=True)
class Action:
    """One create or destroy on one GPU."""

    node: str
    gpu: int
    op: Op
    profile: str
    start: int


@dataclass(frozen=True, slots=True)
class GpuPlan:
    """The target layout of one GPU."""

    node: str
    gpu: int
    changed: bool
    layout: layouts.Layout


@dataclass(frozen=True, slots=True)
class AssignedInstance:
    """A MIG instance given to a pod: a free instance of the target layout."""

    gpu: int
    profile: str
    start: int


@dataclass(frozen=True, slots=True)
class AssignedShare:
    """A share of a GPU given to a pod: an MPS slice (by id), or one time-slicing replica."""

    gpu: int
    slice: int | None
    """The MPS slice's id; ``None``: a time-slicing replica."""
    memory_gb: int = 0
    """The MPS slice's size in GB (0 for a replica)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """A pod and the instances it gets, all on one node."""

    pod: str
    node: str
    instances: tuple[AssignedInstance, ...]
    shares: tuple[AssignedShare, ...] = ()
    """MPS slices or time-slicing replicas (a pod on a node in mode mps or time-slicing)."""
    gpus: tuple[int, ...] = ()
    """Whole GPUs (MIG off) given to a whole-GPU pod, by index (:mod:`planning.dynamic`)."""


@dataclass(frozen=True, slots=True)
class ModeSwitch:
    """A GPU of a dynamic node whose MIG mode the plan switches (``docs/migmode.md``)."""

    node: str
    gpu: int
    mig: bool
    """The target mode: ``True`` into MIG, ``False`` out of it (a whole GPU)."""


class SliceOp(enum.StrEnum):
    """What an action does to one MPS slice."""

    REMOVE = "remove"
    CREATE = "create"


@dataclass(frozen=True, slots=True)
class SliceAction:
    """One MPS slice removed or created on one GPU, and why."""

    node: str
    gpu: int
    op: SliceOp
    slice: int
    memory_gb: int
    cores: int | None
    reason: str


@dataclass(frozen=True, slots=True)
class MpsGpuPlan:
    """The target MPS slices of one GPU of a node in mode mps."""

    node: str
    gpu: int
    changed: bool
    slices: tuple[modes.MpsSlice, ...]
    """Every slice the GPU will have (taken ones kept as they are, new ones free)."""


@dataclass(frozen=True, slots=True)
class Unschedulable:
    """A pod the plan does not place, and why."""

    pod: str
    reason: str
    nodes: tuple[tuple[str, str], ...] = ()
    """Per node, why it was rejected (filled when an explanation is asked for)."""


@dataclass(frozen=True, slots=True)
class Plan:
    """A planner's answer for one snapshot."""

    planner: str
    gpus: tuple[GpuPlan, ...]
    actions: tuple[Action, ...]
    placements: tuple[Placement, ...]
    unschedulable: tuple[Unschedulable, ...]
    optimal: bool | None = None
    """For the exact planner: whether the solver proved the pod objective optimal."""
    mps: tuple[MpsGpuPlan, ...] = ()
    """Target slices of every GPU of the nodes in mode mps (empty: none in the snapshot)."""
    slice_actions: tuple[SliceAction, ...] = ()
    """MPS slices to remove, then to create, per GPU."""
    switches: tuple[ModeSwitch, ...] = ()
    """GPUs whose MIG mode changes (only on dynamic nodes, only idle GPUs); a GPU switched out
    of MIG has an empty target layout, its free instances destroyed first."""

    def placement_of(self, pod_key: str) -> Placement | None:
        """The placement of a pod, if the plan places it."""
        for p in self.placements:
            if p.pod == pod_key:
                return p
        return None


GpuKey = tuple[str, int]
"""(node name, GPU index)."""


def build(
    snap: snapshot.Snapshot,
    *,
    planner: str,
    targets: Mapping[GpuKey, layouts.Layout],
    placements: Iterable[Placement],
    unschedulable: Iterable[Unschedulable],
    optimal: bool | None = None,
) -> Plan:
    """Assemble a plan in snapshot order; GPUs absent from ``targets`` keep their layout."""
    gpus: list[GpuPlan] = []
    actions: list[Action] = []
    for node in snap.nodes:
        for gpu in node.gpus:
            current = gpu.layout
            target = targets.get((node.name, gpu.index), current)
            if target == current:
                gpus.append(GpuPlan(node.name, gpu.index, False, current))
                continue
            now, then = set(current.instances), set(target.instances)
            for inst in sorted(now - then):
                actions.append(Action(node.name, gpu.index, Op.DESTROY, inst.profile, inst.start))
            model = gpu.model

            def create_order(
                i: layouts.Instance, model: profiles.GpuModel = model
            ) -> tuple[int, int]:
                return (-model.profile_named(i.profile).memory_slots, i.start)

            creates = sorted(then - now, key=create_order)
            for inst in creates:
                actions.append(Action(node.name, gpu.index, Op.CREATE, inst.profile, inst.start))
            gpus.append(GpuPlan(node.name, gpu.index, now != then, target))
    order = {p.key: i for i, p in enumerate(snap.pods)}
    return Plan(
        planner=planner,
        gpus=tuple(gpus),
        actions=tuple(actions),
        placements=tuple(
            sorted(
                (
                    Placement(
                        p.pod,
                        p.node,
                        tuple(sorted(p.instances, key=_inst_key)),
                        tuple(sorted(p.shares, key=_share_key)),
                    )
                    for p in placements
                ),
                key=lambda p: order.get(p.pod, len(order)),
            )
        ),
        unschedulable=tuple(sorted(unschedulable, key=lambda u: order.get(u.pod, len(order)))),
        optimal=optimal,
    )


def _inst_key(i: AssignedInstance) -> tuple[int, int, str]:
    return (i.gpu, i.start, i.profile)


def _share_key(s: AssignedShare) -> tuple[int, int]:
    return (s.gpu, -1 if s.slice is None else s.slice)


def to_json(plan: Plan, *, seconds: float | None = None, explain: bool = False) -> dict[str, Any]:
    """The plan as the documented JSON document (``migpilot plan -o json``)."""
    doc: dict[str, Any] = {"planner": plan.planner}
    if seconds is not None:
        doc["seconds"] = round(seconds, 4)
    if plan.optimal is not None:
        doc["optimal"] = plan.optimal
    doc["gpus"] = [
        {
            "node": g.node,
            "gpu": g.gpu,
            "changed": g.changed,
            "layout": [{"profile": i.profile, "start": i.start} for i in g.layout.instances],
        }
        for g in plan.gpus
    ]
    doc["actions"] = [
        {"node": a.node, "gpu": a.gpu, "op": a.op.value, "profile": a.profile, "start": a.start}
        for a in plan.actions
    ]
    doc["placements"] = [
        {
            "pod": p.pod,
            "node": p.node,
            "instances": [
                {"gpu": i.gpu, "profile": i.profile, "start": i.start} for i in p.instances
            ],
        }
        | (
            {
                "shares": [
                    {"gpu": s.gpu, "slice": s.slice, "memoryGB": s.memory_gb} for s in p.shares
                ]
            }
            if p.shares
            else {}
        )
        | ({"gpus": list(p.gpus)} if p.gpus else {})
        for p in plan.placements
    ]
    if plan.switches:
        doc["switches"] = [{"node": s.node, "gpu": s.gpu, "mig": s.mig} for s in plan.switches]
    if plan.mps:
        doc["mps"] = [
            {
                "node": g.node,
                "gpu": g.gpu,
                "changed": g.changed,
                "slices": [
                    {"id": s.id, "memoryGB": s.memory_gb}
                    | ({"cores": s.cores} if s.cores is not None else {})
                    for s in g.slices
                ],
            }
            for g in plan.mps
        ]
        doc["sliceActions"] = [
            {
                "node": a.node,
                "gpu": a.gpu,
                "op": a.op.value,
                "slice": a.slice,
                "memoryGB": a.memory_gb,
                "reason": a.reason,
            }
            for a in plan.slice_actions
        ]
    unsched = []
    for u in plan.unschedulable:
        entry: dict[str, Any] = {"pod": u.pod, "reason": u.reason}
        if explain:
            entry["nodes"] = [{"node": n, "reason": r} for n, r in u.nodes]
        unsched.append(entry)
    doc["unschedulable"] = unsched
    return doc
