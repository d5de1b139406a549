"""The planner's reading of DRA claims for migpilot's devices (planning/draclaims.py): the forms
the shipped claim templates use are read, anything else is refused by name, and every selector
the simulator writes reads back as itself."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from migpilot.mig import catalog
from migpilot.planning import draclaims, snapshot, unified
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
        # '&&' and parentheses inside a literal neither split nor close anything.
        (f'(device.attributes[{D}].model == "a) && (b")', Selector(model="a) && (b")),
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
        # An escaped quote does not end the literal: the term is refused whole, not split.
        (f'device.attributes[{D}].model == "a\\" && b"', re.escape('"a\\\\" && b"')),
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


_OTHER = {"name": "o", "exactly": {"deviceClassName": "rdma.example.com"}}
_EITHER = {
    "name": "e",
    "firstAvailable": [
        {"name": "a", "deviceClassName": "rdma.example.com"},
        {"name": "b", "deviceClassName": "mig.migpilot.io"},
    ],
}


@pytest.mark.parametrize(
    ("spec", "ours"),
    [
        ({"devices": {"requests": [_req()]}}, True),
        ({"devices": {"requests": [_OTHER, _EITHER]}}, True),
        ({"devices": {"requests": [_OTHER]}}, False),
        ({"devices": {"requests": []}}, False),
        ({}, False),
        # Sequences other than lists, as parse_claim_spec takes them: the controller read such
        # specs as naming the class before it asked names_class (it had its own copy).
        ({"devices": {"requests": (_req(),)}}, True),
        (
            {
                "devices": {
                    "requests": ({**_EITHER, "firstAvailable": tuple(_EITHER["firstAvailable"])},)
                }
            },
            True,
        ),
        # Not shaped as the API says: names nothing, never raises.
        ({"devices": {"requests": "mig.migpilot.io"}}, False),
        ({"devices": {"requests": [{"name": "r", "firstAvailable": "mig.migpilot.io"}]}}, False),
        ({"devices": {"requests": [{"name": "r", "exactly": ["mig.migpilot.io"]}]}}, False),
        ({"devices": ["mig.migpilot.io"]}, False),
        ("mig.migpilot.io", False),
        (None, False),
    ],
)
def test_names_class_agrees_with_the_parser(spec: Any, ours: bool) -> None:
    assert draclaims.names_class(spec) is ours
    try:
        read = draclaims.parse_claim_spec(spec, where="claim ns/c")
    except NotUnderstood:
        return
    # What the planner reads as asking for migpilot's class, names_class names.
    assert bool(read.requests) is ours


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


def _spec(
    *selectors: Selector, count: int = 1, others: tuple[str, ...] = ()
) -> draclaims.ClaimSpec:
    return draclaims.ClaimSpec(
        tuple(draclaims.Request(f"r{i}", count, (s,)) for i, s in enumerate(selectors)), others
    )


def _asked(*claims: draclaims.ClaimSpec) -> draclaims.Asked:
    return draclaims.planner_requests(claims, cpu_milli=500, memory_bytes=2**30, where="pod ns/p")


def test_claims_by_profile_are_mig_requests_summed_by_profile() -> None:
    got = _asked(
        _spec(Selector(profile="1g.10gb"), Selector(profile="3g.40gb")),
        _spec(Selector(profile="1g.10gb", model="h100-80gb"), count=2),
    )
    assert got.requests == snapshot.Requests(
        (snapshot.MigRequest("1g.10gb", 3), snapshot.MigRequest("3g.40gb", 1)), 500, 2**30
    )
    assert got.model == "h100-80gb"


def test_claims_by_memory_or_model_alone_are_a_unified_request_in_mig_mode() -> None:
    got = _asked(_spec(Selector(min_memory_mib=20480), Selector(kind="mig", model="a100-80gb")))
    assert got.requests.mig == ()
    assert got.requests.unified == unified.UnifiedRequest(
        asks=(unified.GpuAsk(count=1, memory_mib=20480), unified.GpuAsk(count=1, memory_mib=1)),
        mode=unified.MIG_MODE,
    )
    assert got.model == "a100-80gb"
    # The smallest profile that holds the memory, as first fit over smallest-first slices.
    h100 = catalog.resolve_gpu("h100-80gb")
    assert got.requests.unified is not None
    by_memory, alone = got.requests.unified.asks
    assert unified.profile_for(by_memory, h100) == "3g.40gb"  # 20 GiB: above 2g.20gb's 20,096 MiB
    assert unified.profile_for(alone, h100) == "1g.10gb"


def test_whole_gpus_are_whole_gpu_requests() -> None:
    got = _asked(_spec(Selector(kind="gpu"), count=2))
    assert got.requests.whole == 2 and got.requests.mig == ()


@pytest.mark.parametrize(
    ("claims", "named"),
    [
        ((_spec(Selector(profile="1g.10gb"), others=("nic",)),), "other drivers"),
        ((draclaims.ClaimSpec(()),), "none of migpilot"),
        (
            (
                draclaims.ClaimSpec(
                    (
                        draclaims.Request(
                            "any", 1, (Selector(profile="1g.10gb"), Selector(profile="2g.20gb"))
                        ),
                    )
                ),
            ),
            "firstAvailable",
        ),
        ((_spec(Selector(profile="1g.10gb", min_memory_mib=10000)),), "together"),
        ((_spec(Selector(model="a100-80gb"), Selector(model="h100-80gb")),), "models"),
        ((_spec(Selector(kind="gpu"), Selector(profile="1g.10gb")),), "one kind per pod"),
        ((_spec(Selector(profile="1g.10gb"), Selector(min_memory_mib=1)),), "one kind per pod"),
        ((_spec(Selector(kind="gpu", min_memory_mib=1)),), "whole GPU by memory"),
    ],
)
def test_what_the_planner_cannot_plan_is_refused_naming_the_pod(
    claims: tuple[draclaims.ClaimSpec, ...], named: str
) -> None:
    with pytest.raises(NotUnderstood, match=f"pod ns/p: .*{named}"):
        _asked(*claims)


def test_a_literal_ending_in_an_escaped_backslash_is_closed_by_its_quote() -> None:
    # `"x\\"` is the string x\ : its second quote closes it, so the parentheses after it count,
    # and the outer pair of `(a == "x\\") && (b)` is not one pair to strip.
    inner = f'device.attributes[{D}].model == "x\\\\") && (device.driver == {D}'
    assert not draclaims._balanced(inner)
    assert draclaims._balanced('(a == "x\\\\") && (b == ")(")')
