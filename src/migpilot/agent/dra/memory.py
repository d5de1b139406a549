"""In-memory stand-ins of the kubelet plugin's Protocols: the API's claims and a node's MIG.

Why it exists: the plugin's core and its gRPC shell are tested (and, later, simulated) without
an API server or a GPU. :class:`MemoryInstances` keeps MIG's rules (a placement must be valid
beside the GPU's other instances, :func:`layouts.violation`) and remembers what it created and
destroyed, so a test can see that preparing a claim twice made one instance. Pure: plain data.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
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
    held: dict[placements.Placement, tuple[str, str]] = field(default_factory=dict)
    """Placement -> (owner, MIG UUID)."""
    created: list[placements.Placement] = field(default_factory=list)
    destroyed: list[placements.Placement] = field(default_factory=list)

    def add_foreign(self, placement: placements.Placement) -> None:
        """An instance no claim owns (made by the device-plugin path, or by hand)."""
        self.held[placement] = ("", f"MIG-foreign-{len(self.held)}")

    def ensure(self, placement: placements.Placement, *, owner: str) -> preparing.Instance:
        """The owner's instance at the placement, created if it is not there."""
        if placement in self.held:
            held_by, uuid = self.held[placement]
            if held_by != owner:
                who = f"claim UID {held_by}" if held_by else "an instance no claim owns"
                raise preparing.InstanceError(f"{placement} is taken by {who}")
            return preparing.Instance(placement, uuid)
        model = self.gpus.get(placement.gpu)
        if model is None:
            raise preparing.InstanceError(f"{placement}: no GPU {placement.gpu}")
        beside = [p for p in self.held if p.gpu == placement.gpu]
        wanted = [layouts.Instance(p.start, p.profile) for p in [*beside, placement]]
        problem = layouts.violation(model, wanted)
        if problem is not None:
            raise preparing.InstanceError(f"{placement} does not fit beside the GPU's: {problem}")
        uuid = f"MIG-{placement.gpu}-{placement.profile}-{placement.start}-{len(self.created)}"
        self.held[placement] = (owner, uuid)
        self.created.append(placement)
        return preparing.Instance(placement, uuid)

    def release(self, owner: str) -> tuple[placements.Placement, ...]:
        """Destroy the owner's instances."""
        mine = tuple(p for p, (held_by, _) in self.held.items() if held_by == owner and owner)
        for placement in mine:
            del self.held[placement]
            self.destroyed.append(placement)
        return mine
