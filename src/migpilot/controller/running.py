"""The controller's loop: watch the cluster, plan the waiting MIG pods, reserve, pin, release.

Why it exists: this is the one place that turns the loop's decisions into API calls. The
rules are not here: they are :func:`control.reconcile`, the step the simulator runs too. Per
wake-up:

1. **observe** the cluster from the watched Pods, Nodes and GpuLayouts
   (:func:`observing.observe`, then :func:`pinning.to_control`);
2. **decide**: one :func:`control.reconcile` in a worker thread (it plans with the fast planner
   when the batch window is over);
3. **write** what it decided, in order: a Warning on pods that can never be served, let go to
   kube-scheduler; reservations released (pods gone, done or bound) and expired (specs
   rewritten without them); reserved pods pinned (node affinity narrowed to their node, gate
   removed: :mod:`pinning`), so kube-scheduler binds them; each changed node's GpuLayout spec
   with server-side apply, reserving the chosen instances; an Event on each pod the plan left.

Besides the step, the shell declines the pods migpilot leaves alone (another system's, or
amounts it cannot read) and creates the GpuLayouts nodes lack.

Restart-safe by construction: everything the controller knows lives in the API (reservations
in the specs, pins in the pods), so a new controller, or this one after the API server comes
back, reads it again and plans nothing twice. Writes are reflected in the local view at once, so
the next wake-up never plans a pod whose reservation is still on its way back through the watch.

Active/passive: the loop acts only while it holds the Lease (:mod:`migpilot.api.leases`, the
rules of client-go's leader election: freshness judged on this process's monotonic clock,
Lease calls bounded by a timeout, the renew deadline checked before every write), and each
GpuLayout spec write carries the object's ``resourceVersion`` as a precondition, so the write
of a leader deposed while it was paused fails; watches run either way so a standby takes over
warm. Bad input (a malformed object, a pod the
API refuses to patch) is logged and skipped, never fatal.

A shell module: the API only through :class:`kubeapi.ControllerApi`; time from the clocks it is
given.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from migpilot import errors, gcpause, logs, probes
from migpilot.api import gpulayouts, gpulayouts_wire, leases
from migpilot.controller import kubeapi, metrics, observing, pinning, turnover
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects as kubeobjects
from migpilot.planning import (
    control,
    draclaims,
    drasteering,
    fast,
    modes,
    options,
    plans,
    snapshot,
    unified,
    usage,
)

_log = logging.getLogger("migpilot.controller")

Clock = Callable[[], float]
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Settings:
    """How the controller runs."""

    identity: str
    """Who holds the Lease (the pod's name in a cluster). Required."""
    batch_window_s: float = 0.25
    """Seconds from the first waiting pod to the plan that serves it and the pods arriving with
    it. Default 0.25."""
    lease_namespace: str = leases.NAMESPACE
    """Namespace of the Lease (and the webhook's). Default migpilot-system."""
    lease_name: str = leases.NAME
    """Name of the Lease the webhook checks. Default migpilot-controller."""
    lease_duration_s: int = leases.DURATION_S
    """Seconds a standby waits, on its own clock, having seen no renewal before it takes the
    Lease. Default 15."""
    renew_deadline_s: float = leases.RENEW_DEADLINE_S
    """Seconds after the start of its last successful renewal, on its own monotonic clock,
    that the leader stops writing when it could not renew since. Less than
    :attr:`lease_duration_s`. Default 10."""
    renew_every_s: float = leases.RETRY_S
    """Seconds between tries to take or renew the Lease. Default 2."""
    lease_timeout_s: float = leases.CALL_TIMEOUT_S
    """Seconds one Lease call may take before it is abandoned: at most
    :attr:`renew_deadline_s` minus :attr:`renew_every_s`, so one hung call never costs the
    leader its Lease. Default 4."""
    resync_s: float = 5.0
    """Seconds between wake-ups when nothing happens (pins and releases are re-checked).
    Default 5."""
    retry_s: float = 1.0
    """Seconds before listing again after the API server failed, doubled at each failure in a
    row up to :attr:`retry_max_s`. Default 1."""
    retry_max_s: float = 30.0
    """The longest wait between two tries of a failing watch (or of the start's checks).
    Default 30."""
    reservation_timeout_s: float = 60.0
    """Seconds a reservation may wait, once its instances exist, for its pod to be bound
    before it is dropped and the pod planned again (capacity another pod took); ten times
    that for instances that never appear. Default 60."""
    scale_out_after_s: float | None = None
    """Seconds a gated pod may be left unplaced before it is let go, unpinned, for a node
    autoscaler to see (``--node-autoscaling``, ``--scale-out-after``); ``None`` (the default):
    it waits gated."""
    full_replan_s: float | None = 60.0
    """Seconds between full replans (``--full-replan-every``); in between, a plan while capacity
    has not grown places only the new pods (:mod:`migpilot.planning.incremental`). ``None``
    (``--full-replan-every 0``): every plan is a full replan. Default 60."""
    writers: int = 32
    """API writes in flight at once. Default 32."""
    event_writers: int = 4
    """Events recorded at once, in the background: an Event never holds up a pass. Default 4."""
    event_backlog: int = 20000
    """Events waiting to be recorded at most; more are dropped (and counted). Default 20000."""
    stall_s: float = 120.0
    """Seconds the loop may go without a round before ``/healthz`` fails (it wakes at least
    every :attr:`resync_s`; a plan of 8,000 GPUs takes about a second). Default 120."""
    policy: snapshot.Policy = snapshot.Policy.BINPACK
    """The planner's node policy for pods that name none (``hami.io/node-scheduler-policy``).
    Default binpack."""
    gpu_policy: snapshot.Policy = snapshot.Policy.SPREAD
    """The planner's GPU policy for pods that name none (``hami.io/gpu-scheduler-policy``).
    Default spread (HAMi's chart default)."""
    dra_scoring: str = draclaims.Scoring.LEAST_ALLOCATED.value
    """kube-scheduler's ``NodeResourcesFit`` scoring strategy (``LeastAllocated``, its default,
    or ``MostAllocated``): pods asking through DRA claims are planned with the node policy it
    stands for (spread, or binpack) and GPUs packed (``docs/dra.md``)."""

    def __post_init__(self) -> None:
        if not self.identity:
            raise errors.MigpilotError("the controller's identity must not be empty")
        draclaims.node_policy(self.dra_scoring)  # names a strategy kube-scheduler has
        control.Settings(  # checks the window and the grace
            batch_window_s=self.batch_window_s, scale_out_after_s=self.scale_out_after_s
        )
        if self.renew_every_s * 2 > self.lease_duration_s:
            raise errors.MigpilotError(
                f"the Lease must be renewed at least twice per duration ({self.lease_duration_s}"
                f" s), not every {self.renew_every_s} s"
            )
        if not 0 < self.renew_deadline_s < self.lease_duration_s:
            raise errors.MigpilotError(
                f"the renew deadline ({self.renew_deadline_s} s) must be shorter than the Lease"
                f" duration ({self.lease_duration_s} s)"
            )
        if not 0 < self.lease_timeout_s <= self.renew_deadline_s - self.renew_every_s:
            raise errors.MigpilotError(
                f"a Lease call's timeout ({self.lease_timeout_s} s) must be at most the renew"
                f" deadline ({self.renew_deadline_s} s) less the retry period"
                f" ({self.renew_every_s} s)"
            )


@dataclass
class _Store:
    """What the watches have shown, as views the pure modules read."""

    pods: dict[str, tuple[dict[str, Any], observing.PodView]] = field(default_factory=dict)
    nodes: dict[str, observing.NodeView] = field(default_factory=dict)
    layouts: dict[str, gpulayouts.GpuLayout] = field(default_factory=dict)
    namespaces: dict[str, Mapping[str, str]] = field(default_factory=dict)
    """Namespace labels by name (for ``namespaceSelector`` in pod (anti-)affinity terms)."""
    claims: dict[str, observing.ClaimRead] = field(default_factory=dict)
    """ResourceClaims by ``namespace/name``, as the planner reads their specs."""
    templates: dict[str, observing.ClaimRead] = field(default_factory=dict)
    """ResourceClaimTemplates by ``namespace/name``, as the planner reads their specs."""
    versions: dict[tuple[kubeobjects.Kind, str], int] = field(default_factory=dict)
    """The newest ``resourceVersion`` seen per object: what the controller's own writes
    returned, or a watch showed. An older one is a stale event and is dropped."""
    synced: set[kubeobjects.Kind] = field(default_factory=set)


_CLAIM_KINDS = (kubeobjects.Kind.RESOURCECLAIMS, kubeobjects.Kind.RESOURCECLAIMTEMPLATES)


def _key(doc: Mapping[str, Any]) -> str:
    meta = doc.get("metadata") or {}
    ns = meta.get("namespace")
    return f"{ns}/{meta.get('name')}" if ns else str(meta.get("name"))


class Controller:
    """The loop (see the module). :meth:`run` until ``stop`` is set."""

    def __init__(
        self,
        api: kubeapi.ControllerApi,
        *,
        settings: Settings,
        metrics_: metrics.ControllerMetrics | None = None,
        clock: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self.api = api
        self.settings = settings
        self.metrics = metrics_ or metrics.ControllerMetrics()
        self._clock = clock
        self._wall = wall
        self.heartbeat = probes.Heartbeat(clock, stall_s=settings.stall_s)
        """Beats once per round of :meth:`run`; ``/healthz`` reads it."""
        self.watches = probes.Watches(clock)
        """The watches that are down; ``/healthz`` fails while any is."""
        self._bad: dict[tuple[kubeobjects.Kind, str], str] = {}
        """Objects skipped or ignored, and why: each is logged once per reason."""
        self._unreadable: dict[str, str] = {}
        """GpuLayouts whose spec no reader accepts (stored with an empty spec), and why: each
        pass rewrites their spec (:meth:`_repair`)."""
        self._store = _Store()
        self._node_cache: observing.NodeCache = {}
        self._wake = asyncio.Event()
        self._changed = True
        self._memory = control.Memory()
        self._waits_said: dict[str, str] = {}
        """Reserved pod -> what it was last logged at INFO to wait for (:func:`new_waits`)."""
        self._wake_at: float | None = None
        """When the last step said the next would decide something with nothing changed."""
        self._unlisted: dict[str, gpulayouts.LayoutSpec] = {}
        """DRA node -> the spec written for gated pods the last plan steered there, which its
        agent did not list yet: the step that sees it listed plans at once
        (:attr:`control.Observed.listing`)."""
        self._control = control.Settings(
            batch_window_s=settings.batch_window_s,
            reservation_timeout_s=settings.reservation_timeout_s,
            scale_out_after_s=settings.scale_out_after_s,
            incremental=settings.full_replan_s is not None,
            full_replan_s=settings.full_replan_s,
        )
        self.leading = False
        self._lease_until = 0.0
        self._observed: leases.Observation | None = None
        self._term = 0
        self._written: Mapping[str, Any] | None = None
        """The Lease as this controller last wrote it while holding it (given up on a clean
        stop); ``None`` once another holds it."""
        self._seen_waiting: dict[str, float] = {}
        self._said: dict[str, tuple[str, str]] = {}
        self._node_said: dict[str, str] = {}
        self._reported: dict[str, gpulayouts.LayoutStatus] = {}
        """The last GpuLayout status seen per node: what :meth:`_count_turnover` compares the
        next one with."""
        self._writes = asyncio.Semaphore(settings.writers)
        self._notes: asyncio.Queue[kubeobjects.EventNote] = asyncio.Queue(settings.event_backlog)
        self.plans = 0
        """Plans made (tests and the benchmark read it)."""

    # -- watches ----------------------------------------------------------------------------

    def _put(self, kind: kubeobjects.Kind, doc: Mapping[str, Any], *, deleted: bool) -> None:
        key = _key(doc)
        store = self._store
        version = _version(doc)
        if deleted:
            store.versions.pop((kind, key), None)
        elif version is not None:
            if version < store.versions.get((kind, key), -1):
                return  # older than what a write of ours returned: a stale event
            store.versions[(kind, key)] = version
        if kind is kubeobjects.Kind.PODS:
            if deleted:
                store.pods.pop(key, None)
                self._seen_waiting.pop(key, None)
                self._said.pop(key, None)
                return
            view = observing.pod_view(doc)
            store.pods[key] = (dict(doc), view)
            if view.is_mig and view.waiting:
                self._seen_waiting.setdefault(key, self._clock())
            elif view.node and key in self._seen_waiting:
                created = _epoch(view.created)
                self.metrics.observe_bound(
                    seen_s=self._clock() - self._seen_waiting.pop(key),
                    created_s=self._wall() - created if created is not None else None,
                )
        elif kind is kubeobjects.Kind.NODES:
            if deleted:
                store.nodes.pop(key, None)
            else:
                store.nodes[key] = observing.node_view(doc)
        elif kind is kubeobjects.Kind.NAMESPACES:
            if deleted:
                store.namespaces.pop(key, None)
            else:
                store.namespaces[key] = observing.namespace_labels(doc)
        elif kind in _CLAIM_KINDS:
            reads = (
                store.templates if kind is kubeobjects.Kind.RESOURCECLAIMTEMPLATES else store.claims
            )
            if deleted:
                reads.pop(key, None)
            else:
                template = kind is kubeobjects.Kind.RESOURCECLAIMTEMPLATES
                reads[key] = observing.claim_read(doc, template=template)
        elif deleted:
            store.layouts.pop(key, None)
            self._reported.pop(key, None)  # the node is gone: not a destroy of its instances
            self._unreadable.pop(key, None)
        else:
            try:
                store.layouts[key] = gpulayouts_wire.parse(doc)
                self._unreadable.pop(key, None)
            except errors.MigpilotError as err:
                # A spec no reader accepts (the agent keeps its last good one): plan the node
                # from its status alone and rewrite the spec (:meth:`_repair`), rather than
                # lose the node until someone edits it by hand.
                try:
                    store.layouts[key] = gpulayouts_wire.parse({**doc, "spec": {"gpus": []}})
                except errors.MigpilotError:
                    _log.warning("GpuLayout %s ignored: %s", key, err, extra={"node": key})
                    store.layouts.pop(key, None)
                    self._unreadable.pop(key, None)
                    return
                if self._unreadable.get(key) != str(err):
                    _log.error(
                        "GpuLayout %s has a spec no reader accepts (%s): planned from its "
                        "status, its spec is rewritten",
                        key,
                        err,
                        extra={"node": key},
                    )
                self._unreadable[key] = str(err)
            self._count_turnover(key, store.layouts[key].status)

    def _count_turnover(self, node: str, status: gpulayouts.LayoutStatus | None) -> None:
        """Count the instances ``node``'s agent reports created and destroyed since the status
        seen last. The first status seen of a node (at this controller's start, or the agent's
        first report) is the baseline, not a creation. A standby keeps the baseline current and
        counts nothing, so the controllers' counts add up to each change counted once."""
        if status is None:
            return  # the agent has not reported yet
        before = self._reported.get(node)
        self._reported[node] = status
        if before is not None and self.leading:
            self.metrics.observe_turnover(turnover.diff(before, status))

    def _take(self, kind: kubeobjects.Kind, doc: Mapping[str, Any], *, deleted: bool) -> None:
        """:meth:`_put` one object from a watch or a list; an object it cannot read is logged
        once and skipped (client-go's informers skip what they cannot decode): the watch goes
        on for every other object."""
        try:
            key = _key(doc)
        except Exception:  # metadata that is not a mapping: nothing to name it by
            _log.warning("a %s without readable metadata skipped", kind)
            return
        try:
            self._put(kind, doc, deleted=deleted)
        except Exception as err:  # a bug on one object must not stop the watch of all
            why = f"{type(err).__name__}: {err}"
            if self._bad.get((kind, key)) != why:
                self._bad[(kind, key)] = why
                _log.exception("%s %s skipped: %s", kind, key, why, extra=_about(kind, key))
            self._put(kind, {"metadata": _meta_of(key)}, deleted=True)
            return
        if deleted:
            self._bad.pop((kind, key), None)
            return
        ignored = self._ignored(kind, key)
        if ignored is None:
            self._bad.pop((kind, key), None)
        elif self._bad.get((kind, key)) != ignored:
            self._bad[(kind, key)] = ignored
            _log.warning("%s %s ignored: %s", kind, key, ignored, extra=_about(kind, key))

    def _ignored(self, kind: kubeobjects.Kind, key: str) -> str | None:
        if kind is kubeobjects.Kind.PODS and key in self._store.pods:
            return self._store.pods[key][1].ignored
        if kind is kubeobjects.Kind.NODES and key in self._store.nodes:
            return self._store.nodes[key].problem
        return None

    async def _inform(self, kind: kubeobjects.Kind, stop: asyncio.Event) -> None:
        """List, then watch; list again on 410 Gone or any failure, after a wait that doubles
        at each failure in a row (:attr:`Settings.retry_s` up to :attr:`Settings.retry_max_s`).
        The watch is down (``/healthz`` fails) from a failure until it lists again."""
        failures = 0
        while not stop.is_set():
            try:
                self.metrics.api_requests.labels(operation=f"list-{kind}").inc()
                listed = await self.api.list_all(kind)
                keep = {_key(d) for d in listed.items}
                current: set[str] = set(self._stored(kind))
                for gone in current - keep:
                    self._take(kind, {"metadata": _meta_of(gone)}, deleted=True)
                for doc in listed.items:
                    self._take(kind, doc, deleted=False)
                self._store.synced.add(kind)
                self.watches.up(kind.value)
                failures = 0
                self._poke()
                self.metrics.api_requests.labels(operation=f"watch-{kind}").inc()
                async for event in self.api.watch(kind, resource_version=listed.resource_version):
                    self._take(
                        kind, event.object, deleted=event.type is kubeobjects.EventType.DELETED
                    )
                    self._poke()
            except kube_errors.GoneError:
                continue
            except kube_errors.KubeApiError as err:
                self.metrics.api_errors.labels(operation=f"watch-{kind}").inc()
                self.watches.down(kind.value, str(err))
                wait = self._backoff(failures)
                _log.warning("watching %s failed, listing again in %g s: %s", kind, wait, err)
                failures += 1
                await _sleep(wait, stop)
            except Exception as err:  # a bug: logged, and the watch restarts (never dies)
                self.metrics.api_errors.labels(operation=f"watch-{kind}").inc()
                self.watches.down(kind.value, f"{type(err).__name__}: {err}")
                wait = self._backoff(failures)
                _log.exception("watch of %s failed unexpectedly, restarting in %g s", kind, wait)
                failures += 1
                await _sleep(wait, stop)

    def _stored(self, kind: kubeobjects.Kind) -> Mapping[str, Any]:
        """What the store holds of ``kind``, by key."""
        store = self._store
        held: dict[kubeobjects.Kind, Mapping[str, Any]] = {
            kubeobjects.Kind.PODS: store.pods,
            kubeobjects.Kind.NODES: store.nodes,
            kubeobjects.Kind.NAMESPACES: store.namespaces,
            kubeobjects.Kind.RESOURCECLAIMS: store.claims,
            kubeobjects.Kind.RESOURCECLAIMTEMPLATES: store.templates,
        }
        return held.get(kind, store.layouts)

    def _backoff(self, failures: int) -> float:
        """Seconds to wait after ``failures`` failures in a row (capped exponential)."""
        s = self.settings
        return float(min(s.retry_max_s, s.retry_s * 2 ** min(failures, 30)))

    def _poke(self) -> None:
        self._changed = True
        self._wake.set()

    # -- the Lease ---------------------------------------------------------------------------

    async def _lead(self, stop: asyncio.Event) -> None:
        """Take or renew the Lease every :attr:`Settings.renew_every_s` (client-go's
        ``tryAcquireOrRenew``): a standby takes it once it has seen no renewal for
        ``leaseDurationSeconds`` on its own monotonic clock; the leader keeps acting until
        :attr:`Settings.renew_deadline_s` after the start of its last successful renewal
        (:meth:`_acting`). Every call is bounded by :attr:`Settings.lease_timeout_s`."""
        s = self.settings
        while not stop.is_set():
            if self.cannot_serve() is not None:  # let the Lease lapse: a standby takes over
                self._set_leading(False)
                await _sleep(s.renew_every_s, stop)
                continue
            started = self._clock()
            try:
                lease = await self._lease_call(
                    "lease-get", self.api.get_lease(s.lease_namespace, s.lease_name)
                )
                self._observed = leases.observe(lease, previous=self._observed, now=self._clock())
                body = leases.claim(
                    lease,
                    observed=self._observed,
                    identity=s.identity,
                    now=self._clock(),
                    stamp=self._wall(),
                    namespace=s.lease_namespace,
                    name=s.lease_name,
                    duration_s=s.lease_duration_s,
                    dynamic_mig=self.any_dynamic(),
                )
                if body is not None:
                    written = await self._lease_call(
                        "lease-write", self.api.write_lease(body, create=lease is None)
                    )
                    self._observed = leases.observe(
                        written, previous=self._observed, now=self._clock()
                    )
                    self._term = leases.transitions_of(written)
                    self._written = written
                    # From the start of the attempt: the renewal landed after it, so every
                    # standby saw it (and restarted its wait) after that too.
                    self._lease_until = started + s.renew_deadline_s
                    self._set_leading(self._clock() < self._lease_until)
                else:
                    self._written = None
                    self._set_leading(False)
            except kube_errors.ConflictError:
                self._written = None
                self._set_leading(False)
            except (kube_errors.KubeApiError, TimeoutError) as err:
                self.metrics.api_errors.labels(operation="lease").inc()
                _log.warning(
                    "Lease %s/%s not renewed: %s",
                    s.lease_namespace,
                    s.lease_name,
                    err or f"no answer in {s.lease_timeout_s:g} s",
                )
                self._acting()
            await _sleep(s.renew_every_s, stop)
        self._set_leading(False)

    async def _lease_call(self, operation: str, call: Awaitable[_T]) -> _T:
        """One Lease call, abandoned (:class:`TimeoutError`) after
        :attr:`Settings.lease_timeout_s`: a hung call must not hold the renewals up."""
        self.metrics.api_requests.labels(operation=operation).inc()
        return await asyncio.wait_for(call, timeout=self.settings.lease_timeout_s)

    def _acting(self) -> bool:
        """Whether this controller may write now: it holds the Lease and its renew deadline
        has not passed on its own monotonic clock. Checked before every batch of writes (and
        each write); a leader past its deadline steps down at once, whatever its Lease calls
        are doing (client-go's renew deadline)."""
        if self.leading and self._clock() >= self._lease_until:
            _log.warning(
                "Lease not renewed within the renew deadline (%g s): stepping down",
                self.settings.renew_deadline_s,
            )
            self._set_leading(False)
        return self.leading

    def _set_leading(self, leading: bool) -> None:
        if leading != self.leading:
            _log.info(
                "%s the Lease as %s",
                "holding" if leading else "not holding",
                self.settings.identity,
            )
            self.leading = leading
            self.metrics.leader.set(1 if leading else 0)
            self._poke()

    # -- the loop ----------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Run until ``stop`` is set. A watch or Lease task that ends (it never should: each
        catches its own failures) is logged and started again."""
        makers: dict[str, Callable[[], Any]] = {
            k.value: functools.partial(self._inform, k, stop) for k in kubeapi.WATCHED
        }
        makers["lease"] = functools.partial(self._lead, stop)
        tasks = {name: asyncio.create_task(make()) for name, make in makers.items()}
        writers = [
            asyncio.create_task(self._record_events()) for _ in range(self.settings.event_writers)
        ]
        stopper = asyncio.create_task(stop.wait())
        try:
            while not stop.is_set():
                self.heartbeat.beat()
                self._revive(tasks, makers)
                timeout = self.settings.resync_s
                if self._wake_at is not None:
                    timeout = max(0.0, min(timeout, self._wake_at - self._clock()))
                waker = asyncio.create_task(self._wake.wait())
                await asyncio.wait(
                    {waker, stopper, *tasks.values()},
                    timeout=timeout,
                    return_when="FIRST_COMPLETED",
                )
                waker.cancel()
                self._wake.clear()
                if stop.is_set():
                    break
                if (
                    self._acting()
                    and self.cannot_serve() is None
                    and len(self._store.synced) == len(kubeapi.WATCHED)
                ):
                    await self.step()
        finally:
            stopper.cancel()
            for t in [*tasks.values(), *writers]:
                t.cancel()
            for t in [*tasks.values(), *writers]:
                with contextlib.suppress(asyncio.CancelledError):
                    await t
            await self._release_lease()

    async def _release_lease(self) -> None:
        """On a clean stop, give up the Lease this controller holds (client-go's
        ``ReleaseOnCancel``), so a standby takes over at its next try rather than a Lease
        duration later. Called once the loop and its tasks have stopped: no write of ours can
        land after the release. A failure only means the Lease lapses instead."""
        written, self._written = self._written, None
        self._set_leading(False)
        if written is None:
            return
        s = self.settings
        body = leases.release(written, identity=s.identity, stamp=self._wall())
        if body is None:
            return
        try:
            await self._lease_call("lease-release", self.api.write_lease(body, create=False))
        except (kube_errors.KubeApiError, TimeoutError) as err:
            _log.warning(
                "Lease %s/%s not released (%s): a standby takes over once it lapses",
                s.lease_namespace,
                s.lease_name,
                err or f"no answer in {s.lease_timeout_s:g} s",
            )
            return
        _log.info("Lease %s/%s released", s.lease_namespace, s.lease_name)

    def _revive(self, tasks: dict[str, asyncio.Task[Any]], makers: Mapping[str, Any]) -> None:
        """Start again every task that ended, saying why it did."""
        for name, task in list(tasks.items()):
            if not task.done():
                continue
            err = None if task.cancelled() else task.exception()
            why = f"{type(err).__name__}: {err}" if err is not None else "it returned"
            _log.error("the %s task ended (%s): starting it again", name, why, exc_info=err)
            if name != "lease":
                self.watches.down(name, f"its task ended: {why}")
            tasks[name] = asyncio.create_task(makers[name]())

    def any_dynamic(self) -> bool:
        """Whether some node is labelled ``migpilot.io/mig-mode=dynamic``: written on the Lease,
        so the webhook gates whole-GPU pods only then (``docs/migmode.md``)."""
        return any(modes.dynamic_mig(n.labels) for n in self._store.nodes.values())

    def cannot_serve(self) -> str | None:
        """Why this controller cannot serve now (a watch down for longer than the Lease lasts,
        so its view of the cluster is stale), else ``None``. It then lets its Lease lapse, so
        a standby takes over and the webhook stops gating pods nobody plans."""
        if self.watches.down_for() > self.settings.lease_duration_s:
            return self.watches.check()
        return None

    def not_healthy(self) -> str | None:
        """``/healthz``: ``None`` while the loop goes round and every watch is up."""
        return self.heartbeat.check() or self.watches.check()

    def not_ready(self) -> str | None:
        """``None`` once every watch has listed its kind (``/readyz``), else what is missing.
        A standby is ready too: it keeps its caches warm to take over at once."""
        missing = sorted(k.value for k in kubeapi.WATCHED if k not in self._store.synced)
        return f"not yet listed: {', '.join(missing)}" if missing else None

    def observe(self) -> observing.Observed:
        """The cluster as the watches show it now."""
        return observing.observe(
            pods=(v for _, v in self._store.pods.values()),
            nodes=self._store.nodes.values(),
            layouts_by_node=self._store.layouts,
            namespaces=self._store.namespaces,
            claims=self._store.claims,
            templates=self._store.templates,
            policy=self.settings.policy,
            gpu_policy=self.settings.gpu_policy,
            dra_policy=draclaims.node_policy(self.settings.dra_scoring),
            cache=self._node_cache,
        )

    async def step(self) -> None:
        """One pass of the loop (see the module); the pending pods by reason as it left them."""
        try:
            await self._step()
        finally:
            self._gauge_reasons()

    async def _step(self) -> None:
        observed = self.observe()
        now = self._clock()
        changed, self._changed = self._changed, False
        now_listed = [
            name
            for name, spec in self._unlisted.items()
            if pinning.listed(observed.layouts.get(name), spec)
        ]
        for name in now_listed:
            del self._unlisted[name]
        self._gauge(observed)
        self._warn_broken(observed)
        await self._ensure_layouts(observed)
        await self._repair(observed)
        await self._decline(observed)
        timed: list[float] = []
        decision = await asyncio.to_thread(
            control.reconcile,
            pinning.to_control(observed, changed=changed, listing=bool(now_listed)),
            self._memory,
            now=now,
            settings=self._control,
            planner=functools.partial(_plan_timed, timed),
        )
        self._memory, self._wake_at = decision.memory, decision.wake_at
        for judged in decision.refused:
            await self._refuse(judged.pod, judged.reason)
        if decision.elsewhere:
            await self._judge(decision.elsewhere)
        await self._release(observed, decision.release)
        if decision.expired:
            await self._expire(observed, decision.expired)
        fresh, self._waits_said = new_waits(decision.waits, self._waits_said)
        for w in decision.waits:
            level = logging.INFO if w in fresh else logging.DEBUG
            about = {"pod": w.pod, "node": w.node}
            _log.log(level, "pod %s waits for %s", w.pod, w.why, extra=about)
        await asyncio.gather(*(self._pin_one(k, observed.nodes[n]) for k, n in decision.pins))
        if decision.plan is not None:
            await self._carry_out_plan(observed, decision, timed)
        if decision.dra_aside is not None and self._acting():
            await self._say_aside(decision.dra_aside)
        if decision.cleared is not None and self._acting():
            nodes = sorted({g.node for g in decision.cleared.gpus if g.changed})
            _log.info("DRA targets of %s cleared: no pod waits for their free placements",
                      ", ".join(nodes))  # fmt: skip
            await self._carry_out(observed, decision.cleared)
        if decision.scale_out and self._acting():
            await self._judge(decision.scale_out)

    async def _say_aside(self, aside: drasteering.Aside) -> None:
        """Tell the pod a DRA node is set aside for it (:attr:`control.Memory.dra_aside`)."""
        entry = self._store.pods.get(aside.pod)
        if entry is None:
            return
        _log.info("DRA node %s set aside for pod %s", aside.node, aside.pod,
                  extra={"pod": aside.pod, "node": aside.node})  # fmt: skip
        await self._say(
            entry[1], type_="Normal", reason="MigDraNodeSetAside",
            message=f"no node can take it now; node {aside.node} could once its instances end "
            "(it has the fewest compute slices in use of those that could), so the other DRA "
            "pods are kept off it while they fit elsewhere",
        )  # fmt: skip

    async def _carry_out_plan(
        self, observed: observing.Observed, decision: control.Decision, timed: Sequence[float]
    ) -> None:
        plan = decision.plan
        if plan is None or not self._acting():
            return  # the plan took past the renew deadline: written by no one, not counted
        self.plans += 1
        seconds = sum(timed)
        kind = "incremental" if decision.full is None else "full"
        self.metrics.plan_seconds.observe(seconds)
        self.metrics.plans.labels(kind).inc()
        self.metrics.planner_seconds.labels(kind).inc(seconds)
        _log.info(
            "plan %d (%s%s): %d pods waiting, %d placed, %d GPUs changed, %d not placed%s (%.3f s)",
            self.plans,
            kind,
            f": {decision.full}"
            if decision.full is not None
            else f", {len(decision.backlog)} in the backlog left out",
            len(observed.snapshot.pods),
            len(plan.placements),
            sum(g.changed for g in plan.gpus) + sum(m.changed for m in plan.mps),
            len(plan.unschedulable),
            f" ({plan.unschedulable[0].pod}: {plan.unschedulable[0].reason})"
            if plan.unschedulable
            else "",
            seconds,
        )
        await self._carry_out(observed, plan, steered=decision.steered, check=decision.dra_check)
        await self._judge(decision.judged)
        # The backlog an incremental pass left out still waits, as the plan that found it so
        # judged it.
        left = {j.pod for j in decision.judged if j.verdict is control.Verdict.WAIT}
        left.update(decision.backlog)
        self.metrics.observe_demand(
            usage.unmet_demand(
                observed.snapshot.nodes, [p for p in observed.snapshot.pods if p.key in left]
            )
        )

    def _gauge_reasons(self) -> None:
        """Each pod not yet bound (nor done) under the reason of the last Event it got."""
        pods = self._store.pods
        self.metrics.observe_pending(
            reason
            for key, (reason, _) in self._said.items()
            if key in pods and not pods[key][1].node and not pods[key][1].done
        )

    def _gauge(self, observed: observing.Observed) -> None:
        self.metrics.pending.labels(stage="planning").set(len(observed.snapshot.pods))
        self.metrics.pending.labels(stage="reserved").set(len(observed.reservations))
        self.metrics.observe_cluster(observed.snapshot)
        self.metrics.observe_free(usage.free_instances(observed.snapshot.nodes))
        if not observed.snapshot.pods:
            self.metrics.observe_demand({})  # nothing waits: nothing is wanted

    # -- writes ------------------------------------------------------------------------------

    async def _call(
        self, what: str, call: Any, *, about: Mapping[str, str] | None = None
    ) -> tuple[bool, Any]:
        """One write; ``about`` names the pod or node it concerns (for the logs)."""
        self.metrics.api_requests.labels(operation=what.split(" ", 1)[0]).inc()
        async with self._writes:
            try:
                got = await call
            except kube_errors.KubeApiError as err:
                self.metrics.api_errors.labels(operation=what.split(" ", 1)[0]).inc()
                _log.warning("%s failed: %s", what, err, extra=about)
                return False, None
        return True, got

    def _warn_broken(self, observed: observing.Observed) -> None:
        """A Warning on each node left out for a problem an admin must fix, once per problem."""
        for name, problem in sorted(observed.broken.items()):
            if self._node_said.get(name) == problem:
                continue
            self._node_said[name] = problem
            node = observed.nodes.get(name)
            _log.warning("node %s not planned: %s", name, problem, extra={"node": name})
            self._tell(kubeobjects.EventNote(
                "Node", None, name, node.uid if node is not None else "", "Warning",
                "MigNodeNotPlanned", f"not planned: {problem}",
            ))  # fmt: skip
        for name in [n for n in self._node_said if n not in observed.broken]:
            del self._node_said[name]  # fixed: a new problem is told again

    async def _say(self, view: observing.PodView, *, type_: str, reason: str, message: str) -> None:
        """An Event on the pod, once per distinct reason and message (recorded in the
        background)."""
        if self._said.get(view.key) == (reason, message):
            return
        self._said[view.key] = (reason, message)
        namespace, name = view.key.split("/", 1)
        self._tell(kubeobjects.EventNote("Pod", namespace, name, view.uid, type_, reason, message))

    def _tell(self, note: kubeobjects.EventNote) -> None:
        """Queue an Event for the background writers. Events only inform: a pass never waits
        for one (a thousand pods placed by one plan once held the loop for 15 s), and when
        the API server cannot keep up the backlog is bounded: the surplus is dropped and
        counted (``migpilot_controller_events_dropped_total``)."""
        try:
            self._notes.put_nowait(note)
        except asyncio.QueueFull:
            self.metrics.events_dropped.inc()
            _log.debug(
                "event on %s %s dropped: backlog full",
                note.kind,
                note.name,
                extra=_note_about(note),
            )
        self.metrics.events_pending.set(self._notes.qsize())

    async def _record_events(self) -> None:
        """One background writer of Events (the loop runs a few)."""
        while True:
            note = await self._notes.get()
            self.metrics.events_pending.set(self._notes.qsize())
            where = f"{note.namespace}/{note.name}" if note.namespace else note.name
            await self._call(
                f"event on {note.kind.lower()} {where}",
                self.api.record(note),
                about=_note_about(note),
            )

    async def _patch_pod(self, key: str, patch: pinning.Patch) -> bool:
        if not patch:
            return True
        if not self._acting():
            return False
        ok, got = await self._call(
            f"patch of pod {key}", self.api.patch_pod(key, patch), about={"pod": key}
        )
        if ok:
            self._put(kubeobjects.Kind.PODS, got, deleted=False)
        return ok

    async def _write_spec(
        self, name: str, spec: gpulayouts.LayoutSpec, *, owner_uid: str | None = None
    ) -> bool:
        """Write the spec of GpuLayout ``name`` if this controller still leads, on the
        condition that the object is still the version the spec was planned on (absent when
        the controller saw none): a 409 means someone wrote it since (a new leader, an agent's
        status), and the next pass plans on what the watch shows."""
        if not self._acting():
            return False
        try:
            # Never write what the agent (and this controller) would refuse to read.
            gpulayouts_wire.parse(gpulayouts_wire.spec_patch(name, spec))
        except errors.MigpilotError as err:
            self.metrics.invalid_specs.inc()
            _log.error(
                "GpuLayout %s: spec not written, no reader would accept it: %s; planning again",
                name,
                err,
                extra={"node": name},
            )
            self._poke()
            return False
        version = self._store.versions.get((kubeobjects.Kind.LAYOUTS, name))
        fence = kubeapi.Fence(
            resource_version=str(version) if version is not None else None,
            leader=self.settings.identity,
            term=self._term,
        )
        ok, got = await self._call(
            f"apply of GpuLayout {name}",
            self.api.apply_layout_spec(name, spec, owner_uid=owner_uid, fence=fence),
            about={"node": name},
        )
        if ok:
            self._put(kubeobjects.Kind.LAYOUTS, got, deleted=False)
        return ok

    async def _ensure_layouts(self, observed: observing.Observed) -> None:
        """A GpuLayout for every MIG node (or node in mode ``mps`` or ``time-slicing``) that lacks
        one, so its agent can report its GPUs."""
        shared = (modes.Mode.MPS, modes.Mode.TIME_SLICING)
        missing = [
            n
            for n in observed.nodes.values()
            if (n.mig_capable or n.static or n.labels.get(modes.MODE_LABEL) in shared)
            and n.name not in observed.layouts
        ]
        await asyncio.gather(
            *(
                self._write_spec(n.name, gpulayouts.LayoutSpec(()), owner_uid=n.uid or None)
                for n in missing
            )
        )

    async def _repair(self, observed: observing.Observed) -> None:
        """Rewrite each spec no reader accepts (:func:`pinning.repaired`): the agent keeps its
        last good spec meanwhile, and the node would otherwise wait for a plan that changes it."""
        await asyncio.gather(
            *(
                self._write_spec(name, pinning.repaired(observed.layouts[name]))
                for name in sorted(self._unreadable)
                if name in observed.layouts
            )
        )

    async def _decline(self, observed: observing.Observed) -> None:
        """Pods migpilot leaves alone: another system's (told once), and pods whose amounts
        cannot be read (a Warning, and the gate removed if migpilot set it)."""
        jobs: list[Awaitable[object]] = []
        for key, (doc, view) in self._store.pods.items():
            if view.other_mode is not None and not view.node and not view.done:
                # Another system's pod: not gated by the webhook, never planned; say so once,
                # so a user who expected migpilot sees why nothing happens.
                await self._say(
                    view,
                    type_="Normal",
                    reason="MigDeclined",
                    message=f"nvidia.com/vgpu-mode is {view.other_mode!r}: migpilot serves "
                    f"{unified.MIG_MODE!r} and {unified.MPS_MODE!r} only and leaves the pod to "
                    "the system serving it",
                )
            if view.ignored is not None and not view.done:
                jobs.append(self._ignore(key, doc, view, view.ignored))
            elif key in observed.dra_unplanned:
                # A pod whose DRA claims the planner cannot plan (or not yet find): told once
                # per reason; kube-scheduler's first fit serves it, so a pod gated by us that
                # will not be planned as its claims stand is let go (one whose claim is yet to
                # come waits for it, as kube-scheduler would).
                await self._say(
                    view,
                    type_="Normal",
                    reason="MigDraNotPlanned",
                    message=observed.dra_unplanned[key],
                )
                if key in observed.dra_refused and view.gated_by_us:
                    jobs.append(self._patch_pod(key, pinning.ungate_patch(doc)))
        await asyncio.gather(*jobs)

    async def _ignore(
        self, key: str, doc: Mapping[str, Any], view: observing.PodView, why: str
    ) -> None:
        """A pod whose amounts cannot be read (any pod, in any namespace): a Warning, once,
        and, if migpilot gated it, the gate removed so kube-scheduler says the rest."""
        await self._say(
            view, type_="Warning", reason="MigpilotIgnoredPod",
            message=f"migpilot ignores this pod: {why}",
        )  # fmt: skip
        if view.waiting and view.gated_by_us:
            await self._patch_pod(key, pinning.ungate_patch(doc))

    async def _refuse(self, key: str, why: str) -> None:
        """A pod that can never be served: a Warning, and let kube-scheduler say the rest (it
        is never kept gated)."""
        entry = self._store.pods.get(key)
        if entry is None:
            return
        doc, view = entry
        await self._say(view, type_="Warning", reason="MigRequestUnservable", message=why)
        if view.gated_by_us:
            await self._patch_pod(key, pinning.ungate_patch(doc))

    async def _release(self, observed: observing.Observed, nodes: Iterable[str]) -> None:
        jobs = []
        for name in nodes:
            layout = observed.layouts[name]
            # Only the reservations live on this node: a pod reserved on two nodes keeps one.
            live = frozenset(k for k, r in observed.reservations.items() if r.node == name)
            spec = pinning.without_stale(layout.spec, live=live)
            if spec != layout.spec:
                jobs.append(self._write_spec(name, spec))
        await asyncio.gather(*jobs)

    async def _expire(
        self, observed: observing.Observed, expired: Sequence[control.Expiry]
    ) -> None:
        """Drop the reservations the step let expire, node by node, so their pods are planned
        again."""
        live = frozenset(observed.reservations) - {e.pod for e in expired}
        for name in sorted({e.node for e in expired}):
            layout = observed.layouts[name]
            spec = pinning.without_stale(layout.spec, live=live)
            if not await self._write_spec(name, spec):
                continue
            for e in expired:
                if e.node != name:
                    continue
                _log.warning(
                    "reservation of %s on %s expired: planning again",
                    e.pod,
                    name,
                    extra={"pod": e.pod, "node": name},
                )
                await self._say(
                    observed.pods[e.pod],
                    type_="Warning",
                    reason="MigReservationExpired",
                    message=e.message,
                )

    async def _pin_one(self, key: str, node: observing.NodeView) -> None:
        entry = self._store.pods.get(key)
        if entry is None:
            return
        if await self._patch_pod(key, pinning.pin_patch(entry[0], node)):
            _log.info("pod %s pinned to %s", key, node.name, extra={"pod": key, "node": node.name})

    async def _carry_out(
        self,
        observed: observing.Observed,
        plan: plans.Plan,
        *,
        steered: Sequence[tuple[str, str]] = (),
        check: drasteering.Check | None = None,
    ) -> None:
        """Write each node's spec the plan changes or places pods on, or ``steered`` pods go to;
        then pin and let go the ``steered`` pods (:attr:`control.Decision.steered`) of each node
        whose spec was written and whose agent already lists it (:func:`pinning.listed`).
        ``check``: the round's first-fit check, which the pods' Events tell."""
        placed: dict[str, list[plans.Placement]] = {}
        for p in plan.placements:
            placed.setdefault(p.node, []).append(p)
        changed = (
            {g.node for g in plan.gpus if g.changed}
            | {g.node for g in plan.mps if g.changed}
            | {s.node for s in plan.switches}
        )
        unified = frozenset(k for k, v in observed.pods.items() if v.unified)
        dra = frozenset(p.key for p in observed.snapshot.pods if p.dra)
        pins: dict[str, list[str]] = {}
        for key, name in steered:
            pins.setdefault(name, []).append(key)
        writes = []
        for node in observed.snapshot.nodes:
            if node.name not in changed and node.name not in placed and node.name not in pins:
                continue
            kept = pinning.kept_of(observed.reservations.values(), node.name)
            try:
                spec = pinning.spec_for(
                    node,
                    plan,
                    kept=kept,
                    unified=unified,
                    layout=observed.layouts.get(node.name),
                    unreserved=dra,
                )
            except errors.MigpilotError as err:  # a planner bug: never write such a spec
                _log.error(
                    "plan for %s not carried out: %s", node.name, err, extra={"node": node.name}
                )
                continue
            self.metrics.reconfigurations.inc(
                sum(1 for g in plan.gpus if g.node == node.name and g.changed)
                + sum(1 for m in plan.mps if m.node == node.name and m.changed)
            )
            if _log.isEnabledFor(logging.DEBUG):
                _log.debug(
                    "plan %d: %s had %s (bound %s)",
                    self.plans,
                    node.name,
                    _describe_node(node),
                    dict(observed.bound.get(node.name, {})),
                    extra=logs.about(node=node.name),
                )
                _log.debug(
                    "plan %d: %s gets %s",
                    self.plans,
                    node.name,
                    _describe_spec(spec),
                    extra=logs.about(node=node.name),
                )
            listed = pinning.listed(observed.layouts.get(node.name), spec)
            if pins.get(node.name) and not listed:
                self._unlisted[node.name] = spec
            else:
                self._unlisted.pop(node.name, None)
            writes.append(
                self._write_and_tell(
                    node.name,
                    spec,
                    placed.get(node.name, []),
                    [a for a in plan.actions if a.node == node.name],
                    [a for a in plan.slice_actions if a.node == node.name],
                    # Let go only once the node's agent lists this very target first; until
                    # then they stay gated, planned again when the agent reports.
                    steered=pins.get(node.name, ()) if listed else (),
                    check=check,
                )
            )
        await asyncio.gather(*writes)

    async def _write_and_tell(
        self,
        name: str,
        spec: gpulayouts.LayoutSpec,
        placements: list[plans.Placement],
        actions: list[plans.Action],
        slice_actions: list[plans.SliceAction] = [],  # noqa: B006 (never mutated)
        *,
        steered: Sequence[str] = (),
        check: drasteering.Check | None = None,
    ) -> None:
        """Write node ``name``'s spec, then say what it reserves, or, for the ``steered`` pods
        (DRA claims: nothing reserved), pin each to the node and let it go: the node's agent
        lists the planned placements first, and kube-scheduler allocates them; or, where the
        first-fit ``check`` did not steer, nothing is listed first (but for a pod a
        placement listed first for a pod in flight would take:
        ``drasteering.first_fit_plan``) and kube-scheduler's first fit
        allocates them (Event ``MigDraFirstFit``)."""
        if not await self._write_spec(name, spec):
            # Nothing else will change for these pods: plan them again a batch window later.
            self._poke()
            return
        self.metrics.observe_written(actions, slice_actions)
        node = self._store.nodes.get(name)
        dra_node = node is not None and node.labels.get(modes.MODE_LABEL) == modes.Mode.DRA.value
        # A DRA node's agent makes nothing from its target (the DRA plugin makes each placement
        # kube-scheduler allocates): no reconfiguring to tell.
        if (actions or slice_actions) and node is not None and not dra_node:
            by_gpu: dict[int, list[str]] = {}
            for a in actions:
                by_gpu.setdefault(a.gpu, []).append(f"{a.op.value} {a.profile}@{a.start}")
            for sa in slice_actions:
                by_gpu.setdefault(sa.gpu, []).append(
                    f"{sa.op.value} MPS slice {sa.slice} ({sa.memory_gb} GB)"
                )
            what = "; ".join(f"GPU {g}: {', '.join(ops)}" for g, ops in sorted(by_gpu.items()))
            self._tell(kubeobjects.EventNote(
                "Node", None, name, node.uid, "Normal", "MigReconfiguring",
                f"plan {self.plans} for {len(placements)} pod(s): {what}",
            ))  # fmt: skip
        for p in placements:
            entry = self._store.pods.get(p.pod)
            if entry is None:
                continue
            where = ", ".join(
                [f"{a.profile} at GPU {a.gpu} start {a.start}" for a in p.instances]
                + [
                    f"MPS slice {sh.slice} ({sh.memory_gb} GB) of GPU {sh.gpu}"
                    if sh.slice is not None
                    else f"a replica of GPU {sh.gpu}"
                    for sh in p.shares
                ]
                + [f"whole GPU {g} (MIG off)" for g in p.gpus]
            )
            if p.pod in steered or dra_node:
                continue  # said as it is pinned, below (an ungated one: kube-scheduler's to say)
            await self._say(
                entry[1], type_="Normal", reason="MigInstancesReserved",
                message=f"reserved on node {name}: {where}; waiting for the instances",
            )  # fmt: skip
        if node is None:
            return
        by_pod = {p.pod: p for p in placements}
        first_fit = (
            {s.pod: s for s in check.first_fit} if check is not None and not check.steer else {}
        )
        for key in steered:
            entry = self._store.pods.get(key)
            if entry is None or not entry[1].gated_by_us:
                continue
            served = first_fit.get(key)
            if served is not None and check is not None:
                await self._say(
                    entry[1], type_="Normal", reason="MigDraFirstFit",
                    message=f"kube-scheduler's first fit serves it on node {name} "
                    f"({', '.join(served.devices)}): the plan serves no more of the waiting pods "
                    f"now ({check.planned} against {len(check.first_fit)}) and keeps no "
                    "placement first fit would lose, so the round is not steered; pinned there "
                    "and let go",
                )  # fmt: skip
                await self._pin_one(key, node)
                continue
            planned_at = (
                ", ".join(
                    f"{a.profile} at GPU {a.gpu} start {a.start}" for a in by_pod[key].instances
                )
                if key in by_pod
                else "its placements"
            )
            why = ""
            if check is not None and check.for_room:
                kept = ", ".join(f"{p} ({m})" for m, p in sorted(check.kept))
                why = (
                    f"; first fit would serve as many now ({check.planned}) but leave no "
                    f"{kept} placeable"
                )
            await self._say(
                entry[1], type_="Normal", reason="MigDraPlanned",
                message=f"planned on node {name}: {planned_at}; pinned there and let go for "
                "kube-scheduler to allocate its claims (the planned placements are listed "
                f"first){why}",
            )  # fmt: skip
            await self._pin_one(key, node)

    async def _judge(self, judged: Sequence[control.Judged]) -> None:
        """Each pod the plan left: let go to a static node, refused, or told why it waits."""
        jobs = []
        for j in judged:
            entry = self._store.pods.get(j.pod)
            if entry is None:
                continue
            doc, view = entry
            if j.verdict is control.Verdict.LET_GO:
                jobs.append(self._let_go(j.pod, doc, view, j.reason))
            elif j.verdict is control.Verdict.REFUSE:
                jobs.append(self._refuse(j.pod, j.reason))
            elif j.verdict is control.Verdict.SCALE_OUT:
                jobs.append(self._scale_out(j.pod, doc, view, j.reason))
            elif j.verdict is control.Verdict.ELSEWHERE:
                jobs.append(self._elsewhere(j.pod, doc, view, j.reason))
            else:
                jobs.append(self._say(view, type_="Normal", reason="MigWaiting", message=j.reason))
        await asyncio.gather(*jobs)

    async def _scale_out(
        self, key: str, doc: Mapping[str, Any], view: observing.PodView, why: str
    ) -> None:
        """A pod no node can hold now, let go unpinned for a node autoscaler; if it was let go
        since the step read it, nothing is written."""
        if not view.gated_by_us:
            return
        self.metrics.scaled_out.inc()
        _log.info("pod %s let go for a node autoscaler: %s", key, why, extra=logs.about(pod=key))
        await self._say(view, type_="Normal", reason="MigScaleOut", message=why)
        await self._patch_pod(key, pinning.ungate_patch(doc))

    async def _elsewhere(
        self, key: str, doc: Mapping[str, Any], view: observing.PodView, why: str
    ) -> None:
        """A gated whole-GPU pod left to kube-scheduler, unpinned (``docs/migmode.md``); if it
        was let go since the step read it, nothing is written."""
        if not view.gated_by_us:
            return
        _log.info("whole-GPU pod %s let go: %s", key, why, extra=logs.about(pod=key))
        await self._say(view, type_="Normal", reason="MigWholeGpuElsewhere", message=why)
        await self._patch_pod(key, pinning.ungate_patch(doc))

    async def _let_go(
        self, key: str, doc: Mapping[str, Any], view: observing.PodView, why: str
    ) -> None:
        await self._say(view, type_="Normal", reason="MigStaticLayout", message=why)
        await self._patch_pod(key, pinning.ungate_patch(doc))


def new_waits(
    waits: Sequence[control.Waiting], said: Mapping[str, str]
) -> tuple[frozenset[control.Waiting], dict[str, str]]:
    """Which of this step's ``waits`` are news (a pod not waiting at the last step, or waiting
    for something else now), given ``said`` (pod -> what it was last said to wait for); and
    what is said once they are told. A reserved pod that keeps waiting is logged at INFO once
    per reason, so a long wait can be explained from the log (every pass repeats it at DEBUG);
    a pod no longer waiting is forgotten."""
    fresh = frozenset(w for w in waits if said.get(w.pod) != w.why)
    return fresh, {w.pod: w.why for w in waits}


def _describe_node(node: snapshot.Node) -> str:
    return "; ".join(
        f"{g.index}: "
        + " ".join(f"{i.profile}@{i.start}{'*' if i.used else ''}" for i in g.instances)
        for g in node.gpus
    )


def _describe_spec(spec: gpulayouts.LayoutSpec) -> str:
    return "; ".join(
        f"{g.index}: "
        + " ".join(
            f"{i.profile}@{i.start}" + (f">{i.reserved_for}" if i.reserved_for else "")
            for i in g.instances
        )
        for g in spec.gpus
    )


def _version(doc: Mapping[str, Any]) -> int | None:
    """``metadata.resourceVersion`` as a number (etcd's revision), or ``None``."""
    text = (doc.get("metadata") or {}).get("resourceVersion")
    try:
        return int(text) if text is not None else None
    except (TypeError, ValueError):
        return None


def _epoch(timestamp: str) -> float | None:
    """An RFC 3339 time from the API (``2026-01-01T00:00:00Z``) in seconds since the epoch;
    ``None`` when absent or unreadable."""
    try:
        moment = datetime.datetime.fromisoformat(timestamp)
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _about(kind: kubeobjects.Kind, key: str) -> dict[str, str]:
    """The ``extra`` of a log line on an object: its pod or its node (a GpuLayout is named
    after its node)."""
    return {"pod": key} if kind is kubeobjects.Kind.PODS else {"node": key}


def _note_about(note: kubeobjects.EventNote) -> dict[str, str]:
    """The ``extra`` of a log line on an Event: the pod it is on, or the node (a Node's or a
    GpuLayout's, which is named after its node)."""
    where = f"{note.namespace}/{note.name}" if note.namespace else note.name
    return logs.about(pod=where) if note.kind == "Pod" else logs.about(node=where)


def _meta_of(key: str) -> dict[str, str]:
    if "/" in key:
        ns, name = key.split("/", 1)
        return {"namespace": ns, "name": name}
    return {"name": key}


def _plan_fast(snap: snapshot.Snapshot) -> plans.Plan:
    with gcpause.paused():
        return fast.plan(snap, options.Options())


def _plan_timed(seconds: list[float], snap: snapshot.Snapshot) -> plans.Plan:
    """:func:`_plan_fast`, its time added to ``seconds`` (the loop's plan-time histogram)."""
    started = time.perf_counter()
    plan = _plan_fast(snap)
    seconds.append(time.perf_counter() - started)
    return plan


async def _sleep(seconds: float, stop: asyncio.Event) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
