"""The agent's half of unified requests (agent/unifying.py) with the in-memory API and emulated
GPUs: the pool of instances set aside for unified pods, the node counters, the simulated
kubelet serving unified pods with the plugin's resolver, the GpuLayout status naming the pod
an instance is used by, and the bound pods' count keeping a unified pod's instances.

The single agent is wired by :func:`assembling.kube_side`, as ``migpilot agent --node --kubelet
simulated`` wires it, over :class:`kubeapi.InMemoryNodeApi`; nothing sleeps: passes run with
``step``."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pytest

from migpilot.agent import assembling, metrics, reconciling, running
from migpilot.agent.cluster import boundpods, following, holding, kubeapi
from migpilot.agent.deviceplugin import devices, resolving
from migpilot.agent.rules import changes
from migpilot.agent.sharing import unifying
from migpilot.api import gpulayouts as gl
from migpilot.gpu import clocks, emulated
from migpilot.kube import errors as kube_errors
from migpilot.kwok import standin
from migpilot.mig import catalog, layouts
from migpilot.planning import unified

H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30-24gb")
NODE = "node-a"
T0 = "2026-01-01T00:00:00Z"
GPU = "nvidia.com/gpu"
R1G = "nvidia.com/mig-1g.10gb"
MEM = "nvidia.com/gpumem"


def pod_doc(
    name: str,
    limits: dict[str, Any],
    *,
    node: str | None = NODE,
    created: str = T0,
    phase: str = "Pending",
    uid: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": limits}}]}
    if node is not None:
        spec["nodeName"] = node
    meta = {"name": name, "namespace": "ns", "creationTimestamp": created, "uid": uid or name}
    return {"metadata": meta, "spec": spec, "status": {"phase": phase}}


def spec(*gpus: list[dict[str, Any]]) -> dict[str, Any]:
    return {"gpus": [{"index": i, "instances": insts} for i, insts in enumerate(gpus)]}


def inst(
    profile: str, start: int, reserved: str | None = None, *, unified: bool = False
) -> dict[str, Any]:
    """A spec instance; ``unified``: reserved for a unified pod (as the controller writes it)."""
    out: dict[str, Any] = {"profile": profile, "start": start}
    if reserved is not None:
        out["reservedFor"] = reserved
    if unified:
        out["resource"] = "nvidia.com/gpu"
    return out


# --- the node counters -------------------------------------------------------------------------


def view(*enabled: bool, model: Any = H100) -> devices.NodeDevices:
    return devices.NodeDevices(
        gpus=tuple(devices.Gpu(i, f"GPU-{i}", model, "x", 1, on) for i, on in enumerate(enabled))
    )


class Counting(kubeapi.InMemoryNodeApi):
    refuse = False
    patches = 0

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        if self.refuse:
            raise kube_errors.KubeApiError("nodes/status is forbidden")
        self.patches += 1
        super().patch_node_resources(node, resources)


def test_counters_are_memory_and_a_hundred_per_mig_gpu() -> None:
    assert unifying.counters(view(True, True, False)) == {
        MEM: 2 * unified.memory_mib(H100),
        "nvidia.com/gpumem-percentage": 200,
        "nvidia.com/gpucores": 200,
    }
    assert unifying.counters(view()) == {MEM: 0, "nvidia.com/gpumem-percentage": 0,
                                         "nvidia.com/gpucores": 0}  # fmt: skip


def test_the_counters_follow_the_gpus_into_the_node(caplog: pytest.LogCaptureFixture) -> None:
    api = Counting()
    api.put_node(NODE, {})
    counters = unifying.NodeCounters(api, node=NODE)

    def tell(v: devices.NodeDevices) -> None:
        counters.passed(state={}, report=None, labels={}, view=v)

    def node_status(part: str) -> dict[str, str]:
        (doc,) = api.list_node(NODE).items
        return dict(doc["status"][part])

    tell(view(True))
    want = {MEM: str(unified.memory_mib(H100)), "nvidia.com/gpumem-percentage": "100",
            "nvidia.com/gpucores": "100"}  # fmt: skip
    assert node_status("capacity") == node_status("allocatable") == want
    tell(view(True))
    assert api.patches == 1  # unchanged: not written again
    tell(view(True, True))  # a GPU appears
    assert node_status("allocatable")["nvidia.com/gpucores"] == "200"
    api.refuse = True
    tell(view(True))  # one goes; the write fails: logged, retried at the next pass
    assert not counters.settled and "unified counters not published" in caplog.text
    api.refuse = False
    tell(view(True))
    assert counters.settled and node_status("capacity")["nvidia.com/gpucores"] == "100"
    tell(view(False))  # MIG disabled: nothing for unified pods
    assert node_status("capacity")[MEM] == "0"


# --- the single agent ---------------------------------------------------------------------------


@dataclass
class Node:
    api: kubeapi.InMemoryNodeApi
    gpus: emulated.EmulatedBackend
    cluster: assembling.KubeSide
    agent: running.Agent

    @property
    def book(self) -> boundpods.PodBook:
        return self.cluster.pods

    @property
    def kubelet(self) -> standin.SimulatedKubelet:
        assert isinstance(self.cluster.kubelet, standin.SimulatedKubelet)
        return self.cluster.kubelet

    @property
    def pool(self) -> unifying.UnifiedPool:
        return self.cluster.pool

    def step(self) -> changes.Report:
        self.cluster.source.sync()
        self.book.listed(self.api.list_pods(node=NODE).items)
        return self.agent.reconcile()

    def uuid(self, text: str, gpu: int = 0) -> str:
        (d,) = [d for d in self.gpus.mig_devices(gpu) if str(d) == text]
        assert d.uuid is not None
        return d.uuid

    def layout(self) -> gl.GpuLayout:
        got = self.api.layout(NODE)
        assert got is not None
        return got

    def states(self, gpu: int = 0) -> dict[str, tuple[str, str | None]]:
        status = self.layout().status
        assert status is not None
        (g,) = [g for g in status.gpus if g.index == gpu]
        return {f"{i.profile}@{i.start}": (i.state.value, i.used_by) for i in g.instances}

    def resources(self) -> dict[str, str]:
        return dict(self.api.node_resources.get(NODE, {}))


def wire(api: kubeapi.InMemoryNodeApi, gpus: emulated.EmulatedBackend) -> Node:
    """As ``migpilot agent --kubelet simulated`` wires it (:func:`assembling.kube_side`)."""
    source = following.GpuLayoutSource(api, node=NODE)
    source.sync()
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)
    cluster = assembling.kube_side(
        api,
        source=source,
        pods=book,
        strategy=devices.MigStrategy.MIXED,
        standin=standin.stand_in,
    )
    wired = cluster.wire(reconciling.RunningProcesses(gpus), gpus=gpus)
    agent = running.Agent(
        gpus=gpus,
        in_use=wired.in_use,
        source=cluster.desired_source(),
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=running.AgentSettings(),
        listener=wired.listener,
        view_filter=cluster.pool,
    )
    return Node(api, gpus, cluster, agent)


@pytest.fixture
def node() -> Iterator[Node]:
    api = kubeapi.InMemoryNodeApi()
    api.put_node(NODE, {})
    gpus = emulated.EmulatedBackend([H100], durable=False)
    yield wire(api, gpus)
    api.close()
    gpus.close()


FOUR = [inst("1g.10gb", s) for s in range(4)]


def test_a_unified_pod_is_served_from_its_reservation_and_reported_used_by_it(
    node: Node,
) -> None:
    reserved = [
        inst("1g.10gb", 0),
        inst("1g.10gb", 1, "ns/u", unified=True),
        inst("1g.10gb", 2, "ns/u", unified=True),
    ]
    node.api.put_spec(NODE, spec([*reserved, inst("1g.10gb", 3, "ns/m")]))
    node.api.put_pod(pod_doc("u", {GPU: 2, MEM: 8000}, node=None))  # reserved, not bound yet
    node.api.put_pod(pod_doc("m", {R1G: 1}, node=None))
    node.step()
    # The scheduler sees 2 nvidia.com/gpu (u's instances) and 2 mig-1g.10gb (the others,
    # m's reserved one among them), and the unified counters.
    assert node.resources() == {
        GPU: "2",
        R1G: "2",
        MEM: str(unified.memory_mib(H100)),
        "nvidia.com/gpumem-percentage": "100",
        "nvidia.com/gpucores": "100",
    }
    assert node.states()["1g.10gb@1"] == ("reserved", None)
    # kube-scheduler binds u: the stand-in admits it as the kubelet would.
    node.api.put_pod(pod_doc("u", {GPU: 2, MEM: 8000}, phase="Running"))  # KWOK runs it at once
    node.step()
    mine = {node.uuid("1g.10gb@1"), node.uuid("1g.10gb@2")}
    assert set(node.kubelet.assigned()["ns/u"]) == mine
    assert node.states() == {
        "1g.10gb@0": ("free", None),
        "1g.10gb@1": ("used", "ns/u"),
        "1g.10gb@2": ("used", "ns/u"),
        "1g.10gb@3": ("reserved", None),
    }
    assert gl.allocated(node.layout(), "ns/u")
    assert not gl.allocated(node.layout(), "ns/m")
    # The controller drops u's reservations once it is allocated: its instances stay its own,
    # in the pool and used, until it goes.
    node.api.put_spec(NODE, spec(FOUR))
    node.step()
    assert node.states()["1g.10gb@2"] == ("used", "ns/u")
    assert node.resources()[GPU] == "2"
    node.api.delete_pod("ns", "u")
    node.step()
    assert node.kubelet.assigned() == {}
    assert node.states()["1g.10gb@1"] == ("free", None)
    assert node.resources()[GPU] == "0" and node.resources()[R1G] == "4"


def test_a_restarted_stand_in_gives_unified_pods_back_their_instances(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1, "ns/u"), *FOUR[2:]]))
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    node.step()
    node.api.put_spec(NODE, spec(FOUR))  # the reservation is dropped once it is allocated
    node.step()
    held = node.kubelet.assigned()
    assert held == {"ns/u": (node.uuid("1g.10gb@1"),)}
    again = wire(node.api, node.gpus)
    again.step()
    assert again.kubelet.assigned() == held
    assert again.states()["1g.10gb@1"] == ("used", "ns/u")


def test_a_unified_pod_bound_without_a_reservation_takes_one_of_a_pod_not_bound_here(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    """Created while the webhook was down, kube-scheduler bound it alone: it gets the pool
    instance reserved for a gated pod (the controller plans that one again), not nothing."""
    node.api.put_spec(NODE, spec([*FOUR[:3], inst("1g.10gb", 3, "ns/gated", unified=True)]))
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    node.step()
    assert node.kubelet.assigned() == {"ns/u": (node.uuid("1g.10gb@3"),)}
    assert "gets no device yet" not in caplog.text


def test_a_unified_pod_without_a_reservation_waits_for_one(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    node.api.put_spec(NODE, spec(FOUR))
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    node.step()
    assert node.kubelet.assigned() == {}
    assert "pod ns/u gets no device yet: pod ns/u: no MIG instance is reserved" in caplog.text
    node.api.put_spec(NODE, spec([*FOUR[:3], inst("1g.10gb", 3, "ns/u")]))
    node.step()
    assert node.kubelet.assigned() == {"ns/u": (node.uuid("1g.10gb@3"),)}


def test_a_bound_pods_reservation_dropped_before_allocate_is_remembered(node: Node) -> None:
    """With a real kubelet the controller may drop a bound pod's reservation before the
    kubelet calls Allocate; the pool keeps the instance for the pod (here without the
    stand-in's allocations: the pool alone)."""
    api, gpus = node.api, node.gpus
    api.put_spec(NODE, spec([*FOUR[:3], inst("1g.10gb", 3, "ns/u")]))
    node.step()
    x = node.uuid("1g.10gb@3")
    book = boundpods.PodBook()
    alone = unifying.UnifiedPool(api, node=NODE, pods=book, spec=lambda: _spec(api))
    api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    book.listed(api.list_pods(node=NODE).items)
    v = running.node_view(reconciling.Reconciler(gpus, reconciling.InUseSet()).read())
    assert alone.update(v).unified == {x}
    assert alone.in_use() == frozenset()  # the spec protects it
    api.put_spec(NODE, spec(FOUR))
    assert alone.update(v).unified == {x}
    assert alone.in_use() == {x}
    inputs = alone.inputs(fresh=False)
    assert [i.uuid for i in inputs.reservations["ns/u"]] == [x]
    api.delete_pod("ns", "u")
    book.listed(api.list_pods(node=NODE).items)
    assert alone.update(v).unified == frozenset() and alone.in_use() == frozenset()


def test_a_reservation_dropped_as_the_pod_binds_between_two_passes_is_remembered() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.put_spec(
        NODE,
        spec(
            [inst("1g.10gb", 0, "ns/u", unified=True), inst("1g.10gb", 1, "ns/gone", unified=True)]
        ),
    )
    api.put_pod(pod_doc("u", {GPU: 1, MEM: 1}, node=None))
    api.put_pod(pod_doc("gone", {GPU: 1, MEM: 1}, node=None))
    book = boundpods.PodBook()
    book.listed([])
    pool = unifying.UnifiedPool(api, node=NODE, pods=book, spec=lambda: _spec(api))
    v = _mig_view(0, 1)
    assert pool.update(v).unified == {"M0", "M1"}
    # Before the next pass: u is bound, the controller drops both reservations (gone was
    # re-planned elsewhere).
    api.put_pod(pod_doc("u", {GPU: 1, MEM: 1}))
    book.listed(api.list_pods(node=NODE).items)
    api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1)]))
    assert pool.update(v).unified == {"M0"}
    assert pool.in_use() == {"M0"}
    assert [i.uuid for i in pool.inputs(fresh=False).reservations["ns/u"]] == ["M0"]


def _spec(api: kubeapi.InMemoryNodeApi) -> gl.LayoutSpec | None:
    found = api.layout(NODE)
    return found.spec if found is not None else None


# --- the pool alone ------------------------------------------------------------------------------


class Ledger:
    """A stand-in for the plugin's ledger."""

    def __init__(self, entries: dict[str, resolving.PodAllocation]) -> None:
        self.entries = entries
        self.released: list[str] = []

    def pod_allocations(self) -> Mapping[str, resolving.PodAllocation]:
        return dict(self.entries)

    def pods_version(self) -> int:
        return len(self.released)

    def release_pods(self, pods: Sequence[str]) -> None:
        self.released += pods
        for p in pods:
            self.entries.pop(p, None)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _mig_view(*starts: int) -> devices.NodeDevices:
    gpu = devices.Gpu(0, "GPU-0", H100, "x", 1, True)
    p = H100.profile_named("1g.10gb")
    return devices.NodeDevices(
        gpus=(gpu,),
        mig_devices=tuple(devices.MigDevice(f"M{s}", 0, p, s, s + 1, 0) for s in starts),
    )


def test_the_spec_says_which_reservations_are_for_unified_pods_and_no_pod_is_read() -> None:
    """A reserved pod not bound yet is unified when the spec names its resource
    ``nvidia.com/gpu`` (the controller knows the pod): a pass reads no pod from the API."""
    api = kubeapi.InMemoryNodeApi()
    api.put_spec(
        NODE,
        spec([inst("1g.10gb", 0, "ns/u", unified=True), inst("1g.10gb", 1, "ns/m")]),
    )
    book = boundpods.PodBook()
    book.listed([])
    pool = unifying.UnifiedPool(api, node=NODE, pods=book, spec=lambda: _spec(api))
    v = _mig_view(0, 1)
    assert pool.update(v).unified == {"M0"}
    assert pool.update(v).unified == {"M0"}
    assert api.pod_gets == 0


def test_allocations_of_gone_pods_are_released_once_a_read_confirms_it() -> None:
    api = kubeapi.InMemoryNodeApi()
    entry = resolving.PodAllocation("u1", True, (("c", ("M0",)),))
    ledger = Ledger({"ns/lag": entry, "ns/gone": entry, "ns/renamed": entry, "ns/done": entry})
    api.put_pod(pod_doc("lag", {GPU: 1, MEM: 1}, uid="u1"))  # the watch has not shown it yet
    api.put_pod(pod_doc("renamed", {GPU: 1, MEM: 1}, uid="u2"))  # another pod of that name
    api.put_pod(pod_doc("done", {GPU: 1, MEM: 1}, uid="u1", phase="Succeeded"))
    book = boundpods.PodBook()
    pool = unifying.UnifiedPool(api, node=NODE, pods=book, spec=lambda: None, allocated=ledger)
    before = pool.fingerprint()
    pool.update(_mig_view(0))
    assert ledger.released == []  # the pods were never listed: nothing is known gone
    book.listed([])
    pool.update(_mig_view(0))
    assert sorted(ledger.released) == ["ns/done", "ns/gone", "ns/renamed"]
    assert set(ledger.entries) == {"ns/lag"}
    assert pool.fingerprint() != before
    assert pool.used_by() == {"M0": "ns/lag"}


# --- the bound pods' count -----------------------------------------------------------------------


def test_a_bound_unified_pod_without_instances_keeps_its_profiles_count() -> None:
    gpus = emulated.EmulatedBackend([H100], durable=False)
    for start in (0, 1, 2):
        gpus.create_instance(0, profile="1g.10gb", start=start)
    api = kubeapi.InMemoryNodeApi()
    api.put_pod(pod_doc("u", {GPU: 2, MEM: 8000}))
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)
    pool = unifying.UnifiedPool(api, node=NODE, pods=book, spec=lambda: None)
    pool.update(running.node_view(reconciling.Reconciler(gpus, reconciling.InUseSet()).read()))
    (bound,) = book.pods(NODE)
    assert pool.profiles_for(bound) == ("1g.10gb", "1g.10gb")
    hold = holding.BoundPodsHold(
        book, node=NODE, gpus=gpus, allocated=reconciling.InUseSet(), unified=pool.profiles_for
    )
    want = {0: changes.DesiredGpu(mig_enabled=True, layout=layouts.Layout.of([]))}
    reconciling.Reconciler(gpus, hold).reconcile(want)
    assert sorted(str(d) for d in gpus.mig_devices(0)) == ["1g.10gb@0", "1g.10gb@1"]
    gpus.close()


def test_a_unified_pods_count_is_the_profiles_of_its_instances() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.put_spec(NODE, spec([inst("3g.40gb", 4, "ns/u")]))
    api.put_pod(pod_doc("u", {GPU: 1, MEM: 1000}))
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)
    pool = unifying.UnifiedPool(api, node=NODE, pods=book, spec=lambda: _spec(api))
    gpu = devices.Gpu(0, "GPU-0", H100, "x", 1, True)
    pool.update(devices.NodeDevices(gpus=(gpu,)))
    (bound,) = book.pods(NODE)
    assert pool.profiles_for(bound) == ("3g.40gb",)
    whole = boundpods.bound_pod(pod_doc("w", {GPU: 1}))
    assert whole is not None and pool.profiles_for(whole) == ()


def test_the_pod_book_keeps_unified_and_whole_gpu_pods(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    book = boundpods.PodBook()
    book.listed(
        [
            pod_doc("u", {GPU: 1, MEM: 100}),
            pod_doc("w", {GPU: 1}),
            pod_doc("both", {GPU: 1, MEM: 100, R1G: 1}),
            pod_doc("bad", {MEM: 100}),
        ]
    )
    got = {p.name: (p.requests, p.gpu.unified if p.gpu else None) for p in book.pods(NODE)}
    assert got == {"u": ((), True), "w": ((), False), "both": (((R1G, 1),), True)}
    assert "nvidia.com/gpumem: needs nvidia.com/gpu" in caplog.text


@pytest.mark.parametrize("model", [A30])
def test_counters_use_each_models_largest_instance(model: Any) -> None:
    got = unifying.counters(view(True, model=model))
    assert got[MEM] == max(p.memory_mib or 0 for p in model.profiles)


def test_a_restarted_stand_in_gives_no_mig_pod_an_instance_a_unified_pod_holds(
    node: Node,
) -> None:
    """Soak, CI at f4b415c: after an agent restart the stand-in admitted a new MIG pod before
    it gave the unified pods back their instances, so both held one instance for a pass."""
    node.api.put_spec(NODE, spec([inst("1g.10gb", 1, "ns/u", unified=True)]))
    node.api.put_pod(pod_doc("u", {GPU: 1, MEM: 8000}))
    node.step()
    node.api.put_spec(NODE, spec([inst("1g.10gb", 1)]))  # dropped once it is allocated
    node.step()
    mine = node.uuid("1g.10gb@1")
    assert node.kubelet.assigned() == {"ns/u": (mine,)}
    # Then the agent restarts, and a MIG pod bound here meanwhile asks for that profile.
    node.api.put_pod(pod_doc("m", {R1G: 1}))
    again = wire(node.api, node.gpus)
    again.step()
    assert again.kubelet.assigned()["ns/u"] == (mine,)
    assert mine not in again.kubelet.assigned().get("ns/m", ())
    assert again.states()["1g.10gb@1"] == ("used", "ns/u")
