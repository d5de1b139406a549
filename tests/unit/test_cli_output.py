"""The CLI's rich tables and the simulator's progress bar, as a pipe and as a terminal see them."""

from __future__ import annotations

import io

import pytest

from migpilot.cli import output, simulate_cmd


class Terminal(io.StringIO):
    """A stream that says it is a terminal (rich then draws colours and live displays)."""

    def isatty(self) -> bool:
        return True


def rendered(
    headers: tuple[str, ...], rows: list[tuple[object, ...]], *, right: tuple[str, ...] = ()
) -> str:
    out = io.StringIO()
    output.write_table(out, headers, rows, right=right)
    return out.getvalue()


def test_a_pipe_gets_plain_text_a_rule_under_the_header_and_no_trailing_spaces() -> None:
    text = rendered(("NAME", "COUNT", "NOTE"), [("a", 1, "x"), ("longer-name", 12, None)])
    assert "\x1b" not in text
    header, rule, *rows = text.splitlines()
    assert header.split() == ["NAME", "COUNT", "NOTE"]
    assert set(rule) == {"─"}
    assert [r.split() for r in rows] == [["a", "1", "x"], ["longer-name", "12", "-"]]
    assert all(line == line.rstrip() for line in text.splitlines())
    assert [r.index(r.split()[1]) for r in rows] == [header.index("COUNT")] * 2


def test_right_aligned_columns_end_under_their_header() -> None:
    text = rendered(("NAME", "COUNT", "NOTE"), [("a", 1, "x"), ("b", 12, "y")], right=("COUNT",))
    header, _, *rows = text.splitlines()
    end = header.index("COUNT") + len("COUNT")
    assert [r[end - 2 : end] for r in rows] == [" 1", "12"]


def test_cells_are_text_not_markup() -> None:
    text = rendered(("POD",), [("team/job[bold]0",), (":smile:",)])
    assert "team/job[bold]0" in text and ":smile:" in text


def test_a_pipe_never_folds_a_wide_row() -> None:
    wide = "x" * (output.PIPE_WIDTH + 50)
    text = rendered(("A", "B"), [(wide, "end")])
    assert any(line.startswith(wide) and line.endswith("end") for line in text.splitlines())


def test_a_terminal_gets_colours() -> None:
    out = Terminal()
    output.write_table(out, ("NAME",), [("a",)])
    assert "\x1b[" in out.getvalue()  # the header is bold


@pytest.mark.parametrize(
    ("headers", "rows", "right", "message"),
    [
        (("A", "B"), [("1",)], (), "a row has 1 cells for 2 columns"),
        (("A",), [("1",)], ("B",), "right-aligned columns ['B'] are not among the headers"),
    ],
)
def test_a_misshapen_table_is_refused(
    headers: tuple[str, ...], rows: list[tuple[str, ...]], right: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        output.table(headers, rows, right=right)


def test_the_progress_bar_is_silent_off_a_terminal() -> None:
    out = io.StringIO()
    with simulate_cmd.progress_bar(out) as bar:
        task = bar.add_task("", total=2)
        bar.update(task, completed=1.5, description="migpilot")
    assert out.getvalue() == ""


def test_the_progress_bar_draws_on_a_terminal_and_clears_itself() -> None:
    out = Terminal()
    with simulate_cmd.progress_bar(out) as bar:
        task = bar.add_task("", total=2)
        bar.update(task, completed=1.5, description="migpilot")
        bar.refresh()
    text = out.getvalue()
    assert "simulating migpilot" in text and "75%" in text
    assert text.endswith("\x1b[2K")  # transient: the last thing written erases the line
