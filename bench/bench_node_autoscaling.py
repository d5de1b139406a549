"""Node autoscaling benchmark (issue 23): seconds from a burst of MIG pods no node can serve to
Karpenter's new node, to that node ready for pods, and to every pod Running; and from deleting
the pods to the empty node consolidated away.

Run: ``.venv/bin/python bench/bench_node_autoscaling.py [--runs 3]`` (after ``./scripts/test``
has set up ``.venv`` and ``scripts/k8s-tools`` built the control plane and Karpenter). The
scenario is the e2e test's (``tests/kube/node_autoscaling.py``): two full H100 nodes, eight
``3g.40gb`` pods, Karpenter's KWOK provider with an 8-GPU H100 instance type and migpilot's
NodeOverlay, ``migpilot controller --node-autoscaling``, ``migpilot fleet``. Each run gets a
fresh control plane. Adds its runs to the ``node`` section of ``bench/results/autoscaling.json``
(the other sections, and earlier runs, are kept). Timing never decides a test; this file
records what was measured, on which machine.

``--ungated`` runs it without the webhook: no pod is gated, so they reach Karpenter through
kube-scheduler alone and the controller plans them by its fallback for ungated Unschedulable
pods (what happens to pods made while no controller held the Lease).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kube import controlplane  # noqa: E402
from tests.kube import node_autoscaling as nas  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "autoscaling.json"
SECTION = "node"


def run_once(*, ungated: bool) -> dict[str, Any]:
    """One run on a fresh control plane: the figures, as :class:`nas.Figures` names them."""
    plane = controlplane.ControlPlane.start()
    root = Path(tempfile.mkdtemp(prefix="bench-nas-"))
    scenario = nas.Scenario(
        plane,
        root,
        webhook=not ungated,
        controller_args=() if ungated else nas.Scenario.controller_args,
    )
    try:
        scenario.start()
        scenario.fill()
        scenario.start_karpenter()
        scenario.burst()
        scenario.scale_down()
        return dataclasses.asdict(scenario.figures)
    finally:
        scenario.stop()
        plane.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs (default 3)")
    parser.add_argument("--ungated", action="store_true", help="without the webhook (see above)")
    args = parser.parse_args()
    rows = [run_once(ungated=args.ungated) for _ in range(args.runs)]
    names = ("burst_to_node_s", "burst_to_node_ready_s", "burst_to_pods_running_s",
             "delete_to_node_gone_s", "nodes_added")  # fmt: skip
    print("".join(f"{n:>26}" for n in names))
    for r in rows:
        print("".join(f"{r[n]:>26}" for n in names))
    run = {
        "command": "python bench/bench_node_autoscaling.py"
        + f" --runs {args.runs}"
        + (" --ungated" if args.ungated else ""),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "settings": (
            f"{nas.BURST_PODS} x {nas.BURST_PROFILE} pods, two full 2-GPU H100 nodes, one "
            f"{nas.GPUS}-GPU H100 instance type; Karpenter BATCH_IDLE_DURATION 500ms, "
            "BATCH_MAX_DURATION 2s, NodeOverlay=true; consolidateAfter "
            f"{nas.Scenario.consolidate_after}; fleet --interval 5; "
            + (
                "no webhook (ungated pods)"
                if args.ungated
                else "controller " + " ".join(nas.Scenario.controller_args)
            )
        ),
        "results": rows,
    }
    # Runs accumulate, and the file's other sections (the HPA's) are left as they are.
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    section = old.get(SECTION) or {}
    old[SECTION] = {"runs": [*section.get("runs", []), run]}
    RESULTS.write_text(json.dumps(old, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
