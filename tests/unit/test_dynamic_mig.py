"""Dynamic MIG mode (``docs/migmode.md``): the spec's per-GPU ``mig``, the diff's safe mode
switch on a dynamic node (and the refusal elsewhere), and the reconciler applying it on the
emulated backend."""

from __future__ import annotations

from typing import Any

import pytest

from migpilot import errors
from migpilot.agent import reconciling, running
from migpilot.agent.rules import changes, desired
from migpilot.api import gpulayouts_wire as wire
from migpilot.gpu import backend, clocks, emulated
from migpilot.mig import catalog, layouts
from tests.unit import gpulayout_docs as docs

H100 = catalog.resolve_gpu("h100-80gb")
A100 = catalog.resolve_gpu("a100-40gb")
K = changes.ChangeKind


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
