"""What keeps a reserved or used instance alive, case by case: the GpuLayout's protected set
(agent/desired.protected) and the controller's reservation rules (controller/pinning). Each case
is one the mutation run (bench/mutation.py) showed unguarded."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from typing import Any

import pytest

from migpilot.agent.rules import desired
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.controller import kubeapi, observing, pinning, running
from migpilot.gpu import backend
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects
from migpilot.planning import control


def _layout(spec: list[dict[str, Any]], status: list[dict[str, Any]] | None) -> gl.GpuLayout:
    doc: dict[str, Any] = {
        "apiVersion": gl.API_VERSION,
        "kind": gl.KIND,
        "metadata": {"name": "node-a"},
        "spec": {"gpus": spec},
    }
    if status is not None:
        doc["status"] = {"gpus": status, "conditions": []}
    return wire.parse(doc)


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


# --- the controller's passes that drop reservations, called directly (no loop, no sleeping) ----


def _layout_doc(name: str, spec: list[dict[str, Any]], status: list[dict[str, Any]] | None) -> Any:
    doc: dict[str, Any] = {
        "apiVersion": gl.API_VERSION,
        "kind": gl.KIND,
        "metadata": {"name": name},
        "spec": {"gpus": spec},
    }
    if status is not None:
        doc["status"] = {"gpus": status, "conditions": []}
    return doc


def _reserving(*pods: str | None, start: int = 0) -> dict[str, Any]:
    """GPU 0 of a spec: one 1g.10gb per entry from ``start``, reserved for that pod (or free)."""
    insts = []
    for n, pod in enumerate(pods):
        inst: dict[str, Any] = {"profile": "1g.10gb", "start": start + n}
        if pod is not None:
            inst["reservedFor"] = pod
        insts.append(inst)
    return {"index": 0, "instances": insts}


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _node_doc(name: str, mig: int = 0) -> dict[str, Any]:
    """A Ready MIG node advertising ``mig`` 1g.10gb instances."""
    return {
        "metadata": {
            "name": name,
            "uid": f"u-{name}",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/mig.capable": "true"},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {"cpu": "32", "memory": "256Gi", "nvidia.com/mig-1g.10gb": str(mig)},
        },
    }


async def _controller(
    layouts: dict[str, dict[str, Any]],
    pods: list[dict[str, Any]],
    clock: _Clock,
    nodes: list[dict[str, Any]] = [],  # noqa: B006 (never mutated)
) -> tuple[kubeapi.InMemoryApi, running.Controller]:
    """A leading controller whose store holds ``layouts`` (name -> doc), ``pods`` and
    ``nodes``."""
    api = kubeapi.InMemoryApi()
    settings = running.Settings(identity="c1", reservation_timeout_s=60.0)
    controller = running.Controller(api, settings=settings, clock=clock)
    controller.leading = True
    controller._lease_until = math.inf
    for kind, docs in (
        (kubeobjects.Kind.LAYOUTS, layouts.values()),
        (kubeobjects.Kind.PODS, pods),
        (kubeobjects.Kind.NODES, nodes),
    ):
        for doc in docs:
            await api.put(kind, doc)
            stored = api.objects[kind][kubeapi.InMemoryApi.key_of(doc)]
            controller._take(kind, stored, deleted=False)
    return api, controller


def _said(controller: running.Controller) -> list[tuple[str, str, str]]:
    """The Events the controller queued: (pod, reason, message); each expiry a Warning."""
    out = []
    while not controller._notes.empty():
        note = controller._notes.get_nowait()
        assert (note.kind, note.namespace, note.uid) == ("Pod", "ns", f"u-{note.name}")
        assert note.type == ("Warning" if note.reason == "MigReservationExpired" else "Normal")
        out.append((note.name, note.reason, note.message))
    return out


def _reservations(spec: gl.LayoutSpec) -> dict[tuple[int, int], str | None]:
    return {(g.index, i.start): i.reserved_for for g in spec.gpus for i in g.instances}


TAKEN = (
    "its instances on node {} were taken by a pod bound there without migpilot (created "
    "ungated), or the room for them by another pod bound there; planning again"
)
TIMED_OUT = (
    "its instances on node {} were not usable in time (reservation timeout 60 s); planning again"
)


def test_expire_drops_only_the_expired_reservations_and_says_why_for_each_pod(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two pods expire on n0 in one pass, one stolen, one timed out; one on n1; ns/s stays."""
    layouts = {
        "n0": _layout_doc("n0", [_reserving("ns/p", "ns/q", "ns/s", None)], None),
        "n1": _layout_doc("n1", [_reserving("ns/r")], None),
        "n2": _layout_doc("n2", [_reserving("ns/t")], None),
    }
    pods = [_pod(n) for n in ("p", "q", "r", "s", "t")]

    async def main() -> None:
        api, controller = await _controller(layouts, pods, _Clock(1000.0))
        observed = controller.observe()
        await controller._expire(
            observed,
            [
                control.Expiry("ns/p", "n0", True, TAKEN.format("n0")),
                control.Expiry("ns/q", "n0", False, TIMED_OUT.format("n0")),
                control.Expiry("ns/r", "n1", False, TIMED_OUT.format("n1")),
            ],
        )
        assert [(n, _reservations(s)) for n, s in api.spec_writes] == [
            ("n0", {(0, 0): None, (0, 1): None, (0, 2): "ns/s", (0, 3): None}),
            ("n1", {(0, 0): None}),
        ]
        assert _said(controller) == [
            ("p", "MigReservationExpired", TAKEN.format("n0")),
            ("q", "MigReservationExpired", TIMED_OUT.format("n0")),
            ("r", "MigReservationExpired", TIMED_OUT.format("n1")),
        ]

    with caplog.at_level(logging.WARNING, logger="migpilot.controller"):
        asyncio.run(main())
    expired = (("ns/p", "n0"), ("ns/q", "n0"), ("ns/r", "n1"))
    assert [r.getMessage() for r in caplog.records] == [
        f"reservation of {k} on {n} expired: planning again" for k, n in expired
    ]
    # Each line names its pod and node for JSON logs (docs/observability.md).
    assert [(getattr(r, "pod", None), getattr(r, "node", None)) for r in caplog.records] == list(
        expired
    )


def test_an_expiry_whose_write_fails_says_nothing_and_keeps_the_reservation() -> None:
    layouts = {"n0": _layout_doc("n0", [_reserving("ns/p")], None)}

    async def main() -> None:
        api, controller = await _controller(layouts, [_pod("p")], _Clock(1000.0))
        api.fail_next = kube_errors.KubeApiError("503: unavailable")
        await controller._expire(
            controller.observe(), [control.Expiry("ns/p", "n0", True, TAKEN.format("n0"))]
        )
        assert not _said(controller)
        assert not api.spec_writes
        assert "ns/p" in controller.observe().reservations

    asyncio.run(main())


def test_an_expiry_whose_write_fails_on_one_node_still_expires_the_others() -> None:
    layouts = {
        "n0": _layout_doc("n0", [_reserving("ns/p")], None),
        "n1": _layout_doc("n1", [_reserving("ns/r")], None),
    }

    async def main() -> None:
        api, controller = await _controller(layouts, [_pod("p"), _pod("r")], _Clock(1000.0))
        api.fail_next = kube_errors.KubeApiError("503: unavailable")
        await controller._expire(
            controller.observe(),
            [
                control.Expiry("ns/p", "n0", False, TIMED_OUT.format("n0")),
                control.Expiry("ns/r", "n1", False, TIMED_OUT.format("n1")),
            ],
        )
        assert _said(controller) == [("r", "MigReservationExpired", TIMED_OUT.format("n1"))]
        assert [n for n, _ in api.spec_writes] == ["n1"]
        assert set(controller.observe().reservations) == {"ns/p"}

    asyncio.run(main())


def test_release_rewrites_only_stale_nodes_keeping_the_live_reservations_there() -> None:
    """ns/p is reserved on n0 and n1 (n0's stays, n1's goes); n1 also reserves the gone ns/g
    and the live ns/q; n2 reserves only live ns/r and is not written."""
    layouts = {
        "n0": _layout_doc("n0", [_reserving("ns/p")], None),
        "n1": _layout_doc("n1", [_reserving("ns/p", "ns/g", "ns/q")], None),
        "n2": _layout_doc("n2", [_reserving("ns/r")], None),
    }
    pods = [_pod("p"), _pod("q"), _pod("r")]

    async def main() -> None:
        api, controller = await _controller(layouts, pods, _Clock(1000.0))
        observed = controller.observe()
        assert observed.stale == {"n1"} and observed.reservations["ns/p"].node == "n0"
        await controller._release(observed, sorted(observed.stale))
        assert [(n, _reservations(s)) for n, s in api.spec_writes] == [
            ("n1", {(0, 0): None, (0, 1): None, (0, 2): "ns/q"}),
        ]
        assert not _said(controller)

    asyncio.run(main())


def test_release_of_several_stale_nodes_writes_each() -> None:
    layouts = {
        "n0": _layout_doc("n0", [_reserving("ns/gone")], None),
        "n1": _layout_doc("n1", [_reserving("ns/q", "ns/done")], None),
    }
    done = _pod("done", node="n1")
    done["status"] = {"phase": "Succeeded"}

    async def main() -> None:
        api, controller = await _controller(layouts, [_pod("q"), done], _Clock(1000.0))
        observed = controller.observe()
        await controller._release(observed, sorted(observed.stale))
        assert [(n, _reservations(s)) for n, s in api.spec_writes] == [
            ("n0", {(0, 0): None}),
            ("n1", {(0, 0): "ns/q", (0, 1): None}),
        ]

    asyncio.run(main())


def test_a_reservation_without_its_layout_or_pod_is_neither_made_nor_stolen() -> None:
    """The rules read what they are given: a reservation whose node's GpuLayout or whose pod
    the view lacks (observe never makes one, a caller could) is not made and not stolen."""
    obs = _observed(instances=[_status_inst(0, "used", "ns/other")])
    assert pinning.stolen(obs, "ns/p")
    no_layout = dataclasses.replace(obs, layouts={})
    assert not pinning.made(no_layout, "ns/p")
    assert not pinning.stolen(no_layout, "ns/p")
    no_pod = dataclasses.replace(obs, pods={k: v for k, v in obs.pods.items() if k != "ns/p"})
    assert not pinning.stolen(no_pod, "ns/p")


def test_a_pod_the_planner_cannot_read_is_pinned_nowhere() -> None:
    bad = _pod("p", affinity=[[_field("n0")]])
    bad["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1c.3g.40gb": "1"}
    view = observing.pod_view(bad)
    assert view.pod is None and view.problem is not None
    assert pinning.pinned_to(view) is None


def _gpu0(*instances: dict[str, Any]) -> list[dict[str, Any]]:
    """A layout status: GPU 0 with these instances."""
    return [{"index": 0, "model": "a100-80gb", "uuid": "GPU-0", "instances": list(instances)}]


async def _store(
    api: kubeapi.InMemoryApi, controller: running.Controller, kind: kubeobjects.Kind, doc: Any
) -> None:
    """Change an object as another client would, and show it to the controller."""
    await api.put(kind, doc)
    controller._take(kind, api.objects[kind][kubeapi.InMemoryApi.key_of(doc)], deleted=False)


def test_a_reservation_expires_a_timeout_after_its_instances_exist_or_ten_if_they_never_do() -> (
    None
):
    """ns/p's instance is made from the start, ns/q's only later (and ns/r's never); the node
    advertises none, so no pod is pinned."""
    clock = _Clock(1000.0)
    spec = [_reserving("ns/p", "ns/q", "ns/r")]
    layouts = {"n0": _layout_doc("n0", spec, _gpu0(_status_inst(0, "reserved")))}
    pods = [_pod("p"), _pod("q"), _pod("r")]

    async def main() -> None:
        api, controller = await _controller(layouts, pods, clock, [_node_doc("n0")])

        async def at(now: float) -> list[tuple[str, str, str]]:
            clock.now = now
            await controller.step()
            return _said(controller)

        assert await at(1000.0) == []
        doc = api.objects[kubeobjects.Kind.LAYOUTS]["n0"]
        made = _gpu0(_status_inst(0, "reserved"), _status_inst(1, "free"))
        await _store(api, controller, kubeobjects.Kind.LAYOUTS, {**doc, "status": {"gpus": made}})
        assert await at(1030.0) == []
        # ns/p's instance is being destroyed: it was made, its clock runs on.
        doc = api.objects[kubeobjects.Kind.LAYOUTS]["n0"]
        going = _gpu0(_status_inst(0, "destroying"), _status_inst(1, "free"))
        await _store(api, controller, kubeobjects.Kind.LAYOUTS, {**doc, "status": {"gpus": going}})
        assert await at(1060.0) == []  # a timeout exactly: not yet
        assert await at(1060.5) == [("p", "MigReservationExpired", TIMED_OUT.format("n0"))]
        assert await at(1090.0) == []
        assert await at(1090.5) == [("q", "MigReservationExpired", TIMED_OUT.format("n0"))]
        assert await at(1600.0) == []  # ten timeouts exactly: not yet
        assert await at(1600.5) == [("r", "MigReservationExpired", TIMED_OUT.format("n0"))]
        assert not api.pod_patches
        assert [_reservations(s) for _, s in api.spec_writes] == [
            {(0, 0): None, (0, 1): "ns/q", (0, 2): "ns/r"},
            {(0, 0): None, (0, 1): None, (0, 2): "ns/r"},
            {(0, 0): None, (0, 1): None, (0, 2): None},
        ]

    asyncio.run(main())


def test_a_pod_pinned_to_its_node_keeps_its_reservation_until_another_pod_takes_it() -> None:
    """ns/p is let go pinned to n0, where it is reserved; ns/q is let go pinned to n1 but
    reserved on n0; ns/s is still gated, its own affinity naming n0."""
    clock = _Clock(1000.0)
    spec = [_reserving("ns/p", "ns/q", "ns/s")]
    made = [_status_inst(n, "reserved") for n in range(3)]
    layouts = {"n0": _layout_doc("n0", spec, _gpu0(*made))}
    p, q, s = (
        _pod(name, affinity=[[_field(node)]])
        for name, node in (("p", "n0"), ("q", "n1"), ("s", "n0"))
    )
    del p["spec"]["schedulingGates"], q["spec"]["schedulingGates"]

    async def main() -> None:
        api, controller = await _controller(layouts, [p, q, s], clock, [_node_doc("n0")])

        async def at(now: float) -> list[tuple[str, str, str]]:
            clock.now = now
            await controller.step()
            return _said(controller)

        assert await at(1000.0) == []
        assert await at(1060.5) == [
            ("q", "MigReservationExpired", TIMED_OUT.format("n0")),
            ("s", "MigReservationExpired", TIMED_OUT.format("n0")),
        ]
        assert await at(2000.0) == []
        assert controller.observe().reservations.keys() == {"ns/p"}
        # A pod bound without migpilot uses ns/p's instance: dropped at once.
        doc = api.objects[kubeobjects.Kind.LAYOUTS]["n0"]
        used = _gpu0(_status_inst(0, "used", "ns/other"))
        await _store(api, controller, kubeobjects.Kind.LAYOUTS, {**doc, "status": {"gpus": used}})
        assert await at(2000.0) == [("p", "MigReservationExpired", TAKEN.format("n0"))]
        assert not controller.observe().reservations
        assert not api.pod_patches

    asyncio.run(main())


def test_pin_lets_go_the_ready_gated_pods_the_node_has_room_for_in_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """n0 advertises 4: ns/z is bound there (1), ns/b let go (1); ns/a's instance is stolen
    (dropped, never pinned); ns/c's instance is not made yet; ns/d and ns/e take the last 2;
    ns/f waits for room. A pod says why it waits in the debug log once it has waited more
    than 5 s (at INFO the first time, then at DEBUG)."""
    clock = _Clock(1000.0)
    spec = [_reserving("ns/a", "ns/b", "ns/c", "ns/d", "ns/e", "ns/f")]
    status = [_status_inst(0, "used", "ns/other"), _status_inst(1, "reserved")]
    status += [_status_inst(n, "reserved") for n in range(3, 6)]
    layouts = {"n0": _layout_doc("n0", spec, _gpu0(*status))}
    let_go = _pod("b", affinity=[[_field("n0")]])
    del let_go["spec"]["schedulingGates"]
    pods = [_pod("a"), let_go, *(_pod(n) for n in "cdef"), _pod("z", node="n0")]

    async def main() -> None:
        api, controller = await _controller(layouts, pods, clock, [_node_doc("n0", mig=4)])
        node = controller.observe().nodes["n0"]

        async def at(now: float) -> None:
            clock.now = now
            await controller.step()

        await at(1000.0)
        assert _said(controller) == [("a", "MigReservationExpired", TAKEN.format("n0"))]
        assert api.pod_patches == [
            ("ns/d", pinning.pin_patch(pods[3], node)),
            ("ns/e", pinning.pin_patch(pods[4], node)),
        ]

        def waits() -> list[logging.LogRecord]:
            return [r for r in caplog.records if " waits for " in r.getMessage()]

        with caplog.at_level(logging.DEBUG, logger="migpilot.controller"):
            await at(1005.0)
            assert not waits()
            await at(1005.5)
            # the first time a pod waits for something it is said at INFO, then at DEBUG
            await at(1006.0)
        assert [r.getMessage() for r in waits()] == 2 * [
            "pod ns/c waits for 1g.10gb at GPU 0 start 2 on n0 to be created",
            "pod ns/f waits for node n0 to advertise nvidia.com/mig-1g.10gb (allocatable 4, "
            "taken 4)",
        ]
        assert [(getattr(r, "pod", None), r.levelno) for r in waits()] == [
            ("ns/c", logging.INFO),
            ("ns/f", logging.INFO),
            ("ns/c", logging.DEBUG),
            ("ns/f", logging.DEBUG),
        ]
        assert len(api.pod_patches) == 2

    asyncio.run(main())


def _unified(name: str, mem: int) -> dict[str, Any]:
    limits = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": str(mem)}
    spec = {
        "containers": [{"name": "c", "resources": {"limits": limits}}],
        "schedulingGates": [{"name": observing.GATE}],
    }
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}"}, "spec": spec}


def test_pin_lets_go_unified_pods_asking_alike_together_while_the_node_has_devices() -> None:
    """ns/u and ns/v ask alike, ns/w differently (a larger slice); all three are made. ns/t,
    unified too, is bound to n0 already: one of the node's devices is taken."""
    spec = [
        {
            "index": 0,
            "instances": [
                {
                    "profile": "1g.10gb",
                    "start": 0,
                    "reservedFor": "ns/u",
                    "resource": gl.UNIFIED_RESOURCE,
                },
                {
                    "profile": "1g.10gb",
                    "start": 1,
                    "reservedFor": "ns/v",
                    "resource": gl.UNIFIED_RESOURCE,
                },
                {
                    "profile": "3g.40gb",
                    "start": 4,
                    "reservedFor": "ns/w",
                    "resource": gl.UNIFIED_RESOURCE,
                },
            ],
        }
    ]
    made = [_status_inst(0, "reserved"), _status_inst(1, "reserved")]
    made.append({"profile": "3g.40gb", "start": 4, "uuid": "MIG-4", "state": "reserved"})
    layouts = {"n0": _layout_doc("n0", spec, _gpu0(*made))}
    bound = _unified("t", 8000)
    bound["spec"]["nodeName"] = "n0"
    del bound["spec"]["schedulingGates"]
    pods = [bound, _unified("u", 8000), _unified("v", 8000), _unified("w", 40000)]

    def pinned(devices: int) -> list[str]:
        node = _node_doc("n0")
        node["status"]["allocatable"] |= {
            "nvidia.com/gpu": str(devices),
            "nvidia.com/gpumem": "80000",
        }

        async def main() -> list[str]:
            api, controller = await _controller(layouts, pods, _Clock(1000.0), [node])
            await controller.step()
            assert not _said(controller)
            return [k for k, _ in api.pod_patches]

        return asyncio.run(main())

    assert pinned(4) == ["ns/u", "ns/v"]  # ns/w waits for them to be allocated
    assert pinned(2) == ["ns/u"]  # one device left: ns/v waits for room
