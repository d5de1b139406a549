"""The Dockerfile builds what the README and the Helm chart run (docker is not available here,
so its inputs are checked instead): every file it copies exists and is not ignored, it installs
the locked runtime dependencies with their hashes (no dev tools), runs as a non-root user, and
its entry point is the ``migpilot`` console script."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _instructions(name: str) -> list[str]:
    joined = DOCKERFILE.replace("\\\n", " ")
    return [
        line.split(None, 1)[1]
        for line in joined.splitlines()
        if line.strip() and not line.lstrip().startswith("#") and line.split()[0] == name
    ]


def test_every_copied_path_exists_and_is_in_the_build_context() -> None:
    allowed = [
        line[1:].rstrip("/")
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for args in _instructions("COPY"):
        if args.startswith("--from="):
            continue
        *sources, _ = args.split()
        for source in sources:
            assert (REPO / source).exists(), source
            assert source.rstrip("/") in allowed, f"{source} is excluded by .dockerignore"


_PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)((?:\s*\\\n\s+--hash=\S+)+)", re.MULTILINE)
DEV_TOOLS = (
    "pytest",
    "hypothesis",
    "ruff",
    "mypy",
    "import-linter",
    "grpcio-tools",
    "cryptography",
)


def _lock(name: str) -> dict[str, tuple[str, frozenset[str]]]:
    """Package (normalised) -> (version, hashes) of a hashed lock."""
    text = (REPO / name).read_text()
    return {
        re.sub(r"[-_.]+", "-", m[1]).lower(): (
            m[2],
            frozenset(re.findall(r"--hash=(\S+)", m[3])),
        )
        for m in _PIN.finditer(text)
    }


def test_dependencies_come_from_the_runtime_lock_with_hashes() -> None:
    runs = " ".join(" ".join(run.split()) for run in _instructions("RUN"))
    assert "--require-hashes -r requirements-runtime.lock" in runs
    assert "requirements.lock" not in runs.replace("requirements-runtime.lock", "")
    assert "--no-deps --no-build-isolation ." in runs
    # Building without isolation uses the lock's setuptools: it must be there.
    assert "setuptools" in _lock("requirements-runtime.lock")


def test_the_runtime_lock_is_the_dev_lock_without_the_dev_tools() -> None:
    """Same versions and hashes as requirements.lock (what the tests ran with), every runtime
    dependency of pyproject.toml, and none of the dev tools (scripts/lock writes it)."""
    dev, runtime = _lock("requirements.lock"), _lock("requirements-runtime.lock")
    assert len(runtime) >= 20
    for name, pin in runtime.items():
        assert dev.get(name) == pin, name
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name = re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", requirement)[0]).lower()
        assert name in runtime, name
    for tool in DEV_TOOLS:
        assert tool in dev and tool not in runtime, tool


def test_it_runs_as_a_non_root_user() -> None:
    (user,) = _instructions("USER")
    assert user.strip() not in ("0", "root")


def test_the_entry_point_is_the_migpilot_console_script() -> None:
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    (entry,) = _instructions("ENTRYPOINT")
    assert re.fullmatch(r'\["(\w+)"\]', entry.strip()) is not None
    assert entry.strip() == '["migpilot"]' and "migpilot" in scripts


def test_the_chart_runs_the_image_with_existing_commands() -> None:
    templates = REPO / "deploy" / "helm" / "migpilot" / "templates"
    commands = set()
    for path in templates.glob("*.yaml"):
        commands |= set(re.findall(r"args:\n\s+- (\w+)", path.read_text()))
    assert commands == {"controller", "webhook", "agent"}
