"""The DRA kubelet plugin's gRPC shell: the registration socket and the DRA service socket.

Why it exists: the kubelet finds a DRA driver through its plugin watcher, which dials every
socket in ``/var/lib/kubelet/plugins_registry``, calls ``Registration.GetInfo`` and answers with
``NotifyRegistrationStatus``. The plugin says there that it is a ``DRAPlugin`` named after the
driver (``mig.migpilot.io``), serving ``v1.DRAPlugin`` (the kubelet's DRA v1 API; the v1.37
kubelet takes the first service in this list that it also speaks, and speaks v1 and v1beta1) on
``/var/lib/kubelet/plugins/<driver>/dra.sock``. The kubelet then calls NodePrepareResources
before a pod with a claim of this driver starts, and NodeUnprepareResources after the last one
ends.

This module only decodes, calls the sans-IO :class:`preparing.Preparer` (one call at a time, so
two pods of one claim cannot race to create its instance) and encodes. The DRA socket is served
before the registration socket appears, so the kubelet never dials an endpoint that is not yet
there; on stop the registration socket goes first, so the kubelet deregisters the plugin before
its endpoint disappears.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pathlib
import threading
from dataclasses import dataclass
from typing import Any

import grpc

from migpilot.agent.dra import claims, placements, preparing
from migpilot.agent.kubeletapi.dra.v1 import api_pb2 as dra_pb2
from migpilot.agent.kubeletapi.dra.v1 import api_pb2_grpc as dra_grpc
from migpilot.agent.kubeletapi.pluginregistration.v1 import api_pb2 as reg_pb2
from migpilot.agent.kubeletapi.pluginregistration.v1 import api_pb2_grpc as reg_grpc

PLUGIN_TYPE = "DRAPlugin"
"""The plugin kind the kubelet's DRA handler registers (pluginregistration's ``DRAPlugin``)."""
DRA_SERVICE = "v1.DRAPlugin"
"""The DRA service this plugin serves, as registration names it (``<package end>.<service>``)."""
DEFAULT_PLUGINS_DIR = pathlib.Path("/var/lib/kubelet/plugins")
DEFAULT_REGISTRY_DIR = pathlib.Path("/var/lib/kubelet/plugins_registry")

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PluginSettings:
    """Where the kubelet plugin puts its sockets, and under which driver name."""

    driver: str = placements.DRIVER
    plugins_dir: pathlib.Path = DEFAULT_PLUGINS_DIR
    """The kubelet's plugins folder; the DRA socket is ``<driver>/dra.sock`` in it."""
    registry_dir: pathlib.Path = DEFAULT_REGISTRY_DIR
    """The folder the kubelet's plugin watcher watches; the socket is ``<driver>-reg.sock``."""
    max_workers: int = 4
    """gRPC worker threads per server."""

    @property
    def dra_socket(self) -> pathlib.Path:
        """The DRA service's socket, the endpoint registration announces."""
        return self.plugins_dir / self.driver / "dra.sock"

    @property
    def registration_socket(self) -> pathlib.Path:
        """The registration socket the kubelet's plugin watcher finds."""
        return self.registry_dir / f"{self.driver}-reg.sock"


def _refs(request: Any) -> list[claims.ClaimRef]:
    return [claims.ClaimRef(namespace=c.namespace, name=c.name, uid=c.uid) for c in request.claims]


def _device(device: preparing.PreparedDevice) -> dra_pb2.Device:
    encoded = dra_pb2.Device(
        request_names=list(device.requests),
        pool_name=device.pool,
        device_name=device.device,
        cdi_device_ids=list(device.cdi_ids),
    )
    if device.share_id is not None:
        encoded.share_id = device.share_id
    return encoded


class _DraServicer(dra_grpc.DRAPluginServicer):  # type: ignore[misc]
    def __init__(self, plugin: KubeletPlugin) -> None:
        self._plugin = plugin

    def NodePrepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        refs = _refs(request)
        with self._plugin.lock:
            try:
                results = self._plugin.preparer.prepare(refs)
            except Exception as err:  # a bug or an unexpected backend failure: the call fails
                _log.exception("NodePrepareResources of %d claims failed", len(refs))
                context.abort(grpc.StatusCode.INTERNAL, f"NodePrepareResources: {err}")
                raise  # unreachable: abort raises
        response = dra_pb2.NodePrepareResourcesResponse()
        for uid, result in results.items():
            response.claims[uid].CopyFrom(
                dra_pb2.NodePrepareResourceResponse(
                    devices=[_device(d) for d in result.devices], error=result.error
                )
            )
            if result.error:
                _log.warning("NodePrepareResources: %s", result.error)
        return response

    def NodeUnprepareResources(self, request: Any, context: Any) -> Any:  # noqa: N802
        refs = _refs(request)
        with self._plugin.lock:
            try:
                results = self._plugin.preparer.unprepare(refs)
            except Exception as err:  # as above
                _log.exception("NodeUnprepareResources of %d claims failed", len(refs))
                context.abort(grpc.StatusCode.INTERNAL, f"NodeUnprepareResources: {err}")
                raise
        response = dra_pb2.NodeUnprepareResourcesResponse()
        for uid, error in results.items():
            response.claims[uid].CopyFrom(dra_pb2.NodeUnprepareResourceResponse(error=error))
            if error:
                _log.warning("NodeUnprepareResources: %s", error)
        return response


class _RegistrationServicer(reg_grpc.RegistrationServicer):  # type: ignore[misc]
    def __init__(self, plugin: KubeletPlugin) -> None:
        self._plugin = plugin

    def GetInfo(self, request: Any, context: Any) -> Any:  # noqa: N802
        settings = self._plugin.settings
        return reg_pb2.PluginInfo(
            type=PLUGIN_TYPE,
            name=settings.driver,
            endpoint=str(settings.dra_socket),
            supported_versions=[DRA_SERVICE],
        )

    def NotifyRegistrationStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._plugin.registration_status(request.plugin_registered, request.error)
        return reg_pb2.RegistrationStatusResponse()


class KubeletPlugin:
    """The two gRPC servers of the DRA kubelet plugin, started and stopped together."""

    def __init__(self, preparer: preparing.Preparer, settings: PluginSettings) -> None:
        self.preparer = preparer
        self.settings = settings
        self.lock = threading.Lock()
        """Serialises prepare and unprepare calls."""
        self.registered = threading.Event()
        """Set while the kubelet's last word on registration was a success."""
        self.registration_error = ""
        """The kubelet's error when it refused the registration, empty otherwise."""
        self._servers: list[tuple[Any, pathlib.Path]] = []
        """The running servers with their sockets, in the order they started."""

    def registration_status(self, registered: bool, error: str) -> None:
        """Record the kubelet's answer to the registration."""
        self.registration_error = "" if registered else error
        if registered:
            self.registered.set()
            _log.info("registered with the kubelet as %s", self.settings.driver)
        else:
            self.registered.clear()
            _log.error(
                "the kubelet refused the registration of %s: %s", self.settings.driver, error
            )

    def start(self) -> None:
        """Serve the DRA socket, then the registration socket the kubelet will find."""
        if self._servers:
            raise RuntimeError("the kubelet plugin is already started")
        try:
            self._serve(
                self.settings.dra_socket,
                dra_grpc.add_DRAPluginServicer_to_server,
                _DraServicer(self),
            )
            self._serve(
                self.settings.registration_socket,
                reg_grpc.add_RegistrationServicer_to_server,
                _RegistrationServicer(self),
            )
        except BaseException:
            self.stop()  # the DRA socket must not outlive a registration that never came up
            raise
        _log.info(
            "DRA plugin %s on %s, registration on %s",
            self.settings.driver,
            self.settings.dra_socket,
            self.settings.registration_socket,
        )

    def _serve(self, path: pathlib.Path, add: Any, servicer: Any) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a socket left by an earlier run refuses the bind
        server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=self.settings.max_workers)
        )
        add(servicer, server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        self._servers.append((server, path))

    def stop(self) -> None:
        """Stop serving, the last socket started first (registration, then DRA): the kubelet
        deregisters the plugin before its endpoint goes. Both socket files are removed."""
        servers, self._servers = self._servers, []
        for server, path in reversed(servers):
            server.stop(grace=None).wait()
            path.unlink(missing_ok=True)
        self.registered.clear()
