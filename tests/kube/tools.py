"""Where the control-plane binaries, Prometheus, KEDA, Karpenter and the CDI schema are: the
folders scripts/k8s-tools names in MIGPILOT_* vars.

`./scripts/test` exports them; when pytest runs on its own they are missing and this module runs
scripts/k8s-tools itself, which builds whatever is not in the cache yet (minutes, once). A missing
binary is built, never a reason to skip a test.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_SCRIPT = ROOT / "scripts" / "k8s-tools"
_VARIABLES = (
    "MIGPILOT_KUBE_BIN",
    "MIGPILOT_ETCD_BIN",
    "MIGPILOT_KWOK_BIN",
    "MIGPILOT_KWOK_STAGES",
    "MIGPILOT_HELM_BIN",
    "MIGPILOT_PROMETHEUS_BIN",
    "MIGPILOT_KEDA_BIN",
    "MIGPILOT_KARPENTER_BIN",
    "MIGPILOT_CDI_SCHEMA",
)
STAGES = (
    "node-initialize.yaml",
    "node-heartbeat-with-lease.yaml",
    "pod-ready.yaml",
    "pod-complete.yaml",
    "pod-delete.yaml",
)


@dataclass(frozen=True)
class Tools:
    """Paths of the binaries, KWOK's Stage configs and the autoscalers' CRD folders."""

    kube_apiserver: Path
    kube_controller_manager: Path
    kube_scheduler: Path
    etcd: Path
    kwok: Path
    kwok_stages: tuple[Path, ...]
    helm: Path
    prometheus: Path
    keda_operator: Path
    keda_adapter: Path
    keda_crds: Path
    """KEDA's CustomResourceDefinitions (ScaledObject, TriggerAuthentication, ...), one a file."""
    karpenter: Path
    """Karpenter's KWOK provider."""
    karpenter_crds: Path
    """NodePool, NodeClaim, NodeOverlay, CapacityBuffer and KWOKNodeClass, one a file."""
    cdi_schema: Path
    """The CDI specification's JSON schema: ``schema.json`` and the ``defs.json`` it refers to."""


def _from_script() -> dict[str, str]:
    done = subprocess.run(
        [str(_SCRIPT), "--print-env"], check=True, stdout=subprocess.PIPE, text=True
    )
    found: dict[str, str] = {}
    for line in done.stdout.splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            key, _, value = words[1].partition("=")
            found[key] = value
    return found


def locate() -> Tools:
    """The tools from the environment, or from running scripts/k8s-tools when it lacks them."""
    env = {k: os.environ[k] for k in _VARIABLES if os.environ.get(k)}
    if len(env) < len(_VARIABLES):
        env = _from_script()
    kube, stages = Path(env["MIGPILOT_KUBE_BIN"]), Path(env["MIGPILOT_KWOK_STAGES"])
    keda, karpenter = Path(env["MIGPILOT_KEDA_BIN"]), Path(env["MIGPILOT_KARPENTER_BIN"])
    tools = Tools(
        kube_apiserver=kube / "kube-apiserver",
        kube_controller_manager=kube / "kube-controller-manager",
        kube_scheduler=kube / "kube-scheduler",
        etcd=Path(env["MIGPILOT_ETCD_BIN"]) / "etcd",
        kwok=Path(env["MIGPILOT_KWOK_BIN"]) / "kwok",
        kwok_stages=tuple(stages / name for name in STAGES),
        helm=Path(env["MIGPILOT_HELM_BIN"]) / "helm",
        prometheus=Path(env["MIGPILOT_PROMETHEUS_BIN"]) / "prometheus",
        keda_operator=keda / "keda-operator",
        keda_adapter=keda / "keda-adapter",
        keda_crds=keda / "crds",
        karpenter=karpenter / "karpenter-kwok",
        karpenter_crds=karpenter / "crds",
        cdi_schema=Path(env["MIGPILOT_CDI_SCHEMA"]) / "schema.json",
    )
    missing = [
        str(p)
        for p in (
            tools.kube_apiserver,
            tools.kube_controller_manager,
            tools.kube_scheduler,
            tools.etcd,
            tools.kwok,
            *tools.kwok_stages,
            tools.helm,
            tools.prometheus,
            tools.keda_operator,
            tools.keda_adapter,
            tools.karpenter,
            tools.cdi_schema,
        )
        if not p.is_file()
    ]
    missing += [str(d) for d in (tools.keda_crds, tools.karpenter_crds) if not d.is_dir()]
    if missing:
        raise FileNotFoundError(
            f"control-plane tools missing: {', '.join(missing)}; run scripts/k8s-tools"
        )
    return tools


def cdi_schema() -> Path:
    """The CDI schema's ``schema.json``: from ``MIGPILOT_CDI_SCHEMA`` when set (no other tool
    needed, so unit tests need not build the control plane), else from :func:`locate`."""
    folder = os.environ.get("MIGPILOT_CDI_SCHEMA")
    if folder:
        found = Path(folder) / "schema.json"
        if found.is_file():
            return found
    return locate().cdi_schema
