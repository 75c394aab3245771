"""The process groups shut down before the interpreter's teardown, and every reference to them dropped.

A gloo process group runs C++ ``std::thread``s (two ``pt_gloo_runloop`` workers and a ``gloo_tcp_loop`` per
group, on the CPU). ``destroy_process_group`` leaves them running: they stop when the group object is
freed. A group still referenced at exit is never freed, its threads meet the C++ runtime's static
destructors, and the rank aborts now and then with ``terminate called without an active exception``
(SIGABRT, and the launcher reports a failed job). Plain torch does it too: two gloo groups kept alive past
``destroy_process_group`` aborted 8 of 20 two-rank runs on this machine (torch 2.13.0).

A DeepSpeed run keeps its groups referenced in places the script cannot see:
- ``torch/distributed/nn/functional.py`` binds ``group=group.WORLD`` as a default argument of its ten
  collectives when it is imported, and torch imports it on the first optimizer built after the group is up
  (``torch.optim.Optimizer.__init__`` imports ``torch._dynamo``, which imports FSDP and the sharded tensor,
  which imports it): from then on the default group lives in ten functions' defaults;
- ``deepspeed.utils.groups`` keeps the world group of its own in a module global (``_WORLD_GROUP``);
- the engine (``data_parallel_group``, ``seq_data_parallel_group``), its ZeRO optimizer, ZeRO-3's
  parameters (``ds_process_group``) and grad_release's communicator keep theirs, and the script keeps the
  engine.

`shut_down_at_exit` registers one exit handler: it destroys the groups when the script did not, then, once
no group is left (every group object is then dead), it walks the loaded modules and what they reach and
replaces each reference to a group with ``None`` (a function's default argument included), so the groups are
freed and their threads joined before the interpreter's teardown.
"""
from __future__ import annotations

import atexit
import collections
import functools
import gc
import sys
import types
from typing import Any

WALK_LIMIT = 1_000_000
"""The most objects the walk visits (a 1.3B model's engine and its modules are about 250,000)."""

_ATOMS = (str, bytes, int, float, complex, bool, type(None), range, slice)


def shut_down_at_exit() -> None:
    """Register `shut_down` to run at exit, once per process. Registered after DeepSpeed made the group, so
    exit handlers the script registers later still find it; a group the script destroyed itself is not
    destroyed again."""
    if getattr(shut_down_at_exit, "registered", False):
        return
    shut_down_at_exit.registered = True  # type: ignore[attr-defined]
    atexit.register(shut_down)


def shut_down() -> int:
    """Destroy the process groups if they are up, then drop every reference to them; the number dropped."""
    import torch.distributed as dist

    if not dist.is_available():
        return 0
    if dist.is_initialized():
        dist.destroy_process_group()
    if dist.is_initialized():  # a group made again by a later handler: not ours to touch
        return 0
    dropped = forget_groups(list(sys.modules.values()))
    gc.collect()  # groups held in reference cycles
    return dropped


def forget_groups(roots: list[Any], limit: int = WALK_LIMIT) -> int:
    """Replace each reference to a ``ProcessGroup`` reachable from ``roots`` with ``None``: values of dicts
    (module globals and objects' attributes included), items of lists, members of sets, and functions'
    default arguments. Tuples cannot be changed; what only a tuple holds stays. Call it when every group is
    destroyed: a live group would be cut from its users."""
    from torch.distributed import ProcessGroup

    dropped = 0
    seen: set[int] = set()
    queue = collections.deque(r for r in roots if r is not None)
    while queue and len(seen) < limit:
        obj = queue.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        children: list[Any]
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                if isinstance(value, ProcessGroup):
                    obj[key] = None
                    dropped += 1
            children = list(obj.values())
        elif isinstance(obj, list):
            for i, value in enumerate(obj):
                if isinstance(value, ProcessGroup):
                    obj[i] = None
                    dropped += 1
            children = list(obj)
        elif isinstance(obj, set):
            groups = [v for v in obj if isinstance(v, ProcessGroup)]
            obj.difference_update(groups)
            dropped += len(groups)
            children = list(obj)
        elif isinstance(obj, types.FunctionType):
            defaults = obj.__defaults__ or ()
            if any(isinstance(v, ProcessGroup) for v in defaults):
                obj.__defaults__ = tuple(None if isinstance(v, ProcessGroup) else v for v in defaults)
                dropped += sum(isinstance(v, ProcessGroup) for v in defaults)
            children = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            children += [obj.__kwdefaults__]
        elif isinstance(obj, (tuple, frozenset, collections.deque)):
            children = list(obj)
        elif isinstance(obj, type):
            for key, value in list(vars(obj).items()):
                if isinstance(value, ProcessGroup):
                    try:
                        setattr(obj, key, None)
                    except (AttributeError, TypeError):
                        continue
                    dropped += 1
            children = list(vars(obj).values())
        elif isinstance(obj, (types.MethodType, functools.partial)):
            children = [getattr(obj, "__self__", None), getattr(obj, "func", None),
                        getattr(obj, "args", None), getattr(obj, "keywords", None)]
        else:
            children = [_instance_dict(obj), type(obj)]  # a class defined in a function is no module's
        queue.extend(c for c in children if c is not None and not isinstance(c, _ATOMS) and id(c) not in seen)
    return dropped


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def _instance_dict(obj: Any) -> Any:
    """An object's own ``__dict__`` (a module's, an instance's) read without running its class's attribute
    hooks: a lazy namespace (``torch.ops``) would make what it is asked for."""
    if not type(obj).__dictoffset__:
        return None
    try:
        return object.__getattribute__(obj, "__dict__")
    except (AttributeError, TypeError):
        return None

