"""Node labels as NVIDIA's gpu-feature-discovery writes them, from the device view.

Users select nodes by these labels (``nvidia.com/gpu.product``, ``nvidia.com/mig-1g.10gb.count``),
so keys and values follow GFD exactly (k8s-device-plugin ``internal/lm``): the full-GPU labels
(``gpu.product``/``count``/``memory``/``replicas``/``sharing-strategy``/``family``/
``compute.major``/``compute.minor``), ``mig.capable``, ``mps.capable``, ``mig.strategy`` for the
single and mixed strategies, and the MIG labels: under ``single`` the ``nvidia.com/gpu.*`` keys
describe the one MIG profile (product ``<GPU>-MIG-<profile>``, or ``<GPU>-MIG-INVALID`` with
zero count when the node breaks the strategy's invariants); under ``mixed`` each profile has
``nvidia.com/mig-<profile>.{product,count,replicas,sharing-strategy,memory,multiprocessors,
slices.gi,slices.ci,engines.copy,engines.decoder,engines.encoder,engines.jpeg,engines.ofa}``.
MIG attributes come from the catalog profile; a value the catalog does not know is left out
rather than guessed. Driver/CUDA version and machine-type labels need facts this view does not
carry and are not produced. Under a sharing config (NVIDIA's time-slicing or MPS,
``docs/sharing.md``) ``replicas``, ``sharing-strategy``, the product's ``-SHARED`` suffix and
``mps.capable`` follow GFD (:mod:`migpilot.sharing.labelling`); without one ``replicas`` is 1 (0
for MIG-enabled GPUs, as GFD) and ``sharing-strategy`` is ``none``.

:func:`config_state` gives the ``nvidia.com/mig.config.state`` label NVIDIA's mig-manager sets
beside ``nvidia.com/mig.config`` (``success``, ``pending`` or ``failed``), which the GPU
Operator's components and admins' scripts wait on.

Pure functions: no I/O, no clock. GFD iterates Go maps where several GPU products share the
``nvidia.com/gpu.*`` keys; here the order is fixed (products by name, MIG-disabled last).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from migpilot.agent.deviceplugin import advertising, devices
from migpilot.agent.rules import changes
from migpilot.mig import profiles
from migpilot.sharing import config as sharing_config
from migpilot.sharing import labelling

_GPU = "nvidia.com/gpu"
_INVALID = "INVALID"
CONFIG_STATE_LABEL = "nvidia.com/mig.config.state"
"""mig-manager's label saying how applying ``nvidia.com/mig.config`` went."""


def config_state(report: changes.Report | None, *, unavailable: bool) -> str:
    """``nvidia.com/mig.config.state`` after a pass, as mig-manager uses its values.

    ``failed``: the desired layout could not be read or placed (``unavailable``), a driver call
    failed, or something is refused that waiting will not fix (a MIG mode change needs a GPU
    reset); ``pending``: not there yet, but it will be (instances in use are in the way, or
    actions are left for the next pass); ``success``: the GPUs have the desired layout.
    """
    if unavailable or report is None:
        return "failed"
    if report.outcomes(changes.Outcome.FAILED):
        return "failed"
    if any(not r.in_use for r in report.refusals):
        return "failed"
    return "success" if report.converged and not report.refusals else "pending"


MIG_MODE_STATE_LABEL = "migpilot.io/mig-mode.state"
"""On a node labelled ``migpilot.io/mig-mode=dynamic``: whether its GPUs have the MIG modes
asked for (``success``, ``pending``, ``failed``), as ``nvidia.com/mig.config.state`` says it of
the layout."""


def mig_mode_state(
    report: changes.Report,
    *,
    state: Mapping[int, changes.GpuState],
    desired: Mapping[int, changes.DesiredGpu],
) -> str:
    """``migpilot.io/mig-mode.state`` after a pass: ``failed`` when a mode change failed in the
    driver; ``pending`` while a GPU's current or pending mode is not the one asked for (its
    GPU in use, a reset awaited); else ``success``."""
    for applied in report.outcomes(changes.Outcome.FAILED):
        if applied.change.kind is changes.ChangeKind.SET_MIG_MODE:
            return "failed"
    for index, want in desired.items():
        gpu = state.get(index)
        mig = gpu.info.mig if gpu is not None and gpu.info.model is not None else None
        if mig is not None and (mig.current, mig.pending) != (want.mig_enabled,) * 2:
            return "pending"
    return "success"


def node_labels(
    node: devices.NodeDevices,
    strategy: devices.MigStrategy,
    *,
    sharing: sharing_config.Config = sharing_config.EMPTY,
) -> dict[str, str]:
    """The GFD labels for ``node`` under ``strategy`` and ``sharing`` (empty when the node has
    no GPU)."""
    if not node.gpus:
        return {}
    any_mig = any(g.mig_enabled for g in node.gpus)
    capable = labelling.mps_capable(sharing, any_mig_enabled=any_mig)
    labels: dict[str, str] = {
        "nvidia.com/mig.capable": "true",  # every catalog GPU is MIG-capable
        "nvidia.com/mps.capable": str(capable).lower(),
    }
    labels |= _full_gpu_labels(node, sharing)
    if strategy is devices.MigStrategy.NONE:
        return labels
    labels["nvidia.com/mig.strategy"] = strategy.value
    if strategy is devices.MigStrategy.SINGLE:
        labels |= _single_labels(node, sharing)
    else:
        labels |= _mixed_labels(node, sharing)
    return labels


def arch_family(major: int, minor: int) -> str:
    """GFD's ``nvidia.com/gpu.family`` for a CUDA compute capability."""
    match major:
        case 1:
            return "tesla"
        case 2:
            return "fermi"
        case 3:
            return "kepler"
        case 5:
            return "maxwell"
        case 6:
            return "pascal"
        case 7:
            return "volta" if minor < 5 else "turing"
        case 8:
            return "ampere" if minor < 9 else "ada-lovelace"
        case 9:
            return "hopper"
        case 10 | 12:
            return "blackwell"
    return "undefined"


def sanitise(text: str) -> str:
    """GFD's label-value sanitiser: drop characters outside ``[A-Za-z0-9-_. ]``, join words
    with ``-``."""
    return "-".join(re.sub(r"[^A-Za-z0-9\-_. ]", "", text).split())


def product(*parts: str) -> str:
    """A ``product`` label value: the sanitised non-empty parts joined by ``-``."""
    return "-".join(sanitise(p) for p in parts if p)


def _resource_labels(resource: str, values: Mapping[str, object]) -> dict[str, str]:
    return {f"{resource}.{suffix}": str(value) for suffix, value in values.items()}


def _full_gpu_labels(node: devices.NodeDevices, sharing: sharing_config.Config) -> dict[str, str]:
    counts: dict[str, int] = {}
    first: dict[tuple[bool, str], devices.Gpu] = {}
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        counts[gpu.product_name] = counts.get(gpu.product_name, 0) + 1
        first.setdefault((not gpu.mig_enabled, gpu.product_name), gpu)
    labels: dict[str, str] = {}
    # MIG-enabled products first; whole GPUs override them, as in GFD.
    for (whole, name), gpu in sorted(first.items()):
        major, minor = gpu.model.compute_capability
        # GFD labels MIG-enabled GPUs' whole-GPU keys without sharing.
        shared = labelling.resource_sharing(sharing if whole else None, _GPU)
        values: dict[str, object] = {
            "product": _shared_product(shared, name),
            "count": counts[name],
            "replicas": shared.replicas,
            "sharing-strategy": shared.strategy,
            "memory": gpu.memory_mib,
            "family": arch_family(major, minor),
            "compute.major": major,
            "compute.minor": minor,
        }
        labels |= _resource_labels(_GPU, values)
    return labels


def _mig_name(profile: profiles.Profile) -> str:
    # GFD names MIG devices with NVML's profile string, "+" spelt "." (1g.10gb.me).
    return profile.name.replace("+", ".")


def _shared_product(shared: labelling.ResourceSharing, *parts: str) -> str:
    suffix = labelling.SHARED_PRODUCT_SUFFIX if shared.shared_product else ""
    return product(*parts, suffix)


def _mig_labels(
    resource: str,
    parent: devices.Gpu,
    profile: profiles.Profile,
    count: int,
    sharing: sharing_config.Config,
) -> dict[str, str]:
    engines = profile.engines
    attributes: dict[str, int | None] = {
        "memory": profile.memory_mib,
        "multiprocessors": profile.sms,
        "slices.gi": profile.compute_slices,
        "slices.ci": profile.compute_slices,
        "engines.copy": engines.copy,
        "engines.decoder": engines.decoder,
        "engines.encoder": engines.encoder,
        "engines.jpeg": engines.jpeg,
        "engines.ofa": engines.ofa,
    }
    shared = labelling.resource_sharing(sharing, resource)
    values: dict[str, object] = {
        "product": _shared_product(shared, parent.product_name, "MIG", _mig_name(profile)),
        "count": count,
        "replicas": shared.replicas,
        "sharing-strategy": shared.strategy,
    }
    values |= {k: v for k, v in attributes.items() if v is not None}
    return _resource_labels(resource, values)


def _single_labels(node: devices.NodeDevices, sharing: sharing_config.Config) -> dict[str, str]:
    enabled = [g for g in sorted(node.gpus, key=lambda g: g.index) if g.mig_enabled]
    if not enabled:
        return {}
    try:
        advertising.check_single(node)
    except advertising.InvalidMigConfigurationError:
        return _resource_labels(
            _GPU,
            {
                "product": product(enabled[0].product_name, "MIG", _INVALID),
                "count": 0,
                "replicas": 0,
                "sharing-strategy": "",
                "memory": 0,
            },
        )
    migs = [m for g in enabled for m in node.mig_devices_on(g.index)]
    return _mig_labels(_GPU, node.gpu(migs[0].gpu_index), migs[0].profile, len(migs), sharing)


def _mixed_labels(node: devices.NodeDevices, sharing: sharing_config.Config) -> dict[str, str]:
    by_name: dict[str, list[devices.MigDevice]] = {}
    for gpu in sorted(node.gpus, key=lambda g: g.index):
        if gpu.mig_enabled:
            for mig in node.mig_devices_on(gpu.index):
                by_name.setdefault(_mig_name(mig.profile), []).append(mig)
    labels: dict[str, str] = {}
    for name, migs in sorted(by_name.items()):
        labels |= _mig_labels(
            f"nvidia.com/mig-{name}",
            node.gpu(migs[0].gpu_index),
            migs[0].profile,
            len(migs),
            sharing,
        )
    return labels
