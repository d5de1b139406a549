"""Workload traces: the pods a simulation replays, from the openb CSV, a MIG-native CSV or a name.

A trace is a list of pods with an arrival time, a run time and MIG, CPU and memory requests. Three
sources make one:

- **openb** (Alibaba cluster-trace-gpu-v2023, Weng et al., ATC'23): rows ``name, cpu_milli,
  memory_mib, num_gpu, gpu_milli[, creation_time, deletion_time, ...]``. With
  :attr:`Requests.MIG` (default) a GPU share becomes a MIG profile by :class:`ProfileMapping` on
  a reference GPU model (the cluster's first): ``compute`` (default) asks for the smallest
  profile whose share of the GPU's compute slices covers ``gpu_milli / 1000``; ``memory`` asks
  for the smallest whose share of its memory covers it. A whole GPU or ``num_gpu > 1`` asks for
  that many whole-GPU instances (all on one node). With :attr:`Requests.UNIFIED` the pod asks
  as a HAMi user would, and the planner picks the profile on each model: ``gpu_milli`` is read
  as a share of the GPU's memory (``nvidia.com/gpu: 1``, ``nvidia.com/gpumem-percentage:
  ceil(gpu_milli / 10)``), ``num_gpu > 1`` as that many whole GPUs (``gpumem-percentage:
  100``). With ``whole_gpus`` a row using full GPUs (``gpu_milli`` 1000) asks for ``num_gpu``
  whole GPUs instead (``nvidia.com/gpu: N`` alone, MIG off), which only nodes labelled
  ``migpilot.io/mig-mode=dynamic`` serve. CPU and memory are kept; CPU-only pods (``num_gpu`` 0)
  are left out, since they do not touch a GPU. Variants without times (multigpu50) can only be
  replayed in inflate mode.
- **MIG-native** CSV for users' own traces: ``name,arrival,duration,requests`` with times in
  seconds (an empty duration runs to the end) and requests like
  ``mig-1g.10gb=2;cpu=4;memory=8Gi`` (or a unified request, ``gpu=1;gpumem=8000``, with
  ``gpumem-percentage`` and ``gpucores`` as well, or whole GPUs, ``gpu=1`` alone); an optional
  fifth column ``node_selector``
  holds the pod's node selector like ``nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3``
  (several joined by ``;``), matched against the simulated nodes' labels. openb's
  ``gpu_spec`` (GPU models of Alibaba's cluster) is not a selector here: those models are not
  MIG GPUs. Further optional columns, after those four in any order, carry what pods say about
  each other (kube-scheduler's InterPodAffinity and PodTopologySpread, honoured by the planner
  as on a real cluster; every pod is in namespace ``default``):

  - ``labels``: the pod's labels, ``app=web;tier=front``;
  - ``anti_affinity`` and ``affinity``: required pod (anti-)affinity terms,
    ``TOPOLOGY_KEY:LABEL=VALUE&LABEL=VALUE`` (the labels a selected pod has), several joined by
    ``;``, like ``kubernetes.io/hostname:app=web``;
  - ``spread``: topology spread constraints with ``whenUnsatisfiable: DoNotSchedule``,
    ``TOPOLOGY_KEY:MAX_SKEW:LABEL=VALUE&...``, several joined by ``;``.
- **synthetic** generators by name (``inference``, ``training``, ``mixed``), seeded.

Pure core: parses text it is given (the CLI reads files) and the bundled openb pod list (package
data read with :mod:`importlib.resources`); randomness only from a ``random.Random(seed)`` made
here. May import :mod:`migpilot.errors`, :mod:`migpilot.mig` and :mod:`migpilot.planning`.
"""

from __future__ import annotations

import csv
import enum
import functools
import importlib.resources
import io
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from migpilot import digits, errors
from migpilot.mig import profiles
from migpilot.planning import interpod, modes, snapshot
from migpilot.planning import unified as unifying

_MIB = 2**20
_GIB = 2**30

OPENB_COLUMNS = ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")
"""The columns every openb pod list has (times are optional)."""
NATIVE_COLUMNS = ("name", "arrival", "duration", "requests")
NATIVE_SELECTOR_COLUMN = "node_selector"
"""The MIG-native CSV's optional node selector column."""
NATIVE_OPTIONAL_COLUMNS = (NATIVE_SELECTOR_COLUMN, "labels", "anti_affinity", "affinity", "spread")
"""The MIG-native CSV's optional columns (after :data:`NATIVE_COLUMNS`, in any order)."""
SYNTHETIC = ("inference", "training", "mixed", "small-inference")
"""Names of the synthetic generators (``synthetic:NAME``)."""


class Requests(enum.StrEnum):
    """How openb's and the synthetic traces' GPU shares become pod requests."""

    MIG = "mig"
    """``nvidia.com/mig-<profile>``: the profile chosen on a reference model (default)."""
    UNIFIED = "unified"
    """HAMi-style ``nvidia.com/gpu`` with ``gpumem-percentage``: the share read as memory."""


class ProfileMapping(enum.StrEnum):
    """How a fraction of a GPU (openb's ``gpu_milli``) becomes a MIG profile."""

    COMPUTE = "compute"
    """The smallest profile whose compute slices cover the fraction (default)."""
    MEMORY = "memory"
    """The smallest profile whose memory slots cover the fraction."""


@dataclass(frozen=True, slots=True)
class TracePod:
    """One pod of a trace."""

    name: str
    arrival: float
    """Seconds from the start of the trace."""
    duration: float | None
    """Seconds it runs once bound; ``None``: until the end of the simulation."""
    mig: tuple[snapshot.MigRequest, ...]
    """MIG instances asked for by name; empty for a unified pod."""
    cpu_milli: int
    memory_bytes: int
    node_selector: tuple[tuple[str, str], ...] = ()
    """Labels a node must have to run the pod (sorted ``(key, value)`` pairs)."""
    unified: unifying.UnifiedRequest | None = None
    """A unified (HAMi-style) request, resolved per GPU model; ``None`` for a MIG pod."""
    memory_gb: int | None = None
    """For a pod asking MIG profiles by name, the GB of GPU memory its work uses (openb and
    synthetic traces: its share, as the unified form of the same pod asks it on the reference
    model), so the simulator's memory ratio counts one pod the same in either form; ``None``:
    its profiles' nominal GB."""
    terms: interpod.PodTerms = interpod.NO_TERMS
    """Its labels, required pod (anti-)affinity and hard topology spread (namespace
    ``default``)."""
    whole: int = 0
    """Whole GPUs (MIG off) it asks for (``nvidia.com/gpu: N`` alone); then :attr:`mig` is
    empty and :attr:`unified` is ``None``."""

    @property
    def demand(self) -> snapshot.Demand:
        """What the pod asks of GPUs (:attr:`migpilot.planning.snapshot.Pod.demand`)."""
        return (self.mig, self.unified)

    @property
    def requests(self) -> snapshot.Requests:
        """What the pod asks for, as the request parser gives it (for
        :func:`snapshot.planned_pod`)."""
        if self.whole:
            return snapshot.whole_requests(
                self.whole, cpu_milli=self.cpu_milli, memory_bytes=self.memory_bytes
            )
        return snapshot.Requests(self.mig, self.cpu_milli, self.memory_bytes, unified=self.unified)


@dataclass(frozen=True, slots=True)
class Trace:
    """The pods of a trace, in arrival order (ties keep file order)."""

    name: str
    pods: tuple[TracePod, ...]
    timed: bool
    """Whether arrivals and durations come from the source (faithful replay possible)."""
    skipped: int = 0
    """Rows left out (CPU-only openb pods)."""


def profile_for(
    model: profiles.GpuModel, *, gpu_milli: int, mapping: ProfileMapping = ProfileMapping.COMPUTE
) -> str:
    """The MIG profile of ``model`` that a pod using ``gpu_milli`` thousandths of a GPU gets.

    Only profiles without attributes (no ``+me``) are candidates; among those that cover the
    fraction the smallest (compute slices, then memory slots) wins. A full GPU gets the whole-GPU
    profile.
    """
    return _profile_for(model, gpu_milli, mapping)


@functools.lru_cache(maxsize=1024)
def _profile_for(model: profiles.GpuModel, gpu_milli: int, mapping: ProfileMapping) -> str:
    plain = sorted(
        (p for p in model.profiles if p.attribute is profiles.Attribute.NONE),
        key=lambda p: (p.compute_slices, p.memory_slots, p.name),
    )
    if mapping is ProfileMapping.MEMORY:
        plain.sort(key=lambda p: (p.memory_slots, p.compute_slices, p.name))
    whole = max(plain, key=lambda p: (p.compute_slices, p.memory_slots))
    if gpu_milli >= 1000:
        return whole.name
    for p in plain:
        if mapping is ProfileMapping.COMPUTE:
            covers = p.compute_slices * 1000 >= gpu_milli * model.compute_slices
        else:
            covers = p.memory_slots * 1000 >= gpu_milli * model.memory_slots
        if covers:
            return p.name
    return whole.name


@functools.lru_cache(maxsize=1024)
def unified_for(*, num_gpu: int, gpu_milli: int) -> unifying.UnifiedRequest:
    """The unified request of a pod using ``num_gpu`` GPUs of ``gpu_milli`` thousandths each,
    the share read as memory: ``nvidia.com/gpu: num_gpu`` with ``nvidia.com/gpumem-percentage:
    ceil(gpu_milli / 10)`` (100 for several GPUs, which are whole). Built by the snapshot's
    request parser, as the controller builds a pod's."""
    percent = 100 if num_gpu > 1 else -(-gpu_milli // 10)
    resources = {unifying.GPU: num_gpu, unifying.GPUMEM_PERCENT: percent}
    request = snapshot.pod_requests(resources, where="trace").unified
    assert request is not None  # gpumem-percentage makes it unified
    return request


def _pod_asks(
    model: profiles.GpuModel,
    *,
    num_gpu: int,
    gpu_milli: int,
    mapping: ProfileMapping,
    requests: Requests,
) -> tuple[tuple[snapshot.MigRequest, ...], unifying.UnifiedRequest | None]:
    """What a trace pod using ``num_gpu`` GPUs of ``gpu_milli`` thousandths asks for."""
    if requests is Requests.UNIFIED:
        return (), unified_for(num_gpu=num_gpu, gpu_milli=gpu_milli)
    name = profile_for(model, gpu_milli=gpu_milli, mapping=mapping)
    return (snapshot.MigRequest(name, max(num_gpu, 1)),), None


def _share_gb(model: profiles.GpuModel, num_gpu: int, gpu_milli: int) -> int:
    """The GB of ``model``'s memory a pod using ``num_gpu`` GPUs of ``gpu_milli`` thousandths
    asks in its unified form (:func:`unified_for`)."""
    share = unified_for(num_gpu=num_gpu, gpu_milli=gpu_milli)
    return sum(modes.unified_gb(a, model) * a.count for a in share.asks)


# --------------------------------------------------------------------------- CSV helpers


def _rows(text: str, *, source: str) -> Iterator[tuple[int, list[str]]]:
    """Non-empty, non-comment CSV rows with their 1-based line numbers."""
    reader = csv.reader(io.StringIO(text))
    for row in reader:
        line = reader.line_num
        if not row or not any(c.strip() for c in row) or row[0].lstrip().startswith("#"):
            continue
        yield line, [c.strip() for c in row]


def _int_field(text: str, *, column: str, where: str, least: int = 0) -> int:
    try:
        value = digits.integer(text)
    except ValueError:
        raise errors.TraceError(f"{where}: {column} {text!r} is not a whole number") from None
    if value < least:
        raise errors.TraceError(f"{where}: {column} {value} is below {least}")
    return value


def _seconds(text: str, *, column: str, where: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise errors.TraceError(f"{where}: {column} {text!r} is not a number of seconds") from None
    if not math.isfinite(value) or value < 0:
        raise errors.TraceError(f"{where}: {column} {text!r} must be a non-negative number")
    return value


def _ordered(pods: list[TracePod]) -> tuple[TracePod, ...]:
    order = sorted(range(len(pods)), key=lambda i: (pods[i].arrival, i))
    return tuple(pods[i] for i in order)


def _check_names(pods: list[TracePod], lines: list[int], *, source: str) -> None:
    seen: dict[str, int] = {}
    for pod, line in zip(pods, lines, strict=True):
        if pod.name in seen:
            raise errors.TraceError(
                f"{source}:{line}: pod name {pod.name!r} already used on line {seen[pod.name]}"
            )
        seen[pod.name] = line


# --------------------------------------------------------------------------- openb


def parse_openb(
    text: str,
    *,
    source: str,
    model: profiles.GpuModel,
    mapping: ProfileMapping = ProfileMapping.COMPUTE,
    requests: Requests = Requests.MIG,
    whole_gpus: bool = False,
) -> Trace:
    """An openb pod list (see the module docstring); raises :class:`TraceError` naming the line.
    With ``whole_gpus`` rows using full GPUs ask for whole GPUs."""
    rows = _rows(text, source=source)
    header_line, header = next(rows, (0, []))
    missing = [c for c in OPENB_COLUMNS if c not in header]
    if missing:
        raise errors.TraceError(
            f"{source}:{header_line or 1}: not an openb pod list (missing column {missing[0]!r})"
        )
    col = {name: i for i, name in enumerate(header)}
    timed = "creation_time" in col and "deletion_time" in col
    pods: list[TracePod] = []
    lines: list[int] = []
    skipped = 0
    for line, row in rows:
        where = f"{source}:{line}"
        if len(row) != len(header):
            raise errors.TraceError(f"{where}: expected {len(header)} fields, got {len(row)}")
        num_gpu = _int_field(row[col["num_gpu"]], column="num_gpu", where=where)
        gpu_milli = _int_field(row[col["gpu_milli"]], column="gpu_milli", where=where)
        cpu = _int_field(row[col["cpu_milli"]], column="cpu_milli", where=where)
        memory = _int_field(row[col["memory_mib"]], column="memory_mib", where=where)
        if gpu_milli > 1000:
            raise errors.TraceError(f"{where}: gpu_milli {gpu_milli} is above 1000")
        if num_gpu == 0:
            skipped += 1
            continue
        if gpu_milli == 0:
            raise errors.TraceError(f"{where}: num_gpu {num_gpu} with gpu_milli 0")
        if num_gpu > 1 and gpu_milli < 1000:
            raise errors.TraceError(
                f"{where}: num_gpu {num_gpu} with gpu_milli {gpu_milli} (several GPUs are whole)"
            )
        arrival, duration = 0.0, None
        if timed:
            created = _int_field(row[col["creation_time"]], column="creation_time", where=where)
            deleted = _int_field(row[col["deletion_time"]], column="deletion_time", where=where)
            if deleted < created:
                raise errors.TraceError(
                    f"{where}: deletion_time {deleted} is before creation_time {created}"
                )
            arrival, duration = float(created), float(deleted - created)
        whole = num_gpu if whole_gpus and gpu_milli == 1000 else 0
        mig, request = (
            ((), None)
            if whole
            else _pod_asks(
                model, num_gpu=num_gpu, gpu_milli=gpu_milli, mapping=mapping, requests=requests
            )
        )
        asked = None if request is not None or whole else _share_gb(model, num_gpu, gpu_milli)
        pods.append(
            TracePod(
                name=row[col["name"]] or f"line-{line}",
                arrival=arrival,
                duration=duration,
                mig=mig,
                unified=request,
                cpu_milli=cpu,
                memory_bytes=memory * _MIB,
                memory_gb=asked,
                whole=whole,
            )
        )
        lines.append(line)
    _check_names(pods, lines, source=source)
    return Trace(name=source, pods=_ordered(pods), timed=timed, skipped=skipped)


@functools.cache
def bundled_openb_text() -> str:
    """The openb default pod list shipped in the package (only the columns used here)."""
    files = importlib.resources.files("migpilot.sim")
    return files.joinpath("data/openb_pod_list_default.csv").read_text(encoding="utf-8")


def bundled_openb(
    model: profiles.GpuModel,
    *,
    mapping: ProfileMapping = ProfileMapping.COMPUTE,
    requests: Requests = Requests.MIG,
    whole_gpus: bool = False,
) -> Trace:
    """The bundled openb default trace, mapped to ``model``'s profiles (or unified requests;
    with ``whole_gpus`` its full-GPU rows as whole-GPU pods)."""
    return parse_openb(
        bundled_openb_text(),
        source="openb",
        model=model,
        mapping=mapping,
        requests=requests,
        whole_gpus=whole_gpus,
    )


# --------------------------------------------------------------------------- MIG-native


def _assignments(
    text: str, *, where: str, what: str, form: str, empty_value: bool
) -> Iterator[tuple[str, str]]:
    """The ``KEY=VALUE`` items of a ``;``-separated field, stripped (empty items skipped); an
    item without ``=`` or key (or value, unless ``empty_value``) is a :class:`TraceError`."""
    for part in text.split(";"):
        part = part.strip()
        if not part:
            continue
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not (value or empty_value):
            raise errors.TraceError(f"{where}: {what} {part!r} is not {form}")
        yield key, value


_UNIFIED_KEYS = ("gpu", "gpumem", "gpumem-percentage", "gpucores")
"""A MIG-native trace's names for the unified resources (``nvidia.com/`` left out)."""


def _requests(text: str, *, where: str) -> snapshot.Requests:
    """A MIG-native trace's requests field (``mig-1g.10gb=2;cpu=4;memory=8Gi``, or
    ``gpu=1;gpumem=8000;cpu=4``), read by the snapshot's request parser after ``mig-`` and the
    unified names get their ``nvidia.com/`` prefix."""
    resources: dict[str, str] = {}
    for key, value in _assignments(
        text, where=where, what="request", form="NAME=AMOUNT", empty_value=False
    ):
        written = key
        if key.startswith("mig-") or key in _UNIFIED_KEYS:
            key = "nvidia.com/" + key
        if key.startswith(snapshot.MIG_RESOURCE_PREFIX):
            if not digits.is_digits(value) or int(value) == 0:
                raise errors.TraceError(
                    f"{where}: {written}: {value!r} is not a positive whole number"
                )
        elif key not in ("cpu", "memory") and written not in _UNIFIED_KEYS:
            raise errors.TraceError(
                f"{where}: unknown resource {key!r} (expected mig-<profile>, "
                f"{', '.join(_UNIFIED_KEYS)}, cpu or memory)"
            )
        if key in resources:
            raise errors.TraceError(f"{where}: {written} is named twice")
        resources[key] = value
    if not any(k.startswith(snapshot.MIG_RESOURCE_PREFIX) or k == unifying.GPU for k in resources):
        raise errors.TraceError(
            f"{where}: requests name no MIG profile (like mig-1g.10gb=1) and no gpu"
        )
    try:
        whole = snapshot.whole_gpu_requests(resources, where=where)
        return whole if whole is not None else snapshot.pod_requests(resources, where=where)
    except errors.SnapshotError as e:
        raise errors.TraceError(str(e)) from None


def _selector(text: str, *, where: str) -> tuple[tuple[str, str], ...]:
    out: dict[str, str] = {}
    for key, value in _assignments(
        text, where=where, what="node selector", form="LABEL=VALUE", empty_value=True
    ):
        if key in out and out[key] != value:
            raise errors.TraceError(f"{where}: node selector names {key!r} twice")
        out[key] = value
    return tuple(sorted(out.items()))


def _is_native_header(header: list[str]) -> bool:
    return tuple(header[: len(NATIVE_COLUMNS)]) == NATIVE_COLUMNS


def _native_extra(header: list[str], *, where: str) -> tuple[str, ...]:
    """The optional columns a MIG-native header names (each known, none twice)."""
    extra = tuple(header[len(NATIVE_COLUMNS) :])
    for i, column in enumerate(extra):
        if column not in NATIVE_OPTIONAL_COLUMNS:
            raise errors.TraceError(
                f"{where}: unknown column {column!r} (optional columns: "
                f"{', '.join(NATIVE_OPTIONAL_COLUMNS)})"
            )
        if column in extra[:i]:
            raise errors.TraceError(f"{where}: column {column!r} is named twice")
    return extra


def _match_labels(text: str, *, where: str, what: str) -> dict[str, str]:
    """``LABEL=VALUE&LABEL=VALUE`` (a selector's ``matchLabels``)."""
    out: dict[str, str] = {}
    for key, value in _assignments(
        text.replace("&", ";"), where=where, what=what, form="LABEL=VALUE", empty_value=True
    ):
        if key in out:
            raise errors.TraceError(f"{where}: {what} names {key!r} twice")
        out[key] = value
    if not out:
        raise errors.TraceError(f"{where}: {what} selects no label (expected LABEL=VALUE)")
    return out


def _affinity_terms(text: str, *, where: str, what: str) -> list[dict[str, object]]:
    """``KEY:LABEL=VALUE&...;...`` as Kubernetes ``PodAffinityTerm`` s."""
    out: list[dict[str, object]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        key, sep, selector = part.partition(":")
        if not sep or not key.strip():
            raise errors.TraceError(
                f"{where}: {what} term {part!r} is not TOPOLOGY_KEY:LABEL=VALUE&..."
            )
        labels = _match_labels(selector, where=where, what=f"{what} term {part!r}")
        out.append({"labelSelector": {"matchLabels": labels}, "topologyKey": key.strip()})
    return out


def _spread(text: str, *, where: str) -> list[dict[str, object]]:
    """``KEY:MAX_SKEW:LABEL=VALUE&...;...`` as Kubernetes ``topologySpreadConstraints``."""
    out: list[dict[str, object]] = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) != 3 or not fields[0].strip():
            raise errors.TraceError(
                f"{where}: spread {part!r} is not TOPOLOGY_KEY:MAX_SKEW:LABEL=VALUE&..."
            )
        key, skew, selector = (f.strip() for f in fields)
        if not digits.is_digits(skew) or int(skew) == 0:
            raise errors.TraceError(
                f"{where}: spread {part!r}: max skew {skew!r} is not a positive whole number"
            )
        out.append(
            {
                "maxSkew": int(skew),
                "topologyKey": key,
                "whenUnsatisfiable": "DoNotSchedule",
                "labelSelector": {
                    "matchLabels": _match_labels(selector, where=where, what=f"spread {part!r}")
                },
            }
        )
    return out


def _terms(fields: dict[str, str], *, where: str) -> interpod.PodTerms:
    """A native row's ``labels``, ``anti_affinity``, ``affinity`` and ``spread`` fields."""
    labels = dict(
        _assignments(
            fields.get("labels", ""), where=where, what="label", form="LABEL=VALUE",
            empty_value=True,
        )
    )  # fmt: skip
    affinity: dict[str, object] = {}
    for column, name in (("affinity", "podAffinity"), ("anti_affinity", "podAntiAffinity")):
        found = _affinity_terms(fields.get(column, ""), where=where, what=column)
        if found:
            affinity[name] = {"requiredDuringSchedulingIgnoredDuringExecution": found}
    spread = _spread(fields.get("spread", ""), where=where)
    if not (labels or affinity or spread):
        return interpod.NO_TERMS
    try:
        return interpod.pod_terms(
            affinity=affinity,
            spread=spread,
            labels_=interpod.labels(labels, f"{where}: labels"),
            namespace="default",
            where=where,
        )
    except errors.SnapshotError as e:
        raise errors.TraceError(str(e)) from None


def parse_native(text: str, *, source: str) -> Trace:
    """A MIG-native CSV ``name,arrival,duration,requests`` and optional columns
    (:data:`NATIVE_OPTIONAL_COLUMNS`); raises :class:`TraceError`."""
    rows = _rows(text, source=source)
    header_line, header = next(rows, (0, []))
    if not _is_native_header(header):
        raise errors.TraceError(
            f"{source}:{header_line or 1}: expected the header {','.join(NATIVE_COLUMNS)} "
            f"(optionally followed by columns of {', '.join(NATIVE_OPTIONAL_COLUMNS)})"
        )
    extra = _native_extra(header, where=f"{source}:{header_line}")
    width = len(header)
    pods: list[TracePod] = []
    lines: list[int] = []
    for line, row in rows:
        where = f"{source}:{line}"
        if len(row) != width:
            raise errors.TraceError(f"{where}: expected {width} fields, got {len(row)}")
        name, arrival, duration, requests = row[:4]
        fields = dict(zip(extra, row[4:], strict=True))
        selector = _selector(fields.get(NATIVE_SELECTOR_COLUMN, ""), where=where)
        terms = _terms(fields, where=where)
        if not name:
            raise errors.TraceError(f"{where}: empty pod name")
        req = _requests(requests, where=where)
        pods.append(
            TracePod(
                name=name,
                arrival=_seconds(arrival, column="arrival", where=where),
                duration=None if duration == "" else _seconds(duration, column="duration",
                                                                where=where),
                mig=req.mig,
                unified=req.unified,
                cpu_milli=req.cpu_milli,
                memory_bytes=req.memory_bytes,
                node_selector=selector,
                terms=terms,
                whole=req.whole,
            )
        )  # fmt: skip
        lines.append(line)
    _check_names(pods, lines, source=source)
    return Trace(name=source, pods=_ordered(pods), timed=True)


def parse(
    text: str,
    *,
    source: str,
    model: profiles.GpuModel,
    mapping: ProfileMapping = ProfileMapping.COMPUTE,
    requests: Requests = Requests.MIG,
    whole_gpus: bool = False,
) -> Trace:
    """A trace file's text, its format recognised by its header (openb or MIG-native; the
    latter names its requests itself, so ``mapping``, ``requests`` and ``whole_gpus`` are
    openb's)."""
    first = next(_rows(text, source=source), None)
    if first is None:
        raise errors.TraceError(f"{source}: the trace is empty")
    if _is_native_header(first[1]):
        return parse_native(text, source=source)
    if all(c in first[1] for c in OPENB_COLUMNS):
        return parse_openb(
            text,
            source=source,
            model=model,
            mapping=mapping,
            requests=requests,
            whole_gpus=whole_gpus,
        )
    raise errors.TraceError(
        f"{source}:{first[0]}: unknown trace format (expected the header "
        f"{','.join(NATIVE_COLUMNS)} or an openb pod list with {','.join(OPENB_COLUMNS)})"
    )


# --------------------------------------------------------------------------- synthetic

# Per generator: (weight, gpu_milli, num_gpu, cpu cores, memory GiB, mean run time in seconds).
_MIXES: dict[str, tuple[tuple[int, int, int, int, int, float], ...]] = {
    "inference": (
        (40, 140, 1, 2, 8, 1800.0),
        (25, 250, 1, 4, 16, 3600.0),
        (20, 420, 1, 4, 24, 3600.0),
        (10, 560, 1, 6, 32, 7200.0),
        (5, 1000, 1, 8, 48, 7200.0),
    ),
    "training": (
        (15, 420, 1, 6, 32, 14400.0),
        (20, 560, 1, 8, 48, 14400.0),
        (40, 1000, 1, 12, 64, 28800.0),
        (15, 1000, 2, 24, 128, 43200.0),
        (7, 1000, 4, 48, 256, 43200.0),
        (3, 1000, 8, 88, 320, 86400.0),
    ),
}
# Many small inference pods (5-50 % of a GPU's memory, a few hours each): the trace that MPS and
# time-slicing nodes are compared on (bench/bench_sharing.py).
_MIXES["small-inference"] = (
    (35, 50, 1, 1, 4, 10800.0),
    (30, 100, 1, 2, 8, 10800.0),
    (20, 200, 1, 2, 12, 14400.0),
    (10, 300, 1, 4, 16, 14400.0),
    (5, 500, 1, 4, 24, 14400.0),
)
_MIXES["mixed"] = tuple(
    (row[0] * share, *row[1:])
    for source, share in (("inference", 3), ("training", 1))
    for row in _MIXES[source]
)
_SYNTHETIC_MEAN_GAP_S = 60.0
"""Mean time between arrivals of a synthetic trace (Poisson arrivals)."""


def synthetic(
    name: str,
    *,
    seed: int,
    model: profiles.GpuModel,
    pods: int = 2000,
    mapping: ProfileMapping = ProfileMapping.COMPUTE,
    requests: Requests = Requests.MIG,
    mean_gap_s: float = _SYNTHETIC_MEAN_GAP_S,
) -> Trace:
    """A seeded synthetic trace: ``inference`` (small slices, short runs), ``training`` (whole
    GPUs, some multi-GPU, long runs), ``mixed`` (three inference pods to one training pod) or
    ``small-inference``. Poisson arrivals ``mean_gap_s`` apart on average (default one minute:
    the load scales as its inverse), exponential run times."""
    mix = _MIXES.get(name)
    if mix is None:
        raise errors.TraceError(
            f"unknown synthetic trace {name!r} "
            f"(known: {', '.join('synthetic:' + s for s in SYNTHETIC)})"
        )
    if pods < 1:
        raise errors.TraceError(f"a synthetic trace needs at least one pod, got {pods}")
    if not mean_gap_s > 0:
        raise errors.TraceError(f"the mean gap between arrivals must be positive, got {mean_gap_s}")
    rng = random.Random(seed)
    weights = [row[0] for row in mix]
    width = len(str(pods - 1))
    out: list[TracePod] = []
    now = 0.0
    for i in range(pods):
        _, gpu_milli, num_gpu, cores, mem_gib, mean = rng.choices(mix, weights)[0]
        now += rng.expovariate(1.0 / mean_gap_s)
        mig, request = _pod_asks(
            model, num_gpu=num_gpu, gpu_milli=gpu_milli, mapping=mapping, requests=requests
        )
        asked = None if request is not None else _share_gb(model, num_gpu, gpu_milli)
        out.append(
            TracePod(
                name=f"{name}-{i:0{width}d}",
                arrival=round(now, 3),
                duration=round(rng.expovariate(1.0 / mean), 3),
                mig=mig,
                unified=request,
                cpu_milli=cores * 1000,
                memory_bytes=mem_gib * _GIB,
                memory_gb=asked,
            )
        )
    return Trace(name=f"synthetic:{name}", pods=tuple(out), timed=True)
