"""The MPS daemon spec (validation, environment, default commands), the pinned-memory format,
and the emulated daemon's lifecycle, servers and clients."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.gpu import clocks, mps

GPU0 = "GPU-0a"
GPU1 = "GPU-1b"


def spec(**overrides: object) -> mps.MpsDaemonSpec:
    values: dict[str, object] = {
        "name": "gpu-0",
        "devices": (GPU0, GPU1),
        "pipe_dir": Path("/run/mps/gpu-0/pipe"),
        "log_dir": Path("/run/mps/gpu-0/log"),
        "active_thread_percentage": 50,
        "pinned_mem_limit_mib": 40960,
    }
    values.update(overrides)
    return mps.MpsDaemonSpec(**values)  # type: ignore[arg-type]


def test_env_and_default_commands() -> None:
    s = spec()
    assert s.env() == {
        "CUDA_MPS_PIPE_DIRECTORY": "/run/mps/gpu-0/pipe",
        "CUDA_MPS_LOG_DIRECTORY": "/run/mps/gpu-0/log",
        "CUDA_VISIBLE_DEVICES": f"{GPU0},{GPU1}",
    }
    assert s.default_commands() == (
        "set_default_device_pinned_mem_limit 0 40960M",
        "set_default_device_pinned_mem_limit 1 40960M",
        "set_default_active_thread_percentage 50",
    )
    bare = spec(devices=(), active_thread_percentage=None, pinned_mem_limit_mib=None)
    assert "CUDA_VISIBLE_DEVICES" not in bare.env()
    assert bare.default_commands() == ()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"name": ""}, "name '' is not a name"),
        ({"name": "gpu/0"}, "name 'gpu/0' is not a name"),
        ({"devices": ("GPU-a,GPU-b",)}, "device 'GPU-a,GPU-b' is not a device UUID"),
        ({"devices": ("",)}, "device '' is not a device UUID"),
        ({"devices": (GPU0, GPU0)}, "a device is named twice"),
        ({"pipe_dir": Path("pipe")}, "the pipe directory 'pipe' is not absolute"),
        ({"log_dir": Path("log")}, "the log directory 'log' is not absolute"),
        ({"pipe_dir": Path("/" + "p" * 120)}, "too long for a unix socket"),
        ({"active_thread_percentage": 0}, "active thread percentage 0 is not within 1-100"),
        ({"active_thread_percentage": 101}, "active thread percentage 101 is not within 1-100"),
        ({"pinned_mem_limit_mib": 0}, "pinned device memory limit 0 MiB is not positive"),
        ({"devices": ()}, "a pinned device memory limit needs the devices named"),
    ],
)
def test_bad_specs_are_refused_with_one_line(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(mps.MpsError, match=message) as caught:
        spec(**overrides)
    assert "\n" not in str(caught.value)


def test_same_process_ignores_only_the_defaults() -> None:
    assert spec().same_process(spec(active_thread_percentage=10, pinned_mem_limit_mib=1))
    assert not spec().same_process(spec(devices=(GPU0,)))
    assert not spec().same_process(spec(log_dir=Path("/elsewhere")))


@pytest.mark.parametrize(
    ("text", "mib"),
    [("512M", 512), ("10G", 10240), ("2048MB", 2048), ("1T", 1048576), ("2048K", 2), ("3g", 3072)],
)
def test_memory_values(text: str, mib: int) -> None:
    assert mps.parse_mem_value_mib(text) == mib


@pytest.mark.parametrize("text", ["512", "ten G", "5P", "-1G", ""])
def test_bad_memory_values(text: str) -> None:
    with pytest.raises(mps.MpsError, match="is not a number with a unit"):
        mps.parse_mem_value_mib(text)


@given(st.dictionaries(st.integers(0, 15), st.integers(1, 1 << 22), min_size=1))
def test_pinned_limit_round_trips(limits: dict[int, int]) -> None:
    assert mps.parse_pinned_mem_limit(mps.format_pinned_mem_limit(limits)) == limits


def test_pinned_limit_parse_errors() -> None:
    assert mps.parse_pinned_mem_limit("0=10G, 1=512M") == {0: 10240, 1: 512}
    with pytest.raises(mps.MpsError, match="'10G' is not DEVICE=VALUE"):
        mps.parse_pinned_mem_limit("10G")


# -- the emulated daemon -----------------------------------------------------------------------


def test_lifecycle_starting_running_stopped() -> None:
    clock = clocks.VirtualClock()
    host = mps.EmulatedMps(clock=clock, startup_s=2.0)
    s = spec()
    assert host.state(s) is None
    assert not host.alive(s)
    pid = host.start(s)
    assert host.state(s) is mps.DaemonState.STARTING
    assert host.alive(s)
    assert host.pid(s) == pid
    with pytest.raises(mps.MpsError, match="does not answer yet"):
        host.server_list(s)
    clock.sleep(2.0)
    assert host.state(s) is mps.DaemonState.RUNNING
    assert host.server_list(s) == ()
    host.stop(s)
    assert host.state(s) is mps.DaemonState.STOPPED
    assert host.pid(s) is None
    host.stop(s)  # nothing runs: nothing to do
    assert host.control_log(s)[-2:] == ("get_server_list", "quit")


def test_one_daemon_per_pipe_dir() -> None:
    host = mps.EmulatedMps()
    s = spec()
    pid = host.start(s)
    with pytest.raises(mps.MpsError, match=rf"already runs in '/run/mps/gpu-0/pipe' \(pid {pid}\)"):
        host.start(spec(name="other"))
    host.start(spec(name="gpu-1", pipe_dir=Path("/run/mps/gpu-1/pipe")))
    assert host.starts == 2


def test_clients_get_their_env_limits_or_the_server_defaults() -> None:
    host = mps.EmulatedMps()
    s = spec()
    host.start(s)
    host.set_defaults(s)
    default = host.connect(s)
    assert default.pinned_mem_limit_mib == ((0, 40960), (1, 40960))
    assert default.active_thread_percentage == 50
    own = host.connect(
        s,
        env={
            "CUDA_MPS_PIPE_DIRECTORY": str(s.pipe_dir),
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10G",
            "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "20",
        },
    )
    assert own.pinned_mem_limit_mib == ((0, 10240),)
    assert own.active_thread_percentage == 20
    assert own.server_pid == default.server_pid
    assert host.server_list(s) == (default.server_pid,)
    assert host.clients(s) == (default, own)
    host.disconnect(s, default.pid)
    assert host.clients(s) == (own,)
    with pytest.raises(mps.MpsError, match=f"no MPS client {default.pid}"):
        host.disconnect(s, default.pid)


def test_defaults_affect_only_the_next_server() -> None:
    host = mps.EmulatedMps()
    s = spec(active_thread_percentage=None, pinned_mem_limit_mib=None)
    host.start(s)
    first = host.connect(s)
    assert first.active_thread_percentage == 100
    assert first.pinned_mem_limit_mib == ()
    host.set_defaults(spec())
    assert host.connect(s).active_thread_percentage == 100  # the same server, its old defaults
    host.disconnect(s, first.pid)
    for client in host.clients(s):
        host.disconnect(s, client.pid)
    fresh = host.connect(s, uid=1000)  # another user: a new server, spawned with the new ones
    assert fresh.server_pid != first.server_pid
    assert fresh.active_thread_percentage == 50


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"CUDA_MPS_PIPE_DIRECTORY": "/tmp/nvidia-mps"}, "is not this daemon's"),
        ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "2=1G"}, "names device index 2 but the daemon"),
        ({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=lots"}, "'lots' is not a number"),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "0"}, "=0 is not within 1-100"),
        ({"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "half"}, "'half' is not a whole percentage"),
    ],
)
def test_bad_client_env(env: dict[str, str], message: str) -> None:
    host = mps.EmulatedMps()
    s = spec()
    host.start(s)
    with pytest.raises(mps.MpsError, match=message):
        host.connect(s, env=env)


def test_a_server_takes_48_clients_and_one_user_at_a_time() -> None:
    host = mps.EmulatedMps()
    s = spec()
    host.start(s)
    clients = [host.connect(s) for _ in range(mps.MAX_CLIENTS)]
    with pytest.raises(mps.MpsError, match="already has 48 clients"):
        host.connect(s)
    with pytest.raises(mps.MpsError, match="serves user 0; user 1000 waits"):
        host.connect(s, uid=1000)
    assert len({c.server_pid for c in clients}) == 1


def test_crash_drops_servers_and_clients_and_a_new_start_works() -> None:
    host = mps.EmulatedMps()
    s = spec()
    first = host.start(s)
    host.connect(s)
    host.crash(s)
    assert host.state(s) is mps.DaemonState.CRASHED
    assert not host.alive(s)
    assert host.clients(s) == ()
    with pytest.raises(mps.MpsError, match="no MPS control daemon runs"):
        host.server_list(s)
    with pytest.raises(mps.MpsError, match="no MPS control daemon runs"):
        host.connect(s)
    second = host.start(s)
    assert second != first
    assert host.server_list(s) == ()


def test_injected_start_failures() -> None:
    host = mps.EmulatedMps()
    host.fail_next_starts(1, "no GPU")
    with pytest.raises(mps.MpsError, match="-d failed: no GPU"):
        host.start(spec())
    host.start(spec())
    assert host.starts == 1
