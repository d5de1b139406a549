"""``migpilot agent``: the node agent as a command (reconcile MIG layouts, serve the kubelet).

Thin, as kopf's CLI: the flags become :class:`migpilot.agent.assembling.Settings`, and
:func:`migpilot.agent.assembling.run` checks them and the files they name before anything starts
(bad input is one line and exit code 2), builds the agent and runs it until SIGTERM or SIGINT.
``--once`` reconciles once, prints what it did and exits: 0 when the node reached its desired
layouts, 1 when something was refused or failed. ``--kubelet simulated`` hands the agent the
KWOK stand-in kubelet (:mod:`migpilot.kwok.standin`), which the agent itself never imports.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO

from migpilot import digits, errors, logs
from migpilot.agent import assembling
from migpilot.agent.cluster import watching
from migpilot.agent.deviceplugin import devices
from migpilot.api import leases
from migpilot.kwok import standin

SIMULATED = "simulated"
"""``--kubelet simulated``: the stand-in kubelet of :mod:`migpilot.kwok.standin`."""


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
        "--cdi-spec-dir",
        default=str(assembling.DEFAULT_CDI_SPEC_DIR),
        metavar="DIR",
        help="with --device-list-strategy cdi: where the CDI spec of the advertised devices is "
        f"written, migpilot-<node>.json (default: {assembling.DEFAULT_CDI_SPEC_DIR}; see "
        "docs/cdi.md)",
    )
    p.add_argument(
        "--proc-root",
        default=None,
        metavar="DIR",
        help="the folder holding proc/ whose driver files (device minors, MIG capabilities) "
        "the CDI spec is made from (default: /); with an emulated backend, where it writes "
        "its emulated driver files (required with --device-list-strategy cdi)",
    )
    p.add_argument(
        "--kubelet-dir",
        default=assembling.DEFAULT_KUBELET_DIR,
        metavar="DIR",
        help="the kubelet's folder, holding device-plugins/ and pod-resources/ "
        f"(default: {assembling.DEFAULT_KUBELET_DIR})",
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
        default=assembling.DEFAULT_MIG_PARTED_CONFIGMAP,
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
    p.add_argument(
        "--lease-namespace",
        default=leases.NAMESPACE,
        metavar="NS",
        help="with --node on a node in DRA mode: namespace of the controller's Lease, whose "
        f"plan is listed first only while the Lease is fresh (default: {leases.NAMESPACE})",
    )
    p.add_argument(
        "--lease-name",
        default=leases.NAME,
        metavar="NAME",
        help=f"the controller's Lease (default: {leases.NAME})",
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


def _path(text: str | None) -> Path | None:
    return Path(text) if text is not None else None


def settings_from(args: argparse.Namespace) -> assembling.Settings:
    """The settings the flags describe (a flag that contradicts another: a one-line error)."""
    mode = assembling.KubeletMode.NONE if args.no_kubelet else assembling.KubeletMode.REAL
    kubelet_dir = args.kubelet_dir
    if args.kubelet == SIMULATED:
        # The stand-in replaces the kubelet: no plugin, no PodResources.
        mode = assembling.KubeletMode.SIMULATED
    elif args.kubelet is not None:
        if args.kubelet_dir != assembling.DEFAULT_KUBELET_DIR:
            raise errors.AgentConfigError("--kubelet DIR and --kubelet-dir name the same folder")
        kubelet_dir = args.kubelet
    return assembling.Settings(
        backend=assembling.BackendSettings(
            spec=args.backend,
            state_file=_path(args.state_file),
            emulated_load=_path(args.emulated_load),
            proc_root=_path(args.proc_root),
        ),
        layouts=assembling.LayoutSettings(
            config=_path(args.config),
            config_name=args.config_name,
            node_labels=_path(args.node_labels),
        ),
        sharing=assembling.SharingSettings(
            config_file=_path(args.device_plugin_config),
            configs_dir=_path(args.device_plugin_configs),
            default_config=args.device_plugin_config_default,
            mps_root=args.mps_root,
        ),
        kubelet=assembling.KubeletSettings(
            mode=mode,
            dir=Path(kubelet_dir),
            allocations_file=_path(args.allocations_file),
            device_list_strategies=_device_list(args.device_list_strategy),
            allocate_wait_s=args.allocate_wait,
            publish_capacity=not args.no_publish_capacity,
            cdi_spec_dir=Path(args.cdi_spec_dir),
        ),
        cluster=assembling.ClusterSettings(
            node=args.node,
            kubeconfig=_path(args.kubeconfig),
            mig_parted_configmap=args.mig_parted_configmap,
            unified_counters=args.unified_counters,
            start_patience_s=args.start_patience,
            lease_namespace=args.lease_namespace,
            lease_name=args.lease_name,
        ),
        metrics=assembling.MetricsSettings(
            port=args.metrics_port,
            address=args.metrics_address,
            gpu_interval_s=args.gpu_metrics_interval,
        ),
        strategy=args.strategy,
        labels_file=_path(args.labels_file),
        interval_s=args.interval,
        once=args.once,
        log_format=args.log_format,
        verbose=args.verbose,
    )


def cmd_agent(args: argparse.Namespace, out: IO[str]) -> int:
    """Turn the flags into settings and run the agent they describe."""
    settings = settings_from(args)
    state = settings.backend.state_file
    # The stand-in's checkpoint lies beside the emulated GPUs' state: a restarted agent finds
    # both, as a restarted kubelet finds its checkpoint.
    checkpoint = Path(f"{state}{standin.CHECKPOINT_SUFFIX}") if state is not None else None
    return assembling.run(settings, out, standin=standin.checkpointed(checkpoint))
