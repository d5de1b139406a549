"""``migpilot config validate | show``: exit codes, text and JSON output, errors as one line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from migpilot.cli import main as cli

GOOD = textwrap.dedent(
    """
    version: v1
    mig-configs:
      all-disabled:
        - devices: all
          mig-enabled: false
      balanced:
        - device-filter: ["0x20B210DE", "0x233010DE"]
          devices: all
          mig-enabled: true
          mig-devices: {"1g.10gb": 2, "2g.20gb": 1, "3g.39gb": 1}
        - device-filter: "0x20B010DE"
          devices: all
          mig-enabled: true
          mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
        - devices: [1]
          mig-enabled: false
    """
).lstrip()

BAD = GOOD + (
    "  too-many:\n"
    '    - device-filter: "0x20B010DE"\n'
    "      devices: all\n"
    "      mig-enabled: true\n"
    '      mig-devices: {"3g.20gb": 3}\n'
)


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out=out)
    return code, out.getvalue()


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "mig.yaml"
    path.write_text(GOOD)
    return path


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    return path


# --- validate --------------------------------------------------------------------------------


def test_validate_a_good_file(good: Path) -> None:
    assert run("config", "validate", str(good)) == (
        0,
        "ok: 2 configs validated against the catalog\n",
    )


def test_validate_prints_each_problem_and_exits_1(bad: Path) -> None:
    code, text = run("config", "validate", str(bad))
    assert code == 1
    assert text.splitlines() == [
        f"{bad}: config 'too-many' entry 0: a100-40gb: 3 x 3g.20gb exceed its maximum of 2 per GPU",
        "1 problem (3 configs checked)",
    ]


def test_validate_json(good: Path, bad: Path) -> None:
    code, text = run("config", "validate", str(good), "-o", "json")
    assert code == 0
    assert json.loads(text) == {"file": str(good), "configs": 2, "problems": []}
    code, text = run("config", "validate", str(bad), "-o", "json")
    assert code == 1
    data = json.loads(text)
    assert data["configs"] == 3
    assert len(data["problems"]) == 1
    assert "'too-many' entry 0: a100-40gb" in data["problems"][0]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("version: v2\nmig-configs: {}\n", "unknown version: v2"),
        ("mig-configs: {}\n", "unable to parse with missing 'version' field"),
        (
            "version: v1\nmig-configs:\n  custom:\n    - {devices: all}\n",
            "config 'custom' entry 0: missing required field: mig-enabled",
        ),
        ("version: v1\nmig-configs: {custom: [\n", "malformed YAML at line "),
    ],
)
def test_validate_a_file_that_does_not_parse_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    path = tmp_path / "mig.yaml"
    path.write_text(content)
    code, text = run("config", "validate", str(path))
    assert code == 2
    assert text == ""
    err = capsys.readouterr().err
    assert err.startswith(f"migpilot: error: {path}: ")
    assert expected in err
    assert err.count("\n") == 1


def test_validate_a_missing_file_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run("config", "validate", str(tmp_path / "nope.yaml"))
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("migpilot: error: ")
    assert "nope.yaml" in err


def test_validate_a_binary_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "mig.yaml"
    path.write_bytes(b"version: v1\n\xff\xfe\n")
    code, _ = run("config", "validate", str(path))
    assert code == 2
    assert capsys.readouterr().err == f"migpilot: error: {path}: not UTF-8 text (byte 12)\n"


# --- show ------------------------------------------------------------------------------------


def test_show_prints_the_layout_of_each_gpu(good: Path) -> None:
    code, text = run(
        "config", "show", str(good), "-c", "balanced", "--gpu", "a100-80gb", "--gpus", "3"
    )
    assert code == 0
    header, rule, *lines = text.splitlines()
    assert header.split() == ["GPU", "ENTRY", "LAYOUT"]
    assert set(rule) == {"─"}
    assert lines[0].split()[:2] == ["0", "0"]
    assert lines[1].split() == ["1", "2", "disabled"]
    assert lines[2].split()[:2] == ["2", "0"]
    placed = sorted(part.split("@")[0] for part in lines[0].split()[2:])
    assert placed == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]  # 3g.39gb resolved
    assert len(lines) == 3


def test_show_defaults_to_eight_gpus(good: Path) -> None:
    code, text = run("config", "show", str(good), "-c", "all-disabled", "--gpu", "h100")
    assert code == 0
    assert [line.split() for line in text.splitlines()[2:]] == [
        [str(i), "0", "disabled"] for i in range(8)
    ]


def test_show_json(good: Path) -> None:
    code, text = run(
        "config", "show", str(good), "-c", "balanced", "--gpu", "a100-40gb", "--gpus", "2",
        "-o", "json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(text)
    assert data["config"] == "balanced"
    assert data["gpu"] == "a100-40gb"
    assert [g["index"] for g in data["gpus"]] == [0, 1]
    assert [g["mig_enabled"] for g in data["gpus"]] == [True, False]
    assert data["gpus"][1]["layout"] == []
    layout = data["gpus"][0]["layout"]
    assert all(set(item) == {"profile", "start"} for item in layout)
    assert sorted(item["profile"] for item in layout) == ["1g.5gb", "1g.5gb", "2g.10gb", "3g.20gb"]
    assert len({item["start"] for item in layout}) == 4
    assert set(data) == {"config", "gpu", "pci_id", "gpus"}
    assert data["pci_id"] is None  # a model name says nothing of the board
    assert set(data["gpus"][0]) == {"index", "mig_enabled", "layout"}


def test_show_by_pci_device_id(good: Path) -> None:
    code, text = run(
        "config", "show", str(good), "-c", "balanced", "--gpu", "0x20B010DE", "--gpus", "1"
    )
    assert code == 0
    assert "3g.20gb@" in text


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-c", "balance", "--gpu", "a100-40gb"], "no config 'balance'; did you mean 'balanced'?"),
        (["-c", "balanced", "--gpu", "a30"], "no entry matches GPU 0 (a30-24gb)"),
        (["-c", "balanced", "--gpu", "v100"], "unknown GPU 'v100'"),
    ],
)
def test_show_errors_exit_2_with_one_line(
    good: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    code, text = run("config", "show", str(good), *argv)
    assert code == 2
    assert text == ""
    err = capsys.readouterr().err
    assert err.startswith("migpilot: error: ")
    assert expected in err
    assert err.count("\n") == 1


def test_show_an_entry_that_cannot_be_placed_exits_2(
    bad: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run("config", "show", str(bad), "-c", "too-many", "--gpu", "a100-40gb")
    assert code == 2
    assert capsys.readouterr().err == (
        f"migpilot: error: {bad}: config 'too-many' entry 0 cannot be placed on a100-40gb: "
        "3 x 3g.20gb exceed its maximum of 2 per GPU\n"
    )


@pytest.mark.parametrize("gpus", ["0", "-1", "two"])
def test_show_rejects_a_bad_gpu_count(
    good: Path, capsys: pytest.CaptureFixture[str], gpus: str
) -> None:
    with pytest.raises(SystemExit) as info:
        run("config", "show", str(good), "-c", "balanced", "--gpu", "a100-40gb", "--gpus", gpus)
    assert info.value.code == 2
    assert "--gpus" in capsys.readouterr().err


def test_show_needs_a_config_and_a_gpu(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        run("config", "show", str(good))
    assert info.value.code == 2
    assert "-c/--config" in capsys.readouterr().err


# --- the installed command -------------------------------------------------------------------


def test_console_script_reports_a_malformed_file_on_one_line(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "migpilot"
    if not script.exists():
        pytest.skip(f"console script not installed at {script}")
    path = tmp_path / "mig.yaml"
    path.write_text("version: v1\nmig-configs:\n  custom:\n    - devices: all\n     x: 1\n")
    proc = subprocess.run(
        [str(script), "config", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.startswith(f"migpilot: error: {path}: malformed YAML at line 5")
    assert proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


BOARDS = textwrap.dedent(
    """
    version: v1
    mig-configs:
      by-board:
        - devices: all
          mig-enabled: true
          mig-devices: {"1g.10gb": 7}
        - device-filter: "0x233010DE:0x16C110DE"
          devices: all
          mig-enabled: true
          mig-devices: {"7g.80gb": 1}
    """
).lstrip()


@pytest.fixture
def boards(tmp_path: Path) -> Path:
    path = tmp_path / "boards.yaml"
    path.write_text(BOARDS)
    return path


@pytest.mark.parametrize(
    ("gpu", "layout"),
    [
        ("0x233010DE:0x16C110DE", "7g.80gb@0"),  # the board the entry names
        ("0x233010de:0x16c110de", "7g.80gb@0"),
        ("0x233010DE:0x16C010DE", "1g.10gb@0"),  # a sibling board: not that entry
        ("0x233010DE:0x00000000", "1g.10gb@0"),  # a board nothing is known about
        ("0x233010DE", "1g.10gb@0"),  # the device alone names no board
        ("h100-80gb", "1g.10gb@0"),
    ],
)
def test_show_picks_entries_by_the_gpus_board(boards: Path, gpu: str, layout: str) -> None:
    code, text = run("config", "show", str(boards), "-c", "by-board", "--gpu", gpu, "--gpus", "1")
    assert code == 0
    assert text.splitlines()[2].split()[2].startswith(layout)


def test_show_json_names_the_gpus_pci_id(boards: Path) -> None:
    code, text = run(
        "config", "show", str(boards), "-c", "by-board", "--gpu", "0x233010de:0x16c110de",
        "--gpus", "1", "-o", "json",
    )  # fmt: skip
    assert code == 0
    data = json.loads(text)
    assert data["gpu"] == "h100-80gb"
    assert data["pci_id"] == "0x233010DE:0x16C110DE"
    assert data["gpus"][0]["layout"] == [{"profile": "7g.80gb", "start": 0}]


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ("0x233010DE:0x16C010DE:extra", "--gpu '0x233010DE:0x16C010DE:extra': expected DEVICE"),
        ("0x233010DE:board", "subsystem id 'board' is not a 32-bit number"),
        ("0x1234ABCD:0x16C110DE", "unknown GPU PCI device id 0x1234ABCD"),
    ],
)
def test_show_rejects_a_bad_gpu_id_in_one_line(
    boards: Path, capsys: pytest.CaptureFixture[str], gpu: str, expected: str
) -> None:
    code, text = run("config", "show", str(boards), "-c", "by-board", "--gpu", gpu)
    assert (code, text) == (2, "")
    err = capsys.readouterr().err
    assert expected in err
    assert err.count("\n") == 1


def test_show_hints_at_the_board_when_only_board_entries_exist(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "only-board.yaml"
    path.write_text(
        "version: v1\nmig-configs:\n  by-board:\n"
        "    - {device-filter: '0x233010DE:0x16C110DE', devices: all, mig-enabled: false}\n"
    )
    code, _ = run("config", "show", str(path), "-c", "by-board", "--gpu", "h100-80gb")
    assert code == 2
    err = capsys.readouterr().err
    assert "no entry matches GPU 0 (h100-80gb)" in err
    assert "give the GPU as DEVICE:SUBSYSTEM" in err
    code, _ = run("config", "show", str(path), "-c", "by-board", "--gpu", "0x233010DE:0x16C110DE")
    assert code == 0


@pytest.mark.parametrize("name", ["0g.0gb", "0c.0g.0gb", "1g.5gb+me,you,them"])
def test_validate_a_well_formed_name_no_gpu_offers_exits_1(tmp_path: Path, name: str) -> None:
    path = tmp_path / "odd.yaml"
    path.write_text(
        "version: v1\nmig-configs:\n  odd:\n"
        f"    - {{devices: all, mig-enabled: true, mig-devices: {{'{name}': 1}}}}\n"
    )
    code, text = run("config", "validate", str(path))
    assert code == 1
    assert f"config 'odd' entry 0: no known GPU offers {name}\n" in text
    assert "invalid format" not in text


def test_validate_a_malformed_name_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad-name.yaml"
    path.write_text(
        "version: v1\nmig-configs:\n  odd:\n"
        "    - {devices: all, mig-enabled: true, mig-devices: {'1g.5gb+me,me': 1}}\n"
    )
    code, _ = run("config", "validate", str(path))
    assert code == 2
    err = capsys.readouterr().err
    assert "invalid format for '1g.5gb+me,me': attribute 'me' repeated" in err
    assert err.count("\n") == 1
