"""A model of kube-scheduler's structured DRA allocator, for MIG placements published as
partitionable devices.

Why it exists: on a DRA node migpilot does not pick the instance a pod gets; kube-scheduler
does, with the structured allocator of ``k8s.io/dynamic-resource-allocation``. To measure what
steering buys (issue 26), the simulator needs that allocator's choices, not an idealised one;
and the control loop needs them to decide whether a round is worth steering at all (the
first-fit check, :mod:`migpilot.planning.drasteering`), so the model sits in the pure core,
below both.
What it models, from the v1.37 sources (``structured/internal/incubating``, the variant
``structured/allocator.go`` picks when beta features like DRAConsumableCapacity are on, as they
are by default; ``docs/dra.md``, "Steering kube-scheduler"):

- **Order.** ``allocateOne`` walks pools, then each pool's device slices, then each slice's
  devices in the order the slice lists them, and takes the first device that is not in use,
  matches the request's selectors, has its counters available and carries no untolerated
  ``NoSchedule``/``NoExecute`` taint. It recurses through the claim's requests and backtracks;
  the first full solution wins ("Without scoring, we stop and use the first solution"). A node's
  pool here is one slice of devices, so its order is :attr:`Pool.devices`.
- **Counters** (``checkAvailableCounters``): a device's ``consumesCounters`` must fit in what the
  pool's counter sets hold minus what allocated devices and the devices of this attempt consume.
- **Taints** (``taintPreventsAllocation``): effects ``NoSchedule`` and ``NoExecute`` exclude the
  device unless the request tolerates the taint; ``None`` is ignored.
- **Prioritized lists** (``firstAvailable``, GA in v1.37): the subrequests are tried in order, the
  first that can be satisfied wins.
- **Filter timeout** (DRASchedulerFilterTimeout, beta, on): the search is bounded; here by a
  number of steps (:data:`DEFAULT_BUDGET`) rather than a time, so that runs are deterministic.

The pool of a node is built by :func:`publish`: one counter set per GPU (a counter per memory
slice, the GPU's compute slices and its media engine, which ``+me`` profiles take) and one
device per MIG placement consuming exactly its counters, named as the driver names them
(``gpu-<index>-mig-<profile>-<start>``). The order devices are listed in is the driver's choice;
:class:`DeviceOrder` offers the two natural ones.

Pure: frozen dataclasses and functions, no clock, no I/O. May import :mod:`migpilot.errors`,
:mod:`migpilot.mig` and the planner's reading of a claim's selectors
(:class:`migpilot.planning.draclaims.Selector`, so that the model allocates what the planner
reads).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from migpilot import errors
from migpilot.mig import dra, layouts, profiles
from migpilot.planning.draclaims import Selector

DRIVER = dra.DRIVER
STEERING_TAINT = "mig.migpilot.io/unplanned"
"""The taint key steering puts on placements outside the planner's target layout."""
MAX_SLICE_DEVICES = dra.MAX_DEVICES
DEFAULT_BUDGET = 200_000
"""Search steps one allocation may take before it gives up, as the scheduler's filter timeout
does (``allocateOne`` calls, each trying one device)."""

COMPUTE_SLICES = dra.COMPUTE_COUNTER
MEDIA_ENGINES = dra.MEDIA_COUNTER


class AllocatorError(errors.MigpilotError):
    """Bad input to the allocator model: a claim or pool that cannot be allocated from."""


class Effect(enum.StrEnum):
    """A device taint's effect (``resource.k8s.io/v1`` ``DeviceTaint.effect``)."""

    NONE = "None"
    NO_SCHEDULE = "NoSchedule"
    NO_EXECUTE = "NoExecute"


@dataclass(frozen=True, slots=True)
class Taint:
    """A device taint: ``key=value:effect``."""

    key: str
    effect: Effect = Effect.NO_SCHEDULE
    value: str = ""


STEERED = Taint(STEERING_TAINT, Effect.NO_SCHEDULE, "true")
"""The taint steering puts on the placements it does not offer."""


@dataclass(frozen=True, slots=True)
class CounterSet:
    """One ``sharedCounters`` entry: named counters with what the hardware holds."""

    name: str
    counters: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Device:
    """One published device: a MIG placement on one GPU, and the counters it consumes."""

    name: str
    gpu: int
    model: str
    """The GPU model's id (attribute ``model``)."""
    profile: str
    start: int
    memory_mib: int
    """Capacity ``memory``."""
    compute_slices: int
    counter_set: str
    consumes: tuple[tuple[str, int], ...]

    @property
    def placement(self) -> tuple[int, str, int]:
        """``(gpu, profile, start)``."""
        return (self.gpu, self.profile, self.start)


@dataclass(frozen=True, slots=True)
class Pool:
    """A node's pool: its counter sets and its devices, in the order the allocator walks them."""

    node: str
    counter_sets: tuple[CounterSet, ...]
    devices: tuple[Device, ...]
    by_name: Mapping[str, Device] = field(init=False, compare=False, repr=False)
    capacity: Mapping[tuple[str, str], int] = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        by_name: dict[str, Device] = {}
        for d in self.devices:
            if d.name in by_name:
                # The real allocator marks such a pool invalid and allocates nothing from it.
                raise AllocatorError(f"pool {self.node}: duplicate device name {d.name}")
            by_name[d.name] = d
        capacity = {(cs.name, c): n for cs in self.counter_sets for c, n in cs.counters}
        for d in self.devices:
            for counter, _ in d.consumes:
                if (d.counter_set, counter) not in capacity:
                    raise AllocatorError(
                        f"pool {self.node}: device {d.name} consumes {counter} of counter set "
                        f"{d.counter_set}, which the pool does not publish"
                    )
        object.__setattr__(self, "by_name", MappingProxyType(by_name))
        object.__setattr__(self, "capacity", MappingProxyType(capacity))


class DeviceOrder(enum.StrEnum):
    """The order a driver lists a GPU's placements in (GPUs by index, one after another)."""

    START = "start"
    """By start slot, the larger profile first at one start (how ``nvidia-smi mig -lgipp`` and
    the layout geometry enumerate placements)."""
    PROFILE = "profile"
    """Profile by profile as the model lists them (smallest first), each by start."""


device_name = dra.device_name
"""The driver's name of a placement, ``gpu-0-mig-3g-40gb-4`` (as the agent publishes it)."""


def counter_set_name(gpu: int) -> str:
    """The counter set of GPU ``gpu``."""
    return f"gpu-{gpu}-counters"


def _gpu_counters(model: profiles.GpuModel, gpu: int) -> CounterSet:
    counters = [(dra.memory_counter(k), 1) for k in range(model.memory_slots)]
    counters.append((COMPUTE_SLICES, model.compute_slices))
    counters.append((MEDIA_ENGINES, 1))
    return CounterSet(counter_set_name(gpu), tuple(counters))


def _device(model: profiles.GpuModel, gpu: int, profile: profiles.Profile, start: int) -> Device:
    consumes = [(dra.memory_counter(k), 1) for k in range(start, start + profile.memory_slots)]
    consumes.append((COMPUTE_SLICES, profile.compute_slices))
    if profile.media_extension:
        consumes.append((MEDIA_ENGINES, 1))
    return Device(
        name=device_name(gpu, profile.name, start),
        gpu=gpu,
        model=model.id,
        profile=profile.name,
        start=start,
        memory_mib=profile.memory_mib or 0,
        compute_slices=profile.compute_slices,
        counter_set=counter_set_name(gpu),
        consumes=tuple(consumes),
    )


def publish(
    node: str, model: profiles.GpuModel, *, gpus: int, order: DeviceOrder = DeviceOrder.PROFILE
) -> Pool:
    """A node's pool as the driver publishes it with every placement offered (uncurated)."""
    if gpus < 1:
        raise AllocatorError(f"node {node}: a pool needs at least one GPU, got {gpus}")
    return pool_of(node, [(gpu, model) for gpu in range(gpus)], order=order)


def pool_of(
    node: str,
    gpus: Sequence[tuple[int, profiles.GpuModel]],
    *,
    order: DeviceOrder = DeviceOrder.PROFILE,
) -> Pool:
    """The pool of a node whose MIG GPUs are ``gpus`` ((index, model), in the order the driver
    lists them), every placement offered: :func:`publish` for a node whose GPUs are not all
    0..n-1 of one model (a GPU held whole or left out is not in its pool)."""
    if not gpus:
        raise AllocatorError(f"node {node}: a pool needs at least one GPU")
    indexes = [gpu for gpu, _ in gpus]
    if len(set(indexes)) != len(indexes):
        raise AllocatorError(f"node {node}: GPU indexes {indexes} repeat")
    sets: list[CounterSet] = []
    devices: list[Device] = []
    for gpu, model in gpus:
        sets.append(_gpu_counters(model, gpu))
        placed = [(p, s) for p in model.profiles for s in p.placements]
        if order is DeviceOrder.START:
            placed.sort(key=lambda ps: (ps[1], -ps[0].memory_slots, -ps[0].compute_slices))
        devices.extend(_device(model, gpu, p, s) for p, s in placed)
    return Pool(node, tuple(sets), tuple(devices))


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a claim: ``count`` devices matching one of ``alternatives``.

    One alternative is a plain request (``exactly``); several are a prioritized list
    (``firstAvailable``), tried in order.
    """

    count: int
    alternatives: tuple[Selector, ...]

    def __post_init__(self) -> None:
        if self.count < 1:
            raise AllocatorError(f"a request asks for at least one device, got {self.count}")
        if not self.alternatives:
            raise AllocatorError("a request needs a selector (or a list of them)")


@dataclass(frozen=True, slots=True)
class Claim:
    """A ResourceClaim: its requests, all allocated on one node, and the taints it tolerates."""

    requests: tuple[Request, ...]
    tolerates: frozenset[str] = frozenset()
    """Taint keys every request tolerates (any effect)."""

    def __post_init__(self) -> None:
        if not self.requests:
            raise AllocatorError("a claim needs at least one request")


Taints = Mapping[str, tuple[Taint, ...]]
"""Per device name, its taints (from the slice or from DeviceTaintRules)."""
NO_TAINTS: Taints = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class Allocation:
    """What :func:`allocate` found: the devices, per request in order, or ``None``."""

    devices: tuple[Device, ...] | None
    steps: int
    """Search steps taken."""
    timed_out: bool = False


def _blocked(taints: tuple[Taint, ...], tolerates: frozenset[str]) -> bool:
    return any(
        t.effect in (Effect.NO_SCHEDULE, Effect.NO_EXECUTE) and t.key not in tolerates
        for t in taints
    )


def available_counters(pool: Pool, allocated: Iterable[str]) -> dict[tuple[str, str], int]:
    """What the pool's counters hold once the ``allocated`` devices' consumption is taken out."""
    left = dict(pool.capacity)
    for name in allocated:
        device = pool.by_name.get(name)
        if device is None:
            raise AllocatorError(f"pool {pool.node} has no device {name} (allocated)")
        for counter, n in device.consumes:
            left[(device.counter_set, counter)] -= n
    return left


class _Search:
    """One ``Allocate`` call: the recursive, first-solution search of ``allocateOne``."""

    def __init__(
        self,
        pool: Pool,
        claim: Claim,
        allocated: frozenset[str],
        taints: Taints,
        budget: int,
    ) -> None:
        self.pool = pool
        self.claim = claim
        self.allocated = allocated
        self.taints = taints
        self.budget = budget
        self.steps = 0
        self.left = available_counters(pool, allocated)
        self.taking: list[Device] = []
        self.using: set[str] = set()
        # Which devices each selector matches, in walk order (the allocator caches matches too).
        self.candidates: dict[Selector, tuple[Device, ...]] = {}

    def _matching(self, selector: Selector) -> tuple[Device, ...]:
        found = self.candidates.get(selector)
        if found is None:
            found = tuple(d for d in self.pool.devices if selector.matches(d))
            self.candidates[selector] = found
        return found

    def _fits(self, device: Device) -> bool:
        if device.name in self.allocated or device.name in self.using:
            return False
        if any(self.left[(device.counter_set, c)] < n for c, n in device.consumes):
            return False
        return not _blocked(self.taints.get(device.name, ()), self.claim.tolerates)

    def _take(self, device: Device) -> None:
        for c, n in device.consumes:
            self.left[(device.counter_set, c)] -= n
        self.using.add(device.name)
        self.taking.append(device)

    def _give_back(self, device: Device) -> None:
        for c, n in device.consumes:
            self.left[(device.counter_set, c)] += n
        self.using.discard(device.name)
        self.taking.pop()

    def run(self, request: int) -> bool:
        if request == len(self.claim.requests):
            return True
        req = self.claim.requests[request]
        # firstAvailable: the first subrequest that leads to a full solution wins.
        return any(self._one(request, sel, req.count, 0) for sel in req.alternatives)

    def _one(self, request: int, selector: Selector, left: int, first: int) -> bool:
        if left == 0:
            return self.run(request + 1)
        self.steps += 1
        if self.steps > self.budget:
            raise _OutOfBudgetError
        candidates = self._matching(selector)
        # Devices of one request are combined in walk order only (the allocator's
        # startLocation): {1, 2} is tried, {2, 1} is not.
        for i in range(first, len(candidates)):
            device = candidates[i]
            if not self._fits(device):
                continue
            self._take(device)
            if self._one(request, selector, left - 1, i + 1):
                return True
            self._give_back(device)
        return False


class _OutOfBudgetError(Exception):
    """The search ran out of steps (the filter timeout)."""


def allocate(
    pool: Pool,
    claim: Claim,
    *,
    allocated: frozenset[str] = frozenset(),
    taints: Taints = NO_TAINTS,
    budget: int = DEFAULT_BUDGET,
) -> Allocation:
    """The devices kube-scheduler's allocator gives ``claim`` from ``pool``, or ``None``.

    ``allocated`` are the pool's devices already allocated to other claims; ``taints`` the
    devices' taints. The first solution in walk order wins, as in the real allocator.
    """
    search = _Search(pool, claim, allocated, taints, budget)
    try:
        found = search.run(0)
    except _OutOfBudgetError:
        return Allocation(None, search.steps, timed_out=True)
    return Allocation(tuple(search.taking) if found else None, search.steps)


def steering_taints(
    pool: Pool, *, offered: Iterable[str], allocated: Iterable[str], fresh: bool = True
) -> Taints:
    """The taints steering puts on ``pool``: :data:`STEERED` on every device that is neither
    ``offered`` (a placement of the planner's target layout waiting for its pod) nor
    ``allocated``.

    Allocated devices are never tainted: a ``NoSchedule`` taint on one would keep a new pod
    sharing its claim from scheduling. When the plan is not ``fresh`` (the controller has not
    renewed it in time) nothing is tainted, so allocation goes on, unsteered.
    """
    if not fresh:
        return NO_TAINTS
    keep = set(offered) | set(allocated)
    unknown = sorted(keep - set(pool.by_name))
    if unknown:
        raise AllocatorError(f"pool {pool.node} has no device {unknown[0]} to offer")
    return MappingProxyType({d.name: (STEERED,) for d in pool.devices if d.name not in keep})


def planned_first(pool: Pool, planned: Iterable[str]) -> Pool:
    """``pool`` as order steering publishes it: the ``planned`` devices first, smallest first
    (by memory, then compute slices, then GPU and start), then every other device in the
    pool's order.

    kube-scheduler's allocator (v1.37, ``GatherPools``) sorts a pool's slices by name and walks
    each slice's devices in the order listed, taking the first that fits; with the planned
    placements in the slice that sorts first, a claim gets a planned placement when one fits
    it and any other free placement otherwise, and a claim by memory gets the smallest planned
    placement that holds it rather than one planned for a larger claim.
    """
    first = set(planned)
    unknown = sorted(first - set(pool.by_name))
    if unknown:
        raise AllocatorError(f"pool {pool.node} has no device {unknown[0]} to list first")
    ahead = sorted(
        (d for d in pool.devices if d.name in first),
        key=lambda d: (d.memory_mib, d.compute_slices, d.gpu, d.start),
    )
    rest = tuple(d for d in pool.devices if d.name not in first)
    return Pool(pool.node, pool.counter_sets, (*ahead, *rest))


def best_fit(pool: Pool, allocated: Iterable[str], model: profiles.GpuModel) -> Pool:
    """``pool`` listed so that kube-scheduler's first fit is a best fit, for the allocations
    ``allocated``: profile by profile as the model lists them (smallest first, so a claim by
    memory gets the smallest profile that fits), and within a profile the placements that cost
    their GPU the least free room first (:func:`migpilot.mig.layouts.free_value`, the planner's
    measure of room: a 1g.10gb beside a 3g.40gb rather than at the only start of a 4g.40gb),
    then on the most used GPU (whole GPUs stay free for whole-GPU profiles), then by GPU and
    start. Placements that do not fit now go last in their profile.

    The order depends on what is allocated, so the driver lists it again after every change.
    """
    if any(d.model != model.id for d in pool.devices):
        raise AllocatorError(f"pool {pool.node} holds devices of another model than {model.id}")
    per_gpu: dict[int, list[layouts.Instance]] = {}
    for name in allocated:
        device = pool.by_name.get(name)
        if device is None:
            raise AllocatorError(f"pool {pool.node} has no device {name} (allocated)")
        per_gpu.setdefault(device.gpu, []).append(layouts.Instance(device.start, device.profile))
    rank = {p.name: i for i, p in enumerate(model.profiles)}
    room = {g: _room(model, frozenset(insts)) for g, insts in per_gpu.items()}
    empty = _room(model, frozenset())
    used = {
        g: sum(model.profile_named(i.profile).compute_slices for i in insts)
        for g, insts in per_gpu.items()
    }

    def key(d: Device) -> tuple[int, int, int, int, int, int]:
        loss = room.get(d.gpu, empty).get((d.profile, d.start))
        if loss is None:
            return (rank[d.profile], 1, 0, 0, d.gpu, d.start)
        return (rank[d.profile], 0, loss, -used.get(d.gpu, 0), d.gpu, d.start)

    return Pool(pool.node, pool.counter_sets, tuple(sorted(pool.devices, key=key)))


@functools.lru_cache(maxsize=4096)
def _room(
    model: profiles.GpuModel, instances: frozenset[layouts.Instance]
) -> dict[tuple[str, int], int]:
    """Per placement that fits beside ``instances``: the free room it costs the GPU."""
    layout = layouts.Layout.of(instances)
    before = layouts.free_value(model, layout)
    out: dict[tuple[str, int], int] = {}
    for p in model.profiles:
        for start in p.placements:
            inst = layouts.Instance(start, p.name)
            if inst in instances or layouts.violation(model, (*instances, inst)) is not None:
                continue
            out[(p.name, start)] = before - layouts.free_value(
                model, layouts.Layout.of((*instances, inst))
            )
    return out


def prioritized(selector: Selector, models: Sequence[profiles.GpuModel]) -> tuple[Selector, ...]:
    """A selector by memory rewritten as a ``firstAvailable`` list, smallest profile first: one
    subrequest per plain profile of ``models`` with the memory asked (by memory, then compute),
    each keeping the model condition. What a claim author can do without migpilot so that
    first-fit takes the smallest fitting profile it can."""
    if selector.min_memory_mib is None or selector.profile is not None:
        return (selector,)
    need = selector.min_memory_mib
    best: dict[str, tuple[int, int]] = {}
    for model in models:
        if selector.model is not None and model.id != selector.model:
            continue
        for p in model.profiles:
            if p.attribute is not profiles.Attribute.NONE or (p.memory_mib or 0) < need:
                continue
            key = ((p.memory_mib or 0), p.compute_slices)
            best[p.name] = min(best.get(p.name, key), key)
    if not best:
        return (selector,)
    names = sorted(best, key=lambda n: (*best[n], n))
    # Each keeps the memory condition: a profile name can hold a little less on another model.
    return tuple(Selector(profile=n, min_memory_mib=need, model=selector.model) for n in names)
