"""``migpilot autoscaling overlay``: print the Karpenter NodeOverlay that tells Karpenter what
MIG resources a new node of a GPU model offers.

Why a command: the overlay's counts come from migpilot's MIG model (how many instances of each
profile the node's empty GPUs hold, :func:`~migpilot.mig.capacity.profile_capacity`), and an
operator should not have to work out 25 numbers by hand for each instance type. Thin: the flags
become :func:`~migpilot.planning.overlays.node_overlay`'s arguments, the object is written as
YAML for ``kubectl apply -f -`` (``docs/autoscaling.md``, "Node autoscaling").
"""

from __future__ import annotations

import argparse
from typing import IO

import yaml

from migpilot.mig import catalog
from migpilot.planning import overlays


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``autoscaling`` (with ``overlay``) to the top-level subparsers."""
    group = subparsers.add_parser(
        "autoscaling", help="objects for node autoscalers (docs/autoscaling.md)"
    )
    sub = group.add_subparsers(dest="autoscaling_command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "overlay",
        help="print a Karpenter NodeOverlay listing a GPU node's MIG resources",
        description=(
            "Print a Karpenter NodeOverlay (karpenter.sh/v1alpha1; Karpenter's NodeOverlay "
            "feature gate) whose capacity lists every MIG resource of --model, counted for "
            "--gpus empty GPUs: each profile at the most instances of it those GPUs hold. "
            "The --requirement labels select the instance types it applies to."
        ),
    )
    p.add_argument("--model", required=True, metavar="GPU", help="the GPU model (H100-80GB, ...)")
    p.add_argument(
        "--gpus", required=True, type=int, metavar="N", help="GPUs of that model on one node"
    )
    p.add_argument(
        "--name", metavar="NAME", help="the overlay's name (default: migpilot-<model>-x<N>)"
    )
    p.add_argument(
        "--requirement",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=(
            "a label the instance types must have (operator In), repeatable, at least one "
            "(e.g. node.kubernetes.io/instance-type=p5.48xlarge)"
        ),
    )
    p.set_defaults(func=_overlay)


def _overlay(args: argparse.Namespace, out: IO[str]) -> int:
    model = catalog.resolve_gpu(args.model)
    requirements = overlays.parse_requirements(args.requirement)
    doc = overlays.node_overlay(model, args.gpus, requirements=requirements, name=args.name)
    out.write(yaml.safe_dump(doc, sort_keys=False))
    return 0
