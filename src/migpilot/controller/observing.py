"""What the controller sees: Pods, Nodes and GpuLayouts read into the planner's snapshot.

Why it exists: the controller must plan from the same model the simulator plans from, and keep
no second model of pods, GPUs or reservations. This module is the one translation from the
Kubernetes objects (raw JSON, as the API returns them) to :mod:`migpilot.planning.snapshot`:

- a pod's **requests** are what kube-scheduler counts (per resource, the sum over containers or
  the largest init container, whichever is more, plus overhead; a limit stands in for a missing
  request), parsed by :func:`snapshot.pod_requests`, the one request parser;
- a node's **GPUs** come from its GpuLayout: the spec's instances (what the controller asked
  for: reserved ones are *used*), the status's used instances (which the agent never destroys,
  even if the spec dropped them), and, so that no instance a kubelet could have handed out is
  ever planned away, at least as many used instances of each profile as the pods bound to the
  node ask for;
- a node's **CPU and memory** are its allocatable less the requests of the pods bound to it and
  of the pods reserved on it;
- **pending pods** are the pods gated by ``migpilot.io/plan`` alone, and, as a fallback for pods
  created while no controller held the Lease, ungated pods kube-scheduler marked Unschedulable;
  a pod holding a live reservation is not pending again (it is never planned twice).
- a waiting pod whose **DRA claims** ask for migpilot's devices is read from its
  ResourceClaims and ResourceClaimTemplates (:func:`dra_pod`) as a pending pod that only a
  node in DRA mode serves (:attr:`snapshot.Pod.dra`; such a node serves no other pod), planned
  with the node policy kube-scheduler's score stands for and GPUs packed;
- a **DRA node**'s GPUs (label ``migpilot.io/mode=dra``) are read as any node's, with every
  device a ResourceClaim is allocated there a used instance, made or not (:func:`dra_gpus`);
  its bound pods ask for no ``nvidia.com/*`` resource, so their claims count them.

Nodes labelled ``nvidia.com/mig.config`` are laid out statically (mig-manager's way): they are
not planned, and their free capacity is offered as it is (:func:`static_fit`).

Pure: no client, no clock, no I/O. May import :mod:`migpilot.api`, :mod:`migpilot.planning`,
:mod:`migpilot.mig`, :mod:`migpilot.errors` and :mod:`migpilot.controller.translating`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from migpilot import errors
from migpilot.api import gpulayouts
from migpilot.controller import translating
from migpilot.mig import catalog, dra, layouts, profiles
from migpilot.planning import (
    constraints,
    draalloc,
    draclaims,
    drasteering,
    interpod,
    modes,
    snapshot,
    unified,
)
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

GATE = "migpilot.io/plan"
"""The scheduling gate the webhook adds and the controller removes."""
STATIC_LABEL = "nvidia.com/mig.config"
"""A node with this label is laid out statically from a mig-parted config (not planned)."""
HOSTNAME_LABEL = "kubernetes.io/hostname"
_TERMINATED = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class PodView:
    """One pod as the controller sees it."""

    key: str
    """``namespace/name``."""
    uid: str
    node: str | None
    """``spec.nodeName``: where it is bound."""
    gates: tuple[str, ...]
    unschedulable: bool
    """kube-scheduler tried and found no node (``PodScheduled=False``, ``Unschedulable``)."""
    done: bool
    """Terminated or being deleted: holds nothing any more."""
    mig: Counter[str]
    """MIG instances asked for, by profile (empty: not a MIG pod, or a bad request)."""
    pod: snapshot.Pod | None
    """The pod as the planner sees it; ``None`` when :attr:`problem` says why it cannot be."""
    problem: str | None
    """Why the pod's MIG request cannot be planned (a bad resource name, an unsupported
    affinity); ``None`` for a good one or a pod that asks for no MIG resource."""
    created: str
    """``metadata.creationTimestamp`` as the API gives it."""
    cpu_milli: int = 0
    """CPU the pod asks for (millicores, as kube-scheduler counts it), MIG pod or not."""
    memory_bytes: int = 0
    """Memory the pod asks for (bytes, as kube-scheduler counts it), MIG pod or not."""
    unified: bool = False
    """A unified (HAMi-style) pod: ``nvidia.com/gpu`` with ``gpumem`` and the like, served by
    MIG instances advertised as ``nvidia.com/gpu`` (``docs/unified.md``)."""
    gpus: int = 0
    """For a unified pod: the ``nvidia.com/gpu`` devices (MIG instances) it asks for in all."""
    whole_gpus: int = 0
    """For any other pod: the ``nvidia.com/gpu`` devices it asks for (whole GPUs, or NVIDIA's
    time-slicing replicas on a node shared so: they take replicas the planner must not give
    away)."""
    counters: tuple[str, ...] = ()
    """For a unified pod: the node-level counters its containers name (``nvidia.com/gpumem``
    and the like), which kube-scheduler checks against the Node's allocatable."""
    mps: Counter[str] = field(default_factory=Counter)
    """MPS slices asked for, by resource (``nvidia.com/gpu-10gb``; nodes in mode ``mps``,
    ``docs/modes.md``)."""
    other_mode: str | None = None
    """The ``nvidia.com/vgpu-mode`` of a pod asking ``nvidia.com/gpu`` in a mode migpilot does
    not serve (``hami-core``, ``mps``): left to another system, and told so once."""
    placed: interpod.BoundPod | None = None
    """The pod as pod affinity and topology spread count it wherever it is bound or reserved
    (any pod, GPU or not; its labels and required anti-affinity); ``None`` once it has
    terminated (Succeeded, Failed), when neither counts it."""
    ignored: str | None = None
    """Why migpilot ignores the pod altogether: a resource amount it cannot read (a quantity
    above 2**63-1, ``memory: 1e1000000``, which kube-apiserver accepts). It is never planned
    and counts on no node; the controller says so once, with a Warning event. ``None`` for
    every pod whose amounts read."""
    whole_pod: snapshot.Pod | None = None
    """A pod asking for whole GPUs (``nvidia.com/gpu: N``, not unified, no other mode) as the
    planner sees it (:attr:`snapshot.Pod.whole`): served only on nodes labelled
    ``migpilot.io/mig-mode=dynamic`` (``docs/migmode.md``); ``None`` for any other pod."""
    whole_problem: str | None = None
    """Why a pod asking for whole GPUs cannot be planned (a node affinity migpilot does not
    read): if gated, it is let go at once, for kube-scheduler to serve; ``None`` otherwise."""
    claims: tuple[ClaimRef, ...] = ()
    """Its DRA claims (``spec.resourceClaims``), each naming a ResourceClaim or a
    ResourceClaimTemplate; what they ask is read at :func:`observe` (:func:`dra_pod`), from
    the claims and templates as they are then."""
    dra_base: snapshot.Pod | None = None
    """For a pod with :attr:`claims`: the pod as the planner sees it with no device request
    yet (its CPU, memory and where it may run); :func:`dra_pod` adds what its claims ask.
    ``None`` without claims, or when :attr:`dra_problem` says why it cannot be planned."""
    dra_problem: str | None = None
    """Why a pod with claims cannot be planned whatever they ask (a node affinity migpilot
    does not read, amounts it cannot read); ``None`` otherwise."""
    made_claims: tuple[str, ...] = ()
    """The ResourceClaims made for it from its templates, by key, as its
    ``status.resourceClaimStatuses`` names them."""

    @property
    def planned(self) -> snapshot.Pod | None:
        """The pod as the planner sees it, whichever kind: :attr:`pod` or :attr:`whole_pod`."""
        return self.pod if self.pod is not None else self.whole_pod

    @property
    def is_mig(self) -> bool:
        """Whether migpilot serves it: it asks for a MIG resource or an MPS slice, or is unified
        (good or bad)."""
        return bool(self.mig) or bool(self.mps) or self.unified or self.problem is not None

    @property
    def signature(self) -> tuple[object, ...]:
        """What tells a unified pod's Allocate apart from another's: its asks, container by
        container (pods with equal signatures and equal reserved profiles are interchangeable
        for the kubelet's Allocate)."""
        request = self.pod.unified if self.pod is not None else None
        return request.asks if request is not None else ()

    @property
    def gated_by_us(self) -> bool:
        """Gated by ``migpilot.io/plan`` and by no other gate."""
        return self.gates == (GATE,)

    @property
    def waiting(self) -> bool:
        """Not bound, not done, and either gated by us alone or left Unschedulable."""
        if self.node or self.done:
            return False
        return self.gated_by_us or (not self.gates and self.unschedulable)


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _seq(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list | tuple) else []


def pod_view(doc: Mapping[str, Any]) -> PodView:
    """Read one Pod (raw JSON); a bad MIG request is kept with its :attr:`PodView.problem`, a
    pod whose amounts cannot be read with its :attr:`PodView.ignored`. Anything a tenant can
    write ends there: this never raises :class:`~migpilot.errors.MigpilotError`."""
    meta = _map(doc.get("metadata"))
    spec = _map(doc.get("spec"))
    status = _map(doc.get("status"))
    key = f"{meta.get('namespace', 'default')}/{meta.get('name', '')}"
    gates = tuple(str(_map(g).get("name", "")) for g in _seq(spec.get("schedulingGates")))
    unschedulable = any(
        _map(c).get("type") == "PodScheduled"
        and _map(c).get("status") == "False"
        and _map(c).get("reason") == "Unschedulable"
        for c in _seq(status.get("conditions"))
    )
    done = status.get("phase") in _TERMINATED or meta.get("deletionTimestamp") is not None
    mig: Counter[str] = Counter()
    mps: Counter[str] = Counter()
    pod: snapshot.Pod | None = None
    problem: str | None = None
    total: dict[str, Any] = {}
    annotations = {str(k): str(v) for k, v in _map(meta.get("annotations")).items()}
    containers = [snapshot.container_resources(c) for c in _seq(spec.get("containers"))]
    init = [snapshot.container_resources(c) for c in _seq(spec.get("initContainers"))]
    overhead = _map(spec.get("overhead"))
    is_unified = unified.is_unified(containers, annotations)
    gpus = 0
    ignored: str | None = None
    try:
        total = snapshot.scheduled_amounts(
            containers, init_containers=init, overhead=overhead, where="spec"
        )
    except errors.MigpilotError as err:
        # Amounts nothing can count with (a bound pod's memory would be added to its node's):
        # the whole pod is left out, and a pod that asks migpilot for something is refused.
        ignored, total = str(err), {}
        if is_unified or any(_serves(n) for c in containers for n in c):
            problem = f"migpilot ignores this pod: {err}"
    try:
        if ignored is None and (is_unified or any(_serves(k) and v for k, v in total.items())):
            # CPU and memory as kube-scheduler counts them (overhead included).
            requests = snapshot.container_requests(
                containers,
                where="spec",
                annotations=annotations,
                init_containers=init,
                overhead=overhead,
            )
            gpus = requests.unified.count if requests.unified is not None else 0
            mig.update({r.profile: r.count for r in requests.mig})
            mps.update({r.resource: r.count for r in requests.mps})
            pod = _planned_pod(meta, spec, requests)
    except errors.MigpilotError as err:
        mig.clear()
        mps.clear()
        pod = None
        problem = str(err)
    whole = 0 if is_unified else int(total.get(unified.GPU, 0))
    whole_pod: snapshot.Pod | None = None
    whole_problem: str | None = None
    other = None if is_unified else unified.other_mode(containers, annotations)
    if whole and pod is None and problem is None and ignored is None and other is None:
        # The apiserver validated its affinity; one we cannot read leaves it to kube-scheduler.
        try:
            whole_pod = _planned_pod(
                meta,
                spec,
                snapshot.whole_requests(
                    whole,
                    cpu_milli=int(total.get("cpu", 0)),
                    memory_bytes=int(total.get("memory", 0)),
                ),
            )
        except errors.MigpilotError as err:
            whole_problem = str(err)
    claims = claim_refs(spec, namespace=str(meta.get("namespace", "default")))
    made_claims = tuple(
        sorted(
            f"{meta.get('namespace', 'default')}/{name}"
            for c in _seq(status.get("resourceClaimStatuses"))
            if isinstance(name := _map(c).get("resourceClaimName"), str) and name
        )
    )
    dra_base: snapshot.Pod | None = None
    dra_problem: str | None = None
    if claims:
        try:
            if ignored is not None:
                raise errors.SnapshotError(ignored)
            dra_base = _planned_pod(
                meta,
                spec,
                snapshot.Requests((), int(total.get("cpu", 0)), int(total.get("memory", 0))),
            )
        except errors.MigpilotError as err:
            dra_problem = str(err)
    return PodView(
        made_claims=made_claims,
        claims=claims,
        dra_base=dra_base,
        dra_problem=dra_problem,
        whole_pod=whole_pod,
        whole_problem=whole_problem,
        placed=None if status.get("phase") in _TERMINATED else _placed(meta, spec),
        key=key,
        uid=str(meta.get("uid", "")),
        node=spec.get("nodeName") or None,
        gates=gates,
        unschedulable=unschedulable,
        done=done,
        mig=mig,
        pod=pod,
        problem=problem,
        created=str(meta.get("creationTimestamp", "")),
        cpu_milli=int(total.get("cpu", 0)),
        memory_bytes=int(total.get("memory", 0)),
        unified=is_unified,
        gpus=gpus,
        whole_gpus=whole,
        counters=tuple(sorted({n for c in containers for n in unified.UNIFIED_RESOURCES if n in c}))
        if is_unified
        else (),
        other_mode=other,
        mps=mps,
        ignored=ignored,
    )


def namespace_labels(doc: Mapping[str, Any]) -> Mapping[str, str]:
    """A Namespace's labels, for ``namespaceSelector`` in pod (anti-)affinity terms; labels
    that are not a mapping read as none (the apiserver never stores such a Namespace: only a bug
    or a test shows one), keys and values as text, as for pods."""
    return MappingProxyType(_labels_of(_map(doc.get("metadata"))))


def _labels_of(meta: Mapping[str, Any]) -> dict[str, str]:
    return {str(k): str(v) for k, v in _map(meta.get("labels")).items()}


def _placed(meta: Mapping[str, Any], spec: Mapping[str, Any]) -> interpod.BoundPod:
    """What the filters count of a pod once it is on a node (``node`` is filled in there)."""
    namespace = str(meta.get("namespace", "default"))
    labels = _labels_of(meta)
    anti: tuple[interpod.AffinityTerm, ...] = ()
    # The apiserver validated it; a term we cannot read keeps nobody away.
    with contextlib.suppress(errors.MigpilotError):
        anti = interpod.pod_terms(
            affinity={"podAntiAffinity": _map(spec.get("affinity")).get("podAntiAffinity")},
            spread=None,
            labels_=labels,
            namespace=namespace,
            where="spec",
        ).anti_affinity
    return interpod.BoundPod(
        name=str(meta.get("name", "")),
        namespace=namespace,
        node=str(spec.get("nodeName") or ""),
        labels=MappingProxyType(labels),
        anti_affinity=anti,
        terminating=meta.get("deletionTimestamp") is not None,
    )


def _serves(name: Any) -> bool:
    """A resource migpilot serves: a MIG instance or an MPS slice."""
    text = str(name)
    return text.startswith(snapshot.MIG_RESOURCE_PREFIX) or modes.is_mps_resource(text)


def _planned_pod(
    meta: Mapping[str, Any], spec: Mapping[str, Any], requests: snapshot.Requests
) -> snapshot.Pod:
    affinity = _map(spec.get("affinity"))
    required = _map(
        _map(affinity.get("nodeAffinity")).get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    terms = (
        snapshot.node_affinity(
            {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}},
            "spec.affinity",
        )
        if required
        else ()
    )
    selector = {str(k): str(v) for k, v in _map(spec.get("nodeSelector")).items()}
    priority = spec.get("priority")
    namespace = str(meta.get("namespace", "default"))
    others = interpod.pod_terms(
        affinity={k: v for k, v in affinity.items() if k != "nodeAffinity"},
        spread=spec.get("topologySpreadConstraints"),
        labels_=_labels_of(meta),
        namespace=namespace,
        where="spec",
    )
    return snapshot.planned_pod(
        terms=others,
        name=str(meta.get("name", "")),
        namespace=namespace,
        priority=priority if isinstance(priority, int) else 0,
        requests=requests,
        node_selector=selector,
        affinity=terms,
        tolerations=tuple(
            snapshot.toleration(
                {k: v for k, v in _map(t).items() if k != "tolerationSeconds"},
                f"spec.tolerations[{i}]",
            )
            for i, t in enumerate(_seq(spec.get("tolerations")))
        ),
    )


# --------------------------------------------------------------------------- DRA claims


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """One entry of a pod's ``spec.resourceClaims``: a ResourceClaim or a ResourceClaimTemplate
    of the pod's namespace, by key (``namespace/name``)."""

    name: str
    """The entry's name (what the containers' ``resources.claims`` name)."""
    claim: str | None = None
    """``resourceClaimName``: an existing ResourceClaim."""
    template: str | None = None
    """``resourceClaimTemplateName``: the claim made for the pod is a copy of its spec."""


def claim_refs(spec: Mapping[str, Any], *, namespace: str) -> tuple[ClaimRef, ...]:
    """A pod spec's ``resourceClaims`` (raw JSON); an entry naming neither a claim nor a
    template (the apiserver refuses those) is left out."""
    out: list[ClaimRef] = []
    for entry in _seq(spec.get("resourceClaims")):
        e = _map(entry)
        claim, template = e.get("resourceClaimName"), e.get("resourceClaimTemplateName")
        if isinstance(claim, str) and claim:
            out.append(ClaimRef(str(e.get("name", "")), claim=f"{namespace}/{claim}"))
        elif isinstance(template, str) and template:
            out.append(ClaimRef(str(e.get("name", "")), template=f"{namespace}/{template}"))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class ClaimRead:
    """A ResourceClaim's (or a template's) spec as the planner reads it."""

    ours: bool
    """One of its requests names migpilot's DeviceClass (``mig.migpilot.io``)."""
    spec: draclaims.ClaimSpec | None
    """What it asks (:func:`draclaims.parse_claim_spec`); ``None`` when :attr:`problem` says
    why the planner cannot read it."""
    problem: str | None = None
    allocated: tuple[tuple[str, str], ...] = ()
    """A ResourceClaim's devices of migpilot's driver that kube-scheduler allocated
    (``status.allocation.devices.results``), as (pool, device): the pool is the node's name,
    the device a placement's name (``gpu-0-mig-3g-40gb-4``). Empty for a template."""


def claim_read(doc: Mapping[str, Any], *, template: bool) -> ClaimRead:
    """Read a ResourceClaim, or with ``template`` a ResourceClaimTemplate (its ``spec.spec``),
    as raw JSON; never raises: what the planner cannot read is :attr:`ClaimRead.problem`."""
    meta = _map(doc.get("metadata"))
    what = "ResourceClaimTemplate" if template else "ResourceClaim"
    where = f"{what} {meta.get('namespace', 'default')}/{meta.get('name', '')}"
    spec: Any = _map(doc.get("spec"))
    if template:
        spec = _map(spec).get("spec")
    allocated = () if template else _allocated(doc)
    try:
        read = draclaims.parse_claim_spec(spec, where=where)
    except draclaims.NotUnderstood as err:
        return ClaimRead(draclaims.names_class(spec), None, str(err), allocated)
    return ClaimRead(bool(read.requests), read, allocated=allocated)


def _allocated(doc: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """(pool, device) of each result of migpilot's driver in a claim's allocation, sorted; a
    malformed result is skipped (read tolerantly: the API server wrote it)."""
    allocation = _map(_map(doc.get("status")).get("allocation"))
    out: set[tuple[str, str]] = set()
    for r in _seq(_map(allocation.get("devices")).get("results")):
        r = _map(r)
        pool, device = r.get("pool"), r.get("device")
        if r.get("driver") == dra.DRIVER and isinstance(pool, str) and isinstance(device, str):
            out.add((pool, device))
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class DraAsk:
    """What a pod's DRA claims ask of migpilot's devices, as the planner would plan it."""

    pod: snapshot.Pod | None
    """The pod with its claims' requests, kept to DRA nodes (label ``migpilot.io/mode=dra``)
    and, for a claim naming a GPU model, to the DRA nodes with GPUs of that model; ``None``
    when :attr:`problem` says why it is not planned."""
    problem: str | None = None
    final: bool = False
    """The problem is in what the pod or its claims say (not a claim yet to come): it will not
    be planned as they stand, and a pod gated by ``migpilot.io/plan`` is let go for
    kube-scheduler's first fit."""
    claims: tuple[draclaims.ClaimSpec, ...] = ()
    """Its claims as read, in ``spec.resourceClaims`` order (for the first-fit check)."""


def dra_pod(
    view: PodView,
    *,
    claims: Mapping[str, ClaimRead],
    templates: Mapping[str, ClaimRead],
    nodes_of_model: Mapping[str, tuple[str, ...]],
    policy: snapshot.Policy = snapshot.Policy.SPREAD,
) -> DraAsk | None:
    """``view``'s claims as the planner's pod (``claims`` and ``templates`` by key, as
    :func:`claim_read` read them; ``nodes_of_model``: the DRA nodes with GPUs of each model, by
    the catalog's id), ``None`` when none of its claims asks for migpilot's devices.

    Not planned, with the reason: a claim or template not found (yet: the pod may have been
    created first; kube-scheduler waits for it too) of a pod that another claim, or our gate,
    shows to be migpilot's (``None`` for any other: it may be another driver's); a claim of
    migpilot's devices the planner cannot read (:class:`draclaims.NotUnderstood`: left to
    kube-scheduler's first fit rather than planned wrong); claims the planner cannot plan
    together (:func:`draclaims.planner_requests`); whole GPUs (DRA nodes plan MIG placements
    only); or a pod the planner cannot read otherwise.

    The pod is :attr:`snapshot.Pod.dra` and planned with the node policy ``policy`` (the one
    kube-scheduler's ``NodeResourcesFit`` score stands for: :func:`draclaims.node_policy`) and
    the GPU policy binpack, whatever the planner's defaults for other pods: kube-scheduler picks
    the node by its own score among those where the claims fit, so the plan must pick the same
    node, and packing GPUs keeps whole GPUs free for the largest profiles, which kube-scheduler
    has no score for (``docs/dra.md``, "Which planner policy")."""
    reads: list[ClaimRead] = []
    missing: list[str] = []
    for ref in view.claims:
        if ref.claim is not None:
            found = claims.get(ref.claim)
            if found is None:
                missing.append(f"ResourceClaim {ref.claim}")
        else:
            found = templates.get(ref.template or "")
            if found is None:
                missing.append(f"ResourceClaimTemplate {ref.template}")
        if found is not None:
            reads.append(found)
    ours = any(r.ours for r in reads)
    if missing and (ours or view.gated_by_us):
        # Whether the missing one asks for migpilot's devices cannot be told; another that
        # does (or our gate, which the webhook sets only on pods it serves) makes the pod ours.
        return DraAsk(None, f"not planned: {', '.join(missing)} not found (yet)")
    if missing or not ours:
        return None  # none of its claims found asks for migpilot's devices: none of ours
    unread = next((r.problem for r in reads if r.problem is not None), None)
    if unread is not None:
        return DraAsk(None, f"not planned (left to kube-scheduler): {unread}", final=True)
    if view.dra_base is None:
        why = view.dra_problem or "its spec cannot be read"
        return DraAsk(None, f"not planned (left to kube-scheduler): {why}", final=True)
    base = view.dra_base
    try:
        asked = draclaims.planner_requests(
            [r.spec for r in reads if r.spec is not None],
            cpu_milli=base.cpu_milli,
            memory_bytes=base.memory_bytes,
            where=f"pod {view.key}",
        )
    except draclaims.NotUnderstood as err:
        return DraAsk(None, f"not planned (left to kube-scheduler): {err}", final=True)
    keep: tuple[snapshot.Requirement, ...] = (
        snapshot.Requirement(modes.MODE_LABEL, "In", (modes.Mode.DRA.value,)),
    )
    if asked.model is not None:
        names = nodes_of_model.get(asked.model, ())
        keep += (snapshot.Requirement(snapshot.NODE_NAME_FIELD, "In", names, field=True),)
    requests = asked.requests
    if requests.whole:
        why = f"pod {view.key}: asks for whole GPUs, which migpilot does not plan on DRA nodes"
        return DraAsk(None, f"not planned (left to kube-scheduler): {why}", final=True)
    pod = dataclasses.replace(
        base,
        mig=requests.mig,
        unified=requests.unified,
        dra=True,
        node_policy=policy,
        gpu_policy=snapshot.Policy.BINPACK,
        # Every term of its own node affinity, and these: kube-scheduler allocates all of a
        # pod's claims on its node, and only a DRA node publishes migpilot's devices.
        affinity=tuple(t + keep for t in (base.affinity or ((),))),
    )
    return DraAsk(pod, claims=tuple(r.spec for r in reads if r.spec is not None))


def _device_plugin_ask(pod: snapshot.Pod) -> str:
    """What ``pod`` asks of the device plugins' ``nvidia.com/*`` resources, in words."""
    if pod.mig:
        return ", ".join(f"{r.count} x {r.profile}" for r in pod.mig)
    if pod.unified is not None:
        return "a GPU by memory or compute (nvidia.com/gpu with gpumem or gpucores)"
    if pod.mps:
        return "MPS slices"
    return f"{pod.whole} whole GPU(s) (nvidia.com/gpu)"


def pinned_node(pod: snapshot.Pod) -> str | None:
    """The node ``pod``'s required node affinity confines it to by name (every term names the
    same one node, as the controller's pin leaves it), or ``None``."""
    if not pod.affinity:
        return None
    names: set[str] = set()
    for term in pod.affinity:
        named = {r.values[0] for r in term if r.field and r.operator == "In"}
        if len(named) != 1:
            return None
        names |= named
    return names.pop() if len(names) == 1 else None


def in_flight(view: PodView, claims: Mapping[str, ClaimRead]) -> bool:
    """A pod with DRA claims the controller pinned and let go that kube-scheduler has not yet
    bound (nor found no node for) nor allocated any claim of (``claims``: the ResourceClaims
    by key; a template's claim as the pod's status names it): its claims are being allocated
    from the placements listed first on its node. It is planned again, pinned there, so that
    its planned placements stay in the node's target and go to no other pod until its claims'
    allocation makes them used instances (a plan between the pin and the allocation would
    otherwise give them away); once allocated, its claims' devices count instead."""
    keys = [*(r.claim for r in view.claims if r.claim is not None), *view.made_claims]
    if any(k in claims and claims[k].allocated for k in keys):
        return False
    return (
        bool(view.claims)
        and view.dra_base is not None
        and not view.node
        and not view.done
        and not view.gates
        and not view.unschedulable
        and pinned_node(view.dra_base) is not None
    )


def dra_models(
    nodes: Iterable[NodeView], layouts_by_node: Mapping[str, gpulayouts.GpuLayout]
) -> dict[str, tuple[str, ...]]:
    """The DRA nodes (label ``migpilot.io/mode=dra``) with GPUs of each model (the catalog's
    id), from what their agents report; a model the catalog lacks is left out."""
    out: dict[str, set[str]] = {}
    for view in nodes:
        try:
            if view.mode is not modes.Mode.DRA:
                continue
        except errors.MigpilotError:
            continue
        layout = layouts_by_node.get(view.name)
        if layout is None or layout.status is None:
            continue
        for g in layout.status.gpus:
            try:
                out.setdefault(_model(g.model).id, set()).add(view.name)
            except errors.MigpilotError:
                continue
    return {m: tuple(sorted(n)) for m, n in out.items()}


# --------------------------------------------------------------------------- nodes


@dataclass(frozen=True, slots=True)
class NodeView:
    """One Node as the controller sees it."""

    name: str
    labels: Mapping[str, str]
    taints: tuple[snapshot.Taint, ...]
    unschedulable: bool
    ready: bool
    allocatable: Mapping[str, int]
    """cpu (millicores), memory (bytes) and ``nvidia.com/*`` resources, as the Node reports."""
    uid: str
    problem: str | None = None
    """Why migpilot ignores the node: an allocatable amount it cannot read (``cpu:
    1e1000000``). Such a node is not planned and gets a Warning event; ``None`` for a good
    one."""

    @property
    def static(self) -> bool:
        """Laid out from a mig-parted config (``nvidia.com/mig.config``), not planned."""
        return STATIC_LABEL in self.labels

    @property
    def mig_capable(self) -> bool:
        """The agent labelled it a MIG node (GFD's ``nvidia.com/mig.capable``)."""
        return self.labels.get("nvidia.com/mig.capable") == "true"

    @property
    def mode(self) -> modes.Mode:
        """How it shares its GPUs (label ``migpilot.io/mode``; absent: ``mig``). Raise
        :class:`~migpilot.errors.SnapshotError` naming the node for an unknown value."""
        return modes.node_mode(self.labels, node=self.name)

    @property
    def hostname(self) -> str | None:
        """Its ``kubernetes.io/hostname`` label, what a pod's node affinity pins it by."""
        return self.labels.get(HOSTNAME_LABEL)


def node_view(doc: Mapping[str, Any]) -> NodeView:
    """Read one Node (raw JSON); malformed parts read as absent, an allocatable amount that
    cannot be read as :attr:`NodeView.problem`; never raises."""
    meta = _map(doc.get("metadata"))
    spec = _map(doc.get("spec"))
    status = _map(doc.get("status"))
    labels = {str(k): str(v) for k, v in _map(meta.get("labels")).items()}
    taints: list[snapshot.Taint] = []
    for i, t in enumerate(_seq(spec.get("taints"))):
        t = _map(t)
        try:
            taints.append(
                snapshot.taint(
                    {k: t[k] for k in ("key", "value", "effect") if k in t}, f"taints[{i}]"
                )
            )
        except errors.MigpilotError:
            continue
    ready = any(
        _map(c).get("type") == "Ready" and _map(c).get("status") == "True"
        for c in _seq(status.get("conditions"))
    )
    alloc: dict[str, int] = {}
    problem: str | None = None
    for name, value in _map(status.get("allocatable")).items():
        if name in ("cpu", "memory") or str(name).startswith("nvidia.com/"):
            try:
                alloc[str(name)] = snapshot.amount(
                    str(name), value, where=f"status.allocatable.{name}"
                )
            except errors.MigpilotError as err:
                problem = problem or str(err)
    return NodeView(
        name=str(meta.get("name", "")),
        labels=MappingProxyType(labels),
        taints=tuple(taints),
        unschedulable=bool(spec.get("unschedulable", False)),
        ready=ready,
        allocatable=MappingProxyType(alloc),
        uid=str(meta.get("uid", "")),
        problem=problem,
    )


# --------------------------------------------------------------------------- the cluster


@dataclass(frozen=True, slots=True)
class Reservation:
    """Instances a GpuLayout's spec keeps for one pod."""

    pod: str
    node: str
    instances: tuple[tuple[int, int, str], ...]
    """(GPU index, start, profile)."""
    slices: tuple[tuple[int, int, int], ...] = ()
    """MPS slices: (GPU index, slice id, GB)."""
    replicas: tuple[tuple[int, int], ...] = ()
    """Time-slicing replicas: (GPU index, replica id)."""
    gpus: tuple[int, ...] = ()
    """Whole GPUs (MIG off) kept for a whole-GPU pod on a dynamic node, by index
    (``docs/migmode.md``)."""


_PlannerPod = snapshot.Pod
"""(The field :attr:`Observed.snapshot` hides the module's name in the class body.)"""


@dataclass(frozen=True, slots=True)
class Observed:
    """The cluster, read: what the loop plans and pins from."""

    snapshot: snapshot.Snapshot
    """Planned nodes (their GPUs as the module says) and the pending pods without a reservation."""
    pods: Mapping[str, PodView]
    nodes: Mapping[str, NodeView]
    layouts: Mapping[str, gpulayouts.GpuLayout]
    reservations: Mapping[str, Reservation]
    """Live reservations by pod: the pod exists, is not done and is not bound elsewhere."""
    stale: frozenset[str]
    """Nodes whose spec reserves instances for pods that are gone, done, or bound (their
    reservation has served its purpose): their spec is rewritten without it."""
    bound: Mapping[str, Counter[str]]
    """Per node, MIG instances by profile held by pods bound to it (not done)."""
    unplanned: tuple[str, ...]
    """Nodes with MIG GPUs that are not planned, and why (``name: reason``), for events."""
    bound_gpus: Mapping[str, int] = field(default_factory=dict)
    """Per node, the ``nvidia.com/gpu`` devices unified pods bound to it (not done) ask for."""
    bound_whole: Mapping[str, int] = field(default_factory=dict)
    """Per node, the ``nvidia.com/gpu`` devices other pods bound to it (not done) ask for."""
    broken: Mapping[str, str] = field(default_factory=dict)
    """Nodes left out for a problem an admin must fix (an unknown ``migpilot.io/mode``, a GPU
    model the catalog lacks), and the problem: a Warning event on the Node."""
    dra_pods: tuple[_PlannerPod, ...] = ()
    """Waiting pods whose DRA claims ask for migpilot's devices, as the planner plans them
    (:func:`dra_pod`: :attr:`snapshot.Pod.dra`, kept to DRA nodes), oldest first; they are
    among :attr:`snapshot`'s pods too."""
    dra_unplanned: Mapping[str, str] = field(default_factory=dict)
    """Waiting pods with DRA claims that are not planned, and why (:func:`dra_pod`)."""
    dra_refused: frozenset[str] = frozenset()
    """Those of :attr:`dra_unplanned` that will not be planned as their claims stand
    (:attr:`DraAsk.final`): if gated by us, let go."""
    dra_claims: Mapping[str, draalloc.Claim] = field(default_factory=dict)
    """Per pod of :attr:`dra_pods`, its claims as the allocator model allocates them together
    (:func:`drasteering.claim_of`), for the first-fit check."""


NodeCache = dict[str, tuple[tuple[object, ...], snapshot.Node]]
"""Planned nodes of an earlier :func:`observe`, each with what it was read from."""


def observe(
    *,
    pods: Iterable[PodView],
    nodes: Iterable[NodeView],
    layouts_by_node: Mapping[str, gpulayouts.GpuLayout],
    namespaces: Mapping[str, Mapping[str, str]] | None = None,
    policy: snapshot.Policy = snapshot.Policy.BINPACK,
    gpu_policy: snapshot.Policy = snapshot.Policy.SPREAD,
    cache: NodeCache | None = None,
    claims: Mapping[str, ClaimRead] | None = None,
    templates: Mapping[str, ClaimRead] | None = None,
    dra_policy: snapshot.Policy = snapshot.Policy.SPREAD,
) -> Observed:
    """Read the cluster into an :class:`Observed` (see the module for the rules).

    ``cache`` (optional, kept by the caller between calls) holds each planned node with the
    inputs it was read from (the very NodeView and GpuLayout objects, its live reservations,
    bound instances, CPU and memory taken); a node whose inputs are the same objects and values
    is not read again. The result is the same with or without it: it only saves time at
    thousands of nodes, where most nodes do not change between two passes.

    ``claims`` and ``templates``: the ResourceClaims and ResourceClaimTemplates by key, as
    :func:`claim_read` read them, for the pods with DRA claims (:attr:`Observed.dra_pods`) and
    the devices allocated on DRA nodes; ``dra_policy``: the node policy DRA pods are planned
    with (:func:`dra_pod`)."""
    pod_map = {p.key: p for p in pods}
    node_map = {n.name: n for n in nodes}
    bound: dict[str, Counter[str]] = {}
    used_cpu: Counter[str] = Counter()
    used_mem: Counter[str] = Counter()
    bound_gpus: Counter[str] = Counter()
    bound_whole: Counter[str] = Counter()
    for p in pod_map.values():
        if p.node and not p.done:
            bound.setdefault(p.node, Counter()).update(p.mig)
            bound[p.node].update(p.mps)
            if p.unified:
                bound_gpus[p.node] += p.gpus
            elif p.whole_gpus and p.ignored is None:
                bound_whole[p.node] += p.whole_gpus
            # Every bound pod takes CPU and memory, MIG pod or not (kube-scheduler counts all).
            used_cpu[p.node] += p.cpu_milli
            used_mem[p.node] += p.memory_bytes
    reservations: dict[str, Reservation] = {}
    stale: set[str] = set()
    for node_name, layout in layouts_by_node.items():
        held: dict[str, list[tuple[int, int, str]]] = {}
        sliced: dict[str, list[tuple[int, int, int]]] = {}
        shared: dict[str, list[tuple[int, int]]] = {}
        whole: dict[str, list[int]] = {}
        for g in layout.spec.gpus:
            if g.reserved_for is not None:
                whole.setdefault(g.reserved_for, []).append(g.index)
            for rs in g.replicas:
                shared.setdefault(rs.reserved_for, []).append((g.index, rs.id))
            for i in g.instances:
                if i.reserved_for is not None:
                    held.setdefault(i.reserved_for, []).append((g.index, i.start, i.profile))
            for sl in g.mps:
                if sl.reserved_for is not None:
                    sliced.setdefault(sl.reserved_for, []).append((g.index, sl.id, sl.memory_gb))
        for key in (*sliced, *shared, *whole):
            held.setdefault(key, [])
        for key, insts in held.items():
            holder = pod_map.get(key)
            if (
                holder is None
                or holder.done
                or key in reservations
                or not (holder.node is None or _allocating(holder, node_name, layout))
            ):
                stale.add(node_name)
                continue
            reservations[key] = Reservation(
                key,
                node_name,
                tuple(sorted(insts)),
                tuple(sorted(sliced.get(key, ()))),
                tuple(sorted(shared.get(key, ()))),
                tuple(sorted(whole.get(key, ()))),
            )
    # Bound pods whose replicas a live reservation names (bound, not yet allocated): those
    # are counted by the reservation, not again as bound.
    bound_reserved: Counter[str] = Counter()
    for r in reservations.values():
        if r.replicas and pod_map[r.pod].node == r.node:
            bound_reserved[r.node] += len(r.replicas)
    for r in reservations.values():
        reserved_pod = pod_map[r.pod].planned
        if reserved_pod is not None and pod_map[r.pod].node is None:  # a bound one counted
            used_cpu[r.node] += reserved_pod.cpu_milli
            used_mem[r.node] += reserved_pod.memory_bytes
    live_by_node: dict[str, set[tuple[int, int, str]]] = {}
    live_slices: dict[str, set[tuple[int, int, str]]] = {}
    live_replicas: dict[str, set[tuple[int, int]]] = {}
    live_whole: dict[str, set[int]] = {}
    for r in reservations.values():
        live_whole.setdefault(r.node, set()).update(r.gpus)
        live_by_node.setdefault(r.node, set()).update(r.instances)
        live_slices.setdefault(r.node, set()).update((g, i, r.pod) for g, i, _ in r.slices)
        live_replicas.setdefault(r.node, set()).update(r.replicas)
    # The devices kube-scheduler allocated on each DRA node (its pool is named after it).
    allocated_on: dict[str, set[str]] = {}
    for read in (claims or {}).values():
        for pool, device in read.allocated:
            allocated_on.setdefault(pool, set()).add(device)
    planned: list[snapshot.Node] = []
    unplanned: list[str] = []
    broken: dict[str, str] = {}
    fresh: NodeCache = {}
    for name in sorted(node_map):
        view = node_map[name]
        found = layouts_by_node.get(name)
        if view.static:
            continue
        if view.problem is not None:
            unplanned.append(f"{name}: {view.problem}")
            broken[name] = f"migpilot ignores this node: {view.problem}"
            continue
        try:
            mode = view.mode
        except errors.MigpilotError as err:
            unplanned.append(f"{name}: {err}")
            broken[name] = str(err)
            continue
        if mode is modes.Mode.NONE:  # not served by the planners' resources
            continue
        on_dra = mode is modes.Mode.DRA
        if found is None or found.status is None:
            if view.mig_capable or mode is not modes.Mode.MIG:
                unplanned.append(f"{name}: its agent has not reported its GPUs yet")
            continue
        if not view.ready:
            unplanned.append(f"{name}: not Ready")
            continue
        live = frozenset(live_by_node.get(name, ()))
        live_mps = frozenset(live_slices.get(name, ()))
        live_reps = frozenset(live_replicas.get(name, ()))
        kept_whole = frozenset(live_whole.get(name, ()))
        # A DRA node's bound pods ask for no nvidia.com/* resource: their claims' allocated
        # devices count instead.
        holding = bound.get(name, Counter()) if not on_dra else Counter()
        allocated = frozenset(allocated_on.get(name, ())) if on_dra else frozenset()
        inputs = (
            view,
            found,
            live,
            live_mps,
            live_reps,
            kept_whole,
            tuple(sorted(holding.items())),
            bound_gpus[name] + bound_whole[name] - bound_reserved[name],
            used_cpu[name],
            used_mem[name],
            allocated,
        )
        hit = cache.get(name) if cache is not None else None
        if hit is not None and _same(hit[0], inputs):
            fresh[name] = hit
            planned.append(hit[1])
            continue
        dynamic = modes.dynamic_mig(view.labels) and mode is modes.Mode.MIG
        try:
            gpus = node_gpus(found, reserved=live, bound=holding)
            if on_dra:
                gpus = dra_gpus(gpus, allocated=allocated)
            if dynamic:
                gpus = whole_gpus(found, gpus, bound=bound_whole[name], reserved=kept_whole)
            if mode is modes.Mode.MPS:
                gpus = mps_gpus(found, gpus, reserved=live_mps, bound=holding)
            elif mode is modes.Mode.TIME_SLICING:
                gpus = replica_gpus(
                    found,
                    gpus,
                    reserved=live_reps,
                    bound=bound_gpus[name] + bound_whole[name] - bound_reserved[name],
                )
        except errors.MigpilotError as err:
            unplanned.append(f"{name}: {err}")
            broken[name] = str(err)
            continue
        cpu = view.allocatable.get("cpu")
        mem = view.allocatable.get("memory")
        alloc = (
            snapshot.Resources(
                max(cpu - used_cpu[name], 0) if cpu is not None else 2**62,
                max(mem - used_mem[name], 0) if mem is not None else 2**62,
            )
            if cpu is not None or mem is not None
            else None
        )
        made = snapshot.Node(
            name=name,
            labels=view.labels,
            taints=view.taints,
            unschedulable=view.unschedulable,
            allocatable=alloc,
            gpus=gpus,
            # The planners partition a DRA node's GPUs as a MIG node's; its label keeps it to
            # DRA pods (constraints.rejection).
            mode=modes.Mode.MIG if on_dra else mode,
            dynamic=dynamic,
        )
        fresh[name] = (inputs, made)
        planned.append(made)
    if cache is not None:
        cache.clear()
        cache.update(fresh)
    waiting = [
        p for p in pod_map.values() if p.waiting and p.pod is not None and p.key not in reservations
    ]
    dra_pods: list[snapshot.Pod] = []
    dra_unplanned: dict[str, str] = {}
    dra_refused: set[str] = set()
    dra_claims: dict[str, draalloc.Claim] = {}
    mixed: set[str] = set()
    # Pods asking for the device plugins' GPUs and migpilot's DRA devices both.
    claimed = [
        p
        for p in pod_map.values()
        if p.claims and (p.waiting or in_flight(p, claims or {})) and p.key not in reservations
    ]
    if claimed:
        models = dra_models(node_map.values(), layouts_by_node)
        for p in sorted(claimed, key=lambda p: (p.created, p.key)):
            ask = dra_pod(
                p,
                claims=claims or {},
                templates=templates or {},
                nodes_of_model=models,
                policy=dra_policy,
            )
            if ask is None:
                continue
            plugin = p.pod if p.pod is not None else p.whole_pod
            if ask.pod is not None and plugin is not None:
                # It asks for nvidia.com/* resources too, which no DRA node advertises, and
                # for migpilot's DRA devices, which no device-plugin node publishes: planned
                # either way it would be pinned to a node that cannot take it. Not planned
                # at all (a gated one is let go); kube-scheduler says the same.
                waiting = [w for w in waiting if w.key != p.key]
                mixed.add(p.key)
                dra_unplanned[p.key] = (
                    f"not planned (left to kube-scheduler): pod {p.key} asks for "
                    f"{_device_plugin_ask(plugin)} of the device plugin as well as DRA claims of "
                    f"{draclaims.DEVICE_CLASS}, and no node serves both (a DRA node advertises "
                    "no nvidia.com/* resource; a device-plugin node publishes no migpilot device)"
                )
                dra_refused.add(p.key)
            elif ask.pod is not None:
                dra_pods.append(ask.pod)
                dra_claims[p.key] = drasteering.claim_of(ask.claims)
                waiting.append(dataclasses.replace(p, pod=ask.pod))
            else:
                dra_unplanned[p.key] = ask.problem or "not planned"
                if ask.final:
                    dra_refused.add(p.key)
    waiting.sort(key=lambda p: (p.created, p.key))
    pending = tuple(p.pod for p in waiting if p.pod is not None)
    # Whole-GPU pods kube-scheduler could not place are planned only when a node may switch a
    # GPU out of MIG: without a dynamic node nothing changes from before (docs/migmode.md).
    # Gated ones (the webhook gates them while a node is labelled dynamic) always are: the
    # step lets go at once those no dynamic node can serve.
    whole_waiting = sorted(
        (
            p
            for p in pod_map.values()
            if p.waiting
            and p.whole_pod is not None
            and p.key not in reservations
            and p.key not in mixed
        ),
        key=lambda p: (p.created, p.key),
    )
    any_dynamic = any(n.dynamic for n in planned)
    whole_pods = tuple(
        p.whole_pod
        for p in whole_waiting
        if p.whole_pod is not None and (any_dynamic or p.gated_by_us)
    )
    # Pod affinity and topology spread count every pod bound or reserved, on any node.
    where: dict[str, str] = {r.pod: r.node for r in reservations.values()}
    # A bound pod being deleted still counts for pod (anti-)affinity (kube-scheduler counts it
    # until it is gone); ``placed`` is ``None`` only once it has terminated.
    where.update({p.key: p.node for p in pod_map.values() if p.node and p.placed is not None})
    placed_pods = []
    for k, n in sorted(where.items()):
        seen = pod_map.get(k)
        if seen is not None and seen.placed is not None and n in node_map:
            placed_pods.append(dataclasses.replace(seen.placed, node=n))
    planned_names = {n.name for n in planned}
    outside = tuple(
        snapshot.Node(
            name=v.name,
            labels=v.labels,
            taints=v.taints,
            unschedulable=v.unschedulable,
            allocatable=None,
            gpus=(),
        )
        for v in node_map.values()
        if v.name not in planned_names
    )
    return Observed(
        dra_refused=frozenset(dra_refused),
        dra_pods=tuple(dra_pods),
        dra_claims=MappingProxyType(dra_claims),
        dra_unplanned=MappingProxyType(dra_unplanned),
        snapshot=snapshot.Snapshot(
            nodes=tuple(planned),
            pods=pending,
            whole_pods=whole_pods,
            policy=policy,
            gpu_policy=gpu_policy,
            outside=outside,
            bound=tuple(placed_pods),
            namespaces=MappingProxyType(dict(namespaces or {})),
        ),
        pods=MappingProxyType(pod_map),
        nodes=MappingProxyType(node_map),
        layouts=MappingProxyType(dict(layouts_by_node)),
        reservations=MappingProxyType(reservations),
        stale=frozenset(stale),
        bound=MappingProxyType(bound),
        bound_gpus=MappingProxyType(dict(bound_gpus)),
        bound_whole=MappingProxyType(dict(bound_whole)),
        unplanned=tuple(unplanned),
        broken=MappingProxyType(broken),
    )


def _allocating(holder: PodView, node: str, layout: gpulayouts.GpuLayout) -> bool:
    """A unified pod bound to ``node`` whose Allocate has not yet taken its instances: its
    reservation is live until then (the agent's Allocate hands it exactly those; a bound MIG
    pod is counted by what it asks instead)."""
    return holder.unified and holder.node == node and not gpulayouts.allocated(layout, holder.key)


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """The cached inputs are these: the same view and layout objects, equal other values."""
    return a[0] is b[0] and a[1] is b[1] and a[2:] == b[2:]


@functools.lru_cache(maxsize=64)
def _model(name: str) -> profiles.GpuModel:
    return catalog.resolve_gpu(name)


def node_gpus(
    layout: gpulayouts.GpuLayout,
    *,
    reserved: frozenset[tuple[int, int, str]] | set[tuple[int, int, str]],
    bound: Counter[str],
) -> tuple[snapshot.Gpu, ...]:
    """A node's GPUs for the planner, from its GpuLayout (see the module for the rules).

    ``reserved``: (GPU, start, profile) of the live reservations; ``bound``: instances by
    profile that pods bound to the node hold. Raise :class:`errors.GpuLayoutError` when the
    status names a GPU model the catalog lacks.
    """
    assert layout.status is not None
    spec = {g.index: g for g in layout.spec.gpus}
    out: list[tuple[int, Any, dict[tuple[int, str], bool], set[tuple[int, str]]]] = []
    for gs in layout.status.gpus:
        try:
            model = _model(gs.model)
        except errors.MigpilotError as err:
            raise errors.GpuLayoutError(f"GPU {gs.index}: {err}") from None
        held = {
            (i.start, i.profile)
            for i in gs.instances
            if i.state in (gpulayouts.InstanceState.USED,)
        }
        insts: dict[tuple[int, str], bool] = dict.fromkeys(held, True)
        sg = spec.get(gs.index)
        if sg is None:
            for i in gs.instances:
                if i.state is gpulayouts.InstanceState.DESTROYING:
                    continue
                untouchable = i.state in gpulayouts.UNTOUCHABLE
                insts[(i.start, i.profile)] = insts.get((i.start, i.profile), False) or untouchable
        else:
            for want in sg.instances:
                k = (want.start, want.profile)
                if k in insts:
                    continue
                trial = [layouts.Instance(s, p) for s, p in (*insts, k)]
                if layouts.violation(model, trial) is not None:
                    continue  # the agent keeps a used instance there: it cannot make this one
                insts[k] = (gs.index, want.start, want.profile) in reserved
        out.append((gs.index, model, insts, held))
    # At least as many instances of each profile held for the bound pods as they ask for: the
    # ones the agent reports in use, then free ones (never a reserved one: that is another
    # pod's). The kubelet counts, it does not tell which; the planner only needs the count.
    for profile, need in sorted(bound.items()):
        have = sum(1 for _, _, _, held in out for _, p in held if p == profile)
        for _, _, insts, _ in out:
            for k in sorted(insts):
                if have >= need:
                    break
                if k[1] == profile and not insts[k]:
                    insts[k] = True
                    have += 1
    return tuple(
        snapshot.Gpu(
            index,
            model,
            tuple(snapshot.ExistingInstance(p, s, used) for (s, p), used in sorted(insts.items())),
        )
        for index, model, insts, _ in out
    )


def dra_gpus(
    gpus: tuple[snapshot.Gpu, ...], *, allocated: Iterable[str]
) -> tuple[snapshot.Gpu, ...]:
    """The GPUs of a node in DRA mode (label ``migpilot.io/mode=dra``), as :func:`node_gpus`
    read them from its GpuLayout, with every device a ResourceClaim is allocated there
    (``allocated``: device names, as the kubelet plugin parses them) a used instance, made or
    not: kube-scheduler gave it away, and the plugin makes it at NodePrepareResources. A free
    instance overlapping one of them is left out (the plugin destroys it first). A GPU a claim
    holds whole (MIG off) is left out: DRA nodes plan MIG placements only. So is a GPU whose
    used instances overlap each other (a moment between an allocation and the agent's report
    of an instance going): it is planned again at the next pass. A device name that names no
    placement of the node (an allocation older than the node's GPUs) is skipped."""
    models = {g.index: g.model for g in gpus}
    held: dict[int, set[tuple[int, str]]] = {}
    whole: set[int] = set()
    for name in sorted(set(allocated)):
        whole_gpu = dra.parse_whole_gpu_name(name)
        if whole_gpu is not None:
            whole.add(whole_gpu.gpu)
            continue
        try:
            placement = dra.parse_device_name(name, models)
        except dra.PlacementError:
            continue
        held.setdefault(placement.gpu, set()).add((placement.start, placement.profile))
    out: list[snapshot.Gpu] = []
    for gpu in gpus:
        if gpu.index in whole:
            continue
        taken = held.get(gpu.index)
        if not taken:
            out.append(gpu)
            continue
        used = taken | {(i.start, i.profile) for i in gpu.instances if i.used}
        if layouts.violation(gpu.model, [layouts.Instance(s, p) for s, p in used]) is not None:
            continue
        insts = dict.fromkeys(used, True)
        for i in gpu.instances:
            k = (i.start, i.profile)
            if k in insts:
                continue
            trial = [layouts.Instance(s, p) for s, p in (*insts, k)]
            if layouts.violation(gpu.model, trial) is None:
                insts[k] = False
        out.append(
            dataclasses.replace(
                gpu,
                instances=tuple(
                    snapshot.ExistingInstance(p, s, u) for (s, p), u in sorted(insts.items())
                ),
            )
        )
    return tuple(out)


def whole_gpus(
    layout: gpulayouts.GpuLayout,
    gpus: tuple[snapshot.Gpu, ...],
    *,
    bound: int,
    reserved: frozenset[int] = frozenset(),
) -> tuple[snapshot.Gpu, ...]:
    """The GPUs of a node labelled ``migpilot.io/mig-mode=dynamic`` with their MIG mode
    (``docs/migmode.md``): the mode the spec asks for, else the one the status reports
    (``migMode.current``). A whole GPU holds no instance. ``bound``: the ``nvidia.com/gpu`` the
    pods bound to the node ask for; the kubelet does not say which GPUs they hold, so as many
    whole GPUs are counted held (``whole_taken``), in index order, beside the ones a live
    reservation keeps (``reserved``: GPU indexes), and a GPU whose mode waits for a reset
    (``pending`` differs from ``current``) is held too: none is switched or given away."""
    assert layout.status is not None
    spec = {g.index: g.mig for g in layout.spec.gpus}
    status = {g.index: g.mig_mode for g in layout.status.gpus}
    out: list[snapshot.Gpu] = []
    left = bound
    for gpu in gpus:
        reported = status.get(gpu.index)
        asked = spec.get(gpu.index)
        mig = asked if asked is not None else (reported.current if reported else True)
        waiting = reported is not None and reported.current != reported.pending
        if mig and not waiting:
            out.append(gpu)
            continue
        kept = gpu.index in reserved
        held = waiting or kept or (not mig and left > 0)
        if not mig and not waiting and not kept and left > 0:
            left -= 1
        out.append(dataclasses.replace(gpu, instances=(), mig=mig and not waiting,
                                       whole_taken=held))  # fmt: skip
    return tuple(out)


def mps_gpus(
    layout: gpulayouts.GpuLayout,
    gpus: tuple[snapshot.Gpu, ...],
    *,
    reserved: frozenset[tuple[int, int, str]],
    bound: Counter[str],
) -> tuple[snapshot.Gpu, ...]:
    """The GPUs of a node in mode ``mps`` with their MPS slices (``docs/modes.md``).

    Every slice the spec lists or the status reports taken is there
    (:func:`translating.snapshot_slices`); a slice keeps its reservation only while it is live
    (``reserved``: (GPU, slice id, pod)), and at least as many slices of each size as the pods
    bound to the node ask for are marked used (the kubelet counts devices, it does not say which:
    a slice the status still calls free may be the one a just-bound pod is getting)."""
    assert layout.status is not None
    by_index = {g.index: g for g in layout.status.gpus}
    out: list[snapshot.Gpu] = []
    for gpu in gpus:
        status = by_index.get(gpu.index)
        slices = list(translating.snapshot_slices(layout, status)) if status is not None else []
        slices = [
            sl
            if not sl.reserved_for or (gpu.index, sl.id, sl.reserved_for) in reserved
            else dataclasses.replace(sl, reserved_for="")
            for sl in slices
        ]
        out.append(dataclasses.replace(gpu, instances=(), mps=tuple(slices)))
    for resource, need in sorted(bound.items()):
        if not modes.is_mps_resource(resource):
            continue
        gb = modes.mps_gb(resource, where=resource)
        have = sum(1 for g in out for sl in g.mps if sl.memory_gb == gb and sl.used)
        for i, g in enumerate(out):
            marked = []
            for sl in g.mps:
                if have < need and sl.memory_gb == gb and not sl.taken:
                    sl = dataclasses.replace(sl, used=True)
                    have += 1
                marked.append(sl)
            out[i] = dataclasses.replace(g, mps=tuple(marked))
    return tuple(_within(g) for g in out)


def _within(gpu: snapshot.Gpu) -> snapshot.Gpu:
    """``gpu`` without its free slices while its slices exceed it (memory or MPS clients).

    That happens when a pod holds a slice the spec had just dropped (the kubelet handed it out
    before the agent applied the spec: the agent keeps serving it with the size it had). The
    GPU has no room left then, whatever the free slices say: none may be given to a pod (the
    soak's next plan gave one away and wrote 90 GB of slices for an 80 GB A100). Left out of
    the snapshot, they are left out of the next spec written for the node, and the agent
    removes them; they are planned again once the GPU is within its memory."""
    total = sum(sl.memory_gb for sl in gpu.mps)
    if total <= sharing_mps.memory_gb(gpu.model) and len(gpu.mps) <= sharing_config.MPS_MAX_CLIENTS:
        return gpu
    return dataclasses.replace(gpu, mps=tuple(sl for sl in gpu.mps if sl.taken))


def replica_gpus(
    layout: gpulayouts.GpuLayout,
    gpus: tuple[snapshot.Gpu, ...],
    *,
    reserved: frozenset[tuple[int, int]],
    bound: int,
) -> tuple[snapshot.Gpu, ...]:
    """The GPUs of a node in mode ``time-slicing`` with their replicas (``docs/modes.md``).

    A GPU has the replicas its agent reports (one ``nvidia.com/gpu`` device each, NVIDIA's
    sharing config); a GPU reporting none is left out (the agent shares it with no config). A
    replica is used when the status reports it used, or a live reservation (``reserved``:
    (GPU, replica id)) keeps it. ``bound``: the ``nvidia.com/gpu`` the pods bound to the node
    ask for beyond their live reservations; the kubelet counts devices, and a just-bound pod's
    replica may not be reported yet, so as many replicas as the status reports used outside
    the reservations fall short of it are counted used too, on the GPUs in index order."""
    assert layout.status is not None
    by_index = {g.index: g for g in layout.status.gpus}
    counts: list[tuple[snapshot.Gpu, int, int]] = []
    short = bound
    for gpu in gpus:
        status = by_index.get(gpu.index)
        if status is None or not status.replicas:
            continue
        held = {r.id for r in status.replicas if r.state is gpulayouts.InstanceState.USED}
        kept = {r.id for r in status.replicas if (gpu.index, r.id) in reserved}
        short -= len(held - kept)
        counts.append((gpu, len(status.replicas), len(held | kept)))
    out: list[snapshot.Gpu] = []
    for gpu, total, used in counts:
        more = min(max(short, 0), total - used)
        short -= more
        out.append(
            dataclasses.replace(gpu, instances=(), replicas=total, replicas_used=used + more)
        )
    return tuple(out)


def static_fit(observed: Observed, view: PodView) -> str | None:
    """A statically laid out node with free instances for ``view`` now, by the counts
    kube-scheduler checks (allocatable less what bound pods hold), or ``None``. The node's
    agent must have reported its GPUs in its GpuLayout."""
    if view.pod is None:
        return None
    for name in sorted(observed.nodes):
        node = observed.nodes[name]
        layout = observed.layouts.get(name)
        if not node.static or not node.ready or layout is None or node.problem is not None:
            continue
        try:
            # Its GPUs as reported: the placement rules ask for a node with MIG GPUs.
            gpus = translating.snapshot_gpus(layout)
        except errors.MigpilotError:
            continue
        planner_node = snapshot.Node(
            name=name,
            labels=node.labels,
            taints=node.taints,
            unschedulable=node.unschedulable,
            allocatable=None,
            gpus=gpus,
        )
        if constraints.rejection(planner_node, view.pod) is not None:
            continue
        held = observed.bound.get(name, Counter())
        if all(
            node.allocatable.get(snapshot.resource_name(p), 0) - held[p] >= n
            for p, n in view.mig.items()
        ):
            return name
    return None
