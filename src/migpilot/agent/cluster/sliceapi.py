"""The part of the Kubernetes API a DRA node agent needs to publish its devices: its
ResourceSlices, as a small Protocol, and its in-memory adapter.

Why it exists: in DRA mode (``docs/dra.md``, "Publishing") the agent lists the ResourceSlices
of its driver on its node and creates, replaces and deletes them, and reads the controller's
Lease (its plan is listed first only while the Lease is fresh); nothing else of
``resource.k8s.io``. Kept apart from :class:`~migpilot.agent.cluster.kubeapi.NodeApi`, which
every agent and the fleet implement, so that only what publishes slices needs these calls: an
API that can (:class:`SliceSource`) hands them out with :meth:`SliceSource.slices`.

:class:`InMemorySliceApi` is the contract over the shared in-memory API server
(:class:`~migpilot.kube.memory.InMemoryServer`, with its resource versions and 409s);
:class:`migpilot.agent.cluster.kube.LightkubeSliceApi` over the lightkube client. Objects are raw
JSON both ways.

No I/O, no clock; never imports lightkube or httpx2.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

from migpilot.kube import memory, objects

_S = objects.Kind.RESOURCESLICES


def selectors(*, driver: str, node: str) -> tuple[objects.FieldSelector, ...]:
    """The field selectors of a driver's slices on a node (served by the API server for
    ResourceSlices: ``spec.nodeName`` and ``spec.driver``)."""
    return (
        objects.FieldSelector("spec.nodeName", node),
        objects.FieldSelector("spec.driver", driver),
    )


class SliceApi(Protocol):
    """What a DRA agent asks of the API about ResourceSlices (errors:
    :class:`~migpilot.kube.errors.KubeApiError`)."""

    def list_slices(self, *, driver: str, node: str) -> objects.Listed:
        """The ResourceSlices of ``driver`` on ``node``."""
        ...

    def create_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create a slice (:class:`~migpilot.kube.errors.ConflictError` when it exists)."""
        ...

    def replace_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Replace a slice, guarded by the body's ``resourceVersion``
        (:class:`~migpilot.kube.errors.ConflictError` when someone wrote it first)."""
        ...

    def delete_slice(self, name: str) -> bool:
        """Delete a slice: whether it was there."""
        ...

    def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The coordination.k8s.io/v1 Lease ``namespace/name`` (the controller's: its plan is
        listed first only while it is fresh); ``None`` when there is none."""
        ...


@runtime_checkable
class SliceSource(Protocol):
    """A Kubernetes API that also serves ResourceSlices."""

    def slices(self) -> SliceApi:
        """The ResourceSlice calls, over the same connection."""
        ...


class InMemorySliceApi:
    """A :class:`SliceApi` over the shared in-memory API server. Tests read
    :attr:`server`'s ``objects`` and ``requests`` (``("create", Kind.RESOURCESLICES)``...)."""

    def __init__(self, server: memory.InMemoryServer | None = None) -> None:
        self.server = server if server is not None else memory.InMemoryServer()

    def list_slices(self, *, driver: str, node: str) -> objects.Listed:
        """The slices the field selectors select, sorted by name."""
        listed = self.server.list(_S, fields=selectors(driver=driver, node=node))
        items = tuple(sorted(listed.items, key=objects.name_of))
        return objects.Listed(items, listed.resource_version)

    def create_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Create it (409 when it exists)."""
        return self.server.create(_S, body)

    def replace_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Replace it (409 on a stale ``resourceVersion``)."""
        return self.server.replace(_S, body)

    def delete_slice(self, name: str) -> bool:
        """Delete it."""
        return self.server.remove(_S, name)

    def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The Lease, as stored."""
        return self.server.get(objects.Kind.LEASES, name, namespace=namespace)


_: type[SliceApi] = InMemorySliceApi  # it is one (mypy checks)
