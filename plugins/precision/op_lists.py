"""The op lists of the precision plugin: built-in defaults, name resolution and composition.

Names are ATen operators as ``torch.ops`` spells them: ``"mm"``, ``"softmax"``, ``"aten::pow"``, or
one overload (``"pow.Tensor_Scalar"``); another namespace is written ``"ns::op"``. A name stands for
all of its out-of-place overloads; out= and in-place overloads are never cast (they write into a
tensor whose dtype is fixed), as in PyTorch's autocast. `ALIASES` maps the few
``torch.nn.functional`` names whose ATen operator is named differently.

The defaults are the union of the lists that the terms "white list" and "black list" come from:

* PyTorch autocast, CUDA and CPU (``aten/src/ATen/autocast_mode.cpp`` and ``autocast_mode.h``,
  https://github.com/pytorch/pytorch/blob/v2.13.0/aten/src/ATen/autocast_mode.cpp): its
  ``lower_precision_fp`` ops are white, its ``fp32``, ``fp32_set_opt_dtype`` and
  ``fp32_append_dtype`` ops are black. ``binary_cross_entropy``, which CUDA autocast refuses, is
  black (computed in fp32) like on CPU.
* NVIDIA Apex AMP O1 (``apex/amp/lists/{functional,torch,tensor}_overrides.py``,
  https://github.com/NVIDIA/apex/tree/master/apex/amp/lists): ``FP16_FUNCS`` white, ``FP32_FUNCS``
  black; it adds ``std`` and ``var``. Its Python-only functions map onto ATen ops already listed
  (``F.softmin`` and ``F.normalize`` call ``softmax`` and ``norm``, ``F.interpolate`` the
  ``upsample_*`` ops; ``local_response_norm`` and ``multilabel_soft_margin_loss`` have no op).

Ops in neither list follow their inputs: the widest floating dtype among them (see ``kernels.py``).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Iterable, Optional

import torch

from xirang_ds.compat.torch import OpOverload, OpOverloadPacket, all_op_names, op_schema, ops_with_kernel

DEFAULT_TOKEN = "default"
"""The token that stands for a built-in list."""
REMOVE_PREFIX = "-"
"""A token ``"-name"`` removes ``name`` from the list built so far."""

LOW_PRECISION_DEFAULT: tuple[str, ...] = (
    # convolutions
    "_convolution", "convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d", "conv_transpose3d", "cudnn_convolution", "cudnn_convolution_transpose", "prelu",
    # BLAS
    "addmm", "_addmm_activation", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot",
    "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    # recurrent cells
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
    "rnn_relu_cell", "mkldnn_rnn_layer",
    # attention
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention", "_native_multi_head_attention",
)
"""Built-in white list: ops that run in the low-precision dtype."""

FP32_DEFAULT: tuple[str, ...] = (
    # pointwise
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow", "softplus", "polar", "view_as_complex",
    # normalisation
    "layer_norm", "native_layer_norm", "group_norm", "rms_norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "norm", "linalg_vector_norm", "linalg_matrix_norm", "renorm",
    # softmax, reductions and scans
    "softmax", "log_softmax", "logsumexp", "sum", "prod", "cumsum", "cumprod", "std", "var", "trace",
    "quantile", "nanquantile", "dist", "pdist", "cdist",
    # losses
    "cross_entropy_loss", "nll_loss", "nll_loss2d", "poisson_nll_loss", "cosine_embedding_loss",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "multilabel_margin_loss_forward", "soft_margin_loss",
    "triplet_margin_loss", "multi_margin_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits",
    "ctc_loss",
    # resampling, pooling and padding
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    "grid_sampler", "grid_sampler_2d", "_grid_sampler_2d_cpu_fallback", "grid_sampler_3d", "avg_pool3d",
    "max_pool3d", "max_unpool2d", "max_unpool3d", "adaptive_avg_pool3d", "adaptive_max_pool3d",
    "fractional_max_pool2d", "fractional_max_pool3d", "reflection_pad1d", "reflection_pad2d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d",
    # spectral and linear algebra
    "stft", "fft_fft", "fft_ifft", "fft_fft2", "fft_ifft2", "fft_fftn", "fft_ifftn", "fft_rfft", "fft_irfft",
    "fft_rfft2", "fft_irfft2", "fft_rfftn", "fft_irfftn", "fft_hfft", "fft_ihfft", "cholesky",
    "cholesky_inverse", "cholesky_solve", "inverse", "lu_solve", "orgqr", "ormqr", "pinverse", "geqrf",
    "_lu_with_info", "qr", "svd", "triangular_solve", "linalg_cond", "linalg_matrix_rank", "linalg_solve",
    "linalg_cholesky", "linalg_cholesky_ex", "linalg_svd", "linalg_svdvals", "linalg_eig", "linalg_eigvals",
    "linalg_eigh", "linalg_eigvalsh", "linalg_inv", "linalg_inv_ex", "linalg_householder_product",
    "linalg_tensorinv", "linalg_tensorsolve", "linalg_qr", "linalg_lstsq",
    # quantisation
    "fake_quantize_per_tensor_affine",
)
"""Built-in black list: ops that always run in fp32."""

TORCH_CPU_AUTOCAST_LOW: frozenset[str] = frozenset({
    "conv1d", "conv2d", "conv3d", "bmm", "mm", "linalg_vecdot", "baddbmm", "addmm", "_addmm_activation", "addbmm",
    "linear", "_convolution", "matmul", "conv_tbc", "mkldnn_rnn_layer", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "scaled_dot_product_attention", "_native_multi_head_attention"})
"""PyTorch's CPU autocast ``lower_precision_fp`` ops (``autocast_mode.cpp``); its ``promote`` ops are
``cat``, ``stack`` and ``index_copy``, every other op it lists is ``fp32``."""

ALIASES: dict[str, str] = {
    "cross_entropy": "cross_entropy_loss",
    "F.cross_entropy": "cross_entropy_loss",
    "__matmul__": "matmul",
}
"""Functional names whose ATen operator has another name."""


@dataclass(frozen=True)
class OpLists:
    """The resolved lists: qualified overload names (``"aten::softmax.int"``, ``"aten::mm"``).

    Attributes:
        low: overloads that run in the low-precision dtype.
        fp32: overloads that run in fp32.
        promote: overloads that run in the widest floating dtype of their inputs even where the op
            does not promote by itself (Apex ``register_promote_function`` registrations).
    """

    low: frozenset[str]
    fp32: frozenset[str]
    promote: frozenset[str] = frozenset()

    def policy_of(self, overload: str) -> str:
        """``"low"``, ``"fp32"``, ``"promote"`` or ``"follow"`` for a qualified overload name."""
        if overload in self.low:
            return "low"
        if overload in self.fp32:
            return "fp32"
        return "promote" if overload in self.promote else "follow"


class OpNameError(ValueError):
    """A name that does not resolve to an out-of-place operator; the message says why and the fix."""


def qualified(namespace: str, op: str, overload: str) -> str:
    """``aten::softmax.int``; the default overload has no suffix (``aten::mm``)."""
    return f"{namespace}::{op}" + ("" if overload == "default" else f".{overload}")


def split_name(name: str) -> tuple[str, str, Optional[str]]:
    """``"aten::pow.Scalar"`` -> ``("aten", "pow", "Scalar")``; aliases and ``aten::`` applied."""
    text = ALIASES.get(name.strip(), name.strip())
    namespace, sep, rest = text.partition("::")
    if not sep:
        namespace, rest = "aten", text
    op, dot, overload = rest.partition(".")
    op = ALIASES.get(op, op)
    return namespace, op, (overload if dot else None)


def _is_out_of_place(overload: OpOverload) -> bool:
    schema = op_schema(overload)
    return not schema.is_mutable and not any(a.is_out for a in schema.arguments)


@lru_cache(maxsize=None)
def _packet(namespace: str, op: str) -> Optional[OpOverloadPacket]:
    try:
        packet = getattr(getattr(torch.ops, namespace), op)
    except (AttributeError, RuntimeError):
        return None
    return packet if isinstance(packet, OpOverloadPacket) else None


@lru_cache(maxsize=1)
def _all_op_names() -> tuple[str, ...]:
    names = {n.split("::", 1)[-1].split(".", 1)[0] for n in all_op_names()}
    return tuple(sorted(names))


def resolve(name: str) -> tuple[str, ...]:
    """The qualified out-of-place overloads a list entry stands for.

    Raises:
        OpNameError: the name is not an operator of this torch build, names an unknown overload,
            or has only in-place/out= overloads.
    """
    namespace, op, overload = split_name(name)
    packet = _packet(namespace, op) if op and op.isidentifier() else None
    if packet is None:
        close = difflib.get_close_matches(op, _all_op_names(), n=3, cutoff=0.75) if namespace == "aten" else []
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise OpNameError(f"{name!r} is not a torch operator (names are ATen ops as in torch.ops.aten.<name>, "
                          f"or 'namespace::op'){hint}")
    overloads = packet.overloads()
    if overload is not None:
        if overload not in overloads:
            raise OpNameError(f"{name!r}: {namespace}::{op} has no overload {overload!r}; its overloads are "
                              f"{', '.join(sorted(overloads))}")
        if not _is_out_of_place(getattr(packet, overload)):
            raise OpNameError(f"{name!r} writes into an argument (in-place or out=) and cannot be cast; "
                              f"list the out-of-place overload instead")
        return (qualified(namespace, op, overload),)
    found = tuple(qualified(namespace, op, o) for o in overloads if _is_out_of_place(getattr(packet, o)))
    if not found:
        raise OpNameError(f"{name!r} has only in-place or out= overloads, which cannot be cast; list the "
                          f"out-of-place op instead (for example {op.rstrip('_')!r})")
    return found


def resolve_defaults(names: Iterable[str]) -> frozenset[str]:
    """Overloads of the built-in names that exist in this torch build (the rest are skipped)."""
    out: set[str] = set()
    for name in names:
        try:
            out.update(resolve(name))
        except OpNameError:
            continue
    return frozenset(out)


@dataclass
class _Composed:
    overloads: set[str] = field(default_factory=set)
    explicit: set[str] = field(default_factory=set)


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def compose(tokens: Iterable[str], default: Iterable[str], path: str,
            problems: list[tuple[str, str]]) -> _Composed:
    """Apply ``"default"``, ``"name"`` and ``"-name"`` tokens in order; problems go to ``problems``.

    Args:
        tokens: the list as written.
        default: the names ``"default"`` stands for.
        path: the list's dotted path for messages (``"xirang.precision.fp32_ops"``).
        problems: where ``(path, message)`` pairs are appended.
    """
    built = _Composed()
    seen: set[str] = set()
    for i, token in enumerate(tokens):
        where = f"{path}[{i}]"
        if token in seen:
            problems.append((where, f"{token!r} is listed twice; remove one"))
            continue
        seen.add(token)
        if token == DEFAULT_TOKEN:
            built.overloads |= resolve_defaults(default)
            continue
        remove = token.startswith(REMOVE_PREFIX)
        name = token[len(REMOVE_PREFIX):] if remove else token
        try:
            overloads = set(resolve(name))
        except OpNameError as e:
            problems.append((where, str(e)))
            continue
        if remove:
            if not overloads & built.overloads:
                problems.append((where, f"{token!r} removes nothing: {name!r} is not in the list built so far "
                                        f"(write \"default\" before it, or drop the entry)"))
            built.overloads -= overloads
            built.explicit -= overloads
        else:
            built.overloads |= overloads
            built.explicit |= overloads
    return built


def short(overload: str) -> str:
    """``aten::softmax.int`` -> ``softmax`` (the name users write)."""
    namespace, _, rest = overload.partition("::")
    op = rest.split(".", 1)[0]
    return op if namespace == "aten" else f"{namespace}::{op}"


def build_op_lists(low_tokens: Iterable[str], fp32_tokens: Iterable[str], path: str,
                   problems: list[tuple[str, str]], registered: Optional["Registrations"] = None) -> OpLists:
    """Both lists from the config's tokens, with registrations (Apex) laid over the defaults.

    An op in both final lists is a problem naming both fixes. A registration moves an op out of the
    other list's defaults, but not out of an entry the user wrote there (that is a conflict).
    """
    low = compose(low_tokens, LOW_PRECISION_DEFAULT, _join(path, "low_precision_ops"), problems)
    fp32 = compose(fp32_tokens, FP32_DEFAULT, _join(path, "fp32_ops"), problems)
    promote: set[str] = set()
    if registered is not None:
        for names, mine, other in ((registered.half, low, fp32), (registered.float, fp32, low)):
            for name in names:
                overloads = set(resolve(name))  # `apex_lists` passes resolvable names only
                mine.overloads |= overloads
                other.overloads -= overloads - other.explicit
        for name in registered.promote:
            promote |= set(resolve(name))
    both = low.overloads & fp32.overloads
    if both:
        ops = sorted({short(o) for o in both})
        shown = ", ".join(ops[:8]) + (f" and {len(ops) - 8} more" if len(ops) > 8 else "")
        problems.append((_join(path, "fp32_ops"), f"{shown} {'is' if len(ops) == 1 else 'are'} in both low_precision_ops "
                                             f"and fp32_ops; remove {'it' if len(ops) == 1 else 'them'} from one, "
                                             f"e.g. add \"-{ops[0]}\" to fp32_ops or to low_precision_ops"))
    listed = promote & (low.overloads | fp32.overloads)
    if listed:
        problems.append((path, f"apex.amp.register_promote_function registered "
                                    f"{', '.join(sorted({short(o) for o in listed}))}, which the lists also "
                                    f"name; remove it from low_precision_ops/fp32_ops"))
    return OpLists(low=frozenset(low.overloads), fp32=frozenset(fp32.overloads),
                   promote=frozenset(promote - listed))


def native_autocast_ops(key: str) -> frozenset[str]:
    """Qualified overloads that have a kernel at ``key`` (PyTorch's own list, read from the dispatcher)."""
    return ops_with_kernel(key)


def torch_cpu_autocast_lists() -> OpLists:
    """PyTorch's own CPU autocast lists as an `OpLists`, read from the dispatcher (for comparisons:
    with them the plugin computes exactly what ``torch.autocast("cpu")`` computes)."""
    native = native_autocast_ops("AutocastCPU")
    low = frozenset(o for o in native if short(o) in TORCH_CPU_AUTOCAST_LOW)
    promote = {"cat", "stack", "index_copy"}
    return OpLists(low=low, fp32=frozenset(o for o in native - low if short(o) not in promote))


@dataclass(frozen=True)
class Registrations:
    """Op names registered outside the config (NVIDIA Apex ``amp.register_*_function``)."""

    half: tuple[str, ...] = ()
    float: tuple[str, ...] = ()
    promote: tuple[str, ...] = ()


__all__ = ["ALIASES", "DEFAULT_TOKEN", "FP32_DEFAULT", "LOW_PRECISION_DEFAULT", "OpLists", "OpNameError",
           "Registrations", "TORCH_CPU_AUTOCAST_LOW", "build_op_lists", "compose", "resolve", "short",
           "torch_cpu_autocast_lists"]
