"""The controller against what a tenant (or a bug) can put in its way: quantities no int64 holds,
objects it cannot read, watches that fail, a Lease namespace that does not exist.

The rule under test: nothing one object does stops the others being served, a watch never dies
silently (``/healthz`` says so while it is down), and a setup error is said once.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from typing import Any

import pytest

from migpilot import errors
from migpilot.controller import kubeapi, observing, running, serving
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects
from tests.unit.test_controller_running import (
    _Clock,
    _node,
    _passes,
    _pod,
    _ready_node,
    _reserved,
    _run,
    _until,
)


def _plain_pod(name: str, namespace: str, **requests: str) -> dict[str, Any]:
    """A pod asking for no GPU, as any tenant creates them."""
    return {
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}"},
        "spec": {"containers": [{"name": "c", "resources": {"requests": requests}}]},
        "status": {"phase": "Pending"},
    }


def _warnings(api: kubeapi.InMemoryApi, name: str) -> list[kubeobjects.EventNote]:
    return [e for e in api.events if e.type == "Warning" and e.name == name]


@pytest.mark.parametrize(
    "requests",
    [
        {"memory": "1e1000000"},  # as a tenant writes it
        {"memory": "10e999999"},  # as kube-apiserver stores it
        {"memory": "1e200000"},
        {"cpu": "1e1000000"},
        {"nvidia.com/mig-1g.10gb": "1e5000"},
    ],
)
def test_a_pod_with_a_huge_quantity_is_warned_once_and_the_next_mig_pod_is_served(
    requests: dict[str, str],
) -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        bad = _plain_pod("hostile", "other", **requests)
        bad["spec"]["nodeName"] = "n0"  # bound there: its amounts would count on the node
        await api.put(kubeobjects.Kind.PODS, bad)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("the MIG pod reserved", lambda: "ns/p" in _reserved(api, "n0"))
        await _until("the warning", lambda: bool(_warnings(api, "hostile")))
        await api.put(kubeobjects.Kind.PODS, bad)  # the watch shows it again
        await _passes(controller)
        (warning,) = _warnings(api, "hostile")
        assert warning.reason == "MigpilotIgnoredPod"
        assert warning.message.startswith("migpilot ignores this pod: spec.containers[0].")
        assert "is too large" in warning.message
        assert controller.not_healthy() is None

    _run(body)


def test_a_gated_mig_pod_with_a_huge_memory_is_let_go_with_one_warning() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        pod = _pod("huge", "1g.10gb")
        pod["spec"]["containers"][0]["resources"]["requests"] = {"memory": "1e1000000"}
        await api.put(kubeobjects.Kind.PODS, pod)
        await _until(
            "the gate removed",
            lambda: "schedulingGates" not in api.objects[kubeobjects.Kind.PODS]["ns/huge"]["spec"],
        )
        await _passes(controller)
        (warning,) = _warnings(api, "huge")
        assert "migpilot ignores this pod: spec.containers[0].memory" in warning.message
        assert not _reserved(api, "n0")

    _run(body)


def test_a_node_with_a_huge_allocatable_is_warned_and_left_out_and_others_serve() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.NODES, _node("huge", cpu="1e1000000"))
        await _until("a warning on the node", lambda: bool(_warnings(api, "huge")))
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("the MIG pod reserved on n0", lambda: "ns/p" in _reserved(api, "n0"))
        await _passes(controller)
        (warning,) = _warnings(api, "huge")
        assert "migpilot ignores this node: status.allocatable.cpu" in warning.message
        assert "huge" not in {n.name for n in controller.observe().snapshot.nodes}

    _run(body)


def test_an_object_the_controller_cannot_read_is_logged_once_and_skipped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = observing.pod_view

    def buggy(doc: Any) -> observing.PodView:
        if doc["metadata"]["name"] == "boom":
            raise ValueError("a bug reading this pod")
        return real(doc)

    monkeypatch.setattr(observing, "pod_view", buggy)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        boom = _pod("boom", "1g.10gb")
        await api.put(kubeobjects.Kind.PODS, boom)
        await api.put(kubeobjects.Kind.PODS, boom)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("the next pod reserved", lambda: "ns/p" in _reserved(api, "n0"))
        assert "ns/boom" not in controller.observe().pods
        assert controller.not_healthy() is None

    with caplog.at_level(logging.WARNING, logger="migpilot.controller"):
        _run(body)
    skipped = [r for r in caplog.records if "ns/boom skipped" in r.getMessage()]
    assert len(skipped) == 1


class _Failing(kubeapi.InMemoryApi):
    """Lists of pods fail (with ``error``) until :attr:`healed`."""

    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error
        self.healed = False
        self.failed = 0

    async def list_all(self, kind: kubeobjects.Kind) -> kubeobjects.Listed:
        if kind is kubeobjects.Kind.PODS and not self.healed:
            self.failed += 1
            raise self.error
        return await super().list_all(kind)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("a bug in the watch"),
        kube_errors.KubeApiError(
            "429 TooManyRequests: storage is (re)initializing", transient=True
        ),
    ],
)
def test_a_failing_watch_fails_healthz_restarts_with_backoff_and_serves_again(
    error: Exception,
) -> None:
    api = _Failing(error)

    async def body(api_: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _until("several failures", lambda: api.failed >= 3)
        assert "watch of pods down" in (controller.not_healthy() or "")
        assert controller._backoff(0) < controller._backoff(3) == controller.settings.retry_max_s
        api.healed = True
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("the pod reserved", lambda: "ns/p" in _reserved(api, "n0"))
        assert controller.not_healthy() is None

    _run(body, api=api, retry_s=0.001, retry_max_s=0.008)


def test_a_leader_whose_watch_stays_down_lets_the_lease_lapse_and_leads_again_after() -> None:
    api = _Failing(kube_errors.KubeApiError("503: the API server is shutting down", transient=True))
    clock = _Clock(1000.0)

    async def body(api_: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _until("leading", lambda: controller.leading)
        await _until("a failure", lambda: api.failed >= 1)
        assert controller.cannot_serve() is None  # not yet: a blip is no reason to step down
        clock.now += controller.settings.lease_duration_s + 1
        await _until("stepped down", lambda: not controller.leading)
        assert "watch of pods down" in (controller.cannot_serve() or "")
        renewed = copy.deepcopy(api.leases)
        await _until("more failures", lambda: api.failed >= 5)
        assert api.leases == renewed  # the Lease is no longer renewed: it lapses
        api.healed = True
        await _until("leading again", lambda: controller.leading)

    _run(body, api=api, clock=clock, retry_s=0.001, retry_max_s=0.002, renew_every_s=0.01)


def test_a_task_that_ends_is_started_again() -> None:
    class Ending(running.Controller):
        ended = False

        async def _inform(self, kind: kubeobjects.Kind, stop: asyncio.Event) -> None:
            if kind is kubeobjects.Kind.PODS and not self.ended:
                self.ended = True
                raise RuntimeError("the task died")
            await super()._inform(kind, stop)

    async def main() -> None:
        api = kubeapi.InMemoryApi()
        settings = running.Settings(identity="c1", batch_window_s=0.0, resync_s=0.05)
        controller = Ending(api, settings=settings)
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        try:
            await _ready_node(api)
            await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
            await _until("the pod reserved", lambda: "ns/p" in _reserved(api, "n0"))
            assert controller.ended
            assert controller.not_healthy() is None
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)

    asyncio.run(main())


def _settings(**kw: Any) -> running.Settings:
    return running.Settings(identity="c1", retry_s=0.001, retry_max_s=0.002, **kw)


def test_a_missing_lease_namespace_is_one_clear_error() -> None:
    api = kubeapi.InMemoryApi()
    api.namespaces = {"kube-system"}
    with pytest.raises(errors.ConfigError, match="--lease-namespace") as exc:
        asyncio.run(serving._check_setup(api, _settings(), asyncio.Event()))
    assert "'migpilot-system' does not exist" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_the_setup_check_tries_transient_errors_again_and_passes() -> None:
    class Starting(kubeapi.InMemoryApi):
        answers = 0

        async def lease_namespace_exists(self, namespace: str, name: str) -> bool:
            self.answers += 1
            if self.answers < 3:
                raise kube_errors.KubeApiError("429 TooManyRequests: storage is (re)initializing",
                                           transient=True)  # fmt: skip
            return await super().lease_namespace_exists(namespace, name)

    api = Starting()
    api.namespaces = {"migpilot-system"}
    asyncio.run(serving._check_setup(api, _settings(), asyncio.Event()))
    assert api.answers == 3


def test_the_setup_check_does_not_retry_a_refusal() -> None:
    api = kubeapi.InMemoryApi()
    api.fail_next = kube_errors.KubeApiError("403 Forbidden: leases is forbidden")
    with pytest.raises(kube_errors.KubeApiError, match="403"):
        asyncio.run(serving._check_setup(api, _settings(), asyncio.Event()))
