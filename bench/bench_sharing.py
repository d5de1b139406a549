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

Speed (``--speed-only``, section ``speed``): ``fast`` on ``generate.sharing_snapshot(seed=11,
nodes=N, gpus_per_node=8, pods=3 per GPU, node_modes=("mps", "time-slicing"))`` at 504, 1,000
and 2,000 GPUs (2,000 GPUs and 6,000 pods: issue 25's target, <= 1 s), the whole
``planners.run`` (placing, explaining the pending pods, building the plan) timed in CPU seconds,
against the code before the sharing indexes in one run: ``--old PATH`` is a checkout of it (e.g.
``git worktree add /tmp/old-sharing 08131eb``), run by the same Python in a subprocess. The old
code is timed as it was (every way per level only up to 200,000 GPUs x pods, one beyond) and
with every way at every size (the work the indexed planner does: its plan must be the same, and
``same_plan_as_old_every_way`` says whether it is). CPU times are medians of ``--repeat`` runs
(the old ones: one run), with the cyclic GC left running as a plain ``planners.run`` call has it;
the new planner is also timed with the GC paused, as ``migpilot plan`` and the controller run it.

Usage: python bench/bench_sharing.py [--pods N] [--speed-only --old PATH [--repeat K]]
(the simulation and the speed sections each keep the other's figures in the JSON).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from migpilot import gcpause
from migpilot.planning import generate, objective, options, planners, plans, snapshot
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


SPEED_NODES = (63, 125, 250)
"""Nodes of 8 GPUs: 504, 1,000 and 2,000 GPUs, 3 pending pods per GPU."""
_OLD_RUN = """
import gc, json, sys, time
from migpilot.planning import generate, objective, options, planners, sharing
nodes, every = int(sys.argv[1]), sys.argv[2] == "every"
if every:
    sharing._SMALL_PROBLEM = 10**18  # every way at every size
snap = generate.sharing_snapshot(seed=11, nodes=nodes, gpus_per_node=8, pods=nodes * 24,
                                 node_modes=("mps", "time-slicing"))
gc.collect()
t = time.process_time()
plan = planners.run(snap, "fast", options.Options(workers=1))
cpu = time.process_time() - t
print(json.dumps({"cpu_s": cpu, "placed": len(plan.placements),
                  "weighted": objective.score(snap, plan).weighted,
                  "digest": sorted((p.pod, p.node, [(s.gpu, s.slice) for s in p.shares])
                                   for p in plan.placements)}))
"""


def speed_snapshot(nodes: int) -> snapshot.Snapshot:
    return generate.sharing_snapshot(
        seed=11, nodes=nodes, gpus_per_node=8, pods=nodes * 24, node_modes=("mps", "time-slicing")
    )


def digest(plan: plans.Plan) -> list[Any]:
    """Placements, comparable across the two trees (as the old run prints them)."""
    return sorted([p.pod, p.node, [[s.gpu, s.slice] for s in p.shares]] for p in plan.placements)


def old_run(old: Path, nodes: int, *, every: bool) -> dict[str, Any]:
    """One plan by the old tree at ``old`` (a subprocess: its own modules), its figures."""
    env = dict(os.environ, PYTHONPATH=str(old / "src"))
    out = subprocess.run(
        [sys.executable, "-c", _OLD_RUN, str(nodes), "every" if every else "as-was"],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def figures(run: dict[str, Any]) -> dict[str, Any]:
    """An old run's figures as written (without its placements)."""
    return {"cpu_s": round(run["cpu_s"], 3), "placed": run["placed"], "weighted": run["weighted"]}


def new_cpu(snap: snapshot.Snapshot, *, paused: bool) -> tuple[float, plans.Plan]:
    gc.collect()
    if paused:
        with gcpause.paused():  # its own collection is not timed: the shell's, not the plan's
            start = time.process_time()
            plan = planners.run(snap, "fast", options.Options(workers=1))
            return time.process_time() - start, plan
    start = time.process_time()
    plan = planners.run(snap, "fast", options.Options(workers=1))
    return time.process_time() - start, plan


def speed(old: Path, repeat: int) -> dict[str, Any]:
    """The speed section: old and new at each size, in this one run."""
    load_before = os.getloadavg()[0]
    rows = []
    for nodes in SPEED_NODES:
        snap = speed_snapshot(nodes)
        runs = [new_cpu(snap, paused=False) for _ in range(repeat)]
        paused = [new_cpu(snap, paused=True)[0] for _ in range(repeat)]
        plan = runs[0][1]
        cpu = statistics.median(r[0] for r in runs)
        as_was = old_run(old, nodes, every=False)
        every = old_run(old, nodes, every=True)
        placed = len(plan.placements)
        weighted = objective.score(snap, plan).weighted
        row = {
            "gpus": nodes * 8,
            "nodes": nodes,
            "pods": len(snap.pods),
            "new": {
                "cpu_s": round(cpu, 3),
                "cpu_s_gc_paused": round(statistics.median(paused), 3),
                "placed": placed,
                "weighted": weighted,
            },
            "old": figures(as_was),
            "old_every_way": figures(every),
            "ratio_old_over_new": round(as_was["cpu_s"] / cpu, 1),
            "ratio_old_every_way_over_new": round(every["cpu_s"] / cpu, 1),
            "same_plan_as_old_every_way": digest(plan) == every["digest"],
        }
        rows.append(row)
        print(
            f"{row['gpus']:>5} GPUs {row['pods']:>5} pods: new {cpu:6.2f} s "
            f"(GC paused {row['new']['cpu_s_gc_paused']:.2f} s) placed {placed} "
            f"weighted {weighted}; old {as_was['cpu_s']:6.2f} s placed {as_was['placed']} "
            f"weighted {as_was['weighted']}; old every way {every['cpu_s']:6.2f} s placed "
            f"{every['placed']}; x{row['ratio_old_over_new']} / "
            f"x{row['ratio_old_every_way_over_new']}; same plan: "
            f"{row['same_plan_as_old_every_way']}",
            flush=True,
        )
    return {
        "snapshot": "generate.sharing_snapshot(seed=11, nodes=N, gpus_per_node=8, pods=24*N, "
        "node_modes=('mps', 'time-slicing'))",
        "call": "planners.run(snap, 'fast', options.Options(workers=1))",
        "old_tree": "main at 08131eb (before the sharing indexes), in a separate worktree",
        "repeat": repeat,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "note": "CPU seconds (time.process_time) on a machine shared with other jobs (2 cores): "
        "absolute times are noisy, the ratios are measured in one run",
        "load_average_1min": {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)},
        "rows": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=1000, help="pods per trace (default 1000)")
    parser.add_argument("--speed-only", action="store_true", help="only the planner speed section")
    parser.add_argument("--old", type=Path, help="checkout of the old tree (--speed-only)")
    parser.add_argument("--repeat", type=int, default=3, help="new planner runs per size")
    args = parser.parse_args()
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    command = "python bench/bench_sharing.py " + " ".join(sys.argv[1:])
    if args.speed_only:
        if args.old is None:
            parser.error("--speed-only needs --old PATH (a checkout of the old tree)")
        doc = previous | {"speed": speed(args.old, args.repeat) | {"command": command}}
        RESULTS.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {RESULTS.relative_to(ROOT)}")
        return
    doc = run(pods=args.pods)
    if "speed" in previous:
        doc["speed"] = previous["speed"]
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
