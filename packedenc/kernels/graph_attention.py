"""CUDA implementation of `graph_attention`: torch's varlen kernels, or packedenc's token-block kernels.

Registered as the "flash" backend's `graph_attention` when imported. One *core* runs each call:
- "triton": `kernels/triton/packed_attention.py`, token-block tiles that short sequences share,
  forward and backward on the fused (T, 3, H, K) qkv buffer. Full layers only (query boundaries =
  key boundaries), fp16 / bf16. The default for those (`LOWP_CORE`): graph sequences are short
  (median ~90 tokens), where per-sequence tiles waste a third to a half of the work.
- "efficient": `aten._efficient_attention_forward/_backward` (cutlass memory-efficient), any
  dtype, own query / key boundaries (the anchor-only last layer). With a fused qkv buffer its
  backward allocates dq, dk, dv as slices of one (T, 3, H, K) tensor (`shared_storage_dqdkdv`),
  returned as the gradient of the buffer: no stack of three gradients, no strided copies. fp32
  always runs here; fp16 / bf16 where "triton" does not apply.
- "flash": `aten._flash_attention_forward` (FA2 inside torch), fp16 / bf16, head dim <= 256 (the
  first implementation; kept for comparison, `benchmarks/graph.py` times all three).

GiGL's per-key, per-head bias `b[k, h]` fits none of the kernels' varlen paths (the efficient
kernel's dense bias would be T x T). It is folded into the head dimension instead, exactly:
    q' = [q, 1],  k' = [k, b / scale],  v' = [v, 0]   =>   scale * q'.k' = scale * q.k + b[k, h]
and, for torch's kernels, the head dim is zero-padded to a multiple of 8 (their alignment). Without
a bias nothing is concatenated or padded (head dims that are multiples of 8 go in as they are).
`fold_key_bias`, `fold_key_bias_qkv` and `pad_head_dim` are plain torch, tested on the CPU.

Shapes: Q packed queries, T packed keys, S sequences, H heads, K head dim.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.kernels import register_impl

__all__ = ["graph_attention", "fold_key_bias", "fold_key_bias_qkv", "pad_head_dim", "aten_varlen_attention",
           "efficient_qkv_attention", "choose_core", "CORES", "LOWP_CORE"]

_MAX_FLASH_HEAD_DIM = 256  # FA2's limit; larger heads go to the efficient kernel
CORES = ("triton", "efficient", "flash")
LOWP_CORE = "triton"  # fp16 / bf16 full layers; see the module docstring


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


# ---- torch's kernels ---------------------------------------------------------------------------


def aten_varlen_attention(
    q_QHK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float, *, flash: bool = False,
) -> Tensor:
    """Bias-free packed attention on torch's kernels (autograd: torch's own formulas).

    `flash=True` takes FA2 for fp16 / bf16 heads <= 256; otherwise the efficient kernel. The head
    dim must already be a multiple of 8.
    """
    lowp = q_QHK.dtype in (torch.float16, torch.bfloat16)
    if flash and lowp and q_QHK.shape[-1] <= _MAX_FLASH_HEAD_DIM:
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


def _dqkv_from_shared(dq: Tensor, dk: Tensor, dv: Tensor) -> Tensor:
    """The (T, 3, H, K) tensor that `shared_storage_dqdkdv` allocated, without a copy when dq, dk,
    dv are its three slices (they are, in torch 2.11-2.13); otherwise a stack (one copy)."""
    _, T, H, K = dq.shape
    want = (3 * H * K * T, 3 * H * K, K, 1)
    shared = (
        dq.untyped_storage().data_ptr() == dk.untyped_storage().data_ptr() == dv.untyped_storage().data_ptr()
        and dq.stride() == dk.stride() == dv.stride() == want
        and dk.storage_offset() - dq.storage_offset() == H * K
        and dv.storage_offset() - dq.storage_offset() == 2 * H * K
    )
    if shared:
        return dq.as_strided((T, 3, H, K), (3 * H * K, H * K, K, 1), dq.storage_offset())
    return torch.stack([dq[0], dk[0], dv[0]], dim=1)


class _EfficientQKV(torch.autograd.Function):
    """Efficient-kernel attention on a fused qkv buffer whose gradient is one (T, 3, H, K) tensor."""

    @staticmethod
    def forward(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float):
        q, k, v = qkv[None].unbind(2)  # (1, T, H, K) views, row stride 3HK
        out, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
            q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, 0, True, scale=scale,
        )
        return out[0], lse, seed, offset

    @staticmethod
    def setup_context(ctx, inputs, output):
        qkv, cu_seqlens, max_seqlen, scale = inputs
        out, lse, seed, offset = output
        ctx.save_for_backward(qkv, out, lse, cu_seqlens, seed, offset)
        ctx.mark_non_differentiable(lse, seed, offset)
        ctx.args = (max_seqlen, scale)

    @staticmethod
    def backward(ctx, dout, *_):
        qkv, out, lse, cu_seqlens, seed, offset = ctx.saved_tensors
        max_seqlen, scale = ctx.args
        q, k, v = qkv[None].unbind(2)
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            dout[None], q, k, v, None, out[None], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, lse,
            0.0, seed, offset, 0, False, scale=scale, shared_storage_dqdkdv=True,
        )
        return _dqkv_from_shared(dq, dk, dv), None, None, None


def efficient_qkv_attention(qkv_T3HK: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    """The efficient kernel on a fused (T, 3, H, K) buffer (head dim a multiple of 8): (T, H, K)."""
    if torch.is_grad_enabled() and qkv_T3HK.requires_grad:
        return _EfficientQKV.apply(qkv_T3HK, cu_seqlens, max_seqlen, scale)[0]
    q, k, v = qkv_T3HK[None].unbind(2)
    out = torch.ops.aten._efficient_attention_forward(
        q, k, v, None, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, 0, False, scale=scale,
    )
    return out[0][0]


def _triton_qkv_attention(qkv_T3HK: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float) -> Tensor:
    from packedenc.kernels.triton.packed_attention import packed_attention  # triton only when chosen

    return packed_attention(qkv_T3HK, cu_seqlens, max_seqlen, scale)


# ---- the op ------------------------------------------------------------------------------------


def _has_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_HAS_TRITON = _has_triton()


def choose_core(dtype: torch.dtype, fused: bool, core: str | None = None, head_dim: int = 64) -> str:
    """The core a call runs on (host values only). `core` forces one where it applies.

    fp32 always runs "efficient" (FA2 takes no fp32; the token-block kernels would run fp32 dots
    without tensor cores). "triton" needs a fused buffer (own query boundaries, as in the
    anchor-only layer, go to "efficient"), Triton installed and head dims <= 256 (with a folded
    key-bias column).
    """
    core = LOWP_CORE if core is None else core
    if core not in CORES:
        raise ValueError(f"unknown graph_attention core {core!r}; choose one of {CORES}")
    if dtype not in (torch.float16, torch.bfloat16):
        return "efficient"
    if core == "triton" and not (fused and _HAS_TRITON and head_dim + 1 <= 256):
        return "efficient"
    return core


def graph_attention(
    q_QHK: Tensor,
    k_THK: Tensor | None,
    v_THK: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    key_bias_TH: Tensor | None = None,
    scale: float | None = None,
    *,
    core: str | Callable[..., Tensor] | None = None,
) -> Tensor:
    """`reference.graph_attention` on CUDA kernels (same signature and result).

    With k_THK = v_THK = None, q_QHK is the fused (T, 3, H, K) qkv buffer of a full layer
    (cu_seqlens_q = cu_seqlens_k); its gradient then stays one tensor.
    `core`: None (the rule in `choose_core`), a core name, or a callable taking
    (q, k, v, cu_q, cu_k, max_q, max_k, scale) with head dims padded to a multiple of 8: tests pass
    the reference there to check the folding and padding on the CPU.
    """
    fused = k_THK is None
    assert fused == (v_THK is None), "graph_attention: give k and v, or neither (fused qkv)"
    K = q_QHK.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if cu_seqlens_q.dtype != torch.int32:
        cu_seqlens_q = cu_seqlens_q.to(torch.int32)
    if cu_seqlens_k.dtype != torch.int32:
        cu_seqlens_k = cu_seqlens_k.to(torch.int32)
    name = core if callable(core) else choose_core(q_QHK.dtype, fused, core, K)

    if fused and name in ("triton", "efficient"):
        qkv = q_QHK if key_bias_TH is None else fold_key_bias_qkv(q_QHK, key_bias_TH, scale)
        if name == "triton":  # any head dim: the kernel masks its head-dim tile
            out = _triton_qkv_attention(qkv, cu_seqlens_k, max_seqlen_k, scale)
        else:
            out = efficient_qkv_attention(pad_head_dim(qkv), cu_seqlens_k, max_seqlen_k, scale)
        return out[..., :K]

    if fused:
        q_QHK, k_THK, v_THK = q_QHK.unbind(1)
    if key_bias_TH is not None:
        q_QHK, k_THK, v_THK = fold_key_bias(q_QHK, k_THK, v_THK, key_bias_TH, scale)
    q, k, v = (pad_head_dim(t) for t in (q_QHK, k_THK, v_THK))
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale)
    out = core(*args) if callable(core) else aten_varlen_attention(*args, flash=name == "flash")
    return out[..., :K]


register_impl("flash", "graph_attention", graph_attention)
