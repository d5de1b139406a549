"""The node's pool of DRA devices as ResourceSlices, and the writes that publish it.

Why it exists: in DRA mode kube-scheduler, not migpilot, picks the MIG placement of a claim, from
the devices the node publishes (``resource.k8s.io/v1`` ResourceSlices of driver
``mig.migpilot.io``, one pool named after the node). MIG placements overlap, so they are
*partitionable devices* (KEP-4815): each GPU has a counter set, and each placement consumes
exactly the counters its instance would take; kube-scheduler allocates a device only while the
counters it consumes are left. This module turns what the agent knows of its GPUs and their
instances into that pool (:func:`pool`), and compares it with the slices the API server holds
(:func:`reconcile`) so that the shell (:mod:`migpilot.agent.cluster.resourceslices`) only writes
what changed. ``docs/dra.md``, "Publishing", says the same for users.

The counters of GPU ``i``, counter set ``gpu-<i>`` (counter names must be DNS labels):

- ``memory-slice-<k>``, 1 for each memory slice ``k`` (the ``memorySlice<k>`` of the KEP's MIG
  example): a placement consumes exactly the slices it covers, so two overlapping placements can
  never both be allocated;
- ``compute-slices``, the GPU's compute slices: a placement consumes its profile's. One counter
  for all of them, not one per slice: MIG ties an instance to memory slices, not to particular
  compute slices, so a counter per compute slice would invent a position;
- ``media-engines``, 1: the ``+me`` profiles consume it (one per GPU takes the media engines).

Over the whole catalog these three rules allow exactly the layouts :func:`layouts.violation`
allows (``tests/unit/test_dra_publishing.py`` enumerates them), so kube-scheduler cannot allocate
a set of placements MIG would refuse.

**Instances in use.** An instance used by something other than a DRA claim of this driver (a
pod of the device plugin, a process, an instance the agent cannot account for: no MIG device
UUID, or the in-use sources could not be read) must never be offered. Its counters are set to 0
in its GPU's counter set (its memory slices to 0, ``compute-slices`` less its compute, its media
engines to 0 for a ``+me`` profile), so neither its own device nor any placement overlapping it
can be allocated. The counters are set to 0, never left out: kube-scheduler's allocator marks
the whole pool invalid when a device consumes a counter its set lacks. An instance prepared for
a DRA claim keeps its counters: the claim's allocation already consumes them, and the device
stays published so that the allocation stays valid. A free instance is offered like any other
placement. A GPU with MIG off is one device, ``gpu-<i>``, consuming every counter of its set;
used by anything else than a claim, its counters are all 0.

**Attributes** (unqualified names, so in the driver's domain:
``device.attributes["mig.migpilot.io"].profile``): ``type`` (``mig`` or ``gpu``), ``model`` (the
catalog's id, ``a100-80gb``), ``profile`` (``3g.40gb``; ``whole`` for a whole GPU), ``start``
(int, the first memory slice; 0 for a whole GPU), ``gpuUUID``, ``gpuIndex`` (int). Every device
has every attribute: a CEL selector that reads an attribute a device lacks fails the claim's
allocation rather than skipping the device. **Capacity**: ``memory``, the instance's memory as
the driver reports it (``40192Mi`` for an A100 80GB's ``3g.40gb``: a claim for ``40Gi`` does not
get it).

**Slices.** A ResourceSlice holds either counter sets (at most 8) or devices (at most 64 when they
consume counters: ``ResourceSliceMaxDevicesWithAdvancedFeatures`` of v1.37; 128 is the limit of
plain devices), so a pool is counter slices (``N-mig.migpilot.io-counters-0000``...), then device
slices (``N-mig.migpilot.io-devices-0001``...), each GPU's devices kept together while they fit
(a change on one GPU rewrites few slices), smallest placements first (kube-scheduler takes the
first device that fits: a claim by memory gets the smallest profile that holds it). Indices are
zero-padded: kube-scheduler walks a pool's slices sorted by name as strings. Output is sorted:
the same input gives equal objects.

**Steering** (``docs/dra.md``, "Steering kube-scheduler"). The planner's placements for the node
that are free now are listed in the device slice ``N-mig.migpilot.io-devices-0000``, which sorts
first, smallest first; every other device stays in its home slice, the same as without a plan.
kube-scheduler's first fit then takes a planned placement when one fits the claim, any other
free one otherwise. A device allocated to a claim is never moved from one slice to another in
place (:attr:`Pool.pinned`; the first slice keeps those it holds), and :func:`reconcile` orders
the in-place writes of a change of plan so that no device is ever missing from the pool (each
is added to its new slice before it leaves its old one: for that moment the pool is invalid,
and kube-scheduler allocates nothing from it).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.agent.dra import placements
from migpilot.api import gpulayouts
from migpilot.mig import dra, layouts, profiles

DRIVER = placements.DRIVER
API_VERSION = "resource.k8s.io/v1"
KIND = "ResourceSlice"
MAX_COUNTER_SETS = 8
"""``ResourceSliceMaxCounterSets``: counter sets in one slice."""
MAX_DEVICES = dra.MAX_DEVICES
MAX_COUNTERS = 32
"""``ResourceSliceMaxCountersPerCounterSet`` and ``...PerDeviceCounterConsumption``."""
MAX_SLICE_NAME = 253
"""A ResourceSlice's name is a DNS subdomain."""

COMPUTE_COUNTER = dra.COMPUTE_COUNTER
MEDIA_COUNTER = dra.MEDIA_COUNTER

TYPE_ATTRIBUTE = "type"
MODEL_ATTRIBUTE = "model"
PROFILE_ATTRIBUTE = "profile"
START_ATTRIBUTE = "start"
GPU_UUID_ATTRIBUTE = "gpuUUID"
GPU_INDEX_ATTRIBUTE = "gpuIndex"
MEMORY_CAPACITY = "memory"
MIG_TYPE = "mig"
GPU_TYPE = "gpu"
WHOLE_PROFILE = "whole"
"""The ``profile`` of a whole GPU (every device has every attribute)."""

_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


class PublishingError(errors.MigpilotError):
    """What the agent knows of its GPUs cannot be published (the message says why)."""


class Use(enum.StrEnum):
    """Who uses an instance (or a whole GPU)."""

    FREE = "free"
    """Nobody: it is offered."""
    CLAIM = "claim"
    """A DRA claim of this driver: published as allocated (the claim consumes its counters)."""
    OTHER = "other"
    """Anything else, or unknown: never offered, nor anything overlapping it."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of the node."""

    index: int
    uuid: str
    model: profiles.GpuModel
    mig: bool
    """MIG on: its placements are published; off: the GPU is one device."""
    memory_mib: int
    """The whole GPU's memory (the capacity of its ``gpu-<i>`` device)."""
    use: Use = Use.FREE
    """With MIG off, who uses the whole GPU; with MIG on it must be ``FREE`` (its instances
    say who uses what)."""


@dataclass(frozen=True, slots=True)
class Instance:
    """One MIG instance that exists on a GPU of the node."""

    gpu: int
    profile: str
    """The canonical profile name."""
    start: int
    uuid: str | None
    """The MIG device's UUID; ``None`` for a GPU instance without its compute instance."""
    use: Use


@dataclass(frozen=True, slots=True)
class Pool:
    """The node's pool: each slice's name and content (``sharedCounters`` or ``devices``), in
    order."""

    node: str
    contents: tuple[Mapping[str, Any], ...]
    names: tuple[str, ...]
    """The slices' names, one per content (:func:`counter_slice_name`,
    :func:`device_slice_name`)."""
    pinned: frozenset[str] = frozenset()
    """Devices allocated to a DRA claim (its instance prepared): never moved from one slice to
    another within a pool generation (missing for a moment, an allocated device would stop
    consuming its counters, and kube-scheduler could hand out a placement overlapping it)."""

    def __post_init__(self) -> None:
        if len(self.names) != len(self.contents):
            raise PublishingError(
                f"pool {self.node}: {len(self.names)} slice names for {len(self.contents)} slices"
            )

    def slice_name(self, index: int) -> str:
        """The name of slice ``index``."""
        return self.names[index]

    def documents(self, generation: int) -> tuple[dict[str, Any], ...]:
        """The ResourceSlice objects of the pool at ``generation``."""
        count = len(self.contents)
        out = []
        for name, content in zip(self.names, self.contents, strict=True):
            spec: dict[str, Any] = {
                "driver": DRIVER,
                "nodeName": self.node,
                "pool": {"name": self.node, "generation": generation, "resourceSliceCount": count},
            }
            spec.update(_copy(content))
            out.append(
                {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}
            )
        return tuple(out)


SLICE_DIGITS = 4
"""Slice indices are zero-padded to this many digits: kube-scheduler walks a pool's slices
sorted by name as strings, where ``-10`` would come before ``-2``."""
MAX_SLICES = 10**SLICE_DIGITS
"""Counter slices, or device slices, a pool may have (their indices have four digits)."""
FIRST_SLICE = 0
"""The index of the device slice of the planned placements (:func:`pool`'s ``planned``): its
name sorts first among the device slices, so kube-scheduler looks there first."""


def counter_slice_name(node: str, index: int) -> str:
    """The name of the pool's counter slice ``index``
    (``node-1-mig.migpilot.io-counters-0000``)."""
    return f"{node}-{DRIVER}-counters-{index:0{SLICE_DIGITS}d}"


def device_slice_name(node: str, index: int) -> str:
    """The name of the pool's device slice ``index`` (``node-1-mig.migpilot.io-devices-0001``):
    index :data:`FIRST_SLICE` holds the planned placements; 1 and up each hold a part of the
    GPUs' devices, always the same part (their home), whatever is planned."""
    return f"{node}-{DRIVER}-devices-{index:0{SLICE_DIGITS}d}"


memory_counter = dra.memory_counter


def counter_set(gpu: int) -> str:
    """The counter set of GPU ``gpu``."""
    return f"gpu-{gpu}"


# --- the pool ----------------------------------------------------------------------------------


def pool(
    node: str,
    gpus: Iterable[Gpu],
    instances: Iterable[Instance],
    *,
    planned: Iterable[placements.Placement] = (),
    listed_first: Collection[str] = frozenset(),
) -> Pool:
    """The pool of ``node``: its GPUs' counter sets, less what ``instances`` used by others take,
    and a device per MIG placement (MIG on) or per GPU (MIG off). Raise
    :class:`PublishingError` naming the problem for input that describes no real node.

    Steering (``docs/dra.md``, "Steering kube-scheduler"): the ``planned`` placements that are
    free and valid on their GPU now (:func:`free_planned`) are listed in the device slice
    :data:`FIRST_SLICE`, whose name sorts first, smallest first (memory, compute slices, GPU,
    start), at most :data:`MAX_DEVICES`; every other device in its home slice as without a
    plan. ``listed_first``: the devices the published first slice holds; those allocated to a
    claim stay there (:attr:`Pool.pinned` never move). Without either, no first slice."""
    _check_node(node)
    by_index = _gpus_by_index(gpus)
    on_gpu = _instances_by_gpu(instances, by_index)
    sets: list[dict[str, Any]] = []
    devices: list[list[dict[str, Any]]] = []
    for index in sorted(by_index):
        gpu = by_index[index]
        sets.append({"name": counter_set(index), "counters": _counters(gpu, on_gpu[index])})
        devices.append(_devices(gpu))
    pinned = _pinned(by_index, on_gpu)
    kept = {name for name in listed_first if name in pinned}
    free = free_planned(planned, by_index, on_gpu)
    first = kept | set(free[: max(MAX_DEVICES - len(kept), 0)])
    counter_chunks = [sets[i : i + MAX_COUNTER_SETS] for i in range(0, len(sets), MAX_COUNTER_SETS)]
    names = [counter_slice_name(node, i) for i in range(len(counter_chunks))]
    contents: list[Mapping[str, Any]] = [{"sharedCounters": chunk} for chunk in counter_chunks]
    ahead = [d for devs in devices for d in devs if d["name"] in first]
    if ahead:
        names.append(device_slice_name(node, FIRST_SLICE))
        contents.append({"devices": sorted(ahead, key=_first_key)})
    homes = _packed(devices)
    for home, chunk in enumerate(homes, start=FIRST_SLICE + 1):
        rest = [d for d in chunk if d["name"] not in first]
        if rest:  # a home whose devices are all listed first is left out
            names.append(device_slice_name(node, home))
            contents.append({"devices": rest})
    if len(counter_chunks) >= MAX_SLICES or len(homes) >= MAX_SLICES:
        raise PublishingError(f"node {node}: more than {MAX_SLICES - 1} slices of one kind")
    longest = max(names, key=len, default="")
    if len(longest) > MAX_SLICE_NAME:
        raise PublishingError(
            f"node name {node!r} is too long for ResourceSlice names ({longest!r} is longer "
            f"than {MAX_SLICE_NAME})"
        )
    return Pool(node, tuple(contents), tuple(names), frozenset(pinned))


def planned_placements(spec: gpulayouts.LayoutSpec | None) -> tuple[placements.Placement, ...]:
    """The placements of a GpuLayout spec (the planner's target for the node: every instance,
    reserved for a pod or not), for :func:`pool`'s ``planned``; none without a spec."""
    if spec is None:
        return ()
    return tuple(
        placements.Placement(gpu.index, inst.profile, inst.start)
        for gpu in spec.gpus
        for inst in gpu.instances
    )


def free_planned(
    planned: Iterable[placements.Placement],
    gpus: Mapping[int, Gpu],
    on_gpu: Mapping[int, Sequence[tuple[Instance, layouts.Footprint]]],
) -> list[str]:
    """The device names of the ``planned`` placements that kube-scheduler could allocate now,
    smallest first: on a GPU with MIG on, a placement of its model, overlapping no instance
    that is used (by a claim or anyone else: memory slices, media engines) and leaving room
    for it in the compute slices. Others are left out: the plan is the controller's, read as
    it was written, and the GPUs may have changed since."""
    out: dict[str, tuple[int, ...]] = {}
    for want in planned:
        gpu = gpus.get(want.gpu)
        if gpu is None or not gpu.mig:
            continue
        geo = layouts.geometry(gpu.model)
        try:
            footprint = geo.placement(layouts.Instance(want.start, want.profile))
        except errors.MigpilotError:
            continue
        used = [f for inst, f in on_gpu.get(want.gpu, ()) if inst.use is not Use.FREE]
        if any(f.mask & footprint.mask or (f.media and footprint.media) for f in used):
            continue
        if sum(f.compute for f in used) + footprint.compute > gpu.model.compute_slices:
            continue
        profile = geo.profiles[footprint.profile]
        name = placements.device_name(placements.Placement(want.gpu, profile.name, want.start))
        out[name] = _size(profile, want.gpu, want.start)
    return sorted(out, key=lambda n: out[n])


def _size(profile: profiles.Profile, gpu: int, start: int) -> tuple[int, ...]:
    """Smallest first: memory, compute slices, then GPU and start (as ``draalloc``'s model)."""
    memory = profile.memory_mib if profile.memory_mib is not None else profile.nominal_gb * 1024
    return (memory, profile.compute_slices, gpu, start)


def _first_key(device: Mapping[str, Any]) -> tuple[int, ...]:
    """The order of the first slice, read back from a device's own attributes and capacity."""
    attrs = device["attributes"]
    memory = _mib(device["capacity"][MEMORY_CAPACITY]["value"])
    consumed = device["consumesCounters"][0]["counters"]
    compute = int(consumed[COMPUTE_COUNTER]["value"])
    return (memory, compute, attrs[GPU_INDEX_ATTRIBUTE]["int"], attrs[START_ATTRIBUTE]["int"])


def _mib(quantity: str) -> int:
    """MiB of a quantity this module writes (``40192Mi``, ``80Gi``, ``10G``)."""
    units = {"Mi": 1, "Gi": 1024, "Ti": 1024**2, "Pi": 1024**3, "Ei": 1024**4, "G": 1024}
    for unit in sorted(units, key=len, reverse=True):
        if quantity.endswith(unit):
            return int(quantity[: -len(unit)]) * units[unit]
    return int(quantity) // (1024 * 1024)


def _pinned(
    gpus: Mapping[int, Gpu], on_gpu: Mapping[int, Sequence[tuple[Instance, layouts.Footprint]]]
) -> set[str]:
    """The devices allocated to DRA claims (their instances prepared, or whole GPUs)."""
    out = {
        placements.whole_gpu_name(i)
        for i, gpu in gpus.items()
        if not gpu.mig and gpu.use is Use.CLAIM
    }
    for index, insts in on_gpu.items():
        geo = layouts.geometry(gpus[index].model)
        for inst, footprint in insts:
            if inst.use is Use.CLAIM:
                profile = geo.profiles[footprint.profile].name
                out.add(placements.device_name(placements.Placement(index, profile, inst.start)))
    return out


def _check_node(node: str) -> None:
    if not node or len(node) > MAX_SLICE_NAME or not _SUBDOMAIN.match(node):
        raise PublishingError(f"node name {node!r} is not a DNS subdomain")


def _gpus_by_index(gpus: Iterable[Gpu]) -> dict[int, Gpu]:
    by_index: dict[int, Gpu] = {}
    uuids: dict[str, int] = {}
    for gpu in gpus:
        if gpu.index < 0:
            raise PublishingError(f"GPU index {gpu.index} is negative")
        if gpu.index in by_index:
            raise PublishingError(f"GPU {gpu.index} is given twice")
        if not gpu.uuid:
            raise PublishingError(f"GPU {gpu.index} has no UUID")
        if gpu.uuid in uuids:
            raise PublishingError(f"GPUs {uuids[gpu.uuid]} and {gpu.index} share UUID {gpu.uuid}")
        if gpu.mig and gpu.use is not Use.FREE:
            raise PublishingError(
                f"GPU {gpu.index} has MIG on: who uses it is said by its instances, not the GPU "
                f"(got {gpu.use.value})"
            )
        if gpu.memory_mib <= 0:
            raise PublishingError(f"GPU {gpu.index}: memory {gpu.memory_mib} MiB is not positive")
        if gpu.model.memory_slots + 2 > MAX_COUNTERS:
            raise PublishingError(
                f"GPU {gpu.index}: {gpu.model.id} has {gpu.model.memory_slots} memory slices, more "
                f"counters than a counter set holds ({MAX_COUNTERS})"
            )
        by_index[gpu.index] = gpu
        uuids[gpu.uuid] = gpu.index
    return by_index


def _instances_by_gpu(
    instances: Iterable[Instance], gpus: Mapping[int, Gpu]
) -> dict[int, list[tuple[Instance, layouts.Footprint]]]:
    """Each GPU's instances with their footprints, checked: on a GPU with MIG on, at a valid
    placement, not overlapping one another."""
    out: dict[int, list[tuple[Instance, layouts.Footprint]]] = {i: [] for i in gpus}
    for inst in instances:
        gpu = gpus.get(inst.gpu)
        if gpu is None:
            known = ", ".join(str(i) for i in sorted(gpus)) or "none"
            raise PublishingError(f"instance {_text(inst)}: no GPU {inst.gpu} (GPUs: {known})")
        if not gpu.mig:
            raise PublishingError(f"instance {_text(inst)}: GPU {inst.gpu} has MIG off")
        geo = layouts.geometry(gpu.model)
        try:
            footprint = geo.placement(layouts.Instance(inst.start, inst.profile))
        except errors.MigpilotError as err:
            raise PublishingError(f"instance {_text(inst)}: {err}") from None
        for other, taken in out[inst.gpu]:
            if taken.mask & footprint.mask:
                raise PublishingError(
                    f"instances {_text(other)} and {_text(inst)} overlap on GPU {inst.gpu}"
                )
        out[inst.gpu].append((inst, footprint))
    return out


def _text(inst: Instance) -> str:
    return f"{inst.profile}@{inst.start} on GPU {inst.gpu}"


def _counters(gpu: Gpu, instances: Sequence[tuple[Instance, layouts.Footprint]]) -> dict[str, Any]:
    """The counter set of ``gpu``, less what instances used by others take."""
    model = gpu.model
    slots = {k: 1 for k in range(model.memory_slots)}
    compute = model.compute_slices
    media = 1
    if not gpu.mig and gpu.use is Use.OTHER:
        slots = dict.fromkeys(slots, 0)
        compute = media = 0
    for inst, footprint in instances:
        if inst.use is not Use.OTHER:
            continue
        for k in _slots(footprint.mask):
            slots[k] = 0
        compute -= footprint.compute
        if footprint.media:
            media = 0
    counters = {memory_counter(k): _quantity(v) for k, v in slots.items()}
    counters[COMPUTE_COUNTER] = _quantity(max(compute, 0))
    counters[MEDIA_COUNTER] = _quantity(media)
    return dict(sorted(counters.items()))


def _slots(mask: int) -> list[int]:
    return [k for k in range(mask.bit_length()) if mask >> k & 1]


def _quantity(value: int | str) -> dict[str, str]:
    return {"value": str(value)}


def _devices(gpu: Gpu) -> list[dict[str, Any]]:
    """The devices of ``gpu``: every placement of its model (MIG on), or the whole GPU."""
    model = gpu.model
    if not gpu.mig:
        consumed = {memory_counter(k): _quantity(1) for k in range(model.memory_slots)}
        consumed[COMPUTE_COUNTER] = _quantity(model.compute_slices)
        consumed[MEDIA_COUNTER] = _quantity(1)
        return [
            _device(
                placements.whole_gpu_name(gpu.index),
                gpu,
                kind=GPU_TYPE,
                profile=WHOLE_PROFILE,
                start=0,
                memory=mib_quantity(gpu.memory_mib),
                consumed=consumed,
            )
        ]
    geo = layouts.geometry(model)
    out = []
    for footprint in sorted(geo.placements, key=lambda f: _smallest_first(geo, f)):
        profile = geo.profiles[footprint.profile]
        consumed = {memory_counter(k): _quantity(1) for k in _slots(footprint.mask)}
        consumed[COMPUTE_COUNTER] = _quantity(footprint.compute)
        if footprint.media:
            consumed[MEDIA_COUNTER] = _quantity(1)
        name = placements.device_name(
            placements.Placement(gpu.index, profile.name, footprint.start)
        )
        out.append(
            _device(
                name,
                gpu,
                kind=MIG_TYPE,
                profile=profile.name,
                start=footprint.start,
                memory=_memory(profile),
                consumed=consumed,
            )
        )
    return out


def _smallest_first(geo: layouts.Geometry, footprint: layouts.Footprint) -> tuple[int, ...]:
    """kube-scheduler takes the first device that fits, in slice order: a GPU's smallest
    placements come first (memory slices, compute, media engines), so that a claim by memory
    gets the smallest profile that holds it, then the lowest start."""
    profile = geo.profiles[footprint.profile]
    return (
        profile.memory_slots,
        profile.compute_slices,
        int(profile.media_extension),
        footprint.profile,
        footprint.start,
    )


def _memory(profile: profiles.Profile) -> str:
    """The instance's memory as a quantity: the driver's figure, else the name's (GB)."""
    if profile.memory_mib is not None:
        return mib_quantity(profile.memory_mib)
    return f"{profile.nominal_gb}G"


def mib_quantity(mib: int) -> str:
    """``mib`` MiB as the API server writes the quantity back (its canonical form: the largest
    binary unit that keeps it whole, ``80Gi`` for 81920 MiB), so that a slice read back
    compares equal to the one sent."""
    value, unit = mib, "Mi"
    for bigger in ("Gi", "Ti", "Pi", "Ei"):
        if value == 0 or value % 1024:
            break
        value, unit = value // 1024, bigger
    return "0" if value == 0 else f"{value}{unit}"


def _device(
    name: str,
    gpu: Gpu,
    *,
    kind: str,
    profile: str,
    start: int,
    memory: str,
    consumed: Mapping[str, Any],
) -> dict[str, Any]:
    return {
        "name": name,
        "attributes": {
            GPU_INDEX_ATTRIBUTE: {"int": gpu.index},
            GPU_UUID_ATTRIBUTE: {"string": gpu.uuid},
            MODEL_ATTRIBUTE: {"string": gpu.model.id},
            PROFILE_ATTRIBUTE: {"string": profile},
            START_ATTRIBUTE: {"int": start},
            TYPE_ATTRIBUTE: {"string": kind},
        },
        "capacity": {MEMORY_CAPACITY: _quantity(memory)},
        "consumesCounters": [
            {"counterSet": counter_set(gpu.index), "counters": dict(sorted(consumed.items()))}
        ],
    }


def _packed(per_gpu: Sequence[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """The devices in slices of at most :data:`MAX_DEVICES`, in GPU order, a GPU's devices in
    one slice when they fit in what is left of it (else in the next), split only when one GPU
    has more than a slice holds."""
    chunks: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    for devs in per_gpu:
        if current and len(current) + len(devs) > MAX_DEVICES:
            chunks.append(current)
            current = []
        for dev in devs:
            if len(current) == MAX_DEVICES:
                chunks.append(current)
                current = []
            current.append(dev)
    if current:
        chunks.append(current)
    return chunks


def _copy(value: Any) -> Any:
    """A deep copy of JSON-like data (the pool's contents are shared, never handed out)."""
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_copy(v) for v in value]
    return value


# --- the writes --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Writes:
    """What to send so that the API server holds the pool: creates and updates first (the new
    generation's slices), then deletes (slices the pool no longer has)."""

    generation: int
    """The pool's generation once written (-1: there is no slice and none is needed)."""
    create: tuple[dict[str, Any], ...] = ()
    update: tuple[dict[str, Any], ...] = ()
    """Whole objects, in order, each with the ``resourceVersion`` read (a write that lost a race
    fails). A slice may come twice (devices moving in place, :func:`reconcile`): the second is
    sent with the version the first write returned."""
    delete: tuple[str, ...] = ()
    """The names of the slices to delete (this node's, of this driver: never anyone else's)."""

    @property
    def nothing(self) -> bool:
        """Whether the API server already holds the pool."""
        return not (self.create or self.update or self.delete)


def reconcile(
    desired: Pool, existing: Sequence[Mapping[str, Any]], *, newer_than: int = -1
) -> Writes:
    """The writes that turn ``existing`` (the slices of this driver on this node, raw) into
    ``desired``; a new generation is above ``newer_than`` too (the last one the caller wrote:
    after every slice was deleted, a lagging reader may still hold one of that generation, which
    must not win over the new slices).

    As the upstream ``resourceslice`` controller, slices are matched by name. When the pool
    keeps its slices (none added or removed, all at one generation) and either one slice
    changes or devices only move between slices (:func:`_moves`: a change of plan), the
    changed slices are updated in place at their generation, in an order where the API server
    never misses a device (:func:`_moves`: added before removed; a device listed twice for a
    moment makes the pool invalid, so closed). Any other change writes every slice at the next
    generation, so kube-scheduler, which
    takes a pool's newest generation and allocates nothing from a pool missing slices, never
    mixes old and new devices. Slices of other drivers or nodes in ``existing`` are left
    alone."""
    mine = [
        doc
        for doc in existing
        if _spec(doc).get("driver") == DRIVER and _spec(doc).get("nodeName") == desired.node
    ]
    by_name = {str(doc["metadata"]["name"]): doc for doc in mine}
    generations = {_generation(doc) for doc in mine}
    current = max(generations, default=-1)
    wanted = desired.documents(max(current, 0))
    names = {str(doc["metadata"]["name"]) for doc in wanted}
    obsolete = sorted(name for name in by_name if name not in names)
    changed = [doc for doc in wanted if not _same(by_name.get(doc["metadata"]["name"]), doc)]
    if not changed and not obsolete:
        return Writes(generation=current)
    kept = not obsolete and len(generations) == 1 and names == set(by_name)
    if kept and len(changed) == 1:
        return Writes(generation=current, update=(_versioned(changed[0], by_name),))
    moves = _moves(desired, changed, by_name) if kept else None
    if moves is not None:
        return Writes(generation=current, update=moves)
    generation = max(current, newer_than) + 1
    create, update = [], []
    for doc in desired.documents(generation):
        if doc["metadata"]["name"] in by_name:
            update.append(_versioned(doc, by_name))
        else:
            create.append(doc)
    return Writes(
        generation=generation, create=tuple(create), update=tuple(update), delete=tuple(obsolete)
    )


def _moves(
    desired: Pool,
    changed: Sequence[dict[str, Any]],
    stored: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, Any], ...] | None:
    """The updates, in order, that take the ``stored`` slices to the ``changed`` ones when
    devices only move between slices (the same devices in all, each once, none of
    :attr:`Pool.pinned` moving): ``None`` otherwise, and where a slice would for a moment hold
    more than :data:`MAX_DEVICES`.

    Added before removed, so that no device is ever missing and each keeps consuming its
    counters in every state the API server holds, even one kube-scheduler allocated a moment
    ago that the agent does not know of yet (its claim not prepared): counter slices first;
    then a slice is written whole once every device it loses is held by another slice too;
    where none is ready (slices trading devices), a slice is first written with the devices
    it gains and still those it loses. Meanwhile a moving device may be listed twice, which
    makes the whole pool invalid, and kube-scheduler allocates nothing from an invalid pool
    (``GatherPools`` marks it, ``allocateOne`` skips it): the pool is closed for the moment
    between the writes, never open with a device missing. A slice written twice appears twice
    in the result (the shell sends the second with the version the first returned)."""
    held = {name: _device_names(doc) for name, doc in stored.items()}
    final = dict(held)
    final.update({str(doc["metadata"]["name"]): _device_names(doc) for doc in changed})
    before = [d for devs in held.values() for d in devs]
    after = [d for devs in final.values() for d in devs]
    if len(set(before)) != len(before) or sorted(before) != sorted(after):
        return None
    was = {d: name for name, devs in held.items() for d in devs}
    goes = {d: name for name, devs in final.items() for d in devs}
    if any(was.get(d) != goes.get(d) for d in desired.pinned):
        return None
    out = [_versioned(doc, stored) for doc in changed if "devices" not in doc["spec"]]
    pending = {str(doc["metadata"]["name"]): doc for doc in changed if "devices" in doc["spec"]}
    now = {name: set(devs) for name, devs in held.items()}

    def held_elsewhere(name: str) -> bool:
        return all(
            any(d in devs for other, devs in now.items() if other != name)
            for d in now[name] - set(final[name])
        )

    while pending:
        ready = next((name for name in sorted(pending) if held_elsewhere(name)), None)
        if ready is not None:
            out.append(_versioned(pending.pop(ready), stored))
            now[ready] = set(final[ready])
            continue
        # Slices trading devices: one that gains a device no other slice holds yet (the home
        # of a device some waiting slice loses; there is one) is written with its gains and
        # still with what it loses.
        name = next(n for n in sorted(pending) if set(final[n]) - now[n])
        doc = pending[name]
        leaving = [
            d for d in _spec(stored[name]).get("devices") or ()
            if d.get("name") in now[name] - set(final[name])
        ]  # fmt: skip
        devices = [*doc["spec"]["devices"], *leaving]
        if len(devices) > MAX_DEVICES:
            return None
        out.append(_versioned({**doc, "spec": {**doc["spec"], "devices": devices}}, stored))
        now[name] |= set(final[name])
    return tuple(out)


def listed_first(node: str, existing: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The devices the published slice :data:`FIRST_SLICE` of ``node`` holds (for :func:`pool`:
    those allocated stay there)."""
    name = device_slice_name(node, FIRST_SLICE)
    for doc in existing:
        spec = _spec(doc)
        mine = spec.get("driver") == DRIVER and spec.get("nodeName") == node
        if mine and (doc.get("metadata") or {}).get("name") == name:
            return frozenset(_device_names(doc))
    return frozenset()


def _device_names(doc: Mapping[str, Any]) -> list[str]:
    devices = _spec(doc).get("devices") or ()
    return [str(d.get("name")) for d in devices if isinstance(d, Mapping)]


def _spec(doc: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = doc.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _generation(doc: Mapping[str, Any]) -> int:
    value = (_spec(doc).get("pool") or {}).get("generation", 0)
    return value if isinstance(value, int) else 0


def _same(existing: Mapping[str, Any] | None, wanted: Mapping[str, Any]) -> bool:
    """Whether the stored slice's spec says what ``wanted``'s says (metadata aside)."""
    return existing is not None and _equal(_spec(existing), wanted["spec"])


def _equal(stored: Any, wanted: Any) -> bool:
    """JSON equality, except that a key ``stored`` has with an empty value (``null``, ``{}``,
    ``[]``, ``false``: what a server may write for a field left unset) counts as absent."""
    if isinstance(wanted, Mapping):
        if not isinstance(stored, Mapping):
            return False
        extra = [k for k, v in stored.items() if k not in wanted and v not in (None, {}, [], False)]
        return not extra and all(_equal(stored.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        if not isinstance(stored, list) or len(stored) != len(wanted):
            return False
        return all(_equal(s, w) for s, w in zip(stored, wanted, strict=True))
    return bool(stored == wanted)


def _versioned(doc: dict[str, Any], by_name: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """``doc`` with the stored slice's ``resourceVersion`` (and its other metadata kept)."""
    stored = by_name[doc["metadata"]["name"]]
    meta = dict(stored.get("metadata") or {})
    meta["name"] = doc["metadata"]["name"]
    return {**doc, "metadata": meta}
