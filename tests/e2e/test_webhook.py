"""The webhook on the real kube-apiserver (v1.37): `migpilot webhook` as a process on loopback,
registered with the rendered Mutating- and ValidatingWebhookConfigurations (their CEL
matchConditions accepted), gates a new MIG pod while the controller's Lease is fresh, leaves
other pods alone, gates nothing once the Lease is stale, and when it is stopped pods are still
created (failurePolicy Ignore). A unified pod (``nvidia.com/gpumem``...) is gated alike; a
malformed one is refused at creation with a message naming the field; one another system serves
(``nvidia.com/vgpu-mode: hami-core``) is created untouched. A pod whose ResourceClaimTemplate, or
ResourceClaim, asks for ``mig.migpilot.io`` devices is gated (the webhook reads them at
admission); one whose claims are another driver's, or whose template is not there yet, is not.

The control plane is shared by the session: the webhook configuration, the namespace and the
pods this test makes are deleted at the end. Every wait has a generous timeout; no duration
decides a pass (the one sleep outlasts the webhook's 2 s Lease cache).
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import ssl
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightkube
import pytest
from lightkube import codecs
from lightkube.models.coordination_v1 import LeaseSpec
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import (
    MutatingWebhookConfiguration,
    ValidatingWebhookConfiguration,
)
from lightkube.resources.coordination_v1 import Lease
from lightkube.resources.core_v1 import Namespace, Pod
from lightkube.resources.resource_v1 import ResourceClaim, ResourceClaimTemplate
from lightkube.types import PatchType

from migpilot.webhook import registering, serving
from tests.kube import certs, controlplane
from tests.kube.controlplane import ControlPlane, wait_for

pytestmark = pytest.mark.kube

GATE = "migpilot.io/plan"
POD_NS = "default"
LEASE_CACHE_S = serving.LeaseSettings().cache_s
REPO = Path(__file__).parents[2]


def _micro_time(seconds_ago: float) -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=seconds_ago)


class Scene:
    def __init__(self, plane: ControlPlane, lease_ns: str, suffix: str) -> None:
        self.plane = plane
        self.client = plane.client
        self.lease_ns = lease_ns
        self.suffix = suffix
        self.pods: list[str] = []

    def pod(
        self,
        name: str,
        *,
        mig: str | None = None,
        unified: dict[str, str] | None = None,
        annotations: dict[str, str] | None = None,
    ) -> Pod:
        full = f"wh-{name}-{self.suffix}"
        limits = {mig: "1"} if mig else unified
        pod = Pod(
            metadata=ObjectMeta(name=full, namespace=POD_NS, annotations=annotations),
            spec=PodSpec(
                containers=[
                    Container(
                        name="main",
                        image="registry.example/never-pulled:1",
                        resources=ResourceRequirements(limits=limits, requests={"cpu": "10m"}),
                    )
                ]
            ),
        )
        self.pods.append(full)
        return self.client.create(pod)

    def renew(self, *, seconds_ago: float) -> None:
        renewed = _micro_time(seconds_ago).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        self.client.patch(
            Lease,
            serving.LeaseSettings().name,
            {"spec": {"renewTime": renewed}},
            namespace=self.lease_ns,
            patch_type=PatchType.MERGE,
        )


def _gates(pod: Pod) -> list[str]:
    return [g.name for g in (pod.spec.schedulingGates if pod.spec else None) or []]


def _scheduling_gated(client: lightkube.Client, name: str) -> bool:
    pod = client.get(Pod, name, namespace=POD_NS)
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(
        c.type == "PodScheduled" and c.status == "False" and c.reason == "SchedulingGated"
        for c in conditions
    )


def _healthy(port: int, ca: Path) -> bool:
    conn = http.client.HTTPSConnection(
        "127.0.0.1", port, context=ssl.create_default_context(cafile=ca), timeout=2
    )
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().read() == b"ok"
    finally:
        conn.close()


@pytest.fixture
def scene(
    control_plane: ControlPlane, tmp_path: Path
) -> Iterator[tuple[Scene, controlplane.Component]]:
    client = control_plane.client
    suffix = uuid.uuid4().hex[:6]
    lease_ns = f"migpilot-wh-{suffix}"
    config_name = f"migpilot-webhook-e2e-{suffix}"
    ca = certs.CertificateAuthority(tmp_path)
    pair = ca.issue("webhook", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
    [port] = controlplane.free_ports(1)
    webhook = controlplane.launch(
        "migpilot-webhook",
        [
            sys.executable,
            "-m",
            "migpilot",
            "webhook",
            "--verbose",
            "--cert",
            str(pair.cert),
            "--key",
            str(pair.key),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--kubeconfig",
            str(control_plane.kubeconfig),
            "--lease-namespace",
            lease_ns,
        ],
        log=tmp_path / "webhook.log",
        cwd=REPO,
    )
    scene = Scene(control_plane, lease_ns, suffix)
    try:
        wait_for(lambda: _healthy(port, ca.pair.cert), what="the webhook to serve", watch=[webhook])
        client.create(Namespace(metadata=ObjectMeta(name=lease_ns)))
        client.create(
            Lease(
                metadata=ObjectMeta(name=serving.LeaseSettings().name, namespace=lease_ns),
                spec=LeaseSpec(
                    holderIdentity="e2e", renewTime=_micro_time(0), leaseDurationSeconds=60
                ),
            )
        )
        for document in (
            registering.configuration(
                ca_bundle=ca.pair.cert.read_bytes(),
                url=f"https://127.0.0.1:{port}/mutate-pods",
                name=config_name,
            ),
            registering.validating_configuration(
                ca_bundle=ca.pair.cert.read_bytes(),
                url=f"https://127.0.0.1:{port}/validate-pods",
                name=config_name,
            ),
        ):
            client.create(codecs.from_dict(document))  # the CEL matchConditions compile on 1.37
        yield scene, webhook
    finally:
        controlplane.stop_components([webhook])
        for kind in (MutatingWebhookConfiguration, ValidatingWebhookConfiguration):
            with contextlib.suppress(lightkube.ApiError):
                client.delete(kind, config_name)
        for name in scene.pods:
            with contextlib.suppress(lightkube.ApiError):
                client.delete(Pod, name, namespace=POD_NS, grace_period=0)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, lease_ns)


def test_webhook_gates_mig_pods_only_while_the_lease_is_fresh_and_fails_open(
    scene: tuple[Scene, controlplane.Component],
) -> None:
    s, webhook = scene
    client = s.client

    # The apiserver starts calling a new webhook configuration within a moment.
    attempt = iter(range(1000))

    def a_mig_pod_is_gated() -> str | None:
        pod = s.pod(f"mig{next(attempt)}", mig="nvidia.com/mig-1g.10gb")
        return pod.metadata.name if pod.metadata and GATE in _gates(pod) else None

    gated = wait_for(a_mig_pod_is_gated, what="a MIG pod to be gated", watch=[webhook])
    pod = client.get(Pod, gated, namespace=POD_NS)
    assert _gates(pod) == [GATE]
    assert pod.metadata and pod.metadata.labels == {"migpilot.io/gated": "true"}
    wait_for(lambda: _scheduling_gated(client, gated), what="PodScheduled=False/SchedulingGated")

    assert _gates(s.pod("plain", mig=None)) == []
    assert _gates(s.pod("me", mig="nvidia.com/mig-1g.10gb.me")) == [GATE]
    # A name no device plugin advertises: admitted (with a warning), not gated. (`+me` never
    # gets this far on a real apiserver: `+` is not allowed in a resource name.)
    assert _gates(s.pod("badname", mig="nvidia.com/mig-1G.10gb")) == []

    s.renew(seconds_ago=3600)
    time.sleep(LEASE_CACHE_S + 0.5)  # outlast the webhook's cache of the Lease
    assert _gates(s.pod("stale", mig="nvidia.com/mig-1g.10gb")) == []

    s.renew(seconds_ago=0)
    controlplane.stop_components([webhook])
    assert webhook.process.returncode == 0
    created = s.pod("nowebhook", mig="nvidia.com/mig-1g.10gb")  # failurePolicy Ignore
    assert _gates(created) == []
    assert "review" in webhook.tail(200)  # it logged the reviews it answered


GPU, GPUMEM, GPUCORES = "nvidia.com/gpu", "nvidia.com/gpumem", "nvidia.com/gpucores"


def _refusal(s: Scene, name: str, **kwargs: Any) -> lightkube.ApiError:
    """Create the pod, expecting the apiserver to refuse it; the error."""
    with pytest.raises(lightkube.ApiError) as refused:
        s.pod(name, **kwargs)
    return refused.value


def test_unified_pods_are_gated_and_malformed_ones_refused_naming_the_field(
    scene: tuple[Scene, controlplane.Component],
) -> None:
    s, webhook = scene
    client = s.client

    # A new configuration takes effect within a moment: wait until a malformed pod is refused.
    attempt = iter(range(1000))

    def refused() -> lightkube.ApiError | None:
        try:
            s.pod(f"nogpu{next(attempt)}", unified={GPUMEM: "8000"})
        except lightkube.ApiError as err:
            return err
        return None

    err = wait_for(refused, what="a malformed unified pod to be refused", watch=[webhook])
    assert err.status.code == 422
    message = err.status.message or ""
    assert 'admission webhook "validate.pods.migpilot.io" denied the request' in message
    assert "spec.containers[0].resources.nvidia.com/gpumem: needs nvidia.com/gpu" in message

    err = _refusal(s, "cores", unified={GPU: "1", GPUCORES: "150"})
    assert "spec.containers[0].resources.nvidia.com/gpucores: 150 is outside 1 to 100" in (
        err.status.message or ""
    )
    err = _refusal(s, "huge", unified={GPU: "1", GPUMEM: "8Gi"})  # gpumem counts MiB
    assert "'8Gi' (8589934592 MiB: nvidia.com/gpumem counts MiB) is more than" in (
        err.status.message or ""
    )
    err = _refusal(
        s,
        "policy",
        unified={GPU: "1", GPUMEM: "8000"},
        annotations={"hami.io/gpu-scheduler-policy": "random"},
    )
    assert "metadata.annotations[hami.io/gpu-scheduler-policy]: 'random'" in (
        err.status.message or ""
    )
    # A fraction of an extended resource never reaches a webhook: the apiserver refuses it.
    err = _refusal(s, "fraction", unified={GPU: "1", GPUMEM: "7.5"})
    assert "must be an integer" in (err.status.message or "")

    # A well-formed unified pod is gated, as a MIG pod is; the apiserver hands the webhooks
    # (and the controller) its quantities canonical: 8000 becomes "8k".
    good = s.pod("good", unified={GPU: "1", GPUMEM: "8000"})
    assert _gates(good) == [GATE]
    assert good.metadata and good.metadata.labels == {"migpilot.io/gated": "true"}
    assert good.spec and good.spec.containers[0].resources
    assert (good.spec.containers[0].resources.limits or {})[GPUMEM] == "8k"
    wait_for(lambda: _scheduling_gated(client, f"wh-good-{s.suffix}"), what="SchedulingGated")

    # The annotation alone makes a whole-GPU pod unified; a filter naming a GPU without MIG
    # beside one with it is allowed, with a warning.
    mode = s.pod(
        "mode",
        unified={GPU: "1"},
        annotations={"nvidia.com/vgpu-mode": "mig", "nvidia.com/use-gputype": "A100,V100"},
    )
    assert _gates(mode) == [GATE]

    # HAMi's MPS mode is served (an MPS slice): gated; a container asking two GPUs is refused,
    # as one MPS slice is one GPU's.
    mps = s.pod(
        "mps", unified={GPU: "1", GPUMEM: "8000"}, annotations={"nvidia.com/vgpu-mode": "mps"}
    )
    assert _gates(mps) == [GATE]
    err = _refusal(
        s, "mps2", unified={GPU: "2", GPUMEM: "8000"}, annotations={"nvidia.com/vgpu-mode": "mps"}
    )
    assert "more than one GPU with nvidia.com/vgpu-mode: mps" in (err.status.message or "")

    # Not migpilot's: whole GPUs for NVIDIA's plugin, and another vgpu-mode, even malformed.
    assert _gates(s.pod("whole", unified={GPU: "1"})) == []
    other = s.pod(
        "hami",
        unified={GPU: "1", GPUMEM: "8000", GPUCORES: "150"},
        annotations={"nvidia.com/vgpu-mode": "hami-core"},
    )
    assert _gates(other) == []
    # MIG resource names are never refused (the mutating webhook warns of a misspelt one).
    assert _gates(s.pod("badmig", mig="nvidia.com/mig-1G.10gb")) == []

    # Stopped, the validating webhook refuses nothing (failurePolicy Ignore).
    controlplane.stop_components([webhook])
    assert _gates(s.pod("down", unified={GPUMEM: "8000"})) == []


def _claim_spec(device_class: str) -> dict[str, Any]:
    return {
        "devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": device_class}}]}
    }


def _dra_pod(s: Scene, name: str, **claim: str) -> Pod:
    """A pod with one claim entry (``resourceClaimTemplateName=...`` or ``resourceClaimName``)."""
    full = f"wh-{name}-{s.suffix}"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": full, "namespace": POD_NS},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": "registry.example/never-pulled:1",
                    "resources": {"claims": [{"name": "gpu"}]},
                }
            ],
            "resourceClaims": [{"name": "gpu", **claim}],
        },
    }
    s.pods.append(full)
    created = s.client.create(codecs.from_dict(pod))
    assert isinstance(created, Pod)
    return created


def test_dra_pods_are_gated_when_their_claims_ask_for_migpilots_devices(
    scene: tuple[Scene, controlplane.Component],
) -> None:
    s, webhook = scene
    client = s.client
    ours, other = f"wh-mig-{s.suffix}", f"wh-other-{s.suffix}"
    made: list[tuple[type[Any], str]] = []
    try:
        for name, device_class in ((ours, "mig.migpilot.io"), (other, "gpu.example.com")):
            template = {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceClaimTemplate",
                "metadata": {"name": name, "namespace": POD_NS},
                "spec": {"spec": _claim_spec(device_class)},
            }
            client.create(codecs.from_dict(template))
            made.append((ResourceClaimTemplate, name))
        claim = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": ours, "namespace": POD_NS},
            "spec": _claim_spec("mig.migpilot.io"),
        }
        client.create(codecs.from_dict(claim))
        made.append((ResourceClaim, ours))

        # The apiserver starts calling a new webhook configuration within a moment.
        attempt = iter(range(1000))

        def a_dra_pod_is_gated() -> str | None:
            pod = _dra_pod(s, f"dra{next(attempt)}", resourceClaimTemplateName=ours)
            return pod.metadata.name if pod.metadata and GATE in _gates(pod) else None

        gated = wait_for(a_dra_pod_is_gated, what="a DRA pod to be gated", watch=[webhook])
        pod = client.get(Pod, gated, namespace=POD_NS)
        assert _gates(pod) == [GATE]
        assert pod.metadata and pod.metadata.labels == {"migpilot.io/gated": "true"}
        wait_for(
            lambda: _scheduling_gated(client, gated), what="PodScheduled=False/SchedulingGated"
        )
        # A ResourceClaim of the class, named directly, gates alike.
        assert _gates(_dra_pod(s, "claim", resourceClaimName=ours)) == [GATE]

        # Another driver's claims: untouched (the controller would never let it go).
        assert _gates(_dra_pod(s, "other", resourceClaimTemplateName=other)) == []
        # A template not there yet: not gated (it may be another driver's), with a warning.
        missing = _dra_pod(s, "missing", resourceClaimTemplateName=f"wh-later-{s.suffix}")
        assert _gates(missing) == []

        # A stale Lease gates no DRA pod either.
        s.renew(seconds_ago=3600)
        time.sleep(LEASE_CACHE_S + 0.5)  # outlast the webhook's cache of the Lease
        assert _gates(_dra_pod(s, "stale", resourceClaimTemplateName=ours)) == []
    finally:
        for kind, name in made:
            with contextlib.suppress(lightkube.ApiError):
                client.delete(kind, name, namespace=POD_NS)
