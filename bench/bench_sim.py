"""The simulator's goal figures: every policy on the openb traces (writes bench/results/sim.json).

Sections (each records the command that reproduces it):
- inflate mode at 130 % on openb default, the default H100-80GB + A100-80GB cluster, with the LP
  upper bound on the allocation ratio (the goal: migpilot above every other policy and >= 97 %
  of the bound); also in trace order (no shuffle);
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


def _simulate(argv: list[str]) -> tuple[list[dict[str, Any]], float]:
    out = io.StringIO()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        code = cli.main(["simulate", *argv, "--no-plots", "-o", "json", "--out", tmp], out=out)
    if code != 0:
        raise SystemExit(f"migpilot simulate {' '.join(argv)} failed with exit code {code}")
    return json.loads(out.getvalue()), time.perf_counter() - started


def _bound(trace_arg: str, *, trace_order: bool) -> float:
    cluster = clusters.parse(clusters.DEFAULT_SPEC)
    if trace_arg == "openb":
        trace = traces.bundled_openb(cluster.reference_model)
    else:
        path = Path(trace_arg)
        trace = traces.parse(path.read_text(), source=path.name, model=cluster.reference_model)
    settings = simulating.Settings(shuffle_seed=None if trace_order else 1)
    pods = [p for p, _, _ in simulating.replayed(trace, cluster=cluster, settings=settings)]
    return bounds.inflate_bound(pods, cluster=cluster).allocation_ratio


def _section(argv: list[str], *, trace_arg: str, goal: str) -> dict[str, Any]:
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
        bound = _bound(trace_arg, trace_order="--trace-order" in argv)
        section["upper_bound"] = round(bound, 4)
        mine = by["migpilot"]["allocation_ratio"]
        section["migpilot_share_of_bound"] = round(mine / bound, 4) if bound else None
        section["migpilot_above_all_others"] = all(mine > r["allocation_ratio"] for r in others)
    else:
        mine = by["migpilot"]["pending_p99_s"]
        section["migpilot_p99_below_all_others"] = all(mine < r["pending_p99_s"] for r in others)
    print(f"{section['command']}  ({seconds:.1f} s)")
    for r in rows:
        print(
            f"  {r['policy']:15} scheduled {r['pods_scheduled']:>5}/{r['pods_total']:<5} "
            f"alloc {100 * r['allocation_ratio']:5.1f}%  p99 {r['pending_p99_s']:>10.1f} s  "
            f"planner {r['planner_seconds']} s"
        )
    return section


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "openb"))
    parser.add_argument("--skip-faithful", action="store_true")
    args = parser.parse_args()
    data = Path(args.data)
    sections: dict[str, Any] = {}
    inflate_goal = "migpilot allocation ratio above every other policy and >= 97% of the bound"
    sections["openb_default_inflate"] = _section([], trace_arg="openb", goal=inflate_goal)
    sections["openb_default_inflate_trace_order"] = _section(
        ["--trace-order"], trace_arg="openb", goal=inflate_goal
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
