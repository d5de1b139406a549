"""Seeded cluster snapshots for tests, the benchmark and users who want a cluster to plan.

The planner is judged on snapshots nobody wrote by hand: thousands of GPUs of mixed models, partly
occupied by instances in use, and pending pods with the requests, selectors, taints and priorities
real clusters have. :func:`random_snapshot` draws such a cluster from a few knobs;
:func:`trace_snapshot` draws the pods from the shape of the Alibaba openb GPU trace instead;
:func:`sharing_snapshot` draws nodes in modes mig, mps and time-slicing (``docs/modes.md``) with
partly sliced MPS GPUs and partly used replicas, and pods asking MPS slices by name
(``nvidia.com/gpu-<N>gb``), unified requests or MIG profiles.

Pure core: the only randomness is a ``random.Random(seed)`` made here (never the global one), so
the same arguments give an equal snapshot on every machine; no file is read (the trace shape is a
table below). May import only :mod:`migpilot.errors`, :mod:`migpilot.mig` and
:mod:`migpilot.planning.snapshot`, :mod:`~migpilot.planning.unified`,
:mod:`~migpilot.planning.modes` and :mod:`~migpilot.planning.scoring`. Per-model tables are
computed once and cached, so 8,000 GPUs and 5,000 pods take a fraction of a second.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from migpilot import errors
from migpilot.mig import catalog, layouts, profiles
from migpilot.planning import modes, scoring, snapshot, unified
from migpilot.sharing import mps as sharing_mps

DEFAULT_MODELS = ("a100-80gb", "h100-80gb", "a30-24gb")

_GIB = 2**30
_ZONES = ("a", "b", "c")
_POOLS = ("train", "infer", "batch")
_NAMESPACES = ("default", "team-a", "team-b")
_PRODUCT_LABEL = "nvidia.com/gpu.product"

# Weight of a request of each size (compute slices) among single-profile requests: mostly small
# inference slices, some mid-size, a few whole GPUs. A size a model lacks (3g on an A30) is
# simply not drawn for it.
_SIZE_WEIGHTS = {1: 40, 2: 25, 3: 15, 4: 10, 7: 6}
_MEDIA_WEIGHT = 4
"""Total weight of the media-extension (+me) profiles of a model."""
_EMPTY_GPU_FRACTION = 0.25
"""GPUs drawn with no MIG instance at all."""
_KEEP_FRACTION = 0.7
"""Each instance of a GPU's drawn layout exists with this probability (the rest was destroyed)."""

# The openb trace (Weng et al., "Beware of Fragmentation", USENIX ATC 2023; github.com/alibaba/
# clusterdata, cluster-trace-gpu-v2023), pods of openb_pod_list_default.csv that ask for a GPU,
# grouped by (num_gpu, gpu_milli); the 1,088 CPU-only pods are left out. Columns: num_gpu,
# gpu_milli, pods, of which qos LS (latency-sensitive), median cpu_milli, median memory_mib.
# Made once, by hand, from the shared copy of the trace with:
#   python -c "import csv,collections,statistics as st
#   g=collections.defaultdict(list)
#   for r in csv.DictReader(open('shared/data/openb/openb_pod_list_default.csv')):
#       k=(int(r['num_gpu']),int(r['gpu_milli']))
#       if k[0]: g[k].append(r)
#   for k in sorted(g): v=g[k]; print(k+(len(v),sum(r['qos']=='LS' for r in v),
#       int(st.median(int(r['cpu_milli']) for r in v)),
#       int(st.median(int(r['memory_mib']) for r in v))))"
# 6,989 of the 7,064 GPU pods ask for one GPU; 3,911 of those for all of it (gpu_milli 1000).
_OPENB: tuple[tuple[int, int, int, int, int, int], ...] = (
    (1, 50, 7, 0, 6000, 22888),
    (1, 110, 24, 1, 4000, 22888),
    (1, 140, 1, 0, 1000, 2048),
    (1, 160, 74, 0, 4000, 15258),
    (1, 220, 62, 0, 4000, 22888),
    (1, 230, 140, 0, 4000, 30517),
    (1, 270, 4, 0, 4152, 10600),
    (1, 290, 1, 0, 1000, 2048),
    (1, 320, 328, 0, 4000, 22888),
    (1, 330, 7, 0, 4000, 22888),
    (1, 350, 6, 0, 4000, 22888),
    (1, 370, 47, 2, 4152, 10600),
    (1, 440, 2, 1, 8000, 30517),
    (1, 460, 128, 128, 6000, 12288),
    (1, 470, 750, 390, 11908, 47104),
    (1, 480, 19, 0, 4000, 22888),
    (1, 550, 72, 0, 4152, 10600),
    (1, 590, 75, 0, 3152, 5600),
    (1, 650, 253, 237, 11908, 47104),
    (1, 810, 1078, 0, 3152, 5600),
    (1, 1000, 3911, 3200, 11400, 48128),
    (2, 1000, 16, 15, 16200, 66560),
    (4, 1000, 15, 14, 32200, 132096),
    (8, 1000, 44, 23, 88000, 327680),
)
# The trace's most common GPU node (549 of 1,213 nodes in openb_node_list_gpu_node.csv): 8 GPUs,
# 96 cores, 384 GiB; per GPU that is:
_OPENB_CPU_MILLI_PER_GPU = 12_000
_OPENB_MEMORY_PER_GPU = 48 * _GIB


@dataclass(frozen=True, slots=True, eq=False)
class _ModelTables:
    """What the generators draw from for one GPU model, computed once."""

    model: profiles.GpuModel
    layouts: tuple[layouts.Layout, ...]
    """Every maximal layout: a GPU's current instances are a random subset of one."""
    names: tuple[str, ...]
    """Profiles a single request is drawn from ..."""
    weights: tuple[float, ...]
    """... with these weights (mostly small slices)."""
    by_size: tuple[profiles.Profile, ...]
    """Profiles without attributes, smallest first (compute slices, then memory)."""
    whole: str
    """The profile that takes a whole GPU (7g.80gb on an A100-80GB)."""
    product_label: str


@functools.cache
def _tables(model: profiles.GpuModel) -> _ModelTables:
    plain = sorted(
        (p for p in model.profiles if p.attribute is profiles.Attribute.NONE),
        key=lambda p: (p.compute_slices, p.memory_slots, p.name),
    )
    media = [p for p in model.profiles if p.media_extension]
    names: list[str] = []
    weights: list[float] = []
    for size, weight in _SIZE_WEIGHTS.items():
        same = [p for p in plain if p.compute_slices == size]
        for rank, p in enumerate(same):
            # The leanest memory variant of a size is the usual ask (1g.10gb over 1g.20gb).
            share = 0.75 if rank == 0 else 0.25 / (len(same) - 1)
            names.append(p.name)
            weights.append(weight * (share if len(same) > 1 else 1.0))
    for p in media:
        names.append(p.name)
        weights.append(_MEDIA_WEIGHT / len(media))
    return _ModelTables(
        model=model,
        layouts=layouts.enumerate_layouts(model),
        names=tuple(names),
        weights=tuple(weights),
        by_size=tuple(plain),
        whole=plain[-1].name,
        product_label=model.gfd_product_names[0] if model.product_names else model.id,
    )


def _check_sizes(*, nodes: int, gpus_per_node: int, pods: int) -> None:
    for name, value, least in (("nodes", nodes, 0), ("gpus_per_node", gpus_per_node, 1)):
        if value < least:
            raise errors.MigpilotError(f"{name} must be at least {least}, got {value}")
    if pods < 0:
        raise errors.MigpilotError(f"pods must be at least 0, got {pods}")


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise errors.MigpilotError(f"{name} must be between 0 and 1, got {value}")


def _resolve_models(models: Sequence[str]) -> tuple[_ModelTables, ...]:
    if not models:
        raise errors.MigpilotError("at least one GPU model is needed")
    return tuple(_tables(catalog.resolve_gpu(m)) for m in models)


def _gpu(
    rng: random.Random, tables: _ModelTables, *, index: int, used_fraction: float
) -> snapshot.Gpu:
    """A GPU whose instances are a random subset of a random valid layout (so still valid)."""
    if rng.random() < _EMPTY_GPU_FRACTION:
        return snapshot.Gpu(index, tables.model, ())
    layout = rng.choice(tables.layouts)
    kept = tuple(
        snapshot.ExistingInstance(i.profile, i.start, rng.random() < used_fraction)
        for i in layout.instances
        if rng.random() < _KEEP_FRACTION
    )
    return snapshot.Gpu(index, tables.model, kept)


def _width(count: int) -> int:
    return max(len(str(max(count - 1, 0))), 2)


def _nodes(
    rng: random.Random,
    *,
    tables: Sequence[_ModelTables],
    nodes: int,
    gpus_per_node: int,
    used_fraction: float,
    allocatable: bool,
    constrained: bool,
) -> tuple[tuple[snapshot.Node, ...], tuple[_ModelTables, ...]]:
    """The nodes, and the model tables of each (what pods are drawn for)."""
    out: list[snapshot.Node] = []
    chosen: list[_ModelTables] = []
    width = _width(nodes)
    for n in range(nodes):
        table = rng.choice(tables)
        chosen.append(table)
        zone = rng.choice(_ZONES)
        pool = rng.choice(_POOLS)
        labels = {"zone": zone, "pool": pool, _PRODUCT_LABEL: table.product_label}
        taints: list[snapshot.Taint] = []
        cordoned = False
        if constrained:
            draw = rng.random()
            if draw < 0.05:
                taints.append(snapshot.Taint("dedicated", pool, "NoSchedule"))
            elif draw < 0.08:
                taints.append(snapshot.Taint("maintenance", "soon", "PreferNoSchedule"))
            elif draw < 0.09:
                taints.append(snapshot.Taint("gpu-health", "degraded", "NoExecute"))
            cordoned = rng.random() < 0.03
        if not allocatable:
            alloc = None
        elif constrained:
            alloc = snapshot.Resources(
                gpus_per_node * rng.choice((6, 8, 12, 16)) * 1000,
                gpus_per_node * rng.choice((48, 64, 96)) * _GIB,
            )
        else:
            alloc = snapshot.Resources(
                gpus_per_node * _OPENB_CPU_MILLI_PER_GPU, gpus_per_node * _OPENB_MEMORY_PER_GPU
            )
        gpus = tuple(
            _gpu(rng, table, index=g, used_fraction=used_fraction) for g in range(gpus_per_node)
        )
        out.append(
            snapshot.Node(
                name=f"node-{n:0{width}d}",
                labels=MappingProxyType(labels),
                taints=tuple(taints),
                unschedulable=cordoned,
                allocatable=alloc,
                gpus=gpus,
            )
        )
    return tuple(out), tuple(chosen)


_NO_LABELS: MappingProxyType[str, str] = MappingProxyType({})


def _rules_and_priority(
    rng: random.Random,
    present: Sequence[_ModelTables],
    *,
    selector_fraction: float,
    priority_levels: int,
) -> tuple[MappingProxyType[str, str], tuple[tuple[snapshot.Requirement, ...], ...], int]:
    """A pod's nodeSelector or required node affinity (``selector_fraction`` of the pods have
    one), then its priority: ``0, 100, ...`` over ``priority_levels`` levels, each level half as
    common as the one below."""
    selector: MappingProxyType[str, str] = _NO_LABELS
    affinity: tuple[tuple[snapshot.Requirement, ...], ...] = ()
    if rng.random() < selector_fraction:
        selector, affinity = _placement_rules(rng, present)
    levels = tuple(range(priority_levels))
    weights = tuple(2.0 ** (priority_levels - 1 - lv) for lv in levels)
    level = rng.choices(levels, weights=weights)[0] if priority_levels > 1 else 0
    return selector, affinity, level * 100


def _placement_rules(
    rng: random.Random, tables: Sequence[_ModelTables]
) -> tuple[MappingProxyType[str, str], tuple[tuple[snapshot.Requirement, ...], ...]]:
    """A node selector or a required node affinity, exercising every operator the format has."""
    draw = rng.random()
    req = snapshot.Requirement
    if draw < 0.3:
        return MappingProxyType({"zone": rng.choice(_ZONES)}), ()
    if draw < 0.45:
        return MappingProxyType({"pool": rng.choice(_POOLS)}), ()
    if draw < 0.6:
        product = rng.choice(tables).product_label
        return MappingProxyType({_PRODUCT_LABEL: product}), ()
    if draw < 0.75:
        zones = tuple(sorted(rng.sample(_ZONES, 2)))
        return _NO_LABELS, ((req("zone", "In", zones),),)
    if draw < 0.85:
        return _NO_LABELS, ((req("pool", "NotIn", ("batch",)),),)
    if draw < 0.95:
        # Two terms (OR): either zone a, or any node of the infer pool.
        return _NO_LABELS, (
            (req("zone", "In", ("a",)), req("pool", "Exists", ())),
            (req("pool", "In", ("infer",)),),
        )
    return _NO_LABELS, ((req("gpu-health", "DoesNotExist", ()),),)


def _tolerations(rng: random.Random) -> tuple[snapshot.Toleration, ...]:
    draw = rng.random()
    if draw < 0.08:
        return (snapshot.Toleration("dedicated", "Equal", rng.choice(_POOLS), "NoSchedule"),)
    if draw < 0.10:
        return (snapshot.Toleration("dedicated", "Exists", "", ""),)
    if draw < 0.11:
        return (snapshot.Toleration("", "Exists", "", ""),)
    return ()


def _unified(
    rng: random.Random, pod: snapshot.Pod, table: _ModelTables, tables: Sequence[_ModelTables]
) -> snapshot.Pod:
    """``pod`` asking as a HAMi user would for what its MIG request names: per request line a
    container of that many GPUs with a little less memory than the profile's (or a share of
    the GPU's memory), sometimes gpucores, model filters and node or GPU policies."""
    model = table.model
    asks = []
    for r in pod.mig:
        prof = model.profile_named(r.profile)
        draw = rng.random()
        if draw < 0.15:
            mib, pct = None, max(1, prof.memory_slots * 100 // model.memory_slots)
        else:
            mib, pct = max(1, (prof.memory_mib or 1024) - rng.randint(0, 3000)), None
        cores = None
        if rng.random() < 0.2:
            cores = max(1, prof.compute_slices * 100 // model.compute_slices)
        ask = unified.GpuAsk(r.count, memory_mib=mib, memory_percent=pct, cores_percent=cores)
        asks.append(ask)
    use: tuple[str, ...] = ()
    nouse: tuple[str, ...] = ()
    draw = rng.random()
    if draw < 0.15:
        use = (rng.choice(tables).model.id,)
    elif draw < 0.25:
        nouse = (rng.choice(tables).model.id,)
    policies = (None, scoring.Policy.BINPACK, scoring.Policy.SPREAD)
    node_policy = rng.choice(policies) if rng.random() < 0.3 else None
    gpu_policy = rng.choice(policies) if rng.random() < 0.3 else None
    request = unified.UnifiedRequest(tuple(asks), use_models=use, nouse_models=nouse)
    return dataclasses.replace(
        pod, mig=(), unified=request, node_policy=node_policy, gpu_policy=gpu_policy
    )


def _mig_request(
    rng: random.Random, tables: _ModelTables, *, multi_instance_fraction: float
) -> tuple[tuple[snapshot.MigRequest, ...], int]:
    """Profiles for one pod, drawn for one model's names, and their total compute slices."""
    first = rng.choices(tables.names, weights=tables.weights)[0]
    counts = {first: 1}
    if rng.random() < multi_instance_fraction:
        # 2-4 instances, sometimes of two profiles: possibly more than one GPU's worth.
        counts[first] = rng.randint(2, 4)
        if rng.random() < 0.25:
            other = rng.choices(tables.names, weights=tables.weights)[0]
            counts[other] = counts.get(other, 0) + 1
    compute = sum(tables.model.profile_named(p).compute_slices * n for p, n in counts.items())
    return tuple(snapshot.MigRequest(p, n) for p, n in sorted(counts.items())), compute


def random_snapshot(
    *,
    seed: int,
    nodes: int,
    gpus_per_node: int,
    pods: int,
    models: Sequence[str] = DEFAULT_MODELS,
    used_fraction: float = 0.3,
    selector_fraction: float = 0.1,
    priority_levels: int = 2,
    multi_instance_fraction: float = 0.15,
    cpu: bool = True,
    unified_fraction: float = 0.0,
) -> snapshot.Snapshot:
    """A random cluster: mixed-model nodes, partly occupied GPUs and pending pods.

    Each node has ``gpus_per_node`` GPUs of one of ``models`` (drawn per node); labels ``zone``,
    ``pool`` and ``nvidia.com/gpu.product``; about 9 % carry a taint (NoSchedule, NoExecute or
    PreferNoSchedule) and 3 % are cordoned. A quarter of the GPUs have no instance; the others
    hold a random subset of a random valid layout, each instance in use with probability
    ``used_fraction``. Each pod asks for profiles of one model (mostly 1g/2g, some 3g/4g/7g and
    ``+me``); ``multi_instance_fraction`` of them ask for 2-4 instances; ``selector_fraction``
    have a nodeSelector or required node affinity; priorities are ``0, 100, ...`` over
    ``priority_levels`` levels, lower ones commoner. With ``cpu``, nodes have allocatable CPU
    and memory and pods ask for some in proportion to their compute slices, enough to bind on
    some nodes. ``unified_fraction`` of the pods make a unified (HAMi-style) request instead,
    sized like the MIG request drawn (:func:`_unified`), some with model filters, gpucores or
    node and GPU policies; drawn from a second generator, so the rest of the snapshot is the
    same whatever the fraction. Deterministic in all arguments.
    """
    _check_sizes(nodes=nodes, gpus_per_node=gpus_per_node, pods=pods)
    _check_fraction("used_fraction", used_fraction)
    _check_fraction("selector_fraction", selector_fraction)
    _check_fraction("multi_instance_fraction", multi_instance_fraction)
    _check_fraction("unified_fraction", unified_fraction)
    urng = random.Random(seed * 7919 + 17)
    if priority_levels < 1:
        raise errors.MigpilotError(f"priority_levels must be at least 1, got {priority_levels}")
    tables = _resolve_models(models)
    rng = random.Random(seed)
    node_list, node_tables = _nodes(
        rng,
        tables=tables,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        used_fraction=used_fraction,
        allocatable=cpu,
        constrained=True,
    )
    # Pods ask for the models the cluster has, in proportion to its nodes.
    pod_models = node_tables or tables
    present = tuple(t for t in tables if t in node_tables) or tables
    width = _width(pods)
    pod_list: list[snapshot.Pod] = []
    for i in range(pods):
        table = rng.choice(pod_models)
        mig, compute = _mig_request(rng, table, multi_instance_fraction=multi_instance_fraction)
        selector, affinity, priority = _rules_and_priority(
            rng, present, selector_fraction=selector_fraction, priority_levels=priority_levels
        )
        cpu_milli = mem = 0
        if cpu:
            cpu_milli = compute * rng.choice((500, 1000, 2000, 4000))
            mem = compute * rng.choice((4, 8, 16, 32)) * _GIB
        pod = snapshot.Pod(
            name=f"pod-{i:0{width}d}",
            namespace=rng.choice(_NAMESPACES),
            priority=priority,
            mig=mig,
            cpu_milli=cpu_milli,
            memory_bytes=mem,
            node_selector=selector,
            affinity=affinity,
            tolerations=_tolerations(rng),
        )
        if unified_fraction and urng.random() < unified_fraction:
            pod = _unified(urng, pod, table, present)
        pod_list.append(pod)
    return snapshot.Snapshot(nodes=node_list, pods=tuple(pod_list))


def trace_profile(model: profiles.GpuModel, *, num_gpu: int, gpu_milli: int) -> tuple[str, ...]:
    """The MIG profiles a trace pod asks for on ``model``.

    ``num_gpu`` > 1 (or a whole GPU) asks for that many whole-GPU instances; a fraction of one
    GPU asks for the smallest profile whose share of the GPU's compute slices covers it
    (``compute_slices / 7 >= gpu_milli / 1000`` on an A100; over 4 slices on an A30).
    """
    t = _tables(model)
    if num_gpu > 1 or gpu_milli >= 1000:
        return (t.whole,) * max(num_gpu, 1)
    for p in t.by_size:
        if p.compute_slices * 1000 >= gpu_milli * model.compute_slices:
            return (p.name,)
    return (t.whole,)


def trace_snapshot(
    *,
    seed: int,
    nodes: int,
    gpus_per_node: int,
    pods: int,
    models: Sequence[str] = DEFAULT_MODELS,
    used_fraction: float = 0.3,
) -> snapshot.Snapshot:
    """A cluster whose pending pods follow the openb trace's mix of GPU, CPU and memory asks.

    Nodes are as in :func:`random_snapshot` without taints or cordons, with the CPU and memory
    per GPU of the trace's most common node (12 cores, 48 GiB). Each pod draws a row of the
    trace table by its frequency, a model among the cluster's, and asks for
    :func:`trace_profile` with the row's median CPU and memory; latency-sensitive (LS) pods get
    priority 100, the others 0. Deterministic in all arguments.
    """
    _check_sizes(nodes=nodes, gpus_per_node=gpus_per_node, pods=pods)
    _check_fraction("used_fraction", used_fraction)
    tables = _resolve_models(models)
    rng = random.Random(seed)
    node_list, node_tables = _nodes(
        rng,
        tables=tables,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        used_fraction=used_fraction,
        allocatable=True,
        constrained=False,
    )
    pod_models = node_tables or tables
    weights = tuple(row[2] for row in _OPENB)
    width = _width(pods)
    pod_list: list[snapshot.Pod] = []
    for i in range(pods):
        num_gpu, gpu_milli, count, ls, cpu_milli, memory_mib = rng.choices(_OPENB, weights)[0]
        table = rng.choice(pod_models)
        names = trace_profile(table.model, num_gpu=num_gpu, gpu_milli=gpu_milli)
        latency_sensitive = rng.random() * count < ls
        pod_list.append(
            snapshot.Pod(
                name=f"openb-{i:0{width}d}",
                namespace="default",
                priority=100 if latency_sensitive else 0,
                mig=(snapshot.MigRequest(names[0], len(names)),),
                cpu_milli=cpu_milli,
                memory_bytes=memory_mib * 2**20,
                node_selector=_NO_LABELS,
                affinity=(),
                tolerations=(),
            )
        )
    return snapshot.Snapshot(nodes=node_list, pods=tuple(pod_list))


SHARING_MODES = ("mig", "mps", "time-slicing")
"""The node modes :func:`sharing_snapshot` cycles through by default: a mixed cluster."""

# Slice sizes (GB) pods ask for by name and existing MPS slices have: nos's usual resource names
# (nvidia.com/gpu-10gb, -20gb, ...), mostly small inference slices. A size over a GPU's memory
# is not drawn for it.
_SLICE_GB_WEIGHTS = {5: 20, 10: 30, 15: 8, 20: 20, 30: 8, 40: 8, 60: 3, 80: 3}
_SLICE_CORES = (10, 20, 25, 50)
"""Compute shares (percent) a slice or a unified ask may carry."""
_CORES_FRACTION = 0.15
"""Existing slices, and unified asks, with a compute share."""
_RESERVED_SHARE = 0.25
"""Of the taken slices, those reserved by a plan for a pod rather than in use."""
_MOST_SLICES = 12
"""Existing slices per GPU at most (the 48-client limit is never the binding one here)."""
_REPLICAS = (2, 4, 4, 8)
"""Time-slicing replicas per GPU, drawn per GPU."""


@functools.cache
def _slice_sizes(cap: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """The slice sizes (and their weights) a GPU of ``cap`` GB serves; ``cap`` itself if none."""
    sizes = tuple(gb for gb in _SLICE_GB_WEIGHTS if gb <= cap)
    if not sizes:
        return (cap,), (1.0,)
    return sizes, tuple(float(_SLICE_GB_WEIGHTS[gb]) for gb in sizes)


def _mps_gpu(
    rng: random.Random, tables: _ModelTables, *, index: int, used_fraction: float
) -> snapshot.Gpu:
    """An MPS GPU partly sliced: slices up to a random share (40-100 %) of its memory, each
    taken (used, or reserved for a pod) with probability ``used_fraction``, some with a
    compute share, ids with gaps (as removals leave them); a quarter of the GPUs unsliced."""
    model = tables.model
    if rng.random() < _EMPTY_GPU_FRACTION:
        return snapshot.Gpu(index, model, ())
    cap = sharing_mps.memory_gb(model)
    target = cap * rng.uniform(0.4, 1.0)
    sizes, weights = _slice_sizes(cap)
    slices: list[modes.MpsSlice] = []
    total = cores_total = next_id = 0
    while len(slices) < _MOST_SLICES:
        gb = rng.choices(sizes, weights)[0]
        if total + gb > target:
            break
        taken = rng.random() < used_fraction
        reserved = taken and rng.random() < _RESERVED_SHARE
        cores = None
        if rng.random() < _CORES_FRACTION:
            share = rng.choice(_SLICE_CORES)
            if cores_total + share <= 100:
                cores, cores_total = share, cores_total + share
        slices.append(
            modes.MpsSlice(
                id=next_id,
                memory_gb=gb,
                cores=cores,
                used=taken and not reserved,
                reserved_for=f"serving/gpu{index}-slice{next_id}" if reserved else "",
            )
        )
        total += gb
        next_id += rng.choice((1, 1, 2))
    return snapshot.Gpu(index, model, (), mps=tuple(slices))


def _time_sliced_gpu(
    rng: random.Random, tables: _ModelTables, *, index: int, used_fraction: float
) -> snapshot.Gpu:
    """A time-slicing GPU of 2-8 replicas, each in use with probability ``used_fraction``."""
    replicas = rng.choice(_REPLICAS)
    used = sum(rng.random() < used_fraction for _ in range(replicas))
    return snapshot.Gpu(index, tables.model, (), replicas=replicas, replicas_used=used)


def _in_mode(
    rng: random.Random,
    node: snapshot.Node,
    table: _ModelTables,
    *,
    mode: modes.Mode,
    used_fraction: float,
) -> snapshot.Node:
    """``node`` (drawn as a MIG node) in ``mode``: its label, and GPUs sliced or replicated."""
    if mode is modes.Mode.MIG:
        return node
    gpus: list[snapshot.Gpu] = []
    for g in node.gpus:
        if mode is modes.Mode.MPS:
            gpus.append(_mps_gpu(rng, table, index=g.index, used_fraction=used_fraction))
        elif mode is modes.Mode.TIME_SLICING:
            gpus.append(_time_sliced_gpu(rng, table, index=g.index, used_fraction=used_fraction))
        else:
            gpus.append(snapshot.Gpu(g.index, table.model, ()))
    labels = MappingProxyType({**node.labels, modes.MODE_LABEL: mode.value})
    return dataclasses.replace(node, labels=labels, mode=mode, gpus=tuple(gpus))


def _parse_modes(node_modes: Sequence[str]) -> tuple[modes.Mode, ...]:
    if not node_modes:
        raise errors.MigpilotError("node_modes needs at least one mode")
    out = []
    for m in node_modes:
        try:
            out.append(modes.Mode(m))
        except ValueError:
            known = ", ".join(x.value for x in modes.Mode)
            raise errors.MigpilotError(f"node mode {m!r} is not one of {known}") from None
    return tuple(out)


def _sharing_request(
    rng: random.Random,
    tables: _ModelTables,
    *,
    kind: str,
    multi_instance_fraction: float,
    vgpu_mode_fraction: float,
    vgpu_modes: Sequence[str],
) -> tuple[tuple[modes.MpsRequest, ...], unified.UnifiedRequest | None, int]:
    """An MPS request by name (``kind`` mps) or a unified one (``unified``), sized for
    ``tables``' model, and its size in tenths of an 80 GB GPU (what CPU and memory scale by)."""
    cap = sharing_mps.memory_gb(tables.model)
    sizes, weights = _slice_sizes(cap)
    gb = rng.choices(sizes, weights)[0]
    count = rng.randint(2, 3) if rng.random() < multi_instance_fraction else 1
    units = max(1, round(gb * count / 10))
    if kind == "mps":
        return (modes.MpsRequest(gb, count),), None, units
    mib = pct = cores = None
    if rng.random() < 0.15:
        pct = max(1, gb * 100 // cap)
    else:
        mib = gb * 1024 - rng.randint(0, 1023)
    if rng.random() < _CORES_FRACTION:
        cores = rng.choice(_SLICE_CORES)
    mode = None
    if vgpu_modes and rng.random() < vgpu_mode_fraction:
        mode = rng.choice(vgpu_modes)
    ask = unified.GpuAsk(min(count, 2), memory_mib=mib, memory_percent=pct, cores_percent=cores)
    return (), unified.UnifiedRequest((ask,), mode=mode), units


def sharing_snapshot(
    *,
    seed: int,
    nodes: int,
    gpus_per_node: int,
    pods: int,
    node_modes: Sequence[str] = SHARING_MODES,
    models: Sequence[str] = DEFAULT_MODELS,
    used_fraction: float = 0.4,
    mps_fraction: float = 0.4,
    unified_fraction: float = 0.4,
    vgpu_mode_fraction: float = 0.3,
    selector_fraction: float = 0.1,
    priority_levels: int = 2,
    multi_instance_fraction: float = 0.15,
    cpu: bool = True,
) -> snapshot.Snapshot:
    """A random cluster whose nodes share GPUs in several modes (``docs/modes.md``).

    Node ``i`` is in mode ``node_modes[i % len(node_modes)]`` (one mode: ``("mps",)``; repeat a
    mode to weight it), labelled ``migpilot.io/mode``; otherwise nodes are drawn as in
    :func:`random_snapshot` (models, labels, taints, cordons, allocatable CPU and memory). MIG
    GPUs hold a random subset of a valid layout; MPS GPUs are partly sliced (a quarter not at
    all), each slice taken (used, or reserved for a pod) with probability ``used_fraction``;
    time-slicing GPUs have 2-8 replicas, each in use with probability ``used_fraction``.

    Pods: ``mps_fraction`` ask MPS slices by name (``nvidia.com/gpu-<N>gb``, nos's names, mostly
    5-20 GB, up to the GPU's memory), ``unified_fraction`` a unified request of one container
    (``nvidia.com/gpu`` with ``gpumem`` or ``gpumem-percentage`` of the same sizes, some with
    ``gpucores``), the rest MIG profiles by name as :func:`random_snapshot` draws them.
    ``multi_instance_fraction`` ask for 2-3 slices (unified: 2 GPUs, which MPS cannot serve).
    ``vgpu_mode_fraction`` of the unified pods carry ``nvidia.com/vgpu-mode`` (``mig`` or
    ``mps``, a mode the cluster has; none when it has neither). Selectors, tolerations,
    priorities as in :func:`random_snapshot`; with ``cpu``, allocatable CPU and memory as there
    and pods asking 0.25-2 cores and 2-16 GiB per compute slice (MIG) or per 10 GB (sliced
    pods), half :func:`random_snapshot`'s asks, so that they bind on some nodes, not on nearly
    all. Deterministic in all arguments.
    """
    _check_sizes(nodes=nodes, gpus_per_node=gpus_per_node, pods=pods)
    for name, value in (
        ("used_fraction", used_fraction),
        ("mps_fraction", mps_fraction),
        ("unified_fraction", unified_fraction),
        ("vgpu_mode_fraction", vgpu_mode_fraction),
        ("selector_fraction", selector_fraction),
        ("multi_instance_fraction", multi_instance_fraction),
    ):
        _check_fraction(name, value)
    if mps_fraction + unified_fraction > 1.0:
        raise errors.MigpilotError(
            f"mps_fraction + unified_fraction must be at most 1, got "
            f"{mps_fraction} + {unified_fraction}"
        )
    if priority_levels < 1:
        raise errors.MigpilotError(f"priority_levels must be at least 1, got {priority_levels}")
    cycle = _parse_modes(node_modes)
    tables = _resolve_models(models)
    rng = random.Random(seed)
    drawn, node_tables = _nodes(
        rng,
        tables=tables,
        nodes=nodes,
        gpus_per_node=gpus_per_node,
        used_fraction=used_fraction,
        allocatable=cpu,
        constrained=True,
    )
    node_list = tuple(
        _in_mode(rng, n, t, mode=cycle[i % len(cycle)], used_fraction=used_fraction)
        for i, (n, t) in enumerate(zip(drawn, node_tables, strict=True))
    )
    present_modes = {n.mode for n in node_list}
    vgpu_modes = tuple(m.value for m in (modes.Mode.MIG, modes.Mode.MPS) if m in present_modes)
    pod_models = node_tables or tables
    present = tuple(t for t in tables if t in node_tables) or tables
    width = _width(pods)
    pod_list: list[snapshot.Pod] = []
    for i in range(pods):
        table = rng.choice(pod_models)
        draw = rng.random()
        mig: tuple[snapshot.MigRequest, ...] = ()
        mps: tuple[modes.MpsRequest, ...] = ()
        request: unified.UnifiedRequest | None = None
        if draw < mps_fraction + unified_fraction:
            mps, request, units = _sharing_request(
                rng,
                table,
                kind="mps" if draw < mps_fraction else "unified",
                multi_instance_fraction=multi_instance_fraction,
                vgpu_mode_fraction=vgpu_mode_fraction,
                vgpu_modes=vgpu_modes,
            )
        else:
            mig, units = _mig_request(rng, table, multi_instance_fraction=multi_instance_fraction)
        selector, affinity, priority = _rules_and_priority(
            rng, present, selector_fraction=selector_fraction, priority_levels=priority_levels
        )
        cpu_milli = mem = 0
        if cpu:
            # Half random_snapshot's asks per unit: a GPU holds more sliced pods than MIG pods,
            # and at the full asks CPU and memory bound nearly every node, not some.
            cpu_milli = units * rng.choice((250, 500, 1000, 2000))
            mem = units * rng.choice((2, 4, 8, 16)) * _GIB
        pod_list.append(
            snapshot.Pod(
                name=f"pod-{i:0{width}d}",
                namespace=rng.choice(_NAMESPACES),
                priority=priority,
                mig=mig,
                mps=mps,
                unified=request,
                cpu_milli=cpu_milli,
                memory_bytes=mem,
                node_selector=selector,
                affinity=affinity,
                tolerations=_tolerations(rng),
            )
        )
    return snapshot.Snapshot(nodes=node_list, pods=tuple(pod_list))
