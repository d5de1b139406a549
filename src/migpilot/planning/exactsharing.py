"""The exact planner on the nodes that share GPUs without MIG: MPS slices and time-slicing
replicas as one CP-SAT model.

Why it exists: the exact planner is the yardstick ``fast`` is measured against, so it must plan
every node mode ``fast`` plans. :func:`migpilot.planning.sharing.plan_with` gives the MIG nodes
to the exact MIG model (:mod:`migpilot.planning.exact`) and the pods left pending that an MPS or
time-slicing node can serve to :func:`place` here (``exact.plan`` composes the two).

The model (rules of ``docs/modes.md``):

- per pod and node that admits it (:class:`constraints.Admission`, a mode that serves the pod,
  its CPU and memory alone fit, a GPU that serves it): a Boolean; a pod goes on one node at most;
  the pods of a node fit its CPU and memory;
- on an MPS node, per *slot* of the pod (one slice it needs: :func:`modes.mps_needs`, the same
  ask on every GPU model) and GPU whose model serves the pod: a Boolean; a placed pod's slot is
  on exactly one GPU, the slots of one group (a container's GPUs) on distinct GPUs;
- per MPS GPU and type of free slice (GB and compute share): how many are kept (idle, or reused
  by a slice of exactly that type) and how many are reused; taken slices are fixed. Memory
  (taken + kept + new slices <= the GPU's GB), clients (<= 48) and compute shares (<= 100 %)
  count reused slices once. So a taken slice is never shrunk or removed, and a free slice is
  reused, kept or removed;
- on a time-slicing node, per container of the pod and GPU whose model serves it: a Boolean; a
  container's replicas on distinct GPUs, one per GPU asked; at most ``replicas - replicasUsed``
  per GPU;
- pods no constraint tells apart are placed in snapshot order (symmetry breaking).

Objective, in lexicographic phases as :mod:`migpilot.planning.exact` solves them: pods placed,
one phase per priority level from the highest, each fixing what it achieved; then the fewest
free slices removed, then the fewest slices created (reusing a free slice costs nothing) as
best effort in the time left. The node and GPU policies are not modelled. ``optimal`` says
whether every pod phase was proven.

The search starts from ``fast``'s plan (:func:`sharing.place`) and no phase gives up the best
solution known, so the result is never worse than ``fast``'s on the pods, whatever the time
limit. The solution is expressed by :func:`sharing.express` (the same reuse, creation, removal
and ids as ``fast``), never removing more free slices of a type than the model chose.

Pure: no clock (elapsed time is the solver's own), seeded. May import the planning core it
builds on, :mod:`migpilot.planning.sharing` and OR-Tools; never a planner.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from migpilot.mig import profiles
from migpilot.planning import constraints, cpsat, modes, options, sharing, snapshot
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

_PODS_SHARE = 0.8
"""Fraction of the time limit for the pod phases (the ones whose optimality is reported)."""


def _slots(pod: snapshot.Pod, model: profiles.GpuModel) -> tuple[modes.SliceNeed, ...] | None:
    """The slices ``pod`` needs on an MPS GPU of ``model`` in slot order: slot ``j`` is the same
    ask on every model (by group, then largest first; sizes by name do not depend on the model,
    and a unified container's slice is alone in its group)."""
    needs = modes.mps_needs(pod.mps, pod.unified, model)
    if needs is None:
        return None
    return tuple(sorted(needs, key=lambda n: (n.group, -n.memory_gb)))


@dataclass(slots=True)
class _OnNode:
    """One pod on one node: the Boolean, and per slot (MPS) or container (time-slicing) the
    Boolean per GPU (by position in the node's GPUs)."""

    pod: snapshot.Pod
    node: snapshot.Node
    var: cp_model.IntVar
    gpus: list[dict[int, cp_model.IntVar]]


@dataclass(slots=True)
class _FreeType:
    """The free slices of one type on one MPS GPU."""

    memory_gb: int
    cores: int | None
    count: int
    kept: cp_model.IntVar
    reused: cp_model.IntVar | None


class _Builder:
    """The CP-SAT model of the shared part of one snapshot, its solve and its reading back."""

    def __init__(self, snap: snapshot.Snapshot, pods: Sequence[snapshot.Pod]) -> None:
        self.snap = snap
        self.model = cp_model.CpModel()
        self.nodes = [n for n in snap.nodes if n.mode in (modes.Mode.MPS, modes.Mode.TIME_SLICING)]
        self.ons: list[_OnNode] = []
        self.by_pod: dict[str, list[_OnNode]] = defaultdict(list)
        self.free: dict[tuple[str, int], list[_FreeType]] = {}
        self.levels: dict[int, cpsat.Linear] = defaultdict(cpsat.Linear)
        self.removed = cpsat.Linear()
        self.created = cpsat.Linear()
        admission = constraints.Admission(self.nodes)
        for pod in pods:
            admits = admission.admits(pod)
            for ni, node in enumerate(self.nodes):
                if admits[ni] and pod.served_in(node.mode) and _fits_alone(pod, node):
                    self._add_pod(pod, node)
        for pod in pods:
            vars_ = [o.var for o in self.by_pod[pod.key]]
            if vars_:
                self.model.add(sum(vars_) <= 1)
                self.levels[pod.priority].terms.extend((1, v) for v in vars_)
        for node in self.nodes:
            self._add_capacity(node)
            if node.mode is modes.Mode.MPS:
                for k, gpu in enumerate(node.gpus):
                    self._add_mps_gpu(node, k, gpu)
            else:
                for k, gpu in enumerate(node.gpus):
                    self._add_ts_gpu(node, k, gpu)
        self._break_symmetry(pods)

    # ------------------------------------------------------------------------ building

    def _bool(self) -> cp_model.IntVar:
        return self.model.new_bool_var("")

    def _add_pod(self, pod: snapshot.Pod, node: snapshot.Node) -> None:
        if node.mode is modes.Mode.MPS:
            per_gpu = [_slots(pod, g.model) for g in node.gpus]
            count = next((len(s) for s in per_gpu if s is not None), None)
            if count is None:
                return
            on = _OnNode(pod, node, self._bool(), [])
            for j in range(count):
                on.gpus.append({k: self._bool() for k, s in enumerate(per_gpu) if s is not None})
                self.model.add(sum(on.gpus[j].values()) == on.var)
            groups: dict[int, list[int]] = defaultdict(list)
            for j, need in enumerate(next(s for s in per_gpu if s is not None)):
                if need.group >= 0:
                    groups[need.group].append(j)
            for slots in groups.values():
                if len(slots) > 1:
                    for k in on.gpus[slots[0]]:
                        self.model.add(sum(on.gpus[j][k] for j in slots) <= 1)
        else:
            if pod.unified is None:
                return
            usable = [
                k for k, g in enumerate(node.gpus) if modes.replica_needs(pod.unified, g.model)
            ]
            asks = [a.count for a in pod.unified.asks]
            if not usable or max(asks) > len(usable):
                return
            on = _OnNode(pod, node, self._bool(), [])
            for n in asks:
                on.gpus.append({k: self._bool() for k in usable})
                self.model.add(sum(on.gpus[-1].values()) == n * on.var)
        self.ons.append(on)
        self.by_pod[pod.key].append(on)

    def _add_capacity(self, node: snapshot.Node) -> None:
        alloc = node.allocatable
        ons = [o for o in self.ons if o.node is node]
        if alloc is None or not ons:
            return
        for amounts, limit in (
            ([o.pod.cpu_milli for o in ons], alloc.cpu_milli),
            ([o.pod.memory_bytes for o in ons], alloc.memory_bytes),
        ):
            if sum(amounts) <= limit:
                continue
            unit = math.gcd(*amounts) or 1  # bytes are large: keep CP-SAT's sums small
            self.model.add(
                sum(a // unit * o.var for a, o in zip(amounts, ons, strict=True)) <= limit // unit
            )

    def _add_mps_gpu(self, node: snapshot.Node, k: int, gpu: snapshot.Gpu) -> None:
        on_gpu = [
            (need, on.gpus[j][k])
            for on in self.ons
            if on.node is node
            for j, need in enumerate(_slots(on.pod, gpu.model) or ())
            if k in on.gpus[j]
        ]
        taken = [s for s in gpu.mps if s.taken]
        kinds = Counter((s.memory_gb, s.cores) for s in gpu.mps if not s.taken)
        wanted = {(n.memory_gb, n.cores) for n, _ in on_gpu}
        types: list[_FreeType] = []
        for (gb, cores), count in sorted(kinds.items(), key=lambda kv: (kv[0][0], kv[0][1] or 0)):
            kept = self.model.new_int_var(0, count, "")
            reused = None
            if (gb, cores) in wanted:
                reused = self.model.new_int_var(0, count, "")
                self.model.add(reused <= kept)
                self.model.add(
                    reused <= sum(v for n, v in on_gpu if (n.memory_gb, n.cores) == (gb, cores))
                )
            types.append(_FreeType(gb, cores, count, kept, reused))
            self.removed.terms.append((-1, kept))  # removed = count - kept (constant dropped)
        self.free[(node.name, gpu.index)] = types
        self.created.terms.extend((1, v) for _, v in on_gpu)
        self.created.terms.extend((-1, t.reused) for t in types if t.reused is not None)
        if not on_gpu:
            return  # nothing new can land here: keeping every free slice is always feasible

        def usage(per_need: list[int], per_type: list[int]) -> cp_model.LinearExpr:
            """Kept free slices not reused, plus the new needs, weighted."""
            terms: list[tuple[int, cp_model.IntVar]] = []
            for t, c in zip(types, per_type, strict=True):
                terms.append((c, t.kept))
                if t.reused is not None:
                    terms.append((-c, t.reused))
            terms.extend((c, v) for c, (_, v) in zip(per_need, on_gpu, strict=True))
            return cpsat.Linear(terms).expr()

        cap = sharing_mps.memory_gb(gpu.model) - sum(s.memory_gb for s in taken)
        gbs = [n.memory_gb for n, _ in on_gpu]
        self.model.add(usage(gbs, [t.memory_gb for t in types]) <= cap)
        clients = sharing_config.MPS_MAX_CLIENTS - len(taken)
        self.model.add(usage([1] * len(on_gpu), [1] * len(types)) <= clients)
        if any(n.cores for n, _ in on_gpu):
            cores = 100 - sum(s.cores or 0 for s in taken)
            shares = [n.cores or 0 for n, _ in on_gpu]
            self.model.add(usage(shares, [t.cores or 0 for t in types]) <= cores)

    def _add_ts_gpu(self, node: snapshot.Node, k: int, gpu: snapshot.Gpu) -> None:
        on_gpu = [g[k] for on in self.ons if on.node is node for g in on.gpus if k in g]
        left = gpu.replicas - gpu.replicas_used
        if len(on_gpu) > left:
            self.model.add(sum(on_gpu) <= left)

    def _break_symmetry(self, pods: Sequence[snapshot.Pod]) -> None:
        """Pods nothing tells apart are placed in snapshot order (any plan has one like it)."""
        twins: dict[tuple[object, ...], list[snapshot.Pod]] = defaultdict(list)
        for pod in pods:
            key = (
                pod.priority,
                constraints.signature(pod),
                pod.mps,
                pod.unified,
                pod.cpu_milli,
                pod.memory_bytes,
            )
            twins[key].append(pod)
        for group in twins.values():
            for a, b in itertools.pairwise(group):
                va = [o.var for o in self.by_pod[a.key]]
                vb = [o.var for o in self.by_pod[b.key]]
                if vb:
                    self.model.add(sum(va) >= sum(vb))

    # ------------------------------------------------------------------------ warm start

    def hint(self, shared: sharing.Shared) -> list[int] | None:
        """``shared`` (``fast``'s choices for the same pods) as a value per variable, or
        ``None`` if some choice has no counterpart in the model (then nothing is hinted)."""
        solution = [0] * len(self.model.proto.variables)
        for types in self.free.values():
            for t in types:
                solution[t.kept.index] = t.count
        final = {(g.node, g.gpu): {s.id for s in g.slices} for g in shared.mps}
        given: dict[tuple[str, int], set[int]] = defaultdict(set)
        for pl in shared.placements:
            on = next((o for o in self.by_pod.get(pl.pod, ()) if o.node.name == pl.node), None)
            if on is None:
                return None
            solution[on.var.index] = 1
            position = {g.index: k for k, g in enumerate(on.node.gpus)}
            if on.node.mode is modes.Mode.MPS:
                used: set[int] = set()
                for i, share in enumerate(pl.shares):
                    k = position[share.gpu]
                    model = on.node.gpus[k].model
                    need = (modes.mps_needs(on.pod.mps, on.pod.unified, model) or ())[i]
                    slots = _slots(on.pod, model) or ()
                    j = next((j for j, n in enumerate(slots) if n == need and j not in used), None)
                    if j is None or k not in on.gpus[j]:
                        return None
                    used.add(j)
                    solution[on.gpus[j][k].index] = 1
                    if share.slice is not None:
                        given[(pl.node, share.gpu)].add(share.slice)
            else:
                asks = [j for j, a in enumerate(on.pod.unified.asks if on.pod.unified else ())
                        for _ in range(a.count)]  # fmt: skip
                for j, share in zip(asks, pl.shares, strict=True):
                    k = position[share.gpu]
                    if k not in on.gpus[j]:
                        return None
                    solution[on.gpus[j][k].index] = 1
        for node in self.nodes:
            if node.mode is not modes.Mode.MPS:
                continue
            for gpu in node.gpus:
                key = (node.name, gpu.index)
                kept = final.get(key, {s.id for s in gpu.mps})
                for t in self.free[key]:
                    same = [
                        s.id
                        for s in gpu.mps
                        if not s.taken and (s.memory_gb, s.cores) == (t.memory_gb, t.cores)
                    ]
                    solution[t.kept.index] = sum(1 for i in same if i in kept)
                    reused = sum(1 for i in same if i in given[key])
                    if t.reused is not None:
                        solution[t.reused.index] = reused
                    elif reused:
                        return None
        return solution

    # ------------------------------------------------------------------------ solving

    def solve(self, opts: options.Options, hint: list[int] | None) -> tuple[list[int], bool]:
        """Run the phases; the final solution and whether every pod phase was proven."""
        budget = cpsat.Budget(opts.time_limit_s)
        solution = hint if hint is not None else self._nothing()
        optimal = True
        levels = sorted(self.levels, reverse=True)
        for k, level in enumerate(levels):
            placed = self.levels[level]
            seconds = budget.share(until=_PODS_SHARE, parts=len(levels) - k)
            status, solution = self._run(opts, seconds, budget, solution, placed)
            optimal = optimal and status == cp_model.OPTIMAL
            self.model.add(placed.expr() >= placed.value(solution))
        weight = len(self.created.terms) + 1
        disruption = cpsat.Linear(
            [(-weight * c, v) for c, v in self.removed.terms]
            + [(-c, v) for c, v in self.created.terms]
        )  # maximised: removals weigh more than every creation together
        if disruption.terms:
            _, solution = self._run(opts, budget.share(until=1.0), budget, solution, disruption)
        return solution, optimal

    def _nothing(self) -> list[int]:
        """Place nothing, keep every free slice: always feasible."""
        solution = [0] * len(self.model.proto.variables)
        for types in self.free.values():
            for t in types:
                solution[t.kept.index] = t.count
        return solution

    def _run(
        self,
        opts: options.Options,
        seconds: float,
        budget: cpsat.Budget,
        hint: list[int],
        maximise: cpsat.Linear,
    ) -> tuple[cp_model.CpSolverStatus, list[int]]:
        """One phase (:func:`cpsat.maximise`)."""
        return cpsat.maximise(
            self.model,
            maximise,
            hint=hint,
            seconds=seconds,
            workers=opts.workers,
            budget=budget,
            who="exact planner (sharing nodes)",
        )

    # ------------------------------------------------------------------------ reading back

    def extract(self, solution: Sequence[int], *, optimal: bool) -> sharing.Shared:
        """The solution as :func:`sharing.express` writes plans."""
        given: list[sharing.Given] = []
        index = {p.key: i for i, p in enumerate(self.snap.pods)}
        chosen = sorted(
            (o for o in self.ons if solution[o.var.index]),
            key=lambda o: (-o.pod.priority, -sharing.demand_gb(o.pod), index.get(o.pod.key, 0)),
        )
        for on in chosen:
            gpus = on.node.gpus
            shares: list[tuple[int, modes.SliceNeed | None]] = []
            for j, per_gpu in enumerate(on.gpus):
                for k, var in per_gpu.items():
                    if not solution[var.index]:
                        continue
                    if on.node.mode is modes.Mode.MPS:
                        shares.append((gpus[k].index, (_slots(on.pod, gpus[k].model) or ())[j]))
                    else:
                        shares.append((gpus[k].index, None))
            if on.node.mode is modes.Mode.MPS:
                # fast's order: largest slice first
                shares.sort(key=lambda s: (-s[1].memory_gb, s[1].group) if s[1] else (0, 0))
            given.append(sharing.Given(on.pod.key, on.node.name, tuple(shares)))
        removable = {
            key: Counter({(t.memory_gb, t.cores): t.count - solution[t.kept.index] for t in types})
            for key, types in self.free.items()
        }
        return sharing.express(self.snap, given, removable=removable, optimal=optimal)


def _fits_alone(pod: snapshot.Pod, node: snapshot.Node) -> bool:
    alloc = node.allocatable
    return alloc is None or (
        pod.cpu_milli <= alloc.cpu_milli and pod.memory_bytes <= alloc.memory_bytes
    )


def place(
    snap: snapshot.Snapshot, pods: list[snapshot.Pod], *, opts: options.Options
) -> sharing.Shared:
    """Place ``pods`` on the snapshot's MPS and time-slicing nodes with CP-SAT within
    ``opts.time_limit_s`` on ``opts.workers`` threads (bind ``opts`` with
    :func:`functools.partial` to get a :data:`sharing.SharedPlanner`)."""
    greedy = sharing.place(snap, pods)
    builder = _Builder(snap, pods)
    if not builder.ons:
        return dataclasses.replace(greedy, optimal=True)
    solution, optimal = builder.solve(opts, builder.hint(greedy))
    return builder.extract(solution, optimal=optimal)
