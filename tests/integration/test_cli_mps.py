"""``migpilot mps check`` against the fake ``nvidia-cuda-mps-control`` on PATH."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from migpilot.cli import main as cli
from tests.integration import mps_fake


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    mps_fake.install(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(["mps", "check", *argv], out=out), out.getvalue()


def test_check_with_given_dirs(on_path: Path) -> None:
    pipe, log = on_path / "pipe", on_path / "log"
    try:
        code, text = run(
            "--pipe-dir",
            str(pipe),
            "--log-dir",
            str(log),
            "--device",
            "GPU-a",
            "--device",
            "GPU-b",
            "--active-thread-percentage",
            "50",
            "--pinned-mem-limit-mib",
            "2048",
        )
    finally:
        mps_fake.kill_daemons([pipe])
    assert code == 0
    assert f"binary:          {on_path / 'bin' / 'nvidia-cuda-mps-control'}" in text
    assert "devices:         GPU-a,GPU-b" in text
    assert "(control, nvidia-cuda-mps-control.pid)" in text
    assert "get_server_list: none" in text
    assert "sent:            set_default_device_pinned_mem_limit 1 2048M" in text
    assert "  startup pid=" in text
    assert "  command get_server_list" in text
    assert text.endswith("stopped:         the daemon quit\n")
    assert not (pipe / "nvidia-cuda-mps-control.pid").exists()
    assert (log / "control.log").read_text().splitlines()[-1] == "quit"


def test_check_in_scratch_dirs_cleans_up(on_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(on_path))
    code, text = run()
    assert code == 0, text
    assert "devices:         all" in text
    assert not [p for p in on_path.iterdir() if p.name.startswith("migpilot-mps-")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--binary", "/nowhere/mps-control"], "/nowhere/mps-control is not installed"),
        (["--pipe-dir", "/tmp/p"], "give both --pipe-dir and --log-dir, or neither"),
        (["--timeout", "0"], "--timeout 0 is not a positive number"),
        (["--active-thread-percentage", "0"], "active thread percentage 0 is not within 1-100"),
        (["--pinned-mem-limit-mib", "10"], "a pinned device memory limit needs the devices"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    on_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, text = run(*argv)
    err = capsys.readouterr().err
    assert code == 2
    assert text == ""
    assert err.startswith("migpilot: error: ")
    assert message in err
    assert err.count("\n") == 1


def test_a_daemon_that_fails_to_start(
    on_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FAKE_MPS_FAIL_START", "cannot open /dev/nvidiactl")
    code, _ = run("--timeout", "1")
    err = capsys.readouterr().err
    assert code == 2
    assert "did not come up" in err
    assert "cannot open /dev/nvidiactl" in err
    assert err.count("\n") == 1


def test_no_binary_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    code, _ = run()
    assert code == 2
    assert capsys.readouterr().err == (
        "migpilot: error: nvidia-cuda-mps-control is not installed (not an executable on "
        "PATH); MPS needs NVIDIA's driver utilities on the node\n"
    )
