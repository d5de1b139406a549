"""How much of the GPUs is held, and how scattered what is free is: allocation and fragmentation.

Why it exists: the controller exports both, for the whole cluster and per node and GPU model,
and the numbers must mean one thing everywhere. One definition, here, in compute slices of MIG
instances:

- **allocation**: slices of instances in use or reserved, over all slices of the planned GPUs;
- **fragmentation**: free slices on GPUs that also hold an instance in use or reserved, over
  all free slices. Free capacity on a GPU that is partly held cannot take the GPU's largest
  profile, so the higher this share, the less room large requests find.

A GPU of a node in mode ``mps`` or ``time-slicing`` has no MIG instances and counts as free.

For autoscalers, what is free and what is wanted, by GPU model and profile: the free MIG
instances, MPS slices and time-slicing replicas (:func:`free_instances`), and what the pods a
plan could not place would take on a new node of each model (:func:`unmet_demand`).

Pure: the standard library and the planning core.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from migpilot.mig import profiles
from migpilot.planning import control, modes, snapshot


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


# --------------------------------------------------------------------------- demand

Demand = Mapping[tuple[str, str], int]
"""(GPU model id, profile) -> a count of instances; a profile is a MIG profile (``1g.10gb``),
an MPS slice (``mps-<N>gb``) or a time-slicing replica (:data:`REPLICA_PROFILE`)."""

REPLICA_PROFILE = "replica"
"""The profile of a time-slicing replica (one share of a whole GPU), as the agent's
``migpilot_instances`` names it too."""


def slice_profile(memory_gb: int) -> str:
    """The profile name of an MPS slice of ``memory_gb`` GB (``mps-20gb``)."""
    return f"mps-{memory_gb}gb"


def free_instances(nodes: Iterable[snapshot.Node]) -> Demand:
    """The free MIG instances, MPS slices and time-slicing replicas of the planned nodes, by GPU
    model and profile: made (advertised), and neither in use, reserved nor being made for a pod
    (the snapshot's *used*; a replica bound pods take counts as used)."""
    out: dict[tuple[str, str], int] = {}
    for node in nodes:
        for gpu in node.gpus:
            for inst in gpu.instances:
                if not inst.used:
                    key = (gpu.model.id, inst.profile)
                    out[key] = out.get(key, 0) + 1
            for sl in gpu.mps:
                if not sl.used:
                    key = (gpu.model.id, slice_profile(sl.memory_gb))
                    out[key] = out.get(key, 0) + 1
            if gpu.replicas > gpu.replicas_used:
                key = (gpu.model.id, REPLICA_PROFILE)
                out[key] = out.get(key, 0) + gpu.replicas - gpu.replicas_used
    return out


def unmet_demand(nodes: Iterable[snapshot.Node], pods: Iterable[snapshot.Pod]) -> Demand:
    """What ``pods`` (the pods a plan could not place now) want, by GPU model and profile: for
    each GPU model of the planned nodes, in each mode those nodes run, the instances (or MPS
    slices) the pod would take on a new node of that model, if one could hold it.

    A pod counts once under every model that could serve it: the figure per model is what
    nodes of that model would have to add, so the models' figures do not add up across
    models. A pod no node of any model could hold (it can never run) counts nowhere."""
    shapes: dict[tuple[profiles.GpuModel, modes.Mode], int] = {}
    for node in nodes:
        per_model: dict[profiles.GpuModel, int] = {}
        for gpu in node.gpus:
            per_model[gpu.model] = per_model.get(gpu.model, 0) + 1
        for model, count in per_model.items():
            shape = (model, node.mode)
            shapes[shape] = max(shapes.get(shape, 0), count)
    out: dict[tuple[str, str], int] = {}
    for pod in pods:
        for (model, mode), gpus in sorted(shapes.items(), key=lambda kv: (kv[0][0].id, kv[0][1])):
            if not pod.served_in(mode):
                continue
            wanted = _wanted(pod, model, mode, gpus)
            for name in wanted or ():
                key = (model.id, name)
                out[key] = out.get(key, 0) + 1
    return out


def _wanted(
    pod: snapshot.Pod, model: profiles.GpuModel, mode: modes.Mode, gpus: int
) -> tuple[str, ...] | None:
    """The profiles ``pod`` would take on an empty node of ``gpus`` GPUs of ``model`` in
    ``mode``, ``None`` when no such node could hold it."""
    if mode is modes.Mode.MIG:
        names = pod.profiles_on(model)
        if names is None or not control.fits_empty(names, model, gpus):
            return None
        return names
    if mode is modes.Mode.MPS:
        needs = modes.mps_needs(pod.mps, pod.unified, model)
        if needs is None:
            return None
        return tuple(slice_profile(n.memory_gb) for n in needs)
    return None  # time-slicing replicas are the sharing config's, not made per pod
