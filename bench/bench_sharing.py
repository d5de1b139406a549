"""MIG only, MPS only, time-slicing only and a mixed cluster, migpilot against nos, on the same
inference trace at two loads (writes bench/results/sharing.json).

The trace is ``synthetic:small-inference`` (1,000 pods using 5-50 % of a GPU's memory, runs of a
few hours, Poisson arrivals), replayed at its own times (faithful mode) on 24 A100-80GB GPUs in
four ways: every node in mode mig, every node in mode mps, every node time-sliced (4 replicas
per GPU), and one node of each. Two loads:

- ``busy``: arrivals 110 s apart on average. The MIG-only cluster is about 70 % allocated while
  pods keep arriving and most pods wait no time; the figures measure packing.
- ``overloaded``: arrivals 60 s apart (the trace's default): more than the cluster holds, so
  every mode queues for hours and the figures mostly measure queueing.

Policies: ``migpilot`` (its planner in every mode) and ``nos`` (nos's MIG partitioner on MIG
nodes, nos's MPS partitioner on MPS nodes, kube-scheduler's first fit on time-slicing replicas:
:mod:`migpilot.planning.nosmps`). Requests: on the MIG-only cluster each pod asks the MIG
profile that holds its memory by name (``nvidia.com/mig-1g.10gb``: nos serves nothing else on
MIG); elsewhere the HAMi-style ``nvidia.com/gpu: 1`` + ``gpumem-percentage``, which nos's MPS
partitioner reads as the ``nvidia.com/gpu-<N>gb`` a nos user would write. The pods are the same
in both forms (same seed, same draws). In the mixed cluster nos's MIG node serves none of them.

Figures per cluster and policy, means over seeds 1-3: pods scheduled; allocation ratio
(compute: the MIG profile each running pod's memory resolves to, capped per shared GPU at its
compute, time-weighted from the first arrival to the last departure); the same over the arrival
window only (the steady state, without the drain at the end); memory ratio (GB the running pods
asked over the cluster's GB, the same pod counting the same in every mode); pending time p50
and p99 (pods never scheduled count until the end); reconfigurations (MIG layouts or MPS slices
changed). The same seed gives the same figures (planner CPU time is not written).

Usage: python bench/bench_sharing.py [--pods N]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from migpilot.sim import clusters, policies, simulating, traces

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "sharing.json"
TRACE = "small-inference"
SEEDS = (1, 2, 3)
LOADS = {"busy": 110.0, "overloaded": 60.0}
"""Mean seconds between arrivals, per load."""
POLICIES = ("migpilot", "nos")
CLUSTERS = {
    "mig only": ("a100-80gb:3x8", traces.Requests.MIG),
    "mps only": ("a100-80gb:3x8@mps", traces.Requests.UNIFIED),
    "time-slicing only": ("a100-80gb:3x8@time-slicing:4", traces.Requests.UNIFIED),
    "mixed": (
        "a100-80gb:1x8,a100-80gb:1x8@mps,a100-80gb:1x8@time-slicing:4",
        traces.Requests.UNIFIED,
    ),
}
FIGURES = (
    "pods_scheduled",
    "allocation_ratio",
    "allocation_while_arriving",
    "memory_ratio",
    "pending_p50_s",
    "pending_p99_s",
    "reconfigurations",
)


def window_mean(samples: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """The time-weighted mean of a step function ``(time, value)`` over ``[start, end]``."""
    if end <= start:
        return 0.0
    area = 0.0
    for (t0, value), (t1, _) in zip(samples, [*samples[1:], (end, 0.0)], strict=True):
        lo, hi = max(t0, start), min(t1, end)
        if hi > lo:
            area += value * (hi - lo)
    return area / (end - start)


def one(*, spec: str, requests: traces.Requests, policy: str, seed: int, gap: float, pods: int
        ) -> dict[str, Any]:  # fmt: skip
    """One replay's figures."""
    cluster = clusters.parse(spec)
    trace = traces.synthetic(
        TRACE,
        seed=seed,
        model=cluster.reference_model,
        pods=pods,
        requests=requests,
        mapping=traces.ProfileMapping.MEMORY,
        mean_gap_s=gap,
    )
    result = simulating.simulate(
        trace,
        cluster=cluster,
        policy=policies.dynamic(policy, cluster),
        settings=simulating.Settings(mode=simulating.Replay.FAITHFUL),
    )
    arriving = window_mean(result.ratio_over_time, trace.pods[0].arrival, trace.pods[-1].arrival)
    return {
        "seed": seed,
        "pods_scheduled": result.pods_scheduled,
        "allocation_ratio": round(result.allocation_ratio, 4),
        "allocation_while_arriving": round(arriving, 4),
        "memory_ratio": round(result.memory_ratio, 4),
        "pending_p50_s": round(result.pending_percentile(50), 1),
        "pending_p99_s": round(result.pending_percentile(99), 1),
        "reconfigurations": result.reconfigurations,
    }


def run(*, pods: int) -> dict[str, Any]:
    """Every load, cluster and policy on every seed; the document written to :data:`RESULTS`."""
    loads = []
    for load, gap in LOADS.items():
        rows = []
        for label, (spec, requests) in CLUSTERS.items():
            for policy in POLICIES:
                per_seed = [
                    one(spec=spec, requests=requests, policy=policy, seed=s, gap=gap, pods=pods)
                    for s in SEEDS
                ]
                row: dict[str, Any] = {
                    "cluster": label,
                    "spec": spec,
                    "requests": requests.value,
                    "policy": policy,
                    "pods_total": pods,
                }
                for key in FIGURES:
                    row[key] = round(statistics.fmean(r[key] for r in per_seed), 4)
                row["seeds"] = per_seed
                rows.append(row)
        loads.append({"load": load, "mean_gap_s": gap, "rows": rows})
    return {"trace": f"synthetic:{TRACE}", "mode": "faithful", "seeds": list(SEEDS),
            "loads": loads}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000, help="pods per trace (default 1000)")
    args = parser.parse_args()
    doc = run(pods=args.pods)
    for load in doc["loads"]:
        print(f"\n{load['load']} (arrivals {load['mean_gap_s']:.0f} s apart)")
        print(f"{'cluster':<18} {'policy':<9} {'sched':>7} {'alloc':>7} {'arriving':>8} "
              f"{'memory':>7} {'p50 s':>9} {'p99 s':>9} {'reconf':>7}")  # fmt: skip
        for r in load["rows"]:
            print(
                f"{r['cluster']:<18} {r['policy']:<9} {r['pods_scheduled']:>7.1f} "
                f"{r['allocation_ratio']:>7.1%} {r['allocation_while_arriving']:>8.1%} "
                f"{r['memory_ratio']:>7.1%} {r['pending_p50_s']:>9.1f} {r['pending_p99_s']:>9.1f} "
                f"{r['reconfigurations']:>7.1f}"
            )
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
