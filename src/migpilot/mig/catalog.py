"""The GPU catalog: every MIG-capable GPU model, loaded from the data file shipped in the package.

``data/catalog.yaml`` is built from the sourced facts in ``shared/reference/mig_profiles.yaml``
(a test checks every confirmed fact there against it). Values no public source gives are left
empty, and values inferred rather than observed (placements of GPUs that share the A100/H100
8-slot grid, for example) are listed in each profile's ``inferred`` field.

:func:`resolve_gpu` maps whatever a user or a node reports to a model: the NVML product name
(``NVIDIA A100-SXM4-40GB``), its gpu-feature-discovery form (``NVIDIA-A100-SXM4-40GB``, also with
a single-strategy ``-MIG-3g.20gb`` suffix), a short id (``a100-40gb``) or a PCI device id
(``0x20B010DE``). Reading the file is the only I/O here, a read of package data done once.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Mapping, Sequence
from typing import Any, cast

import yaml

from migpilot import errors
from migpilot.mig import profiles

_ENGINE_KEYS = ("ce", "dec", "enc", "jpeg", "ofa")
_PROFILE_KEYS = frozenset(
    {
        "name",
        "nvml",
        "smi_id",
        "memory_mib",
        "memory_slots",
        "compute_slices",
        "sms",
        "max",
        "placements",
        "inferred",
        "aliases",
        *_ENGINE_KEYS,
    }
)
_GPU_KEYS = frozenset(
    {
        "id",
        "aliases",
        "products",
        "pci_device_ids",
        "family",
        "compute_capability",
        "memory_slots",
        "compute_slices",
        "max_gpu_instances",
        "grid",
        "notes",
        "profiles",
    }
)


def normalise_gpu_name(text: str) -> str:
    """The form every GPU alias is compared in: lower case, no vendor prefix, ``-`` separators."""
    s = text.strip().lower()
    s = re.sub(r"[\s_]+", "-", s)
    s = re.sub(r"^nvidia-?", "", s)
    # gpu-feature-discovery's single strategy appends the profile: NVIDIA-A100-SXM4-40GB-MIG-3g.20gb
    s = re.sub(r"-mig-(?:[0-9]+c\.)?[0-9]+g\.[0-9]+gb.*$|-mig-invalid$", "", s)
    return re.sub(r"-+", "-", s).strip("-")


def parse_pci_device_id(text: str) -> int | None:
    """``0x20B010DE`` (or ``0x20b010de:0x...`` with a subsystem) -> its 32-bit device+vendor id."""
    m = re.fullmatch(r"\s*(0x[0-9a-fA-F]{8})(?::0x[0-9a-fA-F]{8})?\s*", text)
    return int(m[1], 16) if m else None


class Catalog:
    """All known GPU models, with alias resolution."""

    def __init__(self, models: Sequence[profiles.GpuModel]) -> None:
        self.models: tuple[profiles.GpuModel, ...] = tuple(models)
        self._by_alias: dict[str, profiles.GpuModel] = {}
        self._by_pci: dict[int, profiles.GpuModel] = {}
        for model in self.models:
            names = [model.id, *model.aliases, *model.product_names]
            for name in names:
                key = normalise_gpu_name(name)
                other = self._by_alias.get(key)
                if other is not None and other is not model:
                    raise errors.CatalogError(
                        f"alias {name!r} names both {other.id} and {model.id}"
                    )
                self._by_alias[key] = model
            for dev in model.pci_device_ids:
                if dev in self._by_pci:
                    raise errors.CatalogError(f"PCI id {dev:#010x} listed twice")
                self._by_pci[dev] = model

    def by_pci_device_id(self, device_id: int) -> profiles.GpuModel | None:
        """The model with this 32-bit PCI device+vendor id, if known."""
        return self._by_pci.get(device_id)

    def resolve(self, text: str) -> profiles.GpuModel:
        """Resolve any alias to a model; raise :class:`UnknownGpuError` naming what was tried."""
        pci = parse_pci_device_id(text)
        if pci is not None:
            model = self._by_pci.get(pci)
            if model is None:
                raise errors.UnknownGpuError(f"unknown GPU PCI device id {text.strip()!r}")
            return model
        key = normalise_gpu_name(text)
        if not key:
            raise errors.UnknownGpuError("empty GPU name")
        exact = self._by_alias.get(key)
        if exact is not None:
            return exact
        prefixed = {m.id: m for alias, m in self._by_alias.items() if alias.startswith(key + "-")}
        if len(prefixed) == 1:
            return next(iter(prefixed.values()))
        if len(prefixed) > 1:
            raise errors.UnknownGpuError(
                f"GPU name {text!r} is ambiguous: {', '.join(sorted(prefixed))}"
            )
        known = ", ".join(m.id for m in self.models)
        raise errors.UnknownGpuError(f"unknown GPU {text!r} (known: {known})")


def _req(d: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in d:
        raise errors.CatalogError(f"{where}: missing {key!r}")
    return d[key]


def _opt_int(d: Mapping[str, Any], key: str) -> int | None:
    v = d.get(key)
    return None if v is None else int(v)


def _load_profile(
    raw: Mapping[str, Any], gpu: Mapping[str, Any], grids: Mapping[str, Any]
) -> profiles.Profile:
    where = f"{gpu.get('id')}/{raw.get('name')}"
    unknown = set(raw) - _PROFILE_KEYS
    if unknown:
        raise errors.CatalogError(f"{where}: unknown keys {sorted(unknown)}")
    nvml = str(_req(raw, "nvml", where))
    if nvml not in profiles.NVML_GPU_INSTANCE_PROFILE:
        raise errors.CatalogError(f"{where}: unknown NVML profile {nvml}")
    placements_raw = _req(raw, "placements", where)
    if placements_raw == "grid":
        grid = grids[str(_req(gpu, "grid", where))]
        placements_raw = _req(grid, nvml, where)
    inferred = frozenset(str(x) for x in raw.get("inferred", ()))
    return profiles.Profile(
        name=str(_req(raw, "name", where)),
        nvml_profile=nvml,
        smi_id=_opt_int(raw, "smi_id"),
        memory_mib=_opt_int(raw, "memory_mib"),
        memory_slots=int(_req(raw, "memory_slots", where)),
        compute_slices=int(_req(raw, "compute_slices", where)),
        sms=_opt_int(raw, "sms"),
        engines=profiles.Engines(*(_opt_int(raw, k) for k in _ENGINE_KEYS)),
        max_instances=int(_req(raw, "max", where)),
        placements=tuple(sorted(int(s) for s in placements_raw)),
        inferred=inferred,
        aliases=tuple(str(a) for a in raw.get("aliases", ())),
    )


def _check_model(model: profiles.GpuModel) -> None:
    names: set[str] = set()
    for p in model.profiles:
        where = f"{model.id}/{p.name}"
        parsed = profiles.parse_profile_name(p.name)
        if parsed.canonical != p.name:
            raise errors.CatalogError(f"{where}: name is not canonical ({parsed.canonical})")
        if parsed.g != p.compute_slices or parsed.attribute is not p.attribute:
            raise errors.CatalogError(f"{where}: name disagrees with its compute slices/attribute")
        if p.name in names:
            raise errors.CatalogError(f"{where}: duplicate profile")
        names.add(p.name)
        if not p.placements:
            raise errors.CatalogError(f"{where}: no placements")
        for s in p.placements:
            if s < 0 or s + p.memory_slots > model.memory_slots:
                raise errors.CatalogError(f"{where}: placement {s} runs past the GPU's memory")
        if p.compute_slices > model.compute_slices or p.max_instances < 1:
            raise errors.CatalogError(f"{where}: impossible size or max_instances")
    shapes = [p.shape for p in model.profiles]
    if len(set(shapes)) != len(shapes):
        raise errors.CatalogError(f"{model.id}: two profiles share a hardware shape")


def _load_model(
    raw: Mapping[str, Any], grids: Mapping[str, Any], needs_reset: Mapping[str, Any]
) -> profiles.GpuModel:
    where = str(raw.get("id"))
    unknown = set(raw) - _GPU_KEYS
    if unknown:
        raise errors.CatalogError(f"{where}: unknown keys {sorted(unknown)}")
    pci: list[int] = []
    for text in raw.get("pci_device_ids", ()):
        # YAML reads an unquoted 0x20B010DE as an integer already.
        dev = text if isinstance(text, int) else parse_pci_device_id(str(text))
        if dev is None:
            raise errors.CatalogError(f"{where}: bad PCI device id {text!r}")
        pci.append(dev)
    major, minor = (int(x) for x in str(_req(raw, "compute_capability", where)).split("."))
    family = str(_req(raw, "family", where))
    reset = needs_reset.get(family)
    if not isinstance(reset, bool):
        raise errors.CatalogError(
            f"{where}: mig_mode_change_needs_reset names no true or false for family {family!r}"
        )
    model = profiles.GpuModel(
        id=where,
        product_names=tuple(str(n) for n in _req(raw, "products", where)),
        pci_device_ids=tuple(pci),
        family=family,
        compute_capability=(major, minor),
        memory_slots=int(_req(raw, "memory_slots", where)),
        compute_slices=int(_req(raw, "compute_slices", where)),
        max_gpu_instances=int(_req(raw, "max_gpu_instances", where)),
        profiles=tuple(_load_profile(p, raw, grids) for p in _req(raw, "profiles", where)),
        notes=tuple(str(n) for n in raw.get("notes", ())),
        aliases=tuple(str(a) for a in raw.get("aliases", ())),
        mode_change_needs_reset=reset,
    )
    _check_model(model)
    return model


def load_catalog_text(text: str) -> Catalog:
    """Build a catalog from the YAML text of a catalog file (the shipped one, or a test's)."""
    data = yaml.safe_load(text)
    if not isinstance(data, dict) or data.get("version") != 1:
        raise errors.CatalogError("catalog data: expected a mapping with version: 1")
    grids = cast(Mapping[str, Any], data.get("grids", {}))
    needs_reset = cast(Mapping[str, Any], data.get("mig_mode_change_needs_reset", {}))
    return Catalog([_load_model(g, grids, needs_reset) for g in _req(data, "gpus", "catalog")])


@functools.cache
def default() -> Catalog:
    """The catalog shipped in the package (parsed once per process)."""
    text = importlib.resources.files("migpilot.mig").joinpath("data/catalog.yaml").read_text()
    return load_catalog_text(text)


def resolve_gpu(text: str) -> profiles.GpuModel:
    """Resolve a GPU alias against the shipped catalog."""
    return default().resolve(text)


def gpu_models() -> tuple[profiles.GpuModel, ...]:
    """Every GPU model in the shipped catalog, in catalog order."""
    return default().models
