"""migpilot's own processes on a real control plane: webhook, controller, agents.

The end-to-end tests and the controller benchmark start the same processes the same way (each
`python -m migpilot ...`, a log file each, stopped with SIGTERM and waited for). The webhook is
registered with the apiserver (a MutatingWebhookConfiguration pointing at its loopback port,
TLS from a test CA); the agents run emulated GPUs with the stand-in kubelet on KWOK nodes, one
process per node, or all in one ``migpilot fleet`` process for nodes labelled for it.
"""

from __future__ import annotations

import contextlib
import http.client
import ssl
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import lightkube
from lightkube import codecs
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import MutatingWebhookConfiguration
from lightkube.resources.core_v1 import Namespace, Node

from migpilot.webhook import registering
from tests.kube import certs, controlplane, crds

REPO = Path(__file__).resolve().parents[2]
FLEET_LABEL = "migpilot.io/emulated-gpus"
"""The Node label the fleet selects its nodes by, naming their emulated GPUs."""


def _healthy(port: int, ca: Path) -> bool:
    conn = http.client.HTTPSConnection(
        "127.0.0.1", port, context=ssl.create_default_context(cafile=ca), timeout=2
    )
    try:
        conn.request("GET", "/healthz")
        return conn.getresponse().read() == b"ok"
    except OSError:
        return False
    finally:
        conn.close()


@dataclass
class System:
    """The migpilot processes of one test or benchmark run, and the names they use."""

    plane: controlplane.ControlPlane
    root: Path
    lease_ns: str = field(default_factory=lambda: f"migpilot-{uuid.uuid4().hex[:6]}")
    agents: dict[str, controlplane.Component] = field(default_factory=dict)
    controllers: dict[str, controlplane.Component] = field(default_factory=dict)
    webhook: controlplane.Component | None = None
    fleet: controlplane.Component | None = None
    webhook_config: str | None = None
    webhook_port: int | None = None
    """The loopback port the webhook serves on (None: not started)."""
    webhook_ca: Path | None = None
    """The CA certificate the webhook's serving certificate is checked against."""
    nodes: list[str] = field(default_factory=list)
    metrics: bool = False
    """Whether the controllers, agents, fleet and webhook serve ``/metrics`` (each on a free
    loopback port, in :attr:`metrics_ports`); off, they serve none."""
    metrics_ports: dict[str, int] = field(default_factory=dict)
    """Process name (``controller-c1``, ``agent-ctl-a100``, ``fleet``, ``webhook``) -> its
    metrics port, for :func:`tests.kube.prometheus.targets_of`."""

    @property
    def client(self) -> lightkube.Client:
        return self.plane.client

    def components(self) -> list[controlplane.Component]:
        out = [*self.agents.values(), *self.controllers.values()]
        return out + [c for c in (self.webhook, self.fleet) if c is not None]

    def _metrics_args(self, name: str) -> list[str]:
        """``--metrics-port`` for the process ``name``: a free port when :attr:`metrics`
        (recorded in :attr:`metrics_ports`), else 0 (none)."""
        if not self.metrics:
            return ["--metrics-port", "0"]
        [port] = controlplane.free_ports(1)
        self.metrics_ports[name] = port
        return ["--metrics-port", str(port)]

    def prepare(self) -> None:
        """The GpuLayout CRD and the Lease's namespace."""
        crds.ensure_gpulayouts(self.plane)
        self.client.create(Namespace(metadata=ObjectMeta(name=self.lease_ns)))

    def start_webhook(self) -> None:
        """Serve the webhook on a loopback port and register it with the apiserver (with
        :attr:`metrics`, its metrics on another loopback port, plain HTTP)."""
        ca = certs.CertificateAuthority(self.root)
        pair = ca.issue("webhook", common_name="migpilot-webhook", server_ips=("127.0.0.1",))
        [port] = controlplane.free_ports(1)
        self.webhook = controlplane.launch(
            "migpilot-webhook",
            [
                sys.executable,
                "-m",
                "migpilot",
                "webhook",
                "--cert",
                str(pair.cert),
                "--key",
                str(pair.key),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--kubeconfig",
                str(self.plane.kubeconfig),
                "--lease-namespace",
                self.lease_ns,
                *self._metrics_args("webhook"),
                *(["--metrics-address", controlplane.LOOPBACK] if self.metrics else []),
            ],
            log=self.root / "webhook.log",
            cwd=REPO,
        )
        controlplane.wait_for(
            lambda: _healthy(port, ca.pair.cert), what="the webhook", watch=[self.webhook]
        )
        self.webhook_port, self.webhook_ca = port, ca.pair.cert
        self.webhook_config = f"migpilot-{self.lease_ns}"
        document = registering.configuration(
            ca_bundle=ca.pair.cert.read_bytes(),
            url=f"https://127.0.0.1:{port}/mutate-pods",
            name=self.webhook_config,
        )
        self.client.create(codecs.from_dict(document))

    def stop_webhook(self) -> None:
        """Stop the webhook process (its registration stays: the apiserver fails open)."""
        if self.webhook is not None:
            controlplane.stop_components([self.webhook])
            self.webhook = None
            self.metrics_ports.pop("webhook", None)

    def add_node(
        self,
        name: str,
        backend: str,
        *extra: str,
        labels: dict[str, str] | None = None,
        kubelet: str = "simulated",
    ) -> None:
        """A KWOK node (with ``labels``) and its agent with ``backend``
        (``emulated:a100-80gb:x2``), ``kubelet`` (see :meth:`start_agent`) and ``extra``
        flags."""
        self.plane.add_node(name, labels=labels)
        self.nodes.append(name)
        self.start_agent(name, backend, *extra, kubelet=kubelet)

    def start_agent(self, node: str, backend: str, *extra: str, kubelet: str = "simulated") -> None:
        """``migpilot agent`` for ``node``; ``kubelet`` is its ``--kubelet``: ``simulated``
        (the stand-in), or the folder of a kubelet (the soak bench's fake one) whose
        device-plugin Registration and PodResources sockets it uses."""
        self.agents[node] = controlplane.launch(
            f"agent-{node}",
            [
                sys.executable,
                "-m",
                "migpilot",
                "agent",
                "--node",
                node,
                "--kubeconfig",
                str(self.plane.kubeconfig),
                "--backend",
                backend,
                "--state-file",
                str(self.root / f"{node}.json"),
                "--kubelet",
                kubelet,
                "--interval",
                "5",
                # The controller's Lease: a DRA node lists the plan first only while it is fresh.
                "--lease-namespace",
                self.lease_ns,
                *self._metrics_args(f"agent-{node}"),
                *(["--metrics-address", controlplane.LOOPBACK] if self.metrics else []),
                *extra,
            ],
            log=self.root / f"agent-{node}.log",
            cwd=REPO,
        )

    def add_fleet_node(self, name: str, gpus: str) -> None:
        """A KWOK node labelled for the fleet with its emulated GPUs (``a100-80gb.x2``)."""
        self.plane.add_node(name, labels={FLEET_LABEL: gpus})
        self.nodes.append(name)

    def start_fleet(self, *extra: str) -> None:
        """``migpilot fleet``: one process running the agents of every node labelled
        ``migpilot.io/emulated-gpus`` (:meth:`add_fleet_node`), in memory."""
        self.fleet = controlplane.launch(
            "fleet",
            [
                sys.executable,
                "-m",
                "migpilot",
                "fleet",
                "--kubeconfig",
                str(self.plane.kubeconfig),
                "--kubelet",
                "simulated",
                "--interval",
                "5",
                *self._metrics_args("fleet"),
                *extra,
            ],
            log=self.root / "fleet.log",
            cwd=REPO,
        )

    def start_controller(self, identity: str, *extra: str, verbose: bool = True) -> None:
        """``migpilot controller`` (with debug logs unless ``verbose=False``: benchmarks)."""
        self.controllers[identity] = controlplane.launch(
            f"controller-{identity}",
            [
                sys.executable,
                "-m",
                "migpilot",
                "controller",
                *(["--verbose"] if verbose else []),
                "--kubeconfig",
                str(self.plane.kubeconfig),
                "--identity",
                identity,
                "--lease-namespace",
                self.lease_ns,
                *self._metrics_args(f"controller-{identity}"),
                *extra,
            ],
            log=self.root / f"controller-{identity}.log",
            cwd=REPO,
        )

    def logs(self, limit: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-limit:]}"
            for p in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        """Stop every process and delete what the run made in the cluster."""
        controlplane.stop_components(self.components())
        self.agents.clear()
        self.controllers.clear()
        self.metrics_ports.clear()
        self.webhook = None
        self.fleet = None
        client = self.client
        if self.webhook_config is not None:
            with contextlib.suppress(lightkube.ApiError):
                client.delete(MutatingWebhookConfiguration, self.webhook_config)
        for node in self.nodes:
            for res in (crds.GpuLayout, Node):
                with contextlib.suppress(lightkube.ApiError):
                    client.delete(res, node)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, self.lease_ns)
