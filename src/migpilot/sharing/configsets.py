"""A named set of sharing configs, one picked per node by a label, as NVIDIA's config-manager does.

NVIDIA's GPU Operator mounts a ConfigMap of named configs (one file per key) and its
config-manager (k8s-device-plugin ``cmd/config-manager``) links the one the Node's
``nvidia.com/device-plugin.config`` label names; without the label it takes the default name,
else walks the fallbacks (``named``: a config called ``default``; ``single``: the only config;
``empty``: no sharing). Its errors are kept: ``specified config X does not exist``, ``no
configuration files available``, ``no config was set, no default was provided, and all
fallbacks failed``. Which file names count follows it too: directories and the ``..``-prefixed
entries a mounted ConfigMap carries are skipped (:func:`is_config_name`).

Pure: names and texts in, the pick out; listing the folder is the shell's job.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from migpilot import errors

CONFIG_LABEL = "nvidia.com/device-plugin.config"
"""The node label that names the config (config-manager's ``--node-label`` default)."""
NAMED_FALLBACK = "default"
"""The config the ``named`` fallback looks for."""


class Fallback(enum.StrEnum):
    """config-manager's ``--fallback-strategies``."""

    NAMED = "named"
    SINGLE = "single"
    EMPTY = "empty"

    @staticmethod
    def parse(text: str) -> Fallback:
        """The fallback named ``text``; NVIDIA's ``unknown fallback strategy`` error if none."""
        try:
            return Fallback(text.strip())
        except ValueError:
            raise errors.SharingConfigError(f"unknown fallback strategy: {text}") from None


@dataclass(frozen=True, slots=True)
class Selection:
    """How a node's config is chosen from a set."""

    default: str | None = None
    """The config to use when the node has no label (config-manager's ``--default-config``)."""
    fallbacks: tuple[Fallback, ...] = (Fallback.NAMED, Fallback.EMPTY)
    """Tried in order when there is neither label nor default (migpilot's default: a config
    named ``default``, else no sharing)."""
    label: str = CONFIG_LABEL
    """The node label naming the config."""


def is_config_name(name: str) -> bool:
    """True for a file name that is a config (not ``..data`` and the like of a ConfigMap)."""
    return bool(name) and not name.startswith("..") and "/" not in name


def select(names: Collection[str], *, label: str | None, selection: Selection) -> str | None:
    """The config to use (``None``: the empty config), given the set's names and the label's
    value (``None`` or empty: no label)."""
    available = sorted(n for n in names if is_config_name(n))
    if not available:
        raise errors.SharingConfigError("no configuration files available")
    if label:
        if label not in available:
            raise errors.SharingConfigError(
                f"specified config {label} does not exist (the node's {selection.label} label; "
                f"configs: {', '.join(available)})"
            )
        return label
    if selection.default:
        if selection.default not in available:
            raise errors.SharingConfigError(
                f"specified config {selection.default} does not exist (the default; configs: "
                f"{', '.join(available)})"
            )
        return selection.default
    for fallback in selection.fallbacks:
        if fallback is Fallback.NAMED and NAMED_FALLBACK in available:
            return NAMED_FALLBACK
        if fallback is Fallback.SINGLE and len(available) == 1:
            return available[0]
        if fallback is Fallback.EMPTY:
            return None
    raise errors.SharingConfigError(
        "no config was set, no default was provided, and all fallbacks failed"
    )


def parse_fallbacks(texts: Sequence[str]) -> tuple[Fallback, ...]:
    """Fallbacks from their names (``named,single,empty``)."""
    return tuple(Fallback.parse(t) for t in texts if t.strip())
