"""The kubelet PodResources client: which of our devices the kubelet has given to pods.

``List`` on the kubelet's pod-resources socket returns every container's devices per resource.
:class:`KubeletInUse` turns that, together with the devices this plugin's Allocate handed out
and the kubelet has not yet listed, into the set of in-use device UUIDs the reconciler must not
destroy. When the kubelet cannot be asked, :class:`PodResourcesError` is raised: the caller
must then treat every device as in use. With ``serving``, the only module that talks to the
kubelet.
"""

from __future__ import annotations

import pathlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from migpilot.agent.deviceplugin import devices, serving
from migpilot.agent.kubeletapi.podresources.v1 import api_pb2, api_pb2_grpc
from migpilot.sharing import replicas

DEFAULT_SOCKET = pathlib.Path("/var/lib/kubelet/pod-resources/kubelet.sock")


class PodResourcesError(RuntimeError):
    """The kubelet's PodResources API could not be asked (kubelet down, socket missing)."""


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    """The devices of one resource the kubelet assigned to one container."""

    namespace: str
    pod: str
    container: str
    resource_name: str
    device_ids: tuple[str, ...]


def is_nvidia_resource(name: str) -> bool:
    """True for the resources this plugin advertises (``nvidia.com/gpu``, ``nvidia.com/mig-*``,
    and the shared ones renamed under ``nvidia.com/``: ``nvidia.com/gpu.shared``)."""
    return name.startswith(f"{devices.RESOURCE_DOMAIN}/")


class PodResourcesClient:
    """A client of ``PodResourcesLister.List`` on a unix socket. Thread-safe."""

    def __init__(self, socket_path: pathlib.Path = DEFAULT_SOCKET, *, timeout_s: float = 5.0):
        self._target = f"unix://{socket_path}"
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._channel: Any = None

    def list(self) -> tuple[ContainerDevices, ...]:
        """Every container's devices, as the kubelet lists them now."""
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(self._target)
            channel = self._channel
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = stub.List(
                api_pb2.ListPodResourcesRequest(), timeout=self._timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as err:
            # A fresh channel next time: a restarted kubelet is a new socket.
            self.close()
            raise PodResourcesError(
                f"kubelet PodResources List on {self._target} failed: {err.code().name}"
            ) from err
        return tuple(
            ContainerDevices(
                namespace=pod.namespace,
                pod=pod.name,
                container=container.name,
                resource_name=dev.resource_name,
                device_ids=tuple(dev.device_ids),
            )
            for pod in response.pod_resources
            for container in pod.containers
            for dev in container.devices
        )

    def allocatable(self) -> dict[str, frozenset[str]]:
        """The device IDs per resource the kubelet's device manager can hand out now
        (``GetAllocatableResources``: healthy devices of registered plugins). Raise
        :class:`PodResourcesError` (``UNIMPLEMENTED`` on kubelets before 1.23 or with the
        feature off)."""
        with self._lock:
            if self._channel is None:
                self._channel = grpc.insecure_channel(self._target)
            channel = self._channel
        stub = api_pb2_grpc.PodResourcesListerStub(channel)
        try:
            response = stub.GetAllocatableResources(
                api_pb2.AllocatableResourcesRequest(), timeout=self._timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as err:
            self.close()
            raise PodResourcesError(
                f"kubelet PodResources GetAllocatableResources on {self._target} failed: "
                f"{err.code().name}"
            ) from err
        out: dict[str, set[str]] = {}
        for dev in response.devices:
            out.setdefault(dev.resource_name, set()).update(dev.device_ids)
        return {name: frozenset(ids) for name, ids in out.items()}

    def allocated_device_ids(
        self, *, resource_filter: Callable[[str], bool] = is_nvidia_resource
    ) -> frozenset[str]:
        """The IDs of devices of the matching resources that the kubelet assigned to pods (a
        replica ``<uuid>::<n>`` counts as its device, ``<uuid>``, and as itself: the GpuLayout
        reports time-slicing replicas one by one; an MPS slice ``<uuid>::mps-<id>`` as itself
        and its GPU)."""
        return in_use_ids(self.list(), resource_filter=resource_filter)

    def close(self) -> None:
        """Close the channel (a later call opens a new one)."""
        with self._lock:
            channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()


def in_use_ids(
    listed: Sequence[ContainerDevices],
    *,
    resource_filter: Callable[[str], bool] = is_nvidia_resource,
) -> frozenset[str]:
    """The in-use IDs of a PodResources listing
    (:meth:`PodResourcesClient.allocated_device_ids`)."""
    out: set[str] = set()
    for entry in listed:
        if not resource_filter(entry.resource_name):
            continue
        for device_id in entry.device_ids:
            out.add(replicas.real_id(device_id))
            if replicas.is_replica(device_id):  # an MPS slice or a time-slicing replica
                out.add(device_id)
    return frozenset(out)


def slice_holders(listed: Sequence[ContainerDevices]) -> dict[str, str]:
    """MPS slice device ID -> ``namespace/name`` of the pod the kubelet gave it to."""
    return {
        device_id: f"{entry.namespace}/{entry.pod}"
        for entry in listed
        for device_id in entry.device_ids
        if devices.is_slice_id(device_id)
    }


class KubeletInUse:
    """In-use devices: what the kubelet assigned, plus what Allocate handed out and it has not
    listed yet (the reconciler's ``InUse`` source for the kubelet)."""

    def __init__(
        self, client: PodResourcesClient, plugin: serving.DevicePlugin | None = None
    ) -> None:
        self._client = client
        self._plugin = plugin
        self._holders: dict[str, str] = {}
        self._lock = threading.Lock()

    def in_use(self) -> frozenset[str]:
        """The current set of in-use device UUIDs; :class:`PodResourcesError` if unknown."""
        entries = self._client.list()
        listed = in_use_ids(entries)
        holders = slice_holders(entries)
        with self._lock:
            self._holders = holders
        if self._plugin is None:
            return listed
        self._plugin.observe_kubelet(listed)
        return listed | self._plugin.handed_out()

    def holders(self) -> dict[str, str]:
        """MPS slice device ID -> the pod holding it, as the last :meth:`in_use` listed."""
        with self._lock:
            return dict(self._holders)
