"""The control loop's pure rules (planning/control.py): batching, deciding, never runnable."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import pytest

from migpilot import errors
from migpilot.mig import catalog
from migpilot.planning import control, fast, options, plans, snapshot

A100 = catalog.resolve_gpu("a100-80gb")
SETTINGS = control.Settings(batch_window_s=0.25)


def _pod(name: str, *mig: tuple[str, int], selector: dict[str, str] | None = None) -> snapshot.Pod:
    return snapshot.Pod(
        name=name,
        namespace="default",
        priority=0,
        mig=tuple(snapshot.MigRequest(p, n) for p, n in mig),
        cpu_milli=1000,
        memory_bytes=1 << 30,
        node_selector=MappingProxyType(selector or {}),
        affinity=(),
        tolerations=(),
    )


def _node(name: str, gpus: int = 1, *, cpu: int = 64_000) -> snapshot.Node:
    return snapshot.Node(
        name=name,
        labels=MappingProxyType({"zone": "a"}),
        taints=(),
        unschedulable=False,
        allocatable=snapshot.Resources(cpu, 1 << 40),
        gpus=tuple(snapshot.Gpu(i, A100, ()) for i in range(gpus)),
    )


def _planner(snap: snapshot.Snapshot) -> plans.Plan:
    return fast.plan(snap, options.Options())


def test_a_change_with_pods_waiting_makes_a_plan_due_one_window_later() -> None:
    batch = control.changed(control.Batch(), now=10.0, waiting=True, settings=SETTINGS)
    assert batch == control.Batch(due=10.25, dirty=True)
    # Later changes inside the window do not push the plan back.
    again = control.changed(batch, now=10.2, waiting=True, settings=SETTINGS)
    assert again.due == 10.25


def test_a_change_with_nothing_waiting_makes_no_plan_due() -> None:
    batch = control.changed(control.Batch(), now=3.0, waiting=False, settings=SETTINGS)
    assert batch == control.Batch(due=None, dirty=True)


def test_decide_before_the_due_time_changes_nothing() -> None:
    snap = snapshot.Snapshot(nodes=(_node("n"),), pods=(_pod("p", ("1g.10gb", 1)),))
    batch = control.Batch(due=5.0, dirty=True)
    decision = control.decide(snap, batch, now=4.9, planner=_planner)
    assert decision == control.Planned(batch, None)


def test_decide_plans_once_per_change() -> None:
    snap = snapshot.Snapshot(nodes=(_node("n"),), pods=(_pod("p", ("1g.10gb", 1)),))
    first = control.decide(snap, control.Batch(due=1.0, dirty=True), now=1.0, planner=_planner)
    assert first.plan is not None and first.plan.placement_of("default/p") is not None
    assert first.batch == control.Batch()
    # Due again with nothing changed: no second plan for the same state.
    second = control.decide(snap, control.Batch(due=2.0, dirty=False), now=2.0, planner=_planner)
    assert second.plan is None and second.batch.due is None


def test_decide_without_pods_keeps_the_change_for_later() -> None:
    snap = snapshot.Snapshot(nodes=(_node("n"),), pods=())
    decision = control.decide(snap, control.Batch(due=1.0, dirty=True), now=1.0, planner=_planner)
    assert decision.plan is None
    assert decision.batch == control.Batch(due=None, dirty=True)


def test_settings_reject_a_negative_window() -> None:
    with pytest.raises(errors.MigpilotError, match="batch window"):
        control.Settings(batch_window_s=-1)


@pytest.mark.parametrize(
    ("names", "gpus", "fits"),
    [
        (("7g.80gb",), 1, True),
        (("7g.80gb", "1g.10gb"), 1, False),
        (("7g.80gb", "1g.10gb"), 2, True),
        (("3g.40gb", "3g.40gb"), 1, True),
        (("4g.40gb", "4g.40gb"), 1, False),
        (("1g.10gb",) * 7, 1, True),
        (("1g.10gb",) * 8, 1, False),
    ],
)
def test_fits_empty(names: tuple[str, ...], gpus: int, fits: bool) -> None:
    assert control.fits_empty(names, A100, gpus) is fits


def test_never_runs_names_why() -> None:
    nodes = (_node("n", gpus=1, cpu=2000),)
    assert control.never_runs(_pod("ok", ("3g.40gb", 2)), nodes) is None
    assert "advertises nvidia.com/mig-1g.5gb" in (
        control.never_runs(_pod("a", ("1g.5gb", 1)), nodes) or ""
    )
    assert "even empty" in (control.never_runs(_pod("b", ("7g.80gb", 2)), nodes) or "")
    assert "admits" in (
        control.never_runs(_pod("c", ("1g.10gb", 1), selector={"zone": "b"}), nodes) or ""
    )
    big = dataclasses.replace(_pod("d", ("1g.10gb", 1)), cpu_milli=9000)
    assert "CPU and memory" in (control.never_runs(big, nodes) or "")
    assert "no node" in (control.never_runs(_pod("e", ("1g.10gb", 1)), ()) or "")


# --------------------------------------------------------------------------- reconcile

STEP = control.Settings(batch_window_s=1.0, reservation_timeout_s=60.0)


def _reserved(pod: str, **kw: object) -> tuple[str, control.Reserved]:
    fields: dict[str, object] = {
        "node": "n",
        "gated": True,
        "made": True,
        "missing": None,
        "asks": (("nvidia.com/mig-1g.10gb", 1),),
    }
    fields.update(kw)
    return pod, control.Reserved(**fields)  # type: ignore[arg-type]


def _step(
    observed: control.Observed, memory: control.Memory | None = None, *, now: float
) -> control.Decision:
    return control.reconcile(
        observed, memory or control.Memory(), now=now, settings=STEP, planner=_planner
    )


def test_a_step_plans_only_once_the_window_is_over_and_judges_the_pods_left() -> None:
    pods = (
        _pod("fits", ("3g.40gb", 1)),
        _pod("too-big", ("7g.80gb", 1)),
        _pod("never", ("1g.6gb", 1)),
    )
    observed = control.Observed(snapshot.Snapshot(nodes=(_node("n"),), pods=pods))
    first = _step(observed, now=0.0)
    assert first.plan is None and first.memory.batch.due == 1.0 and first.wake_at == 1.0
    quiet = dataclasses.replace(observed, changed=False)
    assert _step(quiet, first.memory, now=0.5).plan is None
    second = _step(quiet, first.memory, now=1.0)
    assert second.plan is not None
    # One GPU: the 3g.40gb and the 7g.80gb cannot both run; the planner places one of them
    # (the larger, as its tie-break on compute placed has it), and the other waits.
    placed = [p.pod for p in second.plan.placements]
    assert len(placed) == 1 and placed[0] in {"default/fits", "default/too-big"}
    left = ({"default/fits", "default/too-big"} - set(placed)).pop()
    verdicts = {j.pod: (j.verdict, j.reason) for j in second.judged}
    assert verdicts["default/never"][0] is control.Verdict.REFUSE
    assert verdicts["default/never"][1].startswith("can never run: ")
    assert verdicts[left][0] is control.Verdict.WAIT
    assert second.memory.batch == control.Batch() and second.wake_at is None
    assert first.unfit == () and second.unfit == ()


def test_an_agent_listing_the_steered_target_makes_the_plan_due_at_once() -> None:
    """The pods were planned a window ago: the step that sees their node's agent list the
    target plans them again then (and lets them go), not a batch window later."""
    observed = control.Observed(
        snapshot.Snapshot(nodes=(_node("n"),), pods=(_pod("p", ("3g.40gb", 1)),))
    )
    waiting = _step(observed, now=0.0)
    assert waiting.plan is None and waiting.memory.batch.due == 1.0
    listed = _step(dataclasses.replace(observed, listing=True), waiting.memory, now=0.3)
    assert listed.plan is not None and [p.pod for p in listed.plan.placements] == ["default/p"]
    # With nothing waiting, a listing makes nothing due.
    empty = control.Observed(snapshot.Snapshot(nodes=(_node("n"),), pods=()), listing=True)
    assert _step(empty, now=0.0).memory.batch.due is None


def test_a_pod_pinned_to_its_node_waits_saying_so_and_a_static_node_lets_a_pod_go() -> None:
    pods = (_pod("p", ("7g.80gb", 1)), _pod("q", ("7g.80gb", 1)), _pod("s", ("7g.80gb", 1)))
    node = _node("n")
    full = dataclasses.replace(
        node,
        gpus=(snapshot.Gpu(0, A100, (snapshot.ExistingInstance("7g.80gb", 0, used=True),)),),
    )
    observed = control.Observed(
        snapshot.Snapshot(nodes=(full,), pods=pods),
        pending={
            "default/p": control.Pending(pinned="n"),
            "default/s": control.Pending(static="static-1"),
        },
    )
    decision = _step(observed, control.Memory(batch=control.Batch(due=0.0, dirty=True)), now=0.0)
    verdicts = {j.pod: (j.verdict, j.reason) for j in decision.judged}
    assert verdicts["default/p"][0] is control.Verdict.WAIT
    assert verdicts["default/p"][1].startswith("pinned to node n, where it can only run, once ")
    assert verdicts["default/q"][0] is control.Verdict.WAIT
    assert not verdicts["default/q"][1].startswith("pinned")
    assert verdicts["default/s"] == (control.Verdict.LET_GO, "node static-1 has free instances")


def test_unservable_pods_are_refused_and_stale_nodes_released_at_every_step() -> None:
    observed = control.Observed(
        snapshot.Snapshot(nodes=(_node("n"),), pods=()),
        unservable={"default/bad": "nvidia.com/mig-9g.99gb is not a MIG profile"},
        stale=frozenset({"n2", "n1"}),
    )
    decision = _step(observed, now=0.0)
    assert decision.refused == (
        control.Judged(
            "default/bad", control.Verdict.REFUSE, "nvidia.com/mig-9g.99gb is not a MIG profile"
        ),
    )
    assert decision.release == ("n1", "n2")


def _held(*reservations: tuple[str, control.Reserved], **kw: object) -> control.Observed:
    return control.Observed(
        snapshot.Snapshot(nodes=(_node("n"),), pods=()),
        reserved=dict(reservations),
        changed=False,
        **kw,  # type: ignore[arg-type]
    )


def test_a_reservation_expires_a_timeout_after_it_is_made_or_ten_before() -> None:
    made = _held(_reserved("p"), advertised={"n": {}})
    memory = _step(made, now=100.0).memory
    assert memory.made_since == {("p", "n"): 100.0}
    assert _step(made, memory, now=160.0).expired == ()  # a timeout exactly: not yet
    (expiry,) = _step(made, memory, now=160.5).expired
    assert expiry == control.Expiry(
        "p",
        "n",
        False,
        "its instances on node n were not usable in time (reservation timeout 60 s); planning "
        "again",
    )
    unmade = _held(_reserved("q", made=False, missing="an instance to be created"))
    memory = _step(unmade, now=100.0).memory
    assert memory.made_since == {}
    assert _step(unmade, memory, now=700.0).expired == ()
    assert [e.pod for e in _step(unmade, memory, now=700.5).expired] == ["q"]
    # The step says when to look again: the earliest expiry.
    assert _step(unmade, memory, now=200.0).wake_at == math.nextafter(700.0, math.inf)


def test_a_pod_pinned_there_keeps_its_reservation_unless_it_is_stolen() -> None:
    kept = _held(_reserved("p", gated=False, pinned_there=True))
    memory = _step(kept, now=0.0).memory
    assert _step(kept, memory, now=10_000.0).expired == ()
    assert _step(kept, memory, now=10_000.0).wake_at is None
    stolen = _held(_reserved("p", gated=False, pinned_there=True, stolen=True))
    (expiry,) = _step(stolen, memory, now=1.0).expired
    assert expiry.stolen and "taken by a pod bound there without migpilot" in expiry.message


def test_pods_are_let_go_in_key_order_while_the_node_advertises_room() -> None:
    observed = _held(
        _reserved("c"),
        _reserved("a"),
        _reserved("b", missing="1g.10gb at GPU 0 start 1 on n to be created"),
        _reserved("d"),
        _reserved("gone", stolen=True),
        advertised={"n": {"nvidia.com/mig-1g.10gb": 3}},
        taken={"n": {"nvidia.com/mig-1g.10gb": 1}},
    )
    memory = _step(observed, now=0.0).memory
    decision = _step(observed, memory, now=10.0)
    assert decision.pins == (("a", "n"), ("c", "n"))
    assert [e.pod for e in decision.expired] == ["gone"]
    assert decision.waits == (
        control.Waiting("b", "n", "1g.10gb at GPU 0 start 1 on n to be created"),
        control.Waiting(
            "d", "n", "node n to advertise nvidia.com/mig-1g.10gb (allocatable 3, taken 3)"
        ),
    )
    # Before the wait-log delay, the waits are not named.
    assert _step(observed, memory, now=1.0).waits == ()


def test_unified_pods_asking_differently_go_one_kind_at_a_time() -> None:
    one, other = ("ask", 8), ("ask", 40)
    observed = _held(
        _reserved("a", gated=False, unified=control.Interchange(one, allocating=True)),
        _reserved("b", unified=control.Interchange(one)),
        _reserved("c", unified=control.Interchange(other)),
        advertised={"n": {"nvidia.com/mig-1g.10gb": 8}},
    )
    listed = {k: why for k, _, why in control.lets_go(observed)}
    assert listed["b"] is None
    assert listed["c"] == "unified pod a, asking differently, to be allocated first"


def test_a_placement_on_a_node_without_the_cpu_is_left_out_of_the_plan() -> None:
    def greedy(snap: snapshot.Snapshot) -> plans.Plan:  # a planner that ignores CPU
        node = snap.nodes[0].name
        return plans.Plan(
            planner="greedy",
            gpus=(),
            actions=(),
            placements=tuple(plans.Placement(p.key, node, ()) for p in snap.pods),
            unschedulable=(),
        )

    pods = (_pod("a", ("1g.10gb", 1)), _pod("b", ("1g.10gb", 1)))
    observed = control.Observed(snapshot.Snapshot(nodes=(_node("n", cpu=1500),), pods=pods))
    decision = control.reconcile(
        observed,
        control.Memory(batch=control.Batch(due=0.0, dirty=True)),
        now=0.0,
        settings=STEP,
        planner=greedy,
    )
    assert decision.plan is not None
    assert [p.pod for p in decision.plan.placements] == ["default/a"]
    assert decision.unfit == ("default/b",)
    (judged,) = decision.judged
    assert judged.verdict is control.Verdict.WAIT
    assert judged.reason == (
        "the planner placed it on node n, which lacks the CPU or memory it asks for"
    )


def test_the_step_settings_refuse_a_timeout_that_is_not_a_finite_positive_number() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(errors.MigpilotError, match="reservation timeout"):
            control.Settings(reservation_timeout_s=bad)


def test_a_node_that_reports_nothing_yet_advertises_nothing() -> None:
    observed = _held(_reserved("p"), _reserved("q", node="elsewhere", asks=()))
    listed = {k: why for k, _, why in control.lets_go(observed)}
    assert listed == {
        "p": "node n to advertise nvidia.com/mig-1g.10gb (allocatable 0, taken 0)",
        "q": None,  # asks nothing of its node's counts: let go
    }


def test_the_cpu_check_counts_each_node_alone_and_exactly() -> None:
    def placing(snap: snapshot.Snapshot) -> plans.Plan:
        where = {"a": "n", "b": "n", "c": "n", "d": "open", "e": "open"}
        return plans.Plan(
            planner="placing",
            gpus=(),
            actions=(),
            placements=tuple(plans.Placement(p.key, where[p.name], ()) for p in snap.pods),
            unschedulable=(),
        )

    def pod(name: str, cpu: int, mem: int) -> snapshot.Pod:
        return dataclasses.replace(_pod(name, ("1g.10gb", 1)), cpu_milli=cpu, memory_bytes=mem)

    n = dataclasses.replace(_node("n"), allocatable=snapshot.Resources(3000, 3 << 30))
    open_ = dataclasses.replace(_node("open"), allocatable=None)
    pods = (
        pod("a", 1000, 1 << 30),
        pod("b", 1500, 3 << 30),  # its memory does not fit after a
        pod("c", 2000, 2 << 30),  # exactly what is left after a: fits
        pod("d", 10**9, 1 << 50),  # a node without a limit takes anything
        pod("e", 10**9, 1 << 50),
    )
    observed = control.Observed(snapshot.Snapshot(nodes=(n, open_), pods=pods))
    decision = control.reconcile(
        observed,
        control.Memory(batch=control.Batch(due=0.0, dirty=True)),
        now=0.0,
        settings=STEP,
        planner=placing,
    )
    assert decision.plan is not None
    assert [(p.pod, p.node) for p in decision.plan.placements] == [
        ("default/a", "n"),
        ("default/c", "n"),
        ("default/d", "open"),
        ("default/e", "open"),
    ]
    assert decision.unfit == ("default/b",)


# --------------------------------------------------------------------------- scaling out

SCALING = dataclasses.replace(STEP, scale_out_after_s=5.0)


def _full(name: str = "n") -> snapshot.Node:
    used = (snapshot.ExistingInstance("7g.80gb", 0, used=True),)
    return dataclasses.replace(_node(name), gpus=(snapshot.Gpu(0, A100, used),))


def _scale_step(
    observed: control.Observed, memory: control.Memory, *, now: float
) -> control.Decision:
    return control.reconcile(observed, memory, now=now, settings=SCALING, planner=_planner)


def test_without_the_setting_an_unplaced_pod_only_waits() -> None:
    observed = control.Observed(
        snapshot.Snapshot(nodes=(_full(),), pods=(_pod("p", ("1g.10gb", 1)),))
    )
    first = _step(observed, control.Memory(batch=control.Batch(due=0.0, dirty=True)), now=0.0)
    assert [j.verdict for j in first.judged] == [control.Verdict.WAIT]
    later = _step(dataclasses.replace(observed, changed=False), first.memory, now=1000.0)
    assert later.scale_out == () and later.memory.unplaced == {} and later.wake_at is None


def test_a_pod_left_unplaced_for_the_grace_is_let_go_for_a_node_autoscaler() -> None:
    pods = (
        _pod("p", ("1g.10gb", 1)),
        _pod("pinned", ("1g.10gb", 1)),
        _pod("static", ("1g.10gb", 1)),
        _pod("ungated", ("1g.10gb", 1)),
    )
    observed = control.Observed(
        snapshot.Snapshot(nodes=(_full(),), pods=pods),
        pending={
            "default/pinned": control.Pending(pinned="n"),
            "default/static": control.Pending(static="s1"),
            "default/ungated": control.Pending(gated=False),
        },
    )
    first = _scale_step(
        observed, control.Memory(batch=control.Batch(due=10.0, dirty=True)), now=10.0
    )
    assert {j.pod: j.verdict for j in first.judged} == {
        "default/p": control.Verdict.WAIT,
        "default/pinned": control.Verdict.WAIT,
        "default/static": control.Verdict.LET_GO,
        "default/ungated": control.Verdict.WAIT,
    }
    # Only the gated pod, pinned nowhere and with no static node, is counted; the step wakes
    # when its grace ends.
    assert set(first.memory.unplaced) == {"default/p"}
    assert first.scale_out == () and first.wake_at == 15.0
    quiet = dataclasses.replace(observed, changed=False)
    early = _scale_step(quiet, first.memory, now=14.9)
    assert early.scale_out == () and early.memory.unplaced == first.memory.unplaced
    due = _scale_step(quiet, early.memory, now=15.0)
    assert [(j.pod, j.verdict) for j in due.scale_out] == [("default/p", control.Verdict.SCALE_OUT)]
    reason = due.scale_out[0].reason
    assert reason.startswith("no node can hold it now (") and "for a node autoscaler" in reason
    assert due.memory.unplaced == {} and due.wake_at is None  # let go once, not again


def test_a_pod_a_later_plan_places_or_that_leaves_is_not_let_go() -> None:
    full = _full()
    p, q = _pod("p", ("1g.10gb", 1)), _pod("q", ("1g.10gb", 1))
    observed = control.Observed(snapshot.Snapshot(nodes=(full,), pods=(p, q)))
    first = _scale_step(observed, control.Memory(batch=control.Batch(due=0.0, dirty=True)), now=0.0)
    assert set(first.memory.unplaced) == {"default/p", "default/q"}
    # At 3 s the node's instance is freed and a plan places p; q was deleted meanwhile.
    freed = control.Observed(snapshot.Snapshot(nodes=(_node("n"),), pods=(p,)))
    memory = dataclasses.replace(first.memory, batch=control.Batch(due=3.0, dirty=True))
    placed = _scale_step(freed, memory, now=3.0)
    assert placed.plan is not None and [x.pod for x in placed.plan.placements] == ["default/p"]
    assert placed.memory.unplaced == {}
    assert (
        _scale_step(dataclasses.replace(freed, changed=False), placed.memory, now=9.0).scale_out
        == ()
    )


def test_the_grace_counts_from_the_first_plan_that_left_the_pod_unplaced() -> None:
    observed = control.Observed(
        snapshot.Snapshot(nodes=(_full(),), pods=(_pod("p", ("1g.10gb", 1)),))
    )
    first = _scale_step(observed, control.Memory(batch=control.Batch(due=0.0, dirty=True)), now=0.0)
    # Another plan at 3 s leaves it again: the count goes on from 0 s, with the new reason.
    again = _scale_step(
        observed,
        dataclasses.replace(first.memory, batch=control.Batch(due=3.0, dirty=True)),
        now=3.0,
    )
    assert again.memory.unplaced["default/p"].since == 0.0
    assert [
        j.pod
        for j in _scale_step(
            dataclasses.replace(observed, changed=False), again.memory, now=5.0
        ).scale_out
    ] == ["default/p"]


def test_the_step_settings_refuse_a_bad_scale_out_grace() -> None:
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(errors.MigpilotError, match="scale-out grace"):
            control.Settings(scale_out_after_s=bad)
    assert control.Settings(scale_out_after_s=0.0).scale_out_after_s == 0.0


def test_a_pod_its_node_turns_away_is_not_let_go_and_its_reservation_times_out() -> None:
    why = "taint karpenter.sh/disrupted=:NoSchedule is not tolerated"
    observed = _held(
        _reserved("a", turned_away=why),
        _reserved("b"),
        advertised={"n": {"nvidia.com/mig-1g.10gb": 2}},
    )
    memory = _step(observed, now=0.0).memory
    decision = _step(observed, memory, now=10.0)
    assert decision.pins == (("b", "n"),)  # a's instance does not count against b's room
    assert decision.waits == (control.Waiting("a", "n", f"node n to admit it again ({why})"),)
    assert decision.expired == ()
    alone = dataclasses.replace(observed, reserved={"a": observed.reserved["a"]})
    late = _step(alone, memory, now=60.5)  # b was bound meanwhile
    assert [(e.pod, e.stolen) for e in late.expired] == [("a", False)]


def test_a_counted_pod_pinned_or_let_go_since_is_dropped_without_a_plan() -> None:
    pod = _pod("p", ("1g.10gb", 1))
    observed = control.Observed(snapshot.Snapshot(nodes=(_full(),), pods=(pod,)))
    first = _scale_step(observed, control.Memory(batch=control.Batch(due=0.0, dirty=True)), now=0.0)
    assert set(first.memory.unplaced) == {"default/p"}
    for extra in (control.Pending(pinned="n"), control.Pending(gated=False)):
        later = dataclasses.replace(observed, changed=False, pending={"default/p": extra})
        step = _scale_step(later, first.memory, now=6.0)
        assert step.scale_out == () and step.memory.unplaced == {}


def test_a_plan_that_places_pods_never_counted_is_fine_and_the_reason_is_the_planners() -> None:
    fits, big = _pod("fits", ("1g.10gb", 1)), _pod("big", ("7g.80gb", 1))
    observed = control.Observed(snapshot.Snapshot(nodes=(_node("n"),), pods=(fits, big)))
    memory = control.Memory(batch=control.Batch(due=0.0, dirty=True))
    first = _scale_step(observed, memory, now=0.0)
    # One GPU holds the 1g.10gb or the 7g.80gb, not both: one is placed (the larger, by the
    # planner's tie-break on compute placed), the other counted.
    assert first.plan is not None
    (placed,) = [p.pod for p in first.plan.placements]
    (other,) = {"default/fits", "default/big"} - {placed}
    (waiting,) = first.judged
    assert set(first.memory.unplaced) == {other}
    assert first.memory.unplaced[other].reason == waiting.reason
    left = dataclasses.replace(observed, changed=False)
    (out,) = _scale_step(left, first.memory, now=5.0).scale_out
    assert f"({waiting.reason})" in out.reason


def test_a_counted_pod_a_later_plan_refuses_is_not_also_let_go_for_an_autoscaler() -> None:
    pod = _pod("p", ("1g.10gb", 1))
    observed = control.Observed(snapshot.Snapshot(nodes=(_full(),), pods=(pod,)))
    first = _scale_step(observed, control.Memory(batch=control.Batch(due=0.0, dirty=True)), now=0.0)
    # The GPU node is replaced by one without GPUs: the pod can never run any more.
    bare = dataclasses.replace(_node("n"), gpus=())
    gone = control.Observed(snapshot.Snapshot(nodes=(bare,), pods=(pod,)))
    memory = dataclasses.replace(first.memory, batch=control.Batch(due=6.0, dirty=True))
    step = _scale_step(gone, memory, now=6.0)
    assert [j.verdict for j in step.judged] == [control.Verdict.REFUSE]
    assert step.scale_out == () and step.memory.unplaced == {}


# --------------------------------------------------------------------------- avoiding a node


def _expire_on(node: str, *, stolen: bool = False) -> control.Memory:
    """The memory after ``default/p``'s reservation on ``node`` expired at 61 s (unused, or
    stolen)."""
    reserved = _held(_reserved("default/p", node=node, stolen=stolen), advertised={node: {}})
    memory = _step(reserved, now=0.0).memory
    expired = _step(reserved, memory, now=61.0)
    assert [(e.pod, e.node, e.stolen) for e in expired.expired] == [("default/p", node, stolen)]
    return expired.memory


def _plan_at(
    memory: control.Memory, *nodes: snapshot.Node, pods: tuple[snapshot.Pod, ...], now: float
) -> plans.Plan:
    """The plan of the first step at ``now`` with ``pods`` waiting on ``nodes``."""
    observed = control.Observed(snapshot.Snapshot(nodes=nodes, pods=pods))
    due = dataclasses.replace(memory, batch=control.Batch(due=now, dirty=True))
    plan = _step(observed, due, now=now).plan
    assert plan is not None
    return plan


def _where(plan: plans.Plan, pod: str = "default/p") -> str | None:
    placement = plan.placement_of(pod)
    return placement.node if placement is not None else None


def test_after_its_reservation_on_a_node_expired_a_pod_is_planned_elsewhere() -> None:
    a, b = _node("a"), _node("b")
    p = _pod("p", ("3g.40gb", 1))
    # Without the expiry the planner puts it on a (the first of two alike nodes).
    assert _where(_plan_at(control.Memory(), a, b, pods=(p,), now=62.0)) == "a"
    memory = _expire_on("a")
    assert memory.avoid == {("default/p", "a"): 361.0}  # 300 s after the expiry
    assert _where(_plan_at(memory, a, b, pods=(p,), now=62.0)) == "b"
    # Other pods are planned as before.
    q = _pod("q", ("3g.40gb", 1))
    assert _where(_plan_at(memory, a, b, pods=(q,), now=62.0), "default/q") == "a"
    # Once the time is over the node is planned again, and forgotten.
    later = _step(control.Observed(snapshot.Snapshot(nodes=(a, b), pods=())), memory, now=361.0)
    assert later.memory.avoid == {}
    assert _where(_plan_at(memory, a, b, pods=(p,), now=361.0)) == "a"


def test_a_pod_only_the_avoided_node_can_hold_stays_there() -> None:
    a, b = _node("a"), _full("b")  # b's only GPU is used
    p = _pod("p", ("3g.40gb", 1))
    assert _where(_plan_at(_expire_on("a"), a, b, pods=(p,), now=62.0)) == "a"
    # Nor does a node selector that admits only a make it wait.
    other = dataclasses.replace(_node("b"), labels=MappingProxyType({"zone": "b"}))
    only_a = _pod("p", ("3g.40gb", 1), selector={"zone": "a"})
    assert _where(_plan_at(_expire_on("a"), a, other, pods=(only_a,), now=62.0)) == "a"


def test_keeping_a_pod_off_its_avoided_node_never_makes_another_wait() -> None:
    # b might hold p, but q (which only b admits) needs b's one GPU: the plan keeping p off a
    # leaves q unplaced, so the plan with a is taken.
    a = _node("a")
    b = dataclasses.replace(_node("b"), labels=MappingProxyType({"zone": "b"}))
    p = _pod("p", ("7g.80gb", 1))
    q = _pod("q", ("7g.80gb", 1), selector={"zone": "b"})
    plan = _plan_at(_expire_on("a"), a, b, pods=(p, q), now=62.0)
    assert (_where(plan), _where(plan, "default/q")) == ("a", "b")


def test_a_stolen_reservation_does_not_make_its_node_avoided() -> None:
    memory = _expire_on("a", stolen=True)
    assert memory.avoid == {}
    p = _pod("p", ("3g.40gb", 1))
    assert _where(_plan_at(memory, _node("a"), _node("b"), pods=(p,), now=62.0)) == "a"


def test_avoiding_can_be_turned_off_and_refuses_a_bad_time() -> None:
    off = control.Settings(batch_window_s=1.0, avoid_after_expiry_s=0.0)
    reserved = _held(_reserved("default/p", node="a"), advertised={"a": {}})
    memory = control.reconcile(
        reserved, control.Memory(), now=0.0, settings=off, planner=_planner
    ).memory
    step = control.reconcile(reserved, memory, now=61.0, settings=off, planner=_planner)
    assert [e.pod for e in step.expired] == ["default/p"] and step.memory.avoid == {}
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(errors.MigpilotError, match="avoided after a reservation expired"):
            control.Settings(avoid_after_expiry_s=bad)


def test_keeping_a_pod_off_nodes_adds_to_each_term_of_its_affinity() -> None:
    seen: list[snapshot.Pod] = []

    def planner(snap: snapshot.Snapshot) -> plans.Plan:
        seen.extend(snap.pods)
        return _planner(snap)

    zone = snapshot.Requirement("zone", "In", ("a",))
    p = dataclasses.replace(_pod("p", ("1g.10gb", 1)), affinity=((zone,), ()))
    nodes = (_node("a"), _node("b"), _node("c"))
    plan = control.avoiding(planner, {"default/p": frozenset({"b", "a"})})(
        snapshot.Snapshot(nodes=nodes, pods=(p,))
    )
    away = snapshot.Requirement("metadata.name", "NotIn", ("a", "b"), field=True)
    # Planned kept off a and b (an empty term still matches no node), then as it is.
    assert [s.affinity for s in seen] == [((zone, away), ()), ((zone,), ())]
    assert _where(plan) == "c"


# --------------------------------------------------------------------------- ageing

DAY = 86_400.0


def _with_free_7g(name: str = "n") -> snapshot.Node:
    """A node whose one A100 holds a free 7g.80gb instance (a whole-GPU pod just left it)."""
    return dataclasses.replace(
        _node(name),
        gpus=(snapshot.Gpu(0, A100, (snapshot.ExistingInstance("7g.80gb", 0, used=False),)),),
    )


def _aged_plan(settings: control.Settings, *, now: float) -> plans.Plan:
    """``old`` (4g.40gb) has waited since 0 while the node was full; at ``now`` its one GPU is
    free with a 7g.80gb instance, and ``new`` (7g.80gb, which reuses it) has just come."""
    old, new = _pod("old", ("4g.40gb", 1)), _pod("new", ("7g.80gb", 1))
    waiting = control.Observed(snapshot.Snapshot(nodes=(_full(),), pods=(old,)))
    memory = control.reconcile(
        waiting, control.Memory(), now=0.0, settings=settings, planner=_planner
    ).memory
    assert memory.waiting_since == {"default/old": 0.0}
    freed = control.Observed(snapshot.Snapshot(nodes=(_with_free_7g(),), pods=(old, new)))
    due = dataclasses.replace(memory, batch=control.Batch(due=now, dirty=True))
    step = control.reconcile(freed, due, now=now, settings=settings, planner=_planner)
    assert step.memory.waiting_since == {"default/old": 0.0, "default/new": now}
    assert step.plan is not None
    return step.plan


def test_a_pod_waiting_long_enough_gets_the_room_a_newer_pod_would_reuse() -> None:
    # The planner alone gives the free 7g.80gb to the new pod (no instance destroyed), as it
    # would to every whole-GPU pod that comes while one leaves: the old 4g.40gb pod starved.
    assert _where(_aged_plan(STEP, now=DAY), "default/old") == "n"
    assert _where(_aged_plan(STEP, now=DAY), "default/new") is None


def test_before_its_age_or_with_ageing_off_the_planner_chooses() -> None:
    young = _aged_plan(STEP, now=STEP.age_after_s - 1 if STEP.age_after_s else 0.0)
    assert (_where(young, "default/new"), _where(young, "default/old")) == ("n", None)
    off = dataclasses.replace(STEP, age_after_s=None)
    plan = _aged_plan(off, now=DAY)
    assert (_where(plan, "default/new"), _where(plan, "default/old")) == ("n", None)


def test_an_aged_pod_outranks_only_where_room_can_be_made_for_it() -> None:
    settings = dataclasses.replace(STEP, age_after_s=100.0)
    two = dataclasses.replace(
        _node("n", gpus=2),
        gpus=(
            snapshot.Gpu(0, A100, (snapshot.ExistingInstance("7g.80gb", 0, used=True),)),
            snapshot.Gpu(1, A100, (snapshot.ExistingInstance("7g.80gb", 0, used=False),)),
        ),
    )
    big, small = _pod("big", ("7g.80gb", 2)), _pod("small", ("4g.40gb", 1))
    snap = snapshot.Snapshot(nodes=(two,), pods=(big, small))
    # big (two whole GPUs) cannot be placed now whatever its rank: no level of its own.
    assert control.age_ranks(snap, {"default/big": 0.0}, now=1000.0, settings=settings) == {}
    # Once small is aged too, it outranks (and big, older, keeps its priority).
    since = {"default/big": 0.0, "default/small": 500.0}
    ranks = control.age_ranks(snap, since, now=1000.0, settings=settings)
    assert ranks == {"default/big": 0, "default/small": 1}


def test_the_oldest_aged_pods_come_first_and_a_higher_priority_still_outranks_them() -> None:
    settings = dataclasses.replace(STEP, age_after_s=100.0)
    older, old = _pod("older", ("4g.40gb", 1)), _pod("old", ("7g.80gb", 1))
    urgent = dataclasses.replace(_pod("urgent", ("7g.80gb", 1)), priority=10)
    snap = snapshot.Snapshot(nodes=(_with_free_7g(),), pods=(old, older, urgent))
    # Room for one: the pod that waited longest (four times the age, the other two) outranks.
    since = {"default/older": 0.0, "default/old": 200.0, "default/urgent": 399.0}
    ranks = control.age_ranks(snap, since, now=400.0, settings=settings)
    assert ranks == {"default/old": 0, "default/older": 1, "default/urgent": 2}
    plan = control.ageing(_planner, since, now=400.0, settings=settings)(snap)
    assert [p.pod for p in plan.placements] == ["default/urgent"]


def test_a_reserved_pod_keeps_its_age_and_a_pod_gone_is_forgotten() -> None:
    memory = control.Memory(waiting_since={"default/p": 5.0, "default/gone": 1.0})
    observed = _held(_reserved("default/p"), advertised={"n": {}})
    step = control.reconcile(observed, memory, now=50.0, settings=STEP, planner=_planner)
    assert step.memory.waiting_since == {"default/p": 5.0}


def test_the_step_settings_refuse_a_bad_age() -> None:
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(errors.MigpilotError, match="outranks newer ones"):
            control.Settings(age_after_s=bad)


def test_of_aged_pods_asking_alike_only_the_oldest_outranks() -> None:
    settings = dataclasses.replace(STEP, age_after_s=100.0)
    first, second = _pod("first", ("4g.40gb", 1)), _pod("second", ("4g.40gb", 1))
    snap = snapshot.Snapshot(nodes=(_node("n", gpus=2),), pods=(second, first))
    since = {"default/first": 0.0, "default/second": 10.0}
    ranks = control.age_ranks(snap, since, now=1000.0, settings=settings)
    assert ranks == {"default/first": 1, "default/second": 0}
