"""HAMi-style GPU requests (``nvidia.com/gpu`` with ``gpumem``/``gpucores``) read and turned into
MIG profiles per GPU model.

Why it exists: many users do not want to know MIG profile names, which differ per GPU model (a
10 GB slice is ``1g.10gb`` on an H100-80GB, ``1g.12gb`` on an H100 NVL, ``1g.18gb`` on an H200).
HAMi lets a pod ask ``nvidia.com/gpu: 1`` with ``nvidia.com/gpumem: 8000`` (MiB) and picks the
slice. This module is the pure half of accepting the same pod specs: :func:`parse` reads a pod's
requests and annotations into a :class:`UnifiedRequest`, refusing bad input with one line that
names the field; :func:`resolve` gives, for one GPU model, the MIG instances that serve it:
``N`` instances of the smallest profile (by memory, then compute) whose memory and compute
satisfy the request, on a model the pod's filters allow, or ``None``.

The rules, as HAMi's documentation gives them where it gives one:

- per container ``nvidia.com/gpu: N`` (N GPUs), with ``nvidia.com/gpumem: MiB`` or
  ``nvidia.com/gpumem-percentage: 1-100`` (of the GPU's memory slices), optional
  ``nvidia.com/gpucores: 1-100`` (a share of the GPU's compute, here its compute slices,
  rounded up); a pod's containers add up (each container's GPUs are its own instances);
- amounts are Kubernetes quantities that must be whole numbers (``8000``, or ``8k`` as the
  apiserver writes 8000 back: it canonicalises quantities before a webhook or a controller
  sees them);
- annotations ``nvidia.com/use-gputype`` / ``nvidia.com/nouse-gputype``: comma-separated
  filters, each matching a GPU model whose id or product name contains it (case-insensitive,
  as HAMi matches device types). A filter that matches no model migpilot knows is kept and
  matches nothing (HAMi's own example, ``use-gputype: "A100,V100"``, names a GPU without MIG);
  :func:`unknown_filters` lists them, :func:`never_served` says when the filters leave no
  model at all. ``nvidia.com/vgpu-mode`` picks how the pod is served, as HAMi's does: ``mig``
  (MIG instances only), ``mps`` (an MPS memory slice only, on a node in mode ``mps``), absent
  (either, whichever the planner finds; HAMi too may then pick any mode); any other value
  (``hami-core``) names another system's mode, and the pod is left to it;
  ``hami.io/node-scheduler-policy`` / ``hami.io/gpu-scheduler-policy``: ``binpack`` or
  ``spread``;
- a pod is *unified* (:func:`is_unified`) when some container asks for ``nvidia.com/gpumem``,
  ``gpumem-percentage`` or ``gpucores``, or it carries ``nvidia.com/vgpu-mode: mig`` or
  ``mps``; a pod
  asking only ``nvidia.com/gpu`` is a whole-GPU request for NVIDIA's device plugin;
- a container asking ``nvidia.com/gpu`` without ``gpumem`` or ``gpumem-percentage`` gets the
  whole GPU's memory: HAMi's ``GenerateResourceRequests`` falls back to its ``defaultMemory``
  setting, which its chart sets to 0, meaning ``gpumem-percentage: 100``
  (hami:pkg/device/nvidia/device.go, hami:charts/hami/templates/scheduler/device-configmap.yaml);
- "GPU memory" of a model is its largest profile's memory (what MIG can hand to one instance);
  only profiles without an attribute (no ``+me`` and the like) are chosen, so a unified request
  never takes a GPU's one media-extension slot.

The snapshot (:mod:`migpilot.planning.snapshot`) holds a pod's :class:`UnifiedRequest` and
resolves it per model with :func:`resolve`; the planners place it like any MIG request, and
:func:`serves` says which instances a pod may be given (the validator's rule).

The admission webhook gates and validates unified pods with it (``webhook/``), the agent
tells unified pods with :func:`is_unified`.

Pure: no I/O, no clock. May import :mod:`migpilot.mig`, :mod:`migpilot.planning.scoring`,
:mod:`migpilot.planning.quantities` and :mod:`migpilot.errors`; never the snapshot, which
imports this module.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.mig import catalog, profiles
from migpilot.planning import quantities, scoring

GPU = "nvidia.com/gpu"
GPUMEM = "nvidia.com/gpumem"
GPUMEM_PERCENT = "nvidia.com/gpumem-percentage"
GPUCORES = "nvidia.com/gpucores"
USE_TYPE = "nvidia.com/use-gputype"
NOUSE_TYPE = "nvidia.com/nouse-gputype"
VGPU_MODE = "nvidia.com/vgpu-mode"
NODE_POLICY = "hami.io/node-scheduler-policy"
GPU_POLICY = "hami.io/gpu-scheduler-policy"
MIG_MODE = "mig"
MPS_MODE = "mps"
SERVED_MODES = (MIG_MODE, MPS_MODE)
"""The ``nvidia.com/vgpu-mode`` values migpilot serves."""
UNIFIED_RESOURCES = (GPUMEM, GPUMEM_PERCENT, GPUCORES)
MOST_GPUS = 1024
"""The most ``nvidia.com/gpu`` a unified container may ask for: more than any node holds (an
HGX node has 8 or 16), so a larger count is refused as a mistake, never planned."""
"""The resources that make a container's ``nvidia.com/gpu`` a unified request."""
_LARGEST = 10**18
"""Amounts this large or larger are refused, not converted (they fit nothing anyway)."""


@dataclass(frozen=True, slots=True)
class GpuAsk:
    """What one container asks of each of its GPUs."""

    count: int
    """GPUs (MIG instances) asked for."""
    memory_mib: int | None = None
    """``nvidia.com/gpumem``, MiB per GPU."""
    memory_percent: int | None = None
    """``nvidia.com/gpumem-percentage`` (1-100); 100 when neither memory field is given."""
    cores_percent: int | None = None
    """``nvidia.com/gpucores`` (1-100), a share of the GPU's compute slices; ``None``: any."""

    def text(self) -> str:
        """The ask as a pod spec writes it: ``gpu 2, gpumem 8000``."""
        parts = [f"gpu {self.count}"]
        if self.memory_mib is not None:
            parts.append(f"gpumem {self.memory_mib}")
        if self.memory_percent is not None:
            parts.append(f"gpumem-percentage {self.memory_percent}")
        if self.cores_percent is not None:
            parts.append(f"gpucores {self.cores_percent}")
        return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class UnifiedRequest:
    """A pod's HAMi-style request."""

    asks: tuple[GpuAsk, ...]
    """One per container that asks for ``nvidia.com/gpu``."""
    use_models: tuple[str, ...] = ()
    """Filters a model must match one of (empty: any)."""
    nouse_models: tuple[str, ...] = ()
    """Filters a model must match none of."""
    mode: str | None = None
    """``nvidia.com/vgpu-mode``: :data:`MIG_MODE` (MIG instances only), :data:`MPS_MODE` (MPS
    slices only); ``None``: either."""

    @property
    def count(self) -> int:
        """MIG instances asked for in all."""
        return sum(a.count for a in self.asks)

    def text(self) -> str:
        """The request as a pod spec writes it, containers joined by ``+``, filters after."""
        out = " + ".join(f"({a.text()})" if len(self.asks) > 1 else a.text() for a in self.asks)
        if self.use_models:
            out += f"; use {','.join(self.use_models)}"
        if self.nouse_models:
            out += f"; not {','.join(self.nouse_models)}"
        if self.mode is not None:
            out += f"; mode {self.mode}"
        return out


def _whole(value: Any, where: str, *, low: int, high: int | None = None) -> int:
    """A whole-number quantity (``8000``, ``"8000"``, ``"8k"``) within ``low``..``high``."""
    number = None
    if not isinstance(value, bool) and isinstance(value, int | float | str):
        try:
            quantity = quantities.parse_quantity(value, where=where)
        except quantities.TooLargeError:
            raise errors.SnapshotError(f"{where}: {_shown(value)} is too large") from None
        except errors.SnapshotError:
            quantity = None
        if quantity is not None and quantity >= _LARGEST:
            raise errors.SnapshotError(f"{where}: {_shown(value)} is too large")
        if quantity is not None and quantity == int(quantity):
            number = int(quantity)
    if number is None:
        raise errors.SnapshotError(f"{where}: expected a whole number, got {_shown(value)}")
    if high is None and number < low:
        raise errors.SnapshotError(f"{where}: {number} is less than {low}")
    if high is not None and not low <= number <= high:
        raise errors.SnapshotError(f"{where}: {number} is outside {low} to {high}")
    return number


def _shown(value: Any) -> str:
    """``value`` for a message, cut short: it may come from anyone creating a pod."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def _filters(text: Any) -> tuple[str, ...]:
    if text is None:
        return ()
    return tuple(f.strip() for f in str(text).split(",") if f.strip())


def _policy(text: Any, where: str) -> scoring.Policy | None:
    if text is None:
        return None
    try:
        return scoring.Policy(str(text).strip())
    except ValueError:
        raise errors.SnapshotError(f"{where}: {text!r} is not binpack or spread") from None


def parse_policies(
    annotations: Mapping[str, Any], *, where: str = "pod"
) -> tuple[scoring.Policy | None, scoring.Policy | None]:
    """A pod's node and GPU policies from ``hami.io/node-scheduler-policy`` and
    ``hami.io/gpu-scheduler-policy`` (``None``: the cluster's default)."""
    return (
        _policy(annotations.get(NODE_POLICY), f"{where}.annotations[{NODE_POLICY}]"),
        _policy(annotations.get(GPU_POLICY), f"{where}.annotations[{GPU_POLICY}]"),
    )


def parse_container(resources: Mapping[str, Any], *, where: str) -> GpuAsk | None:
    """One container's ``nvidia.com/gpu*`` resources (limits standing in for requests), or
    ``None`` when it asks for no GPU. Raises :class:`SnapshotError` naming the field."""
    gpus = resources.get(GPU)
    mem = resources.get(GPUMEM)
    pct = resources.get(GPUMEM_PERCENT)
    cores = resources.get(GPUCORES)
    if gpus is None:
        for name, value in ((GPUMEM, mem), (GPUMEM_PERCENT, pct), (GPUCORES, cores)):
            if value is not None:
                raise errors.SnapshotError(f"{where}.{name}: needs {GPU} in the same container")
        return None
    count = _whole(gpus, f"{where}.{GPU}", low=0)
    if count == 0:
        return None
    if count > MOST_GPUS:
        # A pod runs on one node: such an ask is a typo (``8Gi``), not a wait for a bigger node.
        raise errors.SnapshotError(
            f"{where}.{GPU}: {count} GPUs is more than any node holds (at most {MOST_GPUS})"
        )
    if mem is not None and pct is not None:
        raise errors.SnapshotError(f"{where}: give {GPUMEM} or {GPUMEM_PERCENT}, not both")
    if mem is None and pct is None:
        pct = 100  # HAMi's default: the whole GPU's memory (see the module docstring)
    return GpuAsk(
        count=count,
        memory_mib=_whole(mem, f"{where}.{GPUMEM}", low=1) if mem is not None else None,
        memory_percent=_whole(pct, f"{where}.{GPUMEM_PERCENT}", low=1, high=100)
        if pct is not None
        else None,
        cores_percent=_whole(cores, f"{where}.{GPUCORES}", low=1, high=100)
        if cores is not None
        else None,
    )


def request_mode(annotations: Mapping[str, Any]) -> str | None:
    """The pod's ``nvidia.com/vgpu-mode`` as written (trimmed, lower case), ``None`` if absent."""
    mode = annotations.get(VGPU_MODE)
    return None if mode is None else str(mode).strip().lower()


def serves_mode(annotations: Mapping[str, Any]) -> bool:
    """Whether the pod's ``nvidia.com/vgpu-mode`` (absent, ``mig`` or ``mps``) is one migpilot
    serves."""
    mode = request_mode(annotations)
    return mode is None or mode in SERVED_MODES


def other_mode(
    containers: Sequence[Mapping[str, Any]], annotations: Mapping[str, Any]
) -> str | None:
    """The ``nvidia.com/vgpu-mode`` of a pod that asks for ``nvidia.com/gpu`` (or HAMi's other
    resources) in a mode migpilot does not serve (``hami-core``): another system's pod,
    declined (not gated, not planned, told so). ``None`` for every other pod."""
    if serves_mode(annotations):
        return None
    if not any(name in res for res in containers for name in (GPU, *UNIFIED_RESOURCES)):
        return None
    return str(annotations.get(VGPU_MODE, "")).strip()


def is_unified(containers: Sequence[Mapping[str, Any]], annotations: Mapping[str, Any]) -> bool:
    """Whether migpilot serves the pod's ``nvidia.com/gpu`` requests: some container (its
    resources, as in :func:`parse`) asks for one of :data:`UNIFIED_RESOURCES`, or the pod
    carries ``nvidia.com/vgpu-mode: mig`` or ``mps``. Never for a pod whose mode names another
    system."""
    if not serves_mode(annotations):
        return False
    if VGPU_MODE in annotations:
        return True
    return any(name in res for res in containers for name in UNIFIED_RESOURCES)


def parse_annotations(annotations: Mapping[str, Any], *, where: str) -> UnifiedRequest:
    """The pod-level half of a unified request (its model filters, ``asks`` empty), from the
    pod's annotations at ``where`` (``metadata``, say), with its policies checked. Raises
    :class:`SnapshotError` naming the annotation."""
    parse_policies(annotations, where=where)
    return UnifiedRequest(
        asks=(),
        use_models=_filters(annotations.get(USE_TYPE)),
        nouse_models=_filters(annotations.get(NOUSE_TYPE)),
        mode=request_mode(annotations) if serves_mode(annotations) else None,
    )


def parse(
    containers: Sequence[Mapping[str, Any]],
    annotations: Mapping[str, Any],
    *,
    where: str = "pod",
    wheres: Sequence[str] | None = None,
) -> UnifiedRequest | None:
    """A pod's unified request from its containers' resources (each a resource -> quantity
    mapping) and its annotations; ``None`` when no container asks for ``nvidia.com/gpu``.
    Errors name ``{where}.containers[i]``, or ``wheres[i]`` when given (one per container).

    A ``nvidia.com/vgpu-mode`` other than ``mig`` or ``mps`` is refused (another system serves
    it)."""
    places = (
        wheres
        if wheres is not None
        else [f"{where}.containers[{i}]" for i in range(len(containers))]
    )
    return parse_labelled(list(zip(places, containers, strict=True)), annotations, where=where)


def parse_labelled(
    containers: Sequence[tuple[str, Mapping[str, Any]]],
    annotations: Mapping[str, Any],
    *,
    where: str,
) -> UnifiedRequest | None:
    """:func:`parse` with each container's place in errors given (``where`` names the pod)."""
    asks = tuple(
        ask for at, res in containers if (ask := parse_container(res, where=at)) is not None
    )
    if not asks:
        return None
    if not serves_mode(annotations):
        raise errors.SnapshotError(
            f"{where}: {VGPU_MODE}={annotations[VGPU_MODE]!r} is not served by migpilot "
            f"(it serves {MIG_MODE!r} and {MPS_MODE!r})"
        )
    return dataclasses.replace(parse_annotations(annotations, where=where), asks=asks)


def too_many_for_mps(request: UnifiedRequest) -> bool:
    """Whether a container of ``request`` asks for more than one GPU, which MPS slices never
    serve: a container talks to one MPS daemon through one pipe folder, and migpilot runs one
    daemon per GPU."""
    return any(a.count > 1 for a in request.asks)


def _matches(model: profiles.GpuModel, text: str) -> bool:
    needle = text.lower()
    return any(needle in name.lower() for name in (model.id, *model.product_names))


def unknown_filters(request: UnifiedRequest) -> tuple[str, ...]:
    """The request's model filters that match no GPU model migpilot knows (they select
    nothing: a ``nouse`` one excludes nothing, a ``use`` one adds no model)."""
    return tuple(
        f
        for f in (*request.use_models, *request.nouse_models)
        if not any(_matches(m, f) for m in catalog.gpu_models())
    )


def allowed(request: UnifiedRequest, model: profiles.GpuModel) -> bool:
    """Whether the pod's model filters allow ``model``."""
    if request.use_models and not any(_matches(model, f) for f in request.use_models):
        return False
    return not any(_matches(model, f) for f in request.nouse_models)


def memory_mib(model: profiles.GpuModel) -> int:
    """A model's GPU memory as MIG can hand it out: its largest profile's memory."""
    return max((p.memory_mib or 0) for p in model.profiles)


def need(ask: GpuAsk, model: profiles.GpuModel) -> tuple[int, int, int]:
    """What one GPU of ``ask`` needs on ``model``: (memory MiB, memory slots, compute slices).

    A share of memory (``gpumem-percentage``) is a share of the GPU's memory *slices*, as a
    share of compute (``gpucores``) is one of its compute slices: half an A100-80GB is the four
    slices of a 3g.40gb, although its 40,192 MiB are a little under half the 80,640 MiB of the
    7g.80gb (MIG keeps some memory for itself in every instance)."""
    need_mem = ask.memory_mib or 0
    need_slots = (
        math.ceil(ask.memory_percent * model.memory_slots / 100)
        if ask.memory_percent is not None
        else 0
    )
    need_slices = (
        math.ceil(ask.cores_percent * model.compute_slices / 100)
        if ask.cores_percent is not None
        else 0
    )
    return need_mem, need_slots, need_slices


def serves(ask: GpuAsk, model: profiles.GpuModel, profile: profiles.Profile) -> bool:
    """Whether an instance of ``profile`` (on ``model``) serves one GPU of ``ask``: a plain
    profile with at least the memory and compute slices asked (the filters are the request's)."""
    need_mem, need_slots, need_slices = need(ask, model)
    return (
        profile.attribute is profiles.Attribute.NONE
        and (profile.memory_mib or 0) >= need_mem
        and profile.memory_slots >= need_slots
        and profile.compute_slices >= need_slices
    )


@functools.lru_cache(maxsize=4096)
def profile_for(ask: GpuAsk, model: profiles.GpuModel) -> str | None:
    """The smallest plain profile of ``model`` (by memory, then compute) that serves ``ask``."""
    fitting = [p for p in model.profiles if serves(ask, model, p)]
    if not fitting:
        return None
    best = min(fitting, key=lambda p: ((p.memory_mib or 0), p.compute_slices, p.name))
    return best.name


@functools.lru_cache(maxsize=16384)
def resolve(request: UnifiedRequest, model: profiles.GpuModel) -> tuple[str, ...] | None:
    """The MIG instances (profile names, sorted) that serve ``request`` on ``model``, or
    ``None`` when the filters exclude it or some container's ask fits no profile."""
    if not allowed(request, model):
        return None
    out: list[str] = []
    for ask in request.asks:
        name = profile_for(ask, model)
        if name is None:
            return None
        out.extend([name] * ask.count)
    return tuple(sorted(out))


def by_ask(request: UnifiedRequest, model: profiles.GpuModel) -> tuple[str | None, ...]:
    """Per ask (container) of ``request``, the profile one of its GPUs gets on ``model``
    (``None``: not served there, or the filters exclude the model)."""
    if not allowed(request, model):
        return tuple(None for _ in request.asks)
    return tuple(profile_for(ask, model) for ask in request.asks)


def never_served(
    request: UnifiedRequest, models: Sequence[profiles.GpuModel] | None = None
) -> str | None:
    """Why no GPU of ``models`` (default: every model migpilot knows) could serve ``request``
    (``None``: some could)."""
    if request.mode == MPS_MODE and too_many_for_mps(request):
        return (
            f"a container asks for more than one GPU with {VGPU_MODE}: {MPS_MODE}, and an MPS "
            "slice is one GPU's (one container talks to one GPU's MPS daemon)"
        )
    pool = list(catalog.gpu_models() if models is None else models)
    fitting = [m for m in pool if allowed(request, m)]
    if not fitting:
        if models is None:
            return "its GPU model filters exclude every GPU model"
        names = ", ".join(m.id for m in pool) or "none"
        return f"its GPU model filters exclude every GPU model in the cluster ({names})"
    if any(resolve(request, m) is not None for m in fitting):
        return None
    biggest = max(memory_mib(m) for m in fitting)
    return f"it asks more than any allowed GPU offers (at most {biggest} MiB in one instance)"
