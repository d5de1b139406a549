"""The controller's Kubernetes API client: :class:`~kubeapi.ControllerApi` over lightkube's
async client.

The only controller module that imports lightkube (an import-linter contract checks it). Each
call is prepare (a body from :mod:`migpilot.api.gpulayouts` or a plain dict) → send (one
lightkube call) → interpret (raw JSON back, or :class:`~kubeapi.KubeApiError` with the server's
message: 410 as :class:`~kubeapi.GoneError`, 409 as :class:`~kubeapi.ConflictError`).
"""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx2
import lightkube
from lightkube.generic_resource import create_global_resource
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Node, Pod
from lightkube.types import PatchType

from migpilot import kubeconfigs
from migpilot.api import gpulayouts, gpulayouts_wire
from migpilot.controller import kubeapi

GpuLayout = create_global_resource(
    gpulayouts.GROUP, gpulayouts.VERSION, gpulayouts.KIND, gpulayouts.PLURAL
)
WATCH_SERVER_TIMEOUT_S = 300
"""The apiserver ends a watch after this many seconds; the loop lists again from there."""
COMPONENT = "migpilot-controller"
_RESOURCES: dict[kubeapi.Kind, Any] = {
    kubeapi.Kind.PODS: Pod,
    kubeapi.Kind.NODES: Node,
    kubeapi.Kind.LAYOUTS: GpuLayout,
}


def connect(kubeconfig: Path | None) -> LightkubeControllerApi:
    """A client from a kubeconfig file, or the in-cluster service account without one (a bad
    file: :class:`~migpilot.errors.ConfigError` naming it, :func:`kubeconfigs.load`)."""
    config = kubeconfigs.load(kubeconfig)
    # Proxies from the environment are not for the apiserver the kubeconfig names.
    client = lightkube.AsyncClient(config=config, field_manager=COMPONENT, trust_env=False)
    return LightkubeControllerApi(client)


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
    that cannot be reached or refuses: :class:`~kubeapi.KubeApiError` (one line each)."""
    config = kubeconfigs.load(kubeconfig)
    client = lightkube.AsyncClient(
        config=config, timeout=httpx2.Timeout(timeout_s), trust_env=False
    )

    async def listed(res: Any, **kw: Any) -> list[dict[str, Any]]:
        return [obj.to_dict() async for obj in client.list(res, **kw)]

    try:
        return Objects(
            layouts=await listed(GpuLayout),
            nodes=await listed(Node),
            pods=await listed(Pod, namespace="*"),
            events=await listed(Event, namespace="*", fields={"source": COMPONENT}),
        )
    except _ERRORS as err:
        raise _error(err) from None
    finally:
        await client.close()


def _error(err: Exception) -> kubeapi.KubeApiError:
    if isinstance(err, lightkube.ApiError):
        text = f"{err.status.code} {err.status.reason}: {err.status.message}"
        if err.status.code == 410:
            return kubeapi.GoneError(text)
        if err.status.code == 409:
            return kubeapi.ConflictError(text)
        code = err.status.code or 0
        return kubeapi.KubeApiError(text, transient=code == 429 or code >= 500)
    return kubeapi.KubeApiError(f"the API server cannot be reached: {err!r}", transient=True)


_ERRORS = (lightkube.ApiError, httpx2.HTTPError)


class LightkubeControllerApi:
    """:class:`~kubeapi.ControllerApi` over a lightkube async client."""

    def __init__(self, client: lightkube.AsyncClient) -> None:
        self._client = client

    async def list_all(self, kind: kubeapi.Kind) -> kubeapi.Listed:
        res = _RESOURCES[kind]
        try:
            found = self._client.list(res, namespace="*" if kind is kubeapi.Kind.PODS else None)
            items = [obj.to_dict() async for obj in found]
            version = str(found.resourceVersion)
        except _ERRORS as err:
            raise _error(err) from None
        return kubeapi.Listed(items, version)

    async def watch(
        self, kind: kubeapi.Kind, *, resource_version: str
    ) -> AsyncIterator[kubeapi.WatchEvent]:
        res = _RESOURCES[kind]
        events = self._client.watch(
            res,
            namespace="*" if kind is kubeapi.Kind.PODS else None,
            resource_version=resource_version,
            server_timeout=WATCH_SERVER_TIMEOUT_S,
        )
        try:
            async for type_, obj in events:
                if type_ in kubeapi.EventType.__members__:
                    yield kubeapi.WatchEvent(kubeapi.EventType(type_), obj.to_dict())
        except _ERRORS as err:
            raise _error(err) from None

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
            body["metadata"] = {
                **body["metadata"],
                "ownerReferences": [
                    {"apiVersion": "v1", "kind": "Node", "name": name, "uid": owner_uid}
                ],
            }
        try:
            if fence.resource_version is None:
                # Must not exist yet: a create (409 AlreadyExists otherwise), never an apply
                # that would overwrite the spec another leader wrote.
                got = await self._client.create(
                    GpuLayout.from_dict(body),
                    field_manager=gpulayouts.CONTROLLER_FIELD_MANAGER,
                )
            else:
                # The resourceVersion in the body is a precondition of the apply (409).
                got = await self._client.patch(
                    GpuLayout,
                    name,
                    body,
                    patch_type=PatchType.APPLY,
                    field_manager=gpulayouts.CONTROLLER_FIELD_MANAGER,
                    force=True,
                )
        except _ERRORS as err:
            raise _error(err) from None
        doc: dict[str, Any] = got.to_dict()
        return doc

    async def patch_pod(self, key: str, patch: list[dict[str, Any]]) -> Mapping[str, Any]:
        namespace, name = key.split("/", 1)
        try:
            got = await self._client.patch(
                Pod, name, patch, namespace=namespace, patch_type=PatchType.JSON
            )
        except _ERRORS as err:
            raise _error(err) from None
        doc: dict[str, Any] = got.to_dict()
        return doc

    async def record(self, note: kubeapi.EventNote) -> None:
        now = datetime.datetime.now(datetime.UTC)
        stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
        namespace = note.namespace or "default"
        body = {
            "metadata": {"generateName": f"{note.name}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": "v1",
                "kind": note.kind,
                "name": note.name,
                "namespace": note.namespace,
                "uid": note.uid,
            },
            "type": note.type,
            "reason": note.reason,
            "message": note.message[:1024],
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "firstTimestamp": stamp,
            "lastTimestamp": stamp,
            "count": 1,
        }
        try:
            await self._client.create(cast(Event, Event.from_dict(body)))
        except _ERRORS as err:
            raise _error(err) from None

    async def get_lease(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        try:
            lease = await self._client.get(Lease, name, namespace=namespace)
        except lightkube.ApiError as err:
            if err.status.code == 404:
                return None
            raise _error(err) from None
        except httpx2.HTTPError as err:
            raise _error(err) from None
        doc: dict[str, Any] = lease.to_dict()
        return doc

    async def lease_namespace_exists(self, namespace: str, name: str) -> bool:
        body = {"metadata": {"name": name, "namespace": namespace}, "spec": {}}
        try:
            await self._client.create(cast(Lease, Lease.from_dict(body)), dry_run=True)
        except lightkube.ApiError as err:
            if err.status.code == 404:
                return False  # the namespace: a Lease that exists answers 409
            if err.status.code == 409:
                return True
            raise _error(err) from None
        except httpx2.HTTPError as err:
            raise _error(err) from None
        return True

    async def write_lease(self, lease: Mapping[str, Any], *, create: bool) -> Mapping[str, Any]:
        obj = cast(Lease, Lease.from_dict(dict(lease)))
        try:
            if create:
                got = await self._client.create(obj)
            else:
                got = await self._client.replace(obj)
        except _ERRORS as err:
            raise _error(err) from None
        doc: dict[str, Any] = got.to_dict()
        return doc

    async def close(self) -> None:
        await self._client.close()
