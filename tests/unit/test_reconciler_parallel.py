"""Different GPUs change in parallel, one GPU's changes never overlap.

A burst of new instances spread over a node's GPUs used to wait for each other: every backend
call ran one after another. These tests prove the overlap structurally (a barrier every GPU's
thread must reach together; without parallel GPUs it times out) rather than by timing.
"""

from __future__ import annotations

import threading

import pytest

from migpilot.agent import reconciling
from migpilot.agent.rules import changes
from migpilot.gpu import emulated
from migpilot.mig import catalog, layouts

H100 = catalog.resolve_gpu("h100-80gb")
STEP = emulated.OperationTimes(0.01, 0.01, 0.01, 0.01)


class BarrierClock:
    """Every sleep waits until ``parties`` threads sleep together: sleeps that cannot overlap
    break the barrier (``threading.BrokenBarrierError``) instead of passing."""

    def __init__(self, parties: int) -> None:
        self._barrier = threading.Barrier(parties, timeout=10)
        self.sleeps = 0
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps += 1
        self._barrier.wait()


class CountingClock:
    """Records how many sleeps overlap at most (each sleep really waits a little)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._active = 0
        self.most = 0

    def monotonic(self) -> float:
        return 0.0

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self._active += 1
            self.most = max(self.most, self._active)
        threading.Event().wait(0.005)
        with self._lock:
            self._active -= 1


def _want(*instances: str) -> changes.DesiredGpu:
    return changes.DesiredGpu(
        True,
        layouts.Layout.of(
            layouts.Instance(int(i.split("@")[1]), i.split("@")[0]) for i in instances
        ),
    )


def test_creates_on_different_gpus_run_side_by_side() -> None:
    clock = BarrierClock(parties=4)
    gpus = emulated.EmulatedBackend([H100] * 4, clock=clock, times=STEP)
    rec = reconciling.Reconciler(gpus, reconciling.InUseSet(), clock=clock)
    want = {g: _want("1g.10gb@0", "1g.10gb@1") for g in range(4)}
    report = rec.reconcile(want)
    assert report.converged
    assert len(report.outcomes(changes.Outcome.DONE)) == 8
    assert clock.sleeps == 16  # a GPU instance and its compute instance, twice, on 4 GPUs
    # The report lists GPUs in order, each GPU's actions in the order made.
    assert [a.change.gpu for a in report.applied] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_one_gpu_at_a_time_breaks_the_barrier() -> None:
    """The barrier test above can fail: with one GPU at a time, the sleeps never meet."""
    clock = BarrierClock(parties=2)
    clock._barrier = threading.Barrier(2, timeout=0.2)
    gpus = emulated.EmulatedBackend([H100] * 2, clock=clock, times=STEP)
    rec = reconciling.Reconciler(gpus, reconciling.InUseSet(), clock=clock, parallel_gpus=1)
    with pytest.raises(threading.BrokenBarrierError):
        rec.reconcile({g: _want("1g.10gb@0") for g in range(2)})


def test_steps_on_one_gpu_never_overlap() -> None:
    clock = CountingClock()
    gpus = emulated.EmulatedBackend([H100], clock=clock, times=STEP)

    def make(starts: tuple[int, ...]) -> None:
        for s in starts:
            gpus.create_instance(0, profile="1g.10gb", start=s)

    threads = [threading.Thread(target=make, args=(s,)) for s in ((0, 1, 2), (3, 4, 5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert clock.most == 1
    assert sorted(d.start for d in gpus.mig_devices(0)) == [0, 1, 2, 3, 4, 5]


def test_a_failure_on_one_gpu_leaves_the_others_done() -> None:
    gpus = emulated.EmulatedBackend([H100] * 3, times=emulated.INSTANT)
    gpus.inject(
        emulated.Fault(emulated.Step.CREATE_GPU_INSTANCE, nth=1, effect=emulated.FaultEffect.FAIL)
    )
    rec = reconciling.Reconciler(gpus, reconciling.InUseSet(), max_rounds=1)
    report = rec.reconcile({g: _want("3g.40gb@0", "3g.40gb@4") for g in range(3)})
    failed = report.outcomes(changes.Outcome.FAILED)
    assert len(failed) == 1
    # The failed GPU stopped at its failure; the other two finished both instances.
    assert len(report.outcomes(changes.Outcome.DONE)) == 4
    assert not report.converged
    again = reconciling.Reconciler(gpus, reconciling.InUseSet()).reconcile(
        {g: _want("3g.40gb@0", "3g.40gb@4") for g in range(3)}
    )
    assert again.converged


def test_a_process_started_during_a_destroy_keeps_the_instance() -> None:
    """The driver refuses a destroy whose device gained a process while the step ran."""
    gpus = emulated.EmulatedBackend([H100], times=emulated.INSTANT)
    dev = gpus.create_instance(0, profile="1g.10gb", start=0)
    assert dev.uuid is not None

    class AttachingClock:
        def monotonic(self) -> float:
            return 0.0

        def sleep(self, seconds: float) -> None:
            gpus.attach_process(dev.uuid or "", 4242)

    gpus._clock = AttachingClock()
    gpus._times = STEP
    with pytest.raises(Exception, match="has processes"):
        gpus.destroy_compute_instance(0, dev.gi_id)
    assert [d.uuid for d in gpus.mig_devices(0)] == [dev.uuid]
