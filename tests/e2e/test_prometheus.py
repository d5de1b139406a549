"""migpilot's metrics as a real Prometheus scrapes them, checked with PromQL.

The scene of ``test_controller.py`` (webhook, one agent per KWOK node, the controller) with
every migpilot process serving ``/metrics`` on a loopback port (the webhook's plain HTTP, apart
from its TLS port), and a real Prometheus (``scripts/k8s-tools`` builds it) scraping them every
second. MIG pods are served; then PromQL checks that the series exist with their labels and the
values the scene implies: the controller's plans, binds, pending pods and allocation, the
agents' devices (compared with the GpuLayouts' status) and actions, the instances the agents
reported created and destroyed (a pod of two whole GPUs replaces a node's free instances), the
webhook's admission reviews (one per pod created), and ``up`` for every target. Checks of later
series (per-pod GPU use, per model and node) belong next to these:
``prometheus.wait(PROMQL, CHECK)``.
"""

from __future__ import annotations

import collections
import pathlib

import pytest
from lightkube.resources.core_v1 import Pod

from tests.kube import controlplane, tools
from tests.kube import prometheus as prom
from tests.kube.scenes import NODES, Scene

pytestmark = pytest.mark.kube

PODS = {"small-0": "1g.10gb", "small-1": "1g.10gb", "mid-0": "3g.40gb"}
SLICES = {"1g.10gb": 1, "3g.40gb": 3}
GPUS = 2 * len(NODES)  # emulated:<model>:x2 on each node
COMPUTE_SLICES = 7  # of an A100-80GB and of an H100-80GB


def _by(samples: list[prom.Sample], *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s[label] for label in labels): s.value for s in samples}


def _instances(scene: Scene) -> dict[str, dict[str, int]]:
    """Node -> MIG resource -> instances the node's GpuLayout status shows."""
    out: dict[str, dict[str, int]] = {}
    for node in NODES:
        lay = scene.layout(node)
        counts: collections.Counter[str] = collections.Counter()
        for g in lay.status.gpus if lay is not None and lay.status is not None else ():
            counts.update(f"nvidia.com/mig-{i.profile}" for i in g.instances)
        out[f"agent-{node}"] = dict(counts)
    return out


def _profiles(scene: Scene, node: str) -> collections.Counter[str]:
    """Profile -> MIG instances the node's GpuLayout status lists."""
    lay = scene.layout(node)
    gpus = lay.status.gpus if lay is not None and lay.status is not None else ()
    return collections.Counter(i.profile for g in gpus for i in g.instances)


def test_prometheus_scrapes_the_controller_the_webhook_and_agents(
    metrics_scene: Scene, prometheus: prom.Prometheus
) -> None:
    scene, client = metrics_scene, metrics_scene.client
    scene.start_controller("c1")
    prometheus.scrape(prom.targets_of(scene))
    up = prometheus.wait_up()
    assert _by(up, "job", "instance") == {
        ("agent", "agent-ctl-a100"): 1.0,
        ("agent", "agent-ctl-h100"): 1.0,
        ("controller", "controller-c1"): 1.0,
        ("webhook", "webhook"): 1.0,
    }
    scene.wait(scene.reported, "the agents' first status")

    for name, profile in PODS.items():
        client.create(scene.pod(name, profile))
    scene.wait(lambda: scene.running(set(PODS)), "the MIG pods Running")

    # The controller: leader, every pod bound and counted, none waiting, the GPUs' allocation.
    assert prometheus.value('migpilot_controller_leader{instance="controller-c1"}') == 1
    prometheus.wait(
        'sum(migpilot_pod_bind_seconds_count{job="controller"})',
        lambda got: got[0].value == len(PODS),
        what="every pod's bind observed",
    )
    prometheus.wait(
        'migpilot_pending_mig_pods{job="controller"}',
        lambda got: _by(got, "stage") == {("planning",): 0.0, ("reserved",): 0.0},
        what="no pod pending",
    )
    used = sum(SLICES[p] for p in PODS.values()) / (GPUS * COMPUTE_SLICES)
    prometheus.wait(
        "migpilot_allocation_ratio",
        lambda got: len(got) == 1 and got[0].value == pytest.approx(used),
        what=f"allocation {used:.3f}",
    )
    assert prometheus.value("migpilot_plan_duration_seconds_count") >= 1

    # The webhook: the apiserver sent it one review per pod created (its match conditions pass
    # MIG pods only), each answered (gated while the controller leads, else let through) and
    # timed; none malformed, none unanswered.
    reviews = 'migpilot_webhook_requests_total{job="webhook", path="/mutate-pods"'
    prometheus.wait(
        f"sum({reviews}}}) > 0",
        lambda got: [s.value for s in got] == [len(PODS)],
        what="one admission review per pod",
    )
    answered = prometheus.value(f'sum({reviews}, outcome=~"patched|allowed"}})')
    assert answered == len(PODS)
    timed = 'migpilot_webhook_request_duration_seconds_count{job="webhook", path="/mutate-pods"}'
    assert prometheus.value(timed) == len(PODS)
    assert prometheus.value('up{job="webhook"}') == 1
    assert prometheus.value("migpilot_webhook_connections_refused_total") == 0
    assert prometheus.value("migpilot_reconfigurations_total") >= 1
    # A histogram's buckets come with their le label, +Inf holding the count.
    buckets = prometheus.query('migpilot_pod_bind_seconds_bucket{le="+Inf"}')
    assert [s.value for s in buckets] == [len(PODS)]

    # The agents: the devices they advertise are the instances their GpuLayouts show, and
    # each instance was created by one successful action.
    want = _instances(scene)
    assert sum(sum(v.values()) for v in want.values()) >= len(PODS)
    devices = prometheus.wait(
        'migpilot_devices{job="agent", health="Healthy"} > 0',
        lambda got: (
            {
                i: {r: int(v) for (j, r), v in _by(got, "instance", "resource").items() if j == i}
                for i in want
            }
            == want
        ),
        what=f"the agents' devices {want}",
    )
    assert {s["__name__"] for s in devices} == {"migpilot_devices"}
    created = prometheus.query(
        'sum by (instance) (migpilot_reconcile_actions_total{op="create", outcome="done"})'
    )
    assert {i: v for (i,), v in _by(created, "instance").items() if v} == {
        i: float(sum(v.values())) for i, v in want.items() if v
    }
    assert not prometheus.query('migpilot_reconcile_actions_total{outcome="failed"} > 0')

    # Pods gone: nothing allocated any more, as Prometheus sees it.
    for name in PODS:
        client.delete(Pod, name, namespace=scene.namespace, grace_period=0)
    prometheus.wait(
        "migpilot_allocation_ratio == 0", what="allocation back to 0 with the pods deleted"
    )

    # A pod that needs both GPUs of a node whole, on the node that holds the most instances
    # (all free now): the agent destroys them for it. The controller counts what the agents
    # reported: every instance made since their first report, and those destroyed.
    held = {node: _profiles(scene, node) for node in NODES}
    made: collections.Counter[str] = collections.Counter()
    for profiles in held.values():
        made.update(profiles)
    full = max(held, key=lambda node: held[node].total())
    whole = scene.pod("whole", "7g.80gb", count=2)
    assert whole.spec is not None
    whole.spec.nodeSelector = {"kubernetes.io/hostname": full}
    client.create(whole)
    scene.wait(lambda: scene.running({"whole"}), f"the pod of two 7g.80gb Running on {full}")
    scene.wait(lambda: _profiles(scene, full) == {"7g.80gb": 2}, f"{full} holding two 7g.80gb")
    prometheus.wait(
        'sum by (profile) (migpilot_instances_destroyed_total{job="controller"})',
        lambda got: _by(got, "profile") == {(k,): float(n) for k, n in held[full].items()},
        what=f"the instances destroyed on {full}: {dict(held[full])}",
    )
    made["7g.80gb"] += 2
    prometheus.wait(
        'sum by (profile) (migpilot_instances_created_total{job="controller"})',
        lambda got: _by(got, "profile") == {(k,): float(n) for k, n in made.items()},
        what=f"the instances created: {dict(made)}",
    )
    assert prometheus.value('sum(migpilot_instances_destroyed_total{job="controller"})') > 0

    # A target that stops is seen down.
    controlplane.stop_components([scene.agents["ctl-h100"]])
    prometheus.wait(
        'up{instance="agent-ctl-h100"} == 0', what="the stopped agent's target down", timeout=30
    )
    assert prometheus.value('up{instance="agent-ctl-a100"}') == 1


def test_a_query_prometheus_refuses_fails_at_once_not_by_a_timeout(
    tmp_path: pathlib.Path,
) -> None:
    with prom.Prometheus.start(tools.locate().prometheus, tmp_path) as prometheus:
        assert prometheus.query("vector(1)")[0].value == 1
        assert prometheus.query("up") == []  # no targets
        with pytest.raises(prom.PromQLError, match="parse"):
            prometheus.query("sum(up")
        # A PromQLError, not the AssertionError of a timeout.
        with pytest.raises(prom.PromQLError, match="range vector"):
            prometheus.wait("rate(up)", timeout=30)
