"""The controller's loop against the in-memory API: reserve, pin, release, refuse, lead.

The test plays the agent (it writes GpuLayout status and the Node's allocatable) and
kube-scheduler (it binds pods); the controller runs its real loop (``Controller.run``) on
``kubeapi.InMemoryApi``.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable, Callable
from typing import Any

from migpilot.api import gpulayouts as gl
from migpilot.api import leases
from migpilot.controller import kubeapi, observing, running

A100 = "NVIDIA A100-SXM4-80GB"
WAIT_S = 10.0


def _node(name: str, **allocatable: str) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/mig.capable": "true"},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {"cpu": "32", "memory": "256Gi", **allocatable},
        },
    }


def _pod(name: str, profile: str, *, gated: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"limits": {f"nvidia.com/mig-{profile}": "1"}}}]
    }
    if gated:
        spec["schedulingGates"] = [{"name": observing.GATE}]
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def _status(instances: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "observedGeneration": 1,
        "gpus": [{"index": 0, "model": A100, "uuid": "GPU-0", "instances": instances}],
    }


async def _until(what: str, check: Callable[[], bool]) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def _run(
    body: Callable[[kubeapi.InMemoryApi, running.Controller], Awaitable[None]], **kw: Any
) -> None:
    async def main() -> None:
        api = kubeapi.InMemoryApi()
        settings = running.Settings(identity="c1", batch_window_s=0.0, resync_s=0.05, **kw)
        controller = running.Controller(api, settings=settings)
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        try:
            await body(api, controller)
        finally:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(main())


async def _agent_reports(
    api: kubeapi.InMemoryApi, node: str, instances: list[dict[str, Any]]
) -> None:
    """Write the GpuLayout's status as the agent would (keeping the controller's spec)."""
    doc = copy.deepcopy(api.objects[kubeapi.Kind.LAYOUTS][node])
    doc["status"] = _status(instances)
    await api.put(kubeapi.Kind.LAYOUTS, doc)


def _ungated(api: kubeapi.InMemoryApi, key: str) -> bool:
    return "schedulingGates" not in api.objects[kubeapi.Kind.PODS][key]["spec"]


def _layout(api: kubeapi.InMemoryApi, node: str) -> gl.GpuLayout:
    return gl.parse(api.objects[kubeapi.Kind.LAYOUTS][node])


def _reserved(api: kubeapi.InMemoryApi, node: str) -> dict[str, tuple[int, int, str]]:
    return {
        i.reserved_for: (g.index, i.start, i.profile)
        for g in _layout(api, node).spec.gpus
        for i in g.instances
        if i.reserved_for
    }


def test_a_gated_pod_is_reserved_pinned_once_and_released_when_bound() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeapi.Kind.NODES, _node("n0"))
        # The controller makes the node's GpuLayout; the agent reports empty GPUs.
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeapi.Kind.LAYOUTS])
        await _agent_reports(api, "n0", [])
        await api.put(kubeapi.Kind.PODS, _pod("p", "3g.40gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        assert profile == "3g.40gb"
        assert not api.pod_patches, "pinned before the instance exists"
        # The agent made it and the Node advertises it: the pod is pinned, once.
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await api.put(kubeapi.Kind.NODES, _node("n0", **{"nvidia.com/mig-3g.40gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        pod = api.objects[kubeapi.Kind.PODS]["ns/p"]
        assert "schedulingGates" not in pod["spec"]
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert terms == [
            {
                "matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n0"]}
                ]
            }
        ]
        # kube-scheduler binds it: the reservation goes, the pin is not repeated.
        bound = copy.deepcopy(pod)
        bound["spec"]["nodeName"] = "n0"
        await api.put(kubeapi.Kind.PODS, bound)
        await _until("the release", lambda: not _reserved(api, "n0"))
        assert len(api.pod_patches) == 1
        reasons = [e.reason for e in api.events]
        assert "MigInstancesReserved" in reasons and "MigReconfiguring" in reasons

    _run(body)


def test_a_bad_request_gets_a_warning_and_is_let_go() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeapi.Kind.NODES, _node("n0"))
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeapi.Kind.LAYOUTS])
        await _agent_reports(api, "n0", [])
        await api.put(kubeapi.Kind.PODS, _pod("bad", "1c.3g.40gb"))
        await _until(
            "the gate removed",
            lambda: "schedulingGates" not in api.objects[kubeapi.Kind.PODS]["ns/bad"]["spec"],
        )
        (warning,) = [e for e in api.events if e.type == "Warning"]
        assert warning.reason == "MigRequestUnservable"
        assert "compute-instance profile" in warning.message

    _run(body)


def test_a_pod_no_gpu_could_ever_hold_is_let_go_with_the_reason() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeapi.Kind.NODES, _node("n0"))
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeapi.Kind.LAYOUTS])
        await _agent_reports(api, "n0", [])
        await api.put(kubeapi.Kind.PODS, _pod("typo", "1g.5gb"))
        await _until(
            "the gate removed",
            lambda: "schedulingGates" not in api.objects[kubeapi.Kind.PODS]["ns/typo"]["spec"],
        )
        (warning,) = [e for e in api.events if e.type == "Warning"]
        assert "nvidia.com/mig-1g.5gb" in warning.message

    _run(body)


def test_a_standby_writes_nothing_while_another_holds_the_lease() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeapi.Kind.NODES, _node("n0"))
        await api.put(kubeapi.Kind.PODS, _pod("p", "1g.10gb"))
        await asyncio.sleep(0.5)
        assert not api.spec_writes and not api.pod_patches and not api.events
        assert not controller.leading

    async def main() -> None:
        api = kubeapi.InMemoryApi()
        other = leases.claim(None, identity="someone-else", now=time.time())
        assert other is not None
        await api.write_lease(other, create=True)
        controller = running.Controller(
            api, settings=running.Settings(identity="c1", batch_window_s=0.0, resync_s=0.05)
        )
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        try:
            await body(api, controller)
        finally:
            stop.set()
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(main())


def test_a_failed_write_is_retried_and_a_stale_event_rolls_nothing_back() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeapi.Kind.NODES, _node("n0"))
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeapi.Kind.LAYOUTS])
        before = copy.deepcopy(api.objects[kubeapi.Kind.LAYOUTS]["n0"])
        before["status"] = _status([])
        await api.put(kubeapi.Kind.LAYOUTS, before)
        api.fail_next = kubeapi.KubeApiError("500: the server is busy")
        await api.put(kubeapi.Kind.PODS, _pod("p", "2g.20gb"))
        await _until("a reservation after the failure", lambda: "ns/p" in _reserved(api, "n0"))
        # A stale event (the layout as it was before the write) arrives late: the controller
        # must not plan the pod again.
        stale = copy.deepcopy(before)
        stale["metadata"]["resourceVersion"] = "1"
        controller._put(kubeapi.Kind.LAYOUTS, stale, deleted=False)
        await controller.step()
        assert len([w for w in api.spec_writes if w[0] == "n0" and any(
            i.reserved_for == "ns/p" for g in w[1].gpus for i in g.instances)]) == 1  # fmt: skip

    _run(body)


def test_a_reservation_that_waits_too_long_is_dropped_and_planned_again() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeapi.Kind.NODES, _node("n0"))
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeapi.Kind.LAYOUTS])
        await _agent_reports(api, "n0", [])
        await api.put(kubeapi.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        # The agent makes the instance but the Node never advertises it (say another pod took
        # the capacity): the reservation expires with a Warning, and the pod is planned again.
        _, start, profile = _reserved(api, "n0")["ns/p"]
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await _until(
            "the expiry", lambda: any(e.reason == "MigReservationExpired" for e in api.events)
        )
        await _until("a new reservation", lambda: "ns/p" in _reserved(api, "n0"))
        assert not api.pod_patches

    _run(body, reservation_timeout_s=0.3)
