"""Capacity publishing on the real control plane: ``migpilot agent --node N --kubelet DIR`` as a
real process, its device plugin streaming over real gRPC to the fake kubelet of
tests/integration/kubelet_fake.py, whose ``GetAllocatableResources`` lags behind ListAndWatch
as a device manager may; the Node is a KWOK node of the real kube-apiserver.

Nothing else writes the Node's device-plugin capacity here (the fake kubelet has no node-status
sync), so kube-scheduler binding a pod that asks for a new MIG resource shows the agent's write
(``agent/capacity.py``) is what made it schedulable. "Not before the kubelet lists it" is
checked as a bound that cannot flake: when the test first sees a count on the Node, at least the
kubelet's lag has passed since the list that made it arrived. ``--no-publish-capacity`` is
checked without racing the publisher's thread: the agent says at start, before its first pass,
whether it publishes, and with the flag it does not (and the Node lacks the devices the kubelet
lists once the pass's status is seen).
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightkube
import pytest
from lightkube import codecs
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from tests.integration.kubelet_fake import FakeKubelet
from tests.kube import crds
from tests.kube.agents import AgentProcess
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube

NODE = "capacity-kube-node"
LAG_S = 1.0
"""How long the fake kubelet's GetAllocatableResources lags behind ListAndWatch."""
R1G = "nvidia.com/mig-1g.10gb"
R2G = "nvidia.com/mig-2g.20gb"
R3G = "nvidia.com/mig-3g.40gb"
PUBLISHING = "counts are published as soon as the kubelet lists them"
"""What the agent logs at start when it publishes (before its first pass)."""


class Scene(AgentProcess):
    """The fake kubelet, the agent process and their temp folder (short: unix socket paths)."""

    def __init__(self, plane: ControlPlane, root: pathlib.Path) -> None:
        kubelet = str(root / "k")
        super().__init__(
            plane,
            root,
            node=NODE,
            args=["--backend", "emulated:h100-80gb:x1", "--interval", "5", "--kubelet", kubelet],
        )
        self.kubelet = FakeKubelet(root / "k").start()
        self.kubelet.state.allocatable_delay_s = LAG_S
        self.pods: list[str] = []

    def wait(self, predicate: Callable[[], object], what: str, *, poll_s: float = 0.02) -> None:
        super().wait(predicate, what, poll_s=poll_s)

    # -- the Node, the GpuLayout, pods -----------------------------------------------------
    def capacity(self) -> tuple[dict[str, str], dict[str, str]]:
        status = self.plane.client.get(Node, NODE).status
        if status is None:
            return {}, {}
        return dict(status.capacity or {}), dict(status.allocatable or {})

    def shows(self, counts: dict[str, str]) -> bool:
        """Capacity and allocatable both hold ``counts``."""
        cap, alloc = self.capacity()
        return all(cap.get(k) == v and alloc.get(k) == v for k, v in counts.items())

    def apply_spec(self, instances: tuple[gl.InstanceSpec, ...]) -> None:
        doc = wire.spec_patch(NODE, gl.LayoutSpec((gl.GpuSpec(0, "h100-80gb", instances),)))
        self.plane.client.apply(
            codecs.from_dict(dict(doc)), field_manager=gl.CONTROLLER_FIELD_MANAGER, force=True
        )

    def reported(self, generation: int) -> bool:
        """The agent's status says it reconciled ``generation``."""
        try:
            doc: dict[str, Any] = self.plane.client.get(crds.GpuLayout, NODE).to_dict()
        except lightkube.ApiError as e:
            if e.status.code == 404:
                return False
            raise
        status = wire.parse(doc).status
        if status is None or status.observed_generation != generation:
            return False
        ready = [c for c in status.conditions if c.type == gl.READY]
        return bool(ready) and ready[0].status is gl.ConditionStatus.TRUE

    def create_pod(self, name: str, limits: dict[str, str]) -> None:
        self.pods.append(name)
        self.plane.client.create(
            Pod(
                metadata=ObjectMeta(name=name, namespace="default"),
                spec=PodSpec(
                    nodeSelector={"kubernetes.io/hostname": NODE},
                    containers=[
                        Container(
                            name="c", image="none", resources=ResourceRequirements(limits=limits)
                        )
                    ],
                ),
            )
        )

    def bound(self, name: str) -> bool:
        pod = self.plane.client.get(Pod, name, namespace="default")
        return pod.spec is not None and pod.spec.nodeName == NODE

    # -- the fake kubelet ------------------------------------------------------------------
    def first_list(self, resource: str, size: int) -> float:
        """When the fake kubelet first received a list of ``size`` healthy ``resource``
        devices over ListAndWatch (waits for it)."""

        def arrived() -> float | None:
            with self.kubelet.changed:
                client = self.kubelet.state.clients.get(resource)
                if client is None:
                    return None
                for devices, at in zip(client.lists, client.received, strict=True):
                    if sum(1 for h in devices.values() if h == "Healthy") == size:
                        return at
            return None

        self.wait(lambda: arrived() is not None, f"the kubelet to receive {size} of {resource}")
        at = arrived()
        assert at is not None
        return at


@pytest.fixture
def scene(control_plane: ControlPlane) -> Iterator[Scene]:
    crds.ensure_gpulayouts(control_plane)
    control_plane.add_node(NODE)
    root = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="mpe"))
    s = Scene(control_plane, root)
    yield s
    if s.process is not None:
        s.process.kill()
        s.process.wait()
    s.kubelet.stop()
    client = control_plane.client
    deletes = [(Pod, p, "default") for p in s.pods] + [
        (crds.GpuLayout, NODE, None),
        (Node, NODE, None),
    ]
    for res, name, ns in deletes:
        try:
            client.delete(res, name, namespace=ns, grace_period=0)
        except lightkube.ApiError as e:
            if e.status.code != 404:
                raise
    shutil.rmtree(root, ignore_errors=True)


def _seen_after(scene: Scene, counts: dict[str, str], *, listed_at: float, what: str) -> None:
    """Wait for the Node to show ``counts``; the kubelet's lag has passed since ``listed_at``
    by the time it does (it could not have listed them earlier)."""
    scene.wait(lambda: scene.shows(counts), what)
    seen = time.monotonic()
    assert seen - listed_at >= LAG_S, f"{what}: on the Node before the kubelet listed them"


def test_new_devices_reach_the_node_once_the_kubelet_lists_them_and_pods_bind(
    scene: Scene,
) -> None:
    others_before = {k: v for k, v in scene.capacity()[0].items() if "nvidia.com/" not in k}
    assert others_before, "a KWOK node has cpu, memory and pods"
    scene.apply_spec((gl.InstanceSpec("1g.10gb", 0), gl.InstanceSpec("3g.40gb", 4)))
    scene.start()

    listed = scene.first_list(R1G, 1)
    _seen_after(scene, {R1G: "1", R3G: "1"}, listed_at=listed, what="the first counts")
    scene.create_pod("capacity-a", {R1G: "1"})
    scene.wait(lambda: scene.bound("capacity-a"), "kube-scheduler to bind capacity-a")

    # A reconfiguration: the 3g.40gb gives way to two 2g.20gb; a pod already waits for them.
    scene.create_pod("capacity-b", {R2G: "2"})
    scene.apply_spec(
        (
            gl.InstanceSpec("1g.10gb", 0),
            gl.InstanceSpec("2g.20gb", 2),
            gl.InstanceSpec("2g.20gb", 4),
        )
    )
    listed = scene.first_list(R2G, 2)
    _seen_after(scene, {R1G: "1", R2G: "2", R3G: "0"}, listed_at=listed, what="the new counts")
    scene.wait(lambda: scene.bound("capacity-b"), "kube-scheduler to bind capacity-b")

    # Only the MIG resources were written: cpu, memory and pods are the KWOK node's own.
    cap, alloc = scene.capacity()
    assert {k: v for k, v in cap.items() if "nvidia.com/" not in k} == others_before
    assert {k: v for k, v in alloc.items() if k in others_before} == others_before
    assert PUBLISHING in scene.log_text()
    assert scene.stop() == 0


def test_no_publish_capacity_leaves_the_node_to_the_kubelet(scene: Scene) -> None:
    scene.kubelet.state.allocatable_delay_s = 0.0
    scene.apply_spec((gl.InstanceSpec("1g.10gb", 0),))
    scene.start("--no-publish-capacity")
    scene.first_list(R1G, 1)
    scene.wait(lambda: scene.reported(1), "the agent's status of generation 1")
    # The kubelet lists the device and the agent is done with that pass: no count was written.
    cap, alloc = scene.capacity()
    assert R1G not in cap and R1G not in alloc
    assert PUBLISHING not in scene.log_text()
    assert scene.stop() == 0
