"""``migpilot status``: the pure survey over hand-made objects, its JSON schema, the table it
renders, and the command's exits (bad kubeconfig, unreachable API server, --watch's Ctrl-C)."""

from __future__ import annotations

import io
import json
import pathlib
from typing import Any

import pytest

from migpilot import errors
from migpilot.api import gpulayouts as gl
from migpilot.api import gpulayouts_wire as wire
from migpilot.cli import main, output, status_cmd
from migpilot.controller import surveying

S = gl.InstanceState
A100 = "NVIDIA A100-SXM4-80GB"


def _layout(name: str, spec: list[gl.GpuSpec], status: list[gl.GpuStatus] | None) -> Any:
    st = gl.LayoutStatus(1, tuple(status)) if status is not None else None
    return wire.to_document(gl.GpuLayout(name, gl.LayoutSpec(tuple(spec)), st))


def _node(name: str, labels: dict[str, str] | None = None, gpus: int = 0) -> dict[str, Any]:
    alloc = {"cpu": "64", "memory": "512Gi"}
    if gpus:
        alloc["nvidia.com/gpu"] = str(gpus)
    return {"metadata": {"name": name, "labels": labels or {}}, "status": {"allocatable": alloc}}


def _pod(
    name: str,
    limits: dict[str, str],
    *,
    node: str | None = None,
    gated: bool = False,
    phase: str = "Pending",
    uid: str | None = None,
    created: str = "2025-01-01T00:00:00Z",
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "containers": [{"name": "c", "image": "x", "resources": {"limits": limits}}]
    }
    if node:
        spec["nodeName"] = node
    if gated:
        spec["schedulingGates"] = [{"name": "migpilot.io/plan"}]
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": uid or f"uid-{name}",
            "creationTimestamp": created,
            "annotations": annotations or {},
        },
        "spec": spec,
        "status": {"phase": "Running" if node and phase == "Pending" else phase},
    }


def _event(
    pod: str,
    reason: str,
    when: str,
    *,
    type_: str = "Normal",
    uid: str | None = None,
    component: str = "migpilot-controller",
    message: str = "",
) -> dict[str, Any]:
    return {
        "metadata": {"name": f"{pod}.{reason}", "namespace": "ns", "resourceVersion": "1"},
        "involvedObject": {
            "kind": "Pod",
            "namespace": "ns",
            "name": pod,
            "uid": uid or f"uid-{pod}",
        },
        "reason": reason,
        "message": message or f"{reason} message",
        "type": type_,
        "source": {"component": component},
        "lastTimestamp": when,
    }


MIG1 = "nvidia.com/mig-1g.10gb"
MIG2 = "nvidia.com/mig-2g.20gb"


def _cluster() -> dict[str, list[Any]]:
    n1 = _layout(
        "n1",
        [
            gl.GpuSpec(
                0,
                None,
                (
                    gl.InstanceSpec("3g.40gb", 0, reserved_for="ns/r"),
                    gl.InstanceSpec("1g.10gb", 4),
                    gl.InstanceSpec("1g.10gb", 5),
                    gl.InstanceSpec("1g.10gb", 6),
                ),
            ),
            gl.GpuSpec(
                1,
                None,
                (
                    gl.InstanceSpec("2g.20gb", 0),
                    gl.InstanceSpec("2g.20gb", 2),
                    gl.InstanceSpec("2g.20gb", 4),
                ),
            ),
        ],
        [
            gl.GpuStatus(
                0,
                A100,
                "GPU-0",
                (
                    gl.InstanceStatus("3g.40gb", 0, "MIG-r", S.RESERVED),
                    gl.InstanceStatus("1g.10gb", 4, "MIG-a", S.USED),
                    gl.InstanceStatus("1g.10gb", 5, "MIG-f", S.FREE),
                    gl.InstanceStatus("1g.10gb", 6, None, S.CREATING),
                ),
            ),
            gl.GpuStatus(
                1,
                A100,
                "GPU-1",
                (
                    gl.InstanceStatus("2g.20gb", 0, "MIG-u", S.USED, used_by="ns/u"),
                    gl.InstanceStatus("2g.20gb", 2, "MIG-b", S.USED),
                    gl.InstanceStatus("2g.20gb", 4, "MIG-c", S.USED),
                    gl.InstanceStatus("1g.10gb", 6, "MIG-d", S.DESTROYING),
                ),
            ),
        ],
    )
    n2 = _layout(
        "n2",
        [
            gl.GpuSpec(
                0,
                None,
                (),
                mps=(
                    gl.SliceSpec(0, 10),
                    gl.SliceSpec(1, 10),
                    gl.SliceSpec(2, 20),
                    gl.SliceSpec(3, 20, reserved_for="ns/m3"),
                ),
            )
        ],
        [
            gl.GpuStatus(
                0,
                A100,
                "GPU-2",
                (),
                mps=(
                    gl.SliceStatus(0, 10, None, S.USED, used_by="ns/m1"),
                    gl.SliceStatus(1, 10, None, S.USED),
                    gl.SliceStatus(2, 20, None, S.FREE),
                    gl.SliceStatus(3, 20, None, S.RESERVED),
                ),
            )
        ],
    )
    unreported = _layout(
        "n5", [gl.GpuSpec(0, None, (gl.InstanceSpec("7g.80gb", 0, reserved_for="ns/big"),))], None
    )
    nodes = [
        _node("n1", {"nvidia.com/gpu.count": "2"}),
        _node("n2", {"migpilot.io/mode": "mps"}),
        _node(
            "n3",
            {
                "migpilot.io/mode": "time-slicing",
                "nvidia.com/gpu.count": "2",
                "nvidia.com/gpu.replicas": "4",
                "nvidia.com/gpu.product": "NVIDIA A100-SXM4-40GB-SHARED",
            },
            gpus=8,
        ),
        _node("n4", {"migpilot.io/mode": "mps2", "nvidia.com/gpu.count": "1"}),
        _node("n5"),
        _node("cpu-only"),
    ]
    unified = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20000"}
    pods = [
        _pod("a", {MIG1: "1"}, node="n1"),
        _pod("b", {MIG2: "1"}, node="n1"),
        _pod("c", {MIG2: "1"}, node="n1"),
        _pod("done", {MIG1: "1"}, node="n1", phase="Succeeded"),
        _pod("u", unified, node="n1"),
        _pod("m1", {"nvidia.com/gpu-10gb": "1"}, node="n2"),
        _pod("m2", {"nvidia.com/gpu-10gb": "1"}, node="n2"),
        _pod("t1", {"nvidia.com/gpu": "1"}, node="n3"),
        _pod("t2", {"nvidia.com/gpu": "2"}, node="n3"),
        # waiting
        _pod("r", {"nvidia.com/mig-3g.40gb": "1"}, gated=True, created="2025-01-01T00:00:02Z"),
        _pod("huge", {"nvidia.com/mig-7g.80gb": "9"}, gated=True, created="2025-01-01T00:00:01Z"),
        _pod("new", {MIG1: "2"}, gated=True, created="2025-01-01T00:00:03Z"),
        _pod("bad", {MIG1: "1e1000000"}, created="2025-01-01T00:00:04Z"),
        _pod("again", {MIG1: "1"}, gated=True, uid="uid-second", created="2025-01-01T00:00:05Z"),
        _pod("unified", unified, gated=True, created="2025-01-01T00:00:06Z"),
        _pod("cpu", {"cpu": "1"}, created="2025-01-01T00:00:07Z"),
    ]
    events = [
        _event("r", "MigWaiting", "2025-01-01T00:01:00Z"),
        _event("r", "MigInstancesReserved", "2025-01-01T00:02:00Z"),
        _event("huge", "MigRequestUnservable", "2025-01-01T00:01:00Z", type_="Warning"),
        _event("new", "FailedScheduling", "2025-01-01T00:09:00Z", component="default-scheduler"),
        _event("bad", "MigpilotIgnoredPod", "2025-01-01T00:01:00Z", type_="Warning"),
        _event("again", "MigRequestUnservable", "2025-01-01T00:01:00Z", uid="uid-first"),
    ]
    return {"layouts": [n1, n2, unreported], "nodes": nodes, "pods": pods, "events": events}


@pytest.fixture
def status() -> surveying.Status:
    return surveying.survey(**_cluster())


def _node_of(status: surveying.Status, name: str) -> surveying.NodeStatus:
    return next(n for n in status.nodes if n.name == name)


def _devices(node: surveying.NodeStatus) -> dict[tuple[int, str, int], surveying.Device]:
    return {(g.index, d.profile, d.slot): d for g in node.gpus for d in g.devices}


def test_gpu_nodes_only_each_with_model_mode_and_gpus(status: surveying.Status) -> None:
    rows = [(n.name, n.model, n.mode, n.gpu_count, n.reported) for n in status.nodes]
    assert rows == [
        ("n1", A100, "mig", 2, True),
        ("n2", A100, "mps", 1, True),
        ("n3", "NVIDIA A100-SXM4-40GB-SHARED", "time-slicing", 2, False),
        ("n4", None, "mps2", 1, False),
        ("n5", None, "mig", 1, False),
    ]


def test_every_instance_state_with_its_holder(status: surveying.Status) -> None:
    got = {
        k: (d.state, d.pod, d.holding, d.candidates)
        for k, d in _devices(_node_of(status, "n1")).items()
    }
    assert got == {
        (0, "3g.40gb", 0): ("reserved", "ns/r", surveying.Holding.RESERVED_FOR, ()),
        # the only pod bound to n1 asking 1g.10gb (the Succeeded one holds nothing)
        (0, "1g.10gb", 4): ("used", "ns/a", surveying.Holding.INFERRED, ()),
        (0, "1g.10gb", 5): ("free", None, None, ()),
        (0, "1g.10gb", 6): ("creating", None, None, ()),
        (1, "2g.20gb", 0): ("used", "ns/u", surveying.Holding.USED_BY, ()),
        # two pods ask 2g.20gb: the holder of each is not known, and says who it may be
        (1, "2g.20gb", 2): ("used", None, surveying.Holding.UNKNOWN, ("ns/b", "ns/c")),
        (1, "2g.20gb", 4): ("used", None, surveying.Holding.UNKNOWN, ("ns/b", "ns/c")),
        (1, "1g.10gb", 6): ("destroying", None, None, ()),
    }
    assert _devices(_node_of(status, "n1"))[(0, "1g.10gb", 4)].uuid == "MIG-a"


def test_mps_slices_with_their_holders(status: surveying.Status) -> None:
    got = {
        k: (d.kind, d.state, d.pod, d.holding) for k, d in _devices(_node_of(status, "n2")).items()
    }
    mps = surveying.DeviceKind.MPS
    assert got == {
        (0, "mps-10gb", 0): (mps, "used", "ns/m1", surveying.Holding.USED_BY),
        # m1 is named by slice 0, so m2 is the only candidate left for slice 1
        (0, "mps-10gb", 1): (mps, "used", "ns/m2", surveying.Holding.INFERRED),
        (0, "mps-20gb", 2): (mps, "free", None, None),
        (0, "mps-20gb", 3): (mps, "reserved", "ns/m3", surveying.Holding.RESERVED_FOR),
    }


def test_time_slicing_replicas_per_node(status: surveying.Status) -> None:
    n3 = _node_of(status, "n3")
    assert n3.replicas == surveying.Replicas(per_gpu=4, total=8, used=3, pods=("ns/t1", "ns/t2"))
    assert _node_of(status, "n1").replicas is None


def test_problems_are_said_not_hidden(status: surveying.Status) -> None:
    assert "migpilot.io/mode='mps2'" in (_node_of(status, "n4").problem or "")
    n5 = _node_of(status, "n5")
    assert n5.problem is None
    assert [(d.state, d.pod, d.holding) for d in n5.gpus[0].devices] == [
        ("planned", "ns/big", surveying.Holding.RESERVED_FOR)
    ]


def test_a_layout_without_node_and_an_unreadable_layout() -> None:
    broken = {"apiVersion": gl.API_VERSION, "kind": gl.KIND, "metadata": {"name": "x"}}
    broken["spec"] = {"gpus": [{"index": 0, "instances": [{"profile": "1g.10gb", "start": -1}]}]}
    got = surveying.survey(layouts=[broken], nodes=[], pods=[], events=[])
    (node,) = got.nodes
    assert node.name == "x"
    assert "no Node of this name" in (node.problem or "")
    assert "GpuLayout cannot be read" in (node.problem or "")


def test_pending_pods_with_the_latest_controller_event(status: surveying.Status) -> None:
    got = [(p.pod, p.gated, p.reason, p.event_type) for p in status.pending]
    assert got == [
        ("ns/huge", True, "MigRequestUnservable", "Warning"),
        ("ns/r", True, "MigInstancesReserved", "Normal"),
        # another component's event is not migpilot's reason
        ("ns/new", True, None, None),
        ("ns/bad", False, "MigpilotIgnoredPod", "Warning"),
        # the event was about an earlier pod of the same name
        ("ns/again", True, None, None),
        ("ns/unified", True, None, None),
    ]
    asks = {p.pod: p.asks for p in status.pending}
    assert asks["ns/new"] == ("nvidia.com/mig-1g.10gb: 2",)
    assert asks["ns/unified"] == ("nvidia.com/gpu: 1 (unified)",)
    assert asks["ns/bad"][0].startswith("unreadable: ")


def test_utilisation_only_from_a_source() -> None:
    without = surveying.survey(**_cluster())
    assert all(d.utilization is None for n in without.nodes for g in n.gpus for d in g.devices)
    assert without.utilization_source is None
    got = surveying.survey(**_cluster(), utilization={"ns/a": 0.5}, utilization_source="prom")
    assert _devices(_node_of(got, "n1"))[(0, "1g.10gb", 4)].utilization == 0.5
    assert _devices(_node_of(got, "n1"))[(0, "1g.10gb", 5)].utilization is None
    assert got.utilization_source == "prom"


# --------------------------------------------------------------------------- JSON


def test_json_schema(status: surveying.Status) -> None:
    doc = json.loads(json.dumps(surveying.to_json(status)))
    assert set(doc) == {"schemaVersion", "utilizationSource", "nodes", "pending"}
    assert doc["schemaVersion"] == 1
    n1 = doc["nodes"][0]
    assert set(n1) == {
        "name", "model", "mode", "gpuCount", "reported", "problem", "gpus", "replicas"
    }  # fmt: skip
    assert set(n1["gpus"][0]) == {"index", "model", "uuid", "devices"}
    unknown = n1["gpus"][1]["devices"][1]
    assert unknown == {
        "kind": "mig",
        "profile": "2g.20gb",
        "slot": 2,
        "uuid": "MIG-b",
        "state": "used",
        "pod": None,
        "holder": "unknown",
        "candidates": ["ns/b", "ns/c"],
        "utilization": None,
    }
    assert doc["nodes"][2]["replicas"] == {
        "perGpu": 4,
        "total": 8,
        "used": 3,
        "pods": ["ns/t1", "ns/t2"],
    }
    assert doc["pending"][0] == {
        "pod": "ns/huge",
        "asks": ["nvidia.com/mig-7g.80gb: 9"],
        "gated": True,
        "created": "2025-01-01T00:00:01Z",
        "reason": "MigRequestUnservable",
        "message": "MigRequestUnservable message",
        "eventType": "Warning",
    }


# --------------------------------------------------------------------------- tables


def _text(status: surveying.Status) -> str:
    out = io.StringIO()
    output.console_for(out, width=160).print(status_cmd.renderable(status))
    return out.getvalue()


def test_table_render(status: surveying.Status) -> None:
    text = _text(status)
    lines = [line.rstrip() for line in text.splitlines()]
    assert f"n1  {A100}  mode mig  2 GPUs" in lines
    assert (
        "  1g.10gb: 1 creating, 1 destroying, 1 free, 1 used; 2g.20gb: 3 used; 3g.40gb: 1 reserved"
        in lines
    )
    row = next(
        line for line in lines if "MIG" not in line and " 2g.20gb " in line and " 2 " in line
    )
    assert row.split() == ["1", "2g.20gb", "2", "used", "unknown:", "one", "of", "ns/b,", "ns/c"]
    assert any(
        line.split() == ["0", "1g.10gb", "4", "used", "ns/a", "(inferred)"] for line in lines
    )
    assert any(line.split()[:5] == ["0", "mps-10gb", "0", "used", "ns/m1"] for line in lines)
    assert "  replicas (4 per GPU): 3 of 8 used: ns/t1, ns/t2" in lines
    assert "UTIL" not in text  # no source: no column, no made-up numbers
    assert "Pending pods (6)" in text
    assert any("ns/new" in line and "no event from the controller yet" in line for line in lines)
    assert "(the agent has not reported)" in text  # n5


def test_table_shows_utilisation_with_a_source() -> None:
    got = surveying.survey(**_cluster(), utilization={"ns/a": 0.425}, utilization_source="prom")
    lines = [line.split() for line in _text(got).splitlines()]
    assert ["0", "1g.10gb", "4", "used", "ns/a", "(inferred)", "42%"] in lines
    assert ["0", "1g.10gb", "5", "free", "-", "-"] in lines


def test_empty_cluster() -> None:
    text = _text(surveying.survey(layouts=[], nodes=[], pods=[], events=[]))
    assert "No GPU nodes" in text
    assert "No pods waiting for migpilot." in text


# --------------------------------------------------------------------------- the command


def test_bad_kubeconfig_is_one_line_and_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "kc"
    bad.write_text("- a list\n")
    assert main.main(["status", "--kubeconfig", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"--kubeconfig {bad}: not a kubeconfig" in err


def test_unreachable_api_server_is_one_line_and_exit_2(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kc = tmp_path / "kc"
    kc.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": "http://127.0.0.1:1"}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    assert main.main(["status", "--kubeconfig", str(kc), "-o", "json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("migpilot: error: the API server cannot be reached")


def test_watch_reads_again_until_ctrl_c() -> None:
    shown: list[surveying.Status] = []
    said: list[str] = []
    reads = iter([surveying.Status((), ()), errors.ConfigError("gone"), surveying.Status((), ())])
    sleeps: list[float] = []

    def read_once() -> surveying.Status:
        got = next(reads)
        if isinstance(got, Exception):
            raise got
        return got

    def sleep(s: float) -> None:
        sleeps.append(s)
        if len(sleeps) == 3:
            raise KeyboardInterrupt

    code = status_cmd.watch(
        read_once=read_once, show=shown.append, interval_s=5, sleep=sleep, complain=said.append
    )
    assert code == 0
    assert len(shown) == 2
    assert said == ["migpilot: error: gone (trying again in 5 s)"]
    assert sleeps == [5, 5, 5]


def test_watch_gives_up_when_the_first_read_fails() -> None:
    def read_once() -> surveying.Status:
        raise errors.ConfigError("no such file")

    with pytest.raises(errors.ConfigError):
        status_cmd.watch(read_once=read_once, show=print, interval_s=1, sleep=lambda _: None)


def test_watch_json_is_one_document_per_line(status: surveying.Status) -> None:
    out = io.StringIO()
    status_cmd.write(out, status, "json", watching=True)
    status_cmd.write(out, status, "json", watching=True)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[1]) == surveying.to_json(status)


@pytest.mark.parametrize("bad", ["0", "-1", "x", "3601"])
def test_interval_must_be_sensible(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main.main(["status", "--watch", "--interval", bad])
    assert "--interval" in capsys.readouterr().err


def test_a_reservation_the_spec_no_longer_names_is_unknown() -> None:
    doc = _layout(
        "n1",
        [gl.GpuSpec(0, None, (gl.InstanceSpec("7g.80gb", 0),))],
        [gl.GpuStatus(0, A100, "GPU-0", (gl.InstanceStatus("7g.80gb", 0, "MIG-x", S.RESERVED),))],
    )
    got = surveying.survey(layouts=[doc], nodes=[_node("n1")], pods=[], events=[])
    (device,) = got.nodes[0].gpus[0].devices
    assert (device.state, device.pod, device.holding) == (
        "reserved",
        None,
        surveying.Holding.UNKNOWN,
    )


def _time_sliced() -> surveying.Status:
    """One A100 shared as replicas: 0 used by a unified pod (``usedBy``), 1 used by the only
    NVIDIA-style pod bound (no ``usedBy``: inferred), 2 kept for a pending pod, 3 free, and 4
    kept in the spec but not (yet) reported."""
    replicas = (
        gl.ReplicaStatus(0, S.USED, "ns/h"),
        gl.ReplicaStatus(1, S.USED),
        gl.ReplicaStatus(2, S.RESERVED),
        gl.ReplicaStatus(3, S.FREE),
    )
    kept = (gl.ReplicaSpec(2, "ns/k"), gl.ReplicaSpec(4, "ns/p"))
    layout = _layout(
        "ts",
        [gl.GpuSpec(0, None, (), replicas=kept)],
        [gl.GpuStatus(0, A100, "GPU-9", (), replicas=replicas)],
    )
    labels = {"migpilot.io/mode": "time-slicing", "nvidia.com/gpu.replicas": "4"}
    unified = {"nvidia.com/gpu": "1", "nvidia.com/gpumem": "20000"}
    pods = [
        _pod("h", unified, node="ts"),
        _pod("w", {"nvidia.com/gpu": "1"}, node="ts"),
        _pod("k", unified, gated=True),
    ]
    return surveying.survey(
        layouts=[layout], nodes=[_node("ts", labels, gpus=4)], pods=pods, events=[]
    )


def test_time_slicing_replicas_with_their_holders_as_mps_slices_are_shown() -> None:
    status = _time_sliced()
    node = _node_of(status, "ts")
    rep, held = surveying.DeviceKind.REPLICA, surveying.Holding
    got = {k: (d.kind, d.state, d.pod, d.holding) for k, d in _devices(node).items()}
    assert got == {
        (0, "replica", 0): (rep, "used", "ns/h", held.USED_BY),
        # the unified pod is named by replica 0 and is no candidate: w is the only one
        (0, "replica", 1): (rep, "used", "ns/w", held.INFERRED),
        (0, "replica", 2): (rep, "reserved", "ns/k", held.RESERVED_FOR),
        (0, "replica", 3): (rep, "free", None, None),
        (0, "replica", 4): (rep, "planned", "ns/p", held.RESERVED_FOR),
    }
    assert node.replicas == surveying.Replicas(per_gpu=4, total=4, used=2, pods=("ns/h", "ns/w"))
    lines = [line.rstrip() for line in _text(status).splitlines()]
    assert "  replica: 1 free, 1 planned, 1 reserved, 2 used" in lines
    assert any(line.split() == ["0", "replica", "0", "used", "ns/h"] for line in lines)
    assert any(
        line.split() == ["0", "replica", "1", "used", "ns/w", "(inferred)"] for line in lines
    )
    doc = json.loads(json.dumps(surveying.to_json(status)))
    assert doc["nodes"][0]["gpus"][0]["devices"][2] == {
        "kind": "replica",
        "profile": "replica",
        "slot": 2,
        "uuid": None,
        "state": "reserved",
        "pod": "ns/k",
        "holder": "reservedFor",
        "candidates": [],
        "utilization": None,
    }


def test_two_nvidia_style_pods_on_replicas_are_candidates_not_guesses() -> None:
    layout = _layout(
        "ts",
        [gl.GpuSpec(0, None, ())],
        [gl.GpuStatus(0, A100, "GPU-9", (), replicas=(gl.ReplicaStatus(0, S.USED),))],
    )
    pods = [_pod("w1", {"nvidia.com/gpu": "1"}, node="ts"), _pod("w2", {MIG1: "1"}, node="ts")]
    pods.append(_pod("w3", {"nvidia.com/gpu": "1"}, node="ts"))
    node = _node("ts", {"migpilot.io/mode": "time-slicing"}, gpus=4)
    status = surveying.survey(layouts=[layout], nodes=[node], pods=pods, events=[])
    (d,) = _node_of(status, "ts").gpus[0].devices
    assert (d.pod, d.holding, d.candidates) == (None, surveying.Holding.UNKNOWN, ("ns/w1", "ns/w3"))


def test_renamed_replicas_are_counted_with_the_nodes_replicas() -> None:
    """A sharing config renaming the replicas (``renameByDefault``): the Node advertises
    ``nvidia.com/gpu.shared``, which the agent does not report per GPU; the summary counts them."""
    labels = {"migpilot.io/mode": "time-slicing", "nvidia.com/gpu.replicas": "4"}
    node = _node("ts", labels)
    node["status"]["allocatable"]["nvidia.com/gpu.shared"] = "8"
    pods = [_pod("s", {"nvidia.com/gpu.shared": "2"}, node="ts")]
    status = surveying.survey(layouts=[], nodes=[node], pods=pods, events=[])
    assert _node_of(status, "ts").replicas == surveying.Replicas(
        per_gpu=4, total=8, used=2, pods=("ns/s",)
    )
    assert "  replicas (4 per GPU): 2 of 8 used: ns/s" in _text(status).splitlines()
