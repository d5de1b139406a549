"""The GpuLayout's MPS slices in the device plugin, over real gRPC against the fake kubelet:
``nvidia.com/gpu-<N>gb`` registering with slice IDs, Allocate's MPS answer per container,
packing on one GPU, new slices on the live stream, PodResources naming the slice and its pod,
and a slice the spec dropped kept while the kubelet lists it."""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import grpc
import pytest

from migpilot.agent.deviceplugin import devices, podresources, serving
from migpilot.agent.sharing import slicing
from migpilot.api import gpulayouts as gl
from migpilot.mig import catalog
from tests.integration.kubelet_fake import FakeKubelet

H = "Healthy"
GPU = "nvidia.com/gpu"
G10 = "nvidia.com/gpu-10gb"
G20 = "nvidia.com/gpu-20gb"
H100 = catalog.resolve_gpu("h100-80gb")


def node(*sl: devices.MpsSlice) -> devices.NodeDevices:
    gpus = tuple(
        devices.Gpu(i, f"GPU-{i}", H100, "NVIDIA H100 80GB HBM3", 81559, False) for i in (0, 1)
    )
    return devices.NodeDevices(gpus=gpus, mps_slices=sl)


S = devices.MpsSlice


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="sl"))
    fake = FakeKubelet(path).start()
    yield fake
    fake.stop()
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin(kubelet: FakeKubelet, tmp_path: pathlib.Path) -> Iterator[serving.DevicePlugin]:
    settings = serving.PluginSettings(
        plugin_dir=kubelet.plugin_dir,
        kubelet_poll_s=0.02,
        strategy=devices.MigStrategy.NONE,
        mps_root=str(tmp_path),
    )
    dp = serving.DevicePlugin(settings)
    dp.start(node(S(0, 0, 10), S(0, 1, 10, 25), S(1, 2, 20)))
    yield dp
    dp.stop()


def test_slices_register_and_allocate_with_their_mps_env(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin, tmp_path: pathlib.Path
) -> None:
    kubelet.wait_registered(G10, G20)
    regs = {r.resource: r for r in kubelet.state.registrations}
    assert regs[G10].endpoint == "nvidia-gpu-10gb.sock"
    assert kubelet.devices(G10) == {"GPU-0::mps-0": H, "GPU-0::mps-1": H}
    assert kubelet.devices(G20) == {"GPU-1::mps-2": H}
    assert GPU not in plugin.registered()  # both GPUs are sliced: neither is advertised whole
    (a, b) = kubelet.allocate(G10, ["GPU-0::mps-1"], ["GPU-0::mps-0"]).container_responses
    assert dict(a.envs) == {
        "NVIDIA_VISIBLE_DEVICES": "GPU-0",
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/gpu-0/pipe",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=10240M",
    }
    assert [(m.host_path, m.container_path) for m in a.mounts] == [
        (f"{tmp_path}/gpu-0/pipe", "/mps/gpu-0/pipe"),
        (f"{tmp_path}/shm", "/dev/shm"),
    ]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in b.envs
    (c,) = kubelet.allocate(G20, ["GPU-1::mps-2"]).container_responses
    assert c.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/gpu-1/pipe"
    assert c.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert plugin.handed_out() == {"GPU-0::mps-0", "GPU-0::mps-1", "GPU-1::mps-2"}
    assert [d.resource for d in plugin.mps_daemons()] == ["gpu-0", "gpu-1"]


def test_unknown_slice_and_two_gpus_are_refused(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin
) -> None:
    kubelet.wait_registered(G10)
    with pytest.raises(grpc.RpcError) as caught:
        kubelet.allocate(G10, ["GPU-1::mps-2"])
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        'invalid allocation request for "nvidia.com/gpu-10gb": invalid request: unknown device: '
        "GPU-1::mps-2"
    )
    plugin.update(node(S(0, 0, 10), S(1, 5, 10)))
    kubelet.wait_devices(G10, {"GPU-0::mps-0": H, "GPU-1::mps-5": H})
    with pytest.raises(grpc.RpcError, match="cannot share one container's MPS pipe"):
        kubelet.allocate(G10, ["GPU-0::mps-0", "GPU-1::mps-5"])
    # The preferred allocation packs a container's slices onto one GPU.
    plugin.update(node(S(0, 0, 10), S(1, 5, 10), S(1, 6, 10)))
    kubelet.wait_devices(G10, {"GPU-0::mps-0": H, "GPU-1::mps-5": H, "GPU-1::mps-6": H})
    got = kubelet.preferred(G10, available=sorted(kubelet.devices(G10)), must_include=[], size=2)
    assert sorted(got) == ["GPU-1::mps-5", "GPU-1::mps-6"]


def test_a_slice_the_spec_drops_stays_while_the_kubelet_lists_it(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin
) -> None:
    kubelet.wait_registered(G10, G20)
    stream = kubelet.client(G10)
    kubelet.allocate(G20, ["GPU-1::mps-2"])
    kubelet.assign("default", "p", G20, ["GPU-1::mps-2"])
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=5.0)
    asked = podresources.KubeletInUse(client, plugin)
    try:
        held = asked.in_use()
        assert {"GPU-1::mps-2", "GPU-1"} <= held
        assert asked.holders() == {"GPU-1::mps-2": "default/p"}
        # The filter served the old spec; the controller's new one cuts GPU 0 in 40 GB halves
        # and drops GPU 1's slice.
        old = gl.LayoutSpec(
            (
                gl.GpuSpec(0, None, (), (gl.SliceSpec(0, 10), gl.SliceSpec(1, 10, 25))),
                gl.GpuSpec(1, None, (), (gl.SliceSpec(2, 20),)),
            )
        )
        new = gl.LayoutSpec((gl.GpuSpec(0, None, (), (gl.SliceSpec(0, 40), gl.SliceSpec(1, 40))),))
        specs = [old]
        bare = devices.NodeDevices(gpus=node().gpus)
        sliced = slicing.SliceFilter(spec=lambda: specs[-1], held=asked.in_use)
        assert sliced.update(bare) == node(S(0, 0, 10), S(0, 1, 10, 25), S(1, 2, 20))
        specs.append(new)
        after = sliced.update(bare)
        assert after.mps_slices == (S(0, 0, 40), S(0, 1, 40), S(1, 2, 20))
        plugin.update(after)
        kubelet.wait_devices(G10, {})
        kubelet.wait_devices("nvidia.com/gpu-40gb", {"GPU-0::mps-0": H, "GPU-0::mps-1": H})
        assert kubelet.devices(G20) == {"GPU-1::mps-2": H}
        assert kubelet.client(G10) is stream and not stream.ended  # nothing restarted
        # The pod ends: the slice goes at the next update.
        kubelet.release_all()
        plugin.update(sliced.update(bare))
        kubelet.wait_devices(G20, {})
        assert plugin.handed_out() == frozenset()
    finally:
        client.close()
