#!/usr/bin/env bash
# The main job: a 2-rank torchrun training run on 127.0.0.1 that checkpoints every few steps,
# crashes on one rank, is restarted by torchrun, resumes from the newest complete checkpoint, and
# finishes with weights bit-identical to an uninterrupted run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_setup.sh" test
cd "$REPO"
exec "$PY" scripts/run_demo.py "$@"
