"""The control loop's rules, as one pure step shared by the simulator and the controller.

Why it exists: the simulator's figures are only the controller's figures if both run the same
loop. The loop is small, and this module is all of it:

- **Batching.** Something changes (a pod arrives, an instance appears, a pod leaves):
  :func:`changed`. If pods wait and no plan is due, one becomes due ``batch_window_s`` later, so
  pods arriving together are planned together (the whole pending set is the planner's strength).
- **Deciding.** When a plan is due, :func:`decide` plans the snapshot if pods wait and anything
  changed since the last plan, else does nothing. It never plans twice for the same state.
- **Reservations and actions in flight are in the snapshot.** A pod the last plan placed is not
  in the snapshot's pending pods again; the instances reserved for it, and the instances still
  being created for it, are in the snapshot as *used*: the planner can neither destroy them nor
  give them away. Each caller builds its snapshot so (the simulator from its model, the
  controller from the GpuLayouts' spec and status and the pods bound to each node).
- **Never runnable.** :func:`never_runs` says why a pod could not run even with every GPU of the
  cluster empty, so callers reject it with a reason instead of waiting forever.

Pure core: no clock (``now`` is an argument), no I/O. May import :mod:`migpilot.mig`, this
package and :mod:`migpilot.errors`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from migpilot import errors
from migpilot.mig import layouts, profiles
from migpilot.planning import constraints, explaining, modes, plans, snapshot

Planner = Callable[[snapshot.Snapshot], plans.Plan]
"""A planner with its options bound (``functools.partial(fast.plan, opts=...)`` and the like)."""


@dataclass(frozen=True, slots=True)
class Settings:
    """The loop's timing."""

    batch_window_s: float = 0.25
    """Seconds from the first change with pods waiting to the plan that serves them. Default
    0.25 in the controller; the simulator passes its own (1 s by default)."""

    def __post_init__(self) -> None:
        if not self.batch_window_s >= 0:
            raise errors.MigpilotError(
                f"the batch window must be 0 seconds or more, got {self.batch_window_s}"
            )


@dataclass(frozen=True, slots=True)
class Batch:
    """Where the loop stands between plans."""

    due: float | None = None
    """When the next plan runs; ``None``: none is due."""
    dirty: bool = False
    """Something changed since the last plan."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What one step decided."""

    batch: Batch
    """The loop's state after the step."""
    plan: plans.Plan | None
    """The plan to carry out, or ``None`` when there was nothing to plan."""


def changed(batch: Batch, *, now: float, waiting: bool, settings: Settings) -> Batch:
    """Something changed at ``now``: mark it, and if pods wait and no plan is due, make one due
    a batch window from now (the caller wakes at :attr:`Batch.due`)."""
    due = batch.due
    if waiting and due is None:
        due = now + settings.batch_window_s
    return Batch(due=due, dirty=True)


def is_due(batch: Batch, *, now: float) -> bool:
    """Whether a plan is due at ``now``."""
    return batch.due is not None and now >= batch.due


def decide(snap: snapshot.Snapshot, batch: Batch, *, now: float, planner: Planner) -> Decision:
    """The step at a due time: plan ``snap`` when pods wait and something changed since the last
    plan; either way no plan is due any more until the next :func:`changed`.

    ``snap`` holds the pods still waiting (none already placed) and every reserved or
    in-flight instance as used. A step before the due time changes nothing.
    """
    if not is_due(batch, now=now):
        return Decision(batch, None)
    if not snap.pods or not batch.dirty:
        return Decision(Batch(due=None, dirty=batch.dirty), None)
    return Decision(Batch(due=None, dirty=False), planner(snap))


# --------------------------------------------------------------------------- never runnable


@functools.lru_cache(maxsize=4096)
def fits_empty(profile_names: tuple[str, ...], model: profiles.GpuModel, gpus: int) -> bool:
    """Whether instances of these profiles fit on ``gpus`` empty GPUs of ``model``.

    First-fit decreasing, each GPU packed exactly: a yes is certain, a no may (rarely) miss a
    packing only an exhaustive search would find; callers use it to reject pods that can never
    run, where a false no would strand a pod, so it is only used for a single GPU's worth of
    instances or a whole node as kube-scheduler would see it.
    """
    bins: list[list[str]] = []
    for name in sorted(profile_names, key=lambda n: -model.profile_named(n).memory_slots):
        for b in bins:
            try:
                layouts.place(model, [*b, name])
            except errors.LayoutError:
                continue
            b.append(name)
            break
        else:
            if len(bins) == gpus:
                return False
            bins.append([name])
    return True


def never_runs(pod: snapshot.Pod, nodes: Sequence[snapshot.Node]) -> str | None:
    """Why ``pod`` could not run on any of ``nodes`` even with every GPU empty, or ``None``.

    ``nodes`` are given as they would be empty: their allocatable the node's whole CPU and
    memory, not what is left.
    In order: no node admits it (cordons, selectors, affinity, taints), no GPU advertises the
    resources it names, no node's GPUs could hold its instances, no node has the CPU or memory.
    """
    admitted = [n for n in nodes if constraints.rejection(n, pod) is None]
    if not admitted:
        if not nodes:
            return "the cluster has no node with MIG GPUs that migpilot manages"
        reasons = sorted({r for n in nodes if (r := constraints.rejection(n, pod)) is not None})
        return f"no GPU node admits it ({'; '.join(reasons[:3])})"
    plain = explaining.unresolvable(snapshot.Snapshot(nodes=tuple(admitted), pods=(pod,)))
    if pod.key in plain:
        return plain[pod.key]
    room = False
    for node in admitted:
        by_model: dict[profiles.GpuModel, int] = {}
        for gpu in node.gpus:
            by_model[gpu.model] = by_model.get(gpu.model, 0) + 1
        fits = False
        if not pod.served_in(node.mode):
            continue
        for model, count in by_model.items():
            if node.mode is not modes.Mode.MIG:
                # MPS slices or time-slicing replicas: one per GPU asked, each within a GPU.
                shared = (
                    modes.mps_needs(pod.mps, pod.unified, model)
                    if node.mode is modes.Mode.MPS
                    else modes.replica_needs(pod.unified, model)
                )
                asks = pod.unified.asks if pod.unified is not None else ()
                fits = shared is not None and all(a.count <= count for a in asks)
            else:
                names = pod.profiles_on(model)
                fits = names is not None and fits_empty(names, model, count)
            if fits:
                break
        if not fits:
            continue
        room = True
        alloc = node.allocatable
        if alloc is None or (
            pod.cpu_milli <= alloc.cpu_milli and pod.memory_bytes <= alloc.memory_bytes
        ):
            return None
    if not room:
        return "no node's GPUs could hold its instances even empty"
    return "no node that could hold its instances has the CPU and memory it asks for"
