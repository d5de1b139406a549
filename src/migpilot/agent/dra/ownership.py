"""Which claim owns which MIG instance (or whole GPU): the DRA ledger's content, sans-IO.

Why it exists: a MIG instance carries no owner, so after an agent restart nothing on the GPU
says which claim an instance was made for. The kubelet prepares a claim again after a restart
(and unprepares it later) and expects the same instance, not a second one, and the reconciler
must not take a claim's instance for a stray one to destroy. So the plugin keeps a ledger, claim
UID -> placement and instance UUID, in a file (:mod:`gpuinstances` writes it). This module is
the ledger's content: the document and its checks (:func:`parse`, :func:`dump`), and what it
becomes beside the instances that really exist (:func:`reconcile`, :func:`recovered`).

The rules that keep instances safe:

* an entry is written before its instance is created (``uuid`` ``None``: intended), so a crash
  between the two leaves an entry that :func:`reconcile` completes from the instance found at
  exactly that placement, or drops when there is none: an instance made for a claim is never
  left without its owner;
* an entry whose instance is gone (destroyed by hand, a GPU reset) is dropped; a whole GPU that
  now has MIG on is let go;
* a ledger that cannot be read is not guessed at: :func:`recovered` holds every MIG instance of
  the node under :data:`RECOVERED`, an owner no claim has. Such an instance is in use for the
  reconciler and never destroyed by a release; the claim that the kubelet prepares at exactly
  its placement adopts it (kube-scheduler allocates a device to one claim at a time, so that
  claim is the one it was made for).

Pure: the file's text comes in parsed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.agent.dra import placements

FORMAT_VERSION = 1
RECOVERED = ""
"""The owner of an instance found on the node after the ledger was lost: no claim's."""


class LedgerError(errors.MigpilotError):
    """A ledger document that is not what :func:`dump` writes: the message names the entry."""


@dataclass(frozen=True, slots=True)
class Owned:
    """One instance (or whole GPU) of a claim."""

    owner: str
    """The claim's UID, or :data:`RECOVERED`."""
    target: placements.Target
    uuid: str | None
    """The MIG device's (or GPU's) UUID; ``None`` while its creation is only intended."""


@dataclass(frozen=True, slots=True)
class Ledger:
    """Every instance owned, one entry per placement (or whole GPU)."""

    entries: tuple[Owned, ...] = ()

    def at(self, target: placements.Target) -> Owned | None:
        """The entry of ``target``, ``None`` when nothing owns it."""
        return next((e for e in self.entries if e.target == target), None)

    def of(self, owner: str) -> tuple[Owned, ...]:
        """The entries of ``owner``."""
        return tuple(e for e in self.entries if e.owner == owner)

    def put(self, entry: Owned) -> Ledger:
        """The ledger with ``entry`` (replacing the one at its target)."""
        return Ledger((*(e for e in self.entries if e.target != entry.target), entry))

    def drop(self, targets: Iterable[placements.Target]) -> Ledger:
        """The ledger without the entries of ``targets``."""
        gone = frozenset(targets)
        return Ledger(tuple(e for e in self.entries if e.target not in gone))

    def uuids(self) -> frozenset[str]:
        """Every UUID owned: these MIG devices and GPUs are in use."""
        return frozenset(e.uuid for e in self.entries if e.uuid is not None)


def _target_doc(target: placements.Target) -> dict[str, Any]:
    if isinstance(target, placements.WholeGpu):
        return {"gpu": target.gpu}
    return {"gpu": target.gpu, "profile": target.profile, "start": target.start}


def dump(ledger: Ledger) -> dict[str, Any]:
    """The ledger as JSON-ready data: claim UID -> its entries, in a stable order."""
    claims: dict[str, list[dict[str, Any]]] = {}
    for entry in sorted(ledger.entries, key=lambda e: (e.owner, str(e.target))):
        claims.setdefault(entry.owner, []).append({**_target_doc(entry.target), "uuid": entry.uuid})
    return {"version": FORMAT_VERSION, "claims": claims}


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse(data: Any, *, source: str) -> Ledger:
    """The ledger :func:`dump` wrote; :class:`LedgerError` naming ``source`` and the entry for
    anything else (two owners of one placement included)."""
    if not isinstance(data, Mapping) or data.get("version") != FORMAT_VERSION:
        raise LedgerError(f"{source}: not a DRA claims ledger of version {FORMAT_VERSION}")
    found = data.get("claims")
    if not isinstance(found, Mapping):
        raise LedgerError(f"{source}: 'claims' is not a mapping")
    shape = "expected [{gpu: index, profile: name, start: slot, uuid: text|null}, ...]"
    ledger = Ledger()
    for owner, items in found.items():
        where = f"{source}: claim {owner!r}"
        if not isinstance(owner, str) or not isinstance(items, list):
            raise LedgerError(f"{where}: {shape}")
        for item in items:
            if not isinstance(item, Mapping) or not _int(item.get("gpu")):
                raise LedgerError(f"{where}: {shape}")
            uuid = item.get("uuid")
            if uuid is not None and (not isinstance(uuid, str) or not uuid):
                raise LedgerError(f"{where}: uuid is {errors.shown(uuid)}")
            target: placements.Target
            if "profile" not in item and "start" not in item:
                target = placements.WholeGpu(item["gpu"])
            else:
                profile, start = item.get("profile"), item.get("start")
                if not isinstance(profile, str) or not profile or not isinstance(start, int):
                    raise LedgerError(f"{where}: {shape}")
                if not _int(start):
                    raise LedgerError(f"{where}: start is {errors.shown(start)}")
                target = placements.Placement(gpu=item["gpu"], profile=profile, start=start)
            held = ledger.at(target)
            if held is not None:
                raise LedgerError(f"{where}: {target} is also claim {held.owner!r}'s")
            ledger = ledger.put(Owned(owner, target, uuid))
    return ledger


@dataclass(frozen=True, slots=True)
class NodeInstances:
    """What the node has now, as the backend says."""

    mig: Mapping[placements.Placement, str | None]
    """Every MIG instance by placement: its UUID (``None`` for a GPU instance without its
    compute instance)."""
    whole: Mapping[int, str]
    """The GPUs with MIG off, by index: their UUIDs."""


def reconcile(ledger: Ledger, node: NodeInstances) -> tuple[Ledger, tuple[str, ...]]:
    """The ledger kept to the instances that exist (see the module), and a note per change."""
    kept: list[Owned] = []
    notes: list[str] = []
    for entry in ledger.entries:
        who = f"claim {entry.owner}" if entry.owner != RECOVERED else "recovered"
        target = entry.target
        if isinstance(target, placements.WholeGpu):
            if node.whole.get(target.gpu) == entry.uuid:
                kept.append(entry)
            else:
                notes.append(f"{who}: {target} is no longer a GPU with MIG off: let go")
            continue
        if target not in node.mig:
            notes.append(f"{who}: {target} no longer exists: forgotten")
        elif entry.uuid is None:
            found = node.mig[target]
            kept.append(Owned(entry.owner, target, found))
            notes.append(f"{who}: {target} was being created: adopted ({found or 'incomplete'})")
        elif node.mig[target] == entry.uuid:
            kept.append(entry)
        else:
            notes.append(f"{who}: {target} is now another instance: forgotten")
    return Ledger(tuple(kept)), tuple(notes)


def recovered(node: NodeInstances) -> Ledger:
    """The ledger that replaces one that cannot be read: every MIG instance held, no claim's."""
    return Ledger(tuple(Owned(RECOVERED, p, uuid) for p, uuid in node.mig.items()))
