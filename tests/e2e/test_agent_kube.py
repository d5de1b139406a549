"""``migpilot agent --node`` as a real process against the real control plane of tests/kube.

The agent runs with emulated GPUs on a KWOK node with the stand-in kubelet (``--kubelet
simulated``: the resource counts go into the Node's capacity); the test writes the GpuLayout's
spec as the controller would (server-side apply, ``migpilot-controller``) and waits, with
generous timeouts and never a sleep deciding a pass, for the agent's status and the Node's labels.
"""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import lightkube
import pytest
from lightkube import codecs
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import ConfigMap, Node, Pod
from lightkube.types import PatchType

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from tests.kube import crds
from tests.kube.agents import AgentProcess
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube

NODE = "agent-kube-node"
POD = "agent-kube-pod"


@pytest.fixture
def agent(control_plane: ControlPlane) -> Iterator[AgentProcess]:
    crds.ensure_gpulayouts(control_plane)
    control_plane.add_node(NODE)
    root = pathlib.Path(tempfile.mkdtemp(prefix="mpk"))
    a = AgentProcess(
        control_plane,
        root,
        node=NODE,
        args=["--backend", "emulated:h100-80gb:x2", "--kubelet", "simulated", "--interval", "5"],
    )
    yield a
    if a.process is not None:
        a.process.kill()
        a.process.wait()
    client = control_plane.client
    for res, name, ns in ((Pod, POD, "default"), (crds.GpuLayout, NODE, None), (Node, NODE, None)):
        try:
            client.delete(res, name, namespace=ns, grace_period=0)
        except lightkube.ApiError as e:
            if e.status.code != 404:
                raise
    shutil.rmtree(root, ignore_errors=True)


def _apply_spec(plane: ControlPlane, gpus: list[gl.GpuSpec]) -> None:
    doc = wire.spec_patch(NODE, gl.LayoutSpec(tuple(gpus)))
    plane.client.apply(
        codecs.from_dict(dict(doc)), field_manager=gl.CONTROLLER_FIELD_MANAGER, force=True
    )


def _layout(plane: ControlPlane) -> gl.GpuLayout | None:
    try:
        doc: dict[str, Any] = plane.client.get(crds.GpuLayout, NODE).to_dict()
    except lightkube.ApiError as e:
        if e.status.code == 404:
            return None
        raise
    return wire.parse(doc)


def _reports(plane: ControlPlane, generation: int, want: dict[int, set[str]]) -> bool:
    """The status is for ``generation``, Ready, and each GPU holds ``want`` (profile@start)."""
    got = _layout(plane)
    if got is None or got.status is None or got.status.observed_generation != generation:
        return False
    ready = [c for c in got.status.conditions if c.type == gl.READY]
    if not ready or ready[0].status is not gl.ConditionStatus.TRUE:
        return False
    held = {g.index: {f"{i.profile}@{i.start}" for i in g.instances} for g in got.status.gpus}
    return all(held.get(index) == insts for index, insts in want.items())


def test_agent_follows_its_gpulayout_and_reports_status(
    control_plane: ControlPlane, agent: AgentProcess
) -> None:
    agent.start()
    _apply_spec(
        control_plane,
        [
            gl.GpuSpec(
                0, "h100-80gb", (gl.InstanceSpec("1g.10gb", 0), gl.InstanceSpec("3g.40gb", 4))
            )
        ],
    )
    want0 = {0: {"1g.10gb@0", "3g.40gb@4"}}
    agent.wait(lambda: _reports(control_plane, 1, want0), "the status of generation 1")
    got = _layout(control_plane)
    assert got is not None and got.status is not None
    (gpu0,) = [g for g in got.status.gpus if g.index == 0]
    assert all(i.uuid and i.uuid.startswith("MIG-") for i in gpu0.instances)
    assert {i.state for i in gpu0.instances} == {gl.InstanceState.FREE}
    assert got.status.summary.free == 2
    kept = next(i.uuid for i in gpu0.instances if i.start == 4)

    # The Node gets GFD's labels.
    def labelled() -> bool:
        node = control_plane.client.get(Node, NODE)
        labels = (node.metadata.labels if node.metadata else None) or {}
        return labels.get("nvidia.com/mig-1g.10gb.count") == "1"

    agent.wait(labelled, "the Node's GFD labels")

    # The stand-in kubelet publishes the counts, and kube-scheduler places a pod on them.
    def allocatable(resource: str, count: str) -> bool:
        status = control_plane.client.get(Node, NODE).status
        return ((status.allocatable if status else None) or {}).get(resource) == count

    agent.wait(lambda: allocatable("nvidia.com/mig-3g.40gb", "1"), "the Node's allocatable")
    assert allocatable("nvidia.com/mig-1g.10gb", "1")
    limits = {"nvidia.com/mig-3g.40gb": "1"}
    pod = Pod(
        metadata=ObjectMeta(name=POD, namespace="default"),
        spec=PodSpec(
            nodeSelector={"kubernetes.io/hostname": NODE},
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ],
        ),
    )
    control_plane.client.create(pod)

    def bound() -> bool:
        got = control_plane.client.get(Pod, POD, namespace="default")
        return got.spec is not None and got.spec.nodeName == NODE

    agent.wait(bound, "kube-scheduler to bind the pod to the node")

    # The controller changes the spec: only the changed instance moves, and a reservation shows.
    _apply_spec(
        control_plane,
        [
            gl.GpuSpec(
                0,
                "h100-80gb",
                (gl.InstanceSpec("2g.20gb", 0, "default/p1"), gl.InstanceSpec("3g.40gb", 4)),
            )
        ],
    )
    want1 = {0: {"2g.20gb@0", "3g.40gb@4"}}
    agent.wait(lambda: _reports(control_plane, 2, want1), "the status of generation 2")
    agent.wait(lambda: allocatable("nvidia.com/mig-1g.10gb", "0"), "1g.10gb to go to 0")
    assert allocatable("nvidia.com/mig-2g.20gb", "1")
    got = _layout(control_plane)
    assert got is not None and got.status is not None
    (gpu0,) = [g for g in got.status.gpus if g.index == 0]
    states = {f"{i.profile}@{i.start}": (i.state, i.uuid) for i in gpu0.instances}
    assert states["2g.20gb@0"][0] is gl.InstanceState.RESERVED
    # The bound pod holds the 3g.40gb (the simulated kubelet assigned it, as Allocate would).
    assert states["3g.40gb@4"] == (gl.InstanceState.USED, kept)

    # A spec without the pod's instance does not destroy it while the pod lives.
    _apply_spec(control_plane, [gl.GpuSpec(0, "h100-80gb", (gl.InstanceSpec("1g.10gb", 0),))])

    def status_of(generation: int) -> dict[str, gl.InstanceState] | None:
        got = _layout(control_plane)
        if got is None or got.status is None or got.status.observed_generation != generation:
            return None
        (gpu0,) = [g for g in got.status.gpus if g.index == 0]
        return {f"{i.profile}@{i.start}": i.state for i in gpu0.instances}

    agent.wait(
        lambda: status_of(3) == {"1g.10gb@0": gl.InstanceState.FREE,
                                 "3g.40gb@4": gl.InstanceState.USED},
        "the status of generation 3 with the pod's instance kept, used",
    )  # fmt: skip
    control_plane.client.delete(Pod, POD, namespace="default", grace_period=0)
    agent.wait(
        lambda: status_of(3) == {"1g.10gb@0": gl.InstanceState.FREE},
        "the pod's instance to go once the pod is deleted",
    )
    assert agent.stop() == 0


STATIC_CONFIG = """version: v1
mig-configs:
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "1g.10gb": 7
  all-3g.40gb:
    - devices: all
      mig-enabled: true
      mig-devices:
        "3g.40gb": 2
"""


def test_a_static_label_lays_the_node_out_from_a_configmap_until_it_is_removed(
    control_plane: ControlPlane, agent: AgentProcess
) -> None:
    """mig-manager's way in a cluster: the Node's nvidia.com/mig.config names a config of the
    mig-parted file in a ConfigMap; switching it re-lays the node out, a bad name fails without
    changing anything, and removing it gives the node back to its GpuLayout."""
    client = control_plane.client
    client.apply(
        ConfigMap(
            metadata=ObjectMeta(name="agent-kube-static", namespace="default"),
            data={"mig.yaml": STATIC_CONFIG},
        ),
        field_manager="e2e",
    )
    agent.args += ["--mig-parted-configmap", "default/agent-kube-static:mig.yaml"]
    _apply_spec(control_plane, [])  # the empty GpuLayout the controller creates
    try:
        agent.start()
        agent.wait(lambda: _reports(control_plane, 1, {}), "the first status")

        def label(value: str | None) -> None:
            patch = {"metadata": {"labels": {"nvidia.com/mig.config": value}}}
            client.patch(Node, NODE, patch, patch_type=PatchType.MERGE)

        def node_has(state: str, counts: dict[str, str]) -> bool:
            node = client.get(Node, NODE)
            labels = (node.metadata.labels if node.metadata else None) or {}
            got = (node.status.allocatable if node.status else None) or {}
            return labels.get("nvidia.com/mig.config.state") == state and all(
                got.get(k) == v for k, v in counts.items()
            )

        def held() -> dict[int, list[str]]:
            got = _layout(control_plane)
            assert got is not None and got.status is not None
            return {
                g.index: sorted(f"{i.profile}@{i.start}" for i in g.instances)
                for g in got.status.gpus
            }

        label("all-1g.10gb")
        ones = sorted(f"1g.10gb@{s}" for s in range(7))
        agent.wait(
            lambda: node_has("success", {"nvidia.com/mig-1g.10gb": "14"}),
            "14 1g.10gb instances, state success, in the Node's allocatable",
        )
        agent.wait(lambda: held() == {0: ones, 1: ones}, "the status to show them")

        label("all-3g.40gb")
        threes = ["3g.40gb@0", "3g.40gb@4"]
        agent.wait(
            lambda: node_has(
                "success", {"nvidia.com/mig-3g.40gb": "4", "nvidia.com/mig-1g.10gb": "0"}
            ),
            "the switch to all-3g.40gb",
        )
        agent.wait(lambda: held() == {0: threes, 1: threes}, "the status of all-3g.40gb")

        label("no-such-config")

        def invalid() -> bool:
            got = _layout(control_plane)
            if got is None or got.status is None:
                return False
            (ready,) = got.status.conditions
            return ready.reason == "InvalidConfig" and "no-such-config" in ready.message

        agent.wait(lambda: node_has("failed", {}) and invalid(), "state failed, InvalidConfig")
        assert held() == {0: threes, 1: threes}, "a bad name changed the GPUs"

        label(None)
        _apply_spec(
            control_plane,
            [gl.GpuSpec(0, "h100-80gb", (gl.InstanceSpec("4g.40gb", 0),))],
        )
        agent.wait(
            lambda: _reports(control_plane, 2, {0: {"4g.40gb@0"}, 1: set(threes)}),
            "the GpuLayout's spec again (GPU 1, which it does not list, left alone)",
        )
        agent.wait(
            lambda: node_has("success", {"nvidia.com/mig-4g.40gb": "1"}),
            "the 4g.40gb in the Node's allocatable",
        )
        assert agent.stop() == 0
    finally:
        client.delete(ConfigMap, "agent-kube-static", namespace="default")


def _gpu0(plane: ControlPlane, generation: int) -> dict[str, tuple[gl.InstanceState, str]] | None:
    """GPU 0's instances (``profile@start`` -> state, uuid) in the status of ``generation``."""
    got = _layout(plane)
    if got is None or got.status is None or got.status.observed_generation != generation:
        return None
    (gpu0,) = [g for g in got.status.gpus if g.index == 0]
    return {f"{i.profile}@{i.start}": (i.state, i.uuid or "") for i in gpu0.instances}


def _states(plane: ControlPlane, generation: int) -> dict[str, gl.InstanceState] | None:
    got = _gpu0(plane, generation)
    return None if got is None else {k: state for k, (state, _) in got.items()}


def test_a_bound_pod_gets_its_reserved_instance_which_outlives_the_spec_until_the_pod_goes(
    control_plane: ControlPlane, agent: AgentProcess
) -> None:
    """The controller's path, played by the test: a spec reserving an instance for a pod, the
    pod bound by kube-scheduler, the simulated kubelet handing it that instance (not the first
    free one), an agent restart that moves nothing, a spec without it that destroys nothing,
    and the pod's deletion that lets the spec's change through."""
    client, free, used = control_plane.client, gl.InstanceState.FREE, gl.InstanceState.USED
    agent.start()
    ones = [gl.InstanceSpec("1g.10gb", s) for s in (0, 1)]
    _apply_spec(
        control_plane,
        [gl.GpuSpec(0, "h100-80gb", (*ones, gl.InstanceSpec("1g.10gb", 2, f"default/{POD}")))],
    )
    reserved = {"1g.10gb@0": free, "1g.10gb@1": free, "1g.10gb@2": gl.InstanceState.RESERVED}
    agent.wait(lambda: _states(control_plane, 1) == reserved, "the reserved instance")
    status = _gpu0(control_plane, 1)
    assert status is not None
    uuid = status["1g.10gb@2"][1]
    assert uuid.startswith("MIG-")

    def allocatable() -> str | None:
        got = client.get(Node, NODE).status
        return ((got.allocatable if got else None) or {}).get("nvidia.com/mig-1g.10gb")

    agent.wait(lambda: allocatable() == "3", "three 1g.10gb in the Node's allocatable")
    limits = {"nvidia.com/mig-1g.10gb": "1"}
    client.create(
        Pod(
            metadata=ObjectMeta(name=POD, namespace="default"),
            spec=PodSpec(
                nodeSelector={"kubernetes.io/hostname": NODE},
                containers=[
                    Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
                ],
            ),
        )
    )

    def running() -> bool:
        got = client.get(Pod, POD, namespace="default")
        bound = got.spec is not None and got.spec.nodeName == NODE
        return bound and got.status is not None and got.status.phase == "Running"

    agent.wait(running, "kube-scheduler to bind the pod and KWOK to run it")
    held = {"1g.10gb@0": free, "1g.10gb@1": free, "1g.10gb@2": used}
    agent.wait(lambda: _states(control_plane, 1) == held, "the reserved instance reported used")
    assert f"pod default/{POD} gets {uuid} (simulated Allocate)" in agent.log_text()

    # The controller drops the reservation once the pod is bound; the agent restarts: the pod
    # keeps its instance (not the first free one, which it would get afresh).
    _apply_spec(control_plane, [gl.GpuSpec(0, "h100-80gb", (*ones, gl.InstanceSpec("1g.10gb", 2)))])
    agent.wait(lambda: _states(control_plane, 2) == held, "the status of generation 2")
    assert agent.stop() == 0
    agent.start()
    # As a kubelet reads its checkpoint, the restarted stand-in gives the pod back its own
    # instance (no second Allocate).
    agent.wait(
        lambda: f"pod default/{POD} keeps {uuid} (from the checkpoint)" in agent.log_text(),
        "the restarted agent to give the pod back the same instance",
    )
    assert agent.log_text().count(f"pod default/{POD} gets {uuid} (simulated Allocate)") == 1
    # The restarted agent's first status equals the last one, so nothing changes on the server.
    assert _states(control_plane, 2) == held

    # A spec without the pod's instance: the agent keeps it (still on the GPU, still used).
    _apply_spec(control_plane, [gl.GpuSpec(0, "h100-80gb", tuple(ones))])
    agent.wait(lambda: _states(control_plane, 3) == held, "the status of generation 3")
    agent.wait(
        lambda: (
            "1g.10gb@2" in agent.log_text()
            and "not in the desired layout; kept" in agent.log_text()
        ),
        "the agent to log the kept instance",
    )
    assert uuid in (agent.root / "gpus.json").read_text()
    assert f"destroy 1g.10gb@2 ({uuid})" not in agent.log_text()

    # The pod goes: the instance is released, then destroyed as the spec asks.
    client.delete(Pod, POD, namespace="default", grace_period=0)
    gone = {"1g.10gb@0": free, "1g.10gb@1": free}
    agent.wait(lambda: _states(control_plane, 3) == gone, "the instance destroyed")
    assert uuid not in (agent.root / "gpus.json").read_text()
    assert f"GPU 0: destroy 1g.10gb@2 ({uuid})" in agent.log_text()
    assert f"pod default/{POD} released {uuid}" in agent.log_text()
    assert agent.stop() == 0
