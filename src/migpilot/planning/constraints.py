"""Which nodes a pod may run on, by kube-scheduler's rules, with the reason when it may not.

Covers the constraints of the snapshot format: cordoned nodes, ``nodeSelector``, required node
affinity (In, NotIn, Exists, DoesNotExist, Gt, Lt) and taints with NoSchedule/NoExecute against
tolerations. CPU and memory depend on what the planner has already placed, so each planner checks
them itself. Pure functions; every planner and the plan validator share them.
"""

from __future__ import annotations

from collections.abc import Mapping

from migpilot.planning import snapshot


def tolerates(toleration: snapshot.Toleration, taint: snapshot.Taint) -> bool:
    """Kubernetes' toleration matching (``Toleration.ToleratesTaint``)."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.key and toleration.key != taint.key:
        return False
    if toleration.operator == "Exists":
        return True
    return toleration.value == taint.value


def _requirement_matches(req: snapshot.Requirement, labels: Mapping[str, str]) -> bool:
    value = labels.get(req.key)
    if req.operator == "In":
        return value is not None and value in req.values
    if req.operator == "NotIn":
        return value is None or value not in req.values
    if req.operator == "Exists":
        return value is not None
    if req.operator == "DoesNotExist":
        return value is None
    if value is None:
        return False
    try:
        number = int(value)
    except ValueError:
        return False
    bound = int(req.values[0])
    return number > bound if req.operator == "Gt" else number < bound


def affinity_matches(
    terms: tuple[tuple[snapshot.Requirement, ...], ...], labels: Mapping[str, str]
) -> bool:
    """Required node affinity: any term whose requirements all hold (an empty term matches none)."""
    if not terms:
        return True
    return any(term and all(_requirement_matches(r, labels) for r in term) for term in terms)


def rejection(node: snapshot.Node, pod: snapshot.Pod) -> str | None:
    """Why ``pod`` may not run on ``node`` whatever its resources, or ``None`` when it may."""
    if node.unschedulable:
        return "node is cordoned (unschedulable)"
    for key, want in sorted(pod.node_selector.items()):
        have = node.labels.get(key)
        if have != want:
            shown = "missing" if have is None else repr(have)
            return f"nodeSelector {key}={want} does not match (node has {shown})"
    if not affinity_matches(pod.affinity, node.labels):
        return "required node affinity does not match the node's labels"
    for taint in node.taints:
        if taint.effect == "PreferNoSchedule":
            continue
        if not any(tolerates(t, taint) for t in pod.tolerations):
            return f"taint {taint.key}={taint.value}:{taint.effect} is not tolerated"
    if not node.gpus:
        return "node has no MIG-capable GPU"
    return None


def signature(pod: snapshot.Pod) -> tuple[object, ...]:
    """Pods with equal signatures are admitted by exactly the same nodes (for caching)."""
    return (tuple(sorted(pod.node_selector.items())), pod.affinity, pod.tolerations)
