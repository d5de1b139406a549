"""The crash matrix: the agent dies between any two backend steps and a new one converges.

For a few realistic reconfigurations, the reconciler is run against an emulated node whose state
lives in a file, and the process "dies" (:class:`~migpilot.gpu.emulated.SimulatedCrash`) just
before or just after the k-th state-changing driver step, for every k. A new backend on the same
file and a new reconciler must then converge to exactly the layout a crash-free run reaches: no
leaked instance (nothing extra, no GPU instance left without its compute instance) and no lost
one (every in-use device still there with its UUID and processes).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import pytest

from migpilot.agent import reconciling
from migpilot.agent.rules import changes
from migpilot.gpu import backend, emulated
from migpilot.mig import catalog, layouts, profiles

H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30")
A100 = catalog.resolve_gpu("a100-40gb")


def _layout(*texts: str) -> layouts.Layout:
    return layouts.Layout.of(layouts.Instance(int(t.split("@")[1]), t.split("@")[0]) for t in texts)


@dataclass(frozen=True)
class Scenario:
    name: str
    models: tuple[profiles.GpuModel, ...]
    initial: dict[int, layouts.Layout]
    desired: dict[int, layouts.Layout]
    pod_held: tuple[tuple[int, layouts.Instance], ...] = ()
    """Devices kubelet says a pod holds."""
    busy: tuple[tuple[int, layouts.Instance], ...] = ()
    """Devices with a running process."""


SCENARIOS = [
    Scenario(
        "split-a-whole-gpu",
        (H100,),
        {0: _layout("7g.80gb@0")},
        {0: _layout("3g.40gb@0", "2g.20gb@4", "1g.10gb@6")},
    ),
    Scenario(
        "repack-around-an-in-use-1g",
        (H100,),
        {0: _layout(*(f"1g.10gb@{s}" for s in range(7)))},
        {0: _layout("1g.10gb@0", "1g.10gb@1", "2g.20gb@2", "3g.40gb@4")},
        pod_held=((0, layouts.Instance(0, "1g.10gb")),),
        busy=((0, layouts.Instance(1, "1g.10gb")),),
    ),
    Scenario(
        "two-models-two-gpus",
        (A30, A100),
        {0: _layout("4g.24gb@0"), 1: _layout("3g.20gb@0", "3g.20gb@4")},
        {0: _layout("2g.12gb@0", "1g.6gb@2", "1g.6gb@3"), 1: _layout("7g.40gb@0")},
    ),
    Scenario(
        "blocked-by-a-pod",
        (H100, H100),
        {0: _layout("2g.20gb@2", "1g.10gb@6"), 1: _layout("4g.40gb@0")},
        {0: _layout("3g.40gb@0", "3g.40gb@4"), 1: _layout("1g.20gb@0", "1g.20gb@2", "3g.40gb@4")},
        pod_held=((0, layouts.Instance(2, "2g.20gb")),),
    ),
]


class Node:
    """The emulated node's state file, and the in-use sources that outlive an agent process."""

    def __init__(self, scenario: Scenario, path: Path) -> None:
        self.path = path
        self.scenario = scenario
        emu = emulated.EmulatedBackend(scenario.models, state_path=path, seed=5, durable=False)
        for gpu, layout in scenario.initial.items():
            for inst in layout.instances:
                emu.create_instance(gpu, profile=inst.profile, start=inst.start)
        self.held = reconciling.InUseSet()
        self.protected: dict[str, tuple[int, layouts.Instance]] = {}
        for gpu, inst in scenario.pod_held:
            uuid = self._uuid(emu, gpu, inst)
            self.held.add(uuid)
            self.protected[uuid] = (gpu, inst)
        for gpu, inst in scenario.busy:
            uuid = self._uuid(emu, gpu, inst)
            emu.attach_process(uuid, 1000 + len(self.protected))
            self.protected[uuid] = (gpu, inst)

    @staticmethod
    def _uuid(emu: emulated.EmulatedBackend, gpu: int, inst: layouts.Instance) -> str:
        (dev,) = [d for d in emu.mig_devices(gpu) if d.instance == inst]
        assert dev.uuid is not None
        return dev.uuid

    def agent(self) -> tuple[emulated.EmulatedBackend, reconciling.Reconciler]:
        """A new agent process: a new backend on the state file and a new reconciler."""
        emu = emulated.EmulatedBackend(state_path=self.path, durable=False)
        in_use = reconciling.AnyOf([self.held, reconciling.RunningProcesses(emu)])
        return emu, reconciling.Reconciler(emu, in_use)

    def desired(self) -> dict[int, changes.DesiredGpu]:
        return {g: changes.DesiredGpu(True, lay) for g, lay in self.scenario.desired.items()}


def _snapshot(emu: emulated.EmulatedBackend) -> dict[int, tuple[backend.MigDevice, ...]]:
    return {g.index: emu.mig_devices(g.index) for g in emu.gpus()}


def _clean_run(scenario: Scenario, path: Path) -> tuple[dict[int, layouts.Layout], int]:
    """The layout a crash-free run reaches, and how many driver steps it takes."""
    node = Node(scenario, path)
    emu, rec = node.agent()
    # Count the steps with a fault that never fires.
    emu.inject(emulated.Fault(None, 10_000, emulated.FaultEffect.FAIL))
    report = rec.reconcile(node.desired())
    assert report.converged
    steps = sum(2 if a.change.kind is not changes.ChangeKind.REPAIR else 1 for a in report.applied)
    return {g: report.layout(g) for g in scenario.desired}, steps


def _check_converged(
    node: Node, report: changes.Report, expected: dict[int, layouts.Layout]
) -> None:
    emu, _ = node.agent()
    state = _snapshot(emu)
    assert report.converged
    for gpu, layout in expected.items():
        assert layouts.Layout.of(d.instance for d in state[gpu]) == layout  # nothing leaked
        assert all(d.complete for d in state[gpu])  # no GPU instance without compute instance
    present = {d.uuid: (d.gpu, d.instance) for devs in state.values() for d in devs}
    for uuid, where in node.protected.items():
        assert present.get(uuid) == where  # nothing in use was lost or replaced
    for gpu, inst in node.scenario.busy:
        (dev,) = [d for d in state[gpu] if d.instance == inst]
        assert dev.uuid is not None and emu.running_processes(gpu, dev.uuid)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_clean_run_reaches_the_desired_layout_where_not_blocked(
    scenario: Scenario, tmp_path: Path
) -> None:
    expected, steps = _clean_run(scenario, tmp_path / "clean.json")
    assert steps > 0
    for gpu, layout in expected.items():
        blocked = {
            inst
            for g, inst in scenario.pod_held
            if g == gpu and inst not in scenario.desired[gpu].instances
        }
        if not blocked:
            assert layout == scenario.desired[gpu]
        else:
            assert blocked <= set(layout.instances)


@pytest.mark.parametrize(
    "effect", [emulated.FaultEffect.CRASH_BEFORE, emulated.FaultEffect.CRASH_AFTER]
)
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_crash_at_every_step_then_restart_converges(
    scenario: Scenario, effect: emulated.FaultEffect, tmp_path: Path
) -> None:
    expected, steps = _clean_run(scenario, tmp_path / "clean.json")
    for k in range(1, steps + 1):
        node = Node(scenario, tmp_path / f"crash-{k}.json")
        emu, rec = node.agent()
        emu.inject(emulated.Fault(None, k, effect))
        with pytest.raises(emulated.SimulatedCrash):
            rec.reconcile(node.desired())
        _, restarted = node.agent()
        report = restarted.reconcile(node.desired())
        _check_converged(node, report, expected)
        again = restarted.reconcile(node.desired())
        assert again.applied == ()  # idempotent once converged


def test_crash_again_while_recovering(tmp_path: Path) -> None:
    scenario = SCENARIOS[1]
    expected, steps = _clean_run(scenario, tmp_path / "clean.json")
    for k in range(1, steps + 1, 2):
        for j in (1, 2, 3):
            node = Node(scenario, tmp_path / f"crash-{k}-{j}.json")
            emu, rec = node.agent()
            emu.inject(emulated.Fault(None, k, emulated.FaultEffect.CRASH_AFTER))
            with pytest.raises(emulated.SimulatedCrash):
                rec.reconcile(node.desired())
            emu, rec = node.agent()
            emu.inject(emulated.Fault(None, j, emulated.FaultEffect.CRASH_AFTER))
            with contextlib.suppress(emulated.SimulatedCrash):
                rec.reconcile(node.desired())
            _, rec = node.agent()
            _check_converged(node, rec.reconcile(node.desired()), expected)
