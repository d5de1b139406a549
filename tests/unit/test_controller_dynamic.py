"""The controller's half of dynamic MIG mode (docs/migmode.md): a dynamic node's whole GPUs and
modes are read into the snapshot, a whole-GPU pod kube-scheduler could not place is planned
only when a node is dynamic, and the spec says each GPU's mode after the plan on dynamic nodes
only."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from migpilot.api import gpulayouts as gl
from migpilot.controller import observing, pinning
from migpilot.planning import dynamic, fast, options, plans

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
