"""The controller's view of pods with DRA claims: ResourceClaims and ResourceClaimTemplates are
watched, a waiting pod whose claims ask for migpilot's devices is read as the planner's pod
(kept to DRA nodes, and to the nodes of the model a claim names), and a pod whose claims the
planner cannot read, or whose claim or template is not there, is not planned and told why once.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from migpilot.api import gpulayouts_wire
from migpilot.controller import kubeapi, observing, running
from migpilot.kube import objects as kubeobjects
from migpilot.planning import snapshot
from tests.unit.test_controller_running import A100, _passes, _run, _until

TEMPLATES = {
    d["metadata"]["name"]: d
    for d in yaml.safe_load_all(
        (Path(__file__).parents[2] / "deploy/dra/claimtemplates.yaml").read_text()
    )
    if d
}
"""The shipped ResourceClaimTemplates, by name."""


def _template(name: str, namespace: str = "ns") -> dict[str, Any]:
    doc = copy.deepcopy(TEMPLATES[name])
    doc["metadata"]["namespace"] = namespace
    return doc


def _claim_doc(
    name: str, expression: str, *, device_class: str = "mig.migpilot.io"
) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns"},
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "r",
                        "exactly": {
                            "deviceClassName": device_class,
                            "selectors": [{"cel": {"expression": expression}}],
                        },
                    }
                ]
            }
        },
    }


def _dra_pod(
    name: str, *, template: str | None = None, claim: str | None = None, unschedulable: bool = True
) -> dict[str, Any]:
    """A pending pod with one claim; kube-scheduler found no node for it (the webhook does not
    gate DRA pods yet, so the controller sees it Unschedulable)."""
    entry: dict[str, Any] = {"name": "mig"}
    if template is not None:
        entry["resourceClaimTemplateName"] = template
    if claim is not None:
        entry["resourceClaimName"] = claim
    conditions = (
        [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]
        if unschedulable
        else []
    )
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {
            "resourceClaims": [entry],
            "containers": [
                {
                    "name": "c",
                    "resources": {"requests": {"cpu": "2"}, "claims": [{"name": "mig"}]},
                }
            ],
        },
        "status": {"phase": "Pending", "conditions": conditions},
    }


def _reads(*docs: dict[str, Any], template: bool) -> dict[str, observing.ClaimRead]:
    return {
        f"{d['metadata']['namespace']}/{d['metadata']['name']}": observing.claim_read(
            d, template=template
        )
        for d in docs
    }


def _dra_node(name: str, model: str = A100) -> tuple[observing.NodeView, Any]:
    node = observing.node_view(
        {
            "metadata": {
                "name": name,
                "uid": f"uid-{name}",
                "labels": {"kubernetes.io/hostname": name, "migpilot.io/mode": "dra"},
            },
            "status": {"conditions": [{"type": "Ready", "status": "True"}]},
        }
    )
    layout = gpulayouts_wire.parse(
        {
            "apiVersion": "migpilot.io/v1alpha1",
            "kind": "GpuLayout",
            "metadata": {"name": name},
            "spec": {"gpus": []},
            "status": {
                "observedGeneration": 1,
                "gpus": [{"index": 0, "model": model, "uuid": f"GPU-{name}", "instances": []}],
            },
        }
    )
    return node, layout


MODE_DRA = snapshot.Requirement("migpilot.io/mode", "In", ("dra",))


# --------------------------------------------------------------------------- pure


def test_claim_refs_name_claims_and_templates_in_the_pods_namespace() -> None:
    spec = {
        "resourceClaims": [
            {"name": "a", "resourceClaimTemplateName": "t"},
            {"name": "b", "resourceClaimName": "c"},
            {"name": "bad"},
        ]
    }
    assert observing.claim_refs(spec, namespace="ns") == (
        observing.ClaimRef("a", template="ns/t"),
        observing.ClaimRef("b", claim="ns/c"),
    )
    assert observing.claim_refs({"resourceClaims": "hostile"}, namespace="ns") == ()


def test_a_template_is_read_from_its_spec_spec_and_another_drivers_is_not_ours() -> None:
    read = observing.claim_read(_template("mig-1g-10gb"), template=True)
    assert read.ours and read.problem is None and read.spec is not None
    (request,) = read.spec.requests
    assert request.alternatives[0].profile == "1g.10gb"
    other = observing.claim_read(
        _claim_doc("x", "true", device_class="gpu.example.com"), template=False
    )
    assert not other.ours and other.problem is None
    unread = observing.claim_read(
        _claim_doc("y", 'device.attributes["mig.migpilot.io"].profile == "1g.10gb" || true'),
        template=False,
    )
    assert unread.ours and unread.spec is None
    assert unread.problem is not None and "'||'" in unread.problem
    assert "ResourceClaim ns/y" in unread.problem


def _observe(
    pods: list[dict[str, Any]],
    *,
    templates: dict[str, observing.ClaimRead] | None = None,
    claims: dict[str, observing.ClaimRead] | None = None,
    nodes: tuple[tuple[observing.NodeView, Any], ...] = (),
) -> observing.Observed:
    return observing.observe(
        pods=[observing.pod_view(p) for p in pods],
        nodes=[n for n, _ in nodes],
        layouts_by_node={n.name: layout for n, layout in nodes},
        claims=claims or {},
        templates=templates or {},
    )


def test_a_waiting_pod_with_a_profile_claim_is_a_planner_pod_kept_to_dra_nodes() -> None:
    observed = _observe(
        [_dra_pod("p", template="mig-1g-10gb")],
        templates=_reads(_template("mig-1g-10gb"), template=True),
    )
    (pod,) = observed.dra_pods
    assert pod.key == "ns/p"
    assert pod.mig == (snapshot.MigRequest("1g.10gb", 1),)
    assert pod.cpu_milli == 2000
    assert pod.affinity == ((MODE_DRA,),)
    # planned as a DRA pod (only DRA nodes serve it), nodes spread and GPUs packed by default
    assert observed.snapshot.pods == (pod,)
    assert pod.dra
    assert (pod.node_policy, pod.gpu_policy) == (snapshot.Policy.SPREAD, snapshot.Policy.BINPACK)
    assert dict(observed.dra_unplanned) == {}


def test_a_claim_by_memory_is_a_unified_request_and_own_affinity_is_kept() -> None:
    doc = _dra_pod("p", template="mig-20gi")
    doc["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                    {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                ]
            }
        }
    }
    observed = _observe([doc], templates=_reads(_template("mig-20gi"), template=True))
    (pod,) = observed.dra_pods
    assert pod.mig == ()
    assert pod.unified is not None
    assert [a.memory_mib for a in pod.unified.asks] == [20 * 1024]
    assert pod.affinity == (
        (snapshot.Requirement("zone", "In", ("a",)), MODE_DRA),
        (snapshot.Requirement("zone", "In", ("b",)), MODE_DRA),
    )


def test_a_claim_naming_a_model_keeps_the_pod_to_the_dra_nodes_of_that_model() -> None:
    expression = 'device.attributes["mig.migpilot.io"].model == "a100-80gb"'
    observed = _observe(
        [_dra_pod("p", claim="c")],
        claims=_reads(_claim_doc("c", expression), template=False),
        nodes=(_dra_node("d1"), _dra_node("d0"), _dra_node("h0", "NVIDIA H100 80GB HBM3")),
    )
    (pod,) = observed.dra_pods
    names = snapshot.Requirement("metadata.name", "In", ("d0", "d1"), field=True)
    assert pod.affinity == ((MODE_DRA, names),)
    # no DRA node of the model: planned nowhere, rather than anywhere
    alone = _observe(
        [_dra_pod("p", claim="c")],
        claims=_reads(_claim_doc("c", expression), template=False),
        nodes=(_dra_node("h0", "NVIDIA H100 80GB HBM3"),),
    )
    (pod,) = alone.dra_pods
    assert pod.affinity == (
        (MODE_DRA, snapshot.Requirement("metadata.name", "In", (), field=True)),
    )


def test_pods_that_are_not_planned_say_why() -> None:
    unread = _claim_doc("u", 'device.attributes["mig.migpilot.io"].serial == "x"')
    gated = _dra_pod("gated", template="nowhere", unschedulable=False)
    gated["spec"]["schedulingGates"] = [{"name": observing.GATE}]
    beside = _dra_pod("beside", template="mig-1g-10gb")
    beside["spec"]["resourceClaims"].append({"name": "x", "resourceClaimName": "nowhere"})
    observed = _observe(
        [
            gated,
            beside,
            # a claim not there, nothing else shows the pod is migpilot's: none of ours
            _dra_pod("unknown", template="nowhere"),
            _dra_pod("unread", claim="u"),
            _dra_pod("other", claim="o"),
            _dra_pod("bound-later", template="mig-1g-10gb", unschedulable=False),
        ],
        claims=_reads(
            unread, _claim_doc("o", "true", device_class="gpu.example.com"), template=False
        ),
        templates=_reads(_template("mig-1g-10gb"), template=True),
    )
    assert observed.dra_pods == ()
    why = dict(observed.dra_unplanned)
    assert set(why) == {"ns/gated", "ns/beside", "ns/unread"}  # another driver's: not ours
    assert "ResourceClaimTemplate ns/nowhere not found" in why["ns/gated"]
    assert why["ns/beside"] == "not planned: ResourceClaim ns/nowhere not found (yet)"
    # only what the claims say as they stand lets a pod go; a claim to come is waited for
    assert observed.dra_refused == {"ns/unread"}
    assert "left to kube-scheduler" in why["ns/unread"] and "serial" in why["ns/unread"]


def test_claims_the_planner_cannot_plan_together_are_not_planned() -> None:
    doc = _dra_pod("p", template="mig-1g-10gb")
    doc["spec"]["resourceClaims"].append({"name": "gpu", "resourceClaimName": "o"})
    observed = _observe(
        [doc],
        claims=_reads(_claim_doc("o", "true", device_class="gpu.example.com"), template=False),
        templates=_reads(_template("mig-1g-10gb"), template=True),
    )
    assert observed.dra_pods == ()
    assert "devices of other drivers" in observed.dra_unplanned["ns/p"]
    assert observed.dra_refused == {"ns/p"}


@pytest.mark.parametrize(
    ("resources", "named"),
    [
        ({"nvidia.com/mig-1g.10gb": "1"}, "1 x 1g.10gb"),
        ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "10000"}, "a GPU by memory"),
        ({"nvidia.com/gpu": "2"}, "2 whole GPU"),
    ],
)
def test_a_pod_asking_for_device_plugin_gpus_too_is_not_planned(
    resources: dict[str, str], named: str
) -> None:
    # No node serves both: planned onto a DRA node, kube-scheduler would find no
    # nvidia.com/* resource there, and the pin would hold the pod on a node it cannot fit.
    doc = _dra_pod("p", template="mig-1g-10gb")
    doc["spec"]["containers"][0]["resources"]["limits"] = resources
    observed = _observe([doc], templates=_reads(_template("mig-1g-10gb"), template=True))
    assert observed.dra_pods == ()
    assert observed.snapshot.pods == () and observed.snapshot.whole_pods == ()
    why = observed.dra_unplanned["ns/p"]
    assert named in why and "no node serves both" in why
    assert observed.dra_refused == {"ns/p"}


def test_an_affinity_the_planner_cannot_read_is_not_planned() -> None:
    doc = _dra_pod("p", template="mig-1g-10gb")
    field = {"key": "spec.unschedulable", "operator": "In", "values": ["false"]}
    doc["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [field]}]
            }
        }
    }
    observed = _observe([doc], templates=_reads(_template("mig-1g-10gb"), template=True))
    assert observed.dra_pods == ()
    assert observed.dra_unplanned["ns/p"].startswith("not planned (left to kube-scheduler): ")
    assert observed.dra_refused == {"ns/p"}


# --------------------------------------------------------------------------- the loop


def _events(api: kubeapi.InMemoryApi, pod: str) -> list[tuple[str, str]]:
    return [(e.reason, e.message) for e in api.events if e.name == pod]


def _not_planned(api: kubeapi.InMemoryApi, pod: str) -> list[tuple[str, str]]:
    return [e for e in _events(api, pod) if e[0] == "MigDraNotPlanned"]


def test_the_controller_watches_templates_and_claims_and_tells_once() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _template("mig-1g-10gb"))
        await api.put(kubeobjects.Kind.PODS, _dra_pod("good", template="mig-1g-10gb"))
        late = _dra_pod("late", claim="c", unschedulable=False)
        late["spec"]["schedulingGates"] = [{"name": observing.GATE}]  # as the webhook will
        await api.put(kubeobjects.Kind.PODS, late)
        await _until(
            "the good pod read",
            lambda: [p.key for p in controller.observe().dra_pods] == ["ns/good"],
        )
        await _until("late told", lambda: bool(_not_planned(api, "late")))
        await _passes(controller)
        ((reason, message),) = _not_planned(api, "late")  # once, however many passes
        assert reason == "MigDraNotPlanned" and "ResourceClaim ns/c not found" in message
        assert _not_planned(api, "good") == []
        # the claim comes, one the planner cannot read: told the new reason
        await api.put(
            kubeobjects.Kind.RESOURCECLAIMS,
            _claim_doc("c", 'device.attributes["mig.migpilot.io"].profile != "1g.10gb"'),
        )
        await _until("late told again", lambda: len(_not_planned(api, "late")) == 2)
        assert "left to kube-scheduler" in _not_planned(api, "late")[1][1]
        # ... and let go to kube-scheduler, which finds no node for it
        await _until("late let go", lambda: "schedulingGates" not in _pod_spec(api, "ns/late"))
        await api.put(kubeobjects.Kind.PODS, _dra_pod("late", claim="c"))
        # rewritten so the planner reads it: planned, and nothing more said
        await api.put(
            kubeobjects.Kind.RESOURCECLAIMS,
            _claim_doc("c", 'device.attributes["mig.migpilot.io"].profile == "2g.20gb"'),
        )
        await _until("both read", lambda: len(controller.observe().dra_pods) == 2)
        # the template deleted: nothing shows the ungated pod is migpilot's any more (its claim
        # may be another driver's): not planned, and not told
        await api.delete(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, "ns/mig-1g-10gb")
        await _until(
            "good dropped", lambda: [p.key for p in controller.observe().dra_pods] == ["ns/late"]
        )
        await _passes(controller)
        assert _not_planned(api, "good") == []
        assert len(_not_planned(api, "late")) == 2
        # planned (no DRA node here): told it waits, with the planner's reason in profiles
        ((_, waits),) = set(e for e in _events(api, "good") if e[0] == "MigWaiting")
        assert "MIG profile" in waits or "MIG placements" in waits
        assert [k for k, _ in api.pod_patches] == ["ns/late"]  # the one let go, nothing pinned

    _run(body)


def test_a_gated_pod_is_let_go_only_once_its_claims_will_not_be_planned() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        waits = _dra_pod("waits", claim="c", unschedulable=False)
        waits["spec"]["schedulingGates"] = [{"name": observing.GATE}]
        await api.put(kubeobjects.Kind.PODS, waits)
        await _until("told", lambda: bool(_events(api, "waits")))
        await _passes(controller)
        assert api.pod_patches == []  # its claim may yet come: kept
        await api.put(
            kubeobjects.Kind.RESOURCECLAIMS,
            _claim_doc("c", 'device.attributes["mig.migpilot.io"].profile == "1g.10gb" || true'),
        )
        await _until("let go", lambda: "schedulingGates" not in _pod_spec(api, "ns/waits"))
        assert [k for k, _ in api.pod_patches] == ["ns/waits"]
        assert "'||'" in _events(api, "waits")[-1][1]

    _run(body)


def _pod_spec(api: kubeapi.InMemoryApi, key: str) -> dict[str, Any]:
    spec: dict[str, Any] = api.objects[kubeobjects.Kind.PODS][key]["spec"]
    return spec
