"""Fixtures the device-plugin integration tests share: a short temporary folder under /tmp (unix
socket paths must stay under 108 bytes) and the fake kubelet serving in it (real gRPC on unix
sockets, tests/integration/kubelet_fake.py)."""

from __future__ import annotations

import pathlib
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.integration.kubelet_fake import FakeKubelet


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="mpk"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(root: pathlib.Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(root).start()
    yield fake
    fake.stop()
