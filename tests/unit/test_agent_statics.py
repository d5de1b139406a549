"""Static layouts in a cluster (agent/statics.py): the Node's ``nvidia.com/mig.config`` label
names a config of the mig-parted file in a ConfigMap, as mig-manager does; without the label
the node follows its GpuLayout. Driven through the real agent loop on emulated GPUs and the
in-memory API."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from migpilot import errors
from migpilot.agent import metrics, reconciling, running
from migpilot.agent.cluster import following, kubeapi, statics
from migpilot.agent.deviceplugin import devices
from migpilot.gpu import clocks, emulated
from migpilot.mig import catalog

NODE = "node-s"
H100 = catalog.resolve_gpu("h100-80gb")
REF = statics.ConfigMapRef("gpu-operator", "mig-parted", "config.yaml")
DEFAULT_CONFIG = (
    Path(__file__).resolve().parents[3] / "shared" / "reference" / "mig-parted-config-default.yaml"
)
CONFIG = """version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
  all-3g.40gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
"""


@dataclass
class Node:
    api: kubeapi.InMemoryNodeApi
    gpus: emulated.EmulatedBackend
    source: statics.StaticOrDynamic
    agent: running.Agent
    kubelet: reconciling.InUseSet

    def profiles(self, gpu: int = 0) -> list[str]:
        return sorted(d.profile for d in self.gpus.mig_devices(gpu))

    def state(self) -> str | None:
        return self.api.node_labels.get(NODE, {}).get("nvidia.com/mig.config.state")

    def ready(self) -> tuple[str, str, str]:
        layout = self.api.layout(NODE)
        assert layout is not None and layout.status is not None
        (cond,) = layout.status.conditions
        return cond.status.value, cond.reason, cond.message

    def with_layout(self, spec: dict[str, object]) -> None:
        """The GpuLayout the controller creates (empty for a static node), as the agent sees it."""
        self.api.put_spec(NODE, spec)
        self.source.dynamic.sync()


def _wait(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def node() -> Iterator[Node]:
    api = kubeapi.InMemoryNodeApi()
    api.put_node(NODE, {"kubernetes.io/hostname": NODE})
    gpus = emulated.EmulatedBackend([H100] * 2, durable=False)
    dynamic = following.GpuLayoutSource(api, node=NODE)
    source = statics.StaticOrDynamic(api, dynamic=dynamic, configmap=REF)
    kubelet = reconciling.InUseSet()
    reporter = following.KubeReporter(
        api, source=dynamic, in_use=kubelet, now=lambda: "2026-01-01T00:00:00Z", static=source
    )
    agent = running.Agent(
        gpus=gpus,
        in_use=reconciling.AnyOf([kubelet, dynamic]),
        source=source,
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=running.AgentSettings(strategy=devices.MigStrategy.MIXED),
        listener=reporter,
    )
    yield Node(api, gpus, source, agent, kubelet)
    api.close()
    gpus.close()


def test_the_label_names_the_config_and_a_change_relayouts(node: Node) -> None:
    node.api.put_configmap("gpu-operator", "mig-parted", {"config.yaml": CONFIG})
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-1g.10gb")
    node.source.sync()
    assert node.source.static_name == "all-1g.10gb"
    node.agent.reconcile()
    assert node.profiles(0) == ["1g.10gb"] * 7 and node.profiles(1) == ["1g.10gb"] * 7
    assert node.state() == "success"
    before = node.source.fingerprint()
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-3g.40gb")
    node.source.sync()
    assert node.source.fingerprint() != before
    node.agent.reconcile()
    assert node.profiles(0) == ["3g.40gb", "3g.40gb"]


def test_the_gpu_operators_default_config_works(node: Node) -> None:
    if not DEFAULT_CONFIG.is_file():
        pytest.skip("the shared reference folder is not beside the project")
    node.api.put_configmap(
        "gpu-operator", "mig-parted", {"config.yaml": DEFAULT_CONFIG.read_text()}
    )
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-balanced")
    node.source.sync()
    node.agent.reconcile()
    assert node.profiles(0) and node.state() == "success"


def test_a_kept_instance_in_use_is_never_destroyed_by_a_new_config(node: Node) -> None:
    node.api.put_configmap("gpu-operator", "mig-parted", {"config.yaml": CONFIG})
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-1g.10gb")
    node.source.sync()
    node.agent.reconcile()
    (busy, *_) = node.gpus.mig_devices(0)
    assert busy.uuid is not None
    node.kubelet.add(busy.uuid)
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-3g.40gb")
    node.source.sync()
    node.agent.reconcile()
    assert busy.uuid in {d.uuid for d in node.gpus.mig_devices(0)}
    assert node.state() in ("pending", "failed")


@pytest.mark.parametrize(
    ("data", "label", "why"),
    [
        ({"config.yaml": CONFIG}, "all-2g.20gb", "all-2g.20gb"),
        ({"config.yaml": "version: v1\nmig-configs: [oops"}, "all-1g.10gb", "ConfigMap"),
        ({"other.yaml": CONFIG}, "all-1g.10gb", "not found"),
        ({"config.yaml": "version: v1\nmig-configs: {x: [{devices: all}]}"}, "x", "ConfigMap"),
        (
            {"config.yaml": CONFIG.replace('"3g.40gb": 2', '"3g.40gb": 3')},
            "all-3g.40gb",
            "cannot be placed",
        ),
    ],
)
def test_bad_input_changes_nothing_and_says_failed(
    node: Node, data: dict[str, str], label: str, why: str
) -> None:
    # A node laid out by a good config first: the bad input must leave it as it is.
    node.api.put_configmap("gpu-operator", "mig-parted", {"config.yaml": CONFIG})
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-3g.40gb")
    node.source.sync()
    node.agent.reconcile()
    before = {g: sorted(d.uuid or "" for d in node.gpus.mig_devices(g)) for g in (0, 1)}
    assert node.profiles(0) == ["3g.40gb", "3g.40gb"] and node.state() == "success"
    node.api.put_configmap("gpu-operator", "mig-parted", data)
    node.api.set_node_label(NODE, "nvidia.com/mig.config", label)
    node.source.sync()
    node.agent.reconcile()
    assert {g: sorted(d.uuid or "" for d in node.gpus.mig_devices(g)) for g in (0, 1)} == before
    assert node.state() == "failed"
    assert node.source.problem is not None and why in node.source.problem


def test_without_the_label_the_node_follows_its_gpulayout(node: Node) -> None:
    node.api.put_configmap("gpu-operator", "mig-parted", {"config.yaml": CONFIG})
    node.source.sync()
    assert node.source.static_name is None
    node.api.put_spec(
        NODE, {"gpus": [{"index": 0, "instances": [{"profile": "4g.40gb", "start": 0}]}]}
    )
    node.source.dynamic.sync()
    node.agent.reconcile()
    assert node.profiles(0) == ["4g.40gb"]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("ns/name", statics.ConfigMapRef("ns", "name", "config.yaml")),
        ("ns/name:cfg.yaml", statics.ConfigMapRef("ns", "name", "cfg.yaml")),
    ],
)
def test_configmap_reference(text: str, want: statics.ConfigMapRef) -> None:
    assert statics.ConfigMapRef.parse(text) == want


@pytest.mark.parametrize("text", ["name", "/name", "ns/", "ns/name:"])
def test_bad_configmap_reference(text: str) -> None:
    with pytest.raises(errors.AgentConfigError, match="NAMESPACE/NAME"):
        statics.ConfigMapRef.parse(text)


def test_bad_input_says_invalid_config_in_the_gpulayouts_ready_condition(node: Node) -> None:
    node.with_layout({"gpus": []})
    node.api.put_configmap("gpu-operator", "mig-parted", {"config.yaml": CONFIG})
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-2g.20gb")
    node.source.sync()
    node.agent.reconcile()
    status, reason, message = node.ready()
    assert (status, reason) == ("False", "InvalidConfig")
    assert "all-2g.20gb" in message and "nothing is changed" in message
    assert node.profiles(0) == [] and node.state() == "failed"
    # Fixed by the admin: applied, Ready, and the status names no spec generation.
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-1g.10gb")
    node.source.sync()
    node.agent.reconcile()
    assert node.ready()[:2] == ("True", "Reconciled") and node.state() == "success"
    layout = node.api.layout(NODE)
    assert layout is not None and layout.status is not None
    assert layout.status.observed_generation is None
    assert {i.state.value for g in layout.status.gpus for i in g.instances} == {"free"}


def test_the_label_is_followed_live_and_its_removal_gives_the_node_back_to_its_gpulayout(
    node: Node,
) -> None:
    node.with_layout({"gpus": [{"index": 0, "instances": [{"profile": "4g.40gb", "start": 0}]}]})
    node.api.put_configmap("gpu-operator", "mig-parted", {"config.yaml": CONFIG})
    stop = threading.Event()
    follower = threading.Thread(target=node.source.follow, args=(stop,), daemon=True)
    follower.start()
    try:
        node.agent.reconcile()
        assert node.profiles(0) == ["4g.40gb"] and node.profiles(1) == []
        node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-3g.40gb")
        _wait(lambda: node.source.static_name == "all-3g.40gb", "the label")
        assert node.agent.due()
        node.agent.reconcile()
        assert node.profiles(0) == node.profiles(1) == ["3g.40gb", "3g.40gb"]
        # The ConfigMap is followed too: an edit of the named config re-lays the node out.
        node.api.put_configmap(
            "gpu-operator",
            "mig-parted",
            {"config.yaml": CONFIG.replace('"3g.40gb": 2', '"3g.40gb": 1')},
        )
        _wait(node.agent.due, "the ConfigMap edit")
        node.agent.reconcile()
        assert node.profiles(1) == ["3g.40gb"]
        node.api.set_node_label(NODE, "nvidia.com/mig.config", None)
        _wait(lambda: node.source.static_name is None, "the label's removal")
        node.agent.reconcile()
        assert node.profiles(0) == ["4g.40gb"]  # the GpuLayout's spec again
        assert node.profiles(1) == ["3g.40gb"]  # a GPU the spec does not list is left alone
        assert node.ready()[:2] == ("True", "Reconciled")
    finally:
        stop.set()
        node.api.close()
        follower.join(timeout=10)


def test_what_the_gpulayout_protected_is_released_once_its_status_says_so(node: Node) -> None:
    node.with_layout({"gpus": [{"index": 0, "instances": [{"profile": "3g.40gb", "start": 0}]}]})
    node.agent.reconcile()
    (busy,) = node.gpus.mig_devices(0)
    assert busy.uuid is not None
    node.kubelet.add(busy.uuid)
    node.agent.reconcile()  # the status reports it used
    node.source.dynamic.sync()
    node.agent.reconcile()  # and the GpuLayout protects it
    assert busy.uuid in node.source.in_use()
    node.api.put_configmap("gpu-operator", "mig-parted", {"config.yaml": CONFIG})
    node.api.set_node_label(NODE, "nvidia.com/mig.config", "all-1g.10gb")
    node.source.sync()
    node.agent.reconcile()
    assert busy.uuid in {d.uuid for d in node.gpus.mig_devices(0)}
    assert node.state() == "pending"
    # The pod is gone: the next status says free, and the static config then takes the GPU.
    node.kubelet.discard(busy.uuid)
    for _ in range(3):
        node.agent.reconcile()
        node.source.dynamic.sync()
    assert node.profiles(0) == ["1g.10gb"] * 7 and node.state() == "success"
