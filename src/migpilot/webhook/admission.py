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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

from migpilot import errors
from migpilot.planning import modes, snapshot, unified
from migpilot.webhook import reviews

GATE = "migpilot.io/plan"
"""The scheduling gate the webhook adds and the controller removes."""
GATED_LABEL = "migpilot.io/gated"
"""Label the webhook sets (``"true"``) on the pods it gated, so the controller can watch them."""
API_VERSION = reviews.API_VERSION


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


@dataclass(frozen=True)
class Decision:
    """What to do with one review: the patch to send (empty when none) and what to tell."""

    outcome: Outcome
    patch: tuple[PatchOperation, ...] = ()
    warnings: tuple[str, ...] = ()
    problem: str | None = None
    """Set when the review or the pod was malformed: the message to return."""


def review(
    document: object, *, lease_fresh: bool, gate_whole: bool = False
) -> reviews.AdmissionReview:
    """The AdmissionReview answering ``document`` (a decoded AdmissionReview request).

    Always allows. Adds the gate (and the ``migpilot.io/gated`` label) to a pod being created
    that requests a MIG resource or is unified, has no node and no gate yet, when
    ``lease_fresh``; and to a whole-GPU pod alike when ``gate_whole`` too (the Lease says some
    node is labelled ``migpilot.io/mig-mode=dynamic``). Warnings and the message are capped
    (:func:`reviews.capped`), so the answer stays small whatever the pod holds.
    """
    decision = decide(document, lease_fresh=lease_fresh, gate_whole=gate_whole)
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


def decide(document: object, *, lease_fresh: bool, gate_whole: bool = False) -> Decision:
    """The decision for one decoded AdmissionReview; see :func:`review`."""
    try:
        request = reviews.request_of(document)
        if not reviews.is_pod_create(request):
            return Decision(Outcome.NOT_POD_CREATE)
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
        if as_unified is Outcome.BAD_UNIFIED_REQUEST or (
            not mig and as_unified not in (Outcome.GATED, Outcome.GATED_WHOLE)
        ):
            return Decision(as_unified, warnings=warnings)
        gates = _gates(pod.spec)
        if GATE in gates:
            return Decision(Outcome.ALREADY_GATED, warnings=warnings)
        if pod.spec.get("nodeName"):
            return Decision(Outcome.BOUND, warnings=warnings)
        if not lease_fresh:
            return Decision(Outcome.LEASE_STALE, warnings=warnings)
        patch = (_gate_patch(pod.spec), _label_patch(pod.metadata))
        return Decision(gated, patch=patch, warnings=warnings)
    except reviews.MalformedError as err:
        message = f"migpilot webhook: admitted without a gate: {err}"
        return Decision(Outcome.MALFORMED, warnings=(message,), problem=message)


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
