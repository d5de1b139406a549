"""The ledger of devices this plugin handed out, until the kubelet shows them released.

Between the moment Allocate answers and the moment the kubelet's PodResources API lists the
device for a pod, nothing but this ledger knows the device is taken; a reconciler that looked
only at PodResources could destroy it (the race nos has). The rule: an allocated device is held
until PodResources has listed it and then stops listing it (the pod is gone), or, if
PodResources never lists it, for ``grace_s`` seconds (the container never started). Time is an
input (``now``, seconds on any monotonic clock); the ledger does no I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass


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

    def record(self, device_ids: Iterable[str], *, now: float) -> None:
        """Allocate handed these devices out at ``now`` (a re-allocation restarts the hold)."""
        with self._lock:
            for device_id in device_ids:
                self._entries[device_id] = _Entry(allocated_at=now)

    def observe_kubelet(self, allocated: Iterable[str], *, now: float) -> None:
        """The kubelet's PodResources lists ``allocated`` now: release what it stopped listing."""
        listed = frozenset(allocated)
        with self._lock:
            for device_id, entry in list(self._entries.items()):
                if device_id in listed:
                    entry.seen_by_kubelet = True
                elif entry.seen_by_kubelet or now - entry.allocated_at >= self._grace_s:
                    del self._entries[device_id]

    def forget(self, device_ids: Iterable[str]) -> None:
        """These devices no longer exist (destroyed): drop them."""
        with self._lock:
            for device_id in device_ids:
                self._entries.pop(device_id, None)

    def held(self, *, now: float) -> frozenset[str]:
        """Devices still held at ``now``."""
        with self._lock:
            return frozenset(
                device_id
                for device_id, entry in self._entries.items()
                if entry.seen_by_kubelet or now - entry.allocated_at < self._grace_s
            )
