"""``migpilot fleet`` on a real control plane: one process runs the agents of three KWOK nodes.

First alone, the test writing the GpuLayout specs as the controller would (server-side apply as
``migpilot-controller``): each node gets its status and its Node capacity, a pod bound to one
of them gets the instance reserved for it, and a node whose label names no GPUs is refused in
one log line while the others run. Then the whole system: three KWOK nodes labelled
``migpilot.io/emulated-gpus`` (two A100-80GB each, one with two H100-80GB), one ``migpilot
fleet`` process, the webhook and the real controller. The fleet writes each node's GFD labels,
so the controller creates their GpuLayouts; pods asking for MIG profiles are gated, planned,
made, pinned, bound and run; the simulated kubelet assigns each bound pod its instance, which
the status reports ``used``. Every wait has a generous timeout.
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaim, ResourceSlice

from migpilot.agent.dra import placements, publishing
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.mig import catalog
from tests.kube import crds, system
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube

WAIT_S = 120.0
REPO = pathlib.Path(__file__).parents[2]
NODES = {"fleet-a": "a100-80gb.x2", "fleet-b": "a100-80gb.x2", "fleet-c": "h100-80gb.x2"}


@pytest.fixture
def scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[system.System]:
    s = system.System(control_plane, tmp_path)
    namespace = f"fleet-{s.lease_ns.rsplit('-', 1)[-1]}"
    client = control_plane.client
    try:
        s.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        s.start_webhook()
        for node, gpus in NODES.items():
            s.add_fleet_node(node, gpus)
        yield s
    finally:
        for p in client.list(Pod, namespace=namespace):
            with contextlib.suppress(lightkube.ApiError):
                assert p.metadata is not None
                client.delete(Pod, p.metadata.name or "", namespace=namespace, grace_period=0)
        s.stop()
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)


def _wait(scene: system.System, predicate: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (got := predicate()):
        if scene.fleet is not None and scene.fleet.process.poll() is not None:
            raise AssertionError(f"the fleet exited waiting for {what}\n{scene.logs()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}\n{scene.logs()}")
        time.sleep(0.1)
    return got


def _layout(scene: system.System, node: str) -> gl.GpuLayout | None:
    try:
        return wire.parse(scene.client.get(crds.GpuLayout, node).to_dict())
    except lightkube.ApiError:
        return None


def _pod(name: str, namespace: str, profile: str) -> Pod:
    limits = {f"nvidia.com/mig-{profile}": "1"}
    return Pod(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PodSpec(
            containers=[
                Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
            ]
        ),
    )


def test_one_fleet_process_runs_every_nodes_agent(scene: system.System) -> None:
    client = scene.client
    namespace = f"fleet-{scene.lease_ns.rsplit('-', 1)[-1]}"
    scene.start_fleet()
    scene.start_controller("c1")

    # GFD labels first (no GpuLayout yet), then the controller's GpuLayouts and their status.
    def labelled() -> bool:
        for node in NODES:
            labels = client.get(Node, node).metadata.labels or {}  # type: ignore[union-attr]
            if labels.get("nvidia.com/mig.capable") != "true":
                return False
        return True

    _wait(scene, labelled, "the fleet's GFD labels on every node")

    def reported() -> bool:
        return all((x := _layout(scene, n)) is not None and x.status is not None for n in NODES)

    _wait(scene, reported, "every node's first status")

    names = {f"p{i:02d}": ("1g.10gb", "3g.40gb", "2g.20gb")[i % 3] for i in range(12)}
    for name, profile in sorted(names.items()):
        client.create(_pod(name, namespace, profile))

    def running() -> dict[str, str]:
        out = {}
        for p in client.list(Pod, namespace=namespace):
            assert p.metadata is not None and p.status is not None and p.spec is not None
            if p.status.phase == "Running" and p.spec.nodeName:
                out[p.metadata.name or ""] = p.spec.nodeName
        return out if set(names) <= set(out) else {}

    placed = _wait(scene, running, "12 pods Running")
    assert set(placed.values()) <= set(NODES)

    # Each bound pod holds an instance of its profile: the statuses report them used.
    def used() -> bool:
        counts: dict[str, int] = {}
        for node in NODES:
            lay = _layout(scene, node)
            for g in lay.status.gpus if lay is not None and lay.status is not None else ():
                for i in g.instances:
                    if i.state is gl.InstanceState.USED:
                        counts[i.profile] = counts.get(i.profile, 0) + 1
        return counts == {"1g.10gb": 4, "3g.40gb": 4, "2g.20gb": 4}

    _wait(scene, used, "12 instances reported used")
    text = (scene.root / "fleet.log").read_text(errors="replace")
    assert "(simulated Allocate)" in text


DIRECT = {"fleet-d": "a100-80gb.x2", "fleet-e": "a100-80gb.x2", "fleet-f": "h100-80gb.x1"}
DIRECT_LABEL = "migpilot.io/fleet-test"
"""Selects this test's nodes only (``--fleet-selector``): the control plane is shared."""
SPECS = {
    "fleet-d": [
        gl.GpuSpec(0, "a100-80gb", (gl.InstanceSpec("3g.40gb", 0), gl.InstanceSpec("3g.40gb", 4))),
        gl.GpuSpec(1, "a100-80gb", (gl.InstanceSpec("7g.80gb", 0),)),
    ],
    "fleet-e": [
        gl.GpuSpec(1, "a100-80gb", tuple(gl.InstanceSpec("1g.10gb", s) for s in range(7))),
    ],
    "fleet-f": [
        gl.GpuSpec(0, "h100-80gb", (gl.InstanceSpec("2g.20gb", 0), gl.InstanceSpec("3g.40gb", 4))),
    ],
}
CAPACITY = {
    "fleet-d": {"nvidia.com/mig-3g.40gb": "2", "nvidia.com/mig-7g.80gb": "1"},
    "fleet-e": {"nvidia.com/mig-1g.10gb": "7"},
    "fleet-f": {"nvidia.com/mig-2g.20gb": "1", "nvidia.com/mig-3g.40gb": "1"},
}


@pytest.fixture
def alone(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[system.System]:
    s = system.System(control_plane, tmp_path)
    try:
        s.prepare()
        for node, gpus in {**DIRECT, "fleet-bad": "nope.x2"}.items():
            control_plane.add_node(node, labels={system.FLEET_LABEL: gpus, DIRECT_LABEL: "direct"})
            s.nodes.append(node)
        yield s
    finally:
        with contextlib.suppress(lightkube.ApiError):
            s.client.delete(Pod, "fleet-pod", namespace="default", grace_period=0)
        s.stop()


def _apply_spec(scene: system.System, node: str, gpus: list[gl.GpuSpec]) -> None:
    doc = wire.spec_patch(node, gl.LayoutSpec(tuple(gpus)))
    scene.client.apply(
        codecs.from_dict(dict(doc)), field_manager=gl.CONTROLLER_FIELD_MANAGER, force=True
    )


def _held(lay: gl.GpuLayout | None, generation: int) -> dict[int, dict[str, str]] | None:
    """Per GPU, ``profile@start`` -> state, in a Ready status of ``generation``."""
    if lay is None or lay.status is None or lay.status.observed_generation != generation:
        return None
    ready = [c for c in lay.status.conditions if c.type == gl.READY]
    if not ready or ready[0].status is not gl.ConditionStatus.TRUE:
        return None
    return {
        g.index: {f"{i.profile}@{i.start}": i.state.value for i in g.instances}
        for g in lay.status.gpus
        if g.instances
    }


def test_the_fleet_follows_the_specs_of_its_nodes(alone: system.System) -> None:
    client = alone.client
    alone.start_fleet("--fleet-selector", f"{DIRECT_LABEL}=direct", "--workers", "4")
    for node, gpus in SPECS.items():
        _apply_spec(alone, node, gpus)

    want = {
        node: {g.index: {f"{i.profile}@{i.start}": "free" for i in g.instances} for g in gpus}
        for node, gpus in SPECS.items()
    }

    def reported() -> bool:
        return all(_held(_layout(alone, n), 1) == want[n] for n in SPECS)

    _wait(alone, reported, "every node's status of generation 1")

    def published() -> bool:
        for node, counts in CAPACITY.items():
            status = client.get(Node, node).status
            for part in ("capacity", "allocatable"):
                have = (getattr(status, part, None) if status else None) or {}
                if any(have.get(k) != v for k, v in counts.items()):
                    return False
        return True

    _wait(alone, published, "every node's MIG resources in its capacity and allocatable")

    # A pod bound to fleet-d gets the 3g.40gb the spec reserves for it (not the first one).
    reserved = (gl.InstanceSpec("3g.40gb", 0), gl.InstanceSpec("3g.40gb", 4, "default/fleet-pod"))
    _apply_spec(alone, "fleet-d", [gl.GpuSpec(0, "a100-80gb", reserved), SPECS["fleet-d"][1]])
    limits = {"nvidia.com/mig-3g.40gb": "1"}
    client.create(
        Pod(
            metadata=ObjectMeta(name="fleet-pod", namespace="default"),
            spec=PodSpec(
                nodeSelector={"kubernetes.io/hostname": "fleet-d"},
                containers=[
                    Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
                ],
            ),
        )
    )
    used = {0: {"3g.40gb@0": "free", "3g.40gb@4": "used"}, 1: {"7g.80gb@0": "free"}}
    _wait(alone, lambda: _held(_layout(alone, "fleet-d"), 2) == used, "the reserved one used")

    # The node whose label names no GPUs is refused in one line; the others ran regardless.
    text = (alone.root / "fleet.log").read_text(errors="replace")
    assert (
        f"Node fleet-bad: label {system.FLEET_LABEL}='nope.x2' does not name emulated GPUs" in text
    )
    assert _layout(alone, "fleet-bad") is None


# --- nodes in DRA mode -------------------------------------------------------------------------

DRA_NODES = ("fleet-dra-a", "fleet-dra-b")
DRA_SELECT = "migpilot.io/fleet-dra-test"
"""Selects this test's nodes only (``--fleet-selector``)."""
H100 = catalog.resolve_gpu("h100-80gb")


@pytest.fixture
def dra_fleet(
    control_plane: ControlPlane, tmp_path: pathlib.Path
) -> Iterator[tuple[system.System, str]]:
    """Two KWOK nodes in DRA mode (one emulated H100 each) run by one fleet, the DeviceClass
    (unless there is one), a namespace with a template of ``3g.40gb`` claims; no controller
    and no webhook: kube-scheduler allocates the claims by its own first fit."""
    s = system.System(control_plane, tmp_path)
    client = control_plane.client
    namespace = f"fleet-dra-{s.lease_ns.rsplit('-', 1)[-1]}"
    made_class = False
    try:
        s.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        try:
            client.get(DeviceClass, publishing.DRIVER)
        except lightkube.ApiError:
            for doc in yaml.safe_load_all(
                (REPO / "deploy" / "dra" / "deviceclass.yaml").read_text()
            ):
                client.create(codecs.from_dict(doc))
            made_class = True
        cel = f'device.attributes["{publishing.DRIVER}"].profile == "3g.40gb"'
        request = {
            "deviceClassName": publishing.DRIVER,
            "selectors": [{"cel": {"expression": cel}}],
        }
        template = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": "mig-3g", "namespace": namespace},
            "spec": {"spec": {"devices": {"requests": [{"name": "mig", "exactly": request}]}}},
        }
        client.create(codecs.from_dict(template))
        labels = {system.FLEET_LABEL: "h100-80gb.x1", "migpilot.io/mode": "dra", DRA_SELECT: "yes"}
        for node in DRA_NODES:
            control_plane.add_node(node, labels=labels)
            s.nodes.append(node)
        s.start_fleet(
            "--fleet-selector", f"{DRA_SELECT}=yes", "--lease-namespace", s.lease_ns
        )  # fmt: skip
        for node in DRA_NODES:  # the status is reported into a GpuLayout: as a controller would
            _apply_spec(s, node, [])
        yield s, namespace
    finally:
        for p in client.list(Pod, namespace=namespace):
            with contextlib.suppress(lightkube.ApiError):
                assert p.metadata is not None
                client.delete(Pod, p.metadata.name or "", namespace=namespace, grace_period=0)
        s.stop()
        for node in DRA_NODES:
            for found in client.list(ResourceSlice, fields={"spec.nodeName": node}):
                with contextlib.suppress(lightkube.ApiError):
                    assert found.metadata is not None
                    client.delete(ResourceSlice, found.metadata.name or "")
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)
        if made_class:
            with contextlib.suppress(lightkube.ApiError):
                client.delete(DeviceClass, publishing.DRIVER)


def _dra_pod(name: str, namespace: str) -> Any:
    return codecs.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "containers": [
                    {"name": "c", "image": "none", "resources": {"claims": [{"name": "mig"}]}}
                ],
                "resourceClaims": [{"name": "mig", "resourceClaimTemplateName": "mig-3g"}],
            },
        }
    )


def _allocations(client: lightkube.Client, namespace: str) -> dict[str, tuple[str, str]]:
    """Pod -> (node, device) of its claim, for the claims kube-scheduler allocated."""
    out = {}
    for c in client.list(ResourceClaim, namespace=namespace):
        doc = c.to_dict()
        owners = doc["metadata"].get("ownerReferences") or ()
        results = (((doc.get("status") or {}).get("allocation") or {}).get("devices") or {}).get(
            "results"
        ) or ()
        for r in results:
            for owner in owners:
                out[owner["name"]] = (r["pool"], r["device"])
    return out


def _used(scene: system.System, node: str) -> set[tuple[str, int]] | None:
    """The instances the node's status reports used: (profile, start) on GPU 0."""
    lay = _layout(scene, node)
    if lay is None or lay.status is None:
        return None
    return {
        (i.profile, i.start)
        for g in lay.status.gpus
        for i in g.instances
        if i.state is gl.InstanceState.USED
    }


def test_the_fleet_publishes_dra_nodes_slices_and_prepares_their_claims(
    dra_fleet: tuple[system.System, str],
) -> None:
    """Two H100 nodes in DRA mode: their pools published by the fleet (no device-plugin count
    in the Nodes), five pods of one ``3g.40gb`` claim each: kube-scheduler allocates four (two
    per GPU, starts 0 and 4) and leaves the fifth pending; the fleet prepares the four, whose
    instances the statuses report used at exactly the allocated placements. One pod deleted,
    its instance goes and the pending pod's claim is allocated and prepared in its place."""
    scene, namespace = dra_fleet
    client = scene.client

    def published() -> bool:
        for node in DRA_NODES:
            found = list(client.list(ResourceSlice, fields={"spec.nodeName": node}))
            if not any((s.spec.devices or []) for s in found if s.spec is not None):
                return False
        return True

    _wait(scene, published, "both DRA nodes' ResourceSlices")
    for node in DRA_NODES:
        status = client.get(Node, node).status
        have = (status.capacity if status is not None else None) or {}
        assert not any(k.startswith("nvidia.com/") for k in have), have

    names = [f"d{i}" for i in range(5)]
    for name in names:
        client.create(_dra_pod(name, namespace))

    def four_allocated() -> dict[str, tuple[str, str]] | None:
        got = _allocations(client, namespace)
        return got if len(got) == 4 else None

    allocated = _wait(scene, four_allocated, "four claims allocated")
    pending = (set(names) - set(allocated)).pop()
    want: dict[str, set[tuple[str, int]]] = {node: set() for node in DRA_NODES}
    for node, device in allocated.values():
        p = placements.parse_device_name(device, {0: H100})
        want[node].add((p.profile, p.start))
    assert want == {node: {("3g.40gb", 0), ("3g.40gb", 4)} for node in DRA_NODES}
    _wait(scene, lambda: all(_used(scene, n) == want[n] for n in DRA_NODES), "four prepared")

    gone = sorted(allocated)[0]
    freed = allocated[gone]
    client.delete(Pod, gone, namespace=namespace)

    def moved() -> bool:
        got = _allocations(client, namespace)
        return got.get(pending) == freed and gone not in got

    _wait(scene, moved, "the pending pod's claim allocated the freed placement")
    log = scene.root / "fleet.log"

    def prepared(pod: str, what: str) -> int:
        """Where the fleet's log says the claim of ``pod`` was ``what`` (-1: not yet)."""
        text = log.read_text(errors="replace")
        at = text.find(f"DRA: claim {namespace}/{pod}-mig-")
        while at >= 0 and not text[at:].split("\n", 1)[0].count(f") {what}"):
            at = text.find(f"DRA: claim {namespace}/{pod}-mig-", at + 1)
        return at

    # The gone pod's claim is unprepared (its instance destroyed), then the pending pod's is
    # prepared at the same placement (retried until the placement is free, if it came first).
    _wait(scene, lambda: prepared(pending, "prepared on") >= 0, "the pending pod's claim prepared")
    assert 0 <= prepared(gone, "unprepared") < prepared(pending, "prepared on")
    _wait(scene, lambda: all(_used(scene, n) == want[n] for n in DRA_NODES), "four used again")
