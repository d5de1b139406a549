"""The agent's CDI spec: what it holds for a real H200 (whole GPU) and an H100 MIG layout, the
driver files it is made from, that it passes the CDI specification's JSON schema, that every
name Allocate can answer is defined exactly once, and the writer's file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import referencing
from hypothesis import given
from hypothesis import strategies as st

from migpilot.agent.deviceplugin import (
    advertising,
    allocating,
    cdi,
    cdifiles,
    devices,
    replicating,
)
from migpilot.gpu import emulated_proc
from migpilot.mig import catalog
from migpilot.sharing import config as sharing_config
from migpilot.sharing import replicas
from tests.kube import tools

KIND = "k8s.device-plugin.nvidia.com/gpu"
CONTROL = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]

# /proc/driver/nvidia/gpus/0000:00:06.0/information of the H200 in
# /work/shared/reference/gpu-h200-2026-11/cdi-facts.txt (driver 580.159.04), as the driver pads it.
H200_UUID = "GPU-6871d114-5c34-a5ec-0b30-451b680ec522"
H200_INFORMATION = (
    "Model: \t\t NVIDIA H200\n"
    "IRQ:   \t\t 41\n"
    f"GPU UUID: \t {H200_UUID}\n"
    "Video BIOS: \t 96.00.a5.00.1a\n"
    "Bus Type: \t PCIe\n"
    "DMA Size: \t 52 bits\n"
    "DMA Mask: \t 0xfffffffffffff\n"
    "Bus Location: \t 0000:00:06.0\n"
    "Device Minor: \t 0\n"
    "GPU Firmware: \t 580.159.04\n"
    "GPU Excluded:\t No\n"
)
H200_MIG_CONFIG = "DeviceFileMinor: 1\nDeviceFileMode: 256\nDeviceFileModify: 1\n"


# -- the schema ---------------------------------------------------------------------------------


def _validator() -> jsonschema.protocols.Validator:
    """The CDI schema (scripts/k8s-tools' copy of the module's schema/), with the rule the
    module's newer schema adds (top-level containerEdits checked against the same defs)."""
    path = tools.cdi_schema()
    schema = json.loads(path.read_text())
    defs = json.loads((path.parent / "defs.json").read_text())
    registry: referencing.Registry[Any] = referencing.Registry().with_resources(
        [
            (name, referencing.Resource.from_contents(doc, referencing.jsonschema.DRAFT7))
            for name, doc in (("schema.json", schema), ("defs.json", defs))
        ]
    )
    wrapper = {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "allOf": [{"$ref": "schema.json"}],
        "properties": {"containerEdits": {"$ref": "defs.json#/definitions/containerEdits"}},
    }
    return jsonschema.Draft7Validator(wrapper, registry=registry)


VALIDATOR = _validator()


def test_the_schema_refuses_what_the_specification_refuses() -> None:
    """The validator can fail: no devices, a device without edits, a node without a path."""
    good = {"cdiVersion": "0.5.0", "kind": KIND, "devices": []}
    assert VALIDATOR.is_valid(good)
    assert not VALIDATOR.is_valid({"cdiVersion": "0.5.0", "kind": KIND})
    assert not VALIDATOR.is_valid({**good, "devices": [{"name": "GPU-1"}]})
    bad_node = {"deviceNodes": [{"major": 195}]}
    assert not VALIDATOR.is_valid({**good, "containerEdits": bad_node})
    assert not VALIDATOR.is_valid(
        {**good, "devices": [{"name": "GPU-1", "containerEdits": bad_node}]}
    )


# -- nodes --------------------------------------------------------------------------------------


def whole_gpu(index: int, uuid: str, model_id: str = "h200-141gb") -> devices.Gpu:
    model = catalog.resolve_gpu(model_id)
    return devices.Gpu(
        index=index,
        uuid=uuid,
        model=model,
        product_name=model.product_names[0],
        memory_mib=143771,
        mig_enabled=False,
    )


def h100_mig_node() -> devices.NodeDevices:
    """Two H100s with MIG on: GPU 0 with 3g.40gb@0 (GI 1) and 1g.10gb@6 (GI 2), GPU 1 with
    7g.80gb@0 (GI 1)."""
    model = catalog.resolve_gpu("h100-80gb")
    gpus = tuple(
        devices.Gpu(
            index=i,
            uuid=f"GPU-h100-{i}",
            model=model,
            product_name=model.product_names[0],
            memory_mib=81559,
            mig_enabled=True,
        )
        for i in range(2)
    )
    layout = [(0, "3g.40gb", 0, 1), (0, "1g.10gb", 6, 2), (1, "7g.80gb", 0, 1)]
    migs = tuple(
        devices.MigDevice(
            uuid=f"MIG-h100-{g}-{gi}",
            gpu_index=g,
            profile=model.profile_named(name),
            start=start,
            gpu_instance_id=gi,
            compute_instance_id=0,
        )
        for g, name, start, gi in layout
    )
    return devices.NodeDevices(gpus=gpus, mig_devices=migs)


def write_tree(root: Path, rel_text: dict[str, str]) -> None:
    for rel, text in rel_text.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


# -- the H200, whole -----------------------------------------------------------------------------


def test_h200_whole_gpu_spec_from_its_driver_files(tmp_path: Path) -> None:
    write_tree(
        tmp_path,
        {
            "proc/driver/nvidia/gpus/0000:00:06.0/information": H200_INFORMATION,
            "proc/driver/nvidia/capabilities/mig/config": H200_MIG_CONFIG,
        },
    )
    node = devices.NodeDevices(gpus=(whole_gpu(0, H200_UUID),))
    resources = advertising.resources_for(node, devices.MigStrategy.MIXED)
    facts = cdifiles.read_facts(tmp_path, node)
    assert facts == cdi.DriverFacts({H200_UUID: 0}, {})
    built = cdi.build(node, resources, facts, kind=KIND)
    assert built.missing == ()
    doc = built.spec.document()
    assert doc == {
        "cdiVersion": "0.5.0",
        "kind": KIND,
        "devices": [
            {"name": H200_UUID, "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}
        ],
        "containerEdits": {"deviceNodes": [{"path": p} for p in CONTROL]},
    }
    VALIDATOR.validate(doc)
    # The name Allocate answers with is the one the spec defines.
    answer = allocating.answer(
        [H200_UUID],
        allocating.AllocateSettings(device_list_strategies=(devices.DeviceListStrategy.CDI_CRI,)),
    )
    assert set(answer.cdi_devices) == built.spec.qualified() == {f"{KIND}={H200_UUID}"}


def test_a_gpu_the_driver_does_not_list_is_missing_not_guessed(tmp_path: Path) -> None:
    node = devices.NodeDevices(gpus=(whole_gpu(0, H200_UUID), whole_gpu(1, "GPU-other")))
    write_tree(tmp_path, {"proc/driver/nvidia/gpus/0000:00:06.0/information": H200_INFORMATION})
    resources = advertising.resources_for(node, devices.MigStrategy.MIXED)
    built = cdi.build(node, resources, cdifiles.read_facts(tmp_path, node), kind=KIND)
    assert built.spec.names() == {H200_UUID}
    assert built.missing_ids() == {"GPU-other"}
    assert "no device minor for GPU 1" in built.missing[0].reason


# -- an H100 MIG layout ----------------------------------------------------------------------------


def test_h100_mig_devices_get_their_gpu_and_their_gi_and_ci_caps(tmp_path: Path) -> None:
    node = h100_mig_node()
    # The driver's files as the emulated backend writes them (mig-minors numbering).
    gpus = [
        emulated_proc.EmulatedGpu(0, "GPU-h100-0", "NVIDIA H100 80GB HBM3", ((1, 0), (2, 0))),
        emulated_proc.EmulatedGpu(1, "GPU-h100-1", "NVIDIA H100 80GB HBM3", ((1, 0),)),
    ]
    emulated_proc.sync(tmp_path, emulated_proc.tree(gpus))
    caps = tmp_path / "proc/driver/nvidia/capabilities"
    assert (caps / "gpu0/mig/gi1/access").read_text().startswith("DeviceFileMinor: 12\n")
    assert (caps / "gpu0/mig/gi2/ci0/access").read_text().startswith("DeviceFileMinor: 22\n")
    resources = advertising.resources_for(node, devices.MigStrategy.MIXED)
    built = cdi.build(node, resources, cdifiles.read_facts(tmp_path, node), kind=KIND)
    assert built.missing == ()
    caps = "/dev/nvidia-caps/nvidia-cap"
    assert {d.name: d.nodes for d in built.spec.devices} == {
        "MIG-h100-0-1": ("/dev/nvidia0", f"{caps}12", f"{caps}13"),
        "MIG-h100-0-2": ("/dev/nvidia0", f"{caps}21", f"{caps}22"),
        # GPU 1's GI 1: 3 + 135 + 9 (the driver's per-GPU block of 135 minors).
        "MIG-h100-1-1": ("/dev/nvidia1", f"{caps}147", f"{caps}148"),
    }
    VALIDATOR.validate(built.spec.document())


def test_a_mig_device_without_its_ci_file_is_missing(tmp_path: Path) -> None:
    node = h100_mig_node()
    gpus = [
        emulated_proc.EmulatedGpu(0, "GPU-h100-0", "H100", ((1, 0), (2, None))),
        emulated_proc.EmulatedGpu(1, "GPU-h100-1", "H100", ((1, 0),)),
    ]
    emulated_proc.sync(tmp_path, emulated_proc.tree(gpus))
    resources = advertising.resources_for(node, devices.MigStrategy.MIXED)
    built = cdi.build(node, resources, cdifiles.read_facts(tmp_path, node), kind=KIND)
    assert built.missing_ids() == {"MIG-h100-0-2"}
    assert "capabilities/gpu0/mig/gi2/ci0/access" in built.missing[0].reason
    assert built.spec.names() == {"MIG-h100-0-1", "MIG-h100-1-1"}


def test_sync_removes_a_destroyed_instances_files(tmp_path: Path) -> None:
    one = emulated_proc.EmulatedGpu(0, "GPU-a", "H100", ((1, 0), (2, 0)))
    emulated_proc.sync(tmp_path, emulated_proc.tree([one]))
    emulated_proc.sync(
        tmp_path, emulated_proc.tree([emulated_proc.EmulatedGpu(0, "GPU-a", "H100", ((1, 0),))])
    )
    mig = tmp_path / "proc/driver/nvidia/capabilities/gpu0/mig"
    assert sorted(p.name for p in mig.iterdir()) == ["gi1"]


# -- the driver files' formats -------------------------------------------------------------------


def test_parse_access_reads_the_minor_line() -> None:
    assert cdi.parse_access("DeviceFileMinor: 147\nDeviceFileMode: 292\n", where="f") == 147


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("DeviceFileMode: 292\n", "f: no DeviceFileMinor line"),
        ("DeviceFileMinor: -1\n", "f: DeviceFileMinor: '-1' is not a number"),
        ("DeviceFileMinor: \n", "is not a number"),
    ],
)
def test_parse_access_refuses_a_file_without_a_minor(text: str, message: str) -> None:
    with pytest.raises(cdi.CdiError, match=message):
        cdi.parse_access(text, where="f")


def test_parse_information_needs_uuid_and_minor() -> None:
    assert cdi.parse_information(H200_INFORMATION, where="i") == (H200_UUID, 0)
    with pytest.raises(cdi.CdiError, match="no 'Device Minor' line"):
        cdi.parse_information(f"GPU UUID: \t {H200_UUID}\n", where="i")
    with pytest.raises(cdi.CdiError, match="no 'GPU UUID' line"):
        cdi.parse_information("Device Minor: \t 0\n", where="i")


@pytest.mark.parametrize(
    ("vendor", "cls", "message"),
    [
        ("1vendor", "gpu", "must start with a letter"),
        ("vendor.", "gpu", "must end with a letter or digit"),
        ("ven/dor", "gpu", "holds '/'"),
        ("vendor", "", "class is empty"),
    ],
)
def test_check_kind_follows_the_cdi_parser(vendor: str, cls: str, message: str) -> None:
    with pytest.raises(cdi.CdiError, match=message):
        cdi.check_kind(vendor, cls)


def test_check_device_name_allows_colons_not_slashes() -> None:
    cdi.check_device_name("GPU-x")
    cdi.check_device_name("1a:b")
    for bad in ("", "-a", "a/b", "a::"):
        with pytest.raises(cdi.CdiError):
            cdi.check_device_name(bad)


# -- every advertised device, exactly one entry -------------------------------------------------


@st.composite
def nodes(draw: st.DrawFn) -> tuple[devices.NodeDevices, devices.MigStrategy, int]:
    """An H100 node: each GPU whole, sliced (MPS slices) or in MIG mode with some instances;
    some instances set aside for unified pods; a strategy; time-slicing replicas (1: none)."""
    model = catalog.resolve_gpu("h100-80gb")
    gpus, migs, slices = [], [], []
    unified: set[str] = set()
    for i in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["whole", "sliced", "mig"]))
        gpus.append(devices.Gpu(i, f"GPU-{i}", model, model.product_names[0], 81559, kind == "mig"))
        if kind == "sliced":
            for s in range(draw(st.integers(1, 3))):
                slices.append(devices.MpsSlice(i, s, 10))
        if kind == "mig":
            for gi in range(1, draw(st.integers(0, 3)) + 1):
                uuid = f"MIG-{i}-{gi}"
                migs.append(
                    devices.MigDevice(uuid, i, model.profile_named("1g.10gb"), gi - 1, gi, 0)
                )
                if draw(st.booleans()):
                    unified.add(uuid)
    node = devices.NodeDevices(
        gpus=tuple(gpus),
        mig_devices=tuple(migs),
        unified=frozenset(unified),
        mps_slices=tuple(slices),
    )
    strategy = draw(st.sampled_from([devices.MigStrategy.MIXED, devices.MigStrategy.NONE]))
    return node, strategy, draw(st.sampled_from([1, 2, 4]))


def _facts(node: devices.NodeDevices) -> cdi.DriverFacts:
    caps = {
        cap: n for n, cap in enumerate(cdi.mig_caps(node, {g.uuid: g.index for g in node.gpus}), 10)
    }
    return cdi.DriverFacts({g.uuid: g.index for g in node.gpus}, caps)


@given(nodes())
def test_every_advertised_device_has_exactly_one_entry_and_each_entry_a_device(
    drawn: tuple[devices.NodeDevices, devices.MigStrategy, int],
) -> None:
    node, strategy, copies = drawn
    plain = advertising.resources_for(node, strategy)
    sharing = sharing_config.EMPTY
    if copies > 1:
        sharing = sharing_config.parse(
            "sharing: {timeSlicing: {failRequestsGreaterThanOne: false, resources: "
            f"[{{name: gpu, replicas: {copies}}}]}}}}\n",
            source="t",
        )
    resources = replicating.share(plain, node, sharing).resources
    built = cdi.build(node, resources, _facts(node), kind=KIND)
    assert built.missing == ()
    entries = [d.name for d in built.spec.devices]
    assert len(entries) == len(set(entries))  # one entry per device name
    advertised = [d.id for r in resources for d in r.devices]
    # Every advertised device maps to an entry, and every entry is some advertised device's.
    assert {cdi.spec_device_id(i) for i in advertised} == set(entries)
    # The names Allocate answers with for any advertised device are defined by the spec.
    settings = allocating.AllocateSettings(
        device_list_strategies=(devices.DeviceListStrategy.CDI_CRI,)
    )
    for device_id in advertised:
        answer = allocating.answer(replicas.real_ids([device_id]), settings)
        assert set(answer.cdi_devices) <= built.spec.qualified()
    VALIDATOR.validate(built.spec.document())


# -- the writer --------------------------------------------------------------------------------


def test_writer_rewrites_the_file_when_devices_change_and_drops_the_gone(tmp_path: Path) -> None:
    proc, specs = tmp_path / "root", tmp_path / "cdi"
    node = h100_mig_node()
    gpus = [
        emulated_proc.EmulatedGpu(0, "GPU-h100-0", "H100", ((1, 0), (2, 0))),
        emulated_proc.EmulatedGpu(1, "GPU-h100-1", "H100", ((1, 0),)),
    ]
    emulated_proc.sync(proc, emulated_proc.tree(gpus))
    writer = cdifiles.CdiWriter(specs, node="node-a", proc_root=proc, kind=KIND)
    resources = advertising.resources_for(node, devices.MigStrategy.MIXED)
    assert writer.write(node, resources) == frozenset()
    path = specs / "migpilot-node-a.json"
    first = json.loads(path.read_text())
    VALIDATOR.validate(first)
    assert [d["name"] for d in first["devices"]] == ["MIG-h100-0-1", "MIG-h100-0-2", "MIG-h100-1-1"]
    # GPU 0's GI 2 is destroyed: the next view lacks it, and so does the file.
    smaller = devices.NodeDevices(
        gpus=node.gpus, mig_devices=tuple(m for m in node.mig_devices if m.uuid != "MIG-h100-0-2")
    )
    gpus[0] = emulated_proc.EmulatedGpu(0, "GPU-h100-0", "H100", ((1, 0),))
    emulated_proc.sync(proc, emulated_proc.tree(gpus))
    writer.write(smaller, advertising.resources_for(smaller, devices.MigStrategy.MIXED))
    assert [d["name"] for d in json.loads(path.read_text())["devices"]] == [
        "MIG-h100-0-1",
        "MIG-h100-1-1",
    ]
    assert sorted(p.name for p in specs.iterdir()) == ["migpilot-node-a.json"]  # no temp left
    assert path.stat().st_mode & 0o777 == 0o644


def test_writer_reports_devices_without_facts(tmp_path: Path) -> None:
    writer = cdifiles.CdiWriter(tmp_path / "cdi", node="n", proc_root=tmp_path, kind=KIND)
    node = h100_mig_node()
    resources = advertising.resources_for(node, devices.MigStrategy.MIXED)
    assert writer.write(node, resources) == {"MIG-h100-0-1", "MIG-h100-0-2", "MIG-h100-1-1"}
    assert json.loads((tmp_path / "cdi/migpilot-n.json").read_text())["devices"] == []


def test_spec_file_name_refuses_a_path() -> None:
    assert cdifiles.spec_file_name("gpu-node-1") == "migpilot-gpu-node-1.json"
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(Exception, match="cannot name a CDI spec file"):
            cdifiles.spec_file_name(bad)
