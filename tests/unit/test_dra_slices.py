"""Publishing the DRA pool through the API: the ResourceSlice boundary in memory, the publisher
(generations, no needless writes, stale slices deleted) and the agent in DRA mode."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.agent import assembling, reconciling
from migpilot.agent import metrics as agent_metrics
from migpilot.agent import running as agent_running
from migpilot.agent.cluster import boundpods, following, kubeapi, resourceslices, sliceapi, statics
from migpilot.agent.deviceplugin import devices
from migpilot.agent.dra import publishing
from migpilot.agent.rules import changes
from migpilot.gpu import backend, clocks, emulated
from migpilot.kube import errors, memory, objects
from migpilot.mig import catalog, layouts

A100 = catalog.resolve_gpu("a100-80gb")
NODE = "node-a"
K = objects.Kind.RESOURCESLICES
U = publishing.Use


def gpu(index: int, *, mig: bool = True) -> publishing.Gpu:
    return publishing.Gpu(index, f"GPU-{index}", A100, mig, 81920)


def writes(server: memory.InMemoryServer) -> tuple[int, int, int]:
    return (
        server.requests["create", K],
        server.requests["replace", K],
        server.requests["delete", K],
    )


def pool_of(server: memory.InMemoryServer, node: str = NODE) -> list[dict[str, Any]]:
    docs = [d for d in server.objects[K].values() if d["spec"]["nodeName"] == node]
    return sorted(docs, key=objects.name_of)


def consistent(docs: list[dict[str, Any]]) -> int:
    """The pool's generation, checked whole: one generation, as many slices as it says."""
    pools = {
        (d["spec"]["pool"]["generation"], d["spec"]["pool"]["resourceSliceCount"]) for d in docs
    }
    assert len(pools) == 1, pools
    ((generation, count),) = pools
    assert count == len(docs)
    return int(generation)


# --- the boundary ------------------------------------------------------------------------------


def test_the_in_memory_server_deletes_as_a_client_asks() -> None:
    server = memory.InMemoryServer()
    server.put(K, {"metadata": {"name": "s"}, "spec": {}})
    assert server.remove(K, "s") is True
    assert server.remove(K, "s") is False  # 404
    assert server.requests["delete", K] == 2 and server.objects[K] == {}


def test_slices_are_listed_by_node_and_driver() -> None:
    api = sliceapi.InMemorySliceApi()
    for name, node, driver in [
        ("b", NODE, "mig.migpilot.io"),
        ("a", NODE, "mig.migpilot.io"),
        ("c", "node-b", "mig.migpilot.io"),
        ("d", NODE, "gpu.nvidia.com"),
    ]:
        api.create_slice({"metadata": {"name": name}, "spec": {"nodeName": node, "driver": driver}})
    listed = api.list_slices(driver="mig.migpilot.io", node=NODE)  # fmt: skip
    assert [objects.name_of(d) for d in listed.items] == ["a", "b"]
    with pytest.raises(errors.ConflictError):
        api.create_slice({"metadata": {"name": "a"}, "spec": {}})
    stale = dict(listed.items[0], metadata={"name": "a", "resourceVersion": "0"})
    with pytest.raises(errors.ConflictError):
        api.replace_slice(stale)
    assert api.delete_slice("a") and not api.delete_slice("a")


# --- the publisher -----------------------------------------------------------------------------


def test_a_pool_is_published_once_and_not_rewritten_while_nothing_changes() -> None:
    api = sliceapi.InMemorySliceApi()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    assert publisher.advertised() is None
    done = publisher.publish((gpu(0), gpu(1)), ())
    assert done is not None and done.generation == 0
    docs = pool_of(api.server)
    assert consistent(docs) == 0 and len(docs) == 2
    assert publisher.published and publisher.advertised() == {}
    for _ in range(3):
        again = publisher.publish((gpu(1), gpu(0)), ())
        assert again is not None and again.nothing
    assert writes(api.server) == (2, 0, 0)
    assert api.server.requests["list", K] == 4  # each publish looks (a deleted slice comes back)


def test_a_counter_change_updates_one_slice_at_its_generation() -> None:
    api = sliceapi.InMemorySliceApi()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    publisher.publish((gpu(0), gpu(1)), ())
    used = publishing.Instance(1, "3g.40gb", 4, "MIG-x", U.OTHER)
    publisher.publish((gpu(0), gpu(1)), (used,))
    assert writes(api.server) == (2, 1, 0)
    docs = pool_of(api.server)
    assert consistent(docs) == 0
    counters = docs[0]["spec"]["sharedCounters"][1]["counters"]
    assert counters["memory-slice-4"] == {"value": "0"}


def test_growing_and_shrinking_bump_the_generation_and_delete_stale_slices() -> None:
    api = sliceapi.InMemorySliceApi()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    publisher.publish((gpu(0), gpu(1)), ())
    four = tuple(gpu(i) for i in range(4))
    publisher.publish(four, ())
    docs = pool_of(api.server)
    assert consistent(docs) == 1 and len(docs) == 3
    assert publisher.generation == 1
    publisher.publish((gpu(0, mig=False),), ())
    docs = pool_of(api.server)
    assert consistent(docs) == 2 and len(docs) == 2
    assert [d["name"] for d in docs[1]["spec"]["devices"]] == ["gpu-0"]
    assert api.server.requests["delete", K] == 1


def test_a_slice_deleted_by_someone_else_comes_back_with_the_next_generation() -> None:
    api = sliceapi.InMemorySliceApi()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    publisher.publish((gpu(0),), ())
    api.server.delete(K, f"{NODE}-mig.migpilot.io-devices-0001")  # a kubelet wiping them
    publisher.publish((gpu(0),), ())
    docs = pool_of(api.server)
    assert len(docs) == 2 and consistent(docs) == 1


def test_other_nodes_slices_are_never_touched() -> None:
    api = sliceapi.InMemorySliceApi()
    resourceslices.SlicePublisher(api, node="node-b").publish((gpu(0),), ())
    theirs = copy.deepcopy(pool_of(api.server, "node-b"))
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    publisher.publish((gpu(0), gpu(1)), ())
    publisher.publish((gpu(0),), ())
    assert pool_of(api.server, "node-b") == theirs


class Refusing(sliceapi.InMemorySliceApi):
    """Refuses the next ``refusals`` replaces with a 409, as a server would after a race."""

    refusals = 0

    def replace_slice(self, body: Any) -> dict[str, Any]:
        if self.refusals:
            self.refusals -= 1
            raise errors.ConflictError("409: the object has been modified")
        return super().replace_slice(body)


def test_a_failed_write_is_reported_and_the_next_publish_finishes_the_pool() -> None:
    api = Refusing()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    publisher.publish((gpu(0), gpu(1)), ())
    api.refusals = 1
    four = tuple(gpu(i) for i in range(4))
    assert publisher.publish(four, ()) is None
    assert not publisher.published and publisher.advertised() is None
    assert publisher.publish(four, ()) is not None
    docs = pool_of(api.server)
    assert len(docs) == 3 and consistent(docs) >= 1


def test_input_that_cannot_be_published_writes_nothing() -> None:
    api = sliceapi.InMemorySliceApi()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    assert publisher.publish((gpu(0), gpu(0)), ()) is None
    assert not publisher.published and writes(api.server) == (0, 0, 0)


# --- from the agent's state --------------------------------------------------------------------


def _state() -> dict[int, changes.GpuState]:
    def info(i: int, mig: bool, model: Any = A100) -> backend.GpuInfo:
        return backend.GpuInfo(i, f"GPU-{i}", "NVIDIA A100-SXM4-80GB", model, 81920,
                               backend.MigMode(mig, mig))  # fmt: skip

    def dev(g: int, profile: str, start: int, uuid: str | None) -> backend.MigDevice:
        return backend.MigDevice(g, start + 1, 0 if uuid else None, profile, start, uuid)

    both = (dev(0, "3g.40gb", 0, "MIG-a"), dev(0, "3g.40gb", 4, "MIG-b"))
    return {
        0: changes.GpuState(info(0, True), both),
        1: changes.GpuState(info(1, True), (dev(1, "1g.10gb", 0, None),)),
        2: changes.GpuState(info(2, False), ()),
        3: changes.GpuState(info(3, False, None), ()),  # not in the catalog: left out
    }  # fmt: skip


def test_inputs_say_who_uses_what_and_fail_closed() -> None:
    state = _state()
    view = agent_running.node_view(state)
    gpus, instances = resourceslices.inputs(
        state, view=view, used=frozenset({"MIG-a", "MIG-b", "GPU-2"}), claimed={"MIG-b": "uid"}
    )
    assert [(g.index, g.mig, g.use) for g in gpus] == [(0, True, U.FREE), (1, True, U.FREE),
                                                       (2, False, U.OTHER)]  # fmt: skip
    assert [(i.gpu, i.start, i.use) for i in instances] == [
        (0, 0, U.OTHER),  # used, not a claim's
        (0, 4, U.CLAIM),
        (1, 0, U.OTHER),  # no MIG device yet: nobody can say
    ]
    _, unknown = resourceslices.inputs(state, view=view, used=None, claimed={})
    assert {i.use for i in unknown} == {U.OTHER}
    # A GPU the pass does not advertise (its MIG mode is being switched) is not published.
    hidden = devices.without_gpus(view, frozenset({0}))
    gpus, instances = resourceslices.inputs(state, view=hidden, used=frozenset(), claimed={})
    assert [g.index for g in gpus] == [1, 2] and all(i.gpu == 1 for i in instances)


def _cluster(labels: dict[str, str]) -> tuple[kubeapi.InMemoryNodeApi, assembling.KubeSide]:
    api = kubeapi.InMemoryNodeApi()
    api.put_node(NODE, labels)
    api.put_spec(NODE, {"gpus": [{"index": 0, "instances": [{"profile": "3g.40gb", "start": 4}]}]})
    source = following.GpuLayoutSource(api, node=NODE)
    source.sync()
    static = statics.StaticOrDynamic(api, dynamic=source)
    static.sync()
    book = boundpods.PodBook()
    side = assembling.kube_side(
        api, source=source, pods=book, strategy=devices.MigStrategy.MIXED, statics=static
    )
    return api, side


def test_only_a_node_labelled_dra_gets_a_publisher() -> None:
    assert assembling.dra_publisher(None) is None
    assert assembling.dra_publisher(_cluster({"migpilot.io/mode": "mig"})[1]) is None
    assert assembling.dra_publisher(_cluster({})[1]) is None
    assert isinstance(
        assembling.dra_publisher(_cluster({"migpilot.io/mode": "dra"})[1]),
        resourceslices.SlicePublisher,
    )


def test_an_agent_in_dra_mode_publishes_its_pool_after_each_pass() -> None:
    api, side = _cluster({"migpilot.io/mode": "dra"})
    publisher = assembling.dra_publisher(side)
    assert publisher is not None
    gpus = emulated.EmulatedBackend([A100], durable=False)
    held = reconciling.InUseSet()
    wired = side.wire(held, gpus=gpus, advertised=publisher.advertised)
    publisher.use_from(wired.in_use.in_use)
    agent = agent_running.Agent(
        gpus=gpus,
        in_use=wired.in_use,
        source=side.desired_source(),
        plugin=None,
        agent_metrics=agent_metrics.AgentMetrics(),
        clock=clocks.VirtualClock(),
        settings=agent_running.AgentSettings(),
        listener=agent_running.Listeners([wired.listener, publisher]),
        view_filter=side.view_filter(),
    )
    assert agent.reconcile().converged
    docs = pool_of(api.server)
    assert consistent(docs) == 0 and publisher.advertised() == {}
    free = docs[0]["spec"]["sharedCounters"][0]["counters"]
    assert free["memory-slice-4"] == {"value": "1"}  # the instance exists, nobody uses it
    uuid = next(d.uuid for d in agent_running.node_view(agent_state(gpus)).mig_devices)
    held.add(uuid)  # a pod of the device plugin, say: not a claim's
    agent.reconcile()
    docs = pool_of(api.server)
    counters = docs[0]["spec"]["sharedCounters"][0]["counters"]
    assert [counters[f"memory-slice-{k}"]["value"] for k in range(8)] == ["1"] * 4 + ["0"] * 4
    assert counters["compute-slices"] == {"value": "4"}
    assert consistent(docs) == 0  # one slice changed: updated in place
    gpus.close()


def agent_state(gpus: backend.GpuBackend) -> dict[int, changes.GpuState]:
    return reconciling.Reconciler(gpus, reconciling.InUseSet()).read()


@st.composite
def _node_states(
    draw: st.DrawFn,
) -> tuple[tuple[publishing.Gpu, ...], tuple[publishing.Instance, ...]]:
    """Up to 10 A100s, MIG on or off, each MIG GPU with a few non-overlapping instances of any
    use."""
    geo = layouts.geometry(A100)
    gpus, instances = [], []
    for index in range(draw(st.integers(0, 10))):
        mig = draw(st.booleans())
        gpus.append(gpu(index, mig=mig))
        if not mig:
            continue
        taken = 0
        for footprint in draw(st.lists(st.sampled_from(geo.placements), max_size=4)):
            if footprint.mask & taken:
                continue
            taken |= footprint.mask
            use = draw(st.sampled_from(list(U)))
            profile = geo.profiles[footprint.profile].name
            instances.append(publishing.Instance(index, profile, footprint.start, "MIG", use))
    return tuple(gpus), tuple(instances)


@settings(max_examples=40, deadline=None)
@given(st.lists(_node_states(), min_size=1, max_size=6))
def test_any_sequence_of_states_leaves_the_api_holding_exactly_the_pool(
    states: list[tuple[tuple[publishing.Gpu, ...], tuple[publishing.Instance, ...]]],
) -> None:
    api = sliceapi.InMemorySliceApi()
    publisher = resourceslices.SlicePublisher(api, node=NODE)
    last = -1
    for gpus, instances in states:
        done = publisher.publish(gpus, instances)
        assert done is not None
        want = publishing.pool(NODE, gpus, instances)
        docs = pool_of(api.server)
        assert [d["spec"] for d in docs] == [d["spec"] for d in want.documents(done.generation)]
        if docs:
            assert consistent(docs) == done.generation >= last
            last = done.generation
        before = writes(api.server)
        again = publisher.publish(gpus, instances)
        assert again is not None and again.nothing and writes(api.server) == before
