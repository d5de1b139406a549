"""The HPA-on-GPU-utilisation scenario of issue 23 (docs/autoscaling.md), on the real control
plane. The e2e test (tests/e2e/test_gpu_hpa.py) asserts it and the benchmark
(bench/bench_autoscaling.py, section ``hpa``) times it: one scenario, so the figures come from
the code the test checks.

The scene (:func:`staged`): one KWOK node with one emulated H100-80GB, run by ``migpilot
fleet`` with an ``--emulated-load`` file sampled every half second; the webhook and the
controller; a real Prometheus scraping them every half second; KEDA's operator and adapter; and
kube-controller-manager's HPA controller, which syncs every second on the test control plane
(``controlplane.HPA_SYNC_PERIOD``). Two Deployments (:data:`WORKLOADS`), each with a ScaledObject
(:func:`scaled_object`) whose Prometheus trigger sums the per-pod series
``migpilot_device_utilization_ratio`` of that Deployment's pods, ``metricType: AverageValue``
with a threshold of 0.8: the HPA KEDA makes wants ``ceil(sum / 0.8)`` replicas, each replica at
80 % on average. The load file holds every replica of a Deployment at one utilisation (a
``ns/web-mig-*`` pattern), so at 0.9 each sync adds replicas until the maximum, and at 0.1 one
sync takes it back to one.

Why one GPU: the last step checks that a larger instance is carved from the room the scale-in
freed. With another GPU untouched, the planner would rightly make it there. On one H100 (seven
compute slices, eight memory slots), with three replicas of each Deployment at the peak, six
1g.10gb instances fill six of the seven slots; the two first replicas are kept by the scale-in
(``controller.kubernetes.io/pod-deletion-cost``, so which pods go is no coin toss of the
ReplicaSet's ranking); and a 4g.40gb (memory slots 0-3, its only placement) then fits only where
freed 1g.10gb instances stand. :func:`grow_large` checks that premise from the GpuLayout before
it asks, and that the instance made overlaps the freed ones, which the agent destroyed.

Steps, each a function that waits for what it caused, checks it (an ``AssertionError`` naming
what is wrong, with the layout, the pods, the HPAs and the logs) and returns what it measured:
:func:`start_workloads`, :func:`scale_out`, :func:`scale_in`, :func:`grow_large`.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import lightkube
from lightkube import codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.core_v1 import Namespace, Pod
from lightkube.types import PatchType

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.mig import catalog, layouts
from tests.kube import autoscalers, controlplane, crds, tools
from tests.kube import prometheus as prom
from tests.kube.system import System

T = TypeVar("T")

ScaledObject = create_namespaced_resource("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects")

MODEL = "h100-80gb"
GPUS = f"{MODEL}.x1"
"""The node's emulated GPUs (the fleet's ``migpilot.io/emulated-gpus`` label)."""
TARGET = 0.8
"""The utilisation each replica is held at: the trigger's threshold."""
HIGH, LOW = 0.9, 0.1
"""The loads of the scale-out and of the scale-in (and of the start)."""
MEMORY_MIB = 2000
"""The memory each replica's device reports as used (any value: nothing scales on it)."""
MAX_REPLICAS = 3
"""Each Deployment's maximum: two Deployments of three 1g.10gb replicas fill six of the seven
compute slices of the H100."""
PROFILE = "1g.10gb"
"""The instance each replica gets (MIG pods ask for it; 8000 MiB is one on an H100-80GB)."""
LARGE = "4g.40gb"
"""The larger instance asked for after the scale-in."""
SAMPLE_S = 0.5
"""Seconds between two readings of the GPUs' use (the fleet) and two scrapes (Prometheus)."""
WAIT_S = 180.0
"""The longest wait of one step; generous, the machine may be busy."""
UTILIZATION = "migpilot_device_utilization_ratio"
MEMORY_USED = "migpilot_device_memory_used_bytes"
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
GATED_LABEL = "migpilot.io/gated"


@dataclass(frozen=True)
class Workload:
    """One Deployment of the scenario and how its pods ask for a GPU."""

    name: str
    kind: str
    """``mig`` (a ``nvidia.com/mig-*`` resource) or ``hami`` (HAMi's ``nvidia.com/gpu`` with
    ``nvidia.com/gpumem``), as the figures name it."""
    limits: Mapping[str, str]


WORKLOADS = (
    Workload("web-mig", "mig", {f"nvidia.com/mig-{PROFILE}": "1"}),
    Workload("web-hami", "hami", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}),
)


# --- manifests (pure) ------------------------------------------------------------------------


def query(workload: Workload, *, namespace: str) -> str:
    """The trigger's PromQL: the utilisation summed over the Deployment's pods (its pods are
    ``<name>-<hash>-<suffix>``; the other Deployment's names do not match)."""
    return f'sum({UTILIZATION}{{namespace="{namespace}", pod=~"{workload.name}-.+"}})'


def deployment(workload: Workload, *, namespace: str, node: str) -> dict[str, Any]:
    """The Deployment, one replica, its pods on ``node`` (the scene's only GPUs)."""
    labels = {"app": workload.name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": workload.name, "namespace": namespace},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"kubernetes.io/hostname": node},
                    "containers": [
                        {
                            "name": "main",
                            "image": "registry.invalid/inference",
                            "resources": {"limits": dict(workload.limits)},
                        }
                    ],
                },
            },
        },
    }


def scaled_object(
    workload: Workload, *, namespace: str, prometheus_url: str, max_replicas: int = MAX_REPLICAS
) -> dict[str, Any]:
    """KEDA's ScaledObject for the Deployment: the seed's HPA (a Pods metric
    ``gpu_utilization``, target 80 %) as a Prometheus trigger, and a behaviour that lets the
    HPA move as soon as the metric does (no stabilisation window, any step in a second)."""
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": workload.name, "namespace": namespace},
        "spec": {
            "scaleTargetRef": {"name": workload.name},
            "minReplicaCount": 1,
            "maxReplicaCount": max_replicas,
            "pollingInterval": 1,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {
                        "scaleUp": {
                            "stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 4, "periodSeconds": 1}],
                        },
                        "scaleDown": {
                            "stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Percent", "value": 100, "periodSeconds": 1}],
                        },
                    }
                }
            },
            "triggers": [
                {
                    "type": "prometheus",
                    "metricType": "AverageValue",
                    "metadata": {
                        "serverAddress": prometheus_url,
                        "query": query(workload, namespace=namespace),
                        "threshold": str(TARGET),
                    },
                }
            ],
        },
    }


def load_text(utilization: float, *, namespace: str) -> str:
    """The ``--emulated-load`` file: every replica of each Deployment at ``utilization``."""
    return "".join(
        f'"{namespace}/{w.name}-*": {{utilization: {utilization}, memoryUsedMiB: {MEMORY_MIB}}}\n'
        for w in WORKLOADS
    )


def slots(profile: str, start: int) -> frozenset[int]:
    """The H100-80GB memory slots an instance occupies."""
    geometry = layouts.geometry(catalog.resolve_gpu(MODEL))
    mask = geometry.placement(layouts.Instance(start, profile)).mask
    return frozenset(i for i in range(mask.bit_length()) if mask >> i & 1)


def starts(profile: str) -> tuple[int, ...]:
    """The starts NVIDIA allows a profile on an H100-80GB."""
    model = catalog.resolve_gpu(MODEL)
    return next(p.placements for p in model.profiles if p.name == profile)


# --- what the steps find ---------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """A pod and the instance it holds, as the GpuLayout status and the pod's series say."""

    pod: str
    gpu: int
    start: int
    profile: str
    uuid: str


@dataclass(frozen=True)
class Started:
    """The first replica of each Deployment, Running on its instance, and the HPAs reading."""

    held: Mapping[str, Held]
    """Workload name -> its first replica's instance."""
    seconds: float
    """From the first Deployment's creation to both HPAs reading their metric."""


@dataclass(frozen=True)
class ScaleOut:
    seconds: Mapping[str, float]
    """Workload name -> seconds from the load change to all its new replicas Running."""
    first_seconds: Mapping[str, float]
    """Workload name -> seconds from the load change to its first new replica Running (the
    HPA's first step: each replica holds the load, so it takes one step per replica added
    while ``ceil(n x 0.9 / 0.8)`` exceeds ``n``)."""
    replicas: Mapping[str, int]
    held: Mapping[str, tuple[Held, ...]]
    """Workload name -> its new replicas' instances (each made for it)."""
    created: int
    """Instances the GPU has now that it had not before the load change."""


@dataclass(frozen=True)
class ScaleIn:
    seconds: Mapping[str, float]
    """Workload name -> seconds from the load drop to its removed replicas gone."""
    freed_seconds: float
    """From the load drop to every removed replica's instance reported ``free``."""
    freed: tuple[Held, ...]
    """The removed replicas' instances, now free (``pod``: who held them)."""
    free_series: float
    """``migpilot_instances{state="free"}`` summed over the node, once it counts them."""
    free_gauge: float
    """The controller's ``migpilot_free_instances{profile=1g.10gb}``, once it counts them."""


@dataclass(frozen=True)
class Large:
    held: Held
    seconds: float
    """From the pod's creation to Running."""
    room: tuple[int, ...]
    """The starts where the larger instance could go beside the instances in use."""
    reused: tuple[Held, ...]
    """The freed instances destroyed to make it (within its slots)."""


# --- the scene -------------------------------------------------------------------------------


@dataclass
class Stage:
    """The running scene of one scenario; :func:`staged` makes and ends it."""

    system: System
    namespace: str
    node: str
    load_file: Path
    prometheus: prom.Prometheus
    keda: autoscalers.Keda

    @property
    def client(self) -> lightkube.Client:
        return self.system.client

    def components(self) -> list[controlplane.Component]:
        out = [*self.system.components(), *self.keda.components]
        return out + ([self.prometheus.component] if self.prometheus.component else [])

    def set_load(self, utilization: float) -> None:
        """Write the load file (atomically: the fleet never reads half a file)."""
        tmp = self.load_file.with_suffix(".tmp")
        tmp.write_text(load_text(utilization, namespace=self.namespace), encoding="utf-8")
        tmp.replace(self.load_file)

    def wait(self, probe: Callable[[], T | None], *, what: str, timeout: float = WAIT_S) -> T:
        """Call ``probe`` every 0.1 s (a fixed period: the steps time these waits) until it
        returns something true; fail if a process of the scene exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            for c in self.components():
                if c.process.poll() is not None:
                    raise AssertionError(
                        f"{c.name} exited waiting for {what}\n{c.tail()}\n{self.dump()}"
                    )
            got = probe()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what}\n{self.dump()}"
                )
            time.sleep(0.1)

    # --- reading -------------------------------------------------------------------------

    def layout(self) -> gl.GpuLayout | None:
        try:
            return wire.parse(self.client.get(crds.GpuLayout, self.node).to_dict())
        except lightkube.ApiError:
            return None

    def instances(self) -> dict[str, tuple[int, gl.InstanceStatus]]:
        """MIG UUID -> (GPU index, instance) of the node's status."""
        lay = self.layout()
        if lay is None or lay.status is None:
            return {}
        return {
            i.uuid: (g.index, i) for g in lay.status.gpus for i in g.instances if i.uuid is not None
        }

    def pods(self, workload: Workload | None = None) -> list[Pod]:
        labels = {"app": workload.name} if workload is not None else None
        return list(self.client.list(Pod, namespace=self.namespace, labels=labels))

    def devices(self) -> dict[str, str]:
        """Pod name -> the MIG UUID its device series names (every pod holding an instance)."""
        got = self.prometheus.query(f'{MEMORY_USED}{{namespace="{self.namespace}"}}')
        return {s["pod"]: s["device"] for s in got}

    def held(self, names: Sequence[str]) -> dict[str, Held] | None:
        """Each pod of ``names`` and its instance, once every one has a device series naming
        an instance of the node's status in state ``used``; else None."""
        devices, instances = self.devices(), self.instances()
        out = {}
        for name in names:
            found = instances.get(devices.get(name, ""))
            if found is None or found[1].state is not gl.InstanceState.USED:
                return None
            gpu, inst = found
            out[name] = Held(name, gpu, inst.start, inst.profile, inst.uuid or "")
        return out

    def dump(self) -> str:
        """The layout, the pods, the HPAs and the processes' logs, for a failure's message."""
        lines = []
        with contextlib.suppress(lightkube.ApiError, OSError):
            lay = self.layout()
            for g in lay.spec.gpus if lay is not None else ():
                insts = " ".join(
                    f"{i.profile}@{i.start}" + (f"->{i.reserved_for}" if i.reserved_for else "")
                    for i in g.instances
                )
                lines.append(f"spec gpu {g.index}: {insts}")
            for gs in lay.status.gpus if lay is not None and lay.status is not None else ():
                insts = " ".join(
                    f"{i.profile}@{i.start}:{i.state.value}:{(i.uuid or '')[-6:]}"
                    for i in gs.instances
                )
                lines.append(f"status gpu {gs.index}: {insts}")
            for p in self.pods():
                assert p.metadata is not None and p.spec is not None and p.status is not None
                gates = [g.name for g in p.spec.schedulingGates or []]
                gone = " terminating" if p.metadata.deletionTimestamp else ""
                lines.append(
                    f"pod {p.metadata.name}: {p.status.phase} {p.spec.nodeName} {gates}{gone}"
                )
            for hpa in self.client.list(HorizontalPodAutoscaler, namespace=self.namespace):
                assert hpa.metadata is not None
                status = hpa.status.to_dict() if hpa.status is not None else {}
                lines.append(f"hpa {hpa.metadata.name}: {status}")
        return "\n".join(lines) + f"\n{self.system.logs()}{self.keda.tails()}"


@contextlib.contextmanager
def staged(plane: controlplane.ControlPlane, root: Path) -> Iterator[Stage]:
    """The scene on ``plane``, its files under ``root``; everything it made is removed after
    (ScaledObjects first, while KEDA's operator can still drop their finalizer)."""
    found = tools.locate()
    system = System(plane, root, metrics=True)
    suffix = system.lease_ns.rsplit("-", 1)[-1]
    namespace, node = f"hpa-{suffix}", f"hpa-h100-{suffix}"
    load = root / "load.yaml"
    load.write_text("", encoding="utf-8")
    client = plane.client
    stack = contextlib.ExitStack()
    try:
        system.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        system.start_webhook()
        system.add_fleet_node(node, GPUS)
        system.start_fleet("--emulated-load", str(load), "--gpu-metrics-interval", str(SAMPLE_S))
        system.start_controller("hpa", verbose=False)
        prometheus = stack.enter_context(
            prom.Prometheus.start(
                found.prometheus,
                root / "prometheus",
                prom.targets_of(system),
                interval_s=SAMPLE_S,
            )
        )
        keda = stack.enter_context(
            autoscalers.Keda.start(
                plane,
                operator=found.keda_operator,
                adapter=found.keda_adapter,
                crds=found.keda_crds,
                root=root / "keda",
            )
        )
        stage = Stage(system, namespace, node, load, prometheus, keda)
        stage.set_load(LOW)
        yield stage
    finally:
        with contextlib.suppress(lightkube.ApiError):
            for so in client.list(ScaledObject, namespace=namespace):
                assert so.metadata is not None
                client.delete(ScaledObject, so.metadata.name or "", namespace=namespace)
        with contextlib.suppress(lightkube.ApiError, controlplane.ControlPlaneError):
            controlplane.wait_for(
                lambda: not list(client.list(ScaledObject, namespace=namespace)),
                what="the ScaledObjects to go",
                timeout=60,
            )
        for w in WORKLOADS:
            with contextlib.suppress(lightkube.ApiError):
                client.delete(Deployment, w.name, namespace=namespace)
        with contextlib.suppress(lightkube.ApiError):
            for p in client.list(Pod, namespace=namespace):
                assert p.metadata is not None
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(Pod, p.metadata.name or "", namespace=namespace, grace_period=0)
        stack.close()  # KEDA (its APIService first), then Prometheus
        system.stop()
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)


# --- the steps -------------------------------------------------------------------------------


def _name(pod: Pod) -> str:
    assert pod.metadata is not None
    return pod.metadata.name or ""


def _running(pods: Sequence[Pod], node: str) -> bool:
    return all(
        p.status is not None
        and p.status.phase == "Running"
        and p.spec is not None
        and p.spec.nodeName == node
        and (p.metadata is None or p.metadata.deletionTimestamp is None)
        for p in pods
    )


def _hpa_reads(stage: Stage, workload: Workload) -> bool:
    """The HPA KEDA made for the workload has read its metric at least once."""
    try:
        hpa = stage.client.get(
            HorizontalPodAutoscaler, f"keda-hpa-{workload.name}", namespace=stage.namespace
        )
    except lightkube.ApiError:
        return False
    return bool(hpa.status is not None and hpa.status.currentMetrics)


def start_workloads(stage: Stage) -> Started:
    """Each Deployment with one replica, one after the other (so their instances go where the
    planner puts the first ones on an empty GPU, the top slots), then their ScaledObjects; waits
    until each first replica runs on its instance and both HPAs read their metric. The first
    replicas get a pod-deletion cost: the scale-in keeps them."""
    client, began = stage.client, time.monotonic()
    held: dict[str, Held] = {}
    for w in WORKLOADS:
        client.create(codecs.from_dict(deployment(w, namespace=stage.namespace, node=stage.node)))
        pod = stage.wait(
            lambda w=w: (
                (pods := stage.pods(w)) and len(pods) == 1 and _running(pods, stage.node) and pods
            ),
            what=f"{w.name}'s first replica Running",
        )[0]
        name = _name(pod)
        held[w.name] = stage.wait(
            lambda name=name: stage.held([name]), what=f"{name}'s instance and series"
        )[name]
        client.patch(
            Pod,
            name,
            {"metadata": {"annotations": {DELETION_COST: "1000"}}},
            namespace=stage.namespace,
            patch_type=PatchType.MERGE,
        )
    for w in WORKLOADS:
        document = scaled_object(w, namespace=stage.namespace, prometheus_url=stage.prometheus.url)
        client.create(codecs.from_dict(document))
    for w in WORKLOADS:
        stage.wait(lambda w=w: _hpa_reads(stage, w), what=f"keda-hpa-{w.name} to read its metric")
    return Started(held=held, seconds=time.monotonic() - began)


def scale_out(stage: Stage, started: Started) -> ScaleOut:
    """Load 0.9: each Deployment grows to its maximum. Timed from the load file's change to
    the moment all of a Deployment's replicas are Running; then every new replica must hold an
    instance made after the change (migpilot served it: gated by the webhook, instance made,
    pinned, bound) and the first replicas their own, untouched."""
    before = set(stage.instances())
    seconds: dict[str, float] = {}
    first_seconds: dict[str, float] = {}
    t0 = time.monotonic()
    stage.set_load(HIGH)

    def grown() -> bool:
        for w in WORKLOADS:
            if w.name in seconds:
                continue
            pods = stage.pods(w)
            running = [p for p in pods if _running([p], stage.node)]
            if len(running) > 1:
                first_seconds.setdefault(w.name, time.monotonic() - t0)
            if len(pods) == MAX_REPLICAS and len(running) == MAX_REPLICAS:
                seconds[w.name] = time.monotonic() - t0
        return len(seconds) == len(WORKLOADS)

    stage.wait(grown, what=f"each Deployment at {MAX_REPLICAS} replicas, all Running")
    names = {w.name: sorted(_name(p) for p in stage.pods(w)) for w in WORKLOADS}
    every = [n for ns in names.values() for n in ns]
    held = stage.wait(lambda: stage.held(every), what="every replica's instance and series")
    new: dict[str, tuple[Held, ...]] = {}
    for w in WORKLOADS:
        first = started.held[w.name]
        assert held[first.pod] == first, f"{first.pod} moved: {held[first.pod]} (was {first})"
        new[w.name] = tuple(held[n] for n in names[w.name] if n != first.pod)
        assert len(new[w.name]) == MAX_REPLICAS - 1, (w.name, names[w.name], first)
        for h in new[w.name]:
            assert h.profile == PROFILE, f"{h.pod} holds a {h.profile}, not a {PROFILE}"
            assert h.uuid not in before, f"{h.pod}'s instance {h.uuid} existed before the load"
            meta = stage.client.get(Pod, h.pod, namespace=stage.namespace).metadata
            labels = (meta.labels if meta is not None else None) or {}
            assert labels.get(GATED_LABEL) == "true", f"{h.pod} was not gated: {labels}"
    assert len({h.uuid for h in held.values()}) == len(held), f"an instance held twice: {held}"
    created = len(set(stage.instances()) - before)
    replicas = {}
    for w in WORKLOADS:
        spec = stage.client.get(Deployment, w.name, namespace=stage.namespace).spec
        replicas[w.name] = spec.replicas if spec is not None and spec.replicas else 0
    return ScaleOut(
        seconds=seconds, first_seconds=first_seconds, replicas=replicas, held=new, created=created
    )


def scale_in(stage: Stage, started: Started, out: ScaleOut) -> ScaleIn:
    """Load 0.1: each Deployment goes back to one replica, the first one (its deletion cost).
    Timed from the load file's change to the removed replicas gone, and to their instances
    reported ``free`` (the same instances: same UUIDs and places); then the free instances must
    show in the agent's ``migpilot_instances`` and the controller's ``migpilot_free_instances``,
    and the first replicas still hold theirs."""
    seconds: dict[str, float] = {}
    removed = {h.uuid: h for hs in out.held.values() for h in hs}
    t0 = time.monotonic()
    stage.set_load(LOW)

    def shrunk() -> bool:
        for w in WORKLOADS:
            if w.name not in seconds and [_name(p) for p in stage.pods(w)] == [
                started.held[w.name].pod
            ]:
                seconds[w.name] = time.monotonic() - t0
        return len(seconds) == len(WORKLOADS)

    stage.wait(shrunk, what="each Deployment back to its first replica")

    def freed() -> dict[str, tuple[int, gl.InstanceStatus]] | None:
        now = stage.instances()
        ok = all(
            u in now and now[u][1].state is gl.InstanceState.FREE and now[u][1].start == h.start
            for u, h in removed.items()
        )
        return now if ok else None

    now = stage.wait(freed, what=f"the removed replicas' {len(removed)} instances free")
    freed_seconds = time.monotonic() - t0
    for w in WORKLOADS:
        first = started.held[w.name]
        assert first.uuid in now, f"{first.pod}'s instance is gone"
        assert now[first.uuid][1].state is gl.InstanceState.USED, (first, now[first.uuid])
    free_now = sum(1 for _, i in now.values() if i.state is gl.InstanceState.FREE)
    series = f'sum(migpilot_instances{{node="{stage.node}", state="free"}})'
    free_series = stage.prometheus.wait(
        series,
        lambda got: got and got[0].value == free_now,
        what=f"migpilot_instances to count {free_now} free",
    )[0].value
    gauge = f'sum(migpilot_free_instances{{profile="{PROFILE}"}})'
    free_gauge = stage.prometheus.wait(
        gauge,
        lambda got: got and got[0].value == free_now,
        what=f"migpilot_free_instances to count {free_now} free {PROFILE}",
    )[0].value
    return ScaleIn(
        seconds=seconds,
        freed_seconds=freed_seconds,
        freed=tuple(sorted(removed.values(), key=lambda h: h.start)),
        free_series=free_series,
        free_gauge=free_gauge,
    )


def _large_pod(stage: Stage, name: str) -> Pod:
    limits = {f"nvidia.com/mig-{LARGE}": "1"}
    return codecs.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": stage.namespace},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": stage.node},
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.invalid/training",
                        "resources": {"limits": limits},
                    }
                ],
            },
        }
    )


def grow_large(stage: Stage, started: Started, freed: ScaleIn) -> Large:
    """A pod asking a 4g.40gb after the scale-in. The premise, from the layout: the instance
    has room beside the instances in use, and every such place holds freed instances (no
    untouched room). Then the pod must run on a 4g.40gb whose slots overlap freed instances,
    those destroyed, the first replicas' untouched."""
    instances = stage.instances()
    used = [i for _, i in instances.values() if i.state is not gl.InstanceState.FREE]
    taken = frozenset().union(*(slots(i.profile, i.start) for i in used))
    room = tuple(s for s in starts(LARGE) if not slots(LARGE, s) & taken)
    freed_slots = frozenset().union(*(slots(h.profile, h.start) for h in freed.freed))
    if not room:
        raise AssertionError(
            f"premise: no room for a {LARGE} beside the instances in use at "
            f"{sorted(i.start for i in used)}\n{stage.dump()}"
        )
    untouched = [s for s in room if not slots(LARGE, s) & freed_slots]
    if untouched:
        raise AssertionError(
            f"premise: a {LARGE} fits at {untouched} without the freed instances\n{stage.dump()}"
        )
    name = f"large-{uuid.uuid4().hex[:4]}"
    t0 = time.monotonic()
    stage.client.create(_large_pod(stage, name))
    stage.wait(
        lambda: _running([stage.client.get(Pod, name, namespace=stage.namespace)], stage.node),
        what=f"{name} ({LARGE}) Running",
    )
    seconds = time.monotonic() - t0
    held = stage.wait(lambda: stage.held([name]), what=f"{name}'s instance and series")[name]
    assert held.profile == LARGE, f"{name} holds a {held.profile}"
    assert held.start in room, f"{name}'s {LARGE} at {held.start}, not in {room}"
    mine = slots(LARGE, held.start)
    reused = tuple(h for h in freed.freed if slots(h.profile, h.start) & mine)
    assert reused, f"{name}'s {LARGE} at {held.start} overlaps none of {freed.freed}"
    now = stage.instances()
    kept = [h.uuid for h in reused if h.uuid in now]
    assert not kept, f"freed instances {kept} within the {LARGE}'s slots still listed"
    for first in started.held.values():
        assert first.uuid in now and now[first.uuid][1].state is gl.InstanceState.USED, first
    return Large(held=held, seconds=seconds, room=room, reused=reused)
