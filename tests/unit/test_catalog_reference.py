"""The shipped GPU catalog checked against the sourced reference facts.

``shared/reference/mig_profiles.yaml`` (beside the repository root) lists, for every MIG-capable
GPU, the values public sources give, and marks the rest null or UNCONFIRMED. Each value it gives
must be the catalog's value; each value it does not give must be empty in the catalog or listed in
the profile's ``inferred`` field. ``mig-parted-config-default.yaml`` beside it supplies the PCI
device-id groups and profile names NVIDIA's mig-parted ships, which the catalog must all know.

Where the project measured a value on real hardware itself (``bench/results/nvml-*.json``, see
``test_catalog_hardware.py``), the measurement wins: the catalog holds what the driver reported
(memory per profile varies with the driver version) and the reference value is not required.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from migpilot import errors
from migpilot.mig import catalog, profiles

REFERENCE_DIR = Path(__file__).resolve().parents[3] / "shared" / "reference"
PROFILES_FILE = REFERENCE_DIR / "mig_profiles.yaml"
MIG_PARTED_FILE = REFERENCE_DIR / "mig-parted-config-default.yaml"

if not PROFILES_FILE.is_file():
    pytest.skip(
        f"reference facts {PROFILES_FILE} not found (the shared/ folder beside the repository "
        "root is absent in this checkout)",
        allow_module_level=True,
    )

REFERENCE: dict[str, Any] = yaml.safe_load(PROFILES_FILE.read_text())
MIG_PARTED: dict[str, Any] | None = (
    yaml.safe_load(MIG_PARTED_FILE.read_text()) if MIG_PARTED_FILE.is_file() else None
)

# Reference GPU key -> catalog GPU id.
GPU_IDS: dict[str, str] = {
    "a30_24gb": "a30-24gb",
    "a100_40gb": "a100-40gb",
    "a100_80gb": "a100-80gb",
    "h100_80gb": "h100-80gb",
    "h100_nvl_94gb": "h100-nvl-94gb",
    "h100_96gb_gh200": "h100-96gb",
    "h200_141gb": "h200-141gb",
    "gh200_144gb": "gh200-144gb",
    "b200_180gb": "b200-180gb",
    "gb200": "gb200-186gb",
    "b300": "b300-288gb",
    "gb300": "gb300-288gb",
    "rtx_pro_6000_blackwell_96gb": "rtx-pro-6000-blackwell-96gb",
}

# (catalog GPU id, profile, catalog field) measured on real hardware by this project: the catalog
# follows the measurement (checked in test_catalog_hardware.py), not the reference.
MEASURED: set[tuple[str, str, str]] = {
    (catalog.resolve_gpu(gpu["name"]).id, row["name"].removeprefix("MIG "), key)
    for path in (Path(__file__).resolve().parents[2] / "bench" / "results").glob("nvml-*.json")
    for gpu in json.loads(path.read_text())["gpus"]
    for row in gpu["profiles"]
    if "error" not in row
    for key in ("memory_mib", "placements")
}

# Reference GPUs the catalog leaves out on purpose.
NOT_CATALOGUED: dict[str, str] = {
    # Documentation tables only: no smi ids, MiB, SMs or placements anywhere.
    "rtx_pro_5000_blackwell_48gb": "doc table only",
    "rtx_pro_4500_blackwell_32gb": "doc table only",
}

# (catalog GPU id, profile, catalog field) the reference gives but marks UNCONFIRMED. The
# catalog need not equal these, but must list the field in the profile's `inferred`.
_A100_80GB_PLACEMENTS = (
    # "Placements for A100-80GB: no -lgipp captured -> UNCONFIRMED (listed values = A100-40GB/H100
    # grid)", and the 1g.10gb+me/1g.20gb/2g.20gb rows repeat it in trailing comments.
    "no -lgipp captured on A100-80GB; the listed values are the A100-40GB/H100 grid"
)
UNCONFIRMED: dict[tuple[str, str, str], str] = {
    ("a100-80gb", name, "placements"): _A100_80GB_PLACEMENTS
    for name in ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
}

# (catalog GPU id, GPU-level field) the reference marks UNCONFIRMED: a note must mention them.
UNCONFIRMED_GPU: dict[tuple[str, str], str] = {
    # "max_gpu_instances: 7  # UNCONFIRMED for this SKU (not in DOC_SUPPORTED_GPUS table)"
    ("gh200-144gb", "max_gpu_instances"): "not in NVIDIA's supported-GPUs table",
}

# nvidia_all_balanced names that do not resolve to one catalog GPU on their own.
BALANCED_NAMES: dict[str, str] = {
    # mig-parted's "GH200" group is the 96GB GH200; the 144G part is also a GH200.
    "GH200": "h100-96gb",
}

_PLACEMENTS = re.compile(r"^\{(?P<starts>[\d,\s]*)\}:(?P<size>\d+)$")
_PCI = re.compile(r"^\s*(0x[0-9A-Fa-f]{8})\b")


def _placements(text: str) -> tuple[tuple[int, ...], int]:
    """``{0,2,4}:2`` -> ((0, 2, 4), 2)."""
    m = _PLACEMENTS.match(text.strip())
    assert m is not None, f"reference placement {text!r} is not in -lgipp form"
    starts = tuple(sorted(int(s) for s in m["starts"].split(",") if s.strip()))
    return starts, int(m["size"])


@dataclass(frozen=True)
class Field:
    """One profile field: its catalog key, the reference keys that give it, how to read both."""

    key: str
    """The catalog file's key, as ``inferred`` names it."""
    ref_keys: tuple[str, ...]
    """Reference keys in order of preference; the first non-null one is the reference value."""
    get: Callable[[profiles.Profile], object]
    parse: Callable[[Any], object] = lambda v: v
    never_inferred: bool = False
    """Fields the catalog must leave empty when no source gives them."""

    def reference_value(self, row: Mapping[str, Any]) -> object:
        for k in self.ref_keys:
            if row.get(k) is not None:
                return self.parse(row[k])
        return None


FIELDS: tuple[Field, ...] = (
    Field("nvml", ("nvml_index",), lambda p: p.nvml_profile),
    Field("smi_id", ("smi_id",), lambda p: p.smi_id),
    # mem_mib is derived from the first/lowest -lgip GiB value; mem_mib_observed only where the
    # reference has no mem_mib.
    Field("memory_mib", ("mem_mib", "mem_mib_observed"), lambda p: p.memory_mib),
    Field("memory_slots", ("mem_slots",), lambda p: p.memory_slots),
    Field("compute_slices", ("g",), lambda p: p.compute_slices),
    Field("sms", ("sm",), lambda p: p.sms, never_inferred=True),
    Field("max", ("max_instances",), lambda p: p.max_instances),
    # ce_doc/ofa_doc: NVIDIA's profile table, given where no -lgip row exists (B200 3g/4g/7g).
    Field("ce", ("ce", "ce_doc"), lambda p: p.engines.copy, never_inferred=True),
    Field("dec", ("dec",), lambda p: p.engines.decoder, never_inferred=True),
    Field("enc", ("enc",), lambda p: p.engines.encoder, never_inferred=True),
    Field("jpeg", ("jpeg",), lambda p: p.engines.jpeg, never_inferred=True),
    Field("ofa", ("ofa", "ofa_doc"), lambda p: p.engines.ofa, never_inferred=True),
    Field(
        "placements",
        ("placements",),
        lambda p: (p.placements, p.memory_slots),
        parse=_placements,
    ),
)
FIELD_KEYS = frozenset(f.key for f in FIELDS)


def _reference_gpus() -> Iterator[tuple[str, dict[str, Any]]]:
    for gpu in REFERENCE["gpus"]:
        if gpu["key"] in GPU_IDS:
            yield GPU_IDS[gpu["key"]], gpu


def _reference_rows() -> Iterator[tuple[str, dict[str, Any]]]:
    for gpu_id, gpu in _reference_gpus():
        for row in gpu.get("profiles", ()):
            yield gpu_id, row


def _model(gpu_id: str) -> profiles.GpuModel:
    model = catalog.resolve_gpu(gpu_id)
    assert model.id == gpu_id
    return model


def _lookup(model: profiles.GpuModel, name: str) -> profiles.Profile:
    """The profile with this canonical name or alias (no memory tolerance)."""
    try:
        return model.profile_named(name)
    except errors.UnknownProfileError:
        for p in model.profiles:
            if name in p.aliases:
                return p
        raise


def _pci(text: str) -> int:
    m = _PCI.match(text)
    assert m is not None, f"{text!r} does not start with a 32-bit PCI device id"
    return int(m[1], 16)


# ------------------------------------------------------------------------------- parameters


def _field_params() -> Iterator[Any]:
    for gpu_id, row in _reference_rows():
        for field in FIELDS:
            expected = field.reference_value(row)
            if expected is None or (gpu_id, row["name"], field.key) in UNCONFIRMED:
                continue
            yield pytest.param(
                gpu_id, row["name"], field, expected, id=f"{gpu_id}/{row['name']}/{field.key}"
            )


def _missing_params() -> Iterator[Any]:
    for gpu_id, row in _reference_rows():
        for field in FIELDS:
            if field.reference_value(row) is None:
                yield pytest.param(
                    gpu_id, row["name"], field, id=f"{gpu_id}/{row['name']}/{field.key}"
                )


def _profile_params() -> Iterator[Any]:
    for gpu_id, row in _reference_rows():
        yield pytest.param(gpu_id, row, id=f"{gpu_id}/{row['name']}")


def _gpu_field_params() -> Iterator[Any]:
    for gpu_id, gpu in _reference_gpus():
        for key in ("memory_slots", "compute_slices", "max_gpu_instances"):
            if gpu.get(key) is not None:
                yield pytest.param(gpu_id, key, gpu[key], id=f"{gpu_id}/{key}")


def _gpu_pci_params() -> Iterator[Any]:
    for gpu_id, gpu in _reference_gpus():
        for text in gpu.get("pci_device_ids", ()):
            yield pytest.param(gpu_id, text, id=f"{gpu_id}/{text.split()[0]}")


def _filters(entry: Mapping[str, Any]) -> list[str]:
    raw = entry.get("device-filter")
    if raw is None:
        return []
    return [raw] if isinstance(raw, str) else [str(x) for x in raw]


_NO_MIG_PARTED = pytest.param(
    None,
    None,
    None,
    marks=pytest.mark.skip(reason=f"mig-parted default config {MIG_PARTED_FILE} not found"),
    id="mig-parted-config-absent",
)


def _mig_parted_entries() -> Iterator[tuple[str, Mapping[str, Any]]]:
    assert MIG_PARTED is not None
    for config_name, entries in MIG_PARTED["mig-configs"].items():
        for entry in entries:
            yield config_name, entry


def _pci_filter_params() -> Iterator[Any]:
    if MIG_PARTED is None:
        yield _NO_MIG_PARTED
        return
    seen: set[str] = set()
    for config_name, entry in _mig_parted_entries():
        for dev in _filters(entry):
            if dev.upper() not in seen:
                seen.add(dev.upper())
                yield pytest.param(config_name, dev, None, id=dev)


def _filtered_profile_params() -> Iterator[Any]:
    if MIG_PARTED is None:
        yield _NO_MIG_PARTED
        return
    for config_name, entry in _mig_parted_entries():
        for dev in _filters(entry):
            for name, count in (entry.get("mig-devices") or {}).items():
                yield pytest.param(dev, name, count, id=f"{config_name}/{dev}/{name}")


def _mig_parted_name_params() -> Iterator[Any]:
    if MIG_PARTED is None:
        yield _NO_MIG_PARTED
        return
    names: dict[str, str] = {}
    for config_name, entry in _mig_parted_entries():
        for name in entry.get("mig-devices") or {}:
            names.setdefault(name, config_name)
    for name, config_name in names.items():
        yield pytest.param(config_name, name, None, id=name)


def _balanced_gpu_params() -> Iterator[Any]:
    for key, mix in REFERENCE["supported_configurations"]["nvidia_all_balanced"].items():
        for gpu_name in key.split("/"):
            yield pytest.param(key, gpu_name.strip(), mix, id=f"{key}:{gpu_name.strip()}")


def _balanced_profile_params() -> Iterator[Any]:
    for key, mix in REFERENCE["supported_configurations"]["nvidia_all_balanced"].items():
        for gpu_name in key.split("/"):
            for name, count in mix.items():
                yield pytest.param(
                    gpu_name.strip(), name, count, id=f"{key}:{gpu_name.strip()}/{name}"
                )


def _balanced_model(gpu_name: str) -> profiles.GpuModel:
    return catalog.resolve_gpu(BALANCED_NAMES.get(gpu_name, gpu_name))


# ------------------------------------------------------------------------------------ tests


def test_every_reference_gpu_is_mapped() -> None:
    keys = [gpu["key"] for gpu in REFERENCE["gpus"]]
    unknown = [k for k in keys if k not in GPU_IDS and k not in NOT_CATALOGUED]
    assert not unknown, (
        f"reference GPUs neither in the catalog map nor left out on purpose: {unknown}"
    )
    for gpu in REFERENCE["gpus"]:
        if gpu["key"] in NOT_CATALOGUED:
            assert not gpu.get("profiles"), f"{gpu['key']} now has -lgip rows; catalogue it"
    assert sorted(GPU_IDS.values()) == sorted(m.id for m in catalog.gpu_models())


@pytest.mark.parametrize(("gpu_id", "profile", "field", "expected"), list(_field_params()))
def test_reference_value_matches_catalog(
    gpu_id: str, profile: str, field: Field, expected: object
) -> None:
    p = _lookup(_model(gpu_id), profile)
    assert field.key not in p.inferred, f"{gpu_id} {profile} {field.key} is sourced, not inferred"
    if (gpu_id, p.name, field.key) in MEASURED:
        return  # the project's own hardware record decides (test_catalog_hardware.py)
    assert field.get(p) == expected, f"{gpu_id} {profile} {field.key}"


@pytest.mark.parametrize(("gpu_id", "profile", "field"), list(_missing_params()))
def test_unsourced_value_is_empty_or_inferred(gpu_id: str, profile: str, field: Field) -> None:
    p = _lookup(_model(gpu_id), profile)
    value = field.get(p)
    if (gpu_id, p.name, field.key) in MEASURED:
        assert value is not None and field.key not in p.inferred  # measured: a sourced value
        return
    if field.never_inferred:
        assert value is None, f"{gpu_id} {profile} {field.key}: no source gives it, yet {value!r}"
        assert field.key not in p.inferred
    else:
        assert value is None or field.key in p.inferred, (
            f"{gpu_id} {profile} {field.key}: no source gives it; mark it inferred"
        )


@pytest.mark.parametrize(
    ("gpu_id", "profile", "field"), [pytest.param(*k, id="/".join(k)) for k in sorted(UNCONFIRMED)]
)
def test_unconfirmed_value_is_marked_inferred(gpu_id: str, profile: str, field: str) -> None:
    row = next(r for g, r in _reference_rows() if g == gpu_id and r["name"] == profile)
    spec = next(f for f in FIELDS if f.key == field)
    assert spec.reference_value(row) is not None, "stale UNCONFIRMED entry: the reference is null"
    assert field in _lookup(_model(gpu_id), profile).inferred, UNCONFIRMED[gpu_id, profile, field]


@pytest.mark.parametrize(("gpu_id", "row"), list(_profile_params()))
def test_reference_profile_exists(gpu_id: str, row: dict[str, Any]) -> None:
    model = _model(gpu_id)
    p = _lookup(model, row["name"])
    assert model.resolve_profile(row["name"]) is p
    inferred_ok = {f.key for f in FIELDS if f.reference_value(row) is None}
    inferred_ok |= {f for (g, n, f) in UNCONFIRMED if (g, n) == (gpu_id, row["name"])}
    assert p.inferred <= FIELD_KEYS, f"unknown inferred keys {sorted(p.inferred - FIELD_KEYS)}"
    assert p.inferred <= inferred_ok, (
        f"{gpu_id} {row['name']} marks sourced fields inferred: {sorted(p.inferred - inferred_ok)}"
    )


@pytest.mark.parametrize(
    ("gpu_id", "row"), [p for p in _profile_params() if p.values[1].get("mem_gib_lgip")]
)
def test_memory_matches_lgip_gib(gpu_id: str, row: dict[str, Any]) -> None:
    gib = row["mem_gib_lgip"]
    p = _lookup(_model(gpu_id), row["name"])
    mib = p.memory_mib
    assert mib is not None
    if (gpu_id, p.name, "memory_mib") in MEASURED:
        # Another driver's -lgip: the record's value may differ, but only by driver rounding.
        assert min(abs(mib - g * 1024) for g in gib) <= 512, f"{mib} MiB is far from {gib} GiB"
        return
    assert min(abs(mib - g * 1024) for g in gib) <= 64, f"{mib} MiB is none of {gib} GiB"


@pytest.mark.parametrize("gpu_id", sorted(GPU_IDS.values()))
def test_catalog_has_no_profile_the_reference_lacks(gpu_id: str) -> None:
    (gpu,) = (g for i, g in _reference_gpus() if i == gpu_id)
    listed = [row["name"] for row in gpu["profiles"]]
    assert sorted(p.name for p in _model(gpu_id).profiles) == sorted(listed)


@pytest.mark.parametrize(("gpu_id", "field", "expected"), list(_gpu_field_params()))
def test_gpu_value_matches_catalog(gpu_id: str, field: str, expected: int) -> None:
    model = _model(gpu_id)
    assert getattr(model, field) == expected, f"{gpu_id} {field}"
    if (gpu_id, field) in UNCONFIRMED_GPU:
        assert any(field in note for note in model.notes), (
            f"{gpu_id} {field} is unconfirmed ({UNCONFIRMED_GPU[gpu_id, field]}); say so in notes"
        )


@pytest.mark.parametrize(("gpu_id", "text"), list(_gpu_pci_params()))
def test_reference_pci_id_names_gpu(gpu_id: str, text: str) -> None:
    assert catalog.default().by_pci_device_id(_pci(text)) is _model(gpu_id)


@pytest.mark.parametrize(("config", "dev", "unused"), list(_pci_filter_params()))
def test_mig_parted_pci_id_resolves(config: str, dev: str, unused: None) -> None:
    model = catalog.default().by_pci_device_id(_pci(dev))
    assert model is not None, f"{dev} (mig-parted {config}) names no catalog GPU"
    assert catalog.resolve_gpu(dev) is model


@pytest.mark.parametrize(("dev", "name", "count"), list(_filtered_profile_params()))
def test_mig_parted_profile_fits_filtered_gpu(dev: str, name: str, count: int) -> None:
    model = catalog.default().by_pci_device_id(_pci(dev))
    assert model is not None, f"{dev} names no catalog GPU"
    p = _lookup(model, name)
    assert count <= p.max_instances, f"{model.id}: {count} x {name} > max {p.max_instances}"


@pytest.mark.parametrize(("config", "name", "unused"), list(_mig_parted_name_params()))
def test_mig_parted_profile_name_is_known(config: str, name: str, unused: None) -> None:
    owners = []
    for model in catalog.gpu_models():
        try:
            owners.append(_lookup(model, name))
        except errors.UnknownProfileError:
            continue
    assert owners, f"{name} (mig-parted {config}) is no catalog profile name or alias"


@pytest.mark.parametrize(("gpu_name", "name", "count"), list(_balanced_profile_params()))
def test_all_balanced_profile_exists(gpu_name: str, name: str, count: int) -> None:
    model = _balanced_model(gpu_name)
    p = model.profile_named(name)
    assert count <= p.max_instances, f"{model.id}: {count} x {name} > max {p.max_instances}"


@pytest.mark.parametrize(("key", "gpu_name", "mix"), list(_balanced_gpu_params()))
def test_all_balanced_mix_fits_gpu(key: str, gpu_name: str, mix: dict[str, int]) -> None:
    model = _balanced_model(gpu_name)
    chosen = [(model.profile_named(name), count) for name, count in mix.items()]
    assert sum(p.compute_slices * n for p, n in chosen) <= model.compute_slices, key
    assert sum(p.memory_slots * n for p, n in chosen) <= model.memory_slots, key
