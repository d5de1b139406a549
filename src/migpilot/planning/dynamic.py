"""Dynamic MIG mode in the plan: whole GPUs beside MIG on nodes labelled for it.

Why it exists: a pod asking for a whole GPU (``nvidia.com/gpu: N`` without gpumem, cores or a
percentage) needs a GPU with MIG off, a MIG pod one with MIG on. On a node labelled
``migpilot.io/mig-mode=dynamic`` (:attr:`snapshot.Node.dynamic`) the plan may switch an *idle*
GPU's mode to serve pending pods (``docs/migmode.md``). The other planners know nothing of
modes; :func:`plan` wraps any of them:

1. The MIG pods are planned on the MIG GPUs alone (whole GPUs hidden from the planner).
2. Each whole-GPU pod (:attr:`snapshot.Snapshot.whole_pods`, in order) gets ``N`` GPUs of one
   dynamic node that admits it and has its CPU and memory left: free whole GPUs first, then
   idle MIG GPUs switched out of MIG. *Idle* means no instance used or reserved and none given
   to a pod by step 1; its free instances are destroyed. The node needing the fewest switches
   wins, then snapshot order.
3. When step 1 left MIG pods unplaced and free whole GPUs remain on dynamic nodes, the MIG pods
   are planned again with those GPUs as empty MIG GPUs (and without the GPUs step 2 took); that
   plan is kept when it places more pods, and a whole GPU it puts an instance on is switched
   into MIG.

A GPU with anything used or reserved (an instance, or a whole GPU held or reserved) is never
switched; :func:`migpilot.planning.validation.problems` checks it independently. A snapshot
without dynamic nodes, whole GPUs and whole-GPU pods is planned exactly as before.

Pure: no I/O, no clock. May import this package's snapshot, plans and constraints.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping

from migpilot.mig import layouts
from migpilot.planning import constraints, modes, plans, snapshot

Planner = Callable[[snapshot.Snapshot], plans.Plan]

GpuKey = tuple[str, int]


def no_dynamic_reason() -> str:
    """Why a whole-GPU pod waits when no node may switch a GPU out of MIG."""
    return (
        "it asks for whole GPUs (nvidia.com/gpu without gpumem): migpilot serves them only on "
        f"nodes labelled {modes.MIG_MODE_LABEL}={modes.DYNAMIC_MIG}, and none has an idle GPU "
        "for it"
    )


def idle_mig(gpu: snapshot.Gpu) -> bool:
    """A MIG GPU with no instance used or reserved: its mode may be switched."""
    return gpu.mig and not any(i.used for i in gpu.instances)


def free_whole(gpu: snapshot.Gpu) -> bool:
    """A whole GPU (MIG off) nobody holds or has reserved."""
    return not gpu.mig and not gpu.whole_taken


def _mig_view(
    snap: snapshot.Snapshot,
    *,
    into_mig: frozenset[GpuKey] = frozenset(),
    taken: frozenset[GpuKey] = frozenset(),
    used: Mapping[str, tuple[int, int]] | None = None,
) -> snapshot.Snapshot:
    """``snap`` as the MIG planners see it: only MIG GPUs (and the whole GPUs of ``into_mig``
    as empty MIG GPUs), without the GPUs of ``taken``, each node's allocatable less ``used``
    (CPU, memory); no whole-GPU pods."""
    used = used or {}
    nodes = []
    for n in snap.nodes:
        gpus = tuple(
            g if g.mig else snapshot.Gpu(g.index, g.model, ())
            for g in n.gpus
            if (g.mig or (n.name, g.index) in into_mig) and (n.name, g.index) not in taken
        )
        alloc = n.allocatable
        cpu, mem = used.get(n.name, (0, 0))
        if alloc is not None and (cpu or mem):
            alloc = snapshot.Resources(
                max(alloc.cpu_milli - cpu, 0), max(alloc.memory_bytes - mem, 0)
            )
        nodes.append(dataclasses.replace(n, gpus=gpus, allocatable=alloc))
    return dataclasses.replace(snap, nodes=tuple(nodes), whole_pods=(), models=())


def _run(planner: Planner, view: snapshot.Snapshot) -> plans.Plan:
    if not view.pods:
        return plans.build(view, planner="none", targets={}, placements=(), unschedulable=())
    return planner(view)


def _used(snap: snapshot.Snapshot, placements: Iterable[plans.Placement]) -> dict[str, list[int]]:
    """Per node, the CPU and memory the placements' pods take."""
    pods = {p.key: p for p in (*snap.pods, *snap.whole_pods)}
    out: dict[str, list[int]] = {}
    for pl in placements:
        pod = pods.get(pl.pod)
        if pod is not None:
            got = out.setdefault(pl.node, [0, 0])
            got[0] += pod.cpu_milli
            got[1] += pod.memory_bytes
    return out


def plan(snap: snapshot.Snapshot, planner: Planner) -> plans.Plan:
    """Plan ``snap`` with ``planner``, switching idle GPUs' MIG mode on dynamic nodes (see the
    module for the rules)."""
    if not snap.whole_pods and not any(
        n.dynamic or not all(g.mig for g in n.gpus) for n in snap.nodes
    ):
        return planner(snap)
    first = _run(planner, _mig_view(snap))
    touched = {(p.node, i.gpu) for p in first.placements for i in p.instances}
    used = _used(snap, first.placements)
    given: set[GpuKey] = set()
    switches: dict[GpuKey, bool] = {}
    placements: list[plans.Placement] = []
    unplaced: list[plans.Unschedulable] = []
    for pod in snap.whole_pods:
        best: tuple[int, int, snapshot.Node, list[int]] | None = None
        for rank, node in enumerate(snap.nodes):
            if not node.dynamic or constraints.rejection(node, pod) is not None:
                continue
            if node.allocatable is not None:
                cpu, mem = used.get(node.name, [0, 0])
                if (
                    cpu + pod.cpu_milli > node.allocatable.cpu_milli
                    or mem + pod.memory_bytes > node.allocatable.memory_bytes
                ):
                    continue
            free = [g for g in node.gpus if (node.name, g.index) not in given and free_whole(g)]
            idle = [
                g
                for g in node.gpus
                if (node.name, g.index) not in given
                and (node.name, g.index) not in touched
                and idle_mig(g)
            ]
            if len(free) + len(idle) < pod.whole:
                continue
            chosen = [*free, *idle][: pod.whole]
            flips = sum(1 for g in chosen if g.mig)
            if best is None or (flips, rank) < best[:2]:
                best = (flips, rank, node, [g.index for g in chosen])
        if best is None:
            unplaced.append(plans.Unschedulable(pod.key, no_dynamic_reason()))
            continue
        _, _, node, indexes = best
        by_index = {g.index: g for g in node.gpus}
        for i in indexes:
            given.add((node.name, i))
            if by_index[i].mig:
                switches[(node.name, i)] = False
        got = used.setdefault(node.name, [0, 0])
        got[0] += pod.cpu_milli
        got[1] += pod.memory_bytes
        placements.append(plans.Placement(pod.key, node.name, (), gpus=tuple(sorted(indexes))))
    chosen_plan, spare_used = first, frozenset[GpuKey]()
    spare = frozenset(
        (n.name, g.index)
        for n in snap.nodes
        if n.dynamic
        for g in n.gpus
        if free_whole(g) and (n.name, g.index) not in given
    )
    if first.unschedulable and spare:
        whole_used = _used(snap, placements)
        second = _run(
            planner,
            _mig_view(
                snap,
                into_mig=spare,
                taken=frozenset(switches),
                used={k: (v[0], v[1]) for k, v in whole_used.items()},
            ),
        )
        if len(second.placements) > len(first.placements):
            chosen_plan = second
            spare_used = frozenset(
                (g.node, g.gpu) for g in second.gpus if (g.node, g.gpu) in spare and g.changed
            )
            switches.update(dict.fromkeys(spare_used, True))
    return _assemble(
        snap,
        chosen_plan,
        switches=switches,
        whole=placements,
        unplaced=unplaced,
    )


def _assemble(
    snap: snapshot.Snapshot,
    mig_plan: plans.Plan,
    *,
    switches: Mapping[GpuKey, bool],
    whole: list[plans.Placement],
    unplaced: list[plans.Unschedulable],
) -> plans.Plan:
    """The MIG plan of a view, stretched over every GPU of ``snap``: a GPU switched out of MIG
    gets an empty target (its free instances destroyed), a whole GPU not switched keeps its
    empty layout; the whole-GPU pods' placements and the switches added."""
    planned = {(g.node, g.gpu): g for g in mig_plan.gpus}
    gpus: list[plans.GpuPlan] = []
    destroys: list[plans.Action] = []
    for n in snap.nodes:
        for g in n.gpus:
            key = (n.name, g.index)
            if switches.get(key) is False:
                gpus.append(plans.GpuPlan(n.name, g.index, bool(g.instances), layouts.Layout(())))
                destroys.extend(
                    plans.Action(n.name, g.index, plans.Op.DESTROY, i.profile, i.start)
                    for i in sorted(g.layout.instances)
                )
            elif key in planned:
                gpus.append(planned[key])
            else:
                gpus.append(plans.GpuPlan(n.name, g.index, False, g.layout))
    out = [a for a in mig_plan.actions if switches.get((a.node, a.gpu)) is not False]
    return dataclasses.replace(
        mig_plan,
        gpus=tuple(gpus),
        actions=(*destroys, *out),
        placements=(*mig_plan.placements, *whole),
        unschedulable=(*mig_plan.unschedulable, *unplaced),
        switches=tuple(plans.ModeSwitch(n, i, m) for (n, i), m in sorted(switches.items())),
    )
