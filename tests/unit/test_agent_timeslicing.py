"""The agent's half of time-slicing nodes (``docs/controller.md``, "Time-slicing nodes"): the
replicas its sharing config makes of each GPU, reported in the GpuLayout status; the replicas
the spec keeps for unified pods, handed to them; the node counters of time-slicing GPUs."""

from __future__ import annotations

from typing import Any

import pytest

from migpilot.agent.cluster import reporting
from migpilot.agent.deviceplugin import devices, podresources
from migpilot.agent.rules import changes, desired
from migpilot.agent.sharing import timeslicing
from migpilot.api import gpulayouts as gl
from migpilot.gpu import emulated
from migpilot.mig import catalog
from migpilot.sharing import config as sharing_config

H100 = catalog.resolve_gpu("h100-80gb")
T0 = "2026-01-01T00:00:00Z"
U, R, F = gl.InstanceState.USED, gl.InstanceState.RESERVED, gl.InstanceState.FREE


def ts(replicas: int, *, rename: bool = False, devices_: str = "all") -> sharing_config.Config:
    entry = f"{{name: nvidia.com/gpu, replicas: {replicas}, devices: {devices_}}}"
    flags = "renameByDefault: true, " if rename else ""
    text = f"version: v1\nsharing: {{timeSlicing: {{{flags}resources: [{entry}]}}}}\n"
    return sharing_config.parse(text, source="test")


def gpu(index: int, *, mig: bool = False) -> devices.Gpu:
    return devices.Gpu(index, f"GPU-{index}", H100, "NVIDIA H100 80GB HBM3", 81559, mig)


def view(*gpus: devices.Gpu, slices: tuple[devices.MpsSlice, ...] = ()) -> devices.NodeDevices:
    return devices.NodeDevices(gpus=gpus, mps_slices=slices)


# --- which replicas -----------------------------------------------------------------------------


def test_each_whole_gpu_has_the_configs_replicas() -> None:
    assert timeslicing.replica_ids(view(gpu(0), gpu(1)), ts(3)) == {0: (0, 1, 2), 1: (0, 1, 2)}
    assert timeslicing.device_id("GPU-1", 2) == "GPU-1::2"


def test_no_replicas_without_time_slicing_or_on_mig_or_sliced_gpus() -> None:
    assert timeslicing.replica_ids(view(gpu(0)), sharing_config.EMPTY) == {}
    mps = sharing_config.parse(
        "version: v1\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n",
        source="test",
    )
    assert timeslicing.replica_ids(view(gpu(0)), mps) == {}
    sliced = view(gpu(0), gpu(1, mig=True), gpu(2), slices=(devices.MpsSlice(2, 0, 10),))
    assert timeslicing.replica_ids(sliced, ts(2)) == {0: (0, 1)}


def test_renamed_replicas_are_not_the_unified_pods() -> None:
    assert timeslicing.replica_ids(view(gpu(0)), ts(2, rename=True)) == {}


def test_a_config_naming_gpus_replicates_those_and_one_that_does_not_fit_none() -> None:
    assert timeslicing.replica_ids(view(gpu(0), gpu(1)), ts(2, devices_='["1"]')) == {1: (0, 1)}
    assert timeslicing.replica_ids(view(gpu(0)), ts(2, devices_='["5"]')) == {}


# --- their status -------------------------------------------------------------------------------


def test_a_replica_is_used_while_held_reserved_while_kept_else_free() -> None:
    spec = gl.LayoutSpec(
        (gl.GpuSpec(0, None, (), replicas=(gl.ReplicaSpec(1, "ns/q"), gl.ReplicaSpec(2, "ns/r"))),)
    )
    found = timeslicing.statuses(
        view(gpu(0)),
        sharing=ts(4),
        spec=spec,
        in_use=frozenset({"GPU-0", "GPU-0::0", "GPU-0::2"}),
        used_by={"GPU-0::2": "ns/r"},
    )
    assert found == {
        0: (
            gl.ReplicaStatus(0, U),  # an NVIDIA-style pod's: not named
            gl.ReplicaStatus(1, R),
            gl.ReplicaStatus(2, U, "ns/r"),
            gl.ReplicaStatus(3, F),
        )
    }


def _state(*, mig: bool) -> dict[int, changes.GpuState]:
    gpus = emulated.EmulatedBackend([H100], durable=False, mig_enabled=mig)
    try:
        info = gpus.gpus()[0]
    finally:
        gpus.close()
    return {0: changes.GpuState(info, ())}


@pytest.mark.parametrize("mig", [False, True])
def test_the_status_lists_a_mig_off_gpu_with_its_replicas(mig: bool) -> None:
    state = _state(mig=mig)
    report = changes.Report(devices={}, applied=(), refusals=(), converged=True, duration_s=0.0)
    kw: dict[str, Any] = {
        "state": state, "in_use": frozenset(), "spec": None, "generation": 1,
        "report": report, "now": T0,
    }  # fmt: skip
    reps = {0: (gl.ReplicaStatus(0, F), gl.ReplicaStatus(1, U, "ns/p"))}
    status = reporting.layout_status(**kw, replicas=reps)
    if mig:  # a MIG-enabled GPU reports its instances, never replicas
        assert all(g.replicas == () for g in status.gpus)
        return
    (g,) = status.gpus
    assert (g.instances, g.mps, g.replicas) == ((), (), reps[0])
    assert g.uuid == state[0].info.uuid


def test_a_spec_keeping_replicas_changes_no_mig_mode() -> None:
    info = _state(mig=False)[0].info
    spec = gl.LayoutSpec((gl.GpuSpec(0, None, (), replicas=(gl.ReplicaSpec(0, "ns/p"),)),))
    assert desired.from_gpulayout(spec, gpus=[info]) == {}


def test_the_kubelet_reports_a_replica_in_use_as_itself_and_its_gpu() -> None:
    listed = (podresources.ContainerDevices("ns", "p", "c", "nvidia.com/gpu", ("GPU-1::3",)),)
    assert podresources.in_use_ids(listed) == {"GPU-1", "GPU-1::3"}
