"""``migpilot agent`` as a real process against a fake kubelet of real gRPC servers.

The agent runs with the emulated backend and a state file in a short temp folder (unix socket
paths stay under 108 bytes); the fake kubelet (``tests/integration/kubelet_fake.py``) registers
it, keeps its ListAndWatch streams open, calls Allocate and serves PodResources. The tests wait
on conditions with timeouts (the kubelet's device lists, the state file), never on sleeps.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.kubelet_fake import FakeKubelet

H = "Healthy"
R1G = "nvidia.com/mig-1g.10gb"
R2G = "nvidia.com/mig-2g.20gb"
R3G = "nvidia.com/mig-3g.40gb"
WAIT_S = 20.0
BALANCED = {"1g.10gb": 1, "2g.20gb": 1, "3g.40gb": 1}
ALL_1G = {"1g.10gb": 7}


def config_text(devices: dict[str, int]) -> str:
    """A mig-parted config with one config, ``node``, giving every GPU ``devices``."""
    counts = ", ".join(f'"{p}": {n}' for p, n in devices.items())
    return (
        "version: v1\nmig-configs:\n  node:\n    - devices: all\n      mig-enabled: true\n"
        f"      mig-devices: {{{counts}}}\n"
    )


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Node:
    """The temp folder: kubelet, config, state, labels; and the agent processes run on it."""

    def __init__(self, root: pathlib.Path, gpus: int) -> None:
        self.root = root
        self.config = root / "mig-parted.yaml"
        self.state = root / "gpus.json"
        self.labels = root / "labels"
        self.log = root / "agent.log"
        self.backend = f"emulated:h100-80gb:x{gpus}"
        self.metrics_port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    def write_config(self, devices: dict[str, int]) -> None:
        tmp = self.root / "mig-parted.new"
        tmp.write_text(config_text(devices))
        os.replace(tmp, self.config)

    def args(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "migpilot",
            "agent",
            "--backend",
            self.backend,
            "--state-file",
            str(self.state),
            "--kubelet-dir",
            str(self.root),
            "--config",
            str(self.config),
            "-c",
            "node",
        ]

    def start(self, *extra: str) -> None:
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                [*self.args(), "--interval", "1", *extra], stdout=log, stderr=log
            )

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.process is not None
        self.process.send_signal(sig)
        code = self.process.wait(timeout=WAIT_S)
        self.process = None
        return code

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def instances(self) -> dict[int, dict[str, dict[str, object]]]:
        """GPU -> ``profile@start`` -> the state file's instance."""
        data = json.loads(self.state.read_text())
        return {
            g["index"]: {f"{i['profile']}@{i['start']}": i for i in g["instances"]}
            for g in data["gpus"]
        }

    def layout(self, gpu: int) -> set[str]:
        return set(self.instances()[gpu])

    def uuid(self, gpu: int, inst: str) -> str:
        return str(self.instances()[gpu][inst]["uuid"])

    def uuids(self, profile: str) -> set[str]:
        return {
            str(i["uuid"])
            for insts in self.instances().values()
            for i in insts.values()
            if i["profile"] == profile and i["uuid"] is not None
        }


@pytest.fixture
def root() -> Iterator[pathlib.Path]:
    path = pathlib.Path(tempfile.mkdtemp(dir="/tmp", prefix="mpe"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(root: pathlib.Path) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(root).start()
    yield fake
    fake.stop()


@pytest.fixture
def node(root: pathlib.Path) -> Iterator[Node]:
    n = Node(root, gpus=2)
    yield n
    if n.process is not None:
        n.process.kill()
        n.process.wait()


def list_size(kubelet: FakeKubelet, resource: str, size: int) -> None:
    kubelet.wait_for(
        lambda s: (
            resource in s.clients
            and bool(s.clients[resource].lists)
            and len(s.clients[resource].lists[-1]) == size
        ),
        f"{resource} to list {size} devices",
    )


def one_to_all(uuids: set[str]) -> dict[str, str]:
    return dict.fromkeys(uuids, H)


def test_agent_end_to_end(node: Node, kubelet: FakeKubelet) -> None:
    node.write_config(BALANCED)
    node.start("--labels-file", str(node.labels), "--metrics-port", str(node.metrics_port),
               "--metrics-address", "127.0.0.1")  # fmt: skip
    try:
        kubelet.wait_registered(R1G, R2G, R3G)
    except AssertionError:
        raise AssertionError(node.log_text()) from None
    # The devices listed are the instances the config asks for, as the GPUs hold them.
    for gpu in (0, 1):
        assert node.layout(gpu) == {"2g.20gb@0", "1g.10gb@2", "3g.40gb@4"}
    for resource, profile in ((R1G, "1g.10gb"), (R2G, "2g.20gb"), (R3G, "3g.40gb")):
        kubelet.wait_devices(resource, one_to_all(node.uuids(profile)))
    labels = dict(line.split("=", 1) for line in node.labels.read_text().splitlines())
    assert labels["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
    assert labels["nvidia.com/mig.strategy"] == "mixed"
    assert labels["nvidia.com/mig-3g.40gb.count"] == "2"
    assert labels["nvidia.com/mig-1g.10gb.memory"] == "9984"
    assert {"nvidia.com/mig.capable", "nvidia.com/gpu.count", "nvidia.com/gpu.family"} <= set(
        labels
    )

    with urllib.request.urlopen(f"http://127.0.0.1:{node.metrics_port}/metrics", timeout=5) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    assert {
        "migpilot_reconfiguration_duration_seconds",
        "migpilot_reconcile_actions",
        "migpilot_devices",
    } <= set(families)
    devices = {
        s.labels["resource"]: s.value
        for s in families["migpilot_devices"].samples
        if s.labels["health"] == H
    }
    assert devices == {R1G: 2, R2G: 2, R3G: 2}

    # A pod got GPU 0's 3g through Allocate (the kubelet does not list it yet), another pod
    # holds GPU 1's 2g according to PodResources. The config changes to seven 1g per GPU.
    handed_out, listed = node.uuid(0, "3g.40gb@4"), node.uuid(1, "2g.20gb@0")
    (container,) = kubelet.allocate(R3G, [handed_out]).container_responses
    assert dict(container.envs) == {"NVIDIA_VISIBLE_DEVICES": handed_out}
    kubelet.assign("default", "holder", R2G, [listed])
    streams = {r: kubelet.client(r) for r in (R1G, R2G, R3G)}
    node.write_config(ALL_1G)
    list_size(kubelet, R1G, 4 + 5)
    assert node.layout(0) == {"1g.10gb@0", "1g.10gb@1", "1g.10gb@2", "1g.10gb@3", "3g.40gb@4"}
    assert node.layout(1) == {"2g.20gb@0"} | {f"1g.10gb@{s}" for s in range(2, 7)}
    assert node.uuid(0, "3g.40gb@4") == handed_out and node.uuid(1, "2g.20gb@0") == listed
    kubelet.wait_devices(R3G, {handed_out: H})
    kubelet.wait_devices(R2G, {listed: H})
    kubelet.wait_devices(R1G, one_to_all(node.uuids("1g.10gb")))
    for resource, stream in streams.items():  # the same streams: no plugin restart
        assert kubelet.client(resource) is stream and not stream.ended
        assert kubelet.registrations(resource) == 1
    log = node.log_text()
    for uuid in (handed_out, listed):
        assert f"({uuid}) is in use; desired 1g.10gb@" in log
    wait_until(
        lambda: "nvidia.com/mig-1g.10gb.count=9\n" in node.labels.read_text(), "labels to follow"
    )

    # The kubelet restarts: every resource registers again and lists the same devices.
    kubelet.restart()
    kubelet.wait_registered(R1G, R2G, R3G)
    kubelet.wait_devices(R1G, one_to_all(node.uuids("1g.10gb")))
    assert kubelet.registrations(R1G) == 1  # counted since the restart

    # The pod on GPU 1 goes: its 2g is destroyed at the next pass and GPU 1 converges. The 3g
    # Allocate handed out is still held (the kubelet never listed it; held for the grace time).
    kubelet.release_all()
    list_size(kubelet, R1G, 4 + 7)
    assert node.layout(1) == {f"1g.10gb@{s}" for s in range(7)}
    kubelet.wait_devices(R2G, {})
    assert node.uuid(0, "3g.40gb@4") == handed_out

    assert node.stop() == 0
    assert "SIGTERM received: stopping" in node.log_text()
    assert sorted(p.name for p in kubelet.plugin_dir.iterdir()) == ["kubelet.sock"]


def test_killed_mid_reconfiguration_then_restarted_converges(
    root: pathlib.Path, kubelet: FakeKubelet
) -> None:
    node = Node(root, gpus=4)
    node.write_config(BALANCED)
    once = subprocess.run(
        [*node.args(), "--once"], check=False, capture_output=True, timeout=WAIT_S
    )
    assert once.returncode == 0, once.stderr.decode()
    held = node.uuid(0, "2g.20gb@0")
    kubelet.assign("default", "holder", R2G, [held])
    final = {0: {"2g.20gb@0"} | {f"1g.10gb@{s}" for s in range(2, 7)}} | {
        g: {f"1g.10gb@{s}" for s in range(7)} for g in (1, 2, 3)
    }
    node.write_config(ALL_1G)
    node.start()
    try:

        def midway() -> bool:
            # Some 1g instances made (4 at first, one per GPU), the work not finished.
            now = {g: set(i) for g, i in node.instances().items()}
            made = sum(1 for insts in now.values() for i in insts if i.startswith("1g."))
            return made >= 4 + 3 and now != final

        wait_until(midway, "the reconfiguration to start")
        node.stop(signal.SIGKILL)
        stopped = {g: set(i) for g, i in node.instances().items()}
        assert stopped != final, "the agent finished before it was killed"

        node.start()
        list_size(kubelet, R1G, 5 + 3 * 7)
        state = node.instances()
        assert {g: set(i) for g, i in state.items()} == final  # nothing leaked, nothing lost
        assert all(i["uuid"] is not None for insts in state.values() for i in insts.values())
        assert node.uuid(0, "2g.20gb@0") == held
        kubelet.wait_devices(R1G, one_to_all(node.uuids("1g.10gb")))
        kubelet.wait_devices(R2G, {held: H})
        assert node.stop() == 0
    except AssertionError as err:
        raise AssertionError(f"{err}\n--- agent log ---\n{node.log_text()}") from None
    finally:
        if node.process is not None:
            node.process.kill()
            node.process.wait()
