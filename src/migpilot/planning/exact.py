"""The exact planner: the planning objective solved by a real solver, as the yardstick for ``fast``.

Why it exists: the benchmark needs to know how far ``fast`` is from the best possible plan, and
only a solver that can *prove* optimality says that. This module states the whole problem as one
CP-SAT model (OR-Tools) and solves the objective of :mod:`migpilot.planning.objective` in
lexicographic phases, each fixing what the phases before it achieved:

1. pods placed, one phase per priority level from the highest down (``objective.pod_weights``
   would overflow int64 with many levels, and per-level counts are the same order);
2. ``destroyed * (GPUs + 1) + touched``: the fewest free instances destroyed, then the fewest
   GPUs touched;
3. the most free value left (``layouts.free_value`` summed over GPUs, counting instances in use
   and instances given to pods as occupied, as :func:`objective.score` does).

Pod anti-affinity, topology spread and pod affinity to bound anchors are constraints over the
pod counts (:mod:`migpilot.planning.exactpods`). The node policy (objective 4) is not
modelled. :attr:`Plan.optimal` says whether every phase of (1) was proven optimal; phases (2)
and (3) are best effort in the time left.

The model is a *configuration* model. For each GPU every way it may end up is enumerated up
front (:func:`_options`): which instances it keeps idle, which it gives to pods (reused or
created), and what that costs in destroyed instances, touched GPUs and free value; ways that
serve the same profile counts at the same cost collapse into the one with the most free value.
The solver then picks one option per GPU (identical GPUs of a node share an integer count) and,
per node and *pod class* (pods nothing in the model tells apart), how many pods to place, such
that per node and profile the instances served equal the instances requested, and CPU and memory
fit. Instances in use are part of every option and never serve; an option never creates an
instance that serves nobody. The geometry is thus exact, the linear relaxation is the strong
configuration LP, and the symmetry between identical GPUs and identical pods is gone; a
per-instance model (a Boolean per placement and per pod) could not prove optimality on 64 GPUs.

The search starts from a greedy solution (pods by priority, smallest first, each on the GPUs
where it adds the least disruption), and no phase gives up the best solution known, so a time
limit too short for the solver still yields a sound and reasonable plan.

Determinism: the random seed is fixed and everything is built in snapshot order, so with one
worker the same snapshot gives the same plan as long as no phase runs into its time limit (when
one does, how far it got depends on the machine's speed and load). With more workers CP-SAT's
parallel portfolio is not deterministic: proven optimal *values* are the same, the plan may
differ. (CP-SAT's deterministic ``interleave_search`` proved almost nothing within the limits on
64 GPUs, so it is not used.)

Pure core: it may import :mod:`migpilot.mig`, the planning modules it builds on and OR-Tools, and
nothing that talks to the world (no clock: elapsed time is the solver's own wall time).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ortools.sat.python import cp_model

from migpilot import errors
from migpilot.mig import layouts, profiles
from migpilot.planning import (
    constraints,
    cpsat,
    exactpods,
    exactsharing,
    explaining,
    modes,
    options,
    plans,
    podaffinity,
    sharing,
    snapshot,
)

PLANNER = "exact"
_PODS_SHARE = 0.7
"""Fraction of the time limit for objective (1), the one whose optimality is reported."""
_DISRUPTION_SHARE = 0.2
"""Fraction for objective (2); objective (3) gets what is left."""


# --------------------------------------------------------------------------- GPU options


@dataclass(frozen=True, slots=True)
class _Option:
    """One way a GPU may end up: what it gives to pods and what that costs."""

    serves: tuple[int, ...]
    """Instances given to pods, per wanted profile (in the order of ``_Kind.wanted``)."""
    destroyed: int
    """Free instances that exist now and are not in the target layout."""
    touched: bool
    """The target layout differs from the current one."""
    free_value: int
    """``layouts.free_value`` with instances in use and instances given to pods occupied."""
    layout: layouts.Layout
    """The target layout."""
    serving: tuple[layouts.Instance, ...]
    """The instances given to pods (start order)."""


@dataclass(frozen=True, slots=True)
class _Kind:
    """What the model needs to know about a GPU; GPUs of one kind on a node are interchangeable."""

    model: profiles.GpuModel
    used: tuple[layouts.Instance, ...]
    free: tuple[layouts.Instance, ...]
    wanted: tuple[str, ...]
    """Profiles some pod admitted on the node may use on this GPU (sorted canonical names)."""


@functools.lru_cache(maxsize=1024)
def _options(kind: _Kind) -> tuple[_Option, ...]:
    """Every way ``kind`` may end up that no other way beats on every objective.

    A depth-first search over the sets of instances the GPU may give to pods (placements of
    wanted profiles beside the instances in use, in the geometry's order). For each set, the
    free instances that can stay beside it are kept idle, as many as fit (keeping costs
    nothing, so keeping fewer is never better). Sets serving the same profile counts at the
    same cost keep the most free value, ties going to the first found: deterministic.

    This runs once per kind of GPU and dominates the model's build time, so the search works
    on plain integers (placements by index into the geometry's table).
    """
    g = layouts.geometry(kind.model)
    table = g.placements
    masks = [pl.mask for pl in table]
    computes = [pl.compute for pl in table]
    medias = [pl.media for pl in table]
    profs = [pl.profile for pl in table]
    areas = [g.area[pl.profile] for pl in table]
    caps = g.max_instances
    max_compute = kind.model.compute_slices
    max_count = kind.model.max_gpu_instances
    where = {(pl.profile, pl.start): i for i, pl in enumerate(table)}
    column = {g.index[name]: k for k, name in enumerate(kind.wanted)}

    def index(inst: layouts.Instance) -> int:
        return where[(g.index[inst.profile], inst.start)]

    used = [index(i) for i in kind.used]
    free = [index(i) for i in kind.free]
    free_set = set(free)
    # Occupancy: [mask, compute, media, count] and per-profile counts, mutated by the search.
    occ = [0, 0, 0, 0]
    per = [0] * len(g.profiles)

    def fits(i: int) -> bool:
        return not (
            masks[i] & occ[0]
            or occ[1] + computes[i] > max_compute
            or (medias[i] and occ[2])
            or occ[3] >= max_count
            or per[profs[i]] >= caps[profs[i]]
        )

    def add(i: int, sign: int) -> None:
        occ[0] ^= masks[i]  # callers only add what fits and remove what they added
        occ[1] += sign * computes[i]
        occ[2] += sign * medias[i]
        occ[3] += sign
        per[profs[i]] += sign

    def most_kept(serving: list[int]) -> list[int]:
        # Free instances never overlap each other (they are one valid layout), so usually all
        # that do not overlap the served slots fit; only the counters can force a choice.
        rest = [i for i in free if i not in serving and not masks[i] & occ[0]]
        for size in range(len(rest), 0, -1):
            for subset in itertools.combinations(rest, size):
                added: list[int] = []
                for i in subset:
                    if not fits(i):
                        break
                    add(i, 1)
                    added.append(i)
                for i in added:
                    add(i, -1)
                if len(added) == size:
                    return list(subset)
        return []

    for i in used:
        add(i, 1)
    cands = [i for i, pl in enumerate(table) if pl.profile in column and fits(i)]
    best: dict[tuple[tuple[int, ...], int, bool], tuple[int, list[int], list[int]]] = {}
    serving: list[int] = []
    serves = [0] * len(kind.wanted)

    def record() -> None:
        reused = sum(1 for i in serving if i in free_set)
        idle = most_kept(serving) if free else []
        kept = reused + len(idle)
        key = (tuple(serves), len(free) - kept, len(serving) > reused or kept < len(free))
        value = sum(areas[i] for i in range(len(table)) if fits(i))
        old = best.get(key)
        if old is None or value > old[0]:
            best[key] = (value, list(serving), idle)

    def search(start: int) -> None:
        record()
        for j in range(start, len(cands)):
            i = cands[j]
            if fits(i):
                add(i, 1)
                serving.append(i)
                serves[column[profs[i]]] += 1
                search(j + 1)
                serves[column[profs[i]]] -= 1
                serving.pop()
                add(i, -1)

    search(0)

    def instances(indices: Iterable[int]) -> list[layouts.Instance]:
        return [g.instance(table[i]) for i in indices]

    out = [
        _Option(
            serves=key[0],
            destroyed=key[1],
            touched=key[2],
            free_value=value,
            layout=layouts.Layout.of(instances([*used, *idle, *given])),
            serving=tuple(sorted(instances(given))),
        )
        for key, (value, given, idle) in best.items()
    ]
    # The unchanged GPU (every free instance kept idle, nothing served) sorts first: the hint
    # relies on it.
    return tuple(sorted(out, key=lambda o: (o.touched, o.destroyed, o.serves)))


# --------------------------------------------------------------------------- pods


@dataclass(frozen=True, slots=True)
class _PodClass:
    """Pods the model cannot tell apart: same priority, node constraints and requests."""

    pods: tuple[snapshot.Pod, ...]
    """In snapshot order; the first ones are the ones placed."""

    @property
    def pod(self) -> snapshot.Pod:
        """A representative."""
        return self.pods[0]


def _classes(pods: Iterable[snapshot.Pod], *, interpod: bool = False) -> list[_PodClass]:
    """Pods grouped into classes, in the order each class first appears; with ``interpod``
    (:func:`exactpods.involved`) their namespace, labels and terms must be equal too."""
    groups: dict[tuple[object, ...], list[snapshot.Pod]] = {}
    for pod in pods:
        key = (
            pod.priority,
            constraints.signature(pod),
            pod.demand,
            pod.cpu_milli,
            pod.memory_bytes,
            exactpods.class_key(pod) if interpod else (),
        )
        groups.setdefault(key, []).append(pod)
    return [_PodClass(tuple(group)) for group in groups.values()]


def _serves_every_part(pod: snapshot.Pod, node: snapshot.Node) -> bool:
    """Whether every part of the pod's request (:attr:`snapshot.Pod.parts`) is served by some
    GPU of ``node`` (exact resource names; a unified request resolved on the GPU's model)."""
    on = [pod.parts_on(g.model) for g in node.gpus]
    return all(any(names[i] is not None for names in on) for i in range(len(pod.parts)))


# --------------------------------------------------------------------------- the model

_Supply = tuple[str, str]
"""(GPU model id, canonical profile name): instances of one profile on one node."""


@dataclass(slots=True)
class _Group:
    """The GPUs of one kind on one node and how many of them take each option."""

    node: snapshot.Node
    gpus: tuple[snapshot.Gpu, ...]
    kind: _Kind
    options: tuple[_Option, ...]
    take: list[cp_model.IntVar]
    """Per option, how many of ``gpus`` take it."""


@dataclass(slots=True)
class _Demand:
    """Pods of one class on one node: how many, and from which supplies each request is met."""

    cls: _PodClass
    node: snapshot.Node
    count: cp_model.IntVar
    upper: int
    """The upper bound of ``count``."""
    sources: list[list[tuple[_Supply, cpsat.Linear]]]
    """Per part of the class's request (``pod.parts`` order): instances drawn from each
    supply."""


class _Greedy:
    """The state of :meth:`_Builder._greedy`: what each GPU serves so far, CPU and memory used.

    Room is looked up in the options: a GPU can serve a set of instances exactly when one of its
    options serves those counts, so every step keeps the solution feasible.
    """

    def __init__(self, builder: _Builder) -> None:
        self.builder = builder
        self.solution = list(builder.hint)
        # Per group: serves -> the first (cheapest) option that serves them.
        self.option = [
            {opt.serves: k for k, opt in reversed(list(enumerate(g.options)))}
            for g in builder.groups
        ]
        self.serving: list[list[int]] = []
        """Per GPU of the model (in group order), instances served per wanted profile."""
        self.gpus: dict[str, list[tuple[int, int]]] = defaultdict(list)
        """Per node, (group, index in ``serving``) in group order."""
        for gi, g in enumerate(builder.groups):
            for _ in g.gpus:
                self.gpus[g.node.name].append((gi, len(self.serving)))
                self.serving.append([0] * len(g.kind.wanted))
        self.cpu: dict[str, int] = defaultdict(int)
        self.memory: dict[str, int] = defaultdict(int)
        self.tracker = podaffinity.Tracker(builder.snap) if builder.rules is not None else None
        """With pod (anti-)affinity or spread in play, the filters' view of the pods placed."""

    def place(self, d: _Demand) -> bool:
        """Place one more pod of ``d`` on its node if it fits there."""
        name, pod, alloc = d.node.name, d.cls.pod, d.node.allocatable
        if self.solution[d.count.index] >= d.upper:
            return False
        if alloc is not None and (
            self.cpu[name] + pod.cpu_milli > alloc.cpu_milli
            or self.memory[name] + pod.memory_bytes > alloc.memory_bytes
        ):
            return False
        if self.tracker is not None and self.tracker.refusals_on(pod, [d.node])[0] is not None:
            return False
        given: list[tuple[int, int]] = []  # (GPU, column) of each instance given so far
        splits: list[cpsat.Linear] = []
        for sources, count in zip(d.sources, pod.parts, strict=True):
            for _ in range(count):
                got = self._take(name, sources)
                if got is None:
                    for k, column in given:
                        self.serving[k][column] -= 1
                    return False
                given.append(got[0])
                if len(sources) > 1:  # a split request: count what each model gave
                    splits.append(sources[got[1]][1])
        self.solution[d.count.index] += 1
        for drawn in splits:
            self.solution[drawn.terms[0][1].index] += 1
        self.cpu[name] += pod.cpu_milli
        self.memory[name] += pod.memory_bytes
        if self.tracker is not None:
            self.tracker.add(pod, name)
        return True

    def _take(
        self, node: str, sources: list[tuple[_Supply, cpsat.Linear]]
    ) -> tuple[tuple[int, int], int] | None:
        """Serve one instance where it adds the least disruption (first such GPU).

        Returns (GPU, column) and the index of the source used, or ``None`` if no GPU of the
        node has room.
        """
        best: tuple[int, tuple[int, int], int] | None = None
        for s, (key, _) in enumerate(sources):
            for gi, k in self.gpus[node]:
                kind = self.builder.groups[gi].kind
                if kind.model.id != key[0] or key[1] not in kind.wanted:
                    continue
                column = kind.wanted.index(key[1])
                before = self._cost(gi, k)
                self.serving[k][column] += 1
                if tuple(self.serving[k]) in self.option[gi]:
                    added = self._cost(gi, k) - before
                    if best is None or added < best[0]:
                        best = (added, (k, column), s)
                self.serving[k][column] -= 1
        if best is None:
            return None
        k, column = best[1]
        self.serving[k][column] += 1
        return best[1], best[2]

    def _cost(self, gi: int, k: int) -> int:
        """Destroyed and touched (weighted as in the objective) of GPU ``k``'s cheapest option."""
        opt = self.builder.groups[gi].options[self.option[gi][tuple(self.serving[k])]]
        return opt.destroyed * (len(self.serving) + 1) + opt.touched

    def finish(self) -> list[int]:
        """The solution: each GPU takes the cheapest option serving what it was given."""
        for pairs in self.gpus.values():
            for gi, k in pairs:
                take = self.builder.groups[gi].take
                self.solution[take[0].index] -= 1
                self.solution[take[self.option[gi][tuple(self.serving[k])]].index] += 1
        return self.solution


def _size(d: _Demand) -> int:
    """Compute slices a pod of ``d`` asks for (its requests' names say; a unified request, the
    most it needs on a GPU model of the node)."""
    pod = d.cls.pod
    if pod.unified is None:
        return sum(profiles.parse_profile_name(r.profile).g * r.count for r in pod.mig)
    return max(
        (
            sum(g.model.profile_named(n).compute_slices for n in names)
            for g in d.node.gpus
            if (names := pod.profiles_on(g.model)) is not None
        ),
        default=0,
    )


class _Builder:
    """The CP-SAT model of one snapshot, its phased solve, and the plan read back from it."""

    def __init__(
        self, snap: snapshot.Snapshot, classes: Sequence[_PodClass], *, interpod: bool = False
    ) -> None:
        self.snap = snap
        self.model = cp_model.CpModel()
        self.world = exactpods.World(snap) if interpod else None
        self.rules: exactpods.Rules | None = None
        self.groups: list[_Group] = []
        self.demands: list[_Demand] = []
        self.levels: dict[int, cpsat.Linear] = defaultdict(cpsat.Linear)
        """Per priority level, the pod counts whose sum phase (1) maximises."""
        self.hint: list[int] = []
        """A feasible value per variable, by index: place nothing, change nothing."""
        for node in snap.nodes:
            self._add_node(node, classes)
        for cls in classes:
            counts = [d.count for d in self.demands if d.cls is cls]
            if len(counts) > 1:
                self.model.add(sum(counts) <= len(cls.pods))
        if self.world is not None:
            self.rules = exactpods.add(
                self.model,
                self._var,
                self.world,
                [(id(d.cls), d.cls.pod, d.node, d.count, d.upper) for d in self.demands],
            )

    def _var(self, upper: int, hint: int = 0) -> cp_model.IntVar:
        var = self.model.new_int_var(0, upper, "")
        self.hint.append(hint)
        return var

    def _add_node(self, node: snapshot.Node, classes: Sequence[_PodClass]) -> None:
        admitted = [
            cls
            for cls in classes
            if constraints.rejection(node, cls.pod) is None
            and _serves_every_part(cls.pod, node)
            and (self.world is None or not exactpods.refused(self.world, cls.pod, node))
        ]
        if not admitted:
            return  # nobody may use this node: its GPUs keep their layout
        kinds: dict[_Kind, list[snapshot.Gpu]] = {}
        for gpu in node.gpus:
            names = {n for cls in admitted for n in cls.pod.parts_on(gpu.model)}
            kind = _Kind(
                gpu.model,
                tuple(i.instance for i in gpu.instances if i.used),
                tuple(i.instance for i in gpu.instances if not i.used),
                tuple(sorted(n for n in names if n is not None)),
            )
            kinds.setdefault(kind, []).append(gpu)
        supply: dict[_Supply, cpsat.Linear] = defaultdict(cpsat.Linear)
        most: dict[_Supply, int] = defaultdict(int)
        for kind, gpus in kinds.items():
            if not kind.wanted:
                continue  # no admitted pod can use these GPUs: they keep their layout
            opts = _options(kind)
            if opts[0].touched or any(opts[0].serves):
                raise errors.MigpilotError(f"exact planner: no unchanged option for {kind}")
            # Option 0 is the unchanged GPU: the hint takes it everywhere.
            take = [self._var(len(gpus), len(gpus) if k == 0 else 0) for k in range(len(opts))]
            self.model.add(sum(take) == len(gpus))
            self.groups.append(_Group(node, tuple(gpus), kind, opts, take))
            for p, name in enumerate(kind.wanted):
                key = (kind.model.id, name)
                for opt, var in zip(opts, take, strict=True):
                    if opt.serves[p]:
                        supply[key].terms.append((opt.serves[p], var))
                most[key] += len(gpus) * max(o.serves[p] for o in opts)
        demand: dict[_Supply, cpsat.Linear] = defaultdict(cpsat.Linear)
        for cls in admitted:
            self._add_demand(node, cls, most, demand)
        for key, terms in supply.items():
            # Equal, not at least: an instance is created only for a pod that gets it.
            self.model.add(terms.expr() == demand[key].expr())
        self._add_capacity(node)

    def _add_demand(
        self,
        node: snapshot.Node,
        cls: _PodClass,
        most: Mapping[_Supply, int],
        demand: dict[_Supply, cpsat.Linear],
    ) -> None:
        pod = cls.pod
        keys: list[list[_Supply]] = []
        for part in range(len(pod.parts)):
            found = {(g.model.id, pod.parts_on(g.model)[part]) for g in node.gpus}
            keys.append(sorted((m, n) for m, n in found if n is not None and most.get((m, n))))
        upper = len(cls.pods)
        for n, ks in zip(pod.parts, keys, strict=True):
            upper = min(upper, sum(most[k] for k in ks) // n)
        alloc = node.allocatable
        if alloc is not None:
            if pod.cpu_milli:
                upper = min(upper, alloc.cpu_milli // pod.cpu_milli)
            if pod.memory_bytes:
                upper = min(upper, alloc.memory_bytes // pod.memory_bytes)
        if upper <= 0:
            return
        count = self._var(upper)
        sources: list[list[tuple[_Supply, cpsat.Linear]]] = []
        for n, ks in zip(pod.parts, keys, strict=True):
            if len(ks) == 1:
                drawn = [(ks[0], cpsat.Linear([(n, count)]))]
            else:  # GPUs of several models on the node offer this request: split it
                drawn = [(k, cpsat.Linear([(1, self._var(n * upper))])) for k in ks]
                self.model.add(sum(d.expr() for _, d in drawn) == n * count)
            for k, d in drawn:
                demand[k].terms.extend(d.terms)
            sources.append(drawn)
        self.demands.append(_Demand(cls, node, count, upper, sources))
        self.levels[pod.priority].terms.append((1, count))

    def _add_capacity(self, node: snapshot.Node) -> None:
        alloc = node.allocatable
        if alloc is None:
            return
        demands = [d for d in self.demands if d.node is node]
        for amounts, limit in (
            ([d.cls.pod.cpu_milli for d in demands], alloc.cpu_milli),
            ([d.cls.pod.memory_bytes for d in demands], alloc.memory_bytes),
        ):
            if sum(a * d.upper for a, d in zip(amounts, demands, strict=True)) <= limit:
                continue
            # Bytes are large numbers: divide by their common factor to keep CP-SAT's sums small.
            unit = math.gcd(*amounts) or 1
            self.model.add(
                sum(a // unit * d.count for a, d in zip(amounts, demands, strict=True))
                <= limit // unit
            )

    # ------------------------------------------------------------------------ warm start

    def _greedy(self) -> list[int]:
        """A first solution: pods by priority, smallest first, each where it first fits.

        CP-SAT starts from it, so a short time limit still gives a plan at least this good,
        and a phase that finds nothing better in its time keeps it.
        """
        greedy = _Greedy(self)
        by_class: dict[int, list[_Demand]] = defaultdict(list)
        for d in self.demands:
            by_class[id(d.cls)].append(d)
        order = sorted(by_class.values(), key=lambda ds: (-ds[0].cls.pod.priority, _size(ds[0])))
        for demands in order:
            for _ in demands[0].cls.pods:
                if not any(greedy.place(d) for d in demands):
                    break  # its twins would not fit either
        solution = greedy.finish()
        if self.rules is not None and not self.rules.hint(solution):
            # The filters admitted each pod in the greedy's order, but the model's rules are
            # about the final counts: start from placing nothing instead, which they admit.
            solution = list(self.hint)
            if not self.rules.hint(solution):
                raise errors.MigpilotError("exact planner: placing nothing breaks a pod rule")
        return solution

    # ------------------------------------------------------------------------ solving

    def solve(self, opts: options.Options) -> tuple[list[int], bool]:
        """Run the phases; the final solution (a value per variable) and pod optimality."""
        budget = cpsat.Budget(opts.time_limit_s)
        solution = self._greedy()
        optimal = True
        levels = sorted(self.levels, reverse=True)
        for k, level in enumerate(levels):
            placed = self.levels[level]
            seconds = budget.share(until=_PODS_SHARE, parts=len(levels) - k)
            status, solution = self._run(
                opts, seconds=seconds, budget=budget, hint=solution, maximise=placed
            )
            optimal = optimal and status == cp_model.OPTIMAL
            self.model.add(placed.expr() >= placed.value(solution))
        weight = sum(len(g.gpus) for g in self.groups) + 1
        disruption = cpsat.Linear()
        room = cpsat.Linear()
        for g in self.groups:
            for opt, var in zip(g.options, g.take, strict=True):
                cost = opt.destroyed * weight + opt.touched
                if cost:
                    disruption.terms.append((cost, var))
                if opt.free_value:
                    room.terms.append((opt.free_value, var))
        if disruption.terms:
            # Minimising disruption is maximising its negation.
            disruption = cpsat.Linear([(-c, v) for c, v in disruption.terms])
            seconds = budget.share(until=_PODS_SHARE + _DISRUPTION_SHARE)
            _, solution = self._run(
                opts, seconds=seconds, budget=budget, hint=solution, maximise=disruption
            )
            self.model.add(disruption.expr() >= disruption.value(solution))
        if room.terms:
            seconds = budget.share(until=1.0)
            _, solution = self._run(
                opts, seconds=seconds, budget=budget, hint=solution, maximise=room
            )
        return solution, optimal

    def _run(
        self,
        opts: options.Options,
        *,
        seconds: float,
        budget: cpsat.Budget,
        hint: list[int],
        maximise: cpsat.Linear,
    ) -> tuple[cp_model.CpSolverStatus, list[int]]:
        """One phase (:func:`cpsat.maximise`). Measured on 64-GPU snapshots (2 cores): the
        stronger linear relaxation proves far more phases within the limit, and probing during
        presolve costs more than it gives."""
        return cpsat.maximise(
            self.model,
            maximise,
            hint=hint,
            seconds=seconds,
            workers=opts.workers,
            budget=budget,
            who="exact planner",
            strong_relaxation=True,
        )

    # ------------------------------------------------------------------------ reading back

    def extract(
        self, solution: Sequence[int]
    ) -> tuple[dict[plans.GpuKey, layouts.Layout], list[plans.Placement]]:
        """Target layouts of the modelled GPUs and the pods' placements."""
        targets: dict[plans.GpuKey, layouts.Layout] = {}
        pools: dict[tuple[str, _Supply], list[plans.AssignedInstance]] = defaultdict(list)
        for g in self.groups:
            chosen = [
                opt
                for opt, var in zip(g.options, g.take, strict=True)
                for _ in range(solution[var.index])
            ]
            for gpu, opt in zip(g.gpus, chosen, strict=True):
                targets[(g.node.name, gpu.index)] = opt.layout
                for inst in opt.serving:
                    pools[(g.node.name, (g.kind.model.id, inst.profile))].append(
                        plans.AssignedInstance(gpu.index, inst.profile, inst.start)
                    )
        for pool in pools.values():
            pool.sort(key=lambda i: (i.gpu, i.start))
        placements: list[plans.Placement] = []
        taken: dict[int, int] = defaultdict(int)
        """Pods of each class (by id) placed so far."""
        for d in self.demands:
            n = solution[d.count.index]
            if not n:
                continue
            first = taken[id(d.cls)]
            taken[id(d.cls)] = first + n
            # Per request, how many instances are still to be drawn from each supply.
            quotas = [{key: expr.value(solution) for key, expr in drawn} for drawn in d.sources]
            for pod in d.cls.pods[first : first + n]:
                got: list[plans.AssignedInstance] = []
                for n, quota in zip(pod.parts, quotas, strict=True):
                    for _ in range(n):
                        key = next(k for k, left in quota.items() if left)
                        quota[key] -= 1
                        got.append(pools[(d.node.name, key)].pop(0))
                placements.append(plans.Placement(pod.key, d.node.name, tuple(got)))
        return targets, placements


# --------------------------------------------------------------------------- the planner


def plan(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """Plan ``snap`` with CP-SAT within ``opts.time_limit_s`` on ``opts.workers`` threads.

    A snapshot with nodes in another mode (mps, time-slicing, none) or pods MIG cannot serve is
    split as every planner splits it (:func:`sharing.plan_with`): the MIG nodes and the pods MIG
    can serve go to the MIG model below, the pods it leaves pending to the model of the MPS and
    time-slicing nodes (:func:`exactsharing.place`), each with half the time limit when both
    have work. The split is exact only when no pod could go to both kinds of node; when one
    could (a unified pod without ``nvidia.com/vgpu-mode`` that a MIG node and an MPS or
    time-slicing node both admit), the MIG part is served first and :attr:`Plan.optimal` is
    false even when both parts were proven (the two are not one model)."""
    if not sharing.involved(snap):
        return _plan_mig(snap, opts)
    part = sharing.mig_part(snap)
    shared_nodes = [n for n in snap.nodes if n.mode in _SHARED_MODES]
    both = bool(part.nodes and part.pods and shared_nodes)
    limit = opts.time_limit_s / 2 if both else opts.time_limit_s
    mig_opts = dataclasses.replace(opts, time_limit_s=limit)
    shared_opts = dataclasses.replace(opts, time_limit_s=limit)
    planned = sharing.plan_with(
        snap,
        mig_opts,
        _plan_mig,
        shared_planner=functools.partial(exactsharing.place, opts=shared_opts),
        name=PLANNER,
    )
    if planned.optimal and not split_is_exact(snap):
        planned = dataclasses.replace(planned, optimal=False)
    return planned


_SHARED_MODES = (modes.Mode.MPS, modes.Mode.TIME_SLICING)


def split_is_exact(snap: snapshot.Snapshot) -> bool:
    """Whether no pod of ``snap`` may go both to a MIG node and to an MPS or time-slicing node
    (each admitting it, its mode serving it, some GPU serving its request): then planning the
    MIG part first loses nothing."""
    mig_nodes = [n for n in snap.nodes if n.mode is modes.Mode.MIG]
    shared = [n for n in snap.nodes if n.mode in _SHARED_MODES]
    for pod in snap.pods:
        if pod.mig or pod.mps or pod.unified is None:
            continue  # asked by name: one kind of node only
        if any(_may_go(pod, n) for n in mig_nodes) and any(_may_go(pod, n) for n in shared):
            return False
    return True


def _may_go(pod: snapshot.Pod, node: snapshot.Node) -> bool:
    """Whether ``node`` admits ``pod`` and its mode and some GPU serve the pod's request."""
    if not pod.served_in(node.mode) or constraints.rejection(node, pod) is not None:
        return False
    if node.mode is modes.Mode.MIG:
        return _serves_every_part(pod, node)
    if node.mode is modes.Mode.MPS:
        return any(modes.mps_needs(pod.mps, pod.unified, g.model) for g in node.gpus)
    return any(modes.replica_needs(pod.unified, g.model) for g in node.gpus)


def _plan_mig(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """The MIG model: ``snap`` has only nodes in mode mig and pods MIG can serve."""
    unresolvable = explaining.unresolvable(snap)
    interpod = exactpods.involved(snap)
    classes = _classes((p for p in snap.pods if p.key not in unresolvable), interpod=interpod)
    builder = _Builder(snap, classes, interpod=interpod) if classes else None
    if builder is None or not builder.demands:
        return _finish(snap, opts, targets={}, placements=[])
    solution, optimal = builder.solve(opts)
    targets, placements = builder.extract(solution)
    # The model states pod (anti-)affinity and topology spread (exactpods) over final counts;
    # as a safety net, placements the filters refuse in every binding order are left out
    # (their instances are still created), and the plan is then no longer proven optimal.
    kept, refused = podaffinity.admitted(snap, {p.pod: p.node for p in placements})
    if refused:
        placements = [p for p in placements if p.pod in kept]
        optimal = False
    return _finish(
        snap,
        opts,
        targets=targets,
        placements=placements,
        optimal=optimal,
    )


def _finish(
    snap: snapshot.Snapshot,
    opts: options.Options,
    *,
    targets: Mapping[plans.GpuKey, layouts.Layout],
    placements: list[plans.Placement],
    optimal: bool = True,
) -> plans.Plan:
    placed = {p.pod for p in placements}
    pending = [p for p in snap.pods if p.key not in placed]
    unschedulable = explaining.explain(snap, pending, placements, per_node=opts.explain)
    return plans.build(
        snap,
        planner=PLANNER,
        targets=targets,
        placements=placements,
        unschedulable=unschedulable,
        optimal=optimal,
    )
