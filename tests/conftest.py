"""Shared test settings: a deterministic hypothesis profile so CI runs are repeatable, and the
session's real Kubernetes control plane (`control_plane`)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from tests.kube import controlplane

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=100)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@pytest.fixture(scope="session")
def control_plane() -> Iterator[controlplane.ControlPlane]:
    """A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK)
    shared by the whole session; started on first use, stopped at the end. See tests/kube."""
    plane = controlplane.ControlPlane.start()
    try:
        yield plane
    finally:
        plane.stop()
