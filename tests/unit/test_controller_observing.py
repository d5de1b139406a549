"""What the controller sees (controller/observing.py): pods, nodes and GpuLayouts read into the
planner's snapshot, the live and stale reservations, and the pods bound to each node."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.api import gpulayouts as gl
from migpilot.controller import observing
from migpilot.mig import catalog, layouts
from migpilot.planning import snapshot

A100 = "NVIDIA A100-SXM4-80GB"
A100_MODEL = catalog.resolve_gpu(A100)
GI = 1 << 30
GATE = observing.GATE
S = gl.InstanceState


# --------------------------------------------------------------------------- builders


def _container(name: str = "c", **resources: Any) -> dict[str, Any]:
    """A container; ``requests=``/``limits=`` as dicts."""
    return {"name": name, "resources": dict(resources)}


def _mig(profile: str, n: int = 1) -> dict[str, Any]:
    return _container(limits={f"nvidia.com/mig-{profile}": str(n)})


def _pod(
    name: str = "p",
    *,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    overhead: dict[str, Any] | None = None,
    gates: tuple[str, ...] = (GATE,),
    node: str | None = None,
    phase: str = "Pending",
    deleting: bool = False,
    conditions: list[dict[str, Any]] | None = None,
    created: str = "2026-01-01T00:00:00Z",
    namespace: str = "ns",
    **spec_extra: Any,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": containers if containers is not None else [_mig("1g.10gb")]
    }
    if init is not None:
        spec["initContainers"] = init
    if overhead is not None:
        spec["overhead"] = overhead
    if gates:
        spec["schedulingGates"] = [{"name": g} for g in gates]
    if node is not None:
        spec["nodeName"] = node
    spec.update(spec_extra)
    meta: dict[str, Any] = {
        "name": name,
        "namespace": namespace,
        "uid": f"uid-{name}",
        "creationTimestamp": created,
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:01:00Z"
    status: dict[str, Any] = {"phase": phase}
    if conditions is not None:
        status["conditions"] = conditions
    return {"metadata": meta, "spec": spec, "status": status}


def _node(
    name: str = "n0",
    *,
    ready: bool = True,
    static: bool = False,
    capable: bool = True,
    cpu: str | None = "32",
    memory: str | None = "256Gi",
    taints: list[dict[str, Any]] | None = None,
    **allocatable: str,
) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name}
    if capable:
        labels["nvidia.com/mig.capable"] = "true"
    if static:
        labels[observing.STATIC_LABEL] = "all-1g.10gb"
    alloc = dict(allocatable)
    if cpu is not None:
        alloc["cpu"] = cpu
    if memory is not None:
        alloc["memory"] = memory
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "labels": labels},
        "spec": {"taints": taints or []},
        "status": {
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            "allocatable": alloc,
        },
    }


Spec = dict[int, list[tuple[int, str, str | None]]]
"""GPU index -> (start, profile, reservedFor)."""
Status = dict[int, list[tuple[int, str, gl.InstanceState]]]
"""GPU index -> (start, profile, state)."""


def _layout(
    name: str = "n0", *, spec: Spec | None = None, status: Status | None = None
) -> gl.GpuLayout:
    spec_gpus = tuple(
        gl.GpuSpec(i, None, tuple(gl.InstanceSpec(p, s, r) for s, p, r in insts))
        for i, insts in sorted((spec or {}).items())
    )
    layout_status = None
    if status is not None:
        layout_status = gl.LayoutStatus(
            1,
            tuple(
                gl.GpuStatus(
                    i,
                    A100,
                    f"GPU-{i}",
                    tuple(
                        gl.InstanceStatus(p, s, None if st_ is S.CREATING else f"MIG-{i}-{s}", st_)
                        for s, p, st_ in insts
                    ),
                )
                for i, insts in sorted(status.items())
            ),
        )
    return gl.GpuLayout(name, gl.LayoutSpec(spec_gpus), layout_status)


def _gpus(gpus: tuple[snapshot.Gpu, ...]) -> dict[int, set[tuple[int, str, bool]]]:
    return {g.index: {(i.start, i.profile, i.used) for i in g.instances} for g in gpus}


def _observe(
    pods: list[dict[str, Any]],
    nodes: list[dict[str, Any]],
    layouts_: list[gl.GpuLayout],
    **kw: Any,
) -> observing.Observed:
    return observing.observe(
        pods=[observing.pod_view(p) for p in pods],
        nodes=[observing.node_view(n) for n in nodes],
        layouts_by_node={lay.name: lay for lay in layouts_},
        **kw,
    )


# --------------------------------------------------------------------------- pod_view: requests


@pytest.mark.parametrize(
    ("spec", "mig", "cpu_milli", "memory"),
    [
        pytest.param({"containers": [_mig("1g.10gb")]}, {"1g.10gb": 1}, 0, 0, id="one-limit"),
        pytest.param(
            {"containers": [_container(requests={"nvidia.com/mig-3g.40gb": 2, "cpu": "1500m"})]},
            {"3g.40gb": 2},
            1500,
            0,
            id="requests",
        ),
        pytest.param(
            {
                "containers": [
                    _container(
                        limits={"cpu": "4", "memory": "8Gi", "nvidia.com/mig-1g.10gb": "1"},
                        requests={"cpu": "2"},
                    )
                ]
            },
            {"1g.10gb": 1},
            2000,
            8 * GI,
            id="request-wins-limit-stands-in",
        ),
        pytest.param(
            {
                "containers": [
                    _container("a", limits={"nvidia.com/mig-1g.10gb": "1"}, requests={"cpu": "1"}),
                    _container("b", limits={"nvidia.com/mig-1g.10gb": "2"}, requests={"cpu": "1"}),
                    _container("c", limits={"nvidia.com/mig-2g.20gb": "1"}),
                ]
            },
            {"1g.10gb": 3, "2g.20gb": 1},
            2000,
            0,
            id="containers-summed",
        ),
        pytest.param(
            {
                "containers": [
                    _container(limits={"nvidia.com/mig-1g.10gb": "1"}, requests={"cpu": "1"})
                ],
                "initContainers": [
                    _container(
                        "i1", limits={"nvidia.com/mig-1g.10gb": "3"}, requests={"cpu": "500m"}
                    ),
                    _container("i2", limits={"nvidia.com/mig-1g.10gb": "2"}, requests={"cpu": "3"}),
                ],
            },
            {"1g.10gb": 3},
            3000,
            0,
            id="init-max-beats-sum",
        ),
        pytest.param(
            {
                "containers": [
                    _container("a", limits={"nvidia.com/mig-1g.10gb": "2"}),
                    _container("b", limits={"nvidia.com/mig-1g.10gb": "2"}),
                ],
                "initContainers": [_container("i", limits={"nvidia.com/mig-1g.10gb": "3"})],
            },
            {"1g.10gb": 4},
            0,
            0,
            id="sum-beats-init-max",
        ),
        pytest.param(
            {
                "containers": [_container()],
                "initContainers": [_container("i", limits={"nvidia.com/mig-2g.20gb": "1"})],
            },
            {"2g.20gb": 1},
            0,
            0,
            id="init-only-mig",
        ),
        pytest.param(
            {
                "containers": [
                    _container(
                        limits={"nvidia.com/mig-1g.10gb": "1"},
                        requests={"cpu": "1", "memory": "1Gi"},
                    )
                ],
                "overhead": {"cpu": "250m", "memory": "512Mi"},
            },
            {"1g.10gb": 1},
            1250,
            GI + GI // 2,
            id="overhead-added",
        ),
        pytest.param(
            {"containers": [_container(limits={"nvidia.com/mig-1g.10gb.me": "1"})]},
            {"1g.10gb+me": 1},
            0,
            0,
            id="media-extension",
        ),
        pytest.param(
            {
                "containers": [
                    _container(
                        limits={
                            "nvidia.com/mig-1g.10gb": "1",
                            "ephemeral-storage": "1Gi",
                            "hugepages-2Mi": "2Mi",
                            "example.com/foo": "3",
                        }
                    )
                ]
            },
            {"1g.10gb": 1},
            0,
            0,
            id="unmodelled-ignored",
        ),
        pytest.param(
            {
                "containers": [
                    _container(
                        limits={"nvidia.com/mig-1g.10gb": "1", "nvidia.com/mig-2g.20gb": "0"}
                    )
                ]
            },
            {"1g.10gb": 1},
            0,
            0,
            id="zero-count-dropped",
        ),
    ],
)
def test_pod_requests_are_what_kube_scheduler_counts(
    spec: dict[str, Any], mig: dict[str, int], cpu_milli: int, memory: int
) -> None:
    doc = {"metadata": {"name": "p", "namespace": "ns"}, "spec": spec}
    view = observing.pod_view(doc)
    assert view.problem is None
    assert view.mig == Counter(mig)
    assert view.is_mig
    assert view.pod is not None
    assert {r.profile: r.count for r in view.pod.mig} == mig
    assert view.pod.cpu_milli == cpu_milli
    assert view.pod.memory_bytes == memory
    assert view.cpu_milli == cpu_milli
    assert view.memory_bytes == memory


@pytest.mark.parametrize(
    ("resources", "named"),
    [
        pytest.param(
            {"nvidia.com/mig-1c.3g.40gb": "1"}, "nvidia.com/mig-1c.3g.40gb", id="compute-instance"
        ),
        pytest.param(
            {"nvidia.com/mig-1g.10gb": "1", "nvidia.com/gpu": "1"},
            "nvidia.com/gpu",
            id="gpu-mixed-in",
        ),
        pytest.param(
            {"nvidia.com/mig-1g.10gb+me": "1"}, "nvidia.com/mig-1g.10gb+me", id="plus-spelling"
        ),
        pytest.param({"nvidia.com/mig-1G.10GB": "1"}, "nvidia.com/mig-1G.10GB", id="upper-case"),
        pytest.param({"nvidia.com/mig-banana": "1"}, "nvidia.com/mig-banana", id="not-a-profile"),
    ],
)
def test_a_bad_mig_request_is_kept_with_a_problem_naming_the_resource(
    resources: dict[str, str], named: str
) -> None:
    view = observing.pod_view(_pod(containers=[_container(limits=resources)]))
    assert view.problem is not None
    assert named in view.problem
    assert view.pod is None
    assert not view.mig
    assert view.is_mig  # still a MIG pod: the controller tells why it will not plan it
    assert view.waiting


@pytest.mark.parametrize(
    "containers",
    [
        pytest.param([_container()], id="no-resources"),
        pytest.param([_container(requests={"cpu": "2", "memory": "1Gi"})], id="cpu-memory"),
        pytest.param([_container(limits={"nvidia.com/gpu": "1"})], id="whole-gpu"),
        pytest.param([_container(limits={"nvidia.com/mig-1g.10gb": "0"})], id="zero-mig"),
        pytest.param([], id="no-containers"),
    ],
)
def test_a_pod_asking_for_no_mig_resource_is_not_a_mig_pod(
    containers: list[dict[str, Any]],
) -> None:
    view = observing.pod_view(_pod(containers=containers, gates=()))
    assert not view.is_mig
    assert view.problem is None and view.pod is None and not view.mig


def test_a_non_mig_pod_keeps_its_cpu_and_memory() -> None:
    view = observing.pod_view(
        _pod(containers=[_container(requests={"cpu": "3", "memory": "2Gi"})], gates=())
    )
    assert (view.cpu_milli, view.memory_bytes) == (3000, 2 * GI)


# --------------------------------------------------------------------------- pod_view: state


@pytest.mark.parametrize(
    ("kw", "gated_by_us", "unschedulable", "done", "waiting"),
    [
        pytest.param({}, True, False, False, True, id="gated-by-us"),
        pytest.param({"gates": ()}, False, False, False, False, id="ungated"),
        pytest.param({"gates": (GATE, "other.io/x")}, False, False, False, False, id="two-gates"),
        pytest.param({"gates": ("other.io/x",)}, False, False, False, False, id="other-gate"),
        pytest.param(
            {
                "gates": (),
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                ],
            },
            False,
            True,
            False,
            True,
            id="unschedulable-fallback",
        ),
        pytest.param(
            {
                "gates": ("other.io/x",),
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
                ],
            },
            False,
            True,
            False,
            False,
            id="unschedulable-but-gated-by-another",
        ),
        pytest.param(
            {
                "gates": (),
                "conditions": [
                    {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}
                ],
            },
            False,
            False,
            False,
            False,
            id="scheduling-gated-condition",
        ),
        pytest.param(
            {
                "gates": (),
                "conditions": [
                    {"type": "PodScheduled", "status": "True", "reason": "Unschedulable"}
                ],
            },
            False,
            False,
            False,
            False,
            id="scheduled-condition",
        ),
        pytest.param({"gates": (), "node": "n0"}, False, False, False, False, id="bound"),
        pytest.param({"phase": "Succeeded"}, True, False, True, False, id="succeeded"),
        pytest.param({"phase": "Failed"}, True, False, True, False, id="failed"),
        pytest.param({"deleting": True}, True, False, True, False, id="being-deleted"),
        pytest.param(
            {"phase": "Running", "gates": (), "node": "n0"},
            False,
            False,
            False,
            False,
            id="running",
        ),
    ],
)
def test_pod_state(
    kw: dict[str, Any], gated_by_us: bool, unschedulable: bool, done: bool, waiting: bool
) -> None:
    view = observing.pod_view(_pod(**kw))
    assert view.gated_by_us is gated_by_us
    assert view.unschedulable is unschedulable
    assert view.done is done
    assert view.waiting is waiting


def test_pod_identity() -> None:
    view = observing.pod_view(_pod("x", namespace="team", created="2026-02-03T04:05:06Z"))
    assert (view.key, view.uid, view.created, view.node) == (
        "team/x",
        "uid-x",
        "2026-02-03T04:05:06Z",
        None,
    )
    assert observing.pod_view({"metadata": {"name": "y"}}).key == "default/y"


def test_pod_gates_in_order() -> None:
    view = observing.pod_view(_pod(gates=("a.io/x", GATE)))
    assert view.gates == ("a.io/x", GATE)


# --------------------------------------------------------------------------- pod_view: placement


def _term(*exprs: dict[str, Any]) -> dict[str, Any]:
    return {"matchExpressions": list(exprs)}


def _affinity(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
        }
    }


@pytest.mark.parametrize(
    ("affinity", "want"),
    [
        pytest.param(None, (), id="none"),
        pytest.param({}, (), id="empty"),
        pytest.param(
            {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
            (),
            id="preferred-only",
        ),
        pytest.param(
            _affinity(_term({"key": "zone", "operator": "In", "values": ["a", "b"]})),
            ((snapshot.Requirement("zone", "In", ("a", "b")),),),
            id="one-term",
        ),
        pytest.param(
            _affinity(
                _term(
                    {"key": "zone", "operator": "In", "values": ["a"]},
                    {"key": "gpu", "operator": "Exists"},
                ),
                _term({"key": "pool", "operator": "NotIn", "values": ["x"]}),
            ),
            (
                (
                    snapshot.Requirement("zone", "In", ("a",)),
                    snapshot.Requirement("gpu", "Exists", ()),
                ),
                (snapshot.Requirement("pool", "NotIn", ("x",)),),
            ),
            id="two-terms",
        ),
    ],
)
def test_required_node_affinity_is_read(
    affinity: dict[str, Any] | None, want: tuple[tuple[snapshot.Requirement, ...], ...]
) -> None:
    extra = {} if affinity is None else {"affinity": affinity}
    view = observing.pod_view(_pod(**extra))
    assert view.problem is None and view.pod is not None
    assert view.pod.affinity == want


def test_node_affinity_by_node_name_is_read() -> None:
    """The controller's own pin names the node by field: a pinned pod stays a good pod."""
    aff = _affinity({"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n0"]}]})
    view = observing.pod_view(_pod(affinity=aff))
    assert view.problem is None and view.pod is not None
    assert view.pod.affinity == ((snapshot.Requirement("metadata.name", "In", ("n0",), True),),)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ({"key": "metadata.uid", "operator": "In", "values": ["x"]}, "is not a node field"),
        ({"key": "metadata.name", "operator": "Exists"}, "exactly one value"),
        ({"key": "metadata.name", "operator": "In", "values": ["a", "b"]}, "exactly one value"),
    ],
)
def test_node_affinity_by_other_fields_is_a_problem(field: dict[str, Any], message: str) -> None:
    view = observing.pod_view(_pod(affinity=_affinity({"matchFields": [field]})))
    assert view.pod is None
    assert view.problem is not None and message in view.problem


def test_node_selector_priority_and_tolerations_are_read() -> None:
    view = observing.pod_view(
        _pod(
            nodeSelector={"zone": "a"},
            priority=100,
            tolerations=[
                {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"},
                {
                    "key": "k",
                    "operator": "Equal",
                    "value": "v",
                    "effect": "NoExecute",
                    "tolerationSeconds": 30,
                },
                {"operator": "Exists"},
            ],
        )
    )
    assert view.pod is not None
    assert dict(view.pod.node_selector) == {"zone": "a"}
    assert view.pod.priority == 100
    assert view.pod.tolerations == (
        snapshot.Toleration("gpu", "Exists", "", "NoSchedule"),
        snapshot.Toleration("k", "Equal", "v", "NoExecute"),
        snapshot.Toleration("", "Exists", "", ""),
    )
    assert (view.pod.name, view.pod.namespace) == ("p", "ns")


def test_a_bad_toleration_is_a_problem() -> None:
    view = observing.pod_view(_pod(tolerations=[{"operator": "Sometimes", "key": "k"}]))
    assert view.pod is None and view.problem is not None and "tolerations[0]" in view.problem


# --------------------------------------------------------------------------- node_view


def test_node_view() -> None:
    doc = _node(
        taints=[
            {"key": "gpu", "value": "yes", "effect": "NoSchedule"},
            {"key": "bad", "effect": "Sometimes"},
        ],
        **{"nvidia.com/mig-1g.10gb": "3", "ephemeral-storage": "100Gi", "pods": "110"},
    )
    doc["spec"]["unschedulable"] = True
    view = observing.node_view(doc)
    assert view.name == "n0" and view.uid == "uid-n0"
    assert view.ready and view.mig_capable and not view.static
    assert view.hostname == "n0"
    assert view.unschedulable
    assert view.taints == (snapshot.Taint("gpu", "yes", "NoSchedule"),)  # the bad one skipped
    assert dict(view.allocatable) == {
        "cpu": 32_000,
        "memory": 256 * GI,
        "nvidia.com/mig-1g.10gb": 3,
    }


@pytest.mark.parametrize(
    ("doc", "ready", "static", "capable", "hostname"),
    [
        pytest.param(_node(), True, False, True, "n0", id="plain"),
        pytest.param(_node(ready=False), False, False, True, "n0", id="not-ready"),
        pytest.param(_node(static=True), True, True, True, "n0", id="static"),
        pytest.param(_node(capable=False), True, False, False, "n0", id="not-capable"),
        pytest.param({"metadata": {"name": "bare"}}, False, False, False, None, id="bare"),
        pytest.param(
            {"metadata": {"name": "x", "labels": None}, "status": {"conditions": "junk"}},
            False,
            False,
            False,
            None,
            id="malformed",
        ),
    ],
)
def test_node_state(
    doc: dict[str, Any], ready: bool, static: bool, capable: bool, hostname: str | None
) -> None:
    view = observing.node_view(doc)
    assert (view.ready, view.static, view.mig_capable, view.hostname) == (
        ready,
        static,
        capable,
        hostname,
    )


# --------------------------------------------------------------------------- node_gpus


@pytest.mark.parametrize(
    ("spec", "status", "reserved", "bound", "want"),
    [
        pytest.param(
            {0: [(0, "3g.40gb", None)]},
            {0: []},
            set(),
            {},
            {0: {(0, "3g.40gb", False)}},
            id="spec-instance-to-be-made",
        ),
        pytest.param(
            {0: [(0, "3g.40gb", "ns/p")]},
            {0: []},
            {(0, 0, "3g.40gb")},
            {},
            {0: {(0, "3g.40gb", True)}},
            id="live-reservation-used",
        ),
        pytest.param(
            {0: [(0, "3g.40gb", "ns/gone")]},
            {0: [(0, "3g.40gb", S.RESERVED)]},
            set(),
            {},
            {0: {(0, "3g.40gb", False)}},
            id="stale-reservation-free",
        ),
        pytest.param(
            {0: []},
            {0: [(0, "3g.40gb", S.USED), (4, "3g.40gb", S.FREE)]},
            set(),
            {"3g.40gb": 1},
            {0: {(0, "3g.40gb", True)}},
            id="status-used-kept-though-spec-dropped-it",
        ),
        pytest.param(
            {0: [(0, "7g.80gb", None)]},
            {0: [(0, "3g.40gb", S.USED)]},
            set(),
            {"3g.40gb": 1},
            {0: {(0, "3g.40gb", True)}},
            id="spec-overlapping-used-dropped",
        ),
        pytest.param(
            {0: [(0, "3g.40gb", None), (4, "1g.10gb", None), (5, "1g.10gb", None)]},
            {0: [(4, "2g.20gb", S.USED)]},
            set(),
            {"2g.20gb": 1},
            {0: {(0, "3g.40gb", False), (4, "2g.20gb", True)}},
            id="only-overlapping-dropped",
        ),
        pytest.param(
            {},
            {
                0: [
                    (0, "1g.10gb", S.FREE),
                    (1, "1g.10gb", S.USED),
                    (2, "1g.10gb", S.RESERVED),
                    (3, "1g.10gb", S.CREATING),
                    (4, "1g.10gb", S.DESTROYING),
                ]
            },
            set(),
            {"1g.10gb": 1},
            {
                0: {
                    (0, "1g.10gb", False),
                    (1, "1g.10gb", True),
                    (2, "1g.10gb", True),
                    (3, "1g.10gb", True),
                }
            },
            id="no-spec-gpu-status-as-reported",
        ),
        pytest.param(
            {0: [(s, "1g.10gb", None) for s in range(7)]},
            {0: [(s, "1g.10gb", S.FREE) for s in range(7)]},
            set(),
            {"1g.10gb": 2},
            {0: {(s, "1g.10gb", s < 2) for s in range(7)}},
            id="bound-pods-hold-free-instances",
        ),
        pytest.param(
            {0: [(s, "1g.10gb", "ns/w" if s < 3 else None) for s in range(7)]},
            {0: [(s, "1g.10gb", S.RESERVED if s < 3 else S.FREE) for s in range(7)]},
            {(0, s, "1g.10gb") for s in range(3)},
            {"1g.10gb": 2},
            {0: {(s, "1g.10gb", s < 5) for s in range(7)}},
            id="bound-never-counted-on-reserved",
        ),
        pytest.param(
            {0: [(0, "3g.40gb", None), (4, "3g.40gb", None)], 1: [(0, "3g.40gb", None)]},
            {0: [(0, "3g.40gb", S.USED)], 1: [(0, "3g.40gb", S.FREE)]},
            set(),
            {"3g.40gb": 2},
            {
                0: {(0, "3g.40gb", True), (4, "3g.40gb", True)},
                1: {(0, "3g.40gb", False)},
            },
            id="status-used-counted-first",
        ),
        pytest.param(
            {0: [(0, "3g.40gb", None)]},
            {0: [], 1: [(0, "7g.80gb", S.USED)]},
            set(),
            {"7g.80gb": 1},
            {0: {(0, "3g.40gb", False)}, 1: {(0, "7g.80gb", True)}},
            id="gpu-only-in-status",
        ),
        pytest.param(
            {0: [(0, "3g.40gb", None)], 5: [(0, "7g.80gb", None)]},
            {0: []},
            set(),
            {},
            {0: {(0, "3g.40gb", False)}},
            id="gpu-only-in-spec-ignored",
        ),
        pytest.param(
            {0: [(0, "1g.10gb", None)]},
            {0: []},
            set(),
            {"1g.10gb": 5},
            {0: {(0, "1g.10gb", True)}},
            id="bound-asks-more-than-there-is",
        ),
    ],
)
def test_node_gpus(
    spec: Spec,
    status: Status,
    reserved: set[tuple[int, int, str]],
    bound: dict[str, int],
    want: dict[int, set[tuple[int, str, bool]]],
) -> None:
    got = observing.node_gpus(
        _layout(spec=spec, status=status), reserved=reserved, bound=Counter(bound)
    )
    assert _gpus(got) == want
    for g in got:
        assert g.model is A100_MODEL
        assert layouts.violation(g.model, [i.instance for i in g.instances]) is None


def test_node_gpus_with_an_unknown_model_raises() -> None:
    layout = gl.GpuLayout(
        "n0",
        gl.LayoutSpec(()),
        gl.LayoutStatus(1, (gl.GpuStatus(0, "Acme Tensor 9000", "GPU-0", ()),)),
    )
    with pytest.raises(errors.GpuLayoutError, match="GPU 0"):
        observing.node_gpus(layout, reserved=set(), bound=Counter())


# Valid A100 layouts to draw GPUs from.
_LAYOUTS = [
    [(0, "7g.80gb")],
    [(0, "3g.40gb"), (4, "3g.40gb")],
    [(0, "4g.40gb"), (4, "2g.20gb"), (6, "1g.10gb")],
    [(s, "1g.10gb") for s in range(7)],
    [(0, "2g.20gb"), (2, "2g.20gb"), (4, "1g.10gb"), (5, "1g.10gb"), (6, "1g.10gb")],
    [(0, "3g.40gb"), (4, "1g.20gb"), (6, "1g.10gb")],
    [(0, "1g.20gb"), (2, "1g.20gb"), (4, "3g.40gb")],
]


@st.composite
def _node_state(
    draw: st.DrawFn,
) -> tuple[
    gl.GpuLayout, set[tuple[int, int, str]], Counter[str], Counter[str], Counter[str], Counter[str]
]:
    """A node whose instances each are reserved (live), reported used, or free; pods bound to
    it hold at least the reported-used ones."""
    spec: Spec = {}
    status: Status = {}
    reserved: set[tuple[int, int, str]] = set()
    total: Counter[str] = Counter()
    n_reserved: Counter[str] = Counter()
    n_used: Counter[str] = Counter()
    for gpu in range(draw(st.integers(min_value=1, max_value=3))):
        layout = draw(st.sampled_from(_LAYOUTS))
        spec[gpu], status[gpu] = [], []
        for start, profile in layout:
            role = draw(st.sampled_from(["reserved", "used", "free", "creating"]))
            total[profile] += 1
            if role == "reserved":
                reserved.add((gpu, start, profile))
                n_reserved[profile] += 1
                spec[gpu].append((start, profile, f"ns/w{gpu}-{start}"))
                status[gpu].append((start, profile, S.RESERVED))
            elif role == "used":
                n_used[profile] += 1
                spec[gpu].append((start, profile, None))
                status[gpu].append((start, profile, S.USED))
            elif role == "creating":
                spec[gpu].append((start, profile, None))
                status[gpu].append((start, profile, S.CREATING))
            else:
                spec[gpu].append((start, profile, None))
                status[gpu].append((start, profile, S.FREE))
    bound = Counter({p: n_used[p] + draw(st.integers(min_value=0, max_value=4)) for p in total})
    return _layout(spec=spec, status=status), reserved, bound, total, n_reserved, n_used


@given(state=_node_state())
def test_used_instances_cover_the_bound_pods_and_the_live_reservations(
    state: tuple[
        gl.GpuLayout,
        set[tuple[int, int, str]],
        Counter[str],
        Counter[str],
        Counter[str],
        Counter[str],
    ],
) -> None:
    layout, reserved, bound, total, n_reserved, n_used = state
    gpus = observing.node_gpus(layout, reserved=reserved, bound=bound)
    used = Counter(i.profile for g in gpus for i in g.instances if i.used)
    for profile, count in total.items():
        # Every live reservation is used, and the bound pods get what they ask for out of the
        # rest (status-used ones first), never out of another pod's reservation.
        want = n_reserved[profile] + min(bound[profile], count - n_reserved[profile])
        assert used[profile] == want
        assert used[profile] >= min(count, n_reserved[profile] + bound[profile])
        assert used[profile] >= n_reserved[profile] + n_used[profile]
    marked = {(g.index, i.start, i.profile) for g in gpus for i in g.instances if i.used}
    assert reserved <= marked
    assert {
        (g.index, i.start, i.profile)
        for g in layout.status.gpus  # type: ignore[union-attr]
        for i in g.instances
        if i.state is S.USED
    } <= marked


# --------------------------------------------------------------------------- observe


def _status_all(n: int = 1) -> Status:
    return {i: [] for i in range(n)}


def test_observe_a_waiting_pod_on_an_empty_node() -> None:
    obs = _observe([_pod()], [_node()], [_layout(status=_status_all(2))])
    (node,) = obs.snapshot.nodes
    assert node.name == "n0" and len(node.gpus) == 2
    assert node.allocatable == snapshot.Resources(32_000, 256 * GI)
    assert [p.key for p in obs.snapshot.pods] == ["ns/p"]
    assert not obs.reservations and not obs.stale and not obs.unplanned


def test_observe_carries_the_controllers_policies_into_the_snapshot() -> None:
    """The controller's global policies are the snapshot's defaults (a pod's annotation wins)."""
    default = _observe([_pod()], [_node()], [_layout(status=_status_all(2))])
    assert (default.snapshot.policy, default.snapshot.gpu_policy) == (
        snapshot.Policy.BINPACK,
        snapshot.Policy.SPREAD,
    )
    flipped = _observe(
        [_pod()],
        [_node()],
        [_layout(status=_status_all(2))],
        policy=snapshot.Policy.SPREAD,
        gpu_policy=snapshot.Policy.BINPACK,
    )
    assert (flipped.snapshot.policy, flipped.snapshot.gpu_policy) == (
        snapshot.Policy.SPREAD,
        snapshot.Policy.BINPACK,
    )


def test_cpu_and_memory_are_less_the_bound_and_the_reserved_pods() -> None:
    with_cpu = [
        _container(limits={"nvidia.com/mig-1g.10gb": "1"}, requests={"cpu": "4", "memory": "8Gi"})
    ]
    pods = [
        _pod("bound", containers=with_cpu, gates=(), node="n0", phase="Running"),
        _pod("reserved", containers=with_cpu),
        _pod(
            "plain",
            containers=[_container(requests={"cpu": "2", "memory": "1Gi"})],
            gates=(),
            node="n0",
            phase="Running",
        ),
        _pod("finished", containers=with_cpu, gates=(), node="n0", phase="Succeeded"),
        _pod("elsewhere", containers=with_cpu, gates=(), node="n1", phase="Running"),
        _pod("waiting", containers=with_cpu),
    ]
    lay = _layout(spec={0: [(0, "1g.10gb", "ns/reserved")]}, status={0: []})
    obs = _observe(pods, [_node()], [lay])
    (node,) = obs.snapshot.nodes
    assert node.allocatable == snapshot.Resources(
        32_000 - 4000 - 4000 - 2000, (256 - 8 - 8 - 1) * GI
    )
    assert [p.key for p in obs.snapshot.pods] == ["ns/waiting"]


def test_cpu_and_memory_never_below_zero_and_unconstrained_when_not_reported() -> None:
    big = [_container(limits={"nvidia.com/mig-1g.10gb": "1"}, requests={"cpu": "64"})]
    obs = _observe(
        [
            _pod("b", containers=big, gates=(), node="n0"),
            _pod("c", containers=big, gates=(), node="n1"),
        ],
        [_node("n0", memory=None), _node("n1", cpu=None, memory=None)],
        [_layout("n0", status=_status_all()), _layout("n1", status=_status_all())],
    )
    n0, n1 = obs.snapshot.nodes
    assert n0.allocatable == snapshot.Resources(0, 2**62)
    assert n1.allocatable is None


def test_static_nodes_are_not_planned() -> None:
    obs = _observe([_pod()], [_node("s", static=True)], [_layout("s", status=_status_all())])
    assert not obs.snapshot.nodes and not obs.unplanned
    assert "s" in obs.nodes


@pytest.mark.parametrize(
    ("node", "layout", "why"),
    [
        pytest.param(_node(), None, "its agent has not reported its GPUs yet", id="no-layout"),
        pytest.param(_node(), _layout(), "its agent has not reported its GPUs yet", id="no-status"),
        pytest.param(
            _node(ready=False), _layout(status=_status_all()), "not Ready", id="not-ready"
        ),
    ],
)
def test_nodes_not_planned_say_why(
    node: dict[str, Any], layout: gl.GpuLayout | None, why: str
) -> None:
    obs = _observe([_pod()], [node], [layout] if layout else [])
    assert not obs.snapshot.nodes
    assert obs.unplanned == (f"n0: {why}",)


def test_a_node_that_is_no_mig_node_is_left_out_quietly() -> None:
    obs = _observe([_pod()], [_node(capable=False)], [])
    assert not obs.snapshot.nodes and not obs.unplanned


def test_a_node_with_an_unknown_gpu_is_unplanned_with_the_reason() -> None:
    bad = gl.GpuLayout(
        "n0", gl.LayoutSpec(()), gl.LayoutStatus(1, (gl.GpuStatus(0, "Acme 9000", "G", ()),))
    )
    obs = _observe([_pod()], [_node()], [bad])
    assert not obs.snapshot.nodes
    (why,) = obs.unplanned
    assert why.startswith("n0: GPU 0")


@pytest.mark.parametrize(
    ("holder", "live"),
    [
        pytest.param(_pod("r"), True, id="waiting"),
        pytest.param(_pod("r", gates=()), True, id="let-go"),
        pytest.param(None, False, id="gone"),
        pytest.param(_pod("r", phase="Failed"), False, id="failed"),
        pytest.param(_pod("r", deleting=True), False, id="being-deleted"),
        pytest.param(_pod("r", gates=(), node="n0"), False, id="bound"),
        pytest.param(_pod("r", gates=(), node="n1"), False, id="bound-elsewhere"),
    ],
)
def test_a_reservation_is_live_while_its_pod_waits_for_it(
    holder: dict[str, Any] | None, live: bool
) -> None:
    lay = _layout(spec={0: [(0, "3g.40gb", "ns/r"), (4, "3g.40gb", None)]}, status={0: []})
    obs = _observe([holder] if holder else [], [_node()], [lay])
    if live:
        assert obs.reservations == {
            "ns/r": observing.Reservation("ns/r", "n0", ((0, 0, "3g.40gb"),))
        }
        assert not obs.stale
        assert _gpus(obs.snapshot.nodes[0].gpus) == {
            0: {(0, "3g.40gb", True), (4, "3g.40gb", False)}
        }
        assert not obs.snapshot.pods  # never planned twice
    else:
        assert not obs.reservations
        assert obs.stale == {"n0"}


def test_a_reservation_spans_instances_and_gpus() -> None:
    lay = _layout(
        spec={0: [(0, "3g.40gb", "ns/p"), (4, "3g.40gb", None)], 1: [(0, "1g.10gb", "ns/p")]},
        status=_status_all(2),
    )
    obs = _observe([_pod(containers=[_mig("3g.40gb"), _mig("1g.10gb")])], [_node()], [lay])
    assert obs.reservations["ns/p"].instances == ((0, 0, "3g.40gb"), (1, 0, "1g.10gb"))


def test_a_pod_reserved_on_two_nodes_keeps_the_first_and_the_second_is_stale() -> None:
    a = _layout("a", spec={0: [(0, "3g.40gb", "ns/p")]}, status=_status_all())
    b = _layout("b", spec={0: [(0, "3g.40gb", "ns/p")]}, status=_status_all())
    obs = _observe([_pod()], [_node("a"), _node("b")], [a, b])
    assert obs.reservations["ns/p"].node == "a"
    assert obs.stale == {"b"}
    by_name = {n.name: n for n in obs.snapshot.nodes}
    assert _gpus(by_name["a"].gpus) == {0: {(0, "3g.40gb", True)}}
    assert _gpus(by_name["b"].gpus) == {0: {(0, "3g.40gb", False)}}


def test_pending_pods() -> None:
    unsched = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
    pods = [
        _pod("late", created="2026-01-01T00:00:09Z"),
        _pod("b-early", created="2026-01-01T00:00:01Z"),
        _pod("a-early", created="2026-01-01T00:00:01Z"),
        _pod("fallback", gates=(), conditions=unsched, created="2026-01-01T00:00:05Z"),
        _pod("ungated", gates=()),
        _pod("other-gate", gates=(GATE, "x.io/y")),
        _pod("reserved"),
        _pod("bad", containers=[_container(limits={"nvidia.com/mig-1c.3g.40gb": "1"})]),
        _pod("bound", gates=(), node="n0"),
        _pod("done", phase="Succeeded"),
        _pod("nomig", containers=[_container(requests={"cpu": "1"})]),
    ]
    lay = _layout(spec={0: [(0, "1g.10gb", "ns/reserved")]}, status=_status_all())
    obs = _observe(pods, [_node()], [lay])
    assert [p.key for p in obs.snapshot.pods] == [
        "ns/a-early",
        "ns/b-early",
        "ns/fallback",
        "ns/late",
    ]
    assert set(obs.reservations) == {"ns/reserved"}


def test_bound_counts_by_node() -> None:
    pods = [
        _pod("a", containers=[_mig("1g.10gb", 2)], gates=(), node="n0"),
        _pod("b", containers=[_mig("1g.10gb"), _mig("3g.40gb")], gates=(), node="n0"),
        _pod("c", containers=[_mig("7g.80gb")], gates=(), node="n1"),
        _pod("d", containers=[_mig("7g.80gb")], gates=(), node="n1", phase="Succeeded"),
        _pod("e", containers=[_container(requests={"cpu": "1"})], gates=(), node="n0"),
    ]
    obs = _observe(pods, [], [])
    assert dict(obs.bound) == {
        "n0": Counter({"1g.10gb": 3, "3g.40gb": 1}),
        "n1": Counter({"7g.80gb": 1}),
    }


def test_the_node_cache_changes_nothing_but_time() -> None:
    pods = [_pod("w"), _pod("b", gates=(), node="n0"), _pod("r")]
    nodes = [observing.node_view(_node(f"n{i}")) for i in range(3)]
    lays = {
        "n0": _layout("n0", spec={0: [(0, "1g.10gb", None)]}, status={0: [(0, "1g.10gb", S.USED)]}),
        "n1": _layout("n1", spec={0: [(0, "3g.40gb", "ns/r")]}, status=_status_all()),
        "n2": _layout("n2", status=_status_all(2)),
    }
    views = [observing.pod_view(p) for p in pods]
    cache: observing.NodeCache = {}
    first = observing.observe(pods=views, nodes=nodes, layouts_by_node=lays, cache=cache)
    again = observing.observe(pods=views, nodes=nodes, layouts_by_node=lays, cache=cache)
    plain = observing.observe(pods=views, nodes=nodes, layouts_by_node=lays)
    assert first.snapshot == again.snapshot == plain.snapshot
    assert set(cache) == {"n0", "n1", "n2"}
    # The reservation's pod is bound now: n1's instance is no longer reserved, cache or not.
    views2 = [*views[:2], observing.pod_view(_pod("r", gates=(), node="n1"))]
    cached = observing.observe(pods=views2, nodes=nodes, layouts_by_node=lays, cache=cache)
    fresh = observing.observe(pods=views2, nodes=nodes, layouts_by_node=lays)
    assert cached.snapshot == fresh.snapshot
    assert cached.stale == fresh.stale == {"n1"}


def test_policy_is_passed_to_the_snapshot() -> None:
    obs = _observe([], [], [], policy=snapshot.Policy.SPREAD)
    assert obs.snapshot.policy is snapshot.Policy.SPREAD


# --------------------------------------------------------------------------- static_fit


def _static_layouts(*names: str) -> list[gl.GpuLayout]:
    return [_layout(n, status={0: [(st_, "1g.10gb", S.FREE) for st_ in range(7)]}) for n in names]


def test_static_fit_finds_a_static_node_with_free_instances() -> None:
    nodes = [
        _node("s0", static=True, **{"nvidia.com/mig-1g.10gb": "1"}),
        _node("s1", static=True, **{"nvidia.com/mig-1g.10gb": "3"}),
        _node("s2", static=True, ready=False, **{"nvidia.com/mig-1g.10gb": "7"}),
        _node("d", **{"nvidia.com/mig-1g.10gb": "7"}),  # planned, not static
    ]
    lays = _static_layouts("s0", "s1", "s2", "d")
    two = [_mig("1g.10gb", 2)]
    obs = _observe([_pod("w", containers=two)], nodes, lays)
    assert observing.static_fit(obs, obs.pods["ns/w"]) == "s1"
    # A pod bound to s1 holds one of its three: two are left, enough.
    obs = _observe([_pod("w", containers=two), _pod("b", gates=(), node="s1")], nodes, lays)
    assert observing.static_fit(obs, obs.pods["ns/w"]) == "s1"
    # Two held: one left, not enough anywhere.
    held = _pod("b", containers=two, gates=(), node="s1")
    obs = _observe([_pod("w", containers=two), held], nodes, lays)
    assert observing.static_fit(obs, obs.pods["ns/w"]) is None


def test_static_fit_needs_the_gpus_reported() -> None:
    nodes = [_node("s0", static=True, **{"nvidia.com/mig-1g.10gb": "7"})]
    for lays in ([], [_layout("s0")]):
        obs = _observe([_pod("w")], nodes, lays)
        assert observing.static_fit(obs, obs.pods["ns/w"]) is None


def test_static_fit_honours_selectors_and_taints() -> None:
    nodes = [
        _node(
            "s0",
            static=True,
            taints=[{"key": "t", "value": "", "effect": "NoSchedule"}],
            **{"nvidia.com/mig-1g.10gb": "1"},
        ),
    ]
    lays = _static_layouts("s0")
    plain = _observe([_pod("w")], nodes, lays)
    assert observing.static_fit(plain, plain.pods["ns/w"]) is None
    tolerant = _observe([_pod("w", tolerations=[{"key": "t", "operator": "Exists"}])], nodes, lays)
    assert observing.static_fit(tolerant, tolerant.pods["ns/w"]) == "s0"
    elsewhere = _observe(
        [_pod("w", tolerations=[{"key": "t", "operator": "Exists"}], nodeSelector={"z": "a"})],
        nodes,
        lays,
    )
    assert observing.static_fit(elsewhere, elsewhere.pods["ns/w"]) is None
    bad = _observe(
        [_pod("w", containers=[_container(limits={"nvidia.com/mig-1c.1g.10gb": "1"})])], nodes, lays
    )
    assert observing.static_fit(bad, bad.pods["ns/w"]) is None


# --------------------------------------------------------------------------- pod affinity counts


def test_bound_pods_counted_for_pod_affinity_terminating_marked_terminated_left_out() -> None:
    anti = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": {"app": "web"}}, "topologyKey": "zone"}
            ]
        }
    }
    pods = [
        {
            **_pod("running", node="n0", gates=(), phase="Running"),
            "metadata": {
                "name": "running",
                "namespace": "ns",
                "uid": "u1",
                "labels": {"app": "web"},
            },
        },
        _pod("going", node="n0", gates=(), phase="Running", deleting=True, affinity=anti),
        _pod("finished", node="n0", gates=(), phase="Succeeded"),
    ]
    seen = _observe(pods, [_node("n0")], [_layout("n0", status={0: []})])
    bound = {b.name: b for b in seen.snapshot.bound}
    # kube-scheduler's cache holds a pod being deleted until it is gone: pod (anti-)affinity
    # still counts it (topology spread skips it); a terminated pod counts for neither.
    assert set(bound) == {"running", "going"}
    assert dict(bound["running"].labels) == {"app": "web"} and not bound["running"].terminating
    assert bound["going"].terminating and bound["going"].anti_affinity[0].topology_key == "zone"
