"""PLACEHOLDER being written now; replaced before landing."""

from __future__ import annotations

from migpilot.planning import options, plans, snapshot


def nos(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    raise NotImplementedError


def hami_template(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    raise NotImplementedError


def hami_placement(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    raise NotImplementedError


def static(snap: snapshot.Snapshot, opts: options.Options) -> plans.Plan:
    raise NotImplementedError
