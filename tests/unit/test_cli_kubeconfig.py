"""Every command that takes ``--kubeconfig`` says in one line (exit 2) that a file is no
kubeconfig, whatever YAML (or not) it holds."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from migpilot.cli import main as cli


@pytest.mark.parametrize(
    "text", ["just a string", "- a\n- list\n", "{unclosed: [", "", "[" * 5000 + "]" * 5000]
)
def test_a_file_that_is_no_kubeconfig_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    """Found by hand: lightkube reads any YAML, and a string or a list crashed every command
    that takes --kubeconfig with a traceback."""
    (tmp_path / "kc").write_text(text)
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("x")
    webhook = ["webhook", "--cert", str(tmp_path / "tls.crt"), "--key", str(tmp_path / "tls.key")]
    agent = ["agent", "--backend", "emulated:a100-80gb:x1", "--node", "n", "--no-kubelet"]
    agent += ["--state-file", str(tmp_path / "state.json")]
    for command in (["controller"], ["fleet"], webhook, agent, ["status"], ["status", "--watch"]):
        code = cli.main([*command, "--kubeconfig", str(tmp_path / "kc")], out=io.StringIO())
        assert code == cli.EXIT_BAD_INPUT, command
        err = capsys.readouterr().err
        assert f"--kubeconfig {tmp_path / 'kc'}" in err and err.count("\n") == 1, err
