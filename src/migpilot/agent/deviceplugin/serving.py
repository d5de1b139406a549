"""The device plugin's gRPC shell: one server per resource, registration, kubelet restarts.

Each advertised resource gets its own ``DevicePlugin`` gRPC server on a unix socket in the
kubelet's device-plugin folder (``nvidia-<name>.sock``, NVIDIA's names) and registers with the
kubelet's ``Registration`` service on ``kubelet.sock``. :meth:`DevicePlugin.update` takes a new
view of the node: open ListAndWatch streams get the new list at once; a resource that lost its
last device keeps its server and advertises zero devices; a new resource gets a new server that
registers on its own, the others untouched. A watcher notices when ``kubelet.sock`` is
recreated (the kubelet restarted): servers whose socket the kubelet removed are started again,
and every resource registers again.

The servicer only decodes, calls the sans-IO core (``advertising``, ``allocating``,
``health``, ``allocations``, ``resolving``) and encodes. With a :class:`UnifiedSource`
(``docs/unified.md``), Allocate of ``nvidia.com/gpu`` is resolved to a pod
(:func:`resolving.resolve`) one call at a time under a lock, and the answer is recorded in the
ledger, on disk, before it is sent; when no pod is known for it yet, the node's pods are read
again from the API and the call waits up to ``allocate_wait_s`` before failing. A unified pod
whose reservation is an MPS slice (a node in mode ``mps``) gets the slice's MPS answer
(:func:`slices.container_allocation`), not a MIG device's. With a :class:`CdiSink` (the
cdi-cri strategy, ``docs/cdi.md``) the CDI spec of a view is written before any server publishes
it, and a device it has no entry for is advertised Unhealthy. MIG devices the agent is
destroying are withheld (:meth:`DevicePlugin.withhold`) until its pass ends: left out of the
lists sent, and an Allocate naming one is refused as an unknown device, the check and the
ledger's record made under the lock withhold takes, so the reconciler's in-use check that
follows a withhold sees every device handed out before it. This module
and ``podresources`` are the only ones that speak to the kubelet.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from migpilot import errors, files, logs
from migpilot.agent.deviceplugin import (
    advertising,
    allocating,
    allocations,
    devices,
    health,
    replicating,
    resolving,
    slices,
)
from migpilot.agent.kubeletapi.deviceplugin.v1beta1 import api_pb2, api_pb2_grpc
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps, replicas

API_VERSION = "v1beta1"
"""The device-plugin API version the kubelet must support."""
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_PLUGIN_DIR = pathlib.Path("/var/lib/kubelet/device-plugins")

_log = logging.getLogger(__name__)

SocketIdentity = tuple[int, int, int]
"""(device, inode, ctime ns) of a socket file: changes when the file is recreated."""


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """Settings of the device plugin."""

    plugin_dir: pathlib.Path = DEFAULT_PLUGIN_DIR
    """The kubelet's device-plugin folder (default ``/var/lib/kubelet/device-plugins``)."""
    strategy: devices.MigStrategy = devices.MigStrategy.MIXED
    """How MIG devices are advertised (default ``mixed``)."""
    allocate: allocating.AllocateSettings = field(default_factory=allocating.AllocateSettings)
    """How Allocate names devices (default: ``NVIDIA_VISIBLE_DEVICES``)."""
    xids: health.XidPolicy = field(default_factory=health.XidPolicy)
    """Which XIDs make a device Unhealthy (default: all but NVIDIA's ignored list)."""
    kubelet_poll_s: float = 0.5
    """How often ``kubelet.sock`` is checked for a kubelet restart, in seconds (default 0.5)."""
    rpc_timeout_s: float = 5.0
    """Timeout of each call to the kubelet, in seconds (default 5)."""
    allocation_grace_s: float = 300.0
    """How long an allocated device the kubelet never lists stays held, s (default 300)."""
    ledger_file: pathlib.Path | None = None
    """Where the ledger of devices handed out is kept, so that an agent restart remembers them
    (read at start, rewritten durably after every change); ``None``: in memory only."""
    allocate_wait_s: float = 5.0
    """How long an Allocate of ``nvidia.com/gpu`` for which no pod is known yet waits for the
    pod (the agent's pod watch lagging behind the kubelet), reading the node's pods from the
    API again, before it fails; seconds (default 5)."""
    allocate_poll_s: float = 0.2
    """Seconds between two reads of the node's pods while such an Allocate waits (default 0.2)."""
    sharing: sharing_config.Config = sharing_config.EMPTY
    """The sharing config at start (NVIDIA's time-slicing / MPS; default: none); changed later
    with :meth:`DevicePlugin.set_sharing`."""
    mps_root: str | None = None
    """The MPS root on the host (default: the config's ``flags.mpsRoot``, else
    ``/run/nvidia/mps``)."""

    @property
    def kubelet_socket(self) -> pathlib.Path:
        """The kubelet's registration socket."""
        return self.plugin_dir / KUBELET_SOCKET


class UnifiedSource(Protocol):
    """Where the plugin learns the node's pods and reservations (``agent/unifying.py``)."""

    def inputs(self, *, fresh: bool) -> resolving.Inputs:
        """The inputs now; ``fresh``: read the node's pods from the API first (the watch may
        lag). Never raises for an API failure (it answers with what it has)."""
        ...


class CdiSink(Protocol):
    """Where the CDI spec of what the plugin advertises is written (``cdifiles.CdiWriter``)."""

    def write(
        self, node: devices.NodeDevices, resources: tuple[devices.Resource, ...]
    ) -> frozenset[str]:
        """Write the spec of ``resources``; the device IDs it has no entry for."""
        ...


def socket_identity(path: pathlib.Path) -> SocketIdentity | None:
    """The identity of the file at ``path``, or None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)


def held_key(device_id: str) -> str:
    """What the ledger and the kubelet's in-use set hold a device as: an MPS slice by its own
    ID (a pod holds one slice, not the GPU), a replica as its real device."""
    return device_id if devices.is_slice_id(device_id) else replicas.real_id(device_id)


def _unhealthy(
    resources: tuple[devices.Resource, ...], ids: frozenset[str]
) -> tuple[devices.Resource, ...]:
    """``resources`` with the devices ``ids`` Unhealthy."""
    if not ids:
        return resources
    return tuple(
        devices.Resource(
            r.name,
            tuple(
                devices.Device(d.id, d.gpu_index, devices.Health.UNHEALTHY) if d.id in ids else d
                for d in r.devices
            ),
        )
        for r in resources
    )


def _encode_devices(resource: devices.Resource) -> Any:
    return api_pb2.ListAndWatchResponse(
        devices=[api_pb2.Device(ID=d.id, health=d.health.value) for d in resource.devices]
    )


class _ResourceServer:
    """One resource's gRPC server and the list its ListAndWatch streams send."""

    def __init__(
        self,
        resource: devices.Resource,
        plugin: DevicePlugin,
        *,
        withheld: frozenset[str] = frozenset(),
    ) -> None:
        self.name = resource.name
        self.socket_path = plugin.settings.plugin_dir / resource.socket_name
        self._plugin = plugin
        self._cond = threading.Condition()
        self._resource = resource
        self._withheld = withheld
        """Devices (by :func:`held_key`) left out of the list the streams send: the agent is
        destroying them (:meth:`DevicePlugin.withhold`)."""
        self._generation = 0
        self._epoch = 0
        self._server: Any = None
        self._identity: SocketIdentity | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Serve on a fresh socket file."""
        self.socket_path.unlink(missing_ok=True)
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=8))
        api_pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
        server.add_insecure_port(f"unix://{self.socket_path}")
        server.start()
        with self._cond:
            self._server = server
        self._identity = socket_identity(self.socket_path)
        _log.info("serving %s on %s", self.name, self.socket_path)

    def stop(self) -> None:
        """Stop serving: end open streams, remove the socket file if it is still ours."""
        with self._cond:
            server, self._server = self._server, None
            self._epoch += 1
            self._cond.notify_all()
        if server is not None:
            server.stop(grace=None).wait()
        if self._identity is not None and socket_identity(self.socket_path) == self._identity:
            self.socket_path.unlink(missing_ok=True)
        self._identity = None

    def socket_intact(self) -> bool:
        """True while the socket file is the one this server listens on."""
        return self._identity is not None and socket_identity(self.socket_path) == self._identity

    # -- the advertised list -----------------------------------------------------------------
    def publish(self, resource: devices.Resource) -> None:
        """Advertise this list; open streams send it at once if it changed."""
        with self._cond:
            if resource != self._resource:
                self._resource = resource
                self._generation += 1
                self._cond.notify_all()

    def withhold(self, withheld: frozenset[str]) -> None:
        """Leave these devices (by :func:`held_key`) out of the list sent from now on; open
        streams send the new list at once if it changed."""
        with self._cond:
            if withheld != self._withheld:
                before = self._listed()
                self._withheld = withheld
                if self._listed() != before:
                    self._generation += 1
                    self._cond.notify_all()

    def resource(self) -> devices.Resource:
        """The list published now, withheld devices included (Allocate and
        GetPreferredAllocation judge requests by it: a request the kubelet made from the list
        it had is not refused as unknown for a withheld device, but for being withheld)."""
        with self._cond:
            return self._resource

    def listed(self) -> devices.Resource:
        """The list the kubelet is sent now: the published one without withheld devices."""
        with self._cond:
            return self._listed()

    def _listed(self) -> devices.Resource:
        if not self._withheld:
            return self._resource
        return devices.Resource(
            self._resource.name,
            tuple(d for d in self._resource.devices if held_key(d.id) not in self._withheld),
        )

    def watch(self, context: Any) -> Iterator[Any]:
        """The ListAndWatch stream: the list now, then each new list until the RPC ends."""
        with self._cond:
            epoch, generation, resource = self._epoch, self._generation, self._listed()

        def wake() -> None:
            with self._cond:
                self._cond.notify_all()

        context.add_callback(wake)
        yield _encode_devices(resource)
        while True:
            with self._cond:
                while (
                    generation == self._generation and epoch == self._epoch and context.is_active()
                ):
                    self._cond.wait(timeout=1.0)
                if epoch != self._epoch or not context.is_active():
                    return
                generation, resource = self._generation, self._listed()
            yield _encode_devices(resource)

    def allocate(self, request: Any, context: Any) -> Any:
        try:
            answers = self._plugin.allocate_containers(
                self.name, [list(req.devices_ids) for req in request.container_requests]
            )
        except allocating.AllocationError as err:
            _log.warning("Allocate refused: %s", err)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return api_pb2.AllocateResponse(
            container_responses=[
                api_pb2.ContainerAllocateResponse(
                    envs=dict(a.envs),
                    cdi_devices=[api_pb2.CDIDevice(name=n) for n in a.cdi_devices],
                    # Writable (read_only unset): a client writes to its MPS pipe and /dev/shm.
                    mounts=[api_pb2.Mount(container_path=c, host_path=h) for h, c in a.mounts],
                )
                for a in answers
            ]
        )

    def preferred(self, request: Any, context: Any) -> Any:
        resource = self.resource()
        responses = []
        try:
            for req in request.container_requests:
                ids = self._plugin.preferred_devices(
                    resource,
                    available=list(req.available_deviceIDs),
                    must_include=list(req.must_include_deviceIDs),
                    size=req.allocation_size,
                )
                responses.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        except allocating.AllocationError as err:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"error getting list of preferred allocation devices: {err}",
            )
        return api_pb2.PreferredAllocationResponse(container_responses=responses)


class _Servicer:
    """The generated servicer interface, delegating to the resource server."""

    def __init__(self, server: _ResourceServer) -> None:
        self._server = server

    def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:  # noqa: N802
        return api_pb2.DevicePluginOptions(get_preferred_allocation_available=True)

    def ListAndWatch(self, request: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        return self._server.watch(context)

    def GetPreferredAllocation(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self._server.preferred(request, context)

    def Allocate(self, request: Any, context: Any) -> Any:  # noqa: N802
        return self._server.allocate(request, context)

    def PreStartContainer(self, request: Any, context: Any) -> Any:  # noqa: N802
        return api_pb2.PreStartContainerResponse()


class DevicePlugin:
    """The node's device plugin: every resource's server, registration and health.

    Thread-safe. ``start`` serves and registers the resources of the first view and starts
    the kubelet watcher; ``update`` applies a new view; ``report_xid`` applies a health event;
    ``stop`` ends everything. A view that breaks the single strategy's invariants raises
    :class:`advertising.InvalidMigConfigurationError` and changes nothing that is advertised.
    """

    def __init__(
        self,
        settings: PluginSettings,
        *,
        clock: Callable[[], float] = time.monotonic,
        unified: UnifiedSource | None = None,
        cdi: CdiSink | None = None,
    ) -> None:
        self.settings = settings
        self._clock = clock
        self._unified = unified
        self._cdi = cdi
        """With the cdi-cri strategy: the spec is written before each view is advertised."""
        self._allocating = threading.Lock()
        """Held while an Allocate of ``nvidia.com/gpu`` is resolved and recorded: one at a
        time, so two never take the same pod."""
        self._handing = threading.Lock()
        """Held while :meth:`withhold` replaces the withheld devices, and while an Allocate
        checks the devices it hands out against them and records them in the ledger (never
        while waiting for a pod: withhold, which the reconciler calls before a destroy, waits
        for no more than that). So either the Allocate recorded first, and the reconciler's
        in-use check, made after withhold returns, finds the device in the ledger and refuses
        the destroy; or the withhold came first, and the Allocate is refused."""
        self._withheld: frozenset[str] = frozenset()
        """MIG devices the agent is destroying (by :func:`held_key`): handed to no pod and
        left out of the lists the kubelet is sent, until the agent's pass ends."""
        self._lock = threading.RLock()
        self._servers: dict[str, _ResourceServer] = {}
        self._registered: dict[str, SocketIdentity] = {}
        self._node = devices.NodeDevices(gpus=())
        self._sharing = settings.sharing
        self._shared = replicating.Shared((), ())
        self.sharing_problem: str | None = None
        """Why the sharing config could not be applied to the node's devices now (they are
        then advertised unshared), or ``None``."""
        self._unhealthy: set[str] = set()
        self._ledger = allocations.AllocationLedger(grace_s=settings.allocation_grace_s)
        self._ledger_write = threading.Lock()
        """Held from taking the ledger's dump to its file being replaced, so that writes from
        Allocate's threads and from the agent's pass land in the order of their dumps."""
        self._load_ledger()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    # -- the agent's side --------------------------------------------------------------------
    def start(self, node: devices.NodeDevices) -> None:
        """Serve and register the resources of ``node``; watch for kubelet restarts."""
        with self._lock:
            if self._watcher is not None:
                raise RuntimeError("device plugin already started")
            self._apply(node)
            self._stopping.clear()
            self._watcher = threading.Thread(
                target=self._watch_kubelet, name="migpilot-kubelet-watch", daemon=True
            )
            self._watcher.start()

    def update(self, node: devices.NodeDevices) -> None:
        """Advertise a new view of the node (devices appeared, disappeared or changed)."""
        with self._lock:
            self._apply(node)

    def set_sharing(self, sharing: sharing_config.Config) -> None:
        """Advertise under a new sharing config at once (open streams change; renamed
        resources start their own servers and register; resources no longer advertised send
        zero devices). Raises :class:`~migpilot.errors.SharingConfigError`, changing nothing,
        when the config cannot be applied to the node's devices."""
        sharing.check_mig_strategy(self.settings.strategy.value)
        with self._lock:
            if self._watcher is None:
                replicating.share(
                    advertising.resources_for(self._node, self.settings.strategy),
                    self._node,
                    sharing,
                    mps_root=self.settings.mps_root,
                )  # checked now, applied at start
                self._sharing = sharing
                return
            previous = self._sharing
            self._sharing = sharing
            try:
                self._apply(self._node, strict=True)
            except errors.SharingConfigError:
                self._sharing = previous
                raise

    def sharing(self) -> sharing_config.Config:
        """The sharing config advertised under."""
        with self._lock:
            return self._sharing

    def mps_daemons(self) -> tuple[mps.MpsDaemon, ...]:
        """The MPS daemons the advertised resources need (for the MPS supervisor)."""
        with self._lock:
            return self._shared.daemons

    def report_xid(self, event: health.XidEvent) -> frozenset[str]:
        """Apply an XID event; return the device IDs it made Unhealthy (for good)."""
        with self._lock:
            hit = health.affected_devices(
                event, self._node, strategy=self.settings.strategy, policy=self.settings.xids
            )
            if hit - self._unhealthy:
                _log.warning("XID %d: marking %s Unhealthy", event.xid, ", ".join(sorted(hit)))
                self._unhealthy |= hit
                self._apply(self._node)
            return hit

    def withhold(self, device_ids: frozenset[str]) -> None:
        """From now on, hand none of ``device_ids`` out and leave them out of the lists sent to
        the kubelet (:class:`~migpilot.agent.running.Withholding`; replaces what was withheld
        before, empty: withhold nothing). The agent's reconciler calls this before its last
        in-use check of each destroy and clears it once the pass's end has advertised the
        view without the destroyed devices; without it the kubelet could be given, between
        that check and the pass's end, an instance the pass destroys (the kubelet picks from
        the list it was sent, Allocate checked only that list)."""
        withheld = frozenset(held_key(i) for i in device_ids)
        with self._handing:
            if withheld == self._withheld:
                return
            added = withheld - self._withheld
            self._withheld = withheld
        with self._lock:
            # The newest, not this call's: a later call that set it first may have published
            # already, and must not be undone by this one.
            newest = self._withheld
            for server in self._servers.values():
                server.withhold(newest)
        if added:
            _log.info("not handing out %s: being destroyed", ", ".join(sorted(added)))

    def stop(self) -> None:
        """Stop the watcher and every server; sockets are removed."""
        self._stopping.set()
        watcher = self._watcher
        if watcher is not None:
            watcher.join()
        with self._lock:
            self._watcher = None
            for server in self._servers.values():
                server.stop()
            self._servers.clear()
            self._registered.clear()

    # -- what others read --------------------------------------------------------------------
    def advertised(self) -> dict[str, tuple[devices.Device, ...]]:
        """Every served resource and the devices it advertises now (possibly none; withheld
        devices are not advertised)."""
        with self._lock:
            return {name: s.listed().devices for name, s in sorted(self._servers.items())}

    def registered(self) -> frozenset[str]:
        """Resources registered with the kubelet now running."""
        with self._lock:
            return frozenset(self._registered)

    def handed_out(self) -> frozenset[str]:
        """Devices Allocate handed out that the kubelet has not shown released, and the MIG
        instances handed to unified pods still alive: in use."""
        unified = {u for a in self._ledger.pods().values() if a.unified for u in a.devices}
        return self._ledger.held(now=self._clock()) | unified

    def observe_kubelet(self, allocated: frozenset[str]) -> None:
        """Tell the ledger what the kubelet's PodResources lists as allocated now."""
        if self._ledger.observe_kubelet(allocated, now=self._clock()):
            self._save_ledger()

    def record_allocated(self, device_ids: list[str]) -> None:
        """Allocate handed these devices out (called by the servers)."""
        if self._ledger.record(device_ids, now=self._clock()):
            self._save_ledger()

    def _hand_out(
        self, resource: str, device_ids: Sequence[str], record: Callable[[], bool]
    ) -> None:
        """Refuse ``device_ids`` of ``resource`` if one is withheld, else ``record`` them in
        the ledger (``record`` says whether it changed), both under the lock
        :meth:`withhold` takes; the ledger is saved after, before the answer is sent."""
        with self._handing:
            withheld = [i for i in device_ids if held_key(i) in self._withheld]
            if withheld:
                raise allocating.AllocationError(
                    f"invalid allocation request for {allocating.go_quote(resource)}: invalid "
                    f"request: unknown device: {withheld[0]} (being destroyed; no longer "
                    "advertised)"
                )
            changed = record()
        if changed:
            self._save_ledger()

    def _record(self, resource: str, device_ids: Sequence[str]) -> None:
        """Allocate hands these devices out: refused if one is withheld, else recorded."""
        now = self._clock()
        self._hand_out(resource, device_ids, lambda: self._ledger.record(device_ids, now=now))

    # -- unified requests (docs/unified.md) --------------------------------------------------
    def pod_allocations(self) -> dict[str, resolving.PodAllocation]:
        """What Allocate of ``nvidia.com/gpu`` handed to each pod still in the ledger."""
        return self._ledger.pods()

    def pods_version(self) -> int:
        """Changes whenever :meth:`pod_allocations` does."""
        return self._ledger.pods_version

    def release_pods(self, pods: Sequence[str]) -> None:
        """These pods are gone: drop their entries (their instances are free)."""
        if self._ledger.release_pods(pods):
            _log.info("allocations released, their pods are gone: %s", ", ".join(sorted(pods)))
            self._save_ledger()

    def allocate_containers(
        self, name: str, requests: Sequence[list[str]]
    ) -> list[allocating.ContainerAllocation]:
        """The answers to one Allocate call of resource ``name`` (one request per container);
        raises :class:`allocating.AllocationError` with the message the kubelet is sent.

        The resource's devices, the node's slices and the sharing are taken together, under
        the lock :meth:`update` holds while it changes them: read apart, a view applied in
        between could advertise a slice the node no longer has (a KeyError, not an answer)."""
        settings = self.settings.allocate
        resource, shared, sharing, node = self._snapshot(name)
        for ids in requests:
            allocating.check_distinct(resource, ids)
        if devices.is_slice_resource(resource.name):
            daemons = shared.slice_daemons()
            answers = [
                slices.container_allocation(
                    resource, ids, node=node, daemons=daemons, settings=settings
                )
                for ids in requests
            ]
            self._record(name, [i for ids in requests for i in ids])  # the slices, by ID
            return answers
        if any(
            replicas.is_replica(i) and not devices.is_slice_id(i) for ids in requests for i in ids
        ):
            if self._unified is not None and resource.name == devices.FULL_GPU_RESOURCE:
                with self._allocating:
                    return [
                        self._allocate_replicas(resource, ids, shared, sharing) for ids in requests
                    ]
            return [self._allocate_shared(resource, ids, shared, sharing) for ids in requests]
        if self._unified is None or resource.name != devices.FULL_GPU_RESOURCE:
            answers = [allocating.container_allocation(resource, ids, settings) for ids in requests]
            self._record(name, [i for ids in requests for i in ids])
            return answers
        with self._allocating:
            return [self._allocate_gpu(resource, ids) for ids in requests]

    def _snapshot(
        self, name: str
    ) -> tuple[devices.Resource, replicating.Shared, sharing_config.Config, devices.NodeDevices]:
        """Resource ``name`` as advertised now (no devices when it is not), with the sharing
        and the node view it was advertised from: one consistent snapshot."""
        with self._lock:
            shared, sharing, node = self._shared, self._sharing, self._node
        resource = next((r for r in shared.resources if r.name == name), None)
        return resource or devices.Resource(name, ()), shared, sharing, node

    def _allocate_shared(
        self,
        resource: devices.Resource,
        requested: list[str],
        shared: replicating.Shared,
        sharing: sharing_config.Config,
    ) -> allocating.ContainerAllocation:
        """Replicas: NVIDIA's checks, the real devices once each, MPS's settings."""
        allocating.check_known(resource, requested)
        problem = replicas.request_problem(requested, sharing)
        if problem is not None:
            raise allocating.AllocationError(
                f"invalid allocation request for {allocating.go_quote(resource.name)}: {problem}"
            )
        real = replicas.real_ids(requested)
        answer = allocating.answer(real, self.settings.allocate)
        daemon = shared.daemon(resource.name)
        if daemon is not None:
            extra = mps.client(daemon, requested)
            answer = allocating.ContainerAllocation(
                envs={**answer.envs, **extra.envs},
                cdi_devices=answer.cdi_devices,
                mounts=tuple((m.host_path, m.container_path) for m in extra.mounts),
            )
        self._record(resource.name, real)
        return answer

    def _allocate_replicas(
        self,
        resource: devices.Resource,
        requested: list[str],
        shared: replicating.Shared,
        sharing: sharing_config.Config,
    ) -> allocating.ContainerAllocation:
        """Time-slicing replicas of ``nvidia.com/gpu`` on a node that serves unified pods: the
        unified pod this Allocate serves (:func:`resolving.resolve`) gets the replicas kept
        for it (its GPUs, recorded in the ledger so the status names it ``usedBy``); any other
        pod gets NVIDIA's answer for the replicas the kubelet picked, unless they are kept for
        unified pods (refused, as MIG instances of the pool are)."""
        allocating.check_known(resource, requested)
        found, pool = self._resolve(requested, wait=False)
        if isinstance(found, resolving.NoPod) and any(i in pool for i in requested):
            found, pool = self._resolve(requested, wait=True)
        if isinstance(found, resolving.Refusal):
            raise allocating.AllocationError(found.message)
        if not isinstance(found, resolving.Decision) or not found.pod.unified:
            return self._allocate_shared(resource, requested, shared, sharing)
        answer = allocating.answer(replicas.real_ids(found.device_ids), self.settings.allocate)
        self._record_decision(resource.name, found, requested, what="replica(s) ")
        return answer

    def _allocate_gpu(
        self, resource: devices.Resource, requested: list[str]
    ) -> allocating.ContainerAllocation:
        allocating.check_known(resource, requested)
        found, pool = self._resolve(requested, wait=True)
        settings = self.settings.allocate
        if isinstance(found, resolving.Refusal):
            raise allocating.AllocationError(found.message)
        if isinstance(found, resolving.NoPod):
            if any(i in pool for i in requested):
                raise allocating.AllocationError(
                    f"{found.message}; waited {self.settings.allocate_wait_s:g} s for the pod "
                    "to show in the API server"
                )
            # The wait may have outlasted the list the kubelet picked from: a device that has
            # left nvidia.com/gpu since (a MIG instance of the pool now advertised under its
            # profile) is unknown now, as NVIDIA's plugin would say, never answered raw.
            allocating.check_known(self._snapshot(resource.name)[0], requested)
            # Whole GPUs for a pod the API does not show: answered as NVIDIA's plugin would.
            self._record(resource.name, requested)
            _log.warning("Allocate of %s: %s; answering as NVIDIA's plugin", ", ".join(requested),
                         found.message)  # fmt: skip
            return allocating.answer(requested, settings)
        answer = self._decided_answer(resource, found)
        self._record_decision(resource.name, found, requested)
        return answer

    def _record_decision(
        self,
        resource: str,
        found: resolving.Decision,
        requested: Sequence[str],
        *,
        what: str = "",
    ) -> None:
        """Record in the ledger (and save it, before the answer: a restart must not forget it)
        the devices :func:`resolving.resolve` gave one container, and log them (``what``
        names their kind in the log line). A new entry each time: resolve decides only on a
        container not in the ledger yet. A whole-GPU pod's picks are recorded as allocated
        too, as NVIDIA's plugin's would be; a unified pod's are its own bookkeeping. Refused,
        nothing recorded, when a device given or picked is withheld (being destroyed)."""
        now = self._clock()

        def record() -> bool:
            self._ledger.record_container(
                found.pod.key,
                uid=found.pod.uid,
                unified=found.pod.unified,
                container=found.container.name,
                device_ids=found.device_ids,
            )
            if not found.pod.unified:
                self._ledger.record(requested, now=now)
            return True

        self._hand_out(resource, [*found.device_ids, *requested], record)
        _log.info(
            "Allocate: pod %s container %s gets %s%s (the kubelet picked %s)%s",
            found.pod.key,
            found.container.name,
            what,
            ", ".join(found.device_ids),
            ", ".join(requested),
            _taken_note(found),
            extra=logs.about(pod=found.pod.key),
        )

    def _decided_answer(
        self, resource: devices.Resource, found: resolving.Decision
    ) -> allocating.ContainerAllocation:
        """The answer for the container :func:`resolving.resolve` decided on: its devices (a
        unified pod's MIG instances, a whole-GPU pod's GPUs), or a unified pod's MPS slice with
        the slice's MPS settings (:func:`slices.container_allocation`: one GPU, its daemon,
        the slice's memory and compute share; a whole-GPU pod never gets a slice, resolve
        refuses devices of the unified pool to it). Raises :class:`~allocating.AllocationError`
        before anything is recorded when it cannot be answered."""
        ids = found.device_ids
        sliced = [i for i in ids if devices.is_slice_id(i)]
        if not sliced:
            return allocating.answer(ids, self.settings.allocate)
        if len(sliced) != len(ids):
            raise allocating.AllocationError(
                f"pod {found.pod.key}: container {found.container.name} would get MIG instances "
                f"and MPS slices together ({', '.join(ids)}); one container talks to one MPS "
                "daemon"
            )
        resource, shared, _, node = self._snapshot(resource.name)  # one view of all three
        return slices.container_allocation(
            resource,
            ids,
            node=node,
            daemons=shared.slice_daemons(),
            settings=self.settings.allocate,
        )

    def _resolve(
        self, requested: Sequence[str], *, wait: bool
    ) -> tuple[resolving.Resolution, frozenset[str]]:
        """Resolve; while no pod is known, read the pods again (up to ``allocate_wait_s``).
        With the resolution comes every device the pool held at any of the reads: one the
        kubelet picked from the pool stays the pool's for this Allocate even if it leaves the
        pool while the pods are read again, so it is never answered as a whole GPU."""
        assert self._unified is not None
        deadline = self._clock() + self.settings.allocate_wait_s  # only read when waiting
        fresh = False
        pooled: frozenset[str] = frozenset()
        while True:
            inputs = self._unified.inputs(fresh=fresh)
            pooled |= inputs.pool
            found = resolving.resolve(
                requested=requested,
                pods=inputs.pods,
                reservations=inputs.reservations,
                allocated=self._ledger.pods(),
                pool=inputs.pool,
                busy=self._ledger.held(now=self._clock()),
            )
            if not isinstance(found, resolving.NoPod) or not wait:
                return found, pooled
            if fresh:
                stopping = self._stopping.wait(self.settings.allocate_poll_s)
                if stopping or self._clock() >= deadline:
                    return found, pooled
            else:
                _log.info("Allocate of %s: %s yet; reading the node's pods again",
                          ", ".join(requested), found.message)  # fmt: skip
            fresh = True

    def preferred_devices(
        self,
        resource: devices.Resource,
        *,
        available: list[str],
        must_include: list[str],
        size: int,
    ) -> tuple[str, ...]:
        """GetPreferredAllocation's answer: packed onto few GPUs; for ``nvidia.com/gpu``
        with unified requests, the devices Allocate will hand the pod come first; replicas are
        spread over the real devices, least used first."""
        with self._lock:
            shared = self._shared.shared_resource(resource.name)
        if shared is not None and any(replicas.is_replica(d.id) for d in shared.devices):
            allocating.check_known(resource, [*available, *must_include])
            if self._unified is not None and resource.name == devices.FULL_GPU_RESOURCE:
                # A unified pod's kept replicas first; another pod's outside the pool.
                with self._allocating:
                    found, pool = self._resolve(["?"] * size, wait=False)
                if isinstance(found, resolving.Decision) and found.pod.unified:
                    must_include = list(
                        resolving.preferred(
                            found,
                            available=available,
                            must_include=must_include,
                            size=size,
                            pool=pool,
                        )
                    )
                elif len(outside := [i for i in available if i not in pool]) >= size:
                    available = outside
            return replicas.preferred(
                shared, available=available, must_include=must_include, size=size
            )
        if self._unified is not None and resource.name == devices.FULL_GPU_RESOURCE:
            allocating.check_known(resource, [*available, *must_include])
            with self._allocating:
                found, pool = self._resolve(["?"] * size, wait=False)
            must_include = list(
                resolving.preferred(
                    found, available=available, must_include=must_include, size=size, pool=pool
                )
            )
        return allocating.preferred_allocation(
            resource, available=available, must_include=must_include, size=size
        )

    # -- internals ---------------------------------------------------------------------------
    def _load_ledger(self) -> None:
        path = self.settings.ledger_file
        if path is None:
            return
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        except OSError as err:
            raise errors.AgentConfigError(
                f"cannot read the allocation ledger {path}: {err.strerror or err}"
            ) from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as err:  # RecursionError: nested too deeply
            raise errors.AgentConfigError(
                f"{path}: the allocation ledger is not JSON ({err}); devices handed out before "
                "the restart would be forgotten, so the agent does not start (move the file "
                "away once no pod is starting on this node)"
            ) from None
        now = self._clock()
        self._ledger.load(data, now=now, source=str(path))
        held = self._ledger.held(now=now)
        if held:
            _log.info("allocation ledger %s: %d device(s) still held", path, len(held))

    def _save_ledger(self) -> None:
        path = self.settings.ledger_file
        if path is None:
            return
        try:
            with self._ledger_write:
                data = self._ledger.dump(now=self._clock())
                text = json.dumps(data, indent=1, sort_keys=True) + "\n"
                files.write_atomically(path, text, durable=True)
        except OSError as err:
            # The ledger in memory still holds the devices; only a restart could forget them.
            _log.error("cannot write the allocation ledger %s: %s", path, err.strerror or err)

    def _apply(self, node: devices.NodeDevices, *, strict: bool = False) -> None:
        plain = advertising.resources_for(node, self.settings.strategy, unhealthy=self._unhealthy)
        try:
            shared = replicating.share(plain, node, self._sharing, mps_root=self.settings.mps_root)
            problem = None
        except errors.SharingConfigError as err:
            if strict:
                raise
            # The node changed under the config (a device it names is gone): unshared until
            # the node or the config changes again.
            problem = str(err)
            if problem != self.sharing_problem:
                _log.error("sharing config not applied, advertising unshared devices: %s", err)
            shared = replicating.share(plain, node, sharing_config.EMPTY)
        self.sharing_problem = problem
        self._shared = shared
        resources = shared.resources
        if self._cdi is not None:
            # Before any server publishes: a device is in the spec before the kubelet can
            # hand it out; one the spec cannot describe is advertised Unhealthy.
            resources = _unhealthy(resources, self._cdi.write(node, resources))
        gone = {held_key(d.id) for r in self._advertised_now() for d in r.devices} - {
            held_key(d.id) for r in resources for d in r.devices
        }
        if self._ledger.forget(gone):
            self._save_ledger()
        self._node = node
        wanted = {r.name: r for r in resources}
        for name, served in self._servers.items():
            if name not in wanted:
                served.publish(devices.Resource(name, ()))
        for name, resource in wanted.items():
            existing = self._servers.get(name)
            if existing is not None:
                existing.publish(resource)
                continue
            server = _ResourceServer(resource, self, withheld=self._withheld)
            server.start()
            self._servers[name] = server
            self._register(server)

    def _advertised_now(self) -> list[devices.Resource]:
        return [s.resource() for s in self._servers.values()]

    def _register(self, server: _ResourceServer) -> bool:
        kubelet = self.settings.kubelet_socket
        identity = socket_identity(kubelet)
        if identity is None:
            _log.info(
                "kubelet socket %s absent; %s registers when it appears", kubelet, server.name
            )
            return False
        request = api_pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=server.socket_path.name,
            resource_name=server.name,
            options=api_pb2.DevicePluginOptions(get_preferred_allocation_available=True),
        )
        timeout = self.settings.rpc_timeout_s
        try:
            with grpc.insecure_channel(f"unix://{kubelet}") as channel:
                grpc.channel_ready_future(channel).result(timeout=timeout)
                api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=timeout)
        except (grpc.RpcError, grpc.FutureTimeoutError) as err:
            _log.warning("registering %s with the kubelet failed: %s", server.name, err)
            self._registered.pop(server.name, None)
            return False
        self._registered[server.name] = identity
        _log.info("registered %s with the kubelet", server.name)
        return True

    def _watch_kubelet(self) -> None:
        while not self._stopping.wait(self.settings.kubelet_poll_s):
            self.check_kubelet()

    def check_kubelet(self) -> None:
        """Re-register every resource if ``kubelet.sock`` was recreated (the watcher's step)."""
        identity = socket_identity(self.settings.kubelet_socket)
        if identity is None:
            return
        with self._lock:
            if self._stopping.is_set():
                return
            for name, server in self._servers.items():
                if self._registered.get(name) == identity:
                    continue
                if not server.socket_intact():
                    _log.info("socket of %s was removed; serving it again", name)
                    server.stop()
                    server.start()
                self._register(server)


def _taken_note(found: resolving.Decision) -> str:
    """For the log: a unified pod bound with nothing reserved got other pods' reservations."""
    if not found.taken_from:
        return ""
    return (
        "; nothing was reserved for it (bound without migpilot), so it takes the reservation "
        f"of {', '.join(found.taken_from)}, planned again"
    )
