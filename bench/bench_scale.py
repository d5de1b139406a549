"""Scale benchmark: 1,000 KWOK nodes of 8 GPUs, 5,000 MIG pods submitted at once.

Run: ``.venv/bin/python bench/bench_scale.py [--nodes 1000] [--pods 5000]`` (after
``./scripts/test`` has set up ``.venv`` and built the control plane; about 10 minutes on 2
cores). Prints a table and adds the run to ``bench/results/scale.json`` (earlier runs kept).
Timing never decides a test.

A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler with its
client QPS raised to 500, KWOK for the nodes), ``migpilot webhook``, ``migpilot controller``
(default settings) and one ``migpilot fleet`` process running the simulated agents of
every node (emulated GPUs, half A100-80GB and half H100-80GB nodes; the stand-in kubelet
publishes each node's resources). Every GPU starts empty, so every pod needs an instance made.

With ``--backlog N`` (incremental planning, ``docs/controller.md``): once every pod is bound,
``N`` pods are pinned to the node of the first bound pod, each asking eight ``7g.80gb``: no
pod fits there while that pod runs, and an empty node could run one, so they wait rather than
being refused (the standing backlog); once a plan has judged them, ``--trickle``
batches of ``--trickle-pods`` new pods (profiles in turn, any node) are created
``--trickle-every`` seconds apart, each batch waited for until bound. Reported from the
controller's metrics over the trickle: plans by kind (``migpilot_plans_total{kind}``) and
planner seconds per plan of each kind (``migpilot_planner_seconds_total{kind}``), and each
batch's seconds from its first create to its last pod bound.

Measured: seconds from the first create call to every pod bound (this client's watch), the
controller's API requests (its own counter, by operation), its CPU seconds and peak memory
(``/proc``), the number of plans and their planner seconds (its metrics), every process's CPU
seconds, and kube-apiserver's requests by verb and resource (its ``/metrics``). Requests are
counted when the last pod is bound, and again once the Events the controller writes in the
background (they never hold up its loop) are all written.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import re
import ssl
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import lightkube  # noqa: E402
import yaml  # noqa: E402
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements  # noqa: E402
from lightkube.models.meta_v1 import ObjectMeta  # noqa: E402
from lightkube.resources.core_v1 import Namespace, Node, Pod  # noqa: E402
from tests.kube import controlplane, system  # noqa: E402

import bench_controller  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "scale.json"
PROFILES = ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
EMULATED_LABEL = "migpilot.io/emulated-gpus"
SCHEDULER_QPS = 500
TIMEOUT_S = 1200.0


def _proc(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and peak resident memory in bytes of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    peak = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            peak = int(line.split()[1]) * 1024
    return cpu, peak


def _metrics(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("migpilot_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _apiserver_requests(kubeconfig: Path) -> dict[str, float]:
    """kube-apiserver's ``apiserver_request_total`` summed by verb and resource (and
    subresource), read from its ``/metrics`` with the admin kubeconfig's client certificate."""
    config = yaml.safe_load(kubeconfig.read_text())
    user = config["users"][0]["user"]
    cluster = config["clusters"][0]["cluster"]
    context = ssl.create_default_context(cafile=cluster["certificate-authority"])
    context.load_cert_chain(user["client-certificate"], user["client-key"])
    text = (
        urllib.request.urlopen(cluster["server"] + "/metrics", context=context, timeout=30)
        .read()
        .decode()
    )
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        key = f"{labels.get('verb', '?')} {labels.get('resource', '?')}"
        if labels.get("subresource"):
            key += f"/{labels['subresource']}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {k: int(v - before.get(k, 0.0)) for k, v in after.items() if v - before.get(k, 0.0) >= 1}


def _controller_requests(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The controller's API requests by operation between two readings of its metrics."""
    out = {
        re.sub(r'.*operation="([^"]+)".*', r"\1", k): int(after[k] - before.get(k, 0.0))
        for k in after
        if k.startswith("migpilot_controller_api_requests_total")
    }
    return {k: v for k, v in sorted(out.items()) if v}


def _make_nodes(client: lightkube.Client, names: list[str]) -> None:
    key, value = controlplane.KWOK_ANNOTATION

    def one(i_name: tuple[int, str]) -> None:
        i, name = i_name
        model = "a100-80gb" if i % 2 == 0 else "h100-80gb"
        client.create(
            Node(
                metadata=ObjectMeta(
                    name=name,
                    labels={
                        "kubernetes.io/hostname": name,
                        "type": "kwok",
                        EMULATED_LABEL: f"{model}.x8",
                    },
                    annotations={key: value},
                )
            )
        )

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, enumerate(names)))


def _ready_nodes(client: lightkube.Client, prefix: str) -> int:
    n = 0
    for node in client.list(Node):
        assert node.metadata is not None
        if not (node.metadata.name or "").startswith(prefix):
            continue
        conditions = (node.status.conditions if node.status else None) or []
        taints = (node.spec.taints if node.spec else None) or []
        if any(c.type == "Ready" and c.status == "True" for c in conditions) and not taints:
            n += 1
    return n


def _pinned(name: str, namespace: str, node: str, profile: str, count: int) -> Pod:
    limits = {f"nvidia.com/mig-{profile}": str(count)}
    return Pod(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PodSpec(
            nodeSelector={"kubernetes.io/hostname": node},
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ],
        ),
    )


def _kinds(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Plans and planner seconds per plan by kind, between two metric readings."""
    out: dict[str, Any] = {}
    for kind in ("full", "incremental"):
        plans_key = f'migpilot_plans_total{{kind="{kind}"}}'
        seconds_key = f'migpilot_planner_seconds_total{{kind="{kind}"}}'
        n = after.get(plans_key, 0.0) - before.get(plans_key, 0.0)
        s = after.get(seconds_key, 0.0) - before.get(seconds_key, 0.0)
        out[kind] = {
            "plans": int(n),
            "planner_s_per_plan": round(s / n, 4) if n else None,
        }
    return out


def _trickle(
    client: lightkube.Client,
    kubeconfig: Path,
    *,
    namespace: str,
    port: int,
    backlog: int,
    batches: int,
    per_batch: int,
    every_s: float,
) -> dict[str, Any]:
    """The standing backlog, then the trickle of new pods (see the module)."""
    watch = bench_controller.BindWatch(kubeconfig, namespace)
    first_node = next(
        p.spec.nodeName
        for p in client.list(Pod, namespace=namespace)
        if p.spec is not None and p.spec.nodeName
    )
    names = [f"b{i:05d}" for i in range(backlog)]

    def one(name: str) -> None:
        client.create(_pinned(name, namespace, first_node, "7g.80gb", 8))

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(one, names))
    # A full plan that judged the whole backlog (each waits with the reason MigWaiting).
    controlplane.wait_for(
        lambda: _metrics(port).get('migpilot_pending_pods{reason="MigWaiting"}', 0.0) >= backlog,
        what=f"{backlog} backlog pods judged waiting",
        timeout=TIMEOUT_S,
    )
    before = _metrics(port)
    bound_s: list[float] = []
    for b in range(batches):
        batch = [f"t{b:03d}-{i:03d}" for i in range(per_batch)]
        started = time.time()
        for i, name in enumerate(batch):
            client.create(bench_controller._pod(name, namespace, PROFILES[i % (len(PROFILES) - 1)]))
        watch.wait(set(batch))
        bound_s.append(round(max(watch.bound[n] for n in batch) - started, 2))
        time.sleep(every_s)
    after = _metrics(port)
    watch.stop()
    return {
        "backlog": backlog,
        "batches": batches,
        "pods_per_batch": per_batch,
        "by_kind": _kinds(before, after),
        "batch_bound_s": bound_s,
    }


def run(
    *,
    nodes: int,
    pods: int,
    backlog: int = 0,
    trickle: int = 10,
    trickle_pods: int = 10,
    trickle_every_s: float = 2.0,
) -> dict[str, Any]:
    plane = controlplane.ControlPlane.start(
        scheduler_qps=SCHEDULER_QPS, scheduler_burst=SCHEDULER_QPS * 2
    )
    root = Path(tempfile.mkdtemp(prefix="mpscale-"))
    migpilot = system.System(plane, root)
    client = plane.client
    namespace = "scale"
    try:
        migpilot.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        migpilot.start_webhook()
        names = [f"scale-{i:04d}" for i in range(nodes)]
        t = time.monotonic()
        _make_nodes(client, names)
        controlplane.wait_for(
            lambda: _ready_nodes(client, "scale-") == nodes,
            what=f"{nodes} KWOK nodes Ready",
            timeout=TIMEOUT_S,
        )
        nodes_ready_s = time.monotonic() - t
        migpilot.nodes.extend(names)
        migpilot.start_fleet()
        [port] = controlplane.free_ports(1)
        migpilot.start_controller("scale", "--metrics-port", str(port), verbose=False)
        controlplane.wait_for(
            lambda: bench_controller._reported(client, names),
            what="every agent's first status",
            timeout=TIMEOUT_S,
        )
        pid = migpilot.controllers["scale"].pid
        cpu0, _ = _proc(pid)
        everyone = {c.name: c.pid for c in [*plane.components, *migpilot.components()]}
        everyone["bench-client"] = os.getpid()
        cpu_before = {name: _proc(p)[0] for name, p in everyone.items()}
        apiserver_before = _apiserver_requests(plane.kubeconfig)
        before = _metrics(port)
        watch = bench_controller.BindWatch(plane.kubeconfig, namespace)
        pod_names = [f"p{i:05d}" for i in range(pods)]
        started = time.time()

        def create(i: int) -> None:
            client.create(
                bench_controller._pod(pod_names[i], namespace, PROFILES[i % len(PROFILES)])
            )

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(pool.map(create, range(pods)))
        submitted_s = time.time() - started
        bench_controller.TIMEOUT_S = TIMEOUT_S
        watch.wait(set(pod_names))
        all_bound_s = max(watch.bound.values()) - started
        watch.stop()
        # What had been spent when the last pod was bound...
        cpu1, peak = _proc(pid)
        cpu_by_process = {
            name: round(_proc(p)[0] - cpu_before[name], 1) for name, p in everyone.items()
        }
        apiserver = _delta(apiserver_before, _apiserver_requests(plane.kubeconfig))
        at_bound = _metrics(port)
        requests = _controller_requests(before, at_bound)
        pending = int(at_bound.get("migpilot_controller_events_pending", 0.0))
        # ... and once the Events the controller writes in the background are all written.
        t_bound = time.time()
        controlplane.wait_for(
            lambda: _metrics(port).get("migpilot_controller_events_pending", 1.0) == 0.0,
            what="the controller's Events written",
            timeout=TIMEOUT_S,
        )
        drained_s = time.time() - t_bound
        after = _metrics(port)
        requests_drained = _controller_requests(before, after)
        incremental = (
            _trickle(
                client,
                plane.kubeconfig,
                namespace=namespace,
                port=port,
                backlog=backlog,
                batches=trickle,
                per_batch=trickle_pods,
                every_s=trickle_every_s,
            )
            if backlog
            else None
        )
        apiserver_drained = _delta(apiserver_before, _apiserver_requests(plane.kubeconfig))
        plans = after.get("migpilot_plan_duration_seconds_count", 0) - before.get(
            "migpilot_plan_duration_seconds_count", 0
        )
        plan_s = after.get("migpilot_plan_duration_seconds_sum", 0) - before.get(
            "migpilot_plan_duration_seconds_sum", 0
        )
        return {
            "nodes": nodes,
            "gpus": nodes * 8,
            "pods": pods,
            "nodes_ready_s": round(nodes_ready_s, 1),
            "submit_s": round(submitted_s, 1),
            "all_bound_s": round(all_bound_s, 1),
            "controller_api_requests": requests,
            "controller_api_requests_total": sum(requests.values()),
            "controller_events_pending_when_all_bound": pending,
            "controller_events_written_s_after_all_bound": round(drained_s, 1),
            "controller_api_requests_total_with_events": sum(requests_drained.values()),
            "controller_cpu_s": round(cpu1 - cpu0, 1),
            "controller_peak_rss_mib": round(peak / 2**20),
            "cpu_s_by_process": dict(sorted(cpu_by_process.items(), key=lambda kv: -kv[1])),
            "apiserver_requests_total": sum(apiserver.values()),
            "apiserver_requests": dict(sorted(apiserver.items(), key=lambda kv: -kv[1])),
            "apiserver_requests_total_with_events": sum(apiserver_drained.values()),
            "plans": int(plans),
            "planner_s_total": round(plan_s, 1),
            **({"incremental": incremental} if incremental is not None else {}),
        }
    finally:
        migpilot.stop()
        plane.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--pods", type=int, default=5000)
    parser.add_argument("--backlog", type=int, default=0, help="standing backlog pods (0: none)")
    parser.add_argument("--trickle", type=int, default=10, help="batches of new pods")
    parser.add_argument("--trickle-pods", type=int, default=10, help="new pods per batch")
    parser.add_argument("--trickle-every", type=float, default=2.0, help="seconds between")
    args = parser.parse_args()
    row = run(
        nodes=args.nodes,
        pods=args.pods,
        backlog=args.backlog,
        trickle=args.trickle,
        trickle_pods=args.trickle_pods,
        trickle_every_s=args.trickle_every,
    )
    for k, v in row.items():
        print(f"{k:<28}{v}")
    doc = {
        "command": f"python bench/bench_scale.py --nodes {args.nodes} --pods {args.pods}"
        + (
            f" --backlog {args.backlog} --trickle {args.trickle} --trickle-pods "
            f"{args.trickle_pods} --trickle-every {args.trickle_every:g}"
            if args.backlog
            else ""
        ),
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "settings": f"controller defaults; kube-scheduler client QPS {SCHEDULER_QPS}",
        "results": row,
    }
    # Runs accumulate: figures from a shared machine are compared run by run.
    old = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    runs = old.get("runs", [old] if old.get("results") else [])
    RESULTS.write_text(json.dumps({"runs": [*runs, doc]}, indent=2) + "\n")
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
