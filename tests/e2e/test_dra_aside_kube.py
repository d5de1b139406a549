"""A DRA node set aside for the one pod no node can take now, on the real v1.37.2 control plane
(issue 26, ``docs/dra.md``, "A node set aside").

Two KWOK nodes labelled ``migpilot.io/mode=dra`` (one emulated H100 80GB each), each with its
``migpilot agent`` and a :class:`tests.kube.drakubelet.DraKubelet` preparing claims through the
agent's plugin, with the webhook and the controller as shipped. Every pod is gated by the webhook
(it reads the pod's template) and planned by the controller; the real kube-scheduler allocates
the claims.

A long ``2g.20gb`` runs on ``dra-a`` and a short ``1g.10gb`` on ``dra-b`` (node selectors put
them there). A ``7g.80gb`` then fits neither: it alone waits, so the controller sets aside
``dra-b`` (one compute slice in use against two) and says so in an Event. A ``1g.10gb`` that
comes next, with no node selector, is kept off ``dra-b`` and runs on ``dra-a``; once the short
pod goes, the ``7g.80gb`` runs on ``dra-b``. Without the node set aside the later ``1g.10gb``
runs on ``dra-b``, the node with the most CPU left (kube-scheduler's LeastAllocated; the long
pod asks 8 CPUs, the others 1), and the ``7g.80gb`` never does.

Every wait has a generous timeout; no duration decides whether a test passes.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Pod
from lightkube.resources.resource_v1 import ResourceSlice

from migpilot.agent.dra import publishing
from tests.kube import controlplane, drapods, kwokstages, system, tools
from tests.kube.drakubelet import DraKubelet

pytestmark = pytest.mark.kube

REPO = Path(__file__).resolve().parents[2]
DEVICE_CLASS = REPO / "deploy" / "dra" / "deviceclass.yaml"
NODES = ("dra-a", "dra-b")
WAIT_S = 120.0
T = TypeVar("T")


@dataclasses.dataclass
class Scene:
    plane: controlplane.ControlPlane
    system: system.System
    kubelets: dict[str, DraKubelet]
    namespace: str

    @property
    def client(self) -> lightkube.Client:
        return self.plane.client

    def wait(self, probe: Callable[[], T | None], what: str) -> T:
        return drapods.wait(self.system, probe, what, timeout=WAIT_S, dump=self.dump)

    def dump(self) -> str:
        return "\n".join(drapods.described(self.client, self.namespace)) + "\n" + self.system.logs()

    def pod(self, name: str, profile: str, *, cpu: str, node: str | None = None) -> None:
        """A pod of one claim of ``profile`` (its template, made here) asking ``cpu``, through
        the webhook."""
        template = f"only-{profile.replace('.', '-')}"
        self._template(template, profile)
        self.client.create(
            drapods.claim_pod(
                name, self.namespace, template=template, requests={"cpu": cpu}, node=node
            )
        )

    def _template(self, name: str, profile: str) -> None:
        """The template of one device of ``profile`` (kept if an earlier pod made it)."""
        cel = f'device.attributes["{publishing.DRIVER}"].profile == "{profile}"'
        request = {
            "deviceClassName": publishing.DRIVER,
            "selectors": [{"cel": {"expression": cel}}],
        }
        doc: dict[str, Any] = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": self.namespace},
            "spec": {"spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}}},
        }
        try:
            self.client.create(codecs.from_dict(doc))
        except lightkube.ApiError as err:
            if err.status.code != 409:
                raise

    def running_on(self, name: str) -> str | None:
        got = self.client.get(Pod, name, namespace=self.namespace)
        assert got.status is not None and got.spec is not None
        return got.spec.nodeName if got.status.phase == "Running" else None

    def gated(self, name: str) -> bool:
        got = self.client.get(Pod, name, namespace=self.namespace)
        assert got.spec is not None
        return bool(got.spec.schedulingGates)

    def events(self, pod: str, reason: str) -> list[str]:
        return [
            e.message or ""
            for e in self.client.list(
                Event,
                namespace=self.namespace,
                fields={"involvedObject.name": pod, "reason": reason},
            )
        ]


@pytest.fixture(scope="module")
def scene(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scene]:
    root = tmp_path_factory.mktemp("dra-aside")
    found = tools.locate()
    stages = kwokstages.kwok_stages(
        found.kwok_stages,
        nodes=NODES,
        folder=root / "stages",
        names=(kwokstages.POD_READY, kwokstages.POD_DELETE),
    )
    plane = controlplane.ControlPlane.start(found=dataclasses.replace(found, kwok_stages=stages))
    sys_ = system.System(plane, root)
    kubelets: dict[str, DraKubelet] = {}
    folders: list[Path] = []
    namespace = f"aside-{uuid.uuid4().hex[:6]}"
    try:
        sys_.prepare()
        plane.client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        for doc in yaml.safe_load_all(DEVICE_CLASS.read_text()):
            if doc:
                plane.client.create(codecs.from_dict(doc))
        sys_.start_webhook()
        for node in NODES:
            # A short folder: a unix socket's path has at most 107 bytes.
            folder = Path(tempfile.mkdtemp(prefix="mpas-"))
            folders.append(folder)
            kubelet = DraKubelet(folder, node=node, kubeconfig=plane.kubeconfig)
            kubelet.start()
            kubelets[node] = kubelet
            plane.add_node(
                node,
                labels={"migpilot.io/mode": "dra"},
                resources={"cpu": "32", "memory": "256Gi"},
            )
            sys_.nodes.append(node)
            (root / f"proc-{node}").mkdir()
            sys_.start_agent(
                node,
                "emulated:h100-80gb:x1",
                "--proc-root", str(root / f"proc-{node}"),
                "--cdi-spec-dir", str(root / f"cdi-{node}"),
                "--interval", "2",
                kubelet=str(folder),
            )  # fmt: skip
        sys_.start_controller("c1")
        scene = Scene(plane, sys_, kubelets, namespace)

        def ready() -> bool:
            pools = {
                s.to_dict()["spec"]["pool"]["name"]
                for s in plane.client.list(ResourceSlice, fields={"spec.driver": publishing.DRIVER})
            }
            return pools == set(NODES) and all(k.registered for k in kubelets.values())

        scene.wait(ready, "both nodes' pools published and their plugins registered")
        yield scene
    finally:
        for kubelet in kubelets.values():
            kubelet.stop()
        sys_.stop()
        plane.stop()
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


def test_a_node_is_set_aside_for_the_pod_of_a_whole_gpu_and_it_runs_there(scene: Scene) -> None:
    scene.pod("long", "2g.20gb", cpu="8", node="dra-a")
    scene.pod("short", "1g.10gb", cpu="1", node="dra-b")
    scene.wait(lambda: scene.running_on("long") == "dra-a" or None, "long Running on dra-a")
    scene.wait(lambda: scene.running_on("short") == "dra-b" or None, "short Running on dra-b")
    scene.pod("whole", "7g.80gb", cpu="1")
    (message,) = scene.wait(
        lambda: scene.events("whole", "MigDraNodeSetAside") or None, "whole told of dra-b"
    )
    assert message.startswith("no node can take it now; node dra-b could once its instances end")
    scene.pod("later", "1g.10gb", cpu="1")
    assert scene.wait(lambda: scene.running_on("later"), "later Running") == "dra-a"
    assert scene.gated("whole")  # still held by migpilot: no node can take it
    scene.client.delete(Pod, "short", namespace=scene.namespace)
    assert scene.wait(lambda: scene.running_on("whole"), "whole Running") == "dra-b"
    assert len(scene.events("whole", "MigDraNodeSetAside")) == 1
    for name, kubelet in scene.kubelets.items():
        refused = [e for e in kubelet.errors() if e.startswith(("prepare ", "unprepare "))]
        assert not refused, (name, refused)
