"""ProcessMps against a real (fake) ``nvidia-cuda-mps-control`` executable on PATH: the daemon
is a real process, found through its pid file and control socket, driven by commands on stdin."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from migpilot.agent.sharing import mps as supervising
from migpilot.gpu import clocks, mps
from tests.integration import mps_fake

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
GPU1 = "GPU-11111111-1111-1111-1111-111111111111"


@pytest.fixture
def bin_dir(tmp_path: Path) -> Path:
    mps_fake.install(tmp_path / "bin")
    return tmp_path / "bin"


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[mps.MpsDaemonSpec]:
    pipe, log = tmp_path / "pipe", tmp_path / "log"
    pipe.mkdir()
    log.mkdir()
    yield mps.MpsDaemonSpec(
        name="gpu-0",
        devices=(GPU0, GPU1),
        pipe_dir=pipe,
        log_dir=log,
        active_thread_percentage=25,
        pinned_mem_limit_mib=10240,
    )
    mps_fake.kill_daemons([pipe])


def control(bin_dir: Path, **knobs: str) -> mps.ProcessMps:
    environ = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", **knobs}
    environ["CUDA_VISIBLE_DEVICES"] = "GPU-inherited"  # replaced by the spec's devices
    return mps.ProcessMps(environ=environ, timeout_s=5.0)


def wait_for(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``condition`` until it holds or ``timeout_s`` passed (a signal lands later)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def log_lines(spec: mps.MpsDaemonSpec) -> list[str]:
    return (spec.log_dir / mps.CONTROL_LOG).read_text().splitlines()


def test_start_answer_set_defaults_and_stop(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    ctl = control(bin_dir)
    assert not ctl.alive(spec)
    pid = ctl.start(spec)
    assert ctl.alive(spec)
    assert ctl.pid(spec) == pid
    assert (spec.pipe_dir / mps.CONTROL_SOCKET).is_socket()
    assert (spec.pipe_dir / mps.PID_FILE).read_text().strip() == str(pid)
    assert log_lines(spec)[0] == f"startup pid={pid} CUDA_VISIBLE_DEVICES={GPU0},{GPU1}"
    assert ctl.server_list(spec) == ()

    ctl.set_defaults(spec)
    assert log_lines(spec)[-3:] == [
        "command set_default_device_pinned_mem_limit 0 10240M",
        "command set_default_device_pinned_mem_limit 1 10240M",
        "command set_default_active_thread_percentage 25",
    ]

    ctl.stop(spec)
    assert not ctl.alive(spec)
    assert ctl.pid(spec) is None
    assert not (spec.pipe_dir / mps.PID_FILE).exists()
    assert log_lines(spec)[-2:] == ["command quit", "quit"]
    ctl.stop(spec)  # a second stop has nothing to do


def test_server_list_reads_pids(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    ctl = control(bin_dir)
    pid = ctl.start(spec)
    env = {**os.environ, **spec.env(), "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(
        ["nvidia-cuda-mps-control"],
        input="start_server -uid 0\nstart_server -uid 1000\n",
        text=True,
        env=env,
        check=True,
    )
    assert ctl.server_list(spec) == (pid + 1, pid + 2)


def test_a_second_daemon_in_one_pipe_dir_is_refused(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    ctl = control(bin_dir)
    pid = ctl.start(spec)
    with pytest.raises(mps.MpsError, match=rf"already runs in .* \(pid {pid}\)"):
        ctl.start(spec)


def test_missing_binary_is_named(tmp_path: Path, spec: mps.MpsDaemonSpec) -> None:
    ctl = mps.ProcessMps(environ={"PATH": str(tmp_path)})
    with pytest.raises(mps.MpsError, match=r"^nvidia-cuda-mps-control is not installed"):
        ctl.start(spec)
    absent = mps.ProcessMps(binary=str(tmp_path / "nowhere" / "mps-control"))
    with pytest.raises(mps.MpsError, match=r"nowhere/mps-control is not installed"):
        absent.executable()


def test_a_failing_start_reports_the_daemon_message(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    ctl = control(bin_dir, FAKE_MPS_FAIL_START="cannot open /dev/nvidiactl")
    with pytest.raises(mps.MpsError, match=r"-d failed \(exit 1\): cannot open /dev/nvidiactl$"):
        ctl.start(spec)


def test_start_waits_for_the_pid_file(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    ctl = control(bin_dir, FAKE_MPS_STARTUP_S="0.3")
    pid = ctl.start(spec)
    assert ctl.pid(spec) == pid
    assert ctl.server_list(spec) == ()


def test_start_gives_up_when_no_pid_file_comes(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    environ = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_MPS_STARTUP_S": "3"}
    environ["FAKE_MPS_STARTUP_S"] = "1"
    ctl = mps.ProcessMps(environ=environ, timeout_s=0.3)
    with pytest.raises(
        mps.MpsError, match=r"wrote no live pid .* within 0.3 s; see .*control\.log"
    ):
        ctl.start(spec)
    # The late daemon comes up after all; stop it rather than leave it behind.
    assert wait_for(lambda: ctl.pid(spec) is not None)
    control(bin_dir).stop(spec)


def test_a_crashed_daemon_is_dead_and_can_be_started_again(
    bin_dir: Path, spec: mps.MpsDaemonSpec
) -> None:
    ctl = control(bin_dir)
    pid = ctl.start(spec)
    os.kill(pid, signal.SIGKILL)  # the fake daemon this test started
    assert wait_for(lambda: not ctl.alive(spec))
    assert (spec.pipe_dir / mps.PID_FILE).exists()  # stale, as a crash leaves it
    with pytest.raises(mps.MpsError, match="no MPS control daemon answers|failed"):
        ctl.server_list(spec)
    again = ctl.start(spec)
    assert again != pid
    assert ctl.server_list(spec) == ()


def test_a_daemon_without_its_pid_file_is_found_by_its_socket(
    bin_dir: Path, spec: mps.MpsDaemonSpec
) -> None:
    ctl = control(bin_dir)
    pid = ctl.start(spec)
    (spec.pipe_dir / mps.PID_FILE).unlink()
    assert ctl.pid(spec) is None
    assert ctl.alive(spec)
    os.kill(pid, signal.SIGKILL)  # no pid file left for the fixture to find it by


def test_no_daemon_no_answer(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    ctl = control(bin_dir)
    with pytest.raises(mps.MpsError, match=r"no MPS control daemon answers in .*\(no control"):
        ctl.server_list(spec)


def test_a_daemon_that_ignores_quit_is_reported(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    environ = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_MPS_IGNORE_QUIT": "1"}
    ctl = mps.ProcessMps(environ=environ, timeout_s=0.5)
    pid = ctl.start(spec)
    with pytest.raises(mps.MpsError, match=rf"daemon {pid} in .* did not quit within 0.5 s"):
        ctl.stop(spec)
    assert ctl.alive(spec)


def test_supervisor_over_the_real_process(bin_dir: Path, spec: mps.MpsDaemonSpec) -> None:
    """Start, crash (the daemon killed), restart after backoff, adoption by a new supervisor,
    stop: the supervisor's lifecycle with real processes."""
    clock = clocks.VirtualClock()
    settings = supervising.SupervisorSettings(backoff_initial_s=2.0)
    ctl = control(bin_dir)
    supervisor = supervising.MpsSupervisor(ctl, clock=clock, settings=settings)
    spec = replace(spec, pipe_dir=spec.pipe_dir / "made", log_dir=spec.log_dir / "made")
    try:
        (status,) = supervisor.reconcile([spec])
        assert status.phase is supervising.Phase.RUNNING
        assert status.pid == ctl.pid(spec)
        assert log_lines(spec)[-3:] == [f"command {c}" for c in spec.default_commands()]

        assert status.pid is not None
        os.kill(status.pid, signal.SIGKILL)  # the fake daemon this test started
        assert wait_for(lambda: not ctl.alive(spec))
        (status,) = supervisor.reconcile([spec])
        assert status.phase is supervising.Phase.BACKOFF
        clock.sleep(2.0)
        (status,) = supervisor.reconcile([spec])
        assert status.phase is supervising.Phase.RUNNING
        assert status.restarts == 1

        adopter = supervising.MpsSupervisor(ctl, clock=clock, settings=settings)
        (adopted,) = adopter.reconcile([spec])
        assert adopted.adopted
        assert adopted.pid == status.pid

        assert adopter.reconcile([]) == ()
        assert not ctl.alive(spec)
    finally:
        mps_fake.kill_daemons([spec.pipe_dir])
