#!/usr/bin/env bash
# Run the test suite: sets up .venv (see _setup.sh) and runs pytest on every core.
# Extra arguments go to pytest, e.g. scripts/test.sh -k store
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" test
cd "$REPO"
# --maxschedchunk 1: xdist hands out tests one at a time, so the long ones tests/conftest.py
# starts first go to every worker, not all to the first one's chunk.
exec "$PY" -m pytest -n auto --maxschedchunk 1 "$@"
