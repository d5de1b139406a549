"""Per-device, per-pod GPU use as Prometheus series rows: who holds which device, how busy it is.

Why it exists: dcgm-exporter attributes only whole GPUs and MIG devices to pods; migpilot also
hands out MPS slices and time-sliced replicas, and only the agent knows which pod holds each.
:func:`series` turns what the agent knows (the devices it advertises, who holds each one, one
sample per GPU, and which pod each process belongs to) into the rows the agent serves on
``/metrics`` (``docs/observability.md``, "Per-pod GPU metrics"). A reading the hardware cannot
give is left out, never reported as 0: no GPM before Hopper means no utilisation of an A100's
MIG instance.

It also holds the pure parsers the sampling shell needs: a process's cgroup text to its pod UID
(:func:`pod_uid`), and the ``--emulated-load`` file (:func:`parse_load`), turned into the
emulated backend's per-device loads by :func:`device_loads`.

Pure: no I/O, no clock; it imports only the device plugin's types, the GPU backend's types, the
GpuLayout's types and the strict YAML reader.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors, yamltext
from migpilot.agent.deviceplugin import devices
from migpilot.api import gpulayouts
from migpilot.gpu import backend, emulated

DEVICE_UTILIZATION = "migpilot_device_utilization_ratio"
DEVICE_MEMORY_USED = "migpilot_device_memory_used_bytes"
DEVICE_MEMORY_TOTAL = "migpilot_device_memory_total_bytes"
GPU_UTILIZATION = "migpilot_gpu_utilization_ratio"
GPU_MEMORY_USED = "migpilot_gpu_memory_used_bytes"
INSTANCES = "migpilot_instances"

HELP: dict[str, str] = {
    DEVICE_UTILIZATION: "SM utilisation (0-1) of a device handed to a container, where the "
    "GPU can say.",
    DEVICE_MEMORY_USED: "Device memory used on a device handed to a container (a shared "
    "device: by that pod's processes).",
    DEVICE_MEMORY_TOTAL: "Memory of a device handed to a container (an MPS slice: its pinned "
    "limit).",
    GPU_UTILIZATION: "SM utilisation (0-1) of a whole GPU, where the GPU can say.",
    GPU_MEMORY_USED: "Device memory used on a whole GPU.",
    INSTANCES: "MIG instances, and time-slicing replicas (profile replica), by profile and "
    "state (free, reserved, used).",
}
"""Each series' help text, in the order they are served."""

DEVICE_LABELS = (
    "node",
    "gpu",
    "gpu_uuid",
    "device",
    "resource",
    "profile",
    "namespace",
    "pod",
    "container",
)
STATES = ("free", "reserved", "used")
REPLICA_PROFILE = "replica"
"""The ``profile`` label of a time-slicing replica (a GPU shared as ``<gpu-uuid>::<id>``)."""
MIB = 1024 * 1024


@dataclass(frozen=True, slots=True)
class Holding:
    """One device handed to one container (a PodResources entry, or the simulated kubelet's)."""

    namespace: str
    pod: str
    container: str
    """Empty where the source does not say (the simulated kubelet's MIG assignments)."""
    resource: str
    device_id: str
    """The device-plugin ID: a GPU or MIG UUID, ``GPU-x::mps-3``, or a replica ``X::2``."""

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.pod}"


@dataclass(frozen=True, slots=True)
class Row:
    """One sample of one series."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def series(
    *,
    node: str,
    view: devices.NodeDevices,
    holdings: Iterable[Holding],
    samples: Mapping[int, backend.GpuSample],
    owners: Mapping[int, str] | None,
    in_use: frozenset[str] = frozenset(),
    reserved: frozenset[str] = frozenset(),
    replicas: Mapping[int, Sequence[gpulayouts.ReplicaStatus]] | None = None,
) -> tuple[Row, ...]:
    """The rows of every per-device, per-GPU and layout series, sorted.

    ``samples`` by GPU index (a GPU without one gets no utilisation or memory rows); ``owners``:
    pid -> ``namespace/name`` of its pod, ``None`` when processes cannot be attributed (then a
    shared device's memory and utilisation are absent); ``in_use`` and ``reserved``: MIG UUIDs
    the agent counts as used, or the GpuLayout reserves, beside those held; ``replicas``: GPU
    index -> its time-slicing replicas as the GpuLayout status reports them
    (:func:`~migpilot.agent.sharing.timeslicing.statuses`), counted in the layout series under
    profile ``replica`` as MIG instances are under theirs.
    """
    rows: list[Row] = []
    gpus = {g.index: g for g in view.gpus}
    by_uuid = {g.uuid: g for g in view.gpus}
    migs = {m.uuid: m for m in view.mig_devices}
    slices = view.slice_device_ids()
    held = list(holdings)
    for h in held:
        rows.extend(_device_rows(node, h, gpus, by_uuid, migs, slices, samples, owners))
    for g in view.gpus:
        sample = samples.get(g.index)
        if sample is None:
            continue
        labels = (("node", node), ("gpu", str(g.index)), ("gpu_uuid", g.uuid))
        if _ratio(sample.utilization) is not None:
            rows.append(Row(GPU_UTILIZATION, labels, _clip(sample.utilization)))
        if sample.memory_used_bytes is not None:
            rows.append(Row(GPU_MEMORY_USED, labels, float(sample.memory_used_bytes)))
    taken = {h.device_id.split("::", 1)[0] for h in held} | in_use
    counts: dict[tuple[int, str], dict[str, int]] = {}
    for m in view.mig_devices:
        state = "used" if m.uuid in taken else "reserved" if m.uuid in reserved else "free"
        per = counts.setdefault((m.gpu_index, m.profile.name), dict.fromkeys(STATES, 0))
        per[state] += 1
    for index, reps in (replicas or {}).items():
        per = counts.setdefault((index, REPLICA_PROFILE), dict.fromkeys(STATES, 0))
        for r in reps:
            per[r.state.value] += 1
    for (index, profile), per in counts.items():
        for state, n in per.items():
            layout = (("node", node), ("gpu", str(index)), ("profile", profile), ("state", state))
            rows.append(Row(INSTANCES, layout, float(n)))
    return tuple(sorted(rows, key=lambda r: (r.name, r.labels)))


def reserved_instances(
    spec: gpulayouts.LayoutSpec | None, view: devices.NodeDevices
) -> frozenset[str]:
    """The MIG device UUIDs of ``view`` whose instance (GPU, start, profile) the GpuLayout
    ``spec`` reserves for a pod: :func:`series` counts them ``reserved`` until a pod holds them."""
    if spec is None:
        return frozenset()
    wanted = {
        (g.index, i.start, i.profile)
        for g in spec.gpus
        for i in g.instances
        if i.reserved_for is not None
    }
    return frozenset(
        m.uuid for m in view.mig_devices if (m.gpu_index, m.start, m.profile.name) in wanted
    )


def _device_rows(  # noqa: PLR0917 - a private helper of series(), called once
    node: str,
    h: Holding,
    gpus: Mapping[int, devices.Gpu],
    by_uuid: Mapping[str, devices.Gpu],
    migs: Mapping[str, devices.MigDevice],
    slices: Mapping[str, devices.MpsSlice],
    samples: Mapping[int, backend.GpuSample],
    owners: Mapping[int, str] | None,
) -> list[Row]:
    real, mark, _ = h.device_id.partition("::")
    mig = migs.get(real)
    gpu = gpus.get(mig.gpu_index) if mig is not None else by_uuid.get(real)
    if gpu is None:
        return []  # a device no longer in the view: gone before the next pass
    sample = samples.get(gpu.index)
    sl = slices.get(h.device_id)
    profile = (
        f"mps-{sl.memory_gb}gb"
        if sl is not None
        else mig.profile.name
        if mig is not None
        else REPLICA_PROFILE
        if mark
        else ""
    )
    labels = (
        ("node", node),
        ("gpu", str(gpu.index)),
        ("gpu_uuid", gpu.uuid),
        ("device", h.device_id),
        ("resource", h.resource),
        ("profile", profile),
        ("namespace", h.namespace),
        ("pod", h.pod),
        ("container", h.container),
    )
    util: float | None = None
    used: int | None = None
    total: int | None = None
    instance = None
    if sample is not None and mig is not None:
        instance = next((i for i in sample.instances if i.gi_id == mig.gpu_instance_id), None)
    if sl is not None:
        total = sl.memory_gb * 1024 * MIB
    elif mig is not None:
        total = instance.memory_total_bytes if instance is not None else None
    elif sample is not None:
        total = sample.memory_total_bytes
    if sample is not None and not mark:  # the device is the container's alone
        if mig is not None:
            if instance is not None:
                util, used = instance.utilization, instance.memory_used_bytes
        else:
            util, used = sample.utilization, sample.memory_used_bytes
    elif sample is not None and owners is not None and sample.processes is not None:
        gi = mig.gpu_instance_id if mig is not None else None
        mine = [
            p
            for p in sample.processes
            if owners.get(p.pid) == h.key and (mig is None or p.gi_id == gi)
        ]
        if all(p.memory_used_bytes is not None for p in mine):
            used = sum(p.memory_used_bytes or 0 for p in mine)
        if mine and all(p.utilization is not None for p in mine):
            util = sum(p.utilization or 0.0 for p in mine)
    out: list[Row] = []
    if _ratio(util) is not None:
        out.append(Row(DEVICE_UTILIZATION, labels, _clip(util)))
    if used is not None:
        out.append(Row(DEVICE_MEMORY_USED, labels, float(used)))
    if total is not None:
        out.append(Row(DEVICE_MEMORY_TOTAL, labels, float(total)))
    return out


def _ratio(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else value


def _clip(value: float | None) -> float:
    return min(max(value or 0.0, 0.0), 1.0)


# --- which pod a process belongs to ----------------------------------------------------------

_POD_UID = re.compile(
    r"(?:^|[/-])pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})"
    r"(?:\.slice)?(?:/|$)"
)


def pod_uid(cgroup_text: str) -> str | None:
    """The pod UID in the text of ``/proc/<pid>/cgroup``, ``None`` for a process of no pod.

    Reads cgroup v1 (``N:controller:/path``) and v2 (``0::/path``) lines, with the kubelet's
    cgroupfs driver (``/kubepods/burstable/pod<uid>/...``) and its systemd driver
    (``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>
    .slice/...``).
    """
    for line in cgroup_text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")
        if "kubepods" not in path:
            continue
        found = _POD_UID.search(path)
        if found is not None:
            return found.group(1).replace("_", "-")
    return None


# --- the --emulated-load file ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodLoad:
    """What one pod is made to do (a value of the ``--emulated-load`` map)."""

    utilization: float
    """0-1."""
    memory_used_mib: int


IDLE = PodLoad(0.0, 0)
"""A pod missing from the file."""


def parse_load(text: str, *, source: str) -> dict[str, PodLoad]:
    """``NAMESPACE/POD: {utilization: 0.0-1.0, memoryUsedMiB: N}`` lines; an empty file is an
    empty map. ``POD`` may hold ``*`` wildcards (``ml/web-*``: every replica of a Deployment,
    whose pod names are random; see :func:`load_of`). A bad entry raises
    :class:`~migpilot.errors.AgentConfigError` naming the source, the pod and the field."""
    data: Any = yamltext.load(text, source=source, error=errors.AgentConfigError)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise errors.AgentConfigError(f"{source}: expected a map of NAMESPACE/POD to loads")
    out: dict[str, PodLoad] = {}
    for key, entry in data.items():
        namespace, slash, name = str(key).partition("/")
        if not isinstance(key, str) or not slash or not namespace or not name or "/" in name:
            raise errors.AgentConfigError(f"{source}: {key!r}: expected NAMESPACE/POD")
        if not isinstance(entry, Mapping):
            raise errors.AgentConfigError(
                f"{source}: {key}: expected {{utilization: 0.0-1.0, memoryUsedMiB: N}}"
            )
        unknown = sorted(str(k) for k in entry if k not in ("utilization", "memoryUsedMiB"))
        if unknown:
            raise errors.AgentConfigError(
                f"{source}: {key}: unknown field {unknown[0]!r} (known: utilization, memoryUsedMiB)"
            )
        util = entry.get("utilization", 0.0)
        if (
            isinstance(util, bool)
            or not isinstance(util, int | float)
            or not math.isfinite(util)
            or not 0.0 <= util <= 1.0
        ):
            raise errors.AgentConfigError(
                f"{source}: {key}: utilization: expected a number from 0.0 to 1.0, got {util!r}"
            )
        mem = entry.get("memoryUsedMiB", 0)
        if isinstance(mem, bool) or not isinstance(mem, int) or mem < 0:
            raise errors.AgentConfigError(
                f"{source}: {key}: memoryUsedMiB: expected a whole number of MiB >= 0, got {mem!r}"
            )
        out[key] = PodLoad(float(util), mem)
    return out


def load_of(pods: Mapping[str, PodLoad], key: str) -> PodLoad:
    """The load of pod ``key`` (``namespace/name``): its own entry, else the first entry whose
    pod name is a ``*`` pattern matching it in the same namespace (in the file's order), else
    idle."""
    if key in pods:
        return pods[key]
    namespace, _, name = key.partition("/")
    for pattern, load in pods.items():
        space, _, wanted = pattern.partition("/")
        if "*" in wanted and space == namespace and fnmatch.fnmatchcase(name, wanted):
            return load
    return IDLE


def device_loads(
    pods: Mapping[str, PodLoad], holdings: Sequence[Holding]
) -> dict[str, emulated.Load]:
    """Device ID -> its emulated load: each device a pod holds does what the pod is set to do
    (:func:`load_of`: a pod the file does not name is idle)."""
    return {
        h.device_id: emulated.Load(
            (load := load_of(pods, h.key)).utilization, load.memory_used_mib, h.key
        )
        for h in holdings
    }
