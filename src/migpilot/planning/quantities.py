"""Kubernetes resource quantities (``4``, ``500m``, ``8Gi``, ``1.5G``, ``8k``, ``1e3``) read as
numbers, exactly and within what migpilot can use.

Why it exists: the snapshot reads CPU, memory and MIG counts as quantities, and the unified
requests (``nvidia.com/gpumem: 8000``, which the apiserver writes back as ``8k``) do too; the
snapshot imports the unified module, so the one reader lives below both. Every quantity a
tenant writes (a pod's requests, a Node's allocatable, a trace's row) goes through
:func:`parse_quantity`, because kube-apiserver accepts values no int64 holds: ``memory:
1e1000000`` is stored as ``10e999999`` (only binary-suffix values are capped). Read with
Python's default decimal context, such a value once raised ``decimal.Overflow``, and one of
``1e200000`` took seconds of CPU to turn into an ``int``. Here the grammar is apimachinery's
``resource.Quantity`` (ASCII digits only), the size is judged from the text before any
arithmetic (a huge exponent is refused in microseconds), the arithmetic runs in a local decimal
context that traps anything inexact, and a value outside ``0..2**63-1`` base units (millicores
for CPU) is a :class:`~migpilot.errors.SnapshotError` naming the field.

Pure: no I/O. May import :mod:`migpilot.errors` only.
"""

from __future__ import annotations

import decimal
import math
import re
from decimal import Decimal
from typing import Any

from migpilot import errors

LIMIT = 2**63 - 1
"""The largest amount migpilot uses, in base units (bytes, millicores, devices): int64's."""
MAX_CHARS = 100
"""Longer texts are refused before they are read (no real quantity comes near)."""
_MAX_EXPONENT_DIGITS = 7
"""An exponent with more digits (leading zeros aside) is absurd for any quantity."""


class TooLargeError(errors.SnapshotError):
    """A quantity above :data:`LIMIT`, or too long or with too large an exponent to be read."""


_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
"""Decimal SI suffixes and their power of ten (``E`` alone is exa; ``1E3`` is an exponent)."""
# apimachinery's grammar: <sign>?<digits>[.<digits>] then one of a binary suffix, a decimal
# exponent (e|E, a sign, digits) or a decimal suffix. ASCII only: "٣" is not a digit here.
_QUANTITY = re.compile(
    r"([+-]?)([0-9]+\.?[0-9]*|\.[0-9]+)"
    r"(?:([eE])([+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]?))",
    re.ASCII,
)
_SPACE = " \t\n\r\f\v"
"""What apimachinery's JSON reader trims around a quantity (ASCII whitespace only)."""


def _context() -> decimal.Context:
    """Exact arithmetic on every value the size checks let through: 200 digits hold
    ``MAX_CHARS`` digits times 2**60 times 1000, and anything inexact raises."""
    return decimal.Context(
        prec=200,
        rounding=decimal.ROUND_CEILING,
        Emax=10**8,
        Emin=-(10**8),
        traps=[decimal.InvalidOperation, decimal.Overflow, decimal.Inexact, decimal.DivisionByZero],
    )


def parse_quantity(value: Any, *, where: str, scale: int = 1) -> Decimal:
    """A Kubernetes resource quantity (``4``, ``500m``, ``8Gi``, ``1.5G``, ``1e3``) times
    ``scale`` (1000 for millicores), exactly.

    Raise :class:`~migpilot.errors.SnapshotError` naming ``where`` for anything else: not a
    quantity, negative, or above :data:`LIMIT` (judged from the text first, so an exponent of a
    million costs nothing)."""
    text = _text(value, where=where)
    if len(text) > MAX_CHARS:
        raise TooLargeError(
            f"{where}: a quantity of {len(text)} characters is too long (at most {MAX_CHARS})"
        )
    m = _QUANTITY.fullmatch(text)
    if m is None:
        if re.fullmatch(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)([A-Za-z]+)", text, re.ASCII):
            unit = re.sub(r"^[+-]?[0-9.]*", "", text)
            raise errors.SnapshotError(f"{where}: unknown unit {unit!r} in {text!r}")
        raise errors.SnapshotError(f"{where}: {text!r} is not a quantity (like 4, 500m or 8Gi)")
    sign, digits, marker, exponent, suffix = m.groups()
    power = 0  # a power of ten from the exponent or a decimal suffix
    factor = 1  # a binary suffix's multiplier
    if marker is not None:
        bare = exponent.lstrip("+-").lstrip("0")
        if len(bare) > _MAX_EXPONENT_DIGITS:
            raise TooLargeError(f"{where}: {_shown(text)} has an absurd exponent")
        power = int(exponent)
    elif suffix in _BINARY:
        factor = _BINARY[suffix]
    else:
        power = _DECIMAL[suffix]
    mantissa = Decimal(digits)  # at most MAX_CHARS digits: cheap
    if sign == "-" and mantissa != 0:
        raise errors.SnapshotError(f"{where}: {text!r} is negative")
    if mantissa == 0:
        return Decimal(0)
    # The size from the text alone: the value is at least 10**magnitude base units, and
    # 2**63 < 10**19: a value whose leading digit sits at 10**19 or above is refused before
    # any multiplication (this is what keeps "1e200000" to microseconds).
    magnitude = mantissa.adjusted() + power + len(str(factor)) - 1 + len(str(scale)) - 1
    if magnitude > 18:
        raise TooLargeError(f"{where}: {_shown(text)} is too large (at most {LIMIT})")
    # Exact however small: a Decimal keeps its exponent apart from its (few) digits.
    with decimal.localcontext(_context()):
        result = mantissa.scaleb(power) * factor * scale
    if result > LIMIT:
        raise TooLargeError(f"{where}: {_shown(text)} is too large (at most {LIMIT})")
    return result


def amount(value: Any, *, where: str, scale: int = 1) -> int:
    """:func:`parse_quantity` rounded up to a whole number of base units (what kube-scheduler
    counts: ``0.5m`` CPU is 1 millicore), at most :data:`LIMIT`."""
    q = parse_quantity(value, where=where, scale=scale)
    with decimal.localcontext(_context()):
        return int(q.to_integral_value(rounding=decimal.ROUND_CEILING))


def _text(value: Any, *, where: str) -> str:
    """The quantity's text: a string as it is (trimmed), an int or a float (YAML, traces) as
    its decimal spelling, never through float arithmetic."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise errors.SnapshotError(f"{where}: expected a quantity like 4, 500m or 8Gi")
    if isinstance(value, int):
        if value > LIMIT:  # compared, never turned into a (possibly huge) string
            raise TooLargeError(f"{where}: the number is too large (at most {LIMIT})")
        if value < 0:
            raise errors.SnapshotError(f"{where}: the number is negative")
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise errors.SnapshotError(f"{where}: {value!r} is not a quantity")
        return repr(value)  # the shortest exact spelling, e.g. 1.5 or 1e+20
    return value.strip(_SPACE)


def _shown(text: str) -> str:
    """``text`` for a message, cut short: it may come from anyone creating a pod."""
    return repr(text) if len(text) <= 40 else repr(f"{text[:37]}...")
