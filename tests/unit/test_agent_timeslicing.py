"""The agent's half of time-slicing nodes (``docs/controller.md``, "Time-slicing nodes"): the
replicas its sharing config makes of each GPU, reported in the GpuLayout status; the replicas
the spec keeps for unified pods, handed to them; the node counters of time-slicing GPUs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from migpilot.agent import assembling, metrics, reconciling, running
from migpilot.agent.cluster import boundpods, following, kubeapi, reporting
from migpilot.agent.deviceplugin import devices, podresources, resolving, serving
from migpilot.agent.rules import changes, desired
from migpilot.agent.sharing import timeslicing, unifying
from migpilot.api import gpulayouts as gl
from migpilot.gpu import clocks, emulated
from migpilot.kwok import standin
from migpilot.mig import catalog
from migpilot.planning import unified
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

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


# --- the node counters --------------------------------------------------------------------------

MEM, PCT, CORES = "nvidia.com/gpumem", "nvidia.com/gpumem-percentage", "nvidia.com/gpucores"


def test_a_time_slicing_gpu_counts_once_per_replica() -> None:
    gb = sharing_mps.memory_gb(H100) * 1024
    two = view(gpu(0), gpu(1), gpu(2, mig=True))
    assert unifying.counters(two, replicas={0: 4, 1: 2}) == {
        MEM: 6 * gb + unified.memory_mib(H100),
        PCT: 700,
        CORES: 700,
    }
    # A GPU serving MPS slices counts once, whatever a stale replica count says.
    sliced = view(gpu(0), slices=(devices.MpsSlice(0, 0, 10),))
    assert unifying.counters(sliced, replicas={0: 4}) == {MEM: gb, PCT: 100, CORES: 100}
    assert unifying.counters(view(gpu(0))) == {MEM: 0, PCT: 0, CORES: 0}


# --- the agent in process: reported, handed out, counted -----------------------------------------

NODE = "node-ts"
GPU = "nvidia.com/gpu"


def pod_doc(name: str, limits: dict[str, Any], *, node: str | None = NODE) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": limits}}]}
    if node is not None:
        spec["nodeName"] = node
    meta = {"name": name, "namespace": "ns", "creationTimestamp": T0, "uid": name}
    return {"metadata": meta, "spec": spec, "status": {"phase": "Running" if node else "Pending"}}


def replicas_spec(*kept: tuple[int, int, str]) -> dict[str, Any]:
    by_gpu: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for g, ident, pod in kept:
        by_gpu[g].append({"id": ident, "reservedFor": pod})
    return {"gpus": [{"index": g, "instances": [], "replicas": r} for g, r in by_gpu.items()]}


class TsNode:
    def __init__(self) -> None:
        self.api = kubeapi.InMemoryNodeApi()
        self.api.put_node(NODE, {})
        self.gpus = emulated.EmulatedBackend([H100, H100], durable=False, mig_enabled=False)
        source = following.GpuLayoutSource(self.api, node=NODE)
        source.sync()
        book = boundpods.PodBook()
        book.listed(self.api.list_pods(node=NODE).items)
        self.cluster = assembling.kube_side(
            self.api,
            source=source,
            pods=book,
            strategy=devices.MigStrategy.NONE,
            standin=standin.stand_in,
        )
        self.cluster.share_with(lambda: ts(4))
        wired = self.cluster.wire(reconciling.RunningProcesses(self.gpus), gpus=self.gpus)
        self.agent = running.Agent(
            gpus=self.gpus,
            in_use=wired.in_use,
            source=self.cluster.desired_source(),
            plugin=None,
            agent_metrics=metrics.AgentMetrics(),
            clock=clocks.VirtualClock(),
            settings=running.AgentSettings(strategy=devices.MigStrategy.NONE),
            listener=wired.listener,
            view_filter=self.cluster.view_filter(),
        )

    def close(self) -> None:
        self.api.close()
        self.gpus.close()

    def step(self) -> None:
        self.cluster.source.sync()
        self.cluster.pods.listed(self.api.list_pods(node=NODE).items)
        self.agent.reconcile()

    def layout(self) -> gl.GpuLayout:
        got = self.api.layout(NODE)
        assert got is not None
        return got

    def states(self, index: int = 0) -> list[tuple[str, str | None]]:
        status = self.layout().status
        assert status is not None
        (g,) = [g for g in status.gpus if g.index == index]
        return [(r.state.value, r.used_by) for r in g.replicas]

    def uuid(self, index: int) -> str:
        return self.gpus.gpus()[index].uuid

    def assigned(self) -> dict[str, tuple[str, ...]]:
        kubelet = self.cluster.kubelet
        assert isinstance(kubelet, standin.SimulatedKubelet)
        return kubelet.assigned()


@pytest.fixture
def tsnode() -> Iterator[TsNode]:
    n = TsNode()
    yield n
    n.close()


def test_a_unified_pod_gets_the_replica_kept_for_it_and_the_status_says_so(
    tsnode: TsNode,
) -> None:
    tsnode.api.put_spec(NODE, replicas_spec((0, 2, "ns/u")))
    tsnode.api.put_pod(pod_doc("u", {GPU: 1, MEM: 30000}, node=None))
    tsnode.step()
    free, kept = ("free", None), ("reserved", None)
    assert tsnode.states(0) == [free, free, kept, free]
    assert tsnode.states(1) == [free] * 4
    gb = sharing_mps.memory_gb(H100) * 1024
    resources = tsnode.api.node_resources[NODE]
    assert resources[GPU] == "8"
    assert (resources[MEM], resources[PCT], resources[CORES]) == (str(8 * gb), "800", "800")
    # kube-scheduler binds u: the stand-in admits it with its replica, as Allocate would.
    tsnode.api.put_pod(pod_doc("u", {GPU: 1, MEM: 30000}))
    tsnode.step()
    mine = timeslicing.device_id(tsnode.uuid(0), 2)
    assert tsnode.assigned()["ns/u"] == (mine,)
    assert tsnode.states(0) == [free, free, ("used", "ns/u"), free]
    assert gl.allocated(tsnode.layout(), "ns/u")
    # The controller drops the reservation once u is allocated: the replica stays u's.
    tsnode.api.put_spec(NODE, replicas_spec())
    tsnode.step()
    assert tsnode.states(0)[2] == ("used", "ns/u")
    assert tsnode.assigned()["ns/u"] == (mine,)
    # u goes: its replica is free again.
    tsnode.api.delete_pod("ns", "u")
    tsnode.step()
    assert "ns/u" not in tsnode.assigned()
    assert tsnode.states(0)[2] == free


def test_a_unified_pod_without_a_kept_replica_gets_none(tsnode: TsNode) -> None:
    tsnode.api.put_spec(NODE, replicas_spec())
    tsnode.api.put_pod(pod_doc("u", {GPU: 1, MEM: 30000}))
    tsnode.step()
    assert tsnode.assigned().get("ns/u", ()) == ()
    assert all(s == ("free", None) for g in (0, 1) for s in tsnode.states(g))


def test_nvidia_style_pods_get_replicas_reported_used_and_never_one_kept_for_another(
    tsnode: TsNode,
) -> None:
    """Plain ``nvidia.com/gpu`` pods kube-scheduler bound to replicas: the stand-in gives each
    its count of replicas, as the kubelet would, leaving the one kept for a unified pod; the
    status reports them used (no ``usedBy``: Allocate named no unified pod); freed when gone."""
    tsnode.api.put_spec(NODE, replicas_spec((0, 0, "ns/u")))
    tsnode.api.put_pod(pod_doc("w1", {GPU: 1}))
    tsnode.api.put_pod(pod_doc("w2", {GPU: 2}))
    tsnode.step()
    got = tsnode.assigned()
    g0 = [timeslicing.device_id(tsnode.uuid(0), i) for i in range(4)]
    assert sorted((*got["ns/w1"], *got["ns/w2"])) == g0[1:]
    used = ("used", None)
    assert tsnode.states(0) == [("reserved", None), used, used, used]
    assert tsnode.states(1) == [("free", None)] * 4
    tsnode.api.delete_pod("ns", "w2")
    tsnode.step()
    assert sorted(tsnode.assigned()) == ["ns/w1"]
    assert [s for s, _ in tsnode.states(0)].count("used") == 1


def test_whole_gpus_not_time_sliced_are_left_to_the_kubelet() -> None:
    pod = boundpods.bound_pod(pod_doc("w", {GPU: 1}))
    assert pod is not None and pod.requests == ()
    whole = {GPU: (devices.Device("GPU-0", 0, devices.Health.HEALTHY),)}
    assert standin.with_replicas(pod, whole) is pod
    shared = {GPU: (devices.Device("GPU-0::0", 0, devices.Health.HEALTHY),)}
    assert standin.with_replicas(pod, shared).requests == ((GPU, 1),)


def test_the_stand_in_never_gives_a_unified_pods_replica_to_another_pod() -> None:
    pod = boundpods.BoundPod("ns", "w", NODE, T0, ((GPU, 1),), None, "w")
    offered = {GPU: tuple(devices.Device(f"GPU-0::{i}", 0, devices.Health.HEALTHY) for i in (0, 1))}
    got = standin.assign([pod], advertised=offered, reserved={}, previous={},
                         busy=frozenset({"GPU-0::0"}))  # fmt: skip
    assert got == {"ns/w": ("GPU-0::1",)}


def test_a_missing_replica_is_refused_by_name() -> None:
    pod = resolving.GpuPod("ns", "u", "u", T0, (resolving.Container("c", False, 1),), True)
    found = resolving.resolve(
        requested=("x",),
        pods=(pod,),
        reservations={"ns/u": (resolving.time_slice(0, 3, uuid=None),)},
        allocated={},
        pool=frozenset(),
    )
    assert found == resolving.Refusal(
        "pod ns/u: the time-slicing replicas reserved for it are not served: GPU 0 replica 3"
    )


# --- the device plugin: Allocate of a kept replica ----------------------------------------------


class Source:
    """The unified pool's inputs as the plugin reads them: one unified pod u with replica 2 of
    GPU 0 kept for it, and an NVIDIA-style pod w, newer."""

    def __init__(self) -> None:
        kept = resolving.time_slice(0, 2, uuid="GPU-0::2", model=H100)
        u = resolving.GpuPod("ns", "u", "u", T0, (resolving.Container("c", False, 1),), True)
        w = resolving.GpuPod(
            "ns", "w", "w", "2026-01-01T00:00:01Z", (resolving.Container("c", False, 1),), False
        )
        self.now = resolving.Inputs((u, w), {"ns/u": (kept,)}, frozenset({"GPU-0::2"}))

    def inputs(self, *, fresh: bool) -> resolving.Inputs:
        return self.now


def test_the_plugin_gives_a_unified_pod_its_kept_replica_and_records_it(tmp_path: Path) -> None:
    plugin = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=tmp_path, strategy=devices.MigStrategy.NONE),
        unified=Source(),
    )
    plugin.start(view(gpu(0)))
    plugin.set_sharing(ts(4))
    try:
        # GetPreferredAllocation steers the kubelet to u's replica; Allocate gives it whatever
        # the kubelet picked, and the ledger names u (the status reports it usedBy u).
        available = [f"GPU-0::{i}" for i in range(4)]
        assert plugin.preferred_devices(
            _resource(plugin), available=available, must_include=[], size=1
        ) == ("GPU-0::2",)
        (answer,) = plugin.allocate_containers(GPU, [["GPU-0::0"]])
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
        assert plugin.pod_allocations()["ns/u"].devices == {"GPU-0::2"}
        assert "GPU-0::2" in plugin.handed_out()
        # w, an NVIDIA-style pod, is steered off the kept replica and answered as NVIDIA's.
        got = plugin.preferred_devices(
            _resource(plugin), available=available, must_include=[], size=1
        )
        assert got != ("GPU-0::2",)
        (answer,) = plugin.allocate_containers(GPU, [list(got)])
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
        w = plugin.pod_allocations().get("ns/w")
        assert w is None or not w.unified
    finally:
        plugin.stop()


def _resource(plugin: serving.DevicePlugin) -> devices.Resource:
    return devices.Resource(GPU, plugin.advertised()[GPU])
