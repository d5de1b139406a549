"""The GpuLayout's MPS memory slices as the device plugin serves them: resources, daemons, Allocate.

Why it exists: on a node in mode ``mps`` the controller cuts each GPU (MIG disabled) into memory
slices of any whole number of GB (nos's dynamic MPS partitioning, ``docs/modes.md``). The plugin
advertises each slice as one device of ``nvidia.com/gpu-<N>gb`` (ID ``<gpu-uuid>::mps-<id>``,
:func:`~devices.slice_device_id`; a slice set aside for a unified pod, ``NodeDevices.unified``, as a
device of ``nvidia.com/gpu`` with the same ID and the same answer), runs one MPS control daemon per
sliced GPU (named ``gpu-<index>``, its pipe and log folders ``<mps-root>/gpu-<index>/pipe`` and
``.../log``) and answers Allocate as NVIDIA's MPS sharing does: ``NVIDIA_VISIBLE_DEVICES=<gpu
uuid>`` (or its CDI name), ``CUDA_MPS_PIPE_DIRECTORY`` with the pipe folder and ``/dev/shm``
mounted, and the slice's own ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<GB x 1024>M`` and, when it has a
compute share, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (the recipe is
:func:`migpilot.sharing.mps.client_settings`, the one the sharing config's replicas use).

Slices never pass through the sharing config's replication (:mod:`replicating` keeps them
apart): their IDs carry ``::`` but they are not numbered replicas. Sans-IO.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

from migpilot.agent.deviceplugin import allocating, devices
from migpilot.sharing import mps

MIB_PER_GB = 1024


def daemon_name(gpu_index: int) -> str:
    """The MPS daemon of a sliced GPU: ``gpu-0``."""
    return f"gpu-{gpu_index}"


def resources(
    node: devices.NodeDevices, *, unhealthy: Collection[str] = frozenset()
) -> tuple[devices.Resource, ...]:
    """One ``nvidia.com/gpu-<N>gb`` resource per slice size, sorted by name; its devices by GPU
    index then slice id. A slice set aside for a unified pod (in ``node.unified``) is a device
    of ``nvidia.com/gpu`` instead, its ID unchanged. A slice is Unhealthy when its GPU or itself
    is in ``unhealthy`` (an XID on a GPU with MIG disabled names the GPU)."""
    by_name: dict[str, list[devices.Device]] = {}
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        for sl in node.slices_on(gpu.index):
            device_id = devices.slice_device_id(gpu.uuid, sl.id)
            sick = gpu.uuid in unhealthy or device_id in unhealthy
            health = devices.Health.UNHEALTHY if sick else devices.Health.HEALTHY
            name = devices.FULL_GPU_RESOURCE if device_id in node.unified else sl.resource
            by_name.setdefault(name, []).append(devices.Device(device_id, gpu.index, health))
    return tuple(devices.Resource(name, tuple(by_name[name])) for name in sorted(by_name))


def daemons(node: devices.NodeDevices, *, root: str) -> tuple[tuple[int, mps.MpsDaemon], ...]:
    """One daemon per GPU with slices (``(GPU index, daemon)``), under the MPS root ``root``.
    Its default pinned memory (for a client that sets none) is the GPU's smallest slice, its
    default thread percentage 100; each container's own limits come from Allocate. A change of
    slices changes only those defaults, so the supervisor never restarts a daemon its clients
    use for it."""
    base = root.rstrip("/") or "/"
    out: list[tuple[int, mps.MpsDaemon]] = []
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        served = node.slices_on(gpu.index)
        if not served:
            continue
        name = daemon_name(gpu.index)
        daemon = mps.MpsDaemon(
            resource=name,
            devices=(
                mps.MpsDevice(
                    uuid=gpu.uuid,
                    index=str(gpu.index),
                    replicas=len(served),
                    pinned_limit_mib=min(s.memory_gb for s in served) * MIB_PER_GB,
                ),
            ),
            pipe_dir=f"{base}/{name}/pipe",
            log_dir=f"{base}/{name}/log",
            shm_dir=f"{base}/shm",
            active_thread_percentage=100,
        )
        out.append((gpu.index, daemon))
    return tuple(out)


def container_allocation(
    resource: devices.Resource,
    device_ids: Sequence[str],
    *,
    node: devices.NodeDevices,
    daemons: Mapping[int, mps.MpsDaemon],
    settings: allocating.AllocateSettings,
) -> allocating.ContainerAllocation:
    """The answer for one container asking for slices ``device_ids`` of ``resource``.

    Several slices must be on one GPU (one container talks to one MPS daemon through one pipe
    folder): they add up to one limit. Raises :class:`~allocating.AllocationError` for an ID the
    resource lacks (NVIDIA's message), for slices on two GPUs, or for a GPU whose daemon is not
    known (cannot happen while the slice is advertised)."""
    allocating.check_known(resource, device_ids)
    served = node.slice_device_ids()
    # ``resource`` and ``node`` come from one view of the node (the plugin's snapshot); should
    # they ever disagree, the slice is unknown, not a KeyError.
    allocating.check_known(
        devices.Resource(resource.name, tuple(d for d in resource.devices if d.id in served)),
        device_ids,
    )
    slices = [served[i] for i in dict.fromkeys(device_ids)]
    gpus = sorted({s.gpu_index for s in slices})
    where = f"invalid allocation request for {allocating.go_quote(resource.name)}"
    if len(gpus) != 1:
        raise allocating.AllocationError(
            f"{where}: MPS slices on {len(gpus)} GPUs ({', '.join(map(str, gpus))}) cannot "
            "share one container's MPS pipe; ask for one slice per container"
        )
    gpu = node.gpu(gpus[0])
    daemon = daemons.get(gpu.index)
    if daemon is None:
        raise allocating.AllocationError(f"{where}: GPU {gpu.index} has no MPS daemon")
    memory_mib = sum(s.memory_gb for s in slices) * MIB_PER_GB
    cores = [s.cores for s in slices if s.cores is not None]
    threads = min(100, sum(cores)) if len(cores) == len(slices) else None  # None: one unlimited
    answer = allocating.answer([gpu.uuid], settings)
    extra = mps.client_settings(daemon, pinned_mib=[(0, memory_mib)], threads=threads)
    return allocating.ContainerAllocation(
        envs={**answer.envs, **extra.envs},
        cdi_devices=answer.cdi_devices,
        mounts=tuple((m.host_path, m.container_path) for m in extra.mounts),
    )
