"""Instances created and destroyed per profile, from two reports of one node's GpuLayout status
(:mod:`migpilot.controller.turnover`): what exists is what the agent lists, a MIG instance by
its place and UUID, an MPS slice by its id, size and share."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping

from hypothesis import given
from hypothesis import strategies as st

from migpilot.api import gpulayouts as gl
from migpilot.controller import turnover

S = gl.InstanceState
A100 = "NVIDIA A100-SXM4-80GB"


def _mig(start: int, profile: str, uuid: str | None, state: S = S.FREE) -> gl.InstanceStatus:
    return gl.InstanceStatus(profile, start, uuid, state)


def _status(
    *instances: gl.InstanceStatus,
    slices: tuple[gl.SliceStatus, ...] = (),
    gpu_uuid: str = "GPU-0",
) -> gl.LayoutStatus:
    return gl.LayoutStatus(None, (gl.GpuStatus(0, A100, gpu_uuid, instances, slices),))


def _slice(id_: int, gb: int, cores: int | None = None) -> gl.SliceStatus:
    return gl.SliceStatus(id_, gb, cores, S.FREE)


def _counts(t: turnover.Turnover) -> tuple[dict[str, int], dict[str, int]]:
    return dict(t.created), dict(t.destroyed)


def test_an_instance_is_created_when_the_agent_lists_it_with_its_uuid_not_while_creating() -> None:
    empty = _status()
    creating = _status(_mig(0, "1g.10gb", None, S.CREATING))
    made = _status(_mig(0, "1g.10gb", "MIG-1", S.RESERVED))
    assert not turnover.diff(empty, creating)
    assert _counts(turnover.diff(creating, made)) == ({"1g.10gb": 1}, {})
    assert _counts(turnover.diff(empty, made)) == ({"1g.10gb": 1}, {})
    # A creation that failed (creating, then no longer listed) destroyed nothing.
    assert not turnover.diff(creating, empty)


def test_an_instance_is_destroyed_once_no_longer_listed_and_a_failed_destroy_counts_nothing() -> (
    None
):
    free = _status(_mig(0, "3g.40gb", "MIG-1"))
    destroying = _status(_mig(0, "3g.40gb", "MIG-1", S.DESTROYING))
    assert not turnover.diff(free, destroying)  # still there
    assert not turnover.diff(destroying, free)  # the destroy failed
    assert _counts(turnover.diff(destroying, _status())) == ({}, {"3g.40gb": 1})
    assert _counts(turnover.diff(free, _status())) == ({}, {"3g.40gb": 1})


def test_a_change_of_state_is_no_creation() -> None:
    states = [S.FREE, S.RESERVED, S.USED, S.FREE]
    reports = [_status(_mig(4, "1g.10gb", "MIG-1", s)) for s in states]
    for before, after in itertools.pairwise(reports):
        assert not turnover.diff(before, after)


def test_a_destroy_and_recreate_at_the_same_place_counts_both() -> None:
    before = _status(_mig(0, "1g.10gb", "MIG-1"), _mig(1, "1g.10gb", "MIG-2"))
    after = _status(_mig(0, "1g.10gb", "MIG-3"), _mig(1, "1g.10gb", "MIG-2"))
    assert _counts(turnover.diff(before, after)) == ({"1g.10gb": 1}, {"1g.10gb": 1})
    # Another profile at the same start: one of each.
    bigger = _status(_mig(0, "2g.20gb", "MIG-4"))
    assert _counts(turnover.diff(before, bigger)) == ({"2g.20gb": 1}, {"1g.10gb": 2})


def test_a_gpu_replaced_at_the_same_index_replaces_all_it_held() -> None:
    before = _status(_mig(0, "7g.80gb", "MIG-1"), slices=())
    after = _status(_mig(0, "7g.80gb", "MIG-1"), gpu_uuid="GPU-9")
    assert _counts(turnover.diff(before, after)) == ({"7g.80gb": 1}, {"7g.80gb": 1})


def test_mps_slices_count_by_size_and_a_slice_of_another_size_under_the_same_id_is_another() -> (
    None
):
    one = _status(slices=(_slice(0, 20),))
    assert _counts(turnover.diff(_status(), one)) == ({"mps-20gb": 1}, {})
    grown = _status(slices=(_slice(0, 40), _slice(1, 20)))
    assert _counts(turnover.diff(one, grown)) == ({"mps-20gb": 1, "mps-40gb": 1}, {"mps-20gb": 1})
    shared = _status(slices=(_slice(0, 20, cores=50),))
    assert _counts(turnover.diff(one, shared)) == ({"mps-20gb": 1}, {"mps-20gb": 1})
    used = _status(slices=(gl.SliceStatus(0, 20, None, S.USED, "ns/p"),))
    assert not turnover.diff(one, used)
    assert turnover.slice_profile(20) == "mps-20gb"


def test_a_switch_from_mig_to_mps_destroys_the_instances_and_creates_the_slices() -> None:
    mig = _status(_mig(0, "3g.40gb", "MIG-1"), _mig(4, "3g.40gb", "MIG-2"))
    mps = _status(slices=(_slice(0, 10), _slice(1, 10), _slice(2, 30)))
    assert _counts(turnover.diff(mig, mps)) == (
        {"mps-10gb": 2, "mps-30gb": 1},
        {"3g.40gb": 2},
    )


# -- properties -------------------------------------------------------------------------------

PROFILES = ("1g.10gb", "2g.20gb", "3g.40gb")
_states = st.sampled_from(list(S))
_instances = st.dictionaries(
    st.tuples(st.integers(0, 1), st.integers(0, 6)),  # (GPU, start): one instance per place
    st.tuples(st.sampled_from(PROFILES), st.sampled_from(["MIG-a", "MIG-b", "MIG-c"]), _states),
    max_size=8,
)
_slices = st.dictionaries(
    st.tuples(st.integers(0, 1), st.integers(0, 3)),  # (GPU, id)
    st.tuples(st.sampled_from([10, 20, 40]), st.sampled_from([None, 50])),
    max_size=5,
)
Instances = Mapping[tuple[int, int], tuple[str, str, S]]
"""(GPU, start) -> (profile, UUID, state)."""
Slices = Mapping[tuple[int, int], tuple[int, int | None]]
"""(GPU, id) -> (memory in GB, compute share)."""


def _report(instances: Instances, slices: Slices) -> gl.LayoutStatus:
    gpus = []
    for index in (0, 1):
        mig = tuple(
            # A creating instance has no UUID yet.
            _mig(start, p, None if state is S.CREATING else uuid, state)
            for (g, start), (p, uuid, state) in sorted(instances.items())
            if g == index
        )
        mps = tuple(
            _slice(id_, gb, cores) for (g, id_), (gb, cores) in sorted(slices.items()) if g == index
        )
        gpus.append(gl.GpuStatus(index, A100, f"GPU-{index}", mig, mps))
    return gl.LayoutStatus(None, tuple(gpus))


def _listed(status: gl.LayoutStatus) -> Counter[str]:
    """Per profile, what the report shows as existing: instances past creating, and slices."""
    out: Counter[str] = Counter()
    for g in status.gpus:
        out.update(i.profile for i in g.instances if i.state is not S.CREATING)
        out.update(f"mps-{s.memory_gb}gb" for s in g.mps)
    return out


@given(_instances, _slices, _instances, _slices)
def test_created_less_destroyed_is_the_change_in_count_per_profile(
    mig_before: Instances, mps_before: Slices, mig_after: Instances, mps_after: Slices
) -> None:
    before, after = _report(mig_before, mps_before), _report(mig_after, mps_after)
    got = turnover.diff(before, after)
    change = Counter(_listed(after))
    change.subtract(_listed(before))
    for profile in set(change) | set(got.created) | set(got.destroyed):
        net = got.created.get(profile, 0) - got.destroyed.get(profile, 0)
        assert net == change[profile], profile
    assert all(n > 0 for n in [*got.created.values(), *got.destroyed.values()])
    # Backwards, the same changes the other way round; and a report against itself, none.
    back = turnover.diff(after, before)
    assert (dict(back.created), dict(back.destroyed)) == (dict(got.destroyed), dict(got.created))
    assert not turnover.diff(after, after)


@given(_instances, st.data())
def test_every_instance_given_a_new_uuid_counts_once_destroyed_and_once_created(
    mig: Instances, data: st.DataObject
) -> None:
    existing = sorted(k for k, (_, _, state) in mig.items() if state is not S.CREATING)
    renewed = data.draw(st.sets(st.sampled_from(existing)) if existing else st.just(set()))
    after = {
        k: (p, f"{uuid}-new" if k in renewed else uuid, state)
        for k, (p, uuid, state) in mig.items()
    }
    got = turnover.diff(_report(mig, {}), _report(after, {}))
    want = dict(Counter(mig[k][0] for k in renewed))
    assert (dict(got.created), dict(got.destroyed)) == (want, want)
