"""The GpuLayout API types: parse/write round trips, one-line errors naming the field, the
lifecycle table over every state, and the CRD YAML kept in step with the Python schema."""

from __future__ import annotations

import copy
import pathlib
import re
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.mig import catalog, layouts
from tests.unit import gpulayout_docs as docs

CRD = pathlib.Path(__file__).parents[2] / "deploy" / "crds" / "gpulayouts.migpilot.io.yaml"
S = gl.InstanceState


def test_parse_sorts_by_index_and_start_and_keeps_what_it_owns() -> None:
    layout = wire.parse(docs.mig())
    assert layout.name == "node-a"
    assert layout.generation == 3
    assert [g.index for g in layout.spec.gpus] == [0, 1]
    gpu1 = layout.spec.gpus[1]
    assert gpu1.model == "h100-80gb"
    assert gpu1.instances == (
        gl.InstanceSpec("1g.10gb", 0, "default/p1"),
        gl.InstanceSpec("3g.40gb", 4, None),
    )
    assert layout.spec.gpus[0].model is None
    assert layout.status is not None
    assert layout.status.gpus[0].instances[2] == gl.InstanceStatus("1g.10gb", 2, None, S.CREATING)
    assert layout.status.summary == gl.Summary(gpus=1, instances=4, free=1)
    assert layout.status.conditions[0].status is gl.ConditionStatus.TRUE


def test_to_document_round_trips_and_is_deterministic() -> None:
    layout = wire.parse(docs.mig())
    doc = wire.to_document(layout)
    assert wire.parse(doc) == layout
    assert wire.to_document(wire.parse(doc)) == doc
    assert "uid" not in doc["metadata"]
    assert doc["status"]["gpus"][0]["instances"][0]["state"] == "reserved"
    assert type(doc["status"]["gpus"][0]["instances"][0]["state"]) is str
    assert yaml.safe_dump(doc)  # plain data, no enum objects


def test_patches_hold_only_the_writers_fields() -> None:
    layout = wire.parse(docs.mig())
    spec = wire.spec_patch("node-a", layout.spec)
    assert set(spec) == {"apiVersion", "kind", "metadata", "spec"}
    assert spec["metadata"] == {"name": "node-a"}
    assert layout.status is not None
    status = wire.status_patch("node-a", layout.status)
    assert set(status) == {"apiVersion", "kind", "metadata", "status"}
    assert status["status"]["summary"] == {"gpus": 1, "instances": 4, "free": 1}


def test_a_used_instance_names_the_unified_pod_it_went_to() -> None:
    doc = docs.mig()
    doc["status"]["gpus"][0]["instances"][1]["usedBy"] = "default/p1"
    layout = wire.parse(doc)
    assert layout.status is not None
    assert layout.status.gpus[0].instances[1].used_by == "default/p1"
    assert wire.to_document(layout)["status"]["gpus"][0]["instances"][1]["usedBy"] == "default/p1"
    assert gl.used_by(layout) == {"default/p1": ((1, 1, "1g.10gb"),)}
    # The spec still reserves 1g.10gb@0 for p1 and it is not yet used by it: p1 (two
    # containers, say) is not allocated until it is.
    assert not gl.allocated(layout, "default/p1")
    doc["status"]["gpus"][0]["instances"][0]["state"] = "used"
    doc["status"]["gpus"][0]["instances"][0]["usedBy"] = "default/p1"
    doc["status"]["summary"]["free"] = 1
    assert gl.allocated(wire.parse(doc), "default/p1")
    # Once the controller drops the reservation, what the status says is enough.
    del doc["spec"]["gpus"][0]["instances"][1]["reservedFor"]
    assert gl.allocated(wire.parse(doc), "default/p1")
    assert not gl.allocated(wire.parse(doc), "default/other")
    del doc["status"]
    assert not gl.allocated(wire.parse(doc), "default/p1") and gl.used_by(wire.parse(doc)) == {}


def test_a_layout_without_status_parses_and_writes_none() -> None:
    doc = docs.mig()
    del doc["status"]
    layout = wire.parse(doc)
    assert layout.status is None
    assert "status" not in wire.to_document(layout)


_SI = "spec.gpus[0].instances"
_TI = "status.gpus[0].instances"
BAD = [
    ("apiVersion", "migpilot.io/v1", "apiVersion"),
    ("kind", "Node", "kind"),
    ("metadata.name", "", "metadata.name"),
    ("spec", ..., "spec"),
    ("spec.gpus", {"index": 0}, "spec.gpus"),
    ("spec.extra", 1, "spec.extra"),
    ("spec.gpus[0].index", -1, "spec.gpus[0].index"),
    ("spec.gpus[0].index", True, "spec.gpus[0].index"),
    ("spec.gpus[1].index", 1, "spec.gpus[1].index"),
    ("spec.gpus[1].model", "tesla-v100", "spec.gpus[1].model"),
    (f"{_SI}[0].start", 9, f"{_SI}"),  # in 0..11 (RTX PRO starts at 9), not 3g.40gb's
    (f"{_SI}[0].start", 12, f"{_SI}[0].start"),
    (f"{_SI}[0].start", "4", f"{_SI}[0].start"),
    (f"{_SI}[0].start", 0, f"{_SI}[1].start"),
    (f"{_SI}[0].profile", "3g.40GB", f"{_SI}[0].profile"),
    (f"{_SI}[0].profile", "1g.10gb.me", f"{_SI}[0].profile"),
    (f"{_SI}[0].profile", "3g.39gb", f"{_SI}[0].profile"),
    (f"{_SI}[0].profile", "1g.5gb", f"{_SI}[0].profile"),
    (f"{_SI}[0].profile", "4g.40gb", f"{_SI}"),
    (f"{_SI}[1].reservedFor", "p1", f"{_SI}[1].reservedFor"),
    (f"{_SI}[1].reservedFor", "Default/p1", f"{_SI}[1].reservedFor"),
    (f"{_SI}[1].reservedFor", 7, f"{_SI}[1].reservedFor"),
    (f"{_SI}[1].owner", "x", f"{_SI}[1].owner"),
    (f"{_SI}[1].resource", "nvidia.com/mig-1g.10gb", f"{_SI}[1].resource"),
    (f"{_SI}[0].resource", "nvidia.com/gpu", f"{_SI}[0].resource"),  # not reserved
    ("status.observedGeneration", -2, "status.observedGeneration"),
    ("status.summary.free", 2, "status.summary"),
    ("status.gpus[0].model", ..., "status.gpus[0].model"),
    ("status.gpus[0].uuid", ..., "status.gpus[0].uuid"),
    ("status.gpus", [{"index": 0, "model": "a30", "uuid": "G"}] * 2, "status.gpus[1].index"),
    (f"{_TI}[0].state", "gone", f"{_TI}[0].state"),
    (f"{_TI}[0].state", ..., f"{_TI}[0].state"),
    (f"{_TI}[0].uuid", ..., f"{_TI}[0].uuid"),
    (f"{_TI}[1].start", 0, f"{_TI}[1].start"),
    (f"{_TI}[3].start", 5, f"{_TI}"),
    (f"{_TI}[3].profile", "7g.40gb", f"{_TI}[3].profile"),
    (f"{_TI}[1].usedBy", "p1", f"{_TI}[1].usedBy"),
    (f"{_TI}[3].usedBy", "default/p1", f"{_TI}[3].usedBy"),  # a free instance names no pod
    ("status.conditions[0].status", "true", "status.conditions[0].status"),
    ("status.conditions[0].reason", "not ok", "status.conditions[0].reason"),
    (
        "status.conditions[0].lastTransitionTime",
        "yesterday",
        "status.conditions[0].lastTransitionTime",
    ),
    ("status.conditions[1]", None, "status.conditions[1]"),
]


@pytest.mark.parametrize(("path", "value", "named"), BAD, ids=[f"{p}={v!r}" for p, v, _ in BAD])
def test_bad_input_is_one_line_naming_the_field(path: str, value: Any, named: str) -> None:
    doc = docs.mig()
    if path == "status.conditions[1]":
        doc["status"]["conditions"].append(copy.deepcopy(doc["status"]["conditions"][0]))
        path, value, named = "status.conditions[1].message", "again", "status.conditions[1].type"
    with pytest.raises(errors.GpuLayoutError) as info:
        wire.parse(docs.edited(doc, path, value))
    message = str(info.value)
    assert "\n" not in message
    assert message.split(": ", 1)[0] == named, message


def test_duplicate_instances_are_rejected_never_merged() -> None:
    doc = docs.mig()
    twice = {"profile": "3g.40gb", "start": 4}
    doc["spec"]["gpus"][0] = {"index": 0, "instances": [twice, dict(twice)]}  # no model given
    with pytest.raises(errors.GpuLayoutError, match=r"^spec\.gpus\[0\]\.instances\[1\]\.start: "):
        wire.parse(doc)


def test_overlapping_instances_are_rejected_when_the_model_is_known() -> None:
    doc = docs.edited(docs.mig(), f"{_SI}[1]", {"profile": "1g.10gb", "start": 5})
    with pytest.raises(errors.GpuLayoutError, match=r"^spec\.gpus\[0\]\.instances: .*overlap"):
        wire.parse(doc)
    # Without a model nothing says how many slots 3g.40gb takes: only the starts are checked.
    doc = docs.edited(doc, "spec.gpus[0].model", ...)
    assert [i.start for i in wire.parse(doc).spec.gpus[1].instances] == [4, 5]


# --------------------------------------------------------------------------- lifecycle

STATES: list[S | None] = [None, *S]


@pytest.mark.parametrize("before", STATES, ids=str)
@pytest.mark.parametrize("after", STATES, ids=str)
def test_transition_table_over_every_pair(before: S | None, after: S | None) -> None:
    listed = any(t.before == before and t.after == after for t in gl.TRANSITIONS)
    assert gl.transition_allowed(before, after) == (listed or before == after)
    if after is S.DESTROYING and before is not S.DESTROYING:
        assert gl.transition_allowed(before, after) == (before is S.FREE)
    if before in gl.UNTOUCHABLE and after is None:
        # Only a failed creation vanishes; used and reserved instances never go away at all.
        assert gl.transition_allowed(before, after) == (before is S.CREATING)


def test_every_state_is_reachable_and_left() -> None:
    for s in S:
        assert any(t.after is s for t in gl.TRANSITIONS), s
        assert any(t.before is s for t in gl.TRANSITIONS), s
    assert len({(t.before, t.after) for t in gl.TRANSITIONS}) == len(gl.TRANSITIONS)


# --------------------------------------------------------------------------- property


_MODEL = catalog.resolve_gpu("a100-40gb")
_LAYOUTS = layouts.enumerate_layouts(_MODEL, maximal=False)


@st.composite
def _layouts(draw: st.DrawFn) -> gl.GpuLayout:
    pods = st.sampled_from(["default/p", "ns-1/pod.a", "x/y-2"])
    indexes = draw(st.lists(st.integers(0, 15), unique=True, max_size=3).map(sorted))
    spec_gpus = []
    status_gpus = []
    for index in indexes:
        lay = draw(st.sampled_from(_LAYOUTS))
        model = draw(st.sampled_from([None, "a100-40gb", "NVIDIA A100-SXM4-40GB"]))
        spec_gpus.append(
            gl.GpuSpec(
                index,
                model,
                tuple(
                    gl.InstanceSpec(i.profile, i.start, draw(st.none() | pods))
                    for i in lay.instances
                ),
            )
        )
        if draw(st.booleans()):
            insts = []
            for i in draw(st.sampled_from(_LAYOUTS)).instances:
                state = draw(st.sampled_from(list(S)))
                uuid = draw(st.none()) if state is S.CREATING else f"MIG-{index}-{i.start}"
                owner = draw(st.none() | pods) if state is S.USED else None
                insts.append(gl.InstanceStatus(i.profile, i.start, uuid, state, owner))
            status_gpus.append(gl.GpuStatus(index, "a100-40gb", f"GPU-{index}", tuple(insts)))
    conditions = draw(
        st.lists(
            st.builds(
                gl.Condition,
                type=st.sampled_from(["Ready", "Degraded", "migpilot.io/Static"]),
                status=st.sampled_from(list(gl.ConditionStatus)),
                reason=st.from_regex(wire.REASON_PATTERN, fullmatch=True).filter(
                    lambda r: len(r) < 20
                ),
                message=st.text(max_size=10),
                last_transition_time=st.just("2026-03-04T05:06:07Z"),
                observed_generation=st.none() | st.integers(0, 9),
            ),
            max_size=3,
            unique_by=lambda c: c.type,
        )
    )
    status = draw(
        st.none()
        | st.just(
            gl.LayoutStatus(
                draw(st.none() | st.integers(0, 99)), tuple(status_gpus), tuple(conditions)
            )
        )
    )
    return gl.GpuLayout(
        draw(st.from_regex(r"[a-z][a-z0-9-]{0,10}", fullmatch=True)),
        gl.LayoutSpec(tuple(spec_gpus)),
        status,
        draw(st.none() | st.integers(1, 99)),
    )


@given(_layouts())
def test_parse_inverts_to_document(layout: gl.GpuLayout) -> None:
    doc = wire.to_document(layout)
    assert wire.parse(doc) == layout
    assert wire.parse(copy.deepcopy(doc)) == wire.parse(doc)
    assert wire.to_document(wire.parse(doc)) == doc


# --------------------------------------------------------------------------- the CRD YAML


def _crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    assert version["name"] == gl.VERSION
    return dict(version["schema"]["openAPIV3Schema"]["properties"])


def test_the_crd_matches_the_python_schema() -> None:
    crd = yaml.safe_load(CRD.read_text())
    assert crd["metadata"]["name"] == gl.CRD_NAME
    assert crd["spec"]["group"] == gl.GROUP
    assert crd["spec"]["scope"] == "Cluster"
    assert crd["spec"]["names"]["kind"] == gl.KIND
    assert crd["spec"]["names"]["plural"] == gl.PLURAL
    assert "gl" in crd["spec"]["names"]["shortNames"]
    props = _crd_schema()
    spec_gpu = props["spec"]["properties"]["gpus"]
    status_gpu = props["status"]["properties"]["gpus"]
    for gpus in (spec_gpu, status_gpu):
        assert gpus["x-kubernetes-list-map-keys"] == ["index"]
        insts = gpus["items"]["properties"]["instances"]
        assert insts["x-kubernetes-list-map-keys"] == ["start"]
        item = insts["items"]["properties"]
        assert item["profile"]["pattern"] == wire.PROFILE_PATTERN
        assert (item["start"]["minimum"], item["start"]["maximum"]) == (0, wire.MAX_START)
    spec_item = spec_gpu["items"]["properties"]["instances"]["items"]["properties"]
    assert spec_item["reservedFor"]["pattern"] == wire.RESERVED_FOR_PATTERN
    status_item = status_gpu["items"]["properties"]["instances"]["items"]
    assert status_item["properties"]["usedBy"]["pattern"] == wire.RESERVED_FOR_PATTERN
    rules = [r["rule"] for r in status_item["x-kubernetes-validations"]]
    assert "!has(self.usedBy) || self.state == 'used'" in rules
    state = status_gpu["items"]["properties"]["instances"]["items"]["properties"]["state"]
    assert state["enum"] == [s.value for s in S]
    cond = props["status"]["properties"]["conditions"]["items"]["properties"]
    assert cond["reason"]["pattern"] == wire.REASON_PATTERN


def test_the_crd_allows_every_start_and_profile_of_the_catalog() -> None:
    pattern = re.compile(wire.PROFILE_PATTERN)
    for model in catalog.gpu_models():
        for p in model.profiles:
            assert pattern.match(p.name), (model.id, p.name)
            assert max(p.placements) <= wire.MAX_START, (model.id, p.name)
    assert max(m.memory_slots for m in catalog.gpu_models()) - 1 == wire.MAX_START


def test_an_instance_kept_for_a_unified_pod_names_its_resource() -> None:
    doc = docs.mig()
    doc["spec"]["gpus"][0]["instances"][1]["resource"] = "nvidia.com/gpu"
    layout = wire.parse(doc)
    kept = [i for g in layout.spec.gpus for i in g.instances if i.reserved_for]
    assert [(i.reserved_for, i.resource) for i in kept] == [("default/p1", gl.UNIFIED_RESOURCE)]
    assert wire.parse(wire.to_document(layout)) == layout


# --------------------------------------------------------------------------- MPS slices


def test_mps_slices_parse_sorted_and_round_trip() -> None:
    layout = wire.parse(docs.mps())
    (gpu,) = layout.spec.gpus
    assert gpu.mps == (gl.SliceSpec(0, 10, 30), gl.SliceSpec(2, 20, None, "ns/p2"))
    assert layout.status is not None
    assert [(s.id, s.state, s.used_by) for s in layout.status.gpus[0].mps] == [
        (0, S.USED, "ns/p0"),
        (1, S.USED, None),
        (2, S.RESERVED, None),
    ]
    assert wire.parse(wire.to_document(layout)) == layout


def test_a_slice_kept_for_a_unified_pod_names_its_resource() -> None:
    doc = docs.mps()
    doc["spec"]["gpus"][0]["mps"][0]["resource"] = "nvidia.com/gpu"
    layout = wire.parse(doc)
    kept = [s for s in layout.spec.gpus[0].mps if s.reserved_for is not None]
    assert [(s.reserved_for, s.resource) for s in kept] == [("ns/p2", gl.UNIFIED_RESOURCE)]
    assert wire.parse(wire.to_document(layout)) == layout


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        (("spec", "gpus", 0, "mps", 0, "memoryGB"), 0, "spec.gpus[0].mps[0].memoryGB"),
        (("spec", "gpus", 0, "mps", 0, "cores"), 101, "spec.gpus[0].mps[0].cores"),
        (("spec", "gpus", 0, "mps", 0, "id"), 0, "spec.gpus[0].mps[1].id"),
        (("spec", "gpus", 0, "mps", 0, "memoryGB"), 75, "spec.gpus[0].mps: slices of 85 GB"),
        (("spec", "gpus", 0, "mps", 0, "reservedFor"), "p2", "spec.gpus[0].mps[0].reservedFor"),
        (
            ("spec", "gpus", 0, "mps", 1, "resource"),
            "nvidia.com/gpu",
            "only a reserved instance or slice",
        ),
        (
            ("spec", "gpus", 0, "mps", 0, "resource"),
            "nvidia.com/gpu-20gb",
            "spec.gpus[0].mps[0].resource",
        ),
        (("spec", "gpus", 0, "instances"), [{"profile": "7g.80gb", "start": 0}], "not both"),
        (("status", "gpus", 0, "mps", 0, "state"), "creating", "status.gpus[0].mps[0].state"),
        (("status", "gpus", 0, "mps", 2, "usedBy"), "ns/x", "only a used slice"),
    ],
)
def test_bad_mps_slices_are_one_line_naming_the_field(
    path: tuple[Any, ...], value: Any, named: str
) -> None:
    doc = docs.mps()
    target: Any = doc
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(errors.GpuLayoutError) as info:
        wire.parse(doc)
    assert named in str(info.value) and "\n" not in str(info.value)


def test_too_many_slices_on_one_gpu_are_refused() -> None:
    doc = docs.mps()
    doc["spec"]["gpus"][0]["mps"] = [{"id": i, "memoryGB": 1} for i in range(49)]
    with pytest.raises(errors.GpuLayoutError, match="49 slices; MPS serves at most 48"):
        wire.parse(doc)


# --------------------------------------------------------------------------- whole GPUs kept


def _whole_kept(**gpu: Any) -> dict[str, Any]:
    doc = docs.mig()
    doc["spec"]["gpus"][0] = {"index": doc["spec"]["gpus"][0]["index"], "instances": [], **gpu}
    return doc


def test_a_whole_gpu_reserved_for_a_pod_round_trips() -> None:
    doc = _whole_kept(mig=False, reservedFor="ns/w")
    layout = wire.parse(doc)
    (gpu,) = [g for g in layout.spec.gpus if g.reserved_for is not None]
    assert (gpu.index, gpu.mig, gpu.reserved_for, gpu.instances) == (
        doc["spec"]["gpus"][0]["index"],
        False,
        "ns/w",
        (),
    )
    assert wire.parse(wire.to_document(layout)) == layout
    again = wire.to_document(layout)["spec"]["gpus"]
    assert [g.get("reservedFor") for g in again if g["index"] == gpu.index] == ["ns/w"]


@pytest.mark.parametrize(
    ("gpu", "named"),
    [
        ({"reservedFor": "ns/w"}, "only a whole GPU"),
        ({"mig": True, "reservedFor": "ns/w"}, "only a whole GPU"),
        ({"mig": False, "reservedFor": "w"}, "is not namespace/name of a pod"),
        (
            {"mig": False, "reservedFor": "ns/w", "replicas": [{"id": 0, "reservedFor": "ns/x"}]},
            "only a whole GPU",
        ),
    ],
)
def test_a_bad_whole_gpu_reservation_is_refused_naming_the_field(
    gpu: dict[str, Any], named: str
) -> None:
    with pytest.raises(errors.GpuLayoutError) as info:
        wire.parse(_whole_kept(**gpu))
    assert str(info.value).startswith("spec.gpus[0].reservedFor: ") and named in str(info.value)


def test_the_crd_reserves_only_whole_gpus_with_the_same_pattern() -> None:
    gpu = _crd_schema()["spec"]["properties"]["gpus"]["items"]
    assert gpu["properties"]["reservedFor"]["pattern"] == wire.RESERVED_FOR_PATTERN
    (rule,) = gpu["x-kubernetes-validations"]
    assert rule["rule"].startswith("!has(self.reservedFor) || (has(self.mig) && !self.mig")
    helm = CRD.parents[2] / "deploy" / "helm" / "migpilot" / "crds" / CRD.name
    assert helm.read_text() == CRD.read_text()
