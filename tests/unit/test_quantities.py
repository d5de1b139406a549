"""The quantity reader against a reference written from apimachinery's ``resource.Quantity``
grammar, and the hostile values a tenant can make kube-apiserver accept."""

from __future__ import annotations

import math
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.planning import quantities, snapshot

# --------------------------------------------------------------------------- the reference
# apimachinery (pkg/api/resource/quantity.go):
#   <quantity>        ::= <signedNumber><suffix>
#   <number>          ::= <digits> | <digits>.<digits> | <digits>. | .<digits>
#   <signedNumber>    ::= <number> | <sign><number>
#   <suffix>          ::= <binarySI> | <decimalExponent> | <decimalSI>
#   <binarySI>        ::= Ki | Mi | Gi | Ti | Pi | Ei
#   <decimalSI>       ::= n | u | m | "" | k | M | G | T | P | E
#   <decimalExponent> ::= "e" <signedNumber> | "E" <signedNumber>   (whole exponents)
# "1E" is 1 exa (a suffix); "1E3" is 1000 (an exponent).

_BINARY_REF = {f"{p}i": 1024 ** (n + 1) for n, p in enumerate("KMGTPE")}
_DECIMAL_REF = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}


def _reference(sign: str, number: str, suffix: str) -> Fraction:
    """The exact value, from the grammar's parts, with Fractions (no Decimal, no float)."""
    whole, _, frac = number.partition(".")
    value = Fraction(int(whole or "0")) + (
        Fraction(int(frac), 10 ** len(frac)) if frac else Fraction(0)
    )
    if suffix in _BINARY_REF:
        value *= _BINARY_REF[suffix]
    elif suffix in _DECIMAL_REF:
        value *= Fraction(10) ** _DECIMAL_REF[suffix]
    else:
        assert suffix[0] in "eE"
        value *= Fraction(10) ** int(suffix[1:])
    return -value if sign == "-" else value


_digits = st.text("0123456789", min_size=1, max_size=12)
_numbers = st.one_of(
    _digits,
    st.tuples(_digits, _digits).map(lambda t: f"{t[0]}.{t[1]}"),
    _digits.map(lambda d: f"{d}."),
    _digits.map(lambda d: f".{d}"),
)
_exponents = st.tuples(
    st.sampled_from("eE"), st.sampled_from(["", "+", "-"]), st.integers(0, 40)
).map(lambda t: f"{t[0]}{t[1]}{t[2]}")
_suffixes = st.one_of(
    st.sampled_from(sorted(_BINARY_REF)), st.sampled_from(sorted(_DECIMAL_REF)), _exponents
)


@given(sign=st.sampled_from(["", "+", "-"]), number=_numbers, suffix=_suffixes,
       scale=st.sampled_from([1, 1000]))  # fmt: skip
def test_matches_the_reference(sign: str, number: str, suffix: str, scale: int) -> None:
    text = f"{sign}{number}{suffix}"
    expected = _reference(sign, number, suffix) * scale
    if expected < 0:
        with pytest.raises(errors.SnapshotError, match="^f: .* is negative"):
            quantities.parse_quantity(text, where="f", scale=scale)
    elif expected > quantities.LIMIT:
        with pytest.raises(quantities.TooLargeError, match="^f: .* is too large"):
            quantities.parse_quantity(text, where="f", scale=scale)
    else:
        got = quantities.parse_quantity(text, where="f", scale=scale)
        assert Fraction(got) == expected
        assert quantities.amount(text, where="f", scale=scale) == math.ceil(expected)


@given(st.integers(min_value=0, max_value=quantities.LIMIT))
def test_every_int64_reads_back(n: int) -> None:
    assert quantities.amount(n, where="f") == n
    assert quantities.amount(str(n), where="f") == n


@given(st.text(max_size=12))
def test_anything_else_is_refused_with_the_field(text: str) -> None:
    try:
        got = quantities.parse_quantity(text, where="spec.x")
    except errors.SnapshotError as err:
        assert str(err).startswith("spec.x: ")
    else:
        assert 0 <= got <= quantities.LIMIT


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("1E", 10**18),  # exa, not an exponent
        ("1E3", 1000),
        ("1e3", 1000),
        ("+1.5Gi", 3 * 2**29),
        ("1.", 1),
        (".5k", 500),
        ("10e-1", 1),
        ("7Ei", 7 * 2**60),
        (" 4\n", 4),  # apimachinery's JSON reader trims ASCII whitespace
        ("1e-9999999", Decimal("1e-9999999")),  # tiny, exact, cheap
        (1.5, Decimal("1.5")),
        (1e18, 10**18),
    ],
)
def test_grammar_cases(text: Any, value: Any) -> None:
    assert quantities.parse_quantity(text, where="f") == value


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("1e", "unknown unit 'e'"),
        ("1e3Ki", "is not a quantity"),
        ("1Ki3", "is not a quantity"),
        ("٣", "is not a quantity"),  # an Arabic-Indic digit: ASCII digits only
        ("1\u00a0", "is not a quantity"),  # a no-break space is not trimmed
        ("1.5.2", "is not a quantity"),
        ("8KiB", "unknown unit 'KiB'"),
        ("-0.5", "is negative"),
        (float("nan"), "is not a quantity"),
        (float("inf"), "is not a quantity"),
    ],
)
def test_not_quantities(text: Any, message: str) -> None:
    with pytest.raises(errors.SnapshotError, match="^f: ") as exc:
        quantities.parse_quantity(text, where="f")
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "text",
    [
        "1e1000000",  # memory: 1e1000000, as a tenant writes it
        "10e999999",  # ... and as kube-apiserver stores it
        "1e5000",
        "1e200000",  # once 4.3 s of CPU in int()
        "1e99999999",  # an exponent of 8 digits: absurd
        "1" * 101,  # too long to read
    ],
)
def test_huge_values_are_refused_before_any_arithmetic(
    text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_arithmetic() -> None:
        raise AssertionError("the exact arithmetic ran for a value the text shows is too large")

    # The arithmetic runs only in the local context: refusing from the text alone never makes one.
    monkeypatch.setattr(quantities, "_context", no_arithmetic)
    with pytest.raises(quantities.TooLargeError, match="^spec.memory: ") as exc:
        quantities.parse_quantity(text, where="spec.memory")
    assert any(w in str(exc.value) for w in ("too large", "too long", "absurd exponent"))
    with pytest.raises(quantities.TooLargeError):
        snapshot.memory_bytes(text, where="spec.memory")


@pytest.mark.parametrize("text", ["9223372036854775808", "8Ei", "9223372036854775.808k"])
def test_two_to_the_63_is_refused_by_the_exact_comparison(text: str) -> None:
    with pytest.raises(quantities.TooLargeError, match="^spec.memory: '.*' is too large"):
        quantities.parse_quantity(text, where="spec.memory")
    assert quantities.amount("9223372036854775807", where="spec.memory") == quantities.LIMIT


def test_cpu_is_bounded_in_millicores() -> None:
    limit_cores = quantities.LIMIT // 1000
    assert snapshot.cpu_milli(str(limit_cores), where="cpu") == limit_cores * 1000
    with pytest.raises(quantities.TooLargeError, match="^cpu: "):
        snapshot.cpu_milli(str(limit_cores + 1), where="cpu")


def test_huge_ints_are_compared_not_printed() -> None:
    # str() of an int over 4,300 digits raises ValueError: never reached.
    with pytest.raises(quantities.TooLargeError, match="^f: the number is too large"):
        quantities.parse_quantity(10**5000, where="f")
    with pytest.raises(errors.SnapshotError, match="is negative"):
        quantities.parse_quantity(-(10**5000), where="f")
