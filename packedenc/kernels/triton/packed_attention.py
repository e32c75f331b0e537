"""Packed attention with a backward, on one fused qkv buffer: token-block tiles that short sequences share.

Shapes: T packed tokens, S sequences, H heads, K head dim, M / N rows of a query / key tile.

Why: graph-transformer sequences are short (median ~90 tokens, <= 256). torch's varlen kernels
tile each sequence on its own (FA2: 128 x 128, 48% of the tile work useful on the issue-6
workload; cutlass efficient: 64 x 64, 67%) and launch a program per (sequence, head, tile). Here,
as in `attention.py` (forward-only, inference), the grid runs over blocks of *consecutive packed
rows*: a block finds each row's sequence by a binary search of cu_seqlens, and its key range is the
union of its rows' sequences, one contiguous range looped over in N-row tiles; a per-element mask
(key in the row's own sequence) keeps sequences apart. The same holds with queries and keys
swapped (attention inside a sequence is symmetric), which gives the backward its key-block grid.

Every row attends to its whole sequence (non-causal, no window: the graph transformer's layers);
query and key boundaries are the same cu_seqlens. Inputs and gradients live in one (T, 3, H, K)
buffer, so the projection's single GEMM feeds the forward and the backward writes dq, dk, dv
straight into the gradient of that GEMM's output (no stack, no copies).

Kernels (all grids (blocks, H), fp32 softmax, exp2 with scale * log2(e) folded in):
- `_fwd_kernel`: O and the log-sum-exp in log2 units, LSE2 (H, T) fp32, saved for the backward;
  P is rounded to v's dtype before P @ V (as FA2).
- `_bwd_dq_kernel`: per query block, delta = rowsum(dO * O) (stored, (H, T) fp32) and dq.
- `_bwd_dkdv_kernel`: per key block, loops over the query tiles of its sequences: dk, dv. Runs
  after the dq kernel (same stream), which wrote delta. No atomics: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels import reference
from packedenc.kernels.reference import backward as reference_bwd
from packedenc.kernels.triton._common import cdiv, check_float, direct_launch, next_pow2

__all__ = ["packed_attention", "packed_attention_fwd", "packed_attention_bwd", "TILE_FWD", "TILE_BWD"]

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256

# (owned rows, inner tile rows, num_warps, num_stages). 64 x 32 on 4 warps is what attention.py
# measured best for short packed sequences on an H200. TILE_BWD serves both backward kernels (dq:
# 64 query rows x 32-key tiles; dk/dv: 64 key rows x 32-query tiles). On 4 warps the dq kernel
# spills a little (sm90 ptxas), yet it is faster than 8 on the issue-6 batch (T = 108,487),
# forward + backward 1.63 vs 2.30 ms (`python3 -m benchmarks.graph`, H200, commit e5e974a).
TILE_FWD = (64, 32, 4, 2)
TILE_BWD = (64, 32, 4, 2)


@triton.jit
def _seq_bounds(CU, r, S, n_steps, BLOCK: tl.constexpr):
    """[start, end) of the sequence holding packed row r (r < T): the largest s with cu[s] <= r.

    Invariant cu[lo] <= r < cu[hi]; n_steps >= ceil(log2 S). Empty sequences are skipped (the
    last s with cu[s] <= r owns r)."""
    lo = tl.zeros([BLOCK], tl.int32)
    hi = tl.zeros([BLOCK], tl.int32) + S
    for _ in range(n_steps):
        mid = (lo + hi) >> 1
        go = tl.load(CU + mid) <= r
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return tl.load(CU + lo), tl.load(CU + hi)


@triton.jit(do_not_specialize=["T", "S", "n_steps"])
def _fwd_kernel(
    QKV,  # (T, 3, H, K): q, k, v of every token (head dim contiguous)
    O,  # (T, H, K) out
    LSE2,  # (H, T) fp32 out: log2-sum-exp2 of the scaled scores (STORE_LSE)
    CU,  # (S + 1,) int32 cu_seqlens
    T, S, n_steps,  # tokens, sequences, binary-search steps
    qk_scale,  # softmax scale * log2(e)
    s_t, s_3, s_h,  # qkv strides (elements): token, q/k/v slot, head
    s_ot, s_oh,  # out strides
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    STORE_LSE: tl.constexpr, PREC: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    kl, kh = _seq_bounds(CU, tl.minimum(rows, T - 1), S, n_steps, BLOCK_M)  # row i sees keys [kl_i, kh_i)
    kh = tl.where(rmask, kh, kl)
    blk_lo = tl.min(tl.where(rmask, kl, T), 0)
    blk_hi = tl.max(tl.where(rmask, kh, 0), 0)

    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)[:, None]
    q = tl.load(QKV + r64 * s_t + h * s_h + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for j0 in range(blk_lo, blk_hi, BLOCK_N):
        cols = j0 + offs_n
        cmask = (cols < blk_hi)[:, None] & kmask[None, :]
        c64 = cols.to(tl.int64)[:, None]
        k = tl.load(QKV + s_3 + c64 * s_t + h * s_h + offs_k[None, :], mask=cmask, other=0.0)
        v = tl.load(QKV + 2 * s_3 + c64 * s_t + h * s_h + offs_k[None, :], mask=cmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        keep = (cols[None, :] >= kl[:, None]) & (cols[None, :] < kh[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2 gives exact 0, not NaN
        alpha = tl.exp2(m_i - shift)
        p = tl.exp2(s - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)  # only rows past T have no key
    out = acc / l_safe[:, None]
    tl.store(O + r64 * s_ot + h * s_oh + offs_k[None, :], out.to(O.dtype.element_ty),
             mask=rmask[:, None] & kmask[None, :])
    if STORE_LSE:
        tl.store(LSE2 + h * T + rows, m_i + tl.log2(l_safe), mask=rmask)


@triton.jit(do_not_specialize=["T", "S", "n_steps"])
def _bwd_dq_kernel(
    QKV, O, DO,  # (T, 3, H, K) inputs, (T, H, K) forward output and its gradient
    LSE2, DELTA,  # (H, T) fp32: forward log2-sum-exp2; out: rowsum(dO * O)
    DQKV,  # (T, 3, H, K) out: this kernel writes the q slot
    CU, T, S, n_steps,
    qk_scale, sm_scale,  # scale * log2(e), scale
    s_t, s_3, s_h, s_ot, s_oh, s_dot, s_doh, s_gt, s_g3, s_gh,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PREC: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    kl, kh = _seq_bounds(CU, tl.minimum(rows, T - 1), S, n_steps, BLOCK_M)
    kh = tl.where(rmask, kh, kl)
    blk_lo = tl.min(tl.where(rmask, kl, T), 0)
    blk_hi = tl.max(tl.where(rmask, kh, 0), 0)

    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)[:, None]
    mask2 = rmask[:, None] & kmask[None, :]
    q = tl.load(QKV + r64 * s_t + h * s_h + offs_k[None, :], mask=mask2, other=0.0)
    do = tl.load(DO + r64 * s_dot + h * s_doh + offs_k[None, :], mask=mask2, other=0.0)
    o = tl.load(O + r64 * s_ot + h * s_oh + offs_k[None, :], mask=mask2, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + h * T + rows, delta, mask=rmask)
    lse2 = tl.load(LSE2 + h * T + rows, mask=rmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for j0 in range(blk_lo, blk_hi, BLOCK_N):
        cols = j0 + offs_n
        cmask = (cols < blk_hi)[:, None] & kmask[None, :]
        c64 = cols.to(tl.int64)[:, None]
        k = tl.load(QKV + s_3 + c64 * s_t + h * s_h + offs_k[None, :], mask=cmask, other=0.0)
        v = tl.load(QKV + 2 * s_3 + c64 * s_t + h * s_h + offs_k[None, :], mask=cmask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        keep = (cols[None, :] >= kl[:, None]) & (cols[None, :] < kh[:, None])
        p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)  # other sequences' keys: inf -> 0 here
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    dq = dq * sm_scale
    tl.store(DQKV + r64 * s_gt + h * s_gh + offs_k[None, :], dq.to(DQKV.dtype.element_ty), mask=mask2)


@triton.jit(do_not_specialize=["T", "S", "n_steps"])
def _bwd_dkdv_kernel(
    QKV, DO, LSE2, DELTA,  # as in _bwd_dq_kernel (DELTA now read)
    DQKV,  # (T, 3, H, K) out: this kernel writes the k and v slots
    CU, T, S, n_steps,
    qk_scale, sm_scale,
    s_t, s_3, s_h, s_dot, s_doh, s_gt, s_g3, s_gh,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    PREC: tl.constexpr,
):
    h = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # the key rows this program owns
    cmask = cols < T
    ql, qh = _seq_bounds(CU, tl.minimum(cols, T - 1), S, n_steps, BLOCK_N)  # key j is seen by queries [ql_j, qh_j)
    qh = tl.where(cmask, qh, ql)
    blk_lo = tl.min(tl.where(cmask, ql, T), 0)
    blk_hi = tl.max(tl.where(cmask, qh, 0), 0)

    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    c64 = cols.to(tl.int64)[:, None]
    mask2 = cmask[:, None] & kmask[None, :]
    k = tl.load(QKV + s_3 + c64 * s_t + h * s_h + offs_k[None, :], mask=mask2, other=0.0)
    v = tl.load(QKV + 2 * s_3 + c64 * s_t + h * s_h + offs_k[None, :], mask=mask2, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for i0 in range(blk_lo, blk_hi, BLOCK_M):
        rows = i0 + offs_m
        rm = rows < blk_hi
        rmask2 = rm[:, None] & kmask[None, :]
        r64 = rows.to(tl.int64)[:, None]
        q = tl.load(QKV + r64 * s_t + h * s_h + offs_k[None, :], mask=rmask2, other=0.0)
        do = tl.load(DO + r64 * s_dot + h * s_doh + offs_k[None, :], mask=rmask2, other=0.0)
        lse2 = tl.load(LSE2 + h * T + rows, mask=rm, other=0.0)
        delta = tl.load(DELTA + h * T + rows, mask=rm, other=0.0)
        s_t_ = tl.dot(k, tl.trans(q), input_precision=PREC) * qk_scale  # (N, M): scores transposed
        keep = (rows[None, :] >= ql[:, None]) & (rows[None, :] < qh[:, None])
        p_t = tl.where(keep, tl.exp2(s_t_ - lse2[None, :]), 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
    dk = dk * sm_scale
    out = DQKV + c64 * s_gt + h * s_gh + offs_k[None, :]
    tl.store(out + s_g3, dk.to(DQKV.dtype.element_ty), mask=mask2)
    tl.store(out + 2 * s_g3, dv.to(DQKV.dtype.element_ty), mask=mask2)


# ---- launchers (CUDA, or CPU tensors under TRITON_INTERPRET=1) ---------------------------------


def _check(qkv: Tensor, cu_seqlens: Tensor) -> None:
    check_float("packed_attention", qkv)
    assert qkv.dim() == 4 and qkv.shape[1] == 3, f"packed_attention: qkv must be (T, 3, H, K), got {tuple(qkv.shape)}"
    assert qkv.stride(-1) == 1, "packed_attention: head dim must be contiguous"
    assert qkv.shape[-1] <= MAX_HEAD_DIM, f"packed_attention: head dim {qkv.shape[-1]} > {MAX_HEAD_DIM}"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.dim() == 1, "cu_seqlens must be (S+1,) int32"


def _common(qkv: Tensor, cu_seqlens: Tensor, scale: float | None):
    T, _, H, K = qkv.shape
    S = cu_seqlens.numel() - 1
    scale = K**-0.5 if scale is None else float(scale)
    cu = cu_seqlens if cu_seqlens.is_contiguous() else cu_seqlens.contiguous()
    meta = dict(HEAD_DIM=K, BLOCK_K=max(16, next_pow2(K)),
                PREC="ieee" if qkv.dtype == torch.float32 else "tf32")
    return T, H, K, S, scale, cu, max(1, (S - 1).bit_length()), meta


def packed_attention_fwd(
    qkv_T3HK: Tensor, cu_seqlens: Tensor, scale: float | None = None, *, lse: bool = True,
    tile: tuple[int, int, int, int] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Launch the forward. Return (out (T, H, K) contiguous in qkv's dtype, LSE2 (H, T) fp32 or None).

    LSE2 is the log2-sum-exp2 of `scale * log2(e) * q.k` over each row's keys (what the backward
    reads); `lse=False` skips it (inference). `tile` overrides TILE_FWD (tests, sweeps).
    """
    _check(qkv_T3HK, cu_seqlens)
    T, H, K, S, scale, cu, n_steps, meta = _common(qkv_T3HK, cu_seqlens, scale)
    o = torch.empty((T, H, K), dtype=qkv_T3HK.dtype, device=qkv_T3HK.device)
    lse2 = torch.empty((H, T), dtype=torch.float32, device=qkv_T3HK.device) if lse else None
    if T == 0 or S <= 0:
        return o, lse2
    BM, BN, warps, stages = tile or TILE_FWD
    _fwd_kernel[(cdiv(T, BM), H)](
        qkv_T3HK, o, lse2 if lse else o, cu, T, S, n_steps, scale * LOG2E,
        qkv_T3HK.stride(0), qkv_T3HK.stride(1), qkv_T3HK.stride(2), o.stride(0), o.stride(1),
        BLOCK_M=BM, BLOCK_N=BN, STORE_LSE=lse, num_warps=warps, num_stages=stages, **meta,
    )
    return o, lse2


def packed_attention_bwd(
    dout_THK: Tensor, qkv_T3HK: Tensor, out_THK: Tensor, lse2_HT: Tensor, cu_seqlens: Tensor,
    scale: float | None = None, *, tile: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """Launch the backward. Return dqkv (T, 3, H, K) contiguous in qkv's dtype."""
    _check(qkv_T3HK, cu_seqlens)
    T, H, K, S, scale, cu, n_steps, meta = _common(qkv_T3HK, cu_seqlens, scale)
    dqkv = torch.empty((T, 3, H, K), dtype=qkv_T3HK.dtype, device=qkv_T3HK.device)
    if T == 0 or S <= 0:
        return dqkv.zero_()
    do = dout_THK if dout_THK.stride(-1) == 1 else dout_THK.contiguous()
    if do.dim() == 3 and (do.stride(0) == 0 or do.stride(1) == 0):  # expanded gradients (from .sum())
        do = do.contiguous()
    delta = torch.empty((H, T), dtype=torch.float32, device=qkv_T3HK.device)
    owned, inner, warps, stages = tile or TILE_BWD
    st = (qkv_T3HK.stride(0), qkv_T3HK.stride(1), qkv_T3HK.stride(2))
    sg = (dqkv.stride(0), dqkv.stride(1), dqkv.stride(2))
    _bwd_dq_kernel[(cdiv(T, owned), H)](
        qkv_T3HK, out_THK, do, lse2_HT, delta, dqkv, cu, T, S, n_steps, scale * LOG2E, scale,
        *st, out_THK.stride(0), out_THK.stride(1), do.stride(0), do.stride(1), *sg,
        BLOCK_M=owned, BLOCK_N=inner, num_warps=warps, num_stages=stages, **meta,
    )
    _bwd_dkdv_kernel[(cdiv(T, owned), H)](
        qkv_T3HK, do, lse2_HT, delta, dqkv, cu, T, S, n_steps, scale * LOG2E, scale,
        *st, do.stride(0), do.stride(1), *sg,
        BLOCK_N=owned, BLOCK_M=inner, num_warps=warps, num_stages=stages, **meta,
    )
    return dqkv


# ---- registered ops (CPU: the reference; CUDA: the kernels) ------------------------------------


def _ref_fwd(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float | None) -> Tensor:
    q, k, v = qkv.unbind(1)
    return reference.varlen_attention(q, k, v, cu_seqlens, max_seqlen, (-1, -1), scale).contiguous()


@torch.library.custom_op("packedenc::packed_attention_fwd", mutates_args=(), device_types="cpu")
def _fwd_op(qkv: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float | None) -> tuple[Tensor, Tensor]:
    # The CPU backward recomputes the probabilities (reference_bwd); this LSE2 is never read.
    return _ref_fwd(qkv, cu_seqlens, max_seqlen, scale), qkv.new_zeros((qkv.shape[2], qkv.shape[0]), dtype=torch.float32)


@_fwd_op.register_kernel("cuda")
def _(qkv, cu_seqlens, max_seqlen, scale):
    return packed_attention_fwd(qkv, cu_seqlens, scale)


@_fwd_op.register_fake
def _(qkv, cu_seqlens, max_seqlen, scale):
    T, _, H, K = qkv.shape
    return qkv.new_empty((T, H, K)), qkv.new_empty((H, T), dtype=torch.float32)


@torch.library.custom_op("packedenc::packed_attention_bwd", mutates_args=(), device_types="cpu")
def _bwd_op(dout: Tensor, qkv: Tensor, out: Tensor, lse2: Tensor, cu_seqlens: Tensor, max_seqlen: int,
            scale: float | None) -> Tensor:
    q, k, v = qkv.unbind(1)
    return torch.stack(reference_bwd.varlen_attention_bwd(dout, q, k, v, cu_seqlens, (-1, -1), scale), 1)


@_bwd_op.register_kernel("cuda")
def _(dout, qkv, out, lse2, cu_seqlens, max_seqlen, scale):
    return packed_attention_bwd(dout, qkv, out, lse2, cu_seqlens, scale)


@_bwd_op.register_fake
def _(dout, qkv, out, lse2, cu_seqlens, max_seqlen, scale):
    return qkv.new_empty(qkv.shape)


def _setup(ctx, inputs, output):
    qkv, cu_seqlens, max_seqlen, scale = inputs
    out, lse2 = output
    ctx.save_for_backward(qkv, out, lse2, cu_seqlens)
    ctx.args = (max_seqlen, scale)


def _backward(ctx, dout, dlse2):
    qkv, out, lse2, cu_seqlens = ctx.saved_tensors
    dqkv = torch.ops.packedenc.packed_attention_bwd(dout, qkv, out, lse2, cu_seqlens, *ctx.args)
    return dqkv, None, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup)


# ---- entry point -------------------------------------------------------------------------------


def packed_attention(qkv_T3HK: Tensor, cu_seqlens: Tensor, max_seqlen: int, scale: float | None = None) -> Tensor:
    """Non-causal attention of every packed token over its own sequence, from a fused qkv buffer.

    Arguments:
        qkv_T3HK: (T, 3, H, K) q, k, v of every token (a fused projection's output viewed so),
            float16 / bfloat16 / float32, head dim contiguous, K <= 256.
        cu_seqlens: (S+1,) int32 on qkv's device. max_seqlen: host int >= the longest sequence
            (the kernels do not need it; the CPU reference does).
        scale: softmax scale, default K ** -0.5.
    Return:
        (T, H, K) in qkv's dtype. Differentiable: the gradient is one (T, 3, H, K) tensor.
    """
    if direct_launch(qkv_T3HK):  # eager inference: skip the custom-op dispatch and the LSE store
        return packed_attention_fwd(qkv_T3HK, cu_seqlens, scale, lse=False)[0]
    return torch.ops.packedenc.packed_attention_fwd(qkv_T3HK, cu_seqlens, max_seqlen, scale)[0]
