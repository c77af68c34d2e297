#!/usr/bin/env bash
# cistern on a real GPU: the driver's per-call costs, the replay priced with them, and the CUDA
# backend's own tests on the device. Build the kit first (scripts/build-gpu-kit.sh), then, on
# the device machine, from the repository root with gpu-kit/ copied along:
#     OUT=/some/dir bash scripts/gpu-check.sh          (about 2 minutes; BUDGET_S caps it)
# Writes under $OUT: costs.json (the measured cost table, for `cistern replay --costs`),
# driver_costs.jsonl (every measurement), replay-{published,measured}.json, cuda_driver.log,
# and summary.txt, printed last.
#
# This covers issue "Cheap on a real GPU"'s check. PyTorch, graphs and IPC checks are not here
# yet (see ../shared/gpu-check/ for a draft of those).
#
# Never runs over a fake libcuda: it refuses when one could be picked up.
set -u
cd "$(dirname "$0")/.."
KIT=${KIT:-gpu-kit}
OUT=${OUT:-$PWD/gpu-out}
BUDGET_S=${BUDGET_S:-300}
mkdir -p "$OUT"

case ":${LD_LIBRARY_PATH:-}:" in
  *fakecuda*|*cistern-fake*) echo "refusing: a fake libcuda directory is on LD_LIBRARY_PATH" >&2; exit 2 ;;
esac
if find "$KIT" -name 'libcuda.so*' 2>/dev/null | grep -q .; then
  echo "refusing: the kit contains a libcuda.so (the fake driver must never travel)" >&2; exit 2
fi
[ -x "$KIT/driver_costs" ] || { echo "no $KIT/driver_costs: run scripts/build-gpu-kit.sh first" >&2; exit 2; }
unset CISTERN_FAKECUDA CISTERN_SIM
export CISTERN_DRIVER=cuda CISTERN_CONF=registry:off

START=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
run() { # run NAME LIMIT CMD...: stdout to $OUT/NAME.out, stderr to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  [ "$limit" -gt "$(left)" ] && limit=$(left)
  if [ "$limit" -lt 5 ]; then echo "== $name: skipped (budget)"; echo "$name skipped" >> "$OUT/steps.txt"; return; fi
  echo "== $name (limit ${limit}s)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.out" 2> "$OUT/$name.log"
  local rc=$?
  echo "$name rc=$rc" >> "$OUT/steps.txt"
  echo "   rc=$rc"; tail -n 3 "$OUT/$name.log" | sed 's/^/   | /'
}
: > "$OUT/steps.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1 || true

# 1. The per-call table (the most important figure: the replay's prices).
run driver_costs 120 "$KIT/driver_costs" --reps 30 --jsonl --out "$OUT/costs.json"
cp "$OUT/driver_costs.out" "$OUT/driver_costs.jsonl" 2>/dev/null || true

# 2. The replay priced with the published table and with the measured one.
traces=()
compgen -G "$KIT/traces/*.pickle" > /dev/null && traces=("$KIT"/traces/*.pickle)
for table in published measured; do
  costs="$KIT/costs/a100-published.json"
  [ "$table" = measured ] && costs="$OUT/costs.json"
  [ -f "$costs" ] || continue
  CISTERN_DRIVER=sim run "replay_$table" 90 "$KIT/cistern" replay --no-min-capacity --json \
    -a cistern,pytorch-expandable,pytorch --costs "$costs" "${traces[@]}"
  # Built-in workloads too (a second document).
  CISTERN_DRIVER=sim run "replay_${table}_builtin" 60 "$KIT/cistern" replay --no-min-capacity \
    --json -a cistern,pytorch-expandable,pytorch --costs "$costs"
done

# 3. The CUDA backend's GPU tests on the real device.
run cuda_driver 60 "$KIT/cuda_driver" --test-threads=1 gpu_

# Summary (always).
python3 - "$OUT" "$KIT/costs/a100-published.json" > "$OUT/summary.txt" 2>&1 <<'PY'
import json, os, sys
out, published = sys.argv[1], sys.argv[2]
print(open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(os.path.join(out, "gpu.txt")) else "gpu: ?")
print(open(os.path.join(out, "steps.txt")).read().strip())
try:
    m = json.load(open(os.path.join(out, "costs.json")))
    p = json.load(open(published))
    print("\n%-20s %12s %12s" % ("call", "measured us", "published us"))
    for k in sorted(x for x in m if not x.startswith("_") and isinstance(m[x], dict)):
        pm = m[k].get("per_mib_us"); pp = p.get(k, {}).get("per_mib_us")
        print("%-20s %12.2f %12.2f%s" % (k, m[k]["per_call_us"], p.get(k, {}).get("per_call_us", float("nan")),
              ("   per MiB %.3f / %s" % (pm, pp)) if pm or pp else ""))
except Exception as e:
    print("no measured cost table:", e)
for table in ("published", "measured"):
    for suffix in ("", "_builtin"):
        f = os.path.join(out, f"replay_{table}{suffix}.out")
        try:
            d = json.load(open(f))
        except Exception:
            continue
        print(f"\nreplay, {table} costs{' (built-in workloads)' if suffix else ''}: driver ms / host waits / peak MiB")
        for t in d:
            rows = {r["allocator"]: r for r in t["results"]}
            cells = []
            for a in ("cistern", "pytorch-expandable", "pytorch"):
                r = rows.get(a)
                cells.append("-" if r is None else "%.1f / %d / %.0f" % (r["driver_time_us"] / 1000, r["host_waits"], r["peak_reserved"] / 2**20))
            print("  %-40s %s" % (t["trace"][-40:], " | ".join(cells)))
PY
echo
echo "==================== cistern GPU check ($(( $(date +%s) - START )) s) ===================="
cat "$OUT/summary.txt"
