"""The CDI spec of the devices the plugin advertises, as a pure function of them and the driver.

Why it exists: under ``--device-list-strategy cdi-cri`` Allocate answers with CDI names
(``k8s.device-plugin.nvidia.com/gpu=<id>``, :mod:`allocating`), and the container runtime looks
each one up in the CDI specs on the node. A name no spec defines fails the container's start
("unresolvable CDI devices"); with MIG devices created and destroyed while the node runs
(HAMi#1903, dra-driver-nvidia-gpu#787) a spec generated once at boot cannot have them. So the
agent writes its own spec, from the same advertised resources Allocate answers for, with the
device nodes ``nvidia-ctk cdi generate`` would list (``docs/cdi.md``):

* every device: the common edits ``/dev/nvidiactl``, ``/dev/nvidia-uvm``,
  ``/dev/nvidia-uvm-tools`` (nvidia-ctk's control nodes; ``/dev/nvidia-modeset`` is a display
  driver's node, absent on the data-centre GPUs MIG runs on);
* a whole GPU: ``/dev/nvidia<minor>``, its minor from the driver (NVML's
  ``nvmlDeviceGetMinorNumber``, ``/proc/driver/nvidia/gpus/<bus>/information``'s
  ``Device Minor``);
* a MIG device: its GPU's node, then ``/dev/nvidia-caps/nvidia-cap<N>`` of its GPU instance and
  of its compute instance, N the ``DeviceFileMinor`` of
  ``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access`` and ``.../ci<C>/access``
  (nvidia-container-toolkit's ``internal/nvcaps``: the same capability names, the same order);
* an MPS slice (``GPU-x::mps-3``) and a time-slicing or MPS replica (``GPU-x::2``,
  ``MIG-y::2``): Allocate names the real device behind it (:func:`replicas.real_id`), so the spec
  has that device's entry, once.

A device the driver's files say nothing about is left out and reported (:class:`Missing`):
the plugin advertises it Unhealthy until its spec entry exists, so the kubelet never hands out a
name the runtime cannot resolve. No I/O: the shell (:mod:`cdifiles`) reads the files and
writes the spec.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.agent.deviceplugin import devices
from migpilot.sharing import replicas

CDI_VERSION = "0.5.0"
"""The CDI spec version written: device nodes need 0.3.0; 0.5.0 is what nvidia-ctk has written
for years and every CDI-aware runtime (containerd 1.7+, CRI-O 1.28+) reads."""
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")
"""The control device nodes every container with an NVIDIA device needs (the common edits)."""
CAPS_DEVICE_DIR = "/dev/nvidia-caps"
PROC_CAPABILITIES = "driver/nvidia/capabilities"
"""Below the proc root (``/proc``): the driver's capability files."""
PROC_GPUS = "driver/nvidia/gpus"
"""Below the proc root: one folder per GPU (its PCI bus id), each with ``information``."""
MINOR_KEY = "DeviceFileMinor"
"""The key of a capability file's minor number (``DeviceFileMinor: 12``)."""


class CdiError(errors.AgentConfigError):
    """A CDI vendor, class or device name the CDI specification refuses, or a driver file that
    does not say what it should."""


@dataclass(frozen=True, slots=True)
class DriverFacts:
    """What the driver's files say about the node's GPUs (read by the shell)."""

    gpu_minors: Mapping[str, int]
    """GPU UUID -> its device minor (``/dev/nvidia<minor>``)."""
    cap_minors: Mapping[str, int]
    """Capability name (:func:`gi_cap`, :func:`ci_cap`) -> the minor of its
    ``/dev/nvidia-caps/nvidia-cap<N>``."""


@dataclass(frozen=True, slots=True)
class Device:
    """One spec entry: a CDI device name and its device nodes."""

    name: str
    """The device ID Allocate names (``GPU-...`` or ``MIG-...``)."""
    nodes: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Missing:
    """An advertised device the spec cannot describe, and why."""

    device_id: str
    """The advertised device ID (a replica or slice ID as advertised)."""
    reason: str


@dataclass(frozen=True, slots=True)
class Spec:
    """A CDI spec: ``kind`` is ``<vendor>/<class>``, its devices sorted by name."""

    kind: str
    devices: tuple[Device, ...]
    common_nodes: tuple[str, ...] = CONTROL_NODES

    def names(self) -> frozenset[str]:
        """Every device name the spec defines."""
        return frozenset(d.name for d in self.devices)

    def qualified(self) -> frozenset[str]:
        """Every fully qualified name (``<kind>=<name>``) the spec resolves."""
        return frozenset(f"{self.kind}={d.name}" for d in self.devices)

    def document(self) -> dict[str, Any]:
        """The spec as the CDI specification's JSON document."""
        return {
            "cdiVersion": CDI_VERSION,
            "kind": self.kind,
            "devices": [
                {"name": d.name, "containerEdits": {"deviceNodes": _nodes(d.nodes)}}
                for d in self.devices
            ],
            "containerEdits": {"deviceNodes": _nodes(self.common_nodes)},
        }


@dataclass(frozen=True, slots=True)
class Built:
    """A spec and the advertised devices it could not describe."""

    spec: Spec
    missing: tuple[Missing, ...] = ()

    def missing_ids(self) -> frozenset[str]:
        """The advertised device IDs without a spec entry."""
        return frozenset(m.device_id for m in self.missing)


def _nodes(paths: Iterable[str]) -> list[dict[str, str]]:
    return [{"path": p} for p in paths]


def gi_cap(gpu_minor: int, gi: int) -> str:
    """``gpu<minor>/gi<G>/access``: a GPU instance's capability (nvidia-ctk's name)."""
    return f"gpu{gpu_minor}/gi{gi}/access"


def ci_cap(gpu_minor: int, gi: int, ci: int) -> str:
    """``gpu<minor>/gi<G>/ci<C>/access``: a compute instance's capability."""
    return f"gpu{gpu_minor}/gi{gi}/ci{ci}/access"


def cap_proc_path(cap: str) -> str:
    """Where a capability's file is below the proc root: ``gpu0/gi1/access`` ->
    ``driver/nvidia/capabilities/gpu0/mig/gi1/access`` (nvcaps' ``ProcPath``)."""
    gpu, _, rest = cap.partition("/")
    return f"{PROC_CAPABILITIES}/{gpu}/mig/{rest}"


def gpu_node(minor: int) -> str:
    """``/dev/nvidia<minor>``."""
    return f"/dev/nvidia{minor}"


def cap_node(minor: int) -> str:
    """``/dev/nvidia-caps/nvidia-cap<minor>``."""
    return f"{CAPS_DEVICE_DIR}/nvidia-cap{minor}"


def _fields(text: str) -> dict[str, str]:
    """``Key: value`` lines (the driver's proc files pad with tabs and spaces)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        key, colon, value = line.partition(":")
        if colon:
            found.setdefault(key.strip(), value.strip())
    return found


def _number(value: str, *, what: str) -> int:
    if not value.isdigit() or not value.isascii():
        raise CdiError(f"{what}: {value!r} is not a number")
    return int(value)


def parse_access(text: str, *, where: str) -> int:
    """The ``DeviceFileMinor`` of a capability file (``DeviceFileMinor: 12`` /
    ``DeviceFileMode: 292`` / ``DeviceFileModify: 1``, one a line)."""
    value = _fields(text).get(MINOR_KEY)
    if value is None:
        raise CdiError(f"{where}: no {MINOR_KEY} line")
    return _number(value, what=f"{where}: {MINOR_KEY}")


def parse_information(text: str, *, where: str) -> tuple[str, int]:
    """``(GPU UUID, Device Minor)`` of a GPU's ``information`` file."""
    fields = _fields(text)
    uuid = fields.get("GPU UUID")
    minor = fields.get("Device Minor")
    if not uuid:
        raise CdiError(f"{where}: no 'GPU UUID' line")
    if minor is None:
        raise CdiError(f"{where}: no 'Device Minor' line")
    return uuid, _number(minor, what=f"{where}: Device Minor")


def mig_caps(node: devices.NodeDevices, gpu_minors: Mapping[str, int]) -> tuple[str, ...]:
    """The capability names the node's MIG devices need (GI and CI of each), for the shell to
    read; a MIG device whose GPU has no known minor needs none (it is reported missing)."""
    caps: list[str] = []
    for mig in node.mig_devices:
        minor = gpu_minors.get(node.gpu(mig.gpu_index).uuid)
        if minor is None:
            continue
        caps.append(gi_cap(minor, mig.gpu_instance_id))
        caps.append(ci_cap(minor, mig.gpu_instance_id, mig.compute_instance_id))
    return tuple(caps)


def check_kind(vendor: str, cls: str) -> str:
    """``<vendor>/<class>``, each checked as the CDI parser does (``ValidateVendorName``,
    ``ValidateClassName``: a letter first, a letter or digit last, ``_-.`` between)."""
    for what, name in (("vendor", vendor), ("class", cls)):
        if not name:
            raise CdiError(f"CDI {what} is empty")
        if not name[0].isascii() or not name[0].isalpha():
            raise CdiError(f"CDI {what} {name!r} must start with a letter")
        _check_chars(name, what=f"CDI {what}", extra="_-.")
    return f"{vendor}/{cls}"


def check_device_name(name: str) -> None:
    """A CDI device name as ``ValidateDeviceName`` takes it: a letter or digit first and last,
    letters, digits and ``_-.:`` between."""
    if not name:
        raise CdiError("CDI device name is empty")
    if not _alnum(name[0]):
        raise CdiError(f"CDI device name {name!r} must start with a letter or digit")
    _check_chars(name, what="CDI device name", extra="_-.:")


def _alnum(c: str) -> bool:
    return c.isascii() and c.isalnum()


def _check_chars(name: str, *, what: str, extra: str) -> None:
    for c in name[1:-1]:
        if not (_alnum(c) or c in extra):
            raise CdiError(f"{what} {name!r} holds {c!r}")
    if not _alnum(name[-1]):
        raise CdiError(f"{what} {name!r} must end with a letter or digit")


def spec_device_id(device_id: str) -> str:
    """The device Allocate names for an advertised device: itself, or for an MPS slice or a
    replica the real device behind it (``GPU-x::mps-3`` and ``GPU-x::2`` -> ``GPU-x``)."""
    return replicas.real_id(device_id)


def build(
    node: devices.NodeDevices,
    resources: Sequence[devices.Resource],
    facts: DriverFacts,
    *,
    kind: str,
) -> Built:
    """The spec of every device ``resources`` advertise on ``node`` (one entry per real
    device, however many replicas or slices name it), and those it cannot describe."""
    gpus = {g.uuid: g for g in node.gpus}
    migs = {m.uuid: m for m in node.mig_devices}
    entries: dict[str, Device] = {}
    missing: list[Missing] = []
    for resource in resources:
        for device in resource.devices:
            name = spec_device_id(device.id)
            if name in entries:
                continue
            found = _entry(name, gpus=gpus, migs=migs, node=node, facts=facts)
            if isinstance(found, str):
                missing.append(Missing(device.id, found))
            else:
                entries[name] = found
    spec = Spec(kind, tuple(entries[n] for n in sorted(entries)))
    return Built(spec, tuple(missing))


def _entry(
    name: str,
    *,
    gpus: Mapping[str, devices.Gpu],
    migs: Mapping[str, devices.MigDevice],
    node: devices.NodeDevices,
    facts: DriverFacts,
) -> Device | str:
    """The entry of device ``name``, or why there is none."""
    try:
        check_device_name(name)
    except CdiError as err:
        return str(err)
    gpu = gpus.get(name)
    if gpu is not None:
        minor = facts.gpu_minors.get(gpu.uuid)
        if minor is None:
            return f"the driver lists no device minor for GPU {gpu.index} ({gpu.uuid})"
        return Device(name, (gpu_node(minor),))
    mig = migs.get(name)
    if mig is None:
        return "not a GPU or MIG device of this node"
    parent = node.gpu(mig.gpu_index)
    minor = facts.gpu_minors.get(parent.uuid)
    if minor is None:
        return f"the driver lists no device minor for GPU {parent.index} ({parent.uuid})"
    nodes = [gpu_node(minor)]
    for cap in (
        gi_cap(minor, mig.gpu_instance_id),
        ci_cap(minor, mig.gpu_instance_id, mig.compute_instance_id),
    ):
        cap_minor = facts.cap_minors.get(cap)
        if cap_minor is None:
            return f"no capability file {cap_proc_path(cap)}"
        nodes.append(cap_node(cap_minor))
    return Device(name, tuple(nodes))
