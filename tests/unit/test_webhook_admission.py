"""The webhook's pure decision: which new pods get the migpilot.io/plan gate, the patch it sends,
that it never rejects, and the Lease freshness rule."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.api import leases
from migpilot.webhook import admission, reviews

GATE = {"name": "migpilot.io/plan"}


def _pod(
    *,
    containers: list[dict[str, Any]] | None = None,
    init: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "containers": containers if containers is not None else [{"name": "app", "image": "x"}]
    }
    if init is not None:
        body["initContainers"] = init
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": body}


def _container(name: str = "app", **resources: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "image": "x", "resources": resources}


MIG = _container(requests={"nvidia.com/mig-1g.10gb": "1", "cpu": "1"})
PLAIN = _container(requests={"cpu": "1", "memory": "1Gi"})


def _review(
    obj: Any, *, operation: str = "CREATE", kind: str = "Pod", uid: str = "u-1"
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": uid,
            "kind": {"group": "", "version": "v1", "kind": kind},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "operation": operation,
            "namespace": "default",
            "object": obj,
        },
    }


def _answer(document: Any, *, fresh: bool = True) -> dict[str, Any]:
    out = admission.review(document, lease_fresh=fresh)
    assert out["apiVersion"] == "admission.k8s.io/v1"
    assert out["kind"] == "AdmissionReview"
    response = dict(out["response"])
    assert response["allowed"] is True  # never rejects
    json.dumps(out)  # serialisable as is
    return response


def _patch(response: dict[str, Any]) -> list[dict[str, Any]]:
    assert response["patchType"] == "JSONPatch"
    patch: list[dict[str, Any]] = json.loads(base64.b64decode(response["patch"]))
    return patch


def _apply(obj: dict[str, Any], patch: list[dict[str, Any]]) -> dict[str, Any]:
    """A minimal RFC 6902 'add' (all the webhook sends), to check the result."""
    out = json.loads(json.dumps(obj))
    for op in patch:
        assert op["op"] == "add"
        *parents, last = [
            t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]
        ]
        target = out
        for token in parents:
            target = target[token]
        if last == "-":
            target.append(op["value"])
        else:
            target[last] = op["value"]
    return out


# --- the matrix --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pod", "fresh", "outcome"),
    [
        (_pod(containers=[MIG]), True, admission.Outcome.GATED),
        (_pod(containers=[PLAIN]), True, admission.Outcome.NO_MIG_REQUEST),
        (_pod(containers=[{"name": "app"}]), True, admission.Outcome.NO_MIG_REQUEST),
        (_pod(containers=[MIG], schedulingGates=[GATE]), True, admission.Outcome.ALREADY_GATED),
        (_pod(containers=[MIG], nodeName="n1"), True, admission.Outcome.BOUND),
        (_pod(containers=[MIG]), False, admission.Outcome.LEASE_STALE),
        (_pod(containers=[PLAIN], init=[MIG]), True, admission.Outcome.GATED),
        (
            _pod(containers=[_container(limits={"nvidia.com/mig-3g.40gb": 1})]),
            True,
            admission.Outcome.GATED,
        ),
        (
            _pod(containers=[_container(requests={"nvidia.com/mig-1g.10gb": "0"})]),
            True,
            admission.Outcome.NO_MIG_REQUEST,
        ),
        (
            _pod(containers=[_container(requests={"nvidia.com/gpu": "1"})]),
            True,
            admission.Outcome.NO_MIG_REQUEST,
        ),
        (
            _pod(containers=[_container(limits={"nvidia.com/gpu-10gb": "1"})]),
            True,
            admission.Outcome.GATED,
        ),
    ],
    ids=[
        "mig-gated",
        "plain-untouched",
        "no-resources",
        "already-gated",
        "node-name-set",
        "lease-stale",
        "init-container-mig",
        "limits-only",
        "zero-mig",
        "whole-gpu",
        "mps-slice",
    ],
)
def test_decision_matrix(pod: dict[str, Any], fresh: bool, outcome: admission.Outcome) -> None:
    decision = admission.decide(_review(pod), lease_fresh=fresh)
    assert decision.outcome is outcome
    response = _answer(_review(pod), fresh=fresh)
    assert response["uid"] == "u-1"
    assert ("patch" in response) == (outcome is admission.Outcome.GATED)
    assert "status" not in response
    assert "warnings" not in response


def test_gated_pod_gets_gate_and_label_when_both_absent() -> None:
    pod = _pod(containers=[MIG])
    patched = _apply(pod, _patch(_answer(_review(pod))))
    assert patched["spec"]["schedulingGates"] == [GATE]
    assert patched["metadata"]["labels"] == {"migpilot.io/gated": "true"}
    assert patched["spec"]["containers"] == pod["spec"]["containers"]


def test_gate_is_appended_to_existing_gates_and_labels_kept() -> None:
    pod = _pod(containers=[MIG], schedulingGates=[{"name": "kueue.x-k8s.io/admission"}])
    pod["metadata"]["labels"] = {"app": "train"}
    patch = _patch(_answer(_review(pod)))
    assert patch[0]["path"] == "/spec/schedulingGates/-"
    assert patch[1]["path"] == "/metadata/labels/migpilot.io~1gated"
    patched = _apply(pod, patch)
    assert patched["spec"]["schedulingGates"] == [{"name": "kueue.x-k8s.io/admission"}, GATE]
    assert patched["metadata"]["labels"] == {"app": "train", "migpilot.io/gated": "true"}


@pytest.mark.parametrize("gates", [None, []])
def test_null_or_empty_gates_are_replaced(gates: Any) -> None:
    pod = _pod(containers=[MIG], schedulingGates=gates)
    patched = _apply(pod, _patch(_answer(_review(pod))))
    assert patched["spec"]["schedulingGates"] == [GATE]


@pytest.mark.parametrize("uid", ["u-1", "705ab4f5-6393-11e8-b7cc-42010a800002"])
def test_uid_is_echoed(uid: str) -> None:
    assert _answer(_review(_pod(containers=[MIG]), uid=uid))["uid"] == uid
    assert _answer(_review("not a pod", uid=uid))["uid"] == uid


@pytest.mark.parametrize(
    ("operation", "kind"), [("UPDATE", "Pod"), ("DELETE", "Pod"), ("CREATE", "Deployment")]
)
def test_only_pod_creates_are_gated(operation: str, kind: str) -> None:
    document = _review(_pod(containers=[MIG]), operation=operation, kind=kind)
    assert admission.decide(document, lease_fresh=True).outcome is (
        admission.Outcome.NOT_POD_CREATE
    )
    assert "patch" not in _answer(document)


def test_a_subresource_create_is_not_gated() -> None:
    document = _review(_pod(containers=[MIG]))
    document["request"]["subResource"] = "binding"
    assert "patch" not in _answer(document)


# --- unified (HAMi-style) pods --------------------------------------------------------------------

MODE = "nvidia.com/vgpu-mode"


def _unified(annotations: dict[str, str] | None = None, **limits: Any) -> dict[str, Any]:
    """A pod with one container whose limits are ``limits`` (keys: ``gpu``, ``gpumem``...)."""
    resources = {f"nvidia.com/{k.replace('_', '-')}": v for k, v in limits.items()}
    pod = _pod(containers=[_container(limits=resources, requests=dict(resources))])
    if annotations is not None:
        pod["metadata"]["annotations"] = annotations
    return pod


@pytest.mark.parametrize(
    ("pod", "outcome"),
    [
        (_unified(gpu="1", gpumem="8000"), admission.Outcome.GATED),
        (_unified(gpu="1", gpumem="8k"), admission.Outcome.GATED),  # as the apiserver writes it
        (_unified(gpu="2", gpumem_percentage="50"), admission.Outcome.GATED),
        (_unified(gpu="1", gpucores="30"), admission.Outcome.GATED),
        (_unified({MODE: "mig"}, gpu="1"), admission.Outcome.GATED),
        (_unified({MODE: "MIG"}, gpu="1", gpumem="8000"), admission.Outcome.GATED),
        (
            _unified({"nvidia.com/use-gputype": "A100,V100"}, gpu="1", gpumem="8000"),
            admission.Outcome.GATED,  # V100 selects nothing; A100 is served
        ),
        # a request the planner reads but no model could serve: gated; the validating webhook
        # refuses it (and when that one is down, the controller says why in an event)
        (_unified(gpu="1", gpumem="900000"), admission.Outcome.GATED),
        (_unified(gpu="1"), admission.Outcome.NO_MIG_REQUEST),  # whole GPU: NVIDIA's plugin
        (_unified(gpu="0", gpumem="8000"), admission.Outcome.NO_MIG_REQUEST),  # asks for none
        (_unified({MODE: "mig"}), admission.Outcome.NO_MIG_REQUEST),  # nothing to plan
        (_unified({MODE: "hami-core"}, gpu="1", gpumem="8000"), admission.Outcome.OTHER_VGPU_MODE),
        (_unified({MODE: "mps"}, gpu="1"), admission.Outcome.GATED),  # an MPS slice
        (_unified({MODE: "vgpu"}, gpu="1"), admission.Outcome.OTHER_VGPU_MODE),
        (_unified(gpumem="8000"), admission.Outcome.BAD_UNIFIED_REQUEST),  # no nvidia.com/gpu
        (_unified(gpu="1", gpucores="101"), admission.Outcome.BAD_UNIFIED_REQUEST),
        (
            _unified(gpu="1", gpumem="1", gpumem_percentage="5"),
            admission.Outcome.BAD_UNIFIED_REQUEST,
        ),
        (
            _unified({"hami.io/gpu-scheduler-policy": "random"}, gpu="1", gpumem="8000"),
            admission.Outcome.BAD_UNIFIED_REQUEST,
        ),
    ],
    ids=[
        "gpumem",
        "gpumem-canonical",
        "percentage",
        "cores",
        "mode-mig",
        "mode-mig-upper",
        "unknown-filter-beside-a-known-one",
        "never-served",
        "whole-gpu",
        "zero-gpus",
        "mode-only",
        "hami-core",
        "mode-mps",
        "another-mode",
        "gpumem-without-gpu",
        "cores-out-of-range",
        "both-memories",
        "bad-policy",
    ],
)
def test_unified_decision_matrix(pod: dict[str, Any], outcome: admission.Outcome) -> None:
    assert admission.decide(_review(pod), lease_fresh=True).outcome is outcome
    response = _answer(_review(pod))
    assert ("patch" in response) == (outcome is admission.Outcome.GATED)
    # The validating webhook tells what is wrong with a unified request; this one stays quiet
    # (the user would read it twice).
    assert "warnings" not in response
    assert "status" not in response


def test_a_unified_pod_is_gated_and_labelled_as_a_mig_pod_is() -> None:
    pod = _unified(gpu="1", gpumem="8000")
    patched = _apply(pod, _patch(_answer(_review(pod))))
    assert patched["spec"]["schedulingGates"] == [GATE]
    assert patched["metadata"]["labels"] == {"migpilot.io/gated": "true"}


@pytest.mark.parametrize(
    ("change", "fresh", "outcome"),
    [
        ({"schedulingGates": [GATE]}, True, admission.Outcome.ALREADY_GATED),
        ({"nodeName": "n1"}, True, admission.Outcome.BOUND),
        ({}, False, admission.Outcome.LEASE_STALE),
    ],
)
def test_a_unified_pod_follows_the_same_gate_rules(
    change: dict[str, Any], fresh: bool, outcome: admission.Outcome
) -> None:
    pod = _unified(gpu="1", gpucores="50")
    pod["spec"].update(change)
    assert admission.decide(_review(pod), lease_fresh=fresh).outcome is outcome
    assert "patch" not in _answer(_review(pod), fresh=fresh)


def test_an_init_container_makes_a_pod_unified() -> None:
    pod = _pod(
        containers=[PLAIN],
        init=[_container("setup", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000"})],
    )
    assert admission.decide(_review(pod), lease_fresh=True).outcome is admission.Outcome.GATED


def test_mig_beside_unified() -> None:
    good = _unified(gpu="1", gpumem="8000")
    good["spec"]["containers"].append(MIG)
    assert admission.decide(_review(good), lease_fresh=True).outcome is admission.Outcome.GATED
    # MIG beside a unified request the planner cannot read: not gated (it could not be planned)
    bad = _unified(gpumem="8000")
    bad["spec"]["containers"].append(MIG)
    assert admission.decide(_review(bad), lease_fresh=True).outcome is (
        admission.Outcome.BAD_UNIFIED_REQUEST
    )
    # MIG in a pod another system serves the unified part of: gated for its MIG instances
    other = _unified({MODE: "hami-core"}, gpu="1", gpumem="8000")
    other["spec"]["containers"].append(MIG)
    assert admission.decide(_review(other), lease_fresh=True).outcome is admission.Outcome.GATED


# --- never reject: malformed input --------------------------------------------------------------


def _without(document: dict[str, Any], *path: str) -> dict[str, Any]:
    target = document
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    return document


@pytest.mark.parametrize(
    ("document", "message"),
    [
        (None, "not a JSON object"),
        ([1, 2], "not a JSON object"),
        ({"kind": "AdmissionReview"}, "expected an AdmissionReview of admission.k8s.io/v1"),
        (_without(_review(_pod()), "request"), "request is not an object"),
        (_without(_review(_pod()), "request", "uid"), "request.uid is missing"),
        (_without(_review(_pod()), "request", "object"), "request.object is not an object"),
        (_review({"metadata": {}}), "the pod's spec is not an object"),
        (_review({"metadata": [], "spec": {}}), "the pod's metadata is not an object"),
        (_review(_pod(containers="app")), "spec.containers is not a list"),  # type: ignore[arg-type]
        (_review(_pod(containers=["app"])), "spec.containers[0] is not an object"),
        (
            _review(_pod(containers=[{"name": "a", "resources": {"limits": [1]}}])),
            "container a: resources.limits is not an object",
        ),
        (
            _review(_pod(containers=[MIG], schedulingGates={"name": "x"})),
            "spec.schedulingGates is not a list",
        ),
        (
            _review({"metadata": {"annotations": ["x"]}, "spec": {"containers": []}}),
            "metadata.annotations is not an object",
        ),
    ],
)
def test_malformed_reviews_are_allowed_with_a_message(document: Any, message: str) -> None:
    assert admission.decide(document, lease_fresh=True).outcome is admission.Outcome.MALFORMED
    response = _answer(document)
    assert message in response["status"]["message"]
    assert any(message in w for w in response["warnings"])
    assert "patch" not in response


# --- malformed MIG resource names ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("resource", "spelling"),
    [
        ("nvidia.com/mig-1g.10gb+me", "nvidia.com/mig-1g.10gb.me"),
        ("nvidia.com/mig-1c.3g.40gb", "nvidia.com/mig-3g.40gb"),
        ("nvidia.com/mig-1G.10GB", "nvidia.com/mig-1g.10gb"),
    ],
)
def test_bad_resource_name_is_admitted_with_a_warning(resource: str, spelling: str) -> None:
    pod = _pod(containers=[_container(requests={resource: 1}, limits={resource: 1})])
    response = _answer(_review(pod))
    assert "patch" not in response  # the planner cannot place what no plugin advertises
    assert "status" not in response  # the pod itself is well formed
    [warning] = response["warnings"]  # one per resource, not per requests/limits
    assert resource in warning
    assert spelling in warning
    assert "container app" in warning


def test_bad_name_beside_a_good_one_still_gates_with_the_warning() -> None:
    pod = _pod(
        containers=[MIG],
        init=[_container("setup", limits={"nvidia.com/mig-1g.10gb+me": 1})],
    )
    response = _answer(_review(pod))
    assert "patch" in response
    [warning] = response["warnings"]
    assert "initContainer setup" in warning
    assert "nvidia.com/mig-1g.10gb.me" in warning


def test_a_count_too_long_to_read_warns() -> None:
    pod = _pod(containers=[_container(limits={"nvidia.com/mig-1g.10gb": "9" * 5000})])
    response = _answer(_review(pod))
    assert "patch" not in response
    assert "nvidia.com/mig-1g.10gb" in response["warnings"][0]


def test_unknown_profile_warns() -> None:
    pod = _pod(containers=[_container(requests={"nvidia.com/mig-lots": 1})])
    response = _answer(_review(pod))
    assert "patch" not in response
    assert "nvidia.com/mig-lots" in response["warnings"][0]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


@given(JSON)
def test_any_json_is_allowed(document: Any) -> None:
    response = _answer(document)
    assert "patch" not in response


# --- the Lease ---------------------------------------------------------------------------------

RENEWED = "2026-01-02T03:04:05.000000Z"
RENEWED_S = 1767323045.0


def _lease(**spec: Any) -> dict[str, Any]:
    base = {"holderIdentity": "controller-0", "renewTime": RENEWED, "leaseDurationSeconds": 15}
    base.update(spec)
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "spec": base}


@pytest.mark.parametrize(
    ("lease", "now", "fresh"),
    [
        (_lease(), RENEWED_S, True),
        (_lease(), RENEWED_S + 14.999, True),
        (_lease(), RENEWED_S + 15, False),  # renewTime + duration must be later than now
        (_lease(), RENEWED_S + 60, False),
        (_lease(), RENEWED_S - 100, True),  # renewed "in the future": clocks differ a little
        (_lease(holderIdentity=""), RENEWED_S, False),
        (_lease(holderIdentity=None), RENEWED_S, False),
        (_lease(renewTime=None), RENEWED_S, False),
        (_lease(renewTime="yesterday"), RENEWED_S, False),
        (_lease(renewTime="2026-13-02T03:04:05Z"), RENEWED_S, False),
        (_lease(renewTime="2026-02-30T03:04:05Z"), RENEWED_S, False),
        (_lease(leaseDurationSeconds=0), RENEWED_S, False),
        (_lease(leaseDurationSeconds=-5), RENEWED_S, False),
        (_lease(leaseDurationSeconds="15"), RENEWED_S, False),
        (_lease(leaseDurationSeconds=True), RENEWED_S, False),
        (_lease(renewTime="2026-01-02T04:04:05+01:00"), RENEWED_S + 10, True),
        (_lease(renewTime="2026-01-02T03:04:05Z"), RENEWED_S + 10, True),
        ({"spec": None}, RENEWED_S, False),
        ({}, RENEWED_S, False),
    ],
)
def test_lease_fresh(lease: dict[str, Any], now: float, fresh: bool) -> None:
    assert leases.fresh(lease, now) is fresh


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1970-01-01T00:00:00Z", 0.0),
        ("1970-01-01T00:00:01.250000Z", 1.25),
        ("1970-01-01T01:00:00+01:00", 0.0),
        ("1969-12-31T23:00:00-01:00", 0.0),
        ("2024-02-29T00:00:00Z", 1709164800.0),
    ],
)
def test_parse_time(text: str, seconds: float) -> None:
    assert leases.parse_time(text) == seconds


@pytest.mark.parametrize(
    "text", ["", "2024-02-29", "2023-02-29T00:00:00Z", "2024-01-01T24:00:00Z", 5]
)
def test_parse_time_rejects(text: Any) -> None:
    assert leases.parse_time(text) is None


@given(JSON)
def test_any_object_in_a_review_is_allowed_and_its_uid_echoed(obj: Any) -> None:
    response = _answer(_review(obj, uid="u-9"))
    assert response["uid"] == "u-9"


@given(
    st.lists(st.sampled_from([MIG, PLAIN, _container("b", limits={"nvidia.com/mig-1g.10gb": 2})])),
    st.lists(st.sampled_from([MIG, PLAIN])),
    st.lists(st.sampled_from([GATE, {"name": "other"}]), max_size=2, unique_by=lambda g: g["name"]),
)
def test_a_gated_pod_ends_with_exactly_one_gate(
    containers: list[dict[str, Any]], init: list[dict[str, Any]], gates: list[dict[str, str]]
) -> None:
    pod = _pod(containers=containers, init=init, schedulingGates=gates)
    response = _answer(_review(pod))
    patched = _apply(pod, _patch(response)) if "patch" in response else pod
    mig = MIG in containers or MIG in init or any(c["name"] == "b" for c in containers)
    assert patched["spec"]["schedulingGates"].count(GATE) == (1 if mig or GATE in gates else 0)


def test_warnings_are_capped_whatever_the_pod_holds() -> None:
    """One warning per misspelt MIG resource, and a pod may name thousands: the answer tells the
    first ones and counts the rest; a warning quoting a huge value is cut short."""
    requests = {f"nvidia.com/mig-{i}G.10GB": "1" for i in range(2000)}
    requests["nvidia.com/mig-1g.10gb"] = "[" * 5000
    pod = _pod(containers=[_container(requests=requests)])
    decision = admission.decide(_review(pod), lease_fresh=True)
    assert len(decision.warnings) == 2001
    response = _answer(_review(pod))
    warnings = response["warnings"]
    assert len(warnings) == reviews.MAX_LINES + 1
    assert warnings[-1] == f"+{2001 - reviews.MAX_LINES} more"
    assert all(len(w) <= reviews.MAX_LINE_CHARS for w in warnings)
    assert len(json.dumps(response)) < 20_000


def test_a_malformed_review_message_is_cut_short() -> None:
    pod = _pod()
    pod["metadata"]["annotations"] = {"k" * 100_000: 1}
    response = _answer(_review(pod))
    assert len(response["status"]["message"]) <= reviews.MAX_LINE_CHARS
    assert response["status"]["message"].startswith("migpilot webhook: admitted without a gate")
