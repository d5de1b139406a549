"""``migpilot gpus | profiles | layouts | check``: questions about the MIG hardware model."""

from __future__ import annotations

import argparse
from typing import IO, Any

from migpilot import errors
from migpilot.cli import output
from migpilot.mig import catalog, layouts, profiles


def register(sub: Any) -> None:
    """Add the MIG model commands to the top-level subparsers."""
    p = sub.add_parser("gpus", help="list the MIG-capable GPU models migpilot knows")
    output.add_output_flag(p)
    p.set_defaults(func=cmd_gpus)

    p = sub.add_parser("profiles", help="list the MIG profiles of a GPU model")
    p.add_argument(
        "gpu", metavar="GPU", help="GPU model (any alias: a100-40gb, 'NVIDIA H100 80GB HBM3')"
    )
    output.add_output_flag(p)
    p.set_defaults(func=cmd_profiles)

    p = sub.add_parser("layouts", help="enumerate the maximal MIG layouts of a GPU model")
    p.add_argument("gpu", metavar="GPU", help="GPU model (any alias)")
    p.add_argument(
        "--profiles",
        metavar="P,...",
        help="only use these profiles (comma-separated; default: all of the GPU's)",
    )
    p.add_argument(
        "--keep",
        metavar="P@S,...",
        action="append",
        help="instances that must stay where they are: list the completions of this layout "
        "(comma-separated, or the flag repeated)",
    )
    output.add_output_flag(p)
    p.set_defaults(func=cmd_layouts)

    p = sub.add_parser(
        "check",
        help="check a layout (PROFILE@START ...) or place profiles (PROFILE ...) on a GPU",
        description=(
            "Exit 0 and print the placed layout when the instances form a valid layout; "
            "exit 1 with the reason when they do not. Instances without @START get a "
            "placement chosen for them."
        ),
    )
    p.add_argument("gpu", metavar="GPU", help="GPU model (any alias)")
    p.add_argument("instances", metavar="PROFILE[@START]", nargs="+")
    output.add_output_flag(p)
    p.set_defaults(func=cmd_check)


def _gpu_json(m: profiles.GpuModel) -> dict[str, Any]:
    return {
        "id": m.id,
        "products": list(m.product_names),
        "gfd_products": list(m.gfd_product_names),
        "pci_device_ids": [f"0x{d:08X}" for d in m.pci_device_ids],
        "family": m.family,
        "compute_capability": f"{m.compute_capability[0]}.{m.compute_capability[1]}",
        "memory_slots": m.memory_slots,
        "compute_slices": m.compute_slices,
        "max_gpu_instances": m.max_gpu_instances,
        "profiles": [p.name for p in m.profiles],
        "notes": list(m.notes),
    }


def cmd_gpus(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot gpus``."""
    models = catalog.gpu_models()
    if args.output == "json":
        output.write_json(out, [_gpu_json(m) for m in models])
        return 0
    rows = [
        (
            m.id,
            m.product_names[0] if m.product_names else None,
            m.family,
            m.memory_slots,
            m.compute_slices,
            len(m.profiles),
        )
        for m in models
    ]
    output.write_table(
        out,
        ("ID", "PRODUCT", "FAMILY", "MEM SLOTS", "COMPUTE", "PROFILES"),
        rows,
        right=("MEM SLOTS", "COMPUTE", "PROFILES"),
    )
    return 0


def _profile_json(p: profiles.Profile) -> dict[str, Any]:
    return {
        "name": p.name,
        "resource": "nvidia.com/" + p.resource_name,
        "nvml_profile": f"NVML_GPU_INSTANCE_PROFILE_{p.nvml_profile}",
        "nvml_index": p.nvml_index,
        "smi_id": p.smi_id,
        "memory_mib": p.memory_mib,
        "memory_slots": p.memory_slots,
        "compute_slices": p.compute_slices,
        "sms": p.sms,
        "engines": {
            "copy": p.engines.copy,
            "decoder": p.engines.decoder,
            "encoder": p.engines.encoder,
            "jpeg": p.engines.jpeg,
            "ofa": p.engines.ofa,
        },
        "max_instances": p.max_instances,
        "placements": [{"start": s, "size": p.memory_slots} for s in p.placements],
        "inferred": sorted(p.inferred),
        "aliases": list(p.aliases),
    }


def cmd_profiles(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot profiles GPU``."""
    m = catalog.resolve_gpu(args.gpu)
    if args.output == "json":
        output.write_json(out, {"gpu": m.id, "profiles": [_profile_json(p) for p in m.profiles]})
        return 0
    rows = []
    for p in m.profiles:
        e = p.engines
        engines = "/".join(
            "-" if v is None else str(v) for v in (e.copy, e.decoder, e.encoder, e.jpeg, e.ofa)
        )
        rows.append(
            (
                p.name,
                p.smi_id,
                p.nvml_index,
                p.memory_mib,
                p.memory_slots,
                p.compute_slices,
                p.sms,
                engines,
                p.max_instances,
                p.placements_text(),
                ",".join(sorted(p.inferred)) or None,
            )
        )
    headers = (
        "PROFILE", "ID", "NVML", "MEMORY MiB", "SLOTS", "COMPUTE", "SMs", "CE/DEC/ENC/JPG/OFA",
        "MAX", "PLACEMENTS", "INFERRED",
    )  # fmt: skip
    out.write(f"{m.id} ({', '.join(m.product_names)})\n")
    right = ("ID", "NVML", "MEMORY MiB", "SLOTS", "COMPUTE", "SMs", "MAX")
    output.write_table(out, headers, rows, right=right)
    return 0


def _layout_json(layout: layouts.Layout) -> list[dict[str, Any]]:
    return [{"profile": i.profile, "start": i.start} for i in layout.instances]


def slot_map(model: profiles.GpuModel, layout: layouts.Layout) -> str:
    """A one-line picture of the memory slots, each slot the same width; ``.`` is a free slot."""
    width = max(-(-len(p.name) // p.memory_slots) for p in model.profiles)
    by_start = {i.start: i for i in layout.instances}
    cells: list[str] = []
    slot = 0
    while slot < model.memory_slots:
        inst = by_start.get(slot)
        size = 1 if inst is None else model.profile_named(inst.profile).memory_slots
        span = size * width + size - 1
        cells.append("." * span if inst is None else inst.profile.ljust(span, "-"))
        slot += size
    return "|" + "|".join(cells) + "|"


def _parse_instances(
    model: profiles.GpuModel, texts: list[str]
) -> tuple[list[layouts.Instance], list[str]]:
    fixed: list[layouts.Instance] = []
    loose: list[str] = []
    for text in texts:
        for part in text.split(","):
            if not part.strip():
                continue
            name, start = layouts.parse_instance(model, part.strip())
            if start is None:
                loose.append(name)
            else:
                fixed.append(layouts.Instance(start, name))
    return fixed, loose


def cmd_layouts(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot layouts GPU [--profiles P,...] [--keep P@S,...]``."""
    m = catalog.resolve_gpu(args.gpu)
    allowed = None
    if args.profiles:
        allowed = [m.resolve_profile(x.strip()).name for x in args.profiles.split(",") if x.strip()]
    fixed: list[layouts.Instance] = []
    if args.keep:
        fixed, loose = _parse_instances(m, args.keep)
        if loose:
            raise errors.LayoutError(
                f"--keep needs PROFILE@START for every instance (missing for {', '.join(loose)})"
            )
    found = layouts.enumerate_layouts(m, allowed=allowed, fixed=fixed)
    if args.output == "json":
        output.write_json(
            out,
            {
                "gpu": m.id,
                "profiles": allowed or [p.name for p in m.profiles],
                "keep": [{"profile": i.profile, "start": i.start} for i in sorted(fixed)],
                "layouts": [_layout_json(lay) for lay in found],
            },
        )
        return 0
    rows = [
        (n, len(lay), sum(m.profile_named(i.profile).compute_slices for i in lay.instances), lay)
        for n, lay in enumerate(found, 1)
    ]
    output.write_table(
        out,
        ("#", "INSTANCES", "COMPUTE", "LAYOUT (PROFILE@START)"),
        rows,
        right=("#", "INSTANCES", "COMPUTE"),
    )
    out.write(f"{len(found)} maximal layouts of {m.id}\n")
    return 0


def cmd_check(args: argparse.Namespace, out: IO[str]) -> int:
    """``migpilot check GPU PROFILE[@START] ...``: exit 0 valid, 1 invalid (with the reason)."""
    m = catalog.resolve_gpu(args.gpu)
    fixed, loose = _parse_instances(m, args.instances)
    try:
        layout = layouts.place(m, loose, fixed=fixed)
    except errors.LayoutError as e:
        if args.output == "json":
            output.write_json(out, {"gpu": m.id, "valid": False, "reason": str(e)})
        else:
            out.write(f"invalid: {e}\n")
        return 1
    if args.output == "json":
        output.write_json(out, {"gpu": m.id, "valid": True, "layout": _layout_json(layout)})
        return 0
    out.write(f"valid on {m.id}: {layout}\n{slot_map(m, layout)}\n")
    return 0
