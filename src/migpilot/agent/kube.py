"""The node agent's Kubernetes API client: :class:`~kubeapi.NodeApi` over lightkube.

The only agent module that imports lightkube (an import-linter contract checks it). Each call
is prepare (the body, from :mod:`migpilot.api.gpulayouts` or a plain dict) → send (one lightkube
call) → interpret (raw JSON back, or :class:`~kubeapi.KubeApiError` with the server's message;
410 Gone as :class:`~kubeapi.GoneError` so the caller lists again).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx2
import lightkube
from lightkube import operators
from lightkube.generic_resource import create_global_resource
from lightkube.resources.core_v1 import ConfigMap, Node, Pod
from lightkube.types import PatchType

from migpilot import kubeconfigs
from migpilot.agent import kubeapi
from migpilot.api import gpulayouts, gpulayouts_wire

GpuLayout = create_global_resource(
    gpulayouts.GROUP, gpulayouts.VERSION, gpulayouts.KIND, gpulayouts.PLURAL
)
WATCH_SERVER_TIMEOUT_S = 300
"""The apiserver ends a watch after this many seconds; lightkube reopens it from the last
version seen."""


def connect(kubeconfig: Path | None) -> LightkubeNodeApi:
    """A client from a kubeconfig file, or the in-cluster service account without one (a bad
    file: :class:`~migpilot.errors.ConfigError` naming it, :func:`kubeconfigs.load`)."""
    config = kubeconfigs.load(kubeconfig)
    # Proxies from the environment are not for the apiserver the kubeconfig names.
    client = lightkube.Client(
        config=config, field_manager=gpulayouts.AGENT_FIELD_MANAGER, trust_env=False
    )
    return LightkubeNodeApi(client)


def _error(err: Exception) -> kubeapi.KubeApiError:
    if isinstance(err, lightkube.ApiError):
        text = f"{err.status.code} {err.status.reason}: {err.status.message}"
        if err.status.code == 410:
            return kubeapi.GoneError(text)
        code = err.status.code or 0
        return kubeapi.KubeApiError(text, transient=code == 429 or code >= 500)
    return kubeapi.KubeApiError(f"the API server cannot be reached: {err}", transient=True)


def _node_field(node: str | None) -> dict[str, Any]:
    return {"spec.nodeName": operators.not_equal("") if node is None else node}


def _labels(selector: kubeapi.LabelSelector) -> dict[str, Any]:
    value = operators.exists() if selector.value is None else selector.value
    return {selector.key: value}


class LightkubeNodeApi:
    """:class:`~kubeapi.NodeApi` over a lightkube sync client."""

    def __init__(self, client: lightkube.Client) -> None:
        self._client = client

    def list_layout(self, name: str) -> kubeapi.Listed:
        """One list call with a field selector: the object (or none) and the list's version."""
        try:
            found = self._client.list(GpuLayout, fields={"metadata.name": name})
            docs = [obj.to_dict() for obj in found]  # type: ignore[no-untyped-call]
            version = found.resourceVersion
        except (lightkube.ApiError, httpx2.HTTPError) as err:
            raise _error(err) from None
        return kubeapi.Listed(docs[0] if docs else None, version)

    def watch_layout(self, name: str, *, resource_version: str) -> Iterator[kubeapi.WatchEvent]:
        """Watch events for ``name``; lightkube reopens the stream when the server ends it."""
        events = self._client.watch(
            GpuLayout,
            fields={"metadata.name": name},
            resource_version=resource_version,
            server_timeout=WATCH_SERVER_TIMEOUT_S,
        )
        try:
            for kind, obj in events:
                if kind in kubeapi.EventType.__members__:
                    doc = obj.to_dict()  # type: ignore[no-untyped-call]
                    yield kubeapi.WatchEvent(kubeapi.EventType(kind), doc)
        except (lightkube.ApiError, httpx2.HTTPError) as err:
            raise _error(err) from None

    def list_pods(self, *, node: str | None) -> kubeapi.ListedAll:
        """Pods in every namespace with ``spec.nodeName=node`` (``!=""`` for ``None``)."""
        return self._list_all(Pod, namespace="*", fields=_node_field(node))

    def get_pod(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """One get; ``None`` on 404."""
        try:
            found = self._client.get(Pod, name, namespace=namespace)
        except lightkube.ApiError as err:
            if err.status.code == 404:
                return None
            raise _error(err) from None
        except httpx2.HTTPError as err:
            raise _error(err) from None
        doc: Mapping[str, Any] = found.to_dict()
        return doc

    def watch_pods(
        self, *, node: str | None, resource_version: str
    ) -> Iterator[kubeapi.WatchEvent]:
        """Watch the pods :meth:`list_pods` selects."""
        return self._watch_all(Pod, resource_version, namespace="*", fields=_node_field(node))

    def list_layouts(self) -> kubeapi.ListedAll:
        """Every GpuLayout."""
        return self._list_all(GpuLayout)

    def watch_layouts(self, *, resource_version: str) -> Iterator[kubeapi.WatchEvent]:
        """Watch every GpuLayout."""
        return self._watch_all(GpuLayout, resource_version)

    def list_nodes(self, *, selector: kubeapi.LabelSelector) -> kubeapi.ListedAll:
        """The Nodes ``selector`` selects."""
        return self._list_all(Node, labels=_labels(selector))

    def watch_nodes(
        self, *, selector: kubeapi.LabelSelector, resource_version: str
    ) -> Iterator[kubeapi.WatchEvent]:
        """Watch the Nodes ``selector`` selects."""
        return self._watch_all(Node, resource_version, labels=_labels(selector))

    def list_node(self, name: str) -> kubeapi.ListedAll:
        """The Node ``name`` (a list with a field selector: none or one)."""
        return self._list_all(Node, fields={"metadata.name": name})

    def watch_node(self, name: str, *, resource_version: str) -> Iterator[kubeapi.WatchEvent]:
        """Watch the Node ``name``."""
        return self._watch_all(Node, resource_version, fields={"metadata.name": name})

    def list_configmap(self, namespace: str, name: str) -> kubeapi.ListedAll:
        """The ConfigMap ``namespace/name`` (none or one)."""
        return self._list_all(ConfigMap, namespace=namespace, fields={"metadata.name": name})

    def watch_configmap(
        self, namespace: str, name: str, *, resource_version: str
    ) -> Iterator[kubeapi.WatchEvent]:
        """Watch that ConfigMap."""
        return self._watch_all(
            ConfigMap, resource_version, namespace=namespace, fields={"metadata.name": name}
        )

    def _list_all(self, res: Any, **selectors: Any) -> kubeapi.ListedAll:
        try:
            found = self._client.list(res, **selectors)
            docs = tuple(obj.to_dict() for obj in found)
            version = found.resourceVersion
        except (lightkube.ApiError, httpx2.HTTPError) as err:
            raise _error(err) from None
        return kubeapi.ListedAll(docs, version)

    def _watch_all(
        self, res: Any, resource_version: str, **selectors: Any
    ) -> Iterator[kubeapi.WatchEvent]:
        events = self._client.watch(
            res,
            resource_version=resource_version,
            server_timeout=WATCH_SERVER_TIMEOUT_S,
            **selectors,
        )
        try:
            for kind, obj in events:
                if kind in kubeapi.EventType.__members__:
                    yield kubeapi.WatchEvent(kubeapi.EventType(kind), obj.to_dict())
        except (lightkube.ApiError, httpx2.HTTPError) as err:
            raise _error(err) from None

    def apply_layout_status(self, name: str, status: gpulayouts.LayoutStatus) -> None:
        """Server-side apply on ``status`` as ``migpilot-agent`` (forced: the agent owns it)."""
        body: dict[str, Any] = dict(gpulayouts_wire.status_patch(name, status))
        self._send_patch(GpuLayout.Status, name, body, PatchType.APPLY)

    def patch_node_labels(self, node: str, labels: Mapping[str, str | None]) -> None:
        """A merge patch of ``metadata.labels`` (``None`` deletes a key)."""
        self._send_patch(Node, node, {"metadata": {"labels": dict(labels)}}, PatchType.MERGE)

    def patch_node_resources(self, node: str, resources: Mapping[str, str | None]) -> None:
        """A merge patch of ``status.capacity`` and ``status.allocatable``."""
        body = {"status": {"capacity": dict(resources), "allocatable": dict(resources)}}
        self._send_patch(Node.Status, node, body, PatchType.MERGE)

    def _send_patch(self, res: Any, name: str, body: dict[str, Any], kind: PatchType) -> None:
        try:
            self._client.patch(
                res,
                name,
                body,
                patch_type=kind,
                field_manager=gpulayouts.AGENT_FIELD_MANAGER,
                force=kind is PatchType.APPLY,
            )
        except (lightkube.ApiError, httpx2.HTTPError) as err:
            raise _error(err) from None

    def close(self) -> None:
        """Close the connections."""
        self._client.close()
