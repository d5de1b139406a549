"""The DRA kubelet plugin's core: device names, a claim's allocation, prepare and unprepare."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from migpilot import errors
from migpilot.agent.dra import claims, placements, preparing
from migpilot.agent.dra.memory import MemoryCdi, MemoryClaims, MemoryInstances
from migpilot.mig import catalog

H100 = catalog.resolve_gpu("h100-80gb")
A100 = catalog.resolve_gpu("a100-40gb")
GPUS = {0: H100, 1: A100}
NODE = "node-a"
P = placements.Placement


def claim(
    name: str, uid: str, results: list[dict[str, Any]] | None, *, ns: str = "default"
) -> dict[str, Any]:
    """A ResourceClaim object; ``results`` ``None`` is one not allocated."""
    status = {} if results is None else {"allocation": {"devices": {"results": results}}}
    return {"metadata": {"namespace": ns, "name": name, "uid": uid}, "status": status}


def result(device: str, request: str = "gpu", **kw: Any) -> dict[str, Any]:
    return {"request": request, "driver": placements.DRIVER, "pool": NODE, "device": device, **kw}


def ref(name: str, uid: str, ns: str = "default") -> claims.ClaimRef:
    return claims.ClaimRef(namespace=ns, name=name, uid=uid)


@pytest.fixture
def world() -> tuple[MemoryClaims, MemoryInstances, preparing.Preparer]:
    source, instances = MemoryClaims(), MemoryInstances(GPUS)
    return source, instances, preparing.Preparer(source, instances, GPUS, NODE, specs=MemoryCdi())


@pytest.mark.parametrize(
    ("placement", "name"),
    [
        (P(0, "3g.40gb", 4), "gpu-0-mig-3g-40gb-4"),
        (P(0, "1g.10gb+me", 6), "gpu-0-mig-1g-10gb-me-6"),
        (P(1, "7g.40gb", 0), "gpu-1-mig-7g-40gb-0"),
    ],
)
def test_device_names_round_trip(placement: placements.Placement, name: str) -> None:
    assert placements.device_name(placement) == name
    assert placements.parse_device_name(name, GPUS) == placement
    assert placements.cdi_device_id(placement) == f"mig.migpilot.io/mig={name}"


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("gpu-0-mig", "is not a MIG placement"),
        ("gpu-2-mig-1g-10gb-0", "has no GPU 2 (GPUs: 0, 1)"),
        ("gpu-1-mig-1g-10gb-me-0", "a100-40gb has no MIG profile '1g-10gb-me'"),
        ("gpu-0-mig-3g-40gb-2", "3g.40gb cannot start at slot 2 on h100-80gb (starts: 0, 4)"),
    ],
)
def test_bad_device_names_say_why(name: str, problem: str) -> None:
    with pytest.raises(placements.PlacementError, match=re.escape(problem)):
        placements.parse_device_name(name, GPUS)


def test_driver_devices_group_requests_and_skip_other_drivers() -> None:
    obj = claim(
        "c",
        "u1",
        [
            result("gpu-0-mig-3g-40gb-4", "big/first"),
            {"request": "x", "driver": "gpu.example.com", "pool": "p", "device": "d"},
            result("gpu-0-mig-1g-10gb-0", "small"),
            result("gpu-0-mig-3g-40gb-4", "other"),
        ],
    )
    got = claims.driver_devices(ref("c", "u1"), obj, driver=placements.DRIVER, pool=NODE)
    assert got == (
        claims.AllocatedDevice(NODE, "gpu-0-mig-3g-40gb-4", ("big", "other")),
        claims.AllocatedDevice(NODE, "gpu-0-mig-1g-10gb-0", ("small",)),
    )


@pytest.mark.parametrize(
    ("obj", "problem"),
    [
        (claim("c", "other-uid", [result("gpu-0-mig-1g-10gb-0")]), "has UID 'other-uid'"),
        (claim("c", "u1", None), "is not allocated"),
        (claim("c", "u1", [result("gpu-0-mig-1g-10gb-0", pool="node-b")]), "pool 'node-b'"),
        (claim("c", "u1", [result("gpu-0-mig-1g-10gb-0", adminAccess=True)]), "admin access"),
        (claim("c", "u1", [{"driver": placements.DRIVER, "pool": NODE}]), "device is None"),
    ],
)
def test_driver_devices_refuse_what_cannot_be_prepared(obj: dict[str, Any], problem: str) -> None:
    with pytest.raises(claims.ClaimError) as err:
        claims.driver_devices(ref("c", "u1"), obj, driver=placements.DRIVER, pool=NODE)
    assert problem in str(err.value)
    assert "default/c (u1)" in str(err.value)


def test_prepare_creates_the_allocated_instance_once(
    world: tuple[MemoryClaims, MemoryInstances, preparing.Preparer],
) -> None:
    source, instances, preparer = world
    source.put(claim("c", "u1", [result("gpu-0-mig-3g-40gb-4")]))
    first = preparer.prepare([ref("c", "u1")])
    again = preparer.prepare([ref("c", "u1")])
    assert first == again
    (device,) = first["u1"].devices
    assert first["u1"].error == ""
    assert device.device == "gpu-0-mig-3g-40gb-4"
    assert device.cdi_ids == ("mig.migpilot.io/mig=gpu-0-mig-3g-40gb-4",)
    assert instances.created == [P(0, "3g.40gb", 4)]


def test_unprepare_releases_and_unknown_claims_are_no_error(
    world: tuple[MemoryClaims, MemoryInstances, preparing.Preparer],
) -> None:
    source, instances, preparer = world
    source.put(claim("c", "u1", [result("gpu-0-mig-3g-40gb-4"), result("gpu-1-mig-1g-5gb-0")]))
    assert preparer.prepare([ref("c", "u1")])["u1"].error == ""
    source.delete("default", "c")  # the claim may be gone by the time the kubelet unprepares
    assert preparer.unprepare([ref("c", "u1"), ref("never", "u9")]) == {"u1": "", "u9": ""}
    assert sorted(instances.destroyed, key=str) == sorted(
        [P(0, "3g.40gb", 4), P(1, "1g.5gb", 0)], key=str
    )
    assert instances.held == {}
    assert preparer.unprepare([ref("c", "u1")]) == {"u1": ""}


def test_a_bad_claim_fails_alone_and_creates_nothing(
    world: tuple[MemoryClaims, MemoryInstances, preparing.Preparer],
) -> None:
    source, instances, preparer = world
    source.put(claim("good", "u1", [result("gpu-0-mig-1g-10gb-0")]))
    source.put(claim("bad", "u2", [result("gpu-0-mig-3g-40gb-4"), result("gpu-0-mig-9g-1gb-0")]))
    got = preparer.prepare([ref("good", "u1"), ref("bad", "u2"), ref("gone", "u3"), ref("", "u4")])
    assert got["u1"].error == "" and len(got["u1"].devices) == 1
    assert "claim default/bad (u2)" in got["u2"].error
    assert "no MIG profile '9g-1gb'" in got["u2"].error
    assert got["u2"].devices == ()
    assert got["u3"].error == "claim default/gone (u3) is not in the API"
    assert "leaves out name" in got["u4"].error
    assert instances.created == [P(0, "1g.10gb", 0)]


def test_a_taken_or_colliding_placement_is_the_claims_error(
    world: tuple[MemoryClaims, MemoryInstances, preparing.Preparer],
) -> None:
    source, instances, preparer = world
    instances.add_foreign(P(0, "1g.10gb", 4))
    source.put(claim("a", "u1", [result("gpu-0-mig-3g-40gb-0")]))
    source.put(claim("b", "u2", [result("gpu-0-mig-3g-40gb-0")]))
    source.put(claim("c", "u3", [result("gpu-0-mig-3g-40gb-4")]))
    got = preparer.prepare([ref("a", "u1"), ref("b", "u2"), ref("c", "u3")])
    assert got["u1"].error == ""
    assert "3g.40gb@0 on GPU 0 is taken by claim UID u1" in got["u2"].error
    assert "does not fit beside the GPU's" in got["u3"].error
    assert instances.created == [P(0, "3g.40gb", 0)]


def test_prepare_reads_the_claim_after_a_restart_and_reuses_the_instance(
    world: tuple[MemoryClaims, MemoryInstances, preparing.Preparer],
) -> None:
    source, instances, preparer = world
    source.put(claim("c", "u1", [result("gpu-0-mig-2g-20gb-2", shareID="s-1")]))
    first = preparer.prepare([ref("c", "u1")])
    # an agent restart: a new Preparer over the same node (the MIG state outlives the agent)
    restarted = preparing.Preparer(source, instances, GPUS, NODE, specs=preparer.specs)
    assert restarted.prepare([ref("c", "u1")]) == first
    assert first["u1"].devices[0].share_id == "s-1"
    assert instances.created == [P(0, "2g.20gb", 2)]


def test_whole_gpu_names_and_targets() -> None:
    assert placements.parse_target("gpu-3", GPUS) == placements.WholeGpu(3)
    assert placements.target_name(placements.WholeGpu(3)) == "gpu-3"
    assert placements.parse_target("gpu-0-mig-3g-40gb-4", GPUS) == P(0, "3g.40gb", 4)
    assert placements.parse_whole_gpu_name("gpu-0-mig-3g-40gb-4") is None
    with pytest.raises(placements.PlacementError, match="is not a MIG placement"):
        placements.parse_target("gpu-x", GPUS)


def test_the_spec_is_written_before_the_answer_and_removed_after_unprepare() -> None:
    source = MemoryClaims()
    instances = MemoryInstances(GPUS, whole={2: "GPU-two"})
    specs = MemoryCdi()
    preparer = preparing.Preparer(source, instances, GPUS, NODE, specs=specs)
    source.put(claim("c", "u1", [result("gpu-2"), result("gpu-0-mig-1g-10gb-0", "small")]))
    answer = preparer.prepare([ref("c", "u1")])["u1"]
    assert answer.error == ""
    assert specs.specs["u1"] == {
        "gpu-2": "GPU-two",
        "gpu-0-mig-1g-10gb-0": instances.held[P(0, "1g.10gb", 0)][1],
    }
    assert [d.cdi_ids for d in answer.devices] == [
        ("mig.migpilot.io/mig=gpu-2",),
        ("mig.migpilot.io/mig=gpu-0-mig-1g-10gb-0",),
    ]
    assert instances.created == [P(0, "1g.10gb", 0)]  # the whole GPU is given, not created
    assert preparer.unprepare([ref("c", "u1")]) == {"u1": ""}
    assert specs.specs == {} and instances.held == {}


class FailingSpecs(MemoryCdi):
    def write(
        self, owner: str, devices: Sequence[tuple[str, preparing.Instance]]
    ) -> Mapping[str, str]:
        raise errors.MigpilotError("disk full")


def test_a_spec_that_cannot_be_written_is_the_claims_error() -> None:
    source, instances = MemoryClaims(), MemoryInstances(GPUS)
    preparer = preparing.Preparer(source, instances, GPUS, NODE, specs=FailingSpecs())
    source.put(claim("c", "u1", [result("gpu-0-mig-1g-10gb-0")]))
    answer = preparer.prepare([ref("c", "u1")])["u1"]
    assert answer.error == "claim default/c (u1): CDI spec: disk full"
    assert answer.devices == ()
    assert instances.held[P(0, "1g.10gb", 0)][0] == "u1"  # the kubelet's unprepare releases it
