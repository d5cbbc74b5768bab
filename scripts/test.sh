#!/usr/bin/env bash
# Run the test suite: sets up .venv (see _setup.sh) and runs pytest on every core.
# Extra arguments go to pytest, e.g. scripts/test.sh -k store
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" test
cd "$REPO"
exec "$PY" -m pytest -n auto "$@"
