"""A kubelet's device manager for one soak node, so that its agent runs the real kubelet path.

Every other soak node's agent runs ``--kubelet simulated``: the stand-in kubelet hands out its
devices and the agent never asks PodResources, so there is no PodResources socket to take away.
This node's agent runs ``--kubelet DIR`` against the fake kubelet of
``tests/integration/kubelet_fake.py`` (real gRPC on unix sockets: device-plugin Registration,
ListAndWatch, Allocate, and PodResources ``List`` and ``GetAllocatableResources``), and
:class:`DeviceManager` does the rest of what a kubelet does for it:

* admits the pods bound to the node (a pod list every :data:`POLL_S`), oldest first and each
  whole, picking the devices with the stand-in's own :func:`migpilot.kwok.standin.assign`
  (without reservations: a kubelet knows none; a unified pod asks ``nvidia.com/gpu``), then
  calls the plugin's ``Allocate`` over gRPC and, once it answers, lists the devices in
  PodResources; a pod keeps its devices until it is gone, and one whose Allocate fails (its
  plugin restarting) is tried again at the next poll;
* copies the registered resources' device counts into the Node's capacity and allocatable every
  :data:`STATUS_SYNC_S`, as the kubelet's node-status sync does (the agent's own publisher
  needs ``GetAllocatableResources``, which is down with the PodResources socket);
* starts each pod it admitted: its phase goes from Pending to Running only once every device
  it asks for was allocated, as a kubelet's does. KWOK's own pod-ready Stage would mark it
  Running at once, before any Allocate, and the agent's plugin serves a unified pod's
  Allocate only while the pod is Pending (``resolving.candidate``): so the node's pods are
  left out of that Stage (:func:`tests.kube.kwokstages.kwok_stages`). Without it a
  35-minute soak saw 316 unified Allocates refused on this node, 2 served, and the whole-GPU
  fallback hand out MIG instances that two pods then held.

What it hands out is recorded for the soak checks as the stand-in's log lines are: an
:class:`~soak_checks.Assigned` per pod (its MIG instances; for a unified pod, the instances the
plugin's Allocate made visible) and a :class:`~soak_checks.Released` when it is gone.
:meth:`DeviceManager.take_pod_resources_away` and :meth:`~DeviceManager.give_pod_resources_back`
are the soak's PodResources fault.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import grpc
import lightkube
from lightkube.resources.core_v1 import Node, Pod
from lightkube.types import PatchType
from tests.integration.kubelet_fake import FakeKubelet
from tests.kube import controlplane
from tests.kube.kwokstages import running_status

import soak_checks as checks
from migpilot import errors
from migpilot.agent.cluster import boundpods
from migpilot.agent.deviceplugin import devices
from migpilot.kwok import standin

POLL_S = 0.5
"""How often the node's pods are listed (a kubelet watches; a poll is enough here)."""
STATUS_SYNC_S = 10.0
"""The kubelet's ``nodeStatusUpdateFrequency``."""
GPU = devices.FULL_GPU_RESOURCE


def _asking(pod: boundpods.BoundPod) -> boundpods.BoundPod:
    """``pod`` with the ``nvidia.com/gpu`` it asks for among its requests, as the kubelet
    counts it (the largest of the init containers' asks and the others' sum)."""
    gpu = pod.gpu
    if gpu is None:
        return pod
    count = max(
        [sum(c.count for c in gpu.containers if not c.init)]
        + [c.count for c in gpu.containers if c.init]
    )
    return dataclasses.replace(pod, requests=tuple(sorted((*pod.requests, (GPU, count)))))


def _visible(response: Any) -> list[str]:
    """The devices an Allocate response makes visible to the container."""
    out: list[str] = []
    for container in response.container_responses:
        text = dict(container.envs).get("NVIDIA_VISIBLE_DEVICES", "")
        out += [d for d in text.split(",") if d]
    return out


class DeviceManager:
    """The fake kubelet of ``root`` and the device manager around it, for pods of
    ``namespace`` bound to ``node``; ``record`` gets each hand-out and release."""

    def __init__(
        self,
        root: Path,
        *,
        node: str,
        namespace: str,
        kubeconfig: Path,
        record: Callable[[checks.Event], None],
    ) -> None:
        self.dir = root
        self.node, self.namespace = node, namespace
        self.kubelet = FakeKubelet(root)
        self._kubeconfig = kubeconfig
        self._record = record
        self.picked: dict[str, tuple[str, ...]] = {}
        """``namespace/name`` -> the device IDs the kubelet picked for it (PodResources)."""
        self.started: set[str] = set()
        """The pods this kubelet has marked Running."""
        self.allocate_failures = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"kubelet-{node}")
        self._down = threading.Lock()

    def start(self) -> DeviceManager:
        self.kubelet.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        with contextlib.suppress(Exception):
            self.kubelet.stop()

    def take_pod_resources_away(self) -> None:
        """The PodResources socket gone; the device manager goes on handing out devices."""
        with self._down:
            self.kubelet.stop_pod_resources()

    def give_pod_resources_back(self) -> None:
        with self._down:
            self.kubelet.start_pod_resources()

    # -- the loop ---------------------------------------------------------------------------
    def _run(self) -> None:
        client: lightkube.Client | None = None
        synced = 0.0
        while not self._stop.wait(POLL_S):
            try:
                if client is None:
                    client = controlplane.client_for(self._kubeconfig)
                self._admit(client)
                if time.monotonic() - synced >= STATUS_SYNC_S:
                    self._sync_status(client)
                    synced = time.monotonic()
            except Exception:  # the apiserver restarting: a fresh client, and again
                if client is not None:
                    client.close()
                client = None
        if client is not None:
            client.close()

    def _offered(self) -> dict[str, tuple[devices.Device, ...]]:
        """What the registered plugins list now (a plugin whose stream ended: nothing)."""
        with self.kubelet.changed:
            lists = {
                name: c.lists[-1]
                for name, c in self.kubelet.state.clients.items()
                if c.lists and not c.ended
            }
        return {
            name: tuple(devices.Device(i, 0, devices.Health(h)) for i, h in listed.items())
            for name, listed in lists.items()
        }

    def _admit(self, client: lightkube.Client) -> None:
        docs = client.list(Pod, namespace=self.namespace, fields={"spec.nodeName": self.node})
        pods: list[boundpods.BoundPod] = []
        raw: dict[str, dict[str, Any]] = {}
        for doc in docs:
            d = doc.to_dict()
            meta = d.get("metadata") or {}
            raw[f"{meta.get('namespace', '')}/{meta.get('name', '')}"] = d
            try:
                pod = boundpods.bound_pod(d)
            except errors.MigpilotError as e:
                self.errors.append(str(e))
                continue
            if pod is not None:
                pods.append(_asking(pod))
        self.started &= raw.keys()
        pods.sort(key=lambda p: p.order)
        live = {p.key for p in pods}
        for key in sorted(self.picked.keys() - live):
            namespace, name = key.split("/", 1)
            self.kubelet.release(namespace, name)
            del self.picked[key]
            self._record(checks.Released(time.time(), self.node, key))
        offered = self._offered()
        wanted = standin.assign(pods, advertised=offered, reserved={}, previous=self.picked)
        for pod in pods:
            if pod.key in self.picked or not wanted.get(pod.key):
                continue  # a kubelet never changes a started pod's devices
            self._allocate(pod, wanted[pod.key], offered)
        asking = {p.key for p in pods}
        for key, d in sorted(raw.items()):
            # Started once all it asks for is allocated (a pod asking for no device at once).
            if key in self.started or (key in asking and key not in self.picked):
                continue
            if (d.get("status") or {}).get("phase", "Pending") == "Pending":
                namespace, name = key.split("/", 1)
                client.patch(
                    Pod.Status,
                    name,
                    running_status(d, now=datetime.datetime.now(datetime.UTC)),
                    namespace=namespace,
                    patch_type=PatchType.MERGE,
                )
            self.started.add(key)

    def _allocate(
        self,
        pod: boundpods.BoundPod,
        picks: tuple[str, ...],
        offered: Mapping[str, tuple[devices.Device, ...]],
    ) -> None:
        """Allocate ``picks`` for ``pod``, resource by resource; all or nothing."""
        grants: list[tuple[str, list[str]]] = []
        visible: list[str] = []
        for resource, _count in pod.requests:
            ids = {d.id for d in offered.get(resource, ())}
            mine = [u for u in picks if u in ids]
            try:
                response = self.kubelet.allocate(resource, mine)
            except (grpc.RpcError, KeyError):  # the plugin restarting; tried again next poll
                self.allocate_failures += 1
                return
            grants.append((resource, mine))
            visible += _visible(response) if resource == GPU else mine
        for resource, mine in grants:
            self.kubelet.assign(pod.namespace, pod.name, resource, mine)
        self.picked[pod.key] = picks
        self._record(checks.Assigned(time.time(), self.node, pod.key, tuple(visible)))

    def _sync_status(self, client: lightkube.Client) -> None:
        """The registered resources' counts into the Node (capacity: every device;
        allocatable: the healthy ones), as the kubelet's node-status sync writes them."""
        with self.kubelet.changed:
            clients = self.kubelet.state.clients.items()
            lists = {n: dict(c.lists[-1]) for n, c in clients if c.lists}
            gone = [n for n, c in clients if c.lists and c.ended]
        if not lists:
            return
        capacity = {n: str(len(v)) for n, v in lists.items()}
        allocatable = {n: str(sum(h == "Healthy" for h in v.values())) for n, v in lists.items()}
        # A plugin gone (its agent killed, not registered again yet) has nothing to hand out.
        allocatable |= dict.fromkeys(gone, "0")
        client.patch(
            Node.Status,
            self.node,
            {"status": {"capacity": capacity, "allocatable": allocatable}},
            patch_type=PatchType.MERGE,
        )
