#!/usr/bin/env bash
# Builds gpu-kit/ (git-ignored) for scripts/gpu-check.sh, on a machine with the Rust toolchain
# (the device machine has none). Run from the repository root:  bash scripts/build-gpu-kit.sh
# Result: gpu-kit/{driver_costs, cistern, cuda_driver (the CudaDriver's GPU tests),
#                  costs/a100-published.json, traces/*.pickle when ../shared/traces is here}
# Stripped, under 64 MiB; never contains the fake libcuda.
set -euo pipefail
cd "$(dirname "$0")/.."
KIT=gpu-kit
rm -rf "$KIT"; mkdir -p "$KIT/costs" "$KIT/traces"

cargo build --release -p cistern-benches --bin driver_costs
cargo build --release -p cistern-cli --bin cistern
exe=$(cargo test --release -p cistern --test cuda_driver --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for l in sys.stdin:
    try: m = json.loads(l)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_driver":
        print(m["executable"])' | tail -n 1)
T=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
cp "$T/release/driver_costs" "$T/release/cistern" "$KIT/"
cp "$exe" "$KIT/cuda_driver"
strip --strip-debug "$KIT/driver_costs" "$KIT/cistern" "$KIT/cuda_driver"
cp replay/costs/a100-published.json "$KIT/costs/"
traces=${CISTERN_TRACES_DIR:-../shared/traces}
if [ -d "$traces/pytorch_snapshots" ]; then
  cp "$traces"/pytorch_snapshots/*.pickle "$KIT/traces/"
fi

if find "$KIT" -name 'libcuda.so*' | grep -q .; then echo "a libcuda.so got into the kit" >&2; exit 1; fi
du -sh "$KIT"
[ "$(du -sm "$KIT" | cut -f1)" -lt 64 ] || { echo "kit over 64 MiB" >&2; exit 1; }
