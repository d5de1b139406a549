"""DRA mode end to end on the real v1.37.2 control plane (issue 26, part 4).

A KWOK node labelled ``migpilot.io/mode=dra`` (one emulated H100 80GB) whose ``migpilot
agent`` publishes its ResourceSlices and serves the DRA kubelet plugin in a kubelet folder,
where :class:`tests.kube.drakubelet.DraKubelet` plays the node's kubelet: it registers the
plugin and calls NodePrepareResources with a pod's claims before marking it Running, and
NodeUnprepareResources before a deleted pod goes (KWOK's pod-ready and pod-delete Stages leave
that node's pods to it). Beside it a device-plugin node (one emulated A100 80GB, the stand-in
kubelet), with the webhook and the controller, as every other e2e scene runs them.

- Claims from the ResourceClaimTemplates of ``deploy/dra/`` (by profile, by memory, by model)
  are allocated by the real kube-scheduler, their pods run, the emulated GPU has exactly the
  allocated placements, and each prepared claim has its CDI spec file.
- A device in use is never allocated twice: more claims than fit leave the extra pods pending;
  deleting a pod unprepares its claim (the instance goes), then a pending pod's claim is
  allocated and prepared.
- A claim by memory gets the smallest profile that holds it.
- The device-plugin node keeps serving ``nvidia.com/mig-*`` pods.

Every wait has a generous timeout; no duration decides whether a test passes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.models.core_v1 import (
    Container,
    PodSchedulingGate,
    PodSpec,
)
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.resources.resource_v1 import ResourceClaim, ResourceSlice

from migpilot.agent.dra import placements, publishing
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.gpu import emulated
from migpilot.mig import catalog, profiles
from migpilot.webhook import registering
from tests.kube import controlplane, crds, drapods, kwokstages, system, tools
from tests.kube.drakubelet import DraKubelet
from tests.kube.scenes import container

pytestmark = pytest.mark.kube

REPO = Path(__file__).resolve().parents[2]
DRA = REPO / "deploy" / "dra"
DRA_NODE = "dra-h100"
DP_NODE = "dp-a100"
H100 = catalog.resolve_gpu("h100-80gb")
WAIT_S = 120.0
GATE = "migpilot.io/plan"
"""The scheduling gate migpilot's webhook adds and its controller removes."""
GIB = 1024
T = TypeVar("T")


@dataclasses.dataclass
class Cluster:
    """The control plane, migpilot's processes and the DRA node's kubelet."""

    plane: controlplane.ControlPlane
    system: system.System
    kubelet: DraKubelet
    root: Path
    namespace: str

    @property
    def client(self) -> lightkube.Client:
        return self.plane.client

    def start_dra_agent(self) -> None:
        """The DRA node's agent: emulated H100, the fake kubelet's folder, CDI specs and the
        emulated driver files below the scene's folder."""
        self.system.start_agent(
            DRA_NODE,
            "emulated:h100-80gb:x1",
            "--proc-root", str(self.root / "proc"),
            "--cdi-spec-dir", str(self.root / "cdi"),
            "--interval", "2",
            kubelet=str(self.kubelet.dir),
        )  # fmt: skip

    def stop_dra_agent(self) -> None:
        controlplane.stop_components([self.system.agents.pop(DRA_NODE)])

    def wait(self, probe: Callable[[], T | None], what: str, timeout: float = WAIT_S) -> T:
        return drapods.wait(self.system, probe, what, timeout=timeout, dump=self.dump)

    def dump(self) -> str:
        """Pods, claims, the kubelet's record and the agents' logs, for a failure."""
        lines = drapods.described(self.client, self.namespace)
        lines.append(f"kubelet errors: {self.kubelet.errors()[-10:]}")
        lines.append(f"emulated GPU: {self.instances()}")
        return "\n".join(lines) + "\n" + self.system.logs()

    def pod(
        self,
        name: str,
        template: str,
        *,
        claim: str | None = None,
        gated: bool = False,
        webhook: bool = False,
    ) -> None:
        """A pod with one claim: from ``template``, or the ResourceClaim ``claim``. Opted out
        of the webhook's gate (``migpilot.io/gating: disabled``) unless ``webhook``: most tests
        check kube-scheduler's own allocation (over a plan the test writes) and the kubelet
        plugin; ``gated``: held by migpilot's gate (``migpilot.io/plan``) all the same, as the
        webhook gates pods, for the controller to plan."""
        self.client.create(
            drapods.claim_pod(
                name,
                self.namespace,
                template=template if claim is None else None,
                claim=claim,
                labels=None if webhook else {registering.OPT_OUT_LABEL: "disabled"},
                gates=(GATE,) if gated else (),
            )
        )

    def spec_instances(self) -> set[tuple[int, str, int, str | None]]:
        """The DRA node's GpuLayout spec: (GPU, profile, start, reservedFor)."""
        doc = self.client.get(crds.GpuLayout, DRA_NODE).to_dict()
        layout = wire.parse(doc)
        return {
            (g.index, i.profile, i.start, i.reserved_for)
            for g in layout.spec.gpus
            for i in g.instances
        }

    def make_free_instances(self, instances: tuple[tuple[str, int], ...]) -> None:
        """Instances on the DRA node's GPU 0 that nobody uses, as an admin, a crash or the
        node's device-plugin days could leave them: made on the emulated GPU while the agent is
        stopped (in DRA mode the agent makes nothing from its spec), kept by a spec that lists
        them (a free instance the spec does not hold is destroyed)."""
        self.layout(instances)
        registered = self.kubelet.registrations()
        self.stop_dra_agent()
        gpus = emulated.EmulatedBackend(state_path=self.root / f"{DRA_NODE}.json")
        try:
            for profile, start in instances:
                gpus.create_instance(0, profile=profile, start=start)
        finally:
            gpus.close()
        self.start_dra_agent()
        self.wait(lambda: self.kubelet.registrations() > registered, "the new plugin registered")

    def phase(self, name: str) -> tuple[str, str | None]:
        got = self.client.get(Pod, name, namespace=self.namespace)
        assert got.status is not None and got.spec is not None
        return got.status.phase or "", got.spec.nodeName

    def claim(self, pod: str) -> dict[str, Any] | None:
        """The pod's claim as the API has it (``None``: not made yet)."""
        got = self.client.get(Pod, pod, namespace=self.namespace)
        statuses = (got.status.resourceClaimStatuses if got.status else None) or []
        names = [s.resourceClaimName for s in statuses if s.resourceClaimName]
        if not names:
            return None
        return self.client.get(ResourceClaim, names[0], namespace=self.namespace).to_dict()

    def allocated(self, pod: str) -> str | None:
        """The device the pod's claim was allocated (``None``: not yet)."""
        claim = self.claim(pod)
        allocation = ((claim or {}).get("status") or {}).get("allocation")
        if allocation is None:
            return None
        (result,) = allocation["devices"]["results"]
        assert (result["driver"], result["pool"]) == (publishing.DRIVER, DRA_NODE)
        return str(result["device"])

    def unschedulable(self, pod: str) -> bool:
        got = self.client.get(Pod, pod, namespace=self.namespace)
        conditions = (got.status.conditions if got.status else None) or []
        return any(
            c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"
            for c in conditions
        )

    def instances(self) -> set[tuple[int, str, int]]:
        """The emulated GPUs' MIG instances (GPU, profile, start), from the agent's state file."""
        path = self.root / f"{DRA_NODE}.json"
        if not path.exists():
            return set()
        state = json.loads(path.read_text())
        return {
            (g["index"], i["profile"], i["start"]) for g in state["gpus"] for i in g["instances"]
        }

    def uuids(self) -> dict[tuple[int, str, int], str | None]:
        """(GPU, profile, start) -> the instance's MIG UUID, from the agent's state file."""
        state = json.loads((self.root / f"{DRA_NODE}.json").read_text())
        return {
            (g["index"], i["profile"], i["start"]): i["uuid"]
            for g in state["gpus"]
            for i in g["instances"]
        }

    def layout(
        self, instances: tuple[tuple[str, int], ...], *, reserved_for: str | None = None
    ) -> None:
        """The DRA node's GpuLayout spec: these (profile, start) on GPU 0, as an admin (or the
        node's device-plugin days) could have left it, or, ``reserved_for`` a pod, as the
        planner's target for the node."""
        spec = gl.LayoutSpec(
            (
                gl.GpuSpec(
                    0,
                    H100.id,
                    tuple(gl.InstanceSpec(p, s, reserved_for) for p, s in instances),
                ),
            )
        )
        self.client.apply(
            codecs.from_dict(dict(wire.spec_patch(DRA_NODE, spec))),
            field_manager=gl.CONTROLLER_FIELD_MANAGER,
            force=True,
        )

    def cdi_spec(self, claim_uid: str) -> Path:
        return self.root / "cdi" / f"migpilot-dra-{claim_uid}.json"


def _placement(device: str) -> tuple[int, str, int]:
    target = placements.parse_target(device, {0: H100})
    assert isinstance(target, placements.Placement), device
    return target.gpu, target.profile, target.start


def _apply_deploy_dra(client: lightkube.Client, namespace: str) -> None:
    """The DeviceClass and the example templates of deploy/dra/, as shipped."""
    for path in sorted(DRA.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc["kind"] != "DeviceClass":
                doc["metadata"]["namespace"] = namespace
            if doc:
                client.create(codecs.from_dict(doc))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A control plane of its own (KWOK's Stages leave the DRA node's pods to its kubelet)."""
    root = tmp_path_factory.mktemp("dra")
    found = tools.locate()
    stages = kwokstages.kwok_stages(
        found.kwok_stages,
        nodes=(DRA_NODE,),
        folder=root / "stages",
        names=(kwokstages.POD_READY, kwokstages.POD_DELETE),
    )
    plane = controlplane.ControlPlane.start(found=dataclasses.replace(found, kwok_stages=stages))
    sys_ = system.System(plane, root)
    # A short folder: a unix socket's path has at most 107 bytes, pytest's tmp_path is long.
    folder = Path(tempfile.mkdtemp(prefix="mpdra-"))
    kubelet = DraKubelet(folder, node=DRA_NODE, kubeconfig=plane.kubeconfig)
    namespace = f"dra-{uuid.uuid4().hex[:6]}"
    try:
        sys_.prepare()
        plane.client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        _apply_deploy_dra(plane.client, namespace)
        sys_.start_webhook()
        kubelet.start()
        (root / "proc").mkdir()
        plane.add_node(DRA_NODE, labels={"migpilot.io/mode": "dra"})
        sys_.nodes.append(DRA_NODE)
        cluster = Cluster(plane, sys_, kubelet, root, namespace)
        cluster.start_dra_agent()
        sys_.add_node(DP_NODE, "emulated:a100-80gb:x1")
        sys_.start_controller("c1")
        yield cluster
    finally:
        kubelet.stop()
        sys_.stop()
        plane.stop()
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def dra(cluster: Cluster) -> Iterator[Cluster]:
    """The DRA node ready (its pool published with nothing used, its plugin registered); no
    prepare or unprepare refused during the test; its pods deleted afterwards, and every claim
    unprepared, so the next test starts empty."""

    def ready() -> bool:
        found = [
            s.to_dict()
            for s in cluster.client.list(
                ResourceSlice, fields={"spec.nodeName": DRA_NODE, "spec.driver": publishing.DRIVER}
            )
        ]
        counters = [c for s in found for c in s["spec"].get("sharedCounters") or ()]
        free = all(v == {"value": "1"} for c in counters for k, v in c["counters"].items()
                   if k.startswith("memory-slice-"))  # fmt: skip
        return cluster.kubelet.registered and len(counters) == 1 and free

    cluster.wait(ready, "the DRA node's pool published, nothing used, and its plugin registered")
    seen = len(cluster.kubelet.errors())
    try:
        yield cluster
        # No claim the scheduler allocated was refused by the plugin, not even once (a refusal
        # the kubelet retried until it passed would hide a wrong pool or plugin).
        refused = [
            e for e in cluster.kubelet.errors()[seen:] if e.startswith(("prepare ", "unprepare "))
        ]
        assert not refused, refused
    finally:
        for p in cluster.client.list(Pod, namespace=cluster.namespace):
            assert p.metadata is not None
            with contextlib.suppress(lightkube.ApiError):
                cluster.client.delete(Pod, p.metadata.name or "", namespace=cluster.namespace)
        cluster.wait(
            lambda: (
                not list(cluster.client.list(Pod, namespace=cluster.namespace))
                and not cluster.kubelet.prepared()
                and not cluster.instances()
            ),
            "every pod gone, its claim unprepared and its instance destroyed",
        )


def _running(cluster: Cluster, names: list[str]) -> dict[str, str] | None:
    """Pod -> node, once every one of ``names`` runs (``None`` before)."""
    out = {}
    for name in names:
        phase, node = cluster.phase(name)
        if phase != "Running" or node is None:
            return None
        out[name] = node
    return out


def _template(name: str, namespace: str, cel: str, *, count: int = 1) -> Any:
    """A ResourceClaimTemplate of one request of the driver's class."""
    request = {
        "deviceClassName": publishing.DRIVER,
        "selectors": [{"cel": {"expression": cel}}],
        "count": count,
    }
    devices = {"requests": [{"name": "mig", "exactly": request}]}
    return codecs.from_dict(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaimTemplate",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"spec": {"devices": devices}},
        }
    )


def _smallest_holding(model: profiles.GpuModel, mib: int) -> str:
    """The profile a claim for ``mib`` should get: the least memory that holds it, then the
    fewest memory and compute slices (the catalog's figures, not the publisher's order)."""
    fits = [p for p in model.profiles if p.memory_mib is not None and p.memory_mib >= mib]
    best = min(fits, key=lambda p: (p.memory_mib or 0, p.memory_slots, p.compute_slices))
    return best.name


def test_claims_from_templates_are_allocated_prepared_and_run(dra: Cluster) -> None:
    """By profile, by memory (the smallest profile with 20Gi: 3g.40gb on an H100, whose
    2g.20gb has 19.6 GiB), by model: kube-scheduler allocates, the kubelet prepares, the pods
    run on the DRA node, the GPU has exactly those instances and each claim its CDI spec."""
    asked = {"by-profile": "mig-1g-10gb", "by-memory": "mig-20gi", "by-model": "mig-h100-80gb"}
    for pod, template in asked.items():
        dra.pod(pod, template)
    placed = dra.wait(lambda: _running(dra, list(asked)), "the three pods Running")
    assert set(placed.values()) == {DRA_NODE}
    devices = {pod: dra.allocated(pod) for pod in asked}
    got = {pod: _placement(d) for pod, d in devices.items() if d is not None}
    assert len(got) == 3
    assert got["by-profile"][1] == "1g.10gb"
    assert got["by-memory"][1] == _smallest_holding(H100, 20 * GIB) == "3g.40gb"
    assert got["by-model"][1] in {p.name for p in H100.profiles}
    # Exactly the allocated placements, no more: created by prepare, nothing else made.
    assert dra.instances() == set(got.values())
    prepared = dra.kubelet.prepared()
    for pod in asked:
        claim = dra.claim(pod)
        assert claim is not None
        uid = claim["metadata"]["uid"]
        ((device,),) = [tuple(d.device for d in prepared[uid])]
        assert device == devices[pod]
        spec = json.loads(dra.cdi_spec(uid).read_text())
        assert [d["name"] for d in spec["devices"]] == [device]
        assert prepared[uid][0].cdi_ids == (f"{spec['kind']}={device}",)


@pytest.mark.parametrize("gib", [9, 19, 20, 40])
def test_a_claim_by_memory_gets_the_smallest_profile_that_holds_it(dra: Cluster, gib: int) -> None:
    """On an empty H100 80GB a claim for at least ``gib`` GiB gets the profile with the least
    memory that holds it (then the fewest slices): 9 -> 1g.10gb, 19 -> 1g.20gb (19.6 GiB),
    20 -> 3g.40gb (the 20 GB profiles have 19.6 GiB), 40 -> 7g.80gb (the 40 GB ones have
    39.5)."""
    cel = (
        'device.attributes["mig.migpilot.io"].type == "mig" && '
        f'device.capacity["mig.migpilot.io"].memory.compareTo(quantity("{gib}Gi")) >= 0'
    )
    dra.client.create(_template(f"mig-{gib}gi-test", dra.namespace, cel))
    dra.pod("memory", f"mig-{gib}gi-test")
    dra.wait(lambda: dra.phase("memory")[0] == "Running", f"the {gib}Gi pod Running")
    _, profile, _ = _placement(dra.allocated("memory") or "")
    assert profile == _smallest_holding(H100, gib * GIB)
    assert {p for _, p, _ in dra.instances()} == {profile}


def test_a_claim_of_two_devices_gets_two_instances_in_one_spec(dra: Cluster) -> None:
    """``count: 2`` of 1g.10gb: two placements allocated, both made by one prepare, one CDI spec
    with both devices; both go with the pod."""
    cel = 'device.attributes["mig.migpilot.io"].profile == "1g.10gb"'
    dra.client.create(_template("two-1g", dra.namespace, cel, count=2))
    dra.pod("pair", "two-1g")
    dra.wait(lambda: dra.phase("pair")[0] == "Running", "the pod of two devices Running")
    claim = dra.claim("pair")
    assert claim is not None
    results = claim["status"]["allocation"]["devices"]["results"]
    devices = sorted(r["device"] for r in results)
    assert len(set(devices)) == 2
    assert dra.instances() == {_placement(d) for d in devices}
    uid = claim["metadata"]["uid"]
    spec = json.loads(dra.cdi_spec(uid).read_text())
    assert sorted(d["name"] for d in spec["devices"]) == devices
    assert sorted(d.device for d in dra.kubelet.prepared()[uid]) == devices


def test_two_pods_of_one_claim_share_its_instance_until_the_last_goes(dra: Cluster) -> None:
    """A ResourceClaim two pods name: one placement, one instance, prepared for both (the
    second prepare answers the same and makes nothing); the first pod's deletion leaves it,
    the last one's unprepares it."""
    template = yaml.safe_load((DRA / "claimtemplates.yaml").read_text().split("---")[0])
    shared = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "shared", "namespace": dra.namespace},
        "spec": template["spec"]["spec"],
    }
    dra.client.create(codecs.from_dict(shared))
    try:
        dra.pod("one", "", claim="shared")
        dra.pod("two", "", claim="shared")
        dra.wait(lambda: _running(dra, ["one", "two"]), "both pods of the claim Running")
        claim = dra.client.get(ResourceClaim, "shared", namespace=dra.namespace).to_dict()
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        assert dra.instances() == {_placement(result["device"])}
        uid = claim["metadata"]["uid"]
        dra.client.delete(Pod, "one", namespace=dra.namespace)
        dra.wait(lambda: _gone(dra, "one"), "the first pod gone")
        assert uid not in dra.kubelet.unprepared() and uid in dra.kubelet.prepared()
        assert dra.instances() == {_placement(result["device"])}
        dra.client.delete(Pod, "two", namespace=dra.namespace)
        dra.wait(lambda: uid in dra.kubelet.unprepared(), "the claim unprepared with the last")
        dra.wait(lambda: not dra.instances(), "its instance destroyed")
    finally:
        with contextlib.suppress(lightkube.ApiError):
            dra.client.delete(ResourceClaim, "shared", namespace=dra.namespace)


def _gone(cluster: Cluster, pod: str) -> bool:
    try:
        cluster.client.get(Pod, pod, namespace=cluster.namespace)
    except lightkube.ApiError as err:
        return err.status.code == 404
    return False


def test_a_device_in_use_is_never_allocated_twice(dra: Cluster) -> None:
    """Eight claims for a 1g.10gb, seven fit an H100: seven run on seven distinct placements,
    the eighth waits. Deleting a running pod unprepares its claim (its instance goes, before
    the pod does); then the waiting claim is allocated, prepared and its pod runs."""
    fits = next(p for p in H100.profiles if p.name == "1g.10gb").max_instances
    names = [f"small-{i}" for i in range(fits + 1)]
    for name in names:
        dra.pod(name, "mig-1g-10gb")

    def settled() -> tuple[list[str], list[str]] | None:
        running = [n for n in names if dra.phase(n)[0] == "Running"]
        waiting = [n for n in names if dra.unschedulable(n)]
        return (running, waiting) if len(running) == fits and len(waiting) == 1 else None

    running, (waiting,) = dra.wait(settled, f"{fits} pods Running and one unschedulable")
    devices = [dra.allocated(n) for n in running]
    assert None not in devices and len(set(devices)) == fits
    assert dra.allocated(waiting) is None
    assert dra.instances() == {_placement(d) for d in devices if d is not None}

    freed = running[0]
    claim = dra.claim(freed)
    assert claim is not None
    dra.client.delete(Pod, freed, namespace=dra.namespace)
    dra.wait(lambda: claim["metadata"]["uid"] in dra.kubelet.unprepared(), "the unprepare")
    dra.wait(lambda: dra.phase(waiting)[0] == "Running", "the waiting pod Running")
    later = [dra.allocated(n) for n in names if n != freed]
    assert None not in later and len(set(later)) == fits
    assert dra.instances() == {_placement(d) for d in later if d is not None}
    assert not dra.cdi_spec(claim["metadata"]["uid"]).exists()


def test_an_agent_restart_keeps_the_claims_instances_and_serves_on(dra: Cluster) -> None:
    """The DRA node's agent stops while two claims are prepared and starts again: its ledger
    gives the claims their instances back (none destroyed, none made), the kubelet registers
    the new plugin, the pool still counts them as allocated (the two fill every memory slice:
    a new claim waits), and deleting a pod unprepares its claim through the new agent, whose
    place the waiting claim then gets."""
    for name in ("a", "b"):
        dra.pod(name, "mig-20gi")
    dra.wait(lambda: _running(dra, ["a", "b"]), "two 3g.40gb pods Running")
    before = dra.uuids()
    registered = dra.kubelet.registrations()
    dra.stop_dra_agent()
    dra.start_dra_agent()
    dra.wait(lambda: dra.kubelet.registrations() > registered, "the new plugin registered")
    assert dra.uuids() == before
    dra.pod("c", "mig-1g-10gb")
    dra.wait(lambda: dra.unschedulable("c"), "the third pod to wait: the GPU is full")
    claim = dra.claim("a")
    assert claim is not None
    dra.client.delete(Pod, "a", namespace=dra.namespace)
    dra.wait(lambda: claim["metadata"]["uid"] in dra.kubelet.unprepared(), "a's unprepare")
    dra.wait(lambda: dra.phase("c")[0] == "Running", "the third pod Running in a's place")
    assert (
        dra.uuids()[_placement(dra.allocated("b") or "")]
        == before[_placement(dra.allocated("b") or "")]
    )


def test_free_instances_left_on_the_node_are_taken_by_the_claims_allocated_there(
    dra: Cluster,
) -> None:
    """Instances nobody uses (here a 1g.10gb at 0 and a 3g.40gb at 4) are offered
    like any placement: a claim allocated exactly the 1g.10gb at 0 gets that instance, and one
    allocated the 1g.10gb at 4 (a claim by attribute: ``start == 4``) gets the 3g.40gb there
    destroyed and its own made. Neither stays pending in the kubelet."""
    dra.make_free_instances((("1g.10gb", 0), ("3g.40gb", 4)))
    try:

        def offered() -> dict[tuple[int, str, int], str | None] | None:
            found = dra.uuids()
            return found if len(found) == 2 and None not in found.values() else None

        before = dra.wait(offered, "the GpuLayout's two instances")
        at_4 = (
            'device.attributes["mig.migpilot.io"].profile == "1g.10gb" && '
            'device.attributes["mig.migpilot.io"].start == 4'
        )
        dra.client.create(_template("mig-1g-10gb-at-4", dra.namespace, at_4))
        dra.pod("exact", "mig-1g-10gb")
        dra.wait(lambda: dra.phase("exact")[0] == "Running", "the pod on the free 1g.10gb")
        assert dra.allocated("exact") == "gpu-0-mig-1g-10gb-0"
        assert dra.uuids()[(0, "1g.10gb", 0)] == before[(0, "1g.10gb", 0)]  # adopted
        dra.pod("over", "mig-1g-10gb-at-4")
        dra.wait(lambda: dra.phase("over")[0] == "Running", "the pod inside the free 3g.40gb")
        assert dra.allocated("over") == "gpu-0-mig-1g-10gb-4"
        assert dra.instances() == {(0, "1g.10gb", 0), (0, "1g.10gb", 4)}
    finally:
        dra.layout(())


def _listed_first(cluster: Cluster) -> list[str] | None:
    """The devices of the DRA node's planned slice (``None``: it has none)."""
    name = f"{DRA_NODE}-{publishing.DRIVER}-devices-0000"
    for found in cluster.client.list(
        ResourceSlice, fields={"spec.nodeName": DRA_NODE, "spec.driver": publishing.DRIVER}
    ):
        doc = found.to_dict()
        if doc["metadata"]["name"] == name:
            return [d["name"] for d in doc["spec"].get("devices") or ()]
    return None


def test_the_planned_placements_listed_first_are_what_kube_scheduler_allocates(
    dra: Cluster,
) -> None:
    """The planner's target for the DRA node (its GpuLayout spec, instances reserved for pods)
    is not made by the agent; while the controller's Lease is fresh (the controller runs) its
    placements are listed first, smallest first, and the real kube-scheduler allocates them: a
    claim by memory (20 GiB) gets the planned 3g.40gb at 4, not the 3g.40gb at 0 first fit
    gives; a claim by profile the planned 1g.10gb at 3, not the one at 0. A third claim, the
    plan spent, falls back to first fit (soft steering)."""
    # The pod the plan is for: pending (held by a gate of the test's own), so its reservation
    # is live and the controller, which drops reservations of pods gone or bound, keeps it.
    dra.client.create(
        Pod(
            metadata=ObjectMeta(name="planned", namespace=dra.namespace),
            spec=PodSpec(
                containers=[Container(name="app", image="app")],
                schedulingGates=[PodSchedulingGate(name="test.migpilot.io/hold")],
            ),
        )
    )
    # Its reservation written before the controller's pod watch has the pod would be dropped as
    # stale (the agent would then make the instances, free): let the watch catch up.
    time.sleep(2)
    plan = (("3g.40gb", 4), ("1g.10gb", 3))
    dra.layout(plan, reserved_for=f"{dra.namespace}/planned")
    try:
        planned = ["gpu-0-mig-1g-10gb-3", "gpu-0-mig-3g-40gb-4"]
        dra.wait(lambda: _listed_first(dra) == planned or None, "the plan listed first")
        assert not dra.instances()  # the DRA plugin makes them, at NodePrepareResources
        dra.pod("by-memory", "mig-20gi")
        dra.wait(lambda: dra.phase("by-memory")[0] == "Running", "the pod by memory Running")
        assert dra.allocated("by-memory") == "gpu-0-mig-3g-40gb-4"
        dra.pod("by-profile", "mig-1g-10gb")
        dra.wait(lambda: dra.phase("by-profile")[0] == "Running", "the pod by profile Running")
        assert dra.allocated("by-profile") == "gpu-0-mig-1g-10gb-3"
        dra.pod("unplanned", "mig-1g-10gb")
        dra.wait(lambda: dra.phase("unplanned")[0] == "Running", "the unplanned pod Running")
        assert dra.allocated("unplanned") == "gpu-0-mig-1g-10gb-0"
        assert dra.instances() == {(0, "3g.40gb", 4), (0, "1g.10gb", 3), (0, "1g.10gb", 0)}
        assert _listed_first(dra) == planned  # the claims' devices stay where they were
    finally:
        dra.layout(())
        for pod in ("by-memory", "by-profile", "unplanned", "planned"):
            with contextlib.suppress(lightkube.ApiError):
                dra.client.delete(Pod, pod, namespace=dra.namespace)
        dra.wait(lambda: _listed_first(dra) is None or None, "the planned slice gone")


def test_the_device_plugin_node_beside_serves_mig_pods(dra: Cluster) -> None:
    """A pod asking ``nvidia.com/mig-3g.40gb`` runs on the device-plugin node, planned by the
    controller as ever; the DRA node has no ``nvidia.com/mig-*`` resources."""
    client = dra.client
    client.create(
        Pod(
            metadata=ObjectMeta(name="dp-pod", namespace=dra.namespace),
            spec=PodSpec(containers=[container("3g.40gb")]),
        )
    )
    dra.wait(lambda: dra.phase("dp-pod") == ("Running", DP_NODE), "the device-plugin pod Running")
    node = client.get(Node, DRA_NODE)
    allocatable = (node.status.allocatable if node.status else None) or {}
    assert not [k for k in allocatable if k.startswith("nvidia.com/")]
    dra.pod("beside", "mig-1g-10gb")  # and the DRA node serves claims meanwhile
    dra.wait(lambda: dra.phase("beside") == ("Running", DRA_NODE), "the DRA pod Running")


def _only_templates(dra: Cluster) -> None:
    """Templates by profile the example ones lack: ``only-4g`` and ``only-2g``."""
    for name, cel in (
        ("only-4g", f'device.attributes["{publishing.DRIVER}"].profile == "4g.40gb"'),
        ("only-2g", f'device.attributes["{publishing.DRIVER}"].profile == "2g.20gb"'),
    ):
        with contextlib.suppress(lightkube.ApiError):  # made by an earlier test of the module
            dra.client.create(_template(name, dra.namespace, cel))


def _pinned_to(dra: Cluster, name: str) -> list[tuple[str, str, list[str] | None]]:
    pod = dra.client.get(Pod, name, namespace=dra.namespace)
    assert pod.spec is not None and not pod.spec.schedulingGates
    assert pod.spec.nodeName == DRA_NODE
    affinity = pod.spec.affinity
    assert affinity is not None and affinity.nodeAffinity is not None
    required = affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution
    assert required is not None
    return [
        (f.key, f.operator, f.values)
        for term in required.nodeSelectorTerms
        for f in term.matchFields or ()
    ]


def _lone_gated_pod(dra: Cluster, name: str, template: str) -> tuple[int, str, int]:
    """A pod held by migpilot's gate with one claim from ``template``, alone: once Running,
    pinned to the DRA node, the (GPU, profile, start) its claim was allocated."""
    dra.pod(name, template, gated=True)
    dra.wait(lambda: dra.phase(name)[0] == "Running", "the pod Running")
    assert _pinned_to(dra, name) == [("metadata.name", "In", [DRA_NODE])]
    device = dra.allocated(name)
    assert device is not None
    return _placement(device)


def test_a_lone_gated_pod_is_left_to_first_fit_pinned_and_ungated(dra: Cluster) -> None:
    """The controller's first-fit check: a pod held by migpilot's gate asking for a
    ``4g.40gb`` (one start on an H100), alone, is served as well by kube-scheduler's first fit
    as by the plan, and the plan keeps no more room, so the round is not steered. The pod is
    pinned to the DRA node first fit picks (never the device-plugin node beside it) and
    ungated, the node's target lists nothing first, and the real kube-scheduler allocates what
    first fit gives, which the plugin then makes. (The next test and the three pods below are
    the steered cases.)"""
    _only_templates(dra)
    gpu, profile, start = _lone_gated_pod(dra, "unsteered", "only-4g")
    assert (profile, start) == ("4g.40gb", 0)
    # nothing listed first: the target holds no placement but what is allocated
    assert {(g, p, st) for g, p, st, _ in dra.spec_instances()} <= {(gpu, profile, start)}
    assert dra.instances() == {(gpu, profile, start)}


def test_a_lone_gated_pod_is_steered_where_first_fit_loses_room(dra: Cluster) -> None:
    """A lone pod with a claim by memory (20 GiB): first fit over the smallest-first listing
    gives the smallest fitting profile, ``3g.40gb``, at its first start, slot 0, which leaves
    no ``4g.40gb`` placeable (its only start is 0). The plan serves the same one pod at slot 4
    and keeps the ``4g.40gb``: the round is steered, and the real kube-scheduler allocates the
    planned placement, listed first."""
    gpu, profile, start = _lone_gated_pod(dra, "roomy", "mig-20gi")
    assert (profile, start) == ("3g.40gb", 4)
    assert dra.instances() == {(gpu, profile, start)}
    dra.client.delete(Pod, "roomy", namespace=dra.namespace)
    dra.wait(lambda: _gone(dra, "roomy"), "the pod gone")
    dra.wait(lambda: not dra.spec_instances() or None, "the controller empties the target")


def test_pods_the_webhook_gates_are_planned_together_and_all_run(dra: Cluster) -> None:
    """The whole path, nothing by hand: three pods whose claims ask for a ``1g.10gb``, a
    ``2g.20gb`` and a ``4g.40gb``, arriving smallest first, are gated by the webhook (it reads
    their templates), planned by the controller, pinned, ungated and allocated by the real
    kube-scheduler at placements of the plan, and all run on the one H100. First fit alone,
    with the smallest placements listed first, gives the ``1g.10gb`` slot 0, the only start of
    a ``4g.40gb``, and that pod never runs: the plan serves more, so the first-fit check steers
    the round."""
    _only_templates(dra)
    # Named so that kube-scheduler's queue order (oldest first, then by name: created within a
    # second, they are) is smallest first, where first fit serves two and the plan three: the
    # round is steered (large first, first fit would serve all three, and it is not).
    pods = {"a-small": "mig-1g-10gb", "b-medium": "only-2g", "c-large": "only-4g"}
    for name, template in pods.items():
        dra.pod(name, template, webhook=True)
        got = dra.client.get(Pod, name, namespace=dra.namespace)
        assert got.spec is not None
        assert [g.name for g in got.spec.schedulingGates or ()] == [GATE], name
    running = dra.wait(lambda: _running(dra, list(pods)), "the three gated pods Running")
    assert set(running.values()) == {DRA_NODE}
    placed = {}
    for name in pods:
        device = dra.allocated(name)
        assert device is not None, name
        placed[name] = _placement(device)
    assert sorted(p for _, p, _ in placed.values()) == ["1g.10gb", "2g.20gb", "4g.40gb"]
    assert placed["c-large"][2] == 0  # the 4g.40gb's only start
    planned = {(g, p, st) for g, p, st, _ in dra.spec_instances()}
    assert set(placed.values()) <= planned  # kube-scheduler took the plan's placements
    assert dra.instances() == set(placed.values())
    # The pods gone, nothing waits for the target's placements: the controller writes the
    # target back to the node's used instances (none), so the agent destroys the instances
    # instead of keeping them free and listed first.
    for name in pods:
        dra.client.delete(Pod, name, namespace=dra.namespace)
    dra.wait(lambda: all(_gone(dra, n) for n in pods), "the three pods gone")
    dra.wait(lambda: not dra.spec_instances() or None, "the controller empties the target")
