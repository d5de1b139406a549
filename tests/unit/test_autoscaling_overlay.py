"""What a new node of empty MIG GPUs offers (mig/capacity.py), the Karpenter NodeOverlay that
says it (planning/overlays.py) and ``migpilot autoscaling overlay``."""

from __future__ import annotations

import io

import pytest
import yaml

from migpilot import errors
from migpilot.cli import main as cli
from migpilot.mig import capacity, catalog, layouts, profiles
from migpilot.planning import overlays

H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30-24gb")


def test_each_profile_alone_on_empty_gpus() -> None:
    assert capacity.profile_capacity(H100, 8) == {
        "1g.10gb": 56,
        "1g.10gb+me": 8,  # one media extension a GPU
        "1g.20gb": 32,
        "2g.20gb": 24,
        "3g.40gb": 16,
        "4g.40gb": 8,
        "7g.80gb": 8,
    }
    assert capacity.profile_capacity(A30, 2) == {
        "1g.6gb": 8,
        "1g.6gb+me": 2,
        "2g.12gb": 4,
        "2g.12gb+me": 2,
        "4g.24gb": 2,
    }


@pytest.mark.parametrize("model", catalog.gpu_models(), ids=lambda m: m.id)
def test_the_layout_model_places_exactly_that_many_and_agrees_with_the_catalog(
    model: profiles.GpuModel,
) -> None:
    for profile in model.profiles:
        most = capacity.most_on_one_gpu(model, profile.name)
        layouts.place(model, [profile.name] * most)  # they fit, somewhere
        with pytest.raises(errors.LayoutError):
            layouts.place(model, [profile.name] * (most + 1))
        assert most == profile.max_instances  # the catalog's -lgip "Total" column


@pytest.mark.parametrize("gpus", [0, -1, True, 2.5])
def test_a_node_needs_a_whole_number_of_gpus(gpus: object) -> None:
    with pytest.raises(errors.MigpilotError, match="GPU count must be a whole number"):
        capacity.profile_capacity(H100, gpus)  # type: ignore[arg-type]


def test_an_unknown_profile_is_named() -> None:
    with pytest.raises(errors.UnknownProfileError, match="5g.50gb"):
        capacity.most_on_one_gpu(H100, "5g.50gb")


def test_the_overlay_lists_every_mig_resource_for_the_selected_instance_types() -> None:
    requirements = overlays.parse_requirements(
        ["node.kubernetes.io/instance-type=p5.48xlarge", "karpenter.sh/nodepool=gpu",
         "node.kubernetes.io/instance-type=p5e.48xlarge"]
    )  # fmt: skip
    doc = overlays.node_overlay(H100, 8, requirements=requirements)
    assert doc["apiVersion"] == "karpenter.sh/v1alpha1" and doc["kind"] == "NodeOverlay"
    assert doc["metadata"] == {"name": "migpilot-h100-80gb-x8"}
    assert doc["spec"]["requirements"] == [
        {
            "key": "node.kubernetes.io/instance-type",
            "operator": "In",
            "values": ["p5.48xlarge", "p5e.48xlarge"],
        },
        {"key": "karpenter.sh/nodepool", "operator": "In", "values": ["gpu"]},
    ]
    assert doc["spec"]["capacity"] == {
        "nvidia.com/mig-1g.10gb": "56",
        "nvidia.com/mig-1g.10gb.me": "8",  # the device plugin's spelling of 1g.10gb+me
        "nvidia.com/mig-1g.20gb": "32",
        "nvidia.com/mig-2g.20gb": "24",
        "nvidia.com/mig-3g.40gb": "16",
        "nvidia.com/mig-4g.40gb": "8",
        "nvidia.com/mig-7g.80gb": "8",
    }
    named = overlays.node_overlay(H100, 1, requirements=requirements, name="h100.one")
    assert named["metadata"]["name"] == "h100.one"
    assert named["spec"]["capacity"]["nvidia.com/mig-1g.10gb"] == "7"


@pytest.mark.parametrize(
    ("texts", "message"),
    [
        (["instance-type"], "expected KEY=VALUE"),
        (["=x"], "expected KEY=VALUE"),
        (["a="], "expected KEY=VALUE"),
        (["a b=x"], "is not a label key"),
        (["Bad_Prefix/x=y"], "is not a label key"),
        (["a=has space"], "is not a label value"),
        (["a=" + "x" * 64], "is not a label value"),
    ],
)
def test_a_bad_requirement_is_named(texts: list[str], message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message):
        overlays.parse_requirements(texts)


def test_an_overlay_needs_a_requirement_and_a_good_name() -> None:
    with pytest.raises(errors.ConfigError, match="at least one requirement"):
        overlays.node_overlay(H100, 8, requirements=())
    good = overlays.parse_requirements(["a=b"])
    with pytest.raises(errors.ConfigError, match="not a DNS subdomain"):
        overlays.node_overlay(H100, 8, requirements=good, name="Upper")


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    return cli.main(list(argv), out=out), out.getvalue()


def test_the_command_prints_the_overlay_as_yaml() -> None:
    code, text = run(
        "autoscaling", "overlay", "--model", "H100-80GB", "--gpus", "8",
        "--requirement", "node.kubernetes.io/instance-type=gpu-h100-8x", "--name", "h100-x8",
    )  # fmt: skip
    assert code == 0
    doc = yaml.safe_load(text)
    requirements = overlays.parse_requirements(["node.kubernetes.io/instance-type=gpu-h100-8x"])
    assert doc == overlays.node_overlay(H100, 8, requirements=requirements, name="h100-x8")


def test_the_command_refuses_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert run("autoscaling", "overlay", "--model", "h100", "--gpus", "8")[0] == 2
    assert "at least one requirement" in capsys.readouterr().err
    assert (
        run("autoscaling", "overlay", "--model", "x99", "--gpus", "8", "--requirement", "a=b")[0]
        == 2
    )
    assert "unknown GPU 'x99'" in capsys.readouterr().err
    assert (
        run("autoscaling", "overlay", "--model", "h100", "--gpus", "0", "--requirement", "a=b")[0]
        == 2
    )
    assert "whole number >= 1, got 0" in capsys.readouterr().err
