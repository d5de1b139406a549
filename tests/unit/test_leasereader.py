"""The shells' one reader of the controller's Lease (migpilot.kube.leasereader): cached reads,
a Lease not found not fresh at once, any other failed read keeping the last one read."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from migpilot.kube import errors, leasereader

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z
RENEWED = "2027-01-15T08:00:00.000000Z"


def _lease() -> dict[str, Any]:
    return {"spec": {"holderIdentity": "c1", "leaseDurationSeconds": 15, "renewTime": RENEWED}}


class Source:
    def __init__(self) -> None:
        self.answer: dict[str, Any] | BaseException | None = _lease()
        self.reads = 0

    def read(self) -> dict[str, Any] | None:
        self.reads += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


def test_reads_at_most_every_cache_time_and_again_when_the_clock_goes_back() -> None:
    source, now = Source(), [T0 + 1]
    reader = leasereader.LeaseReader(source.read, cache_s=2.0, clock=lambda: now[0])
    assert reader.fresh() and reader.fresh() and source.reads == 1
    now[0] = T0 + 3
    assert reader.fresh() and source.reads == 2
    now[0] = T0 + 2
    assert reader.fresh() and source.reads == 3
    now[0] = T0 + 16  # renewTime + 15 s: stale, judged at each call
    assert not reader.fresh()


@pytest.mark.parametrize("gone", [None, errors.NotFoundError("Lease x/y not found")])
def test_a_lease_not_there_is_not_fresh_at_once(gone: BaseException | None) -> None:
    source, now = Source(), [T0 + 1]
    reader = leasereader.LeaseReader(source.read, cache_s=2.0, clock=lambda: now[0])
    assert reader.fresh()
    source.answer = gone
    now[0] = T0 + 4
    assert not reader.fresh()
    assert reader.current() == (None, T0 + 4)


def test_a_failed_read_keeps_the_last_lease_judged_by_its_renew_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    source, now = Source(), [T0 + 1]
    reader = leasereader.LeaseReader(source.read, cache_s=2.0, clock=lambda: now[0])
    assert reader.fresh()
    source.answer = errors.KubeApiError("timed out")
    with caplog.at_level(logging.INFO, logger="migpilot.kube.leasereader"):
        for t in (4, 7, 10):
            now[0] = T0 + t
            assert reader.fresh()  # a slow API server is no reason to flip the rule
        now[0] = T0 + 16
        assert not reader.fresh()  # a holder that stopped renewing goes stale on time
        source.answer = _lease()
        now[0] = T0 + 5
        assert reader.fresh()
    said = [r.getMessage() for r in caplog.records]
    assert len([m for m in said if "cannot read" in m]) == 1, said  # once per run of failures
    assert any("read again" in m for m in said)


def test_with_nothing_read_yet_a_failed_read_is_not_fresh() -> None:
    source = Source()
    source.answer = RuntimeError("connection refused")
    reader = leasereader.LeaseReader(source.read, cache_s=2.0, clock=lambda: T0 + 1)
    assert not reader.fresh()


def test_a_negative_cache_time_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="cache time"):
        leasereader.LeaseReader(Source().read, cache_s=-1.0)
