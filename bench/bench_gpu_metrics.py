"""Cost per GPU of one GPU-metrics sampling pass (GpuBackend.sample plus the row builder).

Run: ``python bench/bench_gpu_metrics.py``; prints a table and writes
``bench/results/gpu_metrics.json``. Eight H100 GPUs with seven 1g.10gb instances each, every
instance held by a pod with a load; backends: emulated, and the NVML adapter over the stand-in.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from migpilot.agent import running, usage
from migpilot.gpu import emulated, nvml, nvml_standin
from migpilot.mig import catalog

GPUS = 8
PASSES = 50


def main() -> None:
    """Time the passes and write the results."""
    model = catalog.resolve_gpu("h100-80gb")
    emu = emulated.EmulatedBackend([model] * GPUS, durable=False)
    for g in range(GPUS):
        for start in range(7):
            emu.create_instance(g, profile="1g.10gb", start=start)
    state = {i.index: running.reconciling.GpuState(i, emu.mig_devices(i.index)) for i in emu.gpus()}
    view = running.node_view(state)
    held = [
        usage.Holding("bench", f"p{n}", "c", "nvidia.com/mig-1g.10gb", m.uuid)
        for n, m in enumerate(view.mig_devices)
    ]
    loads = {h.key: usage.PodLoad(0.5, 1024) for h in held}
    emu.drive(lambda: usage.device_loads(loads, held))
    results = {}
    for name, gpus in (
        ("emulated", emu),
        ("nvml-standin", nvml.NvmlBackend(nvml_standin.NvmlStandin(emu))),
    ):
        for g in range(GPUS):
            gpus.sample(g)  # the first GPM sample
        t0 = time.perf_counter()
        for _ in range(PASSES):
            samples = {g: gpus.sample(g) for g in range(GPUS)}
            rows = usage.series(node="n", view=view, holdings=held, samples=samples, owners={})
        per_gpu_ms = (time.perf_counter() - t0) / PASSES / GPUS * 1000
        results[name] = {"per_gpu_ms": round(per_gpu_ms, 3), "rows_per_pass": len(rows)}
    print(f"{'backend':<14} {'ms/GPU/pass':>12} {'rows':>6}")
    for name, r in results.items():
        print(f"{name:<14} {r['per_gpu_ms']:>12} {r['rows_per_pass']:>6}")
    out = {
        "command": "python bench/bench_gpu_metrics.py",
        "gpus": GPUS,
        "instances_per_gpu": 7,
        "passes": PASSES,
        "machine": platform.processor() or platform.machine(),
        "results": results,
        "note": "real NVML, H200: one nvmlGpmSampleGet 80 us, one process list 28 us "
        "(/work/shared/reference/gpu-h200-2026-11/gpm.json)",
    }
    path = Path(__file__).parent / "results" / "gpu_metrics.json"
    path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
