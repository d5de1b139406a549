"""``migpilot plan`` and ``migpilot snapshot generate``: the planner from the command line.

The shell around :mod:`migpilot.planning`: it reads the snapshot file (the only I/O besides the
output), times the planner with the process clock (which the pure core may not touch), re-checks
every plan with the independent validator, and renders the answer as a table for an admin or as
the documented JSON. A malformed file is an :class:`errors.SnapshotError` (one line, exit 2); a
plan the validator rejects is a bug in migpilot (exit 3). ``snapshot generate`` writes the
seeded snapshots of :mod:`migpilot.planning.generate` so that anyone can make a cluster to plan.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml

from migpilot import digits, errors, gcpause, yamltext
from migpilot.cli import output
from migpilot.planning import dynamic, generate, options, planners, plans, snapshot, validation

EXIT_PLANNER_BUG = 3
"""The plan failed the validator: a bug in the planner, not in the input."""

_LOADER: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER: type[yaml.SafeDumper] = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``plan`` and ``snapshot generate`` to the top-level subparsers."""
    p = subparsers.add_parser(
        "plan",
        help="plan MIG layouts and pod placements for a cluster snapshot",
        description=(
            "Read a cluster snapshot (version 1, YAML or JSON) and print the target MIG layout "
            "of every GPU, the create/destroy actions and where each pending pod goes. Exit 0 "
            "when planning succeeded (pods left unschedulable are part of the answer), 2 for "
            "bad input, 3 when the plan fails migpilot's own validator (a bug)."
        ),
    )
    p.add_argument("snapshot", metavar="SNAPSHOT", help="snapshot file (YAML or JSON; - for stdin)")
    p.add_argument(
        "--planner",
        choices=tuple(planners.PLANNERS),
        default="fast",
        help="planner to run (default: fast)",
    )
    p.add_argument(
        "--policy",
        choices=tuple(pol.value for pol in snapshot.Policy),
        help="node policy, overriding the snapshot's (default: the snapshot's, else binpack); "
        "a pod's hami.io/node-scheduler-policy annotation still wins for that pod",
    )
    p.add_argument(
        "--gpu-policy",
        choices=tuple(pol.value for pol in snapshot.Policy),
        help="GPU policy, overriding the snapshot's (default: the snapshot's, else spread); "
        "a pod's hami.io/gpu-scheduler-policy annotation still wins for that pod",
    )
    p.add_argument(
        "--time-limit",
        type=_positive_float,
        metavar="S",
        help=f"exact planner: solver time limit in seconds "
        f"(default: {options.Options().time_limit_s:g})",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="for each unschedulable pod, say why each node was rejected",
    )
    p.add_argument(
        "--omit-timing",
        action="store_true",
        help="leave the planner's run time out, so equal snapshots give byte-identical output",
    )
    output.add_output_flag(p)
    p.set_defaults(func=cmd_plan)

    snap = subparsers.add_parser("snapshot", help="make cluster snapshots for 'migpilot plan'")
    sub = snap.add_subparsers(dest="snapshot_command", metavar="COMMAND", required=True)
    g = sub.add_parser(
        "generate",
        help="write a seeded random, trace-shaped or sharing cluster snapshot",
        description=(
            "Generate a cluster snapshot: 'random' draws mixed-model nodes with partly used GPUs "
            "and pods with selectors, taints, priorities and multi-instance requests; 'trace' "
            "draws pods shaped like the Alibaba openb GPU trace; 'sharing' draws nodes in the "
            "modes of --modes (MPS GPUs partly sliced, time-slicing GPUs partly used) and pods "
            "asking nvidia.com/gpu-<N>gb slices, unified requests or MIG profiles. The same "
            "arguments always give the same file."
        ),
    )
    g.add_argument(
        "--kind", choices=("random", "trace", "sharing"), default="random", help="default: random"
    )
    g.add_argument("--seed", type=int, default=0, metavar="N", help="random seed (default: 0)")
    g.add_argument("--nodes", type=_count(0), default=8, metavar="N", help="nodes (default: 8)")
    g.add_argument(
        "--gpus-per-node",
        type=_count(1),
        default=8,
        metavar="N",
        help="GPUs per node (default: 8)",
    )
    g.add_argument(
        "--pods", type=_count(0), default=64, metavar="N", help="pending pods (default: 64)"
    )
    g.add_argument(
        "--models",
        default=",".join(generate.DEFAULT_MODELS),
        metavar="M,...",
        help=f"GPU models to mix (default: {','.join(generate.DEFAULT_MODELS)})",
    )
    g.add_argument(
        "--modes",
        default=",".join(generate.SHARING_MODES),
        metavar="MODE,...",
        help="--kind sharing: node modes, node i in the i-th modulo their number (mig, mps, "
        f"time-slicing, none; default: {','.join(generate.SHARING_MODES)})",
    )
    g.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write here instead of stdout (JSON when FILE ends in .json, else YAML; JSON "
        "loads many times faster for clusters of thousands of GPUs)",
    )
    g.set_defaults(func=cmd_generate)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: need a positive number of seconds")
    return value


def _count(least: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = digits.integer(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{text!r}: need at least {least}")
        return value

    return parse


# --------------------------------------------------------------------------- reading


def read_snapshot(path: str) -> snapshot.Snapshot:
    """Read, decode and parse a snapshot file (``-`` is stdin); ``OSError`` is left to main."""
    source = "<stdin>" if path == "-" else path
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise errors.SnapshotError(f"{source}: not UTF-8 text (byte {e.start})") from None
    return snapshot.parse(decode(text, source=source), source=source)


def decode(text: str, *, source: str) -> Any:
    """YAML or JSON text as data; a syntax error becomes one line naming where it is."""
    json_error: str | None = None
    if source.endswith(".json") or text.lstrip().startswith(("{", "[")):
        try:
            return json.loads(text)
        except RecursionError:
            raise errors.SnapshotError(f"{source}: malformed JSON: {yamltext.TOO_DEEP}") from None
        except json.JSONDecodeError as e:
            json_error = f"malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}"
            if source.endswith(".json"):
                raise errors.SnapshotError(f"{source}: {json_error}") from None
            # Maybe YAML in flow style, which also starts with { or [.
        except ValueError as e:  # JSON, but a number of more than 4300 digits
            raise errors.SnapshotError(
                f"{source}: malformed JSON: {yamltext.value_problem(e)}"
            ) from None
    try:
        # A safe loader (the C one when PyYAML has it: large snapshots load several times faster).
        return yaml.load(text, Loader=_LOADER)
    except yaml.YAMLError as e:
        reason = json_error or f"malformed YAML: {_yaml_reason(e)}"
        raise errors.SnapshotError(f"{source}: {reason}") from None
    except RecursionError:  # the pure-Python loader, where PyYAML lacks the C one
        raise errors.SnapshotError(f"{source}: malformed YAML: {yamltext.TOO_DEEP}") from None
    except ValueError as e:  # a value PyYAML cannot build: 5000 digits, the 13th month
        raise errors.SnapshotError(
            f"{source}: malformed YAML: {yamltext.value_problem(e)}"
        ) from None


def _yaml_reason(e: yaml.YAMLError) -> str:
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        return f"{e.problem} at line {mark.line + 1}, column {mark.column + 1}"
    first = str(e).strip().splitlines()
    return first[0] if first else type(e).__name__


# --------------------------------------------------------------------------- plan


def cmd_plan(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot plan SNAPSHOT``."""
    snap = read_snapshot(args.snapshot)
    if args.policy is not None:
        snap = dataclasses.replace(snap, policy=snapshot.Policy(args.policy))
    if args.gpu_policy is not None:
        snap = dataclasses.replace(snap, gpu_policy=snapshot.Policy(args.gpu_policy))
    defaults = options.Options()
    opts = options.Options(
        explain=args.explain,
        time_limit_s=args.time_limit if args.time_limit is not None else defaults.time_limit_s,
    )
    # Planning allocates heavily and makes no garbage cycles: run it with the collector paused.
    with gcpause.paused():
        started = time.perf_counter()
        # Through dynamic MIG mode, as the controller plans (control.decide): a snapshot without
        # dynamic nodes, whole GPUs and whole-GPU pods is planned by the planner alone.
        plan = dynamic.plan(snap, lambda s: planners.run(s, args.planner, opts))
        seconds = time.perf_counter() - started
    found = validation.problems(snap, plan)
    if found:
        sys.stderr.write(
            f"migpilot: internal error: planner {args.planner!r} produced a plan that fails "
            f"validation ({len(found)} {'problem' if len(found) == 1 else 'problems'}); this is "
            "a bug in migpilot, please report it "
            "with the snapshot\n"
        )
        for problem in found:
            sys.stderr.write(f"  {problem}\n")
        return EXIT_PLANNER_BUG
    shown = None if args.omit_timing else seconds
    if args.output == "json":
        output.write_json(out, plans.to_json(plan, seconds=shown, explain=args.explain))
    else:
        write_plan_table(out, snap, plan, seconds=shown, explain=args.explain)
    return 0


def _instances_text(gpu: snapshot.Gpu) -> str:
    """The current layout, instances in use marked with ``*``."""
    used = {i.instance for i in gpu.instances if i.used}
    return " ".join(f"{i}{'*' if i in used else ''}" for i in gpu.layout.instances) or "(empty)"


def write_plan_table(
    out: IO[str],
    snap: snapshot.Snapshot,
    plan: plans.Plan,
    *,
    seconds: float | None,
    explain: bool,
) -> None:
    """The plan for a person: a summary line, then what changes, what runs where, what waits."""
    changed = [g for g in plan.gpus if g.changed]
    waiting = len(snap.pods) + len(snap.whole_pods)
    summary = (
        f"planner {plan.planner}: {len(plan.placements)}/{waiting} pods placed, "
        f"{len(changed)}/{len(plan.gpus)} GPUs changed, {len(plan.actions)} actions"
    )
    if plan.switches:
        n = len(plan.switches)
        summary += f", {n} MIG mode switch{'es' if n > 1 else ''}"
    if seconds is not None:
        summary += f", {seconds:.3f} s"
    if plan.optimal is not None:
        summary += ", optimality " + ("proven" if plan.optimal else "not proven")
    policies = f"policy {snap.policy.value}"
    if snap.gpu_policy is not snapshot.Policy.SPREAD or any(
        p.node_policy or p.gpu_policy or p.unified for p in snap.pods
    ):
        policies += f", GPU policy {snap.gpu_policy.value}"
    out.write(f"{summary} ({policies})\n")

    current = {(n.name, g.index): g for n in snap.nodes for g in n.gpus}
    _section(out, "GPU layouts that change", len(changed))
    if changed:
        layout_rows = [
            (g.node, g.gpu, _instances_text(current[(g.node, g.gpu)]), "->", str(g.layout))
            for g in changed
        ]
        output.write_table(
            out, ("NODE", "GPU", "BEFORE (* in use)", "", "AFTER"), layout_rows, right=("GPU",)
        )

    if plan.switches:
        _section(out, "MIG mode switches", len(plan.switches))
        switch_rows = [
            (s.node, s.gpu, "MIG on" if s.mig else "MIG off (whole GPU)") for s in plan.switches
        ]
        output.write_table(out, ("NODE", "GPU", "TO"), switch_rows, right=("GPU",))

    _section(out, "Actions", len(plan.actions))
    if plan.actions:
        action_rows = [(a.node, a.gpu, a.op.value, f"{a.profile}@{a.start}") for a in plan.actions]
        output.write_table(out, ("NODE", "GPU", "OP", "INSTANCE"), action_rows, right=("GPU",))

    if plan.mps:
        _section(out, "MPS slice actions", len(plan.slice_actions))
        if plan.slice_actions:
            slice_rows = [
                (a.node, a.gpu, a.op.value, f"#{a.slice}:{a.memory_gb}gb", a.reason)
                for a in plan.slice_actions
            ]
            output.write_table(
                out, ("NODE", "GPU", "OP", "SLICE", "WHY"), slice_rows, right=("GPU",)
            )

    _section(out, "Placements", len(plan.placements))
    if plan.placements:
        placement_rows: list[tuple[str, ...]] = [
            (
                p.pod,
                p.node,
                " ".join(
                    [f"gpu{i.gpu}:{i.profile}@{i.start}" for i in p.instances]
                    + [_share_text(sh) for sh in p.shares]
                    + [f"gpu{g}:whole" for g in p.gpus]
                ),
            )
            for p in plan.placements
        ]
        headers: tuple[str, ...] = ("POD", "NODE", "INSTANCES (gpu:profile@start)")
        if plan.mps or any(p.shares for p in plan.placements):
            headers = ("POD", "NODE", "GIVEN (gpu:profile@start, gpu:mps#slice:GB, gpu:replica)")
        pods = {p.key: p for p in (*snap.pods, *snap.whole_pods)}
        if any(p.unified is not None or p.mps or p.whole for p in pods.values()):
            # Unified pods name no profile: show what each asked beside the profile chosen.
            headers = (*headers, "ASKED")
            placement_rows = [
                (*row, pods[p.pod].request_text())
                for row, p in zip(placement_rows, plan.placements, strict=True)
            ]
        output.write_table(out, headers, placement_rows)

    _section(out, "Unschedulable", len(plan.unschedulable))
    for u in plan.unschedulable:
        out.write(f"{u.pod}: {u.reason}\n")
        if explain:
            for node, reason in u.nodes:
                out.write(f"    {node}: {reason}\n")


def _share_text(share: plans.AssignedShare) -> str:
    if share.slice is None:
        return f"gpu{share.gpu}:replica"
    return f"gpu{share.gpu}:mps#{share.slice}:{share.memory_gb}gb"


def _section(out: IO[str], title: str, count: int) -> None:
    out.write(f"\n{title}: {'none' if count == 0 else count}\n")


# --------------------------------------------------------------------------- generate


def _quantity(value: str, *, memory: bool) -> str:
    """``48000m`` as ``48`` and ``17179869184`` bytes as ``16Gi``, the way people write them."""
    if memory and digits.is_digits(value):
        for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20)):
            if int(value) % size == 0:
                return f"{int(value) // size}{unit}"
    if (
        not memory
        and value.endswith("m")
        and digits.is_digits(value[:-1])
        and int(value[:-1]) % 1000 == 0
    ):
        return str(int(value[:-1]) // 1000)
    return value


def _readable_quantities(doc: dict[str, Any]) -> dict[str, Any]:
    for item in [*doc["nodes"], *doc["pods"]]:
        for field in ("allocatable", "requests"):
            amounts = item.get(field)
            if amounts is None:
                continue
            for name in ("cpu", "memory"):
                if isinstance(amounts.get(name), str):
                    amounts[name] = _quantity(amounts[name], memory=name == "memory")
    return doc


def cmd_generate(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot snapshot generate``."""
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    sizes = {
        "seed": args.seed,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "pods": args.pods,
        "models": models,
    }
    command = (
        f"migpilot snapshot generate --kind {args.kind} --seed {args.seed} --nodes {args.nodes} "
        f"--gpus-per-node {args.gpus_per_node} --pods {args.pods} --models {','.join(models)}"
    )
    if args.kind == "sharing":
        node_modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        snap = generate.sharing_snapshot(**sizes, node_modes=node_modes)
        command += f" --modes {','.join(node_modes)}"
    elif args.kind == "trace":
        snap = generate.trace_snapshot(**sizes)
    else:
        snap = generate.random_snapshot(**sizes)
    doc = _readable_quantities(snapshot.to_document(snap))
    as_json = args.output is not None and args.output.endswith(".json")
    if as_json:
        text = json.dumps(doc, indent=1) + "\n"
    else:
        text = f"# Generated by: {command}\n" + yaml.dump(
            doc, Dumper=_DUMPER, sort_keys=False, default_flow_style=None, width=100
        )
    if args.output is None:
        out.write(text)
    else:
        Path(args.output).write_text(text, encoding="utf-8")
        gpus = sum(len(n.gpus) for n in snap.nodes)
        out.write(
            f"wrote {args.output}: {len(snap.nodes)} nodes, {gpus} GPUs, {len(snap.pods)} pods\n"
        )
    return 0
