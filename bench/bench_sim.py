"""The simulator's goal figures: every policy on the openb traces (writes bench/results/sim.json).

Sections (each records the command that reproduces it):
- inflate mode at 130 % on openb default (trace order, the default), the default H100-80GB +
  A100-80GB cluster, with the LP upper bound on the allocation ratio (the goal: migpilot above
  every other policy and >= 97 % of the bound);
- the same with the pods shuffled, seeds 1-5 (as Weng et al.'s simulator can), summarised per
  policy: how robust the comparison is to arrival order on a trace slice of ~130 pods;
- the same at four times the cluster (384 GPUs, ~570 pods): a larger slice of the trace;
- the gpushare100 and multigpu50 variants (read from ../shared/data/openb/), inflate mode;
- faithful mode on openb default with the default faithful cluster (the goal: migpilot's p99
  pending time below every other policy's).

Usage: python bench/bench_sim.py [--data DIR] [--skip-faithful]
"""

from __future__ import annotations

import argparse
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from migpilot.cli import main as cli
from migpilot.sim import bounds, clusters, simulating, traces

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "sim.json"
LARGE_SPEC = "h100-80gb:32x8,a100-80gb:16x8"


def _simulate(argv: list[str]) -> tuple[list[dict[str, Any]], float]:
    out = io.StringIO()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        code = cli.main(["simulate", *argv, "--no-plots", "-o", "json", "--out", tmp], out=out)
    if code != 0:
        raise SystemExit(f"migpilot simulate {' '.join(argv)} failed with exit code {code}")
    return json.loads(out.getvalue()), time.perf_counter() - started


def _bound(trace_arg: str, *, spec: str, seed: int | None) -> float:
    cluster = clusters.parse(spec)
    if trace_arg == "openb":
        trace = traces.bundled_openb(cluster.reference_model)
    else:
        path = Path(trace_arg)
        trace = traces.parse(path.read_text(), source=path.name, model=cluster.reference_model)
    settings = simulating.Settings(shuffle_seed=seed)
    pods = [p for p, _, _ in simulating.replayed(trace, cluster=cluster, settings=settings)]
    return bounds.inflate_bound(pods, cluster=cluster).allocation_ratio


def _option(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def _section(argv: list[str], *, trace_arg: str, goal: str, quiet: bool = False) -> dict[str, Any]:
    rows, seconds = _simulate(argv)
    section: dict[str, Any] = {
        "command": "migpilot simulate " + " ".join(argv),
        "wall_seconds": round(seconds, 1),
        "goal": goal,
        "results": rows,
    }
    by = {r["policy"]: r for r in rows}
    others = [r for r in rows if r["policy"] != "migpilot"]
    if "--mode" not in argv:
        seed = int(_option(argv, "--seed") or 1) if "--shuffle" in argv else None
        spec = _option(argv, "--cluster") or clusters.DEFAULT_SPEC
        bound = _bound(trace_arg, spec=spec, seed=seed)
        section["upper_bound"] = round(bound, 4)
        mine = by["migpilot"]["allocation_ratio"]
        section["migpilot_share_of_bound"] = round(mine / bound, 4) if bound else None
        section["migpilot_above"] = {r["policy"]: mine > r["allocation_ratio"] for r in others}
        section["migpilot_above_all_others"] = all(section["migpilot_above"].values())
    else:
        mine = by["migpilot"]["pending_p99_s"]
        section["migpilot_p99_below_all_others"] = all(mine < r["pending_p99_s"] for r in others)
    if quiet:
        return section
    print(f"{section['command']}  ({seconds:.1f} s)")
    for r in rows:
        print(
            f"  {r['policy']:15} scheduled {r['pods_scheduled']:>5}/{r['pods_total']:<5} "
            f"alloc {100 * r['allocation_ratio']:5.1f}%  p99 {r['pending_p99_s']:>10.1f} s  "
            f"planner {r['planner_seconds']} s"
        )
    if "upper_bound" in section:
        print(f"  bound {100 * section['upper_bound']:.1f}%")
    return section


def _shuffled(seeds: range, *, goal: str) -> dict[str, Any]:
    """Inflate on openb default with the pods shuffled, one run per seed, summarised."""
    runs = [
        _section(["--shuffle", "--seed", str(s)], trace_arg="openb", goal=goal, quiet=True)
        for s in seeds
    ]
    summary: dict[str, Any] = {}
    for policy in [r["policy"] for r in runs[0]["results"]]:
        ratios = [next(r for r in run["results"] if r["policy"] == policy) for run in runs]
        summary[policy] = {
            "allocation_ratio_mean": round(
                sum(r["allocation_ratio"] for r in ratios) / len(runs), 4
            ),
            "allocation_ratio_min": min(r["allocation_ratio"] for r in ratios),
            "pods_scheduled_mean": round(sum(r["pods_scheduled"] for r in ratios) / len(runs), 1),
        }
        if policy != "migpilot":
            summary[policy]["migpilot_above_in_runs"] = sum(
                run["migpilot_above"][policy] for run in runs
            )
    print(f"migpilot simulate --shuffle --seed N, N in {seeds.start}..{seeds.stop - 1}")
    for policy, s in summary.items():
        print(f"  {policy:15} {s}")
    return {
        "command": "migpilot simulate --shuffle --seed N",
        "seeds": list(seeds),
        "goal": goal,
        "summary": summary,
        "migpilot_share_of_bound": [run["migpilot_share_of_bound"] for run in runs],
        "runs": runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "openb"))
    parser.add_argument("--skip-faithful", action="store_true")
    args = parser.parse_args()
    data = Path(args.data)
    sections: dict[str, Any] = {}
    inflate_goal = "migpilot allocation ratio above every other policy and >= 97% of the bound"
    sections["openb_default_inflate"] = _section([], trace_arg="openb", goal=inflate_goal)
    sections["openb_default_inflate_shuffled"] = _shuffled(range(1, 6), goal=inflate_goal)
    sections["openb_default_inflate_384_gpus"] = _section(
        ["--cluster", LARGE_SPEC], trace_arg="openb", goal=inflate_goal
    )
    for variant in ("gpushare100", "multigpu50"):
        path = str(data / f"openb_pod_list_{variant}.csv")
        sections[f"openb_{variant}_inflate"] = _section(
            ["--trace", path], trace_arg=path, goal=inflate_goal
        )
    if not args.skip_faithful:
        sections["openb_default_faithful"] = _section(
            ["--mode", "faithful"],
            trace_arg="openb",
            goal="migpilot p99 pending time below every other policy's",
        )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(sections, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
