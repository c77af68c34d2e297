#!/usr/bin/env bash
# Every test of the project, on a machine without a GPU: the Rust workspace in debug and in
# release (which also builds libcistern.so and the fake libcuda.so), then the Python package's
# tests through ctypes, once on the simulated GPU (CISTERN_DRIVER=sim) and once through the real
# CUDA backend over the fake libcuda (tests only: it is never put on the library path anywhere
# else).
set -euo pipefail
cd "$(dirname "$0")/.."

echo "== cargo test --workspace"
cargo test --workspace

# Users run release builds (libcistern.so, the wheel): every test must pass there too
# (inlining and optimisation change what a backtrace sees, and how fast races run).
echo "== cargo test --workspace --release"
cargo test --workspace --release

target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
lib="$target_dir/debug/libcistern.so"
# Always (a no-op when fresh): a libcistern.so left by an older build must not be what is tested.
cargo build -p cistern-ffi

# pytest, in a project-local virtual environment when the system has none.
py=python3
if ! "$py" -c 'import pytest' 2>/dev/null; then
  venv="$target_dir/pytest-venv"
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet pytest
  fi
  py="$venv/bin/python"
fi

run_pytest() {
  # Exit code 5 means every test was skipped or none collected: report it, do not fail.
  set +e
  "$py" -m pytest -q pytorch-plugin/tests "$@"
  rc=$?
  set -e
  if [ $rc -ne 0 ] && [ $rc -ne 5 ]; then exit $rc; fi
}

# The native allocator's compile tests build against torch's headers, fetched without torch by
# scripts/torch-headers.sh (.ci/run runs it); without them those tests skip and say so.
th="$target_dir/torch-headers"
if [ -z "${CISTERN_TORCH_TORCH_DIRS:-}" ]; then
  dirs=""
  for t in "$th/torch-newest/torch" "$th/torch-2.5/torch"; do
    [ -f "$t/lib/libc10.so" ] && dirs="${dirs:+$dirs:}$t"
  done
  [ -n "$dirs" ] && export CISTERN_TORCH_TORCH_DIRS="$dirs"
fi
if [ -z "${CISTERN_TORCH_CUDA_INCLUDE:-}" ] && [ -d "$th/cuda-runtime" ]; then
  inc=$(dirname "$(find "$th/cuda-runtime" -name cuda_runtime_api.h | head -1)")
  [ -f "$inc/crt/host_defines.h" ] && export CISTERN_TORCH_CUDA_INCLUDE="$inc"
fi

# The library publishes each process in the registry; the tests' processes go to a private
# directory, not the user's (/dev/shm/cistern-<uid>), and it is removed at the end.
regdir=$(mktemp -d)
trap 'rm -rf "$regdir" "${fakedir:-}"' EXIT

echo "== pytest (simulated GPU)"
CISTERN_CONF="registry_dir:$regdir/sim" CISTERN_LIB="$lib" CISTERN_DRIVER=sim run_pytest

# The fake libcuda is built as libcistern_fakecuda.so (never as libcuda.so inside target/, which
# cargo puts on the library path of every test: it would shadow a real driver). Here it is copied
# under the driver's names into a private directory for these runs only.
# Always built here (a no-op when fresh): `cargo test` need not leave an up-to-date copy in
# target/debug, only in target/debug/deps.
cargo build -p cistern-fakecuda
fake="$target_dir/debug/libcistern_fakecuda.so"
fakedir=$(mktemp -d)
cp "$fake" "$fakedir/libcuda.so"
ln -sf libcuda.so "$fakedir/libcuda.so.1"
with_fake() {
  LD_LIBRARY_PATH="$fakedir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" CISTERN_FAKECUDA=1 "$@"
}

echo "== the CUDA backend's GPU tests, over the fake libcuda"
with_fake cargo test -p cistern --test cuda_driver

echo "== pytest (CUDA backend over the fake libcuda)"
CISTERN_CONF="registry_dir:$regdir/cuda" CISTERN_LIB="$lib" CISTERN_DRIVER=cuda with_fake run_pytest
