"""migpilot's own planner: greedy over the whole pending set, exact per GPU, fast at 8,000 GPUs.

How it works:

* Priority levels are planned one at a time, highest first, as the objective
  (:mod:`migpilot.planning.objective`) ranks them. Within a level several variants are tried
  on copies of the pass: largest request first (the largest single instance, then the most
  compute: packs tightly), smallest first and smallest dominant share of GPU, CPU or memory
  first (place the most pods when capacity is short), each with and without deferring pods that
  need free instances destroyed, and each again with ties broken by node order rather than by
  the pods' policies; then by scarcity (size against what is left, each resource weighted by how
  short it is: memory left after the levels above, say) and with every pod sent to the least
  used node (keeps a level's memory-heavy pods off one node); then with every pod sent where it
  leaves the least GPU room that the node's CPU and memory cannot back ("backed": a 96 GiB pod
  does not take the memory of a node of two idle A100s when a larger node has it), and most
  compute first ("bulk": a pod of two 2g before single 3g pods). The variant that places the
  most pods of the level, then (where levels below have pods) after which the levels below place
  the most (a lookahead: where a level goes decides what the levels below find; it finishes the
  levels below with the variant's own ties, by the first order and by the scarcity order, and
  takes the better), then scores best on the objective, is kept. A variant runs only while pods
  of the level or of the levels below remain pending, and on large problems only the first runs.
  The shallower greedies (the first nine variants without lookahead, the first thirteen with a
  lookahead by the first variant alone) run too where pods stay pending, and the best plan wins.
* Where every variant leaves pods of a level pending on a small problem, a bounded depth-first
  search (:func:`_search`) tries the ways to put the level's pods on nodes (each placed by the
  greedy on that node) or leave them out, and keeps a pass that places more of the level: some
  levels fit one way only (memory of three nodes, say), which no greedy order finds.
* Each GPU carries a planning state: the instances that must stay (in use, or existing free
  instances given to a pod), the free existing instances not yet touched, the multiset of new
  instances the plan creates, and whether the GPU has been changed. New instances have no fixed
  position until the end, so every time a pod is added the GPU's new instances are re-placed
  *jointly* (:func:`migpilot.mig.layouts.pack`): per GPU the packing is exact.
* For a pod, the best option on a GPU is: reuse free existing instances of the right profiles
  (free), then create the rest beside everything that exists. Pods that fit nowhere without
  destroying free existing instances wait for a second sweep, after every other pod is placed;
  then the fewest free instances are destroyed (the variants without deferral destroy as they
  go). Options are ranked by the objective: free
  instances destroyed, then GPUs newly touched, then the free capacity lost (area-weighted
  placements, so large regions and whole GPUs stay free), then the pod's node policy and GPU
  policy (:mod:`migpilot.planning.scoring`: binpack the most used node or GPU, spread the least
  used), then node order.
* A pod's request is whatever :meth:`migpilot.planning.snapshot.Pod.profiles_on` says it needs
  on each GPU model: MIG profiles by name, or a unified request resolved to the smallest
  profile that serves it there.
* GPUs in the same state share one cached evaluation. States are interned to small integers and
  indexed by what still fits on them (per profile, by compute room, tightest first), so a pod
  evaluates a bounded number of promising states, not every GPU, and options found for one kind
  of pod are remembered for the next pod of that kind. Small clusters have fewer states than the
  bounds, so there the search is exhaustive; elsewhere, if the bounded search finds nothing, a
  thorough one looks at every state before a pod is left pending.
* A pod whose instances fit on no single GPU is spread over the GPUs of one node, largest
  instance first. Pods no node could run even with every GPU empty are set aside at once,
  and so are pods no node has room for now (too few compute slices or memory slots that no
  instance in use holds, or too little CPU or memory left: :func:`_stuck`): no plan places
  them, and under a standing backlog of large pods they were most of the search. The variants
  of a level stop once every other pod of it is placed (and the levels below), and the later
  moves below are skipped once every other pod is placed.
* Where a pod that some node could run is left pending, two more variants run: on small
  problems, the greedy again as if every free instance were gone (kept if it scores better,
  destroys counted), and plain first-fit (:mod:`migpilot.planning.firstfit`), whose plan is the
  answer if it places more pods: ``fast`` is never below first-fit.
* On small problems with several priority levels, single nodes and pairs of nodes are then
  repacked (:func:`_repack_pairs`): the greedy never moves a placed pod, and a level above
  often took the room a pod below needed, one swap away.
* These moves cost passes of the greedy, so they pay only where they can help: the greedies of
  one plan share their passes (:class:`_Memo`: a sweep from a state is computed once and
  replayed), and a repack or a level's search is skipped where the room left, each resource
  summed on its own, cannot hold a better set of pods (:func:`_could_gain`).

Pure: no clock, no randomness; the same snapshot gives the same plan.
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from migpilot.mig import layouts, profiles
from migpilot.planning import (
    constraints,
    explaining,
    firstfit,
    objective,
    options,
    plans,
    podaffinity,
    scoring,
    sharing,
    snapshot,
)

Instance = layouts.Instance

StateKey = tuple[str, frozenset[Instance], frozenset[Instance], tuple[str, ...], bool]
"""A GPU state: (model id, fixed instances, free existing instances, new profiles, touched)."""

_Split = tuple[frozenset[Instance], frozenset[Instance]]
"""A GPU's existing instances: (in use, free)."""

Cost = tuple[int, int, int]
"""(free instances destroyed, GPU newly touched, free value lost): smaller is better."""

# Bounds on the search for one pod: feasible states looked at per kind (reuse, touched GPUs,
# untouched GPUs) -- all of them on small clusters, a few on large ones, where each extra state
# costs time for little gain -- and states tried when nothing fits without destroying.
_STATE_BUDGET = 2048
_FEASIBLE_PER_KIND_MIN = 3
_FEASIBLE_PER_KIND_MAX = 64
_DESTROY_LIMIT = 16
_FALLBACK_BUDGET = 64
_MEMBER_SCAN = 32
_SKIP_THOROUGH = True
# Binpack ties: nodes compared per option for the CPU and memory they would leave unbacked.
_NODE_SCAN = 4
_REMEMBERED = 24
_REMEMBERED_STALE = 256
# (pod order, defer destroys, ties by policy) within a priority level, most promising first:
# each order with and without deferring destroys, ties between equally good options going by the
# pods' node and GPU policies; then each order again with ties by node order (a greedy's
# tie-breaks can cost a pod either way: the objective picks the variant).
_VARIANTS = (
    ("largest", True, "policy"),
    ("largest", False, "policy"),
    ("smallest", True, "policy"),
    ("share", True, "policy"),
    ("smallest", False, "policy"),
    ("share", False, "policy"),
    ("largest", True, "order"),
    ("smallest", True, "order"),
    ("share", True, "order"),
    ("room", True, "policy"),
    ("largest", True, "spread"),
    ("room", True, "spread"),
    ("smallest", True, "spread"),
    ("largest", False, "backed"),
    ("room", False, "backed"),
    ("smallest", False, "backed"),
    ("bulk", True, "policy"),
    ("bulk", False, "backed"),
)
# Pairs of nodes repacked at most per plan, on small problems (_repack_pairs).
_REPACKS = 64
# The greedy a single node's repack runs (a repack is one of many: the shallower lookahead;
# without a lookahead, a single node's repack misses the scarcity variant that ties on its
# level). A pair's repack runs the plain greedy: pairs are most repacks, and the lookahead
# there found nothing the plain greedy missed on the floor tests, at three times the cost.
_REPACK_DEPTH = "lookahead"
# GPUs x pods up to which pairs of nodes are repacked (tens of milliseconds each time).
_REPACK_PROBLEM = 5_000
# The variants of the greedy without lookahead (the first ones: by the pods' policies and by
# node order), which _plan_mig keeps if they do better than the greedy with all.
_PLAIN_VARIANTS = 9
# The variants of the greedy with the lookahead of depth "lookahead" (the greedy as the first
# change for issue 25 left it; _plan_mig keeps its plan if it does better than the deep one).
_LOOKAHEAD_VARIANTS = 13
# Placements a level's search (_search) tries at most (185819, a floor test, needs 150; each
# placement costs about what a pod's placement in a sweep does).
_SEARCH_BUDGET = 150
# What the estimate of the levels below at a leaf of that search counts for, and the smaller
# budget of a search where the level is placed whole (it only looks for more below: each leaf
# costs passes over the levels below).
_FINISH_STEPS = 5
_TIE_SEARCH_BUDGET = 30
# GPUs x pods up to which every planning variant runs (a few hundred milliseconds at most).
_SMALL_PROBLEM = 200_000


@dataclass(frozen=True, slots=True)
class Option:
    """How one pod's instances go onto a GPU in a given state."""

    claim: tuple[Instance, ...]
    """Free existing instances the pod takes as they are."""
    destroy: tuple[Instance, ...]
    """Free existing instances destroyed to make room."""
    add: tuple[str, ...]
    """Profiles created for the pod."""
    cost: Cost


class _Gpu:
    """Planning state of one GPU (mutable, private to one planning run)."""

    __slots__ = ("claimed", "free", "gpu", "id", "model", "new", "node", "touched", "used")

    def __init__(
        self,
        gid: int,
        node: int,
        gpu: snapshot.Gpu,
        split: _Split,
    ) -> None:
        self.id = gid
        self.node = node
        self.gpu = gpu
        self.model = gpu.model
        self.used, self.free = split
        self.claimed: frozenset[Instance] = frozenset()
        self.new: tuple[str, ...] = ()
        self.touched = False

    @property
    def key(self) -> StateKey:
        return (self.model.id, self.used | self.claimed, self.free, self.new, self.touched)

    def clone(self) -> _Gpu:
        # The fields are immutable values: a shallow copy is a deep one.
        twin = _Gpu.__new__(_Gpu)
        twin.id, twin.node, twin.gpu, twin.model = self.id, self.node, self.gpu, self.model
        twin.used, twin.free, twin.claimed = self.used, self.free, self.claimed
        twin.new, twin.touched = self.new, self.touched
        return twin


class _States:
    """Interned GPU states and everything derived from a state alone (cached for a plan)."""

    def __init__(self, models: Sequence[profiles.GpuModel]) -> None:
        self.models = {m.id: m for m in models}
        self.compute = {m.id: {p.name: p.compute_slices for p in m.profiles} for m in models}
        self.slots = {m.id: {p.name: p.memory_slots for p in m.profiles} for m in models}
        self.sid: dict[StateKey, int] = {}
        self.keys: list[StateKey] = []
        self.room: list[int] = []
        self.free_slots: list[int] = []
        self.fits: list[frozenset[str]] = []
        self.value: list[int] = []
        self.cache: dict[tuple[int, tuple[str, ...], bool], Option | None] = {}
        self.need_cache: dict[tuple[str, tuple[str, ...]], int] = {}

    def intern(self, key: StateKey) -> int:
        sid = self.sid.get(key)
        if sid is not None:
            return sid
        sid = len(self.keys)
        self.sid[key] = sid
        self.keys.append(key)
        room, slots, fits, value = _facts(self.models[key[0]], key[1], key[2], key[3])
        self.room.append(room)
        self.free_slots.append(slots)
        self.fits.append(fits)
        self.value.append(value)
        return sid

    def need_compute(self, model: str, need: tuple[str, ...]) -> int:
        k = (model, need)
        c = self.need_cache.get(k)
        if c is None:
            sizes = self.compute[model]
            c = self.need_cache[k] = sum(sizes[n] for n in need)
        return c

    def best(self, sid: int, need: tuple[str, ...], *, destroy: bool = True) -> Option | None:
        """The best option for ``need`` on a GPU in state ``sid`` (``None``: it cannot fit).

        With ``destroy=False`` only options that destroy nothing are looked for (cheaper).
        """
        ck = (sid, need, destroy)
        try:
            return self.cache[ck]
        except KeyError:
            pass
        key = self.keys[sid]
        if self.room[sid] < self.need_compute(key[0], need):
            opt = None
        else:
            opt = _best(self.models[key[0]], key, need, destroy, self.value[sid])
        self.cache[ck] = opt
        return opt


def _value(model: profiles.GpuModel, layout: layouts.Layout, others: frozenset[Instance]) -> int:
    """Free value of a layout, counting ``others`` (free existing instances) as free."""
    return layouts.free_value(
        model, layouts.Layout.of(i for i in layout.instances if i not in others)
    )


@functools.lru_cache(maxsize=262144)
def _best(
    model: profiles.GpuModel,
    key: StateKey,
    need: tuple[str, ...],
    destroy: bool,
    before: int,
) -> Option | None:
    """:meth:`_States.best` for a state (``before`` is its free value), cached across plans."""
    fixed, free, new, touched = key[1], key[2], key[3], key[4]
    # Reuse free existing instances first: it costs nothing.
    claim: list[Instance] = []
    rest_list = list(need)
    if free:
        for inst in sorted(free):
            if inst.profile in rest_list:
                rest_list.remove(inst.profile)
                claim.append(inst)
    rest = tuple(rest_list)
    claimed = frozenset(claim)
    fixed2 = fixed | claimed
    free2 = free - claimed
    new2 = tuple(sorted(new + rest))
    newly = 0 if touched or not rest else 1
    lay = layouts.pack(model, new2, fixed2 | free2)
    if lay is not None:
        after = _value(model, lay, free2)
        return Option(tuple(claim), (), rest, (0, newly, before - after))
    if not destroy:
        return None
    # Destroy the fewest free existing instances; among those, lose the least value.
    newly = 0 if touched else 1
    pool = sorted(free2)
    for size in range(1, len(pool) + 1):
        best: Option | None = None
        for combo in itertools.combinations(pool, size):
            kept = free2 - frozenset(combo)
            lay = layouts.pack(model, new2, fixed2 | kept)
            if lay is None:
                continue
            after = _value(model, lay, kept)
            opt = Option(tuple(claim), combo, rest, (size, newly, before - after))
            if best is None or opt.cost < best.cost:
                best = opt
        if best is not None:
            return best
    return None


@functools.lru_cache(maxsize=131072)
def _facts(
    model: profiles.GpuModel,
    fixed: frozenset[Instance],
    free: frozenset[Instance],
    new: tuple[str, ...],
) -> tuple[int, int, frozenset[str], int]:
    """(compute room, memory slots not held, profiles that fit as it stands, free value).

    Slots held are those of the fixed and the new instances (free existing instances may go).

    A function of the state alone, so it is cached across plans: a controller re-planning a
    cluster that changed a little finds most states known.
    """
    held = [model.profile_named(i.profile) for i in fixed]
    held += [model.profile_named(n) for n in new]
    taken = sum(p.compute_slices for p in held)
    slots = model.memory_slots - sum(p.memory_slots for p in held)
    # Nothing new: the existing instances as they stand (no placement to search).
    lay = layouts.pack(model, new, fixed | free) if new else layouts.Layout.of(fixed | free)
    assert lay is not None  # every state the planner builds is a valid layout
    if free:
        fits, value = layouts.fitting_profiles(model, lay), _value(model, lay, free)
    else:
        fits, value = layouts.free_room(model, lay)
    return model.compute_slices - taken, slots, fits, value


class _Index:
    """Which GPUs are in which state during one pass, and the states indexed for lookup."""

    def __init__(self, states: _States, *, gpus: int) -> None:
        self.states = states
        self.per_kind = min(
            _FEASIBLE_PER_KIND_MAX, max(_FEASIBLE_PER_KIND_MIN, _STATE_BUDGET // max(gpus, 1))
        )
        self.members: dict[int, list[int]] = {}
        # (model, touched, profile, room) -> states where one more `profile` fits as they stand.
        self.fitting: dict[tuple[str, bool, str, int], dict[int, None]] = {}
        # (model, touched, room) -> states with compute room (for needs that only fit repacked).
        self.by_room: dict[tuple[str, bool, int], dict[int, None]] = {}
        self.claimable: dict[tuple[str, str], dict[int, None]] = {}
        self.destroyable: dict[str, dict[int, None]] = {}
        self.group_of: dict[int, list[dict[int, None]]] = {}

    def clone(self) -> _Index:
        twin = copy.copy(self)
        twin.members = {k: list(v) for k, v in self.members.items()}
        twin.fitting = {k: dict(v) for k, v in self.fitting.items()}
        twin.by_room = {k: dict(v) for k, v in self.by_room.items()}
        twin.claimable = {k: dict(v) for k, v in self.claimable.items()}
        twin.destroyable = {k: dict(v) for k, v in self.destroyable.items()}
        twin.group_of = {}  # the twin's groups are its own dicts
        return twin

    def _groups(self, sid: int) -> list[dict[int, None]]:
        """The lookup groups a state belongs to (computed once per state and pass)."""
        found = self.group_of.get(sid)
        if found is not None:
            return found
        st = self.states
        key = st.keys[sid]
        model, touched, room = key[0], key[4], st.room[sid]
        found = []
        if room > 0:
            found.append(self.by_room.setdefault((model, touched, room), {}))
            for name in sorted(st.fits[sid]):
                found.append(self.fitting.setdefault((model, touched, name, room), {}))
        for name in sorted({i.profile for i in key[2]}):
            found.append(self.claimable.setdefault((model, name), {}))
        if key[2]:
            found.append(self.destroyable.setdefault(model, {}))
        self.group_of[sid] = found
        return found

    def enter(self, sid: int, gid: int) -> None:
        b = self.members.get(sid)
        if b is not None:
            bisect.insort(b, gid)
            return
        self.members[sid] = [gid]
        for group in self._groups(sid):
            group[sid] = None

    def leave(self, sid: int, gid: int) -> None:
        b = self.members[sid]
        b.pop(bisect.bisect_left(b, gid))
        if b:
            return
        del self.members[sid]
        for group in self._groups(sid):
            group.pop(sid, None)

    def options(
        self, model: str, need: tuple[str, ...], usable: Callable[[int], bool], *, per_kind: int
    ) -> tuple[list[tuple[int, Option]], bool]:
        """Feasible options for ``need`` without destroying, most promising states first.

        Only states with a GPU the pod may use (``usable``: node admits it, CPU and memory
        left) count towards the bounds. Also says whether every option that touches no new
        GPU was found (the bounds were not reached for reuse and for touched GPUs).
        """
        st = self.states
        out: dict[int, Option] = {}

        def consider(sid: int) -> bool:
            if sid in out or not usable(sid):
                return False
            opt = st.best(sid, need, destroy=False)
            if opt is None:
                return False
            out[sid] = opt
            return True

        # States with free existing instances of the pod's first profile: reuse costs nothing.
        found = 0
        tries = 16 * per_kind
        complete = True
        for sid in self.claimable.get((model, need[0]), ()):
            if found >= per_kind or tries <= 0:
                complete = False
                break
            tries -= 1
            found += consider(sid)
        # Touched GPUs (no new GPU touched), then untouched ones; tightest room first. The
        # largest profile of the need must fit as things stand (cheap, and exact for one instance).
        largest = max(need, key=lambda n: (st.slots[model][n], st.compute[model][n], n))
        compute = st.need_compute(model, need)
        full = st.models[model].compute_slices
        for touched in (True, False):
            found = 0
            tries = 16 * per_kind
            for room in range(compute, full + 1):
                for sid in self.fitting.get((model, touched, largest, room), ()):
                    if found >= per_kind or tries <= 0:
                        break
                    tries -= 1
                    found += consider(sid)
            if touched and (found >= per_kind or tries <= 0):
                complete = False
        if not out:
            # Maybe only a repacked GPU can take it: look further, within a budget.
            budget = _FALLBACK_BUDGET
            for touched in (True, False):
                for room in range(compute, full + 1):
                    for sid in self.by_room.get((model, touched, room), ()):
                        if budget <= 0:
                            break
                        budget -= 1
                        consider(sid)
        return list(out.items()), complete

    def destroy_options(
        self, model: str, need: tuple[str, ...], usable: Callable[[int], bool], *, limit: int
    ) -> list[tuple[int, Option]]:
        """Options that destroy free existing instances (when nothing else fits).

        At most ``limit`` usable states are evaluated (each evaluation tries combinations).
        """
        out = []
        for sid in self.destroyable.get(model, ()):
            if limit <= 0:
                break
            if not usable(sid):
                continue
            limit -= 1
            opt = self.states.best(sid, need)
            if opt is not None:
                out.append((sid, opt))
        return out


class _Run:
    """One greedy pass over the pods in a given order."""

    def __init__(
        self,
        snap: snapshot.Snapshot,
        states: _States,
        pods: Sequence[snapshot.Pod],
        *,
        admission: constraints.Admission,
    ) -> None:
        self.snap = snap
        self.states = states
        self.admission = admission
        self.min_cpu = min((p.cpu_milli for p in pods), default=0)
        self.min_mem = min((p.memory_bytes for p in pods), default=0)
        self.index = _Index(states, gpus=sum(len(n.gpus) for n in snap.nodes))
        self.gpus: list[_Gpu] = []
        self.sid: list[int] = []
        self.node_gpus: list[list[_Gpu]] = []
        # GPUs with the same instances start in the same state: build each state once.
        first: dict[tuple[str, tuple[snapshot.ExistingInstance, ...]], tuple[_Split, int]] = {}
        for ni, node in enumerate(snap.nodes):
            mine = []
            for g in node.gpus:
                seen = first.get((g.model.id, g.instances))
                if seen is None:
                    split: _Split = (
                        frozenset(i.instance for i in g.instances if i.used),
                        frozenset(i.instance for i in g.instances if not i.used),
                    )
                    st = _Gpu(len(self.gpus), ni, g, split)
                    sid = states.intern(st.key)
                    first[(g.model.id, g.instances)] = (split, sid)
                else:
                    split, sid = seen
                    st = _Gpu(len(self.gpus), ni, g, split)
                self.gpus.append(st)
                self.sid.append(sid)
                self.index.enter(sid, st.id)
                mine.append(st)
            self.node_gpus.append(mine)
        self.dead = [False] * len(self.gpus)
        self.owned = [True] * len(self.gpus)
        """Which GPU states this pass may change in place: a fork shares the others with its
        twin until it changes them (copy on write: a search forks at every step)."""
        self.exhaustive = _SKIP_THOROUGH and len(self.gpus) <= min(
            _DESTROY_LIMIT, _MEMBER_SCAN, _FALLBACK_BUDGET, self.index.per_kind
        )
        """Whether the quick search is bounded by nothing on this cluster (each bound is at
        least its number of GPUs, and so of states): then a thorough one would find nothing
        more."""
        self.node_of_gpu = [g.node for g in self.gpus]
        self.node_room = [sum(states.room[self.sid[g.id]] for g in gs) for gs in self.node_gpus]
        self.node_slices = [sum(g.model.compute_slices for g in gs) for gs in self.node_gpus]
        self.node_free_slots = [
            sum(states.free_slots[self.sid[g.id]] for g in gs) for gs in self.node_gpus
        ]
        self.node_slots = [sum(g.model.memory_slots for g in gs) for gs in self.node_gpus]
        self.cpu = [n.allocatable.cpu_milli if n.allocatable else None for n in snap.nodes]
        self.mem = [n.allocatable.memory_bytes if n.allocatable else None for n in snap.nodes]
        # The policy scores' CPU and memory: capacity, and what was taken before this plan.
        self.capacity = [_capacity(n) for n in snap.nodes]
        self.span_nodes: dict[tuple[object, ...], list[int]] = {}
        self.failed: set[tuple[object, ...]] = set()
        self.entered: list[int] = []
        self.remembered: dict[
            tuple[str, tuple[str, ...], tuple[object, ...]],
            tuple[list[tuple[Cost, int, Option]], int, bool],
        ] = {}
        self.split_cache: dict[tuple[object, ...], list[tuple[int, Option]] | None] = {}
        self.placed: dict[str, list[tuple[int, tuple[Instance, ...], tuple[str, ...]]]] = {}
        self.node_of: dict[str, int] = {}
        self.tracker = podaffinity.Tracker(snap)
        """Pods bound and placed so far, for pod (anti-)affinity and topology spread."""
        self.by_policy = True
        """Whether ties between equally good options go by the pods' node and GPU policies
        (else by node order, then GPU index: a variant)."""
        self.spread_all = False
        """Whether every pod goes to the least used node first, before GPUs touched and free
        room, as if each asked to be spread over nodes itself (a variant)."""
        self.backed_first = False
        """Whether every pod goes where it leaves the least GPU room that CPU and memory cannot
        back, before GPUs touched and free room (after destroys: a variant)."""
        self.only: int | None = None
        """The one node the next pods may go to (the search of a level, :func:`_search`)."""
        self.log: list[tuple[snapshot.Pod, int, list[tuple[int, Option]]]] | None = None
        """Where each placement is recorded while a sweep is memoised (:class:`_Memo`)."""
        self.placing_matters = any(
            p.terms.constrained or p.terms.preferring for p in snap.pods
        ) or any(b.anti_affinity for b in snap.bound)
        """Whether which pod went where decides what later pods may do (pod affinity, spread),
        beyond the GPU states, CPU and memory they left."""

    def state(self) -> tuple[object, ...]:
        """What decides how the next pods are placed: GPU states, CPU and memory left, nodes
        out of the search (and where each pod went, where pod affinity or spread count)."""
        key: tuple[object, ...] = (tuple(self.sid), tuple(self.cpu), tuple(self.mem))
        key += (tuple(self.dead),)
        if self.placing_matters:
            key += (frozenset(self.node_of.items()),)
        return key

    def replay(self, log: Sequence[tuple[snapshot.Pod, int, list[tuple[int, Option]]]]) -> None:
        """Commit placements recorded from a pass in the same state (:class:`_Memo`)."""
        for pod, ni, parts in log:
            self._commit(pod, ni, [(self.gpus[gid], opt) for gid, opt in parts])

    def fork(self) -> _Run:
        """An independent copy of this pass (to try variants without replaying what is done)."""
        twin = copy.copy(self)
        twin.gpus = list(self.gpus)
        twin.node_gpus = [list(gs) for gs in self.node_gpus]
        self.owned = [False] * len(self.gpus)  # shared from now on, by both
        twin.owned = list(self.owned)
        twin.index = self.index.clone()
        twin.sid = list(self.sid)
        twin.dead = list(self.dead)
        twin.node_room = list(self.node_room)
        twin.node_free_slots = list(self.node_free_slots)
        twin.cpu = list(self.cpu)
        twin.mem = list(self.mem)
        twin.entered = list(self.entered)
        twin.span_nodes = {k: list(v) for k, v in self.span_nodes.items()}
        twin.failed = set(self.failed)
        twin.remembered = {k: (list(v[0]), v[1], v[2]) for k, v in self.remembered.items()}
        twin.split_cache = dict(self.split_cache)
        twin.placed = dict(self.placed)
        twin.node_of = dict(self.node_of)
        twin.tracker = self.tracker.fork()
        return twin

    def _apply(self, st: _Gpu, opt: Option) -> None:
        old = self.sid[st.id]
        assert not self.dead[st.id]
        if not self.owned[st.id]:
            mine = st.clone()
            self.gpus[st.id] = mine
            same_node = self.node_gpus[st.node]
            same_node[same_node.index(st)] = mine
            self.owned[st.id] = True
            st = mine
        self.index.leave(old, st.id)
        st.claimed = st.claimed | frozenset(opt.claim)
        st.free = st.free - frozenset(opt.claim) - frozenset(opt.destroy)
        if opt.add:
            st.new = tuple(sorted(st.new + opt.add))
        if opt.add or opt.destroy:
            st.touched = True
        sid = self.states.intern(st.key)
        self.sid[st.id] = sid
        self.index.enter(sid, st.id)
        self.entered.append(sid)
        self.node_room[st.node] += self.states.room[sid] - self.states.room[old]
        self.node_free_slots[st.node] += self.states.free_slots[sid] - self.states.free_slots[old]

    def _commit(self, pod: snapshot.Pod, ni: int, parts: list[tuple[_Gpu, Option]]) -> None:
        for st, opt in parts:
            self._apply(st, opt)
        cpu, mem = self.cpu[ni], self.mem[ni]
        if cpu is not None:
            self.cpu[ni] = cpu = cpu - pod.cpu_milli
        if mem is not None:
            self.mem[ni] = mem = mem - pod.memory_bytes
        self.placed[pod.key] = [(st.id, opt.claim, opt.add) for st, opt in parts]
        if self.log is not None:
            self.log.append((pod, ni, [(st.id, opt) for st, opt in parts]))
        self.node_of[pod.key] = ni
        self.tracker.add(pod, self.snap.nodes[ni].name)
        # A node without CPU or memory for the smallest pod left takes no more pods: take its
        # GPUs out of the index so that no search looks at them again.
        if (cpu is not None and cpu < self.min_cpu) or (mem is not None and mem < self.min_mem):
            for g in self.node_gpus[ni]:
                if not self.dead[g.id]:
                    self.dead[g.id] = True
                    self.index.leave(self.sid[g.id], g.id)

    def _resources_ok(self, ni: int, pod: snapshot.Pod) -> bool:
        cpu, mem = self.cpu[ni], self.mem[ni]
        return (cpu is None or pod.cpu_milli <= cpu) and (mem is None or pod.memory_bytes <= mem)

    def _choose(
        self, pod: snapshot.Pod, admits: list[bool], found: list[tuple[Cost, int, Option]]
    ) -> tuple[_Gpu, Option] | None:
        """The best option that has a GPU on a node that admits the pod and has CPU/memory.

        Among options equal on the objective the pod's node policy decides (binpack: the node
        left with the least GPU room its CPU and memory cannot back, then the most used node;
        spread: the least used), then its GPU policy between GPUs of that node, then node order.
        """
        node_policy, gpu_policy = pod.policies(self.snap)
        if self.spread_all:
            node_policy = snapshot.Policy.SPREAD
        spread = node_policy is snapshot.Policy.SPREAD
        # The pod's preferred pod (anti-)affinity and ScheduleAnyway spread: first among nodes
        # equal on the objective, every such node looked at (never a reason to refuse one).
        liking = self.tracker.preferences(pod, admits)
        # A pod that asks to be spread over GPUs itself takes the least used GPU before fewer
        # GPUs touched and more free room (never before a destroy): the objective's crowded.
        own_spread = pod.gpu_policy is snapshot.Policy.SPREAD
        # Likewise over nodes: the least used node first (every option is looked at).
        own_node_spread = self.spread_all or pod.node_policy is snapshot.Policy.SPREAD
        backed = self.backed_first and not own_node_spread

        def head(cost: Cost, sid: int) -> tuple[float, ...]:
            if own_spread:
                return (cost[0], self._gpu_use(sid), cost[1], cost[2])
            return cost

        found.sort(key=lambda o: (head(o[0], o[1]), self.index.members[o[1]][0]))
        best: tuple[tuple[float, ...], tuple[float, ...], _Gpu, Option] | None = None
        for found_cost, sid, opt in found:
            cost = head(found_cost, sid)
            if best is not None and not own_node_spread and not backed and cost > best[0]:
                break
            seen: set[int] = set()
            gpu_rank = scoring.rank(gpu_policy, self._gpu_use(sid)) if self.by_policy else 0.0
            for gid in self.index.members[sid]:
                st = self.gpus[gid]
                if st.node in seen or not admits[st.node] or not self._resources_ok(st.node, pod):
                    continue
                # (Members are in GPU order: a node's later GPUs in this state rank the same,
                # only later.)
                seen.add(st.node)
                use = scoring.rank(node_policy, self._node_use(st.node)) if self.by_policy else 0.0
                strands = 0 if spread and not backed else self._strands(st, pod, opt)
                rank = (use, gpu_rank, gid) if spread else (strands, use, gpu_rank, gid)
                if liking is not None:
                    rank = (-liking[st.node], *rank)
                key: tuple[float, ...] = cost
                if own_node_spread:
                    key = (found_cost[0], self._node_use(st.node), *cost[1:])
                elif backed:
                    key = (found_cost[0], strands, *cost[1:])
                if best is None or (key, rank) < (best[0], best[1]):
                    best = (key, rank, st, opt)
                if not spread and not backed and liking is None and len(seen) >= _NODE_SCAN:
                    break
        return None if best is None else (best[2], best[3])

    def _gpu_use(self, sid: int) -> float:
        """:func:`scoring.gpu_use` of a GPU in state ``sid``: what instances in use, given to
        pods or created hold (free existing instances count as free)."""
        model = self.states.models[self.states.keys[sid][0]]
        return scoring.gpu_use(
            slots_held=model.memory_slots - self.states.free_slots[sid],
            slots=model.memory_slots,
            slices_held=model.compute_slices - self.states.room[sid],
            slices=model.compute_slices,
        )

    def _node_use(self, ni: int) -> float:
        """:func:`scoring.node_use` of node ``ni`` as the pass has it now."""
        gpus = scoring.gpu_use(
            slots_held=self.node_slots[ni] - self.node_free_slots[ni],
            slots=self.node_slots[ni],
            slices_held=self.node_slices[ni] - self.node_room[ni],
            slices=self.node_slices[ni],
        )
        cap_cpu, cap_mem = self.capacity[ni]
        cpu, mem = self.cpu[ni], self.mem[ni]
        return scoring.node_use(
            gpus=gpus,
            cpu_taken=0 if cpu is None else cap_cpu - cpu,
            cpu=cap_cpu,
            memory_taken=0 if mem is None else cap_mem - mem,
            memory=cap_mem,
        )

    def _strands(self, st: _Gpu, pod: snapshot.Pod, opt: Option) -> int:
        """Compute slices of the node of ``st`` that placing ``pod`` there leaves without CPU or
        memory to back them, less those it already had (negative: the pod relieves it)."""
        ni = st.node
        alloc = self.snap.nodes[ni].allocatable
        cpu, mem = self.cpu[ni], self.mem[ni]
        if alloc is None or cpu is None or mem is None:
            return 0
        total = self.node_slices[ni]
        sizes = self.states.compute[st.model.id]
        taken = sum(sizes[i.profile] for i in opt.claim) + sum(sizes[n] for n in opt.add)
        room = self.node_room[ni]

        def stranded(room: int, cpu: int, mem: int) -> int:
            out = 0
            for left, whole in ((cpu, alloc.cpu_milli), (mem, alloc.memory_bytes)):
                if whole <= 0 or whole >= 2**61:
                    continue
                backed = left * total // whole
                out = max(out, room - backed)
            return max(out, 0)

        before = stranded(room, cpu, mem)
        after = stranded(room - taken, cpu - pod.cpu_milli, mem - pod.memory_bytes)
        return after - before

    def place(self, pod: snapshot.Pod, needs: dict[str, tuple[str, ...]], *, destroy: bool) -> bool:
        """Place one pod if it fits anywhere (destroying free instances only if ``destroy``).

        Within a sweep room only shrinks, so once a kind of pod (same request, node constraints,
        CPU and memory) fails, the same kind fails again without another search.
        """
        # Where other pods decide (pod affinity, spread), a pod that failed may fit later.
        involved = self.tracker.involved(pod)
        kind = (
            pod.demand,
            constraints.signature(pod),
            pod.cpu_milli,
            pod.memory_bytes,
            destroy,
            self.only,
        )
        if not involved and (
            kind in self.failed or (self.only is not None and (*kind[:5], None) in self.failed)
        ):
            return False  # (a pod that fits on no node fits on no one node)
        if (
            destroy
            and not involved
            and (*kind[:4], False, kind[5]) in self.failed
            and not any(self.index.destroyable.get(m) for m in needs)
        ):
            # No GPU the pod could use has a free instance to destroy: the search with destroys
            # is the one that failed without (a deferring sweep's second pass, mostly).
            self.failed.add(kind)
            return False
        if not self._place(pod, needs, destroy=destroy):
            if not involved:
                self.failed.add(kind)
            return False
        return True

    def admits(self, pod: snapshot.Pod) -> list[bool]:
        """Per node: its constraints admit the pod, and so do kube-scheduler's pod affinity
        and topology spread filters given the pods placed so far."""
        admits = self.admission.admits(pod)
        if self.only is not None:
            admits = [a and ni == self.only for ni, a in enumerate(admits)]
        if not self.tracker.involved(pod):
            return admits
        refused = self.tracker.refusals(pod)
        return [a and r is None for a, r in zip(admits, refused, strict=True)]

    def _place(
        self,
        pod: snapshot.Pod,
        needs: dict[str, tuple[str, ...]],
        *,
        destroy: bool,
        thorough: bool = False,
    ) -> bool:
        """One search. The quick one is bounded; if it fails, a thorough one looks everywhere."""
        admits = self.admits(pod)
        known: dict[int, bool] = {}
        scan = len(self.gpus) if thorough else _MEMBER_SCAN
        members, node_of, cpu, mem = self.index.members, self.node_of_gpu, self.cpu, self.mem
        want_cpu, want_mem = pod.cpu_milli, pod.memory_bytes

        def usable(sid: int) -> bool:
            """Is a GPU in this state on a node that admits the pod and has CPU and memory?"""
            ok = known.get(sid)
            if ok is None:
                ok = False
                for gid in itertools.islice(members[sid], scan):
                    ni = node_of[gid]
                    if not admits[ni]:
                        continue
                    c, m = cpu[ni], mem[ni]
                    if (c is None or want_cpu <= c) and (m is None or want_mem <= m):
                        ok = True
                        break
                known[sid] = ok
            return ok

        per_kind = len(self.gpus) if thorough else self.index.per_kind
        if (
            not thorough
            and not self.spread_all
            and not self.backed_first
            and self.only is None
            and not self.tracker.involved(pod)
        ):
            # (Options remembered were found where other pods then allowed.)
            # A remembered option that changes nothing or fills an already changed GPU is as
            # good as a search would find (bar the free-value tie-break). So is one that touches
            # a new GPU when the last search saw every option that would not: every state GPUs
            # entered since has been looked at. Otherwise search again.
            remembered, complete = self._remembered(pod, needs)
            choice = self._choose(pod, admits, remembered)
            if choice is not None and (choice[1].cost[:2] == (0, 0) or complete):
                st, opt = choice
                self._commit(pod, st.node, [(st, opt)])
                return True
        for destroying in (False, True) if destroy else (False,):
            found: list[tuple[Cost, int, Option]] = []
            for model, need in needs.items():
                if destroying:
                    limit = len(self.gpus) if thorough else _DESTROY_LIMIT
                    pairs = self.index.destroy_options(model, need, usable, limit=limit)
                else:
                    pairs, complete = self.index.options(model, need, usable, per_kind=per_kind)
                    if self.only is None:  # (options on one node are no guide for the next pod)
                        self.remembered[(model, need, constraints.signature(pod))] = (
                            [(opt.cost, sid, opt) for sid, opt in pairs],
                            len(self.entered),
                            complete,
                        )
                found.extend((opt.cost, sid, opt) for sid, opt in pairs)
            choice = self._choose(pod, admits, found)
            if choice is not None:
                st, opt = choice
                self._commit(pod, st.node, [(st, opt)])
                return True
        if self._place_spanning(pod, needs, admits, destroy=destroy):
            return True
        # (On a cluster of few GPUs the quick search already looked at every state.)
        return (
            not thorough
            and not self.exhaustive
            and self._place(pod, needs, destroy=destroy, thorough=True)
        )

    def _remembered(
        self,
        pod: snapshot.Pod,
        needs: dict[str, tuple[str, ...]],
    ) -> tuple[list[tuple[Cost, int, Option]], bool]:
        """The options found for the last pod of this kind, brought up to date.

        Also says whether the searches behind them saw every option that touches no new GPU.

        A state never changes, so an option found earlier is still right while GPUs are in its
        state; only states GPUs entered since need evaluating. Consecutive pods of one kind
        (same request and node constraints) thus cost a few evaluations, not a search.
        """
        out: list[tuple[Cost, int, Option]] = []
        complete = True
        sig = constraints.signature(pod)
        for model, need in needs.items():
            key = (model, need, sig)
            entry = self.remembered.get(key)
            if entry is None:
                complete = False
                continue
            found, seen, searched_all = entry
            complete = complete and searched_all
            if len(self.entered) - seen > _REMEMBERED_STALE:
                complete = False
                continue  # too much has changed since: search afresh
            have = {sid for _, sid, _ in found}
            for sid in self.entered[seen:]:
                if sid in have or self.states.keys[sid][0] != model:
                    continue
                have.add(sid)
                opt = self.states.best(sid, need, destroy=False)
                if opt is not None:
                    found.append((opt.cost, sid, opt))
            alive = [f for f in found if f[1] in self.index.members]
            if len(alive) > _REMEMBERED:  # keep the best (the order is _choose's business)
                alive.sort(key=lambda f: (f[0], self.index.members[f[1]][0]))
                del alive[_REMEMBERED:]
            self.remembered[key] = (alive, len(self.entered), searched_all)
            out.extend(alive)  # _choose skips GPUs the pod may not use
        return out, complete

    def _place_spanning(
        self,
        pod: snapshot.Pod,
        needs: dict[str, tuple[str, ...]],
        admits: list[bool],
        *,
        destroy: bool,
    ) -> bool:
        """Spread the pod's instances over the GPUs of one node (largest instance first)."""
        if pod.count < 2:
            return False
        # Within a pass a node only fills up (GPU room only shrinks), so a node whose GPUs cannot
        # take this kind of pod now never will: each kind keeps the list of nodes not yet ruled
        # out, and a pass looks at each node's GPUs at most once per kind.
        # (CPU and memory are checked per pod, outside the kind: pods that differ only in them
        # share what is known about the GPUs.)
        kind = (pod.demand, constraints.signature(pod), destroy, self.only)
        candidates = self.span_nodes.get(kind)
        if candidates is None:
            candidates = [ni for ni in range(len(self.snap.nodes)) if admits[ni]]
        smallest_instance = {
            m: (
                min(self.states.compute[m][name] for name in need),
                min(self.states.slots[m][name] for name in need),
            )
            for m, need in needs.items()
        }
        room, free_slots, sid = self.states.room, self.states.free_slots, self.sid

        def ruled_out(ni: int) -> bool:
            gpus = self.node_gpus[ni]
            # Each GPU holds at most as many of the instances as its compute room and its memory
            # slots not held allow, counted in the smallest instance's compute and slots.
            return not any(
                sum(
                    min(room[sid[g.id]] // c, free_slots[sid[g.id]] // k)
                    for g in gpus
                    if g.model.id == m
                )
                >= len(needs[m])
                for m, (c, k) in smallest_instance.items()
            )

        node_policy, gpu_policy = pod.policies(self.snap)
        order = candidates
        if self.spread_all or (self.by_policy and node_policy is snapshot.Policy.SPREAD):
            order = sorted(candidates, key=lambda ni: (self._node_use(ni), ni))
        liking = self.tracker.preferences(pod, admits)
        if liking is not None:  # preferred terms first (stable: the order above breaks ties)
            order = sorted(order, key=lambda ni: -liking[ni])
        out: set[int] = set()
        placed = False
        for ni in order:
            if not admits[ni] or not self._resources_ok(ni, pod):
                continue
            if ruled_out(ni):
                out.add(ni)
                continue
            parts = self._split(
                self.node_gpus[ni],
                needs,
                destroy=destroy,
                policy=gpu_policy if self.by_policy else None,
                spread=pod.gpu_policy is snapshot.Policy.SPREAD,
            )
            if parts is None:
                out.add(ni)
                continue
            self._commit(pod, ni, parts)
            placed = True
            break
        self.span_nodes[kind] = [ni for ni in candidates if ni not in out]
        return placed

    def _split(
        self,
        gpus: list[_Gpu],
        needs: dict[str, tuple[str, ...]],
        *,
        destroy: bool,
        policy: snapshot.Policy | None,
        spread: bool = False,
    ) -> list[tuple[_Gpu, Option]] | None:
        """Assign a pod's instances one at a time to the best GPU of a node (trial states); ties
        between GPUs go by the GPU ``policy`` (``None``: GPU order). ``spread``: the pod itself
        asks to be spread over GPUs (``hami.io/gpu-scheduler-policy: spread``): the least used
        GPU wins over fewer GPUs touched and more free room (never over a destroy), as the
        objective's ``crowded`` term ranks it.

        Nodes in the same state (the same GPU states in the same order) get the same answer,
        so it is cached: most nodes a big pod passes over are identical (full, or empty).
        """
        ck = (
            tuple(self.sid[g.id] for g in gpus),
            tuple(sorted(needs.items())),
            destroy,
            policy,
            spread,
        )
        cached = self.split_cache.get(ck)
        if cached is not None or ck in self.split_cache:
            return None if cached is None else [(gpus[k], opt) for k, opt in cached]
        parts = self._split_uncached(gpus, needs, destroy=destroy, policy=policy, spread=spread)
        pos = {g.id: k for k, g in enumerate(gpus)}
        self.split_cache[ck] = None if parts is None else [(pos[g.id], o) for g, o in parts]
        return parts

    def _split_uncached(
        self,
        gpus: list[_Gpu],
        needs: dict[str, tuple[str, ...]],
        *,
        destroy: bool,
        policy: snapshot.Policy | None,
        spread: bool = False,
    ) -> list[tuple[_Gpu, Option]] | None:
        by_model: dict[str, list[_Gpu]] = {}
        for g in gpus:
            if g.model.id in needs:
                by_model.setdefault(g.model.id, []).append(g)
        for model, group in sorted(by_model.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            slots = self.states.slots[model]
            wanted = sorted(needs[model], key=lambda n: (-slots[n], n))
            per_gpu: dict[int, tuple[str, ...]] = {}
            for name in wanted:
                best: tuple[tuple[float, ...], int] | None = None
                seen: set[tuple[int, tuple[str, ...]]] = set()
                for g in group:
                    have = per_gpu.get(g.id, ())
                    sid = self.sid[g.id]
                    if (sid, have) in seen:
                        continue  # an earlier GPU in the same state gives the same answer
                    seen.add((sid, have))
                    trial = tuple(sorted((*have, name)))
                    opt = self.states.best(sid, trial, destroy=destroy)
                    if opt is None:
                        continue
                    # Compare what adding this instance costs, not the GPU's whole share of the
                    # pod: a GPU already holding part of it is touched anyway, so the pod packs
                    # into as few GPUs as it can and whole GPUs stay free for others.
                    cost = opt.cost
                    if have:
                        before = self.states.best(sid, have, destroy=destroy)
                        assert before is not None  # feasible when it was chosen
                        cost = (
                            cost[0] - before.cost[0],
                            cost[1] - before.cost[1],
                            cost[2] - before.cost[2],
                        )
                    # The pod's GPU policy between GPUs equally good on the objective; a pod
                    # that asks to be spread itself: before GPUs touched and free room.
                    if spread:
                        crowd = self._gpu_use(sid) + len(have)
                        order: tuple[float, ...] = (cost[0], crowd, cost[1], cost[2])
                    else:
                        rank = 0.0 if policy is None else scoring.rank(policy, self._gpu_use(sid))
                        order = (*cost, rank)
                    if best is None or (order, g.id) < best:
                        best = (order, g.id)
                if best is None:
                    break
                per_gpu[best[1]] = tuple(sorted((*per_gpu.get(best[1], ()), name)))
            else:
                out = []
                for g in group:
                    if g.id in per_gpu:
                        opt = self.states.best(self.sid[g.id], per_gpu[g.id], destroy=destroy)
                        assert opt is not None  # feasible when it was chosen
                        out.append((g, opt))
                return out
        return None

    def result(self) -> tuple[dict[plans.GpuKey, layouts.Layout], list[plans.Placement]]:
        """Target layouts and placements: new instances get their final positions here."""
        targets: dict[plans.GpuKey, layouts.Layout] = {}
        new_slots: dict[int, dict[str, list[Instance]]] = {}
        for st in self.gpus:
            if not st.new and not st.touched:
                targets[(self.snap.nodes[st.node].name, st.gpu.index)] = st.gpu.layout
                continue
            fixed = st.used | st.claimed | st.free
            lay = layouts.pack(st.model, st.new, fixed)
            assert lay is not None  # the last option chosen for this GPU placed exactly this
            targets[(self.snap.nodes[st.node].name, st.gpu.index)] = lay
            slots: dict[str, list[Instance]] = {}
            for inst in lay.instances:
                if inst not in fixed:
                    slots.setdefault(inst.profile, []).append(inst)
            new_slots[st.id] = slots
        placements = []
        for pod in self.snap.pods:
            parts = self.placed.get(pod.key)
            if parts is None:
                continue
            got: list[plans.AssignedInstance] = []
            for gid, claim, add in parts:
                st = self.gpus[gid]
                for inst in claim:
                    got.append(plans.AssignedInstance(st.gpu.index, inst.profile, inst.start))
                for name in add:
                    inst = new_slots[st.id][name].pop(0)
                    got.append(plans.AssignedInstance(st.gpu.index, inst.profile, inst.start))
            node = self.snap.nodes[self.node_of[pod.key]]
            placements.append(plans.Placement(pod.key, node.name, tuple(got)))
        return targets, placements


def _capacity(node: snapshot.Node) -> tuple[int, int]:
    """The CPU and memory the policy scores measure use against (0: not constrained)."""
    whole = node.capacity or node.allocatable
    if whole is None or node.allocatable is None:
        return 0, 0
    return (
        whole.cpu_milli if whole.cpu_milli < 2**61 else 0,
        whole.memory_bytes if whole.memory_bytes < 2**61 else 0,
    )


def _size(needs: dict[str, tuple[str, ...]], states: _States) -> int:
    """A model-independent size: the most compute a pod needs on any model it can use."""
    return max((states.need_compute(m, n) for m, n in needs.items()), default=0)


def _dominant_shares(
    snap: snapshot.Snapshot, pods: Sequence[snapshot.Pod], size: dict[str, int]
) -> dict[str, float]:
    """Each pod's largest share of a cluster resource (compute slices, CPU, memory).

    Smallest dominant share first places the most pods when CPU or memory binds, not only GPUs.
    """
    compute = sum(g.model.compute_slices for n in snap.nodes for g in n.gpus) or 1
    limited = [n.allocatable for n in snap.nodes if n.allocatable is not None]
    cpu = sum(a.cpu_milli for a in limited if a.cpu_milli < 2**61) or 1
    mem = sum(a.memory_bytes for a in limited if a.memory_bytes < 2**61) or 1
    return {
        p.key: max(size[p.key] / compute, p.cpu_milli / cpu, p.memory_bytes / mem) for p in pods
    }


def _left_shares(run: _Run, pods: Sequence[snapshot.Pod], size: dict[str, int]) -> dict[str, float]:
    """Each pod's size against what ``run`` has left on nodes that can still take pods (GPU
    compute room, CPU, memory), each resource weighted by how short it is: what ``pods`` ask
    of it together over what is left of it.

    The levels above may have used up one resource more than the others (memory, say), or the
    level may ask more of one than is left: the pods that need least of the scarce resource go
    first (an effective-gradient order, as for multi-dimensional knapsacks).
    """
    compute = cpu = mem = 0
    for ni, gs in enumerate(run.node_gpus):
        if all(run.dead[g.id] for g in gs):
            continue
        compute += run.node_room[ni]
        c, m = run.cpu[ni], run.mem[ni]
        cpu += c if c is not None and c < 2**61 else 0
        mem += m if m is not None and m < 2**61 else 0
    left = (max(compute, 1), max(cpu, 1), max(mem, 1))
    asks = {p.key: (size[p.key], p.cpu_milli, p.memory_bytes) for p in pods}
    short = [sum(a[r] for a in asks.values()) / left[r] for r in range(3)]
    return {k: sum(a[r] / left[r] * short[r] for r in range(3)) for k, a in asks.items()}


def _hopeless(
    snap: snapshot.Snapshot,
    needs: dict[str, dict[str, tuple[str, ...]]],
    admission: constraints.Admission,
) -> set[str]:
    """Pods no node could run even with every GPU empty: wrong model, constraints, CPU/memory.

    They are left out of the search (and out of the decision to try a second order).
    """
    out: set[str] = set()
    verdict: dict[tuple[object, ...], bool] = {}
    models = [frozenset(g.model.id for g in n.gpus) for n in snap.nodes]
    for pod in snap.pods:
        kind = (pod.demand, constraints.signature(pod), pod.cpu_milli, pod.memory_bytes)
        ok = verdict.get(kind)
        if ok is None:
            admits = admission.admits(pod)
            ok = any(
                admits[ni]
                and not models[ni].isdisjoint(needs[pod.key])
                and (
                    node.allocatable is None
                    or (
                        pod.cpu_milli <= node.allocatable.cpu_milli
                        and pod.memory_bytes <= node.allocatable.memory_bytes
                    )
                )
                for ni, node in enumerate(snap.nodes)
            )
            verdict[kind] = ok
        if not ok:
            out.add(pod.key)
    return out


def _stuck(
    snap: snapshot.Snapshot,
    needs: dict[str, dict[str, tuple[str, ...]]],
    admission: constraints.Admission,
) -> set[str]:
    """Pods no node has room for now: on every node that admits the pod and has its CPU and
    memory left, on each GPU model it can use, its largest instance is more than one GPU has
    free (compute slices or memory slots that no instance in use holds), or all of its
    instances more than the node's GPUs of that model have free together.

    A necessary condition, so a pod found stuck fits in no plan of the snapshot (free
    instances may be destroyed, and room only shrinks as pods are placed): like the pods no
    node could run even empty (:func:`_hopeless`), it needs no search. Under a standing backlog
    of large pods (the faithful replay's pods of four and eight whole GPUs) most pending pods
    are stuck, and every variant searched for each of them again.
    """
    # Per node and GPU model: the most compute slices and memory slots free on one GPU, and the
    # total free (a GPU out of MIG mode counts as empty: never a reason to call a pod stuck).
    free: list[dict[str, tuple[int, int, int, int]]] = []
    for node in snap.nodes:
        per: dict[str, tuple[int, int, int, int]] = {}
        for g in node.gpus:
            compute, slots = g.model.compute_slices, g.model.memory_slots
            if g.mig:
                for i in g.instances:
                    if i.used:
                        shape = g.model.profile_named(i.profile)
                        compute -= shape.compute_slices
                        slots -= shape.memory_slots
            mc, ms, tc, ts = per.get(g.model.id, (0, 0, 0, 0))
            per[g.model.id] = (max(mc, compute), max(ms, slots), tc + compute, ts + slots)
        free.append(per)
    models = {g.model.id: g.model for n in snap.nodes for g in n.gpus}
    out: set[str] = set()
    verdict: dict[tuple[object, ...], bool] = {}
    for pod in snap.pods:
        kind = (pod.demand, constraints.signature(pod), pod.cpu_milli, pod.memory_bytes)
        room = verdict.get(kind)
        if room is None:
            asks: dict[str, tuple[int, int, int, int]] = {}
            for mid, need in needs[pod.key].items():
                model = models.get(mid)
                if model is None:
                    continue
                if not need:
                    asks[mid] = (0, 0, 0, 0)
                    continue
                shapes = [model.profile_named(n) for n in need]
                asks[mid] = (
                    max(x.compute_slices for x in shapes),
                    max(x.memory_slots for x in shapes),
                    sum(x.compute_slices for x in shapes),
                    sum(x.memory_slots for x in shapes),
                )
            admits = admission.admits(pod)
            room = any(
                admits[ni]
                and (
                    node.allocatable is None
                    or (
                        pod.cpu_milli <= node.allocatable.cpu_milli
                        and pod.memory_bytes <= node.allocatable.memory_bytes
                    )
                )
                and any(
                    mid in free[ni] and all(a <= f for a, f in zip(ask, free[ni][mid], strict=True))
                    for mid, ask in asks.items()
                )
                for ni, node in enumerate(snap.nodes)
            )
            verdict[kind] = room
        if not room:
            out.add(pod.key)
    return out


def plan(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """Plan the whole pending set (see the module docstring); nodes in mode mps or
    time-slicing through :func:`migpilot.planning.sharing.plan_with`."""
    return sharing.plan_with(snap, opts, _plan_mig)


def _plan_mig(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """Plan the whole pending set of a snapshot of MIG nodes."""
    memo = _Memo(snap)
    chosen, orders, thorough, hopeful, placeable = _greedy(snap, depth="deep", memo=memo)
    if thorough and len({p.priority for p in snap.pods}) > 1 and len(chosen.placements) < placeable:
        # The lookahead only estimates the levels below, and a variant that ties on a level
        # can still leave the levels below less: the shallower greedies run too (the nine
        # variants alone, and the thirteen with the first variant's lookahead), and the best
        # plan is kept. So no depth is ever below another.
        for depth in ("lookahead", "plain"):
            other = _greedy(snap, depth=depth, memo=memo)[0]
            if objective.score(snap, other).key > objective.score(snap, chosen).key:
                chosen = other
    # The other variants can only matter where the greedy left a pod pending that could run.
    if len(chosen.placements) == placeable:
        orders, thorough = [], False
    if thorough and any(not i.used for n in snap.nodes for g in n.gpus for i in g.instances):
        # As if every free instance were gone (as HAMi's reconciler would have it): sometimes a
        # clean slate packs more pods than working around free instances. Destroys count
        # against it in the comparison.
        bare_snap = _without_free(snap)
        bare_memo = _Memo(bare_snap)
        levels = len({p.priority for p in snap.pods}) > 1
        for depth in ("deep", "lookahead", "plain") if levels else ("deep",):  # as above
            bare = _greedy(bare_snap, depth=depth, memo=bare_memo)[0]
            alt = plans.build(
                snap,
                planner="fast",
                targets={(g.node, g.gpu): g.layout for g in bare.gpus},
                placements=bare.placements,
                unschedulable=(),
            )
            if objective.score(snap, alt).key > objective.score(snap, chosen).key:
                chosen = alt
    floor = _first_fit(snap, chosen, orders=orders)
    if floor is not None:
        chosen = floor
    if (
        thorough
        and sum(len(n.gpus) for n in snap.nodes) * hopeful <= _REPACK_PROBLEM
        and len({p.priority for p in snap.pods}) > 1
    ):
        chosen = _repack_pairs(snap, chosen)
    placed = {p.pod for p in chosen.placements}
    pending = [p for p in snap.pods if p.key not in placed]
    index = {p.key: i for i, p in enumerate(snap.pods)}
    unsched = explaining.explain(snap, pending, chosen.placements, per_node=opts.explain)
    return dataclasses.replace(
        chosen, unschedulable=tuple(sorted(unsched, key=lambda u: index[u.pod]))
    )


def _repack_pairs(snap: snapshot.Snapshot, chosen: plans.Plan) -> plans.Plan:
    """``chosen`` with pairs of nodes repacked while that places more (priority-weighted).

    The greedy never moves a pod once placed, so a pod left pending can be one move away from
    a place: another pod on a node where it would fit swapped for a pod on a second node, a pod
    of a higher level put on the other node, where it leaves more CPU or memory beside the GPU
    room (the levels below find that room backed). A pair's repack plans the pods placed on the
    two nodes together with the pods left pending, on those two nodes alone as the snapshot has
    them, with the greedy and its variants; it is kept only if it places more by the objective's
    weights (the pods already on the two nodes count, so it never trades a pod for one of a
    lower level). Only pairs where a pending pod could run on one of the nodes are tried, each
    pair once in node order (the reverse order repacks the same pods on the same nodes), and
    only where the pair's room, each resource summed, could hold a better set of its pods and
    the pending ones (:func:`_could_gain`: most pairs of a full cluster cannot, and a repack
    costs a greedy); round after round while a round gains, within :data:`_REPACKS` repacks.

    Pods in pod (anti-)affinity or topology spread are judged against the whole cluster, so a
    snapshot with any is left as it is.
    """
    if any(p.terms.constrained or p.terms.preferring for p in snap.pods) or any(
        b.anti_affinity for b in snap.bound
    ):
        return chosen
    weights = objective.pod_weights(snap.pods)
    placements = {p.pod: p for p in chosen.placements}
    targets = {(g.node, g.gpu): g.layout for g in chosen.gpus}
    admission = constraints.Admission(snap.nodes)
    pods_by_key = {p.key: p for p in snap.pods}
    room = [_node_capacity(n) for n in snap.nodes]
    demands: dict[tuple[str, tuple[int, ...]], _Demand | None] = {}
    budget = _REPACKS
    changed = False
    tried: set[tuple[object, ...]] = set()
    groups: list[tuple[int, ...]] = [(a,) for a in range(len(snap.nodes))]
    groups += itertools.combinations(range(len(snap.nodes)), 2)
    could: dict[str, list[int]] = {}
    improved = True
    while improved and budget > 0:
        improved = False
        for group in groups:
            pending = [p for p in snap.pods if p.key not in placements]
            for pod in pending:
                if pod.key not in could:
                    could[pod.key] = _could_run(snap, pod, admission)
            wanted = [p for p in pending if not set(could[p.key]).isdisjoint(group)]
            if not wanted:
                continue
            nodes = tuple(snap.nodes[a] for a in group)
            names = {n.name for n in nodes}
            here = [pl for pl in placements.values() if pl.node in names]
            key = (group, frozenset(pl.pod for pl in here), frozenset(p.key for p in wanted))
            if key in tried:
                continue
            tried.add(key)
            keep: dict[int, int] = {}
            candidates = []
            for pod in [pods_by_key[pl.pod] for pl in here] + wanted:
                d = _group_demand(snap, pod, group, demands)
                if d is not None:
                    candidates.append((pod.priority, d))
            for pl in here:
                priority = pods_by_key[pl.pod].priority
                keep[priority] = keep.get(priority, 0) + 1
            if not _could_gain(_group_capacity(room, group), candidates, keep):
                continue  # no repack of the group could place more (by the objective's weights)
            if budget <= 0:
                break
            budget -= 1
            mine = {pl.pod for pl in here} | {p.key for p in wanted}
            sub = dataclasses.replace(
                snap,
                nodes=nodes,
                pods=tuple(p for p in snap.pods if p.key in mine),
                bound=(),
                outside=(),
                whole_pods=(),
                models=(),
            )
            found = _greedy(sub, depth=_REPACK_DEPTH if len(group) == 1 else "plain")[0]
            if sum(weights[pl.pod] for pl in found.placements) <= sum(
                weights[pl.pod] for pl in here
            ):
                continue
            for pl in here:
                del placements[pl.pod]
            for pl in found.placements:
                placements[pl.pod] = pl
            for g in found.gpus:
                targets[(g.node, g.gpu)] = g.layout
            improved = changed = True
    if not changed:
        return chosen
    order = {p.key: i for i, p in enumerate(snap.pods)}
    return plans.build(
        snap,
        planner="fast",
        targets=targets,
        placements=sorted(placements.values(), key=lambda pl: order[pl.pod]),
        unschedulable=(),
    )


_Demand = tuple[int, int, int, int]
"""(CPU millicores, memory bytes, compute slices, memory slots): what a pod takes of a group of
nodes at least, or what the group has (:func:`_could_gain`)."""

_UNLIMITED = 2**62


def _node_capacity(node: snapshot.Node) -> _Demand:
    """What pods could take of ``node`` at most: its allocatable CPU and memory, and the compute
    slices and memory slots of its GPUs that no instance in use holds."""
    alloc = node.allocatable
    compute = slots = 0
    for g in node.gpus:
        held = [g.model.profile_named(i.profile) for i in g.instances if i.used]
        compute += g.model.compute_slices - sum(p.compute_slices for p in held)
        slots += g.model.memory_slots - sum(p.memory_slots for p in held)
    return (
        _UNLIMITED if alloc is None else alloc.cpu_milli,
        _UNLIMITED if alloc is None else alloc.memory_bytes,
        compute,
        slots,
    )


def _group_capacity(room: Sequence[_Demand], group: Sequence[int]) -> _Demand:
    """The capacity of nodes ``group`` together (:func:`_node_capacity` of each, summed)."""
    total = [0, 0, 0, 0]
    for ni in group:
        for r in range(4):
            total[r] = min(total[r] + room[ni][r], _UNLIMITED)
    return (total[0], total[1], total[2], total[3])


def _group_demand(
    snap: snapshot.Snapshot,
    pod: snapshot.Pod,
    group: Sequence[int],
    cache: dict[tuple[str, tuple[int, ...]], _Demand | None],
) -> _Demand | None:
    """The least ``pod`` takes of nodes ``group``: its CPU and memory, and the fewest compute
    slices and memory slots its instances take on a GPU model of the group that serves it
    (``None``: none does)."""
    key = (pod.key, tuple(group))
    if key in cache:
        return cache[key]
    compute = slots = None
    for model in {g.model.id: g.model for ni in group for g in snap.nodes[ni].gpus}.values():
        need = pod.profiles_on(model)
        if need is None:
            continue
        shapes = [model.profile_named(n) for n in need]
        c, m = sum(p.compute_slices for p in shapes), sum(p.memory_slots for p in shapes)
        compute = c if compute is None else min(compute, c)
        slots = m if slots is None else min(slots, m)
    out = (
        None
        if compute is None or slots is None
        else (pod.cpu_milli, pod.memory_bytes, compute, slots)
    )
    cache[key] = out
    return out


def _could_gain(
    capacity: _Demand, candidates: Sequence[tuple[int, _Demand]], keep: dict[int, int]
) -> bool:
    """Whether some of the ``candidates`` (priority, least ask) that fit ``capacity`` (each
    resource summed, :data:`_Demand`) could outweigh ``keep`` pods per priority level by the
    objective's weights.

    A necessary condition, cheap to test, that spares a repack or a search which cannot gain:
    weights are lexicographic by priority level, so a better set has, at some level L, as many
    pods as ``keep`` at every level above L and one more at L. Per resource, the least such a
    set can take is the sum of the smallest asks among the candidates of each level; if at
    every level some resource has less than that, no set is better (each resource is relaxed
    on its own, so this never refuses a set that fits).
    """
    levels: dict[int, list[_Demand]] = {}
    for priority, d in candidates:
        levels.setdefault(priority, []).append(d)
    above = [0, 0, 0, 0]
    for lv in sorted(levels, reverse=True):
        k = keep.get(lv, 0)
        smallest = [sorted(d[r] for d in levels[lv]) for r in range(4)]
        if len(levels[lv]) > k and all(
            above[r] + sum(smallest[r][: k + 1]) <= capacity[r] for r in range(4)
        ):
            return True
        for r in range(4):
            above[r] += sum(smallest[r][:k])
    return False


def _run_capacity(run: _Run, asks: Sequence[_Demand]) -> _Demand:
    """What ``run`` has left (:data:`_Demand`) on the nodes that could still take one of the
    ``asks`` by each resource (a node too small for every one of them adds nothing)."""
    total = [0, 0, 0, 0]
    for ni, gs in enumerate(run.node_gpus):
        if all(run.dead[g.id] for g in gs):
            continue
        c, m = run.cpu[ni], run.mem[ni]
        here = (
            _UNLIMITED if c is None else c,
            _UNLIMITED if m is None else m,
            run.node_room[ni],
            run.node_free_slots[ni],
        )
        if not any(all(a[r] <= here[r] for r in range(4)) for a in asks):
            continue
        for r in range(4):
            total[r] = min(total[r] + here[r], _UNLIMITED)
    return (total[0], total[1], total[2], total[3])


def _could_run(
    snap: snapshot.Snapshot, pod: snapshot.Pod, admission: constraints.Admission
) -> list[int]:
    """The nodes that could run ``pod`` with every GPU empty (constraints, a GPU model that
    serves it, CPU and memory)."""
    admits = admission.admits(pod)
    serves = {m.id for m in snap.models if pod.profiles_on(m) is not None}
    out = []
    for ni, node in enumerate(snap.nodes):
        alloc = node.allocatable
        if (
            admits[ni]
            and any(g.model.id in serves for g in node.gpus)
            and (
                alloc is None
                or (pod.cpu_milli <= alloc.cpu_milli and pod.memory_bytes <= alloc.memory_bytes)
            )
        ):
            out.append(ni)
    return out


def _without_free(snap: snapshot.Snapshot) -> snapshot.Snapshot:
    """``snap`` with every free instance removed (instances in use stay)."""
    nodes = tuple(
        dataclasses.replace(
            n,
            gpus=tuple(
                snapshot.Gpu(g.index, g.model, tuple(i for i in g.instances if i.used))
                for g in n.gpus
            ),
        )
        for n in snap.nodes
    )
    return dataclasses.replace(snap, nodes=nodes)


class _Memo:
    """Work shared by the greedies of one plan on one snapshot (deep, lookahead, plain, and the
    search of a level): interned GPU states, sweeps and estimates of the levels below.

    The three depths try the same variants from the same state at the first level, and many
    variants of a level end in the same state (every pod of the level placed alike): the pass
    that follows from a state is the same whichever variant led there, so it is computed once
    and replayed (its placements committed again, no search). Pure: it lives for one plan.
    """

    def __init__(self, snap: snapshot.Snapshot) -> None:
        self.states = _States(snap.models)
        self.sweeps: dict[
            tuple[object, ...],
            tuple[list[tuple[snapshot.Pod, int, list[tuple[int, Option]]]], list[snapshot.Pod]],
        ] = {}
        self.finishes: dict[tuple[object, ...], tuple[int, int]] = {}
        self.failed: dict[tuple[object, ...], set[tuple[object, ...]]] = {}
        """Per state: kinds of pods found to fit nowhere from it (:meth:`_Run.place`)."""
        self.scores: dict[tuple[object, ...], tuple[int, ...]] = {}


def _greedy(
    snap: snapshot.Snapshot, *, depth: str = "lookahead", memo: _Memo | None = None
) -> tuple[plans.Plan, list[list[snapshot.Pod] | None], bool, int, int]:
    """The greedy passes over the variants: the plan chosen (no reasons yet), the pod orders
    first-fit should also try, whether the problem is small enough for every variant, how
    many pods some node could run with every GPU empty, and how many of them some node has
    room for now (:func:`_stuck`: no plan places the others).

    ``depth``: ``"plain"``, the first nine variants and no lookahead (the greedy before issue
    25); ``"lookahead"``, the first :data:`_LOOKAHEAD_VARIANTS` with the lookahead estimated by
    the first variant; ``"deep"``, every variant, the lookahead estimated with each variant's
    own ties, by the first order and by the scarcity order (the better).
    """
    states = memo.states if memo is not None else _States(snap.models)
    needs: dict[str, dict[str, tuple[str, ...]]] = {}
    for pod in snap.pods:
        per_model = {}
        for m in snap.models:
            need = pod.profiles_on(m)
            if need is not None:
                per_model[m.id] = need
        needs[pod.key] = per_model
    admission = constraints.Admission(snap.nodes)
    hopeless = _hopeless(snap, needs, admission)
    stuck = _stuck(snap, needs, admission)
    index = {p.key: i for i, p in enumerate(snap.pods)}
    size = {p.key: _size(needs[p.key], states) for p in snap.pods}
    # Memory slots break ties between pods of equal compute (1g.10gb before 1g.20gb).
    slots = {
        p.key: max(
            (sum(states.slots[m][n] for n in need) for m, need in needs[p.key].items()), default=0
        )
        for p in snap.pods
    }
    # The largest single instance a pod needs: one big instance is harder to place than as much
    # compute in small ones, which may span GPUs (4g.24gb before 4 x 1g.6gb).
    biggest = {
        p.key: max(
            (max(states.compute[m][n] for n in need) for m, need in needs[p.key].items() if need),
            default=0,
        )
        for p in snap.pods
    }
    hopeful = [p for p in snap.pods if p.key not in hopeless]
    # The pods some node has room for now: the only ones a pass may place. The others (stuck)
    # keep their part in the sizes that choose how much to try (variants, search), so that a
    # backlog changes no gate, but no pass looks for room for them, and the variants stop, and
    # the clean slate and first-fit are skipped, once every pod that could be placed is.
    live = [p for p in hopeful if p.key not in stuck]
    share = _dominant_shares(snap, hopeful, size)
    gpus = sum(len(n.gpus) for n in snap.nodes)
    budget = len(_VARIANTS) if gpus * max(len(hopeful), 1) <= _SMALL_PROBLEM else 1
    if depth == "plain":
        budget = min(budget, _PLAIN_VARIANTS)
    elif depth == "lookahead":
        budget = min(budget, _LOOKAHEAD_VARIANTS)

    if budget == 1:
        memo = None  # (one variant: a single pass, nothing to share)

    def sweep(run: _Run, order: list[snapshot.Pod], defer: bool) -> list[snapshot.Pod]:
        if memo is None:
            return place_all(run, order, defer)
        key = (
            run.state(),
            tuple(p.key for p in order),
            defer,
            run.by_policy,
            run.spread_all,
            run.backed_first,
        )
        seen = memo.sweeps.get(key)
        if seen is not None:
            run.replay(seen[0])
            return list(seen[1])
        known = memo.failed.get(key[0])
        if known:
            run.failed |= known
        run.log = []
        left = place_all(run, order, defer)
        memo.sweeps[key] = (run.log, list(left))
        if not run.log:
            # Nothing placed: every failure was met in the state the sweep started from, so
            # it holds in every pass from there (room only shrinks): the other variants of
            # the level, forked from that state, skip those pods without a search.
            memo.failed.setdefault(key[0], set()).update(run.failed)
        run.log = None
        return left

    def place_all(run: _Run, order: list[snapshot.Pod], defer: bool) -> list[snapshot.Pod]:
        if defer:
            # Pods that need free instances destroyed wait until every pod that fits without
            # destroying anything is placed: fewer destroys, often the same number placed.
            order = [p for p in order if not run.place(p, needs[p.key], destroy=False)]
        left = [p for p in order if not run.place(p, needs[p.key], destroy=True)]
        # A pod with pod affinity may have come before the pods it must follow: again, while
        # that places any.
        while True:
            placed = {
                p.key for p in left if p.terms.affinity and run.place(p, needs[p.key], destroy=True)
            }
            if not placed:
                return left
            left = [p for p in left if p.key not in placed]

    # Priority levels one at a time, highest first, as the objective ranks them. For each level,
    # variants (orders, with and without deferring destroys) are tried on copies of the pass as
    # the levels above left it; the variant that serves the level best is kept.
    # Later variants run only while pods of the level stay pending; on large problems only the
    # first runs (each costs a pass; there the greedy's first choice is what a controller that
    # re-plans every few seconds can afford).
    base = _Run(snap, states, hopeful, admission=admission)
    pending: list[snapshot.Pod] = []
    levels = sorted({p.priority for p in live}, reverse=True)
    weights = objective.pod_weights(snap.pods)
    first_order = {
        level: sorted(
            (p for p in live if p.priority == level),
            key=lambda p: (-biggest[p.key], -size[p.key], -slots[p.key], index[p.key]),
        )
        for level in levels
    }
    lookahead = depth != "plain" and budget > 1 and len(levels) > 1
    deep = depth == "deep"
    # The search of a level (_search): small problems, no pod (anti-)affinity or spread (nodes
    # in the same state are then interchangeable).
    searchable = (
        budget > 1
        and gpus * len(hopeful) <= _REPACK_PROBLEM
        and not any(p.terms.constrained or p.terms.preferring for p in snap.pods)
        and not any(b.anti_affinity for b in snap.bound)
    )

    def finish(run: _Run, below: Sequence[int]) -> tuple[int, int]:
        """The weighted pods the levels ``below`` would add to ``run`` with the first variant
        (deep: with the first order or the scarcity order, the better, ties broken as by the
        variant that made ``run``), and how many of their pods would stay pending."""
        key: tuple[object, ...] = ()
        if memo is not None:
            ties = (run.by_policy, run.spread_all, run.backed_first) if deep else ()
            key = (run.state(), ties, deep, tuple(below))
            seen = memo.finishes.get(key)
            if seen is not None:
                return seen
        best = (-1, 0)
        for scarce in (False, True) if deep else (False,):
            trial = run.fork()
            if not deep:
                trial.by_policy, trial.spread_all, trial.backed_first = True, False, False
            gained = left = 0
            for lv in below:
                order = first_order[lv]
                if scarce:
                    shares = _left_shares(trial, order, size)
                    order = sorted(order, key=lambda p: (shares[p.key], index[p.key]))
                rest = sweep(trial, order, True)
                left += len(rest)
                gained += weights[order[0].key] * (len(order) - len(rest))
            if gained > best[0]:
                best = (gained, left)
            if not left:
                break
        if memo is not None:
            memo.finishes[key] = best
        return best

    least: dict[str, _Demand] = {
        p.key: (
            p.cpu_milli,
            p.memory_bytes,
            min(states.need_compute(m, n) for m, n in needs[p.key].items()),
            min(sum(states.slots[m][x] for x in n) for m, n in needs[p.key].items()),
        )
        for p in hopeful
    }

    def fits_from(run: _Run, pods: Sequence[snapshot.Pod]) -> bool:
        """Whether one of ``pods`` fits somewhere from the state of ``run`` (tried on a copy;
        failures are remembered by kind, so each kind costs one search)."""
        trial = run.fork()
        return any(trial.place(p, needs[p.key], destroy=True) for p in pods)

    def score_of(run: _Run) -> tuple[int, ...]:
        """How the plan ``run`` makes compares with the other variants' (:func:`_variant_key`:
        the objective's key with the compute placed), computed once per plan (variants often
        end in the same plan: a level none of whose pods fits, say)."""
        if memo is None:
            return _variant_key(_plan_of(snap, run), snap, size)
        key = (tuple(run.sid), frozenset((k, tuple(v)) for k, v in run.placed.items()))
        found = memo.scores.get(key)
        if found is None:
            found = memo.scores[key] = _variant_key(_plan_of(snap, run), snap, size)
        return found

    def could_gain(run: _Run, li: int, placed: int, gained: int, below: bool) -> bool:
        """Whether the search of level ``li`` from ``run`` could beat ``placed`` pods of the
        level and (``below``) the weighted pods ``gained`` the levels below would add after it
        (:func:`_could_gain`): where the room left cannot hold more, the search is skipped."""
        keep = {levels[li]: placed}
        rest = gained
        for lv in levels[li + 1 :] if below else ():
            w = weights[first_order[lv][0].key]
            keep[lv], rest = divmod(rest, w)  # weights are lexicographic: a mixed radix
        pods = [p for p in live if p.priority in keep]
        asks = [least[p.key] for p in pods]
        return _could_gain(
            _run_capacity(run, asks), [(p.priority, least[p.key]) for p in pods], keep
        )

    for li, level in enumerate(levels):
        everyone = [p for p in hopeful if p.priority == level]
        at_level = [p for p in everyone if p.key not in stuck]
        orders = {
            "largest": sorted(
                at_level,
                key=lambda p: (-biggest[p.key], -size[p.key], -slots[p.key], index[p.key]),
            ),
            "smallest": sorted(at_level, key=lambda p: (size[p.key], slots[p.key], index[p.key])),
            "bulk": sorted(
                at_level,
                key=lambda p: (-size[p.key], -biggest[p.key], -slots[p.key], index[p.key]),
            ),
            "share": sorted(at_level, key=lambda p: (share[p.key], index[p.key])),
        }
        if budget > 1:
            left_now = _left_shares(base, everyone, size)
            orders["room"] = sorted(at_level, key=lambda p: (left_now[p.key], index[p.key]))
        tried: list[tuple[tuple[int, ...], _Run, list[snapshot.Pod], int]] = []
        for name, defer, ties in _VARIANTS[:budget]:
            run = base.fork() if budget > 1 else base
            run.by_policy, run.spread_all = ties == "policy", ties == "spread"
            run.backed_first = ties == "backed"
            left = sweep(run, orders[name], defer)
            key: tuple[int, ...] = ()
            later = 0
            if budget > 1:
                gained = 0
                # Only a variant that places as many of this level as the best so far can win:
                # only then is the lookahead worth its pass.
                if lookahead and li + 1 < len(levels) and all(len(left) <= -t[0][0] for t in tried):
                    gained, later = finish(run, levels[li + 1 :])
                key = (-len(left), gained)
            tried.append((key, run, left, later))
            if not left and not later:
                # Every pod of this level with room is placed, and the levels below as well:
                # the stuck pods left would fail in every variant.
                break
        before = base
        if budget > 1:
            # The objective's score breaks ties only between the variants best on the level and
            # the lookahead (building a plan to score it costs about a sweep): the first best.
            top = max(t[0] for t in tried)
            tied = [t for t in tried if t[0] == top]
            if len(tied) > 1:
                scores = [score_of(t[1]) for t in tied]
                tried = [tied[scores.index(max(scores))]]
        best_key, base, left, later = max(tried, key=lambda t: t[0])
        search_budget = _SEARCH_BUDGET if left else _TIE_SEARCH_BUDGET
        if (
            deep
            and searchable
            # A pod of the level that fits nowhere from the state before the level fits in no
            # arrangement of the level (room only shrinks): then only the levels below can gain.
            and ((left and fits_from(before, left)) or (later and lookahead))
            # Where the budget of a search cannot try each pod of the level on each node once, it
            # only varies the last pods' nodes, which the variants' orders cover (the faithful
            # replay's levels of 80 waiting pods on 6 nodes: 736 searches, none found more).
            and len(everyone) * len(snap.nodes) <= _SEARCH_BUDGET
            and could_gain(before, li, len(at_level) - len(left), best_key[1], lookahead)
        ):
            below = levels[li + 1 :] if lookahead else []
            found = _search(
                before,
                orders["bulk"],
                needs,
                beat=(len(at_level) - len(left), best_key[1] if below else 0),
                budget=search_budget,
                finish=functools.partial(_gained, finish, below) if below else None,
            )
            if found is not None:
                base, left = found
        pending += left
    targets, placements = base.result()
    chosen = plans.build(
        snap, planner="fast", targets=targets, placements=placements, unschedulable=()
    )
    ff_orders: list[list[snapshot.Pod] | None] = [None]  # kube-scheduler's queue order
    if budget > 1:
        share_all = _dominant_shares(snap, snap.pods, size)
        ff_orders += [
            sorted(
                snap.pods, key=lambda p: (-p.priority, -size[p.key], -slots[p.key], index[p.key])
            ),
            sorted(snap.pods, key=lambda p: (-p.priority, size[p.key], slots[p.key], index[p.key])),
            sorted(snap.pods, key=lambda p: (-p.priority, share_all[p.key], index[p.key])),
        ]
    return chosen, ff_orders, budget > 1, len(hopeful), len(live)


def _variant_key(
    plan: plans.Plan, snap: snapshot.Snapshot, size: dict[str, int]
) -> tuple[int, ...]:
    """How a level's variants that place as many pods compare: the objective's key, with the
    compute the plan places (each pod's :func:`_size`) between its destroys (and ``crowded``) and
    its GPUs touched.

    Variants placing as many pods often differ in which pods they leave pending: one leaves a
    pod of two whole GPUs pending and places one of one GPU, say. GPUs touched and free value
    alone would prefer the smaller pods (fewer GPUs touched, more room left), so the more
    variants tried, the likelier the pods left pending are the large ones; but a large pod left
    pending finds room later only where small pods have not taken it, while small pods fill the
    room left later. Under a standing backlog (inflate replays, MIG-native traces of whole-GPU
    training pods) that lost allocation (issue 25).
    """
    score = objective.score(snap, plan)
    compute = sum(size[pl.pod] for pl in plan.placements)
    head = score.key[:3]  # weighted, -destroyed, -crowded
    return (*head, compute, *score.key[3:])


def _plan_of(snap: snapshot.Snapshot, run: _Run) -> plans.Plan:
    """The plan a pass makes (no reasons)."""
    targets, placements = run.result()
    return plans.build(
        snap, planner="fast", targets=targets, placements=placements, unschedulable=()
    )


def _gained(
    finish: Callable[[_Run, Sequence[int]], tuple[int, int]], below: Sequence[int], run: _Run
) -> int:
    """What ``finish`` says the levels ``below`` would add to ``run`` (weighted pods)."""
    return finish(run, below)[0]


def _search(
    run: _Run,
    pods: Sequence[snapshot.Pod],
    needs: dict[str, dict[str, tuple[str, ...]]],
    *,
    beat: tuple[int, int],
    budget: int,
    finish: Callable[[_Run], int] | None,
) -> tuple[_Run, list[snapshot.Pod]] | None:
    """A pass from ``run`` (as the levels above left it) that beats ``beat`` (pods of ``pods``,
    one priority level, placed; then, with ``finish``, the weighted pods the levels below would
    add after it), with the pods of the level left pending; ``None`` if none was found.

    The greedy's orders and ties can all miss a level's packing: three nodes whose memory fits
    the level's pods one way only, a 4g.24gb on the 64 GiB node and two small pods on the
    48 GiB one, say. This searches the ways to put each pod (most compute first) on a node, or
    to leave it pending, depth first: on each node the greedy places it as it would (its GPUs,
    instances and destroys), nodes in the same state count once, and a branch that cannot
    beat the best found stops. With ``finish``, a pass that places as many of the level but
    leaves the levels below more wins too: a pod of a level can take the one GPU where a pod of
    four instances below would fit (each estimate counts as :data:`_FINISH_STEPS` placements).
    At most ``budget`` placements are tried.
    """
    best: list[tuple[_Run, list[snapshot.Pod]] | None] = [None]
    most = [beat]
    steps = [budget]
    count = len(pods)

    def dfs(cur: _Run, i: int, got: int, left: list[snapshot.Pod]) -> None:
        if steps[0] <= 0 or got + count - i < most[0][0]:
            return
        if finish is None and got + count - i == most[0][0]:
            return
        if i == count:
            key = (got, 0)
            if finish is not None:
                steps[0] -= _FINISH_STEPS
                key = (got, finish(cur))
            if key > most[0]:
                most[0], best[0] = key, (cur, left)
            return
        pod = pods[i]
        admits = cur.admission.admits(pod)
        seen: set[tuple[object, ...]] = set()
        for ni, gpus in enumerate(cur.node_gpus):
            if not admits[ni] or not cur._resources_ok(ni, pod):
                continue
            state = (
                tuple(cur.sid[g.id] for g in gpus),
                cur.cpu[ni],
                cur.mem[ni],
                cur.capacity[ni],
                admits_all[ni],
            )
            if state in seen:
                continue
            seen.add(state)
            if steps[0] <= 0:
                return
            steps[0] -= 1
            trial = cur.fork()
            trial.only = ni
            ok = trial.place(pod, needs[pod.key], destroy=True)
            trial.only = None
            if ok:
                dfs(trial, i + 1, got + 1, left)
        dfs(cur, i + 1, got, [*left, pod])

    # Which of the level's pods each node admits: nodes alike in state and admission are
    # interchangeable.
    per_pod = [run.admission.admits(p) for p in pods]
    admits_all = [tuple(a[ni] for a in per_pod) for ni in range(len(run.node_gpus))]
    start = run.fork()
    start.by_policy, start.spread_all, start.backed_first = True, False, False
    dfs(start, 0, 0, [])
    return best[0]


def _first_fit(
    snap: snapshot.Snapshot,
    chosen: plans.Plan,
    *,
    orders: Sequence[Sequence[snapshot.Pod] | None],
) -> plans.Plan | None:
    """The first-fit plan (as ``fast``'s) over ``orders`` that places the most pods
    (priority-weighted), if that is more than ``chosen`` places, else ``None``.

    The floor under every plan: the greedy above can miss what plain first-fit finds (a pod
    order and node order that happen to suit the cluster). First-fit costs about one pass over
    the nodes per kind of pod.
    """
    weights = objective.pod_weights(snap.pods)
    best: tuple[dict[plans.GpuKey, layouts.Layout], list[plans.Placement]] | None = None
    most = sum(weights[p.pod] for p in chosen.placements)
    for order in orders:
        targets, placements = firstfit.place(snap, order=order)
        theirs = sum(weights[p.pod] for p in placements)
        if theirs > most:
            best, most = (targets, placements), theirs
    if best is None:
        return None
    return plans.build(snap, planner="fast", targets=best[0], placements=best[1], unschedulable=())


def clear_caches() -> None:
    """Forget what earlier plans learnt about GPU states, here and in the layout model.

    Plans are the same with or without it; benchmarks call it to time a cold first plan.
    """
    _best.cache_clear()
    _facts.cache_clear()
    snapshot.clear_caches()
    layouts.clear_caches()
