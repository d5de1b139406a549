"""The MPS supervisor over the emulated daemon: start, defaults, crash and restart with backoff,
start timeouts, adoption after an agent restart, spec changes, stop; the transition table."""

from __future__ import annotations

import itertools
import json
import stat
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.agent.sharing import mps as supervising
from migpilot.gpu import clocks, mps

GPU0 = "GPU-0a"
GPU1 = "GPU-1b"
Phase = supervising.Phase
SETTINGS = supervising.SupervisorSettings(
    backoff_initial_s=1.0, backoff_max_s=8.0, start_timeout_s=30.0, stable_after_s=100.0
)


def spec(root: Path, name: str = "gpu-0", **overrides: object) -> mps.MpsDaemonSpec:
    values: dict[str, object] = {
        "name": name,
        "devices": (GPU0, GPU1),
        "pipe_dir": root / name / "pipe",
        "log_dir": root / name / "log",
        "active_thread_percentage": 50,
        "pinned_mem_limit_mib": 1024,
    }
    values.update(overrides)
    return mps.MpsDaemonSpec(**values)  # type: ignore[arg-type]


class Node:
    """One node's emulated daemons, a virtual clock and a supervisor over them."""

    def __init__(self, *, startup_s: float = 0.0) -> None:
        self.clock = clocks.VirtualClock(1000.0)
        self.host = mps.EmulatedMps(clock=self.clock, startup_s=startup_s)
        self.supervisor = self.restart_agent()

    def restart_agent(self) -> supervising.MpsSupervisor:
        self.supervisor = supervising.MpsSupervisor(self.host, clock=self.clock, settings=SETTINGS)
        return self.supervisor

    def one(self, *specs: mps.MpsDaemonSpec) -> supervising.DaemonStatus:
        (status,) = self.supervisor.reconcile(specs)
        return status


@pytest.mark.parametrize("phase", [None, *supervising.Phase])
@pytest.mark.parametrize("event", list(supervising.Event))
def test_transition_table_over_every_state(
    phase: supervising.Phase | None, event: supervising.Event
) -> None:
    if (phase, event) in supervising.TRANSITIONS:
        assert supervising.transition(phase, event) is supervising.TRANSITIONS[(phase, event)]
    else:
        with pytest.raises(ValueError, match="no transition"):
            supervising.transition(phase, event)


def test_transition_table_essentials() -> None:
    t = supervising.transition
    assert t(None, supervising.Event.ADOPTED) is Phase.STARTING  # answers before it is trusted
    assert t(Phase.RUNNING, supervising.Event.DIED) is Phase.BACKOFF
    assert t(Phase.STARTING, supervising.Event.TIMED_OUT) is Phase.BACKOFF
    assert all(t(p, supervising.Event.QUIT) is Phase.STOPPED for p in Phase)


def test_backoff_doubles_up_to_the_cap() -> None:
    assert [supervising.backoff_delay(n, SETTINGS) for n in range(6)] == [0, 1, 2, 4, 8, 8]


@given(st.integers(1, 200), st.floats(0.01, 100), st.floats(0.01, 1000))
def test_backoff_is_monotone_and_capped(failures: int, initial: float, cap: float) -> None:
    settings = supervising.SupervisorSettings(backoff_initial_s=initial, backoff_max_s=cap)
    now, after = (supervising.backoff_delay(n, settings) for n in (failures, failures + 1))
    assert 0 < now <= after <= cap


def test_start_creates_dirs_marker_and_sets_defaults(tmp_path: Path) -> None:
    node = Node()
    s = spec(tmp_path)
    status = node.one(s)
    assert status.phase is Phase.RUNNING
    assert status.pid == node.host.pid(s)
    assert (status.adopted, status.restarts, status.failures, status.last_error) == (
        False,
        0,
        0,
        None,
    )
    for path in (s.pipe_dir, s.log_dir):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755
    marker = json.loads((s.log_dir / supervising.MARKER_FILE).read_text())
    assert marker["devices"] == [GPU0, GPU1]
    assert node.host.control_log(s)[-3:] == s.default_commands()
    assert node.host.connect(s).pinned_mem_limit_mib == ((0, 1024), (1, 1024))
    assert node.one(s) == status  # nothing to do: no second start, no new defaults
    assert node.host.starts == 1
    assert supervising.sharing_state(node.supervisor.statuses()) == "success"


def test_defaults_wait_until_the_daemon_answers(tmp_path: Path) -> None:
    node = Node(startup_s=5.0)
    s = spec(tmp_path)
    assert node.one(s).phase is Phase.STARTING
    assert supervising.sharing_state(node.supervisor.statuses()) == "pending"
    assert not any(line.startswith("set_default") for line in node.host.control_log(s))
    node.clock.sleep(5.0)
    assert node.one(s).phase is Phase.RUNNING
    assert node.host.control_log(s)[-3:] == s.default_commands()


def test_a_daemon_that_never_answers_is_quit_and_retried(tmp_path: Path) -> None:
    node = Node(startup_s=1000.0)
    s = spec(tmp_path)
    node.one(s)
    node.clock.sleep(29.0)
    assert node.one(s).phase is Phase.STARTING
    node.clock.sleep(2.0)
    status = node.one(s)
    assert status.phase is Phase.BACKOFF
    assert status.failures == 1
    assert status.retry_at == node.clock.monotonic() + 1.0
    assert status.last_error is not None
    assert "no answer within 30 s of starting" in status.last_error
    assert node.host.state(s) is mps.DaemonState.STOPPED
    assert supervising.sharing_state(node.supervisor.statuses()) == "failed"


def test_crash_restart_with_backoff_then_stable(tmp_path: Path) -> None:
    node = Node()
    s = spec(tmp_path)
    first = node.one(s).pid
    waits = []
    for crash in range(1, 5):
        node.host.crash(s)
        status = node.one(s)
        assert status.phase is Phase.BACKOFF
        assert status.failures == crash
        assert status.pid is None
        assert status.last_error is not None
        assert "died" in status.last_error
        assert status.retry_at is not None
        waits.append(status.retry_at - node.clock.monotonic())
        node.clock.sleep(waits[-1] / 2)
        assert node.one(s).phase is Phase.BACKOFF  # not yet
        assert node.host.starts == crash
        node.clock.sleep(waits[-1] / 2)
        status = node.one(s)
        assert status.phase is Phase.RUNNING
        assert status.restarts == crash
        assert status.pid not in (None, first)
    assert waits == [1.0, 2.0, 4.0, 8.0]
    node.clock.sleep(SETTINGS.stable_after_s)
    status = node.one(s)
    assert (status.failures, status.last_error, status.restarts) == (0, None, 4)


def test_start_failures_back_off_then_recover(tmp_path: Path) -> None:
    node = Node()
    s = spec(tmp_path)
    node.host.fail_next_starts(3, "cannot open /dev/nvidiactl")
    status = node.one(s)
    for delay in (1.0, 2.0, 4.0):
        assert status.phase is Phase.BACKOFF
        assert status.last_error is not None
        assert status.last_error.endswith("cannot open /dev/nvidiactl")
        assert status.retry_at == node.clock.monotonic() + delay
        node.clock.sleep(delay)
        status = node.one(s)
    assert status.phase is Phase.RUNNING
    assert status.restarts == 3


def test_a_daemon_that_dies_while_starting_is_a_failure(tmp_path: Path) -> None:
    node = Node(startup_s=5.0)
    s = spec(tmp_path)
    node.one(s)
    node.host.crash(s)
    status = node.one(s)
    assert status.phase is Phase.BACKOFF
    assert status.last_error == "the daemon exited before it answered"


def test_a_restarted_agent_adopts_running_daemons(tmp_path: Path) -> None:
    node = Node()
    s = spec(tmp_path)
    pid = node.one(s).pid
    node.restart_agent()
    status = node.one(s)
    assert status.phase is Phase.RUNNING
    assert status.adopted
    assert status.pid == pid
    assert node.host.starts == 1


def test_a_daemon_started_for_other_devices_is_restarted_not_adopted(tmp_path: Path) -> None:
    node = Node()
    node.one(spec(tmp_path))
    node.restart_agent()
    narrower = spec(tmp_path, devices=(GPU0,))
    status = node.one(narrower)
    assert status.phase is Phase.RUNNING
    assert not status.adopted
    assert node.host.starts == 2
    assert node.host.running_spec(narrower) == narrower


def test_a_daemon_without_marker_is_adopted(tmp_path: Path) -> None:
    node = Node()
    s = spec(tmp_path)
    s.log_dir.mkdir(parents=True)
    node.host.start(s)  # started by hand, or by an older agent
    status = node.one(s)
    assert status.adopted
    assert node.host.starts == 1


def test_crashed_daemon_found_at_start_is_started_again(tmp_path: Path) -> None:
    node = Node()
    s = spec(tmp_path)
    node.one(s)
    node.host.crash(s)
    node.restart_agent()
    status = node.one(s)
    assert status.phase is Phase.RUNNING
    assert not status.adopted
    assert node.host.starts == 2


def test_unwanted_daemons_are_stopped(tmp_path: Path) -> None:
    node = Node()
    a, b = spec(tmp_path, "gpu-0"), spec(tmp_path, "gpu-1")
    assert [s.phase for s in node.supervisor.reconcile([a, b])] == [Phase.RUNNING] * 2
    assert [s.name for s in node.supervisor.reconcile([b])] == ["gpu-1"]
    assert node.host.state(a) is mps.DaemonState.STOPPED
    assert not (a.log_dir / supervising.MARKER_FILE).exists()
    assert node.supervisor.reconcile([]) == ()
    assert node.host.state(b) is mps.DaemonState.STOPPED
    assert supervising.sharing_state(()) == "success"


def test_new_defaults_are_sent_without_a_restart(tmp_path: Path) -> None:
    node = Node()
    node.one(spec(tmp_path))
    changed = spec(tmp_path, active_thread_percentage=20)
    status = node.one(changed)
    assert status.phase is Phase.RUNNING
    assert node.host.starts == 1
    assert node.host.control_log(changed)[-1] == "set_default_active_thread_percentage 20"


def test_new_devices_restart_the_daemon(tmp_path: Path) -> None:
    node = Node()
    before = node.one(spec(tmp_path)).pid
    changed = spec(tmp_path, devices=(GPU1,))
    status = node.one(changed)
    assert status.phase is Phase.RUNNING
    assert status.pid != before
    assert node.host.starts == 2
    assert node.host.running_spec(changed) == changed


def test_directories_that_cannot_be_made_are_a_failure(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    node = Node()
    status = node.one(spec(tmp_path / "file"))
    assert status.phase is Phase.BACKOFF
    assert status.last_error is not None
    assert status.last_error.startswith("cannot create the MPS directory")


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"name": "gpu-0", "pipe_dir": Path("/run/other")}, "two MPS daemons are named 'gpu-0'"),
        ({"name": "gpu-1"}, "'gpu-0' and 'gpu-1' share the pipe directory"),
    ],
)
def test_a_desired_list_that_cannot_be_meant(
    tmp_path: Path, second: dict[str, object], message: str
) -> None:
    first = spec(tmp_path)
    other = spec(tmp_path, **{"pipe_dir": first.pipe_dir, **second})
    with pytest.raises(mps.MpsError, match=message):
        Node().supervisor.reconcile([first, other])


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["crash", "wait", "want-a", "want-b", "want-both", "fail"]),
            st.floats(0, 20),
        ),
        max_size=25,
    )
)
def test_whatever_happens_the_wanted_daemons_end_up_running(
    tmp_path_factory: pytest.TempPathFactory, ops: list[tuple[str, float]]
) -> None:
    root = tmp_path_factory.mktemp("mps")
    node = Node()
    a, b = spec(root, "gpu-0"), spec(root, "gpu-1", devices=(GPU1,))
    wanted = {"want-a": [a], "want-b": [b], "want-both": [a, b]}
    desired = [a, b]
    for op, seconds in ops:
        if op in wanted:
            desired = wanted[op]
        elif op == "crash":
            for s in desired:
                if node.host.alive(s):
                    node.host.crash(s)
        elif op == "fail":
            node.host.fail_next_starts(1)
        node.clock.sleep(seconds)
        statuses = node.supervisor.reconcile(desired)
        assert [s.name for s in statuses] == sorted(s.name for s in desired)
        for s in (a, b):
            if s not in desired:
                assert not node.host.alive(s)
    # Each pass takes one start; every injected failure costs one more.
    for _ in itertools.repeat(None, 3 + sum(op == "fail" for op, _ in ops)):
        node.clock.sleep(SETTINGS.backoff_max_s)
        statuses = node.supervisor.reconcile(desired)
    assert all(s.phase is Phase.RUNNING for s in statuses)
    assert all(node.host.alive(s) for s in desired)


def test_check_starts_asks_and_stops(tmp_path: Path) -> None:
    node = Node(startup_s=0.5)
    s = spec(tmp_path)
    result = supervising.check(node.host, s, clock=node.clock, timeout_s=5.0, poll_s=0.1)
    assert result.pid is not None
    assert result.answered_after_s == pytest.approx(0.5)
    assert result.servers == ()
    assert result.defaults == s.default_commands()
    assert node.host.state(s) is mps.DaemonState.STOPPED
    assert node.host.control_log(s)[-1] == "quit"


def test_check_reports_a_daemon_that_never_answers(tmp_path: Path) -> None:
    node = Node(startup_s=60.0)
    s = spec(tmp_path)
    with pytest.raises(mps.MpsError, match="did not come up: no answer within 5 s"):
        supervising.check(node.host, s, clock=node.clock, timeout_s=5.0)
    assert not node.host.alive(s)


def test_check_never_touches_a_running_daemon(tmp_path: Path) -> None:
    node = Node()
    s = spec(tmp_path)
    node.one(s)
    with pytest.raises(mps.MpsError, match="already runs in .*give it another pipe directory"):
        supervising.check(node.host, s, clock=node.clock)
    assert node.host.alive(s)
