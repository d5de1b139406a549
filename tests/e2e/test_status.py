"""``migpilot status`` on the real control plane: the controller places MIG pods, the agents
report their instances, and ``python -m migpilot status --kubeconfig ... -o json`` names the
nodes, the instances in use and their holders, and a pod nothing can serve with its reason."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

from tests.kube.scenes import NODES, Scene

pytestmark = pytest.mark.kube

MODELS = {"ctl-a100": "A100", "ctl-h100": "H100"}


def _status(scene: Scene, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "migpilot",
            "status",
            "--kubeconfig",
            str(scene.plane.kubeconfig),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _holders(doc: dict[str, Any]) -> dict[str, list[tuple[str, str, str, str]]]:
    """Pod -> (node, profile, state, how known) of each device it holds."""
    out: dict[str, list[tuple[str, str, str, str]]] = {}
    for n in doc["nodes"]:
        for g in n["gpus"]:
            for d in g["devices"]:
                if d["pod"] is not None:
                    out.setdefault(d["pod"], []).append(
                        (n["name"], d["profile"], d["state"], d["holder"])
                    )
    return out


def test_status_names_nodes_holders_and_the_pod_that_cannot_be_served(scene: Scene) -> None:
    client = scene.client
    ns = scene.namespace
    scene.start_controller("c1")
    scene.wait(scene.reported, "the agents' first status")
    client.create(scene.pod("small", "1g.10gb"))
    client.create(scene.pod("medium", "2g.20gb"))
    # No node has three GPUs: the controller refuses it and says so.
    client.create(scene.pod("huge", "7g.80gb", count=3))
    placed = scene.wait(lambda: scene.running({"small", "medium"}), "two pods Running")

    def settled() -> dict[str, Any] | None:
        got = _status(scene, "-o", "json")
        assert got.returncode == 0, got.stderr
        doc: dict[str, Any] = json.loads(got.stdout)
        holders = _holders(doc)
        in_use = all(
            any(state == "used" for _, _, state, _ in holders.get(f"{ns}/{p}", ()))
            for p in ("small", "medium")
        )
        reasons = {p["pod"]: p["reason"] for p in doc["pending"]}
        return doc if in_use and reasons.get(f"{ns}/huge") == "MigRequestUnservable" else None

    doc = scene.wait(settled, "status showing both holders and the refused pod")
    assert doc["schemaVersion"] == 1
    assert doc["utilizationSource"] is None
    nodes = {n["name"]: n for n in doc["nodes"]}
    assert set(nodes) >= set(NODES)
    for name in NODES:
        node = nodes[name]
        assert node["mode"] == "mig"
        assert node["gpuCount"] == 2
        assert node["reported"] is True
        assert MODELS[name] in (node["model"] or "")
        assert [g["index"] for g in node["gpus"]] == [0, 1]
    holders = _holders(doc)
    for pod, profile in (("small", "1g.10gb"), ("medium", "2g.20gb")):
        used = [h for h in holders[f"{ns}/{pod}"] if h[2] == "used"]
        # Each is the only pod on its node asking its profile: the holder is read from the
        # spec's reservation while it lasts, then inferred from the pods bound to the node.
        assert len(used) == 1, holders
        node, got_profile, _, how = used[0]
        assert (node, got_profile) == (placed[pod], profile)
        assert how in ("reservedFor", "inferred")
    huge = next(p for p in doc["pending"] if p["pod"] == f"{ns}/huge")
    assert huge["asks"] == ["nvidia.com/mig-7g.80gb: 3"]
    assert huge["eventType"] == "Warning"
    assert "can never run" in huge["message"]

    # The table view says the same, and a bad kubeconfig is one line with exit 2.
    table = _status(scene)
    assert table.returncode == 0, table.stderr
    assert "ctl-a100" in table.stdout
    assert f"{ns}/huge" in table.stdout
    assert "MigRequestUnservable" in table.stdout
    bad = scene.root / "bad-kubeconfig"
    bad.write_text("[]\n")
    refused = subprocess.run(
        [sys.executable, "-m", "migpilot", "status", "--kubeconfig", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2
    assert refused.stderr.count("\n") == 1
