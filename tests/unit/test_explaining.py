"""Reasons for pending pods: each category, the summary choice, and per-node detail."""

from __future__ import annotations

from typing import Any

from migpilot.planning import explaining, plans, snapshot


def snap_of(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> snapshot.Snapshot:
    return snapshot.parse({"version": 1, "nodes": nodes, "pods": pods})


def h100(*instances: tuple[str, int, bool]) -> dict[str, Any]:
    return {
        "model": "h100-80gb",
        "instances": [{"profile": p, "start": s, "used": u} for p, s, u in instances],
    }


def reason(snap: snapshot.Snapshot, placements: list[plans.Placement] | None = None) -> str:
    (u,) = explaining.explain(snap, [snap.pods[-1]], placements or [])
    return u.reason


def test_not_admitted() -> None:
    snap = snap_of(
        [{"name": "n0", "unschedulable": True, "gpus": [h100()]}],
        [{"name": "p", "requests": {"nvidia.com/mig-1g.10gb": 1}}],
    )
    assert reason(snap) == "no node admits the pod (e.g. n0: node is cordoned (unschedulable))"


def test_not_offered() -> None:
    snap = snap_of(
        [{"name": "n0", "gpus": [{"model": "a30"}]}],
        [{"name": "p", "requests": {"nvidia.com/mig-7g.80gb": 1}}],
    )
    assert reason(snap) == (
        "no GPU in the cluster advertises nvidia.com/mig-7g.80gb (only a100-80gb, h100-80gb "
        "offer it)"
    )


def test_not_offered_by_the_nodes_that_admit_the_pod() -> None:
    snap = snap_of(
        [
            {"name": "n0", "gpus": [{"model": "a30"}]},
            {"name": "n1", "unschedulable": True, "gpus": [h100()]},
        ],
        [{"name": "p", "requests": {"nvidia.com/mig-7g.80gb": 1}}],
    )
    assert reason(snap) == "no node that admits the pod advertises nvidia.com/mig-7g.80gb"


def test_cpu() -> None:
    snap = snap_of(
        [{"name": "n0", "allocatable": {"cpu": "2"}, "gpus": [h100()]}],
        [{"name": "p", "requests": {"nvidia.com/mig-1g.10gb": 1, "cpu": "3"}}],
    )
    assert "not enough CPU: needs 3000m, 2000m free" in reason(snap)


def test_in_use() -> None:
    snap = snap_of(
        [{"name": "n0", "gpus": [h100(("1g.10gb", 0, True))]}],
        [{"name": "p", "requests": {"nvidia.com/mig-7g.80gb": 1}}],
    )
    assert reason(snap) == "no node offers 7g.80gb without destroying instances in use"


def test_taken_by_other_pods_and_room_left() -> None:
    snap = snap_of(
        [{"name": "n0", "gpus": [h100()]}],
        [
            {"name": "a", "requests": {"nvidia.com/mig-7g.80gb": 1}},
            {"name": "p", "requests": {"nvidia.com/mig-1g.10gb": 1}},
        ],
    )
    taken = [plans.Placement("default/a", "n0", (plans.AssignedInstance(0, "7g.80gb", 0),))]
    assert reason(snap, taken).startswith("the room for 1g.10gb went to other pending pods")
    assert reason(snap) == (
        "1g.10gb would still fit on 1 node(s) (e.g. n0); the planner left it out"
    )


def test_summary_takes_the_most_hopeful_node_and_details_every_node() -> None:
    snap = snap_of(
        [
            {"name": "n0", "unschedulable": True, "gpus": [h100()]},
            {"name": "n1", "gpus": [h100(("1g.10gb", 0, True))]},
        ],
        [{"name": "p", "requests": {"nvidia.com/mig-7g.80gb": 1}}],
    )
    (u,) = explaining.explain(snap, snap.pods, [], per_node=True)
    assert u.reason == "no node offers 7g.80gb without destroying instances in use"
    assert dict(u.nodes) == {
        "n0": "node is cordoned (unschedulable)",
        "n1": "no room for 7g.80gb without destroying instances in use",
    }


def test_unresolvable() -> None:
    snap = snap_of(
        [{"name": "n0", "gpus": [{"model": "a30"}]}],
        [{"name": "p", "requests": {"nvidia.com/mig-7g.80gb": 1}}],
    )
    assert explaining.unresolvable(snap) == {
        "default/p": "no GPU in the cluster advertises nvidia.com/mig-7g.80gb"
        " (only a100-80gb, h100-80gb offer it)"
    }
