"""The first-fit check of DRA steering (``planning/drasteering.py``) and the loop's use of it
(``control.reconcile``): a round is steered only when its plan places more gated DRA pods than
kube-scheduler's first fit would serve now, or as many and keeps a profile placeable that first
fit's allocations leave nowhere; otherwise the pods first fit serves are let go on
the nodes it picks, and the DRA targets list nothing first for them."""

from __future__ import annotations

import dataclasses

import pytest

from migpilot import errors
from migpilot.mig import catalog
from migpilot.planning import control, draalloc, draclaims, drasteering, planners, plans, snapshot

H100 = catalog.resolve_gpu("NVIDIA H100 80GB HBM3")
DRA = {"migpilot.io/mode": "dra"}
GIB = 2**30


def _node(
    name: str,
    *,
    used: tuple[tuple[str, int], ...] = (),
    free: tuple[tuple[str, int], ...] = (),
    cpu_milli: int = 32_000,
    labels: dict[str, str] | None = None,
) -> snapshot.Node:
    instances = tuple(snapshot.ExistingInstance(p, s, True) for p, s in used) + tuple(
        snapshot.ExistingInstance(p, s, False) for p, s in free
    )
    return snapshot.Node(
        name,
        DRA if labels is None else labels,
        (),
        False,
        snapshot.Resources(cpu_milli, 256 * GIB),
        (snapshot.Gpu(0, H100, tuple(sorted(instances, key=lambda i: i.start))),),
    )


def _pod(
    name: str,
    profile: str,
    *,
    priority: int = 0,
    policy: snapshot.Policy = snapshot.Policy.SPREAD,
) -> snapshot.Pod:
    pod = snapshot.planned_pod(
        name=name,
        namespace="ns",
        priority=priority,
        requests=snapshot.Requests((snapshot.MigRequest(profile, 1),), 2_000, GIB),
    )
    return dataclasses.replace(
        pod, dra=True, node_policy=policy, gpu_policy=snapshot.Policy.BINPACK
    )


def _claim(profile: str) -> draalloc.Claim:
    spec = draclaims.ClaimSpec(
        (draclaims.Request("mig", 1, (draclaims.Selector(profile=profile),)),)
    )
    return drasteering.claim_of([spec])


def _claims(*pods: snapshot.Pod) -> dict[str, draalloc.Claim]:
    return {p.key: _claim(p.mig[0].profile) for p in pods}


def _check(
    nodes: tuple[snapshot.Node, ...], *pods: snapshot.Pod, gated: frozenset[str] | None = None
) -> tuple[plans.Plan, drasteering.Check | None]:
    snap = snapshot.Snapshot(nodes=nodes, pods=pods)
    plan = planners.run(snap, "fast")
    keys = frozenset(p.key for p in pods) if gated is None else gated
    return plan, drasteering.check(snap, plan, gated=keys, claims=_claims(*pods))


def test_a_lone_pod_first_fit_serves_as_the_plan_would_is_left_to_first_fit() -> None:
    # a 4g.40gb has one start on an H100: first fit and the plan take the same placement, so
    # the plan serves no more now and keeps no more room
    node = _node("d0")
    pod = _pod("a", "4g.40gb")
    plan, found = _check((node,), pod)
    assert found is not None and found.planned == 1
    assert found.first_fit == (drasteering.Served("ns/a", "d0", ("gpu-0-mig-4g-40gb-0",)),)
    assert found.planned_room == found.first_fit_room
    assert not found.steer and not found.for_room
    # the round as first fit's: the pod's planned placement gone, the DRA node's target its
    # used instances only, so its agent lists nothing first
    carried = drasteering.first_fit_plan(
        snapshot.Snapshot(nodes=(node,), pods=(pod,)), plan, gated=frozenset({"ns/a"})
    )
    assert carried.placements == ()
    (gpu,) = carried.gpus
    assert gpu.layout.instances == ()


def test_a_tie_is_steered_when_the_plan_keeps_a_profile_first_fit_loses() -> None:
    """First fit gives a lone 1g.10gb slot 0 (the smallest-first listing's first device), which
    leaves no 4g.40gb (its only start is 0) and no 7g.80gb on the node; the plan serves the
    same one pod and keeps the 4g.40gb: the round is steered."""
    _, found = _check((_node("d0"),), _pod("a", "1g.10gb"))
    assert found is not None and found.planned == 1 and len(found.first_fit) == 1
    assert found.first_fit[0].devices == ("gpu-0-mig-1g-10gb-0",)
    assert ("h100-80gb", "4g.40gb") in found.planned_room - found.first_fit_room
    assert found.planned_room > found.first_fit_room
    assert found.steer and found.for_room


def test_room_counts_used_instances_and_taken_devices_on_dra_nodes_only() -> None:
    node = _node("d0", used=(("4g.40gb", 0),), free=(("3g.40gb", 4),))
    room = drasteering.room((node,))
    # the free 3g.40gb is no allocation: a 3g.40gb still fits at slot 4, no 4g.40gb does
    assert ("h100-80gb", "3g.40gb") in room and ("h100-80gb", "4g.40gb") not in room
    taken = drasteering.room((node,), {"d0": ["gpu-0-mig-1g-10gb-6"]})
    assert ("h100-80gb", "3g.40gb") not in taken and ("h100-80gb", "2g.20gb") in taken
    # a device name that names no placement of the node is not counted
    assert drasteering.room((node,), {"d0": ["gpu-9-mig-1g-10gb-4"]}) == room
    # a node not in DRA mode has no room in it
    assert drasteering.room((_node("p0", labels={}),)) == frozenset()


def test_three_pods_first_fit_fragments_are_steered() -> None:
    """First fit gives the 1g.10gb slot 0, the 4g.40gb's only start: it serves two, the plan
    three."""
    pods = (_pod("a", "1g.10gb"), _pod("b", "2g.20gb"), _pod("c", "4g.40gb"))
    plan, found = _check((_node("d0"),), *pods)
    assert found is not None
    assert [(s.pod, s.devices) for s in found.first_fit] == [
        ("ns/a", ("gpu-0-mig-1g-10gb-0",)),
        ("ns/b", ("gpu-0-mig-2g-20gb-2",)),
    ]
    assert found.planned == 3 and found.steer
    assert not found.for_room  # steered for the third pod, not for room
    assert {pl.pod for pl in plan.placements} == {p.key for p in pods}


def test_used_instances_are_allocated_devices_to_first_fit() -> None:
    # a 7g.80gb in use: nothing fits
    _, found = _check((_node("d0", used=(("7g.80gb", 0),)),), _pod("a", "1g.10gb"))
    assert found is not None and found.first_fit == () and found.planned == 0
    # a 4g.40gb in use at 0: the 1g.10gb goes to the first free slot past it
    _, found = _check((_node("d0", used=(("4g.40gb", 0),)),), _pod("a", "1g.10gb"))
    assert found is not None
    assert found.first_fit[0].devices == ("gpu-0-mig-1g-10gb-4",)
    # a free instance (a target listed before) is no allocation: first fit may take it or
    # anything else
    _, found = _check((_node("d0", free=(("3g.40gb", 4),)),), _pod("a", "1g.10gb"))
    assert found is not None and found.first_fit[0].devices == ("gpu-0-mig-1g-10gb-0",)


@pytest.mark.parametrize(
    ("policy", "together"),
    [(snapshot.Policy.SPREAD, False), (snapshot.Policy.BINPACK, True)],
)
def test_first_fit_picks_the_node_kube_schedulers_score_ranks_first(
    policy: snapshot.Policy, together: bool
) -> None:
    """``LeastAllocated`` (planned as spread): the node with the most CPU and memory left;
    ``MostAllocated`` (binpack): the least; a tie goes to the first node."""
    pods = (_pod("a", "1g.10gb", policy=policy), _pod("b", "1g.10gb", policy=policy))
    _, found = _check((_node("d0"), _node("d1")), *pods)
    assert found is not None
    nodes = [s.node for s in found.first_fit]
    assert nodes[0] == "d0" and (nodes[1] == "d0") is together
    # the strategy given outright (the simulator's setting) wins over the pods' policy
    forced = drasteering.first_fit(
        (_node("d0"), _node("d1")), pods, _claims(*pods), most_allocated=not together
    )
    assert [s.node for s in forced][1] == ("d1" if together else "d0")


def test_first_fit_takes_pods_in_queue_order_and_only_on_dra_nodes() -> None:
    # higher priority first: the later 7g.80gb takes the GPU, the 1g.10gb is not served
    small, large = _pod("a", "1g.10gb"), _pod("b", "7g.80gb", priority=10)
    _, found = _check((_node("d0"),), small, large)
    assert found is not None and [s.pod for s in found.first_fit] == ["ns/b"]
    # a node not in DRA mode, one without the CPU, publish nothing to it
    plugin = _node("n0", labels={})
    busy = _node("d1", cpu_milli=1_000)
    served = drasteering.first_fit((plugin, busy), [small], _claims(small))
    assert served == ()


def test_no_gated_dra_pod_no_check_and_in_flight_placements_are_kept() -> None:
    node = _node("d0")
    flying, waiting = _pod("f", "3g.40gb"), _pod("w", "3g.40gb")
    # only an ungated (in flight) pod: nothing to check
    _, found = _check((node,), flying, gated=frozenset())
    assert found is None
    # the in-flight pod's planned placement is taken before first fit; a round left to first
    # fit keeps it in the target (listed first for it) and drops the gated pod's
    snap = snapshot.Snapshot(nodes=(node,), pods=(flying, waiting))
    plan = planners.run(snap, "fast")
    found = drasteering.check(
        snap, plan, gated=frozenset({"ns/w"}), claims=_claims(flying, waiting)
    )
    assert found is not None and found.planned == 1
    (flown,) = [pl for pl in plan.placements if pl.pod == "ns/f"]
    ((_, start),) = [(a.profile, a.start) for a in flown.instances]
    assert found.first_fit[0].devices == (f"gpu-0-mig-3g-40gb-{4 - start}",)
    carried = drasteering.first_fit_plan(snap, plan, gated=frozenset({"ns/w"}))
    assert [pl.pod for pl in carried.placements] == ["ns/f"]
    (gpu,) = carried.gpus
    assert [(i.profile, i.start) for i in gpu.layout.instances] == [("3g.40gb", start)]
    # w's claim (a 3g.40gb) would take f's placement, listed first, were it allocated first:
    # first fit's device for it is listed first too
    assert found.racing == {"ns/w"}
    carried = drasteering.first_fit_plan(
        snap, plan, gated=frozenset({"ns/w"}), served=found.first_fit
    )
    assert [pl.pod for pl in carried.placements] == ["ns/f"]
    (gpu,) = carried.gpus
    assert sorted((i.profile, i.start) for i in gpu.layout.instances) == [
        ("3g.40gb", 0),
        ("3g.40gb", 4),
    ]
    # a claim f's placement cannot hold (a 1g.10gb), or no pod in flight: not racing
    small = _pod("s", "1g.10gb")
    beside = snapshot.Snapshot(nodes=(node,), pods=(flying, small))
    beside_plan = planners.run(beside, "fast")
    other = drasteering.check(
        beside, beside_plan, gated=frozenset({"ns/s"}), claims=_claims(flying, small)
    )
    assert other is not None and len(other.first_fit) == 1 and other.racing == frozenset()
    alone = snapshot.Snapshot(nodes=(node,), pods=(waiting,))
    lone = drasteering.check(
        alone, planners.run(alone, "fast"), gated=frozenset({"ns/w"}), claims=_claims(waiting)
    )
    assert lone is not None and len(lone.first_fit) == 1 and lone.racing == frozenset()


def test_a_pods_claims_are_allocated_together() -> None:
    one = draclaims.ClaimSpec((draclaims.Request("a", 1, (draclaims.Selector("3g.40gb"),)),))
    two = draclaims.ClaimSpec((draclaims.Request("b", 2, (draclaims.Selector("2g.20gb"),)),))
    claim = drasteering.claim_of([one, two])
    assert [(r.count, r.alternatives[0].profile) for r in claim.requests] == [
        (1, "3g.40gb"),
        (2, "2g.20gb"),
    ]
    with pytest.raises(errors.MigpilotError, match="none of migpilot's devices"):
        drasteering.claim_of([draclaims.ClaimSpec((), others=("gpu",))])


# --------------------------------------------------------------------------- the loop's step


def _reconcile(node: snapshot.Node, *pods: snapshot.Pod) -> control.Decision:
    observed = control.Observed(
        snapshot=snapshot.Snapshot(nodes=(node,), pods=pods),
        dra_claims=_claims(*pods),
    )
    memory = control.Memory(batch=control.Batch(due=0.0, dirty=True))
    return control.reconcile(
        observed,
        memory,
        now=1.0,
        settings=control.Settings(),
        planner=lambda snap: planners.run(snap, "fast"),
    )


def test_the_step_lets_a_lone_pod_go_to_first_fit_unsteered() -> None:
    decision = _reconcile(_node("d0"), _pod("a", "4g.40gb"))
    assert decision.dra_check is not None and not decision.dra_check.steer
    assert decision.steered == (("ns/a", "d0"),)
    assert decision.plan is not None and decision.plan.placements == ()
    assert all(g.layout.instances == () for g in decision.plan.gpus)


def test_the_step_steers_when_the_plan_serves_more() -> None:
    pods = (_pod("a", "1g.10gb"), _pod("b", "2g.20gb"), _pod("c", "4g.40gb"))
    decision = _reconcile(_node("d0"), *pods)
    assert decision.dra_check is not None and decision.dra_check.steer
    assert decision.steered == (("ns/a", "d0"), ("ns/b", "d0"), ("ns/c", "d0"))
    assert decision.plan is not None
    (gpu,) = decision.plan.gpus
    assert sorted(i.profile for i in gpu.layout.instances) == ["1g.10gb", "2g.20gb", "4g.40gb"]


def test_the_step_keeps_pods_first_fit_cannot_serve_gated() -> None:
    """Two 4g.40gb on one GPU: the plan and first fit both serve one; the other stays gated,
    named nowhere (planned again at the next plan)."""
    decision = _reconcile(_node("d0"), _pod("a", "4g.40gb"), _pod("b", "4g.40gb"))
    assert decision.dra_check is not None and not decision.dra_check.steer
    assert decision.steered == (("ns/a", "d0"),)


def test_a_pod_let_go_to_first_fit_holds_its_devices_until_allocated() -> None:
    """Let go to first fit and in flight (ungated, its claim not allocated yet): the next steps
    do not plan it (no placement listed first for it) and count its predicted devices used, so
    no other pod is planned over them."""
    node = _node("d0", free=(("3g.40gb", 0),))
    lone, later = _pod("a", "4g.40gb"), _pod("b", "4g.40gb")
    first = _reconcile(node, lone)
    assert first.steered == (("ns/a", "d0"),)
    assert first.memory.first_fit["ns/a"].devices == ("gpu-0-mig-4g-40gb-0",)
    # a pure view: its devices used, the free instance they overlap gone, the pod not planned
    held = drasteering.holding(
        snapshot.Snapshot(nodes=(node,), pods=(lone, later)), first.memory.first_fit.values()
    )
    assert [p.key for p in held.pods] == ["ns/b"]
    ((gpu),) = held.nodes[0].gpus
    assert [(i.profile, i.start, i.used) for i in gpu.instances] == [("4g.40gb", 0, True)]
    # the next step, the pod let go (not gated) and another waiting: nothing planned for the
    # one in flight, and the other cannot have the only 4g.40gb start
    observed = control.Observed(
        snapshot=snapshot.Snapshot(nodes=(node,), pods=(lone, later)),
        pending={"ns/a": control.Pending(gated=False, pinned="d0")},
        dra_claims=_claims(lone, later),
    )
    memory = dataclasses.replace(first.memory, batch=control.Batch(due=0.0, dirty=True))
    second = control.reconcile(
        observed,
        memory,
        now=2.0,
        settings=control.Settings(),
        planner=lambda snap: planners.run(snap, "fast"),
    )
    assert second.steered == ()
    assert second.plan is not None and second.plan.placements == ()
    assert [j.pod for j in second.judged] == ["ns/b"]
    assert "ns/a" in second.memory.first_fit
    # kube-scheduler found no node for it after all: planned again as any Unschedulable pod
    observed = dataclasses.replace(
        observed,
        pending={"ns/a": control.Pending(gated=False, pinned="d0", unschedulable=True)},
    )
    third = control.reconcile(
        observed,
        memory,
        now=2.0,
        settings=control.Settings(),
        planner=lambda snap: planners.run(snap, "fast"),
    )
    assert third.plan is not None and [p.pod for p in third.plan.placements] == ["ns/a"]
    # allocated (no longer among the waiting pods): forgotten
    gone = control.reconcile(
        control.Observed(snapshot=snapshot.Snapshot(nodes=(node,), pods=())),
        memory,
        now=3.0,
        settings=control.Settings(),
        planner=lambda snap: planners.run(snap, "fast"),
    )
    assert gone.memory.first_fit == {}


# --------------------------------------------------------------------------- past their pods


def _step(
    observed: control.Observed, memory: control.Memory, *, due: bool = True
) -> control.Decision:
    batch = control.Batch(due=0.0, dirty=True) if due else control.Batch()
    return control.reconcile(
        observed,
        dataclasses.replace(memory, batch=batch),
        now=1.0,
        settings=control.Settings(),
        planner=lambda snap: planners.run(snap, "fast"),
    )


def _layout(plan: plans.Plan | None, node: str) -> list[tuple[str, int]]:
    assert plan is not None
    return sorted(
        (i.profile, i.start) for g in plan.gpus if g.node == node for i in g.layout.instances
    )


def test_trimmed_keeps_used_and_placed_and_drops_free_placements_no_pod_is_planned_onto() -> None:
    dra = _node("d0", used=(("1g.10gb", 0),), free=(("2g.20gb", 2), ("3g.40gb", 4)))
    plugin = _node("n0", free=(("3g.40gb", 4),), labels={})
    snap = snapshot.Snapshot(nodes=(dra, plugin), pods=(_pod("a", "3g.40gb"),))
    plan = planners.run(snap, "fast")
    assert [(pl.pod, pl.node) for pl in plan.placements] == [("ns/a", "d0")]
    trimmed = drasteering.trimmed(snap, plan)
    # the 2g.20gb, free and planned for no pod, goes; the used 1g.10gb and the placement stay
    assert _layout(trimmed, "d0") == [("1g.10gb", 0), ("3g.40gb", 4)]
    assert _layout(trimmed, "n0") == _layout(plan, "n0")  # not a DRA node: the plan's target
    assert trimmed.placements == plan.placements
    # a DRA node named in keep keeps the plan's target
    assert _layout(drasteering.trimmed(snap, plan, keep=frozenset({"d0"})), "d0") == _layout(
        plan, "d0"
    )
    # no DRA node: the plan itself
    alone = snapshot.Snapshot(nodes=(plugin,), pods=())
    empty = planners.run(alone, "fast")
    assert drasteering.trimmed(alone, empty) is empty


def test_cleared_writes_a_watched_dra_node_back_to_its_used_instances() -> None:
    dirty = _node("d0", used=(("1g.10gb", 0),), free=(("4g.40gb", 4),))
    used_only = _node("d1", used=(("1g.10gb", 0),))
    empty = _node("d2")
    unwatched = _node("d3", free=(("4g.40gb", 0),))  # free instances nobody here planned
    snap = snapshot.Snapshot(nodes=(dirty, used_only, empty, unwatched), pods=())
    plan, watched = drasteering.cleared(snap, frozenset({"d0", "d1", "d2", "gone"}))
    assert plan is not None and plan.placements == ()
    assert {g.node for g in plan.gpus if g.changed} == {"d0"}
    assert _layout(plan, "d0") == [("1g.10gb", 0)]
    # watched while an instance is there (a used one is freed when its pod goes)
    assert watched == {"d0", "d1"}
    plan, watched = drasteering.cleared(snap, frozenset({"d1"}))
    assert plan is None and watched == {"d1"}


def _steered_pair() -> control.Decision:
    """A 1g.10gb and a 4g.40gb on an H100 that holds two free 1g.10gb (at 5 and 6, a target
    listed before): first fit would give the 1g.10gb slot 0, the 4g.40gb's only start, so the
    round is steered; the planner puts the 1g.10gb on one free instance and keeps the other."""
    node = _node("d0", free=(("1g.10gb", 5), ("1g.10gb", 6)))
    pods = (_pod("a", "1g.10gb"), _pod("c", "4g.40gb"))
    observed = control.Observed(snapshot.Snapshot((node,), pods), dra_claims=_claims(*pods))
    decision = _step(observed, control.Memory())
    assert decision.dra_check is not None and decision.dra_check.steer
    return decision


def test_a_steered_round_lists_only_what_its_pods_are_planned_onto() -> None:
    decision = _steered_pair()
    plan = decision.plan
    assert plan is not None
    placed = sorted((a.profile, a.start) for pl in plan.placements for a in pl.instances)
    assert len(placed) == 2 and ("4g.40gb", 0) in placed
    assert _layout(plan, "d0") == placed  # the other free 1g.10gb is not listed first
    assert decision.memory.dra_targets == {"d0"}
    assert decision.cleared is None


def test_the_target_goes_back_to_the_used_instances_once_no_pod_waits() -> None:
    first = _steered_pair()
    assert first.plan is not None
    target = {a.profile: a.start for pl in first.plan.placements for a in pl.instances}
    small, large = ("1g.10gb", target["1g.10gb"]), ("4g.40gb", target["4g.40gb"])
    # as the controller then sees the node: the target's placements free instances, the
    # 1g.10gb's claim allocated (used), the 4g.40gb's pod deleted before its allocation
    seen = _node("d0", used=(small,), free=(large,))
    # a DRA pod still waits (gated, before its plan is due): the target stays
    waiting = _pod("w", "1g.10gb")
    kept = _step(control.Observed(snapshot.Snapshot((seen,), (waiting,))), first.memory, due=False)
    assert kept.plan is None and kept.cleared is None and kept.memory.dra_targets == {"d0"}
    # one let go and not yet allocated (in flight, planned onto its placement): the same
    flying = control.Observed(
        snapshot.Snapshot((seen,), (_pod("c", "4g.40gb"),)),
        pending={"ns/c": control.Pending(gated=False, pinned="d0")},
    )
    assert _step(flying, first.memory, due=False).cleared is None
    # nobody waits: no plan, and the target is the allocated 1g.10gb alone
    quiet = control.Observed(snapshot.Snapshot((seen,), ()), changed=False)
    cleared = _step(quiet, first.memory, due=False)
    assert cleared.plan is None and cleared.cleared is not None
    assert _layout(cleared.cleared, "d0") == [small]
    assert cleared.memory.dra_targets == {"d0"}  # its instance is freed when its pod goes
    # written: nothing free left, nothing to write at the next step
    after = _node("d0", used=(small,))
    again = _step(control.Observed(snapshot.Snapshot((after,), ())), cleared.memory, due=False)
    assert again.cleared is None and again.memory.dra_targets == {"d0"}
    # the last pod gone, its claim deallocated: the 1g.10gb goes too, then the node is forgotten
    freed = _node("d0", free=(small,))
    last = _step(control.Observed(snapshot.Snapshot((freed,), ())), again.memory, due=False)
    assert last.cleared is not None and _layout(last.cleared, "d0") == []
    done = _step(control.Observed(snapshot.Snapshot((_node("d0"),), ())), last.memory)
    assert done.cleared is None and done.memory.dra_targets == frozenset()


def test_a_pod_let_go_to_first_fit_keeps_the_target_until_allocated() -> None:
    """Its predicted devices are used instances of the snapshot while it is in flight; no
    clearing runs meanwhile (it would write them into the target, listed first)."""
    first = _steered_pair()
    lone = _pod("a", "4g.40gb")
    memory = dataclasses.replace(
        first.memory,
        first_fit={"ns/a": drasteering.Served("ns/a", "d0", ("gpu-0-mig-4g-40gb-0",))},
    )
    observed = control.Observed(
        snapshot.Snapshot((_node("d0", free=(("1g.10gb", 6),)),), (lone,)),
        pending={"ns/a": control.Pending(gated=False, pinned="d0")},
    )
    decision = _step(observed, memory, due=False)
    assert decision.cleared is None and decision.memory.dra_targets == {"d0"}


def test_a_plan_keeps_the_target_of_a_node_where_a_pod_in_flight_is_not_placed() -> None:
    """A pod let go and not yet allocated that the plan does not place: which of the node's
    free placements kube-scheduler is allocating it is not known, so the node keeps the plan's
    target; other DRA nodes are trimmed."""
    here = _node("d0", used=(("7g.80gb", 0),))
    # d1's free 4g.40gb is what the in-flight pod was steered to; d2 holds a stale one
    there = _node("d1", used=(("1g.10gb", 6),), free=(("4g.40gb", 0),))
    stale = _node("d2", used=(("1g.10gb", 0),), free=(("2g.20gb", 2),))
    flying = _pod("f", "7g.80gb")  # cannot be placed now: no GPU is free of used instances
    observed = control.Observed(
        snapshot.Snapshot((here, there, stale), (flying,)),
        pending={"ns/f": control.Pending(gated=False, pinned="d1")},
    )
    decision = _step(observed, control.Memory())
    assert decision.plan is not None and decision.plan.placements == ()
    assert _layout(decision.plan, "d1") == [("1g.10gb", 6), ("4g.40gb", 0)]
    assert _layout(decision.plan, "d2") == [("1g.10gb", 0)]
    assert _layout(decision.plan, "d0") == [("7g.80gb", 0)]


# -- a node set aside for the one pod no node can take now


def _aside_cluster() -> tuple[snapshot.Node, ...]:
    """Two DRA nodes of one H100 each, neither with room for a 7g.80gb now: d0 holds one
    compute slice in use, d1 two."""
    return (_node("d0", used=(("1g.10gb", 6),)), _node("d1", used=(("2g.20gb", 4),)))


def _planned(snap: snapshot.Snapshot) -> plans.Plan:
    return planners.run(snap, "fast")


def test_a_node_is_set_aside_for_the_one_pod_no_node_can_take_now() -> None:
    nodes = _aside_cluster()
    big, small = _pod("big", "7g.80gb"), _pod("small", "1g.10gb")
    snap = snapshot.Snapshot(nodes=nodes, pods=(big, small))
    plan = _planned(snap)
    assert {pl.pod for pl in plan.placements} == {"ns/small"}
    gated = frozenset({big.key, small.key})
    found = drasteering.set_aside(snap, plan, gated=gated, previous=None, planner=_planned)
    # the node with the fewest compute slices in use of those that could take it emptied
    assert found == drasteering.Aside("ns/big", "d0")
    # the one set aside before stays while it still could (no flip between rounds)
    before = drasteering.Aside("ns/big", "d1")
    assert drasteering.set_aside(snap, plan, gated=gated, previous=before, planner=_planned) == (
        before
    )
    # not for a pod let go (kube-scheduler's now), nor for a pod of a device-plugin node
    assert (
        drasteering.set_aside(snap, plan, gated=frozenset({small.key}), previous=None,
                              planner=_planned) is None
    )  # fmt: skip
    plain = dataclasses.replace(big, dra=False)
    assert (
        drasteering.set_aside(
            dataclasses.replace(snap, pods=(plain, small)), plan, gated=gated, previous=None,
            planner=_planned,
        )
        is None
    )  # fmt: skip


def test_no_node_is_set_aside_while_another_pod_waits_too_or_none_could_take_it() -> None:
    nodes = _aside_cluster()
    gated = frozenset({"ns/big", "ns/big2"})
    two = snapshot.Snapshot(nodes=nodes, pods=(_pod("big", "7g.80gb"), _pod("big2", "7g.80gb")))
    assert drasteering.set_aside(two, _planned(two), gated=gated, previous=None,
                                 planner=_planned) is None  # fmt: skip
    # a node not in DRA mode, or cordoned, is never set aside
    others = (
        _node("p0", used=(("1g.10gb", 6),), labels={}),
        dataclasses.replace(_node("d2", used=(("1g.10gb", 6),)), unschedulable=True),
    )
    one = snapshot.Snapshot(nodes=others, pods=(_pod("big", "7g.80gb"),))
    assert drasteering.set_aside(one, _planned(one), gated=gated, previous=None,
                                 planner=_planned) is None  # fmt: skip


def test_the_node_set_aside_keeps_the_other_gated_dra_pods_off_it_while_they_fit() -> None:
    nodes = _aside_cluster()
    big, small = _pod("big", "7g.80gb"), _pod("small", "1g.10gb")
    snap = snapshot.Snapshot(nodes=nodes, pods=(big, small))
    aside = drasteering.Aside("ns/big", "d0")
    gated = frozenset({big.key, small.key})
    kept = drasteering.kept_aside(snap, aside, gated)
    assert kept.pods[0] == big  # its own pod is not kept off
    plan = _planned(kept)
    assert [(pl.pod, pl.node) for pl in plan.placements] == [("ns/small", "d1")]
    assert not drasteering.aside_costs(plan, lambda: _planned(snap), snap, aside)
    # d1 full: keeping the small pod off d0 would leave it waiting, so it costs a pod now
    full = (nodes[0], _node("d1", used=(("7g.80gb", 0),)))
    snap = snapshot.Snapshot(nodes=full, pods=(big, small))
    plan = _planned(drasteering.kept_aside(snap, aside, gated))
    assert plan.placements == ()
    assert drasteering.aside_costs(plan, lambda: _planned(snap), snap, aside)
    # still_aside: only while its pod waits gated and its node is a DRA node admitting pods
    assert drasteering.still_aside(aside, snap, gated) == aside
    assert drasteering.still_aside(aside, snap, frozenset({small.key})) is None
    cordoned = (dataclasses.replace(nodes[0], unschedulable=True), nodes[1])
    assert drasteering.still_aside(aside, dataclasses.replace(snap, nodes=cordoned), gated) is None


def test_the_loop_sets_a_node_aside_and_plans_the_others_elsewhere_until_it_costs_a_pod() -> None:
    nodes = _aside_cluster()
    big, small = _pod("big", "7g.80gb"), _pod("small", "1g.10gb")
    observed = control.Observed(
        snapshot.Snapshot(nodes=nodes, pods=(big,)), dra_claims=_claims(big)
    )
    first = _step(observed, control.Memory())
    assert first.dra_aside == drasteering.Aside("ns/big", "d0")  # newly set aside: said
    assert first.memory.dra_aside == first.dra_aside
    # the next small pod goes to d1, though d0 has more room (spread would pick d0)
    observed = control.Observed(
        snapshot.Snapshot(nodes=nodes, pods=(big, small)), dra_claims=_claims(big, small)
    )
    second = _step(observed, first.memory)
    # (first fit serves it there as the plan would: let go to first fit, pinned to d1)
    assert second.steered == (("ns/small", "d1"),)
    assert second.memory.dra_aside == first.dra_aside and second.dra_aside is None
    assert _step(observed, control.Memory()).steered == (("ns/small", "d0"),)
    # d1 full: the small pod would wait, so this round it goes to d0
    full = (nodes[0], _node("d1", used=(("7g.80gb", 0),)))
    observed = control.Observed(
        snapshot.Snapshot(nodes=full, pods=(big, small)), dra_claims=_claims(big, small)
    )
    assert _step(observed, first.memory).steered == (("ns/small", "d0"),)


def test_a_controller_just_started_clears_a_target_an_earlier_one_steered() -> None:
    """A restarted controller cannot know which DRA nodes an earlier one steered: its first
    step with nobody waiting treats every DRA node so, and writes back the one whose target
    still holds a free placement (the node not in DRA mode is not touched)."""
    steered = _node("d0", used=(("1g.10gb", 6),), free=(("4g.40gb", 0),))
    plain = _node("d1")
    other = _node("p0", free=(("1g.10gb", 0),), labels={})
    quiet = control.Observed(snapshot.Snapshot((steered, plain, other), ()), changed=False)
    started = _step(quiet, control.Memory(), due=False)
    assert started.cleared is not None
    assert {g.node for g in started.cleared.gpus} == {"d0"}
    assert _layout(started.cleared, "d0") == [("1g.10gb", 6)]
    assert started.memory.dra_targets == {"d0"}  # d1 holds nothing: forgotten at once


def test_a_round_that_cannot_keep_the_node_set_aside_plans_plainly_and_keeps_it_for_later() -> None:
    """``plan_aside``, the one round of the controller and the simulator: the pod that fits only
    on the node set aside is planned there (the round does not keep the node), and the node
    stays set aside after it while it still could take its pod, though another node now has
    fewer compute slices in use (choosing afresh would flip to it)."""
    d0 = _node("d0", used=(("1g.10gb", 0),))  # one slice in use; a 4g.40gb cannot start at 0
    d1 = _node("d1", used=(("2g.20gb", 4),))  # two slices in use; a 4g.40gb fits at 0
    big, small = _pod("big", "7g.80gb"), _pod("small", "4g.40gb")
    snap = snapshot.Snapshot(nodes=(d0, d1), pods=(big, small))
    gated = frozenset({big.key, small.key})
    aside = drasteering.Aside("ns/big", "d1")
    planned: list[snapshot.Snapshot] = []

    def plan_on(s: snapshot.Snapshot) -> plans.Plan:
        planned.append(s)
        return _planned(s)

    done = drasteering.plan_aside(snap, aside, gated, plan_on, lambda p: p)
    assert [(pl.pod, pl.node) for pl in done.result.placements] == [("ns/small", "d1")]
    assert done.kept is None and done.remembered == aside
    assert len(planned) == 2 and planned[1] == snap  # kept first, then plainly
    assert done.keeping(snap) == snap
    assert done.next(snap, done.result, planner=_planned) == aside
    fresh = drasteering.set_aside(snap, done.result, gated=gated, previous=None, planner=_planned)
    assert fresh == drasteering.Aside("ns/big", "d0")
    # with room elsewhere the round keeps it: the small pod is planned off d1
    roomy = snapshot.Snapshot(nodes=(_node("d0", used=(("1g.10gb", 6),)), d1), pods=(big, small))
    kept = drasteering.plan_aside(roomy, aside, gated, _planned, lambda p: p)
    assert kept.kept == aside and [(pl.pod, pl.node) for pl in kept.result.placements] == [
        ("ns/small", "d0")
    ]
    assert kept.keeping(roomy) == drasteering.kept_aside(roomy, aside, gated)
    # no node set aside, or its pod gone: planned once, as it is
    assert drasteering.plan_aside(snap, None, gated, _planned, lambda p: p).remembered is None
    gone = drasteering.plan_aside(snap, aside, frozenset({small.key}), _planned, lambda p: p)
    assert gone.kept is None and gone.remembered is None


def test_a_first_fit_round_lists_its_devices_first_beside_a_pod_in_flight() -> None:
    """The control step: a pod let go before and not yet allocated (``f``) has its planned
    ``3g.40gb`` listed first on the node; the round for ``w`` is first fit's (one against one,
    no room kept), and w's first-fit device is listed first beside f's, so kube-scheduler
    cannot give w f's placement (a claim by memory takes the first listed device that holds
    it)."""
    node = _node("d0")
    flying, waiting = _pod("f", "3g.40gb"), _pod("w", "3g.40gb")
    observed = control.Observed(
        snapshot.Snapshot((node,), (flying, waiting)),
        pending={"ns/f": control.Pending(gated=False, pinned="d0"), "ns/w": control.Pending()},
        dra_claims=_claims(flying, waiting),
    )
    decision = _step(observed, control.Memory())
    assert decision.dra_check is not None and not decision.dra_check.steer
    assert decision.steered == (("ns/w", "d0"),)
    assert _layout(decision.plan, "d0") == [("3g.40gb", 0), ("3g.40gb", 4)]
    (served,) = decision.dra_check.first_fit
    assert len(served.devices) == 1


def test_a_claim_by_memory_beside_a_larger_placement_in_flight_is_racing() -> None:
    """The race the real control plane showed: a pod in flight's ``3g.40gb`` is listed first;
    a claim by memory (20 GiB) let go to first fit is predicted a ``1g.20gb`` (smallest first,
    the 3g.40gb taken), but allocated before the pod in flight it would get the listed-first
    3g.40gb. It is racing: its 1g.20gb is listed first too, ahead (smallest first)."""
    node = _node("d0")
    flying = _pod("f", "3g.40gb")
    by_memory = _pod("m", "1g.20gb")
    spec = draclaims.ClaimSpec(
        (draclaims.Request("mig", 1, (draclaims.Selector(min_memory_mib=20 * 1024 - 512),)),)
    )
    claims = {**_claims(flying), by_memory.key: drasteering.claim_of([spec])}
    snap = snapshot.Snapshot(nodes=(node,), pods=(flying, by_memory))
    plan = planners.run(snap, "fast")
    found = drasteering.check(snap, plan, gated=frozenset({"ns/m"}), claims=claims)
    assert found is not None
    ((_, devices),) = [(s.pod, s.devices) for s in found.first_fit]
    assert len(devices) == 1 and "-mig-1g-20gb-" in devices[0]
    assert found.racing == {"ns/m"}
