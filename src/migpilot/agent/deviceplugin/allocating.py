"""The answers to Allocate and GetPreferredAllocation, as pure functions of one resource.

Allocate follows NVIDIA's plugin (``internal/plugin/server.go``): every requested ID must be a
device of the resource (else ``invalid allocation request for "<resource>": invalid request:
unknown device: <id>``), and, stricter than NVIDIA's, named once per container (the kubelet
never repeats one; a repeated ID would be handed out twice, ``NVIDIA_VISIBLE_DEVICES=a,a``, and
counted twice in the ledger); the envvar strategy sets ``NVIDIA_VISIBLE_DEVICES`` to the IDs in
request order; the cdi-cri strategy returns fully qualified CDI names
(``k8s.device-plugin.nvidia.com/gpu=<id>``) and no environment when it is the only strategy.

GetPreferredAllocation packs a request onto as few GPUs as possible: the GPUs of the
must-include devices first, then largest-first with a best fit for the last GPU, so small
requests leave whole GPUs free for large ones. No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from migpilot import errors
from migpilot.agent.deviceplugin import devices

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
NVIDIA_CDI_VENDOR = "k8s.device-plugin.nvidia.com"
"""The CDI vendor NVIDIA's device plugin writes its specs under."""


class AllocationError(errors.MigpilotError):
    """The kubelet asked for devices the resource does not have, or for an impossible size."""


@dataclass(frozen=True, slots=True)
class AllocateSettings:
    """How Allocate names devices to the container runtime."""

    device_list_strategies: tuple[devices.DeviceListStrategy, ...] = (
        devices.DeviceListStrategy.ENVVAR,
    )
    """Which of envvar / cdi-cri to fill (default: envvar only, as NVIDIA)."""
    cdi_vendor: str = NVIDIA_CDI_VENDOR
    """Vendor part of CDI names (default ``k8s.device-plugin.nvidia.com``)."""
    cdi_class: str = "gpu"
    """Class part of CDI names (default ``gpu``)."""

    def __post_init__(self) -> None:
        if not self.device_list_strategies:
            raise errors.AgentConfigError("at least one device-list strategy is needed")


@dataclass(frozen=True, slots=True)
class ContainerAllocation:
    """What one container gets: environment variables and CDI device names."""

    envs: Mapping[str, str] = field(default_factory=dict)
    cdi_devices: tuple[str, ...] = ()
    mounts: tuple[tuple[str, str], ...] = ()
    """``(host path, container path)`` folders mounted into the container (MPS pipes)."""


def check_known(resource: devices.Resource, device_ids: Sequence[str]) -> None:
    """Raise NVIDIA's ``unknown device`` error for the first ID the resource does not have."""
    known = {d.id for d in resource.devices}
    for device_id in device_ids:
        if device_id not in known:
            raise AllocationError(
                f"invalid allocation request for {_go_quote(resource.name)}: invalid request: "
                f"unknown device: {device_id}"
            )


def check_distinct(resource: devices.Resource, device_ids: Sequence[str]) -> None:
    """Raise for the first ID a container's request names twice."""
    seen: set[str] = set()
    for device_id in device_ids:
        if device_id in seen:
            raise AllocationError(
                f"invalid allocation request for {_go_quote(resource.name)}: invalid request: "
                f"device {device_id} is requested more than once for one container"
            )
        seen.add(device_id)


def container_allocation(
    resource: devices.Resource, device_ids: Sequence[str], settings: AllocateSettings
) -> ContainerAllocation:
    """The answer for one container asking for ``device_ids`` of ``resource``."""
    check_known(resource, device_ids)
    return answer(device_ids, settings)


def answer(device_ids: Sequence[str], settings: AllocateSettings) -> ContainerAllocation:
    """What a container that gets ``device_ids`` is told (envvar and/or CDI names)."""
    strategies = settings.device_list_strategies
    cdi: tuple[str, ...] = ()
    if devices.DeviceListStrategy.CDI_CRI in strategies:
        cdi = tuple(f"{settings.cdi_vendor}/{settings.cdi_class}={i}" for i in device_ids)
    envs: dict[str, str] = {}
    if devices.DeviceListStrategy.ENVVAR in strategies:
        envs[VISIBLE_DEVICES_ENV] = ",".join(device_ids)
    return ContainerAllocation(envs=envs, cdi_devices=cdi)


def preferred_allocation(
    resource: devices.Resource,
    *,
    available: Sequence[str],
    must_include: Sequence[str],
    size: int,
) -> tuple[str, ...]:
    """``size`` device IDs from ``available`` including ``must_include``, on the fewest GPUs."""
    check_known(resource, [*available, *must_include])
    required = list(dict.fromkeys(must_include))
    if size < len(required):
        raise AllocationError(
            f"allocation size {size} is smaller than the {len(required)} devices that must be "
            "included"
        )
    order = {d.id: n for n, d in enumerate(resource.devices)}
    gpu_of = {d.id: d.gpu_index for d in resource.devices}
    taken = set(required)
    candidates = sorted(
        (i for i in dict.fromkeys(available) if i not in taken), key=lambda i: order[i]
    )
    needed = size - len(required)
    if len(candidates) < needed:
        raise AllocationError("not enough available devices to satisfy allocation")

    groups: dict[int, list[str]] = {}
    for device_id in candidates:
        groups.setdefault(gpu_of[device_id], []).append(device_id)
    chosen: list[str] = []
    # GPUs the pod already touches come first: filling them costs no extra GPU.
    for gpu in dict.fromkeys(gpu_of[i] for i in required):
        take = groups.pop(gpu, [])[: needed - len(chosen)]
        chosen += take
    while len(chosen) < needed:
        rest = needed - len(chosen)
        fitting = [g for g, ids in groups.items() if len(ids) >= rest]
        if fitting:
            gpu = min(fitting, key=lambda g: (len(groups[g]), g))
        else:
            gpu = max(groups, key=lambda g: (len(groups[g]), -g))
        chosen += groups.pop(gpu)[:rest]
    return (*required, *chosen)


def go_quote(text: str) -> str:
    """Go's ``%q``, for the ASCII resource names it is used on."""
    return _go_quote(text)


def _go_quote(text: str) -> str:
    # Go's %q, for the ASCII resource names it is used on.
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
