"""The Kubernetes API client of every shell: lightkube, with requests sent and errors translated.

Why it exists: the agent (threads), the controller (asyncio), the webhook and the KWOK tools
each need a few calls of the API server. Here, once, is what those calls share: which lightkube
resource each :class:`~migpilot.kube.objects.Kind` is, how selectors are spelt, and the
interpretation of every answer: raw JSON back, or a :class:`~migpilot.kube.errors.KubeApiError`
with the server's message (410 as :class:`~migpilot.kube.errors.GoneError`, 409 as
:class:`~migpilot.kube.errors.ConflictError`, 404 as :class:`~migpilot.kube.errors.NotFoundError`,
a 429, a 5xx or no answer at all marked transient). :class:`Client` and :class:`AsyncClient`
offer the same calls, blocking or awaited; a shell's adapter turns its narrow Protocol into
them, as it turns it into :class:`~migpilot.kube.memory.InMemoryServer`'s in the unit tests.

With :mod:`~migpilot.kube.configs`, the only module that imports lightkube and its httpx2 (an
import-linter contract checks it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx2
import lightkube
from lightkube import operators
from lightkube.generic_resource import create_global_resource
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import ConfigMap, Event, Namespace, Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim, ResourceClaimTemplate, ResourceSlice
from lightkube.types import PatchType

from migpilot.api import gpulayouts
from migpilot.kube import configs, errors, objects

GpuLayout = create_global_resource(
    gpulayouts.GROUP, gpulayouts.VERSION, gpulayouts.KIND, gpulayouts.PLURAL
)
WATCH_SERVER_TIMEOUT_S = 300
"""The apiserver ends a watch after this many seconds; lightkube reopens it from the last
version seen (the sync client), or the caller lists again (the async one)."""
RESOURCES: dict[objects.Kind, Any] = {
    objects.Kind.PODS: Pod,
    objects.Kind.NODES: Node,
    objects.Kind.LAYOUTS: GpuLayout,
    objects.Kind.CONFIGMAPS: ConfigMap,
    objects.Kind.LEASES: Lease,
    objects.Kind.EVENTS: Event,
    objects.Kind.NAMESPACES: Namespace,
    objects.Kind.RESOURCECLAIMS: ResourceClaim,
    objects.Kind.RESOURCECLAIMTEMPLATES: ResourceClaimTemplate,
    objects.Kind.RESOURCESLICES: ResourceSlice,
}
_PATCH_TYPES = {
    objects.Patch.APPLY: PatchType.APPLY,
    objects.Patch.MERGE: PatchType.MERGE,
    objects.Patch.JSON: PatchType.JSON,
}
ERRORS = (lightkube.ApiError, httpx2.HTTPError)
"""What lightkube raises for an answer it did not like, or for none."""


def translate(err: Exception) -> errors.KubeApiError:
    """One of :data:`ERRORS` as the boundary's error, the server's message kept."""
    if isinstance(err, lightkube.ApiError):
        code = err.status.code or 0
        text = f"{err.status.code} {err.status.reason}: {err.status.message}"
        if code == 410:
            return errors.GoneError(text, code=code)
        if code == 409:
            return errors.ConflictError(text, code=code)
        if code == 404:
            return errors.NotFoundError(text, code=code)
        return errors.KubeApiError(text, transient=code == 429 or code >= 500, code=code or None)
    # A timeout's message can be empty: its type then says what happened.
    detail = str(err) or repr(err)
    return errors.KubeApiError(f"the API server cannot be reached: {detail}", transient=True)


def _selection(
    kind: objects.Kind,
    namespace: str | None,
    fields: Sequence[objects.FieldSelector],
    labels: objects.LabelSelector | None,
) -> dict[str, Any]:
    """lightkube's keyword arguments for a list or a watch (``namespace`` ``None``: every
    namespace of a namespaced kind)."""
    chosen: dict[str, Any] = {}
    if kind.namespaced:
        chosen["namespace"] = "*" if namespace is None else namespace
    if fields:
        chosen["fields"] = {
            f.path: operators.not_equal(f.value) if f.negated else f.value for f in fields
        }
    if labels is not None:
        chosen["labels"] = {
            labels.key: operators.exists() if labels.value is None else labels.value
        }
    return chosen


def _resource(kind: objects.Kind, *, status: bool) -> Any:
    res = RESOURCES[kind]
    return res.Status if status else res


def _doc(obj: Any) -> dict[str, Any]:
    doc: dict[str, Any] = obj.to_dict()
    return doc


def _event(type_: str, obj: Any) -> objects.WatchEvent | None:
    """A watch event, ``None`` for a type the shells do not take (a bookmark)."""
    if type_ not in objects.EventType.__members__:
        return None
    return objects.WatchEvent(objects.EventType(type_), _doc(obj))


def _options(field_manager: str | None, timeout_s: float | None) -> dict[str, Any]:
    options: dict[str, Any] = {"trust_env": False}
    if field_manager is not None:
        options["field_manager"] = field_manager
    if timeout_s is not None:
        options["timeout"] = httpx2.Timeout(timeout_s)
    return options


class Client:
    """The calls of the API server the threaded shells make (the agent, the fleet, the
    webhook), over lightkube's sync client; errors: :class:`~migpilot.kube.errors.KubeApiError`."""

    def __init__(self, client: lightkube.Client) -> None:
        self._client = client

    @classmethod
    def connect(
        cls,
        kubeconfig: Path | None,
        *,
        field_manager: str | None = None,
        timeout_s: float | None = None,
    ) -> Client:
        """A client from a kubeconfig file, or the in-cluster service account without one (a
        bad file: :class:`~migpilot.errors.ConfigError` naming it, :func:`configs.load`).
        ``timeout_s``: of each request (``None``: lightkube's default)."""
        config = configs.load(kubeconfig)
        # Proxies from the environment are not for the apiserver the kubeconfig names.
        return cls(lightkube.Client(config=config, **_options(field_manager, timeout_s)))

    def get(
        self, kind: objects.Kind, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, ``None`` when there is none (404)."""
        try:
            return _doc(self._client.get(RESOURCES[kind], name, namespace=namespace))
        except lightkube.ApiError as err:
            if err.status.code == 404:
                return None
            raise translate(err) from None
        except httpx2.HTTPError as err:
            raise translate(err) from None

    def list(
        self,
        kind: objects.Kind,
        *,
        namespace: str | None = None,
        fields: Sequence[objects.FieldSelector] = (),
        labels: objects.LabelSelector | None = None,
    ) -> objects.Listed:
        """The objects selected and the list's resource version."""
        try:
            found = self._client.list(
                RESOURCES[kind], **_selection(kind, namespace, fields, labels)
            )
            docs = tuple(_doc(obj) for obj in found)
            version = str(found.resourceVersion)
        except ERRORS as err:
            raise translate(err) from None
        return objects.Listed(docs, version)

    def watch(
        self,
        kind: objects.Kind,
        *,
        resource_version: str,
        namespace: str | None = None,
        fields: Sequence[objects.FieldSelector] = (),
        labels: objects.LabelSelector | None = None,
    ) -> Iterator[objects.WatchEvent]:
        """The changes after ``resource_version`` as they happen; lightkube reopens the stream
        when the server ends it. :class:`~migpilot.kube.errors.GoneError` when too old."""
        events = self._client.watch(
            RESOURCES[kind],
            resource_version=resource_version,
            server_timeout=WATCH_SERVER_TIMEOUT_S,
            **_selection(kind, namespace, fields, labels),
        )
        try:
            for type_, obj in events:
                event = _event(type_, obj)
                if event is not None:
                    yield event
        except ERRORS as err:
            raise translate(err) from None

    def patch(
        self,
        kind: objects.Kind,
        name: str,
        body: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        patch: objects.Patch,
        namespace: str | None = None,
        status: bool = False,
        field_manager: str | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        """Patch the object (its status subresource with ``status``); the object after."""
        try:
            got = self._client.patch(
                _resource(kind, status=status),
                name,
                body,
                namespace=namespace,
                patch_type=_PATCH_TYPES[patch],
                field_manager=field_manager,
                force=force,
            )
        except ERRORS as err:
            raise translate(err) from None
        return _doc(got)

    def create(
        self, kind: objects.Kind, body: Mapping[str, Any], *, field_manager: str | None = None
    ) -> dict[str, Any]:
        """Create the object (:class:`~migpilot.kube.errors.ConflictError` when it exists)."""
        obj = RESOURCES[kind].from_dict(dict(body))
        try:
            got = self._client.create(obj, field_manager=field_manager)
        except ERRORS as err:
            raise translate(err) from None
        return _doc(got)

    def replace(
        self, kind: objects.Kind, body: Mapping[str, Any], *, field_manager: str | None = None
    ) -> dict[str, Any]:
        """Replace the object; the body's ``resourceVersion`` guards the write
        (:class:`~migpilot.kube.errors.ConflictError` when someone wrote it first)."""
        obj = RESOURCES[kind].from_dict(dict(body))
        try:
            got = self._client.replace(obj, field_manager=field_manager)
        except ERRORS as err:
            raise translate(err) from None
        return _doc(got)

    def delete(self, kind: objects.Kind, name: str, *, namespace: str | None = None) -> bool:
        """Delete the object: ``True`` when it was there, ``False`` when it was not (404)."""
        try:
            self._client.delete(RESOURCES[kind], name, namespace=namespace)
        except lightkube.ApiError as err:
            if err.status.code == 404:
                return False
            raise translate(err) from None
        except httpx2.HTTPError as err:
            raise translate(err) from None
        return True

    def close(self) -> None:
        """Close the connections."""
        self._client.close()


class AsyncClient:
    """The calls of the API server the controller makes, over lightkube's async client;
    errors: :class:`~migpilot.kube.errors.KubeApiError`."""

    def __init__(self, client: lightkube.AsyncClient) -> None:
        self._client = client

    @classmethod
    def connect(
        cls,
        kubeconfig: Path | None,
        *,
        field_manager: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncClient:
        """As :meth:`Client.connect`, with lightkube's async client."""
        config = configs.load(kubeconfig)
        # Proxies from the environment are not for the apiserver the kubeconfig names.
        return cls(lightkube.AsyncClient(config=config, **_options(field_manager, timeout_s)))

    async def get(
        self, kind: objects.Kind, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object, ``None`` when there is none (404)."""
        try:
            return _doc(await self._client.get(RESOURCES[kind], name, namespace=namespace))
        except lightkube.ApiError as err:
            if err.status.code == 404:
                return None
            raise translate(err) from None
        except httpx2.HTTPError as err:
            raise translate(err) from None

    async def list(
        self,
        kind: objects.Kind,
        *,
        namespace: str | None = None,
        fields: Sequence[objects.FieldSelector] = (),
        labels: objects.LabelSelector | None = None,
    ) -> objects.Listed:
        """The objects selected and the list's resource version."""
        try:
            found = self._client.list(
                RESOURCES[kind], **_selection(kind, namespace, fields, labels)
            )
            docs = tuple([_doc(obj) async for obj in found])
            version = str(found.resourceVersion)
        except ERRORS as err:
            raise translate(err) from None
        return objects.Listed(docs, version)

    async def watch(
        self,
        kind: objects.Kind,
        *,
        resource_version: str,
        namespace: str | None = None,
        fields: Sequence[objects.FieldSelector] = (),
        labels: objects.LabelSelector | None = None,
    ) -> AsyncIterator[objects.WatchEvent]:
        """The changes after ``resource_version`` as they happen;
        :class:`~migpilot.kube.errors.GoneError` when too old."""
        events = self._client.watch(
            RESOURCES[kind],
            resource_version=resource_version,
            server_timeout=WATCH_SERVER_TIMEOUT_S,
            **_selection(kind, namespace, fields, labels),
        )
        try:
            async for type_, obj in events:
                event = _event(type_, obj)
                if event is not None:
                    yield event
        except ERRORS as err:
            raise translate(err) from None

    async def create(
        self,
        kind: objects.Kind,
        body: Mapping[str, Any],
        *,
        field_manager: str | None = None,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Create the object (:class:`~migpilot.kube.errors.ConflictError` when it exists);
        ``dry_run``: checked by the server, not stored."""
        obj = RESOURCES[kind].from_dict(dict(body))
        try:
            got = await self._client.create(obj, field_manager=field_manager, dry_run=dry_run)
        except ERRORS as err:
            raise translate(err) from None
        return _doc(got)

    async def replace(self, kind: objects.Kind, body: Mapping[str, Any]) -> dict[str, Any]:
        """Replace the object; the body's ``resourceVersion`` guards the write
        (:class:`~migpilot.kube.errors.ConflictError` when someone wrote it first)."""
        obj = RESOURCES[kind].from_dict(dict(body))
        try:
            got = await self._client.replace(obj)
        except ERRORS as err:
            raise translate(err) from None
        return _doc(got)

    async def patch(
        self,
        kind: objects.Kind,
        name: str,
        body: Mapping[str, Any] | Sequence[Mapping[str, Any]],
        *,
        patch: objects.Patch,
        namespace: str | None = None,
        field_manager: str | None = None,
        force: bool = False,
    ) -> dict[str, Any]:
        """Patch the object; the object after."""
        try:
            got = await self._client.patch(
                RESOURCES[kind],
                name,
                body,
                namespace=namespace,
                patch_type=_PATCH_TYPES[patch],
                field_manager=field_manager,
                force=force,
            )
        except ERRORS as err:
            raise translate(err) from None
        return _doc(got)

    async def close(self) -> None:
        """Close the connections."""
        await self._client.close()
