"""An agent sharing emulated GPUs by MPS, as ``migpilot agent --device-plugin-config`` wires it:
the real device plugin and sharing follower, the MPS supervisor over the emulated daemon, a
virtual clock. Shared by the tests of the daemons' wiring and of the GPUs' compute mode."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migpilot.agent import metrics, reconciling, running
from migpilot.agent.deviceplugin import devices, serving
from migpilot.agent.sharing import mps as agent_mps
from migpilot.agent.sharing import sharingconfig
from migpilot.gpu import backend, clocks, emulated
from migpilot.gpu import mps as gpu_mps
from migpilot.mig import catalog

H100 = catalog.resolve_gpu("h100-80gb")
HEAD = "version: v1\nflags: {migStrategy: none}\n"
MPS = HEAD + "sharing: {mps: {resources: [{name: gpu, replicas: 4}]}}\n"
TS = HEAD + "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 4}]}}\n"
STATE = "migpilot.io/sharing.state"


@dataclass
class Node:
    agent: running.Agent
    gpus: emulated.EmulatedBackend
    plugin: serving.DevicePlugin
    daemons: Any
    """The daemons the supervisor drives: the emulated ones, or what ``wrap`` made of them."""
    clock: clocks.VirtualClock
    config: Path
    labels: Path

    def label(self, key: str) -> str:
        text = self.labels.read_text()
        return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)[key]

    def state(self) -> str:
        return self.label(STATE)

    def modes(self) -> list[backend.ComputeMode]:
        return [self.gpus.compute_mode(g.index) for g in self.gpus.gpus()]

    def phases(self) -> list[agent_mps.Phase]:
        return [s.phase for s in self.agent.mps_statuses()]

    def ticks(self, count: int) -> None:
        for _ in range(count):
            self.clock.sleep(1.0)
            self.agent.tick()

    def switch(self, text: str) -> None:
        """Write a new sharing config (a newer mtime, so the follower sees it) and tick."""
        self.config.write_text(text)
        st_ = os.stat(self.config)
        os.utime(self.config, ns=(st_.st_atime_ns, st_.st_mtime_ns + 1_000_000_000))
        self.agent.tick()


@contextmanager
def mps_node(
    tmp_path: Path,
    *,
    gpus: int = 2,
    wrap: Callable[[gpu_mps.EmulatedMps, emulated.EmulatedBackend], Any] = lambda d, _: d,
) -> Iterator[Node]:
    """The agent on ``gpus`` H100s with MIG off, serving :data:`MPS`; stopped on exit."""
    clock = clocks.VirtualClock()
    emu = emulated.EmulatedBackend([H100] * gpus, clock=clock, durable=False, mig_enabled=False)
    (tmp_path / "device-plugins").mkdir()
    plugin = serving.DevicePlugin(
        serving.PluginSettings(
            plugin_dir=tmp_path / "device-plugins",
            strategy=devices.MigStrategy.NONE,
            kubelet_poll_s=0.02,
            ledger_file=tmp_path / "allocations.json",
            mps_root=str(tmp_path / "mps"),
        )
    )
    config = tmp_path / "sharing.yaml"
    config.write_text(MPS)
    follower = sharingconfig.SharingFollower(
        sharingconfig.SingleFile(config), apply=plugin.set_sharing, mig_strategy="none"
    )
    daemons = wrap(gpu_mps.EmulatedMps(clock=clock), emu)
    labels = tmp_path / "labels"
    agent = running.Agent(
        gpus=emu,
        in_use=reconciling.AnyOf([running.HandedOut(plugin)]),
        source=running.KeepLayout(),
        plugin=plugin,
        agent_metrics=metrics.AgentMetrics(),
        clock=clock,
        settings=running.AgentSettings(
            strategy=devices.MigStrategy.NONE, interval_s=30.0, labels_file=labels
        ),
        sharing=follower,
        mps=agent_mps.MpsSupervisor(daemons, clock=clock),
    )
    try:
        yield Node(agent, emu, plugin, daemons, clock, config, labels)
    finally:
        agent.stop()
