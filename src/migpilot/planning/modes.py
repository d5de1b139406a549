"""How a node shares its GPUs (MIG, MPS, time-slicing or not at all), and what each mode serves.

Why it exists: MIG has seven slices of fixed sizes; many small inference pods want finer or
different sharing. A node's label ``migpilot.io/mode`` picks one mode for all its GPUs:

- ``mig`` (the default): MIG instances, planned by the existing planners;
- ``mps``: the GPU runs an MPS control daemon and is cut into *memory slices* of any whole number
  of GB (nos's dynamic MPS partitioning): slices sum to at most the GPU's memory, at most
  :data:`migpilot.sharing.config.MPS_MAX_CLIENTS` per GPU; each client is held to its slice by
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` (and to its compute share by
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` where the request names one);
- ``time-slicing``: each GPU is advertised as ``replicas`` shares of the whole GPU, no isolation;
- ``none``: migpilot leaves the node's GPUs alone (never planned);
- ``dra``: the node's agent publishes its MIG placements as DRA devices (ResourceSlices of
  ``mig.migpilot.io``, ``docs/dra.md``) and kube-scheduler allocates them to ResourceClaims; no
  device-plugin resource is served there, so the planners leave it alone as they do ``none``.

Which pod each mode serves (:func:`serves`):

- ``nvidia.com/mig-<profile>``: only ``mig`` nodes;
- ``nvidia.com/gpu-<N>gb`` (nos's names, :func:`mps_request`): only ``mps`` nodes, one slice of
  ``N`` GB per unit asked;
- a unified request (``nvidia.com/gpu`` + ``gpumem``/``gpumem-percentage``/``gpucores``): ``mig``
  nodes (the smallest profile that serves it), ``mps`` nodes (a slice of its memory rounded up to
  whole GB, as nos rounds, with its ``gpucores`` as the slice's compute share; one slice per GPU
  asked, each on its own GPU; a container asking more than one GPU is not served there: a
  container talks to one MPS daemon, and each GPU has its own) and ``time-slicing`` nodes (one
  replica per GPU asked, each on its own GPU whose memory is at least the ask's: time-slicing
  enforces neither). Its ``nvidia.com/vgpu-mode`` narrows that, as HAMi's does: ``mig`` only
  ``mig`` nodes, ``mps`` only ``mps`` nodes.

Pure: no I/O, no clock. May import :mod:`migpilot.errors`, :mod:`migpilot.mig`,
:mod:`migpilot.sharing` (the MPS facts the GpuLayout's schema shares) and
:mod:`migpilot.planning.unified`; never the snapshot, which imports this module.
"""

from __future__ import annotations

import enum
import functools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.mig import profiles
from migpilot.planning import unified
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

MODE_LABEL = "migpilot.io/mode"
"""The node label that picks the mode (absent: ``mig``)."""
MIG_MODE_LABEL = "migpilot.io/mig-mode"
"""The node label that lets migpilot switch an idle GPU's MIG mode (``docs/migmode.md``)."""
DYNAMIC_MIG = "dynamic"
"""The :data:`MIG_MODE_LABEL` value that opts a node in; any other value, or none: never."""
MPS_RESOURCE_PREFIX = "nvidia.com/gpu-"
_MPS_RESOURCE = re.compile(r"^nvidia\.com/gpu-(?P<gb>[1-9][0-9]{0,4})gb$")
_MIB_PER_GB = 1024


class Mode(enum.StrEnum):
    """How a node shares its GPUs."""

    MIG = "mig"
    MPS = "mps"
    TIME_SLICING = "time-slicing"
    NONE = "none"
    DRA = "dra"


def parse_mode(value: Any, *, node: str) -> Mode:
    """A ``migpilot.io/mode`` label value; raise :class:`SnapshotError` naming the node."""
    try:
        return Mode(str(value))
    except ValueError:
        known = ", ".join(m.value for m in Mode)
        raise errors.SnapshotError(
            f"node {node}: label {MODE_LABEL}={value!r} is not one of {known}"
        ) from None


def node_mode(labels: Mapping[str, str], *, node: str) -> Mode:
    """The mode a node's labels pick (``mig`` when the label is absent)."""
    value = labels.get(MODE_LABEL)
    return Mode.MIG if value is None else parse_mode(value, node=node)


def dynamic_mig(labels: Mapping[str, str]) -> bool:
    """Whether a node's labels let migpilot switch its idle GPUs' MIG mode (opt-in: a GPU
    reset can disturb other users of the node)."""
    return labels.get(MIG_MODE_LABEL) == DYNAMIC_MIG


@dataclass(frozen=True, slots=True)
class MpsRequest:
    """``count`` MPS slices of ``memory_gb`` GB each (``nvidia.com/gpu-<N>gb: count``)."""

    memory_gb: int
    count: int

    @property
    def resource(self) -> str:
        """The resource name the pod asks for."""
        return f"{MPS_RESOURCE_PREFIX}{self.memory_gb}gb"


def is_mps_resource(name: str) -> bool:
    """Whether ``name`` is spelt as an MPS slice resource (``nvidia.com/gpu-...``)."""
    return name.startswith(MPS_RESOURCE_PREFIX)


def mps_gb(resource: str, *, where: str) -> int:
    """The slice size ``nvidia.com/gpu-<N>gb`` asks for; raise naming the field otherwise."""
    m = _MPS_RESOURCE.match(resource)
    if m is None:
        raise errors.SnapshotError(
            f"{where}: {resource} is not an MPS slice resource (expected "
            f"{MPS_RESOURCE_PREFIX}<N>gb, N a whole number of GB from 1: nvidia.com/gpu-10gb)"
        )
    return int(m["gb"])


@dataclass(frozen=True, slots=True)
class MpsSlice:
    """One MPS memory slice of a GPU: an MPS client's share."""

    id: int
    """Stable within its GPU (slices are created with the next free id)."""
    memory_gb: int
    cores: int | None = None
    """Compute share in percent (``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE``); ``None``: unlimited."""
    used: bool = False
    """Held by a running pod: never shrunk or removed."""
    reserved_for: str = ""
    """``namespace/name`` of the pod a plan reserved it for: never shrunk or removed either."""

    @property
    def taken(self) -> bool:
        """Used or reserved: the planner must keep it as it is."""
        return self.used or bool(self.reserved_for)


def slices_problem(model: profiles.GpuModel, slices: Sequence[MpsSlice]) -> str | None:
    """Why these slices cannot share one GPU of ``model`` (``None``: they can)."""
    total, cap = sum(s.memory_gb for s in slices), sharing_mps.memory_gb(model)
    if total > cap:
        return f"slices of {total} GB exceed the GPU's {cap} GB"
    most = sharing_config.MPS_MAX_CLIENTS
    if len(slices) > most:
        return f"{len(slices)} slices exceed the {most} MPS clients of one GPU"
    cores = sum(s.cores for s in slices if s.cores is not None)
    if cores > 100:
        return f"compute shares of {cores} % exceed 100 %"
    ids = [s.id for s in slices]
    if len(set(ids)) != len(ids):
        return "two slices share an id"
    if any(s.memory_gb < 1 for s in slices):
        return "a slice has less than 1 GB"
    return None


@dataclass(frozen=True, slots=True)
class SliceNeed:
    """One slice a pod needs on an MPS GPU, and the GPU group it must be distinct within."""

    memory_gb: int
    cores: int | None
    group: int
    """Needs of one group go on distinct GPUs (a container's GPUs); -1: no such rule."""


@functools.lru_cache(maxsize=4096)
def mps_needs(
    mps: tuple[MpsRequest, ...],
    request: unified.UnifiedRequest | None,
    model: profiles.GpuModel,
) -> tuple[SliceNeed, ...] | None:
    """The slices a pod needs on an MPS GPU of ``model``, ``None`` if that GPU cannot serve it."""
    cap = sharing_mps.memory_gb(model)
    out: list[SliceNeed] = []
    for r in mps:
        if r.memory_gb > cap:
            return None
        out.extend(SliceNeed(r.memory_gb, None, -1) for _ in range(r.count))
    if request is not None:
        if not unified.allowed(request, model) or unified.too_many_for_mps(request):
            return None
        for k, ask in enumerate(request.asks):
            gb = unified_gb(ask, model)
            if gb > cap:
                return None
            out.extend(SliceNeed(gb, ask.cores_percent, k) for _ in range(ask.count))
    return tuple(sorted(out, key=lambda n: (-n.memory_gb, n.group)))


@functools.lru_cache(maxsize=4096)
def unified_gb(ask: unified.GpuAsk, model: profiles.GpuModel) -> int:
    """The slice size (GB, rounded up) of one GPU of a unified ask on an MPS GPU of ``model``."""
    cap = sharing_mps.memory_gb(model)
    if ask.memory_mib is not None:
        return max(1, math.ceil(ask.memory_mib / _MIB_PER_GB))
    pct = 100 if ask.memory_percent is None else ask.memory_percent
    return max(1, math.ceil(pct * cap / 100))


@functools.lru_cache(maxsize=4096)
def replica_needs(
    request: unified.UnifiedRequest | None, model: profiles.GpuModel
) -> tuple[int, ...] | None:
    """Per container of a unified request, the replicas (on distinct GPUs) it needs on a
    time-slicing GPU of ``model``; ``None`` if such a GPU cannot serve the pod."""
    if request is None or not unified.allowed(request, model):
        return None
    cap = sharing_mps.memory_gb(model)
    for ask in request.asks:
        if unified_gb(ask, model) > cap:
            return None
    return tuple(a.count for a in request.asks)


def serves(
    mode: Mode, *, mig: bool, mps: bool, unified_request: bool, unified_mode: str | None = None
) -> bool:
    """Whether a node in ``mode`` may serve a pod asking MIG resources by name (``mig``), MPS
    slices by name (``mps``) or a unified request, whose ``nvidia.com/vgpu-mode`` is
    ``unified_mode`` (``mig``, ``mps``; ``None``: any)."""
    if mode is Mode.MIG:
        return not mps and unified_mode in (None, unified.MIG_MODE)
    if mode is Mode.MPS:
        return not mig and unified_mode in (None, unified.MPS_MODE)
    if mode is Mode.TIME_SLICING:
        return unified_request and not mig and not mps and unified_mode is None
    return False


def needed_mode(*, mig: bool, mps: bool, unified_mode: str | None = None) -> str:
    """The modes that serve a pod, as reasons write them (``mps``, ``mig``, ``mig, mps or
    time-slicing``)."""
    if mps:
        return Mode.MPS.value
    if mig:
        return Mode.MIG.value
    if unified_mode is not None:
        return f"{unified_mode} (its {unified.VGPU_MODE})"
    return "mig, mps or time-slicing"
