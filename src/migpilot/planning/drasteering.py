"""The first-fit check of DRA steering: a round is steered only when its plan serves more pods
now than kube-scheduler's first fit would, or as many and keeps a kind of room first fit loses.

Why it exists: on DRA nodes kube-scheduler allocates the placements; migpilot steers it by
listing the plan's placements first (``docs/dra.md``, "Steering kube-scheduler"). The simulator
found that steering every round costs pods on loaded clusters: when the plan serves no more pods
now than first fit, the room its placements keep (whole GPUs) went to long multi-GPU pods. Never
steering on a tie cost pods too: first fit then takes the last free whole GPU of a model for a
small claim, and the next whole-GPU pod waits. So a round is steered when the plan places more
of the gated DRA pods than first fit would serve, or as many and leaves, on the DRA nodes, every
profile placeable that first fit's allocations leave and one more (:func:`room`: per GPU model,
the profiles of which one more instance fits somewhere); otherwise the round is first fit's:
the pods first fit serves are let go, each pinned to the node first fit picks, and nothing is
listed first for them (``docs/dra.md``, "The simulator's model and figures"). This module is
that one rule, for the control loop (:func:`migpilot.planning.control.reconcile`) and the
simulator (:mod:`migpilot.sim.drasim`).
It also keeps DRA targets to what pods need (:func:`trimmed`, :func:`cleared`): a free
placement of a target is listed first for any claim, so one left past its pods would steer the
next claims where no plan put them.

First fit is predicted with the allocator model (:mod:`migpilot.planning.draalloc`): the gated
pods in kube-scheduler's queue order (priority, then oldest first, then by key: the order the
controller lets them go in, which is the order kube-scheduler takes pods let go together), each
pod's claims allocated
together as one search (the allocator backtracks across a pod's claims' requests in order) over
the listing migpilot's agent publishes with nothing first (each GPU's placements smallest
first), from the DRA nodes as the snapshot has them (used instances allocated); a pod goes to
the node where its claims fit that kube-scheduler's ``NodeResourcesFit`` score ranks first
(``LeastAllocated``: the most CPU and memory left, the default; ``MostAllocated``: the least;
the pod's :attr:`snapshot.Pod.node_policy` says which, as :func:`draclaims.node_policy` set it),
ties to the first node (kube-scheduler breaks them at random). Pod affinity and topology spread
are not modelled (DRA pods are planned with them; first fit's node may then differ from
kube-scheduler's, which the pin makes kube-scheduler honour or not bind).

Pure: frozen dataclasses and functions, no clock, no I/O.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from migpilot import errors
from migpilot.mig import dra, layouts
from migpilot.planning import (
    constraints,
    draalloc,
    draclaims,
    incremental,
    modes,
    plans,
    snapshot,
)


@dataclass(frozen=True, slots=True)
class Served:
    """A pod first fit serves: the node kube-scheduler picks and the devices it allocates."""

    pod: str
    node: str
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Check:
    """The first-fit check of one round: how many gated DRA pods the plan places and first fit
    serves, and which way the round goes."""

    planned: int
    """Gated DRA pods the plan places."""
    first_fit: tuple[Served, ...]
    """What first fit serves of the gated DRA pods, in queue order."""
    planned_room: Room = frozenset()
    """What still fits on the DRA nodes once the plan's placements are taken (:func:`room`)."""
    first_fit_room: Room = frozenset()
    """What still fits once first fit's allocations are taken."""
    racing: frozenset[str] = frozenset()
    """Pods of :attr:`first_fit` whose claim would be given a placement listed first for a
    pod in flight on their node, were they allocated before it (:func:`first_fit_plan` lists
    their own devices first beside it)."""

    @property
    def kept(self) -> Room:
        """What the plan keeps placeable that first fit's allocations would leave nowhere."""
        return self.planned_room - self.first_fit_room

    @property
    def steer(self) -> bool:
        """The round is steered: the plan serves more pods now than first fit, or as many and
        keeps every kind of room first fit keeps and one more (a profile of some GPU model that
        fits somewhere after the plan and nowhere after first fit)."""
        served = len(self.first_fit)
        return self.planned > served or self.for_room

    @property
    def for_room(self) -> bool:
        """Steered on a tie: the plan serves as many pods now as first fit, and keeps every
        kind of room first fit keeps and one more (:attr:`kept` names it)."""
        return self.planned == len(self.first_fit) and self.planned_room > self.first_fit_room


Room = frozenset[tuple[str, str]]
"""(GPU model id, profile name): the MIG profiles of which one more instance fits on some GPU
of that model on the DRA nodes (:func:`room`)."""


def room(nodes: Sequence[snapshot.Node], taken: Mapping[str, Iterable[str]] | None = None) -> Room:
    """The profiles, per GPU model, of which one more instance fits on some MIG GPU of the DRA
    ``nodes`` beside its used instances and the devices ``taken`` names per node (placements
    allocated or about to be). Free instances do not count: the plugin destroys a free instance
    for an overlapping placement (:func:`layouts.fitting_profiles`)."""
    taken = taken or {}
    out: set[tuple[str, str]] = set()
    for node in nodes:
        if not is_dra_node(node):
            continue
        gpus = _mig_gpus(node)
        models = {g.index: g.model for g in gpus}
        extra: dict[int, set[layouts.Instance]] = {}
        for name in taken.get(node.name, ()):
            try:
                pl = dra.parse_device_name(name, models)
            except dra.PlacementError:
                continue
            extra.setdefault(pl.gpu, set()).add(layouts.Instance(pl.start, pl.profile))
        for g in gpus:
            occupied = {i.instance for i in g.instances if i.used} | extra.get(g.index, set())
            fits = layouts.fitting_profiles(g.model, layouts.Layout.of(occupied))
            out.update((g.model.id, name) for name in fits)
    return frozenset(out)


def claim_of(specs: Sequence[draclaims.ClaimSpec]) -> draalloc.Claim:
    """A pod's claims (in ``spec.resourceClaims`` order) as one claim of the allocator model:
    kube-scheduler allocates all of a pod's claims on its node in one search, each claim's
    requests in order."""
    requests = tuple(draalloc.Request(r.count, r.alternatives) for s in specs for r in s.requests)
    if not requests:
        raise errors.MigpilotError("a DRA pod's claims ask for none of migpilot's devices")
    return draalloc.Claim(requests)


def is_dra_node(node: snapshot.Node) -> bool:
    """Labelled ``migpilot.io/mode=dra``: kube-scheduler allocates its placements."""
    return node.labels.get(modes.MODE_LABEL) == modes.Mode.DRA.value


def _mig_gpus(node: snapshot.Node) -> list[snapshot.Gpu]:
    return [g for g in node.gpus if g.mig and not g.whole_taken]


def queue_order(pods: Iterable[snapshot.Pod]) -> list[snapshot.Pod]:
    """``pods`` (oldest first, as the snapshot lists them) in kube-scheduler's queue order:
    higher priority first (``PrioritySort``), then as they came."""
    return sorted(pods, key=lambda p: -p.priority)


def first_fit(
    nodes: Sequence[snapshot.Node],
    pods: Sequence[snapshot.Pod],
    claims: Mapping[str, draalloc.Claim],
    *,
    whole: Mapping[str, snapshot.Resources | None] | None = None,
    taken: Mapping[str, Iterable[str]] | None = None,
    most_allocated: bool | None = None,
    budget: int = draalloc.DEFAULT_BUDGET,
) -> tuple[Served, ...]:
    """What kube-scheduler's first fit serves of ``pods`` (in the order given: its queue order),
    let go together, on the ``nodes`` that admit them (:func:`constraints.rejection`: a DRA pod
    only DRA nodes), listing nothing first (see the module).

    ``claims``: each pod's claims as one allocator claim (:func:`claim_of`), by key; a pod
    without one is not served. ``whole``: each node's whole CPU and memory for the score (else
    its :attr:`~snapshot.Node.capacity`, else its allocatable). ``taken``: per node, device
    names already spoken for beyond its used instances (placements listed first for pods let go
    before). ``most_allocated``: kube-scheduler's scoring strategy, ``None`` for the one each
    pod's node policy stands for."""
    whole = whole or {}
    taken = taken or {}
    pools: dict[int, tuple[draalloc.Pool, set[str]] | None] = {}
    free: list[list[int] | None] = [
        [n.allocatable.cpu_milli, n.allocatable.memory_bytes] if n.allocatable is not None else None
        for n in nodes
    ]

    def pool(i: int) -> tuple[draalloc.Pool, set[str]] | None:
        # Built on first use: a node no pod is admitted to costs nothing.
        if i not in pools:
            node = nodes[i]
            found = _pool(node)
            if found is None:
                pools[i] = None
            else:
                made, used = found
                used |= set(taken.get(node.name, ()))
                pools[i] = (made, {d for d in used if d in made.by_name})
        return pools[i]

    served: list[Served] = []
    for pod in pods:
        claim = claims.get(pod.key)
        if claim is None:
            continue
        packed = (
            pod.node_policy is snapshot.Policy.BINPACK if most_allocated is None else most_allocated
        )
        best: tuple[float, int, tuple[draalloc.Device, ...]] | None = None
        for i, node in enumerate(nodes):
            left = free[i]
            if left is not None and (pod.cpu_milli > left[0] or pod.memory_bytes > left[1]):
                continue
            if constraints.rejection(node, pod) is not None:
                continue
            found_pool = pool(i)
            if found_pool is None:
                continue
            made, allocated = found_pool
            found = draalloc.allocate(made, claim, allocated=frozenset(allocated), budget=budget)
            if found.devices is None:
                continue
            score = _score(node, pod, left, whole.get(node.name, node.capacity), packed=packed)
            if best is None or score > best[0]:
                best = (score, i, found.devices)
        if best is None:
            continue
        _, i, devices = best
        kept = pools[i]
        assert kept is not None  # allocated from it just now
        kept[1].update(d.name for d in devices)
        left = free[i]
        if left is not None:
            left[0] -= pod.cpu_milli
            left[1] -= pod.memory_bytes
        served.append(Served(pod.key, nodes[i].name, tuple(d.name for d in devices)))
    return tuple(served)


def _pool(node: snapshot.Node) -> tuple[draalloc.Pool, set[str]] | None:
    """The pool of ``node``'s MIG GPUs as its agent publishes it, and the names of its devices
    held by used instances; ``None`` for a node without a MIG GPU."""
    gpus = _mig_gpus(node)
    if not gpus:
        return None
    pool = draalloc.pool_of(node.name, [(g.index, g.model) for g in gpus])
    used = {
        draalloc.device_name(g.index, i.profile, i.start)
        for g in gpus
        for i in g.instances
        if i.used
    }
    return pool, used


def _score(
    node: snapshot.Node,
    pod: snapshot.Pod,
    free: list[int] | None,
    whole: snapshot.Resources | None,
    *,
    packed: bool,
) -> float:
    """kube-scheduler's ``NodeResourcesFit`` score of ``node`` for ``pod``: the share of CPU and
    memory left once the pod is bound (``LeastAllocated``), or its negative (``MostAllocated``,
    ``packed``)."""
    if free is None:
        return 0.0
    cap = whole or node.allocatable
    if cap is None:
        return 0.0
    cpu = (free[0] - pod.cpu_milli) / cap.cpu_milli if cap.cpu_milli else 0.0
    mem = (free[1] - pod.memory_bytes) / cap.memory_bytes if cap.memory_bytes else 0.0
    left = (cpu + mem) / 2
    return -left if packed else left


def check(
    snap: snapshot.Snapshot,
    plan: plans.Plan,
    *,
    gated: frozenset[str],
    claims: Mapping[str, draalloc.Claim],
    whole: Mapping[str, snapshot.Resources | None] | None = None,
    most_allocated: bool | None = None,
    budget: int = draalloc.DEFAULT_BUDGET,
) -> Check | None:
    """The first-fit check of a round: ``plan`` of ``snap``, whose DRA pods
    (:attr:`snapshot.Pod.dra`) named in ``gated`` are held back by migpilot; ``None`` when no
    gated DRA pod waits. ``most_allocated`` and ``budget``: as for :func:`first_fit`.

    The DRA pods let go before and placed by ``plan`` (in flight) keep their planned placements,
    listed first for them: first fit is predicted with those taken, and both rooms
    (:attr:`Check.planned_room`, :attr:`Check.first_fit_room`) count them taken."""
    dra = [p for p in snap.pods if p.dra]
    waiting = [p for p in dra if p.key in gated]
    if not waiting:
        return None
    placed = {pl.pod for pl in plan.placements}
    in_flight = _in_flight(plan, {p.key for p in dra} - gated)
    served = first_fit(
        snap.nodes,
        queue_order(waiting),
        claims,
        whole=whole,
        taken=in_flight,
        most_allocated=most_allocated,
        budget=budget,
    )
    after_plan = _in_flight(plan, {p.key for p in dra})
    after_first_fit: dict[str, list[str]] = {k: list(v) for k, v in in_flight.items()}
    for s in served:
        after_first_fit.setdefault(s.node, []).extend(s.devices)
    return Check(
        planned=sum(1 for p in waiting if p.key in placed),
        first_fit=served,
        planned_room=room(snap.nodes, after_plan),
        first_fit_room=room(snap.nodes, after_first_fit),
        racing=_racing(snap.nodes, served, in_flight, claims, budget=budget),
    )


def _racing(
    nodes: Sequence[snapshot.Node],
    served: Sequence[Served],
    in_flight: Mapping[str, Sequence[str]],
    claims: Mapping[str, draalloc.Claim],
    *,
    budget: int,
) -> frozenset[str]:
    """The pods of ``served`` whose claim, allocated before the pods in flight on its node,
    would take one of their placements (``in_flight``, listed first there) rather than the
    devices first fit predicts (which counts those taken): kube-scheduler reads the
    listed-first devices before the GPU slices. The devices of the node's other pods of
    ``served`` are counted taken."""
    by_name = {n.name: n for n in nodes}
    out: set[str] = set()
    for s in served:
        flying = set(in_flight.get(s.node, ()))
        node = by_name.get(s.node)
        claim = claims.get(s.pod)
        if not flying or node is None or claim is None:
            continue
        found_pool = _pool(node)
        if found_pool is None:
            continue
        pool, taken = found_pool
        taken.update(d for o in served if o.node == s.node and o.pod != s.pod for d in o.devices)
        flying &= set(pool.by_name)
        walk = draalloc.planned_first(pool, flying)
        found = draalloc.allocate(
            walk, claim, allocated=frozenset(taken & set(pool.by_name)), budget=budget
        )
        if found.devices is not None and flying & {d.name for d in found.devices}:
            out.add(s.pod)
    return frozenset(out)


def _in_flight(plan: plans.Plan, pods: set[str]) -> dict[str, list[str]]:
    """Per node, the devices ``plan`` gives ``pods`` (the ungated DRA pods: those in flight)."""
    out: dict[str, list[str]] = {}
    for pl in plan.placements:
        if pl.pod in pods:
            out.setdefault(pl.node, []).extend(
                draalloc.device_name(a.gpu, a.profile, a.start) for a in pl.instances
            )
    return out


def first_fit_plan(
    snap: snapshot.Snapshot,
    plan: plans.Plan,
    *,
    gated: frozenset[str],
    keep: frozenset[str] = frozenset(),
    served: Sequence[Served] = (),
) -> plans.Plan:
    """``plan`` as a round left to first fit carries it out: the gated DRA pods' placements
    dropped (first fit places them), and every DRA node's target its used instances and the
    placements of the DRA pods let go before (in flight), so that its agent lists nothing
    first for the pods let go now (a spec's free placements are what it lists first): as
    :func:`trimmed`, without the gated pods.

    Except the devices of ``served``: pods let go now whose claim a placement listed first
    for a pod in flight on their node would hold (:attr:`Check.racing`). kube-scheduler reads
    the listed-first devices before the node's GPU slices, so such a pod, scheduled before the
    pod in flight is allocated, would take that placement: a larger device than first fit's
    for a claim by memory, and the pod in flight then misses it. Listed first beside it
    (smallest first), first fit's device comes first. Nothing else is listed first: first fit
    over the plain listing gives the other pods those devices anyway."""
    listed: dict[str, list[str]] = {}
    for s in served:
        listed.setdefault(s.node, []).extend(s.devices)
    return trimmed(snap, plan, drop=gated, keep=keep, listed=listed)


def trimmed(
    snap: snapshot.Snapshot,
    plan: plans.Plan,
    *,
    drop: frozenset[str] = frozenset(),
    keep: frozenset[str] = frozenset(),
    listed: Mapping[str, Iterable[str]] | None = None,
) -> plans.Plan:
    """``plan`` with the placements of the pods in ``drop`` left out and every DRA node's target
    its used instances, the placements the plan gives pods there and the devices ``listed``
    names for it (:func:`first_fit_plan`), nothing else: a free
    placement of a DRA node's target is listed first by its agent for kube-scheduler to
    allocate to any pod, so one that no pod is planned onto (the planner kept it free, or an
    earlier target planned it for pods since gone) would steer the next claims where no plan
    put them. The DRA nodes named in ``keep`` (where a pod let go and not yet allocated waits
    that the plan does not place: the caller cannot tell which of the free placements it is
    being allocated) keep the plan's target, as do the nodes not in DRA mode. ``plan`` itself
    when the snapshot has no DRA node."""
    dra_nodes = [n for n in snap.nodes if is_dra_node(n) and n.name not in keep]
    if not dra_nodes:
        if not drop:
            return plan
        return replace(plan, placements=tuple(pl for pl in plan.placements if pl.pod not in drop))
    placements = tuple(pl for pl in plan.placements if pl.pod not in drop)
    targets: dict[tuple[str, int], layouts.Layout] = {}
    for node in dra_nodes:
        models = {g.index: g.model for g in node.gpus}
        extra = [dra.parse_device_name(name, models) for name in (listed or {}).get(node.name, ())]
        for g in node.gpus:
            instances = {i.instance for i in g.instances if i.used}
            instances.update(
                layouts.Instance(a.start, a.profile)
                for pl in placements
                if pl.node == node.name
                for a in pl.instances
                if a.gpu == g.index
            )
            instances.update(
                layouts.Instance(e.start, e.profile) for e in extra if e.gpu == g.index
            )
            targets[(node.name, g.index)] = layouts.Layout.of(instances)
    rebuilt = plans.build(
        replace(snap, nodes=tuple(dra_nodes), pods=()),
        planner=plan.planner,
        targets=targets,
        placements=(),
        unschedulable=(),
    )
    on_dra = {n.name for n in dra_nodes}
    new_gpus = {(g.node, g.gpu): g for g in rebuilt.gpus}
    return replace(
        plan,
        gpus=tuple(new_gpus.get((g.node, g.gpu), g) for g in plan.gpus),
        actions=(
            *(a for a in plan.actions if a.node not in on_dra),
            *rebuilt.actions,
        ),
        placements=placements,
    )


CLEARED = "dra-targets-cleared"
"""The planner named by a plan of :func:`cleared`."""


def cleared(
    snap: snapshot.Snapshot, nodes: frozenset[str]
) -> tuple[plans.Plan | None, frozenset[str]]:
    """For a step with no plan, no DRA pod waiting and none let go and not yet allocated: the
    plan that writes each of ``nodes`` (DRA nodes an earlier plan gave placements for DRA pods)
    whose snapshot GPUs hold a free instance back to its used instances (``None`` when none
    does), and the nodes of ``nodes`` to check again at the next step: those with any instance
    left (a used one is freed when its pod goes). The free placements of a steered target
    outlive its pods otherwise: with nobody waiting nothing replans the node, and its agent
    keeps the instances free and listed first. An instance a claim is allocated, or that a pod
    holds, is a used instance of the snapshot (``observing.dra_gpus``) and stays."""
    ours = tuple(n for n in snap.nodes if n.name in nodes and is_dra_node(n))
    dirty = tuple(n for n in ours if any(not i.used for g in n.gpus for i in g.instances))
    watched = frozenset(n.name for n in ours if any(g.instances for g in n.gpus))
    if not dirty:
        return None, watched
    only = replace(snap, nodes=dirty, pods=(), whole_pods=())
    empty = plans.build(only, planner=CLEARED, targets={}, placements=(), unschedulable=())
    return trimmed(only, empty), watched


def holding(snap: snapshot.Snapshot, served: Iterable[Served]) -> snapshot.Snapshot:
    """``snap`` with the pods let go to first fit and not yet allocated (``served``, each with
    the devices first fit was predicted to give it) out of its pods, their devices used
    instances of their nodes (a free instance they overlap dropped): the plans that follow
    neither list a placement first for them nor give their devices to another pod. A pod whose
    devices no longer fit beside its node's used instances (the cluster changed since) stays
    among the pods, planned again (pinned to its node)."""
    by_node: dict[str, list[Served]] = {}
    waiting = {p.key for p in snap.pods}
    for s in served:
        if s.pod in waiting:
            by_node.setdefault(s.node, []).append(s)
    if not by_node:
        return snap
    held: set[str] = set()
    nodes: list[snapshot.Node] = []
    for node in snap.nodes:
        mine = by_node.get(node.name)
        if not mine:
            nodes.append(node)
            continue
        gpus = {g.index: g for g in node.gpus}
        models = {g.index: g.model for g in node.gpus}
        for s in mine:
            try:
                places = [dra.parse_device_name(d, models) for d in s.devices]
            except dra.PlacementError:
                continue
            after = dict(gpus)
            fits = True
            for pl in places:
                g = after[pl.gpu]
                used = [i.instance for i in g.instances if i.used]
                inst = layouts.Instance(pl.start, pl.profile)
                if layouts.violation(g.model, (*used, inst)) is not None:
                    fits = False
                    break
                # a free instance it overlaps goes (the plugin destroys it first)
                kept = tuple(
                    i
                    for i in g.instances
                    if i.used or layouts.violation(g.model, (i.instance, inst)) is None
                )
                after[pl.gpu] = replace(
                    g,
                    instances=tuple(
                        sorted(
                            (*kept, snapshot.ExistingInstance(pl.profile, pl.start, True)),
                            key=lambda i: (i.start, i.profile),
                        )
                    ),
                )
            if fits:
                gpus = after
                held.add(s.pod)
        nodes.append(replace(node, gpus=tuple(gpus[g.index] for g in node.gpus)))
    return replace(snap, nodes=tuple(nodes), pods=tuple(p for p in snap.pods if p.key not in held))


Planner = Callable[[snapshot.Snapshot], plans.Plan]
"""A planner with its options bound (as :data:`migpilot.planning.control.Planner`)."""

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Aside:
    """A DRA node set aside for the one waiting pod no node can take now but this one could,
    once the instances on it end (a pod of a whole node, or of several whole GPUs): the other
    gated DRA pods are kept off it while that leaves none of them waiting (:func:`set_aside`).

    Why: kube-scheduler's ``LeastAllocated`` score sends each small claim to the emptiest node,
    the very node a pod of a whole node waits for, so on a cluster with room to spare that pod
    waits until the trace ends (the openb window of ``bench/bench_dra.py``). Set aside only
    while that pod is the only one waiting: on a loaded cluster a node kept for a long pod of a
    whole node costs many small pods (``docs/dra.md``, "A node set aside")."""

    pod: str
    node: str


def set_aside(
    snap: snapshot.Snapshot,
    plan: plans.Plan,
    *,
    gated: frozenset[str],
    previous: Aside | None,
    planner: Planner,
) -> Aside | None:
    """The node to set aside after ``plan`` of ``snap`` (``None``: none). Only when exactly one
    pod of ``snap`` is left unplaced, a gated DRA pod (named in ``gated``), and some DRA node
    could take it alone with its instances gone (``planner`` asked of that node emptied):
    ``previous`` if it is for that pod and still such a node, else the one of them with the
    fewest compute slices in use (then by name), which frees soonest as far as migpilot can
    know."""
    placed = {pl.pod for pl in plan.placements}
    unplaced = [p for p in snap.pods if p.key not in placed]
    if len(unplaced) != 1:
        return None
    (pod,) = unplaced
    if not pod.dra or pod.key not in gated:
        return None

    def could(node: snapshot.Node) -> bool:
        if not is_dra_node(node) or node.unschedulable:
            return False
        emptied = replace(
            node,
            gpus=tuple(replace(g, instances=()) for g in node.gpus),
            allocatable=node.capacity or node.allocatable,
        )
        if not incremental.might_hold(pod, emptied):
            return False
        return bool(planner(snapshot.Snapshot(nodes=(emptied,), pods=(pod,))).placements)

    if previous is not None and previous.pod == pod.key:
        node = next((n for n in snap.nodes if n.name == previous.node), None)
        if node is not None and could(node):
            return previous
    for node in sorted(snap.nodes, key=lambda n: (_used_slices(n), n.name)):
        if could(node):
            return Aside(pod.key, node.name)
    return None


def _used_slices(node: snapshot.Node) -> int:
    """Compute slices of ``node``'s GPUs held by used instances."""
    return sum(
        g.model.profile_named(i.profile).compute_slices
        for g in node.gpus
        for i in g.instances
        if i.used
    )


def still_aside(
    aside: Aside | None, snap: snapshot.Snapshot, gated: frozenset[str]
) -> Aside | None:
    """``aside`` while its pod still waits gated in ``snap`` and its node is still a DRA node
    there that admits pods; else ``None``."""
    if aside is None or aside.pod not in gated or all(p.key != aside.pod for p in snap.pods):
        return None
    node = next((n for n in snap.nodes if n.name == aside.node), None)
    if node is None or not is_dra_node(node) or node.unschedulable:
        return None
    return aside


def kept_aside(snap: snapshot.Snapshot, aside: Aside, gated: frozenset[str]) -> snapshot.Snapshot:
    """``snap`` with every gated DRA pod but ``aside``'s kept off its node
    (:func:`constraints.kept_off`): planned, and predicted by first fit, elsewhere."""
    away = frozenset({aside.node})
    return replace(
        snap,
        pods=tuple(
            constraints.kept_off(p, away) if p.dra and p.key in gated and p.key != aside.pod else p
            for p in snap.pods
        ),
    )


def aside_costs(
    kept: plans.Plan,
    plain: Callable[[], plans.Plan | None],
    snap: snapshot.Snapshot,
    aside: Aside,
) -> bool:
    """Whether setting ``aside``'s node aside costs a pod its place now: true when ``kept`` (the
    plan of :func:`kept_aside`'s snapshot) leaves waiting a pod other than ``aside``'s that the
    node might hold (``snap`` is the snapshot as it is) and the plan of ``snap`` (``plain()``,
    planned only then) places more pods. The caller then carries out that plan: the node is
    not set aside this round."""
    placed = {pl.pod for pl in kept.placements}
    node = next((n for n in snap.nodes if n.name == aside.node), None)
    if node is None or not any(
        p.key not in placed and p.key != aside.pod and incremental.might_hold(p, node)
        for p in snap.pods
    ):
        return False
    other = plain()
    return other is not None and len(other.placements) > len(kept.placements)


@dataclass(frozen=True, slots=True)
class AsideRound(Generic[T]):
    """One round planned with the node set aside (:func:`plan_aside`): ``result`` is what the
    caller's planning gave (a plan, or the control loop's ``Planned``)."""

    result: T
    kept: Aside | None
    """The node this round's plan kept the other gated DRA pods off (``None``: none, or setting
    it aside would have cost one of them its place now, :func:`aside_costs`)."""
    remembered: Aside | None
    """The node set aside before this round, while it still is one (:func:`still_aside`), kept
    or not: :meth:`next` keeps it if it still could take its pod."""
    gated: frozenset[str]

    def keeping(self, snap: snapshot.Snapshot) -> snapshot.Snapshot:
        """``snap`` as this round's plan saw it: the other gated DRA pods kept off the node
        set aside (the snapshot the first-fit check must read too)."""
        return kept_aside(snap, self.kept, self.gated) if self.kept is not None else snap

    def next(self, snap: snapshot.Snapshot, plan: plans.Plan, *, planner: Planner) -> Aside | None:
        """The node set aside after this round's ``plan`` of ``snap`` (:func:`set_aside`), the
        one set aside before kept while it still could take its pod, even through a round that
        did not keep it."""
        return set_aside(snap, plan, gated=self.gated, previous=self.remembered, planner=planner)


def plan_aside(
    snap: snapshot.Snapshot,
    aside: Aside | None,
    gated: frozenset[str],
    plan_on: Callable[[snapshot.Snapshot], T],
    plan_of: Callable[[T], plans.Plan | None],
) -> AsideRound[T]:
    """Plan one round with the node set aside, the one rule for the control loop and the
    simulator: ``aside`` (the node set aside so far) while :func:`still_aside`, the other gated
    DRA pods (named in ``gated``) kept off it (:func:`kept_aside`) and planned with ``plan_on``
    (``plan_of`` reads the plan from its result: ``None`` when nothing was planned); when that
    costs one of them its place now (:func:`aside_costs`), ``snap`` planned as it is."""
    still = still_aside(aside, snap, gated)
    if still is None:
        return AsideRound(plan_on(snap), None, None, gated)
    result = plan_on(kept_aside(snap, still, gated))
    kept = plan_of(result)
    if kept is not None:
        plain = functools.cache(lambda: plan_on(snap))
        if aside_costs(kept, lambda: plan_of(plain()), snap, still):
            return AsideRound(plain(), None, still, gated)
    return AsideRound(result, still, still, gated)
