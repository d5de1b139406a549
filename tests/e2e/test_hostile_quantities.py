"""Quantities no int64 holds, on the real control plane: kube-apiserver accepts ``memory:
1e1000000`` (it stores ``10e999999``), and once such a pod, in any namespace, stopped the
controller's pod watch for good. Now the pod is reported with a Warning event and every MIG pod
created after it is served; a Node with ``cpu: 1e1000000`` allocatable stops nothing either."""

from __future__ import annotations

import contextlib

import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node, Pod

from tests.kube.scenes import Scene

pytestmark = pytest.mark.kube

OTHER = "default"
"""A namespace other than the scene's, where a tenant creates the hostile pod."""


def _warning(scene: Scene, *, namespace: str, name: str) -> str | None:
    for e in scene.client.list(Event, namespace=namespace):
        told = e.message or ""
        if e.involvedObject.name == name and e.type == "Warning" and "migpilot ignores" in told:
            return told
    return None


def test_a_pod_with_memory_1e1000000_stops_nothing_and_is_reported(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    hostile = Pod(
        metadata=ObjectMeta(name="hostile-memory", namespace=OTHER),
        spec=PodSpec(
            containers=[
                Container(
                    name="c",
                    image="busybox",
                    resources=ResourceRequirements(
                        requests={"memory": "1e1000000"}, limits={"memory": "1e1000000"}
                    ),
                )
            ]
        ),
    )
    client.create(hostile)
    try:
        stored = client.get(Pod, "hostile-memory", namespace=OTHER)
        assert stored.spec is not None
        requests = stored.spec.containers[0].resources
        assert requests is not None and requests.requests is not None
        assert requests.requests["memory"] == "10e999999"  # accepted, as the issue says
        client.create(scene.pod("after", "1g.10gb"))
        scene.wait(lambda: scene.running({"after"}), "the MIG pod created after it Running")
        message = scene.wait(
            lambda: _warning(scene, namespace=OTHER, name="hostile-memory"),
            "a Warning event on the hostile pod",
        )
        assert "migpilot ignores this pod: spec.containers[0].memory" in message
        assert "is too large" in message
    finally:
        with contextlib.suppress(Exception):
            client.delete(Pod, "hostile-memory", namespace=OTHER, grace_period=0)


def test_a_node_with_cpu_1e1000000_stops_nothing(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    client.create(
        Node(
            metadata=ObjectMeta(
                name="hostile-node",
                labels={"nvidia.com/mig.capable": "true", "kubernetes.io/hostname": "hostile"},
            )
        )
    )
    try:
        client.patch(
            Node.Status,
            "hostile-node",
            {"status": {"capacity": {"cpu": "1e1000000"}, "allocatable": {"cpu": "1e1000000"}}},
        )
        client.create(scene.pod("after-node", "1g.10gb"))
        scene.wait(lambda: scene.running({"after-node"}), "a MIG pod Running after the node")
        message = scene.wait(
            lambda: _warning(scene, namespace="default", name="hostile-node"),
            "a Warning event on the hostile node",
        )
        assert "status.allocatable.cpu" in message and "is too large" in message
    finally:
        with contextlib.suppress(Exception):
            client.delete(Node, "hostile-node")
