"""DRA on the real control plane: the sequences of mixed claims bench_dra.py replays in the
simulator, replayed against a real kube-apiserver, kube-scheduler and kube-controller-manager
(v1.37.2, the tests' build) with KWOK nodes in DRA mode, uncurated against migpilot-steered
(issue 26, part 5; writes bench/results/dra_kube.json).

Each node (``migpilot.io/mode=dra``) runs a real ``migpilot agent`` on emulated GPUs, which
publishes its ResourceSlices and serves the DRA kubelet plugin, and a fake kubelet
(:class:`tests.kube.drakubelet.DraKubelet`) that prepares a bound pod's claims through that
plugin before it marks the pod Running, and unprepares them before a deleted pod goes.

- ``uncurated``: no migpilot controller or webhook. Every placement is published (the agent
  lists nothing first without the controller's Lease) and kube-scheduler's first fit allocates
  each claim as it comes: what NVIDIA's DRA driver does.
- ``steered``: migpilot's webhook gates the pods, the controller plans them (node policy
  spread, as kube-scheduler's default score; GPUs packed), writes each node's target, pins and
  ungates; the agents list the planned placements first (``docs/dra.md``, "Steering").

The pods of a trace are made as ``drasim.claims_from_trace`` makes them (half of them asking by
memory, a seeded draw; the rest by profile), each with a ResourceClaim of its own. Time is
compressed by ``--speedup``: a pod arrives at its trace arrival divided by it, and is deleted
its run time divided by it after it is Running. A run ends three seconds after the last
arrival; a pod is served when it ran by then. So the control plane's own delays (the
controller's batch window, scheduler backoff, the fake kubelet's poll) weigh ``--speedup``
times more, in trace time, than in the simulator; both variants pay them alike but for the
controller's window. kube-scheduler's backoff also orders its retries (``migpilot.sim.queueing``):
at ``--speedup 100`` its 1-10 s are 100-1000 s of trace, so after a departure nearly every
pending pod is backing off and the ones that failed fewer times go first; the simulator with
``Backoff(100, 1000, 100)`` replays that (``--scheduler-max-backoff`` sets kube-scheduler's
maximum).

``--outcomes PATH`` writes each pod's outcome (arrival; when it was bound, Running and
deleted; kube-scheduler's ``Scheduled`` time; its node and the devices its claim was
allocated; its ``FailedScheduling`` count), to compare pod by pod with ``drasim``'s.

Also counted: the pods the controller planned, pinned and let go (its ``MigDraPlanned``
Events; 0 uncurated), those its first-fit check let go unsteered (``MigDraFirstFit``),
prepares the plugin refused (a claim allocated a device the node cannot make: it should be 0),
and the claims by memory given a larger profile than the smallest that holds them.

Usage: python bench/bench_dra_kube.py [--traces NAME,...] [--speedup X] [--pods N]
       [--variants uncurated,steered] [--scheduler-max-backoff S] [--out PATH]
       [--outcomes PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import heapq
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import lightkube  # noqa: E402
import yaml  # noqa: E402
from lightkube import codecs  # noqa: E402
from lightkube.models.meta_v1 import ObjectMeta  # noqa: E402
from lightkube.resources.core_v1 import Event, Namespace, Pod  # noqa: E402
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice  # noqa: E402
from tests.kube import controlplane, drapods, kwokstages, system, tools  # noqa: E402
from tests.kube.drakubelet import DraKubelet  # noqa: E402

import bench_dra  # noqa: E402
from migpilot.agent.dra import placements, publishing  # noqa: E402
from migpilot.mig import profiles  # noqa: E402
from migpilot.planning import draalloc  # noqa: E402
from migpilot.planning import unified as unifying  # noqa: E402
from migpilot.sim import clusters, drasim  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "dra_kube.json"
DEVICE_CLASS = ROOT / "deploy" / "dra" / "deviceclass.yaml"
DEFAULT_TRACES = (
    "shift-to-inference-s5",
    "shift-to-training-s2",
    "steady-training-s8",
    "steady-mixed-s11",
)
VARIANTS = ("uncurated", "steered")
NAMESPACE = "bench"
POLL_S = 0.25
READY_S = 180.0
LINGER_S = 3.0
"""Seconds after the last arrival (real time) a run goes on, so that the last pods to arrive
are not counted unserved for the control plane's own latency alone (about a second from
creation to Running here, uncurated)."""


@dataclasses.dataclass
class Outcome:
    name: str
    arrival: float
    """Trace seconds from the first arrival."""
    running_at: float | None = None
    """Real seconds from the start when it was first seen Running."""
    node: str | None = None
    devices: tuple[str, ...] = ()
    bound_at: float | None = None
    """Real seconds from the start when it was first seen bound to a node (polled)."""
    deleted_at: float | None = None
    """Real seconds from the start when the run deleted it (its run time over)."""
    scheduled_at: float | None = None
    """Real seconds from the start of kube-scheduler's ``Scheduled`` Event (its ``eventTime``,
    in microseconds, by the wall clock): the order kube-scheduler bound pods in, finer than
    the poll."""


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def _claim_body(name: str, claim: draalloc.Claim) -> dict[str, Any]:
    requests: list[dict[str, Any]] = []
    for i, request in enumerate(claim.requests):
        if len(request.alternatives) == 1:
            (sel,) = request.alternatives
            requests.append({
                "name": f"r{i}",
                "exactly": {
                    "deviceClassName": publishing.DRIVER,
                    "count": request.count,
                    "selectors": [{"cel": {"expression": sel.cel()}}],
                },
            })  # fmt: skip
        else:
            requests.append({
                "name": f"r{i}",
                "firstAvailable": [
                    {
                        "name": f"s{j}",
                        "deviceClassName": publishing.DRIVER,
                        "count": request.count,
                        "selectors": [{"cel": {"expression": sel.cel()}}],
                    }
                    for j, sel in enumerate(request.alternatives)
                ],
            })  # fmt: skip
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {"devices": {"requests": requests}},
    }


def _pod(name: str, cp: drasim.ClaimPod, *, requests: bool) -> Pod:
    """The pod of ``cp``; with ``requests``, its trace CPU and memory requests, which
    kube-scheduler's NodeResourcesFit score (LeastAllocated) reads to pick a node, as the
    simulator's model does; without, every node scores alike for it."""
    asked = (
        {"cpu": f"{cp.cpu_milli}m", "memory": str(cp.memory_bytes)}
        if requests and (cp.cpu_milli or cp.memory_bytes)
        else None
    )
    return drapods.claim_pod(name, NAMESPACE, claim=name, requests=asked, grace_s=0)


def _node_names(cluster: clusters.Cluster) -> list[tuple[str, str, profiles.GpuModel]]:
    """(node name, agent backend, GPU model) for every node of the cluster."""
    return [
        (f"dra-{node.name}", f"emulated:{node.model.id}:x{node.gpus}", node.model)
        for node in cluster.nodes
    ]


def _allocatable(cluster: clusters.Cluster) -> dict[str, dict[str, str]]:
    """Node name -> its CPU and memory as the simulator's cluster gives them."""
    return {
        f"dra-{node.name}": {
            "cpu": _canonical(node.allocatable.cpu_milli, (("", 1000), ("m", 1))),
            "memory": _canonical(
                node.allocatable.memory_bytes, (("Gi", 2**30), ("Mi", 2**20), ("", 1))
            ),
        }
        for node in cluster.nodes
    }


def _canonical(amount: int, units: tuple[tuple[str, int], ...]) -> str:
    """``amount`` as the API server writes the quantity back (the node's wait compares text)."""
    for suffix, size in units:
        if amount % size == 0:
            return f"{amount // size}{suffix}"
    return str(amount)


class Scene:
    """A control plane of its own with the cluster's nodes in DRA mode."""

    def __init__(
        self,
        cluster: clusters.Cluster,
        *,
        steered: bool,
        requests: bool,
        backoff_s: tuple[int, int] | None = None,
    ) -> None:
        self.allocatable = _allocatable(cluster) if requests else {}
        self.root = Path(tempfile.mkdtemp(prefix="mpdrakube-"))
        self.nodes = [(name, backend) for name, backend, _ in _node_names(cluster)]
        self.models = [(name, model) for name, _, model in _node_names(cluster)]
        found = tools.locate()
        stages = kwokstages.kwok_stages(
            found.kwok_stages,
            nodes=tuple(n for n, _ in self.nodes),
            folder=self.root / "stages",
            names=(kwokstages.POD_READY, kwokstages.POD_DELETE),
        )
        self.plane = controlplane.ControlPlane.start(
            found=dataclasses.replace(found, kwok_stages=stages), scheduler_backoff_s=backoff_s
        )
        self.system = system.System(self.plane, self.root)
        self.kubelets: dict[str, DraKubelet] = {}
        self.folders: list[Path] = []
        try:
            self._start(steered=steered)
        except BaseException:
            self.stop()
            raise

    @property
    def client(self) -> lightkube.Client:
        return self.plane.client

    def _start(self, *, steered: bool) -> None:
        self.system.prepare()
        self.client.create(Namespace(metadata=ObjectMeta(name=NAMESPACE)))
        for doc in yaml.safe_load_all(DEVICE_CLASS.read_text()):
            if doc:
                self.client.create(codecs.from_dict(doc))
        if steered:
            self.system.start_webhook()
            self.system.start_controller("c1", verbose=False)
        for name, backend in self.nodes:
            # A short folder: a unix socket's path has at most 107 bytes.
            folder = Path(tempfile.mkdtemp(prefix="mpdk-"))
            self.folders.append(folder)
            kubelet = DraKubelet(folder, node=name, kubeconfig=self.plane.kubeconfig)
            kubelet.start()
            self.kubelets[name] = kubelet
            self.plane.add_node(
                name, labels={"migpilot.io/mode": "dra"}, resources=self.allocatable.get(name)
            )
            self.system.nodes.append(name)
            (self.root / f"proc-{name}").mkdir()
            self.system.start_agent(
                name,
                backend,
                "--proc-root", str(self.root / f"proc-{name}"),
                "--cdi-spec-dir", str(self.root / f"cdi-{name}"),
                "--interval", "2",
                kubelet=str(kubelet.dir),
            )  # fmt: skip
        controlplane.wait_for(
            self._ready,
            what="every node's pool published and its plugin registered",
            timeout=READY_S,
            watch=self.system.components(),
        )

    def _ready(self) -> bool:
        slices = [
            s.to_dict()
            for s in self.client.list(ResourceSlice, fields={"spec.driver": publishing.DRIVER})
        ]
        pools = {s["spec"]["pool"]["name"] for s in slices}
        registered = all(k.registered for k in self.kubelets.values())
        return registered and pools == {n for n, _ in self.nodes}

    def refused(self) -> list[str]:
        return [
            e
            for k in self.kubelets.values()
            for e in k.errors()
            if e.startswith(("prepare ", "unprepare "))
        ]

    def stop(self) -> None:
        for kubelet in self.kubelets.values():
            with contextlib.suppress(Exception):
                kubelet.stop()
        with contextlib.suppress(Exception):
            self.system.stop()
        with contextlib.suppress(Exception):
            self.plane.stop()
        for folder in self.folders:
            shutil.rmtree(folder, ignore_errors=True)


def _allocated(doc: dict[str, Any]) -> tuple[str | None, tuple[str, ...]]:
    allocation = (doc.get("status") or {}).get("allocation") or {}
    results = (allocation.get("devices") or {}).get("results") or []
    pools = {r.get("pool") for r in results}
    node = pools.pop() if len(pools) == 1 else None
    return node, tuple(str(r.get("device")) for r in results)


def _oversized(pod: drasim.ClaimPod, devices: tuple[str, ...], model: profiles.GpuModel) -> int:
    """Devices of a claim by memory larger than the smallest profile of ``model`` holding it
    (as ``drasim`` counts them)."""
    if not pod.by_memory:
        return 0
    gpus = dict.fromkeys(range(64), model)
    count = 0
    for device, request in zip(devices, pod.claim.requests, strict=False):
        need = request.alternatives[0].min_memory_mib
        smallest = unifying.profile_for(unifying.GpuAsk(count=1, memory_mib=need), model)
        if smallest is None:
            continue
        got = model.profile_named(placements.parse_device_name(device, gpus).profile)
        best = model.profile_named(smallest)
        if (got.memory_mib or 0, got.compute_slices) > (best.memory_mib or 0, best.compute_slices):
            count += 1
    return count


def replay(
    scene: Scene,
    pods: tuple[drasim.ClaimPod, ...],
    *,
    speedup: float,
    requests: bool,
    log: Callable[[str], None] = _say,
    record: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Replays ``pods`` on ``scene``; the figures of the run. ``record``: a list the run
    appends each pod's outcome to (arrival, bound and running times, node, devices, and the
    time of kube-scheduler's ``Scheduled`` Event), in trace order."""
    client = scene.client
    first = min(p.arrival for p in pods)
    outcomes = {p.name: Outcome(p.name, p.arrival - first) for p in pods}
    by_name = {p.name: p for p in pods}
    events: list[tuple[float, int, str, str]] = []
    for i, p in enumerate(pods):
        heapq.heappush(events, ((p.arrival - first) / speedup, i, "arrive", p.name))
    end = max(p.arrival - first for p in pods) / speedup + LINGER_S
    seq = len(pods)
    start = time.monotonic()
    started = time.time()
    next_poll = 0.0
    next_say = 30.0
    running: set[str] = set()
    deleted: set[str] = set()
    while True:
        now = time.monotonic() - start
        if now >= end:
            break
        while events and events[0][0] <= now:
            _, _, kind, name = heapq.heappop(events)
            if kind == "arrive":
                client.create(codecs.from_dict(_claim_body(name, by_name[name].claim)))
                client.create(_pod(name, by_name[name], requests=requests))
            else:
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(Pod, name, namespace=NAMESPACE)
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(ResourceClaim, name, namespace=NAMESPACE)
                deleted.add(name)
                outcomes[name].deleted_at = now
        if now >= next_poll:
            next_poll = now + POLL_S
            for listed in client.list(Pod, namespace=NAMESPACE):
                seen = listed.metadata.name if listed.metadata else None
                phase = listed.status.phase if listed.status else None
                bound = listed.spec.nodeName if listed.spec else None
                if seen in outcomes and bound and outcomes[seen].bound_at is None:
                    outcomes[seen].bound_at = now
                if seen in outcomes and phase == "Running" and seen not in running:
                    running.add(seen)
                    outcome = outcomes[seen]
                    outcome.running_at = now
                    outcome.node = bound
                    if record is not None:
                        # Its devices now: its claim goes when it departs.
                        with contextlib.suppress(lightkube.ApiError):
                            got = client.get(ResourceClaim, seen, namespace=NAMESPACE)
                            outcome.devices = _allocated(got.to_dict())[1]
                    duration = by_name[seen].duration
                    if duration is not None and math.isfinite(duration):
                        seq += 1
                        heapq.heappush(events, (now + duration / speedup, seq, "depart", seen))
        if now >= next_say:
            next_say += 30.0
            log(f"  {now:.0f}/{end:.0f} s: {len(running)} served, {len(deleted)} done")
        wait = min(
            [end - now, max(next_poll - now, 0.0)] + ([events[0][0] - now] if events else [])
        )
        time.sleep(max(min(wait, POLL_S), 0.01))
    # The devices of the served pods' claims (those still there), for the oversized count.
    for claim in client.list(ResourceClaim, namespace=NAMESPACE):
        doc = claim.to_dict()
        name = doc["metadata"]["name"]
        if name in outcomes:
            outcomes[name].node, outcomes[name].devices = _allocated(doc)
    listed_events = list(client.list(Event, namespace=NAMESPACE))
    told = Counter(e.reason for e in listed_events if e.involvedObject.name in outcomes)
    if record is not None:
        failed: Counter[str] = Counter()
        for e in listed_events:
            name = e.involvedObject.name
            if e.reason == "Scheduled" and name in outcomes and e.eventTime is not None:
                outcomes[name].scheduled_at = e.eventTime.timestamp() - started
            elif e.reason == "FailedScheduling" and name in outcomes:
                # kube-scheduler's events series: one Event, counted
                failed[name] += (e.series.count if e.series else None) or e.count or 1
        record.extend(
            {
                "name": o.name,
                "arrival": round(o.arrival, 3),
                "bound_at": None if o.bound_at is None else round(o.bound_at, 3),
                "running_at": None if o.running_at is None else round(o.running_at, 3),
                "deleted_at": None if o.deleted_at is None else round(o.deleted_at, 3),
                "scheduled_at": None if o.scheduled_at is None else round(o.scheduled_at, 6),
                "node": o.node,
                "devices": list(o.devices),
                "failed_attempts": failed[o.name],
            }
            for o in outcomes.values()
        )
    figures = _figures(scene, pods, outcomes, speedup=speedup, wall=time.monotonic() - start)
    return {
        **figures,
        "pods_planned_by_the_controller": told["MigDraPlanned"],
        "pods_let_go_to_first_fit": told["MigDraFirstFit"],
    }


def _figures(
    scene: Scene,
    pods: tuple[drasim.ClaimPod, ...],
    outcomes: dict[str, Outcome],
    *,
    speedup: float,
    wall: float,
) -> dict[str, Any]:
    end = max(o.arrival for o in outcomes.values()) + LINGER_S * speedup
    pending = sorted(
        (o.running_at * speedup - o.arrival) if o.running_at is not None else (end - o.arrival)
        for o in outcomes.values()
    )

    def pct(q: float) -> float:
        rank = max(1, math.ceil(q / 100.0 * len(pending)))
        return round(pending[min(rank, len(pending)) - 1], 1)

    models = dict(scene.models)
    oversized = sum(
        _oversized(p, outcomes[p.name].devices, models[outcomes[p.name].node or ""])
        for p in pods
        if outcomes[p.name].node in models
    )
    served = [o for o in outcomes.values() if o.running_at is not None]
    return {
        "pods_total": len(pods),
        "pods_served": len(served),
        "pods_by_memory": sum(1 for p in pods if p.by_memory),
        "served_by_memory": sum(1 for p in pods if p.by_memory and outcomes[p.name].running_at),
        "pending_p50_s": pct(50),
        "pending_p95_s": pct(95),
        "prepares_refused": len(scene.refused()),
        "oversized_devices_seen": oversized,
        "wall_seconds": round(wall, 1),
    }


def run(
    names: tuple[str, ...],
    *,
    variants: tuple[str, ...],
    speedup: float,
    pods_limit: int | None,
    requests: bool = True,
    log: Callable[[str], None] = _say,
    outcomes: dict[str, list[dict[str, Any]]] | None = None,
    backoff_s: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The figures of ``variants`` on the traces ``names``. ``backoff_s``: kube-scheduler's
    initial and maximum pod backoff in seconds (``None``: its defaults). ``outcomes``: a dict
    that gets, per ``<trace>/<variant>``, each pod's outcome (:func:`replay`'s ``record``)."""
    cases = {name: (trace, spec) for name, trace, spec in bench_dra._cases(pods_limit)}
    out = []
    for name in names:
        if name not in cases:
            raise SystemExit(f"no trace {name!r}; known: {', '.join(cases)}")
        trace, spec = cases[name]
        cluster = clusters.parse(spec)
        pods, skipped = drasim.claims_from_trace(
            trace, cluster, memory_share=bench_dra.MEMORY_SHARE, seed=bench_dra.SEED
        )
        rows = []
        for variant in variants:
            log(f"{name}: {variant}, {len(pods)} pods on {spec}, speedup {speedup:g}")
            scene = Scene(
                cluster, steered=variant == "steered", requests=requests, backoff_s=backoff_s
            )
            record: list[dict[str, Any]] | None = None
            if outcomes is not None:
                record = outcomes.setdefault(f"{name}/{variant}", [])
            try:
                row = {
                    "variant": variant,
                    **replay(
                        scene, pods, speedup=speedup, requests=requests, log=log, record=record
                    ),
                }
            finally:
                scene.stop()
            log(f"  {row}")
            rows.append(row)
        served = {r["variant"]: r["pods_served"] for r in rows}
        out.append({
            "trace": name,
            "cluster": spec,
            "pods": len(pods),
            "pods_left_out": skipped,
            "runs": rows,
            "steered_minus_uncurated": (
                served["steered"] - served["uncurated"]
                if {"steered", "uncurated"} <= served.keys() else None
            ),
        })  # fmt: skip
    return {
        "command": "python bench/bench_dra_kube.py " + " ".join(sys.argv[1:]),
        "speedup": speedup,
        "requests": requests,
        "scheduler_backoff_s": list(backoff_s) if backoff_s is not None else None,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average_1min_end": round(os.getloadavg()[0], 2),
        "cases": out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--traces", default=",".join(DEFAULT_TRACES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument(
        "--speedup",
        type=float,
        default=25.0,
        help="time compression (default 25: each sequence takes some 12 minutes a variant; at 100 "
        "the control plane's own delays and kube-scheduler's backoff weigh four times more)",
    )
    parser.add_argument("--pods", type=int, default=None, help="first N pods of each trace")
    parser.add_argument(
        "--no-requests",
        action="store_true",
        help="pods without their CPU and memory requests, nodes without the cluster's (every "
        "node then scores alike for kube-scheduler)",
    )
    parser.add_argument(
        "--scheduler-max-backoff",
        type=int,
        default=None,
        metavar="S",
        help="kube-scheduler's podMaxBackoffSeconds (and podInitialBackoffSeconds 1): its "
        "default 10 is 1000 trace seconds at --speedup 100, which reorders its retries "
        "(docs/dra.md, 'The simulator's model and figures'); 1 keeps them in the order they "
        "have at full time",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--outcomes",
        type=Path,
        default=None,
        help="also write each pod's outcome (arrival, bound and running times, node, the "
        "devices its claim was allocated, kube-scheduler's Scheduled time) per trace and "
        "variant to this JSON file, to compare pod by pod with drasim's outcomes",
    )
    args = parser.parse_args()
    variants = tuple(v for v in args.variants.split(",") if v)
    if not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: {', '.join(VARIANTS)}")
    if not args.speedup > 0:
        parser.error("--speedup must be over 0")
    if args.scheduler_max_backoff is not None and args.scheduler_max_backoff < 1:
        parser.error("--scheduler-max-backoff must be at least 1 (kube-scheduler's minimum)")
    outcomes: dict[str, list[dict[str, Any]]] | None = {} if args.outcomes else None
    doc = run(
        tuple(t for t in args.traces.split(",") if t),
        variants=variants,
        speedup=args.speedup,
        requests=not args.no_requests,
        pods_limit=args.pods,
        outcomes=outcomes,
        backoff_s=None if args.scheduler_max_backoff is None else (1, args.scheduler_max_backoff),
    )
    if args.outcomes is not None:
        args.outcomes.write_text(json.dumps(outcomes, indent=1) + "\n", encoding="utf-8")
        _say(f"wrote {args.outcomes}")
    args.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    _say(f"wrote {args.out}")


if __name__ == "__main__":
    main()
