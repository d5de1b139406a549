"""Clocks for the shells: how long an operation takes and how long one waited, as an input.

The emulated GPU backend takes time for each driver operation and the reconciler measures how
long a reconfiguration took. Both get a :class:`Clock` by constructor, so tests run on a
:class:`VirtualClock` that never sleeps and a run is reproducible, while the agent uses the
:class:`SystemClock`. A shell module: it may import ``time``; the pure core never imports it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """A monotonic clock that can also wait."""

    def monotonic(self) -> float:
        """Seconds since an arbitrary fixed point; never goes backwards."""
        ...

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``time.sleep``."""

    def monotonic(self) -> float:
        """Seconds from the system's monotonic clock."""
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Block the calling thread for ``seconds``."""
        if seconds > 0:
            time.sleep(seconds)


class VirtualClock:
    """A clock that moves only when someone sleeps on it: tests and the simulator."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        """The virtual time now."""
        with self._lock:
            return self._now

    def sleep(self, seconds: float) -> None:
        """Advance virtual time by ``seconds`` at once."""
        if seconds < 0:
            raise ValueError(f"cannot sleep a negative time ({seconds} s)")
        with self._lock:
            self._now += seconds
