"""The webhook configurations that send new MIG and unified pods to the webhook.

Why it exists: the registration decides as much as the server does. ``failurePolicy: Ignore``
and a 2 s timeout make a dead or slow webhook let pods through (fail open), for the validating
webhook too (its refusals save a person from a pod that would wait forever; they are not worth
blocking every GPU pod's creation while the webhook is down). The CEL ``matchConditions`` keep
the apiserver from calling the webhook for pods that ask for no ``nvidia.com/mig-`` resource, no
``nvidia.com/gpu`` (the mutating one: a whole GPU), make no unified request
(``nvidia.com/gpumem``, ``gpumem-percentage``, ``gpucores``, or the ``nvidia.com/vgpu-mode``
annotation) and name no DRA claim (the mutating one), which are most of them; the namespace
selector keeps ``kube-system`` (and the webhook's own namespace) out, so the webhook can never
hold up the cluster's own pods. Both configurations share selectors, so a pod is either seen by
both webhooks or by neither. One function per configuration renders it, for the deploy manifests
(``deploy/webhook/``, checked against them by a test), the Helm chart (checked by a test) and the
end-to-end tests alike.

Pure: builds a dict, reads nothing.
"""

from __future__ import annotations

import base64
from typing import Any

from migpilot.planning import modes, snapshot, unified

NAME = "migpilot-webhook"
WEBHOOK_NAME = "pods.migpilot.io"
"""The mutating webhook (it gates)."""
VALIDATING_WEBHOOK_NAME = "validate.pods.migpilot.io"
"""The validating webhook (it refuses malformed unified requests); ``kubectl`` names it."""
MUTATE_PATH = "/mutate-pods"
VALIDATE_PATH = "/validate-pods"
OPT_OUT_LABEL = "migpilot.io/gating"
"""A pod labelled ``migpilot.io/gating: disabled`` is never sent to either webhook."""
TIMEOUT_S = 5
"""Seconds the apiserver waits for an answer before it lets the pod through ungated. A pod let
through ungated is bound by kube-scheduler alone and may take instances reserved for pinned pods
(``docs/controller.md``); at 2 s a CPU-starved webhook missed 95 of 5,000 pods in the scale
benchmark. A dead or unreachable webhook fails at once whatever this is."""


def _container_asks(test: str) -> str:
    """CEL: some container or init container asks (requests or limits) for a resource ``r``
    that passes ``test``."""
    one = (
        "has(c.resources) && ("
        f"(has(c.resources.requests) && c.resources.requests.exists(r, {test})) || "
        f"(has(c.resources.limits) && c.resources.limits.exists(r, {test})))"
    )
    return (
        f"object.spec.containers.exists(c, {one}) || "
        f"(has(object.spec.initContainers) && object.spec.initContainers.exists(c, {one}))"
    )


_IS_MIG = f"r.startsWith('{snapshot.MIG_RESOURCE_PREFIX}')"
_IS_UNIFIED = "r in [" + ", ".join(f"'{name}'" for name in unified.UNIFIED_RESOURCES) + "]"
_HAS_MODE = (
    f"(has(object.metadata.annotations) && '{unified.VGPU_MODE}' in object.metadata.annotations)"
)
UNIFIED_CONDITION = f"{_container_asks(_IS_UNIFIED)} || {_HAS_MODE}"
"""CEL: the pod asks for ``nvidia.com/gpumem``, ``gpumem-percentage`` or ``gpucores``, or says
a ``nvidia.com/vgpu-mode`` (the webhook tells ``mig`` and ``mps`` from the others)."""
_IS_MPS = f"r.startsWith('{modes.MPS_RESOURCE_PREFIX}')"
_IS_WHOLE = f"r == '{unified.GPU}'"
_HAS_CLAIMS = "(has(object.spec.resourceClaims) && size(object.spec.resourceClaims) > 0)"
GATE_CONDITION = (
    f"{_container_asks(f'{_IS_MIG} || {_IS_MPS} || {_IS_UNIFIED} || {_IS_WHOLE}')} || {_HAS_MODE}"
    f" || {_HAS_CLAIMS}"
)
"""CEL: :data:`UNIFIED_CONDITION`, or the pod asks for some ``nvidia.com/mig-`` resource, an
MPS slice (``nvidia.com/gpu-<N>gb``, ``docs/modes.md``) or ``nvidia.com/gpu``: a whole-GPU pod
is gated while a node is labelled for dynamic MIG mode (``docs/migmode.md``), and the webhook
reads the Lease to know; or it names DRA claims (``spec.resourceClaims``), which the webhook
reads to know whether they ask for migpilot's devices (``docs/dra.md``)."""


def configuration(
    *,
    ca_bundle: bytes,
    url: str | None = None,
    service: tuple[str, str] | None = None,
    port: int = 443,
    excluded_namespaces: tuple[str, ...] = ("kube-system",),
    name: str = NAME,
) -> dict[str, Any]:
    """The MutatingWebhookConfiguration as a dict: called at ``url``, or through the Service
    ``(namespace, name)`` on ``port`` at :data:`MUTATE_PATH`, trusting the PEM ``ca_bundle``."""
    hook = _webhook(
        WEBHOOK_NAME,
        client_config=_client_config(
            ca_bundle=ca_bundle, url=url, service=service, port=port, path=MUTATE_PATH
        ),
        excluded_namespaces=excluded_namespaces,
        condition=("requests-mig-or-unified", GATE_CONDITION),
        mutating=True,
    )
    return _configuration("MutatingWebhookConfiguration", name, hook)


def validating_configuration(
    *,
    ca_bundle: bytes,
    url: str | None = None,
    service: tuple[str, str] | None = None,
    port: int = 443,
    excluded_namespaces: tuple[str, ...] = ("kube-system",),
    name: str = NAME,
) -> dict[str, Any]:
    """The ValidatingWebhookConfiguration as a dict, as :func:`configuration` (the path on the
    Service is :data:`VALIDATE_PATH`; a ``url`` names its own)."""
    hook = _webhook(
        VALIDATING_WEBHOOK_NAME,
        client_config=_client_config(
            ca_bundle=ca_bundle, url=url, service=service, port=port, path=VALIDATE_PATH
        ),
        excluded_namespaces=excluded_namespaces,
        condition=("unified", UNIFIED_CONDITION),
        mutating=False,
    )
    return _configuration("ValidatingWebhookConfiguration", name, hook)


def _configuration(kind: str, name: str, hook: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind,
        "metadata": {"name": name},
        "webhooks": [hook],
    }


def _client_config(
    *, ca_bundle: bytes, url: str | None, service: tuple[str, str] | None, port: int, path: str
) -> dict[str, Any]:
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url and service")
    client_config: dict[str, Any]
    if service is None:
        client_config = {"url": url}
    else:
        namespace, service_name = service
        client_config = {
            "service": {"namespace": namespace, "name": service_name, "path": path, "port": port}
        }
    client_config["caBundle"] = base64.b64encode(ca_bundle).decode("ascii")
    return client_config


def _webhook(
    name: str,
    *,
    client_config: dict[str, Any],
    excluded_namespaces: tuple[str, ...],
    condition: tuple[str, str],
    mutating: bool,
) -> dict[str, Any]:
    condition_name, expression = condition
    reinvocation = {"reinvocationPolicy": "Never"} if mutating else {}
    return {
        "name": name,
        "admissionReviewVersions": ["v1"],
        "clientConfig": client_config,
        "rules": [
            {
                "apiGroups": [""],
                "apiVersions": ["v1"],
                "operations": ["CREATE"],
                "resources": ["pods"],
                "scope": "Namespaced",
            }
        ],
        "failurePolicy": "Ignore",
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_S,
        **reinvocation,
        "matchPolicy": "Equivalent",
        "namespaceSelector": {
            "matchExpressions": [
                {
                    "key": "kubernetes.io/metadata.name",
                    "operator": "NotIn",
                    "values": list(excluded_namespaces),
                }
            ]
        },
        "objectSelector": {
            "matchExpressions": [
                {"key": OPT_OUT_LABEL, "operator": "NotIn", "values": ["disabled"]}
            ]
        },
        "matchConditions": [{"name": condition_name, "expression": expression}],
    }
