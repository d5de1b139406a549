"""Unified (HAMi-style) requests on a real control plane: ``nvidia.com/gpu`` with
``nvidia.com/gpumem`` and friends, served with MIG slices (``docs/unified.md``).

The same two KWOK nodes as ``test_controller.py`` (two A100-80GB, two H100-80GB), the webhook,
one agent per node and the controller. A pod asks for GPU memory; it is gated, planned, its
slice is made and reserved (``resource: nvidia.com/gpu``), the node advertises the slice as an
``nvidia.com/gpu`` device and the GPU-memory counters kube-scheduler checks, the pod is pinned
and bound, and the simulated kubelet hands it the instance reserved for it, which the agent
reports ``usedBy`` the pod. Nothing here is a mock of the API: kube-scheduler and the kubelet's
rules decide whether the pod runs.
"""

from __future__ import annotations

import signal
from typing import Any

import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Node, Pod

from tests.kube.scenes import NODES, Scene

pytestmark = pytest.mark.kube


def _unified(
    scene: Scene, name: str, *, annotations: dict[str, str] | None = None, **limits: Any
) -> Pod:
    """A pod asking ``nvidia.com/gpu`` (1 unless given) with HAMi's other resources."""
    res = {"nvidia.com/gpu": str(limits.pop("gpu", 1))}
    res.update({f"nvidia.com/{k.replace('_', '-')}": str(v) for k, v in limits.items()})
    return Pod(
        metadata=ObjectMeta(name=name, namespace=scene.namespace, annotations=annotations),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=res))
            ]
        ),
    )


def _used_by(scene: Scene) -> dict[str, tuple[str, int, str]]:
    """Pod name -> (node, GPU index, profile) of the instance the agent reports it uses."""
    out: dict[str, tuple[str, int, str]] = {}
    for node in NODES:
        lay = scene.layout(node)
        for g in lay.status.gpus if lay is not None and lay.status is not None else ():
            for i in g.instances:
                if i.used_by is not None:
                    out[i.used_by.split("/", 1)[1]] = (node, g.index, i.profile)
    return out


def _served(scene: Scene, names: set[str]) -> dict[str, tuple[str, int, str]]:
    """Every pod of ``names`` Running and reported using its instance, or nothing."""
    running = scene.running(names)
    used = _used_by(scene)
    if not running or not names <= set(used):
        return {}
    assert all(used[n][0] == running[n] for n in names), (running, used)
    return {n: used[n] for n in names}


def test_unified_pods_get_the_smallest_slice_of_the_right_model(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    # 8000 MiB on an H100-80GB: 1g.10gb. Half an A100-80GB's memory: 3g.40gb (40 GB, the
    # smallest by memory, then compute). 8000 MiB with 30 % of the compute, not on an A100:
    # three of seven slices on the H100, 3g.40gb. Beside them a pod asking a MIG profile by name.
    client.create(
        _unified(scene, "u-h100", gpumem=8000, annotations={"nvidia.com/use-gputype": "H100"})
    )
    client.create(
        _unified(
            scene,
            "u-a100",
            gpumem_percentage=50,
            annotations={"nvidia.com/use-gputype": "A100"},
        )
    )
    client.create(
        _unified(
            scene,
            "u-cores",
            gpumem=8000,
            gpucores=30,
            annotations={"nvidia.com/nouse-gputype": "A100"},
        )
    )
    client.create(scene.pod("by-name", "1g.10gb"))
    gated = {
        p.metadata.name
        for p in scene.pods()
        if p.metadata is not None and (p.metadata.labels or {}).get("migpilot.io/gated")
    }
    assert {"u-h100", "u-a100", "u-cores"} <= gated
    got = scene.wait(lambda: _served(scene, {"u-h100", "u-a100", "u-cores"}), "unified pods")
    assert got["u-h100"][0] == "ctl-h100" and got["u-h100"][2] == "1g.10gb"
    assert got["u-a100"][0] == "ctl-a100" and got["u-a100"][2] == "3g.40gb"
    assert got["u-cores"][0] == "ctl-h100" and got["u-cores"][2] == "3g.40gb"
    scene.wait(lambda: scene.running({"by-name"}), "the pod asking for 1g.10gb by name")
    # The node advertises what kube-scheduler checked: one nvidia.com/gpu per unified pod's
    # instance (two on the H100 node), and the GPU-memory counters.
    node = client.get(Node, "ctl-h100")
    assert node.status is not None and node.status.allocatable is not None
    assert node.status.allocatable["nvidia.com/gpu"] == "2"
    assert int(node.status.allocatable["nvidia.com/gpumem"]) > 0

    # Once allocated, the reservations are gone from the spec and the instances stay used.
    def released() -> bool:
        for name in NODES:
            lay = scene.layout(name)
            if lay is None or any(i.reserved_for for g in lay.spec.gpus for i in g.instances):
                return False
        return True

    scene.wait(released, "reservations released once allocated")
    assert set(_used_by(scene)) >= {"u-h100", "u-a100", "u-cores"}


@pytest.mark.parametrize(
    ("model", "policy", "same_gpu"),
    [("A100", "binpack", True), ("H100", "spread", False)],
    ids=["binpack-one-gpu", "spread-two-gpus"],
)
def test_gpu_policies_pack_or_spread_a_nodes_unified_pods(
    scene: Scene, model: str, policy: str, same_gpu: bool
) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    asked = {"nvidia.com/use-gputype": model, "hami.io/gpu-scheduler-policy": policy}
    for name in ("p0", "p1"):
        client.create(_unified(scene, name, gpumem=8000, annotations=asked))
    got = scene.wait(lambda: _served(scene, {"p0", "p1"}), "two unified pods")
    assert got["p0"][0] == got["p1"][0] == f"ctl-{model.lower()}"
    assert (got["p0"][1] == got["p1"][1]) is same_gpu, got


def test_node_spread_puts_unified_pods_on_different_nodes(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    spread = {"hami.io/node-scheduler-policy": "spread"}
    for name in ("n0", "n1"):
        client.create(_unified(scene, name, gpumem=8000, annotations=spread))
    got = scene.wait(lambda: _served(scene, {"n0", "n1"}), "two unified pods")
    assert {got["n0"][0], got["n1"][0]} == set(NODES), got


def _users(scene: Scene) -> list[str]:
    """Every ``usedBy`` the agents report, one entry per instance."""
    return [
        i.used_by
        for n in NODES
        if (lay := scene.layout(n)) is not None and lay.status is not None
        for g in lay.status.gpus
        for i in g.instances
        if i.used_by is not None
    ]


def test_every_component_killed_with_unified_pods_in_flight_loses_nothing(scene: Scene) -> None:
    """The controller and both agents die (SIGKILL) with reservations made and not yet
    allocated; once back, every pod gets one instance of its own, no reservation expires, and
    an agent restarted after the allocations keeps every pod's instance (its ledger)."""
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    names = {f"w{i}" for i in range(6)}
    for name in sorted(names):
        client.create(_unified(scene, name, gpumem=20000))

    def reserved() -> bool:
        return any(
            i.reserved_for
            for n in NODES
            if (lay := scene.layout(n)) is not None
            for g in lay.spec.gpus
            for i in g.instances
        )

    scene.wait(reserved, "a reservation")
    killed = [scene.controllers["c1"], *(scene.agents[n] for n in NODES)]
    for component in killed:
        component.signal(signal.SIGKILL)
    for component in killed:
        component.process.wait()
    for node, model in NODES.items():
        scene.start_agent(node, f"emulated:{model}:x2")
    scene.start_controller("c2")
    scene.wait(lambda: _served(scene, names), "every pod served after the restarts")
    # Each pod got one instance of its own: as many instances are used as pods, each by one.
    expected = sorted(f"{scene.namespace}/{n}" for n in names)
    assert sorted(_users(scene)) == expected
    assert not any(
        e.reason == "MigReservationExpired" for e in client.list(Event, namespace=scene.namespace)
    )

    # Allocated now: an agent restarted again keeps every instance its pods use.
    def used_by() -> dict[str, str]:
        """Instance UUID -> the pod using it, from the GpuLayouts' status."""
        return {
            i.uuid: i.used_by
            for n in NODES
            if (lay := scene.layout(n)) is not None and lay.status is not None
            for g in lay.status.gpus
            for i in g.instances
            if i.used_by is not None and i.uuid is not None
        }

    used = used_by()
    assert len(used) == len(names), used
    logs = {node: scene.root / f"agent-{node}.log" for node in NODES}
    offsets = {node: logs[node].stat().st_size for node in NODES}
    for node, model in NODES.items():
        scene.agents[node].signal(signal.SIGKILL)
        scene.agents[node].process.wait()
        scene.start_agent(node, f"emulated:{model}:x2")

    def reported_again() -> bool:
        return all(
            "status written" in logs[n].read_bytes()[offsets[n] :].decode(errors="replace")
            for n in NODES
        )

    scene.wait(reported_again, "a status from each restarted agent")
    assert sorted(_users(scene)) == expected
    # Nothing in use destroyed: the very instances (same UUIDs) are used by the same pods.
    assert used_by() == used


def test_a_unified_request_nothing_can_serve_is_let_go_with_the_reason(scene: Scene) -> None:
    client = scene.client
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    client.create(_unified(scene, "huge", gpumem=200000))

    def warned() -> list[str]:
        # kube-scheduler's own FailedScheduling Warning may come first: wait for migpilot's.
        return [
            e.message or ""
            for e in client.list(Event, namespace=scene.namespace)
            if e.involvedObject.name == "huge"
            and e.type == "Warning"
            and e.reason == "MigRequestUnservable"
        ]

    messages = scene.wait(warned, "migpilot's Warning on the pod")
    assert any("MiB" in m for m in messages), messages
