"""The device plugin's sans-IO core: resources per strategy, Allocate, preferred allocation,
XID health and the allocation ledger."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.agent.deviceplugin import advertising, allocating, allocations, devices, health
from migpilot.mig import catalog

Strategy = devices.MigStrategy


def make_node(model_id: str, layouts: list[list[tuple[str, int]] | None]) -> devices.NodeDevices:
    """GPUs of one model; ``None`` is a MIG-disabled GPU, a list its MIG devices (profile@start)."""
    model = catalog.resolve_gpu(model_id)
    gpus, migs = [], []
    for i, layout in enumerate(layouts):
        gpus.append(
            devices.Gpu(
                index=i,
                uuid=f"GPU-{i}",
                model=model,
                product_name=model.product_names[0],
                memory_mib=40960,
                mig_enabled=layout is not None,
            )
        )
        for gi, (name, start) in enumerate(layout or [], start=1):
            migs.append(
                devices.MigDevice(
                    uuid=f"MIG-{i}-{name}@{start}",
                    gpu_index=i,
                    profile=model.profile_named(name),
                    start=start,
                    gpu_instance_id=gi,
                    compute_instance_id=0,
                )
            )
    return devices.NodeDevices(gpus=tuple(gpus), mig_devices=tuple(migs))


def ids_by_resource(resources: tuple[devices.Resource, ...]) -> dict[str, list[str]]:
    return {r.name: [d.id for d in r.devices] for r in resources}


MIXED_NODE = make_node(
    "a100-40gb",
    [[("3g.20gb", 0), ("2g.10gb", 4), ("1g.5gb", 6)], None, [("1g.5gb+me", 0), ("1g.5gb", 1)]],
)


# -- resources per strategy ------------------------------------------------------------------


def test_none_advertises_every_gpu_whole_even_mig_enabled() -> None:
    got = ids_by_resource(advertising.resources_for(MIXED_NODE, Strategy.NONE))
    assert got == {"nvidia.com/gpu": ["GPU-0", "GPU-1", "GPU-2"]}


def test_mixed_one_resource_per_profile_and_whole_gpus() -> None:
    got = ids_by_resource(advertising.resources_for(MIXED_NODE, Strategy.MIXED))
    assert got == {
        "nvidia.com/gpu": ["GPU-1"],
        "nvidia.com/mig-1g.5gb": ["MIG-0-1g.5gb@6", "MIG-2-1g.5gb@1"],
        "nvidia.com/mig-1g.5gb.me": ["MIG-2-1g.5gb+me@0"],
        "nvidia.com/mig-2g.10gb": ["MIG-0-2g.10gb@4"],
        "nvidia.com/mig-3g.20gb": ["MIG-0-3g.20gb@0"],
    }


@pytest.mark.parametrize(
    ("resource", "socket"),
    [
        ("nvidia.com/gpu", "nvidia-gpu.sock"),
        ("nvidia.com/mig-1g.10gb", "nvidia-mig-1g.10gb.sock"),
        ("nvidia.com/mig-1g.10gb.me", "nvidia-mig-1g.10gb.me.sock"),
    ],
)
def test_socket_names_are_nvidias(resource: str, socket: str) -> None:
    assert devices.Resource(resource, ()).socket_name == socket


@pytest.mark.parametrize("model", [m.id for m in catalog.gpu_models()])
def test_mig_resource_names_spell_plus_as_dot(model: str) -> None:
    for profile in catalog.resolve_gpu(model).profiles:
        name = devices.mig_resource_name(profile)
        assert name == "nvidia.com/mig-" + profile.name.replace("+", ".")
        assert "+" not in name


def test_mixed_ignores_an_empty_mig_enabled_gpu() -> None:
    node = make_node("h100-80gb", [[], None])
    got = ids_by_resource(advertising.resources_for(node, Strategy.MIXED))
    assert got == {"nvidia.com/gpu": ["GPU-1"]}


def test_single_advertises_uniform_mig_devices_as_gpu() -> None:
    node = make_node("h100-80gb", [[("3g.40gb", 0), ("3g.40gb", 4)], [("3g.40gb", 4)]])
    got = ids_by_resource(advertising.resources_for(node, Strategy.SINGLE))
    assert got == {"nvidia.com/gpu": ["MIG-0-3g.40gb@0", "MIG-0-3g.40gb@4", "MIG-1-3g.40gb@4"]}


def test_single_without_mig_is_whole_gpus() -> None:
    node = make_node("h100-80gb", [None, None])
    got = ids_by_resource(advertising.resources_for(node, Strategy.SINGLE))
    assert got == {"nvidia.com/gpu": ["GPU-0", "GPU-1"]}


@pytest.mark.parametrize(
    ("layouts", "message"),
    [
        (
            [[("1g.10gb", 0)], []],
            "invalid MIG configuration: at least one device with migEnabled=true was not "
            "configured correctly: device 1 has no MIG devices configured",
        ),
        (
            [[("1g.10gb", 0), ("2g.20gb", 2)]],
            "invalid MIG configuration: more than one MIG device type present on node",
        ),
        (
            [[("1g.10gb", 0)], [("3g.40gb", 0)]],
            "invalid MIG configuration: more than one MIG device type present on node",
        ),
        (
            [[("1g.10gb", 0)], None],
            "all devices on the node must be configured with the same migEnabled value",
        ),
    ],
)
def test_single_invariants_fail_with_nvidias_messages(
    layouts: list[list[tuple[str, int]] | None], message: str
) -> None:
    node = make_node("h100-80gb", layouts)
    with pytest.raises(advertising.InvalidMigConfigurationError) as err:
        advertising.resources_for(node, Strategy.SINGLE)
    assert str(err.value) == message
    assert isinstance(err.value, errors.MigpilotError)


def test_unhealthy_devices_are_marked() -> None:
    resources = advertising.resources_for(MIXED_NODE, Strategy.MIXED, unhealthy={"MIG-0-1g.5gb@6"})
    health_of = {d.id: d.health for r in resources for d in r.devices}
    assert health_of["MIG-0-1g.5gb@6"] is devices.Health.UNHEALTHY
    assert {h for i, h in health_of.items() if i != "MIG-0-1g.5gb@6"} == {devices.Health.HEALTHY}


def test_bad_views_are_refused() -> None:
    node = make_node("a30", [[("1g.6gb", 0)]])
    with pytest.raises(errors.AgentConfigError, match="listed twice"):
        devices.NodeDevices(gpus=node.gpus * 2)
    with pytest.raises(errors.AgentConfigError, match="unknown GPU 7"):
        devices.NodeDevices(
            gpus=node.gpus,
            mig_devices=(devices.MigDevice("MIG-x", 7, node.mig_devices[0].profile, 0, 1, 0),),
        )


@pytest.mark.parametrize(
    ("text", "expected"),
    [("none", Strategy.NONE), ("Single", Strategy.SINGLE), (" mixed ", Strategy.MIXED)],
)
def test_strategy_parse(text: str, expected: devices.MigStrategy) -> None:
    assert devices.MigStrategy.parse(text) is expected


def test_unknown_strategies_are_user_errors() -> None:
    with pytest.raises(errors.AgentConfigError, match="unknown MIG strategy 'mix'"):
        devices.MigStrategy.parse("mix")
    with pytest.raises(errors.AgentConfigError, match="unknown device-list strategy"):
        devices.DeviceListStrategy.parse("volume")
    assert devices.DeviceListStrategy.parse("cdi") is devices.DeviceListStrategy.CDI_CRI


# -- Allocate ----------------------------------------------------------------------------------

MIG_1G = advertising.resources_for(MIXED_NODE, Strategy.MIXED)[1]


def test_allocate_envvar_lists_ids_in_request_order() -> None:
    got = allocating.container_allocation(
        MIG_1G, ["MIG-2-1g.5gb@1", "MIG-0-1g.5gb@6"], allocating.AllocateSettings()
    )
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": "MIG-2-1g.5gb@1,MIG-0-1g.5gb@6"}
    assert got.cdi_devices == ()


def test_allocate_cdi_names_like_nvidia() -> None:
    settings = allocating.AllocateSettings(
        device_list_strategies=(devices.DeviceListStrategy.CDI_CRI,)
    )
    got = allocating.container_allocation(MIG_1G, ["MIG-0-1g.5gb@6"], settings)
    assert got.cdi_devices == ("k8s.device-plugin.nvidia.com/gpu=MIG-0-1g.5gb@6",)
    assert dict(got.envs) == {}


def test_allocate_both_strategies_and_custom_vendor() -> None:
    settings = allocating.AllocateSettings(
        device_list_strategies=(
            devices.DeviceListStrategy.ENVVAR,
            devices.DeviceListStrategy.CDI_CRI,
        ),
        cdi_vendor="nvidia.com",
    )
    got = allocating.container_allocation(MIG_1G, ["MIG-0-1g.5gb@6"], settings)
    assert got.cdi_devices == ("nvidia.com/gpu=MIG-0-1g.5gb@6",)
    assert dict(got.envs) == {"NVIDIA_VISIBLE_DEVICES": "MIG-0-1g.5gb@6"}


def test_allocate_rejects_unknown_devices_with_nvidias_message() -> None:
    with pytest.raises(allocating.AllocationError) as err:
        allocating.container_allocation(
            MIG_1G, ["MIG-0-1g.5gb@6", "MIG-0-3g.20gb@0"], allocating.AllocateSettings()
        )
    assert str(err.value) == (
        'invalid allocation request for "nvidia.com/mig-1g.5gb": invalid request: '
        "unknown device: MIG-0-3g.20gb@0"
    )


def test_allocate_refuses_an_id_named_twice_in_one_container() -> None:
    ids = ["MIG-2-1g.5gb@1", "MIG-0-1g.5gb@6", "MIG-2-1g.5gb@1"]
    allocating.check_distinct(MIG_1G, ids[:2])  # distinct: no error
    with pytest.raises(allocating.AllocationError) as err:
        allocating.check_distinct(MIG_1G, ids)
    assert str(err.value) == (
        'invalid allocation request for "nvidia.com/mig-1g.5gb": invalid request: '
        "device MIG-2-1g.5gb@1 is requested more than once for one container"
    )


def test_allocate_cdi_class_is_a_setting() -> None:
    settings = allocating.AllocateSettings(
        device_list_strategies=(devices.DeviceListStrategy.CDI_CRI,), cdi_class="mig"
    )
    got = allocating.answer(["MIG-0-1g.5gb@6", "MIG-2-1g.5gb@1"], settings)
    assert got.cdi_devices == (
        "k8s.device-plugin.nvidia.com/mig=MIG-0-1g.5gb@6",
        "k8s.device-plugin.nvidia.com/mig=MIG-2-1g.5gb@1",
    )
    assert got.mounts == ()


def test_settings_need_a_device_list_strategy() -> None:
    with pytest.raises(errors.AgentConfigError):
        allocating.AllocateSettings(device_list_strategies=())


# -- GetPreferredAllocation ----------------------------------------------------------------


def resource_of(counts: list[int]) -> devices.Resource:
    return devices.Resource(
        "nvidia.com/mig-1g.10gb",
        tuple(
            devices.Device(f"MIG-{g}-{k}", g, devices.Health.HEALTHY)
            for g, n in enumerate(counts)
            for k in range(n)
        ),
    )


def gpus_of(ids: tuple[str, ...]) -> set[int]:
    return {int(i.split("-")[1]) for i in ids}


def test_preferred_packs_onto_one_gpu_with_best_fit() -> None:
    res = resource_of([3, 7, 2])
    got = allocating.preferred_allocation(
        res, available=[d.id for d in res.devices], must_include=[], size=2
    )
    assert got == ("MIG-2-0", "MIG-2-1")  # the smallest GPU that fits keeps GPU 1 whole


def test_preferred_fills_must_include_gpu_first() -> None:
    res = resource_of([3, 7])
    got = allocating.preferred_allocation(
        res, available=[d.id for d in res.devices], must_include=["MIG-1-4"], size=3
    )
    assert got[0] == "MIG-1-4"
    assert gpus_of(got) == {1}


def test_preferred_errors() -> None:
    res = resource_of([2])
    ids = [d.id for d in res.devices]
    with pytest.raises(allocating.AllocationError, match="not enough available devices"):
        allocating.preferred_allocation(res, available=ids, must_include=[], size=3)
    with pytest.raises(allocating.AllocationError, match="unknown device: MIG-9-0"):
        allocating.preferred_allocation(res, available=["MIG-9-0"], must_include=[], size=1)
    with pytest.raises(allocating.AllocationError, match="smaller than"):
        allocating.preferred_allocation(res, available=ids, must_include=ids, size=1)


def min_gpus(groups: dict[int, int], must_gpus: set[int], needed: int) -> int:
    best = None
    free = [g for g in groups if g not in must_gpus]
    for k in range(len(free) + 1):
        for combo in itertools.combinations(free, k):
            if sum(groups[g] for g in combo) + sum(groups.get(g, 0) for g in must_gpus) >= needed:
                best = k
                break
        if best is not None:
            break
    assert best is not None
    return best + len(must_gpus)


@given(
    counts=st.lists(st.integers(0, 7), min_size=1, max_size=6),
    data=st.data(),
)
def test_preferred_allocation_properties(counts: list[int], data: st.DataObject) -> None:
    res = resource_of(counts)
    ids = [d.id for d in res.devices]
    if not ids:
        return
    available = data.draw(st.lists(st.sampled_from(ids), unique=True, min_size=1))
    must = data.draw(st.lists(st.sampled_from(available), unique=True, max_size=2))
    size = data.draw(st.integers(len(must), len(available)))
    got = allocating.preferred_allocation(res, available=available, must_include=must, size=size)
    assert len(got) == size == len(set(got))
    assert set(must) <= set(got) <= set(available)
    groups: dict[int, int] = {}
    for i in available:
        if i not in must:
            groups[int(i.split("-")[1])] = groups.get(int(i.split("-")[1]), 0) + 1
    must_gpus = gpus_of(tuple(must))
    assert len(gpus_of(got) | must_gpus) == min_gpus(groups, must_gpus, size - len(must))


# -- health ------------------------------------------------------------------------------------

H100 = make_node("h100-80gb", [[("3g.40gb", 0), ("2g.20gb", 4), ("1g.10gb", 6)], None])


def hit(event: health.XidEvent, strategy: Strategy = Strategy.MIXED, **kw: object) -> set[str]:
    policy = health.XidPolicy(**kw)  # type: ignore[arg-type]
    return set(health.affected_devices(event, H100, strategy=strategy, policy=policy))


def test_xid_on_a_mig_instance_hits_only_it() -> None:
    assert hit(health.XidEvent("GPU-0", 79, gpu_instance_id=2, compute_instance_id=0)) == {
        "MIG-0-2g.20gb@4"
    }
    assert hit(health.XidEvent("GPU-0", 79, gpu_instance_id=2, compute_instance_id=5)) == set()


def test_xid_for_the_whole_gpu_hits_every_device_on_it() -> None:
    assert hit(health.XidEvent("GPU-0", 79)) == {
        "MIG-0-3g.40gb@0",
        "MIG-0-2g.20gb@4",
        "MIG-0-1g.10gb@6",
    }
    assert hit(health.XidEvent("GPU-1", 48)) == {"GPU-1"}


def test_xid_under_none_strategy_hits_the_whole_gpu() -> None:
    event = health.XidEvent("GPU-0", 79, gpu_instance_id=1, compute_instance_id=0)
    assert hit(event, Strategy.NONE) == {"GPU-0"}


@pytest.mark.parametrize("xid", sorted(health.DEFAULT_IGNORED_XIDS))
def test_nvidias_ignored_xids(xid: int) -> None:
    assert hit(health.XidEvent("GPU-1", xid)) == set()


def test_unknown_gpu_and_disabled_checks() -> None:
    assert hit(health.XidEvent("GPU-9", 79)) == set()
    assert hit(health.XidEvent("GPU-1", 79), enabled=False) == set()
    assert hit(health.XidEvent("GPU-1", 79), ignored=frozenset({79})) == set()


@pytest.mark.parametrize(
    ("text", "enabled", "extra"),
    [("all", False, set()), ("xids", False, set()), ("", True, set()), ("79, 48,", True, {79, 48})],
)
def test_disable_text(text: str, enabled: bool, extra: set[int]) -> None:
    policy = health.XidPolicy.from_disable_text(text)
    assert policy.enabled is enabled
    if enabled:
        assert policy.ignored == health.DEFAULT_IGNORED_XIDS | extra


def test_disable_text_rejects_garbage() -> None:
    with pytest.raises(errors.AgentConfigError, match="'x1' is not a number"):
        health.XidPolicy.from_disable_text("13,x1")


# -- the allocation ledger ---------------------------------------------------------------------


def test_ledger_holds_until_kubelet_lists_then_drops() -> None:
    ledger = allocations.AllocationLedger(grace_s=10)
    ledger.record(["a", "b"], now=0)
    assert ledger.held(now=1) == {"a", "b"}
    ledger.observe_kubelet({"a"}, now=2)
    assert ledger.held(now=50) == {"a"}  # b expired unseen; a is held while listed
    ledger.observe_kubelet({"a"}, now=51)
    assert ledger.held(now=52) == {"a"}
    ledger.observe_kubelet(set(), now=53)
    assert ledger.held(now=53) == set()


def test_ledger_keeps_unseen_devices_for_the_grace_period() -> None:
    ledger = allocations.AllocationLedger(grace_s=10)
    ledger.record(["a"], now=0)
    ledger.observe_kubelet(set(), now=5)
    assert ledger.held(now=9) == {"a"}
    ledger.observe_kubelet(set(), now=10)
    assert ledger.held(now=10) == set()
    ledger.record(["c"], now=20)
    ledger.forget(["c"])
    assert ledger.held(now=20) == set()


def test_ledger_reloads_with_ages_and_what_the_kubelet_saw() -> None:
    ledger = allocations.AllocationLedger(grace_s=10)
    assert ledger.record(["a", "b"], now=100)
    assert ledger.observe_kubelet({"a"}, now=104)
    assert not ledger.observe_kubelet({"a"}, now=105)  # nothing changed
    data = json.loads(json.dumps(ledger.dump(now=106)))
    assert data["devices"]["b"] == {"age_s": 6.0, "seen_by_kubelet": False}
    # Another process, another clock: b keeps the 4 s of grace it had left, a stays held.
    again = allocations.AllocationLedger(grace_s=10)
    again.load(data, now=0.0, source="ledger.json")
    assert again.held(now=3.9) == {"a", "b"}
    again.observe_kubelet({"a"}, now=4.0)
    assert again.held(now=4.0) == {"a"}
    again.observe_kubelet(set(), now=5.0)  # listed before, gone now: the pod is gone
    assert again.held(now=5.0) == set()


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], r"x.json: not an allocation ledger of version 1"),
        ({"version": 2, "devices": {}}, r"x.json: not an allocation ledger of version 1"),
        ({"version": 1, "devices": []}, r"x.json: 'devices' is not a mapping"),
        ({"version": 1, "devices": {"a": {"age_s": -1, "seen_by_kubelet": False}}}, r"'a'"),
        ({"version": 1, "devices": {"a": {"age_s": 1, "seen_by_kubelet": "no"}}}, r"'a'"),
        ({"version": 1, "devices": {"a": {"age_s": True, "seen_by_kubelet": False}}}, r"'a'"),
        ({"version": 1, "devices": {"a": 5}}, r"x.json: device 'a': expected"),
    ],
)
def test_ledger_load_rejects_what_dump_does_not_write(data: object, message: str) -> None:
    ledger = allocations.AllocationLedger()
    with pytest.raises(errors.AgentConfigError, match=message):
        ledger.load(data, now=0.0, source="x.json")
    assert ledger.held(now=0.0) == set()
