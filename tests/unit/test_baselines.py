"""The re-implemented baselines (nos, HAMi <= 2.9 templates, HAMi 2.10 placement, static).

Each system's characteristic behaviour and weakness from ``shared/design/ANCHORS.md`` is shown on
a hand-made snapshot, and every plan any baseline makes, on those and on random small clusters,
passes the independent validator.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.mig import catalog, layouts
from migpilot.planning import baselines, options, plans, snapshot, validation

Planner = Callable[[snapshot.Snapshot, options.Options], plans.Plan]
BASELINES: dict[str, Planner] = {
    "nos": baselines.nos,
    "hami-template": baselines.hami_template,
    "hami-placement": baselines.hami_placement,
    "static": baselines.static,
}


def gpu(model: str, *instances: str) -> dict[str, Any]:
    """A GPU document; instances as ``profile@start``, with a trailing ``*`` when in use."""
    out = []
    for text in instances:
        used = text.endswith("*")
        profile, start = text.rstrip("*").split("@")
        out.append({"profile": profile, "start": int(start), "used": used})
    return {"model": model, "instances": out}


def node(name: str, *gpus: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"name": name, "gpus": list(gpus), **extra}


def pod(name: str, *requests: str, **extra: Any) -> dict[str, Any]:
    """A pod document; requests as ``profile`` or ``profile*count``."""
    reqs: dict[str, Any] = {}
    for r in requests:
        profile, _, count = r.partition("*")
        reqs[snapshot.resource_name(profile)] = int(count or 1)
    return {"name": name, "requests": reqs, **extra}


def make(
    nodes: list[dict[str, Any]], pods: list[dict[str, Any]], **extra: Any
) -> snapshot.Snapshot:
    return snapshot.parse({"version": 1, "nodes": nodes, "pods": pods, **extra})


def run(name: str, snap: snapshot.Snapshot, *, explain: bool = False) -> plans.Plan:
    """Plan with a baseline, check the plan independently and that it is deterministic."""
    plan = BASELINES[name](snap, options.Options(explain=explain))
    assert plan.planner == name
    assert validation.problems(snap, plan) == []
    assert BASELINES[name](snap, options.Options(explain=explain)) == plan
    return plan


def layout_of(plan: plans.Plan, node_name: str, index: int = 0) -> str:
    return next(str(g.layout) for g in plan.gpus if g.node == node_name and g.gpu == index)


def placed(plan: plans.Plan) -> dict[str, list[str]]:
    """Pod name -> its instances as ``gpu:profile@start``."""
    return {
        p.pod.split("/")[1]: [f"{i.gpu}:{i.profile}@{i.start}" for i in p.instances]
        for p in plan.placements
    }


def snap_nodes(snap: snapshot.Snapshot) -> list[dict[str, Any]]:
    return list(snapshot.to_document(snap)["nodes"])


def reason(plan: plans.Plan, pod_name: str) -> str:
    return next(u.reason for u in plan.unschedulable if u.pod == f"default/{pod_name}")


# --------------------------------------------------------------------------- static


def test_static_binds_free_instances_and_never_reconfigures() -> None:
    snap = make(
        [
            node("a", gpu("a100-40gb", "3g.20gb@0*", "1g.5gb@4", "1g.5gb@5")),
            node("b", gpu("a100-40gb")),
        ],
        [pod("small", "1g.5gb*2"), pod("big", "3g.20gb"), pod("other", "1g.5gb")],
    )
    plan = run("static", snap)
    assert plan.actions == ()
    assert placed(plan) == {"small": ["0:1g.5gb@4", "0:1g.5gb@5"]}
    # An empty GPU next door does not help: static never creates an instance.
    assert {u.pod for u in plan.unschedulable} == {"default/big", "default/other"}


def test_static_takes_nodes_in_name_order_and_respects_constraints() -> None:
    snap = make(
        [
            node("c", gpu("h100-80gb", "1g.10gb@0")),
            node("a", gpu("h100-80gb", "1g.10gb@0"), allocatable={"cpu": "1"}),
            node("b", gpu("h100-80gb", "1g.10gb@0"), labels={"zone": "x"}),
        ],
        [
            pod("picky", "1g.10gb", nodeSelector={"zone": "y"}),
            pod("hungry", "1g.10gb", requests={"nvidia.com/mig-1g.10gb": 1, "cpu": "2"}),
            pod("plain", "1g.10gb"),
        ],
    )
    plan = run("static", snap)
    where = {p.pod.split("/")[1]: p.node for p in plan.placements}
    # hungry skips a (1 CPU) and takes b; plain then takes a, the first by name.
    assert where == {"hungry": "b", "plain": "a"}
    assert "nodeSelector" in reason(plan, "picky")


def test_priority_goes_first_in_every_baseline() -> None:
    snap = make(
        [node("a", gpu("a100-80gb", "3g.40gb@0*", "3g.40gb@4"))],
        [pod("low", "3g.40gb"), pod("high", "3g.40gb", priority=10)],
    )
    for name in BASELINES:
        assert set(placed(run(name, snap))) == {"high"}, name


# --------------------------------------------------------------------------- nos


def test_nos_ships_a30_and_a100_tables_and_falls_back_to_maximal_layouts() -> None:
    a100 = catalog.resolve_gpu("a100-40gb")
    table = baselines.nos_geometries(a100)
    assert len(table) == 12
    assert table[0] == {"1g.5gb": 7} and table[-1] == {"7g.40gb": 1}
    # nos's own typos are kept: 3g.20gb on the 80 GB card, 7g.79gb for its whole GPU.
    a100_80 = baselines.nos_geometries(catalog.resolve_gpu("a100-80gb"))
    assert {"2g.20gb": 2, "3g.20gb": 1} in a100_80 and {"7g.79gb": 1} in a100_80
    h100 = catalog.resolve_gpu("h100-80gb")
    fallback = baselines.nos_geometries(h100)
    assert {"7g.80gb": 1} in fallback and {"3g.40gb": 2} in fallback
    assert all("+" not in name for g in fallback for name in g)
    for g in fallback:  # each is the multiset of a real maximal layout
        layouts.place(h100, list(Counter(g).elements()))


def test_nos_geometry_chosen_without_placement_is_not_creatable() -> None:
    # A 1g in use at slot 3 blocks the only 4g placement (slots 0-3). nos's scoring keeps the
    # used 1g and provides the lacking 4g with {3 x 1g, 4g} (first of two tied geometries); its
    # agent deletes every free instance, then cannot create the set: the GPU ends up with only
    # the instance in use.
    snap = make(
        [node("a", gpu("a100-40gb", "1g.5gb@3*", "2g.10gb@4", "1g.5gb@6"))],
        [pod("big", "4g.20gb")],
    )
    plan = run("nos", snap)
    assert layout_of(plan, "a") == "1g.5gb@3"
    assert [(a.op.value, a.profile, a.start) for a in plan.actions] == [
        ("destroy", "2g.10gb", 4),
        ("destroy", "1g.5gb", 6),
    ]
    assert plan.placements == ()
    assert "nos chose 3 x 1g.5gb + 4g.20gb for a/gpu0" in reason(plan, "big")
    assert "cannot be created" in reason(plan, "big")


def test_nos_reconfigures_for_lacking_profiles_and_binds_afterwards() -> None:
    snap = make(
        [node("a", gpu("a100-40gb", "7g.40gb@0")), node("b", gpu("a100-40gb", "1g.5gb@0*"))],
        [pod("p1", "2g.10gb"), pod("p2", "2g.10gb"), pod("p3", "1g.5gb")],
    )
    plan = run("nos", snap)
    # Node a (first by name) gets the first geometry giving the most lacking profiles (3: two
    # 2g and one 1g), 3 x 1g + 2 x 2g; its free 7g is destroyed without a second thought.
    layout = next(g.layout for g in plan.gpus if g.node == "a")
    assert layout.profile_counts() == {"1g.5gb": 3, "2g.10gb": 2}
    assert set(placed(plan)) == {"p1", "p2", "p3"}
    assert all(p.node == "a" for p in plan.placements)


def test_nos_only_plans_for_pods_the_scheduler_left_pending() -> None:
    # kube-scheduler binds p1 to a free 1g first; nos then partitions for p2 around it (the
    # bound instance counts as used and survives), re-creating the other free 1g.
    snap = make(
        [node("a", gpu("a100-40gb", "1g.5gb@0", "1g.5gb@1"))],
        [pod("p1", "1g.5gb"), pod("p2", "3g.20gb")],
    )
    plan = run("nos", snap)
    assert placed(plan)["p1"] == ["0:1g.5gb@0"]
    assert [
        i.profile for i in next(p for p in plan.placements if p.pod == "default/p2").instances
    ] == ["3g.20gb"]
    assert "1g.5gb@0" in layout_of(plan, "a")


def test_nos_cannot_create_the_whole_a100_80gb() -> None:
    # nos's table calls the whole A100-80GB 7g.79gb; the pod asks what the plugin advertises.
    snap = make([node("a", gpu("a100-80gb"))], [pod("whole", "7g.80gb")])
    assert run("nos", snap).placements == ()
    assert set(placed(run("hami-placement", snap))) == {"whole"}


def test_nos_judges_lacking_profiles_cluster_wide() -> None:
    # The only free 1g.10gb is on a node the pod cannot use, yet it makes the pod "not
    # lacking" for nos, which then changes nothing, though node a is empty.
    snap = make(
        [
            node("a", gpu("a100-80gb")),
            node(
                "b",
                gpu("a100-80gb", "1g.10gb@0"),
                taints=[{"key": "k", "value": "v", "effect": "NoSchedule"}],
            ),
        ],
        [pod("p", "1g.10gb")],
    )
    plan = run("nos", snap)
    assert plan.actions == () and plan.placements == ()
    assert set(placed(run("hami-template", snap))) == {"p"}


def test_nos_falls_back_to_maximal_layouts_on_h100() -> None:
    # nos ships no H100 table; our fallback (maximal layouts) lets it partition one anyway.
    snap = make([node("a", gpu("h100-80gb", "1g.10gb@6"))], [pod("p", "3g.40gb")])
    plan = run("nos", snap)
    assert [i.profile for p in plan.placements for i in p.instances] == ["3g.40gb"]


# --------------------------------------------------------------------------- HAMi templates


def test_hami_templates_per_model() -> None:
    def counts(model: str) -> list[dict[str, int]]:
        return [dict(t.counts) for t in baselines.hami_templates(catalog.resolve_gpu(model))]

    assert counts("a100-40gb") == [
        {"1g.5gb": 7},
        {"2g.10gb": 3, "1g.5gb": 1},
        {"3g.20gb": 2},
        {"7g.40gb": 1},
    ]
    assert counts("a100-80gb")[-1] == {"7g.80gb": 1}  # the chart's 7g.79gb, matched by shape
    assert counts("a30-24gb") == [{"1g.6gb": 4}, {"2g.12gb": 2}, {"4g.24gb": 1}]
    # Derived, same pattern, for models the chart does not list.
    assert counts("h100-80gb") == [
        {"1g.10gb": 7},
        {"2g.20gb": 3, "1g.10gb": 1},
        {"3g.40gb": 2},
        {"7g.80gb": 1},
    ]
    assert counts("rtx-pro-6000-blackwell-96gb") == [
        {"1g.24gb": 4},
        {"2g.48gb": 2},
        {"4g.96gb": 1},
    ]
    for model in catalog.gpu_models():
        for tmpl in baselines.hami_templates(model):
            assert layouts.violation(model, tmpl.layout.instances) is None


def test_hami_profiles_follow_the_v2_10_allowlist() -> None:
    def names(model: str) -> tuple[str, ...]:
        return baselines.hami_profiles(catalog.resolve_gpu(model))

    assert names("a100-80gb") == ("1g.10gb", "2g.20gb", "3g.40gb", "7g.80gb")
    assert names("a30-24gb") == ("1g.6gb", "2g.12gb", "4g.24gb")
    assert names("gb200-186gb") == ("1g.23gb", "2g.47gb", "3g.93gb", "7g.186gb")  # derived
    assert all(names(m.id) for m in catalog.gpu_models())


def test_hami_template_blocks_other_sizes_on_a_held_gpu() -> None:
    # HAMi issue #948: the GPU holds the 7 x 1g template while one 1g is in use; a 2g request
    # waits although six free 1g could make room for it.
    ones = [f"1g.5gb@{s}" for s in range(1, 7)]
    snap = make([node("a", gpu("a100-40gb", "1g.5gb@0*", *ones))], [pod("p", "2g.10gb")])
    plan = run("hami-template", snap)
    assert plan.placements == () and plan.actions == ()
    assert "would still fit" in reason(plan, "p")
    # HAMi 2.10 places it, destroying the free 1g instances in its way.
    assert placed(run("hami-placement", snap)) == {"p": ["0:2g.10gb@2"]}


def test_hami_template_applies_the_first_fitting_template_and_keeps_it() -> None:
    snap = make(
        [node("a", gpu("a100-40gb", "3g.20gb@0", "3g.20gb@4"))],
        [pod("small", "1g.5gb"), pod("mid", "3g.20gb")],
    )
    plan = run("hami-template", snap)
    # The idle GPU is wiped and takes 7 x 1g (first template with an entry big enough); the 3g
    # pod that the old layout could have served now waits.
    assert layout_of(plan, "a") == " ".join(f"1g.5gb@{s}" for s in range(7))
    assert placed(plan) == {"small": ["0:1g.5gb@0"]}
    # A pod asking 2 x 1g gets both on one GPU (MIG mode asks the same device again).
    two = make([node("a", gpu("a100-40gb"), gpu("a100-40gb"))], [pod("p", "1g.5gb*2")])
    assert placed(run("hami-template", two)) == {"p": ["0:1g.5gb@0", "0:1g.5gb@1"]}


def test_hami_template_keeps_a_matching_layout() -> None:
    # An idle GPU already holding the template's multiset is not reconfigured.
    snap = make([node("a", gpu("a100-40gb", "3g.20gb@0", "3g.20gb@4"))], [pod("p", "3g.20gb")])
    plan = run("hami-template", snap)
    assert plan.actions == ()
    assert placed(plan) == {"p": ["0:3g.20gb@0"]}


def test_hami_binpacks_nodes_and_spreads_gpus() -> None:
    snap = make(
        [
            node("a", gpu("a100-40gb"), gpu("a100-40gb")),
            node("b", gpu("a100-40gb", "1g.5gb@0", "1g.5gb@1*"), gpu("a100-40gb")),
        ],
        [pod("p1", "1g.5gb"), pod("p2", "1g.5gb")],
    )
    for name in ("hami-template", "hami-placement"):
        plan = run(name, snap)
        # Node b already runs work (binpack); within it, the idle GPU 1 first (spread).
        assert {p.node for p in plan.placements} == {"b"}, name
        assert placed(plan)["p1"][0].startswith("1:"), name
        assert placed(plan)["p2"][0].startswith("0:"), name  # tie between the GPUs: lower index
    assert {p.node for p in run("static", snap).placements} == {"b"}  # only b has free 1g
    spread = make(snap_nodes(snap), [pod("p1", "1g.5gb")], policy="spread")
    assert {p.node for p in run("hami-placement", spread).placements} == {"a"}


def test_hami_says_which_profiles_its_configuration_lacks() -> None:
    snap = make([node("a", gpu("a100-40gb"))], [pod("p", "4g.20gb")])
    for name in ("hami-template", "hami-placement"):
        plan = run(name, snap, explain=True)
        assert plan.placements == ()
        assert "HAMi's" in reason(plan, "p") and "offers no 4g.20gb" in reason(plan, "p")
        assert plan.unschedulable[0].nodes  # per-node reasons kept with --explain
    assert set(placed(run("nos", snap))) == {"p"}


# --------------------------------------------------------------------------- HAMi placement


def test_hami_placement_prefers_high_starts_for_1g_and_3g() -> None:
    for profile, start in (("1g.5gb", 6), ("2g.10gb", 0), ("3g.20gb", 4), ("7g.40gb", 0)):
        snap = make([node("a", gpu("a100-40gb"))], [pod("p", profile)])
        assert placed(run("hami-placement", snap)) == {"p": [f"0:{profile}@{start}"]}, profile


def test_hami_placement_fragments_one_pod_at_a_time() -> None:
    # 1g takes slot 6, so the 3g goes low, the 2g to 4-5, and the last 1g finds no slot; the
    # four fit together (3g@4, 2g@0, 1g@2, 1g@3), which planning the whole set finds.
    model = catalog.resolve_gpu("a100-40gb")
    wanted = ["1g.5gb", "3g.20gb", "2g.10gb", "1g.5gb"]
    assert len(layouts.place(model, wanted)) == 4
    snap = make(
        [node("a", gpu("a100-40gb"))],
        [pod(f"p{k}", profile) for k, profile in enumerate(wanted, 1)],
    )
    plan = run("hami-placement", snap)
    assert placed(plan) == {
        "p1": ["0:1g.5gb@6"],
        "p2": ["0:3g.20gb@0"],
        "p3": ["0:2g.10gb@4"],
    }
    assert {u.pod for u in plan.unschedulable} == {"default/p4"}


def test_hami_placement_destroys_every_free_instance_and_keeps_used_ones() -> None:
    snap = make(
        [
            node("a", gpu("h100-80gb", "3g.40gb@4*", "1g.10gb@0", "1g.10gb@1")),
            node("b", gpu("h100-80gb", "7g.80gb@0")),
        ],
        [pod("p", "1g.10gb")],
    )
    plan = run("hami-placement", snap)
    # The reconciler leaves only reservations: b's idle 7g goes too.
    assert layout_of(plan, "b") == "(empty)"
    assert placed(plan) == {"p": ["0:1g.10gb@3"]}
    assert layout_of(plan, "a") == "1g.10gb@3 3g.40gb@4"
    # The same request reuses the free instance under the other baselines.
    assert placed(run("static", snap)) == {"p": ["0:1g.10gb@0"]}


# --------------------------------------------------------------------------- all baselines


def test_a_profile_no_model_offers_is_unschedulable_everywhere() -> None:
    snap = make([node("a", gpu("a30-24gb"))], [pod("p", "3g.40gb"), pod("q", "1g.6gb")])
    for name in BASELINES:
        plan = run(name, snap)
        assert "default/p" in {u.pod for u in plan.unschedulable}, name


def test_empty_cluster_and_no_pods() -> None:
    for name in BASELINES:
        assert run(name, make([], [pod("p", "1g.5gb")])).placements == ()
        plan = run(name, make([node("a", gpu("a100-40gb", "7g.40gb@0*"))], []))
        assert plan.actions == () and plan.unschedulable == ()


@pytest.mark.parametrize("name", sorted(BASELINES))
def test_used_instances_and_cordoned_nodes(name: str) -> None:
    snap = make(
        [
            node("a", gpu("a100-80gb", "4g.40gb@0*", "1g.10gb@4"), unschedulable=True),
            node("b", gpu("a100-80gb", "3g.40gb@0*", "3g.40gb@4*")),
        ],
        [pod("p", "1g.10gb")],
    )
    plan = run(name, snap)
    assert plan.placements == ()
    assert {g.node: str(g.layout) for g in plan.gpus}["b"] == "3g.40gb@0 3g.40gb@4"


# --------------------------------------------------------------------------- property


MODELS = ("a100-40gb", "a100-80gb", "h100-80gb", "a30-24gb")
_MAXIMAL = {m: layouts.enumerate_layouts(catalog.resolve_gpu(m)) for m in MODELS}
_PROFILES = sorted({p.name for m in MODELS for p in catalog.resolve_gpu(m).profiles})


@st.composite
def gpus(draw: st.DrawFn) -> dict[str, Any]:
    model = draw(st.sampled_from(MODELS))
    layout = draw(st.sampled_from(_MAXIMAL[model]))
    keep = draw(st.lists(st.booleans(), min_size=len(layout), max_size=len(layout)))
    used = draw(st.lists(st.booleans(), min_size=len(layout), max_size=len(layout)))
    return {
        "model": model,
        "instances": [
            {"profile": i.profile, "start": i.start, "used": u}
            for i, k, u in zip(layout.instances, keep, used, strict=True)
            if k
        ],
    }


@st.composite
def snapshots(draw: st.DrawFn) -> snapshot.Snapshot:
    nodes = []
    for k in range(draw(st.integers(0, 4))):
        doc: dict[str, Any] = {
            "name": f"n{k}",
            "labels": {"zone": draw(st.sampled_from("ab"))},
            "gpus": draw(st.lists(gpus(), min_size=0, max_size=3)),
        }
        if draw(st.integers(0, 4)) == 0:
            doc["taints"] = [{"key": "k", "value": "v", "effect": "NoSchedule"}]
        if draw(st.booleans()):
            doc["allocatable"] = {"cpu": str(draw(st.integers(1, 4)))}
        nodes.append(doc)
    pods = []
    for k in range(draw(st.integers(0, 8))):
        requests: dict[str, Any] = {
            snapshot.resource_name(p): draw(st.integers(1, 2))
            for p in draw(st.lists(st.sampled_from(_PROFILES), min_size=1, max_size=2))
        }
        requests["cpu"] = "1"
        doc = {"name": f"p{k}", "priority": draw(st.integers(0, 1)), "requests": requests}
        if draw(st.integers(0, 3)) == 0:
            doc["nodeSelector"] = {"zone": draw(st.sampled_from("ab"))}
        if draw(st.integers(0, 3)) == 0:
            doc["tolerations"] = [{"operator": "Exists"}]
        pods.append(doc)
    policy = draw(st.sampled_from(["binpack", "spread"]))
    return make(nodes, pods, policy=policy)


@settings(max_examples=200, deadline=None)
@given(snapshots())
def test_every_baseline_makes_valid_deterministic_plans(snap: snapshot.Snapshot) -> None:
    for name in BASELINES:
        plan = run(name, snap)
        assert len(plan.placements) + len(plan.unschedulable) == len(snap.pods)
        if name == "static":
            assert plan.actions == ()


# --------------------------------------------------------------------------- memo tables


def _twin(model: Any) -> Any:
    """The same GPU model with a profile tuple of its own identity (a throwaway model)."""
    return dataclasses.replace(model, profiles=tuple(list(model.profiles)))


def test_the_memo_tables_stay_bounded_and_keep_answering_right(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(baselines, "_MEMO_SIZE", 8)
    monkeypatch.setattr(baselines, "_RESOLVED", {})
    monkeypatch.setattr(baselines, "_SHAPES", {})
    a100 = catalog.resolve_gpu("a100-80gb")
    twins = [_twin(a100) for _ in range(20)]
    for m in twins:
        assert baselines._resolved(m, "1g.10gb") == "1g.10gb"
        assert baselines._resolved(m, "9g.1gb") is None
        assert baselines._shape(m, "3g.40gb") == (3, 4, a100.profile_named("3g.40gb").memory_mib)
        assert len(baselines._RESOLVED) <= 8 and len(baselines._SHAPES) <= 8
    # The oldest went first; the newest are kept, and a forgotten one is worked out again.
    assert (id(twins[-1].profiles), "9g.1gb") in baselines._RESOLVED
    assert (id(twins[0].profiles), "1g.10gb") not in baselines._RESOLVED
    assert baselines._resolved(twins[0], "1g.10gb") == "1g.10gb"
    assert len(baselines._RESOLVED) == 8


def test_every_cache_of_the_baselines_is_bounded() -> None:
    cached = [v for v in vars(baselines).values() if hasattr(v, "cache_info")]
    assert {f.__name__ for f in cached} >= {"nos_geometries", "hami_profiles", "hami_templates"}
    assert all(f.cache_info().maxsize == baselines._MEMO_SIZE for f in cached)
