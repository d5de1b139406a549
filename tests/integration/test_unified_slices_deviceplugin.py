"""Unified pods served by MPS slices through the real device plugin and the fake kubelet (real
gRPC on unix sockets): the slices the GpuLayout spec reserves for unified pods (``resource:
nvidia.com/gpu``) are listed under ``nvidia.com/gpu`` with their slice IDs, each Allocate is
resolved to its pod and answered with that pod's slice and its MPS settings, GetPreferredAllocation
steers the kubelet to it, the status reports it used by its pod, and a slice moves between
``nvidia.com/gpu-<N>gb`` and ``nvidia.com/gpu`` on the live streams. Wired as ``migpilot agent
--node`` wires the slices' filter, the pool and the plugin; the Kubernetes side is the
in-memory API."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from migpilot.agent.cluster import boundpods, kubeapi
from migpilot.agent.deviceplugin import allocating, devices, resolving, serving
from migpilot.agent.sharing import slicing, unifying
from migpilot.api import gpulayouts as gl
from migpilot.mig import catalog
from tests.integration.kubelet_fake import FakeKubelet

NODE = "n0"
GPU = "nvidia.com/gpu"
G10 = "nvidia.com/gpu-10gb"
G40 = "nvidia.com/gpu-40gb"
H = "Healthy"
H100 = catalog.resolve_gpu("h100-80gb")
BARE = devices.NodeDevices(
    gpus=tuple(
        devices.Gpu(i, f"GPU-{i}", H100, "NVIDIA H100 80GB HBM3", 81559, False) for i in (0, 1)
    )
)


def pod_doc(name: str, mem: int, *, created: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    limits = {GPU: 1, "nvidia.com/gpumem": mem}
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": created,
        },
        "spec": {
            "nodeName": NODE,
            "containers": [{"name": "c", "resources": {"limits": limits}}],
        },
        "status": {"phase": "Pending"},
    }


def slice_doc(
    ident: int, gb: int, reserved: str | None = None, *, cores: int | None = None
) -> dict[str, Any]:
    out: dict[str, Any] = {"id": ident, "memoryGB": gb}
    if cores is not None:
        out["cores"] = cores
    if reserved is not None:
        out["reservedFor"] = reserved
        out["resource"] = GPU  # as the controller writes it for a unified pod
    return out


def layout_spec(gpu0: list[dict[str, Any]], gpu1: list[dict[str, Any]]) -> dict[str, Any]:
    return {"gpus": [{"index": 0, "mps": gpu0}, {"index": 1, "mps": gpu1}]}


@dataclass
class Node:
    api: kubeapi.InMemoryNodeApi
    book: boundpods.PodBook
    slices: slicing.SliceFilter
    pool: unifying.UnifiedPool
    plugin: serving.DevicePlugin

    def view(self) -> devices.NodeDevices:
        """What the agent's pass makes of the GPUs: the slices served, the pool set aside."""
        return self.pool.update(self.slices.update(BARE))

    def pass_(self) -> None:
        self.book.listed(self.api.list_pods(node=NODE).items)
        self.plugin.update(self.view())

    def states(self) -> dict[str, tuple[str, str | None]]:
        """Each slice's state and user as the status would report them."""
        view = self.view()
        found = self.api.layout(NODE)
        spec = found.spec if found is not None else None
        statuses = slicing.statuses(
            view, spec=spec, in_use=self.plugin.handed_out(), used_by=self.pool.used_by()
        )
        return {
            f"{g}/{s.id}": (s.state.value, s.used_by)
            for g, found in statuses.items()
            for s in found
        }


@pytest.fixture
def api() -> Iterator[kubeapi.InMemoryNodeApi]:
    found = kubeapi.InMemoryNodeApi()
    yield found
    found.close()


@pytest.fixture
def node(kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi, root: pathlib.Path) -> Iterator[Node]:
    api.put_spec(
        NODE,
        layout_spec(
            [slice_doc(0, 10), slice_doc(1, 10, "ns/a"), slice_doc(2, 20, "ns/b", cores=50)],
            [slice_doc(0, 40)],
        ),
    )
    api.put_pod(pod_doc("a", 8000))
    api.put_pod(pod_doc("b", 16000, created="2026-01-01T00:00:05Z"))
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)

    def spec() -> gl.LayoutSpec | None:
        found = api.layout(NODE)
        return found.spec if found is not None else None

    pool = unifying.UnifiedPool(api, node=NODE, pods=book, spec=spec)
    settings = serving.PluginSettings(
        plugin_dir=kubelet.plugin_dir,
        kubelet_poll_s=0.02,
        allocate_wait_s=0.5,
        allocate_poll_s=0.05,
        mps_root=str(root / "mps"),
    )
    plugin = serving.DevicePlugin(settings, unified=pool)
    pool.attach(plugin)
    sliced = slicing.SliceFilter(spec=spec, held=plugin.handed_out)
    found = Node(api, book, sliced, pool, plugin)
    plugin.start(found.view())
    yield found
    plugin.stop()


def test_each_unified_pod_gets_its_own_slice_with_its_mps_settings(
    kubelet: FakeKubelet, node: Node, root: pathlib.Path
) -> None:
    kubelet.wait_registered(GPU, G10, G40)
    assert kubelet.devices(GPU) == {"GPU-0::mps-1": H, "GPU-0::mps-2": H}
    assert kubelet.devices(G10) == {"GPU-0::mps-0": H}
    assert kubelet.devices(G40) == {"GPU-1::mps-0": H}
    assert [d.resource for d in node.plugin.mps_daemons()] == ["gpu-0", "gpu-1"]
    assert node.states()["0/1"] == ("reserved", None)
    # a is the older: GetPreferredAllocation steers the kubelet to a's slice.
    offered = ["GPU-0::mps-2", "GPU-0::mps-1"]
    assert kubelet.preferred(GPU, available=offered, must_include=[], size=1) == ["GPU-0::mps-1"]
    # The kubelet picks b's slice anyway: a still gets its own.
    (first,) = kubelet.allocate(GPU, ["GPU-0::mps-2"]).container_responses
    assert dict(first.envs) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-0",
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/gpu-0/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
    }
    assert [(m.host_path, m.container_path) for m in first.mounts] == [
        (f"{root}/mps/gpu-0/pipe", "/mps/gpu-0/pipe"),
        (f"{root}/mps/shm", "/dev/shm"),
    ]
    (second,) = kubelet.allocate(GPU, ["GPU-0::mps-1"]).container_responses
    assert dict(second.envs) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-0",
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/gpu-0/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50",
    }
    allocated = node.plugin.pod_allocations()
    assert {k: (a.unified, a.devices) for k, a in allocated.items()} == {
        "ns/a": (True, {"GPU-0::mps-1"}),
        "ns/b": (True, {"GPU-0::mps-2"}),
    }
    assert node.pool.used_by() == {"GPU-0::mps-1": "ns/a", "GPU-0::mps-2": "ns/b"}
    assert node.states() == {
        "0/0": ("free", None),
        "0/1": ("used", "ns/a"),
        "0/2": ("used", "ns/b"),
        "1/0": ("free", None),
    }
    # A third Allocate has no pod left: it waits, then names the problem.
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(GPU, ["GPU-0::mps-1"])
    assert "no pod bound to this node is waiting for 1 nvidia.com/gpu" in str(err.value.details())


def test_a_slice_moves_between_gpu_n_gb_and_nvidia_com_gpu_on_the_live_streams(
    kubelet: FakeKubelet, node: Node
) -> None:
    kubelet.wait_registered(GPU, G10, G40)
    streams = {r: kubelet.client(r) for r in (GPU, G10, G40)}
    # The controller reserves GPU 1's free slice for a new unified pod c.
    node.api.put_pod(pod_doc("c", 30000, created="2026-01-01T00:00:09Z"))
    node.api.put_spec(
        NODE,
        layout_spec(
            [slice_doc(0, 10), slice_doc(1, 10, "ns/a"), slice_doc(2, 20, "ns/b", cores=50)],
            [slice_doc(0, 40, "ns/c")],
        ),
    )
    node.pass_()
    kubelet.wait_devices(GPU, {"GPU-0::mps-1": H, "GPU-0::mps-2": H, "GPU-1::mps-0": H})
    kubelet.wait_devices(G40, {})
    for resource, stream in streams.items():  # nothing restarted, nothing registered again
        assert kubelet.client(resource) is stream and not stream.ended
        assert kubelet.registrations(resource) == 1
    kubelet.allocate(GPU, ["GPU-0::mps-1"])  # a
    kubelet.allocate(GPU, ["GPU-0::mps-1"])  # b
    (c,) = kubelet.allocate(GPU, ["GPU-0::mps-1"]).container_responses  # c, on GPU 1
    assert c.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/gpu-1/pipe"
    assert c.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40960M"
    # a goes (the API says so): its slice leaves the pool and is a gpu-10gb again.
    node.api.delete_pod("ns", "a")
    node.api.put_spec(
        NODE,
        layout_spec([slice_doc(0, 10), slice_doc(1, 10), slice_doc(2, 20)], [slice_doc(0, 40)]),
    )
    node.pass_()
    kubelet.wait_devices(GPU, {"GPU-0::mps-2": H, "GPU-1::mps-0": H})
    kubelet.wait_devices(G10, {"GPU-0::mps-0": H, "GPU-0::mps-1": H})
    assert set(node.plugin.pod_allocations()) == {"ns/b", "ns/c"}
    # b's and c's slices, no longer reserved in the spec, stay theirs, with their sizes.
    assert node.states()["0/2"] == ("used", "ns/b")
    assert node.states()["1/0"] == ("used", "ns/c")


def test_a_container_never_gets_mig_instances_and_slices_together(tmp_path: pathlib.Path) -> None:
    """Were a pod reserved a MIG instance and a slice, one container would talk to one MPS
    daemon for both: refused, before anything is recorded."""
    dp = serving.DevicePlugin(serving.PluginSettings(plugin_dir=tmp_path))
    pod = resolving.GpuPod("ns", "p", "uid-p", "", (resolving.Container("c", False, 2),), True)
    found = resolving.Decision(pod, pod.containers[0], ("MIG-a", "GPU-0::mps-1"))
    with pytest.raises(allocating.AllocationError) as err:
        dp._decided_answer(devices.Resource(GPU, ()), found)
    assert str(err.value) == (
        "pod ns/p: container c would get MIG instances and MPS slices together "
        "(MIG-a, GPU-0::mps-1); one container talks to one MPS daemon"
    )
    assert dp.pod_allocations() == {}
