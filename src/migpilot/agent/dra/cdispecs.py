"""The CDI spec of one prepared claim, as a pure function of its devices and the driver's files.

Why it exists: NodePrepareResources answers CDI device IDs (``mig.migpilot.io/mig=<device>``)
and the container runtime resolves each in the CDI specs on the node; an ID no spec defines
fails the container's start. So each prepared claim gets its own spec file, written before the
answer and removed when the claim is unprepared (a claim's devices appear in no other file: a
device is allocated to one claim at a time). An entry is named after the DRA device and holds
the device nodes the device plugin's spec gives the same device (:mod:`deviceplugin.cdi`): the
GPU's ``/dev/nvidia<minor>``, and for a MIG device the ``nvidia-caps`` nodes of its GPU and
compute instances. Pure: the shell (:mod:`cdiclaims`) reads the driver's files and writes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from migpilot.agent.deviceplugin import cdi


@dataclass(frozen=True, slots=True)
class Located:
    """A prepared device as the driver knows it."""

    name: str
    """The DRA device name, the spec entry's name."""
    gpu_uuid: str
    """Its GPU's UUID (the device minor is looked up by it)."""
    gi_id: int | None = None
    """The GPU and compute instance ids of a MIG device; ``None`` for a whole GPU."""
    ci_id: int | None = None


def spec_file_name(owner: str) -> str:
    """``migpilot-dra-<claim UID>.json``: one file per prepared claim."""
    if not owner or "/" in owner or owner.startswith("."):
        raise cdi.CdiError(f"claim UID {owner!r} cannot name a CDI spec file")
    return f"migpilot-dra-{owner}.json"


def caps(devices: Sequence[Located], gpu_minors: Mapping[str, int]) -> tuple[str, ...]:
    """The capability names the MIG devices need (GI, then CI), for the shell to read."""
    out: list[str] = []
    for d in devices:
        minor = gpu_minors.get(d.gpu_uuid)
        if minor is None or d.gi_id is None or d.ci_id is None:
            continue
        out += [cdi.gi_cap(minor, d.gi_id), cdi.ci_cap(minor, d.gi_id, d.ci_id)]
    return tuple(out)


def build(devices: Sequence[Located], facts: cdi.DriverFacts, *, kind: str) -> cdi.Spec:
    """The claim's spec; :class:`cdi.CdiError` naming the first device it cannot describe."""
    entries: list[cdi.Device] = []
    for d in devices:
        cdi.check_device_name(d.name)
        minor = facts.gpu_minors.get(d.gpu_uuid)
        if minor is None:
            raise cdi.CdiError(f"{d.name}: the driver lists no device minor for {d.gpu_uuid}")
        nodes = [cdi.gpu_node(minor)]
        if d.gi_id is not None:
            if d.ci_id is None:
                raise cdi.CdiError(f"{d.name}: GPU instance {d.gi_id} has no compute instance")
            for cap in (cdi.gi_cap(minor, d.gi_id), cdi.ci_cap(minor, d.gi_id, d.ci_id)):
                cap_minor = facts.cap_minors.get(cap)
                if cap_minor is None:
                    raise cdi.CdiError(f"{d.name}: no capability file {cdi.cap_proc_path(cap)}")
                nodes.append(cdi.cap_node(cap_minor))
        entries.append(cdi.Device(d.name, tuple(nodes)))
    return cdi.Spec(kind, tuple(sorted(entries, key=lambda e: e.name)))
