#!/usr/bin/env python3
"""Issue 9's table of targets: per trace, cistern (default settings) against memory first
(`grow_whole_chunks:off`), `pytorch-expandable` and `pytorch`: modelled driver time, host
waits, steady-state calls, peak reserved and fragmentation, from `cistern replay --json` over
the dev snapshots and every built-in workload, in one run each.

    cargo build --release -p cistern-cli
    python3 scripts/cost-table.py [--cistern target/release/cistern] [--traces ../shared/traces]
        [--costs FILE.json] [--pressure FACTOR] [--gpu-lag N (default 2)] [--seeds N]

Prints a Markdown table and the medians the issue's targets name. With `--pressure 1.25`, each
trace runs instead on a device FACTOR times the smallest one the `pytorch` model runs it on
(found by `cistern replay`'s bisection), where memory is short: the issue asks for no host wait
at any capacity where `pytorch` does not run out, and the table reports the same columns, with
which allocators ran out (`oom`). cistern's models run on a GPU two kernels behind the host on
each stream (`cistern replay --gpu-lag 2`; `--gpu-lag N` sets it): pages freed moments ago are
still busy, as on a real GPU, and the table prices what cistern does about them (moves ordered
on the device, by default). `--gpu-lag 0` replays on a GPU that is never behind (the tables of
notes before device-side ordering).

With `--seeds N`, a second table replays each generated workload (every built-in one but the
`minimalloc-*` CSVs) drawn from seeds 1..N as well as the default (`cistern replay --seed`):
cistern's driver time against `pytorch-expandable`'s and `pytorch`'s, its peak reserved
against expandable's and its smallest device against its peak live bytes and against
expandable's smallest device (with the number of draws where cistern needs more), as the
median and the worst over the draws. One draw can be lucky: the serving workloads' stitching
depends on where each request lands.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

ALLOCATORS = "cistern,cistern:grow_whole_chunks:off,pytorch,pytorch-expandable"
GRANULE = 2 << 20


GPU_LAG = []


def replay(binary, args, costs, allocators=ALLOCATORS, search=False):
    cmd = [binary, "replay", "--json", "-a", allocators] + GPU_LAG + args
    if not search:
        cmd.append("--no-min-capacity")
    if costs:
        cmd += ["--costs", costs]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"cost-table: {' '.join(cmd[:4])} ... failed:\n{out.stderr}")
    doc = json.loads(out.stdout)
    return doc if isinstance(doc, list) else doc.get("traces", [doc])


def listed_workloads(binary):
    """The built-in workloads `cistern replay --workload list` names, each with whether it
    needs a file from the traces folder."""
    listing = subprocess.run([binary, "replay", "--workload", "list"],
                             capture_output=True, text=True).stdout
    return [(line.split()[0], "(needs" in line) for line in listing.splitlines()[1:]
            if line.strip()]


def under_pressure(binary, inputs, costs, factor):
    """Each input (a list of `cistern replay` arguments naming one trace) on a device `factor`
    times the smallest the `pytorch` model runs it on, rounded down to the 2 MiB granule."""
    traces = []
    for args in inputs:
        (found,) = replay(binary, args, costs, allocators="pytorch", search=True)
        least = next((x["min_capacity"] for x in found["results"] if x["allocator"] == "pytorch"),
                     None)
        if not least:
            sys.exit(f"cost-table: no smallest device for {found['trace']}")
        cap = int(least * factor) // GRANULE * GRANULE
        traces += replay(binary, args + ["--capacity", f"{cap}B"], costs)
    return traces


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cistern", default=os.path.join(here, "..", "target", "release", "cistern"))
    p.add_argument("--traces", default=os.path.join(here, "..", "..", "shared", "traces"))
    p.add_argument("--costs", help="a cost table (cistern replay --costs)")
    p.add_argument("--pressure", type=float, metavar="FACTOR",
                   help="run each trace on a device FACTOR times the smallest pytorch runs it on")
    p.add_argument("--gpu-lag", type=int, metavar="N", default=2,
                   help="replay cistern on a GPU N kernels behind the host (cistern replay "
                        "--gpu-lag; default 2, 0 for a GPU that is never behind)")
    p.add_argument("--seeds", type=int, metavar="N", default=0,
                   help="also replay each generated workload drawn from seeds 1..N (a table "
                        "of medians and worst cases over the draws)")
    a = p.parse_args()
    if a.seeds < 0:
        sys.exit("cost-table: --seeds takes a count of draws (e.g. 8)")
    if a.gpu_lag:
        GPU_LAG.extend(["--gpu-lag", str(a.gpu_lag)])
    if not os.path.exists(a.cistern):
        sys.exit(f"cost-table: no {a.cistern}: run `cargo build --release -p cistern-cli` first")
    if a.pressure is not None and a.pressure < 1.0:
        sys.exit("cost-table: --pressure takes a factor of at least 1 (e.g. 1.25): below it "
                 "the pytorch model runs out of memory by definition")
    snaps = sorted(glob.glob(os.path.join(a.traces, "pytorch_snapshots", "*.pickle")))
    if a.pressure is None:
        traces = (replay(a.cistern, snaps, a.costs) if snaps else []) + replay(a.cistern, [],
                                                                              a.costs)
    else:
        builtin = [name for name, needs_file in listed_workloads(a.cistern) if not needs_file]
        inputs = [[s] for s in snaps] + [["--workload", w] for w in builtin]
        traces = under_pressure(a.cistern, inputs, a.costs, a.pressure)
    oom_col = " oom |" if a.pressure is not None else ""
    print("| trace | cistern drv ms (x expandable) | off drv ms (x expandable) | expandable drv ms "
          "| pytorch drv ms | host waits c/e/p | steady calls | peak GiB c / e / p | F c / e |"
          + oom_col)
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if oom_col else ""))
    ratios = []
    waits_past_pytorch = 0
    lag = f"@lag={a.gpu_lag}" if a.gpu_lag else ""
    for t in traces:
        r = {x["allocator"]: x for x in t["results"]}
        c, o = r["cistern" + lag], r["cistern:grow_whole_chunks:off" + lag]
        e, pt = r["pytorch-expandable"], r["pytorch"]
        x = c["driver_time_us"] / max(e["driver_time_us"], 1e-9)
        xo = o["driver_time_us"] / max(e["driver_time_us"], 1e-9)
        ratios.append((t["trace"], x, c["driver_time_us"] / max(pt["driver_time_us"], 1e-9),
                       c["peak_reserved"] / e["peak_reserved"]))
        gib = float(1 << 30)
        print(f"| {t['trace'].split(' (')[0]} | {c['driver_time_us'] / 1000:.1f} ({x:.2f}) "
              f"| {o['driver_time_us'] / 1000:.1f} ({xo:.2f}) | {e['driver_time_us'] / 1000:.1f} "
              f"| {pt['driver_time_us'] / 1000:.1f} "
              f"| {c['host_waits']}/{e['host_waits']}/{pt['host_waits']} "
              f"| {c['steady_driver_calls']} "
              f"| {c['peak_reserved'] / gib:.2f} / {e['peak_reserved'] / gib:.2f} / "
              f"{pt['peak_reserved'] / gib:.2f} | {100 * c['frag']:.1f}% / {100 * e['frag']:.1f}% |"
              + (f" {', '.join(n for n, x in r.items() if x.get('oom')) or '-'} |" if oom_col
                 else ""))
        waits_past_pytorch += c["host_waits"] if not pt.get("oom") else 0
    dev = ratios[:len(snaps)]
    print()
    if dev:
        print(f"dev snapshots: median driver time {statistics.median(r[1] for r in dev):.2f}x "
              f"expandable's (max {max(r[1] for r in dev):.2f}x)")
    print(f"all traces: median {statistics.median(r[1] for r in ratios):.2f}x expandable's, "
          f"{statistics.median(r[2] for r in ratios):.1f}x pytorch's; "
          f"at or under expandable's time on {sum(r[1] <= 1.0 for r in ratios)} of {len(ratios)}; "
          f"peak reserved at most {max(r[3] for r in ratios):.3f}x expandable's")
    print(f"cistern's host waits where pytorch did not run out of memory: {waits_past_pytorch}")
    if a.pressure is not None:
        print(f"(each trace on a device {a.pressure}x the smallest the pytorch model runs it on)")
    if a.seeds:
        over_seeds(a, lag)


def over_seeds(a, lag):
    """The `--seeds N` table: each generated workload over seeds 1..N and the default."""
    names = [name for name, _ in listed_workloads(a.cistern) if not name.startswith("minimalloc-")]
    per = {}
    for seed in [None] + list(range(1, a.seeds + 1)):
        args = [x for w in names for x in ("--workload", w)]
        if seed is not None:
            args += ["--seed", str(seed)]
        found = replay(a.cistern, args, a.costs, allocators="cistern,pytorch,pytorch-expandable",
                       search=True)
        for name, t in zip(names, found):
            r = {x["allocator"]: x for x in t["results"]}
            c, e, pt = r["cistern" + lag], r["pytorch-expandable"], r["pytorch"]
            per.setdefault(name, []).append((
                c["driver_time_us"] / max(e["driver_time_us"], 1e-9),
                c["driver_time_us"] / max(pt["driver_time_us"], 1e-9),
                c["peak_reserved"] / e["peak_reserved"],
                c["min_capacity"] / c["peak_live"] if c.get("min_capacity") else float("nan"),
                c["host_waits"] if not pt.get("oom") else 0,
                c["min_capacity"] / e["min_capacity"]
                if c.get("min_capacity") and e.get("min_capacity") else float("nan"),
            ))
    print()
    print(f"Generated workloads over {a.seeds + 1} draws (the default seed and 1..{a.seeds}); "
          "median (worst):")
    print()
    print("| workload | drv time x expandable | drv time x pytorch | peak x expandable "
          "| min capacity x peak live | min capacity x expandable's (draws above) "
          "| host waits |")
    print("|---|---|---|---|---|---|---|")
    med = statistics.median
    for name, rows in per.items():
        col = [[row[i] for row in rows] for i in range(6)]
        above = sum(x > 1.0 for x in col[5])
        print(f"| {name} | {med(col[0]):.2f} ({max(col[0]):.2f}) "
              f"| {med(col[1]):.2f} ({max(col[1]):.2f}) | {med(col[2]):.3f} ({max(col[2]):.3f}) "
              f"| {med(col[3]):.4f} ({max(col[3]):.4f}) "
              f"| {med(col[5]):.4f} ({max(col[5]):.4f}; {above} of {len(rows)}) "
              f"| {max(col[4])} |")


if __name__ == "__main__":
    main()
