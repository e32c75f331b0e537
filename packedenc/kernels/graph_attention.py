"""GiGL's per-key head bias folded into the head dimension: plain torch, shared by every backend.

Shapes: Q packed queries, T packed keys, H heads, K head dim.

The graph transformer's `graph_attention` adds a per-key, per-head bias `b[k, h]` to every score
of key k in head h. No varlen attention kernel takes such a bias (torch's efficient kernel's dense
bias would be T x T), so the backends fold it into the head dimension instead, exactly:
    q' = [q, 1],  k' = [k, b / scale],  v' = [v, 0]   =>   scale * q'.k' = scale * q.k + b[k, h]
and drop the extra output column. The Triton kernel ("triton" graph_attention,
`triton/attention_op.py`) masks its head-dim tile, so K + 1 goes in as it is; torch's kernels
("flash" graph_attention, `flash.py`) need the head dim zero-padded to a multiple of 8
(`pad_head_dim`). Without a bias nothing is concatenated or padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["fold_key_bias", "fold_key_bias_qkv", "pad_head_dim"]


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


def fold_key_bias_qkv(qkv_T3HK: Tensor, key_bias_TH: Tensor, scale: float) -> Tensor:
    """`fold_key_bias` on a fused (T, 3, H, K) buffer: returns (T, 3, H, K + 1), still fused."""
    kb = (key_bias_TH.float() / scale).to(qkv_T3HK.dtype)
    col_T3H = torch.stack([torch.ones_like(kb), kb, torch.zeros_like(kb)], dim=1)
    return torch.cat([qkv_T3HK, col_T3H[..., None]], dim=-1)


def pad_head_dim(x: Tensor, multiple: int = 8) -> Tensor:
    """Zero-pad the last dim to a multiple of `multiple` (zeros change neither scores nor outputs)."""
    extra = -x.shape[-1] % multiple
    return F.pad(x, (0, extra)) if extra else x

