"""``migpilot config validate | show``: nvidia-mig-parted config files from the command line.

The shell around :mod:`migpilot.mig.migparted`: it reads the file (the only I/O), calls the pure
parser and checker, and renders the answer as a table or JSON. Errors in the file surface as
:class:`errors.ConfigError`, which ``cli.main`` prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import IO, Any

from migpilot import digits, errors
from migpilot.cli import output
from migpilot.mig import catalog, migparted, pciids, profiles

EXIT_PROBLEMS = 1
"""``validate`` found configs that the catalog's GPUs cannot hold."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``config validate`` and ``config show`` to the top-level subparsers."""
    config = subparsers.add_parser(
        "config", help="validate or show an nvidia-mig-parted config file"
    )
    sub = config.add_subparsers(dest="config_command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "validate",
        help="parse a mig-parted config file and check every config against the catalog",
        description=(
            "Exit 0 when the file parses and every entry places on the GPUs it targets; exit 1 "
            "listing the problems otherwise; exit 2 when the file does not parse."
        ),
    )
    p.add_argument("file", metavar="FILE", help="mig-parted config file (YAML)")
    output.add_output_flag(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser(
        "show",
        help="show the layout each GPU of a node gets under one config",
        description=(
            "Pick the entry for each GPU as mig-parted does (the last matching entry wins) and "
            "print the placed layout, or 'disabled'."
        ),
    )
    p.add_argument("file", metavar="FILE", help="mig-parted config file (YAML)")
    p.add_argument("-c", "--config", required=True, metavar="NAME", help="config to show")
    p.add_argument(
        "--gpu",
        required=True,
        metavar="GPU",
        help="the node's GPUs: a model (any alias), or a PCI id such as 0x20B010DE or, with "
        "the board's subsystem id, 0x233010DE:0x16C110DE (entries filtered to a board match "
        "only a GPU given with that board's id)",
    )
    p.add_argument(
        "--gpus", type=_positive_int, default=8, metavar="N", help="GPUs on the node (default: 8)"
    )
    output.add_output_flag(p)
    p.set_defaults(func=cmd_show)


def _positive_int(text: str) -> int:
    try:
        value = digits.integer(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: need at least 1")
    return value


def _read(path: str) -> migparted.ConfigFile:
    """Read and parse the file; ``OSError`` is left to ``cli.main``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise errors.ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    return migparted.parse(text, source=path)


def cmd_validate(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot config validate FILE``."""
    config = _read(args.file)
    problems = migparted.check(config)
    count = len(config.configs)
    if args.output == "json":
        output.write_json(out, {"file": args.file, "configs": count, "problems": problems})
    elif problems:
        for problem in problems:
            out.write(problem + "\n")
        noun = "problem" if len(problems) == 1 else "problems"
        out.write(f"{len(problems)} {noun} ({count} configs checked)\n")
    else:
        noun = "config" if count == 1 else "configs"
        out.write(f"ok: {count} {noun} validated against the catalog\n")
    return EXIT_PROBLEMS if problems else 0


def cmd_show(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot config show FILE -c NAME --gpu MODEL [--gpus N]``."""
    config = _read(args.file)
    model, pci_id = _gpu(args.gpu)
    gpus = migparted.layout_for(config, args.config, model=model, gpus=args.gpus, pci_id=pci_id)
    if args.output == "json":
        output.write_json(
            out,
            {
                "config": args.config,
                "gpu": model.id,
                "pci_id": None if pci_id is None else str(pci_id),
                "gpus": [_gpu_json(g) for g in gpus],
            },
        )
        return 0
    rows = [(g.index, g.entry, str(g.layout) if g.mig_enabled else "disabled") for g in gpus]
    output.write_table(out, ("GPU", "ENTRY", "LAYOUT"), rows, right=("GPU",))
    return 0


def _gpu(text: str) -> tuple[profiles.GpuModel, pciids.PciId | None]:
    """``--gpu``: a model name, or a PCI id read as mig-parted reads device-filter ids."""
    if not pciids.looks_like_id(text):
        return catalog.resolve_gpu(text), None
    try:
        pci_id = pciids.parse(text.strip())
    except ValueError as e:
        raise errors.UnknownGpuError(f"--gpu {text.strip()!r}: {e}") from None
    model = catalog.default().by_pci_device_id(pci_id.device)
    if model is None:
        raise errors.UnknownGpuError(f"unknown GPU PCI device id 0x{pci_id.device:08X}")
    return model, pci_id


def _gpu_json(gpu: migparted.GpuLayout) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "mig_enabled": gpu.mig_enabled,
        "layout": [{"profile": i.profile, "start": i.start} for i in gpu.layout.instances],
    }
