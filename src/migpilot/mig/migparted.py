"""nvidia-mig-parted config files: parsed as mig-parted parses them, checked against the catalog.

Clusters that run NVIDIA's GPU Operator already describe their MIG layouts in mig-parted's format
(``version: v1``, ``mig-configs: {NAME: [entry, ...]}``); migpilot reads those files so that a
static setup can be validated, shown and later migrated without rewriting it. :func:`parse`
accepts and rejects what mig-parted's own parser does (``api/spec/v1/spec.go``,
``pkg/types/mig_config.go`` and go-nvlib's profile-name format check, in
github.com/NVIDIA/mig-parted), with one-line messages that name the file, the config and the
entry; the few inputs it rejects although mig-parted reads them are listed in :func:`parse`
(and in the README): each is one mig-parted accepts but then silently ignores or misreads.
Entries are picked per GPU as mig-parted picks them (:func:`entry_for`), comparing device
filters with the GPU's own PCI device and board subsystem ids (:mod:`migpilot.mig.pciids`).
:func:`layout_for` says what each GPU of a node would get, and :func:`check` looks for entries
that no GPU they target can hold, including well-formed profile names no GPU offers.

Part of the pure core: text in, frozen values out. No file I/O (the CLI reads the file), no
clock; it may import PyYAML, :mod:`migpilot.errors` and the other ``migpilot.mig`` modules only.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from migpilot import errors, yamltext
from migpilot.mig import catalog, layouts, pciids, profiles

VERSION = "v1"
"""The only config-file version mig-parted knows."""

_TOP_FIELDS = ("version", "mig-configs")
_ENTRY_FIELDS = ("device-filter", "devices", "mig-enabled", "mig-devices")
_REQUIRED_ENTRY_FIELDS = ("devices", "mig-enabled")

# mig-parted checks a profile name's format with go-nvlib's parser (pkg/nvlib/device/
# mig_profile.go, parseMigProfile), without asking whether any GPU offers it: 'Cc.Gg.GBgb' or
# 'Gg.GBgb' with decimal numbers (zero allowed), then optionally '+' (or '-') and a comma-separated
# list of distinct attributes, each letters, digits and inner dots, not starting with a digit.
# So '0g.0gb' and '1g.5gb+me,you,them' are well formed; whether a GPU offers them is check()'s
# question. Spellings that migpilot tolerates elsewhere ('mig-1g.10gb', '1g.10gb.me') are not.
_GO_INT_MAX = 2**63 - 1  # strconv.Atoi on a 64-bit platform
_ATTRIBUTE = re.compile(r"[A-Za-z](?:[A-Za-z0-9.]*[A-Za-z0-9])?")


@dataclass(frozen=True, slots=True)
class Entry:
    """One entry of a mig-config: which GPUs it applies to and what they get."""

    device_filter: tuple[pciids.PciId, ...]
    """PCI ids (``0x20B010DE``, or with a board's subsystem ``0x233010DE:0x16C110DE``);
    empty means every GPU."""
    device_filter_text: tuple[str, ...]
    """The filter ids as written in the file."""
    devices: Literal["all"] | tuple[int, ...]
    """``"all"`` or the GPU indexes (as ``nvidia-smi`` numbers them) the entry applies to."""
    mig_enabled: bool
    mig_devices: tuple[tuple[str, int], ...]
    """(profile name as written, count), in file order; counts of zero are kept."""

    def matches(self, *, pci_ids: Collection[pciids.PciId], index: int) -> bool:
        """Whether the entry applies to GPU ``index`` whose PCI id is one of ``pci_ids``.

        A real GPU has one id (pass it alone); a catalog model has several (SXM, PCIe, OEM
        variants), so asking about "a GPU of this model" passes them all and any may match.
        Each filter id is compared as mig-parted does (:meth:`pciids.PciId.matches`).
        """
        if self.device_filter and not any(
            f.matches(gpu) for f in self.device_filter for gpu in pci_ids
        ):
            return False
        return self.devices == "all" or index in self.devices

    def wanted(self) -> tuple[tuple[str, int], ...]:
        """The profiles to create: ``mig_devices`` without the zero counts."""
        return tuple((name, n) for name, n in self.mig_devices if n > 0)


@dataclass(frozen=True, slots=True)
class ConfigFile:
    """A parsed mig-parted config file."""

    source: str
    """Where the text came from (a path), used in every message."""
    version: str
    configs: Mapping[str, tuple[Entry, ...]] = field(hash=False)
    """Config name -> its entries, in file order (read-only)."""


@dataclass(frozen=True, slots=True)
class GpuLayout:
    """What one GPU of a node gets under a config."""

    index: int
    entry: int
    """Index (0-based) of the entry that decides this GPU."""
    mig_enabled: bool
    layout: layouts.Layout
    """The placed instances; empty when MIG is disabled or the entry asks for none."""


# --- parsing ---------------------------------------------------------------------------------


def _load_yaml(text: str, source: str) -> Any:
    return yamltext.load(text, source=source, error=errors.ConfigError)


def _describe(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {errors.shown(value)}"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _parse_device_filter(raw: Any) -> tuple[tuple[pciids.PciId, ...], tuple[str, ...]]:
    # null, "" and [] all mean "no filter" to mig-parted (MatchesDeviceFilter returns true).
    if raw is None or raw in ("", []):
        return (), ()
    if isinstance(raw, list):
        texts: list[Any] = raw
    elif isinstance(raw, str) or type(raw) is int:
        texts = [raw]  # a lone number is checked below, to say how to fix it
    else:
        raise ValueError(
            f"device-filter must be a string or a list of strings, got {_describe(raw)}"
        )
    ids: list[pciids.PciId] = []
    for text in texts:
        if not isinstance(text, str):
            # YAML reads an unquoted 0x20B010DE as a number, which mig-parted cannot unmarshal.
            hint = f' (quote it: "0x{text:08X}")' if type(text) is int and text >= 0 else ""
            raise ValueError(f"device-filter ids must be strings, got {_describe(text)}{hint}")
        try:
            ids.append(pciids.parse(text))
        except ValueError as e:
            # mig-parted ignores this parse error and the id silently never matches a GPU.
            raise ValueError(
                f"device-filter {text!r} is not a PCI device id such as 0x20B010DE or "
                f"0x233010DE:0x16C110DE: {e}"
            ) from None
    return tuple(ids), tuple(texts)


def _parse_devices(raw: Any) -> Literal["all"] | tuple[int, ...]:
    if isinstance(raw, str):
        if raw != "all":
            raise ValueError(f"invalid string input for 'devices': {raw!r} (expected 'all')")
        return "all"
    if isinstance(raw, list):
        indexes: list[int] = []
        for item in raw:
            if type(item) is not int or item < 0:
                raise ValueError(f"devices: {errors.shown(item)} is not a GPU index")
            indexes.append(item)
        return tuple(indexes)
    raise ValueError(f"devices must be 'all' or a list of GPU indexes, got {_describe(raw)}")


def _field_problem(text: str, unit: str) -> str | None:
    """Why ``text`` is not ``<decimal><unit>`` (``3g``, ``40gb``), or ``None``."""
    if text.strip() != text:
        return f"spaces around {text.strip()!r}"
    if not text.endswith(unit):
        return f"{text!r} does not end in '{unit}'"
    number = text[: -len(unit)]
    if not (number.isascii() and number.isdigit()) or int(number) > _GO_INT_MAX:
        return f"{text!r} does not start with a decimal number"
    return None


def _attributes_problem(text: str) -> str | None:
    """Why ``text`` is not a list of distinct attributes (``me``, ``me.all,gfx``), or ``None``."""
    seen: set[str] = set()
    for attribute in text.split(","):
        if attribute in seen:
            return f"attribute {attribute!r} repeated"
        if not attribute:
            return "an empty attribute"
        if _ATTRIBUTE.fullmatch(attribute) is None:
            return (
                f"attribute {attribute!r} is not letters, digits and inner dots "
                "starting with a letter"
            )
        seen.add(attribute)
    return None


def format_problem(name: str) -> str | None:
    """Why mig-parted would reject ``name``'s format (see the comment on the grammar above),
    or ``None`` for a well-formed name, whether or not any GPU offers it."""
    if not name:
        return "an empty name"
    plus = name.split("+", 1)
    minus = name.split("-", 1)
    if len(plus) == 2 and len(minus) == 2:
        return "both '+' and '-' attributes"
    head, *attributes = plus if len(plus) == 2 else minus
    fields = head.split(".", 2)
    units = {3: ("c", "g", "gb"), 2: ("g", "gb")}.get(len(fields))
    if units is None:
        return "expected Gg.GBgb or Cc.Gg.GBgb before any attributes"
    for text, unit in zip(fields, units, strict=True):
        problem = _field_problem(text, unit)
        if problem is not None:
            return problem
    return _attributes_problem(attributes[0]) if attributes else None


def _check_profile_name(name: str) -> None:
    problem = format_problem(name)
    if problem is not None:
        raise ValueError(
            f"mig-devices: invalid format for {name!r}: {problem} "
            "(expected e.g. 1g.10gb, 3g.40gb, 1g.10gb+me, 1c.3g.40gb)"
        )


def _parse_mig_devices(raw: Any) -> tuple[tuple[str, int], ...] | None:
    """The (name, count) pairs; ``None`` when absent or null (mig-parted's nil map)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"mig-devices must be a mapping of profile to count, got {_describe(raw)}")
    pairs: list[tuple[str, int]] = []
    for name, count in raw.items():
        if not isinstance(name, str):
            raise ValueError(f"mig-devices: profile {errors.shown(name)} must be a string")
        _check_profile_name(name)
        if type(count) is not int:
            raise ValueError(
                f"mig-devices: count for {name!r} must be an integer, got {errors.shown(count)}"
            )
        if count < 0:
            raise ValueError(f"mig-devices: invalid count for {name!r}: {count}")
        pairs.append((name, count))
    if pairs and not any(n > 0 for _, n in pairs):
        raise ValueError("mig-devices: all counts for all MigProfiles are 0")
    return tuple(pairs)


def _parse_entry(raw: Any) -> Entry:
    """One entry; raises ``ValueError`` with the bare reason (the caller adds where)."""
    if not isinstance(raw, dict):
        raise ValueError(f"expected a mapping, got {_describe(raw)}")
    for key in _REQUIRED_ENTRY_FIELDS:
        if key not in raw:
            raise ValueError(f"missing required field: {key}")
    unexpected = [str(k) for k in raw if k not in _ENTRY_FIELDS]
    if unexpected:
        raise ValueError(f"unexpected field: {', '.join(sorted(unexpected))}")
    filter_ids, filter_text = _parse_device_filter(raw.get("device-filter"))
    devices = _parse_devices(raw["devices"])
    enabled = raw["mig-enabled"]
    if not isinstance(enabled, bool):
        raise ValueError(f"mig-enabled must be true or false, got {_describe(enabled)}")
    mig_devices = _parse_mig_devices(raw.get("mig-devices"))
    if enabled and mig_devices is None:
        raise ValueError("missing required field 'mig-devices' when 'mig-enabled' is true")
    if not enabled and mig_devices:
        raise ValueError("MIG devices included when 'mig-enabled' is false")
    return Entry(
        device_filter=filter_ids,
        device_filter_text=filter_text,
        devices=devices,
        mig_enabled=enabled,
        mig_devices=mig_devices or (),
    )


def parse(text: str, *, source: str) -> ConfigFile:
    """Parse the text of a mig-parted config file; ``source`` names it in messages.

    Raises :class:`ConfigError` with one line naming the source, and the config and entry
    (0-based) where there is one. Beyond mig-parted, it also rejects duplicate keys (mig-parted
    keeps the last silently), device-filter ids mig-parted cannot read (a model name, spaces,
    a second ``:``, a number over 32 bits: mig-parted ignores the error and the id never
    matches a GPU), negative GPU indexes (never a GPU's), and an empty file or one without
    ``mig-configs`` (mig-parted fails only when a config is selected). Profile names are checked
    for format only, as mig-parted does: ``0g.0gb`` parses, and :func:`check` reports that no
    GPU offers it.
    """
    data = _load_yaml(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise errors.ConfigError(f"{source}: expected a mapping at the top, got {_describe(data)}")
    if "version" not in data:
        raise errors.ConfigError(f"{source}: unable to parse with missing 'version' field")
    if data["version"] != VERSION:
        raise errors.ConfigError(f"{source}: unknown version: {data['version']}")
    unexpected = [str(k) for k in data if k not in _TOP_FIELDS]
    if unexpected:
        raise errors.ConfigError(f"{source}: unexpected field: {', '.join(sorted(unexpected))}")
    if "mig-configs" not in data:
        raise errors.ConfigError(f"{source}: missing required field: mig-configs")
    raw_configs = data["mig-configs"]
    if raw_configs is not None and not isinstance(raw_configs, dict):
        raise errors.ConfigError(
            f"{source}: mig-configs must be a mapping of name to entries, "
            f"got {_describe(raw_configs)}"
        )
    if not raw_configs:
        raise errors.ConfigError(f"{source}: at least one entry in 'mig-configs' is required")
    configs: dict[str, tuple[Entry, ...]] = {}
    for name, raw_entries in raw_configs.items():
        if not isinstance(name, str):
            raise errors.ConfigError(f"{source}: config name {name!r} must be a string")
        if raw_entries is None or raw_entries == []:
            raise errors.ConfigError(f"{source}: at least one entry in {name!r} is required")
        if not isinstance(raw_entries, list):
            raise errors.ConfigError(
                f"{source}: config {name!r}: expected a list of entries, "
                f"got {_describe(raw_entries)}"
            )
        entries: list[Entry] = []
        for i, raw in enumerate(raw_entries):
            try:
                entries.append(_parse_entry(raw))
            except ValueError as e:
                raise errors.ConfigError(f"{source}: config {name!r} entry {i}: {e}") from None
        configs[name] = tuple(entries)
    return ConfigFile(source=source, version=VERSION, configs=types.MappingProxyType(configs))


# --- what a node gets ------------------------------------------------------------------------


def resolve_profile(model: profiles.GpuModel, text: str) -> profiles.Profile:
    """The profile of ``model`` that the entry's name ``text`` asks for.

    Resolved by hardware shape (:meth:`profiles.GpuModel.resolve_profile`). A name that is well
    formed for mig-parted but names no profile migpilot knows of (``0g.0gb``,
    ``1g.10gb+me,gfx``) raises :class:`UnknownProfileError` saying that ``model`` lacks it.
    """
    try:
        profiles.parse_profile_name(text)
    except errors.UnknownProfileError:
        offered = ", ".join(p.name for p in model.profiles)
        raise errors.UnknownProfileError(
            f"{model.id} has no MIG profile {text!r} (offered: {offered})"
        ) from None
    return model.resolve_profile(text)


def _place(entry: Entry, model: profiles.GpuModel) -> layouts.Layout:
    """The entry's instances placed on ``model``; raises the resolve or layout error."""
    names: list[str] = []
    for text, count in entry.wanted():
        names.extend([resolve_profile(model, text).name] * count)
    return layouts.place(model, names)


def selected(config: ConfigFile, name: str) -> tuple[Entry, ...]:
    """The entries of config ``name``; raises :class:`ConfigError` naming the config (with the
    closest known name) when there is none."""
    entries = config.configs.get(name)
    if entries is None:
        close = difflib.get_close_matches(name, list(config.configs), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        known = ", ".join(config.configs)
        raise errors.ConfigError(f"{config.source}: no config {name!r}{hint} (known: {known})")
    return entries


# How mig-parted picks the entry for a GPU (github.com/NVIDIA/mig-parted,
# cmd/nvidia-mig-parted/assert/assert.go WalkSelectedMigConfigForEachGPU, used by apply/mode.go,
# apply/config.go and assert/config.go; matching in api/spec/v1/helpers.go): it walks the
# entries in file order and, for each, every GPU whose PCI id passes MatchesDeviceFilter (no
# filter matches all) and whose index passes MatchesDevices ('all' or the index is listed), and
# applies that entry to the GPU. Nothing stops at the first match, so when several entries match
# one GPU each is applied in turn (apply sets the mode and recreates the devices each time) and
# the LAST matching entry is what the GPU ends with; assert likewise records the last match. A
# GPU that no entry matches is left as it is by apply, and assert then fails with "not all GPUs
# match the specified config".
def entry_for(
    entries: tuple[Entry, ...], *, pci_ids: Collection[pciids.PciId], index: int
) -> int | None:
    """The position of the entry mig-parted applies to GPU ``index`` with one of ``pci_ids``
    (the last entry that matches, as the comment above explains); ``None``: no entry matches."""
    chosen: int | None = None
    for i, entry in enumerate(entries):
        if entry.matches(pci_ids=pci_ids, index=index):
            chosen = i
    return chosen


def model_pci_ids(model: profiles.GpuModel) -> tuple[pciids.PciId, ...]:
    """The ids "a GPU of this model" may have when its board is not known: every device id of
    the model with an unknown subsystem, so filters naming a board never match it."""
    return tuple(pciids.PciId(d, 0) for d in model.pci_device_ids)


def layout_for(
    config: ConfigFile,
    name: str,
    *,
    model: profiles.GpuModel,
    gpus: int,
    pci_id: pciids.PciId | None = None,
) -> tuple[GpuLayout, ...]:
    """What each of ``gpus`` GPUs of ``model`` gets under config ``name``, by GPU index.

    The GPUs' PCI id is ``pci_id`` when given (its subsystem, if any, is the board's), otherwise
    any of the model's ids with an unknown board (:func:`model_pci_ids`). Profile names are
    resolved by hardware shape (``3g.39gb`` is the A100-80GB's ``3g.40gb``) and placed with
    :func:`layouts.place`. Raises :class:`ConfigError` for an unknown config, a GPU no entry
    matches, or an entry that cannot be placed (with the reason).
    """
    entries = selected(config, name)
    ids = (pci_id,) if pci_id is not None else model_pci_ids(model)
    where = f"{config.source}: config {name!r}"
    placed: dict[int, layouts.Layout] = {}
    out: list[GpuLayout] = []
    for index in range(gpus):
        i = entry_for(entries, pci_ids=ids, index=index)
        if i is None:
            gpu = model.id if pci_id is None else f"{model.id}, {pci_id}"
            raise errors.ConfigError(
                f"{where}: no entry matches GPU {index} ({gpu}); mig-parted apply would "
                "leave that GPU as it is and mig-parted assert would fail with 'not all GPUs "
                f"match the specified config'{_board_hint(entries, model, pci_id)}"
            )
        entry = entries[i]
        if not entry.mig_enabled:
            out.append(GpuLayout(index, i, mig_enabled=False, layout=layouts.Layout(())))
            continue
        if i not in placed:
            try:
                placed[i] = _place(entry, model)
            except (errors.UnknownProfileError, errors.LayoutError) as e:
                raise errors.ConfigError(
                    f"{where} entry {i} cannot be placed on {model.id}: {e}"
                ) from None
        out.append(GpuLayout(index, i, mig_enabled=True, layout=placed[i]))
    return tuple(out)


def _board_hint(
    entries: tuple[Entry, ...], model: profiles.GpuModel, pci_id: pciids.PciId | None
) -> str:
    """When entries name boards of this model and the GPU's board is unknown, how to name it."""
    if pci_id is not None and pci_id.subsystem is not None:
        return ""
    boards = [
        f
        for e in entries
        for f in e.device_filter
        if f.subsystem is not None and f.device in model.pci_device_ids
    ]
    if not boards:
        return ""
    return f" (entries name boards such as {boards[0]}: give the GPU as DEVICE:SUBSYSTEM)"


# --- checking against the catalog ------------------------------------------------------------


def _resolves(model: profiles.GpuModel, text: str, *, exact: bool) -> bool:
    try:
        if exact:
            canonical = profiles.parse_profile_name(text).canonical
            return any(canonical == p.name or canonical in p.aliases for p in model.profiles)
        resolve_profile(model, text)
    except errors.UnknownProfileError:
        return False  # includes names mig-parted's format allows but migpilot cannot read
    return True


def _targets(entry: Entry, cat: catalog.Catalog) -> list[profiles.GpuModel] | str:
    """The catalog GPUs an entry is meant for, or why there are none."""
    if entry.device_filter:
        # Unknown ids are not errors: mig-parted just never matches them.
        known = (cat.by_pci_device_id(f.device) for f in entry.device_filter)
        return list(dict.fromkeys(m for m in known if m is not None))
    names = [text for text, _ in entry.wanted()]
    # Without a filter an entry is meant for the GPUs that offer its profiles. Names are matched
    # exactly (canonical name or a known alias) first: with the drift tolerance alone, the
    # default file's all-1g.5gb (7 x 1g.5gb, for A100-40GB) would count as 7 x 1g.6gb on A30,
    # which holds 4, and be reported although mig-parted would never apply it there. Only when
    # no GPU offers the names exactly does the tolerant resolution decide.
    for exact in (True, False):
        models = [m for m in cat.models if all(_resolves(m, t, exact=exact) for t in names)]
        if models:
            return models
    missing = [t for t in names if not any(_resolves(m, t, exact=False) for m in cat.models)]
    if missing:
        try:
            parsed: profiles.ParsedName | None = profiles.parse_profile_name(missing[0])
        except errors.UnknownProfileError:
            parsed = None  # well formed for mig-parted (0g.0gb, 1g.5gb+me,gfx) yet no profile
        if parsed is not None and parsed.compute is not None and parsed.compute != parsed.g:
            return f"{missing[0]} is a compute-instance profile; migpilot places GPU instances"
        return "no known GPU offers " + ", ".join(missing)
    return "no known GPU offers all of " + ", ".join(names)


def check(config: ConfigFile, *, cat: catalog.Catalog | None = None) -> list[str]:
    """Problems of every config against the catalog, one line each; empty when all is well.

    An entry with a device-filter must place on every catalog GPU its ids name; one without a
    filter on every catalog GPU that offers its profiles (see :func:`_targets`).
    """
    cat = cat if cat is not None else catalog.default()
    problems: list[str] = []
    for name, entries in config.configs.items():
        for i, entry in enumerate(entries):
            if not entry.mig_enabled:
                continue
            where = f"{config.source}: config {name!r} entry {i}"
            targets = _targets(entry, cat)
            if isinstance(targets, str):
                problems.append(f"{where}: {targets}")
                continue
            for model in targets:
                try:
                    _place(entry, model)
                except (errors.UnknownProfileError, errors.LayoutError) as e:
                    problems.append(f"{where}: {model.id}: {e}")
    return problems
