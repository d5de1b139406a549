"""Which pod an Allocate of ``nvidia.com/gpu`` serves (agent/deviceplugin/resolving.py), the
per-pod ledger that remembers it (agent/deviceplugin/allocations.py), and the unified pool's
advertising: parametrised cases, then properties over any set of pods and any interleaving
of their Allocates."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot import errors
from migpilot.agent.deviceplugin import advertising, allocations, devices, resolving
from migpilot.mig import catalog
from migpilot.planning import unified

H100 = catalog.resolve_gpu("h100-80gb")
T0 = "2026-01-01T00:00:00Z"
T1 = "2026-01-01T00:00:01Z"
T2 = "2026-01-01T00:00:02Z"


def c(
    name: str, count: int = 1, *, init: bool = False, mem: int | None = None
) -> resolving.Container:
    ask = unified.GpuAsk(count, memory_mib=mem) if mem is not None else unified.GpuAsk(count)
    return resolving.Container(name, init, count, ask)


def pod(
    name: str,
    *containers: resolving.Container,
    created: str = T0,
    is_unified: bool = True,
    uid: str | None = None,
    pending: bool = True,
) -> resolving.GpuPod:
    return resolving.GpuPod(
        "ns", name, uid if uid is not None else f"uid-{name}", created,
        containers or (c("main"),), is_unified, pending,
    )  # fmt: skip


def inst(
    uuid: str | None, start: int = 0, profile: str = "1g.10gb", gpu: int = 0
) -> resolving.Instance:
    return resolving.Instance(gpu, start, profile, uuid, H100)


def resolve(
    requested: list[str],
    pods: list[resolving.GpuPod],
    reservations: Mapping[str, tuple[resolving.Instance, ...]],
    allocated: dict[str, resolving.PodAllocation] | None = None,
    pool: frozenset[str] = frozenset(),
) -> resolving.Resolution:
    return resolving.resolve(
        requested=requested,
        pods=pods,
        reservations=reservations,
        allocated=allocated or {},
        pool=pool,
    )


# --- reading pods --------------------------------------------------------------------------------


def doc(
    containers: list[dict[str, Any]],
    *,
    init: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    phase: str | None = "Pending",
) -> dict[str, Any]:
    def part(items: list[dict[str, Any]], prefix: str) -> list[dict[str, Any]]:
        return [{"name": f"{prefix}{i}", "resources": {"limits": r}} for i, r in enumerate(items)]

    spec: dict[str, Any] = {"nodeName": "n0", "containers": part(containers, "c")}
    if init is not None:
        spec["initContainers"] = part(init, "i")
    meta: dict[str, Any] = {"name": "p", "namespace": "ns", "uid": "u1", "creationTimestamp": T0}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec, "status": {"phase": phase} if phase else {}}


GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"


def test_a_unified_pod_lists_its_gpu_containers_init_first() -> None:
    got = resolving.gpu_pod(
        doc(
            [{GPU: 2, MEM: "20000"}, {"cpu": "1"}, {GPU: "1", "nvidia.com/gpucores": 50}],
            init=[{GPU: 1, "nvidia.com/gpumem-percentage": "50"}],
        )
    )
    assert got is not None and got.unified and got.pending
    assert got.key == "ns/p" and got.uid == "u1"
    assert [(x.name, x.init, x.count) for x in got.containers] == [
        ("i0", True, 1),
        ("c0", False, 2),
        ("c2", False, 1),
    ]
    assert got.containers[1].ask == unified.GpuAsk(2, memory_mib=20000)


@pytest.mark.parametrize(
    ("pod_doc", "is_unified"),
    [
        (doc([{GPU: 1}]), False),  # a whole-GPU request, NVIDIA's
        (doc([{GPU: 1}], annotations={unified.VGPU_MODE: "mig"}), True),
        (doc([{GPU: 1, MEM: 1000}], annotations={unified.VGPU_MODE: "hami-core"}), False),
        (doc([{GPU: 1}, {GPU: 1, MEM: 10}]), True),  # gpumem somewhere: the pod is unified
    ],
)
def test_which_pods_are_unified(pod_doc: dict[str, Any], is_unified: bool) -> None:
    got = resolving.gpu_pod(pod_doc)
    assert got is not None and got.unified is is_unified


def test_gpumem_without_gpu_names_the_container() -> None:
    with pytest.raises(errors.MigpilotError, match=r"containers\[1\].nvidia.com/gpumem"):
        resolving.gpu_pod(doc([{GPU: 1}, {MEM: 10}]))


@pytest.mark.parametrize(
    "pod_doc",
    [doc([{"cpu": "1"}]), doc([{GPU: 0}]), doc([{"nvidia.com/mig-1g.10gb": 1}])],
)
def test_pods_without_nvidia_gpu_are_not_candidates(pod_doc: dict[str, Any]) -> None:
    assert resolving.gpu_pod(pod_doc) is None


def test_a_running_pod_was_admitted_already() -> None:
    got = resolving.gpu_pod(doc([{GPU: 1, MEM: 100}], phase="Running"))
    assert got is not None and not got.pending
    none_yet = resolving.gpu_pod(doc([{GPU: 1, MEM: 100}], phase=None))
    assert none_yet is not None and none_yet.pending


def test_a_bad_ask_names_the_field() -> None:
    with pytest.raises(errors.MigpilotError, match=r"pod ns/p.containers\[0\].nvidia.com/gpu"):
        resolving.gpu_pod(doc([{GPU: "two"}]))


# --- the rule ----------------------------------------------------------------------------------


def test_the_oldest_waiting_pod_whose_next_container_asks_as_many() -> None:
    pods = [
        pod("late", c("main", 1), created=T2),
        pod("early", c("main", 2), created=T0),
        pod("middle", c("main", 1), created=T1),
    ]
    reservations = {
        "ns/late": (inst("L"),),
        "ns/early": (inst("E1"), inst("E2", 1)),
        "ns/middle": (inst("M"),),
    }
    one = resolve(["x"], pods, reservations)
    assert isinstance(one, resolving.Decision)
    assert (one.pod.name, one.device_ids) == ("middle", ("M",))  # early asks 2: not it
    two = resolve(["x", "y"], pods, reservations)
    assert isinstance(two, resolving.Decision) and two.device_ids == ("E1", "E2")


def test_ties_in_creation_time_go_by_namespace_then_name() -> None:
    pods = [pod("b"), pod("a")]
    got = resolve(["x"], pods, {"ns/a": (inst("A"),), "ns/b": (inst("B"),)})
    assert isinstance(got, resolving.Decision) and got.pod.name == "a"


def test_allocated_containers_and_admitted_pods_are_skipped() -> None:
    pods = [
        pod("running", created=T0, pending=False),
        pod("two", c("first"), c("second"), created=T1),
        pod("next", created=T2),
    ]
    reservations = {
        "ns/running": (inst("R"),),
        "ns/two": (inst("T1"), inst("T2", 1)),
        "ns/next": (inst("N"),),
    }
    ledger = {"ns/two": resolving.PodAllocation("uid-two", True, (("first", ("T1",)),))}
    got = resolve(["x"], pods, reservations, ledger)
    assert isinstance(got, resolving.Decision)
    assert (got.pod.name, got.container.name, got.device_ids) == ("two", "second", ("T2",))
    ledger["ns/two"] = ledger["ns/two"].adding("second", ("T2",))
    got = resolve(["x"], pods, reservations, ledger)
    assert isinstance(got, resolving.Decision) and got.pod.name == "next"


def test_an_entry_of_an_older_pod_of_the_same_name_does_not_count() -> None:
    pods = [pod("p", uid="new")]
    ledger = {"ns/p": resolving.PodAllocation("old", True, (("main", ("OLD",)),))}
    got = resolve(["x"], pods, {"ns/p": (inst("NEW"),)}, ledger)
    assert isinstance(got, resolving.Decision) and got.device_ids == ("NEW",)
    # ...but its instances stay with it until the agent releases it.
    got = resolve(["x"], pods, {"ns/p": (inst("OLD"),)}, ledger)
    assert isinstance(got, resolving.Refusal) and "allocated to another pod" in got.message


def test_an_instance_handed_out_under_its_profile_is_never_given_to_a_unified_pod() -> None:
    got = resolving.resolve(
        requested=["x"],
        pods=[pod("p")],
        reservations={"ns/p": (inst("A"),)},
        allocated={},
        pool=frozenset({"A"}),
        busy=frozenset({"A"}),
    )
    assert isinstance(got, resolving.Refusal)
    assert got.message == (
        "pod ns/p: the MIG instances reserved for it are allocated to another pod: GPU 0 1g.10gb@0"
    )


@pytest.mark.parametrize(
    ("reserved", "message"),
    [
        ((), "pod ns/p: no MIG instance is reserved for it on this node"),
        (
            (inst("A"), inst(None, 3), inst(None, 4, "2g.20gb")),
            "pod ns/p: the MIG instances reserved for it do not exist: GPU 0 1g.10gb@3, "
            "GPU 0 2g.20gb@4",
        ),
        ((inst("A"),), "container main asks for 2 nvidia.com/gpu, 1 of the instances reserved"),
    ],
)
def test_refusals_name_the_problem(reserved: tuple[resolving.Instance, ...], message: str) -> None:
    got = resolve(["x", "y"], [pod("p", c("main", 2))], {"ns/p": reserved})
    assert isinstance(got, resolving.Refusal) and message in got.message


def test_no_waiting_pod_is_no_pod() -> None:
    got = resolve(["x", "y", "z"], [pod("p")], {"ns/p": (inst("A"),)})
    assert isinstance(got, resolving.NoPod)
    assert "waiting for 3 nvidia.com/gpu" in got.message


def test_a_whole_gpu_pod_gets_the_kubelets_picks_never_a_unified_instance() -> None:
    pods = [pod("whole", is_unified=False)]
    got = resolve(["GPU-1"], pods, {}, pool=frozenset({"MIG-a"}))
    assert isinstance(got, resolving.Decision) and got.device_ids == ("GPU-1",)
    got = resolve(["MIG-a"], pods, {}, pool=frozenset({"MIG-a"}))
    assert isinstance(got, resolving.Refusal) and "set aside for unified pods" in got.message


def test_containers_get_the_instances_that_fit_their_asks() -> None:
    # Two containers: a small ask and a 30 GB ask. The reservation holds a 1g.10gb and a
    # 3g.40gb; the small container must not take the big one.
    p = pod("p", c("big", 1, mem=30000), c("small", 1, mem=5000))
    reserved = {"ns/p": (inst("BIG", 4, "3g.40gb"), inst("SMALL", 0, "1g.10gb"))}
    first = resolve(["x"], [p], reserved)
    assert isinstance(first, resolving.Decision) and first.device_ids == ("BIG",)
    ledger = {"ns/p": resolving.PodAllocation(p.uid, True, (("big", ("BIG",)),))}
    second = resolve(["x"], [p], reserved, ledger)
    assert isinstance(second, resolving.Decision) and second.device_ids == ("SMALL",)


def test_init_containers_may_use_what_the_others_get_after_them() -> None:
    p = pod("p", c("init", 1, init=True), c("main", 2))
    reserved = {"ns/p": (inst("A"), inst("B", 1))}
    ledger: dict[str, resolving.PodAllocation] = {}
    got = []
    for size in (1, 2):
        found = resolve(["x"] * size, [p], reserved, ledger)
        assert isinstance(found, resolving.Decision)
        got.append(found.device_ids)
        entry = ledger.get("ns/p") or resolving.PodAllocation(p.uid, True)
        ledger["ns/p"] = entry.adding(found.container.name, found.device_ids)
    assert got == [("A",), ("A", "B")]


def test_preferred_puts_the_pods_own_devices_first() -> None:
    p = pod("p", c("main", 2))
    found = resolve(["x", "y"], [p], {"ns/p": (inst("A"), inst("B", 1))})
    got = resolving.preferred(
        found, available=["Z", "B", "A"], must_include=[], size=2, pool=frozenset("ABZ")
    )
    assert got == ("A", "B")
    whole = resolve(["x"], [pod("w", is_unified=False)], {})
    got = resolving.preferred(
        whole, available=["MIG-a", "GPU-1"], must_include=[], size=1, pool=frozenset({"MIG-a"})
    )
    assert got == ("GPU-1",)
    none = resolve(["x"], [], {})
    assert resolving.preferred(none, available=["a"], must_include=["a"], size=1, pool=()) == ("a",)


def test_the_pool_is_unified_reservations_and_live_hand_outs() -> None:
    got = resolving.set_aside(
        reservations={"ns/u": (inst("U"), inst(None, 1)), "ns/mig": (inst("M"),)},
        unified_pods={"ns/u"},
        allocated={
            "ns/v": resolving.PodAllocation("v", True, (("c", ("V", "GONE")),)),
            "ns/w": resolving.PodAllocation("w", False, (("c", ("GPU-1",)),)),
        },
        existing={"U", "M", "V", "GPU-1"},
    )
    assert got == {"U", "V"}


def _node(uuids: list[str]) -> devices.NodeDevices:
    gpu = devices.Gpu(0, "GPU-0", H100, "NVIDIA H100 80GB HBM3", 81559, True)
    whole = devices.Gpu(1, "GPU-1", H100, "NVIDIA H100 80GB HBM3", 81559, False)
    migs = tuple(
        devices.MigDevice(u, 0, H100.profile_named("1g.10gb"), i, i + 1, 0)
        for i, u in enumerate(uuids)
    )
    return devices.NodeDevices(gpus=(gpu, whole), mig_devices=migs)


def test_mixed_advertises_the_pool_as_nvidia_gpu_and_nothing_twice() -> None:
    node = _node(["a", "b", "c"])
    pooled = devices.NodeDevices(node.gpus, node.mig_devices, unified=frozenset({"b"}))
    got = {r.name: [d.id for d in r.devices] for r in advertising.resources_for(pooled, MIXED)}
    assert got == {"nvidia.com/gpu": ["GPU-1", "b"], "nvidia.com/mig-1g.10gb": ["a", "c"]}
    before = {r.name: [d.id for d in r.devices] for r in advertising.resources_for(node, MIXED)}
    assert before == {"nvidia.com/gpu": ["GPU-1"], "nvidia.com/mig-1g.10gb": ["a", "b", "c"]}


MIXED = devices.MigStrategy.MIXED


# --- the ledger's pod entries ---------------------------------------------------------------------


def test_the_ledger_keeps_pods_until_released_and_reloads_them() -> None:
    ledger = allocations.AllocationLedger()
    v = ledger.pods_version
    assert ledger.record_container("ns/p", uid="u", unified=True, container="a", device_ids=("X",))
    assert not ledger.record_container(
        "ns/p", uid="u", unified=True, container="a", device_ids=("X",)
    )
    ledger.record_container("ns/p", uid="u", unified=True, container="b", device_ids=("Y",))
    assert ledger.pods()["ns/p"].containers == (("a", ("X",)), ("b", ("Y",)))
    assert ledger.pods_version > v
    # Another pod of that name replaces the entry.
    ledger.record_container("ns/q", uid="1", unified=False, container="c", device_ids=("G",))
    ledger.record_container("ns/q", uid="2", unified=False, container="c", device_ids=("H",))
    assert ledger.pods()["ns/q"] == resolving.PodAllocation("2", False, (("c", ("H",)),))
    again = allocations.AllocationLedger()
    again.load(ledger.dump(now=5.0), now=100.0, source="x.json")
    assert again.pods() == ledger.pods()
    assert again.release_pods(["ns/p", "ns/absent"])
    assert not again.release_pods(["ns/p"])
    assert set(again.pods()) == {"ns/q"}
    # A ledger without pods (an older agent's) loads, and one with bad pods is refused.
    plain = allocations.AllocationLedger()
    plain.load({"version": 1, "devices": {}}, now=0.0, source="x.json")
    assert plain.pods() == {}


@pytest.mark.parametrize(
    "pods",
    [
        [],
        {"ns/p": {"uid": 1, "unified": True, "containers": []}},
        {"ns/p": {"uid": "u", "unified": "yes", "containers": []}},
        {"ns/p": {"uid": "u", "unified": True, "containers": [["a", "X"]]}},
        {"ns/p": {"uid": "u", "unified": True, "containers": [["a"]]}},
    ],
)
def test_the_ledger_refuses_bad_pod_entries(pods: object) -> None:
    with pytest.raises(errors.AgentConfigError, match="x.json"):
        allocations.AllocationLedger().load(
            {"version": 1, "devices": {}, "pods": pods}, now=0.0, source="x.json"
        )


# --- properties ---------------------------------------------------------------------------------


def _reserve(pods: list[resolving.GpuPod]) -> dict[str, tuple[resolving.Instance, ...]]:
    """Each unified pod gets as many instances as its non-init containers ask for in all."""
    out = {}
    for p in pods:
        if p.unified:
            n = sum(x.count for x in p.containers if not x.init)
            out[p.key] = tuple(inst(f"MIG-{p.name}-{k}", k) for k in range(n))
    return out


def _serve(
    ledger: allocations.AllocationLedger,
    requested: list[str],
    pods: list[resolving.GpuPod],
    reservations: dict[str, tuple[resolving.Instance, ...]],
    pool: frozenset[str],
) -> resolving.Decision:
    """What the servicer does: resolve, then record before answering."""
    found = resolving.resolve(
        requested=requested,
        pods=pods,
        reservations=reservations,
        allocated=ledger.pods(),
        pool=pool,
    )
    assert isinstance(found, resolving.Decision), found
    ledger.record_container(
        found.pod.key,
        uid=found.pod.uid,
        unified=found.pod.unified,
        container=found.container.name,
        device_ids=found.device_ids,
    )
    return found


_containers = st.lists(st.tuples(st.booleans(), st.integers(1, 3)), min_size=1, max_size=3).map(
    lambda xs: tuple(
        resolving.Container(f"c{i}", init, n, unified.GpuAsk(n))
        for i, (init, n) in enumerate(sorted(xs, key=lambda x: not x[0]))
    )
)


@st.composite
def _pods(draw: st.DrawFn) -> list[resolving.GpuPod]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        containers = draw(_containers)
        if all(x.init for x in containers):
            containers = (*containers, resolving.Container("app", False, 1, unified.GpuAsk(1)))
        # An init container never asks for more than the others get (the planner reserves
        # for the others; the kubelet reuses an init container's devices for them).
        app = sum(x.count for x in containers if not x.init)
        containers = tuple(
            resolving.Container(x.name, x.init, min(x.count, app), x.ask) for x in containers
        )
        created = f"2026-01-01T00:00:0{draw(st.integers(0, 2))}Z"  # ties happen
        out.append(pod(f"p{i}", *containers, created=created, is_unified=draw(st.booleans())))
    return out


@settings(max_examples=150, deadline=None)
@given(_pods(), st.data())
def test_in_the_kubelets_order_every_pod_gets_exactly_its_instances(
    pods: list[resolving.GpuPod], data: st.DataObject
) -> None:
    """Any pods, Allocates in the kubelet's order (pod by pod, oldest first; init containers
    first), the kubelet picking any devices: each call serves that pod's container, a unified
    pod's containers get only its reserved instances (the others disjoint, all of them used),
    a whole-GPU pod gets the kubelet's picks, and no instance goes to two pods."""
    reservations = _reserve(pods)
    pool = frozenset(i.uuid or "" for insts in reservations.values() for i in insts)
    whole = [f"GPU-{k}" for k in range(20)]
    ledger = allocations.AllocationLedger()
    for p in sorted(pods, key=lambda x: x.order):
        for container in p.containers:
            offered = sorted(pool) + whole if p.unified else whole
            picks = data.draw(
                st.lists(
                    st.sampled_from(offered),
                    min_size=container.count,
                    max_size=container.count,
                    unique=True,
                )
            )
            found = _serve(ledger, picks, pods, reservations, pool)
            assert (found.pod.key, found.container.name) == (p.key, container.name)
            if not p.unified:
                assert found.device_ids == tuple(picks)
    owners: dict[str, str] = {}
    for key, entry in ledger.pods().items():
        if not entry.unified:
            continue
        (p,) = [x for x in pods if x.key == key]
        mine = {i.uuid for i in reservations[key]}
        app = [ids for name, ids in entry.containers if not _is_init(p, name)]
        flat = [u for ids in app for u in ids]
        assert len(flat) == len(set(flat)) and set(flat) == mine
        assert entry.devices <= mine
        for u in entry.devices:
            assert owners.setdefault(u, key) == key


def _is_init(p: resolving.GpuPod, name: str) -> bool:
    return any(x.init for x in p.containers if x.name == name)


@st.composite
def _told_apart(draw: st.DrawFn) -> list[resolving.GpuPod]:
    """Pods whose containers' counts are all different (so the rule tells them apart at any
    moment), each with one or two app containers, in any creation order."""
    n = draw(st.integers(1, 5))
    counts = draw(st.lists(st.integers(1, 12), min_size=2 * n, max_size=2 * n, unique=True))
    out = []
    for i in range(n):
        two = draw(st.booleans())
        mine = counts[2 * i : 2 * i + (2 if two else 1)]
        containers = tuple(c(f"c{k}", x) for k, x in enumerate(mine))
        created = f"2026-01-01T00:00:0{draw(st.integers(0, 3))}Z"
        out.append(pod(f"p{i}", *containers, created=created))
    return out


@settings(max_examples=150, deadline=None)
@given(_told_apart(), st.data())
def test_any_interleaving_of_pods_told_apart_gives_each_its_own(
    pods: list[resolving.GpuPod], data: st.DataObject
) -> None:
    """Concurrent Allocates arrive in any interleaving (each pod's containers in order):
    every pod gets exactly its reserved instances, no instance twice."""
    reservations = _reserve(pods)
    pool = frozenset(i.uuid or "" for insts in reservations.values() for i in insts)
    queues = {p.key: list(p.containers) for p in pods}
    ledger = allocations.AllocationLedger()
    while any(queues.values()):
        key = data.draw(st.sampled_from(sorted(k for k, q in queues.items() if q)))
        container = queues[key].pop(0)
        picks = data.draw(st.permutations(sorted(pool)))[: container.count]
        found = _serve(ledger, picks, pods, reservations, pool)
        assert (found.pod.key, found.container.name) == (key, container.name)
    seen: set[str] = set()
    for p in pods:
        got = ledger.pods()[p.key].devices
        assert got == {i.uuid for i in reservations[p.key]}
        assert not got & seen
        seen |= got


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 3), st.data())
def test_interchangeable_pods_share_out_their_instances_once(
    n: int, count: int, data: st.DataObject
) -> None:
    """Pods that ask for the same thing (the burst the controller lets go at once), Allocates
    in any order: the rule may serve them in another order than they arrive, but each call
    gets one pod's reserved instances whole, and every reservation is handed out exactly
    once."""
    pods = [pod(f"p{i}", c("main", count), created=T0) for i in range(n)]
    reservations = _reserve(pods)
    pool = frozenset(i.uuid or "" for insts in reservations.values() for i in insts)
    ledger = allocations.AllocationLedger()
    handed: list[frozenset[str]] = []
    for _ in data.draw(st.permutations(pods)):
        picks = data.draw(st.permutations(sorted(pool)))[:count]
        found = _serve(ledger, picks, pods, reservations, pool)
        handed.append(frozenset(found.device_ids))
    wanted = {frozenset(i.uuid or "" for i in insts) for insts in reservations.values()}
    assert set(handed) == wanted and len(handed) == n
    assert all(
        ledger.pods()[k].devices == {i.uuid for i in insts} for k, insts in reservations.items()
    )


# --- a unified pod bound with nothing reserved (created while the webhook was down) ----------


POOL = {
    "ns/gated": (inst("A", 0, "1g.20gb"),),
    "ns/other": (inst("B", 2, "1g.10gb"), inst("C", 4, "3g.40gb")),
    "ns/bound": (inst("D", 0, "2g.20gb", gpu=1),),
}
POOL_IDS = frozenset("ABCD")


def test_an_unreserved_pod_takes_a_fitting_reservation_of_a_pod_not_bound_here() -> None:
    """Served at its first Allocate, as a real kubelet fails the pod's admission on a refusal:
    the kubelet's pick first when it fits, then the smallest that fits; never what is reserved
    for a pod bound here (its Allocate comes next) or what another pod holds."""
    bound = pod("bound", created=T1)
    ask = [pod("p", c("main", mem=8000)), bound]
    got = resolve(["C"], ask, POOL, pool=POOL_IDS)
    assert isinstance(got, resolving.Decision)
    assert (got.device_ids, got.taken_from) == (("C",), ("ns/other",))
    got = resolve(["D"], ask, POOL, pool=POOL_IDS)  # D is ns/bound's: the smallest that fits
    assert isinstance(got, resolving.Decision)
    assert (got.device_ids, got.taken_from) == (("B",), ("ns/other",))
    held = {"ns/x": resolving.PodAllocation("uid-x", True, (("c", ("B",)),))}
    got = resolve(["D"], ask, POOL, held, pool=POOL_IDS)
    assert isinstance(got, resolving.Decision)
    assert (got.device_ids, got.taken_from) == (("A",), ("ns/gated",))


def test_an_unreserved_pod_gets_only_what_serves_its_ask() -> None:
    ask = [pod("p", c("main", mem=30000))]
    got = resolve(["A"], ask, POOL, pool=POOL_IDS)
    assert isinstance(got, resolving.Decision) and got.device_ids == ("C",)
    got = resolve(["A"], [pod("p", c("main", mem=50000))], POOL, pool=POOL_IDS)
    assert got == resolving.Refusal(
        "pod ns/p: no MIG instance is reserved for it on this node, nor any MPS slice or "
        "time-slicing replica (the GpuLayout spec names none with reservedFor), and the unified "
        "pool has 0 free that serve its container main (gpu 1, gpumem 50000) of the 1 it asks "
        "for (bound without migpilot: created while the webhook was down?)"
    )
    # Outside the pool (advertised under its profile) is never taken: the kubelet counts it there.
    got = resolve(["A"], [pod("p", c("main", mem=8000))], POOL, pool=frozenset("B"))
    assert isinstance(got, resolving.Decision) and got.device_ids == ("B",)
    got = resolve(["A"], [pod("p", c("main", mem=8000))], POOL, pool=frozenset("D"))
    assert isinstance(got, resolving.Decision) and got.device_ids == ("D",)
    got = resolve(["A"], [pod("p", c("main", mem=8000)), pod("bound", created=T1)], POOL,
                  pool=frozenset("D"))  # fmt: skip
    assert isinstance(got, resolving.Refusal)


def test_a_pod_whose_reservation_another_took_is_served_so_too() -> None:
    """ns/bound, let go before the controller saw ns/x take its D, is bound: rather than fail
    its admission it gets a fitting pool instance of a pod not bound here."""
    held = {"ns/x": resolving.PodAllocation("uid-x", True, (("c", ("D",)),))}
    got = resolve(["D"], [pod("bound", c("main", mem=8000))], POOL, held, pool=POOL_IDS)
    assert isinstance(got, resolving.Decision)
    assert (got.device_ids, got.taken_from) == (("B",), ("ns/other",))
    got = resolve(["D"], [pod("bound", c("main", mem=8000))], POOL, held, pool=frozenset("D"))
    assert got == resolving.Refusal(
        "pod ns/bound: the MIG instances reserved for it are allocated to another pod: "
        "GPU 1 2g.20gb@0"
    )
    # Its own free instances first: two reserved, one taken.
    mine = {**POOL, "ns/bound": (inst("D", 0, "2g.20gb", gpu=1), inst("E", 6, "1g.10gb"))}
    p = pod("bound", c("main", 2, mem=8000))
    got = resolve(["D", "E"], [p], mine, held, pool=POOL_IDS | {"E"})
    assert isinstance(got, resolving.Decision)
    assert (got.device_ids, got.taken_from) == (("E", "B"), ("ns/other",))


def test_an_unreserved_pods_containers_each_get_their_own() -> None:
    p = pod("p", c("a", mem=8000), c("b", mem=8000))
    first = resolve(["x"], [p], POOL, pool=POOL_IDS)
    assert isinstance(first, resolving.Decision) and first.device_ids == ("B",)
    mine = {"ns/p": resolving.PodAllocation("uid-p", True, (("a", ("B",)),))}
    second = resolve(["x"], [p], POOL, mine, pool=POOL_IDS)
    assert isinstance(second, resolving.Decision) and second.container.name == "b"
    assert second.device_ids == ("A",)


# --- every refusal, word for word --------------------------------------------------------------


def _slice(uuid: str | None, ident: int) -> resolving.Instance:
    return resolving.mps_slice(0, ident, 10, uuid=uuid, model=H100)


TWO = [pod("p", c("main", 2))]


@pytest.mark.parametrize(
    ("reserved", "allocated", "message"),
    [
        ((), {}, "pod ns/p: no MIG instance is reserved for it on this node, nor any MPS slice "
         "or time-slicing replica (the GpuLayout spec names none with reservedFor), and the "
         "unified pool has 0 free that serve its container main (gpu 2) of the 2 it asks for "
         "(bound without migpilot: created while the webhook was down?)"),
        ((inst("A"), inst(None, 3), inst(None, 4, "2g.20gb")), {},
         "pod ns/p: the MIG instances reserved for it do not exist: GPU 0 1g.10gb@3, "
         "GPU 0 2g.20gb@4"),
        ((_slice("S0", 0), _slice(None, 1), _slice(None, 2)), {},
         "pod ns/p: the MPS slices reserved for it are not served: GPU 0 MPS slice 1 (10 GB), "
         "GPU 0 MPS slice 2 (10 GB)"),
        ((inst(None, 3), _slice(None, 1)), {},
         "pod ns/p: the MIG instances and MPS slices reserved for it do not exist: "
         "GPU 0 1g.10gb@3, GPU 0 MPS slice 1 (10 GB)"),
        ((inst("A"), inst("B", 1), inst("C", 2)),
         {"ns/o": resolving.PodAllocation("uid-o", True, (("c", ("A", "B")),))},
         "pod ns/p: the MIG instances reserved for it are allocated to another pod: "
         "GPU 0 1g.10gb@0, GPU 0 1g.10gb@1"),
        ((inst("A"),), {},
         "pod ns/p: container main asks for 2 nvidia.com/gpu, 1 of the instances reserved for "
         "it are left (GPU 0 1g.10gb@0)"),
        ((_slice("S0", 0),), {},
         "pod ns/p: container main asks for 2 nvidia.com/gpu, 1 of the slices reserved for it "
         "are left (GPU 0 MPS slice 0 (10 GB))"),
    ],
)  # fmt: skip
def test_each_refusal_says_exactly_why(
    reserved: tuple[resolving.Instance, ...],
    allocated: dict[str, resolving.PodAllocation],
    message: str,
) -> None:
    assert resolve(["x", "y"], TWO, {"ns/p": reserved}, allocated) == resolving.Refusal(message)


def test_a_container_finding_none_left_says_none() -> None:
    p = pod("p", c("a"), c("b"))
    ledger = {"ns/p": resolving.PodAllocation(p.uid, True, (("a", ("A",)),))}
    assert resolve(["x"], [p], {"ns/p": (inst("A"),)}, ledger) == resolving.Refusal(
        "pod ns/p: container b asks for 1 nvidia.com/gpu, 0 of the instances reserved for it "
        "are left (none)"
    )


def test_no_pod_and_a_whole_gpu_refusal_say_exactly_why() -> None:
    assert resolve(["x", "y", "z"], [pod("p")], {}) == resolving.NoPod(
        "no pod bound to this node is waiting for 3 nvidia.com/gpu (pending, a container "
        "asking for that many not yet allocated)"
    )
    whole = [pod("w", c("main", 3), is_unified=False)]
    got = resolve(["MIG-a", "GPU-1", "MIG-b"], whole, {}, pool=frozenset({"MIG-a", "MIG-b"}))
    assert got == resolving.Refusal(
        "pod ns/w asks for whole GPUs (nvidia.com/gpu without gpumem or gpucores) but the "
        "kubelet picked MIG-a, MIG-b, MIG instances set aside for unified pods"
    )


def test_a_container_asking_more_than_is_left_lists_what_is() -> None:
    got = resolve(["x", "y", "z"], [pod("p", c("main", 3))], {"ns/p": (inst("A"), inst("B", 1))})
    assert got == resolving.Refusal(
        "pod ns/p: container main asks for 3 nvidia.com/gpu, 2 of the instances reserved for it "
        "are left (GPU 0 1g.10gb@0, GPU 0 1g.10gb@1)"
    )
