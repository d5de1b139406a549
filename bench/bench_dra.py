"""DRA steering in the simulator: pods served with every MIG placement published and
kube-scheduler's first fit (uncurated, as NVIDIA's DRA driver does), against migpilot's planner
steering the same allocator (writes bench/results/dra.json).

The model of the allocator is :mod:`migpilot.planning.draalloc` (walk order, counters, taints,
prioritized lists, as kube-scheduler v1.37's structured allocator); the replay is
:mod:`migpilot.sim.drasim`. Each trace is replayed faithfully (arrivals, and departures after
each pod's run time) until its last arrival, with half of the pods asking by memory (a seeded
draw) and the rest by profile; a pod's GPU-model selector becomes a condition on the device's
model. Per trace and variant: pods served, the time-weighted allocation ratio (and the share
that counts only what claims by memory needed), pending times, claims by memory given a larger
profile than the smallest that fits, and for steering its plan rounds, misses and slice writes.

Runs: ``uncurated`` (devices listed profile by profile, and by start slot), ``prioritized``
(claims by memory written as a firstAvailable list, smallest profile first; devices by start),
``best-fit`` (no planner and no gating: the driver lists placements best fit first), the first
steering (``taints``: unplanned placements tainted, the planner packing nodes), order steering
every round (``every-round``: planned placements listed first, nothing tainted, the planner's
node policy following kube-scheduler's LeastAllocated) and migpilot's steering (the same with
the first-fit check: a round is steered only if its plan serves more pods now than
kube-scheduler's first fit would, or as many and it keeps a profile placeable that first fit
leaves nowhere; else left to first fit; both listings), and ``uncurated-100x`` (uncurated with
kube-scheduler's backoff as bench_dra_kube.py's ``--speedup 100`` makes it weigh, 100 to 1,000
s of trace: to compare with the real control plane, not for the goal). The goal (issue 26):
steered serves more pods than uncurated on every trace.

Traces: the six MIG-native traces of bench/bench_native.py (bench/data/native) on its 32-GPU
cluster, and a window of openb (pods 4000-4399 of the bundled pod list, the densest 400-pod
window starting at a multiple of 500) on that cluster and on half of it.

Usage: python bench/bench_dra.py [--pods N] [--traces NAME,...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from migpilot.planning import draalloc, scoring
from migpilot.sim import clusters, drasim, queueing, traces

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "bench" / "data" / "native"
RESULTS = ROOT / "bench" / "results" / "dra.json"
CLUSTER = "h100-80gb:2x8,a100-80gb:2x8"
HALF = "h100-80gb:1x8,a100-80gb:1x8"
MEMORY_SHARE = 0.5
SEED = 1
OPENB_WINDOW = (4000, 4400)
NATIVE = (
    "steady-inference-s2",
    "steady-training-s8",
    "shift-to-training-s2",
    "shift-to-inference-s5",
    "steady-mixed-s11",
    "shift-to-training-s11",
)
PROFILE, START = draalloc.DeviceOrder.PROFILE, draalloc.DeviceOrder.START
COMPRESSED_100X = queueing.Backoff(initial_s=100.0, max_s=1000.0, window_s=100.0)
"""kube-scheduler's backoff (1 s doubling to 10 s, 1 s windows) as bench_dra_kube.py's
``--speedup 100`` replays make it weigh in trace time: the ``uncurated-100x`` run, to compare
with the real control plane, not for the goal."""
RUNS: tuple[tuple[str, drasim.Variant, drasim.Settings], ...] = (
    ("uncurated", drasim.Variant.UNCURATED, drasim.Settings(order=PROFILE)),
    ("uncurated", drasim.Variant.UNCURATED, drasim.Settings(order=START)),
    ("prioritized", drasim.Variant.PRIORITIZED, drasim.Settings(order=START)),
    (
        "best-fit",
        drasim.Variant.STEERED,
        drasim.Settings(order=PROFILE, steering=drasim.Steering.BEST_FIT),
    ),
    (
        "taints",
        drasim.Variant.STEERED,
        drasim.Settings(
            order=PROFILE,
            steering=drasim.Steering.TAINTS,
            node_policy=scoring.Policy.BINPACK,
            gpu_policy=scoring.Policy.SPREAD,
        ),
    ),
    ("every-round", drasim.Variant.STEERED, drasim.Settings(order=PROFILE)),
    (
        "uncurated-100x",
        drasim.Variant.UNCURATED,
        drasim.Settings(order=PROFILE, backoff=COMPRESSED_100X),
    ),
    (
        "steered",
        drasim.Variant.STEERED,
        drasim.Settings(order=PROFILE, first_fit_check=True, aside=True),
    ),
    (
        "steered",
        drasim.Variant.STEERED,
        drasim.Settings(order=START, first_fit_check=True, aside=True),
    ),
)
"""(name, variant, settings): ``taints`` is the first steering (issue 26's first try) and
``every-round`` the order steering that steers every round (the second), kept for comparison;
``steered`` is the steering migpilot uses (order steering with the first-fit check);
``uncurated-100x`` is uncurated with kube-scheduler's backoff as time compressed 100 times
makes it (bench_dra_kube.py), for the comparison with the real control plane only."""


def _cases(pods: int | None) -> list[tuple[str, traces.Trace, str]]:
    out: list[tuple[str, traces.Trace, str]] = []
    for name in NATIVE:
        trace = traces.parse_native((DATA / f"{name}.csv").read_text(), source=name)
        if pods is not None:
            trace = traces.Trace(trace.name, trace.pods[:pods], trace.timed)
        out.append((name, trace, CLUSTER))
    reference = clusters.parse(CLUSTER).reference_model
    openb = traces.bundled_openb(reference)
    lo, hi = OPENB_WINDOW
    if pods is not None:
        hi = lo + pods
    window = traces.Trace(f"openb[{lo}:{hi}]", openb.pods[lo:hi], openb.timed)
    out.append((f"openb-{lo}-{hi}", window, CLUSTER))
    out.append((f"openb-{lo}-{hi}-half", window, HALF))
    return out


def _row(name: str, result: drasim.Result, wall: float) -> dict[str, Any]:
    steered = result.variant is drasim.Variant.STEERED
    return {
        "variant": name,
        "device_order": str(result.settings.order),
        "steering": str(result.settings.steering) if steered else None,
        "node_policy": str(result.settings.planner_node_policy()) if steered else None,
        "gpu_policy": str(result.settings.gpu_policy) if steered else None,
        "pods_total": result.pods_total,
        "pods_served": result.pods_served,
        "pods_by_memory": result.pods_by_memory,
        "served_by_memory": result.served_by_memory,
        "allocation_ratio": round(result.allocation_ratio, 4),
        "needed_ratio": round(result.needed_ratio, 4),
        "memory_ratio": round(result.memory_ratio, 4),
        "pending_p50_s": round(result.pending_percentile(50), 1),
        "pending_p95_s": round(result.pending_percentile(95), 1),
        "oversized_devices": result.oversized_devices,
        "oversized_extra_slices": result.oversized_extra_slices,
        "first_fit_check": result.settings.first_fit_check if steered else None,
        "backoff_s": None
        if steered
        else [result.settings.backoff.initial_s, result.settings.backoff.max_s],
        "plan_rounds": result.plan_rounds,
        "first_fit_rounds": result.first_fit_rounds,
        "steering_misses": result.steering_misses,
        "slice_writes": result.slice_writes,
        "search_timeouts": result.timeouts,
        "nodes_set_aside": result.asides,
        "wall_seconds": round(wall, 2),
    }


def _case(trace: traces.Trace, cluster_spec: str) -> dict[str, Any]:
    cluster = clusters.parse(cluster_spec)
    pods, skipped = drasim.claims_from_trace(trace, cluster, memory_share=MEMORY_SHARE, seed=SEED)
    rows = []
    for name, variant, settings in RUNS:
        started = time.perf_counter()
        result = drasim.run(pods, cluster, variant, settings)
        rows.append(_row(name, result, time.perf_counter() - started))
    uncurated = [r for r in rows if r["variant"] == "uncurated"]
    steered = [r for r in rows if r["variant"] == "steered"]
    best_uncurated = max(r["pods_served"] for r in uncurated)
    worst_steered = min(r["pods_served"] for r in steered)
    taints = next(r for r in rows if r["variant"] == "taints")
    return {
        "trace": trace.name,
        "cluster": cluster_spec,
        "gpus": cluster.gpu_count,
        "pods": len(pods),
        "pods_left_out": skipped,
        "runs": rows,
        "best_uncurated_served": best_uncurated,
        "worst_steered_served": worst_steered,
        "steered_serves_more": worst_steered > best_uncurated,
        "steered_serves_at_least_as_many": worst_steered >= best_uncurated,
        "taints_served": taints["pods_served"],
        "every_round_served": next(r for r in rows if r["variant"] == "every-round")["pods_served"],
    }


def _short(variant: str) -> str:
    return "u100x" if variant == "uncurated-100x" else variant[:5]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--pods", type=int, help="only the first N pods of each trace (a test)")
    parser.add_argument("--traces", help="comma-separated case names (default: all)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    wanted = {t.strip() for t in args.traces.split(",")} if args.traces else None
    started = time.perf_counter()
    load_before = os.getloadavg()
    out: dict[str, Any] = {
        "command": " ".join(["python", "bench/bench_dra.py", *sys.argv[1:]]),
        "goal": "steered serves more pods than uncurated (every device order) on every trace",
        "steering": "a round is steered only if its plan serves more pods now than "
        "kube-scheduler's first fit would (else the pods first fit serves are ungated, nothing "
        "listed first); then planned placements listed first in the node's first device slice, "
        "nothing tainted; the planner's node policy follows kube-scheduler's LeastAllocated "
        "(spread), its GPU policy packs",
        "model": "migpilot.planning.draalloc (kube-scheduler v1.37 structured allocator, "
        "incubating variant) replayed by migpilot.sim.drasim until each trace's last arrival",
        "memory_share": MEMORY_SHARE,
        "seed": SEED,
        "node_scoring": str(drasim.Settings().scoring),
        "batch_s": drasim.Settings().batch_s,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
        },
        "cases": {},
    }
    for name, trace, cluster_spec in _cases(args.pods):
        if wanted is not None and name not in wanted:
            continue
        case = _case(trace, cluster_spec)
        out["cases"][name] = case
        runs = "  ".join(
            f"{_short(r['variant'])}/{r['device_order'][:4]} {r['pods_served']:3}"
            for r in case["runs"]
        )
        print(f"{name:28} {case['pods']:3} pods on {case['gpus']:2} GPUs: {runs}", flush=True)
    if not out["cases"]:
        raise SystemExit(f"no case named {sorted(wanted or ())}")
    out["goal_met"] = all(c["steered_serves_more"] for c in out["cases"].values())
    out["at_least_as_many_everywhere"] = all(
        c["steered_serves_at_least_as_many"] for c in out["cases"].values()
    )
    out["machine"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    out["wall_seconds"] = round(time.perf_counter() - started, 1)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"steered serves more on every trace: {out['goal_met']}; wrote {args.out}")


if __name__ == "__main__":
    main()
