"""nos's MPS partitioner as a baseline (``planning.nosmps``): what nos does on MPS nodes, the
scheduler's binding on time-slicing nodes, and the invariants every plan keeps."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from migpilot.planning import modes, nosmps, planners, plans, snapshot, validation
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps
from tests.unit import sharing_snapshots

MODE = modes.MODE_LABEL


def _node(name: str, mode: str, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "labels": {MODE: mode}, "gpus": gpus}


def _snap(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> snapshot.Snapshot:
    return snapshot.parse({"version": 1, "nodes": nodes, "pods": pods})


def _pod(name: str, requests: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "requests": requests, **extra}


def _nos(snap: snapshot.Snapshot) -> plans.Plan:
    plan = planners.run(snap, "nos")
    assert validation.problems(snap, plan) == []
    return plan


def _gpu(*slices: tuple[int, bool], model: str = "a100-80gb") -> dict[str, Any]:
    return {
        "model": model,
        "mps": [{"id": i, "memoryGB": gb, "used": used} for i, (gb, used) in enumerate(slices)],
    }


def test_a_free_slice_of_the_size_is_bound_without_any_change() -> None:
    snap = _snap([_node("n", "mps", [_gpu((40, True), (20, False))])],
                 [_pod("p", {"nvidia.com/gpu-20gb": 1})])  # fmt: skip
    plan = _nos(snap)
    assert plan.placements[0].shares == (plans.AssignedShare(0, 1, 20),)
    assert plan.slice_actions == ()
    assert plan.planner == "nos"


def test_free_slices_are_dropped_for_a_missing_size_never_the_one_in_use() -> None:
    snap = _snap([_node("n", "mps", [_gpu((40, True), (20, False), (20, False))])],
                 [_pod("p", {"nvidia.com/gpu-30gb": 1})])  # fmt: skip
    plan = _nos(snap)
    assert [(a.op, a.slice, a.memory_gb) for a in plan.slice_actions] == [
        (plans.SliceOp.REMOVE, 1, 20),
        (plans.SliceOp.REMOVE, 2, 20),
        (plans.SliceOp.CREATE, 3, 30),
    ]
    assert [(s.id, s.memory_gb) for s in plan.mps[0].slices] == [(0, 40), (3, 30)]
    assert plan.placements[0].shares == (plans.AssignedShare(0, 3, 30),)


def test_a_pod_lacks_nothing_while_the_cluster_has_a_free_slice_of_its_size() -> None:
    # The free 10 GB slice is on a node the pod may not use; nos judges "lacking" against the
    # whole cluster, so it plans nothing and the pod waits. migpilot's planner creates a slice.
    m2 = _node("m2", "mps", [_gpu()])
    m2["labels"]["zone"] = "b"
    snap = _snap(
        [_node("m1", "mps", [_gpu((10, False))]), m2],
        [_pod("b", {"nvidia.com/gpu-10gb": 1}, nodeSelector={"zone": "b"})],
    )
    plan = _nos(snap)
    assert plan.placements == ()
    assert plan.slice_actions == ()
    assert [p.node for p in planners.run(snap, "fast").placements] == ["m2"]


def test_smaller_slices_first_and_all_of_a_pod_on_one_gpu() -> None:
    snap = _snap(
        [_node("n", "mps", [_gpu(model="a100-40gb"), _gpu(model="a100-40gb")])],
        [_pod("big", {"nvidia.com/gpu-30gb": 1}), _pod("two", {"nvidia.com/gpu-15gb": 2})],
    )
    plan = _nos(snap)
    shares = {p.pod: p.shares for p in plan.placements}
    # GPU 0 is cut for the lacking sizes smallest first: 2 x 15 GB, then no room for 30 GB,
    # which GPU 1 gets; the pod asking two slices has both on GPU 0.
    assert {s.gpu for s in shares["default/two"]} == {0}
    assert [s.gpu for s in shares["default/big"]] == [1]


def test_at_most_48_clients_per_gpu() -> None:
    snap = _snap([_node("n", "mps", [_gpu()])],
                 [_pod(f"p{i}", {"nvidia.com/gpu-1gb": 1}) for i in range(50)])  # fmt: skip
    plan = _nos(snap)
    assert len(plan.placements) == sharing_config.MPS_MAX_CLIENTS
    assert len(plan.mps[0].slices) == sharing_config.MPS_MAX_CLIENTS


def test_unified_requests_read_as_the_gb_a_nos_user_writes() -> None:
    snap = _snap(
        [_node("n", "mps", [_gpu()])],
        [
            _pod("pct", {"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 5}),
            _pod("mib", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 30000}),
            _pod("cores", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000,
                           "nvidia.com/gpucores": 20}),
            _pod("two", {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 1000}),
        ],
    )  # fmt: skip
    plan = _nos(snap)
    got = {p.pod: [s.memory_gb for s in p.shares] for p in plan.placements}
    assert got == {"default/pct": [4], "default/mib": [30]}  # 5 % of 80 GB; 29.3 GB -> 30
    assert {u.pod for u in plan.unschedulable} == {"default/cores", "default/two"}


def test_time_slicing_replicas_are_bound_first_fit_and_never_overcommitted() -> None:
    ts = [{"model": "a100-40gb", "replicas": 2, "replicasUsed": 1},
          {"model": "a100-40gb", "replicas": 2}]  # fmt: skip
    snap = _snap(
        [_node("t1", "time-slicing", ts), _node("t0", "time-slicing", ts)],
        [_pod(f"u{i}", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000}) for i in range(7)],
    )
    plan = _nos(snap)
    assert [(p.node, p.shares[0].gpu) for p in plan.placements] == [
        ("t0", 0), ("t0", 1), ("t0", 1), ("t1", 0), ("t1", 1), ("t1", 1),
    ]  # fmt: skip
    assert plan.slice_actions == ()


def test_simulator_policy_nos_uses_it_on_mps_nodes() -> None:
    from migpilot.sim import clusters, policies, simulating, traces

    cluster = clusters.parse("a100-80gb:1x2@mps")
    trace = traces.synthetic("small-inference", seed=1, model=cluster.reference_model, pods=40,
                             requests=traces.Requests.UNIFIED)  # fmt: skip
    result = simulating.simulate(
        trace,
        cluster=cluster,
        policy=policies.dynamic("nos", cluster),
        settings=simulating.Settings(mode=simulating.Replay.FAITHFUL, paranoid=True),
    )
    assert result.pods_scheduled == 40
    assert result.reconfigurations > 0


# --------------------------------------------------------------------------- properties


@given(
    used=st.lists(st.integers(1, 20), max_size=4),
    free=st.lists(st.integers(1, 20), max_size=4),
    required=st.dictionaries(st.integers(1, 40), st.integers(1, 50), max_size=4),
)
def test_a_gpu_update_keeps_used_slices_memory_and_clients(
    used: list[int], free: list[int], required: dict[int, int]
) -> None:
    gpu = nosmps.NosGpu(0, 80, Counter(used), Counter(free))
    if gpu.sliced_gb() > 80:
        return
    before = Counter(gpu.used)
    gpu.update_for(required)
    assert gpu.used == before
    assert gpu.sliced_gb() <= 80
    assert gpu.clients() <= sharing_config.MPS_MAX_CLIENTS or gpu.clients() == len(used) + len(free)
    assert all(n >= 0 for n in gpu.free.values())


@given(
    sharing_snapshots.clusters(
        modes_=("mig", "mps", "mps", "time-slicing"),
        models=("a100-40gb", "a100-80gb"),
        max_slices=6,
        max_pods=14,
        mps_count=(1, 2),
        mig_count=(1, 1),
    )
)
def test_nos_plans_are_sound_and_never_shrink_or_remove_a_slice_in_use(
    snap: snapshot.Snapshot,
) -> None:
    plan = planners.run(snap, "nos")
    assert validation.problems(snap, plan) == []
    targets = {(g.node, g.gpu): {s.id: s for s in g.slices} for g in plan.mps}
    removed = {(a.node, a.gpu, a.slice) for a in plan.slice_actions if a.op is plans.SliceOp.REMOVE}
    for node in snap.nodes:
        for gpu in node.gpus:
            for s in gpu.mps:
                if s.taken:
                    assert targets[(node.name, gpu.index)][s.id].memory_gb == s.memory_gb
                    assert (node.name, gpu.index, s.id) not in removed
    models = {(n.name, g.index): g.model for n in snap.nodes for g in n.gpus}
    for g in plan.mps:
        assert sum(s.memory_gb for s in g.slices) <= sharing_mps.memory_gb(models[(g.node, g.gpu)])
        assert len(g.slices) <= sharing_config.MPS_MAX_CLIENTS
    assert {u.pod for u in plan.unschedulable} | {p.pod for p in plan.placements} == {
        p.key for p in snap.pods
    }
