"""The node agent's main loop: desired layouts in, MIG instances, advertised devices and labels out.

The parts exist on their own (the GPU backend, the reconciler, the device plugin, the GFD label
generator, the metrics); :class:`Agent` wires them into one loop and takes every part by
constructor, so tests run it in process on an emulated backend with a virtual clock. One pass
(:meth:`Agent.reconcile`): read the desired layouts from a :class:`DesiredSource`, reconcile them
with the in-use devices (the kubelet's PodResources, this plugin's Allocate hand-outs, running
processes) never destroyed, send the devices now there to the plugin at once (the open
ListAndWatch streams change, nothing restarts), rewrite the GFD labels file when it changed and
refresh the device metrics. :meth:`Agent.tick` runs a pass when the desired-layout files changed
or the interval elapsed; :meth:`Agent.run` repeats ticks until told to stop; a second thread
feeds XID events from the backend into the plugin's health.

Safety rule: when the kubelet cannot be asked which devices pods hold, :class:`FailClosed` says
every MIG device is in use, so nothing is destroyed until it answers again, and it logs so.

Desired layouts come from a nvidia-mig-parted config file with a config name, or with the name
read from a node-labels file (``nvidia.com/mig.config``, as mig-manager reads the node label),
or from nowhere (:class:`KeepLayout`: keep what is there and only advertise). Files are re-read
when their size, mtime or inode change, polled (no inotify dependency). In a cluster they come
from the node's GpuLayout (:class:`~migpilot.agent.cluster.following.GpuLayoutSource`), and a
:class:`PassListener` reports each pass (its status, the Node's labels).

A shell module: it reads and writes files, runs threads and serves metrics and probes over HTTP
(:mod:`migpilot.probes`); it never imports the CLI.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from migpilot import errors, files, probes
from migpilot.agent import metrics, reconciling
from migpilot.agent.deviceplugin import advertising, devices, health, podresources, replicating
from migpilot.agent.rules import changes, desired, labels
from migpilot.agent.sharing import computemodes
from migpilot.agent.sharing import mps as mps_supervision
from migpilot.gpu import backend, clocks
from migpilot.mig import migparted
from migpilot.sharing import config as sharing_config
from migpilot.sharing import labelling
from migpilot.sharing import mps as sharing_mps

_log = logging.getLogger(__name__)


# --- the parts the agent drives ----------------------------------------------------------------


class Plugin(Protocol):
    """What the agent asks of the device plugin (:class:`~deviceplugin.serving.DevicePlugin`)."""

    def start(self, node: devices.NodeDevices) -> None:
        """Serve and register the resources of ``node``."""
        ...

    def update(self, node: devices.NodeDevices) -> None:
        """Advertise a new view of the node on the open streams."""
        ...

    def report_xid(self, event: health.XidEvent) -> frozenset[str]:
        """Apply an XID event; the device IDs it made Unhealthy."""
        ...

    def advertised(self) -> dict[str, tuple[devices.Device, ...]]:
        """Every served resource and its devices now."""
        ...

    def handed_out(self) -> frozenset[str]:
        """Devices Allocate handed out that the kubelet has not shown released."""
        ...

    def mps_daemons(self) -> tuple[sharing_mps.MpsDaemon, ...]:
        """The MPS control daemons the advertised resources need (none without MPS sharing)."""
        ...

    def stop(self) -> None:
        """Stop serving; sockets are removed."""
        ...


class HandedOut:
    """The plugin's Allocate ledger as an in-use source."""

    def __init__(self, plugin: Plugin) -> None:
        self._plugin = plugin

    def in_use(self) -> frozenset[str]:
        """Devices handed out and not yet released."""
        return self._plugin.handed_out()


def every_uuid(gpus: backend.GpuBackend) -> frozenset[str]:
    """Every MIG device UUID on the backend's MIG-enabled GPUs, and every GPU's own UUID (a
    source that cannot be asked then keeps every GPU's MIG mode as it is, too)."""
    out: set[str] = set()
    for info in gpus.gpus():
        out.add(info.uuid)
        if info.mig is None or not info.mig.current or info.model is None:
            continue
        out.update(d.uuid for d in gpus.mig_devices(info.index) if d.uuid is not None)
    return frozenset(out)


class FailClosed:
    """An in-use source that, when it cannot be asked, says that everything is in use.

    ``failures`` are the exceptions that mean "cannot be asked" (e.g. the kubelet's
    PodResources API is down); then ``everything()`` is returned, so the reconciler destroys
    nothing, and a warning says so once per outage.
    """

    def __init__(
        self,
        source: reconciling.InUse,
        *,
        everything: Callable[[], frozenset[str]],
        failures: tuple[type[Exception], ...],
        what: str,
    ) -> None:
        self._source = source
        self._everything = everything
        self._failures = failures
        self._what = what
        self._lock = threading.Lock()
        self._down = False

    @property
    def down(self) -> bool:
        """True while the source cannot be asked."""
        with self._lock:
            return self._down

    def in_use(self) -> frozenset[str]:
        """The source's answer, or every device when it has none."""
        try:
            got = self._source.in_use()
        except self._failures as err:
            with self._lock:
                was_down, self._down = self._down, True
            if not was_down:
                _log.warning(
                    "%s cannot be asked (%s): treating every MIG device as in use; "
                    "nothing is destroyed until it answers",
                    self._what,
                    err,
                )
            return self._everything()
        with self._lock:
            was_down, self._down = self._down, False
        if was_down:
            _log.info("%s answers again", self._what)
        return got


class PodResourcesInUse:
    """The kubelet's PodResources as an in-use source that fails at once without its socket.

    The gRPC client waits for the socket up to its timeout; when the file is not there at all
    (no kubelet, or one restarting) waiting is pointless, so this raises
    :class:`~podresources.PodResourcesError` straight away.
    """

    def __init__(self, source: reconciling.InUse, *, socket_path: Path) -> None:
        self._source = source
        self._socket_path = socket_path

    def in_use(self) -> frozenset[str]:
        """The kubelet's answer; :class:`~podresources.PodResourcesError` if there is none."""
        if not self._socket_path.exists():
            raise podresources.PodResourcesError(f"socket {self._socket_path} is missing")
        return self._source.in_use()


# --- where desired layouts come from -----------------------------------------------------------


FileStamp = tuple[int, int, int] | None
"""(inode, size, mtime ns) of a file, ``None`` when it is missing: changes when it is rewritten."""


def file_stamp(path: Path) -> FileStamp:
    """The stamp of ``path`` now."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class DesiredSource(Protocol):
    """Where the desired layout per GPU comes from."""

    def fingerprint(self) -> Hashable:
        """A cheap value that changes when the inputs change (file stamps)."""
        ...

    def desired(
        self,
        *,
        gpus: Sequence[backend.GpuInfo],
        current: Mapping[int, Sequence[backend.MigDevice]],
        in_use: frozenset[str],
    ) -> dict[int, changes.DesiredGpu]:
        """The desired layouts now; a :class:`MigpilotError` (or ``OSError``) if unreadable."""
        ...

    def describe(self) -> str:
        """One line for the log: where layouts come from."""
        ...


class KeepLayout:
    """No desired layout: keep the instances there are and only advertise them."""

    def fingerprint(self) -> Hashable:
        """Never changes."""
        return None

    def desired(
        self,
        *,
        gpus: Sequence[backend.GpuInfo],
        current: Mapping[int, Sequence[backend.MigDevice]],
        in_use: frozenset[str],
    ) -> dict[int, changes.DesiredGpu]:
        """Nothing: every GPU is left as it is."""
        return {}

    def describe(self) -> str:
        """For the log."""
        return "no desired layout: keeping the MIG instances there are"


class AlsoWatching:
    """A desired source whose fingerprint also changes with other inputs (the simulated
    kubelet's pods), so that a change of those makes a pass due at once."""

    def __init__(self, source: DesiredSource, *others: Callable[[], Hashable]) -> None:
        self._source = source
        self._others = others

    def fingerprint(self) -> Hashable:
        """The source's fingerprint and the others'."""
        return (self._source.fingerprint(), *(f() for f in self._others))

    def desired(
        self,
        *,
        gpus: Sequence[backend.GpuInfo],
        current: Mapping[int, Sequence[backend.MigDevice]],
        in_use: frozenset[str],
    ) -> dict[int, changes.DesiredGpu]:
        """The source's layouts."""
        return self._source.desired(gpus=gpus, current=current, in_use=in_use)

    def describe(self) -> str:
        """The source's description."""
        return self._source.describe()


def parse_labels(text: str, *, source: str) -> dict[str, str]:
    """``key=value`` lines (values optionally double-quoted, as the downward API writes them).

    Blank lines and ``#`` comments are skipped; a line without ``=`` is a
    :class:`AgentConfigError`.
    """
    out: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise errors.AgentConfigError(f"{source}: line {number} is not key=value: {line!r}")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] == '"':
            value = value[1:-1]
        out[key.strip()] = value
    return out


class MigPartedConfig:
    """Desired layouts from a mig-parted config file and a config name.

    The name is given (``name``) or read from the ``nvidia.com/mig.config`` line of a labels
    file (``labels_path``); without that label nothing is reconfigured. Both files are re-read
    on every call, so edits take effect at the next pass.
    """

    def __init__(
        self, path: Path, *, name: str | None = None, labels_path: Path | None = None
    ) -> None:
        if (name is None) == (labels_path is None):
            raise errors.AgentConfigError(
                "a mig-parted config needs exactly one of a config name or a node-labels file"
            )
        self._path = path
        self._name = name
        self._labels_path = labels_path

    def fingerprint(self) -> Hashable:
        """The stamps of the config file and the labels file."""
        labels_stamp = file_stamp(self._labels_path) if self._labels_path is not None else None
        return (file_stamp(self._path), labels_stamp)

    def config_name(self) -> str | None:
        """The config to apply now (``None``: the labels file names none)."""
        if self._labels_path is None:
            return self._name
        text = _read_text(self._labels_path)
        found = parse_labels(text, source=str(self._labels_path))
        return desired.config_name_from_labels(found)

    def load(self) -> migparted.ConfigFile:
        """The config file, parsed."""
        return migparted.parse(_read_text(self._path), source=str(self._path))

    def desired(
        self,
        *,
        gpus: Sequence[backend.GpuInfo],
        current: Mapping[int, Sequence[backend.MigDevice]],
        in_use: frozenset[str],
    ) -> dict[int, changes.DesiredGpu]:
        """The layouts config :meth:`config_name` gives each GPU, keeping instances in place."""
        config = self.load()
        name = self.config_name()
        if name is None:
            return {}
        return desired.from_migparted(config, name, gpus=gpus, current=current, in_use=in_use)

    def describe(self) -> str:
        """For the log."""
        if self._labels_path is not None:
            return f"mig-parted config {self._path}, name from {desired.CONFIG_LABEL} in " + str(
                self._labels_path
            )
        return f"mig-parted config {self._path}, config {self._name!r}"


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise errors.AgentConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None


class ViewFilter(Protocol):
    """Changes the view before it is advertised (:class:`~unifying.UnifiedPool`: the
    instances set aside for unified pods)."""

    def update(self, view: devices.NodeDevices) -> devices.NodeDevices:
        """The view to advertise."""
        ...


class ViewFilters:
    """Several :class:`ViewFilter` applied in order (the MPS slices, then the unified pool)."""

    def __init__(self, filters: Sequence[ViewFilter]) -> None:
        self._filters = tuple(filters)

    def update(self, view: devices.NodeDevices) -> devices.NodeDevices:
        """The view after each filter."""
        for f in self._filters:
            view = f.update(view)
        return view


class SharingSource(Protocol):
    """The node's sharing config (:class:`~migpilot.agent.sharing.sharingconfig.SharingFollower`):
    re-read when its inputs change, handed to the plugin, its state labelled."""

    def changed(self) -> bool:
        """True when a pass should re-read it."""
        ...

    def refresh(self) -> None:
        """Re-read it and serve it if good; never raises for a bad config."""
        ...

    def current(self) -> sharing_config.Config:
        """The config served now."""
        ...

    def labels(self) -> dict[str, str]:
        """Its state label (``migpilot.io/sharing.state``)."""
        ...


class PassListener(Protocol):
    """Told after every pass what the GPUs hold (:class:`~following.KubeReporter`: status, Node
    labels)."""

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """React to a pass; must not raise for a failure outside the node."""
        ...


@runtime_checkable
class Withholding(Protocol):
    """A part that hands devices to pods (the device plugin, the stand-in kubelet) and can be
    told to hand some to no new pod: MIG devices the reconciler is about to destroy, until the
    pass ends."""

    def withhold(self, device_ids: frozenset[str]) -> None:
        """From now on, give none of ``device_ids`` to a pod that does not hold it already
        (replaces what was withheld before; empty: withhold nothing)."""
        ...


class Listeners:
    """Several :class:`PassListener` told in order."""

    def __init__(self, listeners: Sequence[PassListener]) -> None:
        self._listeners = tuple(listeners)

    def withhold(self, device_ids: frozenset[str]) -> None:
        """Tell each listener that hands out devices (:class:`Withholding`)."""
        for listener in self._listeners:
            if isinstance(listener, Withholding):
                listener.withhold(device_ids)

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Tell each listener."""
        for listener in self._listeners:
            listener.passed(state=state, report=report, labels=labels, view=view)


# --- the view, the labels file -----------------------------------------------------------------


def node_view(state: Mapping[int, changes.GpuState]) -> devices.NodeDevices:
    """The device plugin's view of the GPUs as read from the backend.

    GPUs the catalog does not know are left out (their profiles are unknown); GPU instances
    without their compute instance are not MIG devices yet and are not advertised.
    """
    gpus: list[devices.Gpu] = []
    migs: list[devices.MigDevice] = []
    for index in sorted(state):
        info = state[index].info
        if info.model is None:
            continue
        enabled = info.mig is not None and info.mig.current
        gpus.append(
            devices.Gpu(index, info.uuid, info.model, info.product_name, info.memory_mib, enabled)
        )
        if not enabled:
            continue
        for dev in state[index].devices:
            if dev.uuid is None or dev.ci_id is None:
                continue
            migs.append(
                devices.MigDevice(
                    uuid=dev.uuid,
                    gpu_index=index,
                    profile=info.model.profile_named(dev.profile),
                    start=dev.start,
                    gpu_instance_id=dev.gi_id,
                    compute_instance_id=dev.ci_id,
                )
            )
    return devices.NodeDevices(gpus=tuple(gpus), mig_devices=tuple(migs))


def labels_text(node_labels: Mapping[str, str]) -> str:
    """GFD's feature-file format: one ``key=value`` line per label, sorted by key."""
    return "".join(f"{k}={v}\n" for k, v in sorted(node_labels.items()))


def xid_event(event: backend.XidEvent) -> health.XidEvent:
    """A backend XID event as the plugin's health rules take it."""
    return health.XidEvent(
        gpu_uuid=event.gpu_uuid,
        xid=event.xid,
        gpu_instance_id=event.gi_id,
        compute_instance_id=event.ci_id,
    )


def _not_dynamic() -> bool:
    return False


def device_counts(
    advertised: Mapping[str, Sequence[devices.Device]],
) -> dict[tuple[str, str], int]:
    """``(resource, health) -> count`` of the advertised devices, for the metrics."""
    counts: dict[tuple[str, str], int] = {}
    for resource, devs in advertised.items():
        for d in devs:
            key = (resource, d.health.value)
            counts[key] = counts.get(key, 0) + 1
    return counts


# --- the agent ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """How the agent loop behaves."""

    strategy: devices.MigStrategy = devices.MigStrategy.MIXED
    """MIG strategy the labels follow; the plugin must use the same (default ``mixed``)."""
    interval_s: float = 30.0
    """Seconds between periodic reconciliations (default 30)."""
    watch_s: float = 0.05
    """How often the desired-layout input (files, or the GpuLayout a watch keeps in memory) is
    checked for changes, in seconds (default 0.05: a check costs a few stat calls or none, and
    it is most of the delay between a new spec and the agent acting on it)."""
    xid_wait_s: float = 0.5
    """Longest wait for one XID event before checking for shutdown, in seconds (default 0.5)."""
    labels_file: Path | None = None
    """Where the GFD labels are written (``key=value`` lines); ``None``: not written."""
    stall_s: float = 300.0
    """Seconds the loop may go without a round before ``/healthz`` fails (a driver call that
    never returns); a pass making every instance of eight GPUs takes seconds. Default 300."""
    mps_root: str | None = None
    """Host folder of the MPS daemons' folders (``--mps-root``; ``None``: the config's
    ``flags.mpsRoot``, else ``/run/nvidia/mps``). The plugin has its own copy; this one serves a
    node without a plugin (``--kubelet simulated``)."""
    mps_check_s: float = 1.0
    """Seconds between checks of the MPS daemons between passes (a crashed one is restarted
    after its backoff, not at the next pass). Default 1."""


class Agent:
    """The node agent: reconcile, advertise, label, measure; in a loop until stopped.

    ``plugin`` may be ``None`` (``--once``: reconcile and label without serving the kubelet).
    Thread-safe: passes are serialised; the XID thread only talks to the plugin.
    """

    def __init__(
        self,
        *,
        gpus: backend.GpuBackend,
        in_use: reconciling.InUse,
        source: DesiredSource,
        plugin: Plugin | None,
        agent_metrics: metrics.AgentMetrics,
        clock: clocks.Clock,
        settings: AgentSettings,
        listener: PassListener | None = None,
        view_filter: ViewFilter | None = None,
        sharing: SharingSource | None = None,
        mps: mps_supervision.MpsSupervisor | None = None,
        dynamic_mig: Callable[[], bool] | None = None,
    ) -> None:
        self._backend = gpus
        self._sharing = sharing
        self._mps = mps
        self._dynamic_mig: Callable[[], bool] = (
            dynamic_mig if dynamic_mig is not None else _not_dynamic
        )
        self._modes = computemodes.ComputeModeKeeper(gpus) if mps is not None else None
        """Puts the MPS daemons' GPUs in EXCLUSIVE_PROCESS around the supervisor's passes."""
        self._mps_checked: float | None = None
        self._mps_state_changed = False
        self._mps_state: str | None = None
        """The daemons' state word (:func:`~migpilot.agent.sharing.mps.sharing_state`) last
        labelled."""
        self._listener = listener
        self._view_filter = view_filter
        self._in_use = in_use
        self._source = source
        self._plugin = plugin
        self._metrics = agent_metrics
        self._clock = clock
        self.settings = settings
        self._reconciler = reconciling.Reconciler(
            gpus,
            in_use,
            clock=clock,
            agent_metrics=agent_metrics,
            # The node's migpilot.io/mig-mode=dynamic label (absent: modes are never switched).
            dynamic_mig=self._dynamic_mig,
            withdraw=self._withdraw,
            withhold=self._withhold,
        )
        self._withheld: frozenset[str] = frozenset()
        """MIG devices this pass is destroying or has destroyed: handed to no new pod until
        the pass's end has advertised the view without them."""
        self._withheld_lock = threading.Lock()
        """:meth:`_withhold` is called from the reconciler's per-GPU threads."""
        self._mig_mode_state: str | None = None
        """``migpilot.io/mig-mode.state`` for the labels (None: the node is not dynamic)."""
        self._last_report: changes.Report | None = None
        self._pass_lock = threading.Lock()
        self._started = False
        self._last_pass: float | None = None
        self._last_fingerprint: Hashable = None
        self._last_refusals: frozenset[str] = frozenset()
        self._last_labels: str | None = None
        self._config_state: str | None = None
        """``nvidia.com/mig.config.state`` for the labels file (None: no layout is asked for)."""
        self._view = devices.NodeDevices(gpus=())
        self._stopping = threading.Event()
        self._xid_thread: threading.Thread | None = None
        self.heartbeat = probes.Heartbeat(clock.monotonic, stall_s=settings.stall_s)
        """Beats once per round of :meth:`run`; ``/healthz`` reads it."""

    def not_ready(self) -> str | None:
        """``None`` once the first pass is done (``/readyz``), else why not."""
        return None if self._last_pass is not None else "the first pass has not finished"

    # -- one pass ----------------------------------------------------------------------------
    def reconcile(self) -> changes.Report:
        """One pass: desired layouts, reconcile, advertise, labels, metrics."""
        with self._pass_lock:
            self._last_fingerprint = self._source.fingerprint()
            self._last_pass = self._clock.monotonic()
            if self._sharing is not None:
                self._sharing.refresh()  # before the view is published: one change, not two
            want, unavailable = self._desired()
            report = self._reconciler.reconcile(want)
            self._last_report = report
            self._log_report(report)
            self._config_state = (
                labels.config_state(report, unavailable=unavailable)
                if want or unavailable
                else None
            )
            state = self._reconciler.read()
            self._mig_mode_state = (
                labels.mig_mode_state(report, state=state, desired=want)
                if self._dynamic_mig()
                else None
            )
            view = node_view(state)
            if self._view_filter is not None:
                view = self._view_filter.update(view)
            self._publish(view)
            self._supervise_mps()
            if self._listener is not None:
                self._listener.passed(
                    state=state,
                    report=report,
                    labels=self._node_labels(self._view),
                    view=self._view,
                )
            with self._withheld_lock:
                if self._withheld:
                    # The view just advertised no longer has the destroyed devices.
                    self._tell_withheld(frozenset())
            return report

    def _withhold(self, device_ids: frozenset[str]) -> None:
        """The reconciler is about to destroy ``device_ids``: the device plugin and the
        stand-in kubelet give them to no new pod from now until the pass's end. Without it a
        pod bound mid-pass was given, from the view advertised before the pass, an instance
        the pass destroyed (the 35-minute soak's used-destroyed)."""
        with self._withheld_lock:
            self._tell_withheld(self._withheld | device_ids)

    def _tell_withheld(self, device_ids: frozenset[str]) -> None:
        self._withheld = device_ids
        if isinstance(self._plugin, Withholding):
            self._plugin.withhold(device_ids)
        if isinstance(self._listener, Withholding):
            self._listener.withhold(device_ids)

    def _withdraw(self, indexes: frozenset[int]) -> None:
        """Stop advertising the GPUs ``indexes`` (their MIG mode is about to be switched; the
        pass lock is held): the plugin and the listeners (the stand-in kubelet) are told a view
        without them, so no pod is given them meanwhile. The pass's end advertises them again
        in their new mode."""
        view = devices.without_gpus(self._view, indexes)
        _log.info("GPU %s not advertised while its MIG mode is switched",
                  ", ".join(str(i) for i in sorted(indexes)))  # fmt: skip
        self._publish(view)
        if self._listener is not None:
            self._listener.passed(
                state=self._reconciler.read(),
                report=self._last_report,
                labels=self._node_labels(view),
                view=view,
            )

    def _supervise_mps(self) -> None:
        """Start, restart or stop the MPS daemons the advertised resources need (pass lock
        held). A daemon that cannot be had is the supervisor's to retry; it never stops a pass.
        Their GPUs are put in EXCLUSIVE_PROCESS first (a daemon whose GPU cannot be set does not
        start) and given back to DEFAULT once no kept daemon shares them."""
        if self._mps is None or self._modes is None:
            return
        self._mps_checked = self._clock.monotonic()
        try:
            wanted = [mps_supervision.spec_of(d) for d in self._wanted_daemons()]
        except errors.MigpilotError as err:
            _log.error("MPS daemons not started: %s", err)
            wanted = []
        blocked = self._modes.prepare(wanted)
        statuses = self._mps.reconcile(wanted, blocked=blocked)
        self._modes.release(self._mps.kept())
        self._mps_state = mps_supervision.sharing_state(statuses) if statuses else None

    def _wanted_daemons(self) -> tuple[sharing_mps.MpsDaemon, ...]:
        """The daemons the advertised resources need: the plugin's, or without a plugin (the
        simulated kubelet) what it would advertise under the sharing config now (and the
        daemons of the GpuLayout's MPS slices)."""
        if self._plugin is not None:
            return self._plugin.mps_daemons()
        if self._sharing is None and not self._view.mps_slices:
            return ()
        try:
            plain = advertising.resources_for(self._view, self.settings.strategy)
        except advertising.InvalidMigConfigurationError:
            return ()
        config = self._sharing.current() if self._sharing is not None else sharing_config.EMPTY
        shared = replicating.share(plain, self._view, config, mps_root=self.settings.mps_root)
        return shared.daemons

    def mps_statuses(self) -> tuple[mps_supervision.DaemonStatus, ...]:
        """The MPS daemons the supervisor keeps, as last seen."""
        return self._mps.statuses() if self._mps is not None else ()

    def _desired(self) -> tuple[dict[int, changes.DesiredGpu], bool]:
        """The desired layouts, and whether they could not be had (an error, logged)."""
        state = self._reconciler.read()
        try:
            want = self._source.desired(
                gpus=[s.info for s in state.values()],
                current={g: s.devices for g, s in state.items()},
                in_use=self._in_use.in_use(),
            )
        except (errors.MigpilotError, OSError) as err:
            detail = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            where = f": {err.filename}" if isinstance(err, OSError) and err.filename else ""
            _log.error("desired layout unavailable, changing nothing: %s%s", detail, where)
            return {}, True
        return want, False

    def _log_report(self, report: changes.Report) -> None:
        for applied in report.applied:
            if applied.outcome is changes.Outcome.DONE:
                _log.info("%s", applied.change)
            elif applied.outcome is changes.Outcome.REFUSED:
                _log.warning("%s refused: %s", applied.change, applied.detail)
            else:
                _log.error("%s failed: %s", applied.change, applied.detail)
        refusals = tuple(dict.fromkeys(str(r) for r in report.refusals))
        for text in refusals:
            # Reported once at WARNING while it lasts; every pass repeats it at DEBUG.
            level = logging.DEBUG if text in self._last_refusals else logging.WARNING
            _log.log(level, "not done: %s", text)
        self._last_refusals = frozenset(refusals)
        if report.applied:
            done = len(report.outcomes(changes.Outcome.DONE))
            _log.info(
                "reconfigured in %.2f s: %d of %d actions done%s",
                report.duration_s,
                done,
                len(report.applied),
                "" if report.converged else "; not converged, retrying at the next pass",
            )

    def _publish(self, view: devices.NodeDevices) -> None:
        if self._plugin is not None and self._started:
            try:
                self._plugin.update(view)
            except advertising.InvalidMigConfigurationError as err:
                _log.error("new layout not advertised: %s", err)
                return
        self._view = view
        self._write_labels(view)
        self._refresh_device_metrics()

    def _write_labels(self, view: devices.NodeDevices) -> None:
        path = self.settings.labels_file
        if path is None:
            return
        text = labels_text(self._node_labels(view))
        if text == self._last_labels:
            return
        try:
            files.write_atomically(path, text)
        except OSError as err:
            _log.error("cannot write labels to %s: %s", path, err.strerror or err)
            return
        self._last_labels = text
        _log.info("labels written to %s (%d labels)", path, text.count("\n"))

    def _node_labels(self, view: devices.NodeDevices) -> dict[str, str]:
        if self._sharing is None:
            found = labels.node_labels(view, self.settings.strategy)
        else:
            found = labels.node_labels(
                view, self.settings.strategy, sharing=self._sharing.current()
            )
            found |= self._sharing.labels()
        if self._mps_state is not None and found.get(labelling.STATE_LABEL) != "failed":
            # A good config whose daemons are not all running is not yet a working one.
            found[labelling.STATE_LABEL] = self._mps_state
        if self._config_state is not None:
            found[labels.CONFIG_STATE_LABEL] = self._config_state
        if self._mig_mode_state is not None:
            found[labels.MIG_MODE_STATE_LABEL] = self._mig_mode_state
        return found

    def _refresh_device_metrics(self) -> None:
        if self._plugin is not None and self._started:
            self._metrics.set_devices(device_counts(self._plugin.advertised()))
            return
        try:
            advertised = advertising.resources_for(self._view, self.settings.strategy)
        except advertising.InvalidMigConfigurationError:
            advertised = ()  # the single strategy would advertise nothing
        self._metrics.set_devices(device_counts({r.name: r.devices for r in advertised}))

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> changes.Report:
        """The first pass, then serve the plugin with its result and start the XID thread.

        Raises :class:`advertising.InvalidMigConfigurationError` when the single strategy
        cannot advertise the node (NVIDIA's plugin refuses to start too).
        """
        _log.info("desired layouts: %s", self._source.describe())
        report = self.reconcile()
        if self._plugin is None:
            return report
        with self._pass_lock:
            self._plugin.start(self._view)
            self._started = True
            self._refresh_device_metrics()
            self._supervise_mps()  # the plugin knows its resources now
        self._stopping.clear()
        self._xid_thread = threading.Thread(
            target=self._pump_xids, name="migpilot-xid", daemon=True
        )
        self._xid_thread.start()
        return report

    def _check_mps(self) -> None:
        if self._mps is None or self._mps_checked is None:
            return
        if self._clock.monotonic() - self._mps_checked < self.settings.mps_check_s:
            return
        labelled = self._mps_state
        with self._pass_lock:
            self._supervise_mps()
            if self._mps_state != labelled:
                self._mps_state_changed = True

    def due(self) -> bool:
        """True when a pass is due: the inputs changed or the interval elapsed."""
        if self._last_pass is None:
            return True
        if self._source.fingerprint() != self._last_fingerprint:
            return True
        if self._sharing is not None and self._sharing.changed():
            return True
        return self._clock.monotonic() - self._last_pass >= self.settings.interval_s

    def tick(self) -> changes.Report | None:
        """Run a pass if one is due; its report, or ``None``. Between passes the MPS daemons
        are checked every :attr:`AgentSettings.mps_check_s`; a change of their state word
        makes a pass due (the labels and the Node say it at once)."""
        if not self.due():
            self._check_mps()
            if not self._mps_state_changed:
                return None
        self._mps_state_changed = False
        if self._source.fingerprint() != self._last_fingerprint and self._last_pass is not None:
            _log.info("desired-layout input changed: reconciling")
        return self.reconcile()

    def run(self, stop: threading.Event) -> None:
        """Tick until ``stop`` is set, checking inputs every ``watch_s`` seconds."""
        while not stop.is_set():
            self.heartbeat.beat()
            try:
                self.tick()
            except backend.BackendError as err:
                _log.error("GPU backend failed, retrying at the next pass: %s", err)
            stop.wait(self.settings.watch_s)

    def pump_xid(self, timeout_s: float) -> frozenset[str]:
        """Wait up to ``timeout_s`` for one XID event and apply it; the devices it took down."""
        event = self._backend.wait_xid(timeout_s)
        if event is None or self._plugin is None:
            return frozenset()
        hit = self._plugin.report_xid(xid_event(event))
        if hit:
            with self._pass_lock:
                self._refresh_device_metrics()
        return hit

    def _pump_xids(self) -> None:
        while not self._stopping.is_set():
            try:
                self.pump_xid(self.settings.xid_wait_s)
            except backend.BackendError as err:
                _log.error("waiting for XID events failed: %s", err)
                self._stopping.wait(self.settings.xid_wait_s)

    def stop(self) -> None:
        """Stop the XID thread and the plugin (its sockets are removed)."""
        self._stopping.set()
        thread, self._xid_thread = self._xid_thread, None
        if thread is not None:
            thread.join()
        if self._plugin is not None and self._started:
            self._plugin.stop()
            self._started = False

    def view(self) -> devices.NodeDevices:
        """The node as last advertised."""
        with self._pass_lock:
            return self._view


# --- metrics and probes over HTTP --------------------------------------------------------------


class MetricsServer:
    """The agent's metrics (its own registry) and its probes, served over HTTP
    (:mod:`migpilot.probes`): ``/healthz`` fails when :meth:`Agent.run` stalls, ``/readyz`` until
    the first pass is done."""

    def __init__(
        self,
        agent_metrics: metrics.AgentMetrics,
        *,
        port: int,
        address: str,
        live: probes.Check = probes.ok,
        ready: probes.Check = probes.ok,
    ) -> None:
        self._endpoint = probes.Endpoint(
            agent_metrics.registry, port=port, address=address, live=live, ready=ready
        )
        self.port: int = self._endpoint.port
        _log.info("metrics on http://%s:%d/metrics", address or "0.0.0.0", self.port)

    def close(self) -> None:
        """Stop serving."""
        self._endpoint.close()
