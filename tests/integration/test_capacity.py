"""Publishing new MIG devices into the Node as soon as the kubelet lists them (agent/capacity.py):
the real device plugin over gRPC, the fake kubelet's PodResources ``GetAllocatableResources``
(real gRPC on a unix socket, lagging behind ListAndWatch as the device manager may), and the
in-memory Node API."""

from __future__ import annotations

import pathlib
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping

import pytest

from migpilot.agent import metrics, reconciling, running
from migpilot.agent.cluster import capacity, following, kubeapi
from migpilot.agent.deviceplugin import devices, health, podresources, serving
from migpilot.gpu import clocks, emulated
from migpilot.kube import errors as kube_errors
from migpilot.mig import catalog
from tests.integration.kubelet_fake import FakeKubelet
from tests.integration.test_deviceplugin import GPU, R1G, R3G, START, make_node

WAIT_S = 10.0


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    root = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="mpc"))
    fake = FakeKubelet(root).start()
    yield fake
    fake.stop()
    shutil.rmtree(root, ignore_errors=True)


def _advertised(plugin: serving.DevicePlugin) -> dict[str, frozenset[str]]:
    return {
        name: frozenset(d.id for d in devs if d.health is devices.Health.HEALTHY)
        for name, devs in plugin.advertised().items()
    }


def _published(api: kubeapi.InMemoryNodeApi, node: str) -> dict[str, str]:
    return dict(api.node_resources.get(node, {}))


def _wait(what: str, check: object) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def test_counts_are_published_when_the_kubelet_lists_them_not_before(kubelet: FakeKubelet) -> None:
    api = kubeapi.InMemoryNodeApi()
    plugin = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02)
    )
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=1.0)
    kubelet.state.allocatable_delay_s = 3600.0  # the device manager has not caught up
    publisher = capacity.CapacityPublisher(
        api,
        node="n0",
        kubelet=client,
        advertised=lambda: _advertised(plugin),
        settings=capacity.CapacitySettings(poll_s=0.02, give_up_s=0.2),
    )
    try:
        plugin.start(START)
        kubelet.wait_registered(R1G, R3G)
        # The plugin advertises them, the kubelet does not list them yet: nothing published.
        assert publisher.publish_once() is False
        assert not _published(api, "n0")
        # The kubelet lists them: published (by the thread, woken by the pass).
        kubelet.state.allocatable_delay_s = 0.0
        publisher.passed(state={}, report=None, labels={}, view=START)
        _wait("the counts", lambda: _published(api, "n0"))
        # The MIG resources and nvidia.com/gpu (GPU 1 is whole here; on a node serving
        # unified requests, also the instances set aside for them).
        assert _published(api, "n0") == {R1G: "2", R3G: "1", GPU: "1"}
        assert client.allocatable()[R1G] == frozenset(_advertised(plugin)[R1G])
        # A 1g.10gb goes, a 3g.40gb comes: published again, the gone resource at its count.
        changed = make_node([[("1g.10gb", 0), ("3g.40gb", 4)], [("3g.40gb", 0)]])
        plugin.update(changed)
        publisher.passed(state={}, report=None, labels={}, view=changed)
        _wait("the new counts", lambda: _published(api, "n0") == {R1G: "1", R3G: "2", GPU: "0"})
    finally:
        publisher.close()
        client.close()
        plugin.stop()


def test_a_kubelet_without_allocatable_resources_is_left_alone(kubelet: FakeKubelet) -> None:
    api = kubeapi.InMemoryNodeApi()
    kubelet.state.allocatable_unimplemented = True
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=1.0)
    publisher = capacity.CapacityPublisher(
        api, node="n0", kubelet=client, advertised=lambda: {R1G: frozenset({"a"})}
    )
    try:
        assert publisher.publish_once() is False
        assert not _published(api, "n0")
        with pytest.raises(podresources.PodResourcesError, match="UNIMPLEMENTED"):
            client.allocatable()
    finally:
        publisher.close()
        client.close()


@pytest.mark.parametrize(
    ("kubelet_ids", "advertised", "ready"),
    [
        ({R1G: frozenset({"a", "b"})}, {R1G: frozenset({"a", "b"})}, True),
        ({R1G: frozenset({"a"})}, {R1G: frozenset({"a", "b"})}, False),
        (
            {R1G: frozenset({"a", "b"}), "example.com/fpga": frozenset({"f"})},
            {R1G: frozenset({"a", "b"})},
            True,
        ),
        ({}, {R1G: frozenset()}, True),
    ],
)
def test_caught_up(
    kubelet_ids: dict[str, frozenset[str]], advertised: dict[str, frozenset[str]], ready: bool
) -> None:
    assert capacity.caught_up(kubelet_ids, advertised) is ready


def test_the_patch_touches_nvidia_resources_only_and_zeroes_what_went() -> None:
    listed = {
        R1G: frozenset({"a"}),
        "example.com/fpga": frozenset({"f"}),
        "nvidia.com/gpu": frozenset(),
    }
    assert capacity.counts(listed) == {R1G: 1, GPU: 0}
    assert capacity.patch_for({R1G: 1}, None) == {R1G: "1"}
    assert capacity.patch_for({R1G: 1}, {R1G: 1}) is None
    assert capacity.patch_for({}, {R1G: 1, R3G: 2}) == {R1G: "0", R3G: "0"}


def test_the_agent_publishes_a_reconfiguration_as_soon_as_the_kubelet_lists_it(
    kubelet: FakeKubelet,
) -> None:
    """The whole agent: GpuLayout in, emulated GPUs reconfigured, the real plugin streaming to
    the fake kubelet, whose GetAllocatableResources lags 0.5 s behind ListAndWatch; the Node
    gets the counts once the kubelet lists them, never before, and each write equals what the
    kubelet lists at that moment."""
    kubelet.state.allocatable_delay_s = 0.5
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=1.0)

    mismatches: list[str] = []

    class Recording(kubeapi.InMemoryNodeApi):
        """Checks each write against what the kubelet lists at that moment."""

        def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
            listed = {k: str(v) for k, v in capacity.counts(client.allocatable()).items()}
            if dict(resources) != {**dict.fromkeys(resources, "0"), **listed}:
                mismatches.append(f"wrote {dict(resources)}, the kubelet lists {listed}")
            super().patch_node_resources(node, resources)

    api = Recording()
    api.put_node("n0", {"kubernetes.io/hostname": "n0"})
    api.put_spec(
        "n0",
        {"gpus": [{"index": 0, "instances": [{"profile": "1g.10gb", "start": 0},
                                              {"profile": "3g.40gb", "start": 4}]}]},
    )  # fmt: skip
    source = following.GpuLayoutSource(api, node="n0")
    source.sync()
    gpus = emulated.EmulatedBackend([catalog.resolve_gpu("h100-80gb")], durable=False)
    plugin = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02)
    )
    publisher = capacity.CapacityPublisher(
        api,
        node="n0",
        kubelet=client,
        advertised=lambda: _advertised(plugin),
        settings=capacity.CapacitySettings(poll_s=0.05, give_up_s=5.0),
    )
    agent = running.Agent(
        gpus=gpus,
        in_use=reconciling.InUseSet(),
        source=source,
        plugin=plugin,
        agent_metrics=metrics.AgentMetrics(),
        clock=clocks.SystemClock(),
        settings=running.AgentSettings(strategy=devices.MigStrategy.MIXED),
        listener=publisher,
    )
    try:
        agent.start()
        publisher.check()
        kubelet.wait_registered(R1G, R3G)
        _wait("the first counts", lambda: _published(api, "n0") == {R1G: "1", R3G: "1"})
        # A reconfiguration: the 1g.10gb gives way to a second 3g.40gb.
        api.put_spec(
            "n0", {"gpus": [{"index": 0, "instances": [{"profile": "3g.40gb", "start": 0},
                                                        {"profile": "3g.40gb", "start": 4}]}]},
        )  # fmt: skip
        source.sync()
        agent.reconcile()
        assert _published(api, "n0") == {R1G: "1", R3G: "1"}, "published before the kubelet"
        _wait("the new counts", lambda: _published(api, "n0") == {R1G: "0", R3G: "2"})
        assert not mismatches
    finally:
        agent.stop()
        publisher.close()
        client.close()
        plugin.stop()
        gpus.close()


def test_an_api_server_that_refuses_is_logged_and_retried_at_the_next_change(
    kubelet: FakeKubelet, caplog: pytest.LogCaptureFixture
) -> None:
    class Refusing(kubeapi.InMemoryNodeApi):
        refuse = True

        def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
            if self.refuse:
                raise kube_errors.KubeApiError("nodes/status is forbidden")
            super().patch_node_resources(node, resources)

    api = Refusing()
    plugin = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02)
    )
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=1.0)
    publisher = capacity.CapacityPublisher(
        api,
        node="n0",
        kubelet=client,
        advertised=lambda: _advertised(plugin),
        settings=capacity.CapacitySettings(poll_s=0.02, give_up_s=2.0),
    )
    try:
        plugin.start(START)
        kubelet.wait_registered(R1G, R3G)
        assert publisher.publish_once() is False
        assert "device capacity not published: nodes/status is forbidden" in caplog.text
        api.refuse = False
        assert publisher.publish_once() is True
        assert _published(api, "n0") == {R1G: "2", R3G: "1", GPU: "1"}
    finally:
        publisher.close()
        client.close()
        plugin.stop()


def test_a_device_made_unhealthy_between_passes_leaves_the_count(kubelet: FakeKubelet) -> None:
    """An XID error marks a device Unhealthy without a pass: the publisher notices within
    ``recheck_s`` and writes the kubelet's smaller count, once the kubelet drops it."""
    api = kubeapi.InMemoryNodeApi()
    plugin = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02)
    )
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=1.0)
    publisher = capacity.CapacityPublisher(
        api,
        node="n0",
        kubelet=client,
        advertised=lambda: _advertised(plugin),
        settings=capacity.CapacitySettings(poll_s=0.02, give_up_s=5.0, recheck_s=0.05),
    )
    try:
        plugin.start(START)
        kubelet.wait_registered(R1G, R3G)
        publisher.check()  # the agent's, once the plugin serves
        _wait("the counts", lambda: _published(api, "n0") == {R1G: "2", R3G: "1", GPU: "1"})
        kubelet.state.allocatable_delay_s = 0.3  # the kubelet takes its time to drop it
        event = health.XidEvent("GPU-0", 79, gpu_instance_id=2, compute_instance_id=0)
        assert plugin.report_xid(event) == {"MIG-0-1g.10gb-1"}
        _wait("the smaller count", lambda: _published(api, "n0") == {R1G: "1", R3G: "1", GPU: "1"})
        assert client.allocatable()[R1G] == frozenset({"MIG-0-1g.10gb-0"})
    finally:
        publisher.close()
        client.close()
        plugin.stop()
