"""The Lease rules the controller and the webhook share (api/leases.py): fresh (the webhook),
observe and claim (the controller's leader election, on its own clock), times."""

from __future__ import annotations

import calendar
import datetime
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.api import leases

NOW = 1_800_000_000.0
"""2027-01-15T08:00:00Z."""


def _lease(
    holder: str | None = "other",
    *,
    renewed: float | str | None = NOW,
    duration: Any = 15,
    transitions: Any = 3,
    acquired: str | None = "2027-01-01T00:00:00.000000Z",
    version: str | None = "42",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"leaseTransitions": transitions}
    if holder is not None:
        spec["holderIdentity"] = holder
    if duration is not None:
        spec["leaseDurationSeconds"] = duration
    if renewed is not None:
        spec["renewTime"] = leases.format_time(renewed) if isinstance(renewed, float) else renewed
    if acquired is not None:
        spec["acquireTime"] = acquired
    meta: dict[str, Any] = {"name": leases.NAME, "namespace": leases.NAMESPACE}
    if version is not None:
        meta["resourceVersion"] = version
    return {"metadata": meta, "spec": spec}


# --------------------------------------------------------------------------- fresh


@pytest.mark.parametrize(
    ("lease", "now", "want"),
    [
        pytest.param(_lease(), NOW, True, id="just-renewed"),
        pytest.param(_lease(), NOW + 14.999, True, id="just-before-expiry"),
        pytest.param(_lease(), NOW + 15, False, id="at-expiry"),
        pytest.param(_lease(), NOW + 100, False, id="long-expired"),
        pytest.param(_lease(renewed=NOW + 5), NOW, True, id="renewed-in-the-future"),
        pytest.param(_lease(holder=None), NOW, False, id="no-holder"),
        pytest.param(_lease(holder=""), NOW, False, id="empty-holder"),
        pytest.param(_lease(holder=7), NOW, False, id="holder-not-text"),  # type: ignore[arg-type]
        pytest.param(_lease(duration=None), NOW, False, id="no-duration"),
        pytest.param(_lease(duration=0), NOW, False, id="zero-duration"),
        pytest.param(_lease(duration=-5), NOW, False, id="negative-duration"),
        pytest.param(_lease(duration=True), NOW, False, id="bool-duration"),
        pytest.param(_lease(duration="15"), NOW, False, id="text-duration"),
        pytest.param(_lease(duration=15.0), NOW, False, id="float-duration"),
        pytest.param(_lease(renewed=None), NOW, False, id="never-renewed"),
        pytest.param(_lease(renewed="yesterday"), NOW, False, id="renew-time-garbage"),
        pytest.param({"spec": None}, NOW, False, id="spec-null"),
        pytest.param({"spec": []}, NOW, False, id="spec-list"),
        pytest.param({}, NOW, False, id="empty-object"),
    ],
)
def test_fresh(lease: dict[str, Any], now: float, want: bool) -> None:
    assert leases.fresh(lease, now) is want


# --------------------------------------------------------------------------- claim

T0 = 5_000.0
"""A candidate's monotonic clock when it first reads the Lease (unrelated to any epoch)."""
HOUR = 3600.0


def _claim(
    lease: dict[str, Any] | None,
    *,
    identity: str = "me",
    seen: float = T0,
    now: float = T0,
    stamp: float = NOW,
    **kw: Any,
) -> dict[str, Any] | None:
    """``claim`` by a candidate that first saw ``lease`` at ``seen`` and reads it unchanged
    at ``now`` (its monotonic clock)."""
    first = leases.observe(lease, previous=None, now=seen)
    again = leases.observe(lease, previous=first, now=now)
    assert again is first
    return leases.claim(lease, observed=again, identity=identity, now=now, stamp=stamp, **kw)


def test_an_absent_lease_is_taken() -> None:
    body = _claim(None)
    assert body is not None
    stamp = leases.format_time(NOW)
    assert body == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": leases.NAME, "namespace": leases.NAMESPACE},
        "spec": {
            "holderIdentity": "me",
            "leaseDurationSeconds": leases.DURATION_S,
            "acquireTime": stamp,
            "renewTime": stamp,
            "leaseTransitions": 0,
        },
    }
    assert leases.transitions_of(body) == 0


@pytest.mark.parametrize("waited", [0.0, 1.0, 14.999])
@pytest.mark.parametrize("skew", [-10 * HOUR, -20.0, 0.0, 20.0, 10 * HOUR])
def test_a_lease_another_holder_was_seen_renewing_is_not_taken_whatever_the_clocks(
    waited: float, skew: float
) -> None:
    # The holder's renewTime is hours off this candidate's wall clock either way: a fresh
    # Lease is not taken while a whole duration has not passed on the candidate's own clock.
    lease = _lease("other", renewed=NOW - skew)
    assert _claim(lease, now=T0 + waited, stamp=NOW) is None


@pytest.mark.parametrize("skew", [-10 * HOUR, -20.0, 0.0, 20.0, 10 * HOUR])
def test_a_dead_holders_lease_is_taken_after_one_duration_on_the_candidates_clock(
    skew: float,
) -> None:
    # renewTime written by a holder whose clock is hours ahead (or behind) this one: the
    # Lease is taken one duration after the candidate first saw it, never later.
    lease = _lease("other", renewed=NOW + skew, transitions=3)
    body = _claim(lease, now=T0 + leases.DURATION_S, stamp=NOW)
    assert body is not None
    assert body["spec"]["holderIdentity"] == "me"
    assert body["spec"]["leaseTransitions"] == 4
    assert body["spec"]["acquireTime"] == body["spec"]["renewTime"] == leases.format_time(NOW)
    assert body["metadata"]["resourceVersion"] == "42"


def test_each_renewal_seen_restarts_the_candidates_wait() -> None:
    lease = _lease("other", renewed=NOW, version="42")
    seen = leases.observe(lease, previous=None, now=T0)
    renewed = _lease("other", renewed=NOW + 2, version="43")
    later = leases.observe(renewed, previous=seen, now=T0 + 10)
    assert later is not None and later.at == T0 + 10
    assert (
        leases.claim(renewed, observed=later, identity="me", now=T0 + 20, stamp=NOW) is None
    )  # 10 s since the change was seen, not 20 since the first read
    assert leases.claim(renewed, observed=later, identity="me", now=T0 + 25, stamp=NOW)


@pytest.mark.parametrize(
    "changed",
    [
        pytest.param({"version": "43"}, id="resource-version"),  # a holder whose clock stopped
        pytest.param({"renewed": NOW + 1}, id="renew-time"),
        pytest.param({"holder": "third"}, id="holder"),
        pytest.param({"transitions": 4}, id="transitions"),
        pytest.param({"duration": 30}, id="duration"),
    ],
)
def test_any_change_of_the_record_is_a_renewal_seen(changed: dict[str, Any]) -> None:
    seen = leases.observe(_lease("other"), previous=None, now=T0)
    again = leases.observe(_lease(**{"holder": "other", **changed}), previous=seen, now=T0 + 9)
    assert again is not None and again.at == T0 + 9
    same = leases.observe(_lease("other"), previous=seen, now=T0 + 9)
    assert same is seen


@pytest.mark.parametrize(
    ("lease", "transitions"),
    [
        pytest.param(_lease(None), 4, id="released"),
        pytest.param(_lease("", renewed=NOW - 1), 4, id="released-empty-holder"),
        pytest.param(_lease("other", duration=None), 4, id="no-duration"),
        pytest.param(_lease("other", duration=0), 4, id="zero-duration"),
        pytest.param(_lease("other", duration="15"), 4, id="text-duration"),
        pytest.param(_lease("other", duration=True), 4, id="bool-duration"),
        pytest.param(_lease(None, transitions=None), 1, id="no-transitions"),
        pytest.param(_lease(None, transitions=-2), 1, id="neg-transitions"),
        pytest.param(_lease(None, transitions="3"), 1, id="text-transitions"),
        pytest.param({"spec": None, "metadata": {"resourceVersion": "42"}}, 1, id="spec-null"),
    ],
)
def test_a_released_or_malformed_lease_is_taken_at_once_with_one_more_transition(
    lease: dict[str, Any], transitions: int
) -> None:
    body = _claim(lease)
    assert body is not None
    spec = body["spec"]
    assert spec["holderIdentity"] == "me"
    assert spec["leaseTransitions"] == transitions
    assert spec["acquireTime"] == spec["renewTime"] == leases.format_time(NOW)
    assert body["metadata"]["resourceVersion"] == "42"


@pytest.mark.parametrize("waited", [0.0, 2.0, 14.9, HOUR])
@pytest.mark.parametrize("skew", [-HOUR, 0.0, HOUR])
def test_our_own_lease_is_renewed_keeping_its_acquire_time_and_term(
    waited: float, skew: float
) -> None:
    lease = _lease("me", renewed=NOW - skew, transitions=5)
    body = _claim(lease, now=T0 + waited)
    assert body is not None
    assert body["spec"]["acquireTime"] == lease["spec"]["acquireTime"]
    assert body["spec"]["renewTime"] == leases.format_time(NOW)
    assert body["spec"]["leaseTransitions"] == 5
    assert body["metadata"]["resourceVersion"] == "42"


def test_claim_carries_the_resource_version_only_when_there_is_one() -> None:
    body = _claim(_lease(None, version=None))
    assert body is not None
    assert "resourceVersion" not in body["metadata"]


def test_claim_writes_the_given_name_namespace_and_duration() -> None:
    body = _claim(None, namespace="ns", name="l", duration_s=7)
    assert body is not None
    assert body["metadata"] == {"name": "l", "namespace": "ns"}
    assert body["spec"]["leaseDurationSeconds"] == 7
    seen = leases.observe(body, previous=None, now=T0)
    assert leases.held_by_another(seen, identity="other", now=T0 + 6.9)
    assert not leases.held_by_another(seen, identity="other", now=T0 + 7)
    assert not leases.held_by_another(seen, identity="me", now=T0)


def test_no_lease_is_observed_as_none() -> None:
    assert leases.observe(None, previous=None, now=T0) is None
    assert not leases.held_by_another(None, identity="me", now=T0)


@given(
    holder=st.sampled_from(["me", "other", ""]),
    skew=st.floats(min_value=-1e6, max_value=1e6, allow_nan=False),
    waited=st.floats(min_value=0, max_value=100, allow_nan=False),
    identity=st.sampled_from(["me", "other"]),
)
def test_claim_never_takes_a_lease_another_was_seen_renewing_within_a_duration(
    holder: str, skew: float, waited: float, identity: str
) -> None:
    lease = _lease(holder, renewed=NOW + skew)
    body = _claim(lease, identity=identity, now=T0 + waited)
    held_by_another = holder not in ("", identity) and waited < leases.DURATION_S
    assert (body is None) is held_by_another
    if body is not None:
        assert body["spec"]["holderIdentity"] == identity
        assert body["spec"]["renewTime"] == leases.format_time(NOW)


# --------------------------------------------------------------------------- times


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("1970-01-01T00:00:00Z", 0.0),
        ("2027-01-15T08:00:00Z", NOW),
        ("2027-01-15T08:00:00.5Z", NOW + 0.5),
        ("2027-01-15T08:00:00.123456Z", NOW + 0.123456),
        ("2027-01-15t08:00:00z", NOW),
        ("2027-01-15T09:30:00+01:30", NOW),
        ("2027-01-15T06:00:00-02:00", NOW),
        ("2024-02-29T00:00:00Z", float(calendar.timegm((2024, 2, 29, 0, 0, 0, 0, 0, 0)))),
    ],
)
def test_parse_time(text: str, want: float) -> None:
    got = leases.parse_time(text)
    assert got is not None
    assert got == pytest.approx(want, abs=1e-6)


@pytest.mark.parametrize(
    "text",
    [
        None,
        12,
        "",
        "2027-01-15",
        "2027-01-15T08:00:00",  # no zone
        "2027-01-15 08:00:00Z",
        "2027-13-01T00:00:00Z",
        "2027-00-01T00:00:00Z",
        "2027-02-29T00:00:00Z",  # not a leap year
        "2027-04-31T00:00:00Z",
        "2027-01-15T24:00:00Z",
        "2027-01-15T08:60:00Z",
        "2027-01-15T08:00:61Z",
        "2027-01-15T08:00:00.Z",
        " 2027-01-15T08:00:00Z",
    ],
)
def test_parse_time_refuses_what_is_not_rfc3339(text: object) -> None:
    assert leases.parse_time(text) is None


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.0, "1970-01-01T00:00:00.000000Z"),
        (NOW, "2027-01-15T08:00:00.000000Z"),
        (NOW + 0.25, "2027-01-15T08:00:00.250000Z"),
        (951_782_400.0, "2000-02-29T00:00:00.000000Z"),
        (4_107_542_399.0, "2100-02-28T23:59:59.000000Z"),
        (NOW + 0.9999996, "2027-01-15T08:00:01.000000Z"),  # rounds up into the next second
    ],
)
def test_format_time(seconds: float, text: str) -> None:
    assert leases.format_time(seconds) == text


# Whole microseconds from 1970 to 2100: the precision of a Kubernetes MicroTime (a float of
# seconds holds a microsecond exactly enough up to 2^32 s, in 2106).
MICROS = st.integers(min_value=0, max_value=4_102_444_800 * 1_000_000)


@given(micros=MICROS)
def test_format_then_parse_round_trips_to_the_microsecond(micros: int) -> None:
    seconds = micros / 1_000_000
    text = leases.format_time(seconds)
    back = leases.parse_time(text)
    assert back is not None
    assert round(back * 1_000_000) == micros
    assert leases.format_time(back) == text


@given(micros=MICROS)
def test_format_time_agrees_with_datetime(micros: int) -> None:
    whole, frac = divmod(micros, 1_000_000)
    when = datetime.datetime.fromtimestamp(whole, tz=datetime.UTC).replace(microsecond=frac)
    assert leases.format_time(micros / 1_000_000) == when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")
