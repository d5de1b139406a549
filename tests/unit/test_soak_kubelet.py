"""The fake-kubelet nodes (``bench/soak_kubelet.py``, ``tests/kube/drakubelet.py``): KWOK's
pod-ready Stage (and for the DRA kubelet its pod-delete Stage) rewritten by
``tests/kube/kwokstages.py`` so that node's pods stay Pending until its fake kubelet has
allocated or prepared their devices (and a deleted one stays until it unprepared them), and the
status it then writes, as a kubelet keeps a pod Pending until admission and Allocate are done."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import yaml

from tests.kube import kwokstages

POD_READY = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.phase'
      operator: 'In'
      values:
      - 'Pending'
  next:
    statusTemplate: |
      {{ $now := Now }}
      phase: Running
"""
OTHER = """\
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
"""


def test_pod_ready_leaves_the_held_nodes_pods_alone(tmp_path: Path) -> None:
    ready, other = tmp_path / "pod-ready.yaml", tmp_path / "pod-delete.yaml"
    ready.write_text(POD_READY)
    other.write_text(OTHER)
    out = kwokstages.kwok_stages((other, ready), nodes=("soak-h100-0",), folder=tmp_path / "stages")
    assert out == (other, tmp_path / "stages" / "pod-ready.yaml")
    (doc,) = yaml.safe_load_all(out[1].read_text())
    original = yaml.safe_load(POD_READY)
    assert doc["spec"]["selector"]["matchExpressions"] == [
        *original["spec"]["selector"]["matchExpressions"],
        {"key": ".spec.nodeName", "operator": "NotIn", "values": ["soak-h100-0"]},
    ]
    # Everything else as KWOK ships it, the status template to the character.
    assert doc["spec"]["next"] == original["spec"]["next"]
    assert doc["metadata"] == original["metadata"]
    assert ready.read_text() == POD_READY  # the shared file is not touched


def test_the_dra_kubelet_holds_pod_ready_and_pod_delete(tmp_path: Path) -> None:
    ready, delete = tmp_path / "pod-ready.yaml", tmp_path / "pod-delete.yaml"
    ready.write_text(POD_READY)
    delete.write_text(OTHER)
    names = (kwokstages.POD_READY, kwokstages.POD_DELETE)
    out = kwokstages.kwok_stages(
        (delete, ready), nodes=("dra-0",), folder=tmp_path / "stages", names=names
    )
    assert out == (tmp_path / "stages" / "pod-delete.yaml", tmp_path / "stages" / "pod-ready.yaml")
    for path in out:
        (doc,) = yaml.safe_load_all(path.read_text())
        held = {"key": ".spec.nodeName", "operator": "NotIn", "values": ["dra-0"]}
        assert doc["spec"]["selector"]["matchExpressions"][-1] == held
    with pytest.raises(ValueError, match="no pod-delete Stage"):
        kwokstages.kwok_stages((ready,), nodes=("n",), folder=tmp_path / "x", names=names)


def test_stages_without_pod_ready_or_nodes_are_refused(tmp_path: Path) -> None:
    other = tmp_path / "pod-delete.yaml"
    other.write_text(OTHER)
    with pytest.raises(ValueError, match="no pod-ready Stage"):
        kwokstages.kwok_stages((other,), nodes=("n",), folder=tmp_path)
    with pytest.raises(ValueError, match="at least one node"):
        kwokstages.held_until_admitted(yaml.safe_load(POD_READY), nodes=())
    with pytest.raises(ValueError, match="not KWOK's pod-ready Stage"):
        kwokstages.held_until_admitted(yaml.safe_load(OTHER), nodes=("n",))


def test_a_started_pod_is_running_and_ready_with_each_container_running() -> None:
    doc = {"spec": {"containers": [{"name": "c", "image": "pause"}, {"name": "d"}]}}
    now = datetime.datetime(2026, 11, 28, 3, 14, 20, tzinfo=datetime.UTC)
    status = kwokstages.running_status(doc, now=now)["status"]
    assert status["phase"] == "Running" and status["startTime"] == "2026-11-28T03:14:20Z"
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "PodScheduled": "True", "Initialized": "True", "Ready": "True", "ContainersReady": "True"
    }  # fmt: skip
    assert [(c["name"], c["ready"], c["state"]) for c in status["containerStatuses"]] == [
        ("c", True, {"running": {"startedAt": "2026-11-28T03:14:20Z"}}),
        ("d", True, {"running": {"startedAt": "2026-11-28T03:14:20Z"}}),
    ]
