"""Dynamic MIG mode in the simulator (docs/migmode.md, docs/simulator.md): ``@dynamic`` cluster
groups, whole-GPU trace pods, the loop's switches carried out, whole GPUs freed when pods leave,
and the invariant that no GPU in use is ever switched."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot import errors
from migpilot.cli import main
from migpilot.planning import control, dynamic, plans, snapshot
from migpilot.sim import clusters, policies, reports, simulating, traces

FAITHFUL = simulating.Settings(mode=simulating.Replay.FAITHFUL, paranoid=True)
TRACE = """name,arrival,duration,requests
mig-a,0,100,mig-1g.10gb=1;cpu=1
whole-a,1,50,gpu=1;cpu=2
whole-b,2,50,gpu=1;cpu=2
mig-b,3,100,mig-3g.40gb=1;cpu=1
whole-c,60,50,gpu=2;cpu=2
"""


def _trace(text: str = TRACE) -> traces.Trace:
    return traces.parse_native(text, source="t.csv")


def _run(spec: str, name: str = "migpilot", text: str = TRACE) -> simulating.Result:
    cluster = clusters.parse(spec)
    return simulating.simulate(
        _trace(text), cluster=cluster, policy=policies.dynamic(name, cluster), settings=FAITHFUL
    )


def _outcomes(result: simulating.Result) -> dict[str, simulating.PodOutcome]:
    return {o.name: o for o in result.outcomes}


def test_a_dynamic_group_is_mig_nodes_labelled_for_it() -> None:
    cluster = clusters.parse("h100-80gb:2x4@dynamic,a100-80gb:1x4")
    first, _, plain = cluster.nodes
    assert (first.name, first.dynamic, first.mode) == ("h100-80gb-dynamic-00", True, "mig")
    assert first.labels["migpilot.io/mig-mode"] == "dynamic"
    assert (plain.name, plain.dynamic) == ("a100-80gb-00", False)
    assert "migpilot.io/mig-mode" not in plain.labels
    with pytest.raises(errors.ClusterSpecError, match="only mode time-slicing takes replicas"):
        clusters.parse("h100-80gb:1x8@dynamic:4")
    with pytest.raises(errors.ClusterSpecError, match="mig, mps, time-slicing, none, dra, dynamic"):
        clusters.parse("h100-80gb:1x8@dynamc")


def test_trace_rows_asking_whole_gpus() -> None:
    (pod,) = _trace("name,arrival,duration,requests\nw,0,1,gpu=2;cpu=4\n").pods
    assert (pod.whole, pod.mig, pod.unified, pod.cpu_milli) == (2, (), None, 4000)
    assert pod.requests.whole == 2
    with pytest.raises(errors.TraceError, match="also asks for nvidia.com/mig-1g.10gb"):
        _trace("name,arrival,duration,requests\nw,0,1,gpu=1;mig-1g.10gb=1\n")
    # gpumem makes it a unified request, as before
    (unified,) = _trace("name,arrival,duration,requests\nu,0,1,gpu=1;gpumem=8000\n").pods
    assert unified.whole == 0 and unified.unified is not None


def test_openb_full_gpu_rows_become_whole_gpu_pods_only_when_asked() -> None:
    text = (
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\n"
        "full,8000,1024,2,1000\nhalf,4000,1024,1,500\none,1000,1024,1,1000\n"
    )
    model = clusters.parse("h100-80gb:1x8").reference_model
    as_mig = traces.parse_openb(text, source="o.csv", model=model)
    assert [(p.whole, [(r.profile, r.count) for r in p.mig]) for p in as_mig.pods] == [
        (0, [("7g.80gb", 2)]),
        (0, [("4g.40gb", 1)]),
        (0, [("7g.80gb", 1)]),
    ]
    whole = traces.parse_openb(text, source="o.csv", model=model, whole_gpus=True)
    assert [(p.whole, bool(p.mig)) for p in whole.pods] == [(2, False), (0, True), (1, False)]


@pytest.mark.parametrize("name", ["migpilot", "nos"])
def test_whole_gpu_pods_go_to_switched_gpus_and_mig_pods_keep_theirs(name: str) -> None:
    result = _run("h100-80gb:1x2@dynamic", name)
    got = _outcomes(result)
    assert result.pods_scheduled == 5 and result.pods_rejected == 0
    assert result.whole_gpu_pods == 3
    # GPU 1 goes whole for whole-a (whole-b takes it when whole-a leaves); whole-c needs both,
    # so GPU 0 goes whole once both MIG pods have left.
    assert result.mode_switches == 2
    assert got["mig-a"].bound_at is not None and got["mig-a"].bound_at < 5
    assert got["mig-b"].bound_at is not None and got["mig-b"].bound_at < 10  # MIG kept on GPU 0
    assert got["whole-a"].bound_at is not None and got["whole-a"].bound_at < 5
    assert got["whole-b"].bound_at is not None and got["whole-b"].bound_at >= 51  # after whole-a
    assert got["whole-c"].bound_at is not None and got["whole-c"].bound_at >= 103  # both GPUs
    assert result.requests_never_served == ()
    assert "whole GPU" in result.request_kinds and "2 x whole GPU" in result.request_kinds


def test_without_dynamic_nodes_whole_gpu_pods_are_rejected_and_mig_pods_run_as_before() -> None:
    result = _run("h100-80gb:1x2")
    got = _outcomes(result)
    assert (result.mode_switches, result.whole_gpu_pods, result.pods_rejected) == (0, 0, 3)
    reason = got["whole-a"].reason or ""
    assert reason.startswith("can never run: it asks for 1 whole GPU and no node labelled")
    assert "migpilot.io/mig-mode=dynamic" in reason
    mig_only = "\n".join(line for line in TRACE.splitlines() if "mig-" in line or "name" in line)
    plain = _run("h100-80gb:1x2", text=mig_only + "\n")
    for key in ("mig-a", "mig-b"):
        assert got[key].bound_at == _outcomes(plain)[key].bound_at


def test_a_gpu_needing_a_reset_switches_more_slowly() -> None:
    hopper = _outcomes(_run("h100-80gb:1x2@dynamic"))["whole-a"].bound_at
    ampere = _outcomes(_run("a100-80gb:1x2@dynamic"))["whole-a"].bound_at
    assert hopper is not None and ampere is not None
    timing = simulating.Timing()
    assert ampere - hopper == pytest.approx(timing.mode_reset_s - timing.mode_switch_s)


def test_a_switch_of_a_gpu_in_use_is_an_invariant_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = dynamic.plan

    def reckless(snap: snapshot.Snapshot, planner: dynamic.Planner) -> plans.Plan:
        plan = real(snap, planner)
        for node in snap.nodes:
            for gpu in node.gpus:
                if any(i.used for i in gpu.instances):  # switch the GPU a pod holds
                    flip = plans.ModeSwitch(node.name, gpu.index, False)
                    return dataclasses.replace(plan, switches=(*plan.switches, flip))
        return plan

    monkeypatch.setattr(dynamic, "plan", reckless)
    assert control.dynamic.plan is reckless  # the loop's step plans through it
    with pytest.raises(simulating.InvariantViolation, match="while in use"):
        _run("h100-80gb:1x2@dynamic")


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    name=st.sampled_from(["migpilot", "nos"]),
    window=st.sampled_from([0.0, 1.0]),
)
def test_invariants_hold_with_switches_on_random_traces(
    seed: int, name: str, window: float
) -> None:
    # The paranoid recount after every event checks that no GPU with an instance held or
    # reserved, nor a whole GPU held or reserved, is ever switched, and that whole GPUs are
    # held by exactly the pods that hold them.
    cluster = clusters.parse("h100-80gb:2x2@dynamic,a100-80gb:1x2@dynamic")
    synthetic = traces.synthetic("mixed", seed=seed, model=cluster.reference_model, pods=30)
    pods = tuple(
        dataclasses.replace(p, mig=(), memory_gb=None, whole=min(p.mig[0].count, 2))
        if p.mig and p.mig[0].profile == "7g.80gb"
        else p
        for p in synthetic.pods
    )
    trace = dataclasses.replace(synthetic, pods=pods)
    cfg = dataclasses.replace(
        FAITHFUL, timing=simulating.Timing(batch_window_s=window, advertise_s=window)
    )
    result = simulating.simulate(
        trace, cluster=cluster, policy=policies.dynamic(name, cluster), settings=cfg
    )
    whole = sum(1 for o in result.outcomes if o.bound_at is not None and o.name in {
        p.name for p in pods if p.whole})  # fmt: skip
    assert result.whole_gpu_pods == whole
    assert result.pods_scheduled + result.pods_rejected <= result.pods_total


def test_the_summary_reports_switches_and_whole_gpu_pods(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(TRACE)
    argv = ["simulate", "--cluster", "h100-80gb:1x2@dynamic", "--trace", str(path), "--mode",
            "faithful", "--policies", "migpilot", "--no-plots", "--out", str(tmp_path)]  # fmt: skip
    out = io.StringIO()
    assert main.main(argv, out=out) == 0
    text = out.getvalue()
    assert "dynamic MIG mode: migpilot 2 MIG mode switches, 3 whole-GPU pods placed" in text
    doc = json.loads((tmp_path / "results.json").read_text())
    (row,) = doc["results"]
    assert (row["mode_switches"], row["whole_gpu_pods"]) == (2, 3)
    assert tuple(row) == reports.KEYS
