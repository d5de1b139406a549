"""Profile-name parsing and tolerant resolution; GPU alias resolution."""

from __future__ import annotations

import pytest

from migpilot import errors
from migpilot.mig import catalog, profiles


class TestParse:
    @pytest.mark.parametrize(
        ("text", "g", "gb", "attr"),
        [
            ("1g.10gb", 1, 10, ""),
            ("1g.10gb+me", 1, 10, "+me"),
            ("1g.10gb.me", 1, 10, "+me"),
            ("nvidia.com/mig-1g.10gb.me", 1, 10, "+me"),
            ("mig-3g.40gb", 3, 40, ""),
            ("1g.24gb+me.all", 1, 24, "+me.all"),
            ("1g.24gb-me", 1, 24, "-me"),
            ("2g.48gb+gfx", 2, 48, "+gfx"),
            (" 7G.80GB ", 7, 80, ""),
        ],
    )
    def test_accepted_spellings(self, text: str, g: int, gb: int, attr: str) -> None:
        parsed = profiles.parse_profile_name(text)
        assert (parsed.g, parsed.gb, parsed.attribute.value) == (g, gb, attr)

    @pytest.mark.parametrize("text", ["", "1g", "1g.10", "g.10gb", "1g.10gb+xx", "0g.5gb", "abc"])
    def test_rejected_with_a_clear_message(self, text: str) -> None:
        with pytest.raises(errors.UnknownProfileError, match="not a MIG profile name"):
            profiles.parse_profile_name(text)

    def test_compute_instance_profile_parses(self) -> None:
        assert profiles.parse_profile_name("1c.3g.20gb").compute == 1


class TestResolve:
    @pytest.mark.parametrize(
        ("gpu", "text", "expected"),
        [
            ("a100-80gb", "3g.39gb", "3g.40gb"),  # drivers 535/545 (mig-parted #31)
            ("a100-80gb", "7g.79gb", "7g.80gb"),  # the nos typo that stranded pods
            ("a100-80gb", "1g.10gb", "1g.10gb"),
            ("a100-80gb", "1g.20gb", "1g.20gb"),
            ("gb200-186gb", "1g.24gb", "1g.23gb"),  # pre-production GB200 name
            ("gb200-186gb", "7g.189gb", "7g.186gb"),
            ("h100-80gb", "nvidia.com/mig-1g.10gb.me", "1g.10gb+me"),
            ("h100-80gb", "3g.40gb", "3g.40gb"),
            ("h200-141gb", "1g.35gb", "1g.35gb"),
        ],
    )
    def test_names_resolve_by_shape(self, gpu: str, text: str, expected: str) -> None:
        assert catalog.resolve_gpu(gpu).resolve_profile(text).name == expected

    def test_resolution_never_crosses_attributes(self) -> None:
        m = catalog.resolve_gpu("h100-80gb")
        assert m.resolve_profile("1g.10gb").attribute is profiles.Attribute.NONE
        assert m.resolve_profile("1g.10gb+me").attribute is profiles.Attribute.ME

    @pytest.mark.parametrize("text", ["1g.15gb", "5g.40gb", "2g.10gb+me", "7g.40gb"])
    def test_far_names_are_unknown(self, text: str) -> None:
        with pytest.raises(errors.UnknownProfileError, match="no MIG profile matching"):
            catalog.resolve_gpu("a100-80gb").resolve_profile(text)

    def test_compute_instance_profiles_are_refused_with_advice(self) -> None:
        with pytest.raises(errors.UnknownProfileError, match=r"use 3g\.40gb"):
            catalog.resolve_gpu("a100-80gb").resolve_profile("1c.3g.40gb")

    def test_resource_name(self) -> None:
        p = catalog.resolve_gpu("h100-80gb").profile_named("1g.10gb+me")
        assert p.resource_name == "mig-1g.10gb.me"


class TestGpuAliases:
    @pytest.mark.parametrize(
        ("text", "expected"),
        [
            ("a100-40gb", "a100-40gb"),
            ("A100-SXM4-40GB", "a100-40gb"),
            ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
            ("NVIDIA-A100-SXM4-40GB", "a100-40gb"),
            ("NVIDIA-A100-SXM4-40GB-MIG-3g.20gb", "a100-40gb"),
            ("NVIDIA-A100-SXM4-40GB-MIG-INVALID", "a100-40gb"),
            ("NVIDIA H100 80GB HBM3", "h100-80gb"),
            ("NVIDIA-H100-80GB-HBM3", "h100-80gb"),
            ("nvidia_h100_80gb_hbm3", "h100-80gb"),
            ("0x20B010DE", "a100-40gb"),
            ("0x233010de", "h100-80gb"),
            ("a30", "a30-24gb"),
            ("h200", "h200-141gb"),
        ],
    )
    def test_resolves(self, text: str, expected: str) -> None:
        assert catalog.resolve_gpu(text).id == expected

    def test_ambiguous_short_name(self) -> None:
        with pytest.raises(errors.UnknownGpuError, match="ambiguous: a100-40gb, a100-80gb"):
            catalog.resolve_gpu("a100")

    @pytest.mark.parametrize("text", ["v100", "", "0x1DB410DE", "nvidia"])
    def test_unknown(self, text: str) -> None:
        with pytest.raises(errors.UnknownGpuError):
            catalog.resolve_gpu(text)

    def test_every_product_name_and_gfd_form_resolves_to_its_model(self) -> None:
        for m in catalog.gpu_models():
            assert m.product_names, m.id
            for name in (*m.product_names, *m.gfd_product_names, m.id, *m.aliases):
                assert catalog.resolve_gpu(name) is m, name
            for dev in m.pci_device_ids:
                assert catalog.resolve_gpu(f"0x{dev:08X}") is m

    def test_gfd_sanitised_form(self) -> None:
        assert catalog.resolve_gpu("h100-80gb").gfd_product_names[0] == "NVIDIA-H100-80GB-HBM3"


class TestCatalogChecks:
    def test_bad_catalog_data_is_caught(self) -> None:
        bad = """
version: 1
mig_mode_change_needs_reset: {t: true, test: false}
gpus:
  - id: x
    products: [X]
    family: t
    compute_capability: "1.0"
    memory_slots: 2
    compute_slices: 2
    max_gpu_instances: 2
    profiles:
      - {name: 1g.1gb, nvml: 1_SLICE, memory_slots: 1, compute_slices: 1, max: 2,
         placements: [0, 1, 2]}
"""
        with pytest.raises(errors.CatalogError, match="runs past the GPU's memory"):
            catalog.load_catalog_text(bad)

    def test_duplicate_shapes_are_refused(self) -> None:
        bad = """
version: 1
mig_mode_change_needs_reset: {t: true, test: false}
gpus:
  - id: x
    products: [X]
    family: t
    compute_capability: "1.0"
    memory_slots: 2
    compute_slices: 2
    max_gpu_instances: 2
    profiles:
      - {name: 1g.1gb, nvml: 1_SLICE, memory_slots: 1, compute_slices: 1, max: 2, placements: [0]}
      - {name: 1g.2gb, nvml: 1_SLICE, memory_slots: 1, compute_slices: 1, max: 2, placements: [1]}
"""
        with pytest.raises(errors.CatalogError, match="share a hardware shape"):
            catalog.load_catalog_text(bad)


class TestModeChangeNeedsReset:
    def test_ampere_needs_a_reset_and_hopper_on_do_not(self) -> None:
        # MIG user guide: A100/A30 need a GPU reset; Hopper and later do not.
        by_family = {m.family: m.mode_change_needs_reset for m in catalog.gpu_models()}
        assert by_family == {"ampere": True, "hopper": False, "blackwell": False}
        assert catalog.resolve_gpu("a100-80gb").mode_change_needs_reset
        assert not catalog.resolve_gpu("h200-141gb").mode_change_needs_reset

    def test_a_family_the_table_does_not_name_is_an_error(self) -> None:
        bad = """
version: 1
mig_mode_change_needs_reset: {ampere: true}
gpus:
  - id: x
    products: [X]
    family: volta
    compute_capability: "1.0"
    memory_slots: 1
    compute_slices: 1
    max_gpu_instances: 1
    profiles:
      - {name: 1g.1gb, nvml: 1_SLICE, memory_slots: 1, compute_slices: 1, max: 1, placements: [0]}
"""
        with pytest.raises(errors.CatalogError, match="family 'volta'"):
            catalog.load_catalog_text(bad)
