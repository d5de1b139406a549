"""Error types shared by every layer.

Every error a user can cause (an unknown GPU, a misspelt profile, a malformed file, a layout
that cannot be placed) is a :class:`MigpilotError` whose message is one line that names the
problem. The CLI prints that line and exits with code 2; nothing else should reach a user as a
traceback. This module imports nothing from the project, so any layer may use it.
"""

from __future__ import annotations

import reprlib

SHOWN_CHARS = 200
"""The most characters of a user's value an error message quotes (:func:`shown`)."""

_REPR = reprlib.Repr()  # keyword arguments only from Python 3.12
_REPR.maxlevel = 3
_REPR.maxtuple = _REPR.maxlist = _REPR.maxarray = _REPR.maxdict = 6
_REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 6
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlong = 40


def shown(value: object) -> str:
    """``repr(value)`` cut to a few levels, items and :data:`SHOWN_CHARS` characters, for an
    error message that quotes what a user wrote. A YAML alias bomb (nine lists of nine
    references each) is a few objects in memory but ~10**9 items in a plain ``repr``: a message
    that quoted it whole once wrote gigabytes of log."""
    text = _REPR.repr(value)
    return text if len(text) <= SHOWN_CHARS else text[: SHOWN_CHARS - 3] + "..."


class MigpilotError(Exception):
    """Base class for errors caused by bad input; ``str(err)`` is a one-line explanation."""


class UnknownGpuError(MigpilotError):
    """A GPU name, alias or PCI device id that the catalog does not know."""


class UnknownProfileError(MigpilotError):
    """A MIG profile name that the GPU does not offer (after tolerant name resolution)."""


class CatalogError(MigpilotError):
    """The shipped catalog data is inconsistent (a bug in the package, caught at load time)."""


class LayoutError(MigpilotError):
    """A set of MIG instances that is not a valid layout, or a multiset that cannot be placed."""


class ConfigError(MigpilotError):
    """A nvidia-mig-parted config file that does not parse or does not validate."""


class SnapshotError(MigpilotError):
    """A cluster snapshot file that does not parse or describes an impossible cluster."""


class TraceError(MigpilotError):
    """A workload trace (openb CSV, MIG-native CSV, synthetic name) that does not parse."""


class AgentConfigError(MigpilotError):
    """Node-agent settings that cannot work: unknown strategy or backend, unplaceable layout."""


class ClusterSpecError(MigpilotError):
    """A simulated cluster spec (``h100-80gb:8x8,a100-80gb:4x8``) that does not parse."""


class GpuLayoutError(MigpilotError):
    """A GpuLayout object (migpilot.io/v1alpha1) that does not parse or describes an impossible
    layout; the message names the field (``spec.gpus[1].instances[0].start: ...``)."""


class SharingConfigError(MigpilotError):
    """A GPU sharing config (NVIDIA's device-plugin config file: time-slicing, MPS) that does
    not parse, does not validate, or cannot be applied to the node; the message names the field
    (``sharing.timeSlicing.resources[0].replicas: ...``)."""
