"""Which nodes admit a pod: taints and tolerations, nodeSelector, node affinity, cordon."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.planning import constraints, snapshot

Req = snapshot.Requirement
Tol = snapshot.Toleration
Taint = snapshot.Taint


def node(
    *,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, str]] | None = None,
    unschedulable: bool = False,
    gpus: bool = True,
) -> snapshot.Node:
    doc: dict[str, Any] = {
        "name": "n",
        "labels": labels or {},
        "taints": taints or [],
        "unschedulable": unschedulable,
        "gpus": [{"model": "a100-80gb"}] if gpus else [],
    }
    return snapshot.parse({"version": 1, "nodes": [doc]}).nodes[0]


def pod(**fields: Any) -> snapshot.Pod:
    doc = {"name": "p", "requests": {"nvidia.com/mig-1g.10gb": 1}, **fields}
    return snapshot.parse({"version": 1, "pods": [doc]}).pods[0]


def affinity(*terms: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": t} for t in terms]
            }
        }
    }


# --------------------------------------------------------------------------- tolerations

TAINT = Taint("gpu", "a100", "NoSchedule")


@pytest.mark.parametrize(
    ("toleration", "expected"),
    [
        (Tol("", "Exists", "", ""), True),  # empty key + Exists tolerates everything
        (Tol("", "Exists", "", "NoSchedule"), True),
        (Tol("", "Exists", "", "NoExecute"), False),  # ... of its effect only
        (Tol("gpu", "Exists", "", ""), True),  # any value of the key
        (Tol("gpu", "Equal", "a100", ""), True),  # empty effect matches every effect
        (Tol("gpu", "Equal", "a100", "NoSchedule"), True),
        (Tol("gpu", "Equal", "a100", "NoExecute"), False),
        (Tol("gpu", "Equal", "a100", "PreferNoSchedule"), False),
        (Tol("gpu", "Equal", "h100", ""), False),
        (Tol("gpu", "Equal", "", ""), False),
        (Tol("other", "Exists", "", ""), False),
        (Tol("other", "Equal", "a100", ""), False),
    ],
)
def test_tolerates(toleration: snapshot.Toleration, expected: bool) -> None:
    assert constraints.tolerates(toleration, TAINT) is expected


def test_tolerates_empty_taint_value() -> None:
    bare = Taint("gpu", "", "NoSchedule")
    assert constraints.tolerates(Tol("gpu", "Equal", "", ""), bare)
    assert constraints.tolerates(Tol("gpu", "Exists", "", ""), bare)
    assert not constraints.tolerates(Tol("gpu", "Equal", "x", ""), bare)


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_hard_taints_reject_pods_that_do_not_tolerate_them(effect: str) -> None:
    n = node(taints=[{"key": "k", "value": "v", "effect": effect}])
    assert constraints.rejection(n, pod()) == f"taint k=v:{effect} is not tolerated"
    tolerated = pod(tolerations=[{"key": "k", "operator": "Equal", "value": "v"}])
    assert constraints.rejection(n, tolerated) is None
    wrong_effect = "NoExecute" if effect == "NoSchedule" else "NoSchedule"
    other = pod(tolerations=[{"key": "k", "value": "v", "effect": wrong_effect}])
    assert constraints.rejection(n, other) == f"taint k=v:{effect} is not tolerated"


def test_prefer_no_schedule_is_ignored() -> None:
    n = node(taints=[{"key": "k", "value": "v", "effect": "PreferNoSchedule"}])
    assert constraints.rejection(n, pod()) is None


def test_every_hard_taint_must_be_tolerated() -> None:
    n = node(
        taints=[
            {"key": "a", "value": "1", "effect": "NoSchedule"},
            {"key": "b", "value": "2", "effect": "NoExecute"},
            {"key": "c", "value": "3", "effect": "PreferNoSchedule"},
        ]
    )
    only_a = pod(tolerations=[{"key": "a", "operator": "Exists"}])
    assert constraints.rejection(n, only_a) == "taint b=2:NoExecute is not tolerated"
    both = pod(tolerations=[{"key": "a", "operator": "Exists"}, {"key": "b", "value": "2"}])
    assert constraints.rejection(n, both) is None
    everything = pod(tolerations=[{"operator": "Exists"}])
    assert constraints.rejection(n, everything) is None


# --------------------------------------------------------------------------- nodeSelector


def test_node_selector() -> None:
    n = node(labels={"zone": "a", "pool": "infer"})
    assert constraints.rejection(n, pod(nodeSelector={"zone": "a"})) is None
    assert constraints.rejection(n, pod(nodeSelector={"zone": "a", "pool": "infer"})) is None
    assert (
        constraints.rejection(n, pod(nodeSelector={"zone": "b"}))
        == "nodeSelector zone=b does not match (node has 'a')"
    )
    assert (
        constraints.rejection(n, pod(nodeSelector={"rack": "7"}))
        == "nodeSelector rack=7 does not match (node has missing)"
    )


def test_node_selector_reports_keys_in_sorted_order() -> None:
    n = node(labels={})
    reason = constraints.rejection(n, pod(nodeSelector={"z": "1", "a": "2"}))
    assert reason is not None and reason.startswith("nodeSelector a=2")


# --------------------------------------------------------------------------- affinity

LABELS = {"zone": "a", "rank": "5", "name": "gpu-node"}


@pytest.mark.parametrize(
    ("requirement", "expected"),
    [
        ({"key": "zone", "operator": "In", "values": ["a", "b"]}, True),
        ({"key": "zone", "operator": "In", "values": ["b"]}, False),
        ({"key": "rack", "operator": "In", "values": ["a"]}, False),  # missing label
        ({"key": "zone", "operator": "NotIn", "values": ["b", "c"]}, True),
        ({"key": "zone", "operator": "NotIn", "values": ["a"]}, False),
        ({"key": "rack", "operator": "NotIn", "values": ["a"]}, True),  # missing label matches
        ({"key": "zone", "operator": "Exists"}, True),
        ({"key": "rack", "operator": "Exists"}, False),
        ({"key": "zone", "operator": "DoesNotExist"}, False),
        ({"key": "rack", "operator": "DoesNotExist"}, True),
        ({"key": "rank", "operator": "Gt", "values": ["4"]}, True),
        ({"key": "rank", "operator": "Gt", "values": ["5"]}, False),
        ({"key": "rank", "operator": "Gt", "values": ["-1"]}, True),
        ({"key": "rank", "operator": "Lt", "values": ["6"]}, True),
        ({"key": "rank", "operator": "Lt", "values": ["5"]}, False),
        ({"key": "name", "operator": "Gt", "values": ["1"]}, False),  # not an integer
        ({"key": "name", "operator": "Lt", "values": ["1"]}, False),
        ({"key": "rack", "operator": "Gt", "values": ["1"]}, False),  # missing label
        ({"key": "rack", "operator": "Lt", "values": ["1"]}, False),
    ],
)
def test_affinity_operators(requirement: dict[str, Any], expected: bool) -> None:
    p = pod(affinity=affinity([requirement]))
    assert constraints.affinity_matches(p.affinity, LABELS) is expected
    reason = constraints.rejection(node(labels=LABELS), p)
    if expected:
        assert reason is None
    else:
        assert reason == "required node affinity does not match the node's labels or name"


def test_requirements_of_a_term_are_anded_and_terms_ored() -> None:
    zone_a = {"key": "zone", "operator": "In", "values": ["a"]}
    zone_b = {"key": "zone", "operator": "In", "values": ["b"]}
    has_rank = {"key": "rank", "operator": "Exists"}
    no_rank = {"key": "rank", "operator": "DoesNotExist"}
    match = constraints.affinity_matches
    assert match(pod(affinity=affinity([zone_a, has_rank])).affinity, LABELS)
    assert not match(pod(affinity=affinity([zone_a, no_rank])).affinity, LABELS)
    assert match(pod(affinity=affinity([zone_b], [zone_a])).affinity, LABELS)
    assert match(pod(affinity=affinity([zone_a, no_rank], [has_rank])).affinity, LABELS)
    assert not match(pod(affinity=affinity([zone_b], [no_rank])).affinity, LABELS)


def test_empty_term_matches_nothing_and_no_terms_match_everything() -> None:
    assert constraints.affinity_matches((), LABELS)
    assert not constraints.affinity_matches(((),), LABELS)
    assert constraints.affinity_matches(((), (Req("zone", "Exists", ()),)), LABELS)
    assert constraints.rejection(node(), pod(affinity={"nodeAffinity": {}})) is None


@given(
    value=st.sampled_from(["a", "b", "c", None]),
    values=st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=3),
)
def test_not_in_is_the_negation_of_in(value: str | None, values: list[str]) -> None:
    labels = {} if value is None else {"k": value}
    is_in = constraints.affinity_matches(((Req("k", "In", tuple(values)),),), labels)
    not_in = constraints.affinity_matches(((Req("k", "NotIn", tuple(values)),),), labels)
    assert is_in != not_in


@given(label=st.integers(-50, 50), bound=st.integers(-50, 50))
def test_gt_and_lt_compare_as_integers(label: int, bound: int) -> None:
    labels = {"k": str(label)}
    assert constraints.affinity_matches(((Req("k", "Gt", (str(bound),)),),), labels) is (
        label > bound
    )
    assert constraints.affinity_matches(((Req("k", "Lt", (str(bound),)),),), labels) is (
        label < bound
    )


# --------------------------------------------------------------------------- cordon and order


def test_cordoned_node_rejects_everyone() -> None:
    n = node(unschedulable=True)
    assert constraints.rejection(n, pod()) == "node is cordoned (unschedulable)"
    assert constraints.rejection(n, pod(tolerations=[{"operator": "Exists"}])) == (
        "node is cordoned (unschedulable)"
    )


def test_node_without_gpus() -> None:
    assert constraints.rejection(node(gpus=False), pod()) == "node has no MIG-capable GPU"


def test_first_failing_rule_is_reported_in_scheduler_order() -> None:
    n = node(
        labels={"zone": "a"},
        taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}],
        unschedulable=True,
    )
    strict = pod(
        nodeSelector={"zone": "b"},
        affinity=affinity([{"key": "zone", "operator": "In", "values": ["c"]}]),
    )
    assert constraints.rejection(n, strict) == "node is cordoned (unschedulable)"
    n = node(labels={"zone": "a"}, taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}])
    assert constraints.rejection(n, strict) == "nodeSelector zone=b does not match (node has 'a')"
    loose = pod(affinity=affinity([{"key": "zone", "operator": "In", "values": ["c"]}]))
    assert constraints.rejection(n, loose) == (
        "required node affinity does not match the node's labels or name"
    )
    assert constraints.rejection(n, pod()) == "taint k=v:NoSchedule is not tolerated"


def test_signature_groups_pods_with_the_same_constraints() -> None:
    a = pod(nodeSelector={"zone": "a", "pool": "x"}, tolerations=[{"operator": "Exists"}])
    b = snapshot.parse(
        {
            "version": 1,
            "pods": [
                {
                    "name": "q",
                    "priority": 7,
                    "requests": {"nvidia.com/mig-7g.80gb": 3, "cpu": "2"},
                    "nodeSelector": {"pool": "x", "zone": "a"},
                    "tolerations": [{"operator": "Exists"}],
                }
            ],
        }
    ).pods[0]
    assert constraints.signature(a) == constraints.signature(b)
    assert constraints.signature(a) != constraints.signature(pod(nodeSelector={"zone": "a"}))
    assert constraints.signature(pod()) != constraints.signature(
        pod(affinity=affinity([{"key": "zone", "operator": "Exists"}]))
    )


def test_a_field_requirement_matches_the_node_name_not_a_label() -> None:
    pin = ((Req("metadata.name", "In", ("n1",), True),),)
    assert constraints.affinity_matches(pin, {"metadata.name": "n1"}, name="n0") is False
    assert constraints.affinity_matches(pin, {}, name="n1") is True
    away = ((Req("metadata.name", "NotIn", ("n1",), True),),)
    assert constraints.affinity_matches(away, {}, name="n0") is True


def test_alike_nodes_admit_a_pod_pinned_to_one_of_them_differently() -> None:
    """Admission decides per class of alike nodes, except for a pod that names its node."""
    nodes = [dataclasses.replace(node(), name=f"n{i}") for i in range(3)]
    admission = constraints.Admission(nodes)
    assert admission.class_of(0) == admission.class_of(2)
    pinned = pod(
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "In", "values": ["n2"]}
                            ]
                        }
                    ]
                }
            }
        }
    )
    assert pinned.affinity == ((Req("metadata.name", "In", ("n2",), True),),)
    assert admission.admits(pinned) == [False, False, True]
    assert admission.reason(2, pinned) is None
    assert "affinity" in (admission.reason(0, pinned) or "")
    assert admission.admits(pod()) == [True, True, True]
    # The file format writes the requirement back where it came from.
    doc = snapshot.to_document(snapshot.Snapshot(nodes=(), pods=(pinned,)))
    terms = doc["pods"][0]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert terms["nodeSelectorTerms"] == [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n2"]}]}
    ]
