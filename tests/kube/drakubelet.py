"""The kubelet of one KWOK node in DRA mode: what the v1.37 kubelet's DRA manager does for the
pods bound to it, against the agent's real kubelet plugin.

KWOK nodes have no kubelet, and KWOK's Stages would mark the node's pods Running (and delete a
terminating one) without any driver being asked. So the node is left out of KWOK's pod-ready and
pod-delete Stages (:func:`tests.kube.kwokstages.kwok_stages` with both names), and
:class:`DraKubelet` plays its kubelet, polling the node's pods every :data:`POLL_S`:

* its plugin watcher: the registration socket the agent serves in ``<dir>/plugins_registry`` is
  registered with :class:`~tests.integration.kubelet_dra_fake.FakeDraKubelet` (real gRPC, the
  kubelet's protos), again whenever the socket is replaced (an agent restart);
* a pod bound to the node and Pending: its claims are found as the kubelet finds them (a claim
  named in the pod's spec, or the one ``status.resourceClaimStatuses`` names for a template),
  each read from the API and checked to be allocated and reserved for the pod (the kubelet
  refuses a claim not reserved for it); the claims of this driver are passed to
  ``NodePrepareResources`` as references, and only when every one was prepared is the pod
  marked Running (the status a kubelet writes, :func:`tests.kube.kwokstages.running_status`).
  A failed prepare (a claim's error, the plugin not answering) is recorded and tried again at
  the next poll, as the kubelet retries a pod whose resources are not ready;
* a pod with a deletion timestamp: ``NodeUnprepareResources`` of its claims no other pod on the
  node still uses, then the pod's final delete (grace period 0), as the kubelet deletes a pod
  only once its resources are reclaimed. Until then the claim stays reserved for the pod, so
  kube-scheduler cannot hand its device to another claim before the instance is gone. A pod
  gone without that (force-deleted) has its claims unprepared at the next poll.

Every prepare and unprepare is recorded (:attr:`DraKubelet.prepared`,
:attr:`DraKubelet.unprepared`) for the tests to check against the API and the emulated GPUs.

The agent's PodResources socket (one of its in-use sources, which fails closed when it cannot
be asked) is served by :class:`~tests.integration.kubelet_fake.FakeKubelet` in the same folder,
listing no device-plugin devices: a DRA node has none.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import lightkube
from lightkube.resources.core_v1 import Pod
from lightkube.resources.resource_v1 import ResourceClaim
from lightkube.types import PatchType

from migpilot.agent.dra import placements
from tests.integration.kubelet_dra_fake import FakeDraKubelet, KubeletError, Prepared
from tests.integration.kubelet_fake import FakeKubelet
from tests.kube import controlplane
from tests.kube.kwokstages import running_status

POLL_S = 0.3
STOP_S = 45.0
"""How long :meth:`DraKubelet.stop` waits for the loop's last call to the plugin."""
"""How often the node's pods are listed (a kubelet watches; a poll is enough here)."""

_log = logging.getLogger(__name__)

ClaimRef = tuple[str, str, str]
"""(namespace, name, UID) of a ResourceClaim, as the kubelet passes it."""


@dataclass
class _Pod:
    """A pod this kubelet has seen on its node."""

    key: str
    claims: tuple[ClaimRef, ...] = ()
    started: bool = False


@dataclass
class Record:
    """What the kubelet did, for the tests (read under :attr:`DraKubelet.lock`)."""

    prepared: dict[str, tuple[Prepared, ...]] = field(default_factory=dict)
    """Claim UID -> its devices as the last successful NodePrepareResources answered them, for
    the claims prepared now (an unprepared claim leaves)."""
    unprepared: list[str] = field(default_factory=list)
    """Claim UIDs unprepared, in order."""
    started: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """``namespace/name`` of each pod marked Running -> its claims' UIDs."""
    errors: list[str] = field(default_factory=list)
    """Every error a prepare or unprepare answered, and every failed call."""
    registrations: int = 0


class DraKubelet:
    """The fake kubelet of ``node`` in folder ``root`` (the agent's ``--kubelet DIR``)."""

    def __init__(
        self,
        root: Path,
        *,
        node: str,
        kubeconfig: Path,
        driver: str = placements.DRIVER,
    ) -> None:
        self.dir = root
        self.node = node
        self.driver = driver
        self.pod_resources = FakeKubelet(root)
        self.dra = FakeDraKubelet(root / "plugins_registry")
        self.lock = threading.Lock()
        self.record = Record()
        self._kubeconfig = kubeconfig
        self._pods: dict[str, _Pod] = {}
        """Pod UID -> what the kubelet keeps of it."""
        self._socket: tuple[int, int] | None = None
        """The registered socket's (device, inode): a new one is registered again."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"dra-kubelet-{node}")

    def start(self) -> DraKubelet:
        self.pod_resources.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop and wait for it: a call to the plugin it is in ends within its own
        timeouts (at most three of 10 s, a registration). A thread left inside gRPC at
        interpreter exit can crash the test process."""
        self._stop.set()
        self._thread.join(timeout=STOP_S)
        if self._thread.is_alive():
            _log.warning("DRA kubelet of %s still in a call after %.0f s", self.node, STOP_S)
        with contextlib.suppress(Exception):
            self.pod_resources.stop()

    @property
    def registered(self) -> bool:
        return self.dra.plugin is not None

    def prepared(self) -> dict[str, tuple[Prepared, ...]]:
        with self.lock:
            return dict(self.record.prepared)

    def unprepared(self) -> list[str]:
        with self.lock:
            return list(self.record.unprepared)

    def registrations(self) -> int:
        """How many times the plugin was registered (once per agent start)."""
        with self.lock:
            return self.record.registrations

    def errors(self) -> list[str]:
        with self.lock:
            return list(self.record.errors)

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        client: lightkube.Client | None = None
        while not self._stop.wait(POLL_S):
            try:
                if client is None:
                    client = controlplane.client_for(self._kubeconfig)
                self._register()
                if self.registered:
                    self._sync(client)
            except Exception as err:  # the apiserver or the plugin restarting: again next poll
                self._error(f"kubelet loop: {type(err).__name__}: {err}")
                if client is not None:
                    client.close()
                client = None
        if client is not None:
            client.close()

    def _error(self, text: str) -> None:
        _log.warning("DRA kubelet of %s: %s", self.node, text)
        with self.lock:
            self.record.errors.append(text)

    def _register(self) -> None:
        """The plugin watcher: register the plugin's socket, again when it was replaced."""
        sockets = self.dra.sockets()
        if not sockets:
            return
        (socket,) = sockets
        stat = os.stat(socket)
        if (stat.st_dev, stat.st_ino) == self._socket:
            return
        if self.dra.register(socket) is None:
            raise KubeletError(f"the plugin behind {socket} was refused")
        self._socket = (stat.st_dev, stat.st_ino)
        with self.lock:
            self.record.registrations += 1

    def _sync(self, client: lightkube.Client) -> None:
        found = {
            doc["metadata"]["uid"]: doc
            for doc in (
                p.to_dict()
                for p in client.list(
                    Pod, namespace=lightkube.ALL_NS, fields={"spec.nodeName": self.node}
                )
            )
        }
        for uid in sorted(self._pods.keys() - found.keys()):
            self._gone(uid)  # deleted without a final word from this kubelet (forced)
        for uid, doc in sorted(found.items(), key=lambda kv: _key(kv[1])):
            if (doc.get("metadata") or {}).get("deletionTimestamp"):
                self._terminate(client, uid, doc)
            elif (doc.get("status") or {}).get("phase", "Pending") == "Pending":
                self._admit(client, uid, doc)

    def _admit(self, client: lightkube.Client, uid: str, doc: Mapping[str, Any]) -> None:
        pod = self._pods.get(uid)
        if pod is not None and pod.started:
            return
        refs = self._claims(client, uid, doc)
        if refs is None:
            return  # its claims are not there yet: the next poll
        pod = self._pods.setdefault(uid, _Pod(_key(doc)))
        pod.claims = refs
        if refs:
            try:
                answers = self.dra.prepare(refs)
            except (grpc.RpcError, KubeletError) as err:
                self._error(f"NodePrepareResources for {pod.key}: {err}")
                return
            failed = {u: a for u, a in answers.items() if isinstance(a, str)}
            with self.lock:
                for u, answer in answers.items():
                    if not isinstance(answer, str):
                        self.record.prepared[u] = answer
                self.record.errors += [f"prepare {pod.key}: {e}" for e in failed.values()]
            if failed:
                return
        meta = doc["metadata"]
        client.patch(
            Pod.Status,
            meta["name"],
            running_status(doc, now=datetime.datetime.now(datetime.UTC)),
            namespace=meta["namespace"],
            patch_type=PatchType.MERGE,
        )
        pod.started = True
        with self.lock:
            self.record.started[pod.key] = tuple(u for _, _, u in refs)

    def _claims(
        self, client: lightkube.Client, uid: str, doc: Mapping[str, Any]
    ) -> tuple[ClaimRef, ...] | None:
        """The pod's claims of this driver, each allocated and reserved for the pod; ``None``
        while one is not (a template's claim not made yet, not allocated, not reserved)."""
        meta, spec = doc["metadata"], doc.get("spec") or {}
        namespace = meta["namespace"]
        statuses = {
            s.get("name"): s.get("resourceClaimName")
            for s in (doc.get("status") or {}).get("resourceClaimStatuses") or ()
        }
        refs: list[ClaimRef] = []
        for entry in spec.get("resourceClaims") or ():
            name = entry.get("resourceClaimName")
            if name is None:
                if entry["name"] not in statuses:
                    return None
                name = statuses[entry["name"]]
                if name is None:
                    continue  # the template made no claim for this pod: nothing to prepare
            claim = client.get(ResourceClaim, name, namespace=namespace).to_dict()
            status = claim.get("status") or {}
            reserved = {r.get("uid") for r in status.get("reservedFor") or ()}
            allocation = status.get("allocation")
            if allocation is None or uid not in reserved:
                return None
            results = (allocation.get("devices") or {}).get("results") or ()
            if any(r.get("driver") == self.driver for r in results):
                refs.append((namespace, name, claim["metadata"]["uid"]))
        return tuple(refs)

    def _terminate(self, client: lightkube.Client, uid: str, doc: Mapping[str, Any]) -> None:
        """Unprepare the pod's claims no other pod here uses, then delete it for good."""
        if not self._unprepare(uid):
            return
        meta = doc["metadata"]
        with contextlib.suppress(lightkube.ApiError):  # gone already: what was wanted
            client.delete(Pod, meta["name"], namespace=meta["namespace"], grace_period=0)

    def _gone(self, uid: str) -> None:
        self._unprepare(uid)

    def _unprepare(self, uid: str) -> bool:
        """NodeUnprepareResources of the claims only pod ``uid`` uses; whether all went (the
        pod is forgotten then)."""
        pod = self._pods.get(uid)
        if pod is None:
            return True
        others = {ref for u, p in self._pods.items() if u != uid for ref in p.claims}
        refs = [ref for ref in pod.claims if ref not in others]
        if refs:
            try:
                answers = self.dra.unprepare(refs)
            except (grpc.RpcError, KubeletError) as err:
                self._error(f"NodeUnprepareResources for {pod.key}: {err}")
                return False
            with self.lock:
                for u, error in answers.items():
                    if error:
                        self.record.errors.append(f"unprepare {pod.key}: {error}")
                    else:
                        self.record.prepared.pop(u, None)
                        self.record.unprepared.append(u)
            if any(answers.values()):
                return False
        del self._pods[uid]
        with self.lock:
            self.record.started.pop(pod.key, None)
        return True


def _key(doc: Mapping[str, Any]) -> str:
    meta = doc.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"
