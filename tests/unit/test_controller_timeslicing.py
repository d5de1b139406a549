"""The controller on a node in mode ``time-slicing`` (``docs/modes.md``): the GpuLayout reports each
GPU's replicas; a unified pod (HAMi's ``nvidia.com/gpu`` + ``gpumem``) gets a free replica
reserved in the spec, is pinned once the Node advertises ``nvidia.com/gpu`` and the counters, and
keeps the reservation until the status reports the replica used by it; replicas held by pods,
reserved, or taken by bound pods the status does not show yet are never given away."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from migpilot import errors
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import kubeapi, observing, pinning, running
from migpilot.kube import objects as kubeobjects
from migpilot.planning import fast, options
from tests.unit import controller_sharing as sharing
from tests.unit.test_controller_running import _run, _until

A100 = "NVIDIA A100-SXM4-40GB"
COUNTERS = {
    "nvidia.com/gpumem": "40960",
    "nvidia.com/gpumem-percentage": "100",
    "nvidia.com/gpucores": "100",
}


def _node(name: str, **allocatable: str) -> dict[str, Any]:
    return sharing.node(name, mode="time-slicing", **allocatable)


def _unified(name: str, *, node: str | None = None, gpumem: str = "8000") -> dict[str, Any]:
    return sharing.pod(name, {"nvidia.com/gpu": "1", "nvidia.com/gpumem": gpumem}, node=node)


def _whole(name: str, node: str) -> dict[str, Any]:
    """An NVIDIA-style pod (``nvidia.com/gpu`` alone) kube-scheduler bound to a replica."""
    pod = _unified(name, node=node)
    pod["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/gpu": "1"}
    return pod


def _gpu(index: int, replicas: list[dict[str, Any]]) -> dict[str, Any]:
    gpu: dict[str, Any] = {"index": index, "model": A100, "uuid": f"GPU-{index}", "instances": []}
    if replicas:
        gpu["replicas"] = replicas
    return gpu


def _layout(
    name: str, gpus: list[dict[str, Any]], spec: list[dict[str, Any]] | None = None
) -> gl.GpuLayout:
    return wire.parse(
        {
            "apiVersion": gl.API_VERSION,
            "kind": gl.KIND,
            "metadata": {"name": name},
            "spec": {"gpus": spec or []},
            "status": {"gpus": gpus},
        }
    )


def _free(*ids: int) -> list[dict[str, Any]]:
    return [{"id": i, "state": "free"} for i in ids]


def test_replicas_round_trip_and_bad_ones_are_refused_naming_the_field() -> None:
    layout = _layout(
        "t0",
        [_gpu(0, [{"id": 0, "state": "used", "usedBy": "ns/a"}, *_free(1, 2)])],
        spec=[{"index": 0, "instances": [], "replicas": [{"id": 2, "reservedFor": "ns/b"}]}],
    )
    assert layout.spec.gpus[0].replicas == (gl.ReplicaSpec(2, "ns/b"),)
    assert [r.id for r in layout.status.gpus[0].replicas] == [0, 1, 2]  # type: ignore[union-attr]
    assert wire.parse(wire.to_document(layout)) == layout
    bad = [
        ([{"id": 0, "state": "free", "usedBy": "ns/a"}], "only a used replica has one"),
        ([{"id": 0, "state": "creating"}], "is not one of free, reserved, used"),
        ([*_free(1), *_free(1)], "a second replica with id 1"),
        ([{"id": 1024, "state": "free"}], "replicas[0].id"),
    ]
    for replicas, text in bad:
        with pytest.raises(errors.GpuLayoutError, match=text.replace("[", r"\[")):
            _layout("t0", [_gpu(0, replicas)])
    with pytest.raises(errors.GpuLayoutError, match="reservedFor: required"):
        _layout("t0", [], spec=[{"index": 0, "instances": [], "replicas": [{"id": 0}]}])


def test_allocated_once_every_reserved_replica_is_used_by_the_pod() -> None:
    spec = [{"index": 0, "instances": [], "replicas": [{"id": 1, "reservedFor": "ns/u"}]}]
    waiting = _layout("t0", [_gpu(0, _free(0, 1))], spec)
    assert not gl.allocated(waiting, "ns/u")
    elsewhere = _layout(
        "t0", [_gpu(0, [{"id": 0, "state": "used", "usedBy": "ns/u"}, *_free(1)])], spec
    )
    assert not gl.allocated(elsewhere, "ns/u")
    done = _layout("t0", [_gpu(0, [*_free(0), {"id": 1, "state": "used", "usedBy": "ns/u"}])], spec)
    assert gl.allocated(done, "ns/u")


def test_the_snapshot_counts_used_reserved_and_bound_replicas() -> None:
    """GPU 0 has one replica used, one reserved for a live pod and one stale reservation; GPU 1
    none used; GPU 2 reports no replicas (not shared) and is left out. Three NVIDIA-style pods
    are bound, one replica reported used: two more are counted used (on the GPUs in order)."""
    layout = _layout(
        "t0",
        [
            _gpu(0, [{"id": 0, "state": "used"}, {"id": 1, "state": "reserved"}, *_free(2, 3)]),
            _gpu(1, _free(0, 1, 2, 3)),
            _gpu(2, []),
        ],
        spec=[
            {"index": 0, "instances": [], "replicas": [{"id": 1, "reservedFor": "ns/r"}]},
            {"index": 1, "instances": [], "replicas": [{"id": 3, "reservedFor": "ns/gone"}]},
        ],
    )
    pods = [_unified("r"), _whole("w1", "t0"), _whole("w2", "t0"), _whole("w3", "t0")]
    observed = observing.observe(
        pods=[observing.pod_view(p) for p in pods],
        nodes=[observing.node_view(_node("t0"))],
        layouts_by_node={"t0": layout},
    )
    (node,) = observed.snapshot.nodes
    assert [(g.index, g.replicas, g.replicas_used) for g in node.gpus] == [(0, 4, 4), (1, 4, 0)]
    assert observed.reservations["ns/r"].replicas == ((0, 1),)
    assert observed.stale == frozenset({"t0"})
    assert pinning.taken(observed)["t0"][gl.UNIFIED_RESOURCE] == 3


def test_a_unified_pod_is_planned_onto_a_free_replica() -> None:
    layout = _layout("t0", [_gpu(0, [{"id": 0, "state": "used"}, *_free(1)])])
    observed = observing.observe(
        pods=[observing.pod_view(_unified("u")), observing.pod_view(_unified("v"))],
        nodes=[observing.node_view(_node("t0"))],
        layouts_by_node={"t0": layout},
    )
    plan = fast.plan(observed.snapshot, options.Options())
    assert [(p.pod, p.node) for p in plan.placements] == [("ns/u", "t0")]
    assert [u.pod for u in plan.unschedulable] == ["ns/v"]
    (node,) = observed.snapshot.nodes
    spec = pinning.spec_for(node, plan, kept={}, layout=layout)
    assert spec.gpus == (gl.GpuSpec(0, "a100-40gb", (), replicas=(gl.ReplicaSpec(1, "ns/u"),)),)


def test_a_unified_pod_gets_a_replica_is_pinned_and_released_once_used() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("t0"))
        await _until("a GpuLayout", lambda: "t0" in api.objects[kubeobjects.Kind.LAYOUTS])
        await _report(api, "t0", [{"id": 0, "state": "used"}, *_free(1)])
        await api.put(kubeobjects.Kind.PODS, _whole("w", "t0"))
        await api.put(kubeobjects.Kind.PODS, _unified("u"))
        await _until("a replica reserved", lambda: bool(_reserved(api, "t0")))
        assert _reserved(api, "t0") == [(0, 1, "ns/u")]
        await api.put(kubeobjects.Kind.NODES, _node("t0", **{"nvidia.com/gpu": "2"}))
        await asyncio.sleep(0.2)
        assert not api.pod_patches, "pinned before the Node has the unified counters"
        await api.put(kubeobjects.Kind.NODES, _node("t0", **{"nvidia.com/gpu": "2"}, **COUNTERS))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        assert api.pod_patches[0][0] == "ns/u"

        # A second unified pod: no replica is free (one used, one reserved), so nothing is
        # reserved for it.
        await api.put(kubeobjects.Kind.PODS, _unified("vv"))
        await asyncio.sleep(0.3)
        assert _reserved(api, "t0") == [(0, 1, "ns/u")]

        # Bound, not yet allocated: the reservation stays; used by the pod: released.
        await sharing.bind(api, "ns/u", "t0")
        await asyncio.sleep(0.2)
        assert _reserved(api, "t0") == [(0, 1, "ns/u")]
        await _report(
            api, "t0", [{"id": 0, "state": "used"}, {"id": 1, "state": "used", "usedBy": "ns/u"}]
        )
        await _until("released", lambda: not _reserved(api, "t0"))

        # The NVIDIA-style pod ends: its replica goes to the waiting pod.
        await api.delete(kubeobjects.Kind.PODS, "ns/w")
        await _report(api, "t0", [*_free(0), {"id": 1, "state": "used", "usedBy": "ns/u"}])
        await _until("the freed replica reserved", lambda: bool(_reserved(api, "t0")))
        assert _reserved(api, "t0") == [(0, 0, "ns/vv")]

    _run(body)


async def _report(api: kubeapi.InMemoryApi, node: str, replicas: list[dict[str, Any]]) -> None:
    """The agent's status: one A100-40GB shared as ``replicas``."""
    await sharing.report(api, node, [_gpu(0, replicas)])


def _reserved(api: kubeapi.InMemoryApi, node: str) -> list[tuple[int, int, str]]:
    layout = wire.parse(api.objects[kubeobjects.Kind.LAYOUTS][node])
    return [(g.index, r.id, r.reserved_for) for g in layout.spec.gpus for r in g.replicas]
