"""Removable wrappers: the one way plugins change behaviour they do not own.

Module and tensor hooks return PyTorch's own handles. For a method of one object (the engine's
``save_checkpoint``), `wrap_method` shadows it with an instance attribute and the handle deletes
that attribute again, so the class and every other instance stay untouched.
"""
from __future__ import annotations

import functools
from typing import Any, Callable


class MethodWrap:
    """Handle of `wrap_method`; ``remove()`` restores the original attribute exactly."""

    def __init__(self, obj: Any, name: str, wrapper: Callable):
        self.obj, self.name = obj, name
        self._had_own = name in vars(obj)
        self._own = vars(obj).get(name)
        self.original = getattr(obj, name)
        bound = functools.wraps(self.original)(functools.partial(wrapper, self.original))
        setattr(obj, name, bound)
        self.wrapped = bound

    def remove(self) -> None:
        if getattr(self.obj, self.name, None) is not self.wrapped:
            raise RuntimeError(f"{self.name} of {type(self.obj).__name__} was wrapped again after xirang; "
                               "remove wrappers in reverse order")
        if self._had_own:
            setattr(self.obj, self.name, self._own)
        else:
            delattr(self.obj, self.name)


def wrap_method(obj: Any, name: str, wrapper: Callable) -> MethodWrap:
    """Replace ``obj.name`` by ``wrapper(original, *args, **kwargs)`` on this instance only.

    Example:
        >>> handle = wrap_method(engine, "step", lambda step, *a, **k: step(*a, **k))
        >>> handle.remove()  # engine.step is the class method again
    """
    return MethodWrap(obj, name, wrapper)


class CallbackHandle:
    """A handle that runs ``fn`` once on ``remove()``."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def remove(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()
