"""The reconciler's destroy path, rule by rule, with every refusal compared whole.

These tests pin what the mutation run (bench/mutation.py) found unguarded: the re-check of "in
use" right before each destroy (a device handed to a pod after the diff was read must survive),
the in-use sources' edge cases, and the exact refusals and actions of the diff."""

from __future__ import annotations

import pytest

from migpilot.agent import reconciling
from migpilot.agent.rules import changes
from migpilot.gpu import backend, clocks, emulated
from migpilot.mig import catalog, layouts

H100 = catalog.resolve_gpu("h100-80gb")
ChangeKind = changes.ChangeKind
Refusal = changes.Refusal
Outcome = changes.Outcome


class RacingBackend(emulated.EmulatedBackend):
    """An emulated node on which a pod starts on a device while the reconciler works.

    ``start_on`` names a device; the first time anyone asks for its processes (the diff's
    in-use read, which finds it free), a process attaches to it, as a pod whose container
    starts right then. Every ``destroy_instance`` call is recorded before it runs."""

    def __init__(self, *, clock: clocks.Clock | None = None) -> None:
        super().__init__([H100, H100], clock=clock)
        self.start_on: str | None = None
        self.destroy_calls: list[tuple[int, int]] = []
        self.failing: dict[str, backend.ErrorKind] = {}
        self.without_mig: tuple[backend.GpuInfo, ...] = ()

    def running_processes(self, gpu: int, uuid: str) -> tuple[int, ...]:
        if uuid in self.failing:
            raise backend.BackendError(self.failing[uuid], f"cannot read {uuid}")
        pids = super().running_processes(gpu, uuid)
        if uuid == self.start_on:
            self.start_on = None
            self.attach_process(uuid, 4242)
        return pids

    def destroy_instance(self, gpu: int, gi_id: int) -> None:
        self.destroy_calls.append((gpu, gi_id))
        super().destroy_instance(gpu, gi_id)

    def gpus(self) -> tuple[backend.GpuInfo, ...]:
        return (*self.without_mig, *super().gpus())


def _want(*texts: str) -> changes.DesiredGpu:
    return changes.DesiredGpu(
        True,
        layouts.Layout.of(layouts.Instance(int(t.split("@")[1]), t.split("@")[0]) for t in texts),
    )


def test_a_device_taken_after_the_diff_is_not_destroyed() -> None:
    emu = RacingBackend()
    victim = emu.create_instance(0, profile="3g.40gb", start=4)
    assert victim.uuid is not None
    emu.start_on = victim.uuid
    rec = reconciling.Reconciler(emu, reconciling.RunningProcesses(emu), max_rounds=1)
    report = rec.reconcile({0: _want("7g.80gb@0")})
    # The diff read it free and planned its destroy; the re-check found the new process, so
    # destroy_instance was never called (the driver would refuse too, but a real one may not
    # see a process that has not yet opened the device: migpilot must not rely on it).
    assert emu.destroy_calls == []
    destroy = changes.Change(
        ChangeKind.DESTROY, 0, victim.instance, gi_id=victim.gi_id, uuid=victim.uuid
    )
    assert report.applied == (
        changes.Applied(destroy, Outcome.REFUSED, "became in use; not destroyed"),
    )
    assert [d.uuid for d in report.devices[0]] == [victim.uuid]
    # Nothing left to do but what the in-use device holds back.
    assert report.converged and [r.in_use for r in report.refusals] == [True]


def test_a_free_device_is_destroyed_once_and_the_layout_converges() -> None:
    emu = RacingBackend()
    free = emu.create_instance(0, profile="3g.40gb", start=4)
    rec = reconciling.Reconciler(emu, reconciling.RunningProcesses(emu))
    report = rec.reconcile({0: _want("7g.80gb@0")})
    assert emu.destroy_calls == [(0, free.gi_id)]
    assert report.converged and report.layout(0) == layouts.Layout.of(
        [layouts.Instance(0, "7g.80gb")]
    )


def test_the_drivers_in_use_refusal_is_reported_as_refused_with_its_words() -> None:
    emu = RacingBackend()
    dev = emu.create_instance(0, profile="3g.40gb", start=4)
    assert dev.uuid is not None
    emu.attach_process(dev.uuid, 7)
    # Nothing tells the reconciler the device is used: only the driver knows.
    rec = reconciling.Reconciler(emu, reconciling.InUseSet(), max_rounds=1)
    report = rec.reconcile({0: _want("7g.80gb@0")})
    destroy = changes.Change(ChangeKind.DESTROY, 0, dev.instance, gi_id=dev.gi_id, uuid=dev.uuid)
    assert report.applied == (
        changes.Applied(destroy, Outcome.REFUSED, "3g.40gb@4 on GPU 0 has processes (7) (in use)"),
    )
    assert [d.uuid for d in report.devices[0]] == [dev.uuid]


def test_another_backend_failure_is_failed_not_refused() -> None:
    emu = RacingBackend()
    emu.inject(emulated.Fault(emulated.Step.CREATE_GPU_INSTANCE, 1, emulated.FaultEffect.FAIL))
    rec = reconciling.Reconciler(emu, reconciling.InUseSet(), max_rounds=1)
    report = rec.reconcile({0: _want("7g.80gb@0")})
    create = changes.Change(ChangeKind.CREATE, 0, layouts.Instance(0, "7g.80gb"))
    assert report.applied == (
        changes.Applied(
            create, Outcome.FAILED, "injected failure of create-gpu-instance (unknown)"
        ),
    )


def test_the_report_times_the_whole_pass_on_the_reconcilers_clock() -> None:
    clock = clocks.VirtualClock(start=1000.0)
    emu = RacingBackend(clock=clock)
    emu_times = emulated.OperationTimes()
    slow = emulated.EmulatedBackend([H100], clock=clock, times=emu_times)
    rec = reconciling.Reconciler(slow, reconciling.InUseSet(), clock=clock)
    report = rec.reconcile({0: _want("7g.80gb@0")})
    taken = emu_times.create_gpu_instance_s + emu_times.create_compute_instance_s
    assert report.duration_s == pytest.approx(taken)
    # A GPU with MIG on and no instance is still reported, as an empty GPU.
    idle = reconciling.Reconciler(emu, reconciling.InUseSet(), clock=clock).reconcile({})
    assert idle.devices == {0: (), 1: ()}
    assert idle.duration_s == 0.0


# --- in-use sources ----------------------------------------------------------------------------


def test_running_processes_skip_gpus_without_mig_and_devices_without_a_uuid() -> None:
    emu = RacingBackend()
    t4 = backend.GpuInfo(9, "GPU-9", "Tesla T4", None, 15360, None)
    emu.without_mig = (t4,)
    emu.set_mig_mode(0, enabled=False)
    emu.reset_gpu(0)
    bare = emu.create_gpu_instance(1, profile="1g.10gb", start=0)  # no compute instance yet
    used = emu.create_instance(1, profile="1g.10gb", start=1)
    assert bare is not None and used.uuid is not None
    emu.attach_process(used.uuid, 11)
    assert reconciling.RunningProcesses(emu).in_use() == {used.uuid}


def test_a_device_gone_meanwhile_is_free_but_an_unreadable_one_stops_the_pass() -> None:
    emu = RacingBackend()
    gone = emu.create_instance(0, profile="1g.10gb", start=0)
    used = emu.create_instance(0, profile="1g.10gb", start=1)
    assert gone.uuid is not None and used.uuid is not None
    emu.attach_process(used.uuid, 12)
    emu.failing[gone.uuid] = backend.ErrorKind.NOT_FOUND
    source = reconciling.RunningProcesses(emu)
    assert source.in_use() == {used.uuid}
    emu.failing[gone.uuid] = backend.ErrorKind.UNKNOWN
    with pytest.raises(backend.BackendError, match="cannot read"):
        source.in_use()


# --- the diff's refusals and actions, compared whole -------------------------------------------


def _info(index: int, *, model: object = H100, mig: tuple[bool, bool] = (True, True)) -> object:
    return backend.GpuInfo(
        index,
        f"GPU-{index}",
        "NVIDIA H100 80GB HBM3",
        model,
        81152,
        backend.MigMode(*mig),  # type: ignore[arg-type]
    )


def _dev(text: str, gi: int, *, gpu: int = 2, complete: bool = True) -> backend.MigDevice:
    profile, start = text.split("@")
    uuid = f"MIG-{gpu}-{gi}" if complete else None
    return backend.MigDevice(gpu, gi, 0 if complete else None, profile, int(start), uuid)


def _diff(
    devices: list[backend.MigDevice],
    want: changes.DesiredGpu,
    *,
    in_use: frozenset[str] = frozenset(),
    model: object = H100,
    mig: tuple[bool, bool] = (True, True),
) -> changes.Diff:
    state = changes.GpuState(_info(2, model=model, mig=mig), tuple(devices))  # type: ignore[arg-type]
    return changes.diff(actual={2: state}, desired={2: want}, in_use=in_use)


def _inst(text: str) -> layouts.Instance:
    return layouts.Instance(int(text.split("@")[1]), text.split("@", maxsplit=1)[0])


def test_a_gpu_the_node_lacks_is_refused() -> None:
    d = changes.diff(actual={}, desired={2: _want("7g.80gb@0")}, in_use=frozenset())
    assert d == changes.Diff((), (Refusal(2, "no such GPU on this node"),))


def test_a_mig_gpu_of_an_unknown_model_is_refused_not_planned() -> None:
    d = _diff([], _want("7g.80gb@0"), model=None)
    assert d == changes.Diff(
        (), (Refusal(2, "NVIDIA H100 80GB HBM3 is not a MIG-capable GPU migpilot knows"),)
    )


def test_a_mode_mismatch_is_refused_on_its_gpu() -> None:
    d = _diff([], _want("7g.80gb@0"), mig=(False, False))
    reason = (
        "MIG mode is disabled, the desired layout needs it enabled: needs a GPU reset (not forced)"
    )
    assert d == changes.Diff((), (Refusal(2, reason),))


def test_a_pending_enable_is_reported_with_the_mode_it_waits_for() -> None:
    d = _diff([], changes.DesiredGpu(False), mig=(False, True))
    assert d == changes.Diff((), (Refusal(2, "MIG mode enabled is pending: needs a GPU reset"),))


def test_an_invalid_layout_is_refused_on_its_gpu() -> None:
    want = _want("4g.40gb@0", "4g.40gb@4")
    d = _diff([_dev("1g.10gb@0", 1)], want)
    reason = (
        "desired layout 4g.40gb@0 4g.40gb@4 is invalid: 4g.40gb cannot start at memory slot 4 "
        "on h100-80gb (allowed starts: 0)"
    )
    assert d == changes.Diff((), (Refusal(2, reason),))


def test_a_repair_names_its_instance() -> None:
    d = _diff([_dev("3g.40gb@0", 5, complete=False)], _want("3g.40gb@0"))
    assert d == changes.Diff(
        (changes.Change(ChangeKind.REPAIR, 2, _inst("3g.40gb@0"), gi_id=5),), ()
    )


def test_only_the_in_use_devices_that_overlap_are_named_and_the_others_kept() -> None:
    # 1g@0 and 1g@6 are in use and not desired; the desired 3g@4 overlaps only 1g@6.
    devs = [_dev("1g.10gb@0", 1), _dev("1g.10gb@6", 2)]
    d = _diff(devs, _want("3g.40gb@4"), in_use=frozenset({"MIG-2-1", "MIG-2-2"}))
    assert d == changes.Diff(
        (),
        (
            Refusal(
                2,
                "1g.10gb@6 (MIG-2-2) is in use; desired 3g.40gb@4 not created",
                _inst("3g.40gb@4"),
                in_use=True,
            ),
            Refusal(
                2,
                "1g.10gb@0 (MIG-2-1) is in use and not in the desired layout; kept",
                _inst("1g.10gb@0"),
                in_use=True,
            ),
        ),
    )


def test_two_in_use_devices_in_the_way_are_named_together() -> None:
    devs = [_dev("1g.10gb@4", 1), _dev("1g.10gb@5", 2)]
    d = _diff(devs, _want("2g.20gb@4"), in_use=frozenset({"MIG-2-1", "MIG-2-2"}))
    assert d == changes.Diff(
        (),
        (
            Refusal(
                2,
                "1g.10gb@4 (MIG-2-1), 1g.10gb@5 (MIG-2-2) are in use; desired 2g.20gb@4 not "
                "created",
                _inst("2g.20gb@4"),
                in_use=True,
            ),
        ),
    )


def test_an_in_use_device_that_does_not_overlap_yet_forbids_is_not_blamed_as_in_the_way() -> None:
    # At most one +me instance per GPU: the in-use 1g+me@0 forbids the desired one at 6,
    # without overlapping it. The refusal gives the rule, and the in-use one is kept.
    d = _diff([_dev("1g.10gb+me@0", 1)], _want("1g.10gb+me@6"), in_use=frozenset({"MIG-2-1"}))
    assert d == changes.Diff(
        (),
        (
            Refusal(
                2,
                "desired 1g.10gb+me@6 not created: at most one media-extension (+me) instance "
                "per GPU, got 2: 1g.10gb+me@0, 1g.10gb+me@6",
                _inst("1g.10gb+me@6"),
            ),
            Refusal(
                2,
                "1g.10gb+me@0 (MIG-2-1) is in use and not in the desired layout; kept",
                _inst("1g.10gb+me@0"),
                in_use=True,
            ),
        ),
    )


def test_an_instance_is_withheld_before_its_last_in_use_check_and_only_a_destroyed_one() -> None:
    # Withheld first, then checked: a pod handed it before the withhold shows in the check (the
    # destroy is refused); after it, the stand-in gives it to no new pod.
    emu = RacingBackend()
    free = emu.create_instance(0, profile="3g.40gb", start=4)
    kept = emu.create_instance(1, profile="3g.40gb", start=4)
    assert free.uuid is not None and kept.uuid is not None
    calls: list[str] = []

    class Logged(reconciling.InUseSet):
        def in_use(self) -> frozenset[str]:
            calls.append("in-use")
            return super().in_use()

    rec = reconciling.Reconciler(
        emu,
        Logged(),
        withhold=lambda ids: calls.append(f"withhold {','.join(sorted(ids))}"),
        max_rounds=1,
    )
    rec.reconcile({0: _want("7g.80gb@0"), 1: _want("3g.40gb@4")})
    assert emu.destroy_calls == [(0, free.gi_id)]
    # The diff's read, then the destroy's withhold and re-check, then the final diff's read.
    assert calls == ["in-use", f"withhold {free.uuid}", "in-use", "in-use"]
