"""The stand-in kubelet's DRA side on a KWOK node in DRA mode: the claims of its pods prepared.

Why it exists: on a real node in DRA mode the kubelet calls the agent's DRA plugin
(``NodePrepareResources``) with the claims of each pod bound there before the pod starts, and
``NodeUnprepareResources`` once no pod there uses a claim; preparing creates the MIG instance at
the placement kube-scheduler allocated (``docs/dra.md``, "Kubelet plugin"). A KWOK node has no
kubelet, so in ``migpilot fleet`` this part does what that kubelet would, after each of the
node's passes, through the same :class:`~migpilot.agent.dra.preparing.Preparer` the plugin
serves (no gRPC and no socket: the fleet runs a thousand nodes in one process). The instances
then exist on the emulated GPUs, owned by their claims, the node's ResourceSlices show them
used by those claims, and the planner's view of the node is what a real one would be.

What it prepares: each claim (:func:`~migpilot.agent.cluster.boundpods.pod_claims`) of a live pod
bound to the node (the fleet's pod watch, :class:`~migpilot.agent.cluster.boundpods.PodBook`)
that is allocated devices of this driver from this node's pool; a claim of another driver is
left alone, and one not allocated yet is read again at the next pass. What it unprepares: every
claim it prepared that no live pod there names any more (deleted, terminated), before it
prepares new ones, since kube-scheduler may have given the freed placement to one of them. A
failure (the API, a placement still taken) is logged once and tried again at the next pass;
:attr:`DraStandin.settled` is false until none is left.

Unlike the kubelet it does not hold a pod back until its claims are prepared: KWOK's Stages run
and delete the fleet's pods as every KWOK pod's, so a pod may show Running a moment before its
instance exists, and be gone a moment before it is destroyed (the test stand-in
``tests/kube/drakubelet.py`` plays one node's kubelet faithfully, over gRPC).

The decision of what to prepare and unprepare is the pure :func:`work`; the class is the shell.
Imports no Kubernetes client: the claims are read through the agent's
:class:`~migpilot.agent.dra.apiclaims.ClaimReader`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import logs
from migpilot.agent.cluster import boundpods
from migpilot.agent.deviceplugin import devices
from migpilot.agent.dra import apiclaims, claims, placements, preparing
from migpilot.agent.rules import changes
from migpilot.kube import errors as kube_errors

_log = logging.getLogger(__name__)

ClaimKey = tuple[str, str]
"""``(namespace, name)`` of a ResourceClaim."""


@dataclass(frozen=True, slots=True)
class Work:
    """What one round does: claims to prepare (to read first), then to unprepare."""

    prepare: tuple[ClaimKey, ...]
    unprepare: tuple[claims.ClaimRef, ...]


def work(
    pods: Sequence[boundpods.BoundPod],
    *,
    prepared: Mapping[ClaimKey, str],
    others: frozenset[ClaimKey] = frozenset(),
) -> Work:
    """The claims of ``pods`` not ``prepared`` yet (nor known to be ``others``': another
    driver's or pool's), and the ``prepared`` ones (key -> claim UID) no pod names any more;
    each sorted."""
    wanted = {(p.namespace, name) for p in pods for name in p.claims}
    return Work(
        prepare=tuple(sorted(wanted - prepared.keys() - others)),
        unprepare=tuple(
            claims.ClaimRef(ns, name, uid)
            for (ns, name), uid in sorted(prepared.items())
            if (ns, name) not in wanted
        ),
    )


def allocated_here(claim: Mapping[str, Any], *, driver: str, pool: str) -> bool | None:
    """Whether a ResourceClaim (raw JSON) is allocated devices of ``driver`` from ``pool``:
    ``None`` while it is not allocated at all (kube-scheduler has not decided yet)."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    if not isinstance(allocation, Mapping):
        return None
    found = allocation.get("devices")
    results = found.get("results") if isinstance(found, Mapping) else None
    return any(
        isinstance(r, Mapping) and r.get("driver") == driver and r.get("pool") == pool
        for r in (results if isinstance(results, list) else ())
    )


class DraStandin:
    """Prepares the claims of the pods bound to ``node`` after each pass (see the module); a
    :class:`~migpilot.agent.running.PassListener`. Passes of one node never overlap (the
    fleet's queue), and the fleet's threads only read :meth:`fingerprint` and :attr:`settled`."""

    def __init__(
        self,
        api: apiclaims.ClaimReader,
        *,
        node: str,
        pods: boundpods.PodBook,
        preparer: preparing.Preparer,
        driver: str = placements.DRIVER,
    ) -> None:
        self._api = api
        self._node = node
        self._pods = pods
        self._preparer = preparer
        self._driver = driver
        self._lock = threading.Lock()
        self._prepared: dict[ClaimKey, str] = {}
        """Claim -> its UID, for the claims prepared now."""
        self._others: set[ClaimKey] = set()
        """Claims of the node's pods allocated another driver's devices, or another pool's."""
        self._told: dict[ClaimKey, str] = {}
        """The last problem logged per claim (each is logged once)."""
        self._changes = 0
        self._settled = True

    @property
    def settled(self) -> bool:
        """Whether the last round left nothing to retry (every claim of the node's pods
        prepared, or another driver's, and every claim no pod uses unprepared)."""
        return self._settled

    def fingerprint(self) -> int:
        """Changes when a claim is prepared or unprepared (a pass is then due, so the status
        and the ResourceSlices show the instance made or gone)."""
        return self._changes

    def prepared(self) -> dict[ClaimKey, str]:
        """Claim -> UID of the claims prepared now."""
        with self._lock:
            return dict(self._prepared)

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Prepare and unprepare what the node's pods ask now."""
        del state, report, labels, view
        if not self._pods.synced:  # the pods are not known yet: nothing is prepared nor released
            self._settled = False
            return
        with logs.concerning(node=self._node):
            self._settled = self.sync(self._pods.pods(self._node))

    def sync(self, pods: Sequence[boundpods.BoundPod]) -> bool:
        """One round for ``pods`` (the node's live pods); whether nothing is left to retry."""
        with self._lock:
            live = {(p.namespace, name) for p in pods for name in p.claims}
            self._others &= live
            todo = work(pods, prepared=self._prepared, others=frozenset(self._others))
            done = True
            # Unprepare first: kube-scheduler may have given a freed placement to a new claim.
            for ref in todo.unprepare:
                done = self._unprepare(ref) and done
            for key in todo.prepare:
                done = self._prepare(key) and done
            for key in list(self._told):
                if key not in live and key not in self._prepared:
                    del self._told[key]
            return done

    def _unprepare(self, ref: claims.ClaimRef) -> bool:
        error = self._preparer.unprepare([ref]).get(ref.uid, "")
        key = (ref.namespace, ref.name)
        if error:
            self._tell(key, f"DRA: claim {ref} not unprepared, retried at the next pass: {error}")
            return False
        del self._prepared[key]
        self._told.pop(key, None)
        self._changes += 1
        _log.info("DRA: claim %s unprepared (no pod on %s uses it)", ref, self._node,
                  extra=logs.about(node=self._node))  # fmt: skip
        return True

    def _prepare(self, key: ClaimKey) -> bool:
        namespace, name = key
        try:
            claim = self._api.get_resource_claim(namespace, name)
        except kube_errors.KubeApiError as err:
            self._tell(key, f"DRA: claim {namespace}/{name} not read: {apiclaims.explain(err)}")
            return False
        if claim is None:
            return False  # not made yet (a template's), or gone with its pod: the next pass
        here = allocated_here(claim, driver=self._driver, pool=self._node)
        if here is None:
            return False  # not allocated yet: kube-scheduler decides first
        if not here:
            self._others.add(key)  # another driver's (or node's) devices: not for this plugin
            return True
        meta = claim.get("metadata")
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        ref = claims.ClaimRef(namespace, name, uid if isinstance(uid, str) else "")
        result = self._preparer.prepare([ref]).get(ref.uid)
        if result is None or result.error:
            why = result.error if result is not None else "no answer"
            self._tell(key, f"DRA: claim {ref} not prepared, retried at the next pass: {why}")
            return False
        self._prepared[key] = ref.uid
        self._told.pop(key, None)
        self._changes += 1
        _log.info("DRA: claim %s prepared on %s: %s", ref, self._node,
                  ", ".join(d.device for d in result.devices),
                  extra=logs.about(node=self._node))  # fmt: skip
        return True

    def _tell(self, key: ClaimKey, message: str) -> None:
        if self._told.get(key) != message:
            self._told[key] = message
            _log.warning("%s", message, extra=logs.about(node=self._node))
