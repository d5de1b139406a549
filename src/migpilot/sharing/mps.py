"""The MPS control daemons a node needs, and what a container sharing a GPU through MPS is told.

As NVIDIA's MPS manager (k8s-device-plugin ``cmd/mps-control-daemon/mps``): one daemon per
shared resource, its pipe and log folders under the MPS root (``<root>/<resource>/pipe`` and
``.../log``, the host's ``/run/nvidia/mps`` by default), each device's default pinned memory
limit its memory divided by its replicas (``set_default_device_pinned_mem_limit <index> <N>M``)
and the default active thread percentage 100 divided by the replicas per device. NVIDIA's plugin
leaves the per-client limits to those daemon defaults; here the Allocate answer also sets them
in each container (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``)
so a container holds its slice even when the daemon was started by someone else, beside
``CUDA_MPS_PIPE_DIRECTORY`` and the mounts of the pipe folder and the shared-memory folder.

How much memory MPS slices may share on one GPU (:func:`memory_gb`) lives here too: the
planner, the GpuLayout's schema and the agent all measure a GPU by it.

This module only describes; starting and watching the daemons is ``agent/mps.py``'s job (the
supervisor consumes :func:`daemons`). Pure; imports :mod:`migpilot.mig` and this package only.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from migpilot.mig import profiles
from migpilot.sharing import config as sharing_config
from migpilot.sharing import replicas

DEFAULT_ROOT = "/run/nvidia/mps"
"""The host folder of the daemons' files (NVIDIA's ``--mps-root`` in its Helm chart)."""
CONTAINER_ROOT = "/mps"
"""Where a container finds the pipe folders (NVIDIA's ``mps.ContainerRoot``)."""
CONTAINER_SHM = "/dev/shm"

PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"
PINNED_ENV = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
THREADS_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


@functools.lru_cache(maxsize=4096)
def memory_gb(model: profiles.GpuModel) -> int:
    """A GPU's memory as MPS slices share it, in whole GB: its largest MIG profile's nominal GB
    (80 on an A100-80GB or H100-80GB, 40 on an A100-40GB, 24 on an A30)."""
    return max(p.nominal_gb for p in model.profiles)


@dataclass(frozen=True, slots=True)
class MpsDevice:
    """One device a daemon serves."""

    uuid: str
    index: str
    """NVIDIA's device index, as ``set_default_device_pinned_mem_limit`` takes it."""
    replicas: int
    pinned_limit_mib: int
    """The device's memory divided by its replicas, MiB."""


@dataclass(frozen=True, slots=True)
class Mount:
    """A host folder mounted into a container."""

    host_path: str
    container_path: str


@dataclass(frozen=True, slots=True)
class MpsDaemon:
    """One MPS control daemon: the devices of one shared resource."""

    resource: str
    devices: tuple[MpsDevice, ...]
    pipe_dir: str
    """``CUDA_MPS_PIPE_DIRECTORY`` of the daemon, on the host."""
    log_dir: str
    """``CUDA_MPS_LOG_DIRECTORY`` of the daemon, on the host."""
    shm_dir: str
    """The host folder mounted as the containers' ``/dev/shm``."""
    active_thread_percentage: int
    """The daemon's default (``set_default_active_thread_percentage``)."""

    @property
    def container_pipe_dir(self) -> str:
        """Where a container sees :attr:`pipe_dir`."""
        return f"{CONTAINER_ROOT}/{self.resource}/pipe"

    @property
    def environment(self) -> dict[str, str]:
        """The daemon's own environment (pipe and log folders)."""
        return {PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}

    def control_commands(self) -> tuple[str, ...]:
        """What is written to ``nvidia-cuda-mps-control`` once the daemon runs, as NVIDIA's."""
        limits = tuple(
            f"set_default_device_pinned_mem_limit {d.index} {d.pinned_limit_mib}M"
            for d in self.devices
        )
        return (*limits, f"set_default_active_thread_percentage {self.active_thread_percentage}")

    def device(self, uuid: str) -> MpsDevice | None:
        """The served device with this UUID."""
        for d in self.devices:
            if d.uuid == uuid:
                return d
        return None


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What the Allocate answer adds for a container of an MPS-shared resource."""

    envs: dict[str, str]
    mounts: tuple[Mount, ...]


def daemons(
    resources: Sequence[replicas.Resource],
    sharing: sharing_config.Config,
    *,
    root: str | None = None,
) -> tuple[MpsDaemon, ...]:
    """The daemons the node needs under ``sharing`` for the (replicated) ``resources``: one per
    resource with replicas, none unless the strategy is MPS. ``root``: the MPS root (default
    ``flags.mpsRoot``, else :data:`DEFAULT_ROOT`)."""
    if sharing.strategy is not sharing_config.SharingStrategy.MPS:
        return ()
    base = (root or sharing.mps_root or DEFAULT_ROOT).rstrip("/") or "/"
    out: list[MpsDaemon] = []
    for resource in sorted(resources, key=lambda r: r.name):
        shared = [d for d in resource.devices if replicas.is_replica(d.id)]
        if not shared:
            continue
        by_uuid: dict[str, replicas.Device] = {}
        for d in shared:
            by_uuid.setdefault(d.real_id, d)
        served = tuple(
            MpsDevice(
                uuid=uuid,
                index=d.index,
                replicas=d.replicas,
                pinned_limit_mib=d.memory_mib // d.replicas,
            )
            for uuid, d in by_uuid.items()
        )
        per_device = len(resource.devices) // len({d.real_id for d in resource.devices})
        out.append(
            MpsDaemon(
                resource=resource.name,
                devices=served,
                pipe_dir=f"{base}/{resource.name}/pipe",
                log_dir=f"{base}/{resource.name}/log",
                shm_dir=f"{base}/shm",
                active_thread_percentage=100 // max(per_device, 1),
            )
        )
    return tuple(out)


def client(daemon: MpsDaemon, device_ids: Sequence[str]) -> ClientSettings:
    """What a container that gets ``device_ids`` (replica or real IDs) of the daemon's resource
    is told: the pipe folder, each device's pinned memory limit by its ordinal in the container
    (``0=40960M``), the thread percentage of its most shared device, and the mounts."""
    limits: list[tuple[int, int]] = []
    most = 1
    for ordinal, uuid in enumerate(replicas.real_ids(device_ids)):
        served = daemon.device(uuid)
        if served is None:
            continue
        limits.append((ordinal, served.pinned_limit_mib))
        most = max(most, served.replicas)
    return client_settings(daemon, pinned_mib=limits, threads=100 // most)


def client_settings(
    daemon: MpsDaemon, *, pinned_mib: Sequence[tuple[int, int]], threads: int | None
) -> ClientSettings:
    """The environment and mounts of one client of ``daemon``: its pipe folder (as the
    container sees it), ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from ``(ordinal in the container,
    MiB)`` pairs (``0=40960M,1=20480M``; unset when empty), ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``
    (unset when ``None``), and the pipe and shared-memory mounts. The one recipe for replicas of
    the sharing config (:func:`client`) and for the GpuLayout's MPS slices."""
    envs = {PIPE_ENV: daemon.container_pipe_dir}
    if threads is not None:
        envs[THREADS_ENV] = str(threads)
    if pinned_mib:
        envs[PINNED_ENV] = ",".join(f"{ordinal}={mib}M" for ordinal, mib in pinned_mib)
    return ClientSettings(
        envs=envs,
        mounts=(
            Mount(host_path=daemon.pipe_dir, container_path=daemon.container_pipe_dir),
            Mount(host_path=daemon.shm_dir, container_path=CONTAINER_SHM),
        ),
    )
