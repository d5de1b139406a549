"""How much of the GPUs is held, and how scattered what is free is: allocation and fragmentation.

Why it exists: the controller exports both, for the whole cluster and per node and GPU model,
and the numbers must mean one thing everywhere. One definition, here, in compute slices of MIG
instances:

- **allocation**: slices of instances in use or reserved, over all slices of the planned GPUs;
- **fragmentation**: free slices on GPUs that also hold an instance in use or reserved, over
  all free slices. Free capacity on a GPU that is partly held cannot take the GPU's largest
  profile, so the higher this share, the less room large requests find.

A GPU of a node in mode ``mps`` or ``time-slicing`` has no MIG instances and counts as free.
Pure: standard library and the snapshot's types only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from migpilot.planning import snapshot


@dataclass(frozen=True, slots=True)
class Slices:
    """Compute slices of a set of GPUs."""

    total: int = 0
    """All the compute slices of the GPUs."""
    held: int = 0
    """Slices of instances in use or reserved."""
    scattered: int = 0
    """Free slices on GPUs that also hold some."""

    def __add__(self, other: Slices) -> Slices:
        return Slices(
            self.total + other.total, self.held + other.held, self.scattered + other.scattered
        )

    @property
    def allocation(self) -> float:
        """Held slices over all slices (0 without GPUs)."""
        return self.held / self.total if self.total else 0.0

    @property
    def fragmentation(self) -> float:
        """Free slices on partly held GPUs over all free slices (0 when none is free)."""
        free = self.total - self.held
        return self.scattered / free if free else 0.0


def of_gpu(gpu: snapshot.Gpu) -> Slices:
    """One GPU's slices."""
    total = gpu.model.compute_slices
    held = sum(gpu.model.profile_named(i.profile).compute_slices for i in gpu.instances if i.used)
    return Slices(total=total, held=held, scattered=total - held if held else 0)


def total(slices: Iterable[Slices]) -> Slices:
    """The sum of several."""
    out = Slices()
    for s in slices:
        out = out + s
    return out


def by_node_and_model(nodes: Iterable[snapshot.Node]) -> Mapping[tuple[str, str], Slices]:
    """Per (node name, GPU model id): its GPUs' slices, in node then model order."""
    out: dict[tuple[str, str], Slices] = {}
    for node in nodes:
        for gpu in node.gpus:
            key = (node.name, gpu.model.id)
            out[key] = out.get(key, Slices()) + of_gpu(gpu)
    return out
