"""MIG profiles and GPU models: the hardware facts, as frozen values.

A MIG *profile* is a kind of GPU instance (``1g.10gb``, ``3g.40gb``, ``1g.10gb+me``). What a
profile *is* does not depend on its name: it is a hardware shape, the number of compute slices,
the number of memory slots it occupies and an attribute such as media extensions (``+me``).
Names drift between drivers (``3g.39gb`` vs ``3g.40gb`` on A100-80GB, GB200's ``1g.24gb`` vs
``1g.23gb``), so :meth:`GpuModel.resolve_profile` matches a name to a shape with a tolerance on
the memory figure instead of comparing strings.

This module holds data types and name parsing only; the catalog data that fills them lives in
:mod:`migpilot.mig.catalog`. It is part of the pure core: no I/O, no clock.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from migpilot import errors


class Attribute(enum.StrEnum):
    """The attribute suffix of a profile name; its value is the suffix as NVIDIA spells it."""

    NONE = ""
    ME = "+me"
    """Media extensions: the instance also gets the GPU's JPEG/OFA engines (at most one per GPU)."""
    ME_ALL = "+me.all"
    """All media engines (RTX PRO Blackwell)."""
    GFX = "+gfx"
    """Graphics APIs enabled (RTX PRO Blackwell)."""
    NO_ME = "-me"
    """No media engines at all (RTX PRO Blackwell)."""

    @property
    def media_extension(self) -> bool:
        """True for the attributes that take the GPU's shared media engines."""
        return self in (Attribute.ME, Attribute.ME_ALL)


# NVML_GPU_INSTANCE_PROFILE_* suffix -> attribute, after go-nvlib's naming code.
NVML_INDEX_ATTRIBUTE: dict[str, Attribute] = {
    "1_SLICE_REV1": Attribute.ME,
    "2_SLICE_REV1": Attribute.ME,
    "1_SLICE_GFX": Attribute.GFX,
    "2_SLICE_GFX": Attribute.GFX,
    "3_SLICE_GFX": Attribute.GFX,
    "4_SLICE_GFX": Attribute.GFX,
    "1_SLICE_NO_ME": Attribute.NO_ME,
    "2_SLICE_NO_ME": Attribute.NO_ME,
    "1_SLICE_ALL_ME": Attribute.ME_ALL,
    "2_SLICE_ALL_ME": Attribute.ME_ALL,
}

# The NVML_GPU_INSTANCE_PROFILE_* constants (nvml.h): the profile *type* passed to
# nvmlDeviceGetGpuInstanceProfileInfo. Not the nvidia-smi ID.
NVML_GPU_INSTANCE_PROFILE: dict[str, int] = {
    "1_SLICE": 0,
    "2_SLICE": 1,
    "3_SLICE": 2,
    "4_SLICE": 3,
    "7_SLICE": 4,
    "8_SLICE": 5,
    "6_SLICE": 6,
    "1_SLICE_REV1": 7,
    "2_SLICE_REV1": 8,
    "1_SLICE_REV2": 9,
    "1_SLICE_GFX": 10,
    "2_SLICE_GFX": 11,
    "4_SLICE_GFX": 12,
    "1_SLICE_NO_ME": 13,
    "2_SLICE_NO_ME": 14,
    "1_SLICE_ALL_ME": 15,
    "2_SLICE_ALL_ME": 16,
    "3_SLICE_GFX": 17,
}


@dataclass(frozen=True, slots=True)
class Engines:
    """Engines a GPU instance of this profile owns (the CE/DEC/ENC/JPG/OFA columns of -lgip).

    ``None`` means no public source gives the value.
    """

    copy: int | None
    decoder: int | None
    encoder: int | None
    jpeg: int | None
    ofa: int | None


@dataclass(frozen=True, slots=True)
class Shape:
    """What identifies a profile on a GPU, whatever the driver calls it."""

    compute_slices: int
    memory_slots: int
    attribute: Attribute


@dataclass(frozen=True, slots=True)
class Profile:
    """One GPU-instance profile of one GPU model."""

    name: str
    """Canonical name, as the newest driver in the sources prints it (``3g.40gb``)."""
    nvml_profile: str
    """NVML profile constant suffix (``3_SLICE``, ``1_SLICE_REV1``...)."""
    smi_id: int | None
    """The ID column of ``nvidia-smi mig -lgip`` (what ``-cgi`` takes)."""
    memory_mib: int | None
    """Usable memory in MiB as the driver reports it (driver-dependent; see the catalog)."""
    memory_slots: int
    """Memory slices occupied (the size in ``nvidia-smi mig -lgipp``)."""
    compute_slices: int
    """Compute (GPC) slices, the ``Ng`` in the name."""
    sms: int | None
    """Streaming multiprocessors."""
    engines: Engines
    max_instances: int
    """How many instances of this profile fit on one GPU (the Total column of -lgip)."""
    placements: tuple[int, ...]
    """Allowed start memory slots."""
    inferred: frozenset[str] = field(default_factory=frozenset)
    """Fields whose value is inferred (for example placements from the shared 8-slot grid)."""
    aliases: tuple[str, ...] = ()
    """Other names drivers or tools have used for this profile (``3g.39gb``)."""

    @property
    def attribute(self) -> Attribute:
        """The attribute suffix, from the NVML profile type."""
        return NVML_INDEX_ATTRIBUTE.get(self.nvml_profile, Attribute.NONE)

    @property
    def nvml_index(self) -> int:
        """The NVML_GPU_INSTANCE_PROFILE_* number."""
        return NVML_GPU_INSTANCE_PROFILE[self.nvml_profile]

    @property
    def shape(self) -> Shape:
        """The hardware identity of the profile."""
        return Shape(self.compute_slices, self.memory_slots, self.attribute)

    @property
    def media_extension(self) -> bool:
        """True when the instance takes the GPU's shared media engines (``+me``)."""
        return self.attribute.media_extension

    @property
    def nominal_gb(self) -> int:
        """The memory figure in the name (``40`` for ``3g.40gb``)."""
        return parse_profile_name(self.name).gb

    @property
    def resource_name(self) -> str:
        """The device plugin's mixed-strategy resource suffix: ``+`` becomes ``.``."""
        return "mig-" + self.name.replace("+", ".")

    def placements_text(self) -> str:
        """Placements as ``nvidia-smi mig -lgipp`` prints them: ``{0,2,4}:2``."""
        return "{" + ",".join(str(s) for s in self.placements) + "}:" + str(self.memory_slots)


@dataclass(frozen=True, slots=True)
class GpuModel:
    """One MIG-capable GPU model and its profiles."""

    id: str
    """Short stable identifier (``a100-40gb``), used in files and on the command line."""
    product_names: tuple[str, ...]
    """Names ``nvmlDeviceGetName`` reports (``NVIDIA A100-SXM4-40GB``)."""
    pci_device_ids: tuple[int, ...]
    """32-bit device+vendor ids as nvidia-mig-parted's ``device-filter`` writes them."""
    family: str
    """Architecture (``ampere``, ``hopper``, ``blackwell``), as gpu-feature-discovery labels it."""
    compute_capability: tuple[int, int]
    memory_slots: int
    compute_slices: int
    max_gpu_instances: int
    profiles: tuple[Profile, ...]
    notes: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    """Extra short names accepted on the command line."""
    mode_change_needs_reset: bool = True
    """True when a MIG mode change takes effect only after a GPU reset (Ampere: A100, A30);
    False from Hopper on, where it takes effect at once. The catalog sets it per family, with
    its sources; the default is the cautious answer."""

    def __hash__(self) -> int:
        # Models are cache keys on hot paths (layouts.geometry, placement caches): hashing every
        # profile each time would dominate. Equal models have equal ids, so this is consistent.
        return hash(self.id)

    @property
    def gfd_product_names(self) -> tuple[str, ...]:
        """Product names as gpu-feature-discovery writes them into labels (spaces -> ``-``)."""
        return tuple(gfd_sanitise(n) for n in self.product_names)

    def profile_named(self, name: str) -> Profile:
        """The profile with exactly this canonical name (no tolerance)."""
        for p in self.profiles:
            if p.name == name:
                return p
        raise errors.UnknownProfileError(f"{self.id} has no MIG profile {name!r}")

    def resolve_profile(self, text: str) -> Profile:
        """Resolve a profile name as any driver or tool spells it to this GPU's profile.

        Accepts ``3g.40gb``, ``3g.39gb`` (driver drift), ``1g.10gb+me``, ``1g.10gb.me`` (the
        device plugin's resource spelling) and ``mig-1g.10gb`` / ``nvidia.com/mig-1g.10gb``.
        The match is on compute slices and attribute exactly and on the memory figure within a
        tolerance (2 GB or 10 %, whichever is larger); the nearest profile wins.
        """
        parsed = parse_profile_name(text)
        if parsed.compute is not None and parsed.compute != parsed.g:
            raise errors.UnknownProfileError(
                f"{text!r} is a compute-instance profile; migpilot manages whole GPU instances "
                f"(use {parsed.g}g.{parsed.gb}gb{parsed.attribute.value})"
            )
        candidates = [
            p
            for p in self.profiles
            if p.compute_slices == parsed.g and p.attribute is parsed.attribute
        ]
        for p in candidates:
            if parsed.canonical == p.name or parsed.canonical in p.aliases:
                return p
        scored = sorted(
            (abs(p.nominal_gb - parsed.gb), p.memory_slots, p.name, p)
            for p in candidates
            if abs(p.nominal_gb - parsed.gb) <= max(2.0, 0.1 * p.nominal_gb)
        )
        if not scored:
            offered = ", ".join(p.name for p in self.profiles)
            raise errors.UnknownProfileError(
                f"{self.id} has no MIG profile matching {text!r} (offered: {offered})"
            )
        if len(scored) > 1 and scored[0][0] == scored[1][0]:
            raise errors.UnknownProfileError(
                f"{text!r} is ambiguous on {self.id}: {scored[0][2]} or {scored[1][2]}"
            )
        return scored[0][3]


@dataclass(frozen=True, slots=True)
class ParsedName:
    """A profile name taken apart: ``[Cc.]Gg.GBgb[attribute]``."""

    compute: int | None
    g: int
    gb: int
    attribute: Attribute

    @property
    def canonical(self) -> str:
        """The GPU-instance name in NVIDIA's spelling."""
        return f"{self.g}g.{self.gb}gb{self.attribute.value}"


_NAME = re.compile(
    r"^(?:(?P<c>[0-9]+)c\.)?(?P<g>[0-9]+)g\.(?P<gb>[0-9]+)gb"
    r"(?P<attr>\+me\.all|\.me\.all|\+me|\.me|\+gfx|\.gfx|-me)?$"
)
_ATTRS = {
    None: Attribute.NONE,
    "+me": Attribute.ME,
    ".me": Attribute.ME,
    "+me.all": Attribute.ME_ALL,
    ".me.all": Attribute.ME_ALL,
    "+gfx": Attribute.GFX,
    ".gfx": Attribute.GFX,
    "-me": Attribute.NO_ME,
}


def parse_profile_name(text: str) -> ParsedName:
    """Parse a MIG profile name; raise :class:`UnknownProfileError` naming the problem."""
    s = text.strip().lower()
    for prefix in ("nvidia.com/", "mig-"):
        if s.startswith(prefix):
            s = s[len(prefix) :]
    m = _NAME.match(s)
    if m is None:
        raise errors.UnknownProfileError(
            f"{text!r} is not a MIG profile name (expected e.g. 1g.10gb, 3g.40gb, 1g.10gb+me)"
        )
    g = int(m["g"])
    if g == 0 or int(m["gb"]) == 0:
        raise errors.UnknownProfileError(f"{text!r} is not a MIG profile name (zero size)")
    return ParsedName(
        compute=int(m["c"]) if m["c"] else None,
        g=g,
        gb=int(m["gb"]),
        attribute=_ATTRS[m["attr"]],
    )


def gfd_sanitise(name: str) -> str:
    """A product name as gpu-feature-discovery puts it in a label value (spaces -> ``-``)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", name.strip().replace(" ", "-"))
