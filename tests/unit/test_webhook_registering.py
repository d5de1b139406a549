"""The webhook's registration (the MutatingWebhookConfiguration: fail open, 2 s, CREATE pods,
kube-system excluded; the deploy manifest is the rendered one) and its cached Lease reading."""

from __future__ import annotations

import base64
import pathlib
from collections.abc import Mapping
from typing import Any

import pytest
import yaml

from migpilot.webhook import leases, registering

MANIFEST = (
    pathlib.Path(__file__).parents[2] / "deploy" / "webhook" / "mutatingwebhookconfiguration.yaml"
)


def test_configuration_fails_open_and_only_sees_pod_creates() -> None:
    doc = registering.configuration(ca_bundle=b"PEM", url="https://127.0.0.1:9443/mutate-pods")
    [hook] = doc["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["sideEffects"] == "None"
    assert hook["timeoutSeconds"] == 2
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
    assert "nvidia.com/mig-" in hook["matchConditions"][0]["expression"]


@pytest.mark.parametrize(
    "kwargs", [{}, {"url": "https://x", "service": ("ns", "svc")}], ids=["neither", "both"]
)
def test_configuration_needs_exactly_one_address(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="exactly one"):
        registering.configuration(ca_bundle=b"", **kwargs)


def test_deploy_manifest_is_the_rendered_configuration() -> None:
    manifest = yaml.safe_load(MANIFEST.read_text())
    rendered = registering.configuration(
        ca_bundle=b"",
        service=("migpilot-system", "migpilot-webhook"),
        excluded_namespaces=("kube-system", "migpilot-system"),
    )
    rendered["webhooks"][0]["clientConfig"]["caBundle"] = "${CA_BUNDLE}"
    assert manifest == rendered


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
        "spec": {
            "holderIdentity": "c-0",
            "renewTime": renewed,  # 100 s after the epoch
            "leaseDurationSeconds": duration,
        }
    }


def test_lease_is_read_at_most_once_per_cache_period() -> None:
    source = leases.StaticLease(_lease())
    clock = _Clock(100.0)
    freshness = leases.Freshness(source, cache_s=2.0, clock=clock)
    assert freshness.fresh()
    clock.now = 101.9
    assert freshness.fresh()
    assert source.reads == 1
    clock.now = 102.0
    assert freshness.fresh()
    assert source.reads == 2


def test_cached_lease_expires_between_reads() -> None:
    source = leases.StaticLease(_lease(duration=1))
    clock = _Clock(100.5)
    freshness = leases.Freshness(source, cache_s=10.0, clock=clock)
    assert freshness.fresh()
    clock.now = 101.0  # renewTime + 1 s: no longer later than now
    assert not freshness.fresh()
    assert source.reads == 1


def test_lease_is_reread_when_the_clock_goes_back() -> None:
    source = leases.StaticLease(_lease())
    clock = _Clock(100.0)
    freshness = leases.Freshness(source, cache_s=2.0, clock=clock)
    freshness.fresh()
    clock.now = 90.0
    freshness.fresh()
    assert source.reads == 2


def test_missing_lease_is_not_fresh_until_it_appears() -> None:
    source = leases.StaticLease(None)
    clock = _Clock(100.0)
    freshness = leases.Freshness(source, cache_s=2.0, clock=clock)
    assert not freshness.fresh()
    source.lease = _lease()
    assert not freshness.fresh()  # cached
    clock.now = 102.5
    source.lease = _lease("1970-01-01T00:01:42Z")
    assert freshness.fresh()


def test_errors_reading_the_lease_fail_open(caplog: pytest.LogCaptureFixture) -> None:
    source = _Failing()
    freshness = leases.Freshness(source, cache_s=2.0, clock=_Clock(100.0))
    assert not freshness.fresh()
    assert source.reads == 1
    assert "apiserver unreachable" in caplog.text
