"""The pure parts of the HPA scenario (tests/kube/gpu_hpa.py): the load file the fleet reads
gives each Deployment's replicas their load and no other pod's, the trigger's query selects
one Deployment's pods, the slot arithmetic behind the "carved from the freed room" premise
matches the H100's placements, and docs/autoscaling.md shows the ScaledObject the e2e runs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from migpilot import errors
from migpilot.agent import usage
from tests.kube import gpu_hpa

NS = "hpa-abc123"
MIG, HAMI = gpu_hpa.WORKLOADS


@pytest.mark.parametrize("utilization", [gpu_hpa.LOW, gpu_hpa.HIGH])
def test_the_load_file_sets_every_replica_of_each_deployment_and_nothing_else(
    utilization: float,
) -> None:
    loads = usage.parse_load(gpu_hpa.load_text(utilization, namespace=NS), source="load.yaml")
    for pod in (f"{MIG.name}-54cfdd7958-zd92x", f"{HAMI.name}-7f6dbd4fc7-trd26"):
        got = usage.load_of(loads, f"{NS}/{pod}")
        assert got == usage.PodLoad(utilization, gpu_hpa.MEMORY_MIB)
    assert usage.load_of(loads, f"{NS}/large-1f2e") == usage.IDLE
    assert usage.load_of(loads, f"other/{MIG.name}-54cfdd7958-zd92x") == usage.IDLE


def test_each_trigger_sums_its_own_deployments_pods() -> None:
    for workload, other in ((MIG, HAMI), (HAMI, MIG)):
        q = gpu_hpa.query(workload, namespace=NS)
        assert q.startswith(f"sum({gpu_hpa.UTILIZATION}{{")
        [pattern] = re.findall(r'pod=~"([^"]+)"', q)
        assert re.fullmatch(pattern, f"{workload.name}-54cfdd7958-zd92x")
        assert not re.fullmatch(pattern, f"{other.name}-54cfdd7958-zd92x")
        assert not re.fullmatch(pattern, workload.name)


def test_the_scaled_object_keeps_each_replica_at_the_target() -> None:
    so = gpu_hpa.scaled_object(MIG, namespace=NS, prometheus_url="http://127.0.0.1:9090")
    [trigger] = so["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == gpu_hpa.TARGET
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 0
    assert (so["spec"]["minReplicaCount"], so["spec"]["maxReplicaCount"]) == (1, 3)


def test_h100_slots_of_the_profiles_the_scenario_uses() -> None:
    assert gpu_hpa.slots("1g.10gb", 6) == {6}
    assert gpu_hpa.starts(gpu_hpa.LARGE) == (0,)
    assert gpu_hpa.slots(gpu_hpa.LARGE, 0) == {0, 1, 2, 3}
    with pytest.raises(errors.LayoutError, match="cannot start at memory slot 4"):
        gpu_hpa.slots(gpu_hpa.LARGE, 4)


def test_the_documented_scaled_object_is_the_one_the_e2e_runs() -> None:
    """docs/autoscaling.md shows the e2e's ScaledObject; it must not drift from it."""
    text = (Path(__file__).parents[2] / "docs" / "autoscaling.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
    [shown] = [d for b in blocks if (d := yaml.safe_load(b)).get("kind") == "ScaledObject"]
    namespace, url = (
        shown["metadata"]["namespace"],
        shown["spec"]["triggers"][0]["metadata"]["serverAddress"],
    )
    assert shown == gpu_hpa.scaled_object(MIG, namespace=namespace, prometheus_url=url)
