"""GPU sharing (NVIDIA's time-slicing and MPS config) in the device plugin, over real gRPC against
the fake kubelet: replica IDs, renamed resources registering, a config switch on the live
stream, Allocate's answers per container."""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import grpc
import pytest

from migpilot import errors
from migpilot.agent.deviceplugin import allocating, devices, podresources, serving
from migpilot.sharing import config
from tests.integration.kubelet_fake import FakeKubelet
from tests.integration.test_deviceplugin import GPU, R1G, START, make_node

H = "Healthy"
SHARED = "nvidia.com/gpu.shared"


def parse(text: str) -> config.Config:
    return config.parse(text, source="test")


TS3 = parse("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 3}]}}")
RENAMED = parse(
    "sharing: {timeSlicing: {renameByDefault: true, resources: [{name: gpu, replicas: 2}]}}"
)
MPS2 = parse("sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}")


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="mps"))
    fake = FakeKubelet(path).start()
    yield fake
    fake.stop()
    shutil.rmtree(path, ignore_errors=True)


def plugin_for(
    kubelet: FakeKubelet, node: devices.NodeDevices, **kw: object
) -> serving.DevicePlugin:
    settings = serving.PluginSettings(plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02, **kw)  # type: ignore[arg-type]
    dp = serving.DevicePlugin(settings)
    dp.start(node)
    return dp


def test_replica_ids_over_grpc(kubelet: FakeKubelet) -> None:
    dp = plugin_for(kubelet, START, sharing=TS3)
    try:
        kubelet.wait_registered(GPU, R1G)
        assert kubelet.devices(GPU) == {f"GPU-1::{n}": H for n in range(3)}
        assert kubelet.devices(R1G) == {"MIG-0-1g.10gb-0": H, "MIG-0-1g.10gb-1": H}
        (one, two) = kubelet.allocate(GPU, ["GPU-1::2"], ["GPU-1::0"]).container_responses
        assert one.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
        assert two.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
        assert not one.mounts
        # Time-slicing lets a container take two replicas unless the file says otherwise.
        (both,) = kubelet.allocate(GPU, ["GPU-1::0", "GPU-1::1"]).container_responses
        assert both.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
        assert dp.handed_out() >= {"GPU-1"}
    finally:
        dp.stop()


def test_renamed_resource_registers_its_own_server(kubelet: FakeKubelet) -> None:
    dp = plugin_for(kubelet, START, sharing=RENAMED)
    try:
        kubelet.wait_registered(SHARED, R1G)
        regs = {r.resource: r for r in kubelet.state.registrations}
        assert regs[SHARED].endpoint == "nvidia-gpu.shared.sock"
        assert kubelet.devices(SHARED) == {"GPU-1::0": H, "GPU-1::1": H}
        assert GPU not in dp.registered()
    finally:
        dp.stop()


def test_config_switch_changes_the_live_stream(kubelet: FakeKubelet) -> None:
    dp = plugin_for(kubelet, START)
    try:
        kubelet.wait_registered(GPU, R1G)
        stream = kubelet.client(GPU)
        assert kubelet.devices(GPU) == {"GPU-1": H}
        dp.set_sharing(TS3)
        kubelet.wait_devices(GPU, {f"GPU-1::{n}": H for n in range(3)})
        assert kubelet.client(GPU) is stream and not stream.ended
        assert kubelet.registrations(GPU) == 1
        # Renamed: the old resource advertises zero on its stream, the new one registers.
        dp.set_sharing(RENAMED)
        kubelet.wait_devices(GPU, {})
        kubelet.wait_registered(SHARED)
        assert kubelet.devices(SHARED) == {"GPU-1::0": H, "GPU-1::1": H}
        assert kubelet.client(GPU) is stream and not stream.ended
        # A config the node cannot satisfy changes nothing.
        bad = parse("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: [7]}]}}")
        with pytest.raises(errors.SharingConfigError, match="no matching device at index: 7"):
            dp.set_sharing(bad)
        assert dp.sharing() == RENAMED
        assert dp.advertised()[SHARED] == tuple(
            devices.Device(f"GPU-1::{n}", 1, devices.Health.HEALTHY) for n in range(2)
        )
        # Back to no sharing: the whole GPU again on the first stream.
        dp.set_sharing(config.EMPTY)
        kubelet.wait_devices(GPU, {"GPU-1": H})
        kubelet.wait_devices(SHARED, {})
        assert kubelet.client(GPU) is stream
    finally:
        dp.stop()


def test_mps_env_per_container_and_refusals(kubelet: FakeKubelet, tmp_path: pathlib.Path) -> None:
    node = make_node([None, None])
    with pytest.raises(errors.SharingConfigError, match="mixed is not supported with MPS"):
        serving.DevicePlugin(serving.PluginSettings(plugin_dir=kubelet.plugin_dir)).set_sharing(
            MPS2
        )
    dp = plugin_for(
        kubelet,
        node,
        sharing=MPS2,
        strategy=devices.MigStrategy.NONE,
        mps_root=str(tmp_path),
    )
    try:
        kubelet.wait_registered(GPU)
        assert set(kubelet.devices(GPU)) == {f"GPU-{i}::{n}" for i in (0, 1) for n in (0, 1)}
        (a, b) = kubelet.allocate(GPU, ["GPU-0::1"], ["GPU-1::0"]).container_responses
        for container, uuid in ((a, "GPU-0"), (b, "GPU-1")):
            assert container.envs["NVIDIA_VISIBLE_DEVICES"] == uuid
            assert container.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/mps/nvidia.com/gpu/pipe"
            assert container.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=40779M"
            assert container.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
            assert [(m.host_path, m.container_path, m.read_only) for m in container.mounts] == [
                (f"{tmp_path}/nvidia.com/gpu/pipe", "/mps/nvidia.com/gpu/pipe", False),
                (f"{tmp_path}/shm", "/dev/shm", False),
            ]
        with pytest.raises(grpc.RpcError) as caught:
            kubelet.allocate(GPU, ["GPU-0::0", "GPU-0::1"])
        assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert caught.value.details() == (
            'invalid allocation request for "nvidia.com/gpu": invalid request: maximum '
            "request size for shared resources is 1; found 2"
        )
        (daemon,) = dp.mps_daemons()
        assert daemon.pipe_dir == f"{tmp_path}/nvidia.com/gpu/pipe"
        assert [d.uuid for d in daemon.devices] == ["GPU-0", "GPU-1"]
        # Preferred allocation spreads replicas over the GPUs.
        got = kubelet.preferred(
            GPU, available=sorted(kubelet.devices(GPU)), must_include=[], size=2
        )
        assert {d.split("::")[0] for d in got} == {"GPU-0", "GPU-1"}
    finally:
        dp.stop()


def test_replicas_in_podresources_count_as_their_device(kubelet: FakeKubelet) -> None:
    dp = plugin_for(kubelet, START, sharing=RENAMED)
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=5.0)
    try:
        kubelet.wait_registered(SHARED)
        kubelet.assign("default", "p", SHARED, ["GPU-1::1"])
        # The GPU (kept from reconfiguring) and the replica (the GpuLayout reports it used).
        assert client.allocated_device_ids() == {"GPU-1", "GPU-1::1"}
    finally:
        client.close()
        dp.stop()


def test_mps_replicas_keep_the_cdi_names(kubelet: FakeKubelet, tmp_path: pathlib.Path) -> None:
    both = (devices.DeviceListStrategy.ENVVAR, devices.DeviceListStrategy.CDI_CRI)
    dp = plugin_for(
        kubelet,
        make_node([None, None]),
        sharing=MPS2,
        strategy=devices.MigStrategy.NONE,
        mps_root=str(tmp_path),
        allocate=allocating.AllocateSettings(device_list_strategies=both),
    )
    try:
        (answer,) = dp.allocate_containers(GPU, [["GPU-1::0"]])
        assert answer.cdi_devices == ("k8s.device-plugin.nvidia.com/gpu=GPU-1",)
        assert answer.envs["NVIDIA_VISIBLE_DEVICES"] == "GPU-1"
        assert answer.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50"
        assert answer.mounts == (
            (f"{tmp_path}/nvidia.com/gpu/pipe", "/mps/nvidia.com/gpu/pipe"),
            (f"{tmp_path}/shm", "/dev/shm"),
        )
        assert dp.handed_out() == {"GPU-1"}  # the replica is held as its real device
    finally:
        dp.stop()


def test_a_held_replica_is_forgotten_with_its_gpu(kubelet: FakeKubelet) -> None:
    dp = plugin_for(kubelet, START, sharing=TS3)
    try:
        dp.allocate_containers(GPU, [["GPU-1::2"]])
        assert dp.handed_out() == {"GPU-1"}  # held as the real device
        dp.update(make_node([[("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)], None]))
        assert dp.handed_out() == {"GPU-1"}  # still advertised (as replicas): still held
        dp.update(make_node([[("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)]]))
        assert dp.handed_out() == set()  # GPU 1 is gone, and with it its replicas
    finally:
        dp.stop()
