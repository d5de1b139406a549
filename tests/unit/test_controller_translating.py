"""A GpuLayout as the planner sees it (controller/translating.py): every instance or slice a pod
holds, is getting or is kept for is used, the safer half wins when the spec and the status
disagree, and instances being destroyed are left out."""

from __future__ import annotations

from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import translating
from migpilot.mig import catalog
from migpilot.planning import snapshot
from tests.unit import gpulayout_docs as docs

_TI = "status.gpus[0].instances"


def test_a_layout_the_agent_has_not_reported_has_no_gpus() -> None:
    doc = docs.mig()
    del doc["status"]
    assert translating.snapshot_gpus(wire.parse(doc)) == ()


def test_snapshot_gpus_mark_everything_the_planner_must_not_destroy_as_used() -> None:
    doc = docs.mig()
    doc["status"]["gpus"][0]["instances"].append(
        {"profile": "1g.10gb", "start": 3, "uuid": "MIG-d", "state": "destroying"}
    )
    doc["status"]["summary"]["instances"] = 5
    (gpu,) = translating.snapshot_gpus(wire.parse(doc))
    assert gpu.index == 1
    assert gpu.model == catalog.resolve_gpu("h100-80gb")
    assert gpu.instances == (
        snapshot.ExistingInstance("1g.10gb", 0, True),  # reserved
        snapshot.ExistingInstance("1g.10gb", 1, True),  # used
        snapshot.ExistingInstance("1g.10gb", 2, True),  # creating
        snapshot.ExistingInstance("3g.40gb", 4, False),  # free; destroying left out
    )


def test_a_spec_reservation_wins_over_a_free_status() -> None:
    doc = docs.edited(docs.mig(), f"{_TI}[0].state", "free")
    doc["status"]["summary"]["free"] = 2
    (gpu,) = translating.snapshot_gpus(wire.parse(doc))
    assert gpu.instances[0] == snapshot.ExistingInstance("1g.10gb", 0, True)


def test_snapshot_gpus_keep_every_slice_a_pod_holds_or_the_spec_reserves() -> None:
    (gpu,) = translating.snapshot_gpus(wire.parse(docs.mps()))
    assert [(s.id, s.memory_gb, s.cores, s.used, s.reserved_for) for s in gpu.mps] == [
        (0, 10, 30, True, ""),  # the spec's, used by a pod
        (1, 40, None, True, ""),  # dropped from the spec, still used: kept as used
        (2, 20, None, False, "ns/p2"),  # reserved by the spec
    ]
    assert not gpu.instances


def test_a_held_slice_the_spec_resized_counts_with_the_size_the_status_reports() -> None:
    """The agent never resizes a held slice (it keeps its size until its pod is gone): a spec
    that lists its id with another size must not hide the memory the pod holds."""
    doc = docs.mps()
    (held,) = [sl for sl in doc["spec"]["gpus"][0]["mps"] if sl["id"] == 0]
    held.update(memoryGB=5, cores=10)
    (gpu,) = translating.snapshot_gpus(wire.parse(doc))
    first = gpu.mps[0]
    assert (first.id, first.memory_gb, first.cores, first.used) == (0, 10, 30, True)
