"""Rendering for the CLI: ``rich`` tables for people, JSON for programs (``-o json``).

One place decides how a table looks and how wide the console is, so that every command's human
output reads the same and stays greppable in a pipe: colours only on a terminal, and a pipe or
file gets a width no table has to fold its cells to fit.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from typing import IO, Any

from rich import box
from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text


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


PIPE_WIDTH = 200
"""Columns when writing to a pipe or a file (rich's 80 would fold pod names and reasons that
``grep`` then misses); a terminal's own width otherwise."""


_UNLIMITED = 1_000_000


def console_for(out: IO[str], *, width: int | None = None) -> Console:
    """A console writing to ``out`` (colours only on a terminal)."""
    if width is None and not out.isatty():
        width = PIPE_WIDTH
    return Console(file=out, width=width, highlight=False, soft_wrap=False)


def table(
    headers: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Collection[str] = ()
) -> Table:
    """The CLI's table: a rule under the header and no borders, as ``migpilot status`` draws;
    ``None`` cells print as ``-``; the columns named in ``right`` (numbers) are right-aligned.

    Cells are :class:`~rich.text.Text`, never markup: a pod named ``job[0]`` prints as named.
    """
    unknown = set(right) - set(headers)
    if unknown:
        raise ValueError(f"right-aligned columns {sorted(unknown)} are not among the headers")
    # Collapsed padding: two spaces between columns, not three, so that the simulator's ten
    # columns fit in 100.
    t = Table(box=box.SIMPLE, pad_edge=False, show_edge=False, collapse_padding=True)
    for header in headers:
        t.add_column(Text(header), justify="right" if header in right else "left")
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"a row has {len(row)} cells for {len(headers)} columns: {row!r}")
        t.add_row(*(Text("-" if c is None else str(c)) for c in row))
    return t


def write_rich(out: IO[str], renderable: RenderableType) -> None:
    """Print ``renderable`` to ``out``; in a pipe or file, as wide as it needs (never folded)
    and without the spaces rich pads each line's end with."""
    console = console_for(out)
    if console.is_terminal:
        console.print(renderable)
        return
    # Measured without a limit: Measurement.get clamps to the width it is given.
    unlimited = console.options.update(max_width=_UNLIMITED)
    needed = Measurement.get(console, unlimited, renderable).maximum
    console = console_for(out, width=max(PIPE_WIDTH, needed))
    with console.capture() as captured:
        console.print(renderable)
    out.write("".join(line.rstrip() + "\n" for line in captured.get().splitlines()))


def write_table(
    out: IO[str],
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    *,
    right: Collection[str] = (),
) -> None:
    """:func:`table` printed to ``out`` (see :func:`write_rich`)."""
    write_rich(out, table(headers, rows, right=right))
