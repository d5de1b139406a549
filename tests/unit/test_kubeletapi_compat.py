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
KUBELET_DRA_MODULE = "k8s.io/kubelet@v0.37.2"
"""The kubelet of the control plane the tests run (scripts/k8s-tools): DRA's v1 API is newer."""
GOGO_MODULE = "github.com/gogo/protobuf@v1.3.2"
APIS = {
    "deviceplugin/v1beta1/api.proto": (KUBELET_MODULE, "pkg/apis/deviceplugin/v1beta1/api.proto"),
    "podresources/v1/api.proto": (KUBELET_MODULE, "pkg/apis/podresources/v1/api.proto"),
    "dra/v1/api.proto": (KUBELET_DRA_MODULE, "pkg/apis/dra/v1/api.proto"),
    "pluginregistration/v1/api.proto": (
        KUBELET_DRA_MODULE,
        "pkg/apis/pluginregistration/v1/api.proto",
    ),
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
def official_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, pathlib.Path]:
    """Per kubelet module: an include root holding its files and gogo.proto at their import
    paths."""
    gogo = _go_download(GOGO_MODULE)
    roots: dict[str, pathlib.Path] = {}
    for module in sorted({module for module, _ in APIS.values()}):
        kubelet = _go_download(module)
        root = tmp_path_factory.mktemp("official")
        (root / "github.com/gogo").mkdir(parents=True)
        (root / "github.com/gogo/protobuf").symlink_to(gogo)
        (root / "k8s.io").mkdir()
        (root / "k8s.io/kubelet").symlink_to(kubelet)
        roots[module] = root
    return roots


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
    ours: str, official_roots: dict[str, pathlib.Path], tmp_path: pathlib.Path
) -> None:
    module, path = APIS[ours]
    official = _compile(
        [official_roots[module]], f"k8s.io/kubelet/{path}", tmp_path / "official.pb"
    )
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


# Written from k8s.io/kubelet v0.37.2 (pkg/apis/dra/v1/api.proto and
# pkg/apis/pluginregistration/v1/api.proto): the full names the gRPC method paths carry, and
# every field's number. Checked against the generated modules offline, where the comparison
# above needs Go and the module proxy.
_DRA = "k8s.io.kubelet.pkg.apis.dra.v1"
_REG = "pluginregistration"
OFFICIAL_SERVICES = {
    f"{_DRA}.DRAPlugin": {
        "NodePrepareResources": (
            f"{_DRA}.NodePrepareResourcesRequest",
            f"{_DRA}.NodePrepareResourcesResponse",
        ),
        "NodeUnprepareResources": (
            f"{_DRA}.NodeUnprepareResourcesRequest",
            f"{_DRA}.NodeUnprepareResourcesResponse",
        ),
    },
    f"{_REG}.Registration": {
        "GetInfo": (f"{_REG}.InfoRequest", f"{_REG}.PluginInfo"),
        "NotifyRegistrationStatus": (
            f"{_REG}.RegistrationStatus",
            f"{_REG}.RegistrationStatusResponse",
        ),
    },
}
OFFICIAL_FIELDS = {
    f"{_DRA}.NodePrepareResourcesRequest": {"claims": 1},
    f"{_DRA}.NodePrepareResourcesResponse": {"claims": 1},
    f"{_DRA}.NodePrepareResourceResponse": {"devices": 1, "error": 2},
    f"{_DRA}.Device": {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
        "share_id": 5,
    },
    f"{_DRA}.NodeUnprepareResourcesRequest": {"claims": 1},
    f"{_DRA}.NodeUnprepareResourcesResponse": {"claims": 1},
    f"{_DRA}.NodeUnprepareResourceResponse": {"error": 1},
    f"{_DRA}.Claim": {"namespace": 1, "uid": 2, "name": 3},
    f"{_REG}.PluginInfo": {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4},
    f"{_REG}.RegistrationStatus": {"plugin_registered": 1, "error": 2},
    f"{_REG}.RegistrationStatusResponse": {},
    f"{_REG}.InfoRequest": {},
}


def _generated_files() -> list[Any]:
    from migpilot.agent.kubeletapi.dra.v1 import api_pb2 as dra
    from migpilot.agent.kubeletapi.pluginregistration.v1 import api_pb2 as reg

    return [dra.DESCRIPTOR, reg.DESCRIPTOR]


def test_dra_and_registration_services_have_the_official_full_names() -> None:
    services = {
        s.full_name: {m.name: (m.input_type.full_name, m.output_type.full_name) for m in s.methods}
        for f in _generated_files()
        for s in f.services_by_name.values()
    }
    assert services == OFFICIAL_SERVICES


def test_dra_and_registration_messages_have_the_official_field_numbers() -> None:
    fields = {
        m.full_name: {f.name: f.number for f in m.fields}
        for f in _generated_files()
        for m in f.message_types_by_name.values()
    }
    assert fields == OFFICIAL_FIELDS


def test_dra_maps_and_optional_share_id_are_as_upstream() -> None:
    from google.protobuf import descriptor

    from migpilot.agent.kubeletapi.dra.v1 import api_pb2 as dra

    for name in ("NodePrepareResourcesResponse", "NodeUnprepareResourcesResponse"):
        claims = dra.DESCRIPTOR.message_types_by_name[name].fields_by_name["claims"]
        assert claims.message_type.GetOptions().map_entry, f"{name}.claims is not a map"
        key, value = claims.message_type.fields
        assert key.type == descriptor.FieldDescriptor.TYPE_STRING
        assert value.message_type.name == name.replace("Resources", "Resource")
    share_id = dra.DESCRIPTOR.message_types_by_name["Device"].fields_by_name["share_id"]
    assert share_id.has_presence, "share_id must be proto3 optional"
    assert not dra.Device().HasField("share_id")
