"""NVIDIA's MPS control daemon: what one daemon serves, and how the agent starts, asks and stops it.

MPS (Multi-Process Service) lets the CUDA processes of several containers share one GPU with a
memory cap and a share of the SMs each. A node in MPS mode runs one control daemon,
``nvidia-cuda-mps-control -d``, per shared GPU set; its clients find it through the pipe
directory (``CUDA_MPS_PIPE_DIRECTORY``: the ``control`` socket and the daemon's
``nvidia-cuda-mps-control.pid``), and it logs to ``control.log`` in ``CUDA_MPS_LOG_DIRECTORY``.
The daemon is driven by writing its commands to the standard input of a second
``nvidia-cuda-mps-control`` with the same environment: ``get_server_list``,
``set_default_active_thread_percentage N``, ``set_default_device_pinned_mem_limit DEV VALUE``,
``quit`` (NVIDIA's MPS guide, "Tools and Interface Reference"; NVIDIA's k8s-device-plugin does
the same in ``cmd/mps-control-daemon/mps/daemon.go``).

:class:`MpsDaemonSpec` is one daemon as data; :class:`MpsControl` is what the agent's
supervisor (:mod:`migpilot.agent.sharing.mps`) asks of the daemon. :class:`EmulatedMps` models the
daemon in memory (starting, running, crashed, stopped; MPS servers spawned per user when
clients connect; defaults that affect only the next server, as the real daemon's do; crashes on
demand). :class:`ProcessMps` runs NVIDIA's real binary. Only this module of :mod:`migpilot.gpu`
starts processes (an import-linter contract); it imports no driver bindings.
"""

from __future__ import annotations

import enum
import itertools
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from migpilot import digits, errors
from migpilot.gpu import clocks

CONTROL_BINARY = "nvidia-cuda-mps-control"
"""NVIDIA's control program: ``-d`` starts the daemon, without arguments it relays commands."""
PID_FILE = "nvidia-cuda-mps-control.pid"
"""The control daemon's pid, written into the pipe directory by the daemon itself."""
CONTROL_SOCKET = "control"
"""The control daemon's unix socket in the pipe directory."""
CONTROL_LOG = "control.log"
"""The control daemon's log in the log directory."""
MAX_CLIENTS = 48
"""Clients one MPS server takes on Volta and newer (16 before Volta)."""
_SOCKET_PATH_MAX = 107
"""A unix socket path's longest length on Linux (``sun_path`` is 108 bytes with the NUL)."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")

ENV_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
ENV_PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
ENV_LOG_DIRECTORY = "CUDA_MPS_LOG_DIRECTORY"
ENV_PINNED_DEVICE_MEM_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
ENV_ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


class MpsError(errors.MigpilotError):
    """An MPS daemon that cannot be described, started, reached or stopped; one line."""


class DaemonState(enum.StrEnum):
    """Where one control daemon's process is (as :class:`EmulatedMps` models it)."""

    STARTING = "starting"
    """The process runs but its control socket does not answer yet."""
    RUNNING = "running"
    """It answers commands."""
    CRASHED = "crashed"
    """It died without being asked: its pid file and socket are left behind, stale."""
    STOPPED = "stopped"
    """It quit when asked."""


@dataclass(frozen=True, slots=True)
class MpsDaemonSpec:
    """One MPS control daemon: the devices it shares, its directories and its defaults."""

    name: str
    """The daemon's id on this node (``gpu-0``, ``nvidia.com-gpu``): letters, digits, ``.-_``."""
    devices: tuple[str, ...]
    """UUIDs of the devices it serves, in ``CUDA_VISIBLE_DEVICES`` order (device index ``i`` of
    its commands is ``devices[i]``); empty: every GPU of the node is visible to it."""
    pipe_dir: Path
    """``CUDA_MPS_PIPE_DIRECTORY``: its socket and pid file; mounted into its clients."""
    log_dir: Path
    """``CUDA_MPS_LOG_DIRECTORY``: ``control.log`` and the servers' ``server.log``."""
    active_thread_percentage: int | None = None
    """Default share of each device's SMs a client may use, 1-100; ``None``: the driver's 100."""
    pinned_mem_limit_mib: int | None = None
    """Default cap on the device memory each client may pin on each of its devices, in MiB;
    ``None``: no cap. Needs ``devices``, since the cap is set per device index."""

    def __post_init__(self) -> None:
        where = f"MPS daemon {self.name!r}"
        if not _NAME.fullmatch(self.name):
            raise MpsError(
                f"MPS daemon name {self.name!r} is not a name: use letters, digits, '.', '-', '_'"
            )
        for uuid in self.devices:
            if not uuid or "," in uuid or uuid != uuid.strip():
                raise MpsError(f"{where}: device {uuid!r} is not a device UUID")
        if len(set(self.devices)) != len(self.devices):
            raise MpsError(f"{where}: a device is named twice in {list(self.devices)}")
        for label, path in (("pipe", self.pipe_dir), ("log", self.log_dir)):
            if not path.is_absolute():
                raise MpsError(f"{where}: the {label} directory {str(path)!r} is not absolute")
        socket = str(self.pipe_dir / CONTROL_SOCKET)
        if len(socket.encode()) > _SOCKET_PATH_MAX:
            raise MpsError(
                f"{where}: the pipe directory {str(self.pipe_dir)!r} is too long for a unix "
                f"socket ({len(socket.encode())} bytes with /{CONTROL_SOCKET}, at most "
                f"{_SOCKET_PATH_MAX})"
            )
        atp = self.active_thread_percentage
        if atp is not None and not 1 <= atp <= 100:
            raise MpsError(f"{where}: active thread percentage {atp} is not within 1-100")
        mib = self.pinned_mem_limit_mib
        if mib is not None:
            if mib < 1:
                raise MpsError(f"{where}: pinned device memory limit {mib} MiB is not positive")
            if not self.devices:
                raise MpsError(
                    f"{where}: a pinned device memory limit needs the devices named, since it "
                    "is set per device index"
                )

    def env(self) -> dict[str, str]:
        """The environment the daemon (and every command sent to it) runs with."""
        env = {ENV_PIPE_DIRECTORY: str(self.pipe_dir), ENV_LOG_DIRECTORY: str(self.log_dir)}
        if self.devices:
            env[ENV_VISIBLE_DEVICES] = ",".join(self.devices)
        return env

    def default_commands(self) -> tuple[str, ...]:
        """The control commands that set this spec's defaults, in the order they are sent."""
        commands = [
            f"set_default_device_pinned_mem_limit {index} {self.pinned_mem_limit_mib}M"
            for index in range(len(self.devices))
            if self.pinned_mem_limit_mib is not None
        ]
        if self.active_thread_percentage is not None:
            commands.append(f"set_default_active_thread_percentage {self.active_thread_percentage}")
        return tuple(commands)

    def same_process(self, other: MpsDaemonSpec) -> bool:
        """True when ``other`` can be served by this spec's process: the same devices and
        directories (only the defaults may differ, and those are set on a running daemon)."""
        return (self.devices, self.pipe_dir, self.log_dir) == (
            other.devices,
            other.pipe_dir,
            other.log_dir,
        )


_UNITS = {"": None, "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}
_LIMIT = re.compile(r"([0-9]+)\s*([KMGT]?)B?", re.IGNORECASE)


def parse_mem_value_mib(text: str) -> int:
    """A memory value as MPS writes it (``512M``, ``10G``, ``2048MB``) in MiB (rounded down)."""
    match = _LIMIT.fullmatch(text.strip())
    unit = match.group(2).upper() if match else ""
    if match is None or _UNITS[unit] is None:
        raise MpsError(f"memory value {text!r} is not a number with a unit K, M, G or T")
    factor = _UNITS[unit]
    assert factor is not None
    return int(int(match.group(1)) * factor)


def parse_pinned_mem_limit(text: str) -> dict[int, int]:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (``0=10G,1=512M``) as MiB per device index."""
    limits: dict[int, int] = {}
    for part in text.split(","):
        index, sep, value = part.strip().partition("=")
        if not sep or not digits.is_digits(index.strip()):
            raise MpsError(
                f"{ENV_PINNED_DEVICE_MEM_LIMIT}={text!r}: {part.strip()!r} is not DEVICE=VALUE"
            )
        limits[int(index)] = parse_mem_value_mib(value)
    return limits


def format_pinned_mem_limit(limits_mib: Mapping[int, int]) -> str:
    """MiB per device index as ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` takes it (``0=10240M``)."""
    return ",".join(f"{index}={mib}M" for index, mib in sorted(limits_mib.items()))


class MpsControl(Protocol):
    """What the agent asks of the MPS control daemon of one spec (keyed by its pipe directory)."""

    def start(self, spec: MpsDaemonSpec) -> int:
        """Start the daemon; its pid. :class:`MpsError` if one already runs there or it fails."""
        ...

    def stop(self, spec: MpsDaemonSpec) -> None:
        """Ask the daemon to quit and wait for it; nothing when none runs."""
        ...

    def alive(self, spec: MpsDaemonSpec) -> bool:
        """True when a control daemon runs for this pipe directory (it may not answer yet)."""
        ...

    def pid(self, spec: MpsDaemonSpec) -> int | None:
        """The running daemon's pid, from its pid file; ``None`` when none runs."""
        ...

    def server_list(self, spec: MpsDaemonSpec) -> tuple[int, ...]:
        """The ``get_server_list`` answer: pids of its MPS servers (none until a client came).
        :class:`MpsError` when the daemon does not answer."""
        ...

    def set_defaults(self, spec: MpsDaemonSpec) -> None:
        """Send the spec's :meth:`~MpsDaemonSpec.default_commands` (they take effect for the
        next MPS server the daemon spawns, as NVIDIA documents)."""
        ...


@dataclass(frozen=True, slots=True)
class MpsClient:
    """A CUDA process connected to an emulated daemon, with the limits it got."""

    pid: int
    server_pid: int
    uid: int
    pinned_mem_limit_mib: tuple[tuple[int, int], ...]
    """(device index, MiB) for each capped device: its own env's, else the server's defaults."""
    active_thread_percentage: int
    """Its env's, else the server's default, else 100."""


@dataclass(slots=True)
class _Server:
    pid: int
    uid: int
    active_thread_percentage: int | None
    pinned_mem_limit_mib: dict[int, int]
    clients: dict[int, MpsClient] = field(default_factory=dict)


@dataclass(slots=True)
class _Daemon:
    spec: MpsDaemonSpec
    pid: int
    state: DaemonState
    ready_at: float
    active_thread_percentage: int | None = None
    pinned_mem_limit_mib: dict[int, int] = field(default_factory=dict)
    servers: dict[int, _Server] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)


class EmulatedMps:
    """The MPS control daemons of one node, in memory (see the module docstring).

    One instance stands for the host: daemons outlive a supervisor, so a new supervisor over
    the same instance finds them, as the agent finds real daemons after a restart. A daemon is
    keyed by its pipe directory, as the real one is.
    """

    def __init__(
        self, *, clock: clocks.Clock | None = None, startup_s: float = 0.0, first_pid: int = 4000
    ) -> None:
        self._clock = clock if clock is not None else clocks.VirtualClock()
        self._startup_s = startup_s
        self._pids = itertools.count(first_pid)
        self._daemons: dict[Path, _Daemon] = {}
        self._start_failures: list[str] = []
        self.starts = 0
        """How many daemons were started (adoption starts none)."""

    # -- fault injection and inspection ------------------------------------------------------

    def fail_next_starts(self, count: int, message: str = "emulated start failure") -> None:
        """Make the next ``count`` starts fail with ``message``."""
        self._start_failures.extend([message] * count)

    def crash(self, spec: MpsDaemonSpec) -> None:
        """Kill the daemon as a crash would: its servers and clients go, stale files stay."""
        daemon = self._live(spec)
        daemon.state = DaemonState.CRASHED
        daemon.servers.clear()
        daemon.log.append("crashed")

    def state(self, spec: MpsDaemonSpec) -> DaemonState | None:
        """The daemon's state; ``None`` if none was ever started in this pipe directory."""
        daemon = self._daemons.get(spec.pipe_dir)
        if daemon is None:
            return None
        self._settle(daemon)
        return daemon.state

    def running_spec(self, spec: MpsDaemonSpec) -> MpsDaemonSpec | None:
        """The spec the live daemon in ``spec``'s pipe directory was started with."""
        daemon = self._daemons.get(spec.pipe_dir)
        return daemon.spec if daemon is not None and self.alive(spec) else None

    def control_log(self, spec: MpsDaemonSpec) -> tuple[str, ...]:
        """What the daemon logged: start, commands, crash, quit (its ``control.log``)."""
        daemon = self._daemons.get(spec.pipe_dir)
        return tuple(daemon.log) if daemon is not None else ()

    def connect(
        self, spec: MpsDaemonSpec, *, env: Mapping[str, str] | None = None, uid: int = 0
    ) -> MpsClient:
        """A CUDA process with ``env`` initialising under the daemon: it is served by the
        server of its user (spawned with the daemon's defaults now), with its env's limits.

        The real driver runs a client without MPS when no daemon answers; the emulator refuses
        instead, so a test sees the mistake.
        """
        daemon = self._answering(spec)
        env = env or {}
        if env.get(ENV_PIPE_DIRECTORY, str(spec.pipe_dir)) != str(spec.pipe_dir):
            raise MpsError(
                f"client's {ENV_PIPE_DIRECTORY}={env[ENV_PIPE_DIRECTORY]!r} is not this daemon's "
                f"{str(spec.pipe_dir)!r}"
            )
        server = next(iter(daemon.servers.values()), None)
        if server is not None and server.uid != uid:
            if server.clients:
                raise MpsError(
                    f"MPS server {server.pid} serves user {server.uid}; user {uid} waits until "
                    "its clients finish"
                )
            daemon.servers.clear()
            server = None
        if server is None:
            server = _Server(
                pid=next(self._pids),
                uid=uid,
                active_thread_percentage=daemon.active_thread_percentage,
                pinned_mem_limit_mib=dict(daemon.pinned_mem_limit_mib),
            )
            daemon.servers[server.pid] = server
            daemon.log.append(f"server {server.pid} started for user {uid}")
        if len(server.clients) >= MAX_CLIENTS:
            raise MpsError(f"MPS server {server.pid} already has {MAX_CLIENTS} clients")
        limits = dict(server.pinned_mem_limit_mib)
        if ENV_PINNED_DEVICE_MEM_LIMIT in env:
            limits = parse_pinned_mem_limit(env[ENV_PINNED_DEVICE_MEM_LIMIT])
        visible = len(spec.devices)
        if visible and any(index >= visible for index in limits):
            raise MpsError(
                f"{ENV_PINNED_DEVICE_MEM_LIMIT} names device index {max(limits)} but the "
                f"daemon serves {visible} device(s)"
            )
        atp = server.active_thread_percentage or 100
        if ENV_ACTIVE_THREAD_PERCENTAGE in env:
            atp = _percentage(env[ENV_ACTIVE_THREAD_PERCENTAGE], ENV_ACTIVE_THREAD_PERCENTAGE)
        client = MpsClient(
            pid=next(self._pids),
            server_pid=server.pid,
            uid=uid,
            pinned_mem_limit_mib=tuple(sorted(limits.items())),
            active_thread_percentage=atp,
        )
        server.clients[client.pid] = client
        return client

    def disconnect(self, spec: MpsDaemonSpec, pid: int) -> None:
        """The client ``pid`` exits."""
        for server in self._answering(spec).servers.values():
            if server.clients.pop(pid, None) is not None:
                return
        raise MpsError(f"no MPS client {pid} under daemon {spec.name!r}")

    def clients(self, spec: MpsDaemonSpec) -> tuple[MpsClient, ...]:
        """The clients connected now, by pid."""
        daemon = self._daemons.get(spec.pipe_dir)
        if daemon is None or not self.alive(spec):
            return ()
        found = [c for s in daemon.servers.values() for c in s.clients.values()]
        return tuple(sorted(found, key=lambda c: c.pid))

    # -- MpsControl --------------------------------------------------------------------------

    def start(self, spec: MpsDaemonSpec) -> int:
        """Start a daemon for ``spec`` (see :meth:`MpsControl.start`)."""
        if self.alive(spec):
            running = self._daemons[spec.pipe_dir]
            raise MpsError(
                f"an MPS control daemon already runs in {str(spec.pipe_dir)!r} (pid {running.pid})"
            )
        if self._start_failures:
            raise MpsError(f"{CONTROL_BINARY} -d failed: {self._start_failures.pop(0)}")
        now = self._clock.monotonic()
        daemon = _Daemon(
            spec=spec,
            pid=next(self._pids),
            state=DaemonState.STARTING,
            ready_at=now + self._startup_s,
            log=[f"started with {ENV_VISIBLE_DEVICES}={','.join(spec.devices)}"],
        )
        self._daemons[spec.pipe_dir] = daemon
        self.starts += 1
        self._settle(daemon)
        return daemon.pid

    def stop(self, spec: MpsDaemonSpec) -> None:
        """Quit the daemon (see :meth:`MpsControl.stop`)."""
        if not self.alive(spec):
            return
        daemon = self._daemons[spec.pipe_dir]
        daemon.state = DaemonState.STOPPED
        daemon.servers.clear()
        daemon.log.append("quit")

    def alive(self, spec: MpsDaemonSpec) -> bool:
        """True while the daemon is starting or running."""
        return self.state(spec) in (DaemonState.STARTING, DaemonState.RUNNING)

    def pid(self, spec: MpsDaemonSpec) -> int | None:
        """The live daemon's pid."""
        return self._daemons[spec.pipe_dir].pid if self.alive(spec) else None

    def server_list(self, spec: MpsDaemonSpec) -> tuple[int, ...]:
        """Pids of the daemon's MPS servers."""
        daemon = self._answering(spec)
        daemon.log.append("get_server_list")
        return tuple(sorted(daemon.servers))

    def set_defaults(self, spec: MpsDaemonSpec) -> None:
        """Record the spec's defaults for the next server the daemon spawns."""
        daemon = self._answering(spec)
        for command in spec.default_commands():
            daemon.log.append(command)
        if spec.active_thread_percentage is not None:
            daemon.active_thread_percentage = spec.active_thread_percentage
        if spec.pinned_mem_limit_mib is not None:
            for index in range(len(spec.devices)):
                daemon.pinned_mem_limit_mib[index] = spec.pinned_mem_limit_mib

    # -- internals ---------------------------------------------------------------------------

    def _settle(self, daemon: _Daemon) -> None:
        if daemon.state is DaemonState.STARTING and self._clock.monotonic() >= daemon.ready_at:
            daemon.state = DaemonState.RUNNING

    def _live(self, spec: MpsDaemonSpec) -> _Daemon:
        if not self.alive(spec):
            raise MpsError(f"no MPS control daemon runs in {str(spec.pipe_dir)!r}")
        return self._daemons[spec.pipe_dir]

    def _answering(self, spec: MpsDaemonSpec) -> _Daemon:
        daemon = self._live(spec)
        if daemon.state is not DaemonState.RUNNING:
            raise MpsError(
                f"the MPS control daemon in {str(spec.pipe_dir)!r} does not answer yet (starting)"
            )
        return daemon


def _percentage(text: str, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise MpsError(f"{what}={text!r} is not a whole percentage") from None
    if not 1 <= value <= 100:
        raise MpsError(f"{what}={value} is not within 1-100")
    return value


class ProcessMps:
    """NVIDIA's real ``nvidia-cuda-mps-control``, run as NVIDIA's device plugin runs it.

    ``-d`` starts the daemon (in its own session, so it outlives the agent's process group and
    is adopted after an agent restart); each command is written to the stdin of a second
    ``nvidia-cuda-mps-control`` with the daemon's environment. Liveness is the pid file's
    process, or else the control socket answering ``get_server_list``. Waiting polls on the
    injected clock.
    """

    def __init__(
        self,
        *,
        binary: str = CONTROL_BINARY,
        environ: Mapping[str, str] | None = None,
        clock: clocks.Clock | None = None,
        timeout_s: float = 10.0,
        poll_s: float = 0.02,
    ) -> None:
        self._binary = binary
        self._environ = dict(os.environ if environ is None else environ)
        self._clock = clock if clock is not None else clocks.SystemClock()
        self._timeout_s = timeout_s
        self._poll_s = poll_s

    def executable(self) -> str:
        """The binary's path; :class:`MpsError` naming it when it is not installed."""
        if os.sep in self._binary:
            if os.access(self._binary, os.X_OK) and Path(self._binary).is_file():
                return self._binary
            found = None
        else:
            found = shutil.which(self._binary, path=self._environ.get("PATH", os.defpath))
        if found is None:
            raise MpsError(
                f"{self._binary} is not installed (not an executable on PATH); MPS needs "
                "NVIDIA's driver utilities on the node"
            )
        return found

    def start(self, spec: MpsDaemonSpec) -> int:
        """Run ``nvidia-cuda-mps-control -d`` for ``spec``; the pid from its pid file."""
        binary = self.executable()
        if self.alive(spec):
            raise MpsError(
                f"an MPS control daemon already runs in {str(spec.pipe_dir)!r} "
                f"(pid {self.pid(spec)})"
            )
        # What a dead daemon left behind would make the new one fail to bind or be taken for
        # it; neither answers, so they are stale.
        (spec.pipe_dir / PID_FILE).unlink(missing_ok=True)
        (spec.pipe_dir / CONTROL_SOCKET).unlink(missing_ok=True)
        # Output to a file, not a pipe: a daemon keeping the pipe open would block the wait.
        with tempfile.TemporaryFile(mode="w+", encoding="utf-8", errors="replace") as out:
            try:
                done = subprocess.run(
                    [binary, "-d"],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=self._env(spec),
                    timeout=self._timeout_s,
                    start_new_session=True,
                    check=False,
                )
            except subprocess.TimeoutExpired:
                raise MpsError(f"{binary} -d did not return within {self._timeout_s:g} s") from None
            out.seek(0)
            said = _first_line(out.read())
        if done.returncode != 0:
            raise MpsError(f"{binary} -d failed (exit {done.returncode}): {said or 'no output'}")
        deadline = self._clock.monotonic() + self._timeout_s
        while True:
            pid = self.pid(spec)
            if pid is not None:
                return pid
            if self._clock.monotonic() >= deadline:
                raise MpsError(
                    f"{binary} -d wrote no live pid to {str(spec.pipe_dir / PID_FILE)!r} within "
                    f"{self._timeout_s:g} s; see {str(spec.log_dir / CONTROL_LOG)!r}"
                )
            self._clock.sleep(self._poll_s)

    def stop(self, spec: MpsDaemonSpec) -> None:
        """Send ``quit`` and wait until the daemon's process has gone."""
        if not self.alive(spec):
            return
        pid = self.pid(spec)
        self._command(spec, "quit")
        deadline = self._clock.monotonic() + self._timeout_s
        while pid is not None and _process_alive(pid):
            if self._clock.monotonic() >= deadline:
                raise MpsError(
                    f"the MPS control daemon {pid} in {str(spec.pipe_dir)!r} did not quit "
                    f"within {self._timeout_s:g} s"
                )
            self._clock.sleep(self._poll_s)

    def alive(self, spec: MpsDaemonSpec) -> bool:
        """The pid file's process lives, or else the control socket answers."""
        if self.pid(spec) is not None:
            return True
        if not (spec.pipe_dir / CONTROL_SOCKET).is_socket():
            return False
        try:
            self.server_list(spec)
        except MpsError:
            return False
        return True

    def pid(self, spec: MpsDaemonSpec) -> int | None:
        """The pid in the daemon's pid file, if that process lives."""
        try:
            text = (spec.pipe_dir / PID_FILE).read_text(encoding="utf-8").strip()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not digits.is_digits(text):
            return None
        pid = int(text)
        return pid if _process_alive(pid) else None

    def server_list(self, spec: MpsDaemonSpec) -> tuple[int, ...]:
        """Ask ``get_server_list``; the pids it prints, one a line."""
        if not (spec.pipe_dir / CONTROL_SOCKET).exists():
            raise MpsError(
                f"no MPS control daemon answers in {str(spec.pipe_dir)!r} "
                f"(no {CONTROL_SOCKET} socket)"
            )
        answer = self._command(spec, "get_server_list")
        pids = []
        for line in answer.splitlines():
            if line.strip():
                if not digits.is_digits(line.strip()):
                    raise MpsError(f"get_server_list answered {_first_line(answer)!r}, not pids")
                pids.append(int(line))
        return tuple(pids)

    def set_defaults(self, spec: MpsDaemonSpec) -> None:
        """Send each of the spec's default commands."""
        for command in spec.default_commands():
            self._command(spec, command)

    def _env(self, spec: MpsDaemonSpec) -> dict[str, str]:
        env = {
            k: v
            for k, v in self._environ.items()
            if k != ENV_VISIBLE_DEVICES and not k.startswith("CUDA_MPS_")
        }
        env.update(spec.env())
        return env

    def _command(self, spec: MpsDaemonSpec, command: str) -> str:
        binary = self.executable()
        try:
            done = subprocess.run(
                [binary],
                input=command + "\n",
                capture_output=True,
                text=True,
                env=self._env(spec),
                timeout=self._timeout_s,
                check=False,
            )
        except subprocess.TimeoutExpired:
            raise MpsError(
                f"{CONTROL_BINARY} {command!r} got no answer within {self._timeout_s:g} s "
                f"from {str(spec.pipe_dir)!r}"
            ) from None
        if done.returncode != 0:
            said = _first_line(done.stderr) or _first_line(done.stdout) or "no output"
            raise MpsError(
                f"{CONTROL_BINARY} {command!r} failed in {str(spec.pipe_dir)!r} "
                f"(exit {done.returncode}): {said}"
            )
        return done.stdout


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def _process_alive(pid: int) -> bool:
    """True when ``pid`` is a process that has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[:1] != ["Z"]
