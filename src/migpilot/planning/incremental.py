"""Incremental planning: a pass for a few new pods in a big cluster with a standing backlog.

Why it exists: the control loop (:mod:`migpilot.planning.control`) plans the whole pending set
whenever something changes. In a full cluster with a standing backlog (pods no node can serve)
that replans every backlog pod, at a cost that grows with the cluster, each time one pod
arrives, only to find the backlog as unplaceable as before. This module holds the one rule that
says when that work can be skipped, and the pass that skips it.

The rule. A *full* replan leaves some pods unplaced: the backlog (:class:`Backlog`). As long as
the cluster's capacity has not grown since, they are no more placeable than then, so a pass may
plan only the pods that are new (not in the backlog) against the current state, the backlog
treated as still unplaceable. Capacity has grown (:func:`grew`), and the next plan is full, when,
at any step since the last full replan:

- a node joined or left, or one changed in anything but its use (taints, cordon, mode, GPUs,
  a label a backlog pod's node selector or affinity reads: the agents relabel nodes as their
  GPUs change, and no other label can admit a backlog pod); a node or GPU gone lowers
  capacity, but may leave a backlog pod that can never run, which a full replan judges again
  (and refuses);
- an instance in use (bound or reserved) was freed: a pod left, a reservation expired or was
  released without its pod binding there, a whole GPU was freed;
- a node's allocatable CPU or memory rose;
- an MPS or time-slicing GPU changed in any way other than more replicas in use.

The next plan is full, too, when a backlog pod's request or constraints changed, when a pending
pod has pod (anti-)affinity or topology spread terms (one pod's placement can make another
placeable), when whole-GPU pods or dynamic nodes are in the snapshot (their planning,
:mod:`migpilot.planning.dynamic`, replans MIG pods with spare whole GPUs), when the planner's
inputs other than the nodes changed (policies, other nodes, namespaces), and when
``full_every_s`` has passed since the last full replan (a timer, so nothing the rule did not
foresee lasts).

Each step's nodes are compared with the last step's (:func:`observe`), not with the last full
replan's: a reservation made by a plan lowers capacity, and its release by a pod leaving raises
it again, which only a step-by-step comparison sees.

The pass (:func:`plan_new`). The new pods are planned with the same planner on the nodes that
could hold one of them (a sound filter: a node is left out only if no new pod is admitted there,
has the CPU and memory, and finds free memory slices enough; MPS and time-slicing nodes are
always kept), the nodes of each pod ranked (free instances it can reuse, then the node policy)
and the first ``per_pod`` kept; if that leaves a new pod unplaced that some node might hold,
the pass plans again on every node the filter kept (a pod no node might hold, such as one asking
a profile of a model the cluster lacks, costs no retry; where no node has room, the planner sees
a few nodes that admit each pod, for its reasons). The plan is stretched over every GPU of the
snapshot (those left out keep their layouts).

Pure: no clock (``now`` is an argument), no I/O.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from migpilot.mig.profiles import GpuModel
from migpilot.planning import constraints, modes, plans, scoring, snapshot

Planner = Callable[[snapshot.Snapshot], plans.Plan]

STILL = "left unplaced by the last full replan, and no capacity has been freed since"
"""The reason an incremental pass gives the backlog pods it leaves out."""

PER_POD_NODES = 8
"""Nodes kept per new pod in the first try of an incremental pass (:func:`plan_new`)."""


@dataclass(frozen=True, slots=True)
class Backlog:
    """What the loop remembers of the last full replan, for the next passes."""

    pods: Mapping[str, snapshot.Pod]
    """The pods found unplaceable (by the last full replan, or an incremental pass since), by
    key, as they were planned."""
    nodes: Mapping[str, snapshot.Node]
    """The nodes as the last step saw them."""
    inputs: tuple[object, ...]
    """The planner's inputs other than nodes and pods (:func:`_inputs`) at the last full replan."""
    since: float
    """When the last full replan ran."""
    grown: str | None = None
    """How capacity grew since the last full replan (the first change seen), ``None`` if not."""


def _inputs(snap: snapshot.Snapshot) -> tuple[object, ...]:
    return (snap.policy, snap.gpu_policy, snap.outside, dict(snap.namespaces))


def _more(a: snapshot.Resources | None, b: snapshot.Resources | None) -> bool:
    """Whether ``b`` has more CPU or memory than ``a`` (``None``: unconstrained)."""
    if a is None or b is None:
        return a is not b
    return b.cpu_milli > a.cpu_milli or b.memory_bytes > a.memory_bytes


def _label_keys(pods: Iterable[snapshot.Pod]) -> frozenset[str]:
    """The node labels ``pods``' node selectors and required node affinity read."""
    return frozenset(
        key
        for p in pods
        for key in (
            *p.node_selector,
            *(r.key for term in p.affinity for r in term if not r.field),
        )
    )


def grew(
    before: snapshot.Node, after: snapshot.Node, *, keys: frozenset[str] | None = None
) -> str | None:
    """How ``after`` has more room than ``before`` (the same node, a step apart) for some pod,
    or ``None`` when its capacity did not grow (see the module for what counts). ``keys``: the
    labels that count (those the backlog's pods select nodes by; the agents relabel nodes as
    their GPUs change); ``None``: every label."""
    if before is after:
        return None
    name = after.name
    if before.labels != after.labels:
        changed = {
            k
            for k in {*before.labels, *after.labels}
            if before.labels.get(k) != after.labels.get(k)
        }
        if keys is None or changed & keys:
            return f"node {name} changed its labels {', '.join(sorted(changed)[:3])}"
    if (
        before.taints != after.taints
        or before.unschedulable != after.unschedulable
        or before.mode is not after.mode
        or before.dynamic != after.dynamic
    ):
        return f"node {name} changed its taints, cordon or mode"
    if _more(before.allocatable, after.allocatable) or _more(before.capacity, after.capacity):
        return f"node {name} has more CPU or memory"
    old = {g.index: g for g in before.gpus}
    if len(old) != len(after.gpus):
        # A GPU gone lowers capacity, but may leave a backlog pod that can never run: a full
        # replan judges it again (and refuses it).
        return f"node {name} has other GPUs"
    for g in after.gpus:
        o = old.get(g.index)
        if o is None or o.model.id != g.model.id or o.mig != g.mig:
            return f"node {name} GPU {g.index} appeared or changed"
        if o == g:
            continue
        if o.whole_taken and not g.whole_taken:
            return f"node {name} GPU {g.index} was freed"
        if o.mps != g.mps or o.replicas != g.replicas or g.replicas_used < o.replicas_used:
            return f"node {name} GPU {g.index} has more room to share"
        used = {i.instance for i in g.instances if i.used}
        if any(i.used and i.instance not in used for i in o.instances):
            return f"node {name} GPU {g.index}: an instance in use was freed"
    return None


def start(snap: snapshot.Snapshot, unplaced: Iterable[str], *, now: float) -> Backlog:
    """The backlog a full replan of ``snap`` leaves, ``unplaced`` being the pods it left."""
    pods = {p.key: p for p in snap.pods}
    return Backlog(
        pods=MappingProxyType({k: pods[k] for k in unplaced if k in pods}),
        nodes=MappingProxyType({n.name: n for n in snap.nodes}),
        inputs=_inputs(snap),
        since=now,
    )


def observe(backlog: Backlog, snap: snapshot.Snapshot) -> Backlog:
    """``backlog`` after a step that saw ``snap``: its nodes the current ones, and the first
    way capacity grew since the last full replan kept."""
    grown = backlog.grown
    if grown is None:
        keys = _label_keys(backlog.pods.values())
        for n in snap.nodes:
            before = backlog.nodes.get(n.name)
            grown = f"node {n.name} joined" if before is None else grew(before, n, keys=keys)
            if grown is not None:
                break
    if grown is None and len(backlog.nodes) != len(snap.nodes):
        # A node gone lowers capacity, but may leave a backlog pod that can never run.
        gone = sorted(set(backlog.nodes) - {n.name for n in snap.nodes})
        grown = f"node {gone[0]} left" if gone else "nodes changed"
    return dataclasses.replace(
        backlog, nodes=MappingProxyType({n.name: n for n in snap.nodes}), grown=grown
    )


def full_reason(
    backlog: Backlog | None, snap: snapshot.Snapshot, *, now: float, full_every_s: float | None
) -> str | None:
    """Why the plan for ``snap`` at ``now`` must replan every waiting pod, or ``None`` when an
    incremental pass serves (``backlog`` already :func:`observe`-d with ``snap``)."""
    if backlog is None:
        return "no full replan yet"
    if backlog.grown is not None:
        return f"capacity grew: {backlog.grown}"
    if full_every_s is not None and now - backlog.since >= full_every_s:
        return f"{full_every_s:g} s since the last full replan"
    if snap.whole_pods or any(n.dynamic for n in snap.nodes):
        return "whole-GPU pods or dynamic nodes are planned"
    if _inputs(snap) != backlog.inputs:
        return "the planner's inputs changed"
    for pod in snap.pods:
        if pod.terms.constrained or pod.terms.preferring:
            return f"pod {pod.key} has pod affinity or spread terms"
        was = backlog.pods.get(pod.key)
        if was is not None and was != pod:
            return f"pod {pod.key} changed"
    return None


def after(backlog: Backlog, snap: snapshot.Snapshot, plan: plans.Plan) -> Backlog:
    """``backlog`` after an incremental pass: the pods ``plan`` left unplaced join it, and the
    pods no longer waiting leave it."""
    waiting = {p.key: p for p in snap.pods}
    keep = {k: p for k, p in backlog.pods.items() if k in waiting}
    keep.update((u.pod, waiting[u.pod]) for u in plan.unschedulable if u.pod in waiting)
    return dataclasses.replace(backlog, pods=MappingProxyType(keep))


# --------------------------------------------------------------------------- the pass


def _free_slots(node: snapshot.Node) -> dict[str, tuple[GpuModel, int, int]]:
    """Per GPU model of a MIG node: the model, the most free memory slices on one GPU, and the
    total, free meaning not taken by an instance in use (free instances may be destroyed)."""
    out: dict[str, tuple[GpuModel, int, int]] = {}
    for g in node.gpus:
        if not g.mig:
            continue
        taken = sum(g.model.profile_named(i.profile).memory_slots for i in g.instances if i.used)
        free = g.model.memory_slots - taken
        _, most, total = out.get(g.model.id, (g.model, 0, 0))
        out[g.model.id] = (g.model, max(most, free), total + free)
    return out


class _Cache:
    """What :func:`candidates` computes once per node (free slices) and once per pod and GPU
    model (the largest and total memory slices the pod asks there): 10 new pods against 1,000
    nodes would recompute them 10,000 times."""

    def __init__(self) -> None:
        self.free: dict[str, dict[str, tuple[GpuModel, int, int]]] = {}
        self.asks: dict[tuple[str, str], tuple[int, int] | None] = {}

    def slots(self, node: snapshot.Node) -> dict[str, tuple[GpuModel, int, int]]:
        free = self.free.get(node.name)
        if free is None:
            free = self.free[node.name] = _free_slots(node)
        return free

    def ask(self, pod: snapshot.Pod, model: GpuModel) -> tuple[int, int] | None:
        """The largest and the total memory slices ``pod`` asks on ``model`` (``None``: it
        asks nothing there)."""
        key = (pod.key, model.id)
        if key not in self.asks:
            sizes = [model.profile_named(n).memory_slots for n in pod.profiles_on(model) or ()]
            self.asks[key] = (max(sizes), sum(sizes)) if sizes else None
        return self.asks[key]


def _could_hold(pod: snapshot.Pod, node: snapshot.Node, cache: _Cache) -> bool:
    """Whether ``node`` might hold ``pod`` now (false only when it certainly cannot); the
    cheap checks first, each node's free slices (:func:`_free_slots`) kept in ``cache``."""
    if not pod.served_in(node.mode):
        return False
    alloc = node.allocatable
    if alloc is not None and (
        pod.cpu_milli > alloc.cpu_milli or pod.memory_bytes > alloc.memory_bytes
    ):
        return False
    if node.mode is modes.Mode.MIG and not any(
        _room(cache.ask(pod, model), most, total)
        for model, most, total in cache.slots(node).values()
    ):
        return False
    return constraints.rejection(node, pod) is None


def might_hold(pod: snapshot.Pod, node: snapshot.Node) -> bool:
    """Whether ``node`` might hold ``pod`` now: false only when it certainly cannot (the pass's
    sound filter, for one pod and one node)."""
    return _could_hold(pod, node, _Cache())


def _room(asked: tuple[int, int] | None, most: int, total: int) -> bool:
    """Whether ``most`` free memory slices on one GPU and ``total`` on the node's GPUs of one
    model leave room for what a pod asks there (``asked``: :meth:`_Cache.ask`)."""
    return asked is not None and asked[0] <= most and asked[1] <= total


def _spare(node: snapshot.Node) -> dict[str, tuple[snapshot.Gpu, list[str]]]:
    """Per GPU model: a GPU of it, and the profiles of the node's free existing instances on it."""
    out: dict[str, tuple[snapshot.Gpu, list[str]]] = {}
    for g in node.gpus:
        _, names = out.setdefault(g.model.id, (g, []))
        names.extend(i.profile for i in g.instances if not i.used)
    return out


def _reusable(pod: snapshot.Pod, spare: Mapping[str, tuple[snapshot.Gpu, list[str]]]) -> bool:
    """Whether free existing instances (``spare``, :func:`_spare`) cover what ``pod`` asks on
    one model."""
    for gpu, names in spare.values():
        if not names:
            continue
        wanted = pod.profiles_on(gpu.model)
        if wanted and all(names.count(n) >= wanted.count(n) for n in set(wanted)):
            return True
    return False


def _used_share(node: snapshot.Node) -> float:
    total = sum(g.model.memory_slots for g in node.gpus) or 1
    used = sum(
        g.model.profile_named(i.profile).memory_slots
        for g in node.gpus
        for i in g.instances
        if i.used
    )
    return used / total


def candidates(
    snap: snapshot.Snapshot, pods: Sequence[snapshot.Pod], *, per_pod: int | None
) -> tuple[snapshot.Node, ...]:
    """The nodes an incremental pass plans ``pods`` on, in snapshot order: every MPS and
    time-slicing node, and the MIG nodes that might hold one of ``pods``; with ``per_pod``,
    only that many MIG nodes per pod, those with free instances it can reuse first, then by
    its node policy (binpack: the most used)."""
    keep: set[str] = {n.name for n in snap.nodes if n.mode is not modes.Mode.MIG}
    mig = [n for n in snap.nodes if n.mode is modes.Mode.MIG]
    cache = _Cache()
    shares: dict[str, float] = {}
    spares: dict[str, dict[str, tuple[snapshot.Gpu, list[str]]]] = {}
    for pod in pods:
        fit = [(i, n) for i, n in enumerate(mig) if _could_hold(pod, n, cache)]
        if per_pod is not None and len(fit) > per_pod:
            for _, n in fit:
                if n.name not in shares:
                    shares[n.name] = _used_share(n)
                    spares[n.name] = _spare(n)
            lean = -1.0 if (pod.node_policy or snap.policy) is scoring.Policy.BINPACK else 1.0
            fit = sorted(
                fit,
                key=lambda item: (
                    not _reusable(pod, spares[item[1].name]),
                    lean * shares[item[1].name],
                    item[0],
                ),
            )[:per_pod]
        keep.update(n.name for _, n in fit)
    return tuple(n for n in snap.nodes if n.name in keep)


def _stretch(snap: snapshot.Snapshot, plan: plans.Plan) -> plans.Plan:
    """``plan``, made on some of ``snap``'s nodes, over every GPU of ``snap``: the GPUs it does
    not list keep their layouts."""
    listed = {(g.node, g.gpu) for g in plan.gpus}
    rest = [
        plans.GpuPlan(n.name, g.index, False, g.layout)
        for n in snap.nodes
        for g in n.gpus
        if (n.name, g.index) not in listed
    ]
    if not rest:
        return plan
    return dataclasses.replace(plan, gpus=(*plan.gpus, *rest))


def plan_new(
    snap: snapshot.Snapshot,
    new: Sequence[snapshot.Pod],
    planner: Planner,
    *,
    per_pod: int | None = None,
) -> plans.Plan:
    """Plan only the pods ``new`` of ``snap`` (the rest of its pods are the backlog, left out),
    on the nodes that could hold them (see the module); a plan over every GPU of ``snap`` that
    places or leaves unplaced exactly ``new``. ``per_pod``: nodes kept per pod in the first try
    (default :data:`PER_POD_NODES`)."""
    pods = tuple(new)
    if not pods:
        return plans.build(
            dataclasses.replace(snap, pods=()),
            planner="none",
            targets={},
            placements=(),
            unschedulable=(),
        )
    cap = PER_POD_NODES if per_pod is None else per_pod
    first = candidates(snap, pods, per_pod=cap)
    if not first:
        # No node has room: the planner still sees a few nodes that admit each pod, so the
        # pods wait with its reasons (not "no node").
        admit = {
            n.name
            for pod in pods
            for n in itertools.islice(
                (m for m in snap.nodes if constraints.rejection(m, pod) is None), cap
            )
        }
        first = tuple(n for n in snap.nodes if n.name in admit)
    view = dataclasses.replace(snap, nodes=first, pods=pods, whole_pods=(), models=())
    plan = planner(view)
    left = {u.pod for u in plan.unschedulable}
    # A pod no node could hold (the filter is sound) stays unplaced whatever the retry does, and
    # every other pod is placed: the retry over every node (hundreds, in a full cluster) is
    # made only for a pod left unplaced that some node might hold. (Not ``candidates``: it keeps
    # every MPS and time-slicing node whatever the pods ask.)
    cache = _Cache()
    if any(_could_hold(p, n, cache) for p in pods if p.key in left for n in snap.nodes):
        every = candidates(snap, pods, per_pod=None)
        if len(every) > len(first):
            plan = planner(dataclasses.replace(view, nodes=every, models=()))
    return _stretch(snap, plan)


def carried_out(snap: snapshot.Snapshot, plan: plans.Plan) -> snapshot.Snapshot:
    """``snap`` as the next step sees it once ``plan`` is carried out on its MIG nodes: each
    GPU at its target layout, the instances given to pods in use, each node's allocatable less
    its placed pods' CPU and memory, the placed pods no longer waiting (what the benchmark and
    the tests use to build a standing backlog). Only for plans without MPS slices, time-slicing
    replicas or whole GPUs."""
    if plan.mps or plan.switches or any(p.shares or p.gpus for p in plan.placements):
        raise ValueError("carried_out handles plans of MIG instances only")
    targets = {(g.node, g.gpu): g.layout for g in plan.gpus}
    given: dict[tuple[str, int], set[tuple[str, int]]] = {}
    pods = {p.key: p for p in snap.pods}
    took: dict[str, tuple[int, int]] = {}
    for pl in plan.placements:
        for i in pl.instances:
            given.setdefault((pl.node, i.gpu), set()).add((i.profile, i.start))
        pod = pods[pl.pod]
        cpu, mem = took.get(pl.node, (0, 0))
        took[pl.node] = (cpu + pod.cpu_milli, mem + pod.memory_bytes)
    nodes = []
    for n in snap.nodes:
        gpus = []
        for g in n.gpus:
            key = (n.name, g.index)
            target = targets.get(key)
            if target is None:
                gpus.append(g)
                continue
            used = {(i.profile, i.start) for i in g.instances if i.used} | given.get(key, set())
            gpus.append(
                dataclasses.replace(
                    g,
                    instances=tuple(
                        snapshot.ExistingInstance(i.profile, i.start, (i.profile, i.start) in used)
                        for i in target.instances
                    ),
                )
            )
        alloc = n.allocatable
        if alloc is not None and n.name in took:
            cpu, mem = took[n.name]
            alloc = snapshot.Resources(alloc.cpu_milli - cpu, alloc.memory_bytes - mem)
        nodes.append(dataclasses.replace(n, gpus=tuple(gpus), allocatable=alloc))
    placed = {p.pod for p in plan.placements}
    return dataclasses.replace(
        snap, nodes=tuple(nodes), pods=tuple(p for p in snap.pods if p.key not in placed)
    )
