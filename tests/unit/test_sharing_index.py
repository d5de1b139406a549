"""The sharing planner's indexes choose exactly what the old scan over every node chose.

:mod:`migpilot.planning.sharing` finds a pod's node through indexes of GPU states; the scan it
replaced is kept in :mod:`tests.unit.sharing_reference`. On random sharing clusters (every
node mode, both node and GPU policies, selectors, CPU, several priorities, multi-slice pods,
partly sliced and used GPUs) the two give the same plan, slice for slice; the whole plan is
valid; and beyond the old size limit (where the scan tried one way per level) the indexed
planner, trying every way, places more pods. The explainer's summaries (read from
one node per earlier verdict) match those of its per-node reasons.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.planning import (
    explaining,
    generate,
    objective,
    options,
    planners,
    scoring,
    sharing,
    snapshot,
    validation,
)
from tests.unit import sharing_reference

MODES = [
    ("mps",),
    ("time-slicing",),
    ("mps", "time-slicing"),
    ("mps", "mps", "time-slicing"),
    ("mig", "mps", "time-slicing"),
]
MODELS = [generate.DEFAULT_MODELS, ("a100-80gb", "h100-80gb"), ("a30-24gb",)]

clusters = st.fixed_dictionaries(
    dict(
        seed=st.integers(0, 10**6),
        nodes=st.integers(1, 12),
        gpus_per_node=st.integers(1, 8),
        pods=st.integers(0, 120),
        node_modes=st.sampled_from(MODES),
        models=st.sampled_from(MODELS),
        used_fraction=st.sampled_from([0.0, 0.2, 0.4, 0.8]),
        mps_fraction=st.sampled_from([0.2, 0.4, 0.6]),
        unified_fraction=st.sampled_from([0.0, 0.2, 0.4]),
        vgpu_mode_fraction=st.sampled_from([0.0, 0.3, 1.0]),
        selector_fraction=st.sampled_from([0.0, 0.1, 0.4]),
        priority_levels=st.integers(1, 3),
        multi_instance_fraction=st.sampled_from([0.0, 0.15, 0.5]),
        cpu=st.booleans(),
    )
)
policies = st.sampled_from(list(scoring.Policy))


def drawn(
    args: dict[str, object], node: scoring.Policy, gpu: scoring.Policy, mixed: int = 0
) -> snapshot.Snapshot:
    """The generated cluster with these policies; with ``mixed``, every ``mixed``-th pod asks
    the other node policy and every other one the other GPU policy (pod annotations)."""
    snap = generate.sharing_snapshot(**args)  # type: ignore[arg-type]
    other = {
        scoring.Policy.BINPACK: scoring.Policy.SPREAD,
        scoring.Policy.SPREAD: scoring.Policy.BINPACK,
    }
    pods = tuple(
        dataclasses.replace(
            p,
            node_policy=other[node] if mixed and k % mixed == 0 else None,
            gpu_policy=other[gpu] if mixed and k % 2 else None,
        )
        for k, p in enumerate(snap.pods)
    )
    return dataclasses.replace(snap, pods=pods, policy=node, gpu_policy=gpu)


def shared_pods(snap: snapshot.Snapshot) -> list[snapshot.Pod]:
    return [p for p in snap.pods if not p.mig]


@settings(max_examples=200)
@given(args=clusters, node=policies, gpu=policies, mixed=st.sampled_from([0, 0, 2, 5]))
def test_indexed_planner_chooses_as_the_scan_did(
    args: dict[str, object], node: scoring.Policy, gpu: scoring.Policy, mixed: int
) -> None:
    snap = drawn(args, node, gpu, mixed)
    pods = shared_pods(snap)
    assert sharing.place(snap, pods) == sharing_reference.place(snap, pods)
    plan = planners.run(snap, "fast", options.Options(workers=1))
    assert validation.problems(snap, plan) == []


@settings(max_examples=60)
@given(args=clusters, node=policies, gpu=policies)
def test_summaries_match_the_per_node_reasons(
    args: dict[str, object], node: scoring.Policy, gpu: scoring.Policy
) -> None:
    snap = drawn(args, node, gpu)
    plan = planners.run(snap, "fast", options.Options(workers=1))
    done = {p.pod for p in plan.placements}
    pending = [p for p in snap.pods if p.key not in done]
    short = explaining.explain(snap, pending, plan.placements)
    full = explaining.explain(snap, pending, plan.placements, per_node=True)
    assert [u.reason for u in short] == [u.reason for u in full]
    explainer = explaining.Explainer(snap, plan.placements)
    for pod, why in zip(pending, full, strict=True):
        assert why.nodes == tuple(
            (n.name, explainer.node_reason(k, pod)[1]) for k, n in enumerate(snap.nodes)
        )


def test_beyond_the_old_size_limit_every_way_places_more() -> None:
    # 208 GPUs x 1,300 pods (about 1,050 of them sharing): past the 200,000 GPUs x pods where
    # the scan tried one way per level.
    snap = generate.sharing_snapshot(
        seed=2, nodes=26, gpus_per_node=8, pods=1300, node_modes=("mps", "time-slicing")
    )
    pods = shared_pods(snap)
    assert sum(len(n.gpus) for n in snap.nodes) * len(pods) > sharing_reference._SMALL_PROBLEM
    indexed = sharing.place(snap, pods)
    assert indexed == sharing_reference.place(snap, pods, every_size=True)
    one_way = sharing_reference.place(snap, pods, every_size=False)
    assert len(indexed.placements) > len(one_way.placements)  # 527 against 400
    plan = planners.run(snap, "fast", options.Options(workers=1))
    assert validation.problems(snap, plan) == []
    old = dataclasses.replace(plan, placements=one_way.placements)
    assert objective.score(snap, plan).weighted >= objective.score(snap, old).weighted
