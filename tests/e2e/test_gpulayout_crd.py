"""The GpuLayout CRD on the real kube-apiserver (v1.37): it is accepted and Established, a layout
written by migpilot.api round-trips, the status subresource takes the agent's half, the schema
and CEL rules reject bad objects with 422, and `kubectl get gpulayouts` columns come out as the
agent's summary says. Every wait has a generous timeout; no duration decides a pass."""

from __future__ import annotations

import json
import ssl
from typing import Any

import httpx2
import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.types import PatchType

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from tests.kube import crds
from tests.kube.controlplane import ControlPlane

pytestmark = pytest.mark.kube

GpuLayout = crds.GpuLayout
TIME = "2026-01-02T03:04:05Z"


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> ControlPlane:
    crds.ensure_gpulayouts(control_plane)
    return control_plane


def _spec(name: str) -> dict[str, Any]:
    spec = gl.LayoutSpec(
        (
            gl.GpuSpec(
                0,
                "h100-80gb",
                (
                    gl.InstanceSpec("1g.10gb", 0, "default/p1"),
                    gl.InstanceSpec("3g.40gb", 4, None),
                ),
            ),
        )
    )
    return dict(wire.spec_patch(name, spec))


def _status(state: str = "free") -> gl.LayoutStatus:
    return gl.LayoutStatus(
        observed_generation=1,
        gpus=(
            gl.GpuStatus(
                0,
                "NVIDIA H100 80GB HBM3",
                "GPU-0",
                (
                    gl.InstanceStatus("1g.10gb", 0, "MIG-a", gl.InstanceState.RESERVED),
                    gl.InstanceStatus("1g.10gb", 1, None, gl.InstanceState.CREATING),
                    gl.InstanceStatus("3g.40gb", 4, "MIG-c", gl.InstanceState(state)),
                ),
            ),
        ),
        conditions=(gl.Condition("Ready", gl.ConditionStatus.TRUE, "Reconciled", "", TIME, 1),),
    )


def _apply_spec(plane: ControlPlane, doc: dict[str, Any]) -> None:
    plane.client.apply(codecs.from_dict(doc), field_manager=gl.CONTROLLER_FIELD_MANAGER, force=True)


def _apply_status(plane: ControlPlane, name: str, status: gl.LayoutStatus | dict[str, Any]) -> None:
    body = (
        wire.status_patch(name, status)
        if isinstance(status, gl.LayoutStatus)
        else {"apiVersion": gl.API_VERSION, "kind": gl.KIND, "metadata": {"name": name}, **status}
    )
    plane.client.patch(
        GpuLayout.Status,
        name,
        dict(body),
        patch_type=PatchType.APPLY,
        field_manager=gl.AGENT_FIELD_MANAGER,
        force=True,
    )


def _rejected(call: Any) -> str:
    with pytest.raises(lightkube.ApiError) as info:
        call()
    assert info.value.status.code == 422, info.value.status
    return str(info.value.status.message)


def test_spec_and_status_round_trip_through_the_apiserver(crd: ControlPlane) -> None:
    client = crd.client
    _apply_spec(crd, _spec("gl-node-a"))
    got = wire.parse(client.get(GpuLayout, "gl-node-a").to_dict())
    assert got.status is None
    assert got.generation == 1
    assert got.spec.gpus[0].instances[0].reserved_for == "default/p1"

    # The status subresource takes the agent's half and leaves spec (and its owner) alone.
    _apply_status(crd, "gl-node-a", _status())
    raw = client.get(GpuLayout, "gl-node-a").to_dict()
    back = wire.parse(raw)
    assert back.status == _status()
    assert back.spec == got.spec
    assert back.generation == 1  # status writes do not bump the generation
    managers = {m["manager"]: m.get("subresource", "") for m in raw["metadata"]["managedFields"]}
    assert managers == {gl.CONTROLLER_FIELD_MANAGER: "", gl.AGENT_FIELD_MANAGER: "status"}

    # A spec apply cannot touch status (the subresource splits them).
    doc = _spec("gl-node-a")
    doc["spec"]["gpus"][0]["instances"].pop()
    doc["status"] = {"summary": {"gpus": 9, "instances": 9, "free": 9}}
    _apply_spec(crd, doc)
    again = wire.parse(client.get(GpuLayout, "gl-node-a").to_dict())
    assert again.status == _status()
    assert again.generation == 2
    assert len(again.spec.gpus[0].instances) == 1


BAD_SPEC = {
    "bad profile pattern": ("profile", "3g.40GB"),
    "start 12": ("start", 12),
    "start -1": ("start", -1),
    "reservedFor without namespace": ("reservedFor", "p1"),
}


@pytest.mark.parametrize("case", list(BAD_SPEC))
def test_the_schema_rejects_bad_specs(crd: ControlPlane, case: str) -> None:
    key, value = BAD_SPEC[case]
    doc = _spec("gl-bad")
    doc["spec"]["gpus"][0]["instances"][0][key] = value
    message = _rejected(lambda: _apply_spec(crd, doc))
    assert key in message


def test_list_map_keys_reject_duplicate_starts_and_indexes(crd: ControlPlane) -> None:
    dup_start = _spec("gl-dup")
    instances = dup_start["spec"]["gpus"][0]["instances"]
    instances.append(dict(instances[1]))
    dup_index = _spec("gl-dup")
    dup_index["spec"]["gpus"].append(dict(dup_index["spec"]["gpus"][0]))
    for doc in (dup_start, dup_index):
        created = lambda doc=doc: crd.client.create(codecs.from_dict(doc))  # noqa: E731
        assert "Duplicate value" in _rejected(created)
        # Server-side apply refuses them too, before validation: 1.37 answers 500 "failed to
        # create typed patch object ... duplicate entries for key" (not 422).
        with pytest.raises(lightkube.ApiError, match="duplicate entries"):
            _apply_spec(crd, doc)


def test_status_rules_reject_bad_states_uuids_and_summaries(crd: ControlPlane) -> None:
    _apply_spec(crd, _spec("gl-node-b"))
    good = wire.status_patch("gl-node-b", _status())

    bad_state = json.loads(json.dumps(good))
    bad_state["status"]["gpus"][0]["instances"][2]["state"] = "broken"
    assert "state" in _rejected(lambda: _apply_status(crd, "gl-node-b", bad_state))

    no_uuid = json.loads(json.dumps(good))
    del no_uuid["status"]["gpus"][0]["instances"][2]["uuid"]
    assert "uuid" in _rejected(lambda: _apply_status(crd, "gl-node-b", no_uuid))

    lying = json.loads(json.dumps(good))
    lying["status"]["summary"]["free"] = 3
    assert "summary" in _rejected(lambda: _apply_status(crd, "gl-node-b", lying))


def test_time_slicing_replicas_round_trip_and_a_free_one_names_no_user(crd: ControlPlane) -> None:
    """A GPU of a node in mode time-slicing: the replicas kept for unified pods in the spec,
    every replica and its holder in the status."""
    spec = gl.LayoutSpec((gl.GpuSpec(0, None, (), replicas=(gl.ReplicaSpec(2, "default/q"),)),))
    _apply_spec(crd, dict(wire.spec_patch("gl-ts", spec)))
    used, free = gl.InstanceState.USED, gl.InstanceState.FREE
    status = gl.LayoutStatus(
        observed_generation=1,
        gpus=(
            gl.GpuStatus(
                0,
                "NVIDIA A100-SXM4-40GB",
                "GPU-0",
                (),
                replicas=(
                    gl.ReplicaStatus(0, used, "default/p"),
                    gl.ReplicaStatus(1, used),
                    gl.ReplicaStatus(2, gl.InstanceState.RESERVED),
                    gl.ReplicaStatus(3, free),
                ),
            ),
        ),
    )
    _apply_status(crd, "gl-ts", status)
    back = wire.parse(crd.client.get(GpuLayout, "gl-ts").to_dict())
    assert back.spec == spec and back.status == status
    lying = json.loads(json.dumps(wire.status_patch("gl-ts", status)))
    lying["status"]["gpus"][0]["replicas"][3]["usedBy"] = "default/x"
    assert "only a used replica" in _rejected(lambda: _apply_status(crd, "gl-ts", lying))


def test_only_a_free_instance_may_become_destroying(crd: ControlPlane) -> None:
    _apply_spec(crd, _spec("gl-node-c"))
    _apply_status(crd, "gl-node-c", _status("used"))
    message = _rejected(lambda: _apply_status(crd, "gl-node-c", _status("destroying")))
    assert "only a free instance may become destroying" in message
    _apply_status(crd, "gl-node-c", _status("free"))
    _apply_status(crd, "gl-node-c", _status("destroying"))
    got = wire.parse(crd.client.get(GpuLayout, "gl-node-c").to_dict())
    assert got.status is not None
    assert got.status.gpus[0].instances[2].state is gl.InstanceState.DESTROYING


def test_printer_columns_show_node_gpus_instances_free_and_ready(crd: ControlPlane) -> None:
    _apply_spec(crd, _spec("gl-node-d"))
    _apply_status(crd, "gl-node-d", _status())
    config = yaml.safe_load(crd.kubeconfig.read_text())
    user = config["users"][0]["user"]
    ca = config["clusters"][0]["cluster"]["certificate-authority"]
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(user["client-certificate"], user["client-key"])
    with httpx2.Client(verify=context, trust_env=False) as http:
        response = http.get(
            f"{crd.server}/apis/{gl.GROUP}/{gl.VERSION}/{gl.PLURAL}/gl-node-d",
            headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        )
    response.raise_for_status()
    table = response.json()
    names = [c["name"] for c in table["columnDefinitions"]]
    assert names == ["Name", "Node", "GPUs", "Instances", "Free", "Ready", "Age"]
    (row,) = table["rows"]
    assert row["cells"][:6] == ["gl-node-d", "gl-node-d", 1, 3, 1, "True"]


def test_only_a_gpu_asked_whole_may_be_reserved_for_a_pod(crd: ControlPlane) -> None:
    # Dynamic MIG mode (docs/migmode.md): spec.gpus[].reservedFor keeps a whole GPU (mig false)
    # for a pending whole-GPU pod; the CEL rule refuses it on a GPU in MIG mode or not asked.
    def whole(mig: bool | None) -> dict[str, Any]:
        spec = gl.LayoutSpec((gl.GpuSpec(0, "h100-80gb", (), mig=False, reserved_for="ns/w"),))
        doc = dict(wire.spec_patch("gl-whole", spec))
        if mig is None:
            del doc["spec"]["gpus"][0]["mig"]
        else:
            doc["spec"]["gpus"][0]["mig"] = mig
        return doc

    _apply_spec(crd, whole(False))
    got = wire.parse(crd.client.get(GpuLayout, "gl-whole").to_dict())
    assert (got.spec.gpus[0].mig, got.spec.gpus[0].reserved_for) == (False, "ns/w")
    for mig in (True, None):
        message = _rejected(lambda mig=mig: _apply_spec(crd, whole(mig)))
        assert "only a whole GPU (mig false, no MPS slices or replicas) is reserved" in message
