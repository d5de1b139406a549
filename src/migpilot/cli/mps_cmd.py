"""``migpilot mps check``: start an MPS control daemon, ask it ``get_server_list``, stop it.

What an operator (or the team, when a GPU machine is lent) runs on a node to see that NVIDIA's
``nvidia-cuda-mps-control`` works there as the agent will run it: the same supervisor starts the
daemon with its pipe and log directories, sends the defaults given, waits for its answer and
stops it. It needs no CUDA client and changes neither MIG mode nor compute mode. Thin: flags
become a :class:`~migpilot.gpu.mps.MpsDaemonSpec`, then :func:`migpilot.agent.sharing.mps.check`.
Exit 0 when the daemon answered; 2 with one line otherwise (the binary missing, a start that
fails, no answer).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path
from typing import IO

from migpilot.agent.sharing import mps as supervising
from migpilot.gpu import clocks, mps


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``mps`` (with ``check``) to the top-level subparsers."""
    group = subparsers.add_parser("mps", help="NVIDIA MPS control daemons (docs/mps.md)")
    sub = group.add_subparsers(dest="mps_command", metavar="COMMAND", required=True)
    p = sub.add_parser(
        "check",
        help="start an MPS control daemon, ask get_server_list, stop it",
        description=(
            "Start nvidia-cuda-mps-control -d as the agent does, wait until it answers "
            "get_server_list, print what it saw and stop it. Without --pipe-dir/--log-dir it "
            "uses fresh temporary folders, removed afterwards."
        ),
    )
    p.add_argument("--pipe-dir", type=Path, metavar="DIR", help="CUDA_MPS_PIPE_DIRECTORY")
    p.add_argument("--log-dir", type=Path, metavar="DIR", help="CUDA_MPS_LOG_DIRECTORY")
    p.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="UUID",
        help="a GPU (or MIG device) UUID for CUDA_VISIBLE_DEVICES, repeatable (default: all)",
    )
    p.add_argument(
        "--active-thread-percentage",
        type=int,
        metavar="N",
        help="send set_default_active_thread_percentage N (1-100)",
    )
    p.add_argument(
        "--pinned-mem-limit-mib",
        type=int,
        metavar="MIB",
        help="send set_default_device_pinned_mem_limit for each --device",
    )
    p.add_argument(
        "--binary",
        default=mps.CONTROL_BINARY,
        metavar="PATH",
        help=f"the control program (default: {mps.CONTROL_BINARY} on PATH)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for the daemon to start and to answer each command (default: 30)",
    )
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace, out: IO[str]) -> int:
    if args.timeout <= 0:
        raise mps.MpsError(f"--timeout {args.timeout:g} is not a positive number of seconds")
    if (args.pipe_dir is None) != (args.log_dir is None):
        raise mps.MpsError("give both --pipe-dir and --log-dir, or neither")
    scratch = None
    if args.pipe_dir is None:
        scratch = Path(tempfile.mkdtemp(prefix="migpilot-mps-"))
        args.pipe_dir, args.log_dir = scratch / "pipe", scratch / "log"
    try:
        spec = mps.MpsDaemonSpec(
            name="check",
            devices=tuple(args.device),
            pipe_dir=args.pipe_dir.absolute(),
            log_dir=args.log_dir.absolute(),
            active_thread_percentage=args.active_thread_percentage,
            pinned_mem_limit_mib=args.pinned_mem_limit_mib,
        )
        clock = clocks.SystemClock()
        control = mps.ProcessMps(binary=args.binary, clock=clock, timeout_s=args.timeout)
        binary = control.executable()
        result = supervising.check(control, spec, clock=clock, timeout_s=args.timeout)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    servers = " ".join(map(str, result.servers)) or "none (a server starts with the first client)"
    out.write(f"binary:          {binary}\n")
    out.write(f"devices:         {','.join(spec.devices) or 'all (CUDA_VISIBLE_DEVICES unset)'}\n")
    out.write(f"pipe dir:        {spec.pipe_dir} ({', '.join(result.pipe_files) or 'empty'})\n")
    out.write(f"log dir:         {spec.log_dir}\n")
    out.write(
        f"daemon:          pid {result.pid}, answered after {result.answered_after_s:.2f} s\n"
    )
    out.write(f"get_server_list: {servers}\n")
    for command in result.defaults:
        out.write(f"sent:            {command}\n")
    if result.log_tail:
        out.write("control.log:\n")
        out.writelines(f"  {line}\n" for line in result.log_tail)
    out.write("stopped:         the daemon quit\n")
    return 0
