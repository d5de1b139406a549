"""Partitioning policies the simulator compares: which planner runs, and how GPUs start.

- ``migpilot``: the fast planner (``planning/fast.py``) on the whole pending set;
- ``exact``: the CP-SAT planner (small clusters only: it is slow by design);
- ``nos``, ``hami-template``, ``hami-placement``: the re-implemented baselines;
- ``static``: no reconfiguration; every GPU keeps the layout a nvidia-mig-parted config gives
  it (default: NVIDIA's ``all-balanced``, bundled in ``sim/data``);
- ``static-best``: the best single static layout per GPU model for the trace, found by search
  (the strongest static admin; the search is in :mod:`migpilot.sim.simulating`).

Dynamic policies start with every GPU empty (MIG enabled, no instance). Pure core: may import
:mod:`migpilot.errors`, :mod:`migpilot.mig` and :mod:`migpilot.planning`; the bundled config is
package data read with :mod:`importlib.resources`.
"""

from __future__ import annotations

import functools
import importlib.resources
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from migpilot import errors
from migpilot.mig import layouts, migparted, profiles
from migpilot.planning import options, planners, plans, snapshot
from migpilot.sim import clusters

NAMES = ("migpilot", "exact", "nos", "hami-template", "hami-placement", "static", "static-best")
"""Every policy, in the order results are shown."""
DEFAULT = ("migpilot", "nos", "hami-template", "hami-placement", "static", "static-best")
"""The policies run when none are named (``exact`` is left out: small clusters only)."""
DEFAULT_UNIFIED = ("migpilot", "hami-placement")
"""The policies run on unified (HAMi-style) requests when none are named: the systems that
serve them by choosing the slice (nos serves none; the others are in :data:`NAMES`)."""
DEFAULT_STATIC_CONFIG = "all-balanced"
EXACT_MAX_GPUS = 32
"""The largest cluster the ``exact`` policy accepts."""
EXACT_TIME_LIMIT_S = 2.0
"""Solver time per planning round for the ``exact`` policy."""
_PLANNER_OF = {
    "migpilot": "fast",
    "exact": "exact",
    "nos": "nos",
    "hami-template": "hami-template",
    "hami-placement": "hami-placement",
}

GATED = frozenset({"migpilot", "exact"})
"""The policies whose pods wait for their plan (migpilot's planners, behind its webhook)."""

StaticLayouts = Mapping[str, tuple[layouts.Layout, ...]]
"""Per GPU model id, the layout of each GPU index of a node."""


@dataclass(frozen=True, slots=True)
class Partitioning:
    """A named partitioning policy: the planner it runs and the layouts GPUs start with (not
    :class:`migpilot.planning.scoring.Policy`, binpack or spread among equal choices)."""

    name: str
    planner: str | None
    """Key of :data:`planners.PLANNERS`; ``None``: the policy never reconfigures."""
    start: StaticLayouts = field(default_factory=lambda: MappingProxyType({}))
    """The layout GPUs start with, per model (absent: empty)."""
    options: options.Options = field(default_factory=options.Options)
    """Planner settings (the exact policy's time limit)."""
    gated: bool = False
    """Pods wait for the policy's plan, as migpilot's webhook gates them (migpilot's own
    planners); ``False``: kube-scheduler binds a pod to free advertised instances as it comes
    and the policy plans for the pods left, as nos and HAMi run (they gate nothing)."""

    def initial_layout(self, model: profiles.GpuModel, index: int) -> layouts.Layout:
        """The layout GPU ``index`` of a node of ``model`` starts with."""
        per_index = self.start.get(model.id)
        if not per_index:
            return layouts.Layout(())
        return per_index[index % len(per_index)]

    def plan(self, snap: snapshot.Snapshot) -> plans.Plan | None:
        """The policy's plan for the pending pods of ``snap`` (``None``: it never plans)."""
        if self.planner is None:
            return None
        return planners.run(snap, self.planner, self.options)


def parse_names(text: str) -> tuple[str, ...]:
    """A comma-separated policy list, checked; order and duplicates as :data:`NAMES`."""
    wanted = [t.strip() for t in text.split(",") if t.strip()]
    if not wanted:
        raise errors.MigpilotError("no policy named (known: " + ", ".join(NAMES) + ")")
    for name in wanted:
        if name not in NAMES:
            raise errors.MigpilotError(f"unknown policy {name!r} (known: {', '.join(NAMES)})")
    return tuple(n for n in NAMES if n in wanted)


def dynamic(name: str, cluster: clusters.Cluster) -> Partitioning:
    """One of the planner-driven policies."""
    planner = _PLANNER_OF.get(name)
    if planner is None:
        raise errors.MigpilotError(f"{name!r} is not a planner-driven policy")
    if name == "exact":
        if cluster.gpu_count > EXACT_MAX_GPUS:
            raise errors.MigpilotError(
                f"policy exact is for clusters of at most {EXACT_MAX_GPUS} GPUs "
                f"(this one has {cluster.gpu_count}); leave it out or use a smaller --cluster"
            )
        return Partitioning(
            name,
            planner,
            options=options.Options(time_limit_s=EXACT_TIME_LIMIT_S),
            gated=True,
        )
    return Partitioning(name, planner, gated=name in GATED)


@functools.cache
def bundled_config() -> migparted.ConfigFile:
    """NVIDIA's ``all-balanced`` config, as shipped in nvidia-mig-parted's default file."""
    files = importlib.resources.files("migpilot.sim")
    text = files.joinpath("data/mig-parted-all-balanced.yaml").read_text(encoding="utf-8")
    return migparted.parse(text, source="all-balanced (bundled)")


def static(
    cluster: clusters.Cluster,
    *,
    config: migparted.ConfigFile | None = None,
    config_name: str = DEFAULT_STATIC_CONFIG,
) -> Partitioning:
    """The ``static`` policy: GPUs keep the layouts ``config_name`` of ``config`` gives them."""
    cfg = config if config is not None else bundled_config()
    start: dict[str, tuple[layouts.Layout, ...]] = {}
    for group in cluster.groups:
        if group.model.id in start:
            continue
        placed = migparted.layout_for(cfg, config_name, model=group.model, gpus=group.gpus)
        start[group.model.id] = tuple(p.layout for p in placed)
    return Partitioning("static", None, MappingProxyType(start))


def fixed(name: str, start: Mapping[str, layouts.Layout]) -> Partitioning:
    """A static policy giving every GPU of a model one layout."""
    return Partitioning(name, None, MappingProxyType({m: (lay,) for m, lay in start.items()}))


def static_candidates(
    model: profiles.GpuModel, demand: Mapping[str, int], *, gpus: int, count: int
) -> tuple[layouts.Layout, ...]:
    """The ``count`` maximal layouts of ``model`` that best cover ``demand`` (instances wanted
    per profile name), replicated over ``gpus`` GPUs: ranked by the compute slices they could
    serve, then by how few slices they leave that nobody asked for. A cheap first cut for the
    ``static-best`` search, which then simulates the candidates."""
    wanted: Counter[str] = Counter()
    for name, n in demand.items():
        if snapshot.offered(model, name):
            wanted[name] += n
    scored: list[tuple[int, int, tuple[tuple[int, str], ...], layouts.Layout]] = []
    for lay in layouts.enumerate_layouts(model):
        served = unused = 0
        for prof, k in lay.profile_counts().items():
            size = model.profile_named(prof).compute_slices
            take = min(k * gpus, wanted.get(prof, 0))
            served += take * size
            unused += (k * gpus - take) * size
        key = tuple((i.start, i.profile) for i in lay.instances)
        scored.append((-served, unused, key, lay))
    scored.sort(key=lambda s: s[:3])
    return tuple(s[3] for s in scored[:count])
