"""DRA publishing on the real control plane (v1.37.2): the pool migpilot publishes for a KWOK
node, written through the agent's own lightkube adapter, is accepted by kube-apiserver's
validation (a schema mistake would be a 422), is left alone when nothing changed (the server
adds nothing that reads as a change), and kube-scheduler allocates claims from it only as its
counters allow: never a placement overlapping an instance used by someone else, never two
overlapping placements. The DeviceClass and the example ResourceClaimTemplates of deploy/dra/ are
the ones the claims use.

KWOK runs the pods; nothing prepares the claims here (that is the kubelet plugin's part).
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.models.core_v1 import (
    Container,
    PodResourceClaim,
    PodSpec,
    ResourceRequirements,
)
from lightkube.models.core_v1 import (
    ResourceClaim as ContainerClaim,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice

from migpilot.agent.cluster import kube as agent_kube
from migpilot.agent.cluster import resourceslices
from migpilot.agent.dra import publishing
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.mig import catalog
from tests.integration.kubelet_fake import FakeKubelet
from tests.kube import crds
from tests.kube.agents import AgentProcess
from tests.kube.controlplane import ControlPlane, wait_for

pytestmark = pytest.mark.kube

REPO = Path(__file__).resolve().parents[2]
DRA = REPO / "deploy" / "dra"
A100 = catalog.resolve_gpu("a100-80gb")


@dataclass
class Scene:
    plane: ControlPlane
    node: str
    namespace: str
    publisher: resourceslices.SlicePublisher

    def slices(self) -> list[ResourceSlice]:
        found = self.plane.client.list(
            ResourceSlice, fields={"spec.nodeName": self.node, "spec.driver": publishing.DRIVER}
        )
        return sorted(found, key=lambda s: s.metadata.name if s.metadata else "")

    def pod(self, name: str, template: str) -> None:
        self.plane.client.create(
            Pod(
                metadata=ObjectMeta(name=name, namespace=self.namespace),
                spec=PodSpec(
                    nodeSelector={"kubernetes.io/hostname": self.node},
                    containers=[
                        Container(
                            name="app",
                            image="app",
                            resources=ResourceRequirements(claims=[ContainerClaim(name="mig")]),
                        )
                    ],
                    resourceClaims=[
                        PodResourceClaim(name="mig", resourceClaimTemplateName=template)
                    ],
                ),
            )
        )

    def allocated(self, pod: str) -> str | None:
        """The device the pod's claim was allocated (``None``: not yet)."""
        got = self.plane.client.get(Pod, pod, namespace=self.namespace)
        statuses = (got.status.resourceClaimStatuses if got.status else None) or []
        names = [s.resourceClaimName for s in statuses if s.resourceClaimName]
        if not names:
            return None
        claim = self.plane.client.get(ResourceClaim, names[0], namespace=self.namespace)
        allocation = claim.status.allocation if claim.status else None
        if allocation is None or allocation.devices is None:
            return None
        (result,) = allocation.devices.results or []
        assert (result.driver, result.pool) == (publishing.DRIVER, self.node)
        return str(result.device)

    def unschedulable(self, pod: str) -> bool:
        got = self.plane.client.get(Pod, pod, namespace=self.namespace)
        conditions = (got.status.conditions if got.status else None) or []
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in conditions
        )


def _apply_deploy_dra(client: lightkube.Client, namespace: str) -> list[Any]:
    """The DeviceClass (unless there already is one) and the example templates."""
    made: list[Any] = []
    for path in sorted(DRA.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if doc["kind"] == "DeviceClass":
                with contextlib.suppress(lightkube.ApiError):
                    client.get(DeviceClass, doc["metadata"]["name"])
                    continue  # applied by another test: left to it
            else:
                doc["metadata"]["namespace"] = namespace
            obj = codecs.from_dict(doc)
            client.create(obj)
            made.append(obj)
    return made


@pytest.fixture
def scene(control_plane: ControlPlane) -> Iterator[Scene]:
    client = control_plane.client
    suffix = uuid.uuid4().hex[:6]
    node, namespace = f"dra-{suffix}", f"dra-{suffix}"
    api = agent_kube.connect(control_plane.kubeconfig)
    made: list[Any] = []
    try:
        control_plane.add_node(node, labels={"migpilot.io/mode": "dra"})
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        made = _apply_deploy_dra(client, namespace)
        yield Scene(
            control_plane, node, namespace, resourceslices.SlicePublisher(api.slices(), node=node)
        )
    finally:
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)
        for obj in made:
            if obj.kind == "DeviceClass":
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(DeviceClass, obj.metadata.name)
        for found in client.list(ResourceSlice, fields={"spec.nodeName": node}):
            with contextlib.suppress(lightkube.ApiError):
                client.delete(ResourceSlice, found.metadata.name)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Node, node)
        api.close()


def _gpu(index: int, *, mig: bool = True) -> publishing.Gpu:
    return publishing.Gpu(index, f"GPU-{uuid.uuid4()}", A100, mig, 81920)


def test_the_apiserver_takes_the_pool_and_each_write_keeps_it_whole(scene: Scene) -> None:
    gpus = tuple(_gpu(i) for i in range(8))  # 200 devices: 1 counter slice + 4 device slices
    first = scene.publisher.publish(gpus, ())
    assert first is not None and first.generation == 0 and len(first.create) == 5
    stored = scene.slices()
    assert len(stored) == 5
    assert {(s.spec.pool.generation, s.spec.pool.resourceSliceCount) for s in stored} == {(0, 5)}
    assert sum(len(s.spec.devices or []) for s in stored) == 8 * 25
    # What the server stored reads back as what was sent: no rewrite while nothing changes.
    again = scene.publisher.publish(gpus, ())
    assert again is not None and again.nothing
    # An instance used by someone else: its GPU's counters change, one slice, in place.
    used = publishing.Instance(3, "3g.40gb", 4, "MIG-used", publishing.Use.OTHER)
    one = scene.publisher.publish(gpus, (used,))
    assert one is not None and one.generation == 0 and len(one.update) == 1
    # Fewer GPUs, one with MIG off: the next generation, the stale slices deleted.
    small = scene.publisher.publish((gpus[0], _gpu(1, mig=False)), ())
    assert small is not None and small.generation == 1 and len(small.delete) == 3
    stored = scene.slices()
    assert {(s.spec.pool.generation, s.spec.pool.resourceSliceCount) for s in stored} == {(1, 2)}
    assert scene.publisher.publish((gpus[0], _gpu(1, mig=False)), ()) is not None


def test_kube_scheduler_allocates_only_what_the_counters_leave(scene: Scene) -> None:
    """One A100 80GB with a 3g.40gb at slot 4 used by someone else: a claim for 20Gi gets the
    3g.40gb at 0 (the smallest profile that holds it, the one at 4 taken), and the next one
    finds nothing: every placement with 20Gi overlaps one of the two."""
    used = publishing.Instance(0, "3g.40gb", 4, "MIG-used", publishing.Use.OTHER)
    assert scene.publisher.publish((_gpu(0),), (used,)) is not None
    scene.pod("first", "mig-20gi")
    device = wait_for(
        lambda: scene.allocated("first"), what="the first claim to be allocated", timeout=60
    )
    assert device == "gpu-0-mig-3g-40gb-0"
    scene.pod("second", "mig-20gi")
    wait_for(lambda: scene.unschedulable("second"), what="the second pod to wait", timeout=60)
    assert scene.allocated("second") is None
    # Nor does a 1g.10gb: slots 0-3 are the first claim's, 4-7 the used instance's.
    scene.pod("third", "mig-1g-10gb")
    wait_for(lambda: scene.unschedulable("third"), what="the third pod to wait", timeout=60)


def test_a_real_agent_on_a_node_labelled_dra_publishes_its_pool(
    scene: Scene, tmp_path: Path
) -> None:
    """``migpilot agent`` on the DRA node (emulated A100 80GB, MIG on, its GpuLayout asking a
    3g.40gb at 4): its slices appear, the instance it made is offered (nobody uses it), and the
    agent says it serves no device plugin."""
    plane, node = scene.plane, scene.node
    crds.ensure_gpulayouts(plane)
    spec = gl.LayoutSpec((gl.GpuSpec(0, "a100-80gb", (gl.InstanceSpec("3g.40gb", 4),)),))
    plane.client.apply(
        codecs.from_dict(dict(wire.spec_patch(node, spec))),
        field_manager=gl.CONTROLLER_FIELD_MANAGER,
        force=True,
    )
    # DRA mode serves the kubelet plugin, so it needs a kubelet folder: a fake kubelet's, whose
    # PodResources (an in-use source; unanswered, nothing would be offered) lists no pods.
    # A short folder: a unix socket's path has at most 107 bytes, pytest's tmp_path is long.
    folder = Path(tempfile.mkdtemp(prefix="mpdra-"))
    kubelet = FakeKubelet(folder).start()
    (tmp_path / "proc").mkdir()
    agent = AgentProcess(
        plane,
        tmp_path,
        node=node,
        args=[
            "--backend", "emulated:a100-80gb:x1", "--kubelet", str(folder),
            "--proc-root", str(tmp_path / "proc"), "--cdi-spec-dir", str(tmp_path / "cdi"),
            "--interval", "2",
        ],
    )  # fmt: skip
    agent.start()
    try:

        def offered() -> bool:
            """Two slices, the instance's memory slices offered (a pass may first count a
            just-created instance as the GpuLayout's, until its status says it is free)."""
            found = [s.to_dict() for s in scene.slices()]
            if len(found) != 2 or "sharedCounters" not in found[0]["spec"]:
                return False
            (gpu0,) = found[0]["spec"]["sharedCounters"]
            return bool(gpu0["counters"]["memory-slice-4"] == {"value": "1"})

        agent.wait(offered, "the agent's two slices, its instance offered")
        devices = scene.slices()[1]
        assert devices.spec is not None and len(devices.spec.devices or []) == 25
        assert "DRA mode" in agent.log_text()
        # It reports as any agent does: a pass writes its slices first, then the GpuLayout's status.
        agent.wait(
            lambda: plane.client.get(crds.GpuLayout, node).status is not None,
            "the agent's GpuLayout status",
        )
        plugin = folder / "plugins_registry" / f"{publishing.DRIVER}-reg.sock"
        assert plugin.is_socket()  # and the DRA kubelet plugin waits for the kubelet
    finally:
        agent.stop()
        kubelet.stop()
        shutil.rmtree(folder, ignore_errors=True)
        with contextlib.suppress(lightkube.ApiError):
            plane.client.delete(crds.GpuLayout, node)
