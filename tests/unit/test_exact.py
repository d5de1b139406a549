"""The exact planner: known optima on hand-made snapshots, every rule, and sound plans throughout.

Each snapshot is small enough that CP-SAT proves it in milliseconds, so the tests assert the
optimum itself (``optimal is True``) and not merely a good answer. Every plan also goes through
the independent validator and a check that no instance is created for nobody.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot import errors
from migpilot.mig import catalog, layouts
from migpilot.planning import exact, objective, options, plans, snapshot, validation

OPTS = options.Options(time_limit_s=5.0, workers=1)
I = layouts.Instance  # noqa: E741 (short, so expected layouts read like layouts)
A = plans.AssignedInstance


def gpu(*instances: tuple[str, int, bool], model: str = "h100-80gb") -> dict[str, Any]:
    """A GPU document; instances are (profile, start, used)."""
    return {
        "model": model,
        "instances": [{"profile": p, "start": s, "used": u} for p, s, u in instances],
    }


def node(name: str, *gpus: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {"name": name, "gpus": list(gpus), **fields}


def pod(name: str, profile: str, count: int = 1, **fields: Any) -> dict[str, Any]:
    requests = {snapshot.resource_name(profile): count, **fields.pop("requests", {})}
    return {"name": name, "requests": requests, **fields}


def solve(
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    opts: options.Options = OPTS,
) -> tuple[snapshot.Snapshot, plans.Plan]:
    """Plan a snapshot document and check the plan is sound and proven optimal."""
    snap = snapshot.parse({"version": 1, "nodes": nodes, "pods": pods})
    plan = exact.plan(snap, opts)
    assert plan.planner == "exact"
    assert validation.problems(snap, plan) == []
    assert_nothing_created_for_nobody(plan)
    assert plan.optimal is True
    return snap, plan


def assert_nothing_created_for_nobody(plan: plans.Plan) -> None:
    given = {(p.node, i.gpu, i.start, i.profile) for p in plan.placements for i in p.instances}
    for a in plan.actions:
        if a.op is plans.Op.CREATE:
            assert (a.node, a.gpu, a.start, a.profile) in given, a


def layout_of(plan: plans.Plan, node_name: str, index: int = 0) -> layouts.Layout:
    return next(g.layout for g in plan.gpus if g.node == node_name and g.gpu == index)


def placed(plan: plans.Plan) -> dict[str, str]:
    """Pod key -> node name."""
    return {p.pod: p.node for p in plan.placements}


def reason(plan: plans.Plan, pod_name: str) -> str:
    return next(u.reason for u in plan.unschedulable if u.pod == f"default/{pod_name}")


# --------------------------------------------------------------------------- known optima


def test_whole_gpu_pod_destroys_the_free_instance_in_its_way() -> None:
    _, plan = solve([node("n0", gpu(("1g.10gb", 0, False)))], [pod("p", "7g.80gb")])
    assert placed(plan) == {"default/p": "n0"}
    ops = [(a.op, a.profile, a.start) for a in plan.actions]
    assert ops == [(plans.Op.DESTROY, "1g.10gb", 0), (plans.Op.CREATE, "7g.80gb", 0)]


def test_an_instance_in_use_is_never_destroyed_and_the_pod_waits() -> None:
    _, plan = solve([node("n0", gpu(("1g.10gb", 0, True)))], [pod("p", "7g.80gb")])
    assert plan.placements == ()
    assert plan.actions == ()
    assert "in use" in reason(plan, "p")


def test_a_free_instance_of_the_right_profile_is_reused_without_any_action() -> None:
    _, plan = solve([node("n0", gpu(("3g.40gb", 4, False)))], [pod("p", "3g.40gb")])
    assert plan.actions == ()
    assert plan.placements[0].instances == (A(0, "3g.40gb", 4),)


def test_an_instance_in_use_never_serves_a_pending_pod() -> None:
    _, plan = solve([node("n0", gpu(("3g.40gb", 4, True)))], [pod("p", "3g.40gb")])
    assert plan.placements[0].instances == (A(0, "3g.40gb", 0),)


def test_a_pod_asking_for_two_profiles_gets_both() -> None:
    _, plan = solve(
        [node("n0", gpu())],
        [pod("p", "3g.40gb", requests={"nvidia.com/mig-4g.40gb": 1})],
    )
    assert plan.placements[0].instances == (A(0, "4g.40gb", 0), A(0, "3g.40gb", 4))


def test_free_instances_nobody_needs_are_kept() -> None:
    _, plan = solve(
        [node("n0", gpu(("1g.10gb", 0, False), ("1g.10gb", 1, False)))], [pod("p", "3g.40gb")]
    )
    assert placed(plan) == {"default/p": "n0"}
    # 3g.40gb fits at 4 beside both free instances: nothing is destroyed.
    assert [a.op for a in plan.actions] == [plans.Op.CREATE]
    assert layout_of(plan, "n0") == layouts.Layout.of(
        [I(0, "1g.10gb"), I(1, "1g.10gb"), I(4, "3g.40gb")]
    )


def test_two_pods_share_one_gpu_in_the_only_arrangement_that_fits() -> None:
    # 4g.40gb can only start at 0, so 3g.40gb must go to 4: a first-fit placement of the
    # 3g pod at 0 (the order the pods come in) would block the 4g pod.
    _, plan = solve([node("n0", gpu())], [pod("a", "3g.40gb"), pod("b", "4g.40gb")])
    assert set(placed(plan)) == {"default/a", "default/b"}
    assert layout_of(plan, "n0") == layouts.Layout.of([I(0, "4g.40gb"), I(4, "3g.40gb")])


def test_where_greedy_first_fit_fails_the_exact_planner_places_both() -> None:
    # GPU 0 is empty; GPU 1 has an instance in use at slot 4. Placing the 3g pod first on the
    # first GPU with room (GPU 0) leaves no whole GPU for the 7g pod. The optimum puts the 3g
    # pod beside the instance in use.
    _, plan = solve(
        [node("n0", gpu(), gpu(("1g.10gb", 4, True)))],
        [pod("first", "3g.40gb"), pod("second", "7g.80gb")],
    )
    assert set(placed(plan)) == {"default/first", "default/second"}
    by_pod = {p.pod: p.instances for p in plan.placements}
    assert by_pod["default/second"] == (A(0, "7g.80gb", 0),)
    assert by_pod["default/first"] == (A(1, "3g.40gb", 0),)


def test_a_higher_priority_pod_beats_any_number_of_lower_ones() -> None:
    _, plan = solve(
        [node("n0", gpu())],
        [
            pod("low-1", "2g.20gb"),
            pod("low-2", "2g.20gb"),
            pod("low-3", "2g.20gb"),
            pod("high", "7g.80gb", priority=10),
        ],
    )
    assert placed(plan) == {"default/high": "n0"}
    assert {u.pod for u in plan.unschedulable} == {f"default/low-{i}" for i in (1, 2, 3)}


def test_lower_priority_pods_fill_what_the_higher_ones_leave() -> None:
    _, plan = solve(
        [node("n0", gpu())],
        [pod("low", "1g.10gb", 3), pod("high", "4g.40gb", priority=5)],
    )
    assert set(placed(plan)) == {"default/high", "default/low"}


def test_a_multi_instance_pod_may_span_the_gpus_of_one_node() -> None:
    _, plan = solve([node("n0", gpu(), gpu())], [pod("p", "4g.40gb", 2)])
    assert plan.placements[0].instances == (A(0, "4g.40gb", 0), A(1, "4g.40gb", 0))


def test_a_multi_instance_pod_never_spans_nodes() -> None:
    _, plan = solve([node("n0", gpu()), node("n1", gpu())], [pod("p", "4g.40gb", 2)])
    assert plan.placements == ()
    assert plan.actions == ()


def test_a_pod_gets_all_it_asks_for_or_nothing() -> None:
    _, plan = solve(
        [node("n0", gpu(("3g.40gb", 0, True)))],
        [pod("p", "1g.10gb", 5)],
    )
    # Only four 1g.10gb fit beside the 3g.40gb in use: the pod is not placed by halves.
    assert plan.placements == ()
    assert plan.actions == ()


def test_media_extension_instances_are_one_per_gpu() -> None:
    _, plan = solve(
        [node("n0", gpu())],
        [pod("a", "1g.10gb+me"), pod("b", "1g.10gb+me")],
    )
    assert len(plan.placements) == 1
    assert plan.placements[0].instances[0].profile == "1g.10gb+me"


def test_requests_are_matched_by_exact_resource_name() -> None:
    # 3g.39gb is an older driver's name for the A100-80GB's 3g.40gb: kube-scheduler would never
    # bind a pod asking for it to a node advertising 3g.40gb.
    _, plan = solve(
        [node("n0", gpu(model="a100-80gb"))], [pod("p", "3g.39gb"), pod("q", "3g.40gb")]
    )
    assert [p.pod for p in plan.placements] == ["default/q"]
    assert plan.placements[0].instances[0].profile == "3g.40gb"
    assert "nvidia.com/mig-3g.39gb" in plan.unschedulable[0].reason


def test_mixed_models_on_one_node_each_serve_what_they_offer() -> None:
    _, plan = solve(
        [node("n0", gpu(), gpu(model="a100-80gb"))],
        [pod("a", "1g.10gb", 3), pod("b", "1g.10gb", 7), pod("c", "7g.80gb")],
    )
    # 14 1g.10gb fit on the two GPUs; the 7g pod would take one whole: 10 slices + 1 GPU is
    # impossible, so the best is two pods (any two of the three).
    assert len(plan.placements) == 2


# --------------------------------------------------------------------------- node rules


@pytest.mark.parametrize(
    ("blocked", "pod_fields"),
    [
        ({"labels": {"zone": "b"}}, {"nodeSelector": {"zone": "a"}}),
        ({"taints": [{"key": "gpu", "value": "x", "effect": "NoSchedule"}]}, {}),
        ({"taints": [{"key": "gpu", "value": "x", "effect": "NoExecute"}]}, {}),
        ({"unschedulable": True}, {}),
        (
            {"labels": {"zone": "b"}},
            {
                "affinity": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "zone", "operator": "NotIn", "values": ["b"]}
                                    ]
                                }
                            ]
                        }
                    }
                }
            },
        ),
    ],
    ids=["node-selector", "taint-no-schedule", "taint-no-execute", "cordoned", "affinity"],
)
def test_node_constraints_are_honoured(blocked: dict[str, Any], pod_fields: dict[str, Any]) -> None:
    # The blocked node comes first and has a free 7g.80gb ready: the pod must still go elsewhere.
    _, plan = solve(
        [
            node("blocked", gpu(("7g.80gb", 0, False)), **blocked),
            node("open", gpu(), labels={"zone": "a"}),
        ],
        [pod("p", "7g.80gb", **pod_fields)],
    )
    assert placed(plan) == {"default/p": "open"}


def test_a_tolerated_taint_admits_the_pod() -> None:
    _, plan = solve(
        [node("n0", gpu(("7g.80gb", 0, False)), taints=[{"key": "gpu", "effect": "NoSchedule"}])],
        [pod("p", "7g.80gb", tolerations=[{"key": "gpu", "operator": "Exists"}])],
    )
    assert plan.actions == ()
    assert placed(plan) == {"default/p": "n0"}


@pytest.mark.parametrize(
    ("allocatable", "requests", "fits"),
    [
        ({"cpu": "4"}, {"cpu": "2"}, 2),
        ({"cpu": "4500m"}, {"cpu": "1500m"}, 3),
        ({"memory": "16Gi"}, {"memory": "6Gi"}, 2),
        ({"cpu": "64", "memory": "8Gi"}, {"cpu": "1", "memory": "8Gi"}, 1),
    ],
)
def test_cpu_and_memory_bound_the_pods_on_a_node(
    allocatable: dict[str, str], requests: dict[str, str], fits: int
) -> None:
    _, plan = solve(
        [node("n0", gpu(), allocatable=allocatable)],
        [pod(f"p{i}", "1g.10gb", requests=requests) for i in range(5)],
    )
    assert len(plan.placements) == fits
    assert all("not enough" in u.reason or "CPU" in u.reason for u in plan.unschedulable)


# --------------------------------------------------------------------------- bad input


def test_a_pod_no_model_offers_is_unschedulable_and_nothing_else_fails() -> None:
    _, plan = solve(
        [node("n0", gpu())],
        [pod("odd", "1g.6gb"), pod("ok", "1g.10gb")],
    )
    assert placed(plan) == {"default/ok": "n0"}
    assert "no GPU in the cluster advertises" in reason(plan, "odd")


def test_a_pod_asking_for_more_than_the_cluster_has_is_unschedulable() -> None:
    _, plan = solve(
        [node("n0", gpu(), gpu())],
        [pod("huge", "7g.80gb", 3), pod("ok", "7g.80gb")],
    )
    assert placed(plan) == {"default/ok": "n0"}
    assert "default/huge" in {u.pod for u in plan.unschedulable}


@pytest.mark.parametrize(
    ("nodes", "pods"),
    [([], [pod("p", "1g.10gb")]), ([node("n0", gpu(("1g.10gb", 0, False)))], [])],
    ids=["no-nodes", "no-pods"],
)
def test_an_empty_snapshot_gives_a_trivial_plan(
    nodes: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> None:
    _, plan = solve(nodes, pods)
    assert plan.actions == ()
    assert plan.placements == ()
    assert len(plan.unschedulable) == len(pods)


# --------------------------------------------------------------------------- objectives 2 and 3


def test_fewest_destroyed_then_fewest_gpus_touched() -> None:
    # GPU 0 has free instances in the way of a 4g.40gb; GPU 1 is empty. Destroying nothing
    # (creating on GPU 1) beats destroying on GPU 0.
    snap, plan = solve(
        [node("n0", gpu(("1g.10gb", 0, False), ("1g.10gb", 2, False)), gpu())],
        [pod("p", "4g.40gb")],
    )
    score = objective.score(snap, plan)
    assert (score.placed, score.destroyed, score.touched) == (1, 0, 1)
    assert plan.placements[0].instances == (A(1, "4g.40gb", 0),)


def test_the_free_value_left_is_the_largest_possible() -> None:
    snap, plan = solve([node("n0", gpu())], [pod("p", "1g.10gb")])
    model = snap.nodes[0].gpus[0].model
    best = max(layouts.free_value(model, layouts.Layout.of([I(s, "1g.10gb")])) for s in range(7))
    assert objective.score(snap, plan).free_value == best


def test_explain_gives_a_reason_per_node() -> None:
    _, plan = solve(
        [node("n0", gpu(("1g.10gb", 0, True))), node("n1", gpu(), unschedulable=True)],
        [pod("p", "7g.80gb")],
        options.Options(time_limit_s=5.0, workers=1, explain=True),
    )
    (entry,) = plan.unschedulable
    assert [n for n, _ in entry.nodes] == ["n0", "n1"]
    assert "cordoned" in dict(entry.nodes)["n1"]


# --------------------------------------------------------------------------- determinism


def medium() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Three nodes, mixed models, some instances in use or free, pods of two priorities."""
    nodes = [
        node("n0", gpu(("3g.40gb", 4, True), ("1g.10gb", 0, False)), gpu(("2g.20gb", 2, False))),
        node("n1", gpu(model="a100-80gb"), gpu(("1g.10gb", 6, True), model="a100-80gb")),
        node("n2", gpu(model="a30-24gb"), gpu(("2g.12gb", 0, True), model="a30-24gb")),
    ]
    pods = [
        pod("a", "3g.40gb"),
        pod("b", "4g.40gb", priority=1),
        pod("c", "1g.10gb", 3),
        pod("d", "2g.20gb", 2),
        pod("e", "7g.80gb"),
        pod("f", "1g.6gb", 2),
        pod("g", "4g.24gb", priority=1),
        pod("h", "1g.10gb", requests={"cpu": "2"}),
    ]
    return nodes, pods


def test_same_snapshot_same_plan_with_one_worker() -> None:
    nodes, pods = medium()
    _, first = solve(nodes, pods)
    _, second = solve(nodes, pods)
    assert plans.to_json(first) == plans.to_json(second)


def test_more_workers_reach_the_same_objective_values() -> None:
    nodes, pods = medium()
    snap, one = solve(nodes, pods)
    _, two = solve(nodes, pods, options.Options(time_limit_s=5.0, workers=2))
    a, b = objective.score(snap, one), objective.score(snap, two)
    assert (a.weighted, a.destroyed, a.touched) == (b.weighted, b.destroyed, b.touched)


# --------------------------------------------------------------------------- against brute force

BRUTE_MODELS = ("h100-80gb", "a30-24gb")


@st.composite
def one_gpu_cases(draw: st.DrawFn) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One GPU with a random current layout (some instances in use) and a few pods."""
    model = catalog.resolve_gpu(draw(st.sampled_from(BRUTE_MODELS)))
    full = draw(st.sampled_from(layouts.enumerate_layouts(model)))
    current = [
        (i.profile, i.start, draw(st.booleans()))
        for i in full.instances
        if draw(st.integers(0, 2))  # keep about two thirds of the instances
    ]
    names = [p.name for p in model.profiles]
    pods = [
        pod(
            f"p{k}",
            draw(st.sampled_from(names)),
            draw(st.integers(1, 2)),
            priority=draw(st.integers(0, 1)),
        )
        for k in range(draw(st.integers(1, 4)))
    ]
    return gpu(*current, model=model.id), pods


def best_by_brute_force(snap: snapshot.Snapshot) -> tuple[int, ...]:
    """Pods placed per priority level (highest first), maximised over every subset of pods."""
    gpu_ = snap.nodes[0].gpus[0]
    used = [i.instance for i in gpu_.instances if i.used]
    levels = sorted({p.priority for p in snap.pods}, reverse=True)
    best: tuple[int, ...] = (0,) * len(levels)
    for size in range(len(snap.pods) + 1):
        for subset in itertools.combinations(snap.pods, size):
            wanted = [name for p in subset for name in p.profiles_on(gpu_.model) or ()]
            if any(p.profiles_on(gpu_.model) is None for p in subset):
                continue
            try:
                layouts.place(gpu_.model, wanted, fixed=used)
            except errors.LayoutError:
                continue
            best = max(best, tuple(sum(p.priority == lv for p in subset) for lv in levels))
    return best


@settings(max_examples=60, deadline=None)
@given(one_gpu_cases())
def test_the_pod_objective_matches_brute_force_on_one_gpu(
    case: tuple[dict[str, Any], list[dict[str, Any]]],
) -> None:
    gpu_doc, pods = case
    snap, plan = solve([node("n0", gpu_doc)], pods)
    levels = sorted({p.priority for p in snap.pods}, reverse=True)
    got = {p.pod for p in plan.placements}
    achieved = tuple(sum(p.priority == lv and p.key in got for p in snap.pods) for lv in levels)
    assert achieved == best_by_brute_force(snap)
