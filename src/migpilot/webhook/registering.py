"""The MutatingWebhookConfiguration that sends new MIG pods to the webhook.

Why it exists: the registration decides as much as the server does. ``failurePolicy: Ignore``
and a 2 s timeout make a dead or slow webhook let pods through (fail open); the CEL
``matchConditions`` keep the apiserver from calling the webhook for pods that ask for no
``nvidia.com/mig-`` resource, which are nearly all of them; the namespace selector keeps
``kube-system`` (and the webhook's own namespace) out, so the webhook can never hold up the
cluster's own pods. One function renders it, for the deploy manifest
(``deploy/webhook/mutatingwebhookconfiguration.yaml``, checked against it by a test) and the
end-to-end test alike.

Pure: builds a dict, reads nothing.
"""

from __future__ import annotations

import base64
from typing import Any

NAME = "migpilot-webhook"
WEBHOOK_NAME = "pods.migpilot.io"
OPT_OUT_LABEL = "migpilot.io/gating"
"""A pod labelled ``migpilot.io/gating: disabled`` is never sent to the webhook."""
TIMEOUT_S = 2

_HAS_MIG = (
    "has({0}.resources) && ("
    "(has({0}.resources.requests) && "
    "{0}.resources.requests.exists(r, r.startsWith('nvidia.com/mig-'))) || "
    "(has({0}.resources.limits) && "
    "{0}.resources.limits.exists(r, r.startsWith('nvidia.com/mig-'))))"
)
MIG_CONDITION = (
    f"object.spec.containers.exists(c, {_HAS_MIG.format('c')}) || "
    f"(has(object.spec.initContainers) && "
    f"object.spec.initContainers.exists(c, {_HAS_MIG.format('c')}))"
)
"""CEL: the pod asks (requests or limits) for some ``nvidia.com/mig-`` resource."""


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
    ``(namespace, name)`` on ``port``, trusting the PEM ``ca_bundle``."""
    if (url is None) == (service is None):
        raise ValueError("give exactly one of url and service")
    client_config: dict[str, Any]
    if service is None:
        client_config = {"url": url}
    else:
        namespace, service_name = service
        client_config = {
            "service": {
                "namespace": namespace,
                "name": service_name,
                "path": "/mutate-pods",
                "port": port,
            }
        }
    client_config["caBundle"] = base64.b64encode(ca_bundle).decode("ascii")
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [
            {
                "name": WEBHOOK_NAME,
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
                "reinvocationPolicy": "Never",
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
                "matchConditions": [{"name": "requests-mig", "expression": MIG_CONDITION}],
            }
        ],
    }
