"""``migpilot fleet`` on a real control plane: one process runs the agents of three KWOK nodes.

Three KWOK nodes labelled ``migpilot.io/emulated-gpus`` (two A100-80GB each, one with two
H100-80GB), one ``migpilot fleet`` process, the webhook and the real controller. The fleet
writes each node's GFD labels, so the controller creates their GpuLayouts; pods asking for MIG
profiles are gated, planned, made, pinned, bound and run; the simulated kubelet assigns each
bound pod its instance, which the status reports ``used``. Every wait has a generous timeout.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightkube
import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod

from migpilot.api import gpulayouts as gl
from tests.kube import crds, system
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube

WAIT_S = 120.0
NODES = {"fleet-a": "a100-80gb.x2", "fleet-b": "a100-80gb.x2", "fleet-c": "h100-80gb.x2"}


@pytest.fixture
def scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[system.System]:
    s = system.System(control_plane, tmp_path)
    namespace = f"fleet-{s.lease_ns.rsplit('-', 1)[-1]}"
    client = control_plane.client
    try:
        s.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        s.start_webhook()
        for node, gpus in NODES.items():
            s.add_fleet_node(node, gpus)
        yield s
    finally:
        for p in client.list(Pod, namespace=namespace):
            with contextlib.suppress(lightkube.ApiError):
                assert p.metadata is not None
                client.delete(Pod, p.metadata.name or "", namespace=namespace, grace_period=0)
        s.stop()
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)


def _wait(scene: system.System, predicate: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (got := predicate()):
        if scene.fleet is not None and scene.fleet.process.poll() is not None:
            raise AssertionError(f"the fleet exited waiting for {what}\n{scene.logs()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{scene.logs()}")
        time.sleep(0.1)
    return got


def _layout(scene: system.System, node: str) -> gl.GpuLayout | None:
    try:
        return gl.parse(scene.client.get(crds.GpuLayout, node).to_dict())
    except lightkube.ApiError:
        return None


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


def test_one_fleet_process_runs_every_nodes_agent(scene: system.System) -> None:
    client = scene.client
    namespace = f"fleet-{scene.lease_ns.rsplit('-', 1)[-1]}"
    scene.start_fleet()
    scene.start_controller("c1")

    # GFD labels first (no GpuLayout yet), then the controller's GpuLayouts and their status.
    def labelled() -> bool:
        for node in NODES:
            labels = client.get(Node, node).metadata.labels or {}  # type: ignore[union-attr]
            if labels.get("nvidia.com/mig.capable") != "true":
                return False
        return True

    _wait(scene, labelled, "the fleet's GFD labels on every node")

    def reported() -> bool:
        return all((x := _layout(scene, n)) is not None and x.status is not None for n in NODES)

    _wait(scene, reported, "every node's first status")

    names = {f"p{i:02d}": ("1g.10gb", "3g.40gb", "2g.20gb")[i % 3] for i in range(12)}
    for name, profile in sorted(names.items()):
        client.create(_pod(name, namespace, profile))

    def running() -> dict[str, str]:
        out = {}
        for p in client.list(Pod, namespace=namespace):
            assert p.metadata is not None and p.status is not None and p.spec is not None
            if p.status.phase == "Running" and p.spec.nodeName:
                out[p.metadata.name or ""] = p.spec.nodeName
        return out if set(names) <= set(out) else {}

    placed = _wait(scene, running, "12 pods Running")
    assert set(placed.values()) <= set(NODES)

    # Each bound pod holds an instance of its profile: the statuses report them used.
    def used() -> bool:
        counts: dict[str, int] = {}
        for node in NODES:
            lay = _layout(scene, node)
            for g in lay.status.gpus if lay is not None and lay.status is not None else ():
                for i in g.instances:
                    if i.state is gl.InstanceState.USED:
                        counts[i.profile] = counts.get(i.profile, 0) + 1
        return counts == {"1g.10gb": 4, "3g.40gb": 4, "2g.20gb": 4}

    _wait(scene, used, "12 instances reported used")
    text = (scene.root / "fleet.log").read_text(errors="replace")
    assert "(simulated Allocate)" in text
