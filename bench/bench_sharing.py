"""MIG only, MPS only, time-slicing only and a mixed cluster on the same inference trace
(writes bench/results/sharing.json).

The trace is ``synthetic:small-inference`` (many small pods asking ``nvidia.com/gpu: 1`` with
``nvidia.com/gpumem-percentage`` 5-50, Poisson arrivals a minute apart, runs of a few hours:
more than the cluster holds at once), replayed at its own times (faithful mode) with migpilot's
planner on 24 A100-80GB GPUs in four ways: every node in mode mig, every node in mode mps, every
node time-sliced (4 replicas per GPU), and one node of each. Figures per cluster, means over
seeds 1-3: allocation ratio (time-weighted compute slices of what the running pods asked, the
same measure in every mode), pods scheduled, pending time p50 and p99 (pods never scheduled
count until the end), reconfigurations (MIG layouts or MPS slices changed).

The same seed gives the same figures (planner CPU time aside, which is not written).

Usage: python bench/bench_sharing.py [--pods N]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from migpilot.sim import clusters, policies, simulating, traces

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "sharing.json"
TRACE = "small-inference"
SEEDS = (1, 2, 3)
CLUSTERS = {
    "mig only": "a100-80gb:3x8",
    "mps only": "a100-80gb:3x8@mps",
    "time-slicing only": "a100-80gb:3x8@time-slicing:4",
    "mixed": "a100-80gb:1x8,a100-80gb:1x8@mps,a100-80gb:1x8@time-slicing:4",
}


def run(*, pods: int) -> dict[str, Any]:
    """Every cluster on every seed; the document written to :data:`RESULTS`."""
    rows = []
    for label, spec in CLUSTERS.items():
        cluster = clusters.parse(spec)
        per_seed = []
        for seed in SEEDS:
            trace = traces.synthetic(
                TRACE,
                seed=seed,
                model=cluster.reference_model,
                pods=pods,
                requests=traces.Requests.UNIFIED,
            )
            result = simulating.simulate(
                trace,
                cluster=cluster,
                policy=policies.dynamic("migpilot", cluster),
                settings=simulating.Settings(mode=simulating.Mode.FAITHFUL),
            )
            per_seed.append(
                {
                    "seed": seed,
                    "pods_scheduled": result.pods_scheduled,
                    "allocation_ratio": round(result.allocation_ratio, 4),
                    "pending_p50_s": round(result.pending_percentile(50), 1),
                    "pending_p99_s": round(result.pending_percentile(99), 1),
                    "reconfigurations": result.reconfigurations,
                }
            )
        rows.append(
            {
                "cluster": label,
                "spec": spec,
                "pods_total": pods,
                "allocation_ratio": round(
                    statistics.fmean(r["allocation_ratio"] for r in per_seed), 4
                ),
                "pods_scheduled": round(statistics.fmean(r["pods_scheduled"] for r in per_seed), 1),
                "pending_p50_s": round(statistics.fmean(r["pending_p50_s"] for r in per_seed), 1),
                "pending_p99_s": round(statistics.fmean(r["pending_p99_s"] for r in per_seed), 1),
                "seeds": per_seed,
            }
        )
    return {"trace": f"synthetic:{TRACE}", "mode": "faithful", "policy": "migpilot", "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000, help="pods per trace (default 1000)")
    args = parser.parse_args()
    doc = run(pods=args.pods)
    print(f"{'cluster':<20} {'allocation':>10} {'scheduled':>10} {'p50 s':>9} {'p99 s':>9}")
    for r in doc["rows"]:
        print(
            f"{r['cluster']:<20} {r['allocation_ratio']:>10.2%} {r['pods_scheduled']:>10} "
            f"{r['pending_p50_s']:>9} {r['pending_p99_s']:>9}"
        )
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {RESULTS.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
