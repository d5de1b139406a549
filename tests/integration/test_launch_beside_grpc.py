"""Components started by :func:`tests.kube.controlplane.launch` from a process that runs gRPC
servers (the soak bench runs its fake kubelet in-process) all start.

A ``fork()`` there runs gRPC's ``pthread_atfork`` handlers, which restart gRPC's poller in the
child; it aborted about one child in 250 (SIGABRT before the exec, its log one line: "Epoll1Poller
... encountered epoll_wait error: Bad file descriptor"), which left a soak run without one
agent. ``launch`` therefore never runs code in the child between its ``vfork`` and its exec.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from tests.integration.kubelet_fake import FakeKubelet
from tests.kube import controlplane

_FORKS: list[int] = []
os.register_at_fork(before=lambda: _FORKS.append(os.getpid()))

LAUNCHES = 300
"""Children started beside the gRPC servers: with the old ``fork()`` one in 250 died, so
about three of four runs of the old code failed here."""


def test_launch_runs_nothing_in_the_child_before_exec(root: pathlib.Path) -> None:
    # Python runs its at-fork hooks exactly when subprocess forks to call back into Python in
    # the child (a preexec_fn); gRPC's C handlers run on that same fork().
    before = len(_FORKS)
    child = controlplane.launch("true", ["/bin/true"], log=root / "true.log", cwd=root)
    assert child.process.wait(timeout=60) == 0
    assert len(_FORKS) == before, "launch forked the test process to run code in the child"


def test_every_child_of_a_process_serving_grpc_starts(
    root: pathlib.Path, kubelet: FakeKubelet
) -> None:
    failed = []
    for i in range(LAUNCHES):
        log = root / f"child-{i}.log"
        child = controlplane.launch("true", ["/bin/true"], log=log, cwd=root)
        code = child.process.wait(timeout=60)
        if code != 0:
            failed.append(f"child {i}: status {code}: {log.read_text(errors='replace')[:300]}")
    assert not failed, f"{len(failed)} of {LAUNCHES} children died before running:\n" + "\n".join(
        failed[:3]
    )


def test_the_command_runs_with_its_arguments_as_given(root: pathlib.Path) -> None:
    args = ["one", "two words", "'quoted'", '"$HOME"', "--flag=a;b", ""]
    script = "import json, sys; print(json.dumps(sys.argv[1:]))"
    log = root / "argv.log"
    child = controlplane.launch("argv", [sys.executable, "-c", script, *args], log=log, cwd=root)
    assert child.process.wait(timeout=60) == 0
    assert log.read_text().strip() == json.dumps(args)
