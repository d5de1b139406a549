"""One Kubernetes API server in memory, for the unit tests and demos of every shell.

Why it exists: the agent, the controller and the webhook are tested against the API server's
semantics, not a toy per shell: every write bumps one resource version shared by all kinds, a
list answers that version, a watch from it gets every later change as its selectors see it (an
object that starts or stops matching arrives as ``ADDED`` or ``DELETED``), and a watch from a
version older than the last :meth:`InMemoryServer.compact` is refused with
:class:`~migpilot.kube.errors.GoneError`. Each shell's in-memory adapter (its narrow Protocol,
with the test conveniences it needs) sits on this one server, so an agent and a controller can
even share one.

It is thread-safe, and it serves both kinds of shell: :meth:`InMemoryServer.watch` blocks a
thread (the agent), :meth:`InMemoryServer.watch_async` awaits on an event loop (the
controller). A stored object is never changed in place: every write stores a fresh document, so
the change log shares it, and what a read or a watch hands out is a deep copy.

No client, no I/O, no clock.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import contextlib
import copy
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot.kube import errors, objects

Match = Callable[[Mapping[str, Any]], bool]
"""Whether a raw object is selected."""


@dataclass(frozen=True, slots=True)
class _Change:
    version: int
    kind: objects.Kind
    before: Mapping[str, Any] | None
    after: Mapping[str, Any] | None


def _version_of(change: _Change) -> int:
    return change.version


def selecting(
    *,
    namespace: str | None = None,
    fields: Sequence[objects.FieldSelector] = (),
    labels: objects.LabelSelector | None = None,
) -> Match:
    """The selection of a list or a watch: in ``namespace`` (``None``: any), every field
    selector and the label selector matching, as the API server selects."""

    def match(doc: Mapping[str, Any]) -> bool:
        if namespace is not None and (doc.get("metadata") or {}).get("namespace") != namespace:
            return False
        if labels is not None and not labels.matches(objects.labels_of(doc)):
            return False
        return all(f.matches(doc) for f in fields)

    return match


def _key(kind: objects.Kind, name: str, namespace: str | None) -> str:
    return f"{namespace}/{name}" if kind.namespaced and namespace else name


class InMemoryServer:
    """An API server in memory: objects by kind and key, one resource version, watches.

    Tests write as another client would (:meth:`put`, :meth:`delete`, :meth:`update`) and read
    :attr:`objects` and :attr:`requests`; the shells' adapters call the client side
    (:meth:`get`, :meth:`list`, :meth:`watch`, :meth:`create`, :meth:`replace`,
    :meth:`remove`). A watch ends
    at :meth:`close`.
    """

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.RLock())
        """Held for every read and write; an adapter holds it across a read and its write to
        make them one step (re-entrant)."""
        self.objects: dict[objects.Kind, dict[str, dict[str, Any]]] = {k: {} for k in objects.Kind}
        """Kind -> key (``namespace/name`` or ``name``) -> the object as stored now."""
        self.requests: collections.Counter[tuple[str, objects.Kind]] = collections.Counter()
        """``(verb, kind)`` -> how many calls the client side answered (``get``, ``list``,
        ``watch``, ``create``, ``replace``, ``delete``): tests check what a shell asked."""
        self._version = 0
        self._compacted = 0
        self._changes: list[_Change] = []
        self._closed = False
        self._wakers: set[Callable[[], None]] = set()

    # -- the versions --------------------------------------------------------------------------
    @property
    def version(self) -> str:
        """The resource version now: a watch from it gets every later change."""
        with self.lock:
            return str(self._version)

    def compact(self) -> None:
        """Forget the change history: watches from any older version get
        :class:`~migpilot.kube.errors.GoneError`."""
        with self.lock:
            self._compacted = self._version
            self._changes.clear()

    def close(self) -> None:
        """End every watch (they return)."""
        with self.lock:
            self._closed = True
            self.lock.notify_all()
        self._wake()

    # -- writes (another client's, or an adapter's) ----------------------------------------------
    def store(
        self, kind: objects.Kind, key: str, doc: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """Store ``doc`` under ``key`` (``None`` deletes it) with the next resource version and
        record the change; the document is the server's from now on (never changed in place).
        The object as stored (as deleted), ``None`` when there was nothing to delete."""
        with self.lock:
            store = self.objects[kind]
            before = store.get(key)
            if doc is None and before is None:
                return None
            self._version += 1
            stamp = str(self._version)
            if doc is None:
                del store[key]
                # The DELETED event carries the object at the deletion's version, as a server's.
                assert before is not None
                gone = dict(before)
                gone["metadata"] = {**before.get("metadata", {}), "resourceVersion": stamp}
                self._changes.append(_Change(self._version, kind, gone, None))
                result: dict[str, Any] | None = gone
            else:
                doc.setdefault("metadata", {})["resourceVersion"] = stamp
                store[key] = doc
                self._changes.append(_Change(self._version, kind, before, doc))
                result = doc
            self.lock.notify_all()
        self._wake()
        return result

    def put(self, kind: objects.Kind, doc: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace an object (raw JSON, its ``metadata.name`` set), as another client
        would; a copy of it as stored."""
        body = copy.deepcopy(dict(doc))
        stored = self.store(kind, objects.key_of(body), body)
        assert stored is not None
        return copy.deepcopy(stored)

    def delete(self, kind: objects.Kind, key: str) -> None:
        """Delete an object (nothing if there is none)."""
        self.store(kind, key, None)

    def update(
        self,
        kind: objects.Kind,
        key: str,
        change: Callable[[dict[str, Any] | None], dict[str, Any] | None],
    ) -> dict[str, Any] | None:
        """Read the object under ``key`` (a copy, ``None`` when there is none), give it to
        ``change`` and store what it returns, in one step; nothing is written when ``change``
        returns the object unchanged. What is stored after (a copy)."""
        with self.lock:
            current = self.objects[kind].get(key)
            proposed = change(copy.deepcopy(current) if current is not None else None)
            if proposed == current:
                return copy.deepcopy(current) if current is not None else None
            stored = self.store(kind, key, proposed)
            return copy.deepcopy(stored) if proposed is not None and stored is not None else None

    def replay(self, kind: objects.Kind, doc: Mapping[str, Any]) -> None:
        """Deliver ``doc`` through the watches as ``MODIFIED`` with its own (old) resource
        version, without storing it: a watch that lags (tests of stale events)."""
        with self.lock:
            self._version += 1
            old = copy.deepcopy(dict(doc))
            self._changes.append(_Change(self._version, kind, old, old))
            self.lock.notify_all()
        self._wake()

    # -- the client side -----------------------------------------------------------------------
    def get(
        self, kind: objects.Kind, name: str, *, namespace: str | None = None
    ) -> dict[str, Any] | None:
        """The object (a copy), ``None`` when there is none (404)."""
        with self.lock:
            self.requests["get", kind] += 1
            doc = self.objects[kind].get(_key(kind, name, namespace))
            return copy.deepcopy(doc) if doc is not None else None

    def list(
        self,
        kind: objects.Kind,
        *,
        namespace: str | None = None,
        fields: Sequence[objects.FieldSelector] = (),
        labels: objects.LabelSelector | None = None,
    ) -> objects.Listed:
        """The objects selected (in the order they were first stored) and the version now."""
        match = selecting(namespace=namespace, fields=fields, labels=labels)
        with self.lock:
            self.requests["list", kind] += 1
            docs = tuple(copy.deepcopy(d) for d in self.objects[kind].values() if match(d))
            return objects.Listed(docs, str(self._version))

    def create(
        self, kind: objects.Kind, body: Mapping[str, Any], *, dry_run: bool = False
    ) -> dict[str, Any]:
        """Create an object; :class:`~migpilot.kube.errors.ConflictError` (409) when it exists.
        ``dry_run``: checked, not stored."""
        doc = copy.deepcopy(dict(body))
        key = objects.key_of(doc)
        with self.lock:
            self.requests["create", kind] += 1
            if key in self.objects[kind]:
                raise errors.ConflictError(f"409: {kind} {key} already exists")
            if dry_run:
                return doc
            stored = self.store(kind, key, doc)
            assert stored is not None
            return copy.deepcopy(stored)

    def replace(self, kind: objects.Kind, body: Mapping[str, Any]) -> dict[str, Any]:
        """Replace an object; its ``metadata.resourceVersion`` must be the stored one
        (:class:`~migpilot.kube.errors.ConflictError` otherwise), and it must exist (404)."""
        doc = copy.deepcopy(dict(body))
        key = objects.key_of(doc)
        with self.lock:
            self.requests["replace", kind] += 1
            current = self.objects[kind].get(key)
            if current is None:
                raise errors.KubeApiError(f"404: {kind} {key} not found")
            if current["metadata"].get("resourceVersion") != doc["metadata"].get("resourceVersion"):
                raise errors.ConflictError(f"409: {kind} {key} was modified")
            stored = self.store(kind, key, doc)
            assert stored is not None
            return copy.deepcopy(stored)

    def remove(self, kind: objects.Kind, name: str, *, namespace: str | None = None) -> bool:
        """Delete an object as a client does: ``True`` when it was there, ``False`` when it
        was not (404)."""
        with self.lock:
            self.requests["delete", kind] += 1
            return self.store(kind, _key(kind, name, namespace), None) is not None

    def watch(
        self,
        kind: objects.Kind,
        *,
        resource_version: str,
        namespace: str | None = None,
        fields: Sequence[objects.FieldSelector] = (),
        labels: objects.LabelSelector | None = None,
    ) -> Iterator[objects.WatchEvent]:
        """The changes of ``kind`` after ``resource_version`` as the selectors see them,
        blocking the thread between them, until :meth:`close`."""
        match = selecting(namespace=namespace, fields=fields, labels=labels)
        with self.lock:
            self.requests["watch", kind] += 1
        seen = int(resource_version or 0)
        while True:
            with self.lock:
                pending, seen, closed = self._pending(kind, seen)
                if not pending:
                    if closed:
                        return
                    self.lock.wait()
                    continue
            for change in pending:
                event = _event(change, match)
                if event is not None:
                    yield event

    async def watch_async(
        self,
        kind: objects.Kind,
        *,
        resource_version: str,
        namespace: str | None = None,
        fields: Sequence[objects.FieldSelector] = (),
        labels: objects.LabelSelector | None = None,
    ) -> AsyncIterator[objects.WatchEvent]:
        """:meth:`watch` for an event loop: awaits the next change instead of blocking."""
        match = selecting(namespace=namespace, fields=fields, labels=labels)
        loop = asyncio.get_running_loop()
        woken = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(woken.set)

        with self.lock:
            self.requests["watch", kind] += 1
            self._wakers.add(wake)
        try:
            seen = int(resource_version or 0)
            while True:
                woken.clear()
                with self.lock:
                    pending, seen, closed = self._pending(kind, seen)
                for change in pending:
                    event = _event(change, match)
                    if event is not None:
                        yield event
                if not pending:
                    if closed:
                        return
                    await woken.wait()
        finally:
            with self.lock:
                self._wakers.discard(wake)

    def _pending(self, kind: objects.Kind, seen: int) -> tuple[tuple[_Change, ...], int, bool]:
        """The changes of ``kind`` after ``seen``, the version seen after them, and whether the
        server is closed. Holds the lock."""
        if seen < self._compacted:
            raise errors.GoneError(f"too old resource version: {seen} ({self._compacted})")
        # Versions grow along the log: start past ``seen`` (a fleet's three watches wake at
        # every change of any kind; a scan from the start made that quadratic).
        start = bisect.bisect_right(self._changes, seen, key=_version_of)
        pending = tuple(c for c in self._changes[start:] if c.kind is kind)
        if pending:
            return pending, pending[-1].version, self._closed
        return (), self._version, self._closed  # nothing of this kind up to here

    def _wake(self) -> None:
        with self.lock:
            wakers = list(self._wakers)
        for wake in wakers:
            wake()


def _event(change: _Change, match: Match) -> objects.WatchEvent | None:
    """The change as a watch with selector ``match`` sees it, ``None`` when it does not."""
    was = change.before is not None and match(change.before)
    now = change.after is not None and match(change.after)
    if now and change.after is not None:
        type_ = objects.EventType.MODIFIED if was else objects.EventType.ADDED
        return objects.WatchEvent(type_, copy.deepcopy(change.after))
    if was and change.before is not None:
        return objects.WatchEvent(objects.EventType.DELETED, copy.deepcopy(change.before))
    return None


# --- patches, as the API server applies them ---------------------------------------------------


def merge_patch(doc: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 JSON merge patch of a copy of ``doc``: maps merge, ``None`` removes a key,
    anything else replaces."""
    out = copy.deepcopy(dict(doc))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping):
            inner = out.get(key)
            out[key] = merge_patch(inner if isinstance(inner, Mapping) else {}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_json_patch(doc: Mapping[str, Any], patch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """RFC 6902 ``add``, ``remove``, ``replace`` and ``test`` on a copy of ``doc`` (what the
    controller sends); raise :class:`~migpilot.kube.errors.KubeApiError` as the server would
    refuse."""
    out = copy.deepcopy(dict(doc))
    for op in patch:
        parts = [p.replace("~1", "/").replace("~0", "~") for p in str(op["path"]).split("/")[1:]]
        parent: Any = out
        for p in parts[:-1]:
            try:
                parent = parent[int(p)] if isinstance(parent, list) else parent[p]
            except (KeyError, IndexError, ValueError):
                raise errors.KubeApiError(f"422: path {op['path']} does not exist") from None
        last = parts[-1]
        kind = op["op"]
        try:
            if kind == "test":
                got = parent[int(last)] if isinstance(parent, list) else parent[last]
                if got != op["value"]:
                    raise errors.KubeApiError(f"422: test of {op['path']} failed")
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
                raise errors.KubeApiError(f"422: unsupported patch op {kind}")
        except (KeyError, IndexError, ValueError):
            raise errors.KubeApiError(f"422: path {op['path']} does not exist") from None
    return out
