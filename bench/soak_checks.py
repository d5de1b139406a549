"""The soak bench's invariants, as pure functions over what the bench recorded.

``bench/bench_soak.py`` runs the whole system under churn and faults and records, each with the
host's wall-clock time: what the bench itself did (pods created and deleted, faults), what it
saw through the API (pods' phase, node and scheduling gates; every GpuLayout's spec
reservations and status), and what the agents logged (``--log-format json``: each device the
stand-in kubelet hands to a pod or takes back, each MIG instance destroyed), with the hand-outs
of the bench's own device manager on the node whose agent runs the real kubelet path. Those
records are turned into the events below, and every checker here reads only events: no clock,
no I/O, so each is unit-tested on hand-made sequences, violating ones included
(``tests/unit/test_soak_checks.py``).

The invariants (``docs/soak.md`` says why each is stated as it is):

* :func:`used_destroyed`: no instance held by a live pod, nor one the agent last reported
  ``used`` or ``reserved``, is destroyed; no MPS slice held by a live pod disappears.
* :func:`double_held`: no device is held by two live pods at once.
* :func:`destroyed_without_podresources`: no MIG instance is destroyed on a node while its
  PodResources socket is away (every instance counts as in use then).
* :func:`slow_pods`: every pod runs within ``bound_s`` of capacity for it existing (the
  cluster could serve it, continuously, outside fault windows).
* :func:`gated_while_servable`: no pod keeps its scheduling gate for ``bound_s`` while a node
  could serve it.
* :func:`stale_reservations`: no reservation outlives its pod by more than ``grace_s``.
* :func:`final_mismatch`: at the end, each node's GpuLayout status shows exactly the GPUs'
  instances and the devices its agent holds for pods.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from migpilot.mig import catalog, layouts, profiles
from migpilot.planning import modes, unified
from migpilot.sharing import mps as sharing_mps

# --- what the bench records --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ask:
    """What one soak pod asks for: one ``nvidia.com/mig-<profile>``, a HAMi-style
    ``nvidia.com/gpu: 1`` with ``nvidia.com/gpumem`` MiB, or one MPS slice of ``gb`` GB."""

    kind: str
    """``mig``, ``hami`` or ``mps``."""
    profile: str | None = None
    gpumem_mib: int | None = None
    gb: int | None = None

    def __post_init__(self) -> None:
        wanted = {"mig": self.profile, "hami": self.gpumem_mib, "mps": self.gb}
        if self.kind not in wanted:
            raise ValueError(f"unknown ask kind {self.kind!r} (mig, hami or mps)")
        if wanted[self.kind] is None:
            raise ValueError(f"a {self.kind} ask needs its amount")


@dataclass(frozen=True, slots=True)
class InstanceView:
    """One MIG instance in a GpuLayout status."""

    profile: str
    start: int
    uuid: str | None
    state: str
    """``free``, ``used``, ``reserved`` or ``creating``."""


@dataclass(frozen=True, slots=True)
class SliceView:
    """One MPS slice (``id``) or time-slicing replica (``gb`` 0) in a GpuLayout status."""

    id: int
    gb: int
    state: str


@dataclass(frozen=True, slots=True)
class GpuView:
    """One GPU of a GpuLayout status."""

    index: int
    model: str
    uuid: str
    mig: bool
    instances: tuple[InstanceView, ...] = ()
    slices: tuple[SliceView, ...] = ()
    replicas: tuple[SliceView, ...] = ()

    def device_ids(self) -> frozenset[str]:
        """The device IDs the agent hands out for this GPU's instances, slices and replicas."""
        ids = {i.uuid for i in self.instances if i.uuid}
        ids |= {f"{self.uuid}::mps-{s.id}" for s in self.slices}
        ids |= {f"{self.uuid}::{r.id}" for r in self.replicas}
        return frozenset(ids)


@dataclass(frozen=True, slots=True)
class NodeView:
    """A node's GpuLayout status as seen at one moment, and its sharing mode."""

    node: str
    mode: str
    """``mig``, ``mps`` or ``time-slicing`` (the Node's ``migpilot.io/mode``)."""
    gpus: tuple[GpuView, ...]


@dataclass(frozen=True, slots=True)
class PodCreated:
    t: float
    pod: str
    ask: Ask


@dataclass(frozen=True, slots=True)
class PodDeleted:
    """The bench deleted the pod (grace period 0: it is gone at once)."""

    t: float
    pod: str


@dataclass(frozen=True, slots=True)
class PodSeen:
    """A pod's state as the bench's watch showed it."""

    t: float
    pod: str
    node: str | None
    running: bool
    gated: bool


@dataclass(frozen=True, slots=True)
class LayoutSeen:
    """A GpuLayout as the bench's watch showed it: the pods its spec reserves for, and its
    status (``None`` before the agent's first)."""

    t: float
    node: str
    reserved_for: frozenset[str]
    status: NodeView | None


@dataclass(frozen=True, slots=True)
class Assigned:
    """An agent logged that ``pod`` holds ``devices`` now (``gets`` or ``now holds``)."""

    t: float
    node: str
    pod: str
    devices: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Released:
    """An agent logged that ``pod`` released its devices."""

    t: float
    node: str
    pod: str


@dataclass(frozen=True, slots=True)
class Destroyed:
    """An agent logged that it destroyed a MIG instance (``GPU g: destroy P@S (UUID)``)."""

    t: float
    node: str
    gpu: int
    profile: str
    start: int
    uuid: str | None


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault window: from injection until the faulted part is back and has settled."""

    start: float
    end: float
    what: str


@dataclass(frozen=True, slots=True)
class Outage:
    """A node's PodResources socket away, from its removal to its return."""

    start: float
    end: float
    node: str


Event = PodCreated | PodDeleted | PodSeen | LayoutSeen | Assigned | Released | Destroyed


@dataclass(frozen=True, slots=True)
class Violation:
    """One broken invariant: which, when, and what happened."""

    invariant: str
    t: float
    detail: str


def ordered(events: Iterable[Event]) -> list[Event]:
    """The events in time order (stable: records of one source keep their order)."""
    return sorted(events, key=lambda e: e.t)


# --- whether a node could serve an ask --------------------------------------------------------


def _model(name: str) -> profiles.GpuModel:
    return catalog.resolve_gpu(name)


def _mig_fits(gpu: GpuView, profile: str) -> bool:
    """A free instance of ``profile``, or room for one once the free instances are gone."""
    model = _model(gpu.model)
    if profile not in {p.name for p in model.profiles}:
        return False
    if any(i.profile == profile and i.state == "free" for i in gpu.instances):
        return True
    kept = layouts.Layout.of(
        layouts.Instance(i.start, i.profile) for i in gpu.instances if i.state != "free"
    )
    return profile in layouts.fitting_profiles(model, kept)


def _slice_fits(gpu: GpuView, gb: int) -> bool:
    """Room for a slice of ``gb`` GB beside the slices held or reserved (free ones may go)."""
    whole = sharing_mps.memory_gb(_model(gpu.model))
    return sum(s.gb for s in gpu.slices if s.state != "free") + gb <= whole


def could_serve(ask: Ask, view: NodeView) -> bool:
    """Whether ``view``'s node could serve ``ask`` now, as far as its status shows."""
    for gpu in view.gpus:
        if view.mode == "mig" and gpu.mig:
            profile = ask.profile
            if ask.kind == "hami":
                assert ask.gpumem_mib is not None
                profile = unified.profile_for(
                    unified.GpuAsk(1, memory_mib=ask.gpumem_mib), _model(gpu.model)
                )
            if ask.kind != "mps" and profile is not None and _mig_fits(gpu, profile):
                return True
        elif view.mode == "mps" and not gpu.mig and ask.kind in ("mps", "hami"):
            gb = ask.gb
            if ask.kind == "hami":
                gb = modes.unified_gb(
                    unified.GpuAsk(1, memory_mib=ask.gpumem_mib), _model(gpu.model)
                )
            assert gb is not None
            if _slice_fits(gpu, gb):
                return True
        elif (
            view.mode == "time-slicing"
            and ask.kind == "hami"
            and any(r.state == "free" for r in gpu.replicas)
        ):
            return True
    return False


# --- the checkers ------------------------------------------------------------------------------


@dataclass
class _Holds:
    """Who holds what, per the agents' logs, and which pods are gone (deleted by the bench)."""

    by_pod: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)

    def live(self, pod: str, t: float) -> bool:
        gone = self.deleted.get(pod)
        return gone is None or gone > t

    def holders(self, node: str, device: str, t: float) -> list[str]:
        return sorted(
            pod
            for (n, pod), devices in self.by_pod.items()
            if n == node and device in devices and self.live(pod, t)
        )

    def apply(self, event: Event) -> None:
        if isinstance(event, PodDeleted):
            self.deleted[event.pod] = event.t
        elif isinstance(event, Assigned):
            self.by_pod[(event.node, event.pod)] = event.devices
        elif isinstance(event, Released):
            self.by_pod.pop((event.node, event.pod), None)


def used_destroyed(events: Sequence[Event]) -> list[Violation]:
    """A destroyed MIG instance that a live pod held (per its agent's log) or that the last
    status showing it reported ``used``, ``reserved`` or ``creating`` (the agent reports an
    instance ``free`` before it destroys it); an MPS slice that leaves the status while a live
    pod holds it."""
    out: list[Violation] = []
    holds = _Holds()
    last_state: dict[tuple[str, str], str] = {}
    destroyed: list[Destroyed] = []
    slices: dict[str, frozenset[str]] = {}
    for e in ordered(events):
        holds.apply(e)
        if isinstance(e, Destroyed):
            destroyed.append(e)
            if e.uuid is not None and (who := holds.holders(e.node, e.uuid, e.t)):
                out.append(
                    Violation(
                        "used-destroyed",
                        e.t,
                        f"{e.node} GPU {e.gpu}: {e.profile}@{e.start} ({e.uuid}) destroyed "
                        f"while {', '.join(who)} held it",
                    )
                )
        elif isinstance(e, LayoutSeen) and e.status is not None:
            now = frozenset(f"{g.uuid}::mps-{s.id}:{s.gb}" for g in e.status.gpus for s in g.slices)
            for gone in sorted(slices.get(e.node, frozenset()) - now):
                device = gone.rsplit(":", 1)[0]
                if who := holds.holders(e.node, device, e.t):
                    out.append(
                        Violation(
                            "used-destroyed",
                            e.t,
                            f"{e.node}: MPS slice {gone} gone or resized while "
                            f"{', '.join(who)} held it",
                        )
                    )
            slices[e.node] = now
            for g in e.status.gpus:
                for i in g.instances:
                    if i.uuid:
                        last_state[(e.node, i.uuid)] = i.state
    for d in destroyed:
        state = last_state.get((d.node, d.uuid or ""))
        if state in ("used", "reserved", "creating"):
            out.append(
                Violation(
                    "used-destroyed",
                    d.t,
                    f"{d.node} GPU {d.gpu}: {d.profile}@{d.start} ({d.uuid}) destroyed; the "
                    f"last status showing it said {state}",
                )
            )
    return out


def double_held(events: Sequence[Event]) -> list[Violation]:
    """A device handed to a pod while another live pod holds it, judged line by line: a
    restarted stand-in gives each pod back exactly its own devices (its checkpoint), so no
    pass may hand a pod a device before another pod has given it up."""
    out: list[Violation] = []
    holds = _Holds()
    for e in ordered(events):
        if isinstance(e, Assigned):
            for device in e.devices:
                others = [p for p in holds.holders(e.node, device, e.t) if p != e.pod]
                if others:
                    out.append(
                        Violation(
                            "double-held",
                            e.t,
                            f"{e.node}: {device} given to {e.pod} while {', '.join(others)} "
                            "held it",
                        )
                    )
        holds.apply(e)
    return out


def destroyed_without_podresources(
    events: Sequence[Event], outages: Sequence[Outage]
) -> list[Violation]:
    """A MIG instance destroyed on a node while its PodResources socket was away: the agent
    cannot tell what pods hold then, so it must count every instance in use."""
    return [
        Violation(
            "destroyed-without-podresources",
            e.t,
            f"{e.node} GPU {e.gpu}: {e.profile}@{e.start} ({e.uuid}) destroyed while its "
            f"PodResources socket was away (from t={o.start:.1f} to {o.end:.1f})",
        )
        for e in ordered(events)
        if isinstance(e, Destroyed)
        for o in outages
        if o.node == e.node and o.start <= e.t <= o.end
    ]


def _in_fault(t: float, faults: Sequence[Fault]) -> bool:
    return any(f.start <= t <= f.end for f in faults)


def _waits(
    events: Sequence[Event],
    faults: Sequence[Fault],
    *,
    bound_s: float,
    end: float,
    waiting: str,
) -> list[tuple[str, float, float]]:
    """(pod, since, until) for each stretch longer than ``bound_s`` in which a live pod was
    ``waiting`` (``running``: not yet Running; ``gated``: still gated) while some node could
    serve it, continuously and outside fault windows."""
    asks: dict[str, Ask] = {}
    state: dict[str, PodSeen] = {}
    gone: set[str] = set()
    views: dict[str, NodeView] = {}
    since: dict[str, float] = {}
    long: list[tuple[str, float, float]] = []

    def waits(pod: str) -> bool:
        seen = state.get(pod)
        if pod in gone:
            return False
        if waiting == "running":
            return seen is None or not seen.running
        return seen is None or seen.gated

    def close(pod: str, t: float) -> None:
        start = since.pop(pod, None)
        if start is not None and t - start > bound_s:
            long.append((pod, start, t))

    def tick(t: float) -> None:
        blackout = _in_fault(t, faults)
        for pod, ask in asks.items():
            servable = (
                not blackout and waits(pod) and any(could_serve(ask, v) for v in views.values())
            )
            if servable:
                since.setdefault(pod, t)
            else:
                close(pod, t)

    boundaries = sorted({f.start for f in faults} | {f.end for f in faults})
    for e in [*ordered(events)]:
        while boundaries and boundaries[0] <= e.t:
            tick(boundaries.pop(0))
        if isinstance(e, PodCreated):
            asks[e.pod] = e.ask
        elif isinstance(e, PodDeleted):
            gone.add(e.pod)
            close(e.pod, e.t)
            asks.pop(e.pod, None)  # done with: later ticks need not look at it
        elif isinstance(e, PodSeen):
            state[e.pod] = e
        elif isinstance(e, LayoutSeen) and e.status is not None:
            views[e.node] = e.status
        tick(e.t)
    for b in boundaries:
        if b <= end:
            tick(b)
    for pod in list(since):
        close(pod, end)
    return long


def slow_pods(
    events: Sequence[Event], faults: Sequence[Fault], *, bound_s: float, end: float
) -> list[Violation]:
    """A pod not Running ``bound_s`` after a node could serve it (continuously, outside faults)."""
    return [
        Violation(
            "not-running-in-bound",
            until,
            f"{pod} could be served from t={since:.1f} yet was not Running "
            f"{until - since:.1f} s later (bound {bound_s:g} s)",
        )
        for pod, since, until in _waits(events, faults, bound_s=bound_s, end=end, waiting="running")
    ]


def gated_while_servable(
    events: Sequence[Event], faults: Sequence[Fault], *, bound_s: float, end: float
) -> list[Violation]:
    """A pod still gated ``bound_s`` after a node could serve it (continuously, outside
    faults)."""
    return [
        Violation(
            "gated-while-servable",
            until,
            f"{pod} stayed gated {until - since:.1f} s from t={since:.1f} while a node could "
            f"serve it (bound {bound_s:g} s)",
        )
        for pod, since, until in _waits(events, faults, bound_s=bound_s, end=end, waiting="gated")
    ]


def stale_reservations(
    events: Sequence[Event], faults: Sequence[Fault], *, grace_s: float
) -> list[Violation]:
    """A GpuLayout spec that still reserves for a pod ``grace_s`` after the pod was deleted
    (the time spent in fault windows since the deletion not counted), or for a pod never
    created."""
    out: list[Violation] = []
    created: set[str] = set()
    deleted: dict[str, float] = {}
    reported: set[str] = set()
    for e in ordered(events):
        if isinstance(e, PodCreated):
            created.add(e.pod)
        elif isinstance(e, PodDeleted):
            deleted[e.pod] = e.t
        elif isinstance(e, LayoutSeen):
            for pod in sorted(e.reserved_for - reported):
                if pod not in created:
                    out.append(
                        Violation("stale-reservation", e.t, f"{e.node} reserves for {pod}, "
                                  "a pod the bench never made")
                    )  # fmt: skip
                    reported.add(pod)
                    continue
                gone = deleted.get(pod)
                if gone is None:
                    continue
                paused = sum(max(0.0, min(f.end, e.t) - max(f.start, gone)) for f in faults)
                if e.t - gone - paused > grace_s:
                    out.append(
                        Violation(
                            "stale-reservation",
                            e.t,
                            f"{e.node} still reserves for {pod} {e.t - gone:.1f} s after it "
                            f"was deleted (grace {grace_s:g} s)",
                        )
                    )
                    reported.add(pod)
    return out


def final_mismatch(
    statuses: Mapping[str, NodeView],
    actual: Mapping[str, Mapping[int, frozenset[tuple[str, int, str]]]],
    held: Mapping[str, frozenset[str]],
    *,
    t: float,
    excused: Mapping[str, frozenset[str]] | None = None,
) -> list[Violation]:
    """Each node's last GpuLayout status against its agent's view: the MIG instances
    (profile, start, UUID) the GPUs hold (``actual``: the emulated GPUs' state, per GPU index),
    and the devices its stand-in kubelet holds for live pods (``held``), which the status must
    report ``used`` (and no other as ``used``, but those ``excused``: :func:`unlisted_holds`)."""
    out: list[Violation] = []
    for node in sorted(set(actual) | set(statuses)):
        view = statuses.get(node)
        if view is None:
            out.append(Violation("final-mismatch", t, f"{node}: no GpuLayout status"))
            continue
        for index, instances in sorted(actual.get(node, {}).items()):
            gpu = next((g for g in view.gpus if g.index == index), None)
            shown = (
                frozenset((i.profile, i.start, i.uuid or "") for i in gpu.instances)
                if gpu is not None
                else frozenset()
            )
            if shown != instances:
                out.append(
                    Violation(
                        "final-mismatch",
                        t,
                        f"{node} GPU {index}: status shows {sorted(shown)}, the GPU holds "
                        f"{sorted(instances)}",
                    )
                )
        used: set[str] = set()
        for g in view.gpus:
            used |= {i.uuid for i in g.instances if i.uuid and i.state == "used"}
            used |= {f"{g.uuid}::mps-{s.id}" for s in g.slices if s.state == "used"}
            used |= {f"{g.uuid}::{r.id}" for r in g.replicas if r.state == "used"}
        holds = held.get(node, frozenset())
        used -= (excused or {}).get(node, frozenset()) - holds
        if used != holds:
            out.append(
                Violation(
                    "final-mismatch",
                    t,
                    f"{node}: status reports used {sorted(used - holds)} that no pod holds, "
                    f"and not used {sorted(holds - used)} that pods hold",
                )
            )
    return out


def unlisted_holds(
    events: Sequence[Event],
    outages: Sequence[Outage],
    *,
    grace_s: float,
    margin_s: float,
    end: float,
) -> dict[str, frozenset[str]]:
    """Node -> the devices its agent may still report ``used`` at ``end`` though no pod holds
    them: handed out less than ``grace_s`` before ``end`` to a pod gone before the agent could
    have seen PodResources list them: within ``margin_s`` (two of its passes), or, handed out
    around a PodResources outage (from ``margin_s`` before it), before ``margin_s`` after its
    end. PodResources never listed them, so the agent's Allocate ledger holds them for its
    grace (``docs/agent.md``: the container may not have started yet)."""
    out: dict[str, set[str]] = {}
    given: dict[tuple[str, str], Assigned] = {}
    for e in ordered(events):
        if isinstance(e, Assigned):
            given[(e.node, e.pod)] = e
        elif isinstance(e, Released) and (a := given.pop((e.node, e.pod), None)) is not None:
            unseen = e.t - a.t <= margin_s or any(
                o.node == e.node and o.start - margin_s <= a.t and e.t <= o.end + margin_s
                for o in outages
            )
            if unseen and end - a.t < grace_s:
                out.setdefault(e.node, set()).update(a.devices)
    return {n: frozenset(d) for n, d in out.items()}


def held_at_end(events: Sequence[Event], *, end: float) -> dict[str, frozenset[str]]:
    """Node -> the devices live pods hold at ``end``, per the agents' logs."""
    holds = _Holds()
    for e in ordered(events):
        holds.apply(e)
    out: dict[str, set[str]] = {}
    for (node, pod), devices in holds.by_pod.items():
        if holds.live(pod, end):
            out.setdefault(node, set()).update(devices)
    return {n: frozenset(d) for n, d in out.items()}


# --- the agents' logs --------------------------------------------------------------------------

_GETS = re.compile(r"^Node (?P<node>\S+): pod (?P<pod>\S+) (?:gets (?P<gets>.+) \(simulated "
                   r"Allocate\)|now holds (?P<holds>.+)|released .*)$")  # fmt: skip
_DESTROY = re.compile(
    r"^GPU (?P<gpu>\d+): destroy (?P<profile>[^@\s]+)@(?P<start>\d+)(?: \((?P<uuid>[^)]+)\))?$"
)


def _epoch(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


_REFUSED = re.compile(
    r"^GpuLayout (?P<node>\S+) cannot be applied, keeping the last good: (?P<why>.+)$"
)


def refused_specs(lines: Iterable[str]) -> list[Violation]:
    """A GpuLayout spec the agent cannot apply (``GpuLayout N cannot be applied, keeping the
    last good: ...`` in its ``--log-format json`` log): the controller wrote a spec its readers
    refuse, and the node serves nothing new until it is rewritten. Once per node and reason,
    at its first sight."""
    out: list[Violation] = []
    seen: set[tuple[str, str]] = set()
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict) or not isinstance(record.get("message"), str):
            continue
        m = _REFUSED.match(record["message"])
        if m is None or (m["node"], m["why"]) in seen:
            continue
        seen.add((m["node"], m["why"]))
        out.append(
            Violation(
                "spec-not-appliable",
                _epoch(str(record.get("time"))),
                f"GpuLayout {m['node']}: a spec the agent cannot apply: {m['why']}",
            )
        )
    return out


def agent_event(line: str) -> Event | None:
    """The event one line of an agent's ``--log-format json`` log records, if any: a device
    hand-out or release by the stand-in kubelet, or a MIG instance destroyed. Lines that are
    not JSON (a traceback of a killed process) and other records give ``None``."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or not isinstance(record.get("message"), str):
        return None
    message, t = record["message"], _epoch(str(record.get("time")))
    if m := _GETS.match(message):
        node, pod = m["node"], m["pod"]
        if m["gets"] is not None:
            return Assigned(t, node, pod, tuple(m["gets"].split(", ")))
        if m["holds"] is not None:
            held = () if m["holds"] == "nothing" else tuple(m["holds"].split(", "))
            return Assigned(t, node, pod, held)
        return Released(t, node, pod)
    if (m := _DESTROY.match(message)) and isinstance(record.get("node"), str):
        return Destroyed(t, record["node"], int(m["gpu"]), m["profile"], int(m["start"]), m["uuid"])
    return None
