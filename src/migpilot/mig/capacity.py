"""What a node of empty MIG GPUs can offer, profile by profile: the capacity a node autoscaler
is told a new node brings.

Why it exists: Karpenter decides whether a new node would hold a pending pod from the instance
type's resources, and a pod asking ``nvidia.com/mig-1g.10gb`` fits only a type that lists that
resource. A new node has no MIG instances yet (migpilot creates them when it plans pods onto
it), so the honest figure for each profile is how many instances of it the node's GPUs could
hold if that profile were all they held: :func:`profile_capacity`. Each count is an upper bound
taken alone (eight H100s hold 56 ``1g.10gb`` or 8 ``7g.80gb``, not both), which is what an
autoscaler's per-resource arithmetic can express (``docs/autoscaling.md``).

The counts come from the layout model (:func:`layouts.pack`: placements, memory slots, compute
slices, the per-profile and per-GPU instance limits), not from the catalog's ``max_instances``
column, so they are what the planner itself could place; a test checks that the two agree for
every shipped model. Pure: a model and a count in, a mapping out.
"""

from __future__ import annotations

import functools

from migpilot import errors
from migpilot.mig import layouts, profiles


def most_on_one_gpu(model: profiles.GpuModel, profile: str) -> int:
    """How many instances of ``profile`` (canonical name) one empty GPU of ``model`` holds."""
    model.profile_named(profile)  # an unknown name is an UnknownProfileError
    return _most(model, profile)


@functools.cache
def _most(model: profiles.GpuModel, profile: str) -> int:
    count = 0
    # Every instance takes at least one memory slot: the GPU's slots bound the search.
    while count < model.memory_slots and (
        layouts.pack(model, (profile,) * (count + 1), frozenset()) is not None
    ):
        count += 1
    return count


def profile_capacity(model: profiles.GpuModel, gpus: int) -> dict[str, int]:
    """Profile name -> how many instances of it ``gpus`` empty GPUs of ``model`` hold, each
    profile taken alone (GPUs are independent, so it is ``gpus`` times one GPU's), in the
    catalog's profile order. ``gpus`` must be at least 1."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise errors.MigpilotError(f"a node's GPU count must be a whole number >= 1, got {gpus!r}")
    return {p.name: gpus * _most(model, p.name) for p in model.profiles}
