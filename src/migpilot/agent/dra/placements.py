"""DRA device names of MIG placements, and the CDI device IDs of prepared ones.

Why it exists: the driver publishes one device per MIG placement (a profile at a start slot on
one GPU), kube-scheduler allocates a device by name, and the kubelet plugin must get the
placement back from that name alone. So the name encodes the placement,
``gpu-<index>-mig-<profile>-<start>`` (``gpu-0-mig-3g-40gb-4``, ``gpu-1-mig-1g-10gb-me-0``): a
DNS label as ResourceSlice device names must be, the profile's ``.`` and ``+`` written as ``-``
(and a ``-me`` profile's suffix as ``-no-me``, apart from ``+me``).
Parsing checks the placement against the GPU's model (the profile exists, the start is one of its
placements), so a stale or foreign name is refused with the reason. A GPU with MIG off is
published whole, as ``gpu-<index>`` (:class:`WholeGpu`); :func:`parse_device` reads either kind.
Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from migpilot.mig import dra, profiles

DRIVER = dra.DRIVER
"""The DRA driver's name: the kubelet plugin registers under it and claims' results carry it."""
CDI_KIND = f"{DRIVER}/mig"
"""The CDI kind (``<vendor>/<class>``) of the devices the plugin prepares."""
MAX_NAME = 63
"""A ResourceSlice device name is a DNS label: at most 63 characters."""

PlacementError = dra.PlacementError
Placement = dra.Placement
WholeGpu = dra.WholeGpu
parse_device_name = dra.parse_device_name
parse_whole_gpu_name = dra.parse_whole_gpu_name
# (The parsers live in :mod:`migpilot.mig.dra`: the controller reads allocated claims' devices
# with them too, and may not import the agent.)

Target = Placement | WholeGpu
"""What a DRA device of this driver names: a MIG placement or a whole GPU."""


def device_name(placement: Placement) -> str:
    """The DRA device name of a placement (``gpu-0-mig-3g-40gb-4``)."""
    name = dra.device_name(placement.gpu, placement.profile, placement.start)
    if len(name) > MAX_NAME:
        raise PlacementError(f"device name {name!r} of {placement} is longer than {MAX_NAME}")
    return name


def cdi_device_id(placement: Placement) -> str:
    """The fully qualified CDI name of a prepared placement (``mig.migpilot.io/mig=<device>``)."""
    return f"{CDI_KIND}={device_name(placement)}"


def whole_gpu_name(gpu: WholeGpu | int) -> str:
    """The DRA device name of a whole GPU (``gpu-0``), given as the GPU or its index."""
    return f"gpu-{gpu.gpu if isinstance(gpu, WholeGpu) else gpu}"


def target_name(target: Target) -> str:
    """The DRA device name of a placement or a whole GPU."""
    return whole_gpu_name(target) if isinstance(target, WholeGpu) else device_name(target)


def parse_target(name: str, gpus: Mapping[int, profiles.GpuModel]) -> Target:
    """A whole GPU (``gpu-<index>``) or a MIG placement, checked as :func:`parse_device_name`
    checks it. ``gpus`` holds the models of the GPUs in MIG mode; whether a whole GPU's index is
    a GPU with MIG off is the node's to say when the claim is prepared."""
    whole = parse_whole_gpu_name(name)
    return whole if whole is not None else parse_device_name(name, gpus)


def parse_device(name: str, gpus: Mapping[int, profiles.GpuModel]) -> Target:
    """As :func:`parse_target`, and a whole GPU's index must be one of ``gpus`` too (the
    publisher's check of its own names: it knows every GPU's model)."""
    target = parse_target(name, gpus)
    if isinstance(target, WholeGpu) and target.gpu not in gpus:
        known = ", ".join(str(i) for i in sorted(gpus)) or "none"
        raise PlacementError(f"device {name!r}: this node has no GPU {target.gpu} (GPUs: {known})")
    return target
