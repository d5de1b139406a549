"""The controller's view of the Kubernetes API: a small async Protocol and an in-memory one.

Why it exists: the loop (:mod:`migpilot.controller.running`) talks to the API server only
through :class:`ControllerApi`, so the same loop runs against the real server (``kube``, the
one module that imports lightkube) and against :class:`InMemoryApi` in the unit tests. Raw JSON
crosses it (dicts as the API returns them); the pure modules read them.

May not import lightkube or any HTTP client (an import-linter contract checks it).
"""

from __future__ import annotations

import asyncio
import copy
import enum
import itertools
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from migpilot import errors
from migpilot.api import gpulayouts, gpulayouts_wire


class KubeApiError(errors.MigpilotError):
    """The API server refused a call or could not be reached (the message says which)."""

    def __init__(self, message: str, *, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient
        """Worth trying again as it is: 429 (``storage is (re)initializing`` right after a
        CRD is created), a 5xx, or no answer at all (refused connection, timeout)."""


class GoneError(KubeApiError):
    """410 Gone: the watch's version is too old; list again."""


class ConflictError(KubeApiError):
    """409 Conflict: the object changed since it was read (or exists already)."""


class Kind(enum.StrEnum):
    """The kinds the controller lists and watches."""

    PODS = "pods"
    NODES = "nodes"
    LAYOUTS = "gpulayouts"


class EventType(enum.StrEnum):
    """Watch event types."""

    ADDED = "ADDED"
    MODIFIED = "MODIFIED"
    DELETED = "DELETED"


@dataclass(frozen=True, slots=True)
class Listed:
    """A list call's answer."""

    items: Sequence[Mapping[str, Any]]
    resource_version: str


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One watch event with the object as raw JSON."""

    type: EventType
    object: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class EventNote:
    """A Kubernetes Event the controller records on a Pod or a Node."""

    kind: str
    """``Pod`` or ``Node``."""
    namespace: str | None
    name: str
    uid: str
    type: str
    """``Normal`` or ``Warning``."""
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Fence:
    """The precondition a leader's GpuLayout spec write carries, so that the write of a
    leader deposed meanwhile (paused, partitioned) fails instead of undoing its successor's.
    """

    resource_version: str | None
    """The GpuLayout's ``resourceVersion`` the write was planned on: the API server refuses it
    with 409 if the object changed since. ``None``: the object must not exist yet."""
    leader: str
    """The writer's Lease identity (recorded on the object)."""
    term: int
    """The Lease's ``leaseTransitions`` when the writer took it (recorded on the object)."""


class ControllerApi(Protocol):
    """What the controller needs from the API server."""

    async def list_all(self, kind: Kind) -> Listed:
        """Every object of ``kind`` (all namespaces) and the list's resource version."""
        ...

    def watch(self, kind: Kind, *, resource_version: str) -> AsyncIterator[WatchEvent]:
        """Changes after ``resource_version``; raises :class:`GoneError` when too old."""
        ...

    async def apply_layout_spec(
        self, name: str, spec: gpulayouts.LayoutSpec, *, owner_uid: str | None, fence: Fence
    ) -> Mapping[str, Any]:
        """Server-side apply of the GpuLayout's spec as ``migpilot-controller`` (forced), on
        the condition ``fence`` states (:class:`ConflictError` when it does not hold), creating
        it (owned by the Node ``name`` when ``owner_uid`` is given) if absent; the object as the
        server now has it."""
        ...

    async def patch_pod(self, key: str, patch: list[dict[str, Any]]) -> Mapping[str, Any]:
        """A JSON patch on the pod ``namespace/name``; the pod as the server now has it."""
        ...

    async def record(self, note: EventNote) -> None:
        """Create a Kubernetes Event."""
        ...

    async def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The Lease, or ``None`` when there is none."""
        ...

    async def lease_namespace_exists(self, namespace: str, name: str) -> bool:
        """Whether the Lease ``namespace/name`` could be created (a dry run): ``False`` when
        its namespace does not exist, a setup error no retry mends."""
        ...

    async def write_lease(self, lease: Mapping[str, Any], *, create: bool) -> Mapping[str, Any]:
        """Create the Lease, or replace it (the body's ``resourceVersion`` guards the write:
        :class:`ConflictError` when someone else wrote it first); the Lease as written."""
        ...

    async def close(self) -> None:
        """Release the connections."""
        ...


# --------------------------------------------------------------------------- in memory


def apply_json_patch(doc: dict[str, Any], patch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add``, ``remove``, ``replace`` and ``test`` on a copy of ``doc`` (what the
    controller sends); raise :class:`KubeApiError` as the server would refuse."""
    out = copy.deepcopy(doc)
    for op in patch:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(op["path"]).split("/")[1:]]
        parent: Any = out
        for p in parts[:-1]:
            try:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            except (KeyError, IndexError, ValueError):
                raise KubeApiError(f"422: path {op['path']} does not exist") from None
        last = parts[-1]
        kind = op["op"]
        try:
            if kind == "test":
                got = parent[int(last)] if isinstance(parent, list) else parent[last]
                if got != op["value"]:
                    raise KubeApiError(f"422: test of {op['path']} failed")
            elif kind == "remove":
                if isinstance(parent, list):
                    del parent[int(last)]
                else:
                    del parent[last]
            elif kind == "replace":  # the target must exist, and is replaced in place
                if isinstance(parent, list):
                    parent[int(last)] = copy.deepcopy(op["value"])
                else:
                    if last not in parent:
                        raise KeyError(last)
                    parent[last] = copy.deepcopy(op["value"])
            elif kind == "add":
                if isinstance(parent, list):
                    if last == "-":
                        parent.append(copy.deepcopy(op["value"]))
                    else:
                        parent.insert(int(last), copy.deepcopy(op["value"]))
                else:
                    parent[last] = copy.deepcopy(op["value"])
            else:
                raise KubeApiError(f"422: unsupported patch op {kind}")
        except (KeyError, IndexError, ValueError):
            raise KubeApiError(f"422: path {op['path']} does not exist") from None
    return out


class InMemoryApi:
    """An API server in memory: objects by kind and key, watch streams, Events and Leases.

    For unit tests: tests put Pods, Nodes and GpuLayouts in with :meth:`put` and read what the
    controller wrote. Every write bumps one resource version; a watch opened with a version gets
    every later change.
    """

    def __init__(self) -> None:
        self.objects: dict[Kind, dict[str, dict[str, Any]]] = {k: {} for k in Kind}
        self.events: list[EventNote] = []
        self.leases: dict[str, dict[str, Any]] = {}
        self.pod_patches: list[tuple[str, list[dict[str, Any]]]] = []
        self.spec_writes: list[tuple[str, gpulayouts.LayoutSpec]] = []
        """Spec writes that landed, in order."""
        self.refused_writes: list[tuple[str, Fence]] = []
        """Spec writes refused because their :class:`Fence` did not hold."""
        self._version = itertools.count(1)
        self._log: list[tuple[int, Kind, WatchEvent]] = []
        self._changed = asyncio.Condition()
        self.fail_next: KubeApiError | None = None
        """Raised once by the next write (tests of failure handling)."""
        self.namespaces: set[str] | None = None
        """The namespaces that exist; ``None``: every one does."""
        self.list_failures: list[Exception] = []
        """Raised, one per call, by the next list calls (tests of failing watches)."""

    @staticmethod
    def key_of(doc: Mapping[str, Any]) -> str:
        meta = doc.get("metadata") or {}
        ns = meta.get("namespace")
        return f"{ns}/{meta['name']}" if ns else str(meta["name"])

    async def put(self, kind: Kind, doc: Mapping[str, Any]) -> None:
        """Create or replace an object (as another client would)."""
        body = copy.deepcopy(dict(doc))
        key = self.key_of(body)
        existed = key in self.objects[kind]
        await self._store(kind, key, body, EventType.MODIFIED if existed else EventType.ADDED)

    async def delete(self, kind: Kind, key: str) -> None:
        """Delete an object."""
        body = self.objects[kind].pop(key)
        await self._emit(kind, EventType.DELETED, body)

    async def _store(self, kind: Kind, key: str, body: dict[str, Any], type_: EventType) -> None:
        body.setdefault("metadata", {})
        self.objects[kind][key] = body
        await self._emit(kind, type_, body)

    async def _emit(self, kind: Kind, type_: EventType, body: dict[str, Any]) -> None:
        version = next(self._version)
        body["metadata"]["resourceVersion"] = str(version)
        self._log.append((version, kind, WatchEvent(type_, copy.deepcopy(body))))
        async with self._changed:
            self._changed.notify_all()

    def _maybe_fail(self) -> None:
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err

    async def list_all(self, kind: Kind) -> Listed:
        if self.list_failures:
            raise self.list_failures.pop(0)
        version = str(self._log[-1][0]) if self._log else "0"
        return Listed([copy.deepcopy(d) for d in self.objects[kind].values()], version)

    async def watch(self, kind: Kind, *, resource_version: str) -> AsyncIterator[WatchEvent]:
        seen = int(resource_version or 0)
        while True:
            for version, k, event in list(self._log):
                if version > seen:
                    seen = version
                    if k is kind:
                        yield event
            async with self._changed:
                if not self._log or self._log[-1][0] <= seen:
                    await self._changed.wait()

    async def apply_layout_spec(
        self, name: str, spec: gpulayouts.LayoutSpec, *, owner_uid: str | None, fence: Fence
    ) -> Mapping[str, Any]:
        self._maybe_fail()
        current = self.objects[Kind.LAYOUTS].get(name)
        version = current["metadata"].get("resourceVersion") if current is not None else None
        if version != fence.resource_version:
            self.refused_writes.append((name, fence))
            raise ConflictError(
                f"409 Conflict: GpuLayout {name} is at version {version}, "
                f"not {fence.resource_version}"
            )
        self.spec_writes.append((name, spec))
        body: dict[str, Any] = (
            copy.deepcopy(current)
            if current is not None
            else dict(gpulayouts_wire.spec_patch(name, gpulayouts.LayoutSpec(())))
        )
        new_spec = gpulayouts_wire.spec_patch(name, spec)["spec"]
        meta: dict[str, Any] = body.setdefault("metadata", {})
        if body.get("spec") != new_spec or current is None:
            meta["generation"] = int(meta.get("generation", 0)) + 1
        body["spec"] = new_spec
        annotations = meta.setdefault("annotations", {})
        annotations[gpulayouts.LEADER_ANNOTATION] = fence.leader
        annotations[gpulayouts.TERM_ANNOTATION] = str(fence.term)
        if owner_uid is not None and current is None:
            meta["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Node", "name": name, "uid": owner_uid}
            ]
        type_ = EventType.ADDED if current is None else EventType.MODIFIED
        await self._store(Kind.LAYOUTS, name, body, type_)
        return copy.deepcopy(body)

    async def patch_pod(self, key: str, patch: list[dict[str, Any]]) -> Mapping[str, Any]:
        self._maybe_fail()
        current = self.objects[Kind.PODS].get(key)
        if current is None:
            raise KubeApiError(f"404: pod {key} not found")
        self.pod_patches.append((key, patch))
        body = apply_json_patch(current, patch)
        await self._store(Kind.PODS, key, body, EventType.MODIFIED)
        return copy.deepcopy(body)

    async def record(self, note: EventNote) -> None:
        self.events.append(note)

    async def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        lease = self.leases.get(f"{namespace}/{name}")
        return copy.deepcopy(lease) if lease is not None else None

    async def lease_namespace_exists(self, namespace: str, name: str) -> bool:
        self._maybe_fail()
        return self.namespaces is None or namespace in self.namespaces

    async def write_lease(self, lease: Mapping[str, Any], *, create: bool) -> Mapping[str, Any]:
        self._maybe_fail()
        meta = lease["metadata"]
        if self.namespaces is not None and meta["namespace"] not in self.namespaces:
            raise KubeApiError(f"404: namespace {meta['namespace']} not found")
        key = f"{meta['namespace']}/{meta['name']}"
        current = self.leases.get(key)
        if create and current is not None:
            raise ConflictError(f"409: lease {key} already exists")
        if not create:
            if current is None:
                raise KubeApiError(f"404: lease {key} not found")
            if current["metadata"]["resourceVersion"] != meta.get("resourceVersion"):
                raise ConflictError(f"409: lease {key} was modified")
        body = copy.deepcopy(dict(lease))
        body["metadata"]["resourceVersion"] = str(next(self._version))
        self.leases[key] = body
        return copy.deepcopy(body)

    async def close(self) -> None:
        return None
