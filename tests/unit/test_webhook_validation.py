"""The validating webhook's pure decision: which new pods are refused for a malformed unified
request (each with a message naming the field), and everything it lets through: good unified
forms, pods it does not serve, MIG resources, unfittable requests and malformed reviews."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.webhook import admission, reviews, validation

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
MODE = "nvidia.com/vgpu-mode"
USE = "nvidia.com/use-gputype"
NOUSE = "nvidia.com/nouse-gputype"
NODE_POLICY = "hami.io/node-scheduler-policy"
GPU_POLICY = "hami.io/gpu-scheduler-policy"


def _pod(
    *limits: dict[str, Any],
    init: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod with one container per ``limits`` (the apiserver copies limits into requests)."""
    containers = [
        {"name": f"c{i}", "image": "x", "resources": {"limits": lim, "requests": dict(lim)}}
        for i, lim in enumerate(limits)
    ]
    spec: dict[str, Any] = {"containers": containers}
    if init is not None:
        spec["initContainers"] = [
            {"name": f"i{i}", "image": "x", "resources": {"limits": lim}}
            for i, lim in enumerate(init)
        ]
    metadata: dict[str, Any] = {"name": "p", "namespace": "default"}
    if annotations is not None:
        metadata["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}


def _review(obj: Any, *, operation: str = "CREATE", uid: str = "u-1") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": operation,
            "namespace": "default",
            "object": obj,
        },
    }


def _answer(document: Any) -> dict[str, Any]:
    out = validation.review(document)
    assert out["apiVersion"] == "admission.k8s.io/v1"
    assert out["kind"] == "AdmissionReview"
    json.dumps(out)  # serialisable as is
    response = dict(out["response"])
    assert "patch" not in response  # a validating webhook never mutates
    return response


# --- refused, naming the field -------------------------------------------------------------------

C0 = "spec.containers[0].resources"

REFUSED = [
    # amounts: whole numbers in range (the apiserver already refuses fractions of an extended
    # resource; the webhook does not rely on it)
    ("mps-two-gpus", _pod({GPU: "2", MEM: "8000"}, annotations={MODE: "mps"}), "more than one GPU"),
    ("mem-fraction", _pod({GPU: "1", MEM: "7.5"}), f"{C0}.{MEM}: expected a whole number"),
    ("mem-milli", _pod({GPU: "1", MEM: "500m"}), f"{C0}.{MEM}: expected a whole number"),
    ("mem-zero", _pod({GPU: "1", MEM: "0"}), f"{C0}.{MEM}: 0 is less than 1"),
    ("mem-word", _pod({GPU: "1", MEM: "lots"}), f"{C0}.{MEM}: expected a whole number"),
    ("pct-zero", _pod({GPU: "1", PCT: "0"}), f"{C0}.{PCT}: 0 is outside 1 to 100"),
    ("pct-101", _pod({GPU: "1", PCT: "101"}), f"{C0}.{PCT}: 101 is outside 1 to 100"),
    ("pct-fraction", _pod({GPU: "1", PCT: "50.5"}), f"{C0}.{PCT}: expected a whole number"),
    ("cores-zero", _pod({GPU: "1", CORES: "0"}), f"{C0}.{CORES}: 0 is outside 1 to 100"),
    ("cores-150", _pod({GPU: "1", CORES: "150"}), f"{C0}.{CORES}: 150 is outside 1 to 100"),
    ("cores-1k", _pod({GPU: "1", CORES: "1k"}), f"{C0}.{CORES}: 1000 is outside 1 to 100"),
    ("gpu-fraction", _pod({GPU: "0.5", MEM: "8000"}), f"{C0}.{GPU}: expected a whole number"),
    # no nvidia.com/gpu beside the unified resources, in the same container
    ("mem-no-gpu", _pod({MEM: "8000"}), f"{C0}.{MEM}: needs {GPU} in the same container"),
    ("pct-no-gpu", _pod({PCT: "50"}), f"{C0}.{PCT}: needs {GPU} in the same container"),
    ("cores-no-gpu", _pod({CORES: "30"}), f"{C0}.{CORES}: needs {GPU} in the same container"),
    (
        "gpu-in-another-container",
        _pod({GPU: "1"}, {MEM: "8000"}),
        f"spec.containers[1].resources.{MEM}: needs {GPU} in the same container",
    ),
    (
        "init-container",
        _pod({"cpu": "1"}, init=[{CORES: "30"}]),
        f"spec.initContainers[0].resources.{CORES}: needs {GPU}",
    ),
    # both kinds of memory
    (
        "mem-and-pct",
        _pod({GPU: "1", MEM: "8000", PCT: "50"}),
        f"{C0}: give {MEM} or {PCT}, not both",
    ),
    # more memory than any allowed model has in one MIG instance
    (
        "mem-too-big",
        _pod({GPU: "1", MEM: "300000"}),
        f"{C0}.{MEM}: 300000 MiB is more than any allowed GPU model offers",
    ),
    (
        "mem-in-gi",  # gpumem counts MiB: 8Gi is 2^33 of them
        _pod({GPU: "1", MEM: "8Gi"}),
        f"{C0}.{MEM}: '8Gi' (8589934592 MiB: {MEM} counts MiB) is more than",
    ),
    (
        "mem-too-big-for-the-filtered-model",
        _pod({GPU: "1", MEM: "90000"}, annotations={USE: "A100"}),
        f"{C0}.{MEM}: 90000 MiB is more than any allowed GPU model offers in one MIG instance "
        "(at most 80640 MiB, on a100-80gb)",
    ),
    # model filters that leave no model
    (
        "use-unknown-model",
        _pod({GPU: "1", MEM: "8000"}, annotations={USE: "V100,T4"}),
        f"metadata.annotations[{USE}]: 'V100,T4' matches no GPU model migpilot serves",
    ),
    (
        "use-and-nouse-exclude-all",
        _pod({GPU: "1", PCT: "50"}, annotations={USE: "A30", NOUSE: "a30"}),
        f"metadata.annotations[{USE}], [{NOUSE}]: together they exclude every GPU model",
    ),
    (
        "mode-mig-with-unknown-model",
        _pod({GPU: "1"}, annotations={MODE: "mig", USE: "V100"}),
        f"metadata.annotations[{USE}]: 'V100' matches no GPU model",
    ),
    # scheduler policies
    (
        "node-policy",
        _pod({GPU: "1", MEM: "8000"}, annotations={NODE_POLICY: "packed"}),
        f"metadata.annotations[{NODE_POLICY}]: 'packed' is not binpack or spread",
    ),
    (
        "gpu-policy",
        _pod({GPU: "1", MEM: "8000"}, annotations={GPU_POLICY: "topology-aware"}),
        f"metadata.annotations[{GPU_POLICY}]: 'topology-aware' is not binpack or spread",
    ),
    (
        "gpu-policy-case",
        _pod({GPU: "1", MEM: "8000"}, annotations={GPU_POLICY: "Spread"}),
        f"metadata.annotations[{GPU_POLICY}]: 'Spread' is not binpack or spread",
    ),
]


@pytest.mark.parametrize(("pod", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_malformed_unified_requests_are_refused_naming_the_field(
    pod: dict[str, Any], message: str
) -> None:
    verdict = validation.decide(_review(pod))
    assert verdict.outcome is validation.Outcome.REFUSED
    response = _answer(_review(pod))
    assert response["uid"] == "u-1"
    assert response["allowed"] is False
    assert response["status"]["code"] == 422
    assert response["status"]["reason"] == "Invalid"
    assert message in response["status"]["message"]


def test_every_problem_is_told_at_once() -> None:
    pod = _pod(
        {GPU: "1", PCT: "0"},
        {CORES: "30"},
        annotations={GPU_POLICY: "random", NODE_POLICY: "spread"},
    )
    problems = validation.decide(_review(pod)).problems
    assert [p.split(":")[0] for p in problems] == [
        f"{C0}.{PCT}",
        f"spec.containers[1].resources.{CORES}",
        f"metadata.annotations[{GPU_POLICY}]",
    ]
    assert _answer(_review(pod))["status"]["message"] == "; ".join(problems)


# --- allowed ------------------------------------------------------------------------------------

ALLOWED = [
    ("mem", _pod({GPU: "1", MEM: "8000"})),
    ("mem-canonical-8k", _pod({GPU: "1", MEM: "8k"})),  # how the apiserver writes 8000 back
    ("mem-int", _pod({GPU: 1, MEM: 8000})),
    ("pct", _pod({GPU: "2", PCT: "50"})),
    ("pct-100", _pod({GPU: "1", PCT: "100"})),
    ("cores", _pod({GPU: "1", CORES: "100"})),
    ("mem-and-cores", _pod({GPU: "1", MEM: "20000", CORES: "30"})),
    ("largest-b300", _pod({GPU: "1", MEM: "270000"})),
    ("mode-mig-whole-gpu", _pod({GPU: "1"}, annotations={MODE: "mig"})),
    ("mode-mig-upper", _pod({GPU: "1"}, annotations={MODE: " MIG "})),
    ("two-containers", _pod({GPU: "1", MEM: "8000"}, {GPU: "1"}, {"cpu": "1"})),
    ("init-container", _pod({"cpu": "1"}, init=[{GPU: "1", CORES: "30"}])),
    ("filters", _pod({GPU: "1", MEM: "8000"}, annotations={USE: "H100", NOUSE: "NVL"})),
    ("policies", _pod({GPU: "1", PCT: "20"}, annotations={NODE_POLICY: "spread"})),
    ("policy-spaces", _pod({GPU: "1", PCT: "20"}, annotations={GPU_POLICY: " binpack "})),
    ("zero-gpus", _pod({GPU: "0", MEM: "8000"})),  # asks for nothing: nothing to serve
    ("mode-only", _pod({"cpu": "1"}, annotations={MODE: "mig"})),
    # unfittable here and now is not malformed: it waits, with an event from the controller
    ("many-gpus", _pod({GPU: "64", MEM: "8000"})),
    ("fits-h200-only", _pod({GPU: "1", MEM: "140000"}, annotations={USE: "H200,B200"})),
]


@pytest.mark.parametrize("pod", [a[1] for a in ALLOWED], ids=[a[0] for a in ALLOWED])
def test_good_unified_requests_are_allowed(pod: dict[str, Any]) -> None:
    assert validation.decide(_review(pod)).outcome is validation.Outcome.ALLOWED
    response = _answer(_review(pod))
    assert response == {"uid": "u-1", "allowed": True}


NOT_UNIFIED = [
    ("plain", _pod({"cpu": "1", "memory": "1Gi"})),
    ("no-resources", {"apiVersion": "v1", "kind": "Pod", "spec": {"containers": [{"name": "a"}]}}),
    ("whole-gpu", _pod({GPU: "1"})),  # NVIDIA's device plugin's, not ours
    ("whole-gpu-with-filter", _pod({GPU: "1"}, annotations={USE: "V100"})),
    # another system serves these, whatever they ask
    ("hami-core", _pod({GPU: "1", MEM: "8000", CORES: "30"}, annotations={MODE: "hami-core"})),
    ("hami-core-bad", _pod({MEM: "0"}, annotations={MODE: "hami-core", GPU_POLICY: "x"})),
    ("other-mode", _pod({GPU: "1", PCT: "500"}, annotations={MODE: "vgpu"})),
    # MIG resources are never refused: the mutating webhook warns of a misspelt one
    ("mig", _pod({"nvidia.com/mig-1g.10gb": "1"})),
    ("mig-misspelt", _pod({"nvidia.com/mig-1G.10GB": "1"})),
    ("mig-compute-instance", _pod({"nvidia.com/mig-1c.3g.40gb": "1"})),
    ("mig-unknown", _pod({"nvidia.com/mig-lots": "1"})),
]


@pytest.mark.parametrize("pod", [a[1] for a in NOT_UNIFIED], ids=[a[0] for a in NOT_UNIFIED])
def test_pods_without_a_unified_request_are_allowed_untold(pod: dict[str, Any]) -> None:
    assert validation.decide(_review(pod)).outcome is validation.Outcome.NOT_UNIFIED
    assert _answer(_review(pod)) == {"uid": "u-1", "allowed": True}


def test_a_hami_core_pod_is_allowed_and_not_gated() -> None:
    pod = _pod({GPU: "1", MEM: "8000"}, annotations={MODE: "hami-core"})
    assert _answer(_review(pod))["allowed"] is True
    decision = admission.decide(_review(pod), lease_fresh=True)
    assert decision.outcome is admission.Outcome.OTHER_VGPU_MODE
    assert not decision.patch


@pytest.mark.parametrize(
    ("annotations", "unknown"),
    [
        ({USE: "A100,V100"}, [(USE, "V100")]),  # HAMi's own example
        ({NOUSE: "1080,2080"}, [(NOUSE, "1080"), (NOUSE, "2080")]),  # HAMi's other example
        ({USE: "H100,L4", NOUSE: "T4"}, [(USE, "L4"), (NOUSE, "T4")]),
    ],
)
def test_filters_naming_models_migpilot_does_not_know_warn(
    annotations: dict[str, str], unknown: list[tuple[str, str]]
) -> None:
    response = _answer(_review(_pod({GPU: "1", MEM: "8000"}, annotations=annotations)))
    assert response["allowed"] is True
    assert "status" not in response
    assert len(response["warnings"]) == len(unknown)
    for warning, (field, name) in zip(response["warnings"], unknown, strict=True):
        assert warning.startswith(f"migpilot: metadata.annotations[{field}]: {name!r} matches no")


@pytest.mark.parametrize(("operation"), ["UPDATE", "DELETE", "CONNECT"])
def test_only_creates_are_validated(operation: str) -> None:
    document = _review(_pod({MEM: "8000"}), operation=operation)
    assert validation.decide(document).outcome is validation.Outcome.NOT_POD_CREATE
    assert _answer(document)["allowed"] is True


def test_a_subresource_create_is_not_validated() -> None:
    document = _review(_pod({MEM: "8000"}))
    document["request"]["subResource"] = "binding"
    assert _answer(document)["allowed"] is True


# --- malformed reviews: allowed, with a message --------------------------------------------------


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (None, "not a JSON object"),
        ({"kind": "AdmissionReview"}, "expected an AdmissionReview of admission.k8s.io/v1"),
        (_review({"metadata": {}}), "the pod's spec is not an object"),
        (_review(_pod(annotations={MODE: 1})), "metadata.annotations[nvidia.com/vgpu-mode]"),  # type: ignore[dict-item]
        (
            _review({"spec": {"containers": [{"name": "a", "resources": {"limits": [1]}}]}}),
            "container a: resources.limits is not an object",
        ),
    ],
)
def test_malformed_reviews_are_allowed_with_a_message(document: Any, message: str) -> None:
    assert validation.decide(document).outcome is validation.Outcome.MALFORMED
    response = _answer(document)
    assert response["allowed"] is True
    assert message in response["status"]["message"]
    assert "code" not in response["status"]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
AMOUNT = st.one_of(
    st.integers(-5, 400_000),
    st.sampled_from(
        ["1", "8k", "1.5", "500m", "8Gi", "1e3", "", " 7 ", "-1", "1e40", "1e999999k", "x"]
    ),
    st.booleans(),
    st.none(),
)
RESOURCES = st.dictionaries(st.sampled_from([GPU, MEM, PCT, CORES, "cpu"]), AMOUNT, max_size=4)


@given(JSON)
def test_any_json_is_allowed(document: Any) -> None:
    assert _answer(document)["allowed"] is True


@given(
    st.lists(RESOURCES, min_size=1, max_size=3),
    st.dictionaries(
        st.sampled_from([MODE, USE, NOUSE, NODE_POLICY, GPU_POLICY]),
        st.sampled_from(["mig", "hami-core", "A100", "V100", "binpack", "spread", "x", ""]),
    ),
)
def test_any_pod_gets_an_answer_and_a_refusal_names_a_field(
    containers: list[dict[str, Any]], annotations: dict[str, str]
) -> None:
    pod = _pod(*containers, annotations=annotations)
    response = _answer(_review(pod))
    verdict = validation.decide(_review(pod))
    assert response["allowed"] is (verdict.outcome is not validation.Outcome.REFUSED)
    for problem in verdict.problems:
        assert problem.startswith(("spec.containers[", "metadata.annotations[", "spec:"))
    # The gate and the refusal agree: a request the planner cannot read is never gated; one it
    # reads may be gated and still refused, when no GPU model could ever serve it.
    gated = admission.decide(_review(pod), lease_fresh=True).outcome is admission.Outcome.GATED
    if gated and verdict.outcome is validation.Outcome.REFUSED:
        assert all("GPU model" in p for p in verdict.problems), verdict.problems


def test_a_huge_annotation_gives_a_small_answer() -> None:
    """A 256 KiB model filter of unknown names (once a 6.4 MB answer): the first warnings are
    told, the rest counted, and the answer stays small."""
    unknown = ",".join(f"m{i}" for i in range(60_000))[: 256 * 1024]
    pod = _pod({GPU: "1", MEM: "8k"}, annotations={USE: f"A100,{unknown}", NOUSE: unknown})
    verdict = validation.decide(_review(pod))
    assert len(verdict.warnings) > 10_000  # the decision keeps them all
    response = _answer(_review(pod))
    warnings = response["warnings"]
    assert len(warnings) == reviews.MAX_LINES + 1
    assert warnings[:-1] == list(verdict.warnings[: reviews.MAX_LINES])
    assert warnings[-1] == f"+{len(verdict.warnings) - reviews.MAX_LINES} more"
    assert len(json.dumps(response)) < 20_000


def test_many_problems_are_capped_and_each_is_cut_short() -> None:
    long_value = "9" * 300_000
    pod = _pod(*[{MEM: "8k"}] * 40, {GPU: "1", CORES: long_value})
    verdict = validation.decide(_review(pod))
    assert len(verdict.problems) == 41
    response = _answer(_review(pod))
    assert response["allowed"] is False
    lines = response["status"]["message"].split("; ")
    assert len(lines) == reviews.MAX_LINES + 1
    assert lines[-1] == f"+{41 - reviews.MAX_LINES} more"
    assert all(len(line) <= reviews.MAX_LINE_CHARS for line in lines)
    assert len(json.dumps(response)) < 20_000


@given(st.lists(st.text(max_size=2000), max_size=100))
def test_capped_keeps_the_first_lines_and_counts_the_rest(lines: list[str]) -> None:
    out = reviews.capped(lines)
    told = out if len(lines) <= reviews.MAX_LINES else out[:-1]
    assert len(told) == min(len(lines), reviews.MAX_LINES)
    for line, shown in zip(lines, told, strict=False):
        assert len(shown) <= reviews.MAX_LINE_CHARS
        assert shown == line or (shown.endswith("...") and line.startswith(shown[:-3]))
    if len(lines) > reviews.MAX_LINES:
        assert out[-1] == f"+{len(lines) - reviews.MAX_LINES} more"


# --- what a review's log line names ------------------------------------------------------------


def test_pod_and_node_name_the_pod_a_review_creates() -> None:
    pod = _pod({})
    assert reviews.pod_and_node(_review(pod)) == ("default/p", None)
    pod["spec"]["nodeName"] = "n0"
    assert reviews.pod_and_node(_review(pod)) == ("default/p", "n0")
    # A name left to the API server is empty in the review: the prefix, marked.
    generated = _pod({})
    generated["metadata"] = {"generateName": "job-"}
    assert reviews.pod_and_node(_review(generated)) == ("default/job-*", None)


@pytest.mark.parametrize(
    "document",
    [
        None,
        [],
        {"request": "nope"},
        _review(_pod({}), operation="DELETE"),
        _review({"metadata": "nope", "spec": []}),
        _review({"metadata": {}}),  # no name, no generateName
        _review(None),
    ],
)
def test_pod_and_node_of_a_review_naming_no_pod_is_none_never_an_error(document: Any) -> None:
    assert reviews.pod_and_node(document) == (None, None)
