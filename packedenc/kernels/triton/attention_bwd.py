"""Packed varlen attention in Triton: the backward (dQ pass, then dK/dV pass), token-block tiles.

Shapes: T packed tokens, S sequences, H heads, K head dim; M query rows, N key rows of a tile.

The usual split (FA2's, without its atomics, so the result is deterministic), on the forward's
token-block grids (`attention._spans`, see attention.py): a program owns a block of consecutive
packed rows whatever sequence they belong to, loops over the one contiguous range of rows its
rows see on the other side, masks per element only the tiles that cross some row's bound, and
skips everything outside the window's band. Both passes read the forward's LSE2 (the softmax
statistics), so P = exp2(scale * log2(e) * q.k - LSE2) is recomputed exactly, with no max pass.

One kernel, `_bwd_kernel`, launched twice:
- PASS 0 (`_dq_block`), one program per (query block, head): delta = rowsum(dO * O) for its rows
  (the usual preprocess, fused here: the pass reads dO anyway), stored (H, T) fp32 for PASS 1;
  then dq = scale * sum_j dS_ij k_j over its key range, dS = P * (dO v^T - delta).
- PASS 1 (`_dkdv_block`), one program per (key block, head), launched after PASS 0 (same stream,
  so delta is written): key j is seen by the queries [max(start, j - right), min(end, j + left + 1))
  (the window mirrored: `_spans` with left and right swapped); dv = sum_i P_ij dO_i,
  dk = scale * sum_i dS_ij q_i.
P and dS are rounded to the input dtype before their products (as FA2); accumulation is fp32.
The atomic-dQ plan (FA2's: no dQ pass, dq added by atomics from the dK/dV pass, 5 GEMMs per tile
pair instead of 7) measured slower on every workload (benchmarks/results/attention_sweep_h200.json),
and so did the same plan with dq added by one TMA bulk reduction a tile, FA3's way
(benchmarks/results/history/attention_plans_h100_d5bd132.json).
A one-pass plan (both blocks per program, each query tile's delta recomputed from O: one launch,
no dependency between passes) also measured slower on every workload
(benchmarks/results/history/attention_h200_b4119ba.json).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels.triton._common import cdiv, launch
from packedenc.kernels.triton.attention import _load_tiles, _program, _spans, bwd_tiles, descriptors, grid, launch_args

__all__ = ["attention_bwd"]


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, j_lo, j_hi, blk_hi, kl, kh,
              qk_scale, offs_n, offs_k, kmask, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
              EVEN_K: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dq += dS k over key tiles j_lo, j_lo + N, ... < j_hi (MASKED: per-row ranges [kl, kh)).
    TMA: whole tiles through the descriptors KD, VD, as in the forward's `_attend`."""
    for j0 in range(j_lo, j_hi, BLOCK_N):
        cols = j0 + offs_n
        c64 = cols.to(tl.int64)[:, None]
        kp = K + c64 * s_k_t + h * s_k_h + offs_k[None, :]
        vp = V + c64 * s_v_t + h * s_v_h + offs_k[None, :]
        k, v = _load_tiles(kp, vp, KD, VD, j0, h.to(tl.int32) * HEAD_DIM, cols < blk_hi, kmask, TMA, MASKED, EVEN_K)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        x = s * qk_scale - lse[:, None]
        if MASKED:  # before exp2: another sequence's score may overflow it
            keep = (cols[None, :] >= kl[:, None]) & (cols[None, :] < kh[:, None])
            x = tl.where(keep, x, float("-inf"))
        p = tl.exp2(x)
        dp = tl.dot(do, tl.trans(v), input_precision=PREC)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PREC)
    return dq


@triton.jit
def _dq_block(Q, K, V, KD, VD, O, DO, LSE, DELTA, DQ, CU, pid, h, T, S, n_steps, left, right, qk_scale, sm_scale,
              s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_o_t, s_o_h, s_do_t, s_do_h, s_dq_t, s_dq_h,
              HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """dq of the BLOCK_M query rows of block `pid`; their delta = rowsum(dO * O), stored (H, T)
    for the dK/dV pass."""
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # int32 packed row ids (see `_spans`)
    in_t, valid, kl, kh, blk_lo, mid_lo, mid_hi, blk_hi = _spans(
        CU, rows, T, S, n_steps, left, right, WINDOW_L, WINDOW_R, BLOCK_M, BLOCK_N)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    r64 = rows.to(tl.int64)[:, None]
    mask2 = in_t[:, None] & kmask[None, :]
    q = tl.load(Q + r64 * s_q_t + h * s_q_h + offs_k[None, :], mask=mask2, other=0.0)
    do = tl.load(DO + r64 * s_do_t + h * s_do_h + offs_k[None, :], mask=mask2, other=0.0)
    o = tl.load(O + r64 * s_o_t + h * s_o_h + offs_k[None, :], mask=mask2, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    tl.store(DELTA + h * T + rows, delta, mask=in_t)
    lse = tl.load(LSE + h * T + rows, mask=in_t, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, blk_lo, mid_lo, blk_hi, kl, kh,
                   qk_scale, offs_n, offs_k, kmask, BLOCK_N, True, HEAD_DIM == BLOCK_K, PREC, TMA, HEAD_DIM)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, mid_lo, mid_hi, blk_hi, kl, kh,
                   qk_scale, offs_n, offs_k, kmask, BLOCK_N, False, HEAD_DIM == BLOCK_K, PREC, TMA, HEAD_DIM)
    dq = _dq_tiles(dq, q, do, lse, delta, K, V, KD, VD, h, s_k_t, s_k_h, s_v_t, s_v_h, mid_hi, blk_hi, blk_hi, kl, kh,
                   qk_scale, offs_n, offs_k, kmask, BLOCK_N, True, HEAD_DIM == BLOCK_K, PREC, TMA, HEAD_DIM)
    dq = tl.where(valid[:, None], dq * sm_scale, 0.0)
    tl.store(DQ + r64 * s_dq_t + h * s_dq_h + offs_k[None, :], dq.to(DQ.dtype.element_ty), mask=mask2)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, h, T, s_q_t, s_q_h, s_do_t, s_do_h, i_lo, i_hi,
                blk_hi, ql, qh, qk_scale, offs_m, offs_k, kmask, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
                EVEN_K: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr, HEAD_DIM: tl.constexpr):
    """dv += P^T dO, dk += dS^T q over query tiles i_lo, i_lo + M, ... < i_hi (MASKED: key j's
    queries [ql_j, qh_j)). Scores are built transposed, (N keys, M queries). TMA: q and dO tiles
    whole through the descriptors QD, DOD."""
    for i0 in range(i_lo, i_hi, BLOCK_M):
        rows = i0 + offs_m
        r64 = rows.to(tl.int64)[:, None]
        qp = Q + r64 * s_q_t + h * s_q_h + offs_k[None, :]
        dop = DO + r64 * s_do_t + h * s_do_h + offs_k[None, :]
        rm = rows < blk_hi
        q, do = _load_tiles(qp, dop, QD, DOD, i0, h.to(tl.int32) * HEAD_DIM, rm, kmask, TMA, MASKED, EVEN_K)
        if MASKED:
            lse = tl.load(LSE + h * T + rows, mask=rm, other=0.0)
            delta = tl.load(DELTA + h * T + rows, mask=rm, other=0.0)
        else:
            lse = tl.load(LSE + h * T + rows)
            delta = tl.load(DELTA + h * T + rows)
        s_t = tl.dot(k, tl.trans(q), input_precision=PREC)
        x_t = s_t * qk_scale - lse[None, :]
        if MASKED:
            keep = (rows[None, :] >= ql[:, None]) & (rows[None, :] < qh[:, None])
            x_t = tl.where(keep, x_t, float("-inf"))
        p_t = tl.exp2(x_t)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PREC)
        dp_t = tl.dot(v, tl.trans(do), input_precision=PREC)
        ds_t = p_t * (dp_t - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PREC)
    return dk, dv


@triton.jit
def _dkdv_block(Q, K, V, DO, QD, DOD, LSE, DELTA, DK, DV, CU, pid, h, T, S, n_steps, left, right, qk_scale, sm_scale,
                s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_do_t, s_do_h, s_dk_t, s_dk_h, s_dv_t, s_dv_h,
                HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, PREC: tl.constexpr, TMA: tl.constexpr):
    """dk, dv of the BLOCK_N key rows of block `pid` (query tiles of BLOCK_M rows)."""
    # key j is seen by queries [max(start, j - right), min(end, j + left + 1)): the mirrored window
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)  # int32 packed key rows (see `_spans`)
    in_t, valid, ql, qh, blk_lo, mid_lo, mid_hi, blk_hi = _spans(
        CU, cols, T, S, n_steps, right, left, WINDOW_R, WINDOW_L, BLOCK_N, BLOCK_M)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    c64 = cols.to(tl.int64)[:, None]
    mask2 = in_t[:, None] & kmask[None, :]
    k = tl.load(K + c64 * s_k_t + h * s_k_h + offs_k[None, :], mask=mask2, other=0.0)
    v = tl.load(V + c64 * s_v_t + h * s_v_h + offs_k[None, :], mask=mask2, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, h, T, s_q_t, s_q_h, s_do_t, s_do_h,
                         blk_lo, mid_lo, blk_hi, ql, qh, qk_scale, offs_m, offs_k, kmask, BLOCK_M, True,
                         HEAD_DIM == BLOCK_K, PREC, TMA, HEAD_DIM)
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, h, T, s_q_t, s_q_h, s_do_t, s_do_h,
                         mid_lo, mid_hi, blk_hi, ql, qh, qk_scale, offs_m, offs_k, kmask, BLOCK_M, False,
                         HEAD_DIM == BLOCK_K, PREC, TMA, HEAD_DIM)
    dk, dv = _dkdv_tiles(dk, dv, k, v, Q, DO, QD, DOD, LSE, DELTA, h, T, s_q_t, s_q_h, s_do_t, s_do_h,
                         mid_hi, blk_hi, blk_hi, ql, qh, qk_scale, offs_m, offs_k, kmask, BLOCK_M, True,
                         HEAD_DIM == BLOCK_K, PREC, TMA, HEAD_DIM)
    dk = tl.where(valid[:, None], dk * sm_scale, 0.0)
    dv = tl.where(valid[:, None], dv, 0.0)
    tl.store(DK + c64 * s_dk_t + h * s_dk_h + offs_k[None, :], dk.to(DK.dtype.element_ty), mask=mask2)
    tl.store(DV + c64 * s_dv_t + h * s_dv_h + offs_k[None, :], dv.to(DV.dtype.element_ty), mask=mask2)


@triton.jit(do_not_specialize=["T", "S", "n_steps", "left", "right"])
def _bwd_kernel(
    Q, K, V, O, DO,  # (T, H, K) views, head dim contiguous
    QD, KD, VD, DOD,  # TMA: descriptors of q, k, v, dO as (T, H * K), blocks (INNER, K); else unread
    LSE,  # (H, T) fp32: the forward's log2-sum-exp2
    DELTA,  # (H, T) fp32: rowsum(dO * O), written by PASS 0, read by PASS 1
    DG, o_dq, o_dk, o_dv,  # out: the one gradient buffer, dq / dk / dv at these element offsets in it
    CU, T, S, n_steps, left, right,  # as in the forward
    qk_scale, sm_scale,  # scale * log2(e), scale
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_o_t, s_o_h, s_do_t, s_do_h,
    s_dq_t, s_dq_h, s_dk_t, s_dk_h, s_dv_t, s_dv_h,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
    OWN: tl.constexpr, INNER: tl.constexpr,  # rows a program owns, rows of the tiles it loops over
    WINDOW_L: tl.constexpr, WINDOW_R: tl.constexpr, PREC: tl.constexpr,
    PASS: tl.constexpr,  # 0: dq (and delta); 1: dk, dv (delta read)
    HEAD_MAJOR: tl.constexpr,  # grid (H, blocks): a block's heads run side by side (`attention.grid`)
    TMA: tl.constexpr,  # the loop tiles through the descriptors (PASS 0: KD, VD; PASS 1: QD, DOD)
):
    qk_scale, sm_scale = tl.cast(qk_scale, tl.float32), tl.cast(sm_scale, tl.float32)  # torch.compile passes fp64
    h, pid = _program(HEAD_MAJOR)
    if PASS == 0:
        _dq_block(Q, K, V, KD, VD, O, DO, LSE, DELTA, DG + o_dq, CU, pid, h, T, S, n_steps, left, right, qk_scale, sm_scale,
                  s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_o_t, s_o_h, s_do_t, s_do_h, s_dq_t, s_dq_h,
                  HEAD_DIM, BLOCK_K, OWN, INNER, WINDOW_L, WINDOW_R, PREC, TMA)
    else:
        _dkdv_block(Q, K, V, DO, QD, DOD, LSE, DELTA, DG + o_dk, DG + o_dv, CU, pid, h, T, S, n_steps, left, right, qk_scale, sm_scale,
                    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_do_t, s_do_h,
                    s_dk_t, s_dk_h, s_dv_t, s_dv_h,
                    HEAD_DIM, BLOCK_K, OWN, INNER, WINDOW_L, WINDOW_R, PREC, TMA)


def attention_bwd(
    do_THK: Tensor, q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, o_THK: Tensor, lse2_HT: Tensor,
    cu_seqlens: Tensor, max_seqlen: int, window: tuple[int, int], scale: float,
    fused_qkv: bool = False, *, tiles=None, head_major: bool = True,
) -> Tensor:
    """Launch the backward: dq, dk, dv in one tensor of q's dtype, (3, T, H, K), or with
    `fused_qkv` (T, 3, H, K) (the gradient of a fused qkv buffer).

    The kernel writes the three through that one buffer and element offsets, never through three
    views of it: torch.compile functionalizes a kernel's mutated arguments one by one, and views
    of one base passed as separate outputs come back as clones that inductor mis-sizes (it read
    past a buffer's end and faulted in the compiled ModernBERT backward).
    `do_THK` may have any strides (gradients of `.sum()` arrive expanded). `tiles` overrides
    `bwd_tiles(...)`: (dQ tile, dK/dV tile); `head_major` as for the forward. Inputs are checked
    by the caller, as for the forward.
    """
    T, H, Kd = q_THK.shape
    slot = 1 if fused_qkv else 0
    g = torch.empty((T, 3, H, Kd) if fused_qkv else (3, T, H, Kd), dtype=q_THK.dtype, device=q_THK.device)
    S, n_steps, left, right, qk_scale, meta = launch_args(q_THK, cu_seqlens, window, scale)
    if T == 0 or S <= 0:
        return g.zero_()
    do = do_THK
    if do.stride(-1) != 1 or do.stride(0) == 0 or do.stride(1) == 0:  # expanded or transposed gradients
        do = do.contiguous()
    args = (q_THK, k_THK, v_THK, o_THK, do)
    g_t, g_h = g.select(slot, 0).stride()[:2]
    offsets = tuple(i * g.stride(slot) for i in range(3))
    strides = (*q_THK.stride()[:2], *k_THK.stride()[:2], *v_THK.stride()[:2], *o_THK.stride()[:2],
               *do.stride()[:2], g_t, g_h, g_t, g_h, g_t, g_h)
    common = (cu_seqlens, T, S, n_steps, left, right, qk_scale, float(scale), *strides)
    delta = torch.empty((H, T), dtype=torch.float32, device=q_THK.device)
    (qm, qn, qw, qs, *q_tma), (kn, km, kw, ks, *kv_tma) = tiles or bwd_tiles(T, max_seqlen, window, Kd)
    (dq_grid, dq_hm), (dkv_grid, dkv_hm) = grid(cdiv(T, qm), H, head_major), grid(cdiv(T, kn), H, head_major)
    # the descriptor slots of a pointer-load launch hold tensors the kernel never reads
    kv = descriptors(qn, k_THK, v_THK) if q_tma and q_tma[0] else None
    qdo = descriptors(km, q_THK, do) if kv_tma and kv_tma[0] else None
    dq_args = (*args, *((q_THK, *kv, do) if kv else args[:4]), lse2_HT, delta, g, *offsets, *common)
    dkv_args = (*args, *((qdo[0], k_THK, v_THK, qdo[1]) if qdo else args[:4]), lse2_HT, delta, g, *offsets, *common)
    dq_opts = dict(OWN=qm, INNER=qn, PASS=0, HEAD_MAJOR=dq_hm, num_warps=qw, num_stages=qs, **meta)
    dkv_opts = dict(OWN=kn, INNER=km, PASS=1, HEAD_MAJOR=dkv_hm, num_warps=kw, num_stages=ks, **meta)
    # descriptors are not `launch`'s cache keys: those launches take the JIT (big packs only, `bwd_tiles`)
    if kv is None:
        launch(_bwd_kernel, dq_grid, *dq_args, TMA=False, **dq_opts)
    else:
        _bwd_kernel[dq_grid](*dq_args, TMA=True, **dq_opts)
    if qdo is None:
        launch(_bwd_kernel, dkv_grid, *dkv_args, TMA=False, **dkv_opts)
    else:
        _bwd_kernel[dkv_grid](*dkv_args, TMA=True, **dkv_opts)
    return g
