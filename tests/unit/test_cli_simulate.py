"""``migpilot simulate``: table, JSON, results.json, plots, determinism and bad input."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from migpilot.cli import main
from migpilot.sim import reports

SMALL = ["--cluster", "h100-80gb:2x4,a100-80gb:1x4"]


def run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    code = main.main(argv, out=out)
    return code, out.getvalue()


def test_table_results_and_plots(tmp_path: Path) -> None:
    code, text = run(["simulate", *SMALL, "--policies", "migpilot,static", "--out", str(tmp_path)])
    assert code == 0
    assert "upper bound on the allocation ratio" in text
    assert text.rstrip().splitlines()[-1] == (
        f"plots: {tmp_path / 'allocation.png'}, {tmp_path / 'pending-cdf.png'}"
    )
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [r["policy"] for r in rows] == ["migpilot", "static"]
    assert all(tuple(r) == reports.KEYS for r in rows)
    assert (tmp_path / "allocation.png").read_bytes()[:4] == b"\x89PNG"


def test_json_is_byte_identical_for_equal_runs(tmp_path: Path) -> None:
    argv = ["simulate", *SMALL, "--trace", "synthetic:mixed", "--policies",
            "migpilot,nos,static-best", "--omit-timing", "--no-plots", "-o", "json"]  # fmt: skip
    code1, one = run([*argv, "--out", str(tmp_path / "a")])
    code2, two = run([*argv, "--out", str(tmp_path / "b")])
    assert code1 == code2 == 0 and one == two
    assert (tmp_path / "a" / "results.json").read_bytes() == (
        tmp_path / "b" / "results.json"
    ).read_bytes()
    assert all(r["planner_seconds"] is None for r in json.loads(one))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cluster", "h100:8"], "is not MODEL:NODESxGPUS"),
        (["--policies", "kai"], "unknown policy 'kai'"),
        (["--trace", "synthetic:batch"], "unknown synthetic trace 'batch'"),
        (["--mig-config", "nope"], "nope"),
    ],
)
def test_bad_input_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, _ = run(["simulate", *SMALL, "--out", str(tmp_path), *argv])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("migpilot: error: ") and message in err and err.count("\n") == 1


def test_malformed_trace_row_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mine.csv"
    trace.write_text(
        "name,arrival,duration,requests\na,0,5,mig-1g.10gb=1\nb,soon,5,mig-1g.10gb=1\n"
    )
    code, _ = run(["simulate", *SMALL, "--trace", str(trace), "--out", str(tmp_path)])
    assert code == 2
    assert capsys.readouterr().err == (
        "migpilot: error: mine.csv:3: arrival 'soon' is not a number of seconds\n"
    )


def test_native_trace_file_in_faithful_mode(tmp_path: Path) -> None:
    trace = tmp_path / "mine.csv"
    trace.write_text("name,arrival,duration,requests\na,0,5,mig-1g.10gb=1\nb,1,,mig-7g.80gb=2\n")
    code, text = run(["simulate", *SMALL, "--trace", str(trace), "--mode", "faithful", "--policies",
                      "migpilot", "--no-plots", "-o", "json", "--out", str(tmp_path)])  # fmt: skip
    assert code == 0
    (row,) = json.loads(text)
    assert (row["pods_total"], row["pods_scheduled"]) == (2, 2)
