"""The device plugin with the cdi-cri strategy writes the CDI spec before it advertises: a new
MIG device is in the spec before the kubelet hears of it, a destroyed one leaves it, a device the
driver's files do not describe is advertised Unhealthy, and Allocate's names are the spec's."""

from __future__ import annotations

import json
import pathlib

from migpilot.agent.deviceplugin import allocating, cdifiles, devices, serving
from migpilot.gpu import emulated_proc
from tests.integration.kubelet_fake import FakeKubelet
from tests.integration.test_deviceplugin import GPU, R1G, R2G, R3G, make_node

KIND = "k8s.device-plugin.nvidia.com/gpu"
H = "Healthy"
U = "Unhealthy"


class Recording:
    """A CDI sink that writes through a real writer and records what the kubelet had been
    sent when each write happened."""

    def __init__(self, writer: cdifiles.CdiWriter, kubelet: FakeKubelet) -> None:
        self.writer = writer
        self.kubelet = kubelet
        self.seen: list[tuple[frozenset[str], set[str]]] = []

    def write(
        self, node: devices.NodeDevices, resources: tuple[devices.Resource, ...]
    ) -> frozenset[str]:
        with self.kubelet.changed:
            sent = {i for c in self.kubelet.state.clients.values() if c.lists for i in c.lists[-1]}
        missing = self.writer.write(node, resources)
        names = frozenset(d["name"] for d in json.loads(self.writer.path.read_text())["devices"])
        self.seen.append((names, sent))
        return missing


def proc_for(root: pathlib.Path, node: devices.NodeDevices, *, without_ci: str = "") -> None:
    """The driver's proc files for ``node`` (emulated numbering); ``without_ci``: a MIG device
    whose compute instance's file is absent."""
    gpus = [
        emulated_proc.EmulatedGpu(
            g.index,
            g.uuid,
            g.product_name,
            tuple(
                (m.gpu_instance_id, None if m.uuid == without_ci else m.compute_instance_id)
                for m in node.mig_devices_on(g.index)
            ),
        )
        for g in node.gpus
    ]
    emulated_proc.sync(root, emulated_proc.tree(gpus))


def test_spec_before_advertising_and_without_destroyed_devices(
    kubelet: FakeKubelet, tmp_path: pathlib.Path
) -> None:
    proc = tmp_path / "root"
    first = make_node([[("1g.10gb", 0), ("3g.40gb", 4)], None])
    proc_for(proc, first)
    writer = cdifiles.CdiWriter(tmp_path / "cdi", node="n1", proc_root=proc, kind=KIND)
    sink = Recording(writer, kubelet)
    strategies = (devices.DeviceListStrategy.CDI_CRI,)
    dp = serving.DevicePlugin(
        serving.PluginSettings(
            plugin_dir=kubelet.plugin_dir,
            kubelet_poll_s=0.02,
            allocate=allocating.AllocateSettings(device_list_strategies=strategies),
        ),
        cdi=sink,
    )
    dp.start(first)
    try:
        kubelet.wait_registered(GPU, R1G, R3G)
        assert sink.seen[0] == ({"GPU-1", "MIG-0-1g.10gb-0", "MIG-0-3g.40gb-4"}, set())
        # A 2g.20gb is created, the 3g.40gb destroyed.
        second = make_node([[("1g.10gb", 0), ("2g.20gb", 2)], None])
        proc_for(proc, second)
        dp.update(second)
        kubelet.wait_registered(R2G)
        kubelet.wait_devices(R3G, {})
        names, sent = sink.seen[-1]
        assert names == {"GPU-1", "MIG-0-1g.10gb-0", "MIG-0-2g.20gb-2"}
        assert "MIG-0-2g.20gb-2" not in sent  # in the spec before the kubelet heard of it
        response = kubelet.allocate(R2G, ["MIG-0-2g.20gb-2"])
        (container,) = response.container_responses
        assert [d.name for d in container.cdi_devices] == [f"{KIND}=MIG-0-2g.20gb-2"]
        assert dict(container.envs) == {}
        # A device whose CI file the driver does not show: advertised, but Unhealthy.
        third = make_node([[("1g.10gb", 0), ("2g.20gb", 2), ("1g.10gb", 1)], None])
        proc_for(proc, third, without_ci="MIG-0-1g.10gb-1")
        dp.update(third)
        kubelet.wait_devices(R1G, {"MIG-0-1g.10gb-0": H, "MIG-0-1g.10gb-1": U})
        assert "MIG-0-1g.10gb-1" not in sink.seen[-1][0]
        # Its file appears: the next view makes it Healthy, in the spec.
        proc_for(proc, third)
        dp.update(third)
        kubelet.wait_devices(R1G, {"MIG-0-1g.10gb-0": H, "MIG-0-1g.10gb-1": H})
        assert "MIG-0-1g.10gb-1" in sink.seen[-1][0]
    finally:
        dp.stop()
