"""The MPS slices the node serves, from its GpuLayout spec and what pods hold, and their status.

Why it exists: on a node in mode ``mps`` the controller writes each GPU's MPS slices into the
GpuLayout spec (``spec.gpus[i].mps``, ``docs/gpulayout.md``); the agent serves them through the
device plugin (:mod:`~migpilot.agent.deviceplugin.slices`) and reports each one in the status.
The rules, pure (:func:`served`, :func:`problems`, :func:`statuses`):

* a GPU serves the spec's slices only while its MIG mode is disabled; on a MIG-enabled GPU
  nothing is served and the status condition and the log say why (the agent never changes a
  MIG mode for slices);
* a slice a pod holds (the kubelet's PodResources, the plugin's Allocate ledger, the simulated
  kubelet) is never taken away: dropped from the spec, it stays served with the size it had
  (kept from the last pass, or from the status after a restart) and is reported ``used``;
  resized in the spec while held, it keeps its size until its pod is gone;
* a slice is ``used`` while held (``usedBy`` names the pod when known), ``reserved`` when the spec
  keeps it for a pod and none holds it, else ``free``.

:class:`SliceFilter` is the agent's view filter (:class:`~migpilot.agent.running.ViewFilter`)
that puts the slices into the device view each pass. A shell module only in that it keeps the
last pass's slices; it does no I/O and imports no client.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from migpilot.agent.deviceplugin import devices
from migpilot.api import gpulayouts

_log = logging.getLogger(__name__)

_S = gpulayouts.InstanceState


def known_from_status(layout: gpulayouts.GpuLayout | None) -> dict[str, devices.MpsSlice]:
    """The slices the GpuLayout's status last reported, by device ID (what a restarted agent
    knows of slices the spec may have dropped)."""
    if layout is None or layout.status is None:
        return {}
    return {
        devices.slice_device_id(g.uuid, sl.id): devices.MpsSlice(
            g.index, sl.id, sl.memory_gb, sl.cores
        )
        for g in layout.status.gpus
        for sl in g.mps
    }


def problems(view: devices.NodeDevices, spec: gpulayouts.LayoutSpec | None) -> tuple[str, ...]:
    """Why some GPU the spec slices serves no slices: it is not on the node, or its MIG mode is
    enabled."""
    out: list[str] = []
    present = {g.index: g for g in view.gpus}
    for g in spec.gpus if spec is not None else ():
        if not g.mps:
            continue
        gpu = present.get(g.index)
        if gpu is None:
            out.append(f"GPU {g.index}: the spec lists MPS slices but the node has no such GPU")
        elif gpu.mig_enabled:
            out.append(
                f"GPU {g.index}: the spec lists MPS slices but its MIG mode is enabled; no "
                "slice is served (migpilot does not change the MIG mode: disable MIG on it)"
            )
    return tuple(out)


def served(
    view: devices.NodeDevices,
    *,
    spec: gpulayouts.LayoutSpec | None,
    held: Iterable[str],
    known: Mapping[str, devices.MpsSlice],
) -> tuple[devices.MpsSlice, ...]:
    """The slices to serve: the spec's, on GPUs of the view with MIG disabled, and every slice
    in ``held`` (device IDs) that ``known`` (the last pass's, the status's) describes, with the
    size it had; sorted by GPU and id."""
    held_ids = frozenset(i for i in held if devices.is_slice_id(i))
    gpus = {g.index: g for g in view.gpus if not g.mig_enabled}
    out: dict[tuple[int, int], devices.MpsSlice] = {}
    for g in spec.gpus if spec is not None else ():
        gpu = gpus.get(g.index)
        if gpu is None:
            continue
        for sl in g.mps:
            device_id = devices.slice_device_id(gpu.uuid, sl.id)
            had = known.get(device_id)
            if device_id in held_ids and had is not None and had.gpu_index == g.index:
                out[(g.index, sl.id)] = had  # a held slice keeps its size
            else:
                out[(g.index, sl.id)] = devices.MpsSlice(g.index, sl.id, sl.memory_gb, sl.cores)
    by_uuid = {g.uuid: g for g in gpus.values()}
    for device_id in sorted(held_ids):
        parsed = devices.parse_slice_id(device_id)
        had = known.get(device_id)
        if parsed is None or had is None:
            continue
        gpu = by_uuid.get(parsed[0])
        if gpu is None or (gpu.index, parsed[1]) in out:
            continue
        out[(gpu.index, parsed[1])] = dataclasses.replace(had, gpu_index=gpu.index)
    return tuple(out[k] for k in sorted(out))


def statuses(
    view: devices.NodeDevices,
    *,
    spec: gpulayouts.LayoutSpec | None,
    in_use: frozenset[str],
    used_by: Mapping[str, str],
) -> dict[int, tuple[gpulayouts.SliceStatus, ...]]:
    """GPU index -> the status of each slice served on it, by id (see the module)."""
    reserved = {
        (g.index, sl.id): sl.reserved_for
        for g in (spec.gpus if spec is not None else ())
        for sl in g.mps
        if sl.reserved_for is not None
    }
    out: dict[int, list[gpulayouts.SliceStatus]] = {}
    for gpu in view.gpus:
        for sl in view.slices_on(gpu.index):
            device_id = devices.slice_device_id(gpu.uuid, sl.id)
            owner = None
            if device_id in in_use:
                state, owner = _S.USED, used_by.get(device_id)
            elif (gpu.index, sl.id) in reserved:
                state = _S.RESERVED
            else:
                state = _S.FREE
            out.setdefault(gpu.index, []).append(
                gpulayouts.SliceStatus(sl.id, sl.memory_gb, sl.cores, state, owner)
            )
    return {index: tuple(found) for index, found in out.items()}


class SliceFilter:
    """The agent's view filter that serves the GpuLayout's MPS slices (see the module).

    ``spec`` is the spec the agent acts on, ``held`` the slice IDs pods hold now (the in-use
    source), ``layout`` the GpuLayout as last seen (its status describes held slices after a
    restart). Thread-safe.
    """

    def __init__(
        self,
        *,
        spec: Callable[[], gpulayouts.LayoutSpec | None],
        held: Callable[[], frozenset[str]] = frozenset,
        layout: Callable[[], gpulayouts.GpuLayout | None] = lambda: None,
    ) -> None:
        self._spec = spec
        self._held = held
        self._layout = layout
        self._lock = threading.Lock()
        self._known: dict[str, devices.MpsSlice] = {}
        self._logged: tuple[str, ...] = ()

    def hold_from(self, held: Callable[[], frozenset[str]]) -> None:
        """Read the slices pods hold from ``held`` (the agent's in-use source, built after the
        filter)."""
        self._held = held

    def update(self, view: devices.NodeDevices) -> devices.NodeDevices:
        """``view`` with the slices to serve now."""
        spec = self._spec()
        found = problems(view, spec)
        with self._lock:
            if found != self._logged:
                for text in found:
                    _log.warning("MPS slices: %s", text)
                self._logged = found
            known = {**known_from_status(self._layout()), **self._known}
            held = self._held() if known else frozenset()
            now = served(view, spec=spec, held=held, known=known)
            out = dataclasses.replace(view, mps_slices=now)
            self._known = out.slice_device_ids()
        return out

    def served_ids(self) -> frozenset[str]:
        """The device IDs of the slices served after the last :meth:`update` (what a source
        that cannot be asked must say is in use)."""
        with self._lock:
            return frozenset(self._known)
