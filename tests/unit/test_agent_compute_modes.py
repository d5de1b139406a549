"""MPS-shared GPUs are in EXCLUSIVE_PROCESS while their daemon runs, as NVIDIA's plugin keeps them.

The pure decisions (which GPUs, which changes) over examples and properties; then the agent over
the emulated GPUs and the emulated MPS daemon, with the real device plugin and sharing follower:
the mode is set before the daemon starts, given back after it stops, a GPU that cannot be set
keeps its daemon from starting (sharing state ``failed``) until a later pass manages.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.agent.sharing import computemodes
from migpilot.agent.sharing import mps as agent_mps
from migpilot.gpu import backend, emulated
from migpilot.gpu import mps as gpu_mps
from tests.unit import mps_agents

Mode = backend.ComputeMode
H100, MPS, TS, STATE = mps_agents.H100, mps_agents.MPS, mps_agents.TS, mps_agents.STATE


def _spec(name: str, *devices: str) -> gpu_mps.MpsDaemonSpec:
    return gpu_mps.MpsDaemonSpec(
        name=name, devices=devices, pipe_dir=Path(f"/run/{name}/pipe"), log_dir=Path(f"/l/{name}")
    )


def _info(index: int, *, mig: bool | None = None) -> backend.GpuInfo:
    mode = None if mig is None else backend.MigMode(mig, mig)
    return backend.GpuInfo(index, f"GPU-{index}", "H100", H100, 81559, mode)


# --- the pure decisions ------------------------------------------------------------------------


def test_daemon_gpus_counts_whole_gpus_only() -> None:
    gpus = [_info(0), _info(1, mig=False), _info(2, mig=True)]
    specs = [
        _spec("a", "GPU-1", "GPU-0"),
        _spec("b", "MIG-xyz", "GPU-2"),  # a MIG device; a GPU in MIG mode
        _spec("c", "GPU-9"),  # not on this node
        _spec("all"),  # no devices: every GPU is visible to it
    ]
    assert computemodes.daemon_gpus(specs, gpus) == {"a": (0, 1), "b": (), "c": (), "all": (0, 1)}


def test_to_exclusive_sets_what_is_not_exclusive_and_names_who_waits() -> None:
    needed = {"b": (1, 2), "a": (0, 1)}
    current = {0: Mode.EXCLUSIVE_PROCESS, 1: Mode.DEFAULT, 2: None}
    assert computemodes.to_exclusive(needed, current) == (
        computemodes.ModeChange(1, Mode.EXCLUSIVE_PROCESS, ("a", "b")),
        computemodes.ModeChange(2, Mode.EXCLUSIVE_PROCESS, ("b",)),
    )


def test_to_default_gives_back_only_owned_exclusive_gpus_no_daemon_keeps() -> None:
    current = {1: Mode.EXCLUSIVE_PROCESS, 2: Mode.PROHIBITED, 3: None, 4: Mode.EXCLUSIVE_PROCESS}
    changes, done = computemodes.to_default(
        kept={"a": (0,)}, owned=frozenset({0, 1, 2, 3}), current=current
    )
    assert changes == (computemodes.ModeChange(1, Mode.DEFAULT),)
    assert done == {2}  # someone set it to prohibited: no longer ours; 3 unread: asked again


MODES = st.sampled_from([*Mode, None])
GPUS = st.sets(st.integers(0, 7), max_size=8)


@given(
    needed=st.dictionaries(st.sampled_from("abcd"), GPUS.map(lambda s: tuple(sorted(s)))),
    current=st.dictionaries(st.integers(0, 7), MODES),
)
def test_after_the_changes_every_needed_gpu_is_exclusive(
    needed: dict[str, tuple[int, ...]], current: dict[int, Mode | None]
) -> None:
    after = dict(current)
    for change in computemodes.to_exclusive(needed, current):
        assert change.daemons and all(change.gpu in needed[d] for d in change.daemons)
        after[change.gpu] = change.mode
    assert all(after.get(g) is Mode.EXCLUSIVE_PROCESS for gpus in needed.values() for g in gpus)


@given(
    kept=st.dictionaries(st.sampled_from("abcd"), GPUS.map(lambda s: tuple(sorted(s)))),
    owned=GPUS,
    current=st.dictionaries(st.integers(0, 7), MODES),
)
def test_a_gpu_a_daemon_keeps_is_never_given_back(
    kept: dict[str, tuple[int, ...]], owned: set[int], current: dict[int, Mode | None]
) -> None:
    changes, done = computemodes.to_default(kept=kept, owned=owned, current=current)
    shared = {g for gpus in kept.values() for g in gpus}
    touched = {c.gpu for c in changes}
    assert not (touched | done) & shared
    assert touched | done <= owned
    assert all(current.get(c.gpu) is Mode.EXCLUSIVE_PROCESS for c in changes)
    assert all(current.get(g) not in (None, Mode.EXCLUSIVE_PROCESS) for g in done)


def test_the_keeper_leaves_gpus_in_mig_mode_alone() -> None:
    gpus = emulated.EmulatedBackend([H100])  # MIG mode on
    dev = gpus.create_instance(0, profile="7g.80gb", start=0)
    keeper = computemodes.ComputeModeKeeper(gpus)
    assert dev.uuid is not None
    assert keeper.prepare([_spec("m", dev.uuid), _spec("g", gpus.gpus()[0].uuid)]) == {}
    assert keeper.owned == frozenset()
    keeper.release([])
    assert gpus.compute_mode(0) is Mode.DEFAULT


# --- the agent ---------------------------------------------------------------------------------


@dataclass
class Watching:
    """The emulated daemons, noting the GPUs' compute modes at each start and stop."""

    inner: gpu_mps.EmulatedMps
    gpus: emulated.EmulatedBackend
    seen: list[tuple[str, tuple[Mode, ...]]] = field(default_factory=list)
    started: list[gpu_mps.MpsDaemonSpec] = field(default_factory=list)

    def _modes(self) -> tuple[Mode, ...]:
        return tuple(self.gpus.compute_mode(g.index) for g in self.gpus.gpus())

    def start(self, spec: gpu_mps.MpsDaemonSpec) -> int:
        self.seen.append(("start", self._modes()))
        self.started.append(spec)
        return self.inner.start(spec)

    def stop(self, spec: gpu_mps.MpsDaemonSpec) -> None:
        self.inner.stop(spec)
        self.seen.append(("stopped", self._modes()))

    def alive(self, spec: gpu_mps.MpsDaemonSpec) -> bool:
        return self.inner.alive(spec)

    def pid(self, spec: gpu_mps.MpsDaemonSpec) -> int | None:
        return self.inner.pid(spec)

    def server_list(self, spec: gpu_mps.MpsDaemonSpec) -> tuple[int, ...]:
        return self.inner.server_list(spec)

    def set_defaults(self, spec: gpu_mps.MpsDaemonSpec) -> None:
        self.inner.set_defaults(spec)


def _node(tmp_path: Path, *, gpus: int = 2) -> AbstractContextManager[mps_agents.Node]:
    """The shared MPS agent, its daemons watched for the GPUs' modes at each start and stop."""
    return mps_agents.mps_node(tmp_path, gpus=gpus, wrap=Watching)


EXCL = Mode.EXCLUSIVE_PROCESS


def test_gpus_are_exclusive_before_the_daemon_starts_and_default_after_it_stops(
    tmp_path: Path,
) -> None:
    with _node(tmp_path) as node:
        assert node.modes() == [Mode.DEFAULT, Mode.DEFAULT]
        node.agent.start()
        assert node.daemons.seen == [("start", (EXCL, EXCL))]
        node.ticks(1)
        assert node.phases() == [agent_mps.Phase.RUNNING]
        assert node.modes() == [EXCL, EXCL]

        node.switch(TS)  # time-slicing: the daemon is no longer wanted
        assert node.daemons.seen[-1] == ("stopped", (EXCL, EXCL))  # stopped first, then given back
        assert node.modes() == [Mode.DEFAULT, Mode.DEFAULT]
        assert node.agent.mps_statuses() == ()


def test_a_restart_after_a_crash_sets_the_mode_again_if_it_was_lost(tmp_path: Path) -> None:
    with _node(tmp_path) as node:
        node.agent.start()
        node.ticks(1)
        node.daemons.inner.crash(node.daemons.started[-1])
        node.gpus.set_compute_mode(1, Mode.DEFAULT)  # e.g. someone ran nvidia-smi -c 0
        node.ticks(6)
        assert node.daemons.seen[-1] == ("start", (EXCL, EXCL))
        assert node.phases() == [agent_mps.Phase.RUNNING] and node.modes() == [EXCL, EXCL]


def test_a_gpu_that_cannot_be_set_keeps_the_daemon_from_starting_until_it_can(
    tmp_path: Path,
) -> None:
    with _node(tmp_path) as node:
        node.gpus.inject(
            emulated.Fault(
                emulated.Step.SET_COMPUTE_MODE,
                2,
                emulated.FaultEffect.FAIL,
                backend.ErrorKind.NO_PERMISSION,
            )
        )
        node.agent.start()
        assert node.daemons.seen == []
        (status,) = node.agent.mps_statuses()
        assert status.phase is agent_mps.Phase.BACKOFF
        assert status.last_error is not None
        assert status.last_error.startswith("GPU 1: cannot set compute mode exclusive-process")
        assert "no permission" in status.last_error
        assert node.modes() == [EXCL, Mode.DEFAULT]  # GPU 0 set; kept while the daemon waits

        node.agent.reconcile()  # the next pass sets GPU 1; the daemon waits out its backoff
        assert node.modes() == [EXCL, EXCL]
        assert node.daemons.seen == []
        assert node.state() == "failed"
        node.ticks(3)
        assert node.daemons.seen == [("start", (EXCL, EXCL))]
        assert node.phases() == [agent_mps.Phase.RUNNING]
        node.agent.reconcile()
        assert node.state() == "success"


def test_a_mode_that_cannot_be_given_back_is_retried_at_the_next_pass(tmp_path: Path) -> None:
    with _node(tmp_path) as node:
        node.agent.start()
        node.ticks(1)
        node.gpus.inject(
            emulated.Fault(emulated.Step.SET_COMPUTE_MODE, 1, emulated.FaultEffect.FAIL)
        )
        node.switch(TS)
        assert node.agent.mps_statuses() == ()
        assert node.modes() == [EXCL, Mode.DEFAULT]
        node.agent.reconcile()
        assert node.modes() == [Mode.DEFAULT, Mode.DEFAULT]


def test_a_mode_someone_else_set_on_a_gpu_mps_never_used_is_kept(tmp_path: Path) -> None:
    with _node(tmp_path) as node:
        node.config.write_text(TS)
        node.gpus.set_compute_mode(0, EXCL)
        node.agent.start()
        node.ticks(2)
        assert node.modes() == [EXCL, Mode.DEFAULT]


@pytest.mark.parametrize("kind", [backend.ErrorKind.NO_PERMISSION, backend.ErrorKind.UNKNOWN])
def test_the_keeper_reports_each_waiting_daemon_once(kind: backend.ErrorKind) -> None:
    gpus = emulated.EmulatedBackend([H100] * 2, mig_enabled=False)
    gpus.inject(emulated.Fault(emulated.Step.SET_COMPUTE_MODE, 1, emulated.FaultEffect.FAIL, kind))
    uuids = [g.uuid for g in gpus.gpus()]
    keeper = computemodes.ComputeModeKeeper(gpus)
    blocked = keeper.prepare([_spec("a", *uuids), _spec("b", uuids[1])])
    assert sorted(blocked) == ["a"]  # only GPU 0 failed; b's GPU 1 was set
    assert blocked["a"].startswith("GPU 0: cannot set compute mode exclusive-process")
    assert keeper.owned == {0, 1}
