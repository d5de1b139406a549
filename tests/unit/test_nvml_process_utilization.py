"""Per-process SM utilisation from NVML (MIG off), through the stand-in, and its attribution to
MPS slices and replicas: a reading where NVML gives one, a genuine 0 where NVML says a process
did not run, and absent (never 0) where it cannot say."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pynvml  # type: ignore[import-untyped]
import pytest
from hypothesis import given
from hypothesis import strategies as st

from migpilot.agent import running, sampling, usage
from migpilot.agent.deviceplugin import devices
from migpilot.gpu import backend, emulated, nvml, nvml_standin
from migpilot.mig import catalog

H100 = catalog.resolve_gpu("h100-80gb")
A100 = catalog.resolve_gpu("a100-80gb")
V1 = "nvmlDeviceGetProcessesUtilizationInfo"
LEGACY = "nvmlDeviceGetProcessUtilization"


class _Node:
    """One MIG-off GPU whose MPS slices are held by pods with loads, read through NVML."""

    def __init__(
        self,
        loads: dict[str, float],
        *,
        model: Any = H100,
        bindings: Callable[[nvml_standin.NvmlStandin], Any] = lambda s: s,
        **standin: Any,
    ) -> None:
        self.emu = emulated.EmulatedBackend([model], durable=False, mig_enabled=False)
        gpu = self.emu.gpus()[0].uuid
        self.held = [
            usage.Holding("a", pod, "c", "nvidia.com/gpu-10gb", f"{gpu}::mps-{n}")
            for n, pod in enumerate(loads, 1)
        ]
        self.loads = {f"a/{pod}": usage.PodLoad(u, 100) for pod, u in loads.items()}
        self.emu.drive(lambda: usage.device_loads(self.loads, self.held))
        self.standin = nvml_standin.NvmlStandin(self.emu, **standin)
        self.nvml = nvml.NvmlBackend(bindings(self.standin))
        state = {i.index: running.changes.GpuState(i, ()) for i in self.emu.gpus()}
        base = running.node_view(state)
        slices = tuple(devices.MpsSlice(0, n, 10) for n in range(1, len(loads) + 1))
        self.view = devices.NodeDevices(gpus=base.gpus, mig_devices=(), mps_slices=slices)

    def set(self, pod: str, utilization: float) -> None:
        self.loads[f"a/{pod}"] = usage.PodLoad(utilization, 100)

    def by_pod(self, sample: backend.GpuSample) -> dict[str, float | None]:
        """Pod name -> its process's utilisation in ``sample``."""
        assert sample.processes is not None
        return {str(self.emu.pod_of(p.pid)).split("/")[1]: p.utilization for p in sample.processes}


def _counter(step: int = 1000) -> Callable[[], int]:
    ticks: Iterator[int] = iter(range(step, 1 << 62, step))
    return lambda: next(ticks)


def test_mps_clients_read_their_own_sm_utilisation_from_the_second_pass() -> None:
    node = _Node({"one": 0.3, "two": 0.6})
    first = node.nvml.sample(0)
    assert node.by_pod(first) == {"one": None, "two": None}  # the first pass sets the timestamp
    second = node.nvml.sample(0)
    assert node.by_pod(second) == {"one": pytest.approx(0.3), "two": pytest.approx(0.6)}
    assert all(p.mps for p in second.processes or ())
    assert V1 in node.standin.calls
    assert LEGACY not in node.standin.calls  # the v1 call works: no fallback


def test_an_idle_client_reads_a_genuine_zero() -> None:
    # NVML gives a sample only to a process with non-zero use: no sample is zero use.
    node = _Node({"busy": 0.5, "idle": 0.0})
    node.nvml.sample(0)
    assert node.by_pod(node.nvml.sample(0)) == {"busy": pytest.approx(0.5), "idle": 0.0}
    # Every client idle: NVML answers NOT_FOUND ("no valid sample entries"), still zeros.
    node.set("busy", 0.0)
    assert node.by_pod(node.nvml.sample(0)) == {"busy": 0.0, "idle": 0.0}


def test_each_pass_covers_only_the_interval_since_the_last() -> None:
    node = _Node({"p": 0.2}, clock_us=_counter())
    seen: list[int] = []
    read = node.standin.nvmlDeviceGetProcessesUtilizationInfo

    def spy(handle: Any, stamp: int) -> list[Any]:
        seen.append(stamp)
        return read(handle, stamp)  # type: ignore[no-any-return]

    node.standin.nvmlDeviceGetProcessesUtilizationInfo = spy  # type: ignore[method-assign]
    node.nvml.sample(0)
    node.set("p", 0.8)
    # Were the first pass's 0.2 read again, the driver's mean would be 0.5.
    assert node.by_pod(node.nvml.sample(0)) == {"p": pytest.approx(0.8)}
    node.set("p", 0.0)
    assert node.by_pod(node.nvml.sample(0)) == {"p": 0.0}
    node.set("p", 0.4)
    assert node.by_pod(node.nvml.sample(0)) == {"p": pytest.approx(0.4)}
    # 0 first (all the driver has), then each pass's newest stamp; a pass without a sample
    # (the third) keeps the one before.
    assert seen == [0, 1000, 2000, 2000]


def test_mig_on_gives_no_process_utilisation_and_makes_no_call() -> None:
    emu = emulated.EmulatedBackend([H100], durable=False)
    mig = emu.create_instance(0, profile="1g.10gb", start=0)
    held = [usage.Holding("a", "r", "c", "nvidia.com/mig-1g.10gb", f"{mig.uuid}::0")]
    emu.drive(lambda: usage.device_loads({"a/r": usage.PodLoad(0.7, 64)}, held))
    standin = nvml_standin.NvmlStandin(emu)
    gpu = nvml.NvmlBackend(standin)
    gpu.sample(0)
    got = gpu.sample(0)
    assert got.processes is not None
    assert [(p.utilization, p.memory_used_bytes) for p in got.processes] == [(None, 64 << 20)]
    assert V1 not in standin.calls and LEGACY not in standin.calls


def test_the_standin_refuses_process_utilisation_under_mig() -> None:
    emu = emulated.EmulatedBackend([H100], durable=False)
    standin = nvml_standin.NvmlStandin(emu)
    standin.nvmlInit()
    handle = standin.nvmlDeviceGetHandleByIndex(0)
    for name in (V1, LEGACY):
        with pytest.raises(pynvml.NVMLError_NotSupported):
            getattr(standin, name)(handle, 0)


@pytest.mark.parametrize("model", [H100, A100])
def test_a_gpu_that_does_not_support_it_gives_none_not_zero(model: Any) -> None:
    node = _Node({"p": 0.5}, model=model, not_supported={V1, LEGACY})
    node.nvml.sample(0)
    got = node.nvml.sample(0)
    assert node.by_pod(got) == {"p": None}
    assert [p.memory_used_bytes for p in got.processes or ()] == [100 << 20]  # memory still
    rows = usage.series(
        node="n",
        view=node.view,
        holdings=node.held,
        samples={0: got},
        owners=sampling.emulated_owners(node.emu)(got.processes or ()),
    )
    assert usage.DEVICE_UTILIZATION not in {r.name for r in rows}
    assert usage.DEVICE_MEMORY_USED in {r.name for r in rows}


class _OldBindings:
    """nvidia-ml-py from before a call existed."""

    def __init__(self, inner: nvml_standin.NvmlStandin, lacking: str) -> None:
        self._inner, self._lacking = inner, lacking

    def __getattr__(self, name: str) -> Any:
        if name == self._lacking:
            raise AttributeError(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize(
    "lacking",
    [
        {"missing": {V1}},  # a driver before R550: NVML_ERROR_FUNCTION_NOT_FOUND
        {"bindings": lambda s: _OldBindings(s, V1)},  # bindings without the call
    ],
    ids=["old-driver", "old-bindings"],
)
def test_without_the_v1_call_the_older_one_is_used_and_v1_not_tried_again(
    lacking: dict[str, Any],
) -> None:
    node = _Node({"p": 0.25}, **lacking)
    for _ in range(3):
        got = node.nvml.sample(0)
    assert node.by_pod(got) == {"p": pytest.approx(0.25)}
    assert node.standin.calls.count(V1) == (1 if "missing" in lacking else 0)
    assert node.standin.calls.count(LEGACY) == 3


def test_a_driver_that_knows_no_v1_struct_falls_back_too() -> None:
    node = _Node({"p": 0.25})

    def mismatch(handle: Any, stamp: int) -> list[Any]:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)

    node.standin.nvmlDeviceGetProcessesUtilizationInfo = mismatch  # type: ignore[method-assign]
    node.nvml.sample(0)
    assert node.by_pod(node.nvml.sample(0)) == {"p": pytest.approx(0.25)}


def test_neither_call_means_none() -> None:
    node = _Node({"p": 0.25}, missing={V1, LEGACY})
    node.nvml.sample(0)
    assert node.by_pod(node.nvml.sample(0)) == {"p": None}


def _raising(node: _Node, *codes: int) -> None:
    """The v1 call raises ``codes`` in turn, then answers as the stand-in does."""
    read = node.standin.nvmlDeviceGetProcessesUtilizationInfo
    pending = list(codes)

    def flaky(handle: Any, stamp: int) -> list[Any]:
        if pending:
            raise pynvml.NVMLError(pending.pop(0))
        return read(handle, stamp)  # type: ignore[no-any-return]

    node.standin.nvmlDeviceGetProcessesUtilizationInfo = flaky  # type: ignore[method-assign]


def test_a_process_that_starts_between_sizing_and_reading_is_read_again() -> None:
    node = _Node({"p": 0.25})
    node.nvml.sample(0)
    _raising(node, pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    assert node.by_pod(node.nvml.sample(0)) == {"p": pytest.approx(0.25)}
    _raising(node, pynvml.NVML_ERROR_INSUFFICIENT_SIZE, pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    assert node.by_pod(node.nvml.sample(0)) == {"p": None}  # twice: give up for this pass


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (pynvml.NVML_SUCCESS, 0.0),  # nvidia-ml-py's way of saying "nothing to size"
        (pynvml.NVML_ERROR_NOT_FOUND, 0.0),  # "no valid sample entries"
        (pynvml.NVML_ERROR_NO_PERMISSION, None),
        (pynvml.NVML_ERROR_UNKNOWN, None),
        (pynvml.NVML_ERROR_GPU_IS_LOST, None),
    ],
)
def test_what_each_answer_means(code: int, expected: float | None) -> None:
    node = _Node({"p": 0.25})
    node.nvml.sample(0)
    _raising(node, code)
    assert node.by_pod(node.nvml.sample(0)) == {"p": expected}


def test_several_samples_of_one_pid_average_and_a_reading_out_of_range_is_none() -> None:
    node = _Node({"a": 0.1, "b": 0.1})
    pids = {pod: pid for pid, pod in ((p.pid, node.emu.pod_of(p.pid)) for p in _listed(node))}

    def crafted(handle: Any, stamp: int) -> list[Any]:
        out = []
        for pid, sm, when in ((pids["a/a"], 20, 5), (pids["a/a"], 40, 6), (pids["a/b"], 2**31, 7)):
            s = pynvml.c_nvmlProcessUtilizationInfo_v1_t()
            s.pid, s.smUtil, s.timeStamp = pid, sm, when
            out.append(s)
        return out

    node.standin.nvmlDeviceGetProcessesUtilizationInfo = crafted  # type: ignore[method-assign]
    node.nvml.sample(0)
    assert node.by_pod(node.nvml.sample(0)) == {"a": pytest.approx(0.3), "b": None}


def _listed(node: _Node) -> tuple[backend.ProcessSample, ...]:
    return node.emu.sample(0).processes or ()


def test_an_mps_server_that_holds_the_samples_leaves_unsampled_clients_unknown() -> None:
    server = backend.ProcessSample(10, 66 << 20)
    one = backend.ProcessSample(11, 1 << 30, mps=True)
    two = backend.ProcessSample(12, 1 << 30, mps=True)
    # The server sampled: a client without a sample may have been booked to it.
    got = nvml.process_utilization((server, one, two), {10: 0.9, 11: 0.2})
    assert [p.utilization for p in got] == [0.9, 0.2, None]
    # Only clients sampled: NVML tells them apart, so the unsampled one did not run.
    got = nvml.process_utilization((server, one, two), {11: 0.2})
    assert [p.utilization for p in got] == [0.0, 0.2, 0.0]
    # No clients (time-slicing): every unsampled process did not run.
    plain = backend.ProcessSample(13, 0)
    got = nvml.process_utilization((server, plain), {10: 0.5})
    assert [p.utilization for p in got] == [0.5, 0.0]


_PROCESSES = st.lists(
    st.builds(
        backend.ProcessSample,
        pid=st.integers(1, 40),
        memory_used_bytes=st.none() | st.integers(0, 1 << 40),
        mps=st.booleans(),
    ),
    unique_by=lambda p: p.pid,
    max_size=8,
)
_SHARES = (
    st.dictionaries(st.integers(1, 50), st.none() | st.floats(0.0, 1.0), max_size=10) | st.none()
)


@given(processes=_PROCESSES, shares=_SHARES)
def test_attribution_invents_no_reading(
    processes: list[backend.ProcessSample], shares: dict[int, float | None] | None
) -> None:
    got = nvml.process_utilization(processes, shares)
    assert [(p.pid, p.memory_used_bytes, p.mps) for p in got] == [
        (p.pid, p.memory_used_bytes, p.mps) for p in processes
    ]
    if shares is None:
        assert all(p.utilization is None for p in got)
        return
    server_sampled = any(not p.mps and shares.get(p.pid, 0.0) != 0.0 for p in processes)
    for p in got:
        if p.pid in shares:
            assert p.utilization == shares[p.pid]
        elif p.mps and server_sampled:
            assert p.utilization is None
        else:
            assert p.utilization == 0.0


def test_slices_and_replicas_get_their_pods_utilisation_through_nvml() -> None:
    emu = emulated.EmulatedBackend([H100], durable=False, mig_enabled=False)
    gpu = emu.gpus()[0].uuid
    held = [
        usage.Holding("a", "slice", "c", "nvidia.com/gpu-10gb", f"{gpu}::mps-1"),
        # one pod holding two replicas of the GPU: its processes' shares add up, capped at 1
        usage.Holding("a", "twice", "c", "nvidia.com/gpu", f"{gpu}::1"),
        usage.Holding("a", "twice", "c", "nvidia.com/gpu", f"{gpu}::2"),
        usage.Holding("a", "idle", "c", "nvidia.com/gpu", f"{gpu}::3"),
    ]
    loads = {
        "a/slice": usage.PodLoad(0.25, 10),
        "a/twice": usage.PodLoad(0.7, 10),
        "a/idle": usage.PodLoad(0.0, 10),
    }
    emu.drive(lambda: usage.device_loads(loads, held))
    state = {i.index: running.changes.GpuState(i, ()) for i in emu.gpus()}
    base = running.node_view(state)
    view = devices.NodeDevices(
        gpus=base.gpus, mig_devices=(), mps_slices=(devices.MpsSlice(0, 1, 10),)
    )
    gpus = nvml.NvmlBackend(nvml_standin.NvmlStandin(emu))
    gpus.sample(0)
    sample = gpus.sample(0)
    rows = usage.series(
        node="n",
        view=view,
        holdings=held,
        samples={0: sample},
        owners=sampling.emulated_owners(emu)(sample.processes or ()),
    )
    util = {dict(r.labels)["device"]: r.value for r in rows if r.name == usage.DEVICE_UTILIZATION}
    assert util == {
        f"{gpu}::mps-1": pytest.approx(0.25),
        f"{gpu}::1": 1.0,
        f"{gpu}::2": 1.0,
        f"{gpu}::3": 0.0,
    }
    profile = {
        dict(r.labels)["device"]: dict(r.labels)["profile"]
        for r in rows
        if r.name == usage.DEVICE_UTILIZATION
    }
    assert profile[f"{gpu}::mps-1"] == "mps-10gb"


def test_the_emulated_backend_gives_no_process_utilisation_under_mig() -> None:
    emu = emulated.EmulatedBackend([H100], durable=False)
    mig = emu.create_instance(0, profile="1g.10gb", start=0)
    held = [usage.Holding("a", "r", "c", "nvidia.com/mig-1g.10gb", f"{mig.uuid}::0")]
    emu.drive(lambda: usage.device_loads({"a/r": usage.PodLoad(0.7, 64)}, held))
    sample = emu.sample(0)
    assert [p.utilization for p in sample.processes or ()] == [None]
    state = {i.index: running.changes.GpuState(i, emu.mig_devices(i.index)) for i in emu.gpus()}
    rows = usage.series(
        node="n",
        view=running.node_view(state),
        holdings=held,
        samples={0: sample},
        owners=sampling.emulated_owners(emu)(sample.processes or ()),
    )
    names = {r.name for r in rows if r.name.startswith("migpilot_device")}
    assert names == {usage.DEVICE_MEMORY_USED, usage.DEVICE_MEMORY_TOTAL}
