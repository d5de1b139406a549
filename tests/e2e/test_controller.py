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
import pathlib
import signal

import lightkube
import pytest
from lightkube.models.apps_v1 import DeploymentSpec
from lightkube.models.core_v1 import (
    PodSpec,
    PodTemplateSpec,
)
from lightkube.models.meta_v1 import LabelSelector, ObjectMeta
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Node, Pod

from migpilot.api import gpulayouts as gl
from tests.kube import controlplane
from tests.kube.scenes import NODES, WAIT_S, Scene, container
from tests.kube.writes import Writes

pytestmark = pytest.mark.kube

REPO = pathlib.Path(__file__).resolve().parents[2]


def _uuids(layout: gl.GpuLayout | None) -> set[str]:
    if layout is None or layout.status is None:
        return set()
    return {i.uuid for g in layout.status.gpus for i in g.instances if i.uuid}


def test_pods_get_their_instances_and_a_second_wave_repartitions(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    # The agents report their GPUs once the controller made their GpuLayouts.
    scene.wait(scene.reported, "the agents' first status")

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
    replaced = _uuids(scene.layout(freed))
    for name, node in placed.items():
        if node == freed:
            client.delete(Pod, name, namespace=scene.namespace, grace_period=0)
    scene.wait(lambda: not any(v == freed for v in scene.running().values()), f"{freed} emptied")
    template = PodTemplateSpec(
        metadata=ObjectMeta(labels={"app": "infer"}),
        spec=PodSpec(containers=[container("4g.40gb")]),
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

    # Nothing in use was destroyed: the full node kept every instance its pods hold (the same
    # UUIDs in its status), while the freed node's were destroyed for the new profiles.
    assert replaced - _uuids(scene.layout(freed)), "wave 2 needed a repartition"
    told = [
        e.message or ""
        for e in client.list(Event, namespace="default")
        if e.involvedObject.name == freed and e.reason == "MigReconfiguring"
    ]
    assert any("destroy" in m for m in told), told
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
    scene.wait(scene.reported, "the agents' first status")
    scene.start_controller("c2")
    with Writes(scene.plane.kubeconfig, NODES) as writes:
        for i in range(4):
            client.create(scene.pod(f"p{i}", "2g.20gb"))
        scene.wait(lambda: scene.running({f"p{i}" for i in range(4)}), "4 pods Running")
        # Who wrote the GpuLayouts, as the API server has it: c1 only.
        assert writes.by("c1") and writes.leaders() == {"c1"}, writes.all()
        count = len(writes.all())
        # The leader dies mid-wave: the standby takes over and serves every pod once.
        for i in range(4, 8):
            client.create(scene.pod(f"p{i}", "2g.20gb"))
        controlplane.stop_components([scene.controllers["c1"]])
        scene.wait(
            lambda: scene.running({f"p{i}" for i in range(8)}),
            "8 pods Running after the standby took over",
            timeout=WAIT_S,
        )
        after = writes.all()[count:]
        assert after and {w.leader for w in after} <= {"c1", "c2"}, after
        # Once c2 wrote, c1 never wrote again: the writers hand over once, never interleave.
        leaders = [w.leader for w in after]
        assert "c2" in leaders and "c1" not in leaders[leaders.index("c2") :], leaders
        assert writes.alive()
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
    scene.stop_webhook()
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    for i in range(3):
        client.create(scene.pod(f"u{i}", "3g.40gb"))
    got = scene.wait(lambda: scene.running({f"u{i}" for i in range(3)}), "ungated pods Running")
    assert len(got) == 3
    for p in scene.pods():
        assert p.spec is not None and not p.spec.schedulingGates


def test_killing_the_controller_and_an_agent_mid_wave_loses_nothing(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    names = {f"k{i}" for i in range(8)}
    for name in sorted(names):
        client.create(scene.pod(name, "1g.20gb"))
    # Both die mid-wave (SIGKILL: no clean shutdown), then come back.
    scene.agents["ctl-a100"].signal(signal.SIGKILL)
    scene.controllers["c1"].signal(signal.SIGKILL)
    scene.agents["ctl-a100"].process.wait()
    scene.controllers["c1"].process.wait()
    scene.start_agent("ctl-a100", "emulated:a100-80gb:x2")
    scene.start_controller("c1")
    got = scene.wait(lambda: scene.running(names), "every pod Running after the restarts")
    assert set(got) == names
    reserved: dict[str, int] = {}
    for e in client.list(Event, namespace=scene.namespace):
        if e.reason == "MigInstancesReserved":
            name = e.involvedObject.name or ""
            reserved[name] = reserved.get(name, 0) + 1
    assert all(n == 1 for n in reserved.values()), reserved


def test_an_apiserver_restart_mid_wave_loses_nothing(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    names = {f"r{i}" for i in range(6)}
    for name in sorted(names):
        client.create(scene.pod(name, "2g.20gb"))
    scene.plane.restart_apiserver(down_s=2.0)
    got = scene.wait(lambda: scene.running(names), "every pod Running after the restart")
    assert set(got) == names
    reserved: dict[str, int] = {}
    for e in client.list(Event, namespace=scene.namespace):
        if e.reason == "MigInstancesReserved":
            name = e.involvedObject.name or ""
            reserved[name] = reserved.get(name, 0) + 1
    assert all(n == 1 for n in reserved.values()), reserved
    assert scene.controllers["c1"].process.poll() is None, "the controller died"


def test_a_static_node_is_laid_out_from_its_label_and_left_alone_by_the_controller(
    scene: Scene,
) -> None:
    client = scene.client
    config = (
        "version: v1\nmig-configs:\n  all-3g.40gb:\n    - devices: all\n      mig-enabled: true\n"
        '      mig-devices:\n        "3g.40gb": 2\n'
    )
    with contextlib.suppress(lightkube.ApiError):
        client.create(Namespace(metadata=ObjectMeta(name="gpu-operator")))
    client.apply(
        ConfigMap(
            metadata=ObjectMeta(name="default-mig-parted-config", namespace="gpu-operator"),
            data={"config.yaml": config},
        ),
        field_manager="e2e",
    )
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    client.patch(
        Node, "ctl-h100", {"metadata": {"labels": {"nvidia.com/mig.config": "all-3g.40gb"}}}
    )

    def static_layout() -> bool:
        lay = scene.layout("ctl-h100")
        if lay is None or lay.status is None:
            return False
        held = sorted(f"{i.profile}@{i.start}" for g in lay.status.gpus for i in g.instances)
        labels = client.get(Node, "ctl-h100").metadata.labels or {}  # type: ignore[union-attr]
        state = labels.get("nvidia.com/mig.config.state")
        return held == ["3g.40gb@0", "3g.40gb@0", "3g.40gb@4", "3g.40gb@4"] and state == "success"

    scene.wait(static_layout, "the static layout on ctl-h100")
    client.create(scene.pod("small", "1g.10gb"))
    got = scene.wait(lambda: scene.running({"small"}), "the 1g.10gb pod Running")
    assert got["small"] == "ctl-a100"
    assert static_layout(), "the controller changed a static node"
