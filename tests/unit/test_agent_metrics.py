"""The agent's Prometheus metrics: own registry, fed by the reconciler and by callers."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from migpilot.agent import metrics, reconciling
from migpilot.agent.rules import changes
from migpilot.gpu import clocks, emulated
from migpilot.mig import catalog, layouts

H100 = catalog.resolve_gpu("h100-80gb")


def _samples(m: metrics.AgentMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_each_instance_has_its_own_registry() -> None:
    a, b = metrics.AgentMetrics(), metrics.AgentMetrics()
    a.count_action(op="create", outcome="done")
    assert (
        _samples(a)[("migpilot_reconcile_actions_total", (("op", "create"), ("outcome", "done")))]
        == 1
    )
    assert (
        "migpilot_reconcile_actions_total",
        (("op", "create"), ("outcome", "done")),
    ) not in _samples(b)


def test_reconciler_records_duration_and_actions_by_outcome() -> None:
    clock = clocks.VirtualClock()
    emu = emulated.EmulatedBackend([H100], clock=clock, times=emulated.OperationTimes())
    blocker = emu.create_instance(0, profile="2g.20gb", start=2)
    emu.create_instance(0, profile="1g.10gb", start=6)
    assert blocker.uuid is not None
    m = metrics.AgentMetrics()
    rec = reconciling.Reconciler(
        emu, reconciling.InUseSet([blocker.uuid]), clock=clock, agent_metrics=m
    )
    want = layouts.Layout.of([layouts.Instance(0, "3g.40gb"), layouts.Instance(4, "3g.40gb")])
    report = rec.reconcile({0: changes.DesiredGpu(True, want)})
    s = _samples(m)
    assert s[("migpilot_reconcile_actions_total", (("op", "destroy"), ("outcome", "done")))] == 1
    assert s[("migpilot_reconcile_actions_total", (("op", "create"), ("outcome", "done")))] == 1
    assert s[("migpilot_reconfiguration_duration_seconds_count", ())] == 1
    # one destroy (0.04 + 0.1 s) and one create (0.05 + 0.03 s) on the virtual clock
    assert s[("migpilot_reconfiguration_duration_seconds_sum", ())] == report.duration_s
    assert abs(report.duration_s - 0.22) < 1e-9
    assert s[("migpilot_reconfiguration_duration_seconds_bucket", (("le", "0.25"),))] == 1
    assert s[("migpilot_reconfiguration_duration_seconds_bucket", (("le", "0.1"),))] == 0
    rec.reconcile({0: changes.DesiredGpu(True, want)})  # nothing to do: no new observation
    assert _samples(m)[("migpilot_reconfiguration_duration_seconds_count", ())] == 1


def test_failed_and_refused_actions_are_counted() -> None:
    emu = emulated.EmulatedBackend([H100])
    dev = emu.create_instance(0, profile="7g.80gb", start=0)
    assert dev.uuid is not None
    emu.attach_process(dev.uuid, 7)
    emu.inject(emulated.Fault(emulated.Step.CREATE_GPU_INSTANCE, 1, emulated.FaultEffect.FAIL))
    m = metrics.AgentMetrics()
    rec = reconciling.Reconciler(emu, reconciling.InUseSet(), agent_metrics=m, max_rounds=1)
    want = layouts.Layout.of([layouts.Instance(0, "4g.40gb")])
    report = rec.reconcile({0: changes.DesiredGpu(True, want)})
    assert [a.outcome for a in report.applied] == [changes.Outcome.REFUSED]
    assert (
        _samples(m)[
            ("migpilot_reconcile_actions_total", (("op", "destroy"), ("outcome", "refused")))
        ]
        == 1
    )
    emu.detach_process(dev.uuid, 7)
    report = rec.reconcile({0: changes.DesiredGpu(True, want)})
    assert [a.outcome for a in report.applied] == [
        changes.Outcome.DONE,
        changes.Outcome.FAILED,
    ]
    assert not report.converged
    assert (
        _samples(m)[("migpilot_reconcile_actions_total", (("op", "create"), ("outcome", "failed")))]
        == 1
    )


def test_device_gauge_is_replaced_by_each_call() -> None:
    m = metrics.AgentMetrics()
    m.set_devices(
        {("nvidia.com/mig-1g.10gb", "healthy"): 7, ("nvidia.com/mig-1g.10gb", "unhealthy"): 1}
    )
    m.set_devices({("nvidia.com/mig-3g.40gb", "healthy"): 2})
    s = _samples(m)
    assert (
        s[("migpilot_devices", (("health", "healthy"), ("resource", "nvidia.com/mig-3g.40gb")))]
        == 2
    )
    assert (
        s[("migpilot_devices", (("health", "healthy"), ("resource", "nvidia.com/mig-1g.10gb")))]
        == 0
    )
    assert (
        s[("migpilot_devices", (("health", "unhealthy"), ("resource", "nvidia.com/mig-1g.10gb")))]
        == 0
    )
