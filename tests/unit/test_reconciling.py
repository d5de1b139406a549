"""The pure diff (one test per rule), the in-use sources, and desired layouts from mig-parted."""

from __future__ import annotations

import dataclasses

import pytest

from migpilot import errors
from migpilot.agent import reconciling
from migpilot.agent.rules import changes, desired
from migpilot.gpu import backend, emulated, nvml, nvml_standin
from migpilot.mig import catalog, layouts, migparted, pciids

H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30")
ChangeKind = changes.ChangeKind


def _info(
    index: int = 0, *, model: object = H100, mig: tuple[bool, bool] = (True, True)
) -> backend.GpuInfo:
    return backend.GpuInfo(
        index,
        f"GPU-{index}",
        "NVIDIA H100 80GB HBM3",
        model,
        81152,
        backend.MigMode(*mig),  # type: ignore[arg-type]
    )


def _dev(text: str, gi: int, *, gpu: int = 0, complete: bool = True) -> backend.MigDevice:
    profile, start = text.split("@")
    return backend.MigDevice(
        gpu,
        gi,
        0 if complete else None,
        profile,
        int(start),
        f"MIG-{gpu}-{gi}" if complete else None,
    )


def _layout(*texts: str) -> layouts.Layout:
    return layouts.Layout.of(layouts.Instance(int(t.split("@")[1]), t.split("@")[0]) for t in texts)


def _diff(
    devices: list[backend.MigDevice],
    want: layouts.Layout,
    in_use: frozenset[str] = frozenset(),
    **info: object,
) -> changes.Diff:
    state = changes.GpuState(_info(**info), tuple(devices))  # type: ignore[arg-type]
    return changes.diff(
        actual={0: state}, desired={0: changes.DesiredGpu(True, want)}, in_use=frozenset(in_use)
    )


def _ops(d: changes.Diff) -> list[str]:
    return [f"{a.kind.value} {a.instance}" for a in d.changes]


def test_empty_gpu_gets_every_instance_created_at_its_placement() -> None:
    d = _diff([], _layout("3g.40gb@0", "2g.20gb@4", "1g.10gb@6"))
    assert _ops(d) == ["create 3g.40gb@0", "create 2g.20gb@4", "create 1g.10gb@6"]
    assert d.refusals == ()


def test_matching_layout_needs_nothing() -> None:
    d = _diff([_dev("3g.40gb@0", 1), _dev("3g.40gb@4", 2)], _layout("3g.40gb@0", "3g.40gb@4"))
    assert d.changes == () and d.refusals == ()


def test_only_conflicting_instances_are_destroyed() -> None:
    devices = [_dev("3g.40gb@0", 1), _dev("2g.20gb@4", 2), _dev("1g.10gb@6", 3)]
    d = _diff(devices, _layout("3g.40gb@0", "1g.10gb@4", "1g.10gb@5", "1g.10gb@6"))
    assert _ops(d) == ["destroy 2g.20gb@4", "create 1g.10gb@4", "create 1g.10gb@5"]
    assert d.changes[0].gi_id == 2 and d.changes[0].uuid == "MIG-0-2"


def test_destroys_come_before_creates() -> None:
    d = _diff([_dev("7g.80gb@0", 1)], _layout("4g.40gb@0", "3g.40gb@4"))
    assert [a.kind for a in d.changes] == [ChangeKind.DESTROY, ChangeKind.CREATE, ChangeKind.CREATE]


def test_in_use_instance_is_never_destroyed_and_blocks_what_overlaps_it() -> None:
    d = _diff([_dev("2g.20gb@2", 1)], _layout("3g.40gb@0", "3g.40gb@4"), {"MIG-0-1"})
    assert _ops(d) == ["create 3g.40gb@4"]
    assert [str(r) for r in d.refusals] == [
        "GPU 0: 2g.20gb@2 (MIG-0-1) is in use; desired 3g.40gb@0 not created"
    ]


def test_in_use_instance_outside_the_desired_layout_is_kept_and_reported() -> None:
    d = _diff([_dev("1g.10gb@6", 1)], _layout("4g.40gb@0"), {"MIG-0-1"})
    assert _ops(d) == ["create 4g.40gb@0"]
    assert "1g.10gb@6 (MIG-0-1) is in use and not in the desired layout; kept" in str(d.refusals[0])


def test_in_use_elsewhere_can_still_block_by_compute_slices() -> None:
    # 3g@4 in use; desired 4g@0 + 2g@4: the 2g overlaps, the 4g fits (4 + 3 = 7 slices)
    d = _diff([_dev("3g.40gb@4", 1)], _layout("4g.40gb@0", "2g.20gb@4", "1g.10gb@6"), {"MIG-0-1"})
    assert _ops(d) == ["create 4g.40gb@0"]
    reasons = [r.reason for r in d.refusals]
    assert any("desired 2g.20gb@4 not created" in r for r in reasons)
    assert any("desired 1g.10gb@6 not created" in r for r in reasons)


def test_gpu_instance_without_compute_instance_is_repaired_when_desired() -> None:
    d = _diff([_dev("3g.40gb@0", 1, complete=False)], _layout("3g.40gb@0"))
    assert [(a.kind, a.gi_id) for a in d.changes] == [(ChangeKind.REPAIR, 1)]


def test_gpu_instance_without_compute_instance_is_destroyed_when_not_desired() -> None:
    d = _diff([_dev("3g.40gb@0", 1, complete=False)], _layout("7g.80gb@0"))
    assert _ops(d) == ["destroy 3g.40gb@0", "create 7g.80gb@0"]
    assert d.changes[0].uuid is None


@pytest.mark.parametrize(
    ("mig", "want", "message"),
    [
        ((False, False), True, "MIG mode is disabled, the desired layout needs it enabled"),
        ((True, True), False, "MIG mode is enabled, the desired layout needs it disabled"),
        ((False, True), True, "needs a GPU reset (not forced)"),
    ],
)
def test_mig_mode_mismatch_needs_a_reset_and_is_never_forced(
    mig: tuple[bool, bool], want: bool, message: str
) -> None:
    state = changes.GpuState(_info(mig=mig), (_dev("7g.80gb@0", 1),))
    d = changes.diff(
        actual={0: state},
        desired={0: changes.DesiredGpu(want, _layout("1g.10gb@0") if want else layouts.Layout(()))},
        in_use=frozenset(),
    )
    assert d.changes == ()
    assert message in d.refusals[0].reason


def test_pending_mode_change_is_reported_but_the_layout_still_reconciled() -> None:
    d = _diff([], _layout("7g.80gb@0"), mig=(True, False))
    assert _ops(d) == ["create 7g.80gb@0"]
    assert "pending: needs a GPU reset" in d.refusals[0].reason


@pytest.mark.parametrize(
    ("want", "message"),
    [
        (_layout("4g.40gb@0", "4g.40gb@4"), "is invalid"),
        (_layout("3g.20gb@0"), "has no MIG profile"),
    ],
)
def test_invalid_desired_layout_is_refused_whole(want: layouts.Layout, message: str) -> None:
    d = _diff([_dev("1g.10gb@0", 1)], want)
    assert d.changes == ()
    assert message in d.refusals[0].reason


def test_unknown_and_non_mig_gpus_are_refused() -> None:
    want = {3: changes.DesiredGpu(True, _layout("7g.80gb@0"))}
    d = changes.diff(actual={}, desired=want, in_use=frozenset())
    assert "no such GPU" in d.refusals[0].reason
    state = changes.GpuState(backend.GpuInfo(3, "GPU-3", "Tesla T4", None, 15360, None), ())
    d = changes.diff(actual={3: state}, desired=want, in_use=frozenset())
    assert "not a MIG-capable GPU" in d.refusals[0].reason


def test_gpus_not_in_the_desired_mapping_are_left_alone() -> None:
    state = changes.GpuState(_info(), (_dev("7g.80gb@0", 1),))
    assert changes.diff(actual={0: state}, desired={}, in_use=frozenset()).changes == ()


# --- in use ------------------------------------------------------------------------------------


def test_in_use_sources_combine() -> None:
    emu = emulated.EmulatedBackend([H100])
    a = emu.create_instance(0, profile="1g.10gb", start=0)
    b = emu.create_instance(0, profile="1g.10gb", start=1)
    assert a.uuid and b.uuid
    handed = reconciling.InUseSet(["MIG-pod"])
    reserved = reconciling.InUseSet()
    combined = reconciling.AnyOf([handed, reserved, reconciling.RunningProcesses(emu)])
    assert combined.in_use() == {"MIG-pod"}
    emu.attach_process(b.uuid, 1)
    reserved.add(a.uuid)
    assert combined.in_use() == {"MIG-pod", a.uuid, b.uuid}
    handed.discard("MIG-pod")
    reserved.replace([])
    assert combined.in_use() == {b.uuid}


# --- desired layouts from mig-parted -------------------------------------------------------------

CONFIG = migparted.parse(
    """
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  all-balanced:
    - device-filter: ["0x233010DE", "0x20B710DE"]
      devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
  custom:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - devices: [1]
      mig-enabled: true
      mig-devices: {"4g.40gb": 2}
""",
    source="mig.yaml",
)


def _gpus(n: int = 2) -> list[backend.GpuInfo]:
    return [_info(i) for i in range(n)]


def test_config_gives_each_matching_gpu_its_layout() -> None:
    out = desired.from_migparted(CONFIG, "all-balanced", gpus=_gpus())
    assert set(out) == {0, 1}
    assert out[0].layout == layouts.place(H100, ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"])
    off = desired.from_migparted(CONFIG, "all-disabled", gpus=_gpus())
    assert off == {0: changes.DesiredGpu(False), 1: changes.DesiredGpu(False)}


def test_placement_keeps_the_instances_already_there() -> None:
    current = {0: [_dev("1g.10gb@3", 1), _dev("3g.40gb@4", 2), _dev("2g.20gb@0", 3)]}
    out = desired.from_migparted(CONFIG, "all-balanced", gpus=_gpus(1), current=current)
    assert out[0].layout == _layout("2g.20gb@0", "1g.10gb@2", "1g.10gb@3", "3g.40gb@4")


def test_in_use_instances_are_kept_first() -> None:
    # only one of 3g@0 / 3g@4 can stay beside 4 x 1g; the in-use one wins
    conf = migparted.parse(
        "version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: true\n"
        '      mig-devices: {"3g.40gb": 1, "1g.10gb": 4}\n',
        source="c.yaml",
    )
    current = {0: [_dev("3g.40gb@0", 1), _dev("3g.40gb@4", 2)]}
    out = desired.from_migparted(conf, "c", gpus=_gpus(1), current=current, in_use={"MIG-0-2"})
    assert layouts.Instance(4, "3g.40gb") in out[0].layout.instances


def test_config_by_node_label() -> None:
    labels = {desired.CONFIG_LABEL: "custom"}
    out = desired.from_labels(CONFIG, labels, gpus=_gpus(1))
    assert len(out[0].layout) == 7
    assert desired.from_labels(CONFIG, {}, gpus=_gpus(1)) == {}


def test_config_that_cannot_be_placed_is_a_config_error() -> None:
    with pytest.raises(errors.ConfigError) as info:
        desired.from_migparted(CONFIG, "custom", gpus=_gpus(2))
    assert "entry 1 cannot be placed on GPU 1 (h100-80gb)" in str(info.value)
    assert "exceed its maximum of 1" in str(info.value)


def test_unknown_config_name_is_a_config_error() -> None:
    with pytest.raises(
        errors.ConfigError, match=r"no config 'all-balance'; did you mean 'all-balanced'"
    ):
        desired.from_migparted(CONFIG, "all-balance", gpus=_gpus())


def test_gpus_no_entry_matches_are_left_out() -> None:
    assert desired.from_migparted(CONFIG, "custom", gpus=[_info(2)]) == {}  # devices [0] and [1]
    a30 = backend.GpuInfo(0, "GPU-x", "NVIDIA A30", A30, 24003, backend.MigMode(True, True))
    with pytest.raises(errors.ConfigError, match="a30-24gb has no MIG profile matching '1g.10gb'"):
        desired.from_migparted(CONFIG, "custom", gpus=[a30])


BOARDS = migparted.parse(
    """
version: v1
mig-configs:
  by-board:
    - device-filter: "0x233010DE"
      devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
    - device-filter: "0x233010DE:0x16C110DE"
      devices: all
      mig-enabled: true
      mig-devices: {"7g.80gb": 1}
""",
    source="boards.yaml",
)
BOARD = pciids.PciId(0x233010DE, 0x16C110DE)
SIBLING = pciids.PciId(0x233010DE, 0x16C010DE)


def _with_id(index: int, pci_id: pciids.PciId) -> backend.GpuInfo:
    return dataclasses.replace(_info(index), pci_id=pci_id)


def test_entries_are_picked_by_each_gpus_own_board() -> None:
    gpus = [
        _with_id(0, BOARD),
        _with_id(1, SIBLING),  # a sibling board: never the board's entry
        _with_id(2, pciids.PciId(0x233010DE, 0)),  # a board nothing is known about
        _with_id(3, pciids.PciId(0x233110DE, 0x162610DE)),  # the PCIe card: neither entry
    ]
    out = desired.from_migparted(BOARDS, "by-board", gpus=gpus)
    assert out[0].layout == _layout("7g.80gb@0")
    assert len(out[1].layout) == 7
    assert len(out[2].layout) == 7
    assert 3 not in out  # left as it is, as mig-parted apply does


def test_a_gpu_without_an_id_is_matched_by_its_models_ids_with_no_board() -> None:
    out = desired.from_migparted(BOARDS, "by-board", gpus=[_info(0)])
    assert len(out[0].layout) == 7  # the device-only entry, never the board's


@pytest.mark.parametrize("through_nvml", [False, True], ids=["emulated", "nvml-standin"])
def test_the_agent_reads_the_board_from_the_backend(through_nvml: bool) -> None:
    spec = emulated.parse_spec("emulated:0x233010DE:0x16C110DE,0x233010DE:0x16C010DE")
    emu = emulated.EmulatedBackend(spec.models, pci_ids=spec.pci_ids)
    gpus: backend.GpuBackend = (
        nvml.NvmlBackend(nvml_standin.NvmlStandin(emu)) if through_nvml else emu
    )
    out = desired.from_migparted(BOARDS, "by-board", gpus=gpus.gpus())
    assert out[0].layout == _layout("7g.80gb@0")
    assert len(out[1].layout) == 7


def test_a_well_formed_profile_no_gpu_offers_is_a_config_error_naming_it() -> None:
    conf = migparted.parse(
        "version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: true\n"
        '      mig-devices: {"0g.0gb": 1}\n',
        source="c.yaml",
    )
    with pytest.raises(errors.ConfigError, match="h100-80gb has no MIG profile '0g.0gb'"):
        desired.from_migparted(conf, "c", gpus=_gpus(1))
