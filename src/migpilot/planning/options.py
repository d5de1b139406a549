"""Settings every planner takes (one frozen value, so planners share a signature)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Options:
    """How to plan."""

    explain: bool = False
    """Give every unschedulable pod a reason per node, not only a summary. Default off."""
    time_limit_s: float = 10.0
    """Exact planner only: the solver's wall-clock limit in seconds. Default 10."""
    workers: int = 1
    """Exact planner only: solver threads. Default 1: CP-SAT is deterministic only with one
    (more threads can find the same optimum faster but return a different plan)."""
