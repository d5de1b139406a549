"""``migpilot status``: the cluster's GPU nodes, who holds each device, and the pods waiting.

The first thing an admin types. Reads GpuLayouts, Nodes, Pods and the controller's Events once
(:func:`migpilot.controller.kube.read_objects`, the controller shell's one lightkube module),
joins them with the pure :func:`migpilot.controller.surveying.survey`, and renders the result
as rich tables or as the ``-o json`` document (``docs/controller.md``, "migpilot status").
``--watch`` reads and renders again every ``--interval`` seconds until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from migpilot import errors
from migpilot.cli import output
from migpilot.controller import kube, querying, surveying

DEFAULT_INTERVAL_S = 2.0
READ_TIMEOUT_S = 10.0
"""How long one read of the API server may take before the command gives up on it."""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "status",
        help=(
            "show GPU nodes, who holds each MIG instance, MPS slice or time-slicing replica, "
            "and pending pods"
        ),
        description=(
            "Show every GPU node (model, mode, GPUs), its MIG instances, MPS slices and "
            "time-slicing replicas by profile and state with the pod holding each, and the "
            "pods waiting for migpilot with the reason of the controller's latest Event."
        ),
    )
    p.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="kubeconfig file (default: the in-cluster service account)",
    )
    p.add_argument(
        "--prometheus-url",
        default=None,
        metavar="URL",
        help=(
            "Prometheus to read migpilot_device_utilization_ratio from (e.g. "
            "http://prometheus:9090): adds each device's utilisation; a failed query is a "
            "warning and no utilisation is shown"
        ),
    )
    output.add_output_flag(p)
    p.add_argument(
        "--watch",
        action="store_true",
        help="read and show again every --interval seconds, until Ctrl-C",
    )
    p.add_argument(
        "--interval",
        type=_positive,
        default=DEFAULT_INTERVAL_S,
        metavar="SECONDS",
        help=f"seconds between two reads with --watch (default: {DEFAULT_INTERVAL_S:g})",
    )
    p.set_defaults(func=_run)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0.1 and 3600 seconds: {text!r}")
    return value


def read(
    kubeconfig: Path | None,
    *,
    source: querying.UtilizationSource | None = None,
    warn: Callable[[str], object] = lambda line: sys.stderr.write(line + "\n"),
) -> surveying.Status:
    """One read of the cluster, surveyed, with ``source``'s utilisation when it answers."""
    objects = asyncio.run(kube.read_objects(kubeconfig, timeout_s=READ_TIMEOUT_S))
    return surveyed(objects, source=source, warn=warn)


def surveyed(
    objects: kube.Objects,
    *,
    source: querying.UtilizationSource | None,
    warn: Callable[[str], object],
) -> surveying.Status:
    """The survey of ``objects``; a failing ``source`` is one warning and no utilisation."""
    utilization = None
    if source is not None:
        try:
            utilization = source.utilization()
        except querying.QueryError as err:
            warn(f"migpilot: warning: no utilisation: {err}")
    return surveying.survey(
        layouts=objects.layouts,
        nodes=objects.nodes,
        pods=objects.pods,
        events=objects.events,
        utilization=utilization,
        utilization_source=source.name if source is not None else None,
    )


# --------------------------------------------------------------------------- rendering


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _holder(d: surveying.Device) -> Text:
    if d.pod is not None:
        suffix = (
            {
                surveying.Holding.RESERVED_FOR: " (reserved for)",
                surveying.Holding.INFERRED: " (inferred)",
            }.get(d.holding)
            if d.holding is not None
            else None
        )
        return Text(d.pod + (suffix or ""))
    if d.holding is surveying.Holding.UNKNOWN:
        if d.candidates:
            return Text(f"unknown: one of {', '.join(d.candidates)}", style="yellow")
        return Text("unknown", style="yellow")
    return Text("-")


_STATE_STYLE = {"free": "green", "used": "bold", "reserved": "cyan", "planned": "dim"}


def _node_table(node: surveying.NodeStatus, *, utilization: bool) -> RenderableType:
    title = Text(node.name, style="bold")
    title.append(
        f"  {node.model or 'model unknown'}  mode {node.mode}  {node.gpu_count} GPU"
        f"{'s' if node.gpu_count != 1 else ''}"
    )
    if not node.reported and node.gpus:
        title.append("  (the agent has not reported)", style="yellow")
    parts: list[RenderableType] = [title]
    if node.problem:
        parts.append(Text(f"  problem: {node.problem}", style="red"))
    counts = surveying.counts(node)
    if counts:
        by_profile: dict[str, list[str]] = {}
        for (profile, state), n in sorted(counts.items()):
            by_profile.setdefault(profile, []).append(f"{n} {state}")
        parts.append(Text("  " + "; ".join(f"{p}: {', '.join(s)}" for p, s in by_profile.items())))
    devices = [(g, d) for g in node.gpus for d in g.devices]
    if devices:
        table = Table(box=box.SIMPLE, pad_edge=False, show_edge=False)
        for header in ("GPU", "DEVICE", "SLOT", "STATE", "POD"):
            table.add_column(header)
        if utilization:
            table.add_column("UTIL", justify="right")
        for g, d in devices:
            row: list[RenderableType] = [
                str(g.index),
                d.profile,
                str(d.slot),
                Text(d.state, style=_STATE_STYLE.get(d.state, "")),
                _holder(d),
            ]
            if utilization:
                row.append(_pct(d.utilization))
            table.add_row(*row)
        parts.append(table)
    elif node.gpus:
        parts.append(Text("  no MIG instances, MPS slices or time-slicing replicas"))
    r = node.replicas
    if r is not None:
        per = f" ({r.per_gpu} per GPU)" if r.per_gpu is not None else ""
        pods = f": {', '.join(r.pods)}" if r.pods else ""
        parts.append(Text(f"  replicas{per}: {r.used} of {r.total} used{pods}"))
    return Group(*parts, Text(""))


def _pending_table(status: surveying.Status) -> RenderableType:
    if not status.pending:
        return Text("No pods waiting for migpilot.")
    table = Table(
        title=f"Pending pods ({len(status.pending)})",
        title_justify="left",
        box=box.SIMPLE,
        pad_edge=False,
        show_edge=False,
    )
    for header in ("POD", "ASKS", "GATED", "REASON"):
        table.add_column(header, no_wrap=header != "ASKS")
    table.add_column("MESSAGE", overflow="fold")
    for p in status.pending:
        reason = p.reason or "no event from the controller yet"
        style = "yellow" if p.event_type == "Warning" else ""
        table.add_row(
            p.pod,
            "\n".join(p.asks) or "-",
            "yes" if p.gated else "no",
            Text(reason, style=style),
            p.message or "-",
        )
    return table


def renderable(status: surveying.Status) -> RenderableType:
    """The table view of one survey."""
    parts: list[RenderableType] = []
    if not status.nodes:
        parts.append(Text("No GPU nodes (no GpuLayout, and no Node with GPU labels).\n"))
    utilization = status.utilization_source is not None
    parts += [_node_table(n, utilization=utilization) for n in status.nodes]
    parts.append(_pending_table(status))
    return Group(*parts)


def write(out: IO[str], status: surveying.Status, fmt: str, *, watching: bool = False) -> None:
    """One survey as a table or as JSON (one line per survey while watching)."""
    if fmt == "json":
        doc = surveying.to_json(status)
        if watching:
            out.write(json.dumps(doc, separators=(",", ":")) + "\n")
            out.flush()
        else:
            output.write_json(out, doc)
        return
    output.console_for(out).print(renderable(status))


# --------------------------------------------------------------------------- the command


def watch(
    *,
    read_once: Callable[[], surveying.Status],
    show: Callable[[surveying.Status], None],
    interval_s: float,
    sleep: Callable[[float], None] = time.sleep,
    complain: Callable[[str], object] = lambda line: sys.stderr.write(line + "\n"),
) -> int:
    """Read and show every ``interval_s`` until Ctrl-C (exit 0). The first read failing ends
    the command (exit 2 from the caller); a later one is said on stderr and tried again."""
    first = True
    try:
        while True:
            try:
                status = read_once()
            except errors.MigpilotError as err:
                if first:
                    raise
                complain(f"migpilot: error: {err} (trying again in {interval_s:g} s)")
            else:
                show(status)
            first = False
            sleep(interval_s)
    except KeyboardInterrupt:
        return 0


def _run(args: argparse.Namespace, out: IO[str]) -> int:
    source = querying.Prometheus(args.prometheus_url) if args.prometheus_url else None
    if not args.watch:
        write(out, read(args.kubeconfig, source=source), args.output)
        return 0
    console = output.console_for(out)

    def show(status: surveying.Status) -> None:
        if args.output == "json":
            write(out, status, "json", watching=True)
            return
        if console.is_terminal:
            console.clear()
        stamp = datetime.datetime.now().astimezone().strftime("%H:%M:%S")
        console.print(
            Text(f"migpilot status at {stamp}, every {args.interval:g} s (Ctrl-C to stop)\n")
        )
        console.print(renderable(status))

    return watch(
        read_once=lambda: read(args.kubeconfig, source=source),
        show=show,
        interval_s=args.interval,
    )
