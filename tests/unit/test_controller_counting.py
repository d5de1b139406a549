"""The rule that keeps the planner off instances a kubelet may have handed out.

The kubelet counts devices and does not say which a pod got, so the controller marks at least as
many instances of each profile used as the pods bound to a node ask for, beside the instances
reserved for pods still waiting (never counting a reserved instance for a bound pod: that was a
bug the controller benchmark found, where a burst over-reserved a node and pods waited for the
reservation timeout).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import observing

A100 = "NVIDIA A100-SXM4-80GB"


def _layout(instances: list[tuple[int, str, str | None, str]]) -> gl.GpuLayout:
    """One GPU; (start, profile, reservedFor, status state) per instance."""
    spec = [
        {"profile": p, "start": s, **({"reservedFor": r} if r else {})} for s, p, r, _ in instances
    ]
    status = [
        {"profile": p, "start": s, "uuid": f"MIG-{s}", "state": state}
        for s, p, _, state in instances
    ]
    doc: dict[str, Any] = {
        "apiVersion": gl.API_VERSION,
        "kind": gl.KIND,
        "metadata": {"name": "n0", "generation": 1},
        "spec": {"gpus": [{"index": 0, "instances": spec}]},
        "status": {
            "observedGeneration": 1,
            "gpus": [{"index": 0, "model": A100, "uuid": "GPU-0", "instances": status}],
        },
    }
    return wire.parse(doc)


def _used(
    layout: gl.GpuLayout, *, reserved: set[tuple[int, int, str]], bound: Counter[str]
) -> Counter[str]:
    (gpu,) = observing.node_gpus(layout, reserved=reserved, bound=bound)
    return Counter(i.profile for i in gpu.instances if i.used)


def test_a_reserved_instance_never_counts_for_a_bound_pod() -> None:
    # Seven 1g.10gb: two reserved for waiting pods, three pods bound to the node.
    insts = [
        (s, "1g.10gb", "d/w0" if s == 0 else "d/w1" if s == 1 else None, "free") for s in range(7)
    ]
    layout = _layout(insts)
    used = _used(
        layout, reserved={(0, 0, "1g.10gb"), (0, 1, "1g.10gb")}, bound=Counter({"1g.10gb": 3})
    )
    assert used["1g.10gb"] == 5


def test_instances_the_agent_reports_used_count_for_bound_pods() -> None:
    insts = [(s, "1g.10gb", None, "used" if s < 2 else "free") for s in range(7)]
    used = _used(_layout(insts), reserved=set(), bound=Counter({"1g.10gb": 3}))
    assert used["1g.10gb"] == 3


@given(
    total=st.integers(min_value=1, max_value=7),
    reserved=st.integers(min_value=0, max_value=7),
    reported=st.integers(min_value=0, max_value=7),
    bound=st.integers(min_value=0, max_value=7),
)
def test_used_covers_bound_and_reserved(
    total: int, reserved: int, reported: int, bound: int
) -> None:
    reserved = min(reserved, total)
    reported = min(reported, total - reserved)
    bound = max(bound, reported)  # the agent reports only what bound pods hold
    insts = []
    live = set()
    for s in range(total):
        if s < reserved:
            insts.append((s, "1g.10gb", f"d/w{s}", "reserved"))
            live.add((0, s, "1g.10gb"))
        elif s < reserved + reported:
            insts.append((s, "1g.10gb", None, "used"))
        else:
            insts.append((s, "1g.10gb", None, "free"))
    used = _used(_layout(insts), reserved=live, bound=Counter({"1g.10gb": bound}))
    assert used["1g.10gb"] == min(total, reserved + max(bound, reported))
