"""The controller's leader election and write fencing against the in-memory API.

What client-go's leader election promises, checked on the real loop (``Controller.run``):
freshness judged on the candidate's own monotonic clock (the holder's ``renewTime`` may be
hours off), a leader that stops acting by its renew deadline however its Lease calls hang,
the deadline checked before every write, and a spec write planned on a version someone else
has replaced refused by its precondition (409) and planned again from what the watch shows.

Clocks are injected (:class:`_Clock`); no assertion is on wall time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from migpilot import errors
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.api import leases
from migpilot.controller import kubeapi, running
from migpilot.kube import objects as kubeobjects
from tests.unit.test_controller_running import (
    _Clock,
    _node,
    _pod,
    _ready_node,
    _reserved,
    _until,
)

WAIT_S = 10.0
KEY = f"{leases.NAMESPACE}/{leases.NAME}"
EPOCH = 1_800_000_000.0
HOUR = 3600.0


class _Api(kubeapi.InMemoryApi):
    """The in-memory API, counting Lease reads, whose Lease calls can hang (never answer)
    and whose GpuLayout watch can be held back (a watch that lags)."""

    def __init__(self) -> None:
        super().__init__()
        self.lease_reads = 0
        self.hang = False
        self.hung = 0
        """Lease calls that hung (and were abandoned by the caller)."""
        self.flowing = asyncio.Event()
        self.flowing.set()

    async def _maybe_hang(self) -> None:
        if self.hang:
            self.hung += 1
            await asyncio.Event().wait()  # never answers

    async def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        await self._maybe_hang()
        self.lease_reads += 1
        got = await super().get_lease(namespace, name)
        return dict(got) if got is not None else None

    async def write_lease(self, lease: Any, *, create: bool) -> Any:
        await self._maybe_hang()
        return await super().write_lease(lease, create=create)

    async def watch(
        self, kind: kubeobjects.Kind, *, resource_version: str
    ) -> AsyncIterator[kubeobjects.WatchEvent]:
        async for event in super().watch(kind, resource_version=resource_version):
            if kind is kubeobjects.Kind.LAYOUTS:
                await self.flowing.wait()
            yield event


def _run(
    body: Callable[[_Api, running.Controller], Awaitable[None]],
    *,
    api: _Api,
    clock: _Clock,
    wall: Callable[[], float] = time.time,
    **kw: Any,
) -> None:
    async def main() -> None:
        settings = running.Settings(
            identity="c1", batch_window_s=0.0, resync_s=0.05, renew_every_s=0.05, **kw
        )
        controller = running.Controller(api, settings=settings, clock=clock, wall=wall)
        stop = asyncio.Event()
        task = asyncio.create_task(controller.run(stop))
        try:
            await body(api, controller)
        finally:
            stop.set()
            api.hang = False
            api.flowing.set()
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(main())


async def _reads(api: _Api, n: int = 2) -> None:
    """Let the controller read the Lease ``n`` more times."""
    want = api.lease_reads + n
    await _until(f"{n} Lease reads", lambda: api.lease_reads >= want)


async def _renew_as(api: _Api, holder: str, *, stamp: float) -> None:
    """Renew the Lease as ``holder`` (another controller) would."""
    current = api.leases[KEY]
    seen = leases.observe(current, previous=None, now=0.0)
    body = leases.claim(current, observed=seen, identity=holder, now=0.0, stamp=stamp)
    assert body is not None
    await api.write_lease(body, create=False)


# --------------------------------------------------------------------------- skewed clocks


@pytest.mark.parametrize("skew", [-10 * HOUR, -20.0, 0.0, 20.0, 10 * HOUR])
def test_a_standby_judges_the_lease_on_its_own_clock_whatever_the_holders(skew: float) -> None:
    # c0 stamps renewTime with its clock (EPOCH); c1's wall clock is ``skew`` off it. Hours
    # ahead, comparing renewTime with c1's wall clock would take a fresh Lease at once; hours
    # behind, it would wait hours on a dead one. c1 waits exactly one Lease duration, on its
    # own monotonic clock, from the last renewal it saw.
    clock = _Clock(1000.0)
    api = _Api()
    first = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=EPOCH)
    assert first is not None
    asyncio.run(api.write_lease(first, create=True))

    async def body(api: _Api, controller: running.Controller) -> None:
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        await _reads(api)
        clock.now += 14.5
        await _reads(api)
        assert not controller.leading
        await _renew_as(api, "c0", stamp=EPOCH + 14.5)  # c0 is alive: seen at 1014.5
        await _reads(api)
        clock.now += 14.5  # 29 s since c1 first saw the Lease, 14.5 since the renewal
        await _reads(api)
        assert not controller.leading
        assert not api.spec_writes and not api.pod_patches
        assert api.leases[KEY]["spec"]["holderIdentity"] == "c0"
        clock.now += 0.5  # c0 is dead: 15 s on c1's clock since it was seen renewing
        await _until("the Lease taken", lambda: controller.leading)
        spec = api.leases[KEY]["spec"]
        assert (spec["holderIdentity"], spec["leaseTransitions"]) == ("c1", 1)
        assert spec["renewTime"] == leases.format_time(EPOCH + skew)
        await _until("the GpuLayout", lambda: "n0" in api.objects[kubeobjects.Kind.LAYOUTS])

    _run(body, api=api, clock=clock, wall=lambda: EPOCH + skew)


def test_a_holder_whose_renew_time_never_moves_is_still_seen_renewing() -> None:
    # A holder whose wall clock stopped writes the same renewTime each time; its writes still
    # change the resourceVersion, and that is a renewal seen.
    clock = _Clock(1000.0)
    api = _Api()
    first = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=EPOCH)
    assert first is not None
    asyncio.run(api.write_lease(first, create=True))

    async def body(api: _Api, controller: running.Controller) -> None:
        await _reads(api)
        for _ in range(3):
            clock.now += 10.0
            await _renew_as(api, "c0", stamp=EPOCH)
            await _reads(api)
            assert not controller.leading
        clock.now += 15.0
        await _until("the Lease taken", lambda: controller.leading)

    _run(body, api=api, clock=clock)


# --------------------------------------------------------------------------- deadline


def test_a_leader_whose_lease_calls_hang_stops_acting_by_its_renew_deadline() -> None:
    clock = _Clock(1000.0)

    async def body(api: _Api, controller: running.Controller) -> None:
        await _until("the Lease", lambda: controller.leading)
        api.hang = True
        renewed = clock.now  # the last renewal started at or before this
        await _until("two hung Lease calls", lambda: api.hung >= 2)  # each one abandoned
        clock.now = renewed + 9.9  # within the renew deadline (10 s): still the leader
        await _ready_node(api)
        assert controller.leading
        writes = len(api.spec_writes)
        assert writes == 1
        clock.now = renewed + 10.0 + 0.01  # past it, with the Lease calls still hanging
        await _until("stepping down", lambda: not controller.leading)
        await api.put(kubeobjects.Kind.NODES, _node("n1"))
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("more hung Lease calls", lambda: api.hung >= 4)
        assert len(api.spec_writes) == writes and not api.pod_patches
        assert controller.metrics.leader._value.get() == 0
        api.hang = False  # the API answers again: the Lease is still c1's, renewed
        await _until("leading again", lambda: controller.leading)
        await _until("the pod reserved", lambda: "ns/p" in _reserved(api, "n0"))

    _run(body, api=_Api(), clock=clock, lease_timeout_s=0.1)


def test_the_deadline_is_checked_before_the_plan_is_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The plan takes past the renew deadline (a long solve, a stalled process): the leader
    # writes none of it and steps down, although its Lease task has not run since.
    clock = _Clock(1000.0)
    planned = 0
    plan = running._plan_fast

    def slow(snap: Any) -> Any:
        nonlocal planned
        planned += 1
        clock.now += 60.0
        return plan(snap)

    async def body(api: _Api, controller: running.Controller) -> None:
        await _ready_node(api)
        writes = len(api.spec_writes)
        monkeypatch.setattr(running, "_plan_fast", slow)
        api.hang = True  # so the Lease task cannot renew meanwhile
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("the plan", lambda: planned >= 1)
        await _until("stepping down", lambda: not controller.leading)
        assert len(api.spec_writes) == writes and not api.refused_writes
        assert not _reserved(api, "n0")
        assert controller.plans == 0  # made, but past the deadline: dropped before any write

    _run(body, api=_Api(), clock=clock, lease_timeout_s=0.1)


@pytest.mark.parametrize("write", ["spec", "pod"])
def test_each_write_checks_the_deadline_first(write: str) -> None:
    clock = _Clock(1000.0)

    async def body(api: _Api, controller: running.Controller) -> None:
        await _ready_node(api)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a reservation", lambda: "ns/p" in _reserved(api, "n0"))
        api.hang = True
        spec_writes, patches = len(api.spec_writes), len(api.pod_patches)
        clock.now += 10.0 + 0.01
        assert controller.leading  # not noticed yet: the write itself must notice
        if write == "spec":
            ok = await controller._write_spec("n0", gl.LayoutSpec(()))
        else:
            ok = await controller._patch_pod("ns/p", [{"op": "remove", "path": "/spec/x"}])
        assert not ok and not controller.leading
        assert (len(api.spec_writes), len(api.pod_patches)) == (spec_writes, patches)
        assert "ns/p" in _reserved(api, "n0")

    _run(body, api=_Api(), clock=clock, lease_timeout_s=0.1)


# --------------------------------------------------------------------------- fencing


def test_a_write_planned_on_a_replaced_version_is_refused_and_planned_again() -> None:
    # c1's view of GpuLayout n0 lags (its watch is held back) while another writer (a new
    # leader, c2) replaces the spec. c1's write, planned on the old version, carries that
    # version as its precondition: the API refuses it (409), c1 does not crash, c2's spec
    # stands, and once c1 sees c2's version its next write, planned on that, lands.
    clock = _Clock(1000.0)
    theirs = gl.LayoutSpec((gl.GpuSpec(0, None, (gl.InstanceSpec("1g.10gb", 6),)),))

    async def body(api: _Api, controller: running.Controller) -> None:
        await _ready_node(api)
        await _until("the status seen", lambda: controller._store.layouts["n0"].status is not None)
        api.flowing.clear()  # c1's GpuLayout watch lags from here
        before = api.objects[kubeobjects.Kind.LAYOUTS]["n0"]["metadata"]["resourceVersion"]
        await api.apply_layout_spec(
            "n0", theirs, owner_uid=None, fence=kubeapi.Fence(before, leader="c2", term=1)
        )
        writes = len(api.spec_writes)
        await api.put(kubeobjects.Kind.PODS, _pod("p", "1g.10gb"))
        await _until("a refused write", lambda: bool(api.refused_writes))
        name, fence = api.refused_writes[0]
        assert (name, fence.leader, fence.resource_version) == ("n0", "c1", before)
        assert len(api.spec_writes) == writes
        doc = api.objects[kubeobjects.Kind.LAYOUTS]["n0"]
        assert wire.parse(doc).spec == theirs
        assert doc["metadata"]["annotations"] == {
            gl.LEADER_ANNOTATION: "c2",
            gl.TERM_ANNOTATION: "1",
        }
        assert controller.leading  # a refused write is no reason to stop
        api.flowing.set()
        await _until("p reserved", lambda: "ns/p" in _reserved(api, "n0"))
        # The in-memory API, like the real one, took it only on c2's version: planned anew.
        assert len(api.spec_writes) == writes + 1
        assert (
            api.objects[kubeobjects.Kind.LAYOUTS]["n0"]["metadata"]["annotations"][
                gl.LEADER_ANNOTATION
            ]
            == "c1"
        )

    _run(body, api=_Api(), clock=clock)


def test_a_new_layout_is_created_only_if_none_exists() -> None:
    # c1 has not seen n0's GpuLayout (its watch lags) when another leader creates it: c1's
    # create is refused rather than overwrite that spec with an empty one.
    clock = _Clock(1000.0)
    theirs = gl.LayoutSpec((gl.GpuSpec(0, None, (gl.InstanceSpec("1g.10gb", 6),)),))

    async def body(api: _Api, controller: running.Controller) -> None:
        await _until("the Lease", lambda: controller.leading)
        await _until("the watches", lambda: controller.not_ready() is None)
        api.flowing.clear()
        await api.apply_layout_spec(
            "n0", theirs, owner_uid=None, fence=kubeapi.Fence(None, leader="c2", term=1)
        )
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        await _until("a refused create", lambda: bool(api.refused_writes))
        assert api.refused_writes[0][1].resource_version is None
        assert wire.parse(api.objects[kubeobjects.Kind.LAYOUTS]["n0"]).spec == theirs
        assert api.spec_writes == [("n0", theirs)]

    _run(body, api=_Api(), clock=clock)


def test_the_term_written_is_the_leases_transitions_when_taken() -> None:
    clock = _Clock(1000.0)
    api = _Api()
    first = leases.claim(None, observed=None, identity="c0", now=0.0, stamp=EPOCH)
    assert first is not None
    first["spec"]["leaseTransitions"] = 6
    asyncio.run(api.write_lease(first, create=True))

    async def body(api: _Api, controller: running.Controller) -> None:
        await _reads(api)
        clock.now += 15.0
        await api.put(kubeobjects.Kind.NODES, _node("n0"))
        await _until("the GpuLayout", lambda: "n0" in api.objects[kubeobjects.Kind.LAYOUTS])
        annotations = api.objects[kubeobjects.Kind.LAYOUTS]["n0"]["metadata"]["annotations"]
        assert annotations == {gl.LEADER_ANNOTATION: "c1", gl.TERM_ANNOTATION: "7"}
        assert api.leases[KEY]["spec"]["leaseTransitions"] == 7

    _run(body, api=api, clock=clock)


# --------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("kw", "says"),
    [
        pytest.param({"renew_deadline_s": 15.0}, "renew deadline", id="deadline-not-shorter"),
        pytest.param({"renew_deadline_s": 0.0}, "renew deadline", id="deadline-zero"),
        pytest.param({"lease_timeout_s": 9.0}, "timeout", id="timeout-past-deadline"),
        pytest.param({"lease_timeout_s": 0.0}, "timeout", id="timeout-zero"),
    ],
)
def test_the_timings_must_leave_the_safety_margin(kw: dict[str, Any], says: str) -> None:
    with pytest.raises(errors.MigpilotError, match=says):
        running.Settings(identity="c1", **kw)


def test_the_default_timings_are_client_gos() -> None:
    s = running.Settings(identity="c1")
    assert (s.lease_duration_s, s.renew_deadline_s, s.renew_every_s) == (15, 10.0, 2.0)
    assert s.lease_timeout_s < s.renew_deadline_s - s.renew_every_s + 1e-9


# --------------------------------------------------------------------------- release


def test_a_leader_stopped_cleanly_releases_its_lease_and_a_standby_takes_it_at_once() -> None:
    # client-go's ReleaseOnCancel: no holder and a 1 s duration, the transitions kept; the
    # standby, which saw c1 renewing a moment ago, takes it at its next try, not 15 s later.
    clock = _Clock(1000.0)
    api = _Api()

    async def body(api: _Api, controller: running.Controller) -> None:
        await _until("the Lease taken", lambda: controller.leading)

    _run(body, api=api, clock=clock, wall=lambda: EPOCH)
    spec = api.leases[KEY]["spec"]
    assert spec["holderIdentity"] == ""
    assert (spec["leaseDurationSeconds"], spec["leaseTransitions"]) == (1, 0)
    seen = leases.observe(api.leases[KEY], previous=None, now=0.0)
    assert not leases.held_by_another(seen, identity="c2", now=0.0)
    assert leases.claim(api.leases[KEY], observed=seen, identity="c2", now=0.0, stamp=EPOCH) == {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": leases.NAME,
            "namespace": leases.NAMESPACE,
            "resourceVersion": api.leases[KEY]["metadata"]["resourceVersion"],
        },
        "spec": {
            "holderIdentity": "c2",
            "leaseDurationSeconds": leases.DURATION_S,
            "acquireTime": leases.format_time(EPOCH),
            "renewTime": leases.format_time(EPOCH),
            "leaseTransitions": 1,
        },
    }


def test_a_stopped_controller_leaves_a_lease_another_took_alone() -> None:
    # c1 held it, then c0 took it (c1 saw that): stopping c1 releases nothing of c0's.
    clock = _Clock(1000.0)
    api = _Api()

    async def body(api: _Api, controller: running.Controller) -> None:
        await _until("the Lease taken", lambda: controller.leading)
        api.hang = True  # c1 cannot renew; c0 takes the Lease after c1's deadline
        clock.now += leases.RENEW_DEADLINE_S
        await _until("c1 stepped down", lambda: not controller._acting())
        current = api.leases[KEY]
        body = leases.claim(current, observed=None, identity="c0", now=0.0, stamp=EPOCH)
        assert body is not None
        api.hang = False
        await api.write_lease(body, create=False)
        await _reads(api)

    _run(body, api=api, clock=clock, wall=lambda: EPOCH)
    assert api.leases[KEY]["spec"]["holderIdentity"] == "c0"


def test_release_gives_up_only_our_own_lease() -> None:
    ours = leases.claim(None, observed=None, identity="c1", now=0.0, stamp=EPOCH)
    assert ours is not None
    ours["metadata"]["resourceVersion"] = "7"
    ours["spec"]["leaseTransitions"] = 3
    got = leases.release(ours, identity="c1", stamp=EPOCH + 5)
    assert got is not None
    assert got["metadata"]["resourceVersion"] == "7"
    assert got["spec"] == {
        "holderIdentity": "",
        "leaseDurationSeconds": 1,
        "acquireTime": leases.format_time(EPOCH + 5),
        "renewTime": leases.format_time(EPOCH + 5),
        "leaseTransitions": 3,
    }
    assert not leases.fresh(got, EPOCH + 5)  # the webhook stops gating at once
    assert leases.release(ours, identity="c2", stamp=EPOCH) is None
    assert leases.release({"spec": None}, identity="c1", stamp=EPOCH) is None
