"""An upper bound on the allocation ratio any policy can reach in inflate mode.

In inflate mode pods never leave, so the best any policy could do is to choose, among the pods
submitted, the set that packs the most compute slices into the cluster. That packing problem is
relaxed into a linear program (solved with GLOP, OR-Tools' LP solver):

- ``y[m, L] >= 0``: how many GPUs of model ``m`` use maximal layout ``L`` (every maximal layout
  of the profiles the pods ask for, from :func:`layouts.enumerate_layouts`), with
  ``sum_L y[m, L] <= GPUs of m``;
- ``x[c, m] >= 0``: how many pods of class ``c`` (same request, CPU and memory) run on
  model ``m``, with ``sum_m x[c, m] <= pods of c`` (a unified request as it resolves on ``m``,
  counting the compute slices it asked for, as the simulator does);
- per model and profile, instances used ``<=`` instances the layouts offer;
- per model, CPU and memory used ``<=`` the sum over its nodes (node boundaries are relaxed);
- maximise the compute slices of the pods run, over the cluster's slices.

Every real schedule is a feasible point (count GPUs per layout, completed to a maximal one, and
pods per class), so the optimum bounds every policy from above; it is loose only where the
relaxation forgets something (pods split across nodes or GPUs fractionally, CPU and memory pooled
per model, arrival order, reconfiguration). It ignores time entirely, so it says nothing about
faithful mode.

Pure core: may import :mod:`migpilot.mig`, :mod:`migpilot.planning` and :mod:`migpilot.sim`; the
LP solver is a library, not an outside system.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import ortools.linear_solver.pywraplp as pywraplp  # noqa: PLR0402 - mypy needs the full path

from migpilot import errors
from migpilot.mig import layouts, profiles
from migpilot.planning import snapshot
from migpilot.sim import clusters, traces


@dataclass(frozen=True, slots=True)
class Bound:
    """The LP bound and what it is made of."""

    allocation_ratio: float
    """Upper bound on compute slices held over the cluster's (0-1)."""
    layouts: int
    """Layout variables in the LP."""
    classes: int
    """Pod classes in the LP."""


def inflate_bound(pods: Sequence[traces.TracePod], *, cluster: clusters.Cluster) -> Bound:
    """The LP upper bound on the inflate-mode allocation ratio of ``pods`` on ``cluster``."""
    solver = pywraplp.Solver.CreateSolver("GLOP")
    if solver is None:  # pragma: no cover - GLOP ships with every OR-Tools wheel
        raise errors.MigpilotError("the GLOP LP solver is not available")
    classes: Counter[tuple[snapshot.Demand, int, int]] = Counter(
        (p.demand, p.cpu_milli, p.memory_bytes) for p in pods
    )
    class_list = sorted(
        classes,
        key=lambda c: (
            tuple((r.profile, r.count) for r in c[0][0]),
            "" if c[0][1] is None else c[0][1].text(),
            c[1:],
        ),
    )
    per_model: dict[str, tuple[profiles.GpuModel, int, int, int]] = {}
    for node in cluster.nodes:
        model, gpus, cpu, mem = per_model.get(node.model.id, (node.model, 0, 0, 0))
        per_model[node.model.id] = (
            model,
            gpus + node.gpus,
            cpu + node.allocatable.cpu_milli,
            mem + node.allocatable.memory_bytes,
        )
    objective = solver.Objective()
    objective.SetMaximization()
    by_class: dict[int, list[pywraplp.Variable]] = {}
    n_layouts = 0
    for mid, (model, gpus, cpu, mem) in per_model.items():
        wanted: dict[int, Counter[str]] = {}
        for ci, (demand, _, _) in enumerate(class_list):
            names = snapshot.resolve_demand(demand, model)
            if names is not None:
                wanted[ci] = Counter(names)
        if not wanted:
            continue
        profs = sorted({p for need in wanted.values() for p in need})
        lays = layouts.enumerate_layouts(model, allowed=profs)
        n_layouts += len(lays)
        y = [solver.NumVar(0.0, gpus, f"y[{mid},{i}]") for i in range(len(lays))]
        gpu_row = solver.Constraint(0.0, gpus)
        for var in y:
            gpu_row.SetCoefficient(var, 1.0)
        cpu_row = solver.Constraint(0.0, cpu)
        mem_row = solver.Constraint(0.0, mem)
        rows = {p: solver.Constraint(0.0, solver.infinity()) for p in profs}
        for var, lay in zip(y, lays, strict=True):
            for p, k in lay.profile_counts().items():
                if p in rows:
                    rows[p].SetCoefficient(var, float(k))
        for ci, need in wanted.items():
            _, c_cpu, c_mem = class_list[ci]
            x = solver.NumVar(0.0, classes[class_list[ci]], f"x[{ci},{mid}]")
            by_class.setdefault(ci, []).append(x)
            for p, k in need.items():
                rows[p].SetCoefficient(x, -float(k))
            cpu_row.SetCoefficient(x, float(c_cpu))
            mem_row.SetCoefficient(x, float(c_mem))
            slices = sum(model.profile_named(p).compute_slices * k for p, k in need.items())
            objective.SetCoefficient(x, slices / cluster.compute_slices)
    for ci, xs in by_class.items():
        row = solver.Constraint(0.0, classes[class_list[ci]])
        for x in xs:
            row.SetCoefficient(x, 1.0)
    status = solver.Solve()
    if status != pywraplp.Solver.OPTIMAL:  # pragma: no cover - the LP is bounded and feasible
        raise errors.MigpilotError(f"the bound's LP did not solve (status {status})")
    value = min(max(objective.Value(), 0.0), 1.0)
    return Bound(allocation_ratio=value, layouts=n_layouts, classes=len(class_list))
