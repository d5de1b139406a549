"""The controller watches Namespaces for their labels: a pod (anti-)affinity term's
``namespaceSelector`` selects pods by their namespace's labels, as kube-scheduler's does, and a
Namespace it cannot read stops neither the watch nor the plan."""

from __future__ import annotations

import copy
from typing import Any

from migpilot.controller import kubeapi, observing, running
from migpilot.kube import objects as kubeobjects
from tests.unit.test_controller_running import _passes, _pod, _ready_node, _reserved, _run, _until

HOST = "kubernetes.io/hostname"


def _namespace(name: str, labels: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": f"uid-ns-{name}", "labels": labels}}


def _db(node: str) -> dict[str, Any]:
    """A CPU pod of another team, bound to ``node``."""
    return {
        "metadata": {"name": "db", "namespace": "team", "uid": "uid-db", "labels": {"app": "db"}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "resources": {}}]},
        "status": {"phase": "Running"},
    }


def _away_from_gold_db(name: str) -> dict[str, Any]:
    """A gated MIG pod whose required anti-affinity keeps it off nodes running an ``app=db``
    pod of any namespace labelled ``tier=gold``."""
    pod = _pod(name, "1g.10gb")
    pod["spec"]["affinity"] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {
                    "labelSelector": {"matchLabels": {"app": "db"}},
                    "namespaceSelector": {"matchLabels": {"tier": "gold"}},
                    "topologyKey": HOST,
                }
            ]
        }
    }
    return pod


def test_namespace_labels_are_read_tolerantly() -> None:
    assert dict(observing.namespace_labels(_namespace("a", {"tier": "gold", "n": 3}))) == {
        "tier": "gold",
        "n": "3",
    }
    assert dict(observing.namespace_labels(_namespace("a", ["tier"]))) == {}
    assert dict(observing.namespace_labels({"metadata": "hostile"})) == {}


def test_a_namespace_selector_matches_the_namespaces_labels() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NAMESPACES, _namespace("team", {"tier": "gold"}))
        await _ready_node(api, "n0")
        await _ready_node(api, "n1")
        await api.put(kubeobjects.Kind.PODS, _db("n0"))
        await _passes(controller)
        # n0 comes first and is the busier (binpack): only the namespace's label keeps p off it
        await api.put(kubeobjects.Kind.PODS, _away_from_gold_db("p"))
        await _until("p reserved", lambda: "ns/p" in _reserved(api, "n1"))
        assert "ns/p" not in _reserved(api, "n0")

    _run(body)


def test_without_the_label_the_selector_selects_nothing() -> None:
    # the control: the same scene with the namespace unlabelled lands p on n0
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NAMESPACES, _namespace("team", {"tier": "silver"}))
        await _ready_node(api, "n0")
        await _ready_node(api, "n1")
        await api.put(kubeobjects.Kind.PODS, _db("n0"))
        await _passes(controller)
        await api.put(kubeobjects.Kind.PODS, _away_from_gold_db("p"))
        await _until("p reserved", lambda: "ns/p" in _reserved(api, "n0"))

    _run(body)


def test_a_hostile_namespace_stops_neither_the_watch_nor_the_plan() -> None:
    async def body(api: kubeapi.InMemoryApi, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NAMESPACES, _namespace("odd", ["not", "a", "mapping"]))
        await api.put(kubeobjects.Kind.NAMESPACES, {"metadata": {"name": "bare"}, "spec": 7})
        await _ready_node(api, "n0")
        await _ready_node(api, "n1")
        await api.put(kubeobjects.Kind.PODS, _db("n0"))
        # a Namespace labelled after the watch started is seen too
        await api.put(kubeobjects.Kind.NAMESPACES, _namespace("team", {"tier": "gold"}))
        await _passes(controller)
        await api.put(kubeobjects.Kind.PODS, _away_from_gold_db("p"))
        await _until("p reserved", lambda: "ns/p" in _reserved(api, "n1"))
        assert controller.not_healthy() is None and controller.not_ready() is None
        namespaces = controller.observe().snapshot.namespaces
        assert dict(namespaces["team"]) == {"tier": "gold"} and dict(namespaces["odd"]) == {}
        # relabelled, then deleted: the plans see it
        relabelled = copy.deepcopy(api.objects[kubeobjects.Kind.NAMESPACES]["team"])
        relabelled["metadata"]["labels"] = {"tier": "silver"}
        await api.put(kubeobjects.Kind.NAMESPACES, relabelled)
        await _until(
            "the new label",
            lambda: controller.observe().snapshot.namespaces["team"].get("tier") == "silver",
        )
        await api.delete(kubeobjects.Kind.NAMESPACES, "team")
        await _until("the deletion", lambda: "team" not in controller.observe().snapshot.namespaces)

    _run(body)
