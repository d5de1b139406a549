"""The sharing part of gpu-feature-discovery's labels, from the sharing config.

GFD (k8s-device-plugin ``internal/lm/resource.go``) labels each resource by its own name, even
when its replicas are advertised renamed: ``<resource>.replicas`` is the first sharing entry's
replicas for it (1 when the config shares it not; 0 for whole-GPU labels of MIG-enabled GPUs,
which are written without sharing), ``<resource>.sharing-strategy`` is the config's strategy
when replicas exceed 1 (else ``none``), and ``<resource>.product`` gains ``-SHARED`` when the
resource is shared and not renamed. ``nvidia.com/mps.capable`` is ``true`` only under MPS on a
node without MIG-enabled GPUs. Pure.
"""

from __future__ import annotations

from dataclasses import dataclass

from migpilot.sharing import config as sharing_config

SHARED_PRODUCT_SUFFIX = "SHARED"
STATE_LABEL = "migpilot.io/sharing.state"
"""How applying the node's sharing config went: ``success`` or ``failed`` (the last good
config is still served), as mig-manager's ``nvidia.com/mig.config.state``."""


@dataclass(frozen=True, slots=True)
class ResourceSharing:
    """The sharing labels of one resource."""

    replicas: int
    strategy: str
    """``none``, ``time-slicing`` or ``mps``."""
    shared_product: bool
    """Whether ``-SHARED`` is appended to the product label."""


def resource_sharing(sharing: sharing_config.Config | None, resource: str) -> ResourceSharing:
    """GFD's ``replicas``, ``sharing-strategy`` and product suffix for ``resource``; ``sharing``
    ``None`` labels without sharing (replicas 0, as GFD for MIG-enabled GPUs' whole-GPU labels)."""
    if sharing is None:
        return ResourceSharing(0, sharing_config.SharingStrategy.NONE.value, False)
    entries = sharing.entries_for(resource)
    replicas = entries[0].replicas if entries and entries[0].replicas > 0 else 1
    strategy = sharing.strategy if replicas > 1 else sharing_config.SharingStrategy.NONE
    renamed = bool(entries) and entries[0].rename is not None
    return ResourceSharing(replicas, strategy.value, replicas > 1 and not renamed)


def mps_capable(sharing: sharing_config.Config, *, any_mig_enabled: bool) -> bool:
    """``nvidia.com/mps.capable``."""
    return sharing.strategy is sharing_config.SharingStrategy.MPS and not any_mig_enabled
