"""The planners honour pod (anti-)affinity and topology spread: no plan places a pod where
kube-scheduler's filters would refuse it, and the common cases come out as users expect."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.planning import options, planners, snapshot, validation

HOST = "kubernetes.io/hostname"
OPTS = options.Options(time_limit_s=5.0)


def _node(i: int, zone: str, gpus: int = 1, free: bool = True) -> dict[str, Any]:
    return {
        "name": f"n{i}",
        "labels": {HOST: f"n{i}", "zone": zone},
        "gpus": [{"model": "a100-80gb"} for _ in range(gpus)],
    }


def _pod(name: str, app: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "labels": {"app": app}, "requests": {"nvidia.com/mig-1g.10gb": 1}} | extra


def _anti(app: str, key: str = HOST) -> dict[str, Any]:
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": app}}, "topologyKey": key}
            ]
        }
    }


def _spread(app: str, key: str = "zone", skew: int = 1) -> list[dict[str, Any]]:
    return [
        {
            "maxSkew": skew,
            "topologyKey": key,
            "whenUnsatisfiable": "DoNotSchedule",
            "labelSelector": {"matchLabels": {"app": app}},
        }
    ]


def _plan(doc: dict[str, Any], planner: str) -> dict[str, str]:
    snap = snapshot.parse(doc)
    plan = planners.run(snap, planner, OPTS)
    assert validation.problems(snap, plan) == []
    return {p.pod: p.node for p in plan.placements}


MINE = ["fast", "first-fit", "exact"]


@pytest.mark.parametrize("planner", MINE)
def test_replicas_with_hostname_anti_affinity_land_one_per_node(planner: str) -> None:
    # binpack would put all three on one node's GPUs
    doc = {
        "version": 1,
        "nodes": [_node(i, "a", gpus=2) for i in range(3)],
        "pods": [_pod(f"r{i}", "web", affinity=_anti("web")) for i in range(4)],
    }
    got = _plan(doc, planner)
    assert len(got) == 3 and sorted(got.values()) == ["n0", "n1", "n2"]


@pytest.mark.parametrize("planner", MINE)
def test_zone_spread_is_balanced(planner: str) -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a", 2), _node(1, "a", 2), _node(2, "b", 1)],
        "pods": [_pod(f"w{i}", "web", topologySpreadConstraints=_spread("web")) for i in range(4)],
    }
    got = _plan(doc, planner)
    zones = [{"n0": "a", "n1": "a", "n2": "b"}[n] for n in got.values()]
    assert len(got) == 4 and zones.count("a") == 2 and zones.count("b") == 2


def test_spread_counts_bound_pods_and_other_nodes() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a", 2), _node(1, "b", 2)],
        "otherNodes": [{"name": "cpu", "labels": {"zone": "c"}}],
        "boundPods": [{"name": "b0", "node": "n0", "labels": {"app": "web"}}],
        "pods": [_pod(f"w{i}", "web", topologySpreadConstraints=_spread("web")) for i in range(3)],
    }
    # zone c can hold no GPU pod and has none: every zone may hold at most one
    got = _plan(doc, "fast")
    assert list(got.values()) == ["n1"]


@pytest.mark.parametrize("planner", MINE)
def test_pod_affinity_follows_its_anchor(planner: str) -> None:
    follow = {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": HOST}
            ]
        }
    }
    doc = {
        "version": 1,
        "nodes": [_node(i, "a", 2) for i in range(3)],
        "boundPods": [{"name": "db", "node": "n2", "labels": {"app": "db"}}],
        "pods": [_pod("f", "web", affinity=follow)],
    }
    assert _plan(doc, planner) == {"default/f": "n2"}


def test_follower_listed_before_its_anchor_in_the_same_plan() -> None:
    follow = {
        "podAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "db"}}, "topologyKey": HOST}
            ]
        }
    }
    doc = {
        "version": 1,
        "nodes": [_node(i, "a", 1) for i in range(3)],
        # the follower is larger: the greedy tries it first, before its anchor exists
        "pods": [
            {**_pod("f", "web", affinity=follow), "requests": {"nvidia.com/mig-3g.40gb": 1}},
            _pod("db", "db"),
        ],
    }
    got = _plan(doc, "fast")
    assert got["default/f"] == got["default/db"]


def test_existing_anti_affinity_keeps_pods_out() -> None:
    doc = {
        "version": 1,
        "nodes": [_node(0, "a", 2), _node(1, "b", 2)],
        "boundPods": [
            {
                "name": "lonely",
                "node": "n0",
                "labels": {"app": "x"},
                "affinity": _anti("web", "zone"),
            }
        ],
        "pods": [_pod(f"w{i}", "web") for i in range(2)],
    }
    assert set(_plan(doc, "fast").values()) == {"n1"}


# --------------------------------------------------------------------------- the property


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    count = draw(st.integers(1, 4))
    nodes = [
        _node(i, draw(st.sampled_from(["a", "b"])), draw(st.integers(1, 2))) for i in range(count)
    ]
    pods = []
    for i in range(draw(st.integers(1, 7))):
        app = draw(st.sampled_from(["web", "db"]))
        extra: dict[str, Any] = {}
        kind = draw(st.sampled_from(["none", "anti", "zone-anti", "affinity", "spread", "host"]))
        if kind == "anti":
            extra["affinity"] = _anti(draw(st.sampled_from(["web", "db"])))
        elif kind == "zone-anti":
            extra["affinity"] = _anti(draw(st.sampled_from(["web", "db"])), "zone")
        elif kind == "affinity":
            extra["affinity"] = {
                "podAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {
                                "matchLabels": {"app": draw(st.sampled_from(["web", "db"]))}
                            },
                            "topologyKey": draw(st.sampled_from([HOST, "zone"])),
                        }
                    ]
                }
            }
        elif kind in ("spread", "host"):
            extra["topologySpreadConstraints"] = _spread(
                app, "zone" if kind == "spread" else HOST, draw(st.integers(1, 2))
            )
        profile = draw(st.sampled_from(["1g.10gb", "2g.20gb", "3g.40gb"]))
        pods.append(_pod(f"p{i}", app, **extra) | {"requests": {f"nvidia.com/mig-{profile}": 1}})
    bound = [
        {"name": f"b{j}", "node": f"n{draw(st.integers(0, count - 1))}",
         "labels": {"app": draw(st.sampled_from(["web", "db"]))}}
        for j in range(draw(st.integers(0, 3)))
    ]  # fmt: skip
    return {"version": 1, "nodes": nodes, "pods": pods, "boundPods": bound}


@settings(max_examples=60, deadline=None)
@given(documents(), st.sampled_from(["fast", "first-fit"]))
def test_no_plan_places_a_pod_where_the_filters_refuse_it(
    doc: dict[str, Any], planner: str
) -> None:
    snap = snapshot.parse(doc)
    plan = planners.run(snap, planner, OPTS)
    assert validation.problems(snap, plan) == []


@settings(max_examples=15, deadline=None)
@given(documents())
def test_exact_plans_pass_the_filters(doc: dict[str, Any]) -> None:
    snap = snapshot.parse(doc)
    plan = planners.run(snap, "exact", options.Options(time_limit_s=2.0))
    assert validation.problems(snap, plan) == []


def _dropped(snap: snapshot.Snapshot) -> list[str]:
    """What the exact planner's safety net would drop from its model's own placements."""
    from migpilot.planning import exact, explaining, podaffinity

    unresolvable = explaining.unresolvable(snap)
    interpod = exact.exactpods.involved(snap)
    classes = exact._classes((p for p in snap.pods if p.key not in unresolvable), interpod=interpod)
    builder = exact._Builder(snap, classes, interpod=interpod)
    solution, _ = builder.solve(options.Options(time_limit_s=2.0))
    _, placements = builder.extract(solution)
    return podaffinity.violations(snap, {p.pod: p.node for p in placements})


@settings(max_examples=15, deadline=None)
@given(documents())
def test_exact_model_itself_keeps_to_the_filters(doc: dict[str, Any]) -> None:
    # the model's rules, not the safety net, keep the plan within the filters
    assert _dropped(snapshot.parse(doc)) == []


@settings(max_examples=15, deadline=None)
@given(documents())
def test_exact_places_no_fewer_than_fast_where_fast_places_everything(
    doc: dict[str, Any],
) -> None:
    snap = snapshot.parse(doc)
    fast = planners.run(snap, "fast", OPTS)
    exact = planners.run(snap, "exact", options.Options(time_limit_s=2.0))
    if len(fast.placements) == len(snap.pods):
        assert len(exact.placements) == len(snap.pods)
