"""What NodePrepareResources and NodeUnprepareResources do, sans-IO, through two Protocols.

Why it exists: the kubelet plugin's decisions (which instance a claim needs, when a second call
is the same answer, what a bad claim's error says) must be testable without a kubelet, an API
server or a GPU. The outside world comes in through :class:`ClaimSource` (the ResourceClaim as
the API server has it; the kubelet's v1 API passes only references), :class:`Instances`
(create the MIG instance at a placement for a claim, or give it a whole GPU; release a claim's
instances) and :class:`CdiSpecs` (the CDI spec of a claim's devices, written before the answer
names them). The real ones are :mod:`apiclaims`, :mod:`gpuinstances` and :mod:`cdispecs`;
:mod:`memory` has in-memory ones.

The answers:

* prepare reads the claim, takes this driver's devices from its allocation, parses every
  device's placement (or whole GPU) first (a bad one creates nothing), then ensures each
  instance, owned by the claim's UID, and writes the claim's CDI spec: the answer's CDI IDs are
  the ones written, and nothing is answered before the spec is on disk. Ensuring is
  idempotent, so the same claim prepared twice (a second pod, a kubelet or agent restart) gets
  the same devices and CDI IDs and no second instance. If an instance
  cannot be made after others of the claim were, those stay owned by the claim: the kubelet
  retries prepare (which reuses them) or unprepares (which releases them).
* unprepare releases whatever the claim's UID owns, without reading the claim (it may be gone
  from the API by then), then removes its CDI spec; a claim never prepared owns nothing, and
  that is a success.
* every problem is that claim's error string, naming the claim and the problem; other claims of
  the same call are answered on their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from migpilot import errors
from migpilot.agent.dra import claims, placements
from migpilot.mig import profiles


class InstanceError(errors.MigpilotError):
    """An instance that cannot be created or released (the placement is taken, the GPU
    refuses): the message names the placement and why."""


@dataclass(frozen=True, slots=True)
class Instance:
    """A MIG instance the backend holds for a claim."""

    placement: placements.Target
    """The MIG placement, or the whole GPU."""
    uuid: str
    """The MIG device's UUID (``MIG-...``), or the whole GPU's (``GPU-...``)."""


class ClaimSource(Protocol):
    """The ResourceClaims of the API server, read one at a time."""

    def read_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The claim object (its JSON as a mapping), or ``None`` when there is none; raises a
        :class:`errors.MigpilotError` when the API cannot answer."""
        ...


class Instances(Protocol):
    """The node's MIG instances, as far as claims own them."""

    def ensure(self, placement: placements.Target, *, owner: str) -> Instance:
        """The instance at ``placement`` owned by ``owner`` (a claim's UID): the existing one, or
        a new one created there; for a whole GPU, the GPU (nothing is created). Raises
        :class:`InstanceError` when the placement is taken by another owner or collides with an
        instance on the GPU (a whole GPU: when it has MIG on, or another owner has it)."""
        ...

    def release(self, owner: str) -> tuple[placements.Target, ...]:
        """Destroy every instance ``owner`` holds (a whole GPU is only let go) and return their
        placements; holding none is no error. Raises :class:`InstanceError` for an instance
        something still uses (it stays, with its owner, for the kubelet's retry)."""
        ...


class CdiSpecs(Protocol):
    """The CDI specs of prepared claims, one per claim, for the container runtime."""

    def write(self, owner: str, devices: Sequence[tuple[str, Instance]]) -> Mapping[str, str]:
        """Write (or rewrite) the spec of claim ``owner``: one CDI device per (DRA device name,
        instance). Returns each device name's fully qualified CDI ID as written. Raises a
        :class:`errors.MigpilotError` naming the device when the spec cannot be written."""
        ...

    def remove(self, owner: str) -> None:
        """Remove the spec of claim ``owner`` (none is no error)."""
        ...


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as NodePrepareResources answers it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """A claim's answer: its devices, or an error (then no devices)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class Preparer:
    """Prepares and unprepares the claims of one driver on one node."""

    source: ClaimSource
    """Where claims are read (the API server)."""
    instances: Instances
    gpus: Mapping[int, profiles.GpuModel]
    """The node's GPUs by index: placements are checked against their models."""
    pool: str
    """This node's pool (the node's name): devices from another pool are refused."""
    driver: str = placements.DRIVER
    specs: CdiSpecs = field(kw_only=True)
    """Where each prepared claim's CDI spec is written."""

    def prepare(self, refs: Sequence[claims.ClaimRef]) -> dict[str, PrepareResult]:
        """An answer per claim UID."""
        return {ref.uid: self._prepare(ref) for ref in refs}

    def unprepare(self, refs: Sequence[claims.ClaimRef]) -> dict[str, str]:
        """An error string per claim UID, empty when the claim was released (or never held)."""
        return {ref.uid: self._unprepare(ref) for ref in refs}

    def _prepare(self, ref: claims.ClaimRef) -> PrepareResult:
        try:
            return PrepareResult(devices=self._prepared_devices(ref))
        except errors.MigpilotError as err:
            return PrepareResult(error=str(err))

    def _prepared_devices(self, ref: claims.ClaimRef) -> tuple[PreparedDevice, ...]:
        ref.check()
        try:
            claim = self.source.read_claim(ref.namespace, ref.name)
        except errors.MigpilotError as err:
            raise claims.ClaimError(f"claim {ref}: {err}") from err
        if claim is None:
            raise claims.ClaimError(f"claim {ref} is not in the API")
        allocated = claims.driver_devices(ref, claim, driver=self.driver, pool=self.pool)
        planned: list[tuple[claims.AllocatedDevice, placements.Target]] = []
        for device in allocated:
            try:
                planned.append((device, placements.parse_target(device.device, self.gpus)))
            except placements.PlacementError as err:
                raise claims.ClaimError(f"claim {ref}: {err}") from err
        made: dict[str, Instance] = {}
        for device, placement in planned:
            try:
                made[device.device] = self.instances.ensure(placement, owner=ref.uid)
            except InstanceError as err:
                raise claims.ClaimError(f"claim {ref}: device {device.device}: {err}") from err
        if not made:
            return ()  # nothing of this driver's: no spec to write
        try:
            written = self.specs.write(ref.uid, tuple(made.items()))
        except errors.MigpilotError as err:
            raise claims.ClaimError(f"claim {ref}: CDI spec: {err}") from err
        unwritten = sorted(set(made) - set(written))
        if unwritten:
            raise claims.ClaimError(f"claim {ref}: CDI spec: no entry for {', '.join(unwritten)}")
        return tuple(
            PreparedDevice(
                requests=device.requests,
                pool=device.pool,
                device=device.device,
                cdi_ids=(written[device.device],),
                share_id=device.share_id,
            )
            for device, _ in planned
        )

    def _unprepare(self, ref: claims.ClaimRef) -> str:
        if not ref.uid:
            return f"claim {ref}: the request leaves out uid"
        try:
            self.instances.release(ref.uid)
            # After the instances: a spec whose instance still exists stays until it is gone.
            self.specs.remove(ref.uid)
        except errors.MigpilotError as err:
            return f"claim {ref}: {err}"
        return ""
