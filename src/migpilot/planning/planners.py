"""The planners by name: what ``migpilot plan --planner``, the simulator and the benchmark call.

``fast`` is migpilot's own planner; ``exact`` solves the same objective with CP-SAT; ``nos``,
``hami-template``, ``hami-placement`` and ``static`` re-implement the systems migpilot is measured
against (see ``shared/design/ANCHORS.md``), and ``first-fit`` is the plainest dynamic planner (the
floor ``fast`` never goes below), inside the same framework so all run on the same snapshot and
are checked by the same validator.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from migpilot import errors
from migpilot.planning import (
    baselines,
    exact,
    fast,
    firstfit,
    nosmps,
    options,
    plans,
    sharing,
    snapshot,
)

Planner = Callable[[snapshot.Snapshot, options.Options], plans.Plan]


def _sharing(planner: Planner, name: str, shared: sharing.SharedPlanner = sharing.place) -> Planner:
    """``planner`` on the MIG nodes, MPS and time-slicing nodes planned beside it by
    ``shared`` (:mod:`migpilot.planning.sharing`); unchanged on a MIG-only snapshot."""
    return functools.partial(
        sharing.plan_with, mig_planner=planner, shared_planner=shared, name=name
    )


PLANNERS: dict[str, Planner] = {
    "fast": fast.plan,  # plans MPS and time-slicing nodes itself
    "exact": exact.plan,  # CP-SAT on MIG, MPS and time-slicing nodes (two models, split as above)
    # nos's MIG partitioner on MIG nodes, its MPS partitioner on MPS and time-slicing nodes
    "nos": _sharing(baselines.nos, "nos", nosmps.place),
    "hami-template": _sharing(baselines.hami_template, "hami-template"),
    "hami-placement": _sharing(baselines.hami_placement, "hami-placement"),
    "static": _sharing(baselines.static, "static"),
    "first-fit": _sharing(firstfit.plan, "first-fit"),
}


def run(
    snap: snapshot.Snapshot, name: str = "fast", opts: options.Options | None = None
) -> plans.Plan:
    """Plan ``snap`` with the named planner."""
    planner = PLANNERS.get(name)
    if planner is None:
        raise errors.MigpilotError(f"unknown planner {name!r} (known: {', '.join(PLANNERS)})")
    return planner(snap, opts or options.Options())
