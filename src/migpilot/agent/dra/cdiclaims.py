"""The kubelet plugin's :class:`~preparing.CdiSpecs`: one CDI spec file per prepared claim.

Why it exists: :mod:`cdispecs` builds a claim's spec from facts; this shell gets them (the MIG
device's GPU and instance ids from the backend, the device minors from the driver's files below
the proc root, read as the device plugin's :mod:`~migpilot.agent.deviceplugin.cdifiles` reads
them) and writes the file atomically (a temporary file, then a rename: a runtime sees the whole
spec or none), readable by all as nvidia-ctk writes its specs. Removing a claim's spec is
unlinking its file.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from migpilot import errors, files
from migpilot.agent.deviceplugin import cdi, cdifiles
from migpilot.agent.dra import cdispecs, placements, preparing
from migpilot.gpu import backend

_log = logging.getLogger(__name__)


class ClaimSpecs:
    """Writes and removes the CDI spec files of prepared claims in one folder."""

    def __init__(
        self,
        gpus: backend.GpuBackend,
        *,
        spec_dir: Path,
        proc_root: Path,
        kind: str = placements.CDI_KIND,
    ) -> None:
        self._backend = gpus
        self.spec_dir = spec_dir
        self.kind = kind
        self._proc_root = proc_root
        try:
            spec_dir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise errors.AgentConfigError(
                f"CDI spec folder {spec_dir}: cannot create it: {err.strerror or err}"
            ) from None

    def path(self, owner: str) -> Path:
        """The spec file of claim ``owner``."""
        return self.spec_dir / cdispecs.spec_file_name(owner)

    def _locate(self, name: str, instance: preparing.Instance) -> cdispecs.Located:
        gpu = instance.placement.gpu
        info = next((g for g in self._backend.gpus() if g.index == gpu), None)
        if info is None:
            raise cdi.CdiError(f"{name}: this node has no GPU {gpu}")
        if isinstance(instance.placement, placements.WholeGpu):
            return cdispecs.Located(name, info.uuid)
        dev = next((d for d in self._backend.mig_devices(gpu) if d.uuid == instance.uuid), None)
        if dev is None:
            raise cdi.CdiError(f"{name}: GPU {gpu} has no MIG device {instance.uuid}")
        return cdispecs.Located(name, info.uuid, dev.gi_id, dev.ci_id)

    def write(
        self, owner: str, devices: Sequence[tuple[str, preparing.Instance]]
    ) -> Mapping[str, str]:
        """Write claim ``owner``'s spec; each device's CDI ID as written."""
        located = [self._locate(name, instance) for name, instance in devices]
        minors = cdifiles.read_gpu_minors(self._proc_root)
        facts = cdi.DriverFacts(
            minors, cdifiles.read_caps(self._proc_root, cdispecs.caps(located, minors))
        )
        spec = cdispecs.build(located, facts, kind=self.kind)
        path = self.path(owner)
        try:
            text = json.dumps(spec.document(), indent=1) + "\n"
            files.write_atomically(path, text, durable=True, mode=0o644)
        except OSError as err:
            raise cdi.CdiError(f"cannot write {path}: {err.strerror or err}") from None
        _log.info("CDI spec %s written (%d devices)", path, len(spec.devices))
        return {d.name: f"{spec.kind}={d.name}" for d in spec.devices}

    def remove(self, owner: str) -> None:
        """Remove claim ``owner``'s spec file (none is no error)."""
        path = self.path(owner)
        try:
            path.unlink(missing_ok=True)
        except OSError as err:
            raise cdi.CdiError(f"cannot remove {path}: {err.strerror or err}") from None
