"""First-fit: the simplest planner a cluster could run, and the floor under migpilot's own.

Pods in kube-scheduler's queue order (higher priority first, then snapshot order); each goes to
the first node, in node order, that admits it, has its CPU and memory, and can give it every
instance it asks for: on the node's GPUs in index order, a free existing instance of the
requested profile, or else room to create one beside everything that exists and everything
already planned (new instances of a GPU are placed jointly at the end, so "room" means that a
valid layout holds them all). Nothing is ever destroyed. A pod's instances are taken largest
first.

``fast`` runs it as one of the variants it compares, so no plan of ``fast`` places fewer pods
than first-fit would (the issue "Plans a real cluster can carry out" found a snapshot where it
did). It is also a planner of its own (``migpilot plan --planner first-fit``).

Every step only takes capacity away (free instances get claimed, room shrinks, CPU and memory
are used), so a node that cannot serve a kind of pod now never can later in the same plan: each
kind keeps a cursor into the node list and the whole plan costs about one pass over the nodes
per kind of pod, which keeps it cheap at thousands of GPUs.

Pure: no clock, no randomness; the same snapshot gives the same plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from migpilot.mig import layouts
from migpilot.planning import constraints, explaining, options, plans, podaffinity, snapshot

PLANNER = "first-fit"


@dataclass(slots=True)
class _Gpu:
    """One GPU while planning: what exists (kept whole), what is claimed, what is added."""

    gpu: snapshot.Gpu
    fixed: frozenset[layouts.Instance]
    """Every existing instance: first-fit destroys nothing."""
    free: list[layouts.Instance]
    """Existing free instances not yet given to a pod, in start order."""
    new: tuple[str, ...] = ()
    """Profiles to create (sorted), positions decided at the end."""
    owners: list[tuple[str, str]] = field(default_factory=list)
    """(pod key, profile) per new instance, in the order they were planned."""

    def take(self, profile: str) -> layouts.Instance | str | None:
        """Give one instance of ``profile``: a free existing one, else room for a new one (the
        profile name is returned), else ``None``."""
        for i, inst in enumerate(self.free):
            if inst.profile == profile:
                return self.free.pop(i)
        grown = tuple(sorted((*self.new, profile)))
        if layouts.pack(self.gpu.model, grown, self.fixed) is None:
            return None
        self.new = grown
        return profile


def _node_state(node: snapshot.Node) -> list[_Gpu]:
    return [
        _Gpu(
            gpu=g,
            fixed=frozenset(i.instance for i in g.instances),
            free=[i.instance for i in g.instances if not i.used],
        )
        for g in node.gpus
    ]


def _copy(gpus: list[_Gpu]) -> list[_Gpu]:
    return [_Gpu(g.gpu, g.fixed, list(g.free), g.new, list(g.owners)) for g in gpus]


def _try(
    gpus: list[_Gpu], pod: snapshot.Pod, wanted: list[int]
) -> list[tuple[int, layouts.Instance | str]] | None:
    """Take one instance per entry of ``wanted`` (parts of the request, largest first) from
    ``gpus`` in place, each of the profile that serves the part on the GPU's model; ``None``
    (and ``gpus`` partly changed: callers work on a copy) if one of them has no GPU."""
    got: list[tuple[int, layouts.Instance | str]] = []
    names: dict[str, tuple[str | None, ...]] = {}
    for part in wanted:
        for k, g in enumerate(gpus):
            model = g.gpu.model
            on = names.get(model.id)
            if on is None:
                on = names[model.id] = pod.parts_on(model)
            profile = on[part]
            if profile is None:
                continue
            taken = g.take(profile)
            if taken is not None:
                if isinstance(taken, str):
                    g.owners.append((pod.key, taken))
                got.append((k, taken))
                break
        else:
            return None
    return got


def _wanted(pod: snapshot.Pod, node: snapshot.Node) -> list[int] | None:
    """The pod's instances as parts of its request (one entry per instance), largest first, or
    ``None`` if no GPU of the node serves one of them."""
    counts = pod.parts
    keys: list[tuple[int, str]] = []
    for part in range(len(counts)):
        found = [
            (g.model.profile_named(name).memory_slots, name)
            for g in node.gpus
            if (name := pod.parts_on(g.model)[part]) is not None
        ]
        if not found:
            return None
        keys.append((-max(s for s, _ in found), min(n for _, n in found)))
    order = sorted(range(len(counts)), key=lambda part: (*keys[part], part))
    return [part for part in order for _ in range(counts[part])]


def plan(
    snap: snapshot.Snapshot,
    opts: options.Options,
    *,
    order: Sequence[snapshot.Pod] | None = None,
) -> plans.Plan:
    """Plan ``snap`` first-fit (see the module docstring); pods in kube-scheduler's queue order,
    or in ``order``."""
    targets, placements = place(snap, order=order)
    chosen = plans.build(
        snap, planner=PLANNER, targets=targets, placements=placements, unschedulable=()
    )
    placed = {p.pod for p in placements}
    pending = [p for p in snap.pods if p.key not in placed]
    unsched = explaining.explain(snap, pending, chosen.placements, per_node=opts.explain)
    return dataclasses.replace(chosen, unschedulable=tuple(unsched))


def place(
    snap: snapshot.Snapshot, *, order: Sequence[snapshot.Pod] | None = None
) -> tuple[dict[plans.GpuKey, layouts.Layout], list[plans.Placement]]:
    """First-fit's target layouts (GPUs it changes) and placements, without reasons for the
    pods left pending: what ``fast`` compares its own plan with."""
    admission = constraints.Admission(snap.nodes)
    state: dict[int, list[_Gpu]] = {}
    left: list[tuple[int, int] | None] = [
        None if n.allocatable is None else (n.allocatable.cpu_milli, n.allocatable.memory_bytes)
        for n in snap.nodes
    ]
    cursor: dict[tuple[object, ...], int] = {}
    claimed: dict[str, list[tuple[int, int, layouts.Instance | str]]] = {}
    wanted_on: dict[tuple[snapshot.Demand, int], list[int] | None] = {}
    classes = [tuple(g.model.id for g in n.gpus) for n in snap.nodes]
    first_of: dict[tuple[str, ...], int] = {}
    for ni, c in enumerate(classes):
        first_of.setdefault(c, ni)
    tracker = podaffinity.Tracker(snap)
    for pod in sorted(snap.pods, key=lambda p: -p.priority) if order is None else order:
        kind = (pod.demand, constraints.signature(pod), pod.cpu_milli, pod.memory_bytes)
        admits = admission.admits(pod)
        # Where other pods decide (pod affinity, spread), a node passed over may fit later: no
        # cursor for such a pod.
        involved = tracker.involved(pod)
        if involved:
            refused = tracker.refusals(pod)
            admits = [a and r is None for a, r in zip(admits, refused, strict=True)]
        ni = 0 if involved else cursor.get(kind, 0)
        while ni < len(snap.nodes):
            room = left[ni]
            if admits[ni] and (
                room is None or (pod.cpu_milli <= room[0] and pod.memory_bytes <= room[1])
            ):
                # Nodes with the same GPU models want the same instances.
                wkey = (pod.demand, first_of[classes[ni]])
                if wkey not in wanted_on:
                    wanted_on[wkey] = _wanted(pod, snap.nodes[ni])
                wanted = wanted_on[wkey]
                if wanted is not None:
                    trial = _copy(state.get(ni) or _node_state(snap.nodes[ni]))
                    got = _try(trial, pod, wanted)
                    if got is not None:
                        state[ni] = trial
                        if room is not None:
                            left[ni] = (room[0] - pod.cpu_milli, room[1] - pod.memory_bytes)
                        claimed[pod.key] = [(ni, k, t) for k, t in got]
                        tracker.add(pod, snap.nodes[ni].name)
                        break
            ni += 1
        if not involved:
            cursor[kind] = ni
    return _result(snap, state, claimed)


def _result(
    snap: snapshot.Snapshot,
    state: dict[int, list[_Gpu]],
    claimed: dict[str, list[tuple[int, int, layouts.Instance | str]]],
) -> tuple[dict[plans.GpuKey, layouts.Layout], list[plans.Placement]]:
    """Target layouts (new instances placed jointly) and each pod's instances."""
    targets: dict[plans.GpuKey, layouts.Layout] = {}
    new_at: dict[tuple[int, int], dict[tuple[str, str], list[layouts.Instance]]] = {}
    for ni, gpus in state.items():
        node = snap.nodes[ni]
        for k, g in enumerate(gpus):
            if not g.new:
                continue
            lay = layouts.pack(g.gpu.model, g.new, g.fixed)
            assert lay is not None  # take() checked that exactly these fit
            targets[(node.name, g.gpu.index)] = lay
            created = sorted(
                (i for i in lay.instances if i not in g.fixed), key=lambda i: (i.profile, i.start)
            )
            by_owner: dict[tuple[str, str], list[layouts.Instance]] = {}
            for owner in g.owners:
                inst = next(i for i in created if i.profile == owner[1])
                created.remove(inst)
                by_owner.setdefault(owner, []).append(inst)
            new_at[(ni, k)] = by_owner
    placements: list[plans.Placement] = []
    for pod in snap.pods:
        parts = claimed.get(pod.key)
        if parts is None:
            continue
        got: list[plans.AssignedInstance] = []
        for ni, k, taken in parts:
            gpu = snap.nodes[ni].gpus[k]
            inst = (
                taken
                if isinstance(taken, layouts.Instance)
                else new_at[(ni, k)][(pod.key, taken)].pop(0)
            )
            got.append(plans.AssignedInstance(gpu.index, inst.profile, inst.start))
        placements.append(plans.Placement(pod.key, snap.nodes[parts[0][0]].name, tuple(got)))
    return targets, placements
