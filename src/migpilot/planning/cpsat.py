"""The pieces the two CP-SAT models share: linear expressions that can be read back on a
solution, the time limit split across lexicographic phases, and one phase's solve
(:func:`maximise`, with the solver's fixed seed).

Why it exists: the exact planner is two models (:mod:`migpilot.planning.exact` for MIG nodes,
:mod:`migpilot.planning.exactsharing` for MPS and time-slicing nodes), solved the same way:
phase after phase, each within a share of one time limit, with one seed so that a run is
repeatable. One copy of those rules, not two.

Pure: OR-Tools and :mod:`migpilot.errors` only; no clock (elapsed time is the solver's own
wall time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from migpilot import errors

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


def maximise(
    model: cp_model.CpModel,
    objective: Linear,
    *,
    hint: list[int],
    seconds: float,
    workers: int,
    budget: Budget,
    who: str,
    strong_relaxation: bool = False,
) -> tuple[cp_model.CpSolverStatus, list[int]]:
    """Maximise ``objective`` on ``model`` from ``hint`` (a feasible solution) within
    ``seconds``; the status and the best solution known, the solver's wall time added to
    ``budget``. A solution no better than the hint is not taken: the hint may be better on what
    later phases optimise, and it is what a rerun would keep. ``strong_relaxation``: CP-SAT's
    linearization level 2 without probing (the MIG model proves far more phases so). Raises
    :class:`~migpilot.errors.MigpilotError` naming ``who`` if CP-SAT finds the model infeasible
    or invalid: the hint is always feasible, so that is a bug in the model, never bad input."""
    model.maximize(objective.expr())
    proto = model.proto
    proto.clear_solution_hint()
    proto.solution_hint.vars.extend(range(len(hint)))
    proto.solution_hint.values.extend(hint)
    solver = cp_model.CpSolver()
    params = solver.parameters
    params.max_time_in_seconds = seconds
    params.num_workers = max(1, workers)
    params.random_seed = SEED
    if strong_relaxation:
        params.linearization_level = 2
        params.cp_model_probing_level = 0
    status = solver.solve(model)
    budget.elapsed += solver.wall_time
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        found = list(solver.response_proto.solution)
        return status, found if objective.value(found) > objective.value(hint) else hint
    if status in (cp_model.INFEASIBLE, cp_model.MODEL_INVALID):
        raise errors.MigpilotError(
            f"{who}: CP-SAT says {solver.status_name(status)} {model.validate()}".rstrip()
        )
    return status, hint
