#!/usr/bin/env bash
# Download, here, the wheels bench/gpu/run.sh installs offline on the GPU machine.
#   bash bench/gpu/pack.sh [PYTHON_VERSION=3.12] [DEST=.gpu-wheels]
# Pure-Python wheels and manylinux x86-64 builds for CPython PYTHON_VERSION, no dependencies resolved
# (bench/gpu/wheels.txt names every one). Fails if the wheels plus the tracked tree exceed the 64 MiB
# that travels with a device call.
set -euo pipefail
cd "$(dirname "$0")/../.."
pyver=${1:-3.12}
dest=${2:-.gpu-wheels}
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
rm -rf "$dest"
mkdir -p "$dest"
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64 any; do
  platforms+=(--platform "$p")
done
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  "${platforms[@]}" -d "$dest" -r bench/gpu/wheels.txt
wheels=$(du -sb "$dest" | cut -f1)
if git rev-parse --git-dir >/dev/null 2>&1; then  # what a device call sends: tracked + untracked-not-ignored
  tree=$(git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
else
  tree=$(du -sb --exclude="$dest" --exclude=.venv . | cut -f1)
fi
limit=$((64 * 1024 * 1024))
awk -v n="$(ls "$dest"/*.whl | wc -l)" -v py="$pyver" -v d="$dest" -v w="$wheels" -v t="$tree" 'BEGIN {
  printf "packed %d wheels for CPython %s into %s: %.1f MiB (+ tracked tree %.1f MiB = %.1f of 64 MiB)\n",
    n, py, d, w / 1048576, t / 1048576, (w + t) / 1048576 }'
if [ $((wheels + tree)) -gt $limit ]; then
  echo "too big: the wheels and the tree must fit in 64 MiB" >&2
  exit 1
fi
