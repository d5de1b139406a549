"""The agent in a cluster: follow the node's GpuLayout, report its status and the Node's labels.

:class:`GpuLayoutSource` is the desired-layout source of a node whose layout a controller
plans. A thread (:meth:`GpuLayoutSource.follow`) lists the GpuLayout named after the node and
watches it, listing again on 410 Gone and after any other failure; the agent's loop sees a new
:meth:`~GpuLayoutSource.fingerprint` when the spec's generation changes or the last status
reports other instances as untouchable, and reconciles. A spec that cannot be applied (a GPU
the node lacks, a layout the GPU cannot hold) is logged and reported, and the last good spec is
kept; no GpuLayout at all keeps the instances there are. The source is also an in-use source:
instances the GpuLayout reserves, or last reported used or reserved, are never destroyed even
if the spec no longer lists them (:func:`desired.protected`).

:class:`KubeReporter` runs after every pass: it applies the GpuLayout's status
(:func:`reporting.layout_status`) when it changed, and sets the GFD labels on the Node. On a
static node (:class:`StaticLayouts`) the status reports no spec and the config's problem.

A shell module: it talks to the API only through :class:`~kubeapi.NodeApi` and never imports a
Kubernetes client.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

from migpilot import errors, logs, probes
from migpilot.agent import reconciling
from migpilot.agent.cluster import kubeapi, reporting, watching
from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import changes, desired
from migpilot.agent.sharing import slicing, timeslicing
from migpilot.api import gpulayouts, gpulayouts_wire
from migpilot.gpu import backend
from migpilot.kube import errors as kube_errors
from migpilot.kube import objects
from migpilot.sharing import config as sharing_config

_log = logging.getLogger(__name__)

RETRY_S = 2.0
"""Seconds to wait before listing again after the API server failed."""


class GpuLayoutSource:
    """Desired layouts from the node's GpuLayout, followed by a watch (see the module)."""

    def __init__(self, api: kubeapi.NodeApi, *, node: str) -> None:
        self._api = api
        self.node = node
        self._lock = threading.Lock()
        self._doc: Mapping[str, Any] | None = None
        self._listed = False
        self._good: gpulayouts.GpuLayout | None = None
        """The last GpuLayout whose spec could be applied."""
        self._problem: str | None = None
        self._protected: frozenset[str] = frozenset()
        self._dra = False

    def for_dra(self) -> None:
        """The node is in DRA mode from now on: the spec's instances are the planner's
        placements, left to the DRA plugin to make (:func:`desired.for_dra`: the agent makes
        none); :meth:`layout` still gives the whole spec (the publisher lists them first)."""
        self._dra = True

    def _acted_on(
        self,
        layout: gpulayouts.GpuLayout,
        current: Mapping[int, Sequence[backend.MigDevice]],
    ) -> gpulayouts.GpuLayout:
        """The GpuLayout as the agent acts on it (in DRA mode, the spec less what the DRA
        plugin makes)."""
        if not self._dra:
            return layout
        return dataclasses.replace(layout, spec=desired.for_dra(layout.spec, current=current))

    # -- following -----------------------------------------------------------------------------
    def sync(self) -> str:
        """List once: take the object as it is now; the version to watch from."""
        listed = self._api.list_layout(self.node)
        with self._lock:
            self._doc = listed.one()
            self._listed = True
        return listed.resource_version

    def take(self, doc: Mapping[str, Any] | None) -> None:
        """Take the GpuLayout as someone else's watch saw it (``None``: there is none); the
        fleet of simulated agents watches every GpuLayout once for all its nodes."""
        with self._lock:
            self._doc = doc
            self._listed = True

    def follow(self, stop: threading.Event, *, health: probes.Watches | None = None) -> None:
        """List and watch until ``stop`` is set (run it in a thread): :func:`watching.follow`,
        which never dies and marks the watch down in ``health`` while it fails."""

        watching.follow(
            what=f"GpuLayout {self.node}",
            lister=lambda: self._api.list_layout(self.node),
            watcher=lambda version: self._api.watch_layout(self.node, resource_version=version),
            listed=lambda docs: self.take(docs[0] if docs else None),
            changed=lambda e: self.take(None if e.type is objects.EventType.DELETED else e.object),
            stop=stop,
            retry_s=RETRY_S,
            health=health,
        )

    def layout(self) -> gpulayouts.GpuLayout | None:
        """The GpuLayout as last seen, parsed (``None``: absent or not parseable)."""
        with self._lock:
            doc = self._doc
        if doc is None:
            return None
        try:
            return gpulayouts_wire.parse(doc)
        except errors.GpuLayoutError:
            return None

    # -- DesiredSource -------------------------------------------------------------------------
    def fingerprint(self) -> Hashable:
        """Changes with the spec's generation and with the instances the status protects."""
        with self._lock:
            doc = self._doc
        if doc is None:
            return None
        meta = doc.get("metadata") or {}
        status = doc.get("status") or {}
        held = frozenset(
            str(i.get("uuid"))
            for g in status.get("gpus") or ()
            for i in g.get("instances") or ()
            if i.get("state") in {s.value for s in gpulayouts.UNTOUCHABLE}
        )
        return (meta.get("uid"), meta.get("generation"), held)

    def desired(
        self,
        *,
        gpus: Sequence[backend.GpuInfo],
        current: Mapping[int, Sequence[backend.MigDevice]],
        in_use: frozenset[str],
    ) -> dict[int, changes.DesiredGpu]:
        """The spec's layouts; the last good ones when the spec cannot be applied."""
        with self._lock:
            doc = self._doc
        if doc is None:
            self._problem = None
            self._protected = frozenset()
            return {}
        try:
            layout = self._acted_on(gpulayouts_wire.parse(doc), current)
            want = desired.from_gpulayout(layout.spec, gpus=gpus)
        except errors.MigpilotError as err:
            if str(err) != self._problem:
                _log.warning("GpuLayout %s cannot be applied, keeping the last good: %s",
                             self.node, err, extra=logs.about(node=self.node))  # fmt: skip
            self._problem = str(err)
            good = self._good
            if good is None:
                return {}
            self._protected = desired.protected(good, current=current)
            try:
                return desired.from_gpulayout(good.spec, gpus=gpus)
            except errors.MigpilotError:
                return {}
        self._good, self._problem = layout, None
        self._protected = desired.protected(layout, current=current)
        return want

    def in_use(self) -> frozenset[str]:
        """Instances the GpuLayout protects (as of the last :meth:`desired`)."""
        return self._protected

    def describe(self) -> str:
        """For the log."""
        return f"GpuLayout {self.node} ({gpulayouts.CRD_NAME})"

    # -- for the reporter ----------------------------------------------------------------------
    @property
    def acted_on(self) -> gpulayouts.GpuLayout | None:
        """The last good GpuLayout (the one the layouts came from)."""
        return self._good

    @property
    def problem(self) -> str | None:
        """Why the newest spec was not applied (``None``: it was)."""
        return self._problem

    @property
    def present(self) -> bool:
        """Whether the GpuLayout exists (as last seen)."""
        with self._lock:
            return self._doc is not None

    def keep_protecting(self, *, current: Mapping[int, Sequence[backend.MigDevice]]) -> None:
        """While the layouts come from elsewhere (a static node, ``agent/statics.py``): keep
        :meth:`in_use` current with what the GpuLayout protects, without applying its spec."""
        layout = self.layout()
        self._protected = (
            desired.protected(self._acted_on(layout, current), current=current)
            if layout is not None
            else frozenset()
        )


class StaticLayouts(Protocol):
    """A static node's layouts (``agent/statics.py``), as the reporter needs them."""

    @property
    def applied(self) -> str | None:
        """The mig-parted config the last pass applied (``None``: it followed the GpuLayout)."""
        ...

    @property
    def problem(self) -> str | None:
        """Why that config could not be applied (``None``: it was)."""
        ...


class KubeReporter:
    """After each pass: the GpuLayout's status and the Node's GFD labels, written when changed."""

    def __init__(
        self,
        api: kubeapi.NodeApi,
        *,
        source: GpuLayoutSource,
        in_use: reconciling.InUse,
        now: Callable[[], str],
        static: StaticLayouts | None = None,
        used_by: Callable[[], Mapping[str, str]] = dict,
        mps_node: Callable[[], bool] = lambda: False,
        sharing: Callable[[], sharing_config.Config] = lambda: sharing_config.EMPTY,
        dynamic_mig: Callable[[], bool] = lambda: False,
        plan_listed: Callable[[], bool] | None = None,
    ) -> None:
        self._api = api
        self._plan_listed = plan_listed
        """On a node in DRA mode: whether the pass listed the plan first in the node's
        ResourceSlices (the ``PlanListed`` condition); ``None`` elsewhere."""
        self._mps_node = mps_node
        self._dynamic_mig = dynamic_mig
        """Whether the Node is labelled ``migpilot.io/mig-mode=dynamic`` (every GPU reported,
        with its MIG mode)."""
        self._sharing = sharing
        self._source = source
        self._static = static
        self._used_by = used_by
        self._in_use = in_use
        self._now = now
        self._last_status: gpulayouts.LayoutStatus | None = None
        self._last_labels: dict[str, str] | None = None
        self._managed: frozenset[str] = frozenset()
        self._settled = True

    @property
    def settled(self) -> bool:
        """Whether the last pass wrote all it had to (no write failed): else the next pass,
        whenever it comes, retries."""
        return self._settled

    @property
    def reported(self) -> bool:
        """Whether the node is reported: a GpuLayout status written and the last pass's writes
        all made (the startup taint waits for it, :mod:`~migpilot.agent.cluster.startup`)."""
        return self._last_status is not None and self._settled

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Write what changed; API failures are logged and retried at the next pass."""
        self._settled = self._write_labels(labels)
        if not self._source.present:
            return
        good = self._source.acted_on
        spec, generation = (good.spec, good.generation) if good is not None else (None, None)
        problem, reason = self._source.problem, "InvalidSpec"
        if self._static is not None and self._static.applied is not None:
            # A static node: the layouts came from a mig-parted config, not from the spec.
            spec, generation = None, None
            problem, reason = self._static.problem, "InvalidConfig"
        try:
            in_use = self._in_use.in_use()
            owners = self._used_by()
            status = reporting.layout_status(
                state=state,
                in_use=in_use,
                spec=spec,
                generation=generation,
                report=report,
                problem=problem,
                problem_reason=reason,
                previous=self._last_status,
                used_by=owners,
                mps=slicing.statuses(view, spec=spec, in_use=in_use, used_by=owners),
                mps_problems=slicing.problems(view, spec),
                mps_node=self._mps_node(),
                dynamic_mig=self._dynamic_mig(),
                plan_listed=self._plan_listed() if self._plan_listed is not None else None,
                replicas=timeslicing.statuses(
                    view, sharing=self._sharing(), spec=spec, in_use=in_use, used_by=owners
                ),
                now=self._now(),
            )
        except errors.MigpilotError as err:
            _log.error("GpuLayout %s: status not computed: %s", self._source.node, err,
                       extra=logs.about(node=self._source.node))  # fmt: skip
            self._settled = False
            return
        if status == self._last_status:
            return
        try:
            self._api.apply_layout_status(self._source.node, status)
        except kube_errors.KubeApiError as err:
            _log.error("GpuLayout %s: status not written: %s", self._source.node, err,
                       extra=logs.about(node=self._source.node))  # fmt: skip
            self._settled = False
            return
        self._last_status = status
        _log.info(
            "GpuLayout %s: status written (%s)",
            self._source.node,
            status.conditions[0].reason,
            extra=logs.about(node=self._source.node),
        )

    def _write_labels(self, labels: Mapping[str, str]) -> bool:
        """Set the labels when they changed; whether they are set."""
        if dict(labels) == self._last_labels:
            return True
        patch: dict[str, str | None] = dict.fromkeys(self._managed - set(labels))
        patch.update(labels)
        try:
            self._api.patch_node_labels(self._source.node, patch)
        except kube_errors.KubeApiError as err:
            _log.error("Node %s: labels not written: %s", self._source.node, err,
                       extra=logs.about(node=self._source.node))  # fmt: skip
            return False
        self._last_labels = dict(labels)
        self._managed = frozenset(labels)
        return True
