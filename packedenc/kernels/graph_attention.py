"""CUDA implementation of `graph_attention` on torch's own varlen kernels (no flash-attn package).

Registered as the "flash" backend's `graph_attention` when imported. Two aten kernels do the work,
both called with packed (total, heads, head_dim) tensors and `cu_seqlens`, both with autograd
formulas in torch (FlashAttentionBackward0 / EfficientAttentionBackward0):
- bf16 / fp16: `aten._flash_attention_forward` (FA2 inside torch), separate query / key boundaries;
- fp32: `aten._efficient_attention_forward` (the cutlass memory-efficient kernel), which runs fp32
  and takes the same boundaries with a batch dimension of one.

GiGL's per-key, per-head bias `b[k, h]` does not fit either kernel's varlen path (the efficient
kernel's dense bias would be T x T). It is folded into the head dimension instead, exactly:
    q' = [q, 1],  k' = [k, b / scale],  v' = [v, 0]   =>   scale * q'.k' = scale * q.k + b[k, h]
and the head dim is zero-padded to a multiple of 8 (the kernels' alignment). `fold_key_bias` and
`pad_head_dim` are plain torch, so their algebra is tested on the CPU against the reference.

Shapes: Q packed queries, T packed keys, S sequences, H heads, K head dim.

Status: written without a GPU at hand; the GPU tests (`-m gpu`) have not run yet.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.kernels import register_impl

__all__ = ["graph_attention", "fold_key_bias", "pad_head_dim", "aten_varlen_attention"]

_MAX_FLASH_HEAD_DIM = 256  # FA2's limit; larger heads go to the efficient kernel


def fold_key_bias(
    q_QHK: Tensor, k_THK: Tensor, v_THK: Tensor, key_bias_TH: Tensor, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Append one column so that `scale * q'.k'` carries `key_bias[k, h]` (see module docstring).

    The bias column is computed in fp32 and rounded once to the activation dtype, the same single
    rounding GiGL's padded path applies when it casts its bias to the sequence dtype.
    """
    Q, H, _ = q_QHK.shape
    ones = q_QHK.new_ones((Q, H, 1))
    kb = (key_bias_TH.float() / scale).to(k_THK.dtype)[..., None]
    return (
        torch.cat([q_QHK, ones], dim=-1),
        torch.cat([k_THK, kb], dim=-1),
        torch.cat([v_THK, torch.zeros_like(kb)], dim=-1),
    )


def pad_head_dim(x: Tensor, multiple: int = 8) -> Tensor:
    """Zero-pad the last dim to a multiple of `multiple` (zeros change neither scores nor outputs)."""
    extra = -x.shape[-1] % multiple
    return F.pad(x, (0, extra)) if extra else x


def aten_varlen_attention(
    q_QHK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float,
) -> Tensor:
    """Bias-free packed attention on torch's kernels; head dim must already be a multiple of 8."""
    lowp = q_QHK.dtype in (torch.float16, torch.bfloat16)
    if lowp and q_QHK.shape[-1] <= _MAX_FLASH_HEAD_DIM:
        out = torch.ops.aten._flash_attention_forward(
            q_QHK, k_THK, v_THK, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            0.0, False, False, scale=scale,
        )
        return out[0]
    # The backward needs the log-sum-exp, which the kernel only writes when asked.
    need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (q_QHK, k_THK, v_THK))
    out = torch.ops.aten._efficient_attention_forward(
        q_QHK[None], k_THK[None], v_THK[None], None, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, 0.0, 0, need_lse, scale=scale,
    )
    return out[0][0]


def graph_attention(
    q_QHK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    key_bias_TH: Tensor | None = None,
    scale: float | None = None,
    *,
    core: Callable[..., Tensor] = aten_varlen_attention,
) -> Tensor:
    """`reference.graph_attention` on torch's CUDA varlen kernels (same signature and result).

    `core` is the bias-free kernel call; tests pass the reference there to check the folding on
    the CPU.
    """
    K = q_QHK.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if key_bias_TH is not None:
        q_QHK, k_THK, v_THK = fold_key_bias(q_QHK, k_THK, v_THK, key_bias_TH, scale)
    q, k, v = (pad_head_dim(t) for t in (q_QHK, k_THK, v_THK))
    if cu_seqlens_q.dtype != torch.int32:
        cu_seqlens_q = cu_seqlens_q.to(torch.int32)
    if cu_seqlens_k.dtype != torch.int32:
        cu_seqlens_k = cu_seqlens_k.to(torch.int32)
    out = core(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
    return out[..., :K]


register_impl("flash", "graph_attention", graph_attention)
