"""Plain-torch reference of every op the models call: the executable spec.

Each function has the name and signature of the op in `packedenc.kernels.Ops`. Math is done in
fp32 and the result is returned in the input dtype with one rounding, unless a comment says
otherwise. Nothing here is optimised; it runs on the CPU and is what every kernel is tested
against.

Shapes: T packed tokens, S sequences, D hidden, H heads, K head dim, F mlp width, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.errors import ConfigError

__all__ = [
    "linear",
    "layer_norm",
    "add_layer_norm",
    "embed_layer_norm",
    "activation",
    "glu",
    "rope_inv_freq",
    "rotary",
    "varlen_attention",
]


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias with weight in HF's (out, in) layout. fp32 accumulate (cuBLAS / CPU)."""
    return F.linear(x, weight, bias)


def layer_norm(x_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """LayerNorm over the last dim with fp32 statistics and one rounding to x's dtype."""
    w = weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x_TD.float(), (x_TD.shape[-1],), w, b, eps).to(x_TD.dtype)


def add_layer_norm(
    x_TD: Tensor, residual_TD: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    """(LayerNorm(x + residual), x + residual). The sum is rounded to x's dtype *before* the
    statistics, as two separate eager ops would do, and that rounded sum is the new residual."""
    s_TD = x_TD + residual_TD
    return layer_norm(s_TD, weight, bias, eps), s_TD


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


def activation(x: Tensor, act: str) -> Tensor:
    """Elementwise activation by HF name, computed in fp32, one rounding."""
    return _ACTS[check_activation(act)](x.float()).to(x.dtype)


def glu(u_T2F: Tensor, act: str = "gelu") -> Tensor:
    """act(u[:, :F]) * u[:, F:] (ModernBERT GeGLU: the FIRST half is activated, the second gates).

    fp32 math, one rounding. HF eager in bf16 rounds act(.) before the product (two roundings);
    the difference is at most one ulp per element.
    """
    a, g = u_T2F.float().chunk(2, dim=-1)
    return (_ACTS[check_activation(act)](a) * g).to(u_T2F.dtype)


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> Tensor:
    """(K/2,) fp32 inverse frequencies, computed as HF does (int64 arange -> fp32, then pow)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    return 1.0 / (theta**exponent)


def rotary(
    qkv_T3HK: Tensor, positions_T: Tensor, theta: float, scaling: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Split-half (GPT-NeoX) RoPE on q and k, read straight from the fused Wqkv output.

    Arguments:
        qkv_T3HK: (T, 3, H, K), the Wqkv output viewed as [q | k | v], heads contiguous.
        positions_T: (T,) int, position of each token inside its own sequence.
        theta: RoPE base for this layer type. scaling: HF's `attention_scaling` (1.0 for default RoPE).
    Return:
        q_THK, k_THK: (T, H, K) contiguous, in qkv's dtype. As transformers 5.x: cos/sin computed
        in fp32 and rounded to the activation dtype, rotation in fp32, one final rounding.
    """
    K = qkv_T3HK.shape[-1]
    inv_freq = rope_inv_freq(K, theta, qkv_T3HK.device)
    freqs_TK2 = positions_T.float()[:, None] * inv_freq[None, :]
    emb_TK = torch.cat((freqs_TK2, freqs_TK2), dim=-1)
    dtype = qkv_T3HK.dtype
    cos = (emb_TK.cos() * scaling).to(dtype).float()[:, None, :]
    sin = (emb_TK.sin() * scaling).to(dtype).float()[:, None, :]

    def rot(x_THK: Tensor) -> Tensor:
        x = x_THK.float()
        x1, x2 = x[..., : K // 2], x[..., K // 2 :]
        return (x * cos + torch.cat((-x2, x1), dim=-1) * sin).to(dtype)

    return rot(qkv_T3HK[:, 0]), rot(qkv_T3HK[:, 1])


def varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
) -> Tensor:
    """Non-causal attention inside each packed sequence, with an optional FA-style window.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed, no padding.
        cu_seqlens: (S+1,) int32. max_seqlen: host int >= the longest sequence.
        window: (left, right) like flash-attn: query i sees keys j with i - left <= j <= i + right,
            -1 meaning unbounded. ModernBERT local layers use (64, 64).
        scale: softmax scale, default K ** -0.5.
    Return:
        (T, H, K) in q's dtype. fp32 softmax; tokens never see another sequence.

    The reference scatters into a padded (S, H, L, L) grid: O(S * L^2) memory, fine for tests.
    """
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    T, H, K = q_THK.shape
    S = cu_seqlens.numel() - 1
    L = max_seqlen
    scale = K**-0.5 if scale is None else scale
    seq_T = segment_ids(cu_seqlens, T)
    pos_T = positions_from_cu_seqlens(cu_seqlens, T)

    def grid(x_THK: Tensor) -> Tensor:  # (T, H, K) -> (S, H, L, K) fp32, zeros at pads
        g = x_THK.new_zeros((S, L, H, K), dtype=torch.float32)
        return g.index_put((seq_T, pos_T), x_THK.float()).transpose(1, 2)

    lengths_S = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    i = torch.arange(L, device=q_THK.device)
    keep_LL = torch.ones(L, L, dtype=torch.bool, device=q_THK.device)
    left, right = window
    if left >= 0:
        keep_LL &= i[None, :] >= i[:, None] - left
    if right >= 0:
        keep_LL &= i[None, :] <= i[:, None] + right
    key_ok_SL = i[None, :] < lengths_S[:, None]
    # Padded query rows attend to everything so that no row is all -inf: a NaN there would be
    # discarded in the forward but would poison the gradient of k through the softmax backward.
    mask_SLL = (keep_LL[None] & key_ok_SL[:, None, :]) | ~key_ok_SL[:, :, None]

    scores = torch.einsum("shik,shjk->shij", grid(q_THK), grid(k_THK)) * scale
    scores = scores.masked_fill(~mask_SLL[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o_SHLK = torch.einsum("shij,shjk->shik", probs, grid(v_THK))
    return o_SHLK.transpose(1, 2)[seq_T, pos_T].to(q_THK.dtype)
