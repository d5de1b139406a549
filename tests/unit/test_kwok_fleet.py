"""The fleet of simulated agents with the in-memory API: labels, dispatch, the work queue.

Most tests run :meth:`Fleet.run` in a thread against :class:`kubeapi.InMemoryNodeApi` with
instant emulated GPUs and wait (with a timeout, never a sleep deciding anything) for what the
nodes' agents write; one drives the callbacks and :meth:`Fleet.drain` without threads.
"""

from __future__ import annotations

import logging
import pathlib
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from migpilot import errors
from migpilot.agent import usage
from migpilot.agent.cluster import kubeapi
from migpilot.api import gpulayouts as gl
from migpilot.gpu import clocks, emulated
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects
from migpilot.kwok import fleet

LABEL = fleet.EMULATED_GPUS_LABEL
R1G = "nvidia.com/mig-1g.10gb"
MIB = 1024 * 1024


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


def pod_doc(name: str, node: str, limits: dict[str, Any]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {"phase": "Running"},
    }


def _wait(predicate: Callable[[], Any], timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while not (got := predicate()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return got


# --- the label ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "models", "ids"),
    [
        ("a100-80gb.x8", ["a100-80gb"] * 8, [None] * 8),
        ("a100-80gb.x1_a30.x2", ["a100-80gb", "a30-24gb", "a30-24gb"], [None] * 3),
        ("h100-80gb", ["h100-80gb"], [None]),
    ],
)
def test_backend_spec_from_a_label(value: str, models: list[str], ids: list[None]) -> None:
    got = fleet.backend_spec(value, node="n1")
    assert [m.id for m in got.models] == models
    assert list(got.pci_ids) == ids


def test_backend_spec_by_pci_id() -> None:
    got = fleet.backend_spec("0x233010DE.0x16C110DE.x2", node="n1")
    assert [m.id for m in got.models] == ["h100-80gb"] * 2
    assert all(p is not None and p.subsystem == 0x16C110DE for p in got.pci_ids)


@pytest.mark.parametrize("value", ["", "nope-gpu.x2", "a100-80gb.x0", "a100-80gb.x2.x3"])
def test_a_bad_label_names_the_node_and_the_label(value: str) -> None:
    with pytest.raises(errors.AgentConfigError) as err:
        fleet.backend_spec(value, node="n7")
    text = str(err.value)
    assert text.startswith(f"Node n7: label {LABEL}={value!r}") and "\n" not in text


# --- the work queue ----------------------------------------------------------------------------


def test_work_queue_runs_a_node_once_and_again_after_a_change_during_its_pass() -> None:
    q = fleet.WorkQueue()
    q.add("a")
    q.add("b")
    q.add("a")  # already waiting: once
    assert q.get() == "a"
    q.add("a")  # running: again after done
    assert q.get() == "b"
    q.done("b")
    assert not q.idle()
    q.done("a")
    assert q.get() == "a"
    q.done("a")
    assert q.idle()
    q.close()
    assert q.get() is None


def test_work_queue_never_runs_one_node_twice_at_once() -> None:
    q = fleet.WorkQueue()
    running: set[str] = set()
    overlaps: list[str] = []
    lock = threading.Lock()

    def work() -> None:
        while (node := q.get()) is not None:
            with lock:
                if node in running:
                    overlaps.append(node)
                running.add(node)
            time.sleep(0.001)
            with lock:
                running.discard(node)
            q.done(node)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for i in range(400):
        q.add(f"n{i % 5}")
    _wait(q.idle)
    q.close()
    for t in threads:
        t.join()
    assert overlaps == []


# --- the fleet ---------------------------------------------------------------------------------


class Running:
    """A fleet running in a thread over the in-memory API."""

    def __init__(self, api: kubeapi.InMemoryNodeApi, settings: fleet.FleetSettings) -> None:
        self.api = api
        self.fleet = fleet.Fleet(api, settings=settings, now=lambda: "2026-01-01T00:00:00Z")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.fleet.run, args=(self.stop,))

    def status(self, node: str) -> gl.LayoutStatus | None:
        got = self.api.layout(node)
        return None if got is None else got.status

    def states(self, node: str, gpu: int = 0) -> dict[str, str]:
        status = self.status(node)
        if status is None:
            return {}
        return {
            f"{i.profile}@{i.start}": i.state.value
            for g in status.gpus
            if g.index == gpu
            for i in g.instances
        }


@pytest.fixture
def running() -> Iterator[Running]:
    api = kubeapi.InMemoryNodeApi()
    settings = fleet.FleetSettings(workers=4, tick_s=0.01, times=emulated.INSTANT)
    r = Running(api, settings)
    r.thread.start()
    yield r
    r.stop.set()
    api.close()
    r.thread.join(timeout=10)
    assert not r.thread.is_alive()


def test_the_fleet_labels_its_nodes_then_follows_their_gpulayouts(running: Running) -> None:
    api = running.api
    nodes = [f"n{i}" for i in range(3)]
    for n in nodes:
        api.put_node(n, {LABEL: "h100-80gb.x2"})
    api.put_node("other", {"type": "kwok"})  # not selected
    # GFD labels before any GpuLayout exists: the controller creates one for mig.capable nodes.
    _wait(lambda: all(api.node_labels.get(n, {}).get("nvidia.com/mig.capable") for n in nodes))
    assert "other" not in api.node_labels
    assert running.fleet.members() == nodes
    for n in nodes:
        api.put_spec(n, spec([inst("1g.10gb", 0), inst("3g.40gb", 4)], [inst("7g.80gb", 0)]))
    for n in nodes:
        _wait(lambda n=n: running.states(n) == {"1g.10gb@0": "free", "3g.40gb@4": "free"})
        _wait(lambda n=n: running.states(n, 1) == {"7g.80gb@0": "free"})
        _wait(lambda n=n: api.node_resources.get(n, {}).get(R1G) == "1")
    # Each node has its own GPUs (distinct UUIDs), in memory.
    uuids = set()
    for n in nodes:
        status = running.status(n)
        assert status is not None
        uuids |= {g.uuid for g in status.gpus}
    assert len(uuids) == 6
    # A spec change wakes the node's pass at once (tick aside, the watch event queues it).
    api.put_spec("n1", spec([inst("2g.20gb", 0)]))
    _wait(lambda: running.states("n1") == {"2g.20gb@0": "free"})
    assert running.states("n0") == {"1g.10gb@0": "free", "3g.40gb@4": "free"}


def test_the_fleet_assigns_instances_to_bound_pods(running: Running) -> None:
    api = running.api
    api.put_node("n0", {LABEL: "h100-80gb.x1"})
    api.put_spec("n0", spec([inst("1g.10gb", 0), inst("1g.10gb", 1, "ns/p")]))
    _wait(lambda: running.states("n0") == {"1g.10gb@0": "free", "1g.10gb@1": "reserved"})
    api.put_pod(pod_doc("p", "n0", {R1G: 1}))
    _wait(lambda: running.states("n0") == {"1g.10gb@0": "free", "1g.10gb@1": "used"})
    # The spec drops the pod's instance: it stays, used, until the pod goes.
    api.put_spec("n0", spec([inst("7g.80gb", 0)]))
    _wait(lambda: running.states("n0") == {"1g.10gb@1": "used"})
    api.delete_pod("ns", "p")
    _wait(lambda: running.states("n0") == {"7g.80gb@0": "free"})


def test_the_fleet_serves_unified_pods_and_publishes_the_counters(running: Running) -> None:
    api = running.api
    api.put_node("n0", {LABEL: "h100-80gb.x2"})
    _wait(lambda: api.node_resources.get("n0", {}).get("nvidia.com/gpucores") == "200")
    unified = pod_doc("u", "n0", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000})
    api.put_pod({**unified, "spec": {**unified["spec"], "nodeName": None}})  # pending
    api.put_spec("n0", spec([inst("1g.10gb", 0), inst("1g.10gb", 1, "ns/u", unified=True)]))
    _wait(lambda: api.node_resources["n0"].get("nvidia.com/gpu") == "1")
    assert api.node_resources["n0"][R1G] == "1"
    api.put_pod(unified)  # bound
    _wait(lambda: running.states("n0") == {"1g.10gb@0": "free", "1g.10gb@1": "used"})
    layout = api.layout("n0")
    assert layout is not None and gl.allocated(layout, "ns/u")
    api.delete_pod("ns", "u")
    _wait(lambda: running.states("n0") == {"1g.10gb@0": "free", "1g.10gb@1": "reserved"})
    api.put_spec("n0", spec([inst("1g.10gb", 0), inst("1g.10gb", 1)]))
    _wait(lambda: api.node_resources["n0"].get("nvidia.com/gpu") == "0")


def test_the_fleet_serves_unified_pods_mps_slices(running: Running) -> None:
    """On a node in mode ``mps`` a unified pod's reserved slice is an ``nvidia.com/gpu``
    device, assigned to the pod once bound and reported used by it."""
    api = running.api
    api.put_node("n0", {LABEL: "h100-80gb.x1.mig-off", "migpilot.io/mode": "mps"})
    unified = pod_doc("u", "n0", {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000})
    api.put_pod({**unified, "spec": {**unified["spec"], "nodeName": None}})  # pending
    reserved = {"id": 1, "memoryGB": 10, "reservedFor": "ns/u", "resource": "nvidia.com/gpu"}
    api.put_spec("n0", {"gpus": [{"index": 0, "mps": [{"id": 0, "memoryGB": 10}, reserved]}]})

    def slices() -> dict[int, tuple[str, str | None]]:
        status = running.status("n0")
        found = [] if status is None else [s for g in status.gpus for s in g.mps]
        return {s.id: (s.state.value, s.used_by) for s in found}

    _wait(lambda: api.node_resources.get("n0", {}).get("nvidia.com/gpu") == "1")
    assert api.node_resources["n0"]["nvidia.com/gpu-10gb"] == "1"
    assert api.node_resources["n0"]["nvidia.com/gpumem"] == str(80 * 1024)
    _wait(lambda: slices() == {0: ("free", None), 1: ("reserved", None)})
    api.put_pod(unified)  # bound
    _wait(lambda: slices() == {0: ("free", None), 1: ("used", "ns/u")})
    api.delete_pod("ns", "u")
    _wait(lambda: slices() == {0: ("free", None), 1: ("reserved", None)})


def test_nodes_come_and_go_and_a_bad_label_is_logged(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    api = running.api
    caplog.set_level(logging.ERROR, logger="migpilot.kwok.fleet")
    api.put_node("bad", {LABEL: "nope.x2"})
    api.put_node("n0", {LABEL: "a100-80gb.x1"})
    _wait(lambda: running.fleet.members() == ["n0"])
    _wait(lambda: any("Node bad: label" in r.getMessage() for r in caplog.records))
    api.delete_node("n0")
    _wait(lambda: running.fleet.members() == [])
    api.put_node("bad", {LABEL: "a100-80gb.x1"})  # fixed: it joins
    _wait(lambda: running.fleet.members() == ["bad"])


def test_callbacks_and_drain_without_threads() -> None:
    api = kubeapi.InMemoryNodeApi()
    f = fleet.Fleet(api, settings=fleet.FleetSettings(times=emulated.INSTANT))
    api.put_node("n0", {LABEL: "h100-80gb.x1"})
    api.put_spec("n0", spec([inst("1g.10gb", 0)]))
    f.layouts_listed(api.list_layouts().items)  # a layout before its node: kept for it
    f.nodes_listed(api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items)
    f.drain()
    got = api.layout("n0")
    assert got is not None and got.status is not None
    assert [i.state for g in got.status.gpus for i in g.instances] == [gl.InstanceState.FREE]
    f.drain()  # nothing due: nothing runs
    writes = api.status_writes
    f.tick()
    f.drain()
    assert api.status_writes == writes
    f.nodes_listed([])
    assert f.members() == []


class Flaky(kubeapi.InMemoryNodeApi):
    """Refuses status writes while :attr:`down`."""

    down = False

    def apply_layout_status(self, name: str, status: gl.LayoutStatus) -> None:
        if self.down:
            raise kube_errors.KubeApiError("503 Service Unavailable: down")
        super().apply_layout_status(name, status)


def test_a_settled_node_waits_for_its_resync_one_with_work_left_for_its_interval() -> None:
    api, clock = Flaky(), clocks.VirtualClock()
    settings = fleet.FleetSettings(times=emulated.INSTANT, interval_s=30, resync_s=300)
    f = fleet.Fleet(api, settings=settings, clock=clock)
    api.put_node("n0", {LABEL: "h100-80gb.x1"})
    api.put_spec("n0", spec([inst("1g.10gb", 0), inst("1g.10gb", 1)]))
    f.layouts_listed(api.list_layouts().items)
    f.pods.listed(api.list_pods(node=None).items)
    f.nodes_listed(api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items)
    f.drain()

    def queued_after(seconds: float) -> bool:
        clock.sleep(seconds)
        f.tick()
        queued = not f.queue.idle()
        f.drain()
        return queued

    # Settled: nothing for the interval, a pass at the resync.
    assert not queued_after(31)
    assert not queued_after(200)
    assert queued_after(70)
    # A status write refused: retried every interval until it goes through.
    api.down = True
    api.put_spec("n0", spec([inst("1g.10gb", 0)]))
    f.layout_changed(
        kubeobjects.WatchEvent(kubeobjects.EventType.MODIFIED, api.list_layouts().items[0])
    )
    f.drain()
    assert queued_after(31)
    api.down = False
    assert queued_after(31)  # this pass writes it
    got = api.layout("n0")
    assert got is not None and got.status is not None and got.status.observed_generation == 2
    assert not queued_after(31)
    # A refusal (a bound pod holds an instance the spec drops) is retried every interval too.
    pod = pod_doc("p", "n0", {R1G: 1})
    api.put_pod(pod)
    f.pods.changed(kubeobjects.WatchEvent(kubeobjects.EventType.ADDED, pod))
    f.drain()
    api.put_spec("n0", spec([inst("7g.80gb", 0)]))
    f.layout_changed(
        kubeobjects.WatchEvent(kubeobjects.EventType.MODIFIED, api.list_layouts().items[0])
    )
    f.drain()
    assert queued_after(31)
    assert queued_after(31)
    # The pod goes: the change passes the node at once, which then settles.
    api.delete_pod("ns", "p")
    f.pods.changed(kubeobjects.WatchEvent(kubeobjects.EventType.DELETED, pod))
    for _ in range(3):  # released and reported free; the status seen, destroyed and replaced
        f.drain()
        f.layouts_listed(api.list_layouts().items)  # as the watch shows the new status
    f.drain()
    member = f.member("n0")
    assert member is not None
    assert [str(d) for d in member.gpus.mig_devices(0)] == ["7g.80gb@0"]
    assert not queued_after(31)


def test_the_fleet_serves_its_metrics_and_probes() -> None:
    """``migpilot fleet --metrics-port``: every node's reconciler counts into one registry."""
    f = fleet.Fleet(kubeapi.InMemoryNodeApi(), settings=fleet.FleetSettings(times=emulated.INSTANT))
    endpoint = f.serve(port=0, address="127.0.0.1")
    try:
        base = f"http://127.0.0.1:{endpoint.port}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            assert b"migpilot_reconcile_actions" in r.read()
        with urllib.request.urlopen(f"{base}/healthz", timeout=5) as r:
            assert r.status == 200
    finally:
        endpoint.close()


def _usage(rows: tuple[usage.Row, ...], name: str) -> dict[tuple[str, str], float]:
    """(node, pod) -> value of the series ``name``."""
    return {
        (dict(r.labels)["node"], dict(r.labels)["pod"]): r.value for r in rows if r.name == name
    }


def _instances(rows: tuple[usage.Row, ...]) -> dict[tuple[str, str], float]:
    """(node, state) -> instances of every profile."""
    out: dict[tuple[str, str], float] = {}
    for r in rows:
        if r.name == usage.INSTANCES:
            labels = dict(r.labels)
            key = (labels["node"], labels["state"])
            out[key] = out.get(key, 0.0) + r.value
    return out


def test_one_sampler_serves_every_nodes_gpu_use_as_the_load_file_sets_it(
    tmp_path: pathlib.Path,
) -> None:
    """``migpilot fleet --emulated-load``: every node's per-pod series in the one registry,
    a reserved instance reads ``reserved``, the file's changes and a pod's deletion show."""
    load = tmp_path / "load.yaml"
    load.write_text("ns/p: {utilization: 0.9, memoryUsedMiB: 2048}\n", encoding="utf-8")
    api = kubeapi.InMemoryNodeApi()
    settings = fleet.FleetSettings(times=emulated.INSTANT, emulated_load=load)
    f = fleet.Fleet(api, settings=settings)
    api.put_node("n0", {LABEL: "h100-80gb.x1"})
    api.put_node("n1", {LABEL: "h100-80gb.x1"})
    api.put_spec("n0", spec([inst("1g.10gb", 0), inst("1g.10gb", 1, "ns/later")]))
    api.put_spec("n1", spec([inst("1g.10gb", 0)]))
    api.put_pod(pod_doc("p", "n0", {R1G: 1}))
    api.put_pod(pod_doc("q", "n1", {R1G: 1}))
    f.layouts_listed(api.list_layouts().items)
    f.nodes_listed(api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items)
    f.pods.listed(api.list_pods(node=None).items)
    f.drain()

    rows = f.sample_usage()
    assert _usage(rows, usage.DEVICE_UTILIZATION) == {
        ("n0", "p"): pytest.approx(0.9),
        ("n1", "q"): 0.0,  # not in the file: idle
    }
    assert _usage(rows, usage.DEVICE_MEMORY_USED) == {("n0", "p"): 2048 * MIB, ("n1", "q"): 0.0}
    assert _instances(rows) == {
        ("n0", "used"): 1.0,
        ("n0", "reserved"): 1.0,
        ("n0", "free"): 0.0,
        ("n1", "used"): 1.0,
        ("n1", "reserved"): 0.0,
        ("n1", "free"): 0.0,
    }
    endpoint = f.serve(port=0, address="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        endpoint.close()
    assert 'node="n0"' in text and 'node="n1"' in text and 'pod="p"' in text

    # The file changes: re-read, the next pass shows it.
    load.write_text("ns/q: {utilization: 0.25, memoryUsedMiB: 512}\n", encoding="utf-8")
    assert f.load is not None and f.load.poll()
    rows = f.sample_usage()
    assert _usage(rows, usage.DEVICE_UTILIZATION) == {
        ("n0", "p"): 0.0,
        ("n1", "q"): pytest.approx(0.25),
    }
    # The pod and then a node go: their series with them.
    api.delete_pod("ns", "q")
    f.pods.listed(api.list_pods(node=None).items)
    f.tick()
    f.drain()
    assert _usage(f.sample_usage(), usage.DEVICE_MEMORY_USED) == {("n0", "p"): 0.0}
    f.nodes_listed(
        [
            d
            for d in api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items
            if d["metadata"]["name"] == "n0"
        ]
    )
    assert {dict(r.labels)["node"] for r in f.sample_usage()} == {"n0"}


def test_a_bad_load_file_stops_the_fleet_with_the_field_named(tmp_path: pathlib.Path) -> None:
    load = tmp_path / "load.yaml"
    load.write_text("ns/p: {utilization: 2}\n", encoding="utf-8")
    settings = fleet.FleetSettings(emulated_load=load)
    with pytest.raises(errors.AgentConfigError, match="utilization"):
        fleet.Fleet(kubeapi.InMemoryNodeApi(), settings=settings)


@pytest.mark.parametrize(
    ("labels", "switched"), [({}, False), ({"migpilot.io/mig-mode": "dynamic"}, True)]
)
def test_only_a_node_labelled_dynamic_switches_an_idle_gpu_s_mig_mode(
    labels: dict[str, str], switched: bool
) -> None:
    api = kubeapi.InMemoryNodeApi()
    f = fleet.Fleet(api, settings=fleet.FleetSettings(times=emulated.INSTANT))
    api.put_node("n0", {LABEL: "h100-80gb.x2", **labels})
    doc = spec([inst("1g.10gb", 0)], [])
    doc["gpus"][1]["mig"] = False
    api.put_spec("n0", doc)
    f.layouts_listed(api.list_layouts().items)
    f.nodes_listed(api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items)
    f.drain()
    member = f.member("n0")
    assert member is not None
    assert [g.mig is not None and g.mig.current for g in member.gpus.gpus()] == [True, not switched]
    assert [str(d) for d in member.gpus.mig_devices(0)] == ["1g.10gb@0"]
    got = api.layout("n0")
    assert got is not None and got.status is not None
    modes = [(g.index, g.mig_mode) for g in got.status.gpus]
    state = api.node_labels.get("n0", {}).get("migpilot.io/mig-mode.state")
    if switched:
        assert modes == [(0, gl.MigModeStatus(True, True)), (1, gl.MigModeStatus(False, False))]
        assert state == "success"
        assert api.node_resources.get("n0", {}).get("nvidia.com/gpu") == "1"
    else:
        assert modes == [(0, None), (1, None)]  # as today: no mode reported, no label
        assert state is None
