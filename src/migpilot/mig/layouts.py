"""MIG layouts: which sets of GPU instances a GPU can hold at once, and where they go.

A layout is a set of instances ``(profile, start)`` on one GPU. It is valid when every start is
an allowed placement of its profile, no two instances share a memory slot, the compute slices
add up to at most the GPU's, at most one instance takes the media extensions (``+me``), each
profile's max-instance count holds, and the GPU's max instance count holds.

The planner asks these questions millions of times, so each GPU model gets a
:class:`Geometry` once (placements as memory bitmasks, profiles as small integers) and the
searches run on integers. Everything here is pure: frozen values in, frozen values out.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from migpilot import digits, errors
from migpilot.mig import profiles


class Instance(NamedTuple):
    """One GPU instance: a profile (canonical name) at a start memory slot.

    A named tuple rather than a dataclass: instances are hashed, compared and sorted in the
    planner's inner loops, and tuples do that in C. Ordered by start slot.
    """

    start: int
    profile: str

    def __str__(self) -> str:
        return f"{self.profile}@{self.start}"


@dataclass(frozen=True, slots=True)
class Layout:
    """A set of instances on one GPU, kept sorted by start slot."""

    instances: tuple[Instance, ...]

    @staticmethod
    def of(instances: Iterable[Instance]) -> Layout:
        """A layout of these instances, in canonical (start) order."""
        return Layout(tuple(sorted(instances)))

    def profile_counts(self) -> Counter[str]:
        """How many instances of each profile the layout holds."""
        return Counter(i.profile for i in self.instances)

    def __str__(self) -> str:
        return " ".join(str(i) for i in self.instances) or "(empty)"

    def __len__(self) -> int:
        return len(self.instances)


@dataclass(frozen=True, slots=True)
class Footprint:
    """What a profile at one of its placements (a start NVIDIA allows) occupies: its memory
    slots as a bit mask, its compute slices and the media engine, precomputed as integers for
    the searches. (A pod's placement on a node is :class:`migpilot.planning.plans.Placement`.)"""

    profile: int
    """Index into :attr:`Geometry.profiles`."""
    start: int
    mask: int
    """Memory slots occupied, one bit per slot."""
    compute: int
    media: bool


class Geometry:
    """The placement tables of one GPU model; build it with :func:`geometry` (cached)."""

    def __init__(self, model: profiles.GpuModel) -> None:
        self.model = model
        self.profiles = model.profiles
        self.index = {p.name: i for i, p in enumerate(model.profiles)}
        self.max_instances = tuple(p.max_instances for p in model.profiles)
        self.area = tuple(p.memory_slots * p.compute_slices for p in model.profiles)
        self.compute = tuple(p.compute_slices for p in model.profiles)
        self.slots = tuple(p.memory_slots for p in model.profiles)
        self.media = tuple(int(p.media_extension) for p in model.profiles)
        placements: list[Footprint] = []
        for i, p in enumerate(model.profiles):
            for s in p.placements:
                mask = ((1 << p.memory_slots) - 1) << s
                placements.append(Footprint(i, s, mask, p.compute_slices, p.media_extension))
        # Start order, larger first at the same start: enumeration output reads naturally.
        placements.sort(
            key=lambda pl: (pl.start, -self.profiles[pl.profile].memory_slots, pl.profile)
        )
        self.placements = tuple(placements)
        self.by_profile = tuple(
            tuple(pl for pl in placements if pl.profile == i) for i in range(len(model.profiles))
        )
        self._by_key = {(pl.profile, pl.start): pl for pl in placements}

    def placement(self, instance: Instance) -> Footprint:
        """The footprint of an instance's placement; raise :class:`LayoutError` if it is not
        allowed."""
        idx = self.index.get(instance.profile)
        if idx is None:
            raise errors.UnknownProfileError(
                f"{self.model.id} has no MIG profile {instance.profile!r}"
            )
        pl = self._by_key.get((idx, instance.start))
        if pl is None:
            prof = self.profiles[idx]
            allowed = ", ".join(str(s) for s in prof.placements)
            raise errors.LayoutError(
                f"{prof.name} cannot start at memory slot {instance.start} on {self.model.id} "
                f"(allowed starts: {allowed})"
            )
        return pl

    def instance(self, pl: Footprint) -> Instance:
        """The instance a footprint stands for."""
        return Instance(pl.start, self.profiles[pl.profile].name)


@functools.cache
def geometry(model: profiles.GpuModel) -> Geometry:
    """The (cached) placement tables of a GPU model."""
    return Geometry(model)


@dataclass(frozen=True, slots=True)
class _State:
    """Occupancy of a GPU during a search."""

    mask: int
    compute: int
    media: int
    count: int
    per_profile: tuple[int, ...]

    def fits(self, g: Geometry, pl: Footprint) -> bool:
        return (
            not (self.mask & pl.mask)
            and self.compute + pl.compute <= g.model.compute_slices
            and not (pl.media and self.media)
            and self.count < g.model.max_gpu_instances
            and self.per_profile[pl.profile] < g.max_instances[pl.profile]
        )

    def add(self, pl: Footprint) -> _State:
        per = list(self.per_profile)
        per[pl.profile] += 1
        return _State(
            self.mask | pl.mask,
            self.compute + pl.compute,
            self.media + pl.media,
            self.count + 1,
            tuple(per),
        )


def _slots_text(mask: int) -> str:
    slots = [i for i in range(mask.bit_length()) if mask >> i & 1]
    if len(slots) > 1 and slots == list(range(slots[0], slots[-1] + 1)):
        return f"memory slots {slots[0]}-{slots[-1]}"
    return "memory slot" + ("s " if len(slots) > 1 else " ") + ",".join(map(str, slots))


def violation(model: profiles.GpuModel, instances: Iterable[Instance]) -> str | None:
    """Why these instances are not a valid layout of ``model``, or ``None`` when they are.

    Raises :class:`UnknownProfileError` for a profile the GPU does not offer and
    :class:`LayoutError` is never raised: the reason is returned.
    """
    g = geometry(model)
    insts = sorted(instances)
    pls: list[Footprint] = []
    for inst in insts:
        try:
            pls.append(g.placement(inst))
        except errors.LayoutError as e:
            return str(e)
    if _quick_valid(g, pls):
        return None
    for i, a in enumerate(pls):
        for b in pls[i + 1 :]:
            if a.mask & b.mask:
                return (
                    f"{g.instance(a)} and {g.instance(b)} overlap on {_slots_text(a.mask & b.mask)}"
                )
    media = [g.instance(pl) for pl in pls if pl.media]
    if len(media) > 1:
        names = ", ".join(map(str, media))
        return f"at most one media-extension (+me) instance per GPU, got {len(media)}: {names}"
    counts = Counter(pl.profile for pl in pls)
    for idx, n in sorted(counts.items()):
        if n > g.max_instances[idx]:
            prof = g.profiles[idx]
            return f"{n} x {prof.name} exceed its maximum of {prof.max_instances} per GPU"
    compute = sum(pl.compute for pl in pls)
    if compute > model.compute_slices:
        return f"{compute} compute slices exceed the GPU's {model.compute_slices}"
    if len(pls) > model.max_gpu_instances:
        return f"{len(pls)} instances exceed the GPU's maximum of {model.max_gpu_instances}"
    return None


def _quick_valid(g: Geometry, pls: list[Footprint]) -> bool:
    """The same rules as :func:`violation` in one integer pass, without building a reason."""
    mask = compute = media = 0
    per = [0] * len(g.profiles)
    for pl in pls:
        if mask & pl.mask:
            return False
        mask |= pl.mask
        compute += pl.compute
        media += pl.media
        per[pl.profile] += 1
    return (
        compute <= g.model.compute_slices
        and media <= 1
        and len(pls) <= g.model.max_gpu_instances
        and all(n <= cap for n, cap in zip(per, g.max_instances, strict=True))
    )


def validate(model: profiles.GpuModel, instances: Iterable[Instance]) -> Layout:
    """The layout of these instances; raise :class:`LayoutError` naming the conflict if invalid."""
    insts = list(instances)
    reason = violation(model, insts)
    if reason is not None:
        raise errors.LayoutError(reason)
    return Layout.of(insts)


def _state_of(g: Geometry, layout: Layout) -> _State:
    mask = compute = media = 0
    per = [0] * len(g.profiles)
    for inst in layout.instances:
        pl = g.placement(inst)
        mask |= pl.mask
        compute += pl.compute
        media += pl.media
        per[pl.profile] += 1
    return _State(mask, compute, media, len(layout.instances), tuple(per))


def _flexibility(g: Geometry, st: _State) -> int:
    """Single placements that still fit, each weighted by its area (memory x compute slices).

    The tie-breaker that keeps big contiguous regions free: losing the one 7g placement costs
    more than losing several 1g ones. (The same test as :meth:`_State.fits`, inlined: this is
    the planner's hottest loop.)
    """
    if st.count >= g.model.max_gpu_instances:
        return 0
    room = g.model.compute_slices - st.compute
    mask, media, per, caps, area = st.mask, st.media, st.per_profile, g.max_instances, g.area
    total = 0
    for pl in g.placements:
        if (
            not (mask & pl.mask)
            and pl.compute <= room
            and not (pl.media and media)
            and per[pl.profile] < caps[pl.profile]
        ):
            total += area[pl.profile]
    return total


def fitting_profiles(model: profiles.GpuModel, layout: Layout) -> frozenset[str]:
    """Profiles of which one more instance fits beside ``layout`` as it stands (nothing moved)."""
    g = geometry(model)
    st = _state_of(g, layout)
    return frozenset(g.profiles[pl.profile].name for pl in g.placements if st.fits(g, pl))


def free_value(model: profiles.GpuModel, layout: Layout) -> int:
    """How much room a layout leaves, as the area-weighted count of single placements that fit.

    An empty H100 scores 130, a full one 0. The planner uses it to prefer choices that keep large
    regions and whole GPUs free.
    """
    g = geometry(model)
    return _flexibility(g, _state_of(g, layout))


def free_room(model: profiles.GpuModel, layout: Layout) -> tuple[frozenset[str], int]:
    """(:func:`fitting_profiles`, :func:`free_value`) of a layout, sharing one occupancy scan."""
    g = geometry(model)
    st = _state_of(g, layout)
    fits = frozenset(g.profiles[pl.profile].name for pl in g.placements if st.fits(g, pl))
    return fits, _flexibility(g, st)


def _describe(counts: Mapping[str, int]) -> str:
    return " + ".join(f"{n} x {name}" if n > 1 else name for name, n in counts.items())


def place(
    model: profiles.GpuModel,
    wanted: Iterable[str],
    *,
    fixed: Iterable[Instance] = (),
) -> Layout:
    """Find starts for a multiset of profiles, beside instances that must stay where they are.

    ``wanted`` holds canonical profile names, repeated for several instances. Among all valid
    assignments the one that leaves the most single placements possible is chosen (so large
    contiguous regions stay free), ties going to the lowest starts: deterministic. Raises
    :class:`LayoutError` saying why no assignment exists.
    """
    if not isinstance(fixed, frozenset):
        listed = list(fixed)
        fixed = frozenset(listed)
        if len(fixed) != len(listed):
            # Two instances at one place overlap: never merge what the caller listed twice.
            reason = violation(model, listed)
            assert reason is not None  # a repeated instance overlaps itself
            raise errors.LayoutError(reason)
    names = tuple(sorted(wanted))
    layout = _pack(model, _validated(model, fixed), names)
    if layout is None:
        _explain_failure(model, fixed, names)
    assert layout is not None
    return layout


@functools.lru_cache(maxsize=65536)
def _validated(model: profiles.GpuModel, fixed: frozenset[Instance]) -> frozenset[Instance]:
    validate(model, fixed)
    return fixed


def pack(
    model: profiles.GpuModel, wanted: tuple[str, ...], fixed: frozenset[Instance]
) -> Layout | None:
    """:func:`place` for callers that only build valid layouts: ``None`` instead of a reason.

    ``fixed`` must already be a valid layout (it is not checked) and ``wanted`` sorted
    canonical names. The planner's inner loop; cached.
    """
    return _pack(model, fixed, wanted)


@functools.lru_cache(maxsize=262144)
def _pack(
    model: profiles.GpuModel, fixed: frozenset[Instance], names: tuple[str, ...]
) -> Layout | None:
    g = geometry(model)
    mask = compute = media = 0
    per = [0] * len(g.profiles)
    for inst in fixed:
        pl = g.placement(inst)
        mask |= pl.mask
        compute += pl.compute
        media += pl.media
        per[pl.profile] += 1
    wanted: list[int] = []
    for name in names:
        idx = g.index.get(name)
        if idx is None:
            raise errors.UnknownProfileError(f"{model.id} has no MIG profile {name!r}")
        wanted.append(idx)
    # Cheap necessary conditions first.
    if len(fixed) + len(wanted) > model.max_gpu_instances:
        return None
    if compute + sum(g.compute[i] for i in wanted) > model.compute_slices:
        return None
    if mask.bit_count() + sum(g.slots[i] for i in wanted) > model.memory_slots:
        return None
    if media + sum(g.media[i] for i in wanted) > 1:
        return None
    for i in wanted:
        per[i] += 1
        if per[i] > g.max_instances[i]:
            return None
    for i in wanted:
        per[i] -= 1
    # Most constrained first: big profiles have few placements.
    wanted.sort(key=lambda i: (-g.slots[i], -g.compute[i], i))
    n = len(wanted)
    best_key: tuple[int, tuple[int, ...]] | None = None
    best: tuple[Footprint, ...] = ()
    chosen: list[Footprint] = []
    room = model.compute_slices

    def search(k: int, mask: int, compute: int, media: int) -> None:
        nonlocal best_key, best
        if k == n:
            st = _State(mask, compute, media, len(fixed) + n, tuple(per))
            key = (-_flexibility(g, st), tuple(pl.start for pl in chosen))
            if best_key is None or key < best_key:
                best_key, best = key, tuple(chosen)
            return
        idx = wanted[k]
        # Identical copies take increasing starts, so permutations are not revisited.
        floor = chosen[-1].start if k and wanted[k - 1] == idx else -1
        for pl in g.by_profile[idx]:
            if pl.start > floor and not (mask & pl.mask) and compute + pl.compute <= room:
                if pl.media and media:
                    continue
                chosen.append(pl)
                per[idx] += 1
                search(k + 1, mask | pl.mask, compute + pl.compute, media + pl.media)
                per[idx] -= 1
                chosen.pop()

    search(0, mask, compute, media)
    if best_key is None:
        return None
    return Layout.of([*fixed, *(g.instance(pl) for pl in best)])


def _explain_failure(
    model: profiles.GpuModel, fixed: frozenset[Instance], names: tuple[str, ...]
) -> None:
    """Raise :class:`LayoutError` saying why ``names`` cannot be placed beside ``fixed``."""
    g = geometry(model)
    counts = tuple(sorted(Counter(names).items()))
    wanted = [g.index[name] for name, k in counts for _ in range(k)]
    what = _describe(dict(counts))
    beside = " beside the instances already there" if fixed else ""
    _check_totals(g, _state_of(g, Layout.of(fixed)), wanted, what, beside)
    raise errors.LayoutError(
        f"no valid placement of {what} exists on {model.id}{beside} "
        f"(allowed starts: {_starts_text(g, wanted)})"
    )


def _check_totals(g: Geometry, base: _State, wanted: list[int], what: str, beside: str) -> None:
    """Cheap necessary conditions, so the common failures get a precise reason."""
    model = g.model
    media = sum(1 for i in wanted if g.profiles[i].media_extension) + base.media
    if media > 1:
        raise errors.LayoutError(
            f"{what}: at most one media-extension (+me) instance fits on a GPU{beside}"
        )
    per = Counter(wanted)
    for idx, n in sorted(per.items()):
        have = base.per_profile[idx]
        if n + have > g.max_instances[idx]:
            prof = g.profiles[idx]
            extra = f" ({have} already there)" if have else ""
            raise errors.LayoutError(
                f"{n + have} x {prof.name} exceed its maximum of {prof.max_instances} "
                f"per GPU{extra}"
            )
    compute = sum(g.profiles[i].compute_slices for i in wanted)
    free_compute = model.compute_slices - base.compute
    if compute > free_compute:
        raise errors.LayoutError(
            f"{what} need {compute} compute slices, {model.id} has {free_compute} free"
        )
    slots = sum(g.profiles[i].memory_slots for i in wanted)
    free_slots = model.memory_slots - base.mask.bit_count()
    if slots > free_slots:
        raise errors.LayoutError(
            f"{what} need {slots} memory slots, {model.id} has {free_slots} free"
        )
    if len(wanted) + base.count > model.max_gpu_instances:
        raise errors.LayoutError(
            f"{what}: more than {model.max_gpu_instances} instances on one GPU{beside}"
        )


def _starts_text(g: Geometry, wanted: list[int]) -> str:
    seen = dict.fromkeys(wanted)
    return "; ".join(f"{g.profiles[i].name} {g.profiles[i].placements_text()}" for i in seen)


def enumerate_layouts(
    model: profiles.GpuModel,
    *,
    allowed: Iterable[str] | None = None,
    fixed: Iterable[Instance] = (),
    maximal: bool = True,
) -> tuple[Layout, ...]:
    """All layouts that contain ``fixed`` and add instances of ``allowed`` profiles.

    With ``maximal`` (the default) only layouts to which no further allowed instance can be
    added are returned: for the A100-40GB and 1g.5gb, 2g.10gb, 3g.20gb, 4g.20gb, 7g.40gb there
    are 19. With ``fixed`` this is completion: the layouts reachable by only adding instances.
    ``allowed`` defaults to every profile of the GPU. Sorted, deterministic.
    """
    fixed_layout = validate(model, fixed)
    g = geometry(model)
    if allowed is None:
        allowed_idx = frozenset(range(len(g.profiles)))
    else:
        allowed_idx = frozenset(g.index[model.resolve_profile(a).name] for a in allowed)
    return _enumerate_cached(model, fixed_layout, allowed_idx, maximal)


@functools.lru_cache(maxsize=4096)
def _enumerate_cached(
    model: profiles.GpuModel, fixed: Layout, allowed: frozenset[int], maximal: bool
) -> tuple[Layout, ...]:
    g = geometry(model)
    cands = [pl for pl in g.placements if pl.profile in allowed]
    out: list[Layout] = []
    chosen: list[Footprint] = []

    def search(i: int, st: _State) -> None:
        if not maximal or not any(st.fits(g, pl) for pl in cands):
            out.append(Layout.of([*fixed.instances, *(g.instance(pl) for pl in chosen)]))
        for j in range(i, len(cands)):
            pl = cands[j]
            if st.fits(g, pl):
                chosen.append(pl)
                search(j + 1, st.add(pl))
                chosen.pop()

    search(0, _state_of(g, fixed))
    return tuple(sorted(out, key=_layout_order))


def _layout_order(layout: Layout) -> tuple[tuple[int, str], ...]:
    return tuple((i.start, i.profile) for i in layout.instances)


def completions(
    model: profiles.GpuModel, fixed: Iterable[Instance], *, allowed: Iterable[str] | None = None
) -> tuple[Layout, ...]:
    """Maximal layouts reachable from ``fixed`` by adding instances (``fixed`` stays put)."""
    return enumerate_layouts(model, allowed=allowed, fixed=fixed, maximal=True)


def parse_instance(model: profiles.GpuModel, text: str) -> tuple[str, int | None]:
    """Parse ``PROFILE[@START]`` as a user writes it; the profile is resolved tolerantly."""
    name, sep, start = text.partition("@")
    prof = model.resolve_profile(name)
    if not sep:
        return prof.name, None
    try:
        return prof.name, digits.integer(start)
    except ValueError:
        raise errors.LayoutError(f"{text!r}: start slot {start!r} is not a number") from None


def clear_caches() -> None:
    """Forget every cached placement and enumeration (benchmarks measure cold runs with it).

    The geometry tables stay: they are a model's fixed data, built once.
    """
    _validated.cache_clear()
    _pack.cache_clear()
    _enumerate_cached.cache_clear()
