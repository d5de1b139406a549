"""What a DRA claim for migpilot's devices asks, read as the planner can plan it.

Why it exists: on nodes in DRA mode kube-scheduler allocates a pod's ResourceClaims from the
devices the agents publish, and migpilot steers that choice by planning the pods whose claims
ask for its devices (``docs/dra.md``, "Steering kube-scheduler"). To plan a claim the controller
must know what it asks: per request a count of devices, each matching CEL selectors. CEL is a
language, and a claim may say anything in it; the planner understands the forms migpilot
documents and ships (``deploy/dra/claimtemplates.yaml``), joined by ``&&``:

- ``device.attributes["mig.migpilot.io"].profile == "3g.40gb"`` (and ``.model``, ``.type``:
  ``"mig"`` for a MIG placement, ``"gpu"`` for a whole GPU);
- ``device.capacity["mig.migpilot.io"].memory.compareTo(quantity("20Gi")) >= 0`` (at least that
  much memory; ``> 0`` is strictly more);
- ``device.driver == "mig.migpilot.io"`` and ``true``, which ask nothing more.

Anything else (``||``, another attribute, a request for every device, a constraint across
requests, admin access) is *not understood*: :class:`NotUnderstood` names the request and the
part it could not read, and the caller leaves that pod to kube-scheduler's own first fit rather
than plan it wrong. The simulator's model of kube-scheduler's allocator
(:mod:`migpilot.planning.draalloc`) uses the same :class:`Selector`, so what the planner reads and
what the model allocates cannot drift apart; :meth:`Selector.cel` writes a selector back as the
expression a claim carries (``tests/unit/test_draclaims.py`` reads every one back).

Pure: no I/O.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import ROUND_CEILING, Decimal
from typing import Any, Protocol

from migpilot import errors
from migpilot.mig import dra
from migpilot.planning import quantities, snapshot
from migpilot.planning import unified as unifying

DRIVER = dra.DRIVER
DEVICE_CLASS = dra.DRIVER
"""The DeviceClass migpilot ships (``deploy/dra/deviceclass.yaml``): named as the driver."""
KINDS = ("mig", "gpu")
"""The values of the ``type`` attribute: a MIG placement, or a whole GPU."""
WHOLE = "whole"
"""The ``profile`` attribute of a whole GPU."""
MAX_EXPRESSION = 10_000
"""Longer CEL is not read (kube-apiserver caps a selector's expression at 10 KiB)."""


class Scoring(enum.StrEnum):
    """kube-scheduler's ``NodeResourcesFit`` scoring strategy (``scoringStrategy.type`` in its
    configuration), which picks a pod's node among those where its claims can be allocated."""

    LEAST_ALLOCATED = "LeastAllocated"
    """kube-scheduler's default: the node with the most CPU and memory left."""
    MOST_ALLOCATED = "MostAllocated"
    """The node with the least left (clusters that keep whole nodes free for large jobs)."""


def node_policy(scoring: Scoring | str) -> snapshot.Policy:
    """The planner's node policy for DRA pods under kube-scheduler's ``scoring`` strategy:
    spread for ``LeastAllocated``, binpack for ``MostAllocated``. The plan pins each pod to its
    node, so the two need not agree for the pod to land there; they agree so that the plan
    keeps the room kube-scheduler's own choices would keep (``docs/dra.md``, "Which planner
    policy"). Raise naming the value when it is neither."""
    try:
        strategy = Scoring(scoring)
    except ValueError:
        known = ", ".join(s.value for s in Scoring)
        raise errors.MigpilotError(
            f"kube-scheduler's NodeResourcesFit scoring strategy is one of {known}, got {scoring!r}"
        ) from None
    if strategy is Scoring.MOST_ALLOCATED:
        return snapshot.Policy.BINPACK
    return snapshot.Policy.SPREAD


class NotUnderstood(errors.MigpilotError):
    """A claim (or one of its selectors) the planner cannot read; the message names the part."""


class DeviceFacts(Protocol):
    """What a selector reads of a device (the simulator's devices, the agent's published ones)."""

    @property
    def profile(self) -> str: ...

    @property
    def memory_mib(self) -> int: ...

    @property
    def model(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Selector:
    """What a request's CEL selectors ask of a device, as a predicate: every field set must hold.

    :meth:`cel` writes it as the expression a ResourceClaim would carry.
    """

    profile: str | None = None
    min_memory_mib: int | None = None
    model: str | None = None
    kind: str | None = None
    """``"mig"`` or ``"gpu"`` (the ``type`` attribute); ``None``: either."""

    def matches(self, device: DeviceFacts) -> bool:
        """Whether ``device`` satisfies every condition."""
        if self.profile is not None and device.profile != self.profile:
            return False
        if self.kind is not None and (device.profile == WHOLE) != (self.kind == "gpu"):
            return False
        if self.min_memory_mib is not None and device.memory_mib < self.min_memory_mib:
            return False
        return self.model is None or device.model == self.model

    def cel(self) -> str:
        """The selector as CEL over the driver's attributes and capacity."""
        parts = []
        if self.kind is not None:
            parts.append(f'device.attributes["{DRIVER}"].type == "{self.kind}"')
        if self.profile is not None:
            parts.append(f'device.attributes["{DRIVER}"].profile == "{self.profile}"')
        if self.min_memory_mib is not None:
            parts.append(
                f'device.capacity["{DRIVER}"].memory.compareTo('
                f'quantity("{self.min_memory_mib}Mi")) >= 0'
            )
        if self.model is not None:
            parts.append(f'device.attributes["{DRIVER}"].model == "{self.model}"')
        return " && ".join(parts) or "true"


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a claim: ``count`` devices matching one of ``alternatives``.

    One alternative is a plain request (``exactly``); several are a prioritized list
    (``firstAvailable``), tried in order.
    """

    name: str
    count: int
    alternatives: tuple[Selector, ...]


@dataclass(frozen=True, slots=True)
class ClaimSpec:
    """A ResourceClaim's spec as the planner reads it: its requests for migpilot's devices (all
    allocated on one node), and the names of its requests for other device classes."""

    requests: tuple[Request, ...]
    others: tuple[str, ...] = ()
    """Requests of other DeviceClasses (another driver's devices): not migpilot's to plan."""


# --------------------------------------------------------------------------- CEL

_Q = r'"([^"\\]*)"'
_ATTR = re.compile(
    r'device\.attributes\[\s*"' + re.escape(DRIVER) + r'"\s*\]'
    r'(?:\.(\w+)|\[\s*"(\w+)"\s*\])\s*==\s*' + _Q + r"$"
)
_ATTR_FLIPPED = re.compile(
    _Q + r'\s*==\s*device\.attributes\[\s*"' + re.escape(DRIVER) + r'"\s*\]'
    r'(?:\.(\w+)|\[\s*"(\w+)"\s*\])$'
)
_MEMORY = re.compile(
    r'device\.capacity\[\s*"' + re.escape(DRIVER) + r'"\s*\]'
    r'(?:\.memory|\[\s*"memory"\s*\])'
    r"\.compareTo\(\s*quantity\(\s*" + _Q + r"\s*\)\s*\)\s*(>=|>)\s*0$"
)
_DRIVER = re.compile(r'device\.driver\s*==\s*"' + re.escape(DRIVER) + r'"$')


def _unquoted(text: str) -> Iterator[tuple[int, str, int]]:
    """Each character of ``text`` outside its string literals, with its index and the depth of
    parentheses it is at (a ``)`` at the depth it closes to). One reading of quotes and
    escapes for both :func:`_split_and` and :func:`_balanced`, so they never disagree about
    where a literal ends."""
    depth, quoted, escaped = 0, False, False
    for i, c in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                quoted = False
            continue
        if c == '"':
            quoted = True
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        yield i, c, depth


def _split_and(expression: str) -> list[str]:
    """The top-level ``&&`` terms of ``expression``, outer parentheses stripped; an ``||`` or a
    ``!`` anywhere is not understood."""
    terms: list[str] = []
    start = 0
    text = expression
    for i, c, depth in _unquoted(text):
        if i < start:
            continue  # the second '&' of a split
        if text.startswith("||", i):
            raise NotUnderstood("'||' (either of two conditions)")
        if c == "!" and not text.startswith("!=", i):
            raise NotUnderstood("'!' (a negation)")
        if depth == 0 and text.startswith("&&", i):
            terms.append(text[start:i])
            start = i + 2
    terms.append(text[start:])
    out: list[str] = []
    for term in terms:
        bare = term.strip()
        while bare.startswith("(") and bare.endswith(")") and _balanced(bare[1:-1]):
            bare = bare[1:-1].strip()
        # A parenthesized conjunction is split in turn (it is shorter: no endless recursion).
        out.extend(_split_and(bare) if bare != term.strip() else [bare])
    return out


def _balanced(text: str) -> bool:
    """Every parenthesis of ``text`` outside its literals closes one opened before it, and all
    are closed: ``(a) && (b)`` is, so its outer pair is not one to strip."""
    depth = 0
    for _, _, depth in _unquoted(text):
        if depth < 0:
            return False
    return depth == 0


def _memory_mib(text: str, *, strictly: bool) -> int:
    """A quantity of memory as the least whole MiB that satisfies the comparison."""
    try:
        value = quantities.parse_quantity(text, where=f"quantity({text!r})")
    except errors.MigpilotError as e:
        raise NotUnderstood(str(e)) from e
    mib = value / Decimal(2**20)
    least = int(mib.to_integral_value(rounding=ROUND_CEILING))
    if strictly and Decimal(least) == mib:
        least += 1  # capacity is whole MiB: more than N MiB is at least N + 1
    return max(least, 0)


def parse_selector(expression: str) -> Selector:
    """The :class:`Selector` a CEL ``expression`` of the forms the module lists asks for;
    :class:`NotUnderstood`, naming the term, for anything else (or a contradiction, such as
    two profiles)."""
    if not isinstance(expression, str):
        raise NotUnderstood(f"a CEL expression must be a string, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION:
        raise NotUnderstood(f"a CEL expression of {len(expression)} characters")
    fields: dict[str, Any] = {}

    def put(name: str, value: Any, term: str) -> None:
        had = fields.get(name)
        if had is None:
            fields[name] = value
        elif name == "min_memory_mib":
            fields[name] = max(had, value)
        elif had != value:
            raise NotUnderstood(f"{term!r} contradicts an earlier term ({name} {had!r})")

    for term in _split_and(" ".join(expression.split())):
        if term in ("true", "") or _DRIVER.match(term):
            if term == "":
                raise NotUnderstood("an empty term around '&&'")
            continue
        m = _ATTR.match(term)
        if m is not None:
            attribute, value = m.group(1) or m.group(2), m.group(3)
        elif (f := _ATTR_FLIPPED.match(term)) is not None:
            attribute, value = f.group(2) or f.group(3), f.group(1)
        elif (q := _MEMORY.match(term)) is not None:
            put("min_memory_mib", _memory_mib(q.group(1), strictly=q.group(2) == ">"), term)
            continue
        else:
            raise NotUnderstood(f"the term {term[:200]!r}")
        if attribute == "profile":
            put("profile", value, term)
        elif attribute == "model":
            put("model", value, term)
        elif attribute == "type":
            if value not in KINDS:
                raise NotUnderstood(f"{term!r}: type is one of {', '.join(KINDS)}")
            put("kind", value, term)
        else:
            raise NotUnderstood(f"{term!r}: the planner reads profile, model and type")
    if fields.get("profile") == WHOLE and fields.get("kind") == "mig":
        raise NotUnderstood(f"{expression[:200]!r}: a MIG placement is never profile {WHOLE!r}")
    return Selector(**fields)


# --------------------------------------------------------------------------- claims


def _subrequest(d: Mapping[str, Any], *, where: str) -> tuple[int, Selector] | str:
    """``(count, selector)`` of an ``exactly`` request or a ``firstAvailable`` subrequest of
    migpilot's class, or the class name of another driver's."""
    if not isinstance(d, Mapping):
        raise NotUnderstood(f"{where}: not an object")
    device_class = d.get("deviceClassName")
    if not isinstance(device_class, str) or not device_class:
        raise NotUnderstood(f"{where}: no deviceClassName")
    if device_class != DEVICE_CLASS:
        return device_class
    mode = d.get("allocationMode", "ExactCount")
    if mode != "ExactCount":
        raise NotUnderstood(f"{where}: allocationMode {mode!r} (every matching device)")
    if d.get("adminAccess"):
        raise NotUnderstood(f"{where}: adminAccess (devices in use by others)")
    if d.get("capacity"):
        raise NotUnderstood(f"{where}: a share of a device's capacity")
    count = d.get("count", 1)
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise NotUnderstood(f"{where}: count {count!r} (a whole number of devices, at least 1)")
    selector = Selector()
    for n, s in enumerate(d.get("selectors") or ()):
        cel = s.get("cel") if isinstance(s, Mapping) else None
        expression = cel.get("expression") if isinstance(cel, Mapping) else None
        if not isinstance(expression, str):
            raise NotUnderstood(f"{where}.selectors[{n}]: not a CEL selector")
        try:
            selector = _both(selector, parse_selector(expression))
        except NotUnderstood as e:
            raise NotUnderstood(f"{where}.selectors[{n}]: {e}") from e
    return count, selector


def _both(a: Selector, b: Selector) -> Selector:
    """Two selectors of one request (both must hold) as one."""
    fields: dict[str, Any] = {}
    for name in ("profile", "model", "kind"):
        x, y = getattr(a, name), getattr(b, name)
        if x is not None and y is not None and x != y:
            raise NotUnderstood(f"two selectors ask {name} {x!r} and {y!r}")
        fields[name] = x if x is not None else y
    memory = [m for m in (a.min_memory_mib, b.min_memory_mib) if m is not None]
    return Selector(min_memory_mib=max(memory) if memory else None, **fields)


def parse_claim_spec(spec: Any, *, where: str) -> ClaimSpec:
    """A ResourceClaim's ``spec`` (a ResourceClaimTemplate's ``spec.spec``) as the planner reads
    it; :class:`NotUnderstood` naming ``where`` and the part it cannot read."""
    if not isinstance(spec, Mapping):
        raise NotUnderstood(f"{where}: the spec is not an object")
    devices = spec.get("devices") or {}
    if not isinstance(devices, Mapping):
        raise NotUnderstood(f"{where}: spec.devices is not an object")
    if devices.get("constraints"):
        raise NotUnderstood(f"{where}: constraints across requests (matchAttribute)")
    raw = devices.get("requests") or ()
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise NotUnderstood(f"{where}: spec.devices.requests is not a list")
    requests: list[Request] = []
    others: list[str] = []
    for i, r in enumerate(raw):
        at = f"{where}: request {i}"
        if not isinstance(r, Mapping):
            raise NotUnderstood(f"{at}: not an object")
        named = r.get("name")
        name = named if isinstance(named, str) and named else str(i)
        at = f"{where}: request {name!r}"
        exactly, first = r.get("exactly"), r.get("firstAvailable")
        if (exactly is None) == (first is None):
            raise NotUnderstood(f"{at}: needs exactly one of exactly and firstAvailable")
        if exactly is not None:
            got = _subrequest(exactly, where=at)
            if isinstance(got, str):
                others.append(name)
                continue
            requests.append(Request(name, got[0], (got[1],)))
            continue
        if not isinstance(first, Sequence) or isinstance(first, str) or not first:
            raise NotUnderstood(f"{at}: firstAvailable is not a list of subrequests")
        subs = [_subrequest(s, where=f"{at}.firstAvailable[{n}]") for n, s in enumerate(first)]
        mine = [s for s in subs if not isinstance(s, str)]
        if len(mine) != len(subs):
            if mine:
                raise NotUnderstood(f"{at}: firstAvailable mixes migpilot's and other classes")
            others.append(name)
            continue
        counts = {c for c, _ in mine}
        if len(counts) != 1:
            raise NotUnderstood(f"{at}: firstAvailable subrequests of different counts")
        requests.append(Request(name, mine[0][0], tuple(s for _, s in mine)))
    return ClaimSpec(tuple(requests), tuple(others))


def names_class(spec: Any) -> bool:
    """Whether a ResourceClaim's ``spec`` (a ResourceClaimTemplate's ``spec.spec``) has a
    request, or a ``firstAvailable`` subrequest, of migpilot's DeviceClass. Read tolerantly,
    never raising: the admission webhook asks it of specs not yet validated, and the
    controller of claims :func:`parse_claim_spec` refuses (a claim the planner cannot read may
    still be one migpilot must hear of); anything not shaped as the API says names nothing. A
    list is any sequence but a string, as :func:`parse_claim_spec` takes it, so a spec the
    planner reads as asking for migpilot's class is one this names."""
    if not isinstance(spec, Mapping):
        return False
    devices = spec.get("devices")
    raw = devices.get("requests") if isinstance(devices, Mapping) else None
    for r in _items(raw):
        if not isinstance(r, Mapping):
            continue
        subs = [r.get("exactly"), *_items(r.get("firstAvailable"))]
        if any(isinstance(s, Mapping) and s.get("deviceClassName") == DEVICE_CLASS for s in subs):
            return True
    return False


def _items(value: Any) -> Sequence[Any]:
    """``value`` if it is a list (any sequence but a string or bytes), else nothing."""
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return value
    return ()


# --------------------------------------------------------------------------- as the planner's


@dataclass(frozen=True, slots=True)
class Asked:
    """What a pod's claims ask of migpilot's devices, as the planner's requests."""

    requests: snapshot.Requests
    """MIG instances by profile, a unified request by memory (the smallest fitting profile of
    each model, as kube-scheduler's first fit over smallest-first slices takes it), or whole
    GPUs."""
    model: str | None
    """The GPU model every device must be (the catalog's id), ``None`` for any: the caller
    keeps the pod to the nodes of that model (all of a pod's claims are allocated on its
    node)."""


def planner_requests(
    claims: Sequence[ClaimSpec], *, cpu_milli: int, memory_bytes: int, where: str
) -> Asked:
    """The planner's requests for a pod with ``claims`` (each as :func:`parse_claim_spec`
    read it), or :class:`NotUnderstood` naming ``where`` and what the planner cannot plan:
    another driver's devices beside migpilot's, a ``firstAvailable`` list (the planner plans
    one selector per request), a profile and a memory condition together, requests for two
    models, whole GPUs beside MIG placements, or requests by profile beside requests by
    memory. A request by model or type alone asks for the smallest placement (first fit over
    smallest-first slices)."""
    others = [name for c in claims for name in c.others]
    if others:
        raise NotUnderstood(
            f"{where}: also asks for devices of other drivers (request {others[0]!r})"
        )
    requests = [r for c in claims for r in c.requests]
    if not requests:
        raise NotUnderstood(f"{where}: asks for none of migpilot's devices")
    models = {s.model for r in requests for s in r.alternatives if s.model is not None}
    if len(models) > 1:
        raise NotUnderstood(f"{where}: asks for devices of models {', '.join(sorted(models))}")
    profiles_asked: dict[str, int] = {}
    asks: list[unifying.GpuAsk] = []
    whole = 0
    for r in requests:
        if len(r.alternatives) != 1:
            raise NotUnderstood(
                f"{where}: request {r.name!r} is a firstAvailable list (the planner plans one "
                "selector per request)"
            )
        (s,) = r.alternatives
        if s.kind == "gpu" or s.profile == WHOLE:
            if s.min_memory_mib is not None:
                raise NotUnderstood(f"{where}: request {r.name!r}: a whole GPU by memory")
            whole += r.count
        elif s.profile is not None:
            if s.min_memory_mib is not None:
                raise NotUnderstood(
                    f"{where}: request {r.name!r} asks a profile and a memory condition together"
                )
            profiles_asked[s.profile] = profiles_asked.get(s.profile, 0) + r.count
        else:
            asks.append(unifying.GpuAsk(count=r.count, memory_mib=max(s.min_memory_mib or 1, 1)))
    kinds = sum(1 for k in (profiles_asked, asks, whole) if k)
    if kinds > 1:
        raise NotUnderstood(
            f"{where}: mixes whole GPUs, requests by profile and requests by memory (the "
            "planner plans one kind per pod)"
        )
    model = next(iter(models), None)
    if whole:
        got = snapshot.whole_requests(whole, cpu_milli=cpu_milli, memory_bytes=memory_bytes)
    elif asks:
        got = snapshot.Requests(
            (),
            cpu_milli,
            memory_bytes,
            unified=unifying.UnifiedRequest(asks=tuple(asks), mode=unifying.MIG_MODE),
        )
    else:
        mig = tuple(snapshot.MigRequest(p, n) for p, n in sorted(profiles_asked.items()))
        got = snapshot.Requests(mig, cpu_milli, memory_bytes)
    return Asked(got, model)
