"""Tags: name the memory a scope allocates (``with tag("optimizer")``, module names in forward).

A tag is per thread: cistern keeps a stack of tags for each thread, and a block records the
innermost tag of the thread that allocated it. Reports, the OOM message and snapshots group live
bytes by tag.

Note: autograd runs the backward pass on its own threads, so memory allocated during backward
carries no tag pushed by the forward thread.

Never imports torch (``tag_modules`` receives a module object and uses its methods).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Any, Callable, Iterator, List, Optional

from . import _lib

__all__ = ["tag", "tag_modules", "TagHandle"]

_tls = threading.local()

#: Called when a tag scope or a tagged root module's forward ends without an exception. Set by
#: ``install()`` when the OOM shim is missing, to raise an OOM after the fact.
after_scope: Optional[Callable[[], None]] = None


def _check(name: str) -> bytes:
    if not isinstance(name, str):
        raise TypeError(f"a tag is a str, not {type(name).__name__}")
    if "\0" in name:
        raise ValueError("a tag cannot contain a NUL character")
    return name.encode("utf-8")


def _depth() -> int:
    return getattr(_tls, "depth", 0)


def _push(name: str) -> None:
    _check(name)
    _lib.tag_push(name)
    _tls.depth = _depth() + 1


def _pop() -> None:
    if _depth() > 0:
        _tls.depth = _depth() - 1
        _lib.tag_pop()


@contextlib.contextmanager
def tag(name: str) -> Iterator[None]:
    """Tags every allocation this thread makes inside the block (or decorated function).

    Tags nest: the innermost one wins, and leaving the block restores the outer one.

    Example::

        with cistern_torch.tag("optimizer"):
            opt.step()
    """
    _push(name)
    try:
        yield
    finally:
        _pop()
    if after_scope is not None:
        after_scope()


class TagHandle:
    """What :func:`tag_modules` returns: ``remove()`` takes the hooks off again."""

    def __init__(self, handles: List[Any]) -> None:
        self._handles = handles

    def remove(self) -> None:
        """Removes every hook :func:`tag_modules` registered."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "TagHandle":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.remove()


def tag_modules(model: Any, prefix: Optional[str] = None) -> TagHandle:
    """Tags the memory each submodule allocates during its forward with its qualified name.

    Registers a forward pre-hook (push ``prefix.name``) and a forward hook (pop) on every module
    of ``model`` (``model.named_modules()``); the root is tagged ``prefix`` or the model's class
    name. If a forward raises, the tags it pushed are popped (``always_call``, torch >= 2.1; on
    older torch they stay pushed). The hooks call into ctypes, which ``torch.compile`` cannot
    trace (expect graph breaks): tag compiled models from outside, with :func:`tag`.

    Returns a :class:`TagHandle`; call ``remove()`` (or use it as a context manager) to stop.
    """
    root = prefix if prefix is not None else type(model).__name__
    handles: List[Any] = []

    for qual, module in model.named_modules():
        name = root if not qual else f"{root}.{qual}"
        _check(name)

        def pre(mod: Any, args: Any, _name: str = name) -> None:
            _push(_name)

        def post(mod: Any, args: Any, out: Any, _root: bool = module is model) -> None:
            _pop()
            if _root and after_scope is not None and sys.exc_info()[0] is None:
                after_scope()

        handles.append(module.register_forward_pre_hook(pre))
        try:
            handles.append(module.register_forward_hook(post, always_call=True))
        except TypeError:  # torch < 2.1: a forward that raises leaves its tags pushed
            handles.append(module.register_forward_hook(post))
    return TagHandle(handles)
