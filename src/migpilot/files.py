"""Writing a file so that a reader, or the process after a crash, never sees half of it.

The agent's shells keep small state files (the emulated GPUs' state, the device plugin's ledger
of devices handed out, the labels file): each is replaced whole with :func:`write_atomically`.
A shell helper: only the gpu and agent layers use it; the pure core does no I/O.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(
    path: Path, text: str, *, durable: bool = False, mode: int | None = None
) -> None:
    """Replace ``path`` with ``text`` (a temporary file beside it, then a rename).

    With ``durable`` the data and the rename are flushed to disk (fsync of the file and its
    folder) before returning, so the new content survives a power loss too. ``mode``: the
    file's permission bits (default: the temporary file's, owner read and write only).
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        if mode is not None:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if not durable:
        return
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
