"""The controller steers kube-scheduler on DRA nodes: DRA nodes are in the planner's snapshot
(their allocated claims' devices used instances), gated pods with claims of migpilot's devices
are planned on them only (never onto a device-plugin node, and device-plugin pods never onto
them), the target goes into the node's GpuLayout spec with nothing reserved, and each planned
pod is pinned to its node and ungated (``docs/dra.md``, "Steering kube-scheduler").

The test plays the agents (GpuLayout status) and kube-scheduler (claims' allocations); the
controller runs its real loop on ``kubeapi.InMemoryApi``.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from typing import Any

import pytest

from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import kubeapi, observing, pinning, running
from migpilot.kube import objects as kubeobjects
from migpilot.mig import catalog, dra
from migpilot.planning import constraints, draclaims, planners, snapshot
from tests.unit.test_controller_dra import _claim_doc, _dra_pod, _events, _template
from tests.unit.test_controller_running import A100, _Clock, _passes, _pod, _run, _until

LAYOUTS = kubeobjects.Kind.LAYOUTS
PODS = kubeobjects.Kind.PODS


def _node_doc(name: str, *, dra: bool) -> dict[str, Any]:
    labels = {"kubernetes.io/hostname": name, "nvidia.com/mig.capable": "true"}
    if dra:
        labels["migpilot.io/mode"] = "dra"
    return {
        "metadata": {"name": name, "uid": f"uid-{name}", "labels": labels},
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {"cpu": "32", "memory": "256Gi"},
        },
    }


def _layout_doc(name: str, instances: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "migpilot.io/v1alpha1",
        "kind": "GpuLayout",
        "metadata": {"name": name, "generation": 1},
        "spec": {"gpus": []},
        "status": {
            "observedGeneration": 1,
            "gpus": [
                {"index": 0, "model": A100, "uuid": f"GPU-{name}", "instances": instances or []}
            ],
        },
    }


async def _nodes(api: kubeapi.InMemoryApi, *names: str) -> None:
    """Nodes reported by their agents: ``d*`` in DRA mode, the others device-plugin nodes."""
    for name in names:
        await api.put(kubeobjects.Kind.NODES, _node_doc(name, dra=name.startswith("d")))
        await api.put(LAYOUTS, _layout_doc(name))


def _plan_listed(generation: int, *, listed: bool = True) -> dict[str, Any]:
    """The ``PlanListed`` condition an agent in DRA mode reports."""
    return {
        "type": "PlanListed",
        "status": "True" if listed else "False",
        "reason": "Listed" if listed else "NotListed",
        "message": "",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
        "observedGeneration": generation,
    }


async def _agent_acts(api: kubeapi.InMemoryApi, *nodes: str) -> None:
    """Each DRA node's agent acts on its spec as it stands: it lists the target's placements
    first, then reports the spec's generation acted on and that it listed them."""
    for node in nodes:
        doc = copy.deepcopy(api.objects[LAYOUTS][node])
        generation = doc["metadata"].get("generation", 0)
        doc["status"]["observedGeneration"] = generation
        doc["status"]["conditions"] = [_plan_listed(generation)]
        await api.put(LAYOUTS, doc)


async def _steered(api: kubeapi.InMemoryApi, key: str, *nodes: str) -> str:
    """Play the DRA nodes' agents until the pod is pinned and let go; its node."""

    async def acted() -> str | None:
        await _agent_acts(api, *nodes)
        await asyncio.sleep(0.05)
        return _pinned(api, key)

    for _ in range(100):
        found = await acted()
        if found is not None:
            return found
    raise AssertionError(f"{key} never let go")


def _gated(pod: dict[str, Any]) -> dict[str, Any]:
    pod["spec"]["schedulingGates"] = [{"name": observing.GATE}]
    pod["status"]["conditions"] = []
    return pod


def _spec(api: kubeapi.InMemoryApi, node: str) -> list[tuple[int, int, str, str | None]]:
    layout = wire.parse(api.objects[LAYOUTS][node])
    return [
        (g.index, i.start, i.profile, i.reserved_for) for g in layout.spec.gpus for i in g.instances
    ]


def _pinned(api: kubeapi.InMemoryApi, key: str) -> str | None:
    """The node a pod was pinned to and let go there; ``None`` while gated."""
    spec = api.objects[PODS][key]["spec"]
    if "schedulingGates" in spec:
        return None
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (term,) = terms["nodeSelectorTerms"]
    (field,) = term["matchFields"]
    assert field["key"] == "metadata.name" and field["operator"] == "In"
    (node,) = field["values"]
    return str(node)


def _allocated(name: str, node: str, *devices: str) -> dict[str, Any]:
    """A ResourceClaim of one 1g.10gb kube-scheduler allocated ``devices`` on ``node``."""
    doc = _claim_doc(name, 'device.attributes["mig.migpilot.io"].profile == "1g.10gb"')
    results = [
        {"request": "r", "driver": "mig.migpilot.io", "pool": node, "device": d} for d in devices
    ]
    doc["status"] = {"allocation": {"devices": {"results": results}}}
    return doc


# --------------------------------------------------------------------------- the loop


def _profile_template(profile: str) -> dict[str, Any]:
    """A ResourceClaimTemplate by profile, as the shipped ``mig-1g-10gb``."""
    doc = _template("mig-1g-10gb")
    name = f"mig-{profile.replace('.', '-')}"
    doc["metadata"]["name"] = name
    (request,) = doc["spec"]["spec"]["devices"]["requests"]
    (selector,) = request["exactly"]["selectors"]
    selector["cel"]["expression"] = f'device.attributes["mig.migpilot.io"].profile == "{profile}"'
    return doc


async def _three_gated_pods(api: kubeapi.InMemoryApi) -> None:
    """Templates by profile and three gated pods asking a 1g.10gb (``small``), a 2g.20gb
    (``mid``) and a 4g.40gb (``large``), created one after another (kube-scheduler's queue
    order): on one GPU first fit serves two of them, the plan three."""
    for profile in ("1g.10gb", "2g.20gb", "4g.40gb"):
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _profile_template(profile))
    for i, (name, profile) in enumerate(
        (("small", "1g.10gb"), ("mid", "2g.20gb"), ("large", "4g.40gb"))
    ):
        pod = _gated(_dra_pod(name, template=f"mig-{profile.replace('.', '-')}"))
        pod["metadata"]["creationTimestamp"] = f"2026-01-01T00:00:0{i}Z"
        await api.put(PODS, pod)


def _generation(api: kubeapi.InMemoryApi, node: str) -> int:
    return int(api.objects[LAYOUTS][node]["metadata"].get("generation", 0))


def test_a_lone_gated_dra_pod_first_fit_serves_is_let_go_unsteered() -> None:
    """The plan serves no more pods than first fit (one) and keeps no more room (a 4g.40gb has
    one start): the round is first fit's. The pod is pinned to the node first fit picks and let
    go, once the node's agent lists a target with nothing first for it."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0", "n0")
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _profile_template("4g.40gb"))
        await api.put(PODS, _gated(_dra_pod("claims", template="mig-4g-40gb")))
        await api.put(PODS, _pod("plugin", "1g.10gb"))  # a device-plugin pod, gated too
        await _until("the DRA node's spec written", lambda: _generation(api, "d0") > 1)
        # not let go before the node's agent lists that target (kube-scheduler would
        # allocate from the old listing)
        await _passes(controller)
        assert _pinned(api, "ns/claims") is None
        assert await _steered(api, "ns/claims", "d0") == "d0"
        # its node's target holds nothing: nothing is listed first
        assert _spec(api, "d0") == []
        ((_, message),) = [e for e in _events(api, "claims") if e[0] == "MigDraFirstFit"]
        assert "first fit serves it on node d0 (gpu-0-mig-4g-40gb-0)" in message
        assert "1 against 1" in message and "keeps no placement first fit would lose" in message
        assert not any(e[0] == "MigDraPlanned" for e in _events(api, "claims"))
        # the device-plugin pod is reserved on the device-plugin node, never the DRA node
        await _until("the plugin pod reserved", lambda: len(_spec(api, "n0")) == 1)
        assert _spec(api, "n0")[0][2:] == ("1g.10gb", "ns/plugin")
        assert "schedulingGates" in api.objects[PODS]["ns/plugin"]["spec"]
        # pinned once, however many passes follow
        await _passes(controller)
        assert [k for k, _ in api.pod_patches] == ["ns/claims"]

    _run(body)


def test_a_lone_gated_dra_pod_is_steered_where_first_fit_loses_room() -> None:
    """A lone 1g.10gb: first fit gives it slot 0, the only start of a 4g.40gb; the plan serves
    the same one pod elsewhere and keeps the 4g.40gb placeable (the 7g.80gb is lost either
    way). The round is steered, and the Event says why."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0")
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _template("mig-1g-10gb"))
        await api.put(PODS, _gated(_dra_pod("claims", template="mig-1g-10gb")))
        await _until("the DRA node's target", lambda: len(_spec(api, "d0")) == 1)
        assert await _steered(api, "ns/claims", "d0") == "d0"
        ((_, start, profile, reserved),) = _spec(api, "d0")
        assert profile == "1g.10gb" and start != 0 and reserved is None
        assert not any(e[0] == "MigDraFirstFit" for e in _events(api, "claims"))
        ((_, message),) = [e for e in _events(api, "claims") if e[0] == "MigDraPlanned"]
        assert "first fit would serve as many now (1) but leave no " in message
        assert message.endswith("leave no 4g.40gb (a100-80gb) placeable")

    _run(body)


def test_a_steered_pod_is_let_go_as_soon_as_its_agent_lists_the_target() -> None:
    """The plan that writes the target waits the batch window; the one that lets the pod go,
    when the agent lists it, does not wait another (the controller's clock stands still)."""
    clock = _Clock(1000.0)

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0")
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _template("mig-1g-10gb"))
        await api.put(PODS, _gated(_dra_pod("claims", template="mig-1g-10gb")))
        await _passes(controller)
        assert _spec(api, "d0") == []  # the window is not over
        clock.now += 5.0
        await _until("the DRA node's target", lambda: len(_spec(api, "d0")) == 1)
        await _passes(controller)
        assert _pinned(api, "ns/claims") is None  # not listed yet
        await _agent_acts(api, "d0")
        await _until("the pod let go", lambda: _pinned(api, "ns/claims") == "d0")

    _run(body, clock=clock, batch_window_s=5.0)


def test_gated_dra_pods_the_plan_serves_more_of_are_steered_unreserved() -> None:
    """1g.10gb, 2g.20gb and 4g.40gb on one GPU: first fit gives the 1g.10gb slot 0, the
    4g.40gb's only start, and serves two; the plan serves three. Steered: the targets hold the
    planned placements, reserved for no one (kube-scheduler hands them out), listed first."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0")
        await _three_gated_pods(api)
        await _until("the DRA node's target", lambda: len(_spec(api, "d0")) == 3)
        await _passes(controller)
        assert _pinned(api, "ns/small") is None
        for key in ("ns/small", "ns/mid", "ns/large"):
            assert await _steered(api, key, "d0") == "d0"
        placed = {(p[2], p[1]) for p in _spec(api, "d0")}
        assert ("4g.40gb", 0) in placed
        assert all(p[3] is None for p in _spec(api, "d0"))
        for name in ("small", "mid", "large"):
            ((_, message),) = [e for e in _events(api, name) if e[0] == "MigDraPlanned"]
            assert "planned on node d0" in message
        await _passes(controller)
        assert sorted(k for k, _ in api.pod_patches) == ["ns/large", "ns/mid", "ns/small"]

    _run(body)


def test_a_steered_target_goes_back_to_the_used_instances_once_its_pods_are_gone() -> None:
    """Three pods steered: the target holds their placements, free. Two are allocated and bound;
    the third is deleted before its claim is allocated: with no pod waiting, no plan follows,
    and the controller writes the target back to what the claims are allocated (its agent
    would otherwise keep listing the 4g.40gb first, and keep the instance once made). The two
    go as well: the target is empty."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0")
        await _three_gated_pods(api)
        await _until("the DRA node's target", lambda: len(_spec(api, "d0")) == 3)
        for key in ("ns/small", "ns/mid", "ns/large"):
            assert await _steered(api, key, "d0") == "d0"
        target = {p[2]: p for p in _spec(api, "d0")}
        # kube-scheduler allocates the small and mid pods' claims at their planned placements
        # and binds them; the large pod is deleted before its claim is allocated
        for name, profile in (("small", "1g.10gb"), ("mid", "2g.20gb")):
            gpu, start, _, _ = target[profile]
            claim = _allocated(f"{name}-mig", "d0", dra.device_name(gpu, profile, start))
            await api.put(kubeobjects.Kind.RESOURCECLAIMS, claim)
            pod = copy.deepcopy(api.objects[PODS][f"ns/{name}"])
            pod["status"]["resourceClaimStatuses"] = [
                {"name": "mig", "resourceClaimName": f"{name}-mig"}
            ]
            pod["spec"]["nodeName"] = "d0"
            pod["status"]["phase"] = "Running"
            await api.put(PODS, pod)
        await api.delete(PODS, "ns/large")
        used = sorted([target["1g.10gb"], target["2g.20gb"]])
        await _until("the free 4g.40gb out of the target", lambda: _spec(api, "d0") == used)
        await _passes(controller)
        assert _spec(api, "d0") == used  # the allocated placements stay
        # the two pods done and their claims deleted: nothing is used, nothing stays
        for name in ("small", "mid"):
            await api.delete(PODS, f"ns/{name}")
            await api.delete(kubeobjects.Kind.RESOURCECLAIMS, f"ns/{name}-mig")
        await _until("the target empty", lambda: _spec(api, "d0") == [])
        writes = _generation(api, "d0")
        await _passes(controller)
        assert _generation(api, "d0") == writes  # written once, not again at every pass

    _run(body)


def test_a_dra_pod_is_never_planned_onto_a_device_plugin_node_nor_the_reverse() -> None:
    """Each only ever runs on its own kind of node: with none of that kind, it can never run,
    and is let go with the reason, as any pod no node admits."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "n0", "d0")
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _template("mig-1g-10gb"))
        # the DRA node cordoned: the DRA pod has no node, the device-plugin node never counts
        cordoned = _node_doc("d0", dra=True)
        cordoned["spec"] = {"unschedulable": True}
        await api.put(kubeobjects.Kind.NODES, cordoned)
        await api.put(PODS, _gated(_dra_pod("claims", template="mig-1g-10gb")))
        await _until("claims let go", lambda: _events(api, "claims") != [])
        ((reason, message),) = _events(api, "claims")
        assert reason == "MigRequestUnservable"
        assert "only nodes in DRA mode (migpilot.io/mode=dra) serve" in message
        # the device-plugin node cordoned: a device-plugin pod never goes to the DRA node
        await api.put(kubeobjects.Kind.NODES, _node_doc("d0", dra=True))
        plugin_cordoned = _node_doc("n0", dra=False)
        plugin_cordoned["spec"] = {"unschedulable": True}
        await api.put(kubeobjects.Kind.NODES, plugin_cordoned)
        await api.put(PODS, _pod("plugin", "2g.20gb"))
        await _until("plugin let go", lambda: _events(api, "plugin") != [])
        ((reason, message),) = _events(api, "plugin")
        assert reason == "MigRequestUnservable" and "node is in DRA mode" in message
        await _passes(controller)
        assert _spec(api, "d0") == [] and _spec(api, "n0") == []

    _run(body)


def test_an_allocated_claims_device_is_used_so_no_pod_is_planned_over_it() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0")
        # kube-scheduler allocated the whole A100 (7g.80gb) to another pod's claim; the agent
        # has not even made it yet
        await api.put(
            kubeobjects.Kind.RESOURCECLAIMS, _allocated("held", "d0", "gpu-0-mig-7g-80gb-0")
        )
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _profile_template("4g.40gb"))
        await api.put(PODS, _gated(_dra_pod("claims", template="mig-4g-40gb")))
        await _until(
            "told it waits", lambda: any(e[0] == "MigWaiting" for e in _events(api, "claims"))
        )
        await _passes(controller)
        assert api.pod_patches == []  # kept gated, as any pod the plan cannot place now
        assert all(p[2] == "7g.80gb" for p in _spec(api, "d0"))
        # the claim released: the pod fits where the 7g.80gb was, first fit's as a lone pod
        # whose one placement first fit takes too
        await api.delete(kubeobjects.Kind.RESOURCECLAIMS, "ns/held")
        assert await _steered(api, "ns/claims", "d0") == "d0"
        assert _spec(api, "d0") == []
        assert any(e[0] == "MigDraFirstFit" for e in _events(api, "claims"))

    _run(body)


@pytest.mark.parametrize(
    ("scoring", "together"),
    [(draclaims.Scoring.LEAST_ALLOCATED, False), (draclaims.Scoring.MOST_ALLOCATED, True)],
)
def test_nodes_spread_by_default_and_packed_under_most_allocated(
    scoring: draclaims.Scoring, together: bool
) -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0", "d1")
        await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _template("mig-1g-10gb"))
        for name in ("a", "b"):
            await api.put(PODS, _gated(_dra_pod(name, template="mig-1g-10gb")))
        await _steered(api, "ns/a", "d0", "d1")
        await _steered(api, "ns/b", "d0", "d1")
        assert (_pinned(api, "ns/a") == _pinned(api, "ns/b")) is together

    _run(body, dra_scoring=scoring.value)


def test_a_scoring_strategy_kube_scheduler_lacks_is_refused_by_name() -> None:
    with pytest.raises(
        Exception, match="LeastAllocated, MostAllocated.*'RequestedToCapacityRatio'"
    ):
        running.Settings(identity="c", dra_scoring="RequestedToCapacityRatio")


# --------------------------------------------------------------------------- pure


def _observe_dra(claims: list[dict[str, Any]], instances: list[dict[str, Any]]) -> snapshot.Node:
    node = observing.node_view(_node_doc("d0", dra=True))
    layout = wire.parse(_layout_doc("d0", instances))
    observed = observing.observe(
        pods=[],
        nodes=[node],
        layouts_by_node={"d0": layout},
        claims={
            f"ns/{c['metadata']['name']}": observing.claim_read(c, template=False) for c in claims
        },
    )
    (planned,) = observed.snapshot.nodes
    return planned


def test_a_dra_nodes_gpus_count_allocated_devices_as_used_instances() -> None:
    free = [{"profile": "3g.40gb", "start": 4, "uuid": "MIG-1", "state": "free"}]
    # nothing allocated: the free instance is there to plan with
    (gpu,) = _observe_dra([], free).gpus
    assert [(i.profile, i.start, i.used) for i in gpu.instances] == [("3g.40gb", 4, False)]
    # an allocated device inside it: used, made or not, and the free one it overlaps is gone
    # (the plugin destroys it first); another node's device and a stale name are skipped
    claim = _allocated(
        "c", "d0", "gpu-0-mig-1g-10gb-5", "gpu-0-mig-1g-10gb-9", "gpu-3-mig-1g-10gb-0"
    )
    other = _allocated("o", "d9", "gpu-0-mig-1g-10gb-0")
    node = _observe_dra([claim, other], free)
    (gpu,) = node.gpus
    assert [(i.profile, i.start, i.used) for i in gpu.instances] == [("1g.10gb", 5, True)]
    # planned as a MIG node (its GPUs partition the same way), kept to DRA pods by its label
    assert node.mode.value == "mig" and node.labels["migpilot.io/mode"] == "dra"
    # a GPU a claim holds whole (MIG off) is not planned
    whole = _allocated("w", "d0", "gpu-0")
    assert _observe_dra([whole], []).gpus == ()


def test_dra_pods_and_dra_nodes_admit_only_each_other() -> None:
    model = catalog.resolve_gpu(A100)
    gpus = (snapshot.Gpu(0, model, ()),)
    dra_node = snapshot.Node("d0", {"migpilot.io/mode": "dra"}, (), False, None, gpus)
    plugin_node = snapshot.Node("n0", {}, (), False, None, gpus)
    pod = snapshot.planned_pod(
        name="p",
        namespace="ns",
        requests=snapshot.Requests((snapshot.MigRequest("1g.10gb", 1),), 0, 0),
    )
    claims = dataclasses.replace(pod, dra=True)
    assert constraints.rejection(plugin_node, pod) is None
    assert "DRA mode" in (constraints.rejection(dra_node, pod) or "")
    assert constraints.rejection(dra_node, claims) is None
    assert "ResourceClaims" in (constraints.rejection(plugin_node, claims) or "")
    assert constraints.signature(pod) != constraints.signature(claims)


def test_a_dra_target_is_written_without_reservations() -> None:
    model = catalog.resolve_gpu(A100)
    node = snapshot.Node(
        "d0", {"migpilot.io/mode": "dra"}, (), False, None, (snapshot.Gpu(0, model, ()),)
    )
    pod = snapshot.planned_pod(
        name="p",
        namespace="ns",
        requests=snapshot.Requests((snapshot.MigRequest("3g.40gb", 1),), 0, 0),
    )
    pod = dataclasses.replace(pod, dra=True)
    plan = planners.run(snapshot.Snapshot(nodes=(node,), pods=(pod,)), "fast")
    assert [p.pod for p in plan.placements] == ["ns/p"]
    spec = pinning.spec_for(node, plan, kept={}, unreserved=frozenset({"ns/p"}))
    assert [(i.profile, i.reserved_for) for g in spec.gpus for i in g.instances] == [
        ("3g.40gb", None)
    ]
    reserved = pinning.spec_for(node, plan, kept={})
    assert [i.reserved_for for g in reserved.gpus for i in g.instances] == ["ns/p"]


def test_the_node_policy_follows_kube_schedulers_scoring_strategy() -> None:
    assert draclaims.node_policy("LeastAllocated") is snapshot.Policy.SPREAD
    assert draclaims.node_policy(draclaims.Scoring.MOST_ALLOCATED) is snapshot.Policy.BINPACK


def test_a_target_is_listed_once_the_agent_acted_on_that_very_spec() -> None:
    doc = _layout_doc("d0")
    doc["spec"] = {"gpus": [{"index": 0, "instances": [{"profile": "3g.40gb", "start": 4}]}]}
    doc["metadata"]["generation"] = 2
    spec = wire.parse(doc).spec
    assert not pinning.listed(wire.parse(doc), spec)  # generation 2 not yet acted on
    doc["status"]["observedGeneration"] = 2
    # acted on, but the agent does not say it listed the plan (its view of the controller's
    # Lease stale, or its slices not written): not listed
    assert not pinning.listed(wire.parse(doc), spec)
    doc["status"]["conditions"] = [_plan_listed(2, listed=False)]
    assert not pinning.listed(wire.parse(doc), spec)
    doc["status"]["conditions"] = [_plan_listed(1)]  # listed, but an older plan
    assert not pinning.listed(wire.parse(doc), spec)
    doc["status"]["conditions"] = [_plan_listed(2)]
    assert pinning.listed(wire.parse(doc), spec)
    other = wire.parse({**doc, "spec": {"gpus": [{"index": 0, "instances": []}]}}).spec
    assert not pinning.listed(wire.parse(doc), other)  # another target: not what is listed
    assert not pinning.listed(None, spec)


def test_a_pod_let_go_and_not_yet_allocated_is_planned_again_on_its_node() -> None:
    """In flight: pinned and ungated, kube-scheduler has not allocated its claim yet. It stays
    among the pods planned (pinned to its node), so its placement goes to no other pod; once
    its claim (named in its status, made from its template) is allocated, the claim's device
    counts instead, not the pod again."""
    pod = _dra_pod("p", template="mig-1g-10gb", unschedulable=False)
    pin = {"key": "metadata.name", "operator": "In", "values": ["d0"]}
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchFields": [pin]}]
            }
        }
    }
    pod["status"]["resourceClaimStatuses"] = [{"name": "mig", "resourceClaimName": "p-mig-x"}]
    node = observing.node_view(_node_doc("d0", dra=True))
    templates = {"ns/mig-1g-10gb": observing.claim_read(_template("mig-1g-10gb"), template=True)}

    def observe(claims: list[dict[str, Any]]) -> observing.Observed:
        return observing.observe(
            pods=[observing.pod_view(pod)],
            nodes=[node],
            layouts_by_node={"d0": wire.parse(_layout_doc("d0"))},
            claims={
                f"ns/{c['metadata']['name']}": observing.claim_read(c, template=False)
                for c in claims
            },
            templates=templates,
        )

    (planned,) = observe([]).snapshot.pods
    assert planned.key == "ns/p" and observing.pinned_node(planned) == "d0"
    allocated = observe([_allocated("p-mig-x", "d0", "gpu-0-mig-1g-10gb-3")])
    assert allocated.snapshot.pods == ()
    (gpu,) = allocated.snapshot.nodes[0].gpus
    assert [(i.profile, i.start, i.used) for i in gpu.instances] == [("1g.10gb", 3, True)]
    # bound: none of this (its claim's device counts)
    pod["spec"]["nodeName"] = "d0"
    assert observe([]).snapshot.pods == ()


def test_a_node_is_set_aside_for_the_lone_pod_no_node_can_take_and_it_is_told() -> None:
    """A 7g.80gb that neither DRA node can take (d0's GPU has a 2g.20gb allocated, d1's a
    1g.10gb): d1, with the fewest compute slices in use, is set aside for it, and the pod is
    told once; a 1g.10gb that comes next is planned on d0, though spread would pick d1."""

    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await _nodes(api, "d0", "d1")
        held = _allocated("held0", "d0", "gpu-0-mig-2g-20gb-0")
        held["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"] = (
            'device.attributes["mig.migpilot.io"].profile == "2g.20gb"'
        )
        await api.put(kubeobjects.Kind.RESOURCECLAIMS, held)
        await api.put(
            kubeobjects.Kind.RESOURCECLAIMS, _allocated("held1", "d1", "gpu-0-mig-1g-10gb-6")
        )
        for profile in ("7g.80gb", "1g.10gb"):
            await api.put(kubeobjects.Kind.RESOURCECLAIMTEMPLATES, _profile_template(profile))
        await api.put(PODS, _gated(_dra_pod("whole", template="mig-7g-80gb")))

        def aside() -> list[str]:
            return [m for r, m in _events(api, "whole") if r == "MigDraNodeSetAside"]

        await _until("the pod told a node is set aside", lambda: bool(aside()))
        (message,) = aside()
        assert message.startswith("no node can take it now; node d1 could once its instances end")
        pod = _gated(_dra_pod("small", template="mig-1g-10gb"))
        pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:09Z"
        await api.put(PODS, pod)
        assert await _steered(api, "ns/small", "d0", "d1") == "d0"
        await _passes(controller)
        assert len(aside()) == 1  # told once, not at every plan
        assert _pinned(api, "ns/whole") is None

    _run(body)
