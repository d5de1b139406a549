"""Traces carrying pod labels, required pod (anti-)affinity and topology spread: parsed with
clear errors, and honoured by the simulated cluster (planner and kube-scheduler alike)."""

from __future__ import annotations

import pytest

from migpilot import errors
from migpilot.planning import interpod
from migpilot.sim import clusters, policies, simulating, traces

HOST = "kubernetes.io/hostname"
HEADER = "name,arrival,duration,requests,labels,anti_affinity,spread,affinity\n"
CLUSTER = clusters.parse("h100-80gb:3x2")


def _parse(text: str) -> traces.Trace:
    return traces.parse(text, source="t.csv", model=CLUSTER.reference_model)


def test_columns_become_terms() -> None:
    trace = _parse(
        HEADER
        + f"w0,0,,mig-1g.10gb=1,app=web;tier=front,{HOST}:app=web,zone:2:app=web&tier=front,\n"
        + f"f0,1,,mig-1g.10gb=1,,,,{HOST}:app=web\n"
        + "plain,2,,mig-1g.10gb=1,,,,\n"
    )
    w0, f0, plain = trace.pods
    assert dict(w0.terms.labels) == {"app": "web", "tier": "front"}
    (anti,) = w0.terms.anti_affinity
    assert anti.topology_key == HOST and anti.namespaces == frozenset({"default"})
    assert anti.matches("default", {"app": "web"}, {}) and not anti.matches("default", {}, {})
    (spread,) = w0.terms.spread
    assert (spread.topology_key, spread.max_skew) == ("zone", 2)
    assert spread.selector is not None and spread.selector.matches({"app": "web", "tier": "front"})
    assert not spread.selector.matches({"app": "web"})
    assert f0.terms.affinity and not f0.terms.anti_affinity and not f0.terms.labels
    assert plain.terms is interpod.NO_TERMS


def test_columns_may_come_in_any_order_and_alone() -> None:
    trace = _parse("name,arrival,duration,requests,labels\na,0,,mig-1g.10gb=1,app=x\n")
    assert dict(trace.pods[0].terms.labels) == {"app": "x"}


@pytest.mark.parametrize(
    ("header", "row", "message"),
    [
        (HEADER, "a,0,,mig-1g.10gb=1,app,,,", r"t.csv:2: label 'app' is not LABEL=VALUE"),
        (HEADER, f"a,0,,mig-1g.10gb=1,,{HOST},,", r"t.csv:2: anti_affinity term .* is not TOP"),
        (HEADER, "a,0,,mig-1g.10gb=1,,zone:,,", r"t.csv:2: anti_affinity term 'zone:' selects no"),
        (HEADER, "a,0,,mig-1g.10gb=1,,,,:app=x", r"t.csv:2: affinity term ':app=x' is not"),
        (HEADER, "a,0,,mig-1g.10gb=1,,,zone:app=x,", r"t.csv:2: spread 'zone:app=x' is not"),
        (HEADER, "a,0,,mig-1g.10gb=1,,,zone:0:app=x,", r"max skew '0' is not a positive"),
        (HEADER, "a,0,,mig-1g.10gb=1,,,zone:1:a=x&a=y,", r"names 'a' twice"),
        (HEADER, "a,0,,mig-1g.10gb=1,,,", r"t.csv:2: expected 8 fields, got 7"),
        (
            "name,arrival,duration,requests,labels,colour\n",
            "a,0,,mig-1g.10gb=1,,",
            r"t.csv:1: unknown column 'colour'",
        ),
        (
            "name,arrival,duration,requests,labels,labels\n",
            "a,0,,mig-1g.10gb=1,,",
            r"t.csv:1: column 'labels' is named twice",
        ),
    ],
)
def test_malformed_terms_name_the_line(header: str, row: str, message: str) -> None:
    with pytest.raises(errors.TraceError, match=message):
        _parse(header + row + "\n")


def _replicas(count: int) -> traces.Trace:
    rows = "".join(f"web{i},{i},,mig-1g.10gb=1,app=web,{HOST}:app=web,,\n" for i in range(count))
    # Pods without terms fill GPUs too (binpacking would put the replicas on one node); the
    # later ones keep a faithful replay going until the replicas' instances exist.
    rows += "".join(f"other{i},{i * 50},,mig-1g.10gb=1,app=other,,,\n" for i in range(3))
    return _parse(HEADER + rows)


@pytest.mark.parametrize("policy", ["migpilot", "static"])
@pytest.mark.parametrize("mode", list(simulating.Replay))
def test_hostname_anti_affinity_replicas_never_share_a_node(
    policy: str, mode: simulating.Replay
) -> None:
    partitioning = (
        policies.static(CLUSTER) if policy == "static" else policies.dynamic(policy, CLUSTER)
    )
    result = simulating.simulate(
        _replicas(5),
        cluster=CLUSTER,
        policy=partitioning,
        settings=simulating.Settings(mode=mode, paranoid=True),
    )
    web = [o for o in result.outcomes if o.name.startswith("web") and o.bound_at is not None]
    # every replica runs to the end: at most one per node, and the three nodes each hold one
    assert sorted(o.node for o in web) == sorted(n.name for n in CLUSTER.nodes)
    others = [o for o in result.outcomes if o.name.startswith("other")]
    # (a faithful replay ends at the last arrival, before the last pod can bind)
    assert all(o.bound_at is not None for o in others[:2])
