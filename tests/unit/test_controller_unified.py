"""The controller's rules for unified (HAMi-style) pods, as pure functions of the objects read.

A unified pod asks ``nvidia.com/gpu`` with ``nvidia.com/gpumem``; the planner picks its MIG
slice; the controller reserves it with ``resource: nvidia.com/gpu``, lets the pod go once the
node advertises the devices and counters kube-scheduler checks, and only while the unified pods
let go to that node and not yet allocated ask alike (``docs/unified.md``); the reservation lives
until the agent reports the pod allocated.
"""

from __future__ import annotations

from typing import Any

from migpilot.api import gpulayouts as gl
from migpilot.controller import observing, pinning
from migpilot.mig import catalog, layouts
from migpilot.planning import control, plans, snapshot

A100 = "NVIDIA A100-SXM4-80GB"
GATE = observing.GATE
S = gl.InstanceState
GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"


def _pod(
    name: str,
    mem: int = 8000,
    *,
    gpus: int = 1,
    gated: bool = True,
    node: str | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    limits = {GPU: str(gpus), MEM: str(mem)}
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": limits}}]}
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    if node:
        spec["nodeName"] = node
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"u-{name}"}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec, "status": {"phase": "Pending"}}


def _node(**allocatable: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "n0", "labels": {"nvidia.com/mig.capable": "true"}},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {"cpu": "32", "memory": "256Gi", **allocatable},
        },
    }


def _observed(
    pods: list[dict[str, Any]],
    *,
    spec: list[tuple[int, str, str | None]],
    status: list[tuple[int, str, gl.InstanceState, str | None]],
    node: dict[str, Any],
) -> observing.Observed:
    """One node, one A100; status entries are (start, profile, state, used by)."""
    layout = gl.GpuLayout(
        "n0",
        gl.LayoutSpec(
            (
                gl.GpuSpec(
                    0,
                    None,
                    tuple(
                        gl.InstanceSpec(p, s, r, gl.UNIFIED_RESOURCE if r else None)
                        for s, p, r in spec
                    ),
                ),
            )
        ),
        gl.LayoutStatus(
            1,
            (
                gl.GpuStatus(
                    0,
                    A100,
                    "GPU-0",
                    tuple(
                        gl.InstanceStatus(p, s, f"MIG-{s}", state, who)
                        for s, p, state, who in status
                    ),
                ),
            ),
        ),
    )
    return observing.observe(
        pods=[observing.pod_view(p) for p in pods],
        nodes=[observing.node_view(node)],
        layouts_by_node={"n0": layout},
    )


def test_a_unified_pod_is_read_with_its_request_and_policies() -> None:
    view = observing.pod_view(
        _pod("u", 19000, gpus=2, annotations={"hami.io/gpu-scheduler-policy": "binpack"})
    )
    assert view.problem is None and view.unified and view.gpus == 2
    assert view.is_mig and view.waiting and not view.mig
    assert view.counters == (MEM,)
    assert view.pod is not None and view.pod.unified is not None
    assert view.pod.gpu_policy is snapshot.Policy.BINPACK
    assert view.pod.profiles_on(catalog.resolve_gpu(A100)) == ("1g.20gb", "1g.20gb")
    # The apiserver writes 8000 back as 8k: read the same.
    again = _pod("v")
    again["spec"]["containers"][0]["resources"]["limits"][MEM] = "8k"
    assert observing.pod_view(again).pod == observing.pod_view(_pod("v")).pod


def test_a_whole_gpu_pod_is_not_ours_and_a_bad_unified_one_is_a_problem() -> None:
    whole = _pod("w")
    del whole["spec"]["containers"][0]["resources"]["limits"][MEM]
    assert not observing.pod_view(whole).is_mig
    bad = _pod("b", 0)
    view = observing.pod_view(bad)
    assert view.pod is None and view.problem is not None and MEM in view.problem


def test_a_unified_reservation_is_marked_for_the_agent() -> None:
    model = catalog.resolve_gpu(A100)
    node = snapshot.Node("n0", {}, (), False, None, (snapshot.Gpu(0, model, ()),))
    two = layouts.Layout.of([layouts.Instance(0, "1g.10gb"), layouts.Instance(1, "1g.10gb")])
    plan = plans.Plan(
        planner="test",
        gpus=(plans.GpuPlan("n0", 0, True, two),),
        actions=(),
        placements=(
            plans.Placement("ns/u", "n0", (plans.AssignedInstance(0, "1g.10gb", 0),)),
            plans.Placement("ns/m", "n0", (plans.AssignedInstance(0, "1g.10gb", 1),)),
        ),
        unschedulable=(),
    )
    spec = pinning.spec_for(node, plan, kept={}, unified=frozenset({"ns/u"}))
    got = {(i.start, i.reserved_for, i.resource) for i in spec.gpus[0].instances}
    assert got == {(0, "ns/u", gl.UNIFIED_RESOURCE), (1, "ns/m", None)}
    # Released: the mark goes with the reservation.
    bare = pinning.without_stale(spec, live=frozenset())
    assert {(i.reserved_for, i.resource) for i in bare.gpus[0].instances} == {(None, None)}


def test_a_unified_pod_waits_for_its_devices_and_counters() -> None:
    made = [(0, "1g.10gb", S.RESERVED, None)]
    spec = [(0, "1g.10gb", "ns/u")]
    obs = _observed([_pod("u")], spec=spec, status=made, node=_node())
    assert MEM in (_why(obs, "ns/u") or "")  # the counters first, then the devices
    obs = _observed([_pod("u")], spec=spec, status=made, node=_node(**{MEM: "81920"}))
    assert "nvidia.com/gpu" in (_why(obs, "ns/u") or "")
    obs = _observed([_pod("u")], spec=spec, status=made, node=_node(**{GPU: "1", MEM: "81920"}))
    assert _why(obs, "ns/u") is None
    # A device another pod bound there holds is not free.
    other = _pod("x", gated=False, node="n0")
    obs = _observed([_pod("u"), other], spec=spec, status=made, node=_node(**{GPU: "1", MEM: "1"}))
    held = pinning.taken(obs)["n0"]
    assert held[gl.UNIFIED_RESOURCE] == 1
    assert _why(obs, "ns/u") is not None


def test_a_bound_unified_pod_keeps_its_reservation_until_allocated() -> None:
    bound = _pod("u", gated=False, node="n0")
    spec = [(0, "1g.10gb", "ns/u")]
    waiting = _observed([bound], spec=spec, status=[(0, "1g.10gb", S.RESERVED, None)], node=_node())
    assert "ns/u" in waiting.reservations and not waiting.stale
    done = _observed([bound], spec=spec, status=[(0, "1g.10gb", S.USED, "ns/u")], node=_node())
    assert "ns/u" not in done.reservations and done.stale == {"n0"}
    # Its instance stays out of the planner's hands either way.
    for obs in (waiting, done):
        (gpu,) = obs.snapshot.nodes[0].gpus
        assert all(i.used for i in gpu.instances)


def test_unified_pods_asking_alike_go_together_and_others_wait() -> None:
    spec = [(0, "1g.10gb", "ns/a"), (1, "1g.10gb", "ns/b"), (4, "3g.40gb", "ns/c")]
    status = [
        (0, "1g.10gb", S.RESERVED, None),
        (1, "1g.10gb", S.RESERVED, None),
        (4, "3g.40gb", S.RESERVED, None),
    ]
    pods = [_pod("a", gated=False), _pod("b"), _pod("c", 40000)]
    obs = _observed(pods, spec=spec, status=status, node=_node(**DEVICES))
    assert _allocating(obs) == {"ns/a"}  # let go, not yet allocated
    assert _why(obs, "ns/b") is None  # asks as a does
    why = _why(obs, "ns/c")
    assert why is not None and "ns/a" in why
    # Once a is allocated, b (let go first, in key order) holds c back in turn; without b, c
    # may go.
    status[0] = (0, "1g.10gb", S.USED, "ns/a")
    obs = _observed(pods, spec=spec, status=status, node=_node(**DEVICES))
    assert "ns/b" in (_why(obs, "ns/c") or "")
    del spec[1], status[1], pods[1]
    obs = _observed(pods, spec=spec, status=status, node=_node(**DEVICES))
    assert _why(obs, "ns/c") is None


def _mps_observed(
    pods: list[dict[str, Any]],
    slices: list[tuple[int, int, str, gl.InstanceState, str | None]],
    *,
    unserved: frozenset[int] = frozenset(),
) -> observing.Observed:
    """One mps node with one A100 (MIG off); slices are (id, GB, reserved for, state, used by),
    each reserved one kept for a unified pod."""
    node = _node(**DEVICES)
    node["metadata"]["labels"] = {"migpilot.io/mode": "mps"}
    layout = gl.GpuLayout(
        "n0",
        gl.LayoutSpec(
            (
                gl.GpuSpec(
                    0,
                    None,
                    (),
                    tuple(
                        gl.SliceSpec(i, gb, None, r, gl.UNIFIED_RESOURCE if r else None)
                        for i, gb, r, _, _ in slices
                    ),
                ),
            )
        ),
        gl.LayoutStatus(
            1,
            (
                gl.GpuStatus(
                    0,
                    A100,
                    "GPU-0",
                    (),
                    tuple(
                        gl.SliceStatus(i, gb, None, st, who)
                        for i, gb, _, st, who in slices
                        if i not in unserved
                    ),
                ),
            ),
        ),
    )
    return observing.observe(
        pods=[observing.pod_view(p) for p in pods],
        nodes=[observing.node_view(node)],
        layouts_by_node={"n0": layout},
    )


def test_on_an_mps_node_unified_pods_reserved_other_slice_sizes_wait_for_allocation() -> None:
    """The kubelet's Allocate names no pod: pods let go to one node must be interchangeable,
    and on an mps node that includes the size of the slice each was given."""
    slices = [
        (0, 8, "ns/a", S.RESERVED, None),
        (1, 8, "ns/b", S.RESERVED, None),
        (2, 20, "ns/c", S.RESERVED, None),
    ]
    pods = [_pod("a", gated=False), _pod("b"), _pod("c", 8000)]
    obs = _mps_observed(pods, slices)
    assert obs.reservations["ns/c"].slices == ((0, 2, 20),)
    assert _allocating(obs) == {"ns/a"}
    assert _why(obs, "ns/b") is None  # same ask, same slice size
    why = _why(obs, "ns/c")  # same ask, but a 20 GB slice
    assert why is not None and "ns/a" in why
    # Once the agent reports a's slice used by it, a is allocated; b, let go first, holds c
    # back in turn; without b, c may go.
    slices[0] = (0, 8, "ns/a", S.USED, "ns/a")
    obs = _mps_observed(pods, slices)
    assert "ns/b" in (_why(obs, "ns/c") or "")
    del slices[1], pods[1]
    obs = _mps_observed(pods, slices)
    assert _why(obs, "ns/c") is None


DEVICES = {GPU: "8", MEM: "819200"}
"""A node that advertises enough devices and memory for every pod of these tests."""


def _why(obs: observing.Observed, key: str) -> str | None:
    """What the loop's step says the reserved pod ``key`` waits for (``None``: let go now)."""
    return {k: w for k, _, w in control.lets_go(pinning.to_control(obs, changed=False))}[key]


def _allocating(obs: observing.Observed) -> set[str]:
    """The unified pods let go and not yet allocated, as the step reads them."""
    reserved = pinning.to_control(obs, changed=False).reserved.items()
    return {k for k, r in reserved if r.unified is not None and r.unified.allocating}


def test_a_pod_waits_for_its_slice_to_be_served_and_says_which() -> None:
    slices = [(0, 8, "ns/a", S.RESERVED, None), (1, 20, "ns/a", S.RESERVED, None)]
    obs = _mps_observed([_pod("a")], slices, unserved=frozenset({1}))
    assert _why(obs, "ns/a") == "MPS slice 1 (20 GB) of GPU 0 on n0 to be served"
    assert _why(_mps_observed([_pod("a")], slices), "ns/a") is None


def test_a_mig_pod_let_go_first_never_holds_a_unified_pod_back() -> None:
    spec = [(0, "1g.10gb", "ns/a-mig"), (1, "1g.10gb", "ns/b")]
    status = [(0, "1g.10gb", S.RESERVED, None), (1, "1g.10gb", S.RESERVED, None)]
    mig = _pod("a-mig")
    mig["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "1"}
    node = _node(**DEVICES, **{"nvidia.com/mig-1g.10gb": "1"})
    obs = _observed([mig, _pod("b")], spec=spec, status=status, node=node)
    assert _why(obs, "ns/a-mig") is None
    assert _why(obs, "ns/b") is None
