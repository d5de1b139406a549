"""Which advertised devices an XID error takes down.

NVIDIA's plugin (``internal/rm/health.go``) marks a device Unhealthy, for good, on an XID
critical error, except for the application errors it ignores (13, 31, 43, 45, 68, 109) and any
listed in ``DP_DISABLE_HEALTHCHECKS`` (``all``/``xids`` switch the checks off). Its known bug:
it keys MIG devices by parent GPU, so only one MIG device per GPU is watched. Here an event that
names a GPU instance (and compute instance) takes down exactly that MIG device, not its
siblings; an event for the whole GPU takes down every device on it. Pure: no NVML, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass

from migpilot import digits, errors
from migpilot.agent.deviceplugin import devices

DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})
"""Application errors that leave the GPU healthy (NVIDIA's list)."""


@dataclass(frozen=True, slots=True)
class XidPolicy:
    """Which XIDs count."""

    ignored: frozenset[int] = DEFAULT_IGNORED_XIDS
    """XIDs that never make a device Unhealthy (default: NVIDIA's list)."""
    enabled: bool = True
    """False switches XID health checks off (NVIDIA: ``DP_DISABLE_HEALTHCHECKS=all``)."""

    @staticmethod
    def from_disable_text(text: str) -> XidPolicy:
        """The policy for a ``DP_DISABLE_HEALTHCHECKS`` value, as NVIDIA reads it.

        ``all`` or anything containing ``xids`` disables the checks; otherwise the value is a
        comma-separated list of XIDs ignored on top of the default list. Unlike NVIDIA, which
        skips malformed entries silently, a malformed entry is an error.
        """
        value = text.strip().lower()
        if value == "all" or "xids" in value:
            return XidPolicy(enabled=False)
        extra: set[int] = set()
        for part in value.split(","):
            token = part.strip()
            if not token:
                continue
            if not digits.is_digits(token):
                raise errors.AgentConfigError(
                    f"ignored XID list {text!r}: {token!r} is not a number"
                )
            extra.add(int(token))
        return XidPolicy(ignored=DEFAULT_IGNORED_XIDS | extra)


@dataclass(frozen=True, slots=True)
class XidEvent:
    """An XID error as NVML reports it: the GPU, the XID and (on MIG) the instance ids."""

    gpu_uuid: str
    xid: int
    gpu_instance_id: int | None = None
    """None when the event is for the whole GPU (NVML's 0xFFFFFFFF)."""
    compute_instance_id: int | None = None
    """None when the event is for the whole GPU instance or GPU."""


def affected_devices(
    event: XidEvent,
    node: devices.NodeDevices,
    *,
    strategy: devices.MigStrategy,
    policy: XidPolicy,
) -> frozenset[str]:
    """The IDs of the advertised devices this event makes Unhealthy (empty if none)."""
    if not policy.enabled or event.xid in policy.ignored:
        return frozenset()
    gpu = next((g for g in node.gpus if g.uuid == event.gpu_uuid), None)
    if gpu is None:
        return frozenset()  # NVIDIA: "Ignoring event for unexpected device"
    if not gpu.mig_enabled or strategy is devices.MigStrategy.NONE:
        return frozenset({gpu.uuid})
    hit = frozenset(
        m.uuid
        for m in node.mig_devices_on(gpu.index)
        if event.gpu_instance_id is None
        or (
            m.gpu_instance_id == event.gpu_instance_id
            and (
                event.compute_instance_id is None
                or m.compute_instance_id == event.compute_instance_id
            )
        )
    )
    return hit
