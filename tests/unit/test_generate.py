"""The seeded snapshot generators: deterministic, valid, the sizes asked, the features promised."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot import errors
from migpilot.mig import catalog, layouts, profiles
from migpilot.planning import constraints, generate, snapshot

A100 = catalog.resolve_gpu("a100-80gb")
H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30-24gb")

GENERATORS = {"random": generate.random_snapshot, "trace": generate.trace_snapshot}


def all_gpus(snap: snapshot.Snapshot) -> list[snapshot.Gpu]:
    return [g for n in snap.nodes for g in n.gpus]


@pytest.mark.parametrize("kind", GENERATORS)
def test_same_seed_same_snapshot(kind: str) -> None:
    make = GENERATORS[kind]
    a = make(seed=11, nodes=20, gpus_per_node=4, pods=100)
    b = make(seed=11, nodes=20, gpus_per_node=4, pods=100)
    assert a == b
    assert snapshot.to_document(a) == snapshot.to_document(b)


@pytest.mark.parametrize("kind", GENERATORS)
def test_different_seeds_differ(kind: str) -> None:
    make = GENERATORS[kind]
    docs = [
        snapshot.to_document(make(seed=s, nodes=10, gpus_per_node=4, pods=50)) for s in range(5)
    ]
    assert len({repr(d) for d in docs}) == 5
    # Nodes and pods both vary, not only one of them.
    assert len({repr(d["nodes"]) for d in docs}) == 5
    assert len({repr(d["pods"]) for d in docs}) == 5


@pytest.mark.parametrize("kind", GENERATORS)
def test_global_random_is_untouched(kind: str) -> None:
    random.seed(1234)
    state = random.getstate()
    GENERATORS[kind](seed=1, nodes=5, gpus_per_node=2, pods=20)
    assert random.getstate() == state


@pytest.mark.parametrize("kind", GENERATORS)
@pytest.mark.parametrize(("nodes", "gpus", "pods"), [(0, 1, 0), (1, 1, 5), (7, 3, 0), (13, 8, 77)])
def test_sizes_as_asked(kind: str, nodes: int, gpus: int, pods: int) -> None:
    snap = GENERATORS[kind](seed=2, nodes=nodes, gpus_per_node=gpus, pods=pods)
    assert len(snap.nodes) == nodes
    assert all(len(n.gpus) == gpus for n in snap.nodes)
    assert [g.index for g in snap.nodes[0].gpus] == list(range(gpus)) if nodes else True
    assert len(snap.pods) == pods
    assert len({n.name for n in snap.nodes}) == nodes
    assert len({p.key for p in snap.pods}) == pods


@pytest.mark.parametrize("kind", GENERATORS)
@pytest.mark.parametrize("seed", range(4))
def test_layouts_valid_and_models_as_asked(kind: str, seed: int) -> None:
    snap = GENERATORS[kind](seed=seed, nodes=30, gpus_per_node=8, pods=10)
    for node in snap.nodes:
        assert len({g.model.id for g in node.gpus}) == 1  # one model per node
        for gpu in node.gpus:
            assert gpu.model in (A100, H100, A30)
            assert layouts.violation(gpu.model, gpu.layout.instances) is None
    assert {m.id for m in snap.models} == {"a100-80gb", "h100-80gb", "a30-24gb"}


def test_models_by_any_alias() -> None:
    snap = generate.random_snapshot(
        seed=0, nodes=6, gpus_per_node=2, pods=30, models=["NVIDIA A30"]
    )
    assert {g.model.id for g in all_gpus(snap)} == {"a30-24gb"}
    for pod in snap.pods:
        assert pod.profiles_on(A30) is not None


@pytest.mark.parametrize("kind", GENERATORS)
def test_every_pod_asks_for_a_model_the_cluster_has(kind: str) -> None:
    snap = GENERATORS[kind](seed=5, nodes=12, gpus_per_node=4, pods=300)
    for pod in snap.pods:
        assert any(pod.profiles_on(m) is not None for m in snap.models), pod


def test_gpus_partly_occupied() -> None:
    snap = generate.random_snapshot(seed=3, nodes=50, gpus_per_node=8, pods=0)
    gpus = all_gpus(snap)
    empty = sum(1 for g in gpus if not g.instances)
    with_used = sum(1 for g in gpus if any(i.used for i in g.instances))
    with_free = sum(1 for g in gpus if any(not i.used for i in g.instances))
    assert 0.1 * len(gpus) < empty < 0.5 * len(gpus)
    assert with_used > 0.3 * len(gpus)
    assert with_free > 0.3 * len(gpus)
    insts = [i for g in gpus for i in g.instances]
    assert 0.2 < sum(i.used for i in insts) / len(insts) < 0.4  # used_fraction 0.3


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_used_fraction_extremes(fraction: float) -> None:
    snap = generate.random_snapshot(
        seed=1, nodes=10, gpus_per_node=4, pods=0, used_fraction=fraction
    )
    insts = [i for g in all_gpus(snap) for i in g.instances]
    assert insts
    assert all(i.used is bool(fraction) for i in insts)


def test_random_pods_have_the_promised_features() -> None:
    snap = generate.random_snapshot(seed=4, nodes=100, gpus_per_node=8, pods=3000)
    counts: Counter[str] = Counter()
    for pod in snap.pods:
        for r in pod.mig:
            counts[r.profile] += r.count
    # Mostly 1g/2g, some 3g/4g/7g, some +me, across the three models' names.
    small = sum(n for p, n in counts.items() if p[0] in "12" and "+me" not in p)
    assert small > 0.5 * counts.total()
    for name in ("3g.40gb", "4g.40gb", "7g.80gb", "4g.24gb", "1g.10gb+me", "1g.20gb"):
        assert counts[name] > 0, name
    multi = [p for p in snap.pods if sum(r.count for r in p.mig) > 1]
    assert 0.1 < len(multi) / len(snap.pods) < 0.2  # multi_instance_fraction 0.15
    # Some ask for more than one GPU's worth of compute.
    assert any(
        (need := p.profiles_on(A100)) is not None
        and sum(A100.profile_named(n).compute_slices for n in need) > A100.compute_slices
        for p in multi
    )
    assert any(len(p.mig) > 1 for p in multi)
    selective = [p for p in snap.pods if p.node_selector or p.affinity]
    assert 0.05 < len(selective) / len(snap.pods) < 0.15  # selector_fraction 0.1
    operators = {r.operator for p in snap.pods for term in p.affinity for r in term}
    assert operators == {"In", "NotIn", "Exists", "DoesNotExist"}
    assert {k for p in snap.pods for k in p.node_selector} == {
        "zone",
        "pool",
        "nvidia.com/gpu.product",
    }
    assert Counter(p.priority for p in snap.pods).keys() == {0, 100}
    assert any(p.tolerations for p in snap.pods)
    assert all(p.cpu_milli > 0 and p.memory_bytes > 0 for p in snap.pods)


def test_random_nodes_have_the_promised_features() -> None:
    snap = generate.random_snapshot(seed=4, nodes=300, gpus_per_node=8, pods=0)
    effects = Counter(t.effect for n in snap.nodes for t in n.taints)
    assert effects.keys() == {"NoSchedule", "PreferNoSchedule", "NoExecute"}
    assert 0 < sum(n.unschedulable for n in snap.nodes) < 30
    assert all(n.allocatable is not None for n in snap.nodes)
    assert {"zone", "pool", "nvidia.com/gpu.product"} <= set(snap.nodes[0].labels)
    # The product label matches the model, so selecting on it means selecting a model.
    for n in snap.nodes:
        assert n.labels["nvidia.com/gpu.product"] in n.gpus[0].model.gfd_product_names


def test_some_tolerating_pods_can_use_tainted_nodes() -> None:
    snap = generate.random_snapshot(seed=8, nodes=200, gpus_per_node=2, pods=2000)
    tainted = [n for n in snap.nodes if any(t.effect == "NoSchedule" for t in n.taints)]
    assert tainted
    assert any(
        p.tolerations and constraints.rejection(n, p) is None
        for n in tainted
        if not n.unschedulable
        for p in snap.pods
    )


def test_cpu_and_memory_bind_on_some_nodes() -> None:
    snap = generate.random_snapshot(seed=6, nodes=100, gpus_per_node=8, pods=0)
    # Pods ask 0.5-4 cores per compute slice; a node's slices at the mean ask exceed some nodes.
    for node in snap.nodes:
        assert node.allocatable is not None
    tight = [
        n
        for n in snap.nodes
        if n.allocatable is not None
        and n.allocatable.cpu_milli < 2000 * sum(g.model.compute_slices for g in n.gpus)
    ]
    assert 0 < len(tight) < len(snap.nodes)


def test_knobs_off() -> None:
    snap = generate.random_snapshot(
        seed=9,
        nodes=20,
        gpus_per_node=4,
        pods=400,
        selector_fraction=0.0,
        multi_instance_fraction=0.0,
        priority_levels=1,
        cpu=False,
    )
    assert all(not p.node_selector and not p.affinity for p in snap.pods)
    assert all(len(p.mig) == 1 and p.mig[0].count == 1 for p in snap.pods)
    assert {p.priority for p in snap.pods} == {0}
    assert all(p.cpu_milli == 0 and p.memory_bytes == 0 for p in snap.pods)
    assert all(n.allocatable is None for n in snap.nodes)


def test_knobs_full() -> None:
    snap = generate.random_snapshot(
        seed=9,
        nodes=20,
        gpus_per_node=4,
        pods=400,
        selector_fraction=1.0,
        multi_instance_fraction=1.0,
        priority_levels=4,
    )
    assert all(p.node_selector or p.affinity for p in snap.pods)
    assert all(sum(r.count for r in p.mig) >= 2 for p in snap.pods)
    assert {p.priority for p in snap.pods} == {0, 100, 200, 300}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"nodes": -1}, "nodes must be at least 0"),
        ({"gpus_per_node": 0}, "gpus_per_node must be at least 1"),
        ({"pods": -3}, "pods must be at least 0"),
        ({"used_fraction": 1.5}, "used_fraction must be between 0 and 1"),
        ({"selector_fraction": -0.1}, "selector_fraction must be between 0 and 1"),
        ({"multi_instance_fraction": 2.0}, "multi_instance_fraction must be between 0 and 1"),
        ({"priority_levels": 0}, "priority_levels must be at least 1"),
        ({"models": ()}, "at least one GPU model"),
    ],
)
def test_bad_arguments(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"seed": 0, "nodes": 2, "gpus_per_node": 2, "pods": 2, **kwargs}
    with pytest.raises(errors.MigpilotError, match=message):
        generate.random_snapshot(**args)  # type: ignore[arg-type]


def test_unknown_model() -> None:
    with pytest.raises(errors.UnknownGpuError):
        generate.trace_snapshot(seed=0, nodes=1, gpus_per_node=1, pods=1, models=["tpu"])


# --------------------------------------------------------------------------- trace


@pytest.mark.parametrize(
    ("model", "num_gpu", "gpu_milli", "expected"),
    [
        (A100, 1, 50, ("1g.10gb",)),
        (A100, 1, 142, ("1g.10gb",)),  # 1/7 = 0.1428...
        (A100, 1, 143, ("2g.20gb",)),
        (A100, 1, 285, ("2g.20gb",)),
        (A100, 1, 320, ("3g.40gb",)),
        (A100, 1, 428, ("3g.40gb",)),
        (A100, 1, 430, ("4g.40gb",)),
        (A100, 1, 571, ("4g.40gb",)),
        (A100, 1, 590, ("7g.80gb",)),
        (A100, 1, 1000, ("7g.80gb",)),
        (H100, 1, 810, ("7g.80gb",)),
        (H100, 2, 1000, ("7g.80gb",) * 2),
        (H100, 8, 1000, ("7g.80gb",) * 8),
        (A30, 1, 250, ("1g.6gb",)),  # over the A30's 4 slices
        (A30, 1, 260, ("2g.12gb",)),
        (A30, 1, 500, ("2g.12gb",)),
        (A30, 1, 510, ("4g.24gb",)),
        (A30, 4, 1000, ("4g.24gb",) * 4),
    ],
)
def test_trace_profile(
    model: profiles.GpuModel, num_gpu: int, gpu_milli: int, expected: tuple[str, ...]
) -> None:
    assert generate.trace_profile(model, num_gpu=num_gpu, gpu_milli=gpu_milli) == expected


def test_trace_shape() -> None:
    snap = generate.trace_snapshot(
        seed=1, nodes=100, gpus_per_node=8, pods=5000, models=["a100-80gb"]
    )
    counts = Counter((p.mig[0].profile, p.mig[0].count) for p in snap.pods)
    assert all(len(p.mig) == 1 for p in snap.pods)
    # From the table: 5,392 of the trace's 7,064 GPU pods ask for more than 4/7 of a GPU.
    whole = sum(n for (profile, _), n in counts.items() if profile == "7g.80gb") / len(snap.pods)
    assert 0.73 < whole < 0.80
    multi = sum(n for (_, count), n in counts.items() if count > 1) / len(snap.pods)
    assert 0.005 < multi < 0.02  # 75 of 7,064
    assert {count for _, count in counts} == {1, 2, 4, 8}
    assert {p.priority for p in snap.pods} == {0, 100}
    ls = sum(p.priority == 100 for p in snap.pods) / len(snap.pods)
    assert 0.5 < ls < 0.65  # 4,011 LS pods of 7,064
    assert all(p.cpu_milli > 0 and p.memory_bytes > 0 for p in snap.pods)
    for node in snap.nodes:
        assert node.allocatable == snapshot.Resources(96_000, 384 * 2**30)
        assert not node.taints and not node.unschedulable


def test_trace_table_is_the_trace() -> None:
    rows = generate._OPENB
    assert sum(r[2] for r in rows) == 7064
    assert sum(r[3] for r in rows) == 4011
    assert len({(r[0], r[1]) for r in rows}) == len(rows)


# --------------------------------------------------------------------------- scale


def test_benchmark_size_generates() -> None:
    """The speed benchmark's cluster: 1,000 nodes x 8 GPUs, 5,000 pods (no timing assert)."""
    snap = generate.random_snapshot(seed=0, nodes=1000, gpus_per_node=8, pods=5000)
    assert len(all_gpus(snap)) == 8000
    assert len(snap.pods) == 5000
    trace = generate.trace_snapshot(seed=0, nodes=1000, gpus_per_node=8, pods=5000)
    assert len(all_gpus(trace)) == 8000


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 2**63),
    nodes=st.integers(0, 8),
    gpus=st.integers(1, 8),
    pods=st.integers(0, 40),
    used=st.floats(0, 1),
    multi=st.floats(0, 1),
    kind=st.sampled_from(sorted(GENERATORS)),
)
def test_generated_snapshots_are_valid_and_reparse(
    *, seed: int, nodes: int, gpus: int, pods: int, used: float, multi: float, kind: str
) -> None:
    if kind == "trace":
        snap = generate.trace_snapshot(
            seed=seed, nodes=nodes, gpus_per_node=gpus, pods=pods, used_fraction=used
        )
    else:
        snap = generate.random_snapshot(
            seed=seed,
            nodes=nodes,
            gpus_per_node=gpus,
            pods=pods,
            used_fraction=used,
            multi_instance_fraction=multi,
        )
    for gpu in all_gpus(snap):
        assert layouts.violation(gpu.model, gpu.layout.instances) is None
    assert snapshot.parse(snapshot.to_document(snap)) == snap
