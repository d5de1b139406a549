"""``migpilot agent --device-list-strategy cdi-cri`` on the real control plane: its CDI spec.

The agent runs with emulated GPUs (their driver files below ``--proc-root``) on a KWOK node with
the stand-in kubelet. The test writes the GpuLayout as the controller would and samples the Node
and the spec file while the agent works: every sample finds each MIG device the Node's allocatable
counts already in the spec (the Node is read first) while instances are created, the spec passes
the CDI schema, and a destroyed instance leaves the spec (and its driver files go).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import lightkube
import pytest
from lightkube import codecs
from lightkube.resources.core_v1 import Node

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from tests.kube import crds
from tests.kube.agents import AgentProcess
from tests.kube.controlplane import ControlPlane
from tests.unit.test_cdi import VALIDATOR

pytestmark = pytest.mark.kube

NODE = "cdi-kube-node"
KIND = "k8s.device-plugin.nvidia.com/gpu"
R1G, R3G = "nvidia.com/mig-1g.10gb", "nvidia.com/mig-3g.40gb"


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    folder = pathlib.Path(tempfile.mkdtemp(prefix="mpcdi"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def agent(control_plane: ControlPlane, root: pathlib.Path) -> Iterator[AgentProcess]:
    crds.ensure_gpulayouts(control_plane)
    control_plane.add_node(NODE)
    (root / "proc-root").mkdir()
    a = AgentProcess(
        control_plane,
        root,
        node=NODE,
        args=[
            "--backend", "emulated:h100-80gb:x2", "--kubelet", "simulated", "--interval", "2",
            "--device-list-strategy", "cdi-cri", "--proc-root", str(root / "proc-root"),
            "--cdi-spec-dir", str(root / "cdi"),
        ],
    )  # fmt: skip
    yield a
    if a.process is not None:
        a.process.kill()
        a.process.wait()
    for res, name in ((crds.GpuLayout, NODE), (Node, NODE)):
        try:
            control_plane.client.delete(res, name, grace_period=0)
        except lightkube.ApiError as e:
            if e.status.code != 404:
                raise


def _apply_spec(plane: ControlPlane, instances: tuple[gl.InstanceSpec, ...]) -> None:
    doc = wire.spec_patch(NODE, gl.LayoutSpec((gl.GpuSpec(0, "h100-80gb", instances),)))
    plane.client.apply(
        codecs.from_dict(dict(doc)), field_manager=gl.CONTROLLER_FIELD_MANAGER, force=True
    )


def _instances(plane: ControlPlane) -> dict[str, str]:
    """``profile@start`` -> MIG UUID of GPU 0's instances in the status."""
    try:
        doc: dict[str, Any] = plane.client.get(crds.GpuLayout, NODE).to_dict()
    except lightkube.ApiError:
        return {}
    got = wire.parse(doc)
    if got.status is None:
        return {}
    return {
        f"{i.profile}@{i.start}": i.uuid
        for g in got.status.gpus
        if g.index == 0
        for i in g.instances
        if i.uuid
    }


def _allocatable(plane: ControlPlane) -> dict[str, str]:
    status = plane.client.get(Node, NODE).status
    return dict((status.allocatable if status else None) or {})


def _spec(path: pathlib.Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _names(spec: dict[str, Any] | None) -> set[str]:
    return {d["name"] for d in (spec or {}).get("devices", [])}


class Sampler:
    """Reads the Node, then the spec file, over and over; records any sample whose Node counts
    more MIG devices than the spec defines (while instances are only created)."""

    def __init__(self, plane: ControlPlane, path: pathlib.Path) -> None:
        self.plane, self.path = plane, path
        self.samples = 0
        self.bad: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            counts = _allocatable(self.plane)
            spec = _spec(self.path)
            in_spec = sum(1 for n in _names(spec) if n.startswith("MIG-"))
            on_node = sum(int(counts.get(r, "0")) for r in (R1G, R3G))
            if on_node > in_spec:
                self.bad.append(f"Node {counts}, spec {sorted(_names(spec))}")
            self.samples += 1
            self.stop.wait(0.02)


def test_spec_holds_each_instance_before_the_node_and_drops_the_destroyed(
    control_plane: ControlPlane, agent: AgentProcess, root: pathlib.Path
) -> None:
    path = root / "cdi" / f"migpilot-{NODE}.json"
    sampler = Sampler(control_plane, path)
    sampler.thread.start()
    try:
        agent.start()
        _apply_spec(control_plane, (gl.InstanceSpec("1g.10gb", 0), gl.InstanceSpec("3g.40gb", 4)))

        def both() -> bool:
            counts = _allocatable(control_plane)
            return counts.get(R1G) == "1" and counts.get(R3G) == "1"

        agent.wait(both, "the Node's allocatable with both instances", poll_s=0.1)
        agent.wait(lambda: len(_instances(control_plane)) == 2, "the status's UUIDs")
        uuids = _instances(control_plane)
        spec = _spec(path)
        assert spec is not None
        VALIDATOR.validate(spec)
        assert spec["kind"] == KIND
        by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
        assert set(by_name) == set(uuids.values())
        # GPU 0's instances: its node and the GI and CI caps the emulated driver files give.
        for nodes in by_name.values():
            paths = [n["path"] for n in nodes]
            assert paths[0] == "/dev/nvidia0"
            assert [p.rsplit("cap", 1)[0] for p in paths[1:]] == ["/dev/nvidia-caps/nvidia-"] * 2
        caps = root / "proc-root/proc/driver/nvidia/capabilities/gpu0/mig"
        assert sorted(p.name for p in caps.iterdir()) == ["gi1", "gi2"]
    finally:
        sampler.stop.set()
        sampler.thread.join()
    assert sampler.samples > 10
    assert sampler.bad == []

    # The 3g.40gb is destroyed: it leaves the spec (in the pass that stops advertising it),
    # and the Node.
    _apply_spec(control_plane, (gl.InstanceSpec("1g.10gb", 0),))
    gone = uuids["3g.40gb@4"]
    agent.wait(lambda: gone not in _names(_spec(path)), "the destroyed instance's exit")
    assert _names(_spec(path)) == {uuids["1g.10gb@0"]}
    agent.wait(lambda: _allocatable(control_plane).get(R3G) == "0", "the Node's 3g count 0")
    assert sorted(p.name for p in caps.iterdir()) == ["gi1"]
