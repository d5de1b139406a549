"""Read-only, on a GPU machine: the agent's CDI spec for the real GPUs, checked against the driver.

Run with the project's venv on a node with NVIDIA GPUs::

    python bench/cdi_check.py --out "$OUT/cdi-check.json"

It builds the spec ``migpilot agent --device-list-strategy cdi-cri`` would write for the GPUs and
MIG devices NVML shows now (mixed strategy: whole GPUs with MIG off, MIG devices with MIG on), the
facts read as the agent reads them (``/proc/driver/nvidia/gpus/*/information``, the MIG capability
files), and prints it. Then it lists what the driver's files say (``/dev/nvidia*`` and
``/dev/nvidia-caps/*`` with their major:minor, ``/proc/devices``, the
``/proc/driver/nvidia/capabilities`` tree with each file's content, every GPU's ``information``,
``/proc/driver/nvidia-caps/mig-minors``), checks every device node of the spec exists as a
character device with the major ``/proc/devices`` gives its driver and the minor the spec's facts
give it, that NVML's ``nvmlDeviceGetMinorNumber`` agrees with ``information``, and, when
``nvidia-ctk`` is installed, runs ``nvidia-ctk cdi generate`` (spec to stdout only, device names
by UUID) and compares each device's nodes and the common nodes with ours.

It changes nothing: no MIG mode, no compute mode, no instance, no reset, no file outside
``--out`` (NVML calls are reads; ``nvidia-ctk cdi generate`` without ``--output`` writes the spec
to its stdout). Exit 0 when every check passed, 1 when one failed; the JSON summary says which.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import stat
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import yaml

from migpilot.agent.deviceplugin import advertising, allocating, cdi, cdifiles, devices
from migpilot.gpu import backend, nvml

CTK_TIMEOUT_S = 120
MAJOR_OF = {
    "/dev/nvidiactl": "nvidia",
    "/dev/nvidia-uvm": "nvidia-uvm",
    "/dev/nvidia-uvm-tools": "nvidia-uvm",
}
FIXED_MINORS = {"/dev/nvidiactl": 255, "/dev/nvidia-uvm": 0, "/dev/nvidia-uvm-tools": 1}
"""The control nodes' minors (nvidia-modprobe's, go-nvlib's constants)."""


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def node_view(gpus: nvml.NvmlBackend, errors: list[str]) -> devices.NodeDevices:
    """The agent's view of the GPUs (as ``running.node_view``): catalog GPUs, their MIG
    devices with their compute instance."""
    out_gpus: list[devices.Gpu] = []
    migs: list[devices.MigDevice] = []
    for info in gpus.gpus():
        if info.model is None:
            errors.append(f"GPU {info.index} ({info.product_name}) is not in the catalog: left out")
            continue
        enabled = info.mig is not None and info.mig.current
        out_gpus.append(
            devices.Gpu(
                info.index, info.uuid, info.model, info.product_name, info.memory_mib, enabled
            )
        )
        if not enabled:
            continue
        try:
            found = gpus.mig_devices(info.index)
        except backend.BackendError as err:
            errors.append(f"GPU {info.index}: MIG devices: {err}")
            continue
        for dev in found:
            if dev.uuid is None or dev.ci_id is None:
                continue
            migs.append(
                devices.MigDevice(
                    uuid=dev.uuid,
                    gpu_index=info.index,
                    profile=info.model.profile_named(dev.profile),
                    start=dev.start,
                    gpu_instance_id=dev.gi_id,
                    compute_instance_id=dev.ci_id,
                )
            )
    return devices.NodeDevices(gpus=tuple(out_gpus), mig_devices=tuple(migs))


def nvml_minors() -> dict[str, Any]:
    """GPU UUID -> ``nvmlDeviceGetMinorNumber`` (read-only)."""
    import pynvml  # type: ignore[import-untyped]  # noqa: PLC0415 - only this check needs it

    out: dict[str, Any] = {}
    for index in range(int(pynvml.nvmlDeviceGetCount())):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        try:
            out[uuid] = int(pynvml.nvmlDeviceGetMinorNumber(handle))
        except pynvml.NVMLError as err:
            out[uuid] = f"error: {err}"
    return out


def proc_devices(proc: Path) -> dict[str, int]:
    """``/proc/devices``' character majors by driver name."""
    text = read_text(proc / "devices") or ""
    majors: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            in_char = False
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            majors.setdefault(parts[1], int(parts[0]))
    return majors


def dev_nodes(dev: Path) -> dict[str, Any]:
    """``/dev/nvidia*`` and ``/dev/nvidia-caps/*``: kind, major, minor, mode."""
    out: dict[str, Any] = {}
    paths = sorted(dev.glob("nvidia*"))
    caps = dev / "nvidia-caps"
    if caps.is_dir():
        paths += sorted(caps.iterdir())
    for path in paths:
        try:
            st = path.lstat()
        except OSError as err:
            out[str(path)] = {"error": str(err)}
            continue
        row: dict[str, Any] = {"mode": oct(stat.S_IMODE(st.st_mode))}
        if stat.S_ISCHR(st.st_mode):
            row |= {"type": "c", "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev)}
        elif stat.S_ISDIR(st.st_mode):
            row["type"] = "d"
        else:
            row["type"] = "other"
        out[str(path)] = row
    return out


def proc_tree(base: Path) -> dict[str, str | None]:
    """Every file below ``base`` and its content."""
    out: dict[str, str | None] = {}
    if not base.is_dir():
        return out
    for folder, _, names in os.walk(base):
        for name in sorted(names):
            path = Path(folder) / name
            out[str(path)] = read_text(path)
    return out


def expected_node(
    path: str, *, facts: cdi.DriverFacts, majors: dict[str, int]
) -> tuple[int | None, int | None]:
    """The (major, minor) a spec node must have, from /proc/devices and the spec's facts."""
    if path in FIXED_MINORS:
        return majors.get(MAJOR_OF[path]), FIXED_MINORS[path]
    if path.startswith(cdi.CAPS_DEVICE_DIR + "/nvidia-cap"):
        return majors.get("nvidia-caps"), int(path.rsplit("nvidia-cap", 1)[1])
    if path.startswith("/dev/nvidia") and path[len("/dev/nvidia") :].isdigit():
        return majors.get("nvidia"), int(path[len("/dev/nvidia") :])
    return None, None


def check_nodes(
    spec: cdi.Spec, *, root: Path, facts: cdi.DriverFacts, majors: dict[str, int]
) -> list[dict[str, Any]]:
    """One row per device node of the spec: what it must be, what it is (the path below
    ``root``, where ``dev/`` is), ok."""
    rows: list[dict[str, Any]] = []
    named = [("(common)", p) for p in spec.common_nodes]
    named += [(d.name, p) for d in spec.devices for p in d.nodes]
    for name, path in named:
        want_major, want_minor = expected_node(path, facts=facts, majors=majors)
        host = root / path.lstrip("/")
        row: dict[str, Any] = {
            "device": name,
            "path": path,
            "want": [want_major, want_minor],
        }
        try:
            st = host.stat()
        except OSError as err:
            rows.append(row | {"ok": False, "problem": f"absent: {err.strerror or err}"})
            continue
        if not stat.S_ISCHR(st.st_mode):
            rows.append(row | {"ok": False, "problem": "not a character device"})
            continue
        got = [os.major(st.st_rdev), os.minor(st.st_rdev)]
        ok = got == [want_major, want_minor]
        rows.append(row | {"got": got, "ok": ok} | ({} if ok else {"problem": "major:minor"}))
    return rows


def ctk_specs(text: str) -> list[dict[str, Any]]:
    """The spec documents nvidia-ctk printed (JSON, several concatenated, or YAML)."""
    docs: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    rest = text.strip()
    try:
        while rest:
            doc, end = decoder.raw_decode(rest)
            docs.append(doc)
            rest = rest[end:].strip()
        return docs
    except ValueError:
        return [d for d in yaml.safe_load_all(text) if isinstance(d, dict)]


def run_ctk(ctk: str) -> dict[str, Any]:
    """``nvidia-ctk cdi generate`` to stdout, device names by UUID (JSON, else its YAML)."""
    tries = [
        [ctk, "cdi", "generate", "--format", "json", "--device-name-strategy", "uuid"],
        [ctk, "cdi", "generate", "--device-name-strategy", "uuid"],
    ]
    out: dict[str, Any] = {"path": ctk}
    for argv in tries:
        try:
            done = subprocess.run(
                argv, capture_output=True, text=True, timeout=CTK_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            out["error"] = f"{' '.join(argv)}: {err}"
            continue
        out |= {"argv": argv, "rc": done.returncode, "stderr": done.stderr[-4000:]}
        if done.returncode == 0:
            out["specs"] = ctk_specs(done.stdout)
            return out
    return out


def compare(ours: cdi.Spec, theirs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per device of ours: our nodes, nvidia-ctk's, and what differs; the common nodes too."""
    their_devices: dict[str, set[str]] = {}
    their_common: set[str] = set()
    for doc in theirs:
        edits = doc.get("containerEdits") or {}
        their_common |= {n["path"] for n in edits.get("deviceNodes") or []}
        for d in doc.get("devices") or []:
            nodes = (d.get("containerEdits") or {}).get("deviceNodes") or []
            their_devices.setdefault(str(d.get("name")), set()).update(n["path"] for n in nodes)
    rows = []
    for d in ours.devices:
        theirs_nodes = their_devices.get(d.name)
        mine = set(d.nodes)
        rows.append(
            {
                "device": d.name,
                "ours": sorted(mine),
                "nvidia_ctk": sorted(theirs_nodes) if theirs_nodes is not None else None,
                "only_ours": sorted(mine - (theirs_nodes or set())),
                "only_nvidia_ctk": sorted((theirs_nodes or set()) - mine),
            }
        )
    common = set(ours.common_nodes)
    return {
        "devices": rows,
        "common": {
            "ours": sorted(common),
            "nvidia_ctk": sorted(their_common),
            "only_ours": sorted(common - their_common),
            "only_nvidia_ctk": sorted(their_common - common),
        },
        "nvidia_ctk_device_names": sorted(their_devices),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path, help="the JSON summary's path")
    parser.add_argument("--root", default="/", type=Path, help="where proc/ and dev/ are")
    args = parser.parse_args(argv)
    root: Path = args.root
    proc, dev = root / "proc", root / "dev"
    summary: dict[str, Any] = {"errors": [], "checks": {}}
    errors: list[str] = summary["errors"]
    ok = True

    def section(name: str, fn: Any) -> Any:
        try:
            value = fn()
        except Exception as err:  # one section failing must not lose the others
            errors.append(f"{name}: {type(err).__name__}: {err}")
            summary[f"{name}_traceback"] = traceback.format_exc()
            return None
        summary[name] = value
        return value

    # -- what the driver's files say --------------------------------------------------------------
    majors = section("proc_devices", lambda: proc_devices(proc)) or {}
    section("dev_nodes", lambda: dev_nodes(dev))
    section("capabilities", lambda: proc_tree(proc / cdi.PROC_CAPABILITIES))
    section("gpus_information", lambda: proc_tree(proc / cdi.PROC_GPUS))
    section("mig_minors_lines", lambda: (read_text(proc / "driver/nvidia-caps/mig-minors") or "")
            .count("\n"))  # fmt: skip
    section("params", lambda: read_text(proc / "driver/nvidia/params"))

    # -- our spec -------------------------------------------------------------------------------
    try:
        backend_: nvml.NvmlBackend | None = nvml.NvmlBackend()
        summary["nvml_init"] = "ok"
    except Exception as err:  # no driver, no GPU: the driver's files above still say something
        errors.append(f"nvml_init: {type(err).__name__}: {err}")
        backend_ = None
    spec: cdi.Spec | None = None
    facts: cdi.DriverFacts | None = None
    if backend_ is not None:
        try:
            view = node_view(backend_, errors)
            summary["view"] = {
                "gpus": [
                    {"index": g.index, "uuid": g.uuid, "name": g.product_name, "mig": g.mig_enabled}
                    for g in view.gpus
                ],
                "mig_devices": [
                    {
                        "uuid": m.uuid,
                        "gpu": m.gpu_index,
                        "profile": m.profile.name,
                        "gi": m.gpu_instance_id,
                        "ci": m.compute_instance_id,
                    }
                    for m in view.mig_devices
                ],
            }
            resources = advertising.resources_for(view, devices.MigStrategy.MIXED)
            facts = cdifiles.read_facts(root, view)
            settings = allocating.AllocateSettings()
            kind = cdi.check_kind(settings.cdi_vendor, settings.cdi_class)
            built = cdi.build(view, resources, facts, kind=kind)
            spec = built.spec
            summary["facts"] = {
                "gpu_minors": dict(facts.gpu_minors),
                "caps": dict(facts.cap_minors),
            }
            summary["spec"] = spec.document()
            summary["missing"] = [
                {"device": m.device_id, "reason": m.reason} for m in built.missing
            ]
            ok &= not built.missing
            print(json.dumps(spec.document(), indent=2))
            minors = section("nvml_minors", nvml_minors)  # while NVML is initialised
            if minors is not None:
                agree = {u: facts.gpu_minors.get(u) == m for u, m in minors.items()}
                summary["checks"]["nvml_minor_matches_information"] = agree
                ok &= all(agree.values())
        except Exception as err:
            errors.append(f"spec: {type(err).__name__}: {err}")
            summary["spec_traceback"] = traceback.format_exc()
        finally:
            backend_.close()

    # -- the checks -----------------------------------------------------------------------------
    if spec is not None and facts is not None:
        rows = check_nodes(spec, root=root, facts=facts, majors=majors)
        summary["checks"]["device_nodes"] = rows
        ok &= all(r["ok"] for r in rows)
        ctk = shutil.which("nvidia-ctk")
        if ctk is None:
            summary["nvidia_ctk"] = "not installed"
        else:
            ran = section("nvidia_ctk", lambda: run_ctk(ctk))
            if ran is not None and "specs" in ran:
                diff = compare(spec, ran["specs"])
                summary["checks"]["nvidia_ctk_diff"] = diff
                ok &= all(not r["only_ours"] and not r["only_nvidia_ctk"] for r in diff["devices"])
    else:
        ok = False
    ok &= not errors
    summary["ok"] = ok
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1, sort_keys=True, default=str) + "\n")
    print(f"cdi_check: {'ok' if ok else 'FAILED'}; summary in {args.out}", file=sys.stderr)
    for line in errors:
        print(f"cdi_check: {line}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
