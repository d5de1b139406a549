"""Where kube-scheduler's InterPodAffinity and PodTopologySpread filters let a pod go.

migpilot pins a pod to the node its plan chose, so the plan must leave the pod where
kube-scheduler would bind it; and under the default ``nodeAffinityPolicy: Honor`` a pinned pod has
one eligible domain, so kube-scheduler no longer enforces its spread: the plan has to. This
module answers, for a pod and each node, why those two filters refuse it there (or ``None``),
given the pods placed so far: the pods bound now and those the plan placed before it.

The rules were checked against upstream kube-scheduler (kubernetes/kubernetes, the
``k8s.io/kube-scheduler/framework`` era, v1.3x), under pkg/scheduler/framework/plugins/:

* interpodaffinity/filtering.go: ``getExistingAntiAffinityCounts``,
  ``getIncomingAffinityAntiAffinityCounts``, ``podMatchesAllAffinityTerms``,
  ``satisfyPodAffinity``, ``satisfyPodAntiAffinity``, ``satisfyExistingPodsAntiAffinity``;
  interpodaffinity/plugin.go: ``mergeAffinityTermNamespacesIfNotEmpty``,
  ``GetNamespaceLabelsSnapshot``; framework/types.go: ``getNamespacesFromPodAffinityTerm``,
  ``AffinityTerm.Matches``.
* podtopologyspread/filtering.go: ``calPreFilterState``, ``preFilterState.minMatchNum``,
  ``Filter``; podtopologyspread/common.go: ``filterTopologySpreadConstraints`` (defaults,
  ``matchLabelKeys``), ``matchNodeInclusionPolicies``, ``nodeLabelsMatchSpreadConstraints``,
  ``countPodsMatchSelector``.

Two differences from the first reading were fixed: ``countPodsMatchSelector`` counts no existing
pod for an empty selector (``labelSelector: {}``; the pod itself still matches it) and skips pods
being deleted, which InterPodAffinity still counts. The rules:

* **Pod affinity**: the node must carry every term's topology key, and each term's domain must
  hold a pod that matches *all* the terms; unless no pod anywhere matches them and the pod
  matches its own terms (the first pod of a group that has affinity to itself).
* **Pod anti-affinity**: no pod matching a term in the term's domain of the node.
* **Existing pods' anti-affinity** (the symmetric rule): no placed pod whose own required
  anti-affinity term matches this pod in a domain of the node.
* One rule of migpilot's own, stricter than upstream: a pod placed by the first-pod exception
  is an *anchor*; later pods matching all its terms must join its domains. kube-scheduler may
  bind the pods of a plan in any order, and one of them bound elsewhere first would strand the
  anchor for good.
* **Topology spread** (``DoNotSchedule``): the node must carry each constraint's key; the pods
  matching the selector in the pod's namespace in the node's domain (none for an empty selector;
  pods being deleted left out), plus one if the pod matches itself, less the fewest in any
  eligible domain (0 while there are fewer than ``minDomains``) may not exceed ``maxSkew``.
  Eligible domains come from every node (planned or not) that carries every constraint's key
  and passes the node-inclusion policies (node affinity honoured, taints ignored, by default).
  Only the pod's own hard constraints apply; a cluster's default constraints are not read.

The preferred forms never refuse a node: :meth:`Tracker.preferences` scores nodes as
kube-scheduler's InterPodAffinity and PodTopologySpread score plugins do, and the planners use the
score only to order nodes the objective finds equal (docs/planner.md, "Preferred terms"):

* **InterPodAffinity** (interpodaffinity/scoring.go): per preferred term of the pod, every placed
  pod matching it adds (affinity) or takes away (anti-affinity) the term's weight in its
  topology domain; a node scores the sum over its domains; scores are normalized to 0-100 from
  the lowest (at most 0) to the highest (at least 0) over the candidate nodes. The symmetric
  part (placed pods' own preferred terms and ``hardPodAffinityWeight`` for their required
  affinity) is not counted: it would mean reading every placed pod's terms for every pod.
* **PodTopologySpread** (podtopologyspread/scoring.go), ``ScheduleAnyway`` constraints: a
  candidate node lacking any constraint's key scores 0; otherwise per constraint the matching
  pods in its domain (counted as for the filter, over eligible nodes) times
  ``log(domains among the candidates + 2)``, plus ``maxSkew - 1``, summed and rounded; scores
  are normalized as ``100 * (max + min - s) / max`` (100 for all when max is 0): fewer is
  better. A cluster's default constraints are not read.
* Both plugins weigh 2 in the default profile, so the two normalized scores are added.

Pure and deterministic; the :class:`Tracker` is mutable planning state, like the planners' own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from migpilot.planning import constraints, interpod, snapshot

TopologyPair = tuple[str, str]


@dataclass(frozen=True, slots=True)
class Placed:
    """A pod on a node, as the filters count it."""

    namespace: str
    labels: Mapping[str, str]
    node: str
    anti_affinity: tuple[interpod.AffinityTerm, ...] = field(default=())
    terminating: bool = False
    """Being deleted: no longer counted by topology spread (pod affinity still counts it)."""


def placed_pod(pod: snapshot.Pod, node: str) -> Placed:
    """``pod`` as placed on ``node``."""
    return Placed(pod.namespace, pod.terms.labels, node, pod.terms.anti_affinity)


def bound_pod(pod: interpod.BoundPod) -> Placed:
    """A pod bound now."""
    return Placed(pod.namespace, pod.labels, pod.node, pod.anti_affinity, pod.terminating)


def namespace_labels(snap: snapshot.Snapshot, namespace: str) -> Mapping[str, str]:
    """A namespace's labels, with the ``kubernetes.io/metadata.name`` the apiserver sets."""
    return MappingProxyType(
        {**snap.namespaces.get(namespace, {}), interpod.NAMESPACE_NAME_LABEL: namespace}
    )


def included(c: interpod.SpreadConstraint, pod: snapshot.Pod, node: snapshot.Node) -> bool:
    """Whether ``node`` counts as a domain of ``c`` for ``pod`` (the node-inclusion policies)."""
    if c.honor_node_affinity:
        if any(node.labels.get(k) != v for k, v in pod.node_selector.items()):
            return False
        if not constraints.affinity_matches(pod.affinity, node.labels, name=node.name):
            return False
    if c.honor_node_taints:
        for taint in node.taints:
            if taint.effect == "PreferNoSchedule":
                continue
            if not any(constraints.tolerates(t, taint) for t in pod.tolerations):
                return False
    return True


class Tracker:
    """The pods placed so far, per node, and the two filters over them.

    Starts from the snapshot's bound pods; a planner :meth:`add` s each pod it places, so later
    pods of the same plan count it. :meth:`refusals` is per position in ``snap.nodes`` and is
    remembered until the next :meth:`add`.
    """

    def __init__(self, snap: snapshot.Snapshot) -> None:
        self._snap = snap
        self._every = snap.nodes + snap.outside
        self._labels: dict[str, Mapping[str, str]] = {n.name: n.labels for n in self._every}
        self._on: dict[str, list[Placed]] = {}
        self._log: list[Placed] = []
        """Every pod placed so far, in order (only grows)."""
        self._counts: dict[tuple[object, ...], tuple[int, Mapping[Any, int], int]] = {}
        """Incremental counts by what they are about: how many of the source list they have
        seen, the counts (never changed in place: forks share them), and their minimum."""
        self._domains: dict[tuple[object, ...], Mapping[str, str]] = {}
        """Per spread constraint and node inclusion: eligible node -> its domain (fixed)."""
        self._anti: list[Placed] = []
        self._ns: dict[str, Mapping[str, str]] = {}
        self._memo: dict[str, list[str | None]] = {}
        self._liking: dict[str, list[int] | None] = {}
        self._anchors: list[tuple[snapshot.Pod, str]] = []
        """Pods placed by the first-pod exception, with their nodes."""
        self._touched: dict[tuple[object, ...], tuple[int, int, bool]] = {}
        """Per (namespace, labels) of a pod without terms of its own: how many of
        :attr:`_anti` and :attr:`_anchors` were looked at, and whether one of them selects such
        a pod (both lists only grow, so the answer is brought up to date incrementally)."""
        for b in snap.bound:
            self._add(bound_pod(b))

    def fork(self) -> Tracker:
        """An independent copy (planners try variants on copies)."""
        twin = Tracker.__new__(Tracker)
        twin._snap, twin._every, twin._labels = self._snap, self._every, self._labels
        twin._on = {k: list(v) for k, v in self._on.items()}
        twin._log = list(self._log)
        twin._counts = dict(self._counts)
        twin._domains = self._domains
        twin._anti = list(self._anti)
        twin._ns = self._ns
        twin._memo = {}
        twin._liking = {}
        twin._anchors = list(self._anchors)
        twin._touched = dict(self._touched)
        return twin

    @property
    def pods(self) -> list[Placed]:
        """Every pod placed so far."""
        return [p for pods in self._on.values() for p in pods]

    def _add(self, placed: Placed) -> None:
        self._on.setdefault(placed.node, []).append(placed)
        self._log.append(placed)
        if placed.anti_affinity:
            self._anti.append(placed)
        self._memo.clear()
        self._liking.clear()

    def add(self, pod: snapshot.Pod, node: str) -> None:
        """Count ``pod`` on ``node`` from now on."""
        if pod.terms.affinity and not _Check(self, pod).affinity:
            self._anchors.append((pod, node))
        self._add(placed_pod(pod, node))

    def involved(self, pod: snapshot.Pod) -> bool:
        """Whether the filters could refuse ``pod`` anywhere now (else every node passes).

        A pod without terms of its own is involved only when a placed pod's anti-affinity or
        an anchor's affinity selects it; pods alike in namespace and labels share the answer,
        so most pods of a cluster with a few constrained Deployments cost a lookup."""
        if pod.terms.constrained:
            return True
        if not self._anti and not self._anchors:
            return False
        t = pod.terms
        key = (pod.namespace, tuple(sorted(t.labels.items())))
        seen_anti, seen_anchors, hit = self._touched.get(key, (0, 0, False))
        if not hit:
            own_ns = self._ns_labels(pod.namespace)
            hit = any(
                term.matches(pod.namespace, t.labels, own_ns)
                for q in self._anti[seen_anti:]
                for term in q.anti_affinity
            ) or any(
                all(term.matches(pod.namespace, t.labels, own_ns) for term in a.terms.affinity)
                for a, _ in self._anchors[seen_anchors:]
            )
        self._touched[key] = (len(self._anti), len(self._anchors), hit)
        return hit

    def _ns_labels(self, namespace: str) -> Mapping[str, str]:
        found = self._ns.get(namespace)
        if found is None:
            found = self._ns[namespace] = namespace_labels(self._snap, namespace)
        return found

    def _pairs(
        self,
        key: tuple[object, ...],
        source: list[Placed],
        pairs: Callable[[Placed], Iterable[TopologyPair]],
    ) -> Mapping[TopologyPair, int]:
        """Topology pairs counted over ``source`` (:attr:`_log` or :attr:`_anti`, which only
        grow) by ``pairs``, which ``key`` names; brought up to date from where it was left."""
        upto, counts, _ = self._counts.get(key, (0, {}, 0))
        if upto < len(source):
            fresh = dict(counts)
            for q in source[upto:]:
                for pair in pairs(q):
                    fresh[pair] = fresh.get(pair, 0) + 1
            counts = fresh
            self._counts[key] = (len(source), counts, 0)
        return counts

    def _spread(
        self, pod: snapshot.Pod, c: interpod.SpreadConstraint, keys: tuple[str, ...]
    ) -> tuple[Mapping[str, int], int]:
        """For ``pod``'s constraint ``c`` (``keys``: all its constraints' keys): pods matching
        per eligible domain, and the global minimum (0 below ``minDomains`` domains)."""
        inclusion = (
            (tuple(sorted(pod.node_selector.items())), pod.affinity)
            if c.honor_node_affinity
            else None,
            pod.tolerations if c.honor_node_taints else None,
        )
        where = (c.topology_key, keys, inclusion, c.honor_node_affinity, c.honor_node_taints)
        domains = self._domains.get(where)
        if domains is None:
            domains = self._domains[where] = MappingProxyType(
                {
                    n.name: n.labels[c.topology_key]
                    for n in self._every
                    if all(k in n.labels for k in keys) and included(c, pod, n)
                }
            )
        key = ("spread", pod.namespace, c.selector, where)
        known = self._counts.get(key)
        upto, counts, least = known or (0, {}, 0)
        if known is None or upto < len(self._log):
            fresh = dict(counts) if known else dict.fromkeys(domains.values(), 0)
            # Upstream's countPodsMatchSelector counts nothing for an empty selector (``{}``),
            # though the pod itself still matches it; nor pods being deleted.
            if c.selector is not None and c.selector.requirements:
                for q in self._log[upto:]:
                    value = domains.get(q.node)
                    if (
                        value is not None
                        and not q.terminating
                        and q.namespace == pod.namespace
                        and c.selector.matches(q.labels)
                    ):
                        fresh[value] += 1
            counts = fresh
            least = min(counts.values()) if len(counts) >= c.min_domains else 0
            self._counts[key] = (len(self._log), counts, least)
        return counts, least

    def refusals(self, pod: snapshot.Pod) -> list[str | None]:
        """Per node of ``snap.nodes``: why the filters refuse ``pod`` there, or ``None``."""
        found = self._memo.get(pod.key)
        if found is None:
            found = self._memo[pod.key] = self.refusals_on(pod, self._snap.nodes)
        return found

    def refusals_on(self, pod: snapshot.Pod, nodes: Sequence[snapshot.Node]) -> list[str | None]:
        """Per node of ``nodes`` (any nodes of the snapshot): why the filters refuse ``pod``."""
        if not self.involved(pod):
            return [None] * len(nodes)
        check = _Check(self, pod)
        return [check.refusal(n) for n in nodes]

    def preferences(self, pod: snapshot.Pod, candidates: Sequence[bool]) -> list[int] | None:
        """Per node of ``snap.nodes``: how much ``pod``'s preferred terms like it (higher is
        better; 0 where ``candidates`` is false), scored over the candidate nodes as
        kube-scheduler's score plugins do; ``None`` when the pod prefers nothing. Remembered
        until the next :meth:`add`, so ``candidates`` must not change for a pod in between."""
        if not pod.terms.preferring:
            return None
        if pod.key not in self._liking:
            self._liking[pod.key] = self.preferences_on(pod, self._snap.nodes, candidates)
        return self._liking[pod.key]

    def preferences_on(
        self, pod: snapshot.Pod, nodes: Sequence[snapshot.Node], candidates: Sequence[bool]
    ) -> list[int] | None:
        """:meth:`preferences` over any ``nodes`` of the snapshot (not remembered)."""
        t = pod.terms
        if not t.preferring:
            return None
        score = [0] * len(nodes)
        picked = [i for i, ok in enumerate(candidates) if ok]
        if t.preferred_affinity or t.preferred_anti_affinity:
            raw = self._affinity_scores(pod, nodes, picked)
            top, low = max([0, *(raw[i] for i in picked)]), min([0, *(raw[i] for i in picked)])
            if top > low:
                for i in picked:
                    score[i] += 2 * (100 * (raw[i] - low) // (top - low))
        if t.soft_spread:
            for i, value in self._spread_scores(pod, nodes, picked).items():
                score[i] += 2 * value
        return score

    def _affinity_scores(
        self, pod: snapshot.Pod, nodes: Sequence[snapshot.Node], picked: list[int]
    ) -> list[int]:
        """InterPodAffinity's raw score per node (of the pod's own preferred terms)."""
        t = pod.terms
        labels = self._labels
        weighted = [(w, +1) for w in t.preferred_affinity] + [
            (w, -1) for w in t.preferred_anti_affinity
        ]
        raw = [0] * len(nodes)
        for w, sign in weighted:
            term = w.term

            def pairs(q: Placed, term: interpod.AffinityTerm = term) -> list[TopologyPair]:
                at = labels[q.node]
                key = term.topology_key
                if key in at and term.matches(q.namespace, q.labels, self._ns_labels(q.namespace)):
                    return [(key, at[key])]
                return []

            counts = self._pairs(("preferred", term), self._log, pairs)
            if not counts:
                continue
            for i in picked:
                value = nodes[i].labels.get(term.topology_key)
                if value is not None:
                    raw[i] += sign * w.weight * counts.get((term.topology_key, value), 0)
        return raw

    def _spread_scores(
        self, pod: snapshot.Pod, nodes: Sequence[snapshot.Node], picked: list[int]
    ) -> dict[int, int]:
        """PodTopologySpread's normalized score per candidate node (ScheduleAnyway)."""
        soft = pod.terms.soft_spread
        keys = tuple(c.topology_key for c in soft)
        scored = [i for i in picked if all(k in nodes[i].labels for k in keys)]
        raw: dict[int, int] = {}
        per_constraint = []
        for c in soft:
            counts, _ = self._spread(pod, c, keys)
            size = len({nodes[i].labels[c.topology_key] for i in scored})
            if c.topology_key == interpod.HOSTNAME:
                size = len(scored)
            per_constraint.append((c, counts, math.log(size + 2)))
        for i in scored:
            total = 0.0
            for c, counts, weight in per_constraint:
                total += counts.get(nodes[i].labels[c.topology_key], 0) * weight + c.max_skew - 1
            raw[i] = math.floor(total + 0.5)  # Go's math.Round for a non-negative sum
        out = dict.fromkeys(picked, 0)
        if raw:
            top, low = max(raw.values()), min(raw.values())
            for i, s in raw.items():
                out[i] = 100 if top == 0 else 100 * (top + low - s) // top
        return out


class _Check:
    """The counts the filters need for one pod (upstream's PreFilter state).

    The counts come from the tracker's incremental caches (:meth:`Tracker._pairs`,
    :meth:`Tracker._spread`): a check costs the placements made since the last check of a pod
    with the same terms, not every pod placed so far."""

    def __init__(self, tracker: Tracker, pod: snapshot.Pod) -> None:
        t = pod.terms
        self.pod = pod
        ns = pod.namespace
        own_ns = tracker._ns_labels(ns)
        labels = tracker._labels
        own = tuple(sorted(t.labels.items()))

        def existing(q: Placed) -> list[TopologyPair]:
            at = labels[q.node]
            return [
                (term.topology_key, at[term.topology_key])
                for term in q.anti_affinity
                if term.topology_key in at and term.matches(ns, t.labels, own_ns)
            ]

        self.existing = tracker._pairs(("existing", ns, own), tracker._anti, existing)
        self.affinity: Mapping[TopologyPair, int] = {}
        if t.affinity:

            def affine(q: Placed) -> list[TopologyPair]:
                q_ns = tracker._ns_labels(q.namespace)
                if not all(term.matches(q.namespace, q.labels, q_ns) for term in t.affinity):
                    return []
                at = labels[q.node]
                return [
                    (term.topology_key, at[term.topology_key])
                    for term in t.affinity
                    if term.topology_key in at
                ]

            self.affinity = tracker._pairs(("affinity", t.affinity), tracker._log, affine)
        self.anti: list[Mapping[TopologyPair, int]] = []
        for term in t.anti_affinity:

            def anti(q: Placed, term: interpod.AffinityTerm = term) -> list[TopologyPair]:
                at = labels[q.node]
                key = term.topology_key
                if key in at and term.matches(
                    q.namespace, q.labels, tracker._ns_labels(q.namespace)
                ):
                    return [(key, at[key])]
                return []

            self.anti.append(tracker._pairs(("anti", term), tracker._log, anti))
        # Anchors this pod would join: (anchor, topology key, value) it must share.
        self.join: list[tuple[str, str, str]] = []
        for anchor, at in tracker._anchors:
            if all(term.matches(ns, t.labels, own_ns) for term in anchor.terms.affinity):
                for term in anchor.terms.affinity:
                    value = labels[at].get(term.topology_key)
                    if value is not None:
                        self.join.append((anchor.key, term.topology_key, value))
        self.self_affine = bool(t.affinity) and all(
            term.matches(ns, t.labels, own_ns) for term in t.affinity
        )
        # Topology spread: per constraint, matching pods per eligible domain, the minimum, this
        # pod's own count, and the domains it may not join.
        self.spread: list[tuple[Mapping[str, int], int, int, frozenset[str]]] = []
        keys = tuple(c.topology_key for c in t.spread)
        for c in t.spread:
            counts, least = tracker._spread(pod, c, keys)
            self_count = 1 if interpod.selects(c.selector, t.labels) else 0
            full = frozenset(v for v, n in counts.items() if n + self_count - least > c.max_skew)
            self.spread.append((counts, least, self_count, full))

    def refusal(self, node: snapshot.Node) -> str | None:
        t = self.pod.terms
        for c, (counts, least, self_count, full) in zip(t.spread, self.spread, strict=True):
            value = node.labels.get(c.topology_key)
            if value is None:
                return f"topology spread: node has no label {c.topology_key}"
            # (A domain no eligible node makes holds no counted pod: 1 - least <= maxSkew.)
            if value in full:
                return (
                    f"topology spread on {c.topology_key}: {value} would hold "
                    f"{counts.get(value, 0) + self_count} matching pods, the fewest is {least} "
                    f"(maxSkew {c.max_skew})"
                )
        if t.affinity:
            missing = False
            for term in t.affinity:
                value = node.labels.get(term.topology_key)
                if value is None:
                    return f"pod affinity: node has no label {term.topology_key}"
                if self.affinity.get((term.topology_key, value), 0) <= 0:
                    missing = True
            # The first pod of a group with affinity to itself may go anywhere its terms'
            # topology keys exist.
            if missing and not (not self.affinity and self.self_affine):
                return "pod affinity: no pod matching the terms in the node's domain"
        for term, anti in zip(t.anti_affinity, self.anti, strict=True):
            value = node.labels.get(term.topology_key)
            if value is not None and anti.get((term.topology_key, value), 0) > 0:
                return f"pod anti-affinity: a matching pod is in {term.topology_key}={value}"
        if self.existing:
            for key, value in sorted(node.labels.items()):
                if self.existing.get((key, value), 0) > 0:
                    return (
                        f"existing pods' anti-affinity: a pod in {key}={value} keeps this pod out"
                    )
        for anchor, key, value in self.join:
            if node.labels.get(key) != value:
                return (
                    f"pod {anchor}, placed first of its affinity group, needs the pods it "
                    f"selects in {key}={value}"
                )
        return None


def admitted(snap: snapshot.Snapshot, placed: Mapping[str, str]) -> tuple[set[str], dict[str, str]]:
    """Of the pods of ``snap`` placed on nodes (``pod key -> node name``), those the filters
    admit in some binding order, and why each other one is refused.

    Placements are taken in turn whenever one passes given those taken before (kube-scheduler
    retries a refused pod after later bindings), until none does; the pods taken are admitted
    together, each given those before it. Two orders are tried, pods with pod affinity first
    (an anchor before the pods that join it) and last (a pod that spreads before one that
    follows it); the one that admits more is the answer."""
    pods = {p.key: p for p in snap.pods}
    keys = [k for k in pods if k in placed]
    first = _admitted(snap, placed, sorted(keys, key=lambda k: not pods[k].terms.affinity))
    if not first[1]:
        return first
    last = _admitted(snap, placed, sorted(keys, key=lambda k: bool(pods[k].terms.affinity)))
    return last if len(last[0]) > len(first[0]) else first


def _admitted(
    snap: snapshot.Snapshot, placed: Mapping[str, str], left: list[str]
) -> tuple[set[str], dict[str, str]]:
    tracker = Tracker(snap)
    nodes = {n.name: n for n in snap.nodes + snap.outside}
    pods = {p.key: p for p in snap.pods}
    taken: set[str] = set()
    while left:
        later = []
        for key in left:
            pod, node = pods[key], nodes[placed[key]]
            if tracker.refusals_on(pod, [node])[0] is None:
                tracker.add(pod, node.name)
                taken.add(key)
            else:
                later.append(key)
        if len(later) == len(left):
            break
        left = later
    refused = {}
    for key in left:
        reason = tracker.refusals_on(pods[key], [nodes[placed[key]]])[0]
        refused[key] = reason or "refused"
    return taken, refused


def violations(snap: snapshot.Snapshot, placed: Mapping[str, str]) -> list[str]:
    """The placements no binding order lets the filters admit, each with its reason
    (:func:`admitted`)."""
    _, refused = admitted(snap, placed)
    return [f"{key} on {placed[key]}: {why}" for key, why in refused.items()]
