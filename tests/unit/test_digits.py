"""Numbers users write are read with ASCII digits only: ``"٣"`` (Arabic-Indic three), ``"３"``
(fullwidth) and ``"³"`` are not 3, in a MIG profile name, an MPS slice resource, a sharing
config, an admission review, a node-affinity bound, a device ID, an XID list or a flag, as
Kubernetes, Go's strconv and NVIDIA's tools read them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import digits, errors
from migpilot.agent.deviceplugin import devices, health
from migpilot.cli import main as cli
from migpilot.mig import profiles
from migpilot.planning import constraints, modes, snapshot
from migpilot.sharing import config
from migpilot.webhook import admission

ARABIC_3 = "\u0663"
FULLWIDTH_3 = "\uff13"
NON_ASCII = [ARABIC_3, FULLWIDTH_3, "1" + ARABIC_3, "\u00b3", "\u0967\u0966"]


@pytest.mark.parametrize("text", NON_ASCII)
def test_integer_refuses_other_digits(text: str) -> None:
    assert not digits.is_digits(text)
    with pytest.raises(ValueError, match="ASCII digits"):
        digits.integer(text)


@given(st.integers(min_value=-(10**30), max_value=10**30))
def test_integer_reads_what_str_writes(value: int) -> None:
    assert digits.integer(str(value)) == value
    assert digits.integer(f" {value} ") == value
    assert digits.is_digits(str(value)) is (value >= 0)


@given(st.text(max_size=8))
def test_integer_never_reads_what_is_not_ascii(text: str) -> None:
    try:
        value = digits.integer(text)
    except ValueError:
        return
    assert text.strip().isascii() and value == int(text)


@pytest.mark.parametrize("name", [f"{ARABIC_3}g.40gb", f"1g.1{ARABIC_3}gb", f"{FULLWIDTH_3}g.40gb"])
def test_a_mig_profile_name_with_other_digits_is_not_a_profile(name: str) -> None:
    with pytest.raises(errors.UnknownProfileError):
        profiles.parse_profile_name(name)
    profiles.parse_profile_name("3g.40gb")  # the ASCII spelling is one


def test_an_mps_slice_resource_with_other_digits_is_not_one() -> None:
    assert modes.mps_gb("nvidia.com/gpu-13gb", where="c") == 13
    with pytest.raises(errors.SnapshotError):
        modes.mps_gb(f"nvidia.com/gpu-1{ARABIC_3}gb", where="c")


def test_a_pod_asking_for_a_count_in_other_digits_is_refused() -> None:
    with pytest.raises(errors.SnapshotError, match="expected a whole number"):
        snapshot.pod_requests({"nvidia.com/mig-1g.10gb": ARABIC_3}, where="c")
    assert snapshot.pod_requests({"nvidia.com/mig-1g.10gb": "3"}, where="c").mig


def test_the_webhook_does_not_gate_a_profile_in_other_digits() -> None:
    pod = {
        "metadata": {"name": "p"},
        "spec": {"containers": [{"name": "a", "resources": {"requests": {
            f"nvidia.com/mig-{ARABIC_3}g.40gb": "1"}}}]},
    }  # fmt: skip
    review = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "object": pod,
        },
    }
    decision = admission.decide(review, lease_fresh=True)
    assert decision.outcome is admission.Outcome.NO_MIG_REQUEST
    assert decision.warnings  # the misspelt name is warned of


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (f"{{name: mig-{ARABIC_3}g.40gb, replicas: 2}}", "resource name"),
        (f"{{name: gpu, replicas: 2, devices: ['{ARABIC_3}']}}", "unsupported type for device"),
    ],
)
def test_a_sharing_config_with_other_digits_is_refused(entry: str, message: str) -> None:
    text = f"sharing: {{timeSlicing: {{resources: [{entry}]}}}}"
    with pytest.raises(errors.SharingConfigError, match=message):
        config.parse(text, source="f.yaml")


def test_a_node_affinity_bound_in_other_digits_matches_nothing() -> None:
    gt = ((snapshot.Requirement("gpus", "Gt", ("2",)),),)
    assert constraints.affinity_matches(gt, {"gpus": "3"})
    assert not constraints.affinity_matches(gt, {"gpus": ARABIC_3})


def test_a_slice_id_and_an_xid_list_in_other_digits_are_not_read() -> None:
    assert devices.parse_slice_id("GPU-x::mps-3") == ("GPU-x", 3)
    assert devices.parse_slice_id(f"GPU-x::mps-{ARABIC_3}") is None
    with pytest.raises(errors.AgentConfigError, match="is not a number"):
        health.XidPolicy.from_disable_text(f"13,{ARABIC_3}")


def test_a_flag_in_other_digits_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(["config", "show", "f.yaml", "-c", "x", "--gpu", "h100", "--gpus", ARABIC_3])
    assert "is not a number" in capsys.readouterr().err
