"""Where desired layouts come from: the node's GpuLayout spec, or mig-parted configs.

With a controller, :func:`from_gpulayout` turns the GpuLayout's spec into a desired layout per GPU
at the exact placements the controller chose, and :func:`protected` names the instances the
GpuLayout says must survive whatever the spec now lists (reserved in the spec, or reported
used or reserved in the last status), which the agent adds to its in-use set.

Without one, static layouts come from mig-parted configs.

Admins who want static layouts already write nvidia-mig-parted config files and select one with
the node label ``nvidia.com/mig.config`` (NVIDIA's mig-manager watches that label). This module
turns a parsed config (:mod:`migpilot.mig.migparted`) and a config name, or the label, into a
:class:`~migpilot.agent.changes.DesiredGpu` per GPU of this node.

The entry for each GPU is chosen as mig-parted does (every entry whose device-filter and devices
match applies in file order, so the last match wins; see ``migparted.entry_for``), per GPU, by
that GPU's own PCI id as the backend reads it (device and board subsystem ids), so nodes mixing
GPU models work and an entry written for one board is not applied to its sibling boards. A GPU
that no entry matches is left out (mig-parted apply leaves it as it is). Unlike mig-parted,
which destroys and recreates every instance of a GPU whose layout changes, the placement keeps
the instances already there wherever the wanted multiset allows (in-use ones first), so applying
the same config twice, or a config that differs by one instance, touches nothing else. No I/O:
the caller reads the file and the labels.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Collection, Mapping, Sequence

from migpilot import errors
from migpilot.agent.rules import changes
from migpilot.api import gpulayouts
from migpilot.gpu import backend
from migpilot.mig import catalog, layouts, migparted, profiles

CONFIG_LABEL = "nvidia.com/mig.config"
"""The node label whose value names the mig-parted config to apply."""


def config_name_from_labels(labels: Mapping[str, str]) -> str | None:
    """The config named by the ``nvidia.com/mig.config`` label, or ``None`` without one."""
    value = labels.get(CONFIG_LABEL, "").strip()
    return value or None


def from_labels(
    config: migparted.ConfigFile,
    labels: Mapping[str, str],
    *,
    gpus: Sequence[backend.GpuInfo],
    current: Mapping[int, Sequence[backend.MigDevice]] | None = None,
    in_use: Collection[str] = (),
) -> dict[int, changes.DesiredGpu]:
    """:func:`from_migparted` with the config the node label names (nothing without a label)."""
    name = config_name_from_labels(labels)
    if name is None:
        return {}
    return from_migparted(config, name, gpus=gpus, current=current, in_use=in_use)


def from_migparted(
    config: migparted.ConfigFile,
    name: str,
    *,
    gpus: Sequence[backend.GpuInfo],
    current: Mapping[int, Sequence[backend.MigDevice]] | None = None,
    in_use: Collection[str] = (),
) -> dict[int, changes.DesiredGpu]:
    """The desired layout of each GPU under config ``name``.

    ``current`` (the MIG devices there now) and ``in_use`` steer placement towards keeping
    existing instances. Raises :class:`ConfigError` for an unknown config name or an entry
    that cannot be placed on a GPU it matches.
    """
    entries = migparted.selected(config, name)
    out: dict[int, changes.DesiredGpu] = {}
    for info in gpus:
        if info.model is None:
            continue
        # A backend that cannot read the id gets the model's ids with an unknown board.
        ids = (info.pci_id,) if info.pci_id is not None else migparted.model_pci_ids(info.model)
        chosen = migparted.entry_for(entries, pci_ids=ids, index=info.index)
        if chosen is None:
            continue
        entry = entries[chosen]
        if not entry.mig_enabled:
            out[info.index] = changes.DesiredGpu(mig_enabled=False)
            continue
        existing = (current or {}).get(info.index, ())
        where = f"{config.source}: config {name!r} entry {chosen}"
        try:
            names = [
                migparted.resolve_profile(info.model, t).name
                for t, n in entry.wanted()
                for _ in range(n)
            ]
            layout = place_keeping(info.model, names, existing=existing, in_use=in_use)
        except (errors.UnknownProfileError, errors.LayoutError) as e:
            raise errors.ConfigError(
                f"{where} cannot be placed on GPU {info.index} ({info.model.id}): {e}"
            ) from None
        out[info.index] = changes.DesiredGpu(mig_enabled=True, layout=layout)
    return out


def place_keeping(
    model: profiles.GpuModel,
    names: Sequence[str],
    *,
    existing: Sequence[backend.MigDevice] = (),
    in_use: Collection[str] = (),
) -> layouts.Layout:
    """Place the multiset ``names``, keeping as many existing instances where they are as fits.

    Existing instances of a wanted profile are kept greedily, in-use ones first, then by start,
    each only if the rest of the multiset still places beside those kept; the rest is placed by
    :func:`layouts.place`. Raises :class:`LayoutError` when the multiset cannot be placed at all.
    """
    order = sorted(
        {d.instance: d for d in existing}.values(),
        key=lambda d: (d.uuid is None or d.uuid not in in_use, d.start, d.profile),
    )
    remaining = collections.Counter(names)
    kept: list[layouts.Instance] = []
    for dev in order:
        inst = dev.instance
        if remaining[inst.profile] <= 0:
            continue
        rest = remaining.copy()
        rest[inst.profile] -= 1
        fixed = frozenset([*kept, inst])
        if layouts.violation(model, fixed) is not None:
            continue
        if layouts.pack(model, tuple(sorted(rest.elements())), fixed) is not None:
            kept.append(inst)
            remaining = rest
    return layouts.place(model, list(remaining.elements()), fixed=kept)


def from_gpulayout(
    spec: gpulayouts.LayoutSpec, *, gpus: Sequence[backend.GpuInfo]
) -> dict[int, changes.DesiredGpu]:
    """The desired layout of each GPU the spec lists, at the spec's placements.

    GPUs the spec does not list are left alone, and so are those it gives MPS slices
    (``mps``; the slices are served by :mod:`~migpilot.agent.sharing.slicing`, never by changing the
    MIG mode) and those with MIG disabled it gives no instance (an MPS GPU whose slices are all
    gone asks for nothing). Raises :class:`ConfigError` when the spec names
    a GPU index this node lacks, a model other than the GPU's, or a layout the GPU cannot hold
    (then the caller keeps its last good layout).
    """
    by_index = {g.index: g for g in gpus}
    out: dict[int, changes.DesiredGpu] = {}
    for g in spec.gpus:
        where = f"spec.gpus[index={g.index}]"
        info = by_index.get(g.index)
        if info is None:
            raise errors.ConfigError(f"{where}: this node has no GPU {g.index}")
        if info.model is None:
            raise errors.ConfigError(f"{where}: {info.product_name} is not a GPU migpilot knows")
        if g.model is not None:
            try:
                model = catalog.resolve_gpu(g.model)
            except errors.UnknownGpuError as err:
                raise errors.ConfigError(f"{where}.model: {err}") from None
            if model.id != info.model.id:
                raise errors.ConfigError(
                    f"{where}.model: {g.model!r}, but GPU {g.index} is {info.model.id}"
                )
        if g.mig is False:
            # A mode change asked for: the diff refuses it unless the node is dynamic.
            out[g.index] = changes.DesiredGpu(mig_enabled=False)
            continue
        mig_off = info.mig is None or not info.mig.current
        if g.mps or (mig_off and not g.instances and g.mig is None):
            continue
        insts = [layouts.Instance(i.start, i.profile) for i in g.instances]
        try:
            reason = layouts.violation(info.model, insts)
        except errors.UnknownProfileError as err:
            reason = str(err)
        if reason is not None:
            raise errors.ConfigError(f"{where}: not a valid layout of {info.model.id}: {reason}")
        out[g.index] = changes.DesiredGpu(mig_enabled=True, layout=layouts.Layout.of(insts))
    return out


def protected(
    layout: gpulayouts.GpuLayout, *, current: Mapping[int, Sequence[backend.MigDevice]]
) -> frozenset[str]:
    """MIG device UUIDs the GpuLayout says must not be destroyed, whatever its spec lists.

    An instance the spec reserves for a pod (matched by GPU, start and profile), and one the
    last status reported ``used``, ``reserved`` or ``creating``: the controller may have dropped
    it from the spec while a pod holds it, and the CRD lets such an instance only become free
    before it is destroyed (the agent reports it free first, then destroys it at a later pass).
    """
    reserved = {
        (g.index, i.start, i.profile)
        for g in layout.spec.gpus
        for i in g.instances
        if i.reserved_for is not None
    }
    out = {
        d.uuid
        for index, devs in current.items()
        for d in devs
        if d.uuid is not None and (index, d.start, d.profile) in reserved
    }
    if layout.status is not None:
        out.update(
            i.uuid
            for g in layout.status.gpus
            for i in g.instances
            if i.uuid is not None and i.state in gpulayouts.UNTOUCHABLE
        )
    return frozenset(out)


def for_dra(
    spec: gpulayouts.LayoutSpec, *, current: Mapping[int, Sequence[backend.MigDevice]]
) -> gpulayouts.LayoutSpec:
    """The part of ``spec`` the agent acts on when its node is in DRA mode (``docs/dra.md``).

    There the spec is the planner's target for the node: its placements are what kube-scheduler
    should allocate to pods' claims, and the DRA plugin makes each at NodePrepareResources for
    the claim allocated it. So the agent makes none of them, reserved for a pod or not (the
    controller writes a DRA node's target without reservations: kube-scheduler, not the agent,
    hands a placement to a pod); its publisher lists them first instead. An instance of the
    spec that exists already is kept, as free (never protected or reported reserved, which
    would take the placement from the scheduler, :mod:`migpilot.agent.dra.publishing`): the
    claim allocated it adopts it. A free instance the spec no longer holds is destroyed as on
    any node (the planner gave its room to other placements)."""
    gpus = []
    for gpu in spec.gpus:
        there = {(d.start, d.profile) for d in current.get(gpu.index, ())}
        instances = tuple(
            gpulayouts.InstanceSpec(i.profile, i.start)
            for i in gpu.instances
            if (i.start, i.profile) in there
        )
        gpus.append(dataclasses.replace(gpu, instances=instances))
    return gpulayouts.LayoutSpec(tuple(gpus))
