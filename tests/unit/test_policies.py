"""Node and GPU policies (planning/scoring): the scores, and the node and GPU each planner picks
under binpack and spread, set for the snapshot or per pod by HAMi's annotations."""

from __future__ import annotations

from typing import Any

import pytest

from migpilot.planning import fast, objective, options, planners, scoring, snapshot, validation

OPTS = options.Options()
BINPACK, SPREAD = scoring.Policy.BINPACK, scoring.Policy.SPREAD


def test_scores_are_weighted_shares_and_binpack_ranks_the_most_used_first() -> None:
    gpu = scoring.gpu_use(slots_held=4, slots=8, slices_held=7, slices=7)
    assert gpu == pytest.approx(1.5)
    weights = scoring.Weights(gpu_memory=2.0, compute=0.0)
    assert scoring.gpu_use(slots_held=4, slots=8, slices_held=7, slices=7, weights=weights) == 1.0
    node = scoring.node_use(gpus=gpu, cpu_taken=16, cpu=64, memory_taken=0, memory=0)
    assert node == pytest.approx(1.75)  # an unconstrained resource counts 0
    assert sorted([0.5, 1.5], key=lambda u: scoring.rank(BINPACK, u)) == [1.5, 0.5]
    assert sorted([0.5, 1.5], key=lambda u: scoring.rank(SPREAD, u)) == [0.5, 1.5]
    assert (scoring.DEFAULT_NODE_POLICY, scoring.DEFAULT_GPU_POLICY) == (BINPACK, SPREAD)


def _gpu(*used: tuple[str, int]) -> dict[str, Any]:
    return {
        "model": "h100-80gb",
        "instances": [{"profile": p, "start": s, "used": True} for p, s in used],
    }


def _pod(annotations: dict[str, str] | None = None, **requests: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "name": "p",
        "requests": requests or {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000, "cpu": "1"},
    }
    if annotations:
        pod["annotations"] = annotations
    return pod


def _node_snapshot(pod: dict[str, Any], **top: Any) -> snapshot.Snapshot:
    """Two nodes whose first GPU is in the same state, equally good on the objective; ``busy``
    has a second GPU, in use whole, and three quarters of its CPU taken (capacity 64, 16 free),
    so it is the more used by every score (HAMi's counts GPUs only)."""
    nodes = [
        {
            "name": "idle",
            "allocatable": {"cpu": "64", "memory": "256Gi"},
            "capacity": {"cpu": "64", "memory": "256Gi"},
            "gpus": [_gpu(("3g.40gb", 4))],
        },
        {
            "name": "busy",
            "allocatable": {"cpu": "16", "memory": "256Gi"},
            "capacity": {"cpu": "64", "memory": "256Gi"},
            "gpus": [_gpu(("3g.40gb", 4)), _gpu(("7g.80gb", 0))],
        },
    ]
    return snapshot.parse({"version": 1, **top, "nodes": nodes, "pods": [pod]})


def _gpu_snapshot(pod: dict[str, Any], **top: Any) -> snapshot.Snapshot:
    """One node, two GPUs where a 3g.40gb goes at 4 at the same cost; GPU 1 is more used."""
    nodes = [
        {
            "name": "n",
            "gpus": [
                _gpu(("1g.10gb", 0)),
                _gpu(("1g.10gb", 0), ("1g.10gb", 1)),
            ],
        }
    ]
    return snapshot.parse({"version": 1, **top, "nodes": nodes, "pods": [pod]})


def _where(snap: snapshot.Snapshot, planner: str = "fast") -> tuple[str, int]:
    plan = planners.run(snap, planner, OPTS)
    assert validation.problems(snap, plan) == []
    (placement,) = plan.placements
    return placement.node, placement.instances[0].gpu


@pytest.mark.parametrize("planner", ["fast", "hami-placement"])
@pytest.mark.parametrize(
    ("top", "annotations", "want"),
    [
        ({}, None, "busy"),  # the default node policy: binpack, the most used node
        ({"policy": "spread"}, None, "idle"),
        ({"policy": "spread"}, {"hami.io/node-scheduler-policy": "binpack"}, "busy"),
        ({}, {"hami.io/node-scheduler-policy": "spread"}, "idle"),
    ],
)
def test_the_node_policy_picks_the_node(
    planner: str, top: dict[str, str], annotations: dict[str, str] | None, want: str
) -> None:
    assert _where(_node_snapshot(_pod(annotations), **top), planner)[0] == want


@pytest.mark.parametrize("planner", ["fast", "hami-placement"])
@pytest.mark.parametrize(
    ("top", "annotations", "want"),
    [
        ({}, None, 0),  # the default GPU policy: spread, the least used GPU
        ({"gpuPolicy": "binpack"}, None, 1),
        ({"gpuPolicy": "binpack"}, {"hami.io/gpu-scheduler-policy": "spread"}, 0),
        ({}, {"hami.io/gpu-scheduler-policy": "binpack"}, 1),
    ],
)
def test_the_gpu_policy_picks_the_gpu(
    planner: str, top: dict[str, str], annotations: dict[str, str] | None, want: int
) -> None:
    pod = _pod(annotations, **{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 30000})
    node, gpu = _where(_gpu_snapshot(pod, **top), planner)
    assert (node, gpu) == ("n", want)


def test_mig_pods_follow_the_policies_too() -> None:
    pod = _pod({"hami.io/gpu-scheduler-policy": "binpack"}, **{"nvidia.com/mig-3g.40gb": 1})
    assert _where(_gpu_snapshot(pod)) == ("n", 1)
    assert _where(_gpu_snapshot(_pod(None, **{"nvidia.com/mig-3g.40gb": 1}))) == ("n", 0)


def test_a_policy_never_costs_the_objective() -> None:
    # Spread would rather use the empty GPU, but filling the GPU already holding an instance
    # keeps a whole GPU free (free value ranks before the policy): both policies agree.
    nodes = [{"name": "n", "gpus": [_gpu(("1g.10gb", 6)), _gpu()]}]
    for policy in ("binpack", "spread"):
        snap = snapshot.parse({"version": 1, "gpuPolicy": policy, "nodes": nodes, "pods": [_pod()]})
        assert _where(snap) == ("n", 0)


@pytest.mark.parametrize(("policy", "want"), [("binpack", "cpu-busy"), ("spread", "cpu-idle")])
def test_fast_counts_cpu_in_the_node_score(policy: str, want: str) -> None:
    # The same GPUs; only the CPU taken (capacity minus allocatable) tells the nodes apart.
    nodes = [
        {
            "name": name,
            "allocatable": {"cpu": cpu, "memory": "256Gi"},
            "capacity": {"cpu": "64", "memory": "256Gi"},
            "gpus": [_gpu(("3g.40gb", 4))],
        }
        for name, cpu in (("cpu-idle", "64"), ("cpu-busy", "16"))
    ]
    snap = snapshot.parse({"version": 1, "policy": policy, "nodes": nodes, "pods": [_pod()]})
    assert _where(snap)[0] == want


def test_a_pod_asking_spread_itself_gets_a_gpu_of_its_own_even_if_that_touches_one_more() -> None:
    """An explicit ``hami.io/gpu-scheduler-policy: spread`` outranks GPUs touched and free room
    (the objective's ``crowded``); the default GPU policy (spread too) stays a tie-breaker."""

    def snap(annotations: dict[str, str]) -> snapshot.Snapshot:
        pods = [
            {"name": n, "requests": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000},
             "annotations": annotations}
            for n in ("s0", "s1")
        ]  # fmt: skip
        return snapshot.parse(
            {"version": 1, "nodes": [{"name": "n", "gpus": [{"model": "h100-80gb"}] * 2}],
             "pods": pods}
        )  # fmt: skip

    def gpus(s: snapshot.Snapshot) -> set[int]:
        plan = fast.plan(s, options.Options())
        assert len(plan.placements) == 2
        return {i.gpu for p in plan.placements for i in p.instances}

    assert gpus(snap({"hami.io/gpu-scheduler-policy": "spread"})) == {0, 1}
    assert len(gpus(snap({}))) == 1  # the default packs: one GPU touched
    assert len(gpus(snap({"hami.io/gpu-scheduler-policy": "binpack"}))) == 1
    spread = snap({"hami.io/gpu-scheduler-policy": "spread"})
    assert objective.score(spread, fast.plan(spread, options.Options())).crowded == 0


def test_a_pod_asking_node_spread_itself_gets_a_node_of_its_own() -> None:
    def snap(policy: str) -> snapshot.Snapshot:
        pods = [
            {"name": n, "requests": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000},
             "annotations": {"hami.io/node-scheduler-policy": policy}}
            for n in ("s0", "s1")
        ]  # fmt: skip
        nodes = [{"name": n, "gpus": [{"model": "h100-80gb"}]} for n in ("a", "b")]
        return snapshot.parse({"version": 1, "nodes": nodes, "pods": pods})

    def nodes(s: snapshot.Snapshot) -> set[str]:
        plan = fast.plan(s, options.Options())
        assert len(plan.placements) == 2
        assert not validation.problems(s, plan)
        return {p.node for p in plan.placements}

    assert nodes(snap("spread")) == {"a", "b"}
    assert nodes(snap("binpack")) == {"a"}
