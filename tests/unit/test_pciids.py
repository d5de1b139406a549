"""PCI ids as mig-parted reads and compares them.

The cases restate, in migpilot's terms, those of mig-parted's ``pkg/types/device_test.go``
(github.com/NVIDIA/mig-parted): reading ``DEVICE`` and ``DEVICE:SUBSYSTEM``, printing, and which
GPU a filter id selects. The Go-literal cases follow ``strconv.ParseUint(s, 0, 32)``, which
mig-parted uses for both halves.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.mig import pciids
from migpilot.mig.pciids import PciId

# An A16 and an A2 share the device id 0x25B610DE and differ in their board's subsystem id.
A16 = PciId(0x25B610DE, 0x14A910DE)
A2 = PciId(0x25B610DE, 0x157E10DE)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0x25B610DE", PciId(0x25B610DE)),
        ("0x25B610DE:0x14A910DE", A16),
        ("0x25b610de:0x14a910de", A16),  # hex digits in either case
        ("0X25B610DE", PciId(0x25B610DE)),
        ("0x25B6_10DE", PciId(0x25B610DE)),  # Go allows '_' between digits
        ("632688862", PciId(0x25B610DE)),  # decimal
        ("0o4555410336", PciId(0x25B610DE)),
        ("04555410336", PciId(0x25B610DE)),  # a leading 0 is octal in Go
        ("0", PciId(0)),
        ("0x25B610DE:0", PciId(0x25B610DE, 0)),
        ("0xFFFFFFFF", PciId(0xFFFFFFFF)),
    ],
)
def test_ids_parse_as_go_reads_them(text: str, expected: PciId) -> None:
    assert pciids.parse(text) == expected


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("not-a-device-id", "device id 'not-a-device-id' is not a 32-bit number"),
        ("0x25B610DE:not-a-subsystem", "subsystem id 'not-a-subsystem' is not a 32-bit number"),
        ("0x25B610DE:0x14A910DE:extra", "with one ':' at most"),
        ("0x25B610DE:", "subsystem id '' is not"),
        ("", "device id '' is not"),
        ("0x", "device id '0x' is not"),
        ("0x100000000", "is not a 32-bit number"),
        (" 0x25B610DE", "is not a 32-bit number"),  # Go does not trim
        ("0x25B610DE ", "is not a 32-bit number"),
        ("+0x25B610DE", "is not a 32-bit number"),  # ParseUint takes no sign
        ("08", "is not a 32-bit number"),  # 8 is not an octal digit
        ("0x25B6__10DE", "is not a 32-bit number"),
        ("0x25B610DE_", "is not a 32-bit number"),
        ("\u0661\u0662", "is not a 32-bit number"),  # digits, but not ASCII ones
        ("A100-SXM4-40GB", "is not a 32-bit number"),  # a model name is not an id
    ],
)
def test_ids_go_cannot_read_are_errors_with_the_reason(text: str, reason: str) -> None:
    with pytest.raises(
        ValueError,
    ) as info:
        pciids.parse(text)
    assert reason in str(info.value)
    assert "\n" not in str(info.value)


def test_ids_print_as_mig_parted_prints_them() -> None:
    assert str(PciId(0x25B610DE)) == "0x25B610DE"
    assert str(A16) == "0x25B610DE:0x14A910DE"
    assert str(PciId(0x10DE, 0)) == "0x000010DE:0x00000000"


@pytest.mark.parametrize(
    ("case", "filter_id", "gpu", "matches"),
    [
        ("a device-only filter selects every board of the device", PciId(0x25B610DE), A16, True),
        ("a board filter selects that board", PciId(0x25B610DE, 0x14A910DE), A16, True),
        ("a board filter skips a sibling board", PciId(0x25B610DE, 0x14A910DE), A2, False),
        (
            "a board filter skips a GPU whose board is unknown",
            PciId(0x25B610DE, 0x14A910DE),
            PciId(0x25B610DE, 0),
            False,
        ),
        (
            "a zero board filter selects a GPU whose board is unknown",
            PciId(0x25B610DE, 0),
            PciId(0x25B610DE, 0),
            True,
        ),
        (
            "a GPU read without its board counts as board zero",
            PciId(0x25B610DE, 0),
            PciId(0x25B610DE),
            True,
        ),
        ("another device never matches", PciId(0x1E3010DE), A16, False),
    ],
)
def test_filters_select_gpus_as_in_mig_parted(
    case: str, filter_id: PciId, gpu: PciId, matches: bool
) -> None:
    assert filter_id.matches(gpu) is matches, case


@given(
    st.integers(0, pciids.UINT32_MAX),
    st.one_of(st.none(), st.integers(0, pciids.UINT32_MAX)),
)
def test_printing_and_parsing_round_trip(device: int, subsystem: int | None) -> None:
    pci = PciId(device, subsystem)
    assert pciids.parse(str(pci)) == pci


@pytest.mark.parametrize(
    ("text", "is_id"),
    [("0x233010DE", True), (" 0X233010DE:0x1", True), ("h100-80gb", False), ("0", False)],
)
def test_looks_like_id(text: str, is_id: bool) -> None:
    assert pciids.looks_like_id(text) is is_id
