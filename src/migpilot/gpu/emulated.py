"""Emulated GPUs: N GPUs of any catalog model, in process, with the driver's MIG semantics.

Tests, the demo and the simulator need GPUs that behave like the driver without one: a
placement that overlaps an instance fails with ``Insufficient Resources``, only the placements
the catalog allows are accepted (checked with :mod:`migpilot.mig.layouts`), destroying an
instance with processes fails with ``In Use``, a GPU instance exists without its compute
instance between the two driver calls that create it, and every operation takes time on an
injected :class:`~migpilot.gpu.clocks.Clock`. Faults are injected on demand: the Nth call of a
driver step fails with a chosen kind, or a :class:`SimulatedCrash` stands for the agent process
dying just before or just after that step took effect.

Each GPU has its own PCI id, the device id and the board's subsystem id, which mig-parted
device filters are matched against: by default the model's first catalog device id with
subsystem ``0`` (a board nothing is known about, so a filter naming a board never selects it),
or the ids given (``emulated:0x233010DE:0x16C110DE:x8``). State files written before GPUs had
ids load with those defaults.

Each GPU also has a compute mode (``DEFAULT`` until set), which it keeps until set again, as a
driver keeps it until a reboot; setting it on a GPU in MIG mode is refused (``Not Supported``),
as the driver refuses a whole-GPU handle there. State files written before GPUs had a mode load
with ``DEFAULT``.

The state lives in a JSON file rewritten atomically (temp file, fsync, rename) after every
change, so a new :class:`EmulatedBackend` on the same file sees the same instances, as hardware
survives an agent restart. UUIDs derive from a seed, the GPU index, the instance ids and a
creation counter: runs are reproducible and a re-created device never reuses a UUID.

The driver steps (:meth:`EmulatedBackend.create_gpu_instance` and friends) are public because
the NVML stand-in (:mod:`migpilot.gpu.nvml_standin`) maps NVML's calls onto them one to one.
Each GPU changes under its own lock and a step's time passes without the state lock, so steps on
different GPUs overlap, as the driver runs them (steps on one GPU are serialised).
The GPUs can be driven (:meth:`EmulatedBackend.drive`): a function gives each device ID (a GPU
or MIG UUID, an MPS slice ``GPU-x::mps-3`` or a replica ``GPU-x::2``) a :class:`Load`, and
:meth:`EmulatedBackend.sample` reports it as the driver would: memory everywhere, SM utilisation
per GPU and per MIG instance only where the real hardware gives it (per MIG instance through GPM
on Hopper and later; per GPU with MIG off on every model, with MIG on only on Hopper and later;
per process with MIG off only),
and a process per shared device, with a pid above Linux's largest (2**22) so it never names a
real one, whose pod :meth:`EmulatedBackend.pod_of` tells (the emulated ``/proc/<pid>/cgroup``).

A shell module: file I/O and threading only; no driver bindings.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import json
import re
import threading
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NotRequired, TypedDict, cast

from migpilot import errors, files
from migpilot.gpu import backend, clocks, emulated_proc
from migpilot.mig import catalog, layouts, pciids, profiles

STATE_VERSION = 1
MAX_GPUS = 64
MIB = 1024 * 1024
FIRST_PID = 1 << 22
"""The first pid of an emulated process: Linux's ``pid_max`` is at most 2**22, so no real
process has it."""
GPM_CAPABILITY = (9, 0)
"""GPM (per-GPU and per-MIG-instance SM utilisation) needs Hopper or later."""


@dataclass(frozen=True, slots=True)
class Load:
    """What one device is driven to do (``--emulated-load``)."""

    utilization: float
    """SM utilisation, 0-1."""
    memory_used_mib: int
    """Device memory in use, MiB (capped to the device's memory when reported)."""
    pod: str = ""
    """``namespace/name`` of the pod whose processes make the load."""


class Step(enum.StrEnum):
    """The driver calls that change state, where faults can be injected."""

    CREATE_GPU_INSTANCE = "create-gpu-instance"
    CREATE_COMPUTE_INSTANCE = "create-compute-instance"
    DESTROY_COMPUTE_INSTANCE = "destroy-compute-instance"
    DESTROY_GPU_INSTANCE = "destroy-gpu-instance"
    SET_COMPUTE_MODE = "set-compute-mode"
    SET_MIG_MODE = "set-mig-mode"


class FaultEffect(enum.Enum):
    """What an injected fault does when its call comes."""

    FAIL = "fail"
    """The call raises :class:`~migpilot.gpu.backend.BackendError`; nothing changes."""
    CRASH_BEFORE = "crash-before"
    """:class:`SimulatedCrash` before the step takes effect."""
    CRASH_AFTER = "crash-after"
    """:class:`SimulatedCrash` after the step took effect and was saved, before it returns."""


class SimulatedCrash(Exception):  # noqa: N818 - it is not an error of the caller's making
    """The agent process "died" here; the test drops the backend and starts a new one."""


@dataclass(frozen=True, slots=True)
class Fault:
    """Make the ``nth`` call (1-based, counted from injection) of ``step`` misbehave.

    ``step=None`` counts every state-changing step, so "crash after the 5th change" is one fault.
    """

    step: Step | None
    nth: int
    effect: FaultEffect
    kind: backend.ErrorKind = backend.ErrorKind.UNKNOWN
    """For :attr:`FaultEffect.FAIL`: the kind of the error raised."""


@dataclass(frozen=True, slots=True)
class OperationTimes:
    """How long each driver step takes, in seconds (defaults after A100 measurements)."""

    create_gpu_instance_s: float = 0.05
    """Creating a GPU instance; default 0.05 s."""
    create_compute_instance_s: float = 0.03
    """Creating its compute instance; default 0.03 s."""
    destroy_compute_instance_s: float = 0.04
    """Destroying a compute instance; default 0.04 s."""
    destroy_gpu_instance_s: float = 0.1
    """Destroying a GPU instance; default 0.1 s."""
    set_compute_mode_s: float = 0.0
    """Setting a GPU's compute mode; default 0 s (``nvidia-smi -c`` returns at once)."""
    set_mig_mode_s: float = 0.0
    """Setting a GPU's MIG mode where no reset is needed (Hopper and later); default 0 s."""
    mig_mode_reset_s: float = 0.0
    """The GPU reset that commits a MIG mode change on a GPU that needs one (Ampere), during
    which the new mode is pending; default 0 s (no public measurement; set it per test)."""

    def of(self, step: Step) -> float:
        """The time ``step`` takes."""
        return {
            Step.CREATE_GPU_INSTANCE: self.create_gpu_instance_s,
            Step.CREATE_COMPUTE_INSTANCE: self.create_compute_instance_s,
            Step.DESTROY_COMPUTE_INSTANCE: self.destroy_compute_instance_s,
            Step.DESTROY_GPU_INSTANCE: self.destroy_gpu_instance_s,
            Step.SET_COMPUTE_MODE: self.set_compute_mode_s,
            Step.SET_MIG_MODE: self.set_mig_mode_s,
        }[step]


INSTANT = OperationTimes(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
"""Operations that take no time."""


# --- the state file ----------------------------------------------------------------------------


class InstanceState(TypedDict):
    """One GPU instance in the state file."""

    gi: int
    profile: str
    start: int
    ci: int | None
    uuid: str | None
    processes: list[int]


class GpuState(TypedDict):
    """One GPU in the state file."""

    index: int
    model: str
    uuid: str
    mig_current: bool
    mig_pending: bool
    created: int
    """How many compute instances were ever created on this GPU (for fresh UUIDs)."""
    instances: list[InstanceState]
    pci_device_id: NotRequired[int]
    """``0xDDDDVVVV``; absent in older files: the model's first catalog id."""
    pci_subsystem_id: NotRequired[int]
    """``0xSSSSWWWW``, the board; absent in older files: 0 (unknown board)."""
    compute_mode: NotRequired[str]
    """A :class:`~migpilot.gpu.backend.ComputeMode` value; absent in older files: default."""


class StateFile(TypedDict):
    """The whole state file (``version: 1``)."""

    version: int
    seed: int
    gpus: list[GpuState]


def seed_for(node: str) -> int:
    """The seed of a node's emulated GPUs: each node its own UUIDs (two agents on two nodes
    never report the same GPU or MIG UUID), the same at every start."""
    return zlib.crc32(node.encode())


def _uuid(prefix: str, text: str) -> str:
    h = hashlib.sha256(text.encode()).hexdigest()
    return f"{prefix}-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def default_pci_id(model: profiles.GpuModel) -> pciids.PciId:
    """An emulated GPU's id unless told otherwise: the model's first device id, board 0."""
    return pciids.PciId(model.pci_device_ids[0] if model.pci_device_ids else 0, 0)


def _pci_id(g: GpuState, model: profiles.GpuModel, *, where: str) -> pciids.PciId:
    default = default_pci_id(model)
    device = g.get("pci_device_id", default.device)
    subsystem = g.get("pci_subsystem_id", default.subsystem)
    for value in (device, subsystem):
        if type(value) is not int:
            raise errors.AgentConfigError(
                f"{where}: GPU {g['index']}: PCI id {value!r} is not a number"
            )
    return pciids.PciId(device, subsystem)


def _check_pci_ids(
    models: Sequence[profiles.GpuModel], ids: Sequence[pciids.PciId], *, where: str
) -> None:
    for i, (model, pci) in enumerate(zip(models, ids, strict=True)):
        if model.pci_device_ids and pci.device not in model.pci_device_ids:
            known = ", ".join(f"0x{d:08X}" for d in model.pci_device_ids)
            raise errors.AgentConfigError(
                f"{where}: GPU {i} ({model.id}) cannot have PCI device id 0x{pci.device:08X} "
                f"(its ids: {known})"
            )
        for value in (pci.device, pci.subsystem or 0):
            if not 0 <= value <= pciids.UINT32_MAX:
                raise errors.AgentConfigError(f"{where}: GPU {i}: PCI id {value} is not 32-bit")


def _fresh_state(
    models: Sequence[profiles.GpuModel],
    pci_ids: Sequence[pciids.PciId],
    *,
    seed: int,
    mig: bool,
) -> StateFile:
    return StateFile(
        version=STATE_VERSION,
        seed=seed,
        gpus=[
            GpuState(
                index=i,
                model=m.id,
                uuid=_uuid("GPU", f"migpilot-emulated:{seed}:gpu:{i}"),
                mig_current=mig,
                mig_pending=mig,
                created=0,
                instances=[],
                pci_device_id=p.device,
                pci_subsystem_id=p.subsystem or 0,
            )
            for i, (m, p) in enumerate(zip(models, pci_ids, strict=True))
        ],
    )


def _load_state(path: Path) -> StateFile:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise errors.AgentConfigError(f"emulated GPU state {path}: cannot read: {e}") from None
    except RecursionError:
        raise errors.AgentConfigError(
            f"emulated GPU state {path}: cannot read: nested too deeply"
        ) from None
    if not isinstance(data, dict) or data.get("version") != STATE_VERSION:
        raise errors.AgentConfigError(
            f"emulated GPU state {path}: not a version {STATE_VERSION} state file"
        )
    return cast(StateFile, data)


# --- the backend -------------------------------------------------------------------------------


class EmulatedBackend:
    """GPUs emulated in process, with NVML's semantics; a :class:`~backend.GpuBackend`.

    With ``state_path`` the state is read from that file when it exists (``models`` must then
    match it, or be empty to take the file's) and written back after every change. ``pci_ids``
    gives each GPU its PCI id (one per model, each a device id of its model; a missing subsystem
    is 0); where it is empty or ``None`` a new GPU gets :func:`default_pci_id` and a GPU of the
    file keeps its id, and a given id must be the file's. ``durable``
    (default true) fsyncs each write and its directory, so the file survives a power loss too;
    a process crash needs only the atomic rename, and tests that crash thousands of times turn
    the fsyncs off.
    """

    def __init__(
        self,
        models: Sequence[profiles.GpuModel] = (),
        *,
        pci_ids: Sequence[pciids.PciId | None] = (),
        state_path: Path | None = None,
        seed: int = 0,
        clock: clocks.Clock | None = None,
        times: OperationTimes = INSTANT,
        mig_enabled: bool = True,
        durable: bool = True,
        proc_root: Path | None = None,
    ) -> None:
        self._path = state_path
        self._proc_root: Path | None = None
        """Set once the GPUs are known: below it the driver's proc files are kept
        (:mod:`emulated_proc`)."""
        self._durable = durable
        self._clock: clocks.Clock = clock if clock is not None else clocks.VirtualClock()
        self._times = times
        self._lock = threading.RLock()
        """Guards the state and the fault list; held for reads and brief updates, never while
        a driver step takes its time, so steps on different GPUs overlap."""
        self._events: collections.deque[backend.XidEvent] = collections.deque()
        self._event_ready = threading.Condition(self._lock)
        self._faults: list[tuple[Fault, list[int]]] = []
        self._load: Callable[[], Mapping[str, Load]] | None = None
        self._pids: dict[str, int] = {}
        """Device ID -> the pid of the emulated process making its load (stable while driven)."""
        self._pid_pods: dict[int, str] = {}
        self._reset_blocked: set[int] = set()
        """GPUs whose reset the driver cannot do (:meth:`block_reset`)."""
        if pci_ids and len(pci_ids) != len(models):
            raise errors.AgentConfigError(
                f"emulated GPUs: {len(pci_ids)} PCI ids for {len(models)} GPUs"
            )
        wanted = [None if p is None else pciids.PciId(p.device, p.subsystem or 0) for p in pci_ids]
        if state_path is not None and state_path.exists():
            self._state = _load_state(state_path)
            have = [g["model"] for g in self._state["gpus"]]
            if models and [m.id for m in models] != have:
                raise errors.AgentConfigError(
                    f"emulated GPU state {state_path} holds {', '.join(have) or 'no GPUs'}, "
                    f"not {', '.join(m.id for m in models)}"
                )
        else:
            if not models:
                raise errors.AgentConfigError("an emulated backend needs at least one GPU")
            given = wanted or [None] * len(models)
            ids = [
                default_pci_id(m) if w is None else w for w, m in zip(given, models, strict=True)
            ]
            _check_pci_ids(models, ids, where="emulated GPUs")
            self._state = _fresh_state(models, ids, seed=seed, mig=mig_enabled)
            self._save()
        self._models = tuple(catalog.resolve_gpu(g["model"]) for g in self._state["gpus"])
        self._gpu_locks = tuple(threading.Lock() for _ in self._models)
        """One per GPU, held through each state-changing step on it: the driver serialises
        MIG changes on one GPU, while different GPUs change in parallel."""
        where = f"emulated GPU state {state_path}"
        self._pci_ids = tuple(
            _pci_id(g, m, where=where)
            for g, m in zip(self._state["gpus"], self._models, strict=True)
        )
        if state_path is not None:
            _check_pci_ids(self._models, self._pci_ids, where=where)
            if wanted and any(
                w is not None and w != p for w, p in zip(wanted, self._pci_ids, strict=True)
            ):
                raise errors.AgentConfigError(
                    f"{where} holds GPUs with PCI ids {', '.join(map(str, self._pci_ids))}, "
                    f"not {', '.join(map(str, wanted))}"
                )
        if proc_root is not None:
            self._proc_root = proc_root
            self._write_proc()

    # --- test hooks ----------------------------------------------------------------------------

    def inject(self, fault: Fault) -> None:
        """Arm a fault; it fires once, on the ``nth`` matching call from now."""
        if fault.nth < 1:
            raise ValueError(f"fault nth must be 1 or more, got {fault.nth}")
        with self._lock:
            self._faults.append((fault, [0]))

    def attach_process(self, uuid: str, pid: int) -> None:
        """A process starts on MIG device ``uuid`` (persisted, as it outlives the agent)."""
        with self._lock:
            inst = self._by_uuid(uuid)
            if pid not in inst["processes"]:
                inst["processes"].append(pid)
                self._save()

    def detach_process(self, uuid: str, pid: int) -> None:
        """A process on MIG device ``uuid`` exits."""
        with self._lock:
            inst = self._by_uuid(uuid)
            if pid in inst["processes"]:
                inst["processes"].remove(pid)
                self._save()

    def emit_xid(
        self, gpu: int, xid: int, *, gi_id: int | None = None, ci_id: int | None = None
    ) -> None:
        """Queue an XID critical-error event, as the driver would raise it."""
        with self._lock:
            g = self._gpu(gpu)
            mig_uuid = None
            for inst in g["instances"]:
                if inst["gi"] == gi_id and (ci_id is None or inst["ci"] == ci_id):
                    mig_uuid = inst["uuid"]
            self._events.append(backend.XidEvent(gpu, g["uuid"], xid, gi_id, ci_id, mig_uuid))
            self._event_ready.notify_all()

    def block_reset(self, gpu: int, *, blocked: bool = True) -> None:
        """Make the driver's own reset of GPU ``gpu`` fail (another client holds it, or a
        pass-through VM exposes no reset): a MIG mode change that needs one stays pending."""
        with self._lock:
            self._gpu(gpu)
            if blocked:
                self._reset_blocked.add(gpu)
            else:
                self._reset_blocked.discard(gpu)

    def set_mig_mode(self, gpu: int, *, enabled: bool) -> backend.MigMode:
        """``nvmlDeviceSetMigMode``: ask for MIG mode on or off; the mode afterwards.

        Refused with ``IN_USE`` while the GPU has a GPU instance or a process (migpilot never
        changes the mode of a GPU with anything on it). Where the model needs no reset
        (Hopper and later) the mode is current at once. Where it needs one (Ampere) the new
        mode is pending while the driver resets the GPU (``mig_mode_reset_s``), then current,
        unless the reset is blocked (:meth:`block_reset`): then it stays pending, as NVML's
        ``activationStatus`` of ``IN_USE`` leaves it.
        """
        loads = dict(self._load()) if self._load is not None else {}
        with self._changing(gpu):
            with self._lock:
                g = self._gpu(gpu)
                busy = _busy(g, loads)
                if busy:
                    raise backend.BackendError(
                        backend.ErrorKind.IN_USE,
                        f"GPU {gpu} has {busy}; cannot change its MIG mode",
                    )
                needs_reset = self._models[gpu].mode_change_needs_reset
                blocked = gpu in self._reset_blocked
            if g["mig_current"] == enabled and g["mig_pending"] == enabled:
                return backend.MigMode(enabled, enabled)
            if not needs_reset:

                def apply() -> None:
                    g["mig_current"] = g["mig_pending"] = enabled

                self._step(Step.SET_MIG_MODE, apply)
            else:

                def request() -> None:
                    g["mig_pending"] = enabled

                self._step(Step.SET_MIG_MODE, request)
                if not blocked:
                    self._clock.sleep(self._times.mig_mode_reset_s)
                    with self._lock:
                        g["mig_current"] = g["mig_pending"]
                        self._save()
            with self._lock:
                return backend.MigMode(g["mig_current"], g["mig_pending"])

    def reset_gpu(self, gpu: int) -> None:
        """Reset a GPU from outside (``nvidia-smi --gpu-reset``, a reboot): the pending MIG
        mode becomes current; disabling MIG removes instances."""
        with self._changing(gpu), self._lock:
            g = self._gpu(gpu)
            if any(inst["processes"] for inst in g["instances"]):
                raise backend.BackendError(
                    backend.ErrorKind.IN_USE, f"GPU {gpu} has processes; cannot reset it"
                )
            g["mig_current"] = g["mig_pending"]
            if not g["mig_current"]:
                g["instances"] = []
            self._save()

    def drive(self, load: Callable[[], Mapping[str, Load]] | None) -> None:
        """Read each device's load from ``load()`` at every :meth:`sample` (``None``: idle)."""
        with self._lock:
            self._load = load

    def pod_of(self, pid: int) -> str | None:
        """``namespace/name`` of the pod an emulated process belongs to, ``None`` for any other."""
        with self._lock:
            return self._pid_pods.get(pid) or None

    def _pid(self, device_id: str, pod: str) -> int:
        pid = self._pids.get(device_id)
        if pid is None:
            pid = self._pids[device_id] = FIRST_PID + len(self._pids)
        self._pid_pods[pid] = pod
        return pid

    # --- the GpuBackend protocol ---------------------------------------------------------------

    def sample(self, gpu: int) -> backend.GpuSample:
        """The GPU's readings as the driver would give them, from the :meth:`drive` loads."""
        loads = dict(self._load()) if self._load is not None else {}
        with self._lock:
            g = self._gpu(gpu)
            model = self._models[gpu]
            gpm = model.compute_capability >= GPM_CAPABILITY
            total = _total_memory_mib(model) * MIB
            processes: list[backend.ProcessSample] = []

            def reading(device_id: str, capacity: int, gi_id: int | None) -> tuple[float, int]:
                """Utilisation and memory of one device: its own load, or its shares'."""
                util, used = 0.0, 0
                for key, load in sorted(loads.items()):
                    real, mark, _ = key.partition("::")
                    if real != device_id:
                        continue
                    mem = min(max(load.memory_used_mib, 0) * MIB, capacity)
                    util += min(max(load.utilization, 0.0), 1.0)
                    used += mem
                    processes.append(
                        backend.ProcessSample(
                            pid=self._pid(key, load.pod),
                            memory_used_bytes=mem,
                            gi_id=gi_id,
                            mps=mark != "" and key.startswith(f"{real}::mps-"),
                            # NVML has no per-process utilisation with MIG on (nvml.h)
                            utilization=min(max(load.utilization, 0.0), 1.0)
                            if gi_id is None
                            else None,
                        )
                    )
                return min(util, 1.0), min(used, capacity)

            if not g["mig_current"]:
                util, used = reading(g["uuid"], total, None)
                return backend.GpuSample(gpu, g["uuid"], util, used, total, (), tuple(processes))
            instances: list[backend.InstanceSample] = []
            busy = 0.0
            for inst in sorted(g["instances"], key=lambda i: i["gi"]):
                profile = model.profile_named(inst["profile"])
                capacity = (profile.memory_mib or profile.nominal_gb * 1024) * MIB
                for pid in inst["processes"]:
                    processes.append(backend.ProcessSample(pid, None, gi_id=inst["gi"]))
                if inst["uuid"] is None:
                    instances.append(backend.InstanceSample(inst["gi"], None, None, 0, capacity))
                    continue
                util, used = reading(inst["uuid"], capacity, inst["gi"])
                busy += util * profile.compute_slices
                instances.append(
                    backend.InstanceSample(
                        inst["gi"], inst["uuid"], util if gpm else None, used, capacity
                    )
                )
            used_all = sum(i.memory_used_bytes or 0 for i in instances)
            return backend.GpuSample(
                gpu,
                g["uuid"],
                min(busy / model.compute_slices, 1.0) if gpm else None,
                min(used_all, total),
                total,
                tuple(instances),
                tuple(processes),
            )

    def gpus(self) -> tuple[backend.GpuInfo, ...]:
        """Every emulated GPU."""
        with self._lock:
            return tuple(
                backend.GpuInfo(
                    index=g["index"],
                    uuid=g["uuid"],
                    product_name=m.product_names[0],
                    model=m,
                    memory_mib=_total_memory_mib(m),
                    mig=backend.MigMode(g["mig_current"], g["mig_pending"]),
                    pci_id=pci_id,
                )
                for g, m, pci_id in zip(
                    self._state["gpus"], self._models, self._pci_ids, strict=True
                )
            )

    def model(self, gpu: int) -> profiles.GpuModel:
        """The catalog model of GPU ``gpu``."""
        self._gpu(gpu)
        return self._models[gpu]

    def mig_devices(self, gpu: int) -> tuple[backend.MigDevice, ...]:
        """The GPU instances of one GPU by start slot, with their compute instances."""
        with self._lock:
            g = self._gpu(gpu)
            return tuple(
                sorted(
                    (self._device(gpu, inst) for inst in g["instances"]),
                    key=lambda d: (d.start, d.gi_id),
                )
            )

    def create_instance(self, gpu: int, *, profile: str, start: int) -> backend.MigDevice:
        """Create a GPU instance and its full compute instance (two driver steps)."""
        gi = self.create_gpu_instance(gpu, profile=profile, start=start)
        return self.create_compute_instance(gpu, gi)

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        """Destroy a GPU instance's compute instance, then the GPU instance (two driver steps)."""
        with self._lock:
            has_ci = self._instance(gpu, gi_id)["ci"] is not None
        if has_ci:
            self.destroy_compute_instance(gpu, gi_id)
        self.destroy_gpu_instance(gpu, gi_id)

    def running_processes(self, gpu: int, uuid: str) -> tuple[int, ...]:
        """PIDs attached to MIG device ``uuid`` on GPU ``gpu``."""
        with self._lock:
            for inst in self._gpu(gpu)["instances"]:
                if inst["uuid"] == uuid:
                    return tuple(inst["processes"])
        raise backend.BackendError(
            backend.ErrorKind.NOT_FOUND, f"GPU {gpu} has no MIG device {uuid}"
        )

    def wait_xid(self, timeout_s: float) -> backend.XidEvent | None:
        """The next queued XID event; waits up to ``timeout_s`` (real time) for one."""
        with self._event_ready:
            if not self._events and timeout_s > 0:
                self._event_ready.wait(timeout_s)
            return self._events.popleft() if self._events else None

    def compute_mode(self, gpu: int) -> backend.ComputeMode:
        """GPU ``gpu``'s compute mode (``DEFAULT`` until set)."""
        with self._lock:
            return _compute_mode(self._gpu(gpu), where=f"GPU {gpu}")

    def set_compute_mode(self, gpu: int, mode: backend.ComputeMode) -> None:
        """``nvmlDeviceSetComputeMode`` on the whole GPU; refused while MIG mode is on."""
        mode = backend.ComputeMode(mode)
        with self._changing(gpu):
            with self._lock:
                g = self._gpu(gpu)
                if g["mig_current"]:
                    raise backend.BackendError(
                        backend.ErrorKind.NOT_SUPPORTED,
                        f"GPU {gpu} is in MIG mode: its compute mode is per MIG device",
                    )

            def apply() -> None:
                g["compute_mode"] = mode.value

            self._step(Step.SET_COMPUTE_MODE, apply)

    def close(self) -> None:
        """Nothing to release: the state is saved after every change."""

    # --- driver steps (one NVML call each) -----------------------------------------------------

    def create_gpu_instance(self, gpu: int, *, profile: str, start: int) -> int:
        """``nvmlDeviceCreateGpuInstanceWithPlacement``: a GPU instance without compute instance.

        Returns its GPU-instance id (the lowest free one).
        """
        with self._changing(gpu):
            return self._create_gpu_instance(gpu, profile=profile, start=start)

    def _create_gpu_instance(self, gpu: int, *, profile: str, start: int) -> int:
        with self._lock:
            g = self._gpu(gpu)
            model = self._models[gpu]
            self._require_mig(gpu, g)
            geo = layouts.geometry(model)
            inst = layouts.Instance(start, profile)
            try:
                geo.placement(inst)
            except errors.UnknownProfileError as e:
                raise backend.BackendError(backend.ErrorKind.NOT_SUPPORTED, str(e)) from None
            except errors.LayoutError as e:
                raise backend.BackendError(backend.ErrorKind.INVALID_ARGUMENT, str(e)) from None
            existing = [layouts.Instance(i["start"], i["profile"]) for i in g["instances"]]
            reason = layouts.violation(model, [*existing, inst])
            if reason is not None:
                raise backend.BackendError(
                    backend.ErrorKind.INSUFFICIENT_RESOURCES,
                    f"cannot create {inst} on GPU {gpu}: {reason}",
                )
            used = {i["gi"] for i in g["instances"]}
            gi = next(n for n in range(1, 2 * model.max_gpu_instances + 2) if n not in used)

        def apply() -> None:
            g["instances"].append(
                InstanceState(gi=gi, profile=profile, start=start, ci=None, uuid=None, processes=[])
            )

        self._step(Step.CREATE_GPU_INSTANCE, apply)
        return gi

    def create_compute_instance(self, gpu: int, gi_id: int) -> backend.MigDevice:
        """``nvmlGpuInstanceCreateComputeInstance`` with the full profile: the MIG device."""
        with self._changing(gpu):
            with self._lock:
                g = self._gpu(gpu)
                inst = self._instance(gpu, gi_id)
                if inst["ci"] is not None:
                    raise backend.BackendError(
                        backend.ErrorKind.INSUFFICIENT_RESOURCES,
                        f"GPU instance {gi_id} on GPU {gpu} already has its compute instance",
                    )

            def apply() -> None:
                g["created"] += 1
                inst["ci"] = 0
                inst["uuid"] = _uuid(
                    "MIG",
                    f"migpilot-emulated:{self._state['seed']}:gpu:{gpu}:gi:{gi_id}:ci:0:"
                    f"n:{g['created']}",
                )

            self._step(Step.CREATE_COMPUTE_INSTANCE, apply)
            with self._lock:
                return self._device(gpu, inst)

    def destroy_compute_instance(self, gpu: int, gi_id: int) -> None:
        """``nvmlComputeInstanceDestroy``: fails with in-use while processes run on it."""
        with self._changing(gpu):
            with self._lock:
                inst = self._instance(gpu, gi_id)
                if inst["ci"] is None:
                    raise backend.BackendError(
                        backend.ErrorKind.NOT_FOUND,
                        f"GPU instance {gi_id} on GPU {gpu} has no compute instance",
                    )
                self._refuse_if_running(gpu, inst)

            def apply() -> None:
                # A process may have started while the step took its time: the driver refuses.
                self._refuse_if_running(gpu, inst)
                inst["ci"] = None
                inst["uuid"] = None

            self._step(Step.DESTROY_COMPUTE_INSTANCE, apply)

    @staticmethod
    def _refuse_if_running(gpu: int, inst: InstanceState) -> None:
        if inst["processes"]:
            pids = ", ".join(map(str, inst["processes"]))
            raise backend.BackendError(
                backend.ErrorKind.IN_USE,
                f"{inst['profile']}@{inst['start']} on GPU {gpu} has processes ({pids})",
            )

    def destroy_gpu_instance(self, gpu: int, gi_id: int) -> None:
        """``nvmlGpuInstanceDestroy``: fails with in-use while a compute instance remains."""
        with self._changing(gpu):
            with self._lock:
                g = self._gpu(gpu)
                inst = self._instance(gpu, gi_id)
                if inst["ci"] is not None:
                    raise backend.BackendError(
                        backend.ErrorKind.IN_USE,
                        f"GPU instance {gi_id} on GPU {gpu} still has a compute instance",
                    )
            self._step(Step.DESTROY_GPU_INSTANCE, lambda: g["instances"].remove(inst))

    # --- internals -----------------------------------------------------------------------------

    def _changing(self, gpu: int) -> threading.Lock:
        """The lock a state-changing step on GPU ``gpu`` holds throughout."""
        if not 0 <= gpu < len(self._gpu_locks):
            raise backend.BackendError(backend.ErrorKind.NOT_FOUND, f"no GPU {gpu}")
        return self._gpu_locks[gpu]

    def _step(self, step: Step, apply: collections.abc.Callable[[], None]) -> None:
        """One driver step, called holding its GPU's lock (not the state lock): the step's
        time passes with the state lock free, then ``apply`` changes the state and it is saved."""
        with self._lock:
            fault = self._due_fault(step)
        if fault is not None and fault.effect is FaultEffect.FAIL:
            raise backend.BackendError(fault.kind, f"injected failure of {step.value}")
        if fault is not None and fault.effect is FaultEffect.CRASH_BEFORE:
            raise SimulatedCrash(f"crash before {step.value}")
        self._clock.sleep(self._times.of(step))
        with self._lock:
            apply()
            self._save()
        if fault is not None and fault.effect is FaultEffect.CRASH_AFTER:
            raise SimulatedCrash(f"crash after {step.value}")

    def _due_fault(self, step: Step) -> Fault | None:
        due: Fault | None = None
        for entry in list(self._faults):
            fault, seen = entry
            if fault.step is not None and fault.step is not step:
                continue
            seen[0] += 1
            if seen[0] == fault.nth and due is None:
                due = fault
                self._faults.remove(entry)
        return due

    def _save(self) -> None:
        if self._path is not None:
            files.write_atomically(
                self._path,
                json.dumps(self._state, indent=1, sort_keys=True),
                durable=self._durable,
            )
        self._write_proc()

    def _write_proc(self) -> None:
        """The driver's proc files of the GPUs as they are now (with ``proc_root``)."""
        if self._proc_root is None:
            return
        gpus = [
            emulated_proc.EmulatedGpu(
                index=g["index"],
                uuid=g["uuid"],
                product_name=m.product_names[0],
                instances=tuple((i["gi"], i["ci"]) for i in g["instances"])
                if g["mig_current"]
                else (),
            )
            for g, m in zip(self._state["gpus"], self._models, strict=True)
        ]
        emulated_proc.sync(self._proc_root, emulated_proc.tree(gpus))

    def _gpu(self, gpu: int) -> GpuState:
        gpus = self._state["gpus"]
        if not 0 <= gpu < len(gpus):
            raise backend.BackendError(backend.ErrorKind.NOT_FOUND, f"no GPU {gpu}")
        return gpus[gpu]

    def _instance(self, gpu: int, gi_id: int) -> InstanceState:
        for inst in self._gpu(gpu)["instances"]:
            if inst["gi"] == gi_id:
                return inst
        raise backend.BackendError(
            backend.ErrorKind.NOT_FOUND, f"GPU {gpu} has no GPU instance {gi_id}"
        )

    def _by_uuid(self, uuid: str) -> InstanceState:
        for g in self._state["gpus"]:
            for inst in g["instances"]:
                if inst["uuid"] == uuid:
                    return inst
        raise backend.BackendError(backend.ErrorKind.NOT_FOUND, f"no MIG device {uuid}")

    def _require_mig(self, gpu: int, g: GpuState) -> None:
        if not g["mig_current"]:
            raise backend.BackendError(
                backend.ErrorKind.NOT_SUPPORTED, f"MIG mode is disabled on GPU {gpu}"
            )

    @staticmethod
    def _device(gpu: int, inst: InstanceState) -> backend.MigDevice:
        return backend.MigDevice(
            gpu=gpu,
            gi_id=inst["gi"],
            ci_id=inst["ci"],
            profile=inst["profile"],
            start=inst["start"],
            uuid=inst["uuid"],
        )


def _busy(g: GpuState, loads: Mapping[str, Load]) -> str:
    """What holds GPU ``g`` (GPU instances, or processes of a driven load), or ``""``."""
    if g["instances"]:
        return f"{len(g['instances'])} GPU instance(s)"
    driven = sorted(d for d in loads if d.partition("::")[0] == g["uuid"])
    if driven:
        return f"processes on {', '.join(driven)}"
    return ""


def _compute_mode(g: GpuState, *, where: str) -> backend.ComputeMode:
    value = g.get("compute_mode", backend.ComputeMode.DEFAULT.value)
    try:
        return backend.ComputeMode(value)
    except ValueError:
        known = ", ".join(m.value for m in backend.ComputeMode)
        raise backend.BackendError(
            backend.ErrorKind.UNKNOWN, f"{where}: unknown compute mode {value!r} (known: {known})"
        ) from None


def _total_memory_mib(model: profiles.GpuModel) -> int:
    """The GPU's memory: its largest profile's, else the nominal figure of the id."""
    known = [p.memory_mib for p in model.profiles if p.memory_mib is not None]
    return max(known) if known else 1024 * max(p.nominal_gb for p in model.profiles)


# --- the command-line spec ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EmulatedSpec:
    """What ``emulated:GPU[:xN][,GPU[:xN]...]`` asks for: the GPUs' models and ids, by index."""

    models: tuple[profiles.GpuModel, ...]
    pci_ids: tuple[pciids.PciId | None, ...]
    """Each GPU's PCI id as the spec gives it; ``None`` for a GPU named by its model (a new GPU
    then gets :func:`default_pci_id`, one in a state file keeps its id)."""
    mig_enabled: bool = True
    """Whether new GPUs start in MIG mode (``:mig-off`` at the end of the spec: whole GPUs, as
    a node sharing them by time-slicing or MPS has them)."""


_COUNT = re.compile(r"x(?P<count>[0-9]+)")


def _group(text: str, group: str) -> tuple[profiles.GpuModel, pciids.PciId | None, int]:
    """One ``GPU[:xN]``: GPU is a model name or a PCI id ``0xDEVICE[:0xSUBSYSTEM]``."""
    parts = group.split(":")
    count = 1
    if len(parts) > 1 and (m := _COUNT.fullmatch(parts[-1])) is not None:
        count = int(m["count"])
        parts = parts[:-1]
    gpu = ":".join(parts)
    pci: pciids.PciId | None = None
    try:
        if pciids.looks_like_id(gpu):
            pci = pciids.parse(gpu)
            model = catalog.default().by_pci_device_id(pci.device)
            if model is None:
                raise errors.UnknownGpuError(f"unknown GPU PCI device id 0x{pci.device:08X}")
            pci = pciids.PciId(pci.device, pci.subsystem or 0)
        elif len(parts) == 1 and parts[0]:
            model = catalog.resolve_gpu(gpu)
        else:
            raise ValueError("is not MODEL, MODEL:xN or 0xDEVICE[:0xSUBSYSTEM][:xN]")
    except ValueError as e:
        raise errors.AgentConfigError(
            f"backend {text!r}: {group!r} {e} (e.g. h100-80gb:x8, 0x233010DE:0x16C110DE:x8)"
        ) from None
    except errors.UnknownGpuError as e:
        raise errors.AgentConfigError(f"backend {text!r}: {e}") from None
    if not 1 <= count <= MAX_GPUS:
        raise errors.AgentConfigError(
            f"backend {text!r}: GPU count must be 1 to {MAX_GPUS}, got {count}"
        )
    return model, pci, count


def parse_spec(text: str) -> EmulatedSpec:
    """Parse ``emulated:h100-80gb:x8`` (several groups joined by ``,``, then optionally
    ``:mig-off`` for GPUs with MIG mode disabled); one-line errors.

    A group names its GPUs by model (their ids are then the backend's default) or by PCI id, board
    included (``emulated:0x233010DE:0x16C110DE:x8``): the id picks the model and is what
    mig-parted device filters are matched against.
    """
    head, sep, rest = text.strip().partition(":")
    if head != "emulated":
        raise errors.AgentConfigError(
            f"unknown backend {text!r} (expected nvml or emulated:MODEL:xN, "
            "e.g. emulated:h100-80gb:x8)"
        )
    if not sep or not rest.strip():
        raise errors.AgentConfigError(
            f"backend {text!r} names no GPU model (e.g. emulated:h100-80gb:x8)"
        )
    mig_enabled = True
    for suffix, enabled in ((":mig-off", False), (":mig-on", True)):
        if rest.strip().endswith(suffix):
            rest, mig_enabled = rest.strip()[: -len(suffix)], enabled
    models: list[profiles.GpuModel] = []
    ids: list[pciids.PciId | None] = []
    for group in rest.split(","):
        model, pci, count = _group(text, group.strip())
        models.extend([model] * count)
        ids.extend([pci] * count)
        if len(models) > MAX_GPUS:
            raise errors.AgentConfigError(f"backend {text!r}: more than {MAX_GPUS} GPUs")
    return EmulatedSpec(tuple(models), tuple(ids), mig_enabled)
