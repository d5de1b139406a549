"""A fake kubelet made of real gRPC servers and clients on unix sockets.

It does what the kubelet's device manager does with a device plugin: serves ``Registration`` on
``<dir>/device-plugins/kubelet.sock``; on ``Register`` checks the version, dials the plugin's
socket and keeps a ``ListAndWatch`` stream open, remembering the latest device list per
resource; calls ``Allocate`` and ``GetPreferredAllocation`` when a test asks; serves
``PodResourcesLister.List`` on ``<dir>/pod-resources/kubelet.sock`` from assignments a test
sets, and ``GetAllocatableResources`` from the device lists ListAndWatch brought (the healthy
devices, each list shown ``allocatable_delay_s`` after it arrived). The soak bench's device
manager (``bench/soak_kubelet.py``) drives it as a kubelet would, and takes its PodResources
socket away for a while (:meth:`FakeKubelet.stop_pod_resources`). :meth:`FakeKubelet.restart`
behaves like a kubelet restart: the registration socket is recreated and the other sockets in
the device-plugin folder are removed. Tests wait on conditions (with timeouts), never on
sleeps.
"""

from __future__ import annotations

import concurrent.futures
import pathlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from migpilot.agent.kubeletapi.deviceplugin.v1beta1 import api_pb2 as dp
from migpilot.agent.kubeletapi.deviceplugin.v1beta1 import api_pb2_grpc as dp_grpc
from migpilot.agent.kubeletapi.podresources.v1 import api_pb2 as pr
from migpilot.agent.kubeletapi.podresources.v1 import api_pb2_grpc as pr_grpc

WAIT_S = 10.0


@dataclass
class Registration:
    """One Register call as the kubelet received it."""

    resource: str
    endpoint: str
    version: str
    preferred_allocation: bool


class PluginClient:
    """The kubelet's client of one registered plugin: a ListAndWatch stream and unary calls."""

    def __init__(self, resource: str, socket: pathlib.Path, changed: threading.Condition):
        self.resource = resource
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        grpc.channel_ready_future(self.channel).result(timeout=WAIT_S)
        self.stub = dp_grpc.DevicePluginStub(self.channel)
        self.lists: list[dict[str, str]] = []
        self.received: list[float] = []
        """When each list arrived (monotonic seconds)."""
        self.ended = False
        self._changed = changed
        self._stream = self.stub.ListAndWatch(dp.Empty())
        self._thread = threading.Thread(target=self._consume, daemon=True)
        self._thread.start()

    def _consume(self) -> None:
        try:
            for response in self._stream:
                with self._changed:
                    self.lists.append({d.ID: d.health for d in response.devices})
                    self.received.append(time.monotonic())
                    self._changed.notify_all()
        except grpc.RpcError:
            pass
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    def close(self) -> None:
        self._stream.cancel()
        self.channel.close()
        self._thread.join(timeout=WAIT_S)


@dataclass
class _State:
    registrations: list[Registration] = field(default_factory=list)
    clients: dict[str, PluginClient] = field(default_factory=dict)
    pods: list[tuple[str, str, str, str, tuple[str, ...]]] = field(default_factory=list)
    allocatable_delay_s: float = 0.0
    """How long a device list takes to show in GetAllocatableResources (the device manager's
    lag behind ListAndWatch)."""
    allocatable_unimplemented: bool = False
    """Answer GetAllocatableResources with UNIMPLEMENTED, as kubelets before 1.23 do."""


class FakeKubelet:
    """Registration server, plugin clients and PodResources server in ``root``."""

    def __init__(self, root: pathlib.Path) -> None:
        self.plugin_dir = root / "device-plugins"
        self.pod_resources_socket = root / "pod-resources" / "kubelet.sock"
        self.plugin_dir.mkdir(parents=True, exist_ok=True)
        self.pod_resources_socket.parent.mkdir(parents=True, exist_ok=True)
        self.changed = threading.Condition()
        self.state = _State()
        self._registration: Any = None
        self._pod_resources: Any = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> FakeKubelet:
        self._start_registration()
        self.start_pod_resources()
        return self

    def start_pod_resources(self) -> None:
        """Serve PodResources on its socket (again, after :meth:`stop_pod_resources`)."""
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        pr_grpc.add_PodResourcesListerServicer_to_server(_PodResources(self), server)
        server.add_insecure_port(f"unix://{self.pod_resources_socket}")
        server.start()
        self._pod_resources = server

    def stop_pod_resources(self) -> None:
        """Take the PodResources socket away (the server stopped, the socket file removed),
        as when the kubelet's PodResources endpoint is down; the device manager goes on."""
        if self._pod_resources is not None:
            self._pod_resources.stop(grace=None).wait()
            self._pod_resources = None
        self.pod_resources_socket.unlink(missing_ok=True)

    def _start_registration(self) -> None:
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=4))
        dp_grpc.add_RegistrationServicer_to_server(_Registration(self), server)
        server.add_insecure_port(f"unix://{self.plugin_dir / 'kubelet.sock'}")
        server.start()
        self._registration = server

    def _stop_registration(self) -> None:
        if self._registration is not None:
            self._registration.stop(grace=None).wait()
            self._registration = None
        with self.changed:
            clients = list(self.state.clients.values())
            self.state.clients.clear()
        for client in clients:
            client.close()

    def restart(self, *, remove_plugin_sockets: bool = True) -> None:
        """Stop, remove the sockets in the device-plugin folder (as kubelet does), start."""
        self._stop_registration()
        for path in self.plugin_dir.iterdir():
            if remove_plugin_sockets or path.name == "kubelet.sock":
                path.unlink()
        with self.changed:
            self.state.registrations.clear()
        self._start_registration()

    def stop(self, *, pod_resources: bool = True) -> None:
        self._stop_registration()
        (self.plugin_dir / "kubelet.sock").unlink(missing_ok=True)
        if pod_resources and self._pod_resources is not None:
            self._pod_resources.stop(grace=None).wait()
            self._pod_resources = None

    # -- what tests ask ----------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[_State], bool], what: str) -> None:
        with self.changed:
            if not self.changed.wait_for(lambda: predicate(self.state), timeout=WAIT_S):
                raise AssertionError(f"timed out waiting for {what}")

    def wait_registered(self, *resources: str) -> None:
        self.wait_for(
            lambda s: (
                set(resources) <= {r.resource for r in s.registrations}
                and set(resources) <= set(s.clients)
                and all(s.clients[r].lists for r in resources)
            ),
            f"registration of {resources}",
        )

    def wait_devices(self, resource: str, expected: dict[str, str]) -> None:
        def ok(s: _State) -> bool:
            client = s.clients.get(resource)
            return client is not None and bool(client.lists) and client.lists[-1] == expected

        self.wait_for(ok, f"{resource} to list {expected}")

    def devices(self, resource: str) -> dict[str, str]:
        with self.changed:
            return dict(self.state.clients[resource].lists[-1])

    def client(self, resource: str) -> PluginClient:
        with self.changed:
            return self.state.clients[resource]

    def registrations(self, resource: str) -> int:
        with self.changed:
            return sum(1 for r in self.state.registrations if r.resource == resource)

    def allocate(self, resource: str, *containers: list[str]) -> Any:
        request = dp.AllocateRequest(
            container_requests=[dp.ContainerAllocateRequest(devices_ids=c) for c in containers]
        )
        return self.client(resource).stub.Allocate(request, timeout=WAIT_S)

    def preferred(
        self, resource: str, *, available: list[str], must_include: list[str], size: int
    ) -> list[str]:
        request = dp.PreferredAllocationRequest(
            container_requests=[
                dp.ContainerPreferredAllocationRequest(
                    available_deviceIDs=available,
                    must_include_deviceIDs=must_include,
                    allocation_size=size,
                )
            ]
        )
        response = self.client(resource).stub.GetPreferredAllocation(request, timeout=WAIT_S)
        return list(response.container_responses[0].deviceIDs)

    def assign(self, namespace: str, pod: str, resource: str, device_ids: list[str]) -> None:
        """The kubelet gave these devices to a pod (PodResources lists them)."""
        with self.changed:
            self.state.pods.append((namespace, pod, "main", resource, tuple(device_ids)))

    def release(self, namespace: str, pod: str) -> None:
        """The pod is gone: PodResources no longer lists its devices."""
        with self.changed:
            self.state.pods[:] = [e for e in self.state.pods if (e[0], e[1]) != (namespace, pod)]

    def release_all(self) -> None:
        with self.changed:
            self.state.pods.clear()


class _Registration(dp_grpc.RegistrationServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    def Register(self, request: Any, context: Any) -> Any:
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unsupported {request.version}")
        socket = self._kubelet.plugin_dir / request.endpoint
        client = PluginClient(request.resource_name, socket, self._kubelet.changed)
        with self._kubelet.changed:
            old = self._kubelet.state.clients.get(request.resource_name)
            self._kubelet.state.clients[request.resource_name] = client
            self._kubelet.state.registrations.append(
                Registration(
                    resource=request.resource_name,
                    endpoint=request.endpoint,
                    version=request.version,
                    preferred_allocation=request.options.get_preferred_allocation_available,
                )
            )
            self._kubelet.changed.notify_all()
        if old is not None:
            old.close()
        return dp.Empty()


class _PodResources(pr_grpc.PodResourcesListerServicer):
    def __init__(self, kubelet: FakeKubelet) -> None:
        self._kubelet = kubelet

    def GetAllocatableResources(self, request: Any, context: Any) -> Any:
        state = self._kubelet.state
        if state.allocatable_unimplemented:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "GetAllocatableResources is off")
        now = time.monotonic()
        devices = []
        with self._kubelet.changed:
            for name, client in state.clients.items():
                shown = [
                    lst
                    for lst, at in zip(client.lists, client.received, strict=True)
                    if now - at >= state.allocatable_delay_s
                ]
                if shown:
                    ids = [i for i, health in shown[-1].items() if health == "Healthy"]
                    devices.append(pr.ContainerDevices(resource_name=name, device_ids=ids))
        return pr.AllocatableResourcesResponse(devices=devices)

    def List(self, request: Any, context: Any) -> Any:
        with self._kubelet.changed:
            pods = list(self._kubelet.state.pods)
        return pr.ListPodResourcesResponse(
            pod_resources=[
                pr.PodResources(
                    name=pod,
                    namespace=ns,
                    containers=[
                        pr.ContainerResources(
                            name=container,
                            devices=[pr.ContainerDevices(resource_name=res, device_ids=ids)],
                        )
                    ],
                )
                for ns, pod, container, res, ids in pods
            ]
        )
