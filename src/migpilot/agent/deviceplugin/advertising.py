"""Which resources a node advertises, and their devices, under each MIG strategy.

This is NVIDIA's device map (k8s-device-plugin ``internal/rm/device_map.go``) as a pure
function: ``none`` advertises every GPU whole; ``mixed`` advertises MIG-disabled GPUs whole and
each MIG profile as ``nvidia.com/mig-<profile>``, except the instances set aside for unified
pods (``NodeDevices.unified``, ``docs/unified.md``): one ``nvidia.com/gpu`` device each;
``single`` advertises every MIG device as ``nvidia.com/gpu`` and refuses a node that breaks its
invariants with NVIDIA's messages. Under every strategy a GPU with MPS slices
(``NodeDevices.mps_slices``) is advertised as its slices (``nvidia.com/gpu-<N>gb``,
:mod:`slices`; those set aside for unified pods as ``nvidia.com/gpu`` devices), never whole.
No I/O.
"""

from __future__ import annotations

from collections.abc import Collection

from migpilot import errors
from migpilot.agent.deviceplugin import devices, slices


class InvalidMigConfigurationError(errors.AgentConfigError):
    """The node's MIG layout breaks the strategy's invariants (NVIDIA refuses to start)."""


def resources_for(
    node: devices.NodeDevices,
    strategy: devices.MigStrategy,
    *,
    unhealthy: Collection[str] = frozenset(),
) -> tuple[devices.Resource, ...]:
    """The resources to advertise, sorted by name; devices in ``unhealthy`` are Unhealthy.

    Raises :class:`InvalidMigConfigurationError` with NVIDIA's message when the single strategy's
    invariants do not hold.
    """
    by_name: dict[str, list[devices.Device]] = {}

    def add(name: str, device_id: str, gpu_index: int, health: devices.Health) -> None:
        if device_id in unhealthy:
            health = devices.Health.UNHEALTHY
        by_name.setdefault(name, []).append(devices.Device(device_id, gpu_index, health))

    gpus = sorted(node.gpus, key=lambda g: g.index)
    sliced = {s.gpu_index for s in node.mps_slices}
    for gpu in gpus:
        if gpu.mig_enabled and strategy is not devices.MigStrategy.NONE:
            continue
        if gpu.index in sliced:
            continue  # advertised as its slices
        add(devices.FULL_GPU_RESOURCE, gpu.uuid, gpu.index, devices.Health.HEALTHY)
    for r in slices.resources(node, unhealthy=unhealthy):
        by_name.setdefault(r.name, []).extend(r.devices)  # unified slices join nvidia.com/gpu
    if strategy is devices.MigStrategy.NONE:
        return _sorted(by_name)

    if strategy is devices.MigStrategy.SINGLE:
        check_single(node)
    for gpu in gpus:
        if not gpu.mig_enabled:
            continue
        for mig in node.mig_devices_on(gpu.index):
            name = (
                devices.FULL_GPU_RESOURCE
                if strategy is devices.MigStrategy.SINGLE or mig.uuid in node.unified
                else devices.mig_resource_name(mig.profile)
            )
            add(name, mig.uuid, gpu.index, mig.health)
    return _sorted(by_name)


def check_single(node: devices.NodeDevices) -> None:
    """Raise NVIDIA's ``invalid MIG configuration`` error unless ``single`` can advertise ``node``.

    The invariants, in NVIDIA's order: every MIG-enabled GPU has a MIG device; all MIG devices on
    the node have the same profile; MIG-enabled and MIG-disabled GPUs are not mixed.
    """
    enabled = [g for g in sorted(node.gpus, key=lambda g: g.index) if g.mig_enabled]
    for gpu in enabled:
        if not node.mig_devices_on(gpu.index):
            raise InvalidMigConfigurationError(
                "invalid MIG configuration: at least one device with migEnabled=true was not "
                f"configured correctly: device {gpu.index} has no MIG devices configured"
            )
    shapes = {(m.profile.name, m.profile.memory_mib) for m in node.mig_devices}
    if len(shapes) > 1:
        raise InvalidMigConfigurationError(
            "invalid MIG configuration: more than one MIG device type present on node"
        )
    if enabled and len(enabled) != len(node.gpus):
        raise InvalidMigConfigurationError(
            "all devices on the node must be configured with the same migEnabled value"
        )


def _sorted(by_name: dict[str, list[devices.Device]]) -> tuple[devices.Resource, ...]:
    return tuple(devices.Resource(name, tuple(by_name[name])) for name in sorted(by_name))
