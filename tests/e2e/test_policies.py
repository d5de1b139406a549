"""The chart's ValidatingAdmissionPolicies (the same as ``deploy/policies/``) enforced by the real
API server: the chart's RBAC and policies applied, then requests made as the agent and the
controller, two ways.

- **Impersonation** (``Impersonate-User``, ``-Group`` and ``-Extra-authentication.kubernetes.io
  %2fnode-name``, as the admin): a table of raw requests, each refused with the policy's message
  or allowed.
- **Real tokens** (a TokenRequest bound to a pod on node A, as the kubelet asks for a pod's
  projected token, so the API server itself adds the node-name extra): migpilot's own clients
  (``agent.kube``, ``controller.kube``) send the writes they send in production, and a real
  ``migpilot agent`` process serves its node, and a real ``migpilot controller`` pins and ungates
  a MIG pod there, under the policies.

Each refusal is checked against the same request as the admin (or as the identity of the other
node), which succeeds: the policy refused, not the API server's own validation.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import pathlib
import shutil
import ssl
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx2
import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.models.core_v1 import Container, PodSchedulingGate, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import (
    ValidatingAdmissionPolicy,
    ValidatingAdmissionPolicyBinding,
)
from lightkube.resources.core_v1 import Namespace, Node, Pod
from lightkube.resources.resource_v1 import ResourceSlice

from migpilot.agent.cluster import kube as agent_kube
from migpilot.agent.cluster import resourceslices, startup
from migpilot.agent.dra import publishing
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import kube as controller_kube
from migpilot.controller import observing, pinning
from migpilot.kube import errors as kube_errors
from migpilot.mig import catalog
from tests.kube import crds, tools
from tests.kube.controlplane import ControlPlane, ControlPlaneError, wait_for

pytestmark = pytest.mark.kube

REPO = pathlib.Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "migpilot"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
# What the chart applies here: identities, their rights and the policies (no workloads).
KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
# The policies' messages (the chart's templates/policies.yaml).
OWN_NODE = "may change only the Node its service-account token is bound to"
NODE_LABELS = "may change only nvidia.com/ and migpilot.io/ labels of its Node"
NODE_ANNOTATIONS = "may change only nvidia.com/ and migpilot.io/ annotations of its Node"
NODE_RESOURCES = "may change only nvidia.com/ and migpilot.io/ resources in its Node's status"
NODE_SPEC = "may not change its Node's spec"
NODE_CONDITIONS = "may not change its Node's conditions"
OWN_LAYOUT = "may write only the GpuLayout of the Node its service-account token is bound to"
OWN_SLICES = "may write only the ResourceSlices of the Node its service-account token is bound to"
SLICE_DRIVER = "may write only ResourceSlices of its driver mig.migpilot.io"
LAYOUT_SPEC = "may write only a GpuLayout's status, never its spec"
POD_CONTAINERS = "may not change a pod's containers"
POD_METADATA = "may not change a pod's labels, annotations"
POD_GATES = "may only remove the migpilot.io/plan scheduling gate"
POD_AFFINITY = "may only narrow the required node affinity of a pod gated by migpilot.io/plan"
MERGE = "application/merge-patch+json"
REQUIRED = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"
JSON_PATCH = "application/json-patch+json"


@dataclass
class Installed:
    plane: ControlPlane
    release: str
    namespace: str
    node_a: str
    node_b: str
    root: pathlib.Path

    @property
    def agent_user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.release}-agent"

    @property
    def controller_user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.release}-controller"


def _render(release: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
    args = [str(tools.locate().helm), "template", release, str(CHART), "-n", namespace]
    for s in sets:
        args += ["--set", s]
    got = subprocess.run(args, capture_output=True, text=True, check=False)
    assert got.returncode == 0, got.stderr
    return [d for d in yaml.safe_load_all(got.stdout) if d]


def _admin_tls(plane: ControlPlane) -> tuple[str, ssl.SSLContext]:
    """The API server's address and a TLS context as the admin (client certificate)."""
    config = yaml.safe_load(plane.kubeconfig.read_text())
    cluster, user = config["clusters"][0]["cluster"], config["users"][0]["user"]
    context = ssl.create_default_context(cafile=cluster["certificate-authority"])
    context.load_cert_chain(user["client-certificate"], user["client-key"])
    return cluster["server"], context


@contextlib.contextmanager
def _impersonating(
    plane: ControlPlane, user: str | None, *, node: str | None = None
) -> Iterator[httpx2.Client]:
    """A raw HTTP client as the admin impersonating ``user`` (a service account, with its
    groups) bound to ``node``; ``None``: the admin itself."""
    server, context = _admin_tls(plane)
    headers: list[tuple[str, str]] = []
    if user is not None:
        namespace = user.split(":")[2]
        headers.append(("Impersonate-User", user))
        for group in (
            "system:serviceaccounts",
            f"system:serviceaccounts:{namespace}",
            "system:authenticated",
        ):
            headers.append(("Impersonate-Group", group))
        if node is not None:
            # The extra's key, percent-encoded in the header's name (its "/").
            headers.append(("Impersonate-Extra-authentication.kubernetes.io%2fnode-name", node))
    with httpx2.Client(base_url=server, verify=context, headers=headers, timeout=30) as client:
        yield client


def _token_kubeconfig(plane: ControlPlane, path: pathlib.Path, token: str) -> pathlib.Path:
    server, _ = _admin_tls(plane)
    config = yaml.safe_load(plane.kubeconfig.read_text())
    ca = config["clusters"][0]["cluster"]["certificate-authority"]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": server, "certificate-authority": ca}}
                ],
                "users": [{"name": "u", "user": {"token": token}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    path.chmod(0o600)
    return path


def _token(plane: ControlPlane, namespace: str, account: str, pod: Pod | None) -> str:
    """A service-account token from the TokenRequest API, bound to ``pod`` if given (as the
    kubelet asks for the projected token of a pod it runs)."""
    spec: dict[str, Any] = {"expirationSeconds": 3600}
    if pod is not None:
        assert pod.metadata is not None
        spec["boundObjectRef"] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "name": pod.metadata.name,
            "uid": pod.metadata.uid,
        }
    with _impersonating(plane, None) as admin:
        got = admin.post(
            f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
    assert got.status_code == 201, got.text
    token: str = got.json()["status"]["token"]
    return token


def _message(response: httpx2.Response) -> str:
    return str(response.json().get("message", response.text))


@pytest.fixture(scope="module")
def installed(control_plane: ControlPlane) -> Iterator[Installed]:
    """The chart's identities, RBAC and admission policies in a namespace of their own, two KWOK
    nodes and their GpuLayouts; removed afterwards."""
    client = control_plane.client
    crds.ensure_gpulayouts(control_plane)
    suffix = uuid.uuid4().hex[:6]
    release, namespace = f"pol{suffix}", f"policies-{suffix}"
    node_a, node_b = f"pol-a-{suffix}", f"pol-b-{suffix}"
    root = pathlib.Path(tempfile.mkdtemp(prefix="mpp"))
    applied: list[Any] = []
    try:
        client.create(Namespace(metadata=ObjectMeta(name=namespace)))
        for doc in _render(release, namespace):
            if doc["kind"] in KINDS:
                obj = codecs.from_dict(doc)
                client.apply(obj, field_manager="policies-test", force=True)
                applied.append(obj)
        for node in (node_a, node_b):
            control_plane.add_node(node, labels={"nvidia.com/gpu.present": "true"})
            spec = wire.spec_patch(node, gl.LayoutSpec(()))
            client.apply(
                codecs.from_dict(dict(spec)), field_manager=gl.CONTROLLER_FIELD_MANAGER, force=True
            )
        found = Installed(control_plane, release, namespace, node_a, node_b, root)

        # The API server enforces each new policy once its informers have it, each in its own
        # time: wait until every one of the three refuses its probe (the agent of node A on node
        # B's Node and on its GpuLayout, the controller changing a gated pod's image).
        probe_pod = _gated_pod(found, gates=(observing.GATE,))
        layout = f"/apis/{gl.GROUP}/{gl.VERSION}/{gl.PLURAL}/{node_b}/status"
        layout += f"?fieldManager={gl.AGENT_FIELD_MANAGER}&force=true"
        # A new image at every try: the controller-pods policy refuses a *change* to the
        # containers, so once a try made before the policy was enforced has set an image,
        # setting the same one again is no change, allowed for ever (the fixture then timed
        # out, more often on a loaded machine, where the policy comes later).
        tries = itertools.count(1)

        def enforced() -> bool:
            with _impersonating(control_plane, found.agent_user, node=node_a) as agent:
                node = agent.patch(
                    f"/api/v1/nodes/{node_b}",
                    json={"metadata": {"labels": {"nvidia.com/probe": "1"}}},
                    headers={"Content-Type": MERGE},
                )
                own_layout = agent.patch(
                    layout,
                    content=json.dumps(_layout_status(node_b)),
                    headers={"Content-Type": "application/apply-patch+yaml"},
                )
            with _impersonating(control_plane, found.controller_user) as controller:
                pod = controller.patch(
                    f"/api/v1/namespaces/{namespace}/pods/{probe_pod}",
                    content=json.dumps(
                        [
                            {
                                "op": "replace",
                                "path": "/spec/containers/0/image",
                                "value": f"probe:{next(tries)}",
                            }
                        ]
                    ),
                    headers={"Content-Type": JSON_PATCH},
                )
            answers = {"agent Node": node, "agent GpuLayout": own_layout, "controller Pod": pod}
            last.update((k, f"{v.status_code} {_message(v)[:300]}") for k, v in answers.items())
            return all(
                got.status_code == 403 and refused in _message(got)
                for got, refused in (
                    (node, OWN_NODE),
                    (own_layout, OWN_LAYOUT),
                    (pod, POD_CONTAINERS),
                )
            )

        last: dict[str, str] = {}
        try:
            wait_for(enforced, what="the admission policies to be enforced", timeout=60)
        except ControlPlaneError as e:  # say which probe was never refused, and how it was met
            raise ControlPlaneError(f"{e}; the probes' last answers: {last}") from e
        client.delete(Pod, probe_pod, namespace=namespace)
        yield found
    finally:
        for obj in reversed(applied):
            with contextlib.suppress(lightkube.ApiError):
                client.delete(type(obj), obj.metadata.name, namespace=obj.metadata.namespace)
        for node in (node_a, node_b):
            for res in (crds.GpuLayout, Node):
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(res, node)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)
        shutil.rmtree(root, ignore_errors=True)


def _type_checked(client: lightkube.Client, name: str) -> list[Any]:
    """The API server's type-checking warnings of the policy ``name``, once it has checked it."""

    def checked() -> ValidatingAdmissionPolicy | None:
        got = client.get(ValidatingAdmissionPolicy, name)
        assert got.metadata is not None
        done = got.status is not None and got.status.observedGeneration == got.metadata.generation
        return got if done and got.status is not None and got.status.typeChecking else None

    policy = wait_for(checked, what=f"{name} to be type-checked", timeout=60)
    assert policy.status is not None and policy.status.typeChecking is not None
    return list(policy.status.typeChecking.expressionWarnings or [])


def test_the_policies_type_check_against_the_servers_schemas(installed: Installed) -> None:
    """The API server type-checks every CEL expression against the Node, Pod and GpuLayout
    schemas it serves: a misspelt field is a warning in the policy's status (as it is for a
    copy of the Node policy with one field misspelt)."""
    client = installed.plane.client
    for name in ("agent-nodes", "agent-gpulayouts", "agent-resourceslices", "controller-pods"):
        warnings = _type_checked(client, f"{installed.release}-{name}")
        assert not warnings, [w.to_dict() for w in warnings]
        binding = client.get(ValidatingAdmissionPolicyBinding, f"{installed.release}-{name}")
        assert binding.spec is not None and binding.spec.validationActions == ["Deny"]
    typo = client.get(ValidatingAdmissionPolicy, f"{installed.release}-agent-nodes").to_dict()
    typo = {"apiVersion": typo["apiVersion"], "kind": typo["kind"], "spec": typo["spec"]}
    typo["metadata"] = {"name": f"{installed.release}-typo"}
    rule = typo["spec"]["validations"][4]
    assert rule["expression"].startswith("object.?spec == oldObject.?spec || (")
    rule["expression"] = "object.spec.unschedulabel == oldObject.spec.unschedulabel"
    client.create(codecs.from_dict(typo))
    try:
        (warning,) = _type_checked(client, f"{installed.release}-typo")
        assert "unschedulabel" in warning.warning
    finally:
        client.delete(ValidatingAdmissionPolicy, f"{installed.release}-typo")


# --- the agent, impersonated -------------------------------------------------------------------


def _node_requests(a: str, b: str) -> list[tuple[str, str, str, Any, str | None]]:
    """(what, path, content type, body, the policy's message or None: allowed) as the agent of
    node ``a``."""
    label = {"metadata": {"labels": {"nvidia.com/gpu.product": "NVIDIA-H100"}}}
    return [
        ("its own nvidia.com/ label", f"/api/v1/nodes/{a}", MERGE, label, None),
        (
            "its own migpilot.io/ label and annotation",
            f"/api/v1/nodes/{a}",
            MERGE,
            {
                "metadata": {
                    "labels": {"migpilot.io/mode": "mig"},
                    "annotations": {"migpilot.io/note": "x"},
                }
            },
            None,
        ),
        ("a label of node B", f"/api/v1/nodes/{b}", MERGE, label, OWN_NODE),
        (
            "a taint on its own node",
            f"/api/v1/nodes/{a}",
            MERGE,
            {"spec": {"taints": [{"key": "evil", "effect": "NoSchedule"}]}},
            NODE_SPEC,
        ),
        (
            "unschedulable on its own node",
            f"/api/v1/nodes/{a}",
            MERGE,
            {"spec": {"unschedulable": True}},
            NODE_SPEC,
        ),
        (
            "a control-plane label on its own node",
            f"/api/v1/nodes/{a}",
            MERGE,
            {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
            NODE_LABELS,
        ),
        (
            "removing its own hostname label",
            f"/api/v1/nodes/{a}",
            MERGE,
            {"metadata": {"labels": {"kubernetes.io/hostname": None}}},
            NODE_LABELS,
        ),
        (
            "another annotation on its own node",
            f"/api/v1/nodes/{a}",
            MERGE,
            {"metadata": {"annotations": {"example.com/owner": "evil"}}},
            NODE_ANNOTATIONS,
        ),
        (
            "an nvidia.com/ resource of its own node",
            f"/api/v1/nodes/{a}/status",
            MERGE,
            {
                "status": {
                    "capacity": {"nvidia.com/mig-1g.10gb": "3"},
                    "allocatable": {"nvidia.com/mig-1g.10gb": "3"},
                }
            },
            None,
        ),
        (
            "its own node's cpu",
            f"/api/v1/nodes/{a}/status",
            MERGE,
            {"status": {"capacity": {"cpu": "512"}, "allocatable": {"cpu": "512"}}},
            NODE_RESOURCES,
        ),
        (
            "an nvidia.com/ resource of node B",
            f"/api/v1/nodes/{b}/status",
            MERGE,
            {"status": {"allocatable": {"nvidia.com/mig-1g.10gb": "3"}}},
            OWN_NODE,
        ),
        (
            "its own node's addresses",
            f"/api/v1/nodes/{a}/status",
            MERGE,
            {"status": {"addresses": [{"type": "InternalIP", "address": "10.6.6.6"}]}},
            NODE_CONDITIONS,
        ),
        (
            "a label through its own node's status",
            f"/api/v1/nodes/{a}/status",
            MERGE,
            {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
            NODE_LABELS,
        ),
    ]


def _layout_status(node: str) -> dict[str, Any]:
    status = gl.LayoutStatus(observed_generation=1, gpus=())
    return dict(wire.status_patch(node, status))


def _layout_requests(a: str, b: str) -> list[tuple[str, str, str, Any, str | None]]:
    base = f"/apis/{gl.GROUP}/{gl.VERSION}/{gl.PLURAL}"
    apply = "application/apply-patch+yaml"
    query = f"?fieldManager={gl.AGENT_FIELD_MANAGER}&force=true"
    own, other = f"{base}/{a}/status{query}", f"{base}/{b}/status{query}"
    return [
        ("its own GpuLayout's status", own, apply, _layout_status(a), None),
        ("node B's GpuLayout status", other, apply, _layout_status(b), OWN_LAYOUT),
    ]


@pytest.mark.parametrize("case", range(len(_node_requests("a", "b")) + 2))
def test_the_agent_of_node_a_changes_only_what_is_its_own(installed: Installed, case: int) -> None:
    a, b = installed.node_a, installed.node_b
    requests = _node_requests(a, b) + _layout_requests(a, b)
    what, path, content_type, body, refused = requests[case]
    headers = {"Content-Type": content_type}
    with _impersonating(installed.plane, installed.agent_user, node=a) as agent:
        got = agent.patch(path, content=json.dumps(body), headers=headers)
    if refused is None:
        assert got.status_code == 200, (what, got.text)
        return
    assert got.status_code == 403, (what, got.text)
    message = _message(got)
    assert refused in message and "ValidatingAdmissionPolicy" in message, (what, message)
    # The API server itself allows that change: to node B's own agent when the refusal was for
    # touching node B, otherwise to the admin (on node B, so that node A stays as it was).
    if refused in (OWN_NODE, OWN_LAYOUT):
        user, node = installed.agent_user, b
    else:
        user, node = None, None
    with _impersonating(installed.plane, user, node=node) as other:
        allowed = other.patch(path.replace(a, b), content=json.dumps(body), headers=headers)
    assert allowed.status_code == 200, (what, allowed.text)


def test_an_agent_without_a_node_bound_token_changes_no_node(installed: Installed) -> None:
    """A token not bound to a pod on a node (a long-lived Secret token, say) carries no node
    name: the agent's account may change no Node and no GpuLayout with it."""
    a = installed.node_a
    with _impersonating(installed.plane, installed.agent_user) as agent:
        got = agent.patch(
            f"/api/v1/nodes/{a}",
            json={"metadata": {"labels": {"nvidia.com/gpu.product": "X"}}},
            headers={"Content-Type": MERGE},
        )
    assert got.status_code == 403 and OWN_NODE in _message(got), got.text


STARTUP = {"key": startup.TAINT_KEY, "effect": startup.TAINT_EFFECT}
OTHER = {"key": "example.com/other", "value": "x", "effect": "NoSchedule"}


def _taint(plane: ControlPlane, node: str, taints: list[dict[str, str]]) -> None:
    """Set the Node's taints as the admin (Karpenter registering a node, say)."""
    with _impersonating(plane, None) as admin:
        got = admin.patch(
            f"/api/v1/nodes/{node}",
            json={"spec": {"taints": taints}},
            headers={"Content-Type": MERGE},
        )
    assert got.status_code == 200, got.text


def _taints(plane: ControlPlane, node: str) -> list[dict[str, Any]]:
    """The Node's taints but those Kubernetes' node controllers keep (an earlier test leaves
    node B cordoned: ``node.kubernetes.io/unschedulable``)."""
    spec = plane.client.get(Node, node).spec
    taints = spec.taints if spec and spec.taints else []
    return [t.to_dict() for t in taints if not t.key.startswith("node.kubernetes.io/")]


TAINT_CASES = [
    # what the agent sends, on node B?, the taints it sends, cordoning too?, the refusal
    ("the startup taint, the other kept", False, [OTHER], False, None),
    ("another taint, the startup taint kept", False, [STARTUP], False, NODE_SPEC),
    ("both taints", False, [], False, NODE_SPEC),
    ("the startup taint, adding another", False, [OTHER, {**OTHER, "key": "evil"}], False,
     NODE_SPEC),
    ("the startup taint and cordoning", False, [OTHER], True, NODE_SPEC),
    ("the startup taint of node B", True, [OTHER], False, OWN_NODE),
]  # fmt: skip


@pytest.mark.parametrize("case", TAINT_CASES, ids=[c[0] for c in TAINT_CASES])
def test_the_agent_may_remove_only_the_startup_taint_of_its_own_node(
    installed: Installed, case: tuple[str, bool, list[dict[str, str]], bool, str | None]
) -> None:
    """The one spec change the agent may make (docs/autoscaling.md): remove
    ``migpilot.io/agent-not-ready:NoSchedule`` from its own Node, leaving every other taint and
    field; as its client sends it (a merge patch of the whole list, with the version read)."""
    what, on_b, after, unschedulable, refused = case
    plane, a, b = installed.plane, installed.node_a, installed.node_b
    target = b if on_b else a
    _taint(plane, target, [STARTUP, OTHER])
    try:
        for _ in range(10):  # KWOK's heartbeat may change the Node between read and patch (409)
            meta = plane.client.get(Node, target).metadata
            assert meta is not None
            body: dict[str, Any] = {
                "metadata": {"resourceVersion": meta.resourceVersion},
                "spec": {"taints": after},
            }
            if unschedulable:
                body["spec"]["unschedulable"] = True
            with _impersonating(plane, installed.agent_user, node=a) as agent:
                got = agent.patch(
                    f"/api/v1/nodes/{target}", json=body, headers={"Content-Type": MERGE}
                )
            if got.status_code != 409:
                break
        if refused is None:
            assert got.status_code == 200, (what, got.text)
            assert _taints(plane, target) == [OTHER]
            return
        assert got.status_code == 403, (what, got.text)
        assert refused in _message(got) and "ValidatingAdmissionPolicy" in _message(got), what
        assert _taints(plane, target) == [STARTUP, OTHER]
    finally:
        _taint(plane, target, [])


# --- the controller, impersonated --------------------------------------------------------------


def _gated_pod(installed: Installed, *, gates: tuple[str, ...], affinity: Any = None) -> str:
    name = f"gated-{uuid.uuid4().hex[:6]}"
    spec = PodSpec(
        containers=[Container(name="main", image="registry.k8s.io/pause:3.10")],
        schedulingGates=[PodSchedulingGate(name=g) for g in gates],
    )
    pod = Pod(metadata=ObjectMeta(name=name, namespace=installed.namespace), spec=spec)
    doc = pod.to_dict()
    if affinity is not None:
        doc["spec"]["affinity"] = affinity
    installed.plane.client.create(codecs.from_dict(doc))
    return name


def _pod_doc(installed: Installed, name: str) -> dict[str, Any]:
    doc: dict[str, Any] = installed.plane.client.get(
        Pod, name, namespace=installed.namespace
    ).to_dict()
    return doc


def _node_view(installed: Installed, name: str) -> observing.NodeView:
    return observing.node_view(installed.plane.client.get(Node, name).to_dict())


ZONE = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["z1", "z2"]}
WITH_TERMS = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [ZONE]}, {"matchExpressions": [ZONE]}]
        }
    }
}


@pytest.mark.parametrize("affinity", [None, WITH_TERMS], ids=["no-affinity", "two-terms"])
def test_the_controller_may_pin_and_ungate_as_pinning_does(
    installed: Installed, affinity: Any
) -> None:
    name = _gated_pod(installed, gates=(observing.GATE,), affinity=affinity)
    patch = pinning.pin_patch(_pod_doc(installed, name), _node_view(installed, installed.node_a))
    assert patch and any(op["op"] == "remove" for op in patch)
    with _impersonating(installed.plane, installed.controller_user) as controller:
        got = controller.patch(
            f"/api/v1/namespaces/{installed.namespace}/pods/{name}",
            content=json.dumps(patch),
            headers={"Content-Type": JSON_PATCH},
        )
    assert got.status_code == 200, got.text
    spec = got.json()["spec"]
    assert "schedulingGates" not in spec
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    for term in terms["nodeSelectorTerms"]:
        assert {"key": "metadata.name", "operator": "In", "values": [installed.node_a]} in term[
            "matchFields"
        ]


def _hostname_term(node: str) -> dict[str, Any]:
    return {"key": "kubernetes.io/hostname", "operator": "In", "values": [node]}


CONTROLLER_REFUSED: list[tuple[str, tuple[str, ...], Any, list[dict[str, Any]], str]] = [
    (
        "an image change",
        (observing.GATE,),
        None,
        [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil:latest"}],
        POD_CONTAINERS,
    ),
    (
        "an added label",
        (observing.GATE,),
        None,
        [{"op": "add", "path": "/metadata/labels", "value": {"app": "x"}}],
        POD_METADATA,
    ),
    (
        "removing another controller's gate",
        ("example.com/quota", observing.GATE),
        None,
        [{"op": "remove", "path": "/spec/schedulingGates/0"}],
        POD_GATES,
    ),
    (
        "a toleration",
        (observing.GATE,),
        None,
        [
            {
                "op": "add",
                "path": "/spec/tolerations",
                "value": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}],
            }
        ],
        POD_CONTAINERS,
    ),
    (
        "narrowing by a label expression instead of the node's name",
        (observing.GATE,),
        WITH_TERMS,
        [
            {
                "op": "add",
                "path": f"{REQUIRED}/nodeSelectorTerms/0/matchExpressions/-",
                "value": _hostname_term("pol-a"),
            },
            {
                "op": "add",
                "path": f"{REQUIRED}/nodeSelectorTerms/1/matchExpressions/-",
                "value": _hostname_term("pol-a"),
            },
        ],
        POD_AFFINITY,
    ),
    (
        "pinning a pod migpilot does not gate",
        ("example.com/quota",),
        None,
        [
            {
                "op": "add",
                "path": "/spec/affinity",
                "value": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchFields": [
                                        {
                                            "key": "metadata.name",
                                            "operator": "In",
                                            "values": ["pol-a"],
                                        }
                                    ]
                                }
                            ]
                        }
                    }
                },
            }
        ],
        POD_AFFINITY,
    ),
]


@pytest.mark.parametrize("case", CONTROLLER_REFUSED, ids=[c[0] for c in CONTROLLER_REFUSED])
def test_the_controller_is_refused_any_other_change_to_a_pod(
    installed: Installed, case: tuple[str, tuple[str, ...], Any, list[dict[str, Any]], str]
) -> None:
    what, gates, affinity, patch, refused = case
    name = _gated_pod(installed, gates=gates, affinity=affinity)
    path = f"/api/v1/namespaces/{installed.namespace}/pods/{name}"
    body, headers = json.dumps(patch), {"Content-Type": JSON_PATCH}
    with _impersonating(installed.plane, installed.controller_user) as controller:
        got = controller.patch(path, content=body, headers=headers)
    assert got.status_code == 403, (what, got.text)
    assert refused in _message(got), (what, _message(got))
    # The API server itself allows that change (to the admin): the policy refused it.
    with _impersonating(installed.plane, None) as admin:
        allowed = admin.patch(path, content=body, headers=headers)
    assert allowed.status_code == 200, (what, allowed.text)


# --- real tokens, migpilot's own clients -------------------------------------------------------


def _agent_pod(installed: Installed, node: str) -> Pod:
    """A pod of the agent's service account bound to ``node`` (as the DaemonSet's would be)."""
    pod = Pod(
        metadata=ObjectMeta(name=f"agent-{uuid.uuid4().hex[:6]}", namespace=installed.namespace),
        spec=PodSpec(
            containers=[Container(name="agent", image="registry.k8s.io/pause:3.10")],
            serviceAccountName=f"{installed.release}-agent",
            nodeName=node,
        ),
    )
    return installed.plane.client.create(pod)


def _agent_kubeconfig(installed: Installed, node: str) -> pathlib.Path:
    token = _token(
        installed.plane,
        installed.namespace,
        f"{installed.release}-agent",
        _agent_pod(installed, node),
    )
    return _token_kubeconfig(installed.plane, installed.root / f"agent-{node}.kubeconfig", token)


def test_a_pod_bound_token_carries_its_node(installed: Installed) -> None:
    """What the policies rest on: a token the kubelet would get for the agent's pod (bound to
    the pod) is authenticated with the pod's node as ``authentication.kubernetes.io/node-name``."""
    token = _token(
        installed.plane,
        installed.namespace,
        f"{installed.release}-agent",
        _agent_pod(installed, installed.node_a),
    )
    server, _ = _admin_tls(installed.plane)
    ca = yaml.safe_load(installed.plane.kubeconfig.read_text())["clusters"][0]["cluster"]
    context = ssl.create_default_context(cafile=ca["certificate-authority"])
    with httpx2.Client(
        base_url=server, verify=context, headers={"Authorization": f"Bearer {token}"}
    ) as client:
        got = client.post(
            "/apis/authentication.k8s.io/v1/selfsubjectreviews",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"},
        )
    assert got.status_code == 201, got.text
    user = got.json()["status"]["userInfo"]
    assert user["username"] == installed.agent_user
    assert user["extra"][NODE_NAME_EXTRA] == [installed.node_a]


def test_the_agents_own_client_writes_its_node_and_layout_only(installed: Installed) -> None:
    a, b = installed.node_a, installed.node_b
    api = agent_kube.connect(_agent_kubeconfig(installed, a))
    try:
        api.patch_node_labels(a, {"nvidia.com/mig.capable": "true", "migpilot.io/probe": "1"})
        api.patch_node_resources(a, {"nvidia.com/mig-1g.10gb": "2"})
        api.apply_layout_status(a, gl.LayoutStatus(observed_generation=1, gpus=()))
        node = installed.plane.client.get(Node, a)
        assert node.metadata is not None and node.metadata.labels is not None
        assert node.metadata.labels["nvidia.com/mig.capable"] == "true"
        assert node.status is not None and node.status.allocatable is not None
        assert node.status.allocatable["nvidia.com/mig-1g.10gb"] == "2"
        cases = [
            (lambda: api.patch_node_labels(b, {"nvidia.com/mig.capable": "true"}), OWN_NODE),
            (lambda: api.patch_node_resources(b, {"nvidia.com/mig-1g.10gb": "2"}), OWN_NODE),
            (lambda: api.patch_node_labels(a, {"kubernetes.io/os": "evil"}), NODE_LABELS),
            (lambda: api.patch_node_resources(a, {"pods": "1000"}), NODE_RESOURCES),
            (
                lambda: api.apply_layout_status(b, gl.LayoutStatus(observed_generation=1, gpus=())),
                OWN_LAYOUT,
            ),
        ]
        for call, refused in cases:
            with pytest.raises(kube_errors.KubeApiError) as err:
                call()
            assert str(err.value).startswith("403") and refused in str(err.value)
    finally:
        api.close()


def _slice(name: str, *, node: str, pool: str, driver: str = "mig.migpilot.io") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {"name": pool, "generation": 0, "resourceSliceCount": 1},
            "devices": [{"name": "gpu-0"}],
        },
    }


def test_the_agents_own_client_writes_only_its_nodes_resourceslices(installed: Installed) -> None:
    """DRA mode: the agent's publisher, with a token bound to a pod on node A, publishes node
    A's pool (RBAC and the policy allow it); creating, changing or deleting a slice of node B,
    of node B's pool or of another driver is refused by the policy (node B's agent may delete
    its own: the policy refused, not the API server)."""
    a, b = installed.node_a, installed.node_b
    client = installed.plane.client
    api = agent_kube.connect(_agent_kubeconfig(installed, a))
    slices = api.slices()
    try:
        # The policy is enforced once the API server's informer has it: until node B's slice
        # is refused to node A's agent (one let through meanwhile is deleted again).
        def refused() -> bool:
            try:
                slices.create_slice(_slice(f"{b}-probe", node=b, pool=b))
            except kube_errors.KubeApiError as err:
                return str(err).startswith("403") and OWN_SLICES in str(err)
            client.delete(ResourceSlice, f"{b}-probe")
            return False

        wait_for(refused, what="the ResourceSlice policy to be enforced", timeout=60)
        gpu = publishing.Gpu(0, "GPU-policies", catalog.resolve_gpu("a100-80gb"), True, 81920)
        publisher = resourceslices.SlicePublisher(slices, node=a)
        assert publisher.publish((gpu,), ()) is not None and publisher.published
        used = publishing.Instance(0, "1g.10gb", 0, "MIG-x", publishing.Use.OTHER)
        assert publisher.publish((gpu,), (used,)) is not None  # an update
        assert publisher.publish((publishing.Gpu(0, "GPU-p", gpu.model, False, 81920),), ())
        theirs = _slice(f"{b}-theirs", node=b, pool=b)
        client.create(codecs.from_dict(theirs))
        mine = _slice(f"{a}-mine", node=a, pool=a)
        slices.create_slice(mine)
        changed = client.get(ResourceSlice, f"{b}-theirs").to_dict()
        changed["spec"]["devices"] = [{"name": "gpu-1"}]
        cases = [
            (lambda: slices.create_slice(_slice(f"{a}-x", node=b, pool=b)), OWN_SLICES),
            (lambda: slices.create_slice(_slice(f"{a}-y", node=a, pool=b)), OWN_SLICES),
            (
                lambda: slices.create_slice(
                    _slice(f"{a}-z", node=a, pool=a, driver="x.example.com")
                ),
                SLICE_DRIVER,
            ),
            (lambda: slices.delete_slice(f"{b}-theirs"), OWN_SLICES),
            (lambda: slices.replace_slice(changed), OWN_SLICES),
        ]
        for call, why in cases:
            with pytest.raises(kube_errors.KubeApiError) as err:
                call()
            assert str(err.value).startswith("403") and why in str(err.value), str(err.value)
        # Node B's agent may delete its own slice: the refusal above was the policy's.
        other = agent_kube.connect(_agent_kubeconfig(installed, b))
        try:
            assert other.slices().delete_slice(f"{b}-theirs")
        finally:
            other.close()
        assert slices.delete_slice(f"{a}-mine")
    finally:
        api.close()
        for found in client.list(ResourceSlice, fields={"spec.driver": "mig.migpilot.io"}):
            assert found.metadata is not None and found.spec is not None
            if found.spec.nodeName in (a, b):
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(ResourceSlice, found.metadata.name)


def test_the_controllers_own_client_pins_a_pod_and_nothing_more(installed: Installed) -> None:
    token = _token(installed.plane, installed.namespace, f"{installed.release}-controller", None)
    kubeconfig = _token_kubeconfig(installed.plane, installed.root / "controller.kubeconfig", token)
    pinned = _gated_pod(installed, gates=(observing.GATE,))
    kept = _gated_pod(installed, gates=(observing.GATE,))
    key = f"{installed.namespace}/{pinned}"
    pin = pinning.pin_patch(_pod_doc(installed, pinned), _node_view(installed, installed.node_a))
    image = [{"op": "replace", "path": "/spec/containers/0/image", "value": "evil:latest"}]

    async def run() -> tuple[dict[str, Any], str]:
        api = controller_kube.connect(kubeconfig)
        try:
            got = dict(await api.patch_pod(key, pin))
            try:
                await api.patch_pod(f"{installed.namespace}/{kept}", image)
            except kube_errors.KubeApiError as err:
                return got, str(err)
            return got, ""
        finally:
            await api.close()

    got, refusal = asyncio.run(run())
    assert "schedulingGates" not in got["spec"]
    assert refusal.startswith("403") and POD_CONTAINERS in refusal, refusal
    assert _pod_doc(installed, kept)["spec"]["containers"][0]["image"] == (
        "registry.k8s.io/pause:3.10"
    )


def _launch(log: pathlib.Path, *args: str) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "migpilot", *args], stdout=out, stderr=out)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _denials(log: str) -> list[str]:
    """The log's lines saying the API refused a request (403) for a reason of the policies:
    not an Event refused because another test's namespace is being deleted (the controller
    watches every namespace of the shared control plane, and says why it waits to pods an
    earlier test left behind)."""
    return [
        line
        for line in log.splitlines()
        # "403 Forbidden", as the clients say it: a bare "403" is in a node name with a random
        # suffix (pol-a-5e4034) or a log line's milliseconds (04:09:55,403) now and then.
        if "403 Forbidden" in line and "because it is being terminated" not in line
    ]


def test_a_real_agent_and_controller_serve_a_pod_under_the_policies(installed: Installed) -> None:
    """``migpilot agent`` with the token the kubelet would mount (bound to its pod on node A):
    it lays out its GPUs, reports its GpuLayout's status, labels its Node, publishes the
    counts and removes the startup taint (only that one), all through the policies. Then
    ``migpilot controller`` with its own account's token plans a gated MIG pod there and pins
    and ungates it, through the policies too."""
    a = installed.node_a
    kubeconfig = _agent_kubeconfig(installed, a)
    spec = gl.LayoutSpec((gl.GpuSpec(0, "h100-80gb", (gl.InstanceSpec("1g.10gb", 0),)),))
    installed.plane.client.apply(
        codecs.from_dict(dict(wire.spec_patch(a, spec))),
        field_manager=gl.CONTROLLER_FIELD_MANAGER,
        force=True,
    )
    generation = installed.plane.client.get(crds.GpuLayout, a).metadata.generation
    # A node as a NodePool registers it: the startup taint the agent removes, and another that
    # it must leave (PreferNoSchedule: the pod below may still go there).
    other = {"key": "example.com/other", "effect": "PreferNoSchedule"}
    _taint(installed.plane, a, [STARTUP, other])
    log = installed.root / "agent.log"
    process = _launch(
        log,
        "agent", "--node", a, "--kubeconfig", str(kubeconfig),
        "--state-file", str(installed.root / "gpus.json"),
        "--backend", "emulated:h100-80gb:x1", "--kubelet", "simulated", "--interval", "5",
    )  # fmt: skip
    try:

        def served() -> bool:
            assert process.poll() is None, log.read_text()[-4000:]
            layout = wire.parse(installed.plane.client.get(crds.GpuLayout, a).to_dict())
            node = installed.plane.client.get(Node, a)
            labels = (node.metadata.labels if node.metadata else None) or {}
            allocatable = (node.status.allocatable if node.status else None) or {}
            return (
                layout.status is not None
                and layout.status.observed_generation == generation
                and any(i.uuid for g in layout.status.gpus for i in g.instances)
                and labels.get("nvidia.com/mig-1g.10gb.count") == "1"
                and allocatable.get("nvidia.com/mig-1g.10gb") == "1"
                and _taints(installed.plane, a) == [other]
            )

        deadline = time.monotonic() + 90
        while not served():
            assert time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        assert _denials(log.read_text()) == []

        token = _token(
            installed.plane, installed.namespace, f"{installed.release}-controller", None
        )
        controller_log = installed.root / "controller.log"
        config = _token_kubeconfig(installed.plane, installed.root / "c.kubeconfig", token)
        controller = _launch(
            controller_log,
            "controller", "--verbose", "--kubeconfig", str(config),
            "--identity", "policies", "--lease-namespace", installed.namespace,
            "--metrics-port", "0",
        )  # fmt: skip
        try:
            name = f"mig-{uuid.uuid4().hex[:6]}"
            doc = Pod(
                metadata=ObjectMeta(name=name, namespace=installed.namespace),
                spec=PodSpec(
                    containers=[
                        Container(
                            name="main",
                            image="registry.k8s.io/pause:3.10",
                            resources=ResourceRequirements(
                                limits={"nvidia.com/mig-1g.10gb": "1"},
                                requests={"nvidia.com/mig-1g.10gb": "1"},
                            ),
                        )
                    ],
                    schedulingGates=[PodSchedulingGate(name=observing.GATE)],
                ),
            )
            installed.plane.client.create(doc)

            def bound() -> bool:
                assert controller.poll() is None, controller_log.read_text()[-4000:]
                got = _pod_doc(installed, name)
                return got["spec"].get("nodeName") == a

            deadline = time.monotonic() + 90
            while not bound():
                assert time.monotonic() < deadline, controller_log.read_text()[-4000:]
                time.sleep(0.2)
            spec = _pod_doc(installed, name)["spec"]
            assert "schedulingGates" not in spec
            terms = spec["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"
            ]
            (term,) = terms["nodeSelectorTerms"]
            assert term["matchFields"] == [
                {"key": "metadata.name", "operator": "In", "values": [a]}
            ]
            assert _denials(controller_log.read_text()) == []
        finally:
            _stop(controller)
    finally:
        _stop(process)
        _taint(installed.plane, a, [])
