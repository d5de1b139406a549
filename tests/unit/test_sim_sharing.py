"""The simulator with nodes in mode mps and time-slicing: cluster specs with modes, the
small-inference trace, and replays that are sound and repeatable."""

from __future__ import annotations

import dataclasses

import pytest

from migpilot import errors
from migpilot.planning import modes
from migpilot.planning import unified as unifying
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
        settings=simulating.Settings(mode=simulating.Replay.FAITHFUL, paranoid=True),
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


def _pods(*specs: tuple[int, float, float]) -> traces.Trace:
    """Unified one-GPU pods: (gpumem-percentage, arrival, duration)."""
    pods = tuple(
        traces.TracePod(
            name=f"p{i}",
            arrival=arrival,
            duration=duration,
            mig=(),
            cpu_milli=500,  # a node has 12 cores per GPU
            memory_bytes=2**30,
            unified=unifying.UnifiedRequest((unifying.GpuAsk(1, memory_percent=pct),)),
        )
        for i, (pct, arrival, duration) in enumerate(specs)
    )
    return traces.Trace(name="t", pods=pods, timed=True)


def _run(spec: str, trace: traces.Trace, policy: str = "migpilot") -> simulating.Result:
    cluster = clusters.parse(spec)
    return simulating.simulate(
        trace,
        cluster=cluster,
        policy=policies.dynamic(policy, cluster),
        settings=simulating.Settings(mode=simulating.Replay.FAITHFUL, paranoid=True),
    )


def test_memory_ratio_shows_what_mps_packs_beyond_the_compute_cap() -> None:
    # Sixteen pods asking 5 % (4 GB) each, for a long time, on one A100-80GB: MIG runs seven
    # (1g.10gb), MPS all sixteen. Both count the GPU's full compute (each pod counts a 1g
    # slice, capped at seven per GPU), the memory ratio tells them apart (28 against 64 GB).
    trace = _pods(*((5, float(i), 100_000.0 - i) for i in range(16)))  # all end at 100,000 s
    mig = _run("a100-80gb:1x1", trace)
    mps = _run("a100-80gb:1x1@mps", trace)
    assert (mig.pods_scheduled, mps.pods_scheduled) == (7, 16)
    assert mig.allocation_ratio > 0.99 and mps.allocation_ratio > 0.99
    assert 0.34 < mig.memory_ratio < 0.36
    assert 0.79 < mps.memory_ratio < 0.81


def test_shared_gpu_counts_what_its_running_pods_ask_up_to_its_compute() -> None:
    # Three 30 % pods (24 GB, a 3g.40gb's 3 slices each) share one MPS GPU: 9 slices asked,
    # 7 counted. When the first leaves the two left count 6, whatever order they came in.
    trace = _pods((30, 0.0, 1000.0), (30, 1.0, 5000.0), (30, 2.0, 5000.0))
    result = _run("a100-80gb:1x1@mps", trace)
    assert result.pods_scheduled == 3
    ratios = dict(result.ratio_over_time)
    assert max(ratios.values()) == 1.0
    after = [r for t, r in result.ratio_over_time if 1000.0 < t < 5000.0]
    assert after and after[0] == pytest.approx(6 / 7)


def test_nos_policy_on_mps_nodes_is_sound_and_repeatable() -> None:
    cluster = "a100-80gb:3x4@mps"
    model = clusters.parse(cluster).reference_model
    trace = traces.synthetic(
        "small-inference", seed=2, model=model, pods=150, requests=traces.Requests.UNIFIED
    )
    first, again = _run(cluster, trace, "nos"), _run(cluster, trace, "nos")
    assert dataclasses.replace(first, planner_seconds=0.0) == dataclasses.replace(
        again, planner_seconds=0.0
    )
    assert first.pods_scheduled == 150
    assert 0 < first.memory_ratio <= 1


def test_mean_gap_scales_the_load_and_mig_names_keep_the_memory_asked() -> None:
    model = clusters.parse("a100-80gb:1x8").reference_model
    fast = traces.synthetic("small-inference", seed=4, model=model, pods=30)
    slow = traces.synthetic("small-inference", seed=4, model=model, pods=30, mean_gap_s=120.0)
    assert slow.pods[-1].arrival == pytest.approx(2 * fast.pods[-1].arrival, rel=1e-3)
    assert [p.mig for p in slow.pods] == [p.mig for p in fast.pods]
    same = traces.synthetic("small-inference", seed=4, model=model, pods=30,
                            requests=traces.Requests.UNIFIED)  # fmt: skip
    for named, unified in zip(fast.pods, same.pods, strict=True):
        assert unified.unified is not None
        assert named.memory_gb == modes.unified_gb(unified.unified.asks[0], model)
    with pytest.raises(errors.TraceError, match="mean gap between arrivals must be positive"):
        traces.synthetic("small-inference", seed=4, model=model, pods=3, mean_gap_s=0.0)
