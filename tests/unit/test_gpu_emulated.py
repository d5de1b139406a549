"""The emulated GPU backend: NVML semantics, persistence, determinism, faults, the spec parser."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from migpilot import errors
from migpilot.gpu import backend, clocks, emulated
from migpilot.mig import catalog, layouts, pciids

H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30")
Kind = backend.ErrorKind


def _emu(*models: object, **kw: object) -> emulated.EmulatedBackend:
    ms = models or (H100,)
    return emulated.EmulatedBackend(list(ms), **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", catalog.gpu_models(), ids=lambda m: m.id)
def test_every_allowed_placement_creates_on_an_empty_gpu(model: object) -> None:
    emu = _emu(model)
    for p in emu.model(0).profiles:
        for start in p.placements:
            dev = emu.create_instance(0, profile=p.name, start=start)
            assert (dev.profile, dev.start, dev.ci_id) == (p.name, start, 0)
            assert dev.uuid is not None and dev.uuid.startswith("MIG-")
            assert emu.mig_devices(0) == (dev,)
            emu.destroy_instance(0, dev.gi_id)
            assert emu.mig_devices(0) == ()


@pytest.mark.parametrize(
    ("first", "second", "kind"),
    [
        (("3g.40gb", 0), ("2g.20gb", 2), Kind.INSUFFICIENT_RESOURCES),  # overlap
        (("7g.80gb", 0), ("1g.10gb", 7), Kind.INVALID_ARGUMENT),  # 1g.10gb never starts at 7
        (("4g.40gb", 0), ("4g.40gb", 0), Kind.INSUFFICIENT_RESOURCES),
        (("1g.10gb+me", 0), ("1g.10gb+me", 1), Kind.INSUFFICIENT_RESOURCES),  # one +me per GPU
        (("1g.10gb", 0), ("3g.39gb", 4), Kind.NOT_SUPPORTED),  # not a canonical H100 name
        (("1g.10gb", 0), ("2g.20gb", 3), Kind.INVALID_ARGUMENT),
    ],
)
def test_conflicts_fail_like_the_driver(
    first: tuple[str, int], second: tuple[str, int], kind: backend.ErrorKind
) -> None:
    emu = _emu()
    emu.create_instance(0, profile=first[0], start=first[1])
    before = emu.mig_devices(0)
    with pytest.raises(backend.BackendError) as info:
        emu.create_instance(0, profile=second[0], start=second[1])
    assert info.value.kind is kind
    assert emu.mig_devices(0) == before


def test_destroying_an_instance_with_processes_fails_in_use() -> None:
    emu = _emu()
    dev = emu.create_instance(0, profile="2g.20gb", start=0)
    assert dev.uuid is not None
    emu.attach_process(dev.uuid, 4242)
    assert emu.running_processes(0, dev.uuid) == (4242,)
    with pytest.raises(backend.BackendError) as info:
        emu.destroy_instance(0, dev.gi_id)
    assert info.value.kind is Kind.IN_USE
    assert emu.mig_devices(0) == (dev,)
    emu.detach_process(dev.uuid, 4242)
    emu.destroy_instance(0, dev.gi_id)
    assert emu.mig_devices(0) == ()


def test_gpu_instance_with_compute_instance_cannot_be_destroyed_first() -> None:
    emu = _emu()
    dev = emu.create_instance(0, profile="1g.10gb", start=3)
    with pytest.raises(backend.BackendError) as info:
        emu.destroy_gpu_instance(0, dev.gi_id)
    assert info.value.kind is Kind.IN_USE


def test_mig_disabled_gpu_refuses_instances_until_reset() -> None:
    emu = _emu(mig_enabled=False)
    assert emu.gpus()[0].mig == backend.MigMode(current=False, pending=False)
    with pytest.raises(backend.BackendError) as info:
        emu.create_instance(0, profile="7g.80gb", start=0)
    assert info.value.kind is Kind.NOT_SUPPORTED
    emu.block_reset(0)
    assert emu.set_mig_mode(0, enabled=True) == backend.MigMode(current=True, pending=True)
    emu.set_mig_mode(0, enabled=False)
    a30 = _emu(A30, mig_enabled=False)
    a30.block_reset(0)
    assert a30.set_mig_mode(0, enabled=True) == backend.MigMode(current=False, pending=True)
    assert a30.gpus()[0].mig == backend.MigMode(current=False, pending=True)
    a30.reset_gpu(0)
    assert a30.create_instance(0, profile="4g.24gb", start=0).profile == "4g.24gb"


def test_hopper_changes_mig_mode_at_once_and_ampere_after_its_reset_time() -> None:
    clock = clocks.VirtualClock()
    times = emulated.OperationTimes(set_mig_mode_s=0.5, mig_mode_reset_s=7.0)
    emu = _emu(H100, A30, clock=clock, times=times)
    t0 = clock.monotonic()
    assert emu.set_mig_mode(0, enabled=False) == backend.MigMode(False, False)
    assert clock.monotonic() - t0 == pytest.approx(0.5)
    t1 = clock.monotonic()
    assert emu.set_mig_mode(1, enabled=False) == backend.MigMode(False, False)
    assert clock.monotonic() - t1 == pytest.approx(7.5)
    # Asking for the mode a GPU already has changes nothing and takes no time.
    t2 = clock.monotonic()
    assert emu.set_mig_mode(1, enabled=False) == backend.MigMode(False, False)
    assert clock.monotonic() == t2


def test_a_mig_mode_change_is_refused_while_anything_is_on_the_gpu() -> None:
    emu = _emu(H100, H100)
    emu.create_instance(0, profile="1g.10gb", start=0)
    with pytest.raises(backend.BackendError) as info:
        emu.set_mig_mode(0, enabled=False)
    assert info.value.kind is Kind.IN_USE
    assert emu.gpus()[0].mig == backend.MigMode(True, True)
    assert emu.set_mig_mode(1, enabled=False) == backend.MigMode(False, False)
    whole = emu.gpus()[1].uuid
    emu.drive(lambda: {whole: emulated.Load(0.5, 100, "ns/p")})
    with pytest.raises(backend.BackendError, match="processes on") as info:
        emu.set_mig_mode(1, enabled=True)
    assert info.value.kind is Kind.IN_USE
    emu.drive(None)
    assert emu.set_mig_mode(1, enabled=True) == backend.MigMode(True, True)


def test_unknown_ids_are_not_found() -> None:
    emu = _emu()
    for call in (
        lambda: emu.mig_devices(3),
        lambda: emu.destroy_instance(0, 9),
        lambda: emu.create_compute_instance(0, 9),
        lambda: emu.running_processes(0, "MIG-nope"),
        lambda: emu.attach_process("MIG-nope", 1),
    ):
        with pytest.raises(backend.BackendError) as info:
            call()
        assert info.value.kind is Kind.NOT_FOUND


def test_state_survives_a_restart_and_is_written_atomically(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    first = _emu(H100, A30, state_path=path, seed=7)
    a = first.create_instance(0, profile="3g.40gb", start=4)
    b = first.create_instance(1, profile="2g.12gb", start=2)
    assert a.uuid is not None
    first.attach_process(a.uuid, 99)
    second = emulated.EmulatedBackend(state_path=path)
    assert second.gpus() == first.gpus()
    assert second.mig_devices(0) == (a,)
    assert second.mig_devices(1) == (b,)
    assert second.running_processes(0, a.uuid) == (99,)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpus.json"]  # no temp file left
    assert json.loads(path.read_text())["version"] == emulated.STATE_VERSION


def test_state_file_for_other_gpus_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    _emu(H100, state_path=path)
    with pytest.raises(errors.AgentConfigError, match="holds h100-80gb, not a30-24gb"):
        _emu(A30, state_path=path)
    for text in ("{not json", "[" * 100_000 + "]" * 100_000):
        path.write_text(text)
        with pytest.raises(errors.AgentConfigError, match="cannot read"):
            emulated.EmulatedBackend(state_path=path)


def test_uuids_are_deterministic_and_never_reused() -> None:
    def run(seed: int) -> list[str | None]:
        emu = _emu(H100, H100, seed=seed)
        out = [emu.gpus()[1].uuid]
        d = emu.create_instance(1, profile="1g.10gb", start=0)
        emu.destroy_instance(1, d.gi_id)
        out.append(d.uuid)
        out.append(emu.create_instance(1, profile="1g.10gb", start=0).uuid)
        return out

    assert run(1) == run(1)
    assert run(1) != run(2)
    uuids = run(1)
    assert uuids[1] != uuids[2]  # the same GI id and placement, a new device


def test_operations_take_time_on_the_injected_clock() -> None:
    clock = clocks.VirtualClock()
    times = emulated.OperationTimes(0.05, 0.03, 0.04, 0.1)
    emu = _emu(clock=clock, times=times)
    dev = emu.create_instance(0, profile="7g.80gb", start=0)
    assert clock.monotonic() == pytest.approx(0.08)
    emu.destroy_instance(0, dev.gi_id)
    assert clock.monotonic() == pytest.approx(0.22)


def test_injected_failure_fires_once_on_the_nth_call() -> None:
    emu = _emu()
    emu.inject(
        emulated.Fault(
            emulated.Step.CREATE_GPU_INSTANCE, 2, emulated.FaultEffect.FAIL, Kind.UNKNOWN
        )
    )
    emu.create_instance(0, profile="1g.10gb", start=0)
    with pytest.raises(backend.BackendError, match="injected failure") as info:
        emu.create_instance(0, profile="1g.10gb", start=1)
    assert info.value.kind is Kind.UNKNOWN
    assert [d.start for d in emu.mig_devices(0)] == [0]
    emu.create_instance(0, profile="1g.10gb", start=1)
    assert [d.start for d in emu.mig_devices(0)] == [0, 1]


@pytest.mark.parametrize(
    ("effect", "expected"),
    [
        (emulated.FaultEffect.CRASH_BEFORE, ()),
        (emulated.FaultEffect.CRASH_AFTER, ((None, "3g.40gb", 0),)),
    ],
)
def test_crash_between_the_two_steps_of_a_create_persists_what_happened(
    tmp_path: Path,
    effect: emulated.FaultEffect,
    expected: tuple[tuple[int | None, str, int], ...],
) -> None:
    path = tmp_path / "s.json"
    emu = _emu(state_path=path)
    step = emulated.Step.CREATE_GPU_INSTANCE
    emu.inject(emulated.Fault(step, 1, effect))
    with pytest.raises(emulated.SimulatedCrash):
        emu.create_instance(0, profile="3g.40gb", start=0)
    after = emulated.EmulatedBackend(state_path=path).mig_devices(0)
    assert tuple((d.ci_id, d.profile, d.start) for d in after) == expected


def test_any_step_fault_counts_every_change() -> None:
    emu = _emu()
    emu.inject(emulated.Fault(None, 3, emulated.FaultEffect.CRASH_AFTER))
    emu.create_instance(0, profile="1g.10gb", start=0)  # steps 1 and 2
    dev = emu.mig_devices(0)[0]
    with pytest.raises(emulated.SimulatedCrash, match="destroy-compute-instance"):
        emu.destroy_instance(0, dev.gi_id)  # step 3 takes effect, then the crash
    assert emu.mig_devices(0)[0].ci_id is None


def test_xid_events_name_the_mig_device() -> None:
    emu = _emu()
    dev = emu.create_instance(0, profile="2g.20gb", start=2)
    assert emu.wait_xid(0) is None
    emu.emit_xid(0, 79, gi_id=dev.gi_id, ci_id=0)
    emu.emit_xid(0, 48)
    first = emu.wait_xid(0.01)
    assert first is not None and (first.xid, first.mig_uuid) == (79, dev.uuid)
    second = emu.wait_xid(0)
    assert second is not None and (second.gi_id, second.mig_uuid) == (None, None)
    assert emu.wait_xid(0) is None


def test_gpu_info_comes_from_the_catalog() -> None:
    info = _emu(A30).gpus()[0]
    assert (info.index, info.model, info.product_name) == (0, A30, "NVIDIA A30")
    assert info.uuid.startswith("GPU-")
    assert info.memory_mib == 24003


@pytest.mark.parametrize(
    ("text", "models"),
    [
        ("emulated:h100-80gb:x8", ["h100-80gb"] * 8),
        ("emulated:a30", ["a30-24gb"]),
        ("emulated:NVIDIA A100-SXM4-40GB:x2,h100:x1", ["a100-40gb", "a100-40gb", "h100-80gb"]),
    ],
)
def test_spec_parses(text: str, models: list[str]) -> None:
    assert [m.id for m in emulated.parse_spec(text).models] == models


@pytest.mark.parametrize(
    ("text", "count", "mig"),
    [
        ("emulated:h100-80gb:x2:mig-off", 2, False),
        ("emulated:h100-80gb:x2:mig-on", 2, True),
        ("emulated:a30,h100:x1:mig-off", 2, False),
        ("emulated:h100-80gb", 1, True),
    ],
)
def test_spec_may_ask_for_gpus_with_mig_mode_off(text: str, count: int, mig: bool) -> None:
    spec = emulated.parse_spec(text)
    assert (len(spec.models), spec.mig_enabled) == (count, mig)
    gpus = emulated.EmulatedBackend(spec.models, mig_enabled=spec.mig_enabled, durable=False)
    assert all(g.mig is not None and g.mig.current is mig for g in gpus.gpus())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpu-magic", "unknown backend 'gpu-magic' (expected nvml or emulated:MODEL:xN"),
        ("emulated", "names no GPU model"),
        ("emulated:", "names no GPU model"),
        ("emulated:t4:x8", "unknown GPU 't4'"),
        ("emulated:h100-80gb:x0", "GPU count must be 1 to 64, got 0"),
        ("emulated:h100-80gb:8", "is not MODEL, MODEL:xN or 0xDEVICE[:0xSUBSYSTEM][:xN]"),
        ("emulated:a30,", "'' is not MODEL, MODEL:xN"),
        ("emulated:0x233010DE:0x16C110DE:extra:x2", "with one ':' at most"),
        ("emulated:0x233010DE:board", "subsystem id 'board' is not a 32-bit number"),
        ("emulated:0x1234ABCD:x2", "unknown GPU PCI device id 0x1234ABCD"),
        ("emulated:0x233010DE:x0", "GPU count must be 1 to 64, got 0"),
        ("emulated:h100-80gb:x40,a30:x40", "more than 64 GPUs"),
        ("emulated:mig-off", "unknown GPU 'mig-off'"),
    ],
)
def test_bad_spec_is_a_one_line_error(text: str, message: str) -> None:
    with pytest.raises(errors.AgentConfigError) as info:
        emulated.parse_spec(text)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_placements_respect_the_catalog_layout_rules() -> None:
    emu = _emu()
    for inst in layouts.place(H100, ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"]).instances:
        emu.create_instance(0, profile=inst.profile, start=inst.start)
    got = layouts.Layout.of(d.instance for d in emu.mig_devices(0))
    assert layouts.violation(H100, got.instances) is None
    assert len(got) == 4


# --- PCI ids --------------------------------------------------------------------------------

H100_SXM = 0x233010DE


def test_gpus_default_to_the_models_first_device_id_and_an_unknown_board() -> None:
    infos = _emu(H100, A30).gpus()
    assert [i.pci_id for i in infos] == [
        pciids.PciId(H100_SXM, 0),
        pciids.PciId(0x20B710DE, 0),
    ]


@pytest.mark.parametrize(
    ("text", "models", "ids"),
    [
        ("emulated:h100-80gb:x2", ["h100-80gb"] * 2, [None] * 2),
        (
            "emulated:0x233010DE:0x16C110DE:x2",
            ["h100-80gb"] * 2,
            ["0x233010DE:0x16C110DE"] * 2,
        ),
        ("emulated:0x233110de", ["h100-80gb"], ["0x233110DE:0x00000000"]),  # the PCIe card
        (
            "emulated:0x233010DE:0x16C010DE,0x233010DE:0x16C110DE:x1,a30",
            ["h100-80gb", "h100-80gb", "a30-24gb"],
            ["0x233010DE:0x16C010DE", "0x233010DE:0x16C110DE", None],
        ),
    ],
)
def test_spec_may_name_gpus_by_pci_id_and_board(
    text: str, models: list[str], ids: list[str | None]
) -> None:
    spec = emulated.parse_spec(text)
    assert [m.id for m in spec.models] == models
    assert [None if p is None else str(p) for p in spec.pci_ids] == ids
    emu = emulated.EmulatedBackend(spec.models, pci_ids=spec.pci_ids)
    defaults = [str(emulated.default_pci_id(m)) for m in spec.models]
    assert [str(i.pci_id) for i in emu.gpus()] == [
        d if i is None else i for i, d in zip(ids, defaults, strict=True)
    ]


def test_pci_ids_persist_in_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    board = pciids.PciId(H100_SXM, 0x16C110DE)
    _emu(H100, A30, state_path=path, pci_ids=[board, pciids.PciId(0x20B710DE)])
    gpus = json.loads(path.read_text())["gpus"]
    assert [(g["pci_device_id"], g["pci_subsystem_id"]) for g in gpus] == [
        (H100_SXM, 0x16C110DE),
        (0x20B710DE, 0),
    ]
    again = emulated.EmulatedBackend(state_path=path)
    assert again.gpus()[0].pci_id == board
    # GPUs named by model keep the file's ids; a GPU named by id must have it.
    by_model = emulated.parse_spec("emulated:h100-80gb,a30")
    assert (
        _emu(*by_model.models, state_path=path, pci_ids=by_model.pci_ids).gpus()[0].pci_id == board
    )
    mixed = emulated.parse_spec("emulated:0x233010DE:0x16C110DE,a30")
    _emu(*mixed.models, state_path=path, pci_ids=mixed.pci_ids)
    with pytest.raises(errors.AgentConfigError, match="holds GPUs with PCI ids"):
        _emu(H100, A30, state_path=path, pci_ids=[pciids.PciId(H100_SXM, 1), board])


def test_a_state_file_from_before_pci_ids_loads_with_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "old.json"
    _emu(H100, state_path=path)
    data = json.loads(path.read_text())
    for g in data["gpus"]:
        del g["pci_device_id"], g["pci_subsystem_id"]
    path.write_text(json.dumps(data))
    emu = emulated.EmulatedBackend(state_path=path)
    assert emu.gpus()[0].pci_id == pciids.PciId(H100_SXM, 0)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("pci_device_id", 0x20B710DE, r"GPU 0 \(h100-80gb\) cannot have PCI device id 0x20B710DE"),
        ("pci_subsystem_id", "0x16C110DE", "GPU 0: PCI id '0x16C110DE' is not a number"),
        ("pci_subsystem_id", 2**40, "is not 32-bit"),
    ],
)
def test_a_state_file_with_bad_pci_ids_is_refused(
    tmp_path: Path, field: str, value: object, message: str
) -> None:
    path = tmp_path / "bad.json"
    _emu(H100, state_path=path)
    data = json.loads(path.read_text())
    data["gpus"][0][field] = value
    path.write_text(json.dumps(data))
    with pytest.raises(errors.AgentConfigError, match=message) as info:
        emulated.EmulatedBackend(state_path=path)
    assert "\n" not in str(info.value)


def test_pci_ids_must_belong_to_the_model_and_be_one_per_gpu() -> None:
    with pytest.raises(errors.AgentConfigError, match="cannot have PCI device id 0x20B710DE"):
        _emu(H100, pci_ids=[pciids.PciId(0x20B710DE)])
    with pytest.raises(errors.AgentConfigError, match="1 PCI ids for 2 GPUs"):
        _emu(H100, A30, pci_ids=[pciids.PciId(H100_SXM)])
