"""The CDI spec file on the node: the driver's files read, the spec written (``docs/cdi.md``).

Why it exists: :mod:`cdi` builds the spec from facts; this shell gets the facts (the GPUs'
``/proc/driver/nvidia/gpus/*/information`` and the MIG devices' capability files, below a proc
root that tests and the emulated backend move) and replaces the spec file atomically (a temporary
file beside it, then a rename: a runtime reading the folder sees the old spec or the new one,
never half of one) whenever the advertised devices change. The device plugin calls
:meth:`CdiWriter.write` before it advertises a view (a new device is in the spec before the
kubelet can hand it out; a destroyed one leaves it in the same write); on a node without a
kubelet (``--kubelet simulated``) :class:`CdiListener` does it after each pass, told before the
stand-in kubelet publishes the Node's counts.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path

from migpilot import errors, files
from migpilot.agent.deviceplugin import advertising, cdi, devices
from migpilot.agent.rules import changes

DEFAULT_SPEC_DIR = Path("/var/run/cdi")
DEFAULT_PROC_ROOT = Path("/")

_log = logging.getLogger(__name__)


def spec_file_name(node: str) -> str:
    """``migpilot-<node>.json``: one file per node agent (several agents may share a folder)."""
    if not node or "/" in node or node.startswith("."):
        raise errors.AgentConfigError(f"node name {node!r} cannot name a CDI spec file")
    return f"migpilot-{node}.json"


def read_gpu_minors(proc_root: Path) -> dict[str, int]:
    """GPU UUID -> device minor, from every ``<proc>/driver/nvidia/gpus/*/information`` (an
    absent folder: no GPU known; an unreadable or malformed file is skipped and logged)."""
    folder = proc_root / "proc" / cdi.PROC_GPUS
    found: dict[str, int] = {}
    try:
        entries = sorted(folder.iterdir())
    except OSError:
        return found
    for entry in entries:
        path = entry / "information"
        try:
            uuid, minor = cdi.parse_information(path.read_text(encoding="utf-8"), where=str(path))
        except (OSError, UnicodeDecodeError, cdi.CdiError) as err:
            _log.error("CDI: cannot read %s: %s", path, err)
            continue
        found[uuid] = minor
    return found


def read_caps(proc_root: Path, caps: tuple[str, ...]) -> dict[str, int]:
    """Capability name -> its ``DeviceFileMinor``, for those whose file reads."""
    found: dict[str, int] = {}
    for cap in caps:
        path = proc_root / "proc" / cdi.cap_proc_path(cap)
        try:
            found[cap] = cdi.parse_access(path.read_text(encoding="utf-8"), where=str(path))
        except FileNotFoundError:
            continue  # reported by cdi.build as the device's missing file
        except (OSError, UnicodeDecodeError, cdi.CdiError) as err:
            _log.error("CDI: cannot read %s: %s", path, err)
    return found


def read_facts(proc_root: Path, node: devices.NodeDevices) -> cdi.DriverFacts:
    """What the driver's files say about ``node``'s GPUs and MIG devices."""
    minors = read_gpu_minors(proc_root)
    return cdi.DriverFacts(minors, read_caps(proc_root, cdi.mig_caps(node, minors)))


class CdiWriter:
    """Writes one node agent's CDI spec file; thread-safe. Creating it makes the folder."""

    def __init__(self, spec_dir: Path, *, node: str, proc_root: Path, kind: str) -> None:
        self.path = spec_dir / spec_file_name(node)
        self.kind = kind
        self._proc_root = proc_root
        self._lock = threading.Lock()
        self._written: str | None = None
        self._reported: frozenset[str] = frozenset()
        try:
            spec_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise errors.AgentConfigError(
                f"--cdi-spec-dir {spec_dir}: cannot create it: {err.strerror or err}"
            ) from None

    def write(
        self, node: devices.NodeDevices, resources: tuple[devices.Resource, ...]
    ) -> frozenset[str]:
        """Write the spec of ``resources`` (when it changed); the advertised device IDs it
        could not describe (to be advertised Unhealthy). A failed write leaves every new
        device without its entry: all of them are then returned."""
        with self._lock:
            built = cdi.build(node, resources, read_facts(self._proc_root, node), kind=self.kind)
            missing = built.missing_ids()
            if missing != self._reported:
                for m in built.missing:
                    _log.error("CDI: no spec entry for %s: %s", m.device_id, m.reason)
                self._reported = missing
            text = json.dumps(built.spec.document(), indent=1) + "\n"
            if text == self._written:
                return missing
            try:
                # Readable by all, as nvidia-ctk writes its specs: tools other than the runtime
                # (nvidia-ctk cdi list, podman) read them as any user.
                files.write_atomically(self.path, text, durable=True, mode=0o644)
            except OSError as err:
                _log.error("CDI: cannot write %s: %s", self.path, err.strerror or err)
                self._written = None
                old = _names(self.path)
                return missing | frozenset(
                    d.id
                    for r in resources
                    for d in r.devices
                    if cdi.spec_device_id(d.id) not in old
                )
            self._written = text
            _log.info("CDI spec %s written (%d devices)", self.path, len(built.spec.devices))
            return missing


def _names(path: Path) -> frozenset[str]:
    """The device names of the spec file as it is (none when it cannot be read)."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        return frozenset(str(d["name"]) for d in doc["devices"])
    except (OSError, ValueError, KeyError, TypeError):
        return frozenset()


class CdiListener:
    """On a node without a device plugin (``--kubelet simulated``): the spec of what the node
    advertises, written after each pass, before the stand-in kubelet is told (list it first)."""

    def __init__(self, writer: CdiWriter, *, strategy: devices.MigStrategy) -> None:
        self._writer = writer
        self._strategy = strategy

    def passed(
        self,
        *,
        state: Mapping[int, changes.GpuState],
        report: changes.Report | None,
        labels: Mapping[str, str],
        view: devices.NodeDevices,
    ) -> None:
        """Write the spec of the view's advertised devices (replicas name the same real
        devices, so the unshared resources give the same spec)."""
        try:
            resources = advertising.resources_for(view, self._strategy)
        except advertising.InvalidMigConfigurationError:
            resources = ()  # the single strategy advertises nothing
        self._writer.write(view, resources)
