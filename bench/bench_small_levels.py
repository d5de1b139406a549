"""fast on small snapshots of several priority levels, beside an older tree, back to back.

Run: ``.venv/bin/python bench/bench_small_levels.py [--old PATH] [--seeds N]``.

Why: the moves that keep ``fast`` at or above every baseline (lookahead over the levels below,
the search of a level, the repack of nodes) run on small problems only, where each costs a few
passes of the greedy; this measures what they cost there. Each snapshot is planned cold (caches
cleared, cyclic GC paused) and timed in CPU seconds; with ``--old`` the same snapshots are
planned by the tree at PATH (its ``src`` first on ``sys.path``, in a child process) right after,
so both figures come from the same machine under the same load. Prints per shape the total
CPU seconds and weighted pods of each tree; nothing is written.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

# (In the child for --old, PYTHONPATH puts the old tree's src first: this imports that one.)
from migpilot.planning import fast, generate, objective, options, planners

SHAPES = (
    # (nodes, GPUs per node, pods, priority levels)
    (4, 2, 40, 3),
    (3, 2, 25, 3),
    (6, 1, 30, 3),
    (2, 4, 20, 2),
    (8, 4, 40, 3),
)


def measure(seeds: int) -> dict[str, list[float]]:
    """Per shape: [CPU seconds, weighted pods], summed over ``seeds`` snapshots."""
    out: dict[str, list[float]] = {}
    for nodes, gpn, pods, levels in SHAPES:
        label = f"{nodes}x{gpn} {pods} pods {levels} levels"
        total = [0.0, 0.0]
        for seed in range(seeds):
            snap = generate.random_snapshot(
                seed=seed, nodes=nodes, gpus_per_node=gpn, pods=pods, priority_levels=levels
            )
            fast.clear_caches()
            gc.collect()
            gc.disable()
            try:
                started = time.process_time()
                plan = planners.run(snap, "fast", options.Options())
                total[0] += time.process_time() - started
            finally:
                gc.enable()
            total[1] += objective.score(snap, plan).weighted
        out[label] = total
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", help="another checkout of migpilot to time beside this one")
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.seeds)))
        return
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    old = None
    if args.old:
        env = dict(os.environ, PYTHONPATH=os.path.join(args.old, "src"))
        done = subprocess.run(
            [sys.executable, __file__, "--child", "--seeds", str(args.seeds)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        )
        old = json.loads(done.stdout)
    new = measure(args.seeds)
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    for label, (cpu, weighted) in new.items():
        line = f"{label:28} this tree {cpu:7.2f} s  weighted {weighted:8.0f}"
        if old is not None:
            o_cpu, o_w = old[label]
            line += f"   old {o_cpu:7.2f} s  weighted {o_w:8.0f}   ratio {cpu / o_cpu:5.1f}x"
        print(line)
    if old is not None:
        t_new = sum(v[0] for v in new.values())
        t_old = sum(v[0] for v in old.values())
        print(f"all shapes: this tree {t_new:.2f} s, old {t_old:.2f} s, ratio {t_new / t_old:.1f}x")


if __name__ == "__main__":
    main()
