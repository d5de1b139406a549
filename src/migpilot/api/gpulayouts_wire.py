"""The GpuLayout's wire format: the JSON the API server holds, parsed into and written from the
values of :mod:`migpilot.api.gpulayouts`.

Raw JSON crosses the boundary as the TypedDicts below; inside, everything is frozen dataclasses.
:func:`parse` rejects bad input with one line naming the field
(``spec.gpus[1].instances[0].start: ...``) and checks what the CRD's OpenAPI schema cannot (the
profiles and layouts a known GPU model allows, MPS slices that fit the GPU);
:func:`to_document` is its inverse; :func:`spec_patch` and :func:`status_patch` hold only the
fields their writer owns. The CRD YAML in ``deploy/crds/`` is the same schema for the
apiserver (the patterns below are its patterns), and a unit test keeps the two in step.

Pure core: imports :mod:`migpilot.api.gpulayouts`, :mod:`migpilot.mig`,
:mod:`migpilot.sharing` and :mod:`migpilot.errors` only; never the planner, no Kubernetes
client, no clock.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict

from migpilot import errors
from migpilot.api import gpulayouts
from migpilot.mig import catalog, layouts, profiles
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

PROFILE_PATTERN = r"^[0-9]+g\.[0-9]+gb(\+me|\+me\.all|\+gfx|-me)?$"
"""GPU-instance profile names in NVIDIA's canonical spelling (the CRD's pattern)."""
MAX_START = 11
"""Highest start memory slot any catalog GPU allows (RTX PRO 6000 Blackwell: 12 slots)."""
RESERVED_FOR_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z0-9]([-.a-z0-9]*[a-z0-9])?$"
"""``namespace/name`` of a pod (the CRD's pattern)."""
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
"""A condition's reason, as ``metav1.Condition`` allows it."""
_TIME_PATTERN = (
    r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?(Z|[+-][0-9]{2}:[0-9]{2})$"
)

_PROFILE = re.compile(PROFILE_PATTERN)
_RESERVED_FOR = re.compile(RESERVED_FOR_PATTERN)
_REASON = re.compile(REASON_PATTERN)
_TIME = re.compile(_TIME_PATTERN)


# --------------------------------------------------------------------------- raw JSON


class InstanceSpecDoc(TypedDict):
    profile: str
    start: int
    reservedFor: NotRequired[str]
    resource: NotRequired[str]


class SliceSpecDoc(TypedDict):
    id: int
    memoryGB: int
    cores: NotRequired[int]
    reservedFor: NotRequired[str]
    resource: NotRequired[str]


class ReplicaSpecDoc(TypedDict):
    id: int
    reservedFor: str


class GpuSpecDoc(TypedDict):
    index: int
    model: NotRequired[str]
    instances: list[InstanceSpecDoc]
    mps: NotRequired[list[SliceSpecDoc]]
    replicas: NotRequired[list[ReplicaSpecDoc]]
    mig: NotRequired[bool]
    reservedFor: NotRequired[str]


class SpecDoc(TypedDict):
    gpus: list[GpuSpecDoc]


class InstanceStatusDoc(TypedDict):
    profile: str
    start: int
    uuid: NotRequired[str]
    state: str
    usedBy: NotRequired[str]


class SliceStatusDoc(TypedDict):
    id: int
    memoryGB: int
    cores: NotRequired[int]
    state: str
    usedBy: NotRequired[str]


class ReplicaStatusDoc(TypedDict):
    id: int
    state: str
    usedBy: NotRequired[str]


class MigModeDoc(TypedDict):
    current: bool
    pending: bool


class GpuStatusDoc(TypedDict):
    index: int
    model: str
    uuid: str
    instances: list[InstanceStatusDoc]
    mps: NotRequired[list[SliceStatusDoc]]
    replicas: NotRequired[list[ReplicaStatusDoc]]
    migMode: NotRequired[MigModeDoc]


class ConditionDoc(TypedDict):
    type: str
    status: str
    reason: str
    message: str
    lastTransitionTime: str
    observedGeneration: NotRequired[int]


class SummaryDoc(TypedDict):
    gpus: int
    instances: int
    free: int


class StatusDoc(TypedDict):
    observedGeneration: NotRequired[int]
    summary: SummaryDoc
    gpus: list[GpuStatusDoc]
    conditions: list[ConditionDoc]


class MetadataDoc(TypedDict):
    name: str
    generation: NotRequired[int]
    resourceVersion: NotRequired[str]
    annotations: NotRequired[dict[str, str]]


class GpuLayoutDoc(TypedDict):
    apiVersion: str
    kind: str
    metadata: MetadataDoc
    spec: NotRequired[SpecDoc]
    status: NotRequired[StatusDoc]


# --------------------------------------------------------------------------- parsing


def _fail(where: str, what: str) -> errors.GpuLayoutError:
    return errors.GpuLayoutError(f"{where}: {what}")


def _mapping(value: Any, where: str, *, required: bool = False) -> Mapping[str, Any]:
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        raise _fail(where, "expected an object")
    return value


def _list(value: Any, where: str) -> Sequence[Any]:
    if value is None:
        return ()
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise _fail(where, "expected a list")
    return value


def _only(d: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    unknown = sorted(str(k) for k in d if k not in allowed)
    if unknown:
        raise _fail(
            f"{where}.{unknown[0]}", f"unknown field (allowed: {', '.join(sorted(allowed))})"
        )


def _str(d: Mapping[str, Any], key: str, where: str) -> str:
    value = d.get(key)
    if not isinstance(value, str) or not value:
        raise _fail(f"{where}.{key}", f"expected a non-empty string, got {value!r}")
    return value


def _int(d: Mapping[str, Any], key: str, where: str, *, maximum: int | None = None) -> int:
    value = d.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(f"{where}.{key}", f"expected an integer, got {value!r}")
    if value < 0 or (maximum is not None and value > maximum):
        bound = f"0..{maximum}" if maximum is not None else ">= 0"
        raise _fail(f"{where}.{key}", f"{value} is out of range ({bound})")
    return value


def _model(d: Mapping[str, Any], where: str, *, required: bool) -> profiles.GpuModel | None:
    if not required and d.get("model") is None:
        return None
    text = _str(d, "model", where)
    try:
        return catalog.resolve_gpu(text)
    except errors.UnknownGpuError as err:
        raise _fail(f"{where}.model", str(err)) from None


def _profile(d: Mapping[str, Any], where: str, model: profiles.GpuModel | None) -> str:
    name = _str(d, "profile", where)
    if not _PROFILE.match(name):
        raise _fail(
            f"{where}.profile",
            f"{name!r} is not a profile name in NVIDIA's spelling (3g.40gb, 1g.10gb+me)",
        )
    if model is not None:
        try:
            canonical = model.resolve_profile(name).name
        except errors.UnknownProfileError as err:
            raise _fail(f"{where}.profile", str(err)) from None
        if canonical != name:
            raise _fail(f"{where}.profile", f"{model.id} calls {name!r} {canonical!r}")
    return name


def _unique_starts(starts: Sequence[int], where: str) -> None:
    seen: set[int] = set()
    for j, start in enumerate(starts):
        if start in seen:
            raise _fail(f"{where}[{j}].start", f"a second instance at start {start} (never merged)")
        seen.add(start)


def _check_layout(
    model: profiles.GpuModel | None, insts: Sequence[layouts.Instance], where: str
) -> None:
    if model is None:
        return
    reason = layouts.violation(model, insts)
    if reason is not None:
        raise _fail(where, f"not a valid layout of {model.id}: {reason}")


def _unique_indexes(indexes: Sequence[int], where: str) -> None:
    seen: set[int] = set()
    for i, index in enumerate(indexes):
        if index in seen:
            raise _fail(f"{where}[{i}].index", f"a second GPU with index {index}")
        seen.add(index)


def _instance_spec(
    raw: Any, where: str, model: profiles.GpuModel | None
) -> gpulayouts.InstanceSpec:
    d = _mapping(raw, where, required=True)
    _only(d, frozenset({"profile", "start", "reservedFor", "resource"}), where)
    profile = _profile(d, where, model)
    start = _int(d, "start", where, maximum=MAX_START)
    reserved: str | None = None
    if d.get("reservedFor") is not None:
        reserved = _str(d, "reservedFor", where)
        if not _RESERVED_FOR.match(reserved):
            raise _fail(f"{where}.reservedFor", f"{reserved!r} is not namespace/name of a pod")
    return gpulayouts.InstanceSpec(profile, start, reserved, _unified_resource(d, where, reserved))


def _unified_resource(d: Mapping[str, Any], where: str, reserved: str | None) -> str | None:
    """``resource`` of a reserved instance or slice: absent, or
    :data:`gpulayouts.UNIFIED_RESOURCE`."""
    if d.get("resource") is None:
        return None
    resource = _str(d, "resource", where)
    if resource != gpulayouts.UNIFIED_RESOURCE:
        raise _fail(f"{where}.resource", f"{resource!r} is not {gpulayouts.UNIFIED_RESOURCE}")
    if reserved is None:
        raise _fail(f"{where}.resource", "only a reserved instance or slice has one")
    return resource


def _pod_name(d: Mapping[str, Any], key: str, where: str) -> str | None:
    if d.get(key) is None:
        return None
    name = _str(d, key, where)
    if not _RESERVED_FOR.match(name):
        raise _fail(f"{where}.{key}", f"{name!r} is not namespace/name of a pod")
    return name


def _slice_common(d: Mapping[str, Any], where: str) -> tuple[int, int, int | None]:
    ident = _int(d, "id", where, maximum=sharing_config.MPS_MAX_CLIENTS * 1000)
    gb = _int(d, "memoryGB", where)
    if gb < 1:
        raise _fail(f"{where}.memoryGB", "a slice holds at least 1 GB")
    cores = None
    if d.get("cores") is not None:
        cores = _int(d, "cores", where, maximum=100)
        if cores < 1:
            raise _fail(f"{where}.cores", "a compute share is 1 to 100 percent")
    return ident, gb, cores


def _slice_spec(raw: Any, where: str) -> gpulayouts.SliceSpec:
    d = _mapping(raw, where, required=True)
    _only(d, frozenset({"id", "memoryGB", "cores", "reservedFor", "resource"}), where)
    ident, gb, cores = _slice_common(d, where)
    reserved = _pod_name(d, "reservedFor", where)
    return gpulayouts.SliceSpec(ident, gb, cores, reserved, _unified_resource(d, where, reserved))


def _slice_status(raw: Any, where: str) -> gpulayouts.SliceStatus:
    d = _mapping(raw, where, required=True)
    _only(d, frozenset({"id", "memoryGB", "cores", "state", "usedBy"}), where)
    ident, gb, cores = _slice_common(d, where)
    state, used_by = _shared_state(d, where, what="slice")
    return gpulayouts.SliceStatus(ident, gb, cores, state, used_by)


def _shared_state(
    d: Mapping[str, Any], where: str, *, what: str
) -> tuple[gpulayouts.InstanceState, str | None]:
    """The ``state`` and ``usedBy`` of an MPS slice or a time-slicing replica (``what``): both
    are made and removed with the agent's bookkeeping, so only free, reserved or used, and only
    a used one names its pod."""
    text = d.get("state")
    try:
        state = gpulayouts.InstanceState(str(text))
    except ValueError:
        state = None
    if state is None or state not in gpulayouts.SLICE_STATES:
        names = ", ".join(sorted(x.value for x in gpulayouts.SLICE_STATES))
        raise _fail(f"{where}.state", f"{text!r} is not one of {names}")
    used_by = _pod_name(d, "usedBy", where)
    if used_by is not None and state is not gpulayouts.InstanceState.USED:
        raise _fail(f"{where}.usedBy", f"only a used {what} has one (state {state.value})")
    return state, used_by


def _slices(
    raw: Any, where: str, model: profiles.GpuModel | None, parse_one: Any
) -> tuple[Any, ...]:
    found = [parse_one(r, f"{where}[{j}]") for j, r in enumerate(_list(raw, where))]
    seen: set[int] = set()
    for j, sl in enumerate(found):
        if sl.id in seen:
            raise _fail(f"{where}[{j}].id", f"a second slice with id {sl.id}")
        seen.add(sl.id)
    most = sharing_config.MPS_MAX_CLIENTS
    if len(found) > most:
        raise _fail(where, f"{len(found)} slices; MPS serves at most {most}")
    # The spec must fit its GPU; a status reports what is, and may not: the agent keeps
    # serving a held slice the spec dropped (the kubelet handed it out before the agent applied
    # the spec) beside the spec's new ones. Refusing that report would hide the node's slices
    # from the controller (the soak lost its MPS node so).
    if model is not None and parse_one is _slice_spec:
        total, cap = sum(sl.memory_gb for sl in found), sharing_mps.memory_gb(model)
        if total > cap:
            raise _fail(where, f"slices of {total} GB exceed the {cap} GB of a {model.id}")
    return tuple(sorted(found, key=lambda sl: sl.id))


def _replica_id(d: Mapping[str, Any], where: str) -> int:
    return _int(d, "id", where, maximum=sharing_config.MAX_REPLICAS - 1)


def _replica_spec(raw: Any, where: str) -> gpulayouts.ReplicaSpec:
    d = _mapping(raw, where, required=True)
    _only(d, frozenset({"id", "reservedFor"}), where)
    ident = _replica_id(d, where)
    reserved = _pod_name(d, "reservedFor", where)
    if reserved is None:
        raise _fail(f"{where}.reservedFor", "required: only replicas kept for a pod are listed")
    return gpulayouts.ReplicaSpec(ident, reserved)


def _replica_status(raw: Any, where: str) -> gpulayouts.ReplicaStatus:
    d = _mapping(raw, where, required=True)
    _only(d, frozenset({"id", "state", "usedBy"}), where)
    ident = _replica_id(d, where)
    state, used_by = _shared_state(d, where, what="replica")
    return gpulayouts.ReplicaStatus(ident, state, used_by)


def _replicas(raw: Any, where: str, parse_one: Any) -> tuple[Any, ...]:
    items = _list(raw, where)
    most = sharing_config.MAX_REPLICAS
    if len(items) > most:
        raise _fail(where, f"{len(items)} replicas; a GPU has at most {most}")
    found = [parse_one(r, f"{where}[{j}]") for j, r in enumerate(items)]
    seen: set[int] = set()
    for j, r in enumerate(found):
        if r.id in seen:
            raise _fail(f"{where}[{j}].id", f"a second replica with id {r.id}")
        seen.add(r.id)
    return tuple(sorted(found, key=lambda r: r.id))


def _one_kind(where: str, insts: Sequence[Any], mps: Sequence[Any], reps: Sequence[Any]) -> None:
    if reps and (insts or mps):
        raise _fail(
            f"{where}.replicas",
            "a GPU holds MIG instances, MPS slices or time-slicing replicas, one kind only",
        )


def _gpu_spec(raw: Any, where: str) -> gpulayouts.GpuSpec:
    d = _mapping(raw, where, required=True)
    allowed = {"index", "model", "instances", "mps", "replicas", "mig", "reservedFor"}
    _only(d, frozenset(allowed), where)
    index = _int(d, "index", where)
    mig = d.get("mig")
    if mig is not None and not isinstance(mig, bool):
        raise _fail(f"{where}.mig", f"expected true or false, got {mig!r}")
    model = _model(d, where, required=False)
    w = f"{where}.instances"
    insts = [
        _instance_spec(r, f"{w}[{j}]", model) for j, r in enumerate(_list(d.get("instances"), w))
    ]
    _unique_starts([i.start for i in insts], w)
    _check_layout(model, [layouts.Instance(i.start, i.profile) for i in insts], w)
    mps = _slices(d.get("mps"), f"{where}.mps", model, _slice_spec)
    if mps and insts:
        raise _fail(f"{where}.mps", "a GPU holds MIG instances or MPS slices, not both")
    reps = _replicas(d.get("replicas"), f"{where}.replicas", _replica_spec)
    _one_kind(where, insts, mps, reps)
    if mig is False and insts:
        raise _fail(f"{where}.mig", "a GPU with MIG off (mig: false) holds no MIG instances")
    if mig is True and (mps or reps):
        raise _fail(f"{where}.mig", "MPS slices and time-slicing replicas need MIG off")
    reserved = _pod_name(d, "reservedFor", where)
    if reserved is not None and (mig is not False or mps or reps):
        raise _fail(
            f"{where}.reservedFor",
            "only a whole GPU (mig: false, no MPS slices or replicas) is reserved for a pod",
        )
    return gpulayouts.GpuSpec(
        index,
        d["model"] if model is not None else None,
        tuple(sorted(insts, key=lambda i: i.start)),
        mps,
        reps,
        mig,
        reserved,
    )


def _spec(raw: Any) -> gpulayouts.LayoutSpec:
    d = _mapping(raw, "spec", required=True)
    _only(d, frozenset({"gpus"}), "spec")
    gpus = [
        _gpu_spec(g, f"spec.gpus[{i}]") for i, g in enumerate(_list(d.get("gpus"), "spec.gpus"))
    ]
    _unique_indexes([g.index for g in gpus], "spec.gpus")
    return gpulayouts.LayoutSpec(tuple(sorted(gpus, key=lambda g: g.index)))


def _instance_status(raw: Any, where: str, model: profiles.GpuModel) -> gpulayouts.InstanceStatus:
    d = _mapping(raw, where, required=True)
    _only(d, frozenset({"profile", "start", "uuid", "state", "usedBy"}), where)
    profile = _profile(d, where, model)
    start = _int(d, "start", where, maximum=MAX_START)
    text = d.get("state")
    try:
        state = gpulayouts.InstanceState(str(text))
    except ValueError:
        names = ", ".join(s.value for s in gpulayouts.InstanceState)
        raise _fail(f"{where}.state", f"{text!r} is not one of {names}") from None
    uuid: str | None = None
    if d.get("uuid") is not None or state is not gpulayouts.InstanceState.CREATING:
        uuid = _str(d, "uuid", where)
    used_by: str | None = None
    if d.get("usedBy") is not None:
        used_by = _str(d, "usedBy", where)
        if not _RESERVED_FOR.match(used_by):
            raise _fail(f"{where}.usedBy", f"{used_by!r} is not namespace/name of a pod")
        if state is not gpulayouts.InstanceState.USED:
            raise _fail(f"{where}.usedBy", f"only a used instance has one (state {state.value})")
    return gpulayouts.InstanceStatus(profile, start, uuid, state, used_by)


def _gpu_status(raw: Any, where: str) -> gpulayouts.GpuStatus:
    d = _mapping(raw, where, required=True)
    allowed = {"index", "model", "uuid", "instances", "mps", "replicas", "migMode"}
    _only(d, frozenset(allowed), where)
    index = _int(d, "index", where)
    model = _model(d, where, required=True)
    assert model is not None
    uuid = _str(d, "uuid", where)
    w = f"{where}.instances"
    insts = [
        _instance_status(r, f"{w}[{j}]", model) for j, r in enumerate(_list(d.get("instances"), w))
    ]
    _unique_starts([i.start for i in insts], w)
    _check_layout(model, [layouts.Instance(i.start, i.profile) for i in insts], w)
    mps = _slices(d.get("mps"), f"{where}.mps", model, _slice_status)
    if mps and insts:
        raise _fail(f"{where}.mps", "a GPU holds MIG instances or MPS slices, not both")
    reps = _replicas(d.get("replicas"), f"{where}.replicas", _replica_status)
    _one_kind(where, insts, mps, reps)
    mode = _mig_mode(d.get("migMode"), f"{where}.migMode")
    if mode is not None and not mode.current and insts:
        raise _fail(f"{where}.migMode", "a GPU with MIG off holds no MIG instances")
    if mode is not None and mode.current and (mps or reps):
        raise _fail(f"{where}.migMode", "MPS slices and time-slicing replicas need MIG off")
    return gpulayouts.GpuStatus(
        index, d["model"], uuid, tuple(sorted(insts, key=lambda i: i.start)), mps, reps, mode
    )


def _mig_mode(raw: Any, where: str) -> gpulayouts.MigModeStatus | None:
    if raw is None:
        return None
    d = _mapping(raw, where, required=True)
    _only(d, frozenset({"current", "pending"}), where)
    values = []
    for key in ("current", "pending"):
        value = d.get(key)
        if not isinstance(value, bool):
            raise _fail(f"{where}.{key}", f"expected true or false, got {value!r}")
        values.append(value)
    return gpulayouts.MigModeStatus(values[0], values[1])


def _condition(raw: Any, where: str) -> gpulayouts.Condition:
    d = _mapping(raw, where, required=True)
    allowed = {"type", "status", "reason", "message", "lastTransitionTime", "observedGeneration"}
    _only(d, frozenset(allowed), where)
    text = d.get("status")
    try:
        status = gpulayouts.ConditionStatus(str(text))
    except ValueError:
        raise _fail(f"{where}.status", f"{text!r} is not True, False or Unknown") from None
    reason = _str(d, "reason", where)
    if not _REASON.match(reason):
        raise _fail(f"{where}.reason", f"{reason!r} is not a CamelCase reason")
    message = d.get("message", "")
    if not isinstance(message, str):
        raise _fail(f"{where}.message", "expected a string")
    time = _str(d, "lastTransitionTime", where)
    if not _TIME.match(time):
        raise _fail(f"{where}.lastTransitionTime", f"{time!r} is not an RFC 3339 time")
    generation = None
    if d.get("observedGeneration") is not None:
        generation = _int(d, "observedGeneration", where)
    return gpulayouts.Condition(_str(d, "type", where), status, reason, message, time, generation)


def _status(raw: Any) -> gpulayouts.LayoutStatus | None:
    if raw is None:
        return None
    d = _mapping(raw, "status", required=True)
    _only(d, frozenset({"observedGeneration", "summary", "gpus", "conditions"}), "status")
    generation = None
    if d.get("observedGeneration") is not None:
        generation = _int(d, "observedGeneration", "status")
    gpus = [
        _gpu_status(g, f"status.gpus[{i}]")
        for i, g in enumerate(_list(d.get("gpus"), "status.gpus"))
    ]
    _unique_indexes([g.index for g in gpus], "status.gpus")
    w = "status.conditions"
    conditions = [_condition(c, f"{w}[{i}]") for i, c in enumerate(_list(d.get("conditions"), w))]
    types = [c.type for c in conditions]
    for i, t in enumerate(types):
        if t in types[:i]:
            raise _fail(f"{w}[{i}].type", f"a second condition of type {t!r}")
    status = gpulayouts.LayoutStatus(
        generation, tuple(sorted(gpus, key=lambda g: g.index)), tuple(conditions)
    )
    if d.get("summary") is not None:
        s = _mapping(d["summary"], "status.summary")
        _only(s, frozenset({"gpus", "instances", "free"}), "status.summary")
        given = gpulayouts.Summary(
            *(_int(s, k, "status.summary") for k in ("gpus", "instances", "free"))
        )
        if given != status.summary:
            want = status.summary
            raise _fail(
                "status.summary",
                f"counts {given.gpus}/{given.instances}/{given.free} disagree with status.gpus "
                f"({want.gpus} GPUs, {want.instances} instances, {want.free} free)",
            )
    return status


def parse(document: Any) -> gpulayouts.GpuLayout:
    """A GpuLayout from its decoded JSON (as the apiserver returns it, or as a file holds it).

    Raise :class:`GpuLayoutError` with one line naming the field. Beyond the CRD's schema this
    checks what OpenAPI cannot: profiles the GPU's model offers and valid layouts (when the
    model is known), and no two instances at one start (rejected, never merged).
    """
    d = _mapping(document, "GpuLayout", required=True)
    _only(d, frozenset({"apiVersion", "kind", "metadata", "spec", "status"}), "GpuLayout")
    if d.get("apiVersion") != gpulayouts.API_VERSION:
        raise _fail("apiVersion", f"expected {gpulayouts.API_VERSION}, got {d.get('apiVersion')!r}")
    if d.get("kind") != gpulayouts.KIND:
        raise _fail("kind", f"expected {gpulayouts.KIND}, got {d.get('kind')!r}")
    meta = _mapping(d.get("metadata"), "metadata", required=True)
    name = _str(meta, "name", "metadata")
    generation = None
    if meta.get("generation") is not None:
        generation = _int(meta, "generation", "metadata")
    return gpulayouts.GpuLayout(name, _spec(d.get("spec")), _status(d.get("status")), generation)


# --------------------------------------------------------------------------- writing


def _spec_doc(spec: gpulayouts.LayoutSpec) -> SpecDoc:
    gpus: list[GpuSpecDoc] = []
    for g in spec.gpus:
        instances: list[InstanceSpecDoc] = []
        for i in g.instances:
            inst: InstanceSpecDoc = {"profile": i.profile, "start": i.start}
            if i.reserved_for is not None:
                inst["reservedFor"] = i.reserved_for
            if i.resource is not None:
                inst["resource"] = i.resource
            instances.append(inst)
        gpu: GpuSpecDoc = {"index": g.index, "instances": instances}
        if g.model is not None:
            gpu["model"] = g.model
        if g.mps:
            slices: list[SliceSpecDoc] = []
            for sl in g.mps:
                doc: SliceSpecDoc = {"id": sl.id, "memoryGB": sl.memory_gb}
                if sl.cores is not None:
                    doc["cores"] = sl.cores
                if sl.reserved_for is not None:
                    doc["reservedFor"] = sl.reserved_for
                if sl.resource is not None:
                    doc["resource"] = sl.resource
                slices.append(doc)
            gpu["mps"] = slices
        if g.replicas:
            gpu["replicas"] = [{"id": r.id, "reservedFor": r.reserved_for} for r in g.replicas]
        if g.mig is not None:
            gpu["mig"] = g.mig
        if g.reserved_for is not None:
            gpu["reservedFor"] = g.reserved_for
        gpus.append(gpu)
    return {"gpus": gpus}


def _status_doc(status: gpulayouts.LayoutStatus) -> StatusDoc:
    gpus: list[GpuStatusDoc] = []
    for g in status.gpus:
        instances: list[InstanceStatusDoc] = []
        for i in g.instances:
            inst: InstanceStatusDoc = {
                "profile": i.profile,
                "start": i.start,
                "state": i.state.value,
            }
            if i.uuid is not None:
                inst["uuid"] = i.uuid
            if i.used_by is not None:
                inst["usedBy"] = i.used_by
            instances.append(inst)
        gpu: GpuStatusDoc = {
            "index": g.index,
            "model": g.model,
            "uuid": g.uuid,
            "instances": instances,
        }
        if g.mig_mode is not None:
            gpu["migMode"] = {"current": g.mig_mode.current, "pending": g.mig_mode.pending}
        if g.mps:
            slices: list[SliceStatusDoc] = []
            for sl in g.mps:
                one: SliceStatusDoc = {
                    "id": sl.id,
                    "memoryGB": sl.memory_gb,
                    "state": sl.state.value,
                }
                if sl.cores is not None:
                    one["cores"] = sl.cores
                if sl.used_by is not None:
                    one["usedBy"] = sl.used_by
                slices.append(one)
            gpu["mps"] = slices
        if g.replicas:
            replicas: list[ReplicaStatusDoc] = []
            for r in g.replicas:
                rep: ReplicaStatusDoc = {"id": r.id, "state": r.state.value}
                if r.used_by is not None:
                    rep["usedBy"] = r.used_by
                replicas.append(rep)
            gpu["replicas"] = replicas
        gpus.append(gpu)
    conditions: list[ConditionDoc] = []
    for c in status.conditions:
        cond: ConditionDoc = {
            "type": c.type,
            "status": c.status.value,
            "reason": c.reason,
            "message": c.message,
            "lastTransitionTime": c.last_transition_time,
        }
        if c.observed_generation is not None:
            cond["observedGeneration"] = c.observed_generation
        conditions.append(cond)
    s = status.summary
    doc: StatusDoc = {
        "summary": {"gpus": s.gpus, "instances": s.instances, "free": s.free},
        "gpus": gpus,
        "conditions": conditions,
    }
    if status.observed_generation is not None:
        doc["observedGeneration"] = status.observed_generation
    return doc


def _object(name: str) -> GpuLayoutDoc:
    return {
        "apiVersion": gpulayouts.API_VERSION,
        "kind": gpulayouts.KIND,
        "metadata": {"name": name},
    }


def to_document(layout: gpulayouts.GpuLayout) -> GpuLayoutDoc:
    """The whole object as JSON (inverse of :func:`parse`; deterministic: GPUs by index,
    instances by start, states as plain strings)."""
    doc = _object(layout.name)
    if layout.generation is not None:
        doc["metadata"]["generation"] = layout.generation
    doc["spec"] = _spec_doc(layout.spec)
    if layout.status is not None:
        doc["status"] = _status_doc(layout.status)
    return doc


def spec_patch(
    name: str,
    spec: gpulayouts.LayoutSpec,
    *,
    resource_version: str | None = None,
    leader: tuple[str, int] | None = None,
) -> GpuLayoutDoc:
    """The controller's server-side apply body: identity and ``spec`` only (field manager
    :data:`gpulayouts.CONTROLLER_FIELD_MANAGER`). Instances it leaves out are released by the
    apply.

    ``resource_version`` makes the apply a conditional write: the API server refuses it (409)
    if the object changed since that version, so a deposed leader's write, planned on what it
    saw before the new leader wrote, fails. ``leader`` (identity, term) is recorded in
    :data:`gpulayouts.LEADER_ANNOTATION` and :data:`gpulayouts.TERM_ANNOTATION`."""
    doc = _object(name)
    if resource_version is not None:
        doc["metadata"]["resourceVersion"] = resource_version
    if leader is not None:
        doc["metadata"]["annotations"] = {
            gpulayouts.LEADER_ANNOTATION: leader[0],
            gpulayouts.TERM_ANNOTATION: str(leader[1]),
        }
    doc["spec"] = _spec_doc(spec)
    return doc


def status_patch(name: str, status: gpulayouts.LayoutStatus) -> GpuLayoutDoc:
    """The agent's server-side apply body for the status subresource: identity and ``status``
    only, with the summary the printer columns show (field manager
    :data:`gpulayouts.AGENT_FIELD_MANAGER`)."""
    doc = _object(name)
    doc["status"] = _status_doc(status)
    return doc
