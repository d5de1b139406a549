"""Instances created and destroyed, per profile, as the agents report them.

Why it exists: an admin asks how many instances of each profile the cluster made and removed.
The plans cannot say: a spec written may be rewritten before the agent acts, superseded by the
next plan, or fail on the node. What exists is what the agent reports in its GpuLayout's
``status``, so the controller compares each status it sees with the one it saw before on that
node (:func:`diff`) and counts the difference.

An instance is one thing that exists on a GPU, known by its identity:

- a MIG instance by its GPU (index and UUID), start, profile and MIG UUID. One still being
  created has no UUID and does not exist yet; one being destroyed still does (it goes back to
  free if the destroy fails), so it counts as destroyed only once it is no longer listed. A
  destroy and a re-create at the same place give a new UUID: both count;
- an MPS slice by its GPU, id, memory and compute share (the planner never resizes a slice in
  place; a slice with the same id but another size is another slice). Its profile label is
  ``mps-<N>gb`` (:func:`slice_profile`), as in the agent's series.

Pure: no client, no clock. Imports :mod:`migpilot.api` only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from migpilot.api import gpulayouts
from migpilot.planning import usage

slice_profile = usage.slice_profile
"""The ``profile`` label of an MPS slice (``mps-20gb``): one definition, in the planning core."""


@dataclass(frozen=True, slots=True)
class Existing:
    """One MIG instance or MPS slice as a report lists it: equal only to itself."""

    gpu: int
    gpu_uuid: str
    profile: str
    """A MIG profile (``1g.10gb``) or :func:`slice_profile` of a slice."""
    place: int
    """A MIG instance's start, a slice's id."""
    uuid: str | None = None
    """A MIG instance's UUID (``None`` for a slice)."""
    cores: int | None = None
    """A slice's compute share in percent (``None``: unlimited, or a MIG instance)."""


def existing(status: gpulayouts.LayoutStatus) -> frozenset[Existing]:
    """The instances and slices ``status`` reports as existing."""
    out: set[Existing] = set()
    for g in status.gpus:
        for i in g.instances:
            if i.uuid is not None and i.state is not gpulayouts.InstanceState.CREATING:
                out.add(Existing(g.index, g.uuid, i.profile, i.start, i.uuid))
        for s in g.mps:
            out.add(Existing(g.index, g.uuid, slice_profile(s.memory_gb), s.id, cores=s.cores))
    return frozenset(out)


def _by_profile(things: Iterable[Existing]) -> Mapping[str, int]:
    return MappingProxyType(dict(sorted(Counter(t.profile for t in things).items())))


@dataclass(frozen=True, slots=True)
class Turnover:
    """What changed between two reports of one node, per profile label."""

    created: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Instances and slices listed now and not before."""
    destroyed: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    """Instances and slices listed before and not now."""

    def __bool__(self) -> bool:
        return bool(self.created or self.destroyed)


def diff(before: gpulayouts.LayoutStatus, after: gpulayouts.LayoutStatus) -> Turnover:
    """The instances and slices ``after`` lists that ``before`` did not (created), and the
    reverse (destroyed), counted by profile label."""
    old, new = existing(before), existing(after)
    return Turnover(created=_by_profile(new - old), destroyed=_by_profile(old - new))
