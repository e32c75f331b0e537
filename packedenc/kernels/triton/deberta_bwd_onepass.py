"""One-pass backward of the packed DeBERTa disentangled attention (`deberta_attention_bwd.ONE_PASS`).

Shapes: T packed tokens, H heads, K head dim, R position-table rows, M = N = BLOCK tile rows,
W = 2 * BLOCK band distances (see `deberta_attention.py`).

The two-kernel backward (`deberta_attention_bwd.py`, FA2's split) recomputes every tile's scores
twice, once in the dq kernel and once in the dk/dv kernel. For DeBERTa that recompute is the
expensive part: the two band terms of a tile (c2p, p2c) each cost a band GEMM and a `tl.gather`,
~2.5x a content tile (H200, `benchmarks/profile_gpu.py --parts kernel`). Here one program per key
block loops over the query blocks of its sequence, recomputes each tile once and produces every
gradient from it: dk, dv in registers; dq as fp32 atomics into a (T, H, K) buffer (every key
block of the sequence adds to a query block's rows); dPK / dPQ as fp32 atomics per band distance,
as in the two-kernel version. Per band tile: 4 gathers instead of 6, 17 tile-GEMM units instead
of 23. The price: dq is summed in the order the programs finish (not bitwise reproducible, like
dPK / dPQ), and one (T, H, K) fp32 buffer.
"""

from __future__ import annotations

import triton
import triton.language as tl

from packedenc.kernels.triton.deberta_slots import _slot
from packedenc.kernels.triton.deberta_attention import _key_block, _sequence_span
from packedenc.kernels.triton.deberta_attention_bwd import _probs_and_grad, _query_block

__all__ = ["_bwd_onepass_kernel"]


@triton.jit
def _bwd_onepass_kernel(
    Q, K, V, PK, PQ, SLOT, CU, DO, LSE, DELTA,  # as in `_bwd_dq_kernel`
    DQ,  # (T, H, K) fp32, zero-initialised, atomically accumulated
    DK, DV,  # (T, H, K) out (same strides), q's dtype
    DPK, DPQ,  # (R, H, K) fp32, zero-initialised, atomically accumulated (C2P / P2C)
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h, s_pk_r, s_pk_h, s_pq_r, s_pq_h,
    s_do_t, s_do_h, s_dq_t, s_dq_h, s_dk_t, s_dk_h, s_lse_t, s_dpk_r, s_dpk_h, s_dpq_r, s_dpq_h,
    half, qk_scale, scale,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
    C2P: tl.constexpr, P2C: tl.constexpr, PREC: tl.constexpr, LOWP: tl.constexpr,
):
    pid_n, h = tl.program_id(0), tl.program_id(1)
    start, L = _sequence_span(CU, CU, False)
    j0 = pid_n * BLOCK
    if j0 >= L:
        return
    hh = h.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    cols, nmask, kv_mask, k, v = _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs, offs_k, kmask)
    idx = offs[:, None] - offs[None, :] + (BLOCK - 1)
    w = tl.arange(0, 2 * BLOCK)
    PKh, PQh = PK + hh * s_pk_h, PQ + hh * s_pq_h
    DPKh, DPQh = DPK + hh * s_dpk_h, DPQ + hh * s_dpq_h

    dk = tl.zeros([BLOCK, BLOCK_K], tl.float32)
    dv = tl.zeros([BLOCK, BLOCK_K], tl.float32)
    # Runs of rank-1 tiles (one slot per tile) with the same slot: their table gradients are summed
    # in registers and added once per run. dPK of a tile is sum_m (sum_n G) q_m, a (K,) vector (q
    # changes per tile); dPQ is k^T (sum_m G), so the per-key sums are carried instead.
    run_slot = tl.zeros([], tl.int32) - 1
    run_pk = tl.zeros([BLOCK_K], tl.float32)
    run_gn = tl.zeros([BLOCK], tl.float32)
    for i0 in range(0, L, BLOCK):
        rows, mmask, qmask, q, do, lse, delta = _query_block(Q, DO, LSE, DELTA, start, i0, L, hh, s_q_t, s_q_h,
                                                             s_do_t, s_do_h, s_lse_t, offs, offs_k, kmask)
        p, g = _probs_and_grad(q, k, v, do, lse, delta, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r,
                               offs_k, kmask, idx, mmask[:, None] & nmask[None, :], qk_scale, scale,
                               C2P, P2C, BLOCK, PREC, LOWP)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PREC)
        g16 = g.to(q.dtype)
        dk += tl.dot(tl.trans(g16), q, input_precision=PREC)
        dq = tl.dot(g16, k, input_precision=PREC)
        if C2P or P2C:
            d0 = i0 - j0 - (BLOCK - 1)
            slot_lo = _slot(SLOT, d0, half)
            if slot_lo == _slot(SLOT, d0 + 2 * BLOCK - 2, half):  # one slot: rank-1 terms
                if slot_lo != run_slot:
                    if run_slot >= 0:
                        _flush_run(DPKh, DPQh, run_slot, run_pk, run_gn, k, s_dpk_r, s_dpq_r, offs_k, kmask,
                                   C2P, P2C)
                    run_pk = tl.zeros([BLOCK_K], tl.float32)
                    run_gn = tl.zeros([BLOCK], tl.float32)
                    run_slot = slot_lo
                if C2P:
                    g_m = tl.sum(g, 1)
                    pk = tl.load(PKh + slot_lo.to(tl.int64) * s_pk_r + offs_k, mask=kmask, other=0.0)
                    dq += g_m[:, None] * pk.to(tl.float32)[None, :]
                    run_pk += tl.sum(q.to(tl.float32) * g_m[:, None], 0)
                if P2C:
                    g_n = tl.sum(g, 0)
                    pq = tl.load(PQh + slot_lo.to(tl.int64) * s_pq_r + offs_k, mask=kmask, other=0.0)
                    dk += g_n[:, None] * pq.to(tl.float32)[None, :]
                    run_gn += g_n
            else:
                slot_w = _slot(SLOT, d0 + w, half).to(tl.int64)
                # The band index tensors are formed here, not once before the loop: held across it
                # they cost ~60 registers a thread and the kernel spills (sm_90 ptxas, 4 warps).
                if C2P:
                    band_n = offs[:, None] - w[None, :] + (BLOCK - 1)  # (M, W): key column of (m, w)
                    n_ok = (band_n >= 0) & (band_n < BLOCK)
                    band_n = tl.minimum(tl.maximum(band_n, 0), BLOCK - 1)
                    pkw = tl.load(PKh + slot_w[:, None] * s_pk_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
                    gc = tl.where(n_ok, tl.gather(g16, band_n, axis=1), 0.0)  # (M, W)
                    dq += tl.dot(gc, pkw.to(q.dtype), input_precision=PREC)
                    dpkw = tl.dot(tl.trans(gc), q, input_precision=PREC)  # (W, K)
                    tl.atomic_add(DPKh + slot_w[:, None] * s_dpk_r + offs_k[None, :], dpkw, mask=kmask[None, :],
                                  sem="relaxed")
                if P2C:
                    band_m = w[:, None] + offs[None, :] - (BLOCK - 1)  # (W, N): query row of (w, n)
                    m_ok = (band_m >= 0) & (band_m < BLOCK)
                    band_m = tl.minimum(tl.maximum(band_m, 0), BLOCK - 1)
                    pqw = tl.load(PQh + slot_w[:, None] * s_pq_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
                    gp = tl.where(m_ok, tl.gather(g16, band_m, axis=0), 0.0)  # (W, N)
                    dk += tl.dot(tl.trans(gp), pqw.to(k.dtype), input_precision=PREC)
                    dpqw = tl.dot(gp, k, input_precision=PREC)  # (W, K)
                    tl.atomic_add(DPQh + slot_w[:, None] * s_dpq_r + offs_k[None, :], dpqw, mask=kmask[None, :],
                                  sem="relaxed")
        # "relaxed": pure adds, no ordering with other memory needed (Triton's default acq_rel fences)
        tl.atomic_add(DQ + rows[:, None] * s_dq_t + hh * s_dq_h + offs_k[None, :], dq, mask=qmask, sem="relaxed")
    if C2P or P2C:
        if run_slot >= 0:
            _flush_run(DPKh, DPQh, run_slot, run_pk, run_gn, k, s_dpk_r, s_dpq_r, offs_k, kmask, C2P, P2C)
    tl.store(DK + cols[:, None] * s_dk_t + hh * s_dk_h + offs_k[None, :], dk.to(DK.dtype.element_ty), mask=kv_mask)
    tl.store(DV + cols[:, None] * s_dk_t + hh * s_dk_h + offs_k[None, :], dv.to(DV.dtype.element_ty), mask=kv_mask)


@triton.jit
def _flush_run(DPKh, DPQh, slot, run_pk, run_gn, k, s_dpk_r, s_dpq_r, offs_k, kmask,
               C2P: tl.constexpr, P2C: tl.constexpr):
    """Add a finished run of rank-1 tiles to the table gradients at its slot."""
    if C2P:
        tl.atomic_add(DPKh + slot.to(tl.int64) * s_dpk_r + offs_k, run_pk, mask=kmask, sem="relaxed")
    if P2C:
        tl.atomic_add(DPQh + slot.to(tl.int64) * s_dpq_r + offs_k, tl.sum(k.to(tl.float32) * run_gn[:, None], 0),
                      mask=kmask, sem="relaxed")
