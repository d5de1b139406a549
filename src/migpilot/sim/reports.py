"""The results of a simulation: ``results.json``, ``-o json`` and the CLI table.

One document per run (:class:`Document`): the mode, the yardstick's rule (:data:`RULES`), the
LP ``upper_bound`` (inflate mode), the kinds of request that count, the leaders (best policy
serving every kind of request, best of all, most pods scheduled, lowest p99 pending time),
whether migpilot met the rule on this run, and one row per policy. The row keys are fixed
(:data:`KEYS`); ``serves_every_request`` says whether the policy ran at least one pod of every
kind of request (:func:`simulating.request_kind`) some GPU of the cluster could serve,
``requests_never_served`` names the kinds it did not, ``share_of_bound`` is its allocation ratio
over the bound (inflate mode; ``None`` otherwise). Floats are rounded so that equal simulations
give byte-identical files. ``planner_seconds`` is the only measured figure: ``None`` when timing
is omitted (the determinism test does that).

Pure core: may import this package only.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable, Sequence
from typing import TypedDict

from migpilot.sim import simulating

SHARE_OF_BOUND_GOAL = 0.97
"""Inflate mode: the share of the LP bound migpilot's allocation ratio must reach."""
MARK = "*"
"""Marks, in the table, a policy that left a kind of request unserved."""
RULES = {
    simulating.Replay.INFLATE: (
        "migpilot's allocation ratio is at least that of every policy that ran a pod of every "
        "kind of MIG request the cluster could serve, and at least "
        f"{100 * SHARE_OF_BOUND_GOAL:g}% of the LP upper bound"
    ),
    simulating.Replay.FAITHFUL: (
        "migpilot schedules the most pods and has the lowest p99 pending time"
    ),
}
"""The yardstick migpilot is held to, per mode, in one sentence."""

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
    "share_of_bound",
    "serves_every_request",
    "requests_never_served",
    "mode_switches",
    "whole_gpu_pods",
)
HEADERS = (
    "policy",
    "scheduled",
    "never",
    "alloc %",
    "p50 s",
    "p95 s",
    "p99 s",
    "reconfigs",
    "destroyed",
    "planner s",
)
"""The table's columns (pending time percentiles in seconds); a policy that left a kind of
request unserved is marked with :data:`MARK`."""


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
    share_of_bound: float | None
    serves_every_request: bool
    requests_never_served: list[str]
    mode_switches: int
    """GPUs whose MIG mode a plan switched (dynamic MIG mode)."""
    whole_gpu_pods: int
    """Whole-GPU pods bound to whole GPUs."""


class Leader(TypedDict):
    """The policies (several when tied) with the best value of one figure."""

    policies: list[str]
    figure: float


class Document(TypedDict):
    """``results.json`` and ``-o json``: one run of every policy."""

    mode: str
    rule: str
    upper_bound: float | None
    request_kinds: list[str]
    best_serving_every_request: Leader | None
    """Highest allocation ratio among the policies with ``serves_every_request``."""
    best_of_all: Leader | None
    """Highest allocation ratio of all."""
    most_pods_scheduled: Leader | None
    lowest_pending_p99_s: Leader | None
    rule_met: bool | None
    """Whether migpilot met :data:`RULES` on this run; ``None`` when migpilot was not run."""
    results: list[ResultRow]


def share(ratio: float, bound: float | None) -> float | None:
    """``ratio`` over the bound (``None`` without a positive bound)."""
    return ratio / bound if bound is not None and bound > 0 else None


def row(result: simulating.Result, *, timing: bool = True, bound: float | None = None) -> ResultRow:
    """The figures of one result (``planner_seconds`` ``None`` without ``timing``;
    ``share_of_bound`` ``None`` without ``bound``)."""
    of_bound = share(result.allocation_ratio, bound)
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
        share_of_bound=None if of_bound is None else round(of_bound, 4),
        serves_every_request=result.serves_every_request,
        requests_never_served=list(result.requests_never_served),
        mode_switches=result.mode_switches,
        whole_gpu_pods=result.whole_gpu_pods,
    )


def _leader(
    results: Sequence[simulating.Result],
    figure: Callable[[simulating.Result], float],
    *,
    most: bool,
) -> Leader | None:
    if not results:
        return None
    values = [figure(r) for r in results]
    best = max(values) if most else min(values)
    return Leader(
        policies=[r.policy for r, v in zip(results, values, strict=True) if v == best],
        figure=best,
    )


def rule_met(
    results: Sequence[simulating.Result], *, mode: simulating.Replay, bound: float | None
) -> bool | None:
    """Whether migpilot met :data:`RULES` of ``mode`` on these results (``None``: not run).

    Inflate: its allocation ratio is at least that of every policy that serves every kind of
    request, and at least :data:`SHARE_OF_BOUND_GOAL` of ``bound``. Faithful: no policy
    scheduled more pods, and none has a lower p99 pending time.
    """
    mine = next((r for r in results if r.policy == "migpilot"), None)
    if mine is None:
        return None
    others = [r for r in results if r is not mine]
    if mode is simulating.Replay.INFLATE:
        of_bound = share(mine.allocation_ratio, bound)
        return (of_bound is None or of_bound >= SHARE_OF_BOUND_GOAL) and all(
            mine.allocation_ratio >= r.allocation_ratio for r in others if r.serves_every_request
        )
    p99 = mine.pending_percentile(99)
    return all(
        mine.pods_scheduled >= r.pods_scheduled and p99 <= r.pending_percentile(99) for r in others
    )


def document(
    results: Sequence[simulating.Result],
    *,
    mode: simulating.Replay,
    bound: float | None,
    timing: bool = True,
) -> Document:
    """The document of one run; ``bound`` is the LP upper bound (inflate mode) or ``None``."""

    def ratio(r: simulating.Result) -> float:
        return round(r.allocation_ratio, 4)

    def p99(r: simulating.Result) -> float:
        return round(r.pending_percentile(99), 3)

    return Document(
        mode=mode.value,
        rule=RULES[mode],
        upper_bound=None if bound is None else round(bound, 4),
        request_kinds=list(results[0].request_kinds) if results else [],
        best_serving_every_request=_leader(
            [r for r in results if r.serves_every_request], ratio, most=True
        ),
        best_of_all=_leader(results, ratio, most=True),
        most_pods_scheduled=_leader(results, lambda r: r.pods_scheduled, most=True),
        lowest_pending_p99_s=_leader(results, p99, most=False),
        rule_met=rule_met(results, mode=mode, bound=bound),
        results=[row(r, timing=timing, bound=bound) for r in results],
    )


def _seconds(value: float) -> str:
    # Whole seconds once the decimal says nothing, so faithful runs fit in 100 columns.
    return f"{value:.1f}" if value < 1000 else f"{value:.0f}"


def table(rows: Sequence[ResultRow]) -> list[list[object]]:
    """Table cells in the order of :data:`HEADERS` (never scheduled = total - scheduled)."""
    return [
        [
            r["policy"] + ("" if r["serves_every_request"] else MARK),
            f"{r['pods_scheduled']}/{r['pods_total']}",
            r["pods_total"] - r["pods_scheduled"],
            f"{100 * r['allocation_ratio']:.1f}",
            _seconds(r["pending_p50_s"]),
            _seconds(r["pending_p95_s"]),
            _seconds(r["pending_p99_s"]),
            r["reconfigurations"],
            r["instances_destroyed"],
            None if r["planner_seconds"] is None else f"{r['planner_seconds']:.2f}",
        ]
        for r in rows
    ]


def _names(leader: Leader, rows: Sequence[ResultRow]) -> str:
    marked = {r["policy"] for r in rows if not r["serves_every_request"]}
    return ", ".join(p + (MARK if p in marked else "") for p in leader["policies"])


def summary(doc: Document, *, width: int = 100) -> list[str]:
    """The lines printed under the table: the kinds of request each marked policy never ran a
    pod of, the bound, the rule, the leaders and whether migpilot met the rule (``width``
    columns at most, the rule wrapped)."""
    rows = doc["results"]
    lines: list[str] = []
    marked = [r for r in rows if not r["serves_every_request"]]
    if marked:
        lines.append(
            f"{MARK} never ran a pod asking for (a kind of request the cluster can serve):"
        )
        lines += [f"  {r['policy']}: {', '.join(r['requests_never_served'])}" for r in marked]
    dynamic = [r for r in rows if r["mode_switches"] or r["whole_gpu_pods"]]
    if dynamic:
        lines.append(
            "dynamic MIG mode: "
            + "; ".join(
                f"{r['policy']} {r['mode_switches']} MIG mode switches, "
                f"{r['whole_gpu_pods']} whole-GPU pods placed"
                for r in dynamic
            )
        )
    bound = doc["upper_bound"]
    if bound is not None:
        lines.append(
            "upper bound on the allocation ratio (LP relaxation of the packing): "
            f"{100 * bound:.1f}%"
        )
    lines += textwrap.wrap(f"rule: {doc['rule']}.", width=width, subsequent_indent="  ")
    by = {r["policy"]: r for r in rows}

    def ratio(leader: Leader | None) -> str:
        if leader is None:
            return "none"
        of = by[leader["policies"][0]]["share_of_bound"]
        text = f"{_names(leader, rows)} {100 * leader['figure']:.1f}%"
        return text if of is None else f"{text} ({100 * of:.1f}% of the bound)"

    if doc["mode"] == simulating.Replay.INFLATE.value:
        lines.append(
            f"  best serving every kind of request: {ratio(doc['best_serving_every_request'])}"
        )
        lines.append(f"  best of all: {ratio(doc['best_of_all'])}")
    most, fastest = doc["most_pods_scheduled"], doc["lowest_pending_p99_s"]
    if most is not None and fastest is not None:
        lines.append(
            f"  most pods scheduled: {_names(most, rows)} ({most['figure']:.0f}); "
            f"lowest p99 pending time: {_names(fastest, rows)} ({fastest['figure']:.1f} s)"
        )
    if doc["rule_met"] is not None:
        lines.append(f"  migpilot met the rule on this run: {'yes' if doc['rule_met'] else 'no'}")
    return lines
