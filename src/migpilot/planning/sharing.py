"""Planning nodes that share GPUs without MIG: MPS memory slices and time-slicing replicas.

Why it exists: a cluster may mix nodes in mode ``mig``, ``mps``, ``time-slicing`` and ``none``
(:mod:`migpilot.planning.modes`). The MIG planners know only MIG instances, so
:func:`plan_with` splits a snapshot: the nodes in mode ``mig`` and the pods MIG can serve go to
the MIG planner given (fast, first-fit, the baselines) exactly as before; the pods it leaves
pending that an MPS or time-slicing node can serve are placed here; the two halves are merged
into one :class:`~migpilot.planning.plans.Plan` and every pending pod is explained against the
whole cluster (:mod:`migpilot.planning.explaining` says when a node's mode cannot serve a pod).
A snapshot with only MIG nodes and no MPS pod goes to the MIG planner untouched.

An MPS GPU is a memory-slot knapsack: slices of any whole number of GB summing to at most the
GPU's memory, at most 48 clients, compute shares summing to at most 100 %. For each slice a pod
needs, in order of preference: a free slice of exactly that size and share is reused; a new
slice is created in free memory; free slices are removed (largest first, the fewest that make
room) and a new one created -- a resize when the pod's slice replaces them. Taken slices (used
or reserved) are never shrunk or removed. Pods are placed highest priority first; each level is
placed (on problems up to :data:`_SMALL_PROBLEM` GPUs x pods) in up to three ways from the same
state, and the one that leaves the fewest pods pending, then removes the fewest free slices, is
kept: largest demand first in two sweeps (every pod that fits without removing anything, then
the rest with removals allowed); pods asking fewer GPUs first (replicas run out on time-slicing
GPUs), the same way; largest first in one sweep with removals allowed at once (where a large
slice needs the one GPU the first sweep would fill). Among nodes and GPUs the fewest removals
win, then reuse over creation, then the pod's node and GPU policy (binpack: the fullest; spread:
the emptiest), then order.

A time-slicing GPU serves a unified pod with one replica per GPU asked, each on its own GPU.

Pure: no clock, no randomness; the same snapshot gives the same plan. May import the snapshot,
plans, constraints, explaining and modes; never a planner (they import this module).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from migpilot import errors
from migpilot.planning import constraints, explaining, modes, options, plans, scoring, snapshot
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

MigPlanner = Callable[[snapshot.Snapshot, options.Options], plans.Plan]
SharedPlanner = Callable[[snapshot.Snapshot, list[snapshot.Pod]], "Shared"]
"""What places pods on the MPS and time-slicing nodes: :func:`place` (migpilot's), a
baseline's (:func:`migpilot.planning.nosmps.place`) or the exact planner's
(:func:`migpilot.planning.exactsharing.place`)."""
_SliceType = tuple[int, int | None]
"""A slice's GB and compute share: free slices of one type are interchangeable."""


def involved(snap: snapshot.Snapshot) -> bool:
    """Whether ``snap`` has a node not in mode mig or a pod MIG cannot serve (MPS slices by
    name, a unified pod whose ``nvidia.com/vgpu-mode`` is ``mps``)."""
    return any(n.mode is not modes.Mode.MIG for n in snap.nodes) or any(
        not p.served_in(modes.Mode.MIG) for p in snap.pods
    )


def mig_part(snap: snapshot.Snapshot) -> snapshot.Snapshot:
    """The nodes in mode mig and the pods MIG can serve (MIG by name, or unified in any mode
    but ``mps``)."""
    return snapshot.Snapshot(
        nodes=tuple(n for n in snap.nodes if n.mode is modes.Mode.MIG),
        pods=tuple(p for p in snap.pods if p.served_in(modes.Mode.MIG)),
        policy=snap.policy,
        gpu_policy=snap.gpu_policy,
        # The other nodes still make topology domains and hold bound pods.
        outside=snap.outside + tuple(n for n in snap.nodes if n.mode is not modes.Mode.MIG),
        bound=snap.bound,
        namespaces=snap.namespaces,
    )


def plan_with(
    snap: snapshot.Snapshot,
    opts: options.Options,
    mig_planner: MigPlanner,
    shared_planner: SharedPlanner | None = None,
    name: str = "fast",
) -> plans.Plan:
    """Plan ``snap`` with ``mig_planner`` on its MIG nodes and ``shared_planner`` (default:
    :func:`place`) on its MPS and time-slicing nodes; ``name``: the plan's planner when the MIG
    planner had nothing to plan."""
    if not involved(snap):
        return mig_planner(snap, opts)
    part = mig_part(snap)
    mig_plan: plans.Plan | None = None
    if part.nodes and part.pods:
        mig_plan = mig_planner(part, opts)
    placed = {p.pod for p in mig_plan.placements} if mig_plan else set()
    rest = [p for p in snap.pods if p.key not in placed and not p.mig]
    shared = (shared_planner or place)(snap, rest)
    placements = [*(mig_plan.placements if mig_plan else ()), *shared.placements]
    built = plans.build(
        snap,
        planner=mig_plan.planner if mig_plan else name,
        targets={(g.node, g.gpu): g.layout for g in mig_plan.gpus} if mig_plan else {},
        placements=placements,
        unschedulable=(),
        optimal=_optimal(mig_plan, shared),
    )
    done = {p.pod for p in built.placements}
    pending = [p for p in snap.pods if p.key not in done]
    unsched = explaining.explain(snap, pending, built.placements, per_node=opts.explain)
    return dataclasses.replace(
        built,
        mps=shared.mps,
        slice_actions=shared.actions,
        unschedulable=tuple(unsched),
    )


def _optimal(mig_plan: plans.Plan | None, shared: Shared) -> bool | None:
    """The merged plan's :attr:`~plans.Plan.optimal`: both halves proven (``None`` when a half
    claims nothing, as the greedy planners do)."""
    if mig_plan is None:
        return shared.optimal
    if mig_plan.optimal is None or shared.optimal is None:
        return None
    return mig_plan.optimal and shared.optimal


@dataclass(frozen=True, slots=True)
class Shared:
    """What :func:`place` decided for the MPS and time-slicing nodes."""

    placements: tuple[plans.Placement, ...]
    mps: tuple[plans.MpsGpuPlan, ...]
    actions: tuple[plans.SliceAction, ...]
    optimal: bool | None = None
    """Whether the planner proved its pod objective optimal (``None``: a greedy planner, it
    claims nothing)."""


@dataclass(slots=True)
class _MpsGpu:
    gpu: snapshot.Gpu
    keep: list[modes.MpsSlice]
    """Taken slices and those this plan gives to pods."""
    free: list[modes.MpsSlice]
    """Existing free slices not yet reused or removed."""
    next_id: int
    actions: list[plans.SliceAction] = field(default_factory=list)

    @property
    def cap(self) -> int:
        return sharing_mps.memory_gb(self.gpu.model)

    def used_gb(self) -> int:
        return sum(s.memory_gb for s in self.keep) + sum(s.memory_gb for s in self.free)

    def clients(self) -> int:
        return len(self.keep) + len(self.free)

    def cores(self) -> int:
        return sum(s.cores or 0 for s in (*self.keep, *self.free))

    def copy(self) -> _MpsGpu:
        return _MpsGpu(self.gpu, list(self.keep), list(self.free), self.next_id, list(self.actions))


@dataclass(slots=True)
class _TsGpu:
    gpu: snapshot.Gpu
    used: int


@dataclass(frozen=True, slots=True)
class _Option:
    """How one slice goes onto a GPU: a free slice reused, or a new one after removals."""

    reuse: modes.MpsSlice | None
    removed: tuple[modes.MpsSlice, ...] = ()


@dataclass(frozen=True, slots=True)
class _Choice:
    """A pod's placement on one node, with the node's GPU states after it."""

    node: snapshot.Node
    removed: int
    created: int
    shares: tuple[plans.AssignedShare, ...]
    mps: list[_MpsGpu] | None = None
    replicas: tuple[int, ...] = ()


def _option(
    st: _MpsGpu,
    need: modes.SliceNeed,
    *,
    remove: bool,
    removable: Counter[_SliceType] | None = None,
) -> _Option | None:
    """How ``need`` goes onto ``st`` (``None``: it does not, or only by removing when
    ``remove`` is false); ``removable``: at most this many free slices of each size and share
    may be removed (``None``: any)."""
    for s in st.free:
        if s.memory_gb == need.memory_gb and s.cores == need.cores:
            return _Option(s)
    extra_cores = need.cores or 0
    room = st.cap - st.used_gb()
    if (
        st.cores() + extra_cores <= 100
        and room >= need.memory_gb
        and st.clients() < sharing_config.MPS_MAX_CLIENTS
    ):
        return _Option(None)
    if not remove:
        return None
    removed: list[modes.MpsSlice] = []
    budget = None if removable is None else Counter(removable)
    for s in sorted(st.free, key=lambda s: (-s.memory_gb, s.id)):
        if (
            room >= need.memory_gb
            and st.clients() - len(removed) < sharing_config.MPS_MAX_CLIENTS
            and st.cores() - sum(r.cores or 0 for r in removed) + extra_cores <= 100
        ):
            break
        if budget is not None:
            if budget[(s.memory_gb, s.cores)] <= 0:
                continue
            budget[(s.memory_gb, s.cores)] -= 1
        removed.append(s)
        room += s.memory_gb
    if (
        room < need.memory_gb
        or st.clients() - len(removed) >= sharing_config.MPS_MAX_CLIENTS
        or st.cores() - sum(r.cores or 0 for r in removed) + extra_cores > 100
    ):
        return None
    return _Option(None, tuple(removed))


def _apply(
    node: str,
    st: _MpsGpu,
    *,
    need: modes.SliceNeed,
    pod: str,
    reuse: modes.MpsSlice | None,
    removed: tuple[modes.MpsSlice, ...],
) -> int:
    """Give ``pod`` its slice on ``st``; the slice's id."""
    if reuse is not None:
        st.free.remove(reuse)
        st.keep.append(reuse)
        return reuse.id
    verb = "resized into" if removed else "created for"
    for s in removed:
        st.free.remove(s)
        st.actions.append(
            plans.SliceAction(
                node,
                st.gpu.index,
                plans.SliceOp.REMOVE,
                s.id,
                s.memory_gb,
                s.cores,
                f"free slice of {s.memory_gb} GB removed to make room for {pod}",
            )
        )
    new = modes.MpsSlice(st.next_id, need.memory_gb, need.cores)
    st.next_id += 1
    st.keep.append(new)
    st.actions.append(
        plans.SliceAction(
            node,
            st.gpu.index,
            plans.SliceOp.CREATE,
            new.id,
            new.memory_gb,
            new.cores,
            f"slice of {new.memory_gb} GB {verb} {pod}",
        )
    )
    return new.id


class _Run:
    """The state of one placement pass over the sharing nodes."""

    def __init__(self, snap: snapshot.Snapshot) -> None:
        self.snap = snap
        self.nodes = [n for n in snap.nodes if n.mode in (modes.Mode.MPS, modes.Mode.TIME_SLICING)]
        self.admission = constraints.Admission(self.nodes)
        self.mps: dict[str, list[_MpsGpu]] = {}
        self.ts: dict[str, list[_TsGpu]] = {}
        self.cpu: dict[str, int] = {}
        self.mem: dict[str, int] = {}
        for n in self.nodes:
            alloc = n.allocatable
            self.cpu[n.name] = alloc.cpu_milli if alloc else 2**62
            self.mem[n.name] = alloc.memory_bytes if alloc else 2**62
            if n.mode is modes.Mode.MPS:
                self.mps[n.name] = _mps_states(n)
            else:
                self.ts[n.name] = [_TsGpu(g, g.replicas_used) for g in n.gpus]
        self.placements: list[plans.Placement] = []

    def fork(self) -> _Run:
        """An independent copy of this pass (to try another pod order from here)."""
        twin = copy.copy(self)
        twin.mps = {k: [s.copy() for s in v] for k, v in self.mps.items()}
        twin.ts = {k: [_TsGpu(t.gpu, t.used) for t in v] for k, v in self.ts.items()}
        twin.cpu, twin.mem = dict(self.cpu), dict(self.mem)
        twin.placements = list(self.placements)
        return twin

    def removals(self) -> int:
        """Free slices this pass removed so far."""
        return sum(
            a.op is plans.SliceOp.REMOVE
            for sts in self.mps.values()
            for st in sts
            for a in st.actions
        )

    def sweep(self, order: Sequence[snapshot.Pod], *, defer: bool = True) -> list[snapshot.Pod]:
        """Place ``order``; the pods left pending. With ``defer``, first every pod that fits
        without removing a free slice, then the rest with removals allowed; without, each pod
        in turn with removals allowed."""
        left = [p for p in order if not self.place(p, remove=False)] if defer else list(order)
        return [p for p in left if not self.place(p, remove=True)]

    def _node_use(self, node: snapshot.Node) -> float:
        if node.mode is modes.Mode.MPS:
            sts = self.mps[node.name]
            total = sum(s.cap for s in sts) or 1
            return sum(s.used_gb() for s in sts) / total
        tss = self.ts[node.name]
        return sum(t.used for t in tss) / (sum(t.gpu.replicas for t in tss) or 1)

    def place(self, pod: snapshot.Pod, *, remove: bool) -> bool:
        """Place ``pod`` on the best sharing node; whether it was placed."""
        node_policy, gpu_policy = pod.policies(self.snap)
        admits = self.admission.admits(pod)
        best: tuple[tuple[int, int, float, int], _Choice] | None = None
        for ni, node in enumerate(self.nodes):
            if not admits[ni] or not pod.served_in(node.mode):
                continue
            if pod.cpu_milli > self.cpu[node.name] or pod.memory_bytes > self.mem[node.name]:
                continue
            if node.mode is modes.Mode.MPS:
                choice = self._try_mps(node, pod, gpu_policy, remove=remove)
            else:
                choice = self._try_ts(node, pod, gpu_policy)
            if choice is None:
                continue
            use = self._node_use(node)
            score = -use if node_policy is scoring.Policy.BINPACK else use
            key = (choice.removed, choice.created, score, ni)
            if best is None or key < best[0]:
                best = (key, choice)
        if best is None:
            return False
        choice = best[1]
        node = choice.node
        if choice.mps is not None:
            self.mps[node.name] = choice.mps
        else:
            for k in choice.replicas:
                self.ts[node.name][k].used += 1
        self.cpu[node.name] -= pod.cpu_milli
        self.mem[node.name] -= pod.memory_bytes
        self.placements.append(plans.Placement(pod.key, node.name, (), choice.shares))
        return True

    def _try_mps(
        self, node: snapshot.Node, pod: snapshot.Pod, gpu_policy: scoring.Policy, *, remove: bool
    ) -> _Choice | None:
        """The pod's slices on ``node``'s GPUs, one at a time, largest first; ``None``: no room."""
        states = [s.copy() for s in self.mps[node.name]]
        per_model: dict[str, tuple[modes.SliceNeed, ...] | None] = {}
        for st in states:
            m = st.gpu.model
            if m.id not in per_model:
                per_model[m.id] = modes.mps_needs(pod.mps, pod.unified, m)
        count = next((len(v) for v in per_model.values() if v is not None), None)
        if count is None:
            return None
        removed = created = 0
        shares: list[plans.AssignedShare] = []
        groups: dict[int, set[int]] = {}
        for i in range(count):
            best: tuple[tuple[int, int, float, int], modes.SliceNeed, _Option] | None = None
            for k, st in enumerate(states):
                needs = per_model[st.gpu.model.id]
                if needs is None:
                    continue
                need = needs[i]
                if need.group >= 0 and k in groups.get(need.group, set()):
                    continue
                opt = _option(st, need, remove=remove)
                if opt is None:
                    continue
                free_after = (st.cap - st.used_gb() - need.memory_gb) / st.cap
                score = free_after if gpu_policy is scoring.Policy.BINPACK else -free_after
                key = (len(opt.removed), 0 if opt.reuse else 1, score, k)
                if best is None or key < best[0]:
                    best = (key, need, opt)
            if best is None:
                return None
            key, need, opt = best
            k = key[3]
            removed += len(opt.removed)
            created += opt.reuse is None
            sid = _apply(
                node.name, states[k], need=need, pod=pod.key, reuse=opt.reuse, removed=opt.removed
            )
            shares.append(plans.AssignedShare(states[k].gpu.index, sid, need.memory_gb))
            if need.group >= 0:
                groups.setdefault(need.group, set()).add(k)
        return _Choice(node, removed, created, tuple(shares), mps=states)

    def _try_ts(
        self, node: snapshot.Node, pod: snapshot.Pod, gpu_policy: scoring.Policy
    ) -> _Choice | None:
        """One replica per GPU asked, each container's on distinct GPUs; ``None``: no room."""
        if pod.unified is None:
            return None
        tss = self.ts[node.name]
        taken = [t.used for t in tss]
        for k, st in enumerate(tss):
            if modes.replica_needs(pod.unified, st.gpu.model) is None:
                taken[k] = st.gpu.replicas  # this GPU cannot serve it: as if full
        chosen: list[int] = []
        for ask in pod.unified.asks:
            free = [k for k in range(len(tss)) if taken[k] < tss[k].gpu.replicas]
            if len(free) < ask.count:
                return None
            sign = 1 if gpu_policy is scoring.Policy.BINPACK else -1
            free.sort(key=lambda k: (sign * (tss[k].gpu.replicas - taken[k]), k))
            for k in free[: ask.count]:
                taken[k] += 1
                chosen.append(k)
        shares = tuple(plans.AssignedShare(tss[k].gpu.index, None) for k in chosen)
        return _Choice(node, 0, 0, shares, replicas=tuple(chosen))

    def result(self) -> Shared:
        return _result(self.nodes, self.mps, self.placements)


def _mps_states(node: snapshot.Node) -> list[_MpsGpu]:
    """The slices of an MPS node's GPUs as a placement pass starts from them."""
    return [
        _MpsGpu(
            g,
            [s for s in g.mps if s.taken],
            [s for s in g.mps if not s.taken],
            max((s.id for s in g.mps), default=-1) + 1,
        )
        for g in node.gpus
    ]


def _result(
    nodes: Sequence[snapshot.Node],
    mps: Mapping[str, list[_MpsGpu]],
    placements: Sequence[plans.Placement],
    optimal: bool | None = None,
) -> Shared:
    """Target slices of every MPS GPU, their actions (per GPU: removals, then creations)."""
    gpus: list[plans.MpsGpuPlan] = []
    actions: list[plans.SliceAction] = []
    for node in nodes:
        if node.mode is not modes.Mode.MPS:
            continue
        for st in mps[node.name]:
            final = tuple(sorted((*st.keep, *st.free), key=lambda s: s.id))
            gpus.append(plans.MpsGpuPlan(node.name, st.gpu.index, bool(st.actions), final))
            removes = [a for a in st.actions if a.op is plans.SliceOp.REMOVE]
            creates = [a for a in st.actions if a.op is plans.SliceOp.CREATE]
            actions.extend(removes + creates)
    return Shared(tuple(placements), tuple(gpus), tuple(actions), optimal)


def demand_gb(pod: snapshot.Pod) -> int:
    """A model-independent size for ordering: GB asked by name, or MiB/1024 of a unified ask."""
    total = sum(r.memory_gb * r.count for r in pod.mps)
    if pod.unified is not None:
        for ask in pod.unified.asks:
            gb = -(-(ask.memory_mib or 0) // 1024) if ask.memory_mib else ask.memory_percent or 100
            total += gb * ask.count
    return total


_SMALL_PROBLEM = 200_000
"""Sharing GPUs x pods up to which every way of placing a level is tried (fast's threshold for
its MIG variants). Beyond it one pass per level: 2,000 GPUs and 6,000 pods took 18.7 s with one
and 49.7 s with three (placing 3,986 pods instead of 3,593)."""


def place(snap: snapshot.Snapshot, pods: list[snapshot.Pod]) -> Shared:
    """Place ``pods`` on the snapshot's MPS and time-slicing nodes (see the module docstring)."""
    run = _Run(snap)
    if not run.nodes:
        return run.result()
    index = {p.key: i for i, p in enumerate(snap.pods)}
    gpus = sum(len(n.gpus) for n in run.nodes)
    small = gpus * max(len(pods), 1) <= _SMALL_PROBLEM
    for level in sorted({p.priority for p in pods}, reverse=True):
        at_level = [p for p in pods if p.priority == level]
        # Largest demand first packs MPS memory and keeps large pods from starving behind
        # small ones. Where the count binds (time-slicing replicas), a pod asking several GPUs
        # spends replicas that as many one-GPU pods would use: the second order puts pods
        # asking fewer GPUs first, largest demand first among them. Both run from the same
        # state; the one that leaves fewer pods pending, then removes fewer free slices, is
        # kept (the first on a tie). (Smallest first would place more pods per plan still, and
        # starve large ones: bench_sharing's overloaded MPS p99 went from 41,933 s to 60,500 s.)
        # Deferring removals to a second sweep saves removals, and costs a pod where the one
        # GPU a large slice needs (after a removal) is the one the first sweep fills: largest
        # first with removals allowed at once is tried too.
        largest = sorted(at_level, key=lambda p: (-demand_gb(p), index.get(p.key, 0)))
        fewest = sorted(at_level, key=lambda p: (p.count, -demand_gb(p), index.get(p.key, 0)))
        variants = [(largest, True)]
        if small:  # each way costs a pass: on large problems only the first runs, as in fast
            if fewest != largest:
                variants.append((fewest, True))
            if any(st.free for sts in run.mps.values() for st in sts):
                variants.append((largest, False))  # removals matter only where free slices are
        tried: list[tuple[tuple[int, int, int], _Run]] = []
        for k, (order, defer) in enumerate(variants):
            attempt = run.fork() if len(variants) > 1 else run
            left = attempt.sweep(order, defer=defer)
            tried.append(((-len(left), -attempt.removals(), -k), attempt))
        run = max(tried, key=lambda t: t[0])[1]
    return run.result()


@dataclass(frozen=True, slots=True)
class Given:
    """A pod another planner placed on a sharing node, GPU by GPU, for :func:`express`."""

    pod: str
    node: str
    shares: tuple[tuple[int, modes.SliceNeed | None], ...]
    """Per slice or replica: the GPU's index and, on an MPS node, the slice the pod needs there
    (``None``: a time-slicing replica)."""


def express(
    snap: snapshot.Snapshot,
    given: Sequence[Given],
    *,
    removable: Mapping[tuple[str, int], Counter[_SliceType]] | None = None,
    optimal: bool | None = None,
) -> Shared:
    """Pods already assigned to GPUs, expressed as :func:`place` expresses its own choices.

    Per GPU, every slice a pod needs that a free slice of exactly its size and share can
    serve reuses one (in the snapshot's order); the other slices are created in free memory,
    with the next free ids, removing free slices (largest first, the fewest) where there is no
    room: the same reasons, ids and action order as :func:`place`. ``removable``: per
    ``(node, GPU index)``, at most this many free slices of each ``(GB, cores)`` may be removed
    (the assigning planner's choice; absent: any). An assignment that does not fit is a bug in
    the planner that made it: :class:`MigpilotError`.
    """
    nodes = [n for n in snap.nodes if n.mode in (modes.Mode.MPS, modes.Mode.TIME_SLICING)]
    states = {n.name: _mps_states(n) for n in nodes if n.mode is modes.Mode.MPS}
    position = {
        (n.name, st.gpu.index): k for n in nodes for k, st in enumerate(states.get(n.name, ()))
    }
    budget = {key: Counter(c) for key, c in (removable or {}).items()}
    ids: list[list[int | None]] = [[None] * len(g.shares) for g in given]

    def state(g: Given, gpu: int) -> _MpsGpu:
        k = position.get((g.node, gpu))
        if k is None:
            raise errors.MigpilotError(f"{g.pod}: {g.node}/gpu{gpu} is no GPU of an MPS node")
        return states[g.node][k]

    # Reuse first: a need served by a free slice of its exact type never costs a removal.
    for i, g in enumerate(given):
        for j, (gpu, need) in enumerate(g.shares):
            if need is None:
                continue
            st = state(g, gpu)
            match = next(
                (s for s in st.free if (s.memory_gb, s.cores) == (need.memory_gb, need.cores)),
                None,
            )
            if match is not None:
                ids[i][j] = _apply(g.node, st, need=need, pod=g.pod, reuse=match, removed=())
    for i, g in enumerate(given):
        for j, (gpu, need) in enumerate(g.shares):
            if need is None or ids[i][j] is not None:
                continue
            st = state(g, gpu)
            key = (g.node, gpu)
            left = budget.get(key, Counter()) if removable is not None else None
            opt = _option(st, need, remove=True, removable=left)
            if opt is None:
                raise errors.MigpilotError(
                    f"{g.pod}: a slice of {need.memory_gb} GB does not fit on {g.node}/gpu{gpu}"
                )
            if left is not None:
                left.subtract((s.memory_gb, s.cores) for s in opt.removed)
            ids[i][j] = _apply(
                g.node, st, need=need, pod=g.pod, reuse=opt.reuse, removed=opt.removed
            )
    placements = [
        plans.Placement(
            g.pod,
            g.node,
            (),
            tuple(
                plans.AssignedShare(gpu, None)
                if need is None
                else plans.AssignedShare(gpu, ids[i][j], need.memory_gb)
                for j, (gpu, need) in enumerate(g.shares)
            ),
        )
        for i, g in enumerate(given)
    ]
    return _result(nodes, states, placements, optimal)
