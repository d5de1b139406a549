"""The soak and chaos bench in CI: three minutes of ``bench/bench_soak.py`` on the small
cluster (two H100 and two A100 nodes, the MPS node and the time-slicing node), with a kill every
50-70 s, one apiserver restart, one webhook outage, and the PodResources socket of the node
whose agent runs the real kubelet path (a fake kubelet and the bench's device manager) away for
60-80 s. Every invariant of ``bench/soak_checks.py`` must hold: no violation. The full run
(30 minutes, 12 nodes) is the lead's (``python bench/bench_soak.py --minutes 30``,
``docs/soak.md``).

It starts its own control plane (the bench restarts kube-apiserver, which the session's shared
one must not see).
"""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

pytestmark = pytest.mark.kube

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

import bench_soak  # noqa: E402


def test_three_minutes_of_churn_and_faults_break_no_invariant() -> None:
    result = bench_soak.run(bench_soak.small(3.0, seed=1))
    shown = ("lifecycles", "faults", "kubelet_nodes", "bind_latency", "violation_count")
    print(json.dumps({k: result[k] for k in shown}))  # the run's figures, with -s
    assert result["violations"] == [], result["violations"]
    faults = {f["fault"] for f in result["faults"]}
    assert {"restart-apiserver", "webhook-down", "podresources-down"} <= faults, result["faults"]
    assert faults & {"kill-agent", "kill-controller"}, result["faults"]
    assert result["lifecycles"]["completed"] >= 30, result["lifecycles"]
    assert result["bench_errors"] == [], result["bench_errors"]
    # The kubelet node took pods through Allocate, during the outage too, and destroyed nothing
    # while it could not ask PodResources.
    [kubelet] = result["kubelet_nodes"].values()
    assert kubelet["pods_allocated"] >= 3, kubelet
    assert kubelet["destroyed_during_podresources_outage"] == 0, kubelet
