"""The reconciler's decisions: from the instances a node's GPUs have to the changes that give
them the instances they should have, as a pure function.

Why it exists apart from :mod:`migpilot.agent.reconciling` (the shell that applies the changes
one backend call at a time): given the actual MIG devices per GPU, the desired layout per GPU
and the set of in-use device UUIDs, :func:`diff` returns the minimal ordered changes (destroy
only the instances that are not in the desired layout and not in use, repair a GPU instance left
without its compute instance, create the missing instances at their exact placements) and a
refusal with a reason for everything it cannot do: an in-use instance in the way, a MIG mode
that needs a GPU reset (never forced), a desired layout that is not valid.

The names are the agent's own (:class:`Change`, :class:`ChangeKind`): the planner's plans have
actions of their own (:mod:`migpilot.planning.plans`).

Pure: no backend call, no clock, no thread.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from migpilot import errors
from migpilot.gpu import backend
from migpilot.mig import layouts

_EMPTY = layouts.Layout(())


class ChangeKind(enum.StrEnum):
    """What a change to a GPU does."""

    DESTROY = "destroy"
    REPAIR = "repair"
    """Create the missing compute instance of an existing GPU instance."""
    CREATE = "create"
    SET_MIG_MODE = "set-mig-mode"
    """Switch the GPU's MIG mode (dynamic nodes only; the GPU has nothing on it by then)."""


@dataclass(frozen=True, slots=True)
class DesiredGpu:
    """What one GPU should look like."""

    mig_enabled: bool
    layout: layouts.Layout = _EMPTY
    """The instances at their placements (empty when MIG is disabled)."""


@dataclass(frozen=True, slots=True)
class GpuState:
    """One GPU as read from the backend."""

    info: backend.GpuInfo
    devices: tuple[backend.MigDevice, ...]


@dataclass(frozen=True, slots=True)
class Change:
    """One change to make to a GPU: one backend call."""

    kind: ChangeKind
    gpu: int
    instance: layouts.Instance | None
    """The instance changed; ``None`` for a MIG mode change."""
    gi_id: int | None = None
    """The GPU instance destroyed or repaired; ``None`` for a create."""
    uuid: str | None = None
    """The MIG device destroyed, when it has one; for a MIG mode change, the GPU's UUID (asked
    again right before the change)."""
    mig: bool | None = None
    """The MIG mode a :attr:`ChangeKind.SET_MIG_MODE` sets."""

    def __str__(self) -> str:
        if self.kind is ChangeKind.SET_MIG_MODE:
            return f"GPU {self.gpu}: MIG mode {_on(bool(self.mig))}"
        dev = f" ({self.uuid})" if self.uuid else ""
        return f"GPU {self.gpu}: {self.kind.value} {self.instance}{dev}"


@dataclass(frozen=True, slots=True)
class Refusal:
    """Something the desired layout asks for that is not done, and why."""

    gpu: int
    reason: str
    instance: layouts.Instance | None = None
    in_use: bool = False
    """Held back only by an instance in use: it gets done once that instance is free."""

    def __str__(self) -> str:
        return f"GPU {self.gpu}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Diff:
    """The changes to make, in order, and what will not be done."""

    changes: tuple[Change, ...]
    refusals: tuple[Refusal, ...]


def _on(flag: bool) -> str:
    return "enabled" if flag else "disabled"


def diff(
    *,
    actual: Mapping[int, GpuState],
    desired: Mapping[int, DesiredGpu],
    in_use: frozenset[str],
    dynamic_mig: bool = False,
) -> Diff:
    """The minimal ordered changes that turn ``actual`` into ``desired`` without touching in-use.

    GPUs absent from ``desired`` are left alone. Per GPU, in index order: destroys (by start),
    then repairs, then creates (by start); every intermediate layout is valid because the final
    one is and the layout rules only ever forbid adding.

    A GPU whose MIG mode is not the desired one is refused, unless ``dynamic_mig`` (a node
    labelled ``migpilot.io/mig-mode=dynamic``): then its idle instances are destroyed and its
    mode set, but only when no instance of it and not the GPU itself is in use; the instances
    of the new mode come at the next diff, once the mode is current.
    """
    changes: list[Change] = []
    refusals: list[Refusal] = []
    for gpu in sorted(desired):
        state = actual.get(gpu)
        if dynamic_mig and state is not None and _mode_differs(state, desired[gpu]):
            made, refused = _switch_mode(gpu, state, desired[gpu], in_use)
        else:
            made, refused = _diff_gpu(gpu, state, desired[gpu], in_use)
        changes.extend(made)
        refusals.extend(refused)
    return Diff(tuple(changes), tuple(refusals))


def _mode_differs(state: GpuState, want: DesiredGpu) -> bool:
    mig = state.info.mig
    if mig is None or state.info.model is None:
        return False
    return mig.current != want.mig_enabled or mig.pending != want.mig_enabled


def _switch_mode(
    gpu: int, state: GpuState, want: DesiredGpu, in_use: frozenset[str]
) -> tuple[list[Change], list[Refusal]]:
    """Destroy every instance, then set the mode: all or nothing, never with anything in use."""
    mode = _on(want.mig_enabled)
    busy = [d for d in state.devices if d.uuid is not None and d.uuid in in_use]
    if busy:
        return [], [
            Refusal(gpu, f"{d} ({d.uuid}) is in use; MIG mode not {mode}", d.instance, in_use=True)
            for d in busy
        ]
    if gpu_held(state.info.uuid, in_use):
        return [], [Refusal(gpu, f"the whole GPU is in use; MIG mode not {mode}", in_use=True)]
    destroys = [
        Change(ChangeKind.DESTROY, gpu, d.instance, gi_id=d.gi_id, uuid=d.uuid)
        for d in sorted(state.devices, key=lambda d: (d.start, d.gi_id))
    ]
    switch = Change(ChangeKind.SET_MIG_MODE, gpu, None, uuid=state.info.uuid, mig=want.mig_enabled)
    return [*destroys, switch], []


def gpu_held(uuid: str, in_use: frozenset[str]) -> bool:
    """Whether a pod holds the whole GPU ``uuid``, or a share of it: a time-slicing replica
    (``GPU-x::2``) or an MPS slice (``GPU-x::mps-3``) names its GPU before ``::``."""
    return any(u == uuid or u.startswith(f"{uuid}::") for u in in_use)


def _diff_gpu(
    gpu: int, state: GpuState | None, want: DesiredGpu, in_use: frozenset[str]
) -> tuple[list[Change], list[Refusal]]:
    if state is None:
        return [], [Refusal(gpu, "no such GPU on this node")]
    info = state.info
    if info.model is None or info.mig is None:
        if not want.mig_enabled:
            return [], []
        return [], [Refusal(gpu, f"{info.product_name} is not a MIG-capable GPU migpilot knows")]
    model = info.model
    refusals: list[Refusal] = []
    if info.mig.current != want.mig_enabled:
        return [], [
            Refusal(
                gpu,
                f"MIG mode is {_on(info.mig.current)}, the desired layout needs it "
                f"{_on(want.mig_enabled)}: needs a GPU reset (not forced)",
            )
        ]
    if info.mig.reset_pending:
        refusals.append(
            Refusal(gpu, f"MIG mode {_on(info.mig.pending)} is pending: needs a GPU reset")
        )
    if not want.mig_enabled:
        return [], refusals
    try:
        reason = layouts.violation(model, want.layout.instances)
    except errors.UnknownProfileError as e:
        reason = str(e)
    if reason is not None:
        return [], [*refusals, Refusal(gpu, f"desired layout {want.layout} is invalid: {reason}")]

    wanted = set(want.layout.instances)
    matched: set[layouts.Instance] = set()
    destroys: list[Change] = []
    repairs: list[Change] = []
    staying: list[layouts.Instance] = []
    blocking: list[backend.MigDevice] = []
    for dev in sorted(state.devices, key=lambda d: (d.start, d.gi_id)):
        inst = dev.instance
        if inst in wanted and inst not in matched:
            matched.add(inst)
            staying.append(inst)
            if not dev.complete:
                repairs.append(Change(ChangeKind.REPAIR, gpu, inst, gi_id=dev.gi_id))
        elif dev.uuid is not None and dev.uuid in in_use:
            staying.append(inst)
            blocking.append(dev)
        else:
            destroys.append(Change(ChangeKind.DESTROY, gpu, inst, gi_id=dev.gi_id, uuid=dev.uuid))

    creates: list[Change] = []
    in_the_way: set[str] = set()  # UUIDs of the in-use devices named in a refusal
    geo = layouts.geometry(model)
    for inst in sorted(wanted - matched):
        reason = layouts.violation(model, [*staying, inst])
        if reason is None:
            staying.append(inst)
            creates.append(Change(ChangeKind.CREATE, gpu, inst))
            continue
        mask = geo.placement(inst).mask
        overlapping = [d for d in blocking if geo.placement(d.instance).mask & mask]
        if overlapping:
            in_the_way.update(str(d.uuid) for d in overlapping)
            names = ", ".join(f"{d} ({d.uuid})" for d in overlapping)
            verb = "is" if len(overlapping) == 1 else "are"
            refusals.append(
                Refusal(
                    gpu, f"{names} {verb} in use; desired {inst} not created", inst, in_use=True
                )
            )
        else:
            refusals.append(Refusal(gpu, f"desired {inst} not created: {reason}", inst))
    for dev in blocking:
        if str(dev.uuid) not in in_the_way:
            refusals.append(
                Refusal(
                    gpu,
                    f"{dev} ({dev.uuid}) is in use and not in the desired layout; kept",
                    dev.instance,
                    in_use=True,
                )
            )
    return [*destroys, *repairs, *creates], refusals


# --- what became of them ----------------------------------------------------------------------


class Outcome(enum.StrEnum):
    """What became of a change."""

    DONE = "done"
    REFUSED = "refused"
    """Not attempted or rejected because the device is in use."""
    FAILED = "failed"
    """The backend failed for another reason."""


@dataclass(frozen=True, slots=True)
class Applied:
    """A change and what became of it."""

    change: Change
    outcome: Outcome
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Report:
    """The result of one reconciliation."""

    devices: Mapping[int, tuple[backend.MigDevice, ...]] = field(hash=False)
    """The actual MIG devices per GPU afterwards (MIG-enabled GPUs only)."""
    applied: tuple[Applied, ...]
    refusals: tuple[Refusal, ...]
    """What the desired layout asks for that is not done (the last diff's refusals)."""
    converged: bool
    """True when nothing is left to do but what is refused."""
    duration_s: float

    def layout(self, gpu: int) -> layouts.Layout:
        """The actual layout of ``gpu`` afterwards."""
        return layouts.Layout.of(d.instance for d in self.devices.get(gpu, ()))

    def outcomes(self, outcome: Outcome) -> tuple[Applied, ...]:
        """The applied changes with this outcome."""
        return tuple(a for a in self.applied if a.outcome is outcome)
