"""The controller's Prometheus metrics, on a registry of its own.

What an admin watches: how long plans take, how many MIG pods wait, how often GPUs are
reconfigured, how long a pod waits from being seen to being bound, and how well the GPUs are
used (allocation ratio, fragmentation). A registry of its own, never the global default, so
several controllers (tests) can live in one process. This module defines and updates the
metrics; :mod:`migpilot.controller.running` calls it and serves :meth:`exposition`.
"""

from __future__ import annotations

import prometheus_client

from migpilot.planning import snapshot

PLAN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: a plan of a few nodes (milliseconds) to thousands of GPUs (seconds)."""
BIND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds from a pod first seen waiting to it bound (migpilot's target: 2 s)."""


class ControllerMetrics:
    """The controller's metrics on their own registry."""

    def __init__(self) -> None:
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        r = self.registry
        self.plan_seconds = prometheus_client.Histogram(
            "migpilot_plan_duration_seconds",
            "Time the planner took for one plan.",
            buckets=PLAN_BUCKETS,
            registry=r,
        )
        self.pending = prometheus_client.Gauge(
            "migpilot_pending_mig_pods",
            "MIG pods waiting: to be planned, or for instances reserved for them.",
            ["stage"],
            registry=r,
        )
        self.reconfigurations = prometheus_client.Counter(
            "migpilot_reconfigurations",
            "GPUs whose layout a plan changed.",
            registry=r,
        )
        self.bind_seconds = prometheus_client.Histogram(
            "migpilot_pod_bind_seconds",
            "From a MIG pod first seen waiting by the controller to it seen bound to a node.",
            buckets=BIND_BUCKETS,
            registry=r,
        )
        self.allocation = prometheus_client.Gauge(
            "migpilot_allocation_ratio",
            "Compute slices of MIG instances in use or reserved over all compute slices of the "
            "planned GPUs.",
            registry=r,
        )
        self.fragmentation = prometheus_client.Gauge(
            "migpilot_fragmentation_ratio",
            "Free compute slices on GPUs that also hold instances in use, over all free compute "
            "slices: free capacity too scattered for large profiles.",
            registry=r,
        )
        self.leader = prometheus_client.Gauge(
            "migpilot_controller_leader",
            "1 while this controller holds the Lease and acts, else 0.",
            registry=r,
        )
        self.api_requests = prometheus_client.Counter(
            "migpilot_controller_api_requests",
            "Calls to the API server, by operation (lists and watch starts count once each).",
            ["operation"],
            registry=r,
        )
        self.api_errors = prometheus_client.Counter(
            "migpilot_controller_api_errors",
            "Calls to the API server that failed, by operation.",
            ["operation"],
            registry=r,
        )
        self.events_pending = prometheus_client.Gauge(
            "migpilot_controller_events_pending",
            "Events waiting to be recorded by the background writers.",
            registry=r,
        )
        self.events_dropped = prometheus_client.Counter(
            "migpilot_controller_events_dropped",
            "Events not recorded because the backlog of Events to record was full.",
            registry=r,
        )

    def observe_cluster(self, snap: snapshot.Snapshot) -> None:
        """Set the allocation and fragmentation gauges from the planned nodes."""
        total = used = free_total = free_scattered = 0
        for node in snap.nodes:
            for gpu in node.gpus:
                slices = gpu.model.compute_slices
                held = sum(
                    gpu.model.profile_named(i.profile).compute_slices
                    for i in gpu.instances
                    if i.used
                )
                total += slices
                used += held
                free_total += slices - held
                if held:
                    free_scattered += slices - held
        self.allocation.set(used / total if total else 0.0)
        self.fragmentation.set(free_scattered / free_total if free_total else 0.0)

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)
