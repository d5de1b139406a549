"""The planner's GC pause: the collector is off inside, back as it was after, and entering it
costs no full collection (which walks the whole heap: 0.4-0.5 s per plan in the controller)."""

from __future__ import annotations

import gc

import pytest

from migpilot import gcpause


def test_the_collector_is_paused_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with gcpause.paused():
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # what was alive is out of the collector's sight
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_a_disabled_collector_stays_disabled() -> None:
    gc.disable()
    try:
        with gcpause.paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_entering_makes_no_full_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    def collect(*_: object) -> int:
        raise AssertionError("gcpause.paused() walked the whole heap")

    monkeypatch.setattr(gc, "collect", collect)
    with gcpause.paused():
        pass


def test_the_collector_is_restored_when_the_block_raises() -> None:
    with pytest.raises(RuntimeError), gcpause.paused():
        raise RuntimeError("plan failed")
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0
