"""The real v1.37.2 kube-scheduler allocates as the simulator's model says, and steering by
device taints and by device order works there.

A KWOK node's pool is published from :func:`migpilot.planning.draalloc.publish` (a slice of counter
sets and a slice of devices, placements listed by start slot, largest first), under a driver of
its own so that no other test's slices or classes meet it. Then, on the real scheduler:

- a claim by memory (``memory >= 10G``) gets the first placement in slice order, the
  ``7g.80gb``, as :func:`draalloc.allocate` predicts: first fit in walk order;
- with every placement but one tainted ``mig.migpilot.io/unplanned:NoSchedule`` in the slice
  (:func:`draalloc.steering_taints`), the same claim gets that one;
- a DeviceTaintRule (``resource.k8s.io/v1``, on by default) tainting that last placement leaves
  a claim pending; deleting the rule lets it be allocated;
- on a second node, with the planned placement alone in a device slice whose name sorts first
  by string (``-10`` before ``-2``), though created last, the claim gets the planned placement
  (:func:`draalloc.planned_first`: the allocator walks slices sorted by name), and a second
  claim, with the planned placement taken, gets the first free placement of the other slice,
  as the model predicts: nothing blocks it.

Every wait has a generous timeout; no duration decides whether a test passes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightkube
import pytest
from lightkube import codecs
from lightkube.resources.core_v1 import Node, Pod
from lightkube.resources.resource_v1 import (
    DeviceClass,
    DeviceTaintRule,
    ResourceClaim,
    ResourceSlice,
)

from migpilot.mig import catalog
from migpilot.planning import draalloc, draclaims
from tests.kube.controlplane import Component, ControlPlane, wait_for

pytestmark = pytest.mark.kube

DRIVER = "steer-test.migpilot.io"
CLASS = "migpilot-steer-test"
NODE = "dra-steer-0"
ORDERED = "dra-steer-1"
NS = "default"
H100 = catalog.resolve_gpu("h100-80gb")
POOL = draalloc.publish(NODE, H100, gpus=1, order=draalloc.DeviceOrder.START)
TEN_GB = draclaims.Selector(min_memory_mib=9537)


def _qualified(name: str) -> str:
    # Fully qualified attribute names, so the model's CEL (keyed by mig.migpilot.io) applies
    # whatever driver publishes them.
    return f"{draalloc.DRIVER}/{name}"


def _device(device: draalloc.Device, taints: tuple[draalloc.Taint, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": device.name,
        "attributes": {
            _qualified("profile"): {"string": device.profile},
            _qualified("model"): {"string": device.model},
            _qualified("start"): {"int": device.start},
            _qualified("index"): {"int": device.gpu},
        },
        "capacity": {_qualified("memory"): {"value": f"{device.memory_mib}Mi"}},
        "consumesCounters": [
            {
                "counterSet": device.counter_set,
                "counters": {name: {"value": str(n)} for name, n in device.consumes},
            }
        ],
    }
    if taints:
        out["taints"] = [{"key": t.key, "value": t.value, "effect": str(t.effect)} for t in taints]
    return out


def _slice(name: str, node: str, count: int, body: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": count},
            "nodeName": node,
            **body,
        },
    }


def _ordered_slices(planned: set[str]) -> list[dict[str, Any]]:
    """ORDERED's pool as order steering publishes it: counters, the other placements (slice
    ``-2``), then the planned ones (slice ``-10``, created last, first by name)."""
    listed = draalloc.planned_first(POOL, planned)
    counters = {
        "sharedCounters": [
            {"name": cs.name, "counters": {n: {"value": str(v)} for n, v in cs.counters}}
            for cs in POOL.counter_sets
        ]
    }
    rest = [_device(d, ()) for d in listed.devices if d.name not in planned]
    ahead = [_device(d, ()) for d in listed.devices if d.name in planned]
    return [
        _slice(f"{ORDERED}-0", ORDERED, 3, counters),
        _slice(f"{ORDERED}-2", ORDERED, 3, {"devices": rest}),
        _slice(f"{ORDERED}-10", ORDERED, 3, {"devices": ahead}),
    ]


def _slices(taints: draalloc.Taints) -> list[dict[str, Any]]:
    pool = {"name": NODE, "generation": 1, "resourceSliceCount": 2}
    counters = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE}-counters"},
        "spec": {
            "driver": DRIVER,
            "pool": pool,
            "nodeName": NODE,
            "sharedCounters": [
                {"name": cs.name, "counters": {n: {"value": str(v)} for n, v in cs.counters}}
                for cs in POOL.counter_sets
            ],
        },
    }
    devices = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{NODE}-devices"},
        "spec": {
            "driver": DRIVER,
            "pool": pool,
            "nodeName": NODE,
            "devices": [_device(d, taints.get(d.name, ())) for d in POOL.devices],
        },
    }
    return [counters, devices]


def _claim(name: str) -> Any:
    return codecs.from_dict(
        {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "gpu",
                            "exactly": {
                                "deviceClassName": CLASS,
                                "selectors": [{"cel": {"expression": TEN_GB.cel()}}],
                            },
                        }
                    ]
                }
            },
        }
    )


def _pod(name: str, claim: str, node: str = NODE) -> Any:
    return codecs.from_dict(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": node},
                "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
                "containers": [
                    {
                        "name": "main",
                        "image": "registry.example/never-pulled:1",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }
                ],
            },
        }
    )


@pytest.fixture
def pool(control_plane: ControlPlane) -> Iterator[ControlPlane]:
    client = control_plane.client
    control_plane.add_node(NODE)
    client.create(
        codecs.from_dict(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceClass",
                "metadata": {"name": CLASS},
                "spec": {"selectors": [{"cel": {"expression": f'device.driver == "{DRIVER}"'}}]},
            }
        )
    )
    for obj in _slices(draalloc.NO_TAINTS):
        client.create(codecs.from_dict(obj))
    try:
        yield control_plane
    finally:
        # Whatever a failed test left; what is already gone is fine.
        names = {"steer-a", "steer-b", "steer-c", "steer-o1", "steer-o2"}
        with contextlib.suppress(lightkube.ApiError):
            names |= {  # and those a retry made (_once_seen)
                name
                for p in client.list(Pod, namespace=NS)
                if p.metadata is not None and (name := p.metadata.name or "").startswith("steer-")
            }
        for name in sorted(names):
            with contextlib.suppress(lightkube.ApiError):
                client.delete(Pod, name, namespace=NS, grace_period=0)
            with contextlib.suppress(lightkube.ApiError):
                client.delete(ResourceClaim, name, namespace=NS)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(DeviceTaintRule, "steer-test-rule")
        for slice_name in (
            f"{NODE}-devices",
            f"{NODE}-counters",
            f"{ORDERED}-0",
            f"{ORDERED}-2",
            f"{ORDERED}-10",
        ):
            with contextlib.suppress(lightkube.ApiError):
                client.delete(ResourceSlice, slice_name)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(DeviceClass, CLASS)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Node, NODE)


def _allocated(plane: ControlPlane, claim: str) -> list[str] | None:
    obj = plane.client.get(ResourceClaim, claim, namespace=NS)
    allocation = obj.status.allocation if obj.status else None
    if allocation is None or allocation.devices is None:
        return None
    return [r.device for r in allocation.devices.results or []]


def _schedule(plane: ControlPlane, name: str, node: str = NODE) -> None:
    plane.client.create(_claim(name))
    plane.client.create(_pod(name, name, node))


def _once_seen(
    plane: ControlPlane,
    base: str,
    verdict: Callable[[str], str | None],
    *,
    watch: Sequence[Component],
) -> str:
    """The name of a claim (``base``, then ``base-1``, ...) kube-scheduler decided from the
    slices and rules just written. It allocates from its informers' copies, which may not hold
    a write made a moment before: ``verdict(name)`` says ``"stale"`` for a claim decided from
    the old copy (it is released and another asked), ``"ok"`` for one decided from the new,
    ``None`` while undecided. A scheduler that never follows the write fails on the timeout."""
    tried = 0

    def attempt() -> str | None:
        nonlocal tried
        name = base if tried == 0 else f"{base}-{tried}"
        tried += 1
        _schedule(plane, name)
        if wait_for(lambda: verdict(name), what=f"claim {name} decided", watch=watch) == "ok":
            return name
        _release(plane, name)
        return None

    return wait_for(attempt, what=f"a claim {base}... decided from the new slices", watch=watch)


def _release(plane: ControlPlane, name: str) -> None:
    plane.client.delete(Pod, name, namespace=NS, grace_period=0)
    wait_for(
        lambda: (
            not any(
                p.metadata is not None and p.metadata.name == name
                for p in plane.client.list(Pod, namespace=NS)
            )
        ),
        what=f"pod {name} to be gone",
        timeout=60,
    )
    plane.client.delete(ResourceClaim, name, namespace=NS)


def test_the_real_scheduler_allocates_first_fit_and_follows_steering_taints(
    pool: ControlPlane,
) -> None:
    plane = pool
    watch = [plane.component("kube-scheduler")]
    claim = draalloc.Claim((draalloc.Request(1, (TEN_GB,)),))

    # Uncurated: the first placement in slice order that fits, as the model says.
    expected = draalloc.allocate(POOL, claim).devices
    assert expected is not None and expected[0].name == "gpu-0-mig-7g-80gb-0"
    _schedule(plane, "steer-a")
    got = wait_for(
        lambda: _allocated(plane, "steer-a"), what="claim steer-a allocated", watch=watch
    )
    assert got == [expected[0].name]
    _release(plane, "steer-a")

    # Steered: every placement tainted but the planned one.
    planned = "gpu-0-mig-1g-10gb-6"
    taints = draalloc.steering_taints(POOL, offered={planned}, allocated=())
    expected = draalloc.allocate(POOL, claim, taints=taints).devices
    assert expected is not None and expected[0].name == planned
    current = plane.client.get(ResourceSlice, f"{NODE}-devices")
    updated = _slices(taints)[1]
    assert current.metadata is not None
    updated["metadata"]["resourceVersion"] = current.metadata.resourceVersion
    plane.client.replace(codecs.from_dict(updated))

    def steered(name: str) -> str | None:
        got = _allocated(plane, name)
        return None if got is None else "ok" if got == [planned] else "stale"

    name = _once_seen(plane, "steer-b", steered, watch=watch)
    assert _allocated(plane, name) == [planned]
    _release(plane, name)

    # A DeviceTaintRule on the planned placement leaves nothing untainted: the claim waits.
    plane.client.create(
        codecs.from_dict(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "DeviceTaintRule",
                "metadata": {"name": "steer-test-rule"},
                "spec": {
                    "deviceSelector": {"driver": DRIVER, "pool": NODE, "device": planned},
                    "taint": {"key": "example.com/maintenance", "effect": "NoSchedule"},
                },
            }
        )
    )

    def unschedulable(name: str) -> str | None:
        if _allocated(plane, name) is not None:
            return "stale"  # allocated before kube-scheduler saw the rule
        pod = plane.client.get(Pod, name, namespace=NS)
        conditions = pod.status.conditions if pod.status else None
        waits = any(c.type == "PodScheduled" and c.status == "False" for c in conditions or [])
        return "ok" if waits else None

    name = _once_seen(plane, "steer-c", unschedulable, watch=watch)
    assert _allocated(plane, name) is None
    plane.client.delete(DeviceTaintRule, "steer-test-rule")
    got = wait_for(lambda: _allocated(plane, name), what=f"claim {name} allocated", watch=watch)
    assert got == [planned]


def test_the_real_scheduler_walks_slices_by_name_so_planned_placements_listed_first_win(
    pool: ControlPlane,
) -> None:
    plane = pool
    watch = [plane.component("kube-scheduler")]
    plane.add_node(ORDERED)
    try:
        planned = "gpu-0-mig-1g-10gb-6"
        for obj in _ordered_slices({planned}):
            plane.client.create(codecs.from_dict(obj))
        listed = draalloc.planned_first(POOL, {planned})
        claim = draalloc.Claim((draalloc.Request(1, (TEN_GB,)),))
        # Without the order, first fit gives this claim the 7g.80gb at slot 0 (the test above).
        expected = draalloc.allocate(listed, claim).devices
        assert expected is not None and expected[0].name == planned
        _schedule(plane, "steer-o1", ORDERED)
        got = wait_for(
            lambda: _allocated(plane, "steer-o1"), what="claim steer-o1 allocated", watch=watch
        )
        assert got == [planned]
        # Soft: with the planned placement taken, the next claim gets first fit over the rest.
        after = draalloc.allocate(listed, claim, allocated=frozenset({planned})).devices
        assert after is not None and after[0].name == "gpu-0-mig-4g-40gb-0"
        _schedule(plane, "steer-o2", ORDERED)
        got = wait_for(
            lambda: _allocated(plane, "steer-o2"), what="claim steer-o2 allocated", watch=watch
        )
        assert got == [after[0].name]
        _release(plane, "steer-o1")
        _release(plane, "steer-o2")
    finally:
        with contextlib.suppress(lightkube.ApiError):
            plane.client.delete(Node, ORDERED)
