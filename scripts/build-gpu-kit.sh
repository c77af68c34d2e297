#!/usr/bin/env bash
# Builds gpu-kit/ (git-ignored) for scripts/gpu-check.sh, on a machine with the Rust toolchain
# (the device machine has none, and maybe no compiler). Run from the repository root:
#     bash scripts/build-gpu-kit.sh
# Result, stripped of debug info, under 64 MiB, never holding a libcuda (real or fake):
#   gpu-kit/driver_costs      the driver's per-call table (cistern-benches, release)
#   gpu-kit/cuda_driver       CudaDriver's tests (allocator/tests/cuda_driver.rs, release)
#   gpu-kit/cudarc_kernel     the cudarc example (allocator/examples/cudarc_kernel.rs, release)
#   gpu-kit/cistern           the CLI (cistern replay --costs), release
#   gpu-kit/libcistern.so     the C ABI (cistern-ffi, release): pairbench's and PyTorch's
#   gpu-kit/pairbench         scripts/gpu/pairbench.c, compiled here when gcc is here (else
#                             gpu-check.sh compiles it on the device, or skips that step)
#   gpu-kit/holder            cli/tests/c/holder.c (gcc here too): holds tagged memory through
#                             libcistern.so for the nvml_ps step
#   gpu-kit/pytorch-plugin/   the cistern_torch package's sources (CISTERN_LIB names the .so)
#   gpu-kit/costs/            the published cost table; gpu-kit/traces/ the PyTorch snapshots
#                             of $CISTERN_TRACES_DIR (default ../shared/traces) when there
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=gpu-kit
rm -rf "$KIT"
mkdir -p "$KIT/costs" "$KIT/traces"

# The path of the executable cargo reports for target NAME, from --message-format=json on stdin.
artifact() {
  python3 -c 'import json, sys
name = sys.argv[1]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == name:
        print(m["executable"])' "$1" | tail -n 1
}

cargo build --release -p cistern-benches --bin driver_costs -p cistern-cli --bin cistern
cargo build --release -p cistern-ffi --lib
exe=$(cargo test --release -p cistern --test cuda_driver --no-run --message-format=json | artifact cuda_driver)
example=$(cargo build --release -p cistern --example cudarc_kernel --message-format=json | artifact cudarc_kernel)
T=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
cp "$T/release/driver_costs" "$T/release/cistern" "$T/release/libcistern.so" "$KIT/"
cp "$exe" "$KIT/cuda_driver"
cp "$example" "$KIT/cudarc_kernel"
strip --strip-debug "$KIT/driver_costs" "$KIT/cistern" "$KIT/libcistern.so" "$KIT/cuda_driver" \
  "$KIT/cudarc_kernel"

if command -v gcc > /dev/null; then
  gcc -O2 -Wall -Wextra -o "$KIT/pairbench" scripts/gpu/pairbench.c -ldl
  # Linked to the kit's libcistern.so, found there at run time (LD_LIBRARY_PATH).
  gcc -O2 -std=c11 -D_POSIX_C_SOURCE=200809L -o "$KIT/holder" cli/tests/c/holder.c \
    -I ffi/include -L "$KIT" -lcistern
else
  echo "no gcc here: gpu-check.sh compiles pairbench on the device if it can; no holder" >&2
fi

mkdir -p "$KIT/pytorch-plugin"
cp -r pytorch-plugin/cistern_torch "$KIT/pytorch-plugin/"
find "$KIT/pytorch-plugin" -name '__pycache__' -prune -exec rm -rf {} +
rm -f "$KIT"/pytorch-plugin/cistern_torch/*.so # CISTERN_LIB names the kit's libcistern.so

cp replay/costs/a100-published.json "$KIT/costs/"
traces=${CISTERN_TRACES_DIR:-../shared/traces}
if [ -d "$traces/pytorch_snapshots" ]; then
  cp "$traces"/pytorch_snapshots/*.pickle "$KIT/traces/"
fi

if find "$KIT" \( -name 'libcuda.so*' -o -name '*fakecuda*' \) | grep -q .; then
  echo "a libcuda.so got into the kit" >&2
  exit 1
fi
# The device's glibc must be at least the newest version these binaries ask for.
glibc=$(objdump -T "$KIT"/driver_costs "$KIT"/cuda_driver "$KIT"/cudarc_kernel "$KIT"/cistern \
  "$KIT"/libcistern.so 2> /dev/null | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n 1)
echo "the kit needs ${glibc:-an unknown glibc} or newer on the device"
du -sh "$KIT"
[ "$(du -sm "$KIT" | cut -f1)" -lt 64 ] || {
  echo "kit over 64 MiB" >&2
  exit 1
}
