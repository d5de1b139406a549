"""The webhook's decision: which new pods get the ``migpilot.io/plan`` scheduling gate.

Why it exists: a pod that asks for a MIG instance no GPU has yet would be marked Unschedulable by
kube-scheduler and retried with back-off; the controller would then race the scheduler. Gating
the pod at creation (as Kueue does for its workloads) hands it to the controller first: the
controller plans, creates the instance, pins the pod to the node and lifts the gate. The same
holds for a *unified* pod (HAMi-style ``nvidia.com/gpu`` with ``nvidia.com/gpumem`` and the
like, ``docs/unified.md``): the planner turns it into MIG instances, so it is gated alike.

A *whole-GPU* pod (``nvidia.com/gpu: N`` and nothing unified) is gated only when the Lease also
says some node is labelled ``migpilot.io/mig-mode=dynamic`` (``docs/migmode.md``): the
controller may switch a GPU out of MIG for it and must then pin it to that GPU's node, which
only a gated pod allows. Without such a node nothing changes: the pod is NVIDIA's device
plugin's and kube-scheduler's alone. The controller lets a gated whole-GPU pod no dynamic node
can serve go at once.

A *DRA* pod (``spec.resourceClaims``) is gated when one of its ResourceClaims, or the
ResourceClaimTemplate one is made from, asks for a device of migpilot's DeviceClass
``mig.migpilot.io`` (a request's, or a ``firstAvailable`` subrequest's, ``deviceClassName``):
the planner then steers kube-scheduler's allocation (``docs/dra.md``). The pod says only the
names; the shell reads those objects (:mod:`migpilot.webhook.claims`) and hands them here as
:class:`ClaimLookup` values. A pod none of whose claims read shows to be migpilot's is never
gated: the controller lets go a gated pod whose claims it will not plan, but not one of another
driver, which would then wait forever (``docs/webhook.md``).

The gate is added only while the controller holds a fresh Lease, so that a dead controller never
strands new pods; with the webhook's ``failurePolicy: Ignore`` a dead webhook does not either.
This webhook never rejects a pod: a malformed review or pod is allowed unchanged, with a message
and a warning that say what was wrong. (Refusing malformed unified requests is the validating
webhook's job, :mod:`migpilot.webhook.validation`.)

Sans-IO and pure: an AdmissionReview (already decoded from JSON) and the Lease's freshness in,
an AdmissionReview out. What is a MIG request is decided by the one parser of pod requests,
:func:`migpilot.planning.snapshot.pod_requests`; what is a unified request by
:mod:`migpilot.planning.unified`, the parser the planner uses. This module may import the pure
core only: no HTTP, no socket, no Kubernetes client, no clock (an import-linter contract in
pyproject.toml checks it).
"""

from __future__ import annotations

import base64
import enum
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from migpilot import errors
from migpilot.planning import draclaims, modes, snapshot, unified
from migpilot.webhook import reviews

GATE = "migpilot.io/plan"
"""The scheduling gate the webhook adds and the controller removes."""
GATED_LABEL = "migpilot.io/gated"
"""Label the webhook sets (``"true"``) on the pods it gated, so the controller can watch them."""
API_VERSION = reviews.API_VERSION
MAX_CLAIMS = 32
"""Most claims (ResourceClaims and templates, each once) read for one pod: a pod naming more is
not gated, with a warning, so what one review costs the API server stays bounded."""
MAX_NAME = 253
"""Longest object name (a DNS subdomain); a namespace is at most 63 (a DNS label)."""
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?")
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


class PatchOperation(TypedDict):
    op: Literal["add"]
    path: str
    value: Any


# --- the decision ------------------------------------------------------------------------------


class Outcome(enum.StrEnum):
    """Why a review came out as it did (for logs and metrics)."""

    GATED = "gated"
    GATED_WHOLE = "gated-whole-gpu"
    """A whole-GPU pod, gated because some node is labelled for dynamic MIG mode."""
    NOT_POD_CREATE = "not-pod-create"
    NO_MIG_REQUEST = "no-mig-request"
    """Neither a MIG resource nor a unified request (a plain pod, or ``nvidia.com/gpu`` only)."""
    OTHER_VGPU_MODE = "other-vgpu-mode"
    """A unified request whose ``nvidia.com/vgpu-mode`` names another system, which serves it."""
    BAD_UNIFIED_REQUEST = "bad-unified-request"
    """A unified request the planner cannot read; the validating webhook refuses such a pod."""
    ALREADY_GATED = "already-gated"
    BOUND = "bound"
    """``spec.nodeName`` is set: the apiserver rejects a gate on a bound pod."""
    LEASE_STALE = "lease-stale"
    MALFORMED = "malformed"
    GATED_DRA = "gated-dra"
    """A DRA pod: one of its claims asks for ``mig.migpilot.io`` devices."""
    DRA_UNKNOWN = "dra-claims-unknown"
    """A DRA pod none of whose claims read is migpilot's, and some could not be read (not there
    yet, a failed or timed-out read, too many, a name no object can have): not gated, with a
    warning, since it may be another driver's."""


@dataclass(frozen=True, slots=True, order=True)
class ClaimRef:
    """A ResourceClaim, or a ResourceClaimTemplate, that a pod's ``spec.resourceClaims`` names."""

    template: bool
    namespace: str
    name: str

    @property
    def label(self) -> str:
        """How a person names it: ``ResourceClaimTemplate ns/name``."""
        kind = "ResourceClaimTemplate" if self.template else "ResourceClaim"
        return f"{kind} {self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class ClaimLookup:
    """What reading a :class:`ClaimRef` gave: the object, or why there is none."""

    document: Mapping[str, Any] | None = None
    """The object as the API server returned it; ``None`` when not found or not read."""
    problem: str | None = None
    """Why it was not read (a timeout, forbidden...); ``None`` with no document: not found."""


@dataclass(frozen=True)
class Decision:
    """What to do with one review: the patch to send (empty when none) and what to tell."""

    outcome: Outcome
    patch: tuple[PatchOperation, ...] = ()
    warnings: tuple[str, ...] = ()
    problem: str | None = None
    """Set when the review or the pod was malformed: the message to return."""


def review(
    document: object,
    *,
    lease_fresh: bool,
    gate_whole: bool = False,
    claims: Mapping[ClaimRef, ClaimLookup] | None = None,
) -> reviews.AdmissionReview:
    """The AdmissionReview answering ``document`` (a decoded AdmissionReview request).

    Always allows. Adds the gate (and the ``migpilot.io/gated`` label) to a pod being created
    that requests a MIG resource or is unified, has no node and no gate yet, when
    ``lease_fresh``; to a whole-GPU pod alike when ``gate_whole`` too (the Lease says some
    node is labelled ``migpilot.io/mig-mode=dynamic``); and to a DRA pod one of whose
    ``claims`` (the objects :func:`to_read` named, as read) asks for migpilot's devices.
    Warnings and the message are capped (:func:`reviews.capped`), so the answer stays small
    whatever the pod holds.
    """
    decision = decide(document, lease_fresh=lease_fresh, gate_whole=gate_whole, claims=claims)
    response: reviews.AdmissionResponse = {"uid": reviews.uid(document), "allowed": True}
    if decision.patch:
        encoded = json.dumps(list(decision.patch), separators=(",", ":")).encode()
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(encoded).decode("ascii")
    if decision.warnings:
        response["warnings"] = reviews.capped(decision.warnings)
    if decision.problem is not None:
        response["status"] = {"message": reviews.shortened(decision.problem)}
    return reviews.answer(response)


def decide(
    document: object,
    *,
    lease_fresh: bool,
    gate_whole: bool = False,
    claims: Mapping[ClaimRef, ClaimLookup] | None = None,
) -> Decision:
    """The decision for one decoded AdmissionReview; see :func:`review`. A claim ``claims``
    lacks counts as not read."""
    return _decide(document, lease_fresh=lease_fresh, gate_whole=gate_whole, claims=claims)[0]


def to_read(
    document: object, *, lease_fresh: bool, gate_whole: bool = False
) -> tuple[ClaimRef, ...]:
    """The claims and templates whose reading can change the decision on ``document``: those
    of a DRA pod that nothing else gates, not bound, not gated yet, while ``lease_fresh``;
    none for any other review (no read is spent on a pod that cannot be gated). At most
    :data:`MAX_CLAIMS`, each once, each name one an object can have. Never raises."""
    return _decide(document, lease_fresh=lease_fresh, gate_whole=gate_whole, claims=None)[1]


def _decide(
    document: object,
    *,
    lease_fresh: bool,
    gate_whole: bool,
    claims: Mapping[ClaimRef, ClaimLookup] | None,
) -> tuple[Decision, tuple[ClaimRef, ...]]:
    """The decision, and the claims it turned on (empty when none was looked at)."""
    try:
        request = reviews.request_of(document)
        if not reviews.is_pod_create(request):
            return Decision(Outcome.NOT_POD_CREATE), ()
        pod = reviews.pod_of(request)
        mig, warnings = _mig_requests(pod)
        as_unified = _unified_outcome(pod)
        gated = Outcome.GATED
        if (
            gate_whole
            and lease_fresh
            and not mig
            and as_unified is Outcome.NO_MIG_REQUEST
            and asks_whole_gpus(pod)
        ):
            gated = as_unified = Outcome.GATED_WHOLE
        refs: tuple[ClaimRef, ...] = ()
        bad: str | None = None
        if not mig and as_unified is Outcome.NO_MIG_REQUEST:
            # Nothing else gates it: its DRA claims may, once read.
            refs, bad = claim_refs(pod.spec, namespace=_namespace(request, pod))
            if refs or bad:
                gated = as_unified = Outcome.GATED_DRA
        if as_unified is Outcome.BAD_UNIFIED_REQUEST or (
            not mig and as_unified not in (Outcome.GATED, Outcome.GATED_WHOLE, Outcome.GATED_DRA)
        ):
            return Decision(as_unified, warnings=warnings), ()
        gates = _gates(pod.spec)
        if GATE in gates:
            return Decision(Outcome.ALREADY_GATED, warnings=warnings), ()
        if pod.spec.get("nodeName"):
            return Decision(Outcome.BOUND, warnings=warnings), ()
        if not lease_fresh:
            return Decision(Outcome.LEASE_STALE, warnings=warnings), ()
        if gated is Outcome.GATED_DRA:
            if bad is not None:
                return Decision(Outcome.DRA_UNKNOWN, warnings=(*warnings, _not_gated(bad))), ()
            outcome, told = _dra_outcome(refs, claims or {})
            if outcome is not Outcome.GATED_DRA:
                return Decision(outcome, warnings=(*warnings, *told)), refs
        patch = (_gate_patch(pod.spec), _label_patch(pod.metadata))
        return Decision(gated, patch=patch, warnings=warnings), refs
    except reviews.MalformedError as err:
        message = f"migpilot webhook: admitted without a gate: {err}"
        return Decision(Outcome.MALFORMED, warnings=(message,), problem=message), ()


def claim_refs(
    spec: Mapping[str, Any], *, namespace: str
) -> tuple[tuple[ClaimRef, ...], str | None]:
    """The claims and templates the pod's ``spec.resourceClaims`` names in ``namespace``, each
    once, and why they are not to be read when they are not (a name no object can have, more
    than :data:`MAX_CLAIMS`; the refs are then empty). Raises :class:`reviews.MalformedError`
    when ``resourceClaims`` is not a list of objects."""
    found: dict[ClaimRef, None] = {}
    entries = reviews.items(spec.get("resourceClaims"), "spec.resourceClaims")
    for index, raw in enumerate(entries):
        entry = reviews.mapping(raw, f"spec.resourceClaims[{index}]")
        claim, template = entry.get("resourceClaimName"), entry.get("resourceClaimTemplateName")
        where = f"spec.resourceClaims[{index}]"
        if (claim is None) == (template is None):
            both = "resourceClaimName and resourceClaimTemplateName"
            return (), f"{where} names neither or both of {both}"
        name = claim if claim is not None else template
        if not _is_name(name, _NAME, MAX_NAME):
            field = "resourceClaimName" if claim is not None else "resourceClaimTemplateName"
            return (), f"{where}.{field} {_shown(name)} is not an object's name"
        if not _is_name(namespace, _LABEL, 63):
            return (), f"the namespace {_shown(namespace)} is not a namespace's name"
        found[ClaimRef(template is not None, namespace, str(name))] = None
        if len(found) > MAX_CLAIMS:
            return (), f"the pod names more than {MAX_CLAIMS} claims and templates"
    return tuple(found), None


def _is_name(value: object, pattern: re.Pattern[str], longest: int) -> bool:
    return isinstance(value, str) and len(value) <= longest and pattern.fullmatch(value) is not None


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _namespace(request: Mapping[str, Any], pod: reviews.Pod) -> str:
    """The pod's namespace: the request's (the apiserver sets it), else the pod's own."""
    for where in (request.get("namespace"), pod.metadata.get("namespace")):
        if isinstance(where, str) and where:
            return where
    return "default"


def _dra_outcome(
    refs: tuple[ClaimRef, ...], claims: Mapping[ClaimRef, ClaimLookup]
) -> tuple[Outcome, tuple[str, ...]]:
    """Whether a DRA pod is gated, from its claims as read, and what to tell when it is not.

    Gated when a claim read asks for migpilot's devices and is not allocated yet (a claim
    already allocated, shared with a pod that runs, is placed: kube-scheduler sends the pod to
    its node). Its other claims then need not be read: the controller waits for one yet to come,
    as kube-scheduler does. Not gated otherwise: with every claim read and none migpilot's, the
    pod is another driver's; with some not read, it may be, and a gated pod of another driver
    would wait forever (the controller lets go only the pods it reads as its own)."""
    unknown: list[str] = []
    for ref in refs:
        look = claims.get(ref)
        if look is None:
            unknown.append(f"{ref.label} not read")
        elif look.document is None:
            unknown.append(
                f"{ref.label} not found" if look.problem is None else f"{ref.label}: {look.problem}"
            )
        elif _asks_ours(look.document, template=ref.template):
            return Outcome.GATED_DRA, ()
    if not unknown:
        return Outcome.NO_MIG_REQUEST, ()
    return Outcome.DRA_UNKNOWN, (_not_gated("; ".join(unknown)),)


def _asks_ours(document: Mapping[str, Any], *, template: bool) -> bool:
    """Whether a ResourceClaim, or a template's claim, asks for migpilot's devices and is not
    allocated yet (a template's claims never are)."""
    spec = document.get("spec")
    if template:
        spec = spec.get("spec") if isinstance(spec, Mapping) else None
    else:
        status = document.get("status")
        if isinstance(status, Mapping) and status.get("allocation"):
            return False
    return draclaims.names_class(spec)


def _not_gated(why: str) -> str:
    return (
        f"migpilot: not gated for planning ({why}): if the pod asks for "
        f"{draclaims.DEVICE_CLASS} devices, kube-scheduler allocates them without migpilot's plan"
    )


def _unified_outcome(pod: reviews.Pod) -> Outcome:
    """Whether the pod's unified request asks the planner for instances (``GATED``), and why
    not otherwise. Malformed requests are the validating webhook's to report, not warned of
    here (the user would read the same problem twice)."""
    containers = [c.resources for c in pod.containers]
    if not unified.is_unified(containers, pod.annotations):
        if unified.other_mode(containers, pod.annotations) is not None:
            return Outcome.OTHER_VGPU_MODE
        return Outcome.NO_MIG_REQUEST
    try:
        request = unified.parse(
            containers, pod.annotations, where="metadata", wheres=[c.field for c in pod.containers]
        )
    except errors.SnapshotError:
        return Outcome.BAD_UNIFIED_REQUEST
    return Outcome.NO_MIG_REQUEST if request is None else Outcome.GATED


def asks_whole_gpus(pod: reviews.Pod) -> bool:
    """Whether the pod asks for whole GPUs: some container or initContainer asks, in requests
    or limits, for a readable non-zero count of ``nvidia.com/gpu``, and the pod is not unified
    nor another system's (``nvidia.com/vgpu-mode``). A count that does not read is left to the
    apiserver, which refuses it: such a pod is not gated."""
    containers = [c.resources for c in pod.containers]
    if unified.is_unified(containers, pod.annotations):
        return False
    if unified.other_mode(containers, pod.annotations) is not None:
        return False
    found = False
    for container in pod.containers:
        for amounts in (container.requests, container.limits):
            if unified.GPU not in amounts:
                continue
            try:
                count = snapshot.amount(unified.GPU, amounts[unified.GPU], where=container.label)
            except (errors.MigpilotError, ValueError):
                return False
            found = found or count > 0
    return found


def _mig_requests(pod: reviews.Pod) -> tuple[list[str], tuple[str, ...]]:
    """The well-formed MIG resources and MPS slices the pod's containers ask for (requests or
    limits), and a warning for each malformed one, which no device plugin advertises."""
    found: list[str] = []
    warnings: dict[str, str] = {}  # one warning per resource name
    for container in pod.containers:
        for amounts in (container.requests, container.limits):
            for key, value in amounts.items():
                if not (
                    str(key).startswith(snapshot.MIG_RESOURCE_PREFIX)
                    or modes.is_mps_resource(str(key))
                ):
                    continue
                try:
                    requests = snapshot.pod_requests({key: value}, where=container.label)
                except errors.SnapshotError as err:
                    problem = str(err)
                except ValueError:  # int() refuses a string of over 4300 digits
                    problem = f"{container.label}.{key}: the count is too long to read"
                else:
                    found.extend(r.profile for r in requests.mig)
                    found.extend(r.resource for r in requests.mps)
                    continue
                if not _is_zero(value):  # asking for none is not a MIG request, nor an error
                    warnings.setdefault(key, f"migpilot: {problem}")
    return found, tuple(warnings.values())


def _is_zero(value: object) -> bool:
    return value == 0 or (isinstance(value, str) and value.strip() == "0")


def _gates(spec: Mapping[str, Any]) -> list[str]:
    names = []
    for index, gate in enumerate(
        reviews.items(spec.get("schedulingGates"), "spec.schedulingGates")
    ):
        entry = reviews.mapping(gate, f"spec.schedulingGates[{index}]")
        names.append(str(entry.get("name")))
    return names


def _gate_patch(spec: Mapping[str, Any]) -> PatchOperation:
    if spec.get("schedulingGates"):
        return {"op": "add", "path": "/spec/schedulingGates/-", "value": {"name": GATE}}
    # Absent, null or empty: (re)create the list; "add" on an existing member replaces it.
    return {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": GATE}]}


def _label_patch(metadata: Mapping[str, Any]) -> PatchOperation:
    if isinstance(metadata.get("labels"), Mapping):
        path = "/metadata/labels/" + _pointer_token(GATED_LABEL)
        return {"op": "add", "path": path, "value": "true"}
    return {"op": "add", "path": "/metadata/labels", "value": {GATED_LABEL: "true"}}


def _pointer_token(key: str) -> str:
    """A JSON Pointer reference token (RFC 6901): ``~`` and ``/`` escaped."""
    return key.replace("~", "~0").replace("/", "~1")
