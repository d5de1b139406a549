"""``migpilot controller``: the controller that plans MIG pods and pins them, as a command.

Thin: flags become :class:`migpilot.controller.serving.ServeSettings`, then
:func:`migpilot.controller.serving.run` until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import math
import socket
from pathlib import Path
from typing import IO

from migpilot import errors, logs
from migpilot.api import leases
from migpilot.controller import running, serving
from migpilot.planning import draclaims, snapshot


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``controller`` to the top-level subparsers."""
    p = subparsers.add_parser(
        "controller",
        help="run the controller: plan waiting MIG pods, write GpuLayouts, pin pods to nodes",
        description=(
            "Watch pods, nodes and GpuLayouts; plan the MIG pods the webhook gated (and pods "
            "kube-scheduler left Unschedulable) with the fast planner; write each changed "
            "node's GpuLayout spec, reserving instances; once they exist, pin each pod to its "
            "node and remove its gate. Active/passive on a Lease. Stops on SIGTERM/SIGINT."
        ),
    )
    p.add_argument(
        "--kubeconfig", type=Path, metavar="FILE", help="kubeconfig (default: in-cluster)"
    )
    p.add_argument(
        "--batch-window",
        type=float,
        default=0.25,
        metavar="S",
        help="seconds to collect waiting pods before planning (default: 0.25)",
    )
    p.add_argument(
        "--reservation-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a reservation may wait for its pod to be bound before the pod is planned "
        "again (default: 60)",
    )
    p.add_argument(
        "--node-autoscaling",
        action="store_true",
        help="the cluster has a node autoscaler (Karpenter, Cluster Autoscaler): let go, "
        "unpinned, a pod no node can hold now, so kube-scheduler marks it Unschedulable and "
        "the autoscaler sees it (docs/autoscaling.md; default: it waits gated)",
    )
    p.add_argument(
        "--scale-out-after",
        type=float,
        default=5.0,
        metavar="S",
        help="with --node-autoscaling, seconds a pod must be left unplaced before it is let go "
        "for the autoscaler (default: 5)",
    )
    p.add_argument(
        "--full-replan-every",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds between full replans of every waiting pod; in between, while no capacity "
        "was freed and no node changed, a plan places only the new pods (docs/controller.md, "
        "incremental planning); 0: every plan is a full replan (default: 60)",
    )
    p.add_argument(
        "--node-policy",
        "--scoring",
        dest="node_policy",
        choices=[x.value for x in snapshot.Policy],
        default=snapshot.Policy.BINPACK.value,
        help="the node policy of pods whose hami.io/node-scheduler-policy names none "
        "(default: binpack; --scoring is the old name)",
    )
    p.add_argument(
        "--gpu-policy",
        choices=[x.value for x in snapshot.Policy],
        default=snapshot.Policy.SPREAD.value,
        help="the GPU policy of pods whose hami.io/gpu-scheduler-policy names none "
        "(default: spread)",
    )
    p.add_argument(
        "--dra-scoring-strategy",
        choices=[x.value for x in draclaims.Scoring],
        default=draclaims.Scoring.LEAST_ALLOCATED.value,
        help="kube-scheduler's NodeResourcesFit scoring strategy: pods with DRA claims are "
        "planned on DRA nodes spread (LeastAllocated, the default) or packed (MostAllocated)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        metavar="PORT",
        help="serve Prometheus metrics on this port, 0 for none (default: 8080)",
    )
    p.add_argument(
        "--lease-namespace",
        default=leases.NAMESPACE,
        metavar="NS",
        help=f"namespace of the Lease (default: {leases.NAMESPACE})",
    )
    p.add_argument(
        "--lease-name",
        default=leases.NAME,
        metavar="NAME",
        help=f"the Lease the webhook checks (default: {leases.NAME})",
    )
    p.add_argument(
        "--lease-duration",
        type=int,
        default=leases.DURATION_S,
        metavar="S",
        help="seconds a standby waits, having seen no renewal of the Lease on its own clock, "
        f"before it takes over (default: {leases.DURATION_S})",
    )
    p.add_argument(
        "--renew-deadline",
        type=float,
        default=leases.RENEW_DEADLINE_S,
        metavar="S",
        help="seconds after its last successful renewal that the leader stops writing if it "
        f"cannot renew; less than --lease-duration (default: {leases.RENEW_DEADLINE_S:g})",
    )
    p.add_argument(
        "--retry-period",
        type=float,
        default=leases.RETRY_S,
        metavar="S",
        help=f"seconds between tries to take or renew the Lease (default: {leases.RETRY_S:g})",
    )
    p.add_argument(
        "--lease-timeout",
        type=float,
        default=leases.CALL_TIMEOUT_S,
        metavar="S",
        help="seconds one Lease call may take; at most --renew-deadline less --retry-period "
        f"(default: {leases.CALL_TIMEOUT_S:g})",
    )
    p.add_argument(
        "--identity",
        default=None,
        metavar="ID",
        help="who holds the Lease (default: the host name, the pod's name in a cluster)",
    )
    logs.add_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    p.set_defaults(func=_run)


def settings_from(args: argparse.Namespace) -> serving.ServeSettings:
    """The settings the flags describe; a clear error for bad values."""
    if args.kubeconfig is not None and not args.kubeconfig.is_file():
        raise errors.MigpilotError(f"--kubeconfig: no such file: {args.kubeconfig}")
    if not 0 <= args.metrics_port < 65536:
        raise errors.MigpilotError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if not args.batch_window >= 0:
        raise errors.MigpilotError(f"--batch-window must be 0 or more, got {args.batch_window}")
    if not args.reservation_timeout > 0:
        raise errors.MigpilotError(
            f"--reservation-timeout must be more than 0, got {args.reservation_timeout}"
        )
    if not 0 <= args.scale_out_after < math.inf:
        raise errors.MigpilotError(
            f"--scale-out-after must be a number of seconds, 0 or more, got {args.scale_out_after}"
        )
    if not 0 <= args.full_replan_every < math.inf:
        raise errors.MigpilotError(
            "--full-replan-every must be a number of seconds, 0 or more, got "
            f"{args.full_replan_every}"
        )
    return serving.ServeSettings(
        controller=running.Settings(
            identity=args.identity or socket.gethostname(),
            batch_window_s=args.batch_window,
            reservation_timeout_s=args.reservation_timeout,
            scale_out_after_s=args.scale_out_after if args.node_autoscaling else None,
            full_replan_s=args.full_replan_every or None,
            lease_namespace=args.lease_namespace,
            lease_name=args.lease_name,
            lease_duration_s=args.lease_duration,
            renew_deadline_s=args.renew_deadline,
            renew_every_s=args.retry_period,
            lease_timeout_s=args.lease_timeout,
            policy=snapshot.Policy(args.node_policy),
            gpu_policy=snapshot.Policy(args.gpu_policy),
            dra_scoring=args.dra_scoring_strategy,
        ),
        kubeconfig=args.kubeconfig,
        metrics_port=args.metrics_port or None,
    )


def _run(args: argparse.Namespace, out: IO[str]) -> int:
    settings = settings_from(args)
    logs.configure(
        args.log_format,
        verbose=args.verbose,
        text="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    serving.run(settings)
    return 0
