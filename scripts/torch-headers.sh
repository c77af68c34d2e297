#!/usr/bin/env bash
# Fetches what the native allocator's compile tests (pytorch-plugin/tests/test_native.py) build
# against, from PyPI, without installing torch: the C++ headers and libc10.so of the newest torch
# wheel (with its torch/cuda/_memory_viz.py, for the snapshot tests) and of torch 2.5.1 (the oldest the native allocator supports), and CUDA's runtime headers
# (nvidia-cuda-runtime with nvidia-cuda-crt, the part the runtime wheel alone lacks). Only those
# files are unpacked; the wheels are deleted after. Cached under $CISTERN_TORCH_HEADERS (default
# <target>/torch-headers): a second run downloads nothing.
#
# scripts/test.sh uses them when they are there (CISTERN_TORCH_TORCH_DIRS,
# CISTERN_TORCH_CUDA_INCLUDE); without them those tests skip with a message. Exit status 0 when
# every part is in place, 1 when some could not be fetched (offline, say).
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir=$(cargo metadata --format-version 1 --no-deps 2>/dev/null |
  python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])' 2>/dev/null ||
  echo target)
dest=${CISTERN_TORCH_HEADERS:-$target_dir/torch-headers}
mkdir -p "$dest"

# name, pip requirement, members to unpack (prefixes inside the wheel)
fetch() {
  local name="$1" spec="$2"
  shift 2
  # The marker lists the members unpacked: a cache made with fewer is fetched again.
  if [ -f "$dest/$name/.done" ] && [ "$(cat "$dest/$name/.done")" = "$*" ]; then
    return 0
  fi
  rm -rf "$dest/$name"
  mkdir -p "$dest/$name/wheel"
  if ! python3 -m pip download --no-deps --quiet --disable-pip-version-check \
    -d "$dest/$name/wheel" "$spec"; then
    echo "torch-headers: could not download $spec" >&2
    rm -rf "$dest/$name"
    return 1
  fi
  python3 - "$dest/$name" "$@" <<'EOF'
import glob, os, sys, zipfile
out, prefixes = sys.argv[1], sys.argv[2:]
(whl,) = glob.glob(os.path.join(out, "wheel", "*.whl"))
with zipfile.ZipFile(whl) as z:
    for m in z.namelist():
        if any(m.startswith(p) for p in prefixes):
            z.extract(m, out)
EOF
  rm -rf "$dest/$name/wheel"
  echo "$*" > "$dest/$name/.done"
}

ok=0
# torch/cuda/_memory_viz.py (pure Python, no torch import) checks cistern's snapshots the way
# PyTorch's memory viewer tools read them (test_snapshot.py).
fetch torch-newest torch torch/include/ torch/lib/libc10.so torch/cuda/_memory_viz.py || ok=1
fetch torch-2.5 torch==2.5.1 torch/include/ torch/lib/libc10.so || ok=1
fetch cuda-runtime nvidia-cuda-runtime nvidia/ || ok=1
fetch cuda-crt nvidia-cuda-crt nvidia/ || ok=1
# One include directory with both (the crt wheel's files go under the runtime's include/).
if [ -d "$dest/cuda-runtime/nvidia" ] && [ -d "$dest/cuda-crt/nvidia" ]; then
  inc=$(dirname "$(find "$dest/cuda-runtime/nvidia" -name cuda_runtime_api.h | head -1)")
  crt=$(dirname "$(find "$dest/cuda-crt/nvidia" -name host_defines.h -path '*crt*' | head -1)")
  mkdir -p "$inc/crt"
  cp -n "$crt"/* "$inc/crt/" 2>/dev/null || true
fi
exit $ok
