"""bench/cdi_check.py without a GPU: NVML's stand-in over emulated GPUs whose driver files are
below a fake root. The spec it builds names the MIG device's GPU and caps; every node is absent
from the fake /dev (the check fails, saying so); nvidia-ctk's output is compared per device."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from migpilot.gpu import emulated, nvml, nvml_standin
from migpilot.mig import catalog

ROOT = Path(__file__).resolve().parents[2]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cdi_check", ROOT / "bench" / "cdi_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cdi_check"] = module
    spec.loader.exec_module(module)
    return module


cdi_check = _script()


def test_the_check_builds_the_spec_and_reports_absent_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "root"
    root.mkdir()
    emu = emulated.EmulatedBackend([catalog.resolve_gpu("h100-80gb")], proc_root=root)
    mig = emu.create_instance(0, profile="3g.40gb", start=0)
    standin = nvml_standin.NvmlStandin(emu)
    real = nvml.NvmlBackend
    monkeypatch.setattr(cdi_check.nvml, "NvmlBackend", lambda: real(standin))
    uuid = emu.gpus()[0].uuid
    monkeypatch.setattr(cdi_check, "nvml_minors", lambda: {uuid: 0})
    monkeypatch.setattr(cdi_check.shutil, "which", lambda _: None)
    out = tmp_path / "out" / "summary.json"
    assert cdi_check.main(["--out", str(out), "--root", str(root)]) == 1
    summary = json.loads(out.read_text())
    assert summary["errors"] == []
    (device,) = summary["spec"]["devices"]
    assert device["name"] == mig.uuid
    nodes = [n["path"] for n in device["containerEdits"]["deviceNodes"]]
    assert nodes == [
        "/dev/nvidia0",
        "/dev/nvidia-caps/nvidia-cap12",
        "/dev/nvidia-caps/nvidia-cap13",
    ]
    assert summary["checks"]["nvml_minor_matches_information"] == {uuid: True}
    rows = summary["checks"]["device_nodes"]
    assert len(rows) == 3 + 3  # the common nodes and the device's
    assert all(not r["ok"] and r["problem"].startswith("absent") for r in rows)
    assert summary["nvidia_ctk"] == "not installed"
    caps = summary["capabilities"]
    assert any(k.endswith("gpu0/mig/gi1/ci0/access") for k in caps)


def test_compare_names_what_only_one_side_has() -> None:
    spec = cdi_check.cdi.Spec("k/gpu", (cdi_check.cdi.Device("GPU-a", ("/dev/nvidia0",)),))
    theirs = cdi_check.ctk_specs(
        json.dumps(
            {
                "kind": "nvidia.com/gpu",
                "devices": [
                    {
                        "name": "GPU-a",
                        "containerEdits": {
                            "deviceNodes": [{"path": "/dev/nvidia0"}, {"path": "/dev/dri/card1"}]
                        },
                    }
                ],
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-modeset"}]
                },
            }
        )
    )
    diff = cdi_check.compare(spec, theirs)
    assert diff["devices"] == [
        {
            "device": "GPU-a",
            "ours": ["/dev/nvidia0"],
            "nvidia_ctk": ["/dev/dri/card1", "/dev/nvidia0"],
            "only_ours": [],
            "only_nvidia_ctk": ["/dev/dri/card1"],
        }
    ]
    assert diff["common"]["only_ours"] == ["/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert diff["common"]["only_nvidia_ctk"] == ["/dev/nvidia-modeset"]


def test_ctk_yaml_output_is_read_too() -> None:
    text = "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: GPU-a\n"
    assert cdi_check.ctk_specs(text)[0]["devices"] == [{"name": "GPU-a"}]


def test_check_nodes_looks_below_the_root_where_dev_is(tmp_path: Path) -> None:
    """A node present below ``root/dev`` is found (here a plain file, so the check says it is
    not a character device rather than absent), an absent one is said absent."""
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").write_text("")
    spec = cdi_check.cdi.Spec("k/gpu", (cdi_check.cdi.Device("GPU-a", ("/dev/nvidia0",)),))
    facts = cdi_check.cdi.DriverFacts(gpu_minors={"GPU-a": 0}, cap_minors={})
    rows = cdi_check.check_nodes(spec, root=tmp_path, facts=facts, majors={"nvidia": 195})
    by_path = {r["path"]: r for r in rows}
    assert by_path["/dev/nvidia0"]["problem"] == "not a character device"
    assert by_path["/dev/nvidiactl"]["problem"].startswith("absent")
