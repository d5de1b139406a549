"""One ``migpilot agent`` process on a node of the test control plane, with its log: started,
stopped, and waited on (a wait fails at once, with the log's tail, if the agent exits).

The e2e tests that drive a single agent by hand (the capacity publisher, the sharing config, the
agent alone in the cluster) build their scenes on it; scenes with many agents and a controller
use :class:`tests.kube.system.System`."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

from tests.kube.controlplane import ControlPlane

WAIT_S = 60.0


class AgentProcess:
    """``migpilot agent --node NODE --kubeconfig ... --state-file ROOT/gpus.json`` and ``args``;
    its output goes to ``ROOT/agent.log``."""

    def __init__(
        self,
        plane: ControlPlane,
        root: pathlib.Path,
        *,
        node: str,
        args: Sequence[str],
        wait_s: float = WAIT_S,
    ) -> None:
        self.plane = plane
        self.root = root
        self.log = root / "agent.log"
        self.wait_s = wait_s
        self.args = [
            sys.executable, "-m", "migpilot", "agent",
            "--node", node, "--kubeconfig", str(plane.kubeconfig),
            "--state-file", str(root / "gpus.json"), *args,
        ]  # fmt: skip
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, *extra: str) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen([*self.args, *extra], stdout=log, stderr=log)

    def stop(self) -> int:
        """SIGTERM, and its exit code."""
        assert self.process is not None
        self.process.terminate()
        code = self.process.wait(timeout=30)
        self.process = None
        return code

    def wait(self, predicate: Callable[[], object], what: str, *, poll_s: float = 0.05) -> None:
        """Until ``predicate()`` is true; fails with the log's tail on a timeout or an exit."""
        deadline = time.monotonic() + self.wait_s
        while not predicate():
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"the agent exited waiting for {what}:\n{self.log_text()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.log_text()}")
            time.sleep(poll_s)

    def log_text(self) -> str:
        """The log's last 6,000 characters."""
        return self.log.read_text(errors="replace")[-6000:]
