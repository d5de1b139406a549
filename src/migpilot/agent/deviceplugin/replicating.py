"""The advertised resources under a sharing config: the device plugin's view put through
:mod:`migpilot.sharing`.

``advertising`` says which devices each resource has; this module gives each device what
sharing needs (NVIDIA's index ``"0"`` / ``"0:1"``, memory, MIG or not), replicates them
(:func:`migpilot.sharing.replicas.replicate`) and lists the MPS daemons they need. The
GpuLayout's MPS slices (``nvidia.com/gpu-<N>gb``, :mod:`slices`) are kept out of the
replication and advertised as they are (those of ``nvidia.com/gpu``, set aside for unified
pods, too); their daemons (one per sliced GPU) join the config's in
one list, so the agent's one supervisor runs both. Sans-IO.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from migpilot.agent.deviceplugin import devices, slices
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
    """The MPS daemons these resources need: the config's (none unless its strategy is MPS)
    and one per GPU with MPS slices."""
    sliced: tuple[tuple[int, mps.MpsDaemon], ...] = ()
    """``(GPU index, daemon)`` of each GPU with MPS slices (also in :attr:`daemons`)."""

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

    def slice_daemons(self) -> dict[int, mps.MpsDaemon]:
        """GPU index -> the MPS daemon of its slices."""
        return dict(self.sliced)


def share(
    resources: Sequence[devices.Resource],
    node: devices.NodeDevices,
    sharing: sharing_config.Config,
    *,
    mps_root: str | None = None,
) -> Shared:
    """``resources`` (from :func:`advertising.resources_for`) under ``sharing``; raises
    :class:`~migpilot.errors.SharingConfigError` when the config cannot be applied to the node.
    Slices pass unchanged, slice resources and the slices of ``nvidia.com/gpu`` (set aside
    for unified pods) alike: they are never replicated."""
    sliced = tuple(
        devices.Resource(r.name, kept)
        for r in resources
        if (kept := tuple(d for d in r.devices if devices.is_slice_id(d.id)))
        or devices.is_slice_resource(r.name)
    )
    views = tuple(
        replicas.Resource(
            r.name, tuple(_view(d, node) for d in r.devices if not devices.is_slice_id(d.id))
        )
        for r in resources
        if not devices.is_slice_resource(r.name)
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
    root = mps_root or sharing.mps_root or mps.DEFAULT_ROOT
    per_gpu = slices.daemons(node, root=root)
    return Shared(
        _merged((*out, *sliced)),
        shared,
        (*mps.daemons(shared, sharing, root=mps_root), *(d for _, d in per_gpu)),
        per_gpu,
    )


def _merged(resources: Sequence[devices.Resource]) -> tuple[devices.Resource, ...]:
    """One resource per name (its devices in the order given), sorted by name."""
    by_name: dict[str, list[devices.Device]] = {}
    for r in resources:
        by_name.setdefault(r.name, []).extend(r.devices)
    return tuple(devices.Resource(n, tuple(by_name[n])) for n in sorted(by_name))


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
