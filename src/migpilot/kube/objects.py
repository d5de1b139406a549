"""The Kubernetes objects the shells read and write, as the boundary hands them over.

Why it exists: the agent, the controller and the webhook list and watch the same kinds and read
the same metadata; the types of those answers (:class:`Listed`, :class:`WatchEvent`), the
selectors that narrow them (:class:`LabelSelector`, :class:`FieldSelector`) and the readers of a
raw object's metadata are written once here, for :mod:`~migpilot.kube.client` and
:mod:`~migpilot.kube.memory` alike. Objects cross the boundary as raw JSON (mappings as the API
returns them): the shells' pure modules parse them, so a malformed object reaches their checks
rather than failing inside a client.

Pure: no client, no I/O, no clock.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


class Kind(enum.StrEnum):
    """The kinds migpilot reads or writes (the value is the resource's plural)."""

    PODS = "pods"
    NODES = "nodes"
    LAYOUTS = "gpulayouts"
    CONFIGMAPS = "configmaps"
    LEASES = "leases"
    EVENTS = "events"
    NAMESPACES = "namespaces"
    RESOURCECLAIMS = "resourceclaims"
    """``resource.k8s.io/v1`` ResourceClaims (the DRA kubelet plugin reads its claims; the
    controller reads what pods' claims ask)."""
    RESOURCECLAIMTEMPLATES = "resourceclaimtemplates"
    """``resource.k8s.io/v1`` ResourceClaimTemplates (the controller reads what pods' claims
    from templates ask)."""
    RESOURCESLICES = "resourceslices"
    """``resource.k8s.io/v1`` ResourceSlices (DRA: the devices a driver publishes)."""

    @property
    def namespaced(self) -> bool:
        """Whether objects of this kind live in a namespace (their key is ``namespace/name``)."""
        return self not in _CLUSTER_WIDE


_CLUSTER_WIDE = frozenset({Kind.NODES, Kind.LAYOUTS, Kind.NAMESPACES, Kind.RESOURCESLICES})


class EventType(enum.StrEnum):
    """What happened to a watched object."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


class Patch(enum.StrEnum):
    """How a patch body is read (its ``Content-Type``)."""

    APPLY = "apply"
    """Server-side apply: the fields the body names are the field manager's."""
    MERGE = "merge"
    """RFC 7386 JSON merge patch: maps merge, ``null`` removes a key."""
    JSON = "json"
    """RFC 6902 JSON patch: a list of operations."""


@dataclass(frozen=True, slots=True)
class Listed:
    """A list call's answer: the objects found and where to watch from."""

    items: Sequence[Mapping[str, Any]]
    """The raw objects."""
    resource_version: str
    """The list's resource version: a watch from it misses nothing."""

    def one(self) -> Mapping[str, Any] | None:
        """The object a list of one name found, ``None`` when there is none."""
        return self.items[0] if self.items else None


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of a watched object."""

    type: EventType
    object: Mapping[str, Any]
    """The raw object after the change (as it was deleted, for ``DELETED``)."""


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """Objects whose label ``key`` exists (``value`` ``None``) or equals ``value``."""

    key: str
    """The label's key, e.g. ``migpilot.io/emulated-gpus``."""
    value: str | None = None
    """The value it must have; ``None``: any value."""

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether an object with ``labels`` is selected."""
        if self.key not in labels:
            return False
        return self.value is None or labels[self.key] == self.value

    def __str__(self) -> str:
        return self.key if self.value is None else f"{self.key}={self.value}"


@dataclass(frozen=True, slots=True)
class FieldSelector:
    """Objects whose field ``path`` (dotted, e.g. ``spec.nodeName``) equals ``value``, or
    differs from it when ``negated`` (``spec.nodeName!=""``: bound pods)."""

    path: str
    value: str
    negated: bool = False

    def matches(self, doc: Mapping[str, Any]) -> bool:
        """Whether the raw object ``doc`` is selected (a missing field reads as ``""``, as
        the API server reads it)."""
        field: Any = doc
        for part in self.path.split("."):
            field = field.get(part) if isinstance(field, Mapping) else None
        equal = str(field or "") == self.value
        return equal != self.negated

    def __str__(self) -> str:
        return f"{self.path}{'!=' if self.negated else '='}{self.value}"


def named(name: str) -> FieldSelector:
    """The object called ``name``."""
    return FieldSelector("metadata.name", name)


def on_node(node: str | None) -> FieldSelector:
    """The pods bound to ``node``; for ``None``, the pods bound to any node."""
    if node is None:
        return FieldSelector("spec.nodeName", "", negated=True)
    return FieldSelector("spec.nodeName", node)


@dataclass(frozen=True, slots=True)
class EventNote:
    """A Kubernetes Event to record on a Pod or a Node."""

    kind: str
    """``Pod`` or ``Node``."""
    namespace: str | None
    name: str
    uid: str
    type: str
    """``Normal`` or ``Warning``."""
    reason: str
    message: str


def key_of(doc: Mapping[str, Any]) -> str:
    """A raw object's key: ``namespace/name``, or ``name`` for a cluster-wide object."""
    meta = doc.get("metadata") or {}
    namespace = meta.get("namespace")
    return f"{namespace}/{meta['name']}" if namespace else str(meta["name"])


def name_of(doc: Mapping[str, Any]) -> str:
    """A raw object's ``metadata.name``, ``""`` when it has none."""
    return str((doc.get("metadata") or {}).get("name", ""))


def labels_of(doc: Mapping[str, Any]) -> dict[str, str]:
    """A raw object's ``metadata.labels``, empty when it has none."""
    meta = doc.get("metadata") or {}
    return {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}


def node_name_of(pod: Mapping[str, Any]) -> str:
    """The node a pod (raw JSON) is bound to, ``""`` when it is not bound."""
    return str((pod.get("spec") or {}).get("nodeName") or "")
