"""Removable wrappers: the one way plugins change behaviour they do not own.

Module and tensor hooks return PyTorch's own handles. For a method of one object (the engine's
``step``), `wrap_method` shadows it with an instance attribute that runs a chain of wrappers around
the class's method; each handle removes its own wrapper, in any order, and the attribute is
deleted with the last one, so the class and every other instance stay untouched.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

_CHAINS = "__xirang_method_chains__"


class MethodWrap:
    """Handle of `wrap_method`; ``remove()`` takes this wrapper out of the chain."""

    def __init__(self, obj: Any, name: str, wrapper: Callable, over_instance: bool = False):
        self.obj, self.name, self.wrapper = obj, name, wrapper
        chains = vars(obj).setdefault(_CHAINS, {})
        if name not in chains:
            if name in vars(obj) and not over_instance:
                raise RuntimeError(f"{type(obj).__name__}.{name} is already replaced on this instance by "
                                   "something other than xirang; cannot wrap it safely")
            original = getattr(obj, name)
            chain: list[Callable] = []
            chains[name] = (original, chain, vars(obj).get(name))

            @functools.wraps(original)
            def dispatch(*args: Any, **kwargs: Any) -> Any:
                call = original
                for w in chain:  # first registered is innermost
                    call = functools.partial(w, call)
                return call(*args, **kwargs)

            vars(obj)[name] = dispatch  # bypasses nn.Module.__setattr__ on purpose
        chains[name][1].append(wrapper)

    @property
    def original(self) -> Callable:
        return vars(self.obj)[_CHAINS][self.name][0]

    def remove(self) -> None:
        chains = vars(self.obj).get(_CHAINS, {})
        entry = chains.get(self.name)
        if entry is None or self.wrapper not in entry[1]:
            return
        entry[1].remove(self.wrapper)
        if not entry[1]:
            del chains[self.name]
            if entry[2] is not None:  # an instance attribute wrapped over (`over_instance`) comes back
                vars(self.obj)[self.name] = entry[2]
            else:
                vars(self.obj).pop(self.name, None)
            if not chains:
                vars(self.obj).pop(_CHAINS, None)


def wrap_method(obj: Any, name: str, wrapper: Callable, over_instance: bool = False) -> MethodWrap:
    """Run ``obj.name(...)`` as ``wrapper(original, *args, **kwargs)`` on this instance only.

    An instance attribute someone else set (torch.compile's ``OptimizedModule.forward``) is refused,
    unless ``over_instance``: then it is wrapped and put back when the last wrapper goes.

    Example:
        >>> handle = wrap_method(engine, "step", lambda step, *a, **k: step(*a, **k))
        >>> handle.remove()  # engine.step is the class method again
    """
    return MethodWrap(obj, name, wrapper, over_instance)


class CallbackHandle:
    """A handle that runs ``fn`` once on ``remove()``."""

    def __init__(self, fn: Callable[[], None]):
        self._fn = fn

    def remove(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()
