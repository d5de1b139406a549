"""Cost per GPU of one GPU-metrics sampling pass (GpuBackend.sample plus the row builder).

Run: ``python bench/bench_gpu_metrics.py``; prints a table and writes
``bench/results/gpu_metrics.json``. Two scenes of eight H100 GPUs, every device held by a pod
with a load:

- ``mig``: MIG on, seven 1g.10gb instances per GPU (GPM per instance, no per-process
  utilisation: NVML gives none under MIG);
- ``mps``: MIG off, seven 10 GB MPS slices per GPU, one client process each (the per-process
  utilisation read, ``nvmlDeviceGetProcessesUtilizationInfo``, and its attribution to slices).

Backends: emulated, and the NVML adapter over the stand-in (which answers each NVML call from the
emulator, so its figures are the adapter's Python cost, not the driver's).
"""

from __future__ import annotations

import functools
import json
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from migpilot.agent import running, sampling, usage
from migpilot.agent.deviceplugin import devices
from migpilot.gpu import backend, emulated, nvml, nvml_standin
from migpilot.mig import catalog

GPUS = 8
DEVICES_PER_GPU = 7
PASSES = 50

Scene = tuple[emulated.EmulatedBackend, devices.NodeDevices, list[usage.Holding], sampling.Owners]


def _mig_scene() -> Scene:
    model = catalog.resolve_gpu("h100-80gb")
    emu = emulated.EmulatedBackend([model] * GPUS, durable=False)
    for g in range(GPUS):
        for start in range(DEVICES_PER_GPU):
            emu.create_instance(g, profile="1g.10gb", start=start)
    state = {i.index: running.changes.GpuState(i, emu.mig_devices(i.index)) for i in emu.gpus()}
    view = running.node_view(state)
    held = [
        usage.Holding("bench", f"p{n}", "c", "nvidia.com/mig-1g.10gb", m.uuid)
        for n, m in enumerate(view.mig_devices)
    ]
    return emu, view, held, _nobody


def _nobody(processes: Sequence[backend.ProcessSample]) -> Mapping[int, str]:
    return {}  # MIG devices are exclusive: no process needs a pod


def _mps_scene() -> Scene:
    model = catalog.resolve_gpu("h100-80gb")
    emu = emulated.EmulatedBackend([model] * GPUS, durable=False, mig_enabled=False)
    state = {i.index: running.changes.GpuState(i, ()) for i in emu.gpus()}
    base = running.node_view(state)
    slices = tuple(
        devices.MpsSlice(g, n, 10) for g in range(GPUS) for n in range(1, DEVICES_PER_GPU + 1)
    )
    view = devices.NodeDevices(gpus=base.gpus, mig_devices=(), mps_slices=slices)
    held = [
        usage.Holding("bench", f"p{n}", "c", "nvidia.com/gpu-10gb", device_id)
        for n, device_id in enumerate(sorted(view.slice_device_ids()))
    ]
    return emu, view, held, sampling.emulated_owners(emu)


def main() -> None:
    """Time the passes and write the results."""
    results: dict[str, dict[str, dict[str, float]]] = {}
    for scene, build in (("mig", _mig_scene), ("mps", _mps_scene)):
        emu, view, held, owners = build()
        loads = {h.key: usage.PodLoad(0.5 / DEVICES_PER_GPU, 1024) for h in held}
        emu.drive(functools.partial(usage.device_loads, loads, held))
        gpus_by_name: tuple[tuple[str, backend.GpuBackend], ...] = (
            ("emulated", emu),
            ("nvml-standin", nvml.NvmlBackend(nvml_standin.NvmlStandin(emu))),
        )
        results[scene] = {}
        for name, gpus in gpus_by_name:
            for g in range(GPUS):
                gpus.sample(g)  # the first GPM sample, the first process-utilisation timestamp
            rows: tuple[usage.Row, ...] = ()
            t0 = time.perf_counter()
            for _ in range(PASSES):
                samples = {g: gpus.sample(g) for g in range(GPUS)}
                procs = [p for s in samples.values() for p in s.processes or ()]
                rows = usage.series(
                    node="n", view=view, holdings=held, samples=samples, owners=owners(procs)
                )
            per_gpu_ms = (time.perf_counter() - t0) / PASSES / GPUS * 1000
            util_rows = sum(r.name == usage.DEVICE_UTILIZATION for r in rows)
            results[scene][name] = {
                "per_gpu_ms": round(per_gpu_ms, 3),
                "rows_per_pass": len(rows),
                "device_utilization_rows": util_rows,
            }
    print(f"{'scene':<6} {'backend':<14} {'ms/GPU/pass':>12} {'rows':>6} {'util rows':>10}")
    for scene, per in results.items():
        for name, r in per.items():
            print(
                f"{scene:<6} {name:<14} {r['per_gpu_ms']:>12} {r['rows_per_pass']:>6}"
                f" {r['device_utilization_rows']:>10}"
            )
    out = {
        "command": "python bench/bench_gpu_metrics.py",
        "gpus": GPUS,
        "devices_per_gpu": DEVICES_PER_GPU,
        "passes": PASSES,
        "machine": platform.processor() or platform.machine(),
        "results": results,
        "note": "real NVML, H200: one nvmlGpmSampleGet 80 us, one process list 28 us "
        "(/work/shared/reference/gpu-h200-2026-11/gpm.json); the per-process utilisation "
        "read is not yet timed on real hardware",
    }
    path = Path(__file__).parent / "results" / "gpu_metrics.json"
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
