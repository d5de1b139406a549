"""The controller's Kubernetes API client: :class:`~kubeapi.ControllerApi` over the shared
lightkube async client.

The controller's adapter to :mod:`migpilot.kube.client`: each call of
:class:`~kubeapi.ControllerApi` is prepared here (a body from :mod:`migpilot.api.gpulayouts`
or :mod:`migpilot.kube.requests`) and sent by the client, which interprets the answer: raw JSON
back, or a :class:`~migpilot.kube.errors.KubeApiError` with the server's message (410 as
:class:`~migpilot.kube.errors.GoneError`, 409 as :class:`~migpilot.kube.errors.ConflictError`).
Imports no Kubernetes client itself (an import-linter contract checks it).
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from migpilot.api import gpulayouts, gpulayouts_wire
from migpilot.controller import kubeapi
from migpilot.kube import client, errors, objects, requests

COMPONENT = "migpilot-controller"


def connect(kubeconfig: Path | None) -> LightkubeControllerApi:
    """A client from a kubeconfig file, or the in-cluster service account without one (a bad
    file: :class:`~migpilot.errors.ConfigError` naming it)."""
    return LightkubeControllerApi(client.AsyncClient.connect(kubeconfig, field_manager=COMPONENT))


@dataclass(frozen=True, slots=True)
class Objects:
    """What ``migpilot status`` reads (raw JSON, for :func:`surveying.survey`)."""

    layouts: list[dict[str, Any]]
    nodes: list[dict[str, Any]]
    pods: list[dict[str, Any]]
    events: list[dict[str, Any]]
    """Only the controller's Events (``source`` ``migpilot-controller``)."""


async def read_objects(kubeconfig: Path | None, *, timeout_s: float) -> Objects:
    """One read of the cluster for ``migpilot status``: GpuLayouts, Nodes, Pods and the
    controller's Events. A bad kubeconfig: :class:`~migpilot.errors.ConfigError`; an API server
    that cannot be reached or refuses: :class:`~migpilot.kube.errors.KubeApiError` (one line
    each)."""
    api = client.AsyncClient.connect(kubeconfig, timeout_s=timeout_s)

    async def listed(kind: objects.Kind, *fields: objects.FieldSelector) -> list[dict[str, Any]]:
        return [dict(doc) for doc in (await api.list(kind, fields=fields)).items]

    try:
        return Objects(
            layouts=await listed(objects.Kind.LAYOUTS),
            nodes=await listed(objects.Kind.NODES),
            pods=await listed(objects.Kind.PODS),
            events=await listed(objects.Kind.EVENTS, objects.FieldSelector("source", COMPONENT)),
        )
    finally:
        await api.close()


class LightkubeControllerApi:
    """:class:`~kubeapi.ControllerApi` over :class:`migpilot.kube.client.AsyncClient`."""

    def __init__(self, api: client.AsyncClient) -> None:
        self._api = api

    async def list_all(self, kind: objects.Kind) -> objects.Listed:
        return await self._api.list(kind)

    def watch(
        self, kind: objects.Kind, *, resource_version: str
    ) -> AsyncIterator[objects.WatchEvent]:
        return self._api.watch(kind, resource_version=resource_version)

    async def apply_layout_spec(
        self,
        name: str,
        spec: gpulayouts.LayoutSpec,
        *,
        owner_uid: str | None,
        fence: kubeapi.Fence,
    ) -> Mapping[str, Any]:
        body: dict[str, Any] = dict(
            gpulayouts_wire.spec_patch(
                name,
                spec,
                resource_version=fence.resource_version,
                leader=(fence.leader, fence.term),
            )
        )
        if owner_uid is not None:
            body = requests.owned_by_node(body, node=name, uid=owner_uid)
        if fence.resource_version is None:
            # Must not exist yet: a create (409 AlreadyExists otherwise), never an apply that
            # would overwrite the spec another leader wrote.
            return await self._api.create(
                objects.Kind.LAYOUTS, body, field_manager=gpulayouts.CONTROLLER_FIELD_MANAGER
            )
        # The resourceVersion in the body is a precondition of the apply (409).
        return await self._api.patch(
            objects.Kind.LAYOUTS,
            name,
            body,
            patch=objects.Patch.APPLY,
            field_manager=gpulayouts.CONTROLLER_FIELD_MANAGER,
            force=True,
        )

    async def patch_pod(self, key: str, patch: list[dict[str, Any]]) -> Mapping[str, Any]:
        namespace, name = key.split("/", 1)
        return await self._api.patch(
            objects.Kind.PODS, name, patch, patch=objects.Patch.JSON, namespace=namespace
        )

    async def record(self, note: objects.EventNote) -> None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        body = requests.event_body(note, component=COMPONENT, stamp=stamp)
        await self._api.create(objects.Kind.EVENTS, body)

    async def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        return await self._api.get(objects.Kind.LEASES, name, namespace=namespace)

    async def lease_namespace_exists(self, namespace: str, name: str) -> bool:
        try:
            await self._api.create(
                objects.Kind.LEASES, requests.lease_probe(namespace, name), dry_run=True
            )
        except errors.NotFoundError:
            return False  # the namespace: a Lease that exists answers 409
        except errors.ConflictError:
            return True
        return True

    async def write_lease(self, lease: Mapping[str, Any], *, create: bool) -> Mapping[str, Any]:
        if create:
            return await self._api.create(objects.Kind.LEASES, lease)
        return await self._api.replace(objects.Kind.LEASES, lease)

    async def close(self) -> None:
        await self._api.close()
