"""The Helm chart ``deploy/helm/migpilot``: linted by the real ``helm``, rendered, applied to the
real apiserver, and its RBAC checked as least privilege by the apiserver's own authorizer."""

from __future__ import annotations

import base64
import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.generic_resource import load_in_cluster_generic_resources
from lightkube.models.authorization_v1 import ResourceAttributes, SubjectAccessReviewSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import MutatingWebhookConfiguration
from lightkube.resources.apps_v1 import DaemonSet, Deployment
from lightkube.resources.authorization_v1 import SubjectAccessReview
from lightkube.resources.core_v1 import Namespace, Secret, Service, ServiceAccount
from lightkube.resources.rbac_authorization_v1 import ClusterRole, ClusterRoleBinding

from migpilot.webhook import registering
from tests.kube import tools
from tests.kube.controlplane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "migpilot"


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools.locate().helm), *args], capture_output=True, text=True, check=False
    )


def _render(release: str, namespace: str, *sets: str) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "-n", namespace, "--include-crds"]
    for s in sets:
        args += ["--set", s]
    got = _helm(*args)
    assert got.returncode == 0, got.stderr
    return [d for d in yaml.safe_load_all(got.stdout) if d]


@pytest.mark.parametrize(
    "sets",
    [(), ("certManager.enabled=true", "serviceMonitor.enabled=true"), ("webhook.enabled=false",)],
)
def test_the_chart_lints_strictly(sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    got = _helm(*args)
    assert got.returncode == 0, got.stdout + got.stderr


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("controller.batchWindow=-1", "/controller/batchWindow"),
        ("controller.scoring=random", "/controller/scoring"),
        ("agent.strategy=both", "/agent/strategy"),
        ("agent.backend=cuda", "/agent/backend"),
    ],
)
def test_bad_values_are_refused_naming_the_field(bad: str, message: str) -> None:
    got = _helm("lint", str(CHART), "--set", bad)
    assert got.returncode != 0
    assert message in got.stdout + got.stderr


def test_the_chart_ships_the_crd_of_deploy_crds() -> None:
    shipped = (CHART / "crds" / "gpulayouts.migpilot.io.yaml").read_bytes()
    assert shipped == (REPO / "deploy" / "crds" / "gpulayouts.migpilot.io.yaml").read_bytes()


def test_the_webhook_configuration_is_the_one_registering_renders() -> None:
    docs = _render("mp", "gpu-system")
    (hook,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    ca = base64.b64decode(secret["data"]["ca.crt"])
    want = registering.configuration(
        ca_bundle=ca,
        service=("gpu-system", "mp-webhook"),
        excluded_namespaces=("kube-system", "gpu-system"),
        name="mp-webhook",
    )
    assert hook["webhooks"] == want["webhooks"]
    # The serving certificate is signed by that CA for the Service's DNS name.
    assert "BEGIN CERTIFICATE" in base64.b64decode(secret["data"]["tls.crt"]).decode()


def test_cert_manager_injects_the_ca_instead() -> None:
    docs = _render("mp", "gpu-system", "certManager.enabled=true")
    kinds = {d["kind"] for d in docs}
    assert {"Issuer", "Certificate"} <= kinds and "Secret" not in kinds
    (hook,) = [d for d in docs if d["kind"] == "MutatingWebhookConfiguration"]
    annotations = hook["metadata"]["annotations"]
    assert annotations["cert-manager.io/inject-ca-from"] == "gpu-system/mp-webhook"
    assert "caBundle" not in hook["webhooks"][0]["clientConfig"]


@pytest.fixture
def installed(control_plane: ControlPlane) -> Iterator[tuple[ControlPlane, str, str]]:
    """The rendered chart applied to the real apiserver in a namespace of its own."""
    client = control_plane.client
    suffix = uuid.uuid4().hex[:6]
    release, namespace = f"mp{suffix}", f"migpilot-{suffix}"
    client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    docs = _render(release, namespace)
    applied: list[Any] = []
    try:
        for doc in docs:
            obj = codecs.from_dict(doc)
            client.apply(obj, field_manager="helm-test", force=True)
            applied.append(obj)
        load_in_cluster_generic_resources(client)
        yield control_plane, release, namespace
    finally:
        for obj in reversed(applied):
            if obj.kind == "CustomResourceDefinition":
                continue  # shared with the other tests
            meta = obj.metadata
            with contextlib.suppress(lightkube.ApiError):
                client.delete(type(obj), meta.name, namespace=meta.namespace)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)


@pytest.mark.kube
def test_the_rendered_chart_applies_to_the_real_apiserver(
    installed: tuple[ControlPlane, str, str],
) -> None:
    plane, release, namespace = installed
    client = plane.client
    for name in (f"{release}-controller", f"{release}-webhook"):
        assert client.get(Deployment, name, namespace=namespace)
    assert client.get(DaemonSet, f"{release}-agent", namespace=namespace)
    for name in ("controller", "webhook", "agent"):
        assert client.get(ServiceAccount, f"{release}-{name}", namespace=namespace)
    assert client.get(Service, f"{release}-webhook", namespace=namespace)
    assert client.get(Secret, f"{release}-webhook-tls", namespace=namespace)
    assert client.get(ClusterRole, f"{release}-controller")
    assert client.get(ClusterRoleBinding, f"{release}-agent")
    hook = client.get(MutatingWebhookConfiguration, f"{release}-webhook")
    assert hook.webhooks is not None and hook.webhooks[0].failurePolicy == "Ignore"


def _allowed(
    client: lightkube.Client,
    user: str,
    *,
    verb: str,
    resource: str,
    group: str = "",
    namespace: str | None = None,
    subresource: str | None = None,
    name: str | None = None,
) -> bool:
    review = SubjectAccessReview(
        spec=SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", "system:authenticated"],
            resourceAttributes=ResourceAttributes(
                verb=verb,
                resource=resource,
                group=group,
                namespace=namespace,
                subresource=subresource,
                name=name,
            ),
        )
    )
    got = client.create(review)
    assert got.status is not None
    return bool(got.status.allowed)


@pytest.mark.kube
def test_each_component_has_only_the_rights_it_needs(
    installed: tuple[ControlPlane, str, str],
) -> None:
    plane, release, namespace = installed
    client = plane.client

    def sa(name: str) -> str:
        return f"system:serviceaccount:{namespace}:{release}-{name}"

    ctl, agent, hook = sa("controller"), sa("agent"), sa("webhook")
    yes = [
        (ctl, {"verb": "patch", "resource": "pods", "namespace": "default"}),
        (ctl, {"verb": "watch", "resource": "pods"}),
        (ctl, {"verb": "patch", "resource": "gpulayouts", "group": "migpilot.io"}),
        (ctl, {"verb": "create", "resource": "events", "namespace": "default"}),
        (
            ctl,
            {
                "verb": "update",
                "resource": "leases",
                "group": "coordination.k8s.io",
                "namespace": namespace,
            },
        ),
        (
            agent,
            {
                "verb": "patch",
                "resource": "gpulayouts",
                "group": "migpilot.io",
                "subresource": "status",
            },
        ),
        (agent, {"verb": "patch", "resource": "nodes", "subresource": "status"}),
        (agent, {"verb": "watch", "resource": "pods"}),
        (
            hook,
            {
                "verb": "get",
                "resource": "leases",
                "group": "coordination.k8s.io",
                "namespace": namespace,
                "name": "migpilot-controller",
            },
        ),
    ]
    no = [
        (ctl, {"verb": "delete", "resource": "nodes"}),
        (ctl, {"verb": "get", "resource": "secrets", "namespace": namespace}),
        (ctl, {"verb": "delete", "resource": "pods", "namespace": "default"}),
        (
            ctl,
            {
                "verb": "update",
                "resource": "leases",
                "group": "coordination.k8s.io",
                "namespace": "kube-system",
            },
        ),
        (agent, {"verb": "patch", "resource": "gpulayouts", "group": "migpilot.io"}),
        (agent, {"verb": "patch", "resource": "pods", "namespace": "default"}),
        (agent, {"verb": "get", "resource": "secrets", "namespace": namespace}),
        (
            hook,
            {
                "verb": "get",
                "resource": "leases",
                "group": "coordination.k8s.io",
                "namespace": "kube-system",
                "name": "migpilot-controller",
            },
        ),
        (hook, {"verb": "list", "resource": "pods"}),
        (
            hook,
            {
                "verb": "update",
                "resource": "leases",
                "group": "coordination.k8s.io",
                "namespace": namespace,
                "name": "migpilot-controller",
            },
        ),
    ]
    for user, attrs in yes:
        assert _allowed(client, user, **attrs), (user, attrs)
    for user, attrs in no:
        assert not _allowed(client, user, **attrs), (user, attrs)
