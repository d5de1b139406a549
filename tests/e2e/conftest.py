"""Fixtures of the end-to-end tier: ``scene``, the whole system on the session's control plane;
``metrics_scene``, the same with every migpilot process serving ``/metrics``, and
``prometheus``, a real Prometheus scraping it (``tests/kube/prometheus.py``); ``load_scene``
and ``load_prometheus``, the same with the agents' GPU use driven by a load file."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator, Mapping, Sequence

import lightkube
import pytest
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Namespace, Pod

from tests.kube import prometheus as prom
from tests.kube import tools
from tests.kube.controlplane import ControlPlane
from tests.kube.scenes import NODES, Scene


@contextlib.contextmanager
def _staged(
    plane: ControlPlane,
    root: pathlib.Path,
    *,
    metrics: bool,
    agent_args: Sequence[str] = (),
    nodes: Mapping[str, tuple[str, Mapping[str, str]]] | None = None,
) -> Iterator[Scene]:
    """A scene; ``nodes`` (name -> (GPUs, labels)) replaces the two nodes of ``NODES``."""
    s = Scene(plane, root, metrics=metrics)
    s.namespace = f"mig-{s.lease_ns.rsplit('-', 1)[-1]}"
    client = plane.client
    try:
        s.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=s.namespace)))
        s.start_webhook()
        staged = nodes or {n: (f"{m}:x2", {}) for n, m in NODES.items()}
        for node, (gpus, labels) in staged.items():
            s.add_node(node, f"emulated:{gpus}", *agent_args, labels=dict(labels))
        yield s
    finally:
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Deployment, "infer", namespace=s.namespace)
        for p in s.pods():
            with contextlib.suppress(lightkube.ApiError):
                assert p.metadata is not None
                client.delete(Pod, p.metadata.name or "", namespace=s.namespace, grace_period=0)
        s.stop()
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, s.namespace)


@pytest.fixture
def scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[Scene]:
    with _staged(control_plane, tmp_path, metrics=False) as s:
        yield s


ZONE = "topology.kubernetes.io/zone"
ZONE_NODES: dict[str, tuple[str, Mapping[str, str]]] = {
    "zh100-a0": ("h100-80gb:x1", {ZONE: "zone-a"}),
    "zh100-a1": ("h100-80gb:x1", {ZONE: "zone-a"}),
    "zh100-b0": ("h100-80gb:x1", {ZONE: "zone-b"}),
}
"""The issue's scene: three H100 nodes in two zones."""


@pytest.fixture
def zone_scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[Scene]:
    """``scene`` with the three H100 nodes of ``ZONE_NODES`` (two zones) instead of ``NODES``."""
    with _staged(control_plane, tmp_path, metrics=False, nodes=ZONE_NODES) as s:
        yield s


DYNAMIC_NODES: dict[str, tuple[str, Mapping[str, str]]] = {
    "dyn-h100": ("h100-80gb:x2", {"migpilot.io/mig-mode": "dynamic"}),
    "plain-h100": ("h100-80gb:x2", {}),
}
"""Dynamic MIG mode (``docs/migmode.md``): two H100 nodes, both GPUs in MIG mode, one labelled
``migpilot.io/mig-mode=dynamic``."""


@pytest.fixture
def dynamic_scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[Scene]:
    """``scene`` with the two nodes of ``DYNAMIC_NODES`` instead of ``NODES``."""
    with _staged(control_plane, tmp_path, metrics=False, nodes=DYNAMIC_NODES) as s:
        yield s


@pytest.fixture
def metrics_scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[Scene]:
    """``scene`` whose controllers, agents and fleet serve ``/metrics`` on free loopback ports
    (``metrics_ports``)."""
    with _staged(control_plane, tmp_path, metrics=True) as s:
        yield s


@pytest.fixture
def load_scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[Scene]:
    """``metrics_scene`` whose agents read GPU use every second and run the emulated GPUs at
    the loads of ``scene.load_file`` (``--emulated-load``; empty at start: every pod idle)."""
    load = tmp_path / "load.yaml"
    load.write_text("", encoding="utf-8")
    args = ("--emulated-load", str(load), "--gpu-metrics-interval", "1")
    with _staged(control_plane, tmp_path, metrics=True, agent_args=args) as s:
        s.load_file = load
        yield s


@pytest.fixture
def load_prometheus(load_scene: Scene, tmp_path: pathlib.Path) -> Iterator[prom.Prometheus]:
    """``prometheus`` scraping ``load_scene``."""
    with prom.Prometheus.start(
        tools.locate().prometheus, tmp_path / "prometheus", prom.targets_of(load_scene)
    ) as p:
        yield p


@pytest.fixture
def prometheus(metrics_scene: Scene, tmp_path: pathlib.Path) -> Iterator[prom.Prometheus]:
    """A real Prometheus scraping ``metrics_scene``'s processes every second. Processes started
    later (a controller) are scraped after ``prometheus.scrape(prom.targets_of(scene))``."""
    with prom.Prometheus.start(
        tools.locate().prometheus, tmp_path / "prometheus", prom.targets_of(metrics_scene)
    ) as p:
        yield p
