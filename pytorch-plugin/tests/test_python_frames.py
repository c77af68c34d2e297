"""Python frames as call sites: with ``provenance:stacks``, an allocation made from Python code
is attributed to the Python lines that made it (``cistern_python_frames``, on once
``cistern_torch`` loads the library), in snapshots and in the registry's leak records that
``cistern leaks`` reads, whether the thread held the GIL or not."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

from cistern_torch import _lib

HERE = os.path.dirname(os.path.abspath(__file__))

# The program: ctypes.CDLL calls release the GIL, as PyTorch's operators do before they
# allocate, so the walk must take it back; PyDLL calls keep it.
PROGRAM = textwrap.dedent(
    """\
    import ctypes, json, sys, threading
    from cistern_torch import _lib

    lib = _lib.load()
    held = ctypes.PyDLL(_lib.loaded_path())
    held.cistern_malloc.restype = ctypes.c_void_p
    held.cistern_malloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    on = {"on": _lib.python_frames(True)}

    def load_weights(n):
        return _lib.malloc(n, 0, 0)  # LINE_RELEASED

    def with_gil(n):
        return held.cistern_malloc(n, 0, None)  # LINE_HELD

    out = {"released": load_weights(4 << 20), "held": with_gil(6 << 20)}

    def worker():
        out["thread"] = load_weights(8 << 20)

    t = threading.Thread(target=worker, name="loader")
    t.start()
    t.join()

    # Code objects made and dropped one after another (their addresses would be reused): each
    # block names its own file, never a kept frame of an earlier one.
    out["generated"] = []
    for i in range(40):
        ns = {}
        src = compile("def make(n):\\n    return _lib.malloc(n, 0, 0)\\n", f"gen{i}.py", "exec")
        exec(src, {"_lib": _lib}, ns)
        out["generated"].append(ns["make"](1 << 20))
        del ns, src
    _lib.python_frames(False)
    out["native"] = load_weights(10 << 20)
    out.update(on)
    out["snapshot"] = json.loads(_lib.snapshot_json())
    print(json.dumps(out))
    """
)


def _line(marker: str) -> int:
    return next(i for i, l in enumerate(PROGRAM.splitlines(), 1) if marker in l)


def test_sites_name_the_python_lines_that_allocated(tmp_path, lib) -> None:
    script = tmp_path / "model_loader.py"
    script.write_text(PROGRAM)
    reg = tmp_path / "reg"
    env = dict(os.environ)
    env.update(
        CISTERN_DRIVER="sim",
        CISTERN_CONF=f"provenance:stacks,stack_sample_rate:1,registry_dir:{reg}",
        CISTERN_LIB=_lib.library_path() or "",
        PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), env.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["on"] is True

    frames = {}
    for seg in out["snapshot"]["segments"]:
        for b in seg["blocks"]:
            frames[b["address"]] = b["frames"]

    def names(key: str) -> list:
        """The block's frames, without cistern_torch's own (``_lib.malloc``: the labels of
        ``cistern leaks`` skip them too)."""
        got = [(f["name"], os.path.basename(f["filename"]), f["line"]) for f in frames[out[key]]]
        return [f for f in got if f[1] != "_lib.py"]

    me = "model_loader.py"
    released = _line("LINE_RELEASED")
    # The GIL released (ctypes.CDLL): the walk takes it back, innermost frame first.
    assert names("released") == [
        ("load_weights", me, released),
        ("<module>", me, _line('out = {"released"')),
    ]
    # The GIL held (PyDLL).
    assert names("held")[0] == ("with_gil", me, _line("LINE_HELD"))
    # Another thread: its own frames, down to threading's bootstrap.
    thread = names("thread")
    assert thread[:2] == [("load_weights", me, released), ("worker", me, _line("def worker") + 1)]
    assert any(f[1] == "threading.py" for f in thread[2:]), thread
    for i, p in enumerate(out["generated"]):
        got = [(f["name"], os.path.basename(f["filename"]), f["line"]) for f in frames[p]]
        assert got[1] == ("make", f"gen{i}.py", 2), (i, got)  # got[0]: _lib.malloc
    # Turned off: the native backtrace (the interpreter's C frames), no Python line.
    assert frames[out["native"]] and all(f[1] != me for f in names("native"))

    # The process exited with all four blocks live: its record's leaks name the lines.
    records = [json.loads(open(p).read()) for p in glob.glob(str(reg / "*.json"))]
    assert len(records) == 1, records
    sites = [l.get("site") or "" for l in records[0]["leaks"]]
    assert any(
        # threading's own frames (the standard library) are left out of the label
        s.startswith("site ") and s.endswith(f"load_weights ({script}:{released}) <- worker")
        for s in sites
    ), sites
    assert any(f"load_weights ({script}:{released}) <- <module>" in s for s in sites), sites


def _run(tmp_path, program: str, conf: str = "provenance:stacks,stack_sample_rate:1") -> str:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(program))
    env = dict(os.environ)
    env.update(
        CISTERN_DRIVER="sim",
        CISTERN_CONF=conf,
        CISTERN_LIB=_lib.library_path() or "",
        PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), env.get("PYTHONPATH", "")]),
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the program hung: {e.stdout!r} {e.stderr!r}")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_a_walk_reentered_by_a_finaliser_does_not_hang(tmp_path, lib) -> None:
    # Reading the frames can start a collection (CPython 3.11 on makes frame objects on
    # demand), whose finaliser allocates: the walk is re-entered on the same thread, which
    # then gets a native site instead of waiting on itself for ever.
    out = _run(
        tmp_path,
        """\
        import gc, json
        from cistern_torch import _lib

        _lib.load()
        assert _lib.python_frames(True)
        from_del = []

        class Cycle:
            def __init__(self):
                self.me = self

            def __del__(self):
                from_del.append(_lib.malloc(1 << 20, 0, 0))

        def deep(n):
            return deep(n - 1) if n else _lib.malloc(1 << 20, 0, 0)

        outer = []
        for t in range(1, 60):
            gc.collect()
            Cycle()
            gc.set_threshold(t)
            outer.append(deep(30))
            gc.set_threshold(700)
        gc.collect()
        snap = json.loads(_lib.snapshot_json())
        frames = {b["address"]: b["frames"] for s in snap["segments"] for b in s["blocks"]}
        print(json.dumps({"from_del": len(from_del),
                          "outer": [frames[p] for p in outer]}))
        """,
    )
    doc = json.loads(out)
    assert doc["from_del"] > 0
    # The outer allocations still name their Python lines.
    for frames in doc["outer"]:
        assert any(f["name"] == "deep" for f in frames), frames


def test_the_frame_cache_lets_go_of_code_objects_when_full(tmp_path, lib) -> None:
    # The cache holds a reference to each code object it names, so that an address never
    # names another; once full it is emptied, releasing them (code made at run time must
    # not stay alive for ever).
    out = _run(
        tmp_path,
        """\
        import json, sys
        from cistern_torch import _lib

        _lib.load()
        assert _lib.python_frames(True)

        def f():
            return _lib.malloc(512, 0, 0)

        code = f.__code__
        before = sys.getrefcount(code)
        _lib.free(f(), 0)
        cached = sys.getrefcount(code)
        # 70,000 distinct (code object, line) pairs, more than the cache keeps, in functions
        # of 200 lines (CPython finds a frame's line by scanning its code's line table).
        line = "    m.free(m.malloc(512, 0, 0), 0)\\n"
        src = "".join(f"def many{k}(m):\\n" + line * 200 for k in range(350))
        ns = {}
        exec(compile(src, "many.py", "exec"), ns)
        for k in range(350):
            ns[f"many{k}"](_lib)
        print(json.dumps({"before": before, "cached": cached,
                          "after": sys.getrefcount(code)}))
        """,
    )
    doc = json.loads(out)
    assert doc["cached"] == doc["before"] + 1, doc
    assert doc["after"] == doc["before"], doc
