"""List then watch a set of Kubernetes objects, for as long as the agent runs, and never die.

The simulated kubelet follows the pods bound to its node(s), the agent its GpuLayout, its Node
and its ConfigMap, and the fleet of simulated agents every GpuLayout and the Nodes it runs; each
is this one loop: list (the callback gets every object), watch from the list's version (the
callback gets each event), list again when the watch expires (410 Gone) or fails.

It never dies, as client-go's informers do not: an object a callback cannot take (a pod on the
node with ``nvidia.com/foo: 10e999999``, or a bug) is logged once and skipped, and any failure
of the list or the watch, expected (the API server refused, or could not be reached) or not (a
bug), is logged and the loop lists again after a wait that doubles at each failure in a row
(:data:`RETRY_S` up to :data:`RETRY_MAX_S`). While it is failing the watch is *down* in the
:class:`~migpilot.probes.Watches` it is given, and the agent's ``/healthz`` fails.

:func:`retrying` is the same patience for the agent's first reads: a transient error (429
``storage is (re)initializing`` right after the GpuLayout CRD is created, a 5xx, a refused
connection) is tried again with backoff instead of ending the agent.

A shell module: it talks to the API only through callables over :class:`~kubeapi.NodeApi`;
never imports a Kubernetes client (lightkube) nor gRPC (import-linter contracts).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from migpilot import probes
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects

_log = logging.getLogger(__name__)

RETRY_S = 2.0
"""Seconds to wait before listing again after a first failure (doubled at each one in a row)."""
RETRY_MAX_S = 30.0
"""The longest wait between two tries."""
START_PATIENCE_S = 300.0
"""How long :func:`retrying` keeps trying a transient error before it gives up."""

T = TypeVar("T")


def backoff(failures: int, *, first_s: float = RETRY_S, most_s: float = RETRY_MAX_S) -> float:
    """Seconds to wait after ``failures`` failures in a row (capped exponential)."""
    return float(min(most_s, first_s * 2 ** min(failures, 30)))


def follow(
    *,
    what: str,
    lister: Callable[[], objects.Listed],
    watcher: Callable[[str], Iterator[objects.WatchEvent]],
    listed: Callable[[Sequence[Mapping[str, Any]]], None],
    changed: Callable[[objects.WatchEvent], None],
    stop: threading.Event,
    retry_s: float = RETRY_S,
    retry_max_s: float = RETRY_MAX_S,
    health: probes.Watches | None = None,
) -> None:
    """List and watch until ``stop`` is set (run it in a thread; see the module).

    ``listed`` gets every object after each list (it replaces what was known), ``changed`` each
    watch event; what either raises is logged once and the object skipped. ``watcher`` takes
    the resource version to watch from. ``health``: where the watch is marked down while it
    fails."""
    failures = 0
    said: set[str] = set()
    while not stop.is_set():
        wait = retry_s  # a watch the server ended: list again soon, not at once
        try:
            found = lister()
            _guarded(what, said, listed, found.items)
            if health is not None:
                health.up(what)
            failures = 0
            for event in watcher(found.resource_version):
                _guarded(what, said, changed, event)
                if stop.is_set():
                    return
            stop.wait(wait)
            continue
        except kube_errors.GoneError:
            _log.info("%s: watch expired (410 Gone), listing again", what)
            continue
        except kube_errors.KubeApiError as err:
            wait = backoff(failures, first_s=retry_s, most_s=retry_max_s)
            _log.warning("%s: %s; listing again in %g s", what, err, wait)
            if health is not None:
                health.down(what, str(err))
        except Exception as err:  # a bug: logged, and the watch restarts (it never dies)
            wait = backoff(failures, first_s=retry_s, most_s=retry_max_s)
            _log.exception("%s: the watch failed unexpectedly; listing again in %g s", what, wait)
            if health is not None:
                health.down(what, f"{type(err).__name__}: {err}")
        failures += 1
        stop.wait(wait)


def _guarded(what: str, said: set[str], take: Callable[[T], None], arg: T) -> None:
    """``take(arg)``; what it raises is logged once per message and skipped."""
    try:
        take(arg)
    except Exception as err:
        why = f"{type(err).__name__}: {err}"
        if why not in said:
            said.add(why)
            _log.exception("%s: an object could not be taken, skipped: %s", what, why)


def retrying(
    call: Callable[[], T],
    *,
    what: str,
    patience_s: float = START_PATIENCE_S,
    retry_s: float = RETRY_S,
    retry_max_s: float = RETRY_MAX_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], object] = time.sleep,
) -> T:
    """``call()``, tried again with backoff while it fails with a transient
    :class:`~kube_errors.KubeApiError`, for at most ``patience_s`` seconds; any other error, or the
    last transient one, is raised."""
    deadline = clock() + patience_s
    failures = 0
    while True:
        try:
            return call()
        except kube_errors.KubeApiError as err:
            wait = backoff(failures, first_s=retry_s, most_s=retry_max_s)
            if not err.transient or clock() + wait > deadline:
                raise
            _log.warning("%s: %s; trying again in %g s", what, err, wait)
            failures += 1
            sleep(wait)
