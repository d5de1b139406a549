"""nvidia-mig-parted config files: parsing as mig-parted does, entry selection, placement, check."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from migpilot import errors
from migpilot.mig import catalog, migparted, pciids, profiles

DEFAULT_CONFIG = (
    Path(__file__).resolve().parents[3] / "shared" / "reference" / "mig-parted-config-default.yaml"
)
A100_40GB_SXM = 0x20B010DE
A100_80GB_SXM = 0x20B210DE
A30 = 0x20B710DE


def pci(device: int, subsystem: int | None = None) -> pciids.PciId:
    return pciids.PciId(device, subsystem)


def doc(text: str) -> str:
    return textwrap.dedent(text).lstrip()


def parse(text: str) -> migparted.ConfigFile:
    return migparted.parse(doc(text), source="mig.yaml")


def one_config(entries: str) -> str:
    """A file with one config ``custom`` whose entries are ``entries`` (YAML list items)."""
    body = textwrap.indent(textwrap.dedent(entries).strip(), "    ")
    return f"version: v1\nmig-configs:\n  custom:\n{body}\n"


def parse_error(text: str) -> str:
    with pytest.raises(errors.ConfigError) as info:
        migparted.parse(text, source="mig.yaml")
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("mig.yaml")
    return message


def model(name: str) -> profiles.GpuModel:
    return catalog.resolve_gpu(name)


# --- what mig-parted rejects -----------------------------------------------------------------

FILE_ERRORS = {
    "missing version": (
        "mig-configs:\n  a:\n    - {devices: all, mig-enabled: false}\n",
        "unable to parse with missing 'version' field",
    ),
    "empty file": ("", "unable to parse with missing 'version' field"),
    "wrong version": (
        "version: v2\nmig-configs:\n  a:\n    - {devices: all, mig-enabled: false}\n",
        "unknown version: v2",
    ),
    "numeric version": ("version: 1\nmig-configs: {}\n", "unknown version: 1"),
    "unexpected top-level field": (
        "version: v1\nsharing: {}\nmig-configs:\n  a:\n    - {devices: all, mig-enabled: false}\n",
        "unexpected field: sharing",
    ),
    "empty mig-configs": (
        "version: v1\nmig-configs: {}\n",
        "at least one entry in 'mig-configs' is required",
    ),
    "null mig-configs": (
        "version: v1\nmig-configs:\n",
        "at least one entry in 'mig-configs' is required",
    ),
    "missing mig-configs": ("version: v1\n", "missing required field: mig-configs"),
    "mig-configs a list": ("version: v1\nmig-configs: [a]\n", "mig-configs must be a mapping"),
    "top level a list": ("- version: v1\n", "expected a mapping at the top"),
    "empty entry list": (
        "version: v1\nmig-configs:\n  custom: []\n",
        "at least one entry in 'custom' is required",
    ),
    "null entry list": (
        "version: v1\nmig-configs:\n  custom:\n",
        "at least one entry in 'custom' is required",
    ),
    "entries a mapping": (
        "version: v1\nmig-configs:\n  custom: {devices: all, mig-enabled: false}\n",
        "config 'custom': expected a list of entries",
    ),
}


@pytest.mark.parametrize(("text", "expected"), FILE_ERRORS.values(), ids=FILE_ERRORS.keys())
def test_file_level_errors_name_the_problem(text: str, expected: str) -> None:
    message = parse_error(text)
    assert message.startswith("mig.yaml: ")
    assert expected in message


ENTRY_ERRORS = {
    "missing devices": ("- {mig-enabled: false}", "missing required field: devices"),
    "missing mig-enabled": ("- {devices: all}", "missing required field: mig-enabled"),
    "unexpected field": (
        "- {devices: all, mig-enabled: false, mig-strategy: mixed}",
        "unexpected field: mig-strategy",
    ),
    "devices a string other than all": (
        "- {devices: some, mig-enabled: false}",
        "invalid string input for 'devices': 'some'",
    ),
    "devices a number": ("- {devices: 3, mig-enabled: false}", "devices must be 'all' or a list"),
    "devices with a name": ("- {devices: [0, gpu1], mig-enabled: false}", "'gpu1' is not a GPU"),
    "devices with a negative index": ("- {devices: [-1], mig-enabled: false}", "-1 is not a GPU"),
    "mig-enabled a string": (
        "- {devices: all, mig-enabled: 'true'}",
        "mig-enabled must be true or false",
    ),
    "enabled without mig-devices": (
        "- {devices: all, mig-enabled: true}",
        "missing required field 'mig-devices' when 'mig-enabled' is true",
    ),
    "enabled with null mig-devices": (
        "- {devices: all, mig-enabled: true, mig-devices: null}",
        "missing required field 'mig-devices' when 'mig-enabled' is true",
    ),
    "devices while disabled": (
        "- {devices: all, mig-enabled: false, mig-devices: {1g.5gb: 1}}",
        "MIG devices included when 'mig-enabled' is false",
    ),
    "negative count": (
        "- {devices: all, mig-enabled: true, mig-devices: {1g.5gb: -1}}",
        "invalid count for '1g.5gb': -1",
    ),
    "count not a number": (
        "- {devices: all, mig-enabled: true, mig-devices: {1g.5gb: many}}",
        "count for '1g.5gb' must be an integer",
    ),
    "count a boolean": (
        "- {devices: all, mig-enabled: true, mig-devices: {1g.5gb: true}}",
        "count for '1g.5gb' must be an integer",
    ),
    "all counts zero": (
        "- {devices: all, mig-enabled: true, mig-devices: {1g.5gb: 0, 2g.10gb: 0}}",
        "all counts for all MigProfiles are 0",
    ),
    "mig-devices a list": (
        "- {devices: all, mig-enabled: true, mig-devices: [1g.5gb]}",
        "mig-devices must be a mapping",
    ),
    "device-filter unquoted hex": (
        "- {device-filter: 0x20B010DE, devices: all, mig-enabled: false}",
        'device-filter ids must be strings, got the number 548409566 (quote it: "0x20B010DE")',
    ),
    "device-filter not an id": (
        "- {device-filter: ['A100-SXM4'], devices: all, mig-enabled: false}",
        "device-filter 'A100-SXM4' is not a PCI device id",
    ),
    "device-filter beyond 32 bits": (
        "- {device-filter: '0x8000000000', devices: all, mig-enabled: false}",
        "device-filter '0x8000000000' is not a PCI device id",
    ),
    "device-filter a mapping": (
        "- {device-filter: {id: '0x20B010DE'}, devices: all, mig-enabled: false}",
        "device-filter must be a string or a list of strings, got a mapping",
    ),
    "entry a string": ("- all", "expected a mapping, got the string 'all'"),
}


@pytest.mark.parametrize(("entry", "expected"), ENTRY_ERRORS.values(), ids=ENTRY_ERRORS.keys())
def test_entry_errors_name_config_entry_and_problem(entry: str, expected: str) -> None:
    message = parse_error(one_config(entry))
    assert message.startswith("mig.yaml: config 'custom' entry 0: ")
    assert expected in message


def test_entry_index_counts_from_zero_in_file_order() -> None:
    text = one_config(
        """
        - {devices: [0], mig-enabled: false}
        - {devices: [1]}
        """
    )
    assert (
        parse_error(text)
        == "mig.yaml: config 'custom' entry 1: missing required field: mig-enabled"
    )


@pytest.mark.parametrize(
    "name",
    [
        "mig-1g.10gb",  # the device plugin's resource spelling
        "1g.10gb.me",  # ... and its attribute spelling
        "1g10gb",
        "1g.10",
        "g.10gb",
        "1g.10gb+",
        "1g.10gb+1me",
        " 1g.10gb",
        "1G.10GB",
    ],
)
def test_malformed_profile_names_are_rejected(name: str) -> None:
    text = one_config(f"- devices: all\n  mig-enabled: true\n  mig-devices: {{'{name}': 1}}")
    message = parse_error(text)
    assert message.startswith(
        f"mig.yaml: config 'custom' entry 0: mig-devices: invalid format for {name!r}"
    )


def test_non_string_profile_key_is_rejected() -> None:
    message = parse_error(one_config("- {devices: all, mig-enabled: true, mig-devices: {1: 1}}"))
    assert "profile 1 must be a string" in message


def test_malformed_yaml_names_the_line() -> None:
    text = "version: v1\nmig-configs:\n  custom:\n    - devices: all\n     mig-enabled: true\n"
    message = parse_error(text)
    assert message.startswith("mig.yaml: malformed YAML at line 5")


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_yaml_nested_past_the_recursion_limit_is_a_config_error(depth: int) -> None:
    """PyYAML's loader recurses per level: a document a thousand levels deep (a few KB) once
    raised RecursionError instead of the one-line config error."""
    message = parse_error("version: v1\nmig-configs: " + "[" * depth + "]" * depth + "\n")
    assert (
        message
        == "mig.yaml: malformed YAML: nested too deeply to read (a config is a few levels deep)"
    )


def test_unclosed_flow_mapping_is_malformed_yaml() -> None:
    message = parse_error("version: v1\nmig-configs: {custom: [\n")
    assert message.startswith("mig.yaml: malformed YAML at line ")


def test_duplicate_keys_are_rejected_with_their_line() -> None:
    text = doc(
        """
        version: v1
        mig-configs:
          custom:
            - {devices: all, mig-enabled: false}
          custom:
            - {devices: all, mig-enabled: false}
        """
    )
    assert (
        parse_error(text) == "mig.yaml: malformed YAML at line 5, column 3: duplicate key 'custom'"
    )


def test_keys_beside_a_yaml_merge_override_it_without_being_duplicates() -> None:
    config = parse(
        """
        version: v1
        mig-configs:
          base:
            - &entry {devices: all, mig-enabled: true, mig-devices: {"1g.5gb": 1}}
          other:
            - <<: *entry
              mig-enabled: false
              mig-devices: {}
        """
    )
    (entry,) = config.configs["other"]
    assert (entry.devices, entry.mig_enabled, entry.mig_devices) == ("all", False, ())


# --- what mig-parted accepts -----------------------------------------------------------------


def test_valid_file_parses_into_frozen_values() -> None:
    config = parse(
        """
        version: v1
        mig-configs:
          all-disabled:
            - devices: all
              mig-enabled: false
          custom:
            - device-filter: "0x20B010DE"
              devices: [0, 1]
              mig-enabled: true
              mig-devices:
                "3g.20gb": 1
                "1g.5gb": 0
                "2g.10gb": 2
            - devices: all
              mig-enabled: true
              mig-devices: {}
        """
    )
    assert config.version == "v1"
    assert config.source == "mig.yaml"
    assert list(config.configs) == ["all-disabled", "custom"]
    disabled = config.configs["all-disabled"][0]
    assert disabled == migparted.Entry((), (), "all", mig_enabled=False, mig_devices=())
    first, second = config.configs["custom"]
    assert first.device_filter == (pci(A100_40GB_SXM),)
    assert first.device_filter_text == ("0x20B010DE",)
    assert first.devices == (0, 1)
    assert first.mig_enabled is True
    assert first.mig_devices == (("3g.20gb", 1), ("1g.5gb", 0), ("2g.10gb", 2))
    assert first.wanted() == (("3g.20gb", 1), ("2g.10gb", 2))
    assert second.mig_devices == ()
    assert second.device_filter == ()
    with pytest.raises(TypeError):
        config.configs["new"] = ()  # type: ignore[index]


def test_device_filter_string_and_list_mean_the_same() -> None:
    as_string = parse(
        one_config("- {device-filter: '0x20B010DE', devices: all, mig-enabled: false}")
    )
    as_list = parse(
        one_config("- {device-filter: ['0x20B010DE'], devices: all, mig-enabled: false}")
    )
    assert as_string.configs["custom"] == as_list.configs["custom"]
    several = parse(
        one_config(
            "- {device-filter: ['0x20B010DE', '0x20b710de'], devices: all, mig-enabled: false}"
        )
    )
    entry = several.configs["custom"][0]
    assert entry.device_filter == (pci(A100_40GB_SXM), pci(A30))
    assert entry.device_filter_text == ("0x20B010DE", "0x20b710de")


@pytest.mark.parametrize("empty", ["null", "''", "[]"])
def test_an_empty_device_filter_matches_every_gpu(empty: str) -> None:
    config = parse(one_config(f"- {{device-filter: {empty}, devices: all, mig-enabled: false}}"))
    entry = config.configs["custom"][0]
    assert entry.device_filter == ()
    assert entry.matches(pci_ids=(pci(A30, 0x16C110DE),), index=5)


def test_disabled_entry_may_carry_an_empty_mig_devices_map() -> None:
    config = parse(one_config("- {devices: all, mig-enabled: false, mig-devices: {}}"))
    assert config.configs["custom"][0].mig_devices == ()


@pytest.mark.parametrize(
    "name", ["1g.10gb+me", "1g.24gb+me.all", "1g.24gb+gfx", "1g.24gb-me", "1c.3g.20gb", "7g.186gb"]
)
def test_profile_names_mig_parted_accepts(name: str) -> None:
    config = parse(
        one_config(f"- devices: all\n  mig-enabled: true\n  mig-devices: {{'{name}': 1}}")
    )
    assert config.configs["custom"][0].mig_devices == ((name, 1),)


def test_entry_matches_filter_and_index() -> None:
    entry = migparted.Entry(
        (pci(A100_40GB_SXM),), ("0x20B010DE",), (0, 2), mig_enabled=False, mig_devices=()
    )
    assert entry.matches(pci_ids=(pci(A100_40GB_SXM, 0x145F10DE),), index=0)
    assert entry.matches(pci_ids=(pci(A30, 0), pci(A100_40GB_SXM, 0)), index=2)
    assert not entry.matches(pci_ids=(pci(A100_40GB_SXM, 0),), index=1)
    assert not entry.matches(pci_ids=(pci(A30, 0),), index=0)


# --- what each GPU gets ----------------------------------------------------------------------

SELECTION = one_config(
    """
    - devices: all
      mig-enabled: true
      mig-devices: {"7g.40gb": 1}
    - device-filter: "0x20B710DE"
      devices: all
      mig-enabled: true
      mig-devices: {"4g.24gb": 1}
    - devices: [1, 3]
      mig-enabled: false
    """
)


def layout_texts(gpus: tuple[migparted.GpuLayout, ...]) -> list[str]:
    return [str(g.layout) if g.mig_enabled else "disabled" for g in gpus]


def test_the_last_matching_entry_decides_as_in_mig_parted() -> None:
    config = migparted.parse(SELECTION, source="mig.yaml")
    gpus = migparted.layout_for(config, "custom", model=model("a100-40gb"), gpus=4)
    assert [g.index for g in gpus] == [0, 1, 2, 3]
    assert [g.entry for g in gpus] == [0, 2, 0, 2]
    assert layout_texts(gpus) == ["7g.40gb@0", "disabled", "7g.40gb@0", "disabled"]
    on_a30 = migparted.layout_for(config, "custom", model=model("a30"), gpus=3)
    assert [g.entry for g in on_a30] == [1, 2, 1]
    assert layout_texts(on_a30) == ["4g.24gb@0", "disabled", "4g.24gb@0"]


def test_device_filter_picks_among_a_models_pci_ids() -> None:
    config = parse(
        one_config(
            """
            - {device-filter: "0x20B010DE", devices: all, mig-enabled: true,
               mig-devices: {"7g.40gb": 1}}
            - {device-filter: "0x20B110DE", devices: all, mig-enabled: false}
            """
        )
    )
    a100 = model("a100-40gb")
    sxm = migparted.layout_for(config, "custom", model=a100, gpus=1, pci_id=pci(A100_40GB_SXM))
    pcie = migparted.layout_for(config, "custom", model=a100, gpus=1, pci_id=pci(0x20B110DE))
    assert layout_texts(sxm) == ["7g.40gb@0"]
    assert layout_texts(pcie) == ["disabled"]


def test_a_gpu_no_entry_matches_is_an_error_saying_what_mig_parted_does() -> None:
    config = parse(one_config("- {devices: [0], mig-enabled: false}"))
    with pytest.raises(errors.ConfigError) as info:
        migparted.layout_for(config, "custom", model=model("a100-40gb"), gpus=2)
    message = str(info.value)
    assert message.startswith("mig.yaml: config 'custom': no entry matches GPU 1 (a100-40gb)")
    assert "leave that GPU as it is" in message
    assert "not all GPUs match the specified config" in message


def test_a_filter_for_another_gpu_matches_nothing() -> None:
    config = parse(one_config("- {device-filter: '0x20B710DE', devices: all, mig-enabled: false}"))
    with pytest.raises(errors.ConfigError, match="no entry matches GPU 0 \\(a100-40gb\\)"):
        migparted.layout_for(config, "custom", model=model("a100-40gb"), gpus=1)


def test_drifted_names_resolve_by_hardware_shape() -> None:
    config = parse(
        one_config('- {devices: all, mig-enabled: true, mig-devices: {"3g.39gb": 1, "1g.10gb": 4}}')
    )
    gpus = migparted.layout_for(config, "custom", model=model("a100-80gb"), gpus=1)
    assert gpus[0].mig_enabled
    assert gpus[0].layout.profile_counts() == {"3g.40gb": 1, "1g.10gb": 4}
    assert {i.profile for i in gpus[0].layout.instances} == {"3g.40gb", "1g.10gb"}


def test_enabled_with_no_devices_places_nothing() -> None:
    config = parse(one_config("- {devices: all, mig-enabled: true, mig-devices: {}}"))
    gpus = migparted.layout_for(config, "custom", model=model("h100-80gb"), gpus=2)
    assert [(g.mig_enabled, len(g.layout)) for g in gpus] == [(True, 0), (True, 0)]


def test_an_entry_that_cannot_be_placed_names_config_entry_and_reason() -> None:
    config = parse(one_config('- {devices: all, mig-enabled: true, mig-devices: {"3g.40gb": 3}}'))
    with pytest.raises(errors.ConfigError) as info:
        migparted.layout_for(config, "custom", model=model("a100-80gb"), gpus=1)
    assert str(info.value) == (
        "mig.yaml: config 'custom' entry 0 cannot be placed on a100-80gb: "
        "3 x 3g.40gb exceed its maximum of 2 per GPU"
    )


def test_a_profile_the_gpu_lacks_names_config_entry_and_profile() -> None:
    config = parse(one_config('- {devices: all, mig-enabled: true, mig-devices: {"1g.5gb": 1}}'))
    with pytest.raises(errors.ConfigError) as info:
        migparted.layout_for(config, "custom", model=model("h100-80gb"), gpus=1)
    message = str(info.value)
    assert message.startswith("mig.yaml: config 'custom' entry 0 cannot be placed on h100-80gb: ")
    assert "'1g.5gb'" in message


def test_an_unknown_config_lists_the_known_ones() -> None:
    config = migparted.parse(SELECTION, source="mig.yaml")
    with pytest.raises(errors.ConfigError) as info:
        migparted.layout_for(config, "cutsom", model=model("a100-40gb"), gpus=1)
    assert str(info.value) == (
        "mig.yaml: no config 'cutsom'; did you mean 'custom'? (known: custom)"
    )


# --- checking against the catalog ------------------------------------------------------------


def test_check_finds_nothing_in_a_good_file() -> None:
    config = migparted.parse(SELECTION, source="mig.yaml")
    assert migparted.check(config) == []


def test_check_places_a_filtered_entry_on_each_gpu_its_ids_name() -> None:
    config = parse(
        one_config(
            """
            - device-filter: ["0x20B010DE", "0x20B110DE", "0x20B210DE", "0x7FFF10DE"]
              devices: all
              mig-enabled: true
              mig-devices: {"1g.10gb": 5}
            """
        )
    )
    # Two ids of the A100-40GB give one problem; the A100-80GB holds 5 x 1g.10gb; the unknown
    # id is not an error (mig-parted just never matches it).
    assert migparted.check(config) == [
        "mig.yaml: config 'custom' entry 0: a100-40gb: 5 x 1g.10gb exceed its maximum of 4 per GPU"
    ]


def test_check_reports_a_profile_the_filtered_gpu_lacks() -> None:
    config = parse(
        one_config(
            "- {device-filter: '0x20B710DE', devices: all, mig-enabled: true,"
            " mig-devices: {1g.10gb: 1}}"
        )
    )
    (problem,) = migparted.check(config)
    assert problem.startswith("mig.yaml: config 'custom' entry 0: a30-24gb: ")
    assert "'1g.10gb'" in problem


def test_check_without_filter_uses_every_gpu_offering_the_profiles() -> None:
    # NVIDIA's file filters all-1g.10gb by PCI id for this reason: the A100-40GB holds 4.
    config = parse(one_config('- {devices: all, mig-enabled: true, mig-devices: {"1g.10gb": 7}}'))
    problems = migparted.check(config)
    assert (
        "mig.yaml: config 'custom' entry 0: a100-40gb: 7 x 1g.10gb exceed its maximum of 4 per GPU"
        in problems
    )
    assert not any("h100-80gb" in p or "a100-80gb" in p for p in problems)


def test_check_without_filter_prefers_exact_names_over_drift() -> None:
    # 7 x 1g.5gb is for the A100-40GB; the A30's 1g.6gb is within the drift tolerance but
    # holds only 4, and mig-parted would never apply 1g.5gb there.
    config = parse(one_config('- {devices: all, mig-enabled: true, mig-devices: {"1g.5gb": 7}}'))
    assert migparted.check(config) == []


def test_check_reports_a_profile_no_gpu_offers() -> None:
    config = parse(one_config('- {devices: all, mig-enabled: true, mig-devices: {"1g.500gb": 1}}'))
    assert migparted.check(config) == [
        "mig.yaml: config 'custom' entry 0: no known GPU offers 1g.500gb"
    ]


def test_check_against_a_small_catalog() -> None:
    only_a100 = catalog.Catalog([model("a100-40gb")])
    config = parse(one_config('- {devices: all, mig-enabled: true, mig-devices: {"1g.20gb": 1}}'))
    assert migparted.check(config, cat=only_a100) == [
        "mig.yaml: config 'custom' entry 0: no known GPU offers 1g.20gb"
    ]


def test_check_reports_profiles_no_single_gpu_offers_together() -> None:
    config = parse(
        one_config('- {devices: all, mig-enabled: true, mig-devices: {"7g.40gb": 1, "7g.80gb": 1}}')
    )
    assert migparted.check(config) == [
        "mig.yaml: config 'custom' entry 0: no known GPU offers all of 7g.40gb, 7g.80gb"
    ]


def test_check_explains_compute_instance_profiles() -> None:
    # mig-parted accepts compute-instance profiles; migpilot places whole GPU instances only.
    config = parse(
        one_config('- {devices: all, mig-enabled: true, mig-devices: {"1c.3g.40gb": 1}}')
    )
    problems = migparted.check(config)
    assert problems
    assert all("'1c.3g.40gb' is a compute-instance profile" in p for p in problems)
    assert any(p.startswith("mig.yaml: config 'custom' entry 0: a100-80gb: ") for p in problems)
    odd = parse(one_config('- {devices: all, mig-enabled: true, mig-devices: {"1c.3g.41gb": 1}}'))
    assert migparted.check(odd) == [
        "mig.yaml: config 'custom' entry 0: 1c.3g.41gb is a compute-instance profile; "
        "migpilot places GPU instances"
    ]


def test_check_skips_disabled_entries() -> None:
    config = parse(one_config("- {device-filter: '0x20B010DE', devices: all, mig-enabled: false}"))
    assert migparted.check(config) == []


# --- NVIDIA's shipped file -------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_config() -> migparted.ConfigFile:
    if not DEFAULT_CONFIG.is_file():
        pytest.skip(f"NVIDIA's default config is not in this checkout ({DEFAULT_CONFIG})")
    return migparted.parse(DEFAULT_CONFIG.read_text(encoding="utf-8"), source=DEFAULT_CONFIG.name)


def test_every_default_config_parses(default_config: migparted.ConfigFile) -> None:
    assert {"all-disabled", "all-enabled", "all-balanced", "all-1g.10gb"} <= set(
        default_config.configs
    )
    assert len(default_config.configs) >= 80


def test_the_default_file_has_no_problems(default_config: migparted.ConfigFile) -> None:
    assert migparted.check(default_config) == []


def test_every_default_filter_id_is_a_known_gpu(default_config: migparted.ConfigFile) -> None:
    cat = catalog.default()
    unknown = {
        text
        for entries in default_config.configs.values()
        for entry in entries
        for dev, text in zip(entry.device_filter, entry.device_filter_text, strict=True)
        if dev.subsystem is not None or cat.by_pci_device_id(dev.device) is None
    }
    assert unknown == set()


def filtered_cases() -> list[tuple[str, int, int]]:
    if not DEFAULT_CONFIG.is_file():
        return []
    config = migparted.parse(DEFAULT_CONFIG.read_text(encoding="utf-8"), source="default")
    return [
        (name, i, dev.device)
        for name, entries in config.configs.items()
        for i, entry in enumerate(entries)
        for dev in entry.device_filter
    ]


@pytest.mark.parametrize(
    ("name", "entry", "device_id"),
    filtered_cases() or [pytest.param("", 0, 0, marks=pytest.mark.skip("no default config"))],
    ids=lambda v: f"{v:#010x}" if isinstance(v, int) and v > 9 else str(v),
)
def test_default_filtered_entries_place_on_the_gpus_they_name(
    default_config: migparted.ConfigFile, name: str, entry: int, device_id: int
) -> None:
    gpu = catalog.default().by_pci_device_id(device_id)
    assert gpu is not None, f"{device_id:#010x} is not in the catalog"
    gpus = migparted.layout_for(default_config, name, model=gpu, gpus=2, pci_id=pci(device_id))
    assert [g.entry for g in gpus] == [entry, entry]
    wanted = sum(n for _, n in default_config.configs[name][entry].wanted())
    assert all(len(g.layout) == wanted for g in gpus)


# --- mig-parted's own test cases, restated ---------------------------------------------------
# The cases of api/spec/v1/spec_test.go, api/spec/v1/helpers_test.go and the profile-name cases
# once in pkg/types (now go-nvlib's), in github.com/NVIDIA/mig-parted, written as config files.
# Where migpilot deliberately answers differently the case says so (and the README lists it).

H100_SXM = 0x233010DE
H100_BOARD = 0x16C010DE  # the board mig-parted's matching tests use
H100_SIBLING = 0x16C110DE  # another board with the same device id

SPEC_CASES = {
    # name: (file, mig-parted accepts, migpilot accepts)
    "well formed": (
        "version: v1\nmig-configs:\n  all-disabled:\n    - {devices: all, mig-enabled: false}\n",
        True,
        True,
    ),
    "wrong version": (
        "version: v2\nmig-configs:\n  all-disabled:\n    - {devices: all, mig-enabled: false}\n",
        False,
        False,
    ),
    "only a wrong version": ("version: v2\n", False, False),
    "missing version": (
        "mig-configs:\n  all-disabled:\n    - {devices: all, mig-enabled: false}\n",
        False,
        False,
    ),
    "an unexpected field": (
        "bogus: field\nversion: v1\nmig-configs:\n"
        "  all-disabled:\n    - {devices: all, mig-enabled: false}\n",
        False,
        False,
    ),
    "empty mig-configs": ("version: v1\nmig-configs: {}\n", False, False),
    # Stricter: a file with nothing to apply fails when read, not when a config is selected.
    "an empty file": ("", True, False),
    "only the version": ("version: v1\n", True, False),
}


@pytest.mark.parametrize(
    ("text", "mig_parted", "migpilot"), SPEC_CASES.values(), ids=SPEC_CASES.keys()
)
def test_mig_parted_spec_cases(text: str, mig_parted: bool, migpilot: bool) -> None:
    assert migpilot == mig_parted or (mig_parted and not migpilot)  # only ever stricter
    if migpilot:
        migparted.parse(text, source="mig.yaml")
    else:
        parse_error(text)


ENTRY_CASES = {
    # name: (entry, mig-parted accepts, migpilot accepts)
    "well formed": ("{devices: all, mig-enabled: true, mig-devices: {1g.5gb: 2}}", True, True),
    "with a filter": (
        "{device-filter: '0x20B010DE', devices: all, mig-enabled: true, mig-devices: {1g.5gb: 2}}",
        True,
        True,
    ),
    "with several filters": (
        "{device-filter: ['0x20B010DE', '0x20B110DE'], devices: all, mig-enabled: true, "
        "mig-devices: {1g.5gb: 2}}",
        True,
        True,
    ),
    "missing devices": ("{mig-enabled: true, mig-devices: {1g.5gb: 2}}", False, False),
    "missing mig-enabled": ("{devices: all, mig-devices: {1g.5gb: 2}}", False, False),
    "disabled without mig-devices": ("{devices: all, mig-enabled: false}", True, True),
    "enabled without mig-devices": ("{devices: all, mig-enabled: true}", False, False),
    "a malformed profile": (
        "{devices: all, mig-enabled: true, mig-devices: {bogus: 2}}",
        False,
        False,
    ),
    "an unexpected field": ("{bogus: field, devices: all, mig-enabled: false}", False, False),
    "devices a string other than all": ("{devices: bogus, mig-enabled: false}", False, False),
    "devices a list": ("{devices: [0, 1, 2, 3], mig-enabled: false}", True, True),
    "devices a mapping": ("{devices: {}, mig-enabled: false}", False, False),
    # Stricter: mig-parted reads a model name as a filter, then never matches it to a GPU.
    "a model name as filter": (
        "{device-filter: A100-SXM4-40GB, devices: all, mig-enabled: false}",
        True,
        False,
    ),
    "model names as filters": (
        "{device-filter: [A100-SXM4-40GB, A100-PCIE-40GB], devices: all, mig-enabled: false}",
        True,
        False,
    ),
    # Stricter: an id with a second ':' fails mig-parted's reading and then matches nothing.
    "a filter with an extra separator": (
        "{device-filter: '0x233010DE:0x16C010DE:extra', devices: all, mig-enabled: false}",
        True,
        False,
    ),
}


@pytest.mark.parametrize(
    ("entry", "mig_parted", "migpilot"), ENTRY_CASES.values(), ids=ENTRY_CASES.keys()
)
def test_mig_parted_entry_cases(entry: str, mig_parted: bool, migpilot: bool) -> None:
    assert migpilot == mig_parted or (mig_parted and not migpilot)  # only ever stricter
    text = one_config(f"- {entry}")
    if migpilot:
        migparted.parse(text, source="mig.yaml")
    else:
        parse_error(text)


def test_an_extra_separator_is_rejected_not_read_as_the_device_alone() -> None:
    message = parse_error(
        one_config(
            "- {device-filter: '0x233010DE:0x16C010DE:extra', devices: all, mig-enabled: false}"
        )
    )
    assert message == (
        "mig.yaml: config 'custom' entry 0: device-filter '0x233010DE:0x16C010DE:extra' is not "
        "a PCI device id such as 0x20B010DE or 0x233010DE:0x16C110DE: expected DEVICE or "
        "DEVICE:SUBSYSTEM, with one ':' at most"
    )


def test_a_filter_with_spaces_is_rejected_as_mig_parted_never_matches_it() -> None:
    message = parse_error(
        one_config("- {device-filter: ' 0x233010DE', devices: all, mig-enabled: false}")
    )
    assert "device-filter ' 0x233010DE' is not a PCI device id" in message


FILTER_CASES = {
    # name: (device-filter, whether it selects the H100 on board 0x16C010DE)
    "an empty filter matches every GPU": ("''", True),
    "a device-only filter matches every board": ("'0x233010DE'", True),
    "a lower-case filter is the same id": ("'0x233010de:0x16c010de'", True),
    "the GPU's own board matches": ("'0x233010DE:0x16C010DE'", True),
    "a sibling board does not match": ("'0x233010DE:0x16C110DE'", False),
    "one matching id among several is enough": (
        "['0x233010DE:0x16C110DE', '0x233010DE:0x16C010DE']",
        True,
    ),
    "another device does not match": ("'0x233110DE'", False),
}


@pytest.mark.parametrize(
    ("device_filter", "selects"), FILTER_CASES.values(), ids=FILTER_CASES.keys()
)
def test_mig_parted_filter_cases(device_filter: str, selects: bool) -> None:
    config = parse(
        one_config(
            f"""
            - {{devices: all, mig-enabled: false}}
            - {{device-filter: {device_filter}, devices: all, mig-enabled: true,
               mig-devices: {{"7g.80gb": 1}}}}
            """
        )
    )
    entries = config.configs["custom"]
    gpu = pci(H100_SXM, H100_BOARD)
    assert migparted.entry_for(entries, pci_ids=(gpu,), index=0) == (1 if selects else 0)


BOARD_CONFIG = one_config(
    """
    - {devices: all, mig-enabled: false}
    - {device-filter: '0x233010DE:0x16C110DE', devices: all, mig-enabled: true,
       mig-devices: {"7g.80gb": 1}}
    """
)


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        (pci(H100_SXM, H100_SIBLING), ["7g.80gb@0"]),
        (pci(H100_SXM, H100_BOARD), ["disabled"]),  # a sibling board
        (pci(H100_SXM, 0), ["disabled"]),  # a board nothing is known about
        (pci(H100_SXM), ["disabled"]),  # the device id alone names no board
    ],
    ids=str,
)
def test_an_entry_for_one_board_is_not_applied_to_another(
    gpu: pciids.PciId, expected: list[str]
) -> None:
    config = parse(BOARD_CONFIG)
    gpus = migparted.layout_for(config, "custom", model=model("h100-80gb"), gpus=1, pci_id=gpu)
    assert layout_texts(gpus) == expected


def test_a_model_without_a_board_gets_no_board_entry_and_a_hint() -> None:
    config = parse(
        one_config(
            """
            - {device-filter: '0x233010DE:0x16C110DE', devices: all, mig-enabled: false}
            """
        )
    )
    with pytest.raises(errors.ConfigError) as info:
        migparted.layout_for(config, "custom", model=model("h100-80gb"), gpus=1)
    message = str(info.value)
    assert "no entry matches GPU 0 (h100-80gb)" in message
    assert "entries name boards such as 0x233010DE:0x16C110DE" in message
    with pytest.raises(errors.ConfigError, match=r"\(h100-80gb, 0x233010DE:0x16C010DE\)"):
        migparted.layout_for(
            config, "custom", model=model("h100-80gb"), gpus=1, pci_id=pci(H100_SXM, H100_BOARD)
        )


# Profile names: mig-parted checks only their format. Well-formed names parse; whether a GPU
# offers them is check()'s question (exit 1 from `config validate`), not a format error.
WELL_FORMED = [
    "1g.5gb",
    "1c.1g.5gb",
    "1g.5gb+me",
    "1c.1g.5gb+me",
    "0g.0gb",
    "0c.0g.0gb",
    "10000g.500000gb",
    "10000c.10000g.500000gb",
    "1g.5gb+me,you,them",
    "1c.1g.5gb+me,you,them",
    "1g.10gb+warp",
    "1g.24gb-me,gfx",
    "01g.05gb",
]
MALFORMED = [
    "",
    " 1c.1g.5gb",
    "1 c.1g.5gb",
    "1c .1g.5gb",
    "1c. 1g.5gb",
    "1c.1 g.5gb",
    "1c.1g .5gb",
    "1c.1g. 5gb",
    "1c.1g.5 gb",
    "1c.1g.5g b",
    "1c.1g.5gb ",
    "1c . 1g . 5gb",
    "1c.f1g.5gb",
    "1r.1g.5gb",
    "1g.5gbk",
    "1g.5",
    "g.5gb",
    "1g.gb",
    "1g.5gb+me,me",
    "1g.5gb+",
    "1g.5gb+ ",
    "1g.5gb+,",
    "1g.5gb+me,",
    "1g.5gb+me, ",
    "1g.5gb+2me",
    "1g.5gb+.me",
    "1g.5gb+me.",
    "1g.5gb*me",
    "1c.1g.5gb*me",
    "1g.5gb*me,you,them",
    "1g.5gb+me-you",
    "bogus",
]


@pytest.mark.parametrize("name", WELL_FORMED)
def test_names_mig_parted_calls_well_formed_parse(name: str) -> None:
    assert migparted.format_problem(name) is None
    config = parse(
        one_config(f"- devices: all\n  mig-enabled: true\n  mig-devices: {{'{name}': 1}}")
    )
    assert config.configs["custom"][0].mig_devices == ((name, 1),)


@pytest.mark.parametrize("name", MALFORMED)
def test_names_mig_parted_calls_malformed_are_format_errors(name: str) -> None:
    assert migparted.format_problem(name) is not None
    message = parse_error(
        one_config(f"- devices: all\n  mig-enabled: true\n  mig-devices: {{'{name}': 1}}")
    )
    assert f"mig-devices: invalid format for {name!r}: " in message


@pytest.mark.parametrize(
    "name",
    [
        "0g.0gb",
        "0c.0g.0gb",
        "10000g.500000gb",
        "1g.5gb+me,you,them",
        "1g.10gb+warp",
        "1g.24gb-me,gfx",
    ],
)
def test_well_formed_names_no_gpu_offers_are_reported_by_check(name: str) -> None:
    config = parse(
        one_config(f"- devices: all\n  mig-enabled: true\n  mig-devices: {{'{name}': 1}}")
    )
    assert migparted.check(config) == [
        f"mig.yaml: config 'custom' entry 0: no known GPU offers {name}"
    ]


def test_a_well_formed_name_the_filtered_gpu_lacks_is_reported_for_that_gpu() -> None:
    config = parse(
        one_config(
            "- device-filter: '0x233010DE'\n  devices: all\n  mig-enabled: true\n"
            "  mig-devices: {'0g.0gb': 100}"
        )
    )
    (problem,) = migparted.check(config)
    assert problem.startswith("mig.yaml: config 'custom' entry 0: h100-80gb: h100-80gb has no MIG")
    assert "'0g.0gb' (offered: 1g.10gb," in problem
    with pytest.raises(errors.ConfigError, match="entry 0 cannot be placed on h100-80gb"):
        migparted.layout_for(config, "custom", model=model("h100-80gb"), gpus=1)


def test_mig_parted_round_trip_file_parses_and_check_names_the_unoffered_profile() -> None:
    # TestMarshallUnmarshall's configs, with the model-name filters (which migpilot refuses)
    # replaced by the A100-40GB's PCI ids.
    config = parse(
        """
        version: v1
        mig-configs:
          valid-format-non-existent-devices:
            - {devices: all, mig-enabled: true, mig-devices: {"0g.0gb": 100}}
          all-disabled:
            - {device-filter: "0x20B010DE", devices: all, mig-enabled: false}
          all-1-slice:
            - {device-filter: "0x20B010DE", devices: all, mig-enabled: true,
               mig-devices: {"1g.5gb": 7}}
          all-balanced-slices:
            - {device-filter: "0x20B010DE", devices: all, mig-enabled: true,
               mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}
          half-disabled-half-balanced-slices:
            - {device-filter: "0x20B010DE", devices: [0, 1, 2, 3], mig-enabled: false}
            - {device-filter: "0x20B010DE", devices: [4, 5, 6, 7], mig-enabled: true,
               mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}
          multi-device-filter:
            - {device-filter: ["0x20B010DE", "0x20B110DE"], devices: [0, 1, 2, 3],
               mig-enabled: false}
            - {device-filter: ["0x20B010DE", "0x20B110DE"], devices: [4, 5, 6, 7],
               mig-enabled: true, mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}}
        """
    )
    assert migparted.check(config) == [
        "mig.yaml: config 'valid-format-non-existent-devices' entry 0: no known GPU offers 0g.0gb"
    ]
    half = migparted.layout_for(
        config,
        "half-disabled-half-balanced-slices",
        model=model("a100-40gb"),
        gpus=8,
        pci_id=pci(A100_40GB_SXM, 0x145F10DE),
    )
    assert [g.mig_enabled for g in half] == [False] * 4 + [True] * 4


def test_an_alias_bomb_in_a_mig_parted_config_is_a_short_message() -> None:
    # The anchors are defined where they are first used (the config's fields are strict):
    # nine levels of nine references, ~10**9 items in a plain repr.
    bomb = "&l0 [" + ", ".join(["lol"] * 9) + "]"
    for i in range(1, 10):
        bomb = f"&l{i} [{bomb}, " + ", ".join([f"*l{i - 1}"] * 8) + "]"
    text = "\n".join(
        [
            "version: v1",
            "mig-configs:",
            "  bomb:",
            f"    - devices: {bomb}",
            "      mig-enabled: true",
            "      mig-devices: {}",
        ]
    )
    with pytest.raises(errors.ConfigError) as got:
        migparted.parse(text, source="bomb.yaml")
    assert "is not a GPU index" in str(got.value)
    assert len(str(got.value)) < 600, len(str(got.value))
