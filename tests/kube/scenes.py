"""The scene of the whole-system e2e tests: two KWOK nodes with emulated GPUs (two A100-80GB,
two H100-80GB), the webhook, one agent per node, and helpers to make and read pods. The
``scene`` fixture (``tests/e2e/conftest.py``) builds one per test."""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable
from typing import Any

import lightkube
from lightkube.models.core_v1 import Container, PodSpec, ResourceRequirements
from lightkube.models.meta_v1 import ObjectMeta
from lightkube.resources.core_v1 import Pod

from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from tests.kube import crds, system

WAIT_S = 120.0
NODES = {"ctl-a100": "a100-80gb", "ctl-h100": "h100-80gb"}


class Scene(system.System):
    """The processes of one test, its namespace, and helpers to make and read pods."""

    namespace: str = ""
    load_file: pathlib.Path | None = None
    """The agents' ``--emulated-load`` file (``load_scene``), else ``None``."""

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            got = predicate()
            if got:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}\n{self.dump()}\n{self.logs()}")
            time.sleep(0.1)

    def dump(self) -> str:
        """The GpuLayouts and the pods, for a failure's message."""
        lines = []
        for node in NODES:
            lay = self.layout(node)
            if lay is None:
                continue
            for g in lay.spec.gpus:
                insts = " ".join(
                    f"{i.profile}@{i.start}" + (f"->{i.reserved_for}" if i.reserved_for else "")
                    for i in g.instances
                )
                lines.append(f"{node} spec gpu {g.index}: {insts}")
            for gs in lay.status.gpus if lay.status else ():
                insts = " ".join(f"{i.profile}@{i.start}:{i.state}" for i in gs.instances)
                lines.append(f"{node} status gpu {gs.index}: {insts}")
        for p in self.pods():
            assert p.metadata is not None and p.spec is not None and p.status is not None
            gates = [g.name for g in p.spec.schedulingGates or []]
            lines.append(f"pod {p.metadata.name}: {p.status.phase} {p.spec.nodeName} {gates}")
        return "\n".join(lines)

    def pod(self, name: str, profile: str, count: int = 1) -> Pod:
        return Pod(
            metadata=ObjectMeta(name=name, namespace=self.namespace),
            spec=PodSpec(containers=[container(profile, count)]),
        )

    def pods(self) -> list[Pod]:
        return list(self.client.list(Pod, namespace=self.namespace))

    def running(self, names: set[str] | None = None) -> dict[str, str]:
        """Pod name -> node, of the pods Running (all of ``names`` or nothing)."""
        out = {}
        for p in self.pods():
            assert p.metadata is not None and p.status is not None and p.spec is not None
            name = p.metadata.name or ""
            if p.status.phase == "Running" and p.spec.nodeName:
                out[name] = p.spec.nodeName
        if names is not None and not names <= set(out):
            return {}
        return out

    def layout(self, node: str) -> gl.GpuLayout | None:
        try:
            return wire.parse(self.client.get(crds.GpuLayout, node).to_dict())
        except lightkube.ApiError:
            return None

    def reported(self) -> bool:
        """Every node's agent has reported its GPUs."""
        return all((lay := self.layout(n)) is not None and lay.status is not None for n in NODES)


def container(profile: str, count: int = 1) -> Container:
    limits = {f"nvidia.com/mig-{profile}": str(count)}
    return Container(name="c", image="none", resources=ResourceRequirements(limits=limits))
