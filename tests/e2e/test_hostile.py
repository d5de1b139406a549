"""Hostile input on a real control plane: nothing a tenant writes stops migpilot.

The whole system runs (webhook, controller, one agent per node, kube-scheduler, KWOK) with two
MIG nodes and one time-slicing node whose agent serves NVIDIA's named device-plugin configs.
MIG pods are served first; then the suite throws at it what a review with hostile inputs found
(issue 20): pods and a Node with quantities of huge exponent (which kube-apiserver accepts and
stores as ``10e999999``), a pod bound to a GPU node with such a quantity, malformed and
oversized AdmissionReviews sent straight to the webhook, GpuLayouts with bad specs, and
device-plugin configs with bombs (YAML nested thousands deep, an alias bomb, 10**23 replicas).
Then more MIG pods are created, and every one must be served, while:

- every migpilot process is still running, and the controller and agents still answer;
- the bad pods and the bad Node each got a Warning Event from migpilot saying it ignores them;
- no instance in use was destroyed: the UUIDs of the instances held before are all still there
  (read from the GpuLayouts' status, not from logs);
- a bad config kept the last good one (``migpilot.io/sharing.state=failed``) and a good one is
  served again after it.

Each case and its outcome is recorded; with ``MIGPILOT_HOSTILE_RESULTS=PATH`` the record is
written there as JSON (``bench/hostile.py`` writes ``bench/results/hostile.json`` that way).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import pathlib
import socket
import ssl
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import lightkube
import pytest
from lightkube import codecs
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Event, Namespace, Node, Pod
from lightkube.types import PatchType

from migpilot.api import gpulayouts as gl
from migpilot.sharing import labelling
from tests.kube import crds
from tests.kube.scenes import Scene

pytestmark = pytest.mark.kube

RESULTS_ENV = "MIGPILOT_HOSTILE_RESULTS"
SHARING_NODE = "ctl-share"
HUGE = "1e1000000"
"""kube-apiserver accepts this and stores it as ``10e999999``: only binary suffixes are capped."""
GOOD_CONFIG = (
    "version: v1\nflags: {migStrategy: none}\n"
    "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}\n"
)
LAUGHS = "\n".join(
    [
        'version: v1\nflags: {migStrategy: none}\nl0: &l0 ["lol","lol","lol","lol","lol","lol"]',
        *(f"l{i}: &l{i} [{','.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)),
        "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2, devices: *l9}]}}",
    ]
)
LOG_LIMIT = 4 << 20
"""Bytes the sharing node's agent log may reach over the whole test (about 6 KB): a
message that quoted the alias bomb whole once wrote 1.9 GB."""
BOMBS = {
    "deep": "version: v1\nx: " + "[" * 5000 + "]" * 5000 + "\n",
    "laughs": LAUGHS + "\n",
    "replicas": "version: v1\nflags: {migStrategy: none}\n"
    "sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, "
    "replicas: 100000000000000000000000}]}}\n",
}


@dataclass
class Case:
    """One hostile input and what became of it."""

    kind: str
    """``pod``, ``node``, ``admission``, ``gpulayout`` or ``config``."""
    name: str
    input: str
    outcome: str = ""
    """What the API server and migpilot did with it."""
    passed: bool = False


@dataclass
class Record:
    cases: list[Case] = field(default_factory=list)

    def add(self, kind: str, name: str, what: str) -> Case:
        case = Case(kind, name, what)
        self.cases.append(case)
        return case

    def write(self, path: pathlib.Path, **extra: Any) -> None:
        doc = {
            "what": "tests/e2e/test_hostile.py: hostile inputs on the real control plane",
            **extra,
            "cases": [asdict(c) for c in self.cases],
            "passed": sum(c.passed for c in self.cases),
            "failed": sum(not c.passed for c in self.cases),
        }
        path.write_text(json.dumps(doc, indent=2) + "\n")


def _pod(name: str, namespace: str, limits: dict[str, str], **spec: Any) -> Pod:
    return Pod(
        metadata=ObjectMeta(name=name, namespace=namespace),
        spec=PodSpec(
            containers=[
                Container(
                    name="c",
                    image="none",
                    resources=ResourceRequirements(requests=limits, limits=limits),
                )
            ],
            **spec,
        ),
    )


def _create(client: lightkube.Client, obj: Any) -> str:
    """``created`` or what the API server said when it refused ``obj``."""
    try:
        client.create(obj)
    except lightkube.ApiError as e:
        return f"refused by the API server: {e.status.message}"
    return "created"


def _warned(client: lightkube.Client, *, namespace: str | None, name: str) -> str | None:
    """The message of a Warning Event migpilot wrote about ``name``, if any."""
    for e in client.list(Event, namespace=namespace or "default"):
        obj = e.involvedObject
        if obj.name == name and e.type == "Warning" and "migpilot" in (e.message or ""):
            return e.message
    return None


def _used_uuids(scene: Scene) -> set[str]:
    out: set[str] = set()
    for node in ("ctl-a100", "ctl-h100"):
        lay = scene.layout(node)
        for g in lay.status.gpus if lay is not None and lay.status is not None else ():
            out |= {i.uuid for i in g.instances if i.uuid and i.state == gl.InstanceState.USED}
    return out


def _all_uuids(scene: Scene) -> set[str]:
    out: set[str] = set()
    for node in ("ctl-a100", "ctl-h100"):
        lay = scene.layout(node)
        for g in lay.status.gpus if lay is not None and lay.status is not None else ():
            out |= {i.uuid for i in g.instances if i.uuid}
    return out


def _invalid_spec(scene: Scene, node: str) -> str | None:
    """The message of the node's GpuLayout condition saying its spec is refused, if any."""
    doc = scene.client.get(crds.GpuLayout, node).to_dict()
    for condition in (doc.get("status") or {}).get("conditions") or []:
        if condition.get("reason") == "InvalidSpec":
            return str(condition.get("message"))
    return None


class Webhook:
    """Raw HTTPS to the webhook on loopback, as the API server (or anyone who reaches its
    port) would send."""

    def __init__(self, scene: Scene) -> None:
        assert scene.webhook_port is not None and scene.webhook_ca is not None
        self.port = scene.webhook_port
        self.context = ssl.create_default_context(cafile=scene.webhook_ca)

    def post(self, path: str, body: bytes, *, timeout: float = 60.0) -> tuple[int, bytes]:
        conn = http.client.HTTPSConnection(
            "127.0.0.1", self.port, context=self.context, timeout=timeout
        )
        try:
            conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def stall(self) -> ssl.SSLSocket:
        """A connection that says it sends a body of 1 MiB, sends 10 bytes, and waits."""
        raw = socket.create_connection(("127.0.0.1", self.port), timeout=30)
        conn = self.context.wrap_socket(raw, server_hostname="127.0.0.1")
        conn.sendall(
            b"POST /mutate-pods HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1048576\r\n\r\n" + b'{"kind":"A'
        )
        return conn


def _review(pod: dict[str, Any]) -> bytes:
    return json.dumps(
        {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": str(uuid.uuid4()),
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": "default",
                "operation": "CREATE",
                "object": pod,
            },
        }
    ).encode()


def _mig_pod_doc(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "annotations": annotations or {}},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": "none",
                    "resources": {"limits": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "8000"}},
                }
            ]
        },
    }


@pytest.fixture
def hostile_ns(scene: Scene) -> Iterator[str]:
    name = f"hostile-{scene.lease_ns.rsplit('-', 1)[-1]}"
    scene.client.create(Namespace(metadata=ObjectMeta(name=name)))
    try:
        yield name
    finally:
        for p in scene.client.list(Pod, namespace=name):
            with contextlib.suppress(lightkube.ApiError):
                assert p.metadata is not None
                scene.client.delete(Pod, p.metadata.name or "", namespace=name, grace_period=0)
        with contextlib.suppress(lightkube.ApiError):
            scene.client.delete(Namespace, name)


def test_hostile_inputs_never_stop_migpilot(
    scene: Scene, hostile_ns: str, tmp_path: pathlib.Path
) -> None:
    client = scene.client
    record = Record()
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "good").write_text(GOOD_CONFIG)
    scene.add_node(
        SHARING_NODE,
        "emulated:h100-80gb:x1:mig-off",
        "--strategy", "none",
        "--device-plugin-configs", str(configs), "--device-plugin-config-default", "good",
        "--mps-root", str(tmp_path / "mps"),
        labels={"migpilot.io/mode": "time-slicing"},
    )  # fmt: skip
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")

    # Served before: four MIG pods, whose instances must survive everything below.
    before = {f"before-{i}" for i in range(4)}
    for name in sorted(before):
        client.create(scene.pod(name, "1g.10gb"))
    scene.wait(lambda: scene.running(before), "the first MIG pods Running")
    held = scene.wait(lambda: len(u := _used_uuids(scene)) == len(before) and u, "4 used")

    # --- pods and a Node with quantities kube-apiserver accepts ---
    pods = {
        "memory-huge": {"memory": HUGE},
        "memory-1e200000": {"memory": "1e200000"},
        "mig-count-huge": {"nvidia.com/mig-1g.10gb": "1e5000"},
        "gpumem-huge": {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "1e300"},
        "unicode-digit": {"memory": "\u0663"},
    }
    created = {}
    for name, limits in pods.items():
        case = record.add("pod", name, f"a pod in another namespace asking {limits}")
        case.outcome = _create(client, _pod(name, hostile_ns, limits))
        created[name] = case
    bound = record.add(
        "pod", "bound-huge", f"a pod bound to ctl-a100 asking nvidia.com/foo: {HUGE}"
    )
    bound.outcome = _create(
        client, _pod("bound-huge", hostile_ns, {"nvidia.com/foo": HUGE}, nodeName="ctl-a100")
    )
    node_name = f"hostile-{scene.lease_ns.rsplit('-', 1)[-1]}"
    scene.plane.add_node(node_name)
    scene.nodes.append(node_name)
    node_case = record.add("node", "cpu-huge", f"a Node whose allocatable cpu is {HUGE}")
    client.patch(
        Node.Status,
        node_name,
        {"status": {"capacity": {"cpu": HUGE}, "allocatable": {"cpu": HUGE}}},
        patch_type=PatchType.MERGE,
    )
    node_case.outcome = "accepted by the API server"

    # --- AdmissionReviews straight to the webhook ---
    hook = Webhook(scene)
    stalled = [hook.stall() for _ in range(8)]
    try:
        for name, path, body in (
            ("deep-json", "/mutate-pods", b"[" * 100_000),
            ("deep-json-validate", "/validate-pods", b'{"request":' * 50_000),
            ("not-json", "/mutate-pods", b"\xff\xfe not json at all"),
            ("not-a-review", "/mutate-pods", b'{"kind": 7, "request": [1, 2]}'),
            ("no-object", "/mutate-pods", b'{"request": {"uid": "x"}}'),
        ):
            case = record.add("admission", name, f"{len(body)} bytes to {path}")
            status, answer = hook.post(path, body)
            case.outcome = f"HTTP {status}, {len(answer)} bytes"
            case.passed = status in (400, 413, 422) or (status == 200 and b'"allowed"' in answer)
        filters = ",".join(f"gpu-model-{i:06d}" for i in range(256 * 1024 // 17))
        case = record.add(
            "admission",
            "annotation-256KiB",
            f"a unified pod whose nvidia.com/use-gputype is {len(filters)} bytes",
        )
        status, answer = hook.post(
            "/validate-pods", _review(_mig_pod_doc({"nvidia.com/use-gputype": filters}))
        )
        case.outcome = f"HTTP {status}, {len(answer)} bytes"
        case.passed = status == 200 and len(answer) < 64 * 1024
        case = record.add(
            "admission", "stalled-connections", "8 connections that promise 1 MiB and stall"
        )
        status, answer = hook.post("/mutate-pods", _review(_mig_pod_doc()))
        case.outcome = f"a good review beside them: HTTP {status}"
        case.passed = status == 200 and b'"allowed"' in answer
    finally:
        for conn in stalled:
            with contextlib.suppress(OSError):
                conn.close()

    # --- GpuLayouts with bad specs ---
    def one(profile: str, start: int) -> dict[str, Any]:
        return {"profile": profile, "start": start}

    for name, spec in (
        ("unknown-profile", {"gpus": [{"index": 0, "instances": [one("9g.999gb", 0)]}]}),
        ("negative-index", {"gpus": [{"index": -1, "instances": []}]}),
        ("overlap", {"gpus": [{"index": 0, "instances": [one("4g.40gb", 0)] * 2}]}),
        ("huge-start", {"gpus": [{"index": 0, "instances": [one("1g.10gb", 10**30)]}]}),
    ):
        case = record.add("gpulayout", name, f"GpuLayout {node_name} spec {json.dumps(spec)[:120]}")
        doc = {
            "apiVersion": f"{gl.GROUP}/{gl.VERSION}",
            "kind": gl.KIND,
            "metadata": {"name": node_name},
            "spec": spec,
        }
        try:
            client.apply(codecs.from_dict(doc), field_manager="tenant", force=True)
            case.outcome = "accepted by the API server"
        except lightkube.ApiError as e:
            case.outcome = f"refused by the API server: {e.status.message}"
        # Either way the controller and agents go on; checked below with the other cases.
    with contextlib.suppress(lightkube.ApiError):
        client.delete(crds.GpuLayout, node_name)
    # The same on a live node whose instances pods hold: its agent keeps the last good spec,
    # says why in a condition, and destroys nothing in use; then the spec is put back.
    live = "ctl-a100"
    original = client.get(crds.GpuLayout, live).to_dict()["spec"]
    for name, spec in (
        ("live-unknown-profile", {"gpus": [{"index": 0, "instances": [one("9g.999gb", 0)]}]}),
        (
            "live-overlap",
            {"gpus": [{"index": 0, "instances": [one("4g.40gb", 0), one("2g.20gb", 2)]}]},
        ),
    ):
        case = record.add("gpulayout", name, f"GpuLayout {live} spec {json.dumps(spec)}")
        client.patch(
            crds.GpuLayout, live, {"spec": spec}, patch_type=PatchType.MERGE, field_manager="tenant"
        )
        said = scene.wait(lambda: _invalid_spec(scene, live), f"{live}'s agent refusing {name}")
        kept = held <= _all_uuids(scene)
        case.outcome = f"accepted by the API server; the agent kept its last good spec: {said}"
        case.passed = kept and scene.agents[live].process.poll() is None
        client.patch(
            crds.GpuLayout,
            live,
            {"spec": original},
            patch_type=PatchType.MERGE,
            field_manager="tenant",
        )
        scene.wait(lambda: not _invalid_spec(scene, live), f"{live}'s spec good again")

    # --- device-plugin configs with bombs, picked by the node label ---
    def state() -> str | None:
        labels = client.get(Node, SHARING_NODE).metadata.labels or {}  # type: ignore[union-attr]
        return labels.get(labelling.STATE_LABEL)

    scene.wait(lambda: state() == "success", "the good sharing config served")
    # The bombs arrive later, as an edit of the mounted ConfigMap would bring them (at start,
    # a bad config in the set is one line and exit 2: tests/unit/test_agent_sharing.py).
    for name, text in BOMBS.items():
        (configs / name).write_text(text)
    for name in BOMBS:
        case = record.add("config", name, f"device-plugin config {name!r} picked by the label")
        client.patch(
            Node, SHARING_NODE, {"metadata": {"labels": {"nvidia.com/device-plugin.config": name}}}
        )
        scene.wait(lambda: state() == "failed", f"config {name} refused")
        log_file = scene.root / f"agent-{SHARING_NODE}.log"
        if log_file.stat().st_size > LOG_LIMIT:  # an error that quotes a bomb whole
            case.outcome = f"the agent's log grew to {log_file.stat().st_size} bytes"
            break
        log = log_file.read_text(errors="replace")
        why = [line for line in log.splitlines() if f"configs/{name}" in line]
        case.outcome = "refused, the last good config kept (sharing.state=failed)" + (
            f"; the agent said: {why[-1].split(' ', 3)[-1][:300]}" if why else ""
        )
        client.patch(
            Node,
            SHARING_NODE,
            {"metadata": {"labels": {"nvidia.com/device-plugin.config": "good"}}},
        )
        scene.wait(lambda: state() == "success", "the good config again")
        case.passed = (
            scene.agents[SHARING_NODE].process.poll() is None
            and log_file.stat().st_size < LOG_LIMIT
        )

    # --- served after: MIG pods created after all of it ---
    after = {f"after-{i}" for i in range(4)}
    for name in sorted(after):
        client.create(scene.pod(name, "2g.20gb"))
    scene.wait(lambda: scene.running(before | after), "the MIG pods created after Running")

    # The bad pods and the bad Node are reported, once each, with a Warning Event.
    for name, case in created.items():
        if case.outcome != "created":
            case.passed = "refused by the API server" in case.outcome
            continue
        message = scene.wait(
            lambda n=name: _warned(client, namespace=hostile_ns, name=n), f"a Warning on {name}"
        )
        case.outcome += f"; migpilot warned: {message}"
        case.passed = True
    bound.passed = scene.agents["ctl-a100"].process.poll() is None
    bound.outcome += "; the node's agent kept serving"
    message = scene.wait(
        lambda: _warned(client, namespace=None, name=node_name), "a Warning on the Node"
    )
    node_case.outcome += f"; migpilot warned: {message}"
    node_case.passed = True
    for case in record.cases:
        if case.kind == "gpulayout" and not case.name.startswith("live-"):
            case.passed = all(p.process.poll() is None for p in scene.components())

    # Nothing in use destroyed, nobody stopped, nobody forgotten.
    assert held <= _all_uuids(scene), "an instance in use was destroyed"
    for component in scene.components():
        assert component.process.poll() is None, f"{component.name} exited\n{scene.logs()}"
    failed = [c for c in record.cases if not c.passed]
    if path := os.environ.get(RESULTS_ENV):
        record.write(pathlib.Path(path), mig_pods_served=len(before | after))
    assert not failed, [asdict(c) for c in failed]
