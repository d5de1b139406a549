"""Unified pods (``nvidia.com/gpu`` + ``gpumem``) served by MPS slices on a node in mode ``mps``:
a slice the GpuLayout spec reserves for a unified pod (``resource: nvidia.com/gpu``) is advertised
as one ``nvidia.com/gpu`` device with its slice ID, never replicated; the pool holds it as a
slice instance (set aside, remembered, in use, used by); Allocate resolves the pod to its slice;
the node counters count the sliced GPUs; the simulated kubelet and the fleet assign it and the
status reports it ``used`` by the pod; the GPU's MPS daemon runs for it (``docs/agent.md``,
"Unified pods on MPS slices")."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.agent import assembling, metrics, reconciling, running
from migpilot.agent.cluster import boundpods, holding, kubeapi
from migpilot.agent.deviceplugin import advertising, devices, replicating, resolving
from migpilot.agent.rules import changes
from migpilot.agent.sharing import mps as agent_mps
from migpilot.agent.sharing import slicing, unifying
from migpilot.gpu import clocks, emulated
from migpilot.gpu import mps as gpu_mps
from migpilot.kwok import standin
from migpilot.mig import catalog
from migpilot.planning import unified
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps
from tests.unit import followed_nodes
from tests.unit.test_agent_unifying import Ledger, _spec, pod_doc

H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30-24gb")
NODE = "node-a"
T0 = "2026-01-01T00:00:00Z"
GPU = "nvidia.com/gpu"
G10 = "nvidia.com/gpu-10gb"
MEM = "nvidia.com/gpumem"
S = devices.MpsSlice


def gpu(index: int, *, mig: bool = False, model: Any = H100) -> devices.Gpu:
    return devices.Gpu(index, f"GPU-{index}", model, "NVIDIA H100 80GB HBM3", 81559, mig)


def sliced(*sl: devices.MpsSlice, unified_ids: Sequence[str] = (), gpus: int = 2) -> Any:
    return devices.NodeDevices(
        gpus=tuple(gpu(i) for i in range(gpus)), mps_slices=sl, unified=frozenset(unified_ids)
    )


def ids(resources: Sequence[devices.Resource]) -> dict[str, list[str]]:
    return {r.name: [d.id for d in r.devices] for r in resources}


# --- advertising ---------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", [devices.MigStrategy.NONE, devices.MigStrategy.MIXED])
def test_a_unified_slice_is_an_nvidia_com_gpu_device_with_its_slice_id(
    strategy: devices.MigStrategy,
) -> None:
    view = sliced(S(0, 0, 10), S(0, 1, 10), S(0, 2, 40, 50), unified_ids=["GPU-0::mps-1"])
    got = ids(advertising.resources_for(view, strategy))
    # GPU 1 has no slice: whole. GPU 0 is never whole; its unified slice joins nvidia.com/gpu.
    assert got == {
        GPU: ["GPU-1", "GPU-0::mps-1"],
        G10: ["GPU-0::mps-0"],
        "nvidia.com/gpu-40gb": ["GPU-0::mps-2"],
    }


def test_only_unified_slices_leave_gpu_n_gb_and_an_xid_still_marks_them() -> None:
    view = sliced(S(0, 0, 10), S(1, 3, 20), unified_ids=["GPU-0::mps-0", "GPU-1::mps-3"])
    got = advertising.resources_for(view, devices.MigStrategy.MIXED, unhealthy={"GPU-1"})
    assert ids(got) == {GPU: ["GPU-0::mps-0", "GPU-1::mps-3"]}
    (r,) = got
    assert [d.health for d in r.devices] == [devices.Health.HEALTHY, devices.Health.UNHEALTHY]


def test_a_unified_slice_is_never_replicated_by_the_sharing_config() -> None:
    config = sharing_config.parse(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - name: nvidia.com/gpu\n"
        "      replicas: 3\n",
        source="cfg",
    )
    view = sliced(S(0, 0, 10), S(0, 1, 10), unified_ids=["GPU-0::mps-1"])
    plain = advertising.resources_for(view, devices.MigStrategy.NONE)
    shared = replicating.share(plain, view, config, mps_root="/run/mps")
    # GPU 1 is shared by the config; the unified slice passes as it is, beside its replicas.
    assert ids(shared.resources) == {
        GPU: ["GPU-1::0", "GPU-1::1", "GPU-1::2", "GPU-0::mps-1"],
        G10: ["GPU-0::mps-0"],
    }
    assert [d.resource for d in shared.daemons] == ["gpu-0"]
    # Only unified slices on the GPU: its daemon still runs, with the slice as a client.
    alone = sliced(S(0, 1, 10), unified_ids=["GPU-0::mps-1"], gpus=1)
    out = replicating.share(
        advertising.resources_for(alone, devices.MigStrategy.NONE), alone, sharing_config.EMPTY
    )
    assert ids(out.resources) == {GPU: ["GPU-0::mps-1"]}
    (daemon,) = out.daemons
    assert daemon.resource == "gpu-0" and daemon.devices[0].pinned_limit_mib == 10 * 1024


# --- resolving -----------------------------------------------------------------------------------


def pod(name: str, *asks: unified.GpuAsk, created: str = T0) -> resolving.GpuPod:
    containers = tuple(resolving.Container(f"c{i}", False, a.count, a) for i, a in enumerate(asks))
    return resolving.GpuPod("ns", name, f"uid-{name}", created, containers, True)


def sl(slice_id: int, gb: int, *, served: bool = True, cores: int | None = None) -> Any:
    uuid = f"GPU-0::mps-{slice_id}" if served else None
    return resolving.mps_slice(0, slice_id, gb, uuid=uuid, model=H100, cores=cores)


def test_a_slice_instance_reads_as_a_slice() -> None:
    assert str(sl(3, 10)) == "GPU 0 MPS slice 3 (10 GB)"
    assert sl(3, 10).is_slice and not resolving.Instance(0, 0, "1g.10gb", "M").is_slice


def test_a_unified_pod_is_resolved_to_its_own_slice() -> None:
    a, b = pod("a", unified.GpuAsk(1, 8000)), pod("b", unified.GpuAsk(1, 20000), created="T1")
    reservations = {"ns/a": (sl(1, 10),), "ns/b": (sl(2, 20),)}
    common: dict[str, Any] = {
        "pods": (a, b),
        "reservations": reservations,
        "pool": frozenset({"GPU-0::mps-1", "GPU-0::mps-2"}),
    }
    first = resolving.resolve(requested=["GPU-0::mps-2"], allocated={}, **common)
    assert isinstance(first, resolving.Decision)
    assert first.pod is a and first.device_ids == ("GPU-0::mps-1",)
    ledger = {"ns/a": resolving.PodAllocation("uid-a", True, (("c0", first.device_ids),))}
    second = resolving.resolve(requested=["GPU-0::mps-1"], allocated=ledger, **common)
    assert isinstance(second, resolving.Decision)
    assert second.pod is b and second.device_ids == ("GPU-0::mps-2",)
    # Steering: the kubelet is told to pick b's slice.
    got = resolving.preferred(
        second,
        available=["GPU-0::mps-1", "GPU-0::mps-2"],
        must_include=[],
        size=1,
        pool=common["pool"],
    )
    assert got == ("GPU-0::mps-2",)


def test_a_slice_not_served_or_held_by_another_is_refused_naming_the_slice() -> None:
    a = pod("a", unified.GpuAsk(1, 8000))
    missing = resolving.resolve(
        requested=["x"], pods=(a,), reservations={"ns/a": (sl(4, 10, served=False),)},
        allocated={}, pool=frozenset(),
    )  # fmt: skip
    assert missing == resolving.Refusal(
        "pod ns/a: the MPS slices reserved for it are not served: GPU 0 MPS slice 4 (10 GB)"
    )
    other = {"ns/z": resolving.PodAllocation("uid-z", True, (("c", ("GPU-0::mps-4",)),))}
    held = resolving.resolve(
        requested=["x"], pods=(a,), reservations={"ns/a": (sl(4, 10),)}, allocated=other,
        pool=frozenset(),
    )  # fmt: skip
    assert isinstance(held, resolving.Refusal) and "MPS slices reserved" in held.message


@given(
    sizes=st.lists(st.integers(1, 80), min_size=1, max_size=6, unique=True),
    need=st.integers(1, 80 * 1024),
    cores=st.one_of(st.none(), st.integers(1, 100)),
)
def test_a_container_gets_the_smallest_reserved_slice_that_serves_its_ask(
    sizes: list[int], need: int, cores: int | None
) -> None:
    """Among several slices reserved for one pod (the planner gives one per container; the rank
    must still be sound), a slice that serves the ask comes first, then the smallest."""
    a = pod("a", unified.GpuAsk(1, need, None, cores))
    mine = tuple(sl(i, gb, cores=50 if i % 2 else None) for i, gb in enumerate(sizes))
    found = resolving.resolve(
        requested=["x"], pods=(a,), reservations={"ns/a": mine}, allocated={}, pool=frozenset()
    )
    assert isinstance(found, resolving.Decision)
    (chosen,) = [i for i in mine if i.uuid == found.device_ids[0]]

    def serves(i: resolving.Instance) -> bool:
        assert i.memory_gb is not None
        return i.memory_gb * 1024 >= need and (cores is None or (i.cores or 100) >= cores)

    fits = [i for i in mine if serves(i)]
    if fits:
        assert serves(chosen)
        assert chosen.memory_gb == min(i.memory_gb or 0 for i in fits)
    else:
        assert chosen.memory_gb == min(sizes)


# --- the pool alone ------------------------------------------------------------------------------


def slice_doc(
    ident: int, gb: int, reserved: str | None = None, *, unified_pod: bool = True
) -> dict[str, Any]:
    out: dict[str, Any] = {"id": ident, "memoryGB": gb}
    if reserved is not None:
        out["reservedFor"] = reserved
        if unified_pod:
            out["resource"] = GPU
    return out


def mps_spec(*slices: dict[str, Any]) -> dict[str, Any]:
    return {"gpus": [{"index": 0, "mps": list(slices)}]}


def _pool(api: kubeapi.InMemoryNodeApi, book: boundpods.PodBook) -> unifying.UnifiedPool:
    return unifying.UnifiedPool(api, node=NODE, pods=book, spec=lambda: _spec(api))


def test_the_pool_sets_aside_the_slices_reserved_for_unified_pods() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.put_spec(
        NODE,
        mps_spec(
            slice_doc(0, 10, "ns/u"),  # for a unified pod (the controller says so)
            slice_doc(1, 10, "ns/m", unified_pod=False),  # for a gpu-10gb pod
            slice_doc(2, 20),
            slice_doc(3, 20, "ns/later"),  # not served yet
        ),
    )
    book = boundpods.PodBook()
    book.listed([])
    pool = _pool(api, book)
    view = sliced(S(0, 0, 10), S(0, 1, 10), S(0, 2, 20), gpus=1)
    out = pool.update(view)
    assert out.unified == {"GPU-0::mps-0"}
    assert ids(advertising.resources_for(out, devices.MigStrategy.MIXED)) == {
        GPU: ["GPU-0::mps-0"],
        G10: ["GPU-0::mps-1"],
        "nvidia.com/gpu-20gb": ["GPU-0::mps-2"],
    }
    got = pool.inputs(fresh=False).reservations
    assert got["ns/u"] == (resolving.mps_slice(0, 0, 10, uuid="GPU-0::mps-0", model=H100),)
    assert got["ns/later"] == (resolving.mps_slice(0, 3, 20, uuid=None, model=H100),)
    assert api.pod_gets == 0


def test_a_bound_pods_slice_dropped_before_allocate_is_remembered_and_kept_served() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.put_spec(NODE, mps_spec(slice_doc(5, 10, "ns/u")))
    api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)
    pool = _pool(api, book)
    filt = slicing.SliceFilter(spec=lambda: _spec(api), held=pool.in_use)
    bare = devices.NodeDevices(gpus=(gpu(0),))
    assert pool.update(filt.update(bare)).unified == {"GPU-0::mps-5"}
    assert pool.in_use() == frozenset()  # the spec keeps it
    api.put_spec(NODE, mps_spec(slice_doc(0, 40)))  # dropped before the kubelet's Allocate
    view = pool.update(filt.update(bare))
    assert view.unified == {"GPU-0::mps-5"}
    assert pool.in_use() == {"GPU-0::mps-5"}
    assert view.slice_device_ids()["GPU-0::mps-5"] == S(0, 5, 10)  # still served, its size kept
    (mine,) = pool.inputs(fresh=False).reservations["ns/u"]
    assert mine.uuid == "GPU-0::mps-5" and mine.memory_gb == 10
    api.delete_pod("ns", "u")
    book.listed(api.list_pods(node=NODE).items)
    assert pool.update(filt.update(bare)).unified == frozenset()  # the pass forgets it
    assert pool.in_use() == frozenset()
    view = pool.update(filt.update(bare))  # and the next one no longer serves it
    assert view.unified == frozenset() and view.mps_slices == (S(0, 0, 40),)


def test_an_allocated_slice_stays_in_the_pool_and_is_used_by_its_pod() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.put_spec(NODE, mps_spec(slice_doc(1, 20, "ns/u"), slice_doc(2, 10)))
    api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)
    ledger = Ledger({"ns/u": resolving.PodAllocation("u", True, (("c", ("GPU-0::mps-1",)),))})
    pool = _pool(api, book)
    pool.attach(ledger)
    view = sliced(S(0, 1, 20), S(0, 2, 10), gpus=1)
    api.put_spec(NODE, mps_spec(slice_doc(1, 20), slice_doc(2, 10)))  # allocated: dropped
    assert pool.update(view).unified == {"GPU-0::mps-1"}
    assert pool.used_by() == {"GPU-0::mps-1": "ns/u"}
    (mine,) = pool.inputs(fresh=False).reservations["ns/u"]
    assert str(mine) == "GPU 0 MPS slice 1 (20 GB)"
    statuses = slicing.statuses(
        view, spec=_spec(api), in_use=frozenset({"GPU-0::mps-1"}), used_by=pool.used_by()
    )
    assert [(s.id, s.state.value, s.used_by) for s in statuses[0]] == [
        (1, "used", "ns/u"),
        (2, "free", None),
    ]
    # The pod goes (a read confirms it): released, out of the pool.
    api.delete_pod("ns", "u")
    book.listed(api.list_pods(node=NODE).items)
    assert pool.update(view).unified == frozenset()
    assert ledger.entries == {}


def test_a_unified_pod_on_slices_holds_no_mig_profile() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.put_spec(NODE, mps_spec(slice_doc(0, 10, "ns/u")))
    api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)
    pool = _pool(api, book)
    pool.update(sliced(S(0, 0, 10), gpus=1))
    (bound,) = book.pods(NODE)
    assert pool.profiles_for(bound) == ()
    api.put_spec(NODE, mps_spec())  # no reservation, no MIG GPU: still nothing to hold
    pool.update(devices.NodeDevices(gpus=(gpu(0),)))
    assert pool.profiles_for(bound) == ()


# --- the node counters ---------------------------------------------------------------------------


@pytest.mark.parametrize("model", [H100, A30])
def test_gpus_serving_slices_count_their_whole_memory(model: Any) -> None:
    view = devices.NodeDevices(
        gpus=(gpu(0, mig=True, model=model), gpu(1, model=model), gpu(2, model=model)),
        mps_slices=(S(1, 0, 1),),
    )
    # GPU 0 (MIG) as before; GPU 1 (slices) its memory; GPU 2 (MIG off, no slice) nothing.
    assert unifying.counters(view) == {
        MEM: unified.memory_mib(model) + sharing_mps.memory_gb(model) * 1024,
        "nvidia.com/gpumem-percentage": 200,
        "nvidia.com/gpucores": 200,
    }


def test_on_an_mps_node_every_gpu_with_mig_disabled_counts_slices_or_not() -> None:
    # The node's mode says its GPUs are sliced: the counters do not wait for (or lose a GPU
    # with) its last slice, so a pod is never refused by a counter its slice would have raised.
    view = devices.NodeDevices(
        gpus=(gpu(0, model=H100), gpu(1, model=H100)), mps_slices=(S(0, 0, 10),)
    )
    assert unifying.counters(view)[MEM] == sharing_mps.memory_gb(H100) * 1024
    assert unifying.counters(view, mps_node=True) == {
        MEM: 2 * sharing_mps.memory_gb(H100) * 1024,
        "nvidia.com/gpumem-percentage": 200,
        "nvidia.com/gpucores": 200,
    }
    api = kubeapi.InMemoryNodeApi()
    mode = {"mps": False}
    listener = unifying.NodeCounters(api, node="n", mps_node=lambda: mode["mps"])
    for mps in (False, True):
        mode["mps"] = mps
        listener.passed(state={}, report=None, labels={}, view=view)
        want = unifying.counters(view, mps_node=mps)[MEM]
        assert api.node_resources["n"][MEM] == str(want)


# --- the agent in process: simulated kubelet, pool, slices, MPS daemon --------------------------


@dataclass
class Node:
    api: kubeapi.InMemoryNodeApi
    gpus: emulated.EmulatedBackend
    cluster: assembling.KubeSide
    agent: running.Agent

    @property
    def kubelet(self) -> standin.SimulatedKubelet:
        assert isinstance(self.cluster.kubelet, standin.SimulatedKubelet)
        return self.cluster.kubelet

    @property
    def uuid(self) -> str:
        return self.gpus.gpus()[0].uuid

    def step(self) -> changes.Report:
        self.cluster.source.sync()
        self.cluster.pods.listed(self.api.list_pods(node=NODE).items)
        return self.agent.reconcile()

    def slices(self) -> dict[int, tuple[int, str, str | None]]:
        return followed_nodes.slice_states(self.api, NODE)

    def resources(self) -> dict[str, str]:
        return dict(self.api.node_resources.get(NODE, {}))


def wire(api: kubeapi.InMemoryNodeApi, gpus: emulated.EmulatedBackend, root: Path) -> Node:
    """As ``migpilot agent --kubelet simulated`` wires it (:func:`assembling.kube_side`)."""
    followed = followed_nodes.follow(api, NODE)
    cluster = assembling.kube_side(
        api,
        source=followed.source,
        pods=followed.book,
        strategy=devices.MigStrategy.MIXED,
        standin=standin.stand_in,
    )
    wired = cluster.wire(reconciling.RunningProcesses(gpus), gpus=gpus)
    in_use, listener = wired.in_use, wired.listener
    clock = clocks.VirtualClock()
    agent = running.Agent(
        gpus=gpus,
        in_use=in_use,
        source=cluster.desired_source(),
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clock,
        settings=running.AgentSettings(mps_root=str(root)),
        listener=listener,
        view_filter=cluster.view_filter(),
        mps=agent_mps.MpsSupervisor(gpu_mps.EmulatedMps(clock=clock), clock=clock),
    )
    return Node(api, gpus, cluster, agent)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    api = kubeapi.InMemoryNodeApi()
    api.put_node(NODE, {})
    gpus = emulated.EmulatedBackend([H100] * 2, durable=False, mig_enabled=False)
    yield wire(api, gpus, tmp_path / "mps")
    api.close()
    gpus.close()


def test_a_kwok_node_serves_a_unified_pod_its_slice_and_reports_it_used(node: Node) -> None:
    node.api.put_spec(
        NODE,
        mps_spec(slice_doc(0, 10), slice_doc(1, 10, "ns/u"), slice_doc(2, 20, "ns/v")),
    )
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}, node=None))  # reserved, not bound yet
    report = node.step()
    assert not report.refusals and not report.applied
    # GPU 1 whole, u's and v's slices as nvidia.com/gpu; the counters count GPU 0's memory.
    assert node.resources() == {
        GPU: "3",
        G10: "1",
        MEM: str(80 * 1024),
        "nvidia.com/gpumem-percentage": "100",
        "nvidia.com/gpucores": "100",
    }
    assert node.slices() == {0: (10, "free", None), 1: (10, "reserved", None),
                             2: (20, "reserved", None)}  # fmt: skip
    assert [s.name for s in node.agent.mps_statuses()] == ["gpu-0"]  # its daemon runs
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}, phase="Running"))  # bound; KWOK runs it
    node.api.put_pod(pod_doc("v", {GPU: 1, MEM: 16000}, phase="Running"))
    node.step()
    assert node.kubelet.assigned() == {
        "ns/u": (f"{node.uuid}::mps-1",),
        "ns/v": (f"{node.uuid}::mps-2",),
    }
    assert node.slices() == {0: (10, "free", None), 1: (10, "used", "ns/u"),
                             2: (20, "used", "ns/v")}  # fmt: skip
    # The controller drops u's reservation once allocated: its slice stays, used, in the pool.
    node.api.put_spec(NODE, mps_spec(slice_doc(0, 10), slice_doc(1, 10), slice_doc(2, 20)))
    node.step()
    assert node.slices()[1] == (10, "used", "ns/u")
    assert node.resources()[GPU] == "3"
    # u goes: its slice is free again and advertised as gpu-10gb.
    node.api.delete_pod("ns", "u")
    node.step()
    assert node.slices()[1] == (10, "free", None)
    assert node.resources()[G10] == "2" and node.resources()[GPU] == "2"


def test_a_restarted_stand_in_gives_a_unified_pod_back_its_slice(
    node: Node, tmp_path: Path
) -> None:
    node.api.put_spec(NODE, mps_spec(slice_doc(0, 10), slice_doc(1, 20, "ns/u")))
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}, phase="Running"))
    node.step()
    node.api.put_spec(NODE, mps_spec(slice_doc(0, 10)))  # dropped once allocated
    node.step()
    held = node.kubelet.assigned()
    assert held == {"ns/u": (f"{node.uuid}::mps-1",)}
    again = wire(node.api, node.gpus, tmp_path / "mps")
    again.step()
    again.step()
    assert again.kubelet.assigned() == held
    assert again.slices() == {0: (10, "free", None), 1: (20, "used", "ns/u")}


def test_the_bound_pods_count_keeps_no_mig_instance_for_a_pod_on_slices(node: Node) -> None:
    node.api.put_spec(NODE, mps_spec(slice_doc(1, 10, "ns/u")))
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    node.step()
    assert node.cluster.pods is not None and node.cluster.pool is not None
    hold = holding.BoundPodsHold(
        node.cluster.pods,
        node=NODE,
        gpus=node.gpus,
        allocated=reconciling.InUseSet(),
        unified=node.cluster.pool.profiles_for,
    )
    assert hold.in_use() == frozenset()
