"""The device plugin end to end against a fake kubelet of real gRPC servers on unix sockets."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import grpc
import pytest

from migpilot.agent.deviceplugin import (
    advertising,
    allocating,
    devices,
    health,
    podresources,
    serving,
)
from migpilot.mig import catalog
from tests.integration.kubelet_fake import FakeKubelet

H = "Healthy"
U = "Unhealthy"
MODEL = catalog.resolve_gpu("h100-80gb")


def make_node(layouts: list[list[tuple[str, int]] | None]) -> devices.NodeDevices:
    """H100s; ``None`` is a MIG-disabled GPU. MIG UUIDs name GPU, profile and start."""
    gpus, migs = [], []
    for i, layout in enumerate(layouts):
        gpus.append(
            devices.Gpu(i, f"GPU-{i}", MODEL, "NVIDIA H100 80GB HBM3", 81559, layout is not None)
        )
        for gi, (name, start) in enumerate(layout or [], start=1):
            migs.append(
                devices.MigDevice(
                    f"MIG-{i}-{name}-{start}", i, MODEL.profile_named(name), start, gi, 0
                )
            )
    return devices.NodeDevices(gpus=tuple(gpus), mig_devices=tuple(migs))


START = make_node([[("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)], None])
R1G = "nvidia.com/mig-1g.10gb"
R3G = "nvidia.com/mig-3g.40gb"
R2G = "nvidia.com/mig-2g.20gb"
GPU = "nvidia.com/gpu"


def settings(kubelet: FakeKubelet, **kw: object) -> serving.PluginSettings:
    return serving.PluginSettings(plugin_dir=kubelet.plugin_dir, kubelet_poll_s=0.02, **kw)  # type: ignore[arg-type]


@pytest.fixture
def plugin(kubelet: FakeKubelet) -> Iterator[serving.DevicePlugin]:
    dp = serving.DevicePlugin(settings(kubelet))
    dp.start(START)
    yield dp
    dp.stop()


def test_registers_every_resource_with_its_devices(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin
) -> None:
    kubelet.wait_registered(GPU, R1G, R3G)
    regs = {r.resource: r for r in kubelet.state.registrations}
    assert regs[R1G].endpoint == "nvidia-mig-1g.10gb.sock"
    assert regs[R1G].version == "v1beta1"
    assert regs[R1G].preferred_allocation
    assert kubelet.devices(GPU) == {"GPU-1": H}
    assert kubelet.devices(R1G) == {"MIG-0-1g.10gb-0": H, "MIG-0-1g.10gb-1": H}
    assert kubelet.devices(R3G) == {"MIG-0-3g.40gb-4": H}
    assert plugin.registered() == {GPU, R1G, R3G}


def test_device_changes_stream_without_restart(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin
) -> None:
    kubelet.wait_registered(GPU, R1G, R3G)
    streams = {r: kubelet.client(r) for r in (GPU, R1G, R3G)}
    # 1g@1 destroyed, 2g@2 created: the 1g list shrinks, a new resource registers on its own.
    plugin.update(make_node([[("1g.10gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)], None]))
    kubelet.wait_devices(R1G, {"MIG-0-1g.10gb-0": H})
    kubelet.wait_registered(R2G)
    assert kubelet.devices(R2G) == {"MIG-0-2g.20gb-2": H}
    # The 3g instance goes: its resource stays registered with zero devices.
    plugin.update(make_node([[("1g.10gb", 0), ("2g.20gb", 2)], None]))
    kubelet.wait_devices(R3G, {})
    for resource, stream in streams.items():
        assert kubelet.client(resource) is stream, f"{resource} was re-registered"
        assert not stream.ended
        assert kubelet.registrations(resource) == 1
    assert plugin.advertised()[R3G] == ()
    # It comes back on the same stream.
    plugin.update(make_node([[("1g.10gb", 0), ("2g.20gb", 2), ("3g.40gb", 4)], None]))
    kubelet.wait_devices(R3G, {"MIG-0-3g.40gb-4": H})
    assert kubelet.client(R3G) is streams[R3G]


def test_a_withheld_device_leaves_the_stream_and_allocate_refuses_it(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin
) -> None:
    # The agent is destroying MIG-0-1g.10gb-1: the kubelet is sent the list without it at once
    # (not at the pass's end), on the same stream, and an Allocate that still names it fails.
    kubelet.wait_registered(GPU, R1G, R3G)
    stream = kubelet.client(R1G)
    plugin.withhold(frozenset({"MIG-0-1g.10gb-1"}))
    kubelet.wait_devices(R1G, {"MIG-0-1g.10gb-0": H})
    assert kubelet.devices(R3G) == {"MIG-0-3g.40gb-4": H}
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(R1G, ["MIG-0-1g.10gb-1"])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "unknown device: MIG-0-1g.10gb-1 (being destroyed" in (err.value.details() or "")
    # The destroy was refused after all: listed again when the pass ends.
    plugin.withhold(frozenset())
    kubelet.wait_devices(R1G, {"MIG-0-1g.10gb-0": H, "MIG-0-1g.10gb-1": H})
    assert kubelet.client(R1G) is stream and kubelet.registrations(R1G) == 1


def test_invalid_single_view_changes_nothing(kubelet: FakeKubelet) -> None:
    node = make_node([[("1g.10gb", 0)], [("1g.10gb", 0)]])
    dp = serving.DevicePlugin(settings(kubelet, strategy=devices.MigStrategy.SINGLE))
    dp.start(node)
    try:
        kubelet.wait_devices(GPU, {"MIG-0-1g.10gb-0": H, "MIG-1-1g.10gb-0": H})
        with pytest.raises(advertising.InvalidMigConfigurationError, match="more than one"):
            dp.update(make_node([[("1g.10gb", 0)], [("2g.20gb", 0)]]))
        assert dp.advertised() == {
            GPU: (
                devices.Device("MIG-0-1g.10gb-0", 0, devices.Health.HEALTHY),
                devices.Device("MIG-1-1g.10gb-0", 1, devices.Health.HEALTHY),
            )
        }
    finally:
        dp.stop()


def test_allocate_envvar_and_unknown_device(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin
) -> None:
    kubelet.wait_registered(R1G)
    response = kubelet.allocate(R1G, ["MIG-0-1g.10gb-1"], ["MIG-0-1g.10gb-0"])
    envs = [dict(c.envs) for c in response.container_responses]
    assert envs == [
        {"NVIDIA_VISIBLE_DEVICES": "MIG-0-1g.10gb-1"},
        {"NVIDIA_VISIBLE_DEVICES": "MIG-0-1g.10gb-0"},
    ]
    assert plugin.handed_out() == {"MIG-0-1g.10gb-0", "MIG-0-1g.10gb-1"}
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(R1G, ["MIG-0-3g.40gb-4"])
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        'invalid allocation request for "nvidia.com/mig-1g.10gb": invalid request: '
        "unknown device: MIG-0-3g.40gb-4"
    )
    assert "MIG-0-3g.40gb-4" not in plugin.handed_out()


@pytest.mark.parametrize(
    ("resource", "ids", "twice"),
    [
        (R1G, ["MIG-0-1g.10gb-0", "MIG-0-1g.10gb-0"], "MIG-0-1g.10gb-0"),
        (R1G, ["MIG-0-1g.10gb-0", "MIG-0-1g.10gb-1", "MIG-0-1g.10gb-0"], "MIG-0-1g.10gb-0"),
        (GPU, ["GPU-1", "GPU-1"], "GPU-1"),
    ],
)
def test_allocate_refuses_a_device_named_twice_for_one_container(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin, resource: str, ids: list[str], twice: str
) -> None:
    """The kubelet never repeats an ID; a request that does is refused whole (it would hand
    the device out twice, ``NVIDIA_VISIBLE_DEVICES=a,a``), and nothing is recorded."""
    kubelet.wait_registered(resource)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(resource, ids[:1], ids)  # the second container's request repeats one
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == (
        f'invalid allocation request for "{resource}": invalid request: device {twice} is '
        "requested more than once for one container"
    )
    assert plugin.handed_out() == frozenset()
    # The same devices, once each, are served.
    once = list(dict.fromkeys(ids))
    (container,) = kubelet.allocate(resource, once).container_responses
    assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": ",".join(once)}


def test_allocate_cdi(kubelet: FakeKubelet) -> None:
    cdi = allocating.AllocateSettings(device_list_strategies=(devices.DeviceListStrategy.CDI_CRI,))
    dp = serving.DevicePlugin(settings(kubelet, allocate=cdi))
    dp.start(START)
    try:
        kubelet.wait_registered(R3G)
        (container,) = kubelet.allocate(R3G, ["MIG-0-3g.40gb-4"]).container_responses
        assert [d.name for d in container.cdi_devices] == [
            "k8s.device-plugin.nvidia.com/gpu=MIG-0-3g.40gb-4"
        ]
        assert dict(container.envs) == {}
    finally:
        dp.stop()


def test_preferred_allocation_packs(kubelet: FakeKubelet) -> None:
    node = make_node([[("1g.10gb", s) for s in range(7)], [("1g.10gb", 0), ("1g.10gb", 1)]])
    dp = serving.DevicePlugin(settings(kubelet))
    dp.start(node)
    try:
        kubelet.wait_registered(R1G)
        available = sorted(kubelet.devices(R1G))
        got = kubelet.preferred(R1G, available=available, must_include=[], size=2)
        assert got == ["MIG-1-1g.10gb-0", "MIG-1-1g.10gb-1"]
        got = kubelet.preferred(R1G, available=available, must_include=["MIG-0-1g.10gb-3"], size=3)
        assert got[0] == "MIG-0-1g.10gb-3"
        assert {g.split("-")[1] for g in got} == {"0"}
        with pytest.raises(grpc.RpcError) as err:
            kubelet.preferred(R1G, available=available, must_include=[], size=10)
        assert "not enough available devices" in err.value.details()
    finally:
        dp.stop()


@pytest.mark.parametrize("remove_plugin_sockets", [True, False])
def test_kubelet_restart_re_registers(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin, remove_plugin_sockets: bool
) -> None:
    kubelet.wait_registered(GPU, R1G, R3G)
    kubelet.restart(remove_plugin_sockets=remove_plugin_sockets)
    kubelet.wait_registered(GPU, R1G, R3G)
    assert kubelet.devices(R1G) == {"MIG-0-1g.10gb-0": H, "MIG-0-1g.10gb-1": H}
    # The restarted kubelet gets later changes on its new streams.
    plugin.update(make_node([[("1g.10gb", 0), ("3g.40gb", 4)], None]))
    kubelet.wait_devices(R1G, {"MIG-0-1g.10gb-0": H})
    (container,) = kubelet.allocate(R3G, ["MIG-0-3g.40gb-4"]).container_responses
    assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": "MIG-0-3g.40gb-4"}


def test_plugin_started_before_the_kubelet_registers_when_it_appears(root: pathlib.Path) -> None:
    fake = FakeKubelet(root)
    dp = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=fake.plugin_dir, kubelet_poll_s=0.02)
    )
    dp.start(START)
    try:
        assert dp.registered() == frozenset()
        fake.start()
        fake.wait_registered(GPU, R1G, R3G)
    finally:
        dp.stop()
        fake.stop()


def test_xid_marks_one_mig_device_unhealthy(
    kubelet: FakeKubelet, plugin: serving.DevicePlugin
) -> None:
    kubelet.wait_registered(R1G, R3G)
    ignored = plugin.report_xid(health.XidEvent("GPU-0", 13, gpu_instance_id=2))
    assert ignored == frozenset()
    hit = plugin.report_xid(health.XidEvent("GPU-0", 79, gpu_instance_id=2, compute_instance_id=0))
    assert hit == {"MIG-0-1g.10gb-1"}
    kubelet.wait_devices(R1G, {"MIG-0-1g.10gb-0": H, "MIG-0-1g.10gb-1": U})
    assert kubelet.devices(R3G) == {"MIG-0-3g.40gb-4": H}
    # Unhealthy for good: a new view keeps it so.
    plugin.update(START)
    assert dict((d.id, d.health.value) for d in plugin.advertised()[R1G]) == {
        "MIG-0-1g.10gb-0": H,
        "MIG-0-1g.10gb-1": U,
    }


def test_pod_resources_in_use(kubelet: FakeKubelet, plugin: serving.DevicePlugin) -> None:
    client = podresources.PodResourcesClient(kubelet.pod_resources_socket, timeout_s=0.5)
    in_use = podresources.KubeletInUse(client, plugin)
    try:
        kubelet.wait_registered(R1G)
        assert in_use.in_use() == frozenset()
        kubelet.assign("default", "a", R1G, ["MIG-0-1g.10gb-0"])
        kubelet.assign("default", "b", "example.com/fpga", ["fpga-0"])
        assert client.allocated_device_ids() == {"MIG-0-1g.10gb-0"}
        assert {c.pod for c in client.list()} == {"a", "b"}
        kubelet.allocate(R3G, ["MIG-0-3g.40gb-4"])  # handed out, not yet listed by the kubelet
        assert in_use.in_use() == {"MIG-0-1g.10gb-0", "MIG-0-3g.40gb-4"}
        kubelet.assign("default", "c", R3G, ["MIG-0-3g.40gb-4"])
        assert in_use.in_use() == {"MIG-0-1g.10gb-0", "MIG-0-3g.40gb-4"}
        kubelet.release_all()  # pods gone: the kubelet lists nothing, the ledger lets go
        assert in_use.in_use() == frozenset()
        kubelet.stop()
        with pytest.raises(podresources.PodResourcesError, match="PodResources List"):
            in_use.in_use()
    finally:
        client.close()
