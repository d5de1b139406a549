"""Keep the node's MPS control daemons as wanted: start, adopt, restart after a crash, stop.

Why it exists: an MPS-shared GPU serves its pods only while its control daemon runs. The agent
is told which daemons the node needs (a list of :class:`~migpilot.gpu.mps.MpsDaemonSpec`, from
the sharing config) and :class:`MpsSupervisor` makes it so, one pass at a time:

* it creates each daemon's pipe and log directories (mode 0755, as NVIDIA's plugin does), starts
  the missing daemons and, once a daemon answers ``get_server_list``, sends its defaults
  (active thread percentage, pinned memory per device);
* a daemon that dies is restarted after a backoff that doubles with each consecutive failure
  (from :attr:`SupervisorSettings.backoff_initial_s` up to ``backoff_max_s``), the count
  forgotten once it has run ``stable_after_s``; one that never answers within
  ``start_timeout_s`` is asked to quit and counts as a failure;
* a daemon no longer wanted is asked to quit; one whose devices or directories changed is
  restarted, one whose defaults alone changed gets the new defaults (they apply to the next MPS
  server it spawns);
* a daemon the caller says must not start now (``blocked``: its GPUs could not be put in
  ``EXCLUSIVE_PROCESS``, see :mod:`migpilot.agent.sharing.computemodes`) fails its start with the
  caller's reason and backs off like any failed start, so the node's state word is ``failed``
  until a later pass starts it;
* after an agent restart, a daemon still running (its pid file's process, or its socket
  answering) is adopted, not started twice; a marker file in its log directory
  (:data:`MARKER_FILE`) says which devices it was started for, and a daemon started for others
  is restarted.

Every pass returns a :class:`DaemonStatus` per daemon (for labels, metrics and the GpuLayout's
status); :func:`sharing_state` folds them into one word. Phases change only through
:data:`TRANSITIONS`. Time is an input (a :class:`~migpilot.gpu.clocks.Clock`); the process work
goes through :class:`~migpilot.gpu.mps.MpsControl`, so the tests drive the same code over the
emulated daemon. A shell module: it writes the directories and the marker; it imports no
subprocess, gRPC or Kubernetes client.
"""

from __future__ import annotations

import enum
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from migpilot.gpu import clocks, mps
from migpilot.sharing import mps as sharing_mps

_log = logging.getLogger(__name__)

MARKER_FILE = "migpilot-mps.json"
"""In the log directory: the devices and directories the daemon was started for."""
DIR_MODE = 0o755
"""The pipe and log directories' mode: clients in containers of any user read the pipe
directory (NVIDIA's device plugin creates both with 0755)."""


class Phase(enum.StrEnum):
    """Where one daemon is, as the supervisor sees it."""

    STARTING = "starting"
    """Started (or found running) but not yet answering; its defaults are not yet set."""
    RUNNING = "running"
    """Answering, defaults set."""
    BACKOFF = "backoff"
    """It died, failed to start or never answered: waiting until ``retry_at`` to start again."""
    STOPPED = "stopped"
    """Asked to quit because it is no longer wanted (or to restart it with a new spec)."""


class Event(enum.StrEnum):
    """What happened to a daemon in a pass."""

    STARTED = "started"
    ADOPTED = "adopted"
    START_FAILED = "start failed"
    ANSWERED = "answered"
    DIED = "died"
    TIMED_OUT = "timed out"
    QUIT = "quit"


TRANSITIONS: Mapping[tuple[Phase | None, Event], Phase] = {
    (None, Event.STARTED): Phase.STARTING,
    (None, Event.ADOPTED): Phase.STARTING,
    (None, Event.START_FAILED): Phase.BACKOFF,
    (Phase.STARTING, Event.ANSWERED): Phase.RUNNING,
    (Phase.STARTING, Event.DIED): Phase.BACKOFF,
    (Phase.STARTING, Event.TIMED_OUT): Phase.BACKOFF,
    (Phase.STARTING, Event.QUIT): Phase.STOPPED,
    (Phase.RUNNING, Event.DIED): Phase.BACKOFF,
    (Phase.RUNNING, Event.QUIT): Phase.STOPPED,
    (Phase.BACKOFF, Event.STARTED): Phase.STARTING,
    (Phase.BACKOFF, Event.START_FAILED): Phase.BACKOFF,
    (Phase.BACKOFF, Event.QUIT): Phase.STOPPED,
    (Phase.STOPPED, Event.QUIT): Phase.STOPPED,
    (Phase.STOPPED, Event.STARTED): Phase.STARTING,
    (Phase.STOPPED, Event.START_FAILED): Phase.BACKOFF,
}
"""Every allowed (phase, event) → next phase; ``None`` is a daemon not yet seen."""


def transition(phase: Phase | None, event: Event) -> Phase:
    """The phase after ``event``; ``ValueError`` for a move the table does not allow (a bug)."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise ValueError(f"MPS daemon: no transition from {phase} on {event}") from None


@dataclass(frozen=True, slots=True)
class SupervisorSettings:
    """How the supervisor waits and retries."""

    backoff_initial_s: float = 1.0
    """Seconds before the first restart after a failure; doubles per consecutive failure."""
    backoff_max_s: float = 60.0
    """The longest wait between restarts, in seconds."""
    start_timeout_s: float = 30.0
    """Seconds a started daemon has to answer ``get_server_list`` before it counts as failed."""
    stable_after_s: float = 300.0
    """Seconds of running after which the consecutive-failure count starts again from zero."""


def backoff_delay(failures: int, settings: SupervisorSettings) -> float:
    """Seconds to wait after the ``failures``-th consecutive failure (1, 2, 4, ... up to max)."""
    if failures < 1:
        return 0.0
    return min(settings.backoff_initial_s * 2.0 ** (failures - 1), settings.backoff_max_s)


@dataclass(frozen=True, slots=True)
class DaemonStatus:
    """One daemon's state as the supervisor reports it."""

    name: str
    phase: Phase
    since: float
    """Clock time the daemon entered ``phase``."""
    pid: int | None = None
    """The control daemon's pid while it runs."""
    adopted: bool = False
    """Found running at the first pass (started before this supervisor), not started by it."""
    restarts: int = 0
    """Times it was started again after dying or failing."""
    failures: int = 0
    """Consecutive failures (start failed, died, never answered); 0 once it ran stably."""
    retry_at: float | None = None
    """In ``backoff``: clock time of the next start."""
    last_error: str | None = None
    """The latest failure's one-line message; kept until the daemon has run stably."""


def sharing_state(statuses: Iterable[DaemonStatus]) -> str:
    """One word for the node's MPS daemons: ``success`` (all running, or none wanted),
    ``failed`` (one is backing off after a failure) or ``pending``."""
    phases = {s.phase for s in statuses}
    if Phase.BACKOFF in phases:
        return "failed"
    return "success" if phases <= {Phase.RUNNING} else "pending"


@dataclass(frozen=True, slots=True)
class _Record:
    spec: mps.MpsDaemonSpec
    status: DaemonStatus


class MpsSupervisor:
    """Drives the node's MPS daemons toward a desired list, one :meth:`reconcile` at a time."""

    def __init__(
        self,
        control: mps.MpsControl,
        *,
        clock: clocks.Clock,
        settings: SupervisorSettings | None = None,
    ) -> None:
        self._control = control
        self._clock = clock
        self._settings = settings if settings is not None else SupervisorSettings()
        self._records: dict[str, _Record] = {}
        self._blocked: dict[str, str] = {}
        """The current pass's daemons that must not start, with why."""

    def statuses(self) -> tuple[DaemonStatus, ...]:
        """Every daemon the supervisor keeps, by name."""
        return tuple(self._records[name].status for name in sorted(self._records))

    def kept(self) -> tuple[mps.MpsDaemonSpec, ...]:
        """The daemons the supervisor still keeps (wanted, or unwanted but not yet stopped)."""
        return tuple(self._records[name].spec for name in sorted(self._records))

    def reconcile(
        self, desired: Iterable[mps.MpsDaemonSpec], *, blocked: Mapping[str, str] | None = None
    ) -> tuple[DaemonStatus, ...]:
        """One pass toward ``desired`` (see the module docstring); the statuses after it.

        ``blocked`` names daemons that must not be started in this pass, each with the reason
        (a running one is left running). :class:`~migpilot.gpu.mps.MpsError` only for a desired
        list that cannot be meant (two daemons with one name or one pipe directory); a daemon's
        own failures are in its status.
        """
        self._blocked = dict(blocked or {})
        wanted = _checked(desired)
        for name in sorted(set(self._records) - set(wanted)):
            self._retire(self._records[name])
        for name, spec in wanted.items():
            record = self._records.get(name)
            if record is None:
                self._first_sight(spec)
            else:
                self._step(record, spec)
        return self.statuses()

    # -- one daemon --------------------------------------------------------------------------

    def _first_sight(self, spec: mps.MpsDaemonSpec) -> None:
        if self._control.alive(spec):
            started_for = _read_marker(spec)
            if started_for is None or started_for.same_process(spec):
                pid = self._control.pid(spec)
                _log.info("MPS daemon %s: adopted the running daemon (pid %s)", spec.name, pid)
                self._set(spec, None, Event.ADOPTED, pid=pid, adopted=True)
                self._probe(self._records[spec.name])
                return
            _log.info("MPS daemon %s: running for other devices; restarting it", spec.name)
            try:
                self._control.stop(spec)
            except mps.MpsError as e:
                self._set(spec, None, Event.START_FAILED, error=str(e))
                return
        self._start(spec, None)

    def _step(self, record: _Record, spec: mps.MpsDaemonSpec) -> None:
        status = record.status
        if record.spec != spec and not record.spec.same_process(spec):
            _log.info("MPS daemon %s: devices or directories changed; restarting", spec.name)
            if status.phase is not Phase.STOPPED:
                try:
                    self._control.stop(record.spec)
                except mps.MpsError as e:
                    self._records[spec.name] = replace(
                        record, status=replace(status, last_error=str(e))
                    )
                    return
                record = self._set(record.spec, status, Event.QUIT)
            self._start(spec, record.status, restart=False)
            return
        if record.spec != spec:  # only the defaults changed
            record = replace(record, spec=spec)
            self._records[spec.name] = record
            if status.phase is Phase.RUNNING:
                self._send_defaults(record)
                return
        if status.phase is Phase.STARTING:
            self._probe(record)
        elif status.phase is Phase.RUNNING:
            self._watch(record)
        elif status.phase is Phase.BACKOFF:
            if status.retry_at is None or self._clock.monotonic() >= status.retry_at:
                self._start(spec, status, restart=True)
        else:
            self._start(spec, status, restart=False)

    def _start(
        self, spec: mps.MpsDaemonSpec, status: DaemonStatus | None, *, restart: bool = False
    ) -> None:
        try:
            if spec.name in self._blocked:
                raise mps.MpsError(self._blocked[spec.name])
            _make_dirs(spec)
            pid = self._control.start(spec)
            _write_marker(spec)
        except mps.MpsError as e:
            _log.warning("MPS daemon %s: start failed: %s", spec.name, e)
            self._set(spec, status, Event.START_FAILED, error=str(e), restart=restart)
            return
        _log.info("MPS daemon %s: started (pid %d)", spec.name, pid)
        record = self._set(spec, status, Event.STARTED, pid=pid, restart=restart)
        self._probe(record)

    def _probe(self, record: _Record) -> None:
        """A STARTING daemon: running once it answers, a failure if it dies or keeps silent."""
        spec, status = record.spec, record.status
        if not self._control.alive(spec):
            self._set(spec, status, Event.DIED, error="the daemon exited before it answered")
            return
        try:
            self._control.server_list(spec)
            self._control.set_defaults(spec)
        except mps.MpsError as e:
            if self._clock.monotonic() - status.since < self._settings.start_timeout_s:
                return
            message = (
                f"no answer within {self._settings.start_timeout_s:g} s of starting "
                f"(last: {e}); asked it to quit"
            )
            try:
                self._control.stop(spec)
            except mps.MpsError as stop_error:
                message = f"{message}, which failed: {stop_error}"
            self._set(spec, status, Event.TIMED_OUT, error=message)
            return
        _log.info("MPS daemon %s: answering; defaults set", spec.name)
        self._set(spec, status, Event.ANSWERED, pid=self._control.pid(spec) or status.pid)

    def _watch(self, record: _Record) -> None:
        spec, status = record.spec, record.status
        if not self._control.alive(spec):
            _log.warning(
                "MPS daemon %s: pid %s died; restarting after backoff", spec.name, status.pid
            )
            self._set(spec, status, Event.DIED, error=f"the daemon (pid {status.pid}) died")
            return
        now = self._clock.monotonic()
        if status.failures and now - status.since >= self._settings.stable_after_s:
            self._records[spec.name] = replace(
                record, status=replace(status, failures=0, last_error=None)
            )

    def _send_defaults(self, record: _Record) -> None:
        try:
            self._control.set_defaults(record.spec)
        except mps.MpsError as e:
            self._records[record.spec.name] = replace(
                record, status=replace(record.status, last_error=str(e))
            )

    def _retire(self, record: _Record) -> None:
        spec = record.spec
        try:
            self._control.stop(spec)
        except mps.MpsError as e:
            _log.warning("MPS daemon %s: stop failed: %s", spec.name, e)
            self._records[spec.name] = replace(
                record, status=replace(record.status, last_error=str(e))
            )
            return
        _log.info("MPS daemon %s: stopped (no longer wanted)", spec.name)
        (spec.log_dir / MARKER_FILE).unlink(missing_ok=True)
        self._set(spec, record.status, Event.QUIT)
        del self._records[spec.name]

    def _set(
        self,
        spec: mps.MpsDaemonSpec,
        status: DaemonStatus | None,
        event: Event,
        *,
        pid: int | None = None,
        adopted: bool = False,
        error: str | None = None,
        restart: bool = False,
    ) -> _Record:
        """Move one daemon through :data:`TRANSITIONS` and record what it now is."""
        phase = transition(status.phase if status is not None else None, event)
        now = self._clock.monotonic()
        before = status if status is not None else DaemonStatus(spec.name, phase, now)
        failures = before.failures
        retry_at = None
        if phase is Phase.BACKOFF:
            failures += 1
            retry_at = now + backoff_delay(failures, self._settings)
        new = replace(
            before,
            phase=phase,
            since=now,
            pid=pid if phase in (Phase.STARTING, Phase.RUNNING) else None,
            adopted=adopted or (before.adopted and phase is not Phase.BACKOFF),
            restarts=before.restarts + (1 if restart else 0),
            failures=failures,
            retry_at=retry_at,
            last_error=error if error is not None else before.last_error,
        )
        record = _Record(spec, new)
        self._records[spec.name] = record
        return record


def _checked(desired: Iterable[mps.MpsDaemonSpec]) -> dict[str, mps.MpsDaemonSpec]:
    wanted: dict[str, mps.MpsDaemonSpec] = {}
    pipes: dict[Path, str] = {}
    for spec in desired:
        if spec.name in wanted:
            raise mps.MpsError(f"two MPS daemons are named {spec.name!r}")
        if spec.pipe_dir in pipes:
            raise mps.MpsError(
                f"MPS daemons {pipes[spec.pipe_dir]!r} and {spec.name!r} share the pipe "
                f"directory {str(spec.pipe_dir)!r}"
            )
        wanted[spec.name] = spec
        pipes[spec.pipe_dir] = spec.name
    return wanted


def _make_dirs(spec: mps.MpsDaemonSpec) -> None:
    for path in (spec.pipe_dir, spec.log_dir):
        try:
            path.mkdir(parents=True, exist_ok=True)
            path.chmod(DIR_MODE)
        except OSError as e:
            raise mps.MpsError(
                f"cannot create the MPS directory {str(path)!r}: {e.strerror or e}"
            ) from None


def _write_marker(spec: mps.MpsDaemonSpec) -> None:
    doc = {
        "name": spec.name,
        "devices": list(spec.devices),
        "pipe_dir": str(spec.pipe_dir),
        "log_dir": str(spec.log_dir),
    }
    try:
        (spec.log_dir / MARKER_FILE).write_text(json.dumps(doc) + "\n", encoding="utf-8")
    except OSError as e:
        raise mps.MpsError(f"cannot write {str(spec.log_dir / MARKER_FILE)!r}: {e}") from None


def _read_marker(spec: mps.MpsDaemonSpec) -> mps.MpsDaemonSpec | None:
    """The spec a running daemon was started for, from its marker; ``None`` if unknown."""
    try:
        doc = json.loads((spec.log_dir / MARKER_FILE).read_text(encoding="utf-8"))
        return mps.MpsDaemonSpec(
            name=str(doc["name"]),
            devices=tuple(str(d) for d in doc["devices"]),
            pipe_dir=Path(doc["pipe_dir"]),
            log_dir=Path(doc["log_dir"]),
        )
    except (OSError, ValueError, KeyError, TypeError, RecursionError, mps.MpsError):
        return None


@dataclass(frozen=True, slots=True)
class CheckResult:
    """What :func:`check` saw of one daemon it started, asked and stopped."""

    pid: int | None
    """The control daemon's pid while it ran."""
    answered_after_s: float
    """Seconds from the start until it answered ``get_server_list``."""
    servers: tuple[int, ...]
    """Its ``get_server_list`` answer (empty until a CUDA client connects)."""
    defaults: tuple[str, ...]
    """The default commands it was sent."""
    pipe_files: tuple[str, ...]
    """What was in its pipe directory while it ran (``control``, its pid file, ...)."""
    log_tail: tuple[str, ...]
    """The last lines of its ``control.log`` (empty when it wrote none)."""


def check(
    control: mps.MpsControl,
    spec: mps.MpsDaemonSpec,
    *,
    clock: clocks.Clock,
    timeout_s: float = 30.0,
    poll_s: float = 0.1,
    log_lines: int = 8,
) -> CheckResult:
    """Start a daemon for ``spec`` as the agent does, ask ``get_server_list``, stop it.

    What ``migpilot mps check`` runs on a GPU node. It refuses a pipe directory where a daemon
    already runs (it would stop someone else's daemon). :class:`~migpilot.gpu.mps.MpsError`
    when the daemon does not start or answer; the daemon is stopped in every case.
    """
    if control.alive(spec):
        raise mps.MpsError(
            f"an MPS control daemon already runs in {str(spec.pipe_dir)!r}; the check starts "
            "its own: give it another pipe directory"
        )
    settings = SupervisorSettings(start_timeout_s=timeout_s)
    supervisor = MpsSupervisor(control, clock=clock, settings=settings)
    began = clock.monotonic()
    try:
        (status,) = supervisor.reconcile([spec])
        while status.phase is Phase.STARTING:
            clock.sleep(poll_s)
            (status,) = supervisor.reconcile([spec])
        if status.phase is not Phase.RUNNING:
            raise mps.MpsError(
                f"the MPS control daemon did not come up: {status.last_error or status.phase}"
            )
        answered = clock.monotonic() - began
        servers = control.server_list(spec)
        files = tuple(sorted(p.name for p in spec.pipe_dir.iterdir()))
    finally:
        left = supervisor.reconcile([])
    if left:
        raise mps.MpsError(f"the MPS control daemon did not quit: {left[0].last_error}")
    try:
        log = (spec.log_dir / mps.CONTROL_LOG).read_text(encoding="utf-8", errors="replace")
    except OSError:
        log = ""
    return CheckResult(
        pid=status.pid,
        answered_after_s=answered,
        servers=servers,
        defaults=spec.default_commands(),
        pipe_files=files,
        log_tail=tuple(log.splitlines()[-log_lines:]),
    )


def spec_of(daemon: sharing_mps.MpsDaemon) -> mps.MpsDaemonSpec:
    """The daemon the sharing config asks for (:func:`migpilot.sharing.mps.daemons`, one per
    shared resource) as the supervisor runs it: named after its resource (``nvidia.com-gpu``),
    its devices in order. The daemon's default pinned memory is set per device index but one
    value for all: the smallest of its devices' (memory / replicas), so no client can pin more
    than its share on any of them (a resource's devices are normally of one model, all equal);
    each container's own limit, from Allocate, is its device's exact share."""
    limits = [d.pinned_limit_mib for d in daemon.devices]
    return mps.MpsDaemonSpec(
        name=daemon.resource.replace("/", "-"),
        devices=tuple(d.uuid for d in daemon.devices),
        pipe_dir=Path(daemon.pipe_dir),
        log_dir=Path(daemon.log_dir),
        active_thread_percentage=daemon.active_thread_percentage,
        pinned_mem_limit_mib=min(limits) if limits else None,
    )
