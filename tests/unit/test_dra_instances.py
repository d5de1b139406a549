"""The DRA kubelet plugin's real Protocols: the claims ledger, the instances on the emulated MIG
backend, the CDI spec files, the claims read through the agent's API, and the reconciler that
must leave claims' instances alone."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from migpilot import errors
from migpilot.agent import assembling, metrics, reconciling, running
from migpilot.agent.cluster import kubeapi
from migpilot.agent.dra import (
    apiclaims,
    cdiclaims,
    claims,
    gpuinstances,
    ownership,
    placements,
    preparing,
)
from migpilot.agent.dra import node as dra_node
from migpilot.agent.dra.memory import MemoryCdi, MemoryClaims
from migpilot.agent.rules import changes
from migpilot.gpu import backend, clocks, emulated, nvml, nvml_standin
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects
from migpilot.mig import catalog, layouts
from tests.unit.test_cdi import VALIDATOR

H100 = catalog.resolve_gpu("h100-80gb")
NODE = "node-a"
P = placements.Placement
W = placements.WholeGpu


class Node:
    """Emulated GPUs whose state and proc files outlive an "agent", and its DRA parts."""

    def __init__(self, tmp: Path, *, mig: bool = True, gpus: int = 2) -> None:
        self.tmp = tmp
        self.state = tmp / "gpus.json"
        self.proc = tmp / "root"
        self.ledger = tmp / "kubelet" / "migpilot" / "dra-claims.json"
        self.ledger.parent.mkdir(parents=True)
        self.used = reconciling.InUseSet()
        self.gpus = emulated.EmulatedBackend(
            [H100] * gpus, state_path=self.state, mig_enabled=mig, durable=False,
            proc_root=self.proc,
        )  # fmt: skip
        self.instances = self.start()

    def start(self) -> gpuinstances.BackendInstances:
        """A (re)started agent's instances, from the ledger file."""
        return gpuinstances.BackendInstances(self.gpus, ledger_file=self.ledger, in_use=self.used)

    def restart(self) -> gpuinstances.BackendInstances:
        """The agent process dies and comes back: a new backend on the same GPUs."""
        self.gpus = emulated.EmulatedBackend(
            state_path=self.state, durable=False, proc_root=self.proc
        )
        self.instances = self.start()
        return self.instances

    def devices(self, gpu: int = 0) -> tuple[backend.MigDevice, ...]:
        return self.gpus.mig_devices(gpu)

    def ledger_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.ledger.read_text())
        return doc


@pytest.fixture
def node(tmp_path: Path) -> Node:
    return Node(tmp_path)


# -- the ledger's content ------------------------------------------------------------------------


def test_the_ledger_round_trips_and_refuses_bad_entries() -> None:
    ledger = ownership.Ledger(
        (
            ownership.Owned("u1", P(0, "3g.40gb", 4), "MIG-a"),
            ownership.Owned("u1", W(1), "GPU-b"),
            ownership.Owned("u2", P(0, "1g.10gb", 0), None),
        )
    )
    again = ownership.parse(json.loads(json.dumps(ownership.dump(ledger))), source="f")
    assert set(again.entries) == set(ledger.entries)
    assert again.uuids() == {"MIG-a", "GPU-b"}
    bad = {
        "x": "not a DRA claims ledger of version 1",
        '{"version": 1, "claims": []}': "'claims' is not a mapping",
        '{"version": 1, "claims": {"u": [{"gpu": 0, "profile": "1g.10gb", "start": -1, '
        '"uuid": null}]}}': "claim 'u': start is -1",
        '{"version": 1, "claims": {"u": [{"gpu": 0, "uuid": "G"}], "v": [{"gpu": 0, '
        '"uuid": "G"}]}}': "claim 'v': whole GPU 0 is also claim 'u''s",
        '{"version": 1, "claims": {"u": [{"gpu": 0, "uuid": ""}]}}': "uuid is ''",
    }
    for text, problem in bad.items():
        data = json.loads(text) if text.startswith("{") else text
        with pytest.raises(ownership.LedgerError, match=re.escape(problem)):
            ownership.parse(data, source="f")


def test_reconcile_keeps_the_ledger_to_what_exists() -> None:
    ledger = ownership.Ledger(
        (
            ownership.Owned("kept", P(0, "1g.10gb", 0), "MIG-1"),
            ownership.Owned("gone", P(0, "1g.10gb", 1), "MIG-2"),
            ownership.Owned("pending", P(0, "2g.20gb", 2), None),
            ownership.Owned("never", P(0, "3g.40gb", 4), None),
            ownership.Owned("replaced", P(1, "7g.80gb", 0), "MIG-old"),
            ownership.Owned("whole", W(2), "GPU-2"),
            ownership.Owned("switched", W(3), "GPU-3"),
        )
    )
    node = ownership.NodeInstances(
        mig={P(0, "1g.10gb", 0): "MIG-1", P(0, "2g.20gb", 2): "MIG-3", P(1, "7g.80gb", 0): "MIG-n"},
        whole={2: "GPU-2"},
    )
    kept, notes = ownership.reconcile(ledger, node)
    assert {e.owner: e.uuid for e in kept.entries} == {
        "kept": "MIG-1",
        "pending": "MIG-3",
        "whole": "GPU-2",
    }
    assert len(notes) == 5
    assert ownership.recovered(node).uuids() == {"MIG-1", "MIG-3", "MIG-n"}
    assert {e.owner for e in ownership.recovered(node).entries} == {ownership.RECOVERED}


# -- instances on the backend ------------------------------------------------------------------


def test_ensure_creates_at_exactly_the_placement_once(node: Node) -> None:
    first = node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")
    again = node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")
    assert first == again
    (dev,) = node.devices()
    assert (dev.profile, dev.start, dev.uuid) == ("3g.40gb", 4, first.uuid)
    assert node.ledger_doc()["claims"] == {
        "u1": [{"gpu": 0, "profile": "3g.40gb", "start": 4, "uuid": first.uuid}]
    }
    assert node.instances.in_use() == {first.uuid}


def test_a_restarted_agent_prepares_to_the_same_instance_and_creates_nothing(node: Node) -> None:
    first = node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")
    whole_gpus = Node(node.tmp / "whole", mig=False, gpus=1)
    gpu = whole_gpus.instances.ensure(W(0), owner="u2")
    restarted = node.restart()
    assert restarted.ensure(P(0, "3g.40gb", 4), owner="u1") == first
    assert [d.uuid for d in node.devices()] == [first.uuid]
    assert whole_gpus.restart().ensure(W(0), owner="u2") == gpu
    assert whole_gpus.devices() == ()


def test_a_ledger_that_cannot_be_written_creates_nothing_and_keeps_the_old_file(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")
    before = node.ledger.read_text()

    def full(path: Path, text: str, **kw: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gpuinstances.files, "write_atomically", full)
    with pytest.raises(preparing.InstanceError, match="No space left on device"):
        node.instances.ensure(P(0, "1g.10gb", 0), owner="u2")
    assert [d.start for d in node.devices()] == [4]  # written ahead: no entry, no create
    assert node.ledger.read_text() == before
    monkeypatch.undo()
    made = node.instances.ensure(P(0, "1g.10gb", 0), owner="u2")
    assert {e["uuid"] for e in node.ledger_doc()["claims"]["u2"]} == {made.uuid}
    assert sorted(p.name for p in node.ledger.parent.iterdir()) == ["dra-claims.json"]


def test_a_crash_between_create_and_ledger_leaves_an_owned_instance(node: Node) -> None:
    node.gpus.inject(
        emulated.Fault(emulated.Step.CREATE_COMPUTE_INSTANCE, 1, emulated.FaultEffect.CRASH_BEFORE)
    )
    with pytest.raises(emulated.SimulatedCrash):
        node.instances.ensure(P(0, "2g.20gb", 2), owner="u1")
    (half,) = node.devices()
    assert not half.complete
    restarted = node.restart()
    assert restarted.owned().at(P(0, "2g.20gb", 2)) == ownership.Owned(
        "u1", P(0, "2g.20gb", 2), None
    )
    with pytest.raises(preparing.InstanceError, match="taken by claim UID u1"):
        restarted.ensure(P(0, "2g.20gb", 2), owner="u9")
    made = restarted.ensure(P(0, "2g.20gb", 2), owner="u1")  # completed, not created again
    (dev,) = node.devices()
    assert dev.complete and dev.gi_id == half.gi_id and dev.uuid == made.uuid


def test_a_failed_create_leaves_no_entry(node: Node) -> None:
    node.gpus.inject(
        emulated.Fault(
            emulated.Step.CREATE_GPU_INSTANCE,
            1,
            emulated.FaultEffect.FAIL,
            backend.ErrorKind.INSUFFICIENT_RESOURCES,
        )
    )
    with pytest.raises(preparing.InstanceError, match="the GPU refused"):
        node.instances.ensure(P(0, "1g.10gb", 0), owner="u1")
    assert node.instances.owned().entries == ()
    assert node.ledger_doc()["claims"] == {}


def test_an_instance_made_meanwhile_at_exactly_the_placement_is_adopted(node: Node) -> None:
    """The agent's pass may make a free instance of the node's target at the moment a claim's
    prepare makes the same one (it saw it before the last claim there released it): the
    second create fails, and the claim adopts the one made, rather than refusing the prepare
    for the kubelet to retry (the bench on the real control plane saw it once)."""
    gpus = node.gpus

    class Racing:
        def __getattr__(self, name: str) -> Any:
            return getattr(gpus, name)

        def create_instance(self, gpu: int, *, profile: str, start: int) -> backend.MigDevice:
            gpus.create_instance(gpu, profile=profile, start=start)  # the other hand wins
            raise backend.BackendError(
                backend.ErrorKind.INSUFFICIENT_RESOURCES, f"{profile}@{start} overlaps"
            )

    racing = gpuinstances.BackendInstances(
        Racing(),  # type: ignore[arg-type]
        ledger_file=node.ledger,
        in_use=node.used,
    )
    got = racing.ensure(P(0, "1g.10gb", 6), owner="u1")
    (made,) = node.devices()
    assert (made.profile, made.start, made.uuid) == ("1g.10gb", 6, got.uuid)
    assert [(e.owner, e.uuid) for e in racing.owned().entries] == [("u1", made.uuid)]


def test_taken_placements_are_refused(node: Node) -> None:
    used = node.gpus.create_instance(0, profile="1g.10gb", start=0)  # a process runs on it
    assert used.uuid is not None
    node.gpus.attach_process(used.uuid, 4242)
    node.instances.ensure(P(1, "4g.40gb", 0), owner="u1")
    cases = {
        P(0, "1g.10gb", 0): "the 1g.10gb instance at slot 0",
        P(0, "2g.20gb", 0): "the 1g.10gb instance at slot 0",
        P(0, "7g.80gb", 0): "the 1g.10gb instance at slot 0",
        P(0, "3g.40gb", 0): "the 1g.10gb instance at slot 0",
        P(1, "4g.40gb", 0): "taken by claim UID u1",
        P(1, "2g.20gb", 2): "the 4g.40gb instance at slot 0 is taken by claim UID u1",
    }
    for placement, problem in cases.items():
        with pytest.raises(preparing.InstanceError, match=re.escape(problem)):
            node.instances.ensure(placement, owner="u2")
    with pytest.raises(preparing.InstanceError, match="is in use"):
        node.instances.ensure(P(0, "1g.10gb", 0), owner="u2")
    node.gpus.detach_process(used.uuid, 4242)
    node.used.add(used.uuid)  # the kubelet lists it for a pod
    with pytest.raises(preparing.InstanceError, match="is in use"):
        node.instances.ensure(P(0, "2g.20gb", 0), owner="u2")
    assert len(node.devices(0)) == 1 and len(node.devices(1)) == 1
    assert node.instances.owned().of("u2") == ()


def test_free_instances_no_claim_owns_are_adopted_or_cleared(node: Node) -> None:
    """The publisher offers a free instance like any placement: a claim allocated exactly it
    adopts it (nothing created), one allocated an overlapping placement gets it destroyed
    first; one that overlaps nothing is left alone."""
    free = node.gpus.create_instance(0, profile="1g.10gb", start=0)  # the reconciler's
    other = node.gpus.create_instance(0, profile="3g.40gb", start=4)
    away = node.gpus.create_instance(1, profile="1g.10gb", start=6)
    got = node.instances.ensure(P(0, "1g.10gb", 0), owner="u1")
    assert got.uuid == free.uuid  # adopted
    mine = node.instances.ensure(P(0, "1g.10gb", 4), owner="u2")  # inside the 3g.40gb at 4
    assert {(d.profile, d.start, d.uuid) for d in node.devices(0)} == {
        ("1g.10gb", 0, free.uuid),
        ("1g.10gb", 4, mine.uuid),
    }
    assert mine.uuid != other.uuid
    assert [d.uuid for d in node.devices(1)] == [away.uuid]
    assert node.instances.in_use() == {free.uuid, mine.uuid}
    # The media engines are in the way too: a +me placement clears a free +me instance.
    me = node.gpus.create_instance(1, profile="1g.10gb+me", start=0)
    node.instances.ensure(P(1, "1g.10gb+me", 2), owner="u3")
    assert me.uuid not in {d.uuid for d in node.devices(1)}
    # A claim's instance is never cleared for another: u1's 1g.10gb is in the way of 2g.20gb@0.
    with pytest.raises(preparing.InstanceError, match="taken by claim UID u1"):
        node.instances.ensure(P(0, "2g.20gb", 0), owner="u4")
    assert node.instances.release("u1") == (P(0, "1g.10gb", 0),)
    assert free.uuid not in {d.uuid for d in node.devices(0)}


def test_release_destroys_only_what_nothing_uses(node: Node) -> None:
    a = node.instances.ensure(P(0, "1g.10gb", 0), owner="u1")
    b = node.instances.ensure(P(0, "1g.10gb", 1), owner="u1")
    c = node.instances.ensure(P(0, "3g.40gb", 4), owner="u2")
    node.gpus.attach_process(a.uuid, 4242)
    node.used.add(b.uuid)  # the kubelet still lists it for a pod
    with pytest.raises(preparing.InstanceError) as err:
        node.instances.release("u1")
    assert "1 processes: not destroyed" in str(err.value)
    assert f"({b.uuid}) is in use: not destroyed" in str(err.value)
    assert {d.uuid for d in node.devices()} == {a.uuid, b.uuid, c.uuid}
    assert len(node.instances.owned().of("u1")) == 2  # still the claim's, for the retry
    node.gpus.detach_process(a.uuid, 4242)
    node.used.discard(b.uuid)
    assert set(node.instances.release("u1")) == {P(0, "1g.10gb", 0), P(0, "1g.10gb", 1)}
    assert [d.uuid for d in node.devices()] == [c.uuid]
    assert node.instances.release("u1") == ()
    assert node.instances.release("never") == ()
    assert node.instances.in_use() == {c.uuid}


def test_whole_gpus_are_given_not_created(tmp_path: Path) -> None:
    off = Node(tmp_path / "off", mig=False, gpus=1)
    got = off.instances.ensure(W(0), owner="u1")
    assert got.uuid.startswith("GPU-") and off.devices() == ()
    assert off.instances.in_use() == {got.uuid}
    with pytest.raises(preparing.InstanceError, match="taken by claim UID u1"):
        off.instances.ensure(W(0), owner="u2")
    assert off.instances.release("u1") == (W(0),)
    assert off.instances.in_use() == frozenset()
    off.used.add(f"{got.uuid}::2")  # a time-slicing replica of it, handed to a pod
    with pytest.raises(preparing.InstanceError, match="is in use by a pod"):
        off.instances.ensure(W(0), owner="u2")
    off.used.discard(f"{got.uuid}::2")
    on = Node(tmp_path / "on", gpus=1)
    with pytest.raises(preparing.InstanceError, match="MIG mode is on"):
        on.instances.ensure(W(0), owner="u1")
    with pytest.raises(preparing.InstanceError, match=r"1g\.10gb@0 on GPU 0: .*not supported"):
        off.instances.ensure(P(0, "1g.10gb", 0), owner="u1")
    with pytest.raises(preparing.InstanceError, match="no GPU 3"):
        on.instances.ensure(W(3), owner="u1")


def test_a_corrupt_ledger_is_kept_aside_and_nothing_is_destroyed(node: Node) -> None:
    mine = node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")
    other = node.gpus.create_instance(0, profile="1g.10gb", start=0)
    node.ledger.write_text('{"version": 1, "claims": {"u1": [{"gpu": "zero"')
    restarted = node.restart()
    assert "DRA claims ledger" not in restarted.recovered_from  # the parser's own words
    assert restarted.recovered_from
    assert node.ledger.with_name("dra-claims.json.corrupt").exists()
    assert restarted.in_use() == {mine.uuid, other.uuid}  # the reconciler keeps them
    assert restarted.release("u1") == ()  # nobody owns them any more: nothing destroyed
    assert {d.uuid for d in node.devices()} == {mine.uuid, other.uuid}
    # The claim the kubelet prepares again at its placement adopts its instance.
    assert restarted.ensure(P(0, "3g.40gb", 4), owner="u1") == mine
    assert restarted.release("u1") == (P(0, "3g.40gb", 4),)
    assert [d.uuid for d in node.devices()] == [other.uuid]
    assert restarted.in_use() == {other.uuid}
    assert ownership.parse(node.ledger_doc(), source="f").uuids() == {other.uuid}


def test_an_unreadable_ledger_stops_the_start(node: Node) -> None:
    node.ledger.unlink()
    node.ledger.mkdir()
    with pytest.raises(Exception, match="cannot read it"):
        node.start()


# -- the reconciler ---------------------------------------------------------------------------


def test_the_reconciler_leaves_claims_instances_alone(node: Node) -> None:
    """The desired layout has none of the claim's instances: they are used, not destroyed."""
    mine = node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")
    stray = node.gpus.create_instance(0, profile="1g.10gb", start=0)
    used = reconciling.AnyOf([reconciling.RunningProcesses(node.gpus), node.instances])
    report = reconciling.Reconciler(node.gpus, used).reconcile(
        {0: changes.DesiredGpu(True, layouts.Layout(())), 1: changes.DesiredGpu(True)}
    )
    assert [d.uuid for d in node.devices()] == [mine.uuid]
    assert stray.uuid not in {d.uuid for d in node.devices()}
    assert report.refusals  # the claim's instance is reported as kept in use
    # Without the ledger as a source, the same pass would have destroyed it.
    bare = reconciling.Reconciler(node.gpus, reconciling.RunningProcesses(node.gpus))
    bare.reconcile({0: changes.DesiredGpu(True, layouts.Layout(()))})
    assert node.devices() == ()


def test_a_claim_prepared_or_released_makes_the_agents_pass_due(node: Node) -> None:
    """The agent passes at once (not at its 30 s interval) when the ledger changes, so the
    GpuLayout status says an instance was freed while the controller holds pods for it."""
    agent = running.Agent(
        gpus=node.gpus,
        in_use=reconciling.AnyOf([reconciling.RunningProcesses(node.gpus), node.instances]),
        # As the agent's assembly wires a DRA node's desired source.
        source=running.AlsoWatching(running.KeepLayout(), node.instances.owned),
        plugin=None,
        agent_metrics=metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=running.AgentSettings(interval_s=30.0),
    )
    agent.reconcile()
    assert not agent.due()
    node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")
    assert agent.due()
    assert agent.tick() is not None
    assert not agent.due()
    node.instances.ensure(P(0, "3g.40gb", 4), owner="u1")  # prepared again: nothing changed
    assert not agent.due()
    node.instances.release("u1")
    assert agent.due()
    agent.tick()
    node.instances.release("u1")  # released again: nothing changed
    assert not agent.due()


def test_the_reconciler_never_switches_mig_on_under_a_whole_gpu_claim(tmp_path: Path) -> None:
    off = Node(tmp_path, mig=False, gpus=1)
    off.instances.ensure(W(0), owner="u1")
    want = {0: changes.DesiredGpu(True, layouts.Layout((layouts.Instance(0, "7g.80gb"),)))}
    used = reconciling.AnyOf([reconciling.RunningProcesses(off.gpus), off.instances])
    reconciling.Reconciler(off.gpus, used, dynamic_mig=True).reconcile(want)
    (info,) = off.gpus.gpus()
    assert info.mig is not None and not info.mig.current
    off.instances.release("u1")  # the claim let go: now the GPU may be switched
    reconciling.Reconciler(off.gpus, used, dynamic_mig=True).reconcile(want)
    (info,) = off.gpus.gpus()
    assert info.mig is not None and info.mig.current


# -- CDI spec files ------------------------------------------------------------------------------


def claim(name: str, uid: str, devices: list[str]) -> dict[str, Any]:
    results = [
        {"request": "gpu", "driver": placements.DRIVER, "pool": NODE, "device": d} for d in devices
    ]
    return {
        "metadata": {"namespace": "default", "name": name, "uid": uid},
        "status": {"allocation": {"devices": {"results": results}}},
    }


def ref(name: str, uid: str) -> claims.ClaimRef:
    return claims.ClaimRef(namespace="default", name=name, uid=uid)


def test_the_spec_is_on_disk_when_prepare_answers_and_gone_after_unprepare(
    node: Node, tmp_path: Path
) -> None:
    source = MemoryClaims()
    specs = cdiclaims.ClaimSpecs(node.gpus, spec_dir=tmp_path / "cdi", proc_root=node.proc)
    preparer = preparing.Preparer(source, node.instances, {0: H100, 1: H100}, NODE, specs=specs)
    source.put(claim("c", "u1", ["gpu-0-mig-3g-40gb-4", "gpu-1-mig-1g-10gb-0"]))
    answer = preparer.prepare([ref("c", "u1")])["u1"]
    assert answer.error == ""
    doc = json.loads(specs.path("u1").read_text())
    VALIDATOR.validate(doc)
    assert doc["kind"] == "mig.migpilot.io/mig"
    assert [d["name"] for d in doc["devices"]] == ["gpu-0-mig-3g-40gb-4", "gpu-1-mig-1g-10gb-0"]
    written = {f"{doc['kind']}={d['name']}" for d in doc["devices"]}
    assert {i for d in answer.devices for i in d.cdi_ids} == written
    nodes = [n["path"] for n in doc["devices"][0]["containerEdits"]["deviceNodes"]]
    assert nodes[0].startswith("/dev/nvidia") and len(nodes) == 3  # GPU, GI cap, CI cap
    assert all(n.startswith("/dev/nvidia-caps/nvidia-cap") for n in nodes[1:])
    assert preparer.unprepare([ref("c", "u1")]) == {"u1": ""}
    assert not specs.path("u1").exists()
    assert node.devices(0) == () and node.devices(1) == ()


def test_a_spec_that_cannot_be_written_fails_the_claim_and_keeps_its_instance(
    node: Node, tmp_path: Path
) -> None:
    source = MemoryClaims()
    empty = tmp_path / "no-driver-files"
    specs = cdiclaims.ClaimSpecs(node.gpus, spec_dir=tmp_path / "cdi", proc_root=empty)
    preparer = preparing.Preparer(source, node.instances, {0: H100}, NODE, specs=specs)
    source.put(claim("c", "u1", ["gpu-0-mig-1g-10gb-0"]))
    answer = preparer.prepare([ref("c", "u1")])["u1"]
    assert "CDI spec: gpu-0-mig-1g-10gb-0: the driver lists no device minor" in answer.error
    assert answer.devices == () and not specs.path("u1").exists()
    assert len(node.instances.owned().of("u1")) == 1  # released by the kubelet's unprepare
    assert preparer.unprepare([ref("c", "u1")]) == {"u1": ""}
    assert node.devices() == ()


def test_whole_gpu_claims_get_the_gpus_node(tmp_path: Path) -> None:
    off = Node(tmp_path, mig=False, gpus=1)
    source = MemoryClaims()
    specs = cdiclaims.ClaimSpecs(off.gpus, spec_dir=tmp_path / "cdi", proc_root=off.proc)
    preparer = preparing.Preparer(source, off.instances, {}, NODE, specs=specs)
    source.put(claim("c", "u1", ["gpu-0"]))
    (device,) = preparer.prepare([ref("c", "u1")])["u1"].devices
    assert device.cdi_ids == ("mig.migpilot.io/mig=gpu-0",)
    (entry,) = json.loads(specs.path("u1").read_text())["devices"]
    assert [n["path"] for n in entry["containerEdits"]["deviceNodes"]] == ["/dev/nvidia0"]
    assert off.devices() == ()


# -- claims read through the agent's API -------------------------------------------------------


class Refusing:
    def __init__(self, err: kube_errors.KubeApiError) -> None:
        self.err = err

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        raise self.err


def test_claims_are_read_through_the_agents_api() -> None:
    api = kubeapi.InMemoryNodeApi()
    api.server.put(objects.Kind.RESOURCECLAIMS, claim("c", "u1", ["gpu-0-mig-1g-10gb-0"]))
    source = apiclaims.ApiClaims(api)
    got = source.read_claim("default", "c")
    assert got is not None and got["metadata"]["uid"] == "u1"
    assert source.read_claim("default", "gone") is None
    assert source.read_claim("other", "c") is None
    assert api.server.requests["get", objects.Kind.RESOURCECLAIMS] == 3


@pytest.mark.parametrize(
    ("err", "problem"),
    [
        (
            kube_errors.KubeApiError("403 Forbidden: no", code=403),
            "may not read ResourceClaims (403 Forbidden: no): its ClusterRole needs get on "
            "resourceclaims in resource.k8s.io",
        ),
        (kube_errors.KubeApiError("401 Unauthorized", code=401), "refused the agent's credentials"),
        (
            kube_errors.KubeApiError("the API server cannot be reached: timeout", transient=True),
            "did not answer (the API server cannot be reached: timeout); the kubelet retries",
        ),
        (kube_errors.KubeApiError("422 Invalid: x", code=422), "refused to read it: 422 Invalid"),
    ],
)
def test_api_failures_are_the_claims_error(err: kube_errors.KubeApiError, problem: str) -> None:
    preparer = preparing.Preparer(
        apiclaims.ApiClaims(Refusing(err)),
        MemoryInstancesNever(),
        {0: H100},
        NODE,
        specs=MemoryCdi(),
    )
    answer = preparer.prepare([ref("c", "u1")])["u1"]
    assert answer.error.startswith("claim default/c (u1): cannot read it from the API: ")
    assert problem in answer.error
    missing = preparing.Preparer(
        apiclaims.ApiClaims(Refusing(kube_errors.NotFoundError("404 Not Found", code=404))),
        MemoryInstancesNever(),
        {0: H100},
        NODE,
        specs=MemoryCdi(),
    )
    assert missing.prepare([ref("c", "u1")])["u1"].error == "claim default/c (u1) is not in the API"


class MemoryInstancesNever:
    """Instances no test here should reach: a claim that cannot be read creates nothing."""

    def ensure(self, placement: placements.Target, *, owner: str) -> preparing.Instance:
        raise AssertionError(f"ensure({placement}, {owner}) after a failed read")

    def release(self, owner: str) -> tuple[placements.Target, ...]:
        raise AssertionError("release")


# -- the agent's wiring --------------------------------------------------------------------------


def test_the_agent_starts_the_plugin_only_in_dra_mode_and_only_with_a_node(node: Node) -> None:
    plain = assembling.Settings()
    assert assembling._dra(plain, node.gpus, None, node.used, on=False) is None
    dra = assembling.Settings(kubelet=assembling.KubeletSettings(dra=True))
    with pytest.raises(errors.AgentConfigError, match="DRA mode needs --node NAME"):
        assembling._dra(dra, node.gpus, None, node.used, on=False)
    # the Node's label (migpilot.io/mode=dra) turns it on as the setting does
    with pytest.raises(errors.AgentConfigError, match="DRA mode needs --node NAME"):
        assembling._dra(plain, node.gpus, None, node.used, on=True)


def test_the_plugins_paths_are_below_the_kubelet_folder(tmp_path: Path) -> None:
    paths = dra_node.DraPaths(kubelet_dir=tmp_path / "k", cdi_spec_dir=tmp_path / "cdi")
    settings = paths.plugin_settings()
    assert settings.registration_socket == tmp_path / "k/plugins_registry/mig.migpilot.io-reg.sock"
    assert settings.dra_socket == tmp_path / "k/plugins/mig.migpilot.io/dra.sock"
    assert paths.ledger == tmp_path / "k/migpilot/dra-claims.json"


def test_placements_are_created_exactly_through_nvml_too(tmp_path: Path) -> None:
    """The NVML adapter's create is nvmlDeviceCreateGpuInstanceWithPlacement (through the CI
    stand-in that maps NVML's calls onto the emulated driver): the same exact starts."""
    emu = emulated.EmulatedBackend([H100], durable=False)
    gpus = nvml.NvmlBackend(nvml_standin.NvmlStandin(emu))
    ledger = tmp_path / "dra-claims.json"
    used = reconciling.RunningProcesses(gpus)
    instances = gpuinstances.BackendInstances(gpus, ledger_file=ledger, in_use=used)
    made = [
        instances.ensure(P(0, "1g.10gb", 6), owner="u1"),
        instances.ensure(P(0, "3g.40gb", 0), owner="u2"),
    ]
    assert [(d.profile, d.start, d.uuid) for d in emu.mig_devices(0)] == [
        ("3g.40gb", 0, made[1].uuid),
        ("1g.10gb", 6, made[0].uuid),
    ]
    again = gpuinstances.BackendInstances(gpus, ledger_file=ledger, in_use=used)
    assert again.ensure(P(0, "1g.10gb", 6), owner="u1") == made[0]
    assert len(emu.mig_devices(0)) == 2
    assert again.release("u2") == (P(0, "3g.40gb", 0),)
    assert [d.uuid for d in emu.mig_devices(0)] == [made[0].uuid]
