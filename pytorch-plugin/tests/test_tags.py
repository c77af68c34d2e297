"""tag() and tag_modules(): push/pop bookkeeping (no library needed) and attribution (library)."""

from __future__ import annotations

import threading
from typing import Any, Callable, List

import pytest

import cistern_torch
from cistern_torch import _lib, _snapshot, _tags


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> List[str]:
    """Records tag pushes and pops instead of calling the library."""
    log: List[str] = []
    monkeypatch.setattr(_lib, "tag_push", lambda t: log.append(f"+{t}"))
    monkeypatch.setattr(_lib, "tag_pop", lambda: log.append("-"))
    return log


def test_tags_nest_and_pop_in_order(calls: List[str]) -> None:
    with cistern_torch.tag("outer"):
        with cistern_torch.tag("inner"):
            pass
    assert calls == ["+outer", "+inner", "-", "-"]


def test_a_tag_pops_when_the_body_raises(calls: List[str]) -> None:
    with pytest.raises(KeyError):
        with cistern_torch.tag("boom"):
            raise KeyError
    assert calls == ["+boom", "-"]


def test_tag_works_as_a_decorator(calls: List[str]) -> None:
    @cistern_torch.tag("step")
    def step() -> int:
        return 3

    assert step() == 3 and step() == 3
    assert calls == ["+step", "-", "+step", "-"]


def test_bad_tags_are_rejected(calls: List[str]) -> None:
    with pytest.raises(TypeError):
        with cistern_torch.tag(3):  # type: ignore[arg-type]
            pass
    with pytest.raises(ValueError):
        with cistern_torch.tag("a\0b"):
            pass
    assert calls == []


class _Handle:
    def __init__(self, hooks: List[Callable[..., Any]], fn: Callable[..., Any]) -> None:
        self.hooks, self.fn = hooks, fn

    def remove(self) -> None:
        self.hooks.remove(self.fn)


class FakeModule:
    """Just enough of torch.nn.Module for tag_modules: children, hooks, __call__."""

    def __init__(self, *children: "FakeModule", fail: bool = False) -> None:
        self.children = list(children)
        self.pre: List[Callable[..., Any]] = []
        self.post: List[Callable[..., Any]] = []
        self.fail = fail

    def named_modules(self, prefix: str = ""):
        yield prefix, self
        for i, c in enumerate(self.children):
            yield from c.named_modules(f"{prefix}.{i}" if prefix else str(i))

    def register_forward_pre_hook(self, fn):
        self.pre.append(fn)
        return _Handle(self.pre, fn)

    def register_forward_hook(self, fn, always_call: bool = False):
        self.post.append(fn)
        return _Handle(self.post, fn)

    def __call__(self, x: int) -> int:
        for h in self.pre:
            h(self, (x,))
        try:
            if self.fail:
                raise RuntimeError("forward failed")
            for c in self.children:
                x = c(x)
            return x
        finally:
            for h in self.post:
                h(self, (x,), x)


def test_tag_modules_pushes_qualified_names(calls: List[str]) -> None:
    model = FakeModule(FakeModule(), FakeModule(FakeModule()))
    handle = cistern_torch.tag_modules(model, prefix="net")
    model(1)
    assert calls == ["+net", "+net.0", "-", "+net.1", "+net.1.0", "-", "-", "-"]
    handle.remove()
    calls.clear()
    model(1)
    assert calls == []


def test_tag_modules_pops_when_forward_raises(calls: List[str]) -> None:
    model = FakeModule(FakeModule(fail=True))
    with cistern_torch.tag_modules(model):
        with pytest.raises(RuntimeError):
            model(1)
    assert calls == ["+FakeModule", "+FakeModule.0", "-", "-"]
    assert _tags._depth() == 0


def test_tag_modules_on_a_torch_model(calls: List[str]) -> None:
    torch = pytest.importorskip("torch", reason="torch is not installed")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with cistern_torch.tag_modules(model, prefix="mlp"):
        model(torch.zeros(1, 4))
    assert calls == ["+mlp", "+mlp.0", "-", "+mlp.1", "-", "-"]


def test_tags_are_per_thread(calls: List[str]) -> None:
    seen = []

    def other() -> None:
        seen.append(_tags._depth())

    with cistern_torch.tag("main"):
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert _tags._depth() == 1
    assert seen == [0]


def test_allocations_carry_the_innermost_tag(allocs) -> None:
    with cistern_torch.tag("outer"):
        a = allocs.malloc(1 << 20)
        with cistern_torch.tag("inner"):
            b = allocs.malloc(1 << 20)
        c = allocs.malloc(1 << 20)
    d = allocs.malloc(1 << 20)
    blocks = {
        blk["address"]: blk
        for seg in _snapshot.snapshot()["segments"]
        for blk in seg["blocks"]
    }
    assert blocks[a].get("tag") == "outer"
    assert blocks[b].get("tag") == "inner"
    assert blocks[c].get("tag") == "outer"
    assert not blocks[d].get("tag")
