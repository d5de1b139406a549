"""Two controllers on a real control plane: one writes, and a paused leader is fenced off.

Facts from the API server only: who wrote each GpuLayout version (the writer annotations every
controller spec write carries, collected from a watch: :mod:`tests.kube.writes`), the Lease's
own times, and the answer to a write. Short timings (Lease 6 s, renew deadline 4 s, tries every
1 s, calls 2 s) keep the test quick; the rules are the same as with the defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid

import lightkube
import pytest
from lightkube.resources.coordination_v1 import Lease

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.api import leases
from migpilot.controller import kube, kubeapi
from migpilot.kube import errors as kube_errors
from tests.kube import crds
from tests.kube.controlplane import ControlPlane
from tests.kube.scenes import NODES, Scene
from tests.kube.writes import Writes

pytestmark = pytest.mark.kube

DURATION_S = 6
FLAGS = (
    "--lease-duration",
    str(DURATION_S),
    "--renew-deadline",
    "4",
    "--retry-period",
    "1",
    "--lease-timeout",
    "2",
)


def _lease(scene: Scene) -> dict[str, object]:
    got: dict[str, object] = scene.client.get(
        Lease, leases.NAME, namespace=scene.lease_ns
    ).to_dict()
    return got


def _spec(lease: dict[str, object]) -> dict[str, object]:
    spec = lease["spec"]
    assert isinstance(spec, dict)
    return spec


def _version(scene: Scene, node: str) -> str:
    meta = scene.client.get(crds.GpuLayout, node).to_dict()["metadata"]
    return str(meta["resourceVersion"])


async def _write_as(scene: Scene, node: str, *, version: str, leader: str, term: int) -> None:
    api = kube.connect(scene.plane.kubeconfig)
    try:
        await api.apply_layout_spec(
            node,
            gl.LayoutSpec(()),
            owner_uid=None,
            fence=kubeapi.Fence(version, leader=leader, term=term),
        )
    finally:
        await api.close()


def test_a_paused_leader_is_replaced_after_a_lease_duration_and_its_writes_are_refused(
    scene: Scene,
) -> None:
    client = scene.client
    scene.start_controller("c1", *FLAGS)
    scene.wait(scene.reported, "the agents' first status")
    scene.start_controller("c2", *FLAGS)
    with Writes(scene.plane.kubeconfig, NODES) as writes:
        # Both run: only the Lease holder writes.
        first = {f"p{i}" for i in range(4)}
        for name in sorted(first):
            client.create(scene.pod(name, "2g.20gb"))
        scene.wait(lambda: scene.running(first), "4 pods Running")
        term = leases.transitions_of(_lease(scene))
        assert writes.by("c1"), "the leader wrote nothing"
        assert writes.leaders() == {"c1"}, writes.all()
        assert {w.term for w in writes.all()} == {str(term)}

        # The leader stops (SIGSTOP: no clean shutdown, its Lease left as it was).
        scene.controllers["c1"].signal(signal.SIGSTOP)
        paused = _spec(_lease(scene))
        assert paused["holderIdentity"] == "c1"
        before = {node: _version(scene, node) for node in NODES}
        count = len(writes.all())
        second = {f"q{i}" for i in range(4)}
        for name in sorted(second):
            client.create(scene.pod(name, "2g.20gb"))
        scene.wait(lambda: writes.by("c2"), "the standby's first write")
        taken = _spec(_lease(scene))
        assert (taken["holderIdentity"], taken["leaseTransitions"]) == ("c2", term + 1)
        # Not before a whole Lease duration since c1's last renewal (both stamped by this
        # host's clock: a fact of the Lease, not a timing of this test).
        renewed = leases.parse_time(paused["renewTime"])
        acquired = leases.parse_time(taken["acquireTime"])
        assert renewed is not None and acquired is not None
        assert acquired - renewed >= DURATION_S, (paused, taken)
        assert {w.leader for w in writes.all()[count:]} == {"c2"}
        scene.wait(lambda: scene.running(first | second), "8 pods Running")

        # c1's write planned before the pause and sent now: the API server refuses it (409),
        # and the spec c2 wrote stands.
        node = writes.by("c2")[0].node
        assert _version(scene, node) != before[node]
        by_c1 = len(writes.by("c1"))
        with pytest.raises(kube_errors.ConflictError):
            asyncio.run(_write_as(scene, node, version=before[node], leader="c1", term=term))
        layout = client.get(crds.GpuLayout, node).to_dict()
        assert layout["metadata"]["annotations"][gl.LEADER_ANNOTATION] == "c2"
        assert len(writes.by("c1")) == by_c1

        # c1 resumes: past its renew deadline on its own clock, it writes nothing, and the
        # Lease stays c2's.
        scene.controllers["c1"].signal(signal.SIGCONT)
        third = {f"r{i}" for i in range(2)}
        for name in sorted(third):
            client.create(scene.pod(name, "1g.10gb"))
        scene.wait(lambda: scene.running(first | second | third), "10 pods Running")
        scene.wait(
            lambda: "not holding the Lease" in scene.controllers["c1"].log.read_text(),
            "c1 to have looked at the Lease again",
        )
        scene.wait(lambda: leases.transitions_of(_lease(scene)) == term + 1, "the Lease kept")
        assert _spec(_lease(scene))["holderIdentity"] == "c2"
        after = writes.all()[count:]
        assert after and {(w.leader, w.term) for w in after} == {("c2", str(term + 1))}, after
        assert writes.alive(), "the GpuLayout watch ended: no write would mean nothing"


def test_the_api_server_refuses_a_spec_write_whose_precondition_does_not_hold(
    control_plane: ControlPlane,
) -> None:
    # The controller's own write path (controller/kube.py) against kube-apiserver: a create
    # when the object exists, and a server-side apply on a replaced resourceVersion, are 409.
    crds.ensure_gpulayouts(control_plane)
    name = f"fence-{uuid.uuid4().hex[:6]}"
    theirs = gl.LayoutSpec((gl.GpuSpec(0, None, (gl.InstanceSpec("1g.10gb", 6),)),))

    async def scenario() -> None:
        api = kube.connect(control_plane.kubeconfig)
        try:
            made = await api.apply_layout_spec(
                name, gl.LayoutSpec(()), owner_uid=None, fence=kubeapi.Fence(None, "c1", 3)
            )
            first = str(made["metadata"]["resourceVersion"])
            assert made["metadata"]["annotations"] == {
                gl.LEADER_ANNOTATION: "c1",
                gl.TERM_ANNOTATION: "3",
            }
            with pytest.raises(kube_errors.ConflictError):
                await api.apply_layout_spec(
                    name, gl.LayoutSpec(()), owner_uid=None, fence=kubeapi.Fence(None, "c2", 4)
                )
            replaced = await api.apply_layout_spec(
                name, theirs, owner_uid=None, fence=kubeapi.Fence(first, "c2", 4)
            )
            second = str(replaced["metadata"]["resourceVersion"])
            assert second != first
            with pytest.raises(kube_errors.ConflictError):
                await api.apply_layout_spec(
                    name, gl.LayoutSpec(()), owner_uid=None, fence=kubeapi.Fence(first, "c1", 3)
                )
            now = control_plane.client.get(crds.GpuLayout, name).to_dict()
            assert str(now["metadata"]["resourceVersion"]) == second
            assert wire.parse(now).spec == theirs
            assert now["metadata"]["annotations"][gl.LEADER_ANNOTATION] == "c2"
            emptied = gl.LayoutSpec((gl.GpuSpec(0, None, ()),))
            again = await api.apply_layout_spec(
                name, emptied, owner_uid=None, fence=kubeapi.Fence(second, "c2", 4)
            )
            assert wire.parse(dict(again)).spec == emptied  # the current version passes
        finally:
            await api.close()

    try:
        asyncio.run(scenario())
    finally:
        with contextlib.suppress(lightkube.ApiError):
            control_plane.client.delete(crds.GpuLayout, name)
