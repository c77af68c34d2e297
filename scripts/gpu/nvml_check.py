#!/usr/bin/env python3
"""`cistern ps`, `leaks` and `doctor` against the GPU's own NVML: a process holds device memory
through libcistern.so (cli/tests/c/holder.c: a tagged block, then it waits), and the three
commands must join NVML's view of that process with the record it publishes, then account for
it once it is killed. The step `nvml_ps` of scripts/gpu-check.sh; the same script runs in the
tests over the fake libcuda with a fake NVML (--fake-nvml, cli/tests/suite/nvml_check.rs), so
its own logic is checked where there is no GPU.

    python3 scripts/gpu/nvml_check.py --holder HOLDER --lib-dir DIR --cistern CISTERN
        [--mib 1024] [--out FILE.json] [--fake-nvml]

Checks, in order (the first that fails ends the run, exit status 1):
  1. `ps --json` sees NVML (`nvml.available`) and the GPU's memory;
  2. the holder's row: running, with its record's live bytes (at least --mib MiB) and reserved
     bytes, and NVML's bytes for that pid joined to it (`nvml_used`, at least the reserved
     bytes: NVML counts the context too). Where NVML lists no process at all (some containers),
     the join cannot be checked: said so (`nvml_joined=unknown`), not failed; where NVML lists
     one holding the memory that ps did not join with the holder (another pid namespace not
     resolved), that is a failure;
  2b. another process asking for more than is free (but less than would be free without the
     holder) fails as out of memory, and its error names the holder (pid, bytes, command
     line: from the holder's record); on a real NVML also a process holding memory without
     cistern (a plain cuMemAlloc through ctypes), from NVML, marked as such, and says what
     NVML counts for the failing process itself, unless NVML lists none of these processes
     (another pid namespace: `oom_names_plain=unknown`);
  3. `doctor --json` while it runs: not an error (exit 0 or 1);
  4. after SIGKILL: the row turns dead, and once the driver has reclaimed the memory NVML no
     longer lists it (`dead-record-only`; `dead-but-memory-held` while it still does);
  5. `leaks PID --json` of the dead process: its tag, with at least --mib MiB live;
  6. `doctor --json --grace 0` after: not an error; the killed process's record is reported.
Prints `key=value` lines (the step's key numbers) and the reason of a failure on stderr; with
--out, writes every command's JSON there. Exit status 0 when every check passed, 1 when one
failed, 2 on bad arguments.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

MIB = 1 << 20
TAG = "nvml-check"
# A process holding device memory without cistern: the driver API through ctypes.
PLAIN = '''import ctypes, sys, time
cu = ctypes.CDLL("libcuda.so.1")
def ok(r, what):
    if r != 0:
        print(f"{what} failed: {r}", flush=True)
        sys.exit(3)
ok(cu.cuInit(0), "cuInit")
dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
ok(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
ok(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
ok(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
ok(cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(int(sys.argv[1]) << 20)), "cuMemAlloc")
print("ready", flush=True)
time.sleep(600)
'''
PLAIN_MIB = 256


class Failed(Exception):
    pass


class Runner:
    def __init__(self, args):
        self.args = args
        self.registry = tempfile.mkdtemp(prefix="cistern-nvml-check-")
        os.chmod(self.registry, 0o700)
        self.env = dict(os.environ)
        self.env["NO_COLOR"] = "1"
        self.env["CISTERN_CONF"] = f"registry_dir:{self.registry}"
        path = self.env.get("LD_LIBRARY_PATH", "")
        self.env["LD_LIBRARY_PATH"] = args.lib_dir + (":" + path if path else "")
        self.fake = None
        if args.fake_nvml:
            self.fake = os.path.join(self.registry, "..", os.path.basename(self.registry) + ".nvml.json")
            self.env["CISTERN_FAKE_NVML"] = self.fake
        else:
            self.env.pop("CISTERN_FAKE_NVML", None)
        self.docs = {}
        self.keys = {}

    def run(self, name, cmd):
        out = subprocess.run([self.args.cistern] + cmd + ["--registry-dir", self.registry],
                             capture_output=True, text=True, env=self.env, timeout=60)
        try:
            doc = json.loads(out.stdout) if out.stdout.strip() else None
        except json.JSONDecodeError:
            doc = None
        self.docs[name] = {"rc": out.returncode, "json": doc, "stderr": out.stderr[-4000:]}
        return out.returncode, doc, out.stderr

    def write_fake(self, pid, used, uuid="GPU-00000000-0000-0000-0000-000000000000"):
        """The fake NVML (--fake-nvml): one GPU `uuid`, listing `pid` with `used` bytes (or no
        process when `pid` is None), as the real one would after the holder's allocation."""
        total = 80 << 30
        procs = [] if pid is None else [{"pid": pid, "used_bytes": used, "kind": "compute"}]
        held = used if pid is not None else 0
        doc = {"gpus": [{"index": 0, "uuid": uuid,
                         "name": "fake", "total": total, "used": held, "free": total - held,
                         "reserved": 0, "compute_mode": "default", "mps": False, "mig": None,
                         "processes": procs}]}
        tmp = self.fake + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.fake)

    def ps_until(self, name, ok, what, timeout=12.0):
        """Polls `ps --json` (records refresh at most once a second) until ok(doc) holds; the
        last answer is kept under `name`."""
        start = time.monotonic()
        while True:
            rc, doc, err = self.run(name, ["ps", "--json"])
            if doc is not None and ok(doc):
                return doc
            if time.monotonic() - start > timeout:
                raise Failed(f"{what}: not seen within {timeout:.0f} s; last ps exited {rc}: "
                             f"{json.dumps(doc)[:2000]} {err[-1000:]}")
            time.sleep(0.25)


def row(doc, pid):
    for p in doc.get("processes") or []:
        if p.get("pid") == pid:
            return p
    return None


def gpu_of(p):
    gpus = p.get("gpus") or []
    return gpus[0] if gpus else {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--holder", required=True, help="cli/tests/c/holder.c, built")
    ap.add_argument("--lib-dir", required=True, help="the directory of libcistern.so")
    ap.add_argument("--cistern", required=True, help="the cistern binary")
    ap.add_argument("--mib", type=int, default=1024, help="how much the holder holds (MiB)")
    ap.add_argument("--out", help="write every command's JSON here")
    ap.add_argument("--fake-nvml", action="store_true",
                    help="use a fake NVML (CISTERN_FAKE_NVML) that lists the holder: for the "
                         "tests, over the fake libcuda")
    args = ap.parse_args()
    for p in (args.holder, args.cistern):
        if not os.access(p, os.X_OK):
            print(f"nvml_check: {p} is not an executable: build it first", file=sys.stderr)
            return 2
    r = Runner(args)
    holder = None
    plain = None

    def terminated(signum, frame):
        # The step's time limit (timeout sends SIGTERM): fail with what was learnt so far,
        # through the cleanup below (the holder killed, the keys printed, --out written).
        raise Failed(f"terminated by signal {signum} (the step's time limit)")

    signal.signal(signal.SIGTERM, terminated)
    try:
        if r.fake:
            r.write_fake(None, 0)
        holder = subprocess.Popen([args.holder, TAG, str(args.mib), "wait"], env=r.env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = holder.stdout.readline().strip()
        if line != "ready":
            holder.wait(timeout=30)
            raise Failed(f"the holder did not start ({line!r}): {holder.stderr.read()[-2000:]}")
        pid = holder.pid
        want = args.mib * MIB

        # 1, 2: NVML, and the holder's row joined with NVML's view of it.
        doc = r.ps_until("ps_running",
                         lambda d: (gpu_of(row(d, pid) or {}).get("live") or 0) >= want,
                         "the holder's record with its live bytes")
        uuid = gpu_of(row(doc, pid)).get("uuid")
        if r.fake:
            # The fake NVML names the fake libcuda's GPU, and lists the holder on it.
            r.write_fake(pid, want + 300 * MIB, uuid)
            doc = r.ps_until("ps_running",
                             lambda d: gpu_of(row(d, pid) or {}).get("nvml_used") is not None,
                             "the holder joined with the fake NVML's entry")
        nvml = doc.get("nvml") or {}
        if not nvml.get("available"):
            raise Failed(f"ps says NVML is not available: {json.dumps(nvml)}")
        me = row(doc, pid)
        mg = gpu_of(me)
        # The record names its GPU by the UUID the CUDA driver gives; NVML must know it.
        g0 = next((g for g in doc.get("gpus") or [] if g.get("uuid") == uuid), None)
        if g0 is None or mg.get("gpu_index") is None:
            raise Failed(f"the record's GPU {uuid} is none of NVML's "
                         f"{[g.get('uuid') for g in doc.get('gpus') or []]}: {json.dumps(me)}")
        r.keys["gpu_total_mib"] = (g0.get("total") or 0) // MIB
        if not g0.get("total"):
            raise Failed(f"NVML gave no memory total for {uuid}: {json.dumps(g0)}")
        if me.get("state") != "running":
            raise Failed(f"the holder is not shown running: {json.dumps(me)}")
        reserved, live = mg.get("reserved") or 0, mg.get("live") or 0
        r.keys["reserved_mib"] = reserved // MIB
        r.keys["live_mib"] = live // MIB
        if reserved < live:
            raise Failed(f"reserved below live: {json.dumps(mg)}")
        if TAG not in json.dumps(me):
            raise Failed(f"the holder's tag {TAG} is not in its row: {json.dumps(me)}")
        nvml_procs = [p for p in doc.get("processes") or [] if p.get("nvml_used")]
        r.keys["nvml_processes"] = len(nvml_procs)
        used = mg.get("nvml_used")
        if used is not None:
            r.keys["nvml_used_mib"] = used // MIB
            r.keys["nvml_joined"] = 1
            if used < reserved:
                raise Failed(f"NVML's bytes for the holder ({used}) are below what its record "
                             f"reserves ({reserved}): {json.dumps(me)}")
        else:
            unjoined = [p for p in nvml_procs if p.get("pid") != pid
                        and (p.get("nvml_used") or 0) >= want and p.get("state") == "no-record"]
            if unjoined:
                raise Failed("NVML lists a process holding the holder's memory that ps did not "
                             f"join with the holder's record (pid {pid}): {json.dumps(unjoined)}")
            r.keys["nvml_joined"] = "unknown"
        r.keys["cistern_reserved_mib"] = (g0.get("cistern_reserved") or 0) // MIB
        r.keys["unattributed_mib"] = (g0.get("unattributed") or 0) // MIB
        if (g0.get("cistern_reserved") or 0) < reserved:
            raise Failed(f"the GPU's cistern_reserved is below the holder's reserved bytes: "
                         f"{json.dumps(g0)}")

        # 2b. Another process asks for more than is free, but less than would be free were the
        # holder not there: its OOM error names the holder, from the holder's record; and on a
        # real NVML, a process holding memory without cistern, from NVML.
        if not r.fake:
            # Beside the registry directory, not in it (whose files are records).
            script = r.registry + ".plain_holder.py"
            with open(script, "w") as f:
                f.write(PLAIN)
            plain = subprocess.Popen([sys.executable, script, str(PLAIN_MIB)], env=r.env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            line = plain.stdout.readline().strip()
            if line != "ready":
                plain.kill()
                raise Failed(f"the plain CUDA holder did not start ({line!r}): "
                             f"{plain.stderr.read()[-2000:]}")
            # NVML shows its memory once its context and allocation are made (at once, but
            # polled): the free memory the request below is sized from.
            r.keys["plain_seen"] = 0
            for _ in range(20):
                _, d, _ = r.run("ps_plain", ["ps", "--json"])
                g = next((g for g in (d or {}).get("gpus") or [] if g.get("uuid") == uuid), {})
                if (g.get("free") or 0) // MIB + PLAIN_MIB <= (g0.get("free") or 0) // MIB:
                    g0 = g
                    r.keys["plain_seen"] = 1
                    break
                time.sleep(0.2)
        free_mib = (g0.get("free") or 0) // MIB
        ask = max(free_mib + args.mib // 4, 2 * args.mib)
        greedy = subprocess.run([args.holder, "greedy", str(ask), "exit"], env=r.env,
                                capture_output=True, text=True, timeout=45)
        r.docs["greedy"] = {"rc": greedy.returncode, "stderr": greedy.stderr[-4000:]}
        if greedy.returncode != 3 or "out of memory" not in greedy.stderr:
            raise Failed(f"a request of {ask} MiB beside the holder did not fail as out of "
                         f"memory (exit {greedy.returncode}): {greedy.stderr[-2000:]}")
        named = f"pid {pid:>7}" in greedy.stderr
        r.keys["oom_names_holder"] = int(named)
        if not named:
            raise Failed(f"the OOM error of a request beside the holder does not name it (pid "
                         f"{pid}): {greedy.stderr[-2000:]}")
        if plain is not None:
            # The plain holder's own line: its pid, NVML's bytes, its command, the mark.
            plain_named = re.search(rf"^ +pid +{plain.pid} .*plain_holder\.py.*\[NVML; no "
                                    rf"cistern record\]$", greedy.stderr, re.M) is not None
            self_counted = "this process, as NVML counts it:" in greedy.stderr
            if plain_named and self_counted:
                r.keys["oom_names_plain"] = 1
            elif r.keys.get("nvml_joined") == "unknown":
                # NVML's pids are not this namespace's: the library rightly names none.
                r.keys["oom_names_plain"] = "unknown"
            else:
                raise Failed(f"the OOM error does not name the process holding memory without "
                             f"cistern (pid {plain.pid}) from NVML, or does not say what NVML "
                             f"counts for the failing process: {greedy.stderr[-2000:]}")
            plain.kill()
            plain.wait()

        # 3. doctor while it runs.
        rc, _, err = r.run("doctor_running", ["doctor", "--json"])
        r.keys["doctor_running_rc"] = rc
        if rc not in (0, 1):
            raise Failed(f"doctor failed while the holder ran (exit {rc}): {err[-2000:]}")

        # 4. SIGKILL: dead, and once the driver has reclaimed the memory, record only.
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        if r.fake:
            r.write_fake(None, 0, uuid)
        doc = r.ps_until("ps_killed",
                         lambda d: str((row(d, pid) or {}).get("state", "")).startswith("dead"),
                         "the killed holder shown dead")
        try:
            doc = r.ps_until("ps_killed",
                             lambda d: (row(d, pid) or {}).get("state") == "dead-record-only",
                             "NVML no longer listing the killed holder")
        except Failed:
            pass  # reported below: the driver may take a moment to reclaim it
        r.keys["dead_state"] = (row(doc, pid) or {}).get("state")
        if r.keys["dead_state"] != "dead-record-only":
            raise Failed(f"12 s after SIGKILL the holder is {r.keys['dead_state']!r}, not "
                         f"dead-record-only: {json.dumps(row(doc, pid))}")

        # 5. leaks of the dead process.
        rc, leaks, err = r.run("leaks", ["leaks", str(pid), "--json"])
        if rc != 0 or leaks is None:
            raise Failed(f"leaks {pid} failed (exit {rc}): {err[-2000:]}")
        r.keys["leaked_mib"] = (leaks.get("total_bytes") or 0) // MIB
        if (leaks.get("total_bytes") or 0) < want or TAG not in json.dumps(leaks):
            raise Failed(f"leaks of the killed holder lack its {args.mib} MiB under {TAG}: "
                         f"{json.dumps(leaks)[:2000]}")

        # 6. doctor after: the killed process's record is reported.
        rc, doctor, err = r.run("doctor_killed", ["doctor", "--json", "--grace", "0"])
        r.keys["doctor_killed_rc"] = rc
        if rc not in (0, 1):
            raise Failed(f"doctor failed after the kill (exit {rc}): {err[-2000:]}")
        findings = (doctor or {}).get("findings") or []
        if not any(f.get("pid") == pid for f in findings):
            raise Failed(f"doctor has no finding for the killed holder {pid}: "
                         f"{json.dumps(doctor)[:2000]}")
        ok = True
    except (Failed, subprocess.TimeoutExpired) as e:
        print(f"nvml_check: FAIL: {e}", file=sys.stderr)
        ok = False
    finally:
        for p in (holder, plain):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for k, v in r.keys.items():
            print(f"{k}={v}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"keys": r.keys, "commands": r.docs}, f, indent=1)
        subprocess.run(["rm", "-rf", r.registry, r.registry + ".plain_holder.py"])
        if r.fake:
            for f in (r.fake, r.fake + ".tmp"):
                if os.path.exists(f):
                    os.remove(f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
