"""The MIG-native trace generators: seeded, read back by the MIG-native parser, mixes as named."""

from __future__ import annotations

from collections import Counter

import pytest

from migpilot import errors
from migpilot.sim import nativegen, traces


def _trace(mix: str, seed: int, pods: int = 400) -> traces.Trace:
    return traces.parse_native(nativegen.generate(mix, seed=seed, pods=pods), source=mix)


def test_the_same_seed_gives_the_same_text_and_another_seed_another() -> None:
    a = nativegen.generate("steady-mixed", seed=3)
    assert a == nativegen.generate("steady-mixed", seed=3)
    assert a != nativegen.generate("steady-mixed", seed=4)


@pytest.mark.parametrize("mix", list(nativegen.MIXES))
def test_every_mix_reads_back_as_a_native_trace(mix: str) -> None:
    trace = _trace(mix, 1, pods=200)
    assert len(trace.pods) == 200
    assert all(p.mig and p.cpu_milli > 0 and p.memory_bytes > 0 for p in trace.pods)
    arrivals = [p.arrival for p in trace.pods]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    known = {k.profile for k in nativegen.INFERENCE + nativegen.TRAINING}
    assert {r.profile for p in trace.pods for r in p.mig} <= known


def test_pins_select_the_two_products_and_most_pods_run_anywhere() -> None:
    pins = Counter(
        dict(p.node_selector).get("nvidia.com/gpu.product") for p in _trace("steady-mixed", 2).pods
    )
    assert pins[nativegen.H100] > 0 and pins[nativegen.A100] > 0
    assert pins[None] > pins[nativegen.H100] + pins[nativegen.A100]


def _whole_gpu_share(pods: tuple[traces.TracePod, ...]) -> float:
    return sum(any(r.profile == "7g.80gb" for r in p.mig) for p in pods) / len(pods)


def test_a_shifting_mix_moves_from_its_first_table_to_its_second() -> None:
    pods = _trace("shift-to-training", 5, pods=600).pods
    first, last = pods[:150], pods[-150:]
    assert _whole_gpu_share(last) > _whole_gpu_share(first) + 0.2
    back = _trace("shift-to-inference", 5, pods=600).pods
    assert _whole_gpu_share(back[:150]) > _whole_gpu_share(back[-150:]) + 0.2


def test_a_steady_mix_keeps_its_shares() -> None:
    pods = _trace("steady-training", 6, pods=800).pods
    assert abs(_whole_gpu_share(pods[:400]) - _whole_gpu_share(pods[400:])) < 0.1


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(errors.TraceError, match="unknown MIG-native mix 'nope'"):
        nativegen.generate("nope", seed=1)
    with pytest.raises(errors.TraceError, match="at least one pod"):
        nativegen.generate("steady-mixed", seed=1, pods=0)
