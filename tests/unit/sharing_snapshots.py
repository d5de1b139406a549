"""A hypothesis strategy of snapshots with nodes in every sharing mode (``docs/modes.md``):
MIG, MPS (GPUs with random slices, some used), time-slicing (replicas, some used) and none, and
pods asking MIG profiles, MPS slices or unified memory. Shared by the planner's and the nos
baseline's property tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st

from migpilot.planning import modes, snapshot


@st.composite
def clusters(
    draw: st.DrawFn,
    *,
    modes_: Sequence[str] = ("mig", "mps", "mps", "time-slicing", "none"),
    models: Sequence[str] = ("a100-40gb", "a100-80gb", "h100-80gb"),
    max_slices: int = 5,
    max_pods: int = 12,
    mps_count: tuple[int, int] = (1, 1),
    mig_count: tuple[int, int] = (1, 2),
) -> snapshot.Snapshot:
    """Up to 4 nodes of 1-3 GPUs each in one of ``modes_``, and up to ``max_pods`` pods (MPS
    slices of 1-45 GB, ``mps_count`` of them; ``mig_count`` 1g.10gb; or 1-2 unified GPUs of
    500-50,000 MiB) at priority 0 or 1."""
    nodes: list[dict[str, Any]] = []
    for n in range(draw(st.integers(1, 4))):
        mode = draw(st.sampled_from(list(modes_)))
        gpus: list[dict[str, Any]] = []
        for _ in range(draw(st.integers(1, 3))):
            model = draw(st.sampled_from(list(models)))
            gpu: dict[str, Any] = {"model": model}
            if mode == "mps":
                cap = 40 if model == "a100-40gb" else 80
                slices, left = [], cap
                for i in range(draw(st.integers(0, max_slices))):
                    gb = draw(st.integers(1, max(1, cap // 4)))
                    if gb > left:
                        break
                    left -= gb
                    slices.append({"id": i, "memoryGB": gb, "used": draw(st.booleans())})
                gpu["mps"] = slices
            elif mode == "time-slicing":
                gpu["replicas"] = draw(st.integers(1, 4))
                gpu["replicasUsed"] = draw(st.integers(0, gpu["replicas"]))
            gpus.append(gpu)
        nodes.append({"name": f"n{n}", "labels": {modes.MODE_LABEL: mode}, "gpus": gpus})
    pods: list[dict[str, Any]] = []
    for i in range(draw(st.integers(0, max_pods))):
        kind = draw(st.sampled_from(["mps", "mps", "mig", "unified"]))
        if kind == "mps":
            gb = draw(st.integers(1, 45))
            req: dict[str, Any] = {f"nvidia.com/gpu-{gb}gb": draw(st.integers(*mps_count))}
        elif kind == "mig":
            req = {"nvidia.com/mig-1g.10gb": draw(st.integers(*mig_count))}
        else:
            req = {"nvidia.com/gpu": draw(st.integers(1, 2)),
                   "nvidia.com/gpumem": draw(st.integers(500, 50_000))}  # fmt: skip
        pods.append({"name": f"p{i}", "requests": req, "priority": draw(st.integers(0, 1))})
    return snapshot.parse({"version": 1, "nodes": nodes, "pods": pods})
