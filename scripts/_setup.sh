# Sourced by demo.sh and test.sh: create/use the virtual environment and install localckpt.
# torch is installed first, pinned, and only when it is not importable, so pip never resolves an
# unpinned torch (which would pull several GB of CUDA packages on a machine without a local wheel).
#   LOCALCKPT_TORCH_SPEC   torch requirement to install when missing (default torch==2.13.0)
#   LOCALCKPT_VENV         virtual environment directory (default <repo>/.venv)
#   PYTHON                 interpreter that creates the venv (default python3)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LOCALCKPT_VENV:-$REPO/.venv}"
TORCH_SPEC="${LOCALCKPT_TORCH_SPEC:-torch==2.13.0}"
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "${PYTHON:-python3}" -m venv "$VENV"
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[setup] installing $TORCH_SPEC"
  "$PY" -m pip install -q "$TORCH_SPEC" 2>&1 | grep -v "is ignored: it is neither" || true
  "$PY" -c "import torch" || { echo "[setup] installing $TORCH_SPEC failed" >&2; exit 1; }
fi
echo "[setup] installing localckpt[$1] into $VENV"
"$PY" -m pip install -q -e "$REPO[$1]" 2>&1 | grep -v "is ignored: it is neither" || true
"$PY" -c "import localckpt, torch; print('[setup] localckpt', localckpt.__version__, 'torch', torch.__version__)"
