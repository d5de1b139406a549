"""The catalog against what a real driver reported (``bench/results/nvml-*.json``).

Those files are the read-only output of ``bench/nvml_facts.py`` on a GPU machine (profile info
and possible placements by NVML profile index, PCI device id, name). Every profile the driver
offers must be in the catalog with the same driver id, slices, instance count, memory, SMs,
engines and placements (start, and size in memory slots); every catalog profile must be offered.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from migpilot.mig import catalog

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
FACTS = sorted(RESULTS.glob("nvml-*.json"))


def _gpus() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in FACTS:
        for gpu in json.loads(path.read_text())["gpus"]:
            out.append((f"{path.name}:{gpu['index']}", gpu))
    return out


def test_there_is_a_hardware_record() -> None:
    assert FACTS, "bench/results/nvml-*.json is missing"


@pytest.mark.parametrize(("where", "gpu"), _gpus(), ids=[w for w, _ in _gpus()])
def test_catalog_matches_the_driver(where: str, gpu: dict[str, Any]) -> None:
    model = catalog.resolve_gpu(gpu["name"])
    assert gpu["pci_device_id"] in model.pci_device_ids
    by_index = {p.nvml_index: p for p in model.profiles}
    offered = set()
    for row in gpu["profiles"]:
        p = by_index.get(row["nvml_index"])
        if "error" in row:
            assert p is None, f"{where}: the driver does not offer {p and p.name}"
            continue
        assert p is not None, (
            f"{where}: the catalog lacks {row['name']} (index {row['nvml_index']})"
        )
        offered.add(p.name)
        assert row["name"] == f"MIG {p.name}"
        assert (row["id"], row["slices"], row["instances"]) == (
            p.smi_id,
            p.compute_slices,
            p.max_instances,
        )
        assert (row["memory_mib"], row["sms"]) == (p.memory_mib, p.sms)
        engines = (row["copy"], row["decoder"], row["encoder"], row["jpeg"], row["ofa"])
        assert engines == (
            p.engines.copy,
            p.engines.decoder,
            p.engines.encoder,
            p.engines.jpeg,
            p.engines.ofa,
        )
        assert [tuple(pl) for pl in row["placements"]] == [
            (start, p.memory_slots) for start in p.placements
        ]
    assert offered == {p.name for p in model.profiles}
