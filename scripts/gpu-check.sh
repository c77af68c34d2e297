#!/usr/bin/env bash
# cistern on a real GPU, in one call. Build the kit first on a machine with Rust
# (bash scripts/build-gpu-kit.sh), then on the device machine, from the repository root with
# gpu-kit/ copied along:
#     OUT=/some/empty/dir bash scripts/gpu-check.sh
# Steps, most important first; each runs under `timeout`, capped by its own limit and by what is
# left of BUDGET_S (default 400 s, under the 8 minutes the device allows, with room for a rerun
# of a few steps); a step that does not fit is recorded as skipped, never the summary:
#   env                  the GPU, driver and tools (read-only queries)
#   driver_costs         the driver's per-call table -> $OUT/costs.json (cistern replay --costs)
#   cuda_driver          CudaDriver's GPU tests (gpu_*) on the device; a "skipping:" is a failure
#   capture_rules        what the driver allows while a stream captures a graph, per capture
#                        mode and thread (scripts/gpu/capture_rules.py): the fake's rules' evidence;
#                        fails when an answer differs from tests/fakecuda/capture-rules-h200.json
#   pool_vmm             the pool's cache-hit pair against the driver's cuMemAlloc+cuMemFree, cold
#                        growth, 1 GiB moved to a second stream with its host waits (pairbench)
#   pool_novmm           the same with CISTERN_CONF=vmm:false (the cuMemAlloc path)
#   nvml_ps              cistern ps / leaks / doctor against the real NVML: a process holding
#                        1 GiB through libcistern.so, joined with NVML's entry for it, then
#                        killed and accounted for (scripts/gpu/nvml_check.py)
#   cudarc_kernel        the cudarc example: pooled buffers as kernel arguments on two streams
#   torch_train_native   PyTorch, its own allocator: a small training loop's losses, twice
#   torch_shim           builds cistern_torch's OOM shim once (C++, cached); when that fails the
#                        cistern steps run with CISTERN_TORCH_SHIM=0 (OOM after the fact)
#   torch_train_cistern  the same loop with cistern: the same losses? peak reserved and
#                        torch.empty+del cost side by side
#   torch_oom            OOM raises torch.OutOfMemoryError (a huge request, a memory fraction)
#   torch_record_stream  record_stream across two streams (with a control that must corrupt)
#   torch_snapshot       cistern's snapshot through PyTorch's memory viewer (_memory_viz)
#   torch_ipc            a cistern tensor shared with another process (torch.multiprocessing)
#   torch_graphs         CUDA graph capture and replay under cistern; in native mode the graph
#                        pool's reserved_bytes_by_private_pools while it lives and once reset
#   torch_graph_trees    torch.compile(mode="reduce-overhead"): graph trees' checkpoints
#   torch_memory_apis    native mode: torch.cuda.memory_stats/allocated/summary/snapshot and the
#                        peak and accumulated resets answer from cistern; a record_function
#                        range reaches the history's external_annotations
#   plugin_pytest        pytorch-plugin/tests' GPU tests (test_gpu_*), when pytest is there
#   replay_measured      the traces replayed (simulated GPU) priced with the measured table
# A step passes with exit status 0, is skipped with 77 (its reason is the last line of its
# stderr: a tool or the kit's file is missing), fails otherwise, and times out at its limit.
# Results: $OUT/steps.tsv (one line per step: name, result, rc, seconds, limit, key numbers,
# note), $OUT/<step>.out and .log (stdout, stderr), $OUT/costs.json, and $OUT/summary.txt, the
# table printed last, made from steps.tsv only. Exit status: 0 when no step failed or timed out,
# 1 otherwise, 2 when the kit is missing, 3 when it refuses to run over a fake driver.
#
# Environment (paths relative to the repository root): KIT (default gpu-kit), OUT (default
# gpu-out), BUDGET_S, ONLY=step,step (rerun just these; the others are recorded as skipped),
# PYTHON (default python3).
#
# It never runs over cistern's fake libcuda (tests/fakecuda): it refuses (exit 3) when
# CISTERN_FAKECUDA is set, when the kit holds any libcuda.so*, when a directory on
# LD_LIBRARY_PATH or a file in LD_PRELOAD is the fake, or when the libcuda that ldconfig or the
# dynamic loader would pick (libcuda.so or libcuda.so.1) is; the fake is recognised by its
# content, the string "cistern-fakecuda". Tests: benches/tests/gpu_check.rs (it sources this
# file: its functions are defined and nothing runs when it is sourced).
set -u

GPU_CHECK_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
FAKE_MARK=cistern-fakecuda
export SKIP_RC=77 # a step that exits with this was skipped (its reason: last stderr line)
MIN_STEP_S=${MIN_STEP_S:-5}       # a step with less than this left is skipped for budget
SUMMARY_RESERVE_S=${SUMMARY_RESERVE_S:-10}

# ---- the guard: the real driver only ------------------------------------------------------------

# is_fake FILE: whether FILE is cistern's fake driver (by content, whatever its name).
is_fake() {
  [ -f "$1" ] && grep -qaF "$FAKE_MARK" "$1" 2>/dev/null
}

# loader_libcuda [NAME]: the file the dynamic loader maps for dlopen(NAME) (default
# libcuda.so.1, the CUDA runtime's; cudarc tries libcuda.so first) with this environment; empty
# when none loads or there is no python3 to ask.
loader_libcuda() {
  command -v "${PYTHON:-python3}" > /dev/null 2>&1 || return 0
  "${PYTHON:-python3}" - "${1:-libcuda.so.1}" 2> /dev/null << 'PY' || true
import ctypes, sys
try:
    ctypes.CDLL(sys.argv[1])
except OSError:
    raise SystemExit(0)
for line in open("/proc/self/maps"):
    path = line.split()[-1]
    if "libcuda.so" in path and path.startswith("/"):
        print(path)
        break
PY
}

refuse() {
  echo "gpu-check: refusing to run: $1" >&2
  echo "gpu-check: fix: $2" >&2
  exit 3
}

# guard KIT: refuses (exit 3) when a fake driver could be picked up; prints what was checked.
guard() {
  local kit=$1 dir f found libs
  if [ -n "${CISTERN_FAKECUDA+set}" ]; then
    refuse "CISTERN_FAKECUDA is set (it switches cistern's fake libcuda on)" \
      "unset CISTERN_FAKECUDA"
  fi
  if [ -d "$kit" ]; then
    found=$(find "$kit" \( -name 'libcuda.so*' -o -name 'libcistern_fakecuda*' \) -print -quit 2> /dev/null)
    if [ -n "$found" ]; then
      refuse "the kit holds $found (no driver, real or fake, may travel in the kit)" \
        "delete it and rebuild the kit: bash scripts/build-gpu-kit.sh"
    fi
  fi
  local IFS=:
  for dir in ${LD_LIBRARY_PATH:-}; do
    [ -d "$dir" ] || continue
    for f in "$dir"/libcuda.so*; do
      if is_fake "$f"; then
        refuse "$f (on LD_LIBRARY_PATH) is cistern's fake libcuda" \
          "remove $dir from LD_LIBRARY_PATH (or unset LD_LIBRARY_PATH) and rerun"
      fi
    done
  done
  IFS=': '
  for f in ${LD_PRELOAD:-}; do
    if is_fake "$f"; then
      refuse "$f (in LD_PRELOAD) is cistern's fake libcuda" "unset LD_PRELOAD"
    fi
  done
  IFS=$' \t\n'
  if command -v ldconfig > /dev/null 2>&1; then
    libs=$(ldconfig -p 2> /dev/null | awk '/libcuda\.so/ {print $NF}')
    for f in $libs; do
      if is_fake "$f"; then
        refuse "the loader cache (ldconfig -p) maps libcuda to $f, cistern's fake" \
          "remove $f (and its directory from /etc/ld.so.conf.d), then run ldconfig"
      fi
    done
  fi
  local name
  for name in libcuda.so libcuda.so.1; do
    f=$(loader_libcuda "$name")
    if [ -n "$f" ] && is_fake "$f"; then
      refuse "dlopen(\"$name\") loads $f, cistern's fake" \
        "remove its directory from the library path (LD_LIBRARY_PATH, ld.so.conf) and rerun"
    fi
  done
  echo "gpu-check: driver guard ok (libcuda.so.1 loads as: ${f:-nothing found})"
}

# ---- the step runner ----------------------------------------------------------------------------

# check_init: starts the clock and an empty steps file under $OUT.
check_init() {
  mkdir -p "$OUT"
  STEPS="$OUT/steps.tsv"
  : > "$STEPS"
  START_S=$(date +%s)
  DEADLINE_S=$((START_S + BUDGET_S - SUMMARY_RESERVE_S))
}

# record NAME RESULT RC SECONDS LIMIT KEYS NOTE: one line of the steps file (tabs and newlines
# in the fields become spaces).
record() {
  local fields=() v
  for v in "$@"; do
    v=${v//$'\t'/ }
    fields+=("${v//$'\n'/ }")
  done
  (IFS=$'\t'; echo "${fields[*]}") >> "$STEPS"
}

now_s() { # seconds since the epoch, with decimals where bash has them
  if [ -n "${EPOCHREALTIME:-}" ]; then echo "${EPOCHREALTIME/,/.}"; else date +%s; fi
}

# step NAME LIMIT_S CMD...: runs CMD (a program or a function of this file) under timeout, with
# stdout in $OUT/NAME.out, stderr in $OUT/NAME.log, and STEP_KEYS=$OUT/NAME.keys for it to
# append key=value lines to; records the result.
step() {
  local name=$1 limit=$2 left t0 t1 rc result note keys secs
  shift 2
  if [ -n "${ONLY:-}" ] && [[ ",$ONLY," != *",$name,"* ]]; then
    record "$name" skipped - 0 "$limit" "" "not in ONLY"
    return 0
  fi
  left=$((DEADLINE_S - $(date +%s)))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    record "$name" skipped - 0 "$limit" "" "budget: ${left}s left of BUDGET_S=$BUDGET_S"
    echo "== $name: skipped (budget)"
    return 0
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  export STEP_KEYS="$OUT/$name.keys"
  : > "$STEP_KEYS"
  t0=$(now_s)
  if declare -F "$1" > /dev/null; then
    timeout -k 5 "$limit" bash -c "$(declare -f); \"\$@\"" "$name" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  else
    timeout -k 5 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  fi
  rc=$?
  t1=$(now_s)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  note=$(grep -v '^[[:space:]]*$' "$OUT/$name.log" 2> /dev/null | tail -n 1 | cut -c1-160)
  case $rc in
    0) result=pass; note="" ;;
    "$SKIP_RC") result=skipped; note=${note#skipped: } ;;
    124 | 137) result=timeout; note="killed at its ${limit}s limit${note:+; last: $note}" ;;
    *) result=FAIL ;;
  esac
  keys=$(grep -E '^[A-Za-z0-9_.]+=' "$STEP_KEYS" 2> /dev/null | tr '\n' ' ')
  record "$name" "$result" "$rc" "$secs" "$limit" "${keys% }" "$note"
  echo "   $result rc=$rc ${secs}s ${keys% }"
  [ "$result" = pass ] || tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
  unset STEP_KEYS
  return 0
}

# result_of NAME: the recorded result of step NAME (pass, FAIL, timeout, skipped), or nothing.
result_of() {
  awk -F'\t' -v n="$1" '$1 == n { r = $2 } END { print r }' "$STEPS"
}

# write_summary: the table, from $OUT/steps.tsv alone, to $OUT/summary.txt and stdout. Returns 1
# when a step failed or timed out.
write_summary() {
  local elapsed=$(($(date +%s) - START_S))
  {
    [ -s "$OUT/gpu.txt" ] && sed 's/^/gpu: /' "$OUT/gpu.txt"
    awk -F'\t' -v elapsed="$elapsed" -v budget="$BUDGET_S" '
      { n[$2]++; rows[NR] = $0 }
      END {
        printf "%-20s %-8s %6s %6s  %s\n", "step", "result", "secs", "limit", "key numbers / note"
        for (i = 1; i <= NR; i++) {
          split(rows[i], f, "\t")
          text = f[6]
          if (f[7] != "") text = text (text != "" ? " | " : "") f[7]
          printf "%-20s %-8s %6s %6s  %s\n", f[1], f[2], f[4], f[5], text
        }
        printf "%d steps: %d pass, %d FAIL, %d timeout, %d skipped; %d s of BUDGET_S=%d\n",
          NR, n["pass"], n["FAIL"], n["timeout"], n["skipped"], elapsed, budget
      }' "$STEPS"
  } > "$OUT/summary.txt"
  echo
  echo "==================== cistern GPU check: summary ===================="
  cat "$OUT/summary.txt"
  ! awk -F'\t' '$2 == "FAIL" || $2 == "timeout" { bad = 1 } END { exit !bad }' "$STEPS"
}

# ---- the steps' commands (functions run by step, in a child bash) -------------------------------

skip() { # skip REASON: ends a step as skipped
  echo "skipped: $*" >&2
  exit "$SKIP_RC"
}

need_file() { [ -f "$1" ] || skip "no $1 (rebuild the kit: bash scripts/build-gpu-kit.sh)"; }

run_env() {
  if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
    IFS=, read -r gpu driver mem < "$OUT/gpu.txt"
    echo "gpu=${gpu// /_} driver=${driver// /} memory=${mem// /}" >> "$STEP_KEYS"
  else
    echo "nvidia-smi: not found" > "$OUT/gpu.txt"
  fi
  echo "libcuda.so.1 loads as: $(loader_libcuda)"
  ldconfig -p 2> /dev/null | grep -E 'libcuda\.so' || echo "ldconfig: no libcuda"
  for tool in gcc cc nvcc "${PYTHON:-python3}"; do
    echo "$tool: $(command -v "$tool" || echo missing)"
  done
  "${PYTHON:-python3}" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1 || true
  echo "vm.max_map_count: $(cat /proc/sys/vm/max_map_count 2> /dev/null)"
  echo "glibc: $(ldd --version 2> /dev/null | head -n 1)"
}

run_driver_costs() {
  need_file "$KIT/driver_costs"
  "$KIT/driver_costs" --reps 30 --jsonl --out "$OUT/costs.json" || return
  command -v "${PYTHON:-python3}" > /dev/null 2>&1 || return 0
  "${PYTHON:-python3}" - "$OUT/costs.json" >> "$STEP_KEYS" << 'PY'
import json, sys
t = json.load(open(sys.argv[1]))
for k in ("create_physical", "map", "set_access", "unmap", "release_physical", "mem_alloc", "mem_free"):
    if isinstance(t.get(k), dict):
        print(f"{k}_us={t[k].get('per_call_us', 0):.2f}")
PY
}

run_cuda_driver() {
  need_file "$KIT/cuda_driver"
  # --nocapture: a test without a usable driver says "skipping: ..." and passes; here that is
  # a failure, so its words must reach the log.
  "$KIT/cuda_driver" --test-threads=1 --nocapture gpu_
  local rc=$?
  grep -ohE 'test result: [a-zA-Z]+\. [0-9]+ passed; [0-9]+ failed' "$OUT/cuda_driver.out" |
    tail -n 1 | awk '{ print "passed=" $4; print "failed=" $6 }' >> "$STEP_KEYS"
  [ "$rc" -eq 0 ] || return "$rc"
  if grep -hq '^skipping:' "$OUT/cuda_driver.out" "$OUT/cuda_driver.log"; then
    echo "FAIL: the GPU tests skipped themselves: $(grep -hm1 '^skipping:' "$OUT/cuda_driver.out" "$OUT/cuda_driver.log")" >&2
    return 1
  fi
}

run_capture_rules() {
  command -v "${PYTHON:-python3}" > /dev/null 2>&1 || skip "no ${PYTHON:-python3}"
  # Compared with the answers the fake's rules were written from: a driver that answers
  # differently fails the step, naming the probes (update the fake, then the committed file).
  local rc=0
  "${PYTHON:-python3}" "$GPU_CHECK_ROOT/scripts/gpu/capture_rules.py" --out "$OUT/capture_rules.json" \
    --compare "$GPU_CHECK_ROOT/tests/fakecuda/capture-rules-h200.json" || rc=$?
  # How many probes the driver refused, or that ended the capture; how many differ.
  local probes allowed
  probes=$(grep ' -> ' "$OUT/capture_rules.out" | grep -vc ' -> setup failed' || true)
  allowed=$(grep -c ' -> CUDA_SUCCESS | capture active' "$OUT/capture_rules.out" || true)
  echo "allowed=$allowed" >> "$STEP_KEYS"
  echo "refused_or_invalidating=$((probes - allowed))" >> "$STEP_KEYS"
  echo "differ_from_fake=$(grep -c '^differs:' "$OUT/capture_rules.out" || true)" >> "$STEP_KEYS"
  return "$rc"
}

run_nvml_ps() {
  need_file "$KIT/holder"
  need_file "$KIT/cistern"
  command -v "${PYTHON:-python3}" > /dev/null 2>&1 || skip "no ${PYTHON:-python3}"
  local rc=0
  "${PYTHON:-python3}" "$GPU_CHECK_ROOT/scripts/gpu/nvml_check.py" --holder "$KIT/holder" \
    --lib-dir "$KIT" --cistern "$KIT/cistern" --mib 1024 --out "$OUT/nvml_ps.json" || rc=$?
  # Its key=value lines are the step's key numbers.
  grep -E '^[a-z_]+=' "$OUT/nvml_ps.out" >> "$STEP_KEYS" || true
  return "$rc"
}

run_pairbench() {
  need_file "$CISTERN_LIB"
  if [ ! -x "$KIT/pairbench" ]; then
    command -v gcc > /dev/null 2>&1 || skip "no $KIT/pairbench and no gcc to build it"
    gcc -O2 -o "$OUT/pairbench" "$GPU_CHECK_ROOT/scripts/gpu/pairbench.c" -ldl || skip "gcc could not build pairbench"
    "$OUT/pairbench" 0
  else
    "$KIT/pairbench" 0
  fi
}

run_cudarc_kernel() {
  need_file "$KIT/cudarc_kernel"
  "$KIT/cudarc_kernel" || return
  if grep -q 'needs a CUDA GPU' "$OUT/cudarc_kernel.out"; then
    echo "FAIL: the example found no usable GPU: $(head -n 1 "$OUT/cudarc_kernel.out")" >&2
    return 1
  fi
  grep -q 'elements correct' "$OUT/cudarc_kernel.out" || { echo "FAIL: no 'elements correct' line" >&2; return 1; }
  echo "kernel_check=ok" >> "$STEP_KEYS"
}

# backtrace_preload: the LD_PRELOAD value that gives a crashing step a native backtrace in its
# log (scripts/gpu/backtrace.c, compiled once into $OUT when a C compiler is here), or nothing.
backtrace_preload() {
  local so="$OUT/.backtrace.so"
  if [ ! -f "$so" ] && command -v gcc > /dev/null 2>&1; then
    gcc -shared -fPIC -O1 -o "$so" "$GPU_CHECK_ROOT/scripts/gpu/backtrace.c" 2> /dev/null || rm -f "$so"
  fi
  [ -f "$so" ] && echo "$so${LD_PRELOAD:+ $LD_PRELOAD}"
}

run_torch() {
  command -v "${PYTHON:-python3}" > /dev/null 2>&1 || skip "no ${PYTHON:-python3}"
  case "$*" in "train --mode native" | shim) ;; *) need_file "$CISTERN_LIB" ;; esac
  local preload
  preload=$(backtrace_preload)
  LD_PRELOAD="${preload:-${LD_PRELOAD:-}}" "${PYTHON:-python3}" "$GPU_CHECK_ROOT/scripts/gpu/torch_checks.py" "$@"
}

run_plugin_pytest() {
  "${PYTHON:-python3}" -c 'import pytest' 2> /dev/null || skip "no pytest for ${PYTHON:-python3}"
  need_file "$CISTERN_LIB"
  # The plugin's own GPU tests (test_gpu_*) need CISTERN_DRIVER=cuda; 5: all skipped.
  CISTERN_DRIVER=cuda "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider -k gpu \
    "$GPU_CHECK_ROOT/pytorch-plugin/tests"
  local rc=$?
  grep -oE '[0-9]+ (passed|failed|skipped)' "$OUT/plugin_pytest.out" | tr ' ' '=' |
    awk -F= '{ print $2 "=" $1 }' >> "$STEP_KEYS"
  [ "$rc" -ne 5 ] || skip "pytest: every GPU test skipped itself (see plugin_pytest.out)"
  return "$rc"
}

run_replay() {
  need_file "$KIT/cistern"
  [ -f "$OUT/costs.json" ] || skip "no measured cost table (step driver_costs did not pass)"
  local traces=()
  compgen -G "$KIT/traces/*.pickle" > /dev/null && traces=("$KIT"/traces/*.pickle)
  CISTERN_DRIVER=sim "$KIT/cistern" replay --no-min-capacity --json \
    -a cistern,pytorch-expandable,pytorch --costs "$OUT/costs.json" "${traces[@]}" || return
  command -v "${PYTHON:-python3}" > /dev/null 2>&1 || return 0
  # Totals over the traces, per allocator: driver time (ms) and host waits.
  "${PYTHON:-python3}" - "$OUT/replay_measured.out" >> "$STEP_KEYS" << 'PY'
import json, sys
tot = {}
for t in json.load(open(sys.argv[1])):
    for r in t["results"]:
        a = tot.setdefault(r["allocator"], [0.0, 0])
        a[0] += r.get("driver_time_us") or 0
        a[1] += r.get("host_waits") or 0
for name in ("cistern", "pytorch-expandable", "pytorch"):
    if name in tot:
        print(f"{name.replace('-', '_')}_driver_ms={tot[name][0] / 1000:.1f}")
        print(f"{name.replace('-', '_')}_host_waits={tot[name][1]}")
PY
}

# ---- the run ------------------------------------------------------------------------------------

main() {
  cd "$GPU_CHECK_ROOT" || exit 2
  KIT=${KIT:-gpu-kit}
  OUT=${OUT:-$PWD/gpu-out}
  BUDGET_S=${BUDGET_S:-400}
  PYTHON=${PYTHON:-python3}
  export KIT OUT BUDGET_S PYTHON GPU_CHECK_ROOT
  guard "$KIT"
  [ -d "$KIT" ] || { echo "gpu-check: no $KIT/: build it first: bash scripts/build-gpu-kit.sh" >&2; exit 2; }
  KIT=$(cd "$KIT" && pwd)
  mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
  unset CISTERN_SIM CISTERN_DRIVER
  export CISTERN_CONF=registry:off
  export CISTERN_LIB="$KIT/libcistern.so"
  local plugin="$KIT/pytorch-plugin"
  [ -d "$plugin" ] || plugin="$GPU_CHECK_ROOT/pytorch-plugin"
  export PYTHONPATH="$plugin${PYTHONPATH:+:$PYTHONPATH}"
  export CISTERN_TORCH_CACHE=${CISTERN_TORCH_CACHE:-/tmp/cistern-torch-shim}
  export CUBLAS_WORKSPACE_CONFIG=:4096:8

  check_init
  step env 30 run_env
  step driver_costs 90 run_driver_costs
  step cuda_driver 60 run_cuda_driver
  step capture_rules 60 run_capture_rules
  step pool_vmm 60 run_pairbench
  CISTERN_CONF=registry:off,vmm:false step pool_novmm 45 run_pairbench
  step nvml_ps 90 run_nvml_ps
  step cudarc_kernel 30 run_cudarc_kernel
  step torch_train_native 90 run_torch train --mode native
  step torch_shim 120 run_torch shim
  # A shim that failed to build would be tried again by install() in every step: not once more.
  case $(result_of torch_shim) in FAIL | timeout) export CISTERN_TORCH_SHIM=0 ;; esac
  step torch_train_cistern 90 run_torch train --mode cistern
  step torch_oom 60 run_torch oom
  step torch_record_stream 45 run_torch record_stream
  step torch_snapshot 45 run_torch snapshot
  step torch_ipc 75 run_torch ipc
  step torch_graphs 45 run_torch graphs
  step torch_graph_trees 120 run_torch graph_trees
  step torch_memory_apis 60 run_torch memory_apis
  step plugin_pytest 90 run_plugin_pytest
  step replay_measured 45 run_replay
  write_summary
}

# Sourced (by the tests): define the functions, run nothing.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
