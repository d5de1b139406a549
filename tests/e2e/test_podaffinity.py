"""Pod affinity, anti-affinity and topology spread on a real control plane: migpilot's plan
leaves each pod where kube-scheduler's filters let it bind, and keeps the spread a pinned pod's
node affinity would hide from kube-scheduler: on the two-node scene of ``tests/kube/scenes.py``,
and on the issue's three H100 nodes in two zones (``zone_scene``)."""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.models.apps_v1 import DeploymentSpec
from lightkube.models.core_v1 import PodSpec, PodTemplateSpec
from lightkube.models.meta_v1 import LabelSelector, ObjectMeta
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Namespace, Pod

from tests.e2e.conftest import ZONE, ZONE_NODES
from tests.kube.scenes import NODES, Scene, container

pytestmark = pytest.mark.kube

HOST = "kubernetes.io/hostname"


def _term(app: str) -> dict[str, Any]:
    return {"labelSelector": {"matchLabels": {"app": app}}, "topologyKey": HOST}


def _deployment(scene: Scene, name: str, replicas: int, spec: dict[str, Any]) -> Deployment:
    return Deployment(
        metadata=ObjectMeta(name=name, namespace=scene.namespace),
        spec=DeploymentSpec(
            replicas=replicas,
            selector=LabelSelector(matchLabels={"app": name}),
            template=PodTemplateSpec(
                metadata=ObjectMeta(labels={"app": name}),
                spec=PodSpec.from_dict({"containers": [container("1g.10gb").to_dict()]} | spec),
            ),
        ),
    )


def _of(running: dict[str, str], prefix: str) -> dict[str, str]:
    return {k: v for k, v in running.items() if k.startswith(prefix + "-")}


def test_anti_affinity_spread_and_affinity_are_planned_as_kube_scheduler_filters(
    scene: Scene,
) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")

    # Required hostname anti-affinity: one replica per node, the third waits (binpack alone
    # would put all three on one node, and kube-scheduler would refuse two of them).
    anti = {
        "affinity": {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [_term("web")]}
        }
    }
    client.create(_deployment(scene, "web", 3, anti))
    web = scene.wait(
        lambda: len(_of(scene.running(), "web")) == 2 and _of(scene.running(), "web"),
        "two web replicas Running",
    )
    assert sorted(web.values()) == sorted(NODES)

    # A hostname spread of maxSkew 1 over the two nodes: 2 and 2 (pinning would let
    # kube-scheduler bind all four on one node). Confined to the scene's nodes: the session's
    # control plane holds other tests' nodes too, and under the default nodeAffinityPolicy
    # Honor every node the pod may go to is a domain, so an empty one elsewhere would (rightly)
    # hold the spread at one replica per node.
    spread = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {
                            "matchExpressions": [
                                {"key": HOST, "operator": "In", "values": sorted(NODES)}
                            ]
                        }
                    ]
                }
            }
        },
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": HOST,
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": "spread"}},
            }
        ],
    }
    client.create(_deployment(scene, "spread", 4, spread))
    got = scene.wait(
        lambda: len(_of(scene.running(), "spread")) == 4 and _of(scene.running(), "spread"),
        "four spread replicas Running",
    )
    assert sorted(got.values()) == sorted([*NODES, *NODES])

    # Pod affinity: the follower goes where its anchor runs.
    anchor = scene.pod("anchor", "1g.10gb")
    assert anchor.metadata is not None
    anchor.metadata.labels = {"app": "db"}
    client.create(anchor)
    at = scene.wait(lambda: scene.running().get("anchor"), "the anchor Running")
    follower = Pod.from_dict(
        {
            # Asks to be spread: without its affinity it would take the less used node.
            "metadata": {
                "name": "follower",
                "namespace": scene.namespace,
                "annotations": {"hami.io/node-scheduler-policy": "spread"},
            },
            "spec": {
                "containers": [container("1g.10gb").to_dict()],
                "affinity": {
                    "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [_term("db")]}
                },
            },
        }
    )
    client.create(follower)
    assert scene.wait(lambda: scene.running().get("follower"), "the follower Running") == at
    # The third web replica is still not Running: no node is left for it.
    assert len(_of(scene.running(), "web")) == 2

    # namespaceSelector: anti-affinity to app=db pods of namespaces labelled tier=gold. Only the
    # scene's namespace label (which the controller watches) keeps the loner off the anchor's
    # node, the busier one, which binpack would take.
    client.patch(Namespace, scene.namespace, {"metadata": {"labels": {"e2e-tier": "gold"}}})
    loner = Pod.from_dict(
        {
            "metadata": {
                "name": "loner",
                "namespace": scene.namespace,
                "annotations": {"hami.io/node-scheduler-policy": "binpack"},
            },
            "spec": {
                "containers": [container("1g.10gb").to_dict()],
                "affinity": {
                    "podAntiAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": [
                            _term("db")
                            | {"namespaceSelector": {"matchLabels": {"e2e-tier": "gold"}}}
                        ]
                    }
                },
            },
        }
    )
    client.create(loner)
    assert scene.wait(lambda: scene.running().get("loner"), "the loner Running") != at


def test_three_h100_nodes_in_two_zones(zone_scene: Scene) -> None:
    """The issue's report, on its cluster: three H100 nodes, two in zone-a, one in zone-b."""
    scene = zone_scene
    client = scene.client
    nodes = {name: labels[ZONE] for name, (_, labels) in ZONE_NODES.items()}

    def reported() -> bool:
        return all((lay := scene.layout(n)) is not None and lay.status is not None for n in nodes)

    scene.start_controller("c1")
    scene.wait(reported, "the agents' first status", timeout=300)
    slow = 300.0  # three agents and a controller on a shared machine

    # Required hostname anti-affinity: one replica per node, all three Running.
    anti = {
        "affinity": {
            "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [_term("web")]}
        }
    }
    client.create(_deployment(scene, "web", 3, anti))
    web = scene.wait(
        lambda: len(_of(scene.running(), "web")) == 3 and _of(scene.running(), "web"),
        "three web replicas Running",
        timeout=slow,
    )
    assert sorted(web.values()) == sorted(nodes)

    # A zone spread of maxSkew 1 (DoNotSchedule): two replicas per zone, though zone-a has two
    # nodes and zone-b one (each pinned replica's node affinity hides the spread from
    # kube-scheduler: the plan must keep it).
    spread = {
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": ZONE,
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {"matchLabels": {"app": "spread"}},
            }
        ]
    }
    client.create(_deployment(scene, "spread", 4, spread))
    got = scene.wait(
        lambda: len(_of(scene.running(), "spread")) == 4 and _of(scene.running(), "spread"),
        "four spread replicas Running",
        timeout=slow,
    )
    assert sorted(nodes[n] for n in got.values()) == ["zone-a", "zone-a", "zone-b", "zone-b"]

    # Pod affinity: the follower, which asks to be spread, goes to its anchor's node.
    anchor = scene.pod("anchor", "1g.10gb")
    assert anchor.metadata is not None
    anchor.metadata.labels = {"app": "db"}
    client.create(anchor)
    at = scene.wait(lambda: scene.running().get("anchor"), "the anchor Running", timeout=slow)
    follower = Pod.from_dict(
        {
            "metadata": {
                "name": "follower",
                "namespace": scene.namespace,
                "annotations": {"hami.io/node-scheduler-policy": "spread"},
            },
            "spec": {
                "containers": [container("1g.10gb").to_dict()],
                "affinity": {
                    "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [_term("db")]}
                },
            },
        }
    )
    client.create(follower)
    found = scene.wait(
        lambda: scene.running().get("follower"), "the follower Running", timeout=slow
    )
    assert found == at
