"""The snapshot file format: every parse rule, every bad input named by its place, round trips."""

from __future__ import annotations

import copy
import json
import re
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot import errors
from migpilot.mig import catalog, layouts
from migpilot.planning import generate, snapshot

ROOT = Path(__file__).resolve().parents[2]

ISSUE_EXAMPLE = """
version: 1
nodes:
  - name: node-0
    labels: {zone: a}
    taints: [{key: k, value: v, effect: NoSchedule}]
    unschedulable: false
    allocatable: {cpu: "64", memory: 512Gi}
    gpus:
      - model: NVIDIA A100-SXM4-80GB
        instances:
          - {profile: 3g.40gb, start: 4, used: true}
          - {profile: 1g.10gb, start: 0}
pods:
  - name: p1
    namespace: default
    priority: 0
    requests: {nvidia.com/mig-1g.10gb: 2, cpu: "4", memory: 8Gi}
    nodeSelector: {zone: a}
"""


def base() -> dict[str, Any]:
    """A small valid document that the bad-input cases break one field at a time."""
    return {
        "version": 1,
        "nodes": [
            {
                "name": "n0",
                "labels": {"zone": "a"},
                "gpus": [
                    {
                        "model": "a100-80gb",
                        "instances": [{"profile": "1g.10gb", "start": 0, "used": True}],
                    }
                ],
            }
        ],
        "pods": [{"name": "p", "requests": {"nvidia.com/mig-1g.10gb": 1}}],
    }


def parse(doc: Any) -> snapshot.Snapshot:
    return snapshot.parse(doc, source="s.yaml")


def error_of(doc: Any) -> str:
    with pytest.raises(errors.SnapshotError) as exc:
        parse(doc)
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("s.yaml: ")
    return message.removeprefix("s.yaml: ")


# --------------------------------------------------------------------------- good input


def test_issue_example() -> None:
    snap = parse(yaml.safe_load(ISSUE_EXAMPLE))
    (node,) = snap.nodes
    assert node.name == "node-0"
    assert dict(node.labels) == {"zone": "a"}
    assert node.taints == (snapshot.Taint("k", "v", "NoSchedule"),)
    assert node.unschedulable is False
    assert node.allocatable == snapshot.Resources(64_000, 512 * 2**30)
    (gpu,) = node.gpus
    assert gpu.index == 0
    assert gpu.model is catalog.resolve_gpu("a100-80gb")
    assert gpu.instances == (
        snapshot.ExistingInstance("1g.10gb", 0, False),
        snapshot.ExistingInstance("3g.40gb", 4, True),
    )
    assert gpu.layout == layouts.Layout.of(
        [layouts.Instance(0, "1g.10gb"), layouts.Instance(4, "3g.40gb")]
    )
    (pod,) = snap.pods
    assert pod.key == "default/p1"
    assert pod.mig == (snapshot.MigRequest("1g.10gb", 2),)
    assert (pod.cpu_milli, pod.memory_bytes) == (4000, 8 * 2**30)
    assert dict(pod.node_selector) == {"zone": "a"}
    assert snap.policy is snapshot.Policy.BINPACK
    assert snap.models == (gpu.model,)


def test_defaults() -> None:
    snap = parse(
        {
            "version": 1,
            "nodes": [{"name": "n", "gpus": [{"model": "a30-24gb"}]}],
            "pods": [{"name": "p", "requests": {"nvidia.com/mig-1g.6gb": 1}}],
        }
    )
    node, pod = snap.nodes[0], snap.pods[0]
    assert (node.labels, node.taints, node.unschedulable, node.allocatable) == ({}, (), False, None)
    assert node.gpus[0].instances == ()
    assert (pod.namespace, pod.priority, pod.cpu_milli, pod.memory_bytes) == ("default", 0, 0, 0)
    assert (pod.node_selector, pod.affinity, pod.tolerations) == ({}, (), ())


def test_empty_cluster_and_policy() -> None:
    snap = parse({"version": 1, "policy": "spread"})
    assert (snap.nodes, snap.pods, snap.policy) == ((), (), snapshot.Policy.SPREAD)


@pytest.mark.parametrize(
    "model", ["NVIDIA A100-SXM4-80GB", "a100-80gb", "NVIDIA A100 80GB PCIe", "NVIDIA H100 PCIe"]
)
def test_model_aliases(model: str) -> None:
    doc = base()
    doc["nodes"][0]["gpus"][0]["model"] = model
    assert parse(doc).nodes[0].gpus[0].model.memory_slots == 8


@pytest.mark.parametrize(
    ("resource", "profile"),
    [
        ("nvidia.com/mig-1g.10gb", "1g.10gb"),
        ("nvidia.com/mig-1g.10gb.me", "1g.10gb+me"),  # NVIDIA's mixed-strategy spelling
        ("nvidia.com/mig-3g.39gb", "3g.39gb"),  # kept as asked: only GPUs advertising it serve it
    ],
)
def test_mig_resource_names(resource: str, profile: str) -> None:
    doc = base()
    doc["pods"][0]["requests"] = {resource: 1}
    assert parse(doc).pods[0].mig == (snapshot.MigRequest(profile, 1),)


@pytest.mark.parametrize(
    ("resource", "message"),
    [
        ("nvidia.com/mig-1g.10gb+me", "did you mean nvidia.com/mig-1g.10gb.me?"),
        ("nvidia.com/MIG-1g.10gb", "is not a MIG resource (expected nvidia.com/mig-<profile>)"),
        ("nvidia.com/mig-1G.10GB", "did you mean nvidia.com/mig-1g.10gb?"),
        ("nvidia.com/mig-01g.10gb", "did you mean nvidia.com/mig-1g.10gb?"),
        ("nvidia.com/mig-1c.3g.40gb", "compute-instance profile"),
        ("nvidia.com/mig-banana", "is not a MIG profile name"),
    ],
)
def test_mig_resource_names_must_be_exactly_what_a_device_plugin_advertises(
    resource: str, message: str
) -> None:
    doc = base()
    doc["pods"][0]["requests"] = {resource: 1}
    with pytest.raises(errors.SnapshotError, match=re.escape(message)):
        parse(doc)


def test_requests_match_exactly_per_model() -> None:
    doc = base()
    doc["pods"][0]["requests"] = {"nvidia.com/mig-3g.40gb": 1, "nvidia.com/mig-1g.10gb.me": 1}
    pod = parse(doc).pods[0]
    assert pod.profiles_on(catalog.resolve_gpu("a100-80gb")) == ("1g.10gb+me", "3g.40gb")
    assert pod.profiles_on(catalog.resolve_gpu("h100-80gb")) == ("1g.10gb+me", "3g.40gb")
    assert pod.profiles_on(catalog.resolve_gpu("a30-24gb")) is None


@pytest.mark.parametrize(
    ("resource", "model"),
    [
        # The issue's cases: the same shape (or a near one) under another model's name.
        ("nvidia.com/mig-1g.5gb", "a30-24gb"),
        ("nvidia.com/mig-2g.12gb", "a100-40gb"),
        ("nvidia.com/mig-1g.6gb", "a100-40gb"),
        ("nvidia.com/mig-3g.39gb", "a100-80gb"),  # an older driver's name: not advertised now
        ("nvidia.com/mig-1g.10gb", "h200"),
    ],
)
def test_a_request_is_not_served_by_another_name(resource: str, model: str) -> None:
    doc = base()
    doc["pods"][0]["requests"] = {resource: 1}
    assert parse(doc).pods[0].profiles_on(catalog.resolve_gpu(model)) is None


def test_drifted_instance_names_resolve_at_parse() -> None:
    doc = base()
    doc["nodes"][0]["gpus"][0]["instances"] = [{"profile": "3g.39gb", "start": 0, "used": True}]
    assert parse(doc).nodes[0].gpus[0].instances == (snapshot.ExistingInstance("3g.40gb", 0, True),)


def test_counts_merge_and_zero_counts_drop() -> None:
    doc = base()
    doc["pods"][0]["requests"] = {
        "nvidia.com/mig-1g.10gb.me": 3,
        "nvidia.com/mig-2g.20gb": 0,
        "nvidia.com/mig-3g.40gb": "2",
        "ephemeral-storage": "10Gi",  # not modelled, ignored
    }
    assert parse(doc).pods[0].mig == (
        snapshot.MigRequest("1g.10gb+me", 3),
        snapshot.MigRequest("3g.40gb", 2),
    )


def test_same_pod_name_in_two_namespaces() -> None:
    doc = base()
    doc["pods"].append(
        {"name": "p", "namespace": "other", "requests": {"nvidia.com/mig-1g.10gb": 1}}
    )
    assert [p.key for p in parse(doc).pods] == ["default/p", "other/p"]


def test_explicit_gpu_index_and_label_values() -> None:
    doc = base()
    doc["nodes"][0]["gpus"][0]["index"] = 3
    doc["nodes"][0]["labels"] = {"zone": "a", "rack": 7, "ready": True}
    node = parse(doc).nodes[0]
    assert node.gpus[0].index == 3
    assert dict(node.labels) == {"zone": "a", "rack": "7", "ready": "true"}


def test_affinity_and_tolerations_parse() -> None:
    doc = base()
    doc["pods"][0]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {
                        "matchExpressions": [
                            {"key": "zone", "operator": "In", "values": ["a", "b"]},
                            {"key": "gpu", "operator": "Exists"},
                        ]
                    },
                    {"matchExpressions": [{"key": "rank", "operator": "Gt", "values": ["3"]}]},
                ]
            },
            "preferredDuringSchedulingIgnoredDuringExecution": [],  # accepted, not modelled
        }
    }
    doc["pods"][0]["tolerations"] = [
        {"operator": "Exists"},
        {"key": "k", "value": "v", "effect": "NoExecute", "tolerationSeconds": 30},
    ]
    pod = parse(doc).pods[0]
    req = snapshot.Requirement
    assert pod.affinity == (
        (req("zone", "In", ("a", "b")), req("gpu", "Exists", ())),
        (req("rank", "Gt", ("3",)),),
    )
    assert pod.tolerations == (
        snapshot.Toleration("", "Exists", "", ""),
        snapshot.Toleration("k", "Equal", "v", "NoExecute"),
    )


def test_allocatable_partial_is_unlimited_for_the_missing_resource() -> None:
    doc = base()
    doc["nodes"][0]["allocatable"] = {"cpu": "8"}
    alloc = parse(doc).nodes[0].allocatable
    assert alloc is not None
    assert alloc.cpu_milli == 8000
    assert alloc.memory_bytes >= 2**62


# --------------------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("text", "milli"),
    [
        ("500m", 500),
        ("4", 4000),
        (4, 4000),
        (0.5, 500),
        ("1.5", 1500),
        ("0.1m", 1),  # rounded up, as Kubernetes does
        ("1e3", 1_000_000),
        ("2k", 2_000_000),
        ("0", 0),
    ],
)
def test_cpu_quantities(text: Any, milli: int) -> None:
    assert snapshot.cpu_milli(text, where="x") == milli


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("8Gi", 8 * 2**30),
        ("1.5G", 1_500_000_000),
        ("512Mi", 512 * 2**20),
        ("1Ki", 1024),
        ("100k", 100_000),
        ("2T", 2 * 10**12),
        ("1Ti", 2**40),
        (1024, 1024),
        ("0.5", 1),
        ("1e9", 10**9),
        ("500m", 1),  # half a byte rounds up
    ],
)
def test_memory_quantities(text: Any, size: int) -> None:
    assert snapshot.memory_bytes(text, where="x") == size


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("8 Gi", "is not a quantity"),
        ("8gi", "unknown unit 'gi'"),
        ("8GB", "unknown unit 'GB'"),
        ("abc", "is not a quantity"),
        ("1.5.2", "is not a quantity"),
        ("", "is not a quantity"),
        ("-1", "is negative"),
        (-2, "is negative"),
        ("-8Gi", "is negative"),
        (True, "expected a quantity"),
        (None, "expected a quantity"),
        ([1], "expected a quantity"),
    ],
)
def test_bad_quantities(value: Any, message: str) -> None:
    with pytest.raises(errors.SnapshotError, match="^where: ") as exc:
        snapshot.parse_quantity(value, where="where")
    assert message in str(exc.value)


def test_parse_quantity_is_exact() -> None:
    assert snapshot.parse_quantity("1.5Gi", where="x") == Decimal(3 * 2**29)


# --------------------------------------------------------------------------- bad input


def _set(path: str, value: Any) -> Any:
    """A copy of :func:`base` with one value replaced (``a.0.b`` paths; ``DEL`` removes)."""
    doc = base()
    *parents, last = path.split(".")
    target: Any = doc
    for part in parents:
        target = target[int(part)] if part.isdigit() else target[part]
    key: Any = int(last) if last.isdigit() else last
    if value == "DEL":
        del target[key]
    else:
        target[key] = value
    return doc


GPU = "nodes.0.gpus.0"
INST = "nodes.0.gpus.0.instances"
POD = "pods.0"

BAD_CASES: list[tuple[str, Any, str]] = [
    # version and top level
    ("version", 2, "unsupported version 2 (expected 1)"),
    ("version", "1", "unsupported version '1' (expected 1)"),
    ("version", "DEL", "missing 'version'"),
    ("policy", "pack", "policy: 'pack' is not binpack or spread"),
    ("extra", 1, "snapshot: unknown field 'extra'"),
    ("nodes", {"name": "n"}, "nodes: expected a list"),
    ("pods", "p", "pods: expected a list"),
    # nodes
    ("nodes.0.name", "", "nodes[0].name: expected a non-empty string"),
    ("nodes.0.name", "DEL", "nodes[0].name: expected a non-empty string"),
    ("nodes.0.gpu", [], "nodes[0]: unknown field 'gpu'"),
    ("nodes.0.unschedulable", "yes", "nodes[0].unschedulable: expected true or false"),
    ("nodes.0.labels", ["zone"], "nodes[0].labels: expected a mapping"),
    ("nodes.0.labels", {"zone": None}, "nodes[0].labels.zone: label values must be strings"),
    ("nodes.0.labels", {"zone": ["a"]}, "nodes[0].labels.zone: label values must be strings"),
    ("nodes.0.allocatable", {"cpu": "-4"}, "nodes[0].allocatable.cpu: '-4' is negative"),
    ("nodes.0.allocatable", {"memory": "lots"}, "nodes[0].allocatable.memory: 'lots' is not a"),
    ("nodes.0.taints", [{"key": "k"}], "nodes[0].taints[0].effect: expected a non-empty string"),
    (
        "nodes.0.taints",
        [{"key": "k", "effect": "Never"}],
        "nodes[0].taints[0].effect: 'Never' is not one of NoSchedule, PreferNoSchedule, NoExecute",
    ),
    (
        "nodes.0.taints",
        [{"key": "k", "effect": "NoSchedule", "operator": "Equal"}],
        "nodes[0].taints[0]: unknown field 'operator'",
    ),
    # GPUs
    (GPU + ".model", "tpu-v5", "unknown GPU 'tpu-v5'"),
    (GPU + ".model", "DEL", "nodes[0].gpus[0].model: expected a non-empty string"),
    (GPU + ".migMode", True, "nodes[0].gpus[0]: unknown field 'migMode'"),
    (GPU + ".index", "0", "nodes[0].gpus[0].index: expected an integer"),
    (GPU + ".instances", {"profile": "1g.10gb"}, "nodes[0].gpus[0].instances: expected a list"),
    # instances
    (
        INST + ".0.profile",
        "1g.6gb",
        "nodes[0].gpus[0].instances[0].profile: a100-80gb has no MIG profile matching '1g.6gb'",
    ),
    (
        INST + ".0.profile",
        "huge",
        "nodes[0].gpus[0].instances[0].profile: 'huge' is not a MIG profile name",
    ),
    (INST + ".0.start", "DEL", "nodes[0].gpus[0].instances[0].start: expected an integer"),
    (INST + ".0.start", "0", "nodes[0].gpus[0].instances[0].start: expected an integer"),
    (INST + ".0.used", "yes", "nodes[0].gpus[0].instances[0].used: expected true or false"),
    (INST + ".0.size", 1, "nodes[0].gpus[0].instances[0]: unknown field 'size'"),
    (
        INST + ".0.start",
        -1,
        "nodes[0].gpus[0]: current instances are not a valid layout: 1g.10gb cannot start at "
        "memory slot -1",
    ),
    (
        INST,
        [{"profile": "3g.40gb", "start": 2}],
        "nodes[0].gpus[0]: current instances are not a valid layout: 3g.40gb cannot start at "
        "memory slot 2 on a100-80gb (allowed starts: 0, 4)",
    ),
    (
        INST,
        [{"profile": "4g.40gb", "start": 0}, {"profile": "2g.20gb", "start": 2}],
        "not a valid layout: 4g.40gb@0 and 2g.20gb@2 overlap on memory slots 2-3",
    ),
    (
        INST,
        [{"profile": "1g.10gb+me", "start": 0}, {"profile": "1g.10gb+me", "start": 1}],
        "not a valid layout: at most one media-extension (+me) instance per GPU",
    ),
    (
        INST,
        [{"profile": "1g.10gb", "start": 0}, {"profile": "1g.10gb", "start": 0}],
        "not a valid layout: 1g.10gb@0 and 1g.10gb@0 overlap on memory slot 0",
    ),
    # pods
    (POD + ".name", "DEL", "pods[0].name: expected a non-empty string"),
    (POD + ".priority", "high", "pods[0].priority: expected an integer, got 'high'"),
    (POD + ".limits", {}, "pods[0]: unknown field 'limits'"),
    (POD + ".namespace", "", "pods[0].namespace: expected a non-empty string"),
    (
        POD + ".requests",
        {"cpu": "1"},
        "pods[0].requests: the pod requests no MIG resource (nvidia.com/mig-...)",
    ),
    (POD + ".requests", "DEL", "pods[0].requests: the pod requests no MIG resource"),
    (
        POD + ".requests",
        {"nvidia.com/mig-1g.10gb": 0},
        "pods[0].requests: the pod requests no MIG resource",
    ),
    # nvidia.com/gpu alone is a whole-GPU pod (test_whole_gpu_pods_parse); in another mode:
    (
        POD,
        {
            "name": "p",
            "requests": {"nvidia.com/gpu": 1},
            "annotations": {"nvidia.com/vgpu-mode": "hami-core"},
        },
        "pods[0].requests: nvidia.com/vgpu-mode='hami-core' is not served by migpilot",
    ),
    (
        POD + ".requests",
        {"nvidia.com/mig-big": 1},
        "pods[0].requests: 'nvidia.com/mig-big' is not a MIG profile name",
    ),
    (
        POD + ".requests",
        {"nvidia.com/mig-1g.10gb": -1},
        "pods[0].requests.nvidia.com/mig-1g.10gb: expected a whole number of instances",
    ),
    (
        POD + ".requests",
        {"nvidia.com/mig-1g.10gb": 1.5},
        "pods[0].requests.nvidia.com/mig-1g.10gb: expected a whole number of instances",
    ),
    (
        POD + ".requests",
        {"nvidia.com/mig-1g.10gb": "two"},
        "pods[0].requests.nvidia.com/mig-1g.10gb: expected a whole number of instances",
    ),
    (
        POD + ".requests",
        {"nvidia.com/mig-1g.10gb": True},
        "pods[0].requests.nvidia.com/mig-1g.10gb: expected a whole number of instances",
    ),
    (
        POD + ".requests",
        {"nvidia.com/mig-1g.10gb": 1, "cpu": "-500m"},
        "pods[0].requests.cpu: '-500m' is negative",
    ),
    (
        POD + ".requests",
        {"nvidia.com/mig-1g.10gb": 1, "memory": "8GiB"},
        "pods[0].requests.memory: unknown unit 'GiB'",
    ),
    (POD + ".nodeSelector", ["zone"], "pods[0].nodeSelector: expected a mapping"),
    # tolerations
    (
        POD + ".tolerations",
        [{"key": "k", "operator": "In"}],
        "pods[0].tolerations[0].operator: 'In' is not Equal or Exists",
    ),
    (
        POD + ".tolerations",
        [{"key": "k", "operator": "Exists", "value": "v"}],
        "pods[0].tolerations[0]: operator Exists takes no value",
    ),
    (
        POD + ".tolerations",
        [{"value": "v"}],
        "pods[0].tolerations[0]: an empty key needs operator Exists",
    ),
    (
        POD + ".tolerations",
        [{"operator": "Exists", "effect": "Sometimes"}],
        "pods[0].tolerations[0].effect: 'Sometimes' is not one of",
    ),
    (
        POD + ".tolerations",
        [{"operator": "Exists", "seconds": 1}],
        "pods[0].tolerations[0]: unknown field 'seconds'",
    ),
    (POD + ".tolerations", {"operator": "Exists"}, "pods[0].tolerations: expected a list"),
    # affinity
    (
        POD + ".affinity",
        {"podAntiAffinity": {"x": 1}},
        "pods[0].affinity.podAntiAffinity: unknown field 'x'",
    ),
    (POD + ".affinity", {"nodeAffinty": {}}, "pods[0].affinity: unknown field 'nodeAffinty'"),
    (
        POD + ".affinity",
        {"nodeAffinity": {"required": {}}},
        "pods[0].affinity.nodeAffinity: unknown field 'required'",
    ),
]


def _terms(*exprs: dict[str, Any], fields: bool = False) -> dict[str, Any]:
    term: dict[str, Any] = {"matchExpressions": list(exprs)}
    if fields:
        term = {"matchFields": list(exprs)}
    return {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
        }
    }


TERM = (
    "pods[0].affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    ".nodeSelectorTerms[0]"
)
BAD_CASES += [
    (
        POD + ".affinity",
        _terms({"key": "zone", "operator": "Near", "values": ["a"]}),
        TERM + ".matchExpressions[0].operator: 'Near' is not one of In, NotIn, Exists",
    ),
    (
        POD + ".affinity",
        _terms({"key": "zone", "operator": "In"}),
        TERM + ".matchExpressions[0]: operator In needs values",
    ),
    (
        POD + ".affinity",
        _terms({"key": "zone", "operator": "NotIn", "values": []}),
        TERM + ".matchExpressions[0]: operator NotIn needs values",
    ),
    (
        POD + ".affinity",
        _terms({"key": "zone", "operator": "Exists", "values": ["a"]}),
        TERM + ".matchExpressions[0]: operator Exists takes no values",
    ),
    (
        POD + ".affinity",
        _terms({"key": "zone", "operator": "DoesNotExist", "values": ["a"]}),
        TERM + ".matchExpressions[0]: operator DoesNotExist takes no values",
    ),
    (
        POD + ".affinity",
        _terms({"key": "rank", "operator": "Gt", "values": ["three"]}),
        TERM + ".matchExpressions[0]: operator Gt needs one integer value",
    ),
    (
        POD + ".affinity",
        _terms({"key": "rank", "operator": "Lt", "values": ["1", "2"]}),
        TERM + ".matchExpressions[0]: operator Lt needs one integer value",
    ),
    (
        POD + ".affinity",
        _terms({"operator": "Exists"}),
        TERM + ".matchExpressions[0].key: expected a non-empty string",
    ),
    (
        POD + ".affinity",
        _terms({"key": "zone", "operator": "Exists", "value": "a"}),
        TERM + ".matchExpressions[0]: unknown field 'value'",
    ),
    (
        POD + ".affinity",
        _terms({"key": "metadata.uid", "operator": "In", "values": ["n0"]}, fields=True),
        TERM + ".matchFields[0].key: 'metadata.uid' is not a node field (only metadata.name is)",
    ),
    (
        POD + ".affinity",
        _terms({"key": "metadata.name", "operator": "NotIn", "values": ["a", "b"]}, fields=True),
        TERM + ".matchFields[0]: a node field selector takes In or NotIn with exactly one value",
    ),
]


@pytest.mark.parametrize(
    ("path", "value", "message"), BAD_CASES, ids=[f"{p}={v!r}"[:60] for p, v, _ in BAD_CASES]
)
def test_bad_input_is_named_by_place(path: str, value: Any, message: str) -> None:
    assert message in error_of(_set(path, value))


def test_unknown_model_is_an_error() -> None:
    message = error_of(_set(GPU + ".model", "tpu-v5"))
    assert "unknown GPU 'tpu-v5'" in message


def test_unknown_model_names_its_place() -> None:
    assert error_of(_set(GPU + ".model", "tpu-v5")).startswith("nodes[0].gpus[0].model: ")


@pytest.mark.parametrize("version", [True, 1.0])
def test_version_must_be_the_integer_1(version: Any) -> None:
    assert "unsupported version" in error_of(_set("version", version))


def test_taint_with_empty_value() -> None:
    doc = _set("nodes.0.taints", [{"key": "gpu", "value": "", "effect": "NoSchedule"}])
    assert parse(doc).nodes[0].taints == (snapshot.Taint("gpu", "", "NoSchedule"),)


def test_toleration_with_empty_value() -> None:
    doc = _set(POD + ".tolerations", [{"key": "k", "operator": "Equal", "value": ""}])
    assert parse(doc).pods[0].tolerations == (snapshot.Toleration("k", "Equal", "", ""),)


def test_compute_instance_request_is_rejected() -> None:
    doc = _set(POD + ".requests", {"nvidia.com/mig-1c.3g.40gb": 1})
    assert "compute-instance profile" in error_of(doc)


def test_taint_without_value() -> None:
    doc = _set("nodes.0.taints", [{"key": "gpu", "effect": "NoSchedule"}])
    assert parse(doc).nodes[0].taints == (snapshot.Taint("gpu", "", "NoSchedule"),)


@pytest.mark.parametrize("document", [None, [], "version: 1", 1])
def test_document_must_be_a_mapping_with_a_version(document: Any) -> None:
    message = error_of(document)
    assert message in (
        "snapshot: expected a mapping",
        "missing 'version' (this format is version 1)",
    )


def test_duplicate_node_names() -> None:
    doc = base()
    doc["nodes"].append(copy.deepcopy(doc["nodes"][0]))
    assert error_of(doc) == "nodes: node name 'n0' appears twice"


def test_duplicate_pods() -> None:
    doc = base()
    doc["pods"].append(
        {"name": "p", "namespace": "default", "requests": {"nvidia.com/mig-1g.10gb": 2}}
    )
    assert error_of(doc) == "pods: pod 'default/p' appears twice"


def test_duplicate_gpu_index() -> None:
    doc = base()
    doc["nodes"][0]["gpus"].append({"model": "a100-80gb", "index": 0})
    assert error_of(doc) == "nodes[0].gpus: two GPUs share an index"


def test_an_instance_listed_twice_is_not_merged() -> None:
    doc = base()
    doc["nodes"][0]["gpus"][0]["instances"] = [
        {"profile": "3g.40gb", "start": 4, "used": True},
        {"profile": "3g.40gb", "start": 4},
    ]
    assert error_of(doc) == (
        "nodes[0].gpus[0]: current instances are not a valid layout: 3g.40gb@4 and 3g.40gb@4 "
        "overlap on memory slots 4-7"
    )


def test_second_node_and_pod_errors_name_their_index() -> None:
    doc = base()
    doc["nodes"].append({"name": "n1", "gpus": [{"model": "a30-24gb", "instances": [{}]}]})
    assert error_of(doc).startswith("nodes[1].gpus[0].instances[0].profile: ")
    doc = base()
    doc["pods"].append({"name": "q", "requests": {"nvidia.com/gpu": 0}})
    assert error_of(doc).startswith("pods[1].requests.nvidia.com/gpu: ")


def test_source_defaults_to_snapshot() -> None:
    with pytest.raises(errors.SnapshotError, match=r"^snapshot: unsupported version 3"):
        snapshot.parse({"version": 3})


# --------------------------------------------------------------------------- round trips


def assert_same(a: snapshot.Snapshot, b: snapshot.Snapshot) -> None:
    """Field by field first, so a failure names the first difference; then whole."""
    assert a.policy == b.policy
    assert len(a.nodes) == len(b.nodes)
    for x, y in zip(a.nodes, b.nodes, strict=True):
        assert (x.name, dict(x.labels), x.taints) == (y.name, dict(y.labels), y.taints)
        assert (x.unschedulable, x.allocatable) == (y.unschedulable, y.allocatable)
        assert [(g.index, g.model.id, g.instances) for g in x.gpus] == [
            (g.index, g.model.id, g.instances) for g in y.gpus
        ]
    assert len(a.pods) == len(b.pods)
    for p, q in zip(a.pods, b.pods, strict=True):
        assert (p.key, p.priority, p.mig, p.cpu_milli, p.memory_bytes) == (
            q.key,
            q.priority,
            q.mig,
            q.cpu_milli,
            q.memory_bytes,
        )
        assert (dict(p.node_selector), p.affinity, p.tolerations) == (
            dict(q.node_selector),
            q.affinity,
            q.tolerations,
        )
    assert a == b


def round_trip(snap: snapshot.Snapshot) -> snapshot.Snapshot:
    doc = snapshot.to_document(snap)
    via_json = json.loads(json.dumps(doc))
    via_yaml = yaml.safe_load(yaml.safe_dump(doc))
    assert snapshot.parse(via_json) == snapshot.parse(via_yaml)
    return snapshot.parse(doc)


@pytest.mark.parametrize("seed", range(5))
def test_round_trip_random(seed: int) -> None:
    snap = generate.random_snapshot(
        seed=seed, nodes=12, gpus_per_node=4, pods=60, selector_fraction=0.5
    )
    assert_same(round_trip(snap), snap)


@pytest.mark.parametrize("seed", range(3))
def test_round_trip_trace(seed: int) -> None:
    snap = generate.trace_snapshot(seed=seed, nodes=6, gpus_per_node=8, pods=40)
    assert_same(round_trip(snap), snap)


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32),
    nodes=st.integers(0, 6),
    gpus=st.integers(1, 4),
    pods=st.integers(0, 20),
    cpu=st.booleans(),
)
def test_round_trip_property(seed: int, nodes: int, gpus: int, pods: int, cpu: bool) -> None:
    snap = generate.random_snapshot(
        seed=seed,
        nodes=nodes,
        gpus_per_node=gpus,
        pods=pods,
        selector_fraction=0.5,
        priority_levels=3,
        cpu=cpu,
    )
    assert_same(round_trip(snap), snap)


@pytest.mark.parametrize("name", ["snapshot-small.yaml", "snapshot-random-64.yaml"])
def test_round_trip_examples(name: str) -> None:
    snap = parse(yaml.safe_load((ROOT / "examples" / name).read_text()))
    assert_same(round_trip(snap), snap)


def test_round_trip_every_operator_and_toleration() -> None:
    req = snapshot.Requirement
    doc = base()
    doc["pods"][0]["priority"] = -5
    doc["pods"][0]["affinity"] = _terms(
        {"key": "a", "operator": "In", "values": ["1", "2"]},
        {"key": "b", "operator": "NotIn", "values": ["x"]},
        {"key": "c", "operator": "Exists"},
        {"key": "d", "operator": "DoesNotExist"},
        {"key": "e", "operator": "Gt", "values": ["3"]},
        {"key": "f", "operator": "Lt", "values": ["-3"]},
    )
    doc["pods"][0]["tolerations"] = [
        {"operator": "Exists"},
        {"key": "k", "operator": "Exists", "effect": "NoExecute"},
        {"key": "k", "value": "v"},
    ]
    snap = parse(doc)
    assert snap.pods[0].affinity[0][5] == req("f", "Lt", ("-3",))
    assert_same(round_trip(snap), snap)


def test_round_trip_taint_without_value() -> None:
    snap = parse(_set("nodes.0.taints", [{"key": "gpu", "effect": "NoSchedule"}]))
    assert_same(round_trip(snap), snap)


# --------------------------------------------------------------------------- dynamic MIG mode


def _dynamic_doc() -> dict[str, Any]:
    """A dynamic node with a MIG GPU, an idle whole GPU and a held one; a whole-GPU pod."""
    doc = base()
    node = doc["nodes"][0]
    node["labels"] = {"zone": "a", "migpilot.io/mig-mode": "dynamic"}
    node["gpus"] += [
        {"model": "a100-80gb", "mig": False},
        {"model": "a100-80gb", "mig": False, "used": True},
    ]
    whole = {"nvidia.com/gpu": 2, "cpu": "4", "memory": "8Gi"}
    doc["pods"].append({"name": "w", "requests": whole})
    return doc


def test_whole_gpu_pods_and_dynamic_nodes_parse() -> None:
    snap = parse(_dynamic_doc())
    (node,) = snap.nodes
    assert node.dynamic
    assert [(g.mig, g.whole_taken) for g in node.gpus] == [(True, False), (False, False),
                                                           (False, True)]  # fmt: skip
    assert [p.name for p in snap.pods] == ["p"]
    (w,) = snap.whole_pods
    assert (w.name, w.whole, w.cpu_milli, w.memory_bytes) == ("w", 2, 4000, 8 * 2**30)
    assert (w.mig, w.unified, w.mps) == ((), None, ())
    assert w.request_text() == "2 whole GPUs"


def test_dynamic_true_adds_the_label_as_on_the_cluster() -> None:
    doc = base()
    doc["nodes"][0]["dynamic"] = True
    (node,) = parse(doc).nodes
    assert node.dynamic
    assert node.labels["migpilot.io/mig-mode"] == "dynamic"
    assert node.labels["zone"] == "a"


@pytest.mark.parametrize("value", [None, "static", "Dynamic"])
def test_only_the_label_value_dynamic_opts_in(value: str | None) -> None:
    doc = base()
    if value is not None:
        doc["nodes"][0]["labels"]["migpilot.io/mig-mode"] = value
    assert not parse(doc).nodes[0].dynamic


def test_a_snapshot_without_modes_is_as_before() -> None:
    snap = parse(base())
    assert snap.whole_pods == ()
    assert not snap.nodes[0].dynamic
    assert all(g.mig and not g.whole_taken for g in snap.nodes[0].gpus)
    assert "dynamic" not in snapshot.to_document(snap)["nodes"][0]
    assert "mig" not in snapshot.to_document(snap)["nodes"][0]["gpus"][0]


def test_dynamic_snapshot_round_trips() -> None:
    snap = parse(_dynamic_doc())
    again = round_trip(snap)
    assert again == snap
    doc = snapshot.to_document(snap)
    assert doc["nodes"][0]["gpus"][1] == {"index": 1, "model": "a100-80gb", "instances": [],
                                          "mig": False}  # fmt: skip
    assert doc["pods"][1]["requests"]["nvidia.com/gpu"] == 2


DYNAMIC = "nodes.0.dynamic"
WHOLE_GPU = {"model": "a100-80gb", "mig": False}

DYNAMIC_BAD: list[tuple[dict[str, Any], str]] = [
    ({DYNAMIC: "yes"}, "nodes[0].dynamic: expected true or false"),
    (
        {"nodes.0.labels": {"migpilot.io/mig-mode": "dynamic"}, DYNAMIC: False},
        "nodes[0].dynamic: false, but the node is labelled migpilot.io/mig-mode=dynamic",
    ),
    (
        {DYNAMIC: True, "nodes.0.labels": {"migpilot.io/mode": "mps"}, "nodes.0.gpus": []},
        "nodes[0].dynamic: only a node in mode mig may switch its GPUs' MIG mode (this one is "
        "in mode mps)",
    ),
    (
        {
            "nodes.0.labels": {"migpilot.io/mode": "none", "migpilot.io/mig-mode": "dynamic"},
            "nodes.0.gpus": [],
        },
        "nodes[0].labels: only a node in mode mig may switch",
    ),
    (
        {"nodes.0.gpus": [WHOLE_GPU]},
        "nodes[0].gpus[0].mig: a whole GPU (mig: false) is listed only on a node labelled "
        "migpilot.io/mig-mode=dynamic",
    ),
    ({DYNAMIC: True, "nodes.0.gpus.0.mig": "no"}, "nodes[0].gpus[0].mig: expected true or false"),
    (
        {DYNAMIC: True, "nodes.0.gpus.0.mig": False},
        "nodes[0].gpus[0].instances: a whole GPU (mig: false) has no MIG instances",
    ),
    (
        {DYNAMIC: True, "nodes.0.gpus.0.used": True},
        "nodes[0].gpus[0].used: only a whole GPU (mig: false) is used as a whole",
    ),
    (
        {DYNAMIC: True, "nodes.0.gpus": [WHOLE_GPU | {"used": 1}]},
        "nodes[0].gpus[0].used: expected true or false",
    ),
    (
        {"pods.0.requests": {"nvidia.com/gpu": 0}},
        "pods[0].requests.nvidia.com/gpu: a whole-GPU pod asks for at least 1 GPU, got 0",
    ),
    (
        {"pods.0.requests": {"nvidia.com/gpu": "two"}},
        "pods[0].requests.nvidia.com/gpu: expected a whole number of instances",
    ),
    (
        {"pods.0.requests": {"nvidia.com/gpu": 1, "nvidia.com/mig-1g.10gb": 1}},
        "pods[0].requests: a whole-GPU pod (nvidia.com/gpu without nvidia.com/gpumem) asks for "
        "no other GPU resource, but this one also asks for nvidia.com/mig-1g.10gb",
    ),
    (
        {"pods.0.requests": {"nvidia.com/gpu": 1, "cpu": "lots"}},
        "pods[0].requests.cpu:",
    ),
]


@pytest.mark.parametrize(("changes", "message"), DYNAMIC_BAD)
def test_bad_dynamic_input_is_named_by_place(changes: dict[str, Any], message: str) -> None:
    doc = base()
    for path, value in changes.items():
        *parents, last = path.split(".")
        target: Any = doc
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[int(last) if last.isdigit() else last] = value
    assert message in error_of(doc)


def test_whole_gpu_pod_name_clashes_with_a_mig_pod() -> None:
    doc = _dynamic_doc()
    doc["pods"][1]["name"] = "p"
    assert "pods: pod 'default/p' appears twice" in error_of(doc)


def test_the_request_parsers_still_refuse_whole_gpus() -> None:
    # Traces and the controller build whole-GPU pods themselves (whole_requests).
    with pytest.raises(errors.SnapshotError, match="asks for whole GPUs"):
        snapshot.pod_requests({"nvidia.com/gpu": 1}, where="r")
