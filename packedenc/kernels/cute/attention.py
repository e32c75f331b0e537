"""Varlen attention through FlashAttention-4 (CuteDSL, sm90+): the "cute" backend's varlen_attention.

Shapes: T packed tokens, S sequences, H heads, K head dim.

FA4's varlen forward and backward (`flash_attn.cute.interface._flash_attn_fwd` / `_flash_attn_bwd`
of flash-attn-4 4.0.0b36, called by keyword) are wrapped in the custom ops
`packedenc::fa4_varlen_fwd` / `_bwd`, with a fake and a registered autograd, so
`torch.compile(fullgraph=True)` and CUDA-graph capture see one op. Their CPU implementation is the
reference (forward) and the reference gradients (backward): CPU CI checks the registration, the
autograd wiring and compile without FA4 installed. FA4 is imported inside the CUDA kernels only.

The inputs FA4 takes are `covers_fa4`'s (host values only): CUDA fp16 / bf16, head dims 64 and
128 (what the GPU tests check), an sm90+ device, int32 cu_seqlens, no dropout. The op table sends
every other call to the next choice (kernels/__init__.py).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from packedenc.errors import InputError
from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd

__all__ = ["varlen_attention", "covers_fa4", "HEAD_DIMS", "MIN_CAPABILITY"]

HEAD_DIMS = (64, 128)  # FA4 takes more on sm90; these are the ones tests/kernels/test_cute.py checks
MIN_CAPABILITY = (9, 0)  # FA4's kernels: Hopper (sm90) and Blackwell


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)  # a host query, cached: no device sync


def covers_fa4(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
               window: tuple[int, int] = (-1, -1), scale: float | None = None, dropout_p: float = 0.0,
               dropout_seed: int | None = None) -> bool:
    """The varlen_attention calls FA4 takes (host values only)."""
    return (
        q_THK.is_cuda
        and q_THK.dtype in (torch.float16, torch.bfloat16)
        and k_THK.dtype == q_THK.dtype == v_THK.dtype
        and q_THK.shape[-1] in HEAD_DIMS
        and k_THK.shape[-1] == v_THK.shape[-1] == q_THK.shape[-1]
        and cu_seqlens.dtype == torch.int32
        and dropout_p == 0.0
        and _capability(q_THK.device.index if q_THK.device.index is not None else torch.cuda.current_device())
        >= MIN_CAPABILITY
    )


def _fa4_window(left: int, right: int) -> tuple[int | None, int | None]:
    return (None if left < 0 else left), (None if right < 0 else right)  # FA4: None = unbounded


# ---- the forward: (out, lse) ---------------------------------------------------------------------


@torch.library.custom_op("packedenc::fa4_varlen_fwd", mutates_args=(), device_types="cpu")
def _fa4_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, left: int, right: int,
             scale: float | None, need_lse: bool) -> tuple[Tensor, Tensor]:
    out = reference.varlen_attention(q, k, v, cu_seqlens, max_seqlen, (left, right), scale)
    # The CPU backward recomputes the probabilities: this lse is never read.
    return out, q.new_zeros((q.shape[1], q.shape[0]) if need_lse else (0,), dtype=torch.float32)


@_fa4_fwd.register_kernel("cuda")
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale, need_lse):
    from flash_attn.cute.interface import _flash_attn_fwd

    wl, wr = _fa4_window(left, right)
    res = _flash_attn_fwd(q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
                          max_seqlen_k=max_seqlen, softmax_scale=scale, causal=False, window_size_left=wl,
                          window_size_right=wr, return_lse=need_lse)
    out, lse = res[0], res[1]  # (T, H, K); (H, T) fp32 when asked, else None
    return out, (lse if need_lse else q.new_empty((0,), dtype=torch.float32))


@_fa4_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, left, right, scale, need_lse):
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]) if need_lse else (0,), dtype=torch.float32)


# ---- the backward: (dq, dk, dv) ------------------------------------------------------------------


@torch.library.custom_op("packedenc::fa4_varlen_bwd", mutates_args=(), device_types="cpu")
def _fa4_bwd(do: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens: Tensor,
             max_seqlen: int, left: int, right: int, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = reference_bwd.varlen_attention_bwd(do, q, k, v, cu_seqlens, (left, right), scale)
    return dq, dk, dv


@_fa4_bwd.register_kernel("cuda")
def _(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale):
    from flash_attn.cute.interface import _flash_attn_bwd

    wl, wr = _fa4_window(left, right)
    dq, dk, dv = _flash_attn_bwd(q, k, v, out, do.contiguous(), lse, softmax_scale=scale, causal=False,
                                 window_size_left=wl, window_size_right=wr, cu_seqlens_q=cu_seqlens,
                                 cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv


@_fa4_bwd.register_fake
def _(do, q, k, v, out, lse, cu_seqlens, max_seqlen, left, right, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, left, right, scale, need_lse = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], cu_seqlens)
    ctx.args = (max_seqlen, left, right, scale)


def _backward(ctx, do, dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    if lse.numel() == 0:
        raise RuntimeError("fa4 varlen_attention: backward of a forward run without the log-sum-exp "
                           "(inputs that required no gradient)")
    dq, dk, dv = torch.ops.packedenc.fa4_varlen_bwd(do, q, k, v, out, lse, cu_seqlens, *ctx.args)
    return dq, dk, dv, None, None, None, None, None, None


_fa4_fwd.register_autograd(_backward, setup_context=_setup)


def varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> Tensor:
    """Non-causal varlen attention with an FA window on FlashAttention-4; see `reference.varlen_attention`.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed fp16 / bf16 on an sm90+ GPU, K in HEAD_DIMS; last dim
            contiguous (FA4 copies other layouts). On the CPU the op runs the reference.
        cu_seqlens: (S+1,) int32 on the same device. max_seqlen: host int >= longest sequence.
        window: (left, right), -1 unbounded. scale: default K ** -0.5.
    Return:
        (T, H, K) in q's dtype; forward and backward on FA4's kernels.
    """
    if q_THK.is_cuda and not covers_fa4(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen):
        raise InputError(f"cute varlen_attention: FA4 needs fp16 / bf16 q, k, v with a head dim in {HEAD_DIMS}, "
                         f"int32 cu_seqlens and an sm90+ GPU, got q {q_THK.dtype} {tuple(q_THK.shape)}, "
                         f"cu_seqlens {cu_seqlens.dtype} on {q_THK.device}")
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q_THK, k_THK, v_THK))
    left, right = int(window[0]), int(window[1])
    return torch.ops.packedenc.fa4_varlen_fwd(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, left, right, scale,
                                              need_lse)[0]
