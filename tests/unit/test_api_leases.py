"""The Lease rules the controller and the webhook share (api/leases.py): fresh, claim, times."""

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


def test_an_absent_lease_is_taken() -> None:
    body = leases.claim(None, identity="me", now=NOW)
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
    assert leases.fresh(body, NOW)
    assert not leases.fresh(body, NOW + leases.DURATION_S)


@pytest.mark.parametrize("age", [0.0, 1.0, 14.0])
def test_a_lease_another_holder_keeps_fresh_is_not_taken(age: float) -> None:
    assert leases.claim(_lease("other", renewed=NOW - age), identity="me", now=NOW) is None


@pytest.mark.parametrize(
    ("lease", "transitions"),
    [
        pytest.param(_lease("other", renewed=NOW - 15), 4, id="just-expired"),
        pytest.param(_lease("other", renewed=NOW - 3600), 4, id="long-expired"),
        pytest.param(_lease(None), 4, id="released"),
        pytest.param(_lease("", renewed=NOW - 1), 4, id="released-empty-holder"),
        pytest.param(_lease("other", renewed=NOW - 60, transitions=None), 1, id="no-transitions"),
        pytest.param(_lease("other", renewed="garbage"), 4, id="bad-renew-time"),
        pytest.param(_lease("other", renewed=NOW - 60, transitions=-2), 1, id="neg-transitions"),
        pytest.param(_lease("other", renewed=NOW - 60, transitions="3"), 1, id="text-transitions"),
    ],
)
def test_an_expired_or_released_lease_is_taken_with_one_more_transition(
    lease: dict[str, Any], transitions: int
) -> None:
    body = leases.claim(lease, identity="me", now=NOW)
    assert body is not None
    spec = body["spec"]
    assert spec["holderIdentity"] == "me"
    assert spec["leaseTransitions"] == transitions
    assert spec["acquireTime"] == spec["renewTime"] == leases.format_time(NOW)
    assert body["metadata"]["resourceVersion"] == "42"


@pytest.mark.parametrize("age", [0.0, 2.0, 14.9])
def test_our_own_fresh_lease_is_renewed_keeping_its_acquire_time(age: float) -> None:
    lease = _lease("me", renewed=NOW - age, transitions=5)
    body = leases.claim(lease, identity="me", now=NOW)
    assert body is not None
    assert body["spec"]["acquireTime"] == lease["spec"]["acquireTime"]
    assert body["spec"]["renewTime"] == leases.format_time(NOW)
    assert body["spec"]["leaseTransitions"] == 5
    assert body["metadata"]["resourceVersion"] == "42"


def test_our_own_expired_lease_is_taken_again_without_a_transition() -> None:
    # leaseTransitions counts changes of holder (as client-go's leader election does); the
    # same holder coming back after a lapse is a new acquisition but not a new holder.
    lease = _lease("me", renewed=NOW - 60, transitions=5)
    body = leases.claim(lease, identity="me", now=NOW)
    assert body is not None
    assert body["spec"]["leaseTransitions"] == 5
    assert body["spec"]["acquireTime"] == leases.format_time(NOW)


def test_claim_carries_the_resource_version_only_when_there_is_one() -> None:
    body = leases.claim(_lease("other", renewed=NOW - 60, version=None), identity="me", now=NOW)
    assert body is not None
    assert "resourceVersion" not in body["metadata"]


def test_claim_writes_the_given_name_namespace_and_duration() -> None:
    body = leases.claim(None, identity="me", now=NOW, namespace="ns", name="l", duration_s=7)
    assert body is not None
    assert body["metadata"] == {"name": "l", "namespace": "ns"}
    assert body["spec"]["leaseDurationSeconds"] == 7
    assert leases.fresh(body, NOW + 6.9) and not leases.fresh(body, NOW + 7)


@given(
    holder=st.sampled_from(["me", "other", ""]),
    age=st.floats(min_value=-5, max_value=100, allow_nan=False),
    identity=st.sampled_from(["me", "other"]),
)
def test_claim_never_takes_a_lease_another_keeps_fresh(
    holder: str, age: float, identity: str
) -> None:
    lease = _lease(holder, renewed=NOW - age)
    body = leases.claim(lease, identity=identity, now=NOW)
    held_by_another = leases.fresh(lease, NOW) and holder != identity
    assert (body is None) is held_by_another
    if body is not None:
        assert leases.fresh(body, NOW)
        assert body["spec"]["holderIdentity"] == identity


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
