"""One builder of a pod's planning view (issue 22): kube-scheduler's request rule written once
(:func:`snapshot.scheduled`), and the snapshot file's reader, the controller and the simulator
all building the same :class:`snapshot.Pod` through :func:`snapshot.planned_pod`."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from migpilot.controller import observing
from migpilot.mig import catalog
from migpilot.planning import snapshot
from migpilot.sim import traces

_amounts = st.dictionaries(st.sampled_from(["a", "b", "c"]), st.integers(0, 100), max_size=3)


@given(
    containers=st.lists(_amounts, max_size=4),
    init=st.lists(_amounts, max_size=3),
    overhead=_amounts,
)
def test_the_request_rule_is_the_containers_sum_or_the_largest_init_plus_overhead(
    containers: list[dict[str, int]], init: list[dict[str, int]], overhead: dict[str, int]
) -> None:
    got = snapshot.scheduled(containers, init, overhead)
    for k in {*(k for c in containers for k in c), *(k for c in init for k in c), *overhead}:
        summed = sum(c.get(k, 0) for c in containers)
        largest = max((c.get(k, 0) for c in init), default=0)
        assert got[k] == max(summed, largest) + overhead.get(k, 0)


def test_overhead_counts_in_the_controllers_cpu_and_memory() -> None:
    doc = _doc(
        [{"nvidia.com/mig-1g.10gb": "1", "cpu": "500m", "memory": "1Gi"}],
        init=[{"cpu": "2", "memory": "512Mi"}],
        overhead={"cpu": "250m", "memory": "64Mi"},
    )
    pod = observing.pod_view(doc).pod
    assert pod is not None
    assert (pod.cpu_milli, pod.memory_bytes) == (2250, (1 << 30) + (64 << 20))


def _doc(
    containers: list[dict[str, Any]],
    *,
    init: list[dict[str, Any]] | None = None,
    overhead: dict[str, Any] | None = None,
    selector: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [
            {"name": f"c{i}", "resources": {"requests": r}} for i, r in enumerate(containers)
        ]
    }
    if init:
        spec["initContainers"] = [
            {"name": f"i{i}", "resources": {"limits": r}} for i, r in enumerate(init)
        ]
    if overhead:
        spec["overhead"] = overhead
    if selector:
        spec["nodeSelector"] = selector
    return {"metadata": {"name": "p", "namespace": "default", "uid": "u"}, "spec": spec}


REQUESTS = [
    {"nvidia.com/mig-1g.10gb": 2, "cpu": "1", "memory": "2Gi"},
    {"nvidia.com/mig-3g.40gb": 1, "cpu": "500m", "memory": "1Gi"},
    {"nvidia.com/gpu-10gb": 1, "cpu": "1", "memory": "1Gi"},
]


def test_the_snapshot_file_and_the_controller_read_one_container_pod_alike() -> None:
    for requests in REQUESTS:
        document = {
            "version": 1,
            "nodes": [],
            "pods": [{"name": "p", "requests": requests, "nodeSelector": {"zone": "a"}}],
        }
        (from_file,) = snapshot.parse(document).pods
        from_api = observing.pod_view(_doc([requests], selector={"zone": "a"})).pod
        assert from_api == from_file


def test_the_simulator_builds_its_pods_as_the_request_parser_reads_the_trace() -> None:
    model = catalog.resolve_gpu("a100-80gb")
    trace = traces.parse(
        "name,arrival,duration,requests,node_selector\n"
        "p,0,10,mig-1g.10gb=2;cpu=1;memory=2Gi,zone=a\n",
        source="t.csv",
        model=model,
    )
    (tp,) = trace.pods
    from_trace = snapshot.planned_pod(
        name="p", namespace="default", requests=tp.requests, node_selector={"zone": "a"}
    )
    document = {
        "version": 1,
        "nodes": [],
        "pods": [
            {
                "name": "p",
                "requests": {"nvidia.com/mig-1g.10gb": 2, "cpu": "1", "memory": "2Gi"},
                "nodeSelector": {"zone": "a"},
            }
        ],
    }
    assert from_trace == snapshot.parse(document).pods[0]
