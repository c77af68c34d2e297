#!/usr/bin/env bash
# Coverage-guided fuzzing with libFuzzer, on the stable toolchain (fuzz/README.md says why so).
#
#   scripts/fuzz.sh TARGET SECONDS      fuzz one target (fuzz/fuzz_targets/TARGET.rs)
#   scripts/fuzz.sh --all SECONDS       each target in turn, SECONDS each
#   scripts/fuzz.sh --replay TARGET FILE
#                                       run one input (a reproducer) through TARGET
#   scripts/fuzz.sh --list              the targets
#
# Starts from the committed seeds (fuzz/corpus/TARGET) and keeps what it finds in
# fuzz/work/TARGET (not committed). Exits non-zero on a crash, a hang (an input taking over
# 1 s) or running out of memory (over 2 GiB), after printing the reproducer's path and the
# command that replays it. Installs cargo-fuzz when it is missing.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fuzz="$root/fuzz"
CARGO_FUZZ_VERSION="0.13.2"
TIMEOUT_S=1
RSS_LIMIT_MB=2048

usage() {
  sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

targets() {
  sed -n 's/^name = "\(.*\)"$/\1/p' "$fuzz/Cargo.toml" | grep -v '^cistern-fuzz$'
}

need_cargo_fuzz() {
  if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
    export PATH="$HOME/.cargo/bin:$PATH"
  fi
  if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "== installing cargo-fuzz $CARGO_FUZZ_VERSION (cargo install)"
    cargo install cargo-fuzz --locked --version "$CARGO_FUZZ_VERSION"
  fi
}

# cargo-fuzz passes flags that stable rustc accepts only with RUSTC_BOOTSTRAP (-Z options for
# the sanitizer-coverage passes); it is set for these builds alone, never for the project's.
# No sanitizer: the code under test is safe Rust except the C ABI's pointer arguments, and
# AddressSanitizer would need the nightly-only instrumented standard library to be sound.
fuzz_flags=(--sanitizer none --debug-assertions --release)

build() {
  echo "== building the fuzz targets ($*)"
  (cd "$fuzz" && RUSTC_BOOTSTRAP=1 cargo fuzz build "${fuzz_flags[@]}" "$@")
}

summary_line() { # target log
  local t="$1" log="$2" execs cov ft speed
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  speed="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)"
  cov="$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)"
  ft="$(grep -o 'ft: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)"
  printf '%-16s %12s execs %8s/s  cov %6s  ft %6s\n' "$t" "${execs:-?}" "${speed:-?}" "${cov:-?}" "${ft:-?}"
}

run_one() { # target seconds
  local t="$1" secs="$2"
  local seeds="$fuzz/corpus/$t" work="$fuzz/work/$t" arts="$fuzz/artifacts/$t"
  mkdir -p "$work" "$arts" "$seeds"
  local log="$fuzz/work/$t.log"
  echo "== fuzzing $t for ${secs}s"
  set +e
  (cd "$fuzz" && RUSTC_BOOTSTRAP=1 cargo fuzz run "${fuzz_flags[@]}" "$t" "$work" "$seeds" -- \
    -max_total_time="$secs" -timeout="$TIMEOUT_S" -rss_limit_mb="$RSS_LIMIT_MB" \
    -malloc_limit_mb="$RSS_LIMIT_MB" -artifact_prefix="$arts/" -print_final_stats=1 \
    -close_fd_mask=1) >"$log" 2>&1
  local rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$log" >&2
    local repro
    repro="$(ls -t "$arts" 2>/dev/null | head -n 1)"
    echo >&2
    if [ -n "$repro" ]; then
      echo "fuzz: $t FAILED (exit $rc): reproducer $arts/$repro" >&2
      echo "fuzz: replay it with: scripts/fuzz.sh --replay $t $arts/$repro" >&2
    else
      echo "fuzz: $t FAILED (exit $rc) without a reproducer; the log is $log" >&2
    fi
    return 1
  fi
  summary_line "$t" "$log"
}

[ $# -ge 1 ] || usage
case "$1" in
  --list)
    targets
    ;;
  --replay)
    [ $# -eq 3 ] || usage
    need_cargo_fuzz
    file="$(cd "$(dirname "$3")" && pwd)/$(basename "$3")"
    cd "$fuzz"
    RUSTC_BOOTSTRAP=1 exec cargo fuzz run "${fuzz_flags[@]}" "$2" "$file"
    ;;
  --all)
    [ $# -eq 2 ] || usage
    need_cargo_fuzz
    build
    failed=0
    for t in $(targets); do
      run_one "$t" "$2" || failed=1
    done
    exit "$failed"
    ;;
  -*)
    usage
    ;;
  *)
    [ $# -eq 2 ] || usage
    targets | grep -qx "$1" || { echo "fuzz: no target $1; the targets are: $(targets | tr '\n' ' ')" >&2; exit 2; }
    need_cargo_fuzz
    build "$1"
    run_one "$1" "$2"
    ;;
esac
