"""dcgm-exporter's pod attribution applied to what migpilot's device plugin hands out.

dcgm-exporter labels a GPU metric with ``namespace``/``pod``/``container`` by calling the
kubelet's PodResources ``List`` and mapping each listed device ID to the key of a DCGM entity.
The rule is re-implemented here from its source (NVIDIA/dcgm-exporter,
``internal/pkg/transformation/kubernetes.go``: ``toDeviceToPod``, ``toDeviceToSharingPods``,
``getSharedGPU``; the entity key is ``Metric.GetIDOfType`` in ``internal/pkg/collector``; the
constants ``nvidia.com/gpu``, ``nvidia.com/mig-`` and ``MIG-`` in ``appconfig``):

- a device entry counts only if its resource is ``nvidia.com/gpu``, one named with
  ``--nvidia-resource-names``, or starts with ``nvidia.com/mig-``;
- a device ID starting ``MIG-`` is resolved through NVML (``GetMIGDeviceInfoByID``: parent GPU
  UUID and GPU-instance id) to the key ``<gpu index>-<gpu instance id>``; an ID holding ``::``
  is keyed by the part before it (the GPU UUID) and, with ``--kubernetes-virtual-gpus``, the
  part after becomes the ``vgpu`` label; every ID is also keyed as itself;
- a MIG entity's metric is looked up by ``<gpu index>-<gpu instance id>``, a whole GPU's by its
  UUID (the default ``--kubernetes-gpu-id-type uid``); without virtual GPUs one key holds one
  pod, the last listed.

The devices go through migpilot's real device plugin and the fake kubelet (real gRPC on unix
sockets): the kubelet's Allocate, then PodResources ``List`` read as dcgm-exporter reads it.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from migpilot.agent.deviceplugin import devices, serving
from migpilot.agent.kubeletapi.podresources.v1 import api_pb2 as pr
from migpilot.agent.kubeletapi.podresources.v1 import api_pb2_grpc as pr_grpc
from migpilot.sharing import config
from tests.integration.kubelet_fake import FakeKubelet
from tests.integration.test_deviceplugin import GPU, R1G, R3G, START, make_node

NVIDIA_RESOURCE_NAME = "nvidia.com/gpu"
NVIDIA_MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
MIG_UUID_PREFIX = "MIG-"


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    container: str
    vgpu: str = ""


def device_to_pods(
    listed: pr.ListPodResourcesResponse,
    node: devices.NodeDevices,
    *,
    resource_names: Iterable[str] = (),
    virtual_gpus: bool = False,
) -> dict[str, list[PodInfo]]:
    """dcgm-exporter's map from entity key to the containers it labels the entity's metrics
    with. ``node`` stands in for NVML (``GetMIGDeviceInfoByID`` and the GPU index of a UUID)."""
    extra = set(resource_names)
    by_uuid = {g.uuid: g.index for g in node.gpus}
    mig_info = {m.uuid: (node.gpus[m.gpu_index].uuid, m.gpu_instance_id) for m in node.mig_devices}
    out: dict[str, list[PodInfo]] = {}

    def put(key: str, who: PodInfo) -> None:
        out[key] = [*out.get(key, []), who] if virtual_gpus else [who]

    for pod in listed.pod_resources:
        for container in pod.containers:
            for device in container.devices:
                name = device.resource_name
                if (
                    name != NVIDIA_RESOURCE_NAME
                    and name not in extra
                    and not name.startswith(NVIDIA_MIG_RESOURCE_PREFIX)
                ):
                    continue
                who = PodInfo(pod.namespace, pod.name, container.name)
                for device_id in device.device_ids:
                    if virtual_gpus and "::" in device_id:
                        who = PodInfo(
                            who.namespace, who.name, who.container, device_id.split("::")[1]
                        )
                    if device_id.startswith(MIG_UUID_PREFIX):
                        found = mig_info.get(device_id)
                        if found is not None:
                            parent, gi = found
                            put(f"{by_uuid[parent]}-{gi}", who)
                        put(device_id[len(MIG_UUID_PREFIX) :], who)
                    elif "::" in device_id:
                        put(device_id.split("::")[0], who)
                    put(device_id, who)
    return out


def entity_keys(node: devices.NodeDevices) -> dict[str, str]:
    """The entities dcgm-exporter reports on this node, by the key it looks pods up with: a MIG
    instance by ``<gpu>-<gpu instance id>``, a GPU with MIG disabled by its UUID."""
    keys = {f"{m.gpu_index}-{m.gpu_instance_id}": m.uuid for m in node.mig_devices}
    keys |= {g.uuid: g.uuid for g in node.gpus if not g.mig_enabled}
    return keys


def attributed(
    kubelet: FakeKubelet, node: devices.NodeDevices, **kw: object
) -> dict[str, list[PodInfo]]:
    """Each entity (by its device's ID) and who dcgm-exporter labels it with, from a real
    PodResources ``List`` on the kubelet's socket."""
    with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
        listed = pr_grpc.PodResourcesListerStub(channel).List(
            pr.ListPodResourcesRequest(), timeout=5.0
        )
    mapping = device_to_pods(listed, node, **kw)  # type: ignore[arg-type]
    return {dev: mapping[key] for key, dev in entity_keys(node).items() if key in mapping}


def give(kubelet: FakeKubelet, pod: str, resource: str, device_id: str) -> str:
    """The kubelet's Allocate for one container, then PodResources records the device; returns
    what the container sees."""
    (answer,) = kubelet.allocate(resource, [device_id]).container_responses
    kubelet.assign("team", pod, resource, [device_id])
    return str(answer.envs["NVIDIA_VISIBLE_DEVICES"])


@pytest.fixture
def mig_plugin(kubelet: FakeKubelet) -> Iterator[serving.DevicePlugin]:
    settings = serving.PluginSettings(plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02)
    dp = serving.DevicePlugin(settings)
    dp.start(START)
    yield dp
    dp.stop()


def team(*pods: str) -> list[PodInfo]:
    return [PodInfo("team", p, "main") for p in pods]


def test_mig_instances_and_whole_gpus_are_attributed_to_their_pods(
    kubelet: FakeKubelet, mig_plugin: serving.DevicePlugin
) -> None:
    # START: GPU 0 in MIG mode (1g.10gb at 0 and 1, 3g.40gb at 4; GPU-instance ids 1, 2, 3),
    # GPU 1 whole. The plugin advertises MIG UUIDs under nvidia.com/mig-<profile> and the
    # whole GPU's UUID under nvidia.com/gpu.
    kubelet.wait_registered(GPU, R1G, R3G)
    assert kubelet.devices(R1G).keys() == {"MIG-0-1g.10gb-0", "MIG-0-1g.10gb-1"}
    assert kubelet.devices(GPU).keys() == {"GPU-1"}
    # Each container sees exactly the device dcgm-exporter will attribute to it.
    assert give(kubelet, "small", R1G, "MIG-0-1g.10gb-1") == "MIG-0-1g.10gb-1"
    assert give(kubelet, "large", R3G, "MIG-0-3g.40gb-4") == "MIG-0-3g.40gb-4"
    assert give(kubelet, "whole", GPU, "GPU-1") == "GPU-1"
    assert attributed(kubelet, START) == {
        "MIG-0-1g.10gb-1": team("small"),
        "MIG-0-3g.40gb-4": team("large"),
        "GPU-1": team("whole"),
    }  # the free 1g.10gb at 0 (GPU instance 0-1) has no pod
    assert attributed(kubelet, START, virtual_gpus=True) == attributed(kubelet, START)


def test_the_rule_refuses_what_it_does_not_know(kubelet: FakeKubelet) -> None:
    """The re-implemented rule can fail: a MIG device under another resource name, or a GPU
    listed by index, is not attributed."""
    kubelet.assign("team", "odd", "example.com/mig-1g.10gb", ["MIG-0-1g.10gb-0"])
    kubelet.assign("team", "byindex", GPU, ["1"])
    kubelet.assign("team", "ok", GPU, ["GPU-1"])
    assert attributed(kubelet, START) == {"GPU-1": team("ok")}


def test_mps_slices_are_not_attributed_per_pod(
    kubelet: FakeKubelet, tmp_path: pathlib.Path
) -> None:
    gpus = tuple(
        devices.Gpu(i, f"GPU-{i}", g.model, g.product_name, g.memory_mib, False)
        for i, g in enumerate(START.gpus)
    )
    node = devices.NodeDevices(
        gpus=gpus,
        mps_slices=(devices.MpsSlice(0, 0, 10), devices.MpsSlice(0, 1, 10)),
    )
    settings = serving.PluginSettings(
        plugin_dir=kubelet.plugin_dir,
        kubelet_poll_s=0.02,
        strategy=devices.MigStrategy.NONE,
        mps_root=str(tmp_path),
    )
    dp = serving.DevicePlugin(settings)
    dp.start(node)
    try:
        g10 = "nvidia.com/gpu-10gb"
        kubelet.wait_registered(g10, GPU)
        give(kubelet, "a", g10, "GPU-0::mps-0")
        give(kubelet, "b", g10, "GPU-0::mps-1")
        give(kubelet, "c", GPU, "GPU-1")
        # nvidia.com/gpu-<N>gb is not a resource dcgm-exporter reads: GPU 0 gets no pod.
        assert attributed(kubelet, node) == {"GPU-1": team("c")}
        # Named with --nvidia-resource-names, both slices collapse onto GPU 0's UUID: the
        # whole GPU's numbers go to one of the two pods.
        named = attributed(kubelet, node, resource_names=[g10])
        assert named == {"GPU-0": team("b"), "GPU-1": team("c")}
        # With --kubernetes-virtual-gpus each pod gets a copy of the whole GPU's series (the
        # same value twice), never its own slice's use.
        shared = attributed(kubelet, node, resource_names=[g10], virtual_gpus=True)
        assert shared["GPU-0"] == [
            PodInfo("team", "a", "main", "mps-0"),
            PodInfo("team", "b", "main", "mps-1"),
        ]
    finally:
        dp.stop()


def test_time_sliced_replicas_are_not_attributed_per_pod(kubelet: FakeKubelet) -> None:
    ts3 = config.parse(
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 3}]}}", source="test"
    )
    node = make_node([[("1g.10gb", 0)], None])
    settings = serving.PluginSettings(
        plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02, sharing=ts3
    )
    dp = serving.DevicePlugin(settings)
    dp.start(node)
    try:
        kubelet.wait_registered(GPU)
        assert give(kubelet, "x", GPU, "GPU-1::0") == "GPU-1"
        assert give(kubelet, "y", GPU, "GPU-1::2") == "GPU-1"
        # Two pods share GPU 1; dcgm-exporter keys both by its UUID and keeps the last.
        assert attributed(kubelet, node) == {"GPU-1": team("y")}
        shared = attributed(kubelet, node, virtual_gpus=True)
        assert shared == {
            "GPU-1": [PodInfo("team", "x", "main", "0"), PodInfo("team", "y", "main", "2")]
        }
    finally:
        dp.stop()
