"""In-memory stand-ins of the kubelet plugin's Protocols: the API's claims and a node's MIG.

Why it exists: the plugin's core and its gRPC shell are tested (and, later, simulated) without
an API server or a GPU. :class:`MemoryInstances` keeps MIG's rules (a placement must be valid
beside the GPU's other instances, :func:`layouts.violation`) and remembers what it created and
destroyed, so a test can see that preparing a claim twice made one instance; whole GPUs with MIG
off are given without creating anything. :class:`MemoryCdi` keeps the CDI specs written, so a
test can see a spec is there when prepare answers and gone after unprepare. Pure: plain data.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from migpilot.agent.dra import placements, preparing
from migpilot.mig import layouts, profiles


@dataclass
class MemoryClaims:
    """ResourceClaim objects by (namespace, name), as an API server would return them."""

    objects: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    reads: int = 0
    """How many reads were answered."""

    def put(self, claim: Mapping[str, Any]) -> None:
        """Store (or replace) a claim object under its namespace and name."""
        meta = claim["metadata"]
        self.objects[(meta["namespace"], meta["name"])] = copy.deepcopy(dict(claim))

    def delete(self, namespace: str, name: str) -> None:
        """Forget a claim."""
        self.objects.pop((namespace, name), None)

    def read_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """A copy of the stored claim, or ``None``."""
        self.reads += 1
        found = self.objects.get((namespace, name))
        return None if found is None else copy.deepcopy(found)


@dataclass
class MemoryInstances:
    """MIG instances of a node's GPUs, each owned by a claim's UID (or ``""``: not a claim's)."""

    gpus: Mapping[int, profiles.GpuModel]
    whole: Mapping[int, str] = field(default_factory=dict)
    """GPUs with MIG off, by index: their UUIDs (``GPU-...``)."""
    held: dict[placements.Target, tuple[str, str]] = field(default_factory=dict)
    """Placement -> (owner, MIG UUID)."""
    created: list[placements.Placement] = field(default_factory=list)
    destroyed: list[placements.Placement] = field(default_factory=list)

    def add_foreign(self, placement: placements.Placement) -> None:
        """An instance no claim owns (made by the device-plugin path, or by hand)."""
        self.held[placement] = ("", f"MIG-foreign-{len(self.held)}")

    def ensure(self, placement: placements.Target, *, owner: str) -> preparing.Instance:
        """The owner's instance at the placement, created if it is not there."""
        if placement in self.held:
            held_by, uuid = self.held[placement]
            if held_by != owner:
                who = f"claim UID {held_by}" if held_by else "an instance no claim owns"
                raise preparing.InstanceError(f"{placement} is taken by {who}")
            return preparing.Instance(placement, uuid)
        if isinstance(placement, placements.WholeGpu):
            gpu_uuid = self.whole.get(placement.gpu)
            if gpu_uuid is None:
                raise preparing.InstanceError(f"{placement}: no GPU with MIG off there")
            self.held[placement] = (owner, gpu_uuid)
            return preparing.Instance(placement, gpu_uuid)
        model = self.gpus.get(placement.gpu)
        if model is None:
            raise preparing.InstanceError(f"{placement}: no GPU {placement.gpu}")
        beside = [
            p for p in self.held if isinstance(p, placements.Placement) and p.gpu == placement.gpu
        ]
        wanted = [layouts.Instance(p.start, p.profile) for p in [*beside, placement]]
        problem = layouts.violation(model, wanted)
        if problem is not None:
            raise preparing.InstanceError(f"{placement} does not fit beside the GPU's: {problem}")
        uuid = f"MIG-{placement.gpu}-{placement.profile}-{placement.start}-{len(self.created)}"
        self.held[placement] = (owner, uuid)
        self.created.append(placement)
        return preparing.Instance(placement, uuid)

    def release(self, owner: str) -> tuple[placements.Target, ...]:
        """Destroy the owner's instances (let its whole GPUs go)."""
        mine = tuple(p for p, (held_by, _) in self.held.items() if held_by == owner and owner)
        for placement in mine:
            del self.held[placement]
            if isinstance(placement, placements.Placement):
                self.destroyed.append(placement)
        return mine


@dataclass
class MemoryCdi:
    """CDI specs by claim UID: device name -> the instance's UUID, as a spec file would hold."""

    specs: dict[str, dict[str, str]] = field(default_factory=dict)
    writes: int = 0

    def write(
        self, owner: str, devices: Sequence[tuple[str, preparing.Instance]]
    ) -> Mapping[str, str]:
        """Keep the claim's spec; the CDI IDs of its devices."""
        self.specs[owner] = {name: instance.uuid for name, instance in devices}
        self.writes += 1
        return {name: f"{placements.CDI_KIND}={name}" for name, _ in devices}

    def remove(self, owner: str) -> None:
        """Forget the claim's spec."""
        self.specs.pop(owner, None)
