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

import pytest

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.api import leases
from migpilot.controller import kubeapi, observing, pinning, running
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects
from migpilot.planning import control

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


class _Clock:
    """A clock the test moves (the controller's monotonic clock, or its wall clock)."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _Counting(running.Controller):
    """The controller, counting its passes (so a test can let a few go by)."""

    passes = 0

    async def step(self) -> None:
        await super().step()
        self.passes += 1


async def _passes(controller: running.Controller, n: int = 3) -> None:
    """Let ``n`` more passes of the loop go by."""
    assert isinstance(controller, _Counting)
    want = controller.passes + n
    await _until(f"{n} passes", lambda: controller.passes >= want)


def _run(
    body: Callable[[kubeapi.InMemoryApi, running.Controller], Awaitable[None]],
    *,
    api: kubeapi.InMemoryApi | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    **kw: Any,
) -> None:
    async def main() -> None:
        nonlocal api
        api = api or kubeapi.InMemoryApi()
        given = {"identity": "c1", "batch_window_s": 0.0, "resync_s": 0.05, **kw}
        settings = running.Settings(**given)
        controller = _Counting(api, settings=settings, clock=clock, wall=wall)
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
    doc = copy.deepcopy(api.objects[kubeobjects.Kind.LAYOUTS][node])
    doc["status"] = _status(instances)
    await api.put(kubeobjects.Kind.LAYOUTS, doc)


def _ungated(api: kubeapi.InMemoryApi, key: str) -> bool:
    return "schedulingGates" not in api.objects[kubeobjects.Kind.PODS][key]["spec"]


def _layout(api: kubeapi.InMemoryApi, node: str) -> gl.GpuLayout:
    return wire.parse(api.objects[kubeobjects.Kind.LAYOUTS][node])


def _reserved(api: kubeapi.InMemoryApi, node: str) -> dict[str, tuple[int, int, str]]:
    return {
        i.reserved_for: (g.index, i.start, i.profile)
        for g in _layout(api, node).spec.gpus
        for i in g.instances
        if i.reserved_for
    }


def test_a_gated_pod_is_reserved_pinned_once_and_released_when_bound() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        # The controller makes the node's GpuLayout; the agent reports empty GPUs.
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeobjects.Kind.LAYOUTS])
        await _agent_reports(api, "n0", [])
        await api.put(kubeobjects.Kind.PODS, _pod("p", "3g.40gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        assert profile == "3g.40gb"
        assert not api.pod_patches, "pinned before the instance exists"
        # The agent made it and the Node advertises it: the pod is pinned, once.
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-3g.40gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        pod = api.objects[kubeobjects.Kind.PODS]["ns/p"]
        assert "schedulingGates" not in pod["spec"]
        terms = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"]
        assert terms == [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n0"]}]}
        ]
        # kube-scheduler binds it: the reservation goes, the pin is not repeated.
        bound = copy.deepcopy(pod)
        bound["spec"]["nodeName"] = "n0"
        await api.put(kubeobjects.Kind.PODS, bound)
        await _until("the release", lambda: not _reserved(api, "n0"))
        assert len(api.pod_patches) == 1
        reasons = [e.reason for e in api.events]
        assert "MigInstancesReserved" in reasons and "MigReconfiguring" in reasons

    _run(body)


def test_a_bad_request_gets_a_warning_and_is_let_go() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("bad", "1c.3g.40gb"))
        await _until(
            "the gate removed",
            lambda: "schedulingGates" not in api.objects[kubeobjects.Kind.PODS]["ns/bad"]["spec"],
        )
        (warning,) = [e for e in api.events if e.type == "Warning"]
        assert warning.reason == "MigRequestUnservable"
        assert "compute-instance profile" in warning.message

    _run(body)


def test_a_pod_no_gpu_could_ever_hold_is_let_go_with_the_reason() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("typo", "1g.5gb"))
        await _until(
            "the gate removed",
            lambda: "schedulingGates" not in api.objects[kubeobjects.Kind.PODS]["ns/typo"]["spec"],
        )
        (warning,) = [e for e in api.events if e.type == "Warning"]
        assert "nvidia.com/mig-1g.5gb" in warning.message

    _run(body)


def test_a_standby_writes_nothing_while_another_holds_the_lease() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await asyncio.sleep(0.5)
        assert not api.spec_writes and not api.pod_patches and not api.events
        assert not controller.leading

    async def main() -> None:
        api = kubeapi.InMemoryApi()
        other = leases.claim(
            None, observed=None, identity="someone-else", now=0.0, stamp=time.time()
        )
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
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeobjects.Kind.LAYOUTS])
        before = copy.deepcopy(api.objects[kubeobjects.Kind.LAYOUTS]["n0"])
        before["status"] = _status([])
        await api.put(kubeobjects.Kind.LAYOUTS, before)
        api.fail_next = kube_errors.KubeApiError("500: the server is busy")
        await api.put(kubeobjects.Kind.PODS, _pod("p", "2g.20gb"))
        await _until("a reservation after the failure", lambda: "ns/p" in _reserved(api, "n0"))
        # A stale event (the layout as it was before the write) arrives late: the controller
        # must not plan the pod again.
        stale = copy.deepcopy(before)
        stale["metadata"]["resourceVersion"] = "1"
        controller._put(kubeobjects.Kind.LAYOUTS, stale, deleted=False)
        await controller.step()
        assert len([w for w in api.spec_writes if w[0] == "n0" and any(
            i.reserved_for == "ns/p" for g in w[1].gpus for i in g.instances)]) == 1  # fmt: skip

    _run(body)


async def _reserved_and_made(api: kubeapi.InMemoryApi) -> None:
    """Pod ``ns/p`` (1g.10gb) reserved on node ``n0``, and its instance made by the agent."""
    await _ready_node(api)
    await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
    await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
    _, start, profile = _reserved(api, "n0")["ns/p"]
    await _agent_reports(
        api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
    )


def test_a_reservation_that_waits_too_long_is_dropped_and_planned_again() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        # The agent makes the instance but the Node never advertises it (say another pod took
        # the capacity): the reservation expires with a Warning, and the pod is planned again.
        await _reserved_and_made(api)
        await _until(
            "the expiry", lambda: any(e.reason == "MigReservationExpired" for e in api.events)
        )
        await _until("a new reservation", lambda: "ns/p" in _reserved(api, "n0"))
        assert not api.pod_patches

    _run(body, reservation_timeout_s=0.3)


def test_a_pinned_pod_keeps_its_reservation_however_long_the_scheduler_takes() -> None:
    """Once pinned, a pod can be bound nowhere else: its instances must not go to others."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _reserved_and_made(api)
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-1g.10gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        # kube-scheduler does not bind it (say its cache lags): ten timeouts later the pod is
        # still reserved there, and nothing was said about an expiry.
        await asyncio.sleep(1.0)
        await _passes(controller)
        assert "ns/p" in _reserved(api, "n0")
        assert not any(e.reason == "MigReservationExpired" for e in api.events)
        view = observing.pod_view(api.objects[kubeobjects.Kind.PODS]["ns/p"])
        assert view.problem is None
        assert pinning.pinned_to(view) == "n0"

    _run(body, reservation_timeout_s=0.05)


def test_a_pod_is_not_pinned_to_a_node_a_node_autoscaler_is_removing() -> None:
    """Karpenter taints a node it consolidates (``karpenter.sh/disrupted:NoSchedule``): a
    reservation there is not let go, and expires on its timeout, so the pod is planned where it
    can run and never waits, pinned, on a node about to go."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _reserved_and_made(api)
        node = _node("n0", **{"nvidia.com/mig-1g.10gb": "1"})
        node["spec"] = {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}
        await api.put(kubeobjects.Kind.NODES, node)
        await _until(
            "the expiry", lambda: any(e.reason == "MigReservationExpired" for e in api.events)
        )
        await _passes(controller)
        # Never pinned there. No node is left that could hold it, so the next plan may refuse it
        # (ungated, unpinned, with the reason): whether that plan ran before this check is the
        # loop's timing (faster since the GC pause stopped collecting), so either is right.
        spec = api.objects[kubeobjects.Kind.PODS]["ns/p"]["spec"]
        assert "affinity" not in spec
        assert all(
            op["path"] != "/spec/affinity" and not op["path"].startswith("/spec/affinity/")
            for _, ops in api.pod_patches
            for op in ops
        )
        if _ungated(api, "ns/p"):  # refused: handed to kube-scheduler with the reason why
            assert any(e.reason == "MigRequestUnservable" for e in api.events if e.name == "p")

    _run(body, reservation_timeout_s=0.3)


def test_a_pinned_pods_reservation_taken_by_a_pod_bound_without_migpilot_is_planned_again() -> None:
    """A pod created ungated (the webhook down or timing out) is bound by kube-scheduler alone
    and takes the instance reserved for a pinned pod: waiting would never end, so the
    reservation is dropped at once and the pinned pod planned again (on its node)."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _reserved_and_made(api)
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-1g.10gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        _, start, profile = _reserved(api, "n0")["ns/p"]
        # The interloper holds the instance; the pinned pod is still not bound.
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "used"}]
        )
        await _until(
            "the expiry", lambda: any(e.reason == "MigReservationExpired" for e in api.events)
        )
        (warning,) = [e for e in api.events if e.reason == "MigReservationExpired"]
        assert warning.message == (
            "its instances on node n0 were taken by a pod bound there without migpilot "
            "(created ungated), or the room for them by another pod bound there; planning again"
        )
        await _until("the stolen reservation dropped", lambda: "ns/p" not in _reserved(api, "n0"))
        # kube-scheduler reports the pinned pod Unschedulable: it is planned again, on its node
        # (its pin), with a new instance beside the one taken.
        pod = copy.deepcopy(api.objects[kubeobjects.Kind.PODS]["ns/p"])
        pod["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
        await api.put(kubeobjects.Kind.PODS, pod)
        await _until("a new reservation", lambda: "ns/p" in _reserved(api, "n0"))
        assert _reserved(api, "n0")["ns/p"] != (0, start, profile)

    _run(body)


def test_a_pinned_pod_that_lost_its_instance_and_finds_no_room_waits_saying_where() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("big", "7g.80gb"))
        await _until("a reservation", lambda: "ns/big" in _reserved(api, "n0"))
        whole = {"profile": "7g.80gb", "start": 0, "uuid": "MIG-7", "state": "reserved"}
        await _agent_reports(api, "n0", [whole])
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-7g.80gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        # A pod bound without migpilot takes the whole GPU; kube-scheduler reports ours
        # Unschedulable: it waits for room on the node it is pinned to, and says so.
        await _agent_reports(api, "n0", [{**whole, "state": "used"}])
        await _until("the stolen reservation dropped", lambda: "ns/big" not in _reserved(api, "n0"))
        pod = copy.deepcopy(api.objects[kubeobjects.Kind.PODS]["ns/big"])
        pod["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
        await api.put(kubeobjects.Kind.PODS, pod)
        await _until("MigWaiting", lambda: any(e.reason == "MigWaiting" for e in api.events))
        (waiting,) = [e for e in api.events if e.reason == "MigWaiting"]
        assert waiting.message.startswith("pinned to node n0, where it can only run"), waiting

    _run(body)


# --------------------------------------------------------------------------- more scenarios


async def _ready_node(api: kubeapi.InMemoryApi, name: str = "n0", **allocatable: str) -> None:
    """A MIG node whose agent has reported empty GPUs."""
    await api.put(kubeobjects.Kind.NODES, _node(name, **allocatable))
    await _until(f"a GpuLayout for {name}", lambda: name in api.objects[kubeobjects.Kind.LAYOUTS])
    await _agent_reports(api, name, [])


def _bind(api: kubeapi.InMemoryApi, key: str, node: str) -> dict[str, Any]:
    bound = copy.deepcopy(api.objects[kubeobjects.Kind.PODS][key])
    bound["spec"]["nodeName"] = node
    bound["spec"].pop("schedulingGates", None)
    return bound


def test_the_new_layout_is_empty_and_owned_by_its_node() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        plain = _node("cpu-only")
        del plain["metadata"]["labels"]["nvidia.com/mig.capable"]
        await api.put(kubeobjects.Kind.NODES, plain)
        await _until("a GpuLayout", lambda: "n0" in api.objects[kubeobjects.Kind.LAYOUTS])
        await _passes(controller)
        assert set(api.objects[kubeobjects.Kind.LAYOUTS]) == {"n0"}
        doc = api.objects[kubeobjects.Kind.LAYOUTS]["n0"]
        assert doc["spec"] == {"gpus": []}
        assert doc["metadata"]["ownerReferences"] == [
            {"apiVersion": "v1", "kind": "Node", "name": "n0", "uid": "uid-n0"}
        ]
        assert api.spec_writes == [("n0", gl.LayoutSpec(()))]
        assert controller.leading
        lease = api.leases[f"{leases.NAMESPACE}/{leases.NAME}"]
        assert lease["spec"]["holderIdentity"] == "c1"

    _run(body)


def test_the_whole_path_with_one_spec_write_per_change() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        gpu, start, profile = _reserved(api, "n0")["ns/p"]
        assert (gpu, profile) == (0, "1g.10gb")
        await _passes(controller)
        writes = len(api.spec_writes)
        assert writes == 2  # the empty layout, then the reservation: nothing planned twice
        assert controller.plans == 1
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await _passes(controller)
        assert not api.pod_patches, "pinned before the Node advertises the instance"
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-1g.10gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        ((key, patch),) = api.pod_patches
        assert key == "ns/p"
        assert [op["op"] for op in patch] == ["add", "test", "remove"]
        await _passes(controller)
        assert len(api.pod_patches) == 1
        await api.put(kubeobjects.Kind.PODS, _bind(api, "ns/p", "n0"))
        await _until("the release", lambda: not _reserved(api, "n0"))
        # The instance stays in the spec, unreserved: it is the bound pod's now.
        (g,) = _layout(api, "n0").spec.gpus
        assert [(i.profile, i.start, i.reserved_for) for i in g.instances] == [
            (profile, start, None)
        ]
        await _passes(controller)
        assert len(api.spec_writes) == writes + 1 and controller.plans == 1

    _run(body)


def test_a_deleted_pod_releases_its_reservation() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "3g.40gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        await api.delete(kubeobjects.Kind.PODS, "ns/p")
        await _until("the release", lambda: not _reserved(api, "n0"))
        assert not api.pod_patches

    _run(body)


def test_a_pod_reserved_on_two_nodes_loses_the_second_reservation() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        # Say an earlier controller wrote two specs for one pod (it cannot be planned twice
        # now, but a spec is only data): the second reservation is stale and is released.
        await _ready_node(api, "a")
        await _ready_node(api, "b")
        for name in ("a", "b"):
            doc = copy.deepcopy(api.objects[kubeobjects.Kind.LAYOUTS][name])
            doc["spec"] = {
                "gpus": [
                    {"index": 0, "instances": [
                        {"profile": "7g.80gb", "start": 0, "reservedFor": "ns/p"}]}
                ]
            }  # fmt: skip
            await api.put(kubeobjects.Kind.LAYOUTS, doc)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "7g.80gb"))
        await _until(
            "one reservation left", lambda: len(_reserved(api, "a")) + len(_reserved(api, "b")) == 1
        )
        await _passes(controller)
        assert len(_reserved(api, "a")) + len(_reserved(api, "b")) == 1
        assert controller.plans == 0

    _run(body)


def test_a_pod_left_unschedulable_by_kube_scheduler_is_planned_but_never_pinned() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        pod = _pod("p", "2g.20gb", gated=False)
        await api.put(kubeobjects.Kind.PODS, pod)
        await _passes(controller)
        assert not _reserved(api, "n0"), "planned before kube-scheduler gave up on it"
        pod["status"]["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
        await api.put(kubeobjects.Kind.PODS, pod)
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-2g.20gb": "1"}))
        await _passes(controller)
        assert not api.pod_patches  # an ungated pod cannot be pinned; kube-scheduler retries
        await api.put(kubeobjects.Kind.PODS, _bind(api, "ns/p", "n0"))
        await _until("the release", lambda: not _reserved(api, "n0"))

    _run(body)


def test_a_failed_pin_is_retried_and_lands_once() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        api.fail_next = kube_errors.KubeApiError("503: try again")
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-1g.10gb": "1"}))
        await _until("the pin", lambda: _ungated(api, "ns/p"))
        await _passes(controller)
        assert len(api.pod_patches) == 1  # the failed call recorded nothing
        assert api.fail_next is None
        errors_ = controller.metrics.api_errors.labels(operation="patch")._value.get()
        assert errors_ == 1

    _run(body)


def test_a_pod_in_another_vgpu_mode_is_declined_once_and_never_planned() -> None:
    """``nvidia.com/vgpu-mode: hami-core`` is another system's pod: not planned, not gated, not
    pinned, and told so with one Normal event."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        other = _pod("other", "1g.10gb", gated=False)
        other["metadata"]["annotations"] = {"nvidia.com/vgpu-mode": "hami-core"}
        other["spec"]["containers"][0]["resources"]["limits"] = {
            "nvidia.com/gpu": "1",
            "nvidia.com/gpumem": "4000",
        }
        await api.put(kubeobjects.Kind.PODS, other)
        await _until("an event", lambda: bool(api.events))
        await _passes(controller)
        (event,) = api.events
        assert (event.name, event.type, event.reason) == ("other", "Normal", "MigDeclined")
        assert "'hami-core'" in event.message and "'mig'" in event.message
        assert not api.pod_patches
        assert not any(
            i.get("reservedFor")
            for lay in api.objects[kubeobjects.Kind.LAYOUTS].values()
            for g in lay.get("spec", {}).get("gpus", [])
            for i in g.get("instances", [])
        )

    _run(body)


def test_a_bad_request_is_warned_once() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        bad = _pod("bad", "1g.10gb")
        bad["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"
        await api.put(kubeobjects.Kind.PODS, bad)
        await _until("the gate removed", lambda: _ungated(api, "ns/bad"))
        await _passes(controller)
        (warning,) = api.events
        assert (warning.kind, warning.namespace, warning.name, warning.uid) == (
            "Pod", "ns", "bad", "uid-bad",
        )  # fmt: skip
        assert (warning.type, warning.reason) == ("Warning", "MigRequestUnservable")
        assert "nvidia.com/gpu" in warning.message
        assert not _reserved(api, "n0") and controller.plans == 0

    _run(body)


def test_a_pod_that_fits_a_static_node_is_let_go_there() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        static = _node("s0", **{"nvidia.com/mig-1g.10gb": "7"})
        static["metadata"]["labels"]["nvidia.com/mig.config"] = "all-1g.10gb"
        await api.put(kubeobjects.Kind.NODES, static)
        await _until("a GpuLayout", lambda: "s0" in api.objects[kubeobjects.Kind.LAYOUTS])
        free = [
            {"profile": "1g.10gb", "start": s, "uuid": f"MIG-{s}", "state": "free"}
            for s in range(7)
        ]
        await _agent_reports(api, "s0", free)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("the gate removed", lambda: _ungated(api, "ns/p"))
        (note,) = [e for e in api.events if e.name == "p"]
        assert (note.type, note.reason) == ("Normal", "MigStaticLayout")
        assert "s0" in note.message
        assert api.spec_writes == [("s0", gl.LayoutSpec(()))]  # the static node is not planned

    _run(body)


def test_a_pod_nothing_can_hold_now_waits_gated_and_is_told_once() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("big", "7g.80gb"))
        await _until("a reservation", lambda: "ns/big" in _reserved(api, "n0"))
        await api.put(kubeobjects.Kind.PODS, _pod("more", "7g.80gb"))
        await _until("an event", lambda: any(e.name == "more" for e in api.events))
        await _passes(controller)
        (note,) = [e for e in api.events if e.name == "more"]
        assert (note.type, note.reason) == ("Normal", "MigWaiting")
        assert not _ungated(api, "ns/more")

    _run(body)


def test_with_node_autoscaling_a_pod_nothing_can_hold_is_let_go_unpinned_after_the_grace() -> None:
    clock = _Clock(1000.0)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("big", "7g.80gb"))
        await _until("a reservation", lambda: "ns/big" in _reserved(api, "n0"))
        await api.put(kubeobjects.Kind.PODS, _pod("more", "7g.80gb"))
        await _until("an event", lambda: any(e.name == "more" for e in api.events))
        clock.now += 4.9  # within the grace: it waits gated
        await _passes(controller)
        assert not _ungated(api, "ns/more")
        clock.now += 0.2
        await _until("let go", lambda: _ungated(api, "ns/more"))
        notes = [(e.reason, e.message) for e in api.events if e.name == "more"]
        assert [r for r, _ in notes] == ["MigWaiting", "MigScaleOut"]
        assert notes[1][1].startswith("no node can hold it now (")
        pod = api.objects[kubeobjects.Kind.PODS]["ns/more"]
        assert "affinity" not in pod["spec"]  # unpinned: any new node will do
        assert controller.metrics.scaled_out._value.get() == 1
        await _passes(controller)
        assert [e.reason for e in api.events if e.name == "more"] == ["MigWaiting", "MigScaleOut"]

    _run(body, clock=clock, scale_out_after_s=5.0)


def test_expiry_follows_the_controllers_clock(caplog: pytest.LogCaptureFixture) -> None:
    clock = _Clock(1000.0)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await _passes(controller)
        clock.now += 59.0  # made 59 s ago, not bound: not yet
        await _passes(controller)
        assert "ns/p" in _reserved(api, "n0")
        assert not any(e.reason == "MigReservationExpired" for e in api.events)
        clock.now += 2.0
        await _until(
            "the expiry", lambda: any(e.reason == "MigReservationExpired" for e in api.events)
        )
        (note,) = [e for e in api.events if e.reason == "MigReservationExpired"]
        assert note.type == "Warning"
        assert note.message == (
            "its instances on node n0 were not usable in time (reservation timeout 60 s); "
            "planning again"
        )
        assert "reservation of ns/p on n0 expired: planning again" in caplog.messages
        await _until("planned again", lambda: controller.plans == 2)
        await _until("a new reservation", lambda: "ns/p" in _reserved(api, "n0"))

    _run(body, clock=clock)


def test_instances_that_never_appear_expire_after_ten_timeouts() -> None:
    clock = _Clock(1000.0)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        await _passes(controller)
        clock.now += 500.0  # the agent is slow: 50 s would have expired made instances
        await _passes(controller)
        assert not any(e.reason == "MigReservationExpired" for e in api.events)
        clock.now += 101.0
        await _until(
            "the expiry", lambda: any(e.reason == "MigReservationExpired" for e in api.events)
        )

    _run(body, clock=clock, reservation_timeout_s=60.0)


def test_a_standby_takes_over_once_it_has_seen_no_renewal_for_a_lease_duration() -> None:
    clock = _Clock(1000.0)
    api = kubeapi.InMemoryApi()
    other = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=time.time())
    assert other is not None
    asyncio.run(api.write_lease(other, create=True))

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("the watches", lambda: len(controller._store.pods) == 1)
        await _until("the Lease seen", lambda: controller._observed is not None)
        clock.now += 14.0
        await asyncio.sleep(0.2)  # a pass or more: the standby must stay passive
        assert not controller.leading
        assert not api.spec_writes and not api.pod_patches and not api.events
        clock.now += 1.0  # c0 not seen renewing for 15 s on c1's clock: the Lease is c1's
        await _until("the Lease taken", lambda: controller.leading)
        lease = api.leases[f"{leases.NAMESPACE}/{leases.NAME}"]
        assert lease["spec"]["holderIdentity"] == "c1"
        assert lease["spec"]["leaseTransitions"] == 1
        await _until("the GpuLayout", lambda: "n0" in api.objects[kubeobjects.Kind.LAYOUTS])

    _run(body, api=api, clock=clock, renew_every_s=0.05)


def test_a_leader_that_loses_the_lease_stops_writing() -> None:
    wall = _Clock(1_800_000_000.0)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _until("the Lease", lambda: controller.leading)
        # Another controller took the Lease (say after a partition): c1 sees it and stands by.
        key = f"{leases.NAMESPACE}/{leases.NAME}"
        theirs = copy.deepcopy(api.leases[key])
        theirs["spec"]["holderIdentity"] = "c2"
        theirs["spec"]["renewTime"] = leases.format_time(wall.now + 100)
        api.leases[key] = theirs
        await _until("standing by", lambda: not controller.leading)
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await asyncio.sleep(0.2)
        assert not api.spec_writes and not api.pod_patches
        assert controller.metrics.leader._value.get() == 0

    _run(body, wall=wall, renew_every_s=0.05)


def test_a_late_watch_event_rolls_back_neither_a_spec_nor_a_pin() -> None:
    lagging = kubeapi.InMemoryApi()  # its replay delivers an object late, as it was

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        before = copy.deepcopy(api.objects[kubeobjects.Kind.LAYOUTS]["n0"])
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        gated = copy.deepcopy(api.objects[kubeobjects.Kind.PODS]["ns/p"])
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        # The layout as it was before the reservation comes through the watch again.
        await lagging.replay(kubeobjects.Kind.LAYOUTS, before)
        await _passes(controller)
        assert controller.plans == 1, "planned again from a stale layout"
        _, start, profile = _reserved(api, "n0")["ns/p"]
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await api.put(kubeobjects.Kind.NODES, _node("n0", **{"nvidia.com/mig-1g.10gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        # The pod as it was before the pin comes through the watch again: no second pin.
        await lagging.replay(kubeobjects.Kind.PODS, gated)
        await _passes(controller)
        assert len(api.pod_patches) == 1
        assert controller.plans == 1

    _run(body, api=lagging)


def test_an_api_server_that_fails_to_list_is_listed_again() -> None:
    class Flaky(kubeapi.InMemoryApi):
        failures = 2

        async def list_all(self, kind: kubeobjects.Kind) -> kubeobjects.Listed:
            if kind is kubeobjects.Kind.PODS and self.failures:
                self.failures -= 1
                raise kube_errors.KubeApiError("500: etcd is unhappy")
            return await super().list_all(kind)

    flaky = Flaky()

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        assert flaky.failures == 0

    _run(body, api=flaky, retry_s=0.01)


def test_probes_ready_once_every_kind_is_listed_and_alive_while_the_loop_goes_round() -> None:
    class Clock:
        now = 1000.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    fresh = running.Controller(
        kubeapi.InMemoryApi(), settings=running.Settings(identity="c0"), clock=clock
    )
    assert fresh.not_ready() == (
        "not yet listed: gpulayouts, namespaces, nodes, pods, resourceclaims, "
        "resourceclaimtemplates"
    )
    clock.now += fresh.settings.stall_s + 1  # never run: its loop never went round
    assert "has not gone round" in (fresh.heartbeat.check() or "")

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _until("every kind listed", lambda: controller.not_ready() is None)
        clock.now += controller.settings.stall_s + 1
        await _passes(controller)  # the loop beats each round (every resync at least)
        assert controller.heartbeat.check() is None

    _run(body, clock=clock)


def test_a_reserved_pods_wait_is_news_once_per_reason() -> None:
    a = control.Waiting("ns/a", "n1", "unified pod ns/x, asking differently, to be allocated first")
    b = control.Waiting("ns/b", "n1", "node n1 to advertise nvidia.com/gpu (allocatable 1)")
    fresh, said = running.new_waits([a, b], {})
    assert fresh == {a, b}
    # The same reasons again: nothing new; b's reason changes: news again.
    b2 = control.Waiting("ns/b", "n1", "node n1 to admit it again (cordoned)")
    fresh, said = running.new_waits([a, b2], said)
    assert fresh == {b2}
    # a let go, then waiting again for the same reason: news, as it was forgotten.
    fresh, said = running.new_waits([b2], said)
    assert fresh == frozenset() and said == {"ns/b": b2.why}
    fresh, said = running.new_waits([a, b2], said)
    assert fresh == {a}
