"""Unified requests through the real device plugin and the fake kubelet (real gRPC on unix
sockets): ``nvidia.com/gpu`` advertised with one device per instance set aside for unified
pods, concurrent Allocates each answered with their own pod's MIG instances, the per-pod
ledger surviving a restart of the plugin, and Allocates for pods the agent does not know yet.
The Kubernetes side is the in-memory API; the pool is :class:`unifying.UnifiedPool`."""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import random
import threading
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from migpilot.agent.cluster import boundpods, kubeapi
from migpilot.agent.deviceplugin import allocating, devices, resolving, serving
from migpilot.agent.sharing import unifying
from migpilot.api import gpulayouts as gl
from tests.integration.kubelet_fake import FakeKubelet
from tests.integration.test_deviceplugin import make_node

NODE = "n0"
GPU = "nvidia.com/gpu"
R1G = "nvidia.com/mig-1g.10gb"
H = "Healthy"
# GPU 0: seven 1g.10gb; GPU 1: a 3g.40gb and four 1g.10gb. UUIDs are MIG-<gpu>-<profile>-<start>.
VIEW = make_node(
    [
        [("1g.10gb", s) for s in range(7)],
        [("3g.40gb", 0), *(("1g.10gb", s) for s in range(4, 8))],
    ]
)


def uuid(gpu: int, start: int, profile: str = "1g.10gb") -> str:
    return f"MIG-{gpu}-{profile}-{start}"


def pod_doc(
    name: str,
    *counts: int,
    mem: int | None = 8000,
    created: str = "2026-01-01T00:00:00Z",
    node: str | None = NODE,
    resource: str = GPU,
) -> dict[str, Any]:
    containers = []
    for i, n in enumerate(counts):
        limits: dict[str, Any] = {resource: n}
        if mem is not None and resource == GPU:
            limits["nvidia.com/gpumem"] = mem
        containers.append({"name": f"c{i}", "resources": {"limits": limits}})
    spec: dict[str, Any] = {"containers": containers}
    if node is not None:
        spec["nodeName"] = node
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": created,
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


def layout_spec(
    reserved: dict[tuple[int, int, str], str], *, mig: Collection[str] = ()
) -> dict[str, Any]:
    """Every instance of VIEW, some reserved (GPU, start, profile) -> pod: for a unified pod
    (``resource: nvidia.com/gpu``, as the controller writes it) unless the pod is in ``mig``."""
    gpus: dict[int, list[dict[str, Any]]] = {}
    for m in VIEW.mig_devices:
        inst: dict[str, Any] = {"profile": m.profile.name, "start": m.start}
        who = reserved.get((m.gpu_index, m.start, m.profile.name))
        if who is not None:
            inst["reservedFor"] = who
            if who not in mig:
                inst["resource"] = "nvidia.com/gpu"
        gpus.setdefault(m.gpu_index, []).append(inst)
    return {"gpus": [{"index": g, "instances": insts} for g, insts in sorted(gpus.items())]}


@dataclass
class Node:
    api: kubeapi.InMemoryNodeApi
    book: boundpods.PodBook
    pool: unifying.UnifiedPool
    plugin: serving.DevicePlugin
    kubelet: FakeKubelet

    def pass_(self) -> None:
        """What the agent's pass does for the plugin: the pool set aside, advertised."""
        self.plugin.update(self.pool.update(VIEW))

    def visible(self, response: Any) -> list[set[str]]:
        return [
            set(dict(c.envs)["NVIDIA_VISIBLE_DEVICES"].split(","))
            for c in response.container_responses
        ]


def start(
    kubelet: FakeKubelet,
    api: kubeapi.InMemoryNodeApi,
    *,
    ledger: pathlib.Path | None = None,
    wait_s: float = 2.0,
) -> Node:
    """Wired as ``migpilot agent --node`` wires the pool and the plugin."""
    book = boundpods.PodBook()
    book.listed(api.list_pods(node=NODE).items)

    def spec() -> gl.LayoutSpec | None:
        found = api.layout(NODE)
        return found.spec if found is not None else None

    pool = unifying.UnifiedPool(api, node=NODE, pods=book, spec=spec)
    settings = serving.PluginSettings(
        plugin_dir=kubelet.plugin_dir,
        kubelet_poll_s=0.02,
        ledger_file=ledger,
        allocate_wait_s=wait_s,
        allocate_poll_s=0.05,
    )
    plugin = serving.DevicePlugin(settings, unified=pool)
    pool.attach(plugin)
    plugin.start(pool.update(VIEW))
    return Node(api, book, pool, plugin, kubelet)


@pytest.fixture
def api() -> Iterator[kubeapi.InMemoryNodeApi]:
    found = kubeapi.InMemoryNodeApi()
    yield found
    found.close()


def test_nvidia_gpu_advertises_the_unified_instances_and_nothing_twice(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi
) -> None:
    reserved = {
        (0, 0, "1g.10gb"): "ns/u1",
        (0, 1, "1g.10gb"): "ns/u1",
        (1, 0, "3g.40gb"): "ns/u2",
        (0, 2, "1g.10gb"): "ns/mig",  # a nvidia.com/mig-1g.10gb pod: stays under its name
        (0, 3, "1g.10gb"): "ns/absent",  # reserved for a MIG pod: stays under its name too
    }
    api.put_spec(NODE, layout_spec(reserved, mig={"ns/mig", "ns/absent"}))
    api.put_pod(pod_doc("u1", 2))
    api.put_pod(pod_doc("u2", 1, mem=30000, node=None))  # reserved, not bound yet
    api.put_pod(pod_doc("mig", 1, resource=R1G, node=None))
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(GPU, R1G)
        assert kubelet.devices(GPU) == {uuid(0, 0): H, uuid(0, 1): H, uuid(1, 0, "3g.40gb"): H}
        ones = set(kubelet.devices(R1G))
        assert uuid(0, 2) in ones and uuid(0, 3) in ones
        assert not ones & set(kubelet.devices(GPU))
        assert len(ones) + len(kubelet.devices(GPU)) == len(VIEW.mig_devices)
        reads = api.pod_gets
        node.pass_()  # the kinds of pods read once are remembered (the absent one re-read later)
        assert api.pod_gets == reads
    finally:
        node.plugin.stop()


def _told_apart(api: kubeapi.InMemoryNodeApi) -> dict[str, set[str]]:
    """Pods asking 1, 2 and 3 GPUs (told apart by the rule) and their reservations."""
    want = {
        "ns/one": {uuid(0, 6)},
        "ns/two": {uuid(0, 0), uuid(1, 7)},
        "ns/three": {uuid(0, 3), uuid(0, 4), uuid(1, 4)},
    }
    reserved = {}
    for pod, uuids in want.items():
        for m in VIEW.mig_devices:
            if m.uuid in uuids:
                reserved[(m.gpu_index, m.start, m.profile.name)] = pod
    api.put_spec(NODE, layout_spec(reserved))
    for i, (pod, uuids) in enumerate(want.items()):
        api.put_pod(pod_doc(pod.split("/")[1], len(uuids), created=f"2026-01-01T00:00:0{i}Z"))
    return want


def _concurrently(calls: list[Any]) -> list[Any]:
    """Run the calls on threads released together; their results (or exceptions)."""
    barrier = threading.Barrier(len(calls))
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        barrier.wait()
        try:
            results[i] = calls[i]()
        except Exception as err:  # the test inspects it
            results[i] = err

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    return results


def test_concurrent_allocates_each_get_their_pods_instances(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi
) -> None:
    want = _told_apart(api)
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(GPU)
        pool = sorted(kubelet.devices(GPU))
        assert set(pool) == set().union(*want.values())
        rng = random.Random(7)
        for _ in range(3):  # the kubelet's picks are any devices, never the right ones
            rng.shuffle(pool)
        sizes = {len(v): k for k, v in want.items()}
        calls = [lambda n=n: kubelet.allocate(GPU, pool[:n]) for n in sorted(sizes)]
        got = _concurrently(calls)
        for n, response in zip(sorted(sizes), got, strict=True):
            assert not isinstance(response, Exception), response
            assert node.visible(response) == [want[sizes[n]]]
        allocated = node.plugin.pod_allocations()
        assert {k: set(a.devices) for k, a in allocated.items()} == want
        assert node.plugin.handed_out() >= set().union(*want.values())
        # The status reports who uses what, so the controller knows they are allocated.
        assert {u: k for k, v in want.items() for u in v} == node.pool.used_by()
    finally:
        node.plugin.stop()


def test_a_burst_of_interchangeable_pods_shares_out_each_reservation_once(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi
) -> None:
    reserved = {(0, s, "1g.10gb"): f"ns/r{s}" for s in range(6)}
    api.put_spec(NODE, layout_spec(reserved))
    for s in range(6):
        api.put_pod(pod_doc(f"r{s}", 1))
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(GPU)
        ids = sorted(kubelet.devices(GPU))
        assert len(ids) == 6
        got = _concurrently([lambda i=i: kubelet.allocate(GPU, [ids[5 - i]]) for i in range(6)])
        handed = [node.visible(r)[0] for r in got]
        assert sorted(u for h in handed for u in h) == ids  # each instance exactly once
        allocated = node.plugin.pod_allocations()
        assert {k: set(a.devices) for k, a in allocated.items()} == {
            f"ns/r{s}": {uuid(0, s)} for s in range(6)
        }
        # A seventh Allocate has no pod left: it waits, then names the problem.
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [ids[0]])
        assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "no pod bound to this node is waiting for 1 nvidia.com/gpu" in str(
            err.value.details()
        )
    finally:
        node.plugin.stop()


def test_the_ledger_survives_a_restart_of_the_plugin(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi, root: pathlib.Path
) -> None:
    ledger = root / "allocations.json"
    # One pod with two containers (1 then 2 GPUs), and one asking 1 GPU made later.
    reserved = {(0, 0, "1g.10gb"): "ns/a", (0, 1, "1g.10gb"): "ns/a", (0, 2, "1g.10gb"): "ns/a"}
    reserved[(0, 5, "1g.10gb")] = "ns/b"
    api.put_spec(NODE, layout_spec(reserved))
    api.put_pod(pod_doc("a", 1, 2))
    api.put_pod(pod_doc("b", 1, created="2026-01-01T00:00:09Z"))
    node = start(kubelet, api, ledger=ledger)
    kubelet.wait_registered(GPU)
    first = node.visible(kubelet.allocate(GPU, [uuid(0, 5)]))
    assert first == [{uuid(0, 0)}]  # a's first container (not b's, though b's was picked)
    node.plugin.stop()
    assert '"ns/a"' in ledger.read_text()
    # A new plugin (an agent restart) reads the ledger: a's first container is allocated.
    again = start(kubelet, api, ledger=ledger)
    try:
        kubelet.wait_registered(GPU)
        assert again.plugin.pod_allocations()["ns/a"].done == {"c0"}
        assert uuid(0, 0) in again.plugin.handed_out()
        # The next Allocate of 1 GPU is b's: a's next container asks for 2.
        assert again.visible(kubelet.allocate(GPU, [uuid(0, 1)])) == [{uuid(0, 5)}]
        assert again.visible(kubelet.allocate(GPU, [uuid(0, 0), uuid(0, 5)])) == [
            {uuid(0, 1), uuid(0, 2)}
        ]
    finally:
        again.plugin.stop()


def test_a_pod_the_watch_has_not_shown_is_read_from_the_api_or_waited_for(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi
) -> None:
    api.put_spec(NODE, layout_spec({(0, 0, "1g.10gb"): "ns/late", (0, 1, "1g.10gb"): "ns/later"}))
    api.put_pod(pod_doc("late", 1, node=None))
    api.put_pod(pod_doc("later", 1, node=None, created="2026-01-01T00:00:05Z"))
    node = start(kubelet, api, wait_s=5.0)
    try:
        kubelet.wait_registered(GPU)
        # Bound in the API server, not yet in the agent's pod watch: read again at once.
        api.put_pod(pod_doc("late", 1))
        assert node.book.pods(NODE) == ()
        lists = api.pod_lists
        assert node.visible(kubelet.allocate(GPU, [uuid(0, 1)])) == [{uuid(0, 0)}]
        assert api.pod_lists > lists
        # Bound 0.3 s after the kubelet asks: the Allocate waits for it.
        timer = threading.Timer(0.3, lambda: api.put_pod(pod_doc("later", 1)))
        began = time.monotonic()
        timer.start()
        assert node.visible(kubelet.allocate(GPU, [uuid(0, 0)])) == [{uuid(0, 1)}]
        assert 0.3 <= time.monotonic() - began < 5.0
    finally:
        node.plugin.stop()


def test_reserved_instances_that_do_not_exist_are_named(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi
) -> None:
    spec = layout_spec({(0, 0, "1g.10gb"): "ns/p", (0, 1, "1g.10gb"): "ns/q"})
    spec["gpus"][1]["instances"] = [  # GPU 1: a 3g.40gb at 4 reserved for p, not made yet
        {"profile": "3g.40gb", "start": 4, "reservedFor": "ns/p"}
    ]
    api.put_spec(NODE, spec)
    api.put_pod(pod_doc("p", 2))
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(GPU)
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [uuid(0, 0)])
        assert "waiting for 1" in str(err.value.details())  # p asks 2: not this Allocate
        # Two devices asked, as the kubelet would once the second is advertised: another
        # pod's (a device named twice is refused before any pod is looked at).
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [uuid(0, 0), uuid(0, 1)])
        assert str(err.value.details()) == (
            "pod ns/p: the MIG instances reserved for it do not exist: GPU 1 3g.40gb@4"
        )
        assert node.plugin.pod_allocations() == {}
    finally:
        node.plugin.stop()


def test_a_gone_pods_instances_go_back_to_their_profile(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi
) -> None:
    api.put_spec(NODE, layout_spec({(0, 4, "1g.10gb"): "ns/p"}))
    api.put_pod(pod_doc("p", 1))
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(GPU)
        # GetPreferredAllocation steers the kubelet to the pod's own instance.
        assert kubelet.preferred(GPU, available=[uuid(0, 4)], must_include=[], size=1) == [
            uuid(0, 4)
        ]
        kubelet.allocate(GPU, [uuid(0, 4)])
        # The controller drops the reservation once the status says the pod has it: the
        # ledger keeps the instance in the pool while the pod lives.
        api.put_spec(NODE, layout_spec({}))
        node.pass_()
        assert kubelet.devices(GPU) == {uuid(0, 4): H}
        fingerprint = node.pool.fingerprint()
        api.delete_pod("ns", "p")
        node.book.listed(api.list_pods(node=NODE).items)
        assert node.pool.fingerprint() != fingerprint  # a pass is due
        node.pass_()
        assert node.plugin.pod_allocations() == {}
        kubelet.wait_devices(GPU, {})
        kubelet.wait_for(
            lambda s: uuid(0, 4) in s.clients[R1G].lists[-1], "the instance back under its name"
        )
        assert uuid(0, 4) not in node.plugin.handed_out()
    finally:
        node.plugin.stop()


def test_whole_gpu_pods_are_served_as_nvidia_does(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi
) -> None:
    whole = make_node([[("1g.10gb", 0)], None])  # GPU 1 without MIG: nvidia.com/gpu GPU-1
    api.put_spec(NODE, {"gpus": [{"index": 0, "instances": [
        {"profile": "1g.10gb", "start": 0, "reservedFor": "ns/u"}]}]})  # fmt: skip
    api.put_pod(pod_doc("u", 1, created="2026-01-01T00:00:05Z"))
    api.put_pod(pod_doc("w", 1, mem=None))  # nvidia.com/gpu alone: a whole GPU
    node = start(kubelet, api)
    node.plugin.update(node.pool.update(whole))
    try:
        kubelet.wait_devices(GPU, {"GPU-1": H, uuid(0, 0): H})
        # w is older: the kubelet is steered away from the unified pool...
        offered = [uuid(0, 0), "GPU-1"]
        assert kubelet.preferred(GPU, available=offered, must_include=[], size=1) == ["GPU-1"]
        # ...and when the first Allocate of 1 (w's) picks the MIG instance, it is refused.
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [uuid(0, 0)])
        assert "asks for whole GPUs" in str(err.value.details())
        assert node.visible(kubelet.allocate(GPU, ["GPU-1"])) == [{"GPU-1"}]
        assert node.visible(kubelet.allocate(GPU, ["GPU-1"])) == [{uuid(0, 0)}]
        assert set(node.plugin.pod_allocations()) == {"ns/w", "ns/u"}
    finally:
        node.plugin.stop()


def test_other_resources_are_untouched(kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi) -> None:
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(R1G)
        response = kubelet.allocate(R1G, [uuid(0, 3)])
        assert node.visible(response) == [{uuid(0, 3)}]
        assert node.plugin.pod_allocations() == {}
        assert devices.FULL_GPU_RESOURCE not in node.plugin.registered()
    finally:
        node.plugin.stop()


def _allocate_messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the plugin said about its Allocates (its other messages, such as the one saying it
    serves, may fall inside the capture when an earlier test left the logger at INFO)."""
    return [
        m
        for r in caplog.records
        if r.name.endswith("serving") and (m := r.getMessage()).startswith("Allocate")
    ]


def test_allocate_says_what_it_decides_and_why(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi, caplog: pytest.LogCaptureFixture
) -> None:
    whole = make_node([[("1g.10gb", 0)], None])  # GPU 1 without MIG: nvidia.com/gpu GPU-1
    api.put_spec(NODE, {"gpus": [{"index": 0, "instances": [
        {"profile": "1g.10gb", "start": 0, "reservedFor": "ns/u"}]}]})  # fmt: skip
    api.put_pod(pod_doc("u", 1, created="2026-01-01T00:00:05Z"))
    api.put_pod(pod_doc("w", 1, mem=None))  # nvidia.com/gpu alone: a whole GPU
    node = start(kubelet, api, wait_s=0.2)
    node.plugin.update(node.pool.update(whole))
    nobody = (
        "no pod bound to this node is waiting for 1 nvidia.com/gpu (pending, a container "
        "asking for that many not yet allocated)"
    )
    try:
        kubelet.wait_devices(GPU, {"GPU-1": H, uuid(0, 0): H})
        with caplog.at_level(logging.INFO, logger="migpilot.agent.deviceplugin.serving"):
            with pytest.raises(grpc.RpcError) as err:
                kubelet.allocate(GPU, [uuid(0, 0)])
            refused = (
                "pod ns/w asks for whole GPUs (nvidia.com/gpu without gpumem or gpucores) but "
                "the kubelet picked MIG-0-1g.10gb-0, MIG instances set aside for unified pods"
            )
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details() == refused
            assert node.visible(kubelet.allocate(GPU, ["GPU-1"])) == [{"GPU-1"}]
            assert node.visible(kubelet.allocate(GPU, ["GPU-1"])) == [{uuid(0, 0)}]
            # Nobody waits: whole GPUs are answered as NVIDIA's plugin would, and held...
            assert node.visible(kubelet.allocate(GPU, ["GPU-1"])) == [{"GPU-1"}]
            assert "GPU-1" in node.plugin.handed_out()
            # ...a unified instance is not.
            with pytest.raises(grpc.RpcError) as err:
                kubelet.allocate(GPU, [uuid(0, 0)])
            waited = f"{nobody}; waited 0.2 s for the pod to show in the API server"
            assert err.value.details() == waited
        said = _allocate_messages(caplog)
        again = "Allocate of {}: " + nobody + " yet; reading the node's pods again"
        assert said == [
            f"Allocate refused: {refused}",
            "Allocate: pod ns/w container c0 gets GPU-1 (the kubelet picked GPU-1)",
            "Allocate: pod ns/u container c0 gets MIG-0-1g.10gb-0 (the kubelet picked GPU-1)",
            again.format("GPU-1"),
            f"Allocate of GPU-1: {nobody}; answering as NVIDIA's plugin",
            again.format(uuid(0, 0)),
            f"Allocate refused: {waited}",
        ]
    finally:
        node.plugin.stop()


class _Waiting:
    """A unified source that knows no pod; each read is one second later."""

    def __init__(self) -> None:
        self.now = 0.0
        self.reads: list[bool] = []

    def clock(self) -> float:
        return self.now

    def inputs(self, *, fresh: bool) -> resolving.Inputs:
        self.reads.append(fresh)
        self.now += 1.0
        return resolving.Inputs(pods=(), reservations={}, pool=frozenset())


def test_an_allocate_for_an_unknown_pod_reads_again_until_the_wait_is_over(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = _Waiting()
    settings = serving.PluginSettings(
        plugin_dir=tmp_path, allocate_wait_s=3.0, allocate_poll_s=0.001
    )
    dp = serving.DevicePlugin(settings, clock=source.clock, unified=source)
    dp.start(make_node([None, None]))
    try:
        with caplog.at_level(logging.INFO, logger="migpilot.agent.deviceplugin.serving"):
            (answer,) = dp.allocate_containers(GPU, [["GPU-1", "GPU-0"]])
        assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-0"}
        # Read at 0 s from the watch, then from the API at 1 and 2 s: at 3 s the wait is over.
        assert source.reads == [False, True, True]
        nobody = (
            "no pod bound to this node is waiting for 2 nvidia.com/gpu (pending, a container "
            "asking for that many not yet allocated)"
        )
        assert _allocate_messages(caplog) == [
            f"Allocate of GPU-1, GPU-0: {nobody} yet; reading the node's pods again",
            f"Allocate of GPU-1, GPU-0: {nobody}; answering as NVIDIA's plugin",
        ]
    finally:
        dp.stop()


class _Leaving(_Waiting):
    """Knows no pod; the pool holds ``device`` at the first read only (it leaves the pool,
    to be advertised under its profile, while the Allocate waits for its pod)."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device

    def inputs(self, *, fresh: bool) -> resolving.Inputs:
        first = not self.reads
        super().inputs(fresh=fresh)
        pool = frozenset({self.device}) if first else frozenset()
        return resolving.Inputs(pods=(), reservations={}, pool=pool)


def test_an_instance_that_leaves_the_pool_during_the_wait_is_not_answered_as_a_whole_gpu(
    tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The soak's double hold: the kubelet picked a pool instance as nvidia.com/gpu for a pod
    # the plugin could not find; after the wait the instance was no longer in the pool, and
    # the plugin answered it raw as a whole GPU while the kubelet handed it, now listed under
    # nvidia.com/mig-1g.10gb, to another pod.
    instance = uuid(0, 0)
    source = _Leaving(instance)
    settings = serving.PluginSettings(
        plugin_dir=tmp_path, allocate_wait_s=3.0, allocate_poll_s=0.001
    )
    dp = serving.DevicePlugin(settings, clock=source.clock, unified=source)
    view = make_node([[("1g.10gb", 0)], None])
    dp.start(dataclasses.replace(view, unified=frozenset({instance})))
    try:
        with (
            caplog.at_level(logging.INFO, logger="migpilot.agent.deviceplugin.serving"),
            pytest.raises(allocating.AllocationError) as err,
        ):
            dp.allocate_containers(GPU, [[instance]])
        assert "waited 3 s for the pod to show in the API server" in str(err.value)
        assert instance not in dp.handed_out()
        assert not any("answering as NVIDIA" in m for m in _allocate_messages(caplog))
        # Whole GPUs are still answered as NVIDIA's plugin would.
        source.reads.clear()
        (answer,) = dp.allocate_containers(GPU, [["GPU-1"]])
        assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-1"}
    finally:
        dp.stop()


def test_a_device_no_longer_advertised_after_the_wait_is_unknown(tmp_path: pathlib.Path) -> None:
    # The pool never held it at any read, but the plugin's nvidia.com/gpu list dropped it
    # while the Allocate waited (the kubelet picked from the older list).
    instance = uuid(0, 0)
    view = make_node([[("1g.10gb", 0)], None])

    class _Dropping(_Waiting):
        def inputs(self, *, fresh: bool) -> resolving.Inputs:
            if fresh:
                dp.update(view)  # the instance back under nvidia.com/mig-1g.10gb
            return super().inputs(fresh=fresh)

    source = _Dropping()
    settings = serving.PluginSettings(
        plugin_dir=tmp_path, allocate_wait_s=3.0, allocate_poll_s=0.001
    )
    dp = serving.DevicePlugin(settings, clock=source.clock, unified=source)
    dp.start(dataclasses.replace(view, unified=frozenset({instance})))
    try:
        with pytest.raises(allocating.AllocationError) as err:
            dp.allocate_containers(GPU, [[instance]])
        assert str(err.value).endswith(f"unknown device: {instance}")
        assert instance not in dp.handed_out()
    finally:
        dp.stop()


def test_an_allocate_of_a_resource_no_longer_advertised_names_it(tmp_path: pathlib.Path) -> None:
    dp = serving.DevicePlugin(serving.PluginSettings(plugin_dir=tmp_path))
    dp.start(make_node([None]))
    try:
        with pytest.raises(allocating.AllocationError) as err:
            dp.allocate_containers(R1G, [["MIG-0-1g.10gb-0"]])
        assert str(err.value) == (
            'invalid allocation request for "nvidia.com/mig-1g.10gb": invalid request: '
            "unknown device: MIG-0-1g.10gb-0"
        )
    finally:
        dp.stop()


def test_a_whole_gpu_pods_allocation_is_written_before_the_answer(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi, root: pathlib.Path
) -> None:
    ledger = root / "allocations.json"
    whole = make_node([[("1g.10gb", 0)], None])  # GPU 1 without MIG: nvidia.com/gpu GPU-1
    api.put_spec(NODE, {"gpus": [{"index": 0, "instances": [
        {"profile": "1g.10gb", "start": 0, "reservedFor": "ns/u"}]}]})  # fmt: skip
    api.put_pod(pod_doc("u", 1, created="2026-01-01T00:00:05Z"))
    api.put_pod(pod_doc("w", 1, mem=None))  # nvidia.com/gpu alone: a whole GPU
    node = start(kubelet, api, ledger=ledger)
    node.plugin.update(node.pool.update(whole))
    try:
        kubelet.wait_devices(GPU, {"GPU-1": H, uuid(0, 0): H})
        assert node.visible(kubelet.allocate(GPU, ["GPU-1"])) == [{"GPU-1"}]
        # Read back as a restarted agent would, while this plugin still runs.
        restarted = serving.DevicePlugin(
            serving.PluginSettings(plugin_dir=root / "other", ledger_file=ledger)
        )
        assert restarted.pod_allocations() == {
            "ns/w": resolving.PodAllocation("uid-w", False, (("c0", ("GPU-1",)),))
        }
        assert restarted.handed_out() == {"GPU-1"}
    finally:
        node.plugin.stop()


class _Stopping(_Waiting):
    """Knows no pod; the plugin is stopped during the first read from the API, after which
    each read is 50 s later."""

    def __init__(self) -> None:
        super().__init__()
        self.plugin: serving.DevicePlugin | None = None

    def inputs(self, *, fresh: bool) -> resolving.Inputs:
        if fresh and self.plugin is not None:
            self.plugin.stop()
            self.plugin = None
        if len(self.reads) > 1:
            self.now += 49.0
        return super().inputs(fresh=fresh)


def test_an_allocate_waiting_for_its_pod_ends_when_the_plugin_stops(tmp_path: pathlib.Path) -> None:
    source = _Stopping()
    settings = serving.PluginSettings(
        plugin_dir=tmp_path, allocate_wait_s=100.0, allocate_poll_s=0.001
    )
    dp = serving.DevicePlugin(settings, clock=source.clock, unified=source)
    dp.start(make_node([None]))
    source.plugin = dp
    (answer,) = dp.allocate_containers(GPU, [["GPU-0"]])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": "GPU-0"}
    assert source.reads == [False, True]  # not read again until the 100 s are over


def test_a_device_held_under_its_profile_is_not_handed_to_a_unified_pod(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi, caplog: pytest.LogCaptureFixture
) -> None:
    api.put_spec(NODE, layout_spec({}))
    api.put_pod(pod_doc("u", 2))
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(R1G)
        # Handed out as nvidia.com/mig-1g.10gb, then reserved for u: still held.
        assert node.visible(kubelet.allocate(R1G, [uuid(0, 0)])) == [{uuid(0, 0)}]
        api.put_spec(NODE, layout_spec({(0, 0, "1g.10gb"): "ns/u", (0, 1, "1g.10gb"): "ns/u"}))
        node.pass_()
        kubelet.wait_devices(GPU, {uuid(0, 0): H, uuid(0, 1): H})
        with pytest.raises(grpc.RpcError) as err:
            kubelet.allocate(GPU, [uuid(0, 0), uuid(0, 1)])
        assert err.value.details() == (
            "pod ns/u: the MIG instances reserved for it are allocated to another pod: "
            "GPU 0 1g.10gb@0"
        )
        # Released by the kubelet: u gets both, and the log names every device.
        node.plugin.observe_kubelet(frozenset({uuid(0, 0)}))
        node.plugin.observe_kubelet(frozenset())
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="migpilot.agent.deviceplugin.serving"):
            got = node.visible(kubelet.allocate(GPU, [uuid(0, 1), uuid(0, 0)]))
        assert got == [{uuid(0, 0), uuid(0, 1)}]
        assert [r.getMessage() for r in caplog.records] == [
            "Allocate: pod ns/u container c0 gets MIG-0-1g.10gb-0, MIG-0-1g.10gb-1 (the kubelet "
            "picked MIG-0-1g.10gb-1, MIG-0-1g.10gb-0)"
        ]
    finally:
        node.plugin.stop()


def test_a_unified_pod_bound_with_nothing_reserved_gets_a_gated_pods_instance_at_once(
    kubelet: FakeKubelet, api: kubeapi.InMemoryNodeApi, caplog: pytest.LogCaptureFixture
) -> None:
    """soak35c: a HAMi-style pod created while the webhook was down, bound by kube-scheduler
    alone, was refused at every Allocate for 20 minutes (a real kubelet fails it at the first).
    It gets the pool instance of a pod not bound here, the kubelet's pick being another bound
    pod's; that pod then gets its own."""
    reserved = {(0, 0, "1g.10gb"): "ns/gated", (0, 1, "1g.10gb"): "ns/bound"}
    api.put_spec(NODE, layout_spec(reserved))
    api.put_pod(pod_doc("ungated", 1, created="2026-01-01T00:00:00Z"))
    api.put_pod(pod_doc("bound", 1, created="2026-01-01T00:00:01Z"))
    api.put_pod(pod_doc("gated", 1, node=None))
    node = start(kubelet, api)
    try:
        kubelet.wait_registered(GPU)
        with caplog.at_level(logging.INFO, logger="migpilot.agent.deviceplugin.serving"):
            got = kubelet.allocate(GPU, [uuid(0, 1)])
        assert node.visible(got) == [{uuid(0, 0)}]
        assert "takes the reservation of ns/gated, planned again" in caplog.text
        got = kubelet.allocate(GPU, [uuid(0, 0)])
        assert node.visible(got) == [{uuid(0, 1)}]
        assert {k: v.devices for k, v in node.plugin.pod_allocations().items()} == {
            "ns/ungated": frozenset({uuid(0, 0)}),
            "ns/bound": frozenset({uuid(0, 1)}),
        }
    finally:
        node.plugin.stop()
