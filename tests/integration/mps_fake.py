"""A fake ``nvidia-cuda-mps-control``: a real executable, so ProcessMps is tested for real.

:func:`install` writes :data:`SCRIPT` (a Python program) as ``nvidia-cuda-mps-control`` into a
folder for the test to put on PATH. Like NVIDIA's binary, ``-d`` daemonizes (two forks, a new
session, standard streams closed) and the parent returns at once; the daemon binds the
``control`` unix socket and writes ``nvidia-cuda-mps-control.pid`` in
``CUDA_MPS_PIPE_DIRECTORY`` and logs to ``control.log`` in ``CUDA_MPS_LOG_DIRECTORY`` (its
``CUDA_VISIBLE_DEVICES`` and every command). Without arguments it relays its standard input to
the daemon and prints the answer, exiting 1 with a message when no daemon answers. It answers
``get_server_list``, ``start_server -uid N`` (a made-up server pid, so the list can be
non-empty), ``set_default_active_thread_percentage``, ``set_default_device_pinned_mem_limit``
(rejecting a device index beyond ``CUDA_VISIBLE_DEVICES``), their ``get_`` forms and ``quit``.

Knobs for tests, read from its environment: ``FAKE_MPS_FAIL_START`` (``-d`` fails with that
message), ``FAKE_MPS_STARTUP_S`` (the daemon writes its pid file and socket that much later),
``FAKE_MPS_IGNORE_QUIT`` (``quit`` is answered but the daemon stays).

:func:`kill_daemons` kills, by the pid in each pid file, the fake daemons a test started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections.abc import Iterable
from pathlib import Path

SCRIPT = r"""
import json
import os
import re
import socket
import sys
import time

PIPE = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
LOGDIR = os.environ.get("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
PIDFILE = os.path.join(PIPE, "nvidia-cuda-mps-control.pid")
SOCK = os.path.join(PIPE, "control")
VISIBLE = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d]


def log(message):
    with open(os.path.join(LOGDIR, "control.log"), "a", encoding="utf-8") as f:
        f.write(message + "\n")


def running_pid():
    try:
        pid = int(open(PIDFILE, encoding="utf-8").read().strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def answer(state, line):
    words = line.split()
    if not words:
        return "", "", 0
    cmd, args = words[0], words[1:]
    if cmd == "get_server_list":
        return "".join(f"{pid}\n" for pid in state["servers"]), "", 0
    if cmd == "start_server" and args[:1] == ["-uid"]:
        state["servers"].append(os.getpid() + 1 + len(state["servers"]))
        return "", "", 0
    if cmd == "set_default_active_thread_percentage" and len(args) == 1:
        if not args[0].isdigit() or not 1 <= int(args[0]) <= 100:
            return "", f"invalid active thread percentage {args[0]}", 1
        state["atp"] = int(args[0])
        return "", "", 0
    if cmd == "get_default_active_thread_percentage":
        return f"{float(state['atp']):.1f}\n", "", 0
    if cmd == "set_default_device_pinned_mem_limit" and len(args) == 2:
        devices = len(VISIBLE) or 1
        if not args[0].isdigit() or int(args[0]) >= devices:
            return "", f"invalid device {args[0]}", 1
        if not re.fullmatch(r"\d+[KMGT]B?", args[1]):
            return "", f"invalid memory limit {args[1]}", 1
        state["pinned"][args[0]] = args[1]
        return "", "", 0
    if cmd == "get_default_device_pinned_mem_limit" and len(args) == 1:
        return state["pinned"].get(args[0], "0") + "\n", "", 0
    if cmd == "quit":
        state["quit"] = True
        return "", "", 0
    return "", f"unknown command {line!r}", 1


def serve(server):
    state = {"servers": [], "atp": 100, "pinned": {}, "quit": False}
    while not state["quit"] or os.environ.get("FAKE_MPS_IGNORE_QUIT"):
        conn, _ = server.accept()
        with conn:
            data = b""
            while chunk := conn.recv(4096):
                data += chunk
            out, err, rc = "", "", 0
            for line in data.decode().splitlines():
                log(f"command {line}")
                o, e, r = answer(state, line)
                out, err, rc = out + o, err + e, max(rc, r)
            conn.sendall(json.dumps({"out": out, "err": err, "rc": rc}).encode())
    log("quit")
    os.unlink(PIDFILE)
    os.unlink(SOCK)


def daemon():
    if os.environ.get("FAKE_MPS_FAIL_START"):
        print(os.environ["FAKE_MPS_FAIL_START"], file=sys.stderr)
        sys.exit(1)
    if running_pid() is not None:
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    if not os.path.isdir(PIPE) or not os.path.isdir(LOGDIR):
        print(f"cannot open {PIPE} or {LOGDIR}", file=sys.stderr)
        sys.exit(1)
    if os.fork() > 0:
        os._exit(0)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    time.sleep(float(os.environ.get("FAKE_MPS_STARTUP_S", "0")))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(SOCK)
    server.listen(8)
    with open(PIDFILE, "w", encoding="utf-8") as f:
        f.write(f"{os.getpid()}\n")
    log(f"startup pid={os.getpid()} CUDA_VISIBLE_DEVICES={','.join(VISIBLE)}")
    serve(server)


def client():
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(SOCK)
    except OSError:
        print("Cannot find MPS control daemon process", file=sys.stderr)
        sys.exit(1)
    conn.sendall(sys.stdin.read().encode())
    conn.shutdown(socket.SHUT_WR)
    data = b""
    while chunk := conn.recv(4096):
        data += chunk
    reply = json.loads(data.decode())
    sys.stdout.write(reply["out"])
    sys.stderr.write(reply["err"])
    sys.exit(reply["rc"])


if sys.argv[1:] == ["-d"]:
    daemon()
elif sys.argv[1:] == []:
    client()
else:
    print(f"usage: {sys.argv[0]} [-d]", file=sys.stderr)
    sys.exit(2)
"""


def install(folder: Path) -> Path:
    """Write the fake as ``folder/nvidia-cuda-mps-control``, executable; its path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "nvidia-cuda-mps-control"
    path.write_text(f"#!{sys.executable}\n{SCRIPT}", encoding="utf-8")
    path.chmod(0o755)
    return path


def kill_daemons(pipe_dirs: Iterable[Path]) -> None:
    """Kill the fake daemon of each pipe folder still running (by the pid in its pid file,
    when that process is the fake)."""
    for pipe_dir in pipe_dirs:
        with contextlib.suppress(OSError, ValueError):
            pid = int((pipe_dir / "nvidia-cuda-mps-control.pid").read_text().strip())
            # Only our fake: a stale pid file may name a pid the system has reused since.
            if b"nvidia-cuda-mps-control" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
