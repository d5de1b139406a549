"""Trace parsing: openb, MIG-native CSV, synthetic generators and malformed rows."""

from __future__ import annotations

import pytest

from migpilot import errors
from migpilot.mig import catalog
from migpilot.sim import traces

H100 = catalog.resolve_gpu("h100-80gb")
A30 = catalog.resolve_gpu("a30")

OPENB_HEADER = "name,cpu_milli,memory_mib,num_gpu,gpu_milli,creation_time,deletion_time\n"


@pytest.mark.parametrize(
    ("model", "gpu_milli", "mapping", "expected"),
    [
        (H100, 100, traces.ProfileMapping.COMPUTE, "1g.10gb"),
        (H100, 142, traces.ProfileMapping.COMPUTE, "1g.10gb"),
        (H100, 143, traces.ProfileMapping.COMPUTE, "2g.20gb"),
        (H100, 145, traces.ProfileMapping.COMPUTE, "2g.20gb"),
        (H100, 460, traces.ProfileMapping.COMPUTE, "4g.40gb"),
        (H100, 420, traces.ProfileMapping.COMPUTE, "3g.40gb"),
        (H100, 1000, traces.ProfileMapping.COMPUTE, "7g.80gb"),
        (H100, 200, traces.ProfileMapping.MEMORY, "1g.20gb"),
        (H100, 460, traces.ProfileMapping.MEMORY, "3g.40gb"),
        (H100, 600, traces.ProfileMapping.MEMORY, "7g.80gb"),
        (A30, 300, traces.ProfileMapping.COMPUTE, "2g.12gb"),
    ],
)
def test_profile_mapping(
    model: object, gpu_milli: int, mapping: traces.ProfileMapping, expected: str
) -> None:
    assert traces.profile_for(model, gpu_milli=gpu_milli, mapping=mapping) == expected  # type: ignore[arg-type]


def test_openb_rows_become_pods() -> None:
    text = OPENB_HEADER + "p0,4000,1024,1,460,10,70\np1,1000,512,0,0,5,6\np2,88000,2048,8,1000,0,\n"
    with pytest.raises(errors.TraceError, match=r"t.csv:4: deletion_time '' is not"):
        traces.parse_openb(text, source="t.csv", model=H100)
    trace = traces.parse_openb(text.rsplit("p2", 1)[0] + "p2,88000,2048,8,1000,0,5\n",
                               source="t.csv", model=H100)  # fmt: skip
    assert trace.timed and trace.skipped == 1
    assert [p.name for p in trace.pods] == ["p2", "p0"]  # arrival order
    p2, p0 = trace.pods
    assert (p0.arrival, p0.duration, p0.cpu_milli, p0.memory_bytes) == (10.0, 60.0, 4000, 2**30)
    assert [(r.profile, r.count) for r in p0.mig] == [("4g.40gb", 1)]
    assert [(r.profile, r.count) for r in p2.mig] == [("7g.80gb", 8)]


def test_openb_without_times_is_untimed() -> None:
    text = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1,1,1,1000\n"
    trace = traces.parse(text, source="m.csv", model=H100)
    assert not trace.timed and trace.pods[0].duration is None


def test_bundled_openb() -> None:
    trace = traces.bundled_openb(H100)
    assert len(trace.pods) == 7064 and trace.skipped == 1088 and trace.timed


NATIVE = "name,arrival,duration,requests\n"


def test_native_rows() -> None:
    text = NATIVE + "# a comment\na,5,10,mig-1g.10gb=2;cpu=4;memory=8Gi\nb,1,,mig-3g.40gb=1\n"
    trace = traces.parse(text, source="n.csv", model=H100)
    b, a = trace.pods
    assert (b.name, b.duration) == ("b", None)
    assert (a.arrival, a.duration, a.cpu_milli, a.memory_bytes) == (5.0, 10.0, 4000, 8 * 2**30)
    assert [(r.profile, r.count) for r in a.mig] == [("1g.10gb", 2)]


def test_native_node_selector_column() -> None:
    text = (
        NATIVE.strip()
        + ",node_selector\n"
        + "a,0,,mig-1g.10gb=1,zone=b;nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3\n"
        + "b,0,,mig-1g.10gb=1,\n"
    )
    a, b = traces.parse(text, source="n.csv", model=H100).pods
    assert a.node_selector == (("nvidia.com/gpu.product", "NVIDIA-H100-80GB-HBM3"), ("zone", "b"))
    assert b.node_selector == ()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("a,1,1,mig-1g.10gb=1,zone", r"n.csv:2: node selector 'zone' is not LABEL=VALUE"),
        ("a,1,1,mig-1g.10gb=1,z=a;z=b", r"n.csv:2: node selector names 'z' twice"),
        ("a,1,1,mig-1g.10gb=1", r"n.csv:2: expected 5 fields, got 4"),
    ],
)
def test_native_malformed_selectors_name_the_line(body: str, message: str) -> None:
    with pytest.raises(errors.TraceError, match=message):
        traces.parse(NATIVE.strip() + ",node_selector\n" + body + "\n", source="n.csv", model=H100)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("a,x,1,mig-1g.10gb=1", r"n.csv:2: arrival 'x' is not a number"),
        ("a,1,-3,mig-1g.10gb=1", r"n.csv:2: duration '-3' must be a non-negative"),
        ("a,1,1,cpu=4", r"n.csv:2: requests name no MIG profile"),
        ("a,1,1,mig-1g.10gb=0", r"n.csv:2: mig-1g.10gb: '0' is not a positive"),
        ("a,1,1,mig-abc=1", r"n.csv:2: "),
        ("a,1,1,gpux=1", r"n.csv:2: unknown resource 'gpux'"),
        (
            "a,1,1,gpu=1;mig-1g.10gb=1",
            r"n.csv:2: a whole-GPU pod .* also asks for nvidia.com/mig-1g.10gb",
        ),
        (
            "a,1,1,gpu=1;gpumem-percentage=101",
            r"n.csv:2.nvidia.com/gpumem-percentage: 101 is outside 1 to 100",
        ),
        ("a,1,1,mig-1g.10gb", r"n.csv:2: request 'mig-1g.10gb' is not NAME=AMOUNT"),
        ("a,1,1", r"n.csv:2: expected 4 fields, got 3"),
        ("a,1,1,mig-1g.10gb=1\na,2,1,mig-1g.10gb=1", r"n.csv:3: pod name 'a' already used"),
        (",1,1,mig-1g.10gb=1", r"n.csv:2: empty pod name"),
    ],
)
def test_native_malformed_rows_name_the_line(body: str, message: str) -> None:
    with pytest.raises(errors.TraceError, match=message):
        traces.parse(NATIVE + body + "\n", source="n.csv", model=H100)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("p,1,1,1,abc,0,1", r"o.csv:2: gpu_milli 'abc' is not a whole number"),
        ("p,1,1,1,1500,0,1", r"o.csv:2: gpu_milli 1500 is above 1000"),
        ("p,1,1,2,500,0,1", r"o.csv:2: num_gpu 2 with gpu_milli 500"),
        ("p,1,1,1,0,0,1", r"o.csv:2: num_gpu 1 with gpu_milli 0"),
        ("p,1,1,1,500,9,1", r"o.csv:2: deletion_time 1 is before creation_time 9"),
        ("p,1,1,-1,500,0,1", r"o.csv:2: num_gpu -1 is below 0"),
        ("p,1,1,1", r"o.csv:2: expected 7 fields, got 4"),
    ],
)
def test_openb_malformed_rows_name_the_line(row: str, message: str) -> None:
    with pytest.raises(errors.TraceError, match=message):
        traces.parse(OPENB_HEADER + row + "\n", source="o.csv", model=H100)


@pytest.mark.parametrize(
    ("text", "message"),
    [("", r"x.csv: the trace is empty"), ("a,b\n1,2\n", r"x.csv:1: unknown trace format")],
)
def test_unknown_formats(text: str, message: str) -> None:
    with pytest.raises(errors.TraceError, match=message):
        traces.parse(text, source="x.csv", model=H100)


@pytest.mark.parametrize("name", traces.SYNTHETIC)
def test_synthetic_is_seeded(name: str) -> None:
    one = traces.synthetic(name, seed=3, model=H100, pods=50)
    assert one == traces.synthetic(name, seed=3, model=H100, pods=50)
    assert one != traces.synthetic(name, seed=4, model=H100, pods=50)
    assert len(one.pods) == 50 and one.timed
    assert [p.arrival for p in one.pods] == sorted(p.arrival for p in one.pods)


def test_unknown_synthetic_name() -> None:
    with pytest.raises(errors.TraceError, match="unknown synthetic trace 'batch'"):
        traces.synthetic("batch", seed=1, model=H100)
