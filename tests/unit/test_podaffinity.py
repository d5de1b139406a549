"""kube-scheduler's InterPodAffinity and PodTopologySpread filters (planning/podaffinity.py):
one test per rule, and a property test against a plain re-reading of the upstream rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from hypothesis import given
from hypothesis import strategies as st

from migpilot.planning import constraints, interpod, podaffinity, snapshot

HOST = interpod.HOSTNAME
REQ = snapshot.pod_requests({"nvidia.com/mig-1g.10gb": 1}, where="test")


def node(name: str, zone: str | None = "a", **extra: str) -> snapshot.Node:
    labels = {HOST: name} | ({"zone": zone} if zone else {}) | extra
    return snapshot.Node(name, MappingProxyType(labels), (), False, None, ())


def sel(**labels: str) -> interpod.Selector:
    return interpod.Selector(
        tuple(interpod.LabelRequirement(k, "In", frozenset({v})) for k, v in labels.items())
    )


def term(key: str = HOST, ns: str = "default", **labels: str) -> interpod.AffinityTerm:
    return interpod.AffinityTerm(sel(**labels), frozenset({ns}), None, key)


def pod(
    name: str = "p",
    *,
    labels: Mapping[str, str] | None = None,
    affinity: Sequence[interpod.AffinityTerm] = (),
    anti: Sequence[interpod.AffinityTerm] = (),
    spread: Sequence[interpod.SpreadConstraint] = (),
    namespace: str = "default",
    node_selector: Mapping[str, str] | None = None,
) -> snapshot.Pod:
    return snapshot.planned_pod(
        name=name,
        namespace=namespace,
        requests=REQ,
        node_selector=node_selector,
        terms=interpod.PodTerms(
            labels=MappingProxyType(dict(labels or {})),
            affinity=tuple(affinity),
            anti_affinity=tuple(anti),
            spread=tuple(spread),
        ),
    )


def bound(name: str, at: str, namespace: str = "default", **labels: str) -> interpod.BoundPod:
    return interpod.BoundPod(name, namespace, at, MappingProxyType(labels))


def verdicts(
    nodes: Sequence[snapshot.Node], p: snapshot.Pod, placed: Sequence[interpod.BoundPod] = ()
) -> list[str | None]:
    snap = snapshot.Snapshot(nodes=tuple(nodes), pods=(p,), bound=tuple(placed))
    return podaffinity.Tracker(snap).refusals(p)


NODES = [node("n0", "a"), node("n1", "a"), node("n2", "b")]


def test_no_terms_no_refusal() -> None:
    assert verdicts(NODES, pod(), [bound("x", "n0", app="web")]) == [None, None, None]


def test_hostname_anti_affinity_keeps_replicas_apart() -> None:
    p = pod(labels={"app": "web"}, anti=[term(app="web")])
    got = verdicts(NODES, p, [bound("r0", "n0", app="web")])
    assert got[0] is not None and "anti-affinity" in got[0]
    assert got[1:] == [None, None]


def test_anti_affinity_only_in_its_namespace() -> None:
    p = pod(labels={"app": "web"}, anti=[term(app="web")])
    assert verdicts(NODES, p, [bound("r0", "n0", "other", app="web")]) == [None] * 3


def test_zone_anti_affinity_covers_the_zone() -> None:
    p = pod(anti=[term("zone", app="db")])
    got = verdicts(NODES, p, [bound("d", "n1", app="db")])
    assert [g is None for g in got] == [False, False, True]


def test_affinity_follows_the_anchor() -> None:
    p = pod(affinity=[term(app="db")])
    got = verdicts(NODES, p, [bound("d", "n1", app="db")])
    assert [g is None for g in got] == [False, True, False]


def test_affinity_without_anchor_refuses_everywhere() -> None:
    got = verdicts(NODES, pod(affinity=[term(app="db")]), [bound("x", "n1", app="web")])
    assert all(g is not None and "pod affinity" in g for g in got)


def test_first_pod_of_a_self_affine_group_goes_anywhere() -> None:
    p = pod(labels={"app": "db"}, affinity=[term("zone", app="db")])
    assert verdicts(NODES, p) == [None, None, None]
    # ... but not where its topology key is missing
    assert verdicts([node("bare", None)], p)[0] == "pod affinity: node has no label zone"


def test_affinity_needs_one_pod_matching_every_term() -> None:
    p = pod(affinity=[term(app="db"), term("zone", tier="x")])
    placed = [bound("d", "n0", app="db"), bound("t", "n0", tier="x")]
    assert all(g is not None for g in verdicts(NODES, p, placed))
    placed = [bound("d", "n0", app="db", tier="x")]
    assert [g is None for g in verdicts(NODES, p, placed)] == [True, False, False]


def test_existing_anti_affinity_is_symmetric() -> None:
    anchor = interpod.BoundPod(
        "d", "default", "n2", MappingProxyType({"app": "db"}), (term("zone", app="web"),)
    )
    got = verdicts(NODES, pod(labels={"app": "web"}), [anchor])
    assert [g is None for g in got] == [True, True, False]
    assert got[2] is not None and "existing pods' anti-affinity" in got[2]
    assert verdicts(NODES, pod(labels={"app": "api"}), [anchor]) == [None] * 3


def test_namespace_selector_reads_namespace_labels() -> None:
    t = interpod.AffinityTerm(sel(app="db"), frozenset(), sel(tier="gold"), HOST)
    snap = snapshot.Snapshot(
        nodes=tuple(NODES),
        pods=(),
        bound=(bound("d", "n0", "gold-ns", app="db"), bound("e", "n1", "plain", app="db")),
        namespaces=MappingProxyType({"gold-ns": MappingProxyType({"tier": "gold"})}),
    )
    got = podaffinity.Tracker(snap).refusals(pod(anti=[t]))
    assert [g is None for g in got] == [False, True, True]


def spread(
    key: str = "zone", skew: int = 1, *, min_domains: int = 1, honor_affinity: bool = True
) -> interpod.SpreadConstraint:
    return interpod.SpreadConstraint(
        skew, key, sel(app="web"), min_domains=min_domains, honor_node_affinity=honor_affinity
    )


def test_zone_spread_max_skew_one() -> None:
    p = pod(labels={"app": "web"}, spread=[spread()])
    placed = [bound("w0", "n0", app="web")]
    got = verdicts(NODES, p, placed)
    assert [g is None for g in got] == [False, False, True]
    assert got[0] is not None and "topology spread on zone" in got[0]
    placed.append(bound("w1", "n2", app="web"))
    assert verdicts(NODES, p, placed) == [None, None, None]


def test_spread_needs_the_key() -> None:
    p = pod(labels={"app": "web"}, spread=[spread()])
    assert verdicts([node("bare", None)], p)[0] == "topology spread: node has no label zone"


def test_spread_min_domains_counts_missing_domains_as_zero() -> None:
    p = pod(labels={"app": "web"}, spread=[spread(min_domains=3)])
    placed = [bound("w0", "n0", app="web"), bound("w1", "n2", app="web")]
    # two domains, fewer than three: the minimum is 0, so every domain holding one is full
    assert all(g is not None for g in verdicts(NODES, p, placed))


def test_spread_honours_node_affinity_by_default() -> None:
    # The pod may only go to zone a: zone b is no domain, so zone a alone is balanced.
    placed = [bound("w0", "n0", app="web")]
    honoured = pod(labels={"app": "web"}, spread=[spread()], node_selector={"zone": "a"})
    assert verdicts(NODES, honoured, placed)[1] is None
    ignored = pod(
        labels={"app": "web"}, spread=[spread(honor_affinity=False)], node_selector={"zone": "a"}
    )
    assert verdicts(NODES, ignored, placed)[1] is not None


def test_spread_counts_pods_the_plan_placed() -> None:
    snap = snapshot.Snapshot(nodes=tuple(NODES), pods=())
    tracker = podaffinity.Tracker(snap)
    p = pod(labels={"app": "web"}, spread=[spread()])
    assert tracker.refusals(p) == [None, None, None]
    tracker.add(pod("w0", labels={"app": "web"}), "n2")
    assert [g is None for g in tracker.refusals(p)] == [True, True, False]
    twin = tracker.fork()
    twin.add(pod("w1", labels={"app": "web"}), "n0")
    assert twin.refusals(p) == [None, None, None]
    assert tracker.refusals(p)[2] is not None  # the fork left the original alone


def test_spread_with_an_empty_selector_counts_no_existing_pod() -> None:
    # Upstream (podtopologyspread/common.go countPodsMatchSelector) returns 0 for an empty
    # selector, while the incoming pod still matches it: skew is always 1, never refused.
    everything = interpod.SpreadConstraint(1, "zone", interpod.Selector())
    p = pod(labels={"app": "web"}, spread=[everything])
    placed = [bound("w0", "n0", app="web"), bound("w1", "n1", app="web")]
    assert verdicts(NODES, p, placed) == [None, None, None]


def test_spread_skips_terminating_pods_but_affinity_counts_them() -> None:
    # countPodsMatchSelector bypasses pods with a deletionTimestamp; InterPodAffinity does not.
    going = dataclasses.replace(bound("w0", "n0", app="web"), terminating=True)
    spreader = pod(labels={"app": "web"}, spread=[spread()])
    assert verdicts(NODES, spreader, [going]) == [None, None, None]
    loner = pod(labels={"app": "web"}, anti=[term(app="web")])
    assert verdicts(NODES, loner, [going])[0] is not None
    follower = pod(affinity=[term(app="web")])
    assert [g is None for g in verdicts(NODES, follower, [going])] == [True, False, False]
    keeper = dataclasses.replace(going, anti_affinity=(term(app="web"),))
    assert verdicts(NODES, pod(labels={"app": "web"}), [keeper])[0] is not None


def test_pods_without_terms_are_involved_only_when_selected() -> None:
    # Planners skip the filters for pods not involved: that must never skip a refusal.
    tracker = podaffinity.Tracker(snapshot.Snapshot(nodes=tuple(NODES), pods=()))
    plain, web = pod("x", labels={"app": "db"}), pod("y", labels={"app": "web"})
    assert not tracker.involved(plain) and not tracker.involved(web)
    tracker.add(pod("r0", labels={"app": "web"}, anti=[term(app="web")]), "n0")
    assert not tracker.involved(plain)
    assert tracker.involved(web) and tracker.refusals(web)[0] is not None
    twin = tracker.fork()
    twin.add(pod("r1", labels={"app": "db"}, anti=[term(app="db")]), "n1")
    assert twin.involved(plain) and twin.refusals(plain)[1] is not None
    assert not tracker.involved(plain)  # the fork left the original alone
    anchor = pod("a", labels={"app": "db"}, affinity=[term(app="db")])
    tracker.add(anchor, "n2")  # placed by the first-pod exception: db pods must join it
    assert tracker.involved(plain)
    assert [g is None for g in tracker.refusals(plain)] == [False, False, True]


def test_violations_accept_any_order_kube_scheduler_could_bind_in() -> None:
    pods = tuple(pod(f"w{i}", labels={"app": "web"}, spread=[spread()]) for i in range(3))
    snap = snapshot.Snapshot(nodes=tuple(NODES), pods=pods)
    # w0, w1 both in zone a is fine once w2 is in zone b: some order binds all three.
    assert (
        podaffinity.violations(snap, {"default/w0": "n0", "default/w1": "n1", "default/w2": "n2"})
        == []
    )
    bad = podaffinity.violations(snap, {"default/w0": "n0", "default/w1": "n1", "default/w2": "n0"})
    assert len(bad) == 2 and all("topology spread" in b for b in bad)  # 3 in zone a, 0 in b


# --------------------------------------------------------------------------- the property


def _ns_labels(snap: snapshot.Snapshot, ns: str) -> dict[str, str]:
    return {**snap.namespaces.get(ns, {}), "kubernetes.io/metadata.name": ns}


def _term_matches(
    snap: snapshot.Snapshot, t: interpod.AffinityTerm, ns: str, labels: Mapping[str, str]
) -> bool:
    scope = ns in t.namespaces or (
        t.namespace_selector is not None and t.namespace_selector.matches(_ns_labels(snap, ns))
    )
    return scope and t.selector is not None and t.selector.matches(labels)


def reference(
    snap: snapshot.Snapshot, placed: Sequence[interpod.BoundPod], p: snapshot.Pod, n: snapshot.Node
) -> bool:
    """Upstream's filters, read plainly: a loop over every pod for every question."""
    every = snap.nodes + snap.outside
    at = {x.name: x for x in every}
    terms = p.terms
    for c in terms.spread:
        if c.topology_key not in n.labels:
            return False
        domains: dict[str, int] = {}
        for m in every:
            if any(d.topology_key not in m.labels for d in terms.spread):
                continue
            if c.honor_node_affinity and not (
                all(m.labels.get(k) == v for k, v in p.node_selector.items())
                and constraints.affinity_matches(p.affinity, m.labels, name=m.name)
            ):
                continue
            if c.honor_node_taints and not all(
                t.effect == "PreferNoSchedule"
                or any(constraints.tolerates(tol, t) for tol in p.tolerations)
                for t in m.taints
            ):
                continue
            value = m.labels[c.topology_key]
            # countPodsMatchSelector: nothing for an empty selector; terminating pods skipped.
            domains[value] = domains.get(value, 0) + len(
                [
                    q
                    for q in placed
                    if q.node == m.name
                    and not q.terminating
                    and q.namespace == p.namespace
                    and c.selector is not None
                    and c.selector.requirements
                    and c.selector.matches(q.labels)
                ]
            )
        least = min(domains.values()) if len(domains) >= c.min_domains else 0
        mine = 1 if interpod.selects(c.selector, terms.labels) else 0
        if domains.get(n.labels[c.topology_key], 0) + mine - least > c.max_skew:
            return False
    if terms.affinity:
        if any(t.topology_key not in n.labels for t in terms.affinity):
            return False

        def all_match(ns: str, labels: Mapping[str, str]) -> bool:
            return all(_term_matches(snap, t, ns, labels) for t in terms.affinity)

        satisfied = all(
            any(
                all_match(q.namespace, q.labels)
                and at[q.node].labels.get(t.topology_key) == n.labels[t.topology_key]
                for q in placed
            )
            for t in terms.affinity
        )
        nobody = not any(
            all_match(q.namespace, q.labels)
            and any(t.topology_key in at[q.node].labels for t in terms.affinity)
            for q in placed
        )
        if not satisfied and not (nobody and all_match(p.namespace, terms.labels)):
            return False
    for t in terms.anti_affinity:
        if t.topology_key in n.labels and any(
            _term_matches(snap, t, q.namespace, q.labels)
            and at[q.node].labels.get(t.topology_key) == n.labels[t.topology_key]
            for q in placed
        ):
            return False
    for q in placed:
        for t in q.anti_affinity:
            home = at[q.node].labels.get(t.topology_key)
            if (
                home is not None
                and n.labels.get(t.topology_key) == home
                and _term_matches(snap, t, p.namespace, terms.labels)
            ):
                return False
    return True


KEYS = [HOST, "zone", "rack"]
APPS = ["web", "db"]
NAMESPACES = ["default", "team"]


@st.composite
def selectors(draw: st.DrawFn) -> interpod.Selector | None:
    if draw(st.integers(0, 9)) == 0:
        return None
    reqs = []
    for _ in range(draw(st.integers(0, 2))):
        key = draw(st.sampled_from(["app", "tier"]))
        op = draw(st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]))
        values = frozenset(draw(st.sets(st.sampled_from([*APPS, "x"]), min_size=1, max_size=2)))
        reqs.append(
            interpod.LabelRequirement(key, op, values if op in ("In", "NotIn") else frozenset())
        )
    return interpod.Selector(tuple(reqs))


@st.composite
def terms(draw: st.DrawFn) -> interpod.AffinityTerm:
    names = frozenset(draw(st.sets(st.sampled_from(NAMESPACES), max_size=2)))
    ns_sel = draw(st.none() | st.just(sel(tier="gold")) | st.just(interpod.Selector()))
    if not names and ns_sel is None:
        names = frozenset({"default"})
    return interpod.AffinityTerm(draw(selectors()), names, ns_sel, draw(st.sampled_from(KEYS)))


labels_st = st.dictionaries(
    st.sampled_from(["app", "tier"]), st.sampled_from([*APPS, "x"]), max_size=2
)


@st.composite
def worlds(
    draw: st.DrawFn,
) -> tuple[snapshot.Snapshot, list[interpod.BoundPod], snapshot.Pod, int]:
    count = draw(st.integers(1, 5))
    nodes = []
    for i in range(count):
        labels = {HOST: f"n{i}"}
        for key, choices in (("zone", ["a", "b", "c"]), ("rack", ["r1", "r2"])):
            value = draw(st.none() | st.sampled_from(choices))
            if value is not None:
                labels[key] = value
        taints = draw(st.sampled_from([(), (snapshot.Taint("dedicated", "gpu", "NoSchedule"),)]))
        nodes.append(snapshot.Node(f"n{i}", MappingProxyType(labels), taints, False, None, ()))
    placed = []
    for j in range(draw(st.integers(0, 7))):
        anti = tuple(draw(st.lists(terms(), max_size=1))) if draw(st.booleans()) else ()
        placed.append(
            interpod.BoundPod(
                f"q{j}",
                draw(st.sampled_from(NAMESPACES)),
                f"n{draw(st.integers(0, count - 1))}",
                MappingProxyType(draw(labels_st)),
                anti,
                terminating=draw(st.integers(0, 4)) == 0,
            )
        )
    spreads = [
        interpod.SpreadConstraint(
            draw(st.integers(1, 2)),
            draw(st.sampled_from(KEYS)),
            draw(selectors()),
            min_domains=draw(st.integers(1, 4)),
            honor_node_affinity=draw(st.booleans()),
            honor_node_taints=draw(st.booleans()),
        )
        for _ in range(draw(st.integers(0, 2)))
    ]
    p = snapshot.planned_pod(
        name="p",
        namespace=draw(st.sampled_from(NAMESPACES)),
        requests=REQ,
        node_selector=draw(st.sampled_from([{}, {"zone": "a"}])),
        terms=interpod.PodTerms(
            labels=MappingProxyType(draw(labels_st)),
            affinity=tuple(draw(st.lists(terms(), max_size=2))),
            anti_affinity=tuple(draw(st.lists(terms(), max_size=2))),
            spread=tuple(spreads),
        ),
    )
    snap = snapshot.Snapshot(
        nodes=tuple(nodes),
        pods=(p,),
        namespaces=MappingProxyType({"team": MappingProxyType({"tier": "gold"})}),
    )
    # Some of the placed pods are bound, the rest placed by the plan (both must count alike).
    split = draw(st.integers(0, len(placed)))
    return snap, placed, p, split


@given(worlds())
def test_filter_agrees_with_the_plain_reading(
    world: tuple[snapshot.Snapshot, list[interpod.BoundPod], snapshot.Pod, int],
) -> None:
    snap, placed, p, split = world
    bound_now = snapshot.Snapshot(
        nodes=snap.nodes, pods=snap.pods, bound=tuple(placed[:split]), namespaces=snap.namespaces
    )
    tracker = podaffinity.Tracker(bound_now)
    # (A pod the plan places is never terminating: only bound pods may be.)
    placed = [
        dataclasses.replace(q, terminating=False) if i >= split else q for i, q in enumerate(placed)
    ]
    for q in placed[split:]:
        tracker.refusals(p)  # counts cached before each placement are brought up to date
        tracker.add(
            snapshot.planned_pod(
                name=q.name,
                namespace=q.namespace,
                requests=REQ,
                terms=interpod.PodTerms(labels=q.labels, anti_affinity=q.anti_affinity),
            ),
            q.node,
        )
    got = tracker.refusals(p)
    want = [reference(snap, placed, p, n) for n in snap.nodes]
    assert [g is None for g in got] == want, got


@st.composite
def spread_worlds(draw: st.DrawFn) -> tuple[snapshot.Snapshot, list[interpod.BoundPod], int]:
    """Worlds where topology spread alone decides: two or three hard constraints on different
    keys, nodes lacking some of those keys, and pods the selector matches. The broad
    :func:`worlds` rarely draws them; they are what tells "a node is a domain only if it
    carries *every* constraint's key" from "... its own constraint's key"."""
    count = draw(st.integers(2, 6))
    nodes = []
    for i in range(count):
        labels = {HOST: f"n{i}"}
        for key, choices in (("zone", ["a", "b", "c"]), ("rack", ["r1", "r2"])):
            value = draw(st.none() | st.sampled_from(choices))
            if value is not None:
                labels[key] = value
        nodes.append(snapshot.Node(f"n{i}", MappingProxyType(labels), (), False, None, ()))
    placed = [
        interpod.BoundPod(
            f"q{j}",
            "default",
            f"n{draw(st.integers(0, count - 1))}",
            MappingProxyType({"app": draw(st.sampled_from(["web", "web", "db"]))}),
        )
        for j in range(draw(st.integers(0, 8)))
    ]
    keys = draw(st.permutations(KEYS))[: draw(st.integers(2, 3))]
    p = pod(
        labels={"app": "web"},
        spread=[
            interpod.SpreadConstraint(
                draw(st.integers(1, 2)), key, sel(app="web"), min_domains=draw(st.integers(1, 2))
            )
            for key in keys
        ],
    )
    snap = snapshot.Snapshot(nodes=tuple(nodes), pods=(p,))
    return snap, placed, draw(st.integers(0, len(placed)))


@given(spread_worlds())
def test_spread_domains_need_every_constraints_key(
    world: tuple[snapshot.Snapshot, list[interpod.BoundPod], int],
) -> None:
    snap, placed, split = world
    (p,) = snap.pods
    tracker = podaffinity.Tracker(
        snapshot.Snapshot(nodes=snap.nodes, pods=snap.pods, bound=tuple(placed[:split]))
    )
    for q in placed[split:]:
        tracker.refusals(p)  # counts cached before each placement are brought up to date
        tracker.add(pod(q.name, labels=q.labels), q.node)
    got = tracker.refusals(p)
    assert [g is None for g in got] == [reference(snap, placed, p, n) for n in snap.nodes], got
