"""The node agent assembled from one settings object: for the CLI, the fleet and the tests.

Why it exists: the agent is a dozen parts (the GPU backend, the reconciler's in-use sources, the
device plugin, the GpuLayout it follows, the pods bound to its node, the unified pool, the MPS
slices, the reporters, the MPS daemons' supervisor, the metrics) and they must be wired the same
way wherever an agent runs. :func:`run` builds and runs the agent ``migpilot agent`` describes
(:class:`Settings`, which the CLI only fills from its flags); :class:`KubeSide` is the agent's
Kubernetes side on one node, built by :func:`kube_side` and wired by :meth:`KubeSide.wire`, the
one wiring the single agent and every node of the fleet (:mod:`migpilot.kwok.fleet`) share; on
a node in DRA mode :func:`wire_dra` wires it with the ResourceSlices' publisher, told of each pass
before the GpuLayout status (the order the controller's steering relies on).

Every check of the settings and of the files they name happens before anything changes (bad
input is a one-line :class:`~migpilot.errors.AgentConfigError`, exit code 2 at the CLI). On a
node without a kubelet (KWOK) the caller hands in the stand-in kubelet's factory
(:data:`StandinFactory`): the agent never imports the KWOK tools, it only knows what a stand-in
must do (:class:`Standin`).

A shell module: it imports no Kubernetes client (the agent's adapter
:mod:`~migpilot.agent.cluster.kube` does) and no gRPC itself (the device plugin's server does)."""

from __future__ import annotations

import datetime
import enum
import functools
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from migpilot import errors, logs, probes
from migpilot.agent import metrics as agent_metrics
from migpilot.agent import reconciling, running, sampling, usage
from migpilot.agent.cluster import (
    boundpods,
    capacity,
    following,
    holding,
    kube,
    kubeapi,
    resourceslices,
    sliceapi,
    startup,
    statics,
    watching,
)
from migpilot.agent.deviceplugin import (
    allocating,
    cdi,
    cdifiles,
    devices,
    podresources,
    resolving,
    serving,
)
from migpilot.agent.dra import node as dra_node
from migpilot.agent.dra import placements, publishing
from migpilot.agent.rules import changes, desired
from migpilot.agent.sharing import mps as agent_mps
from migpilot.agent.sharing import sharingconfig, slicing, timeslicing, unifying
from migpilot.api import gpulayouts, leases
from migpilot.gpu import backend, clocks, emulated, nvml
from migpilot.gpu import mps as gpu_mps
from migpilot.kube import leasereader
from migpilot.sharing import config as sharing_config
from migpilot.sharing import configsets

EXIT_NOT_CONVERGED = 1
"""``--once``: something the desired layouts ask for was refused or failed."""
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
DEFAULT_CDI_SPEC_DIR = cdifiles.DEFAULT_SPEC_DIR
"""Where CDI-aware runtimes (containerd, CRI-O) read dynamic CDI specs by default."""
DEFAULT_MIG_PARTED_CONFIGMAP = "gpu-operator/default-mig-parted-config:config.yaml"
"""The GPU Operator's ConfigMap of mig-parted configs, and its key."""

_log = logging.getLogger("migpilot.agent")


# --- the settings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BackendSettings:
    """The GPUs the agent drives."""

    spec: str = "nvml"
    """The backend (``--backend``): ``nvml``, the driver; or emulated GPUs,
    ``emulated:MODEL:xN[,MODEL:xN...]``. Default ``nvml``."""
    state_file: Path | None = None
    """Emulated GPUs: the file their state survives restarts in (``--state-file``); ``None``:
    none. Default ``None``."""
    emulated_load: Path | None = None
    """Emulated GPUs: the YAML map ``NAMESPACE/POD`` -> what the devices each pod holds report
    (``--emulated-load``); ``None``: every pod idle. Default ``None``."""
    proc_root: Path | None = None
    """The folder holding ``proc/`` whose driver files the CDI spec is made from
    (``--proc-root``); emulated GPUs write their emulated driver files there. ``None``: ``/``
    (NVML); an emulated backend then writes none. Default ``None``."""


@dataclass(frozen=True, slots=True)
class LayoutSettings:
    """Where the desired layouts come from without a cluster (a mig-parted config)."""

    config: Path | None = None
    """The nvidia-mig-parted config file (``--config``); ``None``: keep the layout the GPUs
    have. Default ``None``."""
    config_name: str | None = None
    """The config in :attr:`config` to apply (``-c``). Default ``None``."""
    node_labels: Path | None = None
    """A ``key=value`` file whose ``nvidia.com/mig.config`` line names the config
    (``--node-labels``). Default ``None``."""


@dataclass(frozen=True, slots=True)
class SharingSettings:
    """GPU sharing (time-slicing, MPS) from NVIDIA's device-plugin configs."""

    config_file: Path | None = None
    """One device-plugin config file (``--device-plugin-config``). Default ``None``."""
    configs_dir: Path | None = None
    """A folder of named configs, one picked by the node label ``nvidia.com/device-plugin.
    config`` (``--device-plugin-configs``). Default ``None``."""
    default_config: str | None = None
    """With :attr:`configs_dir`: the config of a node without the label
    (``--device-plugin-config-default``); ``None``: one named ``default``, else no sharing.
    Default ``None``."""
    mps_root: str | None = None
    """Host folder of the MPS daemons' folders (``--mps-root``); ``None``: the config's
    ``flags.mpsRoot``, else ``/run/nvidia/mps``. Default ``None``."""


class KubeletMode(enum.StrEnum):
    """What stands where the kubelet does."""

    REAL = "real"
    """A kubelet: serve it the device plugin and ask its PodResources API."""
    SIMULATED = "simulated"
    """No kubelet (KWOK): the stand-in kubelet publishes the resources and hands out devices."""
    NONE = "none"
    """Standalone: no plugin; only devices with running processes are in use."""


@dataclass(frozen=True, slots=True)
class KubeletSettings:
    """The agent's side of the kubelet: the device plugin and PodResources."""

    mode: KubeletMode = KubeletMode.REAL
    """What stands where the kubelet does (``--kubelet simulated``, ``--no-kubelet``).
    Default ``real``."""
    dir: Path = Path(DEFAULT_KUBELET_DIR)
    """The kubelet's folder, holding ``device-plugins/`` and ``pod-resources/``
    (``--kubelet-dir``). Default ``/var/lib/kubelet``."""
    allocations_file: Path | None = None
    """Where the ledger of devices handed out by Allocate is kept (``--allocations-file``);
    ``None``: ``migpilot/allocations.json`` in :attr:`dir`. Default ``None``."""
    device_list_strategies: tuple[devices.DeviceListStrategy, ...] = (
        devices.DeviceListStrategy.ENVVAR,
    )
    """How Allocate names devices (``--device-list-strategy``). Default ``envvar``."""
    allocate_wait_s: float = 5.0
    """Seconds an Allocate of ``nvidia.com/gpu`` for a pod not known yet waits for it to show
    in the API server (``--allocate-wait``). Default 5."""
    publish_capacity: bool = True
    """In a cluster with a real kubelet: write new MIG device counts into the Node as soon as
    the kubelet lists them (``--no-publish-capacity`` turns it off). Default on."""
    cdi_spec_dir: Path = DEFAULT_CDI_SPEC_DIR
    """With the cdi-cri strategy: where the CDI spec of the advertised devices is written
    (``--cdi-spec-dir``, ``docs/cdi.md``). Default ``/var/run/cdi``."""
    dra: bool = False
    """A node in DRA mode (``migpilot.io/mode: dra``): the DRA kubelet plugin
    (``mig.migpilot.io``) is served too, its sockets below :attr:`dir` and its claims' CDI specs
    in :attr:`cdi_spec_dir` (``docs/dra.md``). Default off."""

    @property
    def cdi(self) -> bool:
        """Whether Allocate answers with CDI names (a spec must then define them)."""
        return devices.DeviceListStrategy.CDI_CRI in self.device_list_strategies


@dataclass(frozen=True, slots=True)
class ClusterSettings:
    """The agent in a cluster: its node's GpuLayout, Node and pods."""

    node: str | None = None
    """This node's name (``--node``); ``None``: no cluster. Default ``None``."""
    kubeconfig: Path | None = None
    """The kubeconfig to reach the API server (``--kubeconfig``); ``None``: in-cluster config.
    Default ``None``."""
    mig_parted_configmap: str = DEFAULT_MIG_PARTED_CONFIGMAP
    """``NS/NAME[:KEY]`` of the ConfigMap of mig-parted configs a static node's label names
    (``--mig-parted-configmap``). Default the GPU Operator's."""
    unified_counters: bool = True
    """Write ``nvidia.com/gpumem``, ``gpumem-percentage`` and ``gpucores`` into the Node
    (``--unified-counters``). Default on."""
    start_patience_s: float = watching.START_PATIENCE_S
    """Seconds each first read of the API server waits out a passing error
    (``--start-patience``). Default 300."""
    lease_namespace: str = leases.NAMESPACE
    """Namespace of the controller's Lease (``--lease-namespace``): on a node in DRA mode the
    planner's placements are listed first only while it is fresh. Default ``migpilot-system``."""
    lease_name: str = leases.NAME
    """The controller's Lease (``--lease-name``). Default ``migpilot-controller``."""


@dataclass(frozen=True, slots=True)
class MetricsSettings:
    """The agent's Prometheus endpoint and GPU sampling."""

    port: int = 0
    """Port of the metrics, ``/healthz`` and ``/readyz`` (``--metrics-port``); 0: off.
    Default 0."""
    address: str = "0.0.0.0"
    """Address the metrics server listens on (``--metrics-address``). Default ``0.0.0.0``."""
    gpu_interval_s: float = 5.0
    """Seconds between two readings of the GPUs' use per device and pod
    (``--gpu-metrics-interval``). Default 5."""


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything ``migpilot agent`` is told: what :func:`run` builds and runs."""

    backend: BackendSettings = field(default_factory=BackendSettings)
    """The GPUs. Default: NVML."""
    layouts: LayoutSettings = field(default_factory=LayoutSettings)
    """The desired layouts without a cluster. Default: keep the GPUs' layout."""
    sharing: SharingSettings = field(default_factory=SharingSettings)
    """GPU sharing. Default: none."""
    kubelet: KubeletSettings = field(default_factory=KubeletSettings)
    """The kubelet's side. Default: a real kubelet in ``/var/lib/kubelet``."""
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    """The cluster. Default: none."""
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    """The metrics. Default: off."""
    strategy: str | None = None
    """MIG strategy (``--strategy``); ``None``: the single sharing config's
    ``flags.migStrategy``, else ``mixed``. Default ``None``."""
    labels_file: Path | None = None
    """Where the GFD labels are written (``--labels-file``); ``None``: not written. Default
    ``None``."""
    interval_s: float = 30.0
    """Seconds between periodic reconciliations (``--interval``). Default 30."""
    once: bool = False
    """Reconcile once, print what was done and exit (``--once``). Default off."""
    log_format: logs.Format | str = logs.Format.TEXT
    """``text`` or ``json`` (``--log-format``). Default ``text``."""
    verbose: bool = False
    """Log debug messages (``-v``). Default off."""


# --- the stand-in kubelet, which the caller brings ---------------------------------------------


class Standin(reconciling.InUse, running.PassListener, unifying.Allocations, Protocol):
    """What the agent asks of a stand-in kubelet (:mod:`migpilot.kwok.standin`): the devices
    it handed to pods are in use, it hears every pass (to publish the Node's resources and hand
    out devices), it is the unified pool's record of hand-outs, and it says who holds what."""

    @property
    def settled(self) -> bool:
        """Whether the last pass's resource counts are in the Node."""
        ...

    def fingerprint(self) -> Hashable:
        """Changes when the node's pods change (a pass is then due)."""
        ...

    def slice_holders(self) -> dict[str, str]:
        """MPS slice device ID -> the pod it is assigned to."""
        ...

    def assigned(self) -> dict[str, tuple[str, ...]]:
        """``namespace/name`` -> the device IDs each pod holds now."""
        ...

    def share_with(self, current: Callable[[], sharing_config.Config]) -> None:
        """Publish the devices as shared by the node's sharing config."""
        ...

    def node_seen(self, doc: Mapping[str, Any] | None) -> None:
        """The Node as a watch saw it (a published count it lost is published again)."""
        ...

    def advertised_counts(self) -> Mapping[str, int] | None:
        """The resource counts it last published into the Node (``None``: none yet, or the
        last publish failed)."""
        ...


@dataclass(frozen=True, slots=True)
class StandinInputs:
    """What a stand-in kubelet is made from."""

    api: kubeapi.NodeApi
    node: str
    strategy: devices.MigStrategy
    pods: boundpods.PodBook
    """The pods bound to the node (a watch keeps them)."""
    spec: Callable[[], gpulayouts.LayoutSpec | None]
    """The GpuLayout spec the agent acts on (its reservations are preferred)."""
    layout: Callable[[], gpulayouts.GpuLayout | None]
    """The GpuLayout as last seen (its status says what pods used before a restart)."""
    unified: Callable[[], resolving.Inputs]
    """The unified pool's inputs, to admit unified pods as Allocate would."""
    dra: bool = False
    """The node is in DRA mode: no device plugin serves it, so the stand-in advertises no
    device-plugin resource and hands out no device (``docs/dra.md``)."""


StandinFactory = Callable[[StandinInputs], Standin]
"""Makes the stand-in kubelet of one node."""


# --- the agent's Kubernetes side ---------------------------------------------------------------


def _never() -> bool:
    return False


def _unknown_counts() -> Mapping[str, int] | None:
    return None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class CurrentSharing:
    """The node's sharing config as the agent serves it, for the parts made before the sharing
    follower is (the reporter's time-slicing replicas, the unified pool, the node counters):
    none until :meth:`follow` names the follower's ``current``."""

    def __init__(self) -> None:
        self._current: Callable[[], sharing_config.Config] = lambda: sharing_config.EMPTY

    def follow(self, current: Callable[[], sharing_config.Config]) -> None:
        """Read the config from ``current`` from now on."""
        self._current = current

    def __call__(self) -> sharing_config.Config:
        """The config served now."""
        return self._current()


@dataclass(frozen=True, slots=True)
class Wired:
    """The agent's inputs and outputs on the Kubernetes side, from :meth:`KubeSide.wire`."""

    in_use: reconciling.InUse
    """What the reconciler must not destroy."""
    listener: running.PassListener
    """Everything told after a pass (the stand-in first, then the reporter and counters)."""
    reporter: following.KubeReporter
    counters: unifying.NodeCounters | None
    used: reconciling.InUse
    """What pods hold (``real``, the stand-in's and the pool's hand-outs): the reporter's
    ``used``."""


@dataclass(frozen=True, slots=True)
class KubeSide:
    """The agent's Kubernetes side on one node: the GpuLayout it follows, the pods bound to
    the node, the unified pool, the MPS slices, and on a KWOK node the stand-in kubelet."""

    api: kubeapi.NodeApi
    source: following.GpuLayoutSource
    pods: boundpods.PodBook
    """The pods bound to the node (the simulated kubelet assigns them devices, and on any node
    their counts keep instances from being destroyed, :mod:`~migpilot.agent.cluster.holding`)."""
    pool: unifying.UnifiedPool
    """The instances set aside for unified pods (``nvidia.com/gpu``), Allocate's inputs."""
    slices: slicing.SliceFilter
    """The GpuLayout's MPS slices, put into the device view (``docs/agent.md``)."""
    kubelet: Standin | None = None
    """On a node without a kubelet: its stand-in."""
    statics: statics.StaticOrDynamic | None = None
    """The layouts: a mig-parted config named by the Node's label, else the GpuLayout."""
    counters: bool = True
    """Write the unified node counters into the Node (``--unified-counters``)."""
    sharing_label: Callable[[], str | None] | None = None
    """With a sharing config set: the Node's ``nvidia.com/device-plugin.config`` label, as the
    static layouts' Node watch sees it."""
    mps_node: Callable[[], bool] = _never
    """Whether the Node is in mode ``mps`` now (its GPUs with MIG off are then reported)."""
    dynamic_mig: Callable[[], bool] = _never
    """Whether the Node is labelled ``migpilot.io/mig-mode=dynamic`` now (the reconciler may
    then switch an idle GPU's MIG mode, ``docs/migmode.md``)."""
    now: Callable[[], str] = _now
    """The time stamp of a status (RFC 3339, seconds)."""
    sharing: CurrentSharing = field(default_factory=CurrentSharing)
    """The node's sharing config (its time-slicing replicas are reported, pooled and counted);
    set by :meth:`share_with`."""
    startup: startup.StartupTaint | None = None
    """Removes the startup taint from the Node once the agent is ready (:meth:`wire` says
    what ready means); fed the Node by the caller's Node watch (:meth:`StartupTaint.node_seen`)."""
    dra: bool = False
    """The node is in DRA mode though no static layouts say so (the fleet reads the label from
    its own Node watch); :attr:`dra_node` also reads :attr:`statics`."""

    @property
    def node(self) -> str:
        """The node's name."""
        return self.source.node

    @property
    def dra_node(self) -> bool:
        """Whether the node is in DRA mode (``migpilot.io/mode=dra``): ResourceSlices are
        published, no device plugin serves it (``docs/dra.md``)."""
        return self.dra or (self.statics is not None and self.statics.dra_node)

    def share_with(self, current: Callable[[], sharing_config.Config]) -> None:
        """The node's sharing config is ``current``'s (the sharing follower's): its replicas are
        reported, pooled for unified pods and counted, and the stand-in advertises them."""
        self.sharing.follow(current)
        if self.kubelet is not None:
            self.kubelet.share_with(current)

    def wire(
        self,
        real: reconciling.InUse,
        *,
        gpus: backend.GpuBackend,
        holders: Callable[[], Mapping[str, str]] = dict,
        advertised: Callable[[], Mapping[str, int] | None] | None = None,
        plan_listed: Callable[[], bool] | None = None,
    ) -> Wired:
        """The agent's in-use source (``real``, the stand-in's pods, the instances the bound
        pods' counts keep, and the GpuLayout's protection) and its reporter (which counts
        ``real`` and the pods' devices as in use; ``holders``: MPS slice -> the pod the kubelet
        gave it to), with the stand-in told first so the status sees its newest assignment.
        The MPS slices' filter reads the same in-use source. The startup taint, told last,
        goes once the reporter has reported and the Node shows ``advertised`` (the counts the
        device plugin's kubelet lists; by default the stand-in's published counts; with
        neither, never: no device plugin serves the node, as with ``--once``).
        ``plan_listed``: on a node in DRA mode, whether its slices list the plan first (the
        status's ``PlanListed`` condition)."""
        kubelet = self.kubelet
        used: reconciling.InUse = real if kubelet is None else reconciling.AnyOf([real, kubelet])
        used = reconciling.AnyOf([used, self.pool])
        self.slices.hold_from(used.in_use)
        owners: list[Callable[[], Mapping[str, str]]] = [holders, self.pool.used_by]
        if kubelet is not None:
            owners.append(kubelet.slice_holders)
        reporter = following.KubeReporter(
            self.api,
            source=self.source,
            in_use=used,
            now=self.now,
            static=self.statics,
            used_by=lambda: {k: v for f in owners for k, v in f().items()},
            mps_node=self.mps_node,
            sharing=self.sharing,
            dynamic_mig=self.dynamic_mig,
            plan_listed=plan_listed,
        )
        listeners: list[running.PassListener] = [reporter]
        if kubelet is not None:
            listeners.insert(0, kubelet)
        counters = None
        # A node in DRA mode serves no device plugin, so no nvidia.com/gpu for a unified pod
        # to go with the counters: written there, they would only mislead (docs/dra.md).
        if self.counters and not self.dra_node:
            counters = unifying.NodeCounters(
                self.api, node=self.node, mps_node=self.mps_node, sharing=self.sharing
            )
            listeners.append(counters)
        if self.startup is not None:
            if advertised is None and kubelet is not None:
                advertised = kubelet.advertised_counts
            self.startup.ready_when(
                reported=lambda: reporter.reported,
                advertised=advertised if advertised is not None else _unknown_counts,
            )
            listeners.append(self.startup)
        keep = holding.BoundPodsHold(
            self.pods, node=self.node, gpus=gpus, allocated=used, unified=self.pool.profiles_for
        )
        in_use = reconciling.AnyOf([used, self.source, keep])
        return Wired(in_use, running.Listeners(listeners), reporter, counters, used)

    def view_filter(self) -> running.ViewFilter:
        """The MPS slices, then the unified pool, put into the device view."""
        return running.ViewFilters([self.slices, self.pool])

    def desired_source(self) -> running.DesiredSource:
        """The static config or the GpuLayout, a pass due also when the unified pool's
        hand-outs or the node's pods change (stand-in kubelet)."""
        base: running.DesiredSource = self.statics if self.statics is not None else self.source
        others: list[Callable[[], Hashable]] = [self.pool.fingerprint]
        if self.kubelet is not None:
            others.append(self.kubelet.fingerprint)
        if self.startup is not None:
            others.append(self.startup.fingerprint)
        return running.AlsoWatching(base, *others)

    def follow_static(self, stop: threading.Event, health: probes.Watches) -> None:
        """Keep the Node's label and the ConfigMap current until ``stop`` (in a thread)."""
        if self.statics is not None:
            self.statics.follow(stop, health=health)

    def follow_pods(self, stop: threading.Event, health: probes.Watches) -> None:
        """Keep :attr:`pods` current until ``stop`` (run it in a thread)."""
        node = self.node
        watching.follow(
            what=f"pods on {node}",
            lister=lambda: self.api.list_pods(node=node),
            watcher=lambda version: self.api.watch_pods(node=node, resource_version=version),
            listed=self.pods.listed,
            changed=self.pods.changed,
            stop=stop,
            health=health,
        )


def kube_side(
    api: kubeapi.NodeApi,
    *,
    source: following.GpuLayoutSource,
    pods: boundpods.PodBook,
    strategy: devices.MigStrategy,
    standin: StandinFactory | None = None,
    statics: statics.StaticOrDynamic | None = None,
    counters: bool = True,
    sharing_label: Callable[[], str | None] | None = None,
    mps_node: Callable[[], bool] | None = None,
    dynamic_mig: Callable[[], bool] | None = None,
    now: Callable[[], str] = _now,
    dra: bool = False,
) -> KubeSide:
    """The Kubernetes side of ``source``'s node: its unified pool and MPS slices over the spec
    the agent acts on, with ``standin`` its stand-in kubelet (the pool's record of hand-outs),
    and its startup taint's remover, fed by ``statics``' Node watch when there is one (the
    fleet feeds it from its own). ``mps_node``: whether the Node is in mode ``mps`` (default:
    the static layouts' Node watch says, else never); ``dynamic_mig``: whether the Node is
    labelled ``migpilot.io/mig-mode=dynamic`` (the same default); ``dra``: the node is in DRA
    mode (default: the static layouts' Node label says, read once)."""

    def spec() -> gpulayouts.LayoutSpec | None:
        return source.acted_on.spec if source.acted_on is not None else None

    sharing = CurrentSharing()
    pool = unifying.UnifiedPool(api, node=source.node, pods=pods, spec=spec, sharing=sharing)
    kubelet = None
    if standin is not None:
        inputs = StandinInputs(
            api=api,
            node=source.node,
            strategy=strategy,
            pods=pods,
            spec=spec,
            layout=source.layout,
            unified=lambda: pool.inputs(fresh=False),
            dra=dra or (statics is not None and statics.dra_node),
        )
        kubelet = standin(inputs)
        pool.attach(kubelet)
    if mps_node is None:
        mps_node = (lambda: statics.mps_node) if statics is not None else _never
    if dynamic_mig is None:
        dynamic_mig = (lambda: statics.dynamic_mig) if statics is not None else _never
    taint = startup.StartupTaint(api, node=source.node)
    if statics is not None:  # the single agent's Node watch (the fleet feeds its own)
        statics.observe(taint.node_seen)
        if kubelet is not None:
            statics.observe(kubelet.node_seen)
    return KubeSide(
        api=api,
        source=source,
        pods=pods,
        pool=pool,
        slices=slicing.SliceFilter(spec=spec, layout=source.layout),
        kubelet=kubelet,
        statics=statics,
        counters=counters,
        sharing_label=sharing_label,
        mps_node=mps_node,
        dynamic_mig=dynamic_mig,
        now=now,
        sharing=sharing,
        startup=taint,
        dra=dra,
    )


# --- the single agent --------------------------------------------------------------------------


def run(settings: Settings, out: IO[str], *, standin: StandinFactory | None = None) -> int:
    """Check the settings, open the backend, run the agent: the exit code. ``standin``: the
    stand-in kubelet's factory, required with :attr:`KubeletMode.SIMULATED`."""
    files = sharing_files(settings.sharing)
    strategy = devices.MigStrategy.parse(_strategy(settings, files))
    kubelet = settings.kubelet
    if kubelet.mode is KubeletMode.SIMULATED:
        if settings.cluster.node is None:
            raise errors.AgentConfigError("--kubelet simulated needs --node NAME")
        if standin is None:
            raise ValueError("a simulated kubelet needs the stand-in kubelet's factory")
    plugin_dir = kubelet.dir / "device-plugins"
    serve = kubelet.mode is KubeletMode.REAL and not settings.once
    if serve and not plugin_dir.is_dir():
        raise errors.AgentConfigError(
            f"kubelet device-plugin folder {plugin_dir} does not exist (see --kubelet-dir, "
            "--no-kubelet)"
        )
    load: sampling.LoadFile | None = None
    if settings.backend.emulated_load is not None:
        if not settings.backend.spec.startswith("emulated"):
            raise errors.AgentConfigError("--emulated-load needs --backend emulated:...")
        load = sampling.LoadFile(settings.backend.emulated_load)
        load.load()  # a bad file stops the agent here, with the field named
    cdi_kind = _check_cdi(settings)
    labels_file = settings.labels_file
    if labels_file is not None and not labels_file.parent.is_dir():
        raise errors.AgentConfigError(
            f"--labels-file {labels_file}: folder {labels_file.parent} does not exist"
        )
    source = desired_source(settings)
    cluster = connect_cluster(
        settings,
        strategy,
        sharing=files is not None,
        standin=standin if kubelet.mode is KubeletMode.SIMULATED else None,
    )
    if cluster is not None:
        source = cluster.desired_source()
    # A bad sharing config for this node fails here, before anything changes.
    _follower(settings, files, strategy=strategy, cluster=cluster, apply=lambda _: None)
    gpus = open_backend(settings.backend, node=settings.cluster.node)
    try:
        # A config that names unknown profiles or cannot be placed on these GPUs fails here,
        # before anything changes.
        state = reconciling.Reconciler(gpus, reconciling.InUseSet()).read()
        if cluster is None:  # a GpuLayout that cannot be applied is reported, not fatal
            source.desired(
                gpus=[s.info for s in state.values()],
                current={g: s.devices for g, s in state.items()},
                in_use=frozenset(),
            )
        # Every line of an agent concerns its node: a field of its own in JSON.
        node = settings.cluster.node
        logs.configure(
            settings.log_format, verbose=settings.verbose, fields={"node": node} if node else None
        )
        agent_settings = running.AgentSettings(
            strategy=strategy,
            interval_s=settings.interval_s,
            labels_file=labels_file,
            mps_root=settings.sharing.mps_root,
        )
        if settings.once:
            return run_once(
                settings,
                gpus=gpus,
                source=source,
                agent_settings=agent_settings,
                out=out,
                cluster=cluster,
                sharing=_follower(
                    settings, files, strategy=strategy, cluster=cluster, apply=lambda _: None
                ),
            )
        plugin_settings = serving.PluginSettings(
            plugin_dir=plugin_dir,
            strategy=strategy,
            allocate=allocating.AllocateSettings(
                device_list_strategies=kubelet.device_list_strategies
            ),
            ledger_file=_ledger_file(kubelet),
            allocate_wait_s=kubelet.allocate_wait_s,
            mps_root=settings.sharing.mps_root,
        )
        return _serve(
            settings,
            gpus=gpus,
            source=source,
            agent_settings=agent_settings,
            plugin_settings=plugin_settings,
            cluster=cluster,
            files=files,
            load=load,
            cdi_writer=_cdi_writer(settings, cdi_kind),
        )
    finally:
        gpus.close()


def _check_cdi(settings: Settings) -> str | None:
    """With the cdi-cri strategy and a device plugin or stand-in kubelet to advertise for: the
    CDI kind (``<vendor>/<class>``), the proc root checked; else ``None``: no spec is written
    (``docs/cdi.md``)."""
    kubelet, backend_settings = settings.kubelet, settings.backend
    root = backend_settings.proc_root
    if root is not None and not root.is_dir():
        raise errors.AgentConfigError(f"--proc-root {root}: not a folder")
    if not kubelet.cdi or kubelet.mode is KubeletMode.NONE or settings.once:
        return None
    if backend_settings.spec.strip() != "nvml" and root is None:
        raise errors.AgentConfigError(
            "--device-list-strategy cdi with an emulated backend needs --proc-root DIR: the "
            "emulated GPUs write their driver files there and the CDI spec is made from them"
        )
    allocate = allocating.AllocateSettings(device_list_strategies=kubelet.device_list_strategies)
    return cdi.check_kind(allocate.cdi_vendor, allocate.cdi_class)


def _cdi_writer(settings: Settings, kind: str | None) -> cdifiles.CdiWriter | None:
    """The CDI spec's writer (its folder created), when :func:`_check_cdi` gave a kind."""
    if kind is None:
        return None
    root = settings.backend.proc_root
    return cdifiles.CdiWriter(
        settings.kubelet.cdi_spec_dir,
        node=settings.cluster.node or socket.gethostname(),
        proc_root=root if root is not None else cdifiles.DEFAULT_PROC_ROOT,
        kind=kind,
    )


def desired_source(settings: Settings) -> running.DesiredSource:
    """The desired-layout source the settings name, checked (file readable, name known)."""
    layouts, cluster = settings.layouts, settings.cluster
    if cluster.node is not None and layouts.config is not None:
        raise errors.AgentConfigError(
            "--config does not apply with --node: in a cluster a static node's mig-parted file "
            "is read from a ConfigMap (--mig-parted-configmap NS/NAME[:KEY]), the config named "
            "by the Node's nvidia.com/mig.config label"
        )
    if cluster.node is None and cluster.kubeconfig is not None:
        raise errors.AgentConfigError("--kubeconfig needs --node NAME")
    if layouts.config is None:
        labels_for_sharing = (
            layouts.node_labels is not None and settings.sharing.configs_dir is not None
        )
        if layouts.config_name is not None or (
            layouts.node_labels is not None and not labels_for_sharing
        ):
            flag = "-c" if layouts.config_name is not None else "--node-labels"
            raise errors.AgentConfigError(f"{flag} needs --config FILE (a mig-parted config)")
        return running.KeepLayout()
    if layouts.config_name is None and layouts.node_labels is None:
        raise errors.AgentConfigError(
            "--config needs -c NAME or --node-labels FILE to say which config to apply"
        )
    source = running.MigPartedConfig(
        layouts.config, name=layouts.config_name, labels_path=layouts.node_labels
    )
    name = source.config_name()
    if name is not None:
        # Checks the name alone (no GPUs yet): unknown names fail with a did-you-mean hint.
        desired.from_migparted(source.load(), name, gpus=())
    return source


def connect_cluster(
    settings: Settings,
    strategy: devices.MigStrategy,
    *,
    sharing: bool = False,
    standin: StandinFactory | None = None,
) -> KubeSide | None:
    """With a node: connect and read the node's GpuLayout, Node and pods once (errors stop the
    agent); ``None`` without one."""
    cluster = settings.cluster
    node = cluster.node
    if node is None:
        return None
    configmap = statics.ConfigMapRef.parse(cluster.mig_parted_configmap)  # before connecting
    api = kube.connect(cluster.kubeconfig)
    source = following.GpuLayoutSource(api, node=node)
    # The first reads wait out what the API server says is passing (429 "storage is
    # (re)initializing" just after the GpuLayout CRD is created, a 5xx, no answer yet), each
    # for --start-patience seconds.
    patience = float(cluster.start_patience_s)
    watching.retrying(source.sync, what=f"GpuLayout {node}", patience_s=patience)
    static = statics.StaticOrDynamic(api, dynamic=source, configmap=configmap)
    watching.retrying(static.sync, what=f"Node {node}", patience_s=patience)
    book = boundpods.PodBook()
    pods = watching.retrying(
        lambda: api.list_pods(node=node), what=f"pods on {node}", patience_s=patience
    )
    book.listed(pods.items)
    label: Callable[[], str | None] | None = None
    if sharing:
        # The Node watch of the static layouts carries every label: no second watch.
        label = functools.partial(static.node_label, configsets.CONFIG_LABEL)
    return kube_side(
        api,
        source=source,
        pods=book,
        strategy=strategy,
        standin=standin,
        statics=static,
        counters=cluster.unified_counters,
        sharing_label=label,
    )


def open_backend(settings: BackendSettings, *, node: str | None) -> backend.GpuBackend:
    """The GPU backend the settings name (emulated GPUs' UUIDs derive from ``node``)."""
    spec = settings.spec.strip()
    if spec == "nvml":
        if settings.state_file is not None:
            raise errors.AgentConfigError("--state-file applies only to an emulated backend")
        return nvml.NvmlBackend()
    parsed = emulated.parse_spec(spec)
    state = settings.state_file
    if state is not None and not state.parent.is_dir():
        raise errors.AgentConfigError(f"--state-file {state}: folder {state.parent} does not exist")
    return emulated.EmulatedBackend(
        parsed.models,
        proc_root=settings.proc_root,
        pci_ids=parsed.pci_ids,
        mig_enabled=parsed.mig_enabled,
        state_path=state,
        clock=clocks.SystemClock(),
        times=emulated.OperationTimes(),
        seed=emulated.seed_for(node) if node else 0,
    )


def sharing_files(settings: SharingSettings) -> sharingconfig.ConfigFiles | None:
    """The sharing config files the settings name, every one checked (bad: exit 2)."""
    if settings.config_file is not None and settings.configs_dir is not None:
        raise errors.AgentConfigError(
            "--device-plugin-config FILE and --device-plugin-configs DIR exclude each other"
        )
    if settings.default_config is not None and settings.configs_dir is None:
        raise errors.AgentConfigError(
            "--device-plugin-config-default needs --device-plugin-configs"
        )
    if settings.config_file is not None:
        single = sharingconfig.SingleFile(settings.config_file)
        single.load(None)
        return single
    if settings.configs_dir is not None:
        folder = settings.configs_dir
        if not folder.is_dir():
            raise errors.AgentConfigError(f"--device-plugin-configs {folder}: not a folder")
        named = sharingconfig.NamedSet(
            folder, selection=configsets.Selection(default=settings.default_config)
        )
        named.check_all()
        return named
    return None


def _strategy(settings: Settings, files: sharingconfig.ConfigFiles | None) -> str:
    """``--strategy``, else the single config file's ``flags.migStrategy``, else mixed."""
    if settings.strategy is not None:
        return settings.strategy
    if isinstance(files, sharingconfig.SingleFile):
        found = files.load(None)[1].mig_strategy
        if found is not None:
            return found
    return devices.MigStrategy.MIXED.value


def _sharing_label(settings: Settings, cluster: KubeSide | None) -> Callable[[], str | None]:
    """Where the node's ``nvidia.com/device-plugin.config`` label is read."""
    if cluster is not None and cluster.sharing_label is not None:
        return cluster.sharing_label
    if settings.layouts.node_labels is not None:
        return sharingconfig.LabelsFileLabel(settings.layouts.node_labels)
    return sharingconfig.no_label


def _follower(
    settings: Settings,
    files: sharingconfig.ConfigFiles | None,
    *,
    strategy: devices.MigStrategy,
    cluster: KubeSide | None,
    apply: Callable[[sharing_config.Config], None],
) -> sharingconfig.SharingFollower | None:
    """The sharing follower, its config for the node checked now (bad: exit 2)."""
    if files is None:
        return None
    follower = sharingconfig.SharingFollower(
        files, apply=apply, mig_strategy=strategy.value, label=_sharing_label(settings, cluster)
    )
    follower.check()
    return follower


def _ledger_file(settings: KubeletSettings) -> Path:
    """The Allocate ledger's file, or its default in the kubelet folder; its folder exists
    after."""
    path = (
        settings.allocations_file
        if settings.allocations_file is not None
        else settings.dir / "migpilot" / "allocations.json"
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise errors.AgentConfigError(
            f"--allocations-file {path}: cannot create {path.parent}: {err.strerror or err}"
        ) from None
    return path


def _publisher(
    cluster: KubeSide, plugin: serving.DevicePlugin, client: podresources.PodResourcesClient
) -> capacity.CapacityPublisher:
    """Publishes the kubelet's new device counts into the Node at once (``agent/capacity.py``)."""

    def advertised() -> dict[str, frozenset[str]]:
        return {
            name: frozenset(d.id for d in devs if d.health is devices.Health.HEALTHY)
            for name, devs in plugin.advertised().items()
        }

    return capacity.CapacityPublisher(
        cluster.api, node=cluster.node, kubelet=client, advertised=advertised
    )


def _registered_counts(
    plugin: serving.DevicePlugin,
) -> Callable[[], Mapping[str, int] | None]:
    """What the Node must show before the startup taint goes, on a node with a kubelet: the
    healthy devices of each resource the device plugin advertises that the kubelet's Node
    carries (``capacity.published``: MIG resources and ``nvidia.com/gpu``), once every
    advertised resource is registered with the kubelet (``None`` before)."""

    def counts() -> Mapping[str, int] | None:
        offered = plugin.advertised()
        if not offered.keys() <= plugin.registered():
            return None
        return {
            name: sum(d.health is devices.Health.HEALTHY for d in devs)
            for name, devs in offered.items()
            if capacity.published(name)
        }

    return counts


def _kubelet_in_use(
    gpus: backend.GpuBackend,
    *,
    kubelet_dir: Path,
    plugin: serving.DevicePlugin | None,
    timeout_s: float,
    cluster: KubeSide | None = None,
) -> tuple[reconciling.InUse, podresources.PodResourcesClient, podresources.KubeletInUse]:
    """The kubelet as an in-use source that fails closed: while it cannot be asked, every MIG
    device and every MPS slice served is in use."""
    sock = kubelet_dir / "pod-resources" / "kubelet.sock"
    client = podresources.PodResourcesClient(sock, timeout_s=timeout_s)
    kubelet = podresources.KubeletInUse(client, plugin)
    served = cluster.slices.served_ids if cluster is not None else frozenset
    source = running.FailClosed(
        running.PodResourcesInUse(kubelet, socket_path=sock),
        everything=lambda: running.every_uuid(gpus) | served(),
        failures=(podresources.PodResourcesError,),
        what="the kubelet's PodResources API",
    )
    return source, client, kubelet


def run_once(
    settings: Settings,
    *,
    gpus: backend.GpuBackend,
    source: running.DesiredSource,
    agent_settings: running.AgentSettings,
    out: IO[str],
    cluster: KubeSide | None,
    sharing: sharingconfig.SharingFollower | None,
) -> int:
    """One pass, what it did printed to ``out``: 0 when the node reached its desired layouts,
    :data:`EXIT_NOT_CONVERGED` when something was refused or failed."""
    sources: list[reconciling.InUse] = [reconciling.RunningProcesses(gpus)]
    client = None
    holders: Callable[[], Mapping[str, str]] = dict
    if settings.kubelet.mode is KubeletMode.REAL:
        kubelet, client, asked = _kubelet_in_use(
            gpus, kubelet_dir=settings.kubelet.dir, plugin=None, timeout_s=5.0, cluster=cluster
        )
        sources.append(kubelet)
        holders = asked.holders
    in_use: reconciling.InUse = reconciling.AnyOf(sources)
    listener = None
    if sharing is not None and cluster is not None:
        cluster.share_with(sharing.current)
    if cluster is not None:
        wired = cluster.wire(in_use, gpus=gpus, holders=holders)
        in_use, listener = wired.in_use, wired.listener
    agent = running.Agent(
        gpus=gpus,
        in_use=in_use,
        source=source,
        plugin=None,
        agent_metrics=agent_metrics.AgentMetrics(),
        clock=clocks.SystemClock(),
        settings=agent_settings,
        listener=listener,
        view_filter=cluster.view_filter() if cluster is not None else None,
        sharing=sharing,
        dynamic_mig=cluster.dynamic_mig if cluster is not None else None,
    )
    try:
        report = agent.start()
    finally:
        if client is not None:
            client.close()
    for applied in report.applied:
        detail = f": {applied.detail}" if applied.detail else ""
        out.write(f"{applied.outcome.value:8} {applied.change}{detail}\n")
    for refusal in report.refusals:
        out.write(f"not done {refusal}\n")
    for index in sorted(report.devices):
        layout = report.layout(index)
        out.write(f"GPU {index}: {layout if layout.instances else '(no MIG instances)'}\n")
    failed = report.outcomes(changes.Outcome.FAILED) or report.outcomes(changes.Outcome.REFUSED)
    if report.converged and not report.refusals and not failed:
        return 0
    return EXIT_NOT_CONVERGED


def _serve(
    settings: Settings,
    *,
    gpus: backend.GpuBackend,
    source: running.DesiredSource,
    agent_settings: running.AgentSettings,
    plugin_settings: serving.PluginSettings,
    cluster: KubeSide | None,
    files: sharingconfig.ConfigFiles | None,
    load: sampling.LoadFile | None,
    cdi_writer: cdifiles.CdiWriter | None = None,
) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        # Set from another thread: Event.set takes a lock the interrupted frame may hold.
        _log.info("%s received: stopping", signal.Signals(signum).name)
        threading.Thread(target=stop.set, name="migpilot-stop").start()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    the_metrics = agent_metrics.AgentMetrics()
    watches = probes.Watches(time.monotonic)  # /healthz fails while one of them is down
    plugin: serving.DevicePlugin | None = None
    client: podresources.PodResourcesClient | None = None
    sources: list[reconciling.InUse] = [reconciling.RunningProcesses(gpus)]
    holders: Callable[[], Mapping[str, str]] = dict
    dra_mode = cluster is not None and cluster.dra_node  # ResourceSlices, no device plugin
    if settings.kubelet.mode is KubeletMode.REAL:
        if not dra_mode:
            plugin = serving.DevicePlugin(
                plugin_settings,
                unified=cluster.pool if cluster is not None else None,
                cdi=cdi_writer,
            )
        if cluster is not None and plugin is not None:
            cluster.pool.attach(plugin)  # the plugin's ledger says what Allocate handed out
        kubelet, client, asked = _kubelet_in_use(
            gpus,
            kubelet_dir=settings.kubelet.dir,
            plugin=plugin,
            timeout_s=plugin_settings.rpc_timeout_s,
            cluster=cluster,
        )
        sources += [kubelet] if plugin is None else [kubelet, running.HandedOut(plugin)]
        holders = asked.holders
    sharing = _follower(
        settings,
        files,
        strategy=plugin_settings.strategy,
        cluster=cluster,
        apply=plugin.set_sharing if plugin is not None else lambda _: None,
    )
    if sharing is not None and cluster is not None:
        cluster.share_with(sharing.current)
    dra = _dra(settings, gpus, cluster, reconciling.AnyOf(list(sources)), on=dra_mode)
    if dra is not None:
        sources.append(dra.instances)  # claims' instances are used: never destroyed as stray
        # A claim prepared or released makes a pass due at once, so the GpuLayout status says
        # an instance was taken or freed now, not at the next periodic pass: the controller
        # steers claims only onto capacity it has seen freed (docs/dra.md, "The agent's pass").
        source = running.AlsoWatching(source, dra.instances.owned)
    in_use: reconciling.InUse = reconciling.AnyOf(sources)
    listener: running.PassListener | None = None
    publisher: capacity.CapacityPublisher | None = None
    if cluster is not None:
        if dra_mode:
            wired_dra = wire_dra(
                cluster,
                in_use,
                gpus=gpus,
                settings=settings.cluster,
                holders=holders,
                claimed=dra.instances.claimed if dra is not None else None,
            )
            in_use, listener = wired_dra.wired.in_use, wired_dra.listener
        else:
            advertised = _registered_counts(plugin) if plugin is not None else None
            wired = cluster.wire(in_use, gpus=gpus, holders=holders, advertised=advertised)
            in_use, listener = wired.in_use, wired.listener
        if plugin is None and cdi_writer is not None:
            # The stand-in kubelet publishes the Node's counts when told of the pass: the spec
            # is written first.
            first = cdifiles.CdiListener(cdi_writer, strategy=plugin_settings.strategy)
            listener = running.Listeners([first, listener])
        if plugin is not None and client is not None and settings.kubelet.publish_capacity:
            publisher = _publisher(cluster, plugin, client)
            listener = running.Listeners([listener, publisher])
        threading.Thread(
            target=cluster.source.follow,
            args=(stop,),
            kwargs={"health": watches},
            name="migpilot-gpulayout",
            daemon=True,
        ).start()  # daemon: a watch blocks until the next event; stopping does not wait for it
        threading.Thread(
            target=cluster.follow_pods, args=(stop, watches), name="migpilot-pods", daemon=True
        ).start()
        threading.Thread(
            target=cluster.follow_static, args=(stop, watches), name="migpilot-static", daemon=True
        ).start()
    agent = running.Agent(
        gpus=gpus,
        in_use=in_use,
        source=source,
        plugin=plugin,
        agent_metrics=the_metrics,
        clock=clocks.SystemClock(),
        settings=agent_settings,
        listener=listener,
        view_filter=cluster.view_filter() if cluster is not None else None,
        sharing=sharing,
        dynamic_mig=cluster.dynamic_mig if cluster is not None else None,
        # Daemons for the sharing config's MPS resources and for the GpuLayout's MPS slices.
        mps=_mps_supervisor(settings) if files is not None or cluster is not None else None,
    )
    server = None
    metrics = settings.metrics
    try:
        if metrics.port:
            _start_sampler(
                settings,
                gpus=gpus,
                agent=agent,
                sink=the_metrics,
                stop=stop,
                client=client,
                cluster=cluster,
                in_use=in_use,
                load=load,
            )
            try:
                server = running.MetricsServer(
                    the_metrics,
                    port=metrics.port,
                    address=metrics.address,
                    live=probes.all_of(agent.heartbeat.check, watches.check),
                    ready=agent.not_ready,
                )
            except OSError as err:
                raise errors.AgentConfigError(
                    f"cannot serve metrics on {metrics.address}:{metrics.port}: "
                    f"{err.strerror or err}"
                ) from None
        if dra is not None:
            dra.start()
        agent.start()
        if publisher is not None:
            publisher.check()  # the first pass ran before the plugin served its devices
        agent.run(stop)
    finally:
        agent.stop()
        if dra is not None:
            dra.stop()
        if publisher is not None:
            publisher.close()
        if server is not None:
            server.close()
        if client is not None:
            client.close()
    _log.info("stopped")
    return 0


def _dra(
    settings: Settings,
    gpus: backend.GpuBackend,
    cluster: KubeSide | None,
    in_use: reconciling.InUse,
    *,
    on: bool,
) -> dra_node.DraNode | None:
    """On a DRA-mode node (``on``: its Node is labelled ``migpilot.io/mode=dra``, or
    ``KubeletSettings.dra``): the DRA kubelet plugin for the kubelet (or the stand-in that
    speaks its API) in the kubelet folder, built, to be started (``docs/dra.md``). ``in_use``:
    the agent's other in-use sources, asked before a claim's instance goes."""
    kubelet = settings.kubelet
    if not (on or kubelet.dra):
        return None
    if cluster is None or kubelet.mode is KubeletMode.NONE:
        raise errors.AgentConfigError(
            "DRA mode needs --node NAME (claims are read from the API) and a kubelet"
        )
    root = settings.backend.proc_root
    paths = dra_node.DraPaths(
        kubelet_dir=kubelet.dir,
        cdi_spec_dir=kubelet.cdi_spec_dir,
        proc_root=root if root is not None else cdifiles.DEFAULT_PROC_ROOT,
    )
    return dra_node.build(gpus, cluster.api, node=cluster.node, paths=paths, in_use=in_use)


def dra_steering(
    slices: resourceslices.SlicePublisher,
    cluster: KubeSide,
    settings: ClusterSettings,
    *,
    clock: Callable[[], float] = time.time,
    lease: leasereader.LeaseReader | None = None,
) -> None:
    """On a node in DRA mode: the GpuLayout's spec is the planner's target, whose placements
    for pods the DRA plugin makes (not the reconciler), and which the publisher lists first
    while the controller's Lease is fresh by ``clock`` (epoch seconds; ``docs/dra.md``,
    "Steering kube-scheduler"). ``lease``: the Lease's reader to share (the fleet's nodes read
    one), else one of the node's own."""
    api = cluster.api
    if not isinstance(api, sliceapi.SliceSource):  # dra_publisher checked it
        raise errors.AgentConfigError("this Kubernetes client cannot read the controller's Lease")
    source = cluster.source
    source.for_dra()
    if lease is None:
        lease = controller_lease(api, settings, clock=clock)

    def planned() -> tuple[placements.Placement, ...]:
        layout = source.layout()
        return publishing.planned_placements(layout.spec if layout is not None else None)

    slices.steer_from(planned, fresh=lease.fresh)


def controller_lease(
    api: sliceapi.SliceSource,
    settings: ClusterSettings,
    *,
    clock: Callable[[], float] = time.time,
) -> leasereader.LeaseReader:
    """The reader of the controller's Lease that DRA steering asks (``settings`` name it)."""
    lease_api = api.slices()
    return resourceslices.controller_lease(
        lambda: lease_api.get_lease(settings.lease_namespace, settings.lease_name), clock=clock
    )


def dra_publisher(cluster: KubeSide | None) -> resourceslices.SlicePublisher | None:
    """On a Node labelled ``migpilot.io/mode=dra`` when the agent starts: the publisher of its
    ResourceSlices (``docs/dra.md``, "Publishing"), which the agent serves instead of the
    device plugin; else ``None``. The label is read once: a change takes effect when the agent
    restarts."""
    if cluster is None or not cluster.dra_node:
        return None
    api = cluster.api
    if not isinstance(api, sliceapi.SliceSource):
        raise errors.AgentConfigError(
            f"Node {cluster.node} is labelled migpilot.io/mode=dra, but this Kubernetes client "
            "cannot publish ResourceSlices"
        )
    _log.info("Node %s is in DRA mode: publishing ResourceSlices of mig.migpilot.io, no device "
              "plugin", cluster.node, extra=logs.about(node=cluster.node))  # fmt: skip
    return resourceslices.SlicePublisher(api.slices(), node=cluster.node)


@dataclass(frozen=True, slots=True)
class DraWired:
    """A node in DRA mode's Kubernetes side, wired by :func:`wire_dra`."""

    slices: resourceslices.SlicePublisher
    """The node's ResourceSlices' publisher, listing the GpuLayout's plan first while the
    controller's Lease is fresh."""
    wired: Wired
    """As :meth:`KubeSide.wire` makes it, its status reporting the slices' ``PlanListed``."""
    listener: running.PassListener
    """Told after each pass: the slices, then :attr:`Wired.listener` (the stand-in, the
    GpuLayout status, the startup taint)."""


def wire_dra(
    cluster: KubeSide,
    real: reconciling.InUse,
    *,
    gpus: backend.GpuBackend,
    settings: ClusterSettings,
    holders: Callable[[], Mapping[str, str]] = dict,
    claimed: Callable[[], Mapping[str, str]] | None = None,
    clock: Callable[[], float] = time.time,
    lease: leasereader.LeaseReader | None = None,
) -> DraWired:
    """The Kubernetes side of a node in DRA mode wired (:meth:`KubeSide.wire`, with ``real``,
    ``gpus`` and ``holders``), with its ResourceSlices' publisher (:func:`dra_publisher`)
    offering what the wired sources do not hold and what ``claimed`` (the kubelet plugin's
    ledger, UUID -> claim UID) says claims own, steered by the GpuLayout's plan
    (:func:`dra_steering`, with ``settings``, ``clock`` and ``lease``). The one wiring of the
    single agent, the fleet's nodes and the tests; a caller puts its own listeners before or
    after :attr:`DraWired.listener`, never between.

    The slices are told of a pass before the GpuLayout status: once the status reports the
    spec's generation with ``PlanListed`` true, the controller lets go the pods it steers to
    the target, which the slices must list first by then (``controller/pinning.listed``); the
    status's ``PlanListed`` is what the publisher wrote in this pass, not the last one."""
    slices = dra_publisher(cluster)
    if slices is None:
        raise ValueError(f"Node {cluster.node} is not in DRA mode")
    wired = cluster.wire(
        real,
        gpus=gpus,
        holders=holders,
        advertised=slices.advertised,
        plan_listed=slices.plan_listed,
    )
    if claimed is not None:
        slices.claims_from(claimed)  # offered again: the claim is known
    slices.use_from(wired.in_use.in_use)
    dra_steering(slices, cluster, settings, clock=clock, lease=lease)
    return DraWired(slices, wired, running.Listeners([slices, wired.listener]))


def _mps_supervisor(settings: Settings) -> agent_mps.MpsSupervisor:
    """The MPS daemons' supervisor for a node with a sharing config: NVIDIA's real
    ``nvidia-cuda-mps-control`` beside the NVML backend (a node without it gets its MPS state
    ``failed``, with the reason logged), the emulated daemon beside emulated GPUs. Daemons
    outlive the agent: the next one adopts them."""
    clock = clocks.SystemClock()
    control: gpu_mps.MpsControl
    if settings.backend.spec.strip() == "nvml":
        control = gpu_mps.ProcessMps(clock=clock)
    else:
        control = gpu_mps.EmulatedMps(clock=clock)
    return agent_mps.MpsSupervisor(control, clock=clock)


def _start_sampler(
    settings: Settings,
    *,
    gpus: backend.GpuBackend,
    agent: running.Agent,
    sink: agent_metrics.AgentMetrics,
    stop: threading.Event,
    client: podresources.PodResourcesClient | None,
    cluster: KubeSide | None,
    in_use: reconciling.InUse,
    load: sampling.LoadFile | None,
) -> None:
    """Sample the GPUs' use per device and pod every ``--gpu-metrics-interval`` (a thread)."""
    holdings: sampling.Holdings = list
    if client is not None:
        holdings = sampling.pod_resources_holdings(client.list)
    elif cluster is not None and cluster.kubelet is not None:
        holdings = standin_holdings(cluster.kubelet, agent)
    driven = gpus if isinstance(gpus, emulated.EmulatedBackend) else None
    node = settings.cluster.node
    if driven is not None:
        owners = sampling.emulated_owners(driven)
    else:
        book = cluster.pods if cluster is not None else None
        owners = sampling.proc_owners(
            (lambda: {p.uid: p.key for p in book.pods(node or "") if p.uid})
            if book is not None
            else dict
        )

    def used() -> frozenset[str]:
        try:
            return in_use.in_use()
        except Exception:  # the kubelet unreachable: the holdings still say what is used
            return frozenset()

    def reserved() -> frozenset[str]:
        if cluster is None:
            return frozenset()
        acted = cluster.source.acted_on
        return usage.reserved_instances(acted.spec if acted is not None else None, agent.view())

    sampling.GpuSampler(
        node=node or socket.gethostname(),
        gpus=gpus,
        view=agent.view,
        holdings=holdings,
        sink=sink,
        owners=owners,
        interval_s=settings.metrics.gpu_interval_s,
        in_use=used,
        reserved=reserved,
        replicas=replica_statuses(cluster, agent, used) if cluster is not None else dict,
        load=load,
        driven=driven,
    ).start(stop)


def replica_statuses(
    cluster: KubeSide, agent: running.Agent, in_use: Callable[[], frozenset[str]]
) -> sampling.Replicas:
    """The time-slicing replicas' statuses as the reporter computes them for the GpuLayout
    (:func:`timeslicing.statuses`: the node's sharing config, the spec acted on, the devices in
    use), for the sampler's layout series."""

    def now() -> Mapping[int, tuple[gpulayouts.ReplicaStatus, ...]]:
        acted = cluster.source.acted_on
        return timeslicing.statuses(
            agent.view(),
            sharing=cluster.sharing(),
            spec=acted.spec if acted is not None else None,
            in_use=in_use(),
            used_by={},
        )

    return now


def standin_holdings(kubelet: Standin, agent: running.Agent) -> sampling.Holdings:
    """Who holds which device, as the stand-in kubelet handed them out (for the sampler)."""
    return sampling.assigned_holdings(
        kubelet.assigned,
        lambda: {k: a.containers for k, a in kubelet.pod_allocations().items()},
        agent.view,
    )
