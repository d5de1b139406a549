"""``migpilot simulate``: replay a GPU trace against every partitioning policy (the main job).

The shell around :mod:`migpilot.sim`: it reads the trace file, measures planner CPU time with
``time.process_time``, draws the progress bar (on stderr, only when it is a terminal), prints the
table or JSON, and writes ``results.json`` and the PNG plots (matplotlib, Agg backend).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import IO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from migpilot import errors
from migpilot.cli import output
from migpilot.mig import migparted
from migpilot.planning import snapshot
from migpilot.sim import bounds, clusters, policies, reports, simulating, traces

DEFAULT_OUT = "migpilot-simulation"


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be 0 or more")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``simulate`` to the top-level subparsers."""
    p = subparsers.add_parser(
        "simulate",
        help="replay a GPU trace and compare partitioning policies (the main job)",
        description=(
            "Replay a workload trace on a simulated cluster of MIG GPUs under each partitioning "
            "policy and compare pods scheduled, compute-slice allocation and pending time. "
            "Writes results.json and PNG plots to --out."
        ),
    )
    p.add_argument(
        "--trace",
        default="openb",
        metavar="openb|FILE|synthetic:NAME",
        help="the bundled openb trace (default), an openb or MIG-native CSV file "
        "(name,arrival,duration,requests), or "
        "synthetic:inference|training|mixed|small-inference",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="MODEL:NODESxGPUS[@MODE],...",
        help=f"the cluster (default: {clusters.DEFAULT_SPEC} in inflate mode, "
        f"{clusters.DEFAULT_FAITHFUL_SPEC} in faithful mode); a group's nodes share their GPUs "
        "by MIG (default), @mps, @time-slicing[:REPLICAS] or @none; @dynamic: MIG nodes "
        "labelled migpilot.io/mig-mode=dynamic, whose idle GPUs may be switched out of MIG for "
        "whole-GPU pods",
    )
    p.add_argument(
        "--mode",
        choices=tuple(m.value for m in simulating.Replay),
        default=simulating.Replay.INFLATE.value,
        help="inflate: submit pods without departures until requests reach --inflate %% of the "
        "cluster (default); faithful: the trace's own arrival and run times",
    )
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, from {', '.join(policies.NAMES)} "
        f"(default: {','.join(policies.DEFAULT)}; with --requests unified: "
        f"{','.join(policies.DEFAULT_UNIFIED)})",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=1,
        help="seed of synthetic traces and of --shuffle (default 1)",
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="DIR",
        help=f"where results.json and the plots go (default: {DEFAULT_OUT})",
    )
    p.add_argument(
        "--inflate",
        type=_positive_float,
        default=130.0,
        metavar="PERCENT",
        help="inflate mode: requested compute, in %% of the cluster's (default 130)",
    )
    p.add_argument(
        "--shuffle",
        action="store_true",
        help="inflate mode: submit pods in an order shuffled with --seed instead of trace order",
    )
    p.add_argument(
        "--profile-mapping",
        choices=tuple(m.value for m in traces.ProfileMapping),
        default=None,
        help="openb gpu_milli to MIG profile: smallest covering compute (default) or memory",
    )
    p.add_argument(
        "--requests",
        choices=tuple(r.value for r in traces.Requests),
        default=traces.Requests.MIG.value,
        help="how openb and synthetic pods ask: mig (nvidia.com/mig-<profile>, the profile "
        "chosen by --profile-mapping; default) or unified (HAMi-style nvidia.com/gpu with "
        "gpumem-percentage = gpu_milli / 10: the planner picks the slice per GPU model)",
    )
    p.add_argument(
        "--whole-gpus",
        action="store_true",
        help="openb: rows using full GPUs (gpu_milli 1000) ask for whole GPUs (nvidia.com/gpu: "
        "N alone, MIG off), which only @dynamic cluster groups serve (docs/migmode.md); "
        "default: the whole-GPU MIG profile",
    )
    p.add_argument(
        "--scoring",
        choices=tuple(s.value for s in snapshot.Policy),
        default=snapshot.Policy.BINPACK.value,
        help="scheduler node scoring and planner node policy (default: binpack)",
    )
    p.add_argument(
        "--batch-window",
        type=_positive_float,
        default=simulating.Timing().batch_window_s,
        metavar="S",
        help="seconds pending pods are collected before planning (default 1)",
    )
    p.add_argument(
        "--advertise-delay",
        type=_positive_float,
        default=simulating.Timing().advertise_s,
        metavar="S",
        help="seconds from a MIG instance existing to the scheduler seeing it (default 1)",
    )
    p.add_argument("--mig-parted", metavar="FILE", help="static policy: a nvidia-mig-parted config")
    p.add_argument(
        "--mig-config",
        default=policies.DEFAULT_STATIC_CONFIG,
        metavar="NAME",
        help=f"static policy: the config to apply (default: {policies.DEFAULT_STATIC_CONFIG})",
    )
    p.add_argument(
        "--omit-timing",
        action="store_true",
        help="leave planner CPU time out, so equal runs give byte-identical results.json",
    )
    p.add_argument("--no-plots", action="store_true", help="write results.json only")
    output.add_output_flag(p)
    p.set_defaults(func=cmd_simulate)


def progress_bar(stream: IO[str]) -> Progress:
    """A transient one-line bar on ``stream``, drawn only when it is a terminal (a pipe or a
    CI log gets nothing, not a line per update)."""
    return Progress(
        TextColumn("simulating {task.description:<15}", markup=False),
        BarColumn(bar_width=30),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=Console(file=stream, highlight=False),
        transient=True,
        disable=not stream.isatty(),
    )


def load_trace(args: argparse.Namespace, cluster: clusters.Cluster) -> traces.Trace:
    """The trace ``--trace`` names, mapped onto the cluster's first GPU model."""
    requests = traces.Requests(args.requests)
    if args.profile_mapping is not None and requests is traces.Requests.UNIFIED:
        raise errors.MigpilotError(
            "--profile-mapping chooses MIG profiles for --requests mig; unified requests leave "
            "the choice to the planner"
        )
    mapping = traces.ProfileMapping(args.profile_mapping or traces.ProfileMapping.COMPUTE)
    model = cluster.reference_model
    whole = bool(args.whole_gpus)
    if args.trace == "openb":
        return traces.bundled_openb(model, mapping=mapping, requests=requests, whole_gpus=whole)
    if args.trace.startswith("synthetic:"):
        name = args.trace.removeprefix("synthetic:")
        return traces.synthetic(
            name, seed=args.seed, model=model, mapping=mapping, requests=requests
        )
    path = Path(args.trace)
    text = path.read_text(encoding="utf-8")
    return traces.parse(
        text,
        source=path.name,
        model=model,
        mapping=mapping,
        requests=requests,
        whole_gpus=whole,
    )


def cmd_simulate(args: argparse.Namespace, out: IO[str]) -> int:
    """Run every policy on the trace; print the table or JSON; write results and plots."""
    mode = simulating.Replay(args.mode)
    spec = args.cluster or (
        clusters.DEFAULT_SPEC
        if mode is simulating.Replay.INFLATE
        else clusters.DEFAULT_FAITHFUL_SPEC
    )
    cluster = clusters.parse(spec)
    default = (
        policies.DEFAULT_UNIFIED if args.requests == traces.Requests.UNIFIED else policies.DEFAULT
    )
    names = policies.parse_names(args.policies or ",".join(default))
    trace = load_trace(args, cluster)
    if not trace.pods:
        raise errors.TraceError(f"{trace.name}: the trace has no GPU pod")
    settings = simulating.Settings(
        mode=mode,
        inflate_fraction=args.inflate / 100.0,
        shuffle_seed=args.seed if args.shuffle else None,
        scoring=snapshot.Policy(args.scoring),
        timing=simulating.Timing(
            batch_window_s=args.batch_window, advertise_s=args.advertise_delay
        ),
    )
    config = None
    if args.mig_parted:
        path = Path(args.mig_parted)
        config = migparted.parse(path.read_text(encoding="utf-8"), source=path.name)
    # Build every policy before simulating, so a bad name or config fails at once.
    built: dict[str, policies.Partitioning | None] = {}
    for name in names:
        if name == "static":
            built[name] = policies.static(cluster, config=config, config_name=args.mig_config)
        elif name == "static-best":
            built[name] = None
        else:
            built[name] = policies.dynamic(name, cluster)
    results: list[simulating.Result] = []
    best_layouts = ""
    with progress_bar(sys.stderr) as bar:
        task = bar.add_task("", total=len(names))
        for i, name in enumerate(names):

            def progress(f: float, i: int = i, name: str = name) -> None:
                bar.update(task, completed=i + f, description=name)

            policy = built[name]
            if policy is None:
                policy, result = simulating.best_static(
                    trace, cluster=cluster, settings=settings, progress=progress
                )
                best_layouts = "; ".join(
                    f"{model}: {per_index[0]}" for model, per_index in policy.start.items()
                )
            else:
                result = simulating.simulate(
                    trace,
                    cluster=cluster,
                    policy=policy,
                    settings=settings,
                    cpu_clock=time.process_time,
                    progress=progress,
                )
            results.append(result)
    bound = None
    if mode is simulating.Replay.INFLATE:
        submitted = [
            p for p, _, _ in simulating.replayed(trace, cluster=cluster, settings=settings)
        ]
        bound = bounds.inflate_bound(submitted, cluster=cluster).allocation_ratio
    doc = reports.document(results, mode=mode, bound=bound, timing=not args.omit_timing)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "results.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    plots: list[Path] = []
    if not args.no_plots:
        plots = _plot(results, outdir=outdir, mode=mode)
    if args.output == "json":
        output.write_json(out, doc)
        return 0
    submitted_pods = results[0].pods_total if results else 0
    what = (
        f"{submitted_pods} pods submitted until requests reached {args.inflate:g}% of the cluster"
        if mode is simulating.Replay.INFLATE
        else f"{submitted_pods} pods at the trace's own times"
    )
    out.write(
        f"trace {trace.name} ({what}), cluster {spec} ({cluster.gpu_count} GPUs), "
        f"mode {mode.value}\n\n"
    )
    output.write_table(
        out, reports.HEADERS, reports.table(doc["results"]), right=reports.HEADERS[1:]
    )
    out.write("\n")
    if best_layouts:
        out.write(f"static-best layouts: {best_layouts}\n")
    for line in reports.summary(doc):
        out.write(line + "\n")
    out.write(f"results: {outdir / 'results.json'}\n")
    if plots:
        out.write(f"plots: {', '.join(str(p) for p in plots)}\n")
    return 0


def _plot(results: list[simulating.Result], *, outdir: Path, mode: simulating.Replay) -> list[Path]:
    """Allocation ratio over time per policy, and the CDF of pending time."""
    # Imported here: matplotlib takes a noticeable time to load and only this needs it.
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    days = mode is simulating.Replay.FAITHFUL
    scale = 86400.0 if days else 1.0
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        xs = [t / scale for t, _ in r.ratio_over_time] + [r.end / scale]
        ys = [100 * v for _, v in r.ratio_over_time] + [100 * r.ratio_over_time[-1][1]]
        ax.step(xs, ys, where="post", label=r.policy)
    ax.set_xlabel("time (days)" if days else "time (s)")
    ax.set_ylabel("compute slices allocated (%)")
    ax.set_title("Allocation ratio over time")
    ax.set_ylim(0, 102)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    alloc = outdir / "allocation.png"
    fig.savefig(alloc, dpi=100, metadata={"Software": None})
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in results:
        values = sorted(r.pending_s)
        if not values:
            continue
        ys = [100 * (i + 1) / len(values) for i in range(len(values))]
        ax.step(values, ys, where="post", label=r.policy)
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlabel("pending time (s)")
    ax.set_ylabel("pods (%)")
    ax.set_title("Pending time (CDF; pods never scheduled count until the end)")
    ax.set_ylim(0, 101)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = outdir / "pending-cdf.png"
    fig.savefig(cdf, dpi=100, metadata={"Software": None})
    plt.close(fig)
    return [alloc, cdf]
