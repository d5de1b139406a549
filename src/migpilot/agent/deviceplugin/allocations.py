"""The ledger of devices this plugin handed out, until the kubelet shows them released.

Between the moment Allocate answers and the moment the kubelet's PodResources API lists the
device for a pod, nothing but this ledger knows the device is taken; a reconciler that looked
only at PodResources could destroy it (the race nos has). The rule: an allocated device is held
until PodResources has listed it and then stops listing it (the pod is gone), or, if
PodResources never lists it, for ``grace_s`` seconds (the container never started). Time is an
input (``now``, seconds on any monotonic clock); the ledger does no I/O.

So that an agent restart does not forget what it handed out, :meth:`AllocationLedger.dump` and
:meth:`AllocationLedger.load` turn the ledger into JSON-ready data and back (the device plugin
writes it to a file after every change). Ages are stored, not clock readings, and the time the
agent was down does not count: a reloaded hold lasts at least as long as it would have.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from migpilot import errors

FORMAT_VERSION = 1


@dataclass
class _Entry:
    allocated_at: float
    seen_by_kubelet: bool = False


class AllocationLedger:
    """Devices handed out by Allocate and not yet released. Thread-safe."""

    def __init__(self, *, grace_s: float = 300.0) -> None:
        self._grace_s = grace_s
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()

    def record(self, device_ids: Iterable[str], *, now: float) -> bool:
        """Allocate handed these devices out at ``now`` (a re-allocation restarts the hold).

        Returns whether the ledger changed (so is every mutator's result)."""
        changed = False
        with self._lock:
            for device_id in device_ids:
                self._entries[device_id] = _Entry(allocated_at=now)
                changed = True
        return changed

    def observe_kubelet(self, allocated: Iterable[str], *, now: float) -> bool:
        """The kubelet's PodResources lists ``allocated`` now: release what it stopped listing."""
        listed = frozenset(allocated)
        changed = False
        with self._lock:
            for device_id, entry in list(self._entries.items()):
                if device_id in listed:
                    changed = changed or not entry.seen_by_kubelet
                    entry.seen_by_kubelet = True
                elif entry.seen_by_kubelet or now - entry.allocated_at >= self._grace_s:
                    del self._entries[device_id]
                    changed = True
        return changed

    def forget(self, device_ids: Iterable[str]) -> bool:
        """These devices no longer exist (destroyed): drop them."""
        changed = False
        with self._lock:
            for device_id in device_ids:
                changed = self._entries.pop(device_id, None) is not None or changed
        return changed

    def dump(self, *, now: float) -> dict[str, Any]:
        """The ledger as JSON-ready data (ages at ``now``)."""
        with self._lock:
            return {
                "version": FORMAT_VERSION,
                "devices": {
                    device_id: {
                        "age_s": max(now - entry.allocated_at, 0.0),
                        "seen_by_kubelet": entry.seen_by_kubelet,
                    }
                    for device_id, entry in sorted(self._entries.items())
                },
            }

    def load(self, data: Any, *, now: float, source: str) -> None:
        """Add the entries of :meth:`dump`'s ``data`` (read back after a restart) as of ``now``.

        Raises :class:`~migpilot.errors.AgentConfigError` naming ``source`` and the entry when
        the data is not what :meth:`dump` writes.
        """
        if not isinstance(data, Mapping) or data.get("version") != FORMAT_VERSION:
            raise errors.AgentConfigError(
                f"{source}: not an allocation ledger of version {FORMAT_VERSION}"
            )
        found = data.get("devices")
        if not isinstance(found, Mapping):
            raise errors.AgentConfigError(f"{source}: 'devices' is not a mapping")
        entries: dict[str, _Entry] = {}
        for device_id, entry in found.items():
            age = entry.get("age_s") if isinstance(entry, Mapping) else None
            seen = entry.get("seen_by_kubelet") if isinstance(entry, Mapping) else None
            if (
                not isinstance(device_id, str)
                or isinstance(age, bool)
                or not isinstance(age, int | float)
                or not math.isfinite(age)
                or age < 0
                or not isinstance(seen, bool)
            ):
                raise errors.AgentConfigError(
                    f"{source}: device {device_id!r}: expected {{age_s: seconds >= 0, "
                    "seen_by_kubelet: true|false}"
                )
            entries[device_id] = _Entry(allocated_at=now - float(age), seen_by_kubelet=seen)
        with self._lock:
            self._entries.update(entries)

    def held(self, *, now: float) -> frozenset[str]:
        """Devices still held at ``now``."""
        with self._lock:
            return frozenset(
                device_id
                for device_id, entry in self._entries.items()
                if entry.seen_by_kubelet or now - entry.allocated_at < self._grace_s
            )
