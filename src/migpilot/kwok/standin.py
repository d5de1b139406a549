"""A stand-in for the kubelet on nodes that have none (KWOK), for tests and demos only.

A real kubelet learns the device plugin's resources from ListAndWatch and copies their counts
into the Node's ``status.capacity`` and ``status.allocatable`` (``docs/agent.md``). On a KWOK
node nothing does, so with ``migpilot agent --kubelet simulated`` this listener does it after
every pass: each resource the device plugin would advertise under the strategy (``nvidia.com/
mig-<profile>`` under mixed, and ``nvidia.com/gpu-<N>gb`` for the GpuLayout's MPS slices),
counted, with a resource whose last device disappeared kept at ``0`` as the kubelet keeps a
registered resource. Its first publish sets to ``0`` every extended resource the Node shows that
it does not advertise, as a kubelet does at its start (:func:`stale_resources`: a Karpenter KWOK
node is created with MIG counts for instances that do not exist), and a count the Node's watch
shows lost is published again (:meth:`SimulatedKubelet.node_seen`).

It also does what Allocate does on a real node: each pod bound to the node
(:class:`~migpilot.agent.cluster.boundpods.PodBook`, fed by a pod watch) that is not terminated and
asks for MIG resources or MPS slices (or, NVIDIA-style, for ``nvidia.com/gpu`` advertised as
time-slicing replicas, :func:`with_replicas`) gets distinct healthy devices of those resources
(:func:`assign`, pure), preferring the instances and slices the GpuLayout spec reserves for
that pod, then unreserved ones; a pod keeps its devices while it lives. The assigned devices
are in use (:meth:`SimulatedKubelet.in_use`): the reconciler never destroys them and the
GpuLayout status reports them ``used``. They are released when the pod is deleted or
terminates. As a real kubelet keeps its assignments in a checkpoint
(``/var/lib/kubelet/device-plugins/kubelet_internal_checkpoint``), the stand-in may keep them
in a file (:class:`Checkpoint`, written before the hand-outs are logged or reported): after a
restart each pod gets back exactly the devices it held, not merely one of the same set (which
would let pods of one profile swap instances). Without one (the fleet, whose GPUs are not
durable either), or for a pod the file does not name, the devices the last status reported
``used`` go to the pods first (:func:`reported_used`), so the same instances stay in use.
It is kept apart from the real path on purpose: the agent knows only what it asks of a
stand-in (:class:`~migpilot.agent.assembling.Standin`), and gets this one from its caller
(:func:`stand_in`) with ``--kubelet simulated``; it never imports this package.

A shell module: it writes through :class:`~migpilot.agent.cluster.kubeapi.NodeApi` and never imports
a Kubernetes client (lightkube) nor gRPC; import-linter contracts check both."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any

from migpilot import errors, logs
from migpilot.agent import assembling
from migpilot.agent.cluster import boundpods, kubeapi
from migpilot.agent.deviceplugin import advertising, devices, replicating, resolving
from migpilot.agent.rules import changes
from migpilot.agent.sharing import timeslicing, unifying
from migpilot.api import gpulayouts
from migpilot.kube import errors as kube_errors
from migpilot.planning import quantities
from migpilot.sharing import config as sharing_config
from migpilot.sharing import replicas

_log = logging.getLogger(__name__)


def _counts(advertised: Mapping[str, Sequence[devices.Device]]) -> dict[str, int]:
    """How many healthy devices of each advertised resource (:func:`_advertised`: none under
    an invalid single-strategy node, as NVIDIA's plugin then advertises nothing)."""
    return {
        name: sum(d.health is devices.Health.HEALTHY for d in devs)
        for name, devs in advertised.items()
    }


def _advertised(
    view: devices.NodeDevices,
    strategy: devices.MigStrategy,
    sharing: sharing_config.Config = sharing_config.EMPTY,
) -> dict[str, tuple[devices.Device, ...]]:
    """What the device plugin advertises for ``view``: its resources under ``strategy``, with
    the replicas and renames of the sharing config (unshared when the config does not fit the
    node, as the plugin then does)."""
    try:
        resources = advertising.resources_for(view, strategy)
    except advertising.InvalidMigConfigurationError:
        return {}
    with contextlib.suppress(errors.SharingConfigError):
        resources = tuple(replicating.share(resources, view, sharing).resources)
    return {r.name: r.devices for r in resources}


def is_extended(name: str) -> bool:
    """Whether ``name`` is an extended resource as Kubernetes tells one
    (``IsExtendedResourceName``): domain-prefixed, outside ``kubernetes.io``, not a quota's
    ``requests.`` name. The kubelet zeroes these at its start until a device plugin registers
    them."""
    return "/" in name and "kubernetes.io/" not in name and not name.startswith("requests.")


def stale_resources(
    node: Mapping[str, Any] | None,
    *,
    advertised: Collection[str],
    kept: Collection[str] = unifying.COUNTERS,
) -> tuple[str, ...]:
    """The extended resources the Node's capacity or allocatable show above zero that are not
    ``advertised``, sorted: what the stand-in zeroes at its first publish, as a kubelet zeroes
    the extended resources no device plugin registered yet. ``kept`` are left alone: the
    agent's unified counters (``nvidia.com/gpumem``...), which it writes itself, not a device
    plugin (pure)."""
    if node is None:
        return ()
    status = node.get("status") or {}
    lists = [status.get("capacity") or {}, status.get("allocatable") or {}]
    return tuple(
        sorted(
            {
                name
                for shown in lists
                for name, value in shown.items()
                if is_extended(name)
                and name not in advertised
                and name not in kept
                and not _zero(value)
            }
        )
    )


def lost_counts(node: Mapping[str, Any], published: Mapping[str, str]) -> tuple[str, ...]:
    """The resources whose ``published`` count the Node's capacity or allocatable does not
    show (absent counts as 0; an unreadable value shows nothing), sorted (pure)."""
    status = node.get("status") or {}
    lists = [status.get("capacity") or {}, status.get("allocatable") or {}]
    lost = set()
    for name, value in published.items():
        for shown in lists:
            try:
                same = quantities.amount(shown.get(name, 0), where=name) == int(value)
            except (errors.MigpilotError, ValueError):
                same = False
            if not same:
                lost.add(name)
    return tuple(sorted(lost))


def _zero(value: Any) -> bool:
    try:
        return quantities.amount(value, where="a Node's resource") == 0
    except errors.MigpilotError:
        return False  # unreadable: zero it all the same


def assign(
    pods: Sequence[boundpods.BoundPod],
    *,
    advertised: Mapping[str, Sequence[devices.Device]],
    reserved: Mapping[str, str],
    previous: Mapping[str, tuple[str, ...]],
    held: frozenset[str] = frozenset(),
    busy: frozenset[str] = frozenset(),
    withheld: frozenset[str] = frozenset(),
) -> dict[str, tuple[str, ...]]:
    """Which devices each pod holds: ``namespace/name`` -> device ids (pure).

    A pod keeps the devices it had (``previous``) that are still advertised for a resource it
    asks for; then, in ``pods``' order, each gets what it still lacks from the healthy devices
    no other pod holds: those ``reserved`` (device id -> ``namespace/name``) for it first, then
    those ``held`` (in use before a restart, when nothing is ``previous``), then unreserved
    ones, then those reserved for another pod, each in advertised order. A pod that holds
    nothing gets its devices only when all of them can be had, as a kubelet admits a pod whole
    (so two pods never each hold half of what they need); it holds ``()`` meanwhile. A pod that
    holds some (one of its devices went) gets what there is. Devices in ``busy`` (handed to
    unified pods: a time-slicing replica is ``nvidia.com/gpu`` for both kinds) go to no pod.
    Devices ``withheld`` (the agent is destroying them) go to no pod that does not hold them
    already; a pod that does keeps them (the agent's in-use check then refuses the destroy).
    """
    taken: set[str] = set(busy)
    kept: dict[str, list[str]] = {}
    for pod in pods:
        mine = kept.setdefault(pod.key, [])
        for resource, count in pod.requests:
            ids = {d.id for d in advertised.get(resource, ())}
            had = [u for u in previous.get(pod.key, ()) if u in ids and u not in taken][:count]
            mine.extend(had)
            taken.update(had)
    out: dict[str, tuple[str, ...]] = {}
    for pod in pods:
        mine = kept[pod.key]
        picks: list[str] = []
        short = False
        for resource, count in pod.requests:
            offered = advertised.get(resource, ())
            need = count - sum(1 for d in offered if d.id in mine)
            if need <= 0:
                continue
            free = [d.id for d in offered
                    if d.health is devices.Health.HEALTHY and d.id not in taken
                    and d.id not in picks and d.id not in withheld]  # fmt: skip

            def rank(uuid: str, key: str = pod.key) -> int:
                holder = reserved.get(uuid)
                if holder == key:
                    return 0
                if uuid in held:
                    return 1
                return 2 if holder is None else 3

            got = sorted(free, key=rank)[:need]  # sorted() is stable: advertised order within
            short = short or len(got) < need
            picks.extend(got)
        if mine or not short:
            mine.extend(picks)
            taken.update(picks)
        out[pod.key] = tuple(mine)
    return out


def with_replicas(
    pod: boundpods.BoundPod, advertised: Mapping[str, Sequence[devices.Device]]
) -> boundpods.BoundPod:
    """``pod`` asking, beside its MIG resources, for the ``nvidia.com/gpu`` of its containers
    when it is an NVIDIA-style pod (not unified) and the node advertises ``nvidia.com/gpu`` as
    time-slicing replicas (``<gpu-uuid>::<n>``): :func:`assign` then gives it replicas, so the
    GpuLayout status reports them used, as the kubelet's in-use set would on a real node. As
    kube-scheduler counts: the largest of the init containers' asks and the others' sum.
    Whole GPUs not time-sliced are left as they were (pure)."""
    gpu = pod.gpu
    if gpu is None or gpu.unified:
        return pod
    offered = advertised.get(devices.FULL_GPU_RESOURCE, ())
    if not any(replicas.is_replica(d.id) for d in offered):
        return pod
    count = max(
        [sum(c.count for c in gpu.containers if not c.init)]
        + [c.count for c in gpu.containers if c.init]
    )
    asked = ((devices.FULL_GPU_RESOURCE, count),)
    return dataclasses.replace(pod, requests=tuple(sorted(pod.requests + asked)))


def reservations(
    spec: gpulayouts.LayoutSpec | None, state: Mapping[int, changes.GpuState]
) -> dict[str, str]:
    """MIG device UUID (or MPS slice or time-slicing replica device ID) -> ``namespace/name`` of
    the pod the spec reserves its instance (or slice, or replica) for."""
    if spec is None:
        return {}
    uuids = {index: gpu.info.uuid for index, gpu in state.items()}
    kept = {
        timeslicing.device_id(uuids[g], ident): pod
        for (g, ident), pod in timeslicing.reservations(spec).items()
        if g in uuids
    }
    sliced = {
        devices.slice_device_id(uuids[g.index], sl.id): sl.reserved_for
        for g in spec.gpus
        if g.index in uuids
        for sl in g.mps
        if sl.reserved_for is not None
    }
    wanted = {
        (g.index, i.start, i.profile): i.reserved_for
        for g in spec.gpus
        for i in g.instances
        if i.reserved_for is not None
    }
    return (
        kept
        | sliced
        | {
            d.uuid: pod
            for index, gpu in state.items()
            for d in gpu.devices
            if d.uuid is not None and (pod := wanted.get((index, d.start, d.profile))) is not None
        }
    )


def reported_used_by(layout: gpulayouts.GpuLayout | None) -> dict[str, str]:
    """MIG device UUID (or MPS slice device ID) -> the pod the GpuLayout's status reports it
    used by (``usedBy``): a restarted stand-in gives the unified pods among them back their
    instances and slices."""
    if layout is None or layout.status is None:
        return {}
    slices = {
        devices.slice_device_id(g.uuid, sl.id): sl.used_by
        for g in layout.status.gpus
        for sl in g.mps
        if sl.used_by is not None
    }
    slices |= {
        timeslicing.device_id(g.uuid, r.id): r.used_by
        for g in layout.status.gpus
        for r in g.replicas
        if r.used_by is not None
    }
    return slices | {
        i.uuid: i.used_by
        for g in layout.status.gpus
        for i in g.instances
        if i.uuid is not None and i.used_by is not None
    }


def reported_used(layout: gpulayouts.GpuLayout | None) -> frozenset[str]:
    """MIG device UUIDs (and MPS slice device IDs) the GpuLayout's status reports ``used``:
    what the node's pods held when the agent last reported (the hint of a restarted agent's
    first assignment)."""
    if layout is None or layout.status is None:
        return frozenset()
    used = gpulayouts.InstanceState.USED
    slices = frozenset(
        devices.slice_device_id(g.uuid, sl.id)
        for g in layout.status.gpus
        for sl in g.mps
        if sl.state is used
    ) | frozenset(
        timeslicing.device_id(g.uuid, r.id)
        for g in layout.status.gpus
        for r in g.replicas
        if r.state is used
    )
    return slices | frozenset(
        i.uuid
        for g in layout.status.gpus
        for i in g.instances
        if i.uuid is not None and i.state is used
    )


# --- the checkpoint ----------------------------------------------------------------------------

CHECKPOINT_SUFFIX = ".kubelet-checkpoint"
"""``migpilot agent --kubelet simulated --state-file F`` keeps the stand-in's checkpoint in
``F`` + this suffix, beside the emulated GPUs' state: both are the node's disk."""


@dataclasses.dataclass(frozen=True, slots=True)
class Held:
    """What one pod holds, as the checkpoint keeps it."""

    uid: str
    """The pod's ``metadata.uid`` (``""``: unknown): a pod made again under the same name is
    another pod, which gets nothing back."""
    devices: tuple[str, ...]


def checkpoint_doc(held: Mapping[str, Held]) -> dict[str, Any]:
    """The checkpoint file's JSON for ``held`` (``namespace/name`` -> what the pod holds)
    (pure)."""
    return {
        "version": 1,
        "pods": [
            {"pod": key, "uid": h.uid, "devices": list(h.devices)}
            for key, h in sorted(held.items())
        ],
    }


def parse_checkpoint(doc: Any) -> dict[str, Held]:
    """The pods and devices a checkpoint file holds; a document not of
    :func:`checkpoint_doc`'s shape raises :class:`ValueError` naming what is wrong (pure)."""
    if not isinstance(doc, dict) or doc.get("version") != 1:
        raise ValueError("not a version 1 stand-in kubelet checkpoint")
    pods = doc.get("pods")
    if not isinstance(pods, list):
        raise ValueError("its 'pods' is not a list")
    out: dict[str, Held] = {}
    for entry in pods:
        ok = isinstance(entry, dict) and isinstance(entry.get("pod"), str)
        ok = ok and isinstance(entry.get("uid"), str) and isinstance(entry.get("devices"), list)
        if not ok or not all(isinstance(d, str) for d in entry["devices"]):
            raise ValueError(f"a pod entry is not {{pod, uid, devices}}: {entry!r}")
        out[entry["pod"]] = Held(entry["uid"], tuple(entry["devices"]))
    return out


def restored(
    saved: Mapping[str, Held], pods: Sequence[boundpods.BoundPod]
) -> dict[str, tuple[str, ...]]:
    """What ``saved`` gives back to the pods listed after a restart: each pod's devices, except
    for a pod listed under the same name with another uid (a new pod); pods not listed keep
    theirs, to be released (pure)."""
    uids = {p.key: p.uid for p in pods}
    return {
        key: h.devices
        for key, h in saved.items()
        if not (h.uid and uids.get(key) and uids[key] != h.uid)
    }


class Checkpoint:
    """The stand-in's assignments in a file, as a kubelet's device manager keeps its
    checkpoint: written whole (a temporary file renamed over it) whenever they change, read
    once at the start. A file that cannot be read is logged and ignored (the status's ``used``
    then guides the first assignment, :func:`reported_used`); a write that fails is logged and
    retried at the next change."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> dict[str, Held]:
        """The pods' devices as last saved; none when there is no file yet."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as err:
            _log.warning("stand-in kubelet checkpoint %s not read: %s", self.path, err)
            return {}
        try:
            return parse_checkpoint(json.loads(text))
        except ValueError as err:  # json.JSONDecodeError is one
            _log.warning("stand-in kubelet checkpoint %s ignored: %s", self.path, err)
            return {}

    def save(self, held: Mapping[str, Held]) -> bool:
        """Write ``held``; whether it was written."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps(checkpoint_doc(held)), encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as err:
            _log.error("stand-in kubelet checkpoint %s not written: %s", self.path, err)
            return False
        return True


# --- the stand-in ------------------------------------------------------------------------------


class SimulatedKubelet:
    """Publishes the advertised resource counts into the Node's capacity and allocatable, and, given
    a :class:`~migpilot.agent.cluster.boundpods.PodBook`, assigns devices to the node's pods as
    Allocate would.

    A :class:`~running.PassListener` (tell it before the status is written, so the status sees
    the newest assignment) and a :class:`~reconciling.InUse` source (the assigned devices).
    ``spec`` gives the GpuLayout spec whose reservations are preferred; ``held`` the devices
    in use when the agent started (:func:`reported_used` of the GpuLayout as listed), which the
    first assignment made once the pods are listed prefers, so a restart moves no pod.
    ``checkpoint`` keeps each pod's devices across a restart: until the pods are listed they
    are in use, and then each pod still there gets back exactly its own.

    Unified pods (``nvidia.com/gpu`` with ``gpumem``, ``docs/unified.md``) are admitted as the
    kubelet admits them, in creation order, each container in turn resolved by the device
    plugin's own :func:`resolving.resolve` from ``unified`` (the pool's inputs,
    :meth:`~unifying.UnifiedPool.inputs`): a pod gets the instances (on a node in mode
    ``mps``, the slice) reserved for it, all of its containers or none (retried at every
    pass). The stand-in is then the pool's
    :class:`~unifying.Allocations`; ``held_by`` (:func:`reported_used_by`) gives a restarted
    stand-in's pods back the instances the status last reported them using.
    """

    def __init__(
        self,
        api: kubeapi.NodeApi,
        *,
        node: str,
        strategy: devices.MigStrategy,
        pods: boundpods.PodBook | None = None,
        spec: Callable[[], gpulayouts.LayoutSpec | None] = lambda: None,
        held: Callable[[], frozenset[str]] = frozenset,
        unified: Callable[[], resolving.Inputs] | None = None,
        held_by: Callable[[], Mapping[str, str]] = dict,
        checkpoint: Checkpoint | None = None,
        dra: bool = False,
    ) -> None:
        self._dra = dra
        """A node in DRA mode: no device plugin serves it, so nothing is advertised and no
        device handed out (its pods' claims are prepared instead, ``migpilot.kwok.drakubelet``);
        only counts the Node shows for devices that do not exist are set to 0."""
        self._checkpoint = checkpoint
        self._saved: Mapping[str, Held] | None = checkpoint.load() if checkpoint else None
        """What the checkpoint held at the start, until the first assignment; then ``None``."""
        self._written: Mapping[str, Held] | None = self._saved
        """What the checkpoint file holds now, as far as this stand-in knows."""
        self._unified_inputs = unified
        self._held_by: Callable[[], Mapping[str, str]] | None = held_by
        """Until the first assignment of unified pods; then ``None``."""
        self._unified: Mapping[str, resolving.PodAllocation] = {}
        """Unified pod -> its instances; replaced whole, so readers need no lock."""
        self._unified_version = 0
        self._unified_refused: dict[str, str] = {}
        self._api = api
        self._node = node
        self._strategy = strategy
        self._pods = pods
        self._spec = spec
        self._held: Callable[[], frozenset[str]] | None = held
        """Until the first assignment; then ``None``."""
        self._published: dict[str, str] | None = None
        self._drifts = 0
        """How many times the Node was seen without the counts last published."""
        self._drifted = False
        """The Node lost a published count: publish again at the next pass."""
        self._settled = True
        self._lock = threading.Lock()
        self._state: Mapping[int, changes.GpuState] | None = None
        self._offered: dict[str, tuple[devices.Device, ...]] | None = None
        """What the plugin would advertise, as of the last pass (computed once per pass)."""
        self._seen_version = -1
        self._assigned: dict[str, tuple[str, ...]] = {
            key: h.devices for key, h in (self._saved or {}).items()
        }
        self._sharing: Callable[[], sharing_config.Config] = lambda: sharing_config.EMPTY
        self._withheld: frozenset[str] = frozenset()
        """Devices the agent is destroying: handed to no new pod (:meth:`withhold`)."""

    def share_with(self, current: Callable[[], sharing_config.Config]) -> None:
        """Publish the devices as shared by the node's current sharing config (replicas,
        renames), as the kubelet sees them from the plugin."""
        self._sharing = current

    @property
    def node(self) -> str:
        """The node it stands in for."""
        return self._node

    @property
    def settled(self) -> bool:
        """Whether the last pass's resource counts are in the Node (its patch did not fail)."""
        return self._settled

    def fingerprint(self) -> Hashable:
        """Changes when the node's pods change, and when the Node lost a published count (a
        pass is then due)."""
        pods = None if self._pods is None else self._pods.version(self._node)
        return (pods, self._drifts)

    def node_seen(self, doc: Mapping[str, Any] | None) -> None:
        """The Node as a watch saw it. A count published that it does not show (someone wrote
        the Node's status from an older copy: KWOK's node-initialize stage may, right after
        Karpenter creates the Node) is published again at the next pass, as a kubelet's next
        status sync would write it."""
        published = self._published
        if doc is None or published is None or not self._settled:
            return
        if not lost_counts(doc, published):
            return
        with self._lock:
            self._drifted = True
            self._drifts += 1

    def withhold(self, device_ids: frozenset[str]) -> None:
        """Give none of ``device_ids`` to a pod that does not hold it already, until told
        otherwise (:class:`~running.Withholding`): the agent is destroying them, and the view
        this stand-in assigns from (the last pass's) still lists them until the pass ends."""
        with self._lock:
            self._withheld = device_ids

    def in_use(self) -> frozenset[str]:
        """The devices assigned to the node's live pods; before the first assignment, also
        those in use when the agent started (``held``): an MPS slice the spec dropped must
        stay served until its pod is given it again."""
        with self._lock:
            self._refresh()
            hint = self._held() if self._held is not None else frozenset()
            return (
                hint
                | frozenset(u for devs in self._assigned.values() for u in devs)
                | frozenset(u for a in self._unified.values() for u in a.devices)
            )

    def assigned(self) -> dict[str, tuple[str, ...]]:
        """``namespace/name`` -> the device ids each pod holds now (a unified pod's, sorted)."""
        with self._lock:
            self._refresh()
            out = dict(self._assigned)
            for key, a in self._unified.items():
                out[key] = (*out.get(key, ()), *sorted(a.devices))
            return out

    def slice_holders(self) -> dict[str, str]:
        """MPS slice device ID -> the pod it is assigned to (``usedBy`` in the status)."""
        with self._lock:
            self._refresh()
            return {
                device_id: key
                for key, ids in self._assigned.items()
                for device_id in ids
                if devices.is_slice_id(device_id)
            }

    # -- unifying.Allocations -------------------------------------------------------------------
    def pod_allocations(self) -> Mapping[str, resolving.PodAllocation]:
        """Unified pod -> the instances each of its containers got."""
        return self._unified

    def pods_version(self) -> int:
        """Changes whenever :meth:`pod_allocations` does."""
        return self._unified_version

    def release_pods(self, pods: Sequence[str]) -> None:
        """These pods are gone."""
        with self._lock:
            kept = {k: a for k, a in self._unified.items() if k not in pods}
            if len(kept) != len(self._unified):
                self._unified = kept
                self._unified_version += 1

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Assign devices to new pods, then patch the Node when the counts changed; API
        failures are logged and retried."""
        offered = {} if self._dra else _advertised(view, self._strategy, self._sharing())
        with self._lock:
            self._state, self._offered = state, offered
            self._refresh(force=True)
        self._publish(_counts(offered))

    def _refresh(self, *, force: bool = False) -> None:
        """Assign again when the pods or the devices changed (under the lock)."""
        if self._pods is None or self._offered is None or self._state is None:
            return
        if not self._pods.synced:  # the pods are not known yet: none is assigned nor released
            return
        version = self._pods.version(self._node)
        if not force and version == self._seen_version:
            return
        self._seen_version = version
        pods = self._pods.pods(self._node)
        # Unified pods are admitted below; an NVIDIA-style pod on time-slicing replicas is
        # assigned its replicas here, as a MIG pod its instances.
        mig = (
            []
            if self._dra
            else [q for p in pods if (q := with_replicas(p, self._offered)).requests]
        )
        if self._saved is not None:
            self._assigned = restored(self._saved, mig)
            self._saved = None
            listed = {p.key for p in mig}
            for key, devices in sorted(self._assigned.items()):
                if key in listed and devices:
                    _log.info(
                        "Node %s: pod %s keeps %s (from the checkpoint)",
                        self._node,
                        key,
                        ", ".join(devices),
                        extra=logs.about(pod=key, node=self._node),
                    )
        self._restore_unified(pods)  # before the MIG pods: none may take a unified pod's own
        now = assign(
            mig,
            advertised=self._offered,
            reserved=reservations(self._spec(), self._state),
            previous=self._assigned,
            held=self._held() if self._held is not None else frozenset(),
            busy=frozenset(u for a in self._unified.values() for u in a.devices),
            withheld=self._withheld,
        )
        self._held = None
        self._save(mig, now)
        self._log_changes(mig, now)
        self._assigned = now
        if self._unified_inputs is not None:
            self._assign_unified(pods)

    def _save(self, pods: Sequence[boundpods.BoundPod], now: Mapping[str, tuple[str, ...]]) -> None:
        """Write the checkpoint when what the pods hold changed (under the lock, before the
        change is logged or reported, as a kubelet checkpoints before the container starts)."""
        if self._checkpoint is None:
            return
        uids = {p.key: p.uid for p in pods}
        held = {key: Held(uids.get(key, ""), devs) for key, devs in now.items() if devs}
        if held != self._written and self._checkpoint.save(held):
            self._written = held

    def _restore_unified(self, pods: Sequence[boundpods.BoundPod]) -> None:
        """At the first assignment, give the unified pods still listed back the instances the
        status last reported them using (``held_by``), before any MIG pod is assigned: those
        are then ``busy`` to it, as a restarted kubelet's checkpoint keeps them (under the
        lock). Without this a MIG pod bound while the agent was down could be handed one of
        them for a pass (soak, CI at f4b415c)."""
        if self._held_by is None or self._unified_inputs is None:
            return
        owners: dict[str, list[str]] = {}
        for uuid, key in self._held_by().items():
            owners.setdefault(key, []).append(uuid)
        self._held_by = None
        restored = dict(self._unified)
        for pod in pods:
            gpu = pod.gpu
            if gpu is None or not gpu.unified or pod.key in restored or not owners.get(pod.key):
                continue
            containers = tuple(
                (c.name, tuple(sorted(owners[pod.key])) if n == 0 else ())
                for n, c in enumerate(gpu.containers)
            )
            restored[pod.key] = resolving.PodAllocation(gpu.uid, True, containers)
            _log.info("Node %s: pod %s keeps %s (from the GpuLayout status)", self._node,
                      pod.key, ", ".join(sorted(owners[pod.key])),
                      extra=logs.about(pod=pod.key, node=self._node))  # fmt: skip
        if restored != self._unified:
            self._unified = restored
            self._unified_version += 1

    def _assign_unified(self, pods: Sequence[boundpods.BoundPod]) -> None:
        """Admit the unified pods not yet served, oldest first, as the kubelet would (under
        the lock; see the class)."""
        assert self._unified_inputs is not None
        live = {p.key: p.gpu for p in pods if p.gpu is not None and p.gpu.unified}
        kept = {
            k: a
            for k, a in self._unified.items()
            if (g := live.get(k)) is not None and (not a.uid or not g.uid or a.uid == g.uid)
        }
        for key in sorted(self._unified.keys() - kept.keys()):
            _log.info("Node %s: pod %s released %s", self._node, key,
                      ", ".join(sorted(self._unified[key].devices)),
                      extra=logs.about(pod=key, node=self._node))  # fmt: skip
        inputs = self._unified_inputs()
        busy = frozenset(u for devs in self._assigned.values() for u in devs) | self._withheld
        for pod in pods:
            waiting = live.get(pod.key)
            if waiting is None or pod.key in kept:
                continue
            gpu = waiting
            trial, refusal = dict(kept), None
            admitting = dataclasses.replace(gpu, pending=True)  # KWOK may say Running already
            for container in gpu.containers:
                found = resolving.resolve(
                    requested=tuple(f"simulated-{i}" for i in range(container.count)),
                    pods=(admitting,),
                    reservations=inputs.reservations,
                    allocated=trial,
                    pool=inputs.pool,
                    busy=busy,
                    bound=live.keys(),
                )
                if not isinstance(found, resolving.Decision):
                    refusal = found.message
                    break
                entry = trial.get(pod.key) or resolving.PodAllocation(gpu.uid, True)
                trial[pod.key] = entry.adding(container.name, found.device_ids)
            if refusal is not None:
                if self._unified_refused.get(pod.key) != refusal:
                    _log.warning(
                        "Node %s: pod %s gets no device yet: %s (simulated Allocate; retried "
                        "at every pass)",
                        self._node,
                        pod.key,
                        refusal,
                        extra=logs.about(pod=pod.key, node=self._node),
                    )
                    self._unified_refused[pod.key] = refusal
                continue
            self._unified_refused.pop(pod.key, None)
            kept = trial
            _log.info("Node %s: pod %s gets %s (simulated Allocate)", self._node, pod.key,
                      ", ".join(sorted(kept[pod.key].devices)),
                      extra=logs.about(pod=pod.key, node=self._node))  # fmt: skip
        if kept != self._unified:
            self._unified = kept
            self._unified_version += 1

    def _log_changes(
        self, pods: Sequence[boundpods.BoundPod], now: Mapping[str, tuple[str, ...]]
    ) -> None:
        before = self._assigned
        for pod in pods:
            got, had = now[pod.key], before.get(pod.key)
            if got == had:
                continue
            about = logs.about(pod=pod.key, node=self._node)
            if not had and got:
                _log.info("Node %s: pod %s gets %s (simulated Allocate)", self._node, pod.key,
                          ", ".join(got), extra=about)  # fmt: skip
            elif had is None:
                asks = ", ".join(f"{n} {r}" for r, n in pod.requests)
                _log.warning(
                    "Node %s: pod %s gets no device yet: %s not free (simulated Allocate; "
                    "retried at every pass)",
                    self._node,
                    pod.key,
                    asks,
                    extra=about,
                )
            else:
                held = ", ".join(got) or "nothing"
                _log.info("Node %s: pod %s now holds %s", self._node, pod.key, held, extra=about)
        for key in sorted(before.keys() - now.keys()):
            _log.info("Node %s: pod %s released %s", self._node, key,
                      ", ".join(before[key]) or "nothing",
                      extra=logs.about(pod=key, node=self._node))  # fmt: skip

    def advertised_counts(self) -> Mapping[str, int] | None:
        """The counts last published into the Node (a stale resource zeroed among them);
        ``None`` before the first publish and while the last one failed."""
        published = self._published
        if published is None or not self._settled:
            return None
        return {k: int(v) for k, v in published.items()}

    def _publish(self, healthy: Mapping[str, int]) -> None:
        counts = {k: str(v) for k, v in healthy.items()}
        before = self._published
        if before is None:
            # The first publish, as a kubelet's start: every extended resource the Node shows
            # that nothing here advertises goes to 0 (Karpenter's KWOK nodes are created with
            # the instance type's MIG counts, for instances that do not exist).
            try:
                node = self._api.list_node(self._node).one()
            except kube_errors.KubeApiError as err:
                _log.error("Node %s: not read, resources not published: %s", self._node, err,
                           extra=logs.about(node=self._node))  # fmt: skip
                self._settled = False
                return
            before = dict.fromkeys(stale_resources(node, advertised=counts), "0")
        patch = dict.fromkeys(before, "0") | counts
        self._settled = patch == self._published and not self._drifted
        if self._settled:
            return
        if not patch:  # nothing advertised, nothing stale (a node in DRA mode): no write
            self._published, self._settled, self._drifted = {}, True, False
            return
        try:
            self._api.patch_node_resources(self._node, dict(patch))
        except kube_errors.KubeApiError as err:
            _log.error("Node %s: resources not published: %s", self._node, err,
                       extra=logs.about(node=self._node))  # fmt: skip
            return
        self._published, self._settled, self._drifted = patch, True, False
        _log.info("Node %s: published %s (simulated kubelet)", self._node,
                  ", ".join(f"{k}={v}" for k, v in sorted(patch.items())),
                  extra=logs.about(node=self._node))  # fmt: skip


def stand_in(
    inputs: assembling.StandinInputs, *, checkpoint: Path | None = None
) -> SimulatedKubelet:
    """The stand-in kubelet of one node (:data:`~migpilot.agent.assembling.StandinFactory`):
    restarted, it gives the pods back what its ``checkpoint`` file says they held, else what the
    GpuLayout's status last reported them using."""
    return SimulatedKubelet(
        inputs.api,
        node=inputs.node,
        strategy=inputs.strategy,
        pods=inputs.pods,
        spec=inputs.spec,
        held=lambda: reported_used(inputs.layout()),
        unified=inputs.unified,
        held_by=lambda: reported_used_by(inputs.layout()),
        checkpoint=Checkpoint(checkpoint) if checkpoint is not None else None,
        dra=inputs.dra,
    )


def checkpointed(path: Path | None) -> assembling.StandinFactory:
    """The factory of :func:`stand_in` keeping its checkpoint in ``path`` (``None``: none)."""
    return lambda inputs: stand_in(inputs, checkpoint=path)
