"""The names of migpilot's DRA driver: its driver name, device names and counter names.

Why it exists: the agent publishes MIG placements as ResourceSlice devices
(:mod:`migpilot.agent.dra.publishing`), its kubelet plugin reads a placement back from a device
name (:mod:`migpilot.agent.dra.placements`), and the simulator models kube-scheduler's allocator
over the same devices (:mod:`migpilot.planning.draalloc`). The simulator may not import the
agent, so the names all three must agree on live here, at the bottom of the layers, with the
parsing of a device name back into its placement (the controller reads allocated claims with it
too).
Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from migpilot import errors
from migpilot.mig import profiles

DRIVER = "mig.migpilot.io"
"""The DRA driver's name: the kubelet plugin registers under it and claims' results carry it."""
MAX_DEVICES = 64
"""``ResourceSliceMaxDevicesWithAdvancedFeatures``: devices in one slice once one of them consumes
counters (128, ``ResourceSliceMaxDevices``, is for plain devices)."""
COMPUTE_COUNTER = "compute-slices"
"""The counter of a GPU's compute slices (one total: MIG ties no instance to given slices)."""
MEDIA_COUNTER = "media-engines"
"""The counter of a GPU's media engines, which the ``+me`` profiles take."""


def memory_counter(slot: int) -> str:
    """The counter of memory slice ``slot``."""
    return f"memory-slice-{slot}"


def profile_slug(profile: str) -> str:
    """A profile's name as a DNS label part: ``.`` and ``+`` as ``-``, and a ``-me`` profile's
    suffix as ``-no-me`` (RTX PRO's ``1g.24gb-me``, no media engines, would otherwise read as
    ``1g.24gb+me``)."""
    if profile.endswith(profiles.Attribute.NO_ME.value):
        profile = profile[: -len(profiles.Attribute.NO_ME.value)] + "-no-me"
    return profile.lower().replace(".", "-").replace("+", "-")


def device_name(gpu: int, profile: str, start: int) -> str:
    """The device name of ``profile`` at memory slot ``start`` on GPU ``gpu``
    (``gpu-0-mig-3g-40gb-4``)."""
    return f"gpu-{gpu}-mig-{profile_slug(profile)}-{start}"


_NAME = re.compile(r"^gpu-(\d+)-mig-([a-z0-9-]+)-(\d+)$")
_WHOLE = re.compile(r"^gpu-(0|[1-9]\d*)$")


class PlacementError(errors.MigpilotError):
    """A DRA device name that names no valid MIG placement on this node."""


@dataclass(frozen=True, slots=True)
class Placement:
    """A MIG placement: ``profile`` (canonical name) at memory slot ``start`` on GPU ``gpu``."""

    gpu: int
    """The GPU's index on the node."""
    profile: str
    """The MIG profile's canonical name, e.g. ``3g.40gb``."""
    start: int
    """The first memory slot the instance takes."""

    def __str__(self) -> str:
        return f"{self.profile}@{self.start} on GPU {self.gpu}"


@dataclass(frozen=True, slots=True)
class WholeGpu:
    """A whole GPU with MIG off, given to a claim as it is: nothing is created for it."""

    gpu: int
    """The GPU's index on the node."""

    def __str__(self) -> str:
        return f"whole GPU {self.gpu}"


def parse_device_name(name: str, gpus: Mapping[int, profiles.GpuModel]) -> Placement:
    """The placement a device name names, checked against the model of each GPU index."""
    match = _NAME.match(name)
    if match is None:
        raise PlacementError(
            f"device {name!r} is not a MIG placement of {DRIVER} "
            "(expected gpu-<index>-mig-<profile>-<start>)"
        )
    gpu, slug, start = int(match[1]), match[2], int(match[3])
    model = gpus.get(gpu)
    if model is None:
        known = ", ".join(str(i) for i in sorted(gpus)) or "none"
        raise PlacementError(f"device {name!r}: this node has no GPU {gpu} (GPUs: {known})")
    by_slug = {profile_slug(p.name): p for p in model.profiles}
    profile = by_slug.get(slug)
    if profile is None:
        raise PlacementError(f"device {name!r}: {model.id} has no MIG profile {slug!r}")
    if start not in profile.placements:
        raise PlacementError(
            f"device {name!r}: {profile.name} cannot start at slot {start} on {model.id} "
            f"(starts: {', '.join(str(s) for s in profile.placements)})"
        )
    return Placement(gpu=gpu, profile=profile.name, start=start)


def parse_whole_gpu_name(name: str) -> WholeGpu | None:
    """The whole GPU ``gpu-<index>`` names, ``None`` for any other name (a MIG placement's is
    parsed by :func:`parse_device_name`). Whether the GPU has MIG off is the node's to say,
    when the claim is prepared."""
    match = _WHOLE.match(name)
    return None if match is None else WholeGpu(int(match[1]))
