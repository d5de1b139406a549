"""Read-only: what the NVIDIA driver says about this machine's GPUs and their MIG profiles.

Run on a machine with NVIDIA GPUs: ``python bench/nvml_facts.py [OUT.json]``. It never changes
anything (no MIG mode change, no instance created or destroyed): it reads each GPU's name, PCI
device and board subsystem ids, memory and MIG mode, every GPU-instance profile the driver
offers (by NVML profile index: id, slices, instances, memory, SMs, engines, name) with its
possible placements, and the MIG devices that exist. ``bench/results/nvml-<gpu>.json`` holds
what it printed on real hardware; ``tests/unit/test_catalog_hardware.py`` checks the catalog
against those files.
Needs only nvidia-ml-py (no migpilot import), so it runs on a bare GPU machine.
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import pynvml  # type: ignore[import-untyped]


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _profiles(handle: Any) -> list[dict[str, Any]]:
    out = []
    for index in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, index)
        except pynvml.NVMLError as e:
            out.append({"nvml_index": index, "error": str(e)})
            continue
        row: dict[str, Any] = {
            "nvml_index": index,
            "id": int(info.id),
            "name": _text(getattr(info, "name", b"")),
            "slices": int(info.sliceCount),
            "instances": int(info.instanceCount),
            "memory_mib": int(info.memorySizeMB),
            "sms": int(info.multiprocessorCount),
            "copy": int(info.copyEngineCount),
            "decoder": int(info.decoderCount),
            "encoder": int(info.encoderCount),
            "jpeg": int(info.jpegCount),
            "ofa": int(info.ofaCount),
        }
        try:
            places = (pynvml.c_nvmlGpuInstancePlacement_t * 16)()
            count = ctypes.c_uint(16)
            pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
                handle, info.id, places, ctypes.byref(count)
            )
            row["placements"] = [
                [int(places[i].start), int(places[i].size)] for i in range(count.value)
            ]
        except pynvml.NVMLError as e:
            row["placements_error"] = str(e)
        out.append(row)
    return out


def main() -> int:
    pynvml.nvmlInit()
    facts: dict[str, Any] = {"driver": _text(pynvml.nvmlSystemGetDriverVersion()), "gpus": []}
    for index in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        pci = pynvml.nvmlDeviceGetPciInfo(h)
        gpu: dict[str, Any] = {
            "index": index,
            "name": _text(pynvml.nvmlDeviceGetName(h)),
            "pci_device_id": int(pci.pciDeviceId),
            # The board (what a mig-parted device-filter DEVICE:SUBSYSTEM names); records
            # taken before this field was read lack it.
            "pci_subsystem_id": int(pci.pciSubSystemId),
            "memory_mib": int(pynvml.nvmlDeviceGetMemoryInfo(h).total) // 2**20,
        }
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(h)
            gpu["mig_mode"] = {"current": int(current), "pending": int(pending)}
        except pynvml.NVMLError as e:
            gpu["mig_mode_error"] = str(e)
        gpu["profiles"] = _profiles(h)
        try:
            gpu["max_mig_devices"] = int(pynvml.nvmlDeviceGetMaxMigDeviceCount(h))
        except pynvml.NVMLError as e:
            gpu["max_mig_devices_error"] = str(e)
        facts["gpus"].append(gpu)
    pynvml.nvmlShutdown()
    text = json.dumps(facts, indent=2) + "\n"
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w", encoding="utf-8") as f:
            f.write(text)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
