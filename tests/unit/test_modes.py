"""Nodes in mode mps, time-slicing and none (``planning.modes``, ``planning.sharing``): the
snapshot's modes, slices and replicas, MPS requests (``nvidia.com/gpu-<N>gb``), and the sharing
planner beside the MIG planners."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given

from migpilot import errors
from migpilot.planning import modes, planners, plans, sharing, snapshot, validation
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps
from tests.unit import sharing_snapshots

MODE = modes.MODE_LABEL


def _node(name: str, mode: str | None, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": name, "gpus": gpus}
    if mode is not None:
        out["labels"] = {MODE: mode}
    return out


def _snap(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> snapshot.Snapshot:
    return snapshot.parse({"version": 1, "nodes": nodes, "pods": pods})


def _pod(name: str, requests: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "requests": requests, **extra}


def _plan(snap: snapshot.Snapshot, planner: str = "fast") -> plans.Plan:
    plan = planners.run(snap, planner)
    assert validation.problems(snap, plan) == []
    return plan


# --------------------------------------------------------------------------- snapshot


@pytest.mark.parametrize("value", list(modes.Mode))
def test_every_mode_parses(value: modes.Mode) -> None:
    gpu: dict[str, Any] = {"model": "a100-80gb"}
    if value is modes.Mode.TIME_SLICING:
        gpu["replicas"] = 2
    snap = _snap([_node("n", value.value, [gpu])], [])
    assert snap.nodes[0].mode is value


def test_mode_defaults_to_mig() -> None:
    assert _snap([_node("n", None, [{"model": "a100-80gb"}])], []).nodes[0].mode is modes.Mode.MIG


def test_unknown_mode_names_node_and_value() -> None:
    with pytest.raises(errors.SnapshotError) as err:
        _snap([_node("n3", "mps2", [{"model": "a100-80gb"}])], [])
    assert "node n3" in str(err.value)
    assert "'mps2'" in str(err.value)
    assert "mig, mps, time-slicing, none" in str(err.value)


@pytest.mark.parametrize(
    ("resource", "gb"),
    [("nvidia.com/gpu-10gb", 10), ("nvidia.com/gpu-1gb", 1), ("nvidia.com/gpu-80gb", 80)],
)
def test_mps_resource_names(resource: str, gb: int) -> None:
    req = snapshot.pod_requests({resource: 2, "cpu": "1"}, where="p")
    assert req.mps == (modes.MpsRequest(gb, 2),)
    assert req.mig == ()
    assert req.unified is None


@pytest.mark.parametrize(
    "resource",
    ["nvidia.com/gpu-0gb", "nvidia.com/gpu-10GB", "nvidia.com/gpu-1.5gb", "nvidia.com/gpu-10"],
)
def test_bad_mps_resource_names_the_field(resource: str) -> None:
    with pytest.raises(errors.SnapshotError) as err:
        snapshot.pod_requests({resource: 1}, where="pods[0].requests")
    assert str(err.value).startswith("pods[0].requests: ")
    assert resource in str(err.value)


@pytest.mark.parametrize("value", [-1, "x", 1.5, True])
def test_bad_mps_count_names_the_field(value: Any) -> None:
    with pytest.raises(errors.SnapshotError, match=r"pods\[0\]\.requests\.nvidia.com/gpu-10gb"):
        snapshot.pod_requests({"nvidia.com/gpu-10gb": value}, where="pods[0].requests")


@pytest.mark.parametrize(
    "other",
    [{"nvidia.com/mig-1g.10gb": 1}, {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}],
)
def test_mps_and_another_kind_is_refused(other: dict[str, Any]) -> None:
    with pytest.raises(errors.SnapshotError, match="one or the other"):
        snapshot.pod_requests({"nvidia.com/gpu-10gb": 1, **other}, where="p")


@pytest.mark.parametrize(
    ("node", "match"),
    [
        (_node("n", "mps", [{"model": "a100-40gb", "mps": [{"id": 0, "memoryGB": 41}]}]),
         "slices of 41 GB exceed the GPU's 40 GB"),
        (_node("n", "mps", [{"model": "a100-80gb",
                             "mps": [{"id": i, "memoryGB": 1} for i in range(49)]}]),
         "49 slices exceed the 48 MPS clients"),
        (_node("n", "mps", [{"model": "a100-80gb", "mps": [{"id": 0, "memoryGB": 0}]}]),
         r"mps\[0\]\.memoryGB: a slice needs at least 1 GB"),
        (_node("n", None, [{"model": "a100-80gb", "mps": [{"id": 0, "memoryGB": 10}]}]),
         "mode mig has no MPS slices"),
        (_node("n", "mps", [{"model": "a100-80gb",
                             "instances": [{"profile": "7g.80gb", "start": 0}]}]),
         "mode mps has no MIG instances"),
        (_node("n", "time-slicing", [{"model": "a100-80gb"}]), "needs replicas"),
        (_node("n", "time-slicing", [{"model": "a100-80gb", "replicas": 0}]),
         r"replicas: expected at least 1"),
        (_node("n", "time-slicing", [{"model": "a100-80gb", "replicas": 2, "replicasUsed": 3}]),
         r"replicasUsed: expected 0-2"),
        (_node("n", "mps", [{"model": "a100-80gb", "replicas": 2}]),
         "only GPUs of a node in mode time-slicing"),
    ],
)  # fmt: skip
def test_bad_gpu_sharing_state_names_the_field(node: dict[str, Any], match: str) -> None:
    with pytest.raises(errors.SnapshotError, match=match) as err:
        _snap([node], [])
    assert "nodes[0].gpus[0]" in str(err.value)


def test_document_round_trip_keeps_modes_slices_replicas_and_mps_pods() -> None:
    snap = _snap(
        [
            _node("m", "mps", [{"model": "a100-80gb", "mps": [
                {"id": 0, "memoryGB": 10, "used": True},
                {"id": 3, "memoryGB": 20, "cores": 50, "reservedFor": "default/x"},
            ]}]),
            _node("t", "time-slicing", [{"model": "a100-40gb", "replicas": 4, "replicasUsed": 1}]),
        ],
        [_pod("p", {"nvidia.com/gpu-10gb": 2})],
    )  # fmt: skip
    again = snapshot.parse(snapshot.to_document(snap))
    assert again == snap
    assert again.nodes[0].gpus[0].mps[1].reserved_for == "default/x"
    assert again.nodes[1].gpus[0].replicas_used == 1


# --------------------------------------------------------------------------- planning

MPS_NODE = _node(
    "mps-0",
    "mps",
    [
        {"model": "a100-80gb", "mps": [
            {"id": 0, "memoryGB": 40, "used": True},
            {"id": 1, "memoryGB": 20},
            {"id": 2, "memoryGB": 20},
        ]},
    ],
)  # fmt: skip


def test_free_slice_of_the_right_size_is_reused() -> None:
    plan = _plan(_snap([MPS_NODE], [_pod("p", {"nvidia.com/gpu-20gb": 1})]))
    assert plan.placements[0].shares == (plans.AssignedShare(0, 1, 20),)
    assert plan.slice_actions == ()
    assert not plan.mps[0].changed


def test_free_slices_are_removed_to_make_room_never_the_one_in_use() -> None:
    plan = _plan(_snap([MPS_NODE], [_pod("p", {"nvidia.com/gpu-30gb": 1})]))
    assert [(a.op, a.slice, a.memory_gb) for a in plan.slice_actions] == [
        (plans.SliceOp.REMOVE, 1, 20),
        (plans.SliceOp.REMOVE, 2, 20),
        (plans.SliceOp.CREATE, 3, 30),
    ]
    assert "removed to make room for default/p" in plan.slice_actions[0].reason
    assert "resized into default/p" in plan.slice_actions[2].reason
    assert [s.id for s in plan.mps[0].slices] == [0, 3]
    assert plan.placements[0].shares == (plans.AssignedShare(0, 3, 30),)


def test_no_room_without_removing_a_slice_in_use() -> None:
    plan = _plan(_snap([MPS_NODE], [_pod("p", {"nvidia.com/gpu-50gb": 1})]))
    assert plan.placements == ()
    assert plan.slice_actions == ()
    assert "without removing MPS slices in use" in plan.unschedulable[0].reason


def test_fits_without_removal_before_a_removal() -> None:
    # Pods that fit in free memory or free slices go first; only then are free slices removed.
    node = _node("n", "mps", [{"model": "a100-40gb", "mps": [{"id": 0, "memoryGB": 10}]}])
    plan = _plan(
        _snap(
            [node], [_pod("a", {"nvidia.com/gpu-30gb": 1}), _pod("b", {"nvidia.com/gpu-10gb": 1})]
        )
    )
    assert {p.pod: p.shares[0].slice for p in plan.placements} == {"default/a": 1, "default/b": 0}
    assert [a.op for a in plan.slice_actions] == [plans.SliceOp.CREATE]


def test_at_most_48_clients_per_gpu() -> None:
    node = _node("n", "mps", [{"model": "a100-80gb"}])
    plan = _plan(_snap([node], [_pod(f"p{i}", {"nvidia.com/gpu-1gb": 1}) for i in range(50)]))
    assert len(plan.placements) == sharing_config.MPS_MAX_CLIENTS
    assert len(plan.mps[0].slices) == sharing_config.MPS_MAX_CLIENTS
    assert len(plan.unschedulable) == 2


def test_unified_pod_on_mps_gets_its_memory_rounded_up_to_gb_and_its_cores() -> None:
    node = _node("n", "mps", [{"model": "a100-80gb"}, {"model": "a100-80gb"}])
    pod = _pod("u", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 30000, "nvidia.com/gpucores": 30})
    plan = _plan(_snap([node], [pod]))
    shares = plan.placements[0].shares
    assert [(s.gpu, s.memory_gb) for s in shares] == [(0, 30)]  # 29.3 GB -> 30
    assert {s.cores for g in plan.mps for s in g.slices} == {30}


def test_a_container_asking_two_gpus_is_not_served_by_mps_slices() -> None:
    # One container talks to one MPS daemon (one pipe folder), and each GPU has its own.
    node = _node("n", "mps", [{"model": "a100-80gb"}, {"model": "a100-80gb"}])
    pod = _pod("u", {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8000})
    plan = _plan(_snap([node], [pod]))
    assert not plan.placements
    assert "more than one GPU is not served by MPS slices" in plan.unschedulable[0].reason


@pytest.mark.parametrize(
    ("vgpu_mode", "served_on"),
    [(None, {"m", "s", "t"}), ("mig", {"m"}), ("mps", {"s"}), ("MPS ", {"s"})],
)
def test_vgpu_mode_narrows_the_modes_that_serve_a_unified_pod(
    vgpu_mode: str | None, served_on: set[str]
) -> None:
    nodes = [
        _node("m", "mig", [{"model": "a100-80gb"}]),
        _node("s", "mps", [{"model": "a100-80gb"}]),
        _node("t", "time-slicing", [{"model": "a100-80gb", "replicas": 4}]),
    ]
    for name in ("m", "s", "t"):
        pod = _pod("u", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000})
        if vgpu_mode is not None:
            pod["annotations"] = {"nvidia.com/vgpu-mode": vgpu_mode}
        only = [n for n in nodes if n["name"] == name]
        plan = _plan(_snap(only, [pod]))
        assert bool(plan.placements) == (name in served_on), name
        if name not in served_on:
            assert "is in mode" in plan.unschedulable[0].reason
            assert "its nvidia.com/vgpu-mode" in plan.unschedulable[0].reason


def test_compute_shares_never_exceed_100_percent() -> None:
    node = _node("n", "mps", [{"model": "a100-80gb"}])
    pods = [
        _pod(f"u{i}", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000, "nvidia.com/gpucores": 40})
        for i in range(3)
    ]
    plan = _plan(_snap([node], pods))
    assert len(plan.placements) == 2


def test_time_slicing_gives_one_replica_per_gpu_and_never_overcommits() -> None:
    node = _node("t", "time-slicing", [{"model": "a100-40gb", "replicas": 2, "replicasUsed": 1},
                                       {"model": "a100-40gb", "replicas": 2}])  # fmt: skip
    pods = [_pod(f"u{i}", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000}) for i in range(4)]
    plan = _plan(_snap([node], pods))
    assert len(plan.placements) == 3
    assert "went to other pending pods" in plan.unschedulable[0].reason
    full = _plan(_snap([node], pods[:1]))
    assert [s.gpu for s in full.placements[0].shares] == [1]  # spread: the GPU with most free


def test_time_slicing_refuses_an_ask_larger_than_the_gpu() -> None:
    node = _node("t", "time-slicing", [{"model": "a100-40gb", "replicas": 4}])
    plan = _plan(_snap([node], [_pod("u", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 50000})]))
    assert plan.placements == ()
    assert plan.unschedulable[0].reason.startswith(
        "no GPU in the cluster serves gpu 1, gpumem 50000"
    )


@pytest.mark.parametrize(
    ("mode", "requests", "needs"),
    [
        ("mig", {"nvidia.com/gpu-10gb": 1}, "mps"),
        ("time-slicing", {"nvidia.com/gpu-10gb": 1}, "mps"),
        ("mps", {"nvidia.com/mig-1g.10gb": 1}, "mig"),
        ("time-slicing", {"nvidia.com/mig-1g.10gb": 1}, "mig"),
        ("none", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1000}, "mig, mps or time-slicing"),
    ],
)
def test_a_node_whose_mode_cannot_serve_the_pod_is_never_used_and_says_why(
    mode: str, requests: dict[str, Any], needs: str
) -> None:
    gpu: dict[str, Any] = {"model": "h100-80gb"}
    if mode == "time-slicing":
        gpu["replicas"] = 4
    snap = _snap([_node("n3", mode, [gpu])], [_pod("p", requests)])
    plan = planners.run(snap, "fast", planners.options.Options(explain=True))
    assert validation.problems(snap, plan) == []
    assert plan.placements == ()
    ((_, reason),) = plan.unschedulable[0].nodes
    assert reason.startswith(f"node n3 is in mode {mode}; ")
    assert reason.endswith(f"needs {needs}")


def test_mode_none_is_never_planned() -> None:
    snap = _snap([_node("n", "none", [{"model": "h100-80gb"}])],
                 [_pod("p", {"nvidia.com/mig-1g.10gb": 1})])  # fmt: skip
    plan = _plan(snap)
    assert plan.actions == ()
    assert plan.placements == ()


def test_mps_pod_without_any_mps_node_gets_a_plain_reason() -> None:
    snap = _snap([_node("n", None, [{"model": "h100-80gb"}])],
                 [_pod("p", {"nvidia.com/gpu-10gb": 1})])  # fmt: skip
    plan = _plan(snap)
    assert plan.unschedulable[0].reason == (
        "no node in the cluster is in mode mps (nvidia.com/gpu-10gb needs mps)"
    )


def test_exact_plans_mps_nodes_and_proves_it() -> None:
    snap = _snap([MPS_NODE], [_pod("p", {"nvidia.com/gpu-10gb": 1})])
    plan = planners.run(snap, "exact")
    assert validation.problems(snap, plan) == []
    assert plan.placement_of("default/p") is not None
    assert plan.optimal is True


@pytest.mark.parametrize("name", ["fast", "exact", "first-fit", "nos", "hami-placement", "static"])
def test_every_planner_serves_mps_nodes_beside_mig(name: str) -> None:
    snap = _snap(
        [_node("mig", None, [{"model": "h100-80gb"}]), MPS_NODE],
        [_pod("a", {"nvidia.com/mig-1g.10gb": 1}), _pod("b", {"nvidia.com/gpu-20gb": 1})],
    )
    plan = _plan(snap, name)
    nodes = {p.pod: p.node for p in plan.placements}
    assert nodes["default/b"] == "mps-0"
    assert nodes.get("default/a", "mig") == "mig"


# --------------------------------------------------------------------------- properties


@given(sharing_snapshots.clusters())
def test_plans_are_sound_and_never_touch_a_taken_slice(snap: snapshot.Snapshot) -> None:
    plan = planners.run(snap, "fast")
    assert validation.problems(snap, plan) == []
    targets = {(g.node, g.gpu): {s.id: s for s in g.slices} for g in plan.mps}
    for node in snap.nodes:
        for gpu in node.gpus:
            for s in gpu.mps:
                if s.taken:
                    kept = targets[(node.name, gpu.index)][s.id]
                    assert (kept.memory_gb, kept.cores) == (s.memory_gb, s.cores)
    for g in plan.mps:
        model = next(
            x.model for n in snap.nodes for x in n.gpus if (n.name, x.index) == (g.node, g.gpu)
        )
        assert sum(s.memory_gb for s in g.slices) <= sharing_mps.memory_gb(model)
        assert len(g.slices) <= sharing_config.MPS_MAX_CLIENTS
    mode = {n.name: n.mode for n in snap.nodes}
    pods = {p.key: p for p in snap.pods}
    for p in plan.placements:
        if pods[p.pod].mps:
            assert mode[p.node] is modes.Mode.MPS
        if pods[p.pod].mig:
            assert mode[p.node] is modes.Mode.MIG
    assert {u.pod for u in plan.unschedulable} | {p.pod for p in plan.placements} == set(pods)


@given(sharing_snapshots.clusters())
def test_mig_nodes_are_planned_as_if_mps_pods_and_other_nodes_were_absent(
    snap: snapshot.Snapshot,
) -> None:
    plan = planners.run(snap, "fast")
    alone = planners.run(sharing.mig_part(snap), "fast")
    mig_nodes = {n.name for n in snap.nodes if n.mode is modes.Mode.MIG}
    assert [g for g in plan.gpus if g.node in mig_nodes] == list(alone.gpus)
    assert [a for a in plan.actions if a.node in mig_nodes] == list(alone.actions)
    assert not any(a.node not in mig_nodes for a in plan.actions)
