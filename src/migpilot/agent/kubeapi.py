"""The part of the Kubernetes API the node agent needs, as a small Protocol, and an in-memory one.

The agent reads one object, its node's GpuLayout (``gpulayouts.migpilot.io``, named after the
node), follows it with a watch, and writes three things: the GpuLayout's status (server-side
apply as ``migpilot-agent``), the GFD labels on its Node, and, when it stands in for the kubelet,
the Node's extended-resource capacity and allocatable. :class:`NodeApi` is exactly that, with raw
JSON documents in and out (the caller parses them with :mod:`migpilot.api.gpulayouts`), so a
malformed object reaches the agent's own checks rather than failing inside a client. The
simulated kubelet also lists and watches the pods bound to its node(s) (and any agent reads a
pod the GpuLayout reserves instances for, to tell a unified request), and the fleet of
simulated agents (:mod:`migpilot.agent.fleet`) lists and watches every GpuLayout and the Nodes a
label selects, once for all its nodes.

:class:`InMemoryNodeApi` is the same contract without a server, shipped here so that unit tests
and demos drive the real agent code: objects carry ``metadata.generation`` (bumped by spec
changes only, as the status subresource makes the apiserver do), a resource version, and a
watch that answers :class:`GoneError` for a version older than the last :meth:`compact`.
:mod:`migpilot.agent.kube` is the lightkube implementation; it is the only agent module that
imports a Kubernetes client (an import-linter contract says so).

No I/O, no clock; never imports lightkube or httpx2.
"""

from __future__ import annotations

import bisect
import copy
import enum
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from migpilot import errors
from migpilot.api import gpulayouts, gpulayouts_wire


class KubeApiError(errors.MigpilotError):
    """The API server refused a call or could not be reached."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        """Worth trying again as it is: 429 (``storage is (re)initializing`` right after a
        CRD is created), a 5xx, or no answer at all (refused connection, timeout)."""


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


@dataclass(frozen=True, slots=True)
class ListedAll:
    """Every object a list call found, and where to watch from."""

    documents: tuple[Mapping[str, Any], ...]
    """The raw objects."""
    resource_version: str
    """The list's resource version: a watch from it misses nothing."""


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """Nodes whose label ``key`` exists (``value`` ``None``) or equals ``value``."""

    key: str
    """The label's key, e.g. ``migpilot.io/emulated-gpus``."""
    value: str | None = None
    """The value it must have; ``None``: any value."""

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a node with ``labels`` is selected."""
        if self.key not in labels:
            return False
        return self.value is None or labels[self.key] == self.value

    def __str__(self) -> str:
        return self.key if self.value is None else f"{self.key}={self.value}"


def labels_of(doc: Mapping[str, Any]) -> dict[str, str]:
    """An object's ``metadata.labels`` (raw JSON), empty when it has none."""
    meta = doc.get("metadata") or {}
    return {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}


def _named(name: str, namespace: str | None = None) -> Callable[[Mapping[str, Any]], bool]:
    def match(doc: Mapping[str, Any]) -> bool:
        meta = doc.get("metadata") or {}
        return bool(meta.get("name") == name and meta.get("namespace") == namespace)

    return match


def node_name_of(pod: Mapping[str, Any]) -> str:
    """The node a pod (raw JSON) is bound to, ``""`` when it is not bound."""
    return str((pod.get("spec") or {}).get("nodeName") or "")


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

    def list_pods(self, *, node: str | None) -> ListedAll:
        """The pods bound to ``node`` (``None``: to any node), in every namespace."""
        ...

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod ``namespace/name`` (raw JSON), ``None`` when there is none (404); the
        agent reads a pod the GpuLayout reserves instances for before it is bound."""
        ...

    def watch_pods(self, *, node: str | None, resource_version: str) -> Iterator[WatchEvent]:
        """Changes to the pods :meth:`list_pods` selects (a pod bound after the list arrives
        as ``ADDED``); :class:`GoneError` when the version is too old."""
        ...

    def list_layouts(self) -> ListedAll:
        """Every GpuLayout."""
        ...

    def watch_layouts(self, *, resource_version: str) -> Iterator[WatchEvent]:
        """Changes to every GpuLayout; :class:`GoneError` when the version is too old."""
        ...

    def list_nodes(self, *, selector: LabelSelector) -> ListedAll:
        """The Nodes ``selector`` selects."""
        ...

    def watch_nodes(
        self, *, selector: LabelSelector, resource_version: str
    ) -> Iterator[WatchEvent]:
        """Changes to the Nodes ``selector`` selects (a Node that stops matching arrives as
        ``DELETED``); :class:`GoneError` when the version is too old."""
        ...

    def list_node(self, name: str) -> ListedAll:
        """The Node ``name`` (none or one)."""
        ...

    def watch_node(self, name: str, *, resource_version: str) -> Iterator[WatchEvent]:
        """Changes to the Node ``name``; :class:`GoneError` when the version is too old."""
        ...

    def list_configmap(self, namespace: str, name: str) -> ListedAll:
        """The ConfigMap ``namespace/name`` (none or one)."""
        ...

    def watch_configmap(
        self, namespace: str, name: str, *, resource_version: str
    ) -> Iterator[WatchEvent]:
        """Changes to that ConfigMap; :class:`GoneError` when the version is too old."""
        ...


class _Kind(enum.Enum):
    """Which store a change is in."""

    LAYOUT = "layout"
    NODE = "node"
    POD = "pod"
    CONFIGMAP = "configmap"


@dataclass(frozen=True, slots=True)
class _Change:
    version: int
    kind: _Kind
    before: Mapping[str, Any] | None
    after: Mapping[str, Any] | None


class InMemoryNodeApi:
    """A :class:`NodeApi` in memory, with the apiserver's generation and watch semantics.

    Tests write the controller's half with :meth:`put_spec` and :meth:`delete_layout`, Nodes
    with :meth:`put_node` and pods with :meth:`put_pod` and :meth:`delete_pod`, and read what
    the agent wrote with :meth:`layout`, :attr:`node_labels` and :attr:`node_resources` (also
    merged into a Node made with :meth:`put_node`, as a server would). Watches filter as the
    server's selectors do: an object that starts or stops matching arrives as ``ADDED`` or
    ``DELETED``. Thread-safe; a watch blocks until the next change or until :meth:`close`.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._version = 0
        self._compacted = 0
        self._layouts: dict[str, dict[str, Any]] = {}
        self._nodes: dict[str, dict[str, Any]] = {}
        self._pods: dict[str, dict[str, Any]] = {}
        self._configmaps: dict[str, dict[str, Any]] = {}
        self._events: list[_Change] = []
        self._closed = False
        self.node_labels: dict[str, dict[str, str]] = {}
        """Node name -> its labels as the agent set them."""
        self.node_resources: dict[str, dict[str, str]] = {}
        """Node name -> extended resources in its capacity (= allocatable)."""
        self.status_writes = 0
        """How many status applies were made (to check the agent does not write needlessly)."""
        self.pod_lists = 0
        """How many times pods were listed."""
        self.pod_gets = 0
        """How many times one pod was read."""

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
            self._events.append(_Change(self._version, _Kind.LAYOUT, old, None))
            self._cond.notify_all()

    def layout(self, name: str) -> gpulayouts.GpuLayout | None:
        """The GpuLayout now, parsed."""
        with self._cond:
            doc = self._layouts.get(name)
            return None if doc is None else gpulayouts_wire.parse(copy.deepcopy(doc))

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
        self._put(_Kind.LAYOUT, self._layouts, name, doc)

    def _put(
        self, kind: _Kind, store: dict[str, dict[str, Any]], key: str, doc: dict[str, Any] | None
    ) -> None:
        """Store ``doc`` under ``key`` (``None`` deletes it) and record the change.

        A stored document is never changed in place (every writer changes a copy), so the
        change record shares it; what a list or a watch hands out is a deep copy.
        """
        before = store.get(key)
        if doc is None and before is None:
            return
        self._version += 1
        if doc is None:
            del store[key]
        else:
            doc.setdefault("metadata", {})["resourceVersion"] = str(self._version)
            store[key] = doc
        after = doc
        self._events.append(_Change(self._version, kind, before, after))
        self._cond.notify_all()

    def put_node(self, name: str, labels: Mapping[str, str]) -> None:
        """Create a Node with ``labels``, or replace its labels."""
        with self._cond:
            old = self._nodes.get(name)
            fresh: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
                                     "metadata": {"name": name}, "status": {}}  # fmt: skip
            doc = copy.deepcopy(old) if old is not None else fresh
            doc["metadata"]["labels"] = dict(labels)
            self._put(_Kind.NODE, self._nodes, name, doc)

    def delete_node(self, name: str) -> None:
        """Delete the Node (nothing if there is none)."""
        with self._cond:
            self._put(_Kind.NODE, self._nodes, name, None)

    def put_pod(self, doc: Mapping[str, Any]) -> None:
        """Create or replace a pod (raw JSON, ``metadata.namespace`` and ``name`` set)."""
        meta = doc["metadata"]
        with self._cond:
            self._put(
                _Kind.POD,
                self._pods,
                f"{meta['namespace']}/{meta['name']}",
                copy.deepcopy(dict(doc)),
            )

    def put_configmap(self, namespace: str, name: str, data: Mapping[str, str]) -> None:
        """Create or replace a ConfigMap."""
        doc = {"apiVersion": "v1", "kind": "ConfigMap",
               "metadata": {"namespace": namespace, "name": name}, "data": dict(data)}  # fmt: skip
        with self._cond:
            self._put(_Kind.CONFIGMAP, self._configmaps, f"{namespace}/{name}", doc)

    def set_node_label(self, name: str, key: str, value: str | None) -> None:
        """Set (``None``: remove) one label of an existing Node, as an admin would."""
        with self._cond:
            doc = copy.deepcopy(self._nodes[name])
            labels = doc["metadata"].setdefault("labels", {})
            if value is None:
                labels.pop(key, None)
            else:
                labels[key] = value
            self._put(_Kind.NODE, self._nodes, name, doc)

    def delete_pod(self, namespace: str, name: str) -> None:
        """Delete a pod (nothing if there is none)."""
        with self._cond:
            self._put(_Kind.POD, self._pods, f"{namespace}/{name}", None)

    # -- NodeApi -------------------------------------------------------------------------------
    def list_layout(self, name: str) -> Listed:
        """The object and the current version."""
        with self._cond:
            doc = self._layouts.get(name)
            return Listed(copy.deepcopy(doc) if doc else None, str(self._version))

    def watch_layout(self, name: str, *, resource_version: str) -> Iterator[WatchEvent]:
        """Events after ``resource_version`` until :meth:`close`."""
        return self._watch(_Kind.LAYOUT, lambda d: d["metadata"]["name"] == name, resource_version)

    def _watch(
        self, kind: _Kind, match: Callable[[Mapping[str, Any]], bool], resource_version: str
    ) -> Iterator[WatchEvent]:
        """Changes of ``kind`` after ``resource_version`` as a selector ``match`` sees them."""
        seen = int(resource_version)
        while True:
            with self._cond:
                if seen < self._compacted:
                    raise GoneError(f"too old resource version: {seen} ({self._compacted})")
                # Versions grow along the list: start past ``seen`` (a fleet's three watches
                # wake at every change of any kind; a scan from the start made that quadratic).
                start = bisect.bisect_right(self._events, seen, key=_version_of)
                pending = [c for c in self._events[start:] if c.kind is kind]
                if not pending:
                    if self._closed:
                        return
                    seen = self._version  # nothing of this kind up to here
                    self._cond.wait()
                    continue
            for change in pending:
                seen = change.version
                was = change.before is not None and match(change.before)
                now = change.after is not None and match(change.after)
                if now and change.after is not None:
                    kind_of = EventType.MODIFIED if was else EventType.ADDED
                    yield WatchEvent(kind_of, copy.deepcopy(change.after))
                elif was and change.before is not None:
                    yield WatchEvent(EventType.DELETED, copy.deepcopy(change.before))

    def _list(
        self, store: dict[str, dict[str, Any]], match: Callable[[Mapping[str, Any]], bool]
    ) -> ListedAll:
        with self._cond:
            docs = tuple(copy.deepcopy(d) for _, d in sorted(store.items()) if match(d))
            return ListedAll(docs, str(self._version))

    def list_node(self, name: str) -> ListedAll:
        """The Node ``name`` (none or one)."""
        return self._list(self._nodes, _named(name))

    def watch_node(self, name: str, *, resource_version: str) -> Iterator[WatchEvent]:
        """Changes to the Node ``name``."""
        return self._watch(_Kind.NODE, _named(name), resource_version)

    def list_configmap(self, namespace: str, name: str) -> ListedAll:
        """The ConfigMap (none or one)."""
        return self._list(self._configmaps, _named(name, namespace))

    def watch_configmap(
        self, namespace: str, name: str, *, resource_version: str
    ) -> Iterator[WatchEvent]:
        """Changes to the ConfigMap."""
        return self._watch(_Kind.CONFIGMAP, _named(name, namespace), resource_version)

    def list_pods(self, *, node: str | None) -> ListedAll:
        """The pods bound to ``node`` (any node for ``None``)."""
        with self._cond:
            self.pod_lists += 1
        return self._list(self._pods, _on_node(node))

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The pod, or ``None``."""
        with self._cond:
            self.pod_gets += 1
            doc = self._pods.get(f"{namespace}/{name}")
            return copy.deepcopy(doc) if doc is not None else None

    def watch_pods(self, *, node: str | None, resource_version: str) -> Iterator[WatchEvent]:
        """Pod changes after ``resource_version`` as the field selector sees them."""
        return self._watch(_Kind.POD, _on_node(node), resource_version)

    def list_layouts(self) -> ListedAll:
        """Every GpuLayout."""
        return self._list(self._layouts, lambda d: True)

    def watch_layouts(self, *, resource_version: str) -> Iterator[WatchEvent]:
        """Every GpuLayout change after ``resource_version``."""
        return self._watch(_Kind.LAYOUT, lambda d: True, resource_version)

    def list_nodes(self, *, selector: LabelSelector) -> ListedAll:
        """The Nodes ``selector`` selects."""
        return self._list(self._nodes, lambda d: selector.matches(labels_of(d)))

    def watch_nodes(
        self, *, selector: LabelSelector, resource_version: str
    ) -> Iterator[WatchEvent]:
        """Node changes after ``resource_version`` as the label selector sees them."""
        return self._watch(_Kind.NODE, lambda d: selector.matches(labels_of(d)), resource_version)

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        """Replace the status; a missing object is a :class:`KubeApiError` (404), as on a
        server."""
        with self._cond:
            old = self._layouts.get(name)
            if old is None:
                raise KubeApiError(f'gpulayouts.migpilot.io "{name}" not found')
            # A fresh top level and metadata (``_put`` sets its resourceVersion); the spec is
            # shared, never changed in place.
            doc = {**old, "metadata": dict(old["metadata"])}
            doc["status"] = dict(gpulayouts_wire.status_patch(name, status))["status"]
            self.status_writes += 1
            if doc != old:
                self._store(name, doc, EventType.MODIFIED)

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """Merge into the node's labels (and into its Node, when there is one)."""
        with self._cond:
            _merge(self.node_labels.setdefault(node, {}), labels)
            old = self._nodes.get(node)
            if old is not None:
                doc = copy.deepcopy(old)
                _merge(doc["metadata"].setdefault("labels", {}), labels)
                if doc != old:
                    self._put(_Kind.NODE, self._nodes, node, doc)

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        """Merge into the node's extended resources (and into its Node, when there is one)."""
        with self._cond:
            _merge(self.node_resources.setdefault(node, {}), resources)
            old = self._nodes.get(node)
            if old is not None:
                doc = copy.deepcopy(old)
                for part in ("capacity", "allocatable"):
                    _merge(doc.setdefault("status", {}).setdefault(part, {}), resources)
                if doc != old:
                    self._put(_Kind.NODE, self._nodes, node, doc)


def _version_of(change: _Change) -> int:
    return change.version


def _on_node(node: str | None) -> Callable[[Mapping[str, Any]], bool]:
    """The field selector ``spec.nodeName=node`` (``!=""`` for ``None``)."""
    if node is None:
        return lambda d: node_name_of(d) != ""
    return lambda d: node_name_of(d) == node


def _merge(into: dict[str, str], patch: Mapping[str, str | None]) -> None:
    for key, value in patch.items():
        if value is None:
            into.pop(key, None)
        else:
            into[key] = value
