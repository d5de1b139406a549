"""The agent runs the MPS daemons its sharing config asks for: started with the first pass,
restarted after a crash between passes (the sharing state label says so meanwhile), stopped
when the config no longer shares by MPS. Over the emulated GPUs and the emulated daemon, with
the real device plugin and the real sharing follower (``tests/unit/mps_agents.py``)."""

from __future__ import annotations

from pathlib import Path

from migpilot.agent.sharing import mps as agent_mps
from tests.unit.mps_agents import TS, mps_node


def test_the_agent_keeps_the_mps_daemons_of_its_sharing_config(tmp_path: Path) -> None:
    with mps_node(tmp_path) as node:
        agent, plugin, daemons, clock = node.agent, node.plugin, node.daemons, node.clock
        agent.start()
        (status,) = agent.mps_statuses()
        assert status.name == "nvidia.com-gpu"
        (spec,) = [s for s in (agent_mps.spec_of(d) for d in plugin.mps_daemons())]
        assert len(spec.devices) == 2 and spec.active_thread_percentage == 25
        memory = node.gpus.gpus()[0].memory_mib
        assert spec.pinned_mem_limit_mib == memory // 4
        assert spec.pipe_dir == tmp_path / "mps" / "nvidia.com" / "gpu" / "pipe"
        assert spec.pipe_dir.is_dir() and spec.log_dir.is_dir()
        # Between passes the daemons are checked every mps_check_s: it answers, defaults set.
        clock.sleep(1.0)
        agent.tick()
        assert node.phases() == [agent_mps.Phase.RUNNING]
        assert daemons.alive(spec) and daemons.starts == 1
        agent.reconcile()
        assert node.state() == "success"

        # It crashes: seen within a second, labelled failed at once, restarted after backoff.
        daemons.crash(spec)
        clock.sleep(1.0)
        agent.tick()
        assert node.phases() == [agent_mps.Phase.BACKOFF]
        assert node.state() == "failed"
        node.ticks(5)
        assert daemons.alive(spec) and daemons.starts == 2
        assert node.phases() == [agent_mps.Phase.RUNNING]
        assert node.state() == "success"

        # Time-slicing instead: the daemon is no longer wanted and is stopped.
        node.switch(TS)
        assert not daemons.alive(spec)
        assert not plugin.mps_daemons()
        assert node.state() == "success"
