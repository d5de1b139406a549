"""Time-slicing nodes planned by the controller, on a real control plane (``docs/controller.md``,
"Time-slicing nodes").

Beside the scene's two MIG nodes, filled first (one ``mig-7g.80gb`` pod a GPU), a KWOK node
labelled ``migpilot.io/mode: time-slicing`` with one emulated H100 in MIG mode off, whose agent
(``--kubelet simulated``) serves NVIDIA's sharing config at four replicas: it reports the four
replicas in its GpuLayout status and writes the unified counters four times over. HAMi-style
pods (``nvidia.com/gpu: 1`` with ``nvidia.com/gpumem``, together more memory than the GPU has)
are gated by the webhook; the controller, with no MIG room left, reserves a replica for each in
the GpuLayout spec, pins them, kube-scheduler binds them, the stand-in kubelet admits each with
its replica, and the agent reports the replica used by its pod. Deleting them frees the
replicas.
"""

from __future__ import annotations

import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Node, Pod

from migpilot.api import gpulayouts as gl
from tests.kube.scenes import NODES, Scene

pytestmark = pytest.mark.kube

TS_NODE = "ctl-ts"
REPLICAS = 4
CONFIG = (
    "version: v1\nflags: {migStrategy: none}\n"
    f"sharing: {{timeSlicing: {{resources: [{{name: nvidia.com/gpu, replicas: {REPLICAS}}}]}}}}\n"
)
WAIT_S = 240.0
"""Generous: the scene's processes share two CPUs with other work."""


def _hami(scene: Scene, name: str, *, gpumem: int) -> Pod:
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(gpumem)}
    return Pod(
        metadata=ObjectMeta(name=name, namespace=scene.namespace),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ]
        ),
    )


def _replicas(scene: Scene) -> list[gl.ReplicaStatus]:
    lay = scene.layout(TS_NODE)
    if lay is None or lay.status is None:
        return []
    return [r for g in lay.status.gpus for r in g.replicas]


def test_hami_pods_run_on_time_slicing_replicas_when_mig_nodes_are_full(scene: Scene) -> None:
    client = scene.client
    config = scene.root / "ts.yaml"
    config.write_text(CONFIG, encoding="utf-8")
    scene.add_node(
        TS_NODE,
        "emulated:h100-80gb:x1:mig-off",
        "--strategy", "none",
        "--device-plugin-config", str(config),
        labels={"migpilot.io/mode": "time-slicing"},
    )  # fmt: skip
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status", timeout=WAIT_S)
    scene.wait(lambda: len(_replicas(scene)) == REPLICAS, "the four replicas reported", WAIT_S)
    assert all(r.state is gl.InstanceState.FREE for r in _replicas(scene))

    # Every MIG GPU taken whole: no MIG node can take a unified pod.
    fill = {f"fill{i}" for i in range(2 * len(NODES))}
    for name in sorted(fill):
        client.create(scene.pod(name, "7g.80gb"))
    got = scene.wait(lambda: scene.running(fill), "the MIG nodes filled", WAIT_S)
    assert set(got.values()) == set(NODES), got

    # Three pods of 30,000 MiB: 90,000 MiB in all, more than the H100's 80 GB.
    hami = {"h1", "h2", "h3"}
    for name in sorted(hami):
        client.create(_hami(scene, name, gpumem=30000))
    got = scene.wait(lambda: scene.running(hami), "the HAMi pods Running", WAIT_S)
    assert all(got[n] == TS_NODE for n in hami), got

    def users() -> set[str]:
        used = gl.InstanceState.USED
        return {r.used_by for r in _replicas(scene) if r.state is used and r.used_by}

    want = {f"{scene.namespace}/{n}" for n in hami}
    scene.wait(lambda: users() == want, "each replica reported used by its pod", WAIT_S)
    assert len(_replicas(scene)) == REPLICAS
    node = client.get(Node, TS_NODE)
    assert node.status is not None and node.status.allocatable is not None
    alloc = node.status.allocatable
    assert alloc["nvidia.com/gpu"] == str(REPLICAS)
    assert alloc["nvidia.com/gpumem"] == str(REPLICAS * 80 * 1024)
    assert alloc["nvidia.com/gpucores"] == alloc["nvidia.com/gpumem-percentage"] == "400"
    scene.wait(
        lambda: (
            (lay := scene.layout(TS_NODE)) is not None
            and not any(r.reserved_for for g in lay.spec.gpus for r in g.replicas)
        ),
        "the replicas' reservations released once used",
        WAIT_S,
    )

    for name in sorted(hami):
        client.delete(Pod, name, namespace=scene.namespace, grace_period=0)
    scene.wait(
        lambda: (
            len(reps := _replicas(scene)) == REPLICAS
            and all(r.state is gl.InstanceState.FREE for r in reps)
        ),
        "the replicas freed",
        WAIT_S,
    )
