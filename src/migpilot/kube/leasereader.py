"""The controller's Lease as the shells that follow it read it: at most every few seconds, and
the last one read kept when a read fails.

Why it exists: the webhook gates pods while the controller holds its Lease fresh, and an agent
on a DRA node lists the controller's plan first while it does (``docs/webhook.md``, "The Lease
rule"; ``docs/dra.md``, "Steering"). Both judge the Lease by one rule
(:func:`migpilot.api.leases.fresh`) and must read it the same way: one read per few seconds
whatever the rate of calls, a Lease not there is not fresh at once, and a read that fails keeps
the last Lease read, judged by its own renew time (so a passing API error neither flips the
rule at once nor keeps it forever). They once had a reader each, which differed on what a
failed read meant; :class:`LeaseReader` is the one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from migpilot.api import leases
from migpilot.kube import errors

_log = logging.getLogger(__name__)


class LeaseReader:
    """The Lease ``read`` gives (``None``, or :class:`~migpilot.kube.errors.NotFoundError`:
    there is none), read at most every ``cache_s`` seconds of ``clock`` (seconds since the Unix
    epoch; a clock that went back reads again). Any other failure of ``read`` keeps the last
    Lease read, logged once per run of failures. Thread-safe."""

    def __init__(
        self,
        read: Callable[[], Mapping[str, Any] | None],
        *,
        cache_s: float,
        clock: Callable[[], float] = time.time,
        what: str = "the controller's Lease",
    ) -> None:
        if not cache_s >= 0:
            raise ValueError(f"the Lease's cache time must be 0 seconds or more, got {cache_s}")
        self._read = read
        self._cache_s = cache_s
        self._clock = clock
        self._what = what
        self._lock = threading.Lock()
        self._lease: Mapping[str, Any] | None = None
        self._read_at: float | None = None
        self._failing = False

    def current(self) -> tuple[Mapping[str, Any] | None, float]:
        """The Lease (``None``: there is none, or none was read yet) and the clock's now."""
        with self._lock:
            now = self._clock()
            if self._read_at is None or not 0 <= now - self._read_at < self._cache_s:
                self._lease = self._fetch()
                self._read_at = now
            return self._lease, now

    def fresh(self) -> bool:
        """Whether some holder keeps the Lease fresh now (:func:`leases.fresh`)."""
        lease, now = self.current()
        return lease is not None and leases.fresh(lease, now)

    def _fetch(self) -> Mapping[str, Any] | None:
        try:
            lease = self._read()
        except errors.NotFoundError:
            lease = None
        except Exception as err:  # anything else: the last one read, judged by its own times
            if not self._failing:
                _log.warning(
                    "cannot read %s (%s): %s",
                    self._what,
                    err,
                    "none was read yet"
                    if self._lease is None
                    else "the last one read is judged by its renew time until a read succeeds",
                )
            self._failing = True
            return self._lease
        if self._failing:
            _log.info("%s is read again", self._what)
        self._failing = False
        return lease
