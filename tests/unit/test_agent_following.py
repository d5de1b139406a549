"""The agent in a cluster, in process: the in-memory Kubernetes API, emulated GPUs, the real loop.

The controller's half is written with ``InMemoryNodeApi.put_spec``; the agent follows it (one
``sync`` per step instead of the watch thread, except in the watch tests), reconciles, and
applies its status. Nothing sleeps: passes are driven with ``reconcile``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from migpilot import errors
from migpilot.agent import metrics, reconciling, running
from migpilot.agent.cluster import following, kubeapi, reporting
from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import changes, desired
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.gpu import backend, clocks, emulated
from migpilot.kwok import standin
from migpilot.mig import catalog, layouts

H100 = catalog.resolve_gpu("h100-80gb")
NODE = "node-a"
T0 = "2026-01-01T00:00:00Z"


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
    kubelet: reconciling.InUseSet
    """What the kubelet and Allocate say is in use."""
    agent: running.Agent

    def step(self) -> changes.Report:
        self.source.sync()
        return self.agent.reconcile()

    def layout(self, gpu: int = 0) -> list[str]:
        return sorted(str(d) for d in self.gpus.mig_devices(gpu))

    def uuid(self, text: str, gpu: int = 0) -> str:
        (dev,) = [d for d in self.gpus.mig_devices(gpu) if str(d) == text]
        assert dev.uuid is not None
        return dev.uuid

    def status(self) -> gl.LayoutStatus:
        got = self.api.layout(NODE)
        assert got is not None and got.status is not None
        return got.status

    def states(self, gpu: int = 0) -> dict[str, str]:
        (g,) = [g for g in self.status().gpus if g.index == gpu]
        return {f"{i.profile}@{i.start}": i.state.value for i in g.instances}

    def ready(self) -> gl.Condition:
        (c,) = self.status().conditions
        assert c.type == gl.READY
        return c


@pytest.fixture
def node() -> Iterator[Node]:
    api = kubeapi.InMemoryNodeApi()
    gpus = emulated.EmulatedBackend([H100] * 2, durable=False)
    source = following.GpuLayoutSource(api, node=NODE)
    kubelet = reconciling.InUseSet()
    reporter = following.KubeReporter(api, source=source, in_use=kubelet, now=lambda: T0)
    agent = running.Agent(
        gpus=gpus,
        in_use=reconciling.AnyOf([kubelet, source]),
        source=source,
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=running.AgentSettings(),
        listener=running.Listeners(
            [
                reporter,
                standin.SimulatedKubelet(api, node=NODE, strategy=devices.MigStrategy.MIXED),
            ]
        ),
    )
    yield Node(api, gpus, source, kubelet, agent)
    api.close()
    gpus.close()


def test_spec_is_reconciled_and_reported(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("3g.40gb", 4)]))
    report = node.step()
    assert report.converged and not report.refusals
    assert node.layout(0) == ["1g.10gb@0", "3g.40gb@4"]
    assert node.layout(1) == []  # not in the spec: left alone
    status = node.status()
    assert status.observed_generation == 1
    assert node.states(0) == {"1g.10gb@0": "free", "3g.40gb@4": "free"}
    (g0,) = [g for g in status.gpus if g.index == 0]
    assert {i.uuid for i in g0.instances} == {node.uuid("1g.10gb@0"), node.uuid("3g.40gb@4")}
    assert g0.model == "NVIDIA H100 80GB HBM3"
    assert node.ready().status is gl.ConditionStatus.TRUE
    assert node.ready().reason == "Reconciled"
    # Another pass with nothing new writes nothing.
    writes = node.api.status_writes
    node.step()
    assert node.api.status_writes == writes


def test_a_changed_spec_moves_only_what_changed(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("3g.40gb", 4)]))
    node.step()
    kept = node.uuid("3g.40gb@4")
    node.api.put_spec(NODE, spec([inst("2g.20gb", 0), inst("3g.40gb", 4)]))
    node.source.sync()
    assert node.agent.due()
    node.step()
    assert node.layout(0) == ["2g.20gb@0", "3g.40gb@4"]
    assert node.uuid("3g.40gb@4") == kept
    assert node.status().observed_generation == 2
    assert node.states(0) == {"2g.20gb@0": "free", "3g.40gb@4": "free"}


def test_reserved_and_used_states(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0, "default/p1"), inst("3g.40gb", 4)]))
    node.step()
    assert node.states(0) == {"1g.10gb@0": "reserved", "3g.40gb@4": "free"}
    node.kubelet.add(node.uuid("3g.40gb@4"))
    node.step()
    assert node.states(0) == {"1g.10gb@0": "reserved", "3g.40gb@4": "used"}
    # What was applied parses back to the same status.
    layout = node.api.layout(NODE)
    assert layout is not None
    assert wire.parse(wire.to_document(layout)).status == node.status()


def test_a_reserved_instance_the_spec_drops_is_reported_free_before_it_is_destroyed(
    node: Node,
) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0, "default/p1"), inst("3g.40gb", 4)]))
    node.step()
    reserved = node.uuid("1g.10gb@0")
    # The controller drops the reservation and the instance at once: the CRD allows an
    # instance reported reserved only to become free, so it survives this pass.
    node.api.put_spec(NODE, spec([inst("3g.40gb", 4)]))
    report = node.step()
    assert node.uuid("1g.10gb@0") == reserved
    assert node.states(0) == {"1g.10gb@0": "free", "3g.40gb@4": "free"}
    assert any("in use and not in the desired layout" in str(r) for r in report.refusals)
    assert node.ready().reason == "Pending"
    # Reported free, it goes at the next pass (the status write changed the fingerprint).
    node.source.sync()
    assert node.agent.due()
    node.step()
    assert node.layout(0) == ["3g.40gb@4"]
    assert node.ready().status is gl.ConditionStatus.TRUE


def test_an_instance_in_use_is_never_destroyed_whatever_the_spec_says(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("3g.40gb", 4)]))
    node.step()
    held = node.uuid("1g.10gb@0")
    node.kubelet.add(held)
    node.api.put_spec(NODE, spec([inst("7g.80gb", 0)]))
    for _ in range(3):
        node.step()
        assert held in {d.uuid for d in node.gpus.mig_devices(0)}
        assert node.states(0)["1g.10gb@0"] == "used"
    assert node.ready().status is gl.ConditionStatus.FALSE
    assert node.ready().reason == "Pending"
    node.kubelet.discard(held)  # its pod ended
    node.step()
    node.step()
    assert node.layout(0) == ["7g.80gb@0"]
    assert node.ready().status is gl.ConditionStatus.TRUE


def test_status_used_protects_even_when_the_in_use_sources_forget(node: Node) -> None:
    # The last status says used (a pod holds it); the spec drops it; this pass's sources do not
    # say it (e.g. a restarted agent). It is reported free first and destroyed only after.
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("3g.40gb", 4)]))
    node.step()
    uuid = node.uuid("1g.10gb@0")
    node.kubelet.add(uuid)
    node.step()
    assert node.states(0)["1g.10gb@0"] == "used"
    node.kubelet.discard(uuid)
    node.api.put_spec(NODE, spec([inst("3g.40gb", 4)]))
    node.step()
    assert node.uuid("1g.10gb@0") == uuid
    assert node.states(0)["1g.10gb@0"] == "free"


def test_no_gpulayout_keeps_the_layout_and_writes_no_status(node: Node) -> None:
    node.gpus.create_instance(0, profile="2g.20gb", start=0)
    report = node.step()
    assert report.applied == () and report.converged
    assert node.layout(0) == ["2g.20gb@0"]
    assert node.api.layout(NODE) is None
    # The Node still gets GFD's labels.
    assert node.api.node_labels[NODE]["nvidia.com/mig-2g.20gb.count"] == "1"


def test_a_spec_that_cannot_be_applied_is_reported_and_the_last_good_kept(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("3g.40gb", 4)]))
    node.step()
    before = node.layout(0)
    node.api.put_spec(NODE, {"gpus": [{"index": 5, "instances": [inst("1g.10gb", 0)]}]})
    node.step()
    assert node.layout(0) == before
    ready = node.ready()
    assert ready.status is gl.ConditionStatus.FALSE and ready.reason == "InvalidSpec"
    assert "no GPU 5" in ready.message and "last good spec is kept" in ready.message
    assert node.status().observed_generation == 1
    # A layout the model cannot hold, checked against the GPU itself.
    node.api.put_spec(NODE, spec([inst("4g.40gb", 0), inst("4g.40gb", 4)]))
    node.step()
    assert node.ready().reason == "InvalidSpec"
    assert node.layout(0) == before
    # Fixed: applied, Ready again.
    node.api.put_spec(NODE, spec([inst("7g.80gb", 0)]))
    node.step()
    assert node.layout(0) == ["7g.80gb@0"]
    assert node.ready().reason == "Reconciled"
    assert node.status().observed_generation == 4


def test_gfd_labels_follow_the_layout_and_stale_keys_are_removed(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0)]))
    node.step()
    labels = node.api.node_labels[NODE]
    assert labels["nvidia.com/mig-1g.10gb.count"] == "1"
    node.api.put_spec(NODE, spec([inst("2g.20gb", 0)]))
    node.step()
    labels = node.api.node_labels[NODE]
    assert labels["nvidia.com/mig-2g.20gb.count"] == "1"
    assert "nvidia.com/mig-1g.10gb.count" not in labels


def test_the_simulated_kubelet_publishes_resource_counts(node: Node) -> None:
    node.api.put_spec(NODE, spec([inst("1g.10gb", 0), inst("1g.10gb", 1), inst("3g.40gb", 4)]))
    node.step()
    assert node.api.node_resources[NODE] == {
        "nvidia.com/mig-1g.10gb": "2",
        "nvidia.com/mig-3g.40gb": "1",
    }
    node.api.put_spec(NODE, spec([inst("7g.80gb", 0)]))
    node.step()
    # A resource whose last device went stays at 0, as the kubelet keeps a registered one.
    assert node.api.node_resources[NODE] == {
        "nvidia.com/mig-1g.10gb": "0",
        "nvidia.com/mig-3g.40gb": "0",
        "nvidia.com/mig-7g.80gb": "1",
    }


def test_the_watch_follows_changes_and_lists_again_after_410() -> None:
    api = kubeapi.InMemoryNodeApi()
    source = following.GpuLayoutSource(api, node=NODE)
    stop = threading.Event()
    thread = threading.Thread(target=source.follow, args=(stop,), daemon=True)
    thread.start()

    def seen(generation: int) -> bool:
        layout = source.layout()
        return layout is not None and layout.generation == generation

    try:
        api.put_spec(NODE, spec([inst("1g.10gb", 0)]))
        _wait(lambda: seen(1))
        api.compact()  # the watch's version is now too old: the next change needs a re-list
        api.put_spec(NODE, spec([inst("2g.20gb", 0)]))
        _wait(lambda: seen(2))
        api.delete_layout(NODE)
        _wait(lambda: source.layout() is None and source.fingerprint() is None)
    finally:
        stop.set()
        api.close()
        thread.join(timeout=10)
    assert not thread.is_alive()


def _wait(predicate: Any, timeout: float = 10.0) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if predicate():
            return
        done.wait(0.01)
    raise AssertionError("timed out")


# --- the pure parts --------------------------------------------------------------------------


def _infos() -> list[backend.GpuInfo]:
    gpus = emulated.EmulatedBackend([H100], durable=False)
    try:
        return list(gpus.gpus())
    finally:
        gpus.close()


@pytest.mark.parametrize(
    ("gpus", "problem"),
    [
        ([{"index": 1, "instances": []}], "no GPU 1"),
        ([{"index": 0, "model": "a100-80gb", "instances": []}], "GPU 0 is"),
        ([{"index": 0, "instances": [inst("7g.80gb", 0), inst("1g.10gb", 1)]}], "valid layout"),
        ([{"index": 0, "instances": [inst("9g.90gb", 0)]}], "valid layout"),
    ],
)
def test_from_gpulayout_rejects_what_this_node_cannot_hold(
    gpus: list[dict[str, Any]], problem: str
) -> None:
    layout = wire.parse({"apiVersion": gl.API_VERSION, "kind": gl.KIND,
                       "metadata": {"name": NODE}, "spec": {"gpus": gpus}})  # fmt: skip
    with pytest.raises(errors.ConfigError, match=problem):
        desired.from_gpulayout(layout.spec, gpus=_infos())


def test_from_gpulayout_gives_exact_placements() -> None:
    spec_ = gl.LayoutSpec(
        (
            gl.GpuSpec(
                0, "h100-80gb", (gl.InstanceSpec("3g.40gb", 0), gl.InstanceSpec("1g.10gb", 6))
            ),
        )
    )
    want = layouts.Layout.of([layouts.Instance(0, "3g.40gb"), layouts.Instance(6, "1g.10gb")])
    assert desired.from_gpulayout(spec_, gpus=_infos()) == {0: changes.DesiredGpu(True, want)}


def test_protected_names_spec_reservations_and_untouchable_status() -> None:
    doc = {
        "apiVersion": gl.API_VERSION,
        "kind": gl.KIND,
        "metadata": {"name": NODE},
        "spec": {"gpus": [{"index": 0, "instances": [inst("1g.10gb", 0, "ns/p")]}]},
        "status": {
            "gpus": [
                {
                    "index": 0,
                    "model": "h100-80gb",
                    "uuid": "GPU-0",
                    "instances": [
                        {"profile": "1g.10gb", "start": 1, "uuid": "MIG-used", "state": "used"},
                        {"profile": "1g.10gb", "start": 2, "uuid": "MIG-free", "state": "free"},
                        {"profile": "1g.10gb", "start": 3, "uuid": "MIG-r", "state": "reserved"},
                    ],
                }
            ],
            "conditions": [],
        },
    }
    current = {0: [backend.MigDevice(0, 1, 0, "1g.10gb", 0, "MIG-spec")]}
    got = desired.protected(wire.parse(doc), current=current)
    assert got == {"MIG-spec", "MIG-used", "MIG-r"}


def test_the_ready_condition_keeps_its_time_while_unchanged() -> None:
    report = changes.Report(devices={}, applied=(), refusals=(), converged=True, duration_s=0)
    later = "2026-01-01T00:05:00Z"

    def status(**kw: Any) -> gl.LayoutStatus:
        return reporting.layout_status(
            state={}, in_use=frozenset(), spec=None, generation=None, report=report, **kw
        )

    first = status(now=T0)
    assert status(previous=first, now=later) == first
    changed = status(problem="bad", previous=first, now=later)
    assert changed.conditions[0].last_transition_time == later
    assert changed.conditions[0].reason == "InvalidSpec"
