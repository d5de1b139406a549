"""The hostile-input suite's record: which hostile inputs were tried and what became of each.

Run: ``.venv/bin/python bench/hostile.py`` (after ``./scripts/test`` has set up ``.venv`` and
built the control plane). It runs ``tests/e2e/test_hostile.py`` on a real control plane (the
same test CI runs) with ``MIGPILOT_HOSTILE_RESULTS`` set, so the test writes its record to
``bench/results/hostile.json``: each case (pods and a Node with quantities of huge exponent,
malformed and oversized AdmissionReviews, GpuLayouts with bad specs, device-plugin configs with
bombs), the API server's and migpilot's answer, and whether the system kept serving MIG pods.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "hostile.json"


def main() -> int:
    env = {**os.environ, "MIGPILOT_HOSTILE_RESULTS": str(RESULTS)}
    command = [sys.executable, "-m", "pytest", "-q", "tests/e2e/test_hostile.py"]
    code = subprocess.call(command, cwd=ROOT, env=env)
    if RESULTS.exists():
        print(RESULTS.read_text())
    return code


if __name__ == "__main__":
    sys.exit(main())
