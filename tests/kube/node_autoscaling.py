"""Issue 23's node-autoscaling scenario on the real control plane, for the e2e test and the
benchmark alike (``tests/e2e/test_node_autoscaling.py``; the ``node`` section of
``bench/bench_autoscaling.py``).

Two KWOK nodes of two H100-80GB each, full: every GPU holds a ``7g.80gb`` instance a Running
pod uses. The webhook, ``migpilot controller --node-autoscaling`` and ``migpilot fleet`` (the
simulated agents of every node labelled ``migpilot.io/emulated-gpus``, new ones included) run
as in the other e2e scenes. Then Karpenter's KWOK provider, with one 8-GPU H100 instance type,
the NodeOverlay ``migpilot autoscaling overlay`` prints for it (``NodeOverlay=true``), and a
NodePool whose nodes carry the fleet's label and the startup taint
``migpilot.io/agent-not-ready:NoSchedule``, consolidating empty nodes after a few seconds.

A burst of MIG pods no existing node can hold: migpilot ungates them (no pin), kube-scheduler
marks them Unschedulable, Karpenter adds one node; the fleet joins it (zeroing the instance
type's fake MIG counts), reports it and removes the startup taint; the controller plans the
pods onto it, the agent makes the instances and kube-scheduler binds the pods. Then the pods
are deleted and Karpenter consolidates the empty node away. :class:`Figures` records the
seconds from the burst to the new node and to every pod Running, and from the deletion to the
node gone. Nothing here decides a test by timing.
"""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightkube
from lightkube import codecs
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod
from prometheus_client.parser import text_string_to_metric_families

from migpilot.agent.cluster import startup
from migpilot.mig import catalog
from migpilot.planning import overlays
from tests.kube import autoscalers, system, tools
from tests.kube.controlplane import ControlPlane

H100 = catalog.resolve_gpu("h100-80gb")
GPUS = 8
INSTANCE_TYPE = autoscalers.InstanceType(
    name="gpu-h100-8x",
    resources={"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": str(GPUS)},
)
FULL_NODES = {"nas-a": "h100-80gb.x2", "nas-b": "h100-80gb.x2"}
"""The nodes there are before the burst, each full (one 7g.80gb pod a GPU)."""
FILL_PROFILE = "7g.80gb"
BURST_PROFILE = "3g.40gb"
BURST_PODS = 8
"""Eight 3g.40gb instances: four GPUs' worth, so one 8-GPU node holds them all."""
STARTUP_TAINT = {"key": startup.TAINT_KEY, "effect": startup.TAINT_EFFECT}
WAIT_S = 240.0


@dataclass
class Figures:
    """Seconds, measured by this client polling every 0.1 s (so to about 0.1 s)."""

    burst_to_node_s: float = 0.0
    """From the first burst pod's create call to a Node of the pool existing."""
    burst_to_node_ready_s: float = 0.0
    """... to the new Node registered by Karpenter, Ready (KWOK's condition) and without the
    startup taint (its agent removed it: the GPUs are reported, the resources published)."""
    burst_to_pods_running_s: float = 0.0
    """... to every burst pod Running."""
    delete_to_node_gone_s: float = 0.0
    """From deleting the burst pods to the pool's last Node and NodeClaim gone."""
    nodes_added: int = 0
    """Nodes the pool had, at most, before the scale-down."""
    pods: int = BURST_PODS
    unmet_demand_seen: float = 0.0
    """The most ``migpilot_unmet_demand{profile=BURST_PROFILE}`` the controller served while
    the new node was on its way (the instances a new node would have to hold)."""
    unmet_demand_after: float | None = None
    """... once every burst pod runs (``None``: the series is gone)."""
    scaled_out: float = 0.0
    """``migpilot_pods_scaled_out_total`` once every burst pod runs."""


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


@dataclass
class Scenario:
    """The processes and objects of one run (see the module): :meth:`start`, :meth:`fill`,
    :meth:`burst`, :meth:`scale_down`, then :meth:`stop` (always)."""

    plane: ControlPlane
    root: Path
    controller_args: tuple[str, ...] = ("--node-autoscaling", "--scale-out-after", "2")
    consolidate_after: str = "5s"
    webhook: bool = True
    """Without the webhook no pod is gated: they reach Karpenter through kube-scheduler alone,
    and the controller plans them by its fallback (ungated Unschedulable pods)."""
    system: system.System = field(init=False)
    karpenter: autoscalers.Karpenter | None = None
    namespace: str = ""
    pool: str = ""
    overlay: str = ""
    figures: Figures = field(default_factory=Figures)

    def __post_init__(self) -> None:
        self.system = system.System(self.plane, self.root, metrics=True)
        suffix = self.system.lease_ns.rsplit("-", 1)[-1]
        self.namespace, self.pool = f"nas-{suffix}", f"gpu-{suffix}"
        self.overlay = f"migpilot-h100-x8-{suffix}"

    @property
    def client(self) -> lightkube.Client:
        return self.plane.client

    # -- waiting -------------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        """Until ``predicate()`` is truthy (every 0.1 s); fails with the logs on a timeout or
        when one of the processes exited."""
        deadline = time.monotonic() + timeout
        while not (got := predicate()):
            for c in self.components():
                if c.process.poll() is not None:
                    raise AssertionError(f"{c.name} exited waiting for {what}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.dump()}\n{self.logs()}")
            time.sleep(0.1)
        return got

    def components(self) -> list[Any]:
        extra = [self.karpenter.component] if self.karpenter and self.karpenter.component else []
        return [*self.system.components(), *extra]

    def logs(self) -> str:
        text = self.system.logs()
        if self.karpenter is not None:
            text += f"\n--- karpenter\n{self.karpenter.tail()}"
        return text

    def dump(self) -> str:
        lines = []
        for n in self.client.list(Node):
            assert n.metadata is not None
            taints = [t.key for t in (n.spec.taints if n.spec and n.spec.taints else [])]
            allocatable = {
                k: v
                for k, v in ((n.status.allocatable if n.status else None) or {}).items()
                if k.startswith("nvidia.com/mig-")
            }
            lines.append(f"node {n.metadata.name}: taints {taints} {allocatable}")
        for p in self.client.list(Pod, namespace=self.namespace):
            assert p.metadata is not None and p.spec is not None and p.status is not None
            gates = [g.name for g in p.spec.schedulingGates or []]
            lines.append(f"pod {p.metadata.name}: {p.status.phase} {p.spec.nodeName} {gates}")
        return "\n".join(lines)

    # -- reading -------------------------------------------------------------------------------
    def running(self, prefix: str) -> dict[str, str]:
        """Pod name -> node of the Running pods named ``prefix...``."""
        out = {}
        for p in self.client.list(Pod, namespace=self.namespace):
            assert p.metadata is not None and p.status is not None and p.spec is not None
            name = p.metadata.name or ""
            if name.startswith(prefix) and p.status.phase == "Running" and p.spec.nodeName:
                out[name] = p.spec.nodeName
        return out

    def gated(self) -> list[str]:
        """The pods still carrying a scheduling gate."""
        return [
            p.metadata.name or ""
            for p in self.client.list(Pod, namespace=self.namespace)
            if p.metadata is not None and p.spec is not None and p.spec.schedulingGates
        ]

    def event_reasons(self, prefix: str) -> dict[str, list[str]]:
        """Pod name -> the reasons of its Events (one per Event, counts ignored), for the
        pods named ``prefix...``."""
        out: dict[str, list[str]] = {}
        for e in self.client.list(Event, namespace=self.namespace):
            name = e.involvedObject.name or ""
            if e.involvedObject.kind == "Pod" and name.startswith(prefix):
                out.setdefault(name, []).append(e.reason or "")
        return out

    def controller_metric(self, name: str, **labels: str) -> float | None:
        """One sample of the controller's ``/metrics`` (``None``: no such series)."""
        port = self.system.metrics_ports["controller-c1"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return None

    def _unmet(self) -> float | None:
        return self.controller_metric("migpilot_unmet_demand", profile=BURST_PROFILE)

    def pool_nodes(self) -> list[Node]:
        return list(self.client.list(Node, labels={"karpenter.sh/nodepool": self.pool}))

    def pool_claims(self) -> list[Any]:
        selector = {"karpenter.sh/nodepool": self.pool}
        return list(self.client.list(autoscalers.NodeClaim, labels=selector))

    # -- the run -------------------------------------------------------------------------------
    def start(self) -> None:
        """Everything but Karpenter: the CRD, the namespace, the webhook, the two nodes, the
        fleet and the controller."""
        s = self.system
        s.prepare()
        self.client.create(Namespace(metadata=ObjectMeta(name=self.namespace)))
        if self.webhook:
            s.start_webhook()
        for node, gpus in FULL_NODES.items():
            s.add_fleet_node(node, gpus)
        s.start_fleet()
        s.start_controller("c1", *self.controller_args)

    def fill(self) -> None:
        """One Running 7g.80gb pod on every GPU of the two nodes."""
        count = sum(int(g.rsplit(".x", 1)[1]) for g in FULL_NODES.values())
        for i in range(count):
            self.client.create(_pod(f"fill-{i}", self.namespace, FILL_PROFILE))
        self.wait(
            lambda: len(self.running("fill-")) == count, f"{count} {FILL_PROFILE} pods Running"
        )

    def start_karpenter(self) -> None:
        """Karpenter's KWOK provider with the 8-GPU type, the overlay and the NodePool, Ready."""
        found = tools.locate()
        self.karpenter = autoscalers.Karpenter.start(
            self.plane,
            binary=found.karpenter,
            crds=found.karpenter_crds,
            root=self.root / "karpenter",
            instance_types=[INSTANCE_TYPE],
            env={"FEATURE_GATES": "NodeOverlay=true"},
        )
        with contextlib.suppress(lightkube.ApiError):  # another test may have made it
            self.client.create(autoscalers.node_class())
        requirements = overlays.parse_requirements(
            [f"node.kubernetes.io/instance-type={INSTANCE_TYPE.name}"]
        )
        doc = overlays.node_overlay(H100, GPUS, requirements=requirements, name=self.overlay)
        self.client.create(codecs.from_dict(doc))
        self.client.create(
            autoscalers.node_pool(
                self.pool,
                instance_types=[INSTANCE_TYPE.name],
                consolidate_after=self.consolidate_after,
                labels={system.FLEET_LABEL: f"h100-80gb.x{GPUS}"},
                startup_taints=[STARTUP_TAINT],
            )
        )

        def ready() -> bool:
            overlay = self.client.get(autoscalers.NodeOverlay, self.overlay)
            pool = self.client.get(autoscalers.NodePool, self.pool)
            return (
                autoscalers.condition(overlay, "Ready") == "True"
                and autoscalers.condition(pool, "Ready") == "True"
            )

        self.wait(ready, "the NodeOverlay and the NodePool to be Ready", timeout=90)

    def burst(self) -> Figures:
        """Create the burst; wait for the new node and for every pod Running."""
        f = self.figures
        began = time.monotonic()
        for i in range(BURST_PODS):
            self.client.create(_pod(f"burst-{i}", self.namespace, BURST_PROFILE))

        def node_there() -> bool:
            f.nodes_added = max(f.nodes_added, len(self.pool_nodes()))
            f.unmet_demand_seen = max(f.unmet_demand_seen, self._unmet() or 0.0)
            return f.nodes_added > 0

        self.wait(node_there, "Karpenter to add a node")
        f.burst_to_node_s = round(time.monotonic() - began, 2)

        def node_ready() -> bool:
            nodes = self.pool_nodes()
            f.nodes_added = max(f.nodes_added, len(nodes))
            return any(_registered(n) and _ready(n) and not _has_startup_taint(n) for n in nodes)

        self.wait(node_ready, "the new node registered, Ready and without the startup taint")
        f.burst_to_node_ready_s = round(time.monotonic() - began, 2)

        def all_running() -> bool:
            f.nodes_added = max(f.nodes_added, len(self.pool_nodes()))
            return len(self.running("burst-")) == BURST_PODS

        self.wait(all_running, f"{BURST_PODS} {BURST_PROFILE} pods Running")
        f.burst_to_pods_running_s = round(time.monotonic() - began, 2)
        f.unmet_demand_after = self._unmet()
        f.scaled_out = self.controller_metric("migpilot_pods_scaled_out_total") or 0.0
        return f

    def scale_down(self) -> Figures:
        """Delete the burst's pods; wait until Karpenter has consolidated the node away."""
        f = self.figures
        began = time.monotonic()
        for i in range(BURST_PODS):
            with contextlib.suppress(lightkube.ApiError):
                self.client.delete(Pod, f"burst-{i}", namespace=self.namespace, grace_period=0)
        self.wait(
            lambda: not self.pool_nodes() and not self.pool_claims(),
            "Karpenter to consolidate the empty node away",
        )
        f.delete_to_node_gone_s = round(time.monotonic() - began, 2)
        return f

    def stop(self) -> None:
        """Delete what the run made (the pool's nodes while Karpenter still runs: their
        finalizers need it), stop every process."""
        client = self.client
        for p in client.list(Pod, namespace=self.namespace):
            with contextlib.suppress(lightkube.ApiError):
                assert p.metadata is not None
                client.delete(Pod, p.metadata.name or "", namespace=self.namespace, grace_period=0)
        if self.karpenter is not None:
            with contextlib.suppress(lightkube.ApiError):
                client.delete(autoscalers.NodePool, self.pool)
            for claim in self.pool_claims():
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(autoscalers.NodeClaim, claim.metadata.name)
            with contextlib.suppress(AssertionError):
                self.wait(
                    lambda: not self.pool_nodes() and not self.pool_claims(),
                    "the pool's nodes to go",
                    timeout=120,
                )
            with contextlib.suppress(lightkube.ApiError):
                client.delete(autoscalers.NodeOverlay, self.overlay)
            self.karpenter.stop()
        self.system.stop()
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, self.namespace)


def _registered(node: Node) -> bool:
    """Karpenter registered the Node: it swapped its ``karpenter.sh/unregistered`` taint for
    the NodePool's startup taint (one patch), so from now on that taint's absence means the
    agent removed it."""
    labels = (node.metadata.labels if node.metadata else None) or {}
    return labels.get("karpenter.sh/registered") == "true"


def _ready(node: Node) -> bool:
    conditions = (node.status.conditions if node.status else None) or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _has_startup_taint(node: Node) -> bool:
    taints = (node.spec.taints if node.spec else None) or []
    return any(t.key == startup.TAINT_KEY and t.effect == startup.TAINT_EFFECT for t in taints)
