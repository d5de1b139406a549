"""Who wrote the GpuLayouts, as the API server tells it: every controller write, from a watch.

Why it exists: "two controllers never both act" must be a fact on the API server, not a log
line. Each controller spec write records its writer in the annotations ``migpilot.io/leader``
and ``migpilot.io/leader-term`` (all controllers share one field manager); a watch on the
GpuLayouts delivers every version of every object, so a version whose ``generation`` or writer
annotations differ from the one before is one controller write, and the annotation says whose.
Agents write only the status subresource, which changes neither.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2
import lightkube

from migpilot.api import gpulayouts as gl
from tests.kube import controlplane, crds


@dataclass(frozen=True, slots=True)
class Write:
    """One controller write of a GpuLayout, as the watch delivered it."""

    node: str
    version: str
    """The object's ``resourceVersion`` after the write."""
    generation: int
    leader: str
    term: str
    seen: float
    """The test's monotonic clock when the watch delivered it."""


def _writer(doc: dict[str, Any]) -> tuple[int, str, str]:
    meta = doc.get("metadata") or {}
    notes = meta.get("annotations") or {}
    return (
        int(meta.get("generation") or 0),
        str(notes.get(gl.LEADER_ANNOTATION, "")),
        str(notes.get(gl.TERM_ANNOTATION, "")),
    )


class Writes:
    """Collects the controller writes of the GpuLayouts ``nodes`` from now on (a watch in a
    thread with its own client). Use as a context manager."""

    def __init__(self, kubeconfig: Path, nodes: Iterable[str]) -> None:
        self._nodes = set(nodes)
        self._client = controlplane.client_for(kubeconfig)
        self._lock = threading.Lock()
        self._writes: list[Write] = []
        self._last: dict[str, tuple[int, str, str]] = {}
        listed = self._client.list(crds.GpuLayout)
        for obj in listed:
            doc = obj.to_dict()
            name = doc["metadata"]["name"]
            if name in self._nodes:
                self._last[name] = _writer(doc)
        self._version = str(listed.resourceVersion)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> Writes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._client.close()  # ends the watch's request
        self._thread.join(timeout=10)

    def _watch(self) -> None:
        try:
            for type_, obj in self._client.watch(
                crds.GpuLayout, resource_version=self._version, server_timeout=600
            ):
                doc = obj.to_dict()
                name = doc["metadata"]["name"]
                if name not in self._nodes or type_ == "DELETED":
                    continue
                now = _writer(doc)
                with self._lock:
                    if now != self._last.get(name):
                        self._writes.append(
                            Write(
                                node=name,
                                version=str(doc["metadata"]["resourceVersion"]),
                                generation=now[0],
                                leader=now[1],
                                term=now[2],
                                seen=time.monotonic(),
                            )
                        )
                    self._last[name] = now
        except (httpx2.HTTPError, lightkube.ApiError, RuntimeError) as err:
            self._error = err

    def all(self) -> list[Write]:
        """Every write so far, in the order the API server made them."""
        with self._lock:
            return list(self._writes)

    def by(self, leader: str) -> list[Write]:
        return [w for w in self.all() if w.leader == leader]

    def leaders(self) -> set[str]:
        return {w.leader for w in self.all()}

    def alive(self) -> bool:
        """The watch still runs (a dead watch would make "no write" mean nothing)."""
        return self._thread.is_alive() and self._error is None
