"""``migpilot fleet``: the simulated agents of many KWOK nodes in one process, as a command.

Thin: flags become :class:`migpilot.kwok.fleet.FleetSettings`, then
:func:`migpilot.kwok.fleet.run` until SIGTERM or SIGINT. A separate command rather than
``migpilot agent --fleet``: almost none of the single agent's flags (backend, state file,
configs, kubelet folder, device plugin) mean anything for a fleet.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO

from migpilot import errors, logs
from migpilot.agent.deviceplugin import devices
from migpilot.api import leases
from migpilot.kube import objects
from migpilot.kwok import fleet

SIMULATED = "simulated"


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``fleet`` to the top-level subparsers."""
    p = subparsers.add_parser(
        "fleet",
        help="run the simulated agents of many KWOK nodes in one process (scale tests)",
        description=(
            "Run the node agent, with emulated GPUs and the simulated kubelet, for every Node "
            f"the selector picks; each node's GPUs come from its {fleet.EMULATED_GPUS_LABEL} "
            "label (a100-80gb.x8, a100-80gb.x4_a30.x2). One watch of the Nodes, one of the "
            "GpuLayouts and one of the pods for all of them; passes run on a pool of "
            "threads. A node labelled migpilot.io/mode=dra publishes ResourceSlices and has "
            "the claims of its pods prepared instead. Stops on SIGTERM/SIGINT."
        ),
    )
    p.add_argument(
        "--kubeconfig", type=Path, metavar="FILE", help="kubeconfig (default: in-cluster)"
    )
    p.add_argument(
        "--kubelet",
        choices=[SIMULATED],
        default=SIMULATED,
        help="the only kubelet a fleet has: the stand-in (default: simulated)",
    )
    p.add_argument(
        "--fleet-selector",
        "--selector",
        default=fleet.EMULATED_GPUS_LABEL,
        metavar="LABEL[=VALUE]",
        help=f"the Nodes to run agents for (default: those with the label "
        f"{fleet.EMULATED_GPUS_LABEL})",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=fleet.DEFAULT_WORKERS,
        metavar="N",
        help="threads running node passes in parallel (default: 32)",
    )
    p.add_argument(
        "--strategy",
        default="mixed",
        metavar="none|single|mixed",
        help="MIG strategy, as NVIDIA's --mig-strategy (default: mixed)",
    )
    p.add_argument(
        "--interval",
        type=float,
        default=fleet.DEFAULT_INTERVAL_S,
        metavar="S",
        help="seconds before a node whose last pass left work undone (refused, failed, a "
        "write refused) is passed again (default: 30)",
    )
    p.add_argument(
        "--resync",
        type=float,
        default=fleet.DEFAULT_RESYNC_S,
        metavar="S",
        help="seconds between passes of a node whose last pass left nothing undone; its inputs "
        "are watched, so these only guard against a missed event (default: 300)",
    )
    p.add_argument(
        "--unified-counters",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="write each node's nvidia.com/gpumem, nvidia.com/gpumem-percentage and "
        "nvidia.com/gpucores into its capacity and allocatable (unified requests; default: on)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve the fleet's metrics, /healthz and /readyz on this port, 0 for none "
        "(default: 0)",
    )
    p.add_argument(
        "--gpu-metrics-interval",
        type=float,
        default=5.0,
        metavar="S",
        help="with --metrics-port: seconds between two readings of every node's GPU use, per "
        "device and pod, served to every scrape (default: 5)",
    )
    p.add_argument(
        "--emulated-load",
        type=Path,
        metavar="FILE",
        help="YAML map NAMESPACE/POD -> {utilization: 0.0-1.0, memoryUsedMiB: N}, what the "
        "devices each pod holds report, on every node (re-read within 1 s; a pod missing is "
        "idle); as migpilot agent --emulated-load",
    )
    p.add_argument(
        "--lease-namespace",
        default=leases.NAMESPACE,
        metavar="NS",
        help="namespace of the controller's Lease: on nodes labelled migpilot.io/mode=dra the "
        f"plan is listed first only while the Lease is fresh (default: {leases.NAMESPACE})",
    )
    p.add_argument(
        "--lease-name",
        default=leases.NAME,
        metavar="NAME",
        help=f"the controller's Lease (default: {leases.NAME})",
    )
    logs.add_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    p.set_defaults(func=_run)


def selector(text: str) -> objects.LabelSelector:
    """``LABEL`` (the label exists) or ``LABEL=VALUE``; a one-line error otherwise."""
    key, sep, value = text.strip().partition("=")
    if not key or (sep and not value) or "," in text or "!" in key:
        raise errors.AgentConfigError(
            f"--fleet-selector {text!r} is not LABEL or LABEL=VALUE (one label)"
        )
    return objects.LabelSelector(key, value if sep else None)


def settings_from(args: argparse.Namespace) -> fleet.FleetSettings:
    """The settings the flags describe; a clear error for bad values."""
    if args.kubeconfig is not None and not args.kubeconfig.is_file():
        raise errors.AgentConfigError(f"--kubeconfig: no such file: {args.kubeconfig}")
    if args.workers < 1:
        raise errors.AgentConfigError(f"--workers must be at least 1, got {args.workers}")
    if not args.interval > 0:
        raise errors.AgentConfigError(f"--interval must be more than 0, got {args.interval}")
    if not args.resync > 0:
        raise errors.AgentConfigError(f"--resync must be more than 0, got {args.resync}")
    if not args.gpu_metrics_interval > 0:
        raise errors.AgentConfigError(
            f"--gpu-metrics-interval must be more than 0, got {args.gpu_metrics_interval}"
        )
    if args.emulated_load is not None and not args.emulated_load.is_file():
        raise errors.AgentConfigError(f"--emulated-load: no such file: {args.emulated_load}")
    if not 0 <= args.metrics_port <= 65535:
        raise errors.AgentConfigError(f"--metrics-port must be 0 to 65535, got {args.metrics_port}")
    return fleet.FleetSettings(
        kubeconfig=args.kubeconfig,
        selector=selector(args.fleet_selector),
        workers=args.workers,
        strategy=devices.MigStrategy.parse(args.strategy),
        interval_s=args.interval,
        resync_s=args.resync,
        unified_counters=args.unified_counters,
        metrics_port=args.metrics_port or None,
        gpu_metrics_interval_s=args.gpu_metrics_interval,
        emulated_load=args.emulated_load,
        lease_namespace=args.lease_namespace,
        lease_name=args.lease_name,
    )


def _run(args: argparse.Namespace, out: IO[str]) -> int:
    settings = settings_from(args)
    logs.configure(
        args.log_format,
        verbose=args.verbose,
        text="%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s",
    )
    return fleet.run(settings)
