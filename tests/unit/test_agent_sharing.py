"""The agent's sharing config: followed from files and the node label, bad ones kept out, the
labels it gives, and ``migpilot agent --device-plugin-config`` at the command line."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from migpilot.agent.cluster import following, kubeapi, statics
from migpilot.agent.deviceplugin import devices
from migpilot.agent.rules import labels
from migpilot.agent.sharing import sharingconfig
from migpilot.cli import main as cli
from migpilot.mig import catalog
from migpilot.sharing import config, configsets

TS = "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 4}]}}\n"
TS2 = "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 2}]}}\n"
BAD = "sharing: {timeSlicing: {resources: [{name: gpu, replicas: 1}]}}\n"
MPS = "flags: {migStrategy: none}\nsharing: {mps: {resources: [{name: gpu, replicas: 2}]}}\n"


def touch(path: Path, text: str) -> None:
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_single_file_followed_and_bad_one_kept_out(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(TS)
    applied: list[config.Config] = []
    follower = sharingconfig.SharingFollower(
        sharingconfig.SingleFile(path), apply=applied.append, mig_strategy="mixed"
    )
    assert follower.labels() == {}
    assert follower.changed()
    follower.refresh()
    assert follower.current().entries_for("nvidia.com/gpu")[0].replicas == 4
    assert follower.labels() == {"migpilot.io/sharing.state": "success"}
    assert not follower.changed()
    touch(path, BAD)
    assert follower.changed()
    follower.refresh()
    assert follower.labels() == {"migpilot.io/sharing.state": "failed"}
    assert follower.current().entries_for("nvidia.com/gpu")[0].replicas == 4
    assert "number of replicas must be >= 2" in (follower.problem or "")
    assert len(applied) == 1
    touch(path, TS2)
    follower.refresh()
    assert follower.current().entries_for("nvidia.com/gpu")[0].replicas == 2
    assert follower.labels() == {"migpilot.io/sharing.state": "success"}


def test_plugin_refusal_keeps_the_last_good_config(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(MPS)

    def refuse(found: config.Config) -> None:
        found.check_mig_strategy("mixed")

    follower = sharingconfig.SharingFollower(
        sharingconfig.SingleFile(path), apply=refuse, mig_strategy="none"
    )
    follower.refresh()
    assert follower.labels()["migpilot.io/sharing.state"] == "failed"
    assert follower.current() == config.EMPTY
    with pytest.raises(Exception, match="mixed is not supported with MPS"):
        sharingconfig.SharingFollower(
            sharingconfig.SingleFile(path), apply=refuse, mig_strategy="mixed"
        ).check()


def test_named_set_follows_the_label(tmp_path: Path) -> None:
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "default").write_text("")
    (folder / "ts").write_text(TS)
    (folder / "..data").mkdir()
    labels_file = tmp_path / "labels"
    named = sharingconfig.NamedSet(folder, selection=configsets.Selection())
    assert named.names() == ("default", "ts")
    follower = sharingconfig.SharingFollower(
        named,
        apply=lambda _: None,
        mig_strategy="mixed",
        label=sharingconfig.LabelsFileLabel(labels_file),
    )
    follower.refresh()
    assert follower.current().strategy is config.SharingStrategy.NONE
    labels_file.write_text("nvidia.com/device-plugin.config=ts\n")
    assert follower.changed()
    follower.refresh()
    assert follower.current().strategy is config.SharingStrategy.TIME_SLICING
    labels_file.write_text("nvidia.com/device-plugin.config=nope\n")
    follower.refresh()
    assert follower.labels()["migpilot.io/sharing.state"] == "failed"
    assert "specified config nope does not exist" in (follower.problem or "")
    assert follower.current().strategy is config.SharingStrategy.TIME_SLICING


def test_node_label_from_the_api() -> None:
    """The sharing label is read through the agent's one Node watch (``statics``)."""
    api = kubeapi.InMemoryNodeApi()
    api.put_node("n1", {"nvidia.com/device-plugin.config": "ts"})
    static = statics.StaticOrDynamic(api, dynamic=following.GpuLayoutSource(api, node="n1"))
    static.sync()
    assert static.node_label(configsets.CONFIG_LABEL) == "ts"
    api.put_node("n1", {"nvidia.com/device-plugin.config": ""})
    static.sync()
    assert static.node_label(configsets.CONFIG_LABEL) is None


MODEL = catalog.resolve_gpu("h100-80gb")


def node(mig: bool) -> devices.NodeDevices:
    gpus = (devices.Gpu(0, "GPU-0", MODEL, "NVIDIA H100 80GB HBM3", 81559, mig),)
    migs = (devices.MigDevice("MIG-0", 0, MODEL.profile_named("1g.10gb"), 0, 1, 0),) if mig else ()
    return devices.NodeDevices(gpus=gpus, mig_devices=migs)


def test_gfd_labels_under_sharing() -> None:
    ts = config.parse(TS, source="t")
    found = labels.node_labels(node(False), devices.MigStrategy.MIXED, sharing=ts)
    assert found["nvidia.com/gpu.replicas"] == "4"
    assert found["nvidia.com/gpu.sharing-strategy"] == "time-slicing"
    assert found["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3-SHARED"
    assert found["nvidia.com/mps.capable"] == "false"
    mig_ts = config.parse(
        "sharing: {timeSlicing: {resources: [{name: mig-1g.10gb, replicas: 3}]}}", source="t"
    )
    found = labels.node_labels(node(True), devices.MigStrategy.MIXED, sharing=mig_ts)
    assert found["nvidia.com/mig-1g.10gb.replicas"] == "3"
    assert found["nvidia.com/mig-1g.10gb.product"].endswith("-MIG-1g.10gb-SHARED")
    assert found["nvidia.com/gpu.replicas"] == "0"  # MIG-enabled: labelled without sharing
    mps = config.parse(MPS, source="t")
    found = labels.node_labels(node(False), devices.MigStrategy.NONE, sharing=mps)
    assert found["nvidia.com/mps.capable"] == "true"
    assert found["nvidia.com/gpu.sharing-strategy"] == "mps"
    plain = labels.node_labels(node(False), devices.MigStrategy.MIXED)
    assert plain["nvidia.com/gpu.replicas"] == "1"
    assert plain["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"


# --- the command line --------------------------------------------------------------------------


def run(*argv: str) -> int:
    return cli.main(["agent", *argv], out=io.StringIO())


@pytest.mark.parametrize(
    ("setup", "argv", "message"),
    [
        ({"c.yaml": BAD}, ["--device-plugin-config", "{d}/c.yaml"], "number of replicas"),
        ({}, ["--device-plugin-config", "{d}/absent.yaml"], "No such file"),
        (
            {"c.yaml": MPS},
            ["--device-plugin-config", "{d}/c.yaml", "--strategy", "mixed"],
            "mixed is not supported with MPS",
        ),
        ({"a": TS, "b": BAD}, ["--device-plugin-configs", "{d}"], "b: sharing.timeSlicing"),
        (
            {"a": TS},
            ["--device-plugin-configs", "{d}", "--device-plugin-config-default", "x"],
            "specified config x does not exist",
        ),
        ({"a": TS}, ["--device-plugin-configs", "{d}/a"], "not a folder"),
        ({"a": TS}, ["--device-plugin-config-default", "a"], "needs --device-plugin-configs"),
        (
            {"a": TS},
            ["--device-plugin-config", "{d}/a", "--device-plugin-configs", "{d}"],
            "exclude each other",
        ),
    ],
)
def test_bad_sharing_input_is_exit_2(
    setup: dict[str, str],
    argv: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    folder = tmp_path / "cfg"
    folder.mkdir()
    for name, text in setup.items():
        (folder / name).write_text(text)
    args = [a.format(d=folder) for a in argv]
    code = run(*args, "--backend", "emulated:h100-80gb", "--once", "--no-kubelet")
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("migpilot: error: ") and err.count("\n") == 1, err
    assert message in err


def test_once_writes_sharing_labels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(MPS)
    out = tmp_path / "labels"
    code = run(
        "--backend",
        "emulated:h100-80gb:x2",
        "--device-plugin-config",
        str(path),
        "--labels-file",
        str(out),
        "--once",
        "--no-kubelet",
    )
    assert code == 0, capsys.readouterr().err
    text = out.read_text()
    # The file's flags.migStrategy (none) is taken when --strategy is not given.
    assert "nvidia.com/mig.strategy" not in text
    # The emulated GPUs are MIG-enabled: GFD labels them without sharing, MPS not capable.
    assert "nvidia.com/gpu.replicas=0\n" in text
    assert "nvidia.com/mps.capable=false\n" in text
    assert "migpilot.io/sharing.state=success\n" in text
