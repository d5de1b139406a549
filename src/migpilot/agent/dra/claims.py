"""A ResourceClaim's allocation, as the kubelet plugin needs it: this driver's devices.

Why it exists: in the kubelet's DRA v1 API, NodePrepareResources carries only claim references
(namespace, name, UID); the devices kube-scheduler chose are in the claim's
``status.allocation.devices.results`` in the API server. This module turns the claim object read
from the API into the devices of one driver and pool, grouped per device with the requests they
serve, and refuses what the plugin cannot prepare with the reason: a reference missing a field,
a claim that was replaced (another UID), one not allocated, a result of this driver from another
node's pool, admin access. Pure: the object comes in as a mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from migpilot import errors


class ClaimError(errors.MigpilotError):
    """A claim the plugin cannot prepare: the message names the claim and the problem."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A ResourceClaim as the kubelet names it."""

    namespace: str
    name: str
    uid: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.uid})"

    def check(self) -> None:
        """Refuse a reference the kubelet should never send: every field is needed."""
        missing = [k for k in ("namespace", "name", "uid") if not getattr(self, k)]
        if missing:
            raise ClaimError(f"claim {self}: the request leaves out {', '.join(missing)}")


@dataclass(frozen=True, slots=True)
class AllocatedDevice:
    """One device of the claim's allocation, with every request it was allocated for."""

    pool: str
    device: str
    requests: tuple[str, ...]
    """The requests' names, subrequest suffixes cut (``gpu/small`` is ``gpu``) as the kubelet
    keeps them."""
    share_id: str | None = None
    """The share of a device allocated with consumable capacity; ``None`` otherwise."""


def _field(obj: Mapping[str, Any], key: str, *, where: str, kind: type) -> Any:
    value = obj.get(key)
    if not isinstance(value, kind):
        raise ClaimError(f"{where}: {key} is {errors.shown(value)}, not a {kind.__name__}")
    return value


def driver_devices(
    ref: ClaimRef, claim: Mapping[str, Any], *, driver: str, pool: str
) -> tuple[AllocatedDevice, ...]:
    """The devices of ``driver`` that ``claim`` (the API object ``ref`` names) was allocated,
    in the results' order; every one must come from ``pool`` (this node's)."""
    meta = claim.get("metadata") or {}
    uid = meta.get("uid")
    if uid != ref.uid:
        raise ClaimError(f"claim {ref}: the API has UID {uid!r} under that name (replaced)")
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ref} is not allocated")
    where = f"claim {ref}"
    results = (allocation.get("devices") or {}).get("results") or []
    if not isinstance(results, list):
        raise ClaimError(f"{where}: status.allocation.devices.results is not a list")
    grouped: dict[tuple[str, str, str | None], list[str]] = {}
    for i, result in enumerate(results):
        at = f"{where}: result {i}"
        if not isinstance(result, Mapping):
            raise ClaimError(f"{at} is {errors.shown(result)}, not an object")
        if result.get("driver") != driver:
            continue
        device = _field(result, "device", where=at, kind=str)
        result_pool = _field(result, "pool", where=at, kind=str)
        request = _field(result, "request", where=at, kind=str)
        if result_pool != pool:
            raise ClaimError(
                f"{at}: device {device} is from pool {result_pool!r}, this node's is {pool!r}"
            )
        if result.get("adminAccess"):
            raise ClaimError(f"{at}: admin access to {device} is not supported")
        share = result.get("shareID")
        if share is not None and not isinstance(share, str):
            raise ClaimError(f"{at}: shareID is {errors.shown(share)}, not a str")
        names = grouped.setdefault((result_pool, device, share), [])
        base = request.split("/", 1)[0]
        if base not in names:
            names.append(base)
    return tuple(
        AllocatedDevice(pool=p, device=d, requests=tuple(names), share_id=s)
        for (p, d, s), names in grouped.items()
    )
