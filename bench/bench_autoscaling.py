"""Autoscaling benchmark (issue 23): how fast the loop closes on the real control plane.

Run: ``.venv/bin/python bench/bench_autoscaling.py [--section hpa]`` (after ``./scripts/test``
has set up ``.venv`` and the tool cache). Each section runs its scenario on a fresh control
plane, prints its figures and writes them under its own key of
``bench/results/autoscaling.json`` (read, updated, written back: the other sections' figures
stay), with the command and the machine. Timing never decides a test; this file records what
was measured, on which machine.

Sections:

- ``hpa``: the scenario of ``tests/e2e/test_gpu_hpa.py`` (``tests/kube/gpu_hpa.py``, which
  checks every step as the test does): KEDA and the HPA controller scale a MIG Deployment and a
  HAMi-style one on per-pod GPU utilisation. Recorded: seconds from the load change to all new
  replicas Running (each Deployment), from the load drop to the removed replicas gone and to
  their instances free, how many instances were freed and how many of them the larger pod's
  instance was carved from, and that pod's creation to Running.
- ``node``: the scenario of ``tests/e2e/test_node_autoscaling.py``
  (``tests/kube/node_autoscaling.py``), :data:`NODE_RUNS` times on the one control plane:
  two full H100 nodes, a burst of eight ``3g.40gb`` pods, ``migpilot controller
  --node-autoscaling``, Karpenter's KWOK provider with migpilot's NodeOverlay. Recorded: seconds
  from the burst to Karpenter's new Node, to it registered, Ready and without the startup
  taint, and to every pod Running; from deleting the pods to the node consolidated away; and
  the nodes added.

A section is a function from the control plane and a working folder to a JSON-able dict; add
one to :data:`SECTIONS`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kube import controlplane, gpu_hpa  # noqa: E402
from tests.kube import node_autoscaling as nas  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "autoscaling.json"


def _held(h: gpu_hpa.Held) -> dict[str, Any]:
    return {"pod": h.pod, "gpu": h.gpu, "profile": h.profile, "start": h.start}


def hpa(plane: controlplane.ControlPlane, root: Path) -> dict[str, Any]:
    """The HPA-on-GPU-utilisation scenario, timed."""
    with gpu_hpa.staged(plane, root) as stage:
        started = gpu_hpa.start_workloads(stage)
        out = gpu_hpa.scale_out(stage, started)
        back = gpu_hpa.scale_in(stage, started, out)
        large = gpu_hpa.grow_large(stage, started, back)
    kinds = {w.name: w.kind for w in gpu_hpa.WORKLOADS}
    return {
        "scenario": (
            f"one KWOK node, one emulated {gpu_hpa.MODEL} (migpilot fleet); per Deployment a "
            f"KEDA ScaledObject (prometheus trigger: sum of {gpu_hpa.UTILIZATION} over its "
            f"pods, AverageValue, threshold {gpu_hpa.TARGET}), min 1, max "
            f"{gpu_hpa.MAX_REPLICAS}; load {gpu_hpa.LOW} -> {gpu_hpa.HIGH} -> {gpu_hpa.LOW}, "
            f"then one pod asking nvidia.com/mig-{gpu_hpa.LARGE}"
        ),
        "workloads": {
            w.kind: {"name": w.name, "limits": dict(w.limits)} for w in gpu_hpa.WORKLOADS
        },
        "settings": {
            "hpa_sync_period": controlplane.HPA_SYNC_PERIOD,
            "hpa_behavior": "scaleUp: 4 pods/1 s, scaleDown: 100 %/1 s, no stabilisation",
            "keda_polling_interval_s": 1,
            "gpu_metrics_interval_s": gpu_hpa.SAMPLE_S,
            "prometheus_scrape_interval_s": gpu_hpa.SAMPLE_S,
            "controller": "defaults (batch window 0.25 s)",
        },
        "start_to_hpas_reading_s": round(started.seconds, 2),
        "scale_out": {
            "replicas": {kinds[n]: r for n, r in out.replicas.items()},
            "load_change_to_all_new_replicas_running_s": {
                kinds[n]: round(s, 2) for n, s in out.seconds.items()
            },
            "load_change_to_first_new_replica_running_s": {
                kinds[n]: round(s, 2) for n, s in out.first_seconds.items()
            },
            "instances_created": out.created,
        },
        "scale_in": {
            "load_drop_to_removed_replicas_gone_s": {
                kinds[n]: round(s, 2) for n, s in back.seconds.items()
            },
            "load_drop_to_instances_free_s": round(back.freed_seconds, 2),
            "instances_freed": len(back.freed),
            "kept": [_held(h) for h in started.held.values()],
            "freed": [_held(h) for h in back.freed],
            "free_instances_metric": back.free_series,
        },
        "larger_pod": {
            "profile": large.held.profile,
            "start": large.held.start,
            "created_to_running_s": round(large.seconds, 2),
            "freed_instances_reused": len(large.reused),
            "reused": [_held(h) for h in large.reused],
        },
    }


NODE_RUNS = 3


def node(plane: controlplane.ControlPlane, root: Path) -> dict[str, Any]:
    """The node-autoscaling scenario, :data:`NODE_RUNS` times (each cleans up after itself)."""
    runs = []
    for i in range(NODE_RUNS):
        scenario = nas.Scenario(plane, root / f"run-{i}")
        scenario.root.mkdir(parents=True)
        try:
            scenario.start()
            scenario.fill()
            scenario.start_karpenter()
            scenario.burst()
            scenario.scale_down()
        finally:
            scenario.stop()
        runs.append(dataclasses.asdict(scenario.figures))
    return {
        "scenario": (
            f"two KWOK nodes of two h100-80gb, each GPU holding a {nas.FILL_PROFILE} a Running "
            f"pod uses (migpilot fleet); a burst of {nas.BURST_PODS} {nas.BURST_PROFILE} pods; "
            f"Karpenter's KWOK provider, one instance type {nas.INSTANCE_TYPE.name} "
            f"({nas.GPUS} GPUs) with migpilot's NodeOverlay, a NodePool with the fleet's label "
            "and the startup taint; then the pods deleted"
        ),
        "settings": {
            "controller": " ".join(nas.Scenario.controller_args),
            "karpenter": "BATCH_IDLE_DURATION 500ms, BATCH_MAX_DURATION 2s, NodeOverlay=true",
            "consolidate_after": nas.Scenario.consolidate_after,
            "fleet": "--interval 5",
            "polling_s": 0.1,
        },
        "runs": runs,
    }


SECTIONS: dict[str, Callable[[controlplane.ControlPlane, Path], dict[str, Any]]] = {
    "hpa": hpa,
    "node": node,
}


def _machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--section",
        action="append",
        choices=sorted(SECTIONS),
        help="a section to run (repeat for several; default: all)",
    )
    parser.add_argument(
        "--note",
        default="",
        help="a word on the machine's state (other work running, ...), kept with the figures",
    )
    args = parser.parse_args()
    # The command that reruns it; the note is kept apart, in the machine's record.
    chosen = [w for name in args.section or () for w in ("--section", name)]
    command = shlex.join(["python", "bench/bench_autoscaling.py", *chosen])
    for name in args.section or sorted(SECTIONS):
        before = _machine()
        began = time.monotonic()
        plane = controlplane.ControlPlane.start()
        try:
            with tempfile.TemporaryDirectory(prefix=f"mpbench-{name}-") as root:
                figures = SECTIONS[name](plane, Path(root))
        finally:
            plane.stop()
        record = {
            "command": command,
            "machine": {
                **before,
                "load_average_1m_at_end": round(os.getloadavg()[0], 2),
                **({"note": args.note} if args.note else {}),
            },
            "wall_s": round(time.monotonic() - began, 1),
            **figures,
        }
        print(json.dumps({name: record}, indent=2))
        # Read-modify-write: the other sections' figures stay as they were.
        results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
        results[name] = record
        RESULTS.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {name} to {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
