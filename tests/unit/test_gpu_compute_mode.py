"""A whole GPU's compute mode, on the emulated backend and through the NVML adapter.

The adapter runs against the emulator-backed ``pynvml`` stand-in, so the NVML calls, the mode
codes and the error mapping (``NO_PERMISSION`` included) are those a real driver would see.
"""

from __future__ import annotations

import json
from pathlib import Path

import pynvml
import pytest

from migpilot.gpu import backend, emulated, nvml, nvml_standin
from migpilot.mig import catalog

H100 = catalog.resolve_gpu("h100-80gb")
Mode = backend.ComputeMode
Kind = backend.ErrorKind


def _emu(count: int = 2, **kw: object) -> emulated.EmulatedBackend:
    return emulated.EmulatedBackend([H100] * count, mig_enabled=False, **kw)  # type: ignore[arg-type]


def _adapter(
    emu: emulated.EmulatedBackend,
) -> tuple[nvml_standin.NvmlStandin, nvml.NvmlBackend]:
    standin = nvml_standin.NvmlStandin(emu)
    return standin, nvml.NvmlBackend(standin)


@pytest.mark.parametrize("via_nvml", [False, True], ids=["emulated", "nvml"])
@pytest.mark.parametrize("mode", list(Mode))
def test_a_mode_set_is_read_back_on_that_gpu_only(
    via_nvml: bool, mode: backend.ComputeMode
) -> None:
    emu = _emu()
    gpus: backend.GpuBackend = _adapter(emu)[1] if via_nvml else emu
    assert [gpus.compute_mode(i) for i in (0, 1)] == [Mode.DEFAULT, Mode.DEFAULT]
    gpus.set_compute_mode(1, mode)
    assert [gpus.compute_mode(i) for i in (0, 1)] == [Mode.DEFAULT, mode]
    assert emu.compute_mode(1) is mode


@pytest.mark.parametrize("via_nvml", [False, True], ids=["emulated", "nvml"])
def test_setting_a_mode_on_a_gpu_in_mig_mode_is_refused(via_nvml: bool) -> None:
    emu = emulated.EmulatedBackend([H100])
    gpus: backend.GpuBackend = _adapter(emu)[1] if via_nvml else emu
    with pytest.raises(backend.BackendError) as info:
        gpus.set_compute_mode(0, Mode.EXCLUSIVE_PROCESS)
    assert info.value.kind is Kind.NOT_SUPPORTED
    assert "MIG mode" in str(info.value)
    assert gpus.compute_mode(0) is Mode.DEFAULT


def test_the_adapter_refuses_mig_before_calling_the_driver() -> None:
    standin, adapter = _adapter(emulated.EmulatedBackend([H100]))
    with pytest.raises(backend.BackendError):
        adapter.set_compute_mode(0, Mode.EXCLUSIVE_PROCESS)
    assert "nvmlDeviceSetComputeMode" not in standin.calls


@pytest.mark.parametrize("kind", [Kind.NO_PERMISSION, Kind.UNKNOWN, Kind.NOT_SUPPORTED])
def test_driver_failures_map_to_their_kind_and_change_nothing(kind: backend.ErrorKind) -> None:
    emu = _emu()
    standin, adapter = _adapter(emu)
    emu.inject(emulated.Fault(emulated.Step.SET_COMPUTE_MODE, 1, emulated.FaultEffect.FAIL, kind))
    with pytest.raises(backend.BackendError) as info:
        adapter.set_compute_mode(0, Mode.EXCLUSIVE_PROCESS)
    assert info.value.kind is kind
    assert "setting compute mode exclusive-process" in str(info.value)
    assert adapter.compute_mode(0) is Mode.DEFAULT
    assert standin.calls.count("nvmlDeviceSetComputeMode") == 1


def test_the_adapter_uses_nvmls_mode_codes() -> None:
    emu = _emu()
    standin, adapter = _adapter(emu)
    adapter.set_compute_mode(0, Mode.EXCLUSIVE_PROCESS)
    handle = standin.nvmlDeviceGetHandleByIndex(0)
    assert standin.nvmlDeviceGetComputeMode(handle) == pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS
    standin.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_PROHIBITED)
    assert adapter.compute_mode(0) is Mode.PROHIBITED
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        standin.nvmlDeviceSetComputeMode(handle, pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD)


def test_the_mode_persists_in_the_state_file(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    _emu(state_path=path).set_compute_mode(1, Mode.EXCLUSIVE_PROCESS)
    again = emulated.EmulatedBackend(state_path=path)
    assert [again.compute_mode(i) for i in (0, 1)] == [Mode.DEFAULT, Mode.EXCLUSIVE_PROCESS]


def test_a_state_file_from_before_compute_modes_reads_default(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    _emu(state_path=path).set_compute_mode(0, Mode.PROHIBITED)
    doc = json.loads(path.read_text())
    assert doc["gpus"][0]["compute_mode"] == "prohibited"
    for g in doc["gpus"]:
        g.pop("compute_mode", None)
    path.write_text(json.dumps(doc))
    assert emulated.EmulatedBackend(state_path=path).compute_mode(0) is Mode.DEFAULT


def test_an_unknown_mode_in_the_state_file_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "gpus.json"
    _emu(state_path=path).set_compute_mode(0, Mode.PROHIBITED)
    doc = json.loads(path.read_text())
    doc["gpus"][0]["compute_mode"] = "exclusive-thread"
    path.write_text(json.dumps(doc))
    with pytest.raises(backend.BackendError, match="unknown compute mode 'exclusive-thread'"):
        emulated.EmulatedBackend(state_path=path).compute_mode(0)


def test_no_such_gpu_is_not_found() -> None:
    emu = _emu(1)
    for call in (lambda: emu.compute_mode(3), lambda: emu.set_compute_mode(3, Mode.DEFAULT)):
        with pytest.raises(backend.BackendError) as info:
            call()
        assert info.value.kind is Kind.NOT_FOUND
