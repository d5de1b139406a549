"""Every planner places exactly what pods request, and ``fast`` is never below a simpler one.

Property tests over generated snapshots of mixed GPU models (A30, A100-40GB, A100-80GB and
H100-80GB, whose profile names overlap only in part), partly occupied, with constraints, CPU
and memory, priorities and multi-instance pods.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migpilot.planning import (
    firstfit,
    generate,
    objective,
    options,
    planners,
    plans,
    snapshot,
    validation,
)

MODELS = ("a30-24gb", "a100-40gb", "a100-80gb", "h100-80gb")
OPTS = options.Options()
BASELINES = ("first-fit", "nos", "hami-template", "hami-placement", "static")


def weighted(snap: snapshot.Snapshot, plan: plans.Plan) -> int:
    weights = objective.pod_weights(snap.pods)
    return sum(weights[p.pod] for p in plan.placements)


def exact_names(snap: snapshot.Snapshot, plan: plans.Plan) -> list[str]:
    """Placements whose instances are not advertised under a resource name the pod requests."""
    pods = {p.key: p for p in snap.pods}
    gpus = {(n.name, g.index): g for n in snap.nodes for g in n.gpus}
    out = []
    for pl in plan.placements:
        requested = {snapshot.resource_name(r.profile) for r in pods[pl.pod].mig}
        for inst in pl.instances:
            model = gpus[(pl.node, inst.gpu)].model
            advertised = snapshot.resource_name(model.profile_named(inst.profile).name)
            if advertised not in requested:
                out.append(f"{pl.pod}: {advertised} on {model.id}, requested {sorted(requested)}")
    return out


# Drawn as generator arguments (readable when hypothesis reports a failure), not as snapshots.
snapshot_args = st.fixed_dictionaries(
    dict(
        seed=st.integers(0, 10**6),
        nodes=st.integers(1, 8),
        gpus_per_node=st.integers(1, 4),
        pods=st.integers(1, 40),
        models=st.sampled_from([MODELS, MODELS[:2], ("a30-24gb", "a100-80gb"), MODELS[1:]]),
        used_fraction=st.sampled_from([0.0, 0.3, 0.7]),
        priority_levels=st.integers(1, 3),
    )
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=snapshot_args)
def test_every_planner_places_exactly_the_requested_resources(args: dict[str, object]) -> None:
    snap = generate.random_snapshot(**args)  # type: ignore[arg-type]
    for name in ("fast", *BASELINES):
        plan = planners.run(snap, name, OPTS)
        assert validation.problems(snap, plan) == [], name
        assert exact_names(snap, plan) == [], name


@pytest.mark.parametrize("seed", range(6))
def test_exact_places_exactly_the_requested_resources(seed: int) -> None:
    snap = generate.random_snapshot(
        seed=seed, nodes=3, gpus_per_node=2, pods=12, models=MODELS, used_fraction=0.3
    )
    plan = planners.run(snap, "exact", options.Options(time_limit_s=5.0))
    assert validation.problems(snap, plan) == []
    assert exact_names(snap, plan) == []
    if plan.optimal:
        assert weighted(snap, plan) >= weighted(snap, planners.run(snap, "fast", OPTS))


# FLOOR_EXAMPLES widens the search (docs/planner.md: "never below a baseline" records the
# explore runs: HYPOTHESIS_PROFILE=explore FLOOR_EXAMPLES=2000 ... --hypothesis-seed=N).
@settings(
    max_examples=int(os.environ.get("FLOOR_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(args=snapshot_args)
def test_fast_is_never_below_first_fit_or_any_baseline(args: dict[str, object]) -> None:
    snap = generate.random_snapshot(**args)  # type: ignore[arg-type]
    ours = weighted(snap, planners.run(snap, "fast", OPTS))
    for name in BASELINES:
        assert ours >= weighted(snap, planners.run(snap, name, OPTS)), name


# Found by a wider search than the property test's (1 of 600 draws, before fast's binpack
# ties looked at the GPU room a node's CPU and memory can back): CPU and memory bind on every
# node and HAMi's binpack order happened to leave room for one more pod (fast 11, HAMi 12,
# exact 13).
def test_where_cpu_and_memory_bind_fast_is_not_below_hami() -> None:
    snap = generate.random_snapshot(
        seed=882439,
        nodes=7,
        gpus_per_node=1,
        pods=28,
        models=MODELS,
        used_fraction=0.7,
        priority_levels=1,
    )
    ours = weighted(snap, planners.run(snap, "fast", OPTS))
    assert ours >= weighted(snap, planners.run(snap, "hami-placement", OPTS))


@pytest.mark.parametrize(
    "args",
    [
        # Found by a wider random search; the clean-slate variant (plan as if free instances
        # were gone) is what keeps fast at or above HAMi on these.
        dict(seed=876507, nodes=5, gpus_per_node=1, pods=15, models=MODELS, used_fraction=0.7,
             priority_levels=2),
        dict(seed=962468, nodes=3, gpus_per_node=1, pods=23, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.0, priority_levels=2),
        dict(seed=357292, nodes=6, gpus_per_node=2, pods=22, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.7, priority_levels=3),
        dict(seed=371341, nodes=4, gpus_per_node=3, pods=25, models=("a30-24gb", "a100-40gb"),
             used_fraction=0.3, priority_levels=2),
        # A 4g.24gb and a pod of 4 x 1g.6gb of the same compute: the single large instance goes
        # first (it cannot span GPUs), else the small ones took its only GPU (fast 124, HAMi 137).
        dict(seed=2, nodes=6, gpus_per_node=2, pods=24, models=("a30-24gb", "a100-40gb"),
             used_fraction=0.3, priority_levels=2),
        # Spanning pods packed into few GPUs.
        dict(seed=613656, nodes=3, gpus_per_node=4, pods=13, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.0, priority_levels=1),
        # Found by random searches for issue 25 (9 of 4,500 draws; the figures before the fix:
        # fast below nos, HAMi or first-fit by one or two pods of the lowest level): closed by the
        # lookahead, the scarcity and spread variants and the repack of node pairs.
        dict(seed=869920, nodes=8, gpus_per_node=4, pods=28, models=MODELS,
             used_fraction=0.0, priority_levels=1),
        dict(seed=575866, nodes=4, gpus_per_node=2, pods=40, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.3, priority_levels=3),
        dict(seed=993927, nodes=2, gpus_per_node=1, pods=31, models=MODELS,
             used_fraction=0.7, priority_levels=2),
        dict(seed=372720, nodes=4, gpus_per_node=1, pods=30, models=("a30-24gb", "a100-40gb"),
             used_fraction=0.7, priority_levels=2),
        dict(seed=950599, nodes=4, gpus_per_node=4, pods=28, models=MODELS,
             used_fraction=0.7, priority_levels=3),
        dict(seed=729927, nodes=6, gpus_per_node=3, pods=11, models=("a30-24gb", "a100-40gb"),
             used_fraction=0.0, priority_levels=3),
        dict(seed=684745, nodes=3, gpus_per_node=2, pods=7, models=("a30-24gb", "a100-40gb"),
             used_fraction=0.0, priority_levels=3),
        dict(seed=906346, nodes=6, gpus_per_node=2, pods=13, models=MODELS,
             used_fraction=0.7, priority_levels=2),
        dict(seed=630968, nodes=8, gpus_per_node=3, pods=25, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.3, priority_levels=3),
        dict(seed=64931, nodes=7, gpus_per_node=1, pods=26, models=MODELS,
             used_fraction=0.0, priority_levels=3),
        # Strict xfails until the second change for issue 25 (fast before it, the best
        # baseline): 614746, fast 133, hami-placement 137 (a 96 GiB pod of priority 200 took a
        # node's memory whole, stranding two A100s: the lookahead now finishes the levels below
        # with the variant's own ties, and the "backed" ties put it where CPU and memory back
        # the room left); 833077, fast 97, hami-placement 114 (a priority-100 pod of two
        # 2g.20gb short: the "bulk" order, most compute first, places it before the 3g pods);
        # 4 (the explore run with --hypothesis-seed=1), fast 40, hami-placement 41 (a 4-CPU
        # pod on the 6-CPU node left its last slice unusable: the lookahead's scarcity order).
        dict(seed=614746, nodes=3, gpus_per_node=2, pods=17, models=MODELS, used_fraction=0.3,
             priority_levels=3),
        dict(seed=833077, nodes=7, gpus_per_node=1, pods=32, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.7, priority_levels=2),
        dict(seed=4, nodes=4, gpus_per_node=1, pods=23, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.7, priority_levels=2),
        # 185819: fast 941, hami-template 1100 (five pods of priority 200 fit three A30s one
        # way only, by memory: the 4g.24gb on the 64 GiB node, two small pods on the 48 GiB
        # one; no greedy order finds it, the search of a level does).
        dict(seed=185819, nodes=3, gpus_per_node=1, pods=36, models=("a30-24gb", "a100-80gb"),
             used_fraction=0.0, priority_levels=3),
        # Found by the explore run with --hypothesis-seed=2 (docs/planner.md): fast 74,
        # hami-placement 81. The priority-200 pod took a free 1g.10gb on the one GPU where the
        # 4 x 1g.10gb pod of priority 100 fits; every variant takes that free instance (it
        # costs nothing), the search of a level with the levels below as its tie-break does not.
        dict(seed=480, nodes=4, gpus_per_node=1, pods=15, models=MODELS, used_fraction=0.7,
             priority_levels=3),
    ],
)  # fmt: skip
def test_cases_a_wider_search_found(args: dict[str, object]) -> None:
    snap = generate.random_snapshot(**args)  # type: ignore[arg-type]
    ours = weighted(snap, planners.run(snap, "fast", OPTS))
    for name in BASELINES:
        assert ours >= weighted(snap, planners.run(snap, name, OPTS)), name


def test_memory_binds_across_priority_levels() -> None:
    # Found by a final wider search (1 in 400 draws): the priority-100 pods took node-00's
    # memory whole (64 + 32 of 96 GiB), so a low-priority 1g.6gb found no node (fast 36
    # weighted, nos 37, exact 37). The spread variant puts the two on the two A30 nodes, and
    # the repack of that pair of nodes fits five 1g.6gb pods beside them (fast 37).
    snap = generate.random_snapshot(
        seed=864410,
        nodes=6,
        gpus_per_node=1,
        pods=13,
        models=("a30-24gb", "a100-40gb"),
        used_fraction=0.3,
        priority_levels=2,
    )
    assert weighted(snap, planners.run(snap, "fast", OPTS)) >= weighted(
        snap, planners.run(snap, "nos", OPTS)
    )


@pytest.mark.parametrize("seed", range(12))
def test_fast_is_never_below_first_fit_on_trace_snapshots(seed: int) -> None:
    snap = generate.trace_snapshot(seed=seed, nodes=6, gpus_per_node=4, pods=60)
    assert weighted(snap, planners.run(snap, "fast", OPTS)) >= weighted(
        snap, firstfit.plan(snap, OPTS)
    )


def test_first_fit_takes_the_first_node_and_gpu_with_room() -> None:
    snap = snapshot.parse(
        {
            "version": 1,
            "nodes": [
                {"name": "a", "gpus": [{"model": "a30-24gb"}]},
                {
                    "name": "b",
                    "gpus": [
                        {
                            "model": "a100-80gb",
                            "instances": [{"profile": "4g.40gb", "start": 0, "used": True}],
                        },
                        {"model": "a100-80gb", "instances": [{"profile": "1g.10gb", "start": 6}]},
                    ],
                },
            ],
            "pods": [
                {"name": "p1", "requests": {"nvidia.com/mig-1g.10gb": 1}},
                {"name": "p2", "requests": {"nvidia.com/mig-3g.40gb": 1}},
                {"name": "p3", "requests": {"nvidia.com/mig-3g.40gb": 1}},
            ],
        }
    )
    plan = firstfit.plan(snap, OPTS)
    assert validation.problems(snap, plan) == []
    got = {
        p.pod: (p.node, [(i.gpu, i.profile, i.start) for i in p.instances]) for p in plan.placements
    }
    # The A30 advertises no 1g.10gb; on b, GPU 0 has room beside the 4g in use.
    assert got["default/p1"][0] == "b" and got["default/p1"][1][0][0] == 0
    # GPU 0 has no room for a 3g.40gb beside both; GPU 1's free 1g.10gb@6 stays (first-fit
    # destroys nothing) and a 3g.40gb still fits at 0.
    assert got["default/p2"] == ("b", [(1, "3g.40gb", 0)])
    # Nothing is left for p3 without destroying.
    assert [u.pod for u in plan.unschedulable] == ["default/p3"]
    assert not any(a.op is plans.Op.DESTROY for a in plan.actions)


def test_first_fit_leaves_a_pod_pending_rather_than_destroy() -> None:
    snap = snapshot.parse(
        {
            "version": 1,
            "nodes": [
                {
                    "name": "a",
                    "gpus": [
                        {"model": "a100-80gb", "instances": [{"profile": "1g.10gb", "start": 0}]}
                    ],
                }
            ],
            "pods": [{"name": "big", "requests": {"nvidia.com/mig-7g.80gb": 1}}],
        }
    )
    plan = firstfit.plan(snap, OPTS)
    assert plan.placements == ()
    assert [u.pod for u in plan.unschedulable] == ["default/big"]
    # fast destroys the free instance for it.
    assert [p.pod for p in planners.run(snap, "fast", OPTS).placements] == ["default/big"]


def test_hami_placement_not_above_fast_on_two_small_nodes() -> None:
    # Found by the property test above on a random (dev-profile) run on 2026-11-25 (fast 220
    # weighted, hami-placement 221, exact 222): CPU binds on the A100 node (12 cores), and
    # fast's priority-100 pods there took all 12. Repacking that node alone, its pods ordered
    # by the scarcity of what is left (CPU), places as many of priority 100 in 9 cores and one
    # more pod below (fast 222).
    snap = generate.random_snapshot(
        seed=1,
        nodes=2,
        gpus_per_node=2,
        pods=35,
        models=("a30-24gb", "a100-40gb"),
        used_fraction=0.3,
        priority_levels=2,
    )
    assert weighted(snap, planners.run(snap, "fast", OPTS)) >= weighted(
        snap, planners.run(snap, "hami-placement", OPTS)
    )


def test_memory_binds_on_one_node_of_three_a100s() -> None:
    # Found by the property test on a random run on 2026-11-25 (fast 1260 weighted, both HAMi
    # baselines 1261, exact 1282). Memory binds (192 GiB; 24 left after priority 200): the
    # priority-100 orders by compute or by share of the whole cluster took a 16 GiB 1g.5gb+me.
    # The scarcity order (what is left, memory weighted by how short it is) takes the 4 and
    # 8 GiB pods, and the lookahead over the level below picks that variant (fast 1281).
    snap = generate.random_snapshot(
        seed=40192,
        nodes=1,
        gpus_per_node=3,
        pods=38,
        models=("a100-40gb", "a100-80gb", "h100-80gb"),
        used_fraction=0.0,
        priority_levels=3,
    )
    ours = weighted(snap, planners.run(snap, "fast", OPTS))
    for name in ("hami-template", "hami-placement"):
        assert ours >= weighted(snap, planners.run(snap, name, OPTS)), name


def test_time_slicing_replicas_go_to_pods_asking_fewer_gpus_first() -> None:
    # Found by bench/bench_planner.py's sharing section ("time-slicing s4", proven optimal).
    # One node of four A100s time-sliced with 1, 3, 2 and 3 free replicas; neither CPU nor
    # memory binds. fast ordered the pods of a level by GB asked only (a 2-GPU pod of 10 GB
    # counts 20), so the two 2-GPU pods of priority 0 took four replicas that four 1-replica
    # pods would have used: 7 pods against nos's and exact's 9. On time-slicing GPUs replicas,
    # not memory, run out: fast now also tries fewest GPUs first and keeps the better order.
    snap = generate.sharing_snapshot(
        seed=4,
        nodes=1,
        gpus_per_node=4,
        pods=12,
        models=("a100-80gb", "h100-80gb"),
        node_modes=("time-slicing",),
        mps_fraction=0.0,
        unified_fraction=1.0,
    )
    assert weighted(snap, planners.run(snap, "fast", OPTS)) >= weighted(
        snap, planners.run(snap, "nos", OPTS)
    )


def test_time_slicing_node_memory_binds_below_the_level_above() -> None:
    # Found by bench/bench_planner.py's sharing section ("time-slicing s6", proven optimal).
    # Two nodes of eight time-sliced 80 GB GPUs; every pod but one can go to one node only,
    # whose 9 replicas and 152 GiB of node memory are left after the twelve priority-100
    # pods. Largest demand first put 64, 48 and 32 GiB pods there: 6 of 20 placed (fast 258
    # weighted), nos 8 (260), exact 10 (262). The node's memory, not the GPUs', binds: the
    # search of sharing.place (a level that leaves pods pending also tries smaller asks first,
    # among them least node memory first) now places 10, as exact does.
    snap = generate.sharing_snapshot(
        seed=6,
        nodes=2,
        gpus_per_node=8,
        pods=32,
        models=("a100-80gb", "h100-80gb"),
        node_modes=("time-slicing",),
        mps_fraction=0.0,
        unified_fraction=1.0,
    )
    assert weighted(snap, planners.run(snap, "fast", OPTS)) >= weighted(
        snap, planners.run(snap, "nos", OPTS)
    )


def test_a_level_leaves_the_room_the_level_below_needs() -> None:
    # Found by the sharing property below (before the lookahead): one MPS node of two 80 GB
    # GPUs with 10 and 50 GB free. Priority 200 places 3 of its 4 pods either way, a 40 GB
    # slice and two 10 GB ones (largest first: weighted 195, nothing else fits) or three
    # 10 GB ones, which leave 30 GB to the levels below (nos 211, exact 222). Orders that
    # place as many at a level are now judged by what the levels below then place.
    snap = generate.sharing_snapshot(
        seed=729804,
        nodes=1,
        gpus_per_node=2,
        pods=20,
        node_modes=("mps", "time-slicing"),
        models=("a100-80gb", "h100-80gb"),
        used_fraction=0.8,
        mps_fraction=0.4,
        unified_fraction=0.6,
        priority_levels=3,
    )
    assert weighted(snap, planners.run(snap, "fast", OPTS)) >= weighted(
        snap, planners.run(snap, "nos", OPTS)
    )


# MPS and time-slicing nodes only, so that fast's sharing planner meets nos's (the other
# baselines run fast's). GPUs of 80 GB only: nos binds a time-slicing replica to a unified pod
# whatever memory it asks (nosmps: kube-scheduler sees nvidia.com/gpu), and on a 24 or 40 GB
# GPU that counts pods that fast, rightly, leaves pending.
sharing_args = st.fixed_dictionaries(
    dict(
        seed=st.integers(0, 10**6),
        nodes=st.integers(1, 5),
        gpus_per_node=st.integers(1, 8),
        pods=st.integers(1, 40),
        node_modes=st.sampled_from([("mps",), ("time-slicing",), ("mps", "time-slicing")]),
        models=st.just(("a100-80gb", "h100-80gb")),
        used_fraction=st.sampled_from([0.0, 0.4, 0.8]),
        mps_fraction=st.sampled_from([0.0, 0.4, 0.6]),
        unified_fraction=st.just(0.4),
        priority_levels=st.integers(1, 3),
    )
)


@settings(
    max_examples=int(os.environ.get("FLOOR_EXAMPLES", "80")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(args=sharing_args)
def test_fast_is_never_below_a_baseline_on_mps_and_time_slicing_nodes(
    args: dict[str, object],
) -> None:
    snap = generate.sharing_snapshot(**args)  # type: ignore[arg-type]
    ours = weighted(snap, planners.run(snap, "fast", OPTS))
    for name in BASELINES:
        assert ours >= weighted(snap, planners.run(snap, name, OPTS)), name
