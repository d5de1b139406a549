"""The objects the controller's tests on sharing nodes (modes ``mps`` and ``time-slicing``,
``docs/modes.md``) put into the in-memory API: a Node in a mode, a pod asking for GPU resources
(gated by ``migpilot.io/plan`` or bound), the agent's status of one GPU, and a pod's binding.
One set of builders, so the two modes' tests differ only in what they test."""

from __future__ import annotations

import copy
from typing import Any

from migpilot.controller import kubeapi, observing
from migpilot.kube import objects as kubeobjects


def node(name: str, *, mode: str, **allocatable: str) -> dict[str, Any]:
    """A Ready Node labelled ``migpilot.io/mode=<mode>`` with ``allocatable`` beside its CPUs."""
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"kubernetes.io/hostname": name, "migpilot.io/mode": mode},
        },
        "status": {
            "conditions": [{"type": "Ready", "status": "True"}],
            "allocatable": {"cpu": "32", "memory": "256Gi", **allocatable},
        },
    }


def pod(name: str, limits: dict[str, str], *, node: str | None = None) -> dict[str, Any]:
    """A pending pod in namespace ``ns`` with one container of ``limits``: gated by
    ``migpilot.io/plan``, or bound to ``node`` when given."""
    spec: dict[str, Any] = {"containers": [{"name": "c", "resources": {"limits": limits}}]}
    if node is None:
        spec["schedulingGates"] = [{"name": observing.GATE}]
    else:
        spec["nodeName"] = node
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": f"uid-{name}",
            "creationTimestamp": f"2026-01-01T00:00:0{len(name) % 10}Z",
        },
        "spec": spec,
        "status": {"phase": "Pending"},
    }


async def report(api: kubeapi.InMemoryApi, node: str, gpus: list[dict[str, Any]]) -> None:
    """The agent's status of ``node``'s GpuLayout: ``gpus``, at generation 1."""
    doc = copy.deepcopy(api.objects[kubeobjects.Kind.LAYOUTS][node])
    doc["status"] = {"observedGeneration": 1, "gpus": gpus}
    await api.put(kubeobjects.Kind.LAYOUTS, doc)


async def bind(api: kubeapi.InMemoryApi, key: str, node: str) -> None:
    """What kube-scheduler does to the pinned pod ``key`` (``namespace/name``): bound to
    ``node``, its gates gone."""
    bound = copy.deepcopy(api.objects[kubeobjects.Kind.PODS][key])
    bound["spec"]["nodeName"] = node
    bound["spec"].pop("schedulingGates", None)
    await api.put(kubeobjects.Kind.PODS, bound)
