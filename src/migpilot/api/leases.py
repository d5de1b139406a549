"""The controller's Lease: when it is held, and how a controller takes and renews it.

Why it exists: two programs judge the same Lease (``migpilot-controller`` in
``migpilot-system``): the controller, which acts only while it holds it (active/passive), and
the webhook, which gates new MIG pods only while some controller holds it fresh, so a dead
controller never strands new pods. One module holds the rules so both agree.

A Lease is held when it names a holder and ``renewTime + leaseDurationSeconds`` is later than
now. :func:`claim` is the step of Kubernetes' leader election: take a Lease that is absent,
expired or already ours (renewing it), never one another holder keeps fresh. The caller writes
the body with the Lease's ``resourceVersion``, so of two controllers claiming at once the API
server lets one win.

Pure: times are seconds since the Unix epoch handed in; no clock, no client.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Mapping
from typing import Any

NAME = "migpilot-controller"
"""The Lease's name."""
NAMESPACE = "migpilot-system"
"""The Lease's namespace (the controller's)."""
DURATION_S = 15
"""``leaseDurationSeconds`` the controller writes: another controller takes over this long
after the holder last renewed."""


_RFC3339 = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})[Tt]([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})"
)


def fresh(lease: Mapping[str, Any], now: float) -> bool:
    """Whether a coordination.k8s.io/v1 Lease (as a dict) is held now: it names a holder and its
    ``renewTime + leaseDurationSeconds`` is later than ``now`` (seconds since the Unix epoch).

    Anything missing or malformed means not fresh: the webhook then lets pods through ungated.
    """
    spec = lease.get("spec")
    if not isinstance(spec, Mapping):
        return False
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    renewed = parse_time(spec.get("renewTime"))
    if not isinstance(holder, str) or not holder:
        return False
    if isinstance(duration, bool) or not isinstance(duration, int) or duration <= 0:
        return False
    return renewed is not None and renewed + duration > now


def parse_time(value: object) -> float | None:
    """Seconds since the Unix epoch of an RFC 3339 time (Kubernetes Time or MicroTime), or
    None when ``value`` is not one."""
    if not isinstance(value, str):
        return None
    match = _RFC3339.fullmatch(value)
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    if not (1 <= month <= 12 and 1 <= day <= calendar.monthrange(year, month)[1]):
        return None
    if hour > 23 or minute > 59 or second > 60:
        return None
    seconds = float(calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0)))
    if match.group(7):
        seconds += float("0" + match.group(7))
    zone = match.group(8)
    if zone not in ("Z", "z"):
        sign = 1 if zone[0] == "+" else -1
        seconds -= sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    return seconds


def format_time(seconds: float) -> str:
    """A Kubernetes MicroTime (``2026-11-24T01:02:03.123456Z``) for seconds since the epoch."""
    whole = int(seconds)
    micros = round((seconds - whole) * 1_000_000)
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    y, mo, d, h, mi, s = _gmtime(whole)
    return f"{y:04d}-{mo:02d}-{d:02d}T{h:02d}:{mi:02d}:{s:02d}.{micros:06d}Z"


def _gmtime(seconds: int) -> tuple[int, int, int, int, int, int]:
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    mi, s = divmod(rest, 60)
    # Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    y = yoe + era * 400
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    d = doy - (153 * mp + 2) // 5 + 1
    mo = mp + 3 if mp < 10 else mp - 9
    return (y + (mo <= 2), mo, d, h, mi, s)


def claim(
    lease: Mapping[str, Any] | None,
    *,
    identity: str,
    now: float,
    namespace: str = NAMESPACE,
    name: str = NAME,
    duration_s: int = DURATION_S,
) -> dict[str, Any] | None:
    """The Lease body that takes or renews the Lease for ``identity`` at ``now``, or ``None``
    when another holder keeps it fresh. A new holder bumps ``leaseTransitions`` (the same
    holder taking its own expired Lease again does not; its ``acquireTime`` is new)."""
    if lease is not None and fresh(lease, now):
        holder = (lease.get("spec") or {}).get("holderIdentity")
        if holder != identity:
            return None
    stamp = format_time(now)
    spec_in: Mapping[str, Any] = (lease or {}).get("spec") or {}
    same_holder = lease is not None and spec_in.get("holderIdentity") == identity
    ours = same_holder and lease is not None and fresh(lease, now)
    transitions = spec_in.get("leaseTransitions")
    transitions = transitions if isinstance(transitions, int) and transitions >= 0 else 0
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if lease is not None:
        version = (lease.get("metadata") or {}).get("resourceVersion")
        if version is not None:
            metadata["resourceVersion"] = version
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": duration_s,
            "acquireTime": spec_in.get("acquireTime") if ours else stamp,
            "renewTime": stamp,
            "leaseTransitions": transitions if same_holder or lease is None else transitions + 1,
        },
    }
