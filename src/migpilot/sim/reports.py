"""The results of a simulation as rows: ``results.json``, ``-o json`` and the CLI table.

The row keys are fixed (``policy, pods_total, pods_scheduled, allocation_ratio, pending_p50_s,
pending_p95_s, pending_p99_s, reconfigurations, instances_destroyed, planner_seconds``, then
``requests_never_served``: the MIG requests no pod of which was ever scheduled); floats
are rounded so that equal simulations give byte-identical files. ``planner_seconds`` is the only
measured figure: ``None`` when timing is omitted (the determinism test does that).

Pure core: may import this package only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

from migpilot.sim import simulating

KEYS = (
    "policy",
    "pods_total",
    "pods_scheduled",
    "allocation_ratio",
    "pending_p50_s",
    "pending_p95_s",
    "pending_p99_s",
    "reconfigurations",
    "instances_destroyed",
    "planner_seconds",
    "requests_never_served",
)
HEADERS = (
    "policy",
    "scheduled",
    "never",
    "alloc %",
    "pend p50 s",
    "p95 s",
    "p99 s",
    "reconfigs",
    "destroyed",
    "planner s",
)


class ResultRow(TypedDict):
    """One policy's figures, as written to ``results.json``."""

    policy: str
    pods_total: int
    pods_scheduled: int
    allocation_ratio: float
    pending_p50_s: float
    pending_p95_s: float
    pending_p99_s: float
    reconfigurations: int
    instances_destroyed: int
    planner_seconds: float | None
    requests_never_served: list[str]


def row(result: simulating.Result, *, timing: bool = True) -> ResultRow:
    """The figures of one result (``planner_seconds`` ``None`` without ``timing``)."""
    return ResultRow(
        policy=result.policy,
        pods_total=result.pods_total,
        pods_scheduled=result.pods_scheduled,
        allocation_ratio=round(result.allocation_ratio, 4),
        pending_p50_s=round(result.pending_percentile(50), 3),
        pending_p95_s=round(result.pending_percentile(95), 3),
        pending_p99_s=round(result.pending_percentile(99), 3),
        reconfigurations=result.reconfigurations,
        instances_destroyed=result.instances_destroyed,
        planner_seconds=round(result.planner_seconds, 3) if timing else None,
        requests_never_served=list(result.requests_never_served),
    )


def table(rows: Sequence[ResultRow]) -> list[list[object]]:
    """Table cells in the order of :data:`HEADERS` (never scheduled = total - scheduled)."""
    return [
        [
            r["policy"],
            f"{r['pods_scheduled']}/{r['pods_total']}",
            r["pods_total"] - r["pods_scheduled"],
            f"{100 * r['allocation_ratio']:.1f}",
            f"{r['pending_p50_s']:.1f}",
            f"{r['pending_p95_s']:.1f}",
            f"{r['pending_p99_s']:.1f}",
            r["reconfigurations"],
            r["instances_destroyed"],
            None if r["planner_seconds"] is None else f"{r['planner_seconds']:.2f}",
        ]
        for r in rows
    ]
