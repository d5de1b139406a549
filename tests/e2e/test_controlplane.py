"""The session's real control plane does what migpilot's controller will rely on.

kube-scheduler binds a pod to the KWOK node whose status advertises the MIG resource it asks
for, and KWOK runs it; a pod held by migpilot's scheduling gate waits, accepts a node affinity
pinning it to a node, and binds there once the gate is lifted; RBAC is on; and the fixture's
teardown (or the death of the test process) leaves no component running.

Every wait has a generous timeout; no duration decides whether a test passes.
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import lightkube
import pytest
from lightkube.models.core_v1 import (
    Affinity,
    Container,
    NodeAffinity,
    NodeSelector,
    NodeSelectorRequirement,
    NodeSelectorTerm,
    PodSchedulingGate,
    PodSpec,
    ResourceRequirements,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.models.rbac_v1 import PolicyRule, RoleRef, Subject
from lightkube.resources.core_v1 import Pod
from lightkube.resources.rbac_authorization_v1 import Role, RoleBinding
from lightkube.types import PatchType

from tests.kube import controlplane, tools
from tests.kube.controlplane import ControlPlane, wait_for

pytestmark = pytest.mark.kube

MIG_1G = "nvidia.com/mig-1g.10gb"
GATE = "migpilot.io/plan"
NS = "default"


def _pod(name: str, *, limits: dict[str, str] | None = None, gated: bool = False) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=NS),
        spec=PodSpec(
            containers=[
                Container(
                    name="main",
                    image="registry.example/never-pulled:1",
                    resources=ResourceRequirements(limits=limits) if limits else None,
                )
            ],
            schedulingGates=[PodSchedulingGate(name=GATE)] if gated else None,
        ),
    )


def _running_on(plane: ControlPlane, name: str) -> Pod | None:
    pod = plane.client.get(Pod, name, namespace=NS)
    if pod.spec and pod.spec.nodeName and pod.status and pod.status.phase == "Running":
        return pod
    return None


def _watched(plane: ControlPlane) -> list[controlplane.Component]:
    return [plane.component(n) for n in ("kube-scheduler", "kwok", "kube-apiserver")]


def test_scheduler_binds_a_mig_pod_to_the_node_advertising_it_and_kwok_runs_it(
    control_plane: ControlPlane,
) -> None:
    control_plane.add_node("cp-plain")
    node = control_plane.add_node(
        "cp-mig", labels={"nvidia.com/mig.strategy": "mixed"}, resources={MIG_1G: "2"}
    )
    assert node.status is not None and node.status.capacity is not None
    assert node.status.capacity[MIG_1G] == "2"
    assert node.metadata is not None and node.metadata.labels is not None
    assert node.metadata.labels["kubernetes.io/hostname"] == "cp-mig"

    control_plane.client.create(_pod("cp-mig-pod", limits={MIG_1G: "1"}))
    pod = wait_for(
        lambda: _running_on(control_plane, "cp-mig-pod"),
        what="cp-mig-pod to be bound and Running",
        watch=_watched(control_plane),
    )
    assert pod.spec is not None and pod.spec.nodeName == "cp-mig"


def test_a_gated_pod_waits_takes_a_node_affinity_and_binds_there_once_ungated(
    control_plane: ControlPlane,
) -> None:
    for name in ("cp-gate-a", "cp-gate-b"):
        control_plane.add_node(name)
    client = control_plane.client
    client.create(_pod("cp-gated", gated=True))

    def gated() -> bool:
        pod = client.get(Pod, "cp-gated", namespace=NS)
        conditions = (pod.status.conditions if pod.status else None) or []
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "SchedulingGated"
            for c in conditions
        )

    wait_for(gated, what="cp-gated to show PodScheduled=False/SchedulingGated")

    pin = Affinity(
        nodeAffinity=NodeAffinity(
            requiredDuringSchedulingIgnoredDuringExecution=NodeSelector(
                nodeSelectorTerms=[
                    NodeSelectorTerm(
                        matchExpressions=[
                            NodeSelectorRequirement(
                                key="kubernetes.io/hostname", operator="In", values=["cp-gate-b"]
                            )
                        ]
                    )
                ]
            )
        )
    )
    client.patch(
        Pod,
        "cp-gated",
        {"spec": {"affinity": pin.to_dict()}},
        namespace=NS,
        patch_type=PatchType.MERGE,
    )
    pod = client.get(Pod, "cp-gated", namespace=NS)
    assert pod.spec is not None and pod.spec.affinity == pin
    assert not pod.spec.nodeName and gated(), "a gated pod must not be scheduled"

    client.patch(
        Pod,
        "cp-gated",
        [{"op": "remove", "path": "/spec/schedulingGates"}],
        namespace=NS,
        patch_type=PatchType.JSON,
    )
    pod = wait_for(
        lambda: _running_on(control_plane, "cp-gated"),
        what="cp-gated to be bound and Running once ungated",
        watch=_watched(control_plane),
    )
    assert pod.spec is not None and pod.spec.nodeName == "cp-gate-b"


def test_rbac_forbids_a_user_nothing_was_granted_until_a_role_allows_it(
    control_plane: ControlPlane,
) -> None:
    kubeconfig = control_plane.user_kubeconfig("cp-nobody", groups=["migpilot:test"])
    with controlplane.client_for(kubeconfig) as nobody:
        with pytest.raises(lightkube.ApiError) as raised:
            list(nobody.list(Pod, namespace=NS))
        assert raised.value.status.code == 403

        admin = control_plane.client
        admin.create(
            Role(
                metadata=ObjectMeta(name="cp-pod-reader", namespace=NS),
                rules=[PolicyRule(apiGroups=[""], resources=["pods"], verbs=["list"])],
            )
        )
        admin.create(
            RoleBinding(
                metadata=ObjectMeta(name="cp-pod-reader", namespace=NS),
                roleRef=RoleRef(
                    apiGroup="rbac.authorization.k8s.io", kind="Role", name="cp-pod-reader"
                ),
                subjects=[
                    Subject(kind="User", name="cp-nobody", apiGroup="rbac.authorization.k8s.io")
                ],
            )
        )
        wait_for(
            lambda: list(nobody.list(Pod, namespace=NS)) is not None, what="the grant to apply"
        )
        with pytest.raises(lightkube.ApiError) as raised:
            list(nobody.list(Pod, namespace="kube-system"))
        assert raised.value.status.code == 403


def test_stop_ends_every_component_and_deletes_the_directory() -> None:
    plane = ControlPlane.start()
    pids, directory = plane.pids, plane.directory
    assert len(pids) == 5 and all(controlplane.process_alive(p) for p in pids)
    plane.stop()
    assert not [p for p in pids if controlplane.process_alive(p)]
    assert not directory.exists()


_CRASHING_PARENT = """
import os, pathlib, signal, sys
from tests.kube import controlplane, tools
d = pathlib.Path(sys.argv[1])
client, peer = controlplane.free_ports(2)
args = controlplane.etcd_args(
    tools.locate().etcd, data_dir=d / "etcd", client_port=client, peer_port=peer
)
etcd = controlplane.launch("etcd", args, log=d / "etcd.log", cwd=d)
print(etcd.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_crashed_test_process_takes_its_components_with_it(tmp_path: pathlib.Path) -> None:
    tools.locate()  # built before the child runs, so the child does not build
    done = subprocess.run(
        [sys.executable, "-c", _CRASHING_PARENT, str(tmp_path)],
        cwd=tools.ROOT,
        stdout=subprocess.PIPE,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == -signal.SIGKILL
    pid = int(done.stdout.strip())
    deadline = time.monotonic() + 30
    while controlplane.process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not controlplane.process_alive(pid), (
        f"etcd (pid {pid}) outlived the process that started it"
    )
