"""Whole numbers read from text with ASCII digits only.

Why it exists: Python's ``int()``, ``str.isdigit()`` and a ``str`` regex's ``\\d`` all take any
Unicode digit, so ``"٣"`` (Arabic-Indic three) read as 3 and ``"1g.١٠gb"`` as a MIG profile,
where Kubernetes, Go's ``strconv`` and NVIDIA's tools read ASCII digits only. Every reader of a
number a user (a pod, a config, a flag, a trace) wrote goes through here or matches ``[0-9]``.
Kubernetes quantities have their own parser (:mod:`migpilot.planning.quantities`).

Pure; imports nothing of migpilot.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"[+-]?[0-9]+")


def is_digits(text: str) -> bool:
    """Whether ``text`` is one or more ASCII digits, and nothing else."""
    return text.isascii() and text.isdigit()


def integer(text: str) -> int:
    """``text`` (spaces around it allowed, an optional sign) as an int; ``ValueError`` unless
    its digits are ASCII ones (``int()`` would read ``"٣"`` as 3)."""
    stripped = text.strip()
    if _INTEGER.fullmatch(stripped) is None:
        raise ValueError(f"not a whole number in ASCII digits: {text!r}")
    return int(stripped)
