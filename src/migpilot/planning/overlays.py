"""Karpenter NodeOverlays that tell the autoscaler what MIG resources a new GPU node offers.

Why it exists: Karpenter launches a node for a pending pod only when an instance type's
resources cover the pod's requests. Cloud instance types list whole GPUs (``nvidia.com/gpu``),
never ``nvidia.com/mig-<profile>``, so a pod asking for a MIG instance would look impossible
to place and no node would come. A NodeOverlay (``karpenter.sh/v1alpha1``, Karpenter's
``NodeOverlay`` feature gate) adds extended resources to the instance types its requirements
select; :func:`node_overlay` writes one whose ``capacity`` lists every MIG resource of a GPU
model, at what that many empty GPUs could hold of each profile
(:func:`~migpilot.mig.capacity.profile_capacity`). ``migpilot autoscaling overlay`` prints it;
``docs/autoscaling.md`` says how the pieces fit.

Pure: plain data in, the object as a plain mapping out (the CLI writes it as YAML).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from migpilot import errors
from migpilot.mig import capacity, profiles
from migpilot.planning import snapshot

API_VERSION = "karpenter.sh/v1alpha1"
KIND = "NodeOverlay"

_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""A DNS subdomain (an object name), lower case."""
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
"""A label key's name part, or a label value (at most 63 characters)."""


@dataclass(frozen=True, slots=True)
class Requirement:
    """One requirement of the overlay: the label ``key`` has one of ``values``."""

    key: str
    values: tuple[str, ...]


def default_name(model: profiles.GpuModel, gpus: int) -> str:
    """``migpilot-<model>-x<gpus>``: ``migpilot-h100-80gb-x8``."""
    return f"migpilot-{model.id}-x{gpus}"


def _check_key(key: str, text: str) -> None:
    prefix, slash, name = key.rpartition("/")
    ok = (
        bool(name)
        and len(name) <= 63
        and _LABEL_NAME.match(name) is not None
        and (not slash or (len(prefix) <= 253 and _NAME.match(prefix) is not None))
    )
    if not ok:
        raise errors.ConfigError(
            f"requirement {text!r}: {key!r} is not a label key ([prefix/]name, e.g. "
            "node.kubernetes.io/instance-type)"
        )


def parse_requirements(texts: Sequence[str]) -> tuple[Requirement, ...]:
    """``key=value`` texts as requirements (operator ``In``), in the order their keys first
    appear; a key given twice takes both values. A text that is not ``key=value`` with a label
    key and a label value is a :class:`~migpilot.errors.ConfigError` naming it."""
    values: dict[str, list[str]] = {}
    for text in texts:
        key, eq, value = text.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key or not value:
            raise errors.ConfigError(
                f"requirement {text!r}: expected KEY=VALUE (e.g. "
                "node.kubernetes.io/instance-type=p5.48xlarge)"
            )
        _check_key(key, text)
        if len(value) > 63 or _LABEL_NAME.match(value) is None:
            raise errors.ConfigError(
                f"requirement {text!r}: {value!r} is not a label value (at most 63 letters, "
                "digits, '-', '_' or '.', starting and ending with a letter or digit)"
            )
        listed = values.setdefault(key, [])
        if value not in listed:
            listed.append(value)
    return tuple(Requirement(k, tuple(v)) for k, v in values.items())


def node_overlay(
    model: profiles.GpuModel,
    gpus: int,
    *,
    requirements: Sequence[Requirement],
    name: str | None = None,
) -> dict[str, Any]:
    """The NodeOverlay adding to the instance types ``requirements`` select one extended
    resource per MIG profile of ``model`` (``nvidia.com/mig-1g.10gb``...), counted for
    ``gpus`` empty GPUs. At least one requirement is needed: without one the overlay would
    give MIG resources to every instance type, GPU or not."""
    if not requirements:
        raise errors.ConfigError(
            "a NodeOverlay needs at least one requirement selecting the instance types that "
            f"have {gpus} {model.id} GPUs (e.g. node.kubernetes.io/instance-type=p5.48xlarge)"
        )
    name = default_name(model, gpus) if name is None else name
    if len(name) > 253 or _NAME.match(name) is None:
        raise errors.ConfigError(
            f"NodeOverlay name {name!r} is not a DNS subdomain (lower-case letters, digits, "
            "'-' and '.')"
        )
    counts = capacity.profile_capacity(model, gpus)
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "metadata": {"name": name},
        "spec": {
            "requirements": [
                {"key": r.key, "operator": "In", "values": list(r.values)} for r in requirements
            ],
            "capacity": {snapshot.resource_name(p): str(n) for p, n in counts.items() if n > 0},
        },
    }
