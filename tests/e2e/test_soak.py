"""The soak and chaos bench in CI: three minutes of ``bench/bench_soak.py`` on the small
cluster (two H100 and two A100 nodes, the MPS node and the time-slicing node), with a kill every
50-70 s, one apiserver restart and one webhook outage. Every invariant of ``bench/soak_checks.py``
must hold: no violation. The full run (30 minutes, 12 nodes) is the lead's
(``python bench/bench_soak.py --minutes 30``, ``docs/soak.md``).

It starts its own control plane (the bench restarts kube-apiserver, which the session's shared
one must not see).
"""

from __future__ import annotations

import pathlib
import sys

import pytest

pytestmark = pytest.mark.kube

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))

import bench_soak  # noqa: E402


def test_three_minutes_of_churn_and_faults_break_no_invariant() -> None:
    result = bench_soak.run(bench_soak.small(3.0, seed=1))
    assert result["violations"] == [], result["violations"]
    faults = {f["fault"] for f in result["faults"]}
    assert {"restart-apiserver", "webhook-down"} <= faults, result["faults"]
    assert faults & {"kill-agent", "kill-controller"}, result["faults"]
    assert result["lifecycles"]["completed"] >= 30, result["lifecycles"]
    assert result["bench_errors"] == [], result["bench_errors"]
