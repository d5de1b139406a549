"""The part of the Kubernetes API the node agent needs, as a small Protocol, and an in-memory one.

The agent reads one object, its node's GpuLayout (``gpulayouts.migpilot.io``, named after the
node), follows it with a watch, and writes three things: the GpuLayout's status (server-side
apply as ``migpilot-agent``), the GFD labels on its Node, and, when it stands in for the kubelet,
the Node's extended-resource capacity and allocatable. :class:`NodeApi` is exactly that, with raw
JSON documents in and out (the caller parses them with :mod:`migpilot.api.gpulayouts`), so a
malformed object reaches the agent's own checks rather than failing inside a client.

:class:`InMemoryNodeApi` is the same contract without a server, shipped here so that unit tests
and demos drive the real agent code: objects carry ``metadata.generation`` (bumped by spec
changes only, as the status subresource makes the apiserver do), a resource version, and a
watch that answers :class:`GoneError` for a version older than the last :meth:`compact`.
:mod:`migpilot.agent.kube` is the lightkube implementation; it is the only agent module that
imports a Kubernetes client (an import-linter contract says so).

No I/O, no clock; never imports lightkube or httpx2.
"""

from __future__ import annotations

import copy
import enum
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from migpilot import errors
from migpilot.api import gpulayouts


class KubeApiError(errors.MigpilotError):
    """The API server refused a call or could not be reached."""


class GoneError(KubeApiError):
    """410 Gone: a watch's resource version is too old; list again and watch from there."""


class EventType(enum.StrEnum):
    """What happened to a watched object."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True, slots=True)
class Listed:
    """The GpuLayout as a list call found it, and where to watch from."""

    document: Mapping[str, Any] | None
    """The raw object, ``None`` when there is none."""
    resource_version: str
    """The list's resource version: a watch from it misses nothing."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of the watched GpuLayout."""

    type: EventType
    document: Mapping[str, Any]
    """The raw object after the change (before it, for ``DELETED``)."""


class NodeApi(Protocol):
    """What the node agent asks of the Kubernetes API (errors: :class:`KubeApiError`)."""

    def list_layout(self, name: str) -> Listed:
        """The GpuLayout named ``name`` (or none) and the list's resource version."""
        ...

    def watch_layout(self, name: str, *, resource_version: str) -> Iterator[WatchEvent]:
        """Changes to the GpuLayout ``name`` after ``resource_version``, as they happen.

        Raises :class:`GoneError` when that version is too old to watch from.
        """
        ...

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        """Server-side apply of the status subresource as :data:`gpulayouts.AGENT_FIELD_MANAGER`."""
        ...

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Set labels on the Node (``None`` removes the key); other labels are left alone."""
        ...

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        """Set extended resources in the Node's status capacity and allocatable (``None``
        removes one); other resources are left alone."""
        ...


class InMemoryNodeApi:
    """A :class:`NodeApi` in memory, with the apiserver's generation and watch semantics.

    Tests write the controller's half with :meth:`put_spec` and :meth:`delete_layout`, and read
    what the agent wrote with :meth:`layout`, :attr:`node_labels` and :attr:`node_resources`.
    Thread-safe; a watch blocks until the next change or until :meth:`close`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0
        self._compacted = 0
        self._layouts: dict[str, dict[str, Any]] = {}
        self._events: list[tuple[int, str, WatchEvent]] = []
        self._closed = False
        self.node_labels: dict[str, dict[str, str]] = {}
        """Node name -> its labels as the agent set them."""
        self.node_resources: dict[str, dict[str, str]] = {}
        """Node name -> extended resources in its capacity (= allocatable)."""
        self.status_writes = 0
        """How many status applies were made (to check the agent does not write needlessly)."""

    # -- the controller's side (tests) ---------------------------------------------------------
    def put_spec(self, name: str, spec: Mapping[str, Any]) -> None:
        """Create or replace the GpuLayout's spec (raw JSON); generation +1 when it changed."""
        with self._cond:
            old = self._layouts.get(name)
            if old is None:
                doc: dict[str, Any] = {
                    "apiVersion": gpulayouts.API_VERSION,
                    "kind": gpulayouts.KIND,
                    "metadata": {"name": name, "generation": 1, "uid": f"uid-{self._version}"},
                    "spec": copy.deepcopy(dict(spec)),
                }
                self._store(name, doc, EventType.ADDED)
                return
            if old.get("spec") == spec:
                return
            doc = copy.deepcopy(old)
            doc["spec"] = copy.deepcopy(dict(spec))
            doc["metadata"]["generation"] += 1
            self._store(name, doc, EventType.MODIFIED)

    def delete_layout(self, name: str) -> None:
        """Delete the GpuLayout (nothing if there is none)."""
        with self._cond:
            old = self._layouts.pop(name, None)
            if old is None:
                return
            self._version += 1
            self._events.append((self._version, name, WatchEvent(EventType.DELETED, old)))
            self._cond.notify_all()

    def layout(self, name: str) -> gpulayouts.GpuLayout | None:
        """The GpuLayout now, parsed."""
        with self._cond:
            doc = self._layouts.get(name)
            return None if doc is None else gpulayouts.parse(copy.deepcopy(doc))

    def compact(self) -> None:
        """Forget the change history: watches from any older version get :class:`GoneError`."""
        with self._cond:
            self._compacted = self._version
            self._events.clear()

    def close(self) -> None:
        """End every watch (they return)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _store(self, name: str, doc: dict[str, Any], kind: EventType) -> None:
        self._version += 1
        doc["metadata"]["resourceVersion"] = str(self._version)
        self._layouts[name] = doc
        self._events.append((self._version, name, WatchEvent(kind, copy.deepcopy(doc))))
        self._cond.notify_all()

    # -- NodeApi -------------------------------------------------------------------------------
    def list_layout(self, name: str) -> Listed:
        """The object and the current version."""
        with self._cond:
            doc = self._layouts.get(name)
            return Listed(copy.deepcopy(doc) if doc else None, str(self._version))

    def watch_layout(self, name: str, *, resource_version: str) -> Iterator[WatchEvent]:
        """Events after ``resource_version`` until :meth:`close`."""
        seen = int(resource_version)
        while True:
            with self._cond:
                if seen < self._compacted:
                    raise GoneError(f"too old resource version: {seen} ({self._compacted})")
                pending = [e for e in self._events if e[0] > seen and e[1] == name]
                if not pending:
                    if self._closed:
                        return
                    self._cond.wait()
                    continue
            for version, _, event in pending:
                seen = version
                yield event

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        """Replace the status; a missing object is a :class:`KubeApiError` (404), as on a
        server."""
        with self._cond:
            old = self._layouts.get(name)
            if old is None:
                raise KubeApiError(f'gpulayouts.migpilot.io "{name}" not found')
            doc = copy.deepcopy(old)
            doc["status"] = dict(gpulayouts.status_patch(name, status))["status"]
            self.status_writes += 1
            if doc != old:
                self._store(name, doc, EventType.MODIFIED)

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Merge into the node's labels."""
        with self._cond:
            _merge(self.node_labels.setdefault(node, {}), labels)

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        """Merge into the node's extended resources."""
        with self._cond:
            _merge(self.node_resources.setdefault(node, {}), resources)


def _merge(into: dict[str, str], patch: Mapping[str, str | None]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        else:
            into[key] = value
