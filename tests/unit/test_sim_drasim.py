"""Replays of claims on DRA nodes: uncurated first-fit, prioritized lists, and steering by the
planner through the device order (planned placements first) or device taints."""

from __future__ import annotations

import dataclasses

import pytest

from migpilot import errors
from migpilot.planning import draalloc, draclaims, scoring
from migpilot.sim import clusters, drasim, nativegen, queueing, traces

HEADER = "name,arrival,duration,requests,node_selector\n"


def _trace(rows: str) -> traces.Trace:
    return traces.parse_native(HEADER + rows, source="test")


def _pods(rows: str, *, memory_share: float = 0.0, cluster: str = "h100-80gb:1x1") -> tuple:
    return drasim.claims_from_trace(
        _trace(rows), clusters.parse(cluster), memory_share=memory_share, seed=1
    )[0]


def _served(result: drasim.Result) -> dict[str, tuple[str, ...]]:
    return {o.name: o.devices for o in result.outcomes if o.bound_at is not None}


# 1g, then 4g, then 2g on one H100, each running long after the last arrival.
FRAGMENTING = (
    "a,0,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "b,10,1000,mig-4g.40gb=1;cpu=1;memory=1Gi,\n"
    "c,20,1000,mig-2g.20gb=1;cpu=1;memory=1Gi,\n"
    "z,30,1,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
)


def test_first_fit_fragments_a_gpu_that_steering_keeps_whole() -> None:
    pods = _pods(FRAGMENTING)
    cluster = clusters.parse("h100-80gb:1x1")
    uncurated = drasim.run(pods, cluster, drasim.Variant.UNCURATED)
    # The 1g.10gb takes slot 0, the only start of a 4g.40gb: b waits for ever.
    assert _served(uncurated) == {
        "a": ("gpu-0-mig-1g-10gb-0",),
        "c": ("gpu-0-mig-2g-20gb-2",),
        "z": ("gpu-0-mig-1g-10gb-1",),
    }
    steered = drasim.run(pods, cluster, drasim.Variant.STEERED)
    served = _served(steered)
    assert set(served) == {"a", "b", "c"}  # 1 + 4 + 2 compute slices: z finds none left
    assert served["b"] == ("gpu-0-mig-4g-40gb-0",)
    assert steered.pods_served == 3 and uncurated.pods_served == 3
    assert steered.allocation_ratio > uncurated.allocation_ratio
    # Steered pods wait for the controller's batch window.
    bound = {o.name: o.bound_at for o in steered.outcomes}
    assert bound["a"] == pytest.approx(1.0)
    assert steered.slice_writes >= 1 and steered.plan_rounds >= 3


def test_steering_serves_more_pods_when_first_fit_blocks_them() -> None:
    rows = (
        "a,0,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
        "b,10,1000,mig-4g.40gb=1;cpu=1;memory=1Gi,\n"
        "c,20,1000,mig-2g.20gb=1;cpu=1;memory=1Gi,\n"
        "z,30,1,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"  # no room left for it either way
    )
    pods = _pods(rows)
    cluster = clusters.parse("h100-80gb:1x1")
    assert drasim.run(pods, cluster, drasim.Variant.UNCURATED).pods_served == 2
    assert drasim.run(pods, cluster, drasim.Variant.STEERED).pods_served == 3


MEMORY = (
    "a,0,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "b,10,1000,mig-2g.20gb=1;cpu=1;memory=1Gi,\n"
    "c,20,1000,mig-3g.40gb=1;cpu=1;memory=1Gi,\n"
    "z,30,1,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
)


def test_claims_by_memory_get_the_smallest_fitting_profile_when_steered() -> None:
    pods = _pods(MEMORY, memory_share=1.0, cluster="h100-80gb:1x2")
    assert all(p.by_memory for p in pods)
    cluster = clusters.parse("h100-80gb:1x2")
    start = drasim.Settings(order=draalloc.DeviceOrder.START)
    uncurated = drasim.run(pods, cluster, drasim.Variant.UNCURATED, start)
    # Listed by start, the 7g.80gb comes first: a 10 GB claim takes a whole GPU.
    assert _served(uncurated)["a"] == ("gpu-0-mig-7g-80gb-0",)
    assert uncurated.oversized_devices >= 2
    assert uncurated.needed_ratio < uncurated.allocation_ratio
    steered = drasim.run(pods, cluster, drasim.Variant.STEERED, start)
    # The smallest fitting profiles (10 GB, 20 GB with one compute slice, 40 GB with three).
    got = {
        n: [d.split("-mig-")[1].rsplit("-", 1)[0] for d in ds] for n, ds in _served(steered).items()
    }
    assert got == {"a": ["1g-10gb"], "b": ["1g-20gb"], "c": ["3g-40gb"], "z": ["1g-10gb"]}
    assert steered.oversized_devices == 0
    assert steered.needed_ratio == pytest.approx(steered.allocation_ratio)
    prioritized = drasim.run(pods, cluster, drasim.Variant.PRIORITIZED, start)
    assert prioritized.oversized_devices == 0
    assert _served(prioritized)["a"] == ("gpu-0-mig-1g-10gb-0",)


def test_a_departure_lets_a_pending_claim_in() -> None:
    rows = (
        "a,0,10,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"
        "b,1,100,mig-3g.40gb=1;cpu=1;memory=1Gi,\n"
        "z,50,1,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    )
    pods = _pods(rows)
    cluster = clusters.parse("h100-80gb:1x1")
    for variant in drasim.Variant:
        result = drasim.run(pods, cluster, variant)
        bound = {o.name: o.bound_at for o in result.outcomes}
        # Steered, a is bound a batch window late (1 s), leaves at 11, and b's plan is a batch
        # window after that.
        expected = 12.0 if variant is drasim.Variant.STEERED else 10.0
        assert bound["b"] == pytest.approx(expected)
        assert result.pending_s[1] == pytest.approx(bound["b"] - 1.0)


# One H100: a holds the 4g.40gb at slot 0 until 20 s; the 1g.10gb pods at slots 4-6 leave at
# 12, 14, 16 (d, pending from 1.5 s, takes slot 4 at 12 and leaves at 18). Each departure
# requeues big (a 4g.40gb, pending from 1 s), which fails each time; late (a 4g.40gb too)
# comes at 19.5 and fails once. At 20 s a's departure frees the one 4g.40gb for one of them.
RETRIES = (
    "a,0,20,mig-4g.40gb=1;cpu=1;memory=1Gi,\n"
    "c1,0.2,11.8,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "c2,0.3,13.7,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "c3,0.4,15.6,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "big,1,100,mig-4g.40gb=1;cpu=1;memory=1Gi,\n"
    "d,1.5,6,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "late,19.5,100,mig-4g.40gb=1;cpu=1;memory=1Gi,\n"
    "end,30,1,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"
)


def test_kube_schedulers_backoff_retries_the_pod_that_failed_less_first() -> None:
    # kube-scheduler v1.37 (pkg/scheduler/backend/queue): big failed at 1, 12, 14, 16 and 18 s,
    # so at 20 s it backs off until the 28 s window (10 s, the maximum); late failed once at
    # 19.5 s, backing off until the 20 s window. Both are backing off, and the backoffQ pops
    # the sooner done first (lessBackoffCompletedWithPriority): late gets the 4g.40gb, though
    # big came 18.5 s before it. The simulator used to retry the oldest first.
    pods = _pods(RETRIES)
    cluster = clusters.parse("h100-80gb:1x1")
    result = drasim.run(pods, cluster, drasim.Variant.UNCURATED)
    bound = {o.name: o.bound_at for o in result.outcomes}
    assert bound["d"] == pytest.approx(12.0)
    assert bound["late"] == pytest.approx(20.0) and bound["big"] is None
    assert _served(result)["late"] == ("gpu-0-mig-4g-40gb-0",)
    # Without backoff the pods are retried in the order of their last attempts: big first.
    fifo = drasim.run(
        pods, cluster, drasim.Variant.UNCURATED, drasim.Settings(backoff=queueing.NO_BACKOFF)
    )
    bound = {o.name: o.bound_at for o in fifo.outcomes}
    assert bound["big"] == pytest.approx(20.0) and bound["late"] is None
    # Compressed 100 times (bench_dra_kube's --speedup 100), kube-scheduler backs off 100 times
    # longer in trace time: the same here, late first.
    slow = drasim.Settings(backoff=queueing.Backoff(100.0, 1000.0, 100.0))
    bound = {
        o.name: o.bound_at
        for o in drasim.run(pods, cluster, drasim.Variant.UNCURATED, slow).outcomes
    }
    assert bound["late"] == pytest.approx(20.0)


def test_cpu_and_node_scoring_pick_the_node() -> None:
    rows = "a,0,100,mig-1g.10gb=1;cpu=1;memory=1Gi,\nb,1,100,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    pods = _pods(rows, cluster="h100-80gb:2x1")
    cluster = clusters.parse("h100-80gb:2x1")
    spread = drasim.run(pods, cluster, drasim.Variant.UNCURATED)
    assert {o.node for o in spread.outcomes} == {n.name for n in cluster.nodes}
    packed = drasim.run(
        pods,
        cluster,
        drasim.Variant.UNCURATED,
        drasim.Settings(scoring=drasim.NodeScoring.MOST_ALLOCATED),
    )
    assert len({o.node for o in packed.outcomes}) == 1


def test_claims_from_a_trace() -> None:
    cluster = clusters.parse("h100-80gb:1x8,a100-80gb:1x8")
    rows = (
        "a,0,10,mig-3g.40gb=2;cpu=1;memory=1Gi,nvidia.com/gpu.product=NVIDIA-A100-SXM4-80GB\n"
        "b,1,10,gpu=1;gpumem=8000;cpu=1;memory=1Gi,\n"
        "c,2,10,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    )
    by_profile, skipped = drasim.claims_from_trace(_trace(rows), cluster, memory_share=0.0, seed=3)
    assert skipped == 1 and [p.name for p in by_profile] == ["a", "c"]
    assert by_profile[0].claim == draalloc.Claim(
        (draalloc.Request(2, (draclaims.Selector(profile="3g.40gb", model="a100-80gb"),)),)
    )
    assert by_profile[0].planned.mig and by_profile[0].planned.unified is None
    by_memory, _ = drasim.claims_from_trace(_trace(rows), cluster, memory_share=1.0, seed=3)
    sel = by_memory[0].claim.requests[0].alternatives[0]
    assert sel == draclaims.Selector(min_memory_mib=38146, model="a100-80gb")
    assert by_memory[0].planned.unified is not None and not by_memory[0].planned.mig
    assert drasim.memory_mib("1g.10gb") == 9536
    with pytest.raises(errors.MigpilotError, match="0..1"):
        drasim.claims_from_trace(_trace(rows), cluster, memory_share=1.5, seed=3)
    with pytest.raises(errors.MigpilotError, match="no pod"):
        drasim.run((), cluster, drasim.Variant.UNCURATED)


def test_the_share_of_claims_by_memory_follows_the_seed() -> None:
    cluster = clusters.parse("h100-80gb:1x8")
    trace = traces.parse_native(nativegen.generate("steady-mixed", seed=2, pods=200), source="t")
    a, _ = drasim.claims_from_trace(trace, cluster, memory_share=0.5, seed=7)
    b, _ = drasim.claims_from_trace(trace, cluster, memory_share=0.5, seed=7)
    c, _ = drasim.claims_from_trace(trace, cluster, memory_share=0.5, seed=8)
    assert [p.by_memory for p in a] == [p.by_memory for p in b] != [p.by_memory for p in c]
    assert 60 < sum(p.by_memory for p in a) < 140


def test_replays_are_deterministic_and_never_allocate_a_device_twice() -> None:
    cluster = clusters.parse("h100-80gb:1x4,a100-80gb:1x4")
    trace = traces.parse_native(nativegen.generate("steady-mixed", seed=2, pods=80), source="t")
    pods, _ = drasim.claims_from_trace(trace, cluster, memory_share=0.5, seed=1)
    for variant in drasim.Variant:
        first = drasim.run(pods, cluster, variant)
        assert drasim.run(pods, cluster, variant) == first
        # At every binding, the devices of pods still running on that node are distinct.
        running: list[tuple[float, float, str, str]] = []
        by_name = {p.name: p for p in pods}
        for o in first.outcomes:
            if o.bound_at is None:
                continue
            stop = o.bound_at + (by_name[o.name].duration or float("inf"))
            running.extend((o.bound_at, stop, o.node or "", d) for d in o.devices)
        for i, (t0, t1, node, dev) in enumerate(running):
            for u0, u1, other, dev2 in running[i + 1 :]:
                if node == other and dev == dev2:
                    assert t1 <= u0 or u1 <= t0, (node, dev)


def test_steering_packs_small_claims_and_keeps_a_gpu_whole_for_a_big_one() -> None:
    rows = (
        "a,0,1000,mig-1g.10gb=1;cpu=8;memory=1Gi,\n"
        "b,10,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
        "z,30,1000,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"
    )
    pods = _pods(rows, cluster="h100-80gb:2x1")
    cluster = clusters.parse("h100-80gb:2x1")
    nodes = [n.name for n in cluster.nodes]
    uncurated = drasim.run(pods, cluster, drasim.Variant.UNCURATED)
    # kube-scheduler's default score sends b to the node with the most CPU left: both GPUs
    # are cut, and the 7g.80gb finds none whole.
    assert [o.node for o in uncurated.outcomes] == [nodes[0], nodes[1], None]
    steered = drasim.run(pods, cluster, drasim.Variant.STEERED)
    # The planner packs b beside a, and the controller pins b there: z gets the other GPU.
    assert [o.node for o in steered.outcomes] == [nodes[0], nodes[0], nodes[1]]
    assert _served(steered)["z"] == ("gpu-0-mig-7g-80gb-0",)


# The first steering: unplanned placements tainted, the planner packing nodes.
TAINTS_PACKING = drasim.Settings(
    steering=drasim.Steering.TAINTS,
    node_policy=scoring.Policy.BINPACK,
    gpu_policy=scoring.Policy.SPREAD,
)


def test_packing_nodes_for_a_whole_node_pod_costs_pods_that_following_the_scheduler_does_not() -> (
    None
):
    rows = (
        "a,0,1000,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"
        "b,10,1000,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"
        "z,20,1000,mig-7g.80gb=2;cpu=1;memory=1Gi,\n"  # a whole node of two GPUs
        "c,30,1000,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"
        "d,40,1000,mig-7g.80gb=1;cpu=1;memory=1Gi,\n"
    )
    pods = _pods(rows, cluster="h100-80gb:2x2")
    cluster = clusters.parse("h100-80gb:2x2")
    uncurated = drasim.run(pods, cluster, drasim.Variant.UNCURATED)
    assert set(_served(uncurated)) == {"a", "b", "c", "d"}
    # Packing a and b on one node keeps the other whole for z, which then holds both GPUs
    # c and d would have had.
    packed = drasim.run(pods, cluster, drasim.Variant.STEERED, TAINTS_PACKING)
    assert set(_served(packed)) == {"a", "b", "z"}
    # The planner following kube-scheduler's LeastAllocated spreads a and b as it does.
    steered = drasim.run(pods, cluster, drasim.Variant.STEERED)
    assert steered.settings.planner_node_policy() is scoring.Policy.SPREAD
    assert steered.pods_served == uncurated.pods_served == 4
    most = drasim.Settings(scoring=drasim.NodeScoring.MOST_ALLOCATED)
    assert most.planner_node_policy() is scoring.Policy.BINPACK


def test_a_taint_blocks_a_claim_that_order_steering_lets_fall_back() -> None:
    cluster = clusters.parse("h100-80gb:1x1")
    p = _pods("p,0,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n", memory_share=1.0)
    q = _pods("q,0.5,1000,mig-4g.40gb=1;cpu=1;memory=1Gi,\n")
    pods = p + q
    assert [c.by_memory for c in pods] == [True, False]
    start = draalloc.DeviceOrder.START
    # Listed by start, larger first: p (10 GB by memory) takes the first untainted placement
    # that holds it, the 4g.40gb at slot 0 planned for q; q's only start is gone, for good.
    tainted = drasim.run(
        pods,
        cluster,
        drasim.Variant.STEERED,
        dataclasses.replace(TAINTS_PACKING, order=start),
    )
    assert _served(tainted) == {"p": ("gpu-0-mig-4g-40gb-0",)}
    assert tainted.steering_misses == 1
    # Order steering lists the planned placements first, smallest first: p gets its 1g.10gb.
    ordered = drasim.run(pods, cluster, drasim.Variant.STEERED, drasim.Settings(order=start))
    assert _served(ordered) == {"p": ("gpu-0-mig-1g-10gb-6",), "q": ("gpu-0-mig-4g-40gb-0",)}
    assert ordered.steering_misses == 0 and ordered.slice_writes >= 1
    uncurated = drasim.run(pods, cluster, drasim.Variant.UNCURATED, drasim.Settings(order=start))
    assert uncurated.pods_served == 1


def test_a_best_fit_listing_serves_pods_as_they_come() -> None:
    pods = _pods(FRAGMENTING)
    cluster = clusters.parse("h100-80gb:1x1")
    listed = drasim.run(
        pods, cluster, drasim.Variant.STEERED, drasim.Settings(steering=drasim.Steering.BEST_FIT)
    )
    # No gating: a is bound as it arrives, at slot 6, so b's 4g.40gb still fits.
    bound = {o.name: o.bound_at for o in listed.outcomes}
    assert bound["a"] == 0.0 and listed.plan_rounds == 0
    served = _served(listed)
    assert served["a"] == ("gpu-0-mig-1g-10gb-6",)
    assert served["b"] == ("gpu-0-mig-4g-40gb-0",)
    assert listed.slice_writes >= 1


# A 1g.10gb first, a 4g.40gb it would block, then pods that fill what first fit leaves.
ROOM_FOR_LATER = (
    "a,0,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "w,10,1000,mig-4g.40gb=1;cpu=1;memory=1Gi,\n"
    "c,20,1000,mig-3g.40gb=1;cpu=1;memory=1Gi,\n"
    "d,30,1000,mig-2g.20gb=1;cpu=1;memory=1Gi,\n"
    "e,40,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
)


def test_the_first_fit_check_steers_a_tie_only_for_room_first_fit_loses() -> None:
    pods = _pods(ROOM_FOR_LATER)
    cluster = clusters.parse("h100-80gb:1x1")
    uncurated = drasim.run(pods, cluster, drasim.Variant.UNCURATED)
    assert set(_served(uncurated)) == {"a", "c", "d", "e"}
    # Steering every round keeps slot 0 for w, which then holds four compute slices that c and
    # e would have had: one pod fewer than first fit.
    every = drasim.run(pods, cluster, drasim.Variant.STEERED)
    assert _served(every)["a"] == ("gpu-0-mig-1g-10gb-6",)
    assert set(_served(every)) == {"a", "w", "d"}
    assert every.first_fit_rounds == 0
    # With the check, a's round is a tie (one pod either way) that first fit would end with no
    # 4g.40gb placeable (slot 0 is its only start) and the plan with one: it is steered, and
    # the sequence goes as every round steered does. This is the room rule's cost: here the
    # room it keeps goes to w, and c and e, which came later, would have used it better.
    for steering in (drasim.Steering.ORDER, drasim.Steering.TAINTS):
        settings = drasim.Settings(first_fit_check=True, steering=steering)
        checked = drasim.run(pods, cluster, drasim.Variant.STEERED, settings)
        assert _served(checked) == _served(every)
        # w's, c's and e's rounds: the plan serves no more than first fit and keeps no more
        # room (the only start left for each is the one first fit takes, or none)
        assert checked.plan_rounds == 5 and checked.first_fit_rounds == 4
    # ... and its gain: with no c and e to come, w is served only because a's round kept the
    # 4g.40gb placeable; first fit serves a alone.
    two = _pods(ROOM_FOR_LATER.split("c,", maxsplit=1)[0])
    assert set(_served(drasim.run(two, cluster, drasim.Variant.UNCURATED))) == {"a"}
    checked = drasim.run(
        two, cluster, drasim.Variant.STEERED, drasim.Settings(first_fit_check=True)
    )
    assert _served(checked) == {
        "a": ("gpu-0-mig-1g-10gb-6",),
        "w": ("gpu-0-mig-4g-40gb-0",),
    }
    assert checked.first_fit_rounds == 1  # w's: first fit takes the placement the plan does
    # A round whose plan and first fit keep the same room is left to first fit: by memory and
    # listed by start, first fit gives a whole 7g.80gb; a round left to first fit offers the
    # placements first fit takes over the smallest-first listing instead.
    by_memory = _pods(
        ROOM_FOR_LATER.replace("a,0,1000,mig-1g.10gb", "a,0,1000,mig-7g.80gb"), memory_share=1.0
    )
    start = draalloc.DeviceOrder.START
    checked = drasim.run(
        by_memory,
        cluster,
        drasim.Variant.STEERED,
        drasim.Settings(order=start, first_fit_check=True),
    )
    assert _served(checked) == {"a": ("gpu-0-mig-7g-80gb-0",)}
    assert checked.first_fit_rounds == checked.plan_rounds
    assert checked.slice_writes > 0
    # Arriving in one batch window, the same three first pods are a round the plan serves
    # more of (first fit in queue order gives a slot 0 and leaves w waiting): it is steered.
    batch = _pods(
        "a,0,1000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
        "w,0.1,1000,mig-4g.40gb=1;cpu=1;memory=1Gi,\n"
        "d,0.2,1000,mig-2g.20gb=1;cpu=1;memory=1Gi,\n"
    )
    assert drasim.run(batch, cluster, drasim.Variant.UNCURATED).pods_served == 2
    checked = drasim.run(
        batch, cluster, drasim.Variant.STEERED, drasim.Settings(first_fit_check=True)
    )
    assert checked.pods_served == 3 and checked.first_fit_rounds == 0
    assert _served(checked)["w"] == ("gpu-0-mig-4g-40gb-0",)


# Two nodes of two GPUs: a long 2g.20gb, a short 1g.10gb (spread: to the other node), a pod of
# two 7g.80gb that neither can take now, a long 1g.10gb that spread would send to the 1g's
# node, and a last pod that keeps the run going past the short pod's end.
ASIDE = (
    "a,0,100000,mig-2g.20gb=1;cpu=8;memory=1Gi,\n"
    "b,5,100,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "big,10,1000,mig-7g.80gb=2;cpu=1;memory=1Gi,\n"
    "c,50,100000,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
    "z,200,10,mig-1g.10gb=1;cpu=1;memory=1Gi,\n"
)


def test_a_node_set_aside_serves_the_pod_of_a_whole_gpu_spread_would_starve() -> None:
    cluster = clusters.parse("h100-80gb:2x2")
    pods = _pods(ASIDE, cluster="h100-80gb:2x2")
    uncurated = drasim.run(pods, cluster, drasim.Variant.UNCURATED)
    # kube-scheduler sends c to the node with the most CPU left, b's: big never fits
    assert set(_served(uncurated)) == {"a", "b", "c", "z"}
    checked = drasim.Settings(first_fit_check=True)
    without = drasim.run(pods, cluster, drasim.Variant.STEERED, checked)
    assert set(_served(without)) == {"a", "b", "c", "z"} and without.asides == 0
    # (b's round is first fit's: a 7g.80gb stays placeable either way, so the room rule does
    # not see that big needs two on one node.) big alone waits: b's node (one compute slice in
    # use against a's two) is set aside, c goes beside a, and big has b's node once b ends
    aside = drasim.run(
        pods, cluster, drasim.Variant.STEERED, dataclasses.replace(checked, aside=True)
    )
    assert set(_served(aside)) == {"a", "b", "big", "c", "z"}
    assert _served(aside)["big"] == ("gpu-0-mig-7g-80gb-0", "gpu-1-mig-7g-80gb-0")
    assert aside.asides == 1
