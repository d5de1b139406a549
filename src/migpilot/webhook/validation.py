"""The validating webhook's decision: refuse a new pod whose unified request is malformed.

Why it exists: a unified pod (HAMi-style ``nvidia.com/gpu`` with ``nvidia.com/gpumem``,
``gpumem-percentage`` or ``gpucores``, or ``nvidia.com/vgpu-mode: mig`` or ``mps``;
``docs/unified.md``)
that the planner cannot read, or that no GPU model migpilot knows could ever serve, would
otherwise be created and wait forever, its problem told only by an event on the pod. Refusing it
at creation puts the reason in front of the person running ``kubectl apply``, naming the field.

What is refused is only what can never be served and is unambiguously a mistake (the reasons,
case by case, are in ``docs/webhook.md``): a unified amount that is not a whole number or out of
its range, ``gpumem``/``gpumem-percentage``/``gpucores`` without ``nvidia.com/gpu`` beside it,
both ``gpumem`` and ``gpumem-percentage``, a scheduler policy other than ``binpack`` or
``spread``, more memory than any allowed GPU model has in one MIG instance, model filters that
leave no GPU model at all, and a container asking more than one GPU with ``vgpu-mode: mps`` (an
MPS slice is one GPU's). Never refused: a pod that is not unified (a plain pod, whole GPUs,
another ``vgpu-mode``), ``nvidia.com/mig-*`` resources (the mutating webhook warns of a misspelt
one: that namespace is shared with NVIDIA's device plugin), a well-formed request no node has
room or the right GPU for now (it waits, with an event from the controller), and a malformed
review (allowed with a message, as the mutating webhook does). A model filter naming a GPU
migpilot does not know (HAMi's own example says ``use-gputype: "A100,V100"``) is allowed with a
warning: it selects nothing, but the others may.

Sans-IO and pure: a decoded AdmissionReview in, an AdmissionReview out; the rules are
:mod:`migpilot.planning.unified`'s, the parser the planner uses, so a pod this webhook allows is
one the planner reads. May import the pure core only: no HTTP, no socket, no Kubernetes client,
no clock (an import-linter contract in pyproject.toml checks it).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass

from migpilot import errors
from migpilot.mig import catalog, profiles
from migpilot.planning import unified
from migpilot.webhook import reviews

REFUSAL_CODE = 422
"""HTTP code of a refusal: the apiserver's own for an invalid object (``reason: Invalid``)."""


class Outcome(enum.StrEnum):
    """Why a review came out as it did (for logs and metrics)."""

    ALLOWED = "allowed"
    """A unified request, well formed (it may still have to wait for room)."""
    REFUSED = "refused"
    NOT_POD_CREATE = "not-pod-create"
    NOT_UNIFIED = "not-unified"
    """No unified request, or a ``nvidia.com/vgpu-mode`` that names another system."""
    MALFORMED = "malformed"
    """The review itself is not what the API promises: allowed, with a message."""


@dataclass(frozen=True)
class Verdict:
    """What to answer one review: refuse when ``problems``, and what to tell."""

    outcome: Outcome
    problems: tuple[str, ...] = ()
    """Each a line naming the field: ``spec.containers[0].resources.nvidia.com/gpumem: ...``."""
    warnings: tuple[str, ...] = ()
    message: str | None = None
    """Set when the review was malformed: the message to return, allowing."""


def review(document: object) -> reviews.AdmissionReview:
    """The AdmissionReview answering ``document`` (a decoded AdmissionReview request): allowed,
    unless it creates a pod whose unified request is malformed (then refused, saying why).
    Problems and warnings are capped (:func:`reviews.capped`), so the answer stays small
    whatever the pod holds."""
    verdict = decide(document)
    response: reviews.AdmissionResponse = {
        "uid": reviews.uid(document),
        "allowed": not verdict.problems,
    }
    if verdict.problems:
        response["status"] = {
            "code": REFUSAL_CODE,
            "reason": "Invalid",
            "message": "; ".join(reviews.capped(verdict.problems)),
        }
    elif verdict.message is not None:
        response["status"] = {"message": reviews.shortened(verdict.message)}
    if verdict.warnings:
        response["warnings"] = reviews.capped(verdict.warnings)
    return reviews.answer(response)


def decide(document: object) -> Verdict:
    """The verdict on one decoded AdmissionReview; see :func:`review`."""
    try:
        request = reviews.request_of(document)
        if not reviews.is_pod_create(request):
            return Verdict(Outcome.NOT_POD_CREATE)
        return check(reviews.pod_of(request))
    except reviews.MalformedError as err:
        message = f"migpilot webhook: not validated: {err}"
        return Verdict(Outcome.MALFORMED, warnings=(message,), message=message)


def check(pod: reviews.Pod) -> Verdict:
    """The verdict on one pod being created."""
    containers = [c.resources for c in pod.containers]
    if not unified.is_unified(containers, pod.annotations):
        return Verdict(Outcome.NOT_UNIFIED)
    problems: list[str] = []
    asks: list[tuple[reviews.Container, unified.GpuAsk]] = []
    for container in pod.containers:
        try:
            ask = unified.parse_container(container.resources, where=f"{container.field}.resources")
        except errors.SnapshotError as err:
            problems.append(str(err))
            continue
        if ask is not None:
            asks.append((container, ask))
    try:
        pod_level = unified.parse_annotations(pod.annotations, where="metadata")
    except errors.SnapshotError as err:
        problems.append(str(err))
        pod_level = None
    if problems or pod_level is None:
        return Verdict(Outcome.REFUSED, tuple(problems))
    if not asks:  # nvidia.com/gpu: 0, or only the vgpu-mode annotation: nothing to serve
        return Verdict(Outcome.ALLOWED)
    request = dataclasses.replace(pod_level, asks=tuple(ask for _, ask in asks))
    models = [m for m in catalog.gpu_models() if unified.allowed(request, m)]
    problems.extend(_too_big(asks, models) if models else [_no_model(request, pod.annotations)])
    if not problems and (why := unified.never_served(request)) is not None:
        problems.append(f"spec: {why}")  # a safety net: the checks above name the field first
    warnings = tuple(
        f"migpilot: metadata.annotations[{annotation}]: {_shown(f)} matches no GPU model migpilot "
        f"serves (it serves MIG-capable ones only): it selects nothing"
        for annotation, only in (
            (unified.USE_TYPE, dataclasses.replace(request, nouse_models=())),
            (unified.NOUSE_TYPE, dataclasses.replace(request, use_models=())),
        )
        for f in unified.unknown_filters(only)
    )
    return Verdict(
        Outcome.REFUSED if problems else Outcome.ALLOWED, tuple(problems), warnings=warnings
    )


def _too_big(
    asks: list[tuple[reviews.Container, unified.GpuAsk]], models: list[profiles.GpuModel]
) -> list[str]:
    """A line for each container that asks more memory than any allowed model has in one MIG
    instance. (Percentages and cores always fit: 100 % is a model's largest profile.)"""
    biggest = max(models, key=unified.memory_mib)
    out = []
    for container, ask in asks:
        if any(unified.profile_for(ask, m) is not None for m in models):
            continue
        field = f"{container.field}.resources.{unified.GPUMEM}"
        raw = str(container.resources.get(unified.GPUMEM)).strip()
        # Say what a quantity with a unit came to: gpumem counts MiB, so 8Gi is 2^33 of them.
        amount = f"{ask.memory_mib} MiB"
        if raw != str(ask.memory_mib):
            amount = f"{_shown(raw)} ({amount}: {unified.GPUMEM} counts MiB)"
        out.append(
            f"{field}: {amount} is more than any allowed GPU model offers in one MIG "
            f"instance (at most {unified.memory_mib(biggest)} MiB, on {biggest.id})"
        )
    return out


def _no_model(request: unified.UnifiedRequest, annotations: Mapping[str, str]) -> str:
    known = ", ".join(m.id for m in catalog.gpu_models())
    if request.use_models and not any(
        unified.allowed(dataclasses.replace(request, nouse_models=()), m)
        for m in catalog.gpu_models()
    ):
        field = f"metadata.annotations[{unified.USE_TYPE}]"
        return (
            f"{field}: {_shown(annotations[unified.USE_TYPE])} matches no GPU model migpilot "
            f"serves (it serves MIG on: {known})"
        )
    return (
        f"metadata.annotations[{unified.USE_TYPE}], [{unified.NOUSE_TYPE}]: together they "
        f"exclude every GPU model migpilot serves ({known})"
    )


def _shown(text: str) -> str:
    """``text`` quoted for a message, cut short: it may come from anyone creating a pod."""
    quoted = repr(text)
    return quoted if len(quoted) <= 60 else f"{quoted[:57]}..."
