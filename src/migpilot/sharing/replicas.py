"""Devices into replicas, and Allocate's replica IDs back into devices, as NVIDIA's plugin does.

NVIDIA's device map (k8s-device-plugin ``internal/rm/device_map.go``,
``updateDeviceMapWithReplicas``): each device a sharing entry selects is advertised
``replicas`` times as ``<device-id>::<n>`` (n from 0), under the entry's ``rename`` when it has
one (``nvidia.com/gpu.shared`` with ``renameByDefault``), its health copied; devices the entry
does not select stay under the original name, unreplicated; resources no entry names are left
alone; an entry whose resource the node does not advertise (now) is skipped. ``devices`` picks
all, the first ``count`` (in GPU-index and start order here, where NVIDIA's is a Go map's), or
those named by index (``"0"``, MIG ``"0:1"``) or UUID; NVIDIA's errors for a count or a name the
node cannot satisfy. MPS refuses MIG devices (``sharing using MPS is not supported for MIG
devices``).

Allocate (``internal/rm/rm.go`` ``ValidateRequest``): a request holding a replica and more than
one ID is refused when ``failRequestsGreaterThanOne`` holds (always, for MPS, unless the file
turns it off), with NVIDIA's message; the container gets each real device once, in request order.
GetPreferredAllocation for replicas spreads them over devices, least used first (NVIDIA's
``distributed`` policy for shared devices).

Pure: frozen values in and out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from migpilot import errors
from migpilot.sharing import config as sharing_config

SEPARATOR = "::"
"""Between a device ID and its replica number (NVIDIA's ``AnnotatedID``)."""


@dataclass(frozen=True, slots=True)
class Device:
    """One advertised device, with what sharing needs to know about it."""

    id: str
    """The advertised ID: a UUID, or ``<uuid>::<n>`` for a replica."""
    index: str
    """NVIDIA's device index: ``"0"`` for a GPU, ``"0:1"`` for the second MIG device on GPU 0."""
    gpu_index: int
    healthy: bool
    memory_mib: int
    """The device's memory (the GPU's, or the MIG device's), MiB."""
    mig: bool
    replicas: int = 1
    """How many replicas of the real device are advertised (1: not shared)."""

    @property
    def real_id(self) -> str:
        """The UUID without the replica annotation."""
        return real_id(self.id)


@dataclass(frozen=True, slots=True)
class Resource:
    """One resource and its devices, in advertising order."""

    name: str
    devices: tuple[Device, ...]


def annotated_id(device_id: str, replica: int) -> str:
    """``GPU-x`` and 2 -> ``GPU-x::2``."""
    return f"{device_id}{SEPARATOR}{replica}"


def real_id(device_id: str) -> str:
    """The device ID without its replica annotation (itself when it has none)."""
    return device_id.split(SEPARATOR, 1)[0]


def is_replica(device_id: str) -> bool:
    """True for an annotated (replica) ID."""
    return SEPARATOR in device_id


def real_ids(device_ids: Sequence[str]) -> tuple[str, ...]:
    """The real devices behind ``device_ids``, each once, in request order."""
    return tuple(dict.fromkeys(real_id(i) for i in device_ids))


def replicate(
    resources: Sequence[Resource], sharing: sharing_config.Config
) -> tuple[Resource, ...]:
    """The resources to advertise under ``sharing``, sorted by name.

    Raises :class:`SharingConfigError` naming the entry when its ``devices`` cannot be found on
    the node, or when MPS would share a MIG device.
    """
    active = sharing.active
    if active is None:
        return tuple(sorted(resources, key=lambda r: r.name))
    section = "sharing.mps" if sharing.mps is not None else "sharing.timeSlicing"
    by_name = {r.name: r for r in resources}
    out: dict[str, list[Device]] = {
        r.name: list(r.devices)
        for r in resources
        if not r.devices or not any(e.name == r.name for e in active.resources)
    }
    chosen: dict[str, dict[str, tuple[int, sharing_config.ReplicatedResource]]] = {}
    for n, entry in enumerate(active.resources):
        path = f"{section}.resources[{n}]"
        resource = by_name.get(entry.name)
        if resource is None or not resource.devices:
            continue
        picked = chosen.setdefault(entry.name, {})
        for device in _select(resource, entry, path=path):
            if device.id in picked:
                raise errors.SharingConfigError(
                    f"{path}.devices: device {device.id} is also shared by "
                    f"{section}.resources[{picked[device.id][0]}]"
                )
            if sharing.mps is not None and device.mig:
                raise errors.SharingConfigError(
                    f"{path}: sharing using MPS is not supported for MIG devices ({device.id})"
                )
            picked[device.id] = (n, entry)
    for name, picked in chosen.items():
        for device in by_name[name].devices:
            found = picked.get(device.id)
            if found is None:
                out.setdefault(name, []).append(device)
                continue
            entry = found[1]
            out.setdefault(entry.advertised_as, []).extend(
                replace(device, id=annotated_id(device.id, r), replicas=entry.replicas)
                for r in range(entry.replicas)
            )
    return tuple(Resource(name, tuple(out[name])) for name in sorted(out))


def _select(
    resource: Resource, entry: sharing_config.ReplicatedResource, *, path: str
) -> tuple[Device, ...]:
    """NVIDIA's ``getIDsOfDevicesToReplicate``, with its messages."""
    selector = entry.devices
    where = f"{path}.devices: unable to get IDs of devices to replicate for '{entry.name}' resource"
    if selector.all:
        return resource.devices
    if selector.count:
        if selector.count > len(resource.devices):
            raise errors.SharingConfigError(
                f"{where}: requested {selector.count} devices to be replicated, but only "
                f"{len(resource.devices)} devices available"
            )
        return resource.devices[: selector.count]
    picked: list[Device] = []
    for ref in selector.refs:
        if ref.startswith(("GPU-", "MIG-")):
            match = [d for d in resource.devices if d.id == ref]
            kind = "no matching device with UUID"
        else:
            match = [d for d in resource.devices if d.index == ref]
            kind = "no matching device at index"
        if not match:
            raise errors.SharingConfigError(f"{where}: {kind}: {ref}")
        picked.append(match[0])
    return tuple(dict.fromkeys(picked))


def request_problem(device_ids: Sequence[str], sharing: sharing_config.Config) -> str | None:
    """NVIDIA's refusal of one container's request (``invalid request: ...``), or ``None``."""
    if (
        sharing.fails_requests_greater_than_one
        and len(device_ids) > 1
        and any(is_replica(i) for i in device_ids)
    ):
        return (
            "invalid request: maximum request size for shared resources is 1; "
            f"found {len(device_ids)}"
        )
    return None


def preferred(
    resource: Resource,
    *,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> tuple[str, ...]:
    """``size`` replica IDs from ``available`` with ``must_include``, spread over the real
    devices with the fewest replicas taken (ties: advertising order, then replica number)."""
    required = list(dict.fromkeys(must_include))
    order = {d.id: n for n, d in enumerate(resource.devices)}
    free = [i for i in dict.fromkeys(available) if i not in required and i in order]
    free_count: dict[str, int] = {}
    for i in free:
        free_count[real_id(i)] = free_count.get(real_id(i), 0) + 1
    total = {d.real_id: d.replicas for d in resource.devices}
    taken = {rid: total[rid] - free_count.get(rid, 0) for rid in total}
    for i in required:
        taken[real_id(i)] = taken.get(real_id(i), 0) + 1
    chosen: list[str] = []
    pool = sorted(free, key=lambda i: order[i])
    while len(required) + len(chosen) < size and pool:
        best = min(pool, key=lambda i: (taken[real_id(i)], order[i]))
        pool.remove(best)
        chosen.append(best)
        taken[real_id(best)] += 1
    return (*required, *chosen)


def replicas_by_device(resources: Sequence[Resource]) -> Mapping[str, int]:
    """Real device ID -> replicas advertised, over every shared device."""
    return {d.real_id: d.replicas for r in resources for d in r.devices if is_replica(d.id)}
