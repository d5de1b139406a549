"""Many simulated node agents in one process: ``migpilot fleet``, for scale tests on KWOK nodes.

A benchmark of 1,000 KWOK nodes cannot start 1,000 agent processes, nor one thread and three
watches per node. The fleet runs the simulated agent (emulated GPUs, ``--kubelet simulated``)
of every Node a label selects, with ONE list+watch of those Nodes, ONE of every GpuLayout and
ONE of every pod bound to a node (filtered locally by :class:`~boundpods.PodBook`), and a bounded
pool of worker threads that run the nodes' passes. Each node's GPUs are named by its label
``migpilot.io/emulated-gpus`` in a label-safe spelling of the emulated backend
(:func:`backend_spec`), and kept in memory (no state files).

Nothing here reconciles or reports: each node is the single agent's own parts, wired as the
single agent's are (:func:`assembling.kube_side`, :meth:`assembling.KubeSide.wire`):
:class:`running.Agent` over an emulated backend, :class:`following.GpuLayoutSource` (fed by the
shared watch through :meth:`~following.GpuLayoutSource.take`), :class:`following.KubeReporter`
(status and GFD labels, written before any GpuLayout exists, so the controller creates one),
:class:`standin.SimulatedKubelet` (resource counts, devices assigned to pods),
:class:`holding.BoundPodsHold` (a bound pod's count of instances kept),
:class:`unifying.UnifiedPool` (the instances set aside for unified pods) and
:class:`unifying.NodeCounters` (``nvidia.com/gpumem`` and the other unified counters) and
:class:`startup.StartupTaint` (the startup taint removed once the node is reported; the Node
watch feeds it, and the stand-in, which publishes a count the Node lost again). The fleet
only dispatches: a node's pass is queued when its GpuLayout or its pods change and the pass is
due (:meth:`running.Agent.due`); again ``interval_s`` after a pass that left work undone (to
retry it), and otherwise only every ``resync_s``, since nothing else changes a fleet node. A node is
never in two passes at once, and a change during a pass queues one more (:class:`WorkQueue`).

A node labelled ``migpilot.io/mode=dra`` when it joins is in DRA mode, as a single agent's
(``docs/dra.md``): its stand-in advertises no device-plugin resource, the agent's
:class:`~resourceslices.SlicePublisher` publishes its ResourceSlices after each pass (the planned
placements listed first while the controller's Lease is fresh, one reader of the Lease for the
whole fleet), and :class:`~drastandin.DraStandin` prepares the claims of its pods through the DRA
plugin's own preparer, so their instances exist. Its claims' ledger and CDI specs are kept in
memory, as the fleet's GPUs are.

A shell module: it talks to the API only through :class:`~kubeapi.NodeApi` (:func:`run` opens the
lightkube one from :mod:`migpilot.agent.cluster.kube`); never imports a Kubernetes client itself,
nor gRPC: no device plugin is served (import-linter contracts)."""

from __future__ import annotations

import collections
import datetime
import logging
import signal
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from migpilot import errors, logs, probes
from migpilot.agent import assembling, metrics, reconciling, running, sampling, usage
from migpilot.agent.cluster import (
    boundpods,
    following,
    kube,
    kubeapi,
    resourceslices,
    sliceapi,
    startup,
    watching,
)
from migpilot.agent.deviceplugin import devices
from migpilot.agent.dra import gpuinstances, memory
from migpilot.agent.dra import node as dra_node
from migpilot.agent.rules import changes
from migpilot.agent.sharing import unifying
from migpilot.api import leases
from migpilot.gpu import backend, clocks, emulated
from migpilot.kube import leasereader, objects
from migpilot.kwok import drastandin, standin
from migpilot.planning import modes

_log = logging.getLogger(__name__)

EMULATED_GPUS_LABEL = "migpilot.io/emulated-gpus"
"""The Node label naming the node's emulated GPUs (:func:`backend_spec`), and by default the
one that selects the fleet's nodes."""


DEFAULT_SELECTOR = objects.LabelSelector(EMULATED_GPUS_LABEL)
"""The fleet's Nodes by default: those with the label :data:`EMULATED_GPUS_LABEL`."""
DEFAULT_WORKERS = 32
DEFAULT_INTERVAL_S = 30.0
DEFAULT_RESYNC_S = 300.0


# --- a node's GPUs from its label --------------------------------------------------------------


def backend_spec(value: str, *, node: str) -> emulated.EmulatedSpec:
    """The emulated GPUs a label value names: the backend spec of ``--backend emulated:...``
    spelt with label characters only, ``.`` for ``:`` and ``_`` for ``,``:
    ``a100-80gb.x8``, ``a100-80gb.x4_a30.x2``, ``0x233010DE.0x16C110DE.x8``.

    A bad value is a one-line :class:`AgentConfigError` naming the node and the label.
    """
    spec = "emulated:" + value.strip().replace("_", ",").replace(".", ":")
    try:
        return emulated.parse_spec(spec)
    except errors.AgentConfigError as err:
        raise errors.AgentConfigError(
            f"Node {node}: label {EMULATED_GPUS_LABEL}={value!r} does not name emulated GPUs "
            f"as MODEL.xN[_MODEL.xN...] (e.g. a100-80gb.x8): {err}"
        ) from None


# --- the work queue ----------------------------------------------------------------------------


class WorkQueue:
    """Node names waiting for a pass, each at most once, never two passes of one node at once.

    :meth:`add` while the node's pass runs marks it to run again when :meth:`done` is called
    (as client-go's workqueue). Thread-safe; :meth:`get` blocks until a node or :meth:`close`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: collections.deque[str] = collections.deque()
        self._queued: set[str] = set()
        self._running: set[str] = set()
        self._again: set[str] = set()
        self._closed = False

    def add(self, node: str) -> None:
        """Queue a pass of ``node`` (once)."""
        with self._cond:
            if node in self._running:
                self._again.add(node)
            elif node not in self._queued:
                self._queued.add(node)
                self._waiting.append(node)
                self._cond.notify()

    def get(self) -> str | None:
        """The next node to pass (now running), or ``None`` once closed."""
        with self._cond:
            while not self._waiting and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            node = self._waiting.popleft()
            self._queued.discard(node)
            self._running.add(node)
            return node

    def done(self, node: str) -> None:
        """The pass of ``node`` ended; queue it again if it was asked for meanwhile."""
        with self._cond:
            self._running.discard(node)
            if node in self._again:
                self._again.discard(node)
                if node not in self._queued:
                    self._queued.add(node)
                    self._waiting.append(node)
                    self._cond.notify()

    def idle(self) -> bool:
        """Nothing waiting and nothing running."""
        with self._cond:
            return not self._waiting and not self._running

    def close(self) -> None:
        """Wake every :meth:`get` with ``None``."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()


# --- the fleet ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FleetSettings:
    """How the fleet runs."""

    kubeconfig: Path | None = None
    """The kubeconfig to reach the API server (:func:`run`); ``None``: in-cluster config."""
    selector: objects.LabelSelector = DEFAULT_SELECTOR
    """The Nodes to run agents for (default: those with the label ``migpilot.io/emulated-gpus``;
    each needs that label in any case)."""
    workers: int = DEFAULT_WORKERS
    """Threads running passes, nodes in parallel (default 32): emulated creations take ~0.1 s
    each, as on hardware, so one busy node must not hold up the others."""
    strategy: devices.MigStrategy = devices.MigStrategy.MIXED
    """MIG strategy of every node's labels and resources (default ``mixed``)."""
    interval_s: float = DEFAULT_INTERVAL_S
    """Seconds between the passes of a node whose last pass left something undone: an action
    refused or failed, a write the API server refused (default 30). They retry it."""
    resync_s: float = DEFAULT_RESYNC_S
    """Seconds between the passes of a node whose last pass left nothing undone (default 300).
    Every input of a fleet node is watched (its GpuLayout, its pods) and its emulated GPUs
    change only in its own passes, so these only guard against a missed event; at 1,000 nodes
    a pass of each every few seconds would keep the process busy doing nothing."""
    tick_s: float = 1.0
    stall_s: float = 300.0
    """Seconds the tick loop may go without a round before ``/healthz`` fails. Default 300."""
    metrics_port: int | None = None
    """Serve metrics and probes on this port (:meth:`Fleet.serve`); ``None``: not served."""
    """Seconds between checks for nodes whose periodic pass is due (default 1)."""
    times: emulated.OperationTimes = field(default_factory=emulated.OperationTimes)
    """How long the emulated driver steps take (default: the A100's measured times)."""
    unified_counters: bool = True
    """Write each node's unified counters (``nvidia.com/gpumem``, ``gpumem-percentage``,
    ``gpucores``; ``docs/unified.md``) into its capacity and allocatable (default on)."""
    gpu_metrics_interval_s: float = 5.0
    """With :attr:`metrics_port`: seconds between two readings of every node's GPU use, per
    device and pod (one :class:`~sampling.FleetSampler` for all nodes; default 5)."""
    emulated_load: Path | None = None
    """The ``--emulated-load`` file: ``NAMESPACE/POD`` -> what the devices each pod holds
    report, shared by every node (re-read within 1 s of a change); ``None``: every pod idle."""
    lease_namespace: str = leases.NAMESPACE
    """Namespace of the controller's Lease: on nodes in DRA mode the planner's placements are
    listed first only while it is fresh (default ``migpilot-system``)."""
    lease_name: str = leases.NAME
    """The controller's Lease (default ``migpilot-controller``)."""


@dataclass(frozen=True, slots=True)
class Member:
    """One node of the fleet: the single agent's parts over its emulated GPUs."""

    node: str
    label: str
    """The ``migpilot.io/emulated-gpus`` value its GPUs came from."""
    gpus: emulated.EmulatedBackend
    source: following.GpuLayoutSource
    kubelet: standin.SimulatedKubelet
    reporter: following.KubeReporter
    agent: running.Agent
    pool: unifying.UnifiedPool
    counters: unifying.NodeCounters | None = None
    sampler: sampling.GpuSampler | None = None
    """Reads the node's GPU use for the fleet's :class:`~sampling.FleetSampler`."""
    startup: startup.StartupTaint | None = None
    """Removes the Node's startup taint once the node is reported and its resources
    published (fed the Node by the fleet's Node watch)."""
    slices: resourceslices.SlicePublisher | None = None
    """In DRA mode: publishes the node's ResourceSlices after each pass."""
    dra: drastandin.DraStandin | None = None
    """In DRA mode: prepares the claims of the node's pods."""


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Fleet:
    """The simulated agents of the selected nodes, fed by three shared watches (see the module).

    Tests drive it with the in-memory API: :meth:`run` in a thread, or the watch callbacks
    (:meth:`nodes_listed`, :meth:`node_changed`, ...) and :meth:`drain` without threads.
    """

    def __init__(
        self,
        api: kubeapi.NodeApi,
        *,
        settings: FleetSettings,
        clock: clocks.Clock | None = None,
        now: Callable[[], str] = _now,
    ) -> None:
        self._api = api
        self.settings = settings
        self._clock: clocks.Clock = clock if clock is not None else clocks.SystemClock()
        self._now = now
        self._lock = threading.Lock()
        self._members: dict[str, Member] = {}
        self._layouts: dict[str, Mapping[str, Any]] = {}
        self._refused: dict[str, str] = {}
        self._mps_nodes: dict[str, bool] = {}
        """Node -> whether its ``migpilot.io/mode`` is ``mps`` (its GPUs with MIG off are then
        listed in the status)."""
        self._dynamic_nodes: dict[str, bool] = {}
        """Node -> whether it is labelled ``migpilot.io/mig-mode=dynamic`` (its idle GPUs' MIG
        mode may be switched)."""
        self._lease: leasereader.LeaseReader | None = None
        """The controller's Lease as DRA steering reads it, shared by the nodes in DRA mode
        (made with the first)."""
        """Node -> the label value it was refused for (logged once)."""
        self._retry: dict[str, float] = {}
        """Node -> when to pass it again (monotonic seconds): its last pass left work undone."""
        self.pods = boundpods.PodBook(on_change=self.poke)
        self.queue = WorkQueue()
        self._metrics = metrics.AgentMetrics()
        """Shared by every node (the reconciler counts into it); served by :meth:`serve`."""
        self.load = (
            sampling.LoadFile(settings.emulated_load)
            if settings.emulated_load is not None
            else None
        )
        """The ``--emulated-load`` file every node's sampler reads (:meth:`sample_usage`);
        read here, so a bad or missing file is an :class:`~errors.AgentConfigError`."""
        if self.load is not None:
            self.load.load()
        self.sampler = sampling.FleetSampler(
            nodes=self._samplers,
            sink=self._metrics,
            interval_s=settings.gpu_metrics_interval_s,
            load=self.load,
        )
        """Every node's per-device, per-pod GPU series in one pass (started by :meth:`run`
        when metrics are served)."""
        self.heartbeat = probes.Heartbeat(self._clock.monotonic, stall_s=self.settings.stall_s)
        """Beats once per tick of :meth:`run`; ``/healthz`` reads it."""

    def serve(self, *, port: int, address: str = "0.0.0.0") -> probes.Endpoint:
        """Serve the fleet's metrics (every node's, in one registry), ``/healthz`` (the tick
        loop goes round) and ``/readyz`` on ``port`` until the endpoint is closed."""
        return probes.Endpoint(
            self._metrics.registry, port=port, address=address, live=self.heartbeat.check
        )

    # -- members -------------------------------------------------------------------------------
    def member(self, node: str) -> Member | None:
        """The node's agent, if it runs one."""
        with self._lock:
            return self._members.get(node)

    def sample_usage(self) -> tuple[usage.Row, ...]:
        """One sampling pass of every node's GPU use, published (tests; :meth:`run` repeats
        it every :attr:`~FleetSettings.gpu_metrics_interval_s` when metrics are served)."""
        return self.sampler.sample()

    def _samplers(self) -> list[sampling.GpuSampler]:
        with self._lock:
            members = sorted(self._members.values(), key=lambda m: m.node)
        return [m.sampler for m in members if m.sampler is not None]

    def members(self) -> list[str]:
        """The nodes it runs agents for."""
        with self._lock:
            return sorted(self._members)

    def _join(self, doc: Mapping[str, Any]) -> None:
        node = str((doc.get("metadata") or {}).get("name", ""))
        value = objects.labels_of(doc).get(EMULATED_GPUS_LABEL)
        mps_node = objects.labels_of(doc).get(modes.MODE_LABEL) == modes.Mode.MPS.value
        dra = objects.labels_of(doc).get(modes.MODE_LABEL) == modes.Mode.DRA.value
        with self._lock:
            self._mps_nodes[node] = mps_node
            self._dynamic_nodes[node] = modes.dynamic_mig(objects.labels_of(doc))
            have = self._members.get(node)
        if have is not None:
            if value != have.label:
                self._refuse(node, value or "", "changing a node's emulated GPUs needs a restart")
            if dra != (have.slices is not None):
                self._refuse(
                    node, f"dra={dra}", "changing a node's DRA mode needs a restart of the fleet"
                )
            have.kubelet.node_seen(doc)  # a count the Node lost is published again
            if have.startup is not None:
                have.startup.node_seen(doc)
            self._wake(have)  # due if the Node lost a count, or has the startup taint
            return
        if value is None:
            self._refuse(node, "", f"Node {node} has no label {EMULATED_GPUS_LABEL}")
            return
        try:
            spec = backend_spec(value, node=node)
        except errors.AgentConfigError as err:
            self._refuse(node, value, str(err))
            return
        try:
            member = self._make(node, value, spec, dra=dra)
        except errors.AgentConfigError as err:
            self._refuse(node, value, str(err))
            return
        if member.startup is not None:
            member.startup.node_seen(doc)
        with self._lock:
            self._members[node] = member
            member.source.take(self._layouts.get(node))
            self._refused.pop(node, None)
        _log.info("Node %s: running its agent (%s)", node, value, extra=logs.about(node=node))
        self.queue.add(node)

    def _refuse(self, node: str, value: str, why: str) -> None:
        with self._lock:
            seen = self._refused.get(node) == value
            self._refused[node] = value
        if not seen:
            _log.error("%s; not running an agent for it", why, extra=logs.about(node=node))

    def _leave(self, node: str) -> None:
        with self._lock:
            member = self._members.pop(node, None)
            self._refused.pop(node, None)
            self._retry.pop(node, None)
        if member is not None:
            _log.info("Node %s: gone, its agent stops", node, extra=logs.about(node=node))

    def _make(
        self, node: str, label: str, spec: emulated.EmulatedSpec, *, dra: bool = False
    ) -> Member:
        """The single agent's parts, wired as ``migpilot agent --node --kubelet simulated``
        (:func:`assembling.kube_side` and :meth:`assembling.KubeSide.wire`); in DRA mode
        (``dra``) with the ResourceSlice publisher and the claims' preparer."""
        gpus = emulated.EmulatedBackend(
            spec.models,
            pci_ids=spec.pci_ids,
            mig_enabled=spec.mig_enabled,
            seed=emulated.seed_for(node),
            clock=self._clock,
            times=self.settings.times,
            durable=False,
        )
        source = following.GpuLayoutSource(self._api, node=node)

        def mps_node() -> bool:
            with self._lock:
                return self._mps_nodes.get(node, False)

        def dynamic_mig() -> bool:
            with self._lock:
                return self._dynamic_nodes.get(node, False)

        side = assembling.kube_side(
            self._api,
            source=source,
            pods=self.pods,
            strategy=self.settings.strategy,
            standin=standin.stand_in,
            counters=self.settings.unified_counters,
            mps_node=mps_node,
            dynamic_mig=dynamic_mig,
            now=self._now,
            dra=dra,
        )
        kubelet = side.kubelet
        assert isinstance(kubelet, standin.SimulatedKubelet)
        slices: resourceslices.SlicePublisher | None = None
        prep: drastandin.DraStandin | None = None
        desired: running.DesiredSource = side.desired_source()
        if not side.dra_node:
            wired = side.wire(reconciling.RunningProcesses(gpus), gpus=gpus)
            listener: running.PassListener = wired.listener
        else:
            # As the single agent's DRA mode (assembling._serve), with the kubelet plugin's
            # preparer called by the stand-in instead of a kubelet over gRPC.
            processes = reconciling.RunningProcesses(gpus)
            instances = gpuinstances.BackendInstances(gpus, ledger_file=None, in_use=processes)
            preparer = dra_node.preparer(
                gpus, self._api, node=node, instances=instances, specs=memory.MemoryCdi()
            )
            prep = drastandin.DraStandin(self._api, node=node, pods=self.pods, preparer=preparer)
            wired_dra = assembling.wire_dra(
                side,
                reconciling.AnyOf([processes, instances]),
                gpus=gpus,
                settings=assembling.ClusterSettings(
                    lease_namespace=self.settings.lease_namespace,
                    lease_name=self.settings.lease_name,
                ),
                claimed=instances.claimed,
                lease=self._controller_lease(),
            )
            slices, wired = wired_dra.slices, wired_dra.wired
            # The claims prepared first, so the slices published after hold their instances
            # (then the status, in the order wire_dra keeps).
            listener = running.Listeners([prep, wired_dra.listener])
            desired = running.AlsoWatching(desired, prep.fingerprint)
        agent = running.Agent(
            gpus=gpus,
            in_use=wired.in_use,
            source=desired,
            plugin=None,
            agent_metrics=self._metrics,
            clock=self._clock,
            settings=running.AgentSettings(
                strategy=self.settings.strategy, interval_s=self.settings.resync_s
            ),
            listener=listener,
            view_filter=side.view_filter(),
            dynamic_mig=side.dynamic_mig,
        )
        sampler = sampling.GpuSampler(
            node=node,
            gpus=gpus,
            view=agent.view,
            holdings=assembling.standin_holdings(kubelet, agent),
            sink=self._metrics,  # unused: the fleet's sampler publishes every node's rows
            owners=sampling.emulated_owners(gpus),
            interval_s=self.settings.gpu_metrics_interval_s,
            in_use=wired.used.in_use,
            reserved=lambda: usage.reserved_instances(
                source.acted_on.spec if source.acted_on is not None else None, agent.view()
            ),
            replicas=assembling.replica_statuses(side, agent, wired.used.in_use),
            load=self.load,
            driven=gpus,
        )
        reporter, pool, counters = wired.reporter, side.pool, wired.counters
        return Member(
            node, label, gpus, source, kubelet, reporter, agent, pool, counters, sampler,
            side.startup, slices, prep,
        )  # fmt: skip

    def _controller_lease(self) -> leasereader.LeaseReader:
        """The fleet's one reader of the controller's Lease (DRA steering), made once."""
        with self._lock:
            if self._lease is None:
                if not isinstance(self._api, sliceapi.SliceSource):  # dra_publisher checked
                    raise errors.AgentConfigError(
                        "this Kubernetes client cannot read the controller's Lease"
                    )
                self._lease = assembling.controller_lease(
                    self._api,
                    assembling.ClusterSettings(
                        lease_namespace=self.settings.lease_namespace,
                        lease_name=self.settings.lease_name,
                    ),
                )
            return self._lease

    # -- the watches' callbacks ----------------------------------------------------------------
    def nodes_listed(self, docs: Sequence[Mapping[str, Any]]) -> None:
        """The selected Nodes as a list found them: join new ones, drop the others."""
        names = {str((d.get("metadata") or {}).get("name", "")) for d in docs}
        for node in set(self.members()) - names:
            self._leave(node)
        for doc in docs:
            self._join(doc)

    def node_changed(self, event: objects.WatchEvent) -> None:
        """A selected Node appeared, changed, or went (or stopped matching)."""
        if event.type is objects.EventType.DELETED:
            self._leave(str((event.object.get("metadata") or {}).get("name", "")))
        else:
            self._join(event.object)

    def layouts_listed(self, docs: Sequence[Mapping[str, Any]]) -> None:
        """Every GpuLayout as a list found them."""
        found = {str((d.get("metadata") or {}).get("name", "")): d for d in docs}
        with self._lock:
            self._layouts = found
            members = list(self._members.values())
            for m in members:
                m.source.take(found.get(m.node))
        for m in members:
            self._wake(m)

    def layout_changed(self, event: objects.WatchEvent) -> None:
        """One GpuLayout changed: its node's source takes it, and a pass is queued if due."""
        name = str((event.object.get("metadata") or {}).get("name", ""))
        doc = None if event.type is objects.EventType.DELETED else event.object
        with self._lock:
            if doc is None:
                self._layouts.pop(name, None)
            else:
                self._layouts[name] = doc
            member = self._members.get(name)
            if member is not None:
                member.source.take(doc)
        if member is not None:
            self._wake(member)

    def poke(self, node: str) -> None:
        """Something of ``node`` changed (its pods): queue a pass if one is due."""
        member = self.member(node)
        if member is not None:
            self._wake(member)

    def _wake(self, member: Member) -> None:
        with logs.concerning(node=member.node):  # due() reads the node's inputs, which may log
            due = member.agent.due()
        if due:
            self.queue.add(member.node)

    def tick(self) -> None:
        """Queue every node whose pass is due: an input changed, its last pass left work undone
        :attr:`~FleetSettings.interval_s` ago, or its resync is due."""
        now = self._clock.monotonic()
        with self._lock:
            members = list(self._members.values())
            retry = {n for n, at in self._retry.items() if at <= now}
        for m in members:
            if m.node in retry:
                self.queue.add(m.node)
            else:
                self._wake(m)

    # -- passes --------------------------------------------------------------------------------
    def pass_once(self, node: str) -> None:
        """Run one pass of ``node`` (a worker's job); failures are logged, never raised."""
        member = self.member(node)
        if member is None:
            return
        settled = False
        # The agent's own parts log without naming their node (a single agent's process
        # names it for them): the block does, for every line of the pass.
        with logs.concerning(node=node):
            try:
                report = member.agent.reconcile()
                settled = (
                    report.converged
                    and not report.refusals
                    and not report.outcomes(changes.Outcome.FAILED)
                    and member.reporter.settled
                    and member.kubelet.settled
                    and (member.counters is None or member.counters.settled)
                    and (member.startup is None or member.startup.settled)
                    and (member.slices is None or member.slices.published)
                    and (member.dra is None or member.dra.settled)
                )
            except backend.BackendError as err:
                _log.error("Node %s: GPU backend failed, retrying at the next pass: %s", node, err)
            except Exception:  # a worker must survive any one node's bug
                _log.exception("Node %s: the pass failed", node)
        with self._lock:
            if settled or node not in self._members:
                self._retry.pop(node, None)
            else:
                self._retry[node] = self._clock.monotonic() + self.settings.interval_s

    def drain(self) -> None:
        """Run queued passes in this thread until none is queued (tests, without workers)."""
        while not self.queue.idle():
            node = self.queue.get()
            if node is None:
                return
            try:
                self.pass_once(node)
            finally:
                self.queue.done(node)

    def _work(self) -> None:
        thread = threading.current_thread()
        name = thread.name
        while (node := self.queue.get()) is not None:
            thread.name = f"{name}:{node}"  # the log says which node a line is about
            try:
                self.pass_once(node)
            finally:
                thread.name = name
                self.queue.done(node)

    def run(self, stop: threading.Event) -> None:
        """Watch, dispatch and pass until ``stop`` is set; the passes in progress finish."""
        api, selector = self._api, self.settings.selector
        follows: list[tuple[str, Callable[[], None]]] = [
            (
                "nodes",
                lambda: watching.follow(
                    what=f"Nodes {selector}",
                    lister=lambda: api.list_nodes(selector=selector),
                    watcher=lambda v: api.watch_nodes(selector=selector, resource_version=v),
                    listed=self.nodes_listed,
                    changed=self.node_changed,
                    stop=stop,
                ),
            ),
            (
                "gpulayouts",
                lambda: watching.follow(
                    what="GpuLayouts",
                    lister=api.list_layouts,
                    watcher=lambda v: api.watch_layouts(resource_version=v),
                    listed=self.layouts_listed,
                    changed=self.layout_changed,
                    stop=stop,
                ),
            ),
            (
                "pods",
                lambda: watching.follow(
                    what="bound pods",
                    lister=lambda: api.list_pods(node=None),
                    watcher=lambda v: api.watch_pods(node=None, resource_version=v),
                    listed=self.pods.listed,
                    changed=self.pods.changed,
                    stop=stop,
                ),
            ),
        ]
        for what, target in follows:
            # daemon: a watch blocks until its next event; stopping does not wait for it
            threading.Thread(target=target, name=f"fleet-watch-{what}", daemon=True).start()
        workers = [
            threading.Thread(target=self._work, name=f"fleet-{i}")
            for i in range(self.settings.workers)
        ]
        for w in workers:
            w.start()
        if self.settings.metrics_port is not None:
            self.sampler.start(stop)
        try:
            while not stop.wait(self.settings.tick_s):
                self.heartbeat.beat()
                self.tick()
        finally:
            self.queue.close()
            for w in workers:
                w.join()


def run(settings: FleetSettings) -> int:
    """Connect, run the fleet until SIGTERM or SIGINT, exit code 0.

    An API server that cannot be reached at start is a :class:`~kube_errors.KubeApiError`.
    """
    if settings.workers < 1:
        raise errors.AgentConfigError(f"--workers must be at least 1, got {settings.workers}")
    api = kube.connect(settings.kubeconfig)
    # Fails here, not in a thread, when unreachable; a transient error (429 right after a CRD
    # is created, 5xx, refused) is tried again with backoff first, as the agent's first reads.
    watching.retrying(
        lambda: api.list_nodes(selector=settings.selector), what=f"Nodes {settings.selector}"
    )
    if settings.emulated_load is not None:
        sampling.LoadFile(settings.emulated_load).load()  # a bad file stops here, field named
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        # Set from another thread: Event.set takes a lock the interrupted frame may hold.
        _log.info("%s received: stopping", signal.Signals(signum).name)
        threading.Thread(target=stop.set, name="migpilot-stop").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    _log.info("fleet: agents for the Nodes %s, %d workers", settings.selector, settings.workers)
    the_fleet = Fleet(api, settings=settings)
    endpoint = None
    if settings.metrics_port is not None:
        try:
            endpoint = the_fleet.serve(port=settings.metrics_port)
        except OSError as err:
            raise errors.AgentConfigError(
                f"cannot serve metrics on port {settings.metrics_port}: {err.strerror or err}"
            ) from None
    try:
        the_fleet.run(stop)
    finally:
        if endpoint is not None:
            endpoint.close()
        api.close()
    _log.info("stopped")
    return 0
