"""Unified (HAMi-style) requests through the planning core: the snapshot file and the request
builders, every planner, the validator's rule and the reasons pods stay pending."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migpilot import errors
from migpilot.mig import catalog, layouts
from migpilot.planning import (
    generate,
    objective,
    options,
    planners,
    plans,
    snapshot,
    unified,
    validation,
)

H100 = catalog.resolve_gpu("h100-80gb")
H200 = catalog.resolve_gpu("h200")
A30 = catalog.resolve_gpu("a30")
OPTS = options.Options()
PLANNERS = ("fast", "first-fit", "nos", "hami-template", "hami-placement", "static")
MODELS = ("a30-24gb", "a100-40gb", "a100-80gb", "h100-80gb")


def _doc(*pods: dict[str, Any], nodes: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "version": 1,
        "nodes": nodes
        or [
            {"name": "h100", "gpus": [{"model": "h100-80gb"}, {"model": "h100-80gb"}]},
            {"name": "h200", "gpus": [{"model": "h200"}]},
        ],
        "pods": list(pods),
    }


def _pod(name: str, requests: dict[str, Any], **annotations: str) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "requests": requests}
    if annotations:
        out["annotations"] = annotations
    return out


def _parse(*pods: dict[str, Any], **kw: Any) -> snapshot.Snapshot:
    return snapshot.parse(_doc(*pods, **kw), source="s.yaml")


def _weighted(snap: snapshot.Snapshot, plan: plans.Plan) -> int:
    weights = objective.pod_weights(snap.pods)
    return sum(weights[p.pod] for p in plan.placements)


# --------------------------------------------------------------------------- the snapshot


def test_a_unified_pod_resolves_per_model() -> None:
    snap = _parse(
        _pod("p", {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8000, "cpu": "2"}),
        _pod(
            "q",
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 50},
            **{"nvidia.com/use-gputype": "H200", "hami.io/gpu-scheduler-policy": "binpack"},
        ),
    )
    p, q = snap.pods
    assert p.mig == () and p.unified is not None and p.count == 2 and p.cpu_milli == 2000
    assert p.profiles_on(H100) == ("1g.10gb", "1g.10gb")
    assert p.profiles_on(H200) == ("1g.18gb", "1g.18gb")
    assert q.profiles_on(H100) is None  # the filter allows only H200
    assert q.profiles_on(H200) == ("3g.71gb",)  # half the memory slices
    assert q.gpu_policy is snapshot.Policy.BINPACK and q.node_policy is None
    assert q.policies(snap) == (snapshot.Policy.BINPACK, snapshot.Policy.BINPACK)
    assert p.policies(snap) == (snapshot.Policy.BINPACK, snapshot.Policy.SPREAD)  # the defaults


def test_whole_gpus_are_unified_only_when_the_pod_asks_for_mig() -> None:
    # Alone, nvidia.com/gpu asks for a whole GPU (MIG off): planned only on dynamic nodes.
    whole = _parse(_pod("p", {"nvidia.com/gpu": 1}))
    assert whole.pods == () and [p.whole for p in whole.whole_pods] == [1]
    snap = _parse(_pod("p", {"nvidia.com/gpu": 1}, **{"nvidia.com/vgpu-mode": "mig"}))
    # HAMi's default memory (its chart's defaultMemory 0): the whole GPU's.
    assert snap.pods[0].profiles_on(H100) == ("7g.80gb",)


@pytest.mark.parametrize(
    ("pod", "message"),
    [
        (
            _pod("p", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10, "nvidia.com/mig-1g.10gb": 1}),
            "asks for both nvidia.com/mig-* and nvidia.com/gpu",
        ),
        (
            _pod("p", {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 150}),
            "pods[0].requests.nvidia.com/gpumem-percentage: 150 is outside 1 to 100",
        ),
        (
            _pod("p", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10}, **{"x": ["list"]}),
            "pods[0].annotations.x: label values must be strings",
        ),
        (
            _pod("p", {"nvidia.com/gpumem": 10}),
            "pods[0].requests.nvidia.com/gpumem: needs nvidia.com/gpu",
        ),
        (
            _pod("p", {"nvidia.com/mig-1g.10gb": 1}, **{"hami.io/node-scheduler-policy": "pack"}),
            "hami.io/node-scheduler-policy]: 'pack' is not binpack or spread",
        ),
    ],
)  # fmt: skip
def test_bad_unified_input_is_one_line_naming_the_field(pod: dict[str, Any], message: str) -> None:
    with pytest.raises(errors.SnapshotError) as err:
        _parse(pod)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_the_file_round_trips_unified_pods_and_policies() -> None:
    doc = _doc(
        _pod("p", {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8000, "nvidia.com/gpucores": 30}),
        _pod(
            "q",
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 20},
            **{
                "nvidia.com/nouse-gputype": "A30",
                "hami.io/node-scheduler-policy": "spread",
            },
        ),
        nodes=[
            {
                "name": "n",
                "allocatable": {"cpu": "8", "memory": "64Gi"},
                "capacity": {"cpu": "32", "memory": "256Gi"},
                "gpus": [{"model": "h100-80gb"}],
            }
        ],
    )
    doc["gpuPolicy"] = "binpack"
    snap = snapshot.parse(doc)
    assert snap.gpu_policy is snapshot.Policy.BINPACK
    assert snap.nodes[0].capacity == snapshot.Resources(32000, 256 * 2**30)
    again = snapshot.parse(snapshot.to_document(snap))
    assert again == snap


def test_container_requests_reads_a_kubernetes_pod_in_one_call() -> None:
    got = snapshot.container_requests(
        [
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000, "cpu": "1"},
            {"cpu": "500m", "memory": "1Gi"},
            {"nvidia.com/gpu": 2, "nvidia.com/gpumem-percentage": 40},
        ],
        init_containers=[{"cpu": "4"}],
        annotations={"hami.io/node-scheduler-policy": "spread", "other": "ignored"},
        where="pod default/p",
    )
    assert got.cpu_milli == 4000 and got.memory_bytes == 2**30  # an init container's larger CPU
    assert got.unified is not None and got.mig == ()
    assert [a.count for a in got.unified.asks] == [1, 2]
    assert got.node_policy is snapshot.Policy.SPREAD and got.gpu_policy is None
    assert unified.resolve(got.unified, H100) == ("1g.10gb", "3g.40gb", "3g.40gb")
    with pytest.raises(errors.SnapshotError, match=r"containers\[1\]\.nvidia.com/gpucores: 0"):
        snapshot.container_requests(
            [{"cpu": "1"}, {"nvidia.com/gpu": 1, "nvidia.com/gpucores": 0}], where="pod"
        )
    with pytest.raises(errors.SnapshotError, match=r"initContainers\[0\]: an init container"):
        snapshot.container_requests(
            [{"nvidia.com/mig-1g.10gb": 1}],
            init_containers=[{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1}],
            where="pod",
        )
    mig = snapshot.container_requests(
        [{"nvidia.com/mig-1g.10gb": 1}, {"nvidia.com/mig-1g.10gb": 2}], where="pod"
    )
    assert mig.mig == (snapshot.MigRequest("1g.10gb", 3),) and mig.unified is None


# --------------------------------------------------------------------------- planners

unified_args = st.fixed_dictionaries(
    dict(
        seed=st.integers(0, 10**6),
        nodes=st.integers(1, 6),
        gpus_per_node=st.integers(1, 4),
        pods=st.integers(1, 30),
        models=st.sampled_from([MODELS, MODELS[:2], ("a30-24gb", "a100-80gb"), MODELS[1:]]),
        used_fraction=st.sampled_from([0.0, 0.3, 0.7]),
        priority_levels=st.integers(1, 2),
        unified_fraction=st.sampled_from([0.5, 1.0]),
    )
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=unified_args)
def test_every_planner_serves_unified_pods_soundly(args: dict[str, Any]) -> None:
    snap = generate.random_snapshot(**args)
    for name in PLANNERS:
        plan = planners.run(snap, name, OPTS)
        assert validation.problems(snap, plan) == [], name
        pods = {p.key: p for p in snap.pods}
        models = {(n.name, g.index): g.model for n in snap.nodes for g in n.gpus}
        for pl in plan.placements:
            pod = pods[pl.pod]
            if pod.unified is None or name in {"hami-placement", "hami-template"}:
                continue  # HAMi may hand out a larger instance than the request resolves to
            # migpilot's planners give exactly the smallest profile that serves each GPU.
            model = models[(pl.node, pl.instances[0].gpu)]
            assert tuple(sorted(i.profile for i in pl.instances)) == pod.profiles_on(model)
        if name == "nos":
            assert all(pods[pl.pod].unified is None for pl in plan.placements)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=unified_args)
def test_fast_is_never_below_first_fit_with_unified_pods(args: dict[str, Any]) -> None:
    snap = generate.random_snapshot(**args)
    assert _weighted(snap, planners.run(snap, "fast", OPTS)) >= _weighted(
        snap, planners.run(snap, "first-fit", OPTS)
    )


@pytest.mark.parametrize("seed", range(4))
def test_exact_serves_unified_pods(seed: int) -> None:
    snap = generate.random_snapshot(
        seed=seed, nodes=3, gpus_per_node=2, pods=12, models=MODELS, unified_fraction=0.6
    )
    plan = planners.run(snap, "exact", options.Options(time_limit_s=5.0))
    assert validation.problems(snap, plan) == []
    if plan.optimal:
        assert _weighted(snap, plan) >= _weighted(snap, planners.run(snap, "fast", OPTS))


def test_hami_placement_takes_the_smallest_allowlisted_profile_with_room() -> None:
    # 15000 MiB resolves to 1g.20gb on an H100; HAMi's allowlist has no 1g.20gb, so HAMi gives
    # a 2g.20gb (at 4, the lowest free start), and then nothing fits the second pod; migpilot
    # gives each the 1g.20gb it resolves to, and both fit.
    nodes = [
        {
            "name": "n",
            "gpus": [
                {
                    "model": "h100-80gb",
                    "instances": [{"profile": "3g.40gb", "start": 0, "used": True}],
                }
            ],
        }
    ]
    ask = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 15000}
    snap = _parse(_pod("a", ask), _pod("b", ask), nodes=nodes)
    assert snap.pods[0].profiles_on(H100) == ("1g.20gb",)
    plan = planners.run(snap, "hami-placement", OPTS)
    assert validation.problems(snap, plan) == []
    got = {p.pod: [(i.profile, i.start) for i in p.instances] for p in plan.placements}
    assert got == {"default/a": [("2g.20gb", 4)]}
    ours = planners.run(snap, "fast", OPTS)
    assert {p.pod: [i.profile for i in p.instances] for p in ours.placements} == {
        "default/a": ["1g.20gb"],
        "default/b": ["1g.20gb"],
    }


def test_static_serves_unified_pods_from_free_instances() -> None:
    nodes = [
        {
            "name": "n",
            "gpus": [{"model": "h100-80gb", "instances": [{"profile": "1g.10gb", "start": 6}]}],
        }
    ]
    snap = _parse(
        _pod("a", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000}),
        _pod("b", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000}),
        nodes=nodes,
    )
    plan = planners.run(snap, "static", OPTS)
    assert [(p.pod, p.instances[0].start) for p in plan.placements] == [("default/a", 6)]
    assert validation.problems(snap, plan) == []


def test_nos_refuses_unified_pods_and_says_why() -> None:
    snap = _parse(_pod("a", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000}))
    plan = planners.run(snap, "nos", OPTS)
    assert plan.placements == ()
    assert "nos serves only nvidia.com/mig-* requests" in plan.unschedulable[0].reason


# --------------------------------------------------------------------------- validation


def _plan_with(snap: snapshot.Snapshot, *instances: tuple[str, int, str, int]) -> plans.Plan:
    """A plan creating each (node, gpu, profile, start) for the snapshot's one pod."""
    targets = {}
    for node, gpu, profile, start in instances:
        targets[(node, gpu)] = (
            *targets.get((node, gpu), ()),
            layouts.Instance(start, profile),
        )
    return plans.build(
        snap,
        planner="test",
        targets={k: layouts.Layout.of(v) for k, v in targets.items()},
        placements=[
            plans.Placement(
                snap.pods[0].key,
                instances[0][0],
                tuple(plans.AssignedInstance(g, p, s) for _, g, p, s in instances),
            )
        ],
        unschedulable=(),
    )


def test_validation_accepts_what_serves_the_ask_and_nothing_else() -> None:
    snap = _parse(
        _pod("a", {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 15000}),
        nodes=[
            {"name": "n", "gpus": [{"model": "h100-80gb"}, {"model": "h100-80gb"}]},
            {"name": "m", "gpus": [{"model": "a30"}]},
        ],
    )
    ok = _plan_with(snap, ("n", 0, "1g.20gb", 4), ("n", 1, "1g.20gb", 6))
    assert validation.problems(snap, ok) == []
    larger = _plan_with(snap, ("n", 0, "1g.20gb", 4), ("n", 0, "2g.20gb", 0))  # as HAMi may
    assert validation.problems(snap, larger) == []
    smaller = validation.problems(
        snap, _plan_with(snap, ("n", 0, "1g.20gb", 4), ("n", 1, "1g.10gb", 0))
    )
    assert any(
        "1g.10gb does not serve the pod's request (gpu 2, gpumem 15000)" in p for p in smaller
    )
    media = validation.problems(
        snap, _plan_with(snap, ("n", 0, "1g.20gb", 4), ("n", 1, "1g.10gb+me", 0))
    )
    assert any("does not serve" in p for p in media)
    short = validation.problems(snap, _plan_with(snap, ("n", 0, "1g.20gb", 4)))
    assert any("but asked for gpu 2, gpumem 15000" in p for p in short)
    filtered = _parse(
        _pod(
            "a",
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000},
            **{"nvidia.com/use-gputype": "A30"},
        ),
        nodes=[{"name": "n", "gpus": [{"model": "h100-80gb"}]}],
    )
    found = validation.problems(filtered, _plan_with(filtered, ("n", 0, "1g.10gb", 0)))
    assert any("h100-80gb is excluded by the pod's GPU model filters" in p for p in found)


def test_validation_matches_instances_to_containers() -> None:
    snap = dataclasses.replace(
        _parse(_pod("a", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000})),
        nodes=_parse(_pod("a", {"nvidia.com/mig-1g.10gb": 1})).nodes,
    )
    two = unified.UnifiedRequest(
        (unified.GpuAsk(1, memory_mib=30000), unified.GpuAsk(1, memory_mib=8000))
    )
    snap = dataclasses.replace(snap, pods=(dataclasses.replace(snap.pods[0], unified=two),))
    # 1g.10gb serves only the 8000 MiB container, 3g.40gb either: a matching exists.
    assert (
        validation.problems(
            snap, _plan_with(snap, ("h100", 0, "1g.10gb", 0), ("h100", 0, "3g.40gb", 4))
        )
        == []
    )
    # Two 1g.10gb: neither serves the 30000 MiB container.
    bad = validation.problems(
        snap, _plan_with(snap, ("h100", 0, "1g.10gb", 0), ("h100", 0, "1g.10gb", 1))
    )
    assert any("but asked for" in p for p in bad)


# --------------------------------------------------------------------------- reasons


def test_reasons_name_what_no_gpu_can_serve() -> None:
    snap = _parse(
        _pod("big", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 200000}),
        _pod(
            "a30",
            {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000},
            **{"nvidia.com/use-gputype": "A30"},
        ),
        _pod("ok", {"nvidia.com/gpu": 3, "nvidia.com/gpumem": 70000}),
    )
    for name in ("fast", "exact", "first-fit", "hami-placement"):
        plan = planners.run(snap, name, options.Options(time_limit_s=2.0))
        why = {u.pod: u.reason for u in plan.unschedulable}
        assert "asks more than any allowed GPU offers (at most 143360 MiB" in why["default/big"]
        assert "filters exclude every GPU model in the cluster" in why["default/a30"]
    plan = planners.run(snap, "fast", options.Options(explain=True))
    placed = {p.pod: p for p in plan.placements}
    assert "default/ok" not in placed  # 3 x 7g.80gb on two H100s, 3 x 3g.71gb on one H200
    ok = next(u for u in plan.unschedulable if u.pod == "default/ok")
    assert dict(ok.nodes)["h100"].startswith("no room for 3 x 7g.80gb")
