"""Assemble and run the controller process: the API client, the metrics endpoint, the signals.

Why it exists: the CLI stays thin (flags in, one :func:`run` call) and tests or a demo can start
a whole controller in a thread with the same assembly. Serves ``/metrics`` (Prometheus text),
``/healthz`` (the loop went round lately) and ``/readyz`` (the watches have listed everything)
on ``metrics_port`` (:mod:`migpilot.probes`), and stops cleanly on SIGTERM or SIGINT, giving
the Lease up by letting it expire (a standby takes over within the Lease's duration).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from migpilot import errors, probes
from migpilot.controller import kube, kubeapi, metrics, running
from migpilot.kube import errors as kube_errors

_log = logging.getLogger("migpilot.controller")


@dataclass(frozen=True, slots=True)
class ServeSettings:
    """The process around the loop."""

    controller: running.Settings
    kubeconfig: Path | None = None
    """kubeconfig file; ``None``: the in-cluster service account. Default in-cluster."""
    metrics_port: int | None = 8080
    """Port of ``/metrics``, ``/healthz`` and ``/readyz``; ``None``: not served. Default 8080."""
    metrics_host: str = "0.0.0.0"
    """Address of ``/metrics``. Default all addresses."""


async def _check_setup(
    api: kubeapi.ControllerApi, settings: running.Settings, stop: asyncio.Event
) -> None:
    """Say a setup error once, at start, rather than a warning every renewal forever: a Lease
    namespace that does not exist is a :class:`~migpilot.errors.ConfigError` (exit 2) naming
    the flag. Transient API errors (429 while the API server starts, 5xx, no answer) are tried
    again with backoff, as the loop does later."""
    wait = settings.retry_s
    while not stop.is_set():
        try:
            found = await api.lease_namespace_exists(settings.lease_namespace, settings.lease_name)
        except kube_errors.KubeApiError as err:
            if not err.transient:
                raise
            _log.warning("checking the Lease's namespace failed, trying again in %g s: %s",
                         wait, err)  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=wait)
            wait = min(wait * 2, settings.retry_max_s)
            continue
        if not found:
            raise errors.ConfigError(
                f"the Lease's namespace {settings.lease_namespace!r} does not exist: create it, "
                "or set --lease-namespace to the namespace migpilot is installed in"
            )
        return


def run(settings: ServeSettings, *, stop: threading.Event | None = None) -> None:
    """Run the controller until SIGTERM/SIGINT (or ``stop``, from another thread)."""
    asyncio.run(_main(settings, stop))


async def _main(settings: ServeSettings, outer: threading.Event | None) -> None:
    api = kube.connect(settings.kubeconfig)
    figures = metrics.ControllerMetrics()
    controller = running.Controller(api, settings=settings.controller, metrics_=figures)
    server = None
    if settings.metrics_port is not None:
        server = probes.Endpoint(
            figures.registry,
            port=settings.metrics_port,
            address=settings.metrics_host,
            live=controller.not_healthy,
            ready=controller.not_ready,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    if outer is not None:
        threading.Thread(
            target=lambda: (outer.wait(), loop.call_soon_threadsafe(stop.set)),
            daemon=True,
            name="controller-stop",
        ).start()
    _log.info("controller %s starting", settings.controller.identity)
    try:
        await _check_setup(api, settings.controller, stop)
        await controller.run(stop)
    finally:
        await api.close()
        if server is not None:
            server.close()
        _log.info("controller %s stopped", settings.controller.identity)
