"""Fixtures of the end-to-end tier: ``scene``, the whole system on the session's control plane."""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterator

import lightkube
import pytest
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.apps_v1 import Deployment
from lightkube.resources.core_v1 import Namespace, Pod

from tests.kube.controlplane import ControlPlane
from tests.kube.scenes import NODES, Scene


@pytest.fixture
def scene(control_plane: ControlPlane, tmp_path: pathlib.Path) -> Iterator[Scene]:
    s = Scene(control_plane, tmp_path)
    s.namespace = f"mig-{s.lease_ns.rsplit('-', 1)[-1]}"
    client = control_plane.client
    try:
        s.prepare()
        client.create(Namespace(metadata=ObjectMeta(name=s.namespace)))
        s.start_webhook()
        for node, model in NODES.items():
            s.add_node(node, f"emulated:{model}:x2")
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
