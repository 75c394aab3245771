"""Text data for the bench and the examples: byte-level tokens from a file, or from a corpus that
needs no download (the docstrings of Python's standard library, gathered at run time)."""
from __future__ import annotations

import os
import pkgutil
from typing import Iterator, Optional

import torch

SHARED_CORPUS_CANDIDATES = (
    os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "tinyshakespeare.txt"),
    os.path.join(os.getcwd(), "..", "shared", "data", "tinyshakespeare.txt"),
)


def stdlib_docstrings(limit_bytes: int = 2_000_000) -> bytes:
    """Docstrings of the standard library's pure-Python modules, about ``limit_bytes`` of text."""
    import importlib
    import inspect
    import sys
    import sysconfig
    import warnings

    stdlib = sysconfig.get_paths()["stdlib"]
    chunks, total = [], 0
    names = sorted(m.name for m in pkgutil.iter_modules([stdlib]) if not m.name.startswith("_"))
    skip = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip", "venv", "lib2to3"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            if name in skip:
                continue
            try:
                module = sys.modules.get(name) or importlib.import_module(name)
            except Exception:
                continue
            for _, obj in inspect.getmembers(module):
                doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isfunction(obj)) else None
                if doc and getattr(obj, "__module__", None) == name:
                    chunks.append(doc.encode("utf-8", "replace") + b"\n\n")
                    total += len(chunks[-1])
            if total >= limit_bytes:
                break
    return b"".join(chunks)


def find_default_corpus() -> Optional[str]:
    """The shared tinyshakespeare file if it is beside the checkout, else None."""
    for path in SHARED_CORPUS_CANDIDATES:
        if os.path.isfile(path):
            return os.path.abspath(path)
    return None


def load_tokens(path: Optional[str] = None) -> torch.Tensor:
    """Byte-level tokens (int64 in [0, 256)) of a text file, or of the stdlib docstrings."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file not found: {path!r}")
        with open(path, "rb") as f:
            raw = f.read()
    else:
        raw = stdlib_docstrings()
    if len(raw) < 1024:
        raise ValueError(f"corpus too small ({len(raw)} bytes); need at least 1 KiB of text")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)


def batches(tokens: torch.Tensor, batch: int, seq: int, seed: int, vocab: int = 256,
            rank: int = 0, world_size: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (input, label) batches of random windows; the same seed gives the same sequence.

    Each rank draws the full global batch and keeps its slice, so a 2-rank run sees exactly the
    data a 1-rank run with twice the micro-batch sees.
    """
    if int(tokens.max()) >= vocab:  # byte tokens fit any vocab >= 256 as they are
        tokens = tokens % vocab
    return _windows(tokens, batch, seq, torch.Generator().manual_seed(seed), rank, world_size)


def _windows(tokens: torch.Tensor, batch: int, seq: int, gen: torch.Generator, rank: int,
             world_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    n = tokens.numel() - seq - 1
    while True:
        starts = torch.randint(0, n, (batch * world_size,), generator=gen)
        mine = starts[rank * batch:(rank + 1) * batch]
        window = torch.stack([tokens[s:s + seq + 1] for s in mine.tolist()])
        yield window[:, :-1].contiguous(), window[:, 1:].contiguous()
