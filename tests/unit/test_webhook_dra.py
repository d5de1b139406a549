"""The webhook's decision on DRA pods: a pod whose ResourceClaim, or ResourceClaimTemplate, asks
for ``mig.migpilot.io`` devices is gated (while the Lease is fresh); one of another driver, or
whose claims cannot be read, is not (the controller would never let it go). The claims are read
as the server reads them (:func:`admission.to_read`, then :class:`claims.ClaimReader` over the
in-memory API server, then :func:`admission.review`), bounded in count, time and cache."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.kube import memory as kubememory
from migpilot.kube import objects as kubeobjects
from migpilot.webhook import admission, claims

CLASS = "mig.migpilot.io"
NS = "team-a"
TEMPLATES = kubeobjects.Kind.RESOURCECLAIMTEMPLATES
CLAIMS = kubeobjects.Kind.RESOURCECLAIMS


def _request(name: str = "gpu", cls: str = CLASS, **more: Any) -> dict[str, Any]:
    return {"name": name, "exactly": {"deviceClassName": cls, **more}}


def _claim_spec(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"devices": {"requests": list(requests)}}


def _template(name: str, spec: Any, *, namespace: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": spec},
    }


def _claim(name: str, spec: Any, *, allocated: bool = False) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }
    if allocated:
        doc["status"] = {"allocation": {"devices": {"results": [{"request": "gpu"}]}}}
    return doc


def _pod(*entries: dict[str, Any], **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "containers": [{"name": "app", "image": "x", "resources": {"claims": [{"name": "gpu"}]}}],
        "resourceClaims": list(entries),
        **spec,
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": body}


def _by_template(name: str, entry: str = "gpu") -> dict[str, Any]:
    return {"name": entry, "resourceClaimTemplateName": name}


def _by_claim(name: str, entry: str = "gpu") -> dict[str, Any]:
    return {"name": entry, "resourceClaimName": name}


def _review(obj: Any, *, namespace: str = NS) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "operation": "CREATE",
            "namespace": namespace,
            "object": obj,
        },
    }


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _Scene:
    """An in-memory API server, the webhook's claims reader over it, and the server's steps."""

    def __init__(self, *docs: tuple[kubeobjects.Kind, dict[str, Any]]) -> None:
        self.api = kubememory.InMemoryServer()
        self.clock = _Clock()
        self.reader = claims.ClaimReader(self.api, clock=self.clock)
        for kind, doc in docs:
            self.api.put(kind, doc)

    def answer(
        self, pod: Any, *, fresh: bool = True, namespace: str = NS
    ) -> tuple[admission.Decision, dict[str, Any]]:
        document = _review(pod, namespace=namespace)
        found = self.reader.read(admission.to_read(document, lease_fresh=fresh))
        decision = admission.decide(document, lease_fresh=fresh, claims=found)
        out = admission.review(document, lease_fresh=fresh, claims=found)
        response = dict(out["response"])
        assert response["allowed"] is True  # never rejects
        json.dumps(out)
        return decision, response

    @property
    def reads(self) -> int:
        return self.api.requests["get", TEMPLATES] + self.api.requests["get", CLAIMS]


def _gated(response: Mapping[str, Any]) -> bool:
    if "patch" not in response:
        return False
    patch = json.loads(base64.b64decode(response["patch"]))
    return {"op": "add", "path": "/spec/schedulingGates", "value": [{"name": admission.GATE}]} in (
        patch
    ) and any(p["path"] == "/metadata/labels" for p in patch)


OURS = _template("mig-1g", _claim_spec(_request(selectors=[])))
OTHER = _template("other-gpu", _claim_spec(_request(cls="gpu.nvidia.com")))


def test_a_pod_whose_template_asks_for_migpilots_class_is_gated() -> None:
    scene = _Scene((TEMPLATES, OURS))
    decision, response = scene.answer(_pod(_by_template("mig-1g")))
    assert decision.outcome is admission.Outcome.GATED_DRA
    assert _gated(response)
    assert "warnings" not in response
    assert scene.reads == 1


def test_a_first_available_subrequest_of_the_class_makes_the_pod_ours() -> None:
    spec = _claim_spec(
        {
            "name": "gpu",
            "firstAvailable": [
                {"name": "a", "deviceClassName": "gpu.nvidia.com"},
                {"name": "b", "deviceClassName": CLASS},
            ],
        }
    )
    scene = _Scene((TEMPLATES, _template("either", spec)))
    assert scene.answer(_pod(_by_template("either")))[0].outcome is admission.Outcome.GATED_DRA


def test_a_resource_claim_of_the_class_gates_unless_already_allocated() -> None:
    spec = _claim_spec(_request())
    scene = _Scene((CLAIMS, _claim("mine", spec)), (CLAIMS, _claim("shared", spec, allocated=True)))
    assert scene.answer(_pod(_by_claim("mine")))[0].outcome is admission.Outcome.GATED_DRA
    # Allocated already (shared with a pod that runs): kube-scheduler sends the pod to its node.
    decision, response = scene.answer(_pod(_by_claim("shared")))
    assert decision.outcome is admission.Outcome.NO_MIG_REQUEST
    assert "patch" not in response


def test_another_drivers_pod_is_left_alone_without_a_word() -> None:
    scene = _Scene((TEMPLATES, OTHER))
    decision, response = scene.answer(_pod(_by_template("other-gpu")))
    assert decision.outcome is admission.Outcome.NO_MIG_REQUEST
    assert "patch" not in response and "warnings" not in response


def test_a_template_not_there_yet_leaves_the_pod_ungated_with_a_warning() -> None:
    scene = _Scene()
    decision, response = scene.answer(_pod(_by_template("later")))
    assert decision.outcome is admission.Outcome.DRA_UNKNOWN
    assert "patch" not in response
    [warning] = response["warnings"]
    assert f"ResourceClaimTemplate {NS}/later not found" in warning
    assert "kube-scheduler allocates them without migpilot's plan" in warning
    # Not kept: once made, the next pod is read again and gated.
    scene.api.put(TEMPLATES, _template("later", _claim_spec(_request())))
    assert scene.answer(_pod(_by_template("later")))[0].outcome is admission.Outcome.GATED_DRA
    assert scene.reads == 2


def test_one_claim_of_ours_gates_whatever_the_others_are() -> None:
    scene = _Scene((TEMPLATES, OURS), (TEMPLATES, OTHER))
    pod = _pod(
        _by_template("other-gpu", "a"), _by_claim("not-yet", "b"), _by_template("mig-1g", "c")
    )
    decision, response = scene.answer(pod)
    assert decision.outcome is admission.Outcome.GATED_DRA
    assert _gated(response) and "warnings" not in response


def test_claims_are_read_in_the_pods_namespace() -> None:
    scene = _Scene((TEMPLATES, _template("mig-1g", _claim_spec(_request()), namespace="elsewhere")))
    assert admission.to_read(_review(_pod(_by_template("mig-1g"))), lease_fresh=True) == (
        admission.ClaimRef(True, NS, "mig-1g"),
    )
    assert scene.answer(_pod(_by_template("mig-1g")))[0].outcome is admission.Outcome.DRA_UNKNOWN
    decision, _ = scene.answer(_pod(_by_template("mig-1g")), namespace="elsewhere")
    assert decision.outcome is admission.Outcome.GATED_DRA


@pytest.mark.parametrize(
    ("pod", "fresh", "outcome"),
    [
        (_pod(_by_template("mig-1g")), False, admission.Outcome.LEASE_STALE),
        (_pod(_by_template("mig-1g"), nodeName="n1"), True, admission.Outcome.BOUND),
        (
            _pod(_by_template("mig-1g"), schedulingGates=[{"name": admission.GATE}]),
            True,
            admission.Outcome.ALREADY_GATED,
        ),
        (_pod(), True, admission.Outcome.NO_MIG_REQUEST),  # no claim at all
    ],
    ids=["stale-lease", "bound", "already-gated", "no-claims"],
)
def test_nothing_is_read_for_a_pod_that_cannot_be_gated(
    pod: dict[str, Any], fresh: bool, outcome: admission.Outcome
) -> None:
    scene = _Scene((TEMPLATES, OURS))
    decision, response = scene.answer(pod, fresh=fresh)
    assert decision.outcome is outcome
    assert "patch" not in response
    assert scene.reads == 0


def test_a_mig_pod_with_claims_is_gated_as_a_mig_pod_without_reading_them() -> None:
    scene = _Scene()
    pod = _pod(_by_template("anything"))
    pod["spec"]["containers"][0]["resources"]["limits"] = {"nvidia.com/mig-1g.10gb": "1"}
    decision, response = scene.answer(pod)
    assert decision.outcome is admission.Outcome.GATED
    assert _gated(response) and scene.reads == 0


class _Failing:
    """An API server that refuses every read (forbidden, timed out...)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.reads = 0

    def get(
        self, kind: kubeobjects.Kind, name: str, *, namespace: str | None = None
    ) -> Mapping[str, Any] | None:
        self.reads += 1
        raise self.error


def test_a_failed_read_leaves_the_pod_ungated_and_is_not_kept() -> None:
    reader = claims.ClaimReader(_Failing(TimeoutError("timed out\nsecond line")))
    document = _review(_pod(_by_template("mig-1g")))
    found = reader.read(admission.to_read(document, lease_fresh=True))
    decision = admission.decide(document, lease_fresh=True, claims=found)
    assert decision.outcome is admission.Outcome.DRA_UNKNOWN
    [warning] = decision.warnings
    assert f"ResourceClaimTemplate {NS}/mig-1g: not read: timed out" in warning
    assert "second line" not in warning
    reader.read(admission.to_read(document, lease_fresh=True))
    assert reader.reads == 2  # a failure is not kept


def test_a_pod_given_no_reads_is_not_gated() -> None:
    document = _review(_pod(_by_template("mig-1g")))
    decision = admission.decide(document, lease_fresh=True)
    assert decision.outcome is admission.Outcome.DRA_UNKNOWN
    assert f"ResourceClaimTemplate {NS}/mig-1g not read" in decision.warnings[0]


def test_found_claims_are_kept_a_few_seconds_and_one_read_serves_many_pods() -> None:
    scene = _Scene((TEMPLATES, OURS))
    for _ in range(5):  # a Deployment's replicas from one template
        assert scene.answer(_pod(_by_template("mig-1g")))[0].outcome is (
            admission.Outcome.GATED_DRA
        )
    assert scene.reads == 1
    # Made again with another class: judged by the old one until the cache lets it go.
    scene.api.put(TEMPLATES, _template("mig-1g", _claim_spec(_request(cls="gpu.nvidia.com"))))
    scene.clock.now += claims.CACHE_S
    assert scene.answer(_pod(_by_template("mig-1g")))[0].outcome is (
        admission.Outcome.NO_MIG_REQUEST
    )
    assert scene.reads == 2
    scene.clock.now -= 100  # a clock gone back reads again
    scene.answer(_pod(_by_template("mig-1g")))
    assert scene.reads == 3


def test_the_cache_holds_at_most_its_bound() -> None:
    api = kubememory.InMemoryServer()
    for i in range(5):
        api.put(TEMPLATES, _template(f"t{i}", _claim_spec(_request())))
    reader = claims.ClaimReader(api, max_entries=3)
    refs = [admission.ClaimRef(True, NS, f"t{i}") for i in range(5)]
    reader.read(refs)
    reader.read(refs[2:])  # the last three are kept
    assert reader.reads == 5
    reader.read(refs[:1])
    assert reader.reads == 6


class _Slow:
    """Each read takes a second of the reader's clock."""

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.api = kubememory.InMemoryServer()

    def get(
        self, kind: kubeobjects.Kind, name: str, *, namespace: str | None = None
    ) -> Mapping[str, Any] | None:
        self.clock.now += 1.0
        return self.api.get(kind, name, namespace=namespace)


def test_the_reads_of_one_pod_stop_at_the_time_budget() -> None:
    clock = _Clock()
    slow = _Slow(clock)
    slow.api.put(TEMPLATES, OURS)
    reader = claims.ClaimReader(slow, clock=clock, budget_s=2.0)
    pod = _pod(*(_by_claim(f"c{i}", f"e{i}") for i in range(5)), _by_template("mig-1g", "last"))
    document = _review(pod)
    found = reader.read(admission.to_read(document, lease_fresh=True))
    assert reader.reads == 2  # two seconds spent: the rest not read
    decision = admission.decide(document, lease_fresh=True, claims=found)
    assert decision.outcome is admission.Outcome.DRA_UNKNOWN
    assert "took 2 s" in decision.warnings[0]


@pytest.mark.parametrize(
    ("entries", "told"),
    [
        ([_by_template("../../api/v1/secrets")], "is not an object's name"),
        ([_by_template("UPPER")], "is not an object's name"),
        ([_by_template("x" * 254)], "is not an object's name"),
        ([_by_template(7)], "is not an object's name"),  # type: ignore[arg-type]
        ([{"name": "gpu"}], "names neither or both"),
        ([{"name": "gpu", "resourceClaimName": "a", "resourceClaimTemplateName": "b"}], "both"),
        (
            [_by_template(f"t{i}", f"e{i}") for i in range(admission.MAX_CLAIMS + 1)],
            f"more than {admission.MAX_CLAIMS} claims",
        ),
    ],
    ids=["path", "upper", "long", "number", "neither", "both", "too-many"],
)
def test_bad_claim_references_are_not_read_nor_gated(
    entries: list[dict[str, Any]], told: str
) -> None:
    scene = _Scene((TEMPLATES, OURS))
    decision, response = scene.answer(_pod(*entries))
    assert decision.outcome is admission.Outcome.DRA_UNKNOWN
    assert told in response["warnings"][0]
    assert "patch" not in response
    assert scene.reads == 0


def test_as_many_claims_as_the_bound_are_read_each_once() -> None:
    entries = [_by_template(f"t{i}", f"e{i}") for i in range(admission.MAX_CLAIMS)]
    document = _review(_pod(*entries, *entries))
    assert len(admission.to_read(document, lease_fresh=True)) == admission.MAX_CLAIMS


def test_a_bad_namespace_is_not_read() -> None:
    scene = _Scene((TEMPLATES, OURS))
    decision, response = scene.answer(_pod(_by_template("mig-1g")), namespace="a/b")
    assert decision.outcome is admission.Outcome.DRA_UNKNOWN
    assert "is not a namespace's name" in response["warnings"][0]
    assert scene.reads == 0


@pytest.mark.parametrize(
    "claims_field", ["nope", [1], [None], {"a": 1}], ids=["string", "number", "null", "object"]
)
def test_malformed_resource_claims_are_admitted_with_the_reason(claims_field: Any) -> None:
    pod = _pod()
    pod["spec"]["resourceClaims"] = claims_field
    decision, response = _Scene().answer(pod)
    assert decision.outcome is admission.Outcome.MALFORMED
    assert "spec.resourceClaims" in response["status"]["message"]


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    spec=st.one_of(
        _json,
        st.fixed_dictionaries({"devices": st.fixed_dictionaries({"requests": st.lists(_json)})}),
        st.fixed_dictionaries(
            {
                "devices": st.fixed_dictionaries(
                    {
                        "requests": st.lists(
                            st.fixed_dictionaries(
                                {"exactly": _json, "firstAvailable": _json, "name": _json}
                            )
                        )
                    }
                )
            }
        ),
    )
)
def test_any_stored_spec_is_judged_without_raising(spec: Any) -> None:
    scene = _Scene((TEMPLATES, _template("t", spec)), (CLAIMS, _claim("c", spec)))
    for entry in (_by_template("t"), _by_claim("c")):
        decision, _ = scene.answer(_pod(entry))
        assert decision.outcome in (
            admission.Outcome.GATED_DRA,
            admission.Outcome.NO_MIG_REQUEST,
        )


@settings(max_examples=200, deadline=None)
@given(
    entries=st.one_of(
        _json,
        st.lists(
            st.fixed_dictionaries(
                {},
                optional={
                    "name": _json,
                    "resourceClaimName": st.one_of(
                        _json, st.from_regex(r"[a-z0-9.-]{1,8}", fullmatch=True)
                    ),
                    "resourceClaimTemplateName": st.one_of(_json, st.text(max_size=300)),
                },
            ),
            max_size=40,
        ),
    ),
    namespace=st.one_of(st.none(), st.text(max_size=70), st.integers()),
)
def test_any_resource_claims_are_answered_without_raising(entries: Any, namespace: Any) -> None:
    document = _review(_pod())
    document["request"]["object"]["spec"]["resourceClaims"] = entries
    document["request"]["namespace"] = namespace
    refs = admission.to_read(document, lease_fresh=True)
    assert len(refs) <= admission.MAX_CLAIMS
    found = {
        ref: admission.ClaimLookup({"spec": {"spec": _claim_spec(_request())}}) for ref in refs
    }
    out = admission.review(document, lease_fresh=True, claims=found)
    assert out["response"]["allowed"] is True
    json.dumps(out)
