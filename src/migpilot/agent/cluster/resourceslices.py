"""Publish the node's DRA devices as ResourceSlices after every pass of the agent (DRA mode).

Why it exists: on a node labelled ``migpilot.io/mode=dra`` kube-scheduler allocates MIG
placements from the ResourceSlices of driver ``mig.migpilot.io`` (``docs/dra.md``,
"Publishing"). :class:`SlicePublisher` hears every pass (a
:class:`~migpilot.agent.running.PassListener`), turns what the GPUs hold and who uses it into the
node's pool (:func:`migpilot.agent.dra.publishing.pool`), lists the slices the API server holds
and sends only the writes :func:`~migpilot.agent.dra.publishing.reconcile` finds: none when
nothing changed; one update when one slice changed; else every slice at the next pool
generation, then the deletes of slices the pool no longer has. Listing at each pass also puts
back slices someone else deleted (a kubelet wipes a driver's slices while its plugin is not
registered).

Steering (``docs/dra.md``, "Steering kube-scheduler"): with :meth:`SlicePublisher.steer_from`,
the planner's placements for the node (its GpuLayout's spec) are listed first while the
controller's Lease is fresh (:func:`controller_lease`, the webhook's rule); stale, unreadable
or unparseable, nothing is listed first. In-place updates are sent in the order
:func:`~migpilot.agent.dra.publishing.reconcile` gives, a slice written twice with the version
its first write returned.

Who uses an instance: the agent's in-use sources (the kubelet, processes, the GpuLayout's
protection) say which devices are used; the DRA plugin's record (``claimed``: MIG device UUID
-> claim UID) says which of those are a DRA claim's. Anything used and not a claim's, an
instance without a MIG device, and everything when the in-use sources cannot be read, is
someone else's and is never offered (fail closed).

A shell module: the API through :class:`~sliceapi.SliceApi`; imports no Kubernetes client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from migpilot import errors, logs
from migpilot.agent.cluster import sliceapi
from migpilot.agent.deviceplugin import devices
from migpilot.agent.dra import placements, publishing
from migpilot.agent.rules import changes
from migpilot.kube import errors as kube_errors
from migpilot.kube import leasereader

_log = logging.getLogger(__name__)

LEASE_CACHE_S = 2.0
"""Seconds a read of the controller's Lease is reused (the webhook's default)."""


def inputs(
    state: Mapping[int, changes.GpuState],
    *,
    view: devices.NodeDevices,
    used: frozenset[str] | None,
    claimed: Mapping[str, str],
) -> tuple[tuple[publishing.Gpu, ...], tuple[publishing.Instance, ...]]:
    """The GPUs and instances to publish: the GPUs of ``state`` the catalog knows and the pass
    advertises (``view``: a GPU whose MIG mode is being switched is left out), with who uses
    each instance (``used``: the UUIDs in use, ``None`` when unknown; ``claimed``: UUID ->
    DRA claim)."""
    shown = {g.index for g in view.gpus}
    gpus: list[publishing.Gpu] = []
    instances: list[publishing.Instance] = []
    for index in sorted(state):
        info = state[index].info
        if info.model is None or index not in shown:
            continue
        mig = info.mig is not None and info.mig.current
        gpus.append(
            publishing.Gpu(
                index=index,
                uuid=info.uuid,
                model=info.model,
                mig=mig,
                memory_mib=info.memory_mib,
                use=publishing.Use.FREE if mig else _use(info.uuid, used, claimed),
            )
        )
        if not mig:
            continue
        for dev in state[index].devices:
            instances.append(
                publishing.Instance(
                    gpu=index,
                    profile=dev.profile,
                    start=dev.start,
                    uuid=dev.uuid,
                    use=_use(dev.uuid, used, claimed),
                )
            )
    return tuple(gpus), tuple(instances)


def _use(
    uuid: str | None, used: frozenset[str] | None, claimed: Mapping[str, str]
) -> publishing.Use:
    if uuid is None or used is None:
        return publishing.Use.OTHER  # not a MIG device yet, or nobody can say: never offered
    if uuid in claimed:
        return publishing.Use.CLAIM
    return publishing.Use.OTHER if uuid in used else publishing.Use.FREE


def _nobody() -> Mapping[str, str]:
    return {}


def _no_plan() -> tuple[placements.Placement, ...]:
    return ()


def _never() -> bool:
    return False


def controller_lease(
    read: Callable[[], Mapping[str, Any] | None],
    *,
    cache_s: float = LEASE_CACHE_S,
    clock: Callable[[], float] = time.time,
) -> leasereader.LeaseReader:
    """Whether the controller holds its Lease fresh now, as the webhook judges it
    (``docs/webhook.md``, "The Lease rule"): the shells' one Lease reader
    (:class:`~migpilot.kube.leasereader.LeaseReader`), ``read`` at most every ``cache_s``
    seconds. A Lease not there is not fresh at once; a failed read keeps the last one read,
    judged by its renew time (with none read yet: not fresh)."""
    return leasereader.LeaseReader(
        read, cache_s=cache_s, clock=clock, what="the controller's Lease (DRA steering)"
    )


class SlicePublisher:
    """Keeps the node's ResourceSlices what its GPUs hold (see the module). Thread-safe: passes
    are serialised by a lock."""

    def __init__(
        self,
        api: sliceapi.SliceApi,
        *,
        node: str,
        in_use: Callable[[], frozenset[str]] | None = None,
        claimed: Callable[[], Mapping[str, str]] = _nobody,
    ) -> None:
        self._api = api
        self._node = node
        self._in_use = in_use
        """The UUIDs in use; ``None`` until :meth:`use_from` names it: nothing used is offered."""
        self._claimed = claimed
        self._planned: Callable[[], tuple[placements.Placement, ...]] = _no_plan
        self._fresh: Callable[[], bool] = _never
        self._steering = False
        self._listed = False
        self._lock = threading.Lock()
        self._published = False
        self._generation = -1
        """The newest pool generation written (-1: none): the next one is above it."""

    def claims_from(self, claimed: Callable[[], Mapping[str, str]]) -> None:
        """Read which MIG devices claims own (UUID -> claim UID) from ``claimed`` from now on
        (the kubelet plugin's ledger): a device a claim owns is offered, as kube-scheduler
        knows the claim; any other used device is not."""
        self._claimed = claimed

    def steer_from(
        self, planned: Callable[[], tuple[placements.Placement, ...]], *, fresh: Callable[[], bool]
    ) -> None:
        """List the free ``planned`` placements first from now on (the planner's target for the
        node, from its GpuLayout's spec), while ``fresh`` says the controller's Lease is fresh;
        when it is not, nothing is listed first (``docs/dra.md``, "Steering kube-scheduler")."""
        self._planned = planned
        self._fresh = fresh

    def use_from(self, in_use: Callable[[], frozenset[str]]) -> None:
        """Read the devices in use from ``in_use`` from now on (the agent's wired sources)."""
        self._in_use = in_use

    @property
    def published(self) -> bool:
        """Whether the last publish left the API server holding the pool."""
        with self._lock:
            return self._published

    @property
    def generation(self) -> int | None:
        """The pool's generation as last published (``None``: not yet)."""
        with self._lock:
            return self._generation if self._generation >= 0 else None

    def advertised(self) -> Mapping[str, int] | None:
        """For the startup taint: nothing to see in the Node once the pool is published
        (``{}``), ``None`` before."""
        return {} if self.published else None

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Publish what the pass left on the GPUs."""
        del report, labels
        used: frozenset[str] | None = None
        try:
            if self._in_use is not None:
                used = self._in_use()
        except Exception as err:  # fail closed: offer nothing that may be used
            _log.warning("DRA: devices in use unknown (%s): nothing in use is offered", err,
                         extra=logs.about(node=self._node))  # fmt: skip
            used = None
        gpus, instances = inputs(state, view=view, used=used, claimed=self._claimed())
        planned = self._target()
        writes = self.publish(gpus, instances, planned=planned)
        with self._lock:
            self._listed = self._steering and writes is not None

    def plan_listed(self) -> bool:
        """Whether the last pass published the pool with the plan's free placements listed
        first (the controller's Lease fresh to this agent, the plan read, the slices written):
        what the GpuLayout status's ``PlanListed`` condition reports, and the controller waits
        for before it lets a steered pod go (``controller/pinning.listed``)."""
        with self._lock:
            return self._listed

    def _target(self) -> tuple[placements.Placement, ...]:
        """The placements to list first: the plan while the controller's Lease is fresh."""
        try:
            steering = self._fresh()
            planned = tuple(self._planned()) if steering else ()
        except Exception as err:  # a plan that cannot be read: publish plainly
            _log.warning("DRA: the plan cannot be read (%s): nothing is listed first", err,
                         extra=logs.about(node=self._node))  # fmt: skip
            steering, planned = False, ()
        if steering != self._steering:
            _log.info("DRA: the controller's Lease is %s: %s", *(
                ("fresh", "its plan is listed first") if steering
                else ("stale or unreadable", "nothing is listed first")),
                extra=logs.about(node=self._node))  # fmt: skip
            self._steering = steering
        return planned

    def publish(
        self,
        gpus: tuple[publishing.Gpu, ...],
        instances: tuple[publishing.Instance, ...],
        *,
        planned: tuple[placements.Placement, ...] = (),
    ) -> publishing.Writes | None:
        """Make the API server hold the pool of ``gpus`` and ``instances``, the free ``planned``
        placements listed first: the writes sent, ``None`` when the pool could not be made or
        written (logged; the next pass tries again)."""
        with self._lock:
            try:
                writes = self._write(gpus, instances, planned)
            except errors.MigpilotError as err:
                _log.error("DRA: the node's devices cannot be published: %s", err,
                           extra=logs.about(node=self._node))  # fmt: skip
                self._published = False
                return None
            except kube_errors.KubeApiError as err:
                _log.error("DRA: ResourceSlices not published: %s", err,
                           extra=logs.about(node=self._node))  # fmt: skip
                self._published = False
                return None
            self._published = True
            self._generation = max(writes.generation, self._generation)
            return writes

    def _write(
        self,
        gpus: tuple[publishing.Gpu, ...],
        instances: tuple[publishing.Instance, ...],
        planned: tuple[placements.Placement, ...],
    ) -> publishing.Writes:
        publishing.pool(self._node, gpus, instances)  # bad input fails before any request
        listed = self._api.list_slices(driver=publishing.DRIVER, node=self._node)
        pool = publishing.pool(
            self._node,
            gpus,
            instances,
            planned=planned,
            listed_first=publishing.listed_first(self._node, listed.items),
        )
        writes = publishing.reconcile(pool, listed.items, newer_than=self._generation)
        if writes.nothing:
            return writes
        # In the order given: in place, devices leave a slice before they join another; at a
        # new generation, its slices first, then the deletes (kube-scheduler allocates nothing
        # from the pool until all its slices of the newest generation are there).
        versions: dict[str, str] = {}
        for body in writes.update:
            name = body["metadata"]["name"]
            if name in versions:  # written a moment ago: the version that write returned
                body = {**body, "metadata": {**body["metadata"], "resourceVersion": versions[name]}}
            stored = self._api.replace_slice(body)
            version = (stored.get("metadata") or {}).get("resourceVersion")
            if isinstance(version, str):
                versions[name] = version
        for body in writes.create:
            self._api.create_slice(body)
        for name in writes.delete:
            self._api.delete_slice(name)
        _log.info(
            "DRA: published %d ResourceSlices at generation %d (%d created, %d updates, "
            "%d deleted; %d devices listed first)",
            len(pool.contents),
            writes.generation,
            len(writes.create),
            len(writes.update),
            len(writes.delete),
            len(publishing.listed_first(self._node, pool.documents(writes.generation))),
            extra=logs.about(node=self._node),
        )
        return writes
