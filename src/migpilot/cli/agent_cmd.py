"""``migpilot agent``: the node agent as a command (reconcile MIG layouts, serve the kubelet).

The shell around :mod:`migpilot.agent.running`: it checks every flag and the desired-layout
files before anything starts (bad input is one line and exit code 2), opens the GPU backend,
wires the reconciler's in-use sources (kubelet PodResources, the plugin's Allocate ledger,
running processes), the device plugin, the labels file and the metrics server, and runs the loop
until SIGTERM or SIGINT. ``--once`` reconciles once, prints what it did and exits: 0 when the
node reached its desired layouts, 1 when something was refused or failed.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from migpilot import digits, errors, logs, probes
from migpilot.agent import (
    capacity,
    desired,
    following,
    holding,
    kube,
    kubeapi,
    reconciling,
    running,
    sampling,
    sharingconfig,
    slicing,
    standin,
    statics,
    unifying,
    usage,
    watching,
)
from migpilot.agent import metrics as agent_metrics
from migpilot.agent import mps as agent_mps
from migpilot.agent.deviceplugin import allocating, devices, podresources, serving
from migpilot.api import gpulayouts
from migpilot.gpu import backend, clocks, emulated, nvml
from migpilot.gpu import mps as gpu_mps
from migpilot.sharing import config as sharing_config
from migpilot.sharing import configsets

EXIT_NOT_CONVERGED = 1
"""``--once``: something the desired layouts ask for was refused or failed."""
DEFAULT_KUBELET_DIR = "/var/lib/kubelet"
SIMULATED = "simulated"
"""``--kubelet simulated``: the stand-in kubelet of :mod:`migpilot.agent.standin`."""

_log = logging.getLogger("migpilot.agent")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``agent`` to the top-level subparsers."""
    p = subparsers.add_parser(
        "agent",
        help="run the node agent: reconcile MIG layouts and serve the kubelet device plugin",
        description=(
            "Reconcile the GPUs of this node towards desired MIG layouts (a mig-parted config), "
            "never destroying an instance in use, and advertise the MIG devices to the kubelet "
            "as NVIDIA's device plugin does, without ever restarting. Stops on SIGTERM/SIGINT."
        ),
    )
    p.add_argument(
        "--backend",
        default="nvml",
        metavar="nvml|emulated:MODEL:xN",
        help="GPU backend: the driver through NVML (default), or emulated GPUs, e.g. "
        "emulated:h100-80gb:x8 or emulated:a100-80gb:x4,a30:x2; a GPU may be named by its PCI "
        "id and board instead of a model: emulated:0x233010DE:0x16C110DE:x8",
    )
    p.add_argument(
        "--state-file",
        metavar="FILE",
        help="emulated backend: keep the GPUs' state in this file (survives restarts)",
    )
    p.add_argument(
        "--strategy",
        default=None,
        metavar="none|single|mixed",
        help="MIG strategy, as NVIDIA's --mig-strategy (default: the --device-plugin-config "
        "file's flags.migStrategy, else mixed)",
    )
    p.add_argument(
        "--device-plugin-config",
        metavar="FILE",
        help="GPU sharing (time-slicing, MPS) from NVIDIA's device-plugin config file, the one "
        "its plugin takes with --config-file (re-read when it changes; see docs/sharing.md)",
    )
    p.add_argument(
        "--device-plugin-configs",
        metavar="DIR",
        help="a folder (or mounted ConfigMap) of named device-plugin configs; the node label "
        "nvidia.com/device-plugin.config picks one (from the Node with --node, else from "
        "--node-labels), as NVIDIA's config-manager",
    )
    p.add_argument(
        "--device-plugin-config-default",
        metavar="NAME",
        help="with --device-plugin-configs: the config of a node without the label (default: "
        "one named 'default', else no sharing)",
    )
    p.add_argument(
        "--mps-root",
        metavar="DIR",
        help="host folder of the MPS daemons' pipe and log folders (default: the config's "
        "flags.mpsRoot, else /run/nvidia/mps)",
    )
    p.add_argument(
        "--device-list-strategy",
        default="envvar",
        metavar="envvar|cdi[,...]",
        help="how Allocate names devices: NVIDIA_VISIBLE_DEVICES (envvar, default) or CDI names "
        "(cdi, i.e. cdi-cri); both with envvar,cdi",
    )
    p.add_argument(
        "--kubelet-dir",
        default=DEFAULT_KUBELET_DIR,
        metavar="DIR",
        help="the kubelet's folder, holding device-plugins/ and pod-resources/ "
        f"(default: {DEFAULT_KUBELET_DIR})",
    )
    p.add_argument(
        "--kubelet",
        metavar="DIR|simulated",
        help="the kubelet's folder (as --kubelet-dir), or 'simulated' with --node on a node with "
        "no kubelet (KWOK): serve no device plugin and publish its resource counts into the "
        "Node's capacity and allocatable, for tests and demos",
    )
    p.add_argument(
        "--allocations-file",
        default=None,
        metavar="FILE",
        help="where the ledger of devices handed out by Allocate is kept across agent restarts "
        "(default: migpilot/allocations.json in --kubelet-dir; its folder is created)",
    )
    p.add_argument(
        "--no-kubelet",
        action="store_true",
        help="standalone: no kubelet on this machine; serve no device plugin and count only "
        "devices with running processes as in use",
    )
    p.add_argument(
        "--node",
        metavar="NAME",
        help="in a cluster: this node's name; the desired layouts come from the GpuLayout of "
        "that name (watched), which gets the status, and the Node gets the GFD labels",
    )
    p.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="with --node: the kubeconfig to reach the API server (default: in-cluster config)",
    )
    p.add_argument(
        "--config",
        metavar="FILE",
        help="nvidia-mig-parted config file with the desired layouts (re-read when it changes)",
    )
    which = p.add_mutually_exclusive_group()
    which.add_argument(
        "-c",
        "--config-name",
        metavar="NAME",
        help="the config in --config to apply (as mig-parted's -c)",
    )
    which.add_argument(
        "--node-labels",
        metavar="FILE",
        help="key=value lines; the nvidia.com/mig.config line names the config to apply, as "
        "mig-manager reads the node label (re-read when it changes)",
    )
    p.add_argument(
        "--labels-file",
        metavar="FILE",
        help="write the GFD node labels here as key=value lines (GFD's --output-file format)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        default=0,
        metavar="N",
        help="serve Prometheus metrics on this port (default: 0, off)",
    )
    p.add_argument(
        "--metrics-address",
        default="0.0.0.0",
        metavar="ADDR",
        help="address the metrics server listens on (default: 0.0.0.0)",
    )
    p.add_argument(
        "--interval",
        type=_seconds,
        default=30.0,
        metavar="S",
        help="seconds between periodic reconciliations (default: 30); file changes are seen "
        "within a second",
    )
    p.add_argument(
        "--mig-parted-configmap",
        default="gpu-operator/default-mig-parted-config:config.yaml",
        metavar="NS/NAME[:KEY]",
        help="with --node: while the Node has the label nvidia.com/mig.config=NAME, lay its GPUs "
        "out from config NAME of the mig-parted file in this ConfigMap, as mig-manager does "
        "(default: the GPU Operator's gpu-operator/default-mig-parted-config:config.yaml)",
    )
    p.add_argument(
        "--no-publish-capacity",
        action="store_true",
        help="with --node and a real kubelet: do not write new MIG device counts into the Node "
        "as soon as the kubelet lists them; wait for the kubelet's own status sync (10 s)",
    )
    p.add_argument(
        "--unified-counters",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --node: write nvidia.com/gpumem (MiB), nvidia.com/gpumem-percentage and "
        "nvidia.com/gpucores (100 per MIG GPU) into the Node's capacity and allocatable, so that "
        "pods asking for them (unified requests, HAMi's spelling) are admitted (default: on)",
    )
    p.add_argument(
        "--allocate-wait",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="how long an Allocate of nvidia.com/gpu for a pod the agent does not know yet waits "
        "for it to show in the API server before failing (default: 5)",
    )
    p.add_argument(
        "--gpu-metrics-interval",
        type=_seconds,
        default=5.0,
        metavar="S",
        help="with --metrics-port: seconds between two readings of the GPUs' use, per device "
        "and pod, served to every scrape (default: 5)",
    )
    p.add_argument(
        "--emulated-load",
        metavar="FILE",
        help="emulated backend: YAML map NAMESPACE/POD -> {utilization: 0.0-1.0, memoryUsedMiB: "
        "N}, what the devices each pod holds report (re-read within 1 s; a pod missing is idle)",
    )
    p.add_argument(
        "--start-patience",
        type=_patience,
        default=watching.START_PATIENCE_S,
        metavar="S",
        help="with --node: how long each first read of the API server waits out an error that "
        "passes (429 'storage is (re)initializing' just after the CRD is created, a 5xx, a "
        f"refused connection) before the agent gives up (default: {watching.START_PATIENCE_S:g};"
        " 0: give up at once)",
    )
    p.add_argument("--once", action="store_true", help="reconcile once, print the result and exit")
    logs.add_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    p.set_defaults(func=cmd_agent)


def _port(text: str) -> int:
    try:
        value = digits.integer(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0 to 65535)")
    return value


def _patience(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 or more seconds")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: the interval must be more than 0 seconds")
    return value


def _device_list(text: str) -> tuple[devices.DeviceListStrategy, ...]:
    parts = [p for p in (t.strip() for t in text.split(",")) if p]
    if not parts:
        raise errors.AgentConfigError("--device-list-strategy names no strategy")
    return tuple(dict.fromkeys(devices.DeviceListStrategy.parse(p) for p in parts))


def _source(args: argparse.Namespace) -> running.DesiredSource:
    """The desired-layout source the flags name, checked (file readable, name known)."""
    if args.node is not None and args.config is not None:
        raise errors.AgentConfigError(
            "--config does not apply with --node: in a cluster a static node's mig-parted file "
            "is read from a ConfigMap (--mig-parted-configmap NS/NAME[:KEY]), the config named "
            "by the Node's nvidia.com/mig.config label"
        )
    if args.node is None and args.kubeconfig is not None:
        raise errors.AgentConfigError("--kubeconfig needs --node NAME")
    if args.config is None:
        labels_for_sharing = args.node_labels is not None and args.device_plugin_configs
        if args.config_name is not None or (args.node_labels is not None and
                                            not labels_for_sharing):  # fmt: skip
            flag = "-c" if args.config_name is not None else "--node-labels"
            raise errors.AgentConfigError(f"{flag} needs --config FILE (a mig-parted config)")
        return running.KeepLayout()
    if args.config_name is None and args.node_labels is None:
        raise errors.AgentConfigError(
            "--config needs -c NAME or --node-labels FILE to say which config to apply"
        )
    source = running.MigPartedConfig(
        Path(args.config),
        name=args.config_name,
        labels_path=Path(args.node_labels) if args.node_labels is not None else None,
    )
    name = source.config_name()
    if name is not None:
        # Checks the name alone (no GPUs yet): unknown names fail with a did-you-mean hint.
        desired.from_migparted(source.load(), name, gpus=())
    return source


@dataclass(frozen=True, slots=True)
class _Cluster:
    """The agent's Kubernetes side: the API, the GpuLayout it follows."""

    api: kubeapi.NodeApi
    source: following.GpuLayoutSource
    simulated_kubelet: standin.SimulatedKubelet | None
    pods: standin.PodBook | None = None
    """With the simulated kubelet: the pods bound to the node, which a thread keeps current."""
    statics: statics.StaticOrDynamic | None = None
    """The layouts: a mig-parted config named by the Node's label, else the GpuLayout."""
    pool: unifying.UnifiedPool | None = None
    """The instances set aside for unified pods (``nvidia.com/gpu``), Allocate's inputs."""
    counters: bool = True
    """Write the unified node counters into the Node (``--unified-counters``)."""
    sharing_label: Callable[[], str | None] | None = None
    """With a sharing config set: the Node's ``nvidia.com/device-plugin.config`` label, as the
    static layouts' Node watch sees it."""
    slices: slicing.SliceFilter | None = None
    """The GpuLayout's MPS slices, put into the device view (``docs/agent.md``)."""

    def wire(
        self,
        real: reconciling.InUse,
        *,
        gpus: backend.GpuBackend,
        holders: Callable[[], Mapping[str, str]] = dict,
    ) -> tuple[reconciling.InUse, running.PassListener]:
        """The agent's in-use source (``real``, the simulated kubelet's pods, the instances the
        bound pods' counts keep, and the GpuLayout's protection) and its reporter (which counts
        ``real`` and the pods' devices as in use; ``holders``: MPS slice -> the pod the kubelet
        gave it to), with the simulated kubelet told first so the status sees its newest
        assignment. The MPS slices' filter reads the same in-use source."""
        kubelet = self.simulated_kubelet
        used = real if kubelet is None else reconciling.AnyOf([real, kubelet])
        if self.pool is not None:
            used = reconciling.AnyOf([used, self.pool])
        if self.slices is not None:
            self.slices.hold_from(used.in_use)
        owners: list[Callable[[], Mapping[str, str]]] = [holders]
        if self.pool is not None:
            owners.append(self.pool.used_by)
        if kubelet is not None:
            owners.append(kubelet.slice_holders)
        reporter = following.KubeReporter(
            self.api,
            source=self.source,
            in_use=used,
            now=_now,
            static=self.statics,
            used_by=lambda: {k: v for f in owners for k, v in f().items()},
            mps_node=_mps_node(self.statics),
        )
        listeners: list[running.PassListener] = [reporter]
        if kubelet is not None:
            listeners.insert(0, kubelet)
        if self.counters:
            listeners.append(
                unifying.NodeCounters(
                    self.api, node=self.source.node, mps_node=_mps_node(self.statics)
                )
            )
        protect: list[reconciling.InUse] = [used, self.source]
        if self.pods is not None:
            protect.append(
                holding.BoundPodsHold(
                    self.pods,
                    node=self.source.node,
                    gpus=gpus,
                    allocated=used,
                    unified=self.pool.profiles_for if self.pool is not None else None,
                )
            )
        return reconciling.AnyOf(protect), running.Listeners(listeners)

    def view_filter(self) -> running.ViewFilter | None:
        """The MPS slices, then the unified pool, put into the device view."""
        filters: list[running.ViewFilter] = []
        if self.slices is not None:
            filters.append(self.slices)
        if self.pool is not None:
            filters.append(self.pool)
        return running.ViewFilters(filters) if filters else None

    def desired_source(self) -> running.DesiredSource:
        """The static config or the GpuLayout, a pass due also when the node's pods change
        (simulated kubelet)."""
        base: running.DesiredSource = self.statics if self.statics is not None else self.source
        others: list[Callable[[], Hashable]] = []
        if self.pool is not None:
            others.append(self.pool.fingerprint)  # a new allocation is reported at once
        if self.simulated_kubelet is not None:
            others.append(self.simulated_kubelet.fingerprint)
        return running.AlsoWatching(base, *others) if others else base

    def follow_static(self, stop: threading.Event, health: probes.Watches) -> None:
        """Keep the Node's label and the ConfigMap current until ``stop`` (in a thread)."""
        if self.statics is not None:
            self.statics.follow(stop, health=health)

    def follow_pods(self, stop: threading.Event, health: probes.Watches) -> None:
        """Keep :attr:`pods` current until ``stop`` (run it in a thread)."""
        book, node = self.pods, self.source.node
        if book is None:
            return
        watching.follow(
            what=f"pods on {node}",
            lister=lambda: self.api.list_pods(node=node),
            watcher=lambda version: self.api.watch_pods(node=node, resource_version=version),
            listed=book.listed,
            changed=book.changed,
            stop=stop,
            health=health,
        )


def _mps_node(static: statics.StaticOrDynamic | None) -> Callable[[], bool]:
    """Whether the Node is in mode ``mps`` now (its Node watch keeps the label)."""
    if static is None:
        return lambda: False
    return lambda: static.mps_node


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _cluster(
    args: argparse.Namespace, strategy: devices.MigStrategy, *, sharing: bool = False
) -> _Cluster | None:
    """With ``--node``: connect and read the node's GpuLayout once (errors stop the agent)."""
    if args.node is None:
        return None
    configmap = statics.ConfigMapRef.parse(args.mig_parted_configmap)  # before connecting
    api = kube.connect(Path(args.kubeconfig) if args.kubeconfig is not None else None)
    source = following.GpuLayoutSource(api, node=args.node)
    # The first reads wait out what the API server says is passing (429 "storage is
    # (re)initializing" just after the GpuLayout CRD is created, a 5xx, no answer yet), each
    # for --start-patience seconds.
    patience = float(args.start_patience)
    watching.retrying(source.sync, what=f"GpuLayout {args.node}", patience_s=patience)
    static = statics.StaticOrDynamic(api, dynamic=source, configmap=configmap)
    watching.retrying(static.sync, what=f"Node {args.node}", patience_s=patience)
    simulated = None
    # The pods bound to the node: the simulated kubelet assigns them devices, and on any node
    # their counts keep instances from being destroyed (agent/holding.py).
    book = standin.PodBook()
    pods = watching.retrying(
        lambda: api.list_pods(node=args.node), what=f"pods on {args.node}", patience_s=patience
    )
    book.listed(pods.items)

    def spec() -> gpulayouts.LayoutSpec | None:
        return source.acted_on.spec if source.acted_on is not None else None

    pool = unifying.UnifiedPool(api, node=args.node, pods=book, spec=spec)
    if args.kubelet == SIMULATED:
        simulated = standin.SimulatedKubelet(
            api,
            node=args.node,
            strategy=strategy,
            pods=book,
            spec=spec,
            held=lambda: standin.reported_used(source.layout()),
            unified=lambda: pool.inputs(fresh=False),
            held_by=lambda: standin.reported_used_by(source.layout()),
        )
        pool.attach(simulated)
    label: Callable[[], str | None] | None = None
    if sharing:
        # The Node watch of the static layouts carries every label: no second watch.
        label = functools.partial(static.node_label, configsets.CONFIG_LABEL)
    layout_slices = slicing.SliceFilter(spec=spec, layout=source.layout)
    return _Cluster(
        api, source, simulated, book, static, pool, args.unified_counters, label, layout_slices
    )


def _mps_supervisor(args: argparse.Namespace) -> agent_mps.MpsSupervisor:
    """The MPS daemons' supervisor for a node with a sharing config: NVIDIA's real
    ``nvidia-cuda-mps-control`` beside the NVML backend (a node without it gets its MPS state
    ``failed``, with the reason logged), the emulated daemon beside emulated GPUs. Daemons
    outlive the agent: the next one adopts them."""
    clock = clocks.SystemClock()
    control: gpu_mps.MpsControl
    if args.backend.strip() == "nvml":
        control = gpu_mps.ProcessMps(clock=clock)
    else:
        control = gpu_mps.EmulatedMps(clock=clock)
    return agent_mps.MpsSupervisor(control, clock=clock)


def _open_backend(args: argparse.Namespace) -> backend.GpuBackend:
    spec = args.backend.strip()
    if spec == "nvml":
        if args.state_file is not None:
            raise errors.AgentConfigError("--state-file applies only to an emulated backend")
        return nvml.NvmlBackend()
    parsed = emulated.parse_spec(spec)
    state = Path(args.state_file) if args.state_file is not None else None
    if state is not None and not state.parent.is_dir():
        raise errors.AgentConfigError(f"--state-file {state}: folder {state.parent} does not exist")
    return emulated.EmulatedBackend(
        parsed.models,
        pci_ids=parsed.pci_ids,
        mig_enabled=parsed.mig_enabled,
        state_path=state,
        clock=clocks.SystemClock(),
        times=emulated.OperationTimes(),
        seed=emulated.seed_for(args.node) if args.node else 0,
    )


def _sharing_files(args: argparse.Namespace) -> sharingconfig.ConfigFiles | None:
    """The sharing config files the flags name, every one checked (bad: exit 2)."""
    if args.device_plugin_config is not None and args.device_plugin_configs is not None:
        raise errors.AgentConfigError(
            "--device-plugin-config FILE and --device-plugin-configs DIR exclude each other"
        )
    if args.device_plugin_config_default is not None and args.device_plugin_configs is None:
        raise errors.AgentConfigError(
            "--device-plugin-config-default needs --device-plugin-configs"
        )
    if args.device_plugin_config is not None:
        single = sharingconfig.SingleFile(Path(args.device_plugin_config))
        single.load(None)
        return single
    if args.device_plugin_configs is not None:
        folder = Path(args.device_plugin_configs)
        if not folder.is_dir():
            raise errors.AgentConfigError(f"--device-plugin-configs {folder}: not a folder")
        named = sharingconfig.NamedSet(
            folder,
            selection=configsets.Selection(default=args.device_plugin_config_default),
        )
        named.check_all()
        return named
    return None


def _strategy(args: argparse.Namespace, files: sharingconfig.ConfigFiles | None) -> str:
    """``--strategy``, else the single config file's ``flags.migStrategy``, else mixed."""
    if args.strategy is not None:
        return str(args.strategy)
    if isinstance(files, sharingconfig.SingleFile):
        found = files.load(None)[1].mig_strategy
        if found is not None:
            return found
    return devices.MigStrategy.MIXED.value


def _sharing_label(args: argparse.Namespace, cluster: _Cluster | None) -> Callable[[], str | None]:
    """Where the node's ``nvidia.com/device-plugin.config`` label is read."""
    if cluster is not None and cluster.sharing_label is not None:
        return cluster.sharing_label
    if args.node_labels is not None:
        return sharingconfig.LabelsFileLabel(Path(args.node_labels))
    return sharingconfig.no_label


def _follower(
    args: argparse.Namespace,
    files: sharingconfig.ConfigFiles | None,
    *,
    strategy: devices.MigStrategy,
    cluster: _Cluster | None,
    apply: Callable[[sharing_config.Config], None],
) -> sharingconfig.SharingFollower | None:
    """The sharing follower, its config for the node checked now (bad: exit 2)."""
    if files is None:
        return None
    follower = sharingconfig.SharingFollower(
        files, apply=apply, mig_strategy=strategy.value, label=_sharing_label(args, cluster)
    )
    follower.check()
    return follower


def cmd_agent(args: argparse.Namespace, out: IO[str]) -> int:
    """Check the flags, open the backend, run the agent."""
    files = _sharing_files(args)
    strategy = devices.MigStrategy.parse(_strategy(args, files))
    list_strategies = _device_list(args.device_list_strategy)
    if args.kubelet == SIMULATED:
        if args.node is None:
            raise errors.AgentConfigError("--kubelet simulated needs --node NAME")
        args.no_kubelet = True  # the stand-in replaces the kubelet: no plugin, no PodResources
    elif args.kubelet is not None:
        if args.kubelet_dir != DEFAULT_KUBELET_DIR:
            raise errors.AgentConfigError("--kubelet DIR and --kubelet-dir name the same folder")
        args.kubelet_dir = args.kubelet
    kubelet_dir = Path(args.kubelet_dir)
    plugin_dir = kubelet_dir / "device-plugins"
    serve = not args.no_kubelet and not args.once
    if serve and not plugin_dir.is_dir():
        raise errors.AgentConfigError(
            f"kubelet device-plugin folder {plugin_dir} does not exist (see --kubelet-dir, "
            "--no-kubelet)"
        )
    load: sampling.LoadFile | None = None
    if args.emulated_load is not None:
        if not str(args.backend).startswith("emulated"):
            raise errors.AgentConfigError("--emulated-load needs --backend emulated:...")
        load = sampling.LoadFile(Path(args.emulated_load))
        load.load()  # a bad file stops the agent here, with the field named
    args.load = load
    labels_file = Path(args.labels_file) if args.labels_file is not None else None
    if labels_file is not None and not labels_file.parent.is_dir():
        raise errors.AgentConfigError(
            f"--labels-file {labels_file}: folder {labels_file.parent} does not exist"
        )
    source = _source(args)
    cluster = _cluster(args, strategy, sharing=files is not None)
    if cluster is not None:
        source = cluster.desired_source()
    # A bad sharing config for this node fails here, before anything changes.
    _follower(args, files, strategy=strategy, cluster=cluster, apply=lambda _: None)
    gpus = _open_backend(args)
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
        logs.configure(
            args.log_format,
            verbose=args.verbose,
            fields={"node": args.node} if args.node else None,
        )
        settings = running.AgentSettings(
            strategy=strategy,
            interval_s=args.interval,
            labels_file=labels_file,
            mps_root=args.mps_root,
        )
        if args.once:
            return _run_once(
                args,
                gpus=gpus,
                source=source,
                settings=settings,
                kubelet_dir=kubelet_dir,
                out=out,
                cluster=cluster,
                sharing=_follower(
                    args, files, strategy=strategy, cluster=cluster, apply=lambda _: None
                ),
            )
        plugin_settings = serving.PluginSettings(
            plugin_dir=plugin_dir,
            strategy=strategy,
            allocate=allocating.AllocateSettings(device_list_strategies=list_strategies),
            ledger_file=_ledger_file(args, kubelet_dir),
            allocate_wait_s=args.allocate_wait,
            mps_root=args.mps_root,
        )
        return _serve(
            args,
            gpus=gpus,
            source=source,
            settings=settings,
            plugin_settings=plugin_settings,
            kubelet_dir=kubelet_dir,
            cluster=cluster,
            files=files,
        )
    finally:
        gpus.close()


def _ledger_file(args: argparse.Namespace, kubelet_dir: Path) -> Path:
    """``--allocations-file``, or its default in the kubelet folder; its folder exists after."""
    path = (
        Path(args.allocations_file)
        if args.allocations_file is not None
        else kubelet_dir / "migpilot" / "allocations.json"
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise errors.AgentConfigError(
            f"--allocations-file {path}: cannot create {path.parent}: {err.strerror or err}"
        ) from None
    return path


def _publisher(
    cluster: _Cluster, plugin: serving.DevicePlugin, client: podresources.PodResourcesClient
) -> capacity.CapacityPublisher:
    """Publishes the kubelet's new device counts into the Node at once (``agent/capacity.py``)."""

    def advertised() -> dict[str, frozenset[str]]:
        return {
            name: frozenset(d.id for d in devs if d.health is devices.Health.HEALTHY)
            for name, devs in plugin.advertised().items()
        }

    return capacity.CapacityPublisher(
        cluster.api, node=cluster.source.node, kubelet=client, advertised=advertised
    )


def _kubelet_in_use(
    gpus: backend.GpuBackend,
    *,
    kubelet_dir: Path,
    plugin: serving.DevicePlugin | None,
    timeout_s: float,
    cluster: _Cluster | None = None,
) -> tuple[reconciling.InUse, podresources.PodResourcesClient, podresources.KubeletInUse]:
    """The kubelet as an in-use source that fails closed: while it cannot be asked, every MIG
    device and every MPS slice served is in use."""
    socket = kubelet_dir / "pod-resources" / "kubelet.sock"
    client = podresources.PodResourcesClient(socket, timeout_s=timeout_s)
    kubelet = podresources.KubeletInUse(client, plugin)
    served = cluster.slices.served_ids if cluster is not None and cluster.slices else frozenset
    source = running.FailClosed(
        running.PodResourcesInUse(kubelet, socket_path=socket),
        everything=lambda: running.mig_uuids(gpus) | served(),
        failures=(podresources.PodResourcesError,),
        what="the kubelet's PodResources API",
    )
    return source, client, kubelet


def _run_once(
    args: argparse.Namespace,
    *,
    gpus: backend.GpuBackend,
    source: running.DesiredSource,
    settings: running.AgentSettings,
    kubelet_dir: Path,
    out: IO[str],
    cluster: _Cluster | None,
    sharing: sharingconfig.SharingFollower | None,
) -> int:
    sources: list[reconciling.InUse] = [reconciling.RunningProcesses(gpus)]
    client = None
    holders: Callable[[], Mapping[str, str]] = dict
    if not args.no_kubelet:
        kubelet, client, asked = _kubelet_in_use(
            gpus, kubelet_dir=kubelet_dir, plugin=None, timeout_s=5.0, cluster=cluster
        )
        sources.append(kubelet)
        holders = asked.holders
    in_use: reconciling.InUse = reconciling.AnyOf(sources)
    listener = None
    if cluster is not None:
        in_use, listener = cluster.wire(in_use, gpus=gpus, holders=holders)
    agent = running.Agent(
        gpus=gpus,
        in_use=in_use,
        source=source,
        plugin=None,
        agent_metrics=agent_metrics.AgentMetrics(),
        clock=clocks.SystemClock(),
        settings=settings,
        listener=listener,
        view_filter=cluster.view_filter() if cluster is not None else None,
        sharing=sharing,
    )
    try:
        report = agent.start()
    finally:
        if client is not None:
            client.close()
    for applied in report.applied:
        detail = f": {applied.detail}" if applied.detail else ""
        out.write(f"{applied.outcome.value:8} {applied.action}{detail}\n")
    for refusal in report.refusals:
        out.write(f"not done {refusal}\n")
    for index in sorted(report.devices):
        layout = report.layout(index)
        out.write(f"GPU {index}: {layout if layout.instances else '(no MIG instances)'}\n")
    failed = report.outcomes(reconciling.Outcome.FAILED) or report.outcomes(
        reconciling.Outcome.REFUSED
    )
    if report.converged and not report.refusals and not failed:
        return 0
    return EXIT_NOT_CONVERGED


def _serve(
    args: argparse.Namespace,
    *,
    gpus: backend.GpuBackend,
    source: running.DesiredSource,
    settings: running.AgentSettings,
    plugin_settings: serving.PluginSettings,
    kubelet_dir: Path,
    cluster: _Cluster | None,
    files: sharingconfig.ConfigFiles | None,
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
    if not args.no_kubelet:
        plugin = serving.DevicePlugin(
            plugin_settings, unified=cluster.pool if cluster is not None else None
        )
        if cluster is not None and cluster.pool is not None:
            cluster.pool.attach(plugin)  # the plugin's ledger says what Allocate handed out
        kubelet, client, asked = _kubelet_in_use(
            gpus,
            kubelet_dir=kubelet_dir,
            plugin=plugin,
            timeout_s=plugin_settings.rpc_timeout_s,
            cluster=cluster,
        )
        sources += [kubelet, running.HandedOut(plugin)]
        holders = asked.holders
    sharing = _follower(
        args,
        files,
        strategy=plugin_settings.strategy,
        cluster=cluster,
        apply=plugin.set_sharing if plugin is not None else lambda _: None,
    )
    if sharing is not None and cluster is not None and cluster.simulated_kubelet is not None:
        cluster.simulated_kubelet.share_with(sharing.current)
    in_use: reconciling.InUse = reconciling.AnyOf(sources)
    listener: running.PassListener | None = None
    publisher: capacity.CapacityPublisher | None = None
    if cluster is not None:
        in_use, listener = cluster.wire(in_use, gpus=gpus, holders=holders)
        if plugin is not None and client is not None and not args.no_publish_capacity:
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
        settings=settings,
        listener=listener,
        view_filter=cluster.view_filter() if cluster is not None else None,
        sharing=sharing,
        # Daemons for the sharing config's MPS resources and for the GpuLayout's MPS slices.
        mps=_mps_supervisor(args) if files is not None or cluster is not None else None,
    )
    server = None
    try:
        if args.metrics_port:
            _start_sampler(
                args,
                gpus=gpus,
                agent=agent,
                sink=the_metrics,
                stop=stop,
                client=client,
                cluster=cluster,
                in_use=in_use,
            )
            try:
                server = running.MetricsServer(
                    the_metrics,
                    port=args.metrics_port,
                    address=args.metrics_address,
                    live=probes.all_of(agent.heartbeat.check, watches.check),
                    ready=agent.not_ready,
                )
            except OSError as err:
                raise errors.AgentConfigError(
                    f"cannot serve metrics on {args.metrics_address}:{args.metrics_port}: "
                    f"{err.strerror or err}"
                ) from None
        agent.start()
        if publisher is not None:
            publisher.check()  # the first pass ran before the plugin served its devices
        agent.run(stop)
    finally:
        agent.stop()
        if publisher is not None:
            publisher.close()
        if server is not None:
            server.close()
        if client is not None:
            client.close()
    _log.info("stopped")
    return 0


def _start_sampler(
    args: argparse.Namespace,
    *,
    gpus: backend.GpuBackend,
    agent: running.Agent,
    sink: agent_metrics.AgentMetrics,
    stop: threading.Event,
    client: podresources.PodResourcesClient | None,
    cluster: _Cluster | None,
    in_use: reconciling.InUse,
) -> None:
    """Sample the GPUs' use per device and pod every ``--gpu-metrics-interval`` (a thread)."""
    holdings: sampling.Holdings = list
    if client is not None:
        holdings = sampling.pod_resources_holdings(client.list)
    elif cluster is not None and cluster.simulated_kubelet is not None:
        kubelet = cluster.simulated_kubelet
        holdings = sampling.assigned_holdings(
            kubelet.assigned,
            lambda: {k: a.containers for k, a in kubelet.pod_allocations().items()},
            agent.view,
        )
    driven = gpus if isinstance(gpus, emulated.EmulatedBackend) else None
    if driven is not None:
        owners = sampling.emulated_owners(driven)
    else:
        book = cluster.pods if cluster is not None else None
        owners = sampling.proc_owners(
            (lambda: {p.uid: p.key for p in book.pods(args.node) if p.uid})
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
        node=args.node or socket.gethostname(),
        gpus=gpus,
        view=agent.view,
        holdings=holdings,
        sink=sink,
        owners=owners,
        interval_s=args.gpu_metrics_interval,
        in_use=used,
        reserved=reserved,
        load=args.load,
        driven=driven,
    ).start(stop)
