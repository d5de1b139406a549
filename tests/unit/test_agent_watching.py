"""The agent's watches against hostile input and a failing API server: a bad object is skipped
and logged once, a failure restarts the watch with backoff while ``/healthz`` says it is down,
and the first reads wait out transient errors (429 just after the CRD is created)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from migpilot import probes
from migpilot.agent.cluster import boundpods, kubeapi, watching
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects

NODE = "gpu-node-1"
WAIT_S = 10.0


def _wait(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.005)


def _pod(name: str, **limits: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "c", "resources": {"limits": limits}}],
        },
        "status": {"phase": "Running"},
    }


def _follow_pods(
    api: kubeapi.NodeApi, book: boundpods.PodBook, stop: threading.Event, health: probes.Watches
) -> threading.Thread:
    thread = threading.Thread(
        target=watching.follow,
        kwargs={
            "what": f"pods on {NODE}",
            "lister": lambda: api.list_pods(node=NODE),
            "watcher": lambda v: api.watch_pods(node=NODE, resource_version=v),
            "listed": book.listed,
            "changed": book.changed,
            "stop": stop,
            "retry_s": 0.001,
            "retry_max_s": 0.004,
            "health": health,
        },
        daemon=True,
    )
    thread.start()
    return thread


def test_a_pod_with_a_huge_quantity_is_skipped_once_and_the_pod_watch_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    api = kubeapi.InMemoryNodeApi()
    book = boundpods.PodBook()
    health = probes.Watches(time.monotonic)
    stop = threading.Event()
    with caplog.at_level(logging.WARNING):
        thread = _follow_pods(api, book, stop, health)
        try:
            api.put_pod(_pod("hostile", **{"nvidia.com/foo": "10e999999"}))
            api.put_pod(_pod("hostile", **{"nvidia.com/foo": "10e999999", "cpu": "1"}))
            api.put_pod(_pod("good", **{"nvidia.com/mig-1g.10gb": "1"}))
            _wait(lambda: [p.name for p in book.pods(NODE)] == ["good"])
            assert thread.is_alive()
            assert health.check() is None
        finally:
            stop.set()
            api.close()
    said = [r for r in caplog.records if "hostile" in r.getMessage()]
    assert len(said) == 1
    assert "is too large" in said[0].getMessage()


class _Broken(kubeapi.InMemoryNodeApi):
    """Lists of pods fail with :attr:`error` until it is ``None``."""

    def __init__(self, error: Exception | None) -> None:
        super().__init__()
        self.error = error
        self.failed = 0

    def list_pods(self, *, node: str | None) -> kubeobjects.Listed:
        if self.error is not None:
            self.failed += 1
            raise self.error
        return super().list_pods(node=node)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("a bug in the watch"),
        kube_errors.KubeApiError(
            "429 TooManyRequests: storage is (re)initializing", transient=True
        ),
    ],
)
def test_a_failing_pod_watch_is_down_in_healthz_and_restarts(error: Exception) -> None:
    api = _Broken(error)
    book = boundpods.PodBook()
    health = probes.Watches(time.monotonic)
    stop = threading.Event()
    thread = _follow_pods(api, book, stop, health)
    try:
        _wait(lambda: api.failed >= 3)
        assert f"watch of pods on {NODE} down" in (health.check() or "")
        api.error = None
        api.put_pod(_pod("good", **{"nvidia.com/mig-1g.10gb": "1"}))
        _wait(lambda: [p.name for p in book.pods(NODE)] == ["good"])
        _wait(lambda: health.check() is None)
        assert thread.is_alive()
    finally:
        stop.set()
        api.close()


def test_a_callback_that_raises_skips_that_object_only() -> None:
    taken: list[str] = []

    def changed(event: kubeobjects.WatchEvent) -> None:
        name = event.object["metadata"]["name"]
        if name == "boom":
            raise ValueError("a bug")
        taken.append(name)

    def events(version: str) -> Iterator[kubeobjects.WatchEvent]:
        for name in ("a", "boom", "b"):
            yield kubeobjects.WatchEvent(kubeobjects.EventType.ADDED, {"metadata": {"name": name}})
        stop.set()

    stop = threading.Event()
    watching.follow(
        what="things",
        lister=lambda: kubeobjects.Listed((), "1"),
        watcher=events,
        listed=lambda docs: None,
        changed=changed,
        stop=stop,
    )
    assert taken == ["a", "b"]


def test_backoff_doubles_up_to_its_cap() -> None:
    waits = [watching.backoff(n, first_s=1.0, most_s=30.0) for n in range(7)]
    assert waits == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert watching.backoff(10**6, first_s=1.0, most_s=30.0) == 30.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_the_first_read_waits_out_429_right_after_the_crd_is_created() -> None:
    clock = _Clock()
    answers = iter(
        [
            kube_errors.KubeApiError(
                "429 TooManyRequests: storage is (re)initializing", transient=True
            ),
            kube_errors.KubeApiError("503 ServiceUnavailable", transient=True),
            kube_errors.KubeApiError("the API server cannot be reached: refused", transient=True),
        ]
    )

    def call() -> str:
        for err in answers:
            raise err
        return "listed"

    got = watching.retrying(call, what="GpuLayout n", retry_s=1.0, clock=clock, sleep=clock.sleep)
    assert got == "listed"
    assert clock.slept == [1.0, 2.0, 4.0]


def test_the_first_read_gives_up_on_a_refusal_at_once_and_on_transients_after_its_patience() -> (
    None
):
    clock = _Clock()

    def forbidden() -> None:
        raise kube_errors.KubeApiError("403 Forbidden")

    with pytest.raises(kube_errors.KubeApiError, match="403"):
        watching.retrying(forbidden, what="x", clock=clock, sleep=clock.sleep)
    assert clock.slept == []

    def busy() -> None:
        raise kube_errors.KubeApiError("429 TooManyRequests", transient=True)

    with pytest.raises(kube_errors.KubeApiError, match="429"):
        watching.retrying(busy, what="x", patience_s=60.0, clock=clock, sleep=clock.sleep)
    assert sum(clock.slept) <= 60.0 and len(clock.slept) >= 3
