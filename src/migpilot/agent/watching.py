"""List then watch a set of Kubernetes objects, for as long as the agent runs.

The simulated kubelet follows the pods bound to its node(s), and the fleet of simulated agents
follows every GpuLayout and the Nodes it runs; each is the same loop that
:meth:`following.GpuLayoutSource.follow` runs for one GpuLayout: list (the callback gets every
object), watch from the list's version (the callback gets each event), list again when the
watch expires (410 Gone) or the server fails, after :data:`RETRY_S` seconds for a failure.

A shell module: it talks to the API only through callables over :class:`~kubeapi.NodeApi`;
never imports a Kubernetes client (lightkube) nor gRPC (import-linter contracts).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from migpilot.agent import kubeapi

_log = logging.getLogger(__name__)

RETRY_S = 2.0
"""Seconds to wait before listing again after the API server failed."""


def follow(
    *,
    what: str,
    lister: Callable[[], kubeapi.ListedAll],
    watcher: Callable[[str], Iterator[kubeapi.WatchEvent]],
    listed: Callable[[Sequence[Mapping[str, Any]]], None],
    changed: Callable[[kubeapi.WatchEvent], None],
    stop: threading.Event,
    retry_s: float = RETRY_S,
) -> None:
    """List and watch until ``stop`` is set (run it in a thread).

    ``listed`` gets every object after each list (it replaces what was known), ``changed`` each
    watch event; neither may raise. ``watcher`` takes the resource version to watch from.
    """
    while not stop.is_set():
        try:
            found = lister()
            listed(found.documents)
            for event in watcher(found.resource_version):
                changed(event)
                if stop.is_set():
                    return
        except kubeapi.GoneError:
            _log.info("%s: watch expired (410 Gone), listing again", what)
            continue
        except kubeapi.KubeApiError as err:
            _log.warning("%s: %s; listing again in %.0f s", what, err, retry_s)
        stop.wait(retry_s)
