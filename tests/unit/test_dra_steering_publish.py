"""Order steering in the agent's ResourceSlices (docs/dra.md, "Steering kube-scheduler"): the
planner's free placements listed first, slice names that sort in order, moves in place that
never list a device twice nor move a claim's device, the controller's Lease, and the agent in
DRA mode over the in-memory API."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.agent import assembling, reconciling
from migpilot.agent import metrics as agent_metrics
from migpilot.agent import running as agent_running
from migpilot.agent.cluster import (
    boundpods,
    following,
    kubeapi,
    resourceslices,
    sliceapi,
    statics,
)
from migpilot.agent.deviceplugin import devices
from migpilot.agent.dra import placements, publishing
from migpilot.agent.rules import desired
from migpilot.api import gpulayouts, leases
from migpilot.gpu import backend, clocks, emulated
from migpilot.kube import errors, objects
from migpilot.mig import catalog, layouts

A100 = catalog.resolve_gpu("a100-80gb")
NODE = "node-a"
K = objects.Kind.RESOURCESLICES
U = publishing.Use
P = placements.Placement
FIRST = f"{NODE}-mig.migpilot.io-devices-0000"


def gpu(index: int, *, mig: bool = True) -> publishing.Gpu:
    return publishing.Gpu(index, f"GPU-{index}", A100, mig, 81920)


def inst(g: int, profile: str, start: int, use: publishing.Use) -> publishing.Instance:
    return publishing.Instance(g, profile, start, f"MIG-{g}-{profile}-{start}", use)


def name(g: int, profile: str, start: int) -> str:
    return placements.device_name(P(g, profile, start))


def slices(docs: Iterable[Mapping[str, Any]]) -> dict[str, list[str]]:
    """Device slice name -> its devices' names, in order."""
    return {
        d["metadata"]["name"]: [x["name"] for x in d["spec"]["devices"]]
        for d in docs
        if "devices" in d["spec"]
    }


def usable(
    docs: Iterable[Mapping[str, Any]],
    pinned: Iterable[str] = (),
    *,
    every: Iterable[str] | None = None,
) -> bool:
    """What kube-scheduler's allocator (v1.37, ``GatherPools``) makes of the node's slices as
    the API server holds them at one moment: ``False`` when the pool is incomplete, or lists a
    device twice (invalid; ``allocateOne`` skips it: nothing is allocated from it); ``True``
    when it is complete and valid, with every ``pinned`` device there (consuming its counters),
    and every device of ``every`` (the pool's devices, written or moving: a device missing
    for a moment stops consuming its counters while a claim the agent does not know of yet may
    hold it). A complete pool that is otherwise not valid fails the test."""
    docs = [d for d in docs if d["spec"]["nodeName"] == NODE]
    if not docs:
        return False
    newest = max(d["spec"]["pool"]["generation"] for d in docs)
    current = [d for d in docs if d["spec"]["pool"]["generation"] == newest]
    counts = {d["spec"]["pool"]["resourceSliceCount"] for d in current}
    assert len(counts) == 1, counts
    if len(current) != counts.pop():
        return False
    listed = [x for devs in slices(current).values() for x in devs]
    if len(listed) != len(set(listed)):
        return False  # a device listed twice: the pool is invalid, so closed
    sets = {s["name"]: s["counters"] for d in current for s in d["spec"].get("sharedCounters", ())}
    for d in current:
        for dev in d["spec"].get("devices", ()):
            for use in dev["consumesCounters"]:
                assert set(use["counters"]) <= set(sets[use["counterSet"]]), dev["name"]
    missing = set(pinned) - set(listed)
    assert not missing, f"claimed devices missing, consuming nothing: {sorted(missing)}"
    gone = set(every or ()) - set(listed)
    assert not gone, f"devices missing from an open pool, consuming nothing: {sorted(gone)}"
    return True


class Recording(sliceapi.InMemorySliceApi):
    """Keeps every state the API server holds after each write."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[list[dict[str, Any]]] = []

    def _keep(self) -> None:
        self.states.append([dict(d) for d in self.server.objects[K].values()])

    def create_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        out = super().create_slice(body)
        self._keep()
        return out

    def replace_slice(self, body: Mapping[str, Any]) -> dict[str, Any]:
        out = super().replace_slice(body)
        self._keep()
        return out

    def delete_slice(self, name: str) -> bool:
        out = super().delete_slice(name)
        self._keep()
        return out

    def current(self) -> list[dict[str, Any]]:
        return sorted(self.server.objects[K].values(), key=objects.name_of)


# --- the pool ----------------------------------------------------------------------------------


def test_slice_names_sort_in_the_pools_order_the_planned_slice_first() -> None:
    gpus = [gpu(i) for i in range(20)]  # 3 counter slices, 10 home slices: "-10" after "-9"
    pool = publishing.pool(NODE, gpus, [], planned=[P(3, "1g.10gb", 0)])
    assert list(pool.names) == sorted(pool.names) and len(pool.names) == 3 + 1 + 10
    device_slices = [n for n, c in zip(pool.names, pool.contents, strict=True) if "devices" in c]
    assert device_slices[0] == FIRST
    assert device_slices[-1] == f"{NODE}-mig.migpilot.io-devices-0010"
    assert all("sharedCounters" in c for c in pool.contents[:3])  # counter slices stay valid
    assert usable(pool.documents(0))


def test_the_free_planned_placements_are_listed_first_smallest_first() -> None:
    planned = [P(0, "3g.40gb", 4), P(1, "2g.20gb", 2), P(0, "1g.10gb", 0), P(1, "1g.10gb", 0)]
    pool = publishing.pool(NODE, [gpu(0), gpu(1)], [], planned=planned)
    got = slices(pool.documents(0))
    assert got[FIRST] == [
        name(0, "1g.10gb", 0),
        name(1, "1g.10gb", 0),
        name(1, "2g.20gb", 2),
        name(0, "3g.40gb", 4),
    ]
    plain = slices(publishing.pool(NODE, [gpu(0), gpu(1)], []).documents(0))
    (home,) = plain.values()  # two A100s: 50 devices, one home slice
    want_home = [d for d in home if d not in got[FIRST]]
    assert got[f"{NODE}-mig.migpilot.io-devices-0001"] == want_home  # the rest as before
    assert usable(pool.documents(0))


def test_planned_placements_that_cannot_be_allocated_now_are_not_listed_first() -> None:
    gpus = [gpu(0), gpu(1), gpu(2, mig=False)]
    instances = [
        inst(0, "3g.40gb", 4, U.OTHER),  # used by a device-plugin pod
        inst(1, "1g.10gb", 0, U.CLAIM),  # a claim's
        inst(1, "2g.20gb", 2, U.FREE),  # free: offered, and listed first when planned
    ]
    planned = [
        P(0, "1g.10gb", 4),  # inside the used 3g.40gb
        P(0, "7g.80gb", 0),  # over the used 3g.40gb too
        P(0, "4g.40gb", 0),  # beside it: free
        P(1, "1g.10gb", 0),  # the claim's own: allocated
        P(1, "2g.20gb", 2),
        P(0, "1g.10gb", 7),  # no such start
        P(0, "9g.99gb", 0),  # no such profile
        P(7, "1g.10gb", 0),  # no such GPU
        P(2, "1g.10gb", 0),  # MIG off
        P(0, "1g.10gb", 0),
        P(0, "1g.10gb", 0),  # twice
    ]
    pool = publishing.pool(NODE, gpus, instances, planned=planned)
    assert slices(pool.documents(0))[FIRST] == [
        name(0, "1g.10gb", 0),
        name(1, "2g.20gb", 2),
        name(0, "4g.40gb", 0),
    ]
    assert pool.pinned == {name(1, "1g.10gb", 0)}
    assert usable(pool.documents(0), pool.pinned)


def test_nothing_planned_means_no_first_slice() -> None:
    pool = publishing.pool(NODE, [gpu(0)], [], planned=[P(0, "1g.10gb", 7)])  # none valid
    assert FIRST not in pool.names
    assert pool == publishing.pool(NODE, [gpu(0)], [])


def test_the_first_slice_holds_at_most_a_slices_devices() -> None:
    gpus = [gpu(i) for i in range(10)]
    planned = [P(g, "1g.10gb", s) for g in range(10) for s in range(7)]  # 70 placements
    pool = publishing.pool(NODE, gpus, [], planned=planned)
    got = slices(pool.documents(0))
    assert got[FIRST] == [name(g, "1g.10gb", s) for g in range(10) for s in range(7)][:64]
    assert all(len(devs) <= publishing.MAX_DEVICES for devs in got.values())
    assert usable(pool.documents(0))


def test_a_claims_device_stays_in_the_first_slice_and_free_ones_go_home() -> None:
    before = publishing.pool(NODE, [gpu(0)], [], planned=[P(0, "1g.10gb", 0), P(0, "1g.10gb", 1)])
    listed = publishing.listed_first(NODE, before.documents(0))
    assert listed == {name(0, "1g.10gb", 0), name(0, "1g.10gb", 1)}
    claimed = [inst(0, "1g.10gb", 0, U.CLAIM)]
    after = publishing.pool(
        NODE, [gpu(0)], claimed, planned=[P(0, "3g.40gb", 4)], listed_first=listed
    )
    got = slices(after.documents(0))
    assert got[FIRST] == [name(0, "1g.10gb", 0), name(0, "3g.40gb", 4)]
    assert name(0, "1g.10gb", 1) in got[f"{NODE}-mig.migpilot.io-devices-0001"]
    # With no plan at all (the Lease stale), the claim's device still stays where it is.
    plain = publishing.pool(NODE, [gpu(0)], claimed, listed_first=listed)
    assert slices(plain.documents(0))[FIRST] == [name(0, "1g.10gb", 0)]


def test_the_planned_placements_of_a_spec_are_its_instances() -> None:
    spec = gpulayouts.LayoutSpec(
        (
            gpulayouts.GpuSpec(0, None, (gpulayouts.InstanceSpec("3g.40gb", 4, "ns/a"),)),
            gpulayouts.GpuSpec(2, None, (gpulayouts.InstanceSpec("1g.10gb", 0),)),
        )
    )
    assert publishing.planned_placements(spec) == (P(0, "3g.40gb", 4), P(2, "1g.10gb", 0))
    assert publishing.planned_placements(None) == ()


# --- the writes --------------------------------------------------------------------------------


def publish_all(
    steps: Iterable[tuple[tuple[publishing.Instance, ...], tuple[P, ...]]],
    gpus: tuple[publishing.Gpu, ...] = (gpu(0),),
) -> Recording:
    """Publishes each (instances, plan) in turn, and checks every state the API server held
    on the way: valid (or incomplete: nothing allocated), each claim's device there, and within
    a generation never moved from its slice."""
    api = Recording()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    for instances, planned in steps:
        start = len(api.states)
        listed = publishing.listed_first(NODE, api.current())
        writes = publisher.publish(gpus, instances, planned=planned)
        assert writes is not None
        pinned = {name(i.gpu, i.profile, i.start) for i in instances if i.use is U.CLAIM}
        seen = [api.states[start - 1]] if start else []
        # A device there before and after is there in every open state between.
        before = {x for s in seen for devs in slices(s).values() for x in devs}
        every = before & {x for devs in slices(api.current()).values() for x in devs}
        for state in seen + api.states[start:]:
            usable(state, pinned, every=every)
        for before, after in itertools.pairwise(seen + api.states[start:]):
            if len({d["spec"]["pool"]["generation"] for d in before + after}) == 1:
                was = {x: n for n, devs in slices(before).items() for x in devs}
                now = {x: n for n, devs in slices(after).items() for x in devs}
                for device in pinned & set(was):
                    assert now.get(device) == was[device], f"{device} moved in place"
        want = publishing.pool(NODE, gpus, instances, planned=planned, listed_first=listed)
        got = [d["spec"] for d in api.current()]
        assert got == [d["spec"] for d in want.documents(writes.generation)]
    return api


def test_a_change_of_plan_moves_devices_in_place_never_missing_one() -> None:
    api = Recording()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    publisher.publish((gpu(0),), (), planned=(P(0, "1g.10gb", 0), P(0, "2g.20gb", 2)))
    first = len(api.states)
    b = (P(0, "3g.40gb", 4), P(0, "1g.10gb", 1))
    writes = publisher.publish((gpu(0),), (), planned=b)
    assert writes is not None and writes.generation == 0  # in place, at the generation
    moves = api.states[first:]
    # The planned slice and its home trade devices: the first slice is first written with
    # the devices it gains and still those it loses, then the home whole (its leavers are in
    # the first slice by then), then the first slice whole. No device is ever missing; until
    # the last write some are listed twice, so the pool is closed (invalid) for that moment.
    # The counters are not written.
    assert len(moves) == 3
    home = f"{NODE}-mig.migpilot.io-devices-0001"
    gained, kept = [name(0, "1g.10gb", 1), name(0, "3g.40gb", 4)], name(0, "1g.10gb", 0)
    assert slices(moves[0])[FIRST] == [*gained, kept, name(0, "2g.20gb", 2)]
    assert not usable(moves[0]) and not usable(moves[1])
    assert kept in slices(moves[1])[home] and name(0, "3g.40gb", 4) not in slices(moves[1])[home]
    assert slices(moves[2])[FIRST] == gained and usable(moves[2])
    every = {x for devs in slices(api.states[first - 1]).values() for x in devs}
    for state in api.states:
        usable(state, every=every)
    assert publish_all([((), ()), ((), b), ((), (P(0, "7g.80gb", 0),))])


def test_a_claims_device_is_never_moved_while_the_plan_changes() -> None:
    claimed = (inst(0, "1g.10gb", 0, U.CLAIM),)
    steps = [
        ((), (P(0, "1g.10gb", 0), P(0, "1g.10gb", 1))),
        (claimed, (P(0, "1g.10gb", 0), P(0, "1g.10gb", 1))),  # allocated and prepared
        (claimed, (P(0, "3g.40gb", 4),)),  # the plan moves on: 1g.10gb@1 goes home
        (claimed, ()),  # the Lease stale: nothing planned; the claim's device stays first
        ((), ()),  # released: the first slice goes away (a new generation)
    ]
    api = publish_all(steps)
    with_first = [slices(s)[FIRST] for s in api.states if FIRST in slices(s)]
    assert with_first[-1] == [name(0, "1g.10gb", 0)]
    assert FIRST not in slices(api.current())


def test_a_claims_device_that_would_move_in_place_makes_a_new_generation() -> None:
    """Pinned devices are never moved in place (reconcile writes a new generation instead)."""
    before = publishing.pool(NODE, [gpu(0)], [], planned=[P(0, "1g.10gb", 0)])
    existing = [
        {**d, "metadata": {**d["metadata"], "resourceVersion": "1"}} for d in before.documents(5)
    ]
    # The same slices, but the claim's device back in its home while a free one takes the
    # first slice (what a pool made without the first slice's record would say).
    pool = publishing.pool(
        NODE, [gpu(0)], [inst(0, "1g.10gb", 0, U.CLAIM)], planned=[P(0, "1g.10gb", 1)]
    )
    writes = publishing.reconcile(pool, existing)
    assert writes.generation == 6 and len(writes.update) == len(pool.names)
    free = publishing.pool(NODE, [gpu(0)], [], planned=[P(0, "1g.10gb", 1)])
    assert publishing.reconcile(free, existing).generation == 5  # free: moved in place


@st.composite
def _steps(
    draw: st.DrawFn,
) -> list[tuple[tuple[publishing.Instance, ...], tuple[P, ...]]]:
    """A sequence of plans on 3 A100s, with claims' instances coming and going (allocated
    from the first slice or elsewhere), and stale Leases (no plan)."""
    geo = layouts.geometry(A100)
    out = []
    for _ in range(draw(st.integers(1, 6))):
        instances = []
        for g in range(3):
            taken = 0
            for fp in draw(st.lists(st.sampled_from(geo.placements), max_size=3)):
                if fp.mask & taken:
                    continue
                taken |= fp.mask
                profile = geo.profiles[fp.profile].name
                use = draw(st.sampled_from([U.CLAIM, U.CLAIM, U.FREE, U.OTHER]))
                instances.append(inst(g, profile, fp.start, use))
        plan = [
            P(g, geo.profiles[fp.profile].name, fp.start)
            for g in range(3)
            for fp in draw(st.lists(st.sampled_from(geo.placements), max_size=4))
        ]
        out.append((tuple(instances), tuple(plan)))
    return out


@settings(max_examples=60, deadline=None)
@given(_steps())
def test_every_state_between_any_plans_is_valid_and_claims_never_move_in_place(
    steps: list[tuple[tuple[publishing.Instance, ...], tuple[P, ...]]],
) -> None:
    api = publish_all(steps, (gpu(0), gpu(1), gpu(2)))
    assert api.states


# --- the controller's Lease --------------------------------------------------------------------


def lease(renewed: str, holder: str | None = "controller-0") -> dict[str, Any]:
    spec: dict[str, Any] = {"leaseDurationSeconds": 15, "renewTime": renewed}
    if holder is not None:
        spec["holderIdentity"] = holder
    return {"metadata": {"name": leases.NAME, "namespace": leases.NAMESPACE}, "spec": spec}


T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z
RENEWED = "2027-01-15T08:00:00.000000Z"


def test_the_lease_is_fresh_while_renewed_and_read_at_most_every_two_seconds() -> None:
    now = [T0 + 1]
    reads: list[dict[str, Any] | None] = [lease(RENEWED)]
    calls = []

    def read() -> dict[str, Any] | None:
        calls.append(now[0])
        return reads[-1]

    fresh = resourceslices.controller_lease(read, clock=lambda: now[0])
    assert fresh.fresh() and fresh.fresh() and len(calls) == 1  # cached
    now[0] = T0 + 14
    assert fresh.fresh() and len(calls) == 2
    now[0] = T0 + 15.5  # renewTime + 15 s passed
    assert not fresh.fresh()
    reads.append(None)  # deleted: not fresh at once
    now[0] = T0 + 1
    assert not fresh.fresh()  # a clock that went back reads again
    reads.append(lease(RENEWED, holder=None))
    now[0] = T0 + 4
    assert not fresh.fresh()  # nobody holds it


def test_a_failed_read_keeps_the_last_lease_judged_by_its_renew_time() -> None:
    now = [T0 + 1]
    failing = [False]

    def read() -> dict[str, Any] | None:
        if failing[0]:
            raise errors.KubeApiError("timed out")
        return lease(RENEWED)

    fresh = resourceslices.controller_lease(read, clock=lambda: now[0])
    assert fresh.fresh()
    failing[0] = True
    now[0] = T0 + 10
    assert fresh.fresh()  # one slow read is no reason to drop the plan
    now[0] = T0 + 16
    assert not fresh.fresh()  # but a controller that stopped renewing goes stale on time
    never = resourceslices.controller_lease(read, clock=lambda: now[0])
    assert not never.fresh()  # no Lease read yet: not fresh


def test_the_plan_is_listed_first_only_while_the_lease_is_fresh() -> None:
    api = Recording()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    fresh = [True]
    publisher.steer_from(lambda: (P(0, "1g.10gb", 0),), fresh=lambda: fresh[0])
    state = _state()
    view = agent_running.node_view(state)
    publisher.passed(state=state, report=None, labels={}, view=view)
    assert slices(api.current())[FIRST] == [name(0, "1g.10gb", 0)]
    fresh[0] = False  # stale: plain publishing
    publisher.passed(state=state, report=None, labels={}, view=view)
    assert FIRST not in slices(api.current())
    for state_ in api.states:
        usable(state_)

    def broken() -> tuple[P, ...]:
        raise ValueError("no spec")

    fresh[0] = True
    publisher.steer_from(broken, fresh=lambda: True)
    publisher.passed(state=state, report=None, labels={}, view=view)
    assert FIRST not in slices(api.current()) and publisher.published


def _state() -> dict[int, Any]:
    gpus = emulated.EmulatedBackend([A100], durable=False)
    try:
        return reconciling.Reconciler(gpus, reconciling.InUseSet()).read()
    finally:
        gpus.close()


# --- the spec in DRA mode ----------------------------------------------------------------------


def test_in_dra_mode_no_instance_of_the_spec_is_made() -> None:
    """The spec is the planner's target, reserved for pods or not (the controller writes a DRA
    node's target without reservations): the plugin makes each placement kube-scheduler
    allocates, so the agent makes none; one already there is kept, free."""
    spec = gpulayouts.LayoutSpec(
        (
            gpulayouts.GpuSpec(
                0,
                None,
                (
                    gpulayouts.InstanceSpec("3g.40gb", 4, "ns/a"),  # planned for a pod
                    gpulayouts.InstanceSpec("1g.10gb", 0, "ns/b"),  # planned, already there
                    gpulayouts.InstanceSpec("1g.10gb", 1),  # the target, unreserved: not made
                    gpulayouts.InstanceSpec("1g.10gb", 2),  # unreserved, already there
                ),
            ),
        )
    )
    there = [
        backend.MigDevice(0, 1, 0, "1g.10gb", 0, "MIG-x"),
        backend.MigDevice(0, 2, 0, "1g.10gb", 2, "MIG-y"),
    ]
    got = desired.for_dra(spec, current={0: there})
    assert got.gpus[0].instances == (
        gpulayouts.InstanceSpec("1g.10gb", 0),  # kept, not reserved: free, offered
        gpulayouts.InstanceSpec("1g.10gb", 2),
    )


# --- the agent in DRA mode ---------------------------------------------------------------------


def _dra_agent(
    spec: Mapping[str, Any], clock: Callable[[], float]
) -> tuple[
    kubeapi.InMemoryNodeApi,
    agent_running.Agent,
    emulated.EmulatedBackend,
    following.GpuLayoutSource,
]:
    api = kubeapi.InMemoryNodeApi()
    api.put_node(NODE, {"migpilot.io/mode": "dra"})
    api.put_spec(NODE, spec)
    source = following.GpuLayoutSource(api, node=NODE)
    source.sync()
    static = statics.StaticOrDynamic(api, dynamic=source)
    static.sync()
    side = assembling.kube_side(
        api,
        source=source,
        pods=boundpods.PodBook(),
        strategy=devices.MigStrategy.MIXED,
        statics=static,
    )
    gpus = emulated.EmulatedBackend([A100], durable=False)
    dra = assembling.wire_dra(
        side,
        reconciling.InUseSet(),
        gpus=gpus,
        settings=assembling.ClusterSettings(node=NODE),
        clock=clock,
    )
    agent = agent_running.Agent(
        gpus=gpus,
        in_use=dra.wired.in_use,
        source=side.desired_source(),
        plugin=None,
        agent_metrics=agent_metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=agent_running.AgentSettings(),
        listener=dra.listener,
        view_filter=side.view_filter(),
    )
    return api, agent, gpus, source


def _plan_listed(
    layout: gpulayouts.GpuLayout,
) -> tuple[gpulayouts.ConditionStatus, int | None] | None:
    assert layout.status is not None
    for c in layout.status.conditions:
        if c.type == gpulayouts.PLAN_LISTED:
            return c.status, c.observed_generation
    return None


def test_an_agent_in_dra_mode_lists_its_gpulayouts_plan_first_while_the_lease_is_fresh() -> None:
    spec = {
        "gpus": [
            {
                "index": 0,
                "instances": [
                    {"profile": "3g.40gb", "start": 4, "reservedFor": "ns/big"},
                    {"profile": "1g.10gb", "start": 0, "reservedFor": "ns/small"},
                    {"profile": "1g.10gb", "start": 1},
                ],
            }
        ]
    }
    now = [T0 + 1]
    api, agent, gpus, _ = _dra_agent(spec, lambda: now[0])
    try:
        api.server.put(objects.Kind.LEASES, lease(RENEWED))
        assert agent.reconcile().converged
        made = {(d.profile, d.start) for d in gpus.mig_devices(0)}
        assert made == set()  # the target's placements are the DRA plugin's to make
        docs = sorted(api.server.objects[K].values(), key=objects.name_of)
        assert slices(docs)[FIRST] == [
            name(0, "1g.10gb", 0),
            name(0, "1g.10gb", 1),  # reserved for no pod (as the controller writes it): first too
            name(0, "3g.40gb", 4),
        ]
        layout = api.layout(NODE)
        assert layout is not None and layout.status is not None
        reported = {i.state for g in layout.status.gpus for i in g.instances}
        assert gpulayouts.InstanceState.RESERVED not in reported
        # the status says the plan is listed, at the spec's generation (the controller lets
        # the pods it steers go on it)
        assert _plan_listed(layout) == (gpulayouts.ConditionStatus.TRUE, layout.generation)
        now[0] = T0 + 20  # the controller stopped renewing: plain publishing at the next pass
        agent.reconcile()
        docs = sorted(api.server.objects[K].values(), key=objects.name_of)
        assert FIRST not in slices(docs) and usable(docs)
        layout = api.layout(NODE)
        assert layout is not None
        assert _plan_listed(layout) == (gpulayouts.ConditionStatus.FALSE, layout.generation)
    finally:
        gpus.close()


def _writes(
    api: kubeapi.InMemoryNodeApi, since: str
) -> tuple[list[int], list[tuple[int, str | None, int | None]]]:
    """The resource versions of the ResourceSlices written after ``since``, and of the
    GpuLayout status writes with their ``PlanListed`` (status, observed generation), in the
    server's order (it is closed: the watches end at the last change)."""
    api.server.close()
    sliced = [
        int(e.object["metadata"]["resourceVersion"])
        for e in api.server.watch(K, resource_version=since)
    ]
    statuses = []
    for e in api.server.watch(objects.Kind.LAYOUTS, resource_version=since):
        version = int(e.object["metadata"]["resourceVersion"])
        listed = [
            (c.get("status"), c.get("observedGeneration"))
            for c in (e.object.get("status") or {}).get("conditions", ())
            if c.get("type") == gpulayouts.PLAN_LISTED
        ]
        statuses.append((version, *(listed[0] if listed else (None, None))))
    return sliced, statuses


@pytest.mark.parametrize("first", [True, False], ids=["first-pass", "new-plan"])
def test_wire_dra_tells_the_slices_of_a_pass_before_its_status(first: bool) -> None:
    """The status says the plan is listed only once that pass's slices are written: the
    controller lets steered pods go on it (controller/pinning.listed). Told status first, the
    first pass would report the plan unlisted and a new plan's pass the last plan listed at
    the new generation, before its slices list it."""
    spec: dict[str, Any] = {
        "gpus": [{"index": 0, "instances": [{"profile": "3g.40gb", "start": 4}]}]
    }
    api, agent, gpus, source = _dra_agent(spec, lambda: T0 + 1)
    try:
        api.server.put(objects.Kind.LEASES, lease(RENEWED))
        if not first:
            assert agent.reconcile().converged
            spec["gpus"][0]["instances"] = [{"profile": "2g.20gb", "start": 0}]
            api.put_spec(NODE, spec)  # the controller's next plan: generation 2
            source.sync()  # as the GpuLayout's watch would
        since = api.server.version
        agent.reconcile()
        generation = 1 if first else 2
        planned = name(0, "3g.40gb", 4) if first else name(0, "2g.20gb", 0)
        assert planned in slices(api.server.objects[K].values())[FIRST]
        sliced, statuses = _writes(api, since)
        listed = [v for v, status, gen in statuses if status == "True" and gen == generation]
        assert sliced and listed, (sliced, statuses)
        assert max(sliced) < min(listed)
    finally:
        gpus.close()


def test_a_move_that_would_overfill_a_slice_for_a_moment_makes_a_new_generation() -> None:
    """Added before removed, the first slice would hold both plans' devices for a moment: more
    than a slice may, so the change is written as a new generation instead."""
    gpus = tuple(gpu(g) for g in range(8))
    small = [P(g, "1g.10gb", s) for g in range(8) for s in range(7)]  # 56 devices
    other = [P(g, "2g.20gb", s) for g in range(8) for s in (0, 2, 4)]  # 24 others
    assert len(small) + len(other) > publishing.MAX_DEVICES
    before = publishing.pool(NODE, gpus, [], planned=small)
    existing = [
        {**d, "metadata": {**d["metadata"], "resourceVersion": "1"}} for d in before.documents(3)
    ]
    after = publishing.pool(
        NODE, gpus, [], planned=other, listed_first=publishing.listed_first(NODE, existing)
    )
    assert publishing.reconcile(after, existing).generation == 4
    fewer = publishing.pool(
        NODE, gpus, [], planned=other[:8], listed_first=publishing.listed_first(NODE, existing)
    )
    assert publishing.reconcile(fewer, existing).generation == 3  # fits: in place
