"""Run a burst of allocation-heavy pure computation (a plan, a simulation) without the cyclic GC.

The planner allocates millions of short-lived tuples and frozen sets and no reference cycles
worth collecting; reference counting frees them. Left on, Python's cyclic collector still runs
every few hundred allocations and, in its full collections, walks every live object (the
snapshot, the layout caches), which cost about a fifth of a plan at 8,000 GPUs. The shells (the
CLI, the benchmark, later the controller) wrap planning in :func:`paused`; the pure core never
touches the collector itself. Imports nothing from the project.

It collects nothing itself: a full collection walks the whole heap, and in the controller (the
watches' store of thousands of pods and nodes) that cost 0.4-0.5 s at every plan, twenty times
the incremental pass it wrapped (bench_scale, 1,000 nodes with 5,000 pods bound). Garbage alive
on entry is frozen with the rest and collected after the block, as usual.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Freeze what is alive now out of the collector's sight and pause it until the block ends.

    Objects alive on entry (the parsed snapshot) move to the permanent generation and come back
    on exit; the collector is re-enabled on exit if it was enabled, so any cycle made inside is
    collected later as usual.
    """
    was_enabled = gc.isenabled()
    gc.freeze()  # no gc.collect() first: see the module
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
        gc.unfreeze()
