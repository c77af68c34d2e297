#!/usr/bin/env bash
# Regenerates the seed corpus under fuzz/corpus (committed): the Python part writes inputs other
# programs write (PyTorch's pickles and profiler JSON, RMM logs, MiniMalloc CSVs), the Rust
# example those cistern writes itself (registry records, its own trace format).
set -euo pipefail
fuzz="$(cd "$(dirname "$0")" && pwd)"
rm -rf "$fuzz/corpus"
python3 "$fuzz/make-corpus.py" "$fuzz/corpus"
cargo run --quiet --manifest-path "$fuzz/Cargo.toml" --example make-corpus -- "$fuzz/corpus"
du -sh "$fuzz/corpus"
