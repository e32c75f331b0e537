"""Plain-torch packed ModernBERT: the baseline packedenc must beat (issue 3, item 6).

What a careful PyTorch user writes without custom kernels, on the same packed batch and params:
F.layer_norm on the bf16 stream, F.linear (cuBLAS) for every projection, RoPE from bf16 cos/sin
tables gathered by position (plain elementwise ops), F.gelu(a) * g, residual adds, and torch's own
flash varlen attention with the local window (64, 64). No fused kernels, no CUDA graphs.

Attention: `torch.nn.attention.varlen.varlen_attn(..., window_size=...)` where it takes a window,
else `aten._flash_attention_forward(window_size_left/right)`: the same flash kernel either way.
On the CPU (harness smoke tests only) it falls back to packedenc's reference attention.

Shapes: T packed tokens, S sequences, D hidden, H heads, K head dim, F mlp width, P positions.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclasses.dataclass
class State:
    params: Any  # ModernBertParams on the device
    rope: dict[float, tuple[Tensor, Tensor]]  # theta -> (cos_PK, sin_PK) in the activation dtype


def prepare(params: Any) -> State:
    """Precompute the RoPE tables once (as HF does per forward; a table is the plain-torch habit)."""
    cfg = params.config
    K, P = cfg.head_dim, cfg.max_position_embeddings
    dev, dtype = params.final_norm.weight.device, params.final_norm.weight.dtype
    rope = {}
    for theta in {cfg.global_rope_theta, cfg.local_rope_theta}:
        inv_freq = 1.0 / (theta ** (torch.arange(0, K, 2, device=dev).float() / K))
        freqs_PK2 = torch.arange(P, device=dev).float()[:, None] * inv_freq[None, :]
        emb_PK = torch.cat((freqs_PK2, freqs_PK2), dim=-1)
        rope[theta] = (emb_PK.cos().to(dtype), emb_PK.sin().to(dtype))
    return State(params, rope)


@functools.lru_cache(maxsize=None)
def _varlen_attn_with_window() -> Any:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn if "window_size" in inspect.signature(varlen_attn).parameters else None


def flash_varlen(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                 window: tuple[int, int]) -> Tensor:
    """torch's flash varlen attention, non-causal, FA window (left, right) with -1 = unbounded."""
    if q_THK.device.type != "cuda":
        from packedenc import get_ops

        return get_ops("reference").varlen_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window=window)
    fn = _varlen_attn_with_window()
    if fn is not None:
        return fn(q_THK, k_THK, v_THK, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=window)
    left, right = window
    return torch.ops.aten._flash_attention_forward(
        q_THK, k_THK, v_THK, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False,
        window_size_left=None if left < 0 else left, window_size_right=None if right < 0 else right,
    )[0]


def _rotate(x_THK: Tensor, cos_T1K: Tensor, sin_T1K: Tensor) -> Tensor:
    K = x_THK.shape[-1]
    x1, x2 = x_THK[..., : K // 2], x_THK[..., K // 2:]
    return x_THK * cos_T1K + torch.cat((-x2, x1), dim=-1) * sin_T1K


def encode(state: State, ids: Tensor, cu_seqlens: Tensor, max_seqlen: int, positions: Tensor) -> Tensor:
    """(T, D) last hidden state, same definition as `packedenc.encode` (within bf16 rounding).

    Arguments:
        state: from `prepare(params)`. ids: (T,) int64. cu_seqlens: (S+1,) int32 on ids' device.
        max_seqlen: host int. positions: (T,) position of each token inside its sequence.
    """
    p, cfg = state.params, state.params.config
    T, H, K, D, eps = ids.numel(), cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size, cfg.norm_eps

    def norm(x: Tensor, n: Any) -> Tensor:
        return F.layer_norm(x, (D,), n.weight, n.bias, eps)

    tables = {theta: (c[positions][:, None, :], s[positions][:, None, :]) for theta, (c, s) in state.rope.items()}
    x_TD = norm(F.embedding(ids, p.embeddings.tok_embeddings.weight), p.embeddings.norm)
    for i, layer in enumerate(p.layers):
        is_global = cfg.is_global_layer(i)
        cos, sin = tables[cfg.global_rope_theta if is_global else cfg.local_rope_theta]
        window = (-1, -1) if is_global else (cfg.local_attention // 2,) * 2
        h_TD = x_TD if layer.attn_norm is None else norm(x_TD, layer.attn_norm)
        qkv_T3HK = F.linear(h_TD, layer.attn.wqkv.weight, layer.attn.wqkv.bias).view(T, 3, H, K)
        q_THK, k_THK, v_THK = qkv_T3HK.unbind(1)
        o_THK = flash_varlen(_rotate(q_THK, cos, sin), _rotate(k_THK, cos, sin), v_THK, cu_seqlens,
                             max_seqlen, window)
        x_TD = x_TD + F.linear(o_THK.reshape(T, D), layer.attn.wo.weight, layer.attn.wo.bias)
        u_T2F = F.linear(norm(x_TD, layer.mlp_norm), layer.mlp.wi.weight, layer.mlp.wi.bias)
        a_TF, g_TF = u_T2F.chunk(2, dim=-1)
        act = F.gelu(a_TF) if cfg.hidden_activation == "gelu" else _act(cfg.hidden_activation)(a_TF)
        x_TD = x_TD + F.linear(act * g_TF, layer.mlp.wo.weight, layer.mlp.wo.bias)
    return norm(x_TD, p.final_norm)


def _act(name: str) -> Any:
    from packedenc import get_ops

    return functools.partial(get_ops("reference").activation, act=name)
