"""KEDA and Karpenter's KWOK provider on the test control plane, as child processes.

Both are built by ``scripts/k8s-tools`` (``MIGPILOT_KEDA_BIN``, ``MIGPILOT_KARPENTER_BIN``) and
run here outside any cluster: no pod, no service account, no in-cluster config. What each
needs instead (read from their sources; docs/autoscaling.md has the whole recipe):

- Both take the apiserver from ``KUBECONFIG`` (an admin kubeconfig here). Karpenter parses its
  own flag set and refuses ``--kubeconfig``; KEDA would take it, but one way serves both.
- KEDA's operator and adapter talk gRPC over mutual TLS, reading ``ca.crt``, ``tls.crt`` and
  ``tls.key`` from ``--cert-dir``; a cert from a test CA, valid for 127.0.0.1, serves both
  ends. ``WATCH_NAMESPACE`` must be set (empty: all namespaces), and
  ``KEDA_CLUSTER_OBJECT_NAMESPACE`` too (else the operator reads the service-account namespace
  file of a pod, and exits).
- The adapter is an aggregated API server: it serves TLS on a loopback port with the same cert
  (valid also for ``<service>.<namespace>.svc``, the name the apiserver checks), delegates
  authentication and authorization to the apiserver (``--authentication-kubeconfig``,
  ``--authorization-kubeconfig``; in a pod it would use its service account) and trusts the
  front-proxy cert the control plane's apiserver proxies with. The APIService points at a
  Service of type ExternalName, ``localhost``: the apiserver resolves that by DNS, with no
  kube-proxy and no endpoints.
- Karpenter's KWOK provider: leader election off (``DISABLE_LEADER_ELECTION``), free ports for
  its metrics and health probes (it binds them on every interface), and an instance-types JSON
  (``--instance-types-file-path``) for the GPU nodes it may create. The Nodes it creates carry
  the annotation ``kwok.x-k8s.io/node=fake``, which the control plane's KWOK manages.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightkube
import yaml
from lightkube import codecs
from lightkube.generic_resource import create_global_resource
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apiregistration_v1 import APIService
from lightkube.resources.core_v1 import Namespace, Service

from tests.kube import certs, controlplane
from tests.kube.controlplane import Component, ControlPlane, wait_for

KEDA_NAMESPACE = "keda"
KEDA_SERVICE = "keda-metrics-apiserver"
"""The Service the external-metrics APIService names (KEDA's own name for it)."""
EXTERNAL_METRICS = "v1beta1.external.metrics.k8s.io"
_START_TIMEOUT_S = 90.0

NodePool = create_global_resource("karpenter.sh", "v1", "NodePool", "nodepools")
NodeClaim = create_global_resource("karpenter.sh", "v1", "NodeClaim", "nodeclaims")
KWOKNodeClass = create_global_resource(
    "karpenter.kwok.sh", "v1alpha1", "KWOKNodeClass", "kwoknodeclasses"
)
NodeOverlay = create_global_resource("karpenter.sh", "v1alpha1", "NodeOverlay", "nodeoverlays")


# --- CRDs ------------------------------------------------------------------------------------


def apply_crds(plane: ControlPlane, folder: Path, *, timeout: float = 60.0) -> list[str]:
    """Create every CRD in `folder` unless it exists (409 is fine) and wait until each is
    Established; returns their names."""
    names = []
    for path in sorted(folder.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if not document or document.get("kind") != "CustomResourceDefinition":
                continue
            names.append(document["metadata"]["name"])
            try:
                plane.client.create(codecs.from_dict(document))
            except lightkube.ApiError as e:
                if e.status.code != 409:
                    raise
    if not names:
        raise FileNotFoundError(f"no CustomResourceDefinition in {folder}")

    def established() -> bool:
        for name in names:
            got = plane.client.get(CustomResourceDefinition, name)
            conditions = (got.status.conditions if got.status else None) or []
            if not any(c.type == "Established" and c.status == "True" for c in conditions):
                return False
        return True

    wait_for(established, what=f"the CRDs of {folder} to be Established", timeout=timeout)
    return names


def _ensure_namespace(plane: ControlPlane, name: str) -> None:
    try:
        plane.client.create(Namespace(metadata=ObjectMeta(name=name)))
    except lightkube.ApiError as e:
        if e.status.code != 409:
            raise


# --- KEDA ------------------------------------------------------------------------------------


@dataclass
class Keda:
    """KEDA's operator and metrics adapter, and the APIService that makes the apiserver serve
    ``external.metrics.k8s.io`` from the adapter. Start with :meth:`start`, end with
    :meth:`stop` (or a ``with`` block)."""

    plane: ControlPlane
    root: Path
    operator: Component | None = None
    adapter: Component | None = None
    adapter_port: int = 0
    ports: dict[str, int] = field(default_factory=dict)
    """Loopback ports: ``operator-metrics``, ``operator-health``, ``grpc``,
    ``adapter-metrics`` (the adapter's own /metrics, plain HTTP)."""

    @property
    def components(self) -> list[Component]:
        return [c for c in (self.operator, self.adapter) if c is not None]

    @classmethod
    def start(
        cls,
        plane: ControlPlane,
        *,
        operator: Path,
        adapter: Path,
        crds: Path,
        root: Path,
        timeout: float = _START_TIMEOUT_S,
    ) -> Keda:
        """Apply KEDA's CRDs, start the operator and the adapter, register the adapter's
        APIService and wait until the apiserver serves ``/apis/external.metrics.k8s.io/v1beta1``
        from it."""
        root.mkdir(parents=True, exist_ok=True)
        apply_crds(plane, crds)
        _ensure_namespace(plane, KEDA_NAMESPACE)
        keda = cls(plane=plane, root=root)
        try:
            keda._start(operator, adapter, timeout=timeout)
        except BaseException:
            keda.stop()
            raise
        return keda

    def _start(self, operator: Path, adapter: Path, *, timeout: float) -> None:
        plane, root = self.plane, self.root
        pki = root / "pki"
        pki.mkdir(exist_ok=True)
        ca = certs.CertificateAuthority(pki)  # writes ca.crt, which both ends read
        pair = ca.issue(
            "tls",
            common_name="keda",
            server_names=(
                "localhost",
                f"{KEDA_SERVICE}.{KEDA_NAMESPACE}.svc",
                f"keda-operator.{KEDA_NAMESPACE}.svc",
            ),
            server_ips=(controlplane.LOOPBACK,),
        )
        ports = controlplane.free_ports(5)
        names = ("operator-metrics", "operator-health", "grpc", "adapter-metrics", "adapter")
        self.ports = dict(zip(names[:4], ports[:4], strict=True))
        self.adapter_port = ports[4]
        loop = controlplane.LOOPBACK
        env = {
            "KUBECONFIG": str(plane.kubeconfig),
            "WATCH_NAMESPACE": "",  # all namespaces; unset, both exit
            "POD_NAMESPACE": KEDA_NAMESPACE,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
        }
        self.operator = controlplane.launch(
            "keda-operator",
            [
                str(operator),
                f"--cert-dir={pki}",
                f"--metrics-bind-address={loop}:{self.ports['operator-metrics']}",
                f"--health-probe-bind-address={loop}:{self.ports['operator-health']}",
                f"--metrics-service-bind-address={loop}:{self.ports['grpc']}",
                "--leader-elect=false",
                "--enable-cert-rotation=false",  # the certs are ours, not a Secret's
                "--zap-log-level=info",
            ],
            log=root / "keda-operator.log",
            cwd=root,
            env=env,
        )
        kubeconfig = str(plane.kubeconfig)
        self.adapter = controlplane.launch(
            "keda-adapter",
            [
                str(adapter),
                f"--cert-dir={pki}",
                f"--tls-cert-file={pair.cert}",
                f"--tls-private-key-file={pair.key}",
                f"--bind-address={loop}",
                f"--secure-port={self.adapter_port}",
                f"--port={self.ports['adapter-metrics']}",
                f"--metrics-service-address={loop}:{self.ports['grpc']}",
                f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--zap-log-level=info",
            ],
            log=root / "keda-adapter.log",
            cwd=root,
            env=env,
        )
        self._register(ca.pair.cert)
        wait_for(
            self._served,
            what="the apiserver to serve external.metrics.k8s.io from KEDA's adapter",
            timeout=timeout,
            watch=self.components,
        )

    def _register(self, ca: Path) -> None:
        client = self.plane.client
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": KEDA_SERVICE, "namespace": KEDA_NAMESPACE},
            "spec": {"type": "ExternalName", "externalName": "localhost"},
        }
        api_service = {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": EXTERNAL_METRICS},
            "spec": {
                "group": "external.metrics.k8s.io",
                "version": "v1beta1",
                "groupPriorityMinimum": 100,
                "versionPriority": 100,
                "caBundle": base64.b64encode(ca.read_bytes()).decode(),
                # An ExternalName service is dialled at the APIService's port.
                "service": {
                    "name": KEDA_SERVICE,
                    "namespace": KEDA_NAMESPACE,
                    "port": self.adapter_port,
                },
            },
        }
        for document in (service, api_service):
            client.apply(codecs.from_dict(document), field_manager="migpilot-tests", force=True)

    def _served(self) -> bool:
        got = self.plane.client.get(APIService, EXTERNAL_METRICS)
        conditions = (got.status.conditions if got.status else None) or []
        if not any(c.type == "Available" and c.status == "True" for c in conditions):
            return False
        status, _ = self.plane.get_raw("/apis/external.metrics.k8s.io/v1beta1")
        return status == 200

    def external_metric(self, namespace: str, metric: str, scaled_object: str) -> list[float]:
        """The values the adapter gives for one ScaledObject's metric (``s0-prometheus``, ...)
        through the apiserver, as the HPA controller asks for them."""
        path = (
            f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric}"
            f"?labelSelector=scaledobject.keda.sh%2Fname%3D{scaled_object}"
        )
        status, body = self.plane.get_raw(path)
        if status != 200:
            raise AssertionError(f"GET {path}: {status} {body[:500]!r}")
        items = json.loads(body)["items"]
        return [_quantity(item["value"]) for item in items]

    def stop(self) -> None:
        """Unregister the APIService, then stop both. An APIService left pointing at nothing
        makes discovery of its group fail for the rest of the session (the control plane is
        shared), and clients that discover every group report it (Helm's well-known "could
        not get apiVersions from Kubernetes"). Delete ScaledObjects before: their finalizer
        needs the operator."""
        for kind, name, namespace in (
            (APIService, EXTERNAL_METRICS, None),
            (Service, KEDA_SERVICE, KEDA_NAMESPACE),
        ):
            with contextlib.suppress(lightkube.ApiError):
                self.plane.client.delete(kind, name, namespace=namespace)
        controlplane.stop_components(self.components)
        self.operator = self.adapter = None

    def __enter__(self) -> Keda:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tails(self) -> str:
        return "".join(f"\n--- {c.name} ({c.log}):\n{c.tail()}" for c in self.components)


def _quantity(text: str) -> float:
    """A Kubernetes quantity as the metrics APIs write them (``5``, ``500m``, ``2k``)."""
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    if text and text[-1] in suffixes:
        return float(text[:-1]) * suffixes[text[-1]]
    return float(text)


# --- Karpenter -------------------------------------------------------------------------------


@dataclass(frozen=True)
class InstanceType:
    """One instance type of Karpenter's KWOK provider: what a node of it offers
    (``resources``: cpu, memory, pods and extended resources such as ``nvidia.com/gpu``), and
    its price (one on-demand offering in one zone)."""

    name: str
    resources: Mapping[str, str]
    price: float = 1.0
    zone: str = "test-zone-a"
    capacity_type: str = "on-demand"

    def to_json(self) -> dict[str, Any]:
        """The provider's JSON form (kwok/cloudprovider/helpers.go, InstanceTypeOptions)."""
        requirements = [
            {"key": "karpenter.sh/capacity-type", "operator": "In", "values": [self.capacity_type]},
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": [self.zone]},
        ]
        return {
            "name": self.name,
            "offerings": [{"Price": self.price, "Available": True, "Requirements": requirements}],
            "architecture": "amd64",
            "operatingSystems": ["linux"],
            "resources": dict(self.resources),
        }


def write_instance_types(path: Path, types: Iterable[InstanceType]) -> Path:
    path.write_text(json.dumps([t.to_json() for t in types], indent=2))
    return path


@dataclass
class Karpenter:
    """Karpenter's KWOK provider: a NodeClaim for pods nothing can schedule, a KWOK Node for
    each NodeClaim. Start with :meth:`start`, end with :meth:`stop` (or a ``with`` block)."""

    plane: ControlPlane
    root: Path
    component: Component | None = None
    ports: dict[str, int] = field(default_factory=dict)

    @classmethod
    def start(
        cls,
        plane: ControlPlane,
        *,
        binary: Path,
        crds: Path,
        root: Path,
        instance_types: Sequence[InstanceType],
        env: Mapping[str, str] | None = None,
        timeout: float = _START_TIMEOUT_S,
    ) -> Karpenter:
        """Apply Karpenter's CRDs, start the provider with these instance types and wait until
        it reports ready (its caches synced, its CRDs found). `env` adds or overrides settings
        (``BATCH_IDLE_DURATION``, ``FEATURE_GATES``, ...)."""
        root.mkdir(parents=True, exist_ok=True)
        apply_crds(plane, crds)
        types = write_instance_types(root / "instance-types.json", instance_types)
        metrics, health = controlplane.free_ports(2)
        karpenter = cls(plane=plane, root=root, ports={"metrics": metrics, "health": health})
        karpenter.component = controlplane.launch(
            "karpenter",
            [str(binary), f"--instance-types-file-path={types}"],
            log=root / "karpenter.log",
            cwd=root,
            env={
                "KUBECONFIG": str(plane.kubeconfig),
                "DISABLE_LEADER_ELECTION": "true",
                "METRICS_PORT": str(metrics),
                "HEALTH_PROBE_PORT": str(health),
                "LOG_LEVEL": "info",
                # Seconds matter in a test: a pending pod's batch closes after 1 s idle at most.
                "BATCH_IDLE_DURATION": "500ms",
                "BATCH_MAX_DURATION": "2s",
                **(env or {}),
            },
        )
        try:
            wait_for(
                karpenter._ready,
                what="Karpenter's KWOK provider to be ready",
                timeout=timeout,
                watch=[karpenter.component],
            )
        except BaseException:
            karpenter.stop()
            raise
        return karpenter

    def _ready(self) -> bool:
        connection = http.client.HTTPConnection(
            controlplane.LOOPBACK, self.ports["health"], timeout=2
        )
        try:
            connection.request("GET", "/readyz")
            return connection.getresponse().status == 200
        finally:
            connection.close()

    def stop(self) -> None:
        if self.component is not None:
            controlplane.stop_components([self.component])
            self.component = None

    def __enter__(self) -> Karpenter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def tail(self) -> str:
        return self.component.tail() if self.component is not None else ""


def node_class(name: str = "default") -> Any:
    """A KWOKNodeClass (its Ready condition comes from the CRD's default status)."""
    return KWOKNodeClass(metadata=ObjectMeta(name=name))


def node_pool(
    name: str,
    *,
    instance_types: Sequence[str],
    node_class_name: str = "default",
    consolidate_after: str = "10s",
    labels: Mapping[str, str] | None = None,
    startup_taints: Sequence[Mapping[str, str]] = (),
) -> Any:
    """A NodePool of these instance types, consolidating empty or underused nodes; its nodes
    get ``labels`` and, until something removes them, ``startup_taints``."""
    return NodePool(
        metadata=ObjectMeta(name=name),
        spec={
            "template": {
                "metadata": {"labels": dict(labels or {})},
                "spec": {
                    **(
                        {"startupTaints": [dict(t) for t in startup_taints]}
                        if startup_taints
                        else {}
                    ),
                    "requirements": [
                        {
                            "key": "node.kubernetes.io/instance-type",
                            "operator": "In",
                            "values": list(instance_types),
                        }
                    ],
                    "nodeClassRef": {
                        "group": "karpenter.kwok.sh",
                        "kind": "KWOKNodeClass",
                        "name": node_class_name,
                    },
                    "expireAfter": "Never",
                },
            },
            "disruption": {
                "consolidationPolicy": "WhenEmptyOrUnderutilized",
                "consolidateAfter": consolidate_after,
            },
        },
    )


def condition(obj: Any, kind: str) -> str | None:
    """The status ("True", "False", "Unknown") of a generic resource's condition, if any."""
    status = obj.get("status") if isinstance(obj, dict) else getattr(obj, "status", None)
    for c in (status or {}).get("conditions") or []:
        if c.get("type") == kind:
            return str(c.get("status"))
    return None
