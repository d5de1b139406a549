"""``migpilot webhook``: the admission webhooks (gating MIG and unified pods, refusing malformed
unified requests), as a command.

Thin: it turns flags into :class:`migpilot.webhook.serving.Settings` and calls
:func:`migpilot.webhook.serving.run`, which serves until SIGTERM or SIGINT (and, with
``--metrics-port``, its metrics and probes over plain HTTP on a port apart from the TLS one).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO

from migpilot import errors, logs
from migpilot.webhook import serving


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``webhook`` to the top-level subparsers."""
    defaults = serving.LeaseSettings()
    limits = serving.Settings(tls=serving.TlsSettings(Path(), Path()))
    p = subparsers.add_parser(
        "webhook",
        help="serve the admission webhooks that gate new MIG pods for the controller",
        description=(
            "Serve the admission webhooks over HTTPS (GET /healthz). POST /mutate-pods adds "
            "the scheduling gate migpilot.io/plan to new pods that request MIG resources or "
            "unified GPU slices (nvidia.com/gpumem...) while the controller holds a fresh "
            "Lease, and lets every pod through otherwise. POST /validate-pods refuses a new "
            "pod whose unified request is malformed, naming the field. Stops on SIGTERM/SIGINT."
        ),
    )
    p.add_argument("--cert", required=True, type=Path, metavar="FILE", help="PEM serving cert")
    p.add_argument("--key", required=True, type=Path, metavar="FILE", help="PEM private key")
    p.add_argument("--port", type=int, default=9443, help="port to listen on (default: 9443)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    p.add_argument(
        "--kubeconfig",
        type=Path,
        metavar="FILE",
        help="kubeconfig to read the controller's Lease with (default: in-cluster)",
    )
    p.add_argument(
        "--lease-namespace",
        default=defaults.namespace,
        metavar="NS",
        help=f"namespace of the Lease {defaults.name} (default: {defaults.namespace})",
    )
    p.add_argument(
        "--cert-check-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between looks at --cert and --key for a rotated certificate, reloaded "
        "without a restart (default: 10)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        metavar="N",
        help="connections served at once; more are closed at accept, unserved "
        f"(default: {limits.max_connections})",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=limits.request_timeout_s,
        metavar="S",
        help="seconds a whole request may take, TLS handshake of a new connection included; "
        f"a slower client is cut off (default: {limits.request_timeout_s:g})",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=limits.connection_timeout_s,
        metavar="S",
        help="seconds a kept-alive connection may wait for its next request "
        f"(default: {limits.connection_timeout_s:g})",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve Prometheus metrics, /healthz and /readyz over plain HTTP on this port, apart "
        "from the TLS one; 0 for none (default: 0)",
    )
    p.add_argument(
        "--metrics-address",
        default="0.0.0.0",
        metavar="ADDR",
        help="address the metrics port listens on (default: 0.0.0.0)",
    )
    logs.add_flag(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace, out: IO[str]) -> int:
    for path in (args.cert, args.key, args.kubeconfig):
        if path is not None and not path.is_file():
            raise errors.MigpilotError(f"no such file: {path}")
    if not 0 < args.port < 65536:
        raise errors.MigpilotError(f"--port must be 1..65535, got {args.port}")
    if not 0 <= args.metrics_port < 65536:
        raise errors.MigpilotError(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    if args.metrics_port == args.port:
        raise errors.MigpilotError(
            f"--metrics-port must differ from --port (the TLS one), both are {args.port}"
        )
    if not 0 < args.cert_check_interval <= 3600:
        raise errors.MigpilotError(
            f"--cert-check-interval must be more than 0 and at most 3600 s, got "
            f"{args.cert_check_interval:g}"
        )
    if not 1 <= args.max_connections <= 10_000:
        raise errors.MigpilotError(
            f"--max-connections must be 1..10000, got {args.max_connections}"
        )
    for flag, value in (
        ("--request-timeout", args.request_timeout),
        ("--idle-timeout", args.idle_timeout),
    ):
        if not 0 < value <= 3600:
            raise errors.MigpilotError(
                f"{flag} must be more than 0 and at most 3600 s, got {value:g}"
            )
    logs.configure(
        args.log_format,
        verbose=args.verbose,
        text="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    serving.run(
        serving.Settings(
            tls=serving.TlsSettings(cert_file=args.cert, key_file=args.key),
            lease=serving.LeaseSettings(namespace=args.lease_namespace, kubeconfig=args.kubeconfig),
            host=args.host,
            port=args.port,
            cert_check_s=args.cert_check_interval,
            max_connections=args.max_connections,
            request_timeout_s=args.request_timeout,
            connection_timeout_s=args.idle_timeout,
            metrics_port=args.metrics_port or None,
            metrics_host=args.metrics_address,
        )
    )
    return 0
