"""The MIG model commands: tables, JSON, exit codes and one-line errors."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from migpilot.cli import main as cli


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(list(argv), out=out)
    return code, out.getvalue()


def run_json(*argv: str) -> object:
    code, text = run(*argv, "-o", "json")
    assert code == 0, text
    return json.loads(text)


def test_gpus_table_lists_every_model() -> None:
    code, text = run("gpus")
    assert code == 0
    for gpu in ("a30-24gb", "a100-40gb", "h100-80gb", "h200-141gb", "b200-180gb"):
        assert gpu in text


def test_gpus_json() -> None:
    data = run_json("gpus")
    assert isinstance(data, list)
    a100 = next(g for g in data if g["id"] == "a100-40gb")
    assert "NVIDIA-A100-SXM4-40GB" in a100["gfd_products"]
    assert "0x20B010DE" in a100["pci_device_ids"]


@pytest.mark.parametrize("alias", ["a100-40gb", "A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"])
def test_profiles_accepts_aliases(alias: str) -> None:
    code, text = run("profiles", alias)
    assert code == 0
    assert "3g.20gb" in text and "{0,4}:4" in text


def test_profiles_json_fields() -> None:
    data = run_json("profiles", "NVIDIA H100 80GB HBM3")
    assert isinstance(data, dict)
    p = next(p for p in data["profiles"] if p["name"] == "1g.10gb+me")
    assert p["smi_id"] == 20
    assert p["nvml_index"] == 7
    assert p["resource"] == "nvidia.com/mig-1g.10gb.me"
    assert p["placements"][0] == {"start": 0, "size": 1}


def test_layouts_counts_19() -> None:
    code, text = run("layouts", "a100-40gb", "--profiles", "1g.5gb,2g.10gb,3g.20gb,4g.20gb,7g.40gb")
    assert code == 0
    assert text.strip().endswith("19 maximal layouts of a100-40gb")
    data = run_json("layouts", "a100-40gb", "--profiles", "1g.5gb,2g.10gb,3g.20gb,4g.20gb,7g.40gb")
    assert isinstance(data, dict) and len(data["layouts"]) == 19


def test_layouts_keep_lists_completions() -> None:
    data = run_json("layouts", "a100-40gb", "--keep", "3g.20gb@4", "--profiles", "3g.20gb,4g.20gb")
    assert isinstance(data, dict)
    assert data["layouts"] == [
        [{"profile": "3g.20gb", "start": 0}, {"profile": "3g.20gb", "start": 4}],
        [{"profile": "4g.20gb", "start": 0}, {"profile": "3g.20gb", "start": 4}],
    ]


def test_layouts_keep_repeated_keeps_every_instance() -> None:
    once = run_json("layouts", "a100-40gb", "--keep", "3g.20gb@4,1g.5gb@0")
    twice = run_json("layouts", "a100-40gb", "--keep", "3g.20gb@4", "--keep", "1g.5gb@0")
    assert isinstance(twice, dict) and twice == once
    assert twice["keep"] == [
        {"profile": "1g.5gb", "start": 0},
        {"profile": "3g.20gb", "start": 4},
    ]


@pytest.mark.parametrize(
    ("gpu", "instances", "reason"),
    [
        ("h100-80gb", ["3g.40gb@4", "3g.40gb@4"], "3g.40gb@4 and 3g.40gb@4 overlap on memory"),
        ("a100-40gb", ["7g.40gb@0", "7g.40gb@0"], "7g.40gb@0 and 7g.40gb@0 overlap on memory"),
        ("a30", ["4g.24gb@0", "4g.24gb@0"], "4g.24gb@0 and 4g.24gb@0 overlap on memory"),
        # The same instance written two ways is still two instances.
        ("a100-80gb", ["3g.40gb@4", "3g.39gb@4"], "3g.40gb@4 and 3g.40gb@4 overlap on memory"),
    ],
)
def test_check_never_merges_an_instance_typed_twice(
    gpu: str, instances: list[str], reason: str
) -> None:
    code, text = run("check", gpu, *instances)
    assert code == 1
    assert text.startswith("invalid: ") and reason in text
    code, text = run("check", gpu, *instances, "-o", "json")
    data = json.loads(text)
    assert code == 1 and data["valid"] is False and reason in data["reason"]


def test_layouts_keep_never_merges_an_instance_typed_twice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _ = run("layouts", "h100-80gb", "--keep", "3g.40gb@4", "--keep", "3g.40gb@4")
    assert code == 2
    assert "3g.40gb@4 and 3g.40gb@4 overlap" in capsys.readouterr().err


def test_check_valid_layout() -> None:
    code, text = run("check", "a100-40gb", "4g.20gb@0", "3g.20gb@4")
    assert code == 0
    assert text.startswith("valid on a100-40gb: 4g.20gb@0 3g.20gb@4")


def test_check_places_loose_instances() -> None:
    data = run_json("check", "a30", "2g.12gb", "1g.6gb", "1g.6gb")
    assert isinstance(data, dict) and data["valid"] is True
    assert sorted(i["profile"] for i in data["layout"]) == ["1g.6gb", "1g.6gb", "2g.12gb"]


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["4g.20gb", "4g.20gb"], "2 x 4g.20gb exceed its maximum of 1 per GPU"),
        (["3g.20gb", "3g.20gb", "1g.5gb"], "need 9 memory slots"),
        (["1g.5gb+me@0", "1g.5gb+me@1"], "at most one media-extension"),
        (["7g.40gb@1"], "cannot start at memory slot 1"),
    ],
)
def test_check_invalid_exits_1_with_one_line_reason(args: list[str], reason: str) -> None:
    code, text = run("check", "a100-40gb", *args)
    assert code == 1
    assert text.startswith("invalid: ") and reason in text
    assert text.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["profiles", "v100"], "unknown GPU 'v100'"),
        (["check", "a100-40gb", "9g.40gb"], "no MIG profile matching '9g.40gb'"),
        (["check", "a100-40gb", "banana"], "not a MIG profile name"),
        (["layouts", "a100", "-o", "json"], "ambiguous"),
        (["layouts", "a100-40gb", "--keep", "3g.20gb"], "--keep needs PROFILE@START"),
    ],
)
def test_bad_input_exits_2_with_one_line_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run(*argv)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("migpilot: error: ") and message in err
    assert err.count("\n") == 1


def test_console_script_has_no_traceback() -> None:
    exe = Path(sys.executable).parent / "migpilot"
    proc = subprocess.run(
        [str(exe), "check", "h100-80gb", "3g.40gb@1"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1
    assert "cannot start at memory slot 1" in proc.stdout
    proc = subprocess.run(
        [str(exe), "profiles", "nope"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.startswith("migpilot: error:")
