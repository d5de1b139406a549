"""The agent's GPU sampling loop: read the GPUs once per interval, serve the cache to every scrape.

Why it exists: a scrape must not reach the driver (Prometheus scrapes every 15-30 s, often from
two replicas, and GPM needs two samples an interval apart), so :class:`GpuSampler` samples every
GPU once per ``--gpu-metrics-interval`` (:meth:`~migpilot.gpu.backend.GpuBackend.sample`, read
only), asks who holds which device (the kubelet's PodResources, or the simulated kubelet), maps
each process to its pod (``/proc/<pid>/cgroup``, or the emulated backend's own answer) and puts
the rows :func:`usage.series` builds into :class:`~metrics.AgentMetrics`. A pod that is gone is
not in the next pass, so its series are gone within one interval.

:class:`LoadFile` is the ``--emulated-load`` file, watched by its stamp (inode, size, mtime) as
the agent watches its other files: checked every second, a change samples at once.

A shell module: it reads files and runs a thread; it imports no Kubernetes client, no gRPC.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from migpilot import errors, logs
from migpilot.agent import metrics, usage
from migpilot.agent.deviceplugin import devices
from migpilot.api import gpulayouts
from migpilot.gpu import backend, emulated

_log = logging.getLogger(__name__)

Holdings = Callable[[], Sequence[usage.Holding]]
"""Who holds which device now; may raise (the last answer is then kept)."""
Owners = Callable[[Sequence[backend.ProcessSample]], Mapping[int, str] | None]
"""pid -> ``namespace/name`` for the processes given; ``None``: processes cannot be
attributed on this node."""
Replicas = Callable[[], Mapping[int, Sequence[gpulayouts.ReplicaStatus]]]
"""GPU index -> its time-slicing replicas' statuses now (none on a node not time-sliced)."""

LOAD_CHECK_S = 1.0
"""How often the load file's stamp is checked, in seconds."""

FileStamp = tuple[int, int, int] | None


def _stamp(path: Path) -> FileStamp:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class LoadFile:
    """The ``--emulated-load`` file, re-read when its stamp changes. Thread-safe.

    :meth:`load` at start raises :class:`~migpilot.errors.AgentConfigError` for a bad or missing
    file; later a bad file keeps the last good loads and is logged once per change.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: FileStamp = None
        self._loads: dict[str, usage.PodLoad] = {}
        self._lock = threading.Lock()

    def load(self) -> None:
        """Read the file now; an error naming the file and the field if it is bad."""
        stamp = _stamp(self.path)
        try:
            text = self.path.read_text(encoding="utf-8")
        except OSError as err:
            raise errors.AgentConfigError(
                f"--emulated-load {self.path}: {err.strerror or err}"
            ) from None
        loads = usage.parse_load(text, source=str(self.path))
        with self._lock:
            self._stamp, self._loads = stamp, loads

    def poll(self) -> bool:
        """Re-read the file if it changed; whether the loads changed."""
        stamp = _stamp(self.path)
        with self._lock:
            if stamp == self._stamp:
                return False
            before = self._loads
        try:
            self.load()
        except errors.AgentConfigError as err:
            with self._lock:
                self._stamp = stamp  # logged once: not again until the file changes
            _log.error("emulated load not changed, keeping the last good one: %s", err)
            return False
        return self.current() != before

    def current(self) -> dict[str, usage.PodLoad]:
        """``namespace/name`` -> its load (the last good file's)."""
        with self._lock:
            return dict(self._loads)


def resource_of(view: devices.NodeDevices, device_id: str) -> str:
    """The resource a device ID is advertised under (mixed strategy, no renaming)."""
    real = device_id.split("::", 1)[0]
    if device_id in view.unified or real in view.unified:
        return devices.FULL_GPU_RESOURCE
    sl = view.slice_device_ids().get(device_id)
    if sl is not None:
        return sl.resource
    for m in view.mig_devices:
        if m.uuid == real:
            return devices.mig_resource_name(m.profile)
    return devices.FULL_GPU_RESOURCE


def proc_owners(uids: Callable[[], Mapping[str, str]], *, proc: Path = Path("/proc")) -> Owners:
    """Owners from ``/proc/<pid>/cgroup`` (the pod UID) and ``uids`` (UID -> namespace/name)."""

    def owners(processes: Sequence[backend.ProcessSample]) -> Mapping[int, str] | None:
        known = uids()
        out: dict[int, str] = {}
        for p in processes:
            try:
                text = (proc / str(p.pid) / "cgroup").read_text(encoding="utf-8")
            except OSError:
                continue  # exited, or another pid namespace: not attributed
            uid = usage.pod_uid(text)
            if uid is not None and uid in known:
                out[p.pid] = known[uid]
        return out

    return owners


def emulated_owners(gpus: emulated.EmulatedBackend) -> Owners:
    """Owners as the emulated backend made its processes."""

    def owners(processes: Sequence[backend.ProcessSample]) -> Mapping[int, str]:
        return {p.pid: pod for p in processes if (pod := gpus.pod_of(p.pid)) is not None}

    return owners


class _Periodic:
    """What both samplers share: :meth:`sample` every ``interval_s`` in a daemon thread, and
    at once when the ``load`` file changes."""

    interval_s: float
    _load: LoadFile | None

    def sample(self) -> tuple[usage.Row, ...]:
        raise NotImplementedError

    def run(self, stop: threading.Event) -> None:
        """Sample every interval until ``stop``; a changed load file samples at once."""
        _every(self.sample, interval_s=self.interval_s, load=self._load, stop=stop)

    def start(self, stop: threading.Event) -> threading.Thread:
        """Run :meth:`run` in a daemon thread."""
        thread = threading.Thread(
            target=self.run, args=(stop,), name="migpilot-gpu-sampling", daemon=True
        )
        thread.start()
        return thread


class GpuSampler(_Periodic):
    """Sample the GPUs once per interval into the agent's metrics (see the module)."""

    def __init__(
        self,
        *,
        node: str,
        gpus: backend.GpuBackend,
        view: Callable[[], devices.NodeDevices],
        holdings: Holdings,
        sink: metrics.AgentMetrics,
        owners: Owners,
        interval_s: float = 5.0,
        in_use: Callable[[], frozenset[str]] = frozenset,
        reserved: Callable[[], frozenset[str]] = frozenset,
        replicas: Replicas = dict,
        load: LoadFile | None = None,
        driven: emulated.EmulatedBackend | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be more than 0, got {interval_s}")
        self.node = node
        """The node it samples (its series' ``node`` label, its log lines' ``node`` field)."""
        self._gpus = gpus
        self._view = view
        self._holdings = holdings
        self._sink = sink
        self._owners = owners
        self.interval_s = interval_s
        self._in_use = in_use
        self._reserved = reserved
        self._replicas = replicas
        self._load = load
        self._driven = driven
        self._held: Sequence[usage.Holding] = ()
        self._failed: str | None = None

    def sample(self) -> tuple[usage.Row, ...]:
        """One pass: read every GPU of the view, build the rows, publish them."""
        rows = self.read()
        self._sink.set_usage(rows)
        return rows

    def read(self) -> tuple[usage.Row, ...]:
        """Read every GPU of the view and build the rows, without publishing them (a
        :class:`FleetSampler` publishes every node's together)."""
        view = self._view()
        try:
            self._held = tuple(self._holdings())
        except Exception as err:  # the kubelet restarting: keep the last answer
            _log.debug(
                "who holds which device is unknown now, keeping the last: %s",
                err,
                extra=logs.about(node=self.node),
            )
        if self._driven is not None:
            loads = usage.device_loads(
                self._load.current() if self._load is not None else {}, self._held
            )
            self._driven.drive(lambda: loads)
        samples: dict[int, backend.GpuSample] = {}
        for g in view.gpus:
            try:
                samples[g.index] = self._gpus.sample(g.index)
            except backend.BackendError as err:
                if self._failed != str(err):
                    _log.error(
                        "GPU %d not sampled: %s", g.index, err, extra=logs.about(node=self.node)
                    )
                self._failed = str(err)
        processes = [p for s in samples.values() for p in s.processes or ()]
        return usage.series(
            node=self.node,
            view=view,
            holdings=self._held,
            samples=samples,
            owners=self._owners(processes),
            in_use=self._in_use(),
            reserved=self._reserved(),
            replicas=self._replicas(),
        )


class FleetSampler(_Periodic):
    """One sampler for the many nodes of ``migpilot fleet``: every node's
    :meth:`GpuSampler.read` in one pass, published together into the fleet's one registry
    (a node's own :meth:`GpuSampler.sample` would replace the others' rows). ``nodes`` gives
    the samplers of the nodes the fleet runs now: a node gone is not in the next pass, nor
    its series. The nodes' samplers share the ``load`` file; this one polls it."""

    def __init__(
        self,
        *,
        nodes: Callable[[], Sequence[GpuSampler]],
        sink: metrics.AgentMetrics,
        interval_s: float = 5.0,
        load: LoadFile | None = None,
    ) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be more than 0, got {interval_s}")
        self._nodes = nodes
        self._sink = sink
        self.interval_s = interval_s
        self._load = load

    def sample(self) -> tuple[usage.Row, ...]:
        """One pass over every node; a node whose reading fails is logged and left out."""
        rows: list[usage.Row] = []
        for sampler in self._nodes():
            with logs.concerning(node=sampler.node):  # what its callbacks log concerns it too
                try:
                    rows.extend(sampler.read())
                except Exception:  # one node's bug must not hide the others' series
                    _log.exception("GPU sampling of node %s failed", sampler.node)
        out = tuple(sorted(rows, key=lambda r: (r.name, r.labels)))
        self._sink.set_usage(out)
        return out


def _every(
    sample: Callable[[], object],
    *,
    interval_s: float,
    load: LoadFile | None,
    stop: threading.Event,
) -> None:
    """Call ``sample`` every ``interval_s`` until ``stop``; a changed ``load`` file (checked
    every :data:`LOAD_CHECK_S`) calls it at once."""
    while not stop.is_set():
        try:
            sample()
        except Exception:  # a sampling bug must not take the agent down
            _log.exception("GPU sampling pass failed")
        waited = 0.0
        while waited < interval_s and not stop.is_set():
            step = min(LOAD_CHECK_S, interval_s - waited)
            if stop.wait(step):
                return
            waited += step
            if load is not None and load.poll():
                break


def pod_resources_holdings(
    listed: Callable[[], Sequence[object]],
) -> Holdings:
    """Holdings from the kubelet's PodResources ``List`` (``ContainerDevices`` entries) of the
    ``nvidia.com/`` resources."""

    def holdings() -> list[usage.Holding]:
        out: list[usage.Holding] = []
        for entry in listed():
            resource = str(getattr(entry, "resource_name", ""))
            if not resource.startswith(f"{devices.RESOURCE_DOMAIN}/"):
                continue
            for device_id in getattr(entry, "device_ids", ()):
                out.append(
                    usage.Holding(
                        namespace=str(getattr(entry, "namespace", "")),
                        pod=str(getattr(entry, "pod", "")),
                        container=str(getattr(entry, "container", "")),
                        resource=resource,
                        device_id=str(device_id),
                    )
                )
        return out

    return holdings


def assigned_holdings(
    assigned: Callable[[], Mapping[str, Sequence[str]]],
    containers: Callable[[], Mapping[str, Sequence[tuple[str, Sequence[str]]]]],
    view: Callable[[], devices.NodeDevices],
) -> Holdings:
    """Holdings from the simulated kubelet: pod -> device IDs (``assigned``), with the container
    names Allocate of ``nvidia.com/gpu`` recorded (``containers``; others unnamed)."""

    def holdings() -> list[usage.Holding]:
        node = view()
        named = {
            (pod, device_id): name
            for pod, items in containers().items()
            for name, ids in items
            for device_id in ids
        }
        out: list[usage.Holding] = []
        for pod, ids in sorted(assigned().items()):
            namespace, _, name = pod.partition("/")
            for device_id in ids:
                out.append(
                    usage.Holding(
                        namespace=namespace,
                        pod=name,
                        container=named.get((pod, device_id), ""),
                        resource=resource_of(node, device_id),
                        device_id=device_id,
                    )
                )
        return out

    return holdings
