"""The discrete-event simulator: a Kubernetes cluster with MIG GPUs on a virtual clock.

Events, in time order (ties in the order they were scheduled):

- **arrival**: a pod is created. The scheduler model (kube-scheduler's) tries it at once: a node
  fits when it advertises enough free, unreserved MIG instances of each profile the pod asks for
  and has the CPU and memory; among fitting nodes ``binpack`` takes the most allocated (compute
  slices held or reserved), ``spread`` the least; ties go to the first node. A pod no node could
  run even empty is rejected with a reason. Otherwise it waits.
- **plan**: a batch window after the first pod is left waiting (and after any later change), the
  partitioning policy is given a snapshot (every GPU with its instances, those held by pods,
  reserved or still being created marked *used*; every waiting pod) and returns a plan. Its
  actions run per GPU one after another: destroying an instance takes ``destroy_s``, creating one
  ``create_s``; a created instance is seen by the scheduler ``advertise_s`` after it exists. The
  plan's placements reserve instances (existing or to be created) and CPU/memory for their pods.
- **bind**: a pod whose reserved instances are all advertised is bound to them.
- **visible**: an instance created without a pod (nos creates whole geometries) is advertised;
  waiting pods are tried on its node.
- **departure** (faithful mode): the pod's run time after binding is over; its instances stay,
  free, and waiting pods are tried on that node.

Dynamic MIG mode (``docs/migmode.md``): on nodes labelled ``migpilot.io/mig-mode=dynamic``
(cluster groups ``@dynamic``) the loop's plan may switch an idle GPU's MIG mode
(:attr:`plans.Plan.switches`, planned by :mod:`migpilot.planning.dynamic` inside the loop's
step). A GPU switched out of MIG has its free instances destroyed first, then takes
``mode_switch_s`` (``mode_reset_s`` on a model whose mode change needs a GPU reset) and is
advertised ``advertise_s`` later as a whole GPU; whole-GPU pods (``nvidia.com/gpu: N`` alone)
are reserved and bound to whole GPUs, which are free again when they leave. A switch of a GPU
with an instance held or reserved, or a whole GPU held or reserved, is an invariant violation.

Two replay modes: ``faithful`` uses the trace's arrival times and run times and stops at the
trace's end; ``inflate`` (the method of Weng et al., ATC'23) submits pods in trace order,
``inflate_gap_s`` apart, with no departures, until the compute they request reaches
``inflate_fraction`` of the cluster's, and stops when nothing is left to happen.

Invariants are asserted on every event (:class:`InvariantViolation`, a bug, never a user error):
no instance is destroyed while a pod holds it or it is reserved, every target layout is valid,
every pod is bound at most once and is in exactly one state (not yet arrived, waiting, reserved,
running, finished or rejected), and the per-state counts add up to the trace. With ``paranoid``
the whole cluster is also recounted after every event (tests).

Pure core: no clock (the planner CPU time is measured by a ``cpu_clock`` the caller passes; the
default reads nothing and reports 0), no I/O, no randomness. May import :mod:`migpilot.errors`,
:mod:`migpilot.mig`, :mod:`migpilot.planning` and this package.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import heapq
import math
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from migpilot import errors
from migpilot.mig import layouts, profiles
from migpilot.planning import constraints, control, interpod, modes, plans, podaffinity, snapshot
from migpilot.planning import unified as unifying
from migpilot.sharing import mps as sharing_mps
from migpilot.sim import clusters, policies, traces

CpuClock = Callable[[], float]
Progress = Callable[[float], None]


class InvariantViolation(AssertionError):  # noqa: N818 - it is an assertion, named for what broke
    """The simulation broke one of its invariants: a bug in a policy or in the simulator."""


class Replay(enum.StrEnum):
    """How a trace is replayed."""

    FAITHFUL = "faithful"
    """The trace's arrival and run times; the cluster should be sized so it is busy."""
    INFLATE = "inflate"
    """Arrivals in trace order without departures until requests reach a share of the cluster."""


@dataclass(frozen=True, slots=True)
class Timing:
    """Modelled durations, in seconds of virtual time."""

    create_s: float = 0.1
    """Creating one GPU instance (measured on A100/H100 with nvidia-smi). Default 0.1."""
    destroy_s: float = 0.15
    """Destroying one GPU instance. Default 0.15."""
    advertise_s: float = 1.0
    """From an instance existing to the scheduler seeing it (device plugin, kubelet). Default 1."""
    batch_window_s: float = 1.0
    """How long waiting pods are collected before the policy plans. Default 1."""
    reservation_timeout_s: float = 60.0
    """How long a reservation may wait for its pod to be bound once its instances exist (ten
    times that before they exist) before it expires and the pod is planned again: the
    controller's ``--reservation-timeout``. Default 60."""
    inflate_gap_s: float = 0.2
    """Inflate mode: time between two arrivals. Default 0.2."""
    mode_switch_s: float = 1.0
    """Switching a GPU's MIG mode where no reset is needed (Hopper and later; not measured
    here). Default 1."""
    mode_reset_s: float = 30.0
    """Switching it where the catalog says a GPU reset is needed (Ampere:
    ``mig_mode_change_needs_reset``), the reset included. Default 30 (no public measurement)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """How to simulate."""

    mode: Replay = Replay.INFLATE
    """Replay mode. Default inflate."""
    inflate_fraction: float = 1.3
    """Inflate mode: stop submitting once requests reach this share of the cluster's compute
    slices. Default 1.3 (130 %)."""
    shuffle_seed: int | None = None
    """Inflate mode: submit the trace's pods in an order shuffled with this seed (as the
    simulator of Weng et al. can); ``None``: in trace order. Default ``None``."""
    scoring: snapshot.Policy = snapshot.Policy.BINPACK
    """Scheduler node scoring and the planner's node policy. Default binpack."""
    timing: Timing = Timing()
    paranoid: bool = False
    """Recount the whole cluster after every event (slow; for tests). Default off."""


class PodState(enum.StrEnum):
    """Where a pod is in its life."""

    NOT_ARRIVED = "not-arrived"
    WAITING = "waiting"
    RESERVED = "reserved"
    """A plan reserved instances for it; it binds when they are advertised."""
    RUNNING = "running"
    FINISHED = "finished"
    REJECTED = "rejected"


@dataclass(frozen=True, slots=True)
class PodOutcome:
    """What happened to one pod."""

    name: str
    state: PodState
    arrival: float
    bound_at: float | None
    node: str | None
    reason: str | None
    """Why a rejected pod can never run, or why a pod still waits at the end."""


@dataclass(frozen=True, slots=True)
class Result:
    """The figures of one simulation."""

    policy: str
    mode: Replay
    pods_total: int
    pods_scheduled: int
    pods_rejected: int
    allocation_ratio: float
    """Inflate: compute slices held by pods at the end over the cluster's. Faithful: the same
    ratio averaged over time from the first arrival to the end. A unified pod counts the slices
    of what it asked (its request resolved on its node's model), not of a larger instance a
    policy gave it (HAMi may). On an MPS or time-slicing GPU a unified pod counts the slices of
    the MIG profile its ask resolves to on that model (the same in every mode), and the pods
    sharing one GPU count together for at most its compute slices."""
    pending_s: tuple[float, ...]
    """Per pod that arrived and was not rejected: arrival to binding, or to the end if never
    bound (in trace order)."""
    reconfigurations: int
    """GPUs whose layout a plan changed (one per GPU per plan)."""
    instances_destroyed: int
    planner_seconds: float
    planner_calls: int
    placements_refused: int
    """Pods a plan placed on a node without the CPU or memory left (left waiting)."""
    end: float
    """Virtual time the simulation stopped."""
    ratio_over_time: tuple[tuple[float, float], ...]
    """(time, allocation ratio) after every change."""
    outcomes: tuple[PodOutcome, ...] = field(repr=False)
    request_kinds: tuple[str, ...] = ()
    """The kinds of request (:func:`request_kind`) of the submitted pods that are not rejected:
    the kinds some node of the cluster could serve. The same for every policy of a run."""
    requests_never_served: tuple[str, ...] = ()
    """The kinds of :attr:`request_kinds` of which no pod was ever bound: whole kinds of pods a
    policy never runs (a static layout without the profile, HAMi without a template for it)."""
    memory_ratio: float = 0.0
    """As :attr:`allocation_ratio`, for GPU memory: the GB running pods asked (a unified pod its
    ``gpumem``/``gpumem-percentage`` of its node's model, rounded up to whole GB; a pod asking
    MIG profiles by name :attr:`traces.TracePod.memory_gb`, else its profiles' nominal GB) over
    the cluster's GB (:func:`sharing_mps.memory_gb` per GPU); the pods sharing one GPU count
    together for at most its memory. The same pod counts the same in every mode, so this shows
    what MPS packs beyond MIG's fixed sizes (seven 4 GB pods fill an A100-80GB's seven 1g.10gb
    instances: 100 % of its compute slices, 35 % of its memory)."""
    mode_switches: int = 0
    """GPUs whose MIG mode a plan switched (dynamic MIG mode), either way."""
    whole_gpu_pods: int = 0
    """Whole-GPU pods bound to whole GPUs."""

    @property
    def serves_every_request(self) -> bool:
        """Whether the policy ran at least one pod of every kind in :attr:`request_kinds`."""
        return not self.requests_never_served

    def pending_percentile(self, q: float) -> float:
        """The ``q``-th percentile (0-100, nearest rank) of :attr:`pending_s`; 0 when empty."""
        return percentile(self.pending_s, q)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of ``values`` (0 for none)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def replayed(
    trace: traces.Trace, *, cluster: clusters.Cluster, settings: Settings
) -> list[tuple[traces.TracePod, float, float | None]]:
    """The pods a replay submits, with their arrival time and run time (``None``: to the end).

    Faithful: every pod, as the trace has it. Inflate: pods in trace order, ``inflate_gap_s``
    apart and never leaving, until the compute slices they request (on the model they resolve
    on first, the reference model first) reach ``inflate_fraction`` of the cluster's.
    """
    if settings.mode is Replay.FAITHFUL:
        if not trace.timed:
            raise errors.TraceError(
                f"{trace.name} has no arrival and deletion times; replay it with --mode inflate"
            )
        return [(tp, tp.arrival, tp.duration) for tp in trace.pods]
    if not settings.inflate_fraction > 0:
        raise errors.MigpilotError(
            f"the inflate fraction must be above 0, got {settings.inflate_fraction}"
        )
    target = settings.inflate_fraction * cluster.compute_slices
    models = [cluster.reference_model, *(g.model for g in cluster.groups)]
    order = list(trace.pods)
    if settings.shuffle_seed is not None:
        random.Random(settings.shuffle_seed).shuffle(order)
    out: list[tuple[traces.TracePod, float, float | None]] = []
    requested = 0
    for tp in order:
        if requested >= target:
            break
        out.append((tp, len(out) * settings.timing.inflate_gap_s, None))
        if tp.whole:
            requested += tp.whole * cluster.reference_model.compute_slices
            continue
        requested += next((s for m in models if (s := _slices(tp.demand, m)) is not None), 0)
    return out


# --------------------------------------------------------------------------- mutable state


class _Inst:
    """A MIG instance in the simulated cluster."""

    __slots__ = ("advertised", "holder", "profile", "reserved_for", "slices", "start", "visible_at")

    def __init__(self, profile: str, start: int, slices: int, visible_at: float) -> None:
        self.profile = profile
        self.start = start
        self.slices = slices
        self.visible_at = visible_at
        self.advertised = False
        """Whether the scheduler sees it (its visible event ran)."""
        self.holder: _Pod | None = None
        self.reserved_for: _Pod | None = None

    @property
    def free(self) -> bool:
        return self.holder is None and self.reserved_for is None


class _Slice:
    """An MPS memory slice of a GPU of a node in mode mps."""

    __slots__ = ("cores", "holder", "id", "memory_gb", "reserved_for", "visible_at")

    def __init__(self, sid: int, memory_gb: int, cores: int | None, visible_at: float) -> None:
        self.id = sid
        self.memory_gb = memory_gb
        self.cores = cores
        self.visible_at = visible_at
        self.holder: _Pod | None = None
        self.reserved_for: _Pod | None = None

    @property
    def free(self) -> bool:
        return self.holder is None and self.reserved_for is None


class _Gpu:
    __slots__ = (
        "busy_until",
        "cached",
        "gb_asked",
        "index",
        "insts",
        "mig",
        "model",
        "node",
        "replicas_taken",
        "slices",
        "ts_asked",
        "whole_holder",
        "whole_reserved",
        "whole_visible_at",
    )  # fmt: skip

    def __init__(self, node: _Node, index: int, model: profiles.GpuModel) -> None:
        self.node = node
        self.index = index
        self.model = model
        self.insts: dict[int, _Inst] = {}
        self.slices: dict[int, _Slice] = {}
        """MPS slices by id (a node in mode mps)."""
        self.replicas_taken = 0
        """Time-slicing replicas held or reserved (a node in mode time-slicing)."""
        self.ts_asked = 0
        """Compute slices its running MPS and time-slicing pods asked (they count for at most
        the GPU's compute slices together)."""
        self.gb_asked = 0
        """GB its running MPS and time-slicing pods asked (counted up to the GPU's memory)."""
        self.busy_until = 0.0
        self.cached: snapshot.Gpu | None = None
        self.mig = True
        """Its MIG mode; ``False``: a whole GPU (only on a dynamic node)."""
        self.whole_holder: _Pod | None = None
        """The pod bound to it as a whole GPU."""
        self.whole_reserved: _Pod | None = None
        """The pod a plan reserved it for as a whole GPU."""
        self.whole_visible_at = math.inf
        """When it is advertised as a whole GPU (``inf`` while in MIG mode)."""

    @property
    def whole_free(self) -> bool:
        """A whole GPU nobody holds or reserved."""
        return not self.mig and self.whole_holder is None and self.whole_reserved is None


class _Node:
    __slots__ = (
        "busy_slices",
        "cached",
        "cpu_free",
        "free",
        "gpus",
        "mem_free",
        "mode",
        "order",
        "spec",
    )  # fmt: skip

    def __init__(self, spec: clusters.NodeSpec, order: int) -> None:
        self.spec = spec
        self.mode = spec.mode
        self.order = order
        self.gpus = [_Gpu(self, i, spec.model) for i in range(spec.gpus)]
        self.cpu_free = spec.allocatable.cpu_milli
        self.mem_free = spec.allocatable.memory_bytes
        self.free: Counter[str] = Counter()
        """Advertised instances nobody holds or reserved, per profile."""
        self.busy_slices = 0
        """Compute slices held or reserved (the scheduler's allocation score)."""
        self.cached: snapshot.Node | None = None


class _Pod:
    __slots__ = (
        "arrival",
        "bound_at",
        "duration",
        "gb",
        "gpus",
        "held",
        "index",
        "insts",
        "node",
        "reason",
        "shares",
        "spod",
        "state",
        "trace",
    )  # fmt: skip

    def __init__(self, trace: traces.TracePod, index: int, arrival: float) -> None:
        self.trace = trace
        self.index = index
        self.spod = snapshot.planned_pod(
            name=trace.name,
            namespace="default",
            requests=trace.requests,
            node_selector=dict(trace.node_selector),
            terms=trace.terms,
        )
        self.state = PodState.NOT_ARRIVED
        self.arrival = arrival
        self.bound_at: float | None = None
        self.node: _Node | None = None
        self.insts: list[_Inst] = []
        self.gpus: list[_Gpu] = []
        """Whole GPUs it holds or reserved."""
        self.shares: list[tuple[_Gpu, _Slice | None]] = []
        """MPS slices (or, with ``None``, time-slicing replicas) it holds or reserved."""
        self.held = 0
        """Compute slices it asked while running, on its node's model (over its shares, if
        any, :meth:`_Simulation._share` caps per GPU)."""
        self.gb = 0
        """GB of GPU memory it asked while running (:attr:`Result.memory_ratio`)."""
        self.reason: str | None = None
        self.duration = trace.duration


class _Kind(enum.IntEnum):
    # Same-time order: instances appear and pods leave before arrivals are tried, the loop's
    # own wake-ups (a plan due, a reservation expiring) last.
    VISIBLE = 0
    READY = 1
    DEPARTURE = 2
    ARRIVAL = 3
    WAKE = 4


@functools.lru_cache(maxsize=4096)
def _needs(demand: snapshot.Demand, model: profiles.GpuModel) -> Counter[str] | None:
    names = snapshot.resolve_demand(demand, model)
    return None if names is None else Counter(names)


@functools.lru_cache(maxsize=4096)
def _slices(demand: snapshot.Demand, model: profiles.GpuModel) -> int | None:
    names = snapshot.resolve_demand(demand, model)
    if names is None:
        return None
    return sum(model.profile_named(n).compute_slices for n in names)


# --------------------------------------------------------------------------- the engine


class _Simulation:
    def __init__(
        self,
        *,
        trace: traces.Trace,
        cluster: clusters.Cluster,
        policy: policies.Partitioning,
        settings: Settings,
        cpu_clock: CpuClock,
        progress: Progress | None,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.settings = settings
        self.timing = settings.timing
        self.cpu_clock = cpu_clock
        self.progress = progress
        self.nodes = [_Node(spec, i) for i, spec in enumerate(cluster.nodes)]
        self.node_by_name = {n.spec.name: n for n in self.nodes}
        self.total_slices = cluster.compute_slices
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.now = 0.0
        self.held_slices = 0
        self.total_gb = sum(sharing_mps.memory_gb(n.model) * n.gpus for n in cluster.nodes)
        self.held_gb = 0
        self.memory_area = 0.0
        self.samples: list[tuple[float, float]] = [(0.0, 0.0)]
        self.area = 0.0
        self.last_t = 0.0
        self.counts: Counter[PodState] = Counter()
        self.waiting: dict[str, _Pod] = {}
        self.waiting_pods: tuple[snapshot.Pod, ...] | None = None
        """The waiting pods as the planner reads them, in queue order (``None``: to build)."""
        self.empty_nodes: tuple[snapshot.Node, ...] | None = None
        self.reserved: dict[str, _Pod] = {}
        """Pods a plan reserved instances for, not yet bound, by key."""
        self.loop = policy.planner is not None
        """The policy plans: the loop's step (:func:`control.reconcile`, the controller's own)
        runs after every event; without a planner (a static layout) kube-scheduler alone
        places pods as they come."""
        self.gated = policy.gated and self.loop
        """Pods wait for the loop's plan, as migpilot's webhook gates them for the controller;
        otherwise (nos, HAMi: no gate) kube-scheduler binds a pod to free advertised instances
        as it comes, and the loop plans for the pods left."""
        self.memory = control.Memory()
        self.dirty = False
        """Something changed since the loop's last step."""
        self.wake_due: float | None = None
        """When the loop's last step asked to be woken (a WAKE event at another time is stale)."""
        self.control = control.Settings(
            batch_window_s=settings.timing.batch_window_s,
            reservation_timeout_s=settings.timing.reservation_timeout_s,
        )
        self.reconfigurations = 0
        self.switches = 0
        self.destroyed = 0
        self.refused = 0
        self.planner_seconds = 0.0
        self.planner_calls = 0
        self.whole_bound = 0
        """Whole-GPU pods bound (:attr:`Result.whole_gpu_pods`)."""
        self.pods = self._admit_trace(trace)
        self.interpod = any(p.trace.terms is not interpod.NO_TERMS for p in self.pods)
        """Some pod has labels, pod (anti-)affinity or spread: the snapshot lists the pods
        on nodes (:meth:`_bound`), and kube-scheduler's filters for them apply."""
        self.by_name = {p.trace.name: p for p in self.pods}
        self.counts[PodState.NOT_ARRIVED] = len(self.pods)
        self.horizon = self._horizon()
        for node in self.nodes:
            if node.mode is not modes.Mode.MIG:
                continue  # MPS and time-slicing GPUs have MIG disabled
            for gpu in node.gpus:
                for inst in policy.initial_layout(node.spec.model, gpu.index).instances:
                    self._add_instance(gpu, inst.profile, inst.start, visible_at=0.0)
        for pod in self.pods:
            self._push(pod.arrival, _Kind.ARRIVAL, pod)
        self.first_arrival = self.pods[0].arrival if self.pods else 0.0

    # -- setup

    def _admit_trace(self, trace: traces.Trace) -> list[_Pod]:
        out: list[_Pod] = []
        for i, (tp, arrival, duration) in enumerate(
            replayed(trace, cluster=self.cluster, settings=self.settings)
        ):
            pod = _Pod(tp, i, arrival)
            pod.duration = duration
            out.append(pod)
        return out

    def _horizon(self) -> float:
        if self.settings.mode is Replay.INFLATE:
            return math.inf
        end = 0.0
        for p in self.pods:
            end = max(end, p.arrival + (p.duration or 0.0))
        return end

    # -- events

    def _push(self, t: float, kind: _Kind, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, int(kind), self.seq, payload))

    def run(self) -> Result:
        arrivals = len(self.pods)
        seen = 0
        step = max(arrivals // 100, 1)
        due = False  # the loop's step is owed for what happened at this instant
        while self.events:
            t, kind, _, payload = heapq.heappop(self.events)
            if t > self.horizon:
                break
            if kind != _Kind.WAKE or t == self.wake_due:  # else a later step asked otherwise
                self._advance(t)
                if kind == _Kind.ARRIVAL:
                    assert isinstance(payload, _Pod)
                    self._arrive(payload)
                    seen += 1
                    if self.progress is not None and seen % step == 0:
                        self.progress(seen / arrivals)
                elif kind == _Kind.DEPARTURE:
                    assert isinstance(payload, _Pod)
                    self._depart(payload)
                elif kind == _Kind.VISIBLE:
                    assert isinstance(payload, tuple)
                    self._visible(*payload)
                # READY (a reserved pod's slices served) and WAKE only call for the step.
                due = self.loop
                self._check()
            # One step once everything that happened at this instant has: the controller's
            # pass after the watch events that arrived together.
            if due and not (self.events and self.events[0][0] == t):
                due = False
                self._step()
                self._check()
        end = self.now if self.settings.mode is Replay.INFLATE else self.horizon
        self._advance(max(end, self.now))
        if self.progress is not None:
            self.progress(1.0)
        return self._result(end)

    def _advance(self, t: float) -> None:
        if t > self.last_t:
            self.area += self.held_slices * (t - self.last_t)
            self.memory_area += self.held_gb * (t - self.last_t)
            self.last_t = t
        self.now = max(self.now, t)

    def _sample(self) -> None:
        ratio = self.held_slices / self.total_slices
        if self.samples and self.samples[-1][0] == self.now:
            self.samples[-1] = (self.now, ratio)
        else:
            self.samples.append((self.now, ratio))

    def _set_state(self, pod: _Pod, state: PodState) -> None:
        self.counts[pod.state] -= 1
        self.counts[state] += 1
        pod.state = state

    def _touch(self) -> None:
        """Something changed: the loop's next step is told so (a policy without a planner has
        no loop)."""
        self.dirty = True

    def _wait(self, pod: _Pod) -> None:
        self.waiting[pod.trace.name] = pod
        self.waiting_pods = None

    def _unwait(self, pod: _Pod) -> None:
        del self.waiting[pod.trace.name]
        self.waiting_pods = None

    # -- the scheduler model

    def _emptied(self) -> tuple[snapshot.Node, ...]:
        """The nodes as they would be empty, for :func:`control.never_runs`."""
        if self.empty_nodes is None:
            self.empty_nodes = tuple(
                dataclasses.replace(
                    self._node_snapshot(node),
                    allocatable=node.spec.allocatable,
                    gpus=tuple(snapshot.Gpu(g.index, g.model, ()) for g in node.gpus),
                )
                for node in self.nodes
            )
        return self.empty_nodes

    def _fit(self, pod: _Pod, node: _Node) -> bool:
        """kube-scheduler's filter on free advertised instances (a static layout's pods)."""
        if node.mode is not modes.Mode.MIG:
            return False  # MPS slices and replicas are given by the planner, never scheduled
        if pod.trace.whole:
            return self._fit_whole(pod, node)
        need = _needs(pod.trace.demand, node.spec.model)
        if need is None or constraints.rejection(self._node_snapshot(node), pod.spod):
            return False
        if pod.trace.cpu_milli > node.cpu_free or pod.trace.memory_bytes > node.mem_free:
            return False
        free = node.free
        if not all(free[p] >= n for p, n in need.items()):
            return False
        if self.interpod:
            tracker = podaffinity.Tracker(self._snapshot())
            return tracker.refusals_on(pod.spod, [self._node_snapshot(node)])[0] is None
        return True

    def _fit_whole(self, pod: _Pod, node: _Node) -> bool:
        """kube-scheduler's filter for a whole-GPU pod: ``nvidia.com/gpu`` advertised and free."""
        if pod.trace.cpu_milli > node.cpu_free or pod.trace.memory_bytes > node.mem_free:
            return False
        if len(self._advertised_whole(node)) < pod.trace.whole:
            return False
        if constraints.rejection(self._node_snapshot(node), pod.spod):
            return False
        if self.interpod:
            tracker = podaffinity.Tracker(self._snapshot())
            return tracker.refusals_on(pod.spod, [self._node_snapshot(node)])[0] is None
        return True

    def _advertised_whole(self, node: _Node) -> list[_Gpu]:
        return [g for g in node.gpus if g.whole_free and g.whole_visible_at <= self.now]

    def _score(self, node: _Node) -> tuple[float, int]:
        used = node.busy_slices / (node.spec.gpus * node.spec.model.compute_slices)
        if self.settings.scoring is snapshot.Policy.BINPACK:
            return (-used, node.order)
        return (used, node.order)

    def _schedule(self, pod: _Pod, candidates: Sequence[_Node]) -> bool:
        best: _Node | None = None
        best_score: tuple[float, int] | None = None
        for node in candidates:
            if self._fit(pod, node):
                score = self._score(node)
                if best_score is None or score < best_score:
                    best, best_score = node, score
        if best is None:
            return False
        if pod.trace.whole:
            gpus = self._advertised_whole(best)[: pod.trace.whole]
            for gpu in gpus:
                gpu.whole_holder = pod
                gpu.cached = None
            pod.gpus = gpus
            self._hold(pod, best, [])
            return True
        wanted = _needs(pod.trace.demand, best.spec.model)
        assert wanted is not None
        need = Counter(wanted)  # a copy: the cached one is shared
        chosen: list[_Inst] = []
        for gpu in best.gpus:
            for start in sorted(gpu.insts):
                inst = gpu.insts[start]
                if inst.free and inst.advertised and need[inst.profile] > 0:
                    need[inst.profile] -= 1
                    chosen.append(inst)
        if any(n > 0 for n in need.values()):
            raise InvariantViolation(f"node {best.spec.name} advertised instances it lacks")
        for inst in chosen:
            best.free[inst.profile] -= 1
        self._hold(pod, best, chosen)
        return True

    def _retry(self, node: _Node) -> None:
        """Instances became free on ``node``: try waiting pods there (queue order)."""
        if not self.waiting:
            return
        for pod in sorted(self.waiting.values(), key=lambda p: p.index):
            if self._schedule(pod, (node,)):
                self._unwait(pod)

    def _hold(self, pod: _Pod, node: _Node, insts: list[_Inst]) -> None:
        """Bind ``pod`` to free instances of ``node`` (the scheduler's own choice)."""
        for inst in insts:
            inst.holder = pod
            node.busy_slices += inst.slices
            self._invalidate(node, inst)
        node.busy_slices += len(pod.gpus) * node.spec.model.compute_slices
        node.cached = None
        node.cpu_free -= pod.trace.cpu_milli
        node.mem_free -= pod.trace.memory_bytes
        if node.cpu_free < 0 or node.mem_free < 0:
            raise InvariantViolation(f"node {node.spec.name} overcommitted by {pod.trace.name}")
        pod.node = node
        pod.insts = insts
        self._start(pod)

    def _start(self, pod: _Pod) -> None:
        if pod.bound_at is not None:
            raise InvariantViolation(f"pod {pod.trace.name} bound twice")
        pod.bound_at = self.now
        self._set_state(pod, PodState.RUNNING)
        pod.held = _held(pod)
        pod.gb = _asked_gb(pod)
        if pod.shares:
            per, per_gb = _per_share(pod)
            for gpu, _ in pod.shares:
                self._share(gpu, slices=per, gb=per_gb)
        else:
            self.held_slices += pod.held
            self.held_gb += pod.gb
        if pod.gpus:
            self.whole_bound += 1
        self._sample()
        if pod.duration is not None:
            self._push(self.now + pod.duration, _Kind.DEPARTURE, pod)

    def _share(self, gpu: _Gpu, *, slices: int, gb: int) -> None:
        """A running pod's share of ``gpu`` counted (or, negative, no longer): MPS clients and
        replicas share a GPU, so together they count for at most its compute and memory."""
        cap_slices, cap_gb = gpu.model.compute_slices, sharing_mps.memory_gb(gpu.model)
        before = min(gpu.ts_asked, cap_slices), min(gpu.gb_asked, cap_gb)
        gpu.ts_asked += slices
        gpu.gb_asked += gb
        self.held_slices += min(gpu.ts_asked, cap_slices) - before[0]
        self.held_gb += min(gpu.gb_asked, cap_gb) - before[1]

    def _invalidate(self, node: _Node, inst: _Inst | None = None) -> None:
        node.cached = None
        if inst is not None:
            for gpu in node.gpus:
                if gpu.insts.get(inst.start) is inst:
                    gpu.cached = None

    # -- event handlers

    def _arrive(self, pod: _Pod) -> None:
        self._set_state(pod, PodState.WAITING)
        if pod.trace.whole:
            never = self._never_whole(pod)
            if never is not None:
                self._reject(pod, f"can never run: {never}")
                return
        if self.gated:
            self._wait(pod)  # gated: the loop's next plan serves it, or refuses it
            self._touch()
            return
        reason = None if pod.trace.whole else control.never_runs(pod.spod, self._emptied())
        if reason is not None:  # the words the loop's step uses (Verdict.REFUSE)
            self._reject(pod, f"can never run: {reason}")
            return
        if not self._schedule(pod, self.nodes):
            self._wait(pod)
            self._touch()

    def _never_whole(self, pod: _Pod) -> str | None:
        """Why a whole-GPU pod could run on no node even empty (a dynamic node admitting it
        with its GPUs, CPU and memory), or ``None``. The loop never refuses such a pod (the
        controller leaves it to kube-scheduler), so the simulator rejects it as it comes."""
        empty = self._emptied()
        for node, seen in zip(self.nodes, empty, strict=True):
            if (
                node.spec.dynamic
                and node.spec.gpus >= pod.trace.whole
                and pod.trace.cpu_milli <= node.spec.allocatable.cpu_milli
                and pod.trace.memory_bytes <= node.spec.allocatable.memory_bytes
                and constraints.rejection(seen, pod.spod) is None
            ):
                return None
        n = pod.trace.whole
        return (
            f"it asks for {n} whole GPU{'s' if n > 1 else ''} and no node labelled "
            f"{modes.MIG_MODE_LABEL}={modes.DYNAMIC_MIG} admits it with as many GPUs, its CPU "
            "and memory"
        )

    def _reject(self, pod: _Pod, reason: str) -> None:
        pod.reason = reason
        self._set_state(pod, PodState.REJECTED)

    def _depart(self, pod: _Pod) -> None:
        node = pod.node
        assert node is not None
        for inst in pod.insts:
            if inst.holder is not pod:
                raise InvariantViolation(f"{pod.trace.name} left an instance it did not hold")
            inst.holder = None
            node.busy_slices -= inst.slices
            node.free[inst.profile] += 1
            self._invalidate(node, inst)
        for gpu in pod.gpus:
            if gpu.whole_holder is not pod:
                raise InvariantViolation(f"{pod.trace.name} left a whole GPU it did not hold")
            gpu.whole_holder = None
            gpu.cached = None
            node.busy_slices -= node.spec.model.compute_slices
        if pod.shares:
            per, per_gb = _per_share(pod)
            for gpu, _ in pod.shares:
                self._share(gpu, slices=-per, gb=-per_gb)
        else:
            self.held_slices -= pod.held
            self.held_gb -= pod.gb
        for gpu, sl in pod.shares:
            if sl is None:
                gpu.replicas_taken -= 1
            elif sl.holder is not pod:
                raise InvariantViolation(f"{pod.trace.name} left a slice it did not hold")
            else:
                sl.holder = None
            gpu.cached = None
            node.cached = None
        node.cpu_free += pod.trace.cpu_milli
        node.mem_free += pod.trace.memory_bytes
        node.cached = None
        self._set_state(pod, PodState.FINISHED)
        self._sample()
        if not self.gated:
            self._retry(node)
        self._touch()

    def _visible(self, gpu: _Gpu, inst: _Inst | None) -> None:
        if inst is None:  # a GPU switched out of MIG is advertised whole
            if gpu.whole_free and gpu.whole_visible_at <= self.now and not self.gated:
                self._retry(gpu.node)
            self._touch()
            return
        if gpu.insts.get(inst.start) is not inst:
            return  # destroyed before it was advertised
        inst.advertised = True
        if not inst.free:
            return
        gpu.node.free[inst.profile] += 1
        if not self.gated:
            self._retry(gpu.node)
        self._touch()

    def _bind_reserved(self, pod: _Pod) -> None:
        """kube-scheduler binds a pod the loop let go, pinned to its node, to the instances
        reserved for it (the node has them, and the CPU and memory were set aside)."""
        if pod.state is not PodState.RESERVED:
            raise InvariantViolation(f"{pod.trace.name} bound while {pod.state}")
        del self.reserved[pod.spod.key]
        for inst in pod.insts:
            if inst.reserved_for is not pod or not inst.advertised:
                raise InvariantViolation(f"{pod.trace.name} lost its reserved instance")
            inst.reserved_for = None
            inst.holder = pod
        for gpu in pod.gpus:
            if gpu.whole_reserved is not pod or gpu.whole_visible_at > self.now:
                raise InvariantViolation(f"{pod.trace.name} lost its reserved whole GPU")
            gpu.whole_reserved = None
            gpu.whole_holder = pod
        for _, sl in pod.shares:
            if sl is not None:
                if sl.reserved_for is not pod:
                    raise InvariantViolation(f"{pod.trace.name} lost its reserved slice")
                sl.reserved_for = None
                sl.holder = pod
        # Reserved and held look the same to the planner (used): no cached snapshot changes.
        self._start(pod)

    # -- the policy

    def _node_snapshot(self, node: _Node) -> snapshot.Node:
        """The node as the planner reads it: every instance held, reserved or still being
        created is *used* (cached until the node changes)."""
        if node.cached is None:
            gpus: list[snapshot.Gpu] = []
            for gpu in node.gpus:
                if gpu.cached is None:
                    gpu.cached = snapshot.Gpu(
                        gpu.index,
                        gpu.model,
                        tuple(
                            snapshot.ExistingInstance(i.profile, i.start, not i.free)
                            for i in sorted(gpu.insts.values(), key=lambda i: i.start)
                        ),
                        mps=tuple(
                            modes.MpsSlice(sl.id, sl.memory_gb, sl.cores, used=not sl.free)
                            for sl in sorted(gpu.slices.values(), key=lambda sl: sl.id)
                        ),
                        replicas=node.spec.replicas,
                        replicas_used=gpu.replicas_taken,
                        mig=gpu.mig,
                        whole_taken=not gpu.mig and not gpu.whole_free,
                    )
                gpus.append(gpu.cached)
            node.cached = snapshot.Node(
                name=node.spec.name,
                labels=node.spec.labels,
                taints=(),
                unschedulable=False,
                allocatable=snapshot.Resources(node.cpu_free, node.mem_free),
                gpus=tuple(gpus),
                capacity=node.spec.allocatable,
                mode=node.mode,
                dynamic=node.spec.dynamic,
            )
        return node.cached

    def _snapshot(self) -> snapshot.Snapshot:
        if self.waiting_pods is None:
            self.waiting_pods = tuple(
                p.spod for p in sorted(self.waiting.values(), key=lambda p: p.index)
            )
        return snapshot.Snapshot(
            nodes=tuple(self._node_snapshot(n) for n in self.nodes),
            pods=tuple(p for p in self.waiting_pods if not p.whole),
            whole_pods=tuple(p for p in self.waiting_pods if p.whole),
            policy=self.settings.scoring,
            bound=self._bound(),
        )

    def _bound(self) -> tuple[interpod.BoundPod, ...]:
        """The pods on nodes (running, or reserved and pinned there) that pod (anti-)affinity
        and spread count, as the controller lists bound and pinned pods; none without
        :attr:`interpod`."""
        if not self.interpod:
            return ()
        return tuple(
            interpod.BoundPod(
                name=p.trace.name,
                namespace=p.spod.namespace,
                node=p.node.spec.name,
                labels=p.trace.terms.labels,
                anti_affinity=p.trace.terms.anti_affinity,
            )
            for p in self.pods
            if p.node is not None and p.state in (PodState.RESERVED, PodState.RUNNING)
        )

    def _observed(self) -> control.Observed:
        """The cluster as the loop's step reads it (the controller reads the same from the
        API): the snapshot, and each reservation with what it still waits for."""
        changed, self.dirty = self.dirty, False
        return control.Observed(
            snapshot=self._snapshot(),
            reserved={key: self._reservation(pod) for key, pod in self.reserved.items()},
            changed=changed,
        )

    def _reservation(self, pod: _Pod) -> control.Reserved:
        """A reserved pod as the step reads it: gated until let go, made once every instance
        is advertised and every slice served. kube-scheduler binds it to the very instances
        reserved for it, so it asks nothing more of the node's counts."""
        assert pod.node is not None
        missing = None
        for inst in pod.insts:
            if not inst.advertised:
                at = next(g.index for g in pod.node.gpus if g.insts.get(inst.start) is inst)
                missing = (
                    f"{inst.profile} at GPU {at} start {inst.start} on {pod.node.spec.name} "
                    "to be created"
                )
                break
        if missing is None:
            for gpu in pod.gpus:
                if gpu.whole_visible_at > self.now:
                    missing = f"GPU {gpu.index} on {pod.node.spec.name} to be advertised whole"
                    break
        if missing is None:
            for shared, sl in pod.shares:
                if sl is not None and sl.visible_at > self.now:
                    missing = (
                        f"MPS slice {sl.id} ({sl.memory_gb} GB) of GPU {shared.index} on "
                        f"{pod.node.spec.name} to be served"
                    )
                    break
        return control.Reserved(
            node=pod.node.spec.name,
            gated=True,
            made=missing is None,
            missing=missing,
            asks=(),
        )

    def _step(self) -> None:
        """One step of the loop (:func:`control.reconcile`, the controller's own), carried out
        at once: expired reservations dropped, pods let go bound, the plan applied, pods that
        can never run rejected."""
        decision = control.reconcile(
            self._observed(),
            self.memory,
            now=self.now,
            settings=self.control,
            planner=self._run_planner,
        )
        self.memory = decision.memory
        for e in decision.expired:
            self._expire(self.reserved[e.pod])
        for key, _ in decision.pins:
            self._bind_reserved(self.reserved[key])
        if decision.plan is not None:
            self.refused += len(decision.unfit)
            self._apply(decision.plan)
        by_key = {p.spod.key: p for p in self.waiting.values()} if decision.judged else {}
        for j in decision.judged:
            pod = by_key.get(j.pod)
            if pod is not None and j.verdict is control.Verdict.REFUSE:
                self._unwait(pod)
                self._reject(pod, j.reason)
        # decision.scale_out is always empty: the simulator models no node autoscaler and never
        # sets control.Settings.scale_out_after_s, so an unplaced pod waits (Verdict.WAIT).
        if decision.wake_at is not None and decision.wake_at != self.wake_due:
            self._push(max(decision.wake_at, self.now), _Kind.WAKE, None)
        self.wake_due = decision.wake_at

    def _expire(self, pod: _Pod) -> None:
        """A reservation expired: its instances, slices, CPU and memory are free again and the
        pod waits to be planned again."""
        node = pod.node
        assert node is not None
        del self.reserved[pod.spod.key]
        for inst in pod.insts:
            if inst.reserved_for is not pod:
                raise InvariantViolation(f"{pod.trace.name} lost its reserved instance")
            inst.reserved_for = None
            node.busy_slices -= inst.slices
            if inst.advertised:
                node.free[inst.profile] += 1
            self._invalidate(node, inst)
        for whole in pod.gpus:
            if whole.whole_reserved is not pod:
                raise InvariantViolation(f"{pod.trace.name} lost its reserved whole GPU")
            whole.whole_reserved = None
            whole.cached = None
            node.busy_slices -= node.spec.model.compute_slices
        for gpu, sl in pod.shares:
            if sl is None:
                gpu.replicas_taken -= 1
            else:
                sl.reserved_for = None
            gpu.cached = None
        node.cpu_free += pod.trace.cpu_milli
        node.mem_free += pod.trace.memory_bytes
        node.cached = None
        pod.node, pod.insts, pod.shares, pod.gpus = None, [], [], []
        self._set_state(pod, PodState.WAITING)
        self._wait(pod)
        self._touch()

    def _run_planner(self, snap: snapshot.Snapshot) -> plans.Plan:
        started = self.cpu_clock()
        plan = self.policy.plan(snap)
        self.planner_seconds += self.cpu_clock() - started
        self.planner_calls += 1
        assert plan is not None  # only policies with a planner schedule plans
        return plan

    def _apply(self, plan: plans.Plan) -> None:
        t = self.timing
        ops: dict[tuple[str, int], list[plans.Action]] = {}
        for action in plan.actions:
            ops.setdefault((action.node, action.gpu), []).append(action)
        switched = {(sw.node, sw.gpu): sw.mig for sw in plan.switches}
        for key in switched:
            ops.setdefault(key, [])
        for (node_name, index), actions in ops.items():
            node = self.node_by_name[node_name]
            gpu = node.gpus[index]
            clock = max(self.now, gpu.busy_until)
            to_mig = switched.get((node_name, index))
            if to_mig is True:  # into MIG before its instances are created
                clock = self._switch(gpu, mig=True, clock=clock, planner=plan.planner)
            for a in actions:
                if a.op is plans.Op.DESTROY:
                    inst = gpu.insts.get(a.start)
                    if inst is None or inst.profile != a.profile:
                        raise InvariantViolation(f"{plan.planner} destroys a missing instance")
                    if not inst.free:
                        raise InvariantViolation(
                            f"{plan.planner} destroyed {a.profile}@{a.start} on "
                            f"{node_name}/{index} while a pod holds or reserved it"
                        )
                    if inst.advertised:
                        node.free[inst.profile] -= 1
                    del gpu.insts[a.start]
                    clock += t.destroy_s
                    self.destroyed += 1
                else:
                    if not gpu.mig:
                        raise InvariantViolation(
                            f"{plan.planner} creates {a.profile} on whole GPU {node_name}/{index}"
                        )
                    clock += t.create_s
                    self._add_instance(gpu, a.profile, a.start, visible_at=clock + t.advertise_s)
            if to_mig is False:  # out of MIG once its free instances are destroyed
                clock = self._switch(gpu, mig=False, clock=clock, planner=plan.planner)
            gpu.busy_until = clock
            gpu.cached = None
            node.cached = None
            self.reconfigurations += 1
            reason = layouts.violation(
                gpu.model, [layouts.Instance(i.start, i.profile) for i in gpu.insts.values()]
            )
            if reason is not None:
                raise InvariantViolation(f"{plan.planner} made an invalid layout: {reason}")
        self._apply_slices(plan)
        for placement in plan.placements:
            self._reserve(placement, planner=plan.planner)

    def _switch(self, gpu: _Gpu, *, mig: bool, clock: float, planner: str) -> float:
        """Switch ``gpu``'s MIG mode from ``clock``; returns when the switch is done. Never on
        a GPU with anything held or reserved (the invariant the agent keeps on a real node)."""
        where = f"{gpu.node.spec.name}/{gpu.index}"
        if not gpu.node.spec.dynamic:
            raise InvariantViolation(f"{planner} switched {where}, on a node not dynamic")
        if gpu.mig == mig:
            raise InvariantViolation(f"{planner} switched {where} to the mode it has")
        if gpu.insts or (not gpu.mig and not gpu.whole_free):
            raise InvariantViolation(f"{planner} switched the MIG mode of {where} while in use")
        t = self.timing
        clock += t.mode_reset_s if gpu.model.mode_change_needs_reset else t.mode_switch_s
        gpu.mig = mig
        gpu.whole_visible_at = math.inf if mig else clock + t.advertise_s
        if not mig:
            self._push(gpu.whole_visible_at, _Kind.VISIBLE, (gpu, None))
        gpu.cached = None
        gpu.node.cached = None
        self.switches += 1
        return clock

    def _apply_slices(self, plan: plans.Plan) -> None:
        """MPS slices removed and created (a slice is advertised ``advertise_s`` after)."""
        touched: dict[tuple[str, int], _Gpu] = {}
        for a in plan.slice_actions:
            node = self.node_by_name[a.node]
            gpu = node.gpus[a.gpu]
            touched[(a.node, a.gpu)] = gpu
            if a.op is plans.SliceOp.REMOVE:
                sl = gpu.slices.get(a.slice)
                if sl is None or not sl.free:
                    raise InvariantViolation(
                        f"{plan.planner} removed slice {a.slice} of {a.node}/{a.gpu}, which is "
                        "missing, held or reserved"
                    )
                del gpu.slices[a.slice]
                self.destroyed += 1
            else:
                if a.slice in gpu.slices:
                    raise InvariantViolation(f"two slices {a.slice} on {a.node}/{a.gpu}")
                visible = self.now + self.timing.advertise_s
                gpu.slices[a.slice] = _Slice(a.slice, a.memory_gb, a.cores, visible)
            gpu.cached = None
            node.cached = None
        for (name, index), gpu in touched.items():
            self.reconfigurations += 1
            current = [modes.MpsSlice(sl.id, sl.memory_gb, sl.cores) for sl in gpu.slices.values()]
            problem = modes.slices_problem(gpu.model, current)
            if problem is not None:
                raise InvariantViolation(f"{plan.planner} made {name}/{index} slices: {problem}")

    def _add_instance(self, gpu: _Gpu, profile: str, start: int, *, visible_at: float) -> None:
        if start in gpu.insts:
            raise InvariantViolation(f"two instances at start {start} of {gpu.node.spec.name}")
        inst = _Inst(profile, start, gpu.model.profile_named(profile).compute_slices, visible_at)
        gpu.insts[start] = inst
        gpu.cached = None
        gpu.node.cached = None
        if visible_at <= self.now:
            inst.advertised = True
            gpu.node.free[profile] += 1
        else:
            self._push(visible_at, _Kind.VISIBLE, (gpu, inst))

    def _reserve(self, placement: plans.Placement, *, planner: str) -> None:
        pod = self.waiting.get(placement.pod.split("/", 1)[-1])
        if pod is None:
            raise InvariantViolation(f"{planner} placed {placement.pod}, which is not waiting")
        node = self.node_by_name[placement.node]
        if pod.trace.cpu_milli > node.cpu_free or pod.trace.memory_bytes > node.mem_free:
            # The step leaves out the placements without their CPU or memory.
            raise InvariantViolation(f"{planner} placed {placement.pod} on a full node")
        self._unwait(pod)
        self.reserved[pod.spod.key] = pod
        shares: list[tuple[_Gpu, _Slice | None]] = []
        ready = self.now
        for sh in placement.shares:
            gpu = node.gpus[sh.gpu]
            if sh.slice is None:
                if gpu.replicas_taken >= node.spec.replicas:
                    raise InvariantViolation(f"{planner} overcommitted {node.spec.name}/{sh.gpu}")
                gpu.replicas_taken += 1
                shares.append((gpu, None))
            else:
                sl = gpu.slices.get(sh.slice)
                if sl is None or not sl.free:
                    raise InvariantViolation(f"{planner} gave {placement.pod} an unavailable slice")
                sl.reserved_for = pod
                ready = max(ready, sl.visible_at)
                shares.append((gpu, sl))
            gpu.cached = None
        pod.shares = shares
        for index in placement.gpus:
            gpu = node.gpus[index]
            if not gpu.whole_free:
                raise InvariantViolation(f"{planner} gave {placement.pod} an unavailable whole GPU")
            gpu.whole_reserved = pod
            gpu.cached = None
            node.busy_slices += node.spec.model.compute_slices
            ready = max(ready, gpu.whole_visible_at)
            pod.gpus.append(gpu)
        insts: list[_Inst] = []
        for ai in placement.instances:
            inst = node.gpus[ai.gpu].insts.get(ai.start)
            if inst is None or inst.profile != ai.profile or not inst.free:
                raise InvariantViolation(f"{planner} gave {placement.pod} an unavailable instance")
            inst.reserved_for = pod
            node.busy_slices += inst.slices
            if inst.advertised:
                node.free[inst.profile] -= 1
            node.gpus[ai.gpu].cached = None
            insts.append(inst)
        node.cached = None
        node.cpu_free -= pod.trace.cpu_milli
        node.mem_free -= pod.trace.memory_bytes
        pod.node = node
        pod.insts = insts
        self._set_state(pod, PodState.RESERVED)
        # The loop looks again once its slices are served (its instances have their own
        # VISIBLE events), at once for what exists: the controller's next pass, as its
        # writes come back through the watch.
        self._push(max(ready, self.now), _Kind.READY, pod)

    # -- invariants and results

    def _check(self) -> None:
        if sum(self.counts.values()) != len(self.pods) or min(self.counts.values()) < 0:
            raise InvariantViolation(f"pod states do not add up: {dict(self.counts)}")
        if len(self.waiting) != self.counts[PodState.WAITING]:
            raise InvariantViolation("the waiting queue and the pod states disagree")
        if not 0 <= self.held_slices <= self.total_slices:
            raise InvariantViolation(f"{self.held_slices} compute slices held")
        if not 0 <= self.held_gb <= self.total_gb:
            raise InvariantViolation(f"{self.held_gb} GB of GPU memory held")
        if self.settings.paranoid:
            self._recount()

    def _recount(self) -> None:
        held = 0
        for node in self.nodes:
            free: Counter[str] = Counter()
            busy = 0
            for gpu in node.gpus:
                if layouts.violation(
                    gpu.model, [layouts.Instance(i.start, i.profile) for i in gpu.insts.values()]
                ):
                    raise InvariantViolation(f"invalid layout on {node.spec.name}/{gpu.index}")
                for inst in gpu.insts.values():
                    if inst.holder is not None and inst.reserved_for is not None:
                        raise InvariantViolation("an instance both held and reserved")
                    if inst.holder is not None:
                        if (
                            inst.holder.state is not PodState.RUNNING
                            or inst not in inst.holder.insts
                        ):
                            raise InvariantViolation("an instance held by a pod not running on it")
                        busy += inst.slices
                    elif inst.reserved_for is not None:
                        busy += inst.slices
                    elif inst.advertised:
                        free[inst.profile] += 1
                if gpu.mig and (gpu.whole_holder or gpu.whole_reserved):
                    raise InvariantViolation(f"a MIG GPU held whole on {node.spec.name}")
                if not gpu.mig and gpu.insts:
                    raise InvariantViolation(f"instances on whole GPU {node.spec.name}")
                holder = gpu.whole_holder or gpu.whole_reserved
                if holder is not None:
                    if gpu not in holder.gpus or (gpu.whole_holder and gpu.whole_reserved):
                        raise InvariantViolation(f"whole GPU {node.spec.name} held astray")
                    busy += gpu.model.compute_slices
            if +node.free != +free or node.busy_slices != busy:
                raise InvariantViolation(f"free instance counts of {node.spec.name} drifted")
        held_gb = 0
        asked: dict[int, list[int]] = {}
        for pod in self.pods:
            if pod.state is not PodState.RUNNING:
                continue
            if not pod.shares:
                held += pod.held
                held_gb += pod.gb
                continue
            per, per_gb = _per_share(pod)
            for gpu, _ in pod.shares:
                got = asked.setdefault(id(gpu), [0, 0])
                got[0] += per
                got[1] += per_gb
        for node in self.nodes:
            for gpu in node.gpus:
                slices, gb = asked.get(id(gpu), [0, 0])
                if (slices, gb) != (gpu.ts_asked, gpu.gb_asked):
                    where = f"{node.spec.name}/{gpu.index}"
                    raise InvariantViolation(f"shares asked of {where} drifted")
                held += min(slices, gpu.model.compute_slices)
                held_gb += min(gb, sharing_mps.memory_gb(gpu.model))
        if held != self.held_slices:
            raise InvariantViolation("held compute slices drifted")
        if held_gb != self.held_gb:
            raise InvariantViolation("held GPU memory drifted")
        for pod in self.pods:
            bound = pod.state in (PodState.RUNNING, PodState.FINISHED)
            if bound != (pod.bound_at is not None):
                raise InvariantViolation(
                    f"{pod.trace.name} is {pod.state} with bound_at {pod.bound_at}"
                )

    def _result(self, end: float) -> Result:
        if self.settings.mode is Replay.INFLATE:
            ratio = self.held_slices / self.total_slices
            memory = self.held_gb / self.total_gb
        else:
            span = end - self.first_arrival
            ratio = self.area / (self.total_slices * span) if span > 0 else 0.0
            memory = self.memory_area / (self.total_gb * span) if span > 0 else 0.0
        pending: list[float] = []
        outcomes: list[PodOutcome] = []
        scheduled = rejected = 0
        served: dict[str, bool] = {}
        for pod in self.pods:
            if pod.state not in (PodState.REJECTED, PodState.NOT_ARRIVED):
                kind = request_kind(pod.trace.mig, pod.trace.unified, whole=pod.trace.whole)
                served[kind] = served.get(kind, False) or pod.bound_at is not None
            if pod.state is PodState.REJECTED:
                rejected += 1
            elif pod.bound_at is not None:
                scheduled += 1
                pending.append(pod.bound_at - pod.arrival)
            elif pod.state is not PodState.NOT_ARRIVED:
                pending.append(max(end - pod.arrival, 0.0))
            reason = pod.reason
            if pod.state in (PodState.WAITING, PodState.RESERVED):
                reason = "still waiting at the end of the simulation"
            outcomes.append(
                PodOutcome(
                    name=pod.trace.name,
                    state=pod.state,
                    arrival=pod.arrival,
                    bound_at=pod.bound_at,
                    node=pod.node.spec.name
                    if pod.node is not None and pod.bound_at is not None
                    else None,
                    reason=reason,
                )
            )
        return Result(
            policy=self.policy.name,
            mode=self.settings.mode,
            pods_total=len(self.pods),
            pods_scheduled=scheduled,
            pods_rejected=rejected,
            allocation_ratio=ratio,
            pending_s=tuple(pending),
            reconfigurations=self.reconfigurations,
            instances_destroyed=self.destroyed,
            planner_seconds=self.planner_seconds,
            planner_calls=self.planner_calls,
            placements_refused=self.refused,
            end=end,
            ratio_over_time=tuple(self.samples),
            outcomes=tuple(outcomes),
            request_kinds=tuple(sorted(served)),
            requests_never_served=tuple(sorted(k for k, ok in served.items() if not ok)),
            memory_ratio=memory,
            mode_switches=self.switches,
            whole_gpu_pods=self.whole_bound,
        )


def request_text(mig: tuple[snapshot.MigRequest, ...]) -> str:
    """A MIG request as people write it: ``4g.40gb``, ``8 x 7g.80gb``, ``2 x 1g.10gb + 3g.40gb``."""
    return " + ".join(r.profile if r.count == 1 else f"{r.count} x {r.profile}" for r in mig)


def request_kind(
    mig: tuple[snapshot.MigRequest, ...],
    request: unifying.UnifiedRequest | None = None,
    *,
    whole: int = 0,
) -> str:
    """The kind of request a pod makes, the unit of "a policy serves every request".

    Two pods are of one kind when they ask for the same MIG instances: the same count of each
    profile, as the pods name them (:attr:`snapshot.MigRequest.profile`), in any order and
    however the counts are split over request lines; CPU, memory and node selectors are not
    part of it. Written as :func:`request_text` of the profiles sorted by name
    (``2 x 1g.10gb + 3g.40gb``). A kind counts in a run when at least one submitted pod of it is
    not rejected, i.e. some node of the cluster could run it with every GPU empty: a kind no GPU
    of the cluster can serve never counts against a policy. A unified request is its own kind,
    written as the pod spec asks (``gpu 1, gpumem-percentage 50``), whole GPUs as ``2 x whole
    GPU``.
    """
    if whole:
        return "whole GPU" if whole == 1 else f"{whole} x whole GPU"
    if request is not None:
        return request.text()
    counts: Counter[str] = Counter()
    for r in mig:
        counts[r.profile] += r.count
    return request_text(tuple(snapshot.MigRequest(p, counts[p]) for p in sorted(counts)))


def _held(pod: _Pod) -> int:
    """The compute slices a running pod counts for: what it asked on its node's model (its
    instances' for a MIG request, where asked and given are the same; for a unified request
    the slices of the profile MIG would give it there, whatever mode served it, so a pod counts
    the same on a MIG, an MPS or a time-slicing node)."""
    if pod.gpus:
        return sum(g.model.compute_slices for g in pod.gpus)
    if pod.trace.unified is None:
        return sum(i.slices for i in pod.insts)
    assert pod.node is not None
    model = pod.node.spec.model
    slices = _slices(pod.trace.demand, model)
    if slices is None:  # MIG has no profile for it (an MPS slice has finer sizes)
        share = sum(modes.unified_gb(a, model) * a.count for a in pod.trace.unified.asks)
        return math.ceil(share * model.compute_slices / sharing_mps.memory_gb(model))
    return slices


def _asked_gb(pod: _Pod) -> int:
    """The GB of GPU memory a running pod asked (:attr:`Result.memory_ratio`)."""
    assert pod.node is not None
    model = pod.node.spec.model
    if pod.gpus:
        return sharing_mps.memory_gb(model) * len(pod.gpus)
    if pod.trace.unified is None:
        if pod.trace.memory_gb is not None:
            return min(pod.trace.memory_gb, sharing_mps.memory_gb(model) * len(pod.insts))
        return sum(model.profile_named(i.profile).nominal_gb for i in pod.insts)
    return sum(modes.unified_gb(a, model) * a.count for a in pod.trace.unified.asks)


def _per_share(pod: _Pod) -> tuple[int, int]:
    """Compute slices and GB a pod asked of each GPU it shares (MPS slice or replica)."""
    n = len(pod.shares)
    return math.ceil(pod.held / n), math.ceil(pod.gb / n)


def _shared_serves(pod: _Pod, node: _Node) -> bool:
    """Whether a node in mode mps or time-slicing could serve the pod with every GPU free."""
    request = pod.trace.unified
    if request is None or not modes.serves(
        node.mode,
        mig=bool(pod.trace.mig),
        mps=False,
        unified_request=True,
        unified_mode=request.mode,
    ):
        return False
    model = node.spec.model
    if node.mode is modes.Mode.MPS:
        needs = modes.mps_needs((), request, model)
    else:
        needs = () if modes.replica_needs(request, model) is not None else None
    return needs is not None and all(a.count <= node.spec.gpus for a in request.asks)


def _no_clock() -> float:
    return 0.0


def simulate(
    trace: traces.Trace,
    *,
    cluster: clusters.Cluster,
    policy: policies.Partitioning,
    settings: Settings = Settings(),
    cpu_clock: CpuClock = _no_clock,
    progress: Progress | None = None,
) -> Result:
    """Replay ``trace`` on ``cluster`` under ``policy``; deterministic in everything but the
    planner CPU time ``cpu_clock`` measures (pass ``time.process_time`` from a shell)."""
    sim = _Simulation(
        trace=trace,
        cluster=cluster,
        policy=policy,
        settings=settings,
        cpu_clock=cpu_clock,
        progress=progress,
    )
    return sim.run()


# --------------------------------------------------------------------------- static-best

STATIC_BEST_CANDIDATES = 6
"""Layouts per GPU model the ``static-best`` search simulates."""


def _better(a: Result, b: Result | None) -> bool:
    if b is None:
        return True
    key_a = (a.allocation_ratio, a.pods_scheduled, -a.pending_percentile(99))
    key_b = (b.allocation_ratio, b.pods_scheduled, -b.pending_percentile(99))
    return key_a > key_b


def best_static(
    trace: traces.Trace,
    *,
    cluster: clusters.Cluster,
    settings: Settings = Settings(),
    candidates: int = STATIC_BEST_CANDIDATES,
    progress: Progress | None = None,
) -> tuple[policies.Partitioning, Result]:
    """The ``static-best`` policy: one layout per GPU model, the best for this trace.

    For each model the ``candidates`` maximal layouts that best cover the instances the replay
    asks for (:func:`policies.static_candidates`) are simulated in turn, the other models keeping
    their current choice (one round of coordinate search, starting from each model's first
    candidate); the best allocation ratio wins, then the most pods scheduled, then the lowest p99
    pending time. Returns the policy and its result.
    """
    models: dict[str, tuple[profiles.GpuModel, int]] = {}
    for g in cluster.groups:
        model, gpus = models.get(g.model.id, (g.model, 0))
        models[g.model.id] = (model, gpus + g.nodes * g.gpus)
    # Instances wanted per profile, per model (a unified request resolves per model).
    demand: dict[str, Counter[str]] = {mid: Counter() for mid in models}
    for tp, _, _ in replayed(trace, cluster=cluster, settings=settings):
        for mid, (model, _) in models.items():
            if tp.unified is None:
                for req in tp.mig:
                    demand[mid][req.profile] += req.count
            else:
                demand[mid].update(snapshot.resolve_demand(tp.demand, model) or ())
    options = {
        mid: policies.static_candidates(model, demand[mid], gpus=gpus, count=candidates)
        for mid, (model, gpus) in models.items()
    }
    choice = {mid: opts[0] for mid, opts in options.items()}
    best: Result | None = None
    best_policy: policies.Partitioning | None = None
    total = sum(len(o) for o in options.values())
    done = 0
    tried: set[tuple[tuple[str, layouts.Layout], ...]] = set()
    for mid, opts in options.items():
        keep = choice[mid]
        for lay in opts:
            choice[mid] = lay
            key = tuple(sorted(choice.items()))
            done += 1
            if key in tried:
                continue
            tried.add(key)
            policy = policies.fixed("static-best", dict(choice))
            result = simulate(trace, cluster=cluster, policy=policy, settings=settings)
            if _better(result, best):
                best, best_policy, keep = result, policy, lay
            if progress is not None:
                progress(done / total)
        choice[mid] = keep
    assert best is not None and best_policy is not None
    return best_policy, best
