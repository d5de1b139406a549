"""The node's sharing config followed from files and the Node's label, and handed to the plugin.

One config file (``--device-plugin-config FILE``, what NVIDIA's plugin takes with
``--config-file``) or a named set (``--device-plugin-configs DIR``: a folder, or a mounted
ConfigMap, with one config per file), the one the node's ``nvidia.com/device-plugin.config``
label names (from the Node, through the Node watch of ``agent/statics.py``, or from a labels
file), else the default
(:mod:`migpilot.sharing.configsets`). Files are polled by stamp like the agent's other inputs.

:meth:`SharingFollower.refresh` re-reads when a file or the label changed; a config that parses,
validates and applies to the node's devices replaces the one served (the plugin's open streams
change at once, nothing restarts) and the state is ``success``; a bad one is logged, the last
good config stays served, and the state (label ``migpilot.io/sharing.state``) is ``failed``.
:meth:`SharingFollower.check` is the start-up check: it raises, so the CLI exits 2.

A shell module: it reads files; it never imports the CLI or gRPC.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Protocol

from migpilot import errors
from migpilot.agent import running
from migpilot.sharing import config as sharing_config
from migpilot.sharing import configsets, labelling

_log = logging.getLogger(__name__)

SUCCESS = "success"
FAILED = "failed"


class ConfigFiles(Protocol):
    """Where the config text comes from."""

    def stamp(self) -> Hashable:
        """Changes when a file that matters changed."""
        ...

    def load(self, label: str | None) -> tuple[str, sharing_config.Config]:
        """The config for a node with this label value: (what it is, the config)."""
        ...

    def describe(self) -> str:
        """For the log."""
        ...


class SingleFile:
    """One config file (NVIDIA's ``--config-file``); the node label plays no part."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def stamp(self) -> Hashable:
        """The file's stamp."""
        return running.file_stamp(self.path)

    def load(self, label: str | None) -> tuple[str, sharing_config.Config]:
        """The file, parsed."""
        return str(self.path), sharing_config.parse(_read(self.path), source=str(self.path))

    def describe(self) -> str:
        """For the log."""
        return f"sharing config {self.path}"


class NamedSet:
    """A folder of named configs (a mounted ConfigMap), one picked per node."""

    def __init__(self, folder: Path, *, selection: configsets.Selection) -> None:
        self.folder = folder
        self.selection = selection

    def names(self) -> tuple[str, ...]:
        """The config names in the folder (files only; a ConfigMap's ``..`` entries skipped)."""
        try:
            entries = sorted(os.listdir(self.folder))
        except OSError as err:
            raise errors.SharingConfigError(
                f"{self.folder}: cannot list the sharing configs: {err.strerror or err}"
            ) from None
        return tuple(
            n for n in entries if configsets.is_config_name(n) and (self.folder / n).is_file()
        )

    def stamp(self) -> Hashable:
        """Every config file's stamp (a ConfigMap update swaps them all)."""
        try:
            names = self.names()
        except errors.SharingConfigError:
            return None
        return tuple((n, running.file_stamp(self.folder / n)) for n in names)

    def load(self, label: str | None) -> tuple[str, sharing_config.Config]:
        """The config the label (or the default, or a fallback) picks."""
        name = configsets.select(self.names(), label=label, selection=self.selection)
        if name is None:
            return "the empty config (no sharing)", sharing_config.EMPTY
        path = self.folder / name
        return f"config {name!r} ({path})", sharing_config.parse(_read(path), source=str(path))

    def check_all(self) -> None:
        """Parse every config in the set (the start-up check)."""
        for name in self.names():
            path = self.folder / name
            sharing_config.parse(_read(path), source=str(path))

    def describe(self) -> str:
        """For the log."""
        default = self.selection.default or "none"
        return (
            f"sharing configs in {self.folder}, picked by the node label "
            f"{self.selection.label} (default: {default})"
        )


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise errors.SharingConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as err:
        raise errors.SharingConfigError(f"{path}: {err.strerror or err}") from None


class LabelsFileLabel:
    """The label's value from a ``key=value`` labels file (standalone; no API server)."""

    def __init__(self, path: Path, *, key: str = configsets.CONFIG_LABEL) -> None:
        self.path = path
        self.key = key

    def __call__(self) -> str | None:
        """The value now (``None``: no file, or no such line)."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        try:
            return running.parse_labels(text, source=str(self.path)).get(self.key) or None
        except errors.MigpilotError:
            return None


def no_label() -> str | None:
    """No label source: the node has no label."""
    return None


class SharingFollower:
    """The config served now, re-read when its inputs change (see the module docstring)."""

    def __init__(
        self,
        files: ConfigFiles,
        *,
        apply: Callable[[sharing_config.Config], None],
        mig_strategy: str,
        label: Callable[[], str | None] = no_label,
    ) -> None:
        self._files = files
        self._apply = apply
        self._strategy = mig_strategy
        self._label = label
        self._lock = threading.Lock()
        self._seen: Hashable = object()
        self._current = sharing_config.EMPTY
        self._state: str | None = None
        self.problem: str | None = None
        """Why the newest config is not served, or ``None``."""

    def fingerprint(self) -> Hashable:
        """The files' stamps and the label's value."""
        return (self._files.stamp(), self._label())

    def changed(self) -> bool:
        """True when the inputs changed since the last refresh."""
        return self.fingerprint() != self._seen

    def check(self) -> sharing_config.Config:
        """Load and validate the config for the node now, raising on a problem (start-up)."""
        _, found = self._files.load(self._label())
        found.check_mig_strategy(self._strategy)
        return found

    def refresh(self) -> None:
        """Serve the newest config if its inputs changed and it is good; else keep the last."""
        with self._lock:
            fingerprint = self.fingerprint()
            if fingerprint == self._seen:
                return
            self._seen = fingerprint
            try:
                what, found = self._files.load(self._label())
                found.check_mig_strategy(self._strategy)
                self._apply(found)
            except (errors.MigpilotError, OSError) as err:
                self._state, self.problem = FAILED, str(err)
                _log.error("sharing config not applied, keeping the last good one: %s", err)
                return
            for warning in found.warnings:
                _log.warning("%s: %s", what, warning)
            if found.mig_strategy is not None and found.mig_strategy != self._strategy:
                _log.warning(
                    "%s: flags.migStrategy=%s ignored: the agent runs --strategy %s (set at start)",
                    what,
                    found.mig_strategy,
                    self._strategy,
                )
            if found != self._current or self._state != SUCCESS:
                names = ", ".join(r.name for r in (found.active.resources if found.active else ()))
                _log.info("sharing: %s: %s%s", what, found.strategy.value,
                          f" ({names})" if names else "")  # fmt: skip
            self._current, self._state, self.problem = found, SUCCESS, None

    def current(self) -> sharing_config.Config:
        """The config served now (the last good one)."""
        with self._lock:
            return self._current

    def labels(self) -> dict[str, str]:
        """``migpilot.io/sharing.state`` once a config was read."""
        with self._lock:
            state = self._state
        return {} if state is None else {labelling.STATE_LABEL: state}

    def describe(self) -> str:
        """For the log."""
        return self._files.describe()
