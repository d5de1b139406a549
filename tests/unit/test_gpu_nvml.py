"""The real NVML adapter, run against the emulator-backed stand-in for ``pynvml``.

Every call the adapter makes goes through nvidia-ml-py's names, structs and error classes; the
stand-in raises the real ``pynvml.NVMLError`` subclasses, so the adapter's error mapping runs too.
"""

from __future__ import annotations

import ctypes

import pynvml
import pytest

from migpilot.agent import reconciling
from migpilot.agent.rules import changes
from migpilot.gpu import backend, emulated, nvml, nvml_standin
from migpilot.mig import catalog, layouts, pciids

H100 = catalog.resolve_gpu("h100-80gb")
A100 = catalog.resolve_gpu("a100-40gb")
Kind = backend.ErrorKind


def _pair(
    *models: object, **kw: object
) -> tuple[emulated.EmulatedBackend, nvml_standin.NvmlStandin, nvml.NvmlBackend]:
    emu = emulated.EmulatedBackend(list(models or (H100,)), **kw)  # type: ignore[arg-type]
    standin = nvml_standin.NvmlStandin(emu)
    return emu, standin, nvml.NvmlBackend(standin)


def test_gpus_match_the_emulated_hardware() -> None:
    emu, _, adapter = _pair(H100, A100, seed=3)
    assert adapter.gpus() == emu.gpus()


@pytest.mark.parametrize("model", catalog.gpu_models(), ids=lambda m: m.id)
def test_profiles_and_placements_are_read_from_the_driver(model: object) -> None:
    _, _, adapter = _pair(model)
    table = adapter.driver_profiles(0)
    assert [dp.profile for dp in table] == list(adapter.gpus()[0].model.profiles)  # type: ignore[union-attr]
    for dp in table:
        assert dp.placements == dp.profile.placements
        assert dp.instance_count == dp.profile.max_instances


def test_create_list_destroy_round_trip_agrees_with_the_emulator() -> None:
    emu, standin, adapter = _pair()
    made = [
        adapter.create_instance(0, profile=i.profile, start=i.start)
        for i in layouts.place(H100, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]).instances
    ]
    assert adapter.mig_devices(0) == emu.mig_devices(0)
    assert sorted(made, key=lambda d: d.start) == list(adapter.mig_devices(0))
    assert all(d.uuid and d.uuid.startswith("MIG-") for d in made)
    assert "nvmlDeviceCreateGpuInstanceWithPlacement" in standin.calls
    assert "nvmlGpuInstanceCreateComputeInstance" in standin.calls
    for dev in made:
        adapter.destroy_instance(0, dev.gi_id)
    assert adapter.mig_devices(0) == () == emu.mig_devices(0)
    assert standin.calls.count("nvmlComputeInstanceDestroy") == len(made)
    assert standin.calls.count("nvmlGpuInstanceDestroy") == len(made)


@pytest.mark.parametrize(
    ("profile", "start", "kind"),
    [
        ("2g.20gb", 4, Kind.INSUFFICIENT_RESOURCES),
        ("2g.20gb", 1, Kind.INVALID_ARGUMENT),
        ("5g.50gb", 0, Kind.NOT_SUPPORTED),
    ],
)
def test_driver_errors_map_to_kinds(profile: str, start: int, kind: backend.ErrorKind) -> None:
    _, _, adapter = _pair()
    adapter.create_instance(0, profile="3g.40gb", start=4)
    with pytest.raises(backend.BackendError) as info:
        adapter.create_instance(0, profile=profile, start=start)
    assert info.value.kind is kind
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kind", list(Kind))
def test_every_kind_survives_the_round_trip_through_nvml_codes(kind: backend.ErrorKind) -> None:
    emu, _, adapter = _pair()
    emu.inject(
        emulated.Fault(emulated.Step.CREATE_GPU_INSTANCE, 1, emulated.FaultEffect.FAIL, kind)
    )
    with pytest.raises(backend.BackendError) as info:
        adapter.create_instance(0, profile="7g.80gb", start=0)
    assert info.value.kind is kind


def test_the_standin_raises_the_real_nvml_error_classes() -> None:
    emu, standin, _ = _pair()
    emu.create_instance(0, profile="7g.80gb", start=0)
    handle = standin.nvmlDeviceGetHandleByIndex(0)
    info = standin.nvmlDeviceGetGpuInstanceProfileInfo(
        handle, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    )
    assert isinstance(info, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t)
    place = pynvml.c_nvmlGpuInstancePlacement_t(0, 1)
    with pytest.raises(pynvml.NVMLError_InsufficientResources):
        standin.nvmlDeviceCreateGpuInstanceWithPlacement(handle, info.id, ctypes.byref(place))
    with pytest.raises(pynvml.NVMLError_NotSupported):
        standin.nvmlDeviceGetGpuInstanceProfileInfo(
            handle, pynvml.NVML_GPU_INSTANCE_PROFILE_8_SLICE
        )
    with pytest.raises(AttributeError, match="does not implement nvmlDeviceGetPowerUsage"):
        standin.nvmlDeviceGetPowerUsage(handle)
    assert standin.NVML_ERROR_IN_USE == pynvml.NVML_ERROR_IN_USE


def test_the_standin_requires_init() -> None:
    emu = emulated.EmulatedBackend([H100])
    standin = nvml_standin.NvmlStandin(emu)
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        standin.nvmlDeviceGetCount()
    adapter = nvml.NvmlBackend(standin)
    adapter.close()
    with pytest.raises(backend.BackendError):
        adapter.gpus()


def test_half_made_instance_is_listed_without_uuid_and_repaired() -> None:
    emu, _, adapter = _pair()
    emu.inject(emulated.Fault(emulated.Step.CREATE_COMPUTE_INSTANCE, 1, emulated.FaultEffect.FAIL))
    with pytest.raises(backend.BackendError):
        adapter.create_instance(0, profile="4g.40gb", start=0)
    (half,) = adapter.mig_devices(0)
    assert (half.ci_id, half.uuid, half.complete) == (None, None, False)
    repaired = adapter.create_compute_instance(0, half.gi_id)
    assert repaired.complete and repaired.uuid is not None
    assert adapter.mig_devices(0) == (repaired,)


def test_processes_block_destroy_with_in_use() -> None:
    emu, _, adapter = _pair()
    dev = adapter.create_instance(0, profile="1g.10gb", start=5)
    assert dev.uuid is not None
    assert adapter.running_processes(0, dev.uuid) == ()
    emu.attach_process(dev.uuid, 31337)
    assert adapter.running_processes(0, dev.uuid) == (31337,)
    with pytest.raises(backend.BackendError) as info:
        adapter.destroy_instance(0, dev.gi_id)
    assert info.value.kind is Kind.IN_USE
    assert adapter.mig_devices(0) == (dev,)


def test_xid_events_arrive_through_the_event_set() -> None:
    emu, standin, adapter = _pair(H100, H100)
    dev = adapter.create_instance(1, profile="3g.40gb", start=0)
    assert adapter.wait_xid(0) is None
    emu.emit_xid(1, 94, gi_id=dev.gi_id, ci_id=0)
    event = adapter.wait_xid(0.01)
    assert event is not None
    assert (event.gpu, event.xid, event.gi_id, event.ci_id, event.mig_uuid) == (
        1,
        94,
        dev.gi_id,
        0,
        dev.uuid,
    )
    emu.emit_xid(0, 48)
    whole = adapter.wait_xid(0)
    assert whole is not None and (whole.gpu, whole.gi_id, whole.mig_uuid) == (0, None, None)
    assert standin.calls.count("nvmlDeviceRegisterEvents") == 2
    adapter.close()
    assert "nvmlEventSetFree" in standin.calls


def test_mig_disabled_gpu_lists_nothing_and_cannot_create() -> None:
    _, _, adapter = _pair(mig_enabled=False)
    assert adapter.gpus()[0].mig == backend.MigMode(False, False)
    assert adapter.mig_devices(0) == ()
    with pytest.raises(backend.BackendError) as info:
        adapter.create_instance(0, profile="7g.80gb", start=0)
    assert info.value.kind is Kind.NOT_SUPPORTED


def test_reconciler_drives_the_nvml_adapter() -> None:
    emu, _, adapter = _pair()
    adapter.create_instance(0, profile="7g.80gb", start=0)
    want = layouts.place(H100, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"])
    rec = reconciling.Reconciler(adapter, reconciling.InUseSet())
    report = rec.reconcile({0: changes.DesiredGpu(True, want)})
    assert report.converged and report.layout(0) == want
    assert layouts.Layout.of(d.instance for d in emu.mig_devices(0)) == want


def test_the_standin_reports_pci_ids_in_nvidia_ml_pys_struct() -> None:
    board = pciids.PciId(0x233010DE, 0x16C110DE)
    emu, standin, _ = _pair(H100, A100, pci_ids=[board, pciids.PciId(0x20B110DE)])
    standin.nvmlInit()
    info = standin.nvmlDeviceGetPciInfo(standin.nvmlDeviceGetHandleByIndex(0))
    assert isinstance(info, pynvml.nvmlPciInfo_t)
    assert (info.pciDeviceId, info.pciSubSystemId) == (0x233010DE, 0x16C110DE)
    assert info.busId == "00000000:01:00.0"  # nvidia-ml-py decodes char arrays
    other = standin.nvmlDeviceGetPciInfo(standin.nvmlDeviceGetHandleByIndex(1))
    assert (other.pciDeviceId, other.pciSubSystemId) == (0x20B110DE, 0)
    assert emu.gpus()[1].pci_id == pciids.PciId(0x20B110DE, 0)


def test_the_adapter_reads_each_gpus_own_pci_id() -> None:
    board = pciids.PciId(0x233010DE, 0x16C010DE)
    _, standin, adapter = _pair(H100, H100, pci_ids=[board, pciids.PciId(0x233110DE, 0x162610DE)])
    infos = adapter.gpus()
    assert [str(i.pci_id) for i in infos] == ["0x233010DE:0x16C010DE", "0x233110DE:0x162610DE"]
    assert "nvmlDeviceGetPciInfo" in standin.calls


def test_pci_info_of_a_bad_handle_is_an_nvml_error() -> None:
    _, standin, _ = _pair()
    standin.nvmlInit()
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        standin.nvmlDeviceGetPciInfo(ctypes.cast(ctypes.c_void_p(0), pynvml.c_nvmlDevice_t))


def test_set_mig_mode_through_nvml_follows_the_driver() -> None:
    emu, standin, adapter = _pair(H100, A100)
    adapter.create_instance(0, profile="1g.10gb", start=0)
    with pytest.raises(backend.BackendError) as info:
        adapter.set_mig_mode(0, enabled=False)
    assert info.value.kind is Kind.IN_USE
    assert "nvmlDeviceSetMigMode" not in standin.calls  # refused before the driver is asked
    assert adapter.set_mig_mode(1, enabled=False) == backend.MigMode(False, False)
    assert adapter.gpus()[1].mig == backend.MigMode(False, False)
    # A reset the driver cannot do leaves the mode pending (activationStatus IN_USE).
    emu.block_reset(1)
    assert adapter.set_mig_mode(1, enabled=True) == backend.MigMode(False, True)
    assert adapter.mig_devices(1) == ()
    emu.block_reset(1, blocked=False)
    assert adapter.set_mig_mode(1, enabled=True) == backend.MigMode(True, True)


def test_set_mig_mode_through_nvml_refuses_a_gpu_with_processes() -> None:
    emu, _, adapter = _pair(H100)
    emu.set_mig_mode(0, enabled=False)
    whole = emu.gpus()[0].uuid
    emu.drive(lambda: {whole: emulated.Load(0.2, 50, "ns/p")})
    with pytest.raises(backend.BackendError, match="processes") as info:
        adapter.set_mig_mode(0, enabled=True)
    assert info.value.kind is Kind.IN_USE
