"""The DRA pool as ResourceSlices: counters, devices, in-use rules, slices and the writes."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from migpilot.agent.dra import placements, publishing
from migpilot.mig import catalog, layouts, profiles

A100 = catalog.resolve_gpu("a100-80gb")
H100 = catalog.resolve_gpu("h100-80gb")
RTX = catalog.resolve_gpu("rtx-pro-6000-blackwell-96gb")
NODE = "node-a"
U = publishing.Use


def gpu(
    index: int, model: profiles.GpuModel = A100, *, mig: bool = True, **kw: Any
) -> publishing.Gpu:
    return publishing.Gpu(
        index=index,
        uuid=f"GPU-{index:04d}",
        model=model,
        mig=mig,
        memory_mib=kw.pop("memory_mib", 81920),
        **kw,
    )


def inst(g: int, profile: str, start: int, use: publishing.Use = U.OTHER) -> publishing.Instance:
    return publishing.Instance(g, profile, start, f"MIG-{g}-{profile}-{start}", use)


def counter_sets(pool: publishing.Pool) -> dict[str, dict[str, int]]:
    """Counter set name -> counter -> value, over the pool's counter slices."""
    out: dict[str, dict[str, int]] = {}
    for content in pool.contents:
        for cs in content.get("sharedCounters", ()):
            assert cs["name"] not in out
            out[cs["name"]] = {k: int(v["value"]) for k, v in cs["counters"].items()}
    return out


def devices(pool: publishing.Pool) -> dict[str, Mapping[str, Any]]:
    """Device name -> device, over the pool's device slices."""
    out: dict[str, Mapping[str, Any]] = {}
    for content in pool.contents:
        for dev in content.get("devices", ()):
            assert dev["name"] not in out
            out[dev["name"]] = dev
    return out


def consumed(dev: Mapping[str, Any]) -> tuple[str, dict[str, int]]:
    (use,) = dev["consumesCounters"]
    return use["counterSet"], {k: int(v["value"]) for k, v in use["counters"].items()}


def allocatable(pool: publishing.Pool, names: Sequence[str]) -> bool:
    """Whether kube-scheduler's allocator could allocate these devices together: for every
    counter of every set, what they consume is at most what the set has (its
    ``checkAvailableCounters``), every consumed counter existing in its set (else the pool is
    invalid)."""
    sets, devs = counter_sets(pool), devices(pool)
    total: dict[tuple[str, str], int] = {}
    for name in names:
        set_name, counters = consumed(devs[name])
        assert set(counters) <= set(sets[set_name]), f"{name} consumes counters its set lacks"
        for counter, value in counters.items():
            total[set_name, counter] = total.get((set_name, counter), 0) + value
    return all(sets[s][c] >= v for (s, c), v in total.items())


def placement_of(name: str, gpus: Mapping[int, profiles.GpuModel]) -> placements.Placement:
    got = placements.parse_device(name, gpus)
    assert isinstance(got, placements.Placement)
    return got


# --- devices and counters ----------------------------------------------------------------------


@pytest.mark.parametrize("model", [A100, H100, RTX], ids=lambda m: m.id)
def test_each_device_consumes_exactly_its_placements_slices(model: profiles.GpuModel) -> None:
    pool = publishing.pool(NODE, [gpu(3, model)], [])
    geo = layouts.geometry(model)
    devs = devices(pool)
    assert len(devs) == len(geo.placements)
    for name, dev in devs.items():
        where = placement_of(name, {3: model})
        profile = model.profile_named(where.profile)
        set_name, counters = consumed(dev)
        want = {
            f"memory-slice-{k}": 1 for k in range(where.start, where.start + profile.memory_slots)
        }
        want["compute-slices"] = profile.compute_slices
        if profile.media_extension:
            want["media-engines"] = 1
        assert (set_name, counters) == ("gpu-3", want)
        attrs = {k: next(iter(v.values())) for k, v in dev["attributes"].items()}
        assert attrs == {
            "type": "mig",
            "model": model.id,
            "profile": profile.name,
            "start": where.start,
            "gpuUUID": "GPU-0003",
            "gpuIndex": 3,
        }
        assert profile.memory_mib is not None
        want_memory = publishing.mib_quantity(profile.memory_mib)
        assert dev["capacity"] == {"memory": {"value": want_memory}}
    free = counter_sets(pool)["gpu-3"]
    assert free == {
        **{f"memory-slice-{k}": 1 for k in range(model.memory_slots)},
        "compute-slices": model.compute_slices,
        "media-engines": 1,
    }


@pytest.mark.parametrize("model", catalog.gpu_models(), ids=lambda m: m.id)
def test_the_counters_allow_exactly_the_layouts_mig_allows(model: profiles.GpuModel) -> None:
    """Every set of memory-disjoint placements: kube-scheduler could allocate it from the
    counters exactly when MIG accepts it as a layout (overlaps: the next test)."""
    pool = publishing.pool(NODE, [gpu(0, model)], [])
    names = sorted(devices(pool))
    where = {n: placement_of(n, {0: model}) for n in names}
    geo = layouts.geometry(model)
    # One device per placement, each name unique and read back as its placement.
    assert sorted((w.profile, w.start) for w in where.values()) == sorted(
        (geo.profiles[f.profile].name, f.start) for f in geo.placements
    )
    mask = {
        n: geo.placement(layouts.Instance(where[n].start, where[n].profile)).mask for n in names
    }
    checked = 0

    def walk(i: int, taken: int, chosen: list[str]) -> None:
        nonlocal checked
        if i == len(names):
            instances = [layouts.Instance(where[n].start, where[n].profile) for n in chosen]
            ok = layouts.violation(model, instances) is None
            assert allocatable(pool, chosen) == ok, (chosen, layouts.violation(model, instances))
            checked += 1
            return
        walk(i + 1, taken, chosen)
        if not mask[names[i]] & taken:
            walk(i + 1, taken | mask[names[i]], [*chosen, names[i]])

    walk(0, 0, [])
    assert checked > 50


def test_no_two_overlapping_placements_are_allocatable_together_and_gpus_are_apart() -> None:
    pool = publishing.pool(NODE, [gpu(0), gpu(1, H100)], [])
    gpus = {0: A100, 1: H100}
    for a, b in itertools.combinations(sorted(devices(pool)), 2):
        pa, pb = placement_of(a, gpus), placement_of(b, gpus)
        if pa.gpu != pb.gpu:
            assert allocatable(pool, [a, b])  # separate counter sets
            continue
        geo = layouts.geometry(gpus[pa.gpu])
        overlap = (
            geo.placement(layouts.Instance(pa.start, pa.profile)).mask
            & geo.placement(layouts.Instance(pb.start, pb.profile)).mask
        )
        if overlap:
            assert not allocatable(pool, [a, b]), (a, b)


def test_an_instance_used_by_others_blocks_itself_and_every_placement_over_it() -> None:
    pool = publishing.pool(NODE, [gpu(0)], [inst(0, "3g.40gb", 4, U.OTHER)])
    counters = counter_sets(pool)["gpu-0"]
    assert [counters[f"memory-slice-{k}"] for k in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert counters["compute-slices"] == 7 - 3
    assert counters["media-engines"] == 1
    for name in devices(pool):
        where = placement_of(name, {0: A100})
        slots = set(
            range(where.start, where.start + A100.profile_named(where.profile).memory_slots)
        )
        assert allocatable(pool, [name]) == (not slots & {4, 5, 6, 7}), name
    # What is left is what MIG leaves beside 3g.40gb@4: 4g.40gb@0 still fits, with its compute.
    assert allocatable(pool, ["gpu-0-mig-4g-40gb-0"])


def test_a_used_media_extension_instance_takes_the_media_engines() -> None:
    pool = publishing.pool(NODE, [gpu(0)], [inst(0, "1g.10gb+me", 0, U.OTHER)])
    assert counter_sets(pool)["gpu-0"]["media-engines"] == 0
    assert not allocatable(pool, ["gpu-0-mig-1g-10gb-me-3"])
    assert allocatable(pool, ["gpu-0-mig-1g-10gb-3"])


@pytest.mark.parametrize("use", [U.FREE, U.CLAIM])
def test_free_and_claimed_instances_leave_the_counters_whole(use: publishing.Use) -> None:
    with_instance = publishing.pool(NODE, [gpu(0)], [inst(0, "3g.40gb", 4, use)])
    plain = publishing.pool(NODE, [gpu(0)], [])
    assert (with_instance.contents, with_instance.names) == (plain.contents, plain.names)
    # A claim's device is pinned: it never moves between slices of one generation.
    assert with_instance.pinned == ({"gpu-0-mig-3g-40gb-4"} if use is U.CLAIM else set())
    # A claim's device stays published (its allocation consumes the counters in the scheduler).
    assert "gpu-0-mig-3g-40gb-4" in devices(with_instance)


def test_a_whole_gpu_is_one_device_consuming_every_counter() -> None:
    pool = publishing.pool(NODE, [gpu(0), gpu(1, H100, mig=False, memory_mib=81559)], [])
    devs = devices(pool)
    assert [n for n in devs if n.startswith("gpu-1")] == ["gpu-1"]
    whole = devs["gpu-1"]
    set_name, counters = consumed(whole)
    assert set_name == "gpu-1" and counters == counter_sets(pool)["gpu-1"]
    assert whole["capacity"] == {"memory": {"value": "81559Mi"}}
    # Written as the API server writes quantities back (else every read would be a change).
    assert publishing.mib_quantity(81920) == "80Gi" and publishing.mib_quantity(1 << 20) == "1Ti"
    assert (publishing.mib_quantity(40192), publishing.mib_quantity(0)) == ("40192Mi", "0")
    attrs = {k: next(iter(v.values())) for k, v in whole["attributes"].items()}
    assert attrs["type"] == "gpu" and attrs["profile"] == "whole" and attrs["start"] == 0
    # Every device has the same attributes: a selector never meets a missing one.
    assert len({tuple(sorted(d["attributes"])) for d in devs.values()}) == 1
    assert placements.parse_device("gpu-1", {0: A100, 1: H100}) == placements.WholeGpu(1)
    assert allocatable(pool, ["gpu-1"])
    used = publishing.pool(NODE, [gpu(1, H100, mig=False, use=U.OTHER)], [])
    assert set(counter_sets(used)["gpu-1"].values()) == {0}
    assert not allocatable(used, ["gpu-1"])


def test_whole_gpu_names_parse_and_refuse_what_the_node_lacks() -> None:
    gpus = {0: A100}
    assert placements.whole_gpu_name(0) == "gpu-0"
    assert placements.parse_device("gpu-0-mig-3g-40gb-4", gpus) == placements.Placement(
        0, "3g.40gb", 4
    )
    with pytest.raises(placements.PlacementError, match="no GPU 2"):
        placements.parse_device("gpu-2", gpus)
    with pytest.raises(placements.PlacementError, match="not a MIG placement"):
        placements.parse_device("gpu-01", gpus)


# --- slices ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gpus", "counter_slices", "device_slices"),
    [
        ([gpu(i) for i in range(8)], 1, 4),  # 25 devices a GPU: two GPUs a slice
        ([gpu(i) for i in range(9)], 2, 5),  # more than 8 counter sets
        ([gpu(i, RTX) for i in range(4)], 1, 2),  # 30 devices a GPU
        ([gpu(0, mig=False)], 1, 1),
    ],
)
def test_the_pool_is_split_within_the_apis_limits(
    gpus: list[publishing.Gpu], counter_slices: int, device_slices: int
) -> None:
    pool = publishing.pool(NODE, gpus, [])
    docs = pool.documents(3)
    kinds = ["sharedCounters" if "sharedCounters" in d["spec"] else "devices" for d in docs]
    assert kinds == ["sharedCounters"] * counter_slices + ["devices"] * device_slices
    for doc in docs:
        spec = doc["spec"]
        assert not ("sharedCounters" in spec and "devices" in spec)
        assert len(spec.get("sharedCounters", ())) <= publishing.MAX_COUNTER_SETS
        assert len(spec.get("devices", ())) <= publishing.MAX_DEVICES
        assert spec["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": len(docs)}
        assert (spec["driver"], spec["nodeName"]) == ("mig.migpilot.io", NODE)
    assert [d["metadata"]["name"] for d in docs] == [
        f"{NODE}-mig.migpilot.io-counters-{i:04d}" for i in range(counter_slices)
    ] + [f"{NODE}-mig.migpilot.io-devices-{i:04d}" for i in range(1, device_slices + 1)]
    # A GPU's devices stay in one slice (a change on one GPU rewrites one slice).
    for g in gpus:
        mine = (f"gpu-{g.index}", f"gpu-{g.index}-")
        holding = [
            d
            for d in docs
            if any(x["name"] == mine[0] or x["name"].startswith(mine[1])
                   for x in d["spec"].get("devices", ()))
        ]  # fmt: skip
        assert len(holding) == 1


def test_a_gpu_with_more_devices_than_a_slice_holds_is_split() -> None:
    per_gpu = [[{"name": f"a{i}"} for i in range(10)], [{"name": f"b{i}"} for i in range(130)]]
    chunks = publishing._packed(per_gpu)
    assert [len(c) for c in chunks] == [10, 64, 64, 2]
    assert [d["name"] for c in chunks for d in c] == [d["name"] for g in per_gpu for d in g]


def test_the_same_input_in_any_order_gives_equal_objects() -> None:
    gpus = [gpu(0), gpu(1, H100), gpu(2, mig=False)]
    instances = [
        inst(0, "3g.40gb", 4),
        inst(0, "1g.10gb", 0, U.FREE),
        inst(1, "2g.20gb", 2, U.CLAIM),
    ]
    first = publishing.pool(NODE, gpus, instances).documents(1)
    rng = random.Random(7)
    for _ in range(5):
        rng.shuffle(gpus)
        rng.shuffle(instances)
        again = publishing.pool(NODE, gpus, instances).documents(1)
        assert again == first
        assert json.dumps(again) == json.dumps(first)  # down to the order of keys


@pytest.mark.parametrize(
    ("gpus", "instances", "message"),
    [
        ([gpu(0), gpu(0)], [], "GPU 0 is given twice"),
        ([gpu(0), publishing.Gpu(1, "GPU-0000", A100, True, 1)], [], "share UUID GPU-0000"),
        ([gpu(0)], [inst(1, "1g.10gb", 0)], r"no GPU 1 \(GPUs: 0\)"),
        ([gpu(0, mig=False)], [inst(0, "1g.10gb", 0)], "GPU 0 has MIG off"),
        ([gpu(0)], [inst(0, "3g.40gb", 2)], "3g.40gb cannot start at memory slot 2"),
        ([gpu(0)], [inst(0, "5g.50gb", 0)], "no MIG profile '5g.50gb'"),
        ([gpu(0)], [inst(0, "3g.40gb", 4), inst(0, "1g.10gb", 5)], "overlap on GPU 0"),
        ([gpu(0, use=U.OTHER)], [], "GPU 0 has MIG on"),
        ([gpu(0, memory_mib=0)], [], "memory 0 MiB is not positive"),
    ],
)
def test_bad_input_is_refused_naming_the_problem(
    gpus: list[publishing.Gpu], instances: list[publishing.Instance], message: str
) -> None:
    with pytest.raises(publishing.PublishingError, match=message):
        publishing.pool(NODE, gpus, instances)


@pytest.mark.parametrize("node", ["", "Node_A", "-a", "a" * 254])
def test_a_node_name_that_cannot_name_slices_is_refused(node: str) -> None:
    with pytest.raises(publishing.PublishingError, match="node name"):
        publishing.pool(node, [gpu(0)], [])


# --- the writes --------------------------------------------------------------------------------


def stored(docs: Sequence[Mapping[str, Any]], version: int = 10) -> list[dict[str, Any]]:
    """The documents as a server holds them: with a resource version and a uid."""
    out = []
    for i, doc in enumerate(docs):
        d = json.loads(json.dumps(doc))
        d["metadata"].update(resourceVersion=str(version + i), uid=f"uid-{i}")
        out.append(d)
    return out


def test_a_new_pool_is_created_at_generation_zero_and_then_left_alone() -> None:
    pool = publishing.pool(NODE, [gpu(0), gpu(1)], [])
    writes = publishing.reconcile(pool, [])
    assert (writes.generation, len(writes.create), writes.update, writes.delete) == (0, 2, (), ())
    again = publishing.reconcile(pool, stored(writes.create))
    assert again.nothing and again.generation == 0


def test_one_changed_slice_is_updated_in_place_at_its_generation() -> None:
    before = publishing.pool(NODE, [gpu(0), gpu(1)], [])
    existing = stored(before.documents(4))
    after = publishing.pool(NODE, [gpu(0), gpu(1)], [inst(1, "1g.10gb", 6)])  # counters only
    writes = publishing.reconcile(after, existing)
    assert writes.generation == 4 and not writes.create and not writes.delete
    (update,) = writes.update
    assert update["metadata"]["name"] == f"{NODE}-mig.migpilot.io-counters-0000"
    assert update["metadata"]["resourceVersion"] == "10"  # guarded by what was read
    assert update["spec"]["pool"]["generation"] == 4


def test_a_change_of_several_slices_writes_the_next_generation_then_deletes() -> None:
    before = publishing.pool(NODE, [gpu(i) for i in range(4)], [])  # 1 + 2 slices
    existing = stored(before.documents(2))
    after = publishing.pool(NODE, [gpu(0, mig=False)], [inst(0, "1g.10gb", 0)] * 0)  # 1 + 1
    writes = publishing.reconcile(after, existing)
    assert writes.generation == 3
    assert [d["metadata"]["name"] for d in writes.update] == [
        f"{NODE}-mig.migpilot.io-counters-0000",
        f"{NODE}-mig.migpilot.io-devices-0001",
    ]
    assert all(d["spec"]["pool"] == {"name": NODE, "generation": 3, "resourceSliceCount": 2}
               for d in writes.update)  # fmt: skip
    assert writes.delete == (f"{NODE}-mig.migpilot.io-devices-0002",)
    grown = publishing.reconcile(before, stored(after.documents(3)))
    assert grown.generation == 4 and len(grown.update) == 2 and len(grown.create) == 1


def test_slices_of_mixed_generations_are_rewritten_at_the_next_one() -> None:
    pool = publishing.pool(NODE, [gpu(0)], [])
    docs = stored(pool.documents(5))
    docs[1]["spec"]["pool"]["generation"] = 4  # a half-finished earlier publish
    writes = publishing.reconcile(pool, docs)
    assert writes.generation == 6 and len(writes.update) == 2


def test_other_nodes_and_drivers_slices_are_left_alone() -> None:
    pool = publishing.pool(NODE, [gpu(0)], [])
    mine = stored(pool.documents(0))
    other_node = stored(publishing.pool("node-b", [gpu(0)], []).documents(7), 50)
    other_driver = json.loads(json.dumps(mine[0]))
    other_driver["metadata"]["name"] = "x"
    other_driver["spec"]["driver"] = "gpu.nvidia.com"
    writes = publishing.reconcile(pool, [*mine, *other_node, other_driver])
    assert writes.nothing


def test_a_stored_field_the_pool_does_not_set_is_a_change_unless_it_is_empty() -> None:
    pool = publishing.pool(NODE, [gpu(0)], [])
    docs = stored(pool.documents(0))
    docs[1]["spec"]["devices"][0]["taints"] = []  # what a server may write for "unset"
    assert publishing.reconcile(pool, docs).nothing
    docs[1]["spec"]["devices"][0]["attributes"]["stale"] = {"string": "x"}
    assert len(publishing.reconcile(pool, docs).update) == 1


def _quantity_mib(text: str) -> float:
    units = {"Mi": 1.0, "Gi": 1024.0, "G": 1e9 / 2**20}
    for unit, factor in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * factor
    raise AssertionError(text)


@pytest.mark.parametrize(
    ("gib", "want"), [(9, "1g.10gb"), (19, "1g.20gb"), (20, "3g.40gb"), (40, "7g.80gb")]
)
def test_first_fit_gives_a_claim_by_memory_the_smallest_profile_that_holds_it(
    gib: int, want: str
) -> None:
    """kube-scheduler takes the first device of the pool that fits; an A100 80GB's placements
    are listed smallest first (its 2g.20gb has 19968Mi: 20Gi needs a 40 GB profile)."""
    pool = publishing.pool(NODE, [gpu(0)], [])
    first = next(
        name
        for name, dev in devices(pool).items()  # in slice order
        if _quantity_mib(dev["capacity"]["memory"]["value"]) >= gib * 1024
        and dev["attributes"]["type"] == {"string": "mig"}
    )
    assert placement_of(first, {0: A100}).profile == want


def test_a_pool_written_again_after_all_its_slices_went_is_newer_than_the_last() -> None:
    """A reader that lags may still hold a slice of the last generation written: the new pool
    must not be older than it."""
    pool = publishing.pool(NODE, [gpu(0)], [])
    assert publishing.reconcile(pool, [], newer_than=4).generation == 5
    existing = stored(pool.documents(2))
    assert publishing.reconcile(publishing.pool(NODE, [], []), existing).delete
    assert publishing.reconcile(pool, existing[:1], newer_than=3).generation == 4
