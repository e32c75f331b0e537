"""Varlen flash attention: the only module that knows torch varlen / flash-attn / FA4 signatures.

Shapes: T packed tokens, S sequences, H heads, K head dim.

Every implementation has `reference.varlen_attention`'s signature
`(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None)`, with FA's window
convention (query i sees keys i - left .. i + right, -1 unbounded; ModernBERT local = (64, 64)):

- "torch": `torch.nn.attention.varlen.varlen_attn(..., scale=, window_size=)` (torch >= 2.11; its
  own custom op with autograd, torch's bundled FA2).
- "aten": `aten._flash_attention_forward/_backward` with `window_size_left/right` (torch 2.9,
  2.10), wrapped here in the custom ops `packedenc::flash_varlen_fwd/_bwd` with autograd. Their
  CPU implementation is the reference, so CPU CI exercises registration, compile and autograd.
- "fa2": `flash_attn.flash_attn_varlen_func` (flash-attn 2.x), when installed.
- "fa4": `flash_attn.cute.flash_attn_varlen_func` (FlashAttention-4, sm90+), when installed.

`varlen_attention` (registered as the "flash" backend) uses the first available of fa4 (sm90+),
fa2, torch, aten, and falls back to the reference where flash kernels do not apply (CPU tensors,
fp32, head dims flash does not support). To force one implementation, replace the table entry:
`dataclasses.replace(packedenc.get_ops("auto", "cuda"), varlen_attention=flash.IMPLS["aten"])`.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from typing import Callable

import torch
from torch import Tensor

from packedenc.kernels import reference, register_impl
from packedenc.kernels.reference import backward as reference_bwd

__all__ = ["varlen_attention", "IMPLS", "BEST"]

log = logging.getLogger("packedenc")


def _fast_ok(q: Tensor, k: Tensor, v: Tensor) -> bool:
    K = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == q.dtype == v.dtype
        and K % 8 == 0
        and K <= 256
    )


# ---- torch >= 2.11 ----------------------------------------------------------------------------


def _find_torch_varlen() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    return varlen_attn if "window_size" in params and "scale" in params else None  # 2.10 has neither


_VARLEN_ATTN = _find_torch_varlen()


def torch_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None):
    return _VARLEN_ATTN(
        q_THK, k_THK, v_THK, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        scale=scale, window_size=(int(window[0]), int(window[1])),
    )


# ---- aten (torch 2.9 / 2.10), our own custom op -------------------------------------------------


def _aten_has_window() -> bool:
    try:
        schema = torch.ops.aten._flash_attention_forward.default._schema
    except (AttributeError, RuntimeError):
        return False
    return any(a.name == "window_size_left" for a in schema.arguments)


@torch.library.custom_op("packedenc::flash_varlen_fwd", mutates_args=(), device_types="cpu")
def _flash_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, left: int, right: int,
    scale: float | None,
) -> tuple[Tensor, Tensor]:
    out = reference.varlen_attention(q, k, v, cu_seqlens, max_seqlen, (left, right), scale)
    # The CPU backward recomputes the probabilities; this lse is never read.
    return out, q.new_zeros((q.shape[1], q.shape[0]), dtype=torch.float32)


@_flash_fwd.register_kernel("cuda")
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale):
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False,
        scale=scale, window_size_left=left, window_size_right=right,
    )
    return out, lse


@_flash_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("packedenc::flash_varlen_bwd", mutates_args=(), device_types="cpu")
def _flash_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
    max_seqlen: int, left: int, right: int, scale: float | None,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = reference_bwd.varlen_attention_bwd(do, q, k, v, cu_seqlens, (left, right), scale)
    return dq, dk, dv


@_flash_bwd.register_kernel("cuda")
def _(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale):
    rng = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # dropout is 0: never read
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        do.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        0.0, False, rng, unused, scale=scale, window_size_left=left, window_size_right=right,
    )
    return dq, dk, dv


@_flash_bwd.register_fake
def _(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fwd_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, left, right, scale = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.args = (max_seqlen, left, right, scale)


def _fwd_backward(ctx, do, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.packedenc.flash_varlen_bwd(do, q, k, v, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None


_flash_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


def aten_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None):
    left, right = int(window[0]), int(window[1])
    return torch.ops.packedenc.flash_varlen_fwd(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, left, right, scale)[0]


# ---- flash-attn 2 and 4 (optional installs) -----------------------------------------------------


def fa2_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None):
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q_THK, k_THK, v_THK, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, dropout_p=0.0, softmax_scale=scale,
        causal=False, window_size=(int(window[0]), int(window[1])),
    )


def fa4_varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=(-1, -1), scale=None):
    from flash_attn.cute import flash_attn_varlen_func

    left, right = (None if int(w) < 0 else int(w) for w in window)  # FA4: None = unbounded
    res = flash_attn_varlen_func(
        q_THK, k_THK, v_THK, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, softmax_scale=scale, causal=False,
        window_size=(left, right),
    )
    return res[0] if isinstance(res, tuple) else res


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _available() -> dict[str, Callable]:
    impls: dict[str, Callable] = {}
    if torch.cuda.is_available():
        major, _ = torch.cuda.get_device_capability()
        if major >= 9 and _installed("flash_attn") and _installed("flash_attn.cute"):
            impls["fa4"] = fa4_varlen_attention
        if _installed("flash_attn") and _installed("flash_attn.flash_attn_interface"):
            impls["fa2"] = fa2_varlen_attention
    if _VARLEN_ATTN is not None:
        impls["torch"] = torch_varlen_attention
    if _aten_has_window():
        impls["aten"] = aten_varlen_attention
    return impls


IMPLS: dict[str, Callable] = _available()
BEST: str | None = next(iter(IMPLS), None)
if BEST is None:
    raise ImportError("no varlen flash attention with a window: needs torch >= 2.9 or flash-attn")
_BEST_FN = IMPLS[BEST]


def varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> Tensor:
    """Non-causal varlen attention with an FA window, on the best installed flash kernel.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed; last dim contiguous (other strides are free).
        cu_seqlens: (S+1,) int32 on the same device. max_seqlen: host int >= longest sequence.
        window: (left, right), -1 unbounded. scale: default K ** -0.5.
    Return:
        (T, H, K) in q's dtype. CPU tensors, fp32 and unsupported head dims use the reference.
    """
    if not _fast_ok(q_THK, k_THK, v_THK):
        return reference.varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)
    return _BEST_FN(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale)


register_impl("flash", "varlen_attention", varlen_attention)
