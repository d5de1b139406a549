"""Property-based checks of the layout engine against naive, independent implementations."""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.mig import catalog, layouts, profiles
from migpilot.mig.layouts import Instance

MODELS = catalog.gpu_models()


def naive_valid(model: profiles.GpuModel, instances: list[Instance]) -> bool:
    """The rules of a valid layout, written as plainly as possible, with a slot array."""
    slots = [False] * model.memory_slots
    by_name = {p.name: p for p in model.profiles}
    for inst in instances:
        p = by_name[inst.profile]
        if inst.start not in p.placements:
            return False
        for s in range(inst.start, inst.start + p.memory_slots):
            if slots[s]:
                return False
            slots[s] = True
    counts = Counter(i.profile for i in instances)
    if any(n > by_name[name].max_instances for name, n in counts.items()):
        return False
    if sum(1 for i in instances if by_name[i.profile].media_extension) > 1:
        return False
    if sum(by_name[i.profile].compute_slices for i in instances) > model.compute_slices:
        return False
    return len(instances) <= model.max_gpu_instances


def brute_force_place(model: profiles.GpuModel, wanted: list[str], fixed: list[Instance]) -> bool:
    """Does any assignment of starts make ``fixed + wanted`` valid? Try them all."""
    by_name = {p.name: p for p in model.profiles}
    groups = sorted(Counter(wanted).items())
    choices = [list(itertools.combinations(by_name[name].placements, n)) for name, n in groups]
    for pick in itertools.product(*choices):
        trial = list(fixed)
        for (name, _), starts in zip(groups, pick, strict=True):
            trial += [Instance(s, name) for s in starts]
        if naive_valid(model, trial):
            return True
    return False


@st.composite
def gpu_and_instances(draw: st.DrawFn) -> tuple[profiles.GpuModel, list[Instance]]:
    model = draw(st.sampled_from(MODELS))
    prof = st.sampled_from(model.profiles)
    picks = draw(st.lists(st.tuples(prof, st.integers(0, model.memory_slots - 1)), max_size=6))
    return model, [Instance(s, p.name) for p, s in picks]


@st.composite
def placement_problem(
    draw: st.DrawFn,
) -> tuple[profiles.GpuModel, list[str], list[Instance]]:
    model = draw(st.sampled_from(MODELS))
    every = layouts.enumerate_layouts(model, maximal=False)
    base = draw(st.sampled_from(every))
    fixed = [i for i in base.instances if draw(st.booleans())]
    wanted = draw(st.lists(st.sampled_from([p.name for p in model.profiles]), max_size=5))
    return model, wanted, fixed


@given(gpu_and_instances())
def test_violation_agrees_with_naive_rules(case: tuple[profiles.GpuModel, list[Instance]]) -> None:
    model, instances = case
    assert (layouts.violation(model, instances) is None) == naive_valid(model, instances)


@given(placement_problem())
def test_place_succeeds_exactly_when_brute_force_does(
    case: tuple[profiles.GpuModel, list[str], list[Instance]],
) -> None:
    model, wanted, fixed = case
    expected = brute_force_place(model, wanted, fixed)
    try:
        lay = layouts.place(model, wanted, fixed=fixed)
    except errors.LayoutError:
        assert not expected
        return
    assert expected
    assert naive_valid(model, list(lay.instances))
    assert set(fixed) <= set(lay.instances)
    assert Counter(i.profile for i in lay.instances) == Counter(wanted) + Counter(
        i.profile for i in fixed
    )


@given(placement_problem())
def test_every_completion_keeps_the_fixed_instances_and_is_maximal(
    case: tuple[profiles.GpuModel, list[str], list[Instance]],
) -> None:
    model, _, fixed = case
    found = layouts.completions(model, fixed)
    assert found
    for lay in found:
        assert set(fixed) <= set(lay.instances)
        assert naive_valid(model, list(lay.instances))
        for p in model.profiles:
            for s in p.placements:
                assert not naive_valid(model, [*lay.instances, Instance(s, p.name)])


def test_every_enumerated_layout_is_valid_on_every_gpu() -> None:
    for model in MODELS:
        every = layouts.enumerate_layouts(model, maximal=False)
        assert len(set(every)) == len(every)
        for lay in every:
            assert naive_valid(model, list(lay.instances)), (model.id, str(lay))
        maximal = set(layouts.enumerate_layouts(model))
        assert maximal <= set(every)


def test_enumeration_finds_every_valid_layout_on_a_small_gpu() -> None:
    """On the A30 the power set of placements is small enough to check exhaustively."""
    model = catalog.resolve_gpu("a30")
    placements = [Instance(s, p.name) for p in model.profiles for s in p.placements]
    expected = set()
    for r in range(len(placements) + 1):
        for combo in itertools.combinations(placements, r):
            if naive_valid(model, list(combo)):
                expected.add(layouts.Layout.of(combo))
    assert set(layouts.enumerate_layouts(model, maximal=False)) == expected


def test_free_room_is_fitting_profiles_and_free_value_in_one_scan() -> None:
    for model in catalog.gpu_models():
        for lay in layouts.enumerate_layouts(model, maximal=False)[:400]:
            assert layouts.free_room(model, lay) == (
                layouts.fitting_profiles(model, lay),
                layouts.free_value(model, lay),
            )
