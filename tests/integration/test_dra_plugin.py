"""The DRA kubelet plugin end to end against a fake kubelet on real unix sockets: registration
through the plugin watcher's calls, then NodePrepareResources and NodeUnprepareResources through
the generated stubs of the kubelet's DRA v1 API."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from migpilot.agent import reconciling
from migpilot.agent.cluster import kubeapi
from migpilot.agent.dra import node as dra_node
from migpilot.agent.dra import placements, preparing, serving
from migpilot.agent.dra.memory import MemoryCdi, MemoryClaims, MemoryInstances
from migpilot.gpu import emulated
from migpilot.kube import objects
from migpilot.mig import catalog
from tests.integration.kubelet_dra_fake import FakeDraKubelet, Prepared

GPUS = {0: catalog.resolve_gpu("h100-80gb"), 1: catalog.resolve_gpu("h100-80gb")}
NODE = "node-a"
P = placements.Placement


def claim(name: str, uid: str, devices: list[tuple[str, str]] | None) -> dict[str, Any]:
    """A ResourceClaim in ``default`` allocated (request, device) pairs of this node's pool."""
    status: dict[str, Any] = {}
    if devices is not None:
        results = [
            {"request": r, "driver": placements.DRIVER, "pool": NODE, "device": d}
            for r, d in devices
        ]
        status = {"allocation": {"devices": {"results": results}}}
    return {"metadata": {"namespace": "default", "name": name, "uid": uid}, "status": status}


class Node:
    """The plugin, its in-memory world and the fake kubelet, in one short folder."""

    def __init__(self, root: pathlib.Path) -> None:
        self.claims = MemoryClaims()
        self.instances = MemoryInstances(GPUS)
        self.settings = serving.PluginSettings(
            plugins_dir=root / "plugins", registry_dir=root / "plugins_registry"
        )
        self.specs = MemoryCdi()
        preparer = preparing.Preparer(self.claims, self.instances, GPUS, NODE, specs=self.specs)
        self.plugin = serving.KubeletPlugin(preparer, self.settings)
        self.kubelet = FakeDraKubelet(self.settings.registry_dir)


@pytest.fixture
def node(root: pathlib.Path) -> Iterator[Node]:
    n = Node(root)
    n.plugin.start()
    yield n
    n.plugin.stop()


@pytest.fixture
def registered(node: Node) -> Node:
    (socket,) = node.kubelet.sockets()
    assert node.kubelet.register(socket) is not None
    return node


def test_registration_announces_a_dra_plugin_serving_v1(node: Node) -> None:
    (socket,) = node.kubelet.sockets()
    assert socket == node.settings.registry_dir / "mig.migpilot.io-reg.sock"
    assert not node.plugin.registered.is_set()
    plugin = node.kubelet.register(socket)
    assert plugin is not None
    assert plugin.name == "mig.migpilot.io"
    assert plugin.endpoint == node.settings.plugins_dir / "mig.migpilot.io" / "dra.sock"
    assert plugin.service == "v1.DRAPlugin"
    assert node.plugin.registered.wait(5)
    assert node.plugin.registration_error == ""


def test_a_refused_registration_is_recorded(node: Node) -> None:
    (socket,) = node.kubelet.sockets()
    assert node.kubelet.register(socket, refuse="driver name already registered") is None
    assert not node.plugin.registered.is_set()
    assert node.plugin.registration_error == "driver name already registered"


def test_prepare_is_idempotent_and_unprepare_releases(registered: Node) -> None:
    node = registered
    node.claims.put(claim("a", "uid-a", [("big", "gpu-0-mig-3g-40gb-4")]))
    node.claims.put(
        claim("b", "uid-b", [("one", "gpu-1-mig-1g-10gb-0"), ("two", "gpu-1-mig-2g-20gb-2")])
    )
    asked = [("default", "a", "uid-a"), ("default", "b", "uid-b")]
    first = node.kubelet.prepare(asked)
    assert first["uid-a"] == (
        Prepared(
            ("big",),
            NODE,
            "gpu-0-mig-3g-40gb-4",
            ("mig.migpilot.io/mig=gpu-0-mig-3g-40gb-4",),
            None,
        ),
    )
    prepared_b = first["uid-b"]
    assert isinstance(prepared_b, tuple)
    assert [d.device for d in prepared_b] == ["gpu-1-mig-1g-10gb-0", "gpu-1-mig-2g-20gb-2"]
    assert [d.requests for d in prepared_b] == [("one",), ("two",)]
    # the kubelet calls again (a restart, a second pod): same answer, no second instance
    assert node.kubelet.prepare(asked) == first
    assert node.kubelet.prepare(asked[:1]) == {"uid-a": first["uid-a"]}
    assert node.instances.created == [P(0, "3g.40gb", 4), P(1, "1g.10gb", 0), P(1, "2g.20gb", 2)]
    assert node.kubelet.unprepare([("default", "b", "uid-b")]) == {"uid-b": ""}
    assert node.instances.destroyed == [P(1, "1g.10gb", 0), P(1, "2g.20gb", 2)]
    assert set(node.instances.held) == {P(0, "3g.40gb", 4)}


def test_unprepare_of_an_unknown_claim_is_a_success(registered: Node) -> None:
    node = registered
    assert node.kubelet.unprepare([("default", "never", "uid-x")]) == {"uid-x": ""}
    assert node.instances.destroyed == []


def test_bad_claims_get_their_own_error(registered: Node) -> None:
    node = registered
    node.claims.put(claim("good", "uid-g", [("r", "gpu-0-mig-1g-10gb-0")]))
    node.claims.put(claim("pending", "uid-p", None))
    node.claims.put(claim("odd", "uid-o", [("r", "gpu-0-mig-3g-40gb-2")]))
    node.claims.put(claim("taken", "uid-t", [("r", "gpu-0-mig-1g-10gb-0")]))
    got = node.kubelet.prepare(
        [
            ("default", "good", "uid-g"),
            ("default", "pending", "uid-p"),
            ("default", "odd", "uid-o"),
            ("default", "missing", "uid-m"),
            ("default", "taken", "uid-t"),
            ("default", "", "uid-e"),
        ]
    )
    assert isinstance(got["uid-g"], tuple) and len(got["uid-g"]) == 1
    assert got["uid-p"] == "claim default/pending (uid-p) is not allocated"
    assert "3g.40gb cannot start at slot 2" in str(got["uid-o"])
    assert got["uid-m"] == "claim default/missing (uid-m) is not in the API"
    assert "is taken by claim UID uid-g" in str(got["uid-t"])
    assert "leaves out name" in str(got["uid-e"])
    assert node.instances.created == [P(0, "1g.10gb", 0)]


def test_an_unexpected_failure_fails_the_call(registered: Node) -> None:
    node = registered

    class Broken:
        def read_claim(self, namespace: str, name: str) -> None:
            raise RuntimeError("the API client broke")

    node.plugin.preparer = preparing.Preparer(
        Broken(), node.instances, GPUS, NODE, specs=node.specs
    )
    with pytest.raises(grpc.RpcError) as err:
        node.kubelet.prepare([("default", "a", "uid-a")])
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "the API client broke" in str(err.value.details())


def test_stop_removes_both_sockets(node: Node) -> None:
    assert node.settings.dra_socket.is_socket()
    assert node.settings.registration_socket.is_socket()
    node.plugin.stop()
    assert not node.settings.dra_socket.exists()
    assert node.kubelet.sockets() == []
    node.plugin.start()  # the fixture stops it again
    assert len(node.kubelet.sockets()) == 1


def test_a_registration_socket_that_cannot_be_served_takes_the_dra_socket_down(
    root: pathlib.Path,
) -> None:
    node = Node(root)
    node.settings.registry_dir.parent.mkdir(parents=True, exist_ok=True)
    node.settings.registry_dir.write_text("a file where the folder should be")
    with pytest.raises(OSError):
        node.plugin.start()
    assert not node.settings.dra_socket.exists()
    node.settings.registry_dir.unlink()
    node.plugin.start()  # the failed start left nothing behind
    assert node.settings.registration_socket.is_socket()
    node.plugin.stop()


# -- the real Protocols: claims in the agent's API, instances on emulated GPUs, CDI files -------


class RealNode:
    """The plugin as the agent starts it (:func:`dra_node.start`), over emulated GPUs whose
    state and driver files outlive an agent, with the fake kubelet."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.api = kubeapi.InMemoryNodeApi()
        self.proc = root / "proc"
        self.paths = dra_node.DraPaths(
            kubelet_dir=root / "kubelet", cdi_spec_dir=root / "cdi", proc_root=self.proc
        )
        self.gpus = emulated.EmulatedBackend(
            [GPUS[0], GPUS[1]], state_path=root / "gpus.json", durable=False, proc_root=self.proc
        )
        self.dra = self._start()
        self.kubelet = FakeDraKubelet(self.paths.kubelet_dir / "plugins_registry")
        (socket,) = self.kubelet.sockets()
        assert self.kubelet.register(socket) is not None

    def _start(self) -> dra_node.DraNode:
        used = reconciling.RunningProcesses(self.gpus)
        return dra_node.start(self.gpus, self.api, node=NODE, paths=self.paths, in_use=used)

    def restart(self) -> None:
        """The agent stops and a new one starts on the same GPUs and files."""
        self.dra.stop()
        self.gpus = emulated.EmulatedBackend(
            state_path=self.root / "gpus.json", durable=False, proc_root=self.proc
        )
        self.dra = self._start()
        (socket,) = self.kubelet.sockets()
        assert self.kubelet.register(socket) is not None

    def put(self, doc: dict[str, Any]) -> None:
        self.api.server.put(objects.Kind.RESOURCECLAIMS, doc)

    def spec(self, uid: str) -> pathlib.Path:
        return self.dra.specs.path(uid)

    def layout(self) -> list[tuple[int, str, int, str | None]]:
        return [(g, d.profile, d.start, d.uuid) for g in (0, 1) for d in self.gpus.mig_devices(g)]


@pytest.fixture
def real(root: pathlib.Path) -> Iterator[RealNode]:
    n = RealNode(root)
    yield n
    n.dra.stop()


def test_real_prepare_creates_at_the_placements_writes_cdi_and_survives_a_restart(
    real: RealNode,
) -> None:
    real.put(
        claim("a", "uid-a", [("big", "gpu-0-mig-3g-40gb-4"), ("small", "gpu-1-mig-1g-10gb-6")])
    )
    asked = [("default", "a", "uid-a")]
    first = real.kubelet.prepare(asked)
    devices = first["uid-a"]
    assert isinstance(devices, tuple)
    made = real.layout()
    assert [(g, p, s) for g, p, s, _ in made] == [(0, "3g.40gb", 4), (1, "1g.10gb", 6)]
    spec = json.loads(real.spec("uid-a").read_text())
    assert {f"{spec['kind']}={d['name']}" for d in spec["devices"]} == {
        i for d in devices for i in d.cdi_ids
    }
    assert real.kubelet.prepare(asked) == first
    real.restart()
    assert real.kubelet.prepare(asked) == first
    assert real.layout() == made  # the same instances: nothing created, nothing destroyed
    ledger = json.loads(real.paths.ledger.read_text())
    assert {e["uuid"] for e in ledger["claims"]["uid-a"]} == {u for *_, u in made}
    assert real.kubelet.unprepare(asked) == {"uid-a": ""}
    assert real.layout() == []
    assert not real.spec("uid-a").exists()


def test_real_unprepare_keeps_an_instance_a_process_still_runs_on(real: RealNode) -> None:
    real.put(claim("a", "uid-a", [("r", "gpu-0-mig-1g-10gb-0")]))
    asked = [("default", "a", "uid-a")]
    assert isinstance(real.kubelet.prepare(asked)["uid-a"], tuple)
    ((_, _, _, uuid),) = real.layout()
    assert uuid is not None
    real.gpus.attach_process(uuid, 4242)
    error = real.kubelet.unprepare(asked)["uid-a"]
    assert f"({uuid}) is in use: not destroyed" in error  # the agent's RunningProcesses
    assert real.spec("uid-a").exists() and len(real.layout()) == 1
    real.gpus.detach_process(uuid, 4242)
    assert real.kubelet.unprepare(asked) == {"uid-a": ""}
    assert real.layout() == [] and not real.spec("uid-a").exists()


def test_real_claims_not_in_the_api_or_taken_are_refused(real: RealNode) -> None:
    used = real.gpus.create_instance(0, profile="1g.10gb", start=0)  # not a claim's, in use
    assert used.uuid is not None
    real.gpus.attach_process(used.uuid, 4242)
    real.put(claim("b", "uid-b", [("r", "gpu-0-mig-1g-10gb-0")]))
    got = real.kubelet.prepare([("default", "b", "uid-b"), ("default", "gone", "uid-g")])
    assert f"the 1g.10gb instance at slot 0 ({used.uuid}) is in use" in str(got["uid-b"])
    assert got["uid-g"] == "claim default/gone (uid-g) is not in the API"
    assert len(real.layout()) == 1 and not real.spec("uid-b").exists()
