#!/usr/bin/env bash
# Shrink .gpu-kit/ (written by ../shared/tools/gpu-serving-kit) so that it and the working tree
# fit the GPU machine's 64 MiB carry: its numpy wheel (18 MB, zip) becomes a tar.xz without
# numpy's own tests (~8 MB), and install.sh unpacks that in place of pip-installing the wheel.
# Run from the project root after the kit is written; idempotent. (The tree's tracked files were
# 21 MiB and the kit 46 MiB on 2026-11-28: 67 MiB, over the limit.)
set -euo pipefail
kit=.gpu-kit
wheel=$(ls "$kit"/numpy-*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  echo "slim_gpu_kit: no numpy wheel in $kit (already slim?)"; exit 0
fi
tarball="$kit/$(basename "$wheel" | cut -d- -f1-2)-notests.tar.xz"
work=$(mktemp -d)
python3 -m zipfile -e "$wheel" "$work"
tar cJf "$tarball" --exclude='*/tests/*' -C "$work" .
rm -rf "$work" "$wheel"
python3 - "$kit/install.sh" "$(basename "$tarball")" <<'PY'
import re, sys
path, tarball = sys.argv[1], sys.argv[2]
s = open(path).read()
new = f'{{ python3 -m pip uninstall -y -q numpy; tar xJf "$kit/{tarball}" -C "$sp"; }}'
s, n = re.subn(r'python3 -m pip install -q --no-deps --no-index --force-reinstall "\$kit"/numpy-[^\n]*\.whl', new, s)
if n != 1:
    sys.exit(f"slim_gpu_kit: install.sh's numpy line not found in {path}")
open(path, "w").write(s)
PY
du -sh "$kit"
