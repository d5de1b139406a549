"""The model of kube-scheduler's retry order (v1.37 ``pkg/scheduler/backend/queue``): backoff
durations, the 1 s ordering windows, and the activeQ before the backoffQ."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.sim import queueing

DEFAULT = queueing.Backoff()


@pytest.mark.parametrize(
    ("attempts", "seconds"),
    [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (5, 10.0), (9, 10.0)],
)
def test_backoff_doubles_from_one_second_up_to_ten(attempts: int, seconds: float) -> None:
    # backoff_queue.go calculateBackoffDuration: initial << (count-1), at most the maximum.
    assert DEFAULT.duration(attempts) == seconds


def test_a_pod_backs_off_until_the_window_after_its_backoff_ends() -> None:
    # Failed once at 0.5 s: backoff ends at 1.5 s, truncated to the window [1, 2); it backs off
    # while that window is not before now's (isEntityBackingoff: !boTime.Before(align(now))).
    pod = queueing.Waiting(key=1, priority=0, timestamp=0.5, seq=0, attempts=1)
    assert queueing.backing_off(pod, now=0.9, backoff=DEFAULT)
    assert queueing.backing_off(pod, now=1.99, backoff=DEFAULT)
    assert not queueing.backing_off(pod, now=2.0, backoff=DEFAULT)
    # A pod never attempted has no backoff, nor any pod with backoff off.
    fresh = queueing.Waiting(key=2, priority=0, timestamp=0.5, seq=0, attempts=0)
    assert not queueing.backing_off(fresh, now=0.5, backoff=DEFAULT)
    assert not queueing.backing_off(pod, now=0.6, backoff=queueing.NO_BACKOFF)


def test_a_pod_that_failed_less_goes_before_one_that_failed_more_though_it_came_later() -> None:
    # Both backing off at 20 s: the backoffQ pops by backoff end (late's 20 s window before
    # old's 28 s), not by arrival.
    old = queueing.Waiting(key=1, priority=0, timestamp=18.0, seq=5, attempts=5)
    late = queueing.Waiting(key=2, priority=0, timestamp=19.5, seq=9, attempts=1)
    assert queueing.retry_order([old, late], now=20.0, backoff=DEFAULT) == [2, 1]
    # Without backoff they go in the order of their last attempts.
    assert queueing.retry_order([old, late], now=20.0, backoff=queueing.NO_BACKOFF) == [1, 2]


def test_pods_done_backing_off_go_first_by_priority_then_last_attempt() -> None:
    ready_late = queueing.Waiting(key=1, priority=0, timestamp=5.0, seq=1, attempts=1)
    ready_early = queueing.Waiting(key=2, priority=0, timestamp=3.0, seq=2, attempts=1)
    ready_high = queueing.Waiting(key=3, priority=10, timestamp=6.0, seq=3, attempts=1)
    backing = queueing.Waiting(key=4, priority=100, timestamp=9.5, seq=4, attempts=1)
    order = queueing.retry_order(
        [ready_late, backing, ready_early, ready_high], now=10.0, backoff=DEFAULT
    )
    assert order == [3, 2, 1, 4]


@given(
    st.lists(
        st.tuples(st.integers(0, 3), st.floats(0, 100, allow_nan=False), st.integers(0, 12)),
        max_size=12,
    ),
    st.floats(0, 120, allow_nan=False),
)
def test_the_order_holds_every_pod_once(rows: list[tuple[int, float, int]], now: float) -> None:
    pods = [
        queueing.Waiting(key=i, priority=p, timestamp=t, seq=i, attempts=a)
        for i, (p, t, a) in enumerate(rows)
    ]
    order = queueing.retry_order(pods, now=now, backoff=DEFAULT)
    assert sorted(order) == list(range(len(pods)))
    # every pod done backing off comes before every pod still backing off
    flags = [queueing.backing_off(pods[k], now=now, backoff=DEFAULT) for k in order]
    assert flags == sorted(flags)


@pytest.mark.parametrize(
    ("initial", "most", "window"), [(0.0, 10.0, 1.0), (2.0, 1.0, 1.0), (1.0, 10.0, 0.0)]
)
def test_a_backoff_kube_scheduler_refuses_is_refused(
    initial: float, most: float, window: float
) -> None:
    with pytest.raises(queueing.QueueingError):
        queueing.Backoff(initial, most, window)
