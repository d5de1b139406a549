"""``migpilot agent``: bad input is one line and exit 2 before anything starts; ``--once`` works.

Everything here runs ``cli.main`` in process with ``--once`` or a flag that fails before the
agent starts, so no socket is served and nothing waits.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from migpilot.agent import assembling
from migpilot.agent.cluster import kubeapi
from migpilot.cli import agent_cmd
from migpilot.cli import main as cli

CONFIG = """\
version: v1
mig-configs:
  all-1g.10gb:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
  balanced:
    - devices: all
      mig-enabled: true
      mig-devices: {"1g.10gb": 1, "2g.20gb": 1, "3g.40gb": 1}
  too-big:
    - devices: all
      mig-enabled: true
      mig-devices: {"4g.40gb": 2}
  a100-only:
    - device-filter: "0x20B010DE"
      devices: all
      mig-enabled: true
      mig-devices: {"1g.5gb": 9}
  by-board:
    - devices: all
      mig-enabled: true
      mig-devices: {"3g.40gb": 2}
    - device-filter: "0x233010DE:0x16C110DE"
      devices: all
      mig-enabled: true
      mig-devices: {"7g.80gb": 1}
"""


def run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = cli.main(["agent", *argv], out=out)
    return code, out.getvalue()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "mig-parted.yaml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def kubelet_dir(tmp_path: Path) -> Path:
    (tmp_path / "kubelet" / "device-plugins").mkdir(parents=True)
    return tmp_path / "kubelet"


UNREACHABLE = """\
apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "http://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
"""

BAD_CASES = [
    (["--strategy", "mixd"], "unknown MIG strategy 'mixd' (choose none, single, mixed)"),
    (["--backend", "cuda"], "unknown backend 'cuda' (expected nvml or emulated:MODEL:xN"),
    (["--backend", "emulated:h100-81gb:x2"], "backend 'emulated:h100-81gb:x2': unknown GPU"),
    (["--backend", "emulated:h100-80gb:x0"], "GPU count must be 1 to 64, got 0"),
    (["--backend", "emulated"], "names no GPU model"),
    (
        ["--backend", "emulated:0x233010DE:0x16C110DE:extra"],
        "'0x233010DE:0x16C110DE:extra' expected DEVICE or DEVICE:SUBSYSTEM",
    ),
    (["--device-list-strategy", "volume"], "unknown device-list strategy 'volume'"),
    (["--device-list-strategy", ","], "--device-list-strategy names no strategy"),
    (["--config", "{config}"], "--config needs -c NAME or --node-labels FILE"),
    (["-c", "balanced"], "-c needs --config FILE"),
    (["--config", "{config}", "-c", "balancd"], "no config 'balancd'; did you mean 'balanced'?"),
    (
        ["--config", "{config}", "-c", "too-big"],
        "config 'too-big' entry 0 cannot be placed on GPU 0",
    ),
    (["--config", "{missing}", "-c", "balanced"], "No such file or directory"),
    (["--config", "{config}", "--node-labels", "{labels}"], "no config 'nope'"),
    (["--backend", "nvml", "--state-file", "{tmp}/s.json"], "--state-file applies only to an"),
    (["--state-file", "{tmp}/no/such/s.json"], "does not exist"),
    (["--labels-file", "{tmp}/no/such/labels"], "--labels-file"),
    (["--kubeconfig", "{missing}"], "--kubeconfig needs --node NAME"),
    (
        ["--node", "n", "--config", "{config}", "-c", "balanced"],
        "--config does not apply with --node",
    ),
    (["--node", "n", "--kubeconfig", "{missing}"], "--kubeconfig {missing}"),
    (
        ["--node", "n", "--kubeconfig", "{unreachable}", "--start-patience", "0"],
        "the API server cannot be reached",
    ),
    (["--kubelet", "simulated"], "--kubelet simulated needs --node NAME"),
    (
        [
            "--node",
            "n",
            "--kubeconfig",
            "{unreachable}",
            "--mig-parted-configmap",
            "cm",
            "--start-patience",
            "0",
        ],
        "--mig-parted-configmap 'cm': expected NAMESPACE/NAME[:KEY]",
    ),
    (["--kubelet", "{tmp}", "--kubelet-dir", "{tmp}/k"], "name the same folder"),
    (["--proc-root", "{tmp}/no/such"], "--proc-root {tmp}/no/such: not a folder"),
]


@pytest.mark.parametrize(("argv", "message"), BAD_CASES, ids=[m for _, m in BAD_CASES])
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str],
    message: str,
    config: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    labels = tmp_path / "node-labels"
    labels.write_text("nvidia.com/mig.config=nope\n")
    state = tmp_path / "state.json"
    unreachable = tmp_path / "unreachable.kubeconfig"
    unreachable.write_text(UNREACHABLE)
    values = {
        "config": str(config),
        "unreachable": str(unreachable),
        "missing": str(tmp_path / "absent.yaml"),
        "labels": str(labels),
        "tmp": str(tmp_path),
    }
    args = [a.format(**values) for a in argv]
    if "--backend" not in args:
        args += ["--backend", "emulated:h100-80gb:x2"]
    if "--state-file" not in args and "nvml" not in args:
        args += ["--state-file", str(state)]
    code, out = run(*args, "--once", "--no-kubelet")
    err = capsys.readouterr().err
    assert code == 2
    assert out == ""
    assert err.startswith("migpilot: error: ") and err.count("\n") == 1, err
    assert message.format(**values) in err
    if state.exists():  # the emulated GPUs were opened, but nothing was created
        gpus = json.loads(state.read_text())["gpus"]
        assert all(g["instances"] == [] for g in gpus)


def test_missing_kubelet_folder_is_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = run("--backend", "emulated:a30", "--kubelet-dir", str(tmp_path / "nope"))
    assert code == 2
    assert "device-plugin folder" in capsys.readouterr().err


def test_cdi_with_emulated_gpus_needs_a_proc_root(
    kubelet_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--backend", "emulated:a30", "--kubelet-dir", str(kubelet_dir)]
    code, _ = run(*argv, "--device-list-strategy", "cdi", "--cdi-spec-dir", str(tmp_path / "c"))
    assert code == 2
    assert "cdi with an emulated backend needs --proc-root DIR" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()  # refused before anything was written


@pytest.mark.parametrize("case", ["folder-is-a-file", "not-json"])
def test_bad_allocations_file_is_bad_input(
    case: str, kubelet_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if case == "folder-is-a-file":
        (tmp_path / "plain").write_text("")
        ledger, message = tmp_path / "plain" / "allocations.json", "cannot create"
    else:
        ledger, message = tmp_path / "allocations.json", "the allocation ledger is not JSON"
        ledger.write_text("{half")
    backend = ["--backend", "emulated:h100-80gb:x1", "--state-file", str(tmp_path / "s.json")]
    code, _ = run(*backend, "--kubelet-dir", str(kubelet_dir), "--allocations-file", str(ledger))
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("migpilot: error: ") and message in err


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon"])
def test_start_patience_is_zero_or_more_seconds(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        run("--node", "n", "--start-patience", value)
    assert exit_.value.code == 2
    assert "--start-patience" in capsys.readouterr().err


def test_mutually_exclusive_name_and_labels(config: Path) -> None:
    with pytest.raises(SystemExit) as exit_:
        run("--config", str(config), "-c", "balanced", "--node-labels", "x")
    assert exit_.value.code == 2


def test_once_applies_then_is_idempotent(
    config: Path,
    kubelet_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    state = tmp_path / "state.json"
    labels = tmp_path / "labels"
    common = [
        "--backend",
        "emulated:h100-80gb:x2",
        "--state-file",
        str(state),
        "--config",
        str(config),
        "--kubelet-dir",
        str(kubelet_dir),
        "--once",
    ]
    code, out = run(*common, "-c", "balanced", "--labels-file", str(labels))
    assert code == 0, capsys.readouterr().err
    assert out.count("done     GPU ") == 6
    assert "GPU 1: 2g.20gb@0 1g.10gb@2 3g.40gb@4\n" in out
    assert "nvidia.com/mig-2g.20gb.count=2\n" in labels.read_text()
    code, out = run(*common, "-c", "balanced")
    assert code == 0
    assert "done" not in out
    # No kubelet answers here: devices count as in use, so the change is refused (exit 1).
    caplog.clear()
    code, out = run(*common, "-c", "all-1g.10gb")
    assert code == 1
    assert "is in use; desired 1g.10gb@0 not created" in out
    assert "PodResources API cannot be asked" in caplog.text
    # Standalone, only processes hold devices: the change goes through.
    code, out = run(*common, "-c", "all-1g.10gb", "--no-kubelet")
    assert code == 0
    assert out.endswith("GPU 1: " + " ".join(f"1g.10gb@{s}" for s in range(7)) + "\n")


def test_entries_that_match_no_gpu_leave_it_alone(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a100-only would not place 9 x 1g.5gb, but no A100 is on this node: nothing to do.
    code, out = run(
        "--backend",
        "emulated:h100-80gb",
        "--config",
        str(config),
        "-c",
        "a100-only",
        "--once",
        "--no-kubelet",
    )
    assert code == 0, capsys.readouterr().err
    assert out == "GPU 0: (no MIG instances)\n"


def test_an_entry_for_one_board_reaches_only_gpus_on_that_board(
    config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = run(
        "--backend",
        "emulated:0x233010DE:0x16C110DE,0x233010DE:0x16C010DE,h100-80gb",
        "--config",
        str(config),
        "-c",
        "by-board",
        "--once",
        "--no-kubelet",
    )
    assert code == 0, capsys.readouterr().err
    assert "GPU 0: 7g.80gb@0\n" in out
    assert "GPU 1: 3g.40gb@0 3g.40gb@4\n" in out  # a sibling board: not the board's entry
    assert "GPU 2: 3g.40gb@0 3g.40gb@4\n" in out  # a board nothing is known about


def test_unified_flags() -> None:
    parser = cli.build_parser()
    got = parser.parse_args(["agent"])
    assert got.unified_counters is True and got.allocate_wait == 5.0
    got = parser.parse_args(["agent", "--no-unified-counters", "--allocate-wait", "0.5"])
    assert got.unified_counters is False and got.allocate_wait == 0.5


def test_once_in_a_cluster_sets_aside_unified_instances_and_writes_the_counters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--node N --kubelet simulated --once`` as the CLI wires it, over the in-memory API."""
    api = kubeapi.InMemoryNodeApi()
    monkeypatch.setattr(assembling.kube, "connect", lambda kubeconfig: api)
    api.put_node("n0", {})
    reserved = {
        "profile": "1g.10gb",
        "start": 0,
        "reservedFor": "ns/u",
        "resource": "nvidia.com/gpu",  # the controller marks a unified pod's reservation
    }
    api.put_spec("n0", {"gpus": [{"index": 0, "instances": [reserved]}]})
    limits = {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4000}
    api.put_pod(
        {
            "metadata": {
                "name": "u",
                "namespace": "ns",
                "creationTimestamp": "2026-01-01T00:00:00Z",
            },
            "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
            "status": {"phase": "Pending"},
        }
    )
    argv = ["--node", "n0", "--kubelet", "simulated", "--backend", "emulated:h100-80gb:x1"]
    code, _ = run(*argv, "--once")
    assert code == 0
    got = api.node_resources["n0"]
    assert got["nvidia.com/gpu"] == "1" and got["nvidia.com/gpucores"] == "100"
    assert "nvidia.com/mig-1g.10gb" not in got or got["nvidia.com/mig-1g.10gb"] == "0"
    api2 = kubeapi.InMemoryNodeApi()
    monkeypatch.setattr(assembling.kube, "connect", lambda kubeconfig: api2)
    api2.put_node("n0", {})
    assert run(*argv, "--once", "--no-unified-counters")[0] == 0
    assert "nvidia.com/gpucores" not in api2.node_resources.get("n0", {})


def test_a_node_in_dra_mode_gets_no_unified_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    """No device plugin serves a DRA node's ``nvidia.com/gpu``: no gpumem or gpucores there."""
    api = kubeapi.InMemoryNodeApi()
    monkeypatch.setattr(assembling.kube, "connect", lambda kubeconfig: api)
    api.put_node("n0", {"migpilot.io/mode": "dra"})
    api.put_spec("n0", {"gpus": [{"index": 0, "instances": []}]})
    argv = ["--node", "n0", "--kubelet", "simulated", "--backend", "emulated:h100-80gb:x1"]
    assert run(*argv, "--once")[0] == 0
    got = api.node_resources.get("n0", {})
    assert not [k for k in got if k in ("nvidia.com/gpumem", "nvidia.com/gpucores")], got
    api2 = kubeapi.InMemoryNodeApi()  # the same node in mode mig gets them
    monkeypatch.setattr(assembling.kube, "connect", lambda kubeconfig: api2)
    api2.put_node("n0", {})
    api2.put_spec("n0", {"gpus": [{"index": 0, "instances": []}]})
    assert run(*argv, "--once")[0] == 0
    assert api2.node_resources["n0"]["nvidia.com/gpucores"] == "100"


def test_agents_on_two_nodes_report_different_emulated_uuids(tmp_path: Path) -> None:
    # Each node's emulated GPUs derive their UUIDs from the node's name, as the fleet's do:
    # two agents never report the same GPU (or MIG) UUID, and a restart keeps them.
    def uuids(node: str) -> list[str]:
        args = cli.build_parser().parse_args(
            ["agent", "--node", node, "--backend", "emulated:h100-80gb:x2"]
        )
        backend = agent_cmd.settings_from(args).backend
        return [g.uuid for g in assembling.open_backend(backend, node=node).gpus()]

    a, b = uuids("node-a"), uuids("node-b")
    assert len(set(a)) == 2 and not set(a) & set(b)
    assert uuids("node-a") == a
