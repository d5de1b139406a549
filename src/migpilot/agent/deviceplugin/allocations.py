"""The ledger of devices this plugin handed out, until the kubelet shows them released.

Between the moment Allocate answers and the moment the kubelet's PodResources API lists the
device for a pod, nothing but this ledger knows the device is taken; a reconciler that looked
only at PodResources could destroy it (the race nos has). The rule: an allocated device is held
until PodResources has listed it and then stops listing it (the pod is gone), or, if
PodResources never lists it, for ``grace_s`` seconds (the container never started). Time is an
input (``now``, seconds on any monotonic clock); the ledger does no I/O.

It also keeps, per pod, what Allocate of ``nvidia.com/gpu`` handed to each of its containers
(:class:`~resolving.PodAllocation`, ``docs/unified.md``): the MIG instances of a unified pod
are held for as long as the pod lives, whatever the kubelet lists, and an entry is dropped only
when the agent has seen the pod gone (:meth:`AllocationLedger.release_pods`). These entries
also tell Allocate which pods are already allocated.

So that an agent restart does not forget what it handed out, :meth:`AllocationLedger.dump` and
:meth:`AllocationLedger.load` turn the ledger into JSON-ready data and back (the device plugin
writes it to a file after every change). Ages are stored, not clock readings, and the time the
agent was down does not count: a reloaded hold lasts at least as long as it would have. The pod
entries are an optional ``pods`` key of the same version-1 document, so an older agent reading a
newer file keeps its device holds.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.agent.deviceplugin import resolving

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
        self._pods: dict[str, resolving.PodAllocation] = {}
        self._pods_version = 0
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

    def record_container(
        self, pod: str, *, uid: str, unified: bool, container: str, device_ids: tuple[str, ...]
    ) -> bool:
        """Allocate handed ``device_ids`` to ``container`` of ``pod`` (``namespace/name``); an
        entry of an older pod of that name (another ``uid``) is replaced."""
        with self._lock:
            old = self._pods.get(pod)
            if old is None or old.uid != uid or old.unified != unified:
                old = resolving.PodAllocation(uid, unified)
            new = old.adding(container, device_ids)
            if self._pods.get(pod) == new:
                return False
            self._pods[pod] = new
            self._pods_version += 1
            return True

    def pods(self) -> dict[str, resolving.PodAllocation]:
        """``namespace/name`` -> what its containers got."""
        with self._lock:
            return dict(self._pods)

    @property
    def pods_version(self) -> int:
        """A number that changes whenever :meth:`pods` does."""
        with self._lock:
            return self._pods_version

    def release_pods(self, pods: Iterable[str]) -> bool:
        """These pods are gone: their devices are free."""
        changed = False
        with self._lock:
            for pod in pods:
                if self._pods.pop(pod, None) is not None:
                    changed = True
            if changed:
                self._pods_version += 1
        return changed

    def dump(self, *, now: float) -> dict[str, Any]:
        """The ledger as JSON-ready data (ages at ``now``)."""
        with self._lock:
            data: dict[str, Any] = {
                "version": FORMAT_VERSION,
                "devices": {
                    device_id: {
                        "age_s": max(now - entry.allocated_at, 0.0),
                        "seen_by_kubelet": entry.seen_by_kubelet,
                    }
                    for device_id, entry in sorted(self._entries.items())
                },
            }
            if self._pods:
                data["pods"] = {
                    pod: {
                        "uid": a.uid,
                        "unified": a.unified,
                        "containers": [[name, list(ids)] for name, ids in a.containers],
                    }
                    for pod, a in sorted(self._pods.items())
                }
            return data

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
        pods = _load_pods(data.get("pods"), source)
        with self._lock:
            self._entries.update(entries)
            if pods:
                self._pods.update(pods)
                self._pods_version += 1

    def held(self, *, now: float) -> frozenset[str]:
        """Devices still held at ``now``."""
        with self._lock:
            return frozenset(
                device_id
                for device_id, entry in self._entries.items()
                if entry.seen_by_kubelet or now - entry.allocated_at < self._grace_s
            )


def _load_pods(found: Any, source: str) -> dict[str, resolving.PodAllocation]:
    """The ``pods`` of :meth:`AllocationLedger.dump`; a malformed entry is an error naming it."""
    if found is None:
        return {}
    if not isinstance(found, Mapping):
        raise errors.AgentConfigError(f"{source}: 'pods' is not a mapping")
    out: dict[str, resolving.PodAllocation] = {}
    for pod, entry in found.items():
        shape = (
            f"{source}: pod {pod!r}: expected {{uid: text, unified: true|false, "
            "containers: [[name, [device, ...]], ...]}"
        )
        if not isinstance(pod, str) or not isinstance(entry, Mapping):
            raise errors.AgentConfigError(shape)
        uid, unified, containers = entry.get("uid"), entry.get("unified"), entry.get("containers")
        if not isinstance(uid, str) or not isinstance(unified, bool):
            raise errors.AgentConfigError(shape)
        if not isinstance(containers, list):
            raise errors.AgentConfigError(shape)
        parsed: list[tuple[str, tuple[str, ...]]] = []
        for item in containers:
            if (
                not isinstance(item, list)
                or len(item) != 2
                or not isinstance(item[0], str)
                or not isinstance(item[1], list)
                or not all(isinstance(i, str) for i in item[1])
            ):
                raise errors.AgentConfigError(shape)
            parsed.append((item[0], tuple(item[1])))
        out[pod] = resolving.PodAllocation(uid, unified, tuple(parsed))
    return out
