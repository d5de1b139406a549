"""The bodies the shells send to the Kubernetes API server, built from plain data.

Why it exists: lightkube's shape is prepare → send → interpret. The sending and the interpreting
are :mod:`~migpilot.kube.client`'s; preparing a body is pure, so it is here, where the
in-memory adapters apply the very bodies the lightkube ones send (a label patch that works in
the unit tests is the patch the API server gets).

Pure: no client, no I/O, no clock (a time stamp is an input).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from migpilot.kube import objects

EVENT_MESSAGE_CHARS = 1024
"""The longest Event message sent (the API server refuses longer ones)."""


def node_labels_patch(labels: Mapping[str, str | None]) -> dict[str, Any]:
    """The merge patch setting ``labels`` on a Node (``None`` removes a key); other labels are
    left alone."""
    return {"metadata": {"labels": dict(labels)}}


def node_resources_patch(resources: Mapping[str, str | None]) -> dict[str, Any]:
    """The merge patch of a Node's status setting extended ``resources`` in its capacity and
    allocatable alike (``None`` removes one); other resources are left alone."""
    return {"status": {"capacity": dict(resources), "allocatable": dict(resources)}}


def same_taint(taint: Mapping[str, Any], *, key: str, effect: str) -> bool:
    """Whether ``taint`` (its Kubernetes form) is the taint ``key:effect``, matched as
    Kubernetes matches taints (``Taint.MatchTaint``: key and effect, whatever the value)."""
    return taint.get("key") == key and taint.get("effect") == effect


def node_taints_patch(
    taints: Sequence[Mapping[str, Any]], *, resource_version: str
) -> dict[str, Any]:
    """The merge patch setting a Node's ``spec.taints`` to ``taints``, refused with 409 Conflict
    if the Node changed since ``resource_version`` (a merge patch replaces the whole list, so
    a taint someone added meanwhile would otherwise be lost)."""
    return {
        "metadata": {"resourceVersion": resource_version},
        "spec": {"taints": [dict(t) for t in taints]},
    }


def owned_by_node(body: Mapping[str, Any], *, node: str, uid: str) -> dict[str, Any]:
    """``body`` owned by the Node ``node`` (uid ``uid``): deleted with it by the garbage
    collector."""
    meta = dict(body.get("metadata") or {})
    meta["ownerReferences"] = [{"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}]
    return {**body, "metadata": meta}


def event_body(note: objects.EventNote, *, component: str, stamp: str) -> dict[str, Any]:
    """The core/v1 Event recording ``note``, reported by ``component`` at ``stamp`` (RFC 3339,
    seconds)."""
    return {
        "metadata": {"generateName": f"{note.name}.", "namespace": note.namespace or "default"},
        "involvedObject": {
            "apiVersion": "v1",
            "kind": note.kind,
            "name": note.name,
            "namespace": note.namespace,
            "uid": note.uid,
        },
        "type": note.type,
        "reason": note.reason,
        "message": note.message[:EVENT_MESSAGE_CHARS],
        "source": {"component": component},
        "reportingComponent": component,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def lease_probe(namespace: str, name: str) -> dict[str, Any]:
    """An empty Lease ``namespace/name``, for a dry-run create that asks whether it could be
    created (its namespace exists)."""
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {}}
