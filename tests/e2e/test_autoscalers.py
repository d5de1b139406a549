"""KEDA and Karpenter's KWOK provider run against the real control plane (groundwork of the
autoscaling scenarios, docs/autoscaling.md).

- KEDA: its operator and metrics adapter start outside any cluster, the apiserver serves
  ``external.metrics.k8s.io`` from the adapter through an APIService and an ExternalName
  Service, and a ScaledObject whose Prometheus trigger reads a real Prometheus makes the
  controller-manager's HPA scale a Deployment: the path the GPU-utilisation scenario takes,
  with a constant query in place of migpilot's per-pod series.
- Karpenter: its provider accepts a NodePool of a GPU instance type, and a pod asking for a GPU
  that no node has gets a new KWOK node of that type, and runs there. Deleting the NodePool
  removes the node.

Both leave the session's control plane as they found it (apart from the CRDs).
"""

from __future__ import annotations

import contextlib
import pathlib
import uuid
from collections.abc import Iterator

import lightkube
import pytest
from lightkube import codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.autoscaling_v2 import HorizontalPodAutoscaler
from lightkube.resources.core_v1 import Namespace, Node, Pod

from tests.kube import autoscalers, tools
from tests.kube import prometheus as prom
from tests.kube.controlplane import ControlPlane, wait_for

pytestmark = pytest.mark.kube

ScaledObject = create_namespaced_resource("keda.sh", "v1alpha1", "ScaledObject", "scaledobjects")


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    name = f"autoscale-{uuid.uuid4().hex[:6]}"
    control_plane.client.create(Namespace(metadata=ObjectMeta(name=name)))
    yield name
    with contextlib.suppress(lightkube.ApiError):
        control_plane.client.delete(Namespace, name)


def _deployment(name: str, namespace: str, *, replicas: int, resources: dict[str, str]) -> object:
    labels = {"app": name}
    return codecs.from_dict(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "replicas": replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {
                        "containers": [
                            {
                                "name": "main",
                                "image": "registry.invalid/worker",
                                "resources": {"requests": resources, "limits": resources},
                            }
                        ]
                    },
                },
            },
        }
    )


def test_keda_serves_external_metrics_and_the_hpa_scales(
    control_plane: ControlPlane, namespace: str, tmp_path: pathlib.Path
) -> None:
    found = tools.locate()
    client = control_plane.client
    with (
        prom.Prometheus.start(found.prometheus, tmp_path / "prometheus") as prometheus,
        autoscalers.Keda.start(
            control_plane,
            operator=found.keda_operator,
            adapter=found.keda_adapter,
            crds=found.keda_crds,
            root=tmp_path / "keda",
        ) as keda,
    ):
        status, body = control_plane.get_raw("/apis/external.metrics.k8s.io/v1beta1")
        assert status == 200, body
        assert b'"groupVersion":"external.metrics.k8s.io/v1beta1"' in body

        client.create(_deployment("worker", namespace, replicas=1, resources={"cpu": "100m"}))
        scaled = ScaledObject(
            metadata=ObjectMeta(name="worker", namespace=namespace),
            spec={
                "scaleTargetRef": {"name": "worker"},
                "minReplicaCount": 1,
                "maxReplicaCount": 3,
                "pollingInterval": 1,
                "triggers": [
                    {
                        "type": "prometheus",
                        "metricType": "AverageValue",
                        "metadata": {
                            "serverAddress": prometheus.url,
                            # Five units of load against a target of one a replica: 3 (the max).
                            "query": "vector(5)",
                            "threshold": "1",
                        },
                    }
                ],
            },
        )
        client.create(scaled)
        try:
            hpa = wait_for(
                lambda: client.get(HorizontalPodAutoscaler, "keda-hpa-worker", namespace=namespace),
                what="KEDA to create the HPA",
                timeout=60,
                watch=keda.components,
            )
            assert hpa.spec is not None and hpa.spec.maxReplicas == 3
            values = wait_for(
                lambda: keda.external_metric(namespace, "s0-prometheus", "worker") or None,
                what="the external metric through the apiserver",
                timeout=60,
                watch=keda.components,
            )
            assert values == [5.0]

            def scaled_to_max() -> bool:
                spec = client.get(Deployment, "worker", namespace=namespace).spec
                return spec is not None and spec.replicas == 3

            # The HPA controller syncs every second here (controlplane.HPA_SYNC_PERIOD).
            wait_for(scaled_to_max, what="the HPA to scale worker to 3", timeout=90)
        finally:
            # The operator removes its finalizer; it must still run.
            with contextlib.suppress(lightkube.ApiError):
                client.delete(ScaledObject, "worker", namespace=namespace)
            wait_for(
                lambda: not list(client.list(ScaledObject, namespace=namespace)),
                what="the ScaledObject to go",
                timeout=60,
            )
            client.delete(Deployment, "worker", namespace=namespace)


GPU_TYPE = autoscalers.InstanceType(
    name="gpu-h100-8x",
    resources={"cpu": "96", "memory": "1Ti", "pods": "110", "nvidia.com/gpu": "8"},
)


def test_karpenter_kwok_provider_adds_a_gpu_node(
    control_plane: ControlPlane, namespace: str, tmp_path: pathlib.Path
) -> None:
    found = tools.locate()
    client = control_plane.client
    pool = f"gpu-{namespace.rsplit('-', 1)[-1]}"
    with autoscalers.Karpenter.start(
        control_plane,
        binary=found.karpenter,
        crds=found.karpenter_crds,
        root=tmp_path / "karpenter",
        instance_types=[GPU_TYPE],
    ) as karpenter:
        with contextlib.suppress(lightkube.ApiError):  # another test may have made it
            client.create(autoscalers.node_class())
        client.create(autoscalers.node_pool(pool, instance_types=[GPU_TYPE.name]))
        try:
            wait_for(
                lambda: (
                    autoscalers.condition(client.get(autoscalers.NodePool, pool), "Ready") == "True"
                ),
                what="the NodePool to be Ready",
                timeout=60,
                watch=[karpenter.component] if karpenter.component else [],
            )
            pod = codecs.from_dict(
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": "wants-a-gpu", "namespace": namespace},
                    "spec": {
                        # Only this pool's nodes: other tests' nodes may offer GPUs too.
                        "nodeSelector": {"karpenter.sh/nodepool": pool},
                        "containers": [
                            {
                                "name": "main",
                                "image": "registry.invalid/worker",
                                "resources": {"limits": {"nvidia.com/gpu": "1"}},
                            }
                        ],
                    },
                }
            )
            client.create(pod)

            def running() -> Pod | None:
                got = client.get(Pod, "wants-a-gpu", namespace=namespace)
                phase = got.status.phase if got.status else None
                return got if phase == "Running" else None

            got = wait_for(
                running,
                what="the pod to run on a node Karpenter added",
                timeout=120,
                watch=[karpenter.component] if karpenter.component else [],
            )
            assert got.spec is not None and got.spec.nodeName
            node = client.get(Node, got.spec.nodeName)
            assert node.metadata is not None and node.metadata.labels is not None
            assert node.metadata.labels["karpenter.sh/nodepool"] == pool
            assert node.metadata.labels["node.kubernetes.io/instance-type"] == GPU_TYPE.name
            assert node.status is not None and node.status.allocatable is not None
            assert node.status.allocatable["nvidia.com/gpu"] == "8"
            claims = client.list(autoscalers.NodeClaim, labels={"karpenter.sh/nodepool": pool})
            assert len(list(claims)) == 1
        finally:
            with contextlib.suppress(lightkube.ApiError):
                client.delete(Pod, "wants-a-gpu", namespace=namespace, grace_period=0)
            # Karpenter deletes the Nodes of deleted NodeClaims (its finalizers): it must run.
            # The pool's NodeClaims are deleted here, not left to the garbage collector, which
            # learns of a CRD added after it started only at its next discovery (up to 30 s).
            with contextlib.suppress(lightkube.ApiError):
                client.delete(autoscalers.NodePool, pool)
            for claim in client.list(autoscalers.NodeClaim, labels={"karpenter.sh/nodepool": pool}):
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(autoscalers.NodeClaim, claim.metadata.name)

            def pool_gone() -> bool:
                selector = {"karpenter.sh/nodepool": pool}
                nodes = client.list(Node, labels=selector)
                claims = client.list(autoscalers.NodeClaim, labels=selector)
                return not list(nodes) and not list(claims)

            wait_for(pool_gone, what="the pool's NodeClaims and Nodes to go", timeout=120)
