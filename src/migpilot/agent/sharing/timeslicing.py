"""The time-slicing replicas the node advertises, and their status in the GpuLayout.

Why it exists: on a node whose sharing config time-slices its GPUs (``sharing.timeSlicing``,
:mod:`migpilot.sharing.replicas`), NVIDIA's device map advertises each GPU it selects as
``replicas`` ``nvidia.com/gpu`` devices, ``<gpu-uuid>::<id>``. The controller plans unified pods
onto those replicas (``docs/controller.md``, "Time-slicing nodes"): it must know how many each
GPU has and which are taken, and the agent must know which replica the GpuLayout spec keeps for
which pod. The rules, pure (:func:`replica_ids`, :func:`statuses`, :func:`reservations`):

* a GPU has replicas when it is advertised whole (MIG disabled, no MPS slices) and the config's
  time-slicing entries replicate it under ``nvidia.com/gpu`` itself; replicas renamed (to
  ``nvidia.com/gpu.shared``) or MPS replicas are not the unified pods' (they never ask those
  names) and are not reported;
* a replica is ``used`` while held (the kubelet's in-use set, Allocate's hand-outs; ``usedBy``
  names a unified pod), ``reserved`` when the spec keeps it for a pod and none holds it, else
  ``free``.

No I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from migpilot import errors
from migpilot.agent.deviceplugin import devices
from migpilot.api import gpulayouts
from migpilot.sharing import config as sharing_config
from migpilot.sharing import replicas

_S = gpulayouts.InstanceState


def device_id(gpu_uuid: str, replica: int) -> str:
    """``GPU-x`` and 2 -> ``GPU-x::2``: the device ID NVIDIA's plugin gives the replica."""
    return replicas.annotated_id(gpu_uuid, replica)


def replica_ids(
    view: devices.NodeDevices, sharing: sharing_config.Config
) -> dict[int, tuple[int, ...]]:
    """GPU index -> the ids of its time-slicing replicas advertised as ``nvidia.com/gpu`` (see
    the module); GPUs without any are left out. A config that does not fit the node (its
    ``devices`` name a GPU it lacks) replicates nothing: the plugin then advertises the GPUs
    unshared (``replicating.share`` raises; the sharing follower keeps such a config out)."""
    if sharing.strategy is not sharing_config.SharingStrategy.TIME_SLICING:
        return {}
    sliced = {s.gpu_index for s in view.mps_slices}
    whole = [g for g in sorted(view.gpus, key=lambda g: g.index)
             if not g.mig_enabled and g.index not in sliced]  # fmt: skip
    if not whole:
        return {}
    resource = replicas.Resource(
        devices.FULL_GPU_RESOURCE,
        tuple(
            replicas.Device(g.uuid, str(g.index), g.index, True, g.memory_mib, mig=False)
            for g in whole
        ),
    )
    try:
        shared = replicas.replicate((resource,), sharing)
    except errors.SharingConfigError:
        return {}
    by_uuid = {g.uuid: g.index for g in whole}
    out: dict[int, list[int]] = {}
    for r in shared:
        if r.name != devices.FULL_GPU_RESOURCE:
            continue
        for d in r.devices:
            if not replicas.is_replica(d.id):
                continue
            real, _, number = d.id.partition(replicas.SEPARATOR)
            index = by_uuid.get(real)
            if index is not None and number.isdigit():
                out.setdefault(index, []).append(int(number))
    return {index: tuple(sorted(ids)) for index, ids in sorted(out.items())}


def reservations(spec: gpulayouts.LayoutSpec | None) -> dict[tuple[int, int], str]:
    """(GPU index, replica id) -> ``namespace/name`` of the pod the spec keeps it for."""
    return {
        (g.index, r.id): r.reserved_for
        for g in (spec.gpus if spec is not None else ())
        for r in g.replicas
    }


def statuses(
    view: devices.NodeDevices,
    *,
    sharing: sharing_config.Config,
    spec: gpulayouts.LayoutSpec | None,
    in_use: frozenset[str],
    used_by: Mapping[str, str],
) -> dict[int, tuple[gpulayouts.ReplicaStatus, ...]]:
    """GPU index -> the status of each of its replicas, by id (see the module). ``in_use`` and
    ``used_by`` name replicas by device ID (``<gpu-uuid>::<id>``)."""
    reserved = reservations(spec)
    uuids = {g.index: g.uuid for g in view.gpus}
    out: dict[int, tuple[gpulayouts.ReplicaStatus, ...]] = {}
    for index, ids in replica_ids(view, sharing).items():
        found: list[gpulayouts.ReplicaStatus] = []
        for ident in ids:
            dev = device_id(uuids[index], ident)
            if dev in in_use:
                found.append(gpulayouts.ReplicaStatus(ident, _S.USED, used_by.get(dev)))
            elif (index, ident) in reserved:
                found.append(gpulayouts.ReplicaStatus(ident, _S.RESERVED))
            else:
                found.append(gpulayouts.ReplicaStatus(ident, _S.FREE))
        out[index] = tuple(found)
    return out
