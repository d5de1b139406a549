"""The Helm chart ``deploy/helm/migpilot``: linted by the real ``helm``, rendered, applied to the
real apiserver, and its RBAC checked as least privilege by the apiserver's own authorizer."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightkube
import pytest
import yaml
from lightkube import codecs
from lightkube.generic_resource import create_namespaced_resource
from lightkube.models.authorization_v1 import ResourceAttributes, SubjectAccessReviewSpec
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.admissionregistration_v1 import (
    MutatingWebhookConfiguration,
    ValidatingAdmissionPolicy,
    ValidatingAdmissionPolicyBinding,
    ValidatingWebhookConfiguration,
)
from lightkube.resources.apiextensions_v1 import CustomResourceDefinition
from lightkube.resources.apps_v1 import DaemonSet, Deployment
from lightkube.resources.authorization_v1 import SubjectAccessReview
from lightkube.resources.core_v1 import ConfigMap, Namespace, Secret, Service, ServiceAccount
from lightkube.resources.networking_v1 import NetworkPolicy
from lightkube.resources.rbac_authorization_v1 import (
    ClusterRole,
    ClusterRoleBinding,
    Role,
    RoleBinding,
)
from lightkube.resources.resource_v1 import DeviceClass, ResourceClaimTemplate

from migpilot.agent.sharing import sharingconfig
from migpilot.api import gpulayouts, leases
from migpilot.cli import main
from migpilot.sharing import config as sharing_config
from migpilot.sharing import configsets
from migpilot.webhook import registering
from tests.kube import tools
from tests.kube.controlplane import ControlPlane, wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "migpilot"
DASHBOARD = REPO / "deploy" / "grafana" / "migpilot.json"
ServiceMonitor = create_namespaced_resource(
    "monitoring.coreos.com", "v1", "ServiceMonitor", "servicemonitors"
)
# The Prometheus Operator's CRD cut to what lets the apiserver store a ServiceMonitor.
SERVICEMONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {
        "group": "monitoring.coreos.com",
        "names": {
            "kind": "ServiceMonitor",
            "plural": "servicemonitors",
            "listKind": "ServiceMonitorList",
            "singular": "servicemonitor",
        },
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


# Sharing configs in NVIDIA's device-plugin format: one as a string (no commas: --set splits
# on them), one as a map.
TIME_SLICING = """version: v1
sharing:
  timeSlicing:
    resources:
    - name: nvidia.com/gpu
      replicas: 4"""
MPS = {
    "version": "v1",
    "sharing": {"mps": {"resources": [{"name": "nvidia.com/gpu", "replicas": 2}]}},
}
SHARING_VALUES = {
    "agent": {"sharing": {"configs": {"ts4": TIME_SLICING, "mps2": MPS}, "default": "ts4"}}
}


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(tools.locate().helm), *args], capture_output=True, text=True, check=False
    )


def _render(
    release: str, namespace: str, *sets: str, values: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    args = ["template", release, str(CHART), "-n", namespace, "--include-crds"]
    for s in sets:
        args += ["--set", s]
    for key, value in (values or {}).items():
        args += ["--set-json", f"{key}={json.dumps(value)}"]
    got = _helm(*args)
    assert got.returncode == 0, got.stderr
    return [d for d in yaml.safe_load_all(got.stdout) if d]


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("certManager.enabled=true", "serviceMonitor.enabled=true"),
        ("webhook.enabled=false",),
        ("webhook.validate=false",),
        (f"agent.sharing.configs.ts4={TIME_SLICING}", "agent.sharing.default=ts4"),
        (f"agent.sharing.configs.ts4={TIME_SLICING}", "agent.strategy=mixed"),
        ("agent.sharing.existingConfigMap=gpu-sharing", "agent.mpsRoot=", "agent.hostPID=true"),
        ("admissionPolicies.enabled=false", "networkPolicy.enabled=true"),
        ("admissionPolicies.validationActions={Warn,Audit}", "agent.enabled=false"),
        ("grafana.dashboard.enabled=true", "grafana.dashboard.namespace=monitoring"),
        ("dra.deviceClass=true", "dra.exampleClaimTemplates=true"),
    ],
)
def test_the_chart_lints_strictly(sets: tuple[str, ...]) -> None:
    args = ["lint", "--strict", str(CHART)]
    for s in sets:
        args += ["--set", s]
    got = _helm(*args)
    assert got.returncode == 0, got.stdout + got.stderr


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("controller.batchWindow=-1", "/controller/batchWindow"),
        ("controller.nodePolicy=random", "/controller/nodePolicy"),
        ("controller.gpuPolicy=pack", "/controller/gpuPolicy"),
        ("agent.strategy=both", "/agent/strategy"),
        ("agent.backend=cuda", "/agent/backend"),
        ("agent.migPartedConfigMap=gpu-operator", "/agent/migPartedConfigMap"),
        ("webhook.port=70000", "/webhook/port"),
        ("webhook.metricsPort=0", "/webhook/metricsPort"),
        ("webhook.validate=maybe", "/webhook/validate"),
        ("controler.replicas=1", "'controler' not allowed"),
        ("agent.intervall=5", "'intervall' not allowed"),
        ("agent.sharing.configs.bad/name=x", "/agent/sharing/configs"),
        ("agent.sharing.configs.ts=", "/agent/sharing/configs/ts"),
        ("agent.sharing.existingConfigMap=Gpu_Sharing", "/agent/sharing/existingConfigMap"),
        ("agent.sharing.default=a b", "/agent/sharing/default"),
        ("agent.sharing.rename=true", "'rename' not allowed"),
        ("agent.mpsRoot=run/nvidia/mps", "/agent/mpsRoot"),
        ("agent.hostPID=yes", "/agent/hostPID"),
        ("admissionPolicies.validationActions={Deny,Warn}", "/admissionPolicies/validationActions"),
        ("admissionPolicies.validationActions={Block}", "/admissionPolicies/validationActions"),
        ("admissionPolicies.enabled=yes", "/admissionPolicies/enabled"),
        ("networkPolicy.enabled=maybe", "/networkPolicy/enabled"),
        ("networkPolicy.metricsFrom={x}", "/networkPolicy/metricsFrom"),
        ("logFormat=yaml", "/logFormat"),
        ("grafana.dashboard.enabled=yes", "/grafana/dashboard/enabled"),
        ("grafana.dashboard.namespace=Mon_itoring", "/grafana/dashboard/namespace"),
        ("grafana.dashboard.labels.bad/label/x=a", "invalid propertyName 'bad/label/x'"),
        ("grafana.dashboard.folder=GPU", "'folder' not allowed"),
    ],
)
def test_bad_values_are_refused_naming_the_field(bad: str, message: str) -> None:
    got = _helm("lint", str(CHART), "--set", bad)
    assert got.returncode != 0
    assert message in got.stdout + got.stderr


def _dashboards(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == "ConfigMap" and "migpilot.json" in d.get("data", {})]


def test_the_grafana_dashboard_is_off_by_default() -> None:
    assert _dashboards(_render("mp", "gpu-system")) == []


def test_the_grafana_dashboard_is_a_configmap_for_grafanas_sidecar() -> None:
    [board] = _dashboards(_render("mp", "gpu-system", "grafana.dashboard.enabled=true"))
    assert board["metadata"]["name"] == "mp-grafana-dashboard"
    assert board["metadata"]["namespace"] == "gpu-system"
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert board["metadata"]["labels"]["app.kubernetes.io/instance"] == "mp"
    assert "annotations" not in board["metadata"]
    # The file itself, read by .Files.Get from the chart's copy (equal to deploy/grafana's).
    assert board["data"]["migpilot.json"] == DASHBOARD.read_text().rstrip("\n")
    assert (CHART / "dashboards" / "migpilot.json").read_bytes() == DASHBOARD.read_bytes()


def test_the_grafana_dashboards_namespace_labels_and_annotations_are_configurable() -> None:
    [board] = _dashboards(
        _render(
            "mp",
            "gpu-system",
            "grafana.dashboard.enabled=true",
            "grafana.dashboard.namespace=monitoring",
            values={
                # Helm merges maps: null drops the default label.
                "grafana.dashboard.labels": {"grafana_dashboard": None, "dashboards": "gpu"},
                "grafana.dashboard.annotations": {"grafana_folder": "GPU"},
            },
        )
    )
    meta = board["metadata"]
    assert meta["namespace"] == "monitoring"
    assert meta["labels"]["dashboards"] == "gpu" and "grafana_dashboard" not in meta["labels"]
    assert meta["annotations"] == {"grafana_folder": "GPU"}


def test_the_agents_servicemonitor_keeps_the_pods_labels_of_its_series() -> None:
    """The agent's per-pod series have namespace, pod and container labels of their own: the
    Prometheus Operator's target labels of the same names must not rename them exported_*."""
    docs = _render("mp", "gpu-system", "serviceMonitor.enabled=true")
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ServiceMonitor"}
    assert set(monitors) == {"mp-controller", "mp-webhook", "mp-agent"}
    [agent] = monitors["mp-agent"]["spec"]["endpoints"]
    assert agent["port"] == "metrics" and agent["honorLabels"] is True
    for name in ("mp-controller", "mp-webhook"):
        [endpoint] = monitors[name]["spec"]["endpoints"]
        assert endpoint["port"] == "metrics" and "honorLabels" not in endpoint
    # Each selects its component's Services, and one of them serves the port named metrics.
    services = [d for d in docs if d["kind"] == "Service"]
    for name, monitor in monitors.items():
        selector = monitor["spec"]["selector"]["matchLabels"]
        chosen = [d for d in services if selector.items() <= d["metadata"]["labels"].items()]
        ports = [p["name"] for d in chosen for p in d["spec"]["ports"]]
        assert ports.count("metrics") == 1, (name, ports)
    off = _render("mp", "gpu-system", "serviceMonitor.enabled=true", "webhook.enabled=false")
    assert {d["metadata"]["name"] for d in off if d["kind"] == "ServiceMonitor"} == {
        "mp-controller",
        "mp-agent",
    }


def test_the_chart_ships_the_crd_of_deploy_crds() -> None:
    shipped = (CHART / "crds" / "gpulayouts.migpilot.io.yaml").read_bytes()
    assert shipped == (REPO / "deploy" / "crds" / "gpulayouts.migpilot.io.yaml").read_bytes()


def _containers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each workload's (only) container, by component."""
    found = {}
    for doc in docs:
        if doc["kind"] in ("Deployment", "DaemonSet"):
            (container,) = doc["spec"]["template"]["spec"]["containers"]
            found[doc["metadata"]["labels"]["app.kubernetes.io/component"]] = container
    return found


@pytest.mark.parametrize(
    "sets",
    [(), ("controller.verbose=true", "agent.extraArgs={--no-publish-capacity}")],
)
def test_every_container_runs_a_command_line_migpilot_accepts(sets: tuple[str, ...]) -> None:
    """The rendered args parse with migpilot's own parser: no flag the CLI lacks."""
    containers = _containers(_render("mp", "gpu-system", *sets))
    assert set(containers) == {"controller", "webhook", "agent"}
    for component, container in containers.items():
        env = {e["name"]: e for e in container.get("env", [])}
        args = [re.sub(r"\$\((\w+)\)", lambda m: f"<{m[1]}>", a) for a in container["args"]]
        for name in re.findall(r"\$\((\w+)\)", " ".join(container["args"])):
            assert name in env, f"{component}: $({name}) is not in the container's env"
        parsed = main.build_parser().parse_args(args)
        assert parsed.command == component
        if component in ("controller", "webhook"):
            assert parsed.lease_namespace == "gpu-system"
    assert containers["controller"]["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == (
        "metadata.name"
    )
    agent_env = {e["name"]: e for e in containers["agent"]["env"]}
    assert agent_env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert agent_env["NVIDIA_MIG_CONFIG_DEVICES"]["value"] == "all"


@pytest.mark.parametrize(("sets", "want"), [((), "text"), (("logFormat=json",), "json")])
def test_log_format_is_passed_to_every_component(sets: tuple[str, ...], want: str) -> None:
    containers = _containers(_render("mp", "gpu-system", *sets))
    assert set(containers) == {"controller", "webhook", "agent"}
    for component, container in containers.items():
        assert f"--log-format={want}" in container["args"], component
        args = [re.sub(r"\$\((\w+)\)", "x", a) for a in container["args"]]
        assert main.build_parser().parse_args(args).log_format == want, component


def test_the_agent_keeps_its_state_on_the_host_and_reaches_the_kubelet() -> None:
    docs = _render("mp", "gpu-system")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"]["runAsUser"] == 0
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    mounts = {
        m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host
    }
    assert mounts == {
        "/var/lib/kubelet/device-plugins": "/var/lib/kubelet/device-plugins",
        "/var/lib/kubelet/pod-resources": "/var/lib/kubelet/pod-resources",
        "/var/lib/migpilot": "/var/lib/migpilot",
        "/run/nvidia/mps": "/run/nvidia/mps",
        "/dev/shm": "/run/nvidia/mps/shm",
    }
    parsed = main.build_parser().parse_args(
        [a.replace("$(NODE_NAME)", "n") for a in container["args"]]
    )
    # The Allocate ledger survives a restart only on a host folder.
    assert Path(parsed.allocations_file).parent == Path("/var/lib/migpilot")
    assert "runtimeClassName" not in pod
    docs = _render("mp", "gpu-system", "agent.runtimeClassName=nvidia")
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


def test_the_agent_writes_only_to_its_mounts_and_reads_the_pod_resources_socket() -> None:
    """A read-only root filesystem: the agent writes to its host folders and to /tmp (an
    emptyDir: the MPS control commands' output). The PodResources folder is mounted read-only:
    the agent only connects to the kubelet's socket there, which a read-only mount allows."""
    pod, container, parsed = _agent(_render("mp", "gpu-system"))
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    tmp = _volume_at(pod, container, "/tmp")
    assert "emptyDir" in tmp and tmp["readOnly"] is False
    resources = _volume_at(pod, container, "/var/lib/kubelet/pod-resources")
    assert resources["readOnly"] is True
    assert resources["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    # What it writes stays writable: its device-plugin socket, its ledger, the MPS folders.
    for path in (
        "/var/lib/kubelet/device-plugins",
        str(Path(parsed.allocations_file).parent),
        parsed.mps_root,
        "/dev/shm",
    ):
        assert _volume_at(pod, container, path)["readOnly"] is False, path


def _agent(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The agent's pod spec, its container and its parsed command line."""
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = [a.replace("$(NODE_NAME)", "n") for a in container["args"]]
    return pod, container, main.build_parser().parse_args(args)


def _volume_at(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return {**volume, "readOnly": mount.get("readOnly", False)}


def test_without_sharing_values_no_sharing_config_is_rendered() -> None:
    docs = _render("mp", "gpu-system")
    assert [d for d in docs if d["kind"] == "ConfigMap"] == []
    pod, container, parsed = _agent(docs)
    assert parsed.device_plugin_configs is None
    assert parsed.device_plugin_config_default is None
    assert not any("sharing" in m["mountPath"] for m in container["volumeMounts"])
    assert "hostPID" not in pod
    # The MPS root is there by default: a node labelled migpilot.io/mode=mps needs no config.
    assert parsed.mps_root == "/run/nvidia/mps"
    root = _volume_at(pod, container, "/run/nvidia/mps")
    assert root["hostPath"] == {"path": "/run/nvidia/mps", "type": "DirectoryOrCreate"}


def test_sharing_configs_become_a_mounted_configmap_the_agent_reads(tmp_path: Path) -> None:
    docs = _render(
        "mp", "gpu-system", "agent.hostPID=true", "agent.strategy=none", values=SHARING_VALUES
    )
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert configmap["metadata"] == {
        **configmap["metadata"],
        "name": "mp-sharing",
        "namespace": "gpu-system",
    }
    assert set(configmap["data"]) == {"ts4", "mps2"}
    assert configmap["data"]["ts4"] == TIME_SLICING  # a string goes in as written
    assert yaml.safe_load(configmap["data"]["mps2"]) == MPS  # a map as its YAML
    pod, container, parsed = _agent(docs)
    assert pod["hostPID"] is True
    volume = _volume_at(pod, container, parsed.device_plugin_configs)
    assert volume["configMap"] == {"name": "mp-sharing"} and volume["readOnly"] is True
    assert parsed.device_plugin_config_default == "ts4"
    # The mounted folder, as the agent reads it at start: every config valid, the default
    # picked for a node without the label, the label's config for one with it.
    for name, text in configmap["data"].items():
        (tmp_path / name).write_text(text)
    named = sharingconfig.NamedSet(
        tmp_path, selection=configsets.Selection(default=parsed.device_plugin_config_default)
    )
    named.check_all()
    _, picked = named.load(None)
    assert picked.strategy == sharing_config.SharingStrategy.TIME_SLICING
    assert picked.time_slicing is not None
    assert picked.time_slicing.resources[0].replicas == 4
    _, labelled = named.load("mps2")
    assert labelled.strategy == sharing_config.SharingStrategy.MPS


def test_an_existing_sharing_configmap_is_mounted_and_none_rendered() -> None:
    docs = _render("mp", "gpu-system", "agent.sharing.existingConfigMap=gpu-sharing")
    assert [d for d in docs if d["kind"] == "ConfigMap"] == []
    pod, container, parsed = _agent(docs)
    assert _volume_at(pod, container, parsed.device_plugin_configs)["configMap"] == {
        "name": "gpu-sharing"
    }
    assert parsed.device_plugin_config_default is None


@pytest.mark.parametrize(
    ("root", "mounted"),
    [("/var/run/mps/", "/var/run/mps"), ("", None)],
)
def test_the_mps_root_is_mounted_at_the_hosts_path(root: str, mounted: str | None) -> None:
    pod, container, parsed = _agent(_render("mp", "gpu-system", f"agent.mpsRoot={root}"))
    assert parsed.mps_root == mounted
    paths = {m["mountPath"] for m in container["volumeMounts"]}
    if mounted is None:
        assert "/dev/shm" not in paths and not any("mps" in p for p in paths)
        return
    # Allocate mounts <root>/<resource>/pipe and <root>/shm into pods by their host paths:
    # the agent's daemons must see the same folders at the same paths.
    assert _volume_at(pod, container, mounted)["hostPath"]["path"] == mounted
    assert _volume_at(pod, container, "/dev/shm")["hostPath"] == {
        "path": f"{mounted}/shm",
        "type": "DirectoryOrCreate",
    }


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ("agent.sharing.configs.a=version: v1", "agent.sharing.existingConfigMap=cm"),
            "agent.sharing.configs and agent.sharing.existingConfigMap exclude each other",
        ),
        (
            ("agent.sharing.default=ts4",),
            "agent.sharing.default needs agent.sharing.configs or agent.sharing.existingConfigMap",
        ),
        (
            ("agent.sharing.configs.a=version: v1", "agent.sharing.default=b"),
            'agent.sharing.default: no config named "b" in agent.sharing.configs',
        ),
        (
            ("agent.sharing.configs.m=sharing: {mps: {resources: []}}",),
            "agent.sharing.configs.m: sharing.mps is not served with agent.strategy=mixed",
        ),
    ],
)
def test_conflicting_sharing_values_fail_the_rendering(sets: tuple[str, ...], message: str) -> None:
    args = ["template", "mp", str(CHART)]
    for s in sets:
        args += ["--set", s]
    got = _helm(*args)
    assert got.returncode != 0
    assert message in got.stderr


def test_a_sharing_config_map_must_look_like_nvidias_format() -> None:
    for config in ({"version": "v2"}, {"sharing": {"timeslicing": {}}}, {"replicas": 2}):
        got = _helm(
            "lint", str(CHART), "--set-json", f"agent.sharing.configs.a={json.dumps(config)}"
        )
        assert got.returncode != 0
        assert "/agent/sharing/configs/a" in got.stdout + got.stderr


def test_the_controller_and_the_webhook_run_unprivileged() -> None:
    docs = _render("mp", "gpu-system")
    for doc in docs:
        if doc["kind"] == "Deployment":
            pod = doc["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            (container,) = pod["containers"]
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False
            assert context["capabilities"] == {"drop": ["ALL"]}


def test_the_webhooks_metrics_port_must_differ_from_its_tls_port() -> None:
    got = _helm("template", "mp", str(CHART), "--set", "webhook.metricsPort=9443")
    assert got.returncode != 0
    assert "webhook.metricsPort must differ from webhook.port (both are 9443)" in got.stderr
    assert _helm("template", "mp", str(CHART), "--set", "webhook.port=8080").returncode != 0


@pytest.mark.parametrize("sets", [(), ("webhook.metricsPort=9090", "controller.metricsPort=9091")])
def test_every_component_is_probed_on_its_metrics_port(sets: tuple[str, ...]) -> None:
    """The controller, the webhook and the agent: /readyz and /healthz on the port their
    ``--metrics-port`` serves (the webhook's apart from its TLS port, so a probe never takes a
    connection the API server needs)."""
    for component, container in _containers(_render("mp", "gpu-system", *sets)).items():
        assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        assert container["livenessProbe"]["failureThreshold"] >= 3, component
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        args = [re.sub(r"\$\((\w+)\)", "x", a) for a in container["args"]]
        parsed = main.build_parser().parse_args(args)
        assert ports["metrics"] == parsed.metrics_port, component
        if component == "webhook":
            assert ports == {"https": parsed.port, "metrics": parsed.metrics_port}
            assert parsed.metrics_port != parsed.port
    webhook = _containers(_render("mp", "gpu-system", *sets))["webhook"]
    assert webhook["ports"][1]["containerPort"] == (9090 if sets else 8080)


def test_network_policies_are_optional_and_open_only_the_served_ports() -> None:
    assert [d for d in _render("mp", "gpu-system") if d["kind"] == "NetworkPolicy"] == []
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    apiserver = {"ipBlock": {"cidr": "10.0.0.0/24"}}
    docs = _render(
        "mp",
        "gpu-system",
        "networkPolicy.enabled=true",
        values={
            "networkPolicy.metricsFrom": [monitoring],
            "networkPolicy.webhookFrom": [apiserver],
        },
    )
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    containers = _containers(docs)
    assert set(policies) == {f"mp-{c}" for c in containers}
    for component, container in containers.items():
        spec = policies[f"mp-{component}"]
        assert spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
        assert spec["policyTypes"] == ["Ingress"]
        # One rule per port the container serves, from the peers of that port only.
        opened = {}
        for rule in spec["ingress"]:
            (port,) = rule["ports"]
            assert port["protocol"] == "TCP"
            opened[port["port"]] = rule["from"]
        assert set(opened) == {p["name"] for p in container["ports"]}, component
        assert opened.pop("metrics") == [monitoring], component
        assert opened == ({"https": [apiserver]} if component == "webhook" else {})
    # Without peers: the ports from any source.
    docs = _render("mp", "gpu-system", "networkPolicy.enabled=true", "agent.enabled=false")
    rules = {
        d["metadata"]["name"]: d["spec"]["ingress"] for d in docs if d["kind"] == "NetworkPolicy"
    }
    assert set(rules) == {"mp-controller", "mp-webhook"}
    assert all("from" not in rule for rs in rules.values() for rule in rs)


POLICIES = REPO / "deploy" / "policies"
POLICY_NAMES = ("agent-nodes", "agent-gpulayouts", "agent-resourceslices", "controller-pods")
DRA = REPO / "deploy" / "dra"


def test_the_chart_installs_the_admission_policies_unless_told_not_to() -> None:
    docs = _render("mp", "gpu-system")
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"}
    bindings = {
        d["metadata"]["name"]: d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"
    }
    assert set(policies) == set(bindings) == {f"mp-{n}" for n in POLICY_NAMES}
    for name, binding in bindings.items():
        assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}
        spec = policies[name]["spec"]
        assert spec["failurePolicy"] == "Fail"
        (condition,) = spec["matchConditions"]
        account = "controller" if "controller" in name else "agent"
        want = f"request.userInfo.username == 'system:serviceaccount:gpu-system:mp-{account}'"
        assert condition["expression"] == want
    kinds = {d["kind"] for d in _render("mp", "gpu-system", "admissionPolicies.enabled=false")}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    warn = _render("mp", "gpu-system", "admissionPolicies.validationActions={Warn,Audit}")
    for doc in warn:
        if doc["kind"] == "ValidatingAdmissionPolicyBinding":
            assert doc["spec"]["validationActions"] == ["Warn", "Audit"]


def test_deploy_policies_are_the_charts_for_release_migpilot() -> None:
    """deploy/policies/ (for kubectl) holds the chart's policies and bindings as rendered for
    the release ``migpilot`` in ``migpilot-system``, without Helm's labels."""
    rendered = [
        d
        for d in _render("migpilot", "migpilot-system")
        if d["kind"] in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
    ]
    for doc in rendered:
        del doc["metadata"]["labels"]
    shipped = []
    for path in sorted(POLICIES.glob("*.yaml")):
        shipped += [d for d in yaml.safe_load_all(path.read_text()) if d]

    def named(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    assert named(shipped) == named(rendered) and len(shipped) == len(rendered)
    assert {p.name for p in POLICIES.glob("*.yaml")} == {f"{n}.yaml" for n in POLICY_NAMES}


def test_the_dra_objects_are_asked_for_and_are_deploy_dras() -> None:
    """The DeviceClass and the example ResourceClaimTemplates are rendered only when asked
    (Kubernetes 1.34+), the templates in the release's namespace; deploy/dra/ holds the same,
    without Helm's labels and namespace."""
    dra_kinds = {"DeviceClass", "ResourceClaimTemplate"}
    assert not {d["kind"] for d in _render("mp", "gpu-system")} & dra_kinds
    only_class = _render("mp", "gpu-system", "dra.deviceClass=true")
    assert [d["kind"] for d in only_class if d["kind"] in dra_kinds] == ["DeviceClass"]
    rendered = [
        d
        for d in _render(
            "mp", "gpu-system", "dra.deviceClass=true", "dra.exampleClaimTemplates=true"
        )
        if d["kind"] in dra_kinds
    ]
    for doc in rendered:
        del doc["metadata"]["labels"]
        if doc["kind"] == "ResourceClaimTemplate":
            assert doc["metadata"].pop("namespace") == "gpu-system"
    shipped = []
    for path in sorted(DRA.glob("*.yaml")):
        shipped += [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert sorted(shipped, key=str) == sorted(rendered, key=str) and len(rendered) == 4
    (device_class,) = [d for d in rendered if d["kind"] == "DeviceClass"]
    assert device_class["metadata"]["name"] == "mig.migpilot.io"
    assert device_class["spec"]["selectors"] == [
        {"cel": {"expression": 'device.driver == "mig.migpilot.io"'}}
    ]
    for doc in rendered[1:]:
        (request,) = doc["spec"]["spec"]["devices"]["requests"]
        assert request["exactly"]["deviceClassName"] == "mig.migpilot.io"


@pytest.mark.parametrize(("replicas", "budgets"), [("2", 2), ("1", 0)])
def test_a_disruption_budget_keeps_one_replica_through_a_drain(replicas: str, budgets: int) -> None:
    docs = _render(
        "mp", "gpu-system", f"controller.replicas={replicas}", f"webhook.replicas={replicas}"
    )
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    assert len(pdbs) == budgets
    for pdb in pdbs:
        assert pdb["spec"]["maxUnavailable"] == 1
        component = pdb["metadata"]["labels"]["app.kubernetes.io/component"]
        assert pdb["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"] == component
    off = _render("mp", "gpu-system", "controller.disruptionBudget=false")
    assert [d["metadata"]["name"] for d in off if d["kind"] == "PodDisruptionBudget"] == [
        "mp-webhook"
    ]


def _value_rows() -> dict[str, str]:
    """The README's values table: value -> default as written."""
    text = (CHART / "README.md").read_text()
    return dict(re.findall(r"^\| `([\w.]+)` \| `(.*?)` \|", text, flags=re.MULTILINE))


def _values_lines() -> list[tuple[int, tuple[str, ...], bool, bool]]:
    """values.yaml's keys, in order: (line index, dotted path, ``# --`` comment above,
    a section: the next key is nested under it)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    keys = []
    for i, line in enumerate(lines):
        match = re.match(r"^( *)([A-Za-z]\w*):", line)
        if match is not None:
            keys.append((i, len(match[1]) // 2, match[2]))
    found = []
    stack: list[str] = []
    for n, (i, depth, name) in enumerate(keys):
        stack = [*stack[:depth], name]
        j = i - 1
        while (
            j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --")
        ):
            j -= 1
        documented = j >= 0 and lines[j].strip().startswith("# --") and j < i
        section = n + 1 < len(keys) and keys[n + 1][1] > depth
        found.append((i, tuple(stack), documented, section))
    return found


def _values_by_row() -> dict[str, Any]:
    """values.yaml's documented (``# --``) values: dotted path -> default."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows: dict[str, Any] = {}
    for _, path, documented, _ in _values_lines():
        if documented:
            value = values
            for key in path:
                value = value[key]
            rows[".".join(path)] = value
    return rows


def test_the_readme_documents_every_value_with_its_default() -> None:
    rows, values = _value_rows(), _values_by_row()
    assert set(rows) == set(values)
    for key, default in rows.items():
        assert json.loads(default) == values[key], key


def test_values_yaml_documents_every_field() -> None:
    """Every key is a documented value (``# --``), inside one, or a section whose fields are."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    rows: list[tuple[str, ...]] = []
    for i, path, documented, section in _values_lines():
        if any(path[: len(row)] == row for row in rows):
            continue  # a field of a documented value (controller.resources.requests)
        if documented:
            rows.append(path)
            continue
        assert section, f"values.yaml line {i + 1}: {'.'.join(path)} is undocumented"
        if len(path) > 1:  # a nested section says what its fields are for
            assert lines[i - 1].strip().startswith("#"), f"values.yaml line {i + 1}"
    assert ("agent", "sharing", "configs") in rows  # nested values are rows of their own


def test_the_webhook_only_reads_the_controllers_lease_and_pods_claims() -> None:
    docs = _render("mp", "gpu-system")
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "mp-webhook"]
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [leases.NAME],
            "verbs": ["get"],
        }
    ]
    (cluster,) = [
        d for d in docs if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "mp-webhook"
    ]
    assert cluster["rules"] == [
        {
            "apiGroups": ["resource.k8s.io"],
            "resources": ["resourceclaims", "resourceclaimtemplates"],
            "verbs": ["get"],
        }
    ]
    (binding,) = [
        d
        for d in docs
        if d["kind"] == "ClusterRoleBinding" and d["metadata"]["name"] == "mp-webhook"
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "mp-webhook", "namespace": "gpu-system"}
    ]


def test_the_agent_only_reads_the_controllers_lease() -> None:
    docs = _render("mp", "gpu-system")
    (role,) = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "mp-agent"]
    assert role["rules"] == [
        {
            "apiGroups": ["coordination.k8s.io"],
            "resources": ["leases"],
            "resourceNames": [leases.NAME],
            "verbs": ["get"],
        }
    ]
    (binding,) = [
        d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["name"] == "mp-agent"
    ]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "mp-agent", "namespace": "gpu-system"}
    ]
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (agent,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "--lease-namespace=gpu-system" in agent["args"]


def test_the_webhook_configurations_are_the_ones_registering_renders() -> None:
    docs = _render("mp", "gpu-system")
    (secret,) = [d for d in docs if d["kind"] == "Secret"]
    ca = base64.b64decode(secret["data"]["ca.crt"])
    kwargs: dict[str, Any] = {
        "ca_bundle": ca,
        "service": ("gpu-system", "mp-webhook"),
        "excluded_namespaces": ("kube-system", "gpu-system"),
        "name": "mp-webhook",
    }
    for render in (registering.configuration, registering.validating_configuration):
        want = render(**kwargs)
        (hook,) = [d for d in docs if d["kind"] == want["kind"]]
        assert hook["metadata"]["name"] == want["metadata"]["name"]
        assert hook["webhooks"] == want["webhooks"]
    # The serving certificate is signed by that CA for the Service's DNS name.
    assert "BEGIN CERTIFICATE" in base64.b64decode(secret["data"]["tls.crt"]).decode()
    # Without webhook.validate, the mutating webhook alone.
    kinds = [d["kind"] for d in _render("mp", "gpu-system", "webhook.validate=false")]
    assert "MutatingWebhookConfiguration" in kinds
    assert "ValidatingWebhookConfiguration" not in kinds


def test_cert_manager_injects_the_ca_instead() -> None:
    docs = _render("mp", "gpu-system", "certManager.enabled=true")
    kinds = {d["kind"] for d in docs}
    assert {"Issuer", "Certificate"} <= kinds and "Secret" not in kinds
    hooks = [d for d in docs if d["kind"].endswith("WebhookConfiguration")]
    assert len(hooks) == 2
    for hook in hooks:
        annotations = hook["metadata"]["annotations"]
        assert annotations["cert-manager.io/inject-ca-from"] == "gpu-system/mp-webhook"
        assert "caBundle" not in hook["webhooks"][0]["clientConfig"]


def _wait_established(client: lightkube.Client, name: str) -> None:
    def established() -> bool:
        got = client.get(CustomResourceDefinition, name)
        conditions = (got.status.conditions if got.status else None) or []
        return any(c.type == "Established" and c.status == "True" for c in conditions)

    wait_for(established, what=f"the CRD {name} to be Established", timeout=60)


@pytest.fixture
def installed(
    control_plane: ControlPlane, request: pytest.FixtureRequest
) -> Iterator[tuple[ControlPlane, str, str]]:
    """The rendered chart applied to the real apiserver in a namespace of its own; with the
    parameter ``"sharing"``, with GPU sharing configs (SHARING_VALUES) and hostPID."""
    sharing = getattr(request, "param", None) == "sharing"
    client = control_plane.client
    suffix = uuid.uuid4().hex[:6]
    release, namespace = f"mp{suffix}", f"migpilot-{suffix}"
    client.create(Namespace(metadata=ObjectMeta(name=namespace)))
    with contextlib.suppress(lightkube.ApiError):  # 409: made by an earlier test
        client.create(codecs.from_dict(SERVICEMONITOR_CRD))
    _wait_established(client, "servicemonitors.monitoring.coreos.com")
    if sharing:
        docs = _render(
            release,
            namespace,
            "serviceMonitor.enabled=true",
            "networkPolicy.enabled=true",
            "agent.hostPID=true",
            "agent.strategy=none",
            values=SHARING_VALUES,
        )
    else:
        docs = _render(
            release,
            namespace,
            "serviceMonitor.enabled=true",
            "grafana.dashboard.enabled=true",
            "dra.deviceClass=true",
            "dra.exampleClaimTemplates=true",
        )
    applied: list[Any] = []
    try:
        for doc in docs:
            obj = codecs.from_dict(doc)
            client.apply(obj, field_manager="helm-test", force=True)
            applied.append(obj)
            if obj.kind == "CustomResourceDefinition":
                assert obj.metadata is not None and obj.metadata.name is not None
                _wait_established(client, obj.metadata.name)
        yield control_plane, release, namespace
    finally:
        for obj in reversed(applied):
            if obj.kind == "CustomResourceDefinition":
                continue  # shared with the other tests
            meta = obj.metadata
            with contextlib.suppress(lightkube.ApiError):
                client.delete(type(obj), meta.name, namespace=meta.namespace)
        with contextlib.suppress(lightkube.ApiError):
            client.delete(Namespace, namespace)


@pytest.mark.kube
@pytest.mark.parametrize("installed", ["plain", "sharing"], indirect=True)
def test_the_rendered_chart_applies_to_the_real_apiserver(
    installed: tuple[ControlPlane, str, str], request: pytest.FixtureRequest
) -> None:
    plane, release, namespace = installed
    client = plane.client
    crd = client.get(CustomResourceDefinition, gpulayouts.CRD_NAME)
    assert crd.status is not None and crd.status.conditions is not None
    assert any(c.type == "Established" and c.status == "True" for c in crd.status.conditions)
    for name in (f"{release}-controller", f"{release}-webhook"):
        deployment = client.get(Deployment, name, namespace=namespace)
        assert deployment.spec is not None and deployment.spec.replicas == 2
    agent = client.get(DaemonSet, f"{release}-agent", namespace=namespace)
    assert agent.spec is not None and agent.spec.template.spec is not None
    volumes = {v.name: v for v in agent.spec.template.spec.volumes or []}
    assert volumes["mps-root"].hostPath is not None
    assert volumes["mps-root"].hostPath.type == "DirectoryOrCreate"
    if request.node.callspec.params["installed"] == "sharing":
        configs = client.get(ConfigMap, f"{release}-sharing", namespace=namespace)
        assert set(configs.data or {}) == {"ts4", "mps2"}
        assert volumes["sharing"].configMap is not None
        assert volumes["sharing"].configMap.name == f"{release}-sharing"
        assert agent.spec.template.spec.hostPID is True
    else:
        assert "sharing" not in volumes
        with pytest.raises(lightkube.ApiError):
            client.get(ConfigMap, f"{release}-sharing", namespace=namespace)
    for name in ("controller", "webhook", "agent"):
        assert client.get(ServiceAccount, f"{release}-{name}", namespace=namespace)
    ports = {}
    for name in ("controller-metrics", "agent-metrics", "webhook", "webhook-metrics"):
        service = client.get(Service, f"{release}-{name}", namespace=namespace)
        assert service.spec is not None and service.spec.ports is not None
        ports[name] = service.spec.ports[0].port
    assert ports == {
        "controller-metrics": 8080,
        "agent-metrics": 9400,
        "webhook": 443,
        "webhook-metrics": 8080,
    }
    for name in ("controller", "webhook", "agent"):
        assert client.get(ServiceMonitor, f"{release}-{name}", namespace=namespace)
    if request.node.callspec.params["installed"] == "plain":  # accepted by the API's schema
        assert client.get(DeviceClass, "mig.migpilot.io")
        for name in ("mig-1g-10gb", "mig-20gi", "mig-h100-80gb"):
            assert client.get(ResourceClaimTemplate, name, namespace=namespace)
    if request.node.callspec.params["installed"] == "plain":  # stored as the sidecar reads it
        board = client.get(ConfigMap, f"{release}-grafana-dashboard", namespace=namespace)
        assert board.metadata is not None and board.metadata.labels is not None
        assert board.metadata.labels["grafana_dashboard"] == "1"
        assert json.loads((board.data or {})["migpilot.json"]) == json.loads(DASHBOARD.read_text())
    assert client.get(Secret, f"{release}-webhook-tls", namespace=namespace)
    for name in ("controller", "agent", "webhook"):
        assert client.get(ClusterRole, f"{release}-{name}")
        assert client.get(ClusterRoleBinding, f"{release}-{name}")
    for name in ("controller", "webhook", "agent"):
        assert client.get(Role, f"{release}-{name}", namespace=namespace)
        assert client.get(RoleBinding, f"{release}-{name}", namespace=namespace)
    for name in POLICY_NAMES:  # their CEL compiled by the apiserver
        assert client.get(ValidatingAdmissionPolicy, f"{release}-{name}")
        assert client.get(ValidatingAdmissionPolicyBinding, f"{release}-{name}")
    if request.node.callspec.params["installed"] == "sharing":
        for name in ("controller", "webhook", "agent"):
            assert client.get(NetworkPolicy, f"{release}-{name}", namespace=namespace)
    for kind in (MutatingWebhookConfiguration, ValidatingWebhookConfiguration):
        hook = client.get(kind, f"{release}-webhook")  # its CEL compiled by the apiserver
        assert hook.webhooks is not None and hook.webhooks[0].failurePolicy == "Ignore"
        assert hook.webhooks[0].clientConfig.caBundle


def _allowed(
    client: lightkube.Client,
    user: str,
    *,
    verb: str,
    resource: str,
    group: str = "",
    namespace: str | None = None,
    subresource: str | None = None,
    name: str | None = None,
) -> bool:
    review = SubjectAccessReview(
        spec=SubjectAccessReviewSpec(
            user=user,
            groups=["system:serviceaccounts", "system:authenticated"],
            resourceAttributes=ResourceAttributes(
                verb=verb,
                resource=resource,
                group=group,
                namespace=namespace,
                subresource=subresource,
                name=name,
            ),
        )
    )
    got = client.create(review)
    assert got.status is not None
    return bool(got.status.allowed)


@pytest.mark.kube
def test_each_component_has_only_the_rights_it_needs(
    installed: tuple[ControlPlane, str, str],
) -> None:
    plane, release, namespace = installed
    client = plane.client

    def sa(name: str) -> str:
        return f"system:serviceaccount:{namespace}:{release}-{name}"

    ctl, agent, hook = sa("controller"), sa("agent"), sa("webhook")
    lease_group = {"group": "coordination.k8s.io"}
    controller_lease = {
        "resource": "leases",
        **lease_group,
        "namespace": namespace,
        "name": leases.NAME,
    }
    dra = {"group": "resource.k8s.io"}
    resource_slices = {"resource": "resourceslices", **dra}
    mig_parted = {
        "resource": "configmaps",
        "namespace": "gpu-operator",
        "name": "default-mig-parted-config",
    }
    yes = [
        (ctl, {"verb": "patch", "resource": "pods", "namespace": "default"}),
        (ctl, {"verb": "watch", "resource": "pods"}),
        (ctl, {"verb": "patch", "resource": "gpulayouts", "group": "migpilot.io"}),
        (ctl, {"verb": "create", "resource": "events", "namespace": "default"}),
        (ctl, {"verb": "update", **controller_lease}),
        (
            agent,
            {
                "verb": "patch",
                "resource": "gpulayouts",
                "group": "migpilot.io",
                "subresource": "status",
            },
        ),
        (agent, {"verb": "patch", "resource": "nodes", "subresource": "status"}),
        (agent, {"verb": "patch", "resource": "nodes"}),
        (agent, {"verb": "watch", "resource": "pods"}),
        (agent, {"verb": "list", "resource": "gpulayouts", "group": "migpilot.io"}),
        (agent, {"verb": "watch", **mig_parted}),
        *[(agent, {"verb": v, **resource_slices}) for v in ("list", "create", "update", "delete")],
        (agent, {"verb": "get", "resource": "resourceclaims", **dra, "namespace": "default"}),
        (agent, {"verb": "get", **controller_lease}),  # DRA steering: plan first while fresh
        (ctl, {"verb": "create", "resource": "leases", **lease_group, "namespace": namespace}),
        (ctl, {"verb": "get", **controller_lease}),
        # What pods' DRA claims ask (docs/dra.md, "Steering kube-scheduler").
        *[
            (ctl, {"verb": v, "resource": r, **dra})
            for v in ("get", "list", "watch")
            for r in ("resourceclaims", "resourceclaimtemplates")
        ],
        (
            hook,
            {
                "verb": "get",
                "resource": "leases",
                "group": "coordination.k8s.io",
                "namespace": namespace,
                "name": "migpilot-controller",
            },
        ),
        # What a new pod's DRA claims ask (docs/webhook.md), in any namespace.
        *[
            (hook, {"verb": "get", "resource": r, **dra, "namespace": "ns"})
            for r in ("resourceclaims", "resourceclaimtemplates")
        ],
    ]
    no = [
        (ctl, {"verb": "delete", "resource": "nodes"}),
        (ctl, {"verb": "get", "resource": "secrets", "namespace": namespace}),
        (ctl, {"verb": "delete", "resource": "pods", "namespace": "default"}),
        (ctl, {"verb": "update", **{**controller_lease, "namespace": "kube-system"}}),
        (ctl, {"verb": "create", "resource": "leases", **lease_group, "namespace": "default"}),
        (agent, {"verb": "patch", "resource": "gpulayouts", "group": "migpilot.io"}),
        (agent, {"verb": "patch", "resource": "pods", "namespace": "default"}),
        (agent, {"verb": "get", "resource": "secrets", "namespace": namespace}),
        (agent, {"verb": "delete", "resource": "nodes"}),
        (agent, {"verb": "list", "resource": "configmaps", "namespace": "gpu-operator"}),
        (agent, {"verb": "get", **{**mig_parted, "name": "some-other-config"}}),
        # Verbs its client never sends.
        *[(agent, {"verb": v, **resource_slices}) for v in ("get", "watch", "patch")],
        *[(agent, {"verb": v, **controller_lease}) for v in ("update", "list", "watch")],
        (agent, {"verb": "get", **{**controller_lease, "name": "some-other-lease"}}),
        (agent, {"verb": "get", **{**controller_lease, "namespace": "kube-node-lease"}}),
        (agent, {"verb": "update", "resource": "resourceclaims", **dra, "namespace": "default"}),
        (ctl, {"verb": "list", **resource_slices}),
        (ctl, {"verb": "update", "resource": "resourceclaims", **dra, "namespace": "default"}),
        (ctl, {"verb": "create", "resource": "resourceclaimtemplates", **dra, "namespace": "ns"}),
        (agent, {"verb": "get", **mig_parted}),
        (agent, {"verb": "get", "resource": "nodes"}),
        (agent, {"verb": "get", "resource": "gpulayouts", "group": "migpilot.io"}),
        (
            agent,
            {
                "verb": "update",
                "resource": "gpulayouts",
                "group": "migpilot.io",
                "subresource": "status",
            },
        ),
        (ctl, {"verb": "patch", "resource": "events", "namespace": "default"}),
        (ctl, {"verb": "update", "resource": "pods", "namespace": "default"}),
        (ctl, {"verb": "get", "resource": "pods", "namespace": "default"}),
        (ctl, {"verb": "update", "resource": "gpulayouts", "group": "migpilot.io"}),
        # The sharing configs are mounted by the kubelet, never read through the API.
        (
            agent,
            {
                "verb": "get",
                "resource": "configmaps",
                "namespace": namespace,
                "name": f"{release}-sharing",
            },
        ),
        (ctl, {"verb": "update", **{**controller_lease, "name": "someone-elses-lease"}}),
        (ctl, {"verb": "get", "resource": "configmaps", "namespace": namespace}),
        (hook, {"verb": "list", "resource": "leases", **lease_group}),
        (hook, {"verb": "get", "resource": "nodes"}),
        (hook, {"verb": "list", "resource": "gpulayouts", "group": "migpilot.io"}),
        (hook, {"verb": "get", "resource": "secrets", "namespace": namespace}),
        (
            hook,
            {
                "verb": "get",
                "resource": "leases",
                "group": "coordination.k8s.io",
                "namespace": "kube-system",
                "name": "migpilot-controller",
            },
        ),
        (hook, {"verb": "list", "resource": "pods"}),
        (hook, {"verb": "update", **controller_lease}),
        # Pods' claims are read one by one, never listed, watched or written.
        *[
            (hook, {"verb": v, "resource": r, **dra, "namespace": "default"})
            for v in ("list", "watch", "update", "create")
            for r in ("resourceclaims", "resourceclaimtemplates")
        ],
        (hook, {"verb": "get", **resource_slices}),
    ]
    for user, attrs in yes:
        assert _allowed(client, user, **attrs), (user, attrs)
    for user, attrs in no:
        assert not _allowed(client, user, **attrs), (user, attrs)
