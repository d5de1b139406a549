"""The snapshot's pod affinity, anti-affinity and topology spread fields: read, folded, written."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from migpilot import errors
from migpilot.planning import interpod, snapshot

BASE: dict[str, Any] = {
    "version": 1,
    "nodes": [
        {
            "name": "n0",
            "labels": {"kubernetes.io/hostname": "n0", "zone": "a"},
            "gpus": [{"model": "a100-80gb"}],
        }
    ],
    "otherNodes": [{"name": "cpu0", "labels": {"zone": "b"}}],
    "namespaces": {"team": {"labels": {"tier": "gold"}}},
    "boundPods": [
        {
            "name": "anchor",
            "namespace": "team",
            "node": "cpu0",
            "labels": {"app": "db"},
            "terminating": True,
            "affinity": {
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": {"app": "web"}},
                            "topologyKey": "zone",
                        }
                    ]
                }
            },
        }
    ],
    "pods": [
        {
            "name": "p",
            "namespace": "team",
            "labels": {"app": "web", "rev": "7"},
            "requests": {"nvidia.com/mig-1g.10gb": 1},
            "affinity": {
                "podAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {
                                "matchExpressions": [
                                    {"key": "app", "operator": "In", "values": ["db"]}
                                ]
                            },
                            "namespaceSelector": {"matchLabels": {"tier": "gold"}},
                            "topologyKey": "zone",
                        }
                    ]
                },
                "podAntiAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "labelSelector": {"matchLabels": {"app": "web"}},
                            "matchLabelKeys": ["rev"],
                            "mismatchLabelKeys": ["missing"],
                            "topologyKey": "kubernetes.io/hostname",
                        }
                    ],
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 30,
                            "podAffinityTerm": {
                                "labelSelector": {"matchLabels": {"app": "batch"}},
                                "namespaces": ["jobs"],
                                "topologyKey": "zone",
                            },
                        }
                    ],
                },
            },
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "zone",
                    "whenUnsatisfiable": "DoNotSchedule",
                    "labelSelector": {"matchLabels": {"app": "web"}},
                    "matchLabelKeys": ["rev"],
                    "minDomains": 2,
                    "nodeTaintsPolicy": "Honor",
                },
                {
                    "maxSkew": 3,
                    "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app": "web"}},
                },
            ],
        }
    ],
}


def test_fields_are_read() -> None:
    snap = snapshot.parse(copy.deepcopy(BASE))
    pod = snap.pods[0]
    t = pod.terms
    assert dict(t.labels) == {"app": "web", "rev": "7"}
    (aff,) = t.affinity
    assert aff.namespaces == frozenset()  # a namespace selector replaces the default
    assert aff.namespace_selector is not None
    assert aff.matches("team", {"app": "db"}, {"tier": "gold"})
    assert not aff.matches("other", {"app": "db"}, {})
    (anti,) = t.anti_affinity
    assert anti.namespaces == frozenset({"team"})  # neither given: the pod's own namespace
    # matchLabelKeys folded with the pod's own value; a key the pod lacks adds nothing
    assert anti.matches("team", {"app": "web", "rev": "7"}, {})
    assert not anti.matches("team", {"app": "web", "rev": "8"}, {})
    (spread,) = t.spread  # ScheduleAnyway is soft: kept apart
    (soft,) = t.soft_spread
    assert soft.max_skew == 3 and soft.topology_key == "kubernetes.io/hostname"
    assert t.preferred_affinity == ()
    (pref,) = t.preferred_anti_affinity
    assert pref.weight == 30 and pref.term.namespaces == frozenset({"jobs"})
    assert pref.term.matches("jobs", {"app": "batch"}, {}) and t.preferring
    assert spread.min_domains == 2 and spread.honor_node_taints and spread.honor_node_affinity
    assert spread.selector is not None and not spread.selector.matches({"app": "web"})
    (b,) = snap.bound
    assert b.node == "cpu0" and b.anti_affinity[0].topology_key == "zone" and b.terminating
    assert [n.name for n in snap.outside] == ["cpu0"]
    assert dict(snap.namespaces["team"]) == {"tier": "gold"}


def test_round_trip() -> None:
    snap = snapshot.parse(copy.deepcopy(BASE))
    again = snapshot.parse(snapshot.to_document(snap))
    assert again.pods[0].terms == snap.pods[0].terms
    assert again.bound == snap.bound
    assert again.outside == snap.outside
    assert dict(again.namespaces) == dict(snap.namespaces)


def test_nil_selector_selects_nothing_and_empty_selects_all() -> None:
    assert not interpod.selects(None, {})
    assert interpod.selects(interpod.Selector(), {"x": "y"})


def _at(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    cur: Any = out
    parts = path.split(".")
    for part in parts[:-1]:
        cur = cur[int(part)] if part.isdigit() else cur[part]
    last = parts[-1]
    if last.isdigit():
        cur[int(last)] = value
    else:
        cur[last] = value
    return out


POD = "pods.0"
ANTI = POD + ".affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution.0"
SPREAD = POD + ".topologySpreadConstraints.0"
PREF = POD + ".affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution.0"


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (ANTI + ".topologyKey", "", "podAntiAffinity.requiredDuringSchedulingIgnoredDuring"
         "Execution[0].topologyKey: expected a non-empty string"),
        (ANTI + ".labelSelector", None, "matchLabelKeys needs a labelSelector"),
        (ANTI + ".mismatchLabelKeys", ["rev"], "key 'rev' is in both"),
        (ANTI + ".labelSelector", {"matchExpressions": [{"key": "a", "operator": "Gt",
                                                         "values": ["1"]}]},
         "operator: 'Gt' is not one of In, NotIn, Exists, DoesNotExist"),
        (ANTI + ".labelSelector", {"matchExpressions": [{"key": "a", "operator": "In"}]},
         "operator In needs values"),
        (ANTI + ".namespaces", "team", "namespaces: expected a list"),
        (ANTI + ".weight", 3, "unknown field 'weight'"),
        (PREF + ".weight", 0, "weight: expected an integer from 1 to 100, got 0"),
        (PREF + ".weight", 101, "weight: expected an integer from 1 to 100, got 101"),
        (PREF + ".podAffinityTerm", None, "[0].podAffinityTerm: missing"),
        (PREF + ".podAffinityTerm.topologyKey", "", "podAffinityTerm.topologyKey: expected a"),
        (PREF + ".term", {}, "unknown field 'term'"),
        (SPREAD + ".maxSkew", 0, "topologySpreadConstraints[0].maxSkew: expected an integer >= 1"),
        (SPREAD + ".whenUnsatisfiable", "Never", "expected DoNotSchedule or ScheduleAnyway"),
        (SPREAD + ".minDomains", 0, "minDomains: expected an integer >= 1"),
        (SPREAD + ".nodeAffinityPolicy", "honor", "nodeAffinityPolicy: expected Honor or Ignore"),
        ("boundPods.0.node", "nowhere", "boundPods[0].node: no node 'nowhere'"),
        ("boundPods.0.name", "p", "pod 'team/p' appears twice"),
        ("boundPods.0.terminating", "yes", "boundPods[0].terminating: expected true or false"),
        ("namespaces.team", {"labels": [1]}, "namespaces.team.labels: expected a mapping"),
        ("otherNodes.0.gpus", [], "otherNodes[0]: unknown field 'gpus'"),
    ],
)  # fmt: skip
def test_bad_input_is_named(path: str, value: Any, message: str) -> None:
    with pytest.raises(errors.SnapshotError) as err:
        snapshot.parse(_at(BASE, path, value))
    assert message in str(err.value)
