"""A stand-in for NVIDIA's ``pynvml`` module, backed by an emulated GPU: NVML without a GPU.

The NVML adapter (:mod:`migpilot.gpu.nvml`) is the code that will drive real hardware, so CI
must run it. :class:`NvmlStandin` has the functions the adapter calls, with the signatures,
argument conventions and return shapes of nvidia-ml-py (ctypes structs filled in, arrays and
``byref`` counts written through, handles that are real ctypes pointers), and it raises the
REAL ``pynvml.NVMLError`` subclasses with the driver's codes. Every other attribute (the
``NVML_*`` constants, the ``c_nvml*`` structs, ``NVMLError``) is nvidia-ml-py's own, looked up
on the real module, so a constant cannot drift. Behind it sits an
:class:`~migpilot.gpu.emulated.EmulatedBackend`, whose driver steps map one to one onto NVML's
create/destroy calls; faults injected there surface here as NVML errors.

Handles encode what they point to in their address (kind, GPU, GPU instance, compute instance);
they are never dereferenced. Functions the adapter does not use are absent: calling one raises
``AttributeError`` rather than reaching for a real driver. A test can make the stand-in a driver
that lacks a function (``missing``: ``NVML_ERROR_FUNCTION_NOT_FOUND``, as nvidia-ml-py raises when
the library has no such symbol) or a GPU that does not support it (``not_supported``).

Per-process utilisation follows nvml.h: the driver keeps samples stamped with CPU microseconds
(``clock_us``); one is taken for each process with a non-zero load whenever a process-utilisation
call is made (an emulated load is steady, so when does not matter), and a call returns, per pid,
the mean of its samples newer than ``lastSeenTimeStamp`` with the newest one's stamp, or
``NVML_ERROR_NOT_FOUND`` when there is none; ``NVML_ERROR_NOT_SUPPORTED`` with MIG on.
"""

# The names of functions and parameters are nvidia-ml-py's, so the adapter calls it unchanged.
# ruff: noqa: N802, N803

from __future__ import annotations

import collections
import ctypes
import time
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import pynvml  # type: ignore[import-untyped]

from migpilot.gpu import backend, emulated
from migpilot.mig import profiles

_ERROR_CODES: dict[backend.ErrorKind, int] = {
    backend.ErrorKind.INSUFFICIENT_RESOURCES: pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES,
    backend.ErrorKind.IN_USE: pynvml.NVML_ERROR_IN_USE,
    backend.ErrorKind.NOT_FOUND: pynvml.NVML_ERROR_NOT_FOUND,
    backend.ErrorKind.NOT_SUPPORTED: pynvml.NVML_ERROR_NOT_SUPPORTED,
    backend.ErrorKind.INVALID_ARGUMENT: pynvml.NVML_ERROR_INVALID_ARGUMENT,
    backend.ErrorKind.NO_PERMISSION: pynvml.NVML_ERROR_NO_PERMISSION,
    backend.ErrorKind.UNKNOWN: pynvml.NVML_ERROR_UNKNOWN,
}

_COMPUTE_MODE_CODES: dict[backend.ComputeMode, int] = {
    backend.ComputeMode.DEFAULT: pynvml.NVML_COMPUTEMODE_DEFAULT,
    backend.ComputeMode.EXCLUSIVE_PROCESS: pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS,
    backend.ComputeMode.PROHIBITED: pynvml.NVML_COMPUTEMODE_PROHIBITED,
}

# Compute-instance profile index (NVML_COMPUTE_INSTANCE_PROFILE_*) -> compute slices.
_CI_SLICES = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7, 5: 8, 6: 6}
_NONE_ID = 0xFFFFFFFF

# Handle kinds, in the top bits of a handle's address.
_DEVICE, _GPU_INSTANCE, _COMPUTE_INSTANCE, _MIG_DEVICE, _EVENT_SET, _GPM_SAMPLE = 1, 2, 3, 4, 5, 6


def _raise(code: int) -> NoReturn:
    raise pynvml.NVMLError(code)


def _address(kind: int, gpu: int = 0, gi: int = 0, ci: int = 0) -> int:
    return kind << 40 | gpu << 24 | gi << 8 | ci


def _decode(handle: Any) -> tuple[int, int, int, int]:
    address = ctypes.cast(handle, ctypes.c_void_p).value
    if not address:
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    assert address is not None
    return address >> 40, address >> 24 & 0xFFFF, address >> 8 & 0xFFFF, address & 0xFF


def _deref(ref: Any) -> Any:
    """What ``byref(x)`` points to (the adapter passes counts and placements that way)."""
    return getattr(ref, "_obj", ref)


_SAMPLE_BUFFER = 4096
"""Process-utilisation samples the stand-in keeps per GPU (the driver's buffer is finite too)."""


def _wall_clock_us() -> int:
    return time.time_ns() // 1000


class NvmlStandin:
    """The subset of ``pynvml`` the NVML adapter uses, over an emulated backend."""

    def __init__(
        self,
        emulator: emulated.EmulatedBackend,
        *,
        clock_us: Callable[[], int] = _wall_clock_us,
        missing: Iterable[str] = (),
        not_supported: Iterable[str] = (),
    ) -> None:
        self._emu = emulator
        self._clock_us = clock_us
        self._last_us = 0
        self._missing = frozenset(missing)
        self._not_supported = frozenset(not_supported)
        self._process_util: dict[int, collections.deque[tuple[int, int, int]]] = {}
        """GPU -> its process-utilisation samples: (timestamp us, pid, SM percent)."""
        self._initialised = 0
        self._event_sets: dict[int, dict[int, int]] = {}
        self._gpm_next = 0
        self._gpm_samples: dict[int, float | None] = {}
        """GPM sample address -> the SM utilisation (0-1) read into it."""
        self.calls: list[str] = []
        """Names of the NVML functions called, in order (tests assert on the adapter's path)."""

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *(n for n in dir(pynvml) if n.startswith("NVML_"))})

    def __getattr__(self, name: str) -> Any:
        value = getattr(pynvml, name)
        if callable(value) and name.startswith("nvml") and not isinstance(value, type):
            raise AttributeError(f"the NVML stand-in does not implement {name}")
        return value

    # --- plumbing ------------------------------------------------------------------------------

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if not self._initialised:
            _raise(pynvml.NVML_ERROR_UNINITIALIZED)
        if name in self._missing:
            _raise(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)
        if name in self._not_supported:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def _device(self, handle: Any) -> int:
        kind, gpu, _, _ = _decode(handle)
        if kind != _DEVICE:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu

    def _gpu_instance(self, handle: Any) -> tuple[int, int]:
        kind, gpu, gi, _ = _decode(handle)
        if kind != _GPU_INSTANCE:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gpu, gi

    def _instance(self, gpu: int, gi: int) -> backend.MigDevice:
        for dev in self._emu.mig_devices(gpu):
            if dev.gi_id == gi:
                return dev
        _raise(pynvml.NVML_ERROR_NOT_FOUND)

    def _profile(self, gpu: int, profile_id: int) -> profiles.Profile:
        for p in self._emu.model(gpu).profiles:
            if _profile_id(p) == profile_id:
                return p
        _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _mig_devices(self, gpu: int) -> list[backend.MigDevice]:
        return sorted((d for d in self._emu.mig_devices(gpu) if d.complete), key=lambda d: d.gi_id)

    def _backend_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except backend.BackendError as e:
            _raise(_ERROR_CODES[e.kind])

    # --- init ----------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        self._initialised += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self._initialised -= 1

    # --- devices -------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self._emu.gpus())

    def nvmlDeviceGetHandleByIndex(self, index: int) -> Any:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self._emu.gpus()):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ctypes.cast(ctypes.c_void_p(_address(_DEVICE, index)), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> Any:
        self._enter("nvmlDeviceGetHandleByUUID")
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for info in self._emu.gpus():
            if info.uuid == text:
                address = _address(_DEVICE, info.index)
                return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)
            for dev in self._mig_devices(info.index):
                if dev.uuid == text:
                    address = _address(_MIG_DEVICE, info.index, dev.gi_id, dev.ci_id or 0)
                    return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)
        _raise(pynvml.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetName")
        kind, gpu, gi, _ = _decode(handle)
        info = self._emu.gpus()[gpu]
        if kind == _MIG_DEVICE:
            return f"{info.product_name} MIG {self._instance(gpu, gi).profile}"
        return info.product_name

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        self._enter("nvmlDeviceGetUUID")
        kind, gpu, gi, _ = _decode(handle)
        if kind == _MIG_DEVICE:
            uuid = self._instance(gpu, gi).uuid
            if uuid is None:
                _raise(pynvml.NVML_ERROR_NOT_FOUND)
            return str(uuid)
        self._device(handle)
        return self._emu.gpus()[gpu].uuid

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> Any:
        self._enter("nvmlDeviceGetMemoryInfo")
        kind, gpu, gi, _ = _decode(handle)
        mem = pynvml.c_nvmlMemory_t()
        if kind == _MIG_DEVICE:
            inst = next((i for i in self._emu.sample(gpu).instances if i.gi_id == gi), None)
            if inst is None:
                _raise(pynvml.NVML_ERROR_NOT_FOUND)
            mem.total, mem.used = inst.memory_total_bytes or 0, inst.memory_used_bytes or 0
        else:
            self._device(handle)
            mem.total = self._emu.gpus()[gpu].memory_mib * 1024 * 1024
            mem.used = self._emu.sample(gpu).memory_used_bytes or 0
        mem.free = mem.total - mem.used
        return mem

    # --- sampling ------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        self._enter("nvmlDeviceGetUtilizationRates")
        gpu = self._device(handle)
        mig = self._emu.gpus()[gpu].mig
        if mig is not None and mig.current:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)  # as the driver answers in MIG mode
        util = pynvml.c_nvmlUtilization_t()
        util.gpu = round((self._emu.sample(gpu).utilization or 0.0) * 100)
        util.memory = 0
        return util

    def _process_samples(self, handle: Any, last_seen: int) -> list[tuple[int, int, int]]:
        """(newest timestamp, pid, mean SM percent) per process sampled after ``last_seen``."""
        gpu = self._device(handle)
        mig = self._emu.gpus()[gpu].mig
        if mig is not None and mig.current:
            # nvml.h: "On MIG-enabled GPUs, querying process utilization is not currently
            # supported".
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        now = self._last_us = max(self._clock_us(), self._last_us + 1)
        kept = self._process_util.setdefault(gpu, collections.deque(maxlen=_SAMPLE_BUFFER))
        for p in self._emu.sample(gpu).processes or ():
            percent = round((p.utilization or 0.0) * 100)
            if percent > 0:  # a sample only for a process with non-zero use (nvml.h)
                kept.append((now, p.pid, percent))
        by_pid: dict[int, list[tuple[int, int]]] = {}
        for stamp, pid, percent in kept:
            if stamp > last_seen:
                by_pid.setdefault(pid, []).append((stamp, percent))
        if not by_pid:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        return [
            (max(t for t, _ in got), pid, round(sum(u for _, u in got) / len(got)))
            for pid, got in sorted(by_pid.items())
        ]

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        self._enter("nvmlDeviceGetProcessUtilization")
        out = []
        for stamp, pid, percent in self._process_samples(handle, int(timeStamp)):
            sample = pynvml.c_nvmlProcessUtilizationSample_t()
            sample.pid, sample.timeStamp, sample.smUtil = pid, stamp, percent
            sample.memUtil = sample.encUtil = sample.decUtil = 0
            out.append(sample)
        return out

    def nvmlDeviceGetProcessesUtilizationInfo(self, handle: Any, timeStamp: int) -> list[Any]:
        self._enter("nvmlDeviceGetProcessesUtilizationInfo")
        out = []
        for stamp, pid, percent in self._process_samples(handle, int(timeStamp)):
            info = pynvml.c_nvmlProcessUtilizationInfo_v1_t()
            info.timeStamp, info.pid, info.smUtil = stamp, pid, percent
            info.memUtil = info.encUtil = info.decUtil = info.jpgUtil = info.ofaUtil = 0
            out.append(info)
        return out

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._enter("nvmlDeviceGetMPSComputeRunningProcesses")
        gpu = self._device(handle)
        return [_process(p) for p in self._emu.sample(gpu).processes or () if p.mps]

    def nvmlGpmQueryDeviceSupport(self, device: Any) -> Any:
        self._enter("nvmlGpmQueryDeviceSupport")
        gpu = self._device(device)
        support = pynvml.c_nvmlGpmSupport_t()
        support.version = pynvml.NVML_GPM_SUPPORT_VERSION
        support.isSupportedDevice = int(
            self._emu.model(gpu).compute_capability >= emulated.GPM_CAPABILITY
        )
        return support

    def nvmlGpmSampleAlloc(self) -> Any:
        self._enter("nvmlGpmSampleAlloc")
        self._gpm_next += 1
        address = _address(_GPM_SAMPLE, 0, 0, 0) | self._gpm_next
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlGpmSample_t)

    def nvmlGpmSampleFree(self, gpmSample: Any) -> None:
        self._enter("nvmlGpmSampleFree")
        self._gpm_samples.pop(ctypes.cast(gpmSample, ctypes.c_void_p).value or 0, None)

    def nvmlGpmSampleGet(self, device: Any, gpmSample: Any) -> Any:
        self._enter("nvmlGpmSampleGet")
        gpu = self._device(device)
        if self._emu.model(gpu).compute_capability < emulated.GPM_CAPABILITY:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        key = ctypes.cast(gpmSample, ctypes.c_void_p).value or 0
        self._gpm_samples[key] = self._emu.sample(gpu).utilization
        return gpmSample

    def nvmlGpmMigSampleGet(self, device: Any, gpuInstanceId: int, gpmSample: Any) -> Any:
        self._enter("nvmlGpmMigSampleGet")
        gpu = self._device(device)
        if self._emu.model(gpu).compute_capability < emulated.GPM_CAPABILITY:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        inst = next((i for i in self._emu.sample(gpu).instances if i.gi_id == gpuInstanceId), None)
        if inst is None:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        self._gpm_samples[ctypes.cast(gpmSample, ctypes.c_void_p).value or 0] = inst.utilization
        return gpmSample

    def nvmlGpmMetricsGet(self, metricsGet: Any) -> Any:
        self._enter("nvmlGpmMetricsGet")
        got = _deref(metricsGet)
        first = ctypes.cast(got.sample1, ctypes.c_void_p).value or 0
        second = ctypes.cast(got.sample2, ctypes.c_void_p).value or 0
        if first not in self._gpm_samples or second not in self._gpm_samples:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # An emulated load is steady: the SM utilisation over the interval is the second's.
        util = self._gpm_samples[second]
        for i in range(got.numMetrics):
            if got.metrics[i].metricId == pynvml.NVML_GPM_METRIC_SM_UTIL and util is not None:
                got.metrics[i].value = util * 100.0
                got.metrics[i].nvmlReturn = pynvml.NVML_SUCCESS
            else:
                got.metrics[i].nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return got

    def nvmlDeviceGetPciInfo(self, handle: Any) -> Any:
        self._enter("nvmlDeviceGetPciInfo")
        gpu = self._device(handle)
        pci_id = self._emu.gpus()[gpu].pci_id
        assert pci_id is not None
        info = pynvml.nvmlPciInfo_t()
        bus_id = f"00000000:{gpu + 1:02X}:00.0".encode()
        info.busIdLegacy = bus_id
        info.busId = bus_id
        info.domain = 0
        info.bus = gpu + 1
        info.device = 0
        info.pciDeviceId = pci_id.device
        info.pciSubSystemId = pci_id.subsystem or 0
        return info

    def nvmlDeviceGetMigMode(self, device: Any) -> list[int]:
        self._enter("nvmlDeviceGetMigMode")
        mig = self._emu.gpus()[self._device(device)].mig
        assert mig is not None
        return [int(mig.current), int(mig.pending)]

    def nvmlDeviceSetMigMode(self, device: Any, mode: int) -> int:
        """The activation status, as nvidia-ml-py returns it: ``NVML_SUCCESS`` once the mode
        is current, ``NVML_ERROR_IN_USE`` while it waits for a reset the driver could not do."""
        self._enter("nvmlDeviceSetMigMode")
        if mode not in (pynvml.NVML_DEVICE_MIG_ENABLE, pynvml.NVML_DEVICE_MIG_DISABLE):
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gpu = self._device(device)
        enabled = mode == pynvml.NVML_DEVICE_MIG_ENABLE
        after = self._backend_call(self._emu.set_mig_mode, gpu, enabled=enabled)
        if after.current == enabled:
            return int(pynvml.NVML_SUCCESS)
        return int(pynvml.NVML_ERROR_IN_USE)

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        self._enter("nvmlDeviceGetComputeMode")
        gpu = self._device(handle)
        mode = self._backend_call(self._emu.compute_mode, gpu)
        return int(_COMPUTE_MODE_CODES[mode])

    def nvmlDeviceSetComputeMode(self, handle: Any, mode: int) -> int:
        self._enter("nvmlDeviceSetComputeMode")
        gpu = self._device(handle)
        wanted = next((m for m, code in _COMPUTE_MODE_CODES.items() if code == mode), None)
        if wanted is None:  # EXCLUSIVE_THREAD (removed from drivers) or not a mode at all
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._backend_call(self._emu.set_compute_mode, gpu, wanted)
        return int(pynvml.NVML_SUCCESS)

    # --- GPU instances -------------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, device: Any, profile: int, version: int = 2
    ) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceProfileInfo")
        gpu = self._device(device)
        if not 0 <= profile < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        for p in self._emu.model(gpu).profiles:
            if p.nvml_index == profile:
                return _profile_info(p)
        _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, device: Any, profileId: int, placementsRef: Any, countRef: Any
    ) -> int:
        self._enter("nvmlDeviceGetGpuInstancePossiblePlacements")
        p = self._profile(self._device(device), profileId)
        count = _deref(countRef)
        if placementsRef is None:
            count.value = len(p.placements)
            return int(pynvml.NVML_SUCCESS)
        if count.value < len(p.placements):
            count.value = len(p.placements)
            _raise(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, start in enumerate(p.placements):
            placementsRef[i].start = start
            placementsRef[i].size = p.memory_slots
        count.value = len(p.placements)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, device: Any, profileId: int, placement: Any
    ) -> Any:
        self._enter("nvmlDeviceCreateGpuInstanceWithPlacement")
        gpu = self._device(device)
        p = self._profile(gpu, profileId)
        place = _deref(placement)
        if place.size != p.memory_slots:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        gi = self._backend_call(
            self._emu.create_gpu_instance, gpu, profile=p.name, start=int(place.start)
        )
        return _handle(_GPU_INSTANCE, gpu, gi)

    def nvmlDeviceGetGpuInstances(
        self, device: Any, profileId: int, gpuInstancesRef: Any, countRef: Any
    ) -> int:
        self._enter("nvmlDeviceGetGpuInstances")
        gpu = self._device(device)
        p = self._profile(gpu, profileId)
        found = [d for d in self._emu.mig_devices(gpu) if d.profile == p.name]
        count = _deref(countRef)
        if count.value < len(found):
            count.value = len(found)
            _raise(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, dev in enumerate(sorted(found, key=lambda d: d.gi_id)):
            gpuInstancesRef[i] = _handle(_GPU_INSTANCE, gpu, dev.gi_id)
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlDeviceGetGpuInstanceById(self, device: Any, gpuInstanceId: int) -> Any:
        self._enter("nvmlDeviceGetGpuInstanceById")
        gpu = self._device(device)
        self._instance(gpu, gpuInstanceId)
        return _handle(_GPU_INSTANCE, gpu, gpuInstanceId)

    def nvmlGpuInstanceGetInfo(self, gpuInstance: Any) -> Any:
        self._enter("nvmlGpuInstanceGetInfo")
        gpu, gi = self._gpu_instance(gpuInstance)
        dev = self._instance(gpu, gi)
        p = self._emu.model(gpu).profile_named(dev.profile)
        info = pynvml.c_nvmlGpuInstanceInfo_t()
        info.device = _handle(_DEVICE, gpu, 0, kind_type=pynvml.c_nvmlDevice_t)
        info.id = gi
        info.profileId = _profile_id(p)
        info.placement.start = dev.start
        info.placement.size = p.memory_slots
        return info

    def nvmlGpuInstanceDestroy(self, gpuInstance: Any) -> int:
        self._enter("nvmlGpuInstanceDestroy")
        gpu, gi = self._gpu_instance(gpuInstance)
        self._backend_call(self._emu.destroy_gpu_instance, gpu, gi)
        return int(pynvml.NVML_SUCCESS)

    # --- compute instances ---------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, device: Any, profile: int, engProfile: int, version: int = 2
    ) -> Any:
        self._enter("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        gpu, gi = self._gpu_instance(device)
        p = self._emu.model(gpu).profile_named(self._instance(gpu, gi).profile)
        slices = _CI_SLICES.get(profile)
        if slices is None or slices > p.compute_slices:
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if engProfile != pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        info = pynvml.c_nvmlComputeInstanceProfileInfo_v2_t()
        info.id = profile
        info.sliceCount = slices
        info.instanceCount = p.compute_slices // slices
        info.multiprocessorCount = (p.sms or 0) * slices // p.compute_slices
        info.name = f"MIG {slices}c.{p.name}".encode()
        return info

    def nvmlGpuInstanceCreateComputeInstance(self, gpuInstance: Any, profileId: int) -> Any:
        self._enter("nvmlGpuInstanceCreateComputeInstance")
        gpu, gi = self._gpu_instance(gpuInstance)
        p = self._emu.model(gpu).profile_named(self._instance(gpu, gi).profile)
        if _CI_SLICES.get(profileId) != p.compute_slices:
            # The emulator models the one layout migpilot uses: one full compute instance.
            _raise(pynvml.NVML_ERROR_NOT_SUPPORTED)
        dev = self._backend_call(self._emu.create_compute_instance, gpu, gi)
        return _handle(
            _COMPUTE_INSTANCE, gpu, gi, dev.ci_id, kind_type=pynvml.c_nvmlComputeInstance_t
        )

    def nvmlGpuInstanceGetComputeInstances(
        self, gpuInstance: Any, profileId: int, computeInstancesRef: Any, countRef: Any
    ) -> int:
        self._enter("nvmlGpuInstanceGetComputeInstances")
        gpu, gi = self._gpu_instance(gpuInstance)
        dev = self._instance(gpu, gi)
        p = self._emu.model(gpu).profile_named(dev.profile)
        full = _CI_SLICES.get(profileId) == p.compute_slices
        found = [dev.ci_id] if full and dev.ci_id is not None else []
        count = _deref(countRef)
        if count.value < len(found):
            count.value = len(found)
            _raise(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, ci in enumerate(found):
            computeInstancesRef[i] = _handle(
                _COMPUTE_INSTANCE, gpu, gi, ci, kind_type=pynvml.c_nvmlComputeInstance_t
            )
        count.value = len(found)
        return int(pynvml.NVML_SUCCESS)

    def nvmlComputeInstanceGetInfo(self, computeInstance: Any) -> Any:
        self._enter("nvmlComputeInstanceGetInfo")
        kind, gpu, gi, ci = _decode(computeInstance)
        if kind != _COMPUTE_INSTANCE:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        dev = self._instance(gpu, gi)
        if dev.ci_id != ci:
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        p = self._emu.model(gpu).profile_named(dev.profile)
        info = pynvml.c_nvmlComputeInstanceInfo_t()
        info.device = _handle(_DEVICE, gpu, 0, kind_type=pynvml.c_nvmlDevice_t)
        info.gpuInstance = _handle(_GPU_INSTANCE, gpu, gi)
        info.id = ci
        info.profileId = next(k for k, v in _CI_SLICES.items() if v == p.compute_slices)
        info.placement.start = 0
        info.placement.size = p.compute_slices
        return info

    def nvmlComputeInstanceDestroy(self, computeInstance: Any) -> int:
        self._enter("nvmlComputeInstanceDestroy")
        kind, gpu, gi, _ = _decode(computeInstance)
        if kind != _COMPUTE_INSTANCE:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        self._backend_call(self._emu.destroy_compute_instance, gpu, gi)
        return int(pynvml.NVML_SUCCESS)

    # --- MIG device handles --------------------------------------------------------------------

    def nvmlDeviceGetMaxMigDeviceCount(self, device: Any) -> int:
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        return self._emu.model(self._device(device)).max_gpu_instances

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: Any, index: int) -> Any:
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        gpu = self._device(device)
        devs = self._mig_devices(gpu)
        if index >= self._emu.model(gpu).max_gpu_instances:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(devs):
            _raise(pynvml.NVML_ERROR_NOT_FOUND)
        dev = devs[index]
        address = _address(_MIG_DEVICE, gpu, dev.gi_id, dev.ci_id or 0)
        return ctypes.cast(ctypes.c_void_p(address), pynvml.c_nvmlDevice_t)

    def nvmlDeviceGetGpuInstanceId(self, device: Any) -> int:
        self._enter("nvmlDeviceGetGpuInstanceId")
        kind, _, gi, _ = _decode(device)
        if kind != _MIG_DEVICE:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return gi

    def nvmlDeviceGetComputeInstanceId(self, device: Any) -> int:
        self._enter("nvmlDeviceGetComputeInstanceId")
        kind, _, _, ci = _decode(device)
        if kind != _MIG_DEVICE:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ci

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        kind, gpu, gi, _ = _decode(handle)
        devs = [
            d
            for d in self._mig_devices(gpu)
            if kind == _DEVICE or (kind == _MIG_DEVICE and d.gi_id == gi)
        ]
        out = [
            _process(p)
            for p in self._emu.sample(gpu).processes or ()
            if p.memory_used_bytes is not None
            and (kind == _DEVICE or (kind == _MIG_DEVICE and p.gi_id == gi))
        ]
        for dev in devs:
            assert dev.uuid is not None
            for pid in self._emu.running_processes(gpu, dev.uuid):
                out.append(
                    pynvml.nvmlFriendlyObject(
                        {
                            "pid": pid,
                            "usedGpuMemory": None,
                            "gpuInstanceId": dev.gi_id,
                            "computeInstanceId": dev.ci_id,
                        }
                    )
                )
        return out

    # --- events --------------------------------------------------------------------------------

    def nvmlEventSetCreate(self) -> Any:
        self._enter("nvmlEventSetCreate")
        number = len(self._event_sets) + 1
        self._event_sets[number] = {}
        return ctypes.cast(
            ctypes.c_void_p(_address(_EVENT_SET, 0, number)), pynvml.c_nvmlEventSet_t
        )

    def _event_set(self, handle: Any) -> dict[int, int]:
        kind, _, number, _ = _decode(handle)
        if kind != _EVENT_SET or number not in self._event_sets:
            _raise(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._event_sets[number]

    def nvmlDeviceRegisterEvents(self, handle: Any, eventTypes: int, eventSet: Any) -> None:
        self._enter("nvmlDeviceRegisterEvents")
        gpu = self._device(handle)
        registered = self._event_set(eventSet)
        registered[gpu] = registered.get(gpu, 0) | int(eventTypes)

    def nvmlEventSetWait(self, eventSet: Any, timeoutms: int) -> Any:
        self._enter("nvmlEventSetWait")
        registered = self._event_set(eventSet)
        event = self._emu.wait_xid(timeoutms / 1000)
        if event is None or not registered.get(event.gpu, 0) & pynvml.nvmlEventTypeXidCriticalError:
            _raise(pynvml.NVML_ERROR_TIMEOUT)
        data = pynvml.c_nvmlEventData_t()
        data.device = _handle(_DEVICE, event.gpu, 0, kind_type=pynvml.c_nvmlDevice_t)
        data.eventType = pynvml.nvmlEventTypeXidCriticalError
        data.eventData = event.xid
        data.gpuInstanceId = _NONE_ID if event.gi_id is None else event.gi_id
        data.computeInstanceId = _NONE_ID if event.ci_id is None else event.ci_id
        return data

    def nvmlEventSetFree(self, eventSet: Any) -> None:
        self._enter("nvmlEventSetFree")
        _, _, number, _ = _decode(eventSet)
        self._event_set(eventSet)
        del self._event_sets[number]


def _handle(kind: int, gpu: int, gi: int, ci: int | None = 0, *, kind_type: Any = None) -> Any:
    pointer_type = kind_type if kind_type is not None else pynvml.c_nvmlGpuInstance_t
    return ctypes.cast(ctypes.c_void_p(_address(kind, gpu, gi, ci or 0)), pointer_type)


def _profile_id(p: profiles.Profile) -> int:
    """The driver's profile id (the nvidia-smi ID); the NVML index where no source gives it."""
    return p.smi_id if p.smi_id is not None else 100 + p.nvml_index


def _profile_info(p: profiles.Profile) -> Any:
    info = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
    info.id = _profile_id(p)
    info.isP2pSupported = 0
    info.sliceCount = p.compute_slices
    info.instanceCount = p.max_instances
    info.multiprocessorCount = p.sms or 0
    info.copyEngineCount = p.engines.copy or 0
    info.decoderCount = p.engines.decoder or 0
    info.encoderCount = p.engines.encoder or 0
    info.jpegCount = p.engines.jpeg or 0
    info.ofaCount = p.engines.ofa or 0
    info.memorySizeMB = p.memory_mib or p.nominal_gb * 1024
    info.name = f"MIG {p.name}".encode()
    return info


def _process(p: backend.ProcessSample) -> Any:
    """A driven emulated process as nvidia-ml-py returns one (``nvmlFriendlyObject``)."""
    return pynvml.nvmlFriendlyObject(
        {
            "pid": p.pid,
            "usedGpuMemory": p.memory_used_bytes,
            "gpuInstanceId": _NONE_ID if p.gi_id is None else p.gi_id,
            "computeInstanceId": _NONE_ID if p.gi_id is None else 0,
        }
    )
