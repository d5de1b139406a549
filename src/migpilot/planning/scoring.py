"""Node and GPU policies (binpack, spread) and the use scores they rank candidates by.

Why it exists: HAMi lets a pod choose, per node and per GPU, whether to fill what is already used
(``binpack``) or to prefer what is least used (``spread``), with cluster-wide defaults of binpack
for nodes and spread for GPUs. migpilot accepts the same choices (``hami.io/node-scheduler-policy``
and ``hami.io/gpu-scheduler-policy``, or the snapshot's defaults) and its planners break ties
between options that are equally good on the objective (:mod:`migpilot.planning.objective`) by
these scores, so a policy never costs a pod placed, an instance destroyed or free room lost.

One score per node and one per GPU, each a weighted sum of shares in use (0 to 1 each), with
:class:`Weights` (all 1 by default, as HAMi weighs its three terms alike):

- **GPU memory**: memory slots held by instances in use or given to pods (MIG hands out memory in
  slots), over the slots of the GPU (or of all the node's GPUs);
- **compute slices**: compute slices held, over the GPU's (or the node's);
- **CPU** and **memory** (nodes only): what is taken over the node's capacity
  (:attr:`migpilot.planning.snapshot.Node.capacity`, else the CPU and memory free at the
  snapshot, so only the plan's own pods count).

Binpack takes the highest use first, spread the lowest; remaining ties go to node order, then GPU
index. Pure: imports nothing but the standard library, so every planning module may use it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Policy(enum.StrEnum):
    """How to choose among nodes (or GPUs of a node) that are otherwise equally good."""

    BINPACK = "binpack"
    """Fill what already runs work first (the default for nodes): whole nodes stay free."""
    SPREAD = "spread"
    """Prefer the least used (the default for GPUs): a failure hits fewer pods."""


DEFAULT_NODE_POLICY = Policy.BINPACK
"""HAMi's chart default for nodes (``scheduler.defaultSchedulerPolicy.nodeSchedulerPolicy``)."""
DEFAULT_GPU_POLICY = Policy.SPREAD
"""HAMi's chart default for GPUs (``scheduler.defaultSchedulerPolicy.gpuSchedulerPolicy``)."""


@dataclass(frozen=True, slots=True)
class Weights:
    """How much each share in use counts in a score."""

    gpu_memory: float = 1.0
    """GPU memory: memory slots held over slots. Default 1."""
    compute: float = 1.0
    """Compute slices held over compute slices. Default 1."""
    cpu: float = 1.0
    """Nodes only: CPU taken over capacity. Default 1."""
    memory: float = 1.0
    """Nodes only: memory taken over capacity. Default 1."""


WEIGHTS = Weights()
"""The weights the planners use."""


def _share(used: int, total: int) -> float:
    return used / total if total > 0 else 0.0


def gpu_use(
    *, slots_held: int, slots: int, slices_held: int, slices: int, weights: Weights = WEIGHTS
) -> float:
    """A GPU's (or a node's GPUs') use: weighted shares of memory slots and compute slices held."""
    return weights.gpu_memory * _share(slots_held, slots) + weights.compute * _share(
        slices_held, slices
    )


def node_use(
    *,
    gpus: float,
    cpu_taken: int,
    cpu: int,
    memory_taken: int,
    memory: int,
    weights: Weights = WEIGHTS,
) -> float:
    """A node's use: its GPUs' :func:`gpu_use` plus weighted shares of CPU and memory taken."""
    return (
        gpus + weights.cpu * _share(cpu_taken, cpu) + weights.memory * _share(memory_taken, memory)
    )


def rank(policy: Policy, use: float) -> float:
    """Sort key of a candidate under ``policy`` (smaller first): binpack the most used first."""
    return -use if policy is Policy.BINPACK else use
