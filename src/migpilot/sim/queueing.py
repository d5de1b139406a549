"""A model of the order in which kube-scheduler retries pending pods: its scheduling queue's
backoff (v1.37).

Why it exists: when a departure frees room on a cluster where several pods wait, which of them
gets it decides how many are served. kube-scheduler does not retry the oldest first. Read in
``k8s.io/kubernetes@v1.37.2/pkg/scheduler/backend/queue``:

- a pod that fails a scheduling attempt goes back with its ``Timestamp`` refreshed to the time
  of that attempt and its ``UnschedulableCount`` raised (``AddUnschedulablePodIfNotPresent``);
- an event that may make it schedulable (for a DRA pod, a claim's deallocation or deletion:
  ``dynamicresources.preQueueingHint`` queues every pod) moves it to the activeQ when its
  backoff is over, else to the backoffQ (``requeueEntityWithQueueingStrategy``);
- its backoff lasts ``podInitialBackoffSeconds`` (1) doubled per failed attempt, at most
  ``podMaxBackoffSeconds`` (10) (``backoff_queue.calculateBackoffDuration``), from its
  ``Timestamp``, truncated to 1 s windows (``alignToWindow``); a pod is still backing off while
  that window is not before the current one (``isEntityBackingoff``);
- the activeQ pops by priority, then ``Timestamp`` (``PrioritySort``); with
  ``SchedulerPopFromBackoffQ`` (on by default) the backoffQ is popped when the activeQ is empty,
  by backoff expiry, then as the activeQ (``lessBackoffCompletedWithPriority``).

So after a departure the pods whose backoff is over go first, longest since their last attempt
first, then those backing off, soonest done first: a pod that failed fewer times (one that
came lately) goes before one that failed many times, though it came later. Where departures
come less than the backoff apart, this is not the order the pods came in.

Pure: frozen dataclasses and functions; times are the caller's (seconds), no clock.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from migpilot import errors


class QueueingError(errors.MigpilotError):
    """A backoff that kube-scheduler would refuse."""


@dataclass(frozen=True, slots=True)
class Backoff:
    """kube-scheduler's pod backoff, in the caller's seconds (a replay that compresses time
    divides them by its speed-up)."""

    initial_s: float = 1.0
    """``podInitialBackoffSeconds``; the default 1."""
    max_s: float = 10.0
    """``podMaxBackoffSeconds``; the default 10. 0 turns backoff off (every requeued pod goes
    to the activeQ: the oldest attempt first)."""
    window_s: float = 1.0
    """``backoffQOrderingWindowDuration``: backoff ends are truncated to windows this long."""

    def __post_init__(self) -> None:
        if self.max_s == 0:
            return
        if not 0 < self.initial_s <= self.max_s or self.window_s <= 0:
            raise QueueingError(
                f"backoff needs 0 < initial ({self.initial_s}) <= max ({self.max_s}) and a "
                f"window over 0 ({self.window_s}), or max 0 (off)"
            )

    def align(self, t: float) -> float:
        """``t`` truncated to its window."""
        return math.floor(t / self.window_s) * self.window_s

    def duration(self, attempts: int) -> float:
        """How long a pod backs off after ``attempts`` failed attempts."""
        if attempts <= 0 or self.max_s == 0:
            return 0.0
        return min(self.initial_s * 2.0 ** (attempts - 1), self.max_s)


KUBE_SCHEDULER = Backoff()
"""kube-scheduler's defaults: 1 s, doubling to 10 s, 1 s windows."""
NO_BACKOFF = Backoff(max_s=0.0)
"""Backoff off: pods are retried in the order of their last attempts."""


@dataclass(frozen=True, slots=True)
class Waiting:
    """A pending pod as the queue knows it."""

    key: int
    priority: int
    timestamp: float
    """When it was added, or when its last attempt failed."""
    seq: int
    """Breaks ties of ``timestamp`` (attempts in one round fail one after another)."""
    attempts: int
    """Failed attempts (``UnschedulableCount``)."""


def backing_off(pod: Waiting, *, now: float, backoff: Backoff) -> bool:
    """Whether ``pod`` still backs off at ``now`` (``isEntityBackingoff``)."""
    if pod.attempts == 0 or backoff.max_s == 0:
        return False
    return _expiry(pod, backoff) >= backoff.align(now)


def _expiry(pod: Waiting, backoff: Backoff) -> float:
    return backoff.align(pod.timestamp + backoff.duration(pod.attempts))


def retry_order(pods: Iterable[Waiting], *, now: float, backoff: Backoff) -> list[int]:
    """The keys of ``pods``, all requeued at ``now`` by one event, in the order kube-scheduler
    tries them: the activeQ (backoff over) by priority, then timestamp; then the backoffQ by
    backoff end, then as the activeQ."""
    ready: list[Waiting] = []
    waiting: list[Waiting] = []
    for pod in pods:
        (waiting if backing_off(pod, now=now, backoff=backoff) else ready).append(pod)
    ready.sort(key=lambda p: (-p.priority, p.timestamp, p.seq))
    waiting.sort(key=lambda p: (_expiry(p, backoff), -p.priority, p.timestamp, p.seq))
    return [p.key for p in (*ready, *waiting)]
