"""PLACEHOLDER being written now; replaced before landing."""

from __future__ import annotations

from migpilot.planning import options, plans, snapshot


def plan(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    raise NotImplementedError
