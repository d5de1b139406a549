"""Mutation testing of the rules that protect instances and slices in use or reserved.

Runs mutmut (configured in pyproject.toml, ``[tool.mutmut]``: the files it copies and mutates,
and the tests it may run) over the functions in :data:`SCOPE` only, one worker, then writes
``bench/results/mutation.json``: per file the mutants, killed, survivors and the excluded ones
with the reason each changes nothing observable (:data:`EQUIVALENT`). Exits 1 when any mutant
in scope survives (or has no test), so a rule nobody checks is caught.

A file listed in :data:`TESTS` is run against those tests only (fast, pure ones) instead of
the whole ``pytest_add_cli_args_test_selection``: the files are run in groups, one mutmut run per
test list, each with that list as its selection (mutmut then collects its test-to-function map
again, and re-tests every mutant named anyway).

    python bench/mutation.py                 # the whole scope (about 25 min on 2 cores, most
                                             # of it serving.py, whose tests go through gRPC)
    python bench/mutation.py reconciling     # the files whose path contains a word

mutmut writes its copy of the tree under ``mutants/`` (ignored by git); every mutant in scope
is tested again at each run (they are named). Delete ``mutants/`` for a clean run.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import pathlib
import subprocess
import sys
import time
from importlib import metadata

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "mutation.json"

SCOPE: dict[str, tuple[str, ...]] = {
    # The reconciler's destroy path: what is in use, the diff that keeps it, the re-check
    # right before each destroy, and the loop that applies and re-reads.
    "src/migpilot/agent/reconciling.py": (
        "xǁInUseSetǁ*",
        "xǁAnyOfǁin_use",
        "xǁRunningProcessesǁin_use",
        "xǁReconcilerǁreconcile",
        "xǁReconcilerǁ_apply_gpu",
        "xǁReconcilerǁ_call",
    ),
    # The pure diff: the changes that keep what is in use.
    "src/migpilot/agent/rules/changes.py": (
        "x_diff",
        "x__diff_gpu",
        # Dynamic MIG mode: a GPU's mode switched only when nothing on it is in use or held
        # (whole, a replica, an MPS slice), its idle instances destroyed first.
        "x__switch_mode",
        "x_gpu_held",
    ),
    # The instances a GpuLayout says must survive whatever its spec lists.
    "src/migpilot/agent/rules/desired.py": ("x_protected",),
    # ---- The planner's validation and Allocate -------------------------------------------------
    # The planner's validation: no instance in use destroyed or moved (the target layouts and
    # the actions), no instance or slice in use or given to another pod handed out again, no
    # slice in use or reserved shrunk or removed, no time-slicing replica overcommitted, CPU and
    # memory within allocatable. Not in scope: _check_unified and _matched, which check that a
    # unified pod's instances serve its ask (a plan's fit, not what protects an instance in use).
    "src/migpilot/planning/validation.py": (
        "x_problems",
        "x__check_pods",
        "x__check_sharing",
        "x__check_replicas",
        # Dynamic MIG mode: no switch of a GPU with anything used or reserved, a whole-GPU pod
        # given only free whole GPUs of a dynamic node, none given twice.
        "x__check_modes",
    ),
    # Allocate of nvidia.com/gpu for unified requests: which pod and container a request
    # serves, the instances reserved for it (never one another pod or a mig-* resource holds,
    # never one that does not exist), a whole-GPU pod never given a unified instance, the pool
    # set aside. Not in scope: preferred (GetPreferredAllocation, a hint Allocate re-checks),
    # _rank / _slice_fits / _profile (which of the pod's own instances goes first), _kind /
    # _noun (words of a message), gpu_pod (reading a pod's asks; test_deviceplugin_resolving).
    "src/migpilot/agent/deviceplugin/resolving.py": (
        "x_candidate",
        "x__allocation_of",
        "x_resolve",
        "x__unified",
        "x_set_aside",
        "xǁPodAllocationǁadding",
    ),
    # Every requested ID a device of the resource, none named twice in one container's request,
    # the container told exactly those IDs.
    "src/migpilot/agent/deviceplugin/allocating.py": (
        "x_check_known",
        "x_check_distinct",
        "x_container_allocation",
        "x_answer",
    ),
    # An MPS slice's Allocate: advertised and served, on one GPU, mapped to its real GPU.
    "src/migpilot/agent/deviceplugin/slices.py": ("x_container_allocation",),
    # The Allocate path of the gRPC shell: one consistent snapshot, the checks above on every
    # path (slices, replicas, plain, unified), replicas mapped back to their real devices, the
    # ledger written before the answer.
    "src/migpilot/agent/deviceplugin/serving.py": (
        "x_held_key",
        "xǁ_ResourceServerǁallocate",
        "xǁDevicePluginǁrecord_allocated",
        "xǁDevicePluginǁallocate_containers",
        "xǁDevicePluginǁ_snapshot",
        "xǁDevicePluginǁ_allocate_shared",
        "xǁDevicePluginǁ_allocate_gpu",
        "xǁDevicePluginǁ_decided_answer",
        "xǁDevicePluginǁ_resolve",
    ),
    # The loop's reservations (control.reconcile, the controller's and the simulator's one
    # step): expired and stolen ones dropped, pinned ones kept, and the pins that count what
    # the node has left; placements without CPU or memory left out.
    "src/migpilot/planning/control.py": (
        "x_reconcile",
        "x__ages",
        "x__expired",
        "x__pins",
        "x_lets_go",
        "x__short",
        "x__held_back",
        "x__fitting",
        # Scaling out: only pods no plan could place, after the grace, once each (no
        # autoscaler loop).
        "x__may_scale_out",
        "x__scale_out",
    ),
    # The controller's side of them: what it reads of a reservation (made, stolen, what it
    # still waits for, what it asks and what is taken of its node), and the writes that
    # release and expire reservations.
    "src/migpilot/controller/running.py": (
        "xǁControllerǁ_release",
        "xǁControllerǁ_expire",
    ),
    "src/migpilot/controller/pinning.py": (
        "x_without_stale",
        "x_pinned_to",
        "x__existing",
        "x_made",
        "x__served_slices",
        "x_stolen",
        "x_missing",
        "x_asks",
        "x_taken",
        "x__reserved",
        # Whole GPUs: the reservations a spec keeps, a reservation stolen by the count of bound
        # whole-GPU pods, the GPUs the status shows whole (a pin waits for them).
        "x__whole_given",
        "x__whole_overrun",
        "x_whole_now",
    ),
}
"""Per file, the functions in scope, as mutmut names them (``x_name`` for a function,
``xǁClassǁmethod`` for a method)."""

_CONTROLLER_TESTS = (
    "tests/unit/test_control.py",
    "tests/unit/test_reserved_safety.py",
    "tests/unit/test_controller_pinning.py",
    "tests/unit/test_controller_unified.py",
    "tests/unit/test_one_loop.py",
    "tests/unit/test_controller_dynamic.py",
    "tests/unit/test_whole_gate.py",
)
TESTS: dict[str, tuple[str, ...]] = {
    # The loop's rules, by pure tests and direct calls of the controller's passes (milliseconds
    # each); the loop's own tests (tests/unit/test_controller_running.py) wait on real time.
    "src/migpilot/planning/control.py": _CONTROLLER_TESTS,
    "src/migpilot/controller/running.py": _CONTROLLER_TESTS,
    "src/migpilot/controller/pinning.py": _CONTROLLER_TESTS,
}
"""Per file, the tests its mutants run against when not the whole selection of pyproject.toml
(``pytest_add_cli_args_test_selection``): what proves the rules, without the slow loop tests
that would only prove them again at many times the cost."""

_EQUIVALENT: dict[str, tuple[str, str]] = {
    **{
        f"migpilot.controller.pinning.x_without_stale__mutmut_{n}": (
            call.replace(", None)", ", )"),
            f"Mutant: {call} without its last argument, None: that is the field's default "
            "(reserved_for: str | None = None), so the same frozen dataclass is built.",
        )
        for n, call in (
            (27, "gpulayouts.InstanceSpec(i.profile, i.start, None)"),
            (40, "gpulayouts.SliceSpec(sl.id, sl.memory_gb, sl.cores, None)"),
        )
    },
    "migpilot.planning.validation.x__check_pods__mutmut_7": (
        "out = [",
        "Mutant: `out += [...]` (the pod-affinity problems) as `out = [...]`: out is the empty "
        "list it was made as two lines up (nothing is added in between), so the same list.",
    ),
}
"""Mutants that change nothing observable: per mutant, what its one mutated line holds (as
``mutmut show`` prints it; checked at each run: mutmut numbers a function's mutants in order, so
an edit of the function renumbers them, and a stale entry would exclude a real mutant) and the
argument why it is equivalent."""
EQUIVALENT: dict[str, str] = {name: why for name, (_, why) in _EQUIVALENT.items()}
"""Mutants that change nothing observable, each with the argument why (excluded, not hidden)."""


def _stale(names: list[str]) -> list[str]:
    """The entries of :data:`EQUIVALENT` among ``names`` whose mutant no longer mutates to the
    line the argument is about."""
    from mutmut.mutation.diff_apply import get_diff_for_mutant  # noqa: PLC0415 - a dev tool

    out: list[str] = []
    with contextlib.chdir(ROOT):
        for name in names:
            added = [
                line[1:].strip()
                for line in get_diff_for_mutant(name).splitlines()
                if line.startswith("+") and not line.startswith("+++")
            ]
            want = _EQUIVALENT[name][0]
            if len(added) != 1 or want not in added[0]:
                out.append(f"{name}: mutates to {added}, not to {want!r}")
    return out


def _module(path: str) -> str:
    return path.removeprefix("src/").removesuffix(".py").replace("/", ".")


def _patterns(files: list[str]) -> list[str]:
    return [f"{_module(f)}.{fn}__mutmut_*" for f in files for fn in SCOPE[f]]


def _statuses() -> dict[str, str]:
    from mutmut.stats import status_by_exit_code  # noqa: PLC0415 - a dev tool, imported here

    out: dict[str, str] = {}
    for meta in (ROOT / "mutants").rglob("*.py.meta"):
        data = json.loads(meta.read_text())
        for name, code in data["exit_code_by_key"].items():
            out[name] = "not checked" if code is None else status_by_exit_code[code]
    return out


_CHILD = """
import dataclasses, sys
from mutmut import configuration
configuration._config = dataclasses.replace(
    configuration._load_config(), pytest_add_cli_args_test_selection=sys.argv[1].split(",")
)
from mutmut.__main__ import cli
cli(sys.argv[2:])
"""
"""mutmut with its test selection replaced by the first argument (comma-separated)."""


def _run(patterns: list[str], tests: list[str]) -> subprocess.CompletedProcess[str]:
    args = ["run", "--max-children", "1", *patterns]
    command = [sys.executable, "-c", _CHILD, ",".join(tests), *args]
    return subprocess.run(command, cwd=ROOT, check=False, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="*", help="run the files whose path contains these words")
    args = parser.parse_args(argv)
    files = [f for f in SCOPE if not args.only or any(w in f for w in args.only)]
    groups: dict[tuple[str, ...], list[str]] = {}
    for f in files:
        groups.setdefault(TESTS.get(f, tuple(_tests())), []).append(f)
    started = time.monotonic()
    statuses: dict[str, str] = {}
    runs: list[dict[str, object]] = []
    for tests, group in groups.items():
        patterns = _patterns(group)
        begun = time.monotonic()
        run = _run(patterns, list(tests))
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-4000:] + run.stderr[-4000:])
            return run.returncode
        # Read now: the next group's run (another test selection) resets mutmut's results.
        statuses.update(
            (n, st) for n, st in _statuses().items() if any(fnmatch.fnmatch(n, p) for p in patterns)
        )
        runs.append(
            {
                "files": group,
                "tests": list(tests),
                "mutmut_command": "mutmut run --max-children 1 " + " ".join(patterns),
                "run_time_s": round(time.monotonic() - begun, 1),
            }
        )
    elapsed = time.monotonic() - started
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    per_file: dict[str, object] = dict(old.get("files", {})) if args.only else {}
    survivors: list[str] = []
    stale: list[str] = []
    print(f"{'file':48} {'mutants':>8} {'killed':>7} {'survived':>9} {'excluded':>9}")
    for f in files:
        mine = _patterns([f])
        names = sorted(n for n in statuses if any(fnmatch.fnmatch(n, p) for p in mine))
        excluded = {n: EQUIVALENT[n] for n in names if n in EQUIVALENT}
        stale += _stale(list(excluded))
        tested = [n for n in names if n not in excluded]
        killed = [n for n in tested if statuses[n] in ("killed", "timeout")]
        left = [f"{n}: {statuses[n]}" for n in tested if statuses[n] not in ("killed", "timeout")]
        survivors += left
        per_file[f] = {
            "functions": list(SCOPE[f]),
            "tests": list(TESTS.get(f, ())) or "all (pyproject.toml)",
            "mutants": len(names),
            "killed": len(killed),
            "survivors": len(left),
            "survivor_names": left,
            "excluded": excluded,
        }
        print(f"{f:48} {len(names):8} {len(killed):7} {len(left):9} {len(excluded):9}")
    totals = {
        k: sum(int(v[k]) for v in per_file.values())  # type: ignore[index]
        for k in ("mutants", "killed", "survivors")
    }
    RESULTS.write_text(
        json.dumps(
            {
                "tool": "mutmut",
                "version": metadata.version("mutmut"),
                "command": " ".join(["python bench/mutation.py", *args.only]),
                "runs": runs,
                "tests": _tests(),
                "run_time_s": round(elapsed, 1),
                **totals,
                "excluded": sum(len(v["excluded"]) for v in per_file.values()),  # type: ignore[index]
                "files": per_file,
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    for s in survivors:
        print("survived:", s)
    for s in stale:
        print("stale EQUIVALENT entry (renumber it):", s)
    print(f"wrote {RESULTS.relative_to(ROOT)} ({elapsed:.0f} s)")
    return 1 if survivors or stale else 0


def _tests() -> list[str]:
    import tomllib  # noqa: PLC0415

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return list(config["tool"]["mutmut"]["pytest_add_cli_args_test_selection"])


if __name__ == "__main__":
    sys.exit(main())
