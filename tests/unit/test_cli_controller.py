"""``migpilot controller``'s flags: settings built from them, bad values refused with a reason."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from migpilot import errors
from migpilot.cli import controller_cmd
from migpilot.planning import snapshot


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    controller_cmd.register(sub)
    return parser.parse_args(["controller", *argv])


def test_defaults() -> None:
    settings = controller_cmd.settings_from(_parse("--identity", "me"))
    assert settings.kubeconfig is None
    assert settings.metrics_port == 8080
    c = settings.controller
    assert (c.identity, c.batch_window_s, c.reservation_timeout_s) == ("me", 0.25, 60.0)
    assert (c.lease_namespace, c.lease_name) == ("migpilot-system", "migpilot-controller")
    assert c.policy is snapshot.Policy.BINPACK
    assert c.gpu_policy is snapshot.Policy.SPREAD
    assert c.dra_scoring == "LeastAllocated"


def test_flags(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("{}")
    settings = controller_cmd.settings_from(
        _parse(
            "--kubeconfig",
            str(kubeconfig),
            "--batch-window",
            "0",
            "--scoring",
            "spread",
            "--gpu-policy",
            "binpack",
            "--dra-scoring-strategy",
            "MostAllocated",
            "--metrics-port",
            "0",
            "--lease-namespace",
            "ns",
            "--identity",
            "c2",
            "--reservation-timeout",
            "5",
        )
    )
    assert settings.kubeconfig == kubeconfig
    assert settings.metrics_port is None
    c = settings.controller
    assert (c.batch_window_s, c.policy, c.lease_namespace, c.identity) == (
        0.0,
        snapshot.Policy.SPREAD,
        "ns",
        "c2",
    )
    assert c.reservation_timeout_s == 5.0
    assert c.gpu_policy is snapshot.Policy.BINPACK
    assert c.dra_scoring == "MostAllocated"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--batch-window", "-1"), "--batch-window must be 0 or more"),
        (("--metrics-port", "70000"), "--metrics-port must be 0..65535"),
        (("--reservation-timeout", "0"), "--reservation-timeout must be more than 0"),
        (("--kubeconfig", "/nonexistent/kc"), "no such file"),
    ],
)
def test_bad_values_are_refused_with_a_reason(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(errors.MigpilotError, match=message):
        controller_cmd.settings_from(_parse("--identity", "x", *argv))


def test_node_policy_is_the_new_name_of_scoring(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kc"
    kubeconfig.write_text("{}")
    settings = controller_cmd.settings_from(
        _parse("--kubeconfig", str(kubeconfig), "--node-policy", "spread")
    )
    assert settings.controller.policy is snapshot.Policy.SPREAD


def test_leader_election_timings_default_to_client_gos_and_follow_the_flags() -> None:
    c = controller_cmd.settings_from(_parse("--identity", "me")).controller
    assert (c.lease_duration_s, c.renew_deadline_s, c.renew_every_s, c.lease_timeout_s) == (
        15,
        10.0,
        2.0,
        4.0,
    )
    flags = ("--lease-duration", "6", "--renew-deadline", "4", "--retry-period", "1")
    c = controller_cmd.settings_from(
        _parse("--identity", "me", *flags, "--lease-timeout", "2")
    ).controller
    assert (c.lease_duration_s, c.renew_deadline_s, c.renew_every_s, c.lease_timeout_s) == (
        6,
        4.0,
        1.0,
        2.0,
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--renew-deadline", "15"), "renew deadline .* must be shorter than the Lease duration"),
        (("--lease-timeout", "9"), "timeout .* must be at most the renew deadline"),
    ],
)
def test_timings_without_a_safety_margin_are_refused(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(errors.MigpilotError, match=message):
        controller_cmd.settings_from(_parse("--identity", "x", *argv))


def test_full_replan_every() -> None:
    """Incremental passes between full replans every 60 s by default; ``0`` turns them off (every
    plan full); a negative or infinite period is refused naming the flag."""
    default = controller_cmd.settings_from(_parse("--identity", "me")).controller
    assert default.full_replan_s == 60.0
    every = controller_cmd.settings_from(_parse("--full-replan-every", "5")).controller
    assert every.full_replan_s == 5.0
    off = controller_cmd.settings_from(_parse("--full-replan-every", "0")).controller
    assert off.full_replan_s is None
    for bad in ("-1", "inf"):
        with pytest.raises(errors.MigpilotError, match="--full-replan-every must be"):
            controller_cmd.settings_from(_parse("--full-replan-every", bad))
