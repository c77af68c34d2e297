#!/usr/bin/env python3
"""Writes the seed corpus of the targets whose inputs other programs write: PyTorch memory
snapshots (pickles, as torch.cuda.memory._dump_snapshot writes them, with and without
history), PyTorch profiler traces (plain and gzipped), RMM logs, MiniMalloc CSVs, the
configuration strings, and byte strings for the structure-aware targets (pool, capi).
Deterministic: the same files on every run. Run by fuzz/make-corpus.sh.

    python3 fuzz/make-corpus.py fuzz/corpus
"""
import gzip
import json
import os
import pickle
import random
import sys

out = sys.argv[1] if len(sys.argv) > 1 else "fuzz/corpus"


def put(target, name, data):
    d = os.path.join(out, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


MIB = 1 << 20
BASE = 0x7F0000000000


def frames(fn):
    return [{"filename": "train.py", "line": 42, "name": fn}, {"filename": "model.py", "line": 7, "name": "forward"}]


def snapshot(history=True, expandable=False, oom=False, streams=1):
    """Two segments; a history of allocs, frees and segment events on `streams` streams."""
    segs, traces = [], []
    t = 1_000_000
    events = []
    for k in range(2):
        addr = BASE + k * 64 * MIB
        events.append({"action": "segment_alloc", "addr": addr, "size": 20 * MIB, "stream": 0, "time_us": t, "frames": frames("alloc")})
        t += 10
        blocks = []
        for j in range(4):
            size = (j + 1) * 2 * MIB
            a = addr + j * 5 * MIB
            s = (j % streams) * 0x5A0
            events.append({"action": "alloc", "addr": a, "size": size - 100, "stream": s, "time_us": t, "frames": frames("alloc")})
            t += 3
            if j % 2:
                events.append({"action": "free_requested", "addr": a, "size": size - 100, "stream": s, "time_us": t, "frames": frames("free")})
                events.append({"action": "free_completed", "addr": a, "size": size - 100, "stream": s, "time_us": t + 1, "frames": frames("free")})
                blocks.append({"address": a, "size": size, "requested_size": 0, "state": "inactive", "frames": []})
            else:
                blocks.append({"address": a, "size": size, "requested_size": size - 100, "state": "active_allocated", "frames": frames("alloc")})
            t += 3
        segs.append({"device": 0, "address": addr, "total_size": 20 * MIB, "allocated_size": 8 * MIB, "active_size": 8 * MIB,
                     "requested_size": 8 * MIB - 200, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
                     "is_expandable": expandable, "frames": frames("alloc"), "blocks": blocks})
    if oom:
        events.append({"action": "oom", "addr": 3 * MIB, "device_free": 3 * MIB, "size": 40 * MIB, "stream": 0, "time_us": t, "frames": frames("step")})
    snap = {"segments": segs, "device_traces": [events if history else []], "external_annotations": []}
    snap["allocator_settings"] = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True" if expandable else "",
                                  "max_split_size": -1, "garbage_collection_threshold": 0.0,
                                  "expandable_segments": expandable, "pinned_num_register_threads": 1,
                                  "release_lock_on_cudamalloc": False, "pinned_use_host_register": False,
                                  "roundup_power2_divisions": [1, 1, 1, 1]}
    return pickle.dumps(snap, protocol=4)


snaps = {
    "history.pickle": snapshot(),
    "state-only.pickle": snapshot(history=False),
    "expandable-oom.pickle": snapshot(expandable=True, oom=True),
    "two-streams.pickle": snapshot(streams=2),
}
for name, data in snaps.items():
    put("snapshot", name, data)
    put("load", name, data)
put("load", "history.pickle.gz", gzip.compress(snaps["history.pickle"], mtime=0))


def kineto():
    ev = []
    addr, total = BASE, 0
    for i in range(12):
        size = (i % 4 + 1) * 512 * 1024
        total += size
        ev.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 100 + 2 * i, "s": "t",
                   "args": {"Device Type": 1, "Device Id": 0, "Addr": addr + i * 4 * MIB, "Bytes": size,
                            "Total Allocated": total, "Total Reserved": 64 * MIB}})
        if i % 3 == 2:
            total -= size
            ev.append({"ph": "i", "cat": "cpu_instant_event", "name": "[memory]", "pid": 1, "tid": 1, "ts": 101 + 2 * i, "s": "t",
                       "args": {"Device Type": 1, "Device Id": 0, "Addr": addr + i * 4 * MIB, "Bytes": -size,
                                "Total Allocated": total, "Total Reserved": 64 * MIB}})
    return json.dumps({"schemaVersion": 1, "traceEvents": ev}, separators=(",", ":"))


k = kineto()
put("kineto", "memory.json", k)
put("kineto", "memory.json.gz", gzip.compress(k.encode(), mtime=0))
put("load", "memory.json", k)

rmm = ["Thread,Time,Action,Pointer,Size,Stream"]
for i in range(16):
    rmm.append(f"140{i % 3},10:00:00.{i:06d},allocate,{hex(BASE + i * MIB)},{(i + 1) * 4096},{hex(0x5A0 * (i % 2))}")
    if i % 2:
        rmm.append(f"140{i % 3},10:00:01.{i:06d},free,{hex(BASE + i * MIB)},{(i + 1) * 4096},{hex(0x5A0 * (i % 2))}")
rmm.append("1400,10:00:02.000000,allocate failure,0x0,1099511627776,0x0")
put("rmm", "log.csv", "\n".join(rmm) + "\n")
put("load", "rmm.csv", "\n".join(rmm) + "\n")

mm = ["id,lower,upper,size", "0,0,10,1024", "1,0,5,2048", "2,5,10,2048", "3,2,8,512", "4,8,20,3072"]
put("minimalloc", "small.csv", "\n".join(mm) + "\n")
put("load", "small.minimalloc.csv", "\n".join(mm) + "\n")

configs = [
    (0, "vmm:true,chunk_size:20MiB,small_size:1MiB"),
    (0, "memory_limit:8GiB,release_threshold:1GiB,stream_sync:pressure"),
    (0, "memory_fraction:0.5,provenance:stacks,stack_sample_rate:64,registry:on"),
    (0, "record:/tmp/x.trace,strict:true,registry_dir:/dev/shm/cistern-0"),
    (1, "capacity:80GiB,devices:2,granularity:2MiB,vmm:true"),
    (1, "capacity:16TiB,granularity:64KiB"),
    (2, "pytorch:max_split_size_mb:256"),
    (2, "pytorch-expandable"),
    (2, "cistern:chunk_size:2MiB,stream_sync:always"),
    (2, "cistern:chunk_split:none,chunk_size:64MiB"),
    (3, "iters=3,seq=512"),
]
for i, (sel, text) in enumerate(configs):
    put("config", f"{i:02d}", bytes([sel]) + text.encode())

for target, n, length in [("pool", 8, 600), ("capi", 8, 400)]:
    rng = random.Random(target)
    for i in range(n):
        put(target, f"random-{i}", bytes(rng.randrange(256) for _ in range(length)))
print(f"make-corpus.py: wrote trace, config and byte seeds under {out}", file=sys.stderr)
