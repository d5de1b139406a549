"""Kubernetes resource quantities (``4``, ``500m``, ``8Gi``, ``1.5G``, ``8k``) read as numbers.

Why it exists: the snapshot reads CPU, memory and MIG counts as quantities, and the unified
requests (``nvidia.com/gpumem: 8000``, which the apiserver writes back as ``8k``) do too; the
snapshot imports the unified module, so the one reader lives below both.

Pure: no I/O. May import :mod:`migpilot.errors` only.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

from migpilot import errors

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1),
            "k": Decimal(10**3), "M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12),
            "P": Decimal(10**15), "E": Decimal(10**18)}  # fmt: skip
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([A-Za-z]*)$")


def parse_quantity(value: Any, *, where: str) -> Decimal:
    """A Kubernetes resource quantity (``4``, ``500m``, ``8Gi``, ``1.5G``) as a number."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise errors.SnapshotError(f"{where}: expected a quantity like 4, 500m or 8Gi")
    text = str(value).strip()
    m = _QUANTITY.match(text)
    if m is None:
        raise errors.SnapshotError(f"{where}: {text!r} is not a quantity (like 4, 500m or 8Gi)")
    try:
        number = Decimal(m[1])
    except InvalidOperation:
        raise errors.SnapshotError(f"{where}: {text!r} is not a quantity") from None
    suffix = m[2]
    if suffix in _BINARY:
        result = number * _BINARY[suffix]
    elif suffix in _DECIMAL:
        result = number * _DECIMAL[suffix]
    else:
        raise errors.SnapshotError(f"{where}: unknown unit {suffix!r} in {text!r}")
    if result < 0:
        raise errors.SnapshotError(f"{where}: {text!r} is negative")
    return result
