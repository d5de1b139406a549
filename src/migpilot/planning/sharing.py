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
placed, at every size, in up to three ways from the same state, and the one that leaves the
fewest pods pending, then removes the fewest free slices, is kept: largest demand first in two
sweeps (every pod that fits without removing anything, then the rest with removals allowed);
pods asking fewer GPUs first (replicas run out on time-slicing GPUs), the same way; largest
first in one sweep with removals allowed at once (where a large slice needs the one GPU the
first sweep would fill). Where every way leaves pods of the level pending, a search (within
:data:`SEARCH_WORK`: placements tried times GPUs, so small problems only) tries more orders:
smallest demand first, fewest GPUs then smallest, least node memory and CPU first, most GPUs
first, fewest nodes that admit the pod first, the queue's; one is kept only if it places more,
so largest first wins every tie. Between orders that place as many of a level, the one after
which the levels below place the most wins (a lookahead: each level below placed largest first
on a copy). Among nodes and GPUs the fewest
removals win, then reuse over creation, then the pod's node and GPU policy (binpack: the
fullest; spread: the emptiest), then order.

A pass does not scan every node and GPU per pod: it keeps indexes of the GPU states
(:class:`_Run`: per kind of node its nodes with room in each policy's score order, per free
slice type the nodes holding one, per node the most free GB of a GPU, their sum and what
removals could free), updated as pods are placed, and the three ways share node states
copy-on-write. Its choices are exactly those of the scan over every node
(tests/unit/test_sharing_index.py keeps the scan as a reference); 2,000 GPUs and 6,000 pending
pods plan in about a second with all three ways (bench/bench_sharing.py --speed-only).

A time-slicing GPU serves a unified pod with one replica per GPU asked, each on its own GPU.

Pure: no clock, no randomness; the same snapshot gives the same plan. May import the snapshot,
plans, constraints, explaining and modes; never a planner (they import this module).
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, Self, TypeVar

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
    """One MPS GPU's slices as a pass changes them, with their sums kept up to date (a pod's
    placement reads them for every GPU it looks at: summing the slices each time cost most of
    the planner's time)."""

    gpu: snapshot.Gpu
    keep: list[modes.MpsSlice]
    """Taken slices and those this plan gives to pods."""
    free: list[modes.MpsSlice]
    """Existing free slices not yet reused or removed."""
    next_id: int
    actions: list[plans.SliceAction]
    cap: int
    """The GPU's GB (:func:`migpilot.sharing.mps.memory_gb`)."""
    used: int
    """GB of the kept and free slices."""
    clients: int
    """Kept and free slices."""
    cores: int
    """Compute shares (percent) of the kept and free slices."""

    def copy(self) -> _MpsGpu:
        return _MpsGpu(
            self.gpu,
            list(self.keep),
            list(self.free),
            self.next_id,
            list(self.actions),
            self.cap,
            self.used,
            self.clients,
            self.cores,
        )


def _mps_gpu(gpu: snapshot.Gpu) -> _MpsGpu:
    """A GPU's slices as a pass starts from them: taken slices kept, the others free."""
    slices = gpu.mps
    return _MpsGpu(
        gpu,
        [s for s in slices if s.taken],
        [s for s in slices if not s.taken],
        max((s.id for s in slices), default=-1) + 1,
        [],
        sharing_mps.memory_gb(gpu.model),
        sum(s.memory_gb for s in slices),
        len(slices),
        sum(s.cores or 0 for s in slices),
    )


@dataclass(frozen=True, slots=True)
class _Option:
    """How one slice goes onto a GPU: a free slice reused, or a new one after removals."""

    reuse: modes.MpsSlice | None
    removed: tuple[modes.MpsSlice, ...] = ()


_ROOM = _Option(None)


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
    gb, cores = need.memory_gb, need.cores
    for s in st.free:
        if s.memory_gb == gb and s.cores == cores:
            return _Option(s)
    extra_cores = cores or 0
    room = st.cap - st.used
    if st.cores + extra_cores <= 100 and room >= gb and st.clients < sharing_config.MPS_MAX_CLIENTS:
        return _ROOM
    if not remove:
        return None
    removed: list[modes.MpsSlice] = []
    freed_cores = 0
    budget = None if removable is None else Counter(removable)
    for s in sorted(st.free, key=lambda s: (-s.memory_gb, s.id)):
        if (
            room >= gb
            and st.clients - len(removed) < sharing_config.MPS_MAX_CLIENTS
            and st.cores - freed_cores + extra_cores <= 100
        ):
            break
        if budget is not None:
            if budget[(s.memory_gb, s.cores)] <= 0:
                continue
            budget[(s.memory_gb, s.cores)] -= 1
        removed.append(s)
        room += s.memory_gb
        freed_cores += s.cores or 0
    if (
        room < gb
        or st.clients - len(removed) >= sharing_config.MPS_MAX_CLIENTS
        or st.cores - freed_cores + extra_cores > 100
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
        st.used -= s.memory_gb
        st.clients -= 1
        st.cores -= s.cores or 0
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
    st.used += new.memory_gb
    st.clients += 1
    st.cores += new.cores or 0
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


_Entry = tuple[float, int]
"""A node in a score list: its score under one node policy, its position."""
_Step = tuple[int, modes.SliceNeed, _Option]
"""One slice of a pod on a node: the GPU's position on the node, the slice, how it goes there."""
_Key = tuple[int, int, float, int]
"""A node's rank for a pod, least first: free slices removed, slices created, the node policy's
score (binpack: the fuller the less), the node's position."""


@dataclass(frozen=True, slots=True)
class _Ask:
    """What a pod asks of the sharing nodes, worked out once per pod for every pass."""

    node_policy: scoring.Policy
    gpu_policy: scoring.Policy
    needs: Mapping[str, tuple[modes.SliceNeed, ...] | None]
    """Per GPU model id of the MPS nodes: the slices the pod needs there (``None``: not served;
    empty where the pod is not served in mode mps)."""
    count: int
    """Slices per pod on an MPS node (0: none serves it)."""
    mps_kinds: tuple[tuple[int, int, int], ...]
    """Per kind of MPS node that serves the pod: (kind, GB of its largest slice, GB of all its
    slices), the least over the kind's models."""
    reuse: frozenset[tuple[str, int, int | None]]
    """(model id, GB, cores): free slices the pod could reuse."""
    ts_kinds: tuple[int, ...]
    """Kinds of time-slicing node with a GPU model that serves the pod."""
    ts_gpus: int
    """The most GPUs one container asks (distinct GPUs with a free replica a node needs)."""
    ts_models: frozenset[str]
    """Ids of the GPU models of time-slicing nodes that serve the pod."""


class _Run:
    """The state of one placement pass over the sharing nodes, and its indexes.

    A pod's best node is the least :data:`_Key`. Rather than trying every node, a pass keeps per
    kind of node (mode and GPU models) its nodes sorted by each node policy's score, per free
    slice type (model, GB, cores) the nodes that hold one, the nodes holding any free slice,
    and per node the most free GB of a GPU below the client limit (MPS) or the GPUs with a free
    replica (time-slicing). Then a pod's best node is among: the first time-slicing node in
    score order that fits (removes and creates nothing); the MPS nodes holding a free slice it
    could reuse, each tried; the first other MPS node in score order that fits without
    removals (creates every slice: no free slice of its types is there); and only where none of
    these fits, with removals allowed, the MPS nodes holding a free slice, each tried. Every
    node not looked at provably cannot fit the pod, or ranks after one that was: the choice is
    exactly the scan's over every node. Placing a pod updates the one node's entries.

    Passes fork (several pod orders from one state): node states are shared copy-on-write
    (a pass copies a node's GPUs the first time it changes them), the indexes are copied.
    """

    def __init__(self, snap: snapshot.Snapshot) -> None:
        self.snap = snap
        self.nodes = [n for n in snap.nodes if n.mode in (modes.Mode.MPS, modes.Mode.TIME_SLICING)]
        self.admission = constraints.Admission(self.nodes)
        self.is_mps = [n.mode is modes.Mode.MPS for n in self.nodes]
        self.mps: list[list[_MpsGpu]] = [
            [_mps_gpu(g) for g in n.gpus] if mps else []
            for n, mps in zip(self.nodes, self.is_mps, strict=True)
        ]
        self.ts: list[list[int]] = [
            [] if mps else [g.replicas_used for g in n.gpus]
            for n, mps in zip(self.nodes, self.is_mps, strict=True)
        ]
        self._own: set[int] = set(range(len(self.nodes)))
        """Nodes whose state lists (and GPU states) no other pass shares."""
        big = 2**62
        self.cpu = [n.allocatable.cpu_milli if n.allocatable else big for n in self.nodes]
        self.mem = [n.allocatable.memory_bytes if n.allocatable else big for n in self.nodes]
        self.total = [
            (sum(s.cap for s in sts) if mps else sum(g.replicas for g in n.gpus)) or 1
            for n, mps, sts in zip(self.nodes, self.is_mps, self.mps, strict=True)
        ]
        self.used = [
            sum(s.used for s in sts) if mps else sum(t)
            for mps, sts, t in zip(self.is_mps, self.mps, self.ts, strict=True)
        ]
        self.use = [u / t for u, t in zip(self.used, self.total, strict=True)]
        self.room = [0] * len(self.nodes)
        self.spare = [0] * len(self.nodes)
        self.reclaim = [0] * len(self.nodes)
        for ni in range(len(self.nodes)):
            self._room(ni)
        kinds: dict[tuple[modes.Mode, tuple[str, ...]], int] = {}
        self.kind_of = [
            kinds.setdefault((n.mode, tuple(sorted({g.model.id for g in n.gpus}))), len(kinds))
            for n in self.nodes
        ]
        self.kinds = list(kinds)
        self.mps_models = {
            g.model.id: g.model
            for n, mps in zip(self.nodes, self.is_mps, strict=True)
            if mps
            for g in n.gpus
        }
        self.ts_models = {
            g.model.id: g.model
            for n, mps in zip(self.nodes, self.is_mps, strict=True)
            if not mps
            for g in n.gpus
        }
        # Per kind, its nodes with room by each policy's score: (score, position), ascending.
        # A node without room (time-slicing: no free replica; MPS: no GB free on a GPU below
        # the client limit) fits only pods that reuse or remove free slices, found elsewhere:
        # it leaves the lists (binpack would otherwise look at the full nodes first, each time).
        # Lists are kept for the node policies pods have asked for so far (:meth:`_listing`).
        self.order: dict[tuple[scoring.Policy, int], list[_Entry]] = {}
        self.policies: list[scoring.Policy] = []
        self.reuse: dict[tuple[str, int, int | None], dict[int, int]] = {}
        self.slices: dict[int, int] = {}
        """MPS nodes holding free slices: how many."""
        self.types_of: list[set[tuple[str, int, int | None]]] = [set() for _ in self.nodes]
        """Per node: the free slice types it holds."""
        for ni, sts in enumerate(self.mps):
            for st in sts:
                for s in st.free:
                    t = (st.gpu.model.id, s.memory_gb, s.cores)
                    at = self.reuse.setdefault(t, {})
                    at[ni] = at.get(ni, 0) + 1
                    self.slices[ni] = self.slices.get(ni, 0) + 1
                    self.types_of[ni].add(t)
        # Per free slice type, its nodes by each policy's score, as :attr:`order`.
        self.reuse_order: dict[tuple[scoring.Policy, tuple[str, int, int | None]], list[_Entry]]
        self.reuse_order = {}
        self.asks: dict[str, tuple[_Ask, list[bool]]] = {}
        """Per pod key: :meth:`_ask` (shared by forks: it does not change)."""
        self.shapes: dict[tuple[object, ...], _Ask] = {}
        """Per request and policies (shared by forks too)."""
        self.placements: list[plans.Placement] = []
        self.removed = 0
        self.flip = False
        """Whether pods go by the other node policy than theirs (a variant of the search)."""
        """Free slices this pass removed so far."""

    def _listing(self, policy: scoring.Policy) -> None:
        """Start keeping the score lists of ``policy`` (from the state now)."""
        self.policies.append(policy)
        for k in range(len(self.kinds)):
            self.order[(policy, k)] = sorted(
                (self._score(policy, ni), ni)
                for ni in range(len(self.nodes))
                if self.kind_of[ni] == k and self.room[ni] > 0
            )
        for t, at in self.reuse.items():
            self.reuse_order[(policy, t)] = sorted((self._score(policy, ni), ni) for ni in at)

    def _score(self, policy: scoring.Policy, ni: int) -> float:
        return -self.use[ni] if policy is scoring.Policy.BINPACK else self.use[ni]

    def _room(self, ni: int) -> None:
        """Update the node's room: MPS, the most free GB of a GPU below the client limit (-1:
        none), their sum, and the most GB one GPU would have with its free slices removed;
        time-slicing, the GPUs with a free replica. Each bounds what a node can take: a node
        below a pod's figures cannot fit it."""
        if self.is_mps[ni]:
            most = spare = reclaim = -1
            for s in self.mps[ni]:
                free = s.cap - s.used
                if s.clients < sharing_config.MPS_MAX_CLIENTS:
                    most = max(most, free)
                    spare += free
                # Any GPU: a pod's slices may go some by room, some after removals.
                reclaim = max(reclaim, free + sum(f.memory_gb for f in s.free))
            self.room[ni], self.spare[ni], self.reclaim[ni] = most, spare + 1, reclaim
            return
        gpus = self.nodes[ni].gpus
        self.room[ni] = sum(1 for g, u in zip(gpus, self.ts[ni], strict=True) if u < g.replicas)

    def fork(self) -> _Run:
        """An independent copy of this pass (to try another pod order from here)."""
        twin = copy.copy(self)
        self._own = set()
        twin._own = set()
        twin.mps, twin.ts = list(self.mps), list(self.ts)
        twin.cpu, twin.mem = list(self.cpu), list(self.mem)
        twin.used, twin.use, twin.room = list(self.used), list(self.use), list(self.room)
        twin.spare, twin.reclaim = list(self.spare), list(self.reclaim)
        twin.order = {k: list(v) for k, v in self.order.items()}
        twin.reuse = {k: dict(v) for k, v in self.reuse.items()}
        twin.reuse_order = {k: list(v) for k, v in self.reuse_order.items()}
        twin.policies = list(self.policies)
        twin.types_of = [set(t) for t in self.types_of]
        twin.slices = dict(self.slices)
        twin.placements = list(self.placements)
        return twin

    def removals(self) -> int:
        """Free slices this pass removed so far."""
        return self.removed

    def has_free_slices(self) -> bool:
        return bool(self.slices)

    def sweep(self, order: Sequence[snapshot.Pod], *, defer: bool = True) -> list[snapshot.Pod]:
        """Place ``order``; the pods left pending. With ``defer``, first every pod that fits
        without removing a free slice, then the rest with removals allowed; without, each pod
        in turn with removals allowed."""
        left = [p for p in order if not self.place(p, remove=False)] if defer else list(order)
        return [p for p in left if not self.place(p, remove=True)]

    def _ask(self, pod: snapshot.Pod) -> tuple[_Ask, list[bool]]:
        """What the pod asks, and per node position whether the node admits it."""
        found = self.asks.get(pod.key)
        if found is None:
            node_policy, gpu_policy = pod.policies(self.snap)
            # Many pods ask alike: worked out once per request and policies.
            shape = (bool(pod.mig), pod.mps, pod.unified, node_policy, gpu_policy)
            ask = self.shapes.get(shape)
            if ask is None:
                ask = self.shapes[shape] = self._new_ask(pod, node_policy, gpu_policy)
            found = self.asks[pod.key] = (ask, self.admission.admits(pod))
        return found

    def _new_ask(
        self, pod: snapshot.Pod, node_policy: scoring.Policy, gpu_policy: scoring.Policy
    ) -> _Ask:
        needs: dict[str, tuple[modes.SliceNeed, ...] | None] = {}
        # Per MPS model that serves the pod: (GB of its largest slice, of all its slices).
        sizes: dict[str, tuple[int, int]] = {}
        reuse: set[tuple[str, int, int | None]] = set()
        ts_models: set[str] = set()
        count = 0
        if pod.served_in(modes.Mode.MPS):
            for m, model in self.mps_models.items():
                got = needs[m] = modes.mps_needs(pod.mps, pod.unified, model)
                if got:
                    count = len(got)
                    # Slices come largest first: the first needs the most GB on one GPU.
                    sizes[m] = (got[0].memory_gb, sum(n.memory_gb for n in got))
                    reuse.update((m, n.memory_gb, n.cores) for n in got)
        if pod.unified is not None and pod.served_in(modes.Mode.TIME_SLICING):
            ts_models = {
                m
                for m, model in self.ts_models.items()
                if modes.replica_needs(pod.unified, model) is not None
            }
        mps_kinds: list[tuple[int, int, int]] = []
        ts_kinds: list[int] = []
        for k, (mode, model_ids) in enumerate(self.kinds):
            if mode is modes.Mode.MPS:
                fit = [sizes[m] for m in model_ids if m in sizes]
                if fit:
                    mps_kinds.append((k, min(f[0] for f in fit), min(f[1] for f in fit)))
            elif any(m in ts_models for m in model_ids):
                ts_kinds.append(k)
        ts_gpus = max((a.count for a in pod.unified.asks), default=0) if pod.unified else 0
        return _Ask(
            node_policy,
            gpu_policy,
            needs,
            count,
            tuple(mps_kinds),
            frozenset(reuse),
            tuple(ts_kinds),
            ts_gpus,
            frozenset(ts_models),
        )

    def place(self, pod: snapshot.Pod, *, remove: bool) -> bool:
        """Place ``pod`` on the best sharing node; whether it was placed."""
        ask, admits = self._ask(pod)
        cpu, mem, room, spare = self.cpu, self.mem, self.room, self.spare
        want_cpu, want_mem = pod.cpu_milli, pod.memory_bytes
        policy = ask.node_policy if not self.flip else OTHER_POLICY[ask.node_policy]
        if policy not in self.policies:
            self._listing(policy)
        best: _Key | None = None
        steps: list[_Step] | tuple[int, ...] = ()
        # Time-slicing: any node that fits creates and removes nothing; the first in score
        # order is the best of its kind.
        for kind in ask.ts_kinds:
            for score, ni in self.order[(policy, kind)]:
                if best is not None and (score, ni) > best[2:]:
                    break
                if (
                    admits[ni]
                    and room[ni] >= ask.ts_gpus
                    and cpu[ni] >= want_cpu
                    and mem[ni] >= want_mem
                ):
                    chosen = self._try_ts(ni, pod, ask.gpu_policy, ask.ts_models)
                    if chosen is not None:
                        best, steps = (0, 0, score, ni), chosen
                        break
        if ask.mps_kinds:
            tried: set[int] = set()
            # Nodes holding a free slice the pod could reuse. A pod of one slice reuses it
            # there (creates and removes nothing): only the best such node is worked out. A pod
            # of several slices creates at least those it has no free slice for: its nodes are
            # tried best bound first, until no bound beats the best found.
            several: list[tuple[int, float, int]] = []
            if ask.count == 1:
                # The first node in score order per type that admits the pod. (If none does,
                # none of them passes the checks below either: no need to mark them tried.)
                for t in ask.reuse:
                    for score, ni in self.reuse_order.get((policy, t), ()):
                        if best is not None and (0, 0, score, ni) >= best:
                            break
                        if admits[ni] and cpu[ni] >= want_cpu and mem[ni] >= want_mem:
                            best, steps = (0, 0, score, ni), []
                            break
            else:
                for t in ask.reuse:
                    for ni in self.reuse.get(t, ()):
                        if ni in tried:
                            continue
                        tried.add(ni)
                        if not (admits[ni] and cpu[ni] >= want_cpu and mem[ni] >= want_mem):
                            continue
                        held = sum(self.reuse[u].get(ni, 0) for u in ask.reuse if u in self.reuse)
                        several.append((max(0, ask.count - held), self._score(policy, ni), ni))
            if best is not None and ask.count == 1 and best[:2] == (0, 0) and self.is_mps[best[3]]:
                got = self._try_mps(best[3], ask, remove=False)
                assert got is not None and got[:2] == (0, 0)
                steps = got[2]
            for bound, score, ni in sorted(several):
                if best is not None and (0, bound, score, ni) > best:
                    break
                got = self._try_mps(ni, ask, remove=False)
                if got is not None:
                    key = (got[0], got[1], score, ni)
                    if best is None or key < best:
                        best, steps = key, got[2]
            # Any other node creates every slice: the first in score order that fits without
            # removals is the best of its kind, and only worth looking for if it could win.
            if best is None or best[:2] > (0, ask.count):
                for kind, most, total in ask.mps_kinds:
                    for score, ni in self.order[(policy, kind)]:
                        if (
                            best is not None
                            and best[:2] == (0, ask.count)
                            and (score, ni) > best[2:]
                        ):
                            break
                        if (
                            room[ni] >= most
                            and spare[ni] >= total
                            and admits[ni]
                            and cpu[ni] >= want_cpu
                            and mem[ni] >= want_mem
                            and ni not in tried
                        ):
                            got = self._try_mps(ni, ask, remove=False)
                            if got is not None:
                                key = (got[0], got[1], score, ni)
                                if best is None or key < best:
                                    best, steps = key, got[2]
                                break
            # Removals: only where nothing fits without them, and only free slices are removed.
            if best is None and remove:
                mps_kinds = {k: most for k, most, _ in ask.mps_kinds}
                reclaim = self.reclaim
                for ni in self.slices:
                    if (
                        reclaim[ni] >= mps_kinds.get(self.kind_of[ni], 2**62)
                        and admits[ni]
                        and cpu[ni] >= want_cpu
                        and mem[ni] >= want_mem
                    ):
                        got = self._try_mps(ni, ask, remove=True)
                        if got is None:
                            continue
                        key = (got[0], got[1], self._score(policy, ni), ni)
                        if best is None or key < best:
                            best, steps = key, got[2]
        if best is None:
            return False
        ni = best[3]
        node = self.nodes[ni]
        if self.is_mps[ni]:
            shares = self._apply_mps(ni, pod.key, steps)  # type: ignore[arg-type]
        else:
            shares = self._apply_ts(ni, steps)  # type: ignore[arg-type]
        self.cpu[ni] -= pod.cpu_milli
        self.mem[ni] -= pod.memory_bytes
        self.placements.append(plans.Placement(pod.key, node.name, (), shares))
        return True

    def _own_node(self, ni: int) -> None:
        """Make the node's state this pass's own before changing it (copy-on-write)."""
        if ni not in self._own:
            if self.is_mps[ni]:
                self.mps[ni] = [s.copy() for s in self.mps[ni]]
            else:
                self.ts[ni] = list(self.ts[ni])
            self._own.add(ni)

    def _moved(self, ni: int, used: int) -> None:
        """The node's use changed to ``used``: its score entries and room."""
        old, was_listed = self.use[ni], self.room[ni] > 0
        self.used[ni] = used
        new = self.use[ni] = used / self.total[ni]
        self._room(ni)
        listed = self.room[ni] > 0
        if new == old and listed == was_listed:
            return
        kind = self.kind_of[ni]
        for policy in self.policies:
            sign = -1 if policy is scoring.Policy.BINPACK else 1
            lst = self.order[(policy, kind)]
            if was_listed:
                del lst[bisect.bisect_left(lst, (sign * old, ni))]
            if listed:
                bisect.insort(lst, (sign * new, ni))
            if new != old:
                for t in self.types_of[ni]:
                    lst = self.reuse_order[(policy, t)]
                    del lst[bisect.bisect_left(lst, (sign * old, ni))]
                    bisect.insort(lst, (sign * new, ni))

    def _apply_mps(self, ni: int, pod: str, steps: list[_Step]) -> tuple[plans.AssignedShare, ...]:
        self._own_node(ni)
        states = self.mps[ni]
        name = self.nodes[ni].name
        shares = []
        for k, need, opt in steps:
            st = states[k]
            gone = (opt.reuse,) if opt.reuse is not None else opt.removed
            for s in gone:
                t = (st.gpu.model.id, s.memory_gb, s.cores)
                at = self.reuse[t]
                at[ni] -= 1
                if not at[ni]:
                    del at[ni]
                    self.types_of[ni].discard(t)
                    for policy in self.policies:
                        lst = self.reuse_order[(policy, t)]
                        del lst[bisect.bisect_left(lst, (self._score(policy, ni), ni))]
                self.slices[ni] -= 1
                if not self.slices[ni]:
                    del self.slices[ni]
            self.removed += len(opt.removed)
            sid = _apply(name, st, need=need, pod=pod, reuse=opt.reuse, removed=opt.removed)
            shares.append(plans.AssignedShare(st.gpu.index, sid, need.memory_gb))
        self._moved(ni, sum(s.used for s in states))
        return tuple(shares)

    def _apply_ts(self, ni: int, chosen: tuple[int, ...]) -> tuple[plans.AssignedShare, ...]:
        self._own_node(ni)
        used = self.ts[ni]
        for k in chosen:
            used[k] += 1
        self._moved(ni, self.used[ni] + len(chosen))
        gpus = self.nodes[ni].gpus
        return tuple(plans.AssignedShare(gpus[k].index, None) for k in chosen)

    def _try_mps(self, ni: int, ask: _Ask, *, remove: bool) -> tuple[int, int, list[_Step]] | None:
        """The pod's slices on the node's GPUs, one at a time, largest first (removed, created,
        and where each goes); ``None``: no room. Changes nothing: a pod of several slices is
        worked out on copies of the GPUs it uses."""
        states = self.mps[ni]
        if ask.count == 0:
            return None
        binpack = ask.gpu_policy is scoring.Policy.BINPACK
        removed = created = 0
        steps: list[_Step] = []
        groups: dict[int, set[int]] = {}
        work = states if ask.count == 1 else list(states)
        for i in range(ask.count):
            best: tuple[tuple[int, int, float, int], modes.SliceNeed, _Option] | None = None
            for k, st in enumerate(work):
                needs = ask.needs[st.gpu.model.id]
                if needs is None:
                    continue
                need = needs[i]
                if need.group >= 0 and k in groups.get(need.group, ()):
                    continue
                opt = _option(st, need, remove=remove)
                if opt is None:
                    continue
                free_after = (st.cap - st.used - need.memory_gb) / st.cap
                key = (
                    len(opt.removed),
                    0 if opt.reuse else 1,
                    free_after if binpack else -free_after,
                    k,
                )
                if best is None or key < best[0]:
                    best = (key, need, opt)
            if best is None:
                return None
            key, need, opt = best
            k = key[3]
            removed += len(opt.removed)
            created += opt.reuse is None
            steps.append((k, need, opt))
            if i + 1 < ask.count:
                if work[k] is states[k]:
                    work[k] = work[k].copy()
                _apply("", work[k], need=need, pod="", reuse=opt.reuse, removed=opt.removed)
            if need.group >= 0:
                groups.setdefault(need.group, set()).add(k)
        return removed, created, steps

    def _try_ts(
        self, ni: int, pod: snapshot.Pod, gpu_policy: scoring.Policy, serving: frozenset[str]
    ) -> tuple[int, ...] | None:
        """One replica per GPU asked, each container's on distinct GPUs (their positions on the
        node); ``None``: no room. ``serving``: the GPU models that serve the pod."""
        if pod.unified is None:
            return None
        gpus = self.nodes[ni].gpus
        taken = list(self.ts[ni])
        for k, g in enumerate(gpus):
            if g.model.id not in serving:
                taken[k] = g.replicas  # this GPU cannot serve it: as if full
        chosen: list[int] = []
        sign = 1 if gpu_policy is scoring.Policy.BINPACK else -1
        for ask in pod.unified.asks:
            free = [k for k in range(len(gpus)) if taken[k] < gpus[k].replicas]
            if len(free) < ask.count:
                return None
            free.sort(key=lambda k: (sign * (gpus[k].replicas - taken[k]), k))
            for k in free[: ask.count]:
                taken[k] += 1
                chosen.append(k)
        return tuple(chosen)

    def result(self) -> Shared:
        return _result(
            self.nodes,
            {n.name: sts for n, sts in zip(self.nodes, self.mps, strict=True)},
            self.placements,
        )


def _mps_states(node: snapshot.Node) -> list[_MpsGpu]:
    """The slices of an MPS node's GPUs as a placement pass starts from them."""
    return [_mps_gpu(g) for g in node.gpus]


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


OTHER_POLICY = {
    scoring.Policy.BINPACK: scoring.Policy.SPREAD,
    scoring.Policy.SPREAD: scoring.Policy.BINPACK,
}
"""A node policy's opposite (the search's variant that places a level by it)."""
SEARCH_WORK = 100_000
"""What :func:`place`'s search (beyond the three ways per level: more orders where a level
leaves pods pending, the lookahead over the levels below between orders that place as many) may
cost a plan, in placements tried times the GPUs of the MPS and time-slicing nodes (a
placement's cost grows with the nodes and GPUs it looks at). Each order costs one placement per
pod of its level: a simulator's cluster (24 GPUs, a few hundred pods pending) or a snapshot of
tens of GPUs is searched; 504 GPUs and more (bench_sharing's speed rows, 750 pods a level and
up) keep the three ways only, and their speed."""


class Pass(Protocol):
    """A placement pass as :func:`levels` drives it: :class:`_Run`, or the scan over every node
    that tests/unit/test_sharing_index.py keeps as its reference."""

    flip: bool
    """Whether pods go by the other node policy than theirs (binpack for spread, and back)."""

    def fork(self) -> Self:
        """An independent copy (to try another pod order from here)."""

    def sweep(self, order: Sequence[snapshot.Pod], *, defer: bool = True) -> list[snapshot.Pod]:
        """Place ``order``; the pods left pending (see :meth:`_Run.sweep`)."""

    def removals(self) -> int:
        """Free slices this pass removed so far."""

    def has_free_slices(self) -> bool:
        """Whether an MPS GPU holds a free slice."""


def place(snap: snapshot.Snapshot, pods: list[snapshot.Pod]) -> Shared:
    """Place ``pods`` on the snapshot's MPS and time-slicing nodes (see the module docstring)."""
    run = _Run(snap)
    if not run.nodes:
        return run.result()
    return levels(run, snap, pods).result()


P = TypeVar("P", bound=Pass)


def levels(run: P, snap: snapshot.Snapshot, pods: Sequence[snapshot.Pod]) -> P:
    """``pods`` placed level by level from ``run``, highest priority first: the three ways per
    level, and the search (see below); the pass kept."""
    index = {p.key: i for i, p in enumerate(snap.pods)}

    def largest_first(group: Sequence[snapshot.Pod]) -> list[snapshot.Pod]:
        return sorted(group, key=lambda p: (-demand_gb(p), index.get(p.key, 0)))

    groups = [
        [p for p in pods if p.priority == level]
        for level in sorted({p.priority for p in pods}, reverse=True)
    ]
    shared = [n for n in snap.nodes if n.mode in (modes.Mode.MPS, modes.Mode.TIME_SLICING)]
    admission: constraints.Admission | None = None  # for the search only
    gpus = sum(len(n.gpus) for n in shared)
    budget = SEARCH_WORK // max(gpus, 1)  # placements
    for i, at_level in enumerate(groups):
        # Largest demand first packs MPS memory and keeps large pods from starving behind
        # small ones. Where the count binds (time-slicing replicas), a pod asking several GPUs
        # spends replicas that as many one-GPU pods would use: the second order puts pods
        # asking fewer GPUs first, largest demand first among them. Deferring removals to a
        # second sweep saves removals, and costs a pod where the one GPU a large slice needs
        # (after a removal) is the one the first sweep fills: largest first with removals
        # allowed at once is tried too. Every way is tried at every size: the indexes make a
        # pass cheap (2,000 GPUs and 6,000 pods: 3,986 pods placed instead of 3,593 with one
        # way).
        largest = largest_first(at_level)
        fewest = sorted(at_level, key=lambda p: (p.count, -demand_gb(p), index.get(p.key, 0)))
        variants = [(largest, True)]
        if fewest != largest:
            variants.append((fewest, True))
        if run.has_free_slices():
            variants.append((largest, False))  # removals matter only where free slices are
        tried = [_attempt(run, order, defer=defer) for order, defer in variants]
        # Where a level leaves pods pending, the search (within the budget) tries the
        # orders that place more where a resource other than GPU memory binds, or many small
        # asks beat a few large ones: smallest demand first (nos's order: memory binds), fewest
        # GPUs then smallest (replicas), least node memory and CPU first (the node binds), most
        # GPUs first (a pod needing several distinct GPUs with a free replica, which one-GPU
        # pods scatter), pods that fewest nodes admit first (binpack fills the one node a
        # selector leaves a pod), and the queue's order. One is kept only if it places more
        # pods than every way above: largest first still wins every tie, so large pods are not
        # starved where nothing is gained by it.
        # The nodes a level's pods go to matter as much as their order: binpack fills the
        # node whose CPU or memory the level below (or a pod of this level with one node to
        # go to) needs. Largest first by the other node policy is tried where a level leaves
        # pods pending, or has levels below that the lookahead compares.
        if budget >= len(at_level) and (min(len(t.left) for t in tried) > 0 or len(groups) > i + 1):
            budget -= len(at_level)
            tried.append(_attempt(run, largest, defer=True, flip=True))
        if min(len(t.left) for t in tried) > 0 and budget >= len(at_level):
            seen = [order for order, _ in variants]
            if admission is None:
                admission = constraints.Admission(shared)
            reach = {
                p.key: sum(
                    ok and p.served_in(n.mode)
                    for ok, n in zip(admission.admits(p), shared, strict=True)
                )
                for p in at_level
            }
            for key in _SEARCH_ORDERS:
                if budget < len(at_level):
                    break
                ranked = sorted(
                    (key(p, index.get(p.key, 0), reach[p.key]), k) for k, p in enumerate(at_level)
                )
                order = [at_level[k] for _, k in ranked]
                if order in seen:
                    continue
                budget -= len(order)
                seen.append(order)
                tried.append(_attempt(run, order, defer=True))
        # Orders that leave as many pending at this level may leave the levels below different
        # room (a large slice, or a pod of several GPUs, where three small pods would have left
        # it): between them, the one after which the levels below place the most (each level in
        # turn, placed largest first) wins; then the fewest removals; then the order tried
        # first.
        most = min(len(t.left) for t in tried)
        tied = [t for t in tried if len(t.left) == most]
        below = groups[i + 1 :]
        cost = sum(len(g) for g in below) * len(tied)
        ahead: list[tuple[int, ...]] = [()] * len(tried)
        if len(tied) > 1 and below and cost <= budget:
            budget -= cost
            for k, t in enumerate(tried):
                if len(t.left) == most:
                    probe = t.run.fork()
                    ahead[k] = tuple(-len(probe.sweep(largest_first(g))) for g in below)
        best = max(
            range(len(tried)),
            key=lambda k: (-len(tried[k].left), ahead[k], -tried[k].run.removals(), -k),
        )
        run = tried[best].run
    return run


_SEARCH_ORDERS: tuple[Callable[[snapshot.Pod, int, int], tuple[int, ...]], ...] = (
    lambda p, i, r: (demand_gb(p), i),
    lambda p, i, r: (p.count, demand_gb(p), i),
    lambda p, i, r: (p.count, p.memory_bytes, p.cpu_milli, demand_gb(p), i),
    lambda p, i, r: (-p.count, -demand_gb(p), i),
    lambda p, i, r: (r, -demand_gb(p), i),
    lambda p, i, r: (i,),
)
"""The sort keys of :func:`place`'s search (a pod, its position in the snapshot, how many
sharing nodes admit it in a mode that serves it), in the order tried."""


@dataclass(frozen=True, slots=True)
class _Attempt(Generic[P]):
    """One order of a level placed from the level's starting state."""

    run: P
    left: list[snapshot.Pod]


def _attempt(
    run: P, order: Sequence[snapshot.Pod], *, defer: bool, flip: bool = False
) -> _Attempt[P]:
    """``order`` placed on a fork of ``run`` (which stays as it was); with ``flip``, by the other
    node policy."""
    attempt = run.fork()
    attempt.flip = flip
    left = attempt.sweep(order, defer=defer)
    attempt.flip = False
    return _Attempt(attempt, left)


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
