"""Preferred pod (anti-)affinity and ScheduleAnyway spread: scored as kube-scheduler's score
plugins do, used by the fast planner only among nodes otherwise equal, never a reason to leave a
pod pending; first-fit and exact ignore them."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.planning import options, planners, podaffinity, snapshot, validation

HOST = "kubernetes.io/hostname"
OPTS = options.Options(time_limit_s=5.0)


def _node(i: int, zone: str, gpus: int = 1) -> dict[str, Any]:
    return {
        "name": f"n{i}",
        "labels": {HOST: f"n{i}", "zone": zone},
        "gpus": [{"model": "a100-80gb"} for _ in range(gpus)],
    }


def _pod(name: str, app: str = "web", **extra: Any) -> dict[str, Any]:
    return {"name": name, "labels": {"app": app}, "requests": {"nvidia.com/mig-1g.10gb": 1}} | extra


def _bound(name: str, node: str, app: str) -> dict[str, Any]:
    return {"name": name, "node": node, "labels": {"app": app}}


def _preferred(kind: str, app: str, key: str = HOST, weight: int = 50) -> dict[str, Any]:
    return {
        kind: {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": weight,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": {"app": app}},
                        "topologyKey": key,
                    },
                }
            ]
        }
    }


def _soft_spread(app: str, key: str = "zone", skew: int = 1) -> list[dict[str, Any]]:
    return [
        {
            "maxSkew": skew,
            "topologyKey": key,
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": {"app": app}},
        }
    ]


def _plan(doc: dict[str, Any], planner: str) -> dict[str, str]:
    snap = snapshot.parse(doc)
    plan = planners.run(snap, planner, OPTS)
    assert validation.problems(snap, plan) == []
    return {p.pod: p.node for p in plan.placements}


def _without_preferences(doc: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    for p in out["pods"]:
        p.pop("affinity", None)
        p.pop("topologySpreadConstraints", None)
    return out


# --------------------------------------------------------------------------- the scores


def test_affinity_score_is_the_weighted_count_normalized_over_candidates() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), _node(1, "a"), _node(2, "b")],
        "boundPods": [_bound("d0", "n1", "db"), _bound("d1", "n2", "db"), _bound("d2", "n2", "db")],
        "pods": [_pod("p", affinity=_preferred("podAffinity", "db", weight=10))],
    }
    snap = snapshot.parse(doc)
    tracker = podaffinity.Tracker(snap)
    # raw 0, 10, 20 (min 0, max 20): normalized 0, 50, 100, times the plugin weight 2
    assert tracker.preferences(snap.pods[0], [True] * 3) == [0, 100, 200]
    # only candidates count: n2 left out, n1 is now the best
    assert tracker.preferences_on(snap.pods[0], snap.nodes, [True, True, False]) == [0, 200, 0]


def test_anti_affinity_score_keeps_zero_as_the_top() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), _node(1, "a"), _node(2, "b")],
        "boundPods": [_bound("w0", "n0", "web")],
        "pods": [_pod("p", affinity=_preferred("podAntiAffinity", "web", key="zone"))],
    }
    snap = snapshot.parse(doc)
    # zone a holds a web pod: -50 for n0 and n1, 0 for n2 (the top is at least 0)
    assert podaffinity.Tracker(snap).preferences(snap.pods[0], [True] * 3) == [0, 0, 200]


def test_spread_score_follows_the_plugin() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), _node(1, "a"), _node(2, "b"), _node(3, "b")],
        "otherNodes": [{"name": "nolabel"}],
        "boundPods": [
            _bound("w0", "n0", "web"),
            _bound("w1", "n1", "web"),
            _bound("w2", "n2", "web"),
        ],
        "pods": [_pod("p", topologySpreadConstraints=_soft_spread("web", skew=2))],
    }
    snap = snapshot.parse(doc)
    # zones a (2 pods) and b (1): weight log(2 + 2); raw round(2*1.386 + 1) = 4, round(1.386 + 1)
    # = 2; normalized 100 * (4 + 2 - s) / 4: 50 and 100, times 2
    assert podaffinity.Tracker(snap).preferences(snap.pods[0], [True] * 4) == [100, 100, 200, 200]


def test_a_candidate_without_the_key_scores_zero() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), {"name": "bare", "gpus": [{"model": "a100-80gb"}]}],
        "pods": [_pod("p", topologySpreadConstraints=_soft_spread("web"))],
    }
    snap = snapshot.parse(doc)
    assert podaffinity.Tracker(snap).preferences(snap.pods[0], [True, True]) == [200, 0]


def test_a_pod_without_preferences_has_no_scores() -> None:
    doc = {"version": 1, "nodes": [_node(0, "a")], "pods": [_pod("p")]}
    snap = snapshot.parse(doc)
    assert podaffinity.Tracker(snap).preferences(snap.pods[0], [True]) is None


# --------------------------------------------------------------------------- the planners


def test_preferred_affinity_picks_its_partners_node_among_equal_ones() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(i, "a") for i in range(3)],
        "boundPods": [_bound("db", "n2", "db")],
        "pods": [_pod("p", affinity=_preferred("podAffinity", "db"))],
    }
    assert _plan(_without_preferences(doc), "fast") == {"default/p": "n0"}
    assert _plan(doc, "fast") == {"default/p": "n2"}


def test_preferred_anti_affinity_avoids_a_zone() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), _node(1, "a"), _node(2, "b")],
        "boundPods": [_bound("w", "n1", "web")],
        "pods": [_pod("p", affinity=_preferred("podAntiAffinity", "web", key="zone"))],
    }
    assert _plan(_without_preferences(doc), "fast") == {"default/p": "n0"}
    assert _plan(doc, "fast") == {"default/p": "n2"}


def test_soft_spread_goes_to_the_emptier_zone() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), _node(1, "b")],
        "boundPods": [_bound("w0", "n0", "web")],
        "pods": [_pod("p", topologySpreadConstraints=_soft_spread("web"))],
    }
    assert _plan(_without_preferences(doc), "fast") == {"default/p": "n0"}
    assert _plan(doc, "fast") == {"default/p": "n1"}


def test_a_preference_never_outranks_the_objective() -> None:
    # the second replica prefers another node, but a GPU already changed costs less than a
    # fresh one: binpack keeps both on n0's GPU
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), _node(1, "b")],
        "pods": [
            _pod(f"r{i}", affinity=_preferred("podAntiAffinity", "web", key="zone"))
            for i in range(2)
        ],
    }
    assert set(_plan(doc, "fast").values()) == {"n0"}


@pytest.mark.parametrize("planner", ["fast", "first-fit", "exact"])
def test_a_preference_against_every_node_leaves_no_pod_pending(planner: str) -> None:
    # every node holds a pod the replicas would rather avoid, and capacity is exactly enough
    doc = {
        "version": 1,
        "nodes": [_node(0, "a"), _node(1, "b")],
        "boundPods": [_bound("w0", "n0", "web"), _bound("w1", "n1", "web")],
        "pods": [
            _pod(
                f"r{i}",
                affinity=_preferred("podAntiAffinity", "web"),
                topologySpreadConstraints=_soft_spread("web"),
                requests={"nvidia.com/mig-7g.80gb": 1},
            )
            for i in range(2)
        ],
    }
    assert len(_plan(doc, planner)) == 2


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 4))
    nodes = [
        _node(i, draw(st.sampled_from(["a", "b"])), draw(st.integers(1, 2))) for i in range(count)
    ]
    pods = []
    for i in range(draw(st.integers(1, 7))):
        app = draw(st.sampled_from(["web", "db"]))
        other = draw(st.sampled_from(["web", "db"]))
        key = draw(st.sampled_from([HOST, "zone"]))
        extra: dict[str, Any] = {}
        kind = draw(st.sampled_from(["none", "pref", "anti", "soft"]))
        if kind == "pref":
            extra["affinity"] = _preferred("podAffinity", other, key, draw(st.integers(1, 100)))
        elif kind == "anti":
            extra["affinity"] = _preferred("podAntiAffinity", other, key, draw(st.integers(1, 100)))
        elif kind == "soft":
            extra["topologySpreadConstraints"] = _soft_spread(app, key, draw(st.integers(1, 2)))
        profile = draw(st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb"]))
        pods.append(_pod(f"p{i}", app, **extra) | {"requests": {f"nvidia.com/mig-{profile}": 1}})
    bound = [
        _bound(f"b{j}", f"n{draw(st.integers(0, count - 1))}", draw(st.sampled_from(["web", "db"])))
        for j in range(draw(st.integers(0, 3)))
    ]
    return {"version": 1, "nodes": nodes, "pods": pods, "boundPods": bound}


@settings(max_examples=80, deadline=None)
@given(documents())
def test_preferences_leave_every_pod_placed_that_fits_alone(doc: dict[str, Any]) -> None:
    # where the plan without preferences places every pod, the plan with them does too
    bare = _plan(_without_preferences(doc), "fast")
    if len(bare) == len(doc["pods"]):
        assert len(_plan(doc, "fast")) == len(doc["pods"])


@pytest.mark.parametrize("planner", ["first-fit", "exact"])
def test_first_fit_and_exact_ignore_preferences(planner: str) -> None:
    doc = {
        "version": 1,
        "nodes": [_node(i, "a") for i in range(3)],
        "boundPods": [_bound("db", "n2", "db")],
        "pods": [_pod("p", affinity=_preferred("podAffinity", "db"))],
    }
    assert _plan(doc, planner) == _plan(_without_preferences(doc), planner)
