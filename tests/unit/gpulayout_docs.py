"""GpuLayout documents the unit tests share: a MIG node's and an MPS node's, as the API server
holds them, and a way to edit one field of a copy (for the tests of the wire format and of the
controller's translation into the planner's types)."""

from __future__ import annotations

import copy
import re
from typing import Any


def mig() -> dict[str, Any]:
    """Two H100 GPUs: one reported with instances reserved, used, being created and free; one
    the agent has not reported."""
    return {
        "apiVersion": "migpilot.io/v1alpha1",
        "kind": "GpuLayout",
        "metadata": {"name": "node-a", "generation": 3, "uid": "ignored", "managedFields": []},
        "spec": {
            "gpus": [
                {
                    "index": 1,
                    "model": "h100-80gb",
                    "instances": [
                        {"profile": "3g.40gb", "start": 4},
                        {"profile": "1g.10gb", "start": 0, "reservedFor": "default/p1"},
                    ],
                },
                {"index": 0, "instances": [{"profile": "7g.80gb", "start": 0}]},
            ]
        },
        "status": {
            "observedGeneration": 3,
            "summary": {"gpus": 1, "instances": 4, "free": 1},
            "gpus": [
                {
                    "index": 1,
                    "model": "NVIDIA H100 80GB HBM3",
                    "uuid": "GPU-1",
                    "instances": [
                        {"profile": "1g.10gb", "start": 0, "uuid": "MIG-a", "state": "reserved"},
                        {"profile": "1g.10gb", "start": 1, "uuid": "MIG-b", "state": "used"},
                        {"profile": "1g.10gb", "start": 2, "state": "creating"},
                        {"profile": "3g.40gb", "start": 4, "uuid": "MIG-c", "state": "free"},
                    ],
                }
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "Reconciled",
                    "message": "",
                    "lastTransitionTime": "2026-01-02T03:04:05Z",
                    "observedGeneration": 3,
                }
            ],
        },
    }


def mps() -> dict[str, Any]:
    """An A100 serving MPS slices: one the spec lists and a pod uses, one the spec dropped that a
    pod still uses, one reserved by the spec."""
    return {
        "apiVersion": "migpilot.io/v1alpha1",
        "kind": "GpuLayout",
        "metadata": {"name": "mps-a"},
        "spec": {
            "gpus": [
                {
                    "index": 0,
                    "model": "a100-80gb",
                    "instances": [],
                    "mps": [
                        {"id": 2, "memoryGB": 20, "reservedFor": "ns/p2"},
                        {"id": 0, "memoryGB": 10, "cores": 30},
                    ],
                }
            ]
        },
        "status": {
            "gpus": [
                {
                    "index": 0,
                    "model": "NVIDIA A100-SXM4-80GB",
                    "uuid": "GPU-0",
                    "instances": [],
                    "mps": [
                        {"id": 0, "memoryGB": 10, "cores": 30, "state": "used", "usedBy": "ns/p0"},
                        {"id": 1, "memoryGB": 40, "state": "used"},
                        {"id": 2, "memoryGB": 20, "state": "reserved"},
                    ],
                }
            ],
            "conditions": [],
        },
    }


def edited(doc: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """Set (or with value ... delete) a dotted path with [i] indexes in a copy of doc."""
    out = copy.deepcopy(doc)
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    target: Any = out
    for p in parts[:-1]:
        target = target[int(p[1:-1])] if p.startswith("[") else target[p]
    last = parts[-1]
    key: Any = int(last[1:-1]) if last.startswith("[") else last
    if value is ...:
        del target[key]
    else:
        target[key] = value
    return out
