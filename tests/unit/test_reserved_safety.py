"""What keeps a reserved or used instance alive, case by case: the GpuLayout's protected set
(agent/desired.protected) and the controller's reservation rules (controller/pinning). Each case
is one the mutation run (bench/mutation.py) showed unguarded."""

from __future__ import annotations

from typing import Any

from migpilot.agent import desired
from migpilot.api import gpulayouts as gl
from migpilot.controller import observing, pinning
from migpilot.gpu import backend


def _layout(spec: list[dict[str, Any]], status: list[dict[str, Any]] | None) -> gl.GpuLayout:
    doc: dict[str, Any] = {
        "apiVersion": gl.API_VERSION,
        "kind": gl.KIND,
        "metadata": {"name": "node-a"},
        "spec": {"gpus": spec},
    }
    if status is not None:
        doc["status"] = {"gpus": status, "conditions": []}
    return gl.parse(doc)


def _dev(gpu: int, start: int, profile: str, uuid: str | None) -> backend.MigDevice:
    return backend.MigDevice(gpu, start + 1, 0 if uuid else None, profile, start, uuid)


SPEC = [
    {
        "index": 0,
        "instances": [
            {"profile": "1g.10gb", "start": 0, "reservedFor": "ns/p"},
            {"profile": "1g.10gb", "start": 1},
            {"profile": "1g.10gb", "start": 2, "reservedFor": "ns/q"},
        ],
    },
    {"index": 1, "instances": [{"profile": "2g.20gb", "start": 0, "reservedFor": "ns/r"}]},
]


def test_protected_matches_a_reservation_by_gpu_start_and_profile_only() -> None:
    current = {
        0: [
            _dev(0, 0, "1g.10gb", "MIG-reserved"),
            _dev(0, 1, "1g.10gb", "MIG-free"),
            _dev(0, 2, "1g.10gb", None),  # reserved, but its compute instance is not made yet
        ],
        1: [_dev(1, 0, "1g.10gb", "MIG-other-profile")],
        2: [_dev(2, 0, "2g.20gb", "MIG-other-gpu")],
    }
    assert desired.protected(_layout(SPEC, None), current=current) == {"MIG-reserved"}


def test_protected_adds_what_the_last_status_says_is_used_reserved_or_creating() -> None:
    status = [
        {
            "index": 0,
            "model": "h100-80gb",
            "uuid": "GPU-0",
            "instances": [
                {"profile": "1g.10gb", "start": 3, "uuid": "MIG-used", "state": "used"},
                {"profile": "1g.10gb", "start": 4, "uuid": "MIG-reserved", "state": "reserved"},
                {"profile": "1g.10gb", "start": 5, "uuid": "MIG-creating", "state": "creating"},
                {"profile": "1g.10gb", "start": 6, "state": "creating"},
                {"profile": "1g.10gb", "start": 1, "uuid": "MIG-free", "state": "free"},
                {"profile": "1g.10gb", "start": 2, "uuid": "MIG-going", "state": "destroying"},
            ],
        }
    ]
    got = desired.protected(_layout([], status), current={})
    assert got == {"MIG-used", "MIG-reserved", "MIG-creating"}


# --- the controller's reservation rules --------------------------------------------------------


def _pod(
    name: str, *, node: str | None = None, affinity: list[list[dict[str, Any]]] | None = None
) -> dict[str, Any]:
    limits = {"nvidia.com/mig-1g.10gb": "1"}
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "resources": {"limits": limits}}],
        "schedulingGates": [{"name": observing.GATE}],
    }
    if node:
        spec["nodeName"] = node
        del spec["schedulingGates"]
    if affinity is not None:
        terms = [{"matchFields": t} for t in affinity]
        spec["affinity"] = {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}
            }
        }
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"}, "spec": spec}


def _status_inst(start: int, state: str, used_by: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"profile": "1g.10gb", "start": start, "uuid": f"MIG-{start}"}
    out["state"] = state
    if used_by is not None:
        out["usedBy"] = used_by
    return out


def _status_slice(sid: int, state: str, used_by: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": sid, "memoryGB": 10, "state": state}
    if used_by is not None:
        out["usedBy"] = used_by
    return out


def _observed(
    *,
    instances: list[dict[str, Any]],
    slices: list[dict[str, Any]] = (),  # type: ignore[assignment]
    reported: bool = True,
    pods: list[dict[str, Any]] | None = None,
) -> observing.Observed:
    """Node n0: GPU 0 reserves 1g@0 for ns/p and 1g@1 for ns/q, GPU 1 its MPS slice 1 for ns/p."""
    spec = [
        {
            "index": 0,
            "instances": [
                {"profile": "1g.10gb", "start": 0, "reservedFor": "ns/p"},
                {"profile": "1g.10gb", "start": 1, "reservedFor": "ns/q"},
                {"profile": "1g.10gb", "start": 2},
            ],
        },
        {
            "index": 1,
            "instances": [],
            "mps": [
                {"id": 1, "memoryGB": 10, "reservedFor": "ns/p"},
                {"id": 2, "memoryGB": 10},
            ],
        },
    ]
    status = None
    if reported:
        status = [
            {"index": 0, "model": "a100-80gb", "uuid": "GPU-0", "instances": instances},
            {"index": 1, "model": "a100-80gb", "uuid": "GPU-1", "instances": [], "mps": slices},
        ]
    return observing.observe(
        pods=[observing.pod_view(p) for p in (pods or [_pod("p"), _pod("q")])],
        nodes=[],
        layouts_by_node={"n0": _layout(spec, status)},
    )


def test_a_reservation_is_stolen_only_when_another_pod_uses_what_it_reserves() -> None:
    def stolen(**kw: Any) -> bool:
        return pinning.stolen(_observed(**kw), "ns/p")

    assert stolen(instances=[_status_inst(0, "used", "ns/other")])
    assert stolen(instances=[_status_inst(0, "used")])  # used, by a pod the agent cannot name
    assert not stolen(instances=[_status_inst(0, "used", "ns/p")])
    assert not stolen(instances=[_status_inst(0, "reserved")])
    assert not stolen(instances=[_status_inst(1, "used", "ns/other")])  # ns/q's, not ns/p's
    assert not stolen(instances=[_status_inst(2, "used", "ns/other")])
    assert stolen(instances=[], slices=[_status_slice(1, "used", "ns/other")])
    assert not stolen(instances=[], slices=[_status_slice(1, "used", "ns/p")])
    assert not stolen(instances=[], slices=[_status_slice(1, "free")])
    assert not stolen(instances=[], slices=[_status_slice(2, "used", "ns/other")])
    assert not stolen(instances=[], reported=False)
    obs = _observed(instances=[_status_inst(0, "used", "ns/other")])
    assert not pinning.stolen(obs, "ns/nobody")


def test_made_counts_only_instances_neither_being_created_nor_destroyed() -> None:
    def made(*states: str) -> bool:
        insts = [_status_inst(0, states[0])]
        return pinning.made(_observed(instances=insts, slices=[_status_slice(1, "free")]), "ns/p")

    assert made("reserved") and made("free") and made("used")
    assert not made("creating") and not made("destroying")
    no_slice = _observed(instances=[_status_inst(0, "reserved")], slices=[_status_slice(2, "free")])
    assert not pinning.made(no_slice, "ns/p")


def test_a_stale_reservation_is_dropped_from_instances_and_slices_alike() -> None:
    spec = gl.LayoutSpec(
        (
            gl.GpuSpec(
                3,
                "a100-80gb",
                (gl.InstanceSpec("1g.10gb", 0, "ns/gone"), gl.InstanceSpec("1g.10gb", 1, "ns/p")),
                (
                    gl.SliceSpec(1, 10, 30, "ns/gone", gl.UNIFIED_RESOURCE),
                    gl.SliceSpec(2, 20, 50, "ns/p", gl.UNIFIED_RESOURCE),
                    gl.SliceSpec(3, 5, None, None),
                ),
            ),
        )
    )
    assert pinning.without_stale(spec, live=frozenset({"ns/p"})) == gl.LayoutSpec(
        (
            gl.GpuSpec(
                3,
                "a100-80gb",
                (gl.InstanceSpec("1g.10gb", 0, None), gl.InstanceSpec("1g.10gb", 1, "ns/p")),
                (
                    gl.SliceSpec(1, 10, 30, None),
                    gl.SliceSpec(2, 20, 50, "ns/p", gl.UNIFIED_RESOURCE),
                    gl.SliceSpec(3, 5, None, None),
                ),
            ),
        )
    )


def _field(*names: str, operator: str = "In") -> dict[str, Any]:
    return {"key": "metadata.name", "operator": operator, "values": list(names)}


def test_a_pod_is_pinned_only_when_every_term_names_the_same_one_node() -> None:
    def pinned(affinity: list[list[dict[str, Any]]] | None) -> str | None:
        return pinning.pinned_to(observing.pod_view(_pod("p", affinity=affinity)))

    assert pinned(None) is None
    assert pinned([[_field("n0")]]) == "n0"
    assert pinned([[_field("n0")], [_field("n0")]]) == "n0"
    assert pinned([[_field("n0")], [_field("n1")]]) is None
    assert pinned([[_field("n0"), _field("n1")]]) is None
    assert pinned([[_field("n0", operator="NotIn")]]) is None
    assert pinned([[_field("n0")], []]) is None
