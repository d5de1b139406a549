"""Shared test settings: a deterministic hypothesis profile so every run is repeatable (CI's
and a new user's alike; ``HYPOTHESIS_PROFILE=explore`` searches at random), and the
session's real Kubernetes control plane (`control_plane`); every test leaves the loggers' levels
and the root logger's handlers as it found them."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, settings

from migpilot import logs
from tests.kube import controlplane

settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=150,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", deadline=None, max_examples=300)
# Everyone runs the derandomized profile unless asked otherwise: a new user running the
# README's test command gets what CI gets, never a fresh random draw that fails where CI
# passed (the planner's floor property has rare known gaps, kept as strict xfails once found).
# HYPOTHESIS_PROFILE=explore draws new random examples (and replays failures it saved).
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def control_plane() -> Iterator[controlplane.ControlPlane]:
    """A real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler, KWOK)
    shared by the whole session; started on first use, stopped at the end. See tests/kube."""
    plane = controlplane.ControlPlane.start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """A command run in-process (``cli.main(["controller", ...])``) configures logging for a
    process: the root logger at INFO, its handler, the quiet libraries at WARNING. Put back
    afterwards, so that no later test's log capture depends on which tests ran before it."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    levels = {
        name: logger.level
        for name, logger in logging.Logger.manager.loggerDict.items()
        if isinstance(logger, logging.Logger)
    }
    yield
    # Only the handlers migpilot installed: pytest's own capture handlers change per phase.
    for handler in [h for h in root.handlers if h not in handlers]:
        if type(handler).__module__ == logs.__name__:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and logger.level != levels.get(name, logging.NOTSET):
            logger.setLevel(levels.get(name, logging.NOTSET))
