"""The whole system on a real control plane: webhook, controller, agents, kube-scheduler, KWOK.

Two KWOK nodes with emulated GPUs (one with two A100-80GB, one with two H100-80GB), one
``migpilot agent`` process per node (``--kubelet simulated``), ``migpilot webhook`` registered
with the real apiserver, and ``migpilot controller``. Pods ask for MIG profiles; the webhook
gates them, the controller plans and reserves, the agents create the instances, the controller
pins and ungates, kube-scheduler binds and KWOK runs them. Every wait has a generous timeout and
no sleep decides a pass.
"""

from __future__ import annotations

import contextlib
import http.client
import pathlib
import re
import ssl
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import lightkube
import pytest
from lightkube import codecs
from lightkube.models.apps_v1 import DeploymentSpec
from lightkube.models.core_v1 import (
    Container,
    PodSpec,
    PodTemplateSpec,
    ResourceRequirements,
)
from lightkube.models.meta_v1 import LabelSelector, ObjectMeta
from lightkube.resources.admissionregistration_v1 import MutatingWebhookConfiguration
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod

from migpilot.api import gpulayouts as gl
from migpilot.webhook import registering
from tests.kube import certs, controlplane, crds
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube

REPO = pathlib.Path(__file__).resolve().parents[2]
WAIT_S = 120.0
NODES = {"ctl-a100": "a100-80gb", "ctl-h100": "h100-80gb"}


@dataclass
class Scene:
    """The processes of one test and the names it made."""

    plane: ControlPlane
    root: pathlib.Path
    namespace: str
    lease_ns: str
    agents: dict[str, controlplane.Component] = field(default_factory=dict)
    controllers: dict[str, controlplane.Component] = field(default_factory=dict)
    webhook: controlplane.Component | None = None

    @property
    def client(self) -> lightkube.Client:
        return self.plane.client

    def components(self) -> list[controlplane.Component]:
        out = [*self.agents.values(), *self.controllers.values()]
        return [*out, self.webhook] if self.webhook is not None else out

    def start_agent(self, node: str) -> None:
        self.agents[node] = controlplane.launch(
            f"agent-{node}",
            [
                sys.executable,
                "-m",
                "migpilot",
                "agent",
                "--node",
                node,
                "--kubeconfig",
                str(self.plane.kubeconfig),
                "--backend",
                f"emulated:{NODES[node]}:x2",
                "--state-file",
                str(self.root / f"{node}.json"),
                "--kubelet",
                "simulated",
                "--interval",
                "5",
                "--metrics-port",
                "0",
            ],  # fmt: skip
            log=self.root / f"agent-{node}.log",
            cwd=REPO,
        )

    def start_controller(self, identity: str) -> None:
        self.controllers[identity] = controlplane.launch(
            f"controller-{identity}",
            [
                sys.executable,
                "-m",
                "migpilot",
                "controller",
                "--verbose",
                "--kubeconfig",
                str(self.plane.kubeconfig),
                "--identity",
                identity,
                "--lease-namespace",
                self.lease_ns,
                "--metrics-port",
                "0",
            ],  # fmt: skip
            log=self.root / f"controller-{identity}.log",
            cwd=REPO,
        )

    def stop(self, component: controlplane.Component) -> None:
        controlplane.stop_components([component])

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got = predicate()
            if got:
                return got
            for c in self.components():
                if c.process.poll() is not None and not getattr(c, "stopped", False):
                    pass
            if time.monotonic() > deadline:
                logs = "\n".join(
                    f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                    for p in sorted(self.root.glob("*.log"))
                )
                raise AssertionError(f"timed out waiting for {what}\n{self.dump()}\n{logs}")
            time.sleep(0.1)

    def dump(self) -> str:
        """The GpuLayouts and the pods, for a failure's message."""
        lines = []
        for node in NODES:
            lay = self.layout(node)
            if lay is None:
                continue
            for g in lay.spec.gpus:
                insts = " ".join(
                    f"{i.profile}@{i.start}" + (f"->{i.reserved_for}" if i.reserved_for else "")
                    for i in g.instances
                )
                lines.append(f"{node} spec gpu {g.index}: {insts}")
            for gs in lay.status.gpus if lay.status else ():
                insts = " ".join(f"{i.profile}@{i.start}:{i.state}" for i in gs.instances)
                lines.append(f"{node} status gpu {gs.index}: {insts}")
        for p in self.pods():
            assert p.metadata is not None and p.spec is not None and p.status is not None
            gates = [g.name for g in p.spec.schedulingGates or []]
            lines.append(f"pod {p.metadata.name}: {p.status.phase} {p.spec.nodeName} {gates}")
        return "\n".join(lines)

    def pod(self, name: str, profile: str, count: int = 1) -> Pod:
        return Pod(
            metadata=ObjectMeta(name=name, namespace=self.namespace),
            spec=PodSpec(containers=[_container(profile, count)]),
        )

    def pods(self) -> list[Pod]:
        return list(self.client.list(Pod, namespace=self.namespace))

    def running(self, names: set[str] | None = None) -> dict[str, str]:
        """Pod name -> node, of the pods Running (all of ``names`` or nothing)."""
        out = {}
        for p in self.pods():
            assert p.metadata is not None and p.status is not None and p.spec is not None
            name = p.metadata.name or ""
            if p.status.phase == "Running" and p.spec.nodeName:
                out[name] = p.spec.nodeName
        if names is not None and not names <= set(out):
            return {}
        return out

    def layout(self, node: str) -> gl.GpuLayout | None:
        try:
            return gl.parse(self.client.get(crds.GpuLayout, node).to_dict())
        except lightkube.ApiError:
            return None


def _container(profile: str, count: int = 1) -> Container:
    limits = {f"nvidia.com/mig-{profile}": str(count)}
    return Container(name="c", image="none", resources=ResourceRequirements(limits=limits))


def _healthy(port: int, ca: pathlib.Path) -> bool:
    conn = http.client.HTTPSConnection(
        "127.0.0.1", port, context=ssl.create_default_context(cafile=ca), timeout=2
    )
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().read() == b"ok"
    except OSError:
        return False
    finally:
        conn.close()


@pytest.fixture
def scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[Scene]:
    client = control_plane.client
    crds.ensure_gpulayouts(control_plane)
    suffix = uuid.uuid4().hex[:6]
    s = Scene(control_plane, tmp_path, f"mig-{suffix}", f"migpilot-{suffix}")
    config_name = f"migpilot-e2e-{suffix}"
    client.create(Namespace(metadata=ObjectMeta(name=s.namespace)))
    client.create(Namespace(metadata=ObjectMeta(name=s.lease_ns)))
    ca = certs.CertificateAuthority(tmp_path)
    pair = ca.issue("webhook", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    [port] = controlplane.free_ports(1)
    try:
        s.webhook = controlplane.launch(
            "migpilot-webhook",
            [
                sys.executable,
                "-m",
                "migpilot",
                "webhook",
                "--cert",
                str(pair.cert),
                "--key",
                str(pair.key),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kubeconfig",
                str(control_plane.kubeconfig),
                "--lease-namespace",
                s.lease_ns,
            ],  # fmt: skip
            log=tmp_path / "webhook.log",
            cwd=REPO,
        )
        controlplane.wait_for(
            lambda: _healthy(port, ca.pair.cert), what="the webhook", watch=[s.webhook]
        )
        document = registering.configuration(
            ca_bundle=ca.pair.cert.read_bytes(),
            url=f"https://127.0.0.1:{port}/mutate-pods",
            name=config_name,
        )
        client.create(codecs.from_dict(document))
        for node in NODES:
            control_plane.add_node(node)
            s.start_agent(node)
        yield s
    finally:
        controlplane.stop_components(s.components())
        with contextlib.suppress(lightkube.ApiError):
            client.delete(MutatingWebhookConfiguration, config_name)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Deployment, "infer", namespace=s.namespace)
        for p in s.pods():
            with contextlib.suppress(lightkube.ApiError):
                assert p.metadata is not None
                client.delete(Pod, p.metadata.name or "", namespace=s.namespace, grace_period=0)
        for node in NODES:
            for res in (crds.GpuLayout, Node):
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(res, node)
        for ns in (s.namespace, s.lease_ns):
            with contextlib.suppress(lightkube.ApiError):
                client.delete(Namespace, ns)


_DESTROY = re.compile(r"GPU (\d+): destroy (\S+) \((MIG-[^)]+)\)")


def _destroyed(scene: Scene, node: str) -> set[str]:
    """UUIDs of the instances the node's agent destroyed (from its action log)."""
    text = (scene.root / f"agent-{node}.log").read_text(errors="replace")
    return {m.group(3) for m in _DESTROY.finditer(text)}


def _uuids(layout: gl.GpuLayout | None) -> set[str]:
    if layout is None or layout.status is None:
        return set()
    return {i.uuid for g in layout.status.gpus for i in g.instances if i.uuid}


def test_pods_get_their_instances_and_a_second_wave_repartitions(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    # The agents report their GPUs once the controller made their GpuLayouts.
    scene.wait(
        lambda: all((lay := scene.layout(n)) is not None and lay.status for n in NODES),
        "the agents' first status",
    )

    # Wave 1: 28 pods of 1g.10gb fill all four GPUs.
    names = {f"small-{i:02d}" for i in range(28)}
    for name in sorted(names):
        client.create(scene.pod(name, "1g.10gb"))
    gated = [
        p
        for p in scene.pods()
        if p.metadata is not None and (p.metadata.labels or {}).get("migpilot.io/gated")
    ]
    assert gated, "the webhook gated no pod"
    placed = scene.wait(lambda: scene.running(names), "28 pods Running")
    per_node = {n: sum(1 for v in placed.values() if v == n) for n in NODES}
    assert per_node == {"ctl-a100": 14, "ctl-h100": 14}

    # Wave 2: free one node, then ask for profiles only a repartition of it can give: a
    # Deployment of two 4g.40gb and two pods of 3g.40gb (one node's two GPUs, exactly).
    full, freed = "ctl-h100", "ctl-a100"
    kept = _uuids(scene.layout(full))
    for name, node in placed.items():
        if node == freed:
            client.delete(Pod, name, namespace=scene.namespace, grace_period=0)
    scene.wait(lambda: not any(v == freed for v in scene.running().values()), f"{freed} emptied")
    template = PodTemplateSpec(
        metadata=ObjectMeta(labels={"app": "infer"}),
        spec=PodSpec(containers=[_container("4g.40gb")]),
    )
    client.create(
        Deployment(
            metadata=ObjectMeta(name="infer", namespace=scene.namespace),
            spec=DeploymentSpec(
                replicas=2, selector=LabelSelector(matchLabels={"app": "infer"}), template=template
            ),
        )
    )
    mids = {"mid-0", "mid-1"}
    for name in sorted(mids):
        client.create(scene.pod(name, "3g.40gb"))

    def wave2() -> dict[str, str]:
        r = scene.running()
        infer = [n for n in r if n.startswith("infer-")]
        return r if len(infer) == 2 and mids <= set(r) else {}

    got = scene.wait(wave2, "wave 2 Running")
    assert {node for name, node in got.items() if not name.startswith("small-")} == {freed}

    # Nothing in use was destroyed: the full node kept every instance its pods hold.
    assert _destroyed(scene, freed), "wave 2 needed a repartition"
    assert not _destroyed(scene, full) & kept
    assert kept <= _uuids(scene.layout(full))
    # Reservations are released once the pods are bound.
    lay = scene.wait(
        lambda: (
            (x := scene.layout(freed))
            and not any(i.reserved_for for g in x.spec.gpus for i in g.instances)
            and x
        ),
        "reservations released",
    )
    assert lay is not None


def test_unknown_profile_gets_a_warning_and_is_not_kept_gated(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    client.create(scene.pod("typo", "1g.5gb"))  # an A100-40GB profile: no GPU here has it

    def warned() -> str | None:
        for e in client.list(Event, namespace=scene.namespace):
            obj = e.involvedObject
            if obj.name == "typo" and e.type == "Warning":
                return e.message
        return None

    message = scene.wait(warned, "a Warning event on the pod")
    assert "nvidia.com/mig-1g.5gb" in message

    def ungated() -> bool:
        p = client.get(Pod, "typo", namespace=scene.namespace)
        return p.spec is not None and not p.spec.schedulingGates

    scene.wait(ungated, "the gate removed")


def test_two_controllers_never_both_act_and_a_standby_takes_over(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(
        lambda: all((lay := scene.layout(n)) is not None and lay.status for n in NODES),
        "the agents' first status",
    )
    scene.start_controller("c2")
    for i in range(4):
        client.create(scene.pod(f"p{i}", "2g.20gb"))
    scene.wait(lambda: scene.running({f"p{i}" for i in range(4)}), "4 pods Running")
    logs = {
        ident: (scene.root / f"controller-{ident}.log").read_text(errors="replace")
        for ident in ("c1", "c2")
    }
    holding = [ident for ident, text in logs.items() if "holding the Lease" in text]
    assert holding == ["c1"], logs
    # The leader dies mid-wave: the standby takes over and serves every pod once.
    for i in range(4, 8):
        client.create(scene.pod(f"p{i}", "2g.20gb"))
    scene.stop(scene.controllers["c1"])
    scene.wait(
        lambda: scene.running({f"p{i}" for i in range(8)}),
        "8 pods Running after the standby took over",
        timeout=WAIT_S,
    )
    text = (scene.root / "controller-c2.log").read_text(errors="replace")
    assert "holding the Lease" in text
    # Planned once: each pod got one reservation event.
    reserved: dict[str, int] = {}
    for e in client.list(Event, namespace=scene.namespace):
        if e.reason == "MigInstancesReserved":
            name = e.involvedObject.name or ""
            reserved[name] = reserved.get(name, 0) + 1
    assert all(n == 1 for n in reserved.values()), reserved


def test_pods_are_served_with_the_webhook_down(scene: Scene) -> None:
    client = scene.client
    assert scene.webhook is not None
    scene.stop(scene.webhook)
    scene.webhook = None
    scene.start_controller("c1")
    scene.wait(
        lambda: all((lay := scene.layout(n)) is not None and lay.status for n in NODES),
        "the agents' first status",
    )
    for i in range(3):
        client.create(scene.pod(f"u{i}", "3g.40gb"))
    got = scene.wait(lambda: scene.running({f"u{i}" for i in range(3)}), "ungated pods Running")
    assert len(got) == 3
    for p in scene.pods():
        assert p.spec is not None and not p.spec.schedulingGates
