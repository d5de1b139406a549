"""``migpilot webhook``: flags become Settings and one call to ``serving.run``; bad input is one
line and exit 2 before anything is served."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from migpilot.cli import main as cli
from migpilot.webhook import serving


def test_flags_become_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tls.crt", "tls.key", "kubeconfig"):
        (tmp_path / name).write_text("x")
    got: list[serving.Settings] = []
    monkeypatch.setattr(serving, "run", got.append)
    argv = ["webhook", "--cert", str(tmp_path / "tls.crt"), "--key", str(tmp_path / "tls.key")]
    argv += ["--port", "8443", "--kubeconfig", str(tmp_path / "kubeconfig")]
    argv += ["--lease-namespace", "gpu-system"]
    assert cli.main(argv, out=io.StringIO()) == 0
    assert got == [
        serving.Settings(
            tls=serving.TlsSettings(tmp_path / "tls.crt", tmp_path / "tls.key"),
            lease=serving.LeaseSettings(namespace="gpu-system", kubeconfig=tmp_path / "kubeconfig"),
            port=8443,
        )
    ]
    assert got[0].cert_check_s == 10.0
    assert (got[0].max_connections, got[0].request_timeout_s) == (64, 10.0)
    assert got[0].connection_timeout_s == 30.0
    assert got[0].metrics_port is None  # no metrics port unless asked for


def test_metrics_flags_become_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("x")
    got: list[serving.Settings] = []
    monkeypatch.setattr(serving, "run", got.append)
    argv = ["webhook", "--cert", str(tmp_path / "tls.crt"), "--key", str(tmp_path / "tls.key")]
    argv += ["--metrics-port", "8080", "--metrics-address", "127.0.0.1"]
    assert cli.main(argv, out=io.StringIO()) == 0
    assert (got[0].metrics_port, got[0].metrics_host, got[0].port) == (8080, "127.0.0.1", 9443)
    assert cli.main([*argv[:5], "--metrics-port", "0"], out=io.StringIO()) == 0
    assert (got[1].metrics_port, got[1].metrics_host) == (None, "0.0.0.0")


def test_limit_flags_become_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("x")
    got: list[serving.Settings] = []
    monkeypatch.setattr(serving, "run", got.append)
    argv = ["webhook", "--cert", str(tmp_path / "tls.crt"), "--key", str(tmp_path / "tls.key")]
    argv += ["--max-connections", "8", "--request-timeout", "2.5", "--idle-timeout", "60"]
    assert cli.main(argv, out=io.StringIO()) == 0
    assert (got[0].max_connections, got[0].request_timeout_s) == (8, 2.5)
    assert got[0].connection_timeout_s == 60.0
    assert got[0].lease.name == "migpilot-controller"
    assert got[0].lease.cache_s == 2.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kubeconfig", "/nonexistent/kc"], "no such file"),
        (["--port", "0"], "--port"),
        (["--cert-check-interval", "0"], "--cert-check-interval must be more than 0"),
        (["--cert-check-interval", "nan"], "--cert-check-interval must be more than 0"),
        (["--max-connections", "0"], "--max-connections must be 1..10000"),
        (["--request-timeout", "0"], "--request-timeout must be more than 0"),
        (["--request-timeout", "nan"], "--request-timeout must be more than 0"),
        (["--idle-timeout", "-1"], "--idle-timeout must be more than 0"),
        (["--metrics-port", "65536"], "--metrics-port must be 0..65535, got 65536"),
        (["--metrics-port", "-1"], "--metrics-port must be 0..65535"),
        (["--metrics-port", "9443"], "--metrics-port must differ from --port"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    for name in ("tls.crt", "tls.key"):
        (tmp_path / name).write_text("x")
    argv = ["webhook", "--cert", str(tmp_path / "tls.crt"), "--key", str(tmp_path / "tls.key")]
    assert cli.main(argv + extra, out=io.StringIO()) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1
