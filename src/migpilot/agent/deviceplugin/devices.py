"""The device plugin's view of a node, and the values it advertises.

The agent builds a :class:`NodeDevices` from its GPU backend (NVML or emulated) and hands it to
the device plugin and the label generator; neither talks to the GPUs itself. Everything here is
a frozen value; the module imports only the MIG model and the planner's MPS resource names.

MPS memory slices (``docs/agent.md``, "MPS slices"): a GPU with MIG disabled whose GpuLayout
lists slices is advertised as one device per slice, of resource ``nvidia.com/gpu-<N>gb``, with
device ID ``<gpu-uuid>::mps-<id>``. The ``::`` is NVIDIA's replica separator on purpose: a slice
is a share of its GPU, so code that maps a replica to its GPU (``replicas.real_id``, the kubelet's
PodResources in-use set) maps a slice to its GPU too; the ``mps-`` mark (never a number) tells
a slice from a numbered replica (:func:`parse_slice_id`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from migpilot import digits, errors
from migpilot.mig import profiles
from migpilot.planning import modes

RESOURCE_DOMAIN = "nvidia.com"
"""The vendor domain of every resource name NVIDIA's plugin uses."""
FULL_GPU_RESOURCE = "nvidia.com/gpu"
"""Whole GPUs (every strategy), and MIG devices under the single strategy."""
SLICE_MARK = "::mps-"
"""Between a GPU's UUID and a slice id in a slice's device ID (``GPU-x::mps-3``)."""


class MigStrategy(enum.StrEnum):
    """How MIG devices are advertised (NVIDIA's ``--mig-strategy``)."""

    NONE = "none"
    """Whole GPUs as ``nvidia.com/gpu``, MIG devices ignored, even on MIG-enabled GPUs."""
    SINGLE = "single"
    """Every MIG device as ``nvidia.com/gpu``; all of one profile, no MIG-disabled GPUs."""
    MIXED = "mixed"
    """One ``nvidia.com/mig-<profile>`` resource per profile; MIG-disabled GPUs as whole GPUs."""

    @staticmethod
    def parse(text: str) -> MigStrategy:
        """The strategy named ``text``; an :class:`AgentConfigError` naming the choices if none."""
        try:
            return MigStrategy(text.strip().lower())
        except ValueError:
            choices = ", ".join(s.value for s in MigStrategy)
            raise errors.AgentConfigError(
                f"unknown MIG strategy {text!r} (choose {choices})"
            ) from None


class DeviceListStrategy(enum.StrEnum):
    """How Allocate tells the container runtime which devices a container gets."""

    ENVVAR = "envvar"
    """``NVIDIA_VISIBLE_DEVICES=<ids>`` for the NVIDIA container runtime (NVIDIA's default)."""
    CDI_CRI = "cdi-cri"
    """CDI device names in the CRI field of the response (``vendor/class=<id>``)."""

    @staticmethod
    def parse(text: str) -> DeviceListStrategy:
        """``envvar``, ``cdi-cri`` or its short form ``cdi``; an error naming the choices."""
        key = text.strip().lower()
        if key == "cdi":
            return DeviceListStrategy.CDI_CRI
        try:
            return DeviceListStrategy(key)
        except ValueError:
            raise errors.AgentConfigError(
                f"unknown device-list strategy {text!r} (choose envvar, cdi-cri)"
            ) from None


class Health(enum.StrEnum):
    """A device's health as the kubelet API spells it."""

    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class Gpu:
    """One physical GPU as the backend reports it."""

    index: int
    """NVML device index."""
    uuid: str
    """``GPU-...``: the device ID when the whole GPU is advertised."""
    model: profiles.GpuModel
    """The catalog model (profiles, compute capability)."""
    product_name: str
    """The name NVML reports (``NVIDIA A100-SXM4-40GB``), used verbatim in labels."""
    memory_mib: int
    """Total memory in MiB as NVML reports it (``nvidia.com/gpu.memory``)."""
    mig_enabled: bool
    """Current MIG mode."""


@dataclass(frozen=True, slots=True)
class MigDevice:
    """One MIG device: a GPU instance with its full compute instance."""

    uuid: str
    """``MIG-...``: the device ID the plugin advertises."""
    gpu_index: int
    profile: profiles.Profile
    start: int
    """Start memory slot of the GPU instance."""
    gpu_instance_id: int
    """NVML GPU-instance id (XID events name the instance by it)."""
    compute_instance_id: int
    """NVML compute-instance id inside the GPU instance."""
    health: Health = Health.HEALTHY
    """Health as the backend sees it; XID events can only make it worse."""


@dataclass(frozen=True, slots=True)
class MpsSlice:
    """One MPS memory slice served on a GPU with MIG disabled (an MPS client's share)."""

    gpu_index: int
    id: int
    """The slice's id in the GpuLayout, stable within its GPU."""
    memory_gb: int
    """Its memory, whole GB (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` = this x 1024 MiB)."""
    cores: int | None = None
    """Its compute share in percent (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``); ``None``: all."""

    @property
    def resource(self) -> str:
        """``nvidia.com/gpu-<memory>gb``."""
        return slice_resource_name(self.memory_gb)


@dataclass(frozen=True, slots=True)
class NodeDevices:
    """Every GPU of a node and every MIG device on them."""

    gpus: tuple[Gpu, ...]
    mig_devices: tuple[MigDevice, ...] = ()
    unified: frozenset[str] = frozenset()
    """MIG device UUIDs and MPS slice device IDs set aside for unified pods
    (``docs/unified.md``): advertised as ``nvidia.com/gpu`` (a MIG device under the mixed
    strategy), not as ``nvidia.com/mig-<profile>`` or ``nvidia.com/gpu-<N>gb``."""
    mps_slices: tuple[MpsSlice, ...] = ()
    """The MPS slices served (only on GPUs with MIG disabled); such a GPU is not advertised
    whole."""

    def __post_init__(self) -> None:
        indexes = [g.index for g in self.gpus]
        if len(set(indexes)) != len(indexes):
            raise errors.AgentConfigError(f"GPU indexes listed twice: {sorted(indexes)}")
        ids = [g.uuid for g in self.gpus] + [m.uuid for m in self.mig_devices]
        if len(set(ids)) != len(ids):
            raise errors.AgentConfigError("a GPU or MIG device UUID is listed twice")
        known = set(indexes)
        for m in self.mig_devices:
            if m.gpu_index not in known:
                raise errors.AgentConfigError(
                    f"MIG device {m.uuid} is on unknown GPU {m.gpu_index}"
                )
        enabled = {g.index for g in self.gpus if g.mig_enabled}
        seen: set[tuple[int, int]] = set()
        for sl in self.mps_slices:
            if sl.gpu_index not in known:
                raise errors.AgentConfigError(f"MPS slice {sl.id} is on unknown GPU {sl.gpu_index}")
            if sl.gpu_index in enabled:
                raise errors.AgentConfigError(
                    f"MPS slice {sl.id} is on GPU {sl.gpu_index}, whose MIG mode is enabled"
                )
            if (sl.gpu_index, sl.id) in seen:
                raise errors.AgentConfigError(
                    f"MPS slice {sl.id} is listed twice on GPU {sl.gpu_index}"
                )
            seen.add((sl.gpu_index, sl.id))

    def gpu(self, index: int) -> Gpu:
        """The GPU with this index."""
        for g in self.gpus:
            if g.index == index:
                return g
        raise KeyError(index)

    def mig_devices_on(self, index: int) -> tuple[MigDevice, ...]:
        """The MIG devices of one GPU, by start slot."""
        return tuple(sorted((m for m in self.mig_devices if m.gpu_index == index), key=_start))

    def slices_on(self, index: int) -> tuple[MpsSlice, ...]:
        """The MPS slices of one GPU, by id."""
        return tuple(sorted((s for s in self.mps_slices if s.gpu_index == index), key=_id))

    def slice_device_ids(self) -> dict[str, MpsSlice]:
        """Every served slice by its device ID."""
        return {slice_device_id(self.gpu(s.gpu_index).uuid, s.id): s for s in self.mps_slices}


def without_gpus(view: NodeDevices, indexes: frozenset[int]) -> NodeDevices:
    """``view`` with the GPUs ``indexes`` and everything on them (MIG devices, MPS slices, a
    unified hand-out) left out: what is advertised while their MIG mode is switched, so that
    no new pod is given them meanwhile (``docs/migmode.md``)."""
    if not indexes:
        return view
    gone = {g.uuid for g in view.gpus if g.index in indexes}
    gone |= {m.uuid for m in view.mig_devices if m.gpu_index in indexes}
    slices = tuple(s for s in view.mps_slices if s.gpu_index not in indexes)
    kept_slices = {slice_device_id(view.gpu(s.gpu_index).uuid, s.id) for s in slices}
    return NodeDevices(
        gpus=tuple(g for g in view.gpus if g.index not in indexes),
        mig_devices=tuple(m for m in view.mig_devices if m.gpu_index not in indexes),
        unified=frozenset(
            u for u in view.unified if u not in gone and (not is_slice_id(u) or u in kept_slices)
        ),
        mps_slices=slices,
    )


def _start(m: MigDevice) -> tuple[int, str]:
    return (m.start, m.uuid)


def _id(s: MpsSlice) -> int:
    return s.id


def slice_resource_name(memory_gb: int) -> str:
    """The resource of a slice of ``memory_gb`` GB: ``nvidia.com/gpu-10gb`` (nos's names)."""
    return f"{modes.MPS_RESOURCE_PREFIX}{memory_gb}gb"


def is_slice_resource(name: str) -> bool:
    """True for ``nvidia.com/gpu-<N>gb``."""
    return modes.is_mps_resource(name)


def slice_device_id(gpu_uuid: str, slice_id: int) -> str:
    """``GPU-x`` and 3 -> ``GPU-x::mps-3``."""
    return f"{gpu_uuid}{SLICE_MARK}{slice_id}"


def parse_slice_id(device_id: str) -> tuple[str, int] | None:
    """``GPU-x::mps-3`` -> ``("GPU-x", 3)``; ``None`` for any other ID (a GPU, a MIG device, a
    numbered replica ``GPU-x::2``)."""
    uuid, mark, rest = device_id.partition(SLICE_MARK)
    if not mark or not uuid or not digits.is_digits(rest) or rest != str(int(rest)):
        return None
    return uuid, int(rest)


def is_slice_id(device_id: str) -> bool:
    """True for a slice's device ID."""
    return parse_slice_id(device_id) is not None


@dataclass(frozen=True, slots=True)
class Device:
    """One advertised device: what ListAndWatch sends, plus where it lives."""

    id: str
    gpu_index: int
    health: Health


@dataclass(frozen=True, slots=True)
class Resource:
    """One extended resource and its devices, in a stable order (GPU index, start slot)."""

    name: str
    """``nvidia.com/gpu`` or ``nvidia.com/mig-<profile>``."""
    devices: tuple[Device, ...]

    @property
    def socket_name(self) -> str:
        """The plugin's socket file name, as NVIDIA names it: ``nvidia-mig-1g.10gb.sock``."""
        return socket_name(self.name)

    def device(self, device_id: str) -> Device | None:
        """The device with this ID, if advertised."""
        for d in self.devices:
            if d.id == device_id:
                return d
        return None


def socket_name(resource_name: str) -> str:
    """``nvidia.com/mig-1g.10gb`` -> ``nvidia-mig-1g.10gb.sock`` (NVIDIA's getPluginSocketPath)."""
    _, _, name = resource_name.partition("/")
    return f"nvidia-{name}.sock"


def mig_resource_name(profile: profiles.Profile) -> str:
    """A profile's mixed-strategy resource: ``nvidia.com/mig-1g.10gb.me`` for ``1g.10gb+me``."""
    return f"{RESOURCE_DOMAIN}/{profile.resource_name}"
