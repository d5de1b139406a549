"""The agent serves the GpuLayout's MPS slices: device IDs, advertising, Allocate's MPS answer,
slices kept while a pod holds them, their states in the status, and the agent in process with
the simulated kubelet and the emulated MPS daemon (``docs/agent.md``, "MPS slices")."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.agent import metrics, reconciling, running
from migpilot.agent.cluster import boundpods, following, kubeapi, reporting
from migpilot.agent.deviceplugin import (
    advertising,
    allocating,
    devices,
    replicating,
    serving,
    slices,
)
from migpilot.agent.rules import changes, desired
from migpilot.agent.sharing import mps as agent_mps
from migpilot.agent.sharing import slicing
from migpilot.api import gpulayouts as gl
from migpilot.gpu import backend, clocks, emulated
from migpilot.gpu import mps as gpu_mps
from migpilot.kwok import standin
from migpilot.mig import catalog
from migpilot.planning import modes
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps
from migpilot.sharing import replicas
from tests.unit import followed_nodes

H100 = catalog.resolve_gpu("h100-80gb")
NODE = "node-a"
T0 = "2026-01-01T00:00:00Z"


def gpu(index: int, *, mig: bool = False) -> devices.Gpu:
    return devices.Gpu(index, f"GPU-{index}", H100, "NVIDIA H100 80GB HBM3", 81559, mig)


def node_with(*sl: devices.MpsSlice, gpus: int = 2) -> devices.NodeDevices:
    return devices.NodeDevices(gpus=tuple(gpu(i) for i in range(gpus)), mps_slices=sl)


S = devices.MpsSlice

# --- device IDs ---------------------------------------------------------------------------------


def test_a_slice_id_names_its_gpu_and_is_told_from_a_replica() -> None:
    ident = devices.slice_device_id("GPU-abc", 7)
    assert ident == "GPU-abc::mps-7"
    assert devices.parse_slice_id(ident) == ("GPU-abc", 7)
    # NVIDIA's replica parsing maps it to its GPU, as it maps a replica.
    assert replicas.real_id(ident) == "GPU-abc" and replicas.is_replica(ident)
    for other in ("GPU-abc", "GPU-abc::2", "MIG-x", "GPU-abc::mps-", "GPU-abc::mps-07", "::mps-1"):
        assert devices.parse_slice_id(other) is None, other


def test_the_resource_is_the_planners_name() -> None:
    name = S(0, 0, 10).resource
    assert name == "nvidia.com/gpu-10gb" and modes.mps_gb(name, where="x") == 10


def test_a_slice_on_a_mig_enabled_gpu_or_twice_is_refused() -> None:
    with pytest.raises(errors.AgentConfigError, match="MIG mode is enabled"):
        devices.NodeDevices(gpus=(gpu(0, mig=True),), mps_slices=(S(0, 0, 10),))
    with pytest.raises(errors.AgentConfigError, match="listed twice"):
        node_with(S(0, 1, 10), S(0, 1, 20))
    with pytest.raises(errors.AgentConfigError, match="unknown GPU"):
        node_with(S(5, 1, 10))


# --- advertising --------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(devices.MigStrategy))
def test_a_sliced_gpu_is_advertised_as_its_slices_never_whole(
    strategy: devices.MigStrategy,
) -> None:
    view = node_with(S(0, 0, 10), S(0, 1, 10), S(0, 2, 40, 50))
    got = {r.name: [d.id for d in r.devices] for r in advertising.resources_for(view, strategy)}
    assert got == {
        "nvidia.com/gpu": ["GPU-1"],
        "nvidia.com/gpu-10gb": ["GPU-0::mps-0", "GPU-0::mps-1"],
        "nvidia.com/gpu-40gb": ["GPU-0::mps-2"],
    }


def test_an_xid_on_the_gpu_makes_its_slices_unhealthy() -> None:
    view = node_with(S(0, 0, 10), S(1, 3, 10))
    (res,) = slices.resources(view, unhealthy={"GPU-0"})
    assert [(d.id, d.health) for d in res.devices] == [
        ("GPU-0::mps-0", devices.Health.UNHEALTHY),
        ("GPU-1::mps-3", devices.Health.HEALTHY),
    ]


def test_slices_pass_the_sharing_config_unreplicated_with_their_own_daemon() -> None:
    config = sharing_config.parse(
        "version: v1\nsharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n",
        source="t",
    )
    view = node_with(S(0, 0, 10), S(0, 1, 30))
    plain = advertising.resources_for(view, devices.MigStrategy.NONE)
    shared = replicating.share(plain, view, config, mps_root="/r")
    got = {r.name: [d.id for d in r.devices] for r in shared.resources}
    assert got == {
        "nvidia.com/gpu": ["GPU-1::0", "GPU-1::1"],
        "nvidia.com/gpu-10gb": ["GPU-0::mps-0"],
        "nvidia.com/gpu-30gb": ["GPU-0::mps-1"],
    }
    assert [d.resource for d in shared.daemons] == ["nvidia.com/gpu", "gpu-0"]
    daemon = shared.slice_daemons()[0]
    assert (daemon.pipe_dir, daemon.log_dir) == ("/r/gpu-0/pipe", "/r/gpu-0/log")
    spec = agent_mps.spec_of(daemon)
    assert spec.name == "gpu-0" and spec.devices == ("GPU-0",)
    assert spec.pinned_mem_limit_mib == 10 * 1024 and spec.active_thread_percentage == 100


def test_new_slices_change_the_daemons_defaults_not_its_process() -> None:
    one = agent_mps.spec_of(slices.daemons(node_with(S(0, 0, 40)), root="/r")[0][1])
    two = agent_mps.spec_of(slices.daemons(node_with(S(0, 0, 40), S(0, 1, 10)), root="/r")[0][1])
    assert one != two and one.same_process(two)


# --- Allocate -----------------------------------------------------------------------------------


def _allocate(
    view: devices.NodeDevices,
    ids: list[str],
    settings: allocating.AllocateSettings | None = None,
) -> allocating.ContainerAllocation:
    plain = advertising.resources_for(view, devices.MigStrategy.MIXED)
    shared = replicating.share(plain, view, sharing_config.EMPTY, mps_root="/run/mps")
    (resource,) = [
        r for r in shared.resources if any(d.id in ids for d in r.devices) or not r.devices
    ][:1] or [devices.Resource("nvidia.com/gpu-10gb", ())]
    return slices.container_allocation(
        resource,
        ids,
        node=view,
        daemons=shared.slice_daemons(),
        settings=settings or allocating.AllocateSettings(),
    )


def test_allocate_gives_the_slice_its_mps_limits_and_mounts() -> None:
    view = node_with(S(0, 0, 10), S(0, 4, 20, 30))
    got = _allocate(view, ["GPU-0::mps-4"])
    assert got.envs == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-0",
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/gpu-0/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
    }
    assert got.mounts == (("/run/mps/gpu-0/pipe", "/mps/gpu-0/pipe"), ("/run/mps/shm", "/dev/shm"))
    # No compute share: no thread limit.
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in _allocate(view, ["GPU-0::mps-0"]).envs


def test_allocate_names_the_gpu_by_cdi_under_the_cdi_strategy() -> None:
    settings = allocating.AllocateSettings(
        device_list_strategies=(devices.DeviceListStrategy.CDI_CRI,)
    )
    got = _allocate(node_with(S(1, 0, 10)), ["GPU-1::mps-0"], settings)
    assert got.cdi_devices == ("k8s.device-plugin.nvidia.com/gpu=GPU-1",)
    assert "NVIDIA_VISIBLE_DEVICES" not in got.envs
    assert got.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"


def test_two_slices_of_one_gpu_add_up_and_two_gpus_are_refused() -> None:
    view = node_with(S(0, 0, 10, 20), S(0, 1, 10, 30), S(1, 0, 10))
    got = _allocate(view, ["GPU-0::mps-0", "GPU-0::mps-1"])
    assert got.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert got.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
    with pytest.raises(allocating.AllocationError, match=r"on 2 GPUs \(0, 1\)"):
        _allocate(view, ["GPU-0::mps-0", "GPU-1::mps-0"])
    with pytest.raises(allocating.AllocationError, match="unknown device: GPU-0::mps-9"):
        _allocate(view, ["GPU-0::mps-9"])


def test_a_slice_the_node_view_lacks_is_unknown_not_a_crash() -> None:
    """The pure answer given a resource list and a node view that disagree (a slice listed
    that the node no longer has): NVIDIA's unknown-device error, not a KeyError."""
    listed = node_with(S(0, 0, 10), S(0, 1, 10))
    (resource,) = slices.resources(listed)
    now = node_with(S(0, 0, 10))
    daemons = dict(slices.daemons(now, root="/mps"))
    with pytest.raises(allocating.AllocationError, match="unknown device: GPU-0::mps-1"):
        slices.container_allocation(
            resource,
            ["GPU-0::mps-1"],
            node=now,
            daemons=daemons,
            settings=allocating.AllocateSettings(),
        )


def test_the_plugin_records_the_slice_and_advertises_it(tmp_path: Path) -> None:
    plugin = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=tmp_path, mps_root=str(tmp_path / "mps"))
    )
    view = node_with(S(0, 0, 10))
    plugin.start(view)
    try:
        assert plugin.advertised()["nvidia.com/gpu-10gb"][0].id == "GPU-0::mps-0"
        (answer,) = plugin.allocate_containers("nvidia.com/gpu-10gb", [["GPU-0::mps-0"]])
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-0"
        assert plugin.handed_out() == {"GPU-0::mps-0"}
        assert [d.resource for d in plugin.mps_daemons()] == ["gpu-0"]
        # Dropped from the view: no longer advertised, the ledger forgets it.
        plugin.update(node_with())
        assert plugin.advertised()["nvidia.com/gpu-10gb"] == ()
        assert plugin.handed_out() == frozenset() and plugin.mps_daemons() == ()
        # An Allocate the kubelet sent from the old list is told the slice is unknown: the
        # advertised list and the node's slices are read together, never one old, one new.
        with pytest.raises(allocating.AllocationError, match="unknown device: GPU-0::mps-0"):
            plugin.allocate_containers("nvidia.com/gpu-10gb", [["GPU-0::mps-0"]])
    finally:
        plugin.stop()


# --- which slices are served --------------------------------------------------------------------


def layout_spec(*gpus: tuple[int, list[gl.SliceSpec]]) -> gl.LayoutSpec:
    return gl.LayoutSpec(tuple(gl.GpuSpec(i, None, (), tuple(s)) for i, s in gpus))


def test_the_spec_slices_are_served_on_gpus_with_mig_off_only() -> None:
    view = devices.NodeDevices(gpus=(gpu(0), gpu(1, mig=True)))
    spec = layout_spec((0, [gl.SliceSpec(0, 10)]), (1, [gl.SliceSpec(0, 10)]))
    assert slicing.served(view, spec=spec, held=(), known={}) == (S(0, 0, 10),)
    (problem,) = slicing.problems(view, spec)
    assert problem.startswith("GPU 1:") and "MIG mode is enabled" in problem
    spec3 = layout_spec((3, [gl.SliceSpec(0, 10)]))
    assert "no such GPU" in slicing.problems(view, spec3)[0]


def test_a_held_slice_stays_with_its_size_until_released() -> None:
    view = node_with()
    known = {"GPU-0::mps-1": S(0, 1, 20, 40), "GPU-0::mps-2": S(0, 2, 10)}
    # The spec drops slice 1 (held) and 2 (free), and resizes... a held one stays as it was.
    spec = layout_spec((0, [gl.SliceSpec(3, 40)]))
    got = slicing.served(view, spec=spec, held={"GPU-0::mps-1", "GPU-0"}, known=known)
    assert got == (S(0, 1, 20, 40), S(0, 3, 40))
    spec2 = layout_spec((0, [gl.SliceSpec(1, 60)]))
    assert slicing.served(view, spec=spec2, held={"GPU-0::mps-1"}, known=known) == (
        S(0, 1, 20, 40),
    )
    # Released: the spec's slices alone.
    assert slicing.served(view, spec=spec2, held=(), known=known) == (S(0, 1, 60),)


slice_specs = st.lists(
    st.builds(
        gl.SliceSpec,
        st.integers(0, 6),
        st.integers(1, 20),
        st.one_of(st.none(), st.integers(1, 100)),
    ),
    max_size=6,
    unique_by=lambda s: s.id,
)


@given(
    before=slice_specs,
    after=slice_specs,
    held=st.sets(st.integers(0, 6)),
)
def test_no_slice_a_pod_holds_is_ever_shrunk_moved_or_dropped(
    before: list[gl.SliceSpec], after: list[gl.SliceSpec], held: set[int]
) -> None:
    view = node_with(gpus=1)
    first = slicing.served(view, spec=layout_spec((0, before)), held=(), known={})
    served_ids = dataclass_ids(first)
    holding = {devices.slice_device_id("GPU-0", i) for i in held} & served_ids.keys()
    known = dataclass_ids(first)
    second = slicing.served(view, spec=layout_spec((0, after)), held=holding, known=known)
    now = dataclass_ids(second)
    for device_id in holding:
        assert now[device_id] == known[device_id]
    for sl in after:
        device_id = devices.slice_device_id("GPU-0", sl.id)
        if device_id not in holding:
            assert now[device_id] == S(0, sl.id, sl.memory_gb, sl.cores)
    assert set(now) == holding | {devices.slice_device_id("GPU-0", s.id) for s in after}


def dataclass_ids(found: tuple[devices.MpsSlice, ...]) -> dict[str, devices.MpsSlice]:
    return devices.NodeDevices(gpus=(gpu(0),), mps_slices=found).slice_device_ids()


def test_statuses_say_used_reserved_free() -> None:
    view = node_with(S(0, 0, 10), S(0, 1, 10), S(0, 2, 20, 50), S(1, 0, 80))
    spec = layout_spec(
        (0, [gl.SliceSpec(0, 10), gl.SliceSpec(1, 10, None, "ns/r"), gl.SliceSpec(2, 20, 50)])
    )
    got = slicing.statuses(
        view,
        spec=spec,
        in_use=frozenset({"GPU-0::mps-2", "GPU-1::mps-0"}),
        used_by={"GPU-0::mps-2": "ns/p"},
    )
    u, r, f = gl.InstanceState.USED, gl.InstanceState.RESERVED, gl.InstanceState.FREE
    assert got == {
        0: (gl.SliceStatus(0, 10, None, f), gl.SliceStatus(1, 10, None, r),
            gl.SliceStatus(2, 20, 50, u, "ns/p")),
        1: (gl.SliceStatus(0, 80, None, u),),
    }  # fmt: skip


def test_the_filter_keeps_a_slice_the_status_reported_after_a_restart() -> None:
    status = gl.LayoutStatus(
        1,
        (
            gl.GpuStatus(
                0,
                "NVIDIA H100 80GB HBM3",
                "GPU-0",
                (),
                (gl.SliceStatus(5, 30, None, gl.InstanceState.USED, "ns/p"),),
            ),
        ),
    )
    layout = gl.GpuLayout(NODE, layout_spec((0, [gl.SliceSpec(0, 10)])), status, 2)
    held = {"GPU-0::mps-5"}
    f = slicing.SliceFilter(
        spec=lambda: layout.spec, held=lambda: frozenset(held), layout=lambda: layout
    )
    assert f.update(node_with()).mps_slices == (S(0, 0, 10), S(0, 5, 30))
    assert f.served_ids() == {"GPU-0::mps-0", "GPU-0::mps-5"}
    held.clear()
    assert f.update(node_with()).mps_slices == (S(0, 0, 10),)


# --- the status and the desired layouts ---------------------------------------------------------


def _state(*, mig: bool) -> dict[int, changes.GpuState]:
    gpus = emulated.EmulatedBackend([H100], durable=False, mig_enabled=mig)
    try:
        info = gpus.gpus()[0]
    finally:
        gpus.close()
    return {0: changes.GpuState(info, ())}


def test_the_status_lists_a_mig_off_gpu_with_its_slices_or_on_an_mps_node() -> None:
    state = _state(mig=False)
    slice_status = {0: (gl.SliceStatus(0, 10, None, gl.InstanceState.FREE),)}
    report = changes.Report(devices={}, applied=(), refusals=(), converged=True, duration_s=0.0)
    kw: dict[str, Any] = {
        "state": state, "in_use": frozenset(), "spec": None, "generation": 1,
        "report": report, "now": T0,
    }  # fmt: skip
    assert reporting.layout_status(**kw).gpus == ()  # a MIG node: as before
    (g,) = reporting.layout_status(**kw, mps=slice_status).gpus
    assert g.instances == () and g.mps == slice_status[0] and g.uuid == state[0].info.uuid
    (g,) = reporting.layout_status(**kw, mps_node=True).gpus
    assert g.mps == ()
    refused = reporting.layout_status(**kw, mps_problems=("GPU 0: MIG on",))
    cond = refused.conditions[0]
    assert (cond.status, cond.reason, cond.message) == (
        gl.ConditionStatus.FALSE, "Refused", "GPU 0: MIG on"
    )  # fmt: skip


@pytest.mark.parametrize("mig", [False, True])
def test_a_spec_with_slices_never_asks_for_a_mig_mode_change(mig: bool) -> None:
    info = _state(mig=mig)[0].info
    spec = layout_spec((0, [gl.SliceSpec(0, 10)]))
    assert desired.from_gpulayout(spec, gpus=[info]) == {}
    empty = gl.LayoutSpec((gl.GpuSpec(0, None, ()),))
    want = desired.from_gpulayout(empty, gpus=[info])
    assert want == ({0: changes.DesiredGpu(True, want[0].layout)} if mig else {})


# --- the agent in process, with the simulated kubelet and the emulated daemon --------------------


def pod_doc(name: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "default", "creationTimestamp": T0},
        "spec": {"nodeName": NODE, "containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {"phase": "Running"},
    }


def spec_doc(*slices_of_gpu0: dict[str, Any]) -> dict[str, Any]:
    return {"gpus": [{"index": 0, "mps": list(slices_of_gpu0)}]}


@dataclass
class Node:
    api: kubeapi.InMemoryNodeApi
    gpus: emulated.EmulatedBackend
    source: following.GpuLayoutSource
    book: boundpods.PodBook
    kubelet: standin.SimulatedKubelet
    daemons: gpu_mps.EmulatedMps
    agent: running.Agent

    def step(self) -> changes.Report:
        self.source.sync()
        self.book.listed(self.api.list_pods(node=NODE).items)
        return self.agent.reconcile()

    def slices(self) -> dict[int, tuple[int, str, str | None]]:
        return followed_nodes.slice_states(self.api, NODE)

    def resources(self) -> dict[str, str]:
        return self.api.node_resources[NODE]


def wire(api: kubeapi.InMemoryNodeApi, gpus: emulated.EmulatedBackend, root: Path) -> Node:
    """Part of what ``assembling.kube_side`` wires for ``--kubelet simulated`` (no plugin): the
    stand-in, the slices and the reporter."""
    followed = followed_nodes.follow(api, NODE)
    source, book, reserving = followed.source, followed.book, followed.reserving
    kubelet = standin.SimulatedKubelet(
        api,
        node=NODE,
        strategy=devices.MigStrategy.MIXED,
        pods=book,
        spec=reserving,
        held=lambda: standin.reported_used(source.layout()),
    )
    used = reconciling.AnyOf([reconciling.RunningProcesses(gpus), kubelet])
    sliced = slicing.SliceFilter(spec=reserving, held=used.in_use, layout=source.layout)
    reporter = following.KubeReporter(
        api, source=source, in_use=used, now=lambda: T0, used_by=kubelet.slice_holders
    )
    clock = clocks.VirtualClock()
    daemons = gpu_mps.EmulatedMps(clock=clock)
    agent = running.Agent(
        gpus=gpus,
        in_use=reconciling.AnyOf([used, source]),
        source=running.AlsoWatching(source, kubelet.fingerprint),
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clock,
        settings=running.AgentSettings(mps_root=str(root)),
        listener=running.Listeners([kubelet, reporter]),
        view_filter=running.ViewFilters([sliced]),
        mps=agent_mps.MpsSupervisor(daemons, clock=clock),
    )
    return Node(api, gpus, source, book, kubelet, daemons, agent)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    api = kubeapi.InMemoryNodeApi()
    gpus = emulated.EmulatedBackend([H100] * 2, durable=False, mig_enabled=False)
    yield wire(api, gpus, tmp_path / "mps")
    api.close()
    gpus.close()


def test_a_kwok_node_serves_slices_to_its_pods_and_keeps_a_held_one(node: Node) -> None:
    node.api.put_spec(
        NODE,
        spec_doc(
            {"id": 0, "memoryGB": 10},
            {"id": 1, "memoryGB": 10, "reservedFor": "default/p"},
            {"id": 2, "memoryGB": 40, "cores": 50},
        ),
    )
    report = node.step()
    assert not report.refusals and not report.applied  # no MIG mode change is asked for
    assert node.resources() == {"nvidia.com/gpu": "1", "nvidia.com/gpu-10gb": "2",
                                "nvidia.com/gpu-40gb": "1"}  # fmt: skip
    assert node.slices() == {0: (10, "free", None), 1: (10, "reserved", None),
                             2: (40, "free", None)}  # fmt: skip
    (status,) = node.agent.mps_statuses()
    assert status.name == "gpu-0"
    uuid = node.gpus.gpus()[0].uuid
    node.api.put_pod(pod_doc("p", {"nvidia.com/gpu-10gb": 1}))
    node.step()
    assert node.kubelet.assigned() == {"default/p": (f"{uuid}::mps-1",)}
    assert node.slices()[1] == (10, "used", "default/p")
    # The controller drops every slice: the held one stays advertised and used; the daemon too.
    node.api.put_spec(NODE, spec_doc())
    node.step()
    assert node.slices() == {1: (10, "used", "default/p")}
    assert node.resources()["nvidia.com/gpu-10gb"] == "1"
    assert node.resources()["nvidia.com/gpu-40gb"] == "0"
    assert [s.name for s in node.agent.mps_statuses()] == ["gpu-0"]
    # The pod goes: the slice is released, the GPU whole again, the daemon stopped.
    node.api.delete_pod("default", "p")
    node.step()
    node.step()
    assert node.resources()["nvidia.com/gpu-10gb"] == "0"
    assert node.resources()["nvidia.com/gpu"] == "2"
    assert node.agent.mps_statuses() == () or all(
        s.phase is agent_mps.Phase.STOPPED for s in node.agent.mps_statuses()
    )


def test_a_restarted_agent_keeps_the_slice_a_pod_holds(node: Node, tmp_path: Path) -> None:
    node.api.put_spec(NODE, spec_doc({"id": 3, "memoryGB": 20}))
    node.step()
    node.api.put_pod(pod_doc("p", {"nvidia.com/gpu-20gb": 1}))
    node.step()
    node.api.put_spec(NODE, spec_doc({"id": 4, "memoryGB": 60}))
    again = wire(node.api, node.gpus, tmp_path / "mps")
    again.step()
    again.step()
    assert again.slices() == {3: (20, "used", "default/p"), 4: (60, "free", None)}


def test_slices_on_a_mig_enabled_gpu_are_refused_in_the_status(tmp_path: Path) -> None:
    api = kubeapi.InMemoryNodeApi()
    gpus = emulated.EmulatedBackend([H100], durable=False)
    try:
        node = wire(api, gpus, tmp_path / "mps")
        api.put_spec(NODE, spec_doc({"id": 0, "memoryGB": 10}))
        node.step()
        got = api.layout(NODE)
        assert got is not None and got.status is not None
        cond = got.status.conditions[0]
        assert cond.reason == "Refused" and "MIG mode is enabled" in cond.message
        assert "nvidia.com/gpu-10gb" not in api.node_resources.get(NODE, {})
        assert node.agent.mps_statuses() == ()
        info: backend.GpuInfo = gpus.gpus()[0]
        assert info.mig is not None and info.mig.current  # left as it was
    finally:
        api.close()
        gpus.close()


def test_bound_pod_reads_slice_requests() -> None:
    got = boundpods.bound_pod(pod_doc("p", {"nvidia.com/gpu-10gb": 2, "cpu": "1"}))
    assert got is not None and got.requests == (("nvidia.com/gpu-10gb", 2),)


def test_client_settings_is_the_one_recipe() -> None:
    daemon = slices.daemons(node_with(S(0, 0, 10)), root="/x")[0][1]
    got = sharing_mps.client_settings(daemon, pinned_mib=[(0, 5), (2, 7)], threads=None)
    assert got.envs == {
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/gpu-0/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=5M,2=7M",
    }


def test_compute_shares_add_up_to_at_most_the_whole_gpu() -> None:
    view = node_with(S(0, 0, 10, 60), S(0, 1, 10, 50), S(0, 2, 10))
    both = _allocate(view, ["GPU-0::mps-0", "GPU-0::mps-1"])
    assert both.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "100"
    unlimited = _allocate(view, ["GPU-0::mps-0", "GPU-0::mps-2"])
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in unlimited.envs


def test_slice_refusals_name_the_resource() -> None:
    view = node_with(S(0, 0, 10), S(1, 0, 10))
    (resource,) = slices.resources(view)
    with pytest.raises(allocating.AllocationError) as err:
        _allocate(view, ["GPU-0::mps-0", "GPU-1::mps-0"])
    assert str(err.value) == (
        'invalid allocation request for "nvidia.com/gpu-10gb": MPS slices on 2 GPUs (0, 1) '
        "cannot share one container's MPS pipe; ask for one slice per container"
    )
    with pytest.raises(allocating.AllocationError) as err:
        slices.container_allocation(
            resource,
            ["GPU-1::mps-0"],
            node=view,
            daemons={},
            settings=allocating.AllocateSettings(),
        )
    assert str(err.value) == (
        'invalid allocation request for "nvidia.com/gpu-10gb": GPU 1 has no MPS daemon'
    )
