"""The webhook's registration (the Mutating- and ValidatingWebhookConfigurations: fail open, 2 s,
CREATE pods, kube-system excluded, the same selectors; the deploy manifests and the chart's CEL
are the rendered ones) and its cached Lease reading."""

from __future__ import annotations

import base64
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import yaml

from migpilot.kube import memory as kubememory
from migpilot.kube import objects as kubeobjects
from migpilot.webhook import leases, registering

REPO = pathlib.Path(__file__).parents[2]
MANIFESTS = REPO / "deploy" / "webhook"
HELPERS = REPO / "deploy" / "helm" / "migpilot" / "templates" / "_helpers.tpl"


def test_configuration_fails_open_and_only_sees_pod_creates() -> None:
    doc = registering.configuration(ca_bundle=b"PEM", url="https://127.0.0.1:9443/mutate-pods")
    [hook] = doc["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None"
    assert hook["timeoutSeconds"] == 5
    assert hook["reinvocationPolicy"] == "Never"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["rules"] == [
        {
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "operations": ["CREATE"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    assert hook["clientConfig"] == {
        "url": "https://127.0.0.1:9443/mutate-pods",
        "caBundle": base64.b64encode(b"PEM").decode(),
    }
    [term] = hook["namespaceSelector"]["matchExpressions"]
    assert term["operator"] == "NotIn"
    assert "kube-system" in term["values"]
    [condition] = hook["matchConditions"]
    assert condition["expression"] == registering.GATE_CONDITION
    for needle in ("nvidia.com/mig-", "'nvidia.com/gpumem'", "'nvidia.com/gpucores'"):
        assert needle in condition["expression"]
    assert "'nvidia.com/gpumem-percentage'" in condition["expression"]
    assert "'nvidia.com/vgpu-mode' in object.metadata.annotations" in condition["expression"]


def test_the_validating_configuration_fails_open_beside_the_mutating_one() -> None:
    kwargs: dict[str, Any] = {
        "ca_bundle": b"PEM",
        "service": ("gpu-system", "mp-webhook"),
        "excluded_namespaces": ("kube-system", "gpu-system"),
        "name": "mp-webhook",
    }
    mutating = registering.configuration(**kwargs)
    validating = registering.validating_configuration(**kwargs)
    assert validating["kind"] == "ValidatingWebhookConfiguration"
    assert validating["metadata"] == {"name": "mp-webhook"}
    [hook] = validating["webhooks"]
    [gate] = mutating["webhooks"]
    assert hook["name"] == "validate.pods.migpilot.io" != gate["name"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None"
    assert hook["admissionReviewVersions"] == ["v1"]
    assert hook["timeoutSeconds"] == 5
    assert "reinvocationPolicy" not in hook  # mutating webhooks only
    assert hook["clientConfig"]["service"] == {
        "namespace": "gpu-system",
        "name": "mp-webhook",
        "path": "/validate-pods",
        "port": 443,
    }
    assert gate["clientConfig"]["service"]["path"] == "/mutate-pods"
    # A pod is seen by both webhooks or by neither (the validating one: unified pods only).
    for key in ("rules", "namespaceSelector", "objectSelector", "matchPolicy"):
        assert hook[key] == gate[key], key
    [condition] = hook["matchConditions"]
    assert condition["expression"] == registering.UNIFIED_CONDITION
    assert "nvidia.com/mig-" not in condition["expression"]
    gating = gate["matchConditions"][0]["expression"]
    for also in (
        "r.startsWith('nvidia.com/mig-') || ",
        "r.startsWith('nvidia.com/gpu-') || ",
        " || r == 'nvidia.com/gpu'",  # whole-GPU pods: gated only with a dynamic node
    ):
        assert also in gating
        gating = gating.replace(also, "")
    assert condition["expression"] in gating


@pytest.mark.parametrize(
    "kwargs", [{}, {"url": "https://x", "service": ("ns", "svc")}], ids=["neither", "both"]
)
def test_configuration_needs_exactly_one_address(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        registering.configuration(ca_bundle=b"", **kwargs)
    with pytest.raises(ValueError, match="exactly one"):
        registering.validating_configuration(ca_bundle=b"", **kwargs)


@pytest.mark.parametrize(
    ("render", "file"),
    [
        (registering.configuration, "mutatingwebhookconfiguration.yaml"),
        (registering.validating_configuration, "validatingwebhookconfiguration.yaml"),
    ],
)
def test_deploy_manifests_are_the_rendered_configurations(
    render: Callable[..., dict[str, Any]], file: str
) -> None:
    manifest = yaml.safe_load((MANIFESTS / file).read_text())
    rendered = render(
        ca_bundle=b"",
        service=("migpilot-system", "migpilot-webhook"),
        excluded_namespaces=("kube-system", "migpilot-system"),
    )
    rendered["webhooks"][0]["clientConfig"]["caBundle"] = "${CA_BUNDLE}"
    assert manifest == rendered


@pytest.mark.parametrize(
    ("define", "expression"),
    [
        ("migpilot.gateCondition", registering.GATE_CONDITION),
        ("migpilot.unifiedCondition", registering.UNIFIED_CONDITION),
    ],
)
def test_the_charts_cel_is_the_rendered_one(define: str, expression: str) -> None:
    """The whole chart is compared with the renderings in tests/e2e/test_helm.py (it needs
    helm); the CEL, the part most easily mistyped, is checked here too."""
    head = "{{- define " + f'"{define}"' + " -}}\n"
    text = HELPERS.read_text()
    start = text.index(head) + len(head)
    assert text[start : text.index("\n{{- end -}}", start)] == expression


# --- the cached Lease ----------------------------------------------------------------------------


class _Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class _Failing:
    def __init__(self) -> None:
        self.reads = 0

    def read(self) -> Mapping[str, Any]:
        self.reads += 1
        raise ConnectionError("apiserver unreachable")


def _lease(renewed: str = "1970-01-01T00:01:40Z", duration: int = 15) -> dict[str, Any]:
    return {
        "metadata": {"name": "migpilot-controller", "namespace": "migpilot-system"},
        "spec": {
            "holderIdentity": "c-0",
            "renewTime": renewed,  # 100 s after the epoch
            "leaseDurationSeconds": duration,
        },
    }


class _Stored:
    """The controller's Lease in an in-memory API server, and the webhook's reader of it."""

    def __init__(self, lease: dict[str, Any] | None) -> None:
        self.api = kubememory.InMemoryServer()
        self.source = leases.KubeLease(
            self.api, name="migpilot-controller", namespace="migpilot-system"
        )
        if lease is not None:
            self.put(lease)

    def put(self, lease: dict[str, Any]) -> None:
        self.api.put(kubeobjects.Kind.LEASES, lease)

    @property
    def reads(self) -> int:
        return self.api.requests["get", kubeobjects.Kind.LEASES]


def test_lease_is_read_at_most_once_per_cache_period() -> None:
    stored = _Stored(_lease())
    clock = _Clock(100.0)
    freshness = leases.Freshness(stored.source, cache_s=2.0, clock=clock)
    assert freshness.fresh()
    clock.now = 101.9
    assert freshness.fresh()
    assert stored.reads == 1
    clock.now = 102.0
    assert freshness.fresh()
    assert stored.reads == 2


def test_cached_lease_expires_between_reads() -> None:
    stored = _Stored(_lease(duration=1))
    clock = _Clock(100.5)
    freshness = leases.Freshness(stored.source, cache_s=10.0, clock=clock)
    assert freshness.fresh()
    clock.now = 101.0  # renewTime + 1 s: no longer later than now
    assert not freshness.fresh()
    assert stored.reads == 1


def test_lease_is_reread_when_the_clock_goes_back() -> None:
    stored = _Stored(_lease())
    clock = _Clock(100.0)
    freshness = leases.Freshness(stored.source, cache_s=2.0, clock=clock)
    freshness.fresh()
    clock.now = 90.0
    freshness.fresh()
    assert stored.reads == 2


def test_missing_lease_is_not_fresh_until_it_appears() -> None:
    stored = _Stored(None)
    clock = _Clock(100.0)
    freshness = leases.Freshness(stored.source, cache_s=2.0, clock=clock)
    assert not freshness.fresh()
    stored.put(_lease())
    assert not freshness.fresh()  # cached
    clock.now = 102.5
    stored.put(_lease("1970-01-01T00:01:42Z"))
    assert freshness.fresh()


def test_errors_reading_the_lease_fail_open(caplog: pytest.LogCaptureFixture) -> None:
    source = _Failing()
    freshness = leases.Freshness(source, cache_s=2.0, clock=_Clock(100.0))
    assert not freshness.fresh()
    assert source.reads == 1
    assert "apiserver unreachable" in caplog.text


class _Flaky:
    """A Lease source whose reads fail while ``down``."""

    def __init__(self, stored: _Stored) -> None:
        self.stored = stored
        self.down = False

    def read(self) -> Mapping[str, Any]:
        if self.down:
            raise TimeoutError("The read operation timed out")
        return self.stored.source.read()


def test_a_failed_read_keeps_the_last_lease_judged_by_its_own_times(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One read that times out on a busy API server does not let pods through ungated (the
    scale bench's 1,000 nodes: pods made in those 2 s took instances reserved for pinned
    pods); a controller that stopped renewing still goes stale when its Lease says."""
    stored = _Stored(_lease(duration=15))  # renewed at 100 s, fresh until 115 s
    source = _Flaky(stored)
    clock = _Clock(100.0)
    freshness = leases.Freshness(source, cache_s=2.0, clock=clock)
    assert freshness.fresh()
    source.down = True
    clock.now = 103.0
    assert freshness.fresh()  # the read failed: the last Lease, still fresh by its renew time
    assert "judged by its renew time" in caplog.text
    clock.now = 115.0
    assert not freshness.fresh()  # not renewed since: stale, read or no read
    source.down = False
    stored.put(_lease("1970-01-01T00:01:56Z"))  # renewed at 116 s
    clock.now = 117.0
    assert freshness.fresh()


def test_a_lease_that_is_gone_is_stale_at_once() -> None:
    """A controller that stopped cleanly releases (or deletes) its Lease: not found fails open
    now, however fresh the last Lease read was."""
    stored = _Stored(_lease(duration=15))
    clock = _Clock(100.0)
    freshness = leases.Freshness(stored.source, cache_s=2.0, clock=clock)
    assert freshness.fresh()
    stored.api.remove(kubeobjects.Kind.LEASES, "migpilot-controller", namespace="migpilot-system")
    clock.now = 102.0
    assert not freshness.fresh()
