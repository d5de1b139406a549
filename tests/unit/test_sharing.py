"""The sharing core: NVIDIA's config format, named sets, replicas, Allocate, MPS, labels."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot import errors
from migpilot.sharing import config, configsets, labelling, mps, replicas

GPU = "nvidia.com/gpu"
UUID0 = "GPU-b1028956-cfa2-0990-bf4a-5da9abb51763"


def parse(text: str) -> config.Config:
    return config.parse(text, source="f.yaml")


TS = """
version: v1
flags: {migStrategy: none}
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4
"""


def test_time_slicing_parses_as_nvidia() -> None:
    c = parse(TS)
    assert c.mig_strategy == "none"
    assert c.strategy is config.SharingStrategy.TIME_SLICING
    (r,) = c.time_slicing.resources if c.time_slicing else ()
    assert (r.name, r.replicas, r.rename, str(r.devices)) == (GPU, 4, None, "all")
    assert not c.fails_requests_greater_than_one


def test_short_names_rename_by_default_and_mps_defaults() -> None:
    c = parse(
        "sharing:\n  mps:\n    renameByDefault: true\n    resources:\n"
        "    - {name: gpu, replicas: 2}\n    - {name: mig-1g.10gb, replicas: 3, rename: small}\n"
    )
    assert c.strategy is config.SharingStrategy.MPS
    assert [(r.name, r.advertised_as) for r in c.mps.resources] == [  # type: ignore[union-attr]
        (GPU, "nvidia.com/gpu.shared"),
        ("nvidia.com/mig-1g.10gb", "nvidia.com/small"),
    ]
    assert c.fails_requests_greater_than_one  # MPS keeps NVIDIA's historical default


@pytest.mark.parametrize("text", ["", "version: v1\n", "{}", "sharing: {}\n"])
def test_empty_configs_share_nothing(text: str) -> None:
    assert parse(text).strategy is config.SharingStrategy.NONE


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: v2", "version: unknown version: v2"),
        ("flags: {migStrategy: both}", "flags.migStrategy: unknown MIG strategy: both"),
        ("sharing: {timeSlicing: {}}", "sharing.timeSlicing: no resources specified"),
        (
            "sharing: {timeSlicing: {resources: []}}",
            "sharing.timeSlicing.resources: no resources specified",
        ),
        (
            "sharing: {timeSlicing: {resources: [{replicas: 2}]}}",
            "sharing.timeSlicing.resources[0]: no resource name specified",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu}]}}",
            "sharing.timeSlicing.resources[0]: no replicas specified",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}",
            "sharing.timeSlicing.resources[0].replicas: number of replicas must be >= 2",
        ),
        (
            "sharing: {mps: {resources: [{name: gpu, replicas: 0}]}}",
            "sharing.mps.resources[0].replicas: number of replicas must be >= 2",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: '4'}]}}",
            "sharing.timeSlicing.resources[0].replicas: expected an integer",
        ),
        (
            "sharing: {mps: {resources: [{name: gpu, replicas: 49}]}}",
            "maximum allowed replicas exceeded: 49 > 48",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpux, replicas: 2}]}}",
            "sharing.timeSlicing.resources[0].name: unknown resource nvidia.com/gpux",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: GPU, replicas: 2}]}}",
            "incorrect format for resource name 'nvidia.com/GPU'",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, rename: "
            + "x" * 60
            + "}]}}",
            "rename: fully-qualified resource name must be 63 characters or less",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, rename: mig-1g.10gb}]}}",
            "rename: nvidia.com/mig-1g.10gb is a resource the plugin advertises itself",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: some}]}}",
            "devices: devices set as 'some' but the only valid string input is 'all'",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: 0}]}}",
            "devices: devices set as '0' but a count of devices must be > 0",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: [GPU-x]}]}}",
            "devices[0]: unsupported type for device in devices list: GPU-x",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}, "
            "{name: gpu, replicas: 3}]}}",
            "resources[1]: nvidia.com/gpu is already shared by resources[0]",
        ),
        (
            "sharing: {timeSlicing: {renameByDefault: 1, resources: [{name: gpu, replicas: 2}]}}",
            "sharing.timeSlicing.renameByDefault: expected true or false",
        ),
        ("sharing: [1]", "sharing: expected a mapping, got a list"),
        ("version: v1\nversion: v1\n", "duplicate key 'version'"),
        ("sharing: {", "malformed YAML"),
        ("sharing: " + "[" * 5000 + "]" * 5000, "malformed YAML: nested too deeply to read"),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1025}]}}",
            "sharing.timeSlicing.resources[0].replicas: number of replicas must be <= 1024, got "
            "1025: each replica is a device the plugin advertises and the kubelet tracks",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1" + "0" * 23 + "}]}}",
            "replicas: number of replicas must be <= 1024, got a number over 2^64",
        ),
        (
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1" + "0" * 5000 + "}]}}",
            "malformed YAML: a number of more than 4300 digits",
        ),
        ("sharing: {mps: {resources: [{name: gpu, replicas: 1025}]}}", "replicas exceeded"),
        ("flags: {migStrategy: 2020-13-45}", "malformed YAML: month must be in 1..12"),
        ("".join(" " * i + "a:\n" for i in range(1500)) + " " * 1500 + "b: 1\n", "too deeply"),
    ],
)
def test_bad_configs_name_the_field(text: str, message: str) -> None:
    with pytest.raises(errors.SharingConfigError) as caught:
        parse(text)
    assert message in str(caught.value)
    assert str(caught.value).startswith("f.yaml: ")
    assert "\n" not in str(caught.value)


def test_mps_with_mixed_strategy_is_refused() -> None:
    c = parse("sharing: {mps: {resources: [{name: gpu, replicas: 2}]}}")
    with pytest.raises(errors.SharingConfigError, match="mig-strategy=mixed is not supported"):
        c.check_mig_strategy("mixed")
    c.check_mig_strategy("none")
    parse(TS).check_mig_strategy("mixed")


def test_warnings_for_what_nvidia_ignores() -> None:
    c = parse(
        "resources: {gpus: [{pattern: '*', name: gpu}]}\nsharing:\n"
        "  timeSlicing: {resources: [{name: gpu, replicas: 2}]}\n"
        "  mps: {resources: [{name: gpu, replicas: 2}]}\n"
    )
    assert c.strategy is config.SharingStrategy.MPS
    assert len(c.warnings) == 2


@pytest.mark.parametrize(
    ("ref", "ok"),
    [
        ("0", True),
        ("0:1", True),
        (UUID0, True),
        ("MIG-" + UUID0[4:], True),
        (f"MIG-{UUID0}/3/0", True),
        ("GPU-nope", False),
        ("0:x", False),
        ("-1", False),
    ],
)
def test_device_refs(ref: str, ok: bool) -> None:
    assert config.is_device_ref(ref) is ok


# --- named sets ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("names", "label", "default", "want"),
    [
        (["a", "b"], "b", None, "b"),
        (["a", "default"], None, None, "default"),
        (["a", "b"], None, "a", "a"),
        (["a", "b"], None, None, None),  # named fallback fails, empty fallback
        (["a", "..data"], "", None, None),
    ],
)
def test_named_set_picks_as_config_manager(
    names: list[str], label: str | None, default: str | None, want: str | None
) -> None:
    selection = configsets.Selection(default=default)
    assert configsets.select(names, label=label, selection=selection) == want


@pytest.mark.parametrize(
    ("names", "label", "selection", "message"),
    [
        (["a"], "b", configsets.Selection(), "specified config b does not exist"),
        (["a"], None, configsets.Selection(default="c"), "specified config c does not exist"),
        (["..data"], None, configsets.Selection(), "no configuration files available"),
        (
            ["a", "b"],
            None,
            configsets.Selection(fallbacks=(configsets.Fallback.SINGLE,)),
            "all fallbacks failed",
        ),
    ],
)
def test_named_set_errors(
    names: list[str], label: str | None, selection: configsets.Selection, message: str
) -> None:
    with pytest.raises(errors.SharingConfigError, match=message):
        configsets.select(names, label=label, selection=selection)


def test_single_fallback_and_unknown_fallback() -> None:
    sel = configsets.Selection(fallbacks=(configsets.Fallback.SINGLE,))
    assert configsets.select(["only"], label=None, selection=sel) == "only"
    with pytest.raises(errors.SharingConfigError, match="unknown fallback strategy: x"):
        configsets.parse_fallbacks(["x"])


# --- replicas --------------------------------------------------------------------------------


def dev(i: int, *, mig: bool = False, healthy: bool = True, j: int = 0) -> replicas.Device:
    if mig:
        return replicas.Device(f"MIG-{i}-{j}", f"{i}:{j}", i, healthy, 10240, mig=True)
    return replicas.Device(f"GPU-{i}", str(i), i, healthy, 81920, mig=False)


NODE = (replicas.Resource(GPU, (dev(0), dev(1, healthy=False))),)


def ids(resources: tuple[replicas.Resource, ...]) -> dict[str, list[str]]:
    return {r.name: [d.id for d in r.devices] for r in resources}


def test_replicas_are_annotated_ids_with_health_copied() -> None:
    out = replicas.replicate(NODE, parse(TS))
    assert ids(out) == {GPU: [f"GPU-{i}::{n}" for i in (0, 1) for n in range(4)]}
    assert [d.healthy for d in out[0].devices] == [True] * 4 + [False] * 4
    assert {d.replicas for d in out[0].devices} == {4}


def test_rename_and_partial_selection() -> None:
    c = parse(
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, rename: gpu.half, "
        "devices: [1]}]}}"
    )
    assert ids(replicas.replicate(NODE, c)) == {
        GPU: ["GPU-0"],
        "nvidia.com/gpu.half": ["GPU-1::0", "GPU-1::1"],
    }


def test_count_and_disjoint_lists() -> None:
    c = parse("sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: 1}]}}")
    assert ids(replicas.replicate(NODE, c)) == {GPU: ["GPU-0::0", "GPU-0::1", "GPU-1"]}
    c = parse(
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: [0]}, "
        "{name: gpu, replicas: 3, devices: [1]}]}}"
    )
    assert ids(replicas.replicate(NODE, c))[GPU] == [
        "GPU-0::0", "GPU-0::1", "GPU-1::0", "GPU-1::1", "GPU-1::2",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("devices", "message"),
    [
        ("3", "requested 3 devices to be replicated, but only 2 devices available"),
        ("[4]", "no matching device at index: 4"),
        (f"[{UUID0}]", f"no matching device with UUID: {UUID0}"),
    ],
)
def test_selection_the_node_cannot_satisfy(devices: str, message: str) -> None:
    c = parse(
        f"sharing: {{timeSlicing: {{resources: [{{name: gpu, replicas: 2, devices: {devices}}}]}}}}"
    )
    with pytest.raises(errors.SharingConfigError) as caught:
        replicas.replicate(NODE, c)
    assert message in str(caught.value)
    assert str(caught.value).startswith("sharing.timeSlicing.resources[0].devices: ")


def test_overlapping_lists_on_the_node_are_refused() -> None:
    c = parse(
        "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: [0]}, "
        "{name: gpu, replicas: 3, devices: ['GPU-0']}]}}".replace("'GPU-0'", "'" + UUID0 + "'")
    )
    node = (replicas.Resource(GPU, (replace_id(dev(0), UUID0),)),)
    with pytest.raises(errors.SharingConfigError, match="also shared by"):
        replicas.replicate(node, c)


def replace_id(d: replicas.Device, new: str) -> replicas.Device:
    return replicas.Device(new, d.index, d.gpu_index, d.healthy, d.memory_mib, d.mig)


def test_mps_refuses_mig_devices_and_absent_resources_are_skipped() -> None:
    c = parse("sharing: {mps: {resources: [{name: gpu, replicas: 2}, {name: mig-1g.10gb, "
              "replicas: 2}]}}")  # fmt: skip
    node = (replicas.Resource(GPU, (dev(0, mig=True),)),)
    with pytest.raises(errors.SharingConfigError, match="not supported for MIG devices"):
        replicas.replicate(node, c)
    assert ids(replicas.replicate((replicas.Resource(GPU, (dev(0),)),), c)) == {
        GPU: ["GPU-0::0", "GPU-0::1"]
    }


def test_unshared_resources_untouched() -> None:
    mig = replicas.Resource("nvidia.com/mig-1g.10gb", (dev(0, mig=True),))
    out = replicas.replicate((*NODE, mig), parse(TS))
    assert ids(out)["nvidia.com/mig-1g.10gb"] == ["MIG-0-0"]
    assert replicas.replicate(NODE, config.EMPTY) == NODE


@pytest.mark.parametrize(
    ("requested", "fail", "problem"),
    [
        (["GPU-0::0"], True, None),
        (["GPU-0::0", "GPU-0::1"], True, "maximum request size for shared resources is 1; found 2"),
        (["GPU-0::0", "GPU-0::1"], False, None),
        (["GPU-0", "GPU-1"], True, None),
    ],
)
def test_request_problem(requested: list[str], fail: bool, problem: str | None) -> None:
    c = parse(
        "sharing: {timeSlicing: {failRequestsGreaterThanOne: "
        f"{str(fail).lower()}, resources: [{{name: gpu, replicas: 2}}]}}}}"
    )
    found = replicas.request_problem(requested, c)
    assert found == (None if problem is None else f"invalid request: {problem}")


def test_real_ids_once_in_order() -> None:
    assert replicas.real_ids(["GPU-1::2", "GPU-0::0", "GPU-1::0"]) == ("GPU-1", "GPU-0")


@given(
    taken=st.lists(st.booleans(), min_size=8, max_size=8),
    size=st.integers(min_value=1, max_value=8),
)
def test_preferred_spreads_over_least_used_devices(taken: list[bool], size: int) -> None:
    shared = replicas.replicate(NODE, parse(TS))[0]
    available = [d.id for d, t in zip(shared.devices, taken, strict=True) if not t]
    size = min(size, len(available))
    got = replicas.preferred(shared, available=available, must_include=[], size=size)
    assert len(got) == size and set(got) <= set(available)
    assert len(set(got)) == size
    devices = ("GPU-0", "GPU-1")
    used = {r: sum(1 for d, t in zip(shared.devices, taken, strict=True) if t and d.real_id == r)
            for r in devices}  # fmt: skip
    picks = {r: sum(1 for p in got if replicas.real_id(p) == r) for r in devices}
    final = {r: used[r] + picks[r] for r in devices}
    for x in devices:
        still_free = any(replicas.real_id(a) == x for a in available if a not in got)
        for y in devices:
            if still_free and picks[y]:
                # Greedy: y's last replica was picked while x had a free, no more used one.
                assert final[x] + 1 >= final[y]


# --- MPS -------------------------------------------------------------------------------------


MPS = "sharing:\n  mps:\n    resources:\n    - {name: gpu, replicas: 4}\n"


def test_mps_daemon_per_resource_as_nvidia() -> None:
    c = parse(MPS)
    shared = replicas.replicate(NODE, c)
    (daemon,) = mps.daemons(shared, c)
    assert daemon.resource == GPU
    assert daemon.pipe_dir == "/run/nvidia/mps/nvidia.com/gpu/pipe"
    assert daemon.log_dir == "/run/nvidia/mps/nvidia.com/gpu/log"
    assert daemon.active_thread_percentage == 25
    assert [(d.uuid, d.index, d.pinned_limit_mib) for d in daemon.devices] == [
        ("GPU-0", "0", 20480),
        ("GPU-1", "1", 20480),
    ]
    assert daemon.control_commands() == (
        "set_default_device_pinned_mem_limit 0 20480M",
        "set_default_device_pinned_mem_limit 1 20480M",
        "set_default_active_thread_percentage 25",
    )
    assert mps.daemons(shared, c, root="/x/")[0].pipe_dir == "/x/nvidia.com/gpu/pipe"
    assert mps.daemons(replicas.replicate(NODE, parse(TS)), parse(TS)) == ()


def test_mps_client_env_and_mounts() -> None:
    c = parse(MPS)
    (daemon,) = mps.daemons(replicas.replicate(NODE, c), c)
    got = mps.client(daemon, ["GPU-1::3"])
    assert got.envs == {
        "CUDA_MPS_PIPE_DIRECTORY": "/mps/nvidia.com/gpu/pipe",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20480M",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
    }
    assert got.mounts == (
        mps.Mount("/run/nvidia/mps/nvidia.com/gpu/pipe", "/mps/nvidia.com/gpu/pipe"),
        mps.Mount("/run/nvidia/mps/shm", "/dev/shm"),
    )
    two = mps.client(daemon, ["GPU-1::3", "GPU-0::0"])
    assert two.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M,1=20480M"


# --- labels ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "resource", "want"),
    [
        (TS, GPU, (4, "time-slicing", True)),
        (TS, "nvidia.com/mig-1g.10gb", (1, "none", False)),
        (MPS, GPU, (4, "mps", True)),
        (
            "sharing: {timeSlicing: {renameByDefault: true, "
            "resources: [{name: gpu, replicas: 2}]}}",
            GPU,
            (2, "time-slicing", False),
        ),
        ("", GPU, (1, "none", False)),
    ],
)
def test_labels_follow_gfd(text: str, resource: str, want: tuple[int, str, bool]) -> None:
    got = labelling.resource_sharing(parse(text), resource)
    assert (got.replicas, got.strategy, got.shared_product) == want


def test_labels_without_sharing_and_mps_capable() -> None:
    assert labelling.resource_sharing(None, GPU).replicas == 0
    assert labelling.mps_capable(parse(MPS), any_mig_enabled=False)
    assert not labelling.mps_capable(parse(MPS), any_mig_enabled=True)
    assert not labelling.mps_capable(parse(TS), any_mig_enabled=False)


def test_an_unhashable_key_is_a_one_line_error_not_a_crash() -> None:
    """One strict YAML loader for every config (``migpilot.yamltext``): a mapping used as a key
    is reported, never a TypeError."""
    with pytest.raises(errors.SharingConfigError) as info:
        config.parse("version: v1\n? {a: 1}\n: 2\n", source="c.yaml")
    assert str(info.value).startswith("c.yaml: malformed YAML") and "\n" not in str(info.value)


def test_the_most_time_slicing_replicas_are_accepted() -> None:
    """The cap is a bound, not a change of meaning: 1024 replicas of a device still parse."""
    c = parse(
        f"sharing: {{timeSlicing: {{resources: [{{name: gpu, replicas: {config.MAX_REPLICAS}}}]}}}}"
    )
    assert c.time_slicing is not None
    assert c.time_slicing.resources[0].replicas == config.MAX_REPLICAS == 1024


def test_an_alias_bomb_is_refused_with_a_short_message() -> None:
    # Nine lists of nine references each: a few objects in memory, ~10**9 items in a plain
    # repr. The message quoting it once wrote gigabytes of agent log; now it is one short line.
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]
    text = "\n".join(
        [
            "version: v1",
            *lines,
            "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: *l9}]}}",
        ]
    )
    with pytest.raises(errors.SharingConfigError) as got:
        config.parse(text, source="bomb.yaml")
    message = str(got.value)
    assert "devices[0]: unsupported type for device in devices list: [[[" in message
    assert len(message) < 600, len(message)


def test_a_long_device_string_is_quoted_cut_short() -> None:
    text = (
        "version: v1\nsharing: {timeSlicing: {resources: [{name: gpu, replicas: 2, devices: "
        + "x" * 100_000
        + "}]}}\n"
    )
    with pytest.raises(errors.SharingConfigError) as got:
        config.parse(text, source="long.yaml")
    assert "devices set as 'xxx" in str(got.value)
    assert len(str(got.value)) < 600
