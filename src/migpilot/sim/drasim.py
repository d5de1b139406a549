"""Replays a trace on DRA nodes: kube-scheduler's allocator uncurated, or steered by the planner.

Why it exists: issue 26 asks whether steering kube-scheduler's DRA allocation with migpilot's
planner serves more pods than publishing every MIG placement and letting the scheduler take the
first that fits, as NVIDIA's driver does. This module answers on a trace, side by side, with the
allocator of :mod:`migpilot.planning.draalloc`:

- **uncurated**: every placement is offered; a pod's claim is tried as it arrives, and pending
  claims again after every departure (a claim's deallocation requeues every pending pod), in
  the order kube-scheduler retries them: those whose backoff is over first, then those backing
  off, soonest done first (:mod:`migpilot.sim.queueing`; not the oldest first);
- **prioritized**: the same, but claims by memory are written as a ``firstAvailable`` list,
  smallest profile first (what a careful claim author can do without migpilot);
- **steered**: pods are gated (migpilot's webhook); a batch window after a change the planner
  (``fast``, as the controller runs it, with the node policy kube-scheduler's score stands for
  and GPUs packed) plans the gated pods on the cluster as it is (allocated placements are used
  instances); the node's free planned placements are listed first in its pool, in the device
  slice that sorts first (:attr:`Steering.ORDER`, the default), or every free placement outside
  the plan is tainted ``mig.migpilot.io/unplanned:NoSchedule`` (:attr:`Steering.TAINTS`, the
  first try); the planned pods are pinned to their planned node (a node affinity, as the
  controller pins them) and ungated, and the same allocator places them, in queue order. A
  device is not tied to a claim (a claim's spec cannot be changed once made), so a pod may take
  a placement planned for another pod on that node whose claim it also matches; under taints
  the other one then misses and is planned again (counted as :attr:`Result.steering_misses`),
  under order it takes another free placement if one fits. With
  :attr:`Settings.first_fit_check` a round is steered only when its plan serves more pods now
  than kube-scheduler's first fit would; otherwise the pods first fit serves are ungated and
  nothing is listed first.
  :attr:`Steering.BEST_FIT` gates nothing and plans nothing: the driver lists placements so
  that first fit is a best fit, after every change.

In both, a node is picked among those whose CPU, memory and allocation fit by kube-scheduler's
default ``NodeResourcesFit`` score (``LeastAllocated``) or ``MostAllocated``; ties go to the
first node (kube-scheduler breaks them at random; fixed here so runs are deterministic). Devices
are created when claims are prepared and destroyed when released, so a free placement costs
nothing and no time is modelled for it, in either variant.

Trace pods become claims (:func:`claims_from_trace`): each MIG request a request of one claim, by
profile or, for a seeded share of pods, by memory (``memory >= the profile's nominal GB``); a
pod's GPU-model node selector becomes a condition on the device's ``model`` attribute.

Pure core with mutable state inside one run, like :mod:`migpilot.sim.simulating`: no clock, no
I/O; randomness only from ``random.Random(seed)``.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from migpilot import errors
from migpilot.mig import profiles
from migpilot.planning import draalloc, draclaims, drasteering, modes, planners, plans, snapshot
from migpilot.planning import unified as unifying
from migpilot.sim import clusters, queueing, traces

PRODUCT_LABEL = "nvidia.com/gpu.product"
NAMESPACE = "default"
_GB = 10**9
_MIB = 2**20


class Variant(enum.StrEnum):
    """How devices are offered and claims written."""

    UNCURATED = "uncurated"
    PRIORITIZED = "prioritized"
    STEERED = "steered"


class Steering(enum.StrEnum):
    """How the steered variant offers the planner's placements to kube-scheduler."""

    TAINTS = "taints"
    """Every free placement outside the plan is tainted ``NoSchedule``: a claim gets a planned
    placement or none."""
    ORDER = "order"
    """Nothing is tainted; the planned placements are listed first in the node's pool (its
    first device slice), so first fit takes a planned placement when one fits the claim and
    any other free placement otherwise."""
    BEST_FIT = "best-fit"
    """No gating and no plan: pods go to kube-scheduler as they come, as uncurated, and the
    driver lists each node's placements so that first fit is a best fit
    (:func:`migpilot.planning.draalloc.best_fit`), listing them again after every change."""


class NodeScoring(enum.StrEnum):
    """kube-scheduler's ``NodeResourcesFit`` scoring strategy (CPU and memory)."""

    LEAST_ALLOCATED = "least-allocated"
    """The default: the node with the most CPU and memory left."""
    MOST_ALLOCATED = "most-allocated"


@dataclass(frozen=True, slots=True)
class Settings:
    """How a run publishes, scores and plans."""

    order: draalloc.DeviceOrder = draalloc.DeviceOrder.PROFILE
    scoring: NodeScoring = NodeScoring.LEAST_ALLOCATED
    batch_s: float = 1.0
    """Steered: the controller plans this long after a change with gated pods (its batch
    window), then ungates what it planned."""
    budget: int = draalloc.DEFAULT_BUDGET
    """Search steps per allocation attempt (the scheduler's filter timeout)."""
    planner: str = "fast"
    steering: Steering = Steering.ORDER
    """Steered: how the plan reaches the allocator."""
    node_policy: snapshot.Policy | None = None
    """Steered: the planner's node policy; ``None``: the one :attr:`scoring` stands for
    (``LeastAllocated`` spreads, ``MostAllocated`` packs). Binpack keeps whole nodes free,
    which serves pods of a whole node at the cost of many small pods on a loaded cluster."""
    gpu_policy: snapshot.Policy = snapshot.Policy.BINPACK
    """Steered: the planner's GPU policy among a node's GPUs; binpack keeps whole GPUs free
    for whole-GPU profiles (kube-scheduler has no such score)."""
    first_fit_check: bool = False
    """Steered (order or taints): before steering a round, predict what kube-scheduler's first
    fit would serve of the gated pods as the cluster stands (the controller's prediction,
    :func:`migpilot.planning.drasteering.first_fit`: this allocator model, the pods in queue
    order, over the smallest-first listing migpilot's driver publishes: what the controller
    sees, no future pod), and steer only if the plan serves more pods now;
    otherwise the round is first fit's: only the pods first fit serves are ungated, each
    pinned to the node first fit picks, and the listing is left plain (:attr:`order`
    ``PROFILE``) or first fit's placements are offered as a plan's would be (any other
    listing, so the round does not depend on it). ``False``: every round is steered. The
    plan never serves fewer pods now than first fit (``fast`` places the most pods), but when
    it serves as many its placements keep room (whole GPUs) that, on a loaded cluster, went to
    long multi-GPU pods and cost pods against first fit (docs/dra.md)."""
    aside: bool = False
    """Steered: set a DRA node aside for the one gated pod no node can take now, as the
    controller does (:func:`drasteering.set_aside`); ``bench_dra.py``'s ``steered`` runs do."""
    backoff: queueing.Backoff = queueing.KUBE_SCHEDULER
    """Uncurated, prioritized and best-fit: kube-scheduler's pod backoff, in trace seconds (its
    defaults: 1 s doubling to 10 s), which orders its retries after a departure
    (:mod:`migpilot.sim.queueing`). A replay compressed ``k`` times on a real control plane
    backs off ``k`` times longer in trace time: ``Backoff(k * 1.0, k * 10.0, k * 1.0)`` models
    it. :data:`queueing.NO_BACKOFF` retries in the order of the pods' last attempts."""
    drain: bool = False
    """Run until the last pod would have ended had it started at once (pods pending at the last
    arrival are then served late); ``False``: stop one batch window after the last arrival, so
    the figures are what the cluster did while the trace ran."""

    def planner_node_policy(self) -> snapshot.Policy:
        """The node policy the planner is given."""
        if self.node_policy is not None:
            return self.node_policy
        if self.scoring is NodeScoring.MOST_ALLOCATED:
            return snapshot.Policy.BINPACK
        return snapshot.Policy.SPREAD


@dataclass(frozen=True, slots=True)
class ClaimPod:
    """A trace pod as a DRA user writes it: one claim, and what the planner reads of it."""

    name: str
    arrival: float
    duration: float | None
    claim: draalloc.Claim
    cpu_milli: int
    memory_bytes: int
    by_memory: bool
    """Its claim selects devices by memory rather than by profile."""
    planned: snapshot.Pod
    """The pod as the planner reads it (MIG requests, or a unified request by memory)."""
    node_labels: tuple[tuple[str, str], ...] = ()
    """Node labels it still selects (its node selector without the GPU product)."""


def memory_mib(profile_name: str) -> int:
    """A profile's nominal memory as a claim writes it, ``quantity("<N>G")``, in MiB (rounded
    down): ``3g.40gb`` asks 40 GB, which every ``*.40gb`` instance holds."""
    return profiles.parse_profile_name(profile_name).gb * _GB // _MIB


def _product_models(cluster: clusters.Cluster) -> dict[str, str]:
    out: dict[str, str] = {}
    for node in cluster.nodes:
        product = node.labels.get(PRODUCT_LABEL)
        if product is not None:
            out[product] = node.model.id
    return out


def claims_from_trace(
    trace: traces.Trace,
    cluster: clusters.Cluster,
    *,
    memory_share: float,
    seed: int,
) -> tuple[tuple[ClaimPod, ...], int]:
    """The trace's MIG pods as claim pods, and how many pods were left out (unified or
    whole-GPU pods, which ask for no MIG profile by name).

    A pod asks by memory with probability ``memory_share`` (a seeded draw per pod, in trace
    order), otherwise by profile.
    """
    if not 0.0 <= memory_share <= 1.0:
        raise errors.MigpilotError(f"the share of claims by memory is 0..1, got {memory_share}")
    products = _product_models(cluster)
    rng = random.Random(seed)
    out: list[ClaimPod] = []
    skipped = 0
    for tp in trace.pods:
        if not tp.mig or tp.unified is not None or tp.whole:
            skipped += 1
            continue
        by_memory = rng.random() < memory_share
        model: str | None = None
        labels: list[tuple[str, str]] = []
        for key, value in tp.node_selector:
            if key == PRODUCT_LABEL:
                model = products.get(value, value)
            else:
                labels.append((key, value))
        requests: list[draalloc.Request] = []
        for r in tp.mig:
            if by_memory:
                sel = draclaims.Selector(min_memory_mib=memory_mib(r.profile), model=model)
            else:
                sel = draclaims.Selector(profile=r.profile, model=model)
            requests.append(draalloc.Request(r.count, (sel,)))
        # What the planner reads of the claim, as the controller reads a pod's claims.
        spec = draclaims.ClaimSpec(
            tuple(
                draclaims.Request(str(i), r.count, r.alternatives) for i, r in enumerate(requests)
            )
        )
        reqs = draclaims.planner_requests(
            (spec,), cpu_milli=tp.cpu_milli, memory_bytes=tp.memory_bytes, where=f"pod {tp.name}"
        ).requests
        planned = dataclasses.replace(
            snapshot.planned_pod(
                name=tp.name,
                namespace=NAMESPACE,
                requests=reqs,
                node_selector=dict(tp.node_selector),
                terms=tp.terms,
            ),
            dra=True,  # as the controller reads a pod whose claims are migpilot's
        )
        out.append(
            ClaimPod(
                name=tp.name,
                arrival=tp.arrival,
                duration=tp.duration,
                claim=draalloc.Claim(tuple(requests)),
                cpu_milli=tp.cpu_milli,
                memory_bytes=tp.memory_bytes,
                by_memory=by_memory,
                planned=planned,
                node_labels=tuple(labels),
            )
        )
    return tuple(out), skipped


@dataclass(frozen=True, slots=True)
class PodOutcome:
    """What became of one pod."""

    name: str
    arrival: float
    bound_at: float | None
    node: str | None
    devices: tuple[str, ...]
    oversized: int
    """Devices it got that are larger than the smallest profile fitting its claim (by memory)."""


@dataclass(frozen=True, slots=True)
class Result:
    """The figures of one run."""

    variant: Variant
    settings: Settings
    pods_total: int
    pods_served: int
    pods_by_memory: int
    served_by_memory: int
    oversized_devices: int
    """Devices given to claims by memory that are larger than the smallest fitting profile."""
    oversized_extra_slices: int
    """Compute slices those devices hold beyond the smallest fitting profile's."""
    allocation_ratio: float
    """Time-weighted share of the cluster's compute slices held by pods."""
    needed_ratio: float
    """The same, counting for a claim by memory only the compute slices of the smallest
    profile that fits it (what the pod needed; the rest is what oversizing cost)."""
    memory_ratio: float
    """Time-weighted share of the cluster's MIG memory held by pods."""
    pending_s: tuple[float, ...]
    """Per pod: from arrival to binding, or to the end for pods not served by then."""
    plan_rounds: int
    first_fit_rounds: int
    """Steered with :attr:`Settings.first_fit_check`: plan rounds left to first fit (the plan
    served no more pods now)."""
    steering_misses: int
    slice_writes: int
    """Steered: ResourceSlice updates the taints took (one per node whose taints changed)."""
    search_steps: int
    timeouts: int
    asides: int
    """Steered with :attr:`Settings.aside`: times a node was set aside for a pod."""
    end: float
    outcomes: tuple[PodOutcome, ...]

    def pending_percentile(self, q: float) -> float:
        """Nearest-rank percentile of :attr:`pending_s`."""
        if not self.pending_s:
            return 0.0
        ordered = sorted(self.pending_s)
        rank = max(1, math.ceil(q / 100.0 * len(ordered)))
        return ordered[min(rank, len(ordered)) - 1]


class _Node:
    def __init__(self, spec: clusters.NodeSpec, order: draalloc.DeviceOrder) -> None:
        self.spec = spec
        self.labels = {**spec.labels, modes.MODE_LABEL: modes.Mode.DRA.value}
        """Its labels as the controller reads a node in DRA mode."""
        self.pool = draalloc.publish(spec.name, spec.model, gpus=spec.gpus, order=order)
        self.walk = self.pool
        """The pool as the allocator walks it (order steering lists planned devices first)."""
        self.first_slice: frozenset[str] = frozenset()
        """Order steering: the devices published in the first device slice."""
        per_gpu = len(self.pool.devices) // spec.gpus
        self.gpus_per_slice = max(1, draalloc.MAX_SLICE_DEVICES // per_gpu)
        self.allocated: set[str] = set()
        self.cpu_free = spec.allocatable.cpu_milli
        self.mem_free = spec.allocatable.memory_bytes
        self.taints: draalloc.Taints = draalloc.NO_TAINTS
        self.version = 0


class _Pod:
    def __init__(self, cp: ClaimPod, index: int) -> None:
        self.cp = cp
        self.index = index
        self.bound_at: float | None = None
        self.node: _Node | None = None
        self.devices: tuple[draalloc.Device, ...] = ()
        self.claim = cp.claim
        self.oversized = 0
        self.extra = 0
        # kube-scheduler's queue: when it was added or last failed, and how often it failed.
        self.timestamp = cp.arrival
        self.seq = index
        self.attempts = 0


class _Kind(enum.IntEnum):
    DEPART = 0
    ARRIVE = 1
    PLAN = 2


class _Run:
    def __init__(
        self,
        pods: Sequence[ClaimPod],
        cluster: clusters.Cluster,
        variant: Variant,
        settings: Settings,
    ) -> None:
        self.variant = variant
        self.settings = settings
        self.models = tuple({n.model.id: n.model for n in cluster.nodes}.values())
        self.nodes = [_Node(spec, settings.order) for spec in cluster.nodes]
        self.pods = [_Pod(cp, i) for i, cp in enumerate(pods)]
        if variant is Variant.PRIORITIZED:
            for pod in self.pods:
                pod.claim = _prioritized(pod.claim, self.models)
        self.pending: dict[int, _Pod] = {}
        self.events: list[tuple[float, int, int, int]] = []
        self.seq = 0
        self.now = 0.0
        self.plan_due: float | None = None
        self.total_slices = sum(n.spec.model.compute_slices * n.spec.gpus for n in self.nodes)
        self.total_mib = sum(unifying.memory_mib(n.spec.model) * n.spec.gpus for n in self.nodes)
        self.held_slices = 0
        self.held_mib = 0
        self.area = 0.0
        self.memory_area = 0.0
        self.plan_rounds = 0
        self.first_fit_rounds = 0
        self.misses = 0
        self.aside: drasteering.Aside | None = None
        self.asides = 0
        self.slice_writes = 0
        self.steps = 0
        self.timeouts = 0
        # Orders the failed attempts of one round (they fail one after another).
        self.attempt_seq = len(pods)
        # (claim, node index, node version) -> devices or None: a claim tried again on a node
        # nothing changed on gets the same answer (kube-scheduler's queueing hints skip it too).
        self.tried: dict[tuple[draalloc.Claim, int, int], tuple[draalloc.Device, ...] | None] = {}
        self.first = min(p.arrival for p in pods)
        # One batch window past the last arrival, so that steering plans the last pod too.
        self.end = max(p.arrival for p in pods) + settings.batch_s
        if settings.drain:
            self.end = max(p.arrival + (p.duration or 0.0) for p in pods)
        self.held_extra = 0
        self.extra_area = 0.0
        self.gated = variant is Variant.STEERED and settings.steering is not Steering.BEST_FIT
        self.listing = variant is Variant.STEERED and settings.steering is Steering.BEST_FIT
        if self.listing:
            # Published best fit first from the start (the first publication is no update).
            for node in self.nodes:
                node.walk = draalloc.best_fit(node.pool, (), node.spec.model)

    # -- events

    def _push(self, t: float, kind: _Kind, index: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, int(kind), self.seq, index))

    def run(self) -> Result:
        for pod in self.pods:
            self._push(pod.cp.arrival, _Kind.ARRIVE, pod.index)
        while self.events and self.events[0][0] <= self.end:
            t, kind, _, index = heapq.heappop(self.events)
            self._advance(t)
            if kind == _Kind.ARRIVE:
                self.pending[index] = self.pods[index]
                if self.gated:
                    self._plan_soon()
                else:
                    self._try_pending(only=index)
            elif kind == _Kind.DEPART:
                self._depart(self.pods[index])
                if self.gated:
                    if self.pending:
                        self._plan_soon()
                else:
                    self._try_pending()
            else:
                self.plan_due = None
                self._plan_round()
        self._advance(self.end)
        return self._result()

    def _advance(self, t: float) -> None:
        if t > self.now:
            self.area += self.held_slices * (t - self.now)
            self.memory_area += self.held_mib * (t - self.now)
            self.extra_area += self.held_extra * (t - self.now)
            self.now = t

    def _plan_soon(self) -> None:
        due = self.now + self.settings.batch_s
        if self.plan_due is None or self.plan_due > due:
            self.plan_due = due
            self._push(due, _Kind.PLAN, -1)

    # -- the scheduler

    def _fits_node(self, pod: _Pod, node: _Node) -> bool:
        if pod.cp.cpu_milli > node.cpu_free or pod.cp.memory_bytes > node.mem_free:
            return False
        return all(node.spec.labels.get(k) == v for k, v in pod.cp.node_labels)

    def _allocate(self, pod: _Pod, i: int, node: _Node) -> tuple[draalloc.Device, ...] | None:
        key = (pod.claim, i, node.version)
        if key in self.tried:
            return self.tried[key]
        found = draalloc.allocate(
            node.walk,
            pod.claim,
            allocated=frozenset(node.allocated),
            taints=node.taints,
            budget=self.settings.budget,
        )
        self.steps += found.steps
        self.timeouts += int(found.timed_out)
        self.tried[key] = found.devices
        return found.devices

    def _score(self, pod: _Pod, node: _Node) -> float:
        return self._score_free(
            node, node.cpu_free - pod.cp.cpu_milli, node.mem_free - pod.cp.memory_bytes
        )

    def _score_free(self, node: _Node, cpu_left: int, mem_left: int) -> float:
        cap = node.spec.allocatable
        cpu = cpu_left / cap.cpu_milli if cap.cpu_milli else 0.0
        mem = mem_left / cap.memory_bytes if cap.memory_bytes else 0.0
        free = (cpu + mem) / 2
        return free if self.settings.scoring is NodeScoring.LEAST_ALLOCATED else -free

    def _schedule(self, pod: _Pod, *, pinned: str | None = None) -> bool:
        best: tuple[float, int, tuple[draalloc.Device, ...]] | None = None
        for i, node in enumerate(self.nodes):
            if pinned is not None and node.spec.name != pinned:
                continue
            if not self._fits_node(pod, node):
                continue
            devices = self._allocate(pod, i, node)
            if devices is None:
                continue
            score = self._score(pod, node)
            if best is None or score > best[0]:
                best = (score, i, devices)
        if best is None:
            return False
        self._bind(pod, self.nodes[best[1]], best[2])
        return True

    def _bind(self, pod: _Pod, node: _Node, devices: tuple[draalloc.Device, ...]) -> None:
        for d in devices:
            if d.name in node.allocated:
                raise AssertionError(f"{d.name} on {node.spec.name} allocated twice")
            node.allocated.add(d.name)
            self.held_slices += d.compute_slices
            self.held_mib += d.memory_mib
        node.cpu_free -= pod.cp.cpu_milli
        node.mem_free -= pod.cp.memory_bytes
        node.version += 1
        self._relist(node)
        pod.node, pod.devices, pod.bound_at = node, devices, self.now
        pod.oversized, pod.extra = self._oversized(pod)
        self.held_extra += pod.extra
        del self.pending[pod.index]
        if pod.cp.duration is not None:
            self._push(self.now + pod.cp.duration, _Kind.DEPART, pod.index)

    def _depart(self, pod: _Pod) -> None:
        node = pod.node
        assert node is not None
        for d in pod.devices:
            node.allocated.remove(d.name)
            self.held_slices -= d.compute_slices
            self.held_mib -= d.memory_mib
        node.cpu_free += pod.cp.cpu_milli
        node.mem_free += pod.cp.memory_bytes
        node.version += 1
        self._relist(node)
        self.held_extra -= pod.extra

    def _relist(self, node: _Node) -> None:
        if not self.listing:
            return
        walk = draalloc.best_fit(node.pool, node.allocated, node.spec.model)
        size = draalloc.MAX_SLICE_DEVICES
        old = [d.name for d in node.walk.devices]
        new = [d.name for d in walk.devices]
        changed = sum(1 for i in range(0, len(new), size) if new[i : i + size] != old[i : i + size])
        if changed:
            node.walk = walk
            self.slice_writes += changed

    def _try_pending(self, only: int | None = None) -> None:
        """Retry the pending pods as kube-scheduler does after an event: ``only`` the pod that
        just came (nothing changed for the others: a new claim requeues only its pod), else
        every pending pod (a departure deallocates a claim, which requeues them all), in
        :func:`queueing.retry_order`."""
        if only is not None:
            order = [only]
        else:
            order = queueing.retry_order(
                (
                    queueing.Waiting(p.index, p.cp.planned.priority, p.timestamp, p.seq, p.attempts)
                    for p in self.pending.values()
                ),
                now=self.now,
                backoff=self.settings.backoff,
            )
        for index in order:
            pod = self.pending[index]
            if not self._schedule(pod):
                pod.attempts += 1
                pod.timestamp = self.now
                self.attempt_seq += 1
                pod.seq = self.attempt_seq

    # -- steering

    def _node_snapshot(self, node: _Node) -> snapshot.Node:
        by_gpu: dict[int, list[snapshot.ExistingInstance]] = {}
        for name in node.allocated:
            d = node.pool.by_name[name]
            by_gpu.setdefault(d.gpu, []).append(snapshot.ExistingInstance(d.profile, d.start, True))
        gpus = tuple(
            snapshot.Gpu(
                i,
                node.spec.model,
                tuple(sorted(by_gpu.get(i, []), key=lambda e: e.start)),
                mig=True,
            )
            for i in range(node.spec.gpus)
        )
        return snapshot.Node(
            name=node.spec.name,
            labels=node.labels,
            taints=(),
            unschedulable=False,
            allocatable=snapshot.Resources(node.cpu_free, node.mem_free),
            gpus=gpus,
            capacity=node.spec.allocatable,
            mode=node.spec.mode,
        )

    def _plan_round(self) -> None:
        if not self.pending:
            return
        self.plan_rounds += 1
        gated = [self.pending[i] for i in sorted(self.pending)]
        snap = snapshot.Snapshot(
            nodes=tuple(self._node_snapshot(n) for n in self.nodes),
            pods=tuple(p.cp.planned for p in gated),
            policy=self.settings.planner_node_policy(),
            gpu_policy=self.settings.gpu_policy,
        )
        snap, plan = self._plan(snap, frozenset(p.cp.planned.key for p in gated))
        offered: dict[str, set[str]] = {n.spec.name: set() for n in self.nodes}
        for placement in plan.placements:
            for inst in placement.instances:
                offered[placement.node].add(
                    draalloc.device_name(inst.gpu, inst.profile, inst.start)
                )
        planned = {p.pod: p.node for p in plan.placements}
        plain = False
        if self.settings.first_fit_check:
            first_fit, steer = self._first_fit(gated, snap, plan)
            if not steer:
                # The plan serves no more pods now, nor keeps room first fit loses (the rule of
                # drasteering.Check.steer): the round is first fit's, over the
                # smallest-first listing migpilot's driver publishes. Where the pool is listed
                # so, nothing is listed first or tainted; otherwise first fit's placements are
                # offered as a plan's are.
                self.first_fit_rounds += 1
                plain = self.settings.order is draalloc.DeviceOrder.PROFILE
                offered = {n.spec.name: set() for n in self.nodes}
                planned = {}
                for index, (picked, devices) in first_fit.items():
                    planned[self.pods[index].cp.planned.key] = picked
                    if not plain:
                        offered[picked].update(devices)
        for node in self.nodes:
            if self.settings.steering is Steering.ORDER:
                self._list_first(node, offered[node.spec.name])
                continue
            taints = (
                draalloc.NO_TAINTS
                if plain
                else draalloc.steering_taints(
                    node.pool, offered=offered[node.spec.name], allocated=node.allocated
                )
            )
            changed = set(taints) ^ set(node.taints)
            if changed:
                node.taints = taints
                node.version += 1
                # One update per device slice (a GPU's slice) whose taints changed.
                self.slice_writes += len({self._home(node, d) for d in changed})
        served = missed = 0
        for pod in gated:
            there = planned.get(pod.cp.planned.key)
            if there is None:
                continue
            # The controller pins a pod to its planned node (a node affinity) as it ungates it.
            if self._schedule(pod, pinned=there):
                served += 1
            else:
                missed += 1
        self.misses += missed
        # A pod whose planned placement another took is planned again soon; each round serves
        # at least its first planned pod (nothing is taken before it), so this ends.
        if served and missed:
            self._plan_soon()

    def _plan(
        self, snap: snapshot.Snapshot, gated: frozenset[str]
    ) -> tuple[snapshot.Snapshot, plans.Plan]:
        """The round's plan, and the snapshot its first-fit check reads: with
        :attr:`Settings.aside`, the other pods kept off the node set aside while that costs
        none of them its place now, as :func:`migpilot.planning.control.reconcile` does."""

        def planner(s: snapshot.Snapshot) -> plans.Plan:
            return planners.run(s, self.settings.planner)

        if not self.settings.aside:
            return snap, planner(snap)
        aside = drasteering.plan_aside(snap, self.aside, gated, planner, lambda p: p)
        plan = aside.result
        before, self.aside = self.aside, aside.next(snap, plan, planner=planner)
        self.asides += self.aside is not None and self.aside != before
        used = aside.keeping(snap)
        return used, plan

    def _first_fit(
        self, gated: Sequence[_Pod], snap: snapshot.Snapshot, plan: plans.Plan
    ) -> tuple[dict[int, tuple[str, tuple[str, ...]]], bool]:
        """The controller's first-fit check (:func:`drasteering.check`) of ``plan`` over the
        cluster as the planner sees it (``snap``, whose pods are the gated ones): the pods
        kube-scheduler's first fit would serve now, ungated in queue order over the
        smallest-first listing with nothing tainted, with the node and devices each would get
        (by pod index), and whether the round is steered."""
        index = {p.cp.planned.key: p.index for p in gated}
        found = drasteering.check(
            snap,
            plan,
            gated=frozenset(index),
            claims={p.cp.planned.key: p.claim for p in gated},
            most_allocated=self.settings.scoring is NodeScoring.MOST_ALLOCATED,
            budget=self.settings.budget,
        )
        assert found is not None  # a round plans only with gated pods
        return {index[s.pod]: (s.node, s.devices) for s in found.first_fit}, found.steer

    def _list_first(self, node: _Node, offered: set[str]) -> None:
        # The first device slice holds the free planned placements. An allocated device stays
        # in the slice it is in (moving it would drop its counters for a moment), so the slice
        # keeps the allocated ones it had; a free one goes back to its GPU's slice.
        first = frozenset(
            {d for d in node.first_slice if d in node.allocated} | (offered - node.allocated)
        )
        moved = first ^ node.first_slice
        if not moved:
            return
        node.first_slice = first
        node.walk = draalloc.planned_first(node.pool, first)
        node.version += 1
        # The first slice, and each GPU slice a device left or joined (same pool generation:
        # a device leaves its old slice before it joins the new one, so it is never listed
        # twice, which would make the pool invalid).
        self.slice_writes += 1 + len({self._home(node, d) for d in moved})

    @staticmethod
    def _home(node: _Node, device: str) -> int:
        """The device slice a device is published in (a GPU's devices stay in one slice)."""
        return node.pool.by_name[device].gpu // node.gpus_per_slice

    # -- figures

    def _oversized(self, pod: _Pod) -> tuple[int, int]:
        if not pod.cp.by_memory:
            return 0, 0
        count = extra = 0
        devices = iter(pod.devices)
        for request in pod.cp.claim.requests:
            need = request.alternatives[0].min_memory_mib
            for _ in range(request.count):
                d = next(devices)
                model = next(m for m in self.models if m.id == d.model)
                smallest = unifying.profile_for(unifying.GpuAsk(count=1, memory_mib=need), model)
                if smallest is None:
                    continue
                best = model.profile_named(smallest)
                if (d.memory_mib, d.compute_slices) > ((best.memory_mib or 0), best.compute_slices):
                    count += 1
                    extra += d.compute_slices - best.compute_slices
        return count, extra

    def _result(self) -> Result:
        span = self.end - self.first
        outcomes: list[PodOutcome] = []
        pending: list[float] = []
        served = by_memory = served_memory = oversized = extra = 0
        for pod in self.pods:
            if pod.cp.arrival > self.end:
                continue
            by_memory += int(pod.cp.by_memory)
            if pod.bound_at is not None:
                served += 1
                served_memory += int(pod.cp.by_memory)
                pending.append(pod.bound_at - pod.cp.arrival)
                oversized += pod.oversized
                extra += pod.extra
            else:
                pending.append(max(self.end - pod.cp.arrival, 0.0))
            outcomes.append(
                PodOutcome(
                    name=pod.cp.name,
                    arrival=pod.cp.arrival,
                    bound_at=pod.bound_at,
                    node=pod.node.spec.name if pod.node is not None else None,
                    devices=tuple(d.name for d in pod.devices),
                    oversized=pod.oversized,
                )
            )
        return Result(
            variant=self.variant,
            settings=self.settings,
            pods_total=len(outcomes),
            pods_served=served,
            pods_by_memory=by_memory,
            served_by_memory=served_memory,
            oversized_devices=oversized,
            oversized_extra_slices=extra,
            allocation_ratio=self.area / (self.total_slices * span) if span > 0 else 0.0,
            needed_ratio=(
                (self.area - self.extra_area) / (self.total_slices * span) if span > 0 else 0.0
            ),
            memory_ratio=self.memory_area / (self.total_mib * span) if span > 0 else 0.0,
            pending_s=tuple(pending),
            plan_rounds=self.plan_rounds,
            first_fit_rounds=self.first_fit_rounds,
            steering_misses=self.misses,
            slice_writes=self.slice_writes,
            search_steps=self.steps,
            timeouts=self.timeouts,
            asides=self.asides,
            end=self.end,
            outcomes=tuple(outcomes),
        )


def _prioritized(claim: draalloc.Claim, models: Sequence[profiles.GpuModel]) -> draalloc.Claim:
    requests = tuple(
        dataclasses.replace(r, alternatives=draalloc.prioritized(r.alternatives[0], models))
        if len(r.alternatives) == 1
        else r
        for r in claim.requests
    )
    return dataclasses.replace(claim, requests=requests)


def run(
    pods: Sequence[ClaimPod],
    cluster: clusters.Cluster,
    variant: Variant,
    settings: Settings | None = None,
) -> Result:
    """Replay ``pods`` (arrival order) on ``cluster``'s nodes, all in DRA mode, under
    ``variant``: arrivals, and departures after each pod's duration once bound, until a batch
    window after the last arrival (:attr:`Settings.drain`: until the last pod would have
    ended)."""
    if not pods:
        raise errors.MigpilotError("no pod to replay")
    return _Run(pods, cluster, variant, settings or Settings()).run()
