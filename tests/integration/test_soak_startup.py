"""The soak bench's wait for every agent's first status names what it waits on: an agent that
exits fails the wait at once with its log, and a timeout names each silent agent with the tail
of its log (a count alone sent a run looking for which of twelve agents never started)."""

from __future__ import annotations

import pathlib
import sys
import types
from typing import Any, cast

import pytest

from tests.kube import controlplane, system

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import bench_soak


class _Layouts:
    """GpuLayouts as the API returns them: the nodes in ``reported`` have a status."""

    def __init__(self, reported: set[str]) -> None:
        self.reported = reported

    def get(self, _kind: object, name: str) -> Any:
        status = {"gpus": []} if name in self.reported else {}
        return types.SimpleNamespace(to_dict=lambda: {"metadata": {"name": name}, "status": status})


def _agent(root: pathlib.Path, node: str, script: str) -> controlplane.Component:
    log = root / f"agent-{node}.log"
    return controlplane.launch(f"agent-{node}", [sys.executable, "-c", script], log=log, cwd=root)


def _system(agents: dict[str, controlplane.Component]) -> system.System:
    return cast(system.System, types.SimpleNamespace(agents=agents, controllers={}))


def _wait(layouts: _Layouts, agents: dict[str, controlplane.Component], timeout: float) -> None:
    client = cast(Any, layouts)
    bench_soak._await_first_statuses(client, _system(agents), timeout=timeout, poll_s=0.05)


def test_the_timeout_names_each_silent_agent_with_its_log(tmp_path: pathlib.Path) -> None:
    quiet = "import time; print('quiet line', flush=True); time.sleep(60)"
    agents = {n: _agent(tmp_path, n, quiet) for n in ("a", "b", "c")}
    try:
        with pytest.raises(controlplane.ControlPlaneError) as raised:
            _wait(_Layouts({"b"}), agents, timeout=1.0)
    finally:
        controlplane.stop_components(list(agents.values()))
    text = str(raised.value)
    assert "the first status of 2 of 3 agents: a, c" in text
    assert "last lines of agent-a" in text and "last lines of agent-c" in text
    assert "agent-b" not in text
    assert "quiet line" in text


def test_an_agent_that_exits_fails_the_wait_at_once(tmp_path: pathlib.Path) -> None:
    agents = {
        "a": _agent(tmp_path, "a", "import time; time.sleep(60)"),
        "b": _agent(tmp_path, "b", "import sys; print('dying', flush=True); sys.exit(3)"),
    }
    agents["b"].process.wait(timeout=60)
    try:
        with pytest.raises(controlplane.ControlPlaneError) as raised:
            _wait(_Layouts(set()), agents, timeout=600.0)
    finally:
        controlplane.stop_components(list(agents.values()))
    assert "agent-b exited with status 3" in str(raised.value)
    assert "dying" in str(raised.value)


def test_the_wait_ends_once_every_agent_reported(tmp_path: pathlib.Path) -> None:
    agents = {n: _agent(tmp_path, n, "import time; time.sleep(60)") for n in ("a", "b")}
    try:
        _wait(_Layouts({"a", "b"}), agents, timeout=60.0)
    finally:
        controlplane.stop_components(list(agents.values()))
