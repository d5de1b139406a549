"""The fleet's nodes in DRA mode (``migpilot.io/mode=dra``) over the in-memory API: their
ResourceSlices published by the agent's publisher, no device-plugin count in the Node, the
claims of their bound pods prepared (the instance made at the allocated placement, used, then
destroyed once no pod uses the claim), another driver's claims left alone, the plan listed first
while the controller's Lease is fresh; and the pure parts (which claims a pod names, which to
prepare and unprepare)."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest

from migpilot.agent import reconciling
from migpilot.agent import running as agent_running
from migpilot.agent.cluster import boundpods, kubeapi
from migpilot.agent.deviceplugin import devices
from migpilot.agent.dra import claims, placements, publishing
from migpilot.gpu import emulated
from migpilot.kube import objects as kubeobjects
from migpilot.kwok import drastandin, fleet, standin
from migpilot.mig import catalog

LABEL = fleet.EMULATED_GPUS_LABEL
DRA = {LABEL: "h100-80gb.x1", "migpilot.io/mode": "dra"}
NS = "ns"
SLICES = kubeobjects.Kind.RESOURCESLICES
CLAIMS = kubeobjects.Kind.RESOURCECLAIMS
R1G = "nvidia.com/mig-1g.10gb"


def _wait(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return got


def _pod(name: str, node: str | None, *entries: dict[str, Any], **status: Any) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": NS,
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": node,
            "containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": list(entries),
        },
        "status": {"phase": "Running", **status},
    }


def _claim(
    name: str, *, device: str | None, pool: str = "n0", driver: str = placements.DRIVER
) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS, "uid": f"claim-uid-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
    }
    if device is not None:
        result = {"request": "gpu", "driver": driver, "pool": pool, "device": device}
        doc["status"] = {"allocation": {"devices": {"results": [result]}}}
    return doc


# --- the pure parts ----------------------------------------------------------------------------


def test_a_pods_claims_are_its_claim_names_and_its_templates_claims() -> None:
    doc = _pod(
        "p",
        "n0",
        {"name": "a", "resourceClaimName": "shared"},
        {"name": "b", "resourceClaimTemplateName": "t"},
        {"name": "c", "resourceClaimTemplateName": "t2"},  # its claim not made yet
        {"name": "d", "resourceClaimTemplateName": "t3"},  # the template made none
        {"name": "e", "resourceClaimName": "shared"},  # named twice: once
        resourceClaimStatuses=[
            {"name": "b", "resourceClaimName": "p-b-x7k2"},
            {"name": "d", "resourceClaimName": None},
        ],
    )
    assert boundpods.pod_claims(doc) == ("shared", "p-b-x7k2")
    bound = boundpods.bound_pod(doc)
    assert bound is not None and bound.claims == ("shared", "p-b-x7k2") and not bound.requests
    # Anything not shaped as the API says names nothing; a pod with no claim and no GPU is none.
    assert boundpods.pod_claims({"spec": {"resourceClaims": "x"}, "status": []}) == ()
    assert boundpods.pod_claims({"spec": {"resourceClaims": [7, {"resourceClaimName": 3}]}}) == ()
    assert boundpods.bound_pod(_pod("q", "n0")) is None


def _bound(name: str, *claim_names: str) -> boundpods.BoundPod:
    return boundpods.BoundPod(NS, name, "n0", "", (), claims=claim_names)


def test_work_prepares_new_claims_and_unprepares_those_no_pod_names() -> None:
    pods = [_bound("a", "c1", "c2"), _bound("b", "c2")]
    got = drastandin.work(pods, prepared={(NS, "c2"): "u2", (NS, "old"): "u9"})
    assert got.prepare == ((NS, "c1"),)
    assert got.unprepare == (claims.ClaimRef(NS, "old", "u9"),)
    assert drastandin.work(pods, prepared={}, others=frozenset({(NS, "c1")})).prepare == (
        (NS, "c2"),
    )
    assert drastandin.work([], prepared={}) == drastandin.Work((), ())


def test_allocated_here_reads_the_driver_and_pool_of_the_results() -> None:
    device = "gpu-0-mig-1g-10gb-0"
    assert drastandin.allocated_here(_claim("c", device=device), driver=placements.DRIVER,
                                     pool="n0") is True  # fmt: skip
    assert drastandin.allocated_here(_claim("c", device=device, pool="n1"),
                                     driver=placements.DRIVER, pool="n0") is False  # fmt: skip
    other = _claim("c", device="gpu-0", driver="gpu.example.com")
    assert drastandin.allocated_here(other, driver=placements.DRIVER, pool="n0") is False
    assert drastandin.allocated_here(_claim("c", device=None), driver="d", pool="n0") is None
    assert drastandin.allocated_here({"status": {"allocation": 3}}, driver="d", pool="p") is None


# --- the fleet ---------------------------------------------------------------------------------


class Running:
    """A fleet running in a thread over the in-memory API."""

    def __init__(self, api: kubeapi.InMemoryNodeApi) -> None:
        self.api = api
        settings = fleet.FleetSettings(
            workers=2, tick_s=0.01, times=emulated.INSTANT, lease_namespace="mp"
        )
        self.fleet = fleet.Fleet(api, settings=settings, now=lambda: "2026-01-01T00:00:00Z")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.fleet.run, args=(self.stop,))

    def slices(self, node: str) -> list[dict[str, Any]]:
        with self.api.server.lock:
            docs = list(self.api.server.objects[SLICES].values())
        return [d for d in docs if d["spec"].get("nodeName") == node]

    def devices(self, node: str) -> list[str]:
        """The node's published devices, in kube-scheduler's walk order (slices by name)."""
        out = []
        for doc in sorted(self.slices(node), key=lambda d: d["metadata"]["name"]):
            out += [d["name"] for d in doc["spec"].get("devices") or ()]
        return out

    def instances(self, node: str) -> set[tuple[str, int]]:
        member = self.fleet.member(node)
        assert member is not None
        return {(d.profile, d.start) for d in member.gpus.mig_devices(0)}

    def states(self, node: str) -> dict[str, str]:
        layout = self.api.layout(node)
        if layout is None or layout.status is None:
            return {}
        return {
            f"{i.profile}@{i.start}": i.state.value for g in layout.status.gpus for i in g.instances
        }


@pytest.fixture
def running() -> Iterator[Running]:
    r = Running(kubeapi.InMemoryNodeApi())
    r.thread.start()
    yield r
    r.stop.set()
    r.api.close()
    r.thread.join(timeout=10)
    assert not r.thread.is_alive()


def test_a_dra_node_publishes_slices_and_no_device_plugin_counts(running: Running) -> None:
    api = running.api
    api.put_node("n0", DRA)
    api.put_node("n1", {LABEL: "h100-80gb.x1"})  # a device-plugin node beside
    api.put_spec("n1", {"gpus": [{"index": 0, "instances": [{"profile": "1g.10gb", "start": 0}]}]})
    _wait(lambda: api.node_resources.get("n1", {}).get("nvidia.com/mig-1g.10gb") == "1")
    names = _wait(lambda: running.devices("n0"))
    h100 = placements.Placement(0, "7g.80gb", 0)
    assert placements.device_name(h100) in names
    assert running.slices("n1") == []
    assert all(
        d["spec"]["driver"] == publishing.DRIVER and d["spec"]["pool"]["name"] == "n0"
        for d in running.slices("n0")
    )
    # The GFD labels are written (the controller creates the GpuLayout), no MIG count, no
    # unified counter: no device plugin serves a DRA node.
    _wait(lambda: api.node_labels.get("n0", {}).get("nvidia.com/mig.capable"))
    assert not any(k.startswith("nvidia.com/") for k in api.node_resources.get("n0", {}))
    member = running.fleet.member("n0")
    assert member is not None and member.slices is not None and member.dra is not None


def test_the_claims_of_a_dra_nodes_pods_are_prepared_and_released(running: Running) -> None:
    api = running.api
    api.put_node("n0", DRA)
    api.put_spec("n0", {"gpus": []})  # as the controller makes it: the status is reported there
    _wait(lambda: running.devices("n0"))
    placement = placements.Placement(0, "3g.40gb", 4)
    device = placements.device_name(placement)
    api.server.put(CLAIMS, _claim("c1", device=device))
    api.server.put(CLAIMS, _claim("other", device="gpu-0", driver="gpu.example.com"))
    api.put_pod(
        _pod(
            "p",
            "n0",
            {"name": "gpu", "resourceClaimTemplateName": "t"},
            resourceClaimStatuses=[{"name": "gpu", "resourceClaimName": "c1"}],
        )
    )
    api.put_pod(_pod("q", "n0", {"name": "gpu", "resourceClaimName": "other"}))
    _wait(lambda: running.instances("n0") == {("3g.40gb", 4)})
    member = running.fleet.member("n0")
    assert member is not None and member.dra is not None
    assert member.dra.prepared() == {(NS, "c1"): "claim-uid-c1"}  # not the other driver's
    _wait(lambda: running.states("n0") == {"3g.40gb@4": "used"})
    _wait(lambda: member.dra is not None and member.dra.settled)
    # A second pod of the same claim shares it: one instance; it goes with the last pod.
    api.put_pod(_pod("p2", "n0", {"name": "gpu", "resourceClaimName": "c1"}))
    api.delete_pod(NS, "p")
    _wait(lambda: {b.name for b in running.fleet.pods.pods("n0")} == {"p2", "q"})
    assert member.dra.sync(running.fleet.pods.pods("n0"))  # a round with p gone: nothing to do
    assert running.instances("n0") == {("3g.40gb", 4)}
    api.delete_pod(NS, "p2")
    _wait(lambda: running.instances("n0") == set())
    assert member.dra.prepared() == {}


def test_a_claim_not_allocated_yet_is_prepared_once_it_is(running: Running) -> None:
    api = running.api
    api.put_node("n0", DRA)
    _wait(lambda: running.devices("n0"))
    api.server.put(CLAIMS, _claim("c1", device=None))
    api.put_pod(_pod("p", "n0", {"name": "gpu", "resourceClaimName": "c1"}))
    member = running.fleet.member("n0")
    assert member is not None and member.dra is not None
    _wait(lambda: member.dra is not None and not member.dra.settled)
    device = placements.device_name(placements.Placement(0, "1g.10gb", 2))
    api.server.put(CLAIMS, _claim("c1", device=device))
    api.delete_pod(NS, "p")  # the pod's change wakes the node; so would the retry
    api.put_pod(_pod("p", "n0", {"name": "gpu", "resourceClaimName": "c1"}))
    _wait(lambda: running.instances("n0") == {("1g.10gb", 2)})


def _lease(renewed: str) -> dict[str, Any]:
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {"name": "migpilot-controller", "namespace": "mp"},
        "spec": {"holderIdentity": "c", "renewTime": renewed, "leaseDurationSeconds": 3600},
    }


def test_the_plan_is_listed_first_while_the_controllers_lease_is_fresh(running: Running) -> None:
    api = running.api
    now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
    api.server.put(kubeobjects.Kind.LEASES, _lease(now))
    planned = placements.Placement(0, "2g.20gb", 2)
    spec = {
        "gpus": [
            {"index": 0, "instances": [{"profile": "2g.20gb", "start": 2, "reservedFor": "ns/x"}]}
        ]
    }
    api.put_node("n0", DRA)
    api.put_node("n1", DRA)
    api.put_spec("n0", spec)
    api.put_spec("n1", spec)
    first = [placements.device_name(planned)]
    for node in ("n0", "n1"):
        # The planned placement comes first in kube-scheduler's walk; not made by the agent.
        _wait(lambda: running.devices(node)[:1] == first)  # noqa: B023 (waited on at once)
        assert running.instances(node) == set()
    # Stale, nothing is listed first (both nodes read the fleet's one Lease reader, which
    # reads again at a pass once its 2 s are over: a spec change makes one).
    api.server.put(kubeobjects.Kind.LEASES, _lease("2020-01-01T00:00:00.000000Z"))
    changes = iter(range(10**6))

    def plain() -> bool:
        if running.devices("n0")[:1] != first:
            return True
        changed = {"profile": "2g.20gb", "start": 2, "reservedFor": f"ns/y{next(changes)}"}
        api.put_spec("n0", {"gpus": [{"index": 0, "instances": [changed]}]})
        time.sleep(0.05)
        return False

    _wait(plain)


# --- the stand-in on a DRA node ----------------------------------------------------------------


class _Counting(kubeapi.InMemoryNodeApi):
    def __init__(self) -> None:
        super().__init__()
        self.patches: list[dict[str, str | None]] = []

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        self.patches.append(dict(resources))
        super().patch_node_resources(node, resources)


@pytest.mark.parametrize("stale", [True, False], ids=["stale-count", "nothing-shown"])
def test_the_stand_in_of_a_dra_node_advertises_nothing_and_hands_out_nothing(stale: bool) -> None:
    api = _Counting()
    api.put_node("n0", DRA)
    if stale:  # a node made with counts for instances that do not exist (Karpenter's KWOK)
        with api.server.lock:
            doc = copy.deepcopy(api.server.objects[kubeobjects.Kind.NODES]["n0"])
            doc["status"] = {"capacity": {R1G: "3"}, "allocatable": {R1G: "3"}}
            api.server.store(kubeobjects.Kind.NODES, "n0", doc)
    gpus = emulated.EmulatedBackend([catalog.resolve_gpu("h100-80gb")], durable=False)
    gpus.create_instance(0, profile="1g.10gb", start=0)
    book = boundpods.PodBook()
    pod = _pod("p", "n0")
    pod["spec"]["containers"][0]["resources"] = {"limits": {R1G: 1}}
    book.listed([pod])
    kubelet = standin.SimulatedKubelet(
        api, node="n0", strategy=devices.MigStrategy.MIXED, pods=book, dra=True
    )
    state = reconciling.Reconciler(gpus, reconciling.InUseSet()).read()
    kubelet.passed(state=state, report=None, labels={}, view=agent_running.node_view(state))
    assert kubelet.assigned() == {}
    assert kubelet.settled and kubelet.in_use() == frozenset()
    # Only a count for devices that do not exist is written, as 0; else nothing at all.
    assert api.patches == ([{R1G: "0"}] if stale else [])
    kubelet.passed(state=state, report=None, labels={}, view=agent_running.node_view(state))
    assert len(api.patches) == (1 if stale else 0)
    gpus.close()
