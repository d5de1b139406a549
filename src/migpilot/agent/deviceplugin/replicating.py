"""The advertised resources under a sharing config: the device plugin's view put through
:mod:`migpilot.sharing`.

``advertising`` says which devices each resource has; this module gives each device what
sharing needs (NVIDIA's index ``"0"`` / ``"0:1"``, memory, MIG or not), replicates them
(:func:`migpilot.sharing.replicas.replicate`) and lists the MPS daemons they need. Sans-IO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from migpilot.agent.deviceplugin import devices
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps, replicas


@dataclass(frozen=True, slots=True)
class Shared:
    """What the plugin advertises under a sharing config."""

    resources: tuple[devices.Resource, ...]
    """Sorted by name; replicas as ``<uuid>::<n>``."""
    shared: tuple[replicas.Resource, ...]
    """The same with sharing's view of each device (replicas, memory, index)."""
    daemons: tuple[mps.MpsDaemon, ...] = ()
    """The MPS daemons these resources need (none unless the strategy is MPS)."""

    def shared_resource(self, name: str) -> replicas.Resource | None:
        """Sharing's view of one resource."""
        for r in self.shared:
            if r.name == name:
                return r
        return None

    def daemon(self, name: str) -> mps.MpsDaemon | None:
        """The MPS daemon of one resource, if it has one."""
        for d in self.daemons:
            if d.resource == name:
                return d
        return None


def share(
    resources: Sequence[devices.Resource],
    node: devices.NodeDevices,
    sharing: sharing_config.Config,
    *,
    mps_root: str | None = None,
) -> Shared:
    """``resources`` (from :func:`advertising.resources_for`) under ``sharing``; raises
    :class:`~migpilot.errors.SharingConfigError` when the config cannot be applied to the node."""
    views = tuple(
        replicas.Resource(r.name, tuple(_view(d, node) for d in r.devices)) for r in resources
    )
    shared = replicas.replicate(views, sharing)
    out = tuple(
        devices.Resource(
            r.name,
            tuple(
                devices.Device(
                    d.id,
                    d.gpu_index,
                    devices.Health.HEALTHY if d.healthy else devices.Health.UNHEALTHY,
                )
                for d in r.devices
            ),
        )
        for r in shared
    )
    return Shared(out, shared, mps.daemons(shared, sharing, root=mps_root))


def _view(device: devices.Device, node: devices.NodeDevices) -> replicas.Device:
    healthy = device.health is devices.Health.HEALTHY
    for gpu in node.gpus:
        if gpu.uuid == device.id:
            return replicas.Device(
                device.id, str(gpu.index), gpu.index, healthy, gpu.memory_mib, mig=False
            )
    migs = node.mig_devices_on(device.gpu_index)
    for j, mig in enumerate(migs):
        if mig.uuid == device.id:
            return replicas.Device(
                device.id,
                f"{device.gpu_index}:{j}",
                device.gpu_index,
                healthy,
                mig.profile.memory_mib or 0,
                mig=True,
            )
    # Not in the view (cannot happen for resources_for's output): shareable, size unknown.
    return replicas.Device(device.id, str(device.gpu_index), device.gpu_index, healthy, 0, False)
