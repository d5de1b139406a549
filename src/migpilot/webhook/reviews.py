"""AdmissionReview v1 as the apiserver sends it, and the pod being created inside it.

Why it exists: both of the webhook's decisions, the mutating one that gates
(:mod:`~migpilot.webhook.admission`) and the validating one that refuses malformed unified
requests (:mod:`~migpilot.webhook.validation`), read the same review and the same parts of the
pod: its containers' resources and its annotations. Reading them once, here, gives both the
same view and the same one-line reasons when the review is not what the API promises.

Pure and sans-IO: decoded JSON in, frozen dataclasses out. May import the pure core only (an
import-linter contract in pyproject.toml checks it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

API_VERSION = "admission.k8s.io/v1"
MAX_LINES = 16
"""Most warnings, or problems, one answer tells; the rest are counted (``+K more``)."""
MAX_LINE_CHARS = 512
"""Longest warning, problem or message told; longer ones are cut (``...``). With
:data:`MAX_LINES` this bounds an answer (some 20 KB) whatever the pod holds: a 256 KiB
annotation of unknown GPU models once made a 6.4 MB answer."""


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


class Status(TypedDict, total=False):
    """The ``metav1.Status`` of a response: the message, and for a refusal its HTTP code."""

    message: str
    code: int
    reason: str


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


def answer(response: AdmissionResponse) -> AdmissionReview:
    """The AdmissionReview carrying ``response``."""
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def capped(lines: Iterable[str]) -> list[str]:
    """The first :data:`MAX_LINES` of ``lines``, each :func:`shortened`, and ``+K more`` for
    the rest."""
    out: list[str] = []
    rest = 0
    for line in lines:
        if len(out) < MAX_LINES:
            out.append(shortened(line))
        else:
            rest += 1
    if rest:
        out.append(f"+{rest} more")
    return out


def shortened(text: str) -> str:
    """``text``, cut to :data:`MAX_LINE_CHARS` with ``...`` when longer."""
    return text if len(text) <= MAX_LINE_CHARS else f"{text[: MAX_LINE_CHARS - 3]}..."


# --- reading a review --------------------------------------------------------------------------


class MalformedError(Exception):
    """The review or the pod is not what the API promises; carries the one-line reason."""


@dataclass(frozen=True, slots=True)
class Container:
    """One container (or init container) of the pod, as far as the webhook looks."""

    field: str
    """Where it is in the pod: ``spec.containers[0]``, ``spec.initContainers[1]``."""
    label: str
    """How a person names it: ``container app``, ``initContainer setup``."""
    requests: Mapping[str, Any]
    limits: Mapping[str, Any]

    @property
    def resources(self) -> Mapping[str, Any]:
        """Requests and limits together, a request winning: the apiserver copies limits into
        absent requests, and refuses an extended resource whose request and limit differ."""
        return {**self.limits, **self.requests}


@dataclass(frozen=True, slots=True)
class Pod:
    """The pod a review creates."""

    metadata: Mapping[str, Any]
    spec: Mapping[str, Any]
    annotations: Mapping[str, str]
    containers: tuple[Container, ...]
    """Init containers first, then containers (the kubelet's order)."""


def uid(document: object) -> str:
    """The request's uid, or ``""`` when the document has none (to echo even when malformed)."""
    if isinstance(document, Mapping):
        request = document.get("request")
        if isinstance(request, Mapping) and isinstance(request.get("uid"), str):
            return str(request["uid"])
    return ""


def pod_and_node(document: object) -> tuple[str | None, str | None]:
    """The pod a pod-create review creates, as ``namespace/name`` (``namespace/prefix*`` when
    the API server is to generate the name from ``generateName``), and the node it names in
    ``spec.nodeName``; ``None`` for what the document does not say. Never raises: a malformed
    review is logged too, with what can be read of it."""

    def text(where: Mapping[str, Any], key: str) -> str:
        value = where.get(key)
        return value if isinstance(value, str) else ""

    def part(where: Mapping[str, Any], key: str) -> Mapping[str, Any]:
        value = where.get(key)
        return value if isinstance(value, Mapping) else {}

    request = part(document, "request") if isinstance(document, Mapping) else {}
    if not is_pod_create(request):
        return None, None
    pod = part(request, "object")
    metadata = part(pod, "metadata")
    namespace = text(request, "namespace") or text(metadata, "namespace")
    name = text(request, "name") or text(metadata, "name")
    if not name and text(metadata, "generateName"):
        name = text(metadata, "generateName") + "*"
    node = text(part(pod, "spec"), "nodeName")
    return (f"{namespace}/{name}" if namespace and name else None), (node or None)


def request_of(document: object) -> Mapping[str, Any]:
    """The ``request`` of a decoded AdmissionReview; raises :class:`MalformedError`."""
    if not isinstance(document, Mapping):
        raise MalformedError("the AdmissionReview is not a JSON object")
    if document.get("kind") != "AdmissionReview" or document.get("apiVersion") != API_VERSION:
        raise MalformedError(f"expected an AdmissionReview of {API_VERSION}")
    request = mapping(document.get("request"), "request")
    if not isinstance(request.get("uid"), str) or not request["uid"]:
        raise MalformedError("request.uid is missing")
    return request


def is_pod_create(request: Mapping[str, Any]) -> bool:
    """Whether the request creates a Pod (not one of its subresources)."""
    kind = request.get("kind")
    return (
        isinstance(kind, Mapping)
        and kind.get("group", "") == ""
        and kind.get("kind") == "Pod"
        and request.get("operation") == "CREATE"
        and not request.get("subResource")
    )


def pod_of(request: Mapping[str, Any]) -> Pod:
    """The pod a pod-create request carries; raises :class:`MalformedError`."""
    pod = mapping(request.get("object"), "request.object")
    metadata = mapping(pod.get("metadata", {}), "the pod's metadata")
    spec = mapping(pod.get("spec"), "the pod's spec")
    annotations = mapping(metadata.get("annotations"), "metadata.annotations", empty=True)
    for key, value in annotations.items():
        if not isinstance(value, str):
            raise MalformedError(f"metadata.annotations[{key}] is not a string")
    containers = []
    for field in ("initContainers", "containers"):
        for index, raw in enumerate(items(spec.get(field), f"spec.{field}")):
            container = mapping(raw, f"spec.{field}[{index}]")
            name = container.get("name")
            label = f"{field[:-1]} {name if isinstance(name, str) else index}"
            resources = mapping(container.get("resources"), f"{label}: resources", empty=True)
            amounts = {
                kind: mapping(resources.get(kind), f"{label}: resources.{kind}", empty=True)
                for kind in ("requests", "limits")
            }
            containers.append(
                Container(
                    field=f"spec.{field}[{index}]",
                    label=label,
                    requests=amounts["requests"],
                    limits=amounts["limits"],
                )
            )
    return Pod(metadata, spec, annotations, tuple(containers))


def mapping(value: object, where: str, *, empty: bool = False) -> Mapping[str, Any]:
    """A JSON object (with ``empty``, ``null`` or absent reads as ``{}``); raises
    :class:`MalformedError`."""
    if empty and value is None:
        return {}
    if not isinstance(value, Mapping):
        raise MalformedError(f"{where} is not an object")
    return value


def items(value: object, where: str) -> Sequence[Any]:
    """A JSON list (``null`` or absent: empty); raises :class:`MalformedError`."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise MalformedError(f"{where} is not a list")
    return value
