"""The model of kube-scheduler's structured DRA allocator: walk order, counters, selectors,
prioritized lists, taints, backtracking, the filter budget, and the pool's counters against
MIG's own layout rules."""

from __future__ import annotations

import pytest

from migpilot.agent.dra import placements
from migpilot.mig import catalog, layouts, profiles
from migpilot.planning import draalloc as D  # noqa: N812 - short, read like the module

H100 = catalog.resolve_gpu("h100-80gb")
A100 = catalog.resolve_gpu("a100-80gb")


def _claim(*selectors: D.Selector, count: int = 1) -> D.Claim:
    return D.Claim(tuple(D.Request(count, (s,)) for s in selectors))


def _names(found: D.Allocation) -> list[str] | None:
    return None if found.devices is None else [d.name for d in found.devices]


def _by_profile(profile: str) -> D.Claim:
    return _claim(D.Selector(profile=profile))


def test_devices_are_named_as_the_kubelet_plugin_parses_them() -> None:
    pool = D.publish("n0", H100, gpus=2)
    assert len(pool.devices) == 2 * sum(len(p.placements) for p in H100.profiles)
    for d in pool.devices:
        placement = placements.Placement(gpu=d.gpu, profile=d.profile, start=d.start)
        assert d.name == placements.device_name(placement)
        assert placements.parse_device_name(d.name, {0: H100, 1: H100}) == placement


def test_the_first_device_in_walk_order_wins() -> None:
    pool = D.publish("n0", H100, gpus=2)
    assert _names(D.allocate(pool, _by_profile("1g.10gb"))) == ["gpu-0-mig-1g-10gb-0"]
    taken = frozenset({"gpu-0-mig-1g-10gb-0"})
    assert _names(D.allocate(pool, _by_profile("1g.10gb"), allocated=taken)) == [
        "gpu-0-mig-1g-10gb-1"
    ]


def test_walk_order_decides_what_a_claim_by_memory_gets() -> None:
    by_memory = _claim(D.Selector(min_memory_mib=9537))  # memory >= 10G
    by_start = D.publish("n0", H100, gpus=1, order=D.DeviceOrder.START)
    by_profile = D.publish("n0", H100, gpus=1, order=D.DeviceOrder.PROFILE)
    # Listed by start, the largest profile at slot 0 comes first: a 10 GB claim gets 80 GB.
    assert _names(D.allocate(by_start, by_memory)) == ["gpu-0-mig-7g-80gb-0"]
    assert _names(D.allocate(by_profile, by_memory)) == ["gpu-0-mig-1g-10gb-0"]


def test_counters_keep_placements_apart() -> None:
    pool = D.publish("n0", H100, gpus=1)
    one = frozenset({"gpu-0-mig-1g-10gb-0"})
    # 4g.40gb starts only at slot 0, which the 1g.10gb holds: first-fit fragments the GPU.
    assert D.allocate(pool, _by_profile("4g.40gb"), allocated=one).devices is None
    assert _names(D.allocate(pool, _by_profile("3g.40gb"), allocated=one)) == [
        "gpu-0-mig-3g-40gb-4"
    ]
    full = frozenset({"gpu-0-mig-7g-80gb-0"})
    assert D.allocate(pool, _by_profile("1g.10gb"), allocated=full).devices is None
    # Two 3g.40gb hold every memory slot (and six compute slices): nothing else fits.
    two = frozenset({"gpu-0-mig-3g-40gb-0", "gpu-0-mig-3g-40gb-4"})
    assert D.allocate(pool, _by_profile("1g.10gb"), allocated=two).devices is None


def test_compute_slices_are_counted_not_only_memory_slots() -> None:
    pool = D.publish("n0", H100, gpus=1)
    # 4g@0 and 2g@4 take 6 compute slices and slots 0-5: a 1g.20gb@6 fits (7), a second
    # compute-heavy instance does not.
    held = frozenset({"gpu-0-mig-4g-40gb-0", "gpu-0-mig-2g-20gb-4"})
    assert _names(D.allocate(pool, _by_profile("1g.20gb"), allocated=held)) == [
        "gpu-0-mig-1g-20gb-6"
    ]
    four_ones = frozenset(f"gpu-0-mig-1g-20gb-{s}" for s in (0, 2, 4))
    left = D.available_counters(pool, four_ones)
    assert left[("gpu-0-counters", D.COMPUTE_SLICES)] == 4


def test_one_media_engine_per_gpu() -> None:
    pool = D.publish("n0", H100, gpus=1)
    me = frozenset({"gpu-0-mig-1g-10gb-me-0"})
    assert D.allocate(pool, _by_profile("1g.10gb+me"), allocated=me).devices is None
    assert _names(D.allocate(pool, _by_profile("1g.10gb"), allocated=me)) == ["gpu-0-mig-1g-10gb-1"]


@pytest.mark.parametrize("model", [H100, A100], ids=lambda m: m.id)
def test_the_counters_admit_exactly_the_valid_mig_layouts(model: profiles.GpuModel) -> None:
    """Every set of placements the counters let the allocator take together is a layout MIG
    accepts, and every layout MIG accepts fits the counters: the published pool can never lead
    kube-scheduler to an allocation the kubelet plugin could not create."""
    pool = D.publish("n0", model, gpus=1)
    devices = pool.devices
    admitted: set[frozenset[str]] = set()

    def grow(taken: frozenset[str], first: int) -> None:
        admitted.add(taken)
        left = D.available_counters(pool, taken)
        for i in range(first, len(devices)):
            d = devices[i]
            if all(left[(d.counter_set, c)] >= n for c, n in d.consumes):
                grow(taken | {d.name}, i + 1)

    grow(frozenset(), 0)
    for names in admitted:
        instances = [
            layouts.Instance(pool.by_name[n].start, pool.by_name[n].profile) for n in names
        ]
        assert layouts.violation(model, instances) is None, sorted(names)
    for lay in layouts.enumerate_layouts(model, maximal=False):
        names = frozenset(D.device_name(0, i.profile, i.start) for i in lay.instances)
        assert names in admitted, str(lay)


def test_selectors_by_profile_memory_and_model() -> None:
    h = D.publish("h", H100, gpus=1)
    a = D.publish("a", A100, gpus=1)
    on_a100 = _claim(D.Selector(profile="1g.10gb", model="a100-80gb"))
    assert D.allocate(h, on_a100).devices is None
    assert _names(D.allocate(a, on_a100)) == ["gpu-0-mig-1g-10gb-0"]
    # 40,448 MiB is more than an A100's 3g.40gb holds (40,192): only its 7g.80gb serves it.
    big = _claim(D.Selector(min_memory_mib=40448))
    assert _names(D.allocate(h, big)) == ["gpu-0-mig-3g-40gb-0"]
    assert _names(D.allocate(a, big)) == ["gpu-0-mig-7g-80gb-0"]


def test_selectors_are_written_as_the_claims_cel() -> None:
    sel = D.Selector(profile="3g.40gb", min_memory_mib=38146, model="h100-80gb")
    assert sel.cel() == (
        'device.attributes["mig.migpilot.io"].profile == "3g.40gb" && '
        'device.capacity["mig.migpilot.io"].memory.compareTo(quantity("38146Mi")) >= 0 && '
        'device.attributes["mig.migpilot.io"].model == "h100-80gb"'
    )
    assert D.Selector().cel() == "true"


def test_a_claims_requests_backtrack_to_a_full_solution() -> None:
    pool = D.publish("n0", H100, gpus=1)
    # Any 10 GB device, then the 4g.40gb: first-fit would put the small one at slot 0, which
    # the 4g.40gb needs; the search backtracks until the small one leaves slots 0-3 free.
    claim = _claim(
        D.Selector(min_memory_mib=9537, profile="1g.10gb"), D.Selector(profile="4g.40gb")
    )
    assert _names(D.allocate(pool, claim)) == ["gpu-0-mig-1g-10gb-4", "gpu-0-mig-4g-40gb-0"]


def test_a_request_for_several_devices_takes_distinct_ones_in_walk_order() -> None:
    pool = D.publish("n0", H100, gpus=2)
    found = D.allocate(pool, _claim(D.Selector(profile="7g.80gb"), count=2))
    assert _names(found) == ["gpu-0-mig-7g-80gb-0", "gpu-1-mig-7g-80gb-0"]
    assert D.allocate(pool, _claim(D.Selector(profile="7g.80gb"), count=3)).devices is None


def test_a_prioritized_list_takes_the_first_subrequest_that_fits() -> None:
    pool = D.publish("n0", H100, gpus=1, order=D.DeviceOrder.START)
    plain = D.Selector(min_memory_mib=19073)  # memory >= 20G
    listed = D.prioritized(plain, [H100, A100])
    assert [s.profile for s in listed] == ["1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"]
    assert all(s.min_memory_mib == 19073 for s in listed)
    claim = D.Claim((D.Request(1, listed),))
    assert _names(D.allocate(pool, claim)) == ["gpu-0-mig-1g-20gb-0"]
    # With every 1g.20gb slot taken, the next subrequest serves it.
    taken = frozenset(f"gpu-0-mig-1g-20gb-{s}" for s in (0, 2, 4))
    assert _names(D.allocate(pool, claim, allocated=taken)) == ["gpu-0-mig-1g-20gb-6"]
    taken |= {"gpu-0-mig-1g-20gb-6"}
    assert D.allocate(pool, claim, allocated=taken).devices is None
    # A selector by profile is left as it is.
    assert D.prioritized(D.Selector(profile="1g.10gb"), [H100]) == (D.Selector(profile="1g.10gb"),)


def test_taints_exclude_devices_unless_tolerated() -> None:
    pool = D.publish("n0", H100, gpus=1)
    first = "gpu-0-mig-1g-10gb-0"
    tainted = {first: (D.Taint("example.com/broken"),)}
    assert _names(D.allocate(pool, _by_profile("1g.10gb"), taints=tainted)) == [
        "gpu-0-mig-1g-10gb-1"
    ]
    tolerant = D.Claim(_by_profile("1g.10gb").requests, tolerates=frozenset({"example.com/broken"}))
    assert _names(D.allocate(pool, tolerant, taints=tainted)) == [first]
    evicting = {first: (D.Taint("k", D.Effect.NO_EXECUTE),)}
    assert _names(D.allocate(pool, _by_profile("1g.10gb"), taints=evicting)) != [first]
    informational = {first: (D.Taint("k", D.Effect.NONE),)}
    assert _names(D.allocate(pool, _by_profile("1g.10gb"), taints=informational)) == [first]


def test_steering_taints_everything_but_the_offered_and_the_allocated() -> None:
    pool = D.publish("n0", H100, gpus=1)
    offered = {"gpu-0-mig-1g-10gb-6"}
    allocated = {"gpu-0-mig-4g-40gb-0"}
    taints = D.steering_taints(pool, offered=offered, allocated=allocated)
    assert set(taints) == {d.name for d in pool.devices} - offered - allocated
    assert all(t == (D.STEERED,) for t in taints.values())
    claim = _claim(D.Selector(min_memory_mib=9537))
    found = D.allocate(pool, claim, allocated=frozenset(allocated), taints=taints)
    assert _names(found) == ["gpu-0-mig-1g-10gb-6"]
    # A stale plan taints nothing: allocation goes on, unsteered.
    assert D.steering_taints(pool, offered=offered, allocated=allocated, fresh=False) == {}
    with pytest.raises(D.AllocatorError, match="no device gpu-0-mig-9g"):
        D.steering_taints(pool, offered={"gpu-0-mig-9g-90gb-0"}, allocated=())


def test_the_search_gives_up_past_its_budget() -> None:
    pool = D.publish("n0", H100, gpus=2)
    # Eight 7g.80gb on two GPUs cannot be had; a tiny budget stops the search early.
    claim = _claim(D.Selector(min_memory_mib=1), count=15)
    found = D.allocate(pool, claim, budget=50)
    assert found.devices is None and found.timed_out and found.steps == 51
    assert not D.allocate(pool, _by_profile("1g.10gb"), budget=50).timed_out


def test_allocation_is_deterministic() -> None:
    pool = D.publish("n0", A100, gpus=4, order=D.DeviceOrder.START)
    claim = _claim(D.Selector(min_memory_mib=19073), D.Selector(profile="3g.40gb"), count=2)
    first = D.allocate(pool, claim)
    assert first.devices is not None
    assert all(D.allocate(pool, claim) == first for _ in range(3))


def test_bad_pools_and_claims_are_refused() -> None:
    pool = D.publish("n0", H100, gpus=1)
    with pytest.raises(D.AllocatorError, match="duplicate device name"):
        D.Pool("n0", pool.counter_sets, (pool.devices[0], pool.devices[0]))
    with pytest.raises(D.AllocatorError, match="does not publish"):
        D.Pool("n0", (), pool.devices[:1])
    with pytest.raises(D.AllocatorError, match="at least one device"):
        D.Request(0, (D.Selector(),))
    with pytest.raises(D.AllocatorError, match="needs a selector"):
        D.Request(1, ())
    with pytest.raises(D.AllocatorError, match="at least one request"):
        D.Claim(())
    with pytest.raises(D.AllocatorError, match="at least one GPU"):
        D.publish("n0", H100, gpus=0)
    with pytest.raises(D.AllocatorError, match="no device gpu-9"):
        D.available_counters(pool, ["gpu-9-mig-1g-10gb-0"])


def test_planned_placements_listed_first_win_and_the_rest_still_fit() -> None:
    pool = D.publish("n0", H100, gpus=2)
    planned = {"gpu-1-mig-3g-40gb-4", "gpu-1-mig-1g-10gb-6"}
    listed = D.planned_first(pool, planned)
    # Planned first, smallest first; then every other device in the pool's order.
    assert [d.name for d in listed.devices[:2]] == ["gpu-1-mig-1g-10gb-6", "gpu-1-mig-3g-40gb-4"]
    assert [d.name for d in listed.devices[2:]] == [
        d.name for d in pool.devices if d.name not in planned
    ]
    # A claim by memory takes the smallest planned placement that holds it, not the 3g.40gb
    # planned for a larger claim.
    assert _names(D.allocate(listed, _claim(D.Selector(min_memory_mib=9536)))) == [
        "gpu-1-mig-1g-10gb-6"
    ]
    assert _names(D.allocate(listed, _by_profile("3g.40gb"))) == ["gpu-1-mig-3g-40gb-4"]
    # Soft: a claim no planned placement fits gets the first free one, as uncurated.
    assert _names(D.allocate(listed, _by_profile("7g.80gb"))) == ["gpu-0-mig-7g-80gb-0"]
    taken = frozenset({"gpu-1-mig-1g-10gb-6"})
    assert _names(D.allocate(listed, _by_profile("1g.10gb"), allocated=taken)) == [
        "gpu-0-mig-1g-10gb-0"
    ]
    with pytest.raises(D.AllocatorError, match="no device gpu-0-mig-9g-90gb-0 to list first"):
        D.planned_first(pool, {"gpu-0-mig-9g-90gb-0"})


def test_a_best_fit_listing_keeps_big_placements_and_whole_gpus_free() -> None:
    pool = D.publish("n0", H100, gpus=2)
    listed = D.best_fit(pool, (), H100)
    # First fit on the plain listing puts a 1g.10gb at slot 0, the only start of a 4g.40gb;
    # the best-fit listing puts it at slot 6, and the next one beside it on the same GPU.
    assert _names(D.allocate(pool, _by_profile("1g.10gb"))) == ["gpu-0-mig-1g-10gb-0"]
    first = _names(D.allocate(listed, _by_profile("1g.10gb")))
    assert first == ["gpu-0-mig-1g-10gb-6"]
    again = D.best_fit(pool, first, H100)
    second = D.allocate(again, _by_profile("1g.10gb"), allocated=frozenset(first))
    assert second.devices is not None and second.devices[0].gpu == 0
    assert second.devices[0].start not in (0, 6)
    after = frozenset(first) | {d.name for d in second.devices}
    assert _names(D.allocate(again, _by_profile("4g.40gb"), allocated=after)) == [
        "gpu-0-mig-4g-40gb-0"
    ]
    # Profiles keep their order, smallest first: a claim by memory gets the smallest profile.
    assert [d.profile for d in listed.devices[:1]] == ["1g.10gb"]
    assert len(listed.devices) == len(pool.devices)
    with pytest.raises(D.AllocatorError, match="another model"):
        D.best_fit(pool, (), A100)
    with pytest.raises(D.AllocatorError, match="no device gpu-5"):
        D.best_fit(pool, ["gpu-5-mig-1g-10gb-0"], H100)
