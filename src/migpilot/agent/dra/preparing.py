"""What NodePrepareResources and NodeUnprepareResources do, sans-IO, through two Protocols.

Why it exists: the kubelet plugin's decisions (which instance a claim needs, when a second call
is the same answer, what a bad claim's error says) must be testable without a kubelet, an API
server or a GPU. The outside world comes in through :class:`ClaimSource` (the ResourceClaim as
the API server has it; the kubelet's v1 API passes only references) and :class:`Instances`
(create the MIG instance at a placement for a claim, release a claim's instances); the real
ones (the API client, the agent's MIG backend) plug in later, :mod:`memory` has in-memory ones.

The answers:

* prepare reads the claim, takes this driver's devices from its allocation, parses every
  device's placement first (a bad one creates nothing), then ensures each instance, owned by the
  claim's UID. Ensuring is idempotent, so the same claim prepared twice (a second pod, a kubelet
  or agent restart) gets the same devices and CDI IDs and no second instance. If an instance
  cannot be made after others of the claim were, those stay owned by the claim: the kubelet
  retries prepare (which reuses them) or unprepares (which releases them).
* unprepare releases whatever the claim's UID owns, without reading the claim (it may be gone
  from the API by then); a claim never prepared owns nothing, and that is a success.
* every problem is that claim's error string, naming the claim and the problem; other claims of
  the same call are answered on their own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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

    placement: placements.Placement
    uuid: str
    """The MIG device's UUID (``MIG-...``)."""


class ClaimSource(Protocol):
    """The ResourceClaims of the API server, read one at a time."""

    def read_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The claim object (its JSON as a mapping), or ``None`` when there is none; raises a
        :class:`errors.MigpilotError` when the API cannot answer."""
        ...


class Instances(Protocol):
    """The node's MIG instances, as far as claims own them."""

    def ensure(self, placement: placements.Placement, *, owner: str) -> Instance:
        """The instance at ``placement`` owned by ``owner`` (a claim's UID): the existing one, or
        a new one created there. Raises :class:`InstanceError` when the placement is taken by
        another owner or collides with an instance on the GPU."""
        ...

    def release(self, owner: str) -> tuple[placements.Placement, ...]:
        """Destroy every instance ``owner`` holds and return their placements; holding none is
        no error."""
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
        claim = self.source.read_claim(ref.namespace, ref.name)
        if claim is None:
            raise claims.ClaimError(f"claim {ref} is not in the API")
        allocated = claims.driver_devices(ref, claim, driver=self.driver, pool=self.pool)
        planned: list[tuple[claims.AllocatedDevice, placements.Placement]] = []
        for device in allocated:
            try:
                planned.append((device, placements.parse_device_name(device.device, self.gpus)))
            except placements.PlacementError as err:
                raise claims.ClaimError(f"claim {ref}: {err}") from err
        prepared: list[PreparedDevice] = []
        for device, placement in planned:
            try:
                instance = self.instances.ensure(placement, owner=ref.uid)
            except InstanceError as err:
                raise claims.ClaimError(f"claim {ref}: device {device.device}: {err}") from err
            prepared.append(
                PreparedDevice(
                    requests=device.requests,
                    pool=device.pool,
                    device=device.device,
                    cdi_ids=(placements.cdi_device_id(instance.placement),),
                    share_id=device.share_id,
                )
            )
        return tuple(prepared)

    def _unprepare(self, ref: claims.ClaimRef) -> str:
        if not ref.uid:
            return f"claim {ref}: the request leaves out uid"
        try:
            self.instances.release(ref.uid)
        except InstanceError as err:
            return f"claim {ref}: {err}"
        return ""
