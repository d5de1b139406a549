"""Close the kubelet's capacity gap: publish new MIG devices into the Node as soon as the kubelet
can hand them out, not at its next status sync.

Why it exists: the kubelet's device manager learns a plugin's new devices at once from
ListAndWatch, so its admission accepts pods using them, but it copies device-plugin capacity into
the Node object only in its periodic node-status sync (``nodeStatusUpdateFrequency``, 10 s by
default). kube-scheduler reads the Node, so until then a pod waiting for a new MIG instance
cannot be bound: most of a reconfiguration's latency. After each pass that changed what the
device plugin advertises (or a device's health changed between passes),
:class:`CapacityPublisher` asks the kubelet's PodResources
``GetAllocatableResources`` (every ``poll_s``, up to ``give_up_s``) until it lists every device
the plugin advertises, then writes the counts the kubelet lists for the ``nvidia.com/mig-*``
resources and ``nvidia.com/gpu`` (whole GPUs, and the MIG instances set aside for unified pods,
``docs/unified.md``) into the Node's ``status.capacity`` and ``status.allocatable`` (a merge
patch of those keys only). The kubelet later writes the same values itself.

It counts what the kubelet lists, never what the plugin sent, so the Node never promises a
device the kubelet would refuse. On a kubelet without ``GetAllocatableResources``
(``UNIMPLEMENTED``) or when the API fails it logs and does nothing: the kubelet's own sync
still comes. The waiting runs on a thread of its own, so a pass is never held up.

A shell module: the kubelet through :class:`AllocatableSource`, the API through
:class:`~kubeapi.NodeApi`; it imports neither gRPC nor a Kubernetes client.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from migpilot import logs
from migpilot.agent.cluster import kubeapi
from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import changes
from migpilot.kube import errors as kube_errors

_log = logging.getLogger(__name__)

MIG_PREFIX = f"{devices.RESOURCE_DOMAIN}/mig-"


def published(name: str) -> bool:
    """Whether the publisher writes resource ``name``: a MIG resource or ``nvidia.com/gpu``."""
    return name.startswith(MIG_PREFIX) or name == devices.FULL_GPU_RESOURCE


class AllocatableSource(Protocol):
    """The kubelet's view of the devices it can hand out."""

    def allocatable(self) -> Mapping[str, frozenset[str]]:
        """Device IDs per resource; raises on any failure."""
        ...


@dataclass(frozen=True, slots=True)
class CapacitySettings:
    """How the publisher waits for the kubelet."""

    poll_s: float = 0.05
    """Seconds between two asks of GetAllocatableResources. Default 0.05."""
    give_up_s: float = 5.0
    """Seconds after a change to stop waiting for the kubelet to list every new device and
    publish what it lists by then. Default 5."""
    recheck_s: float = 1.0
    """Seconds between two looks, between passes, at what the plugin advertises (a device an
    XID error made Unhealthy leaves the kubelet's list without a pass). Default 1."""


def counts(kubelet: Mapping[str, frozenset[str]]) -> dict[str, int]:
    """The resources the kubelet lists that are :func:`published`, counted."""
    return {name: len(ids) for name, ids in kubelet.items() if published(name)}


def caught_up(
    kubelet: Mapping[str, frozenset[str]], advertised: Mapping[str, frozenset[str]]
) -> bool:
    """Whether the kubelet lists exactly the healthy devices the plugin advertises (of the
    :func:`published` resources)."""
    want = {k: v for k, v in advertised.items() if published(k) and v}
    have = {k: v for k, v in kubelet.items() if published(k) and v}
    return want == have


def patch_for(
    new: Mapping[str, int], published: Mapping[str, int] | None
) -> dict[str, str | None] | None:
    """The Node resources patch taking ``published`` to ``new`` (a resource no longer listed
    goes to ``0``, as the kubelet keeps a registered resource), or ``None`` if nothing
    changed."""
    before = dict(published or {})
    after = {**dict.fromkeys(before, 0), **new}
    if after == before:
        return None
    return {k: str(v) for k, v in sorted(after.items())}


class CapacityPublisher:
    """A pass listener (see the module): wakes its thread when the plugin's devices changed."""

    def __init__(
        self,
        api: kubeapi.NodeApi,
        *,
        node: str,
        kubelet: AllocatableSource,
        advertised: Callable[[], Mapping[str, frozenset[str]]],
        settings: CapacitySettings = CapacitySettings(),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._node = node
        self._kubelet = kubelet
        self._advertised = advertised
        self.settings = settings
        self._monotonic = monotonic
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._published: dict[str, int] | None = None
        self._last_seen: dict[str, frozenset[str]] | None = None
        self._checking = threading.Lock()
        """``check`` runs on the agent's thread and on the publisher's."""
        self._unavailable: str | None = None
        self._thread = threading.Thread(target=self._run, name="migpilot-capacity", daemon=True)
        self._thread.start()
        _log.info(
            "Node %s: new MIG device counts are published as soon as the kubelet lists them "
            "(asked every %g s for up to %g s)",
            node,
            settings.poll_s,
            settings.give_up_s,
            extra=logs.about(node=node),
        )

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """After a pass: wake the thread if the advertised devices changed."""
        self.check()

    def check(self) -> None:
        """Wake the thread if the advertised devices changed since the last check (also after
        the plugin starts serving: the first pass runs before it does; and every
        ``recheck_s``, for health changes between passes)."""
        now = dict(self._advertised())
        with self._checking:
            if now == self._last_seen:
                return
            self._last_seen = now
        self._wake.set()

    def close(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            woken = self._wake.wait(self.settings.recheck_s)
            if self._stop.is_set():
                return
            try:
                if not woken:
                    if self._last_seen is not None:  # once the agent has checked: it serves
                        self.check()  # a health change between passes wakes it
                    continue
                self._wake.clear()
                self.publish_once()
            except Exception:  # the kubelet's own sync still comes: never let the thread die
                _log.exception(
                    "Node %s: publishing device capacity failed",
                    self._node,
                    extra=logs.about(node=self._node),
                )

    def publish_once(self) -> bool:
        """Wait (bounded) for the kubelet to list what the plugin advertises, then publish
        its counts; ``True`` when the Node was patched."""
        deadline = self._monotonic() + self.settings.give_up_s
        listed: Mapping[str, frozenset[str]] = {}
        while True:
            try:
                listed = self._kubelet.allocatable()
            except Exception as err:
                if str(err) != self._unavailable:
                    _log.warning("kubelet allocatable devices unavailable, leaving the Node "
                                 "to the kubelet's own sync: %s", err,
                                 extra=logs.about(node=self._node))  # fmt: skip
                    self._unavailable = str(err)
                return False
            self._unavailable = None
            if caught_up(listed, self._advertised()) or self._monotonic() >= deadline:
                break
            if self._stop.wait(self.settings.poll_s):
                return False
        patch = patch_for(counts(listed), self._published)
        if patch is None:
            return False
        try:
            self._api.patch_node_resources(self._node, patch)
        except kube_errors.KubeApiError as err:
            _log.error("Node %s: device capacity not published: %s", self._node, err,
                       extra=logs.about(node=self._node))  # fmt: skip
            return False
        self._published = {k: int(v) for k, v in patch.items() if v is not None}
        _log.info(
            "Node %s: published %s as the kubelet lists them",
            self._node,
            ", ".join(f"{k}={v}" for k, v in patch.items()),
            extra=logs.about(node=self._node),
        )
        return True
