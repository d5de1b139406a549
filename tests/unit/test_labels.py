"""GFD-compatible node labels: NVIDIA's keys and values for real configurations."""

from __future__ import annotations

import pytest

from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import changes, labels
from migpilot.mig import catalog, layouts

Strategy = devices.MigStrategy


def make_node(
    model_id: str,
    layouts: list[list[tuple[str, int]] | None],
    *,
    product: str | None = None,
    memory_mib: int = 40960,
) -> devices.NodeDevices:
    model = catalog.resolve_gpu(model_id)
    gpus, migs = [], []
    for i, layout in enumerate(layouts):
        gpus.append(
            devices.Gpu(
                index=i,
                uuid=f"GPU-{i}",
                model=model,
                product_name=product or model.product_names[0],
                memory_mib=memory_mib,
                mig_enabled=layout is not None,
            )
        )
        for gi, (name, start) in enumerate(layout or [], start=1):
            migs.append(
                devices.MigDevice(f"MIG-{i}-{gi}", i, model.profile_named(name), start, gi, 0)
            )
    return devices.NodeDevices(gpus=tuple(gpus), mig_devices=tuple(migs))


A100_BASE = {
    "nvidia.com/mig.capable": "true",
    "nvidia.com/mps.capable": "false",
    "nvidia.com/gpu.family": "ampere",
    "nvidia.com/gpu.compute.major": "8",
    "nvidia.com/gpu.compute.minor": "0",
}
A100_MIXED_LAYOUT = [("3g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6)]


def test_a100_mixed_3g_2g_1g() -> None:
    node = make_node("a100-40gb", [A100_MIXED_LAYOUT])
    assert labels.node_labels(node, Strategy.MIXED) == A100_BASE | {
        "nvidia.com/mig.strategy": "mixed",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
        "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.memory": "40960",
        "nvidia.com/mig-3g.20gb.product": "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
        "nvidia.com/mig-3g.20gb.count": "1",
        "nvidia.com/mig-3g.20gb.replicas": "1",
        "nvidia.com/mig-3g.20gb.sharing-strategy": "none",
        "nvidia.com/mig-3g.20gb.memory": "19968",
        "nvidia.com/mig-3g.20gb.multiprocessors": "42",
        "nvidia.com/mig-3g.20gb.slices.gi": "3",
        "nvidia.com/mig-3g.20gb.slices.ci": "3",
        "nvidia.com/mig-3g.20gb.engines.copy": "3",
        "nvidia.com/mig-3g.20gb.engines.decoder": "2",
        "nvidia.com/mig-3g.20gb.engines.encoder": "0",
        "nvidia.com/mig-3g.20gb.engines.jpeg": "0",
        "nvidia.com/mig-3g.20gb.engines.ofa": "0",
        "nvidia.com/mig-2g.10gb.product": "NVIDIA-A100-SXM4-40GB-MIG-2g.10gb",
        "nvidia.com/mig-2g.10gb.count": "1",
        "nvidia.com/mig-2g.10gb.replicas": "1",
        "nvidia.com/mig-2g.10gb.sharing-strategy": "none",
        "nvidia.com/mig-2g.10gb.memory": "9856",
        "nvidia.com/mig-2g.10gb.multiprocessors": "28",
        "nvidia.com/mig-2g.10gb.slices.gi": "2",
        "nvidia.com/mig-2g.10gb.slices.ci": "2",
        "nvidia.com/mig-2g.10gb.engines.copy": "2",
        "nvidia.com/mig-2g.10gb.engines.decoder": "1",
        "nvidia.com/mig-2g.10gb.engines.encoder": "0",
        "nvidia.com/mig-2g.10gb.engines.jpeg": "0",
        "nvidia.com/mig-2g.10gb.engines.ofa": "0",
        "nvidia.com/mig-1g.5gb.product": "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
        "nvidia.com/mig-1g.5gb.count": "1",
        "nvidia.com/mig-1g.5gb.replicas": "1",
        "nvidia.com/mig-1g.5gb.sharing-strategy": "none",
        "nvidia.com/mig-1g.5gb.memory": "4864",
        "nvidia.com/mig-1g.5gb.multiprocessors": "14",
        "nvidia.com/mig-1g.5gb.slices.gi": "1",
        "nvidia.com/mig-1g.5gb.slices.ci": "1",
        "nvidia.com/mig-1g.5gb.engines.copy": "1",
        "nvidia.com/mig-1g.5gb.engines.decoder": "0",
        "nvidia.com/mig-1g.5gb.engines.encoder": "0",
        "nvidia.com/mig-1g.5gb.engines.jpeg": "0",
        "nvidia.com/mig-1g.5gb.engines.ofa": "0",
    }


def test_mixed_counts_across_gpus_and_me_spelling() -> None:
    node = make_node(
        "h100-80gb",
        [[("1g.10gb+me", 0), ("1g.10gb", 1)], [("1g.10gb", 0)], None],
        product="NVIDIA H100 80GB HBM3",
        memory_mib=81559,
    )
    got = labels.node_labels(node, Strategy.MIXED)
    assert got["nvidia.com/mig-1g.10gb.count"] == "2"
    assert got["nvidia.com/mig-1g.10gb.me.count"] == "1"
    assert got["nvidia.com/mig-1g.10gb.me.product"] == "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb.me"
    assert got["nvidia.com/mig-1g.10gb.me.engines.ofa"] == "1"
    # A MIG-disabled GPU of the same product: whole-GPU labels count all three, replicas 1.
    assert got["nvidia.com/gpu.count"] == "3"
    assert got["nvidia.com/gpu.replicas"] == "1"
    assert got["nvidia.com/gpu.memory"] == "81559"
    assert got["nvidia.com/gpu.family"] == "hopper"
    assert not any(k.startswith("nvidia.com/mig-1g.20gb") for k in got)


def test_single_uniform() -> None:
    node = make_node("a100-40gb", [[("3g.20gb", 0), ("3g.20gb", 4)], [("3g.20gb", 0)]])
    assert labels.node_labels(node, Strategy.SINGLE) == A100_BASE | {
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
        "nvidia.com/gpu.count": "3",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.memory": "19968",
        "nvidia.com/gpu.multiprocessors": "42",
        "nvidia.com/gpu.slices.gi": "3",
        "nvidia.com/gpu.slices.ci": "3",
        "nvidia.com/gpu.engines.copy": "3",
        "nvidia.com/gpu.engines.decoder": "2",
        "nvidia.com/gpu.engines.encoder": "0",
        "nvidia.com/gpu.engines.jpeg": "0",
        "nvidia.com/gpu.engines.ofa": "0",
    }


INVALID = A100_BASE | {
    "nvidia.com/mig.strategy": "single",
    "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB-MIG-INVALID",
    "nvidia.com/gpu.count": "0",
    "nvidia.com/gpu.replicas": "0",
    "nvidia.com/gpu.sharing-strategy": "",
    "nvidia.com/gpu.memory": "0",
}


@pytest.mark.parametrize(
    "layouts",
    [
        [A100_MIXED_LAYOUT],  # more than one profile
        [[("1g.5gb", 0)], []],  # a MIG-enabled GPU with no MIG device
        [[("1g.5gb", 0)], None],  # MIG enabled and disabled mixed
        [[("1g.5gb", 0)], None, []],
    ],
)
def test_single_invalid(layouts: list[list[tuple[str, int]] | None]) -> None:
    node = make_node("a100-40gb", layouts)
    assert labels.node_labels(node, Strategy.SINGLE) == INVALID


def test_single_without_mig_is_whole_gpu_labels() -> None:
    node = make_node("a100-40gb", [None, None])
    assert labels.node_labels(node, Strategy.SINGLE) == A100_BASE | {
        "nvidia.com/mig.strategy": "single",
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
        "nvidia.com/gpu.count": "2",
        "nvidia.com/gpu.replicas": "1",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.memory": "40960",
    }


def test_none_ignores_mig_devices_and_sets_no_strategy() -> None:
    node = make_node("a100-40gb", [A100_MIXED_LAYOUT])
    assert labels.node_labels(node, Strategy.NONE) == A100_BASE | {
        "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB",
        "nvidia.com/gpu.count": "1",
        "nvidia.com/gpu.replicas": "0",
        "nvidia.com/gpu.sharing-strategy": "none",
        "nvidia.com/gpu.memory": "40960",
    }


def test_no_gpus_no_labels() -> None:
    assert labels.node_labels(devices.NodeDevices(gpus=()), Strategy.MIXED) == {}


@pytest.mark.parametrize("model", catalog.gpu_models(), ids=lambda m: m.id)
def test_family_from_compute_capability_matches_catalog(model: object) -> None:
    from migpilot.mig import profiles

    assert isinstance(model, profiles.GpuModel)
    assert labels.arch_family(*model.compute_capability) == model.family


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("NVIDIA A100-SXM4-40GB", "NVIDIA-A100-SXM4-40GB"),
        ("NVIDIA  H100 80GB HBM3 ", "NVIDIA-H100-80GB-HBM3"),
        ("NVIDIA RTX PRO 6000 (Blackwell)", "NVIDIA-RTX-PRO-6000-Blackwell"),
    ],
)
def test_sanitise_like_gfd(text: str, expected: str) -> None:
    assert labels.sanitise(text) == expected


@pytest.mark.parametrize("model", catalog.gpu_models(), ids=lambda m: m.id)
def test_every_profile_labels_are_strings_without_none(model: object) -> None:
    from migpilot.mig import profiles

    assert isinstance(model, profiles.GpuModel)
    layout = [(p.name, p.placements[0]) for p in model.profiles[:1]]
    node = make_node(model.id, [layout])
    got = labels.node_labels(node, Strategy.MIXED)
    key = "nvidia.com/mig-" + model.profiles[0].name.replace("+", ".")
    assert got[key + ".count"] == "1"
    assert all(isinstance(v, str) and v != "None" for v in got.values())


def _report(
    *,
    outcomes: tuple[changes.Outcome, ...] = (),
    refusals: tuple[changes.Refusal, ...] = (),
    converged: bool = True,
) -> changes.Report:
    create = changes.Change(changes.ChangeKind.CREATE, 0, layouts.Instance(0, "1g.10gb"))
    return changes.Report(
        devices={},
        applied=tuple(changes.Applied(create, o) for o in outcomes),
        refusals=refusals,
        converged=converged,
        duration_s=0.0,
    )


IN_USE = changes.Refusal(0, "in use", layouts.Instance(0, "1g.10gb"), in_use=True)
RESET = changes.Refusal(0, "needs a GPU reset")


@pytest.mark.parametrize(
    ("report", "unavailable", "state"),
    [
        (_report(outcomes=(changes.Outcome.DONE,)), False, "success"),
        (_report(), True, "failed"),
        (None, False, "failed"),
        (_report(outcomes=(changes.Outcome.DONE, changes.Outcome.FAILED)), False, "failed"),
        (_report(refusals=(IN_USE,)), False, "pending"),
        (_report(converged=False), False, "pending"),
        (_report(refusals=(IN_USE, RESET)), False, "failed"),
    ],
)
def test_mig_config_state(report: changes.Report | None, unavailable: bool, state: str) -> None:
    assert labels.config_state(report, unavailable=unavailable) == state
