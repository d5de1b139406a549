"""The fleet's own cost: ``migpilot fleet``'s agents of 1,000 nodes x 8 GPUs in one process.

Run: ``.venv/bin/python bench/fleet_agents.py [--nodes 1000] [--workers 32] [--instant]``
(after ``./scripts/test`` has set up ``.venv``; about a minute). Prints a table and writes
``bench/results/fleet_agents.json``. Timing never decides a test.

No control plane: :class:`migpilot.kwok.fleet.Fleet` runs as ``migpilot fleet`` runs it (its
three shared watches, its pool of workers, every node's single-agent parts) over the in-memory
``NodeApi``, so the figures are the fleet's, not an apiserver's (``bench/bench_scale.py`` runs
the fleet on a real control plane with the controller). Half the nodes have eight A100-80GB,
half eight H100-80GB, all empty at start; the emulated driver takes the A100's measured time
per step (``--instant``: none).

Measured, each from the moment its input is written: every node labelled (the first passes),
every GpuLayout's spec (24 instances per node, 24,000 in all) made and reported Ready, two
pods bound to every node given their instances and reported ``used``; the fleet's peak memory
(the whole process, the in-memory API's copies of every object included) and CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from migpilot.agent.cluster import kubeapi  # noqa: E402
from migpilot.api import gpulayouts  # noqa: E402
from migpilot.gpu import emulated  # noqa: E402
from migpilot.kwok import fleet  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "fleet_agents.json"
GPUS_PER_NODE = 8
LAYOUT = (("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6))
"""Every GPU's spec: three instances."""
PODS_PER_NODE = 2
TIMEOUT_S = 900.0


class Recording(kubeapi.InMemoryNodeApi):
    """The in-memory API, noting which nodes the agents wrote for, so the bench re-checks only
    those (a check of every node at every write would cost more than the fleet)."""

    def __init__(self) -> None:
        super().__init__()
        self.changed = threading.Condition()
        self.statuses: dict[str, gpulayouts.LayoutStatus] = {}
        self._dirty: set[str] = set()

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        super().apply_layout_status(name, status)
        with self.changed:
            self.statuses[name] = status
            self._dirty.add(name)
            self.changed.notify_all()

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        super().patch_node_labels(node, labels)
        with self.changed:
            self._dirty.add(node)
            self.changed.notify_all()

    def wait(self, names: list[str], done: Callable[[str], bool], what: str) -> float:
        """Seconds until ``done`` holds for every node in ``names``."""
        start = time.perf_counter()
        with self.changed:
            left = {n for n in names if not done(n)}
            self._dirty.clear()
            while left:
                if time.perf_counter() - start > TIMEOUT_S:
                    raise SystemExit(f"timed out waiting for {what} ({len(left)} nodes left)")
                self.changed.wait(1.0)
                left -= {n for n in self._dirty & left if done(n)}
                self._dirty.clear()
        return round(time.perf_counter() - start, 2)


def _spec() -> dict[str, Any]:
    instances = [{"profile": p, "start": s} for p, s in LAYOUT]
    return {"gpus": [{"index": g, "instances": instances} for g in range(GPUS_PER_NODE)]}


def _pod(name: str, node: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "bench",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.10gb": 1}}}],
        },
        "status": {"phase": "Running"},
    }


def _ready(status: gpulayouts.LayoutStatus | None, *, used: int) -> bool:
    if status is None or status.observed_generation != 1:
        return False
    ready = [c for c in status.conditions if c.type == gpulayouts.READY]
    if not ready or ready[0].status is not gpulayouts.ConditionStatus.TRUE:
        return False
    held = sum(i.state is gpulayouts.InstanceState.USED for g in status.gpus for i in g.instances)
    return status.summary.instances == GPUS_PER_NODE * len(LAYOUT) and held == used


def run(*, nodes: int, workers: int, instant: bool) -> dict[str, Any]:
    api = Recording()
    names = [f"node-{i:04d}" for i in range(nodes)]
    for i, name in enumerate(names):
        model = "a100-80gb" if i % 2 else "h100-80gb"
        api.put_node(name, {fleet.EMULATED_GPUS_LABEL: f"{model}.x{GPUS_PER_NODE}"})
    settings = fleet.FleetSettings(
        workers=workers, times=emulated.INSTANT if instant else emulated.OperationTimes()
    )
    cpu0 = time.process_time()
    stop = threading.Event()
    runner = threading.Thread(target=fleet.Fleet(api, settings=settings).run, args=(stop,))
    runner.start()
    try:
        labelled = api.wait(
            names, lambda n: "nvidia.com/mig.capable" in api.node_labels.get(n, {}), "labels"
        )
        for name in names:
            api.put_spec(name, _spec())
        made = api.wait(names, lambda n: _ready(api.statuses.get(n), used=0), "specs made")
        for name in names:
            for k in range(PODS_PER_NODE):
                api.put_pod(_pod(f"{name}-p{k}", name))
        assigned = api.wait(
            names, lambda n: _ready(api.statuses.get(n), used=PODS_PER_NODE), "pods' instances used"
        )
    finally:
        stop.set()
        api.close()
        runner.join()
    return {
        "nodes": nodes,
        "gpus": nodes * GPUS_PER_NODE,
        "instances": nodes * GPUS_PER_NODE * len(LAYOUT),
        "pods": nodes * PODS_PER_NODE,
        "workers": workers,
        "emulated_times": "instant" if instant else "A100 measured",
        "all_labelled_s": labelled,
        "all_specs_made_s": made,
        "all_pods_used_s": assigned,
        "status_writes": api.status_writes,
        "cpu_s": round(time.process_time() - cpu0, 1),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--workers", type=int, default=fleet.DEFAULT_WORKERS)
    parser.add_argument("--instant", action="store_true", help="emulated steps take no time")
    args = parser.parse_args()
    row = run(nodes=args.nodes, workers=args.workers, instant=args.instant)
    for k, v in row.items():
        print(f"{k:<20}{v}")
    flags = f" --nodes {args.nodes} --workers {args.workers}" + (
        " --instant" if args.instant else ""
    )
    doc = {
        "command": f"python bench/fleet_agents.py{flags}",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "results": row,
    }
    RESULTS.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
