#!/usr/bin/env python3
"""What the real CUDA driver allows while a stream captures a graph: the evidence for the rules
cistern's fake libcuda (tests/fakecuda) enforces, and for what cistern may call during a capture.

Each probe begins a capture on a fresh non-blocking stream S (a blocking one where the probe's
name says so; in each capture mode: global,
thread_local, relaxed), makes one driver call the pool makes (on S, on another stream T, on the
legacy and per-thread handles, from this thread or another one, each also with the thread's
capture mode exchanged to relaxed for the call, as cistern's backend makes its calls), then
records the call's result,
whether the capture survived (cuStreamIsCapturing) and what cuStreamEndCapture said. Nothing but
ctypes and libcuda.so.1: no compiler, no torch.

    python3 scripts/gpu/capture_rules.py [--out FILE.json] [--compare REF.json]

Prints one line per probe and mode (`mode probe thread -> call rc | capture after | end rc`),
and writes the same as JSON with --out. With --compare, lists the probes whose answer differs
from a reference file's (tests/fakecuda/capture-rules-h200.json: the fake's rules' evidence;
tests/fakecuda/tests/probe.rs runs this probe on the fake and compares). Exit status 0 when
every probe ran (whatever the driver answered) and none differs, 4 when some differ, 1 when the
driver could not be set up, 77 when there is no libcuda.
"""

import argparse
import ctypes
import json
import sys
import threading
from ctypes import byref, c_int, c_size_t, c_uint, c_ulonglong, c_void_p

try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    if "--summarize" not in sys.argv:
        print(f"skipped: no libcuda.so.1 ({e})", file=sys.stderr)
        sys.exit(77)

MODES = {"global": 0, "thread_local": 1, "relaxed": 2}
STATUS = {0: "none", 1: "active", 2: "invalidated"}
LEGACY = c_void_p(1)  # CU_STREAM_LEGACY
PER_THREAD = c_void_p(2)  # CU_STREAM_PER_THREAD
BLOCKING = "blocking"  # a probe's fifth element: its capturing stream S is a blocking one


class MemLocation(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class AllocProp(ctypes.Structure):
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", MemLocation),
                ("win32HandleMetaData", c_void_p), ("allocFlags", AllocFlags)]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", MemLocation), ("flags", c_int)]


def name(rc) -> str:
    if rc is None:
        return "MISSING"  # the library does not export the call (a fake driver)
    if rc == 0:
        return "CUDA_SUCCESS"
    p = ctypes.c_char_p()
    if hasattr(cu, "cuGetErrorName") and cu.cuGetErrorName(rc, byref(p)) == 0 and p.value:
        return p.value.decode()
    return f"CUresult({rc})"


def check(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: {name(rc)}")


class Gpu:
    def __init__(self) -> None:
        check(cu.cuInit(0), "cuInit")
        dev = c_int()
        check(cu.cuDeviceGet(byref(dev), 0), "cuDeviceGet")
        self.dev = dev.value
        self.ctx = c_void_p()
        check(cu.cuDevicePrimaryCtxRetain(byref(self.ctx), dev), "cuDevicePrimaryCtxRetain")
        self.bind()
        self.prop = AllocProp()
        self.prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
        self.prop.location.type = 1  # CU_MEM_LOCATION_TYPE_DEVICE
        self.prop.location.id = self.dev
        g = c_size_t()
        check(cu.cuMemGetAllocationGranularity(byref(g), byref(self.prop), 0), "granularity")
        self.gran = g.value

    def bind(self) -> None:
        check(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")

    def stream(self, blocking: bool = False) -> c_void_p:
        s = c_void_p()
        # CU_STREAM_DEFAULT (0): synchronises with the legacy stream; CU_STREAM_NON_BLOCKING (1)
        check(cu.cuStreamCreate(byref(s), 0 if blocking else 1), "cuStreamCreate")
        return s

    def event(self) -> c_void_p:
        e = c_void_p()
        check(cu.cuEventCreate(byref(e), 2), "cuEventCreate")  # CU_EVENT_DISABLE_TIMING
        return e


def probes(gpu: Gpu):
    """(name, setup(env), call(env) -> rc, teardown(env)); env holds s (capturing), t (another
    stream), and what setup made."""
    g = gpu.gran

    def nothing(env):
        pass

    def recorded_on_t(env):
        env["e"] = gpu.event()
        check(cu.cuEventRecord(env["e"], env["t"]), "cuEventRecord")

    def recorded_on_legacy(env):
        env["e"] = gpu.event()
        check(cu.cuEventRecord(env["e"], LEGACY), "cuEventRecord")

    def recorded_in_an_ended_capture(env):
        # Recorded on stream U during a capture of U (relaxed, so as not to disturb anything)
        # that has ended since: the event is still a captured one.
        env["e"] = gpu.event()
        u = gpu.stream()
        env["u"] = u
        check(cu.cuStreamBeginCapture_v2(u, MODES["relaxed"]), "cuStreamBeginCapture(U)")
        rc = cu.cuEventRecord(env["e"], u)
        graph = c_void_p()
        end = cu.cuStreamEndCapture(u, byref(graph))
        if graph.value:
            cu.cuGraphDestroy(graph)
        check(rc, "cuEventRecord(U, in its capture)")
        check(end, "cuStreamEndCapture(U)")

    def drop_event_and_u(env):
        drop_event(env)
        cu.cuStreamDestroy_v2(env.pop("u"))

    def event_only(env):
        env["e"] = gpu.event()

    def drop_event(env):
        cu.cuEventDestroy_v2(env["e"])

    def stream_id(which):
        def call(env):
            out = c_ulonglong()
            return cu.cuStreamGetId(which(env), byref(out))
        return call

    def stream_ctx(which):
        def call(env):
            out = c_void_p()
            return cu.cuStreamGetCtx(which(env), byref(out))
        return call

    def is_capturing(which):
        def call(env):
            out = c_int(-1)
            return cu.cuStreamIsCapturing(which(env), byref(out))
        return call

    def event_create(env):
        e = c_void_p()
        rc = cu.cuEventCreate(byref(e), 2)
        if rc == 0:
            env["e"] = e
        return rc

    def drop_event_if_any(env):
        if "e" in env:
            cu.cuEventDestroy_v2(env.pop("e"))

    def reserved(env):
        reserve(env)

    def address_free(env):
        return cu.cuMemAddressFree(env.pop("va"), c_size_t(g))

    def push_pop(env):
        rc = cu.cuCtxPushCurrent_v2(gpu.ctx)
        if rc != 0:
            return rc
        out = c_void_p()
        return cu.cuCtxPopCurrent_v2(byref(out))

    def ctx_get_current(env):
        out = c_void_p()
        return cu.cuCtxGetCurrent(byref(out))

    def ctx_get_device(env):
        out = c_int()
        return cu.cuCtxGetDevice(byref(out))

    def device_attribute(env):
        out = c_int()
        # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED (102)
        return cu.cuDeviceGetAttribute(byref(out), 102, gpu.dev)

    def granularity(env):
        out = c_size_t()
        return cu.cuMemGetAllocationGranularity(byref(out), byref(gpu.prop), 0)

    def primary_retain_release(env):
        ctx = c_void_p()
        rc = cu.cuDevicePrimaryCtxRetain(byref(ctx), gpu.dev)
        if rc != 0:
            return rc
        return cu.cuDevicePrimaryCtxRelease_v2(gpu.dev)

    def ipc_handle(env):
        buf = (ctypes.c_char * 64)()
        return cu.cuIpcGetMemHandle(buf, env["dptr"])

    def reserve(env):
        p = c_ulonglong()
        check(cu.cuMemAddressReserve(byref(p), c_size_t(g), c_size_t(0), c_ulonglong(0),
                                     c_ulonglong(0)), "cuMemAddressReserve")
        env["va"] = p

    def handle(env):
        h = c_ulonglong()
        check(cu.cuMemCreate(byref(h), c_size_t(g), byref(gpu.prop), c_ulonglong(0)), "cuMemCreate")
        env["h"] = h

    def mapped(env):
        reserve(env)
        handle(env)
        check(cu.cuMemMap(env["va"], c_size_t(g), c_size_t(0), env["h"], c_ulonglong(0)), "cuMemMap")

    def access(env):
        d = AccessDesc()
        d.location.type = 1
        d.location.id = gpu.dev
        d.flags = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        return cu.cuMemSetAccess(env["va"], c_size_t(g), byref(d), c_size_t(1))

    def unmap_quietly(env):
        if "va" in env:
            cu.cuMemUnmap(env["va"], c_size_t(g))

    def free_all(env):
        unmap_quietly(env)
        if "h" in env:
            cu.cuMemRelease(env["h"])
        if "va" in env:
            cu.cuMemAddressFree(env["va"], c_size_t(g))

    def mem_info(env):
        f, t = c_size_t(), c_size_t()
        return cu.cuMemGetInfo_v2(byref(f), byref(t))

    def mem_alloc(env):
        p = c_ulonglong()
        rc = cu.cuMemAlloc_v2(byref(p), c_size_t(g))
        if rc == 0:
            env["dptr"] = p
        return rc

    def free_dptr(env):
        if "dptr" in env:
            cu.cuMemFree_v2(env["dptr"])

    def allocated(env):
        p = c_ulonglong()
        check(cu.cuMemAlloc_v2(byref(p), c_size_t(g)), "cuMemAlloc")
        env["dptr"] = p

    def create(env):
        h = c_ulonglong()
        rc = cu.cuMemCreate(byref(h), c_size_t(g), byref(gpu.prop), c_ulonglong(0))
        if rc == 0:
            env["h"] = h
        return rc

    def reserve_call(env):
        p = c_ulonglong()
        rc = cu.cuMemAddressReserve(byref(p), c_size_t(g), c_size_t(0), c_ulonglong(0),
                                    c_ulonglong(0))
        if rc == 0:
            env["va"] = p
        return rc

    return [
        ("stream_get_id(S)", nothing, stream_id(lambda e: e["s"]), nothing),
        ("stream_get_id(T)", nothing, stream_id(lambda e: e["t"]), nothing),
        ("stream_get_id(legacy)", nothing, stream_id(lambda e: LEGACY), nothing),
        ("stream_get_id(per_thread)", nothing, stream_id(lambda e: PER_THREAD), nothing),
        ("stream_get_id(NULL)", nothing, stream_id(lambda e: c_void_p(0)), nothing),
        ("stream_get_ctx(S)", nothing, stream_ctx(lambda e: e["s"]), nothing),
        ("stream_get_ctx(T)", nothing, stream_ctx(lambda e: e["t"]), nothing),
        ("event_record(S)", event_only, lambda e: cu.cuEventRecord(e["e"], e["s"]), drop_event),
        ("event_record(T)", event_only, lambda e: cu.cuEventRecord(e["e"], e["t"]), drop_event),
        ("event_query(recorded on T before)", recorded_on_t, lambda e: cu.cuEventQuery(e["e"]),
         drop_event),
        ("event_synchronize(recorded on T before)", recorded_on_t,
         lambda e: cu.cuEventSynchronize(e["e"]), drop_event),
        ("event_query(recorded on S in the capture)", event_only,
         lambda e: cu.cuEventRecord(e["e"], e["s"]) or cu.cuEventQuery(e["e"]), drop_event),
        ("event_synchronize(recorded on S in the capture)", event_only,
         lambda e: cu.cuEventRecord(e["e"], e["s"]) or cu.cuEventSynchronize(e["e"]), drop_event),
        ("event_record(legacy)", event_only, lambda e: cu.cuEventRecord(e["e"], LEGACY),
         drop_event),
        ("stream_wait_event(S, recorded on T before)", recorded_on_t,
         lambda e: cu.cuStreamWaitEvent(e["s"], e["e"], c_uint(0)), drop_event),
        ("stream_query(T)", nothing, lambda e: cu.cuStreamQuery(e["t"]), nothing),
        ("stream_query(S)", nothing, lambda e: cu.cuStreamQuery(e["s"]), nothing),
        ("stream_synchronize(T)", nothing, lambda e: cu.cuStreamSynchronize(e["t"]), nothing),
        ("ctx_synchronize", nothing, lambda e: cu.cuCtxSynchronize(), nothing),
        ("mem_get_info", nothing, mem_info, nothing),
        ("mem_alloc", nothing, mem_alloc, free_dptr),
        ("mem_free", allocated, lambda e: cu.cuMemFree_v2(e.pop("dptr")), free_dptr),
        ("mem_create", nothing, create, free_all),
        ("mem_address_reserve", nothing, reserve_call, free_all),
        ("mem_map", lambda e: (reserve(e), handle(e)),
         lambda e: cu.cuMemMap(e["va"], c_size_t(g), c_size_t(0), e["h"], c_ulonglong(0)),
         free_all),
        ("mem_set_access", mapped, access, free_all),
        ("mem_unmap", mapped, lambda e: cu.cuMemUnmap(e["va"], c_size_t(g)), free_all),
        ("mem_release", lambda e: handle(e), lambda e: cu.cuMemRelease(e.pop("h")), free_all),
        ("stream_is_capturing(S)", nothing, is_capturing(lambda e: e["s"]), nothing),
        ("stream_is_capturing(legacy)", nothing, is_capturing(lambda e: LEGACY), nothing),
        # S created blocking (CU_STREAM_DEFAULT): the legacy stream synchronises with it, so
        # using the legacy stream during its capture would be an implicit dependency.
        ("blocking S: stream_is_capturing(legacy)", nothing, is_capturing(lambda e: LEGACY),
         nothing, BLOCKING),
        ("blocking S: stream_is_capturing(NULL)", nothing, is_capturing(lambda e: c_void_p(0)),
         nothing, BLOCKING),
        ("blocking S: stream_is_capturing(per_thread)", nothing,
         is_capturing(lambda e: PER_THREAD), nothing, BLOCKING),
        ("blocking S: event_record(legacy)", event_only,
         lambda e: cu.cuEventRecord(e["e"], LEGACY), drop_event, BLOCKING),
        ("blocking S: event_record(T)", event_only, lambda e: cu.cuEventRecord(e["e"], e["t"]),
         drop_event, BLOCKING),
        ("event_create", nothing, event_create, drop_event_if_any),
        ("event_destroy(recorded on T before)", recorded_on_t,
         lambda e: cu.cuEventDestroy_v2(e.pop("e")), drop_event_if_any),
        ("mem_address_free", reserved, address_free, free_all),
        ("ctx_push_pop", nothing, push_pop, nothing),
        ("ctx_get_current", nothing, ctx_get_current, nothing),
        ("ctx_get_device", nothing, ctx_get_device, nothing),
        ("device_get_attribute", nothing, device_attribute, nothing),
        ("mem_get_allocation_granularity", nothing, granularity, nothing),
        ("primary_ctx_retain_release", nothing, primary_retain_release, nothing),
        ("ipc_get_mem_handle", allocated, ipc_handle, free_dptr),
        ("event_query(recorded in an ended capture)", recorded_in_an_ended_capture,
         lambda e: cu.cuEventQuery(e["e"]), drop_event_and_u),
        ("blocking S: stream_get_id(legacy)", nothing, stream_id(lambda e: LEGACY), nothing,
         BLOCKING),
        ("blocking S: stream_get_id(NULL)", nothing, stream_id(lambda e: c_void_p(0)), nothing,
         BLOCKING),
        ("blocking S: stream_wait_event(legacy, recorded on T before)", recorded_on_t,
         lambda e: cu.cuStreamWaitEvent(LEGACY, e["e"], c_uint(0)), drop_event, BLOCKING),
        ("blocking S: event_query(recorded on legacy before)", recorded_on_legacy,
         lambda e: cu.cuEventQuery(e["e"]), drop_event, BLOCKING),
    ]


def run_probe(gpu: Gpu, mode: str, probe, other_thread: bool, relaxed: bool = False) -> dict:
    pname, setup, call, teardown = probe[:4]
    blocking = len(probe) > 4 and probe[4] is BLOCKING
    env = {"s": gpu.stream(blocking), "t": gpu.stream()}
    try:
        setup(env)
        check(cu.cuStreamBeginCapture_v2(env["s"], MODES[mode]), "cuStreamBeginCapture")
    except RuntimeError:
        cu.cuStreamDestroy_v2(env["s"])
        cu.cuStreamDestroy_v2(env["t"])
        raise
    rc = [None]
    def attempt():
        # As cistern's CUDA backend makes its calls: with the thread's capture mode exchanged
        # to relaxed for the call, and put back after.
        saved = c_uint(2)
        if relaxed:
            cu.cuThreadExchangeStreamCaptureMode(byref(saved))
        try:
            rc[0] = call(env)
        except AttributeError:  # not exported (a fake driver): recorded as MISSING
            rc[0] = None
        if relaxed:
            cu.cuThreadExchangeStreamCaptureMode(byref(saved))

    if other_thread:
        def body():
            gpu.bind()
            attempt()
        th = threading.Thread(target=body)
        th.start()
        th.join()
    else:
        attempt()
    status = c_int(-1)
    st_rc = cu.cuStreamIsCapturing(env["s"], byref(status))
    graph = c_void_p()
    end_rc = cu.cuStreamEndCapture(env["s"], byref(graph))
    if graph.value:
        cu.cuGraphDestroy(graph)
    if hasattr(cu, "cuCtxSynchronize"):
        cu.cuCtxSynchronize()
    teardown(env)
    cu.cuStreamDestroy_v2(env["s"])
    cu.cuStreamDestroy_v2(env["t"])
    return {
        "mode": mode,
        "probe": pname,
        "thread": ("other" if other_thread else "capturing") + ("/relaxed" if relaxed else ""),
        "rc": name(rc[0]),
        "capture_after": STATUS.get(status.value, str(status.value)) if st_rc == 0 else name(st_rc),
        "end_capture": name(end_rc),
    }


def short(r: dict) -> str:
    """One probe's result in a few characters: the call's result (ok, or the error's name less
    CUDA_ERROR_), then `!` when the capture did not survive it."""
    if "rc" not in r:
        return "setup-failed"
    rc = "ok" if r["rc"] == "CUDA_SUCCESS" else r["rc"].replace("CUDA_ERROR_", "")
    return rc + ("" if r["capture_after"] == "active" else "!")


def summarize(path: str) -> None:
    """One line per probe: its result per mode (g, t, r) and thread (c: the capturing one, o:
    another; C, O: the same with the thread's mode exchanged to relaxed for the call)."""
    doc = json.load(open(path))
    rows: dict = {}
    for r in doc["probes"]:
        who = r["thread"][0]
        if r["thread"].endswith("/relaxed"):
            who = who.upper()
        rows.setdefault(r["probe"], []).append(f"{r['mode'][0]}{who}={short(r)}")
    print(f"driver {doc['driver_version']}; g/t/r: global/thread_local/relaxed capture, "
          "c/o: the capturing thread/another (C/O: exchanged to relaxed for the call, as "
          "cistern calls); !: the capture was invalidated")
    for probe, cells in rows.items():
        print(f"{probe}: {' '.join(cells)}")


def compare(results: list, ref_path: str) -> int:
    """The probes whose answer (the call's result, the capture after it, cuStreamEndCapture's
    result) differs from the reference file's, printed one per line; probes only one side ran
    count too. Returns how many differ."""
    fields = ("rc", "capture_after", "end_capture", "error")
    ref = {(r["mode"], r["probe"], r["thread"]): r for r in json.load(open(ref_path))["probes"]}
    got = {(r["mode"], r["probe"], r["thread"]): r for r in results}
    differ = 0
    for key in sorted(set(ref) | set(got)):
        a, b = ref.get(key), got.get(key)
        if a is None or b is None:
            print(f"differs: {' '.join(key)}: only in {'this run' if a is None else ref_path}")
            differ += 1
            continue
        want = {f: a.get(f) for f in fields}
        have = {f: b.get(f) for f in fields}
        if want != have:
            print(f"differs: {' '.join(key)}: {ref_path} says {want}, this run {have}")
            differ += 1
    print(f"{differ} of {len(set(ref) | set(got))} probes differ from {ref_path}")
    return differ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--summarize", metavar="FILE.json",
                    help="print a --out file's results, one line per probe, and exit")
    ap.add_argument("--compare", metavar="REF.json",
                    help="after probing, list the probes whose answer differs from this --out "
                         "file's (the fake's test runs the probe on the fake against the GPU's "
                         "answers) and exit 4 when any does")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize)
        return 0
    try:
        gpu = Gpu()
    except RuntimeError as e:
        print(f"capture_rules: {e}", file=sys.stderr)
        return 1
    drv = c_int()
    if hasattr(cu, "cuDriverGetVersion"):
        cu.cuDriverGetVersion(byref(drv))
    results = []
    for mode in MODES:
        for probe in probes(gpu):
            for other, relaxed in ((False, False), (True, False), (False, True), (True, True)):
                thread = ("other" if other else "capturing") + ("/relaxed" if relaxed else "")
                try:
                    r = run_probe(gpu, mode, probe, other, relaxed)
                except RuntimeError as e:
                    r = {"mode": mode, "probe": probe[0], "thread": thread, "error": str(e)}
                results.append(r)
                print(f"{r['mode']:12} {r['probe']:42} {r['thread']:17} -> "
                      + (f"{r['rc']} | capture {r['capture_after']} | end {r['end_capture']}"
                         if "rc" in r else f"setup failed: {r['error']}"), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"driver_version": drv.value, "probes": results}, f, indent=1)
    if args.compare and compare(results, args.compare):
        return 4
    return 0


if __name__ == "__main__":
    sys.exit(main())
