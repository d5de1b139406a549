"""Gating whole-GPU pods while a node is labelled for dynamic MIG mode (``docs/migmode.md``).

The controller writes on its Lease whether some node is labelled
``migpilot.io/mig-mode=dynamic``; the webhook gates ``nvidia.com/gpu: N`` pods only then (and
only while the Lease is fresh); the loop's step lets a gated whole-GPU pod go at once, unpinned
(``MigWholeGpuElsewhere``), when no dynamic node could ever serve it, when migpilot cannot read
it, or when a node that is not dynamic has free ``nvidia.com/gpu`` for it now; otherwise it is
planned, reserved and pinned to its reserved GPU's node.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import pytest

from migpilot.api import gpulayouts as gl
from migpilot.api import leases
from migpilot.controller import observing, pinning, running
from migpilot.kube import objects as kubeobjects
from migpilot.planning import control, fast, options
from migpilot.webhook import admission
from migpilot.webhook import leases as webhook_leases
from tests.unit.test_controller_leading import _Api, _Clock, _run, _until

H100 = "h100-80gb"
PLANNER = functools.partial(fast.plan, opts=options.Options())
EPOCH = 1_800_000_000.0
DYNAMIC = {"migpilot.io/mig-mode": "dynamic"}


# --------------------------------------------------------------------------- the Lease


def test_the_lease_says_dynamic_only_when_the_holder_wrote_so() -> None:
    plain = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=EPOCH)
    said = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=EPOCH, dynamic_mig=True)
    assert plain is not None and said is not None
    assert "annotations" not in plain["metadata"]  # without a dynamic node: as before
    assert said["metadata"]["annotations"] == {leases.DYNAMIC_MIG_ANNOTATION: "true"}
    assert leases.dynamic_mig(said) and not leases.dynamic_mig(plain)
    # Renewed without it: gone (the holder writes what it sees at each renewal).
    renewed = leases.claim(said, observed=None, identity="c0", now=0.0, stamp=EPOCH + 2)
    assert renewed is not None and not leases.dynamic_mig(renewed)
    for bad in (
        {},
        {"metadata": []},
        {"metadata": {"annotations": "x"}},
        {"metadata": {"annotations": {leases.DYNAMIC_MIG_ANNOTATION: "yes"}}},
    ):
        assert not leases.dynamic_mig(bad)
    released = leases.release(said, identity="c0", stamp=EPOCH + 3)
    assert released is not None and not leases.dynamic_mig(released)


class _Source:
    def __init__(self, lease: Mapping[str, Any]) -> None:
        self.lease = lease

    def read(self) -> Mapping[str, Any]:
        return self.lease


def test_the_webhook_reads_dynamic_only_from_a_fresh_lease() -> None:
    said = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=EPOCH, dynamic_mig=True)
    assert said is not None
    now = [EPOCH + 1.0]
    freshness = webhook_leases.Freshness(_Source(said), cache_s=0.0, clock=lambda: now[0])
    assert freshness.state() == webhook_leases.LeaseState(fresh=True, dynamic_mig=True)
    now[0] = EPOCH + leases.DURATION_S + 1.0  # the controller died: nothing is gated
    assert freshness.state() == webhook_leases.LeaseState(fresh=False, dynamic_mig=False)
    plain = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=EPOCH)
    assert plain is not None
    now[0] = EPOCH + 1.0
    fresh_plain = webhook_leases.Freshness(_Source(plain), cache_s=0.0, clock=lambda: now[0])
    assert fresh_plain.state() == webhook_leases.LeaseState(fresh=True, dynamic_mig=False)


# --------------------------------------------------------------------------- the webhook


def _review(containers: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", **meta},
        "spec": {"containers": containers},
    }
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": "ns",
            "object": pod,
        },
    }


def _asking(**amounts: str) -> list[dict[str, Any]]:
    return [{"name": "c", "image": "x", "resources": {"limits": amounts}}]


WHOLE = _asking(**{"nvidia.com/gpu": "2"})


def test_a_whole_gpu_pod_is_gated_only_with_a_dynamic_node_and_a_fresh_lease() -> None:
    gated = admission.decide(_review(WHOLE), lease_fresh=True, gate_whole=True)
    assert gated.outcome is admission.Outcome.GATED_WHOLE
    assert [op["path"] for op in gated.patch] == ["/spec/schedulingGates", "/metadata/labels"]
    assert gated.patch[1]["value"] == {admission.GATED_LABEL: "true"}
    # No dynamic node (today): untouched.
    today = admission.decide(_review(WHOLE), lease_fresh=True)
    assert today.outcome is admission.Outcome.NO_MIG_REQUEST and today.patch == ()
    # The controller down: its Lease stale, nothing gated, dynamic node or not.
    stale = admission.decide(_review(WHOLE), lease_fresh=False, gate_whole=True)
    assert stale.outcome is admission.Outcome.NO_MIG_REQUEST and stale.patch == ()


@pytest.mark.parametrize(
    ("containers", "annotations", "outcome"),
    [
        (_asking(**{"nvidia.com/gpu": "0"}), {}, admission.Outcome.NO_MIG_REQUEST),
        (_asking(cpu="1"), {}, admission.Outcome.NO_MIG_REQUEST),
        (_asking(**{"nvidia.com/gpu": "lots"}), {}, admission.Outcome.NO_MIG_REQUEST),
        # Unified and MIG pods are gated as before, never as whole-GPU pods.
        (
            _asking(**{"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}),
            {},
            admission.Outcome.GATED,
        ),
        (
            _asking(**{"nvidia.com/mig-1g.10gb": "1", "nvidia.com/gpu": "1"}),
            {},
            admission.Outcome.GATED,
        ),
        # Another system's pod.
        (WHOLE, {"nvidia.com/vgpu-mode": "hami-core"}, admission.Outcome.OTHER_VGPU_MODE),
    ],
)
def test_only_whole_gpu_requests_are_gated_as_whole(
    containers: list[dict[str, Any]], annotations: dict[str, str], outcome: admission.Outcome
) -> None:
    got = admission.decide(
        _review(containers, annotations=annotations), lease_fresh=True, gate_whole=True
    )
    assert got.outcome is outcome


def test_an_init_container_asking_a_whole_gpu_is_gated_and_a_bound_pod_is_not() -> None:
    review = _review(_asking(cpu="1"))
    review["request"]["object"]["spec"]["initContainers"] = _asking(**{"nvidia.com/gpu": "1"})
    assert admission.decide(review, lease_fresh=True, gate_whole=True).outcome is (
        admission.Outcome.GATED_WHOLE
    )
    bound = _review(WHOLE)
    bound["request"]["object"]["spec"]["nodeName"] = "n"
    assert admission.decide(bound, lease_fresh=True, gate_whole=True).outcome is (
        admission.Outcome.BOUND
    )


# --------------------------------------------------------------------------- the step


def _node(name: str, labels: Mapping[str, str] = DYNAMIC, **alloc: Any) -> observing.NodeView:
    return observing.node_view(
        {
            "metadata": {
                "name": name,
                "uid": f"uid-{name}",
                "labels": {
                    "kubernetes.io/hostname": name,
                    "nvidia.com/mig.capable": "true",
                    **labels,
                },
            },
            "status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "allocatable": {"cpu": "32", "memory": "256Gi", **alloc},
            },
        }
    )


def _plain(name: str, gpus: int) -> observing.NodeView:
    """A GPU node migpilot does not plan (no MIG), advertising ``gpus`` whole GPUs."""
    return observing.node_view(
        {
            "metadata": {"name": name, "uid": f"uid-{name}", "labels": {"gpu": "whole"}},
            "status": {
                "conditions": [{"type": "Ready", "status": "True"}],
                "allocatable": {"cpu": "32", "memory": "256Gi", "nvidia.com/gpu": str(gpus)},
            },
        }
    )


def _pod(
    name: str, gpus: int, *, gated: bool = True, node: str | None = None, **spec: Any
) -> observing.PodView:
    body: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}],
        **spec,
    }
    status: dict[str, Any] = {"phase": "Pending"}
    if node is not None:
        body["nodeName"] = node
    elif gated:
        body["schedulingGates"] = [{"name": observing.GATE}]
    else:
        status["conditions"] = [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
        ]
    return observing.pod_view(
        {
            "metadata": {
                "name": name,
                "namespace": "ns",
                "uid": f"uid-{name}",
                "creationTimestamp": f"2026-01-01T00:00:0{len(name)}Z",
            },
            "spec": body,
            "status": status,
        }
    )


def _layout(name: str) -> gl.GpuLayout:
    """Two idle H100s in MIG mode."""
    return gl.GpuLayout(
        name,
        gl.LayoutSpec((gl.GpuSpec(0, H100, ()), gl.GpuSpec(1, H100, ()))),
        gl.LayoutStatus(
            1,
            tuple(
                gl.GpuStatus(i, H100, f"GPU-{name}-{i}", (), mig_mode=gl.MigModeStatus(True, True))
                for i in (0, 1)
            ),
        ),
    )


def _step(
    pods: list[observing.PodView], nodes: list[observing.NodeView]
) -> tuple[observing.Observed, control.Decision]:
    observed = observing.observe(
        pods=pods,
        nodes=nodes,
        layouts_by_node={n.name: _layout(n.name) for n in nodes if n.mig_capable},
    )
    decision = control.reconcile(
        pinning.to_control(observed, changed=True),
        control.Memory(),
        now=0.0,
        settings=control.Settings(batch_window_s=0.0),
        planner=PLANNER,
    )
    return observed, decision


def _elsewhere(decision: control.Decision) -> dict[str, str]:
    assert all(j.verdict is control.Verdict.ELSEWHERE for j in decision.elsewhere)
    return {j.pod: j.reason for j in decision.elsewhere}


def test_a_gated_whole_gpu_pod_a_dynamic_node_can_serve_is_planned_there() -> None:
    _, decision = _step([_pod("w", 1)], [_node("dyn"), _node("mig", {})])
    assert decision.elsewhere == ()
    assert decision.plan is not None
    (placed,) = decision.plan.placements
    assert (placed.pod, placed.node, len(placed.gpus)) == ("ns/w", "dyn", 1)


def test_a_gated_whole_gpu_pod_no_dynamic_node_can_serve_is_let_go_at_once() -> None:
    # The label was removed (or the only dynamic node is not planned): nothing can serve it.
    _, none = _step([_pod("w", 1)], [_node("mig", {})])
    assert "no node labelled migpilot.io/mig-mode=dynamic is planned" in _elsewhere(none)["ns/w"]
    assert none.plan is None
    # More GPUs than any dynamic node has.
    _, big = _step([_pod("w", 3)], [_node("dyn")])
    assert "asks for 3 GPUs and the dynamic nodes that admit it have 2" in _elsewhere(big)["ns/w"]
    # No dynamic node admits it.
    _, away = _step([_pod("w", 1, nodeSelector={"gpu": "whole"})], [_node("dyn")])
    assert "no dynamic node admits it (nodeSelector gpu=whole" in _elsewhere(away)["ns/w"]
    # More memory than the dynamic node has at all.
    heavy = _pod("w", 1)
    heavy = observing.pod_view(
        {
            "metadata": {"name": "w", "namespace": "ns", "uid": "u"},
            "spec": {
                "schedulingGates": [{"name": observing.GATE}],
                "containers": [
                    {"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1", "memory": "1Ti"}}}
                ],
            },
            "status": {"phase": "Pending"},
        }
    )
    _, cramped = _step([heavy], [_node("dyn")])
    assert "CPU and memory" in _elsewhere(cramped)["ns/w"]


def test_a_free_whole_gpu_on_a_node_that_is_not_dynamic_lets_the_pod_go_rather_than_switch() -> (
    None
):
    # Two gated pods, one free whole GPU on a plain node: the first goes there, the second is
    # planned on the dynamic node (its GPU switched out of MIG).
    _, decision = _step([_pod("w", 1), _pod("w2", 1)], [_node("dyn"), _plain("gpu", 1)])
    assert _elsewhere(decision) == {
        "ns/w": "node gpu has 1 free nvidia.com/gpu for it now; left to kube-scheduler rather "
        "than switching a GPU out of MIG"
    }
    assert decision.plan is not None
    assert [(p.pod, p.node) for p in decision.plan.placements] == [("ns/w2", "dyn")]
    # The plain node's GPU already taken by a bound pod: both are planned on the dynamic node.
    taken = [_pod("w", 1), _pod("w2", 1), _pod("held", 1, node="gpu")]
    _, busy = _step(taken, [_node("dyn"), _plain("gpu", 1)])
    assert busy.elsewhere == ()
    assert busy.plan is not None and {p.node for p in busy.plan.placements} == {"dyn"}
    # A MIG node's nvidia.com/gpu is migpilot's unified instances: not a whole GPU to go to.
    _, unified = _step([_pod("w", 1)], [_node("dyn"), _node("mig", {}, **{"nvidia.com/gpu": 7})])
    assert unified.elsewhere == ()


def test_a_whole_gpu_pod_kube_scheduler_gave_up_on_is_never_let_go_again() -> None:
    # Not gated: planned on the dynamic node, or (none) left to kube-scheduler as today.
    _, planned = _step([_pod("w", 1, gated=False)], [_node("dyn")])
    assert planned.elsewhere == () and planned.plan is not None
    observed, today = _step([_pod("w", 1, gated=False)], [_node("mig", {})])
    assert observed.snapshot.whole_pods == () and today.elsewhere == () and today.plan is None


def test_a_gated_whole_gpu_pod_migpilot_cannot_read_is_let_go() -> None:
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "k", "operator": "Bogus", "values": ["v"]}]}
                ]
            }
        }
    }
    pod = _pod("w", 1, affinity=affinity)
    assert pod.whole_pod is None and pod.whole_problem is not None
    _, decision = _step([pod], [_node("dyn")])
    assert _elsewhere(decision)["ns/w"].startswith("migpilot cannot plan it (")


# --------------------------------------------------------------------------- the loop


def _raw_node(name: str, labels: Mapping[str, str]) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"nvidia.com/mig.capable": "true", **labels},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {"cpu": "32", "memory": "256Gi"},
        },
    }


def test_the_controller_writes_dynamic_on_its_lease_and_lets_go_what_no_node_serves() -> None:
    api = _Api()
    key = f"{leases.NAMESPACE}/{leases.NAME}"

    async def body(api: _Api, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _raw_node("n", {}))
        await _until("the Lease", lambda: key in api.leases)
        await _until("leading", lambda: controller.leading)
        assert not leases.dynamic_mig(api.leases[key])
        await api.put(kubeobjects.Kind.NODES, _raw_node("n", DYNAMIC))
        await _until("dynamic on the Lease", lambda: leases.dynamic_mig(api.leases[key]))
        await api.put(kubeobjects.Kind.NODES, _raw_node("n", {}))
        await _until("dynamic gone", lambda: not leases.dynamic_mig(api.leases[key]))
        # A whole-GPU pod gated while the label was there: no dynamic node now, let go.
        pod = {
            "metadata": {
                "name": "w",
                "namespace": "ns",
                "uid": "uid-w",
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {
                "containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": "1"}}}],
                "schedulingGates": [{"name": observing.GATE}],
            },
            "status": {"phase": "Pending"},
        }
        await api.put(kubeobjects.Kind.PODS, pod)
        await _until(
            "the pod let go",
            lambda: not api.objects[kubeobjects.Kind.PODS]["ns/w"]["spec"].get("schedulingGates"),
        )
        await _until("the event", lambda: any(e.name == "w" for e in api.events))
        (event,) = [e for e in api.events if e.name == "w"]
        assert event.reason == "MigWholeGpuElsewhere"
        assert "no node labelled migpilot.io/mig-mode=dynamic" in event.message
        got = api.objects[kubeobjects.Kind.PODS]["ns/w"]["spec"]
        assert "affinity" not in got  # unpinned

    _run(body, api=api, clock=_Clock(1000.0))
