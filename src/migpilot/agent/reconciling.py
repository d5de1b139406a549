"""Reconciling MIG layouts: from the instances a node has to the instances it should have.

The shell of the reconciler; its decisions are pure and live apart
(:mod:`migpilot.agent.rules.changes`). :class:`Reconciler` reads the state from a
:class:`~migpilot.gpu.backend.GpuBackend`, asks :func:`~migpilot.agent.rules.changes.diff`,
applies each GPU's changes one backend call at a time (different GPUs in parallel threads, so a
burst of new instances spread over a node's GPUs does not wait for each other), and re-reads. It
keeps no state of its own, so the backend is the only truth: if the process dies between any
two backend calls, a new reconciler on the same GPUs finishes the job with nothing leaked and
nothing lost. In-use is asked again right before each destroy, because a device can be handed to
a pod while a reconfiguration runs.

"In use" is an :class:`InUse` source, the union (:class:`AnyOf`) of kubelet's PodResources
allocations, the devices this agent's Allocate handed out, the planner's reservations
(:class:`InUseSet` holds those in memory) and the devices with running processes
(:class:`RunningProcesses`).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from migpilot.agent import metrics
from migpilot.agent.rules import changes
from migpilot.gpu import backend, clocks

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


# --- the shell ---------------------------------------------------------------------------------


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
        dynamic_mig: bool | Callable[[], bool] = False,
        withdraw: Callable[[frozenset[int]], None] | None = None,
        withhold: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        self._backend = gpus
        self._in_use = in_use
        self._clock: clocks.Clock = clock if clock is not None else clocks.SystemClock()
        self._metrics = agent_metrics
        self._max_rounds = max_rounds
        self._dynamic_mig: Callable[[], bool] = (
            _constant(dynamic_mig) if isinstance(dynamic_mig, bool) else dynamic_mig
        )
        """Whether the node is labelled ``migpilot.io/mig-mode=dynamic`` now (MIG modes may be
        switched); asked once per :meth:`reconcile`, as the label may change."""
        self._withdraw = withdraw
        """Told the GPUs whose MIG mode is about to be switched, before anything on them is
        touched: they are no longer advertised, so no pod is given them meanwhile."""
        self._withhold = withhold
        """Told each MIG device about to be destroyed, before its last in-use check: from then
        on it is handed to no new pod (it stays advertised until the pass ends), so a pod
        either got it before the check (the destroy is refused) or never gets it."""
        self._parallel_gpus = max(1, parallel_gpus)
        """GPUs changed at once: each GPU's changes run in order in one thread, GPUs side by
        side (the driver serialises changes on one GPU, not across GPUs)."""

    def read(self) -> dict[int, changes.GpuState]:
        """The actual state of every GPU, from the backend."""
        out: dict[int, changes.GpuState] = {}
        for info in self._backend.gpus():
            enabled = info.mig is not None and info.mig.current and info.model is not None
            devices = self._backend.mig_devices(info.index) if enabled else ()
            out[info.index] = changes.GpuState(info, devices)
        return out

    def reconcile(self, desired: Mapping[int, changes.DesiredGpu]) -> changes.Report:
        """Apply the diff, re-reading and re-planning after any surprise, a few rounds at most."""
        started = self._clock.monotonic()
        applied: list[changes.Applied] = []
        dynamic = self._dynamic_mig()
        for _ in range(self._max_rounds):
            plan = changes.diff(
                actual=self.read(),
                desired=desired,
                in_use=self._in_use.in_use(),
                dynamic_mig=dynamic,
            )
            if not plan.changes:
                break
            switched = frozenset(
                c.gpu for c in plan.changes if c.kind is changes.ChangeKind.SET_MIG_MODE
            )
            if switched and self._withdraw is not None:
                self._withdraw(switched)
            applied.extend(self._apply_all(plan.changes))
        actual = self.read()
        plan = changes.diff(
            actual=actual,
            desired=desired,
            in_use=self._in_use.in_use(),
            dynamic_mig=dynamic,
        )
        duration = self._clock.monotonic() - started
        if self._metrics is not None and applied:
            self._metrics.observe_reconfiguration(duration)
        return changes.Report(
            devices={g: s.devices for g, s in actual.items() if s.devices or _mig_on(s)},
            applied=tuple(applied),
            refusals=plan.refusals,
            converged=not plan.changes,
            duration_s=duration,
        )

    def _apply_all(self, planned: Sequence[changes.Change]) -> list[changes.Applied]:
        """Each GPU's changes in order, GPUs in parallel; the results by GPU, then order."""
        by_gpu: dict[int, list[changes.Change]] = {}
        for change in planned:
            by_gpu.setdefault(change.gpu, []).append(change)
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

    def _apply_gpu(self, planned: Sequence[changes.Change]) -> list[changes.Applied]:
        """One GPU's changes in order, stopping at the first not done: the world is not as
        read, so the next round reads it again and re-plans."""
        out: list[changes.Applied] = []
        for change in planned:
            result = self._apply(change)
            out.append(result)
            if result.outcome is not changes.Outcome.DONE:
                break
        return out

    def _apply(self, change: changes.Change) -> changes.Applied:
        result = self._call(change)
        if self._metrics is not None:
            self._metrics.count_action(op=change.kind.value, outcome=result.outcome.value)
        return result

    def _call(self, change: changes.Change) -> changes.Applied:
        try:
            if change.kind is changes.ChangeKind.DESTROY:
                assert change.gi_id is not None
                if change.uuid is not None and self._withhold is not None:
                    self._withhold(frozenset({change.uuid}))
                if change.uuid is not None and change.uuid in self._in_use.in_use():
                    return changes.Applied(
                        change, changes.Outcome.REFUSED, "became in use; not destroyed"
                    )
                self._backend.destroy_instance(change.gpu, change.gi_id)
            elif change.kind is changes.ChangeKind.REPAIR:
                assert change.gi_id is not None
                self._backend.create_compute_instance(change.gpu, change.gi_id)
            elif change.kind is changes.ChangeKind.SET_MIG_MODE:
                assert change.mig is not None
                if change.uuid is not None and changes.gpu_held(change.uuid, self._in_use.in_use()):
                    return changes.Applied(
                        change, changes.Outcome.REFUSED, "became in use; MIG mode not changed"
                    )
                after = self._backend.set_mig_mode(change.gpu, enabled=change.mig)
                if after.current != change.mig:
                    return changes.Applied(
                        change, changes.Outcome.REFUSED, "pending: waits for a GPU reset"
                    )
            else:
                assert change.instance is not None
                self._backend.create_instance(
                    change.gpu, profile=change.instance.profile, start=change.instance.start
                )
        except backend.BackendError as e:
            outcome = (
                changes.Outcome.REFUSED
                if e.kind is backend.ErrorKind.IN_USE
                else changes.Outcome.FAILED
            )
            return changes.Applied(change, outcome, str(e))
        return changes.Applied(change, changes.Outcome.DONE)


def _constant(value: bool) -> Callable[[], bool]:
    return lambda: value


def _mig_on(state: changes.GpuState) -> bool:
    return state.info.mig is not None and state.info.mig.current
