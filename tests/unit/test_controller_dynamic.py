"""The controller's half of dynamic MIG mode (docs/migmode.md): a dynamic node's whole GPUs and
modes are read into the snapshot, a whole-GPU pod kube-scheduler could not place is planned
only when a node is dynamic, and the spec says each GPU's mode after the plan on dynamic nodes
only."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

from migpilot import errors
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import observing, pinning
from migpilot.planning import control, dynamic, fast, options, plans, validation

H100 = "h100-80gb"
PLANNER = functools.partial(fast.plan, opts=options.Options())


def _node(name: str, *, dynamic_: bool) -> observing.NodeView:
    labels = {"kubernetes.io/hostname": name, "nvidia.com/mig.capable": "true"}
    if dynamic_:
        labels["migpilot.io/mig-mode"] = "dynamic"
    return observing.node_view(
        {
            "metadata": {"name": name, "uid": f"uid-{name}", "labels": labels},
            "status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "allocatable": {"cpu": "32", "memory": "256Gi"},
            },
        }
    )


def _pod(name: str, limits: dict[str, str], *, node: str | None = None) -> observing.PodView:
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": limits}}]}
    status: dict[str, Any] = {"phase": "Pending"}
    if node is None:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
    else:
        spec["nodeName"] = node
    return observing.pod_view(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": spec,
            "status": status,
        }
    )


def _layout(name: str, *, gpu1_mig: bool, spec_mig: bool | None = None) -> gl.GpuLayout:
    used = gl.InstanceStatus("1g.10gb", 0, "MIG-a", gl.InstanceState.USED)
    return gl.GpuLayout(
        name,
        gl.LayoutSpec(
            (
                gl.GpuSpec(0, H100, (gl.InstanceSpec("1g.10gb", 0, None, None),)),
                gl.GpuSpec(1, H100, (), mig=spec_mig),
            )
        ),
        gl.LayoutStatus(
            1,
            (
                gl.GpuStatus(0, H100, "GPU-0", (used,), mig_mode=gl.MigModeStatus(True, True)),
                gl.GpuStatus(1, H100, "GPU-1", (), mig_mode=gl.MigModeStatus(gpu1_mig, gpu1_mig)),
            ),
        ),
    )


def _observe(*, dynamic_: bool, gpu1_mig: bool = True, bound_whole: bool = False) -> Any:
    pods = [
        _pod("mig", {"nvidia.com/mig-1g.10gb": "1"}, node="n"),
        _pod("w", {"nvidia.com/gpu": "1"}),
    ]
    if bound_whole:
        pods.append(_pod("held", {"nvidia.com/gpu": "1"}, node="n"))
    return observing.observe(
        pods=pods,
        nodes=[_node("n", dynamic_=dynamic_)],
        layouts_by_node={"n": _layout("n", gpu1_mig=gpu1_mig)},
    )


def test_a_whole_gpu_pod_is_planned_on_a_dynamic_node_and_the_spec_switches_its_gpu() -> None:
    observed = _observe(dynamic_=True)
    snap = observed.snapshot
    (node,) = snap.nodes
    assert node.dynamic and [g.mig for g in node.gpus] == [True, True]
    assert [p.key for p in snap.whole_pods] == ["ns/w"] and snap.whole_pods[0].whole == 1
    plan = dynamic.plan(snap, PLANNER)
    assert plan.switches == (plans.ModeSwitch("n", 1, False),)
    spec = pinning.spec_for(node, plan, kept={})
    assert [(g.index, g.mig) for g in spec.gpus] == [(0, True), (1, False)]
    assert [i.profile for i in spec.gpus[0].instances] == ["1g.10gb"]  # the MIG pod's, kept


def test_without_the_label_whole_pods_are_not_planned_and_no_mode_is_written() -> None:
    observed = _observe(dynamic_=False)
    snap = observed.snapshot
    assert snap.whole_pods == () and not snap.nodes[0].dynamic
    plan = plans.build(snap, planner="none", targets={}, placements=(), unschedulable=())
    assert all(g.mig is None for g in pinning.spec_for(snap.nodes[0], plan, kept={}).gpus)


def test_a_whole_gpu_is_read_whole_and_held_while_a_bound_pod_asks_for_one() -> None:
    free = _observe(dynamic_=True, gpu1_mig=False).snapshot.nodes[0].gpus[1]
    assert not free.mig and not free.whole_taken and free.instances == ()
    held = _observe(dynamic_=True, gpu1_mig=False, bound_whole=True).snapshot.nodes[0].gpus[1]
    assert not held.mig and held.whole_taken


def test_the_mode_the_spec_asks_for_wins_and_a_pending_mode_holds_the_gpu() -> None:
    layout = _layout("n", gpu1_mig=True, spec_mig=False)
    gpus = observing.whole_gpus(
        layout, observing.node_gpus(layout, reserved=set(), bound={}), bound=0
    )  # type: ignore[arg-type]
    assert [g.mig for g in gpus] == [True, False] and not gpus[1].whole_taken
    status = layout.status
    assert status is not None
    waiting = dataclasses.replace(
        layout,
        status=dataclasses.replace(
            status,
            gpus=(
                status.gpus[0],
                dataclasses.replace(status.gpus[1], mig_mode=gl.MigModeStatus(True, False)),
            ),
        ),
    )
    gpus = observing.whole_gpus(
        waiting, observing.node_gpus(waiting, reserved=set(), bound={}), bound=0
    )  # type: ignore[arg-type]
    assert gpus[1].whole_taken


# --------------------------------------------------------------------------- whole-GPU reservations


def _gated(name: str, limits: dict[str, str]) -> observing.PodView:
    return observing.pod_view(
        {
            "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}"},
            "spec": {
                "containers": [{"name": "c", "resources": {"limits": limits}}],
                "schedulingGates": [{"name": observing.GATE}],
            },
            "status": {"phase": "Pending"},
        }
    )


def _reserving(*, gpu1_mig: bool, reserved: str | None = "ns/w") -> gl.GpuLayout:
    """GPU 1 asked whole (``mig: false``) and kept for ``reserved``; the status says whether
    the agent has switched it yet."""
    layout = _layout("n", gpu1_mig=gpu1_mig)
    spec = layout.spec.gpus
    kept = dataclasses.replace(spec[1], mig=False, reserved_for=reserved)
    return dataclasses.replace(layout, spec=gl.LayoutSpec((spec[0], kept)))


def _observe_reserved(
    layout: gl.GpuLayout, *, whole: observing.PodView, advertised: int = 0, extra: Any = ()
) -> observing.Observed:
    node = _node("n", dynamic_=True)
    if advertised:
        node = dataclasses.replace(
            node, allocatable={**node.allocatable, gl.UNIFIED_RESOURCE: advertised}
        )
    return observing.observe(
        pods=[_pod("mig", {"nvidia.com/mig-1g.10gb": "1"}, node="n"), whole, *extra],
        nodes=[node],
        layouts_by_node={"n": layout},
    )


def test_the_spec_reserves_the_whole_gpu_a_plan_gives_and_round_trips() -> None:
    observed = _observe(dynamic_=True)
    (node,) = observed.snapshot.nodes
    plan = dynamic.plan(observed.snapshot, PLANNER)
    (placement,) = plan.placements
    assert placement.gpus == (1,)
    spec = pinning.spec_for(node, plan, kept={})
    assert [(g.index, g.mig, g.reserved_for) for g in spec.gpus] == [
        (0, True, None),
        (1, False, "ns/w"),
    ]
    doc = wire.spec_patch("n", spec)
    assert doc["spec"]["gpus"][1]["reservedFor"] == "ns/w"
    assert "reservedFor" not in doc["spec"]["gpus"][0]
    assert wire.parse({**doc, "spec": doc["spec"]}).spec == spec
    # A placement on another node before it changes nothing of this node's spec.
    elsewhere = plans.Placement("ns/x", "m", (), gpus=(0,))
    both = dataclasses.replace(plan, placements=(elsewhere, placement))
    assert pinning.spec_for(node, both, kept={}) == spec


def test_a_whole_gpu_reservation_is_live_counted_taken_and_kept_by_the_next_spec() -> None:
    observed = _observe_reserved(
        _reserving(gpu1_mig=True), whole=_pod("w", {"nvidia.com/gpu": "1", "cpu": "2"})
    )
    (r,) = [r for r in observed.reservations.values()]
    assert (r.pod, r.node, r.gpus, r.instances) == ("ns/w", "n", (1,), ())
    snap = observed.snapshot
    assert snap.whole_pods == ()  # reserved: never planned twice
    (node,) = snap.nodes
    assert not node.gpus[1].mig and node.gpus[1].whole_taken
    assert node.allocatable is not None and node.allocatable.cpu_milli == 30_000
    # A second whole-GPU pod finds no GPU: the reserved one is taken, GPU 0 holds a used instance.
    second = _observe_reserved(
        _reserving(gpu1_mig=True),
        whole=_pod("w", {"nvidia.com/gpu": "1"}),
        extra=[_pod("w2", {"nvidia.com/gpu": "1"})],
    )
    plan = dynamic.plan(second.snapshot, PLANNER)
    assert plan.placements == () and plan.switches == ()
    assert [u.pod for u in plan.unschedulable] == ["ns/w2"]
    # A later plan of the node keeps the reservation in the spec it writes.
    kept = pinning.kept_of(second.reservations.values(), "n")
    spec = pinning.spec_for(second.snapshot.nodes[0], plan, kept=kept)
    assert [(g.index, g.mig, g.reserved_for) for g in spec.gpus][1] == (1, False, "ns/w")


def test_validation_refuses_a_plan_that_gives_a_reserved_whole_gpu_to_another_pod() -> None:
    observed = _observe_reserved(
        _reserving(gpu1_mig=False),
        whole=_pod("w", {"nvidia.com/gpu": "1"}),
        extra=[_pod("w2", {"nvidia.com/gpu": "1"})],
    )
    snap = observed.snapshot
    honest = dynamic.plan(snap, PLANNER)
    assert validation.problems(snap, honest) == []
    stolen = dataclasses.replace(
        honest,
        placements=(plans.Placement("ns/w2", "n", (), gpus=(1,)),),
        unschedulable=(),
    )
    assert any(
        "ns/w2" in p and "already held or reserved" in p for p in validation.problems(snap, stolen)
    )
    with pytest.raises(errors.GpuLayoutError, match="given to both ns/w and ns/w2"):
        pinning.spec_for(
            snap.nodes[0], stolen, kept=pinning.kept_of(observed.reservations.values(), "n")
        )


def test_a_whole_gpu_given_while_in_mig_mode_after_the_plan_is_never_written() -> None:
    observed = _observe(dynamic_=True)
    plan = dynamic.plan(observed.snapshot, PLANNER)
    broken = dataclasses.replace(plan, switches=())
    with pytest.raises(errors.GpuLayoutError, match="not whole after the plan"):
        pinning.spec_for(observed.snapshot.nodes[0], broken, kept={})


def _step(observed: observing.Observed, memory: control.Memory, now: float) -> control.Decision:
    return control.reconcile(
        pinning.to_control(observed, changed=True),
        memory,
        now=now,
        settings=control.Settings(reservation_timeout_s=60),
        planner=PLANNER,
    )


def test_a_gated_whole_gpu_pod_is_pinned_once_its_gpu_is_whole_and_advertised() -> None:
    gated = _gated("w", {"nvidia.com/gpu": "1"})
    switching = _observe_reserved(_reserving(gpu1_mig=True), whole=gated)
    reserved = pinning.to_control(switching, changed=True).reserved["ns/w"]
    assert reserved.asks == ((gl.UNIFIED_RESOURCE, 1),) and not reserved.made
    assert reserved.missing is not None and "GPU 1 on n to be switched out of MIG" in (
        reserved.missing
    )
    first = _step(switching, control.Memory(), 0.0)
    assert first.pins == ()
    # Whole in the status, not yet advertised: it waits for the device plugin.
    whole = _observe_reserved(_reserving(gpu1_mig=False), whole=gated)
    assert pinning.made(whole, "ns/w") and pinning.missing(whole, "ns/w") is None
    second = _step(whole, first.memory, 1.0)
    assert second.pins == ()
    # Advertised: pinned to its node (its node affinity narrowed, the gate removed).
    ready = _observe_reserved(_reserving(gpu1_mig=False), whole=gated, advertised=1)
    third = _step(ready, second.memory, 2.0)
    assert third.pins == (("ns/w", "n"),)
    patch = pinning.pin_patch(
        {"spec": {"schedulingGates": [{"name": observing.GATE}]}}, ready.nodes["n"]
    )
    assert patch[0]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n"]}]}
        ]
    }
    # A whole-GPU pod already bound there counts against the node's nvidia.com/gpu.
    busy = _observe_reserved(
        _reserving(gpu1_mig=False),
        whole=gated,
        advertised=1,
        extra=[_pod("held", {"nvidia.com/gpu": "1"}, node="n")],
    )
    assert _step(busy, second.memory, 2.0).pins == ()


def test_a_whole_gpu_reservation_is_released_once_bound_and_expires_unbound() -> None:
    bound = _observe_reserved(
        _reserving(gpu1_mig=False), whole=_pod("w", {"nvidia.com/gpu": "1"}, node="n")
    )
    assert bound.reservations == {} and bound.stale == frozenset({"n"})
    layout = _reserving(gpu1_mig=False)
    released = pinning.without_stale(layout.spec, live=frozenset())
    assert [(g.mig, g.reserved_for) for g in released.gpus] == [(None, None), (False, None)]
    # Still whole, now held by the bound pod: not switched back, not given away.
    assert bound.snapshot.nodes[0].gpus[1].whole_taken
    # An ungated pod kube-scheduler does not bind: its reservation expires, it is planned again.
    waiting = _observe_reserved(layout, whole=_pod("w", {"nvidia.com/gpu": "1"}), advertised=1)
    first = _step(waiting, control.Memory(), 0.0)
    assert first.expired == () and first.pins == ()  # not gated: kube-scheduler's to bind
    later = _step(waiting, first.memory, 61.0)
    assert [(e.pod, e.node) for e in later.expired] == [("ns/w", "n")]


def test_a_reserved_whole_gpu_taken_by_a_pod_bound_without_migpilot_is_stolen() -> None:
    def stolen(*, bound: int, gpu0_whole: bool = False, elsewhere: bool = False) -> bool:
        layout = _reserving(gpu1_mig=False)
        if gpu0_whole:  # GPU 0 whole and free too: room for one bound pod beside the reservation
            status = layout.status
            assert status is not None
            free0 = dataclasses.replace(
                status.gpus[0], instances=(), mig_mode=gl.MigModeStatus(False, False)
            )
            layout = dataclasses.replace(
                layout, status=dataclasses.replace(status, gpus=(free0, status.gpus[1]))
            )
        held = [_pod(f"held{i}", {"nvidia.com/gpu": "1"}, node="n") for i in range(bound)]
        layouts = {"n": layout}
        if elsewhere:  # node m keeps its whole GPU 0 for the gated pod v: not n's to count
            whole_m = gl.GpuStatus(0, H100, "GPU-m0", (), mig_mode=gl.MigModeStatus(False, False))
            layouts["m"] = gl.GpuLayout(
                "m",
                gl.LayoutSpec((gl.GpuSpec(0, H100, (), mig=False, reserved_for="ns/v"),)),
                gl.LayoutStatus(1, (whole_m,)),
            )
        observed = observing.observe(
            pods=[_gated("w", {"nvidia.com/gpu": "1"}), *held]
            + ([_gated("v", {"nvidia.com/gpu": "1"})] if elsewhere else []),
            nodes=[_node("n", dynamic_=True)] + ([_node("m", dynamic_=True)] if elsewhere else []),
            layouts_by_node=layouts,
        )
        if elsewhere:
            assert observed.reservations["ns/v"].gpus == (0,)
        return pinning.stolen(observed, "ns/w")

    assert not stolen(bound=0)
    assert stolen(bound=1)  # the only whole GPU is the reserved one
    assert not stolen(bound=1, gpu0_whole=True)
    assert stolen(bound=2, gpu0_whole=True)
    # Another node's reservation of its GPU 0 takes nothing of n's GPU 0.
    assert not stolen(bound=1, gpu0_whole=True, elsewhere=True)
