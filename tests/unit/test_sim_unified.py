"""The simulator on unified (HAMi-style) requests: openb's gpu_milli read as a memory share, the
policies that serve them, the invariants, determinism and the CLI's ``--requests unified``."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from migpilot.cli import main
from migpilot.mig import catalog
from migpilot.planning import unified
from migpilot.sim import clusters, policies, reports, simulating, traces

SMALL = clusters.parse("h100-80gb:2x4,a100-80gb:1x4")
H100 = catalog.resolve_gpu("h100-80gb")


@pytest.mark.parametrize(
    ("num_gpu", "gpu_milli", "text", "on_h100"),
    [
        (1, 1, "gpu 1, gpumem-percentage 1", ("1g.10gb",)),
        (1, 125, "gpu 1, gpumem-percentage 13", ("1g.20gb",)),  # 13 % of 8 slices: 2 slices
        (1, 500, "gpu 1, gpumem-percentage 50", ("3g.40gb",)),  # half the memory slices
        (1, 450, "gpu 1, gpumem-percentage 45", ("3g.40gb",)),
        (1, 1000, "gpu 1, gpumem-percentage 100", ("7g.80gb",)),
        (4, 1000, "gpu 4, gpumem-percentage 100", ("7g.80gb",) * 4),
    ],
)
def test_gpu_milli_is_read_as_a_share_of_memory(
    num_gpu: int, gpu_milli: int, text: str, on_h100: tuple[str, ...]
) -> None:
    request = traces.unified_for(num_gpu=num_gpu, gpu_milli=gpu_milli)
    assert request.text() == text
    assert request.count == num_gpu
    trace_pod = traces.TracePod("p", 0.0, None, (), 1000, 2**30, unified=request)
    assert simulating._needs(trace_pod.demand, H100) is not None
    assert unified.resolve(request, H100) == on_h100


def test_the_bundled_trace_in_unified_mode_keeps_every_gpu_pod() -> None:
    mig = traces.bundled_openb(H100)
    uni = traces.bundled_openb(H100, requests=traces.Requests.UNIFIED)
    assert len(uni.pods) == len(mig.pods) and uni.skipped == mig.skipped
    assert all(p.mig == () and p.unified is not None for p in uni.pods)
    assert [(p.name, p.cpu_milli, p.arrival) for p in uni.pods] == [
        (p.name, p.cpu_milli, p.arrival) for p in mig.pods
    ]


def test_native_traces_take_unified_requests() -> None:
    text = "name,arrival,duration,requests\na,0,5,gpu=2;gpumem=8000;cpu=1\n"
    (pod,) = traces.parse_native(text, source="n.csv").pods
    assert pod.mig == () and pod.unified is not None and pod.unified.text() == "gpu 2, gpumem 8000"


@pytest.mark.parametrize("name", ["migpilot", "hami-placement", "hami-template", "static", "nos"])
@pytest.mark.parametrize("mode", list(simulating.Replay))
def test_policies_serve_unified_traces_within_the_invariants(
    name: str, mode: simulating.Replay
) -> None:
    trace = traces.synthetic(
        "mixed", seed=3, model=SMALL.reference_model, pods=60, requests=traces.Requests.UNIFIED
    )
    policy = policies.static(SMALL) if name == "static" else policies.dynamic(name, SMALL)
    settings = simulating.Settings(mode=mode, paranoid=True)
    result = simulating.simulate(trace, cluster=SMALL, policy=policy, settings=settings)
    assert 0.0 <= result.allocation_ratio <= 1.0
    assert all("gpumem" in kind for kind in result.request_kinds)
    if name == "nos":
        assert result.pods_scheduled == 0  # nos serves no unified request
    elif name != "static":
        assert result.pods_scheduled > 0
    again = simulating.simulate(trace, cluster=SMALL, policy=policy, settings=settings)
    assert reports.row(again, timing=False) == reports.row(result, timing=False)


def test_migpilot_beats_hami_on_the_bundled_trace_in_unified_mode() -> None:
    cluster = clusters.parse(clusters.DEFAULT_SPEC)
    trace = traces.bundled_openb(cluster.reference_model, requests=traces.Requests.UNIFIED)
    got = {
        name: simulating.simulate(trace, cluster=cluster, policy=policies.dynamic(name, cluster))
        for name in policies.DEFAULT_UNIFIED
    }
    ours, hami = got["migpilot"], got["hami-placement"]
    assert ours.allocation_ratio > hami.allocation_ratio
    assert ours.pending_percentile(99) < hami.pending_percentile(99)


def _run(argv: list[str]) -> tuple[int, str]:
    out = io.StringIO()
    return main.main(argv, out=out), out.getvalue()


def test_the_cli_simulates_unified_requests(tmp_path: Path) -> None:
    code, text = _run(
        ["simulate", "--requests", "unified", "--cluster", "h100-80gb:2x4", "--no-plots",
         "-o", "json", "--out", str(tmp_path)]
    )  # fmt: skip
    assert code == 0
    doc = json.loads(text)
    assert [r["policy"] for r in doc["results"]] == list(policies.DEFAULT_UNIFIED)
    assert all(k.startswith("gpu ") for k in doc["request_kinds"])


def test_the_cli_refuses_a_profile_mapping_for_unified_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = _run(
        ["simulate", "--requests", "unified", "--profile-mapping", "memory", "--out",
         str(tmp_path)]
    )  # fmt: skip
    assert code == 2
    assert "--profile-mapping chooses MIG profiles for --requests mig" in capsys.readouterr().err
