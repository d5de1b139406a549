"""Incremental planning in the control loop: a pass for a few new pods at 8,000 GPUs with a
standing backlog, incremental against a full replan (writes bench/results/incremental.json).

The cluster: ``generate.random_snapshot(seed, nodes=1000, gpus_per_node=8, pods=--fill,
used_fraction=0.95)`` planned with ``fast`` and carried out, so it is as full as the planner
makes it; ``--backlog`` of the pods it left unplaced stay pending. One full replan of that
backlog is carried out (the loop's standing state: its :class:`control.Memory` remembers the
backlog), then ``--new`` new pods arrive (drawn by the same generator with another seed, one
instance each and no CPU or memory asked, so some find room). The
same step (:func:`control.reconcile`, the controller's and the simulator's) runs twice on that
state: as the loop does by default (an incremental pass, since capacity did not grow) and with
``Settings(incremental=False)`` (a full replan of backlog and new pods). Per run, in one
process, back to back: the planner's CPU seconds (every planner call of the step, the
incremental pass's node filter included), the whole step's CPU seconds, the new pods placed,
the backlog pods placed, the plan's objective on the snapshot (priority-weighted pods placed)
and the validator's problems (must be none). CPU time, not wall time: the machine may be busy.

Usage: python bench/bench_incremental.py [--seeds 1 2 3] [--fill 12000] [--backlog 2000]
[--new 10]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import time
from pathlib import Path
from typing import Any

from migpilot.planning import (
    control,
    fast,
    generate,
    incremental,
    objective,
    options,
    plans,
    snapshot,
    validation,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "incremental.json"
NODES = 1000
GPUS_PER_NODE = 8


def _planner(spent: list[float]) -> control.Planner:
    def run(snap: snapshot.Snapshot) -> plans.Plan:
        t = time.process_time()
        try:
            return fast.plan(snap, options.Options())
        finally:
            spent.append(time.process_time() - t)

    return run


def standing(seed: int, *, fill: int, backlog: int) -> tuple[snapshot.Snapshot, control.Memory]:
    """The full cluster with ``backlog`` pods pending, and the loop's memory after a full
    replan of them, carried out."""
    snap = generate.random_snapshot(
        seed=seed, nodes=NODES, gpus_per_node=GPUS_PER_NODE, pods=fill, used_fraction=0.95
    )
    snap = incremental.carried_out(snap, fast.plan(snap, options.Options()))
    if len(snap.pods) < backlog:
        raise SystemExit(f"seed {seed}: only {len(snap.pods)} pods left unplaced; raise --fill")
    snap = dataclasses.replace(snap, pods=snap.pods[:backlog])
    settings = control.Settings(batch_window_s=0.0)
    decision = control.reconcile(
        control.Observed(snapshot=snap),
        control.Memory(),
        now=0.0,
        settings=settings,
        planner=_planner([]),
    )
    assert decision.plan is not None and decision.full is not None
    return incremental.carried_out(snap, decision.plan), decision.memory


def one(seed: int, *, fill: int, backlog: int, new: int) -> dict[str, Any]:
    snap, memory = standing(seed, fill=fill, backlog=backlog)
    # Small pods (one instance, no CPU or memory asked), so the full cluster still has room for
    # some of them: the pass has placements to get right.
    fresh = generate.random_snapshot(
        seed=seed + 1000,
        nodes=NODES,
        gpus_per_node=GPUS_PER_NODE,
        pods=new,
        cpu=False,
        multi_instance_fraction=0.0,
    ).pods
    fresh = tuple(dataclasses.replace(p, name=f"new-{p.name}") for p in fresh)
    now_snap = dataclasses.replace(snap, pods=(*snap.pods, *fresh))
    observed = control.Observed(snapshot=now_snap)
    new_keys = {p.key for p in fresh}
    out: dict[str, Any] = {"seed": seed, "backlog": len(snap.pods), "new": len(fresh)}
    for name, settings in (
        ("incremental", control.Settings(batch_window_s=0.0)),
        ("full", control.Settings(batch_window_s=0.0, incremental=False)),
    ):
        spent: list[float] = []
        t = time.process_time()
        decision = control.reconcile(
            observed, memory, now=1.0, settings=settings, planner=_planner(spent)
        )
        step = time.process_time() - t
        plan = decision.plan
        assert plan is not None
        placed = {p.pod for p in plan.placements}
        out[name] = {
            "kind": "full" if decision.full is not None else "incremental",
            "planner_cpu_s": round(sum(spent), 4),
            "planner_calls": len(spent),
            "step_cpu_s": round(step, 4),
            "new_placed": len(placed & new_keys),
            "backlog_placed": len(placed - new_keys),
            "weighted": objective.score(now_snap, plan).weighted,
            "problems": len(validation.problems(now_snap, plan)),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--fill", type=int, default=12000)
    ap.add_argument("--backlog", type=int, default=2000)
    ap.add_argument("--new", type=int, default=10)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    runs = []
    for seed in args.seeds:
        r = one(seed, fill=args.fill, backlog=args.backlog, new=args.new)
        inc, full = r["incremental"], r["full"]
        print(
            f"seed {seed}: backlog {r['backlog']}, new {r['new']}: "
            f"incremental {inc['planner_cpu_s'] * 1000:.1f} ms planner "
            f"({inc['step_cpu_s'] * 1000:.1f} ms step), {inc['new_placed']} new placed; "
            f"full {full['planner_cpu_s'] * 1000:.1f} ms planner "
            f"({full['step_cpu_s'] * 1000:.1f} ms step), {full['new_placed']} new + "
            f"{full['backlog_placed']} backlog placed",
            flush=True,
        )
        runs.append(r)
    if args.no_write:
        return
    result = {
        "command": "python bench/bench_incremental.py "
        f"--seeds {' '.join(map(str, args.seeds))} --fill {args.fill} "
        f"--backlog {args.backlog} --new {args.new}",
        "cluster": f"{NODES} nodes x {GPUS_PER_NODE} GPUs = {NODES * GPUS_PER_NODE} GPUs",
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        "note": "CPU seconds in one process, incremental and full back to back on the same "
        "state; the machine was shared (2 cores, other jobs running).",
        "runs": runs,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
