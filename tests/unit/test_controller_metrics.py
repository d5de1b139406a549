"""The controller's metrics per node and model, pending pods by reason, creation-to-bind time and
instances per profile (written in specs, and reported created and destroyed by the agents):
exact values, from the pure definitions and from the real loop on the
in-memory API with clocks the test moves."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
from typing import Any

import pytest

from migpilot.api import gpulayouts as gl
from migpilot.api import leases
from migpilot.controller import kubeapi, metrics, running, turnover
from migpilot.kube import objects as kubeobjects
from migpilot.mig import catalog, profiles
from migpilot.planning import plans, snapshot, usage
from tests.unit.test_controller_leading import _Api as _LeaseApi
from tests.unit.test_controller_leading import _reads as _lease_reads
from tests.unit.test_controller_leading import _run as _run_leading
from tests.unit.test_controller_running import (
    _agent_reports,
    _bind,
    _Clock,
    _passes,
    _pod,
    _ready_node,
    _reserved,
    _run,
    _status,
    _until,
)
from tests.unit.test_controller_running import _node as _node_doc

A100 = catalog.resolve_gpu("a100-80gb")
A30 = catalog.resolve_gpu("a30-24gb")
CREATED = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()
"""The ``creationTimestamp`` of the test's pods (2026-01-01T00:00:00Z)."""


def _gpu(model: profiles.GpuModel, *held: tuple[str, int, bool]) -> snapshot.Gpu:
    return snapshot.Gpu(
        0, model, tuple(snapshot.ExistingInstance(p, s, used) for p, s, used in held)
    )


def _node(name: str, *gpus: snapshot.Gpu) -> snapshot.Node:
    return snapshot.Node(name, {}, (), False, None, gpus)


def _value(m: metrics.ControllerMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


# -- the pure definition ----------------------------------------------------------------------


def test_a_gpu_counts_held_slices_and_its_free_slices_as_scattered_only_when_partly_held() -> None:
    partly = usage.of_gpu(_gpu(A100, ("3g.40gb", 0, True), ("1g.10gb", 4, False)))
    assert partly == usage.Slices(total=7, held=3, scattered=4)
    assert usage.of_gpu(_gpu(A100, ("1g.10gb", 0, False))) == usage.Slices(7, 0, 0)
    assert usage.of_gpu(_gpu(A100, ("7g.80gb", 0, True))) == usage.Slices(7, 7, 0)


def test_ratios_and_their_empty_cases() -> None:
    assert usage.Slices(8, 2, 3).allocation == 0.25
    assert usage.Slices(8, 2, 3).fragmentation == 0.5
    assert usage.Slices().allocation == 0.0 and usage.Slices().fragmentation == 0.0
    assert usage.Slices(7, 7, 0).fragmentation == 0.0  # nothing free


def test_per_node_and_model_sums_the_gpus_of_that_model() -> None:
    a = _node("a", _gpu(A100, ("3g.40gb", 0, True)), _gpu(A100), _gpu(A30, ("1g.6gb", 0, True)))
    b = _node("b", _gpu(A100, ("7g.80gb", 0, True)))
    per = usage.by_node_and_model([a, b])
    assert per == {
        ("a", "a100-80gb"): usage.Slices(total=14, held=3, scattered=4),
        ("a", "a30-24gb"): usage.Slices(total=4, held=1, scattered=3),
        ("b", "a100-80gb"): usage.Slices(total=7, held=7, scattered=0),
    }
    assert usage.total(per.values()) == usage.Slices(total=25, held=11, scattered=7)


def test_gauges_per_node_and_model_and_a_node_gone_loses_its_series() -> None:
    m = metrics.ControllerMetrics()
    a = _node("a", _gpu(A100, ("3g.40gb", 0, True)), _gpu(A100))
    b = _node("b", _gpu(A30, ("1g.6gb", 0, True)))
    m.observe_cluster(snapshot.Snapshot(nodes=(a, b), pods=()))
    assert _value(m, "migpilot_node_allocation_ratio", node="a", model="a100-80gb") == 3 / 14
    assert _value(m, "migpilot_node_fragmentation_ratio", node="a", model="a100-80gb") == 4 / 11
    assert _value(m, "migpilot_node_allocation_ratio", node="b", model="a30-24gb") == 1 / 4
    assert _value(m, "migpilot_node_fragmentation_ratio", node="b", model="a30-24gb") == 1.0
    assert _value(m, "migpilot_allocation_ratio") == 4 / 18
    assert _value(m, "migpilot_fragmentation_ratio") == 7 / 14
    m.observe_cluster(snapshot.Snapshot(nodes=(a,), pods=()))
    assert _value(m, "migpilot_node_allocation_ratio", node="b", model="a30-24gb") is None
    assert _value(m, "migpilot_node_fragmentation_ratio", node="b", model="a30-24gb") is None
    assert _value(m, "migpilot_allocation_ratio") == 3 / 14


def test_pending_by_reason_keeps_a_reason_no_pod_holds_at_zero() -> None:
    m = metrics.ControllerMetrics()
    m.observe_pending(["MigWaiting", "MigWaiting", "MigRequestUnservable"])
    assert _value(m, "migpilot_pending_pods", reason="MigWaiting") == 2
    assert _value(m, "migpilot_pending_pods", reason="MigRequestUnservable") == 1
    m.observe_pending(["MigWaiting"])
    assert _value(m, "migpilot_pending_pods", reason="MigWaiting") == 1
    assert _value(m, "migpilot_pending_pods", reason="MigRequestUnservable") == 0


def test_instance_actions_written_are_counted_by_op_and_profile_and_mps_slices_by_size() -> None:
    m = metrics.ControllerMetrics()
    m.observe_written(
        [
            plans.Action("n", 0, plans.Op.DESTROY, "1g.10gb", 0),
            plans.Action("n", 0, plans.Op.DESTROY, "1g.10gb", 1),
            plans.Action("n", 0, plans.Op.CREATE, "2g.20gb", 0),
        ],
        [
            plans.SliceAction("n", 1, plans.SliceOp.CREATE, 0, 20, None, "for ns/p"),
            plans.SliceAction("n", 1, plans.SliceOp.REMOVE, 1, 40, None, "freed"),
        ],
    )
    written = "migpilot_instance_actions_written_total"
    assert _value(m, written, op="destroy", profile="1g.10gb") == 2
    assert _value(m, written, op="create", profile="2g.20gb") == 1
    assert _value(m, written, op="create", profile="mps-20gb") == 1
    assert _value(m, written, op="destroy", profile="mps-40gb") == 1
    assert _value(m, written, op="create", profile="1g.10gb") is None
    # What was written is not what the agents reported.
    assert _value(m, "migpilot_instances_created_total", profile="2g.20gb") is None
    assert _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") is None


def test_turnover_is_counted_by_profile() -> None:
    m = metrics.ControllerMetrics()
    m.observe_turnover(turnover.Turnover(created={"1g.10gb": 2, "mps-20gb": 1}))
    m.observe_turnover(turnover.Turnover(created={"1g.10gb": 1}, destroyed={"7g.80gb": 1}))
    assert _value(m, "migpilot_instances_created_total", profile="1g.10gb") == 3
    assert _value(m, "migpilot_instances_created_total", profile="mps-20gb") == 1
    assert _value(m, "migpilot_instances_destroyed_total", profile="7g.80gb") == 1
    assert _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") is None


@pytest.mark.parametrize(
    ("created_s", "le_below", "le_at"), [(0.3, None, "0.5"), (100.0, "60.0", "120.0")]
)
def test_creation_to_bind_lands_in_its_bucket(
    created_s: float, le_below: str | None, le_at: str
) -> None:
    m = metrics.ControllerMetrics()
    m.observe_bound(seen_s=None, created_s=created_s)
    name = "migpilot_pod_creation_to_bind_seconds_bucket"
    if le_below is not None:
        assert _value(m, name, le=le_below) == 0
    assert _value(m, name, le=le_at) == 1
    assert _value(m, "migpilot_pod_bind_seconds_count") == 0


def test_a_creation_time_ahead_of_the_controllers_clock_counts_as_zero() -> None:
    m = metrics.ControllerMetrics()
    m.observe_bound(seen_s=1.0, created_s=-2.0)
    assert _value(m, "migpilot_pod_creation_to_bind_seconds_sum") == 0.0
    assert _value(m, "migpilot_pod_bind_seconds_sum") == 1.0


# -- the real loop ----------------------------------------------------------------------------


def test_a_pod_bound_after_n_seconds_lands_in_its_bucket_and_leaves_the_pending_gauge() -> None:
    clock, wall = _Clock(1000.0), _Clock(CREATED + 30.0)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        m = controller.metrics
        await _ready_node(api)
        await _until(
            "the node's series",
            lambda: (
                _value(m, "migpilot_node_allocation_ratio", node="n0", model="a100-80gb") == 0.0
            ),
        )
        await api.put(kubeobjects.Kind.PODS, _pod("p", "3g.40gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        _, start, profile = _reserved(api, "n0")["ns/p"]
        written = "migpilot_instance_actions_written_total"
        assert _value(m, written, op="create", profile="3g.40gb") == 1
        assert _value(m, "migpilot_instances_created_total", profile="3g.40gb") is None
        await _until(
            "the pod pending as reserved",
            lambda: _value(m, "migpilot_pending_pods", reason="MigInstancesReserved") == 1,
        )
        await _agent_reports(
            api, "n0", [{"profile": profile, "start": start, "uuid": "MIG-1", "state": "reserved"}]
        )
        await _until(
            "the reserved instance counted",
            lambda: (
                _value(m, "migpilot_node_allocation_ratio", node="n0", model="a100-80gb") == 3 / 7
            ),
        )
        await _until(
            "the instance the agent made counted",
            lambda: _value(m, "migpilot_instances_created_total", profile="3g.40gb") == 1,
        )
        clock.now += 7.0
        wall.now += 70.0  # created 100 s before it is bound
        await api.put(kubeobjects.Kind.PODS, _bind(api, "ns/p", "n0"))
        await _until(
            "the bind counted",
            lambda: _value(m, "migpilot_pod_creation_to_bind_seconds_count") == 1,
        )
        assert _value(m, "migpilot_pod_creation_to_bind_seconds_sum") == 100.0
        assert _value(m, "migpilot_pod_creation_to_bind_seconds_bucket", le="60.0") == 0
        assert _value(m, "migpilot_pod_creation_to_bind_seconds_bucket", le="120.0") == 1
        assert _value(m, "migpilot_pod_bind_seconds_sum") == 7.0
        await _until(
            "the pod out of the pending gauge",
            lambda: _value(m, "migpilot_pending_pods", reason="MigInstancesReserved") == 0,
        )

    _run(body, clock=clock, wall=wall)


def test_a_refused_pod_counts_under_its_reason_until_it_is_served() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        m = controller.metrics
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("bad", "1c.3g.40gb"))
        await _until(
            "the refusal counted",
            lambda: _value(m, "migpilot_pending_pods", reason="MigRequestUnservable") == 1,
        )
        await _passes(controller)
        assert _value(m, "migpilot_pending_pods", reason="MigRequestUnservable") == 1
        # kube-scheduler serves it (the request was for it to judge).
        await api.put(kubeobjects.Kind.PODS, _bind(api, "ns/bad", "n0"))
        await _until(
            "the pod out of the gauge",
            lambda: _value(m, "migpilot_pending_pods", reason="MigRequestUnservable") == 0,
        )

    _run(body)


def test_a_free_instance_a_plan_replaces_is_counted_destroyed_once_the_agent_reports_it() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        m = controller.metrics
        await _ready_node(api)  # the agent's first report: the baseline
        await _agent_reports(
            api, "n0", [{"profile": "1g.10gb", "start": 0, "uuid": "MIG-0", "state": "free"}]
        )
        await _until(
            "the new instance counted",
            lambda: _value(m, "migpilot_instances_created_total", profile="1g.10gb") == 1,
        )
        await api.put(kubeobjects.Kind.PODS, _pod("big", "7g.80gb"))
        await _until("a reservation", lambda: "ns/big" in _reserved(api, "n0"))
        written = "migpilot_instance_actions_written_total"
        assert _value(m, written, op="destroy", profile="1g.10gb") == 1
        assert _value(m, written, op="create", profile="7g.80gb") == 1
        # Planned, not done: nothing counted until the agent reports it.
        await _passes(controller)
        assert _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") is None
        assert _value(m, "migpilot_instances_created_total", profile="7g.80gb") is None
        await _agent_reports(
            api,
            "n0",
            [{"profile": "1g.10gb", "start": 0, "uuid": "MIG-0", "state": "destroying"}],
        )
        await _passes(controller)
        assert _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") is None
        await _agent_reports(
            api,
            "n0",
            [{"profile": "7g.80gb", "start": 0, "uuid": "MIG-7", "state": "reserved"}],
        )
        await _until(
            "the destroy counted",
            lambda: _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") == 1,
        )
        assert _value(m, "migpilot_instances_created_total", profile="7g.80gb") == 1
        assert _value(m, "migpilot_instances_created_total", profile="1g.10gb") == 1

    _run(body)


def _layout_doc(node: str, instances: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": gl.API_VERSION,
        "kind": gl.KIND,
        "metadata": {"name": node},
        "spec": {"gpus": []},
        "status": _status(instances),
    }


FOUND = [
    {"profile": "3g.40gb", "start": 0, "uuid": "MIG-0", "state": "free"},
    {"profile": "1g.10gb", "start": 4, "uuid": "MIG-4", "state": "free"},
]


def test_what_a_starting_controller_finds_is_its_baseline_and_a_deleted_layout_is_forgotten() -> (
    None
):
    api = kubeapi.InMemoryApi()
    asyncio.run(api.put(kubeobjects.Kind.NODES, _node_doc("n0")))
    asyncio.run(api.put(kubeobjects.Kind.LAYOUTS, _layout_doc("n0", FOUND)))

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        m = controller.metrics
        await _until("leading", lambda: controller.leading)
        await _passes(controller)
        for profile in ("3g.40gb", "1g.10gb"):
            assert _value(m, "migpilot_instances_created_total", profile=profile) is None
        # One destroyed, as the agent reports it.
        await _agent_reports(api, "n0", FOUND[:1])
        await _until(
            "the destroy counted",
            lambda: _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") == 1,
        )
        # The GpuLayout deleted (the controller makes it again, empty): no destroy counted, and
        # the agent's report on the new one is a new baseline.
        await api.delete(kubeobjects.Kind.LAYOUTS, "n0")
        await _until(
            "the GpuLayout made again", lambda: "n0" in api.objects[kubeobjects.Kind.LAYOUTS]
        )
        await _agent_reports(api, "n0", FOUND)
        await _passes(controller)
        assert _value(m, "migpilot_instances_destroyed_total", profile="3g.40gb") is None
        assert _value(m, "migpilot_instances_created_total", profile="1g.10gb") is None
        assert _value(m, "migpilot_instances_created_total", profile="3g.40gb") is None
        await _agent_reports(api, "n0", [])
        await _until(
            "both destroys counted",
            lambda: _value(m, "migpilot_instances_destroyed_total", profile="3g.40gb") == 1,
        )
        assert _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") == 2

    _run(body, api=api)


def test_a_standby_counts_nothing_but_keeps_its_baseline_for_when_it_leads() -> None:
    clock = _Clock(1000.0)
    api = _LeaseApi()
    held = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=CREATED)
    assert held is not None
    asyncio.run(api.write_lease(held, create=True))
    asyncio.run(api.put(kubeobjects.Kind.NODES, _node_doc("n0")))
    asyncio.run(api.put(kubeobjects.Kind.LAYOUTS, _layout_doc("n0", [])))

    async def body(api: _LeaseApi, controller: running.Controller) -> None:
        m = controller.metrics
        await _lease_reads(api)
        await _agent_reports(api, "n0", FOUND)
        await _lease_reads(api)
        assert not controller.leading
        assert _value(m, "migpilot_instances_created_total", profile="3g.40gb") is None
        clock.now += 60.0  # c0 is long gone
        await _until("the Lease taken", lambda: controller.leading)
        await _agent_reports(api, "n0", FOUND[:1])
        await _until(
            "the destroy counted",
            lambda: _value(m, "migpilot_instances_destroyed_total", profile="1g.10gb") == 1,
        )
        assert _value(m, "migpilot_instances_created_total", profile="3g.40gb") is None
        assert _value(m, "migpilot_instances_created_total", profile="1g.10gb") is None

    _run_leading(body, api=api, clock=clock)


# -- what autoscalers read: free instances and unmet demand ------------------------------------

H100 = catalog.resolve_gpu("h100-80gb")


def test_free_instances_are_the_made_ones_nobody_uses_or_reserved_by_model_and_profile() -> None:
    a100 = _gpu(A100, ("1g.10gb", 0, False), ("1g.10gb", 1, True), ("3g.40gb", 4, False))
    h100 = _gpu(H100, ("1g.10gb", 0, False))
    mps = snapshot.Gpu(
        0,
        A100,
        (),
        mps=(
            snapshot.modes.MpsSlice(0, 20, None, used=False),
            snapshot.modes.MpsSlice(1, 20, None, used=True),
        ),
    )
    shared = snapshot.Gpu(0, H100, (), replicas=4, replicas_used=1)
    full = snapshot.Gpu(1, H100, (), replicas=4, replicas_used=4)
    nodes = [_node("a", a100), _node("h", h100), _node("m", mps), _node("t", shared, full)]
    assert usage.free_instances(nodes) == {
        ("a100-80gb", "1g.10gb"): 1,
        ("a100-80gb", "3g.40gb"): 1,
        ("h100-80gb", "1g.10gb"): 1,
        ("a100-80gb", "mps-20gb"): 1,
        ("h100-80gb", usage.REPLICA_PROFILE): 3,
    }


def _waiting(name: str, *mig: tuple[str, int]) -> snapshot.Pod:
    requests = snapshot.Requests(tuple(snapshot.MigRequest(p, n) for p, n in mig), 1000, 1 << 30)
    return snapshot.planned_pod(name=name, namespace="ns", requests=requests)


def test_unmet_demand_counts_each_pod_under_every_model_that_could_hold_it() -> None:
    two_a100 = dataclasses.replace(_node("a", _gpu(A100), dataclasses.replace(_gpu(A100), index=1)))
    one_h100 = _node("h", _gpu(H100))
    pods = [
        _waiting("small", ("1g.10gb", 2)),
        _waiting("whole-pair", ("7g.80gb", 2)),  # two whole GPUs: only the two-A100 node
        _waiting("a30-only", ("1g.6gb", 1)),  # no model here offers it: counts nowhere
    ]
    got = usage.unmet_demand([two_a100, one_h100], pods)
    assert got == {
        ("a100-80gb", "1g.10gb"): 2,
        ("h100-80gb", "1g.10gb"): 2,
        ("a100-80gb", "7g.80gb"): 2,
    }
    assert usage.unmet_demand([two_a100], []) == {}


def test_unmet_demand_on_an_mps_node_is_in_slices() -> None:
    mps_node = dataclasses.replace(
        _node("m", snapshot.Gpu(0, A100, ())), mode=snapshot.modes.Mode.MPS
    )
    pod = dataclasses.replace(_waiting("slice"), mig=(), mps=(snapshot.modes.MpsRequest(10, 2),))
    assert usage.unmet_demand([mps_node], [pod]) == {("a100-80gb", "mps-10gb"): 2}


def test_the_loop_exports_free_instances_and_the_demand_it_cannot_meet() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        m = controller.metrics
        await _ready_node(api)
        await _agent_reports(
            api, "n0", [{"profile": "7g.80gb", "start": 0, "uuid": "MIG-7", "state": "free"}]
        )
        await _until(
            "the free instance",
            lambda: _value(m, "migpilot_free_instances", model="a100-80gb", profile="7g.80gb") == 1,
        )
        # One whole GPU, taken by a pod; a second pod asking for it cannot be placed.
        await api.put(kubeobjects.Kind.PODS, _bind_doc(_pod("holder", "7g.80gb"), "n0"))
        await api.put(kubeobjects.Kind.PODS, _pod("more", "7g.80gb"))
        await _until(
            "the unmet demand",
            lambda: _value(m, "migpilot_unmet_demand", model="a100-80gb", profile="7g.80gb") == 1,
        )
        assert _value(m, "migpilot_free_instances", model="a100-80gb", profile="7g.80gb") is None
        # The waiting pod goes: nothing is wanted any more.
        await api.delete(kubeobjects.Kind.PODS, "ns/more")
        await _until(
            "no demand",
            lambda: (
                _value(m, "migpilot_unmet_demand", model="a100-80gb", profile="7g.80gb") is None
            ),
        )

    _run(body)


def _bind_doc(doc: dict[str, Any], node: str) -> dict[str, Any]:
    doc["spec"]["nodeName"] = node
    doc["spec"].pop("schedulingGates", None)
    return doc
