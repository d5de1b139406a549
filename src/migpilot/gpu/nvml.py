"""The NVML backend: the node agent's GPU operations over NVIDIA's official Python bindings.

This is the only module that talks to the driver. It follows what NVIDIA's own tools do with
NVML (mig-parted, the device plugin, go-nvlib): GPU-instance profiles are looked up per GPU with
``nvmlDeviceGetGpuInstanceProfileInfo`` by their ``NVML_GPU_INSTANCE_PROFILE_*`` index (the
catalog's ``nvml:`` field), so the profile *id* the driver uses comes from the driver; instances
are created with ``nvmlDeviceCreateGpuInstanceWithPlacement`` at an exact start, each with one
compute instance of the full profile; MIG device UUIDs come from the MIG device handles; a whole
GPU's compute mode is read and set with ``nvmlDeviceGetComputeMode``/``nvmlDeviceSetComputeMode``
(what ``nvidia-smi -c``, which NVIDIA's MPS daemon runs, calls), never on a GPU in MIG mode. Driver
errors (``pynvml.NVMLError``) become :class:`~migpilot.gpu.backend.BackendError` with a kind.
Sampling is read-only: memory, SM utilisation (GPM, per GPU and per GPU instance), the process
lists, and on a GPU with MIG off each process's SM utilisation
(``nvmlDeviceGetProcessesUtilizationInfo``), which is what an MPS slice or a replica reports.

The bindings module is injected (default: ``import pynvml`` from nvidia-ml-py), so the same
code runs in CI against :mod:`migpilot.gpu.nvml_standin`. A shell module: it may import
``pynvml`` and ``ctypes``; it never imports the agent.
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pynvml  # type: ignore[import-untyped]

from migpilot import errors
from migpilot.gpu import backend
from migpilot.mig import catalog, pciids, profiles

_NONE_ID = 0xFFFFFFFF
"""NVML's "not applicable" instance id in event data."""

_PROCESS_UTILIZATION_CALLS = (
    "nvmlDeviceGetProcessesUtilizationInfo",
    "nvmlDeviceGetProcessUtilization",
)
"""The per-process utilisation reads, newest first: the v1 struct call (drivers R550 and later),
then the call every driver since Maxwell has. Same samples, same timestamp rule."""


@dataclass(frozen=True, slots=True)
class DriverProfile:
    """A GPU-instance profile as the driver reports it for one GPU."""

    profile: profiles.Profile
    """The catalog profile it maps to (by NVML profile index)."""
    profile_id: int
    """The driver's profile id (what create and list calls take)."""
    memory_mib: int
    instance_count: int
    placements: tuple[int, ...]
    """Possible start slots, read with ``nvmlDeviceGetGpuInstancePossiblePlacements``."""


class NvmlBackend:
    """A :class:`~migpilot.gpu.backend.GpuBackend` over NVML; calls ``nvmlInit`` on creation."""

    def __init__(self, bindings: Any = None, *, cat: catalog.Catalog | None = None) -> None:
        self._nvml: Any = bindings if bindings is not None else pynvml
        self._catalog = cat if cat is not None else catalog.default()
        self._lock = threading.RLock()
        self._profiles: dict[int, dict[int, DriverProfile]] = {}
        self._event_set: Any = None
        self._gpm: dict[tuple[int, int | None], Any] = {}
        """(GPU, GPU-instance id or ``None``) -> the last GPM sample taken there."""
        self._gpm_support: dict[int, bool] = {}
        self._process_seen: dict[int, int] = {}
        """GPU -> the last per-process utilisation timestamp seen there (CPU microseconds, the
        driver's); absent before the first pass with MIG off."""
        self._process_calls: tuple[str, ...] = _PROCESS_UTILIZATION_CALLS
        """The per-process utilisation calls still worth trying (one is dropped for good when the
        driver or the bindings lack it)."""
        with self._mapped("initialising NVML"):
            self._nvml.nvmlInit()

    # --- plumbing ------------------------------------------------------------------------------

    @contextmanager
    def _mapped(self, what: str) -> Iterator[None]:
        try:
            yield
        except self._nvml.NVMLError as e:
            raise _error(self._nvml, e, what) from None

    def _handle(self, gpu: int) -> Any:
        with self._mapped(f"GPU {gpu}"):
            return self._nvml.nvmlDeviceGetHandleByIndex(gpu)

    def _model(self, gpu: int, handle: Any) -> profiles.GpuModel:
        with self._mapped(f"GPU {gpu}: reading its name"):
            name = _text(self._nvml.nvmlDeviceGetName(handle))
        try:
            return self._catalog.resolve(name)
        except errors.UnknownGpuError:
            raise backend.BackendError(
                backend.ErrorKind.NOT_SUPPORTED, f"GPU {gpu} ({name}) is not a known MIG GPU"
            ) from None

    def _array(self, item_type: Any, count: int) -> tuple[Any, ctypes.c_uint]:
        return (item_type * max(count, 1))(), ctypes.c_uint(count)

    # --- profiles ------------------------------------------------------------------------------

    def driver_profiles(self, gpu: int) -> tuple[DriverProfile, ...]:
        """The GPU-instance profiles the driver offers on GPU ``gpu``, with their placements."""
        return tuple(self._profile_table(gpu).values())

    def _profile_table(self, gpu: int) -> dict[int, DriverProfile]:
        with self._lock:
            if gpu in self._profiles:
                return self._profiles[gpu]
            nvml = self._nvml
            handle = self._handle(gpu)
            model = self._model(gpu, handle)
            table: dict[int, DriverProfile] = {}
            for p in model.profiles:
                try:
                    info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, p.nvml_index)
                except nvml.NVMLError as e:
                    if e.value in (nvml.NVML_ERROR_NOT_SUPPORTED, nvml.NVML_ERROR_INVALID_ARGUMENT):
                        continue  # this driver does not offer the profile (go-nvlib skips too)
                    raise _error(nvml, e, f"GPU {gpu}: profile {p.name}") from None
                with self._mapped(f"GPU {gpu}: placements of {p.name}"):
                    places, count = self._array(
                        nvml.c_nvmlGpuInstancePlacement_t, len(p.placements) + 8
                    )
                    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(
                        handle, info.id, places, ctypes.byref(count)
                    )
                table[int(info.id)] = DriverProfile(
                    profile=p,
                    profile_id=int(info.id),
                    memory_mib=int(info.memorySizeMB),
                    instance_count=int(info.instanceCount),
                    placements=tuple(int(places[i].start) for i in range(count.value)),
                )
            self._profiles[gpu] = table
            return table

    def _driver_profile(self, gpu: int, name: str) -> DriverProfile:
        for dp in self._profile_table(gpu).values():
            if dp.profile.name == name:
                return dp
        raise backend.BackendError(
            backend.ErrorKind.NOT_SUPPORTED, f"GPU {gpu}: the driver offers no profile {name}"
        )

    # --- the GpuBackend protocol ---------------------------------------------------------------

    def gpus(self) -> tuple[backend.GpuInfo, ...]:
        """Every GPU NVML sees."""
        nvml = self._nvml
        with self._mapped("counting GPUs"):
            count = int(nvml.nvmlDeviceGetCount())
        out: list[backend.GpuInfo] = []
        for index in range(count):
            handle = self._handle(index)
            with self._mapped(f"GPU {index}"):
                name = _text(nvml.nvmlDeviceGetName(handle))
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1024 * 1024)
                pci = nvml.nvmlDeviceGetPciInfo(handle)
                # Both 32-bit fields pack device<<16 | vendor, as mig-parted's ids are written.
                pci_id = pciids.PciId(int(pci.pciDeviceId), int(pci.pciSubSystemId))
            mig: backend.MigMode | None
            try:
                current, pending = nvml.nvmlDeviceGetMigMode(handle)
                mig = backend.MigMode(
                    current == nvml.NVML_DEVICE_MIG_ENABLE, pending == nvml.NVML_DEVICE_MIG_ENABLE
                )
            except nvml.NVMLError as e:
                if e.value != nvml.NVML_ERROR_NOT_SUPPORTED:
                    raise _error(nvml, e, f"GPU {index}: MIG mode") from None
                mig = None
            try:
                model: profiles.GpuModel | None = self._catalog.resolve(name)
            except errors.UnknownGpuError:
                model = None
            out.append(backend.GpuInfo(index, uuid, name, model, memory, mig, pci_id=pci_id))
        return tuple(out)

    def mig_devices(self, gpu: int) -> tuple[backend.MigDevice, ...]:
        """The GPU instances of GPU ``gpu`` with their full compute instances and UUIDs."""
        nvml = self._nvml
        handle = self._handle(gpu)
        with self._mapped(f"GPU {gpu}: MIG mode"):
            current, _ = nvml.nvmlDeviceGetMigMode(handle)
        if current != nvml.NVML_DEVICE_MIG_ENABLE:
            return ()
        uuids = self._mig_uuids(gpu, handle)
        out: list[backend.MigDevice] = []
        for dp in self._profile_table(gpu).values():
            with self._mapped(f"GPU {gpu}: listing {dp.profile.name} instances"):
                gis, count = self._array(nvml.c_nvmlGpuInstance_t, dp.instance_count)
                nvml.nvmlDeviceGetGpuInstances(handle, dp.profile_id, gis, ctypes.byref(count))
                for i in range(count.value):
                    info = nvml.nvmlGpuInstanceGetInfo(gis[i])
                    cis = self._compute_instance_ids(gis[i], dp.profile)
                    ci = min(cis) if cis else None
                    gi_id = int(info.id)
                    out.append(
                        backend.MigDevice(
                            gpu=gpu,
                            gi_id=gi_id,
                            ci_id=ci,
                            profile=dp.profile.name,
                            start=int(info.placement.start),
                            uuid=uuids.get((gi_id, ci)) if ci is not None else None,
                        )
                    )
        return tuple(sorted(out, key=lambda d: (d.start, d.gi_id)))

    def create_instance(self, gpu: int, *, profile: str, start: int) -> backend.MigDevice:
        """``nvmlDeviceCreateGpuInstanceWithPlacement`` then a full compute instance."""
        nvml = self._nvml
        handle = self._handle(gpu)
        dp = self._driver_profile(gpu, profile)
        placement = nvml.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = dp.profile.memory_slots
        with self._mapped(f"GPU {gpu}: creating {profile}@{start}"):
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                handle, dp.profile_id, ctypes.byref(placement)
            )
            gi_id = int(nvml.nvmlGpuInstanceGetInfo(gi).id)
        return self._create_full_compute_instance(
            gpu, handle=handle, gi=gi, gi_id=gi_id, profile=dp.profile, start=start
        )

    def create_compute_instance(self, gpu: int, gi_id: int) -> backend.MigDevice:
        """Give GPU instance ``gi_id`` its full compute instance (repairs a half-made one)."""
        nvml = self._nvml
        handle = self._handle(gpu)
        with self._mapped(f"GPU {gpu}: GPU instance {gi_id}"):
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            info = nvml.nvmlGpuInstanceGetInfo(gi)
        dp = self._profile_table(gpu).get(int(info.profileId))
        if dp is None:
            raise backend.BackendError(
                backend.ErrorKind.NOT_SUPPORTED,
                f"GPU {gpu}: GPU instance {gi_id} has unknown profile id {info.profileId}",
            )
        start = int(info.placement.start)
        return self._create_full_compute_instance(
            gpu, handle=handle, gi=gi, gi_id=gi_id, profile=dp.profile, start=start
        )

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        """Destroy the compute instances of GPU instance ``gi_id``, then the GPU instance."""
        nvml = self._nvml
        handle = self._handle(gpu)
        with self._mapped(f"GPU {gpu}: GPU instance {gi_id}"):
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
            info = nvml.nvmlGpuInstanceGetInfo(gi)
        dp = self._profile_table(gpu).get(int(info.profileId))
        if dp is not None:
            for ci in self._compute_instances(gi, dp.profile):
                with self._mapped(f"GPU {gpu}: destroying the compute instance of {gi_id}"):
                    nvml.nvmlComputeInstanceDestroy(ci)
        with self._mapped(f"GPU {gpu}: destroying GPU instance {gi_id}"):
            nvml.nvmlGpuInstanceDestroy(gi)

    def running_processes(self, gpu: int, uuid: str) -> tuple[int, ...]:
        """PIDs of compute processes on MIG device ``uuid``."""
        nvml = self._nvml
        with self._mapped(f"GPU {gpu}: processes on {uuid}"):
            mig = nvml.nvmlDeviceGetHandleByUUID(uuid)
            return tuple(int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(mig))

    # --- sampling (read-only) --------------------------------------------------------------------

    def sample(self, gpu: int) -> backend.GpuSample:
        """GPU ``gpu``'s memory, SM utilisation (GPM between this call and the last, else the
        utilisation rate with MIG off), its MIG devices' (memory from their handles, GPM per GPU
        instance on Hopper and later) and its processes (MPS clients marked; with MIG off, each
        one's SM utilisation between this call and the last). Read-only."""
        nvml = self._nvml
        handle = self._handle(gpu)
        with self._mapped(f"GPU {gpu}: sampling"):
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        try:
            current, _ = nvml.nvmlDeviceGetMigMode(handle)
            mig_on = current == nvml.NVML_DEVICE_MIG_ENABLE
        except nvml.NVMLError:
            mig_on = False
        util = self._gpm_util(gpu, handle, None)
        if util is None and not mig_on:
            util = self._optional(lambda: nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0)
        instances: list[backend.InstanceSample] = []
        if mig_on:
            for (gi, _), mig_uuid in sorted(self._mig_uuids(gpu, handle).items()):
                mig = self._optional(lambda u=mig_uuid: nvml.nvmlDeviceGetHandleByUUID(u))
                info = self._optional(lambda m=mig: nvml.nvmlDeviceGetMemoryInfo(m))
                instances.append(
                    backend.InstanceSample(
                        gi_id=gi,
                        uuid=mig_uuid,
                        utilization=self._gpm_util(gpu, handle, gi),
                        memory_used_bytes=None if info is None else int(info.used),
                        memory_total_bytes=None if info is None else int(info.total),
                    )
                )
        processes = self._processes(handle)
        if mig_on:
            # nvml.h: "On MIG-enabled GPUs, querying process utilization is not currently
            # supported": no call, and a fresh start if MIG goes off again.
            self._process_seen.pop(gpu, None)
        elif processes is not None:
            processes = process_utilization(processes, self._process_shares(gpu, handle))
        return backend.GpuSample(
            gpu=gpu,
            uuid=uuid,
            utilization=util,
            memory_used_bytes=int(mem.used),
            memory_total_bytes=int(mem.total),
            instances=tuple(instances),
            processes=processes,
        )

    def _optional(self, read: Any) -> Any:
        """``read()``, or ``None`` when the driver cannot say (any NVML error)."""
        try:
            return read()
        except self._nvml.NVMLError:
            return None

    def _processes(self, handle: Any) -> tuple[backend.ProcessSample, ...] | None:
        nvml = self._nvml
        listed = self._optional(lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle))
        if listed is None:
            return None
        clients = self._optional(lambda: nvml.nvmlDeviceGetMPSComputeRunningProcesses(handle))
        mps = {int(p.pid) for p in clients or ()}
        out: dict[int, backend.ProcessSample] = {}
        for p in [*listed, *(clients or ())]:
            pid = int(p.pid)
            used = getattr(p, "usedGpuMemory", None)
            gi = getattr(p, "gpuInstanceId", None)
            out[pid] = backend.ProcessSample(
                pid=pid,
                memory_used_bytes=None if used is None else int(used),
                gi_id=None if gi is None or gi == _NONE_ID else int(gi),
                mps=pid in mps,
            )
        return tuple(out[pid] for pid in sorted(out))

    def _process_shares(self, gpu: int, handle: Any) -> dict[int, float | None] | None:
        """pid -> its SM utilisation 0-1 between the last pass on ``gpu`` and now, for each
        process NVML sampled (``None``: a reading out of range); ``None`` when NVML cannot say:
        the first pass (it only sets the timestamp, as GPM's first sample does), a GPU or driver
        without the call (``NOT_SUPPORTED``, ``NO_PERMISSION``, ...).

        The timestamp is the driver's own: the newest sample's ``timeStamp`` becomes the next
        pass's ``lastSeenTimeStamp`` (nvml.h: "Set lastSeenTimeStamp to a timeStamp retrieved
        from a previous query to read utilization since the previous query"), so no clock of
        ours is compared with the driver's, and a pass with no sample keeps the old one.
        """
        last = self._process_seen.get(gpu)
        try:
            samples = self._process_samples(handle, 0 if last is None else last)
        except self._nvml.NVMLError:
            return None
        newest = max((int(s.timeStamp) for s in samples), default=0)
        self._process_seen[gpu] = max(newest, last or 0)
        if last is None:
            return None
        return _shares(samples)

    def _process_samples(self, handle: Any, last_seen: int) -> list[Any]:
        """The per-process utilisation samples newer than ``last_seen``; ``[]`` when NVML says
        there are none. Raises ``NVMLError`` when it cannot say."""
        nvml = self._nvml
        try:
            try:
                return self._process_samples_once(handle, last_seen)
            except nvml.NVMLError as e:
                if e.value != nvml.NVML_ERROR_INSUFFICIENT_SIZE:
                    raise
                # A process started between the bindings' sizing call and their read: once more.
                return self._process_samples_once(handle, last_seen)
        except nvml.NVMLError as e:
            # NOT_FOUND: "If no valid sample entries are found since the lastSeenTimeStamp"
            # (nvml.h). SUCCESS: nvidia-ml-py raises NVMLError(NVML_SUCCESS) when the driver
            # answers its sizing call with success, having nothing to size a buffer for.
            if e.value in (nvml.NVML_ERROR_NOT_FOUND, nvml.NVML_SUCCESS):
                return []
            raise

    def _process_samples_once(self, handle: Any, last_seen: int) -> list[Any]:
        """One read with the newest call the bindings and the driver have."""
        nvml = self._nvml
        while True:
            name, *older = self._process_calls
            read = getattr(nvml, name, None)  # None: nvidia-ml-py older than the call
            if read is not None:
                try:
                    return list(read(handle, last_seen))
                except nvml.NVMLError as e:
                    lacking = (
                        nvml.NVML_ERROR_FUNCTION_NOT_FOUND,  # a driver older than the call
                        nvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,  # it knows no v1 struct
                    )
                    if not older or e.value not in lacking:
                        raise
            elif not older:
                raise nvml.NVMLError(nvml.NVML_ERROR_FUNCTION_NOT_FOUND)
            self._process_calls = tuple(older)

    def _gpm_util(self, gpu: int, handle: Any, gi: int | None) -> float | None:
        """SM utilisation 0-1 between the last GPM sample of (``gpu``, ``gi``) and a new one;
        ``None`` without GPM (before Hopper) or on the first call."""
        nvml = self._nvml
        if gpu not in self._gpm_support:
            support = self._optional(lambda: nvml.nvmlGpmQueryDeviceSupport(handle))
            self._gpm_support[gpu] = bool(support is not None and support.isSupportedDevice)
        if not self._gpm_support[gpu]:
            return None
        try:
            fresh = nvml.nvmlGpmSampleAlloc()
        except nvml.NVMLError:
            return None
        try:
            if gi is None:
                nvml.nvmlGpmSampleGet(handle, fresh)
            else:
                nvml.nvmlGpmMigSampleGet(handle, gi, fresh)
        except nvml.NVMLError:
            nvml.nvmlGpmSampleFree(fresh)
            return None
        last = self._gpm.get((gpu, gi))
        self._gpm[(gpu, gi)] = fresh
        if last is None:
            return None
        try:
            got = nvml.c_nvmlGpmMetricsGet_t()
            got.version = nvml.NVML_GPM_METRICS_GET_VERSION
            got.numMetrics = 1
            got.sample1 = last
            got.sample2 = fresh
            got.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
            nvml.nvmlGpmMetricsGet(got)
            if got.metrics[0].nvmlReturn != nvml.NVML_SUCCESS:
                return None
            return min(max(float(got.metrics[0].value) / 100.0, 0.0), 1.0)
        except nvml.NVMLError:
            return None
        finally:
            nvml.nvmlGpmSampleFree(last)

    def wait_xid(self, timeout_s: float) -> backend.XidEvent | None:
        """The next XID critical error (registered on every GPU at the first call)."""
        nvml = self._nvml
        with self._lock:
            if self._event_set is None:
                self._event_set = self._register_xid_events()
            event_set = self._event_set
        try:
            data = nvml.nvmlEventSetWait(event_set, int(timeout_s * 1000))
        except nvml.NVMLError as e:
            if e.value == nvml.NVML_ERROR_TIMEOUT:
                return None
            raise _error(nvml, e, "waiting for XID events") from None
        with self._mapped("reading an XID event"):
            gpu_uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
        index = next((g.index for g in self.gpus() if g.uuid == gpu_uuid), -1)
        gi = None if data.gpuInstanceId == _NONE_ID else int(data.gpuInstanceId)
        ci = None if data.computeInstanceId == _NONE_ID else int(data.computeInstanceId)
        mig_uuid = None
        if index >= 0 and gi is not None:
            for dev in self.mig_devices(index):
                if dev.gi_id == gi and (ci is None or dev.ci_id == ci):
                    mig_uuid = dev.uuid
        return backend.XidEvent(index, gpu_uuid, int(data.eventData), gi, ci, mig_uuid)

    def compute_mode(self, gpu: int) -> backend.ComputeMode:
        """``nvmlDeviceGetComputeMode`` of whole GPU ``gpu``."""
        nvml = self._nvml
        handle = self._handle(gpu)
        with self._mapped(f"GPU {gpu}: reading its compute mode"):
            value = int(nvml.nvmlDeviceGetComputeMode(handle))
        modes = _compute_modes(nvml)
        if value == nvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD:
            return backend.ComputeMode.EXCLUSIVE_PROCESS  # removed from drivers; the nearest
        for mode, code in modes.items():
            if code == value:
                return mode
        raise backend.BackendError(
            backend.ErrorKind.UNKNOWN, f"GPU {gpu}: unknown compute mode {value}"
        )

    def set_compute_mode(self, gpu: int, mode: backend.ComputeMode) -> None:
        """``nvmlDeviceSetComputeMode`` on whole GPU ``gpu``; refused while MIG mode is on."""
        nvml = self._nvml
        handle = self._handle(gpu)
        try:
            current, _ = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as e:
            if e.value != nvml.NVML_ERROR_NOT_SUPPORTED:
                raise _error(nvml, e, f"GPU {gpu}: MIG mode") from None
            current = nvml.NVML_DEVICE_MIG_DISABLE  # not MIG-capable: a whole GPU
        if current == nvml.NVML_DEVICE_MIG_ENABLE:
            raise backend.BackendError(
                backend.ErrorKind.NOT_SUPPORTED,
                f"GPU {gpu} is in MIG mode: its compute mode is per MIG device",
            )
        code = _compute_modes(nvml)[backend.ComputeMode(mode)]
        with self._mapped(f"GPU {gpu}: setting compute mode {mode.value}"):
            nvml.nvmlDeviceSetComputeMode(handle, code)

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> backend.MigMode:
        """``nvmlDeviceSetMigMode``, only on a GPU with no GPU instance and no process.

        The activation status is not an error: ``IN_USE`` or ``RESET_REQUIRED`` there leave the
        new mode pending, which the mode read afterwards says. The handle is taken again after
        the call, as the driver may have unbound and reset the GPU.
        """
        nvml = self._nvml
        handle = self._handle(gpu)
        with self._mapped(f"GPU {gpu}: MIG mode"):
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        want = nvml.NVML_DEVICE_MIG_ENABLE if enabled else nvml.NVML_DEVICE_MIG_DISABLE
        if current == want and pending == want:
            return backend.MigMode(enabled, enabled)
        if current == nvml.NVML_DEVICE_MIG_ENABLE and self.mig_devices(gpu):
            raise backend.BackendError(
                backend.ErrorKind.IN_USE, f"GPU {gpu} has GPU instances; MIG mode not changed"
            )
        with self._mapped(f"GPU {gpu}: listing processes"):
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        if running:
            pids = ", ".join(str(int(p.pid)) for p in running)
            raise backend.BackendError(
                backend.ErrorKind.IN_USE, f"GPU {gpu} has processes ({pids}); MIG mode not changed"
            )
        with self._mapped(f"GPU {gpu}: setting MIG mode {'on' if enabled else 'off'}"):
            nvml.nvmlDeviceSetMigMode(handle, want)
        handle = self._handle(gpu)
        with self._mapped(f"GPU {gpu}: MIG mode"):
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        return backend.MigMode(
            current == nvml.NVML_DEVICE_MIG_ENABLE, pending == nvml.NVML_DEVICE_MIG_ENABLE
        )

    def close(self) -> None:
        """Free the event set and shut NVML down."""
        with self._lock, self._mapped("shutting NVML down"):
            if self._event_set is not None:
                self._nvml.nvmlEventSetFree(self._event_set)
                self._event_set = None
            self._nvml.nvmlShutdown()

    # --- internals -----------------------------------------------------------------------------

    def _register_xid_events(self) -> Any:
        nvml = self._nvml
        with self._mapped("creating an NVML event set"):
            event_set = nvml.nvmlEventSetCreate()
            count = int(nvml.nvmlDeviceGetCount())
        for index in range(count):
            handle = self._handle(index)
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
            except nvml.NVMLError as e:
                if e.value != nvml.NVML_ERROR_NOT_SUPPORTED:
                    raise _error(nvml, e, f"GPU {index}: registering XID events") from None
        return event_set

    def _mig_uuids(self, gpu: int, handle: Any) -> dict[tuple[int, int], str]:
        """(GPU-instance id, compute-instance id) -> MIG device UUID, from the MIG handles."""
        nvml = self._nvml
        out: dict[tuple[int, int], str] = {}
        with self._mapped(f"GPU {gpu}: MIG device handles"):
            count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
        for i in range(count):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
            except nvml.NVMLError as e:
                if e.value == nvml.NVML_ERROR_NOT_FOUND:
                    continue  # no MIG device at this index (mig-parted and the plugin skip too)
                raise _error(nvml, e, f"GPU {gpu}: MIG device {i}") from None
            with self._mapped(f"GPU {gpu}: MIG device {i}"):
                key = (
                    int(nvml.nvmlDeviceGetGpuInstanceId(mig)),
                    int(nvml.nvmlDeviceGetComputeInstanceId(mig)),
                )
                out[key] = _text(nvml.nvmlDeviceGetUUID(mig))
        return out

    def _full_ci_profile(self, gi: Any, profile: profiles.Profile) -> Any:
        nvml = self._nvml
        index = getattr(nvml, f"NVML_COMPUTE_INSTANCE_PROFILE_{profile.compute_slices}_SLICE")
        return nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            gi, index, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        )

    def _compute_instances(self, gi: Any, profile: profiles.Profile) -> list[Any]:
        nvml = self._nvml
        with self._mapped(f"compute instances of a {profile.name} GPU instance"):
            ci_info = self._full_ci_profile(gi, profile)
            cis, count = self._array(nvml.c_nvmlComputeInstance_t, int(ci_info.instanceCount))
            nvml.nvmlGpuInstanceGetComputeInstances(gi, ci_info.id, cis, ctypes.byref(count))
            return [cis[i] for i in range(count.value)]

    def _compute_instance_ids(self, gi: Any, profile: profiles.Profile) -> list[int]:
        nvml = self._nvml
        return [
            int(nvml.nvmlComputeInstanceGetInfo(ci).id)
            for ci in self._compute_instances(gi, profile)
        ]

    def _create_full_compute_instance(
        self, gpu: int, *, handle: Any, gi: Any, gi_id: int, profile: profiles.Profile, start: int
    ) -> backend.MigDevice:
        nvml = self._nvml
        with self._mapped(f"GPU {gpu}: creating the compute instance of {profile.name}@{start}"):
            ci_info = self._full_ci_profile(gi, profile)
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_info.id)
            ci_id = int(nvml.nvmlComputeInstanceGetInfo(ci).id)
        uuid = self._mig_uuids(gpu, handle).get((gi_id, ci_id))
        return backend.MigDevice(gpu, gi_id, ci_id, profile.name, start, uuid)


def process_utilization(
    processes: Sequence[backend.ProcessSample], shares: Mapping[int, float | None] | None
) -> tuple[backend.ProcessSample, ...]:
    """``processes`` with their SM utilisation from ``shares`` (pid -> 0-1 over the interval,
    what :meth:`NvmlBackend.sample` read with MIG off; ``None``: NVML could not say). Pure.

    A process with a sample gets it. A process without one gets 0.0: NVML returns "one
    utilization sample structure ... per process running, that had some non-zero utilization
    during the last sample period" (nvml.h, ``nvmlDeviceGetProcessUtilization`` and
    ``nvmlDeviceGetProcessesUtilizationInfo``), so a listed process with no sample did not use
    the SMs. One exception keeps a made-up zero out: an MPS client without a sample while a
    process that is not a client (the MPS server) has one reads ``None``: NVML may then have
    booked the clients' work to the server (pre-Volta MPS clients submit their work through it:
    NVIDIA's MPS guide, "Volta MPS clients submit work directly to the GPU without passing
    through the MPS server"; not yet checked on real hardware), and what each client did cannot
    be told apart.
    """
    if shares is None:
        return tuple(processes)
    # A server sample out of range (None) counts as busy: it was sampled, for an unknown use.
    server_busy = any(p.mps for p in processes) and any(
        not p.mps and shares.get(p.pid, 0.0) != 0.0 for p in processes
    )
    unsampled_client = None if server_busy else 0.0
    return tuple(
        dataclasses.replace(p, utilization=shares.get(p.pid, unsampled_client if p.mps else 0.0))
        for p in processes
    )


def _shares(samples: Iterable[Any]) -> dict[int, float | None]:
    """pid -> the mean ``smUtil`` of its samples as 0-1; ``None`` for a pid with a reading
    above 100 % (drivers have returned garbage there, e.g. 2147483632: NVIDIA/DCGM#83).

    nvml.h promises one sample per process (the driver's own reading since
    ``lastSeenTimeStamp``); should a driver give several for one pid, nvml.h says nothing of
    how they combine, and their mean is taken: each is one stretch of the interval, and the mean
    neither adds stretches up past 100 % nor drops any."""
    by_pid: dict[int, list[int]] = {}
    for s in samples:
        by_pid.setdefault(int(s.pid), []).append(int(s.smUtil))
    return {
        pid: None if max(values) > 100 else sum(values) / len(values) / 100.0
        for pid, values in by_pid.items()
    }


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _error(nvml: Any, err: Any, what: str) -> backend.BackendError:
    """A backend error for an ``NVMLError`` raised while doing ``what``."""
    text = str(err)
    if text.startswith("NVML Error with code"):
        # Without the library nvmlErrorString is unavailable; name the constant instead.
        names = sorted(n for n in dir(nvml) if n.startswith("NVML_ERROR_"))
        text = next((n for n in names if getattr(nvml, n) == err.value), text)
    return backend.BackendError(_kind(nvml, err.value), f"{what}: {text}")


def _compute_modes(nvml: Any) -> dict[backend.ComputeMode, int]:
    """Each compute mode's ``NVML_COMPUTEMODE_*`` code."""
    return {
        backend.ComputeMode.DEFAULT: nvml.NVML_COMPUTEMODE_DEFAULT,
        backend.ComputeMode.EXCLUSIVE_PROCESS: nvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
        backend.ComputeMode.PROHIBITED: nvml.NVML_COMPUTEMODE_PROHIBITED,
    }


def _kind(nvml: Any, code: int) -> backend.ErrorKind:
    """The backend error kind of an NVML return code."""
    table: dict[int, backend.ErrorKind] = {
        nvml.NVML_ERROR_INSUFFICIENT_RESOURCES: backend.ErrorKind.INSUFFICIENT_RESOURCES,
        nvml.NVML_ERROR_IN_USE: backend.ErrorKind.IN_USE,
        nvml.NVML_ERROR_NOT_FOUND: backend.ErrorKind.NOT_FOUND,
        nvml.NVML_ERROR_NOT_SUPPORTED: backend.ErrorKind.NOT_SUPPORTED,
        nvml.NVML_ERROR_INVALID_ARGUMENT: backend.ErrorKind.INVALID_ARGUMENT,
        nvml.NVML_ERROR_NO_PERMISSION: backend.ErrorKind.NO_PERMISSION,
    }
    return table.get(code, backend.ErrorKind.UNKNOWN)
