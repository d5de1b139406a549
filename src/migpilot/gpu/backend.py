"""The GPU backend interface: what the node agent asks of a GPU driver, and the values it gets.

The agent needs a handful of driver operations: list the GPUs and their MIG mode, list the MIG
devices of a GPU with their placements and UUIDs, create a GPU instance at an exact placement
together with its full compute instance, destroy one, list the processes running on a MIG
device, wait for XID error events, set a GPU's MIG mode, and read and set a whole GPU's
compute mode (an MPS-shared
GPU is put in ``EXCLUSIVE_PROCESS``, as NVIDIA's device plugin does, so only the MPS server
reaches it). :class:`GpuBackend` is that interface; ``nvml`` implements
it over NVIDIA's official bindings and ``emulated`` in process. Every failure is a
:class:`BackendError` carrying an :class:`ErrorKind` (the driver's answer, mapped) and the
backend's own message, so callers decide on kinds, never on message text.

Types only: this module imports the MIG model and :mod:`migpilot.errors`, no driver bindings.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from migpilot import errors
from migpilot.mig import layouts, pciids, profiles


class ErrorKind(enum.StrEnum):
    """Why a backend operation failed, in the driver's terms."""

    INSUFFICIENT_RESOURCES = "insufficient resources"
    """The placement overlaps an instance or the GPU is full (NVML_ERROR_INSUFFICIENT_RESOURCES)."""
    IN_USE = "in use"
    """Processes run on the instance, or compute instances remain (NVML_ERROR_IN_USE)."""
    NOT_FOUND = "not found"
    """No such GPU, GPU instance or MIG device (NVML_ERROR_NOT_FOUND)."""
    NOT_SUPPORTED = "not supported"
    """The GPU or driver cannot do this, e.g. MIG mode is off (NVML_ERROR_NOT_SUPPORTED)."""
    INVALID_ARGUMENT = "invalid argument"
    """A placement the profile does not allow, or a bad id (NVML_ERROR_INVALID_ARGUMENT)."""
    NO_PERMISSION = "no permission"
    """The operation needs root, e.g. setting a compute mode (NVML_ERROR_NO_PERMISSION)."""
    UNKNOWN = "unknown"
    """Anything else the driver reported."""


class BackendError(errors.MigpilotError):
    """A GPU backend operation failed; ``kind`` says how, ``message`` is the backend's text."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(f"{message} ({kind.value})")
        self.kind = kind
        self.message = message


class ComputeMode(enum.StrEnum):
    """Which CUDA contexts a whole GPU accepts (``nvmlComputeMode_t``, ``nvidia-smi -c``).

    NVML's fourth value, ``EXCLUSIVE_THREAD``, was removed from the driver; a backend that reads
    it anyway reports it as :attr:`EXCLUSIVE_PROCESS`.
    """

    DEFAULT = "default"
    """Any number of contexts, from any processes (NVML_COMPUTEMODE_DEFAULT)."""
    EXCLUSIVE_PROCESS = "exclusive-process"
    """One context, of one process: with MPS that process is the MPS server, so every client
    goes through MPS (NVML_COMPUTEMODE_EXCLUSIVE_PROCESS)."""
    PROHIBITED = "prohibited"
    """No contexts at all (NVML_COMPUTEMODE_PROHIBITED)."""


@dataclass(frozen=True, slots=True)
class MigMode:
    """A GPU's MIG mode now and after the next GPU reset."""

    current: bool
    pending: bool

    @property
    def reset_pending(self) -> bool:
        """True when a mode change waits for a GPU reset."""
        return self.current != self.pending


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One physical GPU as the driver reports it."""

    index: int
    uuid: str
    """``GPU-...``."""
    product_name: str
    """What ``nvmlDeviceGetName`` reports (``NVIDIA H100 80GB HBM3``)."""
    model: profiles.GpuModel | None
    """The catalog model, or ``None`` for a GPU the catalog does not know."""
    memory_mib: int
    mig: MigMode | None
    """``None`` for a GPU that is not MIG-capable."""
    pci_id: pciids.PciId | None = None
    """The GPU's own PCI device and board subsystem ids (``nvmlDeviceGetPciInfo``), which
    mig-parted device filters are matched against; ``None`` from a backend that cannot say."""


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One GPU instance and, when it has one, its full compute instance (the MIG device)."""

    gpu: int
    """Index of the parent GPU."""
    gi_id: int
    """GPU-instance id (unique on its GPU)."""
    ci_id: int | None
    """Compute-instance id, ``None`` for a GPU instance without one (left by a crash)."""
    profile: str
    """Canonical catalog profile name."""
    start: int
    """Start memory slot of the placement."""
    uuid: str | None
    """``MIG-...``, the device id kubelet sees; ``None`` without a compute instance."""

    @property
    def instance(self) -> layouts.Instance:
        """The instance as the MIG model names it."""
        return layouts.Instance(self.start, self.profile)

    @property
    def complete(self) -> bool:
        """True when the GPU instance has its compute instance (a usable MIG device)."""
        return self.ci_id is not None

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An XID critical-error event."""

    gpu: int
    gpu_uuid: str
    xid: int
    gi_id: int | None
    """GPU instance the error is confined to, ``None`` when it concerns the whole GPU."""
    ci_id: int | None
    mig_uuid: str | None
    """The affected MIG device, when the event names one that exists."""


@dataclass(frozen=True, slots=True)
class ProcessSample:
    """One compute process on a GPU as the driver lists it (``nvmlProcessInfo_t``)."""

    pid: int
    """The process id, in the host's pid namespace (``/proc/<pid>/cgroup`` names its pod)."""
    memory_used_bytes: int | None
    """Its device memory; ``None`` where the driver cannot say (``usedGpuMemory`` unavailable)."""
    gi_id: int | None = None
    """The GPU instance it runs in, ``None`` on a GPU with MIG off."""
    mps: bool = False
    """An MPS client (``nvmlDeviceGetMPSComputeRunningProcesses``), not the MPS server."""
    utilization: float | None = None
    """Its SM utilisation, 0-1, over the last sampling interval; ``None`` where the backend
    cannot say. NVML gives it only with MIG off (``nvmlDeviceGetProcessesUtilizationInfo``, the
    percent of the time a kernel of the process ran), and not on the first pass."""


@dataclass(frozen=True, slots=True)
class InstanceSample:
    """One MIG device's readings."""

    gi_id: int
    uuid: str | None
    utilization: float | None
    """SM utilisation 0-1 over the last interval (GPM per GPU instance, Hopper and later);
    ``None`` where the hardware cannot say (A100, A30, or the first sample)."""
    memory_used_bytes: int | None
    memory_total_bytes: int | None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """One sampling pass over one GPU: read-only, ``None`` wherever the hardware cannot say."""

    gpu: int
    uuid: str
    utilization: float | None
    """SM utilisation 0-1 (GPM between this sample and the last, else the driver's utilisation
    rate on a GPU with MIG off); ``None`` where neither is given."""
    memory_used_bytes: int | None
    memory_total_bytes: int | None
    instances: tuple[InstanceSample, ...] = ()
    """The MIG devices, by GPU-instance id (empty with MIG off)."""
    processes: tuple[ProcessSample, ...] | None = ()
    """Every compute process (MPS clients marked); ``None`` when the list cannot be read."""


class GpuBackend(Protocol):
    """The driver operations the node agent uses. Implementations raise :class:`BackendError`."""

    def gpus(self) -> tuple[GpuInfo, ...]:
        """Every GPU, by index."""
        ...

    def mig_devices(self, gpu: int) -> tuple[MigDevice, ...]:
        """The GPU instances of one GPU, with their compute instances, by start slot."""
        ...

    def create_instance(self, gpu: int, *, profile: str, start: int) -> MigDevice:
        """Create a GPU instance of ``profile`` at ``start`` and its full compute instance."""
        ...

    def create_compute_instance(self, gpu: int, gi_id: int) -> MigDevice:
        """Give an existing GPU instance without one its full compute instance."""
        ...

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        """Destroy a GPU instance: its compute instances first, then the GPU instance."""
        ...

    def running_processes(self, gpu: int, uuid: str) -> tuple[int, ...]:
        """PIDs of the compute processes running on MIG device ``uuid``."""
        ...

    def sample(self, gpu: int) -> GpuSample:
        """Read GPU ``gpu``'s utilisation and memory, its MIG devices' and its processes'.

        Read-only: never changes a mode or a setting. A utilisation over an interval is taken
        between this call and the previous one on the same GPU (GPM needs two samples).
        """
        ...

    def wait_xid(self, timeout_s: float) -> XidEvent | None:
        """The next XID critical-error event, or ``None`` after ``timeout_s`` without one."""
        ...

    def compute_mode(self, gpu: int) -> ComputeMode:
        """The compute mode of whole GPU ``gpu``."""
        ...

    def set_compute_mode(self, gpu: int, mode: ComputeMode) -> None:
        """Set whole GPU ``gpu``'s compute mode (takes effect at once; a reboot resets it).

        Refused with ``NOT_SUPPORTED`` while MIG mode is on: the mode then belongs to each MIG
        device, which migpilot never shares through MPS. ``NO_PERMISSION`` without root.
        """
        ...

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> MigMode:
        """Ask for GPU ``gpu``'s MIG mode on or off (``nvmlDeviceSetMigMode``); the mode after.

        Refused with ``IN_USE`` while the GPU has any GPU instance or process: never on a GPU
        with anything on it. From Hopper on the new mode is current when this returns; on
        Ampere the driver resets the GPU to commit it, and where that reset cannot happen (a
        client holds the GPU, a pass-through VM) the result's ``pending`` differs from its
        ``current`` until a later call, a reset or a reboot commits it. ``NOT_SUPPORTED`` on a
        GPU that is not MIG-capable; ``NO_PERMISSION`` without root.
        """
        ...

    def close(self) -> None:
        """Release driver resources; the backend is unusable afterwards."""
        ...
