"""The simulator: determinism, conservation, invariants, policies, cluster specs, the bound."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot import errors
from migpilot.mig import layouts
from migpilot.planning import planners, plans, snapshot
from migpilot.sim import bounds, clusters, policies, reports, simulating, traces

SMALL = clusters.parse("h100-80gb:2x4,a100-80gb:1x4")
PARANOID_INFLATE = simulating.Settings(paranoid=True)
PARANOID_FAITHFUL = simulating.Settings(mode=simulating.Replay.FAITHFUL, paranoid=True)


def _policy(name: str, cluster: clusters.Cluster = SMALL) -> policies.Partitioning:
    if name == "static":
        return policies.static(cluster)
    return policies.dynamic(name, cluster)


def _trace(seed: int = 1, pods: int = 60) -> traces.Trace:
    return traces.synthetic("mixed", seed=seed, model=SMALL.reference_model, pods=pods)


def _conserved(result: simulating.Result) -> None:
    states = [o.state for o in result.outcomes]
    assert len(states) == result.pods_total
    bound = sum(s in (simulating.PodState.RUNNING, simulating.PodState.FINISHED) for s in states)
    assert bound == result.pods_scheduled
    assert sum(s is simulating.PodState.REJECTED for s in states) == result.pods_rejected
    for o in result.outcomes:
        if o.state is simulating.PodState.REJECTED:
            assert o.reason and o.bound_at is None
        elif o.state in (simulating.PodState.WAITING, simulating.PodState.RESERVED):
            assert o.reason == "still waiting at the end of the simulation"
        else:
            assert o.bound_at is not None and o.bound_at >= o.arrival and o.node
    assert len(result.pending_s) == result.pods_total - result.pods_rejected
    assert 0.0 <= result.allocation_ratio <= 1.0


@pytest.mark.parametrize("name", ["migpilot", "nos", "hami-template", "hami-placement", "static"])
@pytest.mark.parametrize("paranoid", [PARANOID_INFLATE, PARANOID_FAITHFUL])
def test_every_policy_runs_and_conserves_pods(name: str, paranoid: simulating.Settings) -> None:
    result = simulating.simulate(_trace(), cluster=SMALL, policy=_policy(name), settings=paranoid)
    _conserved(result)
    assert result.policy == name
    if name == "static":
        assert result.reconfigurations == result.planner_calls == 0
    else:
        assert result.pods_scheduled > 0 and result.planner_calls > 0


def test_exact_runs_on_a_small_cluster_only() -> None:
    tiny = clusters.parse("a100-80gb:1x2")
    trace = traces.synthetic("inference", seed=2, model=tiny.reference_model, pods=12)
    result = simulating.simulate(
        trace, cluster=tiny, policy=policies.dynamic("exact", tiny), settings=PARANOID_FAITHFUL
    )
    _conserved(result)
    with pytest.raises(errors.MigpilotError, match="policy exact is for clusters of at most"):
        policies.dynamic("exact", clusters.parse("h100-80gb:8x8"))


def test_same_inputs_give_identical_results() -> None:
    def once() -> list[reports.ResultRow]:
        return [
            reports.row(
                simulating.simulate(_trace(5), cluster=SMALL, policy=_policy(n)), timing=False
            )
            for n in ("migpilot", "nos")
        ]

    assert once() == once()
    first = simulating.simulate(_trace(5), cluster=SMALL, policy=_policy("migpilot"))
    again = simulating.simulate(_trace(5), cluster=SMALL, policy=_policy("migpilot"))
    assert first.outcomes == again.outcomes and first.ratio_over_time == again.ratio_over_time


@settings(max_examples=15, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    name=st.sampled_from(["migpilot", "nos", "hami-template"]),
    window=st.sampled_from([0.0, 0.5, 5.0]),
    scoring=st.sampled_from(list(snapshot.Policy)),
)
def test_invariants_hold_on_random_traces(
    seed: int, name: str, window: float, scoring: snapshot.Policy
) -> None:
    trace = traces.synthetic("mixed", seed=seed, model=SMALL.reference_model, pods=25)
    cfg = simulating.Settings(
        mode=simulating.Replay.FAITHFUL,
        scoring=scoring,
        timing=simulating.Timing(batch_window_s=window, advertise_s=window),
        paranoid=True,
    )
    _conserved(simulating.simulate(trace, cluster=SMALL, policy=_policy(name), settings=cfg))


def test_destroying_a_held_instance_is_an_invariant_violation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cluster = clusters.parse("a100-80gb:1x1")
    trace = traces.parse(
        "name,arrival,duration,requests\na,0,100,mig-1g.10gb=1\nb,5,100,mig-7g.80gb=1\n",
        source="t.csv",
        model=cluster.reference_model,
    )
    policy = policies.Partitioning("reckless", "fast")

    def reckless(snap: snapshot.Snapshot) -> plans.Plan:
        gpu = snap.nodes[0].gpus[0]
        held = next((i for i in gpu.instances if i.used), None)
        if held is None:  # nothing to break yet: plan properly for the first pod
            return planners.run(snap, "fast")
        action = plans.Action(snap.nodes[0].name, 0, plans.Op.DESTROY, held.profile, held.start)
        return plans.Plan("reckless", (), (action,), (), ())

    monkeypatch.setattr(policies.Partitioning, "plan", lambda self, snap: reckless(snap))
    with pytest.raises(simulating.InvariantViolation, match="while a pod holds or reserved it"):
        simulating.simulate(trace, cluster=cluster, policy=policy, settings=PARANOID_FAITHFUL)


def test_inflate_stops_at_the_requested_share() -> None:
    cfg = simulating.Settings(inflate_fraction=0.5)
    submitted = simulating.replayed(_trace(pods=500), cluster=SMALL, settings=cfg)
    slices = [
        sum(SMALL.reference_model.profile_named(r.profile).compute_slices * r.count for r in p.mig)
        for p, _, _ in submitted
    ]
    assert sum(slices) >= 0.5 * SMALL.compute_slices > sum(slices[:-1])
    assert all(d is None for _, _, d in submitted)


def test_inflate_submits_in_trace_order_unless_shuffled() -> None:
    trace = _trace(pods=500)
    plain = simulating.replayed(trace, cluster=SMALL, settings=simulating.Settings())
    names = [p.name for p, _, _ in plain]
    assert names == [p.name for p in trace.pods[: len(names)]]
    shuffled = [
        [p.name for p, _, _ in simulating.replayed(trace, cluster=SMALL, settings=cfg)]
        for cfg in (simulating.Settings(shuffle_seed=3), simulating.Settings(shuffle_seed=3))
    ]
    assert shuffled[0] == shuffled[1] != names[: len(shuffled[0])]


def test_faithful_needs_times() -> None:
    untimed = traces.parse(
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np,1,1,1,1000\n",
        source="m.csv",
        model=SMALL.reference_model,
    )
    with pytest.raises(errors.TraceError, match="m.csv has no arrival and deletion times"):
        simulating.simulate(
            untimed, cluster=SMALL, policy=_policy("static"), settings=PARANOID_FAITHFUL
        )


def test_a_pod_no_node_can_run_is_rejected_with_a_reason() -> None:
    trace = traces.parse(
        "name,arrival,duration,requests\n"
        "big,0,10,mig-7g.80gb=8\nodd,0,10,mig-1g.6gb=1\ncpu,0,10,mig-1g.10gb=1;cpu=1000\n",
        source="t.csv",
        model=SMALL.reference_model,
    )
    result = simulating.simulate(
        trace, cluster=SMALL, policy=_policy("migpilot"), settings=PARANOID_FAITHFUL
    )
    reasons = {o.name: o.reason for o in result.outcomes}
    assert result.pods_rejected == 3
    # The controller's own words (control.never_runs), as its Warning event says them.
    assert reasons["odd"] == (
        "can never run: no GPU in the cluster advertises nvidia.com/mig-1g.6gb (only a30-24gb "
        "offers it)"
    )
    assert reasons["big"] == "can never run: no node's GPUs could hold its instances even empty"
    assert reasons["cpu"] == (
        "can never run: no node that could hold its instances has the CPU and memory it asks for"
    )


@pytest.mark.parametrize("name", ["migpilot", "nos", "hami-template", "hami-placement", "static"])
def test_node_selectors_are_honoured(name: str) -> None:
    h100 = SMALL.groups[0].model.gfd_product_names[0]
    rows = [f"h{i},{i},,mig-1g.10gb=1,nvidia.com/gpu.product={h100}" for i in range(6)]
    rows += [f"n{i},{i},,mig-2g.20gb=1,kubernetes.io/hostname=a100-80gb-00" for i in range(3)]
    rows += ["lost,0,,mig-1g.10gb=1,zone=nowhere"]
    trace = traces.parse(
        "name,arrival,duration,requests,node_selector\n" + "\n".join(rows) + "\n",
        source="sel.csv",
        model=SMALL.reference_model,
    )
    result = simulating.simulate(
        trace, cluster=SMALL, policy=_policy(name), settings=PARANOID_INFLATE
    )
    _conserved(result)
    where = {o.name: o.node for o in result.outcomes}
    reasons = {o.name: o.reason for o in result.outcomes}
    assert all((where[f"h{i}"] or "").startswith("h100-80gb-") for i in range(6) if where[f"h{i}"])
    assert all(where[f"n{i}"] in (None, "a100-80gb-00") for i in range(3))
    assert reasons["lost"] == (
        "can never run: no GPU node admits it (nodeSelector zone=nowhere does not match (node "
        "has missing))"
    )
    if name != "static":  # all-balanced offers 1g and 2g instances: static serves them too
        assert all(where[f"h{i}"] for i in range(6))


def test_requests_no_pod_of_which_ran_are_named() -> None:
    trace = traces.parse(
        "name,arrival,duration,requests\n"
        "a,0,,mig-4g.40gb=1\nb,1,,mig-1g.10gb=1\nc,2,,mig-1g.10gb=2;mig-3g.40gb=1\n"
        "d,3,,mig-7g.80gb=8\n",
        source="k.csv",
        model=SMALL.reference_model,
    )
    whole = policies.fixed("whole", {m.id: layouts.Layout.of([layouts.Instance(0, "7g.80gb")])
                                     for m in (g.model for g in SMALL.groups)})  # fmt: skip
    fixed = simulating.simulate(trace, cluster=SMALL, policy=whole, settings=PARANOID_INFLATE)
    assert fixed.requests_never_served == ("1g.10gb", "2 x 1g.10gb + 3g.40gb", "4g.40gb")
    assert reports.row(fixed)["requests_never_served"] == list(fixed.requests_never_served)
    mine = simulating.simulate(
        trace, cluster=SMALL, policy=_policy("migpilot"), settings=PARANOID_INFLATE
    )
    assert mine.requests_never_served == ()
    assert mine.pods_rejected == 1  # 8 x 7g.80gb fits no 4-GPU node: rejected, not listed
    # A kind no GPU of the cluster can serve counts against no policy.
    assert (
        mine.request_kinds
        == fixed.request_kinds
        == (
            "1g.10gb",
            "2 x 1g.10gb + 3g.40gb",
            "4g.40gb",
        )
    )
    assert mine.serves_every_request and not fixed.serves_every_request


@pytest.mark.parametrize(
    ("mig", "kind"),
    [
        ((("4g.40gb", 1),), "4g.40gb"),
        ((("7g.80gb", 8),), "8 x 7g.80gb"),
        ((("3g.40gb", 1), ("1g.10gb", 2)), "2 x 1g.10gb + 3g.40gb"),
        ((("1g.10gb", 1), ("3g.40gb", 1), ("1g.10gb", 1)), "2 x 1g.10gb + 3g.40gb"),
    ],
)
def test_a_request_kind_is_the_multiset_of_profiles_asked_for(
    mig: tuple[tuple[str, int], ...], kind: str
) -> None:
    assert simulating.request_kind(tuple(snapshot.MigRequest(p, n) for p, n in mig)) == kind


def _kinds_trace() -> traces.Trace:
    # Three kinds the cluster serves (two whole GPUs on one node among them): a static layout
    # of 4g.40gb + 3g.40gb per GPU never runs the 7g.80gb pod; e selects no node.
    return traces.parse(
        "name,arrival,duration,requests,node_selector\n"
        "a,0,,mig-3g.40gb=1,\nb,1,,mig-4g.40gb=1,\nc,2,,mig-7g.80gb=2,\n"
        "d,3,,mig-3g.40gb=1;cpu=1;memory=1Gi,\n"
        "e,4,,mig-1g.10gb=1,zone=nowhere\n",
        source="kinds.csv",
        model=SMALL.reference_model,
    )


def test_serves_every_request_names_the_policy_that_left_a_kind_unserved() -> None:
    trace = _kinds_trace()
    halves = policies.fixed(
        "halves",
        {
            m.id: layouts.Layout.of(
                [layouts.Instance(0, "4g.40gb"), layouts.Instance(4, "3g.40gb")]
            )
            for m in (g.model for g in SMALL.groups)
        },
    )
    fixed = simulating.simulate(trace, cluster=SMALL, policy=halves, settings=PARANOID_INFLATE)
    mine = simulating.simulate(
        trace, cluster=SMALL, policy=_policy("migpilot"), settings=PARANOID_INFLATE
    )
    # e selects no node: rejected, so 1g.10gb is no kind of this run.
    assert fixed.request_kinds == mine.request_kinds == ("2 x 7g.80gb", "3g.40gb", "4g.40gb")
    assert fixed.requests_never_served == ("2 x 7g.80gb",)
    assert not fixed.serves_every_request and mine.serves_every_request
    rows = [reports.row(r, bound=0.5) for r in (mine, fixed)]
    assert [r["serves_every_request"] for r in rows] == [True, False]
    assert rows[1]["share_of_bound"] == round(fixed.allocation_ratio / 0.5, 4)
    assert reports.row(mine)["share_of_bound"] is None


def test_bound_is_above_every_policy_in_inflate_mode() -> None:
    trace = _trace(7, pods=300)
    submitted = [
        p for p, _, _ in simulating.replayed(trace, cluster=SMALL, settings=PARANOID_INFLATE)
    ]
    bound = bounds.inflate_bound(submitted, cluster=SMALL)
    for name in ("migpilot", "nos", "hami-placement", "static"):
        r = simulating.simulate(trace, cluster=SMALL, policy=_policy(name))
        assert r.allocation_ratio <= bound.allocation_ratio + 1e-9
    best_policy, best = simulating.best_static(trace, cluster=SMALL, candidates=3)
    assert best.allocation_ratio <= bound.allocation_ratio + 1e-9
    assert set(best_policy.start) == {"h100-80gb", "a100-80gb"}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("h100-80gb", "is not MODEL:NODESxGPUS"),
        ("h100-80gb:2x", "is not MODEL:NODESxGPUS"),
        ("nosuchgpu:1x1", "cluster: "),
        ("h100-80gb:0x8", "needs at least one node and one GPU"),
        ("h100-80gb:1x8,h100-80gb:1x8", "names a GPU model twice"),
    ],
)
def test_cluster_spec_errors(spec: str, message: str) -> None:
    with pytest.raises(errors.ClusterSpecError, match=message):
        clusters.parse(spec)


def test_cluster_spec() -> None:
    cluster = clusters.parse(clusters.DEFAULT_SPEC)
    assert cluster.gpu_count == 96 and cluster.compute_slices == 96 * 7
    assert cluster.nodes[0].name == "h100-80gb-00" and cluster.nodes[-1].name == "a100-80gb-03"
    assert cluster.nodes[0].allocatable.cpu_milli == 96_000


def test_static_uses_all_balanced_by_default() -> None:
    policy = policies.static(SMALL)
    layout = policy.initial_layout(SMALL.reference_model, 0)
    assert sorted(layout.profile_counts().items()) == [
        ("1g.10gb", 2),
        ("2g.20gb", 1),
        ("3g.40gb", 1),
    ]
    assert layouts.violation(SMALL.reference_model, layout.instances) is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [("static,migpilot", ("migpilot", "static")), ("nos", ("nos",))],
)
def test_policy_names(text: str, expected: tuple[str, ...]) -> None:
    assert policies.parse_names(text) == expected


def test_unknown_policy_name() -> None:
    with pytest.raises(errors.MigpilotError, match="unknown policy 'kai'"):
        policies.parse_names("migpilot,kai")
