"""Controller benchmark: from a pod's creation to its binding, when MIG instances must be made.

Run: ``.venv/bin/python bench/bench_controller.py [--pods 50]`` (after ``./scripts/test`` has set
up ``.venv`` and built the control plane). Prints a table and adds the run to
``bench/results/controller.json`` (earlier runs are kept, with the machine's load). Timing never
decides a test; this file records what was measured, on which machine.

The whole system runs as in production, on a real control plane (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) with KWOK nodes: ``migpilot webhook`` registered with
the apiserver, ``migpilot controller`` with default settings, one ``migpilot agent`` per node
(emulated GPUs, which take about 0.1 s per instance as the hardware does, and the stand-in
kubelet that publishes the node's capacity). Four nodes of eight fresh GPUs each (two A100-80GB,
two H100-80GB), so every pod needs an instance that does not exist yet.

Two ways pods arrive, each on fresh nodes:

- **burst**: ``--pods`` pods created back to back (profiles 1g.10gb, 1g.20gb, 2g.20gb, 3g.40gb,
  4g.40gb in turn);
- **one at a time**: the next pod is created when the previous one is bound;
- **burst (spread)**: the burst again with the controller's ``--node-policy spread``, so the new
  instances are made by four agents at once instead of two (the default ``binpack`` packs the
  burst onto two nodes, whose agents make their instances one after another).

Creation → bind is measured by this client: the time before its create call to the time its
watch first shows the pod with a node.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


import lightkube  # noqa: E402
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements  # noqa: E402
from lightkube.models.meta_v1 import ObjectMeta  # noqa: E402
from lightkube.resources.core_v1 import Namespace, Pod  # noqa: E402
from tests.kube import controlplane, system  # noqa: E402

from migpilot.sim import simulating  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "controller.json"
PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb")
MODELS = ("a100-80gb", "a100-80gb", "h100-80gb", "h100-80gb")
GPUS_PER_NODE = 8
TIMEOUT_S = 300.0


class BindWatch:
    """Records when each pod of a namespace is first seen with a node (wall clock)."""

    def __init__(self, kubeconfig: Path, namespace: str) -> None:
        self.bound: dict[str, float] = {}
        self._client = lightkube.Client(
            config=lightkube.KubeConfig.from_file(kubeconfig), trust_env=False
        )
        self._namespace = namespace
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _run(self) -> None:
        listed = self._client.list(Pod, namespace=self._namespace)
        list(listed)
        version = listed.resourceVersion
        self._ready.set()
        try:
            for _, pod in self._client.watch(
                Pod, namespace=self._namespace, resource_version=version
            ):
                if self._stop.is_set():
                    return
                assert pod.metadata is not None
                name = pod.metadata.name or ""
                if pod.spec is not None and pod.spec.nodeName and name not in self.bound:
                    self.bound[name] = time.time()
        except Exception:
            # A stopped watch's stream stays open until the control plane stops, which then
            # breaks it: not an error of the run. A break before stop() is.
            if not self._stop.is_set():
                raise

    def wait(self, names: set[str]) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not names <= set(self.bound):
            if time.monotonic() > deadline:
                missing = sorted(names - set(self.bound))[:5]
                raise SystemExit(f"timed out: pods never bound, e.g. {missing}")
            time.sleep(0.01)

    def stop(self) -> None:
        self._stop.set()


def _pod(name: str, namespace: str, profile: str) -> Pod:
    limits = {f"nvidia.com/mig-{profile}": "1"}
    return Pod(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ]
        ),
    )


def _creates(root: Path) -> int:
    return sum(
        len(re.findall(r"GPU \d+: create ", p.read_text(errors="replace")))
        for p in root.glob("agent-*.log")
    )


def run_mode(
    plane: controlplane.ControlPlane, *, mode: str, pods: int, scoring: str = "binpack"
) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix=f"mpbench-{mode}-"))
    migpilot = system.System(plane, root)
    client = plane.client
    namespace = f"bench-{migpilot.lease_ns.rsplit('-', 1)[-1]}"
    try:
        migpilot.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        migpilot.start_webhook()
        suffix = migpilot.lease_ns.rsplit("-", 1)[-1]
        for i, model in enumerate(MODELS):
            migpilot.add_node(f"bench-{suffix}-{i}", f"emulated:{model}:x{GPUS_PER_NODE}")
        migpilot.start_controller("bench", "--node-policy", scoring, verbose=False)
        controlplane.wait_for(
            lambda: _reported(client, migpilot.nodes),
            what="every agent's first status",
            timeout=TIMEOUT_S,
        )
        watch = BindWatch(plane.kubeconfig, namespace)
        created: dict[str, float] = {}
        names = [f"p{i:03d}" for i in range(pods)]
        for i, name in enumerate(names):
            created[name] = time.time()
            client.create(_pod(name, namespace, PROFILES[i % len(PROFILES)]))
            if mode == "sequential":
                watch.wait({name})
        watch.wait(set(names))
        watch.stop()
        latencies = [watch.bound[n] - created[n] for n in names]
        gated = sum(
            1
            for p in client.list(Pod, namespace=namespace)
            if p.metadata is not None
            and (p.metadata.labels or {}).get("migpilot.io/gated") == "true"
        )
        return {
            "mode": mode if scoring == "binpack" else f"{mode} ({scoring})",
            "pods": pods,
            "gated_by_webhook": gated,
            "instances_created": _creates(root),
            "p50_s": round(simulating.percentile(latencies, 50), 3),
            "p95_s": round(simulating.percentile(latencies, 95), 3),
            "max_s": round(max(latencies), 3),
        }
    finally:
        for p in client.list(Pod, namespace=namespace):
            assert p.metadata is not None
            with contextlib.suppress(lightkube.ApiError):
                client.delete(Pod, p.metadata.name or "", namespace=namespace, grace_period=0)
        migpilot.stop()
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)


def _reported(client: lightkube.Client, nodes: list[str]) -> bool:
    """Every node's GpuLayout exists and has a status."""
    for n in nodes:
        try:
            doc = client.get(system.crds.GpuLayout, n).to_dict()
        except lightkube.ApiError:
            return False
        if not doc.get("status"):
            return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pods", type=int, default=50, help="pods per mode (default 50)")
    args = parser.parse_args()
    plane = controlplane.ControlPlane.start()
    try:
        rows = [
            run_mode(plane, mode="burst", pods=args.pods),
            run_mode(plane, mode="sequential", pods=args.pods),
            run_mode(plane, mode="burst", pods=args.pods, scoring="spread"),
        ]
    finally:
        plane.stop()
    print(f"{'mode':<18}{'pods':>6}{'gated':>7}{'created':>9}{'p50 s':>8}{'p95 s':>8}{'max s':>8}")
    for r in rows:
        print(
            f"{r['mode']:<18}{r['pods']:>6}{r['gated_by_webhook']:>7}{r['instances_created']:>9}"
            f"{r['p50_s']:>8}{r['p95_s']:>8}{r['max_s']:>8}"
        )
    run = {
        "command": f"python bench/bench_controller.py --pods {args.pods}",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "load_average_1m_at_end": round(os.getloadavg()[0], 2),
        },
        "settings": "controller defaults (batch window 0.25 s); agents --interval 5",
        "results": rows,
    }
    # Runs accumulate: a figure is only comparable with one measured on an equally quiet machine.
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    runs = old.get("runs", [old] if old.get("results") else [])
    RESULTS.write_text(json.dumps({"runs": [*runs, run]}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
