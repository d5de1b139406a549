"""Reconciling MIG layouts: from the instances a node has to the instances it should have.

Two parts, kept apart on purpose. :func:`diff` is pure: given the actual MIG devices per GPU, the
desired layout per GPU and the set of in-use device UUIDs, it returns the minimal ordered
actions (destroy only the instances that are not in the desired layout and not in use, repair a
GPU instance left without its compute instance, create the missing instances at their exact
placements) and a refusal with a reason for everything it cannot do: an in-use instance in the
way, a MIG mode that needs a GPU reset (never forced), a desired layout that is not valid.

:class:`Reconciler` is the shell: it reads the state from a
:class:`~migpilot.gpu.backend.GpuBackend`, asks :func:`diff`, applies each GPU's actions one
backend call at a time (different GPUs in parallel threads, so a burst of new instances spread
over a node's GPUs does not wait for each other), and re-reads. It keeps no state of its own,
so the backend is the only truth: if the process dies between any two backend calls, a new
reconciler on the same GPUs finishes the job with nothing leaked and nothing lost. In-use is
asked again right before each destroy, because a device can be handed to a pod while a
reconfiguration runs.

"In use" is an :class:`InUse` source, the union (:class:`AnyOf`) of kubelet's PodResources
allocations, the devices this agent's Allocate handed out, the planner's reservations
(:class:`InUseSet` holds those in memory) and the devices with running processes
(:class:`RunningProcesses`).
"""

from __future__ import annotations

import concurrent.futures
import enum
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from migpilot import errors
from migpilot.agent import metrics
from migpilot.gpu import backend, clocks
from migpilot.mig import layouts

# --- in use ------------------------------------------------------------------------------------


class InUse(Protocol):
    """A source of MIG device UUIDs that must not be destroyed."""

    def in_use(self) -> frozenset[str]:
        """The UUIDs in use now."""
        ...


class InUseSet:
    """An in-memory, thread-safe set of in-use UUIDs (Allocate hand-outs, reservations)."""

    def __init__(self, uuids: Iterable[str] = ()) -> None:
        self._uuids = set(uuids)
        self._lock = threading.Lock()

    def add(self, *uuids: str) -> None:
        """Mark devices in use."""
        with self._lock:
            self._uuids.update(uuids)

    def discard(self, *uuids: str) -> None:
        """Release devices (unknown ones are ignored)."""
        with self._lock:
            self._uuids.difference_update(uuids)

    def replace(self, uuids: Iterable[str]) -> None:
        """Make the set exactly ``uuids``."""
        with self._lock:
            self._uuids = set(uuids)

    def in_use(self) -> frozenset[str]:
        """The UUIDs in the set now."""
        with self._lock:
            return frozenset(self._uuids)


class AnyOf:
    """A device is in use when any source says so."""

    def __init__(self, sources: Sequence[InUse]) -> None:
        self._sources = tuple(sources)

    def in_use(self) -> frozenset[str]:
        """The union of every source's UUIDs."""
        return frozenset().union(*(s.in_use() for s in self._sources))


class RunningProcesses:
    """MIG devices on which the backend sees compute processes."""

    def __init__(self, gpus: backend.GpuBackend) -> None:
        self._backend = gpus

    def in_use(self) -> frozenset[str]:
        """UUIDs of the devices with at least one running process."""
        out: set[str] = set()
        for info in self._backend.gpus():
            if info.mig is None or not info.mig.current:
                continue
            for dev in self._backend.mig_devices(info.index):
                if dev.uuid is None:
                    continue
                try:
                    if self._backend.running_processes(info.index, dev.uuid):
                        out.add(dev.uuid)
                except backend.BackendError as e:
                    if e.kind is not backend.ErrorKind.NOT_FOUND:
                        raise  # gone meanwhile is fine; anything else must not pass as "free"
        return frozenset(out)


# --- the pure diff -----------------------------------------------------------------------------


_EMPTY = layouts.Layout(())


class Op(enum.StrEnum):
    """What an action does."""

    DESTROY = "destroy"
    REPAIR = "repair"
    """Create the missing compute instance of an existing GPU instance."""
    CREATE = "create"


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
class Action:
    """One backend call to make."""

    op: Op
    gpu: int
    instance: layouts.Instance
    gi_id: int | None = None
    """The GPU instance destroyed or repaired; ``None`` for a create."""
    uuid: str | None = None
    """The MIG device destroyed, when it has one."""

    def __str__(self) -> str:
        dev = f" ({self.uuid})" if self.uuid else ""
        return f"GPU {self.gpu}: {self.op.value} {self.instance}{dev}"


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
    """The actions to take, in order, and what will not be done."""

    actions: tuple[Action, ...]
    refusals: tuple[Refusal, ...]


def _on(flag: bool) -> str:
    return "enabled" if flag else "disabled"


def diff(
    *,
    actual: Mapping[int, GpuState],
    desired: Mapping[int, DesiredGpu],
    in_use: frozenset[str],
) -> Diff:
    """The minimal ordered actions that turn ``actual`` into ``desired`` without touching in-use.

    GPUs absent from ``desired`` are left alone. Per GPU, in index order: destroys (by start),
    then repairs, then creates (by start); every intermediate layout is valid because the final
    one is and the layout rules only ever forbid adding.
    """
    actions: list[Action] = []
    refusals: list[Refusal] = []
    for gpu in sorted(desired):
        acts, refs = _diff_gpu(gpu, actual.get(gpu), desired[gpu], in_use)
        actions.extend(acts)
        refusals.extend(refs)
    return Diff(tuple(actions), tuple(refusals))


def _diff_gpu(
    gpu: int, state: GpuState | None, want: DesiredGpu, in_use: frozenset[str]
) -> tuple[list[Action], list[Refusal]]:
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
    destroys: list[Action] = []
    repairs: list[Action] = []
    staying: list[layouts.Instance] = []
    blocking: list[backend.MigDevice] = []
    for dev in sorted(state.devices, key=lambda d: (d.start, d.gi_id)):
        inst = dev.instance
        if inst in wanted and inst not in matched:
            matched.add(inst)
            staying.append(inst)
            if not dev.complete:
                repairs.append(Action(Op.REPAIR, gpu, inst, gi_id=dev.gi_id))
        elif dev.uuid is not None and dev.uuid in in_use:
            staying.append(inst)
            blocking.append(dev)
        else:
            destroys.append(Action(Op.DESTROY, gpu, inst, gi_id=dev.gi_id, uuid=dev.uuid))

    creates: list[Action] = []
    in_the_way: set[str] = set()  # UUIDs of the in-use devices named in a refusal
    geo = layouts.geometry(model)
    for inst in sorted(wanted - matched):
        reason = layouts.violation(model, [*staying, inst])
        if reason is None:
            staying.append(inst)
            creates.append(Action(Op.CREATE, gpu, inst))
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


# --- the shell ---------------------------------------------------------------------------------


class Outcome(enum.StrEnum):
    """What became of an action."""

    DONE = "done"
    REFUSED = "refused"
    """Not attempted or rejected because the device is in use."""
    FAILED = "failed"
    """The backend failed for another reason."""


@dataclass(frozen=True, slots=True)
class Applied:
    """An action and what became of it."""

    action: Action
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
        """The applied actions with this outcome."""
        return tuple(a for a in self.applied if a.outcome is outcome)


class Reconciler:
    """Drives a backend towards desired layouts; stateless between calls (crash-safe)."""

    def __init__(
        self,
        gpus: backend.GpuBackend,
        in_use: InUse,
        *,
        clock: clocks.Clock | None = None,
        agent_metrics: metrics.AgentMetrics | None = None,
        max_rounds: int = 3,
        parallel_gpus: int = 8,
    ) -> None:
        self._backend = gpus
        self._in_use = in_use
        self._clock: clocks.Clock = clock if clock is not None else clocks.SystemClock()
        self._metrics = agent_metrics
        self._max_rounds = max_rounds
        self._parallel_gpus = max(1, parallel_gpus)
        """GPUs changed at once: each GPU's actions run in order in one thread, GPUs side by
        side (the driver serialises changes on one GPU, not across GPUs)."""

    def read(self) -> dict[int, GpuState]:
        """The actual state of every GPU, from the backend."""
        out: dict[int, GpuState] = {}
        for info in self._backend.gpus():
            enabled = info.mig is not None and info.mig.current and info.model is not None
            devices = self._backend.mig_devices(info.index) if enabled else ()
            out[info.index] = GpuState(info, devices)
        return out

    def reconcile(self, desired: Mapping[int, DesiredGpu]) -> Report:
        """Apply the diff, re-reading and re-planning after any surprise, a few rounds at most."""
        started = self._clock.monotonic()
        applied: list[Applied] = []
        for _ in range(self._max_rounds):
            plan = diff(actual=self.read(), desired=desired, in_use=self._in_use.in_use())
            if not plan.actions:
                break
            applied.extend(self._apply_all(plan.actions))
        actual = self.read()
        plan = diff(actual=actual, desired=desired, in_use=self._in_use.in_use())
        duration = self._clock.monotonic() - started
        if self._metrics is not None and applied:
            self._metrics.observe_reconfiguration(duration)
        return Report(
            devices={g: s.devices for g, s in actual.items() if s.devices or _mig_on(s)},
            applied=tuple(applied),
            refusals=plan.refusals,
            converged=not plan.actions,
            duration_s=duration,
        )

    def _apply_all(self, actions: Sequence[Action]) -> list[Applied]:
        """Each GPU's actions in order, GPUs in parallel; the results by GPU, then order."""
        by_gpu: dict[int, list[Action]] = {}
        for action in actions:
            by_gpu.setdefault(action.gpu, []).append(action)
        runs = [by_gpu[g] for g in sorted(by_gpu)]
        if len(runs) == 1 or self._parallel_gpus == 1:
            results = [self._apply_gpu(run) for run in runs]
        else:
            workers = min(len(runs), self._parallel_gpus)
            with concurrent.futures.ThreadPoolExecutor(
                workers, thread_name_prefix="migpilot-gpu"
            ) as pool:
                results = list(pool.map(self._apply_gpu, runs))
        return [applied for run in results for applied in run]

    def _apply_gpu(self, actions: Sequence[Action]) -> list[Applied]:
        """One GPU's actions in order, stopping at the first not done: the world is not as
        read, so the next round reads it again and re-plans."""
        out: list[Applied] = []
        for action in actions:
            result = self._apply(action)
            out.append(result)
            if result.outcome is not Outcome.DONE:
                break
        return out

    def _apply(self, action: Action) -> Applied:
        result = self._call(action)
        if self._metrics is not None:
            self._metrics.count_action(op=action.op.value, outcome=result.outcome.value)
        return result

    def _call(self, action: Action) -> Applied:
        try:
            if action.op is Op.DESTROY:
                assert action.gi_id is not None
                if action.uuid is not None and action.uuid in self._in_use.in_use():
                    return Applied(action, Outcome.REFUSED, "became in use; not destroyed")
                self._backend.destroy_instance(action.gpu, action.gi_id)
            elif action.op is Op.REPAIR:
                assert action.gi_id is not None
                self._backend.create_compute_instance(action.gpu, action.gi_id)
            else:
                self._backend.create_instance(
                    action.gpu, profile=action.instance.profile, start=action.instance.start
                )
        except backend.BackendError as e:
            outcome = Outcome.REFUSED if e.kind is backend.ErrorKind.IN_USE else Outcome.FAILED
            return Applied(action, outcome, str(e))
        return Applied(action, Outcome.DONE)


def _mig_on(state: GpuState) -> bool:
    return state.info.mig is not None and state.info.mig.current
