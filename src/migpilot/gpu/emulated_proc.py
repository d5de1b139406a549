"""The driver's proc files for emulated GPUs: what the agent's CDI spec is made from.

Why it exists: the agent reads a GPU's device minor from
``/proc/driver/nvidia/gpus/<bus>/information`` and a MIG device's capability minors from
``/proc/driver/nvidia/capabilities/gpu<minor>/mig/gi<G>/access`` and ``.../ci<C>/access``
(``docs/cdi.md``). Emulated GPUs have no driver, so the emulated backend writes these files
below a proc root of its own (``--proc-root``), rewritten after every change, as the driver adds
and removes them when instances are created and destroyed: tests and the e2e read the same files
the agent reads on a GPU node.

The numbers are the driver's: GPU ``i`` is minor ``i`` (``/dev/nvidia<i>``); the capability
minors follow ``/proc/driver/nvidia-caps/mig-minors`` (``config`` 1, ``monitor`` 2, then per
GPU 15 GPU instances of 1 + 8 minors each: ``gpu<g>/gi<i>/access`` is 3 + 135 g + 9 i and its
``ci<c>/access`` one more plus c). The file formats are those seen on an H200 (driver
580.159.04, ``/work/shared/reference/gpu-h200-2026-11/cdi-facts.txt``). :func:`tree` is pure;
:func:`sync` writes it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from migpilot import files

GIS_PER_GPU = 15
CIS_PER_GI = 8
FIRST_GPU_MINOR = 3
"""``config`` and ``monitor`` take minors 1 and 2."""
ROOTS = ("proc/driver/nvidia/gpus", "proc/driver/nvidia/capabilities")
"""The folders below the proc root this module owns (anything else there is left alone)."""


@dataclass(frozen=True, slots=True)
class EmulatedGpu:
    """What the proc files say about one emulated GPU."""

    index: int
    uuid: str
    product_name: str
    instances: tuple[tuple[int, int | None], ...] = ()
    """``(GPU-instance id, compute-instance id or None)`` of each GPU instance."""


def bus_id(index: int) -> str:
    """The PCI bus id an emulated GPU is listed under (``0000:01:00.0`` for GPU 0)."""
    return f"0000:{index + 1:02x}:00.0"


def gi_minor(gpu_minor: int, gi: int) -> int:
    """The capability minor of ``gpu<g>/gi<i>/access``, as the driver numbers it."""
    return FIRST_GPU_MINOR + gpu_minor * GIS_PER_GPU * (1 + CIS_PER_GI) + gi * (1 + CIS_PER_GI)


def ci_minor(gpu_minor: int, gi: int, ci: int) -> int:
    """The capability minor of ``gpu<g>/gi<i>/ci<c>/access``."""
    return gi_minor(gpu_minor, gi) + 1 + ci


def _access(minor: int, mode: int) -> str:
    return f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n"


def _information(gpu: EmulatedGpu) -> str:
    rows = (
        ("Model", gpu.product_name),
        ("GPU UUID", gpu.uuid),
        ("Bus Type", "PCIe"),
        ("Bus Location", bus_id(gpu.index)),
        ("Device Minor", str(gpu.index)),
        ("GPU Excluded", "No"),
    )
    return "".join(f"{key}: \t {value}\n" for key, value in rows)


def tree(gpus: Sequence[EmulatedGpu]) -> dict[str, str]:
    """Path below the proc root -> content, for every file the driver would show."""
    caps = "proc/driver/nvidia/capabilities"
    out = {
        f"{caps}/mig/config": _access(1, 256),
        f"{caps}/mig/monitor": _access(2, 292),
    }
    for gpu in gpus:
        out[f"proc/driver/nvidia/gpus/{bus_id(gpu.index)}/information"] = _information(gpu)
        for gi, ci in gpu.instances:
            base = f"{caps}/gpu{gpu.index}/mig/gi{gi}"
            out[f"{base}/access"] = _access(gi_minor(gpu.index, gi), 292)
            if ci is not None:
                out[f"{base}/ci{ci}/access"] = _access(ci_minor(gpu.index, gi, ci), 292)
    return out


def sync(root: Path, wanted: Mapping[str, str]) -> None:
    """Make the files below ``root``'s :data:`ROOTS` exactly ``wanted``: changed files
    replaced atomically, files no longer wanted removed with their empty folders."""
    for rel, text in wanted.items():
        path = root / rel
        try:
            if path.read_text(encoding="utf-8") == text:
                continue
        except OSError:
            pass
        path.parent.mkdir(parents=True, exist_ok=True)
        files.write_atomically(path, text)
    for top in ROOTS:
        base = root / top
        if not base.is_dir():
            continue
        for folder, dirs, names in os.walk(base, topdown=False):
            for name in names:
                path = Path(folder) / name
                if str(path.relative_to(root)) not in wanted:
                    path.unlink(missing_ok=True)
            for name in dirs:
                sub = Path(folder) / name
                if not any(sub.iterdir()):
                    sub.rmdir()
