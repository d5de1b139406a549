"""The kubelet plugin's :class:`~preparing.ClaimSource` over the agent's Kubernetes API.

Why it exists: in the kubelet's DRA v1 API a claim comes as a reference, so the plugin GETs the
``resource.k8s.io/v1`` ResourceClaim (through the agent's :class:`ClaimReader`, which
:class:`~migpilot.agent.cluster.kubeapi.NodeApi` is, over the shared boundary
:mod:`migpilot.kube`) and reads its allocation. A claim that is not there is ``None`` (the
preparer says "not in the API"); every other failure becomes a message a person can act on, one
claim's error in the kubelet's answer: the agent not allowed to read claims (its RBAC), its
credentials refused, the API server unreachable or overloaded (the kubelet retries), or the
server's own refusal, quoted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from migpilot import errors
from migpilot.kube import errors as kube_errors


class ClaimReader(Protocol):
    """The one API call the plugin makes."""

    def get_resource_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The ResourceClaim, ``None`` on 404; :class:`~migpilot.kube.errors.KubeApiError`."""
        ...


class ClaimReadError(errors.MigpilotError):
    """A ResourceClaim the API server would not give: the message says why."""


def explain(err: kube_errors.KubeApiError) -> str:
    """What a failed GET of a ResourceClaim means, for the claim's error."""
    if err.code == 403:
        return (
            f"the agent may not read ResourceClaims ({err}): its ClusterRole needs get on "
            "resourceclaims in resource.k8s.io"
        )
    if err.code == 401:
        return f"the API server refused the agent's credentials ({err})"
    if err.transient:
        return f"the API server did not answer ({err}); the kubelet retries"
    return f"the API server refused to read it: {err}"


class ApiClaims:
    """ResourceClaims read through a :class:`ClaimReader`."""

    def __init__(self, api: ClaimReader) -> None:
        self._api = api

    def read_claim(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The claim object, ``None`` when there is none; :class:`ClaimReadError` else."""
        try:
            return self._api.get_resource_claim(namespace, name)
        except kube_errors.NotFoundError:
            return None  # the client answers None for a 404; a reader may raise it instead
        except kube_errors.KubeApiError as err:
            raise ClaimReadError(f"cannot read it from the API: {explain(err)}") from err
