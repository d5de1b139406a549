"""A GpuLayout as the planner sees it: its GPUs, instances and MPS slices as snapshot values.

Why it exists: the GpuLayout's types (:mod:`migpilot.api.gpulayouts`) sit below the planner and
know nothing of it; only the controller plans from GpuLayouts, so the translation into the
planner's types is the controller's. It is the one place that decides which instances and
slices the planner must treat as used: when the agent's report and the controller's spec
disagree, the safer one wins. The other direction, plan to spec, is
:func:`migpilot.controller.pinning.spec_for`.

Pure: no client, no clock. May import :mod:`migpilot.api`, :mod:`migpilot.planning`,
:mod:`migpilot.mig` and :mod:`migpilot.errors`.
"""

from __future__ import annotations

from migpilot.api import gpulayouts
from migpilot.mig import catalog
from migpilot.planning import modes, snapshot


def snapshot_gpus(layout: gpulayouts.GpuLayout) -> tuple[snapshot.Gpu, ...]:
    """The node's GPUs as the planner sees them, from what the agent reports.

    An instance is ``used`` (never destroyed, never handed to another pod) when its state is in
    :data:`gpulayouts.UNTOUCHABLE`, or when the spec reserves it for a pod even though the
    status says free (the two may disagree for a moment: the safer one wins). Destroying
    instances are left out: no pod may be given one, and their slots will be free once the
    agent is done. A GpuLayout the agent has not reported on yet has no GPUs.
    """
    if layout.status is None:
        return ()
    reserved = {
        (g.index, i.start, i.profile)
        for g in layout.spec.gpus
        for i in g.instances
        if i.reserved_for is not None
    }
    gpus: list[snapshot.Gpu] = []
    for g in layout.status.gpus:
        instances = tuple(
            snapshot.ExistingInstance(
                i.profile,
                i.start,
                i.state in gpulayouts.UNTOUCHABLE or (g.index, i.start, i.profile) in reserved,
            )
            for i in g.instances
            if i.state is not gpulayouts.InstanceState.DESTROYING
        )
        model = catalog.resolve_gpu(g.model)
        gpus.append(snapshot.Gpu(g.index, model, instances, mps=snapshot_slices(layout, g)))
    return tuple(gpus)


def snapshot_slices(
    layout: gpulayouts.GpuLayout, gpu: gpulayouts.GpuStatus
) -> tuple[modes.MpsSlice, ...]:
    """A GPU's MPS slices as the planner sees them: those the spec asks for (reserved as the
    spec reserves them; used when the status says so), and those the status still reports used
    that the spec dropped (a pod holds them: never reused, never overlapped).

    A slice the status reports used under an id the spec lists with another size or share
    counts with the size the status reports: the agent never resizes a held slice (it keeps
    its size until its pod is gone), so the spec's size would hide memory a pod holds, and the
    planner would give it away (the soak's 90 GB of slices on an 80 GB GPU)."""
    wanted = next((g.mps for g in layout.spec.gpus if g.index == gpu.index), ())
    reported = {sl.id: sl for sl in gpu.mps}
    out: list[modes.MpsSlice] = []
    for sl in wanted:
        seen = reported.pop(sl.id, None)
        used = seen is not None and seen.state is gpulayouts.InstanceState.USED
        gb, cores = (seen.memory_gb, seen.cores) if used and seen else (sl.memory_gb, sl.cores)
        out.append(modes.MpsSlice(sl.id, gb, cores, used, sl.reserved_for or ""))
    for left in reported.values():
        if left.state is not gpulayouts.InstanceState.FREE:
            out.append(modes.MpsSlice(left.id, left.memory_gb, left.cores, True))
    return tuple(sorted(out, key=lambda sl: sl.id))
