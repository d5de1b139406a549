"""Every query of the Grafana dashboard (``deploy/grafana/migpilot.json``) run against a real
Prometheus scraping the whole system, with every variable at "All" (``.*``).

The scene: the two MIG nodes of ``metrics_scene`` (the H100 node's agent restarted with
``--emulated-load`` so its MIG instances report utilisation: an A100 MIG instance gives none, by
design), an MPS node (two A100-80GB, MIG off) with the same load file, the controller, MIG pods
on both MIG nodes (the A100 node's after a pod of two whole GPUs came and went, so a free
7g.80gb is destroyed for one of them), an MPS pod, and a pod no node can serve (three 7g.80gb:
pending with ``MigRequestUnservable``). Then each panel's query must parse (Prometheus answers 400
otherwise: ``PromQLError``) and return at least one series; each variable's ``label_values``
must list the scene's nodes, models and namespace; and the top pod by utilisation is the one the
load file made busiest.
"""

from __future__ import annotations

import re

import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from tests import dashboard
from tests.kube import controlplane
from tests.kube import prometheus as prom
from tests.kube.scenes import NODES, Scene

pytestmark = pytest.mark.kube

MPS_NODE = "ctl-mps"
H100, A100 = "ctl-h100", "ctl-a100"
MIG_PODS = {"busy-0": ("1g.10gb", H100), "busy-1": ("3g.40gb", H100), "idle-0": ("2g.20gb", A100)}
LOADS = {
    "busy-0": (0.75, 4096),
    "busy-1": (0.25, 20480),
    "mps-0": (0.5, 3000),
}
EMPTY_OK: dict[tuple[str, str], str] = {}
"""(panel, refId) -> why its query may return nothing in this scene: none, every panel has data."""


def _mig_pod(scene: Scene, name: str, profile: str, node: str, count: int = 1) -> Pod:
    pod = scene.pod(name, profile, count)
    assert pod.spec is not None
    pod.spec.nodeSelector = {"kubernetes.io/hostname": node}
    return pod


def _mps_pod(scene: Scene, name: str, gb: int) -> Pod:
    limits = {f"nvidia.com/gpu-{gb}gb": "1"}
    return Pod(
        metadata=ObjectMeta(name=name, namespace=scene.namespace),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ]
        ),
    )


def _label_values(definition: str) -> str:
    """Grafana's ``label_values(SERIES, LABEL)`` as the PromQL giving the same values."""
    m = re.fullmatch(r"label_values\((.+), (\w+)\)", definition)
    assert m is not None, definition
    return f"group by ({m[2]}) ({dashboard.resolved(m[1])})"


def test_every_dashboard_query_returns_data_with_all_selected(
    metrics_scene: Scene, prometheus: prom.Prometheus
) -> None:
    scene, client = metrics_scene, metrics_scene.client
    loads = scene.root / "loads.yaml"
    loads.write_text(
        "".join(
            f"{scene.namespace}/{pod}: {{utilization: {util}, memoryUsedMiB: {mib}}}\n"
            for pod, (util, mib) in LOADS.items()
        )
    )
    load_args = ("--emulated-load", str(loads), "--gpu-metrics-interval", "1")
    controlplane.stop_components([scene.agents[H100]])
    scene.start_agent(H100, f"emulated:{NODES[H100]}:x2", *load_args)
    scene.add_node(
        MPS_NODE,
        "emulated:a100-80gb:x2:mig-off",
        "--mps-root",
        str(scene.root / "mps"),
        *load_args,
        labels={"migpilot.io/mode": "mps"},
    )
    scene.start_controller("c1")
    prometheus.scrape(prom.targets_of(scene))
    prometheus.wait_up()
    scene.wait(scene.reported, "the agents' first status")
    scene.wait(lambda: scene.layout(MPS_NODE) is not None, "the mps node's GpuLayout")

    # First a pod of two whole A100s, gone once Running: its two 7g.80gb stay free, and
    # idle-0's 2g.20gb takes the place of one (an instance destroyed, for the Reconfigurations
    # panel's destroyed query).
    client.create(_mig_pod(scene, "whole", "7g.80gb", A100, count=2))
    scene.wait(lambda: scene.running({"whole"}), "the pod of two 7g.80gb Running")
    client.delete(Pod, "whole", namespace=scene.namespace, grace_period=0)
    for name, (profile, node) in MIG_PODS.items():
        client.create(_mig_pod(scene, name, profile, node))
    client.create(_mps_pod(scene, "mps-0", 10))
    client.create(scene.pod("huge", "7g.80gb", count=3))  # no node has three GPUs
    # The webhook reviewed each MIG pod as it was created: the admission panel shows them
    # (within its 30 s rate window; the reviews happened inside client.create).
    doc = dashboard.load()
    [(_, _, admitted)] = [q for q in dashboard.queries(doc) if q[0] == "Admission requests"]
    prometheus.wait(
        dashboard.resolved(admitted),
        lambda got: sum(s.value for s in got if s["path"] == "/mutate-pods") > 0,
        what="the MIG pods' admission reviews on the admission panel",
        timeout=30,
    )
    want = {name: node for name, (_, node) in MIG_PODS.items()} | {"mps-0": MPS_NODE}
    assert scene.wait(lambda: scene.running(set(want)), "the MIG and MPS pods Running") == want

    # Settled as the panels need it: the busiest pod's utilisation, the MPS slice's series and
    # the refused pod's reason scraped.
    ns = scene.namespace
    prometheus.wait(
        f'migpilot_device_utilization_ratio{{namespace="{ns}", pod="busy-0"}}',
        lambda got: [s.value for s in got] == [0.75],
        what="busy-0's utilisation from the load file",
    )
    prometheus.wait(
        f'migpilot_device_memory_total_bytes{{namespace="{ns}", pod="mps-0", profile="mps-10gb"}}',
        what="the MPS pod's slice",
    )
    prometheus.wait(
        'migpilot_pending_pods{reason="MigRequestUnservable"} == 1', what="the refused pod"
    )
    prometheus.wait(
        'migpilot_instances_destroyed_total{profile="7g.80gb"} == 1',
        what="the free 7g.80gb destroyed for idle-0",
    )

    queries = dashboard.queries(doc)
    assert len(queries) >= 15
    empty = []
    for title, ref, expr in queries:
        promql = dashboard.resolved(expr)
        try:
            prometheus.wait(promql, what=f"{title} {ref}: {promql}", timeout=30)
        except prom.PromQLError:
            raise  # refused: the panel's query is wrong, whatever the scene
        except AssertionError:
            empty.append((title, ref))
    assert empty == list(EMPTY_OK), f"panels with no data: {empty}"

    # The top-utilisation panel puts the busiest pod first (utilisation from the load file).
    [(_, _, top)] = [q for q in queries if q[0] == "Top pods by GPU utilisation"]
    ranked = sorted(prometheus.query(dashboard.resolved(top)), key=lambda s: -s.value)
    assert [(s["pod"], s.value) for s in ranked[:3]] == [
        ("busy-0", 0.75),
        ("mps-0", 0.5),
        ("busy-1", 0.25),
    ]

    # Each variable lists what the scene has.
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    expected = {
        "node": {A100, H100, MPS_NODE},
        "model": {"a100-80gb", "h100-80gb"},
        "namespace": {ns},
    }
    for name, values in expected.items():
        got = prometheus.query(_label_values(variables[name]["definition"]))
        assert values <= {s[name] for s in got}, (name, got)
