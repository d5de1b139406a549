"""Pod anti-affinity, topology spread and pod affinity as constraints of the exact planner's model.

Why it exists: the exact planner counts pods per class and node, and without these constraints
it packs the replicas of a Deployment with hostname anti-affinity onto one node; dropping what
kube-scheduler's filters refuse afterwards (:func:`podaffinity.admitted`, still run as the
safety net) then places one replica of three. Here the filters' rules are stated over the
model's counts, so the solver looks for the best plan among those the filters admit:

* **Required anti-affinity** (any topology key), among the pods of the plan and against bound
  pods: a class with a term may be present in a domain only if the other pods the term matches
  there number none (the class's own pods count when the term matches them, so one per domain).
  This also covers the symmetric rule among pods of the plan. Bound pods that a term matches,
  and bound pods whose own terms match a class, rule the class out of their domains up front
  (:func:`refused`).
* **Topology spread** (``DoNotSchedule``): per constraint, the matching pods per eligible domain
  (bound pods not being deleted, plus the plan's pods), and a variable held at or below each
  domain's count (0 below ``minDomains`` domains); a domain where the class is present may hold
  at most ``maxSkew`` more than it. A final state meeting this can be reached one pod at a time
  (always adding to the emptiest domain still to grow), which is what kube-scheduler sees.
* **Pod affinity**, to bound anchors: when bound pods match all of a class's terms, the class may
  only go where every term's domain holds one. When none does and the class matches its own
  terms (a group with affinity to itself), its pods and the plan's pods that match its terms go
  to one domain per term. Otherwise (an anchor only among the pods of the plan) the class is not
  placed here; the fast planner may still place it.

The rules are also kept as data, so that the warm start can be checked against them
(:meth:`Rules.holds`); a warm start that breaks one is not used.

Pure: the planning modules it builds on and OR-Tools.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from migpilot.planning import interpod, podaffinity, snapshot

NewVar = Callable[[int], cp_model.IntVar]
"""Makes a variable in ``0..upper`` (the builder keeps its hint)."""


def involved(snap: snapshot.Snapshot) -> bool:
    """Whether any rule here can apply: a pod of the plan with terms, or a bound pod with
    required anti-affinity."""
    return any(p.terms.constrained for p in snap.pods) or any(b.anti_affinity for b in snap.bound)


def class_key(pod: snapshot.Pod) -> tuple[object, ...]:
    """What must also be equal for two pods to share a class when :func:`involved`."""
    return (pod.namespace, pod.terms.signature())


@dataclass(frozen=True, slots=True)
class _Count:
    """Pods of one class on one node: the model's count variable."""

    cls: int
    pod: snapshot.Pod
    node: snapshot.Node
    var: cp_model.IntVar
    upper: int


class World:
    """The snapshot's nodes, bound pods and namespace labels, looked up by the rules."""

    def __init__(self, snap: snapshot.Snapshot) -> None:
        self.snap = snap
        self.labels: dict[str, Mapping[str, str]] = {
            n.name: n.labels for n in snap.nodes + snap.outside
        }
        self._ns: dict[str, Mapping[str, str]] = {}

    def ns(self, namespace: str) -> Mapping[str, str]:
        found = self._ns.get(namespace)
        if found is None:
            found = self._ns[namespace] = podaffinity.namespace_labels(self.snap, namespace)
        return found

    def matches(
        self, term: interpod.AffinityTerm, namespace: str, labels: Mapping[str, str]
    ) -> bool:
        return term.matches(namespace, labels, self.ns(namespace))

    def bound_in(self, key: str, value: str) -> list[interpod.BoundPod]:
        return [b for b in self.snap.bound if self.labels.get(b.node, {}).get(key) == value]


def refused(world: World, pod: snapshot.Pod, node: snapshot.Node) -> bool:
    """Whether ``pod`` may not go to ``node`` whatever else the plan does: a topology key of its
    terms missing, a bound pod its anti-affinity matches in the node's domain, a bound pod whose
    anti-affinity matches it there, or (with bound anchors) no anchor in a term's domain."""
    t = pod.terms
    for c in t.spread:
        if c.topology_key not in node.labels:
            return True
    for term in t.affinity:
        if term.topology_key not in node.labels:
            return True
    for term in t.anti_affinity:
        value = node.labels.get(term.topology_key)
        if value is not None and any(
            world.matches(term, b.namespace, b.labels)
            for b in world.bound_in(term.topology_key, value)
        ):
            return True
    for b in world.snap.bound:
        at = world.labels.get(b.node, {})
        for term in b.anti_affinity:
            value = at.get(term.topology_key)
            if (
                value is not None
                and node.labels.get(term.topology_key) == value
                and world.matches(term, pod.namespace, t.labels)
            ):
                return True
    if t.affinity and _anchored(world, pod):
        for term in t.affinity:
            value = node.labels[term.topology_key]
            if not any(_affine(world, pod, b) for b in world.bound_in(term.topology_key, value)):
                return True
    # Without a bound anchor or affinity to itself, its anchor could only be a pod of this
    # plan: not modelled.
    return bool(t.affinity) and not _anchored(world, pod) and not _self_affine(world, pod)


def _affine(world: World, pod: snapshot.Pod, b: interpod.BoundPod) -> bool:
    return all(world.matches(term, b.namespace, b.labels) for term in pod.terms.affinity)


def _anchored(world: World, pod: snapshot.Pod) -> bool:
    return any(_affine(world, pod, b) for b in world.snap.bound)


def _self_affine(world: World, pod: snapshot.Pod) -> bool:
    return all(world.matches(term, pod.namespace, pod.terms.labels) for term in pod.terms.affinity)


@dataclass(frozen=True, slots=True)
class _Sum:
    """A constant plus a sum of count variables."""

    const: int
    vars: tuple[cp_model.IntVar, ...]

    def expr(self) -> cp_model.LinearExpr:
        return cp_model.LinearExpr.sum(list(self.vars)) + self.const

    def value(self, values: Sequence[int]) -> int:
        return self.const + sum(values[v.index] for v in self.vars)


@dataclass(slots=True)
class Rules:
    """The constraints added, as data: each ``(presence, flag, check)`` says that where
    ``presence`` (a class's count in a domain) is positive, ``flag`` is 1 and ``check`` holds."""

    present: list[tuple[_Sum, cp_model.IntVar]] = field(default_factory=list)
    """Presence sums and their indicator."""
    bounded: list[tuple[cp_model.IntVar, _Sum, int]] = field(default_factory=list)
    """Indicator set: the sum is at most the limit."""
    skews: list[tuple[cp_model.IntVar, _Sum, cp_model.IntVar, int]] = field(default_factory=list)
    """Indicator set: the domain's count less the floor is at most maxSkew."""
    floors: list[tuple[cp_model.IntVar, tuple[_Sum, ...], bool]] = field(default_factory=list)
    """A floor variable, the domain counts it stays under, and whether it is held at 0."""
    domains: list[tuple[cp_model.IntVar, ...]] = field(default_factory=list)
    """Indicators of which at most one may be set (one domain per term)."""

    def hint(self, values: list[int]) -> bool:
        """Set the auxiliary variables of ``values`` (a solution whose counts are set) and say
        whether every rule holds there."""
        for presence, flag in self.present:
            values[flag.index] = 1 if presence.value(values) > 0 else 0
        for floor, counts, zero in self.floors:
            values[floor.index] = 0 if zero else min(c.value(values) for c in counts)
        ok = all(values[f.index] == 0 or s.value(values) <= lim for f, s, lim in self.bounded)
        ok = ok and all(
            values[f.index] == 0 or s.value(values) - values[m.index] <= skew
            for f, s, m, skew in self.skews
        )
        return ok and all(sum(values[f.index] for f in group) <= 1 for group in self.domains)


def add(
    model: cp_model.CpModel,
    new_var: NewVar,
    world: World,
    counts: Sequence[tuple[int, snapshot.Pod, snapshot.Node, cp_model.IntVar, int]],
) -> Rules:
    """Add the rules over ``counts`` (class id, its representative pod, node, count, upper)."""
    cs = [_Count(*c) for c in counts]
    rules = Rules()
    reps: dict[int, snapshot.Pod] = {}
    for c in cs:
        reps.setdefault(c.cls, c.pod)
    flags: dict[tuple[int, str, str], cp_model.IntVar] = {}

    def presence(cls: int, key: str, value: str) -> cp_model.IntVar | None:
        """The indicator of ``cls`` being present in domain ``key=value`` (None: it cannot)."""
        found = flags.get((cls, key, value))
        if found is None:
            mine = [c for c in cs if c.cls == cls and c.node.labels.get(key) == value]
            if not mine:
                return None
            found = flags[(cls, key, value)] = new_var(1)
            model.add(sum(c.var for c in mine) <= sum(c.upper for c in mine) * found)
            rules.present.append((_Sum(0, tuple(c.var for c in mine)), found))
        return found

    def values_of(key: str) -> list[str]:
        return sorted({v for c in cs if (v := c.node.labels.get(key)) is not None})

    for cls, pod in reps.items():
        t = pod.terms
        for term in t.anti_affinity:
            key = term.topology_key
            matched = [c for c in cs if world.matches(term, c.pod.namespace, c.pod.terms.labels)]
            own = 1 if world.matches(term, pod.namespace, t.labels) else 0
            for value in values_of(key):
                flag = presence(cls, key, value)
                if flag is None:
                    continue
                there = _Sum(0, tuple(c.var for c in matched if c.node.labels.get(key) == value))
                if not there.vars:
                    continue
                model.add(there.expr() <= own).only_enforce_if(flag)
                rules.bounded.append((flag, there, own))
        keys = tuple(c.topology_key for c in t.spread)
        for sc in t.spread:
            _spread(
                model,
                new_var=new_var,
                world=world,
                rules=rules,
                presence=presence,
                cs=cs,
                cls=cls,
                pod=pod,
                sc=sc,
                keys=keys,
            )
        if t.affinity and not _anchored(world, pod) and _self_affine(world, pod):
            followers = {c.cls for c in cs if _affine_pod(world, pod, c.pod)} | {cls}
            for term in t.affinity:
                key = term.topology_key
                chosen: list[cp_model.IntVar] = []
                for value in values_of(key):
                    here = [
                        f for k in sorted(followers) if (f := presence(k, key, value)) is not None
                    ]
                    if not here:
                        continue
                    z = new_var(1)
                    for f in here:
                        model.add(f <= z)
                    chosen.append(z)
                    rules.present.append((_Sum(0, tuple(here)), z))
                if len(chosen) > 1:
                    model.add(sum(chosen) <= 1)
                    rules.domains.append(tuple(chosen))
    return rules


def _affine_pod(world: World, pod: snapshot.Pod, other: snapshot.Pod) -> bool:
    return all(
        world.matches(term, other.namespace, other.terms.labels) for term in pod.terms.affinity
    )


def _spread(
    model: cp_model.CpModel,
    *,
    new_var: NewVar,
    world: World,
    rules: Rules,
    presence: Callable[[int, str, str], cp_model.IntVar | None],
    cs: Sequence[_Count],
    cls: int,
    pod: snapshot.Pod,
    sc: interpod.SpreadConstraint,
    keys: tuple[str, ...],
) -> None:
    """One topology spread constraint of class ``cls``."""
    key = sc.topology_key
    snap = world.snap
    eligible = {
        n.name: n.labels[key]
        for n in snap.nodes + snap.outside
        if all(k in n.labels for k in keys) and podaffinity.included(sc, pod, n)
    }
    domains = sorted(set(eligible.values()))
    if not domains:
        return
    sel = sc.selector
    counting = sel is not None and bool(sel.requirements)
    bound = dict.fromkeys(domains, 0)
    if counting and sel is not None:
        for b in snap.bound:
            value = eligible.get(b.node)
            if (
                value is not None
                and not b.terminating
                and b.namespace == pod.namespace
                and sel.matches(b.labels)
            ):
                bound[value] += 1
    totals: dict[str, _Sum] = {}
    for value in domains:
        mine = (
            tuple(
                c.var
                for c in cs
                if eligible.get(c.node.name) == value
                and c.pod.namespace == pod.namespace
                and interpod.selects(sel, c.pod.terms.labels)
            )
            if counting
            else ()
        )
        totals[value] = _Sum(bound[value], mine)
    zero = len(domains) < sc.min_domains
    most = sum(t.const for t in totals.values()) + sum(c.upper for c in cs)
    floor = new_var(0 if zero else most)
    if not zero:
        for total in totals.values():
            model.add(floor <= total.expr())
    rules.floors.append((floor, tuple(totals.values()), zero))
    for value in domains:
        flag = presence(cls, key, value)
        if flag is None:
            continue
        total = totals[value]
        model.add(total.expr() - floor <= sc.max_skew).only_enforce_if(flag)
        rules.skews.append((flag, total, floor, sc.max_skew))
