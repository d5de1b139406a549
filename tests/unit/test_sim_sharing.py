"""The simulator with nodes in mode mps and time-slicing: cluster specs with modes, the
small-inference trace, and replays that are sound and repeatable."""

from __future__ import annotations

import dataclasses

import pytest

from migpilot import errors
from migpilot.planning import modes
from migpilot.sim import clusters, policies, simulating, traces


@pytest.mark.parametrize(
    ("spec", "mode", "replicas", "name"),
    [
        ("a100-80gb:1x8", modes.Mode.MIG, 0, "a100-80gb-00"),
        ("a100-80gb:1x8@mig", modes.Mode.MIG, 0, "a100-80gb-00"),
        ("a100-80gb:1x8@mps", modes.Mode.MPS, 0, "a100-80gb-mps-00"),
        ("a100-80gb:1x8@time-slicing", modes.Mode.TIME_SLICING, 4, "a100-80gb-time-slicing-00"),
        ("a100-80gb:1x8@time-slicing:8", modes.Mode.TIME_SLICING, 8, "a100-80gb-time-slicing-00"),
        ("a100-80gb:1x8@none", modes.Mode.NONE, 0, "a100-80gb-none-00"),
    ],
)
def test_cluster_groups_take_a_mode(spec: str, mode: modes.Mode, replicas: int, name: str) -> None:
    (node,) = clusters.parse(spec).nodes
    assert (node.mode, node.replicas, node.name) == (mode, replicas, name)
    assert node.labels.get(modes.MODE_LABEL) == (None if mode is modes.Mode.MIG else mode.value)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("a100-80gb:1x8@mpss", "mode 'mpss' is not one of mig, mps, time-slicing, none"),
        ("a100-80gb:1x8@mps:4", "only mode time-slicing takes replicas"),
        ("a100-80gb:1x8@time-slicing:0", "replicas must be at least 1"),
        ("a100-80gb:1x8@mps,a100-80gb:1x8@mps", "names a GPU model twice in one mode"),
    ],
)
def test_bad_cluster_modes_are_named(spec: str, match: str) -> None:
    with pytest.raises(errors.ClusterSpecError, match=match):
        clusters.parse(spec)


def test_one_model_in_two_modes_is_two_groups() -> None:
    names = [n.name for n in clusters.parse("a100-80gb:1x8,a100-80gb:1x8@mps").nodes]
    assert names == ["a100-80gb-00", "a100-80gb-mps-00"]


MIXED = "a100-80gb:1x4,a100-80gb:1x4@mps,a100-80gb:1x4@time-slicing:2"


def _replay(spec: str, *, pods: int = 120, seed: int = 1) -> simulating.Result:
    cluster = clusters.parse(spec)
    trace = traces.synthetic(
        "small-inference",
        seed=seed,
        model=cluster.reference_model,
        pods=pods,
        requests=traces.Requests.UNIFIED,
    )
    return simulating.simulate(
        trace,
        cluster=cluster,
        policy=policies.dynamic("migpilot", cluster),
        settings=simulating.Settings(mode=simulating.Mode.FAITHFUL, paranoid=True),
    )


def test_small_inference_trace_is_seeded_and_small() -> None:
    model = clusters.parse("a100-80gb:1x8").reference_model
    a = traces.synthetic("small-inference", seed=3, model=model, pods=50,
                         requests=traces.Requests.UNIFIED)  # fmt: skip
    b = traces.synthetic("small-inference", seed=3, model=model, pods=50,
                         requests=traces.Requests.UNIFIED)  # fmt: skip
    assert a == b
    shares = {p.unified.asks[0].memory_percent for p in a.pods if p.unified is not None}
    assert shares <= {5, 10, 20, 30, 50}
    assert len(shares) > 2


@pytest.mark.parametrize(
    "spec", [MIXED, "a100-80gb:3x4@mps", "a100-80gb:3x4@time-slicing:2", "a100-80gb:3x4"]
)
def test_replays_in_every_mode_are_sound_and_repeatable(spec: str) -> None:
    first = _replay(spec)
    again = _replay(spec)
    assert dataclasses.replace(first, planner_seconds=0.0) == dataclasses.replace(
        again, planner_seconds=0.0
    )
    assert first.pods_scheduled > 0
    assert 0 < first.allocation_ratio <= 1


def test_mixed_cluster_serves_pods_on_every_mode() -> None:
    result = _replay(MIXED)
    used = {o.node.rsplit("-", 1)[0] for o in result.outcomes if o.node is not None}
    assert used == {"a100-80gb", "a100-80gb-mps", "a100-80gb-time-slicing"}


def test_mps_only_cluster_never_waits_longer_at_p99_than_mig_only_on_small_pods() -> None:
    # Small pods waste most of a MIG slice (5 % of memory still takes a 1g.10gb): MPS slices
    # of the size asked hold more pods at once.
    mig = _replay("a100-80gb:3x4", pods=200)
    mps = _replay("a100-80gb:3x4@mps", pods=200)
    assert mps.pending_percentile(99) <= mig.pending_percentile(99)
