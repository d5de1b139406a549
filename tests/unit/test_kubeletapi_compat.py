"""Our kubelet API protos against the official ones, and the committed stubs against a fresh
generation.

The official ``api.proto`` files come from the Go module k8s.io/kubelet through the Go module
proxy (``go mod download``); their ``gogoproto`` options come from github.com/gogo/protobuf the
same way. Both files and ours are compiled to descriptor sets and compared: packages, services,
methods (names, streaming, types), messages, fields (name, number, type, label, type name) and
enums. Without Go or the proxy the test skips locally and fails when ``CI`` is set.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest
from google.protobuf import descriptor_pb2

from migpilot.agent.kubeletapi import generate

KUBELET_MODULE = "k8s.io/kubelet@v0.33.4"
GOGO_MODULE = "github.com/gogo/protobuf@v1.3.2"
APIS = {
    "deviceplugin/v1beta1/api.proto": "pkg/apis/deviceplugin/v1beta1/api.proto",
    "podresources/v1/api.proto": "pkg/apis/podresources/v1/api.proto",
}


def _unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"cannot fetch the official kubelet protos: {reason}")
    pytest.skip(f"official kubelet protos unavailable: {reason}")


def _go_download(module: str) -> pathlib.Path:
    go = shutil.which("go")
    if go is None:
        _unavailable("the go command is not installed")
        raise AssertionError  # unreachable: _unavailable raises
    env = dict(os.environ, GOFLAGS="-mod=mod", GO111MODULE="on")
    try:
        out = subprocess.run(
            [go, "mod", "download", "-json", module],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd="/",
            check=False,
        )
    except subprocess.TimeoutExpired:
        _unavailable(f"go mod download {module} timed out")
    info = json.loads(out.stdout or "{}")
    if out.returncode != 0 or "Dir" not in info:
        _unavailable(f"go mod download {module}: {info.get('Error') or out.stderr.strip()}")
    return pathlib.Path(info["Dir"])


@pytest.fixture(scope="module")
def official_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """An include root holding the official files and gogo.proto at their import paths."""
    kubelet = _go_download(KUBELET_MODULE)
    gogo = _go_download(GOGO_MODULE)
    root = tmp_path_factory.mktemp("official")
    (root / "github.com/gogo").mkdir(parents=True)
    (root / "github.com/gogo/protobuf").symlink_to(gogo)
    (root / "k8s.io").mkdir()
    (root / "k8s.io/kubelet").symlink_to(kubelet)
    return root


def _compile(include: list[pathlib.Path], proto: str, out: pathlib.Path) -> Any:
    import grpc_tools

    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        *(f"-I{p}" for p in [*include, well_known]),
        f"--descriptor_set_out={out}",
        proto,
    ]
    subprocess.run(cmd, check=True, capture_output=True)
    fds = descriptor_pb2.FileDescriptorSet()
    fds.ParseFromString(out.read_bytes())
    (file,) = fds.file
    return file


def _message_shape(msg: Any) -> dict[str, Any]:
    return {
        "fields": sorted(
            (f.name, f.number, f.type, f.label, f.type_name, f.json_name) for f in msg.field
        ),
        "nested": {m.name: _message_shape(m) for m in msg.nested_type},
        "enums": {e.name: sorted((v.name, v.number) for v in e.value) for e in msg.enum_type},
        "map_entry": msg.options.map_entry,
        "oneofs": [o.name for o in msg.oneof_decl],
    }


def _shape(file: Any) -> dict[str, Any]:
    return {
        "package": file.package,
        "syntax": file.syntax,
        "services": {
            s.name: sorted(
                (m.name, m.input_type, m.output_type, m.client_streaming, m.server_streaming)
                for m in s.method
            )
            for s in file.service
        },
        "messages": {m.name: _message_shape(m) for m in file.message_type},
        "enums": {e.name: sorted((v.name, v.number) for v in e.value) for e in file.enum_type},
    }


@pytest.mark.parametrize("ours", sorted(APIS))
def test_protos_match_the_official_api(
    ours: str, official_root: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    official = _compile([official_root], f"k8s.io/kubelet/{APIS[ours]}", tmp_path / "official.pb")
    mine = _compile([generate.HERE], ours, tmp_path / "ours.pb")
    assert _shape(mine) == _shape(official)
    assert _shape(mine)["services"], "no service compared"


def test_committed_stubs_match_a_fresh_generation(tmp_path: pathlib.Path) -> None:
    fresh = generate.generate(tmp_path)
    assert len(fresh) == 3 * len(generate.PROTOS)
    for path in fresh:
        committed = generate.SRC_ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed} is not committed"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed} is stale: run python -m migpilot.agent.kubeletapi.generate"
        )
