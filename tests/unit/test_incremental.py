"""Incremental planning in the control loop (planning/incremental.py through control.reconcile):
a pass for new pods places them as a full replan would, or better; each trigger of a full replan.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.mig import catalog
from migpilot.planning import (
    control,
    fast,
    generate,
    incremental,
    interpod,
    modes,
    objective,
    options,
    plans,
    snapshot,
    validation,
)

A100 = catalog.resolve_gpu("a100-80gb")
SETTINGS = control.Settings(batch_window_s=0.0)


def _planner(snap: snapshot.Snapshot) -> plans.Plan:
    return fast.plan(snap, options.Options())


def _counting(calls: list[snapshot.Snapshot]) -> control.Planner:
    def run(snap: snapshot.Snapshot) -> plans.Plan:
        calls.append(snap)
        return _planner(snap)

    return run


def _step(
    snap: snapshot.Snapshot,
    memory: control.Memory,
    *,
    now: float,
    settings: control.Settings = SETTINGS,
    planner: control.Planner = _planner,
) -> control.Decision:
    return control.reconcile(
        control.Observed(snapshot=snap), memory, now=now, settings=settings, planner=planner
    )


def _standing(
    seed: int, *, nodes: int, gpus: int, fill: int
) -> tuple[snapshot.Snapshot, control.Memory]:
    """A cluster filled by a plan, its leftovers pending; then the loop's full replan of them,
    carried out: the state a new pod arrives in, and the loop's memory."""
    snap = generate.random_snapshot(
        seed=seed, nodes=nodes, gpus_per_node=gpus, pods=fill, used_fraction=0.8
    )
    snap = incremental.carried_out(snap, _planner(snap))
    decision = _step(snap, control.Memory(), now=0.0)
    if decision.plan is None:  # nothing left over: the loop remembers no backlog yet
        return snap, decision.memory
    assert decision.full is not None
    return incremental.carried_out(snap, decision.plan), decision.memory


def _new(seed: int, count: int, *, nodes: int, gpus: int) -> tuple[snapshot.Pod, ...]:
    pods = generate.random_snapshot(
        seed=seed + 7777, nodes=nodes, gpus_per_node=gpus, pods=count
    ).pods
    return tuple(dataclasses.replace(p, name=f"new-{p.name}") for p in pods)


@settings(max_examples=30)
@given(
    seed=st.integers(0, 10_000),
    nodes=st.integers(1, 5),
    gpus=st.integers(1, 3),
    fill=st.integers(1, 30),
    new=st.integers(1, 6),
    per_pod=st.integers(1, 3),
)
def test_an_incremental_pass_places_the_new_pods_as_a_full_replan_would_or_better(  # noqa: PLR0917
    seed: int, nodes: int, gpus: int, fill: int, new: int, per_pod: int
) -> None:
    snap, memory = _standing(seed, nodes=nodes, gpus=gpus, fill=fill)
    fresh = _new(seed, new, nodes=nodes, gpus=gpus)
    now = dataclasses.replace(snap, pods=(*snap.pods, *fresh))
    keys = {p.key for p in fresh}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(incremental, "PER_POD_NODES", per_pod)  # make the node cap bind
        inc = _step(now, memory, now=1.0)
    full = _step(now, memory, now=1.0, settings=dataclasses.replace(SETTINGS, incremental=False))
    assert inc.plan is not None and full.plan is not None
    assert full.full == "incremental planning is off"
    if memory.backlog is not None:
        assert inc.full is None
        assert set(inc.backlog) == set(memory.backlog.pods)
        assert not {p.pod for p in inc.plan.placements} - keys  # only new pods planned
    assert validation.problems(now, inc.plan) == []
    placed_inc = {p.pod for p in inc.plan.placements} & keys
    placed_full = {p.pod for p in full.plan.placements} & keys
    assert len(placed_inc) >= len(placed_full)
    assert objective.score(now, inc.plan).weighted >= objective.score(now, full.plan).weighted


def test_a_pass_with_only_the_backlog_waiting_and_nothing_freed_plans_nothing() -> None:
    snap, memory = _standing(5, nodes=3, gpus=2, fill=40)
    assert memory.backlog is not None and memory.backlog.pods
    calls: list[snapshot.Snapshot] = []
    decision = _step(snap, memory, now=1.0, planner=_counting(calls))
    assert decision.plan is None and calls == []
    assert set(decision.backlog) == set(memory.backlog.pods)


def _full_after(snap: snapshot.Snapshot, memory: control.Memory, *, now: float = 1.0) -> str:
    """Why the step after a change to ``snap`` (with a new pod waiting) replanned in full."""
    fresh = _new(5, 1, nodes=3, gpus=2)
    decision = _step(dataclasses.replace(snap, pods=(*snap.pods, *fresh)), memory, now=now)
    assert decision.plan is not None
    assert decision.full is not None, "expected a full replan"
    return decision.full


@pytest.fixture
def standing() -> tuple[snapshot.Snapshot, control.Memory]:
    snap, memory = _standing(5, nodes=3, gpus=2, fill=40)
    assert memory.backlog is not None and memory.backlog.pods
    return snap, memory


def test_a_new_pod_alone_is_planned_incrementally(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    fresh = _new(5, 1, nodes=3, gpus=2)
    calls: list[snapshot.Snapshot] = []
    decision = _step(
        dataclasses.replace(snap, pods=(*snap.pods, *fresh)),
        memory,
        now=1.0,
        planner=_counting(calls),
    )
    assert decision.full is None
    assert [p.key for c in calls for p in c.pods] == [fresh[0].key] * len(calls)


def test_a_pod_no_node_could_hold_costs_no_retry_over_every_node(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    """A new pod that no node could hold (more instances than any node has memory slices) stays
    unplaced without the second planner call over every node; the other new pod is placed."""
    snap, _ = standing
    i, j = _a_used_gpu(snap)
    small = min(snap.nodes[i].gpus[j].model.profiles, key=lambda p: p.memory_slots).name
    freed = snap
    while any(x.used for n in freed.nodes for g in n.gpus for x in g.instances):
        freed = _freed(freed)  # room for the small pod on more than one node
    fits = dataclasses.replace(
        _new(5, 1, nodes=3, gpus=2)[0],
        mig=(snapshot.MigRequest(small, 1),),
        cpu_milli=0,
        memory_bytes=0,
    )
    never = dataclasses.replace(fits, name="never", mig=(snapshot.MigRequest(small, 99),))
    # An MPS node beside them, which no MIG pod can use, does not make a retry worth it either.
    mps = dataclasses.replace(freed.nodes[0], name="mps-node", mode=modes.Mode.MPS, gpus=())
    freed = dataclasses.replace(freed, nodes=(*freed.nodes, mps))
    assert len(incremental.candidates(freed, (fits,), per_pod=None)) > 1
    calls: list[snapshot.Snapshot] = []
    plan = incremental.plan_new(freed, (fits, never), _counting(calls), per_pod=1)
    assert len(calls) == 1
    assert [u.pod for u in plan.unschedulable] == [never.key]
    assert [p.pod for p in plan.placements] == [fits.key]


def _with_node(snap: snapshot.Snapshot, i: int, node: snapshot.Node) -> snapshot.Snapshot:
    nodes = list(snap.nodes)
    nodes[i] = node
    return dataclasses.replace(snap, nodes=tuple(nodes))


def _a_used_gpu(snap: snapshot.Snapshot) -> tuple[int, int]:
    for i, n in enumerate(snap.nodes):
        for j, g in enumerate(n.gpus):
            if any(x.used for x in g.instances):
                return i, j
    raise AssertionError("no GPU with an instance in use")


def _freed(snap: snapshot.Snapshot) -> snapshot.Snapshot:
    """``snap`` with every instance of its first GPU holding one in use freed."""
    i, j = _a_used_gpu(snap)
    node = snap.nodes[i]
    gpu = node.gpus[j]
    freed = dataclasses.replace(
        gpu, instances=tuple(dataclasses.replace(x, used=False) for x in gpu.instances)
    )
    gpus = tuple(freed if k == j else g for k, g in enumerate(node.gpus))
    return _with_node(snap, i, dataclasses.replace(node, gpus=gpus))


def test_an_instance_freed_triggers_a_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    why = _full_after(_freed(snap), memory)
    assert "an instance in use was freed" in why


def test_a_node_joining_triggers_a_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    extra = snapshot.Node(
        name="joined",
        labels=MappingProxyType({}),
        taints=(),
        unschedulable=False,
        allocatable=None,
        gpus=(snapshot.Gpu(0, A100, ()),),
    )
    why = _full_after(dataclasses.replace(snap, nodes=(*snap.nodes, extra), models=()), memory)
    assert "node joined joined" in why


@pytest.mark.parametrize(
    "change",
    ["uncordoned", "labels", "more cpu", "gpu mode"],
)
def test_a_node_changing_triggers_a_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory], change: str
) -> None:
    snap, memory = standing
    node = snap.nodes[0]
    if change == "uncordoned":
        changed = dataclasses.replace(node, unschedulable=not node.unschedulable)
    elif change == "labels":
        # A label the backlog selects nodes by (zone, pool or the GPU product in these pods).
        keys = incremental._label_keys(memory.backlog.pods.values())  # type: ignore[union-attr]
        assert keys, "the backlog selects nodes by no label"
        key = sorted(keys)[0]
        changed = dataclasses.replace(
            node, labels=MappingProxyType({**node.labels, key: node.labels.get(key, "") + "x"})
        )
    elif change == "more cpu":
        assert node.allocatable is not None
        changed = dataclasses.replace(
            node,
            allocatable=dataclasses.replace(
                node.allocatable, cpu_milli=node.allocatable.cpu_milli + 1000
            ),
        )
    else:
        gpus = (dataclasses.replace(node.gpus[0], mig=False, instances=()), *node.gpus[1:])
        changed = dataclasses.replace(node, gpus=gpus)
    why = _full_after(_with_node(snap, 0, changed), memory)
    assert f"node {node.name}" in why


def test_a_label_no_backlog_pod_reads_is_not_growth(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    node = snap.nodes[0]
    relabelled = dataclasses.replace(
        node, labels=MappingProxyType({**node.labels, "nvidia.com/mig.config": "changed"})
    )
    fresh = _new(5, 1, nodes=3, gpus=2)
    now = _with_node(snap, 0, relabelled)
    decision = _step(dataclasses.replace(now, pods=(*now.pods, *fresh)), memory, now=1.0)
    assert decision.plan is not None and decision.full is None


def test_capacity_freed_at_a_step_without_a_plan_still_triggers_the_next_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    """Freed, then taken again before the next plan: the step between saw it grow."""
    snap, memory = standing
    later = dataclasses.replace(SETTINGS, batch_window_s=10.0)
    between = _step(_freed(snap), memory, now=0.5, settings=later)
    assert between.plan is None  # no plan due yet
    why = _full_after(snap, between.memory, now=11.0)
    assert "an instance in use was freed" in why


def test_a_backlog_pod_changing_triggers_a_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    pods = list(snap.pods)
    pods[0] = dataclasses.replace(pods[0], priority=pods[0].priority + 1)
    why = _full_after(dataclasses.replace(snap, pods=tuple(pods)), memory)
    assert why == f"pod {pods[0].key} changed"


def test_pod_affinity_terms_trigger_a_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    pods = list(snap.pods)
    term = interpod.AffinityTerm(
        selector=None,
        namespaces=frozenset(),
        namespace_selector=None,
        topology_key="kubernetes.io/hostname",
    )
    pods[0] = dataclasses.replace(pods[0], terms=interpod.PodTerms(affinity=(term,)))
    why = _full_after(dataclasses.replace(snap, pods=tuple(pods)), memory)
    assert "pod affinity" in why


def test_the_timer_triggers_a_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    assert SETTINGS.full_replan_s is not None
    why = _full_after(snap, memory, now=SETTINGS.full_replan_s + 0.5)
    assert "since the last full replan" in why


def test_a_changed_policy_triggers_a_full_replan(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    policy = (
        snapshot.Policy.SPREAD
        if snap.policy is snapshot.Policy.BINPACK
        else snapshot.Policy.BINPACK
    )
    why = _full_after(dataclasses.replace(snap, policy=policy), memory)
    assert why == "the planner's inputs changed"


def test_reservations_made_by_a_plan_do_not_count_as_growth(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    """A pass's placements carried out lower capacity: the pass after is incremental again."""
    snap, memory = standing
    fresh = _new(5, 3, nodes=3, gpus=2)
    first = _step(dataclasses.replace(snap, pods=(*snap.pods, *fresh)), memory, now=1.0)
    assert first.plan is not None and first.full is None
    after = incremental.carried_out(
        dataclasses.replace(snap, pods=(*snap.pods, *fresh)), first.plan
    )
    more = _new(6, 1, nodes=3, gpus=2)
    more = tuple(dataclasses.replace(p, name=f"more-{p.name}") for p in more)
    second = _step(dataclasses.replace(after, pods=(*after.pods, *more)), first.memory, now=2.0)
    assert second.plan is not None and second.full is None
    # The new pods left unplaced joined the backlog.
    left = {u.pod for u in first.plan.unschedulable}
    assert left <= set(second.backlog)


def test_incremental_planning_off_always_replans_in_full(
    standing: tuple[snapshot.Snapshot, control.Memory],
) -> None:
    snap, memory = standing
    fresh = _new(5, 1, nodes=3, gpus=2)
    off = dataclasses.replace(SETTINGS, incremental=False)
    decision = _step(
        dataclasses.replace(snap, pods=(*snap.pods, *fresh)), memory, now=1.0, settings=off
    )
    assert decision.full == "incremental planning is off"
    assert decision.memory.backlog is None


def test_settings_reject_a_bad_full_replan_period() -> None:
    with pytest.raises(Exception, match="full replan period"):
        control.Settings(full_replan_s=0)
