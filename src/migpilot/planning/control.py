"""The control loop's rules, as one pure step shared by the simulator and the controller.

Why it exists: the simulator's figures are only the controller's figures if both run the same
loop. Every rule of the loop is here, and :func:`reconcile` is the one step that applies them:
it takes what is observed (:class:`Observed`), what the loop remembers between steps
(:class:`Memory`) and ``now``, and returns a :class:`Decision`. The controller
(``controller/running.py``) only watches, builds the :class:`Observed` from its caches, calls
it, and writes what it decided; the simulator (``sim/simulating.py``) builds the same
:class:`Observed` from its model and carries the decision out on its virtual clock. The rules:

- **Batching.** Something changes (a pod arrives, an instance appears, a pod leaves):
  :func:`changed`. If pods wait and no plan is due, one becomes due ``batch_window_s`` later, so
  pods arriving together are planned together (the whole pending set is the planner's strength).
- **Deciding.** When a plan is due, :func:`decide` plans the snapshot if pods wait and anything
  changed since the last plan, else does nothing. It never plans twice for the same state.
- **Incremental passes** (:mod:`migpilot.planning.incremental`, the one rule). A full replan
  plans every waiting pod; the pods it leaves unplaced are the backlog (:attr:`Memory.backlog`).
  While capacity has not grown since (every step compares its nodes with the last step's: no
  node joined or changed, no instance in use freed, no CPU or memory freed), no backlog pod
  changed, and :attr:`Settings.full_replan_s` has not passed, a plan is an incremental pass: it
  plans only the pods not in the backlog, on the nodes that could hold them, the backlog
  treated as still unplaceable (none to plan: no plan). Anything else makes the plan full
  (:attr:`Decision.full` says why).
- **Reservations and actions in flight are in the snapshot.** A pod the last plan placed is not
  in the snapshot's pending pods again; the instances reserved for it, and the instances still
  being created for it, are in the snapshot as *used*: the planner can neither destroy them nor
  give them away. Each caller builds its snapshot so.
- **Releasing.** A reservation whose pod is gone, done or bound has served its purpose: the
  nodes that still keep one are in :attr:`Decision.release`.
- **Expiring.** A reservation expires when its pod is still not bound
  ``reservation_timeout_s`` after its instances exist (capacity another pod took, a pin the
  scheduler cannot honour), or ten times that after it was made (instances that never appear);
  at once when another pod took what it reserves (*stolen*). A pod let go with its node
  affinity naming its node keeps its reservation however long kube-scheduler takes, unless
  stolen. Its pod is planned again.
- **Ageing.** A pod that has waited :attr:`Settings.age_after_s` (default 12 hours, counted
  from the first step that saw it waiting or reserved: a controller that restarts counts
  again) outranks the newer pods of its priority in the plans, whenever room can be made for
  it now (:func:`age_ranks`). The planner places the most pods and destroys the fewest free
  instances, so without it a stream of pods that reuse freed instances as they are can pass
  an older pod of another shape over for days.
- **Avoiding a node that let a reservation expire.** A pod whose reservation on a node expired
  because it was not usable in time (not a stolen one) is kept off that node by the plans of
  the next :attr:`Settings.avoid_after_expiry_s` (:func:`avoiding`), while another node might
  hold it: a node whose agent or device plugin never makes reservations usable would otherwise
  be given the pod again and again, each time for a timeout. The node is ranked last, never
  forbidden: a plan that leaves the pod unplaced without that node is made again with it.
- **Steering DRA nodes** (``docs/dra.md``). A pod asking through DRA claims
  (:attr:`snapshot.Pod.dra`) is planned like any other, on DRA nodes only, but nothing is reserved
  for it: kube-scheduler allocates the placements from what the node's agent publishes, listing the
  planned ones first. A gated one the plan places is pinned to its node and let go
  (:attr:`Decision.steered`) once its node's target is written and listed by the node's agent, else
  planned again (at once when the agent's report that it lists the target is the change:
  :attr:`Observed.listing`); its placement, once allocated, is a used instance of the next
  snapshots. The
  first-fit check (:mod:`migpilot.planning.drasteering`): a round is steered only when its plan
  places more of the gated DRA pods than kube-scheduler's first fit would serve now; otherwise the
  pods first fit serves are let go, each pinned to the node first fit picks, and the DRA nodes'
  targets list nothing first for them (but for a pod a placement listed first for a pod in flight
  would take: :func:`drasteering.first_fit_plan`); until their claims are allocated, the devices
  first fit was predicted to give them are used instances of the snapshot, and they are not planned
  again (:attr:`Memory.first_fit`). A DRA node's target holds only its used instances and the
  placements the plan gives pods there (a free placement is listed first for any claim:
  :func:`drasteering.trimmed`); between plans, once no DRA pod waits or is in flight, the targets a
  plan gave DRA pods placements in are written back to their used instances
  (:attr:`Decision.cleared`), so a steered target does not outlive its pods.
- **Pinning.** Reserved pods are let go to kube-scheduler, pinned to their node, in the order
  of their keys, once every instance is made, the node still admits the pod (not cordoned, no
  new taint it does not tolerate: a node being drained or consolidated) and the node
  advertises enough of each resource beyond what bound pods and pods let go before take; a
  unified pod also waits while another, asking differently, is let go there and not yet
  allocated (``docs/unified.md``).
- **Refusing.** A pod whose request cannot be served is refused with the reason; a pod the
  plan leaves unplaced is let go to a statically laid out node with free instances for it,
  refused when it could never run (:func:`never_runs`), and otherwise waits, with the
  planner's reason.
- **Whole GPUs elsewhere** (dynamic MIG mode, ``docs/migmode.md``). A gated whole-GPU pod
  (the webhook gates them while some node is labelled ``migpilot.io/mig-mode=dynamic``) is
  let go at once, unpinned, before any plan, when no planned dynamic node could ever serve it
  (none admits it, has that many GPUs, or the CPU and memory), when migpilot cannot read it,
  or when a node that is not dynamic (and whose ``nvidia.com/gpu`` is not migpilot's MIG
  instances) admits it and advertises enough free ``nvidia.com/gpu`` now: a GPU is then not
  switched out of MIG for it, and kube-scheduler serves it as it did before the label.
- **Scaling out** (only with :attr:`Settings.scale_out_after_s`, for clusters with a node
  autoscaler). A gated pod that plans have left unplaced for ``scale_out_after_s``, not pinned
  to one node and with no static node for it, is let go *unpinned*: kube-scheduler marks it
  Unschedulable, which is what Cluster Autoscaler and Karpenter act on (a gated pod is
  invisible to them). The grace keeps a pod that capacity about to be freed will serve from
  asking for a node. Once let go it is planned like any Unschedulable pod: when a new node
  joins, its instances are made there and kube-scheduler binds it (``docs/autoscaling.md``).

Pure core: no clock (``now`` is an argument), no I/O. May import :mod:`migpilot.mig`, this
package and :mod:`migpilot.errors`.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from migpilot import errors
from migpilot.mig import layouts, profiles
from migpilot.planning import (
    constraints,
    draalloc,
    drasteering,
    dynamic,
    explaining,
    firstfit,
    incremental,
    modes,
    plans,
    snapshot,
    unified,
)

Planner = Callable[[snapshot.Snapshot], plans.Plan]
"""A planner with its options bound (``functools.partial(fast.plan, opts=...)`` and the like)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The loop's timing."""

    batch_window_s: float = 0.25
    """Seconds from the first change with pods waiting to the plan that serves them. Default
    0.25 in the controller; the simulator passes its own (1 s by default)."""
    reservation_timeout_s: float = 60.0
    """Seconds a reservation may wait, once its instances exist, for its pod to be bound before
    it expires and the pod is planned again; ten times that for instances that never appear.
    Default 60."""
    wait_log_s: float = 5.0
    """Seconds a reservation waits to be let go before :attr:`Decision.waits` names it (for the
    logs). Default 5."""
    scale_out_after_s: float | None = None
    """Seconds a gated pod may be left unplaced by the plans before it is let go, unpinned, for
    a node autoscaler to see (:attr:`Verdict.SCALE_OUT`); ``None`` (the default): never, the
    pod waits gated for room."""
    incremental: bool = True
    """Plan only the new pods while capacity has not grown since the last full replan (see the
    module); ``False``: every plan replans every waiting pod. Default on."""
    full_replan_s: float | None = 60.0
    """Seconds after a full replan at which the next plan is full again whatever changed;
    ``None``: only when capacity grows. Default 60."""
    age_after_s: float | None = 43_200.0
    """Seconds a pod may wait before it outranks the newer pods of its priority in the plans,
    whenever room can be made for it (:func:`age_ranks`); ``None``: never, the planner weighs
    every pod of a priority alike however long it waited. Default 43,200 (12 hours): long
    enough that the planner stays free to pick the pods that fit best while a crunch is
    ordinary (on the faithful openb replay the whole-GPU pods of its crunch wait up to about
    5 hours), short enough that no pod is passed over for days. Each aged pod served early
    costs the instances destroyed to make its room, and again when the room is given back:
    shorter ages served the pods of that replay's crunch sooner at more reconfigurations
    (docs/planner.md, "Faithful replay")."""
    avoid_after_expiry_s: float = 300.0
    """Seconds after a pod's reservation on a node expired unused during which the plans keep
    the pod off that node while another might hold it (:func:`avoiding`); 0: never. Default
    300, five default timeouts: a node whose device plugin never makes reservations usable is
    not tried again every minute, one with a passing fault is used again soon, and a long
    time costs little, as the pod still goes there when no other node takes it."""

    def __post_init__(self) -> None:
        if not self.batch_window_s >= 0:
            raise errors.MigpilotError(
                f"the batch window must be 0 seconds or more, got {self.batch_window_s}"
            )
        if not self.reservation_timeout_s > 0 or math.isinf(self.reservation_timeout_s):
            raise errors.MigpilotError(
                "the reservation timeout must be a finite number of seconds over 0, got "
                f"{self.reservation_timeout_s}"
            )
        every = self.full_replan_s
        if every is not None and (not every > 0 or math.isinf(every)):
            raise errors.MigpilotError(
                f"the full replan period must be a finite number of seconds over 0, got {every}"
            )
        age = self.age_after_s
        if age is not None and (not age > 0 or math.isinf(age)):
            raise errors.MigpilotError(
                f"the age after which a waiting pod outranks newer ones must be a finite number "
                f"of seconds over 0, got {age}"
            )
        avoid = self.avoid_after_expiry_s
        if not avoid >= 0 or math.isinf(avoid):
            raise errors.MigpilotError(
                "the time a node is avoided after a reservation expired there must be a finite "
                f"number of seconds, 0 or more, got {avoid}"
            )
        grace = self.scale_out_after_s
        if grace is not None and (not grace >= 0 or math.isinf(grace)):
            raise errors.MigpilotError(
                f"the scale-out grace must be a finite number of seconds, 0 or more, got {grace}"
            )


@dataclass(frozen=True, slots=True)
class Batch:
    """Where the loop stands between plans."""

    due: float | None = None
    """When the next plan runs; ``None``: none is due."""
    dirty: bool = False
    """Something changed since the last plan."""


@dataclass(frozen=True, slots=True)
class Planned:
    """What :func:`decide` decided."""

    batch: Batch
    """The batch after the step."""
    plan: plans.Plan | None
    """The plan to carry out, or ``None`` when there was nothing to plan."""
    full: str | None = None
    """Why :attr:`plan` replanned every waiting pod; ``None`` for an incremental pass (or no
    plan)."""
    backlog: tuple[str, ...] = ()
    """The waiting pods an incremental pass left out as still unplaceable, in snapshot order."""


def changed(batch: Batch, *, now: float, waiting: bool, settings: Settings) -> Batch:
    """Something changed at ``now``: mark it, and if pods wait and no plan is due, make one due
    a batch window from now (the caller wakes at :attr:`Batch.due`)."""
    due = batch.due
    if waiting and due is None:
        due = now + settings.batch_window_s
    return Batch(due=due, dirty=True)


def is_due(batch: Batch, *, now: float) -> bool:
    """Whether a plan is due at ``now``."""
    return batch.due is not None and now >= batch.due


def decide(
    snap: snapshot.Snapshot,
    batch: Batch,
    *,
    now: float,
    planner: Planner,
    backlog: incremental.Backlog | None = None,
    settings: Settings = Settings(),
) -> Planned:
    """The step at a due time: plan ``snap`` when pods wait and something changed since the last
    plan; either way no plan is due any more until the next :func:`changed`. The plan is an
    incremental pass when :func:`incremental.full_reason` finds no reason against it
    (``backlog``: what the loop remembers of the last full replan, already
    :func:`incremental.observe`-d with ``snap``), else a full replan.

    ``snap`` holds the pods still waiting (none already placed) and every reserved or
    in-flight instance as used. A step before the due time changes nothing.
    """
    if not is_due(batch, now=now):
        return Planned(batch, None)
    if not (snap.pods or snap.whole_pods) or not batch.dirty:
        return Planned(Batch(due=None, dirty=batch.dirty), None)
    full = (
        incremental.full_reason(backlog, snap, now=now, full_every_s=settings.full_replan_s)
        if settings.incremental
        else "incremental planning is off"
    )
    if full is None and backlog is not None:
        new = [p for p in snap.pods if p.key not in backlog.pods]
        left = tuple(p.key for p in snap.pods if p.key in backlog.pods)
        if not new:
            return Planned(Batch(due=None, dirty=False), None, backlog=left)
        plan = incremental.plan_new(snap, new, planner)
        still = tuple(plans.Unschedulable(k, incremental.STILL) for k in left)
        plan = replace(plan, unschedulable=(*plan.unschedulable, *still))
        return Planned(Batch(due=None, dirty=False), plan, backlog=left)
    # Dynamic MIG mode wraps the planner; without dynamic nodes or whole-GPU pods it is the
    # planner alone.
    return Planned(Batch(due=None, dirty=False), dynamic.plan(snap, planner), full=full)


# --------------------------------------------------------------------------- never runnable


@functools.lru_cache(maxsize=4096)
def fits_empty(profile_names: tuple[str, ...], model: profiles.GpuModel, gpus: int) -> bool:
    """Whether instances of these profiles fit on ``gpus`` empty GPUs of ``model``.

    First-fit decreasing, each GPU packed exactly: a yes is certain, a no may (rarely) miss a
    packing only an exhaustive search would find; callers use it to reject pods that can never
    run, where a false no would strand a pod, so it is only used for a single GPU's worth of
    instances or a whole node as kube-scheduler would see it.
    """
    bins: list[list[str]] = []
    for name in sorted(profile_names, key=lambda n: -model.profile_named(n).memory_slots):
        for b in bins:
            try:
                layouts.place(model, [*b, name])
            except errors.LayoutError:
                continue
            b.append(name)
            break
        else:
            if len(bins) == gpus:
                return False
            bins.append([name])
    return True


def never_runs(pod: snapshot.Pod, nodes: Sequence[snapshot.Node]) -> str | None:
    """Why ``pod`` could not run on any of ``nodes`` even with every GPU empty, or ``None``.

    ``nodes`` are given as they would be empty: their allocatable the node's whole CPU and
    memory, not what is left.
    In order: no node admits it (cordons, selectors, affinity, taints), no GPU advertises the
    resources it names, no node's GPUs could hold its instances, no node has the CPU or memory.
    """
    admitted = [n for n in nodes if constraints.rejection(n, pod) is None]
    if not admitted:
        if not nodes:
            return "the cluster has no node with MIG GPUs that migpilot manages"
        reasons = sorted({r for n in nodes if (r := constraints.rejection(n, pod)) is not None})
        return f"no GPU node admits it ({'; '.join(reasons[:3])})"
    plain = explaining.unresolvable(snapshot.Snapshot(nodes=tuple(admitted), pods=(pod,)))
    if pod.key in plain:
        return plain[pod.key]
    room = False
    for node in admitted:
        by_model: dict[profiles.GpuModel, int] = {}
        for gpu in node.gpus:
            by_model[gpu.model] = by_model.get(gpu.model, 0) + 1
        fits = False
        if not pod.served_in(node.mode):
            continue
        for model, count in by_model.items():
            if node.mode is not modes.Mode.MIG:
                # MPS slices or time-slicing replicas: one per GPU asked, each within a GPU.
                shared = (
                    modes.mps_needs(pod.mps, pod.unified, model)
                    if node.mode is modes.Mode.MPS
                    else modes.replica_needs(pod.unified, model)
                )
                asks = pod.unified.asks if pod.unified is not None else ()
                fits = shared is not None and all(a.count <= count for a in asks)
            else:
                names = pod.profiles_on(model)
                fits = names is not None and fits_empty(names, model, count)
            if fits:
                break
        if not fits:
            continue
        room = True
        alloc = node.allocatable
        if alloc is None or (
            pod.cpu_milli <= alloc.cpu_milli and pod.memory_bytes <= alloc.memory_bytes
        ):
            return None
    if not room:
        return "no node's GPUs could hold its instances even empty"
    return "no node that could hold its instances has the CPU and memory it asks for"


def whole_never_served(
    pod: snapshot.Pod, nodes: Sequence[snapshot.Node], whole: Whole
) -> str | None:
    """Why no dynamic node of ``nodes`` could ever serve the whole-GPU ``pod`` (``pod.whole``
    GPUs of one node), even with every GPU idle, or ``None``. ``whole``: each node's whole
    CPU and memory (a node not named has its capacity, else its allocatable)."""
    dynamic = [n for n in nodes if n.dynamic]
    if not dynamic:
        return f"no node labelled {modes.MIG_MODE_LABEL}={modes.DYNAMIC_MIG} is planned"
    admitted = [n for n in dynamic if constraints.rejection(n, pod) is None]
    if not admitted:
        reasons = sorted({r for n in dynamic if (r := constraints.rejection(n, pod)) is not None})
        return f"no dynamic node admits it ({'; '.join(reasons[:3])})"
    big = [n for n in admitted if len(n.gpus) >= pod.whole]
    if not big:
        most = max(len(n.gpus) for n in admitted)
        return f"it asks for {pod.whole} GPUs and the dynamic nodes that admit it have {most}"
    for n in big:
        alloc = whole.get(n.name, n.capacity or n.allocatable)
        if alloc is None or (
            pod.cpu_milli <= alloc.cpu_milli and pod.memory_bytes <= alloc.memory_bytes
        ):
            return None
    return "no dynamic node with that many GPUs has the CPU and memory it asks for"


def _elsewhere(observed: Observed) -> tuple[Judged, ...]:
    """The gated whole-GPU pods to let go, unpinned, before planning (:attr:`Verdict.ELSEWHERE`,
    see the module), in snapshot order; each one let go to a node that is not dynamic counts
    against that node's free ``nvidia.com/gpu`` for the next."""
    snap = observed.snapshot
    out: list[Judged] = [
        Judged(key, Verdict.ELSEWHERE, f"migpilot cannot plan it ({why}); left to kube-scheduler")
        for key, why in sorted(observed.unplannable_whole.items())
        if observed.pending.get(key, Pending()).gated
    ]
    if not snap.whole_pods:
        return tuple(out)
    # Nodes whose nvidia.com/gpu kube-scheduler may give a whole-GPU pod as before: any node
    # migpilot does not plan, and planned nodes neither dynamic nor in MIG mode (a MIG node's
    # nvidia.com/gpu are unified pods' instances).
    others = [
        *snap.outside,
        *(n for n in snap.nodes if not n.dynamic and n.mode is not modes.Mode.MIG),
    ]
    taken = {
        n.name: observed.taken.get(n.name, {}).get(unified.GPU, 0)
        for n in others
        if observed.advertised.get(n.name, {}).get(unified.GPU, 0)
    }
    for pod in snap.whole_pods:
        if not observed.pending.get(pod.key, Pending()).gated:
            continue  # kube-scheduler already tried it: it is planned, never gated again
        never = whole_never_served(pod, snap.nodes, observed.whole)
        if never is not None:
            out.append(Judged(pod.key, Verdict.ELSEWHERE, (
                f"no dynamic node can ever serve it: {never}; left to kube-scheduler for the "
                f"nodes that advertise {unified.GPU}"
            )))  # fmt: skip
            continue
        for node in others:
            if node.name not in taken or constraints.rejection(node, pod, gpus=False):
                continue
            free = observed.advertised[node.name][unified.GPU] - taken[node.name]
            if free >= pod.whole:
                taken[node.name] += pod.whole
                out.append(Judged(pod.key, Verdict.ELSEWHERE, (
                    f"node {node.name} has {free} free {unified.GPU} for it now; left to "
                    "kube-scheduler rather than switching a GPU out of MIG"
                )))  # fmt: skip
                break
    return tuple(out)


# --------------------------------------------------------------------------- the step


@dataclass(frozen=True, slots=True)
class Reserved:
    """A live reservation as the loop reads it: a pod a plan placed on a node, whose instances
    (and MPS slices) are kept for it until it is bound."""

    node: str
    gated: bool
    """Still held back by migpilot (not yet let go to kube-scheduler)."""
    made: bool
    """Every instance and slice it reserves exists."""
    missing: str | None
    """What must still happen on the node before the pod can be let go (an instance created, a
    slice served, the node Ready and reported), ``None`` once nothing."""
    asks: tuple[tuple[str, int], ...]
    """What kube-scheduler will count against the node's advertised resources: (resource, n),
    ``nvidia.com/mig-1g.10gb`` and the like."""
    pinned_there: bool = False
    """Let go with its required node affinity naming this node: it can be bound nowhere else,
    so its reservation outlives any wait."""
    stolen: bool = False
    """Another pod is using an instance or slice it reserves (one bound there without
    migpilot): the reservation can never be honoured as it stands."""
    unified: Interchange | None = None
    """For a unified pod, what tells its Allocate from another's; ``None`` for any other."""
    turned_away: str | None = None
    """Why its node no longer admits the pod (cordoned, or a taint it does not tolerate, such
    as ``karpenter.sh/disrupted`` while a node autoscaler removes the node), ``None`` while
    it does. A gated pod is then not let go there, and its reservation expires on its
    timeout: it never holds a node that is being drained or consolidated."""


@dataclass(frozen=True, slots=True)
class Interchange:
    """A unified pod as its node's device plugin tells it from others: the kubelet's Allocate
    names no pod, so the agent answers for the pod being admitted, which is right as long as
    the unified pods let go to a node and not yet allocated are interchangeable."""

    group: tuple[object, ...]
    """Its asks and reserved profiles: pods with equal groups are interchangeable."""
    allocating: bool = False
    """Let go and not yet allocated by its node's device plugin."""


@dataclass(frozen=True, slots=True)
class Pending:
    """A pod waiting without a reservation, beyond what the planner reads of it."""

    gated: bool = True
    """Held back by migpilot alone (it may be let go or refused); ``False``: kube-scheduler
    already gave up on it (Unschedulable, no gate)."""
    pinned: str | None = None
    """The node its required node affinity confines it to, ``None`` for none."""
    static: str | None = None
    unschedulable: bool = False
    """kube-scheduler found no node for it (its ``PodScheduled`` condition): not in flight."""
    """A statically laid out node with free instances for it now, ``None`` for none."""


Whole = Mapping[str, snapshot.Resources | None]
"""Per node, its whole CPU and memory."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What one step reads, from the controller's watches or the simulator's model."""

    snapshot: snapshot.Snapshot
    """The planned nodes (reserved and in-flight instances *used*) and the pods waiting without
    a reservation."""
    reserved: Mapping[str, Reserved] = field(default_factory=dict)
    """Live reservations by pod."""
    advertised: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Per node, each resource the node advertises (its allocatable)."""
    taken: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Per node, what kube-scheduler counts as taken of each resource: by the pods bound there
    and by reserved pods already let go there, not yet bound."""
    pending: Mapping[str, Pending] = field(default_factory=dict)
    """The waiting pods' extras, by key; a pod not named is gated, not pinned, with no static
    node."""
    unservable: Mapping[str, str] = field(default_factory=dict)
    """Waiting pods whose request can never be planned (a bad resource name, an unsupported
    affinity), and why."""
    stale: frozenset[str] = frozenset()
    """Nodes that keep a reservation for a pod gone, done or bound."""
    changed: bool = True
    """Something changed since the last step."""
    listing: bool = False
    """A DRA node's agent now lists first the target written for gated pods a plan steered
    there (the controller's ``pinning.listed``): the plan that lets them go is due at once,
    not a batch window later (see the module, "Steering DRA nodes")."""
    whole: Whole = field(default_factory=dict)
    """Per node, its whole CPU and memory (``None``: not constrained), for :func:`never_runs`,
    which sees the nodes empty; a node not named has its :attr:`~snapshot.Node.capacity`, else
    its allocatable."""
    unplannable_whole: Mapping[str, str] = field(default_factory=dict)
    """Waiting whole-GPU pods migpilot cannot plan (a node affinity it cannot read), and why:
    kube-scheduler may still serve them, so a gated one is let go at once
    (:attr:`Verdict.ELSEWHERE`)."""
    dra_claims: Mapping[str, draalloc.Claim] = field(default_factory=dict)
    """Per DRA pod of the snapshot (:attr:`snapshot.Pod.dra`), its claims as the allocator
    model allocates them (:func:`drasteering.claim_of`), for the first-fit check; a pod not
    named is never predicted served by first fit."""


@dataclass(frozen=True, slots=True)
class Memory:
    """What the loop remembers from one step to the next."""

    batch: Batch = Batch()
    reserved_since: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """When each reservation (pod, node) was first seen."""
    made_since: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """When each reservation was first seen with its instances made."""
    unplaced: Mapping[str, Unplaced] = field(default_factory=dict)
    """The gated pods the plans have left unplaced, without a break, that may be let go for a
    node autoscaler (only with :attr:`Settings.scale_out_after_s`)."""
    backlog: incremental.Backlog | None = None
    """What the loop remembers of the last full replan for incremental passes: the pods found
    unplaceable and the nodes as last seen; ``None`` before the first full replan."""
    avoid: Mapping[tuple[str, str], float] = field(default_factory=dict)
    """(pod, node) whose reservation there expired unused -> until when the plans keep the pod
    off the node (:func:`avoiding`)."""
    waiting_since: Mapping[str, float] = field(default_factory=dict)
    """When each pod still waiting or reserved was first seen so, by key (its age for
    :func:`age_ranks`)."""
    first_fit: Mapping[str, drasteering.Served] = field(default_factory=dict)
    """The DRA pods a round left to first fit named to let go, by key, with the node and the
    devices first fit was predicted to give them, while they wait: once let go and until their
    claims are allocated (in flight), their devices are used instances of the snapshot and
    they are not planned (:func:`drasteering.holding`)."""
    dra_targets: frozenset[str] | None = None
    """The DRA nodes a plan gave placements for DRA pods (free placements of their targets,
    listed first), until a step with no plan and no DRA pod waiting or let go and unallocated
    finds no instance there: such a step writes the targets of those with a free instance back
    to their used instances (:attr:`Decision.cleared`). ``None`` (a controller just started,
    which cannot know what an earlier one steered): every DRA node of the first step, so a
    target steered before a restart is cleared as any other."""
    dra_aside: drasteering.Aside | None = None
    """The DRA node set aside for the one gated DRA pod no node can take now
    (:func:`drasteering.set_aside`): the plans keep the other gated DRA pods off it while that
    leaves none of them waiting. Not in the API: a restarted controller sets one aside again at
    its first plan."""


@dataclass(frozen=True, slots=True)
class Unplaced:
    """A gated pod left unplaced by the plans: since when, and the last plan's reason."""

    since: float
    reason: str


@dataclass(frozen=True, slots=True)
class Expiry:
    """A reservation dropped: its pod is planned again."""

    pod: str
    node: str
    stolen: bool
    message: str
    """Why, for the pod's Warning event (``MigReservationExpired``)."""


class Verdict(enum.StrEnum):
    """What happens to a pod the loop will not place now."""

    WAIT = "wait"
    """It waits for room (Event ``MigWaiting``)."""
    REFUSE = "refuse"
    """It can never be served: let go, with a Warning (``MigRequestUnservable``), so
    kube-scheduler says the rest."""
    LET_GO = "let-go"
    """A statically laid out node has free instances for it: let go (``MigStaticLayout``)."""
    ELSEWHERE = "elsewhere"
    """A gated whole-GPU pod no dynamic node can serve, or one a node that is not dynamic has
    free whole GPUs for now: let go, unpinned, for kube-scheduler (``MigWholeGpuElsewhere``)."""
    SCALE_OUT = "scale-out"
    """No node can hold it now, for longer than :attr:`Settings.scale_out_after_s`: let go,
    unpinned, so kube-scheduler marks it Unschedulable and a node autoscaler sees it
    (``MigScaleOut``)."""


@dataclass(frozen=True, slots=True)
class Judged:
    """One pod's :class:`Verdict` and its reason."""

    pod: str
    verdict: Verdict
    reason: str


@dataclass(frozen=True, slots=True)
class Waiting:
    """A reserved pod not let go for a while, and what it waits for (for the logs)."""

    pod: str
    node: str
    why: str


@dataclass(frozen=True, slots=True)
class Decision:
    """What one :func:`reconcile` step decided, in the order the caller carries it out:
    refuse, release, expire, pin, then carry out the plan (pinning the :attr:`steered` pods of
    each node whose target is written) and judge the pods it left, or write the
    :attr:`cleared` targets."""

    memory: Memory
    """What the loop remembers for the next step."""
    refused: tuple[Judged, ...] = ()
    """Waiting pods whose request can never be served (all :attr:`Verdict.REFUSE`)."""
    elsewhere: tuple[Judged, ...] = ()
    """Gated whole-GPU pods let go, unpinned, for kube-scheduler to serve without migpilot
    (all :attr:`Verdict.ELSEWHERE`); they are not in :attr:`plan`."""
    release: tuple[str, ...] = ()
    """Nodes whose reservations for pods gone, done or bound are dropped."""
    expired: tuple[Expiry, ...] = ()
    pins: tuple[tuple[str, str], ...] = ()
    """(pod, node): reserved pods to let go, pinned to their node, in this order."""
    waits: tuple[Waiting, ...] = ()
    full: str | None = None
    """Why :attr:`plan` replanned every waiting pod; ``None`` for an incremental pass, which
    planned only the pods not in :attr:`backlog` (or for no plan)."""
    backlog: tuple[str, ...] = ()
    """The waiting pods an incremental pass left out as still unplaceable (in :attr:`plan`'s
    unschedulable pods, not in :attr:`judged`: they keep the verdict of the plan that found
    them so)."""
    plan: plans.Plan | None = None
    """The plan to carry out, ``None`` when none was due or nothing waited. Placements the
    planner made on a node without the CPU or memory their pod asks for are left out of it (a
    baseline that models GPUs only): see :attr:`unfit`."""
    unfit: tuple[str, ...] = ()
    """Pods the planner placed on a node without their CPU or memory: not placed (kube-scheduler
    could not bind them there), in :attr:`plan`'s unschedulable pods."""
    judged: tuple[Judged, ...] = ()
    """The pods the plan left unplaced, each with its verdict."""
    steered: tuple[tuple[str, str], ...] = ()
    """(pod, node): the gated pods asking through DRA claims (:attr:`snapshot.Pod.dra`) to let
    go this round, in the order to let them go in, with no reservation: pinned to their node and
    let go once their node's target is written and its agent lists it (the caller checks that;
    a node named here is written even where the plan leaves it as it was). Until then they
    stay gated and are planned again at the next plan (the agent's report is a change); one
    whose node's target could not be written too. When :attr:`dra_check` steers, those
    :attr:`plan` placed, in the order of their keys (kube-scheduler allocates the planned
    placements, which the node's agent lists first); otherwise those first fit serves, each on
    the node first fit picks, in the queue order first fit was predicted in (:attr:`plan` then
    lists nothing first for them, but for a pod a placement listed first for a pod in
    flight would take: :func:`drasteering.first_fit_plan`)."""
    dra_check: drasteering.Check | None = None
    """The first-fit check of the round's gated DRA pods (``None``: no plan, or none waits)."""
    dra_aside: drasteering.Aside | None = None
    """A DRA node newly set aside by this step (``None``: none, or the same as before), for the
    caller to tell its pod (:attr:`Memory.dra_aside` holds the current one)."""
    cleared: plans.Plan | None = None
    """With no :attr:`plan`, no DRA pod waiting and none let go and not yet allocated: the DRA
    nodes of :attr:`Memory.dra_targets` whose targets still hold free placements, written back
    to their used instances (:func:`drasteering.cleared`; the caller writes each node the plan
    changes). ``None`` for nothing to clear."""
    scale_out: tuple[Judged, ...] = ()
    """Gated pods left unplaced for :attr:`Settings.scale_out_after_s` (all
    :attr:`Verdict.SCALE_OUT`), carried out after the plan and its verdicts."""
    wake_at: float | None = None
    """The earliest time a step would decide something with nothing else changed (a plan due, a
    reservation expiring, a pod's scale-out grace over); ``None``: never."""


def reconcile(
    observed: Observed,
    memory: Memory,
    *,
    now: float,
    settings: Settings,
    planner: Planner,
) -> Decision:
    """One step of the loop (see the module for the rules), at ``now``."""
    seen = {p.key for p in observed.snapshot.pods}
    held = [
        s
        for key, s in memory.first_fit.items()
        if not (pending := observed.pending.get(key, Pending())).gated and not pending.unschedulable
    ]
    if held:
        observed = replace(observed, snapshot=drasteering.holding(observed.snapshot, held))
    first_fit = {k: s for k, s in memory.first_fit.items() if k in seen}
    batch = memory.batch
    waiting = bool(observed.snapshot.pods or observed.snapshot.whole_pods)
    if observed.changed:
        batch = changed(batch, now=now, waiting=waiting, settings=settings)
    if observed.listing and waiting:
        # The pods were planned a batch window ago; another one would only delay their pin.
        batch = Batch(due=now, dirty=True)
    refused = tuple(
        Judged(pod, Verdict.REFUSE, why) for pod, why in sorted(observed.unservable.items())
    )
    elsewhere = _elsewhere(observed)
    snap = observed.snapshot
    if elsewhere:
        let_go = {j.pod for j in elsewhere}
        snap = replace(snap, whole_pods=tuple(p for p in snap.whole_pods if p.key not in let_go))
    since, made_since = _ages(observed, memory, now=now)
    expired = _expired(observed, since, made_since, now=now, settings=settings)
    gone = {e.pod for e in expired}
    pins, waits = _pins(observed, gone, since, now=now, settings=settings)
    avoid = _avoid(memory.avoid, expired, now=now, settings=settings)
    backlog = memory.backlog
    if backlog is not None:
        backlog = incremental.observe(backlog, snap)
    waiting_since = _waiting_since(observed, memory, now=now)
    steps = avoiding(planner, _by_pod(avoid)) if avoid else planner
    if settings.age_after_s is not None:
        steps = ageing(steps, waiting_since, now=now, settings=settings)
    gated_dra = frozenset(
        p.key
        for p in observed.snapshot.pods
        if p.dra and observed.pending.get(p.key, Pending()).gated
    )
    plan_on = functools.partial(
        decide, batch=batch, now=now, planner=steps, backlog=backlog, settings=settings
    )
    aside = drasteering.plan_aside(snap, memory.dra_aside, gated_dra, plan_on, lambda p: p.plan)
    planned = aside.result
    plan = planned.plan
    unfit: tuple[str, ...] = ()
    if plan is not None:
        plan, unfit = _fitting(plan, observed.snapshot)
        if planned.full is not None:
            backlog = incremental.start(snap, (u.pod for u in plan.unschedulable), now=now)
        elif backlog is not None:
            backlog = incremental.after(backlog, snap, plan)
    judged = _judge(observed, plan, skip=frozenset(planned.backlog)) if plan is not None else ()
    unplaced, scale_out = _scale_out(observed, memory, plan, judged, now=now, settings=settings)
    steered: tuple[tuple[str, str], ...] = ()
    dra_check: drasteering.Check | None = None
    dra_pods = frozenset(p.key for p in observed.snapshot.pods if p.dra)
    dra_targets = memory.dra_targets
    if dra_targets is None:
        dra_targets = frozenset(
            n.name for n in observed.snapshot.nodes if drasteering.is_dra_node(n)
        )
    cleared: plans.Plan | None = None
    next_aside = aside.remembered
    if plan is not None:
        next_aside = aside.next(observed.snapshot, plan, planner=planner)
        checked = replace(observed, snapshot=aside.keeping(observed.snapshot))
        plan, steered, dra_check = _steering(checked, plan)
        dra_targets |= {pl.node for pl in plan.placements if pl.pod in dra_pods}
        if dra_check is not None:
            # The gated pods are decided again by each check; the ones let go stay held.
            first_fit = {
                k: s for k, s in first_fit.items() if not observed.pending.get(k, Pending()).gated
            }
            if not dra_check.steer:
                first_fit.update((s.pod, s) for s in dra_check.first_fit)
    elif not dra_pods and not held:
        # Nothing waits that a DRA node's target could be for: the free placements a plan
        # left there for pods since gone go (else its agent keeps listing them first).
        cleared, dra_targets = drasteering.cleared(observed.snapshot, dra_targets)
    kept = Memory(
        batch=planned.batch,
        reserved_since=MappingProxyType(since),
        made_since=MappingProxyType(made_since),
        unplaced=MappingProxyType(unplaced),
        backlog=backlog if settings.incremental else None,
        avoid=MappingProxyType(avoid),
        waiting_since=MappingProxyType(waiting_since),
        first_fit=MappingProxyType(first_fit),
        dra_targets=dra_targets,
        dra_aside=next_aside,
    )
    return Decision(
        memory=kept,
        refused=refused,
        elsewhere=elsewhere,
        release=tuple(sorted(observed.stale)),
        expired=expired,
        pins=pins,
        waits=waits,
        full=planned.full,
        backlog=planned.backlog,
        plan=plan,
        unfit=unfit,
        judged=judged,
        steered=steered,
        dra_check=dra_check,
        dra_aside=next_aside if next_aside != memory.dra_aside else None,
        cleared=cleared,
        scale_out=scale_out,
        wake_at=_wake_at(observed, kept, settings=settings),
    )


def _steering(
    observed: Observed, plan: plans.Plan
) -> tuple[plans.Plan, tuple[tuple[str, str], ...], drasteering.Check | None]:
    """The first-fit check (:mod:`migpilot.planning.drasteering`): the plan to carry out, the
    gated DRA pods to let go (:attr:`Decision.steered`) and the check. Steered when the plan
    places more gated DRA pods than kube-scheduler's first fit would serve now; otherwise the
    round is first fit's: the pods it serves, on the nodes it picks, and DRA targets that list
    nothing first for them (:func:`drasteering.first_fit_plan`). Pods first fit cannot serve
    stay gated, planned again at the next plan."""
    gated = frozenset(
        p.key
        for p in observed.snapshot.pods
        if p.dra and observed.pending.get(p.key, Pending()).gated
    )
    found = drasteering.check(
        observed.snapshot, plan, gated=gated, claims=observed.dra_claims, whole=observed.whole
    )
    # A DRA node where a pod let go and not yet allocated waits that the plan does not place
    # keeps the plan's target: which free placement it is being allocated is not known here.
    placed = {pl.pod for pl in plan.placements}
    keep = frozenset(
        pending.pinned
        for p in observed.snapshot.pods
        if p.dra
        and p.key not in placed
        and not (pending := observed.pending.get(p.key, Pending())).gated
        and not pending.unschedulable
        and pending.pinned is not None
    )
    if found is None or found.steer:
        # Every DRA node's target only what the plan's pods need and what is used.
        trimmed = drasteering.trimmed(observed.snapshot, plan, keep=keep)
        return trimmed, _steered(observed, plan), found
    carried = drasteering.first_fit_plan(
        observed.snapshot,
        plan,
        gated=gated,
        keep=keep,
        served=[s for s in found.first_fit if s.pod in found.racing],
    )
    # In queue order: the order they are let go in is the order kube-scheduler takes them.
    return carried, tuple((s.pod, s.node) for s in found.first_fit), found


def _steered(observed: Observed, plan: plans.Plan) -> tuple[tuple[str, str], ...]:
    """The gated DRA pods ``plan`` placed, with their node (see :attr:`Decision.steered`). An
    ungated one (kube-scheduler found no node for it) is not pinned: its node affinity can no
    longer be narrowed, and kube-scheduler tries it again as the listing changes."""
    dra = {p.key for p in observed.snapshot.pods if p.dra}
    return tuple(
        sorted(
            (pl.pod, pl.node)
            for pl in plan.placements
            if pl.pod in dra and observed.pending.get(pl.pod, Pending()).gated
        )
    )


Ages = dict[tuple[str, str], float]


def _ages(observed: Observed, memory: Memory, *, now: float) -> tuple[Ages, Ages]:
    """When each live reservation was first seen, and first seen made (the memory kept for the
    reservations still live; a new one starts now)."""
    since: Ages = {}
    made_since: Ages = {}
    for key, r in observed.reserved.items():
        k = (key, r.node)
        since[k] = memory.reserved_since.get(k, now)
        if k in memory.made_since:
            made_since[k] = memory.made_since[k]
        elif r.made:
            made_since[k] = now
    return since, made_since


def _expired(
    observed: Observed, since: Ages, made_since: Ages, *, now: float, settings: Settings
) -> tuple[Expiry, ...]:
    limit = settings.reservation_timeout_s
    out: list[Expiry] = []
    for key, r in sorted(observed.reserved.items()):
        k = (key, r.node)
        if r.stolen:
            message = (
                f"its instances on node {r.node} were taken by a pod bound there without "
                "migpilot (created ungated), or the room for them by another pod bound there; "
                "planning again"
            )
        elif not r.pinned_there and (
            now - made_since.get(k, now) > limit or now - since[k] > 10 * limit
        ):
            message = (
                f"its instances on node {r.node} were not usable in time (reservation timeout "
                f"{limit:g} s); planning again"
            )
        else:
            continue
        out.append(Expiry(key, r.node, r.stolen, message))
    return tuple(out)


def _avoid(
    before: Mapping[tuple[str, str], float],
    expired: Sequence[Expiry],
    *,
    now: float,
    settings: Settings,
) -> dict[tuple[str, str], float]:
    """(pod, node) -> until when the plans keep the pod off the node: those still on, and the
    reservations that expired unused now. A stolen one is not the node's doing (another pod
    took its instances): its node is not avoided."""
    out = {k: until for k, until in before.items() if until > now}
    if settings.avoid_after_expiry_s > 0:
        for e in expired:
            if not e.stolen:
                out[(e.pod, e.node)] = now + settings.avoid_after_expiry_s
    return out


def _by_pod(avoid: Mapping[tuple[str, str], float]) -> dict[str, frozenset[str]]:
    nodes: dict[str, set[str]] = {}
    for pod, node in avoid:
        nodes.setdefault(pod, set()).add(node)
    return {pod: frozenset(names) for pod, names in nodes.items()}


def avoiding(planner: Planner, avoid: Mapping[str, frozenset[str]]) -> Planner:
    """``planner``, keeping each pod of ``avoid`` off the nodes named for it (where its
    reservation expired unused) while another node of the snapshot might hold it
    (:func:`incremental.might_hold`): the pod is given a required node affinity excluding
    them, for the planner only. Ranked last, never forbidden: the snapshot is also planned as
    it is, and that plan is taken when the other leaves unplaced a pod kept off (its avoided
    node is better than waiting) or places fewer pods (keeping one pod off a node must not
    make another wait). Two plans only while such a pod waits to be planned, which is rare
    and brief: a placed pod is no longer planned. One place for the rule: the controller and
    the simulator plan through it."""

    def plan(snap: snapshot.Snapshot) -> plans.Plan:
        kept_off: dict[str, frozenset[str]] = {}
        for pod in snap.pods:
            nodes = avoid.get(pod.key)
            if nodes and any(
                n.name not in nodes and incremental.might_hold(pod, n) for n in snap.nodes
            ):
                kept_off[pod.key] = nodes
        if not kept_off:
            return planner(snap)
        pods = tuple(
            constraints.kept_off(p, kept_off[p.key]) if p.key in kept_off else p for p in snap.pods
        )
        found = planner(replace(snap, pods=pods))
        plain = planner(snap)
        if any(u.pod in kept_off for u in found.unschedulable) or len(found.placements) < len(
            plain.placements
        ):
            return plain
        return found

    return plan


def _waiting_since(observed: Observed, memory: Memory, *, now: float) -> dict[str, float]:
    """When each pod waiting (planned or not) or reserved was first seen so: the memory kept for
    those still there, ``now`` for a new one. A reserved pod keeps its time, so one whose
    reservation expires is as old when it is planned again."""
    before = memory.waiting_since
    snap = observed.snapshot
    keys = itertools.chain(
        (p.key for p in snap.pods), (p.key for p in snap.whole_pods), observed.reserved
    )
    return {k: before.get(k, now) for k in keys}


AGED_KINDS = 8
"""Aged pods :func:`age_ranks` tries per plan: the oldest of each request (per priority), the
oldest first. A bound on its cost where a standing backlog has aged: 103 kinds of request at
1,000 nodes cost 0.4 s of CPU a full replan, these 8 30 ms (``bench_incremental.standing``,
every backlog pod aged)."""


def age_ranks(
    snap: snapshot.Snapshot,
    since: Mapping[str, float],
    *,
    now: float,
    settings: Settings,
) -> dict[str, int]:
    """The priority each pod of ``snap`` is planned at, by key, when ageing changes anything
    (empty otherwise).

    A pod that has waited ``age_after_s`` or more (``since``: when each was first seen waiting)
    is aged. The oldest aged pod of each request (the same MIG instances or unified request, per
    priority), at most :data:`AGED_KINDS` of them, the oldest first, are tried first-fit on the
    snapshot's MIG nodes with every free instance gone (the planner may destroy free
    instances): those it places outrank every other pod of their priority. A pod of a higher
    priority still outranks every pod of a lower one, however long that waited. Ranks are
    consecutive integers from 0, in the order of (priority, outranking): the planners compare
    priorities only with each other.

    Why: the planner places the most pods, then destroys the fewest free instances. A steady
    stream of pods that reuse a free instance as it is (a whole-GPU ``7g.80gb`` pod on the
    ``7g.80gb`` instance a leaving one freed) then wins every GPU that frees, and an older pod
    of another profile (a ``4g.40gb`` one, for which the instance must be destroyed) waits for
    a moment with no such pod: 150,000 s in the faithful openb replay. kube-scheduler's queue
    is first come first served within a priority; ageing leaves the planner free with the pods
    that have not waited long, and serves the others oldest first as room frees.

    Why only the pods first-fit can place now outrank: an aged pod no room can be made for
    (four whole GPUs of one node, in a full cluster) is unplaced at any rank, and a level of its
    own would cost the planner its multi-level moves on every plan (three times the planner
    time of the faithful replay when every aged pod outranked); and aged pods that all
    outranked would compete by the planner's objective again, where the newest of them wins the
    room by reusing a free instance. Why the oldest of each request: the next of a kind is the
    oldest once its elder is placed, and first-fit's cost is a pass over the nodes per pod it
    tries that fits nowhere.
    """
    after = settings.age_after_s
    if after is None:
        return {}
    heads: dict[tuple[int, snapshot.Demand], snapshot.Pod] = {}
    for pod in snap.pods:
        if now - since.get(pod.key, now) < after:
            continue
        head = heads.get((pod.priority, pod.demand))
        if head is None or since[pod.key] < since[head.key]:
            heads[(pod.priority, pod.demand)] = pod
    if not heads:
        return {}
    aged = sorted(heads.values(), key=lambda p: (-p.priority, since[p.key]))[:AGED_KINDS]
    bare = replace(
        snap, nodes=tuple(_bare(n) for n in snap.nodes if n.mode is modes.Mode.MIG), whole_pods=()
    )
    # First-fit tries a pod on every node it passes over: only the nodes that might hold one
    # of the pods (a few, in a full cluster with a standing backlog of aged pods).
    probe = replace(bare, nodes=incremental.candidates(bare, aged, per_pod=None), pods=tuple(aged))
    first = {pl.pod for pl in firstfit.place(probe, order=aged)[1]}
    if not first:
        return {}
    levels = {p.key: (p.priority, p.key in first) for p in snap.pods}
    order = {level: rank for rank, level in enumerate(sorted(set(levels.values())))}
    return {key: order[level] for key, level in levels.items()}


def _bare(node: snapshot.Node) -> snapshot.Node:
    """``node`` with its free instances gone (those in use stay)."""
    if all(i.used for g in node.gpus for i in g.instances):
        return node
    return replace(
        node,
        gpus=tuple(
            replace(g, instances=tuple(i for i in g.instances if i.used)) for g in node.gpus
        ),
    )


def ageing(
    planner: Planner, since: Mapping[str, float], *, now: float, settings: Settings
) -> Planner:
    """``planner``, each pod of the snapshot it plans planned at its rank of :func:`age_ranks`
    (how long it has waited, ``since``: when each was first seen waiting) instead of its
    priority. The plan is the planner's: it names pods by key. Ranks are found for the
    snapshot planned, so an incremental pass (new pods only) costs nothing more."""

    def plan(snap: snapshot.Snapshot) -> plans.Plan:
        ranks = age_ranks(snap, since, now=now, settings=settings)
        if not ranks:
            return planner(snap)
        pods = tuple(
            replace(p, priority=ranks[p.key]) if p.priority != ranks[p.key] else p
            for p in snap.pods
        )
        return planner(replace(snap, pods=pods))

    return plan


def _pins(
    observed: Observed, gone: set[str], since: Ages, *, now: float, settings: Settings
) -> tuple[tuple[tuple[str, str], ...], tuple[Waiting, ...]]:
    pins: list[tuple[str, str]] = []
    waits: list[Waiting] = []
    for key, node, why in lets_go(observed, skip=frozenset(gone)):
        if why is None:
            pins.append((key, node))
        elif now - since[(key, node)] > settings.wait_log_s:
            waits.append(Waiting(key, node, why))
    return tuple(pins), tuple(waits)


def lets_go(
    observed: Observed, *, skip: frozenset[str] = frozenset()
) -> tuple[tuple[str, str, str | None], ...]:
    """Every reservation still gated (but those in ``skip``), in the order of their keys, with
    what it still waits for: ``None`` for one let go now. Each let go counts against its node's
    advertised resources for the ones after it, as kube-scheduler will count it."""
    taken = {node: Counter(amounts) for node, amounts in observed.taken.items()}
    allocating: dict[str, dict[str, tuple[object, ...]]] = {}
    for key, r in observed.reserved.items():
        if r.unified is not None and r.unified.allocating and not r.gated:
            allocating.setdefault(r.node, {})[key] = r.unified.group
    out: list[tuple[str, str, str | None]] = []
    for key, r in sorted(observed.reserved.items()):
        if not r.gated or key in skip:
            continue
        node_taken = taken.setdefault(r.node, Counter())
        why = r.missing
        if why is None and r.turned_away is not None:
            why = f"node {r.node} to admit it again ({r.turned_away})"
        why = why or _short(r, observed.advertised.get(r.node, {}), node_taken)
        others = allocating.setdefault(r.node, {})
        if why is None and r.unified is not None:
            why = _held_back(r.unified.group, others)
        if why is None:
            node_taken.update(dict(r.asks))
            if r.unified is not None:
                others[key] = r.unified.group
        out.append((key, r.node, why))
    return tuple(out)


def _short(r: Reserved, advertised: Mapping[str, int], taken: Counter[str]) -> str | None:
    """The first resource ``r``'s node does not yet advertise enough of beyond ``taken``."""
    for name, n in r.asks:
        have = advertised.get(name, 0)
        if have - taken[name] < n:
            return f"node {r.node} to advertise {name} (allocatable {have}, taken {taken[name]})"
    return None


def _held_back(group: tuple[object, ...], others: Mapping[str, tuple[object, ...]]) -> str | None:
    """Why a unified pod asking ``group`` may not be let go yet (:class:`Interchange`): it
    waits while another, asking differently (``others``: the unified pods let go to its node
    and not yet allocated, by key, never itself), is let go there."""
    for other, theirs in sorted(others.items()):
        if theirs != group:
            return f"unified pod {other}, asking differently, to be allocated first"
    return None


def _fitting(plan: plans.Plan, snap: snapshot.Snapshot) -> tuple[plans.Plan, tuple[str, ...]]:
    """``plan`` without the placements on a node left without the CPU or memory of their pod
    (counted in plan order against the node's allocatable), and those pods."""
    left = {n.name: n.allocatable for n in snap.nodes}
    pods = {p.key: p for p in snap.pods}
    used: dict[str, tuple[int, int]] = {}
    kept: list[plans.Placement] = []
    unfit: list[plans.Unschedulable] = []
    for placement in plan.placements:
        alloc = left.get(placement.node)
        pod = pods.get(placement.pod)
        if alloc is None or pod is None:
            kept.append(placement)
            continue
        cpu, mem = used.get(placement.node, (0, 0))
        cpu, mem = cpu + pod.cpu_milli, mem + pod.memory_bytes
        if cpu > alloc.cpu_milli or mem > alloc.memory_bytes:
            unfit.append(plans.Unschedulable(placement.pod, (
                f"the planner placed it on node {placement.node}, which lacks the CPU or memory "
                "it asks for"
            )))  # fmt: skip
            continue
        used[placement.node] = (cpu, mem)
        kept.append(placement)
    if not unfit:
        return plan, ()
    fitted = replace(plan, placements=tuple(kept), unschedulable=(*plan.unschedulable, *unfit))
    return fitted, tuple(u.pod for u in unfit)


def _judge(
    observed: Observed, plan: plans.Plan, *, skip: frozenset[str] = frozenset()
) -> tuple[Judged, ...]:
    """A verdict for each pod ``plan`` left unplaced, but those of ``skip`` (the backlog an
    incremental pass left out: judged by the plan that found them unplaceable)."""
    judged = [u for u in plan.unschedulable if u.pod not in skip]
    if not judged:
        # Built only for pods to judge: an incremental pass at 8,000 GPUs leaves the whole
        # backlog unschedulable (skipped), and the empty cluster costs more than the pass.
        return ()
    bare: dict[tuple[int, str], snapshot.Gpu] = {}
    empty = tuple(
        replace(
            n,
            allocatable=observed.whole.get(n.name, n.capacity or n.allocatable),
            gpus=tuple(
                bare.get((g.index, g.model.id))
                or bare.setdefault((g.index, g.model.id), snapshot.Gpu(g.index, g.model, ()))
                for g in n.gpus
            ),
        )
        for n in observed.snapshot.nodes
    )
    pods = {p.key: p for p in observed.snapshot.pods}
    out: list[Judged] = []
    for u in judged:
        extra = observed.pending.get(u.pod, Pending())
        pod = pods.get(u.pod)
        if extra.static is not None and extra.gated:
            out.append(Judged(u.pod, Verdict.LET_GO, f"node {extra.static} has free instances"))
            continue
        never = never_runs(pod, empty) if pod is not None and empty else None
        if never is not None:
            out.append(Judged(u.pod, Verdict.REFUSE, f"can never run: {never}"))
        elif extra.pinned is not None:
            out.append(Judged(u.pod, Verdict.WAIT, (
                f"pinned to node {extra.pinned}, where it can only run, once there is room: "
                f"{u.reason}"
            )))  # fmt: skip
        else:
            out.append(Judged(u.pod, Verdict.WAIT, u.reason))
    return tuple(out)


def _may_scale_out(observed: Observed, key: str) -> bool:
    """Whether a waiting pod may be let go for a node autoscaler: held back by migpilot alone,
    servable, not confined to one node (a new node could not help) and with no static node."""
    extra = observed.pending.get(key, Pending())
    return (
        extra.gated
        and extra.pinned is None
        and extra.static is None
        and key not in observed.unservable
    )


def _scale_out(
    observed: Observed,
    memory: Memory,
    plan: plans.Plan | None,
    judged: Sequence[Judged],
    *,
    now: float,
    settings: Settings,
) -> tuple[dict[str, Unplaced], tuple[Judged, ...]]:
    """The gated pods left unplaced, kept for the next step, and those whose grace is over.

    A pod stays counted while it waits gated without a break; a plan that places it, or any
    verdict but :attr:`Verdict.WAIT`, ends its count. Those let go leave the count: let go, they
    are no longer gated, and planned as Unschedulable pods."""
    grace = settings.scale_out_after_s
    if grace is None:
        return {}, ()
    waiting = {p.key for p in observed.snapshot.pods}
    unplaced = {
        k: u for k, u in memory.unplaced.items() if k in waiting and _may_scale_out(observed, k)
    }
    if plan is not None:
        for placement in plan.placements:
            unplaced.pop(placement.pod, None)
    for j in judged:
        if j.verdict is Verdict.WAIT and j.pod in waiting and _may_scale_out(observed, j.pod):
            before = unplaced.get(j.pod)
            unplaced[j.pod] = Unplaced(before.since if before is not None else now, j.reason)
        else:
            unplaced.pop(j.pod, None)
    out = tuple(
        Judged(key, Verdict.SCALE_OUT, _scale_out_reason(u, now=now))
        for key, u in sorted(unplaced.items())
        if now - u.since >= grace
    )
    for j in out:
        del unplaced[j.pod]
    return unplaced, out


def _scale_out_reason(u: Unplaced, *, now: float) -> str:
    return (
        f"no node can hold it now ({u.reason}); let go, unpinned, for a node autoscaler after "
        f"{now - u.since:.0f} s unplaced"
    )


def _wake_at(observed: Observed, memory: Memory, *, settings: Settings) -> float | None:
    """The earliest time a reservation expires, a plan is due or a pod's scale-out grace ends,
    with nothing else changed."""
    limit = settings.reservation_timeout_s
    times = [memory.batch.due] if memory.batch.due is not None else []
    if settings.scale_out_after_s is not None:
        times.extend(u.since + settings.scale_out_after_s for u in memory.unplaced.values())
    for key, r in observed.reserved.items():
        if r.pinned_there:
            continue
        k = (key, r.node)
        times.append(math.nextafter(memory.reserved_since[k] + 10 * limit, math.inf))
        if k in memory.made_since:
            times.append(math.nextafter(memory.made_since[k] + limit, math.inf))
    return min(times) if times else None
