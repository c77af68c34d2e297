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
