"""HAMi-style requests (planning/unified.py): parsing with clear errors, and the smallest MIG
profile per GPU model that serves each GPU a container asks for."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.mig import catalog
from migpilot.planning import snapshot, unified

VGPU = unified.VGPU_MODE

H100 = catalog.resolve_gpu("h100-80gb")
H200 = catalog.resolve_gpu("h200")
A100_40 = catalog.resolve_gpu("a100-40gb")
A30 = catalog.resolve_gpu("a30")


def _req(*containers: dict[str, Any], **annotations: str) -> unified.UnifiedRequest:
    got = unified.parse(list(containers), dict(annotations))
    assert got is not None
    return got


@pytest.mark.parametrize(
    ("model", "memory", "want"),
    [
        (H100, 8000, "1g.10gb"),  # the README's example: 8000 MiB
        (H200, 8000, "1g.18gb"),  # the same pod spec, the same slice size on another model
        (A100_40, 8000, "1g.10gb"),
        (A30, 8000, "2g.12gb"),
        (H100, 10000, "1g.20gb"),  # 1g.10gb holds 9984 MiB: never rounded down
        (H100, 40000, "3g.40gb"),  # smallest by memory, then compute (not 4g.40gb)
    ],
)
def test_the_smallest_profile_with_enough_memory(model: Any, memory: int, want: str) -> None:
    assert unified.resolve(_req({"nvidia.com/gpu": 1, "nvidia.com/gpumem": memory}), model) == (
        want,
    )


def test_cores_and_percentages() -> None:
    # 50 % of an H100's 7 compute slices is 4 slices: 4g.40gb.
    req = _req({"nvidia.com/gpu": "1", "nvidia.com/gpumem": 8000, "nvidia.com/gpucores": 50})
    assert unified.resolve(req, H100) == ("4g.40gb",)
    # 50 % of an H200's memory is half its memory slices: 3g.71gb (4 of 8), although its
    # 71424 MiB are a little under half of 7g.141gb's (MIG keeps some in every instance).
    got = unified.resolve(_req({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 50}), H200)
    assert got == ("3g.71gb",)
    # One slice more than half: the whole GPU's slices are needed.
    more = _req({"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 51})
    assert unified.resolve(more, H200) == ("7g.141gb",)


def test_no_memory_asked_is_the_whole_gpu_memory_as_in_hami() -> None:
    # HAMi's defaultMemory is 0 in its chart: gpumem-percentage 100, the whole GPU's memory.
    req = _req({"nvidia.com/gpu": 2}, **{"nvidia.com/vgpu-mode": "mig"})
    assert req.asks[0].memory_percent == 100
    assert unified.resolve(req, H100) == ("7g.80gb", "7g.80gb")
    cores = _req({"nvidia.com/gpu": 1, "nvidia.com/gpucores": 10})
    assert unified.resolve(cores, A30) == ("4g.24gb",)


def test_containers_add_up() -> None:
    req = _req(
        {"nvidia.com/gpu": 2, "nvidia.com/gpumem": 8000},
        {"cpu": "1"},
        {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 30000},
    )
    assert req.count == 3
    assert unified.resolve(req, H100) == ("1g.10gb", "1g.10gb", "3g.40gb")
    assert unified.resolve(req, A30) is None  # 30000 MiB fits no A30 slice


def test_model_filters_and_policies() -> None:
    req = _req({"nvidia.com/gpu": 1}, **{"nvidia.com/use-gputype": "H100,H200"})
    assert unified.resolve(req, H100) is not None and unified.resolve(req, A30) is None
    req = _req({"nvidia.com/gpu": 1}, **{"nvidia.com/nouse-gputype": "a100"})
    assert unified.resolve(req, A100_40) is None and unified.resolve(req, H100) is not None
    got = unified.parse_policies(
        {"hami.io/node-scheduler-policy": "spread", "hami.io/gpu-scheduler-policy": "binpack"}
    )
    assert got == (snapshot.Policy.SPREAD, snapshot.Policy.BINPACK)
    assert unified.parse_policies({}) == (None, None)


def test_pods_without_gpu_requests_are_not_unified() -> None:
    assert unified.parse([{"cpu": "2"}, {"nvidia.com/mig-1g.10gb": 1}], {}) is None
    assert unified.parse([{"nvidia.com/gpu": 0}], {}) is None


@pytest.mark.parametrize(
    ("containers", "annotations", "message"),
    [
        ([{"nvidia.com/gpumem": 8000}], {}, "needs nvidia.com/gpu"),
        ([{"nvidia.com/gpu": "1.5"}], {}, "expected a whole number"),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpumem-percentage": 101}], {}, "outside 1 to 100"),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpucores": 0}], {}, "outside 1 to 100"),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 0}], {}, "0 is less than 1"),
        (
            [{"nvidia.com/gpu": 1, "nvidia.com/gpumem": 1, "nvidia.com/gpumem-percentage": 5}],
            {},
            "not both",
        ),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpumem": "500m"}], {}, "expected a whole number"),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpumem": "-8000"}], {}, "expected a whole number"),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpumem": True}], {}, "expected a whole number"),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpumem": "1e30"}], {}, "too large"),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpumem": "1e999999"}], {}, "too large"),
        (
            [{"nvidia.com/gpu": 1, "nvidia.com/gpumem": "9" * 5000}],
            {},
            r"'9{36}\.{3} is too large$",
        ),
        ([{"nvidia.com/gpu": 1, "nvidia.com/gpucores": "1k"}], {}, "outside 1 to 100"),
        ([{"nvidia.com/gpu": 1}], {"nvidia.com/vgpu-mode": "hami-core"}, "not served"),
    ],
)
def test_bad_input_names_the_field(
    containers: list[dict[str, Any]], annotations: dict[str, str], message: str
) -> None:
    with pytest.raises(errors.SnapshotError, match=message):
        unified.parse(containers, annotations)


def test_a_bad_policy_names_the_annotation() -> None:
    with pytest.raises(errors.SnapshotError, match=r"gpu-scheduler-policy\]: 'random' is not"):
        unified.parse_policies({"hami.io/gpu-scheduler-policy": "random"})


def test_never_served_says_why() -> None:
    assert unified.never_served(_req({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 8000})) is None
    too_big = _req({"nvidia.com/gpu": 1, "nvidia.com/gpumem": 10**7})
    assert "more than any allowed GPU offers" in (unified.never_served(too_big) or "")
    excluded = _req(
        {"nvidia.com/gpu": 1},
        **{"nvidia.com/use-gputype": "A30", "nvidia.com/nouse-gputype": "A30"},
    )
    assert "exclude every GPU model" in (unified.never_served(excluded) or "")


@given(
    memory=st.integers(min_value=1, max_value=300_000),
    cores=st.none() | st.integers(min_value=1, max_value=100),
    model=st.sampled_from(catalog.gpu_models()),
)
def test_the_choice_fits_and_nothing_smaller_does(
    memory: int, cores: int | None, model: Any
) -> None:
    ask = unified.GpuAsk(1, memory_mib=memory, cores_percent=cores)
    name = unified.profile_for(ask, model)
    need_slices = 0 if cores is None else -(-cores * model.compute_slices // 100)
    plain = [p for p in model.profiles if not p.attribute.value]
    fits = [p for p in plain if (p.memory_mib or 0) >= memory and p.compute_slices >= need_slices]
    if name is None:
        assert not fits
        return
    chosen = model.profile_named(name)
    assert chosen in fits
    assert all(
        ((chosen.memory_mib or 0), chosen.compute_slices) <= ((p.memory_mib or 0), p.compute_slices)
        for p in fits
    )


@pytest.mark.parametrize(
    ("quantity", "mib"),
    [(8000, 8000), ("8000", 8000), ("8k", 8000), (" 10k ", 10000), ("1e3", 1000), ("2Ki", 2048)],
)
def test_amounts_are_whole_quantities_as_the_apiserver_writes_them(quantity: Any, mib: int) -> None:
    # The apiserver canonicalises quantities: a pod created with gpumem 8000 reads back "8k".
    [ask] = _req({"nvidia.com/gpu": 1, "nvidia.com/gpumem": quantity}).asks
    assert ask.memory_mib == mib


def test_filters_matching_no_known_model_are_kept_and_select_nothing() -> None:
    # HAMi's own example names a GPU without MIG beside one with it.
    req = _req({"nvidia.com/gpu": 1}, **{"nvidia.com/use-gputype": "A100,V100"})
    assert req.use_models == ("A100", "V100")
    assert unified.unknown_filters(req) == ("V100",)
    assert unified.resolve(req, A100_40) is not None and unified.resolve(req, H100) is None
    assert unified.never_served(req) is None
    req = _req({"nvidia.com/gpu": 1}, **{"nvidia.com/nouse-gputype": "1080, 2080"})
    assert unified.unknown_filters(req) == ("1080", "2080")
    assert unified.resolve(req, H100) is not None  # excludes nothing
    only_unknown = _req({"nvidia.com/gpu": 1}, **{"nvidia.com/use-gputype": "V100"})
    assert "exclude every GPU model" in (unified.never_served(only_unknown) or "")


GPU = "nvidia.com/gpu"
MODE = "nvidia.com/vgpu-mode"


@pytest.mark.parametrize(
    ("containers", "annotations", "want"),
    [
        ([{GPU: 1, "nvidia.com/gpumem": 8000}], {}, True),
        ([{"cpu": 1}, {GPU: 1, "nvidia.com/gpumem-percentage": 50}], {}, True),
        ([{GPU: 1, "nvidia.com/gpucores": 30}], {}, True),
        ([{"nvidia.com/gpumem": 8000}], {}, True),  # unified, and malformed (parse says why)
        ([{GPU: 1}], {MODE: "mig"}, True),
        ([{GPU: 1}], {MODE: " MIG "}, True),
        ([{"cpu": 1}], {MODE: "mig"}, True),
        ([{GPU: 1}], {}, False),  # whole GPUs, for NVIDIA's device plugin
        ([{"nvidia.com/mig-1g.10gb": 1}], {}, False),
        ([], {}, False),
        ([{GPU: 1, "nvidia.com/gpumem": 8000}], {MODE: "hami-core"}, False),
        ([{GPU: 1}], {MODE: "mps"}, True),  # HAMi's MPS mode: an MPS slice
        ([{GPU: 1}], {MODE: "vgpu"}, False),
    ],
)
def test_is_unified(
    containers: list[dict[str, Any]], annotations: dict[str, str], want: bool
) -> None:
    assert unified.is_unified(containers, annotations) is want
    assert unified.serves_mode(annotations) is (
        annotations.get(MODE, "mig").strip().lower() in ("mig", "mps")
    )


def test_errors_name_the_place_the_caller_gives() -> None:
    with pytest.raises(errors.SnapshotError, match=r"^spec.initContainers\[0\].nvidia.com/gpumem:"):
        unified.parse(
            [{GPU: 1, "nvidia.com/gpumem": 0}, {GPU: 1}],
            {},
            wheres=["spec.initContainers[0]", "spec.containers[0]"],
        )
    with pytest.raises(ValueError):
        unified.parse([{GPU: 1}], {}, wheres=[])
    with pytest.raises(
        errors.SnapshotError, match=r"^metadata.annotations\[hami.io/node-scheduler-policy\]"
    ):
        unified.parse_annotations({"hami.io/node-scheduler-policy": "pack"}, where="metadata")
    pod_level = unified.parse_annotations({"nvidia.com/use-gputype": "H100"}, where="metadata")
    assert pod_level == unified.UnifiedRequest(asks=(), use_models=("H100",))


@pytest.mark.parametrize(
    ("annotations", "mode"),
    [({}, None), ({MODE: "mig"}, "mig"), ({MODE: " MPS "}, "mps")],
)
def test_the_request_keeps_the_mode_it_is_served_in(
    annotations: dict[str, str], mode: str | None
) -> None:
    request = unified.parse([{GPU: 1, "nvidia.com/gpumem": 8000}], annotations)
    assert request is not None
    assert request.mode == mode
    assert ("; mode " in request.text()) is (mode is not None)


def test_mps_mode_never_serves_a_container_asking_two_gpus() -> None:
    two = unified.parse([{GPU: 2, "nvidia.com/gpumem": 8000}], {MODE: "mps"})
    one = unified.parse([{GPU: 1, "nvidia.com/gpumem": 8000}] * 2, {MODE: "mps"})
    assert two is not None and one is not None
    assert "more than one GPU" in (unified.never_served(two) or "")
    assert unified.never_served(one) is None


def test_another_systems_mode_is_refused_naming_the_modes_served() -> None:
    with pytest.raises(errors.SnapshotError, match="it serves 'mig' and 'mps'"):
        unified.parse([{GPU: 1, "nvidia.com/gpumem": 8000}], {MODE: "hami-core"})


@pytest.mark.parametrize(
    ("resources", "annotations", "mode"),
    [
        ({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4000"}, {VGPU: "hami-core"}, "hami-core"),
        ({"nvidia.com/gpu": "1"}, {VGPU: " vgpu "}, "vgpu"),
        ({"nvidia.com/gpu": "1"}, {VGPU: " mps "}, None),  # served: an MPS slice
        ({"nvidia.com/gpumem": "4000"}, {VGPU: "MIG"}, None),
        ({"nvidia.com/gpu": "1"}, {}, None),
        ({"cpu": "1"}, {VGPU: "hami-core"}, None),
    ],
)
def test_other_mode_names_the_mode_of_another_systems_gpu_pod(
    resources: dict[str, str], annotations: dict[str, str], mode: str | None
) -> None:
    assert unified.other_mode([resources], annotations) == mode


def test_a_gpu_count_no_node_could_hold_is_refused_naming_the_field() -> None:
    ok = unified.parse_container({"nvidia.com/gpu": "1024"}, where="c")
    assert ok is not None and ok.count == unified.MOST_GPUS
    with pytest.raises(errors.SnapshotError, match=r"c\.nvidia\.com/gpu: 8589934592 GPUs is more"):
        unified.parse_container({"nvidia.com/gpu": "8Gi"}, where="c")
