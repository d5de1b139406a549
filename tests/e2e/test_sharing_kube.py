"""GPU sharing on a real control plane: ``migpilot agent --device-plugin-configs`` on a KWOK node.

The agent serves NVIDIA's named device-plugin configs (a folder, as NVIDIA's config-manager
mounts its ConfigMap); the Node's ``nvidia.com/device-plugin.config`` label picks one. With
time-slicing at four replicas the node advertises four ``nvidia.com/gpu`` per GPU and eight
pods asking one each are bound by kube-scheduler and Running; relabelled to MPS at two replicas,
the same agent (never restarted) advertises two per GPU, labels the strategy, and runs the MPS
daemons (emulated beside emulated GPUs); a label naming no config keeps the last good one with
the sharing state ``failed``.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator

import lightkube
import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType

from tests.kube import crds
from tests.kube.agents import AgentProcess
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube

NODE = "sharing-node"
NAMESPACE = "default"
CONFIGS = {
    "ts4": "version: v1\nflags: {migStrategy: none}\n"
    "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}\n",
    "mps2": "version: v1\nflags: {migStrategy: none}\n"
    "sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n",
}


class Scene(AgentProcess):
    def __init__(self, plane: ControlPlane, root: pathlib.Path) -> None:
        folder = root / "configs"
        folder.mkdir()
        for name, text in CONFIGS.items():
            (folder / name).write_text(text)
        super().__init__(
            plane,
            root,
            node=NODE,
            args=[
                "--backend", "emulated:h100-80gb:x2:mig-off",
                "--kubelet", "simulated", "--interval", "5", "--metrics-port", "0",
                "--strategy", "none",
                "--device-plugin-configs", str(folder), "--device-plugin-config-default", "ts4",
                "--mps-root", str(root / "mps"),
            ],
        )  # fmt: skip

    def wait(self, predicate: Callable[[], object], what: str, *, poll_s: float = 0.1) -> None:
        super().wait(predicate, what, poll_s=poll_s)

    def node(self) -> Node:
        return self.plane.client.get(Node, NODE)

    def allocatable(self, resource: str) -> str | None:
        status = self.node().status
        return (status.allocatable or {}).get(resource) if status is not None else None

    def labels(self) -> dict[str, str]:
        meta = self.node().metadata
        return dict(meta.labels or {}) if meta is not None else {}

    def label(self, value: str) -> None:
        patch = {"metadata": {"labels": {"nvidia.com/device-plugin.config": value}}}
        self.plane.client.patch(Node, NODE, patch, patch_type=PatchType.MERGE)

    def running(self, names: set[str]) -> bool:
        pods = self.plane.client.list(Pod, namespace=NAMESPACE)
        return names <= {
            p.metadata.name
            for p in pods
            if p.metadata is not None
            and p.status is not None
            and p.status.phase == "Running"
            and p.spec is not None
            and p.spec.nodeName == NODE
        }


@pytest.fixture
def scene(control_plane: ControlPlane) -> Iterator[Scene]:
    crds.ensure_gpulayouts(control_plane)
    control_plane.add_node(NODE)
    root = pathlib.Path(tempfile.mkdtemp(prefix="mps"))
    s = Scene(control_plane, root)
    yield s
    if s.process is not None:
        s.process.kill()
        s.process.wait()
    client = control_plane.client
    for p in client.list(Pod, namespace=NAMESPACE):
        if p.metadata is not None and (p.metadata.name or "").startswith("share-"):
            client.delete(Pod, p.metadata.name or "", namespace=NAMESPACE, grace_period=0)
    for res, name in ((crds.GpuLayout, NODE), (Node, NODE)):
        try:
            client.delete(res, name)
        except lightkube.ApiError as e:
            if e.status.code != 404:
                raise
    shutil.rmtree(root, ignore_errors=True)


def _pod(name: str) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=NAMESPACE),
        spec=PodSpec(
            nodeSelector={"kubernetes.io/hostname": NODE},
            tolerations=[{"operator": "Exists"}],  # type: ignore[list-item]
            containers=[
                Container(
                    name="c",
                    image="none",
                    resources=ResourceRequirements(limits={"nvidia.com/gpu": "1"}),
                )
            ],
        ),
    )


def test_the_node_label_picks_the_sharing_config_and_switching_it_restarts_nothing(
    scene: Scene,
) -> None:
    scene.start()
    scene.wait(lambda: scene.allocatable("nvidia.com/gpu") == "8", "8 time-sliced replicas")
    # The Node's capacity and its labels are two writes: wait for the labels too.
    scene.wait(lambda: "nvidia.com/gpu.replicas" in scene.labels(), "the sharing labels")
    labels = scene.labels()
    assert labels["nvidia.com/gpu.replicas"] == "4"
    assert labels["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert labels["migpilot.io/sharing.state"] == "success"
    names = {f"share-{i}" for i in range(8)}
    for name in sorted(names):
        scene.plane.client.create(_pod(name))
    scene.wait(lambda: scene.running(names), "eight pods sharing two GPUs Running")
    for name in sorted(names):
        scene.plane.client.delete(Pod, name, namespace=NAMESPACE, grace_period=0)

    pid = scene.process.pid if scene.process is not None else None
    scene.label("mps2")
    scene.wait(lambda: scene.allocatable("nvidia.com/gpu") == "4", "4 MPS replicas")
    scene.wait(
        lambda: scene.labels().get("nvidia.com/gpu.sharing-strategy") == "mps", "the mps label"
    )
    scene.wait(
        lambda: scene.labels().get("migpilot.io/sharing.state") == "success",
        "the MPS daemon running",
    )
    assert scene.labels()["nvidia.com/gpu.replicas"] == "2"
    pipe = scene.root / "mps" / "nvidia.com" / "gpu" / "pipe"
    assert pipe.is_dir(), scene.log_text()
    assert scene.process is not None and scene.process.pid == pid  # never restarted

    scene.label("no-such-config")
    scene.wait(
        lambda: scene.labels().get("migpilot.io/sharing.state") == "failed", "the failed state"
    )
    assert scene.allocatable("nvidia.com/gpu") == "4"  # the last good config is kept
    assert scene.process.poll() is None
