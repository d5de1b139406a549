"""Simulated clusters: the ``h100-80gb:8x8,a100-80gb:4x8`` spec and the nodes it stands for.

A spec is a comma-separated list of ``MODEL:NODESxGPUS`` groups (any catalog alias for the
model). Every node gets the CPU and memory per GPU of the openb trace's most common GPU node (8
GPUs, 96 cores, 384 GiB: 12 cores and 48 GiB per GPU) and the labels pods may select on:
``nvidia.com/gpu.product`` (as gpu-feature-discovery sets it) and ``kubernetes.io/hostname``.

A group may name how its nodes share their GPUs (:mod:`migpilot.planning.modes`):
``a100-80gb:4x8@mps``, ``h100-80gb:4x8@mig`` (the default), ``a100-40gb:2x8@time-slicing:4``
(4 replicas per GPU; :data:`DEFAULT_REPLICAS` when left out), ``...@none``. Nodes of a group in
another mode than mig are named ``<model>-<mode>-<i>`` and carry the label
``migpilot.io/mode``. ``h100-80gb:4x8@dynamic`` makes MIG nodes labelled
``migpilot.io/mig-mode=dynamic`` (named ``<model>-dynamic-<i>``): the plan may switch their idle
GPUs out of MIG for whole-GPU pods and back (``docs/migmode.md``).

Pure core: may import :mod:`migpilot.errors`, :mod:`migpilot.mig` and :mod:`migpilot.planning`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType

from migpilot import errors
from migpilot.mig import catalog, profiles
from migpilot.planning import modes, snapshot

DEFAULT_SPEC = "h100-80gb:8x8,a100-80gb:4x8"
"""The default cluster (inflate mode): 96 GPUs of two models."""
DEFAULT_FAITHFUL_SPEC = "h100-80gb:4x8,a100-80gb:2x8"
"""The default cluster in faithful mode: 48 GPUs, which the openb default trace keeps busy
(its pods ask for about 65 GPUs at its peak, more once rounded up to MIG profiles)."""
CPU_MILLI_PER_GPU = 12_000
MEMORY_PER_GPU = 48 * 2**30
PRODUCT_LABEL = "nvidia.com/gpu.product"
HOSTNAME_LABEL = "kubernetes.io/hostname"
DEFAULT_REPLICAS = 4
"""Time-slicing replicas per GPU when a group names none."""
_GROUP = re.compile(
    r"^(?P<model>[^:@]+):(?P<nodes>[0-9]+)x(?P<gpus>[0-9]+)"
    r"(?:@(?P<mode>[^:]+)(?::(?P<replicas>[0-9]+))?)?$"
)


@dataclass(frozen=True, slots=True)
class Group:
    """Identical nodes: ``nodes`` nodes of ``gpus`` GPUs of one model."""

    model: profiles.GpuModel
    nodes: int
    gpus: int
    mode: modes.Mode = modes.Mode.MIG
    replicas: int = 0
    """Time-slicing replicas per GPU (0 in other modes)."""
    dynamic: bool = False
    """MIG nodes whose idle GPUs' MIG mode may be switched (``@dynamic``)."""


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """One node of the cluster as it starts."""

    name: str
    model: profiles.GpuModel
    gpus: int
    labels: MappingProxyType[str, str]
    allocatable: snapshot.Resources
    mode: modes.Mode = modes.Mode.MIG
    replicas: int = 0
    """Time-slicing replicas per GPU (0 in other modes)."""
    dynamic: bool = False
    """Labelled ``migpilot.io/mig-mode=dynamic`` (:attr:`Group.dynamic`)."""


@dataclass(frozen=True, slots=True)
class Cluster:
    """The simulated cluster."""

    spec: str
    groups: tuple[Group, ...]
    nodes: tuple[NodeSpec, ...]

    @property
    def gpu_count(self) -> int:
        """GPUs in the cluster."""
        return sum(n.gpus for n in self.nodes)

    @property
    def compute_slices(self) -> int:
        """Compute slices of all GPUs together (the allocation ratio's denominator)."""
        return sum(n.gpus * n.model.compute_slices for n in self.nodes)

    @property
    def reference_model(self) -> profiles.GpuModel:
        """The model trace pods' GPU shares are mapped on (the first group's)."""
        return self.groups[0].model


def parse(spec: str) -> Cluster:
    """Parse ``MODEL:NODESxGPUS[,...]``; raise :class:`ClusterSpecError` naming the bad group."""
    groups: list[Group] = []
    for raw in spec.split(","):
        text = raw.strip()
        m = _GROUP.match(text)
        if m is None:
            raise errors.ClusterSpecError(
                f"cluster: {text!r} is not MODEL:NODESxGPUS[@MODE] (like h100-80gb:8x8 or "
                "a100-80gb:4x8@mps)"
            )
        try:
            model = catalog.resolve_gpu(m["model"])
        except errors.UnknownGpuError as e:
            raise errors.ClusterSpecError(f"cluster: {e}") from None
        nodes, gpus = int(m["nodes"]), int(m["gpus"])
        if nodes < 1 or gpus < 1:
            raise errors.ClusterSpecError(f"cluster: {text!r} needs at least one node and one GPU")
        mode = modes.Mode.MIG
        dynamic = m["mode"] == modes.DYNAMIC_MIG
        if m["mode"] is not None and not dynamic:
            try:
                mode = modes.Mode(m["mode"])
            except ValueError:
                known = ", ".join([*(x.value for x in modes.Mode), modes.DYNAMIC_MIG])
                raise errors.ClusterSpecError(
                    f"cluster: {text!r}: mode {m['mode']!r} is not one of {known}"
                ) from None
        if m["replicas"] is not None and mode is not modes.Mode.TIME_SLICING:
            raise errors.ClusterSpecError(
                f"cluster: {text!r}: only mode time-slicing takes replicas (@time-slicing:N)"
            )
        replicas = 0
        if mode is modes.Mode.TIME_SLICING:
            replicas = int(m["replicas"]) if m["replicas"] is not None else DEFAULT_REPLICAS
            if replicas < 1:
                raise errors.ClusterSpecError(f"cluster: {text!r}: replicas must be at least 1")
        groups.append(Group(model, nodes, gpus, mode, replicas, dynamic))
    out: list[NodeSpec] = []
    for g in groups:
        label = g.model.gfd_product_names[0] if g.model.gfd_product_names else g.model.id
        width = max(len(str(g.nodes - 1)), 2)
        stem = g.model.id if g.mode is modes.Mode.MIG else f"{g.model.id}-{g.mode.value}"
        if g.dynamic:
            stem = f"{g.model.id}-{modes.DYNAMIC_MIG}"
        for i in range(g.nodes):
            name = f"{stem}-{i:0{width}d}"
            labels = {PRODUCT_LABEL: label, HOSTNAME_LABEL: name}
            if g.mode is not modes.Mode.MIG:
                labels[modes.MODE_LABEL] = g.mode.value
            if g.dynamic:
                labels[modes.MIG_MODE_LABEL] = modes.DYNAMIC_MIG
            out.append(
                NodeSpec(
                    name=name,
                    model=g.model,
                    gpus=g.gpus,
                    labels=MappingProxyType(labels),
                    allocatable=snapshot.Resources(
                        g.gpus * CPU_MILLI_PER_GPU, g.gpus * MEMORY_PER_GPU
                    ),
                    mode=g.mode,
                    replicas=g.replicas,
                    dynamic=g.dynamic,
                )
            )
    names = [n.name for n in out]
    if len(set(names)) != len(names):
        raise errors.ClusterSpecError(f"cluster: {spec!r} names a GPU model twice in one mode")
    return Cluster(spec=spec, groups=tuple(groups), nodes=tuple(out))
