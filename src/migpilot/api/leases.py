"""The controller's Lease: when it is held, and how a controller takes and renews it.

Why it exists: two programs judge the same Lease (``migpilot-controller`` in
``migpilot-system``): the controller, which acts only while it holds it (active/passive), and
the webhook, which gates new MIG pods only while some controller holds it fresh, so a dead
controller never strands new pods. One module holds the rules so both agree.

The controller follows client-go's leader election (``tools/leaderelection``): a candidate
never compares the holder's ``renewTime`` with its own wall clock. It remembers when, on its
own monotonic clock, it last saw the Lease record change (:func:`observe`: holder, renew and
acquire times, duration, transitions, ``resourceVersion``) and takes the Lease only once
``leaseDurationSeconds`` have passed on that clock with no change (:func:`held_by_another`).
Clock skew between nodes therefore does not matter; only the rate of the clocks does. The
holder, for its part, acts only until its renew deadline (shorter than the duration) has
passed on its own monotonic clock since the start of its last successful renewal, so it has
stopped before any candidate can have waited out the duration. :func:`claim` is the step:
take a Lease that is absent, released or not seen renewed for a whole duration, or renew our
own, never one another holder was seen renewing. The caller writes the body with the Lease's
``resourceVersion``, so of two controllers claiming at once the API server lets one win.

:func:`fresh` is the webhook's looser reading (``renewTime`` against the wall clock): the
webhook only decides whether to gate a pod, never whether two controllers act, and it must
fail open on its first read rather than wait a whole duration.

The Lease also carries what the webhook must know of the cluster and cannot read itself (it
reads no Node): whether any node is labelled ``migpilot.io/mig-mode=dynamic``
(:data:`DYNAMIC_MIG_ANNOTATION`, written by the holder at each renewal, read by
:func:`dynamic_mig`). Only then does the webhook gate whole-GPU pods (``docs/migmode.md``);
without such a node the Lease is written as before.

Pure: times are numbers handed in (monotonic seconds to judge, epoch seconds to stamp); no
clock, no client.
"""

from __future__ import annotations

import calendar
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

NAME = "migpilot-controller"
"""The Lease's name."""
NAMESPACE = "migpilot-system"
"""The Lease's namespace (the controller's)."""
DURATION_S = 15
"""``leaseDurationSeconds`` the controller writes: another controller takes over once it has
seen no renewal for this long on its own clock (client-go's default)."""
RENEW_DEADLINE_S = 10.0
"""Seconds after the start of its last successful renewal that the holder stops acting, on its
own monotonic clock, when it could not renew since (client-go's default). Less than
:data:`DURATION_S`: the margin covers the clocks' rates and an in-flight write."""
RETRY_S = 2.0
"""Seconds between tries to take or renew the Lease (client-go's default)."""
CALL_TIMEOUT_S = 4.0
"""Seconds one Lease call (get, create, update) may take before it is abandoned: less than
:data:`RENEW_DEADLINE_S` minus :data:`RETRY_S`, so one hung call never costs the holder its
Lease."""

DYNAMIC_MIG_ANNOTATION = "migpilot.io/dynamic-mig-nodes"
"""Annotation the holder writes on the Lease, ``"true"``, while some node is labelled
``migpilot.io/mig-mode=dynamic``; absent otherwise."""


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


def dynamic_mig(lease: Mapping[str, Any]) -> bool:
    """Whether the Lease says some node is labelled ``migpilot.io/mig-mode=dynamic``
    (:data:`DYNAMIC_MIG_ANNOTATION` is ``"true"``); anything else, malformed included, is no."""
    metadata = lease.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    return isinstance(annotations, Mapping) and annotations.get(DYNAMIC_MIG_ANNOTATION) == "true"


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


@dataclass(frozen=True, slots=True)
class Observation:
    """The Lease as this candidate last saw it change, and when, on its own monotonic clock
    (client-go's ``observedRecord`` and ``observedTime``)."""

    record: tuple[object, ...]
    """What tells one write of the Lease from the next: ``resourceVersion`` and the spec's
    holder, renew and acquire times, duration and transitions."""
    holder: str
    """``holderIdentity`` ("" when released or missing)."""
    duration_s: int
    """``leaseDurationSeconds`` as written (0 when missing or malformed: not held)."""
    transitions: int
    """``leaseTransitions`` (0 when missing or malformed)."""
    at: float
    """Monotonic seconds (the observer's clock) when this record was first seen."""


def observe(
    lease: Mapping[str, Any] | None, *, previous: Observation | None, now: float
) -> Observation | None:
    """What a candidate knows after reading ``lease`` at ``now`` (its monotonic clock): the
    ``previous`` observation when the record has not changed since (its time stays the time
    it was first seen), else a new one seen ``now``; ``None`` when there is no Lease."""
    if lease is None:
        return None
    spec: Mapping[str, Any] = lease.get("spec") or {}
    if not isinstance(spec, Mapping):
        spec = {}
    meta: Mapping[str, Any] = lease.get("metadata") or {}
    if not isinstance(meta, Mapping):
        meta = {}
    record = (
        _hashable(meta.get("resourceVersion")),
        _hashable(spec.get("holderIdentity")),
        _hashable(spec.get("renewTime")),
        _hashable(spec.get("acquireTime")),
        _hashable(spec.get("leaseDurationSeconds")),
        _hashable(spec.get("leaseTransitions")),
    )
    if previous is not None and previous.record == record:
        return previous
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    transitions = spec.get("leaseTransitions")
    return Observation(
        record=record,
        holder=holder if isinstance(holder, str) else "",
        duration_s=_count(duration),
        transitions=_count(transitions),
        at=now,
    )


def held_by_another(observed: Observation | None, *, identity: str, now: float) -> bool:
    """Whether another holder was seen renewing within its ``leaseDurationSeconds`` before
    ``now``, both on this candidate's monotonic clock (client-go's ``isLeaseValid`` for a
    holder that is not us)."""
    return (
        observed is not None
        and observed.holder not in ("", identity)
        and now < observed.at + observed.duration_s
    )


def claim(
    lease: Mapping[str, Any] | None,
    *,
    observed: Observation | None,
    identity: str,
    now: float,
    stamp: float,
    namespace: str = NAMESPACE,
    name: str = NAME,
    duration_s: int = DURATION_S,
    dynamic_mig: bool = False,
) -> dict[str, Any] | None:
    """The Lease body that takes or renews the Lease for ``identity``, or ``None`` while
    another holder was seen renewing it (:func:`held_by_another` at ``now``, monotonic).

    ``observed`` is :func:`observe` of ``lease``. ``stamp`` (seconds since the epoch) is only
    written, as ``renewTime`` (and ``acquireTime`` on a take): no one judges freshness by it
    but the webhook. Renewing our own Lease keeps its ``acquireTime`` and ``leaseTransitions``;
    a take bumps ``leaseTransitions``, the fencing term a spec write carries. ``dynamic_mig``:
    some node is labelled ``migpilot.io/mig-mode=dynamic`` (:data:`DYNAMIC_MIG_ANNOTATION`
    written; without it, none)."""
    if held_by_another(observed, identity=identity, now=now):
        return None
    text = format_time(stamp)
    spec_in: Mapping[str, Any] = (lease or {}).get("spec") or {}
    ours = lease is not None and spec_in.get("holderIdentity") == identity
    transitions = _count(spec_in.get("leaseTransitions"))
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if lease is not None:
        version = (lease.get("metadata") or {}).get("resourceVersion")
        if version is not None:
            metadata["resourceVersion"] = version
    if dynamic_mig:
        metadata["annotations"] = {DYNAMIC_MIG_ANNOTATION: "true"}
    acquired = spec_in.get("acquireTime")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": metadata,
        "spec": {
            "holderIdentity": identity,
            "leaseDurationSeconds": duration_s,
            "acquireTime": acquired if ours and isinstance(acquired, str) else text,
            "renewTime": text,
            "leaseTransitions": transitions if ours or lease is None else transitions + 1,
        },
    }


def release(lease: Mapping[str, Any], *, identity: str, stamp: float) -> dict[str, Any] | None:
    """The body that gives up ``identity``'s Lease on a clean stop (client-go's
    ``ReleaseOnCancel``): no holder, a duration of 1 s, the transitions kept, so a standby takes
    it at its next try instead of a whole duration later, and the webhook stops gating at once.
    ``None`` when ``lease`` is not held by ``identity`` (nothing of ours to give up). The
    ``resourceVersion`` is kept: a Lease someone took since is not touched (409)."""
    spec_in = lease.get("spec")
    if not isinstance(spec_in, Mapping) or spec_in.get("holderIdentity") != identity:
        return None
    metadata = lease.get("metadata")
    meta_in: Mapping[str, Any] = metadata if isinstance(metadata, Mapping) else {}
    text = format_time(stamp)
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            k: meta_in[k] for k in ("name", "namespace", "resourceVersion") if k in meta_in
        },
        "spec": {
            "holderIdentity": "",
            "leaseDurationSeconds": 1,
            "acquireTime": text,
            "renewTime": text,
            "leaseTransitions": transitions_of(lease),
        },
    }


def transitions_of(lease: Mapping[str, Any]) -> int:
    """``leaseTransitions`` of a Lease body (0 when missing or malformed)."""
    spec = lease.get("spec")
    return _count(spec.get("leaseTransitions") if isinstance(spec, Mapping) else None)


def _count(value: object) -> int:
    """``value`` when it is a whole number of 0 or more (JSON's, not a bool), else 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _hashable(value: object) -> object:
    return value if isinstance(value, (str, int, float, bool, type(None))) else repr(value)
