"""Node autoscaling sees MIG demand (issue 23), on the real control plane with Karpenter's KWOK
provider: the scenario of ``tests/kube/node_autoscaling.py``.

Two H100 nodes full of used instances; a burst of eight ``3g.40gb`` pods that no existing node
can serve. ``migpilot controller --node-autoscaling`` ungates them; Karpenter (its instance type
told the MIG resources by the NodeOverlay ``migpilot autoscaling overlay`` prints) adds exactly
one 8-GPU node; the fleet runs the new node's agent, which zeroes the instance type's fake MIG
counts and removes the NodePool's startup taint once it has reported the GPUs; the controller
plans the pods there, and every pod ends Running with none left gated. Deleting the pods leaves
the node empty, and Karpenter consolidates it away.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest
from lightkube.resources.core_v1 import Node

from migpilot.agent.cluster import startup
from tests.kube import autoscalers
from tests.kube import node_autoscaling as nas
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube


@pytest.fixture
def scenario(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[nas.Scenario]:
    s = nas.Scenario(control_plane, tmp_path)
    try:
        yield s
    finally:
        s.stop()


def test_karpenter_adds_one_node_for_mig_pods_no_node_can_serve_then_removes_it(
    scenario: nas.Scenario,
) -> None:
    scenario.start()
    scenario.fill()
    scenario.start_karpenter()
    assert scenario.pool_claims() == []  # the full nodes' Running pods ask for nothing

    figures = scenario.burst()
    assert figures.nodes_added == 1, scenario.dump()
    (claim,) = scenario.pool_claims()
    (node,) = scenario.pool_nodes()
    assert node.metadata is not None and node.metadata.name
    name = node.metadata.name
    assert set(scenario.running("burst-").values()) == {name}
    assert len(scenario.running("fill-")) == len(nas.FULL_NODES) * 2  # left where they were
    assert scenario.gated() == []
    # While the node was on its way the controller said what it would have to hold, and let
    # every burst pod go once; with the pods placed, nothing is wanted any more.
    assert figures.unmet_demand_seen == nas.BURST_PODS
    assert figures.unmet_demand_after in (None, 0.0)
    assert figures.scaled_out == nas.BURST_PODS
    reasons = scenario.event_reasons("burst-")
    assert all(r.count("MigScaleOut") == 1 for r in reasons.values()), reasons

    # The node holds what the pods use, no fake count, and no startup taint; Karpenter counts
    # it initialized (the startup taint gone, the requested resources registered).
    got = scenario.client.get(Node, name)
    assert got.status is not None and got.status.allocatable is not None
    mig = {k: v for k, v in got.status.allocatable.items() if k.startswith("nvidia.com/mig-")}
    assert mig == {f"nvidia.com/mig-{nas.BURST_PROFILE}": str(nas.BURST_PODS)}
    taints = [t.key for t in (got.spec.taints if got.spec and got.spec.taints else [])]
    assert startup.TAINT_KEY not in taints
    scenario.wait(
        lambda: (
            autoscalers.condition(
                scenario.client.get(autoscalers.NodeClaim, claim.metadata.name), "Initialized"
            )
            == "True"
        ),
        "Karpenter to count the node initialized",
    )
    fleet = (scenario.root / "fleet.log").read_text(errors="replace")
    # The stand-in's first publish zeroed the NodeClaim's requests KWOK put in as capacity.
    assert f"{name}: published nvidia.com/gpu=0, nvidia.com/mig-{nas.BURST_PROFILE}=0" in fleet
    assert f"{name}: GPUs reported and resources advertised: startup taint" in fleet

    scenario.scale_down()
    assert scenario.pool_nodes() == [] and scenario.pool_claims() == []
