"""HPA on per-pod GPU utilisation, end to end on the real control plane (issue 23, part 1).

KEDA reads the per-pod series ``migpilot_device_utilization_ratio`` from a real Prometheus, the
HPA controller of kube-controller-manager scales two Deployments (MIG ``nvidia.com/mig-1g.10gb``
pods and HAMi-style ``nvidia.com/gpu`` + ``nvidia.com/gpumem`` pods), and migpilot serves what
the HPA asks: at load 0.9 every new replica gets an instance made for it; at 0.1 the removed
replicas' instances are free again; and a pod asking a 4g.40gb then gets one carved from the
freed room. The scenario and its checks are in ``tests/kube/gpu_hpa.py`` (shared with
``bench/bench_autoscaling.py``); this test runs it and asserts what each step returned.
"""

from __future__ import annotations

import pathlib

import pytest

from tests.kube import gpu_hpa
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube


def test_hpa_scales_on_gpu_utilisation_and_migpilot_serves_and_frees_the_replicas(
    control_plane: ControlPlane, tmp_path: pathlib.Path
) -> None:
    with gpu_hpa.staged(control_plane, tmp_path) as stage:
        started = gpu_hpa.start_workloads(stage)
        firsts = {h.start for h in started.held.values()}
        assert all(h.profile == gpu_hpa.PROFILE for h in started.held.values()), started

        # Load 0.9: 1 -> 3 replicas each, every new one on an instance made for it.
        out = gpu_hpa.scale_out(stage, started)
        assert out.replicas == {w.name: gpu_hpa.MAX_REPLICAS for w in gpu_hpa.WORKLOADS}
        assert set(out.seconds) == {w.name for w in gpu_hpa.WORKLOADS}
        assert all(out.first_seconds[n] <= s for n, s in out.seconds.items()), out
        new = [h for hs in out.held.values() for h in hs]
        assert len(new) == 2 * (gpu_hpa.MAX_REPLICAS - 1)
        assert out.created == len(new)  # one instance made per new replica, nothing else
        assert all(h.gpu == 0 for h in new)
        assert len({h.start for h in new} | firsts) == len(new) + len(firsts)

        # Load 0.1: back to the first replica each; the four instances free where they were.
        back = gpu_hpa.scale_in(stage, started, out)
        assert {h.uuid for h in back.freed} == {h.uuid for h in new}
        assert back.free_series == back.free_gauge >= len(new)

        # A 4g.40gb: only the freed room can hold it; it is carved from it.
        large = gpu_hpa.grow_large(stage, started, back)
        assert large.held.profile == gpu_hpa.LARGE
        assert large.held.start in large.room
        assert large.reused
        assert {h.uuid for h in large.reused} <= {h.uuid for h in back.freed}
        # The first replicas sit outside the 4g.40gb's slots and were never touched.
        assert not firsts & gpu_hpa.slots(gpu_hpa.LARGE, large.held.start)
