"""The DRA kubelet plugin of one node, built from the agent's parts and started.

Why it exists: the agent's assembly (:mod:`migpilot.agent.assembling`) should gain a call or two
for a node in DRA mode, not the plugin's wiring. :func:`build` makes the real Protocols (the
claims read through the agent's Kubernetes API, the instances on its MIG backend with their
ledger, the CDI spec files) and hands back what the agent needs: :attr:`DraNode.instances`, an
in-use source for the reconciler, then :meth:`DraNode.start` serves the kubelet's sockets at the
paths below the kubelet's folder and :meth:`DraNode.stop` ends it; :func:`start` is both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from migpilot import errors
from migpilot.agent import reconciling
from migpilot.agent.dra import apiclaims, cdiclaims, gpuinstances, placements, preparing, serving
from migpilot.gpu import backend


@dataclass(frozen=True, slots=True)
class DraPaths:
    """Where the plugin's sockets, ledger and CDI specs go."""

    kubelet_dir: Path
    """The kubelet's folder (``--kubelet-dir``, ``/var/lib/kubelet``): the registration socket
    goes in its ``plugins_registry/``, the DRA socket in ``plugins/mig.migpilot.io/``."""
    cdi_spec_dir: Path
    """The CDI spec folder (``--cdi-spec-dir``, ``/var/run/cdi``)."""
    proc_root: Path = Path("/")
    """Below it, ``proc/driver/nvidia/...`` (the emulated backend's own under tests)."""
    ledger_file: Path | None = None
    """The claims ledger; ``None``: ``<kubelet_dir>/migpilot/dra-claims.json``."""

    def plugin_settings(self, driver: str = placements.DRIVER) -> serving.PluginSettings:
        """The kubelet plugin's socket folders below :attr:`kubelet_dir`."""
        return serving.PluginSettings(
            driver=driver,
            plugins_dir=self.kubelet_dir / "plugins",
            registry_dir=self.kubelet_dir / "plugins_registry",
        )

    @property
    def ledger(self) -> Path:
        """The claims ledger's file."""
        if self.ledger_file is not None:
            return self.ledger_file
        return self.kubelet_dir / "migpilot" / "dra-claims.json"


@dataclass(frozen=True, slots=True)
class DraNode:
    """A started kubelet plugin and its parts."""

    plugin: serving.KubeletPlugin
    instances: gpuinstances.BackendInstances
    """Its claims' instances: an in-use source for the reconciler."""
    specs: cdiclaims.ClaimSpecs

    def start(self) -> None:
        """Serve the kubelet."""
        self.plugin.start()

    def stop(self) -> None:
        """Stop serving the kubelet (claims stay prepared: their instances and specs remain);
        nothing when it was not started."""
        self.plugin.stop()


def build(
    gpus: backend.GpuBackend,
    api: apiclaims.ClaimReader,
    *,
    node: str,
    paths: DraPaths,
    in_use: reconciling.InUse,
) -> DraNode:
    """Build the plugin for ``node`` (its pool), not served yet: its ledger is read and
    reconciled. ``in_use``: the agent's other in-use sources, asked before a claim's instance
    is destroyed."""
    ledger = paths.ledger
    try:
        ledger.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise errors.AgentConfigError(
            f"DRA claims ledger {ledger}: cannot create {ledger.parent}: {err.strerror or err}"
        ) from None
    instances = gpuinstances.BackendInstances(gpus, ledger_file=ledger, in_use=in_use)
    specs = cdiclaims.ClaimSpecs(gpus, spec_dir=paths.cdi_spec_dir, proc_root=paths.proc_root)
    prepares = preparer(gpus, api, node=node, instances=instances, specs=specs)
    plugin = serving.KubeletPlugin(prepares, paths.plugin_settings())
    return DraNode(plugin=plugin, instances=instances, specs=specs)


def preparer(
    gpus: backend.GpuBackend,
    api: apiclaims.ClaimReader,
    *,
    node: str,
    instances: preparing.Instances,
    specs: preparing.CdiSpecs,
) -> preparing.Preparer:
    """What prepares and unprepares ``node``'s claims (its pool) on ``gpus``: the plugin's, and
    the KWOK fleet's stand-in kubelet's (``migpilot.kwok.drastandin``), which calls it
    directly."""
    models = {g.index: g.model for g in gpus.gpus() if g.model is not None}
    return preparing.Preparer(apiclaims.ApiClaims(api), instances, models, node, specs=specs)


def start(
    gpus: backend.GpuBackend,
    api: apiclaims.ClaimReader,
    *,
    node: str,
    paths: DraPaths,
    in_use: reconciling.InUse,
) -> DraNode:
    """:func:`build`, then serve the kubelet."""
    built = build(gpus, api, node=node, paths=paths, in_use=in_use)
    built.start()
    return built
