"""The node agent's Prometheus metrics, on a registry of its own.

The figures nobody else publishes for MIG: how long a reconfiguration takes, how many actions
were done, refused (in use) or failed, and how many devices of each resource are healthy. The
metrics live on a :class:`prometheus_client.CollectorRegistry` created here, never the global
default, so several agents (tests, the simulator) can live in one process. This module defines
and updates the metrics; others call :class:`AgentMetrics`' methods. Serving them over HTTP is
``agent.running.MetricsServer``'s job (through :mod:`migpilot.probes`).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import prometheus_client
from prometheus_client import core, registry

from migpilot.agent import usage

RECONFIGURATION_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
"""Seconds: from one instance created on an idle GPU (~0.1 s) to mig-parted's minutes."""


class AgentMetrics:
    """The agent's metrics on their own registry."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self._reconfiguration = prometheus_client.Histogram(
            "migpilot_reconfiguration_duration_seconds",
            "Time from the start of a reconciliation that changed MIG instances to its end.",
            buckets=RECONFIGURATION_BUCKETS,
            registry=self.registry,
        )
        self._actions = prometheus_client.Counter(
            "migpilot_reconcile_actions",
            "MIG actions attempted by the reconciler, by operation and outcome.",
            ["op", "outcome"],
            registry=self.registry,
        )
        self._devices = prometheus_client.Gauge(
            "migpilot_devices",
            "Devices advertised to the kubelet, by resource name and health.",
            ["resource", "health"],
            registry=self.registry,
        )
        self._lock = threading.Lock()
        self._device_labels: set[tuple[str, str]] = set()
        self._usage = UsageCollector()
        self.registry.register(self._usage)

    def set_usage(self, rows: tuple[usage.Row, ...]) -> None:
        """Replace the per-device, per-GPU and layout series (a sampling pass's rows): a row
        not given again is gone from the next scrape."""
        self._usage.rows = rows

    def observe_reconfiguration(self, seconds: float) -> None:
        """Record the duration of one reconfiguration."""
        self._reconfiguration.observe(seconds)

    def count_action(self, *, op: str, outcome: str) -> None:
        """Count one action (``op`` create/destroy/repair, ``outcome`` done/refused/failed)."""
        self._actions.labels(op=op, outcome=outcome).inc()

    def set_devices(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Replace the device gauge: ``(resource, health) -> count``; absent pairs drop to 0."""
        with self._lock:
            for key in self._device_labels - set(counts):
                self._devices.labels(resource=key[0], health=key[1]).set(0)
            for (resource, health), n in counts.items():
                self._devices.labels(resource=resource, health=health).set(n)
            self._device_labels |= set(counts)

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)


class UsageCollector(registry.Collector):
    """Yields the last sampling pass's rows (:mod:`migpilot.agent.usage`) at each scrape, so a
    series that is not in the pass (a deleted pod's) is simply not served: no stale children
    as labelled gauges keep."""

    def __init__(self) -> None:
        self.rows: tuple[usage.Row, ...] = ()

    def describe(self) -> list[core.Metric]:
        """Nothing to check at registration: the names are this module's own."""
        return []

    def collect(self) -> list[core.Metric]:
        """One gauge family per series name, with the rows of the last pass."""
        rows = self.rows  # one read: a pass replaces the tuple whole
        out: list[core.Metric] = []
        for name, help_text in usage.HELP.items():
            mine = [r for r in rows if r.name == name]
            if not mine:
                continue
            family = core.GaugeMetricFamily(name, help_text, labels=[k for k, _ in mine[0].labels])
            for r in mine:
                family.add_metric([v for _, v in r.labels], r.value)
            out.append(family)
        return out
