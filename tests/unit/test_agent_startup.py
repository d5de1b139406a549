"""The startup taint (agent/cluster/startup.py): a node a NodePool brings up with
``migpilot.io/agent-not-ready:NoSchedule`` loses that taint, and only it, once its agent has
reported the GPUs and the Node shows the resources it advertises; in the fleet of simulated
agents and in the single agent, both over the in-memory API with emulated GPUs. The pure parts
are tested alone. Nothing sleeps: passes are driven with ``drain``/``reconcile``, the Node
watch by handing the callbacks the Node as listed.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from migpilot.agent import assembling, metrics, reconciling
from migpilot.agent import running as agent_running
from migpilot.agent.cluster import boundpods, following, kubeapi, startup, statics
from migpilot.agent.deviceplugin import devices
from migpilot.gpu import clocks, emulated
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects
from migpilot.kube import requests
from migpilot.kwok import fleet, standin
from migpilot.mig import catalog

LABEL = fleet.EMULATED_GPUS_LABEL
STARTUP = {"key": startup.TAINT_KEY, "effect": startup.TAINT_EFFECT}
OTHER = {"key": "example.com/other", "value": "x", "effect": "NoSchedule"}
UNREGISTERED = {"key": "karpenter.sh/unregistered", "effect": "NoExecute"}
R1G = "nvidia.com/mig-1g.10gb"


def node_doc(
    *, taints: list[dict[str, str]] | None = None, allocatable: dict[str, str] | None = None
) -> dict[str, Any]:
    return {
        "metadata": {"name": "n0"},
        "spec": {"taints": taints or []},
        "status": {"allocatable": allocatable or {}},
    }


def karpenter_node(api: kubeapi.InMemoryNodeApi, name: str, label: str) -> None:
    """A Node as Karpenter's KWOK provider creates it: the NodePool's label, the unregistered
    taint, and the instance type's fake MIG counts in capacity and allocatable."""
    fake = {R1G: "56", "nvidia.com/gpu": "8"}
    with api.server.lock:
        api.server.store(
            kubeobjects.Kind.NODES,
            name,
            {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {LABEL: label}},
                "spec": {"taints": [UNREGISTERED]},
                "status": {"capacity": dict(fake), "allocatable": {"cpu": "96", **fake}},
            },
        )


def stale_write(api: kubeapi.InMemoryNodeApi, name: str, resources: dict[str, str]) -> None:
    """Someone else writes these counts into the Node's capacity and allocatable."""
    with api.server.lock:
        doc = copy.deepcopy(api.server.objects[kubeobjects.Kind.NODES][name])
        doc["status"]["capacity"].update(resources)
        doc["status"]["allocatable"].update(resources)
        api.server.store(kubeobjects.Kind.NODES, name, doc)


def node_of(api: kubeapi.InMemoryNodeApi, name: str) -> dict[str, Any]:
    doc = api.list_node(name).one()
    assert doc is not None
    return copy.deepcopy(dict(doc))


def taints_of(api: kubeapi.InMemoryNodeApi, name: str) -> list[dict[str, Any]]:
    return list(node_of(api, name)["spec"].get("taints") or [])


# --- pure parts --------------------------------------------------------------------------------


def test_the_taint_is_matched_by_key_and_effect() -> None:
    assert startup.TAINT == "migpilot.io/agent-not-ready:NoSchedule"
    assert startup.tainted(node_doc(taints=[OTHER, {**STARTUP, "value": "any"}]))
    assert not startup.tainted(node_doc(taints=[OTHER, {**STARTUP, "effect": "NoExecute"}]))
    assert not startup.tainted(node_doc())
    assert not startup.tainted(None)
    assert requests.same_taint(STARTUP, key=startup.TAINT_KEY, effect="NoSchedule")
    patch = requests.node_taints_patch([OTHER], resource_version="42")
    assert patch == {"metadata": {"resourceVersion": "42"}, "spec": {"taints": [OTHER]}}


def test_shows_compares_the_allocatable_quantities() -> None:
    doc = node_doc(allocatable={R1G: "3", "nvidia.com/gpu": "0", "odd": "x"})
    assert startup.shows(doc, {R1G: 3, "nvidia.com/gpu": 0, "nvidia.com/mig-7g.80gb": 0})
    assert not startup.shows(doc, {R1G: 2})
    assert not startup.shows(doc, {"nvidia.com/mig-7g.80gb": 1})  # absent counts 0
    assert not startup.shows(doc, {"odd": 0})  # unreadable: no match
    assert startup.shows(doc, {})
    assert not startup.shows(None, {})


class Api(kubeapi.InMemoryNodeApi):
    """Refuses the next ``fail`` taint removals."""

    fail = 0

    def remove_node_taint(self, node: str, *, key: str, effect: str) -> bool:
        if self.fail:
            self.fail -= 1
            raise kube_errors.KubeApiError("503 Service Unavailable: down")
        return super().remove_node_taint(node, key=key, effect=effect)


def test_removed_only_when_reported_and_shown_and_retried_after_a_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = Api()
    api.put_node("n0", {})
    api.set_node_taints("n0", [STARTUP, OTHER])
    now: dict[str, Any] = {"reported": False, "counts": None}
    taint = startup.StartupTaint(api, node="n0")
    taint.ready_when(reported=lambda: now["reported"], advertised=lambda: now["counts"])
    taint.node_seen(node_doc(taints=[STARTUP, OTHER], allocatable={R1G: "56"}))
    assert taint.pending and taint.fingerprint() == ("tainted", False)
    caplog.set_level(logging.INFO)
    # Not reported; nothing published yet; published, but the fake count still shown.
    for reported, counts in ((False, {R1G: 0}), (True, None), (True, {R1G: 0})):
        now.update(reported=reported, counts=counts)
        taint.settle()
        assert taint.settled and taints_of(api, "n0") == [STARTUP, OTHER]
    assert "removing it once the GPUs are reported" in caplog.text
    taint.node_seen(node_doc(taints=[STARTUP, OTHER], allocatable={R1G: "0"}))
    assert taint.fingerprint() == ("tainted", True)  # a pass is due
    api.fail = 1
    taint.settle()
    assert not taint.settled and "not removed, retrying" in caplog.text
    assert taints_of(api, "n0") == [STARTUP, OTHER]
    taint.settle()
    assert taint.settled and taints_of(api, "n0") == [OTHER]
    assert api.taint_removals == 1
    assert not taint.pending and taint.fingerprint() is None
    taint.node_seen(node_of(api, "n0"))
    taint.settle()
    assert api.taint_removals == 1  # nothing sent when the Node has no taint


def test_an_untainted_node_costs_no_request() -> None:
    api = Api()
    api.put_node("n0", {})
    api.fail = 5  # any request would fail
    taint = startup.StartupTaint(api, node="n0")
    taint.ready_when(reported=lambda: True)
    taint.node_seen(node_of(api, "n0"))
    taint.settle()
    assert taint.settled and api.taint_removals == 0 and api.fail == 5


# --- the fleet ---------------------------------------------------------------------------------


def test_a_karpenter_node_in_the_fleet_loses_only_the_startup_taint_once_reported() -> None:
    """Karpenter's order: the Node appears (unregistered taint, fake MIG counts), the fleet
    joins it, Karpenter swaps its taint for the NodePool's startup taint, the controller
    creates the GpuLayout, the agent reports: the startup taint goes, the other stays."""
    api = kubeapi.InMemoryNodeApi()
    f = fleet.Fleet(api, settings=fleet.FleetSettings(times=emulated.INSTANT))

    def watch() -> None:
        f.nodes_listed(api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items)
        f.layouts_listed(api.list_layouts().items)
        f.drain()

    f.pods.listed(api.list_pods(node=None).items)
    karpenter_node(api, "n0", "h100-80gb.x2")
    watch()
    allocatable = node_of(api, "n0")["status"]["allocatable"]
    assert allocatable[R1G] == "0" and allocatable["nvidia.com/gpu"] == "0"  # zeroed
    assert allocatable["cpu"] == "96"
    # KWOK's node-initialize stage writes the Node's status from the copy it saw at creation:
    # the fake counts are back. The watch shows it; the stand-in publishes its counts again.
    stale_write(api, "n0", {R1G: "56", "nvidia.com/gpu": "8"})
    api.set_node_taints("n0", [STARTUP, OTHER])
    watch()
    watch()
    allocatable = node_of(api, "n0")["status"]["allocatable"]
    assert allocatable[R1G] == "0" and allocatable["nvidia.com/gpu"] == "0"
    assert taints_of(api, "n0") == [STARTUP, OTHER]  # no GpuLayout yet: nothing reported
    assert api.taint_removals == 0
    api.put_spec("n0", {"gpus": []})  # the controller's empty spec for a new MIG node
    watch()
    watch()
    assert taints_of(api, "n0") == [OTHER]
    member = f.member("n0")
    assert member is not None and member.startup is not None and member.startup.settled
    for _ in range(3):
        watch()
        f.tick()
        f.drain()
    assert api.taint_removals == 1


def test_a_startup_taint_that_comes_after_the_report_is_removed_too() -> None:
    """Karpenter registers the node (adding the startup taint) after the agent's first pass:
    the watch shows the taint on a ready node, and the pass that follows removes it."""
    api = kubeapi.InMemoryNodeApi()
    f = fleet.Fleet(api, settings=fleet.FleetSettings(times=emulated.INSTANT))
    f.pods.listed(api.list_pods(node=None).items)
    karpenter_node(api, "n0", "h100-80gb.x1")
    api.put_spec("n0", {"gpus": []})
    for _ in range(2):
        f.nodes_listed(api.list_nodes(selector=fleet.DEFAULT_SELECTOR).items)
        f.layouts_listed(api.list_layouts().items)
        f.drain()
    member = f.member("n0")
    assert member is not None and member.reporter.reported
    api.set_node_taints("n0", [STARTUP])
    f.node_changed(kubeobjects.WatchEvent(kubeobjects.EventType.MODIFIED, node_of(api, "n0")))
    f.drain()
    assert taints_of(api, "n0") == []


# --- the single agent --------------------------------------------------------------------------


def test_the_single_agent_removes_the_taint_its_node_watch_shows() -> None:
    """``migpilot agent --kubelet simulated``'s wiring: the static layouts' Node watch feeds
    the startup taint (one watch); the stand-in's published counts are what the Node must
    show."""
    api = kubeapi.InMemoryNodeApi()
    api.put_node("n0", {})
    api.set_node_taints("n0", [OTHER, STARTUP])
    api.put_spec("n0", {"gpus": [{"index": 0, "instances": [{"profile": "1g.10gb", "start": 0}]}]})
    source = following.GpuLayoutSource(api, node="n0")
    source.sync()
    static = statics.StaticOrDynamic(api, dynamic=source)
    static.sync()
    book = boundpods.PodBook()
    book.listed(api.list_pods(node="n0").items)
    side = assembling_kube_side(api, source, book, static)
    assert side.startup is not None and side.startup.pending
    gpus = emulated.EmulatedBackend([catalog.resolve_gpu("h100-80gb")], durable=False)
    wired = side.wire(reconciling.RunningProcesses(gpus), gpus=gpus)
    agent = agent_running.Agent(
        gpus=gpus,
        in_use=wired.in_use,
        source=side.desired_source(),
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=agent_running.AgentSettings(),
        listener=wired.listener,
        view_filter=side.view_filter(),
    )
    agent.reconcile()
    # Reported and published, but the Node as last watched does not show the count yet.
    assert wired.reporter.reported
    assert taints_of(api, "n0") == [OTHER, STARTUP]
    assert not agent.due()
    static.sync()  # the Node watch's next event: the published count
    assert agent.due()
    agent.reconcile()
    assert taints_of(api, "n0") == [OTHER]
    gpus.close()


def assembling_kube_side(
    api: kubeapi.InMemoryNodeApi,
    source: following.GpuLayoutSource,
    book: boundpods.PodBook,
    static: statics.StaticOrDynamic,
) -> Any:
    return assembling.kube_side(
        api,
        source=source,
        pods=book,
        strategy=devices.MigStrategy.MIXED,
        standin=standin.stand_in,
        statics=static,
        now=lambda: "2026-01-01T00:00:00Z",
    )


def test_without_a_device_plugin_or_a_stand_in_the_taint_stays() -> None:
    """Nothing advertises the node's resources (``--once``, ``--no-kubelet``): reported or
    not, the taint is never removed."""
    api = kubeapi.InMemoryNodeApi()
    api.put_node("n0", {})
    api.set_node_taints("n0", [STARTUP])
    api.put_spec("n0", {"gpus": []})
    source = following.GpuLayoutSource(api, node="n0")
    source.sync()
    static = statics.StaticOrDynamic(api, dynamic=source)
    static.sync()
    book = boundpods.PodBook()
    side = assembling.kube_side(
        api, source=source, pods=book, strategy=devices.MigStrategy.MIXED, statics=static
    )
    gpus = emulated.EmulatedBackend([catalog.resolve_gpu("h100-80gb")], durable=False)
    wired = side.wire(reconciling.RunningProcesses(gpus), gpus=gpus)
    wired.listener.passed(state={}, report=None, labels={}, view=devices.NodeDevices(()))
    assert side.startup is not None and not side.startup.ready()
    assert taints_of(api, "n0") == [STARTUP]
    gpus.close()


class Plugin:
    """What the startup taint asks of the device plugin."""

    def __init__(self, offered: dict[str, tuple[devices.Device, ...]], registered: set[str]):
        self.offered, self.names = offered, frozenset(registered)

    def advertised(self) -> dict[str, tuple[devices.Device, ...]]:
        return self.offered

    def registered(self) -> frozenset[str]:
        return self.names


def test_with_a_kubelet_the_counts_wait_for_every_resource_registered() -> None:
    ok, bad = devices.Health.HEALTHY, devices.Health.UNHEALTHY
    offered = {
        R1G: (devices.Device("a", 0, ok), devices.Device("b", 0, bad)),
        "nvidia.com/gpu": (),
        "nvidia.com/gpu-10gb": (devices.Device("s", 0, ok),),  # an MPS slice: not the Node's
    }
    names = set(offered)
    counts = assembling._registered_counts(Plugin(offered, names - {R1G}))  # type: ignore[arg-type]
    assert counts() is None  # the kubelet has not got R1G yet
    counts = assembling._registered_counts(Plugin(offered, names))  # type: ignore[arg-type]
    assert counts() == {R1G: 1, "nvidia.com/gpu": 0}
