"""The systems migpilot is measured against, re-implemented inside its framework.

A claim that migpilot "beats nos and HAMi" is only worth something if nos and HAMi run on the very
same snapshot, under the same validator and the same objective. This module re-implements the
allocation logic of each of them (see ``shared/design/ANCHORS.md``) from their public source, as
pure functions with the planners' signature ``(snapshot, options) -> Plan``:

- :func:`nos`: nebuly-ai/nos's greedy MIG partitioner (geometry = profile multiset, placement not
  modelled) followed by what its node agent can actually create, then a scheduler pass;
- :func:`hami_template`: HAMi up to v2.9, per-model MIG templates held while a GPU is in use;
- :func:`hami_placement`: HAMi v2.10, one pod at a time, one exact placement per instance;
- :func:`static`: no reconfiguration at all (NVIDIA device plugin + kube-scheduler).

Unified (HAMi-style) requests: ``static`` serves them from free instances of the profile the
request resolves to; ``hami-placement`` and ``hami-template`` serve them as HAMi does (the
smallest allow-listed, or template, profile big enough that has room); ``nos`` does not serve
them at all (it knows only ``nvidia.com/mig-*`` resources) and says so in the pod's reason.

Every choice the original leaves to chance (Go map order, unstable sorts) is made deterministic
here, and every point where our framework cannot express what the original does is documented on
the function concerned. Files cited as ``nos:path`` are in github.com/nebuly-ai/nos (main, last
commit April 2024), ``hami:path`` in github.com/Project-HAMi/HAMi. The code here is ours: the
algorithms were read, not copied.

Pure core: may import :mod:`migpilot.errors`, :mod:`migpilot.mig` and the planning core
(``snapshot``, ``constraints``, ``plans``, ``explaining``, ``options``); never a shell, never the
other planners.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TypeVar

from migpilot import errors
from migpilot.mig import layouts, profiles
from migpilot.planning import (
    constraints,
    explaining,
    options,
    plans,
    podaffinity,
    scoring,
    snapshot,
    unified,
)

Instance = layouts.Instance
GpuKey = plans.GpuKey

# --------------------------------------------------------------------------- shared pieces


def _ordered_pods(snap: snapshot.Snapshot) -> list[snapshot.Pod]:
    """kube-scheduler's queue order: higher priority first, then arrival (snapshot) order."""
    return sorted(snap.pods, key=lambda p: -p.priority)


_MEMO_SIZE = 4096
"""Most entries each memo table of this module keeps (the tables below and the
``functools.lru_cache`` ones). The catalog's models times their profiles are a few hundred, so
only throwaway models (tests, generated GPUs) ever push an entry out."""

# Memo tables for the innermost loops, keyed by the identity of the model's profile tuple (hashing
# a GpuModel costs a Python call per lookup). Each entry keeps that tuple alive, so its identity
# cannot be reused by another model while the entry exists; once the entry is pushed out, no
# lookup can find it, so a reused identity cannot hit a stale answer either.
_RESOLVED: dict[tuple[int, str], tuple[object, str | None]] = {}
_SHAPES: dict[tuple[int, str], tuple[object, tuple[int, int, int]]] = {}
_K = TypeVar("_K")
_V = TypeVar("_V")


def _remember(table: dict[_K, _V], key: _K, value: _V) -> None:
    """``table[key] = value``, first forgetting the oldest entry when ``table`` holds
    :data:`_MEMO_SIZE`, so the table stays bounded. Oldest first rather than least recently
    used: a hit then costs one dict lookup and nothing more, and with the bound far above what
    the catalog needs, which entry goes only matters for throwaway models."""
    if len(table) >= _MEMO_SIZE:
        del table[next(iter(table))]
    table[key] = value


def _requested(model: profiles.GpuModel, name: str) -> str | None:
    """``name`` if a pod asking for it can be served on ``model`` (exact resource name)."""
    return name if snapshot.offered(model, name) else None


def _resolved(model: profiles.GpuModel, name: str) -> str | None:
    """The canonical name of the profile a configuration's ``name`` stands for on ``model`` (by
    shape, tolerating driver drift), if any. Never for pods' requests: see :func:`_requested`."""
    key = (id(model.profiles), name)
    hit = _RESOLVED.get(key)
    if hit is not None:
        return hit[1]
    try:
        found: str | None = model.resolve_profile(name).name
    except errors.UnknownProfileError:
        found = None
    _remember(_RESOLVED, key, (model.profiles, found))
    return found


def _shape(model: profiles.GpuModel, name: str) -> tuple[int, int, int]:
    """(compute slices, memory slots, memory MiB) of a canonical profile name."""
    key = (id(model.profiles), name)
    hit = _SHAPES.get(key)
    if hit is not None:
        return hit[1]
    p = model.profile_named(name)
    mib = p.memory_mib if p.memory_mib is not None else p.nominal_gb * 1024
    found = (p.compute_slices, p.memory_slots, mib)
    _remember(_SHAPES, key, (model.profiles, found))
    return found


class _Capacity:
    """CPU and memory still allocatable per node while pods are placed."""

    def __init__(self, snap: snapshot.Snapshot) -> None:
        self._left: dict[str, tuple[int, int]] = {
            n.name: (n.allocatable.cpu_milli, n.allocatable.memory_bytes)
            for n in snap.nodes
            if n.allocatable is not None
        }

    def fits(self, node: str, pod: snapshot.Pod) -> bool:
        left = self._left.get(node)
        return left is None or (pod.cpu_milli <= left[0] and pod.memory_bytes <= left[1])

    def take(self, node: str, pod: snapshot.Pod) -> None:
        left = self._left.get(node)
        if left is not None:
            self._left[node] = (left[0] - pod.cpu_milli, left[1] - pod.memory_bytes)

    def copy(self) -> _Capacity:
        twin = _Capacity.__new__(_Capacity)
        twin._left = dict(self._left)
        return twin


class _Admitted:
    """Which nodes admit a pod (selector, affinity, taints, cordon), per pod signature."""

    def __init__(self, nodes: Sequence[snapshot.Node]) -> None:
        self._admission = constraints.Admission(nodes)
        self._cache: dict[tuple[object, ...], tuple[list[int], frozenset[int]]] = {}

    def _lookup(self, pod: snapshot.Pod) -> tuple[list[int], frozenset[int]]:
        key = constraints.signature(pod)
        found = self._cache.get(key)
        if found is None:
            ks = [k for k, ok in enumerate(self._admission.admits(pod)) if ok]
            found = self._cache[key] = (ks, frozenset(ks))
        return found

    def indices(self, pod: snapshot.Pod) -> list[int]:
        """Positions in ``nodes`` of the nodes that admit ``pod``, in order."""
        return self._lookup(pod)[0]

    def members(self, pod: snapshot.Pod) -> frozenset[int]:
        """The same positions, as a set."""
        return self._lookup(pod)[1]


@dataclass(slots=True)
class _Pool:
    """Free instances of one GPU that pods may still be bound to."""

    index: int
    model: profiles.GpuModel
    free: list[Instance]


@dataclass(slots=True)
class _NodePool:
    """A node's free instances, with counts per (model, profile) for a quick no."""

    gpus: list[_Pool]
    counts: Counter[tuple[str, str]]
    models: tuple[profiles.GpuModel, ...]

    def may_fit(self, pod: snapshot.Pod) -> bool:
        """False when the node surely lacks free instances for the pod (cheap check)."""
        on = [pod.parts_on(m) for m in self.models]
        for part, count in enumerate(pod.parts):
            have = 0
            for m, names in zip(self.models, on, strict=True):
                name = names[part]
                if name is not None:
                    have += self.counts[(m.id, name)]
            if have < count:
                return False
        return True

    def take(self, pod: snapshot.Pod) -> list[plans.AssignedInstance]:
        """Bind every instance the pod asks for to a free one here (all or nothing).

        Each instance goes to the first GPU in index order holding a free instance of the
        profile, lowest start first; on success the instances leave the pool. Empty when the
        pod does not fit.
        """
        picks: list[tuple[_Pool, Instance]] = []
        taken: set[tuple[int, int]] = set()
        for part, count in enumerate(pod.parts):
            for _ in range(count):
                pick = None
                for pool in self.gpus:
                    name = pod.parts_on(pool.model)[part]
                    if name is None:
                        continue
                    for i in pool.free:
                        if i.profile == name and (pool.index, i.start) not in taken:
                            pick = i
                            break
                    if pick is not None:
                        taken.add((pool.index, pick.start))
                        picks.append((pool, pick))
                        break
                if pick is None:
                    return []
        for pool, inst in picks:
            pool.free.remove(inst)
            self.counts[(pool.model.id, inst.profile)] -= 1
        return [plans.AssignedInstance(pool.index, i.profile, i.start) for pool, i in picks]


def _held(placements: Iterable[plans.Placement]) -> dict[GpuKey, set[Instance]]:
    """The instances these placements give to pods, per GPU."""
    out: dict[GpuKey, set[Instance]] = {}
    for pl in placements:
        for i in pl.instances:
            out.setdefault((pl.node, i.gpu), set()).add(Instance(i.start, i.profile))
    return out


def _bind_free(
    snap: snapshot.Snapshot,
    *,
    targets: Mapping[GpuKey, layouts.Layout],
    pods: Iterable[snapshot.Pod],
    before: Sequence[plans.Placement] = (),
) -> list[plans.Placement]:
    """A scheduler pass binding pending pods to free instances that already exist.

    ``pods`` in queue order (priority, then snapshot order); each goes to the first node in name
    order that admits it, has the CPU and memory, and holds free instances of every profile it
    asks for (they may span the node's GPUs). ``before`` are pods bound earlier: their instances
    and CPU and memory are taken. Nodes only lose free instances during the pass, so a node
    found short for some request is never tried again for it.
    """
    nodes = sorted(snap.nodes, key=lambda n: n.name)
    held = _held(before)
    pools: list[_NodePool] = []
    for node in nodes:
        gpus = []
        counts: Counter[tuple[str, str]] = Counter()
        for g in sorted(node.gpus, key=lambda g: g.index):
            busy = {i.instance for i in g.instances if i.used} | held.get(
                (node.name, g.index), set()
            )
            layout = targets.get((node.name, g.index), g.layout)
            free = [i for i in layout.instances if i not in busy]
            gpus.append(_Pool(g.index, g.model, free))
            counts.update((g.model.id, i.profile) for i in free)
        models = tuple({g.model.id: g.model for g in node.gpus}.values())
        pools.append(_NodePool(gpus, counts, models))
    admitted = _Admitted(nodes)
    capacity = _Capacity(snap)
    by_key = {p.key: p for p in snap.pods}
    for pl in before:
        capacity.take(pl.node, by_key[pl.pod])
    short: dict[snapshot.Demand, set[int]] = {}
    placements: list[plans.Placement] = []
    for pod in sorted(pods, key=lambda p: -p.priority):
        dead = short.setdefault(pod.demand, set())
        for k in admitted.indices(pod):
            if k in dead or not capacity.fits(nodes[k].name, pod):
                continue
            got = pools[k].take(pod) if pools[k].may_fit(pod) else []
            if not got:
                dead.add(k)
                continue
            capacity.take(nodes[k].name, pod)
            placements.append(plans.Placement(pod.key, nodes[k].name, tuple(got)))
            break
    return placements


def _finish(
    snap: snapshot.Snapshot,
    opts: options.Options,
    *,
    planner: str,
    targets: Mapping[GpuKey, layouts.Layout],
    placements: Sequence[plans.Placement],
    notes: Callable[[snapshot.Pod, str], str] | None = None,
) -> plans.Plan:
    """Build the plan; ``notes`` may rewrite a pending pod's reason with what the system did.

    The systems re-implemented here do not plan pod (anti-)affinity or topology spread; a pod
    they place where kube-scheduler's filters refuse it in every binding order would never be
    bound there, so it is left pending (its instances are still created), with that reason:
    the baseline's plan as a cluster would run it, comparable with the planners that honour
    the filters."""
    mig_pods = {p.key for p in snap.pods}
    on = {p.pod: p.node for p in placements if p.pod in mig_pods}
    _, refused = podaffinity.admitted(snap, on)
    placements = [p for p in placements if p.pod not in refused]
    placed = {p.pod for p in placements}
    pending = [p for p in snap.pods if p.key not in placed]
    unschedulable = explaining.explain(snap, pending, placements, per_node=opts.explain)
    if notes is not None:
        by_key = {p.key: p for p in pending}
        unschedulable = [
            dataclasses.replace(u, reason=notes(by_key[u.pod], u.reason)) for u in unschedulable
        ]
    unschedulable = [
        dataclasses.replace(
            u,
            reason=f"{planner} placed it on {on[u.pod]}, where kube-scheduler's filters refuse "
            f"it: {refused[u.pod]} ({planner} does not plan pod affinity or topology spread)",
        )
        if u.pod in refused
        else u
        for u in unschedulable
    ]
    return plans.build(
        snap,
        planner=planner,
        targets=targets,
        placements=placements,
        unschedulable=unschedulable,
    )


# --------------------------------------------------------------------------- static


def static(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """No reconfiguration: pods only get free instances that already exist.

    This is a cluster run with the NVIDIA device plugin in the ``mixed`` strategy and a fixed
    mig-parted layout: kube-scheduler binds each pending pod (priority order, then snapshot
    order) to the first node in name order that admits it, has the CPU and memory, and
    advertises enough free ``nvidia.com/mig-<profile>`` devices; the plan never has an action.
    """
    return _finish(
        snap,
        opts,
        planner="static",
        targets={},
        placements=_bind_free(snap, targets={}, pods=snap.pods),
        notes=None,
    )


# --------------------------------------------------------------------------- nos

# nos:config/gpupartitioner/manager/known_mig_geometries.yaml, the last version of the table
# (models A30, A100 40 GB and A100 80 GB, in the file's order), keyed by our catalog ids.
# Profile names are nos's, typos included: 3g.20gb does not exist on an 80 GB card and the
# driver calls the whole 80 GB GPU 7g.80gb, not 7g.79gb (nos issue #51).
_NOS_KNOWN_GEOMETRIES: dict[str, tuple[dict[str, int], ...]] = {
    "a30-24gb": (
        {"1g.6gb": 4},
        {"1g.6gb": 2, "2g.12gb": 1},
        {"2g.12gb": 2},
        {"4g.24gb": 1},
    ),
    "a100-40gb": (
        {"1g.5gb": 7},
        {"1g.5gb": 5, "2g.10gb": 1},
        {"1g.5gb": 3, "2g.10gb": 2},
        {"1g.5gb": 1, "2g.10gb": 3},
        {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1},
        {"2g.10gb": 2, "3g.20gb": 1},
        {"1g.5gb": 3, "3g.20gb": 1},
        {"1g.5gb": 1, "2g.10gb": 1, "3g.20gb": 1},
        {"3g.20gb": 2},
        {"1g.5gb": 3, "4g.20gb": 1},
        {"1g.5gb": 1, "2g.10gb": 1, "4g.20gb": 1},
        {"7g.40gb": 1},
    ),
    "a100-80gb": (
        {"1g.10gb": 7},
        {"1g.10gb": 5, "2g.20gb": 1},
        {"1g.10gb": 3, "2g.20gb": 2},
        {"1g.10gb": 1, "2g.20gb": 3},
        {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
        {"2g.20gb": 2, "3g.20gb": 1},
        {"1g.10gb": 3, "3g.40gb": 1},
        {"1g.10gb": 1, "2g.20gb": 1, "3g.40gb": 1},
        {"3g.40gb": 2},
        {"1g.10gb": 3, "4g.40gb": 1},
        {"1g.10gb": 1, "2g.20gb": 1, "4g.40gb": 1},
        {"7g.79gb": 1},
    ),
}


@functools.lru_cache(maxsize=_MEMO_SIZE)
def nos_geometries(model: profiles.GpuModel) -> tuple[Mapping[str, int], ...]:
    """The geometries (profile name -> count) nos may give a GPU of ``model``, in nos's order.

    For A30 and A100 these are nos's shipped table, as nos spells it. nos ships nothing for any
    other GPU: honestly, ``NewGPU`` fails with "model is not associated with any known GPU" and
    nos cannot partition an H100 or H200 at all. So that the comparison means something, this
    re-implementation falls back, without any flag, to the profile multisets of the model's
    maximal layouts (:func:`migpilot.mig.layouts.enumerate_layouts`) over the profiles nos's
    name pattern accepts (no ``+me`` or other attribute), most instances first, then by name.
    """
    known = _NOS_KNOWN_GEOMETRIES.get(model.id)
    if known is not None:
        return tuple(MappingProxyType(dict(g)) for g in known)
    allowed = [p.name for p in model.profiles if p.attribute is profiles.Attribute.NONE]
    multisets = {
        tuple(sorted(lay.profile_counts().items()))
        for lay in layouts.enumerate_layouts(model, allowed=allowed)
    }
    ordered = sorted(multisets, key=lambda m: (-sum(n for _, n in m), m))
    return tuple(MappingProxyType(dict(m)) for m in ordered)


def _exact_profile(model: profiles.GpuModel, name: str) -> str | None:
    """The profile a driver would create for ``name``: exact name or a known driver alias.

    nos's agent hands the name to go-nvlib, which accepts only the names the driver reports
    (nos:pkg/gpu/nvml/client.go ``CreateMigDevices`` -> ``ParseMigProfile``): no tolerance.
    """
    for p in model.profiles:
        if name == p.name or name in p.aliases:
            return p.name
    return None


@dataclass(slots=True)
class _NosGpu:
    """nos's view of one GPU (nos:pkg/gpu/mig/gpu.go): used and free device counts by name."""

    index: int
    model: profiles.GpuModel
    used: Counter[str]
    free: Counter[str]

    def copy(self) -> _NosGpu:
        return _NosGpu(self.index, self.model, Counter(self.used), Counter(self.free))

    def geometry(self) -> Counter[str]:
        return +(self.used + self.free)

    def can_apply(self, candidate: Mapping[str, int]) -> bool:
        """``CanApplyGeometry``: the candidate keeps every device in use."""
        return all(candidate.get(p, 0) >= n for p, n in self.used.items())

    def update_for(self, required: Mapping[str, int]) -> bool:
        """``GPU.UpdateGeometryFor``: apply the allowed geometry providing most lacking profiles.

        Score of a candidate = sum over the required profiles this GPU lacks of
        ``min(candidate - used, required)``; the best strictly positive score wins. Go breaks
        ties by map iteration order (random); here the first in the table's order wins.
        """
        best: Mapping[str, int] | None = None
        best_score = 0
        for candidate in nos_geometries(self.model):
            if not self.can_apply(candidate):
                continue
            score = 0
            for p, q in required.items():
                if self.free[p] >= q:
                    continue
                score += max(0, min(candidate.get(p, 0) - self.used[p], q))
            if score > best_score:
                best, best_score = candidate, score
        if best is None:
            return False
        # ApplyGeometry: free = geometry - used for its profiles; other free devices go.
        self.free = Counter({p: n - self.used[p] for p, n in best.items() if n > self.used[p]})
        return True

    def can_host(self, need: Iterable[tuple[str, int]]) -> bool:
        """Does this GPU alone have free devices for everything the pod asks?"""
        free = self.free
        return all(free.get(p, 0) >= q for p, q in need)

    def add_pod(self, need: Iterable[tuple[str, int]]) -> None:
        """``GPU.AddPod``: move the pod's devices from free to used (after :meth:`can_host`)."""
        for p, q in need:
            self.free[p] -= q
            self.used[p] += q


def _nos_size(pod: snapshot.Pod) -> tuple[int, int]:
    """nos's pod sorter compares requested profiles by memory, then slices (smaller first)."""
    sizes = []
    for req in pod.mig:
        parsed = profiles.parse_profile_name(req.profile)
        sizes.append((parsed.gb, parsed.g))
    return min(sizes)


@dataclass(frozen=True, slots=True)
class _NosFailure:
    """A geometry nos chose for a GPU that its agent cannot create."""

    node: str
    gpu: int
    geometry: tuple[tuple[str, int], ...]

    def text(self) -> str:
        return " + ".join(f"{n} x {p}" if n > 1 else p for p, n in self.geometry)


def _nos_partition(
    snap: snapshot.Snapshot, *, pods: Sequence[snapshot.Pod], bound: Sequence[plans.Placement]
) -> dict[str, list[_NosGpu]]:
    """nos's planner (nos:internal/partitioning/core/planner.go ``Plan``): committed geometries.

    ``pods`` are the pods kube-scheduler could not bind; ``bound`` the pods it bound, whose
    instances and CPU and memory are in use. Returns the nodes whose partitioning nos commits,
    with the desired state of each GPU.
    """
    held = _held(bound)
    state: dict[str, list[_NosGpu]] = {}
    for node in snap.nodes:
        gpus = []
        for sg in sorted(node.gpus, key=lambda g: g.index):
            busy = held.get((node.name, sg.index), set())
            gpus.append(
                _NosGpu(
                    sg.index,
                    sg.model,
                    Counter(i.profile for i in sg.instances if i.used or i.instance in busy),
                    Counter(
                        i.profile for i in sg.instances if not i.used and i.instance not in busy
                    ),
                )
            )
        state[node.name] = gpus
    needs = {p.key: Counter({r.profile: r.count for r in p.mig}) for p in pods}

    # Cluster-wide free devices per resource name: allocatable minus requested over all nodes
    # (nos:internal/partitioning/core/snapshot.go getLackingResources).
    cluster_free: Counter[str] = Counter()
    for gpus in state.values():
        for g in gpus:
            cluster_free.update(g.free)

    # SliceTracker (nos:internal/partitioning/core/tracker.go): each pod's lacking profiles are
    # judged against the whole cluster's free devices, each pod on its own.
    lacking_of = {
        pod.key: Counter(
            {p: q - cluster_free[p] for p, q in needs[pod.key].items() if q > cluster_free[p]}
        )
        for pod in pods
    }
    lacking: Counter[str] = Counter()
    for lack in lacking_of.values():
        lacking.update(lack)

    # Pod sorter (nos:internal/partitioning/core/util.go NewPodSorter): priority, then smaller
    # profiles first; stable, so snapshot order breaks ties.
    ordered = sorted(pods, key=lambda p: (-p.priority, _nos_size(p)))

    # Candidate nodes: those with a free device or a GPU not in an allowed geometry
    # (nos:pkg/gpu/mig/node.go HasFreeCapacity), in name order instead of Go map order.
    def has_free_capacity(gpus: list[_NosGpu]) -> bool:
        return any(
            +g.free or dict(g.geometry()) not in [dict(c) for c in nos_geometries(g.model)]
            for g in gpus
        )

    nodes = sorted(snap.nodes, key=lambda n: n.name)
    admitted = _Admitted(nodes)
    capacity = _Capacity(snap)
    by_key = {p.key: p for p in snap.pods}
    for pl in bound:
        capacity.take(pl.node, by_key[pl.pod])
    # Per pod, once: what it needs, which nodes admit it, and the key under which a failure on
    # an unchanged node state is remembered.
    prepared = [
        (
            pod,
            tuple(needs[pod.key].items()),
            admitted.members(pod),
            (tuple(sorted(needs[pod.key].items())), constraints.signature(pod), pod.cpu_milli,
             pod.memory_bytes),
        )
        for pod in ordered
    ]  # fmt: skip
    committed: dict[str, list[_NosGpu]] = {}
    for k, node in enumerate(nodes):
        if not has_free_capacity(state[node.name]):
            continue
        if not +lacking:
            break
        base = state[node.name]
        fork = [g.copy() for g in base]
        # Node.UpdateGeometryFor: GPUs in index order, each served what the previous left.
        required = +lacking
        for g in fork:
            g.update_for(required)
            required = +(required - g.free)
        # Free devices cluster-wide with this node's fork in place of its committed state.
        free: dict[str, int] = dict(cluster_free)
        for g in base:
            for p, n in g.free.items():
                free[p] = free.get(p, 0) - n
        for g in fork:
            for p, n in g.free.items():
                free[p] = free.get(p, 0) + n
        node_free: dict[str, int] = {}
        for g in fork:
            for p, n in g.free.items():
                node_free[p] = node_free.get(p, 0) + n
        trial_capacity = capacity.copy()
        added = 0
        failed: dict[tuple[object, ...], int] = {}
        for pod, need, admits, memo in prepared:
            if failed.get(memo) == added:
                continue
            # planner.tryAddPod: still lacking cluster-wide? then the scheduler's Filter (node
            # admission, CPU, memory, MIG devices of the node), then Node.AddPod, which needs one
            # GPU holding everything the pod asks.
            fits = (
                all(q <= free.get(p, 0) for p, q in need)
                and k in admits
                and all(q <= node_free.get(p, 0) for p, q in need)
                and trial_capacity.fits(node.name, pod)
            )
            gpu = next((g for g in fork if g.can_host(need)), None) if fits else None
            if gpu is None:
                failed[memo] = added
                continue
            gpu.add_pod(need)
            for p, q in need:
                free[p] -= q
                node_free[p] -= q
            trial_capacity.take(node.name, pod)
            # A pod already "added" on an earlier node is tried again here: nos's loop does
            # not skip it, so its simulation can count a pod on several nodes. Kept as is.
            added += 1
            for p, q in lacking_of[pod.key].items():
                lacking[p] -= q
            lacking_of[pod.key] = Counter()
        if added:
            # Commit; a node that took no pod is reverted. (nos's Fork/Revert aliases the node
            # object, so a reverted geometry can leak into later cluster-wide checks; we model
            # the revert its code intends.)
            for g in base:
                cluster_free.subtract(g.free)
            for g in fork:
                cluster_free.update(g.free)
            state[node.name] = fork
            committed[node.name] = fork
            capacity = trial_capacity
    return committed


def _nos_actuate(
    gpu: snapshot.Gpu, desired: Mapping[str, int], *, held: set[Instance]
) -> tuple[layouts.Layout, bool]:
    """What nos's agent leaves on a GPU told to hold ``desired`` (and whether it succeeded).

    nos:internal/controllers/migagent/plan/plan.go ``NewMigConfigPlan``: free devices of
    profiles the spec drops, and surplus free devices, are deleted; if anything must be created,
    every remaining free device is deleted too and re-created with the missing ones, so the
    creations are exactly ``desired - used``. nos:internal/controllers/migagent/actuator.go
    applies the deletions first; nos:pkg/gpu/nvml/client.go ``CreateMigDevices`` then tries up
    to 21 creation orders and, when none succeeds, destroys what it made: all or nothing per
    GPU. We count a multiset as creatable when :func:`migpilot.mig.layouts.place` finds any
    valid placement beside the instances in use (optimistic: nos lets the driver place each
    instance and caps the orders it tries). ``held`` are free instances kube-scheduler has just
    bound to pods: in use from the agent's point of view.
    """
    current = Counter(i.profile for i in gpu.instances)
    used = [i.instance for i in gpu.instances if i.used or i.instance in held]
    used_counts = Counter(i.profile for i in used)
    if all(desired[p] <= current[p] for p in desired):
        keep = []
        surplus = Counter({p: current[p] - desired.get(p, 0) for p in current})
        for inst in sorted(gpu.layout.instances):
            if inst not in used and surplus[inst.profile] > 0:
                surplus[inst.profile] -= 1
                continue
            keep.append(inst)
        return layouts.Layout.of(keep), True
    wanted: list[str] = []
    for p, n in desired.items():
        name = _exact_profile(gpu.model, p)
        if name is None:
            return layouts.Layout.of(used), False
        wanted.extend([name] * (n - used_counts[name]))
    try:
        return layouts.place(gpu.model, wanted, fixed=used), True
    except errors.MigpilotError:
        return layouts.Layout.of(used), False


def nos(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """nos's greedy MIG partitioner, its node agent, then a scheduler pass.

    nos acts only on pods kube-scheduler left pending (``PodScheduled=Unschedulable``,
    nos:internal/controllers/gpupartitioner/pod_controller.go), so a first scheduler pass binds
    what free instances already allow (the first-fit pass of :func:`static`); nos then plans
    one batch for the rest (a snapshot is planned once, as migpilot's planners do; later
    batches are not modelled), its agent reconfigures, and the scheduler binds again.

    Planner (nos:internal/partitioning/core/planner.go, tracker.go, snapshot.go, util.go and
    nos:pkg/gpu/mig/gpu.go, node.go): profiles are compared by name, as nos's resource maps do.
    A pod "lacks" a profile when the whole cluster has fewer free devices of it than the pod
    asks (each pod judged alone); nothing happens if no pod lacks anything. Pods are sorted by
    priority, then smaller profiles first. Candidate nodes (a free device, or a GPU whose
    geometry is not an allowed one) are visited in name order (nos: Go map order), GPUs in index
    order; each GPU takes the allowed geometry (:func:`nos_geometries`) that keeps its used
    devices and scores best on ``sum min(candidate - used, required)`` over the lacking
    profiles, ties to the first in table order (nos: map order). Then every sorted pod is tried:
    still not lacking cluster-wide, admitted by the node (kube-scheduler's Filter: selector,
    affinity, taints, cordon, CPU, memory) and served entirely by one GPU's free devices. A node
    on which no pod was added is reverted. nos never counts the cost of destroying free devices.

    Agent: see :func:`_nos_actuate`. A chosen geometry that cannot be created beside the used
    instances leaves the GPU with its used instances only (its free ones were deleted first);
    the plan's target layouts hold only what was created, and pending pods that asked for a
    profile of such a geometry say so in their reason.

    Binding: nos only changes geometries; kube-scheduler binds pods to free devices, here the
    first-fit pass of :func:`static` (nodes in name order, a pod's instances may span a node's
    GPUs), before and after the reconfiguration.

    Not modelled: the batch window, device-plugin restarts, the kubelet race ANCHORS.md
    describes, ``GPU.AddPod``'s partial update when a multi-profile pod does not fit, and
    nodes with GPUs of several models (nos assumes one model per node; we use each GPU's own).
    """
    served = [p for p in snap.pods if p.unified is None]  # nos knows no unified request
    first = _bind_free(snap, targets={}, pods=served)
    bound = {p.pod for p in first}
    pending = [p for p in served if p.key not in bound]
    committed = _nos_partition(snap, pods=pending, bound=first)
    held = _held(first)
    targets: dict[GpuKey, layouts.Layout] = {}
    failures: list[_NosFailure] = []
    nodes = {n.name: n for n in snap.nodes}
    for name, gpus in committed.items():
        node = nodes[name]
        by_index = {g.index: g for g in node.gpus}
        for ng in gpus:
            gpu = by_index[ng.index]
            desired = ng.geometry()
            if desired == Counter(i.profile for i in gpu.instances):
                continue
            layout, ok = _nos_actuate(gpu, desired, held=held.get((name, gpu.index), set()))
            targets[(name, gpu.index)] = layout
            if not ok:
                failures.append(_NosFailure(name, gpu.index, tuple(sorted(desired.items()))))
    second = _bind_free(snap, targets=targets, pods=pending, before=first)
    placements = [*first, *second]

    def notes(pod: snapshot.Pod, reason: str) -> str:
        if pod.unified is not None:
            return (
                f"nos serves only nvidia.com/mig-* requests, not {unified.GPU} with "
                f"{unified.GPUMEM} ({pod.request_text()})"
            )
        asked = {r.profile for r in pod.mig}
        for f in failures:
            if asked & {p for p, _ in f.geometry} and _admits(nodes[f.node], pod):
                return (
                    f"{reason}; nos chose {f.text()} for {f.node}/gpu{f.gpu}, which cannot be "
                    "created beside the instances in use, so its agent created nothing there"
                )
        return reason

    return _finish(snap, opts, planner="nos", targets=targets, placements=placements, notes=notes)


def _admits(node: snapshot.Node, pod: snapshot.Pod) -> bool:
    return constraints.rejection(node, pod) is None


# --------------------------------------------------------------------------- HAMi

# hami:charts/hami/templates/scheduler/device-configmap.yaml at v2.10, ``migProfileAllowlist``,
# keyed by our catalog ids. Names are HAMi's; they are matched to profiles by shape (7g.79gb is
# the A100-80GB's whole-GPU profile).
_HAMI_ALLOWLIST: dict[str, tuple[str, ...]] = {
    "a30-24gb": ("1g.6gb", "2g.12gb", "4g.24gb"),
    "a100-40gb": ("1g.5gb", "2g.10gb", "3g.20gb", "7g.40gb"),
    "a100-80gb": ("1g.10gb", "2g.20gb", "3g.40gb", "7g.79gb"),
    "h100-80gb": ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb"),
    "h100-nvl-94gb": ("1g.12gb", "2g.24gb", "3g.47gb", "7g.94gb"),
    "h100-96gb": ("1g.12gb", "2g.24gb", "3g.48gb", "7g.96gb"),
    "h200-141gb": ("1g.18gb", "2g.35gb", "3g.71gb", "7g.141gb"),
    "b200-180gb": ("1g.23gb", "2g.45gb", "3g.90gb", "7g.180gb"),
    "rtx-pro-6000-blackwell-96gb": ("1g.24gb", "2g.48gb", "4g.96gb"),
}

# The ``knownMigGeometries`` templates HAMi's chart shipped before v2.10 (hami:charts/hami/
# templates/scheduler/device-configmap.yaml, as reproduced in hami:docs/dynamic-mig-support_cn.md),
# in config order: (profile, count) entries per template.
_HAMI_TEMPLATES: dict[str, tuple[tuple[tuple[str, int], ...], ...]] = {
    "a30-24gb": ((("1g.6gb", 4),), (("2g.12gb", 2),), (("4g.24gb", 1),)),
    "a100-40gb": (
        (("1g.5gb", 7),),
        (("2g.10gb", 3), ("1g.5gb", 1)),
        (("3g.20gb", 2),),
        (("7g.40gb", 1),),
    ),
    "a100-80gb": (
        (("1g.10gb", 7),),
        (("2g.20gb", 3), ("1g.10gb", 1)),
        (("3g.40gb", 2),),
        (("7g.79gb", 1),),
    ),
}


@functools.lru_cache(maxsize=_MEMO_SIZE)
def hami_profiles(model: profiles.GpuModel) -> tuple[str, ...]:
    """The profiles (canonical names) HAMi v2.10 may create on ``model``, smallest first.

    The chart's ``migProfileAllowlist`` where it lists the model; otherwise the same pattern
    derived from our catalog: per slice class (1g, 2g, 3g and 7g on 7-slice GPUs; 1g, 2g and 4g
    on 4-slice ones), the attribute-free profile with the least memory.
    """
    listed = _HAMI_ALLOWLIST.get(model.id)
    if listed is not None:
        names = [_resolved(model, n) for n in listed]
        return tuple(n for n in names if n is not None)
    classes = (1, 2, 3, 7) if model.compute_slices == 7 else (1, 2, model.compute_slices)
    out: list[str] = []
    for c in classes:
        plain = [
            p
            for p in model.profiles
            if p.compute_slices == c and p.attribute is profiles.Attribute.NONE
        ]
        if plain:
            out.append(min(plain, key=lambda p: (_shape(model, p.name)[2], p.name)).name)
    return tuple(dict.fromkeys(out))


@dataclass(frozen=True, slots=True)
class HamiTemplate:
    """One HAMi (<= v2.9) MIG template of a GPU model, ready to apply."""

    counts: Mapping[str, int]
    """Instances per canonical profile name."""
    layout: layouts.Layout
    """Where mig-parted puts them (as :func:`migpilot.mig.layouts.place` would)."""
    largest_mib: int
    """Memory of its largest entry: HAMi takes a template that has any entry this big."""


@functools.lru_cache(maxsize=_MEMO_SIZE)
def hami_templates(model: profiles.GpuModel) -> tuple[HamiTemplate, ...]:
    """HAMi's MIG templates for ``model`` in config order (v2.9 and earlier).

    The chart's ``knownMigGeometries`` for A30 and A100; for any other model the same pattern
    over :func:`hami_profiles`: for each profile, smallest first, as many as fit on the GPU,
    then the rest filled with the smallest profile (this reproduces the shipped tables exactly).
    """
    listed = _HAMI_TEMPLATES.get(model.id)
    entries: list[list[tuple[str, int]]] = []
    if listed is not None:
        for tmpl in listed:
            resolved = [(_resolved(model, n), k) for n, k in tmpl]
            entries.append([(n, k) for n, k in resolved if n is not None])
    else:
        names = hami_profiles(model)
        for name in names:
            k = _max_fit(model, fixed=[], name=name)
            fill = _max_fit(model, fixed=[name] * k, name=names[0]) if name != names[0] else 0
            entries.append([(name, k), *([(names[0], fill)] if fill else [])])
    out: list[HamiTemplate] = []
    for entry in entries:
        counts = Counter(dict(entry))
        try:
            layout = layouts.place(model, list(counts.elements()))
        except errors.MigpilotError:
            continue
        largest = max(_shape(model, n)[2] for n in counts)
        out.append(HamiTemplate(MappingProxyType(dict(counts)), layout, largest))
    return tuple(out)


def _max_fit(model: profiles.GpuModel, *, fixed: list[str], name: str) -> int:
    """How many more ``name`` instances fit beside the ``fixed`` multiset."""
    k = 0
    while True:
        try:
            layouts.place(model, [*fixed, *[name] * (k + 1)])
        except errors.MigpilotError:
            return k
        k += 1


class _HamiGpu:
    """HAMi's view of one GPU during planning: its instances and which are in use."""

    __slots__ = ("busy", "gpu", "layout", "used_compute", "used_slots")

    def __init__(self, gpu: snapshot.Gpu, layout: set[Instance], busy: set[Instance]) -> None:
        self.gpu = gpu
        self.layout = layout
        self.busy: set[Instance] = set()
        """Instances a pod holds: in use in the snapshot or given to a pod by this plan."""
        self.used_compute = self.used_slots = 0
        for inst in busy:
            self.hold(inst)

    def hold(self, inst: Instance) -> None:
        """Mark an instance as held by a pod."""
        compute, slots, _ = _shape(self.gpu.model, inst.profile)
        self.busy.add(inst)
        self.used_compute += compute
        self.used_slots += slots

    def copy(self) -> _HamiGpu:
        twin = _HamiGpu.__new__(_HamiGpu)
        twin.gpu, twin.layout, twin.busy = self.gpu, set(self.layout), set(self.busy)
        twin.used_compute, twin.used_slots = self.used_compute, self.used_slots
        return twin


Choice = tuple[frozenset[Instance] | None, Instance]
"""What HAMi does to give a pod one instance: the GPU's new layout (``None``: unchanged) and
the instance the pod gets."""

Chooser = Callable[[_HamiGpu, str], Choice | None]
"""Where HAMi would give one instance of a canonical profile on this GPU, without changing it."""

Menu = Callable[[profiles.GpuModel], tuple[str, ...]]
"""The profiles HAMi's configuration may hand out on a model (allowlist or templates)."""


def _hami_names(
    pod: snapshot.Pod, model: profiles.GpuModel, *, menu: Menu
) -> tuple[tuple[str, ...], ...]:
    """Per part of the pod's request, the profiles HAMi may give one instance of it on ``model``,
    in the order it tries them: a MIG request's own profile (exact name); for a unified request
    the profiles of ``menu`` that serve the container's ask, smallest (memory, then slices)
    first, as hami:pkg/device/nvidia/device.go ``selectMigCandidate`` sorts them."""
    if pod.unified is None:
        return tuple(() if (n := _requested(model, r.profile)) is None else (n,) for r in pod.mig)
    return _unified_names(pod.unified, model, menu(model))


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _unified_names(
    request: unified.UnifiedRequest, model: profiles.GpuModel, menu: tuple[str, ...]
) -> tuple[tuple[str, ...], ...]:
    if not unified.allowed(request, model):
        return tuple(() for _ in request.asks)
    out = []
    for ask in request.asks:
        fit = [p for p in map(model.profile_named, menu) if unified.serves(ask, model, p)]
        fit.sort(key=lambda p: (p.memory_mib or 0, p.compute_slices, p.name))
        out.append(tuple(p.name for p in fit))
    return tuple(out)


def _choose_from_template(g: _HamiGpu, name: str) -> Choice | None:
    """HAMi <= v2.9 (hami:pkg/device/nvidia/device.go ``CustomFilterRule``, ``migNeedsReset``,
    ``AddResourceUsage``; hami:pkg/device/devices.go ``PlatternMIG``).

    A GPU with no instance in use takes the first template, in config order, that has an entry
    at least as big (memory) as the request, and mig-parted applies it: every instance on the
    GPU is destroyed and the template created (nothing happens if the GPU already holds that
    multiset). A GPU with instances in use keeps its layout and hands out its free instances.
    """
    model = g.gpu.model
    layout: frozenset[Instance] | None = None
    if not g.busy:
        tmpl = _template_for(model, name)
        if tmpl is None:
            return None
        if Counter(i.profile for i in g.layout) != Counter(tmpl.counts):
            layout = frozenset(tmpl.layout.instances)
    for inst in sorted(g.layout if layout is None else layout):
        if inst.profile == name and inst not in g.busy:
            return layout, inst
    return None


@functools.lru_cache(maxsize=_MEMO_SIZE)
def _template_for(model: profiles.GpuModel, name: str) -> HamiTemplate | None:
    """The template an idle GPU takes for a request of ``name``, if it holds ``name`` at all."""
    mib = _shape(model, name)[2]
    tmpl = next((t for t in hami_templates(model) if t.largest_mib >= mib), None)
    return tmpl if tmpl is not None and name in tmpl.counts else None


def _overlaps(model: profiles.GpuModel, *, a: Instance, b: Instance) -> bool:
    sa, sb = _shape(model, a.profile)[1], _shape(model, b.profile)[1]
    return a.start < b.start + sb and b.start < a.start + sa


def _choose_placement(g: _HamiGpu, name: str) -> Choice | None:
    """HAMi v2.10 (hami:pkg/device/nvidia/mig_topology.go ``selectMigPlacement``,
    ``preferHighMigPlacement``; hami:pkg/device/nvidia/device.go ``selectMigCandidate``).

    The profile must be allowlisted (:func:`hami_profiles`); its placements are tried from the
    highest start for 1g and 3g profiles, from the lowest otherwise, and the first one that
    overlaps no instance held by a pod is reserved. Free instances no pod holds are invisible
    to the scheduler (they are not reservations). A placement the hardware would refuse for
    another reason (compute or instance count) is skipped as well.
    """
    model = g.gpu.model
    if name not in hami_profiles(model):
        return None
    prof = model.profile_named(name)
    starts = sorted(prof.placements, reverse=prof.compute_slices in (1, 3))
    busy = list(g.busy)
    for start in starts:
        inst = Instance(start, name)
        if any(_overlaps(model, a=inst, b=b) for b in busy):
            continue
        if layouts.violation(model, [*busy, inst]) is not None:
            continue
        return None, inst
    return None


def _gpu_score(g: _HamiGpu, *, name: str | None, count: int) -> float:
    """hami:pkg/scheduler/policy/gpu_policy.go ``ComputeScore``, with MIG usage counted in
    instances, compute slices and memory slots, the request included."""
    model = g.gpu.model
    rc, rm = (_shape(model, name)[:2]) if name is not None else (0, 0)
    return 10 * (
        (len(g.busy) + count) / model.max_gpu_instances
        + (g.used_compute + rc) / model.compute_slices
        + (g.used_slots + rm) / model.memory_slots
    )


def _node_score(gpus: Sequence[_HamiGpu]) -> float:
    """hami:pkg/scheduler/policy/node_policy.go ``ComputeDefaultScore`` (usage before the pod)."""
    if not gpus:
        return 0.0
    n = c = m = tn = tc = tm = 0
    for g in gpus:
        n, c, m = n + len(g.busy), c + g.used_compute, m + g.used_slots
        tn += g.gpu.model.max_gpu_instances
        tc += g.gpu.model.compute_slices
        tm += g.gpu.model.memory_slots
    return 10 * (n / tn + c / tc + m / tm)


def _hami_fit(
    gpus: Sequence[_HamiGpu],
    pod: snapshot.Pod,
    *,
    choose: Chooser,
    menu: Menu,
    policy: scoring.Policy,
) -> tuple[list[_HamiGpu], list[plans.AssignedInstance]] | None:
    """HAMi's ``Fit`` on one node: every request of the pod, on copies of the node's GPUs.

    Each ``nvidia.com/mig-P: n`` request (or unified container asking ``nvidia.com/gpu: n``) is
    a container asking for n devices: GPUs are tried in the pod's GPU policy (the chart's default
    is spread: least-used score first; binpack: most used first; ties to the lower index), and
    in MIG mode a GPU that gave one instance is asked again before moving on. A unified ask
    takes, on each GPU, the first of :func:`_hami_names` that has room.
    """
    trial = list(gpus)
    copied = [False] * len(trial)
    assigned: list[plans.AssignedInstance] = []
    sign = -1 if policy is scoring.Policy.BINPACK else 1
    for part, count in enumerate(pod.parts):
        need = count
        names = [_hami_names(pod, g.gpu.model, menu=menu)[part] for g in trial]
        order = sorted(
            range(len(trial)),
            key=lambda k: (
                sign * _gpu_score(trial[k], name=names[k][0] if names[k] else None, count=count),
                trial[k].gpu.index,
            ),
        )
        for k in order:
            if not names[k]:
                continue
            while need:
                choice = None
                for name in names[k]:
                    choice = choose(trial[k], name)
                    if choice is not None:
                        break
                if choice is None:
                    break
                if not copied[k]:
                    trial[k], copied[k] = trial[k].copy(), True
                layout, inst = choice
                if layout is not None:
                    trial[k].layout = set(layout)
                trial[k].hold(inst)
                assigned.append(
                    plans.AssignedInstance(trial[k].gpu.index, inst.profile, inst.start)
                )
                need -= 1
            if not need:
                break
        if need:
            return None
    return trial, assigned


def _hami_schedule(
    snap: snapshot.Snapshot, choose: Chooser, *, menu: Menu
) -> tuple[dict[str, list[_HamiGpu]], list[plans.Placement]]:
    """HAMi's scheduler extender, one pod at a time in queue order.

    kube-scheduler first filters nodes (admission, CPU, memory); HAMi then keeps the nodes whose
    GPUs fit the pod and picks by node score (hami:pkg/scheduler/scheduler.go ``Filter``,
    hami:pkg/scheduler/score.go ``calcScore``, hami:pkg/scheduler/policy/node_policy.go;
    defaults from hami:charts/hami/values.yaml ``scheduler.defaultSchedulerPolicy``): the
    chart's default node policy is binpack (the most used node); the snapshot's ``policy:
    spread`` selects HAMi's spread, and a pod's own ``hami.io/node-scheduler-policy`` overrides
    both. Ties, which Go's unstable sort leaves open, go to the first node by name.
    """
    nodes = sorted(snap.nodes, key=lambda n: n.name)
    state = [
        [
            _HamiGpu(g, set(g.layout.instances), {i.instance for i in g.instances if i.used})
            for g in sorted(n.gpus, key=lambda g: g.index)
        ]
        for n in nodes
    ]
    sign = -1 if snap.policy is snapshot.Policy.BINPACK else 1
    keys = [(sign * _node_score(gpus), k) for k, gpus in enumerate(state)]
    order = sorted(keys)
    """Nodes best first: (signed score, name position), kept sorted as scores change."""
    admitted = _Admitted(nodes)
    models = [tuple({g.model.id: g.model for g in n.gpus}.values()) for n in nodes]
    left: list[list[int] | None] = [
        None if n.allocatable is None else [n.allocatable.cpu_milli, n.allocatable.memory_bytes]
        for n in nodes
    ]
    version = [0] * len(nodes)
    no_fit: list[tuple[int, set[snapshot.Demand]]] = [(0, set()) for _ in nodes]
    """Per node: the requests it could not fit at that version of its state."""
    candidates: dict[tuple[object, ...], frozenset[int]] = {}
    placements: list[plans.Placement] = []
    for pod in _ordered_pods(snap):
        demand, cpu, mem = pod.demand, pod.cpu_milli, pod.memory_bytes
        key = (constraints.signature(pod), demand)
        cands = candidates.get(key)
        if cands is None:
            # Nodes that admit the pod and have a GPU model offering each part of its request.
            parts = range(len(pod.parts))
            cands = candidates[key] = frozenset(
                k
                for k in admitted.indices(pod)
                if all(any(_hami_names(pod, m, menu=menu)[i] for m in models[k]) for i in parts)
            )
        if not cands:
            continue
        node_policy, gpu_policy = pod.policies(snap)
        # Best node first: a few candidates are sorted, many are filtered lazily from the kept
        # order (the loop stops at the first node that fits, before the order changes). A pod
        # with the other node policy than the snapshot's ranks the candidates its own way.
        ranked: Iterable[int]
        if (node_policy is scoring.Policy.BINPACK) != (sign == -1):
            ranked = sorted(cands, key=lambda k: (-keys[k][0], k))
        elif 8 * len(cands) < len(order):
            ranked = sorted(cands, key=keys.__getitem__)
        else:
            ranked = (k for _, k in order if k in cands)
        for k in ranked:
            room = left[k]
            if room is not None and (cpu > room[0] or mem > room[1]):
                continue
            seen, failed = no_fit[k]
            if seen == version[k] and demand in failed:
                continue
            fit = _hami_fit(state[k], pod, choose=choose, menu=menu, policy=gpu_policy)
            if fit is None:
                if seen != version[k]:
                    no_fit[k] = (version[k], set())
                no_fit[k][1].add(demand)
                continue
            state[k] = fit[0]
            version[k] += 1
            order.remove(keys[k])
            keys[k] = (sign * _node_score(fit[0]), k)
            bisect.insort(order, keys[k])
            if room is not None:
                room[0] -= cpu
                room[1] -= mem
            placements.append(plans.Placement(pod.key, nodes[k].name, tuple(fit[1])))
            break
    return {n.name: gpus for n, gpus in zip(nodes, state, strict=True)}, placements


def _hami_notes(
    snap: snapshot.Snapshot, *, offered: Callable[[profiles.GpuModel], Iterable[str]], what: str
) -> Callable[[snapshot.Pod, str], str]:
    """Reasons for pods asking a profile HAMi's configuration never creates on the cluster."""

    def notes(pod: snapshot.Pod, reason: str) -> str:
        for req in pod.mig:
            models = [m for m in snap.models if _requested(m, req.profile) is not None]
            if models and all(_requested(m, req.profile) not in set(offered(m)) for m in models):
                have = "; ".join(f"{m.id}: {', '.join(offered(m)) or 'none'}" for m in models)
                return f"HAMi's {what} offers no {req.profile} ({have})"
        return reason

    return notes


def hami_template(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """HAMi up to v2.9: per-model MIG templates, chosen per GPU and held while it is in use.

    Pods in queue order; node and GPU choice as in :func:`_hami_schedule` and
    :func:`_hami_fit`; per GPU :func:`_choose_from_template`. Templates per model:
    :func:`hami_templates`. The characteristic weakness (HAMi issue #948): a GPU that holds a
    template keeps it until no instance on it is in use, so a request of another size waits
    even when the GPU has room for it.

    Each ``nvidia.com/mig-P: n`` request is one HAMi container request, so an idle GPU picks
    its template for the request it serves first (HAMi decides per container, not per pod).
    mig-parted re-creates every instance of a GPU it reconfigures; a plan only shows the net
    change, so instances a template happens to keep in place count as kept.

    Where our framework cannot follow HAMi exactly: HAMi requests are memory amounts and HAMi
    may hand a pod a larger instance than it needs (the first free slot big enough, or the
    first big-enough entry of a template); a plan gives a pod exactly the profiles it asked for,
    so here a pod takes a free instance of its own profile and a GPU without one does not serve
    it. A profile no template contains (4g on A100, +me, 1g.20gb...) is never served, and the
    pod's reason says so.
    """

    def offered(model: profiles.GpuModel) -> tuple[str, ...]:
        return tuple(dict.fromkeys(n for t in hami_templates(model) for n in t.counts))

    state, placements = _hami_schedule(snap, _choose_from_template, menu=offered)
    targets = {
        (name, g.gpu.index): layouts.Layout.of(g.layout) for name, gs in state.items() for g in gs
    }

    return _finish(
        snap,
        opts,
        planner="hami-template",
        targets=targets,
        placements=placements,
        notes=_hami_notes(snap, offered=offered, what="MIG template configuration"),
    )


def hami_placement(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    """HAMi v2.10: one pod at a time, each instance at the first free legal placement.

    Pods in queue order, node and GPU choice as in :func:`_hami_schedule` and :func:`_hami_fit`,
    per instance :func:`_choose_placement`. HAMi never looks at the other pending pods and never
    moves anything: one small pod placed first can leave no room for a large one.

    Free instances: HAMi's scheduler only sees reservations held by pods, and its device
    plugin converges every managed GPU to the active reservations (the reconciler of
    hami:docs/develop/mig-dynamic-deallocate.md, "Lifecycle reconciliation"; idle GPUs are reset
    to "MIG enabled, no partitions" at start-up). So every free instance in the snapshot, on
    every GPU, is destroyed, and each target layout is exactly the instances in use plus those
    reserved for pods. (Newer HAMi keeps idle instances for reuse, hami:docs/develop/
    dynamic-mig-lifecycle.md; that is not v2.10.)

    HAMi picks the smallest allowlisted profile whose memory covers the request and moves up to
    a larger one when it has no free placement. For a ``nvidia.com/mig-*`` request the request
    is a profile, so a pod gets exactly that profile (it is the smallest covering one whenever
    it is allowlisted) and a GPU without a free placement for it does not serve it. A unified
    request is served as HAMi serves it: per container, on each GPU in policy order, the
    smallest allowlisted profile with the memory asked that has a free placement
    (:func:`_hami_names`). Two differences from HAMi, both so that the plan gives the pod what
    it asked: compute slices asked with ``nvidia.com/gpucores`` must be covered too (HAMi's MIG
    choice looks at memory only), and a GPU's memory is its largest profile's (HAMi takes NVML's
    total, a little more, for ``gpumem-percentage``).
    """
    state, placements = _hami_schedule(snap, _choose_placement, menu=hami_profiles)
    targets = {
        (name, g.gpu.index): layouts.Layout.of(g.busy) for name, gs in state.items() for g in gs
    }
    return _finish(
        snap,
        opts,
        planner="hami-placement",
        targets=targets,
        placements=placements,
        notes=_hami_notes(snap, offered=hami_profiles, what="migProfileAllowlist"),
    )
