"""The GpuLayout status the agent reports, from what the GPUs hold after a pass.

:func:`layout_status` is pure: the GPUs as the reconciler read them, the devices in use (the
kubelet, Allocate hand-outs, running processes; never the GpuLayout's own protection, or a used
instance would stay used for ever), the spec the agent acted on, the pass's report and any
problem with the spec in; a :class:`~gpulayouts.LayoutStatus` out. The states follow the
lifecycle of ``docs/gpulayout.md``: ``used`` when in use, ``reserved`` when the spec keeps it for
a pod, ``creating`` for a GPU instance still without its compute instance or a spec instance
that does not exist yet but has room, ``free`` otherwise; a used instance Allocate handed to a
unified pod names it (``usedBy``, ``docs/unified.md``). A GPU with MIG disabled is reported
when it serves MPS slices (``mps``, :mod:`~migpilot.agent.sharing.slicing`) or the node is in mode
``mps`` (``mps_node``), with its slices and no instances, or when the node's sharing config
time-slices it (``replicas``, :mod:`~migpilot.agent.sharing.timeslicing`), with its replicas.
The ``Ready`` condition is ``True`` when the GPUs hold the spec, with reasons ``Reconciled``,
``Pending`` (instances in use in the way, or work left for the next pass), ``Refused`` (something
waiting will not fix) or ``InvalidSpec`` (the spec cannot be applied; the last good one is kept; a
static node's unusable mig-parted config says ``InvalidConfig``); MPS slices the spec asks on a GPU
that cannot serve them (``mps_problems``: MIG enabled) make it ``Refused``. Its transition time
changes only when status, reason or message change.

No I/O, no clock (``now`` is RFC 3339 text from the caller).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from migpilot.agent.rules import changes
from migpilot.api import gpulayouts
from migpilot.mig import layouts

_S = gpulayouts.InstanceState


def layout_status(
    *,
    state: Mapping[int, changes.GpuState],
    in_use: frozenset[str],
    spec: gpulayouts.LayoutSpec | None,
    generation: int | None,
    report: changes.Report | None,
    problem: str | None = None,
    problem_reason: str = "InvalidSpec",
    previous: gpulayouts.LayoutStatus | None = None,
    used_by: Mapping[str, str] | None = None,
    mps: Mapping[int, Sequence[gpulayouts.SliceStatus]] | None = None,
    mps_problems: Sequence[str] = (),
    mps_node: bool = False,
    replicas: Mapping[int, Sequence[gpulayouts.ReplicaStatus]] | None = None,
    dynamic_mig: bool = False,
    plan_listed: bool | None = None,
    now: str,
) -> gpulayouts.LayoutStatus:
    """The status to apply after a pass (see the module docstring).

    ``spec`` and ``generation`` are the last good spec the agent acted on (``None``: none yet);
    ``problem`` is why the newest spec was not applied, reported with ``problem_reason``
    (``InvalidConfig`` for a static node's mig-parted config). ``used_by``: MIG UUID -> the unified
    pod Allocate handed it to, reported on a used instance (``usedBy``). ``mps``: GPU index -> its
    MPS slices' statuses (:func:`~migpilot.agent.sharing.slicing.statuses`), reported on GPUs with
    MIG disabled; ``mps_node``: report every such GPU the catalog knows, even without slices (the
    controller plans the slices of a node in mode ``mps`` from them). ``replicas``: GPU index ->
    its time-slicing replicas' statuses (:func:`~migpilot.agent.sharing.timeslicing.statuses`),
    reported on GPUs with MIG disabled. ``dynamic_mig``: the node is labelled
    ``migpilot.io/mig-mode=dynamic``: every GPU the catalog knows is reported, with its MIG mode
    (the controller plans whole GPUs, and GPUs to switch, from them). ``plan_listed``: on a
    node in DRA mode, whether the pass listed the spec's free placements first in its
    ResourceSlices (the ``PlanListed`` condition, at ``generation``); ``None`` elsewhere (no
    such condition)."""
    slices = mps or {}
    shared = replicas or {}
    owners = used_by or {}
    wanted = {g.index: g for g in spec.gpus} if spec is not None else {}
    gpus: list[gpulayouts.GpuStatus] = []
    for index in sorted(state):
        info = state[index].info
        if info.model is None:
            continue  # the planner plans only GPUs it knows
        mode = (
            gpulayouts.MigModeStatus(info.mig.current, info.mig.pending)
            if dynamic_mig and info.mig is not None
            else None
        )
        if info.mig is None or not info.mig.current:
            if index in slices or index in shared or mps_node or mode is not None:
                gpus.append(
                    gpulayouts.GpuStatus(
                        index,
                        info.product_name,
                        info.uuid,
                        (),
                        tuple(slices.get(index, ())),
                        tuple(shared.get(index, ())),
                        mode,
                    )
                )
            continue  # MIG instances only on MIG-enabled GPUs
        reserved = {
            (i.start, i.profile) for i in (wanted[index].instances if index in wanted else ())
            if i.reserved_for is not None
        }  # fmt: skip
        found: list[gpulayouts.InstanceStatus] = []
        taken: list[layouts.Instance] = []
        for dev in sorted(state[index].devices, key=lambda d: (d.start, d.gi_id)):
            if dev.instance in taken:
                continue
            taken.append(dev.instance)
            if dev.uuid is None:
                st = _S.CREATING
            elif dev.uuid in in_use:
                st = _S.USED
            elif (dev.start, dev.profile) in reserved:
                st = _S.RESERVED
            else:
                st = _S.FREE
            owner = owners.get(dev.uuid) if st is _S.USED and dev.uuid is not None else None
            found.append(gpulayouts.InstanceStatus(dev.profile, dev.start, dev.uuid, st, owner))
        for inst in wanted[index].instances if index in wanted else ():
            spot = layouts.Instance(inst.start, inst.profile)
            if spot in taken or layouts.violation(info.model, [*taken, spot]) is not None:
                continue
            taken.append(spot)
            found.append(gpulayouts.InstanceStatus(inst.profile, inst.start, None, _S.CREATING))
        gpus.append(
            gpulayouts.GpuStatus(
                index,
                info.product_name,
                info.uuid,
                tuple(sorted(found, key=lambda i: i.start)),
                mig_mode=mode,
            )
        )
    ready = _ready(report=report, problem=problem, generation=generation, spec=spec)
    if problem is not None:
        ready = (ready[0], problem_reason, ready[2])
    elif mps_problems and ready[1] in {"Reconciled", "Pending", "Refused"}:
        message = "; ".join(x for x in (ready[2], *mps_problems) if x)
        ready = (gpulayouts.ConditionStatus.FALSE, "Refused", message)
    conditions = [_keep_time(ready, previous, now)]
    if plan_listed is not None:
        listed = (
            (gpulayouts.ConditionStatus.TRUE, "Listed", "the plan's free placements are listed "
             "first in the node's ResourceSlices")
            if plan_listed
            else (gpulayouts.ConditionStatus.FALSE, "NotListed", "nothing is listed first: the "
                  "controller's Lease is stale or unread here, or the slices were not written")
        )  # fmt: skip
        conditions.append(
            _keep_time(listed, previous, now, kind=gpulayouts.PLAN_LISTED, generation=generation)
        )
    return gpulayouts.LayoutStatus(
        observed_generation=generation,
        gpus=tuple(gpus),
        conditions=tuple(conditions),
    )


def _ready(
    *,
    report: changes.Report | None,
    problem: str | None,
    generation: int | None,
    spec: gpulayouts.LayoutSpec | None,
) -> tuple[gpulayouts.ConditionStatus, str, str]:
    t, f = gpulayouts.ConditionStatus.TRUE, gpulayouts.ConditionStatus.FALSE
    if problem is not None:
        kept = "the last good spec is kept" if spec is not None else "nothing is changed"
        return f, "InvalidSpec", f"{problem}; {kept}"
    if report is None:
        return gpulayouts.ConditionStatus.UNKNOWN, "NotReconciled", "no pass has run yet"
    failed = report.outcomes(changes.Outcome.FAILED)
    hard = [r for r in report.refusals if not r.in_use]
    if failed or hard:
        texts = [f"{a.change} failed: {a.detail}" for a in failed] + [str(r) for r in hard]
        return f, "Refused", "; ".join(texts)
    if report.refusals or not report.converged:
        texts = [str(r) for r in report.refusals] or ["actions are left for the next pass"]
        return f, "Pending", "; ".join(texts)
    return t, "Reconciled", ""


def _keep_time(
    ready: tuple[gpulayouts.ConditionStatus, str, str],
    previous: gpulayouts.LayoutStatus | None,
    now: str,
    *,
    kind: str = gpulayouts.READY,
    generation: int | None = None,
) -> gpulayouts.Condition:
    status, reason, message = ready
    before = next((c for c in (previous.conditions if previous else ()) if c.type == kind), None)
    same = before is not None and (before.status, before.reason, before.message) == ready
    when = before.last_transition_time if same and before is not None else now
    return gpulayouts.Condition(kind, status, reason, message, when, generation)
