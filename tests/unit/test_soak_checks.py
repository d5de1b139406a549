"""The soak bench's invariant checkers (``bench/soak_checks.py``) on hand-made event sequences:
each passes a sequence that keeps its invariant and fails one that breaks it."""

from __future__ import annotations

import json

import pytest
from bench import soak_checks as c

MIG = c.Ask("mig", profile="3g.40gb")
HAMI = c.Ask("hami", gpumem_mib=8000)
MPS = c.Ask("mps", gb=20)


def _gpu(*instances: c.InstanceView, model: str = "h100-80gb", uuid: str = "GPU-0") -> c.GpuView:
    return c.GpuView(0, model, uuid, True, instances)


def _view(node: str, *gpus: c.GpuView, mode: str = "mig") -> c.NodeView:
    return c.NodeView(node, mode, gpus)


def _inst(profile: str, start: int, uuid: str, state: str) -> c.InstanceView:
    return c.InstanceView(profile, start, uuid, state)


FULL = _view("n", _gpu(_inst("7g.80gb", 0, "MIG-a", "used")))
EMPTY = _view("n", _gpu())


# --- could_serve ---------------------------------------------------------------------------------


def test_could_serve_a_mig_ask_from_a_free_instance_or_room_beside_the_kept_ones() -> None:
    assert c.could_serve(MIG, EMPTY)
    assert not c.could_serve(MIG, FULL)
    # A free 7g.80gb is in the way but may be destroyed.
    assert c.could_serve(MIG, _view("n", _gpu(_inst("7g.80gb", 0, "MIG-a", "free"))))
    # Used 4g.40gb at 0: a 3g.40gb fits at 4; a reserved 3g.40gb there leaves no room.
    half = _inst("4g.40gb", 0, "MIG-a", "used")
    assert c.could_serve(MIG, _view("n", _gpu(half)))
    assert not c.could_serve(MIG, _view("n", _gpu(half, _inst("3g.40gb", 4, "MIG-b", "reserved"))))


def test_could_serve_hami_and_mps_asks_by_node_mode() -> None:
    assert c.could_serve(HAMI, EMPTY)
    assert not c.could_serve(HAMI, FULL)
    assert not c.could_serve(MPS, EMPTY)  # a MIG node serves no MPS slice
    mps_gpu = c.GpuView(0, "a100-80gb", "GPU-m", False, (), (c.SliceView(0, 70, "used"),))
    assert c.could_serve(c.Ask("mps", gb=10), _view("m", mps_gpu, mode="mps"))
    assert not c.could_serve(MPS, _view("m", mps_gpu, mode="mps"))
    assert not c.could_serve(c.Ask("hami", gpumem_mib=16000), _view("m", mps_gpu, mode="mps"))
    ts = c.GpuView(0, "h100-80gb", "GPU-t", False, (), (), (c.SliceView(0, 0, "used"),))
    assert not c.could_serve(HAMI, _view("t", ts, mode="time-slicing"))
    free = c.GpuView(0, "h100-80gb", "GPU-t", False, (), (), (c.SliceView(1, 0, "free"),))
    assert c.could_serve(HAMI, _view("t", free, mode="time-slicing"))
    assert not c.could_serve(MIG, _view("t", free, mode="time-slicing"))


def test_an_ask_needs_its_amount() -> None:
    with pytest.raises(ValueError, match="needs its amount"):
        c.Ask("mig")
    with pytest.raises(ValueError, match="unknown ask kind"):
        c.Ask("gpu", profile="x")


# --- used or reserved instances destroyed -----------------------------------------------------


def test_destroying_a_held_instance_is_a_violation_until_its_pod_is_deleted() -> None:
    held = [
        c.Assigned(1.0, "n", "ns/a", ("MIG-a",)),
        c.Destroyed(2.0, "n", 0, "7g.80gb", 0, "MIG-a"),
    ]
    [v] = c.used_destroyed(held)
    assert v.invariant == "used-destroyed" and "ns/a" in v.detail
    after_delete = [held[0], c.PodDeleted(1.5, "ns/a"), held[1]]
    assert c.used_destroyed(after_delete) == []
    released = [held[0], c.Released(1.5, "n", "ns/a"), held[1]]
    assert c.used_destroyed(released) == []


def test_destroying_what_the_last_status_reported_used_or_reserved_is_a_violation() -> None:
    def seen(t: float, state: str) -> c.LayoutSeen:
        return c.LayoutSeen(
            t, "n", frozenset(), _view("n", _gpu(_inst("3g.40gb", 4, "MIG-b", state)))
        )

    destroy = c.Destroyed(3.0, "n", 0, "3g.40gb", 4, "MIG-b")
    assert c.used_destroyed([seen(1.0, "reserved"), seen(2.0, "free"), destroy]) == []
    # The status written before the destroy may be seen after it: order, not time, decides.
    assert c.used_destroyed([seen(1.0, "reserved"), destroy, seen(3.5, "free")]) == []
    [v] = c.used_destroyed([seen(1.0, "free"), seen(2.0, "reserved"), destroy])
    assert "said reserved" in v.detail


def test_an_mps_slice_gone_while_held_is_a_violation() -> None:
    def seen(t: float, *slices: c.SliceView) -> c.LayoutSeen:
        gpu = c.GpuView(0, "a100-80gb", "GPU-m", False, (), slices)
        return c.LayoutSeen(t, "m", frozenset(), _view("m", gpu, mode="mps"))

    hold = c.Assigned(1.0, "m", "ns/s", ("GPU-m::mps-0",))
    events = [seen(0.5, c.SliceView(0, 20, "reserved")), hold, seen(2.0)]
    [v] = c.used_destroyed(events)
    assert "GPU-m::mps-0" in v.detail
    resized = [seen(0.5, c.SliceView(0, 20, "used")), hold, seen(2.0, c.SliceView(0, 10, "used"))]
    assert len(c.used_destroyed(resized)) == 1
    assert c.used_destroyed([*events[:2], c.PodDeleted(1.5, "ns/s"), seen(2.0)]) == []


# --- a device held by two pods ----------------------------------------------------------------


def test_a_device_given_to_a_second_live_pod_is_a_violation() -> None:
    first = c.Assigned(1.0, "n", "ns/a", ("MIG-a",))
    second = c.Assigned(2.0, "n", "ns/b", ("MIG-a",))
    [v] = c.double_held([first, second])
    assert v.invariant == "double-held" and "ns/a" in v.detail and "ns/b" in v.detail
    assert c.double_held([first, c.PodDeleted(1.5, "ns/a"), second]) == []
    assert c.double_held([first, c.Released(1.5, "n", "ns/a"), second]) == []
    # The same pod given its device again (an agent restart) is no second holder.
    assert c.double_held([first, c.Assigned(3.0, "n", "ns/a", ("MIG-a",))]) == []
    # Two pods swapping devices in one pass (what a restarted stand-in without its checkpoint
    # did) is a violation however close the lines are: a pod is handed a device another live
    # pod still holds.
    swap = [
        c.Assigned(1.0, "n", "ns/a", ("MIG-a",)),
        c.Assigned(1.0, "n", "ns/b", ("MIG-b",)),
        c.Assigned(5.0, "n", "ns/a", ("MIG-b",)),
        c.Assigned(5.001, "n", "ns/b", ("MIG-a",)),
    ]
    [v] = c.double_held(swap)
    assert "MIG-b given to ns/a while ns/b" in v.detail
    # "now holds" replaces what a pod held.
    moved = c.Assigned(1.5, "n", "ns/a", ("MIG-z",))
    assert c.double_held([first, moved, second]) == []


# --- Running within the bound; gated while servable -------------------------------------------


def _pending_pod(*, running_at: float | None, gated_until: float | None) -> list[c.Event]:
    events: list[c.Event] = [
        c.PodCreated(0.0, "ns/p", MIG),
        c.PodSeen(0.1, "ns/p", None, False, True),
        c.LayoutSeen(0.2, "n", frozenset(), FULL),
        c.LayoutSeen(10.0, "n", frozenset(), EMPTY),  # capacity from t=10
    ]
    if gated_until is not None:
        events.append(c.PodSeen(gated_until, "ns/p", None, False, False))
    if running_at is not None:
        events.append(c.PodSeen(running_at, "ns/p", "n", True, False))
    return events


def test_a_pod_running_within_the_bound_after_capacity_exists_passes() -> None:
    events = _pending_pod(running_at=50.0, gated_until=45.0)
    assert c.slow_pods(events, [], bound_s=60.0, end=200.0) == []
    assert c.gated_while_servable(events, [], bound_s=60.0, end=200.0) == []


def test_a_pod_not_running_long_after_capacity_exists_is_a_violation() -> None:
    events = _pending_pod(running_at=100.0, gated_until=80.0)
    [v] = c.slow_pods(events, [], bound_s=60.0, end=200.0)
    assert v.invariant == "not-running-in-bound" and "t=10.0" in v.detail
    [g] = c.gated_while_servable(events, [], bound_s=60.0, end=200.0)
    assert g.invariant == "gated-while-servable"
    # Still waiting at the end counts too.
    [v] = c.slow_pods(_pending_pod(running_at=None, gated_until=None), [], bound_s=60, end=80)
    assert "70.0 s later" in v.detail


def test_fault_windows_restart_the_clock() -> None:
    events = _pending_pod(running_at=100.0, gated_until=80.0)
    window = [c.Fault(30.0, 55.0, "kill-controller c1")]
    assert c.slow_pods(events, window, bound_s=60.0, end=200.0) == []
    assert c.gated_while_servable(events, window, bound_s=60.0, end=200.0) == []


def test_no_capacity_means_no_violation_however_long_the_wait() -> None:
    events: list[c.Event] = [
        c.PodCreated(0.0, "ns/p", MIG),
        c.LayoutSeen(0.2, "n", frozenset(), FULL),
        c.PodSeen(500.0, "ns/p", "n", True, False),
    ]
    assert c.slow_pods(events, [], bound_s=60.0, end=600.0) == []


def test_a_deleted_pod_no_longer_waits() -> None:
    events = [*_pending_pod(running_at=None, gated_until=None), c.PodDeleted(20.0, "ns/p")]
    assert c.slow_pods(events, [], bound_s=60.0, end=200.0) == []


# --- reservations outliving their pods --------------------------------------------------------


def test_a_reservation_kept_past_the_grace_after_its_pod_went_is_a_violation() -> None:
    def reserving(t: float, *pods: str) -> c.LayoutSeen:
        return c.LayoutSeen(t, "n", frozenset(pods), EMPTY)

    made = c.PodCreated(0.0, "ns/p", MIG)
    gone = c.PodDeleted(10.0, "ns/p")
    ok = [made, reserving(5.0, "ns/p"), gone, reserving(30.0, "ns/p"), reserving(40.0)]
    assert c.stale_reservations(ok, [], grace_s=60.0) == []
    late = [made, reserving(5.0, "ns/p"), gone, reserving(80.0, "ns/p")]
    [v] = c.stale_reservations(late, [], grace_s=60.0)
    assert v.invariant == "stale-reservation" and "70.0 s after" in v.detail
    # Time inside a fault window is not counted.
    assert c.stale_reservations(late, [c.Fault(20.0, 40.0, "restart-apiserver")], grace_s=60) == []
    [v] = c.stale_reservations([reserving(1.0, "ns/ghost")], [], grace_s=60.0)
    assert "never made" in v.detail


# --- the end: status against the agent's view -------------------------------------------------


def test_the_final_status_must_match_the_gpus_and_the_holds() -> None:
    status = {"n": _view("n", _gpu(_inst("3g.40gb", 4, "MIG-b", "used")))}
    actual = {"n": {0: frozenset({("3g.40gb", 4, "MIG-b")})}}
    held = {"n": frozenset({"MIG-b"})}
    assert c.final_mismatch(status, actual, held, t=1.0) == []
    [v] = c.final_mismatch(status, {"n": {0: frozenset()}}, held, t=1.0)
    assert "status shows" in v.detail
    [v] = c.final_mismatch(status, actual, {}, t=1.0)
    assert "MIG-b" in v.detail
    [v] = c.final_mismatch({}, actual, held, t=1.0)
    assert "no GpuLayout status" in v.detail


def test_held_at_end_keeps_only_live_pods() -> None:
    events: list[c.Event] = [
        c.Assigned(1.0, "n", "ns/a", ("MIG-a",)),
        c.Assigned(1.0, "n", "ns/b", ("MIG-b",)),
        c.PodDeleted(2.0, "ns/b"),
    ]
    assert c.held_at_end(events, end=3.0) == {"n": frozenset({"MIG-a"})}


# --- the agents' log lines ---------------------------------------------------------------------


def _line(message: str, **extra: str) -> str:
    return json.dumps({"time": "2026-01-01T00:00:01.500Z", "level": "INFO", "message": message}
                      | extra)  # fmt: skip


def test_agent_log_lines_become_events() -> None:
    got = c.agent_event(_line("Node n: pod ns/a gets MIG-1, MIG-2 (simulated Allocate)"))
    assert got == c.Assigned(1767225601.5, "n", "ns/a", ("MIG-1", "MIG-2"))
    assert c.agent_event(_line("Node n: pod ns/a now holds nothing")) == c.Assigned(
        1767225601.5, "n", "ns/a", ()
    )
    assert c.agent_event(_line("Node n: pod ns/a released MIG-1")) == c.Released(
        1767225601.5, "n", "ns/a"
    )
    destroyed = c.agent_event(_line("GPU 1: destroy 3g.40gb@4 (MIG-x)", node="n"))
    assert destroyed == c.Destroyed(1767225601.5, "n", 1, "3g.40gb", 4, "MIG-x")
    assert c.agent_event(_line("GPU 1: create 3g.40gb@4", node="n")) is None
    assert c.agent_event("Traceback (most recent call last):") is None
    assert c.agent_event(_line("Node n: pod ns/a gets no device yet: ... retried")) is None


def test_a_destroy_while_the_podresources_socket_is_away_is_a_violation() -> None:
    outage = c.Outage(10.0, 80.0, "n")
    during = c.Destroyed(50.0, "n", 0, "1g.10gb", 3, "MIG-x")
    [v] = c.destroyed_without_podresources([during], [outage])
    assert v.invariant == "destroyed-without-podresources" and "MIG-x" in v.detail
    # Before or after the outage, or on another node, a destroy is the other checks' business.
    others = [
        c.Destroyed(9.0, "n", 0, "1g.10gb", 3, "MIG-x"),
        c.Destroyed(81.0, "n", 0, "1g.10gb", 3, "MIG-x"),
        c.Destroyed(50.0, "m", 0, "1g.10gb", 3, "MIG-y"),
    ]
    assert c.destroyed_without_podresources(others, [outage]) == []


def test_devices_handed_out_and_given_up_unseen_during_an_outage_are_excused_for_the_grace() -> (
    None
):
    outage = c.Outage(100.0, 160.0, "n")
    events: list[c.Event] = [
        c.Assigned(95.0, "n", "ns/a", ("MIG-a",)),  # just before: the agent may not have listed it
        c.Assigned(120.0, "n", "ns/b", ("MIG-b",)),
        c.Assigned(130.0, "n", "ns/c", ("MIG-c",)),  # outlives the outage: PodResources lists it
        c.Assigned(80.0, "n", "ns/d", ("MIG-d",)),  # listed before the outage
        c.Assigned(120.0, "m", "ns/e", ("MIG-e",)),  # another node
        c.Released(140.0, "n", "ns/a"),
        c.Released(150.0, "n", "ns/b"),
        c.Released(200.0, "n", "ns/c"),
        c.Released(110.0, "n", "ns/d"),
        c.Released(135.0, "m", "ns/e"),
        c.Assigned(250.0, "m", "ns/f", ("MIG-f",)),  # gone before a pass could list it
        c.Released(255.0, "m", "ns/f"),
        c.Assigned(250.0, "m", "ns/g", ("MIG-g",)),  # listed
        c.Released(270.0, "m", "ns/g"),
    ]
    kw = {"grace_s": 300.0, "margin_s": 10.0}
    assert c.unlisted_holds(events, [outage], end=300.0, **kw) == {
        "n": frozenset({"MIG-a", "MIG-b"}),
        "m": frozenset({"MIG-f"}),
    }
    # Past the grace the ledger lets them go: no excuse left.
    assert c.unlisted_holds(events, [outage], end=400.0, **kw) == {
        "n": frozenset({"MIG-b"}),
        "m": frozenset({"MIG-f"}),
    }
    status = c.NodeView("n", "mig", (c.GpuView(0, "h100-80gb", "GPU-0", True, (
        c.InstanceView("1g.10gb", 0, "MIG-a", "used"),
        c.InstanceView("1g.10gb", 1, "MIG-b", "used"),
        c.InstanceView("1g.10gb", 2, "MIG-c", "used"),
    )),))  # fmt: skip
    actual = {"n": {0: frozenset({("1g.10gb", 0, "MIG-a"), ("1g.10gb", 1, "MIG-b"),
                                  ("1g.10gb", 2, "MIG-c")})}}  # fmt: skip
    excused = {"n": frozenset({"MIG-a", "MIG-b"})}
    [v] = c.final_mismatch({"n": status}, actual, {}, t=1.0, excused=excused)
    assert "['MIG-c'] that no pod holds" in v.detail
    assert c.final_mismatch({"n": status}, actual, {"n": frozenset({"MIG-c"})}, t=1.0,
                            excused=excused) == []  # fmt: skip


def test_a_spec_the_agent_cannot_apply_is_a_violation_once_per_node_and_reason() -> None:
    """The soak's MPS node: its agent refused the spec over its GPU every pass for 25 minutes."""
    why = "spec.gpus[0].mps: slices of 90 GB exceed the 80 GB of a a100-80gb"

    def line(t: str, message: str) -> str:
        record = {"time": t, "level": "WARNING", "message": message, "node": "soak-mps"}
        return json.dumps(record)

    refused = f"GpuLayout soak-mps cannot be applied, keeping the last good: {why}"
    lines = [
        line("2026-11-28T02:31:38.912Z", refused),
        line("2026-11-28T02:31:44.000Z", refused),
        line("2026-11-28T02:31:45.000Z", "GpuLayout soak-mps: status written (InvalidSpec)"),
        "Traceback (most recent call last):",
    ]
    (v,) = c.refused_specs(lines)
    assert v.invariant == "spec-not-appliable"
    assert "soak-mps" in v.detail and why in v.detail
    assert v.t == pytest.approx(c.refused_specs(lines[:1])[0].t)
    assert c.refused_specs(lines[2:]) == []
