"""Layout rules, placement, enumeration and completion, from the published MIG facts."""

from __future__ import annotations

import itertools

import pytest

from migpilot import errors
from migpilot.mig import catalog, layouts, profiles
from migpilot.mig.layouts import Instance

A100_CLASSIC = ["1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"]


def model(name: str) -> profiles.GpuModel:
    return catalog.resolve_gpu(name)


def insts(text: str) -> list[Instance]:
    out = []
    for part in text.split():
        name, start = part.split("@")
        out.append(Instance(int(start), name))
    return out


# The 19 maximal layouts of the A100-40GB with its classic profiles, from the reference
# (supported_configurations.derived_a100_40gb_classic), spelled out.
A100_19 = {
    "7g.40gb@0",
    "4g.20gb@0 3g.20gb@4",
    "3g.20gb@0 3g.20gb@4",
    "4g.20gb@0 2g.10gb@4 1g.5gb@6",
    "4g.20gb@0 1g.5gb@4 1g.5gb@5 1g.5gb@6",
    "3g.20gb@0 2g.10gb@4 1g.5gb@6",
    "3g.20gb@0 1g.5gb@4 1g.5gb@5 1g.5gb@6",
    "2g.10gb@0 2g.10gb@2 3g.20gb@4",
    "2g.10gb@0 1g.5gb@2 1g.5gb@3 3g.20gb@4",
    "1g.5gb@0 1g.5gb@1 2g.10gb@2 3g.20gb@4",
    "1g.5gb@0 1g.5gb@1 1g.5gb@2 1g.5gb@3 3g.20gb@4",
    "2g.10gb@0 2g.10gb@2 2g.10gb@4 1g.5gb@6",
    "2g.10gb@0 2g.10gb@2 1g.5gb@4 1g.5gb@5 1g.5gb@6",
    "2g.10gb@0 1g.5gb@2 1g.5gb@3 2g.10gb@4 1g.5gb@6",
    "1g.5gb@0 1g.5gb@1 2g.10gb@2 2g.10gb@4 1g.5gb@6",
    "2g.10gb@0 1g.5gb@2 1g.5gb@3 1g.5gb@4 1g.5gb@5 1g.5gb@6",
    "1g.5gb@0 1g.5gb@1 2g.10gb@2 1g.5gb@4 1g.5gb@5 1g.5gb@6",
    "1g.5gb@0 1g.5gb@1 1g.5gb@2 1g.5gb@3 2g.10gb@4 1g.5gb@6",
    "1g.5gb@0 1g.5gb@1 1g.5gb@2 1g.5gb@3 1g.5gb@4 1g.5gb@5 1g.5gb@6",
}


def canon(text: str) -> str:
    return str(layouts.Layout.of(insts(text)))


class TestValidity:
    def test_four_plus_three_is_valid_on_a100_40gb(self) -> None:
        assert layouts.violation(model("a100-40gb"), insts("4g.20gb@0 3g.20gb@4")) is None

    def test_two_4g_are_not(self) -> None:
        reason = layouts.violation(model("a100-40gb"), insts("4g.20gb@0 4g.20gb@0"))
        assert reason is not None and "overlap" in reason

    def test_two_3g_and_a_1g_are_not(self) -> None:
        m = model("a100-40gb")
        for s in range(7):
            reason = layouts.violation(m, [*insts("3g.20gb@0 3g.20gb@4"), Instance(s, "1g.5gb")])
            assert reason is not None and "overlap" in reason

    def test_two_media_extension_instances_are_not(self) -> None:
        reason = layouts.violation(model("a100-40gb"), insts("1g.5gb+me@0 1g.5gb+me@1"))
        assert reason is not None and "media-extension" in reason

    def test_a30_two_1g_beside_a_2g(self) -> None:
        assert layouts.violation(model("a30"), insts("2g.12gb@2 1g.6gb@0 1g.6gb@1")) is None

    def test_start_outside_allowed_placements_names_them(self) -> None:
        reason = layouts.violation(model("a100-40gb"), insts("3g.20gb@2"))
        assert reason == (
            "3g.20gb cannot start at memory slot 2 on a100-40gb (allowed starts: 0, 4)"
        )

    def test_1g_never_starts_at_slot_7(self) -> None:
        assert layouts.violation(model("h100-80gb"), insts("1g.10gb@7")) is not None
        assert layouts.violation(model("h100-80gb"), insts("1g.20gb@6")) is None

    def test_overlap_names_both_instances_and_slots(self) -> None:
        reason = layouts.violation(model("a100-40gb"), insts("3g.20gb@0 2g.10gb@2"))
        assert reason == "3g.20gb@0 and 2g.10gb@2 overlap on memory slots 2-3"

    def test_unknown_profile_is_an_error_not_a_reason(self) -> None:
        with pytest.raises(errors.UnknownProfileError):
            layouts.violation(model("a100-40gb"), insts("1g.10gb+me@0"))

    def test_validate_raises_with_the_reason(self) -> None:
        with pytest.raises(errors.LayoutError, match="overlap"):
            layouts.validate(model("a100-40gb"), insts("7g.40gb@0 1g.5gb@6"))

    def test_empty_layout_is_valid(self) -> None:
        assert layouts.validate(model("a100-40gb"), []) == layouts.Layout(())


# A made-up GPU whose limits bind before memory does, to exercise the remaining rules.
TOY = """
version: 1
mig_mode_change_needs_reset: {t: true, test: false}
gpus:
  - id: toy
    products: [Toy GPU]
    family: test
    compute_capability: "1.0"
    memory_slots: 8
    compute_slices: 5
    max_gpu_instances: 3
    profiles:
      - {name: 1g.1gb, nvml: 1_SLICE, memory_slots: 1, compute_slices: 1, max: 2,
         placements: [0, 1, 2, 3, 4, 5, 6, 7]}
      - {name: 1g.1gb+me, nvml: 1_SLICE_REV1, memory_slots: 1, compute_slices: 1, max: 1,
         placements: [0, 1, 2, 3, 4, 5, 6, 7]}
      - {name: 2g.2gb, nvml: 2_SLICE, memory_slots: 2, compute_slices: 2, max: 3,
         placements: [0, 2, 4, 6]}
      - {name: 1g.2gb, nvml: 1_SLICE_REV2, memory_slots: 2, compute_slices: 1, max: 4,
         placements: [0, 2, 4, 6]}
"""


@pytest.fixture(scope="module")
def toy() -> profiles.GpuModel:
    return catalog.load_catalog_text(TOY).resolve("toy")


class TestToyRules:
    def test_compute_slices(self, toy: profiles.GpuModel) -> None:
        reason = layouts.violation(toy, insts("2g.2gb@0 2g.2gb@2 2g.2gb@4"))
        assert reason == "6 compute slices exceed the GPU's 5"

    def test_max_instances_per_profile(self, toy: profiles.GpuModel) -> None:
        reason = layouts.violation(toy, insts("1g.1gb@0 1g.1gb@1 1g.1gb@2"))
        assert reason == "3 x 1g.1gb exceed its maximum of 2 per GPU"

    def test_max_instances_per_gpu(self, toy: profiles.GpuModel) -> None:
        reason = layouts.violation(toy, insts("1g.2gb@0 1g.2gb@2 1g.2gb@4 1g.2gb@6"))
        assert reason == "4 instances exceed the GPU's maximum of 3"

    def test_place_reports_compute(self, toy: profiles.GpuModel) -> None:
        with pytest.raises(errors.LayoutError, match="need 6 compute slices, toy has 5 free"):
            layouts.place(toy, ["2g.2gb"] * 3)

    def test_place_reports_max(self, toy: profiles.GpuModel) -> None:
        with pytest.raises(errors.LayoutError, match="3 x 1g.1gb exceed its maximum of 2"):
            layouts.place(toy, ["1g.1gb"] * 3)

    def test_place_reports_media(self, toy: profiles.GpuModel) -> None:
        with pytest.raises(errors.LayoutError, match="at most one media-extension"):
            layouts.place(toy, ["1g.1gb+me"], fixed=insts("1g.1gb+me@7"))

    def test_enumeration_respects_every_limit(self, toy: profiles.GpuModel) -> None:
        for lay in layouts.enumerate_layouts(toy, maximal=False):
            assert layouts.violation(toy, lay.instances) is None


class TestPlacement:
    def test_places_and_keeps_large_regions_free(self) -> None:
        lay = layouts.place(model("a100-40gb"), ["1g.5gb"])
        # A lone 1g should not sit at slot 0, where it would block the 4g and the 7g... it
        # blocks the 7g wherever it goes, but the 4g only lives at slot 0.
        assert lay.instances[0].start != 0

    def test_three_two_one_one(self) -> None:
        lay = layouts.place(model("a100-40gb"), ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"])
        assert layouts.violation(model("a100-40gb"), lay.instances) is None
        assert sorted(i.profile for i in lay.instances) == [
            "1g.5gb",
            "1g.5gb",
            "2g.10gb",
            "3g.20gb",
        ]

    def test_fixed_instances_stay(self) -> None:
        m = model("a100-40gb")
        lay = layouts.place(m, ["3g.20gb"], fixed=insts("2g.10gb@2"))
        assert lay == layouts.Layout.of(insts("2g.10gb@2 3g.20gb@4"))

    def test_impossible_beside_fixed(self) -> None:
        with pytest.raises(errors.LayoutError, match="no valid placement of 4g.20gb"):
            layouts.place(model("a100-40gb"), ["4g.20gb"], fixed=insts("1g.5gb@1"))

    def test_too_much_memory(self) -> None:
        with pytest.raises(errors.LayoutError, match="need 9 memory slots, a100-40gb has 8 free"):
            layouts.place(model("a100-40gb"), ["3g.20gb", "3g.20gb", "1g.5gb"])

    def test_invalid_fixed_is_rejected(self) -> None:
        with pytest.raises(errors.LayoutError, match="overlap"):
            layouts.place(model("a100-40gb"), [], fixed=insts("7g.40gb@0 1g.5gb@0"))

    def test_deterministic(self) -> None:
        m = model("h100-80gb")
        a = layouts.place(m, ["1g.10gb", "2g.20gb", "1g.20gb"])
        b = layouts.place(m, ["1g.20gb", "1g.10gb", "2g.20gb"])
        assert a == b


class TestEnumeration:
    def test_a100_40gb_has_exactly_19_classic_layouts(self) -> None:
        found = layouts.enumerate_layouts(model("a100-40gb"), allowed=A100_CLASSIC)
        assert len(found) == 19
        assert {str(lay) for lay in found} == {canon(t) for t in A100_19}

    @pytest.mark.parametrize(
        "gpu",
        ["a100-80gb", "h100-80gb", "h100-nvl-94gb", "h200-141gb", "b200-180gb"],
    )
    def test_same_19_on_every_8_slot_gpu(self, gpu: str) -> None:
        m = model(gpu)
        classic = [
            p.name
            for p in m.profiles
            if p.attribute is profiles.Attribute.NONE
            and not (p.compute_slices == 1 and p.memory_slots == 2)
        ]
        assert len(layouts.enumerate_layouts(m, allowed=classic)) == 19

    def test_a30(self) -> None:
        found = layouts.enumerate_layouts(model("a30"), allowed=["1g.6gb", "2g.12gb", "4g.24gb"])
        assert {str(lay) for lay in found} == {
            "4g.24gb@0",
            "2g.12gb@0 2g.12gb@2",
            "2g.12gb@0 1g.6gb@2 1g.6gb@3",
            "1g.6gb@0 1g.6gb@1 2g.12gb@2",
            "1g.6gb@0 1g.6gb@1 1g.6gb@2 1g.6gb@3",
        }

    def test_rtx_pro_6000(self) -> None:
        m = model("rtx-pro-6000-blackwell-96gb")
        found = layouts.enumerate_layouts(m, allowed=["1g.24gb", "2g.48gb", "4g.96gb"])
        assert {str(lay) for lay in found} == {
            "4g.96gb@0",
            "2g.48gb@0 2g.48gb@6",
            "2g.48gb@0 1g.24gb@6 1g.24gb@9",
            "1g.24gb@0 1g.24gb@3 2g.48gb@6",
            "1g.24gb@0 1g.24gb@3 1g.24gb@6 1g.24gb@9",
        }

    def test_maximal_means_nothing_fits(self) -> None:
        m = model("h100-80gb")
        for lay in layouts.enumerate_layouts(m):
            for p in m.profiles:
                for s in p.placements:
                    assert layouts.violation(m, [*lay.instances, Instance(s, p.name)]) is not None

    def test_all_layouts_include_the_empty_one(self) -> None:
        every = layouts.enumerate_layouts(model("a30"), maximal=False)
        assert layouts.Layout(()) in every
        assert len(set(every)) == len(every)


class TestCompletion:
    def test_completions_keep_the_fixed_instance(self) -> None:
        m = model("a100-40gb")
        fixed = insts("3g.20gb@4")
        found = layouts.completions(m, fixed, allowed=A100_CLASSIC)
        assert {str(lay) for lay in found} == {
            canon(t) for t in A100_19 if "3g.20gb@4" in t.split()
        }

    def test_completion_of_a_full_gpu_is_itself(self) -> None:
        m = model("a100-40gb")
        assert layouts.completions(m, insts("7g.40gb@0")) == (
            layouts.Layout.of(insts("7g.40gb@0")),
        )

    def test_completion_of_invalid_fixed_raises(self) -> None:
        with pytest.raises(errors.LayoutError):
            layouts.completions(model("a100-40gb"), insts("4g.20gb@0 3g.20gb@0"))


def test_parse_instance_resolves_names() -> None:
    m = model("a100-80gb")
    assert layouts.parse_instance(m, "3g.39gb@4") == ("3g.40gb", 4)
    assert layouts.parse_instance(m, "1g.10gb") == ("1g.10gb", None)
    with pytest.raises(errors.LayoutError, match="not a number"):
        layouts.parse_instance(m, "1g.10gb@x")


def test_every_catalog_gpu_has_a_consistent_geometry() -> None:
    for m in catalog.gpu_models():
        full = layouts.enumerate_layouts(m)
        assert full, m.id
        # The whole-GPU profile, where known, is a maximal layout on its own.
        whole = [p for p in m.profiles if p.memory_slots == m.memory_slots]
        for p in whole:
            assert layouts.Layout((Instance(0, p.name),)) in full
        for lay, other in itertools.pairwise(full):
            assert lay != other


def test_place_never_merges_a_fixed_instance_listed_twice() -> None:
    h100 = catalog.resolve_gpu("h100-80gb")
    with pytest.raises(errors.LayoutError, match="3g.40gb@4 and 3g.40gb@4 overlap"):
        layouts.place(h100, ["1g.10gb"], fixed=[Instance(4, "3g.40gb"), Instance(4, "3g.40gb")])
    with pytest.raises(errors.LayoutError, match="overlap"):
        layouts.validate(h100, [Instance(0, "7g.80gb"), Instance(0, "7g.80gb")])
