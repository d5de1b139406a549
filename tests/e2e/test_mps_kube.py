"""Dynamic MPS partitioning on a real control plane (``docs/modes.md``).

Beside the scene's two MIG nodes, a KWOK node labelled ``migpilot.io/mode: mps`` with two
emulated A100-80GB GPUs in MIG mode off and its agent (``--kubelet simulated``, the emulated MPS
daemon). Pods ask nos's ``nvidia.com/gpu-<N>gb``: the webhook gates them, the controller plans
MPS memory slices and writes them into the node's GpuLayout reserved for the pods, the agent
serves each slice as an ``nvidia.com/gpu-<N>gb`` device, the controller pins the pods and
kube-scheduler binds them; the agent reports each slice used by its pod. A second wave needs a
free slice removed to make room: nothing held is ever removed or shrunk.
"""

from __future__ import annotations

import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod

from migpilot.api import gpulayouts as gl
from tests.kube.scenes import Scene

pytestmark = pytest.mark.kube

MPS_NODE = "ctl-mps"


def _pod(scene: Scene, name: str, gb: int) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=scene.namespace),
        spec=PodSpec(
            containers=[
                Container(
                    name="c",
                    image="none",
                    resources=ResourceRequirements(limits={f"nvidia.com/gpu-{gb}gb": "1"}),
                )
            ]
        ),
    )


def _slices(scene: Scene) -> dict[tuple[int, int], gl.SliceStatus]:
    lay = scene.layout(MPS_NODE)
    if lay is None or lay.status is None:
        return {}
    return {(g.index, sl.id): sl for g in lay.status.gpus for sl in g.mps}


def _with_mps_node(scene: Scene) -> None:
    """The scene's MIG nodes, an mps node of two A100-80GB with MIG off, and the controller."""
    scene.add_node(
        MPS_NODE,
        "emulated:a100-80gb:x2:mig-off",
        "--mps-root",
        str(scene.root / "mps"),
        labels={"migpilot.io/mode": "mps"},
    )
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    scene.wait(lambda: scene.layout(MPS_NODE) is not None, "the mps node's GpuLayout")


def test_mps_pods_get_memory_slices_and_held_slices_are_never_touched(scene: Scene) -> None:
    _with_mps_node(scene)
    client = scene.client

    first = {"a10": 10, "b10": 10, "c30": 30, "d40": 40}
    for name, gb in first.items():
        client.create(_pod(scene, name, gb))
    got = scene.wait(lambda: scene.running(set(first)), "four MPS pods Running")
    assert all(got[n] == MPS_NODE for n in first), got

    def used_by_all(names: set[str]) -> bool:
        users = {sl.used_by for sl in _slices(scene).values() if sl.state is gl.InstanceState.USED}
        return {f"{scene.namespace}/{n}" for n in names} <= users

    scene.wait(lambda: used_by_all(set(first)), "each slice reported used by its pod")
    held = {k: (sl.memory_gb, sl.used_by) for k, sl in _slices(scene).items() if sl.used_by}
    node = client.get(Node, MPS_NODE)
    assert node.status is not None and node.status.allocatable is not None
    assert node.status.allocatable["nvidia.com/gpu-10gb"] == "2"
    assert node.status.allocatable["nvidia.com/gpu-40gb"] == "1"

    # c30 ends; a 70 GB pod fits only on its GPU, once its freed 30 GB slice is removed to make
    # room: the planner removes the free slice, never one a pod holds.
    (c30_key,) = [k for k, (_, user) in held.items() if user == f"{scene.namespace}/c30"]
    client.delete(Pod, "c30", namespace=scene.namespace, grace_period=0)
    del held[c30_key]
    scene.wait(
        lambda: c30_key not in _slices(scene) or not _slices(scene)[c30_key].used_by,
        "c30's slice released",
    )
    second = {"e70": 70}
    for name, gb in second.items():
        client.create(_pod(scene, name, gb))
    got = scene.wait(lambda: scene.running(set(second)), "the 70 GB pod Running")
    assert got["e70"] == MPS_NODE
    after = _slices(scene)
    for key, (gb, user) in held.items():
        assert key in after and after[key].memory_gb == gb and after[key].used_by == user, (
            key,
            after.get(key),
        )
    per_gpu: dict[int, int] = {}
    for (gpu, _), sl in after.items():
        per_gpu[gpu] = per_gpu.get(gpu, 0) + sl.memory_gb
    assert all(total <= 80 for total in per_gpu.values()), per_gpu


def _unified(scene: Scene, name: str, *, gpumem: int, gpucores: int | None = None) -> Pod:
    """HAMi's spelling in its MPS mode: ``nvidia.com/gpu`` + ``gpumem`` (+ ``gpucores``)."""
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(gpumem)}
    if gpucores is not None:
        limits["nvidia.com/gpucores"] = str(gpucores)
    return Pod(
        metadata=ObjectMeta(
            name=name, namespace=scene.namespace, annotations={"nvidia.com/vgpu-mode": "mps"}
        ),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ]
        ),
    )


def test_unified_pods_in_mps_mode_get_slices_advertised_as_nvidia_gpu(scene: Scene) -> None:
    """``nvidia.com/vgpu-mode: mps`` pods go to the mps node only (the scene's MIG nodes have
    room too): each gets a slice of its memory rounded up to whole GB, its ``gpucores`` as the
    share, reserved as ``nvidia.com/gpu``; the agent advertises the slices as ``nvidia.com/gpu``
    with the unified counters, and reports each slice used by its pod."""
    _with_mps_node(scene)
    client = scene.client

    asks = {"u8": (8000, 30), "u20": (20000, None), "u40": (40960, None)}
    for name, (mem, cores) in asks.items():
        client.create(_unified(scene, name, gpumem=mem, gpucores=cores))
    got = scene.wait(lambda: scene.running(set(asks)), "three unified MPS pods Running")
    assert all(got[n] == MPS_NODE for n in asks), got

    def users() -> dict[str, gl.SliceStatus]:
        return {sl.used_by.split("/", 1)[1]: sl for sl in _slices(scene).values() if sl.used_by}

    scene.wait(lambda: set(asks) <= set(users()), "each slice reported used by its pod")
    slices = users()
    assert {n: (slices[n].memory_gb, slices[n].cores) for n in asks} == {
        "u8": (8, 30),  # 8000 MiB -> 8 GB (nos rounds up to whole GB)
        "u20": (20, None),  # 19.5 GB -> 20
        "u40": (40, None),
    }
    # Released once used: the controller's next pass after the status (a spec write planned on
    # a version an agent's status write replaced meanwhile gets 409 and is planned again).
    scene.wait(
        lambda: (
            (lay := scene.layout(MPS_NODE)) is not None
            and not any(sl.reserved_for for g in lay.spec.gpus for sl in g.mps)
        ),
        "the slices' reservations released once used",
    )
    node = client.get(Node, MPS_NODE)
    assert node.status is not None and node.status.allocatable is not None
    alloc = node.status.allocatable
    assert alloc["nvidia.com/gpu"] == "3"
    assert not any(k.startswith("nvidia.com/gpu-") and v != "0" for k, v in alloc.items()), alloc
    assert alloc["nvidia.com/gpumem"] == str(2 * 80 * 1024)
    assert alloc["nvidia.com/gpucores"] == "200"
