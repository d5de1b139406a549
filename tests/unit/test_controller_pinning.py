"""What the controller writes (controller/pinning.py): specs with reservations, when a reserved
pod may be let go, and the JSON patches that pin and ungate it (applied here with the in-memory
API's own patcher, to check that a pin only ever narrows the pod)."""

from __future__ import annotations

import copy
from collections import Counter
from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import observing, pinning
from migpilot.kube import errors as kube_errors
from migpilot.kube import memory as kubememory
from migpilot.mig import catalog, layouts
from migpilot.planning import control, modes, planners, plans, snapshot
from tests.unit import controller_sharing as sharing

A100 = "NVIDIA A100-SXM4-80GB"
A100_MODEL = catalog.resolve_gpu(A100)
GATE = observing.GATE
S = gl.InstanceState
HOST = {"key": "kubernetes.io/hostname", "operator": "In", "values": ["n0"]}
FIELD = {"key": "metadata.name", "operator": "In", "values": ["n0"]}
ZONE_A = {"key": "zone", "operator": "In", "values": ["a"]}
BASE = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"


# --------------------------------------------------------------------------- spec_for


def _snode(*gpus: int) -> snapshot.Node:
    return snapshot.Node(
        name="n0",
        labels=MappingProxyType({}),
        taints=(),
        unschedulable=False,
        allocatable=None,
        gpus=tuple(snapshot.Gpu(i, A100_MODEL, ()) for i in gpus),
    )


def _plan(
    targets: dict[int, list[tuple[int, str]]],
    placements: dict[str, list[tuple[int, int, str]]] | None = None,
    *,
    node: str = "n0",
) -> plans.Plan:
    return plans.Plan(
        planner="test",
        gpus=tuple(
            plans.GpuPlan(
                node, g, True, layouts.Layout.of(layouts.Instance(s, p) for s, p in insts)
            )
            for g, insts in sorted(targets.items())
        ),
        actions=(),
        placements=tuple(
            plans.Placement(pod, node, tuple(plans.AssignedInstance(g, p, s) for g, s, p in insts))
            for pod, insts in (placements or {}).items()
        ),
        unschedulable=(),
    )


def _reserved(spec: gl.LayoutSpec) -> dict[tuple[int, int, str], str | None]:
    return {(g.index, i.start, i.profile): i.reserved_for for g in spec.gpus for i in g.instances}


@pytest.mark.parametrize(
    ("targets", "placements", "kept", "want"),
    [
        pytest.param(
            {0: [(0, "3g.40gb"), (4, "3g.40gb")]},
            {"ns/q": [(0, 4, "3g.40gb")]},
            {(0, 0, "3g.40gb"): "ns/p"},
            {(0, 0, "3g.40gb"): "ns/p", (0, 4, "3g.40gb"): "ns/q"},
            id="kept-beside-new",
        ),
        pytest.param(
            {0: [(0, "7g.80gb")]},
            {},
            {(0, 0, "3g.40gb"): "ns/p"},
            {(0, 0, "7g.80gb"): None},
            id="kept-instance-gone-from-target",
        ),
        pytest.param(
            {0: [(0, "4g.40gb"), (4, "3g.40gb")]},
            {},
            {(0, 0, "3g.40gb"): "ns/p"},
            {(0, 0, "4g.40gb"): None, (0, 4, "3g.40gb"): None},
            id="same-start-other-profile",
        ),
        pytest.param(
            {0: [(0, "3g.40gb")], 1: [(0, "3g.40gb")]},
            {},
            {(1, 0, "3g.40gb"): "ns/p"},
            {(0, 0, "3g.40gb"): None, (1, 0, "3g.40gb"): "ns/p"},
            id="kept-on-its-own-gpu",
        ),
        pytest.param(
            {0: [(0, "3g.40gb")]},
            {"ns/q": [(0, 0, "3g.40gb")]},
            {(0, 0, "3g.40gb"): "ns/p"},
            {(0, 0, "3g.40gb"): "ns/q"},
            id="plan-wins",
        ),
        pytest.param({0: []}, {}, {}, {}, id="emptied"),
    ],
)
def test_spec_for_keeps_reservations_only_on_instances_still_in_the_target(
    targets: dict[int, list[tuple[int, str]]],
    placements: dict[str, list[tuple[int, int, str]]],
    kept: dict[tuple[int, int, str], str],
    want: dict[tuple[int, int, str], str | None],
) -> None:
    spec = pinning.spec_for(_snode(0, 1), _plan(targets, placements), kept=kept)
    assert _reserved(spec) == want
    assert [g.index for g in spec.gpus] == sorted(targets)
    assert all(g.model == A100_MODEL.id for g in spec.gpus)


def test_spec_for_leaves_out_other_nodes_gpus() -> None:
    other = _plan({0: [(0, "7g.80gb")]}, {"ns/x": [(0, 0, "7g.80gb")]}, node="n1")
    spec = pinning.spec_for(_snode(0), other, kept={(0, 0, "7g.80gb"): "ns/p"})
    assert spec == gl.LayoutSpec(())


def test_spec_for_reserves_what_the_plan_assigns() -> None:
    snap = snapshot.parse(
        {
            "version": 1,
            "nodes": [
                {"name": "n0", "gpus": [{"model": "a100-40gb", "instances": []}]},
                {"name": "n1", "gpus": [{"model": "a100-40gb", "instances": []}]},
            ],
            "pods": [
                {"name": "a", "requests": {"nvidia.com/mig-3g.20gb": 1}},
                {"name": "b", "requests": {"nvidia.com/mig-1g.5gb": 2}},
            ],
        }
    )
    plan = planners.run(snap, "fast")
    for node in snap.nodes:
        spec = pinning.spec_for(node, plan, kept={})
        targets = {(g.gpu, i.start): i.profile for g in plan.gpus if g.node == node.name
                   for i in g.layout.instances}  # fmt: skip
        assert {(g.index, i.start): i.profile for g in spec.gpus for i in g.instances} == targets
        assert all(g.model == "a100-40gb" for g in spec.gpus)
        reserved = {
            (g.index, i.start): i.reserved_for
            for g in spec.gpus
            for i in g.instances
            if i.reserved_for
        }
        want = {
            (a.gpu, a.start): p.pod for p in plan.placements if p.node == node.name
            for a in p.instances
        }  # fmt: skip
        assert reserved == want
    assert sorted(i for n in snap.nodes for g in pinning.spec_for(n, plan, kept={}).gpus
                  for i in (x.reserved_for for x in g.instances) if i) == [
        "default/a", "default/b", "default/b"]  # fmt: skip


def test_spec_for_writes_mps_slices_with_their_reservations() -> None:
    node = snapshot.Node(
        "mps-a",
        {},
        (),
        False,
        None,
        (snapshot.Gpu(0, catalog.resolve_gpu("a100-80gb"), ()),),
        mode=modes.Mode.MPS,
    )
    target = (modes.MpsSlice(0, 10, None, True), modes.MpsSlice(1, 20), modes.MpsSlice(2, 5))
    plan = plans.Plan(
        planner="fast",
        gpus=(),
        actions=(),
        placements=(plans.Placement("ns/new", "mps-a", (), (plans.AssignedShare(0, 1, 20),)),),
        unschedulable=(),
        mps=(plans.MpsGpuPlan("mps-a", 0, True, target),),
    )
    spec = pinning.spec_for(node, plan, kept={})
    (gpu,) = spec.gpus
    assert gpu.mps == (
        gl.SliceSpec(0, 10),
        gl.SliceSpec(1, 20, None, "ns/new"),
        gl.SliceSpec(2, 5),
    )
    bad = plans.Plan(
        planner="fast",
        gpus=(),
        actions=(),
        placements=(plans.Placement("ns/new", "mps-a", (), (plans.AssignedShare(0, 7, 20),)),),
        unschedulable=(),
        mps=(plans.MpsGpuPlan("mps-a", 0, True, target),),
    )
    with pytest.raises(errors.GpuLayoutError, match="slice 7 on GPU 0"):
        pinning.spec_for(node, bad, kept={})


def test_spec_for_refuses_one_instance_given_to_two_pods() -> None:
    plan = _plan({0: [(0, "3g.40gb")]}, {"ns/p": [(0, 0, "3g.40gb")], "ns/q": [(0, 0, "3g.40gb")]})
    with pytest.raises(errors.GpuLayoutError, match="given to both ns/p and ns/q"):
        pinning.spec_for(_snode(0), plan, kept={})


def test_spec_for_refuses_an_instance_its_target_layout_lacks() -> None:
    plan = _plan({0: [(0, "3g.40gb")]}, {"ns/p": [(0, 4, "3g.40gb")]})
    with pytest.raises(errors.GpuLayoutError, match="which its target layout does not hold"):
        pinning.spec_for(_snode(0), plan, kept={})


def test_spec_for_marks_kept_and_new_reservations_of_unified_pods_in_the_same_pass() -> None:
    plan = _plan({0: [(0, "3g.40gb"), (4, "3g.40gb")]}, {"ns/new": [(0, 4, "3g.40gb")]})
    spec = pinning.spec_for(
        _snode(0), plan, kept={(0, 0, "3g.40gb"): "ns/old"}, unified=frozenset({"ns/old"})
    )
    assert spec.gpus[0].instances == (
        gl.InstanceSpec("3g.40gb", 0, "ns/old", gl.UNIFIED_RESOURCE),
        gl.InstanceSpec("3g.40gb", 4, "ns/new", None),
    )


def test_spec_for_marks_a_slice_reserved_for_a_unified_pod() -> None:
    node = snapshot.Node(
        "mps-a", {}, (), False, None, (snapshot.Gpu(0, A100_MODEL, ()),), mode=modes.Mode.MPS
    )
    target = (modes.MpsSlice(0, 10, None, False, "ns/old"), modes.MpsSlice(1, 20))
    plan = plans.Plan(
        planner="fast",
        gpus=(),
        actions=(),
        placements=(plans.Placement("ns/new", "mps-a", (), (plans.AssignedShare(0, 1, 20),)),),
        unschedulable=(),
        mps=(plans.MpsGpuPlan("mps-a", 0, True, target),),
    )
    spec = pinning.spec_for(node, plan, kept={}, unified=frozenset({"ns/old", "ns/new"}))
    assert spec.gpus[0].mps == (
        gl.SliceSpec(0, 10, None, "ns/old", gl.UNIFIED_RESOURCE),
        gl.SliceSpec(1, 20, None, "ns/new", gl.UNIFIED_RESOURCE),
    )
    spec = pinning.spec_for(node, plan, kept={}, unified=frozenset({"ns/new"}))
    assert [sl.resource for sl in spec.gpus[0].mps] == [None, gl.UNIFIED_RESOURCE]


# --------------------------------------------------------------------------- without_stale


SPEC = gl.LayoutSpec(
    (
        gl.GpuSpec(
            0,
            "a100-80gb",
            (gl.InstanceSpec("3g.40gb", 0, "ns/a"), gl.InstanceSpec("3g.40gb", 4, "ns/b")),
        ),
        gl.GpuSpec(1, None, (gl.InstanceSpec("7g.80gb", 0, None),)),
    )
)


@pytest.mark.parametrize(
    ("live", "want"),
    [
        (frozenset({"ns/a", "ns/b"}), {"ns/a", "ns/b"}),
        (frozenset({"ns/a"}), {"ns/a"}),
        (frozenset({"ns/b", "ns/zzz"}), {"ns/b"}),
        (frozenset(), set()),
    ],
)
def test_without_stale_keeps_the_live_reservations_and_every_instance(
    live: frozenset[str], want: set[str]
) -> None:
    got = pinning.without_stale(SPEC, live=live)
    assert {r for r in _reserved(got).values() if r} == want
    assert set(_reserved(got)) == set(_reserved(SPEC))
    assert [(g.index, g.model) for g in got.gpus] == [(0, "a100-80gb"), (1, None)]
    if want == {"ns/a", "ns/b"}:
        assert got == SPEC


def test_without_stale_keeps_live_replicas_and_whole_gpus_and_each_gpu_s_mode() -> None:
    """A time-slicing replica or a whole GPU kept for a live pod stays reserved for it; a gone
    pod's is released (the replica dropped, the whole GPU left whole, ``mig: false``)."""
    spec = gl.LayoutSpec(
        (
            gl.GpuSpec(
                0, None, (), replicas=(gl.ReplicaSpec(1, "ns/a"), gl.ReplicaSpec(2, "ns/gone"))
            ),
            gl.GpuSpec(1, None, (), mig=False, reserved_for="ns/a"),
            gl.GpuSpec(2, None, (), mig=False, reserved_for="ns/gone"),
        )
    )
    got = pinning.without_stale(spec, live=frozenset({"ns/a"}))
    assert got.gpus[0].replicas == (gl.ReplicaSpec(1, "ns/a"),)
    assert [(g.mig, g.reserved_for) for g in got.gpus[1:]] == [(False, "ns/a"), (False, None)]


# --------------------------------------------------------------------------- ready, waiting_for


def _pod(
    name: str,
    *,
    mig: dict[str, int] | None = None,
    gated: bool = True,
    node: str | None = None,
) -> dict[str, Any]:
    limits = {f"nvidia.com/mig-{p}": str(n) for p, n in (mig or {"1g.10gb": 1}).items()}
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": limits}}]}
    if gated:
        spec["schedulingGates"] = [{"name": GATE}]
    if node:
        spec["nodeName"] = node
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"}, "spec": spec}


def _node(*, ready: bool = True, **allocatable: int) -> dict[str, Any]:
    return {
        "metadata": {
            "name": "n0",
            "labels": {"kubernetes.io/hostname": "n0", "nvidia.com/mig.capable": "true"},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": str(ready)}],
            "allocatable": {
                f"nvidia.com/mig-{p.replace('_', '.')}": str(n) for p, n in allocatable.items()
            },
        },
    }


def _observed(
    pods: list[dict[str, Any]],
    *,
    spec: list[tuple[int, str, str | None]],
    status: list[tuple[int, str, gl.InstanceState, bool]] | None,
    node: dict[str, Any] | None,
) -> observing.Observed:
    """One node, one GPU; status entries are (start, profile, state, has a UUID)."""
    lay_status = None
    if status is not None:
        lay_status = gl.LayoutStatus(
            1,
            (
                gl.GpuStatus(
                    0,
                    A100,
                    "GPU-0",
                    tuple(
                        gl.InstanceStatus(p, s, f"MIG-{s}" if uuid else None, state)
                        for s, p, state, uuid in status
                    ),
                ),
            ),
        )
    layout = gl.GpuLayout(
        "n0",
        gl.LayoutSpec((gl.GpuSpec(0, None, tuple(gl.InstanceSpec(p, s, r) for s, p, r in spec)),)),
        lay_status,
    )
    return observing.observe(
        pods=[observing.pod_view(p) for p in pods],
        nodes=[observing.node_view(node)] if node else [],
        layouts_by_node={"n0": layout},
    )


MADE = (0, "1g.10gb", S.RESERVED, True)


@pytest.mark.parametrize(
    ("pods", "spec", "status", "node", "why"),
    [
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [MADE], _node(**{"1g_10gb": 1}), None, id="ready"
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", None)], [MADE], _node(**{"1g_10gb": 1}),
            "no reservation", id="no-reservation",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [MADE], _node(ready=False, **{"1g_10gb": 1}),
            "node n0 to be Ready and reported", id="node-not-ready",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [MADE], None,
            "node n0 to be Ready and reported", id="node-gone",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], None, _node(**{"1g_10gb": 1}),
            "node n0 to be Ready and reported", id="not-reported",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [], _node(**{"1g_10gb": 1}),
            "1g.10gb at GPU 0 start 0 on n0 to be created", id="not-made",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [(0, "1g.10gb", S.CREATING, False)],
            _node(**{"1g_10gb": 1}), "1g.10gb at GPU 0 start 0 on n0 to be created", id="creating",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [(0, "1g.10gb", S.RESERVED, False)],
            _node(**{"1g_10gb": 1}), "1g.10gb at GPU 0 start 0 on n0 to be created", id="no-uuid",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [(0, "1g.10gb", S.DESTROYING, True)],
            _node(**{"1g_10gb": 1}), "1g.10gb at GPU 0 start 0 on n0 to be created",
            id="destroying",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [(0, "1g.10gb", S.FREE, True)],
            _node(**{"1g_10gb": 1}), None, id="made-reported-free",
        ),
        pytest.param(
            [_pod("p", mig={"1g.10gb": 2})],
            [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", "ns/p")],
            [MADE],
            _node(**{"1g_10gb": 2}),
            "1g.10gb at GPU 0 start 1 on n0 to be created",
            id="one-of-two-made",
        ),
        pytest.param(
            [_pod("p")], [(0, "1g.10gb", "ns/p")], [MADE], _node(),
            "node n0 to advertise nvidia.com/mig-1g.10gb (allocatable 0, taken 0)",
            id="not-advertised",
        ),
        pytest.param(
            [_pod("p"), _pod("b", gated=False, node="n0")],
            [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", None)],
            [MADE, (1, "1g.10gb", S.USED, True)],
            _node(**{"1g_10gb": 1}),
            "node n0 to advertise nvidia.com/mig-1g.10gb (allocatable 1, taken 1)",
            id="advertised-one-held-by-a-bound-pod",
        ),
        pytest.param(
            [_pod("p"), _pod("b", gated=False, node="n0")],
            [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", None)],
            [MADE, (1, "1g.10gb", S.USED, True)],
            _node(**{"1g_10gb": 2}),
            None,
            id="advertised-two-one-held",
        ),
        pytest.param(
            [_pod("p"), _pod("q", gated=False)],
            [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", "ns/q")],
            [MADE, (1, "1g.10gb", S.RESERVED, True)],
            _node(**{"1g_10gb": 1}),
            "node n0 to advertise nvidia.com/mig-1g.10gb (allocatable 1, taken 1)",
            id="another-let-go-takes-it",
        ),
        pytest.param(
            [_pod("p"), _pod("q")],
            [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", "ns/q")],
            [MADE, (1, "1g.10gb", S.RESERVED, True)],
            _node(**{"1g_10gb": 1}),
            None,
            id="another-still-gated-does-not",
        ),
    ],
)  # fmt: skip
def test_waiting_for_and_ready(
    pods: list[dict[str, Any]],
    spec: list[tuple[int, str, str | None]],
    status: list[tuple[int, str, gl.InstanceState, bool]] | None,
    node: dict[str, Any] | None,
    why: str | None,
) -> None:
    obs = _observed(pods, spec=spec, status=status, node=node)
    assert _why(obs, "ns/p") == why


def test_made_says_whether_every_reserved_instance_exists() -> None:
    spec = [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", "ns/p")]
    node = _node()
    obs = _observed([_pod("p", mig={"1g.10gb": 2})], spec=spec, status=[MADE], node=node)
    assert not pinning.made(obs, "ns/p")
    both = [MADE, (1, "1g.10gb", S.RESERVED, True)]
    obs = _observed([_pod("p", mig={"1g.10gb": 2})], spec=spec, status=both, node=node)
    assert pinning.made(obs, "ns/p")
    assert not pinning.made(obs, "ns/nobody")
    obs = _observed([_pod("p", mig={"1g.10gb": 2})], spec=spec, status=None, node=node)
    assert not pinning.made(obs, "ns/p")


@pytest.mark.parametrize(
    ("status", "stolen"),
    [
        pytest.param([(6, "1g.20gb", S.USED, True)], True, id="a-used-instance-where-it-goes"),
        pytest.param([(0, "7g.80gb", S.USED, True)], True, id="a-used-wider-one-over-it"),
        pytest.param([(4, "1g.20gb", S.USED, True)], False, id="a-used-one-beside-it"),
        pytest.param([(6, "1g.20gb", S.FREE, True)], False, id="a-free-one-the-agent-destroys"),
        pytest.param([(6, "1g.10gb", S.RESERVED, True)], False, id="made"),
    ],
)  # fmt: skip
def test_a_reservation_that_cannot_be_made_while_another_pod_lives_is_stolen(
    status: list[tuple[int, str, gl.InstanceState, bool]], stolen: bool
) -> None:
    """soak35c, p02205: the plan reshaped a 1g.20gb it saw free, a pod bound to the node got
    it from the kubelet meanwhile, and the agent reported "1g.20gb@6 is in use; desired
    1g.10gb@6 not created" for 8 minutes while the reservation waited for it (ten timeouts
    for an instance never made). Dropped at once instead, the pod is planned again."""
    obs = _observed(
        [_pod("p")], spec=[(6, "1g.10gb", "ns/p")], status=status, node=_node(**{"1g_10gb": 1})
    )
    assert pinning.stolen(obs, "ns/p") is stolen


SHARED = {"nvidia.com/gpu": "2", "nvidia.com/gpumem": "40960", "nvidia.com/gpucores": "100"}


def _replicas(*status: tuple[int, str]) -> observing.Observed:
    """A time-slicing node t0 whose spec keeps replica 1 of GPU 0 for the gated unified pod
    ns/u; ``status`` lists the replicas the agent reports, as (id, the pod using it or
    ``"free"``)."""
    reported = [
        {"id": i, "state": "free"} if by == "free" else {"id": i, "state": "used", "usedBy": by}
        for i, by in status
    ]
    doc = {
        "apiVersion": gl.API_VERSION,
        "kind": gl.KIND,
        "metadata": {"name": "t0"},
        "spec": {
            "gpus": [{"index": 0, "instances": [], "replicas": [{"id": 1, "reservedFor": "ns/u"}]}]
        },
        "status": {
            "gpus": [
                {
                    "index": 0,
                    "model": "NVIDIA A100-SXM4-40GB",
                    "uuid": "GPU-0",
                    "instances": [],
                    **({"replicas": reported} if reported else {}),
                }
            ]
        },
    }
    unified = sharing.pod("u", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"})
    return observing.observe(
        pods=[observing.pod_view(unified)],
        nodes=[observing.node_view(sharing.node("t0", mode="time-slicing", **SHARED))],
        layouts_by_node={"t0": wire.parse(doc)},
    )


@pytest.mark.parametrize(
    ("status", "made", "why", "stolen"),
    [
        pytest.param(
            [(0, "free")], False, "time-slicing replica 1 of GPU 0 on t0 to be advertised", False,
            id="not-advertised",
        ),
        pytest.param([(0, "free"), (1, "free")], True, None, False, id="advertised-free"),
        pytest.param(
            [(0, "ns/other"), (1, "free")], True, None, False, id="another-replica-used"
        ),
        pytest.param([(0, "free"), (1, "ns/other")], True, None, True, id="taken-by-another"),
        pytest.param([(0, "free"), (1, "ns/u")], True, None, False, id="used-by-the-pod"),
    ],
)  # fmt: skip
def test_a_reserved_replica_is_made_once_advertised_and_stolen_once_another_pod_uses_it(
    status: list[tuple[int, str]], made: bool, why: str | None, stolen: bool
) -> None:
    obs = _replicas(*status)
    assert obs.reservations["ns/u"].replicas == ((0, 1),)
    assert pinning.made(obs, "ns/u") is made
    assert pinning.missing(obs, "ns/u") == why
    assert pinning.stolen(obs, "ns/u") is stolen


def test_taken_counts_bound_pods_and_reserved_pods_let_go() -> None:
    pods = [
        _pod("bound", mig={"1g.10gb": 2, "2g.20gb": 1}, gated=False, node="n0"),
        _pod("gone", gated=False, node="n0"),
        _pod("let-go", mig={"1g.10gb": 1}, gated=False),
        _pod("gated", mig={"1g.10gb": 1}),
    ]
    pods[1]["status"] = {"phase": "Succeeded"}
    spec = [(0, "2g.20gb", None), (2, "1g.10gb", "ns/let-go"), (3, "1g.10gb", "ns/gated")]
    obs = _observed(pods, spec=spec, status=[], node=_node())
    assert pinning.taken(obs) == {
        "n0": Counter({"nvidia.com/mig-1g.10gb": 3, "nvidia.com/mig-2g.20gb": 1})
    }


def test_each_pod_let_go_counts_for_the_ones_after_it() -> None:
    pods = [_pod("p"), _pod("q")]
    spec = [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", "ns/q")]
    status = [MADE, (1, "1g.10gb", S.RESERVED, True)]
    obs = _observed(pods, spec=spec, status=status, node=_node(**{"1g_10gb": 1}))
    assert _why(obs, "ns/p") is None
    assert _why(obs, "ns/q") == (
        "node n0 to advertise nvidia.com/mig-1g.10gb (allocatable 1, taken 1)"
    )


def test_a_node_that_no_longer_admits_a_gated_pod_holds_it_back() -> None:
    """Cordoned, or tainted by a node autoscaler removing it: the reserved pod is not let go
    there (its reservation then times out); a pod already let go is kube-scheduler's."""
    pods = [_pod("p"), _pod("q", gated=False)]
    spec = [(0, "1g.10gb", "ns/p"), (1, "1g.10gb", "ns/q")]
    status = [MADE, (1, "1g.10gb", S.RESERVED, True)]
    node = _node(**{"1g_10gb": 2})
    assert _why(_observed(pods, spec=spec, status=status, node=node), "ns/p") is None
    tainted = copy.deepcopy(node)
    tainted["spec"] = {"taints": [{"key": "karpenter.sh/disrupted", "effect": "NoSchedule"}]}
    obs = _observed(pods, spec=spec, status=status, node=tainted)
    why = "taint karpenter.sh/disrupted=:NoSchedule is not tolerated"
    assert _why(obs, "ns/p") == f"node n0 to admit it again ({why})"
    reserved = pinning.to_control(obs, changed=False).reserved
    assert reserved["ns/p"].turned_away == why and reserved["ns/q"].turned_away is None
    cordoned = copy.deepcopy(node)
    cordoned["spec"] = {"unschedulable": True}
    obs = _observed(pods, spec=spec, status=status, node=cordoned)
    assert _why(obs, "ns/p") == "node n0 to admit it again (node is cordoned (unschedulable))"
    soft = copy.deepcopy(node)
    soft["spec"] = {"taints": [{"key": "x", "effect": "PreferNoSchedule"}]}
    assert _why(_observed(pods, spec=spec, status=status, node=soft), "ns/p") is None


def _why(obs: observing.Observed, key: str) -> str | None:
    """What the loop's step says the reserved pod ``key`` waits for (``None``: let go now)."""
    listed = {k: why for k, _, why in control.lets_go(pinning.to_control(obs, changed=False))}
    if key not in obs.reservations:
        assert key not in listed
        return "no reservation"
    return listed[key]


# --------------------------------------------------------------------------- pin_patch


def _gated(*, gates: list[str] | None = None, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/mig-1g.10gb": "1"}}}],
        **spec,
    }
    if gates is None:
        gates = [GATE]
    if gates:
        body["schedulingGates"] = [{"name": g} for g in gates]
    return {
        "metadata": {"name": "p", "namespace": "ns", "resourceVersion": "7"},
        "spec": body,
        "status": {"phase": "Pending"},
    }


def _node_view(*, hostname: bool = True) -> observing.NodeView:
    labels = {"kubernetes.io/hostname": "n0"} if hostname else {}
    return observing.node_view({"metadata": {"name": "n0", "labels": labels}})


def _required(pod: dict[str, Any]) -> list[dict[str, Any]]:
    terms: list[dict[str, Any]] = pod["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]["nodeSelectorTerms"]
    return terms


def _terms_of(pod: dict[str, Any]) -> list[dict[str, Any]]:
    try:
        return _required(pod)
    except (KeyError, TypeError):
        return []


def _assert_narrows(
    before: dict[str, Any], after: dict[str, Any], requirement: dict[str, Any]
) -> None:
    """``after`` is ``before`` with only our gate gone and each required term narrowed by
    ``requirement`` (one term of it when there were none)."""
    kind = "matchExpressions" if requirement["key"] != "metadata.name" else "matchFields"
    old_terms, new_terms = _terms_of(before), _required(after)
    if not old_terms:
        assert new_terms == [{kind: [requirement]}]
    else:
        assert len(new_terms) == len(old_terms)
        for old, new in zip(old_terms, new_terms, strict=True):
            had = old.get(kind, [])
            assert new[kind] == (had if requirement in had else [*had, requirement])
            assert {k: v for k, v in new.items() if k != kind} == {
                k: v for k, v in old.items() if k != kind
            }
    gates = [g["name"] for g in before["spec"].get("schedulingGates", [])]
    left = [g["name"] for g in after["spec"].get("schedulingGates", [])]
    assert left == [g for g in gates if g != GATE]
    if not left:
        assert "schedulingGates" not in after["spec"]
    # Nothing else changed.
    strip = copy.deepcopy(after)
    strip_before = copy.deepcopy(before)
    for doc in (strip, strip_before):
        doc["spec"].pop("schedulingGates", None)
        aff = doc["spec"].get("affinity")
        if isinstance(aff, dict):
            na = aff.get("nodeAffinity")
            if isinstance(na, dict):
                na.pop("requiredDuringSchedulingIgnoredDuringExecution", None)
                if not na:
                    aff.pop("nodeAffinity")
            if not aff:
                doc["spec"].pop("affinity")
    assert strip == strip_before


PREFERRED = {
    "preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 1, "preference": {"matchExpressions": [{"key": "z", "operator": "Exists"}]}}
    ]
}
POD_AFFINITY = {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}}


@pytest.mark.parametrize(
    ("pod", "ops"),
    [
        pytest.param(
            _gated(),
            [
                {
                    "op": "add",
                    "path": "/spec/affinity",
                    "value": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchFields": [FIELD]}]
                            }
                        }
                    },
                },
                {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE},
                {"op": "remove", "path": "/spec/schedulingGates"},
            ],
            id="no-affinity",
        ),
        pytest.param(
            _gated(affinity=POD_AFFINITY),
            [
                {
                    "op": "add",
                    "path": "/spec/affinity/nodeAffinity",
                    "value": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchFields": [FIELD]}]
                        }
                    },
                },
                {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE},
                {"op": "remove", "path": "/spec/schedulingGates"},
            ],
            id="affinity-without-node-affinity",
        ),
        pytest.param(
            _gated(affinity={"nodeAffinity": PREFERRED}),
            [
                {
                    "op": "add",
                    "path": BASE,
                    "value": {"nodeSelectorTerms": [{"matchFields": [FIELD]}]},
                },
                {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE},
                {"op": "remove", "path": "/spec/schedulingGates"},
            ],
            id="node-affinity-without-required",
        ),
        pytest.param(
            _gated(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [ZONE_A]},
                                {"matchFields": [FIELD]},
                            ]
                        }
                    }
                }
            ),
            [
                # The second term names the node already: it is left as it is.
                {
                    "op": "add",
                    "path": f"{BASE}/nodeSelectorTerms/0/matchFields",
                    "value": [FIELD],
                },
                {"op": "test", "path": "/spec/schedulingGates/0/name", "value": GATE},
                {"op": "remove", "path": "/spec/schedulingGates"},
            ],
            id="terms-with-and-without-expressions",
        ),
        pytest.param(
            _gated(gates=["a.io/x", GATE, "b.io/y"]),
            [
                {
                    "op": "add",
                    "path": "/spec/affinity",
                    "value": {
                        "nodeAffinity": {
                            "requiredDuringSchedulingIgnoredDuringExecution": {
                                "nodeSelectorTerms": [{"matchFields": [FIELD]}]
                            }
                        }
                    },
                },
                {"op": "test", "path": "/spec/schedulingGates/1/name", "value": GATE},
                {"op": "remove", "path": "/spec/schedulingGates/1"},
            ],
            id="other-gates-kept",
        ),
        pytest.param(_gated(gates=[]), [], id="no-gate"),
        pytest.param(_gated(gates=["a.io/x"]), [], id="only-another-gate"),
    ],
)
def test_pin_patch(pod: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    patch = pinning.pin_patch(pod, _node_view())
    assert patch == ops
    after = kubememory.apply_json_patch(pod, patch)
    if ops:
        _assert_narrows(pod, after, FIELD)
    else:
        assert after == pod


def test_pin_patch_names_the_node_by_field_with_or_without_a_hostname_label() -> None:
    pod = _gated(
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "zone", "operator": "Exists"}]},
                        {
                            "matchFields": [
                                {"key": "metadata.name", "operator": "NotIn", "values": ["x"]}
                            ]
                        },
                    ]
                }
            }
        }
    )
    patch = pinning.pin_patch(pod, _node_view(hostname=False))
    assert patch[:2] == [
        {"op": "add", "path": f"{BASE}/nodeSelectorTerms/0/matchFields", "value": [FIELD]},
        {"op": "add", "path": f"{BASE}/nodeSelectorTerms/1/matchFields/-", "value": FIELD},
    ]
    _assert_narrows(pod, kubememory.apply_json_patch(pod, patch), FIELD)
    bare = pinning.pin_patch(_gated(), _node_view(hostname=False))
    assert bare[0]["value"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == {
        "nodeSelectorTerms": [{"matchFields": [FIELD]}]
    }


def test_pin_patch_does_not_repeat_a_requirement_a_term_has() -> None:
    pod = _gated(
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchFields": [FIELD]},
                        {
                            "matchExpressions": [HOST],
                            "matchFields": [
                                {"key": "metadata.name", "operator": "NotIn", "values": ["x"]}
                            ],
                        },
                    ]
                }
            }
        }
    )
    patch = pinning.pin_patch(pod, _node_view())
    assert [op["path"] for op in patch if op["op"] == "add"] == [
        f"{BASE}/nodeSelectorTerms/1/matchFields/-"
    ]
    after = kubememory.apply_json_patch(pod, patch)
    assert _required(after)[0] == {"matchFields": [FIELD]}


def test_a_pin_computed_from_an_old_pod_fails_on_a_changed_one() -> None:
    pod = _gated(gates=["a.io/x", GATE])
    patch = pinning.pin_patch(pod, _node_view())
    moved = _gated(gates=[GATE])  # the other gate went meanwhile: index 1 is no longer ours
    with pytest.raises(kube_errors.KubeApiError):
        kubememory.apply_json_patch(moved, patch)


_REQ = st.fixed_dictionaries(
    {
        "key": st.sampled_from(["zone", "pool", "kubernetes.io/hostname"]),
        "operator": st.sampled_from(["In", "NotIn"]),
        "values": st.lists(st.sampled_from(["a", "b", "n0"]), min_size=1, max_size=2),
    }
)
_TERM = st.fixed_dictionaries(
    {},
    optional={
        "matchExpressions": st.lists(st.one_of(_REQ, st.just(HOST)), max_size=3),
        "matchFields": st.lists(st.just(FIELD), max_size=1),
    },
)
_AFFINITY = st.one_of(
    st.none(),
    st.just(POD_AFFINITY),
    st.just({"nodeAffinity": PREFERRED}),
    st.lists(_TERM, min_size=1, max_size=3).map(
        lambda terms: {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms},
                **PREFERRED,
            }
        }
    ),
)


@given(
    affinity=_AFFINITY,
    others=st.lists(st.sampled_from(["a.io/x", "b.io/y", "c.io/z"]), unique=True, max_size=3),
    at=st.integers(min_value=0, max_value=3),
    hostname=st.booleans(),
)
def test_a_pin_only_narrows_the_pod_and_removes_only_our_gate(
    affinity: dict[str, Any] | None, others: list[str], at: int, hostname: bool
) -> None:
    gates = [*others]
    gates.insert(min(at, len(gates)), GATE)
    pod = _gated(gates=gates, **({"affinity": affinity} if affinity is not None else {}))
    patch = pinning.pin_patch(pod, _node_view(hostname=hostname))
    after = kubememory.apply_json_patch(pod, patch)
    _assert_narrows(pod, after, FIELD)
    # Pinned once: a second pin finds no gate and changes nothing.
    assert pinning.pin_patch(after, _node_view(hostname=hostname)) == []


# --------------------------------------------------------------------------- ungate_patch


@pytest.mark.parametrize(
    ("gates", "left"),
    [
        ([GATE], None),
        (["a.io/x", GATE], ["a.io/x"]),
        ([GATE, "a.io/x"], ["a.io/x"]),
        (["a.io/x"], ["a.io/x"]),
        ([], None),
    ],
)
def test_ungate_patch_removes_only_our_gate(gates: list[str], left: list[str] | None) -> None:
    pod = _gated(gates=gates)
    after = kubememory.apply_json_patch(pod, pinning.ungate_patch(pod))
    if left is None:
        assert "schedulingGates" not in after["spec"]
    else:
        assert [g["name"] for g in after["spec"]["schedulingGates"]] == left
    assert "affinity" not in after["spec"]


def test_ungate_patch_of_a_pod_without_spec_is_empty() -> None:
    assert pinning.ungate_patch({"metadata": {"name": "p"}}) == []


# --------------------------------------------------------------------------- apply_json_patch


def test_apply_json_patch_works_on_a_copy() -> None:
    doc = {"a": {"b": [1, 2]}}
    out = kubememory.apply_json_patch(doc, [{"op": "add", "path": "/a/b/-", "value": 3}])
    assert out == {"a": {"b": [1, 2, 3]}} and doc == {"a": {"b": [1, 2]}}


@pytest.mark.parametrize(
    ("patch", "want"),
    [
        ([{"op": "add", "path": "/a/b/0", "value": 0}], {"a": {"b": [0, 1, 2]}, "c~/": 1}),
        ([{"op": "replace", "path": "/a/b/1", "value": 9}], {"a": {"b": [1, 9]}, "c~/": 1}),
        ([{"op": "remove", "path": "/a/b/0"}], {"a": {"b": [2]}, "c~/": 1}),
        ([{"op": "remove", "path": "/c~0~1"}], {"a": {"b": [1, 2]}}),
        ([{"op": "test", "path": "/a/b/1", "value": 2}], {"a": {"b": [1, 2]}, "c~/": 1}),
    ],
)
def test_apply_json_patch_ops(patch: list[dict[str, Any]], want: dict[str, Any]) -> None:
    assert kubememory.apply_json_patch({"a": {"b": [1, 2]}, "c~/": 1}, patch) == want


@pytest.mark.parametrize(
    "patch",
    [
        [{"op": "test", "path": "/a/b/0", "value": 5}],
        [{"op": "remove", "path": "/a/x"}],
        [{"op": "add", "path": "/x/y", "value": 1}],
        [{"op": "remove", "path": "/a/b/7"}],
        [{"op": "replace", "path": "/a/x", "value": 1}],
        [{"op": "replace", "path": "/a/b/2", "value": 1}],
        [{"op": "move", "from": "/a", "path": "/z"}],
        [{"op": "add", "path": "/a/c", "value": 1}, {"op": "test", "path": "/a/b/0", "value": 9}],
    ],
)
def test_apply_json_patch_refuses_as_the_server_would(patch: list[dict[str, Any]]) -> None:
    doc = {"a": {"b": [1, 2]}}
    with pytest.raises(kube_errors.KubeApiError):
        kubememory.apply_json_patch(doc, patch)
    assert doc == {"a": {"b": [1, 2]}}


def _mps_plan(target: tuple[modes.MpsSlice, ...]) -> tuple[snapshot.Node, plans.Plan]:
    node = snapshot.Node(
        "mps-a", {}, (), False, None, (snapshot.Gpu(0, A100_MODEL, ()),), mode=modes.Mode.MPS
    )
    plan = plans.Plan(
        planner="fast",
        gpus=(),
        actions=(),
        placements=(),
        unschedulable=(),
        mps=(plans.MpsGpuPlan("mps-a", 0, True, target),),
    )
    return node, plan


def test_spec_for_leaves_out_held_slices_a_spec_over_the_gpu_would_list() -> None:
    """Target slices over the GPU (a pod holds a slice the spec had dropped): the spec leaves
    out the held unreserved slices, largest first (the agent keeps serving them), then free
    ones, and parses; reserved ones are kept."""
    target = (
        modes.MpsSlice(0, 40, None, True),
        modes.MpsSlice(1, 20, None, False, "ns/r"),
        modes.MpsSlice(4, 30, None, True),
        modes.MpsSlice(5, 10),
    )
    node, plan = _mps_plan(target)
    spec = pinning.spec_for(node, plan, kept={})
    assert [(s.id, s.memory_gb, s.reserved_for) for s in spec.gpus[0].mps] == [
        (1, 20, "ns/r"),
        (4, 30, None),
        (5, 10, None),
    ]
    wire.parse(wire.spec_patch("mps-a", spec))
    node, plan = _mps_plan((modes.MpsSlice(0, 50, None, False, "ns/a"),
                            modes.MpsSlice(1, 40, None, False, "ns/b")))  # fmt: skip
    with pytest.raises(errors.GpuLayoutError, match="reserved on GPU 0 of mps-a take 90 GB"):
        pinning.spec_for(node, plan, kept={})
