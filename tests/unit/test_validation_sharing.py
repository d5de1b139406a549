"""The plan validator on nodes in mode mps and time-slicing: each kind of broken plan is caught.

One sound plan is made by hand (slices kept, reused, created; a time-slicing replica), then
broken one fault at a time; each test asserts the exact problems found, so a check that is
dropped, loosened or that fires on a sound part shows as a difference.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import pytest

from migpilot.mig import layouts
from migpilot.planning import modes, plans, snapshot, validation

MODE = modes.MODE_LABEL
S = modes.MpsSlice
SH = plans.AssignedShare
CREATE, REMOVE = plans.SliceOp.CREATE, plans.SliceOp.REMOVE

SNAP = snapshot.parse(
    {
        "version": 1,
        "nodes": [
            {
                "name": "mps-0",
                "labels": {MODE: "mps"},
                "gpus": [
                    {"model": "a100-80gb", "mps": [
                        {"id": 0, "memoryGB": 40, "used": True},
                        {"id": 1, "memoryGB": 20},
                        {"id": 2, "memoryGB": 10, "cores": 30, "reservedFor": "default/r"},
                    ]},
                    {"model": "a100-80gb"},
                ],
            },
            {
                "name": "ts-0",
                "labels": {MODE: "time-slicing"},
                "gpus": [
                    {"model": "a100-40gb", "replicas": 2, "replicasUsed": 1},
                    {"model": "a100-40gb", "replicas": 3},
                ],
            },
            {"name": "mig-0", "gpus": [{"model": "a100-80gb"}]},
        ],
        "pods": [
            {"name": "m1", "requests": {"nvidia.com/gpu-20gb": 1}},
            {"name": "m2", "requests": {"nvidia.com/gpu-30gb": 1}},
            {"name": "t1", "requests": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000}},
            {"name": "u2", "requests": {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8000}},
            {"name": "um", "requests": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10000}},
        ],
    }
)  # fmt: skip

KEPT = (S(0, 40, used=True), S(1, 20), S(2, 10, 30, reserved_for="default/r"))
GOOD_MPS = (
    plans.MpsGpuPlan("mps-0", 0, False, KEPT),
    plans.MpsGpuPlan("mps-0", 1, True, (S(0, 30),)),
)
GOOD_SLICE_ACTIONS = (plans.SliceAction("mps-0", 1, CREATE, 0, 30, None, "for default/m2"),)
GOOD_PLACEMENTS = (
    plans.Placement("default/m1", "mps-0", (), (SH(0, 1, 20),)),
    plans.Placement("default/m2", "mps-0", (), (SH(1, 0, 30),)),
    plans.Placement("default/t1", "ts-0", (), (SH(1, None),)),
    plans.Placement("default/u2", "ts-0", (), (SH(0, None), SH(1, None))),
)


def make(
    *,
    mps: Iterable[plans.MpsGpuPlan] = GOOD_MPS,
    slice_actions: Iterable[plans.SliceAction] = GOOD_SLICE_ACTIONS,
    placements: Iterable[plans.Placement] = GOOD_PLACEMENTS,
    targets: dict[plans.GpuKey, layouts.Layout] | None = None,
    snap: snapshot.Snapshot = SNAP,
) -> plans.Plan:
    placements = tuple(placements)
    placed = {p.pod for p in placements}
    plan = plans.build(
        snap,
        planner="hand",
        targets=targets or {},
        placements=placements,
        unschedulable=[plans.Unschedulable(p.key, "x") for p in snap.pods if p.key not in placed],
    )
    return dataclasses.replace(plan, mps=tuple(mps), slice_actions=tuple(slice_actions))


def with_gpu0(*slices: S, changed: bool = False) -> tuple[plans.MpsGpuPlan, ...]:
    return (plans.MpsGpuPlan("mps-0", 0, changed, slices), GOOD_MPS[1])


def placing(
    pod: str, node: str, *shares: SH, instances: Iterable[plans.AssignedInstance] = ()
) -> list[plans.Placement]:
    """The sound placements with ``pod``'s replaced."""
    return [
        plans.Placement(pod, node, tuple(instances), shares) if p.pod == pod else p
        for p in GOOD_PLACEMENTS
    ]


def test_the_sound_plan_passes() -> None:
    assert validation.problems(SNAP, make()) == []


def test_no_mps_node_needs_no_mps_plan() -> None:
    mig_only = dataclasses.replace(
        SNAP, nodes=tuple(n for n in SNAP.nodes if n.name == "mig-0"), pods=()
    )
    assert (
        validation.problems(mig_only, make(snap=mig_only, mps=(), slice_actions=(), placements=()))
        == []
    )


# --------------------------------------------------------------------------- slices kept


def test_a_used_slice_removed_is_caught() -> None:
    plan = make(
        mps=with_gpu0(KEPT[1], KEPT[2], changed=True),
        slice_actions=(*GOOD_SLICE_ACTIONS, plans.SliceAction("mps-0", 0, REMOVE, 0, 40, None, "")),
    )
    assert validation.problems(SNAP, plan) == [
        "mps-0/gpu0: slice 0 of 40 GB in use is shrunk or removed"
    ]


@pytest.mark.parametrize(
    "changed", [S(2, 5, 30, reserved_for="default/r"), S(2, 10, 40, reserved_for="default/r")]
)
def test_a_reserved_slice_shrunk_or_given_other_cores_is_caught(changed: S) -> None:
    plan = make(mps=with_gpu0(KEPT[0], KEPT[1], changed))
    assert validation.problems(SNAP, plan) == [
        "mps-0/gpu0: slice 2 of 10 GB in use is shrunk or removed"
    ]


@pytest.mark.parametrize("changed", [S(1, 30), S(1, 20, 50)])
def test_a_free_slice_changed_in_place_is_caught(changed: S) -> None:
    plan = make(
        mps=with_gpu0(KEPT[0], changed, KEPT[2]),
        placements=[p for p in GOOD_PLACEMENTS if p.pod != "default/m1"],
    )
    assert validation.problems(SNAP, plan) == [
        "mps-0/gpu0: slice 1 changes in place (remove it, create another)"
    ]


def test_a_free_slice_removed_with_its_action_passes() -> None:
    plan = make(
        mps=with_gpu0(KEPT[0], KEPT[2], changed=True),
        slice_actions=(*GOOD_SLICE_ACTIONS, plans.SliceAction("mps-0", 0, REMOVE, 1, 20, None, "")),
        placements=[p for p in GOOD_PLACEMENTS if p.pod != "default/m1"],
    )
    assert validation.problems(SNAP, plan) == []


@pytest.mark.parametrize(("gpu", "changed"), [(0, True), (1, False)])
def test_the_changed_flag_must_match(gpu: int, changed: bool) -> None:
    mps = [dataclasses.replace(g, changed=changed) if g.gpu == gpu else g for g in GOOD_MPS]
    assert validation.problems(SNAP, make(mps=mps)) == [f"mps-0/gpu{gpu}: 'changed' is {changed}"]


def test_target_slices_that_do_not_fit_are_caught() -> None:
    plan = make(mps=(GOOD_MPS[0], plans.MpsGpuPlan("mps-0", 1, True, (S(0, 30), S(1, 60)))),
                slice_actions=(*GOOD_SLICE_ACTIONS,
                               plans.SliceAction("mps-0", 1, CREATE, 1, 60, None, "")))  # fmt: skip
    assert validation.problems(SNAP, plan) == [
        "mps-0/gpu1: target slices do not fit: slices of 90 GB exceed the GPU's 80 GB"
    ]


# --------------------------------------------------------------------------- plan.mps, actions


def test_every_mps_gpu_listed_exactly_once() -> None:
    message = "plan.mps does not list every GPU of the nodes in mode mps exactly once"
    missing = make(
        mps=GOOD_MPS[:1], placements=[p for p in GOOD_PLACEMENTS if p.pod != "default/m2"]
    )
    assert message in validation.problems(SNAP, missing)
    twice = make(mps=(*GOOD_MPS, GOOD_MPS[0]))
    assert validation.problems(SNAP, twice) == [message]


def test_mps_slices_on_a_gpu_not_in_mode_mps() -> None:
    plan = make(mps=(*GOOD_MPS, plans.MpsGpuPlan("mig-0", 0, False, ())))
    assert validation.problems(SNAP, plan) == [
        "plan.mps does not list every GPU of the nodes in mode mps exactly once",
        "mig-0/gpu0: MPS slices on a GPU not in mode mps",
    ]


SLICE_ACTIONS_WRONG = "slice actions do not turn the current MPS slices into the target slices"


@pytest.mark.parametrize(
    "actions",
    [
        (),
        (*GOOD_SLICE_ACTIONS, *GOOD_SLICE_ACTIONS),
        (plans.SliceAction("mps-0", 1, REMOVE, 0, 30, None, ""),),
        (*GOOD_SLICE_ACTIONS, plans.SliceAction("mps-0", 0, REMOVE, 1, 20, None, "")),
    ],
)
def test_slice_actions_must_turn_the_slices_into_the_targets(
    actions: tuple[plans.SliceAction, ...],
) -> None:
    assert validation.problems(SNAP, make(slice_actions=actions)) == [SLICE_ACTIONS_WRONG]


def test_a_slice_removed_needs_its_remove_action() -> None:
    plan = make(mps=with_gpu0(KEPT[0], KEPT[2], changed=True),
                placements=[p for p in GOOD_PLACEMENTS if p.pod != "default/m1"])  # fmt: skip
    assert validation.problems(SNAP, plan) == [SLICE_ACTIONS_WRONG]


def test_mig_instances_on_a_node_not_in_mode_mig() -> None:
    plan = make(targets={("mps-0", 1): layouts.Layout.of([layouts.Instance(0, "7g.80gb")])})
    assert validation.problems(SNAP, plan) == [
        f"mps-0/gpu1: MIG instances on a node in mode {modes.Mode.MPS}"
    ]


# --------------------------------------------------------------------------- slices given


def test_a_slice_in_use_is_never_given() -> None:
    plan = make(placements=placing("default/m1", "mps-0", SH(0, 2, 10)))
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: mps-0/gpu0: slice 2 is already in use",
        "pod default/m1: got slices of [10] GB but asked for [20]",
    ]


def test_a_slice_is_given_to_one_pod_only() -> None:
    plan = make(placements=placing("default/m2", "mps-0", SH(0, 1, 20)))
    assert validation.problems(SNAP, plan) == [
        "pod default/m2: mps-0/gpu0: slice 1 is given to two pods",
        "pod default/m2: got slices of [20] GB but asked for [30]",
    ]


def test_the_same_slice_id_on_two_gpus_is_two_slices() -> None:
    # Slice 0 of GPU 1 is not slice 0 of GPU 0 (in use): only the GPU and id together name one.
    assert (
        validation.problems(SNAP, make(placements=placing("default/m2", "mps-0", SH(1, 0, 30))))
        == []
    )


@pytest.mark.parametrize("share", [SH(0, 7, 20), SH(0, None, 20)])
def test_a_slice_not_in_the_targets_is_caught(share: SH) -> None:
    plan = make(placements=placing("default/m1", "mps-0", share))
    assert validation.problems(SNAP, plan) == [
        f"pod default/m1: mps-0/gpu0: slice {share.slice} is not in the target slices",
        "pod default/m1: got slices of [] GB but asked for [20]",
    ]


def test_a_slice_on_a_gpu_the_node_lacks_is_caught() -> None:
    plan = make(placements=placing("default/m1", "mps-0", SH(5, 1, 20)))
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: mps-0/gpu5: slice 1 is not in the target slices"
    ]


def test_a_share_must_name_its_slice_size() -> None:
    plan = make(placements=placing("default/m1", "mps-0", SH(0, 1, 30)))
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: mps-0/gpu0: slice 1 has 20 GB, not 30"
    ]


def test_a_pod_gets_exactly_the_sizes_it_asks() -> None:
    plan = make(placements=placing("default/m1", "mps-0", SH(0, 1, 20), SH(1, 0, 30)))
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: got slices of [20, 30] GB but asked for [20]",
        "pod default/m2: mps-0/gpu1: slice 0 is given to two pods",
    ]


def test_a_pod_given_nothing_on_an_mps_node_is_caught() -> None:
    plan = make(placements=placing("default/m1", "mps-0"))
    assert validation.problems(SNAP, plan) == ["pod default/m1: got no MPS slice on mps-0"]


def test_mig_instances_for_a_pod_on_an_mps_node_are_caught() -> None:
    plan = make(
        placements=placing(
            "default/m1", "mps-0", SH(0, 1, 20), instances=[plans.AssignedInstance(1, "7g.80gb", 0)]
        )
    )
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: given MIG instances on mps-0, not in mode mig"
    ]


def test_a_pod_on_a_node_whose_mode_does_not_serve_it() -> None:
    plan = make(placements=placing("default/m1", "ts-0", SH(1, None)))
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: node ts-0 is in mode time-slicing",
        "pod default/m1: got 1 replicas but asked for 0",
    ]


def test_shares_for_a_pod_on_a_mig_node_are_caught() -> None:
    snap = dataclasses.replace(
        SNAP,
        pods=(
            *SNAP.pods,
            snapshot.parse(
                {"version": 1, "nodes": [],
                 "pods": [{"name": "g", "requests": {"nvidia.com/mig-7g.80gb": 1}}]}
            ).pods[0],
        ),
    )  # fmt: skip
    placements = [
        *GOOD_PLACEMENTS,
        plans.Placement(
            "default/g", "mig-0", (plans.AssignedInstance(0, "7g.80gb", 0),), (SH(0, 1, 20),)
        ),
    ]
    plan = make(
        snap=snap,
        placements=placements,
        targets={("mig-0", 0): layouts.Layout.of([layouts.Instance(0, "7g.80gb")])},
    )
    assert validation.problems(snap, plan) == [
        "pod default/g: given MPS slices or replicas on mig-0, in mode mig"
    ]


# --------------------------------------------------------------------------- time-slicing


def test_the_last_free_replica_may_be_given() -> None:
    # GPU 0 has 2 replicas, 1 used: one more fits, exactly.
    plan = make(placements=placing("default/t1", "ts-0", SH(0, None)))
    assert validation.problems(SNAP, plan) == [
        "ts-0/gpu0: more than its 2 replicas given"
    ]  # u2 takes GPU 0's last replica already


def test_replicas_are_never_overcommitted() -> None:
    placements = [p for p in GOOD_PLACEMENTS if p.pod != "default/u2"]
    one = make(
        placements=[*placements[:2], plans.Placement("default/t1", "ts-0", (), (SH(0, None),))]
    )
    assert validation.problems(SNAP, one) == []
    three = [
        plans.Placement("default/t1", "ts-0", (), (SH(1, None),)),
        plans.Placement("default/u2", "ts-0", (), (SH(0, None), SH(1, None))),
    ]
    assert validation.problems(SNAP, make(placements=[*placements[:2], *three])) == []
    both = make(placements=placing("default/t1", "ts-0", SH(0, None)))
    assert "ts-0/gpu0: more than its 2 replicas given" in validation.problems(SNAP, both)


@pytest.mark.parametrize("share", [SH(1, 0), SH(4, None)])
def test_a_share_that_is_no_replica_is_caught(share: SH) -> None:
    plan = make(placements=placing("default/t1", "ts-0", share))
    assert validation.problems(SNAP, plan) == [
        f"pod default/t1: ts-0/gpu{share.gpu} is no time-slicing replica"
    ]


@pytest.mark.parametrize("shares", [(), (SH(0, None), SH(1, None))])
def test_a_pod_gets_one_replica_per_gpu_asked(shares: tuple[SH, ...]) -> None:
    plan = make(placements=placing("default/t1", "ts-0", *shares))
    found = validation.problems(SNAP, plan)
    assert f"pod default/t1: got {len(shares)} replicas but asked for 1" in found


def test_a_share_that_is_no_replica_does_not_stop_the_count() -> None:
    # u2's first share names no GPU of the node; its second still counts against GPU 0, which
    # t1 fills: two replicas over one free.
    plan = dataclasses.replace(
        make(),
        placements=(
            *GOOD_PLACEMENTS[:2],
            plans.Placement("default/t1", "ts-0", (), (SH(0, None),)),
            plans.Placement("default/u2", "ts-0", (), (SH(4, None), SH(0, None))),
        ),
    )
    assert validation.problems(SNAP, plan) == [
        "pod default/u2: ts-0/gpu4 is no time-slicing replica",
        "ts-0/gpu0: more than its 2 replicas given",
    ]


def test_a_pod_on_the_wrong_mode_does_not_stop_the_checks() -> None:
    g = snapshot.parse(
        {
            "version": 1,
            "nodes": [],
            "pods": [{"name": "g", "requests": {"nvidia.com/mig-7g.80gb": 1}}],
        }
    ).pods[0]
    snap = dataclasses.replace(SNAP, pods=(*SNAP.pods, g))
    placements = [
        *placing("default/m1", "ts-0", SH(1, None)),
        plans.Placement(
            "default/g", "mig-0", (plans.AssignedInstance(0, "7g.80gb", 0),), (SH(0, None),)
        ),
    ]
    plan = make(
        snap=snap,
        placements=placements,
        targets={("mig-0", 0): layouts.Layout.of([layouts.Instance(0, "7g.80gb")])},
    )
    assert validation.problems(snap, plan) == [
        "pod default/m1: node ts-0 is in mode time-slicing",
        "pod default/g: given MPS slices or replicas on mig-0, in mode mig",
        "pod default/m1: got 1 replicas but asked for 0",
    ]


# --------------------------------------------------------------------------- checks go on


def test_a_gpu_missing_from_plan_gpus_is_named_not_a_crash() -> None:
    plan = make()
    gpus = tuple(g for g in plan.gpus if (g.node, g.gpu) != ("mps-0", 0))
    assert validation.problems(SNAP, dataclasses.replace(plan, gpus=gpus)) == [
        "plan.gpus does not list every GPU of the snapshot exactly once"
    ]


def test_mps_slices_on_a_gpu_not_in_mode_mps_listed_first() -> None:
    plan = make(mps=(plans.MpsGpuPlan("mig-0", 0, False, ()), *GOOD_MPS))
    assert validation.problems(SNAP, plan) == [
        "plan.mps does not list every GPU of the nodes in mode mps exactly once",
        "mig-0/gpu0: MPS slices on a GPU not in mode mps",
    ]


def test_a_pod_the_snapshot_lacks_does_not_stop_the_slice_checks() -> None:
    ghost = plans.Placement("default/ghost", "mps-0", (), ())
    bad = placing("default/m1", "mps-0", SH(0, 1, 30))
    plan = dataclasses.replace(make(), placements=(ghost, *bad))
    assert validation.problems(SNAP, plan) == [
        "pod default/ghost: not in the snapshot",
        "pod default/ghost: placed on unknown node 'mps-0'",
        "pod default/m1: mps-0/gpu0: slice 1 has 20 GB, not 30",
    ]


def test_a_pod_given_nothing_does_not_stop_the_checks() -> None:
    plan = make(
        placements=[
            plans.Placement("default/m1", "mps-0", (), ()),
            plans.Placement("default/m2", "mps-0", (), (SH(1, 0, 20),)),
            *GOOD_PLACEMENTS[2:],
        ]
    )
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: got no MPS slice on mps-0",
        "pod default/m2: mps-0/gpu1: slice 0 has 30 GB, not 20",
    ]


def test_a_slice_not_in_the_targets_does_not_stop_the_pods_other_slices() -> None:
    m1 = plans.Placement("default/m1", "mps-0", (), (SH(0, 7, 20), SH(0, 1, 20)))
    plan = dataclasses.replace(make(), placements=(m1, *GOOD_PLACEMENTS[1:]))
    assert validation.problems(SNAP, plan) == [
        "pod default/m1: mps-0/gpu0: slice 7 is not in the target slices"
    ]


# --------------------------------------------------------------------------- unified on mps

UM_MPS = (
    GOOD_MPS[0],
    plans.MpsGpuPlan("mps-0", 1, True, (S(0, 30), S(1, 10), S(2, 10))),
)
UM_ACTIONS = (
    *GOOD_SLICE_ACTIONS,
    plans.SliceAction("mps-0", 1, CREATE, 1, 10, None, ""),
    plans.SliceAction("mps-0", 1, CREATE, 2, 10, None, ""),
)


def _um(*shares: SH) -> list[str]:
    placements = [*GOOD_PLACEMENTS, plans.Placement("default/um", "mps-0", (), shares)]
    return validation.problems(
        SNAP, make(mps=UM_MPS, slice_actions=UM_ACTIONS, placements=placements)
    )


def test_a_unified_pod_gets_one_slice_per_container() -> None:
    assert _um(SH(1, 1, 10)) == []
    assert _um(SH(1, 1, 10), SH(1, 2, 10)) == [
        "pod default/um: got slices of [10, 10] GB but asked for [10]",
        "pod default/um: two slices of one container on one GPU",
    ]


def test_a_unified_pod_given_no_slice_of_the_targets_is_named() -> None:
    assert _um(SH(1, 5, 10)) == [
        "pod default/um: mps-0/gpu1: slice 5 is not in the target slices",
        "pod default/um: got slices of [] GB but asked for [10]",
    ]
