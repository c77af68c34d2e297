#!/usr/bin/env bash
# Coverage-guided fuzzing with libFuzzer, on the stable toolchain (fuzz/README.md says why so).
#
#   scripts/fuzz.sh TARGET SECONDS      fuzz one target (fuzz/fuzz_targets/TARGET.rs)
#   scripts/fuzz.sh --all SECONDS       every target for SECONDS each, as many at once as
#                                       there are cores (FUZZ_JOBS=N to choose)
#   scripts/fuzz.sh --replay TARGET FILE
#                                       run one input (a reproducer) through TARGET
#   scripts/fuzz.sh --build             build every target, fuzz none (CI starts it early)
#   scripts/fuzz.sh --list              the targets
#
# Starts from the committed seeds (fuzz/corpus/TARGET) and keeps what it finds in
# fuzz/work/TARGET (not committed). Exits non-zero on a crash, a hang (an input taking over
# 1 s) or running out of memory (over 2 GiB), after printing the reproducer's path and the
# command that replays it. Needs only cargo and a C++ compiler (libfuzzer-sys builds libFuzzer).
# FUZZ_BUILD=smoke builds the targets at opt-level 1 (CI's short run: a build a minute faster,
# targets about half as fast); the default is the optimised build that campaigns want.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
fuzz="$root/fuzz"
TIMEOUT_S=1
RSS_LIMIT_MB=2048

usage() {
  sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

targets() {
  sed -n 's/^name = "\(.*\)"$/\1/p' "$fuzz/Cargo.toml" | grep -v '^cistern-fuzz$'
}

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
host="$(rustc -vV | sed -n 's/^host: //p')"
bin_dir="$fuzz/target/$host/release"

# The instrumentation cargo-fuzz asks for (`cargo fuzz build --sanitizer none
# --debug-assertions`), spelled out so that no tool has to be installed: every flag is a stable
# -C option or an LLVM option passed through one. Coverage counters and the PC table for
# libFuzzer's feedback, comparison tracing for its value profile, no branch folding (so each
# branch keeps its counter), stack depth, `--cfg fuzzing`, and overflow checks (an overflowing
# parser is a crash, not a wrong answer). `--target` keeps the flags off build scripts and
# proc macros. One codegen unit, as cargo-fuzz does in release: the sancov pass otherwise blocks
# cross-unit inlining, and the targets run several times slower.
fuzz_rustflags="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cllvm-args=-simplifycfg-branch-fold-threshold=0 \
-Cllvm-args=-sanitizer-coverage-stack-depth --cfg fuzzing -Clink-dead-code -Cdebug-assertions"
profile=(--config 'profile.release.debug="line-tables-only"')
case "${FUZZ_BUILD:-campaign}" in
  campaign) fuzz_rustflags="$fuzz_rustflags -Ccodegen-units=1" ;;
  smoke) profile+=(--config 'profile.release.opt-level=1') ;;
  *)
    echo "fuzz: FUZZ_BUILD=$FUZZ_BUILD: expected campaign (the default) or smoke" >&2
    exit 2
    ;;
esac

build() { # [target]
  echo "== building the fuzz targets${1:+ ($1)}"
  local which=(--bins)
  [ $# -eq 1 ] && which=(--bin "$1")
  RUSTFLAGS="$fuzz_rustflags${RUSTFLAGS:+ $RUSTFLAGS}" cargo build --locked \
    --manifest-path "$fuzz/Cargo.toml" --target "$host" --release "${profile[@]}" "${which[@]}"
}

summary_line() { # target log
  local t="$1" log="$2" execs cov ft speed
  execs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)"
  speed="$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -n 1)"
  cov="$(grep -o 'cov: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)"
  ft="$(grep -o 'ft: [0-9]*' "$log" | tail -n 1 | cut -d' ' -f2)"
  printf '%-16s %12s execs %8s/s  cov %6s  ft %6s\n' "$t" "${execs:-?}" "${speed:-?}" "${cov:-?}" "${ft:-?}"
}

# Fuzzes one target; its log is fuzz/work/TARGET.log, and on failure the last lines of it, the
# reproducer and the replay command go to fuzz/work/TARGET.failure (printed by the caller).
run_one() { # target seconds
  local t="$1" secs="$2"
  local seeds="$fuzz/corpus/$t" work="$fuzz/work/$t" arts="$fuzz/artifacts/$t"
  mkdir -p "$work" "$arts" "$seeds"
  local log="$fuzz/work/$t.log" failure="$fuzz/work/$t.failure"
  rm -f "$failure"
  set +e
  "$bin_dir/$t" "$work" "$seeds" -max_total_time="$secs" -timeout="$TIMEOUT_S" \
    -rss_limit_mb="$RSS_LIMIT_MB" -malloc_limit_mb="$RSS_LIMIT_MB" -artifact_prefix="$arts/" \
    -print_final_stats=1 -close_fd_mask=1 >"$log" 2>&1
  local rc=$?
  set -e
  if [ "$rc" -ne 0 ]; then
    {
      tail -n 40 "$log"
      echo
      local repro
      repro="$(ls -t "$arts" 2>/dev/null | head -n 1)"
      if [ -n "$repro" ]; then
        echo "fuzz: $t FAILED (exit $rc): reproducer $arts/$repro"
        echo "fuzz: replay it with: scripts/fuzz.sh --replay $t $arts/$repro"
      else
        echo "fuzz: $t FAILED (exit $rc) without a reproducer; the log is $log"
      fi
    } >"$failure"
    return 1
  fi
}

report() { # target: prints its summary or its failure; fails on failure
  local t="$1"
  if [ -f "$fuzz/work/$t.failure" ]; then
    cat "$fuzz/work/$t.failure" >&2
    return 1
  fi
  if [ ! -f "$fuzz/work/$t.log" ]; then
    echo "fuzz: $t did not run (no log in fuzz/work)" >&2
    return 1
  fi
  summary_line "$t" "$fuzz/work/$t.log"
}

jobs_wanted() {
  local n="${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}"
  case "$n" in
    '' | *[!0-9]* | 0)
      echo "fuzz: FUZZ_JOBS=$n: expected a whole number of jobs, at least 1" >&2
      exit 2
      ;;
  esac
  echo "$n"
}

[ $# -ge 1 ] || usage
case "$1" in
  --list)
    targets
    ;;
  --build)
    [ $# -eq 1 ] || usage
    build
    ;;
  --replay)
    [ $# -eq 3 ] || usage
    targets | grep -qx "$2" || { echo "fuzz: no target $2; the targets are: $(targets | tr '\n' ' ')" >&2; exit 2; }
    [ -f "$3" ] || { echo "fuzz: no file $3 to replay" >&2; exit 2; }
    build "$2"
    exec "$bin_dir/$2" -rss_limit_mb="$RSS_LIMIT_MB" -malloc_limit_mb="$RSS_LIMIT_MB" "$3"
    ;;
  --all)
    [ $# -eq 2 ] || usage
    jobs="$(jobs_wanted)"
    build
    all=()
    while IFS= read -r t; do all+=("$t"); done < <(targets)
    echo "== fuzzing ${#all[@]} targets for ${2}s each, $jobs at a time"
    running=0
    for t in "${all[@]}"; do
      if [ "$running" -ge "$jobs" ]; then
        wait -n || true
        running=$((running - 1))
      fi
      run_one "$t" "$2" &
      running=$((running + 1))
    done
    wait || true
    failed=0
    for t in "${all[@]}"; do
      report "$t" || failed=1
    done
    exit "$failed"
    ;;
  -*)
    usage
    ;;
  *)
    [ $# -eq 2 ] || usage
    targets | grep -qx "$1" || { echo "fuzz: no target $1; the targets are: $(targets | tr '\n' ' ')" >&2; exit 2; }
    build "$1"
    echo "== fuzzing $1 for ${2}s"
    run_one "$1" "$2" || true
    report "$1"
    ;;
esac
