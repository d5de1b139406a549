"""Dynamic MIG mode (``docs/migmode.md``): the spec's per-GPU ``mig``, the diff's safe mode
switch on a dynamic node (and the refusal elsewhere), and the reconciler applying it on the
emulated backend."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from migpilot import errors
from migpilot.agent import reconciling, running
from migpilot.agent.cluster import reporting
from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import changes, desired, labels
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.gpu import backend, clocks, emulated
from migpilot.mig import catalog, layouts
from tests.unit import gpulayout_docs as docs

H100 = catalog.resolve_gpu("h100-80gb")
A100 = catalog.resolve_gpu("a100-40gb")
K = changes.ChangeKind
NOW = "2026-01-01T00:00:00Z"


def _spec_gpu(doc: dict[str, Any], index: int) -> dict[str, Any]:
    return next(g for g in doc["spec"]["gpus"] if g["index"] == index)


def test_the_spec_carries_mig_per_gpu_and_round_trips() -> None:
    doc = docs.mig()
    _spec_gpu(doc, 0)["instances"] = []
    _spec_gpu(doc, 0)["mig"] = False
    layout = wire.parse(doc)
    gpu0 = next(g for g in layout.spec.gpus if g.index == 0)
    assert gpu0.mig is False
    assert next(g for g in layout.spec.gpus if g.index == 1).mig is None
    again = wire.to_document(layout)
    assert [g.get("mig") for g in again["spec"]["gpus"]] == [False, None]


@pytest.mark.parametrize(
    ("value", "named"),
    [("yes", "expected true or false"), (False, "holds no MIG instances")],
)
def test_a_bad_mig_field_is_refused_naming_it(value: object, named: str) -> None:
    doc = docs.mig()
    _spec_gpu(doc, 0)["mig"] = value  # GPU 0 keeps its 7g.80gb instance
    with pytest.raises(errors.GpuLayoutError, match=rf"spec\.gpus\[.*\]\.mig.*{named}"):
        wire.parse(doc)


def _state(emu: emulated.EmulatedBackend) -> dict[int, changes.GpuState]:
    return reconciling.Reconciler(emu, reconciling.InUseSet()).read()


def test_a_static_node_still_refuses_a_mode_change() -> None:
    emu = emulated.EmulatedBackend([H100])
    plan = changes.diff(
        actual=_state(emu), desired={0: changes.DesiredGpu(mig_enabled=False)}, in_use=frozenset()
    )
    assert plan.changes == ()
    assert "needs a GPU reset (not forced)" in plan.refusals[0].reason


def test_a_dynamic_node_destroys_idle_instances_then_switches_the_mode() -> None:
    emu = emulated.EmulatedBackend([H100])
    emu.create_instance(0, profile="3g.40gb", start=4)
    emu.create_instance(0, profile="1g.10gb", start=0)
    plan = changes.diff(
        actual=_state(emu),
        desired={0: changes.DesiredGpu(mig_enabled=False)},
        in_use=frozenset(),
        dynamic_mig=True,
    )
    assert [(c.kind, c.instance) for c in plan.changes] == [
        (K.DESTROY, layouts.Instance(0, "1g.10gb")),
        (K.DESTROY, layouts.Instance(4, "3g.40gb")),
        (K.SET_MIG_MODE, None),
    ]
    assert plan.changes[-1].mig is False and plan.refusals == ()


def test_a_dynamic_node_never_switches_a_gpu_with_anything_in_use() -> None:
    emu = emulated.EmulatedBackend([H100, H100], mig_enabled=False)
    emu.set_mig_mode(0, enabled=True)
    used = emu.create_instance(0, profile="1g.10gb", start=0)
    emu.create_instance(0, profile="1g.10gb", start=1)
    assert used.uuid is not None
    actual = _state(emu)
    plan = changes.diff(
        actual=actual,
        desired={0: changes.DesiredGpu(False), 1: changes.DesiredGpu(True)},
        in_use=frozenset({used.uuid, actual[1].info.uuid}),
        dynamic_mig=True,
    )
    assert plan.changes == ()  # not even the idle 1g.10gb@1 is destroyed
    assert [(r.gpu, r.in_use) for r in plan.refusals] == [(0, True), (1, True)]
    # The refusal names the instance in use (the status reports it against that instance).
    assert [r.instance for r in plan.refusals] == [layouts.Instance(0, "1g.10gb"), None]
    assert "MIG mode not disabled" in plan.refusals[0].reason
    assert "whole GPU is in use" in plan.refusals[1].reason


def test_the_reconciler_switches_then_creates_on_a_dynamic_node() -> None:
    emu = emulated.EmulatedBackend([H100, A100], mig_enabled=False)
    want = {
        0: changes.DesiredGpu(True, layouts.Layout.of([layouts.Instance(0, "7g.80gb")])),
        1: changes.DesiredGpu(True, layouts.Layout.of([layouts.Instance(0, "7g.40gb")])),
    }
    static = reconciling.Reconciler(emu, reconciling.InUseSet())
    assert not static.reconcile(want).applied
    dynamic = reconciling.Reconciler(emu, reconciling.InUseSet(), dynamic_mig=True)
    report = dynamic.reconcile(want)
    assert report.converged and report.refusals == ()
    assert report.layout(0) == want[0].layout and report.layout(1) == want[1].layout
    assert [g.mig for g in emu.gpus()] == [backend.MigMode(True, True)] * 2


def test_a_reset_that_cannot_happen_leaves_the_mode_pending_and_reported() -> None:
    clock = clocks.VirtualClock()
    times = emulated.OperationTimes(mig_mode_reset_s=4.0)
    emu = emulated.EmulatedBackend([A100], clock=clock, times=times)
    emu.block_reset(0)
    rec = reconciling.Reconciler(emu, reconciling.InUseSet(), dynamic_mig=True, clock=clock)
    report = rec.reconcile({0: changes.DesiredGpu(False)})
    assert not report.converged
    assert {a.outcome for a in report.applied} == {changes.Outcome.REFUSED}
    assert emu.gpus()[0].mig == backend.MigMode(True, False)
    emu.block_reset(0, blocked=False)
    t0 = clock.monotonic()
    assert rec.reconcile({0: changes.DesiredGpu(False)}).converged
    assert clock.monotonic() - t0 == pytest.approx(4.0)
    assert emu.gpus()[0].mig == backend.MigMode(False, False)


def test_the_spec_asks_for_a_mode_through_desired() -> None:
    emu = emulated.EmulatedBackend([H100, H100])
    doc = docs.mig()
    _spec_gpu(doc, 0)["instances"] = []
    _spec_gpu(doc, 0)["mig"] = False
    want = desired.from_gpulayout(wire.parse(doc).spec, gpus=emu.gpus())
    assert want[0] == changes.DesiredGpu(mig_enabled=False)
    assert want[1].mig_enabled


@pytest.mark.parametrize("held", ["{uuid}", "{uuid}::2", "{uuid}::mps-1"])
def test_a_pod_on_the_whole_gpu_or_a_share_of_it_keeps_its_mode(held: str) -> None:
    emu = emulated.EmulatedBackend([H100], mig_enabled=False)
    actual = _state(emu)
    used = held.format(uuid=actual[0].info.uuid)
    plan = changes.diff(
        actual=actual,
        desired={0: changes.DesiredGpu(True)},
        in_use=frozenset({used}),
        dynamic_mig=True,
    )
    assert plan.changes == () and plan.refusals[0].in_use
    assert plan.refusals[0].reason == "the whole GPU is in use; MIG mode not enabled"
    other = changes.diff(
        actual=actual,
        desired={0: changes.DesiredGpu(True)},
        in_use=frozenset({"GPU-other", "GPU-other::2"}),
        dynamic_mig=True,
    )
    assert [c.kind for c in other.changes] == [K.SET_MIG_MODE]


def test_the_reconciler_asks_whether_the_node_is_dynamic_at_each_pass() -> None:
    emu = emulated.EmulatedBackend([H100])
    label = [False]
    rec = reconciling.Reconciler(emu, reconciling.InUseSet(), dynamic_mig=lambda: label[0])
    want = {0: changes.DesiredGpu(False)}
    assert "needs a GPU reset (not forced)" in rec.reconcile(want).refusals[0].reason
    assert emu.gpus()[0].mig == backend.MigMode(True, True)
    label[0] = True
    report = rec.reconcile(want)
    assert report.converged and report.refusals == ()
    assert emu.gpus()[0].mig == backend.MigMode(False, False)


def test_a_kubelet_that_cannot_be_asked_keeps_every_gpu_s_mode() -> None:
    emu = emulated.EmulatedBackend([H100, H100], mig_enabled=False)
    everything = running.every_uuid(emu)
    assert {g.uuid for g in emu.gpus()} <= everything
    rec = reconciling.Reconciler(emu, reconciling.InUseSet(everything), dynamic_mig=True)
    report = rec.reconcile({0: changes.DesiredGpu(True), 1: changes.DesiredGpu(True)})
    assert [(r.gpu, r.in_use) for r in report.refusals] == [(0, True), (1, True)]
    assert [g.mig for g in emu.gpus()] == [backend.MigMode(False, False)] * 2


# --- step 2: withdrawn before the switch, reported after -------------------------------------


def test_the_gpus_to_switch_are_withdrawn_before_anything_on_them_changes() -> None:
    emu = emulated.EmulatedBackend([H100, H100])
    emu.create_instance(0, profile="1g.10gb", start=0)
    seen: list[tuple[frozenset[int], int, bool]] = []

    def withdraw(gpus: frozenset[int]) -> None:
        mig = emu.gpus()[0].mig
        seen.append((gpus, len(emu.mig_devices(0)), mig is not None and mig.current))

    rec = reconciling.Reconciler(emu, reconciling.InUseSet(), dynamic_mig=True, withdraw=withdraw)
    want = {0: changes.DesiredGpu(False), 1: changes.DesiredGpu(True)}
    assert rec.reconcile(want).converged
    assert seen == [(frozenset({0}), 1, True)]  # GPU 0 still as it was; GPU 1 not switched
    rec.reconcile(want)
    assert len(seen) == 1  # nothing to switch: nothing withdrawn


def test_a_gpu_taken_after_the_diff_is_not_switched() -> None:
    emu = emulated.EmulatedBackend([H100], mig_enabled=False)
    used = reconciling.InUseSet()
    uuid = emu.gpus()[0].uuid
    rec = reconciling.Reconciler(
        emu, used, dynamic_mig=True, withdraw=lambda _: used.add(f"{uuid}::1"), max_rounds=1
    )
    report = rec.reconcile({0: changes.DesiredGpu(True)})
    assert [(a.outcome, a.detail) for a in report.applied] == [
        (changes.Outcome.REFUSED, "became in use; MIG mode not changed")
    ]
    assert emu.gpus()[0].mig == backend.MigMode(False, False)


def test_an_instance_taken_after_the_diff_is_not_destroyed_for_a_switch() -> None:
    """Each destroy of a switch names its instance's UUID: the re-check right before it refuses
    an instance a pod took since the diff (the GPU then stays in MIG mode)."""
    emu = emulated.EmulatedBackend([H100])
    taken = emu.create_instance(0, profile="1g.10gb", start=0)
    assert taken.uuid is not None
    used = reconciling.InUseSet()
    rec = reconciling.Reconciler(
        emu, used, dynamic_mig=True, withdraw=lambda _: used.add(str(taken.uuid)), max_rounds=1
    )
    report = rec.reconcile({0: changes.DesiredGpu(False)})
    assert [(a.change.kind, a.outcome, a.detail) for a in report.applied] == [
        (K.DESTROY, changes.Outcome.REFUSED, "became in use; not destroyed")
    ]
    assert report.applied[0].change.uuid == taken.uuid
    assert [d.uuid for d in emu.mig_devices(0)] == [taken.uuid]
    assert emu.gpus()[0].mig == backend.MigMode(True, True)


def test_without_gpus_leaves_out_the_gpu_and_everything_on_it() -> None:
    emu = emulated.EmulatedBackend([H100, H100])
    a = emu.create_instance(0, profile="1g.10gb", start=0)
    b = emu.create_instance(1, profile="1g.10gb", start=0)
    full = running.node_view(_state(emu))
    full = devices.NodeDevices(full.gpus, full.mig_devices, unified=frozenset({a.uuid, b.uuid}))
    view = devices.without_gpus(full, frozenset({0}))
    assert [g.index for g in view.gpus] == [1]
    assert [m.uuid for m in view.mig_devices] == [b.uuid]
    assert view.unified == {b.uuid}
    assert devices.without_gpus(full, frozenset()) is full


def _report(*applied: changes.Applied) -> changes.Report:
    return changes.Report(devices={}, applied=applied, refusals=(), converged=True, duration_s=0)


def test_the_mig_mode_state_label() -> None:
    emu = emulated.EmulatedBackend([A100], mig_enabled=False)
    state = _state(emu)
    off, on = {0: changes.DesiredGpu(False)}, {0: changes.DesiredGpu(True)}
    assert labels.mig_mode_state(_report(), state=state, desired=off) == "success"
    assert labels.mig_mode_state(_report(), state=state, desired={}) == "success"
    assert labels.mig_mode_state(_report(), state=state, desired=on) == "pending"
    emu.block_reset(0)
    emu.set_mig_mode(0, enabled=True)  # pending until a reset
    state = _state(emu)
    assert labels.mig_mode_state(_report(), state=state, desired=on) == "pending"
    change = changes.Change(K.SET_MIG_MODE, 0, None, mig=True)
    failed = changes.Applied(change, changes.Outcome.FAILED, "driver error")
    assert labels.mig_mode_state(_report(failed), state=state, desired=on) == "failed"


def test_the_status_carries_each_gpu_s_mig_mode_on_a_dynamic_node_only() -> None:
    emu = emulated.EmulatedBackend([H100, H100])
    emu.set_mig_mode(1, enabled=False)
    state = _state(emu)
    plain = reporting.layout_status(
        state=state, in_use=frozenset(), spec=None, generation=None, report=None, now=NOW
    )
    assert [(g.index, g.mig_mode) for g in plain.gpus] == [(0, None)]
    status = reporting.layout_status(
        state=state,
        in_use=frozenset(),
        spec=None,
        generation=None,
        report=None,
        dynamic_mig=True,
        now=NOW,
    )
    assert [(g.index, g.mig_mode) for g in status.gpus] == [
        (0, gl.MigModeStatus(True, True)),
        (1, gl.MigModeStatus(False, False)),
    ]
    layout = wire.parse(docs.mig())
    with_status = wire.to_document(dataclasses.replace(layout, status=status))
    assert with_status["status"]["gpus"][1]["migMode"] == {"current": False, "pending": False}
    assert wire.parse(with_status).status == status


@pytest.mark.parametrize(
    ("mode", "named"),
    [({"current": "no", "pending": False}, "current.*expected true or false"),
     ({"current": False, "pending": False}, "MIG off holds no MIG instances"),
     ({"current": True}, "pending.*expected true or false")],
)  # fmt: skip
def test_a_bad_mig_mode_in_the_status_is_refused_naming_it(
    mode: dict[str, Any], named: str
) -> None:
    emu = emulated.EmulatedBackend([H100])
    emu.create_instance(0, profile="1g.10gb", start=0)
    status = reporting.layout_status(
        state=_state(emu), in_use=frozenset(), spec=None, generation=None, report=None, now=NOW
    )
    layout = dataclasses.replace(wire.parse(docs.mig()), status=status)
    doc = wire.to_document(layout)
    doc["status"]["gpus"][0]["migMode"] = mode
    with pytest.raises(errors.GpuLayoutError, match=rf"status\.gpus\[0\]\.migMode.*{named}"):
        wire.parse(doc)
