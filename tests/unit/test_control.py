"""The control loop's pure rules (planning/control.py): batching, deciding, never runnable."""

from __future__ import annotations

import dataclasses
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
