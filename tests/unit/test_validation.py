"""The independent plan validator: a sound plan passes, and each kind of broken plan is caught.

Broken plans are made by hand from one sound plan, one fault at a time, so each test shows that
the validator notices that fault (and says where).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.mig import layouts
from migpilot.planning import generate, plans, snapshot, validation

SNAPSHOT = """
version: 1
nodes:
  - name: node-0
    labels: {zone: a}
    allocatable: {cpu: "8", memory: 16Gi}
    gpus:
      - model: a100-80gb
        instances:
          - {profile: 3g.40gb, start: 4, used: true}
          - {profile: 1g.10gb, start: 0}
      - model: a100-80gb
  - name: node-1
    labels: {zone: b}
    taints: [{key: k, value: v, effect: NoSchedule}]
    gpus:
      - model: h100-80gb
  - name: node-2
    unschedulable: true
    gpus:
      - model: a100-80gb
pods:
  - {name: p1, requests: {nvidia.com/mig-1g.10gb: 2, cpu: "4", memory: 8Gi},
     nodeSelector: {zone: a}}
  - {name: p2, requests: {nvidia.com/mig-3g.40gb: 1, cpu: "2"}}
  - {name: p3, requests: {nvidia.com/mig-7g.80gb: 1},
     tolerations: [{key: k, operator: Exists}]}
  - {name: p4, requests: {nvidia.com/mig-1g.10gb: 1, cpu: "4", memory: 10Gi}}
"""

SNAP = snapshot.parse(yaml.safe_load(SNAPSHOT))
I = layouts.Instance  # noqa: E741 (short, like A below: the tables read as layouts)
A = plans.AssignedInstance

GOOD_TARGETS: dict[plans.GpuKey, layouts.Layout] = {
    ("node-0", 0): layouts.Layout.of([I(0, "1g.10gb"), I(1, "1g.10gb"), I(4, "3g.40gb")]),
    ("node-0", 1): layouts.Layout.of([I(0, "3g.40gb")]),
    ("node-1", 0): layouts.Layout.of([I(0, "7g.80gb")]),
}
GOOD_PLACEMENTS = (
    plans.Placement("default/p1", "node-0", (A(0, "1g.10gb", 0), A(0, "1g.10gb", 1))),
    plans.Placement("default/p2", "node-0", (A(1, "3g.40gb", 0),)),
    plans.Placement("default/p3", "node-1", (A(0, "7g.80gb", 0),)),
)
GOOD_UNSCHEDULABLE = (plans.Unschedulable("default/p4", "no room"),)


def make(
    *,
    targets: Mapping[plans.GpuKey, layouts.Layout] | None = None,
    placements: Iterable[plans.Placement] = GOOD_PLACEMENTS,
    unschedulable: Iterable[plans.Unschedulable] = GOOD_UNSCHEDULABLE,
) -> plans.Plan:
    merged = dict(GOOD_TARGETS)
    merged.update(targets or {})
    return plans.build(
        SNAP,
        planner="hand",
        targets=merged,
        placements=placements,
        unschedulable=unschedulable,
    )


def replace_placement(
    pod: str, node: str, *instances: plans.AssignedInstance
) -> list[plans.Placement]:
    return [plans.Placement(pod, node, instances) if p.pod == pod else p for p in GOOD_PLACEMENTS]


def only(found: list[str], expected: str) -> None:
    assert found, "the validator found nothing wrong"
    assert any(expected in f for f in found), found


def test_sound_plan_passes() -> None:
    plan = make()
    assert validation.problems(SNAP, plan) == []
    # Reuse of the free 1g.10gb@0, one create on gpu0, one each on the other two.
    assert [(a.node, a.gpu, a.op.value, str(I(a.start, a.profile))) for a in plan.actions] == [
        ("node-0", 0, "create", "1g.10gb@1"),
        ("node-0", 1, "create", "3g.40gb@0"),
        ("node-1", 0, "create", "7g.80gb@0"),
    ]


def test_unchanged_plan_with_nothing_placed_passes() -> None:
    plan = plans.build(
        SNAP,
        planner="static",
        targets={},
        placements=(),
        unschedulable=[plans.Unschedulable(p.key, "x") for p in SNAP.pods],
    )
    assert validation.problems(SNAP, plan) == []
    assert plan.actions == ()


# --------------------------------------------------------------------------- layouts


def test_destroyed_used_instance() -> None:
    plan = make(targets={("node-0", 0): layouts.Layout.of([I(0, "1g.10gb"), I(1, "1g.10gb")])})
    found = validation.problems(SNAP, plan)
    only(found, "node-0/gpu0: instance in use 3g.40gb@4 is destroyed or moved")


def test_moved_used_instance() -> None:
    plan = make(
        targets={("node-0", 0): layouts.Layout.of([I(0, "3g.40gb"), I(4, "1g.10gb")])},
        placements=[],
        unschedulable=[plans.Unschedulable(p.key, "x") for p in SNAP.pods],
    )
    only(validation.problems(SNAP, plan), "instance in use 3g.40gb@4 is destroyed or moved")


def test_action_destroying_used_instance_is_named() -> None:
    plan = make(targets={("node-0", 0): layouts.Layout.of([I(0, "1g.10gb"), I(1, "1g.10gb")])})
    only(validation.problems(SNAP, plan), "node-0/gpu0: destroys instance in use 3g.40gb@4")


@pytest.mark.parametrize(
    ("layout", "reason"),
    [
        ([I(0, "4g.40gb"), I(0, "3g.40gb")], "overlap"),
        ([I(2, "3g.40gb")], "3g.40gb cannot start at memory slot 2"),
        ([I(0, "1g.10gb+me"), I(1, "1g.10gb+me")], "at most one media-extension"),
        ([I(0, "4g.40gb"), I(4, "4g.40gb")], "4g.40gb cannot start at memory slot 4"),
        ([I(0, "7g.80gb"), I(0, "1g.10gb")], "overlap on memory slot 0"),
    ],
)
def test_invalid_target_layout(layout: list[layouts.Instance], reason: str) -> None:
    plan = make(
        targets={("node-2", 0): layouts.Layout(tuple(layout))},
    )
    found = validation.problems(SNAP, plan)
    only(found, "node-2/gpu0: target layout is invalid: ")
    only(found, reason)


def test_target_layout_with_a_profile_the_gpu_lacks() -> None:
    plan = make()
    gpus = tuple(
        dataclasses.replace(g, layout=layouts.Layout((I(0, "1g.6gb"),)), changed=True)
        if (g.node, g.gpu) == ("node-2", 0)
        else g
        for g in plan.gpus
    )
    create = plans.Action("node-2", 0, plans.Op.CREATE, "1g.6gb", 0)
    broken = dataclasses.replace(plan, gpus=gpus, actions=(*plan.actions, create))
    only(validation.problems(SNAP, broken), "node-2/gpu0: target layout is invalid")


def test_placement_with_a_profile_the_gpu_lacks() -> None:
    plan = make(placements=replace_placement("default/p3", "node-1", A(0, "1g.6gb", 0)))
    found = validation.problems(SNAP, plan)
    only(
        found,
        "pod default/p3: node-1/gpu0: 1g.6gb is advertised as nvidia.com/mig-1g.6gb, but the pod "
        "requests nvidia.com/mig-7g.80gb",
    )


def test_gpu_missing_or_listed_twice() -> None:
    plan = make()
    missing = dataclasses.replace(plan, gpus=plan.gpus[1:])
    only(validation.problems(SNAP, missing), "does not list every GPU of the snapshot exactly once")
    twice = dataclasses.replace(plan, gpus=(*plan.gpus, plan.gpus[0]))
    only(validation.problems(SNAP, twice), "does not list every GPU of the snapshot exactly once")


def test_changed_flag_must_match() -> None:
    plan = make()
    flipped = tuple(dataclasses.replace(g, changed=not g.changed) for g in plan.gpus)
    found = validation.problems(SNAP, dataclasses.replace(plan, gpus=flipped))
    only(found, "node-0/gpu0: 'changed' is False but the layout changed")
    only(found, "node-2/gpu0: 'changed' is True but the layout did not change")


# --------------------------------------------------------------------------- actions


def _with_actions(actions: Iterable[plans.Action]) -> plans.Plan:
    return dataclasses.replace(make(), actions=tuple(actions))


ACTIONS_MISMATCH = "actions do not turn the current layouts into the target layouts"


def test_missing_action() -> None:
    only(validation.problems(SNAP, _with_actions(make().actions[1:])), ACTIONS_MISMATCH)


def test_extra_action() -> None:
    extra = plans.Action("node-2", 0, plans.Op.CREATE, "1g.10gb", 0)
    only(validation.problems(SNAP, _with_actions((*make().actions, extra))), ACTIONS_MISMATCH)


def test_duplicate_action() -> None:
    actions = make().actions
    only(validation.problems(SNAP, _with_actions((*actions, actions[0]))), ACTIONS_MISMATCH)


def test_wrong_op() -> None:
    actions = list(make().actions)
    actions[0] = dataclasses.replace(actions[0], op=plans.Op.DESTROY)
    only(validation.problems(SNAP, _with_actions(actions)), ACTIONS_MISMATCH)


def test_destroy_after_create() -> None:
    # Repartition node-0 gpu0's free 1g.10gb@0 into 2g.20gb@0: one destroy, one create.
    plan = make(
        targets={("node-0", 0): layouts.Layout.of([I(0, "2g.20gb"), I(4, "3g.40gb")])},
        placements=GOOD_PLACEMENTS[1:],
        unschedulable=[plans.Unschedulable("default/p1", "x"), *GOOD_UNSCHEDULABLE],
    )
    assert validation.problems(SNAP, plan) == []
    ops = [a.op for a in plan.actions if (a.node, a.gpu) == ("node-0", 0)]
    assert ops == [plans.Op.DESTROY, plans.Op.CREATE]
    swapped = (plan.actions[1], plan.actions[0], *plan.actions[2:])
    found = validation.problems(SNAP, dataclasses.replace(plan, actions=swapped))
    assert found == ["node-0/gpu0: a destroy comes after a create"]


# --------------------------------------------------------------------------- pods


def test_instance_given_twice() -> None:
    plan = make(
        placements=[
            *GOOD_PLACEMENTS,
            plans.Placement("default/p4", "node-0", (A(0, "1g.10gb", 1),)),
        ],
        unschedulable=[],
    )
    only(validation.problems(SNAP, plan), "1g.10gb@1 is given to two pods")


@pytest.mark.parametrize(
    ("pod", "node", "gpu", "profile", "reason"),
    [
        ("default/p1", "node-1", 0, "1g.10gb", "nodeSelector zone=a does not match"),
        ("default/p2", "node-1", 0, "3g.40gb", "taint k=v:NoSchedule is not tolerated"),
        ("default/p2", "node-2", 0, "3g.40gb", "node is cordoned"),
    ],
)
def test_pod_on_a_node_it_may_not_use(
    pod: str, node: str, gpu: int, profile: str, reason: str
) -> None:
    count = 2 if pod == "default/p1" else 1
    layout = layouts.Layout.of([I(s, profile) for s in range(0, 4 * count, 4)])
    instances = tuple(A(gpu, profile, i.start) for i in layout.instances)
    plan = make(
        targets={(node, gpu): layout},
        placements=replace_placement(pod, node, *instances),
    )
    if node == "node-1":  # p3's 7g.80gb no longer fits there; leave p3 out
        plan = make(
            targets={(node, gpu): layout},
            placements=[
                p for p in replace_placement(pod, node, *instances) if p.pod != "default/p3"
            ],
            unschedulable=[*GOOD_UNSCHEDULABLE, plans.Unschedulable("default/p3", "x")],
        )
    found = validation.problems(SNAP, plan)
    only(found, f"pod {pod}: node {node} does not admit it: {reason}")


def test_cpu_overcommit() -> None:
    plan = make(
        targets={("node-0", 1): layouts.Layout.of([I(0, "3g.40gb"), I(4, "1g.10gb")])},
        placements=[
            *GOOD_PLACEMENTS,
            plans.Placement("default/p4", "node-0", (A(1, "1g.10gb", 4),)),
        ],
        unschedulable=[],
    )
    found = validation.problems(SNAP, plan)
    only(found, "node node-0: pods need 10000m CPU, 8000m allocatable")
    only(found, f"node node-0: pods need {18 * 2**30} bytes, {16 * 2**30} allocatable")


def test_wrong_profile() -> None:
    plan = make(
        targets={("node-0", 1): layouts.Layout.of([I(0, "4g.40gb")])},
        placements=replace_placement("default/p2", "node-0", A(1, "4g.40gb", 0)),
    )
    found = validation.problems(SNAP, plan)
    only(found, "pod default/p2: node-0/gpu1: 4g.40gb is advertised as nvidia.com/mig-4g.40gb")
    only(found, "pod default/p2: got {} but asked for {'3g.40gb': 1}")


def test_too_few_instances() -> None:
    plan = make(placements=replace_placement("default/p1", "node-0", A(0, "1g.10gb", 0)))
    only(
        validation.problems(SNAP, plan),
        "pod default/p1: got {'1g.10gb': 1} but asked for {'1g.10gb': 2}",
    )


def test_too_many_instances() -> None:
    plan = make(
        targets={("node-0", 1): layouts.Layout.of([I(0, "3g.40gb"), I(4, "3g.40gb")])},
        placements=replace_placement(
            "default/p2", "node-0", A(1, "3g.40gb", 0), A(1, "3g.40gb", 4)
        ),
    )
    only(validation.problems(SNAP, plan), "pod default/p2: got {'3g.40gb': 2} but asked for")


def test_instance_not_in_target_layout() -> None:
    plan = make(placements=replace_placement("default/p2", "node-0", A(1, "3g.40gb", 4)))
    only(
        validation.problems(SNAP, plan),
        "pod default/p2: node-0/gpu1: 3g.40gb@4 is not in the target",
    )


def test_instance_already_in_use() -> None:
    plan = make(placements=replace_placement("default/p2", "node-0", A(0, "3g.40gb", 4)))
    only(
        validation.problems(SNAP, plan), "pod default/p2: node-0/gpu0: 3g.40gb@4 is already in use"
    )


def test_no_such_gpu() -> None:
    plan = make(placements=replace_placement("default/p2", "node-0", A(7, "3g.40gb", 0)))
    only(validation.problems(SNAP, plan), "pod default/p2: node-0/gpu7: no such GPU")


def test_unknown_node() -> None:
    plan = make(placements=replace_placement("default/p2", "node-9", A(0, "3g.40gb", 0)))
    only(validation.problems(SNAP, plan), "pod default/p2: placed on unknown node 'node-9'")


def test_pod_placed_and_unschedulable() -> None:
    plan = make(unschedulable=[*GOOD_UNSCHEDULABLE, plans.Unschedulable("default/p2", "x")])
    only(
        validation.problems(SNAP, plan), "pod default/p2: placed 1 times and unschedulable 1 times"
    )


def test_pod_placed_twice() -> None:
    plan = make(placements=[*GOOD_PLACEMENTS, GOOD_PLACEMENTS[1]])
    found = validation.problems(SNAP, plan)
    only(found, "pod default/p2: placed 2 times and unschedulable 0 times")


def test_pod_forgotten() -> None:
    plan = make(unschedulable=[])
    only(
        validation.problems(SNAP, plan), "pod default/p4: placed 0 times and unschedulable 0 times"
    )


def test_unknown_pod() -> None:
    plan = make(unschedulable=[*GOOD_UNSCHEDULABLE, plans.Unschedulable("default/ghost", "x")])
    only(validation.problems(SNAP, plan), "pod default/ghost: not in the snapshot")


# --------------------------------------------------------------------------- generated snapshots


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32), pods=st.integers(0, 30))
def test_keeping_everything_passes_on_generated_snapshots(seed: int, pods: int) -> None:
    snap = generate.random_snapshot(seed=seed, nodes=5, gpus_per_node=4, pods=pods)
    plan = plans.build(
        snap,
        planner="static",
        targets={},
        placements=(),
        unschedulable=[plans.Unschedulable(p.key, "x") for p in snap.pods],
    )
    assert validation.problems(snap, plan) == []


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**32))
def test_clearing_a_gpu_with_used_instances_is_caught(seed: int) -> None:
    snap = generate.random_snapshot(seed=seed, nodes=5, gpus_per_node=4, pods=3, used_fraction=0.5)
    used = [
        (n.name, g.index) for n in snap.nodes for g in n.gpus if any(i.used for i in g.instances)
    ]
    plan = plans.build(
        snap,
        planner="broken",
        targets={key: layouts.Layout(()) for key in used},
        placements=(),
        unschedulable=[plans.Unschedulable(p.key, "x") for p in snap.pods],
    )
    found = validation.problems(snap, plan)
    destroyed = [f for f in found if "destroyed or moved" in f]
    assert len(destroyed) == sum(
        1 for n in snap.nodes for g in n.gpus for i in g.instances if i.used
    )


def test_a_profile_of_the_same_shape_under_another_name_is_rejected() -> None:
    # kube-scheduler binds a pod asking nvidia.com/mig-3g.39gb only where that name is advertised:
    # a 3g.40gb (the same hardware shape on an A100-80GB) never serves it.
    snap = snapshot.parse(
        {
            "version": 1,
            "nodes": [{"name": "n", "gpus": [{"model": "a100-80gb"}]}],
            "pods": [{"name": "p", "requests": {"nvidia.com/mig-3g.39gb": 1}}],
        }
    )
    plan = plans.build(
        snap,
        planner="hand",
        targets={("n", 0): layouts.Layout.of([I(0, "3g.40gb")])},
        placements=[plans.Placement("default/p", "n", (A(0, "3g.40gb", 0),))],
        unschedulable=(),
    )
    only(
        validation.problems(snap, plan),
        "pod default/p: n/gpu0: 3g.40gb is advertised as nvidia.com/mig-3g.40gb, but the pod "
        "requests nvidia.com/mig-3g.39gb",
    )


# --------------------------------------------------------------------------- exact messages


def test_target_layout_with_an_unknown_profile_says_which() -> None:
    plan = make()
    gpus = tuple(
        dataclasses.replace(g, layout=layouts.Layout((I(0, "1g.6gb"),)), changed=True)
        if (g.node, g.gpu) == ("node-2", 0)
        else g
        for g in plan.gpus
    )
    create = plans.Action("node-2", 0, plans.Op.CREATE, "1g.6gb", 0)
    broken = dataclasses.replace(plan, gpus=gpus, actions=(*plan.actions, create))
    assert validation.problems(SNAP, broken) == [
        "node-2/gpu0: target layout is invalid: a100-80gb has no MIG profile '1g.6gb'"
    ]


def test_every_gpu_listed_exactly_once_is_the_only_problem() -> None:
    plan = make()
    twice = dataclasses.replace(plan, gpus=(*plan.gpus, plan.gpus[0]))
    assert validation.problems(SNAP, twice) == [
        "plan.gpus does not list every GPU of the snapshot exactly once"
    ]


def test_an_action_on_a_gpu_the_snapshot_lacks_is_an_action_too_many() -> None:
    for op in plans.Op:
        extra = plans.Action("node-9", 0, op, "1g.10gb", 0)
        assert validation.problems(SNAP, _with_actions((*make().actions, extra))) == [
            ACTIONS_MISMATCH
        ]


def test_destroys_are_ordered_per_gpu_only() -> None:
    # A create on node-0/gpu1, then node-0/gpu0's destroy and create: each GPU is in order.
    plan = make(
        targets={("node-0", 0): layouts.Layout.of([I(0, "2g.20gb"), I(4, "3g.40gb")])},
        placements=GOOD_PLACEMENTS[1:],
        unschedulable=[plans.Unschedulable("default/p1", "x"), *GOOD_UNSCHEDULABLE],
    )
    first = [a for a in plan.actions if (a.node, a.gpu) == ("node-0", 1)]
    assert [a.op for a in first] == [plans.Op.CREATE]
    rest = [a for a in plan.actions if a not in first]
    assert validation.problems(SNAP, dataclasses.replace(plan, actions=(*first, *rest))) == []


def test_a_placement_on_an_unknown_node_does_not_stop_the_checks() -> None:
    placements = [
        plans.Placement("default/p1", "node-9", (A(0, "1g.10gb", 0),)),
        plans.Placement("default/p2", "node-0", (A(0, "3g.40gb", 4),)),
        GOOD_PLACEMENTS[2],
    ]
    assert validation.problems(SNAP, make(placements=placements)) == [
        "pod default/p1: placed on unknown node 'node-9'",
        "pod default/p2: node-0/gpu0: 3g.40gb@4 is already in use",
    ]


SMALL = snapshot.parse(
    yaml.safe_load(
        """
version: 1
nodes:
  - name: a
    gpus: [{model: a100-80gb}]
  - name: b
    allocatable: {cpu: "4", memory: 8Gi}
    gpus: [{model: a100-80gb}]
pods:
  - {name: two, requests: {nvidia.com/mig-1g.10gb: 1, nvidia.com/mig-2g.20gb: 1}}
  - {name: full, requests: {nvidia.com/mig-1g.10gb: 1, cpu: "4", memory: 8Gi}}
  - {name: u, requests: {nvidia.com/gpu: 1, nvidia.com/gpumem: 8000}}
  - {name: more, requests: {nvidia.com/mig-1g.10gb: 1, cpu: 1m, memory: "1"}}
"""
    )
)
SMALL_TARGETS: dict[plans.GpuKey, layouts.Layout] = {
    ("a", 0): layouts.Layout.of([I(0, "1g.10gb"), I(1, "1g.10gb"), I(4, "3g.40gb")]),
    ("b", 0): layouts.Layout.of([I(0, "1g.10gb"), I(1, "1g.10gb")]),
}


def _small(*placements: plans.Placement) -> list[str]:
    """The problems of a plan with these placements (as given, instances in this order)."""
    placed = {p.pod for p in placements}
    plan = plans.build(
        SMALL,
        planner="hand",
        targets=SMALL_TARGETS,
        placements=(),
        unschedulable=[plans.Unschedulable(p.key, "x") for p in SMALL.pods if p.key not in placed],
    )
    return validation.problems(SMALL, dataclasses.replace(plan, placements=placements))


def test_cpu_and_memory_may_fill_allocatable_exactly() -> None:
    # Node a has no allocatable (nothing to check) and comes first; b is filled exactly.
    full = plans.Placement("default/full", "b", (A(0, "1g.10gb", 0),))
    assert _small(full) == []
    more = plans.Placement("default/more", "b", (A(0, "1g.10gb", 1),))
    assert _small(full, more) == [
        "node b: pods need 4001m CPU, 4000m allocatable",
        f"node b: pods need {8 * 2**30 + 1} bytes, {8 * 2**30} allocatable",
    ]


def test_an_instance_on_a_missing_gpu_does_not_stop_the_pods_checks() -> None:
    two = plans.Placement("default/two", "a", (A(3, "1g.10gb", 0), A(0, "1g.10gb", 2)))
    assert _small(two) == [
        "pod default/two: a/gpu3: no such GPU",
        "pod default/two: a/gpu0: 1g.10gb@2 is not in the target layout",
        "pod default/two: got {'1g.10gb': 1} but asked for {'1g.10gb': 1, '2g.20gb': 1}",
    ]


def test_a_profile_the_pod_does_not_request_names_every_request() -> None:
    two = plans.Placement("default/two", "a", (A(0, "1g.10gb", 0), A(0, "3g.40gb", 4)))
    assert _small(two) == [
        "pod default/two: a/gpu0: 3g.40gb is advertised as nvidia.com/mig-3g.40gb, but the pod "
        "requests nvidia.com/mig-1g.10gb, nvidia.com/mig-2g.20gb",
        "pod default/two: got {'1g.10gb': 1} but asked for {'1g.10gb': 1, '2g.20gb': 1}",
    ]


def test_a_unified_pod_given_too_much_is_named() -> None:
    u = plans.Placement("default/u", "a", (A(0, "1g.10gb", 0), A(0, "1g.10gb", 1)))
    found = _small(u)
    assert len(found) == 1
    assert found[0].startswith("pod default/u: got ")


def test_two_mig_pods_placed_against_their_anti_affinity_are_named() -> None:
    """Pod (anti-)affinity is checked over the MIG pods' placements: two pods that must not
    share a node, given instances on one node."""
    anti = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "x"}}, "topologyKey": "zone"}
            ]
        }
    }
    pod = {"labels": {"app": "x"}, "requests": {"nvidia.com/mig-1g.10gb": 1}, "affinity": anti}
    doc = {
        "version": 1,
        "nodes": [{"name": "node-0", "labels": {"zone": "a"}, "gpus": [{"model": "a100-80gb"}]}],
        "pods": [{"name": "a", **pod}, {"name": "b", **pod}],
    }
    snap = snapshot.parse(doc)
    target = layouts.Layout.of([I(0, "1g.10gb"), I(1, "1g.10gb")])
    placements = (
        plans.Placement("default/a", "node-0", (A(0, "1g.10gb", 0),)),
        plans.Placement("default/b", "node-0", (A(0, "1g.10gb", 1),)),
    )
    plan = plans.build(
        snap, planner="hand", targets={("node-0", 0): target}, placements=placements,
        unschedulable=(),
    )  # fmt: skip
    found = validation.problems(snap, plan)
    assert found and all(p.endswith("(pod affinity or topology spread)") for p in found), found
    alone = plans.build(
        snap, planner="hand", targets={("node-0", 0): target}, placements=placements[:1],
        unschedulable=(plans.Unschedulable("default/b", "anti-affinity"),),
    )  # fmt: skip
    assert validation.problems(snap, alone) == []
