"""The names of migpilot's DRA driver: its driver name, device names and counter names.

Why it exists: the agent publishes MIG placements as ResourceSlice devices
(:mod:`migpilot.agent.dra.publishing`), its kubelet plugin reads a placement back from a device
name (:mod:`migpilot.agent.dra.placements`), and the simulator models kube-scheduler's allocator
over the same devices (:mod:`migpilot.sim.draalloc`). The simulator may not import the agent, so
the names all three must agree on live here, at the bottom of the layers. Pure: no I/O.
"""

from __future__ import annotations

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
