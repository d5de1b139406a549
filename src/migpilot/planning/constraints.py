"""Which nodes a pod may run on, by kube-scheduler's rules, with the reason when it may not.

Covers the constraints of the snapshot format: cordoned nodes, ``nodeSelector``, required node
affinity (In, NotIn, Exists, DoesNotExist, Gt, Lt) and taints with NoSchedule/NoExecute against
tolerations, and the split of DRA mode: a node labelled ``migpilot.io/mode=dra`` serves only
pods asking through ResourceClaims (:attr:`snapshot.Pod.dra`), and such pods only it. CPU and
memory depend on what the planner has already placed, so each planner checks
them itself. Pure functions; every planner and the plan validator share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from migpilot import digits
from migpilot.planning import modes, snapshot


def tolerates(toleration: snapshot.Toleration, taint: snapshot.Taint) -> bool:
    """Kubernetes' toleration matching (``Toleration.ToleratesTaint``)."""
    if toleration.effect and toleration.effect != taint.effect:
        return False
    if toleration.key and toleration.key != taint.key:
        return False
    if toleration.operator == "Exists":
        return True
    return toleration.value == taint.value


def _requirement_matches(req: snapshot.Requirement, labels: Mapping[str, str], name: str) -> bool:
    value = name if req.field else labels.get(req.key)
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
        number = digits.integer(value)
    except ValueError:
        return False
    bound = digits.integer(req.values[0])
    return number > bound if req.operator == "Gt" else number < bound


def affinity_matches(
    terms: tuple[tuple[snapshot.Requirement, ...], ...],
    labels: Mapping[str, str],
    *,
    name: str = "",
) -> bool:
    """Required node affinity on a node with these labels and this name: any term whose
    requirements all hold (an empty term matches none)."""
    if not terms:
        return True
    return any(term and all(_requirement_matches(r, labels, name) for r in term) for term in terms)


def names_nodes(pod: snapshot.Pod) -> bool:
    """Whether the pod's node affinity names nodes (``matchFields`` on ``metadata.name``): then
    alike nodes no longer admit it alike."""
    return any(r.field for term in pod.affinity for r in term)


def rejection(node: snapshot.Node, pod: snapshot.Pod, *, gpus: bool = True) -> str | None:
    """Why ``pod`` may not run on ``node`` whatever its resources, or ``None`` when it may.
    ``gpus=False`` skips the check that the node has MIG-capable GPUs (for a node whose
    ``nvidia.com/gpu`` kube-scheduler counts, a node migpilot does not plan)."""
    if node.unschedulable:
        return "node is cordoned (unschedulable)"
    dra_node = node.labels.get(modes.MODE_LABEL) == modes.Mode.DRA.value
    if dra_node and not pod.dra:
        return (
            f"node is in DRA mode ({modes.MODE_LABEL}={modes.Mode.DRA.value}): it serves only "
            "pods asking through ResourceClaims"
        )
    if pod.dra and not dra_node:
        return (
            "it asks through ResourceClaims, which only nodes in DRA mode "
            f"({modes.MODE_LABEL}={modes.Mode.DRA.value}) serve"
        )
    for key, want in sorted(pod.node_selector.items()):
        have = node.labels.get(key)
        if have != want:
            shown = "missing" if have is None else repr(have)
            return f"nodeSelector {key}={want} does not match (node has {shown})"
    if not affinity_matches(pod.affinity, node.labels, name=node.name):
        return "required node affinity does not match the node's labels or name"
    for taint in node.taints:
        if taint.effect == "PreferNoSchedule":
            continue
        if not any(tolerates(t, taint) for t in pod.tolerations):
            return f"taint {taint.key}={taint.value}:{taint.effect} is not tolerated"
    if gpus and not node.gpus:
        return "node has no MIG-capable GPU"
    return None


def signature(pod: snapshot.Pod) -> tuple[object, ...]:
    """Pods with equal signatures are admitted by exactly the same nodes (for caching)."""
    return (tuple(sorted(pod.node_selector.items())), pod.affinity, pod.tolerations, pod.dra)


def node_class(node: snapshot.Node) -> tuple[object, ...]:
    """Nodes with equal classes admit exactly the same pods (labels, taints, cordon, GPUs)."""
    return (tuple(sorted(node.labels.items())), node.taints, node.unschedulable, bool(node.gpus))


class Admission:
    """Which nodes admit a pod, per pod signature, decided once per class of alike nodes.

    A cluster of thousands of nodes has a few dozen classes (zones, pools, taints), so a pod
    signature costs one :func:`rejection` per class, not per node.
    """

    def __init__(self, nodes: Sequence[snapshot.Node]) -> None:
        self._nodes = tuple(nodes)
        self._named: dict[tuple[object, ...], list[str | None]] = {}
        """Per signature of a pod that names nodes: the reason per node position."""
        classes: dict[tuple[object, ...], int] = {}
        self._class = [classes.setdefault(node_class(n), len(classes)) for n in nodes]
        first: dict[int, snapshot.Node] = {}
        for c, n in zip(self._class, nodes, strict=True):
            first.setdefault(c, n)
        self._example = [first[c] for c in range(len(classes))]
        self._reasons: dict[tuple[object, ...], list[str | None]] = {}
        self._admits: dict[tuple[object, ...], list[bool]] = {}

    def class_of(self, position: int) -> int:
        """The class of the node at ``position`` in the node list."""
        return self._class[position]

    def reasons(self, pod: snapshot.Pod) -> list[str | None]:
        """Per class: why the pod may not run there, or ``None``."""
        sig = signature(pod)
        found = self._reasons.get(sig)
        if found is None:
            found = self._reasons[sig] = [rejection(n, pod) for n in self._example]
        return found

    def _per_node(self, pod: snapshot.Pod) -> list[str | None]:
        """:func:`rejection` per node position, for a pod that names nodes."""
        sig = signature(pod)
        found = self._named.get(sig)
        if found is None:
            found = self._named[sig] = [rejection(n, pod) for n in self._nodes]
        return found

    def reason(self, position: int, pod: snapshot.Pod) -> str | None:
        """:func:`rejection` for the node at ``position``."""
        if names_nodes(pod):
            return self._per_node(pod)[position]
        return self.reasons(pod)[self._class[position]]

    def admits(self, pod: snapshot.Pod) -> list[bool]:
        """Per node position: does the node admit the pod?"""
        sig = signature(pod)
        found = self._admits.get(sig)
        if found is None:
            if names_nodes(pod):
                found = [r is None for r in self._per_node(pod)]
            else:
                per_class = [r is None for r in self.reasons(pod)]
                found = [per_class[c] for c in self._class]
            self._admits[sig] = found
        return found


def kept_off(pod: snapshot.Pod, nodes: frozenset[str]) -> snapshot.Pod:
    """``pod`` admitted nowhere in ``nodes``: each term of its required node affinity (or a new
    one) also requires the node's name not in them. An empty term matches no node and stays
    empty."""
    away = snapshot.Requirement("metadata.name", "NotIn", tuple(sorted(nodes)), field=True)
    terms = tuple((*t, away) if t else t for t in pod.affinity) or ((away,),)
    return dataclasses.replace(pod, affinity=terms)
