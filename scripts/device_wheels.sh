#!/usr/bin/env bash
# Here, before scripts/device_check.sh runs on a lent GPU machine: download into .whl/ (ignored by
# git through .git/info/exclude) the wheels its Python 3.12 lacks, at the versions this checkout's
# .venv holds. The device tool carries .whl/ there (carry=[".whl"]).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
PY=.venv/bin/python
pins=$("$PY" - <<'PY'
from importlib.metadata import version
names = ["zarr", "numcodecs", "donfig", "google-crc32c", "crc32c", "crc32c-rs", "nvidia-ml-py",
         "pyyaml", "typing_extensions", "packaging", "pytest", "pluggy", "iniconfig"]
print(" ".join(f"{n}=={version(n)}" for n in names))
PY
)
platforms=()
for n in 2_28 2_27 2_17 2014 1 2_24 2_31 2_34; do
  case $n in 2014|1) platforms+=(--platform "manylinux${n}_x86_64");;
             *) platforms+=(--platform "manylinux_${n}_x86_64");; esac
done
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d .whl $pins
ls .whl
du -sh .whl
