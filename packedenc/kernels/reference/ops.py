"""Plain-torch reference of every op the models call: the executable spec.

Each function has the name and signature of the op in `packedenc.kernels.Ops`. Math is done in
fp32 and the result is returned in the input dtype with one rounding, unless a comment says
otherwise. Nothing here is optimised beyond plain torch; it runs on the CPU (it is the CPU's
backend) and is what every kernel is tested against.

Shapes: T packed tokens, S sequences, D hidden, H heads, K head dim, F mlp width, V vocab.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.errors import ConfigError, InputError
# varlen attention and DeBERTa's ops live in their own files; they are part of this module's
# namespace (the Ops table)
from packedenc.kernels.reference.attention import graph_attention, varlen_attention
from packedenc.kernels.reference.deberta import (
    deberta_attention, log_bucket_position, relative_positions, varlen_conv1d,
)

__all__ = [
    "linear",
    "linear_add",
    "layer_norm",
    "add_layer_norm",
    "embed_layer_norm",
    "activation",
    "glu",
    "linear_glu",
    "rope_inv_freq",
    "rope_cos_sin",
    "rotary",
    "varlen_attention",
    "graph_attention",
    "graph_readout",
    "log_bucket_position",
    "relative_positions",
    "deberta_attention",
    "varlen_conv1d",
    "linear_cross_entropy",
    "rotary_attention",
    "compose_rotary_attention",
    "compose_linear_glu",
    "layer_norm_linear_glu",
    "compose_layer_norm_linear_glu",
    "layer_norm_linear",
    "compose_layer_norm_linear",
]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias with weight in HF's (out, in) layout. fp32 accumulate (cuBLAS / CPU)."""
    return F.linear(x, weight, bias)


def linear_add(x_TX: Tensor, weight: Tensor, bias: Tensor | None, residual_TD: Tensor,
               overwrite_input: bool = False) -> Tensor:
    """residual + x @ weight.T + bias as one GEMM (beta = 1: cuBLAS adds the residual in its
    epilogue), rounded once: a block's output projection added to the residual stream.

    Arguments: x_TX (T, X); weight (D, X) in HF's (out, in) layout; bias (D,) or None; residual_TD
        (T, D). overwrite_input: the sum may be written into residual_TD (the caller gives it up). An
        out-of-place addmm copies the residual into its output first (a full extra pass over T x D),
        so eager inference, which owns its residual stream, passes True.
    Return: (T, D), residual_TD itself when overwritten.
    """
    if x_TX.dim() != 2 or residual_TD.shape != (x_TX.shape[0], weight.shape[0]):
        raise InputError(f"linear_add: x {tuple(x_TX.shape)} @ weight.T {tuple(weight.shape[::-1])} does not "
                         f"match the residual {tuple(residual_TD.shape)}")
    if not x_TX.dtype == weight.dtype == residual_TD.dtype:  # (devices: torch's own error names them)
        raise InputError(f"linear_add: x, weight and residual must share a dtype, got "
                         f"{x_TX.dtype} / {weight.dtype} / {residual_TD.dtype}")
    if not overwrite_input or residual_TD.requires_grad and torch.is_grad_enabled():
        return torch.addmm(residual_TD if bias is None else residual_TD + bias, x_TX, weight.t())
    if bias is not None:
        residual_TD.add_(bias)
    return residual_TD.addmm_(x_TX, weight.t())


def linear_cross_entropy(x_MD: Tensor, weight_VD: Tensor, bias_V: Tensor | None, targets_M: Tensor) -> Tensor:
    """Per-row cross-entropy of the logits `linear(x, weight, bias)` (rounded to x's dtype), in fp32.

    The MLM loss's decoder + loss as one op, so that a kernel may skip materialising the logits.
    Arguments:
        x_MD: (M, D) features of the scored rows. weight_VD: (V, D). bias_V: (V,) or None.
        targets_M: (M,) int ids in [0, V), or -100 to ignore a row (loss 0, no gradient).
    Return:
        (M,) fp32, F.cross_entropy(logits.float(), targets, reduction="none").
    """
    return F.cross_entropy(linear(x_MD, weight_VD, bias_V).float(), targets_M, reduction="none")


def layer_norm(x_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim with fp32 statistics and one rounding to x's dtype."""
    w = weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x_TD.float(), (x_TD.shape[-1],), w, b, eps).to(x_TD.dtype)


def add_layer_norm(
    x_TD: Tensor, residual_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
    x_bias: Tensor | None = None, keep_sum: bool = True, overwrite_input: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(LayerNorm(x + residual), x + residual). The sum is rounded to x's dtype *before* the
    statistics, as two separate eager ops would do, and that rounded sum is the new residual.
    `overwrite_input`: the caller no longer needs x and residual, so an implementation may write
    its outputs into them (the Triton one does in eager inference: no allocation); ignored here.

    `x_bias` (D,) in x's dtype, or None: the bias of the linear layer that produced x, moved here
    (the GEMM runs without it) so that kernels get its gradient while they read the sum's. The sum
    is then x + x_bias + residual, formed in fp32 in that order and rounded once. `keep_sum` False
    returns (y, None): post-LN layers drop the sum, and kernels then need not write it."""
    if x_bias is None:
        s_TD = x_TD + residual_TD
    else:
        check_bias("add_layer_norm", x_bias, x_TD, "x_bias")
        dtype = torch.promote_types(x_TD.dtype, residual_TD.dtype)
        s_TD = (x_TD.float() + x_bias.float() + residual_TD.float()).to(dtype)
    return layer_norm(s_TD, weight, bias, eps), s_TD if keep_sum else None


def check_bias(op: str, bias: Tensor, x: Tensor, name: str = "bias") -> None:
    """A fused bias must be a (x.shape[-1],) tensor of x's dtype on x's device (InputError)."""
    if not isinstance(bias, Tensor):
        raise InputError(f"{op}: {name} must be a tensor or None, got {type(bias).__name__}")
    if bias.dim() != 1 or bias.shape[0] != x.shape[-1]:
        raise InputError(f"{op}: {name} must have shape ({x.shape[-1]},) (the last dim of x, "
                         f"{tuple(x.shape)}), got {tuple(bias.shape)}")
    if bias.dtype != x.dtype:
        raise InputError(f"{op}: {name} is {bias.dtype} but x is {x.dtype}; cast it with .to({x.dtype})")
    if bias.device != x.device:
        raise InputError(f"{op}: {name} is on {bias.device} but x on {x.device}; move it there")


def embed_layer_norm(
    ids_T: Tensor, table_VD: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> Tensor:
    """LayerNorm(table[ids]): the ModernBERT embedding block (gather, then norm)."""
    return layer_norm(F.embedding(ids_T, table_VD), weight, bias, eps)


# HF ACT2FN names -> fp32 functions. Unknown names are a ConfigError, never a silent default.
_ACTS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_python": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "silu": F.silu,
    "swish": F.silu,
    "relu": F.relu,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "linear": lambda x: x,
}

ACTIVATIONS = frozenset(_ACTS)


def check_activation(name: str) -> str:
    if name not in _ACTS:
        raise ConfigError(
            f"activation {name!r} is not supported; packedenc knows {sorted(_ACTS)}"
        )
    return name


def activation(x: Tensor, act: str, overwrite_input: bool = False, bias: Tensor | None = None) -> Tensor:
    """Elementwise activation by HF name, computed in fp32, one rounding: act(x) or act(x + bias).

    `overwrite_input`: the caller no longer needs x, so an implementation may write the result
    into it and return it (the Triton one does in eager inference); ignored here.
    `bias`: (F,) in x's dtype, broadcast over rows (F = x.shape[-1]), or None: the bias of the
    linear layer that produced x, moved here so that kernels get its gradient (the column sums of
    dx) from the backward pass that already reads dy. x + bias is formed in fp32, not rounded."""
    f = _ACTS[check_activation(act)]
    if bias is None:
        return f(x.float()).to(x.dtype)
    check_bias("activation", bias, x)
    return f(x.float() + bias.float()).to(x.dtype)


def glu(u_T2F: Tensor, act: str = "gelu", overwrite_input: bool = False) -> Tensor:
    """act(u[:, :F]) * u[:, F:] (ModernBERT GeGLU: the FIRST half is activated, the second gates).

    fp32 math, one rounding. HF eager in bf16 rounds act(.) before the product (two roundings);
    the difference is at most one ulp per element. `overwrite_input`: the caller no longer needs
    u, so an implementation may write the result into u's first half and return that (T, F) view
    (the Triton one does in eager inference); ignored here.
    """
    a, g = u_T2F.float().chunk(2, dim=-1)
    return (_ACTS[check_activation(act)](a) * g).to(u_T2F.dtype)


def linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """glu(linear(x, weight, bias), act): a gated MLP's input projection and its gate as one op.

    The two steps as two eager ops run them: the GEMM output u (T, 2F) is rounded to x's dtype,
    then act(u[:, :F]) * u[:, F:] in fp32 with one rounding. One op so that a kernel may apply the
    gate in the GEMM's epilogue and never write u.
    Arguments:
        x_TD: (T, D). weight: (2F, D) in HF's (out, in) layout, input rows then gate rows
            (ModernBERT's Wi). bias: (2F,) or None. act: an HF activation name (ModernBERT: "gelu").
    Return:
        (T, F) in x's dtype. An unknown `act` raises ConfigError.
    """
    return compose_linear_glu(linear, glu)(x_TD, weight, bias, act)


def compose_linear_glu(linear_fn: Callable, glu_fn: Callable) -> Callable:
    """`linear_glu` made of a table's own `linear` and `glu` entries, one after the other (the op
    table's last link for the calls no fused kernel takes). u is this call's own temporary, so the
    gate may write into its first half (`overwrite_input`: the Triton gate does in eager inference)."""

    def linear_glu(x_TD: Tensor, weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
        check_activation(act)  # an unknown activation fails before the GEMM runs
        return glu_fn(linear_fn(x_TD, weight, bias), act, overwrite_input=True)

    return linear_glu


def layer_norm_linear_glu(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                          weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
    """linear_glu(layer_norm(x, norm_weight, norm_bias, eps), weight, bias, act): a pre-norm gated
    MLP's norm and input projection as one op (ModernBERT's mlp_norm, Wi and GeGLU in inference,
    where the residual add sits in the GEMM before it). The normalised rows are rounded to x's
    dtype, as the two ops round them; one op so that a kernel may normalise x on its way into the
    GEMM and never write those rows."""
    return compose_layer_norm_linear_glu(layer_norm, linear_glu)(x_TD, norm_weight, norm_bias, eps, weight, bias, act)


def compose_layer_norm_linear_glu(layer_norm_fn: Callable, linear_glu_fn: Callable) -> Callable:
    """`layer_norm_linear_glu` made of a table's own `layer_norm` and `linear_glu` entries (the
    end of its chain)."""

    def layer_norm_linear_glu(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                              weight: Tensor, bias: Tensor | None = None, act: str = "gelu") -> Tensor:
        check_activation(act)  # an unknown activation fails before any kernel runs
        return linear_glu_fn(layer_norm_fn(x_TD, norm_weight, norm_bias, eps), weight, bias, act)

    return layer_norm_linear_glu


def layer_norm_linear(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                      weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """linear(layer_norm(x, norm_weight, norm_bias, eps), weight, bias): a pre-norm block's norm and
    input projection as one op (ModernBERT's attn_norm and Wqkv in inference, where the residual
    add sits in the GEMM before it). The normalised rows are rounded to x's dtype, as the two ops
    round them; one op so that a kernel may normalise x on its way into the GEMM and never write
    those rows.
    Return: (T, N) for weight (N, D) in HF's (out, in) layout."""
    return compose_layer_norm_linear(layer_norm, linear)(x_TD, norm_weight, norm_bias, eps, weight, bias)


def compose_layer_norm_linear(layer_norm_fn: Callable, linear_fn: Callable) -> Callable:
    """`layer_norm_linear` made of a table's own `layer_norm` and `linear` entries (the end of its chain)."""

    def layer_norm_linear(x_TD: Tensor, norm_weight: Tensor, norm_bias: Tensor | None, eps: float,
                          weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return linear_fn(layer_norm_fn(x_TD, norm_weight, norm_bias, eps), weight, bias)

    return layer_norm_linear


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """(K/2,) fp32 inverse frequencies, computed as HF does (int64 arange -> fp32, then pow)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


def rope_cos_sin(positions_T: Tensor, inv_freq: Tensor, scaling: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(cos, sin), each (T, K) fp32 holding `dtype` values: split-half RoPE's tables for these
    positions, as transformers 5.x builds them (fp32 angle pos * inv_freq, both halves alike, times
    scaling, rounded to the activation dtype)."""
    freqs_TK2 = positions_T.float()[:, None] * inv_freq[None, :]
    emb_TK = torch.cat((freqs_TK2, freqs_TK2), dim=-1)
    return (emb_TK.cos() * scaling).to(dtype).float(), (emb_TK.sin() * scaling).to(dtype).float()


def rotary(
    qkv_T3HK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0, with_v: bool = False,
    overwrite_input: bool = False,
) -> tuple[Tensor, ...]:
    """Split-half (GPT-NeoX) RoPE on q and k, read straight from the fused Wqkv output.

    Arguments:
        qkv_T3HK: (T, 3, H, K), the Wqkv output viewed as [q | k | v], heads contiguous.
        positions_T: (T,) int, position of each token inside its own sequence.
        theta: RoPE base for this layer type. scaling: HF's `attention_scaling` (1.0 for default RoPE).
        with_v: also return v_THK = qkv[:, 2] (kernels hand it over as its own tensor in training,
            so the attention's saved q, k, v do not keep the whole qkv alive).
        overwrite_input: the caller no longer needs qkv, so an implementation may rotate it in
            place and return views of it (the Triton one does in eager inference, saving two
            (T, H, K) buffers; here it is ignored).
    Return:
        q_THK, k_THK: (T, H, K) contiguous, in qkv's dtype. As transformers 5.x: cos/sin computed
        in fp32 and rounded to the activation dtype, rotation in fp32, one final rounding.
    """
    K = qkv_T3HK.shape[-1]
    dtype = qkv_T3HK.dtype
    cos_TK, sin_TK = rope_cos_sin(positions_T, rope_inv_freq(K, theta, qkv_T3HK.device), scaling, dtype)
    cos, sin = cos_TK[:, None, :], sin_TK[:, None, :]

    def rot(x_THK: Tensor) -> Tensor:
        x = x_THK.float()
        x1, x2 = x[..., : K // 2], x[..., K // 2 :]
        return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(dtype)

    if with_v:
        return rot(qkv_T3HK[:, 0]), rot(qkv_T3HK[:, 1]), qkv_T3HK[:, 2]
    return rot(qkv_T3HK[:, 0]), rot(qkv_T3HK[:, 1])


def compose_rotary_attention(rotary_fn: Callable, attention_fn: Callable) -> Callable:
    """`rotary_attention` made of a table's own `rotary` and `varlen_attention` entries, one after
    the other (the op table's last link for the calls no fused kernel takes)."""

    def rotary_attention(qkv_T3HK: Tensor, positions_T: Tensor, theta: float, cu_seqlens: Tensor, max_seqlen: int,
                         window: tuple[int, int] = (-1, -1), scale: float | None = None, scaling: float = 1.0,
                         overwrite_input: bool = False, **attention_kwargs) -> Tensor:
        q, k, v = rotary_fn(qkv_T3HK, positions_T, theta, scaling, with_v=True, overwrite_input=overwrite_input)
        return attention_fn(q, k, v, cu_seqlens, max_seqlen, window=window, scale=scale, **attention_kwargs)

    return rotary_attention


def rotary_attention(
    qkv_T3HK: Tensor, positions_T: Tensor, theta: float, cu_seqlens: Tensor, max_seqlen: int,
    window: tuple[int, int] = (-1, -1), scale: float | None = None, scaling: float = 1.0,
    overwrite_input: bool = False, **attention_kwargs,
) -> Tensor:
    """RoPE on q and k of a fused Wqkv output, then varlen attention: `varlen_attention(*rotary(...))`.

    Arguments: `rotary`'s (qkv_T3HK (T, 3, H, K), positions_T, theta, scaling, overwrite_input: the
    caller no longer needs qkv) and `varlen_attention`'s (cu_seqlens, max_seqlen, window, scale,
    and its dropout keywords). A fused kernel applies the rotation as it reads q and k (the rotated
    values rounded to qkv's dtype, as the two ops give) and writes no rotated copy.
    Return: (T, H, K) in qkv's dtype.
    """
    return compose_rotary_attention(rotary, varlen_attention)(
        qkv_T3HK, positions_T, theta, cu_seqlens, max_seqlen, window, scale, scaling, overwrite_input,
        **attention_kwargs)


def graph_readout(
    z_TD: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, max_seqlen: int
) -> Tensor:
    """GiGL's "anchor_neighbor_attention" readout: the anchor plus its attention-weighted neighbours.

    out_s = z_anchor + sum_{t >= 1} w_t z_t,  w = softmax over the sequence's tokens t >= 1 of
    weight . [z_anchor, z_t] + bias. A sequence without neighbours returns its anchor.

    Arguments:
        z_TD: (T, D) packed final states, each sequence's anchor first.
        weight: (1, 2D) GiGL's `_readout_attention.weight` ([:, :D] scores the anchor, [:, D:] the
            neighbour). bias: (1,) or None. cu_seqlens: (S+1,) int32. max_seqlen: host int (unused
            here; kernels may use it).
    Return:
        (S, D) in z's dtype; fp32 math, one rounding.
    """
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    T, D = z_TD.shape
    S = cu_seqlens.numel() - 1
    seg_T = segment_ids(cu_seqlens, T)
    is_anchor_T = positions_from_cu_seqlens(cu_seqlens, T) == 0
    z = z_TD.float()
    w_2D = weight.float().reshape(2, D)
    anchor_SD = z.index_select(0, cu_seqlens[:-1].long())
    s_T = z @ w_2D[1] + (anchor_SD @ w_2D[0]).index_select(0, seg_T)
    if bias is not None:
        s_T = s_T + bias.float()
    s_T = s_T.masked_fill(is_anchor_T, float("-inf"))
    m_S = torch.full((S,), float("-inf"), device=z.device).scatter_reduce(
        0, seg_T, s_T.detach(), reduce="amax", include_self=True
    )
    m_S = torch.where(torch.isfinite(m_S), m_S, torch.zeros_like(m_S))  # anchor-only sequences
    e_T = torch.exp(s_T - m_S.index_select(0, seg_T))  # 0 at anchors
    den_S = torch.zeros(S, device=z.device).index_add(0, seg_T, e_T)
    w_T = e_T / den_S.clamp_min(torch.finfo(torch.float32).tiny).index_select(0, seg_T)
    agg_SD = torch.zeros(S, D, device=z.device).index_add(0, seg_T, w_T[:, None] * z)
    return (anchor_SD + agg_SD).to(z_TD.dtype)
