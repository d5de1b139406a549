"""``migpilot fleet``: the flags become :class:`FleetSettings`; bad ones are one line, exit 2,
before anything connects."""

from __future__ import annotations

from pathlib import Path

import pytest

from migpilot.cli import fleet_cmd
from migpilot.cli import main as cli
from migpilot.kube import objects as kubeobjects
from migpilot.kwok import fleet


def settings(*argv: str) -> fleet.FleetSettings:
    return fleet_cmd.settings_from(cli.build_parser().parse_args(["fleet", *argv]))


def test_defaults() -> None:
    got = settings()
    assert got.selector == kubeobjects.LabelSelector(fleet.EMULATED_GPUS_LABEL)
    assert (got.workers, got.interval_s, got.resync_s) == (32, 30.0, 300.0)
    assert got.unified_counters
    assert not settings("--no-unified-counters").unified_counters
    assert got.metrics_port is None
    assert settings("--metrics-port", "9400").metrics_port == 9400
    assert (got.gpu_metrics_interval_s, got.emulated_load) == (5.0, None)
    assert (got.lease_namespace, got.lease_name) == ("migpilot-system", "migpilot-controller")
    got = settings("--lease-namespace", "gpu-system", "--lease-name", "mp")
    assert (got.lease_namespace, got.lease_name) == ("gpu-system", "mp")


def test_flags(tmp_path: Path) -> None:
    config = tmp_path / "kubeconfig"
    config.write_text("{}")
    got = settings(
        "--kubeconfig", str(config), "--fleet-selector", "pool=a", "--workers", "4",
        "--interval", "5", "--resync", "60", "--strategy", "single",
    )  # fmt: skip
    assert got.kubeconfig == config
    assert got.selector == kubeobjects.LabelSelector("pool", "a")
    assert (got.workers, got.interval_s, got.resync_s) == (4, 5.0, 60.0)
    assert got.strategy.value == "single"
    load = tmp_path / "load.yaml"
    load.write_text("ns/p: {utilization: 0.5}\n")
    got = settings("--emulated-load", str(load), "--gpu-metrics-interval", "1")
    assert (got.emulated_load, got.gpu_metrics_interval_s) == (load, 1.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1, got 0"),
        (["--interval", "0"], "--interval must be more than 0, got 0.0"),
        (["--resync", "-1"], "--resync must be more than 0, got -1.0"),
        (["--fleet-selector", "a=1,b=2"], "--fleet-selector 'a=1,b=2' is not LABEL or LABEL=VALUE"),
        (["--fleet-selector", "a="], "--fleet-selector 'a=' is not LABEL or LABEL=VALUE"),
        (["--kubeconfig", "/nonexistent/kc"], "--kubeconfig: no such file: /nonexistent/kc"),
        (["--strategy", "most"], "most"),
        (["--metrics-port", "70000"], "--metrics-port must be 0 to 65535, got 70000"),
        (["--gpu-metrics-interval", "0"], "--gpu-metrics-interval must be more than 0, got 0.0"),
        (["--emulated-load", "/nonexistent/l.yaml"], "--emulated-load: no such file"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["fleet", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("migpilot: error: ") and message in err
    assert err.count("\n") == 1
