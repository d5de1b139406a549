"""The pieces the two CP-SAT models share: linear expressions that can be read back on a
solution, the time limit split across lexicographic phases, and the solver's fixed seed.

Why it exists: the exact planner is two models (:mod:`migpilot.planning.exact` for MIG nodes,
:mod:`migpilot.planning.exactsharing` for MPS and time-slicing nodes), solved the same way:
phase after phase, each within a share of one time limit, with one seed so that a run is
repeatable. One copy of those rules, not two.

Pure: OR-Tools only; no clock (elapsed time is the solver's own wall time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

SEED = 1
"""CP-SAT's random seed: with one worker, the same model gives the same solution."""
MIN_SHARE = 0.01
"""No phase gets less than this fraction of the limit."""


@dataclass(slots=True)
class Linear:
    """A linear expression kept as terms, so it can also be evaluated on a solution vector."""

    terms: list[tuple[int, cp_model.IntVar]] = field(default_factory=list)

    def expr(self) -> cp_model.LinearExpr:
        return cp_model.LinearExpr.weighted_sum(
            [v for _, v in self.terms], [c for c, _ in self.terms]
        )

    def value(self, solution: Sequence[int]) -> int:
        return sum(c * solution[v.index] for c, v in self.terms)


class Budget:
    """The time limit split across phases; elapsed time is the sum of the solver's wall times."""

    def __init__(self, limit_s: float) -> None:
        self.limit = max(limit_s, 0.0)
        self.elapsed = 0.0

    def share(self, *, until: float, parts: int = 1) -> float:
        """An equal part of the time left before ``until`` (a fraction of the limit), floored."""
        left = self.limit * until - self.elapsed
        return max(left / max(parts, 1), self.limit * MIN_SHARE, 0.001)
