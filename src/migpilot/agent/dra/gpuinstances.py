"""The kubelet plugin's :class:`~preparing.Instances` over the agent's MIG backend, with its
ledger file.

Why it exists: preparing a claim creates the GPU instance and its compute instance at exactly
the placement kube-scheduler allocated (the backend's ``create_instance`` at a start slot:
``nvmlDeviceCreateGpuInstanceWithPlacement`` under NVML, the same placement rules emulated),
and unpreparing destroys it. Which claim owns which instance is kept in a ledger file
(:mod:`ownership`), replaced atomically after every change and reconciled with the instances
that exist when the plugin starts, so a restarted agent prepares a claim again to the same
instance and creates nothing.

Safety:

* a placement is refused when another claim's instance (or one held since the ledger was lost)
  is in its way; a free instance no claim owns (one the reconciler or a person made) is offered
  by the publisher like any placement, so a claim allocated exactly it adopts it, and one
  allocated an overlapping placement has it destroyed first; an instance no claim owns that is
  in use or not complete is never taken over (the prepare fails, the kubelet retries);
* before an instance is destroyed, the agent's other in-use sources (the processes running on
  it, the kubelet's PodResources) are asked, as the reconciler asks right before a destroy; an
  instance in use stays, with its owner, and the release fails for the kubelet to retry;
* :meth:`BackendInstances.in_use` is every UUID the ledger holds: the reconciler counts them as
  used, so a claim's instance is never destroyed as "not in the desired layout", and a GPU a
  claim holds whole never has its MIG mode switched. A create and its ledger entry happen under
  the lock :meth:`~BackendInstances.in_use` takes, so the reconciler never sees an instance the
  ledger does not hold yet;
* a ledger that cannot be parsed is kept aside (``<file>.corrupt``), logged, and replaced by
  :func:`ownership.recovered`: every MIG instance held, none destroyed.

A shell: file I/O and a lock; the decisions are :mod:`ownership`'s.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from migpilot import errors, files
from migpilot.agent import reconciling
from migpilot.agent.dra import ownership, placements, preparing
from migpilot.agent.rules import changes
from migpilot.gpu import backend
from migpilot.mig import layouts

_log = logging.getLogger(__name__)


class BackendInstances:
    """Claims' MIG instances and whole GPUs on the node's backend; thread-safe."""

    def __init__(
        self, gpus: backend.GpuBackend, *, ledger_file: Path | None, in_use: reconciling.InUse
    ) -> None:
        """Read the ledger (recovering from a corrupt one), reconcile it with the node's
        instances and write it back. ``in_use``: what else uses MIG devices (never this
        object's own :meth:`in_use`), asked before each destroy. ``ledger_file`` ``None``: the
        ledger is kept in memory only (the KWOK fleet, whose emulated GPUs are not durable
        either)."""
        self._backend = gpus
        self._path = ledger_file
        self._used = in_use
        self._lock = threading.Lock()
        self.recovered_from = ""
        """Why the ledger file could not be read, when it was replaced at start; else empty."""
        node = self._node()
        ledger = self._read(node)
        ledger, notes = ownership.reconcile(ledger, node)
        for note in notes:
            _log.warning("DRA ledger %s: %s", self._path, note)
        self._ledger = ledger
        self._save()

    # -- the reconciler's side ----------------------------------------------------------------
    def in_use(self) -> frozenset[str]:
        """Every MIG device and GPU UUID a claim (or a recovered entry) holds."""
        with self._lock:
            return self._ledger.uuids()

    def claimed(self) -> dict[str, str]:
        """MIG device and GPU UUID -> the claim UID that owns it, for the ResourceSlice
        publisher: kube-scheduler knows these from their claims. An instance recovered after
        the ledger was lost is no claim's, so it is left out (never offered)."""
        with self._lock:
            return {
                e.uuid: e.owner
                for e in self._ledger.entries
                if e.uuid is not None and e.owner != ownership.RECOVERED
            }

    def owned(self) -> ownership.Ledger:
        """The ledger now."""
        with self._lock:
            return self._ledger

    # -- preparing.Instances ----------------------------------------------------------------
    def ensure(self, placement: placements.Target, *, owner: str) -> preparing.Instance:
        """The owner's instance at ``placement``: the one it holds (a recovered one there is
        adopted, a half-made one completed), else a new one; a whole GPU with MIG off is
        recorded, nothing created."""
        if not owner or owner == ownership.RECOVERED:
            raise preparing.InstanceError(f"{placement}: an owner (claim UID) is needed")
        with self._lock:
            try:
                if isinstance(placement, placements.WholeGpu):
                    return self._ensure_whole(placement, owner)
                return self._ensure_mig(placement, owner)
            except backend.BackendError as err:  # reading the GPU failed (MIG off, gone)
                raise preparing.InstanceError(f"{placement}: {err}") from err

    def _ensure_whole(self, target: placements.WholeGpu, owner: str) -> preparing.Instance:
        info = next((g for g in self._backend.gpus() if g.index == target.gpu), None)
        if info is None:
            raise preparing.InstanceError(f"{target}: this node has no GPU {target.gpu}")
        if info.mig is not None and (info.mig.current or info.mig.pending):
            raise preparing.InstanceError(
                f"{target}: MIG mode is on (or about to be): its MIG placements are the devices"
            )
        held = self._ledger.at(target)
        if held is not None and held.owner != owner:
            raise preparing.InstanceError(f"{target} is taken by claim UID {held.owner}")
        if held is None and changes.gpu_held(info.uuid, self._used.in_use()):
            raise preparing.InstanceError(f"{target} ({info.uuid}) is in use by a pod")
        if held is None or held.uuid != info.uuid:
            self._record(ownership.Owned(owner, target, info.uuid))
        return preparing.Instance(target, info.uuid)

    def _ensure_mig(self, placement: placements.Placement, owner: str) -> preparing.Instance:
        held = self._ledger.at(placement)
        if held is not None and held.owner not in (owner, ownership.RECOVERED):
            raise preparing.InstanceError(f"{placement} is taken by claim UID {held.owner}")
        if held is None:
            self._clear_way(placement)
        there = self._at(placement)
        if there is not None and there.profile != placement.profile:
            raise preparing.InstanceError(
                f"{placement}: slot {placement.start} holds a {there.profile} instance "
                f"({there.uuid or 'incomplete'})"
            )
        if there is not None and held is not None and held.uuid not in (None, there.uuid):
            raise preparing.InstanceError(
                f"{placement} is taken by an instance no claim owns ({there.uuid or 'incomplete'})"
            )
        made = there is None
        if there is None:
            if held is not None:
                _log.warning("DRA: %s of claim %s is gone: created again", placement, owner)
            there = self._create(placement, owner)
        elif not there.complete:
            there = self._complete(placement, there)
        assert there.uuid is not None
        if held is None or held.owner != owner or held.uuid != there.uuid:
            if held is None and not made:
                _log.info("DRA: claim %s adopts the free %s (%s)", owner, placement, there.uuid)
            if held is not None and held.owner == ownership.RECOVERED:
                _log.warning("DRA: claim %s adopts the recovered %s", owner, placement)
            self._record(ownership.Owned(owner, placement, there.uuid))
        return preparing.Instance(placement, there.uuid)

    def _clear_way(self, placement: placements.Placement) -> None:
        """Make room for a claim at ``placement``, which no claim holds: the instances no claim
        owns that overlap it (memory slices, media engines) are destroyed, and one at exactly
        the placement is kept for the claim to adopt. The publisher offers such a free
        instance like any placement, so kube-scheduler allocates it, or a placement
        overlapping it, from counters that say its slices are free. Nothing is destroyed and
        :class:`~preparing.InstanceError` is raised when one of them is a claim's, held since
        the ledger was lost, not complete, or in use (the agent's other in-use sources, its
        processes): the kubelet retries."""
        info = next((g for g in self._backend.gpus() if g.index == placement.gpu), None)
        if info is None or info.model is None:
            raise preparing.InstanceError(f"{placement}: this node has no such GPU it knows")
        geo = layouts.geometry(info.model)
        try:
            want = geo.placement(layouts.Instance(placement.start, placement.profile))
        except errors.MigpilotError as err:
            raise preparing.InstanceError(f"{placement}: {err}") from None
        owners = {e.uuid: e.owner for e in self._ledger.entries if e.uuid is not None}
        in_the_way = [
            dev for dev in self._backend.mig_devices(placement.gpu) if _in_the_way(geo, dev, want)
        ]
        if not in_the_way:
            return
        used = self._used.in_use()
        doomed: list[backend.MigDevice] = []
        for dev in in_the_way:
            what = f"{placement}: the {dev.profile} instance at slot {dev.start}"
            at = self._ledger.at(placements.Placement(placement.gpu, dev.profile, dev.start))
            owner = owners.get(dev.uuid or "", at.owner if at is not None else None)
            if owner == ownership.RECOVERED:
                raise preparing.InstanceError(f"{what} is held since the ledger was lost")
            if owner is not None:
                raise preparing.InstanceError(f"{what} is taken by claim UID {owner}")
            if dev.uuid is None:
                raise preparing.InstanceError(f"{what} is not complete (being made?)")
            if dev.uuid in used or self._backend.running_processes(placement.gpu, dev.uuid):
                raise preparing.InstanceError(f"{what} ({dev.uuid}) is in use")
            if (dev.profile, dev.start) != (placement.profile, placement.start):
                doomed.append(dev)
        for dev in doomed:
            _log.info("DRA: %s destroys the free %s@%d no claim owns (%s)",
                      placement, dev.profile, dev.start, dev.uuid)  # fmt: skip
            self._backend.destroy_instance(placement.gpu, dev.gi_id)

    def _create(self, placement: placements.Placement, owner: str) -> backend.MigDevice:
        # Written ahead: a crash after the create leaves an entry the next start completes.
        self._record(ownership.Owned(owner, placement, None))
        try:
            made = self._backend.create_instance(
                placement.gpu, profile=placement.profile, start=placement.start
            )
        except backend.BackendError as err:
            half = self._at(placement)
            if half is not None and half.profile == placement.profile:
                # Made a moment ago by another hand: the agent's pass, keeping a free instance
                # of the node's target that it saw before the last claim there released it.
                # Free and exactly the placement, it is what this claim would adopt.
                _log.info("DRA: %s was made meanwhile (%s): claim %s adopts it",
                          placement, err, owner)  # fmt: skip
                return half if half.uuid is not None else self._complete(placement, half)
            if half is None:  # nothing was made: no entry either
                self._ledger = self._ledger.drop([placement])
                self._save()
            raise preparing.InstanceError(f"{placement}: the GPU refused: {err}") from err
        if made.uuid is None:
            return self._complete(placement, made)
        return made

    def _complete(
        self, placement: placements.Placement, half: backend.MigDevice
    ) -> backend.MigDevice:
        try:
            return self._backend.create_compute_instance(placement.gpu, half.gi_id)
        except backend.BackendError as err:
            raise preparing.InstanceError(
                f"{placement}: its compute instance cannot be created: {err}"
            ) from err

    def release(self, owner: str) -> tuple[placements.Target, ...]:
        """Destroy the owner's MIG instances that nothing uses and let its whole GPUs go;
        :class:`~preparing.InstanceError` naming those in use (they stay, with their owner)."""
        if not owner or owner == ownership.RECOVERED:
            return ()
        with self._lock:
            mine = self._ledger.of(owner)
            if not mine:
                return ()
            used = self._used.in_use()
            done: list[placements.Target] = []
            refused: list[str] = []
            for entry in mine:
                try:
                    problem = self._let_go(entry, used)
                except backend.BackendError as err:
                    problem = f"{entry.target}: {err}"
                if problem:
                    refused.append(problem)
                else:
                    done.append(entry.target)
            self._ledger = self._ledger.drop(done)
            self._save()
        if refused:
            raise preparing.InstanceError("; ".join(refused))
        return tuple(done)

    def _let_go(self, entry: ownership.Owned, used: frozenset[str]) -> str:
        """Destroy one entry's instance: ``""`` when it is gone (or was a whole GPU), else why
        it stays."""
        target = entry.target
        if isinstance(target, placements.WholeGpu):
            return ""
        there = self._at(target)
        if (
            there is None
            or there.profile != target.profile
            or (entry.uuid is not None and there.uuid != entry.uuid)
        ):
            return ""  # gone already (an instance there now is not this claim's)
        if there.uuid is not None:
            if there.uuid in used:
                return f"{target} ({there.uuid}) is in use: not destroyed"
            try:
                running = self._backend.running_processes(target.gpu, there.uuid)
            except backend.BackendError as err:
                if err.kind is not backend.ErrorKind.NOT_FOUND:
                    return f"{target}: cannot tell whether it is in use: {err}"
                running = ()
            if running:
                return f"{target} ({there.uuid}) has {len(running)} processes: not destroyed"
        try:
            self._backend.destroy_instance(target.gpu, there.gi_id)
        except backend.BackendError as err:
            if err.kind is backend.ErrorKind.NOT_FOUND:
                return ""
            return f"{target}: not destroyed: {err}"
        return ""

    # -- the node and the file ------------------------------------------------------------------
    def _at(self, placement: placements.Placement) -> backend.MigDevice | None:
        """The instance at ``placement``'s start slot of its GPU, of its profile or not."""
        for dev in self._backend.mig_devices(placement.gpu):
            if dev.start == placement.start:
                return dev
        return None

    def _node(self) -> ownership.NodeInstances:
        mig: dict[placements.Placement, str | None] = {}
        whole: dict[int, str] = {}
        for info in self._backend.gpus():
            if info.mig is None or not info.mig.current:
                whole[info.index] = info.uuid
                continue
            for dev in self._backend.mig_devices(info.index):
                mig[placements.Placement(info.index, dev.profile, dev.start)] = dev.uuid
        return ownership.NodeInstances(mig=mig, whole=whole)

    def _read(self, node: ownership.NodeInstances) -> ownership.Ledger:
        if self._path is None:
            return ownership.Ledger()
        try:
            raw = self._path.read_bytes()
        except FileNotFoundError:
            return ownership.Ledger()
        except OSError as err:
            raise errors.AgentConfigError(
                f"DRA claims ledger {self._path}: cannot read it: {err.strerror or err}"
            ) from None
        try:
            return ownership.parse(json.loads(raw), source=str(self._path))
        except (ValueError, ownership.LedgerError) as err:  # bad UTF-8 and JSON are ValueErrors
            self.recovered_from = str(err)
        aside = self._path.with_name(f"{self._path.name}.corrupt")
        os.replace(self._path, aside)
        recovered = ownership.recovered(node)
        _log.error(
            "DRA claims ledger %s cannot be read (%s): kept as %s; the node's %d MIG instances "
            "are held as no claim's (never destroyed; a claim prepared at one's placement "
            "adopts it)",
            self._path,
            self.recovered_from,
            aside,
            len(recovered.entries),
        )
        return recovered

    def _record(self, entry: ownership.Owned) -> None:
        self._ledger = self._ledger.put(entry)
        self._save()

    def _save(self) -> None:
        if self._path is None:
            return
        text = json.dumps(ownership.dump(self._ledger), indent=1, sort_keys=True) + "\n"
        try:
            files.write_atomically(self._path, text, durable=True)
        except OSError as err:
            raise preparing.InstanceError(
                f"cannot write the DRA claims ledger {self._path}: {err.strerror or err}"
            ) from None


def _in_the_way(geo: layouts.Geometry, dev: backend.MigDevice, want: layouts.Footprint) -> bool:
    """Whether instance ``dev`` keeps an instance of footprint ``want`` from being made: they
    share memory slots or both take the media engines. An instance at a placement MIG does not
    allow is in the way of everything."""
    try:
        got = geo.placement(layouts.Instance(dev.start, dev.profile))
    except errors.MigpilotError:
        return True
    return bool(got.mask & want.mask) or (got.media and want.media)
