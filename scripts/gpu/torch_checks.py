"""cistern through PyTorch on a real GPU: the PyTorch steps of scripts/gpu-check.sh.

One check per process (cistern_torch.install() must precede CUDA initialisation)::

    python3 torch_checks.py train --mode native     # the reference losses, run twice
    python3 torch_checks.py shim                    # builds cistern_torch's OOM shim (cached)
    python3 torch_checks.py train --mode cistern    # the same losses? peak reserved, alloc cost
    python3 torch_checks.py oom                     # OOM raises torch.OutOfMemoryError
    python3 torch_checks.py record_stream           # a block used on a second stream
    python3 torch_checks.py snapshot                # cistern's snapshot in PyTorch's memory viewer
    python3 torch_checks.py ipc                     # a CUDA tensor shared with another process
    python3 torch_checks.py graphs                  # CUDA graph capture and replay

Exit status: 0 pass, 1 fail, 77 skipped (no torch, no CUDA, nothing to compare with); the reason
of a failure or a skip is the last line on stderr. JSON lines go to stdout; the key numbers are
appended to $STEP_KEYS (key=value lines) when it is set; files go under $OUT. Nothing here changes
the card's settings; all memory is plain device memory, freed before exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

OUT = os.environ.get("OUT", ".")
SKIP = 77

# Deterministic cuBLAS needs this before its first handle.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class Skip(Exception):
    pass


class Fail(Exception):
    pass


def emit(check: str, **kw) -> None:
    print(json.dumps({"check": check, **kw}, default=str), flush=True)


def key(**kw) -> None:
    path = os.environ.get("STEP_KEYS")
    if not path:
        return
    with open(path, "a") as f:
        for k, v in kw.items():
            f.write(f"{k}={v}\n")


def err_text(e: BaseException) -> str:
    first = str(e).splitlines()[0][:200] if str(e) else ""
    return f"{type(e).__name__}: {first}"


def torch_or_skip(mode: str):
    try:
        import torch
    except ImportError as e:
        raise Skip(f"no torch here ({e})")
    if mode == "cistern":
        import cistern_torch

        cistern_torch.install()  # before anything that could initialise CUDA
        key(oom_mode=cistern_torch.oom_mode(), allocator_mode=cistern_torch.allocator_mode())
    if not torch.cuda.is_available():
        raise Skip("torch.cuda.is_available() is False")
    torch.cuda.init()
    return torch


# ---------------------------------------------------------------------------------------------
def train_once(torch, seed: int = 0) -> list:
    import torch.nn as nn

    dev = torch.device("cuda")
    torch.manual_seed(seed)
    d = 512

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, 8, d // 8).unbind(2)
            att = torch.softmax(torch.einsum("bthd,bshd->bhts", q, k) / (d // 8) ** 0.5, -1)
            x = x + self.proj(torch.einsum("bhts,bshd->bthd", att, v).reshape(b, t, d))
            return x + self.ff(self.ln2(x))

    model = nn.Sequential(
        nn.Linear(64, d), *[Block() for _ in range(4)], nn.LayerNorm(d), nn.Linear(d, 64)
    ).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    gen = torch.Generator().manual_seed(seed + 1)
    seqs = [64, 256, 128, 512, 96, 384, 200, 448]  # shapes vary: growth and reuse
    losses = []
    for step in range(40):
        t = seqs[step % len(seqs)]
        x = torch.randn(16, t, 64, generator=gen).to(dev)
        y = torch.randn(16, t, 64, generator=gen).to(dev)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item().hex())
    del model, opt
    return losses


def alloc_cost_ns(torch) -> dict:
    """torch.empty + del per tensor (Python and the dispatcher included), best of 3 x 20000."""
    dev = torch.device("cuda")
    res = {}
    for name, n in (("4KiB", 4096), ("64MiB", 64 << 20)):
        x = torch.empty(n, dtype=torch.uint8, device=dev)
        del x
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter_ns()
            for _ in range(20000):
                x = torch.empty(n, dtype=torch.uint8, device=dev)
                del x
            best = min(best, (time.perf_counter_ns() - t0) / 20000)
        res[name] = round(best)
    return res


def cmd_train(a) -> None:
    torch = torch_or_skip(a.mode)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    t0 = time.perf_counter()
    losses = train_once(torch)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    if a.mode == "cistern":
        import cistern_torch

        peak = cistern_torch.max_memory_reserved()
        st = cistern_torch.memory_stats()
        waits = (st.get("num_stream_syncs", 0) or 0) + (st.get("num_sync_all_streams", 0) or 0)
        ordered = st.get("num_ordered_moves", 0) or 0
    else:
        peak = torch.cuda.max_memory_reserved()
        waits = None
        ordered = None
    cost = alloc_cost_ns(torch)
    rec = {"mode": a.mode, "losses": losses, "seconds": round(seconds, 3), "peak_reserved": peak,
           "alloc_cost_ns": cost}
    key(seconds=round(seconds, 2), peak_reserved_mib=round(peak / 2**20),
        **{f"empty_del_ns_{k}": v for k, v in cost.items()})
    if a.mode == "native":
        again = train_once(torch)  # same process, other addresses: is the loop deterministic?
        rec["deterministic"] = again == losses
        key(deterministic=int(again == losses))
        with open(os.path.join(OUT, "train_native.json"), "w") as f:
            json.dump(rec, f)
        emit("train", **rec)
        return
    key(host_waits=waits, ordered_moves=ordered)
    emit("train", **rec)
    try:
        with open(os.path.join(OUT, "train_native.json")) as f:
            ref = json.load(f)
    except OSError:
        raise Skip("no native losses to compare with (step torch_train_native did not pass)")
    key(native_peak_reserved_mib=round(ref["peak_reserved"] / 2**20),
        **{f"native_empty_del_ns_{k}": v for k, v in ref.get("alloc_cost_ns", {}).items()})
    same = ref["losses"] == losses
    key(same_losses=int(same), last_loss=float.fromhex(losses[-1]))
    if same:
        return
    first = next(i for i, (x, y) in enumerate(zip(ref["losses"], losses)) if x != y)
    if not ref.get("deterministic"):
        raise Skip(f"inconclusive: the native loop itself is not deterministic (differs at {first})")
    raise Fail(f"losses differ from the native allocator's from step {first}")


# ---------------------------------------------------------------------------------------------
def cmd_shim(_a) -> None:
    """Builds (or finds in $CISTERN_TORCH_CACHE) the OOM shim, once, before the cistern checks."""
    try:
        import torch
    except ImportError as e:
        raise Skip(f"no torch here ({e})")
    from cistern_torch import _shim

    t0 = time.perf_counter()
    try:
        path = _shim.build_for_torch(torch)
    except _shim.ShimBuildError as e:
        text = str(e)
        if "no C++ compiler" in text or "headers are missing" in text:
            raise Skip(text.splitlines()[0])
        raise Fail(text.splitlines()[0] + " (see the log)")
    key(build_s=round(time.perf_counter() - t0, 1))
    emit("shim", path=path)


# ---------------------------------------------------------------------------------------------
def cmd_oom(_a) -> None:
    torch = torch_or_skip("cistern")
    import cistern_torch

    dev = torch.device("cuda")
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    results = {}

    def expect_oom(name, fn):
        try:
            x = fn()
            cistern_torch.check_oom()  # after-the-fact mode raises here
            del x
            results[name] = "no exception"
        except oom as e:
            results[name] = "ok"
            emit("oom", case=name, error=err_text(e))
        except Exception as e:  # noqa: BLE001
            results[name] = err_text(e)

    expect_oom("huge", lambda: torch.empty(1 << 50, dtype=torch.uint8, device=dev))
    total = torch.cuda.get_device_properties(0).total_memory
    try:
        torch.cuda.set_per_process_memory_fraction(0.10)
        expect_oom("fraction", lambda: torch.empty(int(total * 0.2), dtype=torch.uint8, device=dev))
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
    healthy = torch.ones(1000, device=dev).sum().item() == 1000
    emit("oom", results=results, healthy_after=healthy)
    key(**{f"{k}_raises": int(v == "ok") for k, v in results.items()}, healthy_after=int(healthy))
    bad = {k: v for k, v in results.items() if v != "ok"}
    if bad or not healthy:
        raise Fail(f"not a torch.OutOfMemoryError: {bad}" if bad else "allocator broken after OOM")


# ---------------------------------------------------------------------------------------------
def cycles_for(torch, seconds: float) -> int:
    """torch.cuda._sleep cycles for about `seconds` (calibrated once)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 10_000_000
    start.record()
    torch.cuda._sleep(n)
    end.record()
    end.synchronize()
    return int(n * seconds * 1000.0 / max(start.elapsed_time(end), 1e-3))


def cmd_record_stream(_a) -> None:
    torch = torch_or_skip("cistern")
    import cistern_torch

    dev = torch.device("cuda")
    cyc = cycles_for(torch, 0.2)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    n = (64 << 20) // 4

    def trial(use_record: bool):
        with torch.cuda.stream(s1):
            x = torch.full((n,), 1.0, device=dev)
        s2.wait_stream(s1)
        with torch.cuda.stream(s2):
            torch.cuda._sleep(cyc)  # s2 still reads x when x is freed below
            out = x * 2
        if use_record:
            x.record_stream(s2)
        xp = x.data_ptr()
        del x
        with torch.cuda.stream(s1):
            y = torch.full((n,), 7.0, device=dev)
        reused = y.data_ptr() == xp
        torch.cuda.synchronize()
        return bool((out == 2).all().item()), reused

    st0 = cistern_torch.memory_stats()
    ok, reused = trial(True)
    st1 = cistern_torch.memory_stats()
    ok_ctl, reused_ctl = trial(False)  # no record_stream: shows that the trial can fail
    waits = sum((st1.get(k, 0) or 0) - (st0.get(k, 0) or 0)
                for k in ("num_stream_syncs", "num_sync_all_streams"))
    emit("record_stream", correct=ok, reused_early=reused, control_correct=ok_ctl,
         control_reused=reused_ctl, host_waits=waits)
    key(correct=int(ok), reused_early=int(reused), host_waits=waits,
        record_streams=(st1.get("num_record_streams", 0) or 0) - (st0.get("num_record_streams", 0) or 0),
        control_corrupted=int(not ok_ctl))
    if not ok:
        raise Fail("the block was reused while the second stream still read it")


# ---------------------------------------------------------------------------------------------
def cmd_snapshot(_a) -> None:
    """cistern's snapshot through PyTorch's memory viewer (_memory_viz), and dump_snapshot."""
    torch = torch_or_skip("cistern")
    import cistern_torch
    from cistern_torch import _snapshot
    from torch.cuda import _memory_viz

    dev = torch.device("cuda")
    with cistern_torch.tag("kept"):
        kept = [torch.empty(n, dtype=torch.uint8, device=dev) for n in (1000, 3 << 20, 40 << 20)]
    side_stream = torch.cuda.Stream()
    with torch.cuda.stream(side_stream):
        side = torch.empty(5 << 20, dtype=torch.uint8, device=dev)
    snap = cistern_torch.snapshot()
    problems = _snapshot.validate(snap)
    viz = {}
    for name, fn in (("segsum", _memory_viz.segsum), ("segment_plot", _memory_viz.segment_plot),
                     ("memory", _memory_viz.memory)):
        try:
            text = fn(snap)
            with open(os.path.join(OUT, f"snapshot_{name}.{'txt' if name == 'segsum' else 'html'}"),
                      "w") as f:
                f.write(text)
            viz[name] = "ok"
        except Exception as e:  # noqa: BLE001
            text = err_text(e)
            # The flame graph view downloads flamegraph.pl on first use: offline (a device
            # machine with no network) that is not the snapshot's failure.
            offline = name == "memory" and ("URLError" in text or "name resolution" in text)
            viz[name] = "skipped: offline (flamegraph.pl cannot be downloaded)" if offline else text
    try:
        cistern_torch.dump_snapshot(os.path.join(OUT, "snapshot.pickle"))
        viz["dump_snapshot"] = "ok"
    except Exception as e:  # noqa: BLE001
        viz["dump_snapshot"] = err_text(e)
    emit("snapshot", segments=len(snap.get("segments", [])), problems=problems[:5], **viz)
    key(segments=len(snap.get("segments", [])), problems=len(problems),
        **{k: int(v == "ok") for k, v in viz.items()})
    del kept, side
    bad = {k: v for k, v in viz.items() if v != "ok" and not v.startswith("skipped:")}
    if problems or bad:
        raise Fail(f"snapshot problems {problems[:3]}, viewer {bad}")


# ---------------------------------------------------------------------------------------------
def _ipc_child(bufs, install: bool, q) -> None:
    try:
        from multiprocessing.reduction import ForkingPickler

        if install:
            import cistern_torch

            cistern_torch.install()
        import torch
        import torch.multiprocessing  # noqa: F401  registers the CUDA reductions

        sums = []
        for buf in bufs:
            try:
                t = ForkingPickler.loads(buf)
                sums.append(("ok", float(t.sum().item())))
            except Exception as e:  # noqa: BLE001  one tensor's failure, reported per tensor
                sums.append(("error", err_text(e)))
        q.put(("ok", sums))
    except Exception as e:  # noqa: BLE001
        q.put(("error", err_text(e)))


def cmd_ipc(_a) -> None:
    """Two tensors sent to a receiver running PyTorch's allocator and to one running cistern: a
    small one (one physical handle: PyTorch's 'e' format) and a 90 MiB one (its handles may
    differ in size: cistern's 'v' format, which only cistern reads). Both must reach the cistern
    receiver, and every 'e' or 'c' tensor the native one; a 'v' tensor refused by the native
    receiver is the known limitation, reported, not failed."""
    try:
        import torch.multiprocessing as mp
    except ImportError as e:
        raise Skip(f"no torch here ({e})")
    from multiprocessing.reduction import ForkingPickler

    mp.set_start_method("spawn", force=True)
    torch = torch_or_skip("cistern")
    tensors = [torch.ones(1 << 20, device="cuda"), torch.full((90 << 18,), 2.0, device="cuda")]
    want = [float(1 << 20), float(2 * (90 << 18))]
    kinds = []
    try:
        bufs = [bytes(ForkingPickler.dumps(t)) for t in tensors]
        for t in tensors:
            handle = t.untyped_storage()._share_cuda_()[1]
            kinds.append(chr(handle[1]) if handle and len(handle) > 1 else "?")
    except Exception as e:  # noqa: BLE001
        key(sender_ok=0)
        raise Fail(f"the sender cannot share a cistern tensor: {err_text(e)}")
    emit("ipc", handle_types=kinds)
    problems = []
    for receiver_installs in (False, True):
        q = mp.Queue()
        p = mp.Process(target=_ipc_child, args=(bufs, receiver_installs, q))
        p.start()
        try:
            status, val = q.get(timeout=60)
        except Exception as e:  # noqa: BLE001
            status, val = "timeout", err_text(e)
        p.join(10)
        if p.is_alive():
            p.kill()
        name = "receiver_cistern" if receiver_installs else "receiver_native"
        emit("ipc", receiver=name, status=status, value=val)
        if status != "ok":
            problems.append(f"{name}: {status} {val}")
            key(**{name: 0})
            continue
        # float32 sums of millions of terms: equal within rounding, not bit for bit.
        ok = [s == "ok" and abs(v - w) <= 1e-4 * w for (s, v), w in zip(val, want)]
        key(**{name: int(all(ok))})
        for i, good in enumerate(ok):
            if good:
                continue
            if not receiver_installs and kinds[i] == "v":
                emit("ipc", note=f"{name} cannot read tensor {i} ('v': handles of mixed sizes)")
                continue
            problems.append(f"{name}: tensor {i} ({kinds[i]!r}): {val[i]}")
    if problems:
        raise Fail("; ".join(problems))


# ---------------------------------------------------------------------------------------------
def cmd_graphs(_a) -> None:
    """Capture and replay; replay must not overwrite memory allocated after the capture."""
    torch = torch_or_skip("cistern")
    dev = torch.device("cuda")
    n = 1 << 22
    static_in = torch.randn(n, device=dev)

    def f(x):
        return ((x * 2 + 1) ** 2 - 3).clone()

    ref = f(static_in)
    cap = torch.cuda.Stream()
    cap.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(cap):
        for _ in range(3):
            f(static_in)
    torch.cuda.current_stream().wait_stream(cap)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, stream=cap):
            static_out = f(static_in)
    except Exception as e:  # noqa: BLE001
        key(captured=0)
        raise Fail(f"capture failed: {err_text(e)}")
    with torch.cuda.stream(cap):
        sentinels = [torch.full((n,), 123.0, device=dev) for _ in range(6)]
    torch.cuda.synchronize()
    g.replay()
    torch.cuda.synchronize()
    corrupted = sum(int(not bool((s == 123.0).all().item())) for s in sentinels)
    correct = bool(torch.equal(static_out, ref))
    # The graph's pool in memory_stats (torch with reserved_bytes_by_private_pools, native
    # mode): reserved while the graph lives, 0 once it is gone.
    pool_keys = {}
    pool_problems = []
    import cistern_torch

    if cistern_torch.allocator_mode() == "native":
        pid = g.pool()
        name = f"reserved_bytes_by_private_pools.{pid[0]}_{pid[1]}.all.current"
        live = torch.cuda.memory_stats().get(name)
        del static_out
        g.reset()
        torch.cuda.synchronize()
        gone = torch.cuda.memory_stats().get(name)
        pool_keys = {"pool": list(pid), "reserved_live": live, "reserved_released": gone}
        if live is not None and (live <= 0 or gone != 0):
            pool_problems.append(f"{name}: {live} while the graph lived, {gone} after")
    emit("graphs", captured=True, output_correct=correct, sentinels_corrupted=corrupted,
         **pool_keys)
    key(captured=1, output_correct=int(correct), sentinels_corrupted=corrupted,
        private_pool_problems=len(pool_problems))
    if corrupted or not correct:
        raise Fail(f"replay: output correct={correct}, {corrupted} of 6 later blocks overwritten")
    if pool_problems:
        raise Fail("; ".join(pool_problems))


def cmd_graph_trees(_a) -> None:
    """CUDA graph trees (torch.compile(mode="reduce-overhead")): two branches recorded into one
    pool need getCheckpointState / setCheckpointPoolState; outputs must match eager mode."""
    torch = torch_or_skip("cistern")
    dev = torch.device("cuda")
    try:
        import torch._inductor.config as ic  # noqa: F401

        ic.triton.slow_path_cudagraph_asserts = True  # checkPoolLiveAllocations, each step
    except Exception:  # noqa: BLE001  older torch: the fast path only
        pass

    def f(x, wide):
        y = torch.relu(x @ x.T)
        return (y * 2 if wide else y + 1).sum(dim=0)

    try:
        g = torch.compile(f, mode="reduce-overhead", dynamic=False)
    except Exception as e:  # noqa: BLE001
        raise Skip(f"torch.compile unavailable: {err_text(e)}")
    x = torch.randn(512, 512, device=dev)
    mismatches = 0
    try:
        for step in range(8):
            wide = step % 3 == 0  # two branches after the first recording
            out = g(x, wide).clone()
            mismatches += int(not torch.allclose(out, f(x, wide), rtol=1e-3, atol=1e-3))
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        key(ran=0)
        raise Fail(f"torch.compile(mode='reduce-overhead'): {err_text(e)}")
    emit("graph_trees", steps=8, mismatches=mismatches)
    key(ran=1, mismatches=mismatches)
    if mismatches:
        raise Fail(f"{mismatches} of 8 compiled steps differ from eager mode")


def cmd_memory_apis(_a) -> None:
    """Every torch.cuda memory API answers from cistern (native mode), with cistern's numbers."""
    torch = torch_or_skip("cistern")
    import cistern_torch

    mode = cistern_torch.allocator_mode()
    if mode != "native":
        raise Fail(f"allocator_mode() is {mode!r}: the native allocator did not install")
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    y = torch.empty(1000, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    results = {}
    problems = []
    stats = torch.cuda.memory_stats()
    ours = cistern_torch.memory_stats()
    for k in ("allocated_bytes.all.current", "reserved_bytes.all.current", "allocation.all.current"):
        results[k] = (stats.get(k), ours.get(k))
        if stats.get(k) != ours.get(k):
            problems.append(f"memory_stats()[{k}] {stats.get(k)} != cistern's {ours.get(k)}")
    if torch.cuda.memory_allocated() != ours["allocated_bytes.all.current"]:
        problems.append("memory_allocated() differs from cistern's")
    peak = torch.cuda.max_memory_allocated()
    del x
    torch.cuda.reset_peak_memory_stats()
    if torch.cuda.max_memory_allocated() >= peak:
        problems.append("reset_peak_memory_stats() left the peak")
    torch.cuda.reset_accumulated_memory_stats()
    if torch.cuda.memory_stats().get("allocation.all.allocated", -1) != 0:
        problems.append("reset_accumulated_memory_stats() left allocation.all.allocated")
    summary = torch.cuda.memory_summary()
    if "PyTorch CUDA memory summary" not in summary:
        problems.append("memory_summary() has no table")
    snap = torch.cuda.memory_snapshot()
    if not any(b["state"] == "active_allocated" for s in snap for b in s["blocks"]):
        problems.append("memory_snapshot() shows no allocated block")
    # History: a record_function range becomes the snapshot's annotations, as with PyTorch's
    # allocator.
    torch.cuda.memory._record_memory_history(max_entries=1000)
    with torch.profiler.record_function("## cistern check ##"):
        z = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    names = [a.get("name") for a in snap.get("external_annotations", [])]
    if "## cistern check ##" not in names:
        problems.append(f"record_function range not in the snapshot's annotations ({names[:4]})")
    if not any(e.get("action") == "alloc" for t in snap.get("device_traces", []) for e in t):
        problems.append("the history recorded no alloc")
    del z
    name = torch.cuda.get_allocator_backend()
    torch.cuda.empty_cache()
    del y
    emit("memory_apis", mode=mode, backend=name, stats=results, problems=problems)
    key(memory_apis_problems=len(problems))
    if problems:
        raise Fail("; ".join(problems))


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("train")
    p.add_argument("--mode", choices=["native", "cistern"], required=True)
    for name in ("shim", "oom", "record_stream", "snapshot", "ipc", "graphs", "graph_trees",
                 "memory_apis"):
        sub.add_parser(name)
    a = ap.parse_args()
    cmds = {"train": cmd_train, "shim": cmd_shim, "oom": cmd_oom, "record_stream": cmd_record_stream,
            "snapshot": cmd_snapshot,
            "ipc": cmd_ipc, "graphs": cmd_graphs, "graph_trees": cmd_graph_trees,
            "memory_apis": cmd_memory_apis}
    try:
        cmds[a.cmd](a)
    except Skip as e:
        print(f"skipped: {e}", file=sys.stderr)
        return SKIP
    except Fail as e:
        print(f"FAIL: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001  any other error is this check's failure only
        import traceback

        traceback.print_exc()
        print(f"FAIL: {err_text(e)}", file=sys.stderr)
        return 1
    print("pass", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
