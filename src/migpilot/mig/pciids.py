"""PCI ids of GPUs: device+vendor, and the board's subsystem id, compared as mig-parted does.

A GPU model ships on several boards: the H100 SXM5 id ``0x233010DE`` is shared by boards that
differ only in their PCI *subsystem* id (``0x16C010DE``, ``0x16C110DE``...). nvidia-mig-parted's
``device-filter`` may name either the device alone or ``DEVICE:SUBSYSTEM``, and an entry written
for one board must not reach its sibling. :class:`PciId` is that pair and :meth:`PciId.matches`
is mig-parted's comparison (``pkg/types/device.go`` in github.com/NVIDIA/mig-parted,
``DeviceID.Matches``): the device ids must be equal, and the subsystem ids too when the filter
names one; a GPU whose subsystem is unknown reads as subsystem ``0``.

:func:`parse` reads an id the way mig-parted's ``NewDeviceIDFromString`` does: at most one
``:``, each half a Go unsigned-integer literal (``strconv.ParseUint(s, 0, 32)``: ``0x``/``0o``/
``0b`` prefixes, a leading ``0`` for octal, ``_`` between digits, no sign, no spaces) that fits
32 bits. Where mig-parted turns a bad id into an entry that silently never matches, migpilot
reports it (see :func:`parse`).

Part of the pure core: values and text only; it imports nothing from migpilot.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

UINT32_MAX = 2**32 - 1

# Go's integer-literal syntax for strconv.ParseUint with base 0: a base prefix, then digits of
# that base with single underscores between digits (or between the prefix and a digit).
_GO_UINT = re.compile(
    r"0[xX](?:_?[0-9a-fA-F])+"
    r"|0[oO](?:_?[0-7])+"
    r"|0[bB](?:_?[01])+"
    r"|0(?:_?[0-7])*"
    r"|[1-9](?:_?[0-9])*"
)


def _go_uint32(text: str) -> int | None:
    """``strconv.ParseUint(text, 0, 32)``: the value, or ``None`` where Go returns an error."""
    if _GO_UINT.fullmatch(text) is None:
        return None
    digits = text.replace("_", "")
    if len(digits) > 1 and digits[0] == "0" and digits[1] not in "xXoObB":
        value = int(digits, 8)  # Go reads a leading 0 as octal; Python's int(..., 0) refuses
    else:
        value = int(digits, 0)
    return value if value <= UINT32_MAX else None


@dataclass(frozen=True, slots=True)
class PciId:
    """A GPU's PCI identity, or a ``device-filter`` id: ``0xDDDDVVVV[:0xSSSSWWWW]``."""

    device: int
    """Device id in the high 16 bits, vendor id in the low 16 (``0x233010DE``)."""
    subsystem: int | None = None
    """Subsystem device and vendor ids packed the same way (``0x16C110DE``), as NVML's
    ``pciSubSystemId`` reports them; ``None`` when not given (a filter that names no board)."""

    def __str__(self) -> str:
        text = f"0x{self.device:08X}"
        return text if self.subsystem is None else f"{text}:0x{self.subsystem:08X}"

    def matches(self, gpu: PciId) -> bool:
        """Whether this filter id selects ``gpu``: same device, and same subsystem when the
        filter names one (a GPU without a known subsystem has subsystem 0, as in mig-parted)."""
        if self.device != gpu.device:
            return False
        return self.subsystem is None or self.subsystem == (gpu.subsystem or 0)


def parse(text: str) -> PciId:
    """``0x233010DE`` or ``0x233010DE:0x16C110DE`` -> :class:`PciId`.

    Raises :class:`ValueError` with the reason (the caller says where): more than one ``:``,
    or a half that is not an unsigned 32-bit number as Go writes one. mig-parted fails the same
    ids but then ignores the failure, so such a filter matches no GPU there.
    """
    parts = text.split(":")
    if len(parts) > 2:
        raise ValueError("expected DEVICE or DEVICE:SUBSYSTEM, with one ':' at most")
    device = _go_uint32(parts[0])
    if device is None:
        raise ValueError(f"device id {parts[0]!r} is not a 32-bit number such as 0x233010DE")
    if len(parts) == 1:
        return PciId(device)
    subsystem = _go_uint32(parts[1])
    if subsystem is None:
        raise ValueError(f"subsystem id {parts[1]!r} is not a 32-bit number such as 0x16C110DE")
    return PciId(device, subsystem)


def looks_like_id(text: str) -> bool:
    """True for text meant as a PCI id (``0x...``) rather than a GPU model name."""
    return text.strip()[:2].lower() == "0x"
