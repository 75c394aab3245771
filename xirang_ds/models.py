"""Built-in model specs for ``estimate`` and ``bench``: a GPT-style decoder and a Llama-style one.

A spec is written ``gpt:layers=4,hidden=256,heads=8,seq=128,vocab=1024`` or named
(`BUILTIN_SPECS`); ``module:factory`` (``module`` importable, from the current directory too) names a
Python factory returning a module whose ``forward(input_ids, labels)`` returns the loss. A factory's
run feeds it token ids of the sequence length and vocabulary given with ``--seq`` and ``--vocab``
(`FactorySpec`); the factory receives them as keywords when it takes ``seq`` and ``vocab``. The
micro-batch comes from the ds_config.

Module names are stable (``blocks.3.attn``, ``blocks.3.mlp``, ``lm_head``) so globs in the
``"xirang"`` block can select them.
"""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import sys
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from xirang_ds.hooks import wrap_method


class ModelSpecError(ValueError):
    """A model spec that is incomplete, inconsistent or cannot be loaded."""


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a built-in decoder.

    Attributes:
        arch: ``gpt`` (LayerNorm, GELU MLP, learned positions) or ``llama`` (RMSNorm, SwiGLU, RoPE).
        layers, hidden, heads, seq, vocab: the usual transformer sizes.
        ffn: MLP width (default 4 × hidden for gpt, 8/3 × hidden rounded to 32 for llama).
    """

    arch: str = "gpt"
    layers: int = 4
    hidden: int = 256
    heads: int = 8
    seq: int = 128
    vocab: int = 256
    ffn: int = 0

    def __post_init__(self):
        problems = []
        if self.arch not in ARCHS:
            problems.append(f"arch must be one of {', '.join(ARCHS)}; got {self.arch!r}")
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1; got {getattr(self, name)}")
        if self.heads >= 1 and self.hidden % self.heads:
            problems.append(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        elif self.arch == "llama" and self.heads >= 1 and (self.hidden // self.heads) % 2:
            problems.append(f"llama needs an even head size for RoPE; hidden/heads = {self.hidden // self.heads}")
        if self.ffn < 0:
            problems.append(f"ffn must be >= 0; got {self.ffn}")
        if problems:
            raise ModelSpecError("invalid model spec: " + "; ".join(problems))

    @property
    def ffn_size(self) -> int:
        if self.ffn:
            return self.ffn
        if self.arch == "llama":
            return 32 * math.ceil(8 * self.hidden / 3 / 32)
        return 4 * self.hidden

    def describe(self) -> str:
        return (f"{self.arch}:layers={self.layers},hidden={self.hidden},heads={self.heads},"
                f"seq={self.seq},vocab={self.vocab}" + (f",ffn={self.ffn}" if self.ffn else ""))


@dataclass(frozen=True)
class FactorySpec:
    """A ``module:factory`` model and the shape of the token ids its run feeds it.

    Attributes:
        target: ``module:factory``; the module is imported with the current directory on ``sys.path``.
        seq: the run's sequence length (``--seq``).
        vocab: the run's vocabulary: token ids are drawn below it (``--vocab``).
    """

    target: str
    seq: int
    vocab: int

    def load(self) -> Callable[..., nn.Module]:
        """The factory function.

        Raises:
            ModelSpecError: the module does not import, or has no such callable.
        """
        module, _, name = self.target.partition(":")
        if os.getcwd() not in sys.path:  # a module beside the user, as ``python -m`` finds it
            sys.path.insert(0, os.getcwd())
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ModelSpecError(f"cannot load model factory {self.target!r}: {e}") from None
        if not callable(factory):
            raise ModelSpecError(f"model factory {self.target!r} is not callable")
        return factory

    def build(self) -> nn.Module:
        """Call the factory, with ``seq=`` and ``vocab=`` when it takes them."""
        factory = self.load()
        try:
            accepted = inspect.signature(factory).parameters
        except (TypeError, ValueError):
            accepted = {}
        return factory(**{k: getattr(self, k) for k in ("seq", "vocab") if k in accepted})

    def describe(self) -> str:
        return f"{self.target} (seq={self.seq}, vocab={self.vocab})"


@dataclass(frozen=True)
class HFSpec:
    """A Hugging Face causal LM from its ``config.json`` (``hf:PATH``, a file or the folder holding it),
    built from the config alone (no weights), fed ``input_ids`` and ``labels`` by keyword.

    Attributes:
        path: the ``config.json`` (or its folder).
        seq: the run's sequence length (``--seq``; default the config's ``max_position_embeddings``).
        vocab: token ids are drawn below it (``--vocab``; default the config's ``vocab_size``).
    """

    path: str
    seq: int
    vocab: int

    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(self.path if os.path.isdir(self.path) else os.path.dirname(self.path) or ".")

    def build(self) -> nn.Module:
        """The model from its config (``use_cache`` off, as a training run has it), its ``forward`` taking
        ``(input_ids, labels)`` positionally like the built-in models'."""
        from transformers import AutoModelForCausalLM

        config = self.config()
        config.use_cache = False
        model = AutoModelForCausalLM.from_config(config)
        wrap_method(model, "forward", _labels_by_keyword)  # innermost of the chain others wrap
        return model

    def describe(self) -> str:
        return f"hf:{self.path} (seq={self.seq}, vocab={self.vocab})"


def _labels_by_keyword(forward: Callable[..., Any], input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
    return forward(input_ids=input_ids, labels=labels)


def _hf_spec(path: str, seq: Optional[int], vocab: Optional[int]) -> HFSpec:
    file = path if not os.path.isdir(path) else os.path.join(path, "config.json")
    if not os.path.isfile(file) or os.path.basename(file) != "config.json":
        raise ModelSpecError(f"hf:{path}: no config.json there; pass hf:PATH/config.json or the folder holding it")
    if importlib.util.find_spec("transformers") is None:
        raise ModelSpecError("hf: models need transformers (pip install transformers)")
    spec = HFSpec(file, seq or 0, vocab or 0)
    config = spec.config()
    seq = seq or getattr(config, "max_position_embeddings", None)
    if not seq:
        raise ModelSpecError(f"hf:{path}: the config has no max_position_embeddings; pass --seq")
    return replace(spec, seq=int(seq), vocab=int(vocab or config.vocab_size))


ModelArg = Union[str, ModelSpec, FactorySpec, HFSpec]
"""A ``--model`` as text or parsed."""

ARCHS = ("gpt", "llama")
BUILTIN_SPECS: dict[str, ModelSpec] = {
    "gpt-tiny": ModelSpec("gpt", layers=2, hidden=64, heads=4, seq=64, vocab=256),
    "gpt-small": ModelSpec("gpt", layers=4, hidden=256, heads=8, seq=128, vocab=256),
    "gpt-medium": ModelSpec("gpt", layers=8, hidden=512, heads=8, seq=256, vocab=256),
    "llama-tiny": ModelSpec("llama", layers=2, hidden=64, heads=4, seq=64, vocab=256),
    "llama-small": ModelSpec("llama", layers=4, hidden=256, heads=8, seq=128, vocab=256),
}
"""Named specs; ``gpt-small`` is the bench GPT."""

_INT_KEYS = {f.name for f in fields(ModelSpec)} - {"arch"}


def parse_model_spec(text: ModelArg, seq: Optional[int] = None,
                     vocab: Optional[int] = None) -> Union[ModelSpec, FactorySpec]:
    """Parse ``--model``: a built-in name, ``arch:key=value,...``, or ``module:factory``; a parsed spec is
    returned as it is.

    Args:
        seq, vocab: the run's sequence length and vocabulary (``--seq``, ``--vocab``): required for a
            factory; for a built-in spec they replace its own.

    Raises:
        ModelSpecError: unknown name, missing or extra keys, bad numbers, a factory without ``seq`` and
            ``vocab``, or one that cannot be imported.
    """
    problems = [f"--{name} must be >= 1; got {value}" for name, value in (("seq", seq), ("vocab", vocab))
                if value is not None and value < 1]
    if problems:
        raise ModelSpecError("; ".join(problems))
    if not isinstance(text, str):
        return text
    text = text.strip()
    given = {k: v for k, v in (("seq", seq), ("vocab", vocab)) if v is not None}
    if text in BUILTIN_SPECS:
        return replace(BUILTIN_SPECS[text], **given)
    head, sep, tail = text.partition(":")
    if head == "hf" and sep:
        return _hf_spec(tail, seq, vocab)
    if head in ARCHS:
        values: dict[str, Any] = {}
        for item in filter(None, (s.strip() for s in tail.split(","))):
            key, eq, value = item.partition("=")
            if not eq:
                raise ModelSpecError(f"model spec item {item!r} must be key=value")
            if key not in _INT_KEYS:
                raise ModelSpecError(f"model spec key {key!r} is unknown; allowed: {', '.join(sorted(_INT_KEYS))}")
            try:
                values[key] = int(float(value))
            except ValueError:
                raise ModelSpecError(f"model spec {key}={value!r} is not a number") from None
        values.update(given)
        missing = {"layers", "hidden", "heads", "seq", "vocab"} - values.keys()
        if missing:
            raise ModelSpecError(f"model spec {text!r} is missing {', '.join(sorted(missing))}; "
                                 f"write e.g. {head}:layers=4,hidden=256,heads=8,seq=128,vocab=256")
        return ModelSpec(arch=head, **values)
    if not (sep and head and tail.isidentifier()):
        raise ModelSpecError(f"unknown model {text!r}; use one of {', '.join(BUILTIN_SPECS)}, "
                             f"'gpt:layers=..,hidden=..,heads=..,seq=..,vocab=..' or 'module:factory'")
    spec = FactorySpec(text, seq=given.get("seq", 0), vocab=given.get("vocab", 0))
    try:
        spec.load()  # fail fast on a module or name that is not there
    except ModelSpecError as e:
        problems.append(str(e))
    missing_flags = [f"--{k}" for k in ("seq", "vocab") if k not in given]
    if missing_flags:
        problems.append(f"model factory {text!r} needs the run's sequence length and vocabulary: pass "
                        f"{' and '.join(missing_flags)} (the token ids the run feeds the model; e.g. --seq 512 "
                        "--vocab 32000)")
    if problems:  # both at once
        raise ModelSpecError("; ".join(problems))
    return spec


def describe_model(model: ModelArg) -> str:
    """The model as results name it."""
    return model if isinstance(model, str) else model.describe()


# ------------------------------------------------------------------------------------------------
# modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (x.float() * scale).to(x.dtype) * self.weight


def _rope(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding on [b, heads, s, d]."""
    s, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = torch.outer(torch.arange(s, device=x.device, dtype=torch.float32), inv)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.heads = spec.heads
        self.rope = spec.arch == "llama"
        self.qkv = nn.Linear(spec.hidden, 3 * spec.hidden, bias=not self.rope)
        self.proj = nn.Linear(spec.hidden, spec.hidden, bias=not self.rope)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        if self.rope:
            q, k = _rope(q), _rope(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gated = spec.arch == "llama"
        width = spec.ffn_size
        self.fc_in = nn.Linear(spec.hidden, (2 if self.gated else 1) * width, bias=not self.gated)
        self.fc_out = nn.Linear(width, spec.hidden, bias=not self.gated)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = self.fc_in(x).chunk(2, dim=-1)
            return self.fc_out(F.silu(gate) * up)
        return self.fc_out(F.gelu(self.fc_in(x)))


class Block(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        norm = (lambda: RMSNorm(spec.hidden)) if spec.arch == "llama" else (lambda: nn.LayerNorm(spec.hidden))
        self.ln_1, self.attn, self.ln_2, self.mlp = norm(), Attention(spec), norm(), MLP(spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Decoder(nn.Module):
    """A GPT- or Llama-style decoder LM; ``forward(input_ids, labels=None)`` returns the mean loss
    when labels are given, else the logits."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(spec.seq, spec.hidden) if spec.arch == "gpt" else None
        self.blocks = nn.ModuleList(Block(spec) for _ in range(spec.layers))
        self.ln_f = RMSNorm(spec.hidden) if spec.arch == "llama" else nn.LayerNorm(spec.hidden)
        self.lm_head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        if self.pos is not None:
            x = x + self.pos(torch.arange(input_ids.shape[1], device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def build_model(spec: Union[ModelSpec, FactorySpec, HFSpec], seed: int = 0) -> nn.Module:
    """Build the model of a spec with a fixed seed (same weights on every rank and run)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(spec, ModelSpec):
            return Decoder(spec)
        return spec.build()


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def with_seq(spec: ModelSpec, seq: int) -> ModelSpec:
    return replace(spec, seq=seq)
