"""The controller's Prometheus metrics, on a registry of its own.

What an admin watches: how long plans take, how many MIG pods wait and why (the reason of the
last Event the controller gave each), how often GPUs are reconfigured, which instances the agents
report created and destroyed (:mod:`migpilot.controller.turnover`) beside what the plans asked
for, how long a pod waits from its creation (and from being seen) to being
bound, and how well the GPUs are used (allocation ratio, fragmentation; for the cluster and per
node and GPU model, as :mod:`migpilot.planning.usage` defines them). A registry of its own, never
the global default, so several controllers (tests) can live in one process. This module defines
and updates the metrics; :mod:`migpilot.controller.running` calls it and serves
:meth:`exposition`. No clock: the caller gives the times.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import prometheus_client

from migpilot.controller import turnover
from migpilot.planning import plans, snapshot, usage

PLAN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: a plan of a few nodes (milliseconds) to thousands of GPUs (seconds)."""
BIND_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds from a pod first seen waiting to it bound (migpilot's target: 2 s)."""
CREATED_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Seconds from a pod's creation to it bound: as :data:`BIND_BUCKETS`, up to an hour (a pod
that waited for capacity)."""


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
        self.plans = prometheus_client.Counter(
            "migpilot_plans",
            "Plans carried out, by kind: full (every waiting pod replanned) or incremental "
            "(only the pods new since the last full replan, while capacity has not grown).",
            ["kind"],
            registry=r,
        )
        self.planner_seconds = prometheus_client.Counter(
            "migpilot_planner_seconds",
            "Seconds the planner took, summed over plans, by kind (as migpilot_plans).",
            ["kind"],
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
        self.node_allocation = prometheus_client.Gauge(
            "migpilot_node_allocation_ratio",
            "As migpilot_allocation_ratio, for the GPUs of one model on one node.",
            ["node", "model"],
            registry=r,
        )
        self.node_fragmentation = prometheus_client.Gauge(
            "migpilot_node_fragmentation_ratio",
            "As migpilot_fragmentation_ratio, for the GPUs of one model on one node.",
            ["node", "model"],
            registry=r,
        )
        self.pending_reason = prometheus_client.Gauge(
            "migpilot_pending_pods",
            "Pods not yet bound, by the reason of the last Event the controller gave each "
            "(MigWaiting, MigInstancesReserved, MigRequestUnservable, ...).",
            ["reason"],
            registry=r,
        )
        self.created_to_bound = prometheus_client.Histogram(
            "migpilot_pod_creation_to_bind_seconds",
            "From a MIG pod's creationTimestamp to it seen bound to a node, on the "
            "controller's wall clock.",
            buckets=CREATED_BUCKETS,
            registry=r,
        )
        self.instances_created = prometheus_client.Counter(
            "migpilot_instances_created",
            "Instances the agents reported as new in their GpuLayouts' status (a MIG instance "
            "with a UUID, or an MPS slice), by profile (MIG profile such as 1g.10gb, or "
            "mps-<N>gb for an MPS slice). Counted by the leader only.",
            ["profile"],
            registry=r,
        )
        self.instances_destroyed = prometheus_client.Counter(
            "migpilot_instances_destroyed",
            "Instances the agents stopped reporting in their GpuLayouts' status (destroyed), "
            "by profile. Counted by the leader only.",
            ["profile"],
            registry=r,
        )
        self.actions_written = prometheus_client.Counter(
            "migpilot_instance_actions_written",
            "Instances the controller's plans asked to create or destroy (op), counted when the "
            "GpuLayout spec is written, by profile: what was planned, whether or not the agent "
            "carried it out (compare migpilot_instances_created_total).",
            ["op", "profile"],
            registry=r,
        )
        self.free_instances = prometheus_client.Gauge(
            "migpilot_free_instances",
            "Free MIG instances (made, neither in use nor reserved), free MPS slices "
            "(profile mps-<N>gb) and free time-slicing replicas (profile replica) of the "
            "planned GPUs, by GPU model and profile.",
            ["model", "profile"],
            registry=r,
        )
        self.unmet_demand = prometheus_client.Gauge(
            "migpilot_unmet_demand",
            "Instances the pods the last plan could not place want, by GPU model and profile: "
            "what a new node of that model would have to hold for them. A pod counts under "
            "every model that could serve it, so the models' figures do not add up.",
            ["model", "profile"],
            registry=r,
        )
        self.scaled_out = prometheus_client.Counter(
            "migpilot_pods_scaled_out",
            "Gated pods no node could hold that the controller let go, unpinned, for a node "
            "autoscaler to see (--node-autoscaling). Counted by the leader only.",
            registry=r,
        )
        self._layout_keys: set[tuple[str, str]] = set()
        self._free_keys: set[tuple[str, str]] = set()
        self._demand_keys: set[tuple[str, str]] = set()
        self._reasons: set[str] = set()
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
        self.invalid_specs = prometheus_client.Counter(
            "migpilot_controller_invalid_specs",
            "GpuLayout specs the controller made but did not write: its own parser refuses them "
            "(a bug; the node is planned again on the next pass).",
            registry=r,
        )
        self.events_dropped = prometheus_client.Counter(
            "migpilot_controller_events_dropped",
            "Events not recorded because the backlog of Events to record was full.",
            registry=r,
        )

    def observe_cluster(self, snap: snapshot.Snapshot) -> None:
        """Set the allocation and fragmentation gauges from the planned nodes: the cluster's,
        and each (node, model)'s; a node no longer planned loses its series."""
        per = usage.by_node_and_model(snap.nodes)
        whole = usage.total(per.values())
        self.allocation.set(whole.allocation)
        self.fragmentation.set(whole.fragmentation)
        for node, model in self._layout_keys - set(per):
            self.node_allocation.remove(node, model)
            self.node_fragmentation.remove(node, model)
        for (node, model), slices in per.items():
            self.node_allocation.labels(node=node, model=model).set(slices.allocation)
            self.node_fragmentation.labels(node=node, model=model).set(slices.fragmentation)
        self._layout_keys = set(per)

    def observe_free(self, free: usage.Demand) -> None:
        """Set the free instances by model and profile; a pair with none left loses its
        series."""
        self._free_keys = _set_each(self.free_instances, free, self._free_keys)

    def observe_demand(self, demand: usage.Demand) -> None:
        """Set the unmet demand by model and profile; a pair no longer wanted loses its
        series."""
        self._demand_keys = _set_each(self.unmet_demand, demand, self._demand_keys)

    def observe_pending(self, reasons: Iterable[str]) -> None:
        """Set the pending pods by reason, one reason per pod not yet bound; a reason seen
        before and held by no pod now reads 0."""
        counts: dict[str, int] = {}
        for reason in reasons:
            counts[reason] = counts.get(reason, 0) + 1
        self._reasons |= set(counts)
        for reason in sorted(self._reasons):
            self.pending_reason.labels(reason=reason).set(counts.get(reason, 0))

    def observe_bound(self, *, seen_s: float | None, created_s: float | None) -> None:
        """A MIG pod bound: ``seen_s`` after the controller first saw it waiting and
        ``created_s`` after its creation (``None``: not known)."""
        if seen_s is not None:
            self.bind_seconds.observe(seen_s)
        if created_s is not None:
            self.created_to_bound.observe(max(0.0, created_s))  # clocks a little apart

    def observe_written(
        self,
        actions: Iterable[plans.Action],
        slice_actions: Iterable[plans.SliceAction] = (),
    ) -> None:
        """Count the instances a spec just written asks to create and destroy."""
        asked: Counter[tuple[str, str]] = Counter()
        for a in actions:
            asked[("create" if a.op is plans.Op.CREATE else "destroy", a.profile)] += 1
        for sa in slice_actions:
            op = "create" if sa.op is plans.SliceOp.CREATE else "destroy"
            asked[(op, turnover.slice_profile(sa.memory_gb))] += 1
        for (op, profile), n in sorted(asked.items()):
            self.actions_written.labels(op=op, profile=profile).inc(n)

    def observe_turnover(self, seen: turnover.Turnover) -> None:
        """Count the instances a node's agent reported created and destroyed."""
        _count(self.instances_created, seen.created)
        _count(self.instances_destroyed, seen.destroyed)

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return prometheus_client.generate_latest(self.registry)


def _count(counter: prometheus_client.Counter, by_profile: Mapping[str, int]) -> None:
    for profile, n in sorted(by_profile.items()):
        counter.labels(profile=profile).inc(n)


def _set_each(
    gauge: prometheus_client.Gauge, values: usage.Demand, before: set[tuple[str, str]]
) -> set[tuple[str, str]]:
    """Set ``gauge{model, profile}`` to each of ``values``, remove the pairs of ``before`` no
    longer there, and return the pairs now set."""
    for model, profile in before - set(values):
        gauge.remove(model, profile)
    for (model, profile), n in values.items():
        gauge.labels(model=model, profile=profile).set(n)
    return set(values)
