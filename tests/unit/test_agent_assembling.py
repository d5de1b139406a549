"""The agent assembled from one settings object (agent/assembling.py): the settings the CLI
fills, :func:`assembling.run` without the CLI, and the Kubernetes side the single agent and the
fleet share, over the in-memory API and emulated GPUs."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

from migpilot import errors
from migpilot.agent import assembling, reconciling
from migpilot.agent import metrics as agent_metrics
from migpilot.agent import running as agent_running
from migpilot.agent.cluster import boundpods, following, kubeapi
from migpilot.agent.deviceplugin import devices
from migpilot.cli import agent_cmd
from migpilot.cli import main as cli
from migpilot.gpu import clocks, emulated
from migpilot.kwok import standin
from migpilot.mig import catalog

CONFIG = """\
version: v1
mig-configs:
  two:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 2}
"""
SETTINGS = [
    assembling.Settings,
    assembling.BackendSettings,
    assembling.LayoutSettings,
    assembling.SharingSettings,
    assembling.KubeletSettings,
    assembling.ClusterSettings,
    assembling.MetricsSettings,
]


@pytest.mark.parametrize("kind", SETTINGS, ids=lambda k: k.__name__)
def test_every_setting_is_frozen_and_has_a_default(kind: type) -> None:
    made = kind()
    field = dataclasses.fields(made)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, field.name, getattr(made, field.name))


def test_the_cli_fills_the_settings_and_keeps_its_defaults() -> None:
    args = cli.build_parser().parse_args(["agent"])
    settings = agent_cmd.settings_from(args)
    assert settings == assembling.Settings(log_format="text")
    args = cli.build_parser().parse_args(
        ["agent", "--kubelet", "simulated", "--node", "n0", "--no-publish-capacity"]
    )
    got = agent_cmd.settings_from(args)
    assert got.kubelet.mode is assembling.KubeletMode.SIMULATED
    assert got.kubelet.publish_capacity is False and got.cluster.node == "n0"
    args = cli.build_parser().parse_args(["agent", "--kubelet", "/k", "--no-kubelet"])
    got = agent_cmd.settings_from(args)
    assert (got.kubelet.mode, got.kubelet.dir) == (assembling.KubeletMode.NONE, Path("/k"))


def test_run_once_from_settings_alone(tmp_path: Path) -> None:
    config = tmp_path / "mig-parted.yaml"
    config.write_text(CONFIG)
    settings = assembling.Settings(
        backend=assembling.BackendSettings(spec="emulated:h100-80gb:x1"),
        layouts=assembling.LayoutSettings(config=config, config_name="two"),
        kubelet=assembling.KubeletSettings(mode=assembling.KubeletMode.NONE),
        once=True,
    )
    out = io.StringIO()
    assert assembling.run(settings, out) == 0
    assert out.getvalue().endswith("GPU 0: 1g.10gb@4 1g.10gb@5\n")


def test_a_simulated_kubelet_needs_a_node_then_the_stand_ins_factory() -> None:
    settings = assembling.Settings(
        backend=assembling.BackendSettings(spec="emulated:h100-80gb:x1"),
        kubelet=assembling.KubeletSettings(mode=assembling.KubeletMode.SIMULATED),
        once=True,
    )
    with pytest.raises(errors.AgentConfigError, match="--kubelet simulated needs --node NAME"):
        assembling.run(settings, io.StringIO(), standin=standin.stand_in)
    on_node = dataclasses.replace(settings, cluster=assembling.ClusterSettings(node="n0"))
    with pytest.raises(ValueError, match="stand-in kubelet's factory"):
        assembling.run(on_node, io.StringIO())


def test_the_kube_side_wires_the_stand_in_the_reporter_and_the_counters() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.put_node("n0", {})
    api.put_spec("n0", {"gpus": [{"index": 0, "instances": [{"profile": "1g.10gb", "start": 0}]}]})
    source = following.GpuLayoutSource(api, node="n0")
    source.sync()
    book = boundpods.PodBook()
    book.listed(api.list_pods(node="n0").items)
    side = assembling.kube_side(
        api,
        source=source,
        pods=book,
        strategy=devices.MigStrategy.MIXED,
        standin=standin.stand_in,
        now=lambda: "2026-01-01T00:00:00Z",
    )
    assert isinstance(side.kubelet, standin.SimulatedKubelet)
    gpus = emulated.EmulatedBackend([catalog.resolve_gpu("h100-80gb")], durable=False)
    wired = side.wire(reconciling.RunningProcesses(gpus), gpus=gpus)
    assert wired.counters is not None
    agent = agent_running.Agent(
        gpus=gpus,
        in_use=wired.in_use,
        source=side.desired_source(),
        plugin=None,
        agent_metrics=agent_metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=agent_running.AgentSettings(),
        listener=wired.listener,
        view_filter=side.view_filter(),
    )
    report = agent.reconcile()
    assert report.converged
    layout = api.layout("n0")
    assert layout is not None and layout.status is not None
    resources = api.node_resources["n0"]
    assert resources["nvidia.com/mig-1g.10gb"] == "1"  # the stand-in published it
    assert "nvidia.com/gpucores" in resources  # the unified counters too
    without = assembling.kube_side(
        api, source=source, pods=book, strategy=devices.MigStrategy.MIXED, counters=False
    )
    assert without.kubelet is None
    assert without.wire(reconciling.RunningProcesses(gpus), gpus=gpus).counters is None
    gpus.close()
