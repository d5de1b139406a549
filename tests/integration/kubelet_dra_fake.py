"""A fake kubelet's DRA side: its plugin watcher's registration and its DRA manager's calls.

It does with real gRPC clients on unix sockets what the v1.37 kubelet does with a DRA driver's
kubelet plugin (pkg/kubelet/pluginmanager and pkg/kubelet/cm/dra in k8s.io/kubernetes v1.37.2):
finds ``*.sock`` files in the plugins_registry folder; dials one, calls ``GetInfo``, checks the
plugin type is ``DRAPlugin``, picks the first of the plugin's supported services the kubelet
speaks (``v1.DRAPlugin``, ``v1beta1.DRAPlugin``), and answers ``NotifyRegistrationStatus`` (a
refusal with its reason when it cannot use the plugin); then calls ``NodePrepareResources`` and
``NodeUnprepareResources`` on the endpoint through the generated stubs, refusing an answer for a
claim it did not ask about or one that leaves a claim out, as the kubelet does.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import grpc

from migpilot.agent.kubeletapi.dra.v1 import api_pb2 as dra
from migpilot.agent.kubeletapi.dra.v1 import api_pb2_grpc as dra_grpc
from migpilot.agent.kubeletapi.pluginregistration.v1 import api_pb2 as reg
from migpilot.agent.kubeletapi.pluginregistration.v1 import api_pb2_grpc as reg_grpc

WAIT_S = 10.0
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
"""What the v1.37 kubelet speaks, newest first (servicesSupportedByKubelet)."""


class KubeletError(AssertionError):
    """Something the real kubelet would refuse."""


@dataclass(frozen=True)
class Registered:
    """A plugin the fake kubelet registered."""

    name: str
    endpoint: pathlib.Path
    service: str


@dataclass(frozen=True)
class Prepared:
    """One claim's prepared device, as the kubelet records it."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]
    share_id: str | None


class FakeDraKubelet:
    """The plugin watcher of ``registry_dir`` and the DRA manager's client of one driver."""

    def __init__(self, registry_dir: pathlib.Path) -> None:
        self.registry_dir = registry_dir
        self.plugin: Registered | None = None

    def sockets(self) -> list[pathlib.Path]:
        """The registration sockets the plugin watcher would find."""
        return sorted(p for p in self.registry_dir.glob("*.sock") if p.is_socket())

    def register(self, socket: pathlib.Path, *, refuse: str = "") -> Registered | None:
        """Register the plugin behind ``socket``; ``refuse`` makes the kubelet refuse it with
        that reason (as when validation fails). Returns the registration, ``None`` if refused."""
        with grpc.insecure_channel(f"unix://{socket}") as channel:
            grpc.channel_ready_future(channel).result(timeout=WAIT_S)
            stub = reg_grpc.RegistrationStub(channel)
            info = stub.GetInfo(reg.InfoRequest(), timeout=WAIT_S)
            reason = refuse or self._invalid(info)
            if reason:
                stub.NotifyRegistrationStatus(
                    reg.RegistrationStatus(plugin_registered=False, error=reason), timeout=WAIT_S
                )
                return None
            service = next(s for s in info.supported_versions if s in KUBELET_SERVICES)
            endpoint = pathlib.Path(info.endpoint or str(socket))
            self.plugin = Registered(info.name, endpoint, service)
            stub.NotifyRegistrationStatus(
                reg.RegistrationStatus(plugin_registered=True), timeout=WAIT_S
            )
            return self.plugin

    @staticmethod
    def _invalid(info: reg.PluginInfo) -> str:
        if info.type != "DRAPlugin":
            return f"no handler registered for plugin type: {info.type}"
        if not info.name:
            return "empty driver name"
        if not any(s in KUBELET_SERVICES for s in info.supported_versions):
            return f"none of services {list(info.supported_versions)} are supported"
        return ""

    def _stub(self) -> tuple[grpc.Channel, dra_grpc.DRAPluginStub]:
        if self.plugin is None:
            raise KubeletError("no DRA plugin registered")
        if self.plugin.service != "v1.DRAPlugin":
            raise KubeletError(f"the fake speaks only v1, the plugin chose {self.plugin.service}")
        channel = grpc.insecure_channel(f"unix://{self.plugin.endpoint}")
        return channel, dra_grpc.DRAPluginStub(channel)

    def prepare(
        self, claims: Sequence[tuple[str, str, str]]
    ) -> dict[str, tuple[Prepared, ...] | str]:
        """NodePrepareResources of (namespace, name, uid) claims: per UID the devices, or the
        claim's error string."""
        request = dra.NodePrepareResourcesRequest(claims=[_claim(c) for c in claims])
        channel, stub = self._stub()
        with channel:
            response = stub.NodePrepareResources(request, timeout=WAIT_S)
        _check_keys(response.claims, claims, "NodePrepareResources")
        answers: dict[str, tuple[Prepared, ...] | str] = {}
        for uid, result in response.claims.items():
            if result.error:
                answers[uid] = result.error
                continue
            answers[uid] = tuple(
                Prepared(
                    requests=tuple(d.request_names),
                    pool=d.pool_name,
                    device=d.device_name,
                    cdi_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id if d.HasField("share_id") else None,
                )
                for d in result.devices
            )
        return answers

    def unprepare(self, claims: Sequence[tuple[str, str, str]]) -> dict[str, str]:
        """NodeUnprepareResources: per UID the error string, empty on success."""
        request = dra.NodeUnprepareResourcesRequest(claims=[_claim(c) for c in claims])
        channel, stub = self._stub()
        with channel:
            response = stub.NodeUnprepareResources(request, timeout=WAIT_S)
        _check_keys(response.claims, claims, "NodeUnprepareResources")
        return {uid: result.error for uid, result in response.claims.items()}


def _claim(claim: tuple[str, str, str]) -> dra.Claim:
    namespace, name, uid = claim
    return dra.Claim(namespace=namespace, name=name, uid=uid)


def _check_keys(answered: Iterable[str], claims: Sequence[tuple[str, str, str]], call: str) -> None:
    asked = {uid for _, _, uid in claims}
    got = set(answered)
    if got - asked:
        raise KubeletError(f"{call} returned result for unknown claim UID {sorted(got - asked)}")
    if asked - got:
        raise KubeletError(f"{call} skipped {len(asked - got)} ResourceClaims")
