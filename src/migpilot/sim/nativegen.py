"""Seeded MIG-native traces of mixed H100/A100 clusters: the planner's quality check off openb.

openb is one cluster's workload, mapped onto MIG profiles from GPU shares; a planner tuned on it
alone can learn what only openb rewards (issue 25: a change that lifted openb lost allocation on
a MIG-native trace). These generators write traces as users of MIG clusters submit them: pods
that name their MIG profiles (``mig-3g.40gb=1``, several instances of one profile for a pod
using more than one GPU), some pinned to one GPU model by ``nvidia.com/gpu.product``, with CPU
and memory roughly in proportion to the slices asked.

A trace follows a mix (:data:`MIXES`): ``steady`` mixes draw every pod from one table of
profiles; ``shifting`` mixes blend two tables, the second's weight growing linearly from the
first pod to the last, as a cluster's workload moves from inference to training (or back). In
inflate mode (pods submitted in trace order without departures) a shift means the pods placed
first are of another kind than those that fill the cluster at the end.

The output is the MIG-native CSV (:func:`migpilot.sim.traces.parse_native` reads it back), so
the committed traces (``bench/data/native/``) are plain files anyone can replay with
``migpilot simulate --trace FILE``.

Pure core: randomness only from a ``random.Random(seed)`` made here; no I/O. May import
:mod:`migpilot.errors`.
"""

from __future__ import annotations

import csv
import io
import random
from dataclasses import dataclass

from migpilot import errors

H100 = "NVIDIA-H100-80GB-HBM3"
"""``nvidia.com/gpu.product`` of the simulator's h100-80gb nodes."""
A100 = "NVIDIA-A100-SXM4-80GB"
"""``nvidia.com/gpu.product`` of the simulator's a100-80gb nodes."""


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of pod in a mix: ``count`` instances of ``profile``, drawn with ``weight``."""

    weight: int
    profile: str
    count: int
    cores_per_slice: float
    """CPU cores per compute slice asked (a node has 12 cores per GPU, 12/7 per slice)."""
    mean_s: float
    """Mean run time (exponential), for faithful replays; inflate mode ignores it."""
    pin: tuple[tuple[str, float], ...] = ()
    """Share of the kind's pods pinned to a ``gpu.product``, per product (the rest run anywhere)."""


_SLICES = {"1g.10gb": 1, "1g.20gb": 1, "2g.20gb": 2, "3g.40gb": 3, "4g.40gb": 4, "7g.80gb": 7}
_MEM_GIB = {"1g.10gb": 6, "1g.20gb": 6, "2g.20gb": 12, "3g.40gb": 20, "4g.40gb": 24, "7g.80gb": 40}
"""Host memory per instance (a node has 48 GiB per GPU)."""

INFERENCE: tuple[Kind, ...] = (
    Kind(30, "1g.10gb", 1, 1.5, 1800.0, ((A100, 0.2),)),
    Kind(10, "1g.20gb", 1, 2.0, 1800.0),
    Kind(25, "2g.20gb", 1, 1.5, 3600.0),
    Kind(20, "3g.40gb", 1, 1.5, 3600.0, ((H100, 0.25),)),
    Kind(8, "4g.40gb", 1, 1.0, 7200.0),
    Kind(7, "7g.80gb", 1, 1.0, 7200.0),
)
"""Serving: mostly small instances, a few whole GPUs."""
TRAINING: tuple[Kind, ...] = (
    Kind(10, "2g.20gb", 1, 1.5, 3600.0),
    Kind(15, "3g.40gb", 1, 1.5, 14400.0),
    Kind(10, "4g.40gb", 1, 1.5, 14400.0),
    Kind(35, "7g.80gb", 1, 1.5, 28800.0, ((H100, 0.4),)),
    Kind(15, "7g.80gb", 2, 1.5, 43200.0, ((H100, 0.5),)),
    Kind(8, "7g.80gb", 4, 1.5, 43200.0),
    Kind(7, "1g.10gb", 2, 1.5, 7200.0),
)
"""Training and fine-tuning: whole GPUs, some several per pod, with some small helpers."""
MIXED: tuple[Kind, ...] = tuple(
    Kind(k.weight * share, k.profile, k.count, k.cores_per_slice, k.mean_s, k.pin)
    for table, share in ((INFERENCE, 3), (TRAINING, 2))
    for k in table
)
"""Three inference weights to two training weights."""


@dataclass(frozen=True, slots=True)
class Mix:
    """A trace's mix: ``start`` for every pod (steady), or ``start`` blending into ``end``."""

    start: tuple[Kind, ...]
    end: tuple[Kind, ...] | None = None


MIXES: dict[str, Mix] = {
    "steady-inference": Mix(INFERENCE),
    "steady-mixed": Mix(MIXED),
    "steady-training": Mix(TRAINING),
    "shift-to-training": Mix(INFERENCE, TRAINING),
    "shift-to-inference": Mix(TRAINING, INFERENCE),
}
"""The mixes by name."""

HEADER = ("name", "arrival", "duration", "requests", "node_selector")
MEAN_GAP_S = 60.0
"""Mean time between arrivals (Poisson)."""


def _draw(rng: random.Random, mix: Mix, position: float) -> Kind:
    """A kind drawn from ``mix`` at ``position`` (0 first pod, 1 last) of the trace."""
    if mix.end is None:
        return rng.choices(mix.start, [k.weight for k in mix.start])[0]
    table = mix.start if rng.random() >= position else mix.end
    return rng.choices(table, [k.weight for k in table])[0]


def _pin(rng: random.Random, kind: Kind) -> str:
    roll = rng.random()
    for product, share in kind.pin:
        if roll < share:
            return f"nvidia.com/gpu.product={product}"
        roll -= share
    return ""


def generate(mix: str, *, seed: int, pods: int = 400) -> str:
    """The MIG-native CSV text of ``pods`` pods drawn from the mix named ``mix``, seeded."""
    chosen = MIXES.get(mix)
    if chosen is None:
        raise errors.TraceError(f"unknown MIG-native mix {mix!r} (known: {', '.join(MIXES)})")
    if pods < 1:
        raise errors.TraceError(f"a MIG-native trace needs at least one pod, got {pods}")
    rng = random.Random(seed)
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(HEADER)
    width = len(str(pods - 1))
    now = 0.0
    for i in range(pods):
        kind = _draw(rng, chosen, i / max(pods - 1, 1))
        now += rng.expovariate(1.0 / MEAN_GAP_S)
        slices = _SLICES[kind.profile] * kind.count
        cores = max(1, round(kind.cores_per_slice * slices))
        memory = _MEM_GIB[kind.profile] * kind.count
        requests = f"mig-{kind.profile}={kind.count};cpu={cores};memory={memory}Gi"
        duration = round(rng.expovariate(1.0 / kind.mean_s), 3)
        writer.writerow(
            (f"{mix}-{i:0{width}d}", f"{now:.3f}", f"{duration:.3f}", requests, _pin(rng, kind))
        )
    return out.getvalue()
