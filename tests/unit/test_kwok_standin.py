"""The simulated kubelet assigns devices to the pods bound to its node, as Allocate would.

Pure parts (:func:`standin.assign`, :func:`boundpods.bound_pod`, :class:`boundpods.PodBook`) are
tested alone; then the single agent runs in process with the in-memory API, emulated GPUs and
the stand-in wired as ``migpilot agent --node --kubelet simulated`` wires it. Nothing sleeps:
passes are driven with ``reconcile``, the pod watch with ``listed``/``changed`` or a thread.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from migpilot import errors
from migpilot.agent import metrics, reconciling, running
from migpilot.agent.cluster import boundpods, following, kubeapi, watching
from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import changes
from migpilot.gpu import clocks, emulated
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects
from migpilot.kwok import standin
from migpilot.mig import catalog
from tests.unit import followed_nodes

H100 = catalog.resolve_gpu("h100-80gb")
NODE = "node-a"
T0 = "2026-01-01T00:00:00Z"
R1G = "nvidia.com/mig-1g.10gb"
R3G = "nvidia.com/mig-3g.40gb"


def pod_doc(
    name: str,
    limits: dict[str, Any],
    *,
    node: str | None = NODE,
    namespace: str = "default",
    created: str = T0,
    phase: str = "Running",
    init: dict[str, Any] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": limits}}]}
    if init is not None:
        spec["initContainers"] = [{"name": "i", "resources": {"limits": init}}]
    if node is not None:
        spec["nodeName"] = node
    return {
        "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
        "spec": spec,
        "status": {"phase": phase},
    }


def dev(uuid: str, health: devices.Health = devices.Health.HEALTHY) -> devices.Device:
    return devices.Device(uuid, 0, health)


def bp(name: str, *requests: tuple[str, int], created: str = T0) -> boundpods.BoundPod:
    return boundpods.BoundPod("ns", name, NODE, created, tuple(sorted(requests)))


# --- pure parts --------------------------------------------------------------------------------


def test_bound_pod_reads_mig_requests() -> None:
    pod = boundpods.bound_pod(pod_doc("p", {R1G: 2, "cpu": "1"}, init={R3G: "1"}))
    assert pod is not None
    assert pod.key == "default/p" and pod.node == NODE
    assert pod.requests == ((R1G, 2), (R3G, 1))


@pytest.mark.parametrize(
    "doc",
    [
        pod_doc("unbound", {R1G: 1}, node=None),
        pod_doc("done", {R1G: 1}, phase="Succeeded"),
        pod_doc("failed", {R1G: 1}, phase="Failed"),
        pod_doc("cpu-only", {"cpu": "1"}),
        pod_doc("zero", {R1G: 0}),
    ],
)
def test_pods_holding_no_device(doc: dict[str, Any]) -> None:
    assert boundpods.bound_pod(doc) is None


def test_a_bad_mig_request_is_one_line() -> None:
    with pytest.raises(errors.MigpilotError, match=r"pod default/p.*nvidia.com/mig-1g.10gb"):
        boundpods.bound_pod(pod_doc("p", {"nvidia.com/mig-1g.10GB": 1}))


def test_assign_prefers_the_pods_reservation_then_unreserved_devices() -> None:
    advertised = {R1G: (dev("a"), dev("b"), dev("c"), dev("d"))}
    reserved = {"a": "ns/other", "c": "ns/p2"}
    got = standin.assign(
        [bp("p1", (R1G, 2)), bp("p2", (R1G, 1))],
        advertised=advertised,
        reserved=reserved,
        previous={},
    )
    # p1 comes first but never takes c (p2's) while unreserved ones remain; a goes last.
    assert got == {"ns/p1": ("b", "d"), "ns/p2": ("c",)}


def test_assign_keeps_what_a_pod_holds_and_skips_unhealthy_devices() -> None:
    advertised = {R1G: (dev("a", devices.Health.UNHEALTHY), dev("b"), dev("c"))}
    got = standin.assign(
        [bp("new", (R1G, 1), created="2025-01-01T00:00:00Z"), bp("old", (R1G, 2))],
        advertised=advertised,
        reserved={},
        previous={"ns/old": ("a", "c")},
    )
    # "new" sorts first but "old" keeps a (unhealthy, still its) and c; b goes to "new"; old
    # is not given more than it asked for.
    assert got == {"ns/new": ("b",), "ns/old": ("a", "c")}


def test_assign_gives_what_there_is_and_drops_devices_that_went() -> None:
    got = standin.assign(
        [bp("p", (R1G, 3), (R3G, 1))],
        advertised={R1G: (dev("a"),), R3G: ()},
        reserved={},
        previous={"ns/p": ("gone", "a")},
    )
    assert got == {"ns/p": ("a",)}


def test_a_pod_that_holds_nothing_gets_all_it_asks_for_or_nothing() -> None:
    advertised = {R1G: (dev("a"), dev("b"), dev("c")), R3G: (dev("x"),)}
    got = standin.assign(
        [
            bp("p1", (R1G, 2), (R3G, 2)),  # 3g short: holds nothing, takes nothing
            bp("p2", (R1G, 4)),  # short: nothing
            bp("p3", (R1G, 2), (R3G, 1)),
            bp("p4", (R1G, 1)),
        ],
        advertised=advertised,
        reserved={},
        previous={},
    )
    assert got == {"ns/p1": (), "ns/p2": (), "ns/p3": ("a", "b", "x"), "ns/p4": ("c",)}


def test_assign_is_deterministic_and_distinct() -> None:
    pods = [bp(f"p{i}", (R1G, 1 + i % 2)) for i in range(6)]
    advertised = {R1G: tuple(dev(f"d{i}") for i in range(7))}
    first = standin.assign(pods, advertised=advertised, reserved={}, previous={})
    assert first == standin.assign(pods, advertised=advertised, reserved={}, previous={})
    held = [u for devs in first.values() for u in devs]
    assert len(held) == len(set(held)) == 7


def test_pod_book_follows_lists_and_events() -> None:
    told: list[str] = []
    book = boundpods.PodBook(on_change=told.append)
    book.listed([pod_doc("p1", {R1G: 1}), pod_doc("x", {R1G: 1}, node="node-b")])
    assert [p.key for p in book.pods(NODE)] == ["default/p1"]
    assert sorted(told) == [NODE, "node-b"]
    v = book.version(NODE)
    told.clear()
    # A status change that does not change what the stand-in sees tells nobody.
    book.changed(kubeobjects.WatchEvent(kubeobjects.EventType.MODIFIED, pod_doc("p1", {R1G: 1})))
    assert told == [] and book.version(NODE) == v
    book.changed(
        kubeobjects.WatchEvent(
            kubeobjects.EventType.MODIFIED, pod_doc("p1", {R1G: 1}, phase="Failed")
        )
    )
    assert book.pods(NODE) == () and told == [NODE] and book.version(NODE) > v
    book.changed(
        kubeobjects.WatchEvent(kubeobjects.EventType.ADDED, pod_doc("p2", {"bad": 1, R3G: 1}))
    )
    book.changed(
        kubeobjects.WatchEvent(kubeobjects.EventType.DELETED, pod_doc("x", {R1G: 1}, node="node-b"))
    )
    assert [p.key for p in book.pods(NODE)] == ["default/p2"] and book.pods("node-b") == ()


# --- the single agent with the stand-in ---------------------------------------------------------


def spec(*gpus: list[dict[str, Any]]) -> dict[str, Any]:
    return {"gpus": [{"index": i, "instances": insts} for i, insts in enumerate(gpus)]}


def inst(profile: str, start: int, reserved: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"profile": profile, "start": start}
    if reserved is not None:
        out["reservedFor"] = reserved
    return out


@dataclass
class Node:
    api: kubeapi.InMemoryNodeApi
    gpus: emulated.EmulatedBackend
    source: following.GpuLayoutSource
    book: boundpods.PodBook
    kubelet: standin.SimulatedKubelet
    agent: running.Agent

    def step(self) -> changes.Report:
        self.source.sync()
        self.book.listed(self.api.list_pods(node=NODE).items)
        return self.agent.reconcile()

    def uuid(self, text: str, gpu: int = 0) -> str:
        (d,) = [d for d in self.gpus.mig_devices(gpu) if str(d) == text]
        assert d.uuid is not None
        return d.uuid

    def layout(self, gpu: int = 0) -> list[str]:
        return sorted(str(d) for d in self.gpus.mig_devices(gpu))

    def states(self, gpu: int = 0) -> dict[str, str]:
        got = self.api.layout(NODE)
        assert got is not None and got.status is not None
        (g,) = [g for g in got.status.gpus if g.index == gpu]
        return {f"{i.profile}@{i.start}": i.state.value for i in g.instances}


def wire(
    api: kubeapi.InMemoryNodeApi,
    gpus: emulated.EmulatedBackend,
    checkpoint: standin.Checkpoint | None = None,
) -> Node:
    """Part of what ``assembling.kube_side`` wires for ``--kubelet simulated``: the stand-in and
    the reporter only."""
    followed = followed_nodes.follow(api, NODE)
    source, book, reserving = followed.source, followed.book, followed.reserving
    kubelet = standin.SimulatedKubelet(
        api,
        node=NODE,
        strategy=devices.MigStrategy.MIXED,
        pods=book,
        spec=reserving,
        held=lambda: standin.reported_used(source.layout()),
        checkpoint=checkpoint,
    )
    used = reconciling.AnyOf([reconciling.RunningProcesses(gpus), kubelet])
    reporter = following.KubeReporter(api, source=source, in_use=used, now=lambda: T0)
    agent = running.Agent(
        gpus=gpus,
        in_use=reconciling.AnyOf([used, source]),
        source=running.AlsoWatching(source, kubelet.fingerprint),
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=running.AgentSettings(),
        listener=running.Listeners([kubelet, reporter]),
    )
    return Node(api, gpus, source, book, kubelet, agent)


@pytest.fixture
def node() -> Iterator[Node]:
    api = kubeapi.InMemoryNodeApi()
    gpus = emulated.EmulatedBackend([H100] * 2, durable=False)
    yield wire(api, gpus)
    api.close()
    gpus.close()


def test_a_bound_pod_gets_its_reserved_instance_which_is_reported_used(node: Node) -> None:
    node.api.put_spec(
        NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1, "default/p"), inst("3g.40gb", 4)])
    )
    node.step()
    assert node.states() == {"1g.10gb@0": "free", "1g.10gb@1": "reserved", "3g.40gb@4": "free"}
    node.api.put_pod(pod_doc("p", {R1G: 1}))
    node.step()
    assert node.kubelet.assigned() == {"default/p": (node.uuid("1g.10gb@1"),)}
    assert node.states() == {"1g.10gb@0": "free", "1g.10gb@1": "used", "3g.40gb@4": "free"}


def test_an_assigned_instance_outlives_the_spec_until_its_pod_goes(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("3g.40gb", 0), inst("3g.40gb", 4)]))
    node.step()
    node.api.put_pod(pod_doc("p", {R3G: 1}))
    node.step()
    held = node.kubelet.assigned()["default/p"]
    assert held == (node.uuid("3g.40gb@0"),)  # no reservation: the first free one
    # The controller drops both instances from the spec: only the free one goes.
    node.api.put_spec(NODE, spec([inst("7g.80gb", 0)], []))
    node.step()
    node.step()
    assert node.layout() == ["3g.40gb@0"]
    assert node.states()["3g.40gb@0"] == "used"
    # The pod ends: the instance is released, reported free, then replaced.
    node.api.delete_pod("default", "p")
    for _ in range(3):
        node.step()
    assert node.kubelet.assigned() == {}
    assert node.layout() == ["7g.80gb@0"]


def test_a_restarted_agent_gives_the_pods_the_devices_they_held(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1), inst("1g.10gb", 2)]))
    node.step()
    node.api.put_pod(pod_doc("a", {R1G: 1}, created="2026-01-01T00:00:01Z"))
    node.api.put_pod(pod_doc("b", {R1G: 1}, created="2026-01-01T00:00:02Z"))
    node.step()
    node.api.delete_pod("default", "a")
    node.step()
    held = node.kubelet.assigned()
    assert held == {"default/b": (node.uuid("1g.10gb@1"),)}
    assert node.states() == {"1g.10gb@0": "free", "1g.10gb@1": "used", "1g.10gb@2": "free"}
    # A new agent over the same GPUs and API. Made afresh, b would get the first free device,
    # 1g.10gb@0, and 1g.10gb@1 would turn free (destroyable); the devices the status reported
    # used go to the pods first, so nothing moves.
    again = wire(node.api, node.gpus)
    again.step()
    assert again.kubelet.assigned() == held
    assert again.states() == {"1g.10gb@0": "free", "1g.10gb@1": "used", "1g.10gb@2": "free"}
    # The hint serves the first assignment only: a new pod then takes the first free device,
    # even though the status still says used for the one b held.
    node.api.delete_pod("default", "b")
    node.api.put_pod(pod_doc("d", {R1G: 1}, created="2026-01-01T00:00:04Z"))
    again.book.listed(node.api.list_pods(node=NODE).items)
    assert again.kubelet.assigned() == {"default/d": (node.uuid("1g.10gb@0"),)}


def test_a_restart_with_the_checkpoint_gives_each_pod_its_own_devices(
    node: Node, tmp_path: Path
) -> None:
    ckpt = standin.Checkpoint(tmp_path / "node.json.kubelet-checkpoint")
    node = wire(node.api, node.gpus, ckpt)
    # a (older) gets 1g.10gb@1 and b 1g.10gb@0, reserved for them; then the spec reserves no
    # more (the controller drops a running pod's reservation).
    insts = [inst("1g.10gb", 0, "default/b"), inst("1g.10gb", 1, "default/a"), inst("1g.10gb", 2)]
    node.api.put_spec(NODE, spec(insts))
    node.step()
    node.api.put_pod(pod_doc("a", {R1G: 1}, created="2026-01-01T00:00:01Z") | {})
    node.api.put_pod(pod_doc("b", {R1G: 1}, created="2026-01-01T00:00:02Z"))
    node.step()
    held = node.kubelet.assigned()
    assert held == {"default/a": (node.uuid("1g.10gb@1"),), "default/b": (node.uuid("1g.10gb@0"),)}
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1), inst("1g.10gb", 2)]))
    node.step()
    # Without the checkpoint the status's used set alone comes back: the older pod, a, would
    # take the first used device, b's (the swap the soak bench saw).
    swapped = wire(node.api, node.gpus)
    swapped.step()
    assert swapped.kubelet.assigned() == {
        "default/a": (node.uuid("1g.10gb@0"),),
        "default/b": (node.uuid("1g.10gb@1"),),
    }
    # With it, each pod gets back exactly what it held, and its devices are in use before the
    # pods are even listed.
    again = wire(node.api, node.gpus, standin.Checkpoint(ckpt.path))
    assert again.kubelet.in_use() >= {node.uuid("1g.10gb@0"), node.uuid("1g.10gb@1")}
    again.step()
    assert again.kubelet.assigned() == held
    assert again.states() == {"1g.10gb@0": "used", "1g.10gb@1": "used", "1g.10gb@2": "free"}
    # A pod deleted while the agent was down is released; one made again under its name (a
    # new uid) is another pod and gets nothing back from the file.
    node.api.delete_pod("default", "a")
    node.api.put_pod(pod_doc("b", {R1G: 1}) | {"metadata": {
        "name": "b", "namespace": "default", "creationTimestamp": T0, "uid": "new"}})  # fmt: skip
    ckpt.save({"default/a": standin.Held("", held["default/a"]),
               "default/b": standin.Held("old", held["default/b"])})  # fmt: skip
    third = wire(node.api, node.gpus, standin.Checkpoint(ckpt.path))
    third.step()
    assert third.kubelet.assigned() == {"default/b": (node.uuid("1g.10gb@0"),)}
    assert standin.Checkpoint(ckpt.path).load() == {
        "default/b": standin.Held("new", (node.uuid("1g.10gb@0"),))
    }


def test_the_checkpoint_reads_back_what_it_wrote_and_ignores_a_bad_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    held = {"ns/p": standin.Held("u1", ("a", "b")), "ns/q": standin.Held("", ("c",))}
    ckpt = standin.Checkpoint(tmp_path / "c")
    assert ckpt.load() == {}  # no file yet
    assert ckpt.save(held)
    assert ckpt.load() == held
    assert standin.parse_checkpoint(standin.checkpoint_doc(held)) == held
    for bad, says in (
        ({"version": 2}, "version 1"),
        ({"version": 1, "pods": {}}, "not a list"),
        ({"version": 1, "pods": [{"pod": "ns/p", "devices": ["a"]}]}, "pod entry"),
    ):
        with pytest.raises(ValueError, match=says):
            standin.parse_checkpoint(bad)
    ckpt.path.write_text("{not json", encoding="utf-8")
    with caplog.at_level(logging.WARNING):
        assert ckpt.load() == {}
    assert "ignored" in caplog.text
    assert not standin.Checkpoint(tmp_path / "missing" / "c").save(held)


def test_restored_drops_a_pod_made_again_under_the_same_name() -> None:
    saved = {"ns/p": standin.Held("u1", ("a",)), "ns/q": standin.Held("u2", ("b",)),
             "ns/r": standin.Held("", ("c",))}  # fmt: skip
    pods = [bp("p", (R1G, 1)), dataclasses.replace(bp("q", (R1G, 1)), uid="u9")]
    assert standin.restored(saved, pods) == {"ns/p": ("a",), "ns/r": ("c",)}


def test_assign_prefers_held_devices_after_the_pods_own_reservation() -> None:
    advertised = {R1G: (dev("a"), dev("b"), dev("c"), dev("d"))}
    got = standin.assign(
        [bp("p1", (R1G, 1)), bp("p2", (R1G, 1)), bp("p3", (R1G, 1))],
        advertised=advertised,
        reserved={"a": "ns/p1", "d": "ns/p9"},
        previous={},
        held=frozenset({"c", "d"}),
    )
    # p1 takes its reservation; p2 and p3 the held ones, even d, reserved for another pod
    # (a pod held it before the restart); b, neither held nor reserved, stays free.
    assert got == {"ns/p1": ("a",), "ns/p2": ("c",), "ns/p3": ("d",)}


def test_the_first_assignment_waits_for_the_pod_list() -> None:
    api = kubeapi.InMemoryNodeApi()
    gpus = emulated.EmulatedBackend([H100], durable=False)
    api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1)]))
    first = wire(api, gpus)
    first.step()
    api.put_pod(pod_doc("a", {R1G: 1}))
    api.put_pod(pod_doc("b", {R1G: 1}, created="2026-01-01T00:00:01Z"))
    first.step()
    api.delete_pod("default", "a")
    first.step()
    assert first.states() == {"1g.10gb@0": "free", "1g.10gb@1": "used"}
    # As in the fleet: the pods are listed by another thread, after the first pass.
    book = boundpods.PodBook()
    source = following.GpuLayoutSource(api, node=NODE)
    source.sync()
    kubelet = standin.SimulatedKubelet(
        api,
        node=NODE,
        strategy=devices.MigStrategy.MIXED,
        pods=book,
        held=lambda: standin.reported_used(source.layout()),
    )
    state = reconciling.Reconciler(gpus, reconciling.InUseSet()).read()
    view = running.node_view(state)
    kubelet.passed(state=state, report=None, labels={}, view=view)
    assert kubelet.assigned() == {}
    book.listed(api.list_pods(node=NODE).items)
    kubelet.passed(state=state, report=None, labels={}, view=view)
    assert kubelet.assigned() == {"default/b": (first.uuid("1g.10gb@1"),)}
    api.close()
    gpus.close()


def test_a_pod_without_free_devices_waits_logged_once_and_gets_them_later(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0)]))
    node.step()
    node.api.put_pod(pod_doc("p", {R1G: 2}))
    with caplog.at_level(logging.INFO, logger="migpilot.kwok.standin"):
        node.step()
        node.step()
    waits = [r for r in caplog.records if "gets no device yet" in r.getMessage()]
    assert len(waits) == 1 and waits[0].levelno == logging.WARNING
    assert f"1 {R1G}" not in waits[0].getMessage() and f"2 {R1G}" in waits[0].getMessage()
    assert node.kubelet.assigned() == {"default/p": ()}
    assert node.states() == {"1g.10gb@0": "free"}
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1)]))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="migpilot.kwok.standin"):
        node.step()
        node.step()
    assert node.kubelet.assigned() == {
        "default/p": (node.uuid("1g.10gb@0"), node.uuid("1g.10gb@1"))
    }
    assert node.states() == {"1g.10gb@0": "used", "1g.10gb@1": "used"}
    assert any("pod default/p gets MIG-" in r.getMessage() for r in caplog.records)


def test_a_pod_change_makes_a_pass_due(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0)]))
    node.step()
    assert not node.agent.due()
    node.book.changed(kubeobjects.WatchEvent(kubeobjects.EventType.ADDED, pod_doc("p", {R1G: 1})))
    assert node.agent.due()
    # in_use sees the new pod at once, before the pass (nothing it holds can go meanwhile).
    assert node.kubelet.in_use() == {node.uuid("1g.10gb@0")}


def test_the_pod_watch_follows_binds_and_deletions() -> None:
    api = kubeapi.InMemoryNodeApi()
    book = boundpods.PodBook()
    stop = threading.Event()
    thread = threading.Thread(
        target=watching.follow,
        kwargs={
            "what": "pods",
            "lister": lambda: api.list_pods(node=NODE),
            "watcher": lambda v: api.watch_pods(node=NODE, resource_version=v),
            "listed": book.listed,
            "changed": book.changed,
            "stop": stop,
            "retry_s": 0.01,
        },
        daemon=True,
    )
    api.put_pod(pod_doc("before", {R1G: 1}))
    thread.start()
    try:
        _wait(lambda: [p.name for p in book.pods(NODE)] == ["before"])
        api.put_pod(pod_doc("pending", {R1G: 1}, node=None))
        api.put_pod(pod_doc("elsewhere", {R1G: 1}, node="node-b"))
        api.put_pod(pod_doc("pending", {R1G: 1}))  # bound: arrives as ADDED
        _wait(lambda: [p.name for p in book.pods(NODE)] == ["before", "pending"])
        api.compact()
        api.delete_pod("default", "before")
        _wait(lambda: [p.name for p in book.pods(NODE)] == ["pending"])
        assert book.pods("node-b") == ()
    finally:
        stop.set()
        api.close()


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


# --- the first publish, as a kubelet's start ---------------------------------------------------


def test_stale_resources_are_the_extended_ones_shown_above_zero_and_not_advertised() -> None:
    node = {
        "status": {
            "capacity": {R1G: "12", R3G: "2", "cpu": "96", "nvidia.com/gpumem": "81920"},
            "allocatable": {
                R1G: "12",
                R3G: "0",
                "nvidia.com/gpu": "8",
                "example.com/fpga": "1",
                "hugepages-2Mi": "1Gi",
                "kubernetes.io/batch-cpu": "4",
                "requests.nvidia.com/gpu": "1",
                "nvidia.com/mig-7g.80gb": "0",
            },
        }
    }
    # R1G is advertised, the counters are the agent's own, R3G is above zero in capacity.
    got = standin.stale_resources(node, advertised={R1G: "3"})
    assert got == ("example.com/fpga", "nvidia.com/gpu", R3G)
    assert standin.stale_resources(None, advertised={}) == ()
    assert [standin.is_extended(n) for n in ("nvidia.com/gpu", "cpu", "kubernetes.io/x")] == [
        True,
        False,
        False,
    ]


class Unreadable(kubeapi.InMemoryNodeApi):
    """Fails the next ``fail`` reads of the Node."""

    fail = 0

    def list_node(self, name: str) -> kubeobjects.Listed:
        if self.fail:
            self.fail -= 1
            raise kube_errors.KubeApiError("503 Service Unavailable: down")
        return super().list_node(name)


def test_the_first_publish_zeroes_what_the_node_shows_that_nothing_advertises() -> None:
    """A Karpenter KWOK node is created with its instance type's MIG counts: the stand-in's
    first publish zeroes every extended resource it does not advertise (the unified counters
    aside), so kube-scheduler never binds a pod to instances that do not exist; a Node it
    cannot read is retried at the next pass, and later publishes do not read it again."""
    api = Unreadable()
    gpus = emulated.EmulatedBackend([H100], durable=False)
    node = wire(api, gpus)
    api.put_node(NODE, {})
    fake = {R1G: "56", R3G: "16", "nvidia.com/gpu": "8", "nvidia.com/gpumem": "81920"}
    api.patch_node_resources(NODE, fake)  # as Karpenter created it
    api.put_spec(NODE, {"gpus": [{"index": 0, "instances": [{"profile": "1g.10gb", "start": 0}]}]})
    api.fail = 1
    node.step()
    assert not node.kubelet.settled and node.kubelet.advertised_counts() is None
    assert api.node_resources[NODE][R3G] == "16"  # nothing published without the read
    node.step()
    assert node.kubelet.settled
    shown = api.node_resources[NODE]
    assert (shown[R1G], shown[R3G], shown["nvidia.com/gpu"]) == ("1", "0", "0")
    assert shown["nvidia.com/gpumem"] == "81920"  # the agent's own counter: not the stand-in's
    assert node.kubelet.advertised_counts() == {R1G: 1, R3G: 0, "nvidia.com/gpu": 0}
    api.fail = 5
    api.put_spec(NODE, {"gpus": [{"index": 0, "instances": []}]})
    node.step()
    assert api.fail == 5 and api.node_resources[NODE][R1G] == "0"
    gpus.close()


def test_a_count_the_node_lost_is_published_again() -> None:
    """Someone writes the Node's status from an older copy (KWOK's node-initialize stage, right
    after Karpenter created the Node): the watch shows the lost count, a pass is due, and it
    publishes the stand-in's counts again, as a kubelet's next status sync would."""
    api = kubeapi.InMemoryNodeApi()
    gpus = emulated.EmulatedBackend([H100], durable=False)
    node = wire(api, gpus)
    api.put_node(NODE, {})
    api.put_spec(NODE, {"gpus": [{"index": 0, "instances": [{"profile": "1g.10gb", "start": 0}]}]})
    node.step()
    doc = api.list_node(NODE).one()
    assert doc is not None and doc["status"]["allocatable"][R1G] == "1"
    before = node.kubelet.fingerprint()
    node.kubelet.node_seen(doc)
    assert node.kubelet.fingerprint() == before  # it shows what was published
    stale = {**doc, "status": {"capacity": {R1G: "7"}, "allocatable": {R1G: "7"}}}
    assert standin.lost_counts(stale, {R1G: "1"}) == (R1G,)
    assert standin.lost_counts(doc, {R1G: "1", R3G: "0"}) == ()  # absent is 0
    api.patch_node_resources(NODE, {R1G: "7"})  # the stale write
    node.kubelet.node_seen(api.list_node(NODE).one())
    assert node.kubelet.fingerprint() != before and node.agent.due()
    node.step()
    assert api.node_resources[NODE][R1G] == "1" and node.kubelet.settled
    gpus.close()


class _BindsDuringDestroy(emulated.EmulatedBackend):
    """Binds ``pod`` to the node just before the first ``destroy_instance`` runs (after the
    reconciler's last in-use check), and records what the stand-in then says each pod holds,
    as its other threads (the status writer, the pod watch) would see it."""

    def __init__(self) -> None:
        super().__init__([H100] * 2, durable=False)
        self.node: Node | None = None
        self.pod: dict[str, Any] | None = None
        self.seen: dict[str, tuple[str, ...]] | None = None

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        if self.node is not None and self.pod is not None:
            self.node.api.put_pod(self.pod)
            self.node.book.listed(self.node.api.list_pods(node=NODE).items)
            self.seen = self.node.kubelet.assigned()
            self.pod = None
        super().destroy_instance(gpu, gi_id)


def test_a_pod_bound_mid_pass_is_not_given_an_instance_the_pass_destroys() -> None:
    # The 35-minute soak's used-destroyed: the stand-in assigns from the view of the last
    # pass, which still lists an instance the running pass is destroying.
    api = kubeapi.InMemoryNodeApi()
    gpus = _BindsDuringDestroy()
    node = wire(api, gpus)
    try:
        api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("3g.40gb", 4)]))
        node.step()
        victim = node.uuid("1g.10gb@0")
        api.put_spec(NODE, spec([inst("3g.40gb", 0), inst("3g.40gb", 4)]))
        gpus.node, gpus.pod = node, pod_doc("p", {R1G: 1})
        node.step()
        assert gpus.seen is not None and victim not in gpus.seen.get("default/p", ())
        assert gpus.seen.get("default/p") == ()
        assert node.layout() == ["3g.40gb@0", "3g.40gb@4"]
        assert node.kubelet.assigned() == {"default/p": ()}  # no 1g.10gb left: it waits
        # Withheld only while the pass ran: a later instance of the profile is given out.
        api.put_spec(NODE, spec([inst("3g.40gb", 0), inst("1g.10gb", 4)]))
        node.step()
        node.step()
        assert node.kubelet.assigned() == {"default/p": (node.uuid("1g.10gb@4"),)}
    finally:
        api.close()
        gpus.close()


def test_assign_gives_no_new_pod_a_withheld_device_but_keeps_a_holders() -> None:
    advertised = {R1G: (dev("a"), dev("b"), dev("c"))}
    got = standin.assign(
        [bp("old", (R1G, 1)), bp("new", (R1G, 2), created="2026-02-01T00:00:00Z")],
        advertised=advertised,
        reserved={},
        previous={"ns/old": ("a",)},
        withheld=frozenset({"a", "b"}),
    )
    assert got == {"ns/old": ("a",), "ns/new": ()}  # new would need b: all or nothing
