"""Unified (HAMi-style) requests on the openb trace: migpilot against HAMi's own way of serving
them (writes bench/results/unified.json).

Every openb pod asks as a HAMi user would: ``nvidia.com/gpu: 1`` with
``nvidia.com/gpumem-percentage: ceil(gpu_milli / 10)`` (``gpu_milli`` read as a share of the
GPU's memory), several whole GPUs as ``nvidia.com/gpu: N`` with ``gpumem-percentage: 100``.
``migpilot`` plans the whole pending set with the fast planner, resolving each request to the
smallest profile per GPU model; ``hami-placement`` serves one pod at a time in arrival order as
HAMi v2.10 does (the smallest allowlisted profile with the memory that has a free placement,
binpack nodes, spread GPUs). Figures per policy: allocation ratio (compute slices of what the
running pods asked for, over the cluster's), pods scheduled, pending time mean and p99 (pods
never scheduled count until the end).

Sections:
- inflate mode at 130 % on openb default, the default cluster (96 GPUs), trace order;
- the same with the pods shuffled, seeds 1-5 (means);
- the same on 384 GPUs;
- faithful mode: openb default at its own times on the default faithful cluster (48 GPUs)
  (skipped with ``--skip-faithful``).

Target: migpilot above hami-placement on allocation ratio and on pending time in each section.

Usage: python bench/bench_unified.py [--skip-faithful]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from migpilot.sim import bounds, clusters, policies, simulating, traces

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "unified.json"
LARGE_SPEC = "h100-80gb:32x8,a100-80gb:16x8"
SEEDS = range(1, 6)
NAMES = policies.DEFAULT_UNIFIED


def _row(result: simulating.Result, seconds: float) -> dict[str, Any]:
    pending = result.pending_s
    return {
        "policy": result.policy,
        "pods_total": result.pods_total,
        "pods_scheduled": result.pods_scheduled,
        "allocation_ratio": round(result.allocation_ratio, 4),
        "pending_mean_s": round(statistics.fmean(pending), 1) if pending else 0.0,
        "pending_p50_s": round(result.pending_percentile(50), 1),
        "pending_p99_s": round(result.pending_percentile(99), 1),
        "reconfigurations": result.reconfigurations,
        "planner_seconds": round(result.planner_seconds, 2),
        "wall_seconds": round(seconds, 1),
    }


def _run(
    *, spec: str, mode: simulating.Replay, seed: int | None
) -> tuple[dict[str, dict[str, Any]], float | None]:
    """Every policy once; rows by policy, and the LP bound in inflate mode."""
    cluster = clusters.parse(spec)
    trace = traces.bundled_openb(cluster.reference_model, requests=traces.Requests.UNIFIED)
    settings = simulating.Settings(mode=mode, shuffle_seed=seed)
    rows: dict[str, dict[str, Any]] = {}
    for name in NAMES:
        started = time.perf_counter()
        result = simulating.simulate(
            trace,
            cluster=cluster,
            policy=policies.dynamic(name, cluster),
            settings=settings,
            cpu_clock=time.process_time,
        )
        rows[name] = _row(result, time.perf_counter() - started)
    bound = None
    if mode is simulating.Replay.INFLATE:
        submitted = [
            p for p, _, _ in simulating.replayed(trace, cluster=cluster, settings=settings)
        ]
        bound = round(bounds.inflate_bound(submitted, cluster=cluster).allocation_ratio, 4)
    return rows, bound


def _verdict(rows: dict[str, dict[str, Any]], *, mean: str = "") -> dict[str, bool]:
    ours, hami = rows["migpilot"], rows["hami-placement"]
    return {
        "allocation_above_hami": ours[f"allocation_ratio{mean}"] > hami[f"allocation_ratio{mean}"],
        "pending_mean_below_hami": ours[f"pending_mean_s{mean}"] < hami[f"pending_mean_s{mean}"],
        "pending_p99_below_hami": ours[f"pending_p99_s{mean}"] < hami[f"pending_p99_s{mean}"],
    }


def _section(command: str, *, spec: str, mode: simulating.Replay) -> dict[str, Any]:
    rows, bound = _run(spec=spec, mode=mode, seed=None)
    section = {
        "command": command,
        "cluster": spec,
        "upper_bound": bound,
        "results": list(rows.values()),
        "target": _verdict(rows),
    }
    _print(command, rows, bound)
    return section


def _shuffled() -> dict[str, Any]:
    runs = [_run(spec=clusters.DEFAULT_SPEC, mode=simulating.Replay.INFLATE, seed=s) for s in SEEDS]
    summary: dict[str, dict[str, Any]] = {}
    for name in NAMES:
        rows = [run[0][name] for run in runs]
        summary[name] = {
            key + "_mean": round(statistics.fmean(r[key] for r in rows), 4)
            for key in ("allocation_ratio", "pods_scheduled", "pending_mean_s", "pending_p99_s")
        }
        summary[name]["allocation_ratio_per_seed"] = [r["allocation_ratio"] for r in rows]
    command = "migpilot simulate --requests unified --shuffle --seed N"
    print(f"{command}, N in {SEEDS.start}..{SEEDS.stop - 1} (means)")
    for name, s in summary.items():
        print(f"  {name:15} {s}")
    return {
        "command": command,
        "seeds": list(SEEDS),
        "cluster": clusters.DEFAULT_SPEC,
        "upper_bound_per_seed": [run[1] for run in runs],
        "summary": summary,
        "target": _verdict(summary, mean="_mean"),
        "runs": [list(run[0].values()) for run in runs],
    }


def _print(command: str, rows: dict[str, dict[str, Any]], bound: float | None) -> None:
    print(command)
    for r in rows.values():
        print(
            f"  {r['policy']:15} scheduled {r['pods_scheduled']:>5}/{r['pods_total']:<5} "
            f"alloc {100 * r['allocation_ratio']:5.1f}%  "
            f"pending mean {r['pending_mean_s']:>10.1f} s  p99 {r['pending_p99_s']:>10.1f} s  "
            f"planner {r['planner_seconds']} s"
        )
    if bound is not None:
        print(f"  LP bound {100 * bound:.1f}%")
    print(f"  target (migpilot above hami-placement): {_verdict(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--skip-faithful", action="store_true")
    args = parser.parse_args()
    inflate = simulating.Replay.INFLATE
    sections: dict[str, Any] = {
        "bench": "python bench/bench_unified.py",
        "policies": list(NAMES),
    }
    sections["openb_default_inflate"] = _section(
        "migpilot simulate --requests unified", spec=clusters.DEFAULT_SPEC, mode=inflate
    )
    sections["openb_default_inflate_shuffled"] = _shuffled()
    sections["openb_default_inflate_384_gpus"] = _section(
        f"migpilot simulate --requests unified --cluster {LARGE_SPEC}",
        spec=LARGE_SPEC,
        mode=inflate,
    )
    if not args.skip_faithful:
        sections["openb_default_faithful"] = _section(
            "migpilot simulate --requests unified --mode faithful",
            spec=clusters.DEFAULT_FAITHFUL_SPEC,
            mode=simulating.Replay.FAITHFUL,
        )
    met = {k: all(v["target"].values()) for k, v in sections.items() if isinstance(v, dict)}
    sections["target_met"] = met
    print(f"target met: {met}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(sections, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
