"""The planner's reading of DRA claims for migpilot's devices (planning/draclaims.py): the forms
the shipped claim templates use are read, anything else is refused by name, and every selector
the simulator writes reads back as itself."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from migpilot.planning import draclaims
from migpilot.planning.draclaims import NotUnderstood, Selector

ROOT = Path(__file__).resolve().parents[2]
D = '"mig.migpilot.io"'


@dataclass(frozen=True)
class Dev:
    profile: str
    memory_mib: int
    model: str


def test_the_shipped_templates_are_read() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/dra/claimtemplates.yaml").read_text()))
    read = {
        d["metadata"]["name"]: draclaims.parse_claim_spec(d["spec"]["spec"], where="t")
        for d in docs
    }
    assert read["mig-1g-10gb"].requests == (
        draclaims.Request("mig", 1, (Selector(profile="1g.10gb"),)),
    )
    assert read["mig-20gi"].requests == (
        draclaims.Request("mig", 1, (Selector(kind="mig", min_memory_mib=20 * 1024),)),
    )
    assert read["mig-h100-80gb"].requests == (
        draclaims.Request("mig", 1, (Selector(kind="mig", model="h100-80gb"),)),
    )
    assert all(not c.others for c in read.values())


@pytest.mark.parametrize(
    ("expression", "want"),
    [
        (f'device.attributes[{D}].profile == "3g.40gb"', Selector(profile="3g.40gb")),
        (f'"3g.40gb" == device.attributes[{D}].profile', Selector(profile="3g.40gb")),
        (f'device.attributes[{D}]["model"] == "a100-80gb"', Selector(model="a100-80gb")),
        (
            f'(device.driver == {D}) && (device.attributes[{D}].type == "gpu")',
            Selector(kind="gpu"),
        ),
        (
            f'device.capacity[{D}].memory.compareTo(quantity("20G")) >= 0',
            Selector(min_memory_mib=19074),  # 20e9 bytes: the least whole MiB at or above
        ),
        (
            f'device.capacity[{D}].memory.compareTo(quantity("40192Mi")) > 0',
            Selector(min_memory_mib=40193),
        ),
        (
            f'device.capacity[{D}].memory.compareTo(quantity("10Gi")) >= 0 && '
            f'device.capacity[{D}].memory.compareTo(quantity("20Gi")) >= 0',
            Selector(min_memory_mib=20480),
        ),
        ("true", Selector()),
        (f'device.attributes[{D}].profile\n   == "1g.10gb"', Selector(profile="1g.10gb")),
    ],
)
def test_the_understood_forms(expression: str, want: Selector) -> None:
    assert draclaims.parse_selector(expression) == want


@pytest.mark.parametrize(
    ("expression", "named"),
    [
        (f'device.attributes[{D}].profile == "1g.10gb" || true', "'||'"),
        (f'!(device.attributes[{D}].profile == "1g.10gb")', "negation"),
        (f'device.attributes[{D}].gpuUUID == "GPU-1"', "profile, model and type"),
        ('device.attributes["gpu.nvidia.com"].profile == "1g.10gb"', "the term"),
        (
            f'device.attributes[{D}].profile == "1g.10gb" && '
            f'device.attributes[{D}].profile == "2g.20gb"',
            "contradicts",
        ),
        (f'device.attributes[{D}].type == "vgpu"', "type is one of"),
        (
            f'device.attributes[{D}].profile == "whole" && device.attributes[{D}].type == "mig"',
            "never profile",
        ),
        (f'device.capacity[{D}].memory.compareTo(quantity("1e1000000")) >= 0', "quantity"),
        (f'device.attributes[{D}].profile == "1g.10gb" && ', "empty term"),
        ("x" * 20_000, "characters"),
    ],
)
def test_anything_else_is_refused_by_name(expression: str, named: str) -> None:
    with pytest.raises(NotUnderstood, match=named):
        draclaims.parse_selector(expression)


def _req(**exactly: Any) -> dict[str, Any]:
    return {"name": "r", "exactly": {"deviceClassName": "mig.migpilot.io", **exactly}}


def _sel(expression: str) -> list[dict[str, Any]]:
    return [{"cel": {"expression": expression}}]


def test_a_claim_with_counts_lists_and_another_drivers_request() -> None:
    spec = {
        "devices": {
            "requests": [
                _req(count=2, selectors=_sel(f'device.attributes[{D}].profile == "1g.10gb"')),
                {
                    "name": "any",
                    "firstAvailable": [
                        {
                            "name": "a",
                            "deviceClassName": "mig.migpilot.io",
                            "selectors": _sel(f'device.attributes[{D}].profile == "1g.20gb"'),
                        },
                        {
                            "name": "b",
                            "deviceClassName": "mig.migpilot.io",
                            "selectors": _sel(f'device.attributes[{D}].profile == "2g.20gb"'),
                        },
                    ],
                },
                {"name": "nic", "exactly": {"deviceClassName": "rdma.example.com"}},
            ]
        }
    }
    got = draclaims.parse_claim_spec(spec, where="claim ns/c")
    assert got.requests == (
        draclaims.Request("r", 2, (Selector(profile="1g.10gb"),)),
        draclaims.Request("any", 1, (Selector(profile="1g.20gb"), Selector(profile="2g.20gb"))),
    )
    assert got.others == ("nic",)


def test_two_selectors_of_one_request_both_hold() -> None:
    spec = {
        "devices": {
            "requests": [
                _req(
                    selectors=[
                        *_sel(f'device.attributes[{D}].model == "h100-80gb"'),
                        *_sel(f'device.capacity[{D}].memory.compareTo(quantity("20Gi")) >= 0'),
                    ]
                )
            ]
        }
    }
    (r,) = draclaims.parse_claim_spec(spec, where="c").requests
    assert r.alternatives == (Selector(model="h100-80gb", min_memory_mib=20480),)


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        ({"devices": {"requests": [_req(allocationMode="All")]}}, "every matching device"),
        ({"devices": {"requests": [_req(adminAccess=True)]}}, "adminAccess"),
        ({"devices": {"requests": [_req(count=0)]}}, "count 0"),
        ({"devices": {"requests": [_req(count="2")]}}, "count '2'"),
        (
            {"devices": {"requests": [_req()], "constraints": [{"matchAttribute": "x"}]}},
            "constraints",
        ),
        ({"devices": {"requests": [{"name": "r"}]}}, "exactly one of"),
        ({"devices": {"requests": [{"name": "r", "exactly": {}}]}}, "no deviceClassName"),
        ({"devices": {"requests": [_req(selectors=[{"cel": {}}])]}}, "not a CEL selector"),
        ({"devices": {"requests": "x"}}, "not a list"),
        ([], "not an object"),
        (
            {
                "devices": {
                    "requests": [
                        {
                            "name": "r",
                            "firstAvailable": [
                                {"deviceClassName": "mig.migpilot.io"},
                                {"deviceClassName": "other"},
                            ],
                        }
                    ]
                }
            },
            "mixes",
        ),
        (
            {
                "devices": {
                    "requests": [
                        {
                            "name": "r",
                            "firstAvailable": [
                                {"deviceClassName": "mig.migpilot.io"},
                                {"deviceClassName": "mig.migpilot.io", "count": 2},
                            ],
                        }
                    ]
                }
            },
            "different counts",
        ),
        (
            {"devices": {"requests": [_req(selectors=_sel(f'device.attributes[{D}].x == "y"'))]}},
            r"claim ns/c: request 'r'\.selectors\[0\]",
        ),
    ],
)
def test_claims_the_planner_cannot_read_are_refused_naming_the_part(spec: Any, named: str) -> None:
    with pytest.raises(NotUnderstood, match=named):
        draclaims.parse_claim_spec(spec, where="claim ns/c")


selectors = st.builds(
    Selector,
    profile=st.none() | st.sampled_from(["1g.10gb", "3g.40gb", "1g.20gb+me", "whole"]),
    min_memory_mib=st.none() | st.integers(0, 200_000),
    model=st.none() | st.sampled_from(["a100-80gb", "h100-80gb"]),
    kind=st.none() | st.sampled_from(["mig", "gpu"]),
).filter(lambda s: not (s.profile == "whole" and s.kind == "mig"))


@given(selectors)
def test_every_selector_reads_back_as_itself(selector: Selector) -> None:
    assert draclaims.parse_selector(selector.cel()) == selector


@given(
    selectors,
    st.builds(
        Dev,
        profile=st.sampled_from(["1g.10gb", "3g.40gb", "whole"]),
        memory_mib=st.integers(0, 200_000),
        model=st.sampled_from(["a100-80gb", "h100-80gb"]),
    ),
)
def test_matching_holds_each_condition(selector: Selector, dev: Dev) -> None:
    want = (
        (selector.profile is None or dev.profile == selector.profile)
        and (selector.model is None or dev.model == selector.model)
        and (selector.min_memory_mib is None or dev.memory_mib >= selector.min_memory_mib)
        and (selector.kind is None or (selector.kind == "gpu") == (dev.profile == "whole"))
    )
    assert selector.matches(dev) is want
