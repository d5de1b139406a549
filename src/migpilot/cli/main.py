"""Entry point of the ``migpilot`` command: argument parsing and error handling."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import IO

import yaml

import migpilot
from migpilot import errors
from migpilot.cli import (
    agent_cmd,
    autoscaling_cmd,
    config_cmd,
    controller_cmd,
    fleet_cmd,
    mig_cmds,
    mps_cmd,
    plan_cmd,
    simulate_cmd,
    status_cmd,
    webhook_cmd,
)

EXIT_OK = 0
EXIT_INVALID = 1
"""A well-formed question whose answer is no (``check`` of an invalid layout)."""
EXIT_BAD_INPUT = 2
"""Bad input: unknown GPU or profile, malformed file, impossible request."""


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (exposed for tests and documentation)."""
    parser = argparse.ArgumentParser(
        prog="migpilot",
        description="Dynamic NVIDIA MIG partitioning for Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"migpilot {migpilot.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    mig_cmds.register(sub)
    config_cmd.register(sub)
    plan_cmd.register(sub)
    simulate_cmd.register(sub)
    agent_cmd.register(sub)
    fleet_cmd.register(sub)
    webhook_cmd.register(sub)
    controller_cmd.register(sub)
    mps_cmd.register(sub)
    status_cmd.register(sub)
    autoscaling_cmd.register(sub)
    return parser


def main(argv: Sequence[str] | None = None, *, out: IO[str] | None = None) -> int:
    """Run one command; returns the exit code instead of exiting (for tests)."""
    stdout = out if out is not None else sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args, stdout)
    except errors.MigpilotError as e:
        sys.stderr.write(f"migpilot: error: {e}\n")
        return EXIT_BAD_INPUT
    except yaml.YAMLError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        sys.stderr.write(f"migpilot: error: malformed YAML: {first}\n")
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        raise
    except OSError as e:
        sys.stderr.write(f"migpilot: error: {e.strerror or e}: {e.filename or ''}\n")
        return EXIT_BAD_INPUT
    return code


def entrypoint() -> None:
    """Console-script entry point."""
    try:
        sys.exit(main())
    except BrokenPipeError:  # `migpilot layouts ... | head`
        sys.exit(EXIT_OK)
    except KeyboardInterrupt:
        sys.exit(130)
