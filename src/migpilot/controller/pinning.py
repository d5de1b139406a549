"""What the controller writes: GpuLayout specs with reservations, and the patches that pin a pod.

Why it exists: every write the controller makes is decided here, as data, so the rules that
keep the cluster safe are tested without a server:

- :func:`spec_for` turns a plan into a node's spec in one pass: the target layouts, the
  reservations the plan makes, and those of the pods still waiting for instances an earlier
  plan gave them (the planner saw those as used, so they are in its target layout);
- :func:`without_stale` drops reservations whose pods are gone, done or bound;
- :func:`to_control` reads the cluster for the loop's step (:func:`control.reconcile`, which
  decides when a reserved pod is let go): what each reservation still waits for on its node
  (:func:`missing`: every instance made, the agent reporting it with a UUID), what it asks of
  the node's advertised resources (:func:`asks`) and what bound pods and pods already let go
  take of them (:func:`taken`, kube-scheduler's own count, so the pod binds at once instead of
  waiting out the scheduler's back-off);
- :func:`listed` tells when a DRA node's agent lists the target written for it, so the pods the
  plan steers there may be pinned;
- :func:`pin_patch` narrows a gated pod's required node affinity to that node and removes the
  gate (a JSON patch; narrowing is what the API allows on a gated pod); :func:`ungate_patch`
  removes the gate alone (for a pod no plan can serve, so kube-scheduler reports it too).

Pure: no client, no clock. May import :mod:`migpilot.api`, :mod:`migpilot.planning` and this
package's pure modules.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from migpilot import errors
from migpilot.api import gpulayouts
from migpilot.controller import observing
from migpilot.mig import catalog, layouts, profiles
from migpilot.planning import constraints, control, modes, plans, snapshot
from migpilot.sharing import config as sharing_config
from migpilot.sharing import mps as sharing_mps

_V = TypeVar("_V")

Patch = list[dict[str, Any]]
"""A JSON patch (RFC 6902)."""


def spec_for(
    node: snapshot.Node,
    plan: plans.Plan,
    *,
    kept: Mapping[tuple[int, int, str], str],
    unified: frozenset[str] = frozenset(),
    layout: gpulayouts.GpuLayout | None = None,
    unreserved: frozenset[str] = frozenset(),
) -> gpulayouts.LayoutSpec:
    """The spec the controller writes for ``node`` after ``plan``, in one pass: each GPU's
    target layout (or, on an MPS GPU, its target slices) from the plan, with ``reservedFor`` on
    the instances and slices the plan gives to pending pods and on the instances the target
    layout still holds that the ``kept`` reservations ((GPU, start, profile) -> pod) of earlier
    plans name (the planner saw those as used, so they are in its target layout). An instance
    or MPS slice reserved for a pod of ``unified`` is marked ``resource: nvidia.com/gpu``: the
    agent advertises it so (``docs/unified.md``). On a node in mode ``time-slicing``, each
    replica the plan gives a pod is a free one of its GPU in ``layout``'s status (the lowest id
    neither used nor kept), reserved beside the replicas its spec keeps for live pods (``kept``
    names those as (GPU, ``-1 - id``, ``"replica"``): :func:`kept_of`). On a dynamic node,
    each whole GPU the plan gives a whole-GPU pod, or a ``kept`` one ((GPU, 0, ``"whole"``)),
    is written ``mig: false`` with ``reservedFor`` (``docs/migmode.md``). The instances the plan
    gives a pod of ``unreserved`` (pods asking through DRA claims) are written without
    ``reservedFor``: they are the target kube-scheduler is steered to, which hands them out
    itself (``docs/dra.md``).

    Raise :class:`GpuLayoutError` if the plan gives a pod an instance its target layout lacks,
    one instance or whole GPU to two pods, or a GPU in MIG mode after the plan as a whole GPU (a
    planner bug: such a spec must never be written).
    """
    given: dict[tuple[int, int], str] = {}
    for placement in plan.placements:
        if placement.node != node.name:
            continue
        for a in placement.instances:
            key = (a.gpu, a.start)
            if key in given:
                raise errors.GpuLayoutError(
                    f"plan: {a.profile}@{a.start} on GPU {a.gpu} of {node.name} given to both "
                    f"{given[key]} and {placement.pod}"
                )
            given[key] = placement.pod
    whole = _whole_given(plan, node, kept=kept)
    models = {g.index: g.model.id for g in node.gpus}
    if node.mode is modes.Mode.TIME_SLICING:
        return gpulayouts.LayoutSpec(_replica_specs(plan, node, models=models, kept=kept,
                                                    layout=layout))  # fmt: skip
    gpus = _mps_specs(plan, node, models=models, unified=unified)
    targets: dict[tuple[int, int], str] = {}
    sliced = {g.index for g in gpus}
    # Dynamic MIG mode (docs/migmode.md): on a dynamic node every GPU's mode after the plan is
    # written (its switch, else the mode it has); on any other node none, as before.
    switched = {s.gpu: s.mig for s in plan.switches if s.node == node.name}
    modes_after: dict[int, bool] = (
        {g.index: switched.get(g.index, g.mig) for g in node.gpus} if node.dynamic else {}
    )
    for gpu, holder in sorted(whole.items()):
        if modes_after.get(gpu, True):
            raise errors.GpuLayoutError(
                f"plan: {holder} is given GPU {gpu} of {node.name} whole, which is not whole after "
                "the plan"
            )
    for gp in plan.gpus:
        if gp.node != node.name or gp.gpu in sliced:  # an MPS GPU holds no MIG instances
            continue
        instances = []
        for i in gp.layout.instances:
            targets[(gp.gpu, i.start)] = i.profile
            pod = given.get((gp.gpu, i.start)) or kept.get((gp.gpu, i.start, i.profile))
            if pod in unreserved:
                pod = None
            instances.append(
                gpulayouts.InstanceSpec(i.profile, i.start, pod, _resource(pod, unified))
            )
        gpus.append(
            gpulayouts.GpuSpec(
                gp.gpu,
                models.get(gp.gpu),
                tuple(instances),
                mig=modes_after.get(gp.gpu),
                reserved_for=whole.get(gp.gpu),
            )
        )
    for placement in plan.placements:
        for a in placement.instances:
            if placement.node == node.name and targets.get((a.gpu, a.start)) != a.profile:
                raise errors.GpuLayoutError(
                    f"plan: {placement.pod} is given {a.profile}@{a.start} on GPU {a.gpu} of "
                    f"{node.name}, which its target layout does not hold"
                )
    return gpulayouts.LayoutSpec(tuple(sorted(gpus, key=lambda g: g.index)))


REPLICA = "replica"
"""The profile :func:`kept_of` gives a kept time-slicing replica."""
WHOLE = "whole"
"""The profile :func:`kept_of` gives a kept whole GPU (at start 0)."""


def _whole_given(
    plan: plans.Plan, node: snapshot.Node, *, kept: Mapping[tuple[int, int, str], str]
) -> dict[int, str]:
    """GPU index -> the pod each whole GPU of ``node`` is kept for: the ``kept`` ones, then
    those the plan gives. Raise :class:`GpuLayoutError` for a GPU given to two pods."""
    out = {gpu: pod for (gpu, _, kind), pod in kept.items() if kind == WHOLE}
    for placement in plan.placements:
        if placement.node != node.name:
            continue
        for gpu in placement.gpus:
            if gpu in out and out[gpu] != placement.pod:
                raise errors.GpuLayoutError(
                    f"plan: whole GPU {gpu} of {node.name} given to both {out[gpu]} and "
                    f"{placement.pod}"
                )
            out[gpu] = placement.pod
    return out


def kept_of(
    reservations: Iterable[observing.Reservation], node: str
) -> dict[tuple[int, int, str], str]:
    """The ``kept`` of :func:`spec_for` for ``node``: the instances and time-slicing replicas
    (as (GPU, ``-1 - id``, :data:`REPLICA`)) its live ``reservations`` keep, by pod."""
    out: dict[tuple[int, int, str], str] = {}
    for r in reservations:
        if r.node != node:
            continue
        out.update(dict.fromkeys(r.instances, r.pod))
        out.update({(g, -1 - i, REPLICA): r.pod for g, i in r.replicas})
        out.update({(g, 0, WHOLE): r.pod for g in r.gpus})
    return out


def _replica_specs(
    plan: plans.Plan,
    node: snapshot.Node,
    *,
    models: Mapping[int, str],
    kept: Mapping[tuple[int, int, str], str],
    layout: gpulayouts.GpuLayout | None,
) -> tuple[gpulayouts.GpuSpec, ...]:
    """The GPUs of a time-slicing ``node`` with the replicas kept for pods: the ``kept`` ones,
    then one free replica per share the plan gives a pod on that GPU. Raise
    :class:`GpuLayoutError` for a share on a GPU without a free replica (a planner bug, or a
    status the planner did not see)."""
    reserved: dict[int, dict[int, str]] = {}
    for (gpu, at, kind), pod in kept.items():
        if kind == REPLICA:
            reserved.setdefault(gpu, {})[-1 - at] = pod
    free: dict[int, list[int]] = {}
    for g in layout.status.gpus if layout is not None and layout.status is not None else ():
        taken = reserved.get(g.index, {})
        free[g.index] = [
            r.id
            for r in g.replicas
            if r.state is not gpulayouts.InstanceState.USED and r.id not in taken
        ]
    for placement in plan.placements:
        if placement.node != node.name:
            continue
        for share in placement.shares:
            left = free.get(share.gpu, [])
            if not left:
                raise errors.GpuLayoutError(
                    f"plan: {placement.pod} is given a replica of GPU {share.gpu} of "
                    f"{node.name}, which has no free replica"
                )
            reserved.setdefault(share.gpu, {})[left.pop(0)] = placement.pod
    return tuple(
        gpulayouts.GpuSpec(
            index,
            models.get(index),
            (),
            replicas=tuple(gpulayouts.ReplicaSpec(i, pod) for i, pod in sorted(ids.items())),
        )
        for index, ids in sorted(reserved.items())
        if ids
    )


def _resource(pod: str | None, unified: frozenset[str]) -> str | None:
    """``resource`` of an instance or slice reserved for ``pod``: :data:`UNIFIED_RESOURCE` for
    a unified pod, else ``None`` (its MIG profile's or slice size's own resource)."""
    return gpulayouts.UNIFIED_RESOURCE if pod is not None and pod in unified else None


def _mps_specs(
    plan: plans.Plan,
    node: snapshot.Node,
    *,
    models: Mapping[int, str],
    unified: frozenset[str],
) -> list[gpulayouts.GpuSpec]:
    """The MPS GPUs of ``node``: each GPU's target slices from the plan, ``reservedFor`` on the
    slices kept or newly given to pending pods. Raise :class:`GpuLayoutError` for a slice given
    to two pods or a share of a slice the target lacks (a planner bug)."""
    given: dict[tuple[int, int], str] = {}
    for placement in plan.placements:
        if placement.node != node.name:
            continue
        for share in placement.shares:
            if share.slice is None:
                continue
            key = (share.gpu, share.slice)
            if key in given and given[key] != placement.pod:
                raise errors.GpuLayoutError(
                    f"plan: MPS slice {share.slice} on GPU {share.gpu} of {node.name} given to "
                    f"both {given[key]} and {placement.pod}"
                )
            given[key] = placement.pod
    out: list[gpulayouts.GpuSpec] = []
    targets: set[tuple[int, int]] = set()
    gpu_models = {g.index: g.model for g in node.gpus}
    for gp in plan.mps:
        if gp.node != node.name:
            continue
        slices = []
        held: list[gpulayouts.SliceSpec] = []
        for sl in gp.slices:
            targets.add((gp.gpu, sl.id))
            pod = given.get((gp.gpu, sl.id)) or sl.reserved_for or None
            spec = gpulayouts.SliceSpec(sl.id, sl.memory_gb, sl.cores, pod, _resource(pod, unified))
            slices.append(spec)
            if sl.used and pod is None:
                held.append(spec)
        model = gpu_models.get(gp.gpu)
        if model is not None:
            slices = _fitted(slices, held, model=model, where=f"GPU {gp.gpu} of {node.name}")
        out.append(gpulayouts.GpuSpec(gp.gpu, models.get(gp.gpu), (), tuple(slices)))
    missing = sorted(set(given) - targets)
    if missing:
        gpu, ident = missing[0]
        raise errors.GpuLayoutError(
            f"plan: {given[(gpu, ident)]} is given MPS slice {ident} on GPU {gpu} of {node.name}, "
            "which its target slices do not hold"
        )
    return out


def _fitted(
    slices: list[gpulayouts.SliceSpec],
    held: list[gpulayouts.SliceSpec],
    *,
    model: profiles.GpuModel,
    where: str,
) -> list[gpulayouts.SliceSpec]:
    """The slices of one MPS GPU as its spec may list them: within the GPU's memory and MPS
    clients, as the spec's parser (the agent's and the controller's) demands.

    The target slices can exceed the GPU when a pod holds a slice the spec had just dropped
    (the kubelet handed it out before the agent applied the spec): the agent keeps serving a
    held slice with the size it had, so the snapshot counts it, and a spec listing it beside
    the others would be refused by every reader (the soak lost its MPS node so). Held slices
    no reservation names are left out first, largest first (the agent keeps serving them while
    held, and the controller still counts them from the status), then free ones (the agent
    removes them). Raise :class:`GpuLayoutError` if the reserved slices alone exceed it (a
    planner bug: such a spec must never be written)."""
    cap, most = sharing_mps.memory_gb(model), sharing_config.MPS_MAX_CLIENTS

    def fits(kept: list[gpulayouts.SliceSpec]) -> bool:
        return sum(s.memory_gb for s in kept) <= cap and len(kept) <= most

    if fits(slices):
        return slices
    free = [s for s in slices if s.reserved_for is None and s not in held]
    out = list(slices)
    for s in (*sorted(held, key=lambda s: (-s.memory_gb, s.id)),
              *sorted(free, key=lambda s: (-s.memory_gb, s.id))):  # fmt: skip
        out.remove(s)
        if fits(out):
            return out
    raise errors.GpuLayoutError(
        f"plan: the MPS slices reserved on {where} take {sum(s.memory_gb for s in out)} GB "
        f"in {len(out)} slices, more than its {cap} GB or {most} clients"
    )


def repaired(layout: gpulayouts.GpuLayout) -> gpulayouts.LayoutSpec:
    """The spec that replaces one the controller cannot read (over its GPU, a bad profile):
    each GPU the status reports keeps the MIG instances it has (none reserved, none destroyed),
    and its MPS slices and time-slicing replicas are left to the agent (it keeps serving every
    held slice and replica, removes the rest). Reservations the unreadable spec made are gone:
    their pods are planned again. A spec every reader accepts, so the node is planned again at
    once instead of being ignored until someone edits it (the soak lost its MPS node so)."""
    status = layout.status.gpus if layout.status is not None else ()
    return gpulayouts.LayoutSpec(
        tuple(
            gpulayouts.GpuSpec(
                g.index,
                None,
                tuple(
                    gpulayouts.InstanceSpec(i.profile, i.start, None)
                    for i in g.instances
                    if i.state is not gpulayouts.InstanceState.DESTROYING
                ),
            )
            for g in sorted(status, key=lambda g: g.index)
        )
    )


def listed(layout: gpulayouts.GpuLayout | None, spec: gpulayouts.LayoutSpec) -> bool:
    """Whether a DRA node's agent lists ``spec``'s placements first now: the node's GpuLayout
    holds ``spec`` (the same instances, reservations included), its agent has acted on it
    (``status.observedGeneration`` has caught up with ``metadata.generation``; in DRA mode the
    agent publishes its ResourceSlices before it reports) and says it listed the plan first
    (the ``PlanListed`` condition ``True`` at that generation). A pod the plan steers there is
    pinned and let go only then: let go before, kube-scheduler allocates from the old listing
    (first fit, not the plan), as the real scheduler did in ``tests/e2e/test_dra_kube.py``.
    Until then the pod stays gated and is planned again; the agent's report is a change that
    brings the next plan."""
    if layout is None or layout.status is None or layout.generation is None:
        return False
    seen = layout.status.observed_generation
    if seen is None or seen < layout.generation:
        return False
    # And the agent says it listed them: its view of the controller's Lease may be stale (read
    # before this controller took it, and cached), or its slices not written, and then it
    # reports the spec acted on while nothing is listed first.
    said = next((c for c in layout.status.conditions if c.type == gpulayouts.PLAN_LISTED), None)
    if said is None or said.status is not gpulayouts.ConditionStatus.TRUE:
        return False
    if said.observed_generation is None or said.observed_generation < layout.generation:
        return False
    return _instances(layout.spec) == _instances(spec)


def _instances(spec: gpulayouts.LayoutSpec) -> set[tuple[int, int, str, str | None]]:
    return {(g.index, i.start, i.profile, i.reserved_for) for g in spec.gpus for i in g.instances}


def without_stale(spec: gpulayouts.LayoutSpec, *, live: frozenset[str]) -> gpulayouts.LayoutSpec:
    """``spec`` with only the reservations of the ``live`` pods; each GPU keeps the MIG mode
    it asks for (a whole GPU released stays whole)."""
    return gpulayouts.LayoutSpec(
        tuple(
            gpulayouts.GpuSpec(
                g.index,
                g.model,
                tuple(
                    i
                    if i.reserved_for is None or i.reserved_for in live
                    else gpulayouts.InstanceSpec(i.profile, i.start, None)
                    for i in g.instances
                ),
                tuple(
                    sl
                    if sl.reserved_for is None or sl.reserved_for in live
                    else gpulayouts.SliceSpec(sl.id, sl.memory_gb, sl.cores, None)
                    for sl in g.mps
                ),
                tuple(r for r in g.replicas if r.reserved_for in live),
                g.mig,
                g.reserved_for if g.reserved_for in live else None,
            )
            for g in spec.gpus
        )
    )


def to_control(
    observed: observing.Observed, *, changed: bool, listing: bool = False
) -> control.Observed:
    """The cluster as the loop's step reads it (:func:`control.reconcile`): the snapshot, each
    live reservation with what it still waits for, what each node advertises and what is taken
    of it, the waiting pods' pins and static nodes, the unservable pods and the stale nodes.

    A waiting pod's extras and a node's whole CPU and memory are read only for the pods a plan
    leaves (:class:`_Lazily`): built up front they cost every pass a walk of every pending pod
    (and, with static nodes, a fit on each)."""
    statics = any(n.static for n in observed.nodes.values())

    def extras(key: str) -> control.Pending:
        view = observed.pods[key]
        static = observing.static_fit(observed, view) if statics else None
        return control.Pending(
            view.gated_by_us, pinned_to(view), static, unschedulable=view.unschedulable
        )

    planned = {n.name: n for n in observed.snapshot.nodes} if observed.reservations else {}
    return control.Observed(
        snapshot=observed.snapshot,
        reserved={key: _reserved(observed, key, planned) for key in observed.reservations},
        advertised={name: n.allocatable for name, n in observed.nodes.items()},
        taken=taken(observed),
        pending=_Lazily(observed.pods, extras),
        unservable={
            key: view.problem
            for key, view in observed.pods.items()
            if view.problem is not None and view.waiting and view.ignored is None
        },
        unplannable_whole={
            key: view.whole_problem
            for key, view in observed.pods.items()
            if view.whole_problem is not None and view.waiting and view.gated_by_us
        },
        stale=observed.stale,
        changed=changed,
        listing=listing,
        whole=_Lazily(observed.nodes, lambda name: _whole(observed.nodes[name])),
        dra_claims=observed.dra_claims,
    )


class _Lazily(Mapping[str, _V]):
    """A read-only mapping over ``keys`` whose values are computed when first read, then kept:
    the same answers as a dict built up front, paid for only where read."""

    def __init__(self, keys: Mapping[str, object], value: Callable[[str], _V]) -> None:
        self._keys = keys
        self._value = value
        self._seen: dict[str, _V] = {}

    def __getitem__(self, key: str) -> _V:
        if key not in self._keys:
            raise KeyError(key)
        if key not in self._seen:
            self._seen[key] = self._value(key)
        return self._seen[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def _whole(node: observing.NodeView) -> snapshot.Resources | None:
    """The node's whole CPU and memory, as :func:`control.never_runs` sees it empty."""
    cpu, mem = node.allocatable.get("cpu"), node.allocatable.get("memory")
    if cpu is None and mem is None:
        return None
    return snapshot.Resources(cpu if cpu is not None else 2**62, mem if mem is not None else 2**62)


def _reserved(
    observed: observing.Observed, key: str, planned: Mapping[str, snapshot.Node]
) -> control.Reserved:
    r = observed.reservations[key]
    view = observed.pods[key]
    node = planned.get(r.node)
    turned_away = None
    planned_pod = view.planned
    if view.gated_by_us and node is not None and node.gpus and planned_pod is not None:
        turned_away = constraints.rejection(node, planned_pod)
    interchange = None
    if view.unified:
        layout = observed.layouts.get(r.node)
        interchange = control.Interchange(
            signature(observed, key),
            allocating=(
                not view.gated_by_us
                and layout is not None
                and not gpulayouts.allocated(layout, key)
            ),
        )
    return control.Reserved(
        node=r.node,
        gated=view.gated_by_us,
        made=made(observed, key),
        missing=missing(observed, key),
        asks=asks(view),
        pinned_there=not view.gated_by_us and pinned_to(view) == r.node,
        stolen=stolen(observed, key),
        unified=interchange,
        turned_away=turned_away,
    )


def asks(view: observing.PodView) -> tuple[tuple[str, int], ...]:
    """What kube-scheduler counts of a node's resources for the pod: MIG instances by
    resource (``nvidia.com/mig-1g.10gb``), MPS slices by resource (``nvidia.com/gpu-10gb``),
    a unified pod's ``nvidia.com/gpu`` devices, and a whole-GPU pod's whole GPUs (also
    ``nvidia.com/gpu``)."""
    out = [(snapshot.resource_name(p), n) for p, n in sorted(view.mig.items())]
    out += sorted(view.mps.items())
    if view.unified:
        out.append((gpulayouts.UNIFIED_RESOURCE, view.gpus))
    elif view.whole_pod is not None:
        out.append((gpulayouts.UNIFIED_RESOURCE, view.whole_gpus))
    return tuple(out)


def taken(observed: observing.Observed) -> dict[str, Counter[str]]:
    """Per node, what kube-scheduler counts as taken or about to be, by resource (see
    :func:`asks`): of the pods bound there and of the reserved pods already let go (not
    gated)."""
    out: dict[str, Counter[str]] = {}

    def add(node: str, amounts: Mapping[str, int]) -> None:
        out.setdefault(node, Counter()).update(amounts)

    for node, bound in observed.bound.items():
        add(node, {snapshot.resource_name(p): n for p, n in bound.items()})
    for node, gpus in observed.bound_gpus.items():
        add(node, {gpulayouts.UNIFIED_RESOURCE: gpus})
    for node, gpus in observed.bound_whole.items():  # kube-scheduler counts them too
        add(node, {gpulayouts.UNIFIED_RESOURCE: gpus})
    for r in observed.reservations.values():
        view = observed.pods.get(r.pod)
        if view is not None and not view.gated_by_us and view.node is None:
            add(r.node, dict(asks(view)))
    return out


def signature(observed: observing.Observed, pod_key: str) -> tuple[object, ...]:
    """A unified pod's asks, container by container, and the profiles (and MPS slice sizes)
    reserved for it: pods with equal signatures are interchangeable for the kubelet's
    Allocate."""
    view = observed.pods.get(pod_key)
    r = observed.reservations.get(pod_key)
    profiles = tuple(sorted(p for _, _, p in r.instances)) if r is not None else ()
    sizes = tuple(sorted(gb for _, _, gb in r.slices)) if r is not None else ()
    replicas = len(r.replicas) if r is not None else 0
    return (view.signature if view is not None else (), profiles, sizes, replicas)


def pinned_to(view: observing.PodView) -> str | None:
    """The node a pod's required node affinity confines it to by name (every term names the
    same one node, as :func:`pin_patch` leaves it), or ``None`` (:func:`observing.pinned_node`;
    a pod with DRA claims by its own affinity).

    Such a pod can be bound nowhere else: its reservation there must outlive any wait."""
    pod = view.planned or view.dra_base
    return observing.pinned_node(pod) if pod is not None else None


def _existing(layout: gpulayouts.GpuLayout) -> set[tuple[int, int, str]]:
    """(GPU, start, profile) of the instances the agent reports made: with a UUID, neither
    being created nor destroyed."""
    assert layout.status is not None
    return {
        (g.index, i.start, i.profile)
        for g in layout.status.gpus
        for i in g.instances
        if i.uuid
        and i.state not in (gpulayouts.InstanceState.CREATING, gpulayouts.InstanceState.DESTROYING)
    }


def made(observed: observing.Observed, pod_key: str) -> bool:
    """Whether every instance reserved for ``pod_key`` exists (reported with a UUID, neither
    being created nor destroyed)."""
    r = observed.reservations.get(pod_key)
    layout = observed.layouts.get(r.node) if r is not None else None
    if r is None or layout is None or layout.status is None:
        return False
    have = _existing(layout)
    served = _served_slices(layout)
    advertised = _replicas(layout)
    whole = whole_now(layout)
    return (
        all(i in have for i in r.instances)
        and all(sl in served for sl in r.slices)
        and all(rep in advertised for rep in r.replicas)
        and all(g in whole for g in r.gpus)
    )


def whole_now(layout: gpulayouts.GpuLayout) -> set[int]:
    """Indexes of the GPUs the agent reports whole: MIG off (``migMode.current: false``, no
    change pending) and no instance left (``docs/migmode.md``)."""
    assert layout.status is not None
    return {
        g.index
        for g in layout.status.gpus
        if g.mig_mode is not None
        and not g.mig_mode.current
        and not g.mig_mode.pending
        and not g.instances
    }


def _replicas(layout: gpulayouts.GpuLayout) -> set[tuple[int, int]]:
    """(GPU, replica id) of the time-slicing replicas the agent reports advertising."""
    assert layout.status is not None
    return {(g.index, r.id) for g in layout.status.gpus for r in g.replicas}


def _served_slices(layout: gpulayouts.GpuLayout) -> set[tuple[int, int, int]]:
    """(GPU, slice id, GB) of the MPS slices the agent reports serving."""
    assert layout.status is not None
    return {(g.index, sl.id, sl.memory_gb) for g in layout.status.gpus for sl in g.mps}


def stolen(observed: observing.Observed, pod_key: str) -> bool:
    """Whether an instance or slice reserved for the unbound pod ``pod_key`` is in use by
    another pod: a pod kube-scheduler bound there without migpilot (created ungated, while the
    webhook was down or timed out) took the capacity the reservation counted on. Also when an
    instance reserved for it is not made yet and another pod uses an instance where it would
    go: the plan counted that one free, and a pod bound there got it since (the kubelet picks
    any free device of a profile; the agent then reports it cannot make the reserved one).
    The reservation can then never be honoured as it stands, even for a pod pinned to the
    node: it must be dropped and the pod planned again (on its node, if pinned), rather than
    wait ten timeouts for an instance that cannot appear while that pod lives. For whole GPUs
    only the count tells (:func:`_whole_overrun`)."""
    r = observed.reservations.get(pod_key)
    view = observed.pods.get(pod_key)
    layout = observed.layouts.get(r.node) if r is not None else None
    if r is None or view is None or view.node is not None or layout is None:
        return False
    if layout.status is None:
        return False
    if r.gpus and _whole_overrun(observed, r.node, layout):
        return True
    wanted = set(r.instances)
    absent = wanted - _existing(layout)
    slices = {(g, i) for g, i, _ in r.slices}
    replicas = set(r.replicas)
    used = gpulayouts.InstanceState.USED
    for g in layout.status.gpus:
        blocked = [(s, p) for gpu, s, p in absent if gpu == g.index]
        for i in g.instances:
            key = (g.index, i.start, i.profile)
            if i.state is not used or i.used_by == pod_key:
                continue
            if key in wanted or (blocked and _overlaps(g.model, (i.start, i.profile), blocked)):
                return True
        for sl in g.mps:
            if (g.index, sl.id) in slices and sl.state is used and sl.used_by != pod_key:
                return True
        for rep in g.replicas:
            if (g.index, rep.id) in replicas and rep.state is used and rep.used_by != pod_key:
                return True
    return False


def _overlaps(model: str, used: tuple[int, str], wanted: Iterable[tuple[int, str]]) -> bool:
    """Whether the instance ``used`` ((start, profile) on a GPU of ``model``) leaves no room for
    one of ``wanted``; an unknown model or profile: not known to, ``False``."""
    try:
        gpu = catalog.resolve_gpu(model)
        return any(
            layouts.violation(gpu, (layouts.Instance(*used), layouts.Instance(*w))) is not None
            for w in wanted
        )
    except errors.MigpilotError:
        return False


def _whole_overrun(observed: observing.Observed, node: str, layout: gpulayouts.GpuLayout) -> bool:
    """Whether the pods bound to ``node`` ask for more ``nvidia.com/gpu`` than its whole GPUs
    outside the live reservations of unbound pods: then one holds a reserved GPU. The agent does
    not say which pod holds a whole GPU, only the count tells."""
    kept = {
        g
        for other in observed.reservations.values()
        if other.node == node and observed.pods[other.pod].node is None
        for g in other.gpus
    }
    return observed.bound_whole.get(node, 0) > len(whole_now(layout) - kept)


def missing(observed: observing.Observed, pod_key: str) -> str | None:
    """What the reserved pod ``pod_key`` waits for on its node before kube-scheduler's counts
    matter, or ``None``: the node Ready and reported, every instance reserved for it made (the
    agent reports it with a UUID), every slice served, every whole GPU reported with MIG off
    (:func:`whole_now`), and the counters a unified pod names advertised."""
    r = observed.reservations[pod_key]
    layout = observed.layouts.get(r.node)
    node = observed.nodes.get(r.node)
    if layout is None or layout.status is None or node is None or not node.ready:
        return f"node {r.node} to be Ready and reported"
    have = _existing(layout)
    absent = [i for i in r.instances if i not in have]
    if absent:
        gpu, start, profile = absent[0]
        return f"{profile} at GPU {gpu} start {start} on {r.node} to be created"
    served = _served_slices(layout)
    unserved = [sl for sl in r.slices if sl not in served]
    if unserved:
        gpu, ident, gb = unserved[0]
        return f"MPS slice {ident} ({gb} GB) of GPU {gpu} on {r.node} to be served"
    advertised = _replicas(layout)
    unseen = [rep for rep in r.replicas if rep not in advertised]
    if unseen:
        gpu, ident = unseen[0]
        return f"time-slicing replica {ident} of GPU {gpu} on {r.node} to be advertised"
    whole = whole_now(layout)
    switching = [g for g in r.gpus if g not in whole]
    if switching:
        return f"GPU {switching[0]} on {r.node} to be switched out of MIG (migMode.current false)"
    view = observed.pods[pod_key]
    for counter in view.counters:
        if counter not in node.allocatable:
            return f"node {r.node} to advertise {counter} (its agent writes it)"
    return None


def _gate_ops(spec: Mapping[str, Any]) -> Patch:
    gates = [
        g.get("name") if isinstance(g, Mapping) else None for g in spec.get("schedulingGates") or []
    ]
    if observing.GATE not in gates:
        return []
    at = gates.index(observing.GATE)
    test = {"op": "test", "path": f"/spec/schedulingGates/{at}/name", "value": observing.GATE}
    if len(gates) == 1:
        return [test, {"op": "remove", "path": "/spec/schedulingGates"}]
    return [test, {"op": "remove", "path": f"/spec/schedulingGates/{at}"}]


def ungate_patch(pod: Mapping[str, Any]) -> Patch:
    """Remove the ``migpilot.io/plan`` gate (empty when the pod has none)."""
    return _gate_ops(pod.get("spec") or {})


def pin_patch(pod: Mapping[str, Any], node: observing.NodeView) -> Patch:
    """Narrow the pod's required node affinity to ``node`` and remove the gate.

    The node is named by ``metadata.name`` in a ``matchFields`` requirement, as the DaemonSet
    controller pins its pods: kube-scheduler's NodeAffinity PreFilter then hands the scheduling
    cycle that one node instead of filtering every node of the cluster (with a
    ``kubernetes.io/hostname`` label requirement it would check all of them, one pod after
    another: the cost grows with the cluster). Every existing term gains the requirement (a pod
    matches when any term does, so each must be narrowed); with no terms, one term is added. A
    gated pod's terms may gain requirements (the apiserver refuses any other change).
    """
    spec = pod.get("spec") or {}
    if not _gate_ops(spec):
        return []
    kind = "matchFields"
    requirement = {"key": "metadata.name", "operator": "In", "values": [node.name]}
    term = {kind: [requirement]}
    ops: Patch = []
    affinity = spec.get("affinity")
    node_aff = affinity.get("nodeAffinity") if isinstance(affinity, Mapping) else None
    required = (
        node_aff.get("requiredDuringSchedulingIgnoredDuringExecution")
        if isinstance(node_aff, Mapping)
        else None
    )
    terms = required.get("nodeSelectorTerms") if isinstance(required, Mapping) else None
    base = "/spec/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"
    if not isinstance(affinity, Mapping):
        ops.append(
            {
                "op": "add",
                "path": "/spec/affinity",
                "value": {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [term]
                        }
                    }
                },
            }
        )
    elif not isinstance(node_aff, Mapping):
        ops.append(
            {
                "op": "add",
                "path": "/spec/affinity/nodeAffinity",
                "value": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [term]}
                },
            }
        )
    elif not isinstance(required, Mapping) or not terms:
        ops.append({"op": "add", "path": base, "value": {"nodeSelectorTerms": [term]}})
    else:
        for i, t in enumerate(terms):
            if isinstance(t, Mapping) and t.get(kind):
                if requirement in t[kind]:
                    continue
                ops.append(
                    {
                        "op": "add",
                        "path": f"{base}/nodeSelectorTerms/{i}/{kind}/-",
                        "value": requirement,
                    }
                )
            else:
                ops.append(
                    {
                        "op": "add",
                        "path": f"{base}/nodeSelectorTerms/{i}/{kind}",
                        "value": [requirement],
                    }
                )
    return ops + _gate_ops(spec)
