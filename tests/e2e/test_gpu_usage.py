"""Per-pod GPU series on the real control plane, as a real Prometheus scrapes them.

The scene of ``test_prometheus.py`` with each agent's emulated GPUs driven by one
``--emulated-load`` file and sampled every second (``load_scene``). MIG pods and a unified pod
(``nvidia.com/gpu`` with ``nvidia.com/gpumem``) are served; PromQL then checks that each pod's
device series carry every label (compared with the GpuLayouts' status) and the values the file
set, that a change of the file shows, that a deleted pod's series are gone, and that
``migpilot_instances`` counts every instance of each node by state. An H100's MIG instance
gives utilisation (GPM) and memory; an A100's gives memory only, its utilisation is absent,
never a zero (``docs/observability.md``).
"""

from __future__ import annotations

from typing import Any

import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from tests.kube import prometheus as prom
from tests.kube.scenes import NODES, Scene

pytestmark = pytest.mark.kube

MIB = 1024 * 1024
H100, A100 = "ctl-h100", "ctl-a100"
R1G = "nvidia.com/mig-1g.10gb"
UTIL, USED = "migpilot_device_utilization_ratio", "migpilot_device_memory_used_bytes"


def _pod(scene: Scene, name: str, limits: dict[str, str], node: str | None = None) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=scene.namespace),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ],
            nodeSelector={"kubernetes.io/hostname": node} if node is not None else None,
        ),
    )


def _load(scene: Scene, loads: dict[str, tuple[float, int]]) -> None:
    assert scene.load_file is not None
    scene.load_file.write_text(
        "".join(
            f"{scene.namespace}/{pod}: {{utilization: {u}, memoryUsedMiB: {m}}}\n"
            for pod, (u, m) in loads.items()
        ),
        encoding="utf-8",
    )


def _held(scene: Scene) -> dict[str, dict[str, str]]:
    """Pod name -> the labels its device must have, from the GpuLayouts' status (``usedBy``
    for the unified pod; for a MIG pod, the one instance used on its node's GPUs)."""
    out: dict[str, dict[str, str]] = {}
    for node in NODES:
        lay = scene.layout(node)
        for g in lay.status.gpus if lay is not None and lay.status is not None else ():
            for i in g.instances:
                if i.used_by is not None and i.uuid is not None:
                    out[i.used_by.split("/", 1)[1]] = {
                        "node": node,
                        "gpu": str(g.index),
                        "gpu_uuid": g.uuid,
                        "device": i.uuid,
                        "profile": i.profile,
                    }
    return out


def _one(samples: list[prom.Sample], pod: str) -> prom.Sample | None:
    mine = [s for s in samples if s.labels.get("pod") == pod]
    assert len(mine) <= 1, mine
    return mine[0] if mine else None


def test_per_pod_gpu_series_carry_the_labels_and_the_loads_and_go_with_the_pod(
    load_scene: Scene, load_prometheus: prom.Prometheus
) -> None:
    scene, client, prometheus = load_scene, load_scene.client, load_prometheus
    ns = scene.namespace
    _load(scene, {"hot": (0.9, 3000), "cool": (0.25, 700), "amem": (0.5, 1500), "uni": (0.5, 900)})
    scene.start_controller("c1")
    prometheus.scrape(prom.targets_of(scene))
    scene.wait(scene.reported, "the agents' first status")
    client.create(_pod(scene, "hot", {R1G: "1"}, H100))
    client.create(_pod(scene, "cool", {R1G: "1"}, H100))
    client.create(_pod(scene, "amem", {R1G: "1"}, A100))
    client.create(_pod(scene, "uni", {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}))
    pods = {"hot", "cool", "amem", "uni"}
    scene.wait(lambda: scene.running(pods), "every pod Running")
    # The unified pod's instance is reported with usedBy; a MIG pod's is the node's only used
    # 1g.10gb on its GPU, found by the device series' own label below.
    held = scene.wait(lambda: (h := _held(scene)) and "uni" in h and h, "uni's usedBy")

    # Memory: every pod's device, on either model, with the MiB its load set.
    mem = prometheus.wait(
        f'{USED}{{namespace="{ns}"}}',
        lambda got: (
            {s["pod"]: s.value for s in got}
            == {"hot": 3000 * MIB, "cool": 700 * MIB, "amem": 1500 * MIB, "uni": 900 * MIB}
        ),
        what="each pod's memory as the load file sets it",
    )
    running = scene.running(pods)
    for pod in pods:
        s = _one(mem, pod)
        assert s is not None
        assert (s["job"], s["node"], s["namespace"]) == ("agent", running[pod], ns)
        assert s["gpu_uuid"].startswith("GPU-") and s["device"].startswith("MIG-")
        want = "nvidia.com/gpu" if pod == "uni" else R1G
        assert (s["resource"], s["profile"]) == (want, held.get(pod, s.labels)["profile"])
        assert s["profile"].startswith("1g.")  # the smallest instance for 8000 MiB too
    uni = _one(mem, "uni")
    assert uni is not None
    assert {k: uni[k] for k in held["uni"]} == held["uni"]  # as the GpuLayout status says
    # The MIG pods' devices are instances of their node's GpuLayout status, distinct.
    uuids = {
        node: {i.uuid for g in lay.status.gpus for i in g.instances}
        for node in NODES
        if (lay := scene.layout(node)) is not None and lay.status is not None
    }
    assert all(s["device"] in uuids[s["node"]] for s in mem)
    # Distinct per node (separate agents' emulated GPUs may share UUIDs: same seed).
    assert len({(s["node"], s["device"]) for s in mem}) == len(pods)

    # Utilisation: the H100's instances give it, the A100's do not (absent, not 0).
    util = prometheus.wait(
        f'{UTIL}{{namespace="{ns}", node="{H100}"}}',
        lambda got: {s["pod"] for s in got} >= {"hot", "cool"},
        what="the H100 pods' utilisation",
    )
    assert _one(util, "hot").value == pytest.approx(0.9)  # type: ignore[union-attr]
    assert _one(util, "cool").value == pytest.approx(0.25)  # type: ignore[union-attr]
    assert prometheus.query(f'{UTIL}{{node="{A100}"}}') == []
    assert prometheus.query(f'{UTIL}{{pod="amem"}}') == []

    # The file changes: the value follows within a few scrapes.
    _load(scene, {"hot": (0.25, 100), "cool": (0.9, 700), "amem": (0.5, 1500), "uni": (0.5, 900)})
    prometheus.wait(
        f'{UTIL}{{namespace="{ns}", pod="hot"}} == 0.25',
        what="hot's utilisation changed to 0.25",
    )
    prometheus.wait(f'{USED}{{namespace="{ns}", pod="hot"}} == {100 * MIB}', what="hot's memory")

    # The layout: every instance of a node counted once, by state; the pods' are used.
    def layout_counts(got: list[prom.Sample]) -> Any:
        states: dict[tuple[str, str], float] = {}
        for s in got:
            key = (s["node"], s["state"])
            states[key] = states.get(key, 0.0) + s.value
        return states

    want_used = {H100: 2.0, A100: 1.0}
    for node, n in want_used.items():
        if running["uni"] == node:
            want_used[node] = n + 1

    def counted(got: list[prom.Sample]) -> bool:
        states = layout_counts(got)
        return all(
            {st for (nd, st) in states if nd == node} == {"free", "reserved", "used"}
            and states[(node, "used")] == want_used[node]
            and sum(v for (nd, _), v in states.items() if nd == node) == len(uuids[node])
            for node in NODES
        )

    prometheus.wait("migpilot_instances", counted, what=f"instances used {want_used}")

    # A deleted pod's series go: PromQL returns nothing for it.
    client.delete(Pod, "cool", namespace=ns, grace_period=0)
    client.delete(Pod, "uni", namespace=ns, grace_period=0)
    for pod in ("cool", "uni"):
        prometheus.wait(
            f'absent({USED}{{namespace="{ns}", pod="{pod}"}})', what=f"{pod}'s series gone"
        )
        assert prometheus.query(f'{{namespace="{ns}", pod="{pod}"}}') == []
    assert _one(prometheus.query(f'{UTIL}{{namespace="{ns}"}}'), "hot") is not None
