"""Pods of DRA claims and what a DRA test prints when it fails, for the DRA e2e tests and
``bench/bench_dra_kube.py``.

Why it exists: every DRA scene makes pods of one claim (from a template or a named
ResourceClaim) and, on a failed wait, prints the pods and the claims' allocations beside the
components' logs; written once here so the scenes differ only in what they set up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import lightkube
from lightkube.models.core_v1 import (
    Container,
    PodResourceClaim,
    PodSchedulingGate,
    PodSpec,
    ResourceRequirements,
)
from lightkube.models.core_v1 import ResourceClaim as ContainerClaim
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import ResourceClaim

from tests.kube import controlplane, system

CLAIM = "mig"
"""The name of the pod's one claim, as its container names it."""
T = TypeVar("T")


def claim_pod(
    name: str,
    namespace: str,
    *,
    template: str | None = None,
    claim: str | None = None,
    requests: Mapping[str, str] | None = None,
    node: str | None = None,
    labels: Mapping[str, str] | None = None,
    gates: Sequence[str] = (),
    grace_s: int | None = None,
) -> Pod:
    """A pod of one container with one claim: from the ResourceClaimTemplate ``template`` or
    the ResourceClaim ``claim`` (exactly one). ``requests``: the container's CPU and memory
    requests; ``node``: a node selector on that hostname; ``gates``: scheduling gates;
    ``grace_s``: its termination grace period."""
    if (template is None) == (claim is None):
        raise ValueError(f"pod {name}: give a template or a claim, not {template=} {claim=}")
    source = (
        PodResourceClaim(name=CLAIM, resourceClaimName=claim)
        if claim is not None
        else PodResourceClaim(name=CLAIM, resourceClaimTemplateName=template)
    )
    return Pod(
        metadata=ObjectMeta(name=name, namespace=namespace, labels=dict(labels or {}) or None),
        spec=PodSpec(
            containers=[
                Container(
                    name="app",
                    image="app",
                    resources=ResourceRequirements(
                        claims=[ContainerClaim(name=CLAIM)],
                        requests=dict(requests) if requests else None,
                    ),
                )
            ],
            resourceClaims=[source],
            nodeSelector={"kubernetes.io/hostname": node} if node else None,
            schedulingGates=[PodSchedulingGate(name=g) for g in gates] or None,
            terminationGracePeriodSeconds=grace_s,
        ),
    )


def described(client: lightkube.Client, namespace: str) -> list[str]:
    """A line per pod (phase, node, scheduling gates) and per claim (its status)."""
    lines = []
    for p in client.list(Pod, namespace=namespace):
        assert p.metadata is not None and p.spec is not None and p.status is not None
        gates = [g.name for g in p.spec.schedulingGates or ()]
        lines.append(f"pod {p.metadata.name}: {p.status.phase} on {p.spec.nodeName} {gates}")
    for c in client.list(ResourceClaim, namespace=namespace):
        d = c.to_dict()
        lines.append(f"claim {d['metadata']['name']}: {d.get('status') or {}}")
    return lines


def wait(
    running: system.System,
    probe: Callable[[], T | None],
    what: str,
    *,
    timeout: float,
    dump: Callable[[], str],
) -> T:
    """``probe``'s first answer other than ``None`` (watching ``running``'s components: one
    that exits fails the wait at once); a wait that times out fails the test with ``dump()``."""
    try:
        return controlplane.wait_for(probe, what=what, timeout=timeout, watch=running.components())
    except controlplane.ControlPlaneError as err:
        raise AssertionError(f"{err}\n{dump()}") from None
