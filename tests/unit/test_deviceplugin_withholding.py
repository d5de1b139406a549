"""The device plugin's withholding of MIG devices the agent is destroying, driven directly.

The reconciler calls ``withhold`` before its last in-use check of a destroy; the plugin's
ledger is one of the in-use sources (``handed_out``). Either an Allocate recorded its devices
before the withhold (then the in-use check made after it sees them) or the withhold came first
(then the Allocate is refused, as an unknown device): never both missed. No kubelet: the plugin
serves on sockets of a temporary folder and registers with nobody.
"""

from __future__ import annotations

import dataclasses
import pathlib
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator

import pytest

from migpilot.agent.deviceplugin import allocating, devices, resolving, serving
from migpilot.mig import catalog
from migpilot.sharing import config as sharing_config

MODEL = catalog.resolve_gpu("h100-80gb")
R1G = "nvidia.com/mig-1g.10gb"
R3G = "nvidia.com/mig-3g.40gb"
GPU = "nvidia.com/gpu"


def uuid(gpu: int, start: int, profile: str = "1g.10gb") -> str:
    return f"MIG-{gpu}-{profile}-{start}"


def make_node(layouts: list[list[tuple[str, int]] | None]) -> devices.NodeDevices:
    """H100s; ``None`` is a MIG-disabled GPU. MIG UUIDs name GPU, profile and start."""
    gpus, migs = [], []
    for i, layout in enumerate(layouts):
        gpus.append(devices.Gpu(i, f"GPU-{i}", MODEL, "NVIDIA H100", 81559, layout is not None))
        for gi, (name, start) in enumerate(layout or [], start=1):
            migs.append(
                devices.MigDevice(uuid(i, start, name), i, MODEL.profile_named(name), start, gi, 0)
            )
    return devices.NodeDevices(gpus=tuple(gpus), mig_devices=tuple(migs))


VIEW = make_node([[("1g.10gb", 0), ("1g.10gb", 1), ("3g.40gb", 4)], None])


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="mpw"))  # short: socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def plugin(root: pathlib.Path) -> Iterator[serving.DevicePlugin]:
    dp = serving.DevicePlugin(
        serving.PluginSettings(plugin_dir=root, ledger_file=root / "allocations.json")
    )
    dp.start(VIEW)
    yield dp
    dp.stop()


def ids(plugin: serving.DevicePlugin, resource: str) -> set[str]:
    return {d.id for d in plugin.advertised()[resource]}


def test_a_withheld_mig_device_is_refused_and_not_advertised(
    plugin: serving.DevicePlugin,
) -> None:
    victim = uuid(0, 0)
    plugin.withhold(frozenset({victim}))
    assert ids(plugin, R1G) == {uuid(0, 1)}  # ListAndWatch sends the list without it
    with pytest.raises(allocating.AllocationError) as err:
        plugin.allocate_containers(R1G, [[victim]])
    assert str(err.value) == (
        f'invalid allocation request for "{R1G}": invalid request: unknown device: {victim} '
        "(being destroyed; no longer advertised)"
    )
    assert victim not in plugin.handed_out()
    # The others are handed out as before.
    (answer,) = plugin.allocate_containers(R1G, [[uuid(0, 1)]])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": uuid(0, 1)}
    assert plugin.handed_out() == {uuid(0, 1)}
    # The pass is over (the device was not destroyed after all): advertised and given again.
    plugin.withhold(frozenset())
    assert ids(plugin, R1G) == {uuid(0, 0), uuid(0, 1)}
    plugin.allocate_containers(R1G, [[victim]])
    assert victim in plugin.handed_out()


def test_an_allocate_recorded_before_the_withhold_is_in_use_after_it(
    plugin: serving.DevicePlugin,
) -> None:
    victim = uuid(0, 4, "3g.40gb")
    plugin.allocate_containers(R3G, [[victim]])
    plugin.withhold(frozenset({victim}))
    assert victim in plugin.handed_out()  # the reconciler's re-check refuses the destroy


def test_time_slicing_replicas_of_a_withheld_device_are_refused(root: pathlib.Path) -> None:
    sharing = sharing_config.parse(
        "version: v1\nsharing: {timeSlicing: {resources: [{name: nvidia.com/mig-1g.10gb, "
        "replicas: 2}]}}\n",
        source="test",
    )
    dp = serving.DevicePlugin(serving.PluginSettings(plugin_dir=root, sharing=sharing))
    dp.start(VIEW)
    try:
        victim = uuid(0, 0)
        dp.withhold(frozenset({victim}))
        assert {serving.held_key(i) for i in ids(dp, R1G)} == {uuid(0, 1)}
        with pytest.raises(allocating.AllocationError, match="being destroyed"):
            dp.allocate_containers(R1G, [[f"{victim}::1"]])
        assert victim not in dp.handed_out()
    finally:
        dp.stop()


def _blocking(
    record: Callable[..., bool], entered: threading.Event, go: threading.Event
) -> Callable[..., bool]:
    """``record``, held up in the middle: after the Allocate's check, before its record."""

    def held_up(*args: object, **kwargs: object) -> bool:
        entered.set()
        assert go.wait(10.0)
        return record(*args, **kwargs)

    return held_up


def _race(
    plugin: serving.DevicePlugin,
    allocate: Callable[[], object],
    victim: str,
    monkeypatch: pytest.MonkeyPatch,
    what: str,
) -> None:
    """An Allocate held up between its check and its record while the reconciler withholds
    ``victim`` and re-checks in-use; what that re-check saw."""
    entered, go = threading.Event(), threading.Event()
    ledger = plugin._ledger  # the only place to hold an Allocate up mid-record
    monkeypatch.setattr(ledger, what, _blocking(getattr(ledger, what), entered, go))
    failures: list[BaseException] = []

    def run_allocate() -> None:
        try:
            allocate()
        except BaseException as err:  # reported by the test
            failures.append(err)

    seen: list[bool] = []

    def reconciler() -> None:
        plugin.withhold(frozenset({victim}))
        seen.append(victim in plugin.handed_out())

    allocating_thread = threading.Thread(target=run_allocate)
    allocating_thread.start()
    assert entered.wait(10.0)
    reconciling_thread = threading.Thread(target=reconciler)
    reconciling_thread.start()
    reconciling_thread.join(0.3)  # were withhold not held up by the record, it would be done
    go.set()
    allocating_thread.join(10.0)
    reconciling_thread.join(10.0)
    assert not failures, failures
    assert seen == [True]  # the in-use check after the withhold sees the device handed out


def test_a_withhold_waits_for_an_allocate_between_its_check_and_its_record(
    plugin: serving.DevicePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = uuid(0, 1)
    allocate = lambda: plugin.allocate_containers(R1G, [[victim]])  # noqa: E731
    _race(plugin, allocate, victim, monkeypatch, "record")


# -- the unified nvidia.com/gpu path (docs/unified.md) -------------------------------------------


def unified_pod(name: str, created: str = "2026-01-01T00:00:00Z") -> resolving.GpuPod:
    doc = {
        "metadata": {"name": name, "namespace": "ns", "uid": f"uid-{name}",
                     "creationTimestamp": created},
        "spec": {"nodeName": "n0", "containers": [{"name": "c0", "resources": {
            "limits": {GPU: 1, "nvidia.com/gpumem": 8000}}}]},
        "status": {"phase": "Pending"},
    }  # fmt: skip
    pod = resolving.gpu_pod(doc)
    assert pod is not None and pod.unified
    return pod


class _Reserved:
    """A unified source: pod ``ns/u`` with instance 1g.10gb@0 of GPU 0 reserved for it, and
    both 1g.10gb instances of GPU 0 in the pool."""

    def __init__(self, pods: Iterable[resolving.GpuPod]) -> None:
        self.pods = tuple(pods)

    def inputs(self, *, fresh: bool) -> resolving.Inputs:
        reserved = resolving.Instance(0, 0, "1g.10gb", uuid(0, 0), MODEL)
        return resolving.Inputs(
            pods=self.pods,
            reservations={p.key: (reserved,) for p in self.pods},
            pool=frozenset({uuid(0, 0), uuid(0, 1)}),
        )


@pytest.fixture
def unified(root: pathlib.Path) -> Iterator[serving.DevicePlugin]:
    settings = serving.PluginSettings(plugin_dir=root, allocate_wait_s=0.0)
    dp = serving.DevicePlugin(settings, unified=_Reserved([unified_pod("u")]))
    dp.start(dataclasses.replace(VIEW, unified=frozenset({uuid(0, 0), uuid(0, 1)})))
    yield dp
    dp.stop()


def test_a_unified_pod_is_not_given_a_withheld_instance(unified: serving.DevicePlugin) -> None:
    victim = uuid(0, 0)
    assert ids(unified, GPU) == {"GPU-1", uuid(0, 0), uuid(0, 1)}
    unified.withhold(frozenset({victim}))
    assert ids(unified, GPU) == {"GPU-1", uuid(0, 1)}
    # The kubelet picked another device of the pool, but u would get its reserved instance.
    with pytest.raises(allocating.AllocationError, match=f"unknown device: {victim} "):
        unified.allocate_containers(GPU, [[uuid(0, 1)]])
    assert unified.pod_allocations() == {} and victim not in unified.handed_out()
    unified.withhold(frozenset())
    (answer,) = unified.allocate_containers(GPU, [[uuid(0, 1)]])
    assert answer.envs == {"NVIDIA_VISIBLE_DEVICES": victim}
    assert victim in unified.handed_out()


def test_a_unified_allocate_recorded_before_the_withhold_is_in_use_after_it(
    unified: serving.DevicePlugin,
) -> None:
    victim = uuid(0, 0)
    unified.allocate_containers(GPU, [[victim]])
    unified.withhold(frozenset({victim}))
    assert victim in unified.handed_out()


def test_a_withhold_waits_for_a_unified_allocate_between_its_check_and_its_record(
    unified: serving.DevicePlugin, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = uuid(0, 0)
    _race(
        unified,
        lambda: unified.allocate_containers(GPU, [[victim]]),
        victim,
        monkeypatch,
        "record_container",
    )
