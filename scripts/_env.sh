# Sourced by the other scripts: make sure .venv exists and matches requirements.lock.
# Idempotent and quick when nothing changed; a fresh clone gets everything it needs here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
if ! "$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' 2>/dev/null; then
    echo "migpilot needs Python 3.11 or newer (set PYTHON=/path/to/python3.11)" >&2
    exit 2
fi
VENV="$ROOT/.venv"
STAMP="$VENV/.migpilot-stamp"
WANT="$(cat requirements.lock pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
    echo "==> setting up $VENV (Python $("$PY" -c 'import platform; print(platform.python_version())'))" >&2
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --require-hashes -r requirements.lock
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps -e .
    echo "$WANT" > "$STAMP"
fi
export PATH="$VENV/bin:$PATH"
