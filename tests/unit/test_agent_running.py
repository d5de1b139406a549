"""The agent loop in process: emulated GPUs, the real device plugin (no kubelet), a virtual clock.

Each test builds the agent from its parts as the CLI does, drives passes with ``tick`` and
``reconcile`` (never a sleep: the clock is virtual and the file changes are seen by stamp), and
checks what the plugin advertises, what the reconciler refused, the labels file and the metrics.
"""

from __future__ import annotations

import logging
import os
import pathlib
import shutil
import tempfile
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from migpilot import errors
from migpilot.agent import metrics, reconciling, running
from migpilot.agent.deviceplugin import allocating, devices, podresources, serving
from migpilot.agent.rules import changes
from migpilot.gpu import backend, clocks, emulated
from migpilot.mig import catalog

H100 = catalog.resolve_gpu("h100-80gb")
R1G = "nvidia.com/mig-1g.10gb"
R2G = "nvidia.com/mig-2g.20gb"
R3G = "nvidia.com/mig-3g.40gb"

CONFIG = """\
version: v1
mig-configs:
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  balanced:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 1, "2g.20gb": 1, "3g.40gb": 1}
  all-disabled:
    - devices: all
      mig-enabled: false
"""


@dataclass
class Node:
    """An agent wired as ``migpilot agent`` wires it, on emulated GPUs."""

    root: pathlib.Path
    gpus: emulated.EmulatedBackend
    plugin: serving.DevicePlugin
    agent: running.Agent
    metrics: metrics.AgentMetrics
    clock: clocks.VirtualClock
    config: pathlib.Path
    labels: pathlib.Path

    def write_config(self, text: str) -> None:
        # A new inode each time, so the stamp changes even within one mtime tick.
        tmp = self.config.with_suffix(".new")
        tmp.write_text(text)
        os.replace(tmp, self.config)

    def advertised(self) -> dict[str, dict[str, str]]:
        return {
            name: {d.id: d.health.value for d in devs}
            for name, devs in self.plugin.advertised().items()
        }

    def layout(self, gpu: int) -> list[str]:
        return [str(d) for d in self.gpus.mig_devices(gpu)]

    def uuid(self, gpu: int, text: str) -> str:
        (dev,) = [d for d in self.gpus.mig_devices(gpu) if str(d) == text]
        assert dev.uuid is not None
        return dev.uuid

    def gauge(self, resource: str, health: str) -> float:
        for family in text_string_to_metric_families(self.metrics.exposition().decode()):
            for s in family.samples:
                if s.name == "migpilot_devices" and s.labels == {
                    "resource": resource,
                    "health": health,
                }:
                    return s.value
        return 0.0


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="mpu"))  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


def as_balanced(name: str) -> str:
    """The config file with config ``name`` renamed to the ``balanced`` the agent applies."""
    return CONFIG.replace("balanced:", "old:").replace(f"{name}:", "balanced:")


def make_node(
    root: pathlib.Path,
    *,
    gpus: int = 2,
    config_name: str | None = "balanced",
    extra_in_use: reconciling.InUse | None = None,
    strategy: devices.MigStrategy = devices.MigStrategy.MIXED,
    reuse: Node | None = None,
    emulator: emulated.EmulatedBackend | None = None,
) -> Node:
    """An agent on ``gpus`` emulated H100s (or on ``emulator``); with ``reuse``, a restarted
    agent on that node's GPUs, clock and files (the old agent must be stopped)."""
    config = root / "mig-parted.yaml"
    if not config.exists():  # a restart (same root, same GPUs) keeps what is there
        config.write_text(CONFIG)
    (root / "device-plugins").mkdir(exist_ok=True)
    clock = clocks.VirtualClock() if reuse is None else reuse.clock
    emu = (
        reuse.gpus
        if reuse is not None
        else emulator or emulated.EmulatedBackend([H100] * gpus, clock=clock, durable=False)
    )
    plugin = serving.DevicePlugin(
        serving.PluginSettings(
            plugin_dir=root / "device-plugins",
            strategy=strategy,
            kubelet_poll_s=0.02,
            ledger_file=root / "allocations.json",
        )
    )
    sources: list[reconciling.InUse] = [
        running.HandedOut(plugin),
        reconciling.RunningProcesses(emu),
    ]
    if extra_in_use is not None:
        sources.append(extra_in_use)
    source: running.DesiredSource = (
        running.MigPartedConfig(config, name=config_name)
        if config_name is not None
        else running.KeepLayout()
    )
    m = metrics.AgentMetrics()
    labels = root / "labels"
    agent = running.Agent(
        gpus=emu,
        in_use=reconciling.AnyOf(sources),
        source=source,
        plugin=plugin,
        agent_metrics=m,
        clock=clock,
        settings=running.AgentSettings(
            strategy=strategy, interval_s=30.0, xid_wait_s=0.02, labels_file=labels
        ),
    )
    return Node(root, emu, plugin, agent, m, clock, config, labels)


@pytest.fixture
def node(root: pathlib.Path) -> Iterator[Node]:
    n = make_node(root)
    yield n
    n.agent.stop()


def test_start_creates_the_config_and_advertises_it(node: Node) -> None:
    report = node.agent.start()
    assert report.converged and not report.refusals
    for gpu in (0, 1):
        assert node.layout(gpu) == ["2g.20gb@0", "1g.10gb@2", "3g.40gb@4"]
    advertised = node.advertised()
    assert set(advertised) == {R1G, R2G, R3G}
    assert advertised[R1G] == {
        node.uuid(0, "1g.10gb@2"): "Healthy",
        node.uuid(1, "1g.10gb@2"): "Healthy",
    }
    assert node.gauge(R3G, "Healthy") == 2
    labels = dict(line.split("=", 1) for line in node.labels.read_text().splitlines())
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/gpu.count"] == "2"
    assert labels["nvidia.com/mig-1g.10gb.count"] == "2"
    assert labels["nvidia.com/mig-3g.40gb.slices.gi"] == "3"
    assert labels["nvidia.com/mig.config.state"] == "success"
    # Idempotent: the next pass does nothing.
    assert node.agent.reconcile().applied == ()


def test_due_on_interval_and_on_file_change(node: Node) -> None:
    node.agent.start()
    assert not node.agent.due()
    assert node.agent.tick() is None
    node.clock.sleep(29.0)
    assert not node.agent.due()
    node.clock.sleep(1.0)
    assert node.agent.due()
    assert node.agent.tick() is not None
    assert not node.agent.due()
    node.write_config(CONFIG.replace('"1g.10gb": 1, ', '"1g.10gb": 2, '))
    assert node.agent.due()


def test_config_change_updates_devices_labels_and_metrics_in_place(node: Node) -> None:
    node.agent.start()
    node.write_config(as_balanced("all-1g.10gb"))
    report = node.agent.tick()
    assert report is not None and report.converged
    assert node.layout(0) == [f"1g.10gb@{s}" for s in range(7)]
    advertised = node.advertised()
    assert len(advertised[R1G]) == 14
    assert advertised[R2G] == {} and advertised[R3G] == {}  # still served, zero devices
    assert "nvidia.com/mig-1g.10gb.count=14\n" in node.labels.read_text()
    assert "mig-3g.40gb" not in node.labels.read_text()
    assert node.gauge(R1G, "Healthy") == 14
    assert node.gauge(R3G, "Healthy") == 0


def test_a_handed_out_device_is_never_destroyed(
    node: Node, caplog: pytest.LogCaptureFixture
) -> None:
    node.agent.start()
    taken = node.uuid(0, "3g.40gb@4")
    node.plugin.record_allocated([taken])  # Allocate answered; the kubelet lists nothing yet
    node.write_config(as_balanced("all-1g.10gb"))
    with caplog.at_level(logging.WARNING, logger="migpilot.agent.running"):
        report = node.agent.tick()
    assert report is not None
    assert node.uuid(0, "3g.40gb@4") == taken
    assert node.layout(0) == ["1g.10gb@0", "1g.10gb@1", "1g.10gb@2", "1g.10gb@3", "3g.40gb@4"]
    assert node.layout(1) == [f"1g.10gb@{s}" for s in range(7)]  # everything else converged
    assert {str(r.instance) for r in report.refusals} == {"1g.10gb@4", "1g.10gb@5", "1g.10gb@6"}
    refused = [r.getMessage() for r in caplog.records if taken in r.getMessage()]
    assert refused and all("in use" in m for m in refused)
    assert node.advertised()[R3G] == {taken: "Healthy"}
    assert "nvidia.com/mig.config.state=pending\n" in node.labels.read_text()
    # Refusals already reported are not logged again at the next pass.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="migpilot.agent.running"):
        node.agent.reconcile()
    assert not [r for r in caplog.records if taken in r.getMessage()]


class _AllocatesDuringDestroy(emulated.EmulatedBackend):
    """One H100 that calls ``allocate`` with the first instance the reconciler destroys, just
    before destroying it (after the reconciler's last in-use check): a kubelet's Allocate
    landing inside the destroy."""

    def __init__(self) -> None:
        super().__init__([H100], durable=False)
        self.allocate: Callable[[backend.MigDevice], None] | None = None

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        if self.allocate is not None:
            allocate, self.allocate = self.allocate, None
            (dev,) = [d for d in self.mig_devices(gpu) if d.gi_id == gi_id]
            allocate(dev)
        super().destroy_instance(gpu, gi_id)


def test_an_allocate_inside_a_destroy_is_refused(root: pathlib.Path) -> None:
    # The destroy race of the 35-minute soak, on the device plugin's path: the plugin kept
    # advertising the instance until the pass ended and Allocate checked only that list, so
    # the kubelet could be given an instance the pass destroyed.
    gpus = _AllocatesDuringDestroy()
    node = make_node(root, emulator=gpus)
    try:
        node.agent.start()
        seen: dict[str, object] = {}

        def allocate(dev: backend.MigDevice) -> None:
            assert dev.uuid is not None
            resource = f"nvidia.com/mig-{dev.profile}"
            seen["uuid"], seen["listed"] = dev.uuid, set(node.advertised()[resource])
            try:
                node.plugin.allocate_containers(resource, [[dev.uuid]])
            except allocating.AllocationError as err:
                seen["refused"] = str(err)

        gpus.allocate = allocate
        node.write_config(as_balanced("all-1g.10gb"))
        assert node.agent.tick() is not None
        victim = seen["uuid"]
        assert victim not in seen["listed"]  # no longer sent to the kubelet
        assert "being destroyed" in str(seen.get("refused"))
        assert node.layout(0) == [f"1g.10gb@{s}" for s in range(7)]
        assert victim not in node.plugin.handed_out()
        # Withheld only while the pass ran: every instance is advertised and handed out.
        listed = node.advertised()[R1G]
        assert len(listed) == 7
        node.plugin.allocate_containers(R1G, [sorted(listed)])
    finally:
        node.agent.stop()


def test_an_allocate_just_before_the_withhold_keeps_its_instance(root: pathlib.Path) -> None:
    # The other order: handed out after the pass planned the destroy, before the withhold.
    # The reconciler's in-use check after the withhold sees it in the ledger.
    node = make_node(root, gpus=1)
    try:
        node.agent.start()
        withhold = node.plugin.withhold
        taken: list[str] = []

        def allocate_then_withhold(device_ids: frozenset[str]) -> None:
            if device_ids and not taken:
                (victim,) = device_ids
                (resource,) = [r for r, devs in node.advertised().items() if victim in devs]
                node.plugin.allocate_containers(resource, [[victim]])
                taken.append(victim)
            withhold(device_ids)

        node.plugin.withhold = allocate_then_withhold  # type: ignore[method-assign]
        node.write_config(as_balanced("all-1g.10gb"))
        report = node.agent.tick()
        assert report is not None and taken
        (victim,) = taken
        assert victim in {d.uuid for d in node.gpus.mig_devices(0)}  # not destroyed
        assert [a.detail for a in report.applied if a.change.uuid == victim] == [
            "became in use; not destroyed"
        ]
        assert victim in node.plugin.handed_out()
        assert any(victim in devs for devs in node.advertised().values())  # withheld no more
    finally:
        node.agent.stop()


def test_a_handed_out_device_survives_an_agent_restart(root: pathlib.Path) -> None:
    first = make_node(root)
    first.agent.start()
    taken = first.uuid(0, "3g.40gb@4")
    first.plugin.record_allocated([taken])  # Allocate answered; the kubelet lists nothing yet
    first.agent.stop()
    second = make_node(root, reuse=first)  # a new process: only the ledger file remembers
    try:
        second.write_config(as_balanced("all-1g.10gb"))
        report = second.agent.start()
        assert second.uuid(0, "3g.40gb@4") == taken
        assert {str(r.instance) for r in report.refusals} == {
            "1g.10gb@4",
            "1g.10gb@5",
            "1g.10gb@6",
        }
        assert taken in second.plugin.handed_out()
    finally:
        second.agent.stop()


@pytest.mark.parametrize("text", ["{not json", "[" * 100_000 + "]" * 100_000])
def test_an_unreadable_ledger_stops_the_agent_from_starting(root: pathlib.Path, text: str) -> None:
    (root / "allocations.json").write_text(text)
    with pytest.raises(errors.AgentConfigError, match="the allocation ledger is not JSON"):
        make_node(root)


def test_running_processes_keep_a_device(node: Node) -> None:
    node.agent.start()
    busy = node.uuid(1, "2g.20gb@0")
    node.gpus.attach_process(busy, 4242)
    node.write_config(as_balanced("all-1g.10gb"))
    node.agent.tick()
    assert node.uuid(1, "2g.20gb@0") == busy
    assert node.layout(0) == [f"1g.10gb@{s}" for s in range(7)]


class Kubelet:
    """An in-use source that fails like an unreachable kubelet while ``down`` is set."""

    def __init__(self) -> None:
        self.down = False
        self.held: frozenset[str] = frozenset()

    def in_use(self) -> frozenset[str]:
        if self.down:
            raise podresources.PodResourcesError("kubelet PodResources List failed: UNAVAILABLE")
        return self.held


def test_kubelet_unreachable_destroys_nothing_and_says_so(
    root: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    kubelet = Kubelet()
    holder: list[backend.GpuBackend] = []
    guarded = running.FailClosed(
        kubelet,
        everything=lambda: running.every_uuid(holder[0]),
        failures=(podresources.PodResourcesError,),
        what="the kubelet's PodResources API",
    )
    node = make_node(root, extra_in_use=guarded)
    holder.append(node.gpus)
    try:
        node.agent.start()
        before = {g: node.layout(g) for g in (0, 1)}
        kubelet.down = True
        node.write_config(as_balanced("all-1g.10gb"))
        with caplog.at_level(logging.INFO, logger="migpilot.agent.running"):
            report = node.agent.tick()
        assert report is not None
        assert not report.outcomes(changes.Outcome.DONE) or all(
            a.change.kind is changes.ChangeKind.CREATE for a in report.applied
        )
        for gpu in (0, 1):
            assert set(before[gpu]) <= set(node.layout(gpu))  # nothing destroyed
        assert guarded.down
        warnings = [r.getMessage() for r in caplog.records if "cannot be asked" in r.getMessage()]
        assert len(warnings) == 1 and "nothing is destroyed" in warnings[0]
        kubelet.down = False
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="migpilot.agent.running"):
            report = node.agent.reconcile()
        assert report.converged and not report.refusals
        assert node.layout(0) == [f"1g.10gb@{s}" for s in range(7)]
        assert any("answers again" in r.getMessage() for r in caplog.records)
    finally:
        node.agent.stop()


def test_pod_resources_socket_missing_fails_at_once(root: pathlib.Path) -> None:
    client = podresources.PodResourcesClient(root / "absent.sock", timeout_s=30.0)
    source = running.PodResourcesInUse(
        podresources.KubeletInUse(client), socket_path=root / "absent.sock"
    )
    with pytest.raises(podresources.PodResourcesError, match="missing"):
        source.in_use()
    client.close()


def test_xid_event_marks_one_device_unhealthy(node: Node) -> None:
    node.agent.start()
    victim = next(d for d in node.gpus.mig_devices(0) if d.profile == "1g.10gb")
    node.gpus.emit_xid(0, 13, gi_id=victim.gi_id, ci_id=0)  # ignored application error
    assert node.agent.pump_xid(0.0) == frozenset()
    node.gpus.emit_xid(0, 79, gi_id=victim.gi_id, ci_id=0)
    assert node.agent.pump_xid(0.0) == {victim.uuid}
    assert node.advertised()[R1G][str(victim.uuid)] == "Unhealthy"
    assert set(node.advertised()[R2G].values()) == {"Healthy"}  # siblings untouched
    assert node.gauge(R1G, "Unhealthy") == 1
    assert node.gauge(R1G, "Healthy") == 1
    assert node.agent.pump_xid(0.0) == frozenset()  # no event waiting


def test_keep_layout_only_advertises(root: pathlib.Path) -> None:
    node = make_node(root, config_name=None)
    node.gpus.create_instance(0, profile="7g.80gb", start=0)
    half = node.gpus.create_gpu_instance(1, profile="3g.40gb", start=4)  # no compute instance
    try:
        report = node.agent.start()
        assert report.applied == ()
        assert set(node.advertised()) == {"nvidia.com/mig-7g.80gb"}
        assert "mig.config.state" not in node.labels.read_text()  # nothing asked for
        assert [d.gi_id for d in node.gpus.mig_devices(1)] == [half]  # left as it is
    finally:
        node.agent.stop()


@pytest.mark.parametrize(
    "bad",
    [
        "version: v1\nmig-configs: [",
        "version: v2\nmig-configs: {}\n",
        CONFIG.replace("balanced:", "renamed:"),
        CONFIG.replace('"3g.40gb": 1', '"3g.40gb": 3'),
        None,
    ],
    ids=["malformed", "version", "name-gone", "unplaceable", "file-removed"],
)
def test_bad_config_at_runtime_changes_nothing(
    node: Node, bad: str | None, caplog: pytest.LogCaptureFixture
) -> None:
    node.agent.start()
    before = {g: node.layout(g) for g in (0, 1)}
    if bad is None:
        node.config.unlink()
    else:
        node.write_config(bad)
    with caplog.at_level(logging.ERROR, logger="migpilot.agent.running"):
        report = node.agent.tick()
    assert report is not None and report.applied == ()
    assert {g: node.layout(g) for g in (0, 1)} == before
    (record,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert record.getMessage().startswith("desired layout unavailable, changing nothing: ")
    assert "\n" not in record.getMessage()
    assert "nvidia.com/mig.config.state=failed\n" in node.labels.read_text()


def test_mig_mode_change_is_refused_not_forced(node: Node) -> None:
    node.agent.start()
    node.write_config(as_balanced("all-disabled"))
    report = node.agent.tick()
    assert report is not None and report.applied == ()
    assert all("needs a GPU reset" in r.reason for r in report.refusals)
    assert len(node.advertised()[R1G]) == 2
    assert "nvidia.com/mig.config.state=failed\n" in node.labels.read_text()  # waiting won't do


def test_single_strategy_layout_it_cannot_advertise_keeps_the_old_list(
    root: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = make_node(root, config_name="all-1g.10gb", strategy=devices.MigStrategy.SINGLE)
    try:
        node.agent.start()
        assert len(node.advertised()["nvidia.com/gpu"]) == 14
        node.write_config(
            CONFIG.replace("all-1g.10gb:", "old:").replace("balanced:", "all-1g.10gb:")
        )
        with caplog.at_level(logging.ERROR, logger="migpilot.agent.running"):
            node.agent.tick()
        assert len(node.advertised()["nvidia.com/gpu"]) == 14
        assert any("more than one MIG device type" in r.getMessage() for r in caplog.records)
    finally:
        node.agent.stop()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("nvidia.com/mig.config=all-1g.10gb\n", {"nvidia.com/mig.config": "all-1g.10gb"}),
        (
            'nvidia.com/mig.config="balanced"\nzone="a"\n',
            {"nvidia.com/mig.config": "balanced", "zone": "a"},
        ),
        ("# comment\n\n  a = b  \n", {"a": "b"}),
        ("a=\n", {"a": ""}),
    ],
)
def test_parse_labels(text: str, expected: dict[str, str]) -> None:
    assert running.parse_labels(text, source="f") == expected


@pytest.mark.parametrize("text", ["just-a-key\n", "=value\n"])
def test_parse_labels_rejects_lines_without_a_key(text: str) -> None:
    with pytest.raises(errors.AgentConfigError, match="f: line 1 is not key=value"):
        running.parse_labels(text, source="f")


def test_config_name_from_node_labels_file(root: pathlib.Path) -> None:
    config = root / "c.yaml"
    config.write_text(CONFIG)
    labels = root / "node-labels"
    labels.write_text("kubernetes.io/hostname=n1\n")
    source = running.MigPartedConfig(config, labels_path=labels)
    emu = emulated.EmulatedBackend([H100])
    kw = {"gpus": emu.gpus(), "current": {}, "in_use": frozenset[str]()}
    assert source.desired(**kw) == {}  # type: ignore[arg-type]
    stamp = source.fingerprint()
    labels.write_text('nvidia.com/mig.config="all-1g.10gb"\n')
    assert source.fingerprint() != stamp
    (want,) = source.desired(**kw).values()  # type: ignore[arg-type]
    assert len(want.layout.instances) == 7
    with pytest.raises(errors.AgentConfigError, match="exactly one"):
        running.MigPartedConfig(config)


def test_metrics_server_serves_the_agents_registry(node: Node) -> None:
    node.agent.start()
    server = running.MetricsServer(node.metrics, port=0, address="127.0.0.1")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as r:
            body = r.read().decode()
    finally:
        server.close()
    names = {f.name for f in text_string_to_metric_families(body)}
    assert {
        "migpilot_reconfiguration_duration_seconds",
        "migpilot_reconcile_actions",
        "migpilot_devices",
    } <= names
    assert 'migpilot_devices{health="Healthy",resource="nvidia.com/mig-1g.10gb"} 2.0' in body


def test_the_agents_probes_say_ready_after_the_first_pass_and_alive_while_it_loops(
    node: Node,
) -> None:
    assert node.agent.not_ready() == "the first pass has not finished"
    server = running.MetricsServer(
        node.metrics,
        port=0,
        address="127.0.0.1",
        live=node.agent.heartbeat.check,
        ready=node.agent.not_ready,
    )
    try:
        url = f"http://127.0.0.1:{server.port}"
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/readyz", timeout=5)
        err.value.close()
        assert err.value.code == 503
        node.agent.start()
        with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
            assert r.status == 200
        assert node.agent.heartbeat.check() is None
        node.clock.sleep(node.agent.settings.stall_s + 1)  # the loop never went round
        assert "has not gone round" in (node.agent.heartbeat.check() or "")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"{url}/healthz", timeout=5)
        err.value.close()
        assert err.value.code == 503
        stop = threading.Event()
        loop = threading.Thread(target=node.agent.run, args=(stop,))
        loop.start()  # the loop goes round again: alive
        try:
            for _ in range(100):
                if node.agent.heartbeat.check() is None:
                    break
                stop.wait(0.05)
            assert node.agent.heartbeat.check() is None
        finally:
            stop.set()
            loop.join()
    finally:
        server.close()
