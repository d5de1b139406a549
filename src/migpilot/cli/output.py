"""Rendering for the CLI: readable tables for people, JSON for programs (``-o json``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import IO, Any


def add_output_flag(parser: Any) -> None:
    """Give a listing command the ``-o table|json`` option."""
    parser.add_argument(
        "-o",
        "--output",
        choices=("table", "json"),
        default="table",
        help="output format (default: table)",
    )


def write_json(out: IO[str], data: Any) -> None:
    """Deterministic, indented JSON followed by a newline."""
    out.write(json.dumps(data, indent=2, sort_keys=False) + "\n")


def write_table(out: IO[str], headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned table; ``None`` cells print as ``-``."""
    cells = [[("-" if c is None else str(c)) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    out.write("\n".join(lines) + "\n")
