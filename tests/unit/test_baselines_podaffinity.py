"""The baselines (nos, HAMi, static) do not plan pod (anti-)affinity or topology spread, but their
plans are taken as a cluster would run them: a pod placed where kube-scheduler's filters refuse
it stays pending, with that reason, so their plans pass the same validation as migpilot's."""

from __future__ import annotations

from typing import Any

import pytest

from migpilot.planning import options, planners, snapshot, validation

HOST = "kubernetes.io/hostname"
BASELINES = ["nos", "hami-template", "hami-placement", "static"]


def _doc(free: bool) -> dict[str, Any]:
    gpu: dict[str, Any] = {"model": "a100-80gb"}
    if free:  # static only hands out free instances that exist
        gpu["instances"] = [{"profile": "1g.10gb", "start": s, "used": False} for s in range(0, 4)]
    anti = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "web"}}, "topologyKey": HOST}
            ]
        }
    }
    return {
        "version": 1,
        "nodes": [{"name": "n0", "labels": {HOST: "n0"}, "gpus": [gpu]}],
        "pods": [
            {
                "name": f"r{i}",
                "labels": {"app": "web"},
                "requests": {"nvidia.com/mig-1g.10gb": 1},
                "affinity": anti,
            }
            for i in range(3)
        ],
    }


@pytest.mark.parametrize("planner", BASELINES)
def test_a_baseline_keeps_only_what_the_filters_admit(planner: str) -> None:
    # one node: hostname anti-affinity admits one replica; binpack-like baselines place all 3
    snap = snapshot.parse(_doc(free=planner == "static"))
    plan = planners.run(snap, planner, options.Options())
    assert validation.problems(snap, plan) == []
    assert len(plan.placements) == 1
    reasons = [u.reason for u in plan.unschedulable]
    assert len(reasons) == 2
    assert all("kube-scheduler's filters refuse it: pod anti-affinity" in r for r in reasons)
