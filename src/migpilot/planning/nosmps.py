"""nos's dynamic MPS partitioning, re-implemented as the baseline for nodes in mode mps.

Why it exists: the issue asks for MPS slices of any size "as nos did, planned better". That
claim is only worth something if nos's own MPS partitioner runs on the same snapshot, under the
same validator and in the same simulator as migpilot's (:mod:`migpilot.planning.sharing`). This
module is that baseline: :func:`place` has the signature of :func:`sharing.place` and the
``nos`` planner (:data:`migpilot.planning.planners.PLANNERS`) uses it for the MPS and
time-slicing nodes beside the MIG baseline :func:`migpilot.planning.baselines.nos`.

What nos does, read from github.com/nebuly-ai/nos (main, last commit April 2024; files cited
as ``nos:path``; the code here is ours, the algorithm was read, not copied):

- kube-scheduler binds a pod asking ``nvidia.com/gpu-<N>gb: k`` to free slices of exactly that
  size; nos acts only on the pods left pending.
- The planner is the one nos shares with MIG (nos:internal/partitioning/core/planner.go
  ``Plan``, tracker.go, snapshot.go, util.go) over MPS nodes (nos:pkg/gpu/slicing/node.go,
  gpu.go; nos:internal/partitioning/mps/*.go). A pod *lacks* a size when the whole cluster has
  fewer free slices of it than the pod asks, each pod judged alone; nothing happens if no pod
  lacks anything. Pods are sorted by priority, then smaller slices first (stable). Candidate
  nodes (a free slice or at least ``MinSliceMemoryGB`` = 1 GB not sliced) are visited in name
  order (nos: Go map order, then a stable sort by name). On each, GPUs in index order update
  their geometry for what the node still lacks (``GPU.UpdateGeometryFor``): the missing sizes,
  smallest first, are created in spare memory; then *every free slice the GPU had* is dropped
  and more missing slices are created in the room freed; then the dropped slices are put back,
  one size at a time, where memory is left (Go map order; here smallest size first). So nos
  does remove free slices to make room, without counting what that costs, and it never
  shrinks or removes a slice in use. (Dropping a size also drops slices of that size created a
  moment before: nos's ``delete(g.FreeProfiles, k)``; kept as nos does it.) Then every sorted
  pod is tried on the node: still lacking cluster-wide? admitted by the node (selector,
  affinity, taints, CPU, memory, slices of the node)? and all of its slices free on *one* GPU
  (``GPU.AddPod``)? A node on which no pod was added is reverted. A pod added on one node is
  tried again on later ones, as nos's loop does.
- nos's partitioner (nos:internal/partitioning/mps/partitioner.go) writes each node's new
  geometry as NVIDIA device-plugin MPS replicas per GPU; the plugin then advertises them and
  kube-scheduler binds. Here: per GPU, free slices of a size the geometry keeps are reused
  (lowest id first), the other free slices removed, the missing ones created; then the pending
  pods are bound again (first fit: nodes in name order, GPUs in index order, lowest id first).

Where this baseline adds or chooses, each on the generous side for nos:

- nos checks no client limit; the MPS server refuses the 49th client, so slices are created
  only while a GPU has fewer than :data:`sharing_config.MPS_MAX_CLIENTS` (the validator
  requires it).
- nos knows only ``nvidia.com/gpu-<N>gb``. A unified request of one GPU (``nvidia.com/gpu: 1``
  with ``gpumem`` or ``gpumem-percentage``, no ``gpucores``: nos's slices have no compute
  share) is read as the ``nvidia.com/gpu-<N>gb: 1`` a nos user would write for it, N its
  memory rounded up to whole GB (:func:`modes.unified_gb`), so one trace runs under both
  planners. A ``gpumem-percentage`` has one such N only when every MPS GPU of the cluster has
  the same memory; where they differ, no one name serves it and nos leaves the pod alone.
  HAMi's model filters are ignored (nos has none). Other unified requests are not served on MPS
  nodes, nor is one whose ``nvidia.com/vgpu-mode`` is ``mig`` (the user asked for MIG).
- Time-slicing nodes are not nos's: NVIDIA's device plugin advertises ``replicas`` shares of
  ``nvidia.com/gpu`` and kube-scheduler binds them. A unified request is read as
  ``nvidia.com/gpu: <count>`` and bound first fit (nodes in name order, one replica per GPU
  asked, distinct GPUs, lowest index first); a node of either mode may take a pod, whichever
  comes first in name order, unless the pod's ``nvidia.com/vgpu-mode`` names the other mode.

Not modelled: the batch window, device-plugin restarts (nos rewrites every node's config on
each plan), Go's map order, nodes mixing GPU models.

Pure: no clock, no randomness. May import the planning core (snapshot, constraints, modes,
plans, sharing for its result type); never a planner.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from migpilot.planning import constraints, modes, plans, sharing, snapshot
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

MIN_SLICE_GB = 1
"""nos:pkg/gpu/slicing/constant.go ``MinSliceMemoryGB``."""

Need = Counter[int]
"""Slices a pod asks, per size in GB."""


@dataclass(slots=True)
class NosGpu:
    """nos's view of one MPS GPU (nos:pkg/gpu/slicing/gpu.go): slice counts per size in GB."""

    index: int
    memory_gb: int
    used: Counter[int]
    free: Counter[int]

    def copy(self) -> NosGpu:
        return NosGpu(self.index, self.memory_gb, Counter(self.used), Counter(self.free))

    def sliced_gb(self) -> int:
        return sum(s * n for s, n in (self.used + self.free).items())

    def clients(self) -> int:
        return sum((self.used + self.free).values())

    def can_create_more(self) -> bool:
        """``canCreateMoreSlices``: room for the smallest slice (and, ours, a client left)."""
        return (
            self.memory_gb - self.sliced_gb() >= MIN_SLICE_GB
            and self.clients() < sharing_config.MPS_MAX_CLIENTS
        )

    def create(self, size: int, num: int = 1) -> bool:
        """``createSlices``: all ``num`` slices of ``size`` GB, or none."""
        if self.memory_gb - self.sliced_gb() < size * num:
            return False
        if self.clients() + num > sharing_config.MPS_MAX_CLIENTS:
            return False
        self.free[size] += num
        return True

    def update_for(self, required: Mapping[int, int]) -> bool:
        """``GPU.UpdateGeometryFor``: create as many of the ``required`` slices as nos does."""
        missing = {s: q - self.free[s] for s, q in required.items() if q > self.free[s]}
        if not missing:
            return False
        updated = False
        original = +Counter(self.free)
        for size in sorted(missing):
            if self.can_create_more():
                for _ in range(missing[size]):
                    if not self.create(size):
                        break
                    missing[size] -= 1
                    updated = True
            for k in original:
                self.free.pop(k, None)
            for _ in range(missing[size]):
                if not self.can_create_more() or not self.create(size):
                    break
                missing[size] -= 1
                updated = True
            for k in sorted(original):
                self.create(k, original[k])
        return updated

    def can_host(self, need: Need) -> bool:
        return all(self.free[s] >= q for s, q in need.items())

    def add_pod(self, need: Need) -> None:
        """``GPU.AddPod``: the pod's slices move from free to used."""
        for s, q in need.items():
            self.free[s] -= q
            self.used[s] += q


def needs(pod: snapshot.Pod, reference: int | None) -> Need | None:
    """The slices nos sees ``pod`` ask, per size (``None``: nos serves it on no MPS node);
    ``reference``: the GB of every MPS GPU of the cluster, which a ``gpumem-percentage`` is
    read against (``None``: no MPS GPU, or MPS GPUs of different memory)."""
    if pod.mig:
        return None
    if pod.mps:
        return Counter({r.memory_gb: r.count for r in pod.mps})
    request = pod.unified
    if request is None or request.count != 1 or not pod.served_in(modes.Mode.MPS):
        return None
    (ask,) = request.asks
    if ask.cores_percent is not None:
        return None
    if ask.memory_mib is not None:
        gb = -(-ask.memory_mib // 1024)
    elif reference is None:
        return None
    else:
        pct = 100 if ask.memory_percent is None else ask.memory_percent
        gb = -(-pct * reference // 100)
    return Counter({max(1, gb): 1})


@dataclass(slots=True)
class _Slots:
    """The real slices of one MPS GPU while pods are bound: free ones by id, and the next id."""

    gpu: snapshot.Gpu
    slices: dict[int, modes.MpsSlice]
    free: list[int]
    next_id: int


class _Run:
    """One planning round over the snapshot's MPS and time-slicing nodes."""

    def __init__(self, snap: snapshot.Snapshot, pods: Sequence[snapshot.Pod]) -> None:
        shared = (modes.Mode.MPS, modes.Mode.TIME_SLICING)
        self.nodes = sorted((n for n in snap.nodes if n.mode in shared), key=lambda n: n.name)
        self.admission = constraints.Admission(self.nodes)
        self.left = {
            n.name: (
                (n.allocatable.cpu_milli, n.allocatable.memory_bytes) if n.allocatable else None
            )
            for n in self.nodes
        }
        self.slots: dict[str, list[_Slots]] = {}
        self.replicas: dict[str, list[int]] = {}
        for n in self.nodes:
            if n.mode is modes.Mode.MPS:
                self.slots[n.name] = [
                    _Slots(
                        g,
                        {s.id: s for s in g.mps},
                        sorted(s.id for s in g.mps if not s.taken),
                        max((s.id for s in g.mps), default=-1) + 1,
                    )
                    for g in sorted(n.gpus, key=lambda g: g.index)
                ]
            else:
                self.replicas[n.name] = [g.replicas - g.replicas_used for g in n.gpus]
        sizes = {
            sharing_mps.memory_gb(g.model)
            for n in self.nodes
            if n.mode is modes.Mode.MPS
            for g in n.gpus
        }
        reference = next(iter(sizes)) if len(sizes) == 1 else None
        self.need = {p.key: needs(p, reference) for p in pods}
        self.pods = sorted(pods, key=lambda p: -p.priority)  # queue order, stable
        self.placements: list[plans.Placement] = []
        self.actions: list[plans.SliceAction] = []
        self.changed: set[tuple[str, int]] = set()

    # -- kube-scheduler

    def _fits(self, k: int, pod: snapshot.Pod) -> bool:
        left = self.left[self.nodes[k].name]
        return left is None or (pod.cpu_milli <= left[0] and pod.memory_bytes <= left[1])

    def _take(self, node: str, pod: snapshot.Pod) -> None:
        left = self.left[node]
        if left is not None:
            self.left[node] = (left[0] - pod.cpu_milli, left[1] - pod.memory_bytes)

    def _mps_shares(self, node: str, need: Need) -> list[plans.AssignedShare] | None:
        """Free slices of the node for ``need`` (GPUs in index order, lowest id first)."""
        picks: list[tuple[_Slots, int]] = []
        for size, count in sorted(need.items()):
            got = 0
            for sl in self.slots[node]:
                for sid in sl.free:
                    if got < count and sl.slices[sid].memory_gb == size:
                        picks.append((sl, sid))
                        got += 1
            if got < count:
                return None
        for sl, sid in picks:
            sl.free.remove(sid)
        return [
            plans.AssignedShare(sl.gpu.index, sid, sl.slices[sid].memory_gb) for sl, sid in picks
        ]

    def _ts_shares(
        self, node: snapshot.Node, pod: snapshot.Pod
    ) -> list[plans.AssignedShare] | None:
        """One replica per GPU asked, distinct GPUs per container, lowest index first."""
        if pod.unified is None or not pod.served_in(node.mode):
            return None
        free = list(self.replicas[node.name])
        chosen: list[int] = []
        for ask in pod.unified.asks:
            ks = [k for k, n in enumerate(free) if n > 0][: ask.count]
            if len(ks) < ask.count:
                return None
            for k in ks:
                free[k] -= 1
                chosen.append(k)
        self.replicas[node.name] = free
        return [plans.AssignedShare(node.gpus[k].index, None) for k in chosen]

    def bind(self, pods: Sequence[snapshot.Pod]) -> list[snapshot.Pod]:
        """Bind ``pods`` in queue order, each to the first node that has what it asks; the pods
        left pending."""
        left: list[snapshot.Pod] = []
        for pod in pods:
            admits = self.admission.admits(pod)
            for k, node in enumerate(self.nodes):
                if not admits[k] or not self._fits(k, pod):
                    continue
                need = self.need[pod.key]
                if node.mode is modes.Mode.MPS:
                    shares = self._mps_shares(node.name, need) if need else None
                else:
                    shares = self._ts_shares(node, pod)
                if shares is None:
                    continue
                self._take(node.name, pod)
                self.placements.append(plans.Placement(pod.key, node.name, (), tuple(shares)))
                break
            else:
                left.append(pod)
        return left

    # -- nos's planner and partitioner

    def _nos_state(self) -> dict[str, list[NosGpu]]:
        out: dict[str, list[NosGpu]] = {}
        for name, gpus in self.slots.items():
            out[name] = []
            for sl in gpus:
                free = Counter(sl.slices[i].memory_gb for i in sl.free)
                used = Counter(s.memory_gb for s in sl.slices.values()) - free
                out[name].append(
                    NosGpu(sl.gpu.index, sharing_mps.memory_gb(sl.gpu.model), used, free)
                )
        return out

    def partition(self, pods: Sequence[snapshot.Pod]) -> dict[str, list[NosGpu]]:
        """nos's ``Plan``: the committed geometry of every node it changes."""
        state = self._nos_state()
        wanting = [(p, n) for p in pods if (n := self.need[p.key])]
        cluster_free: Counter[int] = Counter()
        for gpus in state.values():
            for g in gpus:
                cluster_free.update(g.free)
        lacking_of = {
            p.key: Counter({s: q - cluster_free[s] for s, q in n.items() if q > cluster_free[s]})
            for p, n in wanting
        }
        lacking: Counter[int] = Counter()
        for lack in lacking_of.values():
            lacking.update(lack)
        ordered = sorted(wanting, key=lambda pn: (-pn[0].priority, min(pn[1])))
        positions = {n.name: k for k, n in enumerate(self.nodes)}
        capacity = dict(self.left)
        committed: dict[str, list[NosGpu]] = {}
        for name in sorted(state):
            if not +lacking:
                break
            base = state[name]
            if not any(+g.free or g.can_create_more() for g in base):
                continue
            fork = [g.copy() for g in base]
            required = +lacking
            for g in fork:
                g.update_for(required)
                required = +(required - g.free)
            free = Counter(cluster_free)
            for g in base:
                free.subtract(g.free)
            for g in fork:
                free.update(g.free)
            trial = dict(capacity)
            k = positions[name]
            added = 0
            for pod, need in ordered:
                left = trial[name]
                if (
                    any(free[s] < q for s, q in need.items())
                    or not self.admission.admits(pod)[k]
                    or (left is not None
                        and (pod.cpu_milli > left[0] or pod.memory_bytes > left[1]))
                ):  # fmt: skip
                    continue
                gpu = next((g for g in fork if g.can_host(need)), None)
                if gpu is None:
                    continue
                gpu.add_pod(need)
                free.subtract(need)
                if left is not None:
                    trial[name] = (left[0] - pod.cpu_milli, left[1] - pod.memory_bytes)
                added += 1
                lacking.subtract(lacking_of[pod.key])
                lacking = +lacking
                lacking_of[pod.key] = Counter()
            if added:
                for g in base:
                    cluster_free.subtract(g.free)
                for g in fork:
                    cluster_free.update(g.free)
                state[name] = fork
                committed[name] = fork
                capacity = trial
        return committed

    def actuate(self, committed: Mapping[str, list[NosGpu]]) -> None:
        """The device plugin serves each committed geometry: free slices of a size it keeps stay
        (lowest id first), the other free slices go, the missing ones are created."""
        for name, gpus in committed.items():
            for sl, ng in zip(self.slots[name], gpus, strict=True):
                taken = Counter(s.memory_gb for i, s in sl.slices.items() if i not in sl.free)
                want = (ng.used + ng.free) - taken
                keep: list[int] = []
                for sid in sl.free:
                    size = sl.slices[sid].memory_gb
                    if want[size] > 0:
                        want[size] -= 1
                        keep.append(sid)
                        continue
                    self._act(
                        name,
                        sl,
                        op=plans.SliceOp.REMOVE,
                        sid=sid,
                        size=size,
                        why=f"free slice of {size} GB removed by nos's new geometry",
                    )
                    del sl.slices[sid]
                for size in sorted(+want):
                    for _ in range(want[size]):
                        sid = sl.next_id
                        sl.next_id += 1
                        sl.slices[sid] = modes.MpsSlice(sid, size)
                        keep.append(sid)
                        self._act(
                            name,
                            sl,
                            op=plans.SliceOp.CREATE,
                            sid=sid,
                            size=size,
                            why=f"slice of {size} GB created by nos's new geometry",
                        )
                sl.free = sorted(keep)

    def _act(
        self, node: str, sl: _Slots, *, op: plans.SliceOp, sid: int, size: int, why: str
    ) -> None:
        self.actions.append(plans.SliceAction(node, sl.gpu.index, op, sid, size, None, why))
        self.changed.add((node, sl.gpu.index))

    def result(self) -> sharing.Shared:
        gpus = [
            plans.MpsGpuPlan(
                name,
                sl.gpu.index,
                (name, sl.gpu.index) in self.changed,
                tuple(sl.slices[i] for i in sorted(sl.slices)),
            )
            for name in sorted(self.slots)
            for sl in self.slots[name]
        ]
        order = {op: k for k, op in enumerate((plans.SliceOp.REMOVE, plans.SliceOp.CREATE))}
        actions = sorted(self.actions, key=lambda a: (a.node, a.gpu, order[a.op]))
        return sharing.Shared(tuple(self.placements), tuple(gpus), tuple(actions))


def place(snap: snapshot.Snapshot, pods: list[snapshot.Pod]) -> sharing.Shared:
    """``pods`` on the snapshot's MPS and time-slicing nodes, as nos and kube-scheduler would
    (see the module docstring): bind to free slices and replicas, partition for the rest, bind
    again."""
    run = _Run(snap, pods)
    if not run.nodes:
        return run.result()
    pending = run.bind(run.pods)
    committed = run.partition(pending)
    run.actuate(committed)
    run.bind(pending)
    return run.result()
