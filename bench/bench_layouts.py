"""Speed of the layout engine: the operations the planner calls millions of times.

Run: ``.venv/bin/python bench/bench_layouts.py`` (after ``./scripts/test`` or ``./scripts/demo``
has set up ``.venv``). Prints a table and writes ``bench/results/layouts.json``. Timing never
decides a test; this file only records what was measured, on which machine.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from migpilot.mig import catalog, layouts

RESULTS = Path(__file__).parent / "results" / "layouts.json"


def per_call_us(fn: Callable[[], object], *, min_seconds: float = 0.3) -> float:
    """Median of 5 timings of a batch of calls, in microseconds per call."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t0 >= min_seconds / 5:
            break
        n *= 2
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    samples.sort()
    return samples[2] * 1e6


def uncached(fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        layouts._pack.cache_clear()
        layouts._validated.cache_clear()
        layouts._enumerate_cached.cache_clear()
        return fn()

    return call


def main() -> int:
    rows = []
    cases = {
        "a30-24gb": ["2g.12gb", "1g.6gb"],
        "a100-40gb": ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"],
        "h100-80gb": ["3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"],
        "rtx-pro-6000-blackwell-96gb": ["2g.48gb", "1g.24gb"],
    }
    for gpu, wanted in cases.items():
        m = catalog.resolve_gpu(gpu)
        full = layouts.place(m, wanted)
        fixed = full.instances[:1]
        ops: dict[str, Callable[[], object]] = {
            "violation(layout)": lambda m=m, full=full: layouts.violation(m, full.instances),
            "place(multiset) uncached": uncached(lambda m=m, w=wanted: layouts.place(m, w)),
            "place(multiset) cached": lambda m=m, w=wanted: layouts.place(m, w),
            "place beside fixed, cached": lambda m=m, w=wanted[1:], f=fixed: layouts.place(
                m, w, fixed=f
            ),
            "enumerate maximal uncached": uncached(lambda m=m: layouts.enumerate_layouts(m)),
            "completions(1 fixed) uncached": uncached(
                lambda m=m, f=fixed: layouts.completions(m, f)
            ),
        }
        for name, fn in ops.items():
            rows.append({"gpu": gpu, "operation": name, "us_per_call": round(per_call_us(fn), 2)})
    width = max(len(r["operation"]) for r in rows)
    print(f"{'GPU':28} {'OPERATION':{width}} {'µs/call':>10}")
    for r in rows:
        print(f"{r['gpu']:28} {r['operation']:{width}} {r['us_per_call']:>10.2f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "benchmark": "layouts",
                "command": "python bench/bench_layouts.py",
                "python": sys.version.split()[0],
                "machine": platform.machine(),
                "cpus": os.cpu_count(),
                "results": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
