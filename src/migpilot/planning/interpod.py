"""What a pod says about the other pods it may share a topology with, as frozen values.

kube-scheduler's InterPodAffinity and PodTopologySpread filters read a pod's labels, its required
``podAffinity`` and ``podAntiAffinity`` terms and its ``topologySpreadConstraints`` with
``whenUnsatisfiable: DoNotSchedule``; a pod already bound counts with its namespace, labels and
node, and its own required anti-affinity terms keep others away (the symmetric rule). This module
holds those values and reads them from their Kubernetes form (the snapshot file, traces and the
controller's pods all come through :func:`pod_terms`); :mod:`migpilot.planning.podaffinity`
applies them.

``matchLabelKeys`` and ``mismatchLabelKeys`` are folded into the selector here with the pod's own
labels, as the apiserver does on creation (``key In (value)``, ``key NotIn (value)``); folding a
selector that already holds them changes nothing. The preferred (soft) forms, weighted
``preferredDuringSchedulingIgnoredDuringExecution`` terms and ``ScheduleAnyway`` constraints, are
kept apart (:attr:`PodTerms.preferred_affinity`, :attr:`PodTerms.preferred_anti_affinity`,
:attr:`PodTerms.soft_spread`): they never refuse a node, and the planners use them only to order
nodes otherwise equal (:func:`migpilot.planning.podaffinity.Tracker.preferences`).

Pure: may import only :mod:`migpilot.errors`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from migpilot import errors

HOSTNAME = "kubernetes.io/hostname"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""The label the apiserver gives every namespace: its name (namespace selectors may use it)."""

_EMPTY: Mapping[str, str] = MappingProxyType({})


@dataclass(frozen=True, slots=True)
class LabelRequirement:
    """One requirement of a label selector (``matchLabels`` become ``In`` with one value)."""

    key: str
    operator: str
    """In, NotIn, Exists or DoesNotExist."""
    values: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Selector:
    """A label selector: every requirement must hold; no requirement selects everything.

    Where Kubernetes leaves a selector out (``labelSelector: null``) it selects nothing: that is
    ``None`` wherever a ``Selector | None`` is held."""

    requirements: tuple[LabelRequirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether a set of labels satisfies every requirement."""
        for r in self.requirements:
            value = labels.get(r.key)
            if r.operator == "In":
                ok = value is not None and value in r.values
            elif r.operator == "NotIn":
                ok = value is None or value not in r.values
            elif r.operator == "Exists":
                ok = value is not None
            else:
                ok = value is None
            if not ok:
                return False
        return True

    def with_requirements(self, extra: Sequence[LabelRequirement]) -> Selector:
        """This selector with ``extra`` requirements added (none repeated)."""
        have = list(self.requirements)
        have += [r for r in extra if r not in have]
        return Selector(tuple(have))


def selects(selector: Selector | None, labels: Mapping[str, str]) -> bool:
    """Whether ``selector`` selects ``labels`` (``None``: Kubernetes' nil selector, nothing)."""
    return selector is not None and selector.matches(labels)


@dataclass(frozen=True, slots=True)
class AffinityTerm:
    """A required pod (anti-)affinity term, resolved against the pod that holds it."""

    selector: Selector | None
    """Which pods' labels it selects (``matchLabelKeys``/``mismatchLabelKeys`` folded in)."""
    namespaces: frozenset[str]
    """Namespaces named; with neither these nor :attr:`namespace_selector`, the holder's own."""
    namespace_selector: Selector | None
    """Namespaces by their labels; ``None``: not given (an empty selector selects all)."""
    topology_key: str
    """The node label whose value makes a domain (``kubernetes.io/hostname``, a zone, ...)."""

    def matches(
        self, namespace: str, labels: Mapping[str, str], namespace_labels: Mapping[str, str]
    ) -> bool:
        """Whether a pod in ``namespace`` (whose labels are ``namespace_labels``) with
        ``labels`` is one this term is about (kube-scheduler's ``AffinityTerm.Matches``)."""
        in_scope = namespace in self.namespaces or selects(
            self.namespace_selector, namespace_labels
        )
        return in_scope and selects(self.selector, labels)


@dataclass(frozen=True, slots=True)
class SpreadConstraint:
    """A ``topologySpreadConstraints`` entry with ``whenUnsatisfiable: DoNotSchedule``."""

    max_skew: int
    topology_key: str
    selector: Selector | None
    """Pods counted (in the pod's own namespace); ``matchLabelKeys`` folded in."""
    min_domains: int = 1
    """Below this many eligible domains the global minimum counts as 0."""
    honor_node_affinity: bool = True
    """``nodeAffinityPolicy``: Honor (default) counts only nodes the pod's node selector and
    required node affinity admit; Ignore counts every node."""
    honor_node_taints: bool = False
    """``nodeTaintsPolicy``: Ignore (default) counts tainted nodes too; Honor only those whose
    NoSchedule/NoExecute taints the pod tolerates."""


@dataclass(frozen=True, slots=True)
class WeightedTerm:
    """A preferred pod (anti-)affinity term and its weight (1-100, as the apiserver allows)."""

    weight: int
    term: AffinityTerm


@dataclass(frozen=True, slots=True)
class PodTerms:
    """Everything the two filters read from a pod besides its node constraints."""

    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    affinity: tuple[AffinityTerm, ...] = ()
    """Required ``podAffinity`` terms (all must hold)."""
    anti_affinity: tuple[AffinityTerm, ...] = ()
    """Required ``podAntiAffinity`` terms."""
    spread: tuple[SpreadConstraint, ...] = ()
    """Hard topology spread constraints."""
    preferred_affinity: tuple[WeightedTerm, ...] = ()
    """Preferred ``podAffinity`` terms: never refuse a node, only rank nodes."""
    preferred_anti_affinity: tuple[WeightedTerm, ...] = ()
    """Preferred ``podAntiAffinity`` terms."""
    soft_spread: tuple[SpreadConstraint, ...] = ()
    """``ScheduleAnyway`` topology spread constraints (``min_domains`` always 1)."""

    @property
    def constrained(self) -> bool:
        """Whether the pod itself limits where it may go relative to other pods."""
        return bool(self.affinity or self.anti_affinity or self.spread)

    @property
    def preferring(self) -> bool:
        """Whether the pod prefers some nodes to others because of other pods."""
        return bool(self.preferred_affinity or self.preferred_anti_affinity or self.soft_spread)

    def signature(self) -> tuple[object, ...]:
        """Hashable and equal for pods the filters treat alike."""
        return (
            tuple(sorted(self.labels.items())),
            self.affinity,
            self.anti_affinity,
            self.spread,
            self.preferred_affinity,
            self.preferred_anti_affinity,
            self.soft_spread,
        )


NO_TERMS = PodTerms()


@dataclass(frozen=True, slots=True)
class BoundPod:
    """A pod bound to a node already (any pod, GPU or not): the filters count it."""

    name: str
    namespace: str
    node: str
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    anti_affinity: tuple[AffinityTerm, ...] = ()
    """Its required anti-affinity terms: they keep matching pods out of its domains."""
    terminating: bool = False
    """Being deleted (``deletionTimestamp`` set, not yet gone): topology spread skips it, pod
    (anti-)affinity still counts it, as kube-scheduler does."""

    @property
    def key(self) -> str:
        """``namespace/name``."""
        return f"{self.namespace}/{self.name}"


# --------------------------------------------------------------------------- parsing


def read_mapping(value: Any, where: str) -> Mapping[str, Any]:
    """A snapshot field that must be a mapping (``None``: empty); shared with
    :mod:`~migpilot.planning.snapshot`'s reader."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise errors.SnapshotError(f"{where}: expected a mapping")
    return value


def read_sequence(value: Any, where: str) -> Sequence[Any]:
    """A snapshot field that must be a list (``None``: empty)."""
    if value is None:
        return ()
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise errors.SnapshotError(f"{where}: expected a list")
    return value


def read_only_fields(d: Mapping[str, Any], allowed: set[str], where: str) -> None:
    """Refuse a field outside ``allowed``, naming it and the allowed ones."""
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise errors.SnapshotError(
            f"{where}: unknown field {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})"
        )


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise errors.SnapshotError(f"{where}: expected a non-empty string")
    return value


def _strings(value: Any, where: str) -> tuple[str, ...]:
    return tuple(_text(v, f"{where}[{i}]") for i, v in enumerate(read_sequence(value, where)))


def labels(value: Any, where: str) -> Mapping[str, str]:
    """A label mapping (keys and values strings; values may be empty)."""
    out: dict[str, str] = {}
    for k, v in read_mapping(value, where).items():
        if not isinstance(k, str) or not k:
            raise errors.SnapshotError(f"{where}: label keys must be non-empty strings")
        if isinstance(v, bool):
            v = str(v).lower()
        if v is None or not isinstance(v, str | int | float):
            raise errors.SnapshotError(f"{where}.{k}: label values must be strings")
        out[k] = str(v)
    return MappingProxyType(out)


_SELECTOR_OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")


def selector(raw: Any, where: str) -> Selector | None:
    """A ``LabelSelector`` (``matchLabels``, ``matchExpressions``); ``None`` for null."""
    if raw is None:
        return None
    d = read_mapping(raw, where)
    read_only_fields(d, {"matchLabels", "matchExpressions"}, where)
    reqs = [
        LabelRequirement(k, "In", frozenset({v}))
        for k, v in sorted(labels(d.get("matchLabels"), f"{where}.matchLabels").items())
    ]
    for i, e in enumerate(read_sequence(d.get("matchExpressions"), f"{where}.matchExpressions")):
        ew = f"{where}.matchExpressions[{i}]"
        m = read_mapping(e, ew)
        read_only_fields(m, {"key", "operator", "values"}, ew)
        op = _text(m.get("operator"), f"{ew}.operator")
        if op not in _SELECTOR_OPERATORS:
            raise errors.SnapshotError(
                f"{ew}.operator: {op!r} is not one of {', '.join(_SELECTOR_OPERATORS)}"
            )
        values = tuple(
            str(v) for v in read_sequence(m.get("values"), f"{ew}.values") if _label_value(v, ew)
        )
        if op in ("In", "NotIn") and not values:
            raise errors.SnapshotError(f"{ew}: operator {op} needs values")
        if op in ("Exists", "DoesNotExist") and values:
            raise errors.SnapshotError(f"{ew}: operator {op} takes no values")
        reqs.append(LabelRequirement(_text(m.get("key"), f"{ew}.key"), op, frozenset(values)))
    return Selector(tuple(reqs))


def _label_value(value: Any, where: str) -> bool:
    if not isinstance(value, str | int | float) or isinstance(value, bool):
        raise errors.SnapshotError(f"{where}.values: expected strings, got {value!r}")
    return True


def _folded(
    sel: Selector | None,
    own: Mapping[str, str],
    *,
    match: Sequence[str],
    mismatch: Sequence[str],
    where: str,
) -> Selector | None:
    """``sel`` with ``matchLabelKeys`` (``key In (own value)``) and ``mismatchLabelKeys``
    (``key NotIn (own value)``) added; keys the pod lacks add nothing, as upstream."""
    if not match and not mismatch:
        return sel
    if sel is None:
        raise errors.SnapshotError(f"{where}: matchLabelKeys needs a labelSelector")
    both = set(match) & set(mismatch)
    if both:
        raise errors.SnapshotError(
            f"{where}: key {sorted(both)[0]!r} is in both matchLabelKeys and mismatchLabelKeys"
        )
    extra = [LabelRequirement(k, "In", frozenset({own[k]})) for k in match if k in own]
    extra += [LabelRequirement(k, "NotIn", frozenset({own[k]})) for k in mismatch if k in own]
    return sel.with_requirements(extra)


def affinity_term(raw: Any, where: str, *, namespace: str, own: Mapping[str, str]) -> AffinityTerm:
    """One ``PodAffinityTerm`` of a pod in ``namespace`` whose labels are ``own``."""
    d = read_mapping(raw, where)
    read_only_fields(
        d,
        {
            "labelSelector",
            "namespaces",
            "namespaceSelector",
            "topologyKey",
            "matchLabelKeys",
            "mismatchLabelKeys",
        },
        where,
    )
    sel = selector(d.get("labelSelector"), f"{where}.labelSelector")
    sel = _folded(
        sel,
        own,
        match=_strings(d.get("matchLabelKeys"), f"{where}.matchLabelKeys"),
        mismatch=_strings(d.get("mismatchLabelKeys"), f"{where}.mismatchLabelKeys"),
        where=where,
    )
    names = frozenset(_strings(d.get("namespaces"), f"{where}.namespaces"))
    ns_selector = selector(d.get("namespaceSelector"), f"{where}.namespaceSelector")
    if not names and ns_selector is None:
        names = frozenset({namespace})
    return AffinityTerm(
        selector=sel,
        namespaces=names,
        namespace_selector=ns_selector,
        topology_key=_text(d.get("topologyKey"), f"{where}.topologyKey"),
    )


def _terms(
    raw: Any, where: str, *, namespace: str, own: Mapping[str, str]
) -> tuple[tuple[AffinityTerm, ...], tuple[WeightedTerm, ...]]:
    """A ``podAffinity`` or ``podAntiAffinity``: its required terms and its weighted preferred
    ones."""
    d = read_mapping(raw, where)
    read_only_fields(
        d,
        {
            "requiredDuringSchedulingIgnoredDuringExecution",
            "preferredDuringSchedulingIgnoredDuringExecution",
        },
        where,
    )
    w = f"{where}.requiredDuringSchedulingIgnoredDuringExecution"
    terms = read_sequence(d.get("requiredDuringSchedulingIgnoredDuringExecution"), w)
    required = tuple(
        affinity_term(t, f"{w}[{i}]", namespace=namespace, own=own) for i, t in enumerate(terms)
    )
    pw = f"{where}.preferredDuringSchedulingIgnoredDuringExecution"
    preferred = []
    for i, raw_term in enumerate(
        read_sequence(d.get("preferredDuringSchedulingIgnoredDuringExecution"), pw)
    ):
        tw = f"{pw}[{i}]"
        td = read_mapping(raw_term, tw)
        read_only_fields(td, {"weight", "podAffinityTerm"}, tw)
        weight = td.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, int) or not 1 <= weight <= 100:
            raise errors.SnapshotError(
                f"{tw}.weight: expected an integer from 1 to 100, got {weight!r}"
            )
        if td.get("podAffinityTerm") is None:
            raise errors.SnapshotError(f"{tw}.podAffinityTerm: missing")
        term = affinity_term(
            td["podAffinityTerm"], f"{tw}.podAffinityTerm", namespace=namespace, own=own
        )
        preferred.append(WeightedTerm(weight, term))
    return required, tuple(preferred)


_POLICIES = ("Honor", "Ignore")


def spread_constraint(
    raw: Any, where: str, *, own: Mapping[str, str]
) -> tuple[SpreadConstraint, bool]:
    """One ``topologySpreadConstraints`` entry, and whether it is hard (``DoNotSchedule``)."""
    d = read_mapping(raw, where)
    read_only_fields(
        d,
        {
            "maxSkew",
            "topologyKey",
            "whenUnsatisfiable",
            "labelSelector",
            "minDomains",
            "nodeAffinityPolicy",
            "nodeTaintsPolicy",
            "matchLabelKeys",
        },
        where,
    )
    skew = d.get("maxSkew")
    if isinstance(skew, bool) or not isinstance(skew, int) or skew < 1:
        raise errors.SnapshotError(f"{where}.maxSkew: expected an integer >= 1, got {skew!r}")
    key = _text(d.get("topologyKey"), f"{where}.topologyKey")
    when = d.get("whenUnsatisfiable")
    if when not in ("DoNotSchedule", "ScheduleAnyway"):
        raise errors.SnapshotError(
            f"{where}.whenUnsatisfiable: expected DoNotSchedule or ScheduleAnyway, got {when!r}"
        )
    sel = selector(d.get("labelSelector"), f"{where}.labelSelector")
    match = _strings(d.get("matchLabelKeys"), f"{where}.matchLabelKeys")
    if sel is not None and match:
        sel = sel.with_requirements(
            [LabelRequirement(k, "In", frozenset({own[k]})) for k in match if k in own]
        )
    min_domains = d.get("minDomains")
    if min_domains is not None:
        if isinstance(min_domains, bool) or not isinstance(min_domains, int) or min_domains < 1:
            raise errors.SnapshotError(
                f"{where}.minDomains: expected an integer >= 1, got {min_domains!r}"
            )
        if when != "DoNotSchedule":
            raise errors.SnapshotError(
                f"{where}.minDomains: only with whenUnsatisfiable DoNotSchedule"
            )
    policies: list[bool] = []
    for name, default in (("nodeAffinityPolicy", "Honor"), ("nodeTaintsPolicy", "Ignore")):
        value = d.get(name, default)
        if value not in _POLICIES:
            raise errors.SnapshotError(f"{where}.{name}: expected Honor or Ignore, got {value!r}")
        policies.append(value == "Honor")
    found = SpreadConstraint(
        max_skew=skew,
        topology_key=key,
        selector=sel,
        min_domains=min_domains or 1,
        honor_node_affinity=policies[0],
        honor_node_taints=policies[1],
    )
    return found, when == "DoNotSchedule"


def pod_terms(
    *, affinity: Any, spread: Any, labels_: Mapping[str, str], namespace: str, where: str
) -> PodTerms:
    """A pod's terms from its ``affinity`` (only the pod parts are read here; node affinity is
    the caller's) and ``topologySpreadConstraints``; errors name the field under ``where``."""
    aff = read_mapping(affinity, f"{where}.affinity")
    own = MappingProxyType(dict(labels_))
    pa, soft_pa = _terms(
        aff.get("podAffinity"), f"{where}.affinity.podAffinity", namespace=namespace, own=own
    )
    anti, soft_anti = _terms(
        aff.get("podAntiAffinity"),
        f"{where}.affinity.podAntiAffinity",
        namespace=namespace,
        own=own,
    )
    found = [
        spread_constraint(c, f"{where}.topologySpreadConstraints[{i}]", own=own)
        for i, c in enumerate(read_sequence(spread, f"{where}.topologySpreadConstraints"))
    ]
    return PodTerms(
        labels=own,
        affinity=pa,
        anti_affinity=anti,
        spread=tuple(c for c, hard in found if hard),
        preferred_affinity=soft_pa,
        preferred_anti_affinity=soft_anti,
        soft_spread=tuple(c for c, hard in found if not hard),
    )


# --------------------------------------------------------------------------- writing


def selector_document(sel: Selector) -> dict[str, Any]:
    """A selector in its Kubernetes form (``matchExpressions`` only, sorted)."""
    exprs = []
    for r in sorted(sel.requirements, key=lambda r: (r.key, r.operator, sorted(r.values))):
        e: dict[str, Any] = {"key": r.key, "operator": r.operator}
        if r.values:
            e["values"] = sorted(r.values)
        exprs.append(e)
    return {"matchExpressions": exprs}


def term_document(term: AffinityTerm) -> dict[str, Any]:
    """A resolved term in its Kubernetes form (namespaces always written out)."""
    out: dict[str, Any] = {"topologyKey": term.topology_key}
    if term.selector is not None:
        out["labelSelector"] = selector_document(term.selector)
    if term.namespaces:
        out["namespaces"] = sorted(term.namespaces)
    if term.namespace_selector is not None:
        out["namespaceSelector"] = selector_document(term.namespace_selector)
    return out


def affinity_document(terms: PodTerms) -> dict[str, Any]:
    """The pod parts of an ``affinity`` (empty when the pod has none)."""
    out: dict[str, Any] = {}
    for name, required, preferred in (
        ("podAffinity", terms.affinity, terms.preferred_affinity),
        ("podAntiAffinity", terms.anti_affinity, terms.preferred_anti_affinity),
    ):
        part: dict[str, Any] = {}
        if required:
            part["requiredDuringSchedulingIgnoredDuringExecution"] = [
                term_document(t) for t in required
            ]
        if preferred:
            part["preferredDuringSchedulingIgnoredDuringExecution"] = [
                {"weight": w.weight, "podAffinityTerm": term_document(w.term)} for w in preferred
            ]
        if part:
            out[name] = part
    return out


def spread_documents(terms: PodTerms) -> list[dict[str, Any]]:
    """A pod's ``topologySpreadConstraints``, hard then soft (empty when it has none)."""
    return [spread_document(c) for c in terms.spread] + [
        spread_document(c, hard=False) for c in terms.soft_spread
    ]


def spread_document(c: SpreadConstraint, *, hard: bool = True) -> dict[str, Any]:
    """A constraint in its Kubernetes form (``hard``: ``DoNotSchedule``, else
    ``ScheduleAnyway``)."""
    out: dict[str, Any] = {
        "maxSkew": c.max_skew,
        "topologyKey": c.topology_key,
        "whenUnsatisfiable": "DoNotSchedule" if hard else "ScheduleAnyway",
    }
    if c.selector is not None:
        out["labelSelector"] = selector_document(c.selector)
    if c.min_domains != 1:
        out["minDomains"] = c.min_domains
    if not c.honor_node_affinity:
        out["nodeAffinityPolicy"] = "Ignore"
    if c.honor_node_taints:
        out["nodeTaintsPolicy"] = "Honor"
    return out
