"""The controller on a node in mode ``mps`` (``docs/modes.md``), against the in-memory API: a pod
asking ``nvidia.com/gpu-10gb`` gets an MPS slice reserved in the GpuLayout's spec, is pinned once
the agent serves the slice and the Node advertises it, its reservation is released when bound,
and a bound pod's slice is never given to the next pod."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import kubeapi, running
from migpilot.kube import objects as kubeobjects
from tests.unit import controller_sharing as sharing
from tests.unit.test_controller_running import WAIT_S, _run, _until

A100 = "NVIDIA A100-SXM4-80GB"


def _node(name: str, **allocatable: str) -> dict[str, Any]:
    return sharing.node(name, mode="mps", **allocatable)


def _pod(name: str, gb: int) -> dict[str, Any]:
    return sharing.pod(name, {f"nvidia.com/gpu-{gb}gb": "1"})


async def _report(api: kubeapi.InMemoryApi, node: str, slices: list[dict[str, Any]]) -> None:
    """The agent's status: one A100 serving ``slices``."""
    gpu: dict[str, Any] = {"index": 0, "model": A100, "uuid": "GPU-0", "instances": []}
    if slices:
        gpu["mps"] = slices
    await sharing.report(api, node, [gpu])


def _slices(api: kubeapi.InMemoryApi, node: str) -> list[gl.SliceSpec]:
    layout = wire.parse(api.objects[kubeobjects.Kind.LAYOUTS][node])
    return [sl for g in layout.spec.gpus for sl in g.mps]


def test_an_mps_pod_gets_a_slice_reserved_is_pinned_and_its_slice_is_kept_when_bound() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("m0"))
        await _until(
            "a GpuLayout for the mps node", lambda: "m0" in api.objects[kubeobjects.Kind.LAYOUTS]
        )
        await _report(api, "m0", [])
        await api.put(kubeobjects.Kind.PODS, _pod("a", 10))
        await _until("a slice reserved", lambda: any(s.reserved_for for s in _slices(api, "m0")))
        (mine,) = _slices(api, "m0")
        assert (mine.memory_gb, mine.reserved_for) == (10, "ns/a")
        await asyncio.sleep(0.2)
        assert not api.pod_patches, "pinned before the agent serves the slice"
        served = {"id": mine.id, "memoryGB": 10, "state": "reserved"}
        await _report(api, "m0", [served])
        await asyncio.sleep(0.2)
        assert not api.pod_patches, "pinned before the Node advertises the slice"
        await api.put(kubeobjects.Kind.NODES, _node("m0", **{"nvidia.com/gpu-10gb": "1"}))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        ((key, patch),) = api.pod_patches
        assert key == "ns/a"
        assert any(op.get("path") == "/spec/schedulingGates" for op in patch)
        reasons = [e.reason for e in api.events if e.name == "a"]
        assert "MigInstancesReserved" in reasons
        assert any("MPS slice" in e.message for e in api.events if e.name == "a")

        # Bound: the reservation goes; a second pod gets a second slice, never the first.
        await sharing.bind(api, "ns/a", "m0")
        await _until("released", lambda: not any(s.reserved_for for s in _slices(api, "m0")))
        await api.put(kubeobjects.Kind.PODS, _pod("bb", 10))
        await _until(
            "a second slice", lambda: any(s.reserved_for == "ns/bb" for s in _slices(api, "m0"))
        )
        ids = {s.id: s.reserved_for for s in _slices(api, "m0")}
        assert len(ids) == 2 and ids[mine.id] is None

    _run(body)


def test_a_node_in_an_unknown_mode_is_not_planned_and_the_pod_waits() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        odd = _node("m1")
        odd["metadata"]["labels"]["migpilot.io/mode"] = "mps2"
        odd["metadata"]["labels"]["nvidia.com/mig.capable"] = "true"
        await api.put(kubeobjects.Kind.NODES, odd)
        await _until("a GpuLayout", lambda: "m1" in api.objects[kubeobjects.Kind.LAYOUTS])
        await _report(api, "m1", [])
        await api.put(kubeobjects.Kind.PODS, _pod("c", 10))
        obs = controller.observe()
        await _until("observed", lambda: "ns/c" in controller.observe().pods)
        obs = controller.observe()
        assert any("mps2" in u for u in obs.unplanned), obs.unplanned
        assert not obs.snapshot.nodes
        await _until("a Warning on the node", lambda: any(e.kind == "Node" for e in api.events))
        (warning,) = [e for e in api.events if e.kind == "Node"]
        assert (warning.type, warning.reason, warning.name) == (
            "Warning",
            "MigNodeNotPlanned",
            "m1",
        )
        assert "migpilot.io/mode='mps2' is not one of" in warning.message
        await asyncio.sleep(0.1)
        assert not _slices(api, "m1")

    _run(body)


def test_a_node_in_dra_mode_serves_no_mps_pod() -> None:
    """A node labelled migpilot.io/mode=dra publishes DRA devices (docs/dra.md): it is planned
    for pods with DRA claims only (once its agent reports its GPUs; until then it is named
    unplanned, as any node), never given an MPS slice, with no warning."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        dra = _node("d1")
        dra["metadata"]["labels"]["migpilot.io/mode"] = "dra"
        dra["metadata"]["labels"]["nvidia.com/mig.capable"] = "true"
        await api.put(kubeobjects.Kind.NODES, dra)
        await api.put(kubeobjects.Kind.PODS, _pod("c", 10))
        await _until("observed", lambda: "ns/c" in controller.observe().pods)
        obs = controller.observe()
        assert not obs.snapshot.nodes
        assert obs.unplanned == ("d1: its agent has not reported its GPUs yet",)
        await asyncio.sleep(0.1)
        assert not [e for e in api.events if e.kind == "Node"]
        assert not _slices(api, "d1")

    _run(body)


assert WAIT_S > 0


def _unified(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    pod = _pod(name, 10)
    pod["spec"]["containers"][0]["resources"]["limits"] = {
        "nvidia.com/gpu": "1",
        "nvidia.com/gpumem": "8000",
        "nvidia.com/gpucores": "30",
    }
    if annotations:
        pod["metadata"]["annotations"] = annotations
    return pod


def test_a_unified_pod_gets_an_mps_slice_advertised_as_nvidia_gpu_and_is_pinned() -> None:
    """HAMi-style ``nvidia.com/gpu`` + ``gpumem`` (and ``vgpu-mode: mps``) on an mps node: a slice
    of its memory rounded up to whole GB, its cores as the share, marked ``resource:
    nvidia.com/gpu``; pinned once the agent serves it and the Node advertises ``nvidia.com/gpu``
    and the counters; released once the status says Allocate handed it to the pod."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("m0"))
        await _until("a GpuLayout", lambda: "m0" in api.objects[kubeobjects.Kind.LAYOUTS])
        await _report(api, "m0", [])
        await api.put(kubeobjects.Kind.PODS, _unified("u", {"nvidia.com/vgpu-mode": "mps"}))
        await _until("a slice reserved", lambda: any(s.reserved_for for s in _slices(api, "m0")))
        (mine,) = _slices(api, "m0")
        assert (mine.memory_gb, mine.cores, mine.reserved_for, mine.resource) == (
            8,
            30,
            "ns/u",
            gl.UNIFIED_RESOURCE,
        )
        served = {"id": mine.id, "memoryGB": 8, "cores": 30, "state": "reserved"}
        await _report(api, "m0", [served])
        await api.put(kubeobjects.Kind.NODES, _node("m0", **{"nvidia.com/gpu": "1"}))
        await asyncio.sleep(0.2)
        assert not api.pod_patches, "pinned before the Node has the unified counters"
        counters = {
            "nvidia.com/gpu": "1",
            "nvidia.com/gpumem": "81920",
            "nvidia.com/gpumem-percentage": "100",
            "nvidia.com/gpucores": "100",
        }
        await api.put(kubeobjects.Kind.NODES, _node("m0", **counters))
        await _until("the pin", lambda: len(api.pod_patches) == 1)
        assert api.pod_patches[0][0] == "ns/u"

        # Bound, not yet allocated: the reservation stays (Allocate hands the pod this slice).
        await sharing.bind(api, "ns/u", "m0")
        await asyncio.sleep(0.2)
        assert [s.reserved_for for s in _slices(api, "m0")] == ["ns/u"]
        used = {**served, "state": "used", "usedBy": "ns/u"}
        await _report(api, "m0", [used])
        await _until("released", lambda: not any(s.reserved_for for s in _slices(api, "m0")))

    _run(body)


def _layout_with(
    api: kubeapi.InMemoryApi, node: str, *, spec: list[dict[str, Any]], status: list[dict[str, Any]]
) -> dict[str, Any]:
    """``node``'s GpuLayout with one A100 whose spec lists ``spec`` and whose status reports
    ``status`` (slices, wire form)."""
    doc = copy.deepcopy(api.objects[kubeobjects.Kind.LAYOUTS][node])
    doc["spec"] = {"gpus": [{"index": 0, "model": "a100-80gb", "instances": [], "mps": spec}]}
    gpu = {"index": 0, "model": A100, "uuid": "GPU-0", "instances": [], "mps": status}
    doc["status"] = {"observedGeneration": 1, "gpus": [gpu]}
    return doc


def _every_write_parses(api: kubeapi.InMemoryApi) -> None:
    for name, spec in api.spec_writes:
        wire.parse(wire.spec_patch(name, spec))  # raises GpuLayoutError, naming the field


def test_a_held_slice_the_spec_dropped_is_counted_and_no_spec_over_the_gpu_is_written() -> None:
    """The soak's loss of its MPS node: a plan dropped free slice 4 (40 GB) to make room, but
    the kubelet handed it to a bound pod before the agent applied that spec, so the agent keeps
    serving it beside the spec's slices (110 GB of slices on an 80 GB A100). The next plan gave
    the free slice 5 to a pending pod and wrote all of them back: a spec of 110 GB that the
    agent and the controller's own parser refuse, and the node was ignored from then on. Now no
    free slice is given away while the GPU is over, no spec over the GPU is written, and once the
    held slice's pod is gone the pending pod gets its slice."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("m0", **{"nvidia.com/gpu-40gb": "2"}))
        await _until("a GpuLayout", lambda: "m0" in api.objects[kubeobjects.Kind.LAYOUTS])
        await api.put(kubeobjects.Kind.PODS, sharing.pod("a", {"nvidia.com/gpu-40gb": "1"},
                                                        node="m0"))  # fmt: skip
        await api.put(kubeobjects.Kind.PODS, sharing.pod("q", {"nvidia.com/gpu-40gb": "1"},
                                                        node="m0"))  # fmt: skip
        held = {"memoryGB": 40, "state": "used"}
        await api.put(
            kubeobjects.Kind.LAYOUTS,
            _layout_with(
                api,
                "m0",
                spec=[{"id": 0, "memoryGB": 40}, {"id": 5, "memoryGB": 30}],
                status=[
                    {"id": 0, **held, "usedBy": "ns/a"},
                    {"id": 4, **held, "usedBy": "ns/q"},
                    {"id": 5, "memoryGB": 30, "state": "free"},
                ],
            ),
        )
        await _until("observed", lambda: "m0" in controller.observe().layouts)
        await api.put(kubeobjects.Kind.PODS, _pod("p", 30))
        await _until("p observed", lambda: "ns/p" in controller.observe().pods)
        await asyncio.sleep(0.3)
        _every_write_parses(api)
        assert not any(s.reserved_for for s in _slices(api, "m0")), "a slice the GPU lacks given"
        assert "m0" in controller.observe().layouts, "the node was lost"

        # q leaves: slice 4 is gone, and p gets the free slice 5.
        await api.delete(kubeobjects.Kind.PODS, "ns/q")
        await api.put(
            kubeobjects.Kind.LAYOUTS,
            _layout_with(
                api,
                "m0",
                spec=[{"id": 0, "memoryGB": 40}, {"id": 5, "memoryGB": 30}],
                status=[
                    {"id": 0, **held, "usedBy": "ns/a"},
                    {"id": 5, "memoryGB": 30, "state": "free"},
                ],
            ),
        )
        await _until("p's slice", lambda: any(s.reserved_for == "ns/p" for s in _slices(api, "m0")))
        _every_write_parses(api)
        assert {s.id: s.reserved_for for s in _slices(api, "m0")} == {0: None, 5: "ns/p"}

    _run(body)


def test_a_spec_no_reader_accepts_is_rewritten_and_the_node_planned_again() -> None:
    """The soak's second failure: once a spec over the GPU was written, both controllers
    ignored the GpuLayout (424 times each) and tried to create it again (a 422 every pass),
    and the MPS node was lost for 25 minutes. Now the node is planned from its status, its
    spec is rewritten with one every reader accepts, and a pending pod gets a slice."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("m0"))
        await _until("a GpuLayout", lambda: "m0" in api.objects[kubeobjects.Kind.LAYOUTS])
        await api.put(kubeobjects.Kind.PODS, sharing.pod("a", {"nvidia.com/gpu-40gb": "1"},
                                                        node="m0"))  # fmt: skip
        bad = _layout_with(
            api,
            "m0",
            spec=[{"id": 0, "memoryGB": 40}, {"id": 1, "memoryGB": 50, "reservedFor": "ns/x"}],
            status=[{"id": 0, "memoryGB": 40, "state": "used", "usedBy": "ns/a"}],
        )
        writes = len(api.spec_writes)
        await api.put(kubeobjects.Kind.LAYOUTS, bad)
        await _until("the spec rewritten", lambda: len(api.spec_writes) > writes)
        _every_write_parses(api)
        assert _slices(api, "m0") == [], "the repaired spec lists the slices it could not read"
        await _report(api, "m0", [{"id": 0, "memoryGB": 40, "state": "used", "usedBy": "ns/a"}])
        await api.put(kubeobjects.Kind.PODS, _pod("p", 30))
        await _until("p's slice", lambda: any(s.reserved_for == "ns/p" for s in _slices(api, "m0")))
        _every_write_parses(api)
        assert controller.metrics.invalid_specs._value.get() == 0

    _run(body)


def test_a_spec_its_own_parser_refuses_is_never_written_and_counted(monkeypatch: Any) -> None:
    """Defence in depth: whatever the planner and the spec writer produce, a spec over its GPU
    is not written; an error names the node and the metric counts it."""
    real = running.pinning.spec_for

    def over(*args: Any, **kw: Any) -> gl.LayoutSpec:
        spec = real(*args, **kw)
        return gl.LayoutSpec(
            tuple(
                gl.GpuSpec(g.index, "a100-80gb", (), (*g.mps, gl.SliceSpec(40, 80)))
                for g in spec.gpus
            )
        )

    monkeypatch.setattr(running.pinning, "spec_for", over)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("m0"))
        await _until("a GpuLayout", lambda: "m0" in api.objects[kubeobjects.Kind.LAYOUTS])
        await _report(api, "m0", [])
        writes = len(api.spec_writes)
        await api.put(kubeobjects.Kind.PODS, _pod("p", 10))
        await _until("refused", lambda: controller.metrics.invalid_specs._value.get() >= 1)
        assert len(api.spec_writes) == writes
        assert _slices(api, "m0") == []

    _run(body)
