"""Per-device, per-pod GPU series: the pure row builder, the cgroup parser, the load file, and
sampling through the emulated backend and the NVML stand-in."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from migpilot import errors
from migpilot.agent import metrics, running, sampling, usage
from migpilot.agent.deviceplugin import devices
from migpilot.api import gpulayouts as gl
from migpilot.gpu import backend, emulated, nvml, nvml_standin
from migpilot.mig import catalog

H100 = catalog.resolve_gpu("h100-80gb")
A100 = catalog.resolve_gpu("a100-40gb")
MIB = 1024 * 1024


def _node(model: object, *, mig: bool = True) -> tuple[emulated.EmulatedBackend, str | None]:
    emu = emulated.EmulatedBackend([model], durable=False, mig_enabled=mig)  # type: ignore[list-item]
    if not mig:
        return emu, None
    dev = emu.create_instance(0, profile=emu.model(0).profiles[0].name, start=0)
    return emu, dev.uuid


def _view(
    emu: emulated.EmulatedBackend, slices: tuple[devices.MpsSlice, ...] = ()
) -> devices.NodeDevices:
    state = {
        info.index: running.changes.GpuState(info, emu.mig_devices(info.index))
        for info in emu.gpus()
    }
    view = running.node_view(state)
    return devices.NodeDevices(gpus=view.gpus, mig_devices=view.mig_devices, mps_slices=slices)


def _rows(
    emu: emulated.EmulatedBackend,
    view: devices.NodeDevices,
    held: list[usage.Holding],
    loads: dict[str, usage.PodLoad],
) -> dict[tuple[str, str], float]:
    emu.drive(lambda: usage.device_loads(loads, held))
    samples = {g.index: emu.sample(g.index) for g in view.gpus}
    owners = sampling.emulated_owners(emu)([p for s in samples.values() for p in s.processes or ()])
    rows = usage.series(node="n1", view=view, holdings=held, samples=samples, owners=owners)
    return {
        (r.name, dict(r.labels).get("device", dict(r.labels).get("state", ""))): r.value
        for r in rows
    }


def test_an_h100_mig_device_reports_its_pods_use_with_every_label() -> None:
    emu, uuid = _node(H100)
    assert uuid is not None
    view = _view(emu)
    held = [usage.Holding("ml", "train", "main", "nvidia.com/mig-1g.10gb", uuid)]
    emu.drive(lambda: usage.device_loads({"ml/train": usage.PodLoad(0.9, 2048)}, held))
    rows = usage.series(node="n1", view=view, holdings=held, samples={0: emu.sample(0)}, owners={})
    util = [r for r in rows if r.name == usage.DEVICE_UTILIZATION]
    assert len(util) == 1
    assert dict(util[0].labels) == {
        "node": "n1",
        "gpu": "0",
        "gpu_uuid": emu.gpus()[0].uuid,
        "device": uuid,
        "resource": "nvidia.com/mig-1g.10gb",
        "profile": "1g.10gb",
        "namespace": "ml",
        "pod": "train",
        "container": "main",
    }
    assert util[0].value == pytest.approx(0.9)
    used = [r for r in rows if r.name == usage.DEVICE_MEMORY_USED]
    assert used[0].value == 2048 * MIB
    states = {dict(r.labels)["state"]: r.value for r in rows if r.name == usage.INSTANCES}
    assert states == {"free": 0.0, "reserved": 0.0, "used": 1.0}


def test_an_a100_mig_device_has_memory_but_no_utilisation_not_a_zero() -> None:
    emu, uuid = _node(A100)
    assert uuid is not None
    held = [usage.Holding("ml", "p", "c", "nvidia.com/mig-1g.5gb", uuid)]
    got = _rows(emu, _view(emu), held, {"ml/p": usage.PodLoad(0.5, 100)})
    assert (usage.DEVICE_UTILIZATION, uuid) not in got
    assert (usage.GPU_UTILIZATION, "") not in {
        (k[0], "") for k in got if k[0] == usage.GPU_UTILIZATION
    }
    assert got[(usage.DEVICE_MEMORY_USED, uuid)] == 100 * MIB
    assert got[(usage.DEVICE_MEMORY_TOTAL, uuid)] > 0


def test_a_whole_gpu_reports_the_gpus_readings_with_an_empty_profile() -> None:
    emu, _ = _node(A100, mig=False)
    gpu = emu.gpus()[0].uuid
    held = [usage.Holding("a", "p", "c", "nvidia.com/gpu", gpu)]
    emu.drive(lambda: usage.device_loads({"a/p": usage.PodLoad(0.25, 10)}, held))
    rows = usage.series(
        node="n", view=_view(emu), holdings=held, samples={0: emu.sample(0)}, owners={}
    )
    util = next(r for r in rows if r.name == usage.DEVICE_UTILIZATION)
    assert dict(util.labels)["profile"] == ""
    assert util.value == pytest.approx(0.25)
    assert any(r.name == usage.GPU_UTILIZATION and r.value == pytest.approx(0.25) for r in rows)


def test_mps_slices_and_replicas_are_each_pods_own_processes() -> None:
    emu, _ = _node(H100, mig=False)
    gpu = emu.gpus()[0].uuid
    slices = (devices.MpsSlice(0, 1, 10), devices.MpsSlice(0, 2, 20))
    view = _view(emu, slices)
    held = [
        usage.Holding("a", "one", "c", "nvidia.com/gpu-10gb", f"{gpu}::mps-1"),
        usage.Holding("a", "two", "c", "nvidia.com/gpu-20gb", f"{gpu}::mps-2"),
    ]
    got = _rows(
        emu, view, held, {"a/one": usage.PodLoad(0.3, 6660), "a/two": usage.PodLoad(0.6, 20996)}
    )
    assert got[(usage.DEVICE_MEMORY_USED, f"{gpu}::mps-1")] == 6660 * MIB
    assert got[(usage.DEVICE_MEMORY_USED, f"{gpu}::mps-2")] == 20996 * MIB
    assert got[(usage.DEVICE_MEMORY_TOTAL, f"{gpu}::mps-2")] == 20 * 1024 * MIB
    assert got[(usage.DEVICE_UTILIZATION, f"{gpu}::mps-1")] == pytest.approx(0.3)
    assert got[(usage.GPU_UTILIZATION, "")] == pytest.approx(0.9)
    # profile of a slice
    rows = usage.series(
        node="n", view=view, holdings=held[:1], samples={0: emu.sample(0)}, owners={}
    )
    assert {dict(r.labels)["profile"] for r in rows if r.name.startswith("migpilot_device")} == {
        "mps-10gb"
    }


def test_a_shared_device_without_attribution_has_no_memory_row() -> None:
    emu, uuid = _node(H100)
    held = [usage.Holding("a", "p", "c", "nvidia.com/mig-1g.10gb", f"{uuid}::0")]
    emu.drive(lambda: usage.device_loads({"a/p": usage.PodLoad(0.5, 5)}, held))
    rows = usage.series(
        node="n", view=_view(emu), holdings=held, samples={0: emu.sample(0)}, owners=None
    )
    names = {r.name for r in rows if r.name.startswith("migpilot_device")}
    assert names == {usage.DEVICE_MEMORY_TOTAL}


def test_a_deleted_pods_series_are_gone_from_the_next_scrape() -> None:
    emu, uuid = _node(H100)
    assert uuid is not None
    view = _view(emu)
    sink = metrics.AgentMetrics()
    held: list[usage.Holding] = [usage.Holding("a", "gone", "c", "nvidia.com/mig-1g.10gb", uuid)]
    sampler = sampling.GpuSampler(
        node="n",
        gpus=emu,
        view=lambda: view,
        holdings=lambda: held,
        sink=sink,
        owners=sampling.emulated_owners(emu),
        driven=emu,
    )
    sampler.sample()
    assert b'pod="gone"' in sink.exposition()
    held = []
    sampler.sample()
    text = sink.exposition()
    assert b'pod="gone"' not in text
    assert b"migpilot_gpu_memory_used_bytes" in text


CGROUP_UID = "1f6c2b3a-9d4e-4c1b-8a7f-0123456789ab"


@pytest.mark.parametrize(
    "text",
    [
        f"0::/kubepods/besteffort/pod{CGROUP_UID}/0a1b2c\n",
        f"0::/kubepods/pod{CGROUP_UID}/0a1b2c\n",
        "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
        f"{CGROUP_UID.replace('-', '_')}.slice/cri-containerd-0a1b.scope\n",
        "12:memory:/kubepods.slice/kubepods-pod"
        f"{CGROUP_UID.replace('-', '_')}.slice/docker-0a1b.scope\n"
        f"11:cpu,cpuacct:/kubepods.slice/kubepods-pod{CGROUP_UID.replace('-', '_')}.slice\n",
        f"5:devices:/kubepods/burstable/pod{CGROUP_UID}/abc\n1:name=systemd:/\n",
    ],
)
def test_a_processes_cgroup_names_its_pod(text: str) -> None:
    assert usage.pod_uid(text) == CGROUP_UID


@pytest.mark.parametrize(
    "text",
    ["0::/system.slice/containerd.service\n", "0::/\n", "", "0::/user.slice/podman-pod1.scope\n"],
)
def test_a_process_of_no_pod_has_no_uid(text: str) -> None:
    assert usage.pod_uid(text) is None


def test_the_load_file_reads_pods_and_empty_files() -> None:
    assert usage.parse_load("", source="f") == {}
    got = usage.parse_load("ml/a: {utilization: 0.9, memoryUsedMiB: 2048}\nml/b: {}\n", source="f")
    assert got == {"ml/a": usage.PodLoad(0.9, 2048), "ml/b": usage.IDLE}


def test_a_pattern_gives_every_replica_its_load_and_a_pods_own_entry_wins() -> None:
    loads = usage.parse_load(
        "ml/web-abc12: {utilization: 0.1}\n"
        "ml/web-*: {utilization: 0.9, memoryUsedMiB: 512}\n"
        "ml/*: {utilization: 0.5}\n",
        source="f",
    )
    assert usage.load_of(loads, "ml/web-abc12") == usage.PodLoad(0.1, 0)  # its own entry
    assert usage.load_of(loads, "ml/web-7fxk2") == usage.PodLoad(0.9, 512)  # first match
    assert usage.load_of(loads, "ml/batch-0") == usage.PodLoad(0.5, 0)
    assert usage.load_of(loads, "other/web-7fxk2") == usage.IDLE  # another namespace
    assert usage.load_of({"ml/web": usage.PodLoad(1.0, 1)}, "ml/web-1") == usage.IDLE


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("ml/a: {utilization: 1.5}", "utilization"),
        ("ml/a: {utilization: yes}", "utilization"),
        ("ml/a: {memoryUsedMiB: -1}", "memoryUsedMiB"),
        ("ml/a: {memoryUsedMiB: 1.5}", "memoryUsedMiB"),
        ("ml/a: {util: 1}", "util"),
        ("nopod: {}", "NAMESPACE/POD"),
        ("- a", "map"),
    ],
)
def test_a_bad_load_file_names_the_field(text: str, field: str) -> None:
    with pytest.raises(errors.AgentConfigError, match=field):
        usage.parse_load(text, source="load.yaml")


def test_the_load_file_is_reread_and_a_bad_one_keeps_the_last_good(tmp_path: Path) -> None:
    path = tmp_path / "load.yaml"
    path.write_text("a/p: {utilization: 0.5}\n")
    f = sampling.LoadFile(path)
    f.load()
    assert f.current() == {"a/p": usage.PodLoad(0.5, 0)}
    assert not f.poll()
    path.write_text("a/p: {utilization: 0.75, memoryUsedMiB: 3}\n")
    os.utime(path, ns=(1, 1))
    assert f.poll()
    assert f.current() == {"a/p": usage.PodLoad(0.75, 3)}
    path.write_text("a/p: {utilization: 7}\n")
    os.utime(path, ns=(2, 2))
    assert not f.poll()
    assert f.current() == {"a/p": usage.PodLoad(0.75, 3)}


def test_a_missing_load_file_fails_at_start(tmp_path: Path) -> None:
    with pytest.raises(errors.AgentConfigError, match="emulated-load"):
        sampling.LoadFile(tmp_path / "none.yaml").load()


def test_nvml_sampling_through_the_standin_gives_gpm_from_the_second_sample() -> None:
    emu, uuid = _node(H100)
    assert uuid is not None
    gpu = nvml.NvmlBackend(nvml_standin.NvmlStandin(emu))
    held = [usage.Holding("a", "p", "c", "nvidia.com/mig-1g.10gb", uuid)]
    emu.drive(lambda: usage.device_loads({"a/p": usage.PodLoad(0.965, 6660)}, held))
    first = gpu.sample(0)
    assert first.instances[0].utilization is None  # GPM needs two samples
    assert first.instances[0].memory_used_bytes == 6660 * MIB
    second = gpu.sample(0)
    assert second.instances[0].utilization == pytest.approx(0.965)
    assert second.utilization is not None
    assert second.processes is not None
    assert [p.memory_used_bytes for p in second.processes] == [6660 * MIB]


def test_nvml_sampling_of_an_a100_gives_no_utilisation_in_mig_mode() -> None:
    emu, _uuid = _node(A100)
    gpu = nvml.NvmlBackend(nvml_standin.NvmlStandin(emu))
    gpu.sample(0)
    got = gpu.sample(0)
    assert got.utilization is None
    assert [i.utilization for i in got.instances] == [None]
    assert got.memory_used_bytes == 0


def test_nvml_sampling_lists_mps_clients_as_such() -> None:
    emu, _ = _node(H100, mig=False)
    g = emu.gpus()[0].uuid
    held = [usage.Holding("a", "p", "c", "nvidia.com/gpu-10gb", f"{g}::mps-1")]
    emu.drive(lambda: usage.device_loads({"a/p": usage.PodLoad(0.1, 6660)}, held))
    got = nvml.NvmlBackend(nvml_standin.NvmlStandin(emu)).sample(0)
    assert got.processes is not None
    assert [(p.mps, p.memory_used_bytes) for p in got.processes] == [(True, 6660 * MIB)]
    assert got.utilization == pytest.approx(0.1)  # MIG off: the utilisation rate
    assert isinstance(got, backend.GpuSample)


def test_an_instance_the_spec_reserves_reads_reserved_until_a_pod_holds_it() -> None:
    emu = emulated.EmulatedBackend([H100], durable=False)
    one = emu.create_instance(0, profile="1g.10gb", start=0)
    two = emu.create_instance(0, profile="1g.10gb", start=1)
    emu.create_instance(0, profile="2g.20gb", start=2)
    view = _view(emu)
    spec = gl.LayoutSpec(
        gpus=(
            gl.GpuSpec(
                index=0,
                model=None,
                instances=(
                    gl.InstanceSpec("1g.10gb", 0, "ml/a"),
                    gl.InstanceSpec("1g.10gb", 1, "ml/b"),
                    gl.InstanceSpec("2g.20gb", 2),
                ),
            ),
        )
    )
    reserved = usage.reserved_instances(spec, view)
    assert reserved == {one.uuid, two.uuid}
    assert usage.reserved_instances(None, view) == frozenset()
    # The spec names the start and profile: another profile at that start is not reserved.
    other = gl.LayoutSpec(gpus=(gl.GpuSpec(0, None, (gl.InstanceSpec("2g.20gb", 0, "ml/a"),)),))
    assert usage.reserved_instances(other, view) == frozenset()
    held = [usage.Holding("ml", "a", "", "nvidia.com/mig-1g.10gb", str(one.uuid))]
    rows = usage.series(
        node="n", view=view, holdings=held, samples={}, owners={}, reserved=reserved
    )
    states = {
        (dict(r.labels)["profile"], dict(r.labels)["state"]): r.value
        for r in rows
        if r.name == usage.INSTANCES
    }
    assert states == {
        ("1g.10gb", "used"): 1.0,  # held beats reserved
        ("1g.10gb", "reserved"): 1.0,
        ("1g.10gb", "free"): 0.0,
        ("2g.20gb", "free"): 1.0,
        ("2g.20gb", "reserved"): 0.0,
        ("2g.20gb", "used"): 0.0,
    }


def test_time_slicing_replicas_are_counted_by_state_and_a_held_one_is_profile_replica() -> None:
    """Two pods on replicas of one A100 (``GPU-x::0`` and ``::2``): each has its own device
    rows under profile ``replica``; the layout series counts the GPU's four replicas by the
    state the GpuLayout status gives them, as MIG instances are counted by theirs."""
    emu, _ = _node(A100, mig=False)
    gpu = emu.gpus()[0].uuid
    held = [
        usage.Holding("a", "one", "c", "nvidia.com/gpu", f"{gpu}::0"),
        usage.Holding("a", "two", "c", "nvidia.com/gpu", f"{gpu}::2"),
    ]
    used, free = gl.InstanceState.USED, gl.InstanceState.FREE
    replicas = {
        0: (
            gl.ReplicaStatus(0, used, "a/one"),
            gl.ReplicaStatus(1, gl.InstanceState.RESERVED),
            gl.ReplicaStatus(2, used),
            gl.ReplicaStatus(3, free),
        )
    }
    emu.drive(lambda: usage.device_loads({"a/one": usage.PodLoad(0.25, 100)}, held))
    rows = usage.series(
        node="n",
        view=_view(emu),
        holdings=held,
        samples={0: emu.sample(0)},
        owners=sampling.emulated_owners(emu)(list(emu.sample(0).processes or ())),
        replicas=replicas,
    )
    devs = {
        (dict(r.labels)["pod"], dict(r.labels)["profile"])
        for r in rows
        if r.name == usage.DEVICE_MEMORY_TOTAL
    }
    assert devs == {("one", usage.REPLICA_PROFILE), ("two", usage.REPLICA_PROFILE)}
    states = {
        (dict(r.labels)["gpu"], dict(r.labels)["profile"], dict(r.labels)["state"]): r.value
        for r in rows
        if r.name == usage.INSTANCES
    }
    assert states == {
        ("0", "replica", "used"): 2,
        ("0", "replica", "reserved"): 1,
        ("0", "replica", "free"): 1,
    }
    # Without replicas reported, no replica is counted (a GPU not shared has none).
    plain = usage.series(node="n", view=_view(emu), holdings=(), samples={}, owners={})
    assert not [r for r in plain if r.name == usage.INSTANCES]
