"""The controller's view of the Kubernetes API: a small async Protocol and its in-memory adapter.

Why it exists: the loop (:mod:`migpilot.controller.running`) talks to the API server only
through :class:`ControllerApi`, so the same loop runs against the real server (``kube``, the
adapter to the shared lightkube client :mod:`migpilot.kube.client`) and against
:class:`InMemoryApi` in the unit tests, an adapter to the shared in-memory API server
(:mod:`migpilot.kube.memory`). Raw JSON crosses it (dicts as the API returns them); the pure
modules read them. The kinds, list and watch types and errors are the shared boundary's
(:mod:`migpilot.kube`).

May not import lightkube or any HTTP client (an import-linter contract checks it).
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from migpilot.api import gpulayouts, gpulayouts_wire
from migpilot.kube import errors, memory
from migpilot.kube import objects as kubeobjects

WATCHED = (
    kubeobjects.Kind.PODS,
    kubeobjects.Kind.NODES,
    kubeobjects.Kind.LAYOUTS,
    kubeobjects.Kind.NAMESPACES,
    kubeobjects.Kind.RESOURCECLAIMS,
    kubeobjects.Kind.RESOURCECLAIMTEMPLATES,
)
"""The kinds the controller lists and watches (its informers), in that order. Namespaces only
for their labels: pod (anti-)affinity terms may select namespaces by them. ResourceClaims and
ResourceClaimTemplates (``resource.k8s.io/v1``) only for their specs: what a pod's DRA claims
ask of migpilot's devices (``docs/dra.md``, "Steering kube-scheduler")."""


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

    async def list_all(self, kind: kubeobjects.Kind) -> kubeobjects.Listed:
        """Every object of ``kind`` (all namespaces) and the list's resource version."""
        ...

    def watch(
        self, kind: kubeobjects.Kind, *, resource_version: str
    ) -> AsyncIterator[kubeobjects.WatchEvent]:
        """Changes after ``resource_version``; raises
        :class:`~migpilot.kube.errors.GoneError` when too old."""
        ...

    async def apply_layout_spec(
        self, name: str, spec: gpulayouts.LayoutSpec, *, owner_uid: str | None, fence: Fence
    ) -> Mapping[str, Any]:
        """Server-side apply of the GpuLayout's spec as ``migpilot-controller`` (forced), on
        the condition ``fence`` states (:class:`~migpilot.kube.errors.ConflictError` when it
        does not hold), creating it (owned by the Node ``name`` when ``owner_uid`` is given) if
        absent; the object as the server now has it."""
        ...

    async def patch_pod(self, key: str, patch: list[dict[str, Any]]) -> Mapping[str, Any]:
        """A JSON patch on the pod ``namespace/name``; the pod as the server now has it."""
        ...

    async def record(self, note: kubeobjects.EventNote) -> None:
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
        :class:`~migpilot.kube.errors.ConflictError` when someone else wrote it first); the
        Lease as written."""
        ...

    async def close(self) -> None:
        """Release the connections."""
        ...


# --------------------------------------------------------------------------- in memory


class InMemoryApi:
    """A :class:`ControllerApi` over the shared in-memory API server: watch streams, Events,
    Leases and what the controller wrote, for unit tests.

    Tests put Pods, Nodes and GpuLayouts in with :meth:`put` and read what the controller wrote
    (:attr:`objects`, :attr:`spec_writes`, :attr:`pod_patches`, :attr:`events`). Every write
    bumps the server's one resource version; a watch opened with a version gets every later
    change.
    """

    def __init__(self, server: memory.InMemoryServer | None = None) -> None:
        self.server = server if server is not None else memory.InMemoryServer()
        """The API server underneath (one may be shared with other adapters)."""
        self.events: list[kubeobjects.EventNote] = []
        self.pod_patches: list[tuple[str, list[dict[str, Any]]]] = []
        self.spec_writes: list[tuple[str, gpulayouts.LayoutSpec]] = []
        """Spec writes that landed, in order."""
        self.refused_writes: list[tuple[str, Fence]] = []
        """Spec writes refused because their :class:`Fence` did not hold."""
        self.fail_next: errors.KubeApiError | None = None
        """Raised once by the next write (tests of failure handling)."""
        self.namespaces: set[str] | None = None
        """The namespaces that exist; ``None``: every one does."""
        self.list_failures: list[Exception] = []
        """Raised, one per call, by the next list calls (tests of failing watches)."""

    key_of = staticmethod(kubeobjects.key_of)

    @property
    def objects(self) -> dict[kubeobjects.Kind, dict[str, dict[str, Any]]]:
        """Kind -> key -> the object as the server has it now."""
        return self.server.objects

    @property
    def leases(self) -> dict[str, dict[str, Any]]:
        """``namespace/name`` -> the Lease as the server has it now."""
        return self.server.objects[kubeobjects.Kind.LEASES]

    async def put(self, kind: kubeobjects.Kind, doc: Mapping[str, Any]) -> None:
        """Create or replace an object (as another client would)."""
        self.server.put(kind, doc)

    async def delete(self, kind: kubeobjects.Kind, key: str) -> None:
        """Delete an object."""
        self.server.delete(kind, key)

    async def replay(self, kind: kubeobjects.Kind, doc: Mapping[str, Any]) -> None:
        """Deliver ``doc`` through the watches with its own (old) resourceVersion, as a watch
        that lags would."""
        self.server.replay(kind, doc)

    def _maybe_fail(self) -> None:
        if self.fail_next is not None:
            err, self.fail_next = self.fail_next, None
            raise err

    async def list_all(self, kind: kubeobjects.Kind) -> kubeobjects.Listed:
        if self.list_failures:
            raise self.list_failures.pop(0)
        return self.server.list(kind)

    def watch(
        self, kind: kubeobjects.Kind, *, resource_version: str
    ) -> AsyncIterator[kubeobjects.WatchEvent]:
        return self.server.watch_async(kind, resource_version=resource_version)

    async def apply_layout_spec(
        self, name: str, spec: gpulayouts.LayoutSpec, *, owner_uid: str | None, fence: Fence
    ) -> Mapping[str, Any]:
        self._maybe_fail()
        with self.server.lock:
            current = self.objects[kubeobjects.Kind.LAYOUTS].get(name)
            version = current["metadata"].get("resourceVersion") if current is not None else None
            if version != fence.resource_version:
                self.refused_writes.append((name, fence))
                raise errors.ConflictError(
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
            self.server.store(kubeobjects.Kind.LAYOUTS, name, body)
            return copy.deepcopy(body)

    async def patch_pod(self, key: str, patch: list[dict[str, Any]]) -> Mapping[str, Any]:
        self._maybe_fail()
        with self.server.lock:
            current = self.objects[kubeobjects.Kind.PODS].get(key)
            if current is None:
                raise errors.NotFoundError(f"404: pod {key} not found")
            self.pod_patches.append((key, patch))
            body = memory.apply_json_patch(current, patch)
            self.server.store(kubeobjects.Kind.PODS, key, body)
            return copy.deepcopy(body)

    async def record(self, note: kubeobjects.EventNote) -> None:
        self.events.append(note)

    async def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return self.server.get(kubeobjects.Kind.LEASES, name, namespace=namespace)

    async def lease_namespace_exists(self, namespace: str, name: str) -> bool:
        self._maybe_fail()
        return self.namespaces is None or namespace in self.namespaces

    async def write_lease(self, lease: Mapping[str, Any], *, create: bool) -> Mapping[str, Any]:
        self._maybe_fail()
        meta = lease["metadata"]
        if self.namespaces is not None and meta["namespace"] not in self.namespaces:
            raise errors.NotFoundError(f"404: namespace {meta['namespace']} not found")
        key = f"{meta['namespace']}/{meta['name']}"
        with self.server.lock:
            current = self.leases.get(key)
            if create and current is not None:
                raise errors.ConflictError(f"409: lease {key} already exists")
            if not create:
                if current is None:
                    raise errors.NotFoundError(f"404: lease {key} not found")
                if current["metadata"]["resourceVersion"] != meta.get("resourceVersion"):
                    raise errors.ConflictError(f"409: lease {key} was modified")
            body = self.server.store(kubeobjects.Kind.LEASES, key, copy.deepcopy(dict(lease)))
            return copy.deepcopy(body) if body is not None else {}

    async def close(self) -> None:
        return None
