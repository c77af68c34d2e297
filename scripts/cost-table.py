#!/usr/bin/env python3
"""Issue 9's table of targets: per trace, cistern (default settings) against memory first
(`grow_whole_chunks:off`), `pytorch-expandable` and `pytorch`: modelled driver time, host
waits, steady-state calls, peak reserved and fragmentation, from `cistern replay --json` over
the dev snapshots and every built-in workload, in one run each.

    cargo build --release -p cistern-cli
    python3 scripts/cost-table.py [--cistern target/release/cistern] [--traces ../shared/traces]
        [--costs FILE.json]

Prints a Markdown table and the medians the issue's targets name.
"""

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

ALLOCATORS = "cistern,cistern:grow_whole_chunks:off,pytorch,pytorch-expandable"


def replay(binary, args, costs):
    cmd = [binary, "replay", "--no-min-capacity", "--json", "-a", ALLOCATORS] + args
    if costs:
        cmd += ["--costs", costs]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"cost-table: {' '.join(cmd[:4])} ... failed:\n{out.stderr}")
    doc = json.loads(out.stdout)
    return doc if isinstance(doc, list) else doc.get("traces", [doc])


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cistern", default=os.path.join(here, "..", "target", "release", "cistern"))
    p.add_argument("--traces", default=os.path.join(here, "..", "..", "shared", "traces"))
    p.add_argument("--costs", help="a cost table (cistern replay --costs)")
    a = p.parse_args()
    if not os.path.exists(a.cistern):
        sys.exit(f"cost-table: no {a.cistern}: run `cargo build --release -p cistern-cli` first")
    snaps = sorted(glob.glob(os.path.join(a.traces, "pytorch_snapshots", "*.pickle")))
    traces = (replay(a.cistern, snaps, a.costs) if snaps else []) + replay(a.cistern, [], a.costs)
    print("| trace | cistern drv ms (x expandable) | off drv ms (x expandable) | expandable drv ms "
          "| pytorch drv ms | host waits c/e/p | steady calls | peak GiB c / e / p | F c / e |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for t in traces:
        r = {x["allocator"]: x for x in t["results"]}
        c, o = r["cistern"], r["cistern:grow_whole_chunks:off"]
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
              f"{pt['peak_reserved'] / gib:.2f} | {100 * c['frag']:.1f}% / {100 * e['frag']:.1f}% |")
    dev = ratios[:len(snaps)]
    print()
    if dev:
        print(f"dev snapshots: median driver time {statistics.median(r[1] for r in dev):.2f}x "
              f"expandable's (max {max(r[1] for r in dev):.2f}x)")
    print(f"all traces: median {statistics.median(r[1] for r in ratios):.2f}x expandable's, "
          f"{statistics.median(r[2] for r in ratios):.1f}x pytorch's; "
          f"at or under expandable's time on {sum(r[1] <= 1.0 for r in ratios)} of {len(ratios)}; "
          f"peak reserved at most {max(r[3] for r in ratios):.3f}x expandable's")


if __name__ == "__main__":
    main()
