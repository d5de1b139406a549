"""The webhook's decision: which new pods get the ``migpilot.io/plan`` scheduling gate.

Why it exists: a pod that asks for a MIG instance no GPU has yet would be marked Unschedulable by
kube-scheduler and retried with back-off; the controller would then race the scheduler. Gating
the pod at creation (as Kueue does for its workloads) hands it to the controller first: the
controller plans, creates the instance, pins the pod to the node and lifts the gate.

The gate is added only while the controller holds a fresh Lease, so that a dead controller never
strands new pods; with the webhook's ``failurePolicy: Ignore`` a dead webhook does not either.
The webhook never rejects a pod: a malformed review or pod is allowed unchanged, with a message
and a warning that say what was wrong.

Sans-IO and pure: an AdmissionReview (already decoded from JSON) and the Lease's freshness in,
an AdmissionReview out; ``now`` is an argument. What is a MIG request is decided by the one
parser of pod requests, :func:`migpilot.planning.snapshot.pod_requests`. This module may import
the pure core only: no HTTP, no socket, no Kubernetes client, no clock (an import-linter
contract in pyproject.toml checks it).
"""

from __future__ import annotations

import base64
import enum
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from migpilot import errors
from migpilot.planning import snapshot

GATE = "migpilot.io/plan"
"""The scheduling gate the webhook adds and the controller removes."""
GATED_LABEL = "migpilot.io/gated"
"""Label the webhook sets (``"true"``) on the pods it gated, so the controller can watch them."""
API_VERSION = "admission.k8s.io/v1"


# --- the AdmissionReview at the boundary (admission.k8s.io/v1) ---------------------------------


class GroupVersionKind(TypedDict, total=False):
    group: str
    version: str
    kind: str


class AdmissionRequest(TypedDict, total=False):
    uid: str
    kind: GroupVersionKind
    operation: str
    subResource: str
    namespace: str
    name: str
    object: dict[str, Any]
    dryRun: bool


class Status(TypedDict):
    message: str


class AdmissionResponse(TypedDict, total=False):
    uid: str
    allowed: bool
    patchType: Literal["JSONPatch"]
    patch: str
    """Base64 of the JSON Patch (RFC 6902) document."""
    warnings: list[str]
    status: Status


class AdmissionReview(TypedDict, total=False):
    apiVersion: str
    kind: str
    request: AdmissionRequest
    response: AdmissionResponse


class PatchOperation(TypedDict):
    op: Literal["add"]
    path: str
    value: Any


# --- the decision ------------------------------------------------------------------------------


class Outcome(enum.StrEnum):
    """Why a review came out as it did (for logs and metrics)."""

    GATED = "gated"
    NOT_POD_CREATE = "not-pod-create"
    NO_MIG_REQUEST = "no-mig-request"
    ALREADY_GATED = "already-gated"
    BOUND = "bound"
    """``spec.nodeName`` is set: the apiserver rejects a gate on a bound pod."""
    LEASE_STALE = "lease-stale"
    MALFORMED = "malformed"


@dataclass(frozen=True)
class Decision:
    """What to do with one review: the patch to send (empty when none) and what to tell."""

    outcome: Outcome
    patch: tuple[PatchOperation, ...] = ()
    warnings: tuple[str, ...] = ()
    problem: str | None = None
    """Set when the review or the pod was malformed: the message to return."""


class _MalformedError(Exception):
    """The review or the pod is not what the API promises; carries the one-line reason."""


def review(document: object, *, lease_fresh: bool) -> AdmissionReview:
    """The AdmissionReview answering ``document`` (a decoded AdmissionReview request).

    Always allows. Adds the gate (and the ``migpilot.io/gated`` label) to a pod being created
    that requests a MIG resource, has no node and no gate yet, when ``lease_fresh``.
    """
    uid = _uid(document)
    decision = decide(document, lease_fresh=lease_fresh)
    response: AdmissionResponse = {"uid": uid, "allowed": True}
    if decision.patch:
        encoded = json.dumps(list(decision.patch), separators=(",", ":")).encode()
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(encoded).decode("ascii")
    if decision.warnings:
        response["warnings"] = list(decision.warnings)
    if decision.problem is not None:
        response["status"] = {"message": decision.problem}
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def decide(document: object, *, lease_fresh: bool) -> Decision:
    """The decision for one decoded AdmissionReview; see :func:`review`."""
    try:
        request = _request(document)
        if not _is_pod_create(request):
            return Decision(Outcome.NOT_POD_CREATE)
        pod = _mapping(request.get("object"), "request.object")
        metadata = _mapping(pod.get("metadata", {}), "the pod's metadata")
        spec = _mapping(pod.get("spec"), "the pod's spec")
        mig, warnings = _mig_requests(spec)
        if not mig:
            return Decision(Outcome.NO_MIG_REQUEST, warnings=warnings)
        gates = _gates(spec)
        if GATE in gates:
            return Decision(Outcome.ALREADY_GATED, warnings=warnings)
        if spec.get("nodeName"):
            return Decision(Outcome.BOUND, warnings=warnings)
        if not lease_fresh:
            return Decision(Outcome.LEASE_STALE, warnings=warnings)
        patch = (_gate_patch(spec), _label_patch(metadata))
        return Decision(Outcome.GATED, patch=patch, warnings=warnings)
    except _MalformedError as err:
        message = f"migpilot webhook: admitted without a gate: {err}"
        return Decision(Outcome.MALFORMED, warnings=(message,), problem=message)


def _uid(document: object) -> str:
    if isinstance(document, Mapping):
        request = document.get("request")
        if isinstance(request, Mapping) and isinstance(request.get("uid"), str):
            return str(request["uid"])
    return ""


def _request(document: object) -> Mapping[str, Any]:
    if not isinstance(document, Mapping):
        raise _MalformedError("the AdmissionReview is not a JSON object")
    if document.get("kind") != "AdmissionReview" or document.get("apiVersion") != API_VERSION:
        raise _MalformedError(f"expected an AdmissionReview of {API_VERSION}")
    request = _mapping(document.get("request"), "request")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise _MalformedError("request.uid is missing")
    return request


def _is_pod_create(request: Mapping[str, Any]) -> bool:
    kind = request.get("kind")
    return (
        isinstance(kind, Mapping)
        and kind.get("group", "") == ""
        and kind.get("kind") == "Pod"
        and request.get("operation") == "CREATE"
        and not request.get("subResource")
    )


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise _MalformedError(f"{where} is not an object")
    return value


def _list(value: object, where: str) -> Sequence[Any]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _MalformedError(f"{where} is not a list")
    return value


def _mig_requests(spec: Mapping[str, Any]) -> tuple[list[str], tuple[str, ...]]:
    """The well-formed MIG resources the pod's containers ask for (requests or limits), and a
    warning for each malformed MIG resource name, which no device plugin advertises."""
    found: list[str] = []
    warnings: dict[str, str] = {}  # one warning per resource name
    for field in ("initContainers", "containers"):
        for index, raw in enumerate(_list(spec.get(field), f"spec.{field}")):
            container = _mapping(raw, f"spec.{field}[{index}]")
            name = container.get("name")
            label = f"{field[:-1]} {name if isinstance(name, str) else index}"
            resources = _mapping(container.get("resources", {}), f"{label}: resources")
            for kind in ("requests", "limits"):
                amounts = resources.get(kind)
                if amounts is None:
                    continue
                amounts = _mapping(amounts, f"{label}: resources.{kind}")
                for key, value in amounts.items():
                    if not str(key).startswith(snapshot.MIG_RESOURCE_PREFIX):
                        continue
                    try:
                        requests = snapshot.pod_requests({key: value}, where=label)
                    except errors.SnapshotError as err:
                        if _is_zero(value):
                            continue  # asking for none is not a MIG request, and not an error
                        warnings.setdefault(key, f"migpilot: {err}")
                        continue
                    found.extend(r.profile for r in requests.mig)
    return found, tuple(warnings.values())


def _is_zero(value: object) -> bool:
    return value == 0 or (isinstance(value, str) and value.strip() == "0")


def _gates(spec: Mapping[str, Any]) -> list[str]:
    names = []
    for index, gate in enumerate(_list(spec.get("schedulingGates"), "spec.schedulingGates")):
        entry = _mapping(gate, f"spec.schedulingGates[{index}]")
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
