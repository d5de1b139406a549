"""The node agent's Kubernetes API client: :class:`~kubeapi.NodeApi` over the shared lightkube
client.

The agent's adapter to :mod:`migpilot.kube.client`: each call of :class:`~kubeapi.NodeApi` is
one call of it, with the request's selectors and body (:mod:`migpilot.kube.requests`) built
here. The client sends it and interprets the answer: raw JSON back, or a
:class:`~migpilot.kube.errors.KubeApiError` with the server's message (410 Gone as
:class:`~migpilot.kube.errors.GoneError`, so the caller lists again). Imports no Kubernetes
client itself (an import-linter contract checks it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from migpilot.agent.cluster import kubeapi, sliceapi
from migpilot.api import gpulayouts, gpulayouts_wire
from migpilot.kube import client, objects, requests
from migpilot.kube import errors as kube_errors

_AGENT = gpulayouts.AGENT_FIELD_MANAGER
TAINT_TRIES = 3
"""Reads and patches of a taint removal before a run of conflicts is given up (the next pass
tries again)."""


def connect(kubeconfig: Path | None) -> LightkubeNodeApi:
    """A client from a kubeconfig file, or the in-cluster service account without one (a bad
    file: :class:`~migpilot.errors.ConfigError` naming it)."""
    return LightkubeNodeApi(client.Client.connect(kubeconfig, field_manager=_AGENT))


class LightkubeNodeApi:
    """:class:`~kubeapi.NodeApi` over :class:`migpilot.kube.client.Client`."""

    def __init__(self, api: client.Client) -> None:
        self._api = api

    def list_layout(self, name: str) -> objects.Listed:
        """One list call with a field selector: the object (none or one) and the list's
        version."""
        return self._api.list(objects.Kind.LAYOUTS, fields=(objects.named(name),))

    def watch_layout(self, name: str, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Watch events for ``name``; lightkube reopens the stream when the server ends it."""
        return self._api.watch(
            objects.Kind.LAYOUTS, resource_version=resource_version, fields=(objects.named(name),)
        )

    def list_pods(self, *, node: str | None) -> objects.Listed:
        """Pods in every namespace with ``spec.nodeName=node`` (``!=""`` for ``None``)."""
        return self._api.list(objects.Kind.PODS, fields=(objects.on_node(node),))

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """One get; ``None`` on 404."""
        return self._api.get(objects.Kind.PODS, name, namespace=namespace)

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """One get of ``resource.k8s.io/v1`` ResourceClaims; ``None`` on 404."""
        return self._api.get(objects.Kind.RESOURCECLAIMS, name, namespace=namespace)

    def watch_pods(
        self, *, node: str | None, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Watch the pods :meth:`list_pods` selects."""
        return self._api.watch(
            objects.Kind.PODS, resource_version=resource_version, fields=(objects.on_node(node),)
        )

    def list_layouts(self) -> objects.Listed:
        """Every GpuLayout."""
        return self._api.list(objects.Kind.LAYOUTS)

    def watch_layouts(self, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Watch every GpuLayout."""
        return self._api.watch(objects.Kind.LAYOUTS, resource_version=resource_version)

    def list_nodes(self, *, selector: objects.LabelSelector) -> objects.Listed:
        """The Nodes ``selector`` selects."""
        return self._api.list(objects.Kind.NODES, labels=selector)

    def watch_nodes(
        self, *, selector: objects.LabelSelector, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Watch the Nodes ``selector`` selects."""
        return self._api.watch(
            objects.Kind.NODES, resource_version=resource_version, labels=selector
        )

    def list_node(self, name: str) -> objects.Listed:
        """The Node ``name`` (a list with a field selector: none or one)."""
        return self._api.list(objects.Kind.NODES, fields=(objects.named(name),))

    def watch_node(self, name: str, *, resource_version: str) -> Iterator[objects.WatchEvent]:
        """Watch the Node ``name``."""
        return self._api.watch(
            objects.Kind.NODES, resource_version=resource_version, fields=(objects.named(name),)
        )

    def list_configmap(self, namespace: str, name: str) -> objects.Listed:
        """The ConfigMap ``namespace/name`` (none or one)."""
        return self._api.list(
            objects.Kind.CONFIGMAPS, namespace=namespace, fields=(objects.named(name),)
        )

    def watch_configmap(
        self, namespace: str, name: str, *, resource_version: str
    ) -> Iterator[objects.WatchEvent]:
        """Watch that ConfigMap."""
        return self._api.watch(
            objects.Kind.CONFIGMAPS,
            resource_version=resource_version,
            namespace=namespace,
            fields=(objects.named(name),),
        )

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        """Server-side apply on ``status`` as ``migpilot-agent`` (forced: the agent owns it)."""
        body: dict[str, Any] = dict(gpulayouts_wire.status_patch(name, status))
        self._api.patch(
            objects.Kind.LAYOUTS,
            name,
            body,
            patch=objects.Patch.APPLY,
            status=True,
            field_manager=_AGENT,
            force=True,
        )

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """A merge patch of ``metadata.labels`` (``None`` deletes a key)."""
        self._api.patch(
            objects.Kind.NODES,
            node,
            requests.node_labels_patch(labels),
            patch=objects.Patch.MERGE,
            field_manager=_AGENT,
        )

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        """A merge patch of ``status.capacity`` and ``status.allocatable``."""
        self._api.patch(
            objects.Kind.NODES,
            node,
            requests.node_resources_patch(resources),
            patch=objects.Patch.MERGE,
            status=True,
            field_manager=_AGENT,
        )

    def remove_node_taint(self, node: str, *, key: str, effect: str) -> bool:
        """Read the Node (a list by name: the agent may list its Node, not get it), and if it
        has the taint, a merge patch of ``spec.taints`` without it, conditional on the version
        read; a 409 Conflict (someone changed the Node meanwhile) reads it again, up to
        :data:`TAINT_TRIES` times."""
        conflict: kube_errors.ConflictError | None = None
        for _ in range(TAINT_TRIES):
            doc = self.list_node(node).one()
            if doc is None:
                raise kube_errors.NotFoundError(f'nodes "{node}" not found')
            taints = (doc.get("spec") or {}).get("taints") or []
            kept = [t for t in taints if not requests.same_taint(t, key=key, effect=effect)]
            if len(kept) == len(taints):
                return False
            version = str((doc.get("metadata") or {}).get("resourceVersion", ""))
            try:
                self._api.patch(
                    objects.Kind.NODES,
                    node,
                    requests.node_taints_patch(kept, resource_version=version),
                    patch=objects.Patch.MERGE,
                    field_manager=_AGENT,
                )
            except kube_errors.ConflictError as err:
                conflict = err
                continue
            return True
        assert conflict is not None
        raise conflict

    def slices(self) -> LightkubeSliceApi:
        """The ResourceSlice calls (DRA mode), over the same connection."""
        return LightkubeSliceApi(self._api)

    def close(self) -> None:
        """Close the connections."""
        self._api.close()


class LightkubeSliceApi:
    """:class:`~sliceapi.SliceApi` over :class:`migpilot.kube.client.Client`: each call one
    request, written as ``migpilot-agent``."""

    def __init__(self, api: client.Client) -> None:
        self._api = api

    def list_slices(self, *, driver: str, node: str) -> objects.Listed:
        """One list with the field selectors ``spec.nodeName`` and ``spec.driver``."""
        return self._api.list(
            objects.Kind.RESOURCESLICES, fields=sliceapi.selectors(driver=driver, node=node)
        )

    def create_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One create."""
        return self._api.create(objects.Kind.RESOURCESLICES, body, field_manager=_AGENT)

    def replace_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """One replace (a PUT guarded by the body's ``resourceVersion``)."""
        return self._api.replace(objects.Kind.RESOURCESLICES, body, field_manager=_AGENT)

    def delete_slice(self, name: str) -> bool:
        """One delete; ``False`` on 404."""
        return self._api.delete(objects.Kind.RESOURCESLICES, name)

    def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """One get; ``None`` on 404."""
        return self._api.get(objects.Kind.LEASES, name, namespace=namespace)


_: type[kubeapi.NodeApi] = LightkubeNodeApi  # it is one (mypy checks)
__: type[sliceapi.SliceApi] = LightkubeSliceApi
___: type[sliceapi.SliceSource] = LightkubeNodeApi
