"""The sharing planner as it was before its index (main at 08131eb), kept as a reference.

Why it exists: :mod:`migpilot.planning.sharing` now finds each pod's node through indexes of
GPU states instead of scanning every node and GPU. Its plans must be exactly this scan's (with
every way of placing a level tried at every size: ``every_size``; ``False`` is the old
behaviour beyond ``_SMALL_PROBLEM``). Only the tests and the speed bench use it; it is the old
code with its names qualified, not maintained beyond that.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from migpilot.planning import constraints, modes, plans, scoring, sharing, snapshot
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

_SMALL_PROBLEM = 200_000
_SliceType = tuple[int, int | None]
demand_gb = sharing.demand_gb
Shared = sharing.Shared


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
        self.flip = False

    def fork(self) -> _Run:
        """An independent copy of this pass (to try another pod order from here)."""
        twin = copy.copy(self)
        twin.mps = {k: [s.copy() for s in v] for k, v in self.mps.items()}
        twin.ts = {k: [_TsGpu(t.gpu, t.used) for t in v] for k, v in self.ts.items()}
        twin.cpu, twin.mem = dict(self.cpu), dict(self.mem)
        twin.placements = list(self.placements)
        return twin

    def has_free_slices(self) -> bool:
        return any(st.free for sts in self.mps.values() for st in sts)

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
        if self.flip:
            node_policy = sharing.OTHER_POLICY[node_policy]
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


def place(
    snap: snapshot.Snapshot, pods: list[snapshot.Pod], *, every_size: bool = True
) -> sharing.Shared:
    """Place ``pods`` on the snapshot's MPS and time-slicing nodes (see the module docstring)."""
    run = _Run(snap)
    if not run.nodes:
        return run.result()
    index = {p.key: i for i, p in enumerate(snap.pods)}
    gpus = sum(len(n.gpus) for n in run.nodes)
    small = every_size or gpus * max(len(pods), 1) <= _SMALL_PROBLEM
    if small:  # the level search of fast, over the scan
        return sharing.levels(run, snap, pods).result()
    for level in sorted({p.priority for p in pods}, reverse=True):
        # Each way costs a pass: on large problems only the first ran, largest demand first.
        at_level = [p for p in pods if p.priority == level]
        largest = sorted(at_level, key=lambda p: (-demand_gb(p), index.get(p.key, 0)))
        run.sweep(largest)
    return run.result()
