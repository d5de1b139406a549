"""Dynamic MIG mode in the plan (planning/dynamic.py, docs/migmode.md): whole-GPU pods get idle
GPUs switched out of MIG on dynamic nodes only, MIG pods get idle whole GPUs switched into MIG
when no MIG GPU holds them, and no plan switches a GPU with anything used or reserved (the
validator checks it independently)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migpilot.mig import catalog
from migpilot.planning import dynamic, fast, options, plans, snapshot, validation

H100 = catalog.resolve_gpu("h100-80gb")
PLANNER = functools.partial(fast.plan, opts=options.Options())


def _inst(profile: str, start: int, used: bool) -> snapshot.ExistingInstance:
    return snapshot.ExistingInstance(profile, start, used)


def _node(name: str, gpus: tuple[snapshot.Gpu, ...], *, dynamic_: bool = True) -> snapshot.Node:
    return snapshot.Node(
        name=name,
        labels={"kubernetes.io/hostname": name},
        taints=(),
        unschedulable=False,
        allocatable=snapshot.Resources(64_000, 2**36),
        gpus=gpus,
        dynamic=dynamic_,
    )


def _mig_pod(name: str, profile: str = "1g.10gb") -> snapshot.Pod:
    return snapshot.planned_pod(
        name=name,
        namespace="default",
        requests=snapshot.pod_requests({f"nvidia.com/mig-{profile}": 1}, where=name),
    )


def _whole_pod(name: str, gpus: int = 1, cpu: int = 1000) -> snapshot.Pod:
    return snapshot.planned_pod(
        name=name,
        namespace="default",
        requests=snapshot.whole_requests(gpus, cpu_milli=cpu, memory_bytes=0),
    )


def _plan(snap: snapshot.Snapshot) -> plans.Plan:
    out = dynamic.plan(snap, PLANNER)
    assert validation.problems(snap, out) == []
    return out


def test_whole_pod_gets_the_idle_mig_gpu_switched_out_of_mig() -> None:
    busy = snapshot.Gpu(0, H100, (_inst("1g.10gb", 0, True),))
    idle = snapshot.Gpu(1, H100, (_inst("3g.40gb", 4, False),))
    snap = snapshot.Snapshot(
        nodes=(_node("n", (busy, idle)),), pods=(), whole_pods=(_whole_pod("w"),)
    )
    out = _plan(snap)
    assert out.switches == (plans.ModeSwitch("n", 1, False),)
    placed = out.placement_of("default/w")
    assert placed is not None and placed.gpus == (1,) and placed.node == "n"
    # The idle GPU's free instance goes; the used one on GPU 0 is untouched.
    assert [(a.gpu, a.op, a.profile) for a in out.actions] == [(1, plans.Op.DESTROY, "3g.40gb")]


def test_free_whole_gpu_is_preferred_to_a_switch() -> None:
    mig = snapshot.Gpu(0, H100, ())
    whole = snapshot.Gpu(1, H100, (), mig=False)
    snap = snapshot.Snapshot(
        nodes=(_node("n", (mig, whole)),), pods=(), whole_pods=(_whole_pod("w"),)
    )
    out = _plan(snap)
    assert out.switches == ()
    assert out.placement_of("default/w") == plans.Placement("default/w", "n", (), gpus=(1,))


def test_no_switch_on_a_node_not_labelled_dynamic() -> None:
    idle = snapshot.Gpu(0, H100, ())
    snap = snapshot.Snapshot(
        nodes=(_node("n", (idle,), dynamic_=False),), pods=(), whole_pods=(_whole_pod("w"),)
    )
    out = _plan(snap)
    assert out.switches == () and out.placements == ()
    (u,) = out.unschedulable
    assert u.pod == "default/w" and "migpilot.io/mig-mode=dynamic" in u.reason


def test_no_switch_of_a_gpu_with_a_used_instance_or_held_whole() -> None:
    busy = snapshot.Gpu(0, H100, (_inst("1g.10gb", 0, True),))
    held = snapshot.Gpu(1, H100, (), mig=False, whole_taken=True)
    snap = snapshot.Snapshot(
        nodes=(_node("n", (busy, held)),), pods=(), whole_pods=(_whole_pod("w"),)
    )
    out = _plan(snap)
    assert out.switches == () and out.placement_of("default/w") is None


def test_a_gpu_the_mig_pods_need_is_not_switched_out() -> None:
    # One idle MIG GPU: the MIG pod is planned first and takes it; the whole pod waits.
    snap = snapshot.Snapshot(
        nodes=(_node("n", (snapshot.Gpu(0, H100, ()),)),),
        pods=(_mig_pod("m"),),
        whole_pods=(_whole_pod("w"),),
    )
    out = _plan(snap)
    assert out.placement_of("default/m") is not None
    assert out.placement_of("default/w") is None and out.switches == ()


def test_mig_pod_gets_an_idle_whole_gpu_switched_into_mig() -> None:
    full = snapshot.Gpu(0, H100, (_inst("7g.80gb", 0, True),))
    whole = snapshot.Gpu(1, H100, (), mig=False)
    snap = snapshot.Snapshot(nodes=(_node("n", (full, whole)),), pods=(_mig_pod("m"),))
    out = _plan(snap)
    assert out.switches == (plans.ModeSwitch("n", 1, True),)
    placed = out.placement_of("default/m")
    assert placed is not None and [i.gpu for i in placed.instances] == [1]


def test_whole_gpus_are_not_switched_into_mig_while_a_mig_gpu_holds_the_pod() -> None:
    mig = snapshot.Gpu(0, H100, ())
    whole = snapshot.Gpu(1, H100, (), mig=False)
    snap = snapshot.Snapshot(nodes=(_node("n", (mig, whole)),), pods=(_mig_pod("m"),))
    out = _plan(snap)
    assert out.switches == ()
    placed = out.placement_of("default/m")
    assert placed is not None and [i.gpu for i in placed.instances] == [0]


def test_the_node_needing_fewest_switches_wins_and_cpu_counts() -> None:
    a = _node("a", (snapshot.Gpu(0, H100, ()), snapshot.Gpu(1, H100, ())))
    b = _node("b", (snapshot.Gpu(0, H100, (), mig=False), snapshot.Gpu(1, H100, ())))
    snap = snapshot.Snapshot(nodes=(a, b), pods=(), whole_pods=(_whole_pod("w", 2),))
    out = _plan(snap)
    assert out.placement_of("default/w") == plans.Placement("default/w", "b", (), gpus=(0, 1))
    assert out.switches == (plans.ModeSwitch("b", 1, False),)
    starved = dataclasses.replace(b, allocatable=snapshot.Resources(500, 2**36))
    out = _plan(dataclasses.replace(snap, nodes=(a, starved)))
    placed = out.placement_of("default/w")
    assert placed is not None and placed.node == "a"


def test_validation_refuses_a_switch_of_a_gpu_in_use() -> None:
    busy = snapshot.Gpu(0, H100, (_inst("1g.10gb", 0, True),))
    snap = snapshot.Snapshot(nodes=(_node("n", (busy,)),), pods=(), whole_pods=(_whole_pod("w"),))
    bad = dataclasses.replace(
        _plan(snap),
        switches=(plans.ModeSwitch("n", 0, False),),
        placements=(plans.Placement("default/w", "n", (), gpus=(0,)),),
        unschedulable=(),
    )
    found = validation.problems(snap, bad)
    assert any("something used or reserved" in p for p in found), found
    assert any("has instances" in p for p in found), found


def test_validation_refuses_a_switch_on_a_node_not_dynamic_and_a_whole_gpu_twice() -> None:
    gpus = (snapshot.Gpu(0, H100, (), mig=False), snapshot.Gpu(1, H100, ()))
    snap = snapshot.Snapshot(
        nodes=(_node("n", gpus, dynamic_=False),),
        pods=(),
        whole_pods=(_whole_pod("w1"), _whole_pod("w2")),
    )
    bad = dataclasses.replace(
        _plan(snap),
        switches=(plans.ModeSwitch("n", 1, False),),
        placements=(
            plans.Placement("default/w1", "n", (), gpus=(0,)),
            plans.Placement("default/w2", "n", (), gpus=(0,)),
        ),
        unschedulable=(),
    )
    found = validation.problems(snap, bad)
    assert any("not labelled dynamic" in p for p in found), found
    assert any("given to two pods" in p for p in found), found


# One dynamic node n: GPU 0 in MIG mode with a used instance, GPU 1 whole and free, GPU 2 whole
# and held, GPU 3 in MIG mode and idle; one node s not labelled dynamic, its GPU 0 whole and free.
_MODES = snapshot.Snapshot(
    nodes=(
        _node(
            "n",
            (
                snapshot.Gpu(0, H100, (_inst("1g.10gb", 0, True),)),
                snapshot.Gpu(1, H100, (), mig=False),
                snapshot.Gpu(2, H100, (), mig=False, whole_taken=True),
                snapshot.Gpu(3, H100, ()),
            ),
        ),
        _node("s", (snapshot.Gpu(0, H100, (), mig=False),), dynamic_=False),
    ),
    pods=(_mig_pod("m"),),
    whole_pods=(_whole_pod("w"), _whole_pod("w2", 2)),
)
_M = plans.AssignedInstance(3, "1g.10gb", 0)


def _w(pod: str, *gpus: int, node: str = "n") -> plans.Placement:
    return plans.Placement(f"default/{pod}", node, (), gpus=gpus)


def _sw(gpu: int, mig: bool = False) -> plans.ModeSwitch:
    return plans.ModeSwitch("n", gpu, mig)


@pytest.mark.parametrize(
    ("switches", "placements", "wanted"),
    [
        pytest.param(
            (_sw(9), _sw(0)), (),
            ["n/gpu9: switches the MIG mode of no such GPU",
             "n/gpu0: switches the MIG mode of a GPU with something used or reserved",
             "n/gpu0: whole (MIG off) after the plan, yet has instances"],
            id="no-such-gpu-then-a-busy-one",
        ),
        pytest.param(
            (_sw(3), _sw(3)), (), ["n/gpu3: its MIG mode is switched twice"], id="twice"
        ),
        pytest.param(
            (_sw(1),), (), ["n/gpu1: switches the MIG mode to the one it has"], id="same-mode"
        ),
        pytest.param(
            (), (plans.Placement("default/m", "n", (plans.AssignedInstance(1, "1g.10gb", 0),)),),
            ["pod default/m: given an instance on whole GPU n/gpu1"], id="instance-on-whole",
        ),
        pytest.param(
            (), (plans.Placement("default/m", "n", (_M,)), _w("w", 2)),
            ["pod default/w: n/gpu2 is already held or reserved"], id="after-a-mig-pod",
        ),
        pytest.param(
            (), (plans.Placement("default/w", "n", (_M,)),),
            ["pod default/w: asks for whole GPUs, given instances or shares",
             "pod default/w: got whole GPUs [], asked for 1"],
            id="whole-pod-given-an-instance",
        ),
        pytest.param(
            (), (_w("w", 1, 3),),
            ["pod default/w: got whole GPUs [1, 3], asked for 1",
             "pod default/w: n/gpu3 is in MIG mode after the plan"],
            id="more-than-asked",
        ),
        pytest.param(
            (), (_w("w2", 1, 1),), ["pod default/w2: got whole GPUs [1, 1], asked for 2"],
            id="one-gpu-twice",
        ),
        pytest.param(
            (), (_w("w", 1), plans.Placement("default/m", "n", (_M,), gpus=(2,))),
            ["pod default/m: given whole GPUs, but it asks for none"],
            id="mig-pod-given-a-whole-gpu-after-a-whole-pod",
        ),
        pytest.param(
            (), (_w("w", 0, node="s"),), ["pod default/w: placed on s, not labelled dynamic"],
            id="not-dynamic",
        ),
        pytest.param(
            (), (_w("w2", 9, 2),),
            ["pod default/w2: n/gpu9: no such GPU",
             "pod default/w2: n/gpu2 is already held or reserved"],
            id="no-such-gpu-then-a-held-one",
        ),
    ],
)  # fmt: skip
def test_validation_names_each_mode_problem(
    switches: tuple[plans.ModeSwitch, ...],
    placements: tuple[plans.Placement, ...],
    wanted: list[str],
) -> None:
    """Each rule of the validator's mode check, by its message (the GPU and the pod named), a
    broken switch or placement before a later one never hiding it."""
    honest = _plan(_MODES)  # sound: every problem below is the broken switch or placement's
    placed = {p.pod for p in placements}
    pods = (*_MODES.pods, *_MODES.whole_pods)
    bad = dataclasses.replace(
        honest,
        switches=switches,
        placements=placements,
        unschedulable=tuple(plans.Unschedulable(p.key, "-") for p in pods if p.key not in placed),
    )
    found = validation.problems(_MODES, bad)
    assert [w for w in wanted if w not in found] == [], found


def test_without_dynamic_nodes_the_plan_is_the_planners() -> None:
    snap = snapshot.Snapshot(
        nodes=(_node("n", (snapshot.Gpu(0, H100, ()),), dynamic_=False),), pods=(_mig_pod("m"),)
    )
    assert dynamic.plan(snap, PLANNER) == PLANNER(snap)


_GPU = st.one_of(
    st.builds(lambda: snapshot.Gpu(0, H100, ())),
    st.builds(lambda u: snapshot.Gpu(0, H100, (_inst("3g.40gb", 4, u),)), st.booleans()),
    st.builds(lambda t: snapshot.Gpu(0, H100, (), mig=False, whole_taken=t), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(
    nodes=st.lists(
        st.tuples(st.lists(_GPU, min_size=1, max_size=3), st.booleans()), min_size=1, max_size=3
    ),
    mig_pods=st.lists(st.sampled_from(["1g.10gb", "3g.40gb", "7g.80gb"]), max_size=4),
    whole_pods=st.lists(st.integers(1, 3), max_size=3),
)
def test_no_plan_switches_a_gpu_with_anything_in_use(
    nodes: list[tuple[list[snapshot.Gpu], bool]], mig_pods: list[str], whole_pods: list[int]
) -> None:
    snap = snapshot.Snapshot(
        nodes=tuple(
            _node(
                f"n{k}",
                tuple(dataclasses.replace(g, index=i) for i, g in enumerate(gpus)),
                dynamic_=dyn,
            )
            for k, (gpus, dyn) in enumerate(nodes)
        ),
        pods=tuple(_mig_pod(f"m{i}", p) for i, p in enumerate(mig_pods)),
        whole_pods=tuple(_whole_pod(f"w{i}", n) for i, n in enumerate(whole_pods)),
    )
    out = dynamic.plan(snap, PLANNER)
    assert validation.problems(snap, out) == []
    by_key = {(n.name, g.index): (n, g) for n in snap.nodes for g in n.gpus}
    for sw in out.switches:
        node, gpu = by_key[(sw.node, sw.gpu)]
        assert node.dynamic and not gpu.whole_taken and not any(i.used for i in gpu.instances)
