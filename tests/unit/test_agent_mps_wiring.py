"""The agent runs the MPS daemons its sharing config asks for: started with the first pass,
restarted after a crash between passes (the sharing state label says so meanwhile), stopped
when the config no longer shares by MPS. Over the emulated GPUs and the emulated daemon, with
the real device plugin and the real sharing follower."""

from __future__ import annotations

import os
from pathlib import Path

from migpilot.agent import metrics, reconciling, running, sharingconfig
from migpilot.agent import mps as agent_mps
from migpilot.agent.deviceplugin import devices, serving
from migpilot.gpu import clocks, emulated
from migpilot.gpu import mps as gpu_mps
from migpilot.mig import catalog

HEAD = "version: v1\nflags: {migStrategy: none}\n"
MPS = HEAD + "sharing: {mps: {resources: [{name: gpu, replicas: 4}]}}\n"
TS = HEAD + "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 4}]}}\n"
STATE = "migpilot.io/sharing.state"


def _touch(path: Path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def _labels(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_the_agent_keeps_the_mps_daemons_of_its_sharing_config(tmp_path: Path) -> None:
    clock = clocks.VirtualClock()
    gpus = emulated.EmulatedBackend(
        [catalog.resolve_gpu("h100-80gb")] * 2, clock=clock, durable=False, mig_enabled=False
    )
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
    daemons = gpu_mps.EmulatedMps(clock=clock)
    supervisor = agent_mps.MpsSupervisor(daemons, clock=clock)
    labels_file = tmp_path / "labels"
    agent = running.Agent(
        gpus=gpus,
        in_use=reconciling.AnyOf([running.HandedOut(plugin)]),
        source=running.KeepLayout(),
        plugin=plugin,
        agent_metrics=metrics.AgentMetrics(),
        clock=clock,
        settings=running.AgentSettings(
            strategy=devices.MigStrategy.NONE, interval_s=30.0, labels_file=labels_file
        ),
        sharing=follower,
        mps=supervisor,
    )
    try:
        agent.start()
        (status,) = agent.mps_statuses()
        assert status.name == "nvidia.com-gpu"
        (spec,) = [s for s in (agent_mps.spec_of(d) for d in plugin.mps_daemons())]
        assert len(spec.devices) == 2 and spec.active_thread_percentage == 25
        memory = gpus.gpus()[0].memory_mib
        assert spec.pinned_mem_limit_mib == memory // 4
        assert spec.pipe_dir == tmp_path / "mps" / "nvidia.com" / "gpu" / "pipe"
        assert spec.pipe_dir.is_dir() and spec.log_dir.is_dir()
        # Between passes the daemons are checked every mps_check_s: it answers, defaults set.
        clock.sleep(1.0)
        agent.tick()
        assert [s.phase for s in agent.mps_statuses()] == [agent_mps.Phase.RUNNING]
        assert daemons.alive(spec) and daemons.starts == 1
        agent.reconcile()
        assert _labels(labels_file)[STATE] == "success"

        # It crashes: seen within a second, labelled failed at once, restarted after backoff.
        daemons.crash(spec)
        clock.sleep(1.0)
        agent.tick()
        assert [s.phase for s in agent.mps_statuses()] == [agent_mps.Phase.BACKOFF]
        assert _labels(labels_file)[STATE] == "failed"
        for _ in range(5):
            clock.sleep(1.0)
            agent.tick()
        assert daemons.alive(spec) and daemons.starts == 2
        assert [s.phase for s in agent.mps_statuses()] == [agent_mps.Phase.RUNNING]
        assert _labels(labels_file)[STATE] == "success"

        # Time-slicing instead: the daemon is no longer wanted and is stopped.
        _touch(config, TS)
        agent.tick()
        assert not daemons.alive(spec)
        assert not plugin.mps_daemons()
        assert _labels(labels_file)[STATE] == "success"
    finally:
        agent.stop()
