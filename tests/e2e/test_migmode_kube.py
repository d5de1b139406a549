"""Dynamic MIG mode on a real control plane (``docs/migmode.md``): whole GPUs beside MIG.

Two KWOK nodes with two emulated H100s each, every GPU in MIG mode; ``dyn-h100`` is labelled
``migpilot.io/mig-mode=dynamic``, ``plain-h100`` is not. A MIG pod (gated by the webhook,
planned, pinned) runs on one GPU of the dynamic node. The controller's Lease says a node is
labelled dynamic, so the webhook gates a pod asking ``nvidia.com/gpu: 1`` (no gpumem: a whole
GPU) on creation; the controller plans it on the dynamic node's idle GPU, reserves that GPU
whole in the GpuLayout spec (``mig: false``, ``reservedFor``), the agent withdraws it, switches
it out of MIG and advertises it as ``nvidia.com/gpu``, the controller pins the pod to the node
(its node affinity narrowed, the gate removed) and kube-scheduler binds it there.
The MIG pod's instance is untouched (same UUID, same place). A second whole-GPU pod finds no
idle GPU on the dynamic node and waits, gated: the unlabelled node's GPUs are never switched.
"""

from __future__ import annotations

import threading

import pytest
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Event, Node, Pod

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.api import leases
from tests.kube import controlplane, crds
from tests.kube.scenes import Scene, container

pytestmark = pytest.mark.kube

DYN = "dyn-h100"
PLAIN = "plain-h100"
MODE_LABEL = "migpilot.io/mig-mode"
STATE_LABEL = "migpilot.io/mig-mode.state"
WAIT_S = 300.0
"""Generous: the scene's processes share two CPUs with other work."""


class _Reservations:
    """Every whole-GPU reservation a node's GpuLayout spec held, ``(gpu, mig, pod)``, from a
    watch: polling can miss one, since the controller drops it as soon as the pod is bound."""

    def __init__(self, scene: Scene, node: str) -> None:
        self.kept: set[tuple[int, bool | None, str]] = set()
        self._client = controlplane.client_for(scene.plane.kubeconfig)
        self._node = node
        self._stop = threading.Event()
        first = self._client.get(crds.GpuLayout, node)
        assert first.metadata is not None
        self._seen(first.to_dict())
        self._version = first.metadata.resourceVersion
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _seen(self, doc: dict[str, object]) -> None:
        for g in wire.parse(doc).spec.gpus:
            if g.reserved_for is not None:
                self.kept.add((g.index, g.mig, g.reserved_for))

    def _run(self) -> None:
        try:
            for _, obj in self._client.watch(
                crds.GpuLayout,
                fields={"metadata.name": self._node},
                resource_version=self._version,
            ):
                if self._stop.is_set():
                    return
                self._seen(obj.to_dict())
        except Exception:  # the stream breaks when the control plane stops
            if not self._stop.is_set():
                raise

    def stop(self) -> None:
        self._stop.set()


def _whole(scene: Scene, name: str) -> Pod:
    limits = {"nvidia.com/gpu": "1"}
    return Pod(
        metadata=ObjectMeta(name=name, namespace=scene.namespace),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ]
        ),
    )


def _mig_pod(scene: Scene, name: str) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=scene.namespace),
        spec=PodSpec(containers=[container("3g.40gb")], nodeSelector={MODE_LABEL: "dynamic"}),
    )


def _status(scene: Scene, node: str) -> tuple[gl.GpuStatus, ...]:
    lay = scene.layout(node)
    return lay.status.gpus if lay is not None and lay.status is not None else ()


def _used(scene: Scene) -> list[tuple[int, int, str, str | None]]:
    """(GPU, start, profile, UUID) of the dynamic node's used instances."""
    return [
        (g.index, i.start, i.profile, i.uuid)
        for g in _status(scene, DYN)
        for i in g.instances
        if i.state is gl.InstanceState.USED
    ]


def _labels(scene: Scene, node: str) -> dict[str, str]:
    got = scene.client.get(Node, node)
    return dict(got.metadata.labels or {}) if got.metadata is not None else {}


def _allocatable(scene: Scene, node: str) -> dict[str, str]:
    got = scene.client.get(Node, node)
    return dict(got.status.allocatable or {}) if got.status is not None else {}


def _gated(pod: Pod) -> bool:
    return pod.spec is not None and any(
        g.name == "migpilot.io/plan" for g in pod.spec.schedulingGates or ()
    )


def _pinned_to(pod: Pod) -> list[str]:
    """The node names its required node affinity confines it to (``matchFields``)."""
    spec = pod.spec
    affinity = spec.affinity if spec is not None else None
    node = affinity.nodeAffinity if affinity is not None else None
    required = node.requiredDuringSchedulingIgnoredDuringExecution if node is not None else None
    return [
        value
        for term in (required.nodeSelectorTerms if required is not None else ())
        for field in term.matchFields or ()
        if field.key == "metadata.name"
        for value in field.values or ()
    ]


def _untouched_plain(scene: Scene) -> None:
    """The unlabelled node: no mode asked or reported, nothing whole advertised, no label."""
    lay = scene.layout(PLAIN)
    assert lay is not None and lay.status is not None
    assert all(g.mig is None and g.reserved_for is None for g in lay.spec.gpus), lay.spec
    assert all(g.mig_mode is None for g in lay.status.gpus), lay.status
    assert "nvidia.com/gpu" not in _allocatable(scene, PLAIN)
    assert STATE_LABEL not in _labels(scene, PLAIN)


def test_a_whole_gpu_pod_runs_on_a_gpu_switched_out_of_mig_beside_a_mig_pod(
    dynamic_scene: Scene,
) -> None:
    scene = dynamic_scene
    client = scene.client
    scene.start_controller("c1")
    scene.wait(
        lambda: len(_status(scene, DYN)) == 2 and len(_status(scene, PLAIN)) == 2,
        "both agents' first status",
        WAIT_S,
    )
    # The dynamic node reports every GPU's mode (all MIG at start); the other node none.
    scene.wait(
        lambda: all(g.mig_mode == gl.MigModeStatus(True, True) for g in _status(scene, DYN)),
        "the dynamic node's GPUs reported in MIG mode",
        WAIT_S,
    )
    _untouched_plain(scene)
    # The controller says on its Lease that a node is labelled dynamic (the webhook reads it).
    scene.wait(
        lambda: (
            (lease := client.get(Lease, leases.NAME, namespace=scene.lease_ns)).metadata is not None
            and (lease.metadata.annotations or {}).get(leases.DYNAMIC_MIG_ANNOTATION) == "true"
        ),
        "the Lease saying a node is dynamic",
        WAIT_S,
    )

    client.create(_mig_pod(scene, "m"))
    got = scene.wait(lambda: scene.running({"m"}), "the MIG pod Running", WAIT_S)
    assert got["m"] == DYN
    (before,) = scene.wait(lambda: _used(scene), "the MIG pod's instance reported used", WAIT_S)
    mig_gpu = before[0]
    assert before[3]

    # Until it is bound, the GPU planned for it is kept whole for it in the spec.
    reservations = _Reservations(scene, DYN)
    created = client.create(_whole(scene, "w"))
    assert _gated(created), "the whole-GPU pod was not gated on creation"
    got = scene.wait(lambda: scene.running({"w"}), "the whole-GPU pod Running", WAIT_S)
    reservations.stop()
    assert got["w"] == DYN
    assert _pinned_to(client.get(Pod, "w", namespace=scene.namespace)) == [DYN]
    whole_gpu = 1 - mig_gpu
    assert reservations.kept == {(whole_gpu, False, f"{scene.namespace}/w")}
    by_index = {g.index: g for g in _status(scene, DYN)}
    assert by_index[whole_gpu].mig_mode == gl.MigModeStatus(False, False)
    assert by_index[whole_gpu].instances == ()
    assert by_index[mig_gpu].mig_mode == gl.MigModeStatus(True, True)
    assert _used(scene) == [before], "the MIG pod's instance was touched"
    lay = scene.layout(DYN)
    assert lay is not None
    assert {g.index: g.mig for g in lay.spec.gpus} == {mig_gpu: True, whole_gpu: False}
    assert _allocatable(scene, DYN).get("nvidia.com/gpu") == "1"
    scene.wait(lambda: _labels(scene, DYN).get(STATE_LABEL) == "success", "state success", WAIT_S)
    # Bound: the reservation has served its purpose and is released; the GPU stays whole.
    scene.wait(
        lambda: (
            (spec := scene.layout(DYN)) is not None
            and not any(g.reserved_for for g in spec.spec.gpus)
            and {g.index: g.mig for g in spec.spec.gpus}[whole_gpu] is False
        ),
        "the whole GPU's reservation released once bound",
        WAIT_S,
    )

    # A second whole-GPU pod: no idle GPU left on the dynamic node, the other node is not
    # labelled, so it waits, told why, and nothing switches.
    assert _gated(client.create(_whole(scene, "w2")))

    def told() -> list[str]:
        return [
            e.message or ""
            for e in client.list(Event, namespace=scene.namespace)
            if e.involvedObject.name == "w2" and e.reason == "MigWaiting"
        ]

    (message, *_) = scene.wait(told, "the second whole-GPU pod told it waits", WAIT_S)
    assert f"{MODE_LABEL}=dynamic" in message
    pod = client.get(Pod, "w2", namespace=scene.namespace)
    assert pod.spec is not None and not pod.spec.nodeName and _gated(pod)
    _untouched_plain(scene)
    assert _used(scene) == [before]
    assert {g.index: g.mig_mode for g in _status(scene, DYN)}[mig_gpu] == gl.MigModeStatus(
        True, True
    )
