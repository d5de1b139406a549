"""The fast planner: rules, objective order, determinism, and validity on random snapshots."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.planning import fast, generate, objective, options, plans, snapshot, validation

OPTS = options.Options()


def node(name: str, gpus: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"name": name, "gpus": gpus, **extra}


def gpu(model: str, *instances: tuple[str, int, bool]) -> dict[str, Any]:
    return {
        "model": model,
        "instances": [{"profile": p, "start": s, "used": u} for p, s, u in instances],
    }


def pod(name: str, profile: str, count: int = 1, **extra: Any) -> dict[str, Any]:
    reqs = {snapshot.resource_name(profile): count, **extra.pop("requests", {})}
    return {"name": name, "requests": reqs, **extra}


def plan_of(
    nodes: list[dict[str, Any]], pods: list[dict[str, Any]], **kw: Any
) -> tuple[snapshot.Snapshot, plans.Plan]:
    snap = snapshot.parse({"version": 1, "nodes": nodes, "pods": pods, **kw})
    result = fast.plan(snap, OPTS)
    assert validation.problems(snap, result) == []
    return snap, result


def placed(result: plans.Plan) -> dict[str, list[tuple[int, str, int]]]:
    return {
        p.pod.split("/")[1]: [(i.gpu, i.profile, i.start) for i in p.instances]
        for p in result.placements
    }


def test_reuses_a_free_instance_without_any_action() -> None:
    _, result = plan_of(
        [node("n0", [gpu("h100-80gb", ("3g.40gb", 0, False), ("3g.40gb", 4, True))])],
        [pod("a", "3g.40gb")],
    )
    assert placed(result) == {"a": [(0, "3g.40gb", 0)]}
    assert result.actions == ()


def test_never_destroys_an_instance_in_use() -> None:
    _, result = plan_of(
        [node("n0", [gpu("h100-80gb", ("1g.10gb", 6, True))])],
        [pod("big", "7g.80gb")],
    )
    assert result.placements == ()
    assert "without destroying instances in use" in result.unschedulable[0].reason


def test_destroys_only_the_free_instances_in_the_way() -> None:
    # 4g.40gb lives only at slot 0: the free 1g at 0 and 1 must go; the free 1g at 6 stays.
    _, result = plan_of(
        [
            node(
                "n0",
                [
                    gpu(
                        "h100-80gb",
                        ("1g.10gb", 0, False),
                        ("1g.10gb", 1, False),
                        ("3g.40gb", 4, True),
                    )
                ],
            )
        ],
        [pod("a", "4g.40gb")],
    )
    assert placed(result) == {"a": [(0, "4g.40gb", 0)]}
    destroyed = [(a.profile, a.start) for a in result.actions if a.op is plans.Op.DESTROY]
    assert destroyed == [("1g.10gb", 0), ("1g.10gb", 1)]


def test_four_plus_three_after_destroying_free_1g() -> None:
    _, result = plan_of(
        [node("n0", [gpu("h100-80gb", ("1g.10gb", 0, False), ("3g.40gb", 4, True))])],
        [pod("a", "4g.40gb")],
    )
    assert placed(result) == {"a": [(0, "4g.40gb", 0)]}
    ops = [(a.op.value, a.profile, a.start) for a in result.actions]
    assert ops == [("destroy", "1g.10gb", 0), ("create", "4g.40gb", 0)]


def test_prefers_a_touched_gpu_over_a_new_one() -> None:
    _, result = plan_of(
        [node("n0", [gpu("a100-80gb"), gpu("a100-80gb")])],
        [pod("a", "3g.40gb"), pod("b", "3g.40gb")],
    )
    gpus_used = {i[0] for insts in placed(result).values() for i in insts}
    assert gpus_used == {0}
    assert sum(g.changed for g in result.gpus) == 1


def test_packs_jointly_on_one_gpu() -> None:
    # 4g + 3g fit one GPU only as 4g@0 + 3g@4: whichever comes first must not block the other.
    _, result = plan_of(
        [node("n0", [gpu("a100-40gb")])],
        [pod("small", "3g.20gb"), pod("large", "4g.20gb")],
    )
    assert sorted(placed(result)) == ["large", "small"]


def test_priority_wins_when_not_everything_fits() -> None:
    _, result = plan_of(
        [node("n0", [gpu("h100-80gb")])],
        [pod("low1", "2g.20gb"), pod("low2", "2g.20gb"), pod("high", "7g.80gb", priority=5)],
    )
    assert list(placed(result)) == ["high"]


def test_most_pods_when_capacity_is_short() -> None:
    # One H100: three 2g pods fit, or one 7g pod; same priority, so the three win.
    _, result = plan_of(
        [node("n0", [gpu("h100-80gb")])],
        [pod("big", "7g.80gb"), pod("s1", "2g.20gb"), pod("s2", "2g.20gb"), pod("s3", "2g.20gb")],
    )
    assert sorted(placed(result)) == ["s1", "s2", "s3"]


def test_multi_instance_pod_spans_gpus_of_one_node() -> None:
    _, result = plan_of(
        [node("n0", [gpu("h100-80gb"), gpu("h100-80gb")]), node("n1", [gpu("h100-80gb")])],
        [pod("wide", "7g.80gb", 2)],
    )
    assert sorted(placed(result)["wide"]) == [(0, "7g.80gb", 0), (1, "7g.80gb", 0)]
    assert result.placements[0].node == "n0"


def test_node_constraints_and_resources() -> None:
    taint = {"key": "k", "value": "v", "effect": "NoSchedule"}
    small = {"cpu": "1", "memory": "1Gi"}
    nodes = [
        node("cordoned", [gpu("h100-80gb")], unschedulable=True),
        node("tainted", [gpu("h100-80gb")], taints=[taint]),
        node("small", [gpu("h100-80gb")], allocatable=small, labels={"zone": "a"}),
        node("ok", [gpu("h100-80gb")], labels={"zone": "b"}),
    ]
    pods = [
        pod("sel", "1g.10gb", nodeSelector={"zone": "a"}, requests={"cpu": "2"}),
        pod("tol", "1g.10gb", tolerations=[{"key": "k", "operator": "Exists"}]),
        pod("any", "1g.10gb"),
    ]
    _, result = plan_of(nodes, pods)
    where = {p.pod.split("/")[1]: p.node for p in result.placements}
    assert "sel" not in where  # zone a is only 'small', which lacks CPU
    assert where["tol"] != "cordoned"
    assert where["any"] in ("small", "ok")  # neither cordoned nor tainted
    reason = result.unschedulable[0].reason
    assert "not enough CPU" in reason


def test_spread_policy_uses_the_least_loaded_nodes() -> None:
    # Each 7g pod needs a GPU of its own, so the node policy decides where it goes (it ranks
    # after instances destroyed, GPUs touched and free capacity, which tie here).
    nodes = [node(f"n{i}", [gpu("h100-80gb"), gpu("h100-80gb")]) for i in range(3)]
    pods = [pod(f"p{i}", "7g.80gb") for i in range(3)]
    _, packed = plan_of(nodes, pods)
    _, spread = plan_of(nodes, pods, policy="spread")
    assert sorted(p.node for p in packed.placements) == ["n0", "n0", "n1"]
    assert sorted(p.node for p in spread.placements) == ["n0", "n1", "n2"]


def test_unknown_profile_on_every_model_is_explained() -> None:
    _, result = plan_of([node("n0", [gpu("a30-24gb")])], [pod("x", "3g.40gb")])
    assert result.placements == ()
    assert "advertises nvidia.com/mig-3g.40gb" in result.unschedulable[0].reason


def test_explain_gives_a_reason_per_node() -> None:
    snap = snapshot.parse(
        {
            "version": 1,
            "nodes": [
                node("n0", [gpu("a30-24gb")]),
                node("n1", [gpu("h100-80gb")], unschedulable=True),
            ],
            "pods": [pod("x", "3g.40gb")],
        }
    )
    result = fast.plan(snap, options.Options(explain=True))
    nodes = dict(result.unschedulable[0].nodes)
    assert "do not advertise nvidia.com/mig-3g.40gb" in nodes["n0"]
    assert "cordoned" in nodes["n1"]


@pytest.mark.parametrize("seed", range(4))
def test_deterministic_and_valid_on_generated_snapshots(seed: int) -> None:
    snap = generate.random_snapshot(seed=seed, nodes=6, gpus_per_node=4, pods=40)
    a = fast.plan(snap, OPTS)
    b = fast.plan(snap, OPTS)
    assert plans.to_json(a) == plans.to_json(b)
    assert validation.problems(snap, a) == []


@settings(max_examples=40)
@given(
    seed=st.integers(0, 10_000),
    nodes=st.integers(1, 5),
    gpn=st.integers(1, 4),
    pods=st.integers(0, 30),
    trace=st.booleans(),
)
def test_every_plan_is_valid(seed: int, nodes: int, gpn: int, pods: int, trace: bool) -> None:
    make = generate.trace_snapshot if trace else generate.random_snapshot
    snap = make(seed=seed, nodes=nodes, gpus_per_node=gpn, pods=pods)
    result = fast.plan(snap, OPTS)
    assert validation.problems(snap, result) == []
    placed_keys = {p.pod for p in result.placements}
    assert len(placed_keys) + len(result.unschedulable) == len(snap.pods)
    assert objective.score(snap, result).placed == len(placed_keys)


def test_plans_are_the_same_with_cold_and_warm_caches() -> None:
    snap = generate.random_snapshot(seed=3, nodes=12, gpus_per_node=4, pods=60)
    warm = fast.plan(snap, options.Options())
    fast.clear_caches()
    cold = fast.plan(snap, options.Options())
    assert plans.to_json(cold, explain=True) == plans.to_json(warm, explain=True)


def test_variants_placing_as_many_pods_prefer_the_one_placing_more_compute() -> None:
    # A MIG-native inflate replay's snapshot (issue 25): two free H100 GPUs hold either the
    # pinned pod of two whole GPUs or the pinned pod of one. Both plans place five pods; fewer
    # GPUs touched and more free value would keep the larger pod pending (as the spread
    # variants' plans did), which then never finds two GPUs again under the backlog.
    product = "nvidia.com/gpu.product"
    h100, a100 = {product: "NVIDIA-H100-80GB-HBM3"}, {product: "NVIDIA-A100-SXM4-80GB"}
    busy = [gpu("h100-80gb", ("7g.80gb", 0, True)) for _ in range(5)]
    mixed = gpu("h100-80gb", ("1g.10gb", 0, True), ("1g.10gb", 1, True), ("3g.40gb", 4, True))
    nodes = [
        node(
            "h",
            [*busy, mixed, gpu("h100-80gb"), gpu("h100-80gb")],
            labels=h100,
            allocatable={"cpu": "37", "memory": "1Ti"},
        ),
        *(
            node(n, [gpu("a100-80gb") for _ in range(8)], labels=a100,
                 allocatable={"cpu": "96", "memory": "1Ti"})
            for n in ("a0", "a1")
        ),
    ]  # fmt: skip
    cpu = {"cpu": "10"}
    pods = [
        pod("one-a", "7g.80gb", requests=cpu),
        pod("one-b", "7g.80gb", requests=cpu),
        pod("four-a", "7g.80gb", 4, requests={"cpu": "42"}),
        pod("two-h100", "7g.80gb", 2, requests={"cpu": "21"}, nodeSelector=h100),
        pod("one-h100", "7g.80gb", requests=cpu, nodeSelector=h100),
        pod("four-b", "7g.80gb", 4, requests={"cpu": "42"}),
    ]
    _, result = plan_of(nodes, pods)
    assert {p.pod.split("/")[-1] for p in result.placements} == {
        "one-a",
        "one-b",
        "four-a",
        "two-h100",
        "four-b",
    }


def _stuck_of(snap: snapshot.Snapshot) -> set[str]:
    needs = {
        p.key: {m.id: need for m in snap.models if (need := p.profiles_on(m)) is not None}
        for p in snap.pods
    }
    return fast._stuck(snap, needs, fast.constraints.Admission(snap.nodes))


def test_a_pod_no_node_has_room_for_now_is_stuck() -> None:
    # Every GPU holds an instance in use: a pod of a whole GPU has room nowhere (its largest
    # instance), a pod of 4g.40gb beside a used 3g.40gb may have (a necessary test only), and
    # a pod of two 3g.40gb has room on one GPU each but not on one node's GPUs together when
    # one of them is full.
    h100 = "h100-80gb"
    snap = snapshot.parse({
        "version": 1,
        "nodes": [
            node("n0", [gpu(h100, ("3g.40gb", 4, True)), gpu(h100, ("1g.10gb", 6, True))]),
            node("n1", [gpu(h100, ("7g.80gb", 0, True)), gpu(h100, ("4g.40gb", 0, True))],
                 allocatable={"cpu": "4", "memory": "64Gi"}),
        ],
        "pods": [
            pod("whole", "7g.80gb"),
            pod("four", "4g.40gb"),
            pod("two-threes", "3g.40gb", 2),
            pod("three-cpu", "3g.40gb", requests={"cpu": "8"}),
            pod("four-wide", "4g.40gb", 2),
        ],
    })  # fmt: skip
    stuck = {k.split("/")[-1] for k in _stuck_of(snap)}
    # two-threes: n0 has two GPUs with a 3g.40gb's room (4 slices of each left on GPU 0, 6 on
    # GPU 1): not stuck. three-cpu: n0 has no allocatable limit, so it is not stuck either.
    # four-wide: two 4g.40gb on n0 need 8 memory slots with 4 + 7 free: room by the totals.
    assert stuck == {"whole"}


def test_a_free_instance_counts_as_room_and_cpu_as_a_limit() -> None:
    snap = snapshot.parse({
        "version": 1,
        "nodes": [
            node("n0", [gpu("h100-80gb", ("7g.80gb", 0, False))],
                 allocatable={"cpu": "4", "memory": "64Gi"}),
        ],
        "pods": [pod("fits", "7g.80gb"), pod("no-cpu", "7g.80gb", requests={"cpu": "8"})],
    })  # fmt: skip
    assert {k.split("/")[-1] for k in _stuck_of(snap)} == {"no-cpu"}


def test_a_stuck_backlog_changes_no_plan_and_each_stuck_pod_gets_a_reason() -> None:
    # A full cluster but for one GPU, with a backlog of pods of several whole GPUs: the plan
    # places what it places without them, and explains each.
    full = [gpu("h100-80gb", ("7g.80gb", 0, True)) for _ in range(3)]
    nodes = [node(f"n{i}", [*full, gpu("h100-80gb")]) for i in range(3)]
    small = [pod(f"s{i}", p) for i, p in enumerate(("3g.40gb", "4g.40gb", "2g.20gb", "1g.10gb"))]
    backlog = [pod(f"wide{i}", "7g.80gb", 4) for i in range(5)]
    snap_all, with_backlog = plan_of(nodes, backlog + small)
    _, without = plan_of(nodes, small)
    assert placed(with_backlog) == placed(without)
    assert with_backlog.actions == without.actions
    reasons = {u.pod.split("/")[-1]: u.reason for u in with_backlog.unschedulable}
    assert {f"wide{i}" for i in range(5)} <= set(reasons)
    assert all(reasons[f"wide{i}"] for i in range(5))
    assert {k.split("/")[-1] for k in _stuck_of(snap_all)} == {f"wide{i}" for i in range(5)}
