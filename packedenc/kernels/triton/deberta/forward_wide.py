"""The DeBERTa forward on wide tiles: 64 query rows (one Hopper warpgroup's wgmma) x 32 key rows.

Shapes: T packed tokens, H heads, K head dim, M = 2N query rows, N key rows of a band tile.

Same math, same slot table, same key ranges and saturated tiles as `forward._fwd_kernel` (`tiles.py`);
only the band tile changes shape. With M = 2N query rows per key tile, a band tile's distances
i - j = d0 + u, u = m - n + N - 1 in [0, M + N - 1), fall in three N-wide chunks of slots:
  - c2p: C_c = q @ PK[slot(d0 + cN + t)]^T, (M, N) each, picked as C_c[m, u % N] for the pairs whose
    u // N is c. The next key tile (j0 + N, d0 - N) has chunk c + 1 = this tile's chunk c, and the
    pick index u % N does not depend on the tile, so each tile computes and gathers chunk 0 only
    (one (M, N, K) GEMM, what q @ k^T costs) and carries the gathered chunks 1 and 2;
  - p2c: G = PQ[slot(d0 + u)] @ k^T over u in [0, 2M) as two (M, N) wgmma GEMMs (33 of their 128
    slot rows unused, yet faster than three (N, N) mma.sync chunks), all fresh (keys change per
    tile), picked as G[u, n] with `tl.gather` along the rows.
The two picks are summed in the gathers' layouts (in the input dtype with LOWP, as HF's eager sums
them: half the bytes of the layout conversion, one more rounding) and enter q @ k^T as its
accumulator, so each tile converts the position sum to the wgmma layout once and the softmax stays
in that layout (adding each pick to the scores instead made Triton 3.6 redo the softmax in a second
layout, 1.3x slower on a doc pack; benchmarks/results/history/NOTES-diary.md).
A band tile costs 5 (M, N, K) GEMMs against 2 for a flash tile (the 32-row kernel: 5 against 2 as
well), but the 64-row GEMMs run as wgmma (H200: content alone 2.8x faster than through 32 x 32
tiles) and c2p gathers one chunk per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from packedenc.kernels.triton._common import cdiv, launch, next_pow2
from packedenc.kernels.triton.deberta.launch import LOG2E, DebertaTiles, prec
from packedenc.kernels.triton.deberta.scores import _c2p_half
from packedenc.kernels.triton.deberta.slots import _slot
from packedenc.kernels.triton.deberta.tiles import (
    _fold, _key_block, _key_ranges, _query_rows, _saturated_range, _sequence_span, _softmax_step, _store_rows,
)

__all__ = ["launch_wide"]


@triton.jit
def _p2c_chunk(k, PQ, SLOT, d_lo, half, s_pq_r, offs_k, kmask, U: tl.constexpr, PREC: tl.constexpr,
               LOWP: tl.constexpr):
    """PQ[slot(d_lo + u)] @ k^T for u in [0, U): a chunk of a tile's p2c band, (U, N)."""
    slot_u = _slot(SLOT, d_lo + tl.arange(0, U), half).to(tl.int64)
    pqr = tl.load(PQ + slot_u[:, None] * s_pq_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
    g = tl.dot(pqr.to(k.dtype), tl.trans(k), input_precision=PREC)
    if LOWP:
        g = g.to(k.dtype)
    return g


@triton.jit
def _p2c_band(k, PQ, SLOT, d0, half, s_pq_r, offs_k, kmask, idx, M: tl.constexpr, PREC: tl.constexpr,
              LOWP: tl.constexpr):
    """G[idx[m, n], n] as fp32 for the band G = PQ[slot(d0 + u)] @ k^T, u in [0, 2M), computed as two
    (M, N) chunks (wgmma-shaped; 33 of their 128 slot rows unused) and picked along the rows."""
    g0 = _p2c_chunk(k, PQ, SLOT, d0, half, s_pq_r, offs_k, kmask, M, PREC, LOWP)
    g1 = _p2c_chunk(k, PQ, SLOT, d0 + M, half, s_pq_r, offs_k, kmask, M, PREC, LOWP)
    lo, hi = idx % M, idx // M
    v0 = tl.gather(g0, lo, axis=0)
    v1 = tl.gather(g1, lo, axis=0)
    return tl.where(hi == 0, v0, v1).to(tl.float32)


@triton.jit
def _c2p_chunk(q, PK, SLOT, d_lo, half, s_pk_r, offs_k, kmask, lo_n, N: tl.constexpr, PREC: tl.constexpr,
               LOWP: tl.constexpr):
    """C[m, lo_n[m, n]] for C = q @ PK[slot(d_lo + t)]^T, t in [0, N): one chunk of a tile's c2p band,
    picked in the input dtype if LOWP."""
    return tl.gather(_c2p_half(q, PK, SLOT, d_lo, half, s_pk_r, offs_k, kmask, N, PREC, LOWP), lo_n, axis=1)


@triton.jit
def _fwd_wide_kernel(
    Q, K, V, PK, PQ, SLOT, CU, ORDER, O, LSE,
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,
    s_pk_r, s_pk_h, s_pq_r, s_pq_h, s_o_t, s_o_h, s_lse_t,
    half, D_LO, D_HI, SLOT_MIN, SLOT_MAX, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows (= 2 * BLOCK_N)
    BLOCK_N: tl.constexpr,  # key rows of a band tile
    NS: tl.constexpr,  # key rows of a saturated tile (a multiple of BLOCK_N)
    C2P: tl.constexpr, P2C: tl.constexpr, STORE_LSE: tl.constexpr, PREC: tl.constexpr,
    LOWP: tl.constexpr,  # band GEMM outputs and their sum rounded to the input dtype (fp16 / bf16)
    HAS_ORDER: tl.constexpr = False,  # grid z runs the sequences in ORDER (longest first)
):
    """`forward._fwd_kernel` (same arguments, same ranges) on (BLOCK_M, BLOCK_N) band tiles."""
    tl.static_assert(BLOCK_M == 2 * BLOCK_N)
    pid_m, h = tl.program_id(0), tl.program_id(1)
    start, L = _sequence_span(CU, ORDER, HAS_ORDER)
    i0 = pid_m * BLOCK_M
    if i0 >= L:
        return
    hh = h.to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    rows, mmask, q = _query_rows(Q, start, i0, L, hh, s_q_t, s_q_h, offs_m, offs_k, kmask)
    idx = offs_m[:, None] - offs_n[None, :] + (BLOCK_N - 1)  # band column u of pair (m, n)
    lo_n = idx % BLOCK_N  # u in its c2p chunk
    hi_n = idx // BLOCK_N  # the chunk
    PKh = PK + hh * s_pk_h
    PQh = PQ + hh * s_pq_h

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    e1, s3 = _key_ranges(i0, L, D_LO, D_HI, NS, BLOCK_M, BLOCK_N)  # the three key ranges of `_fwd_kernel`
    qf, pk_row, cst = _fold(q, PKh, PQh, SLOT_MAX, s_pk_r, s_pq_r, offs_k, kmask, C2P, P2C)
    m_i, l_i, acc = _saturated_range(qf, pk_row, cst, K, V, start, L, 0, e1, hh, s_k_t, s_k_h, s_v_t, s_v_h,
                                     offs_k, kmask, m_i, l_i, acc, qk_scale, NS, C2P, PREC)
    if C2P:  # chunks 1 and 2 of the first band tile's c2p band (d0(e1) + N .., d0(e1) + 2N ..)
        d_first = i0 - e1 - (BLOCK_N - 1)
        c1 = _c2p_chunk(q, PKh, SLOT, d_first + BLOCK_N, half, s_pk_r, offs_k, kmask, lo_n, BLOCK_N, PREC, LOWP)
        c2 = _c2p_chunk(q, PKh, SLOT, d_first + 2 * BLOCK_N, half, s_pk_r, offs_k, kmask, lo_n, BLOCK_N, PREC, LOWP)
    for j0 in range(e1, s3, BLOCK_N):
        _, nmask, _, k, v = _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs_n, offs_k, kmask)
        d0 = i0 - j0 - (BLOCK_N - 1)
        # the position terms summed in the gathers' layouts first, then added to q @ k^T once
        pos = tl.zeros([BLOCK_M, BLOCK_N], q.dtype if LOWP else tl.float32)
        if C2P:  # chunk 0 fresh; this tile's chunks 0, 1 are the next tile's 1, 2
            c0 = _c2p_chunk(q, PKh, SLOT, d0, half, s_pk_r, offs_k, kmask, lo_n, BLOCK_N, PREC, LOWP)
            pos += tl.where(hi_n == 0, c0, tl.where(hi_n == 1, c1, c2)).to(pos.dtype)
            c2 = c1
            c1 = c0
        if P2C:
            pos += _p2c_band(k, PQh, SLOT, d0, half, s_pq_r, offs_k, kmask, idx, BLOCK_M, PREC, LOWP).to(pos.dtype)
        s = tl.dot(q, tl.trans(k), pos.to(tl.float32), input_precision=PREC)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PREC)
    qf, pk_row, cst = _fold(q, PKh, PQh, SLOT_MIN, s_pk_r, s_pq_r, offs_k, kmask, C2P, P2C)
    m_i, l_i, acc = _saturated_range(qf, pk_row, cst, K, V, start, L, s3, L, hh, s_k_t, s_k_h, s_v_t, s_v_h,
                                     offs_k, kmask, m_i, l_i, acc, qk_scale, NS, C2P, PREC)
    _store_rows(O, LSE, acc, m_i, l_i, rows, hh, s_o_t, s_o_h, s_lse_t, offs_k, mmask, kmask, STORE_LSE)


def launch_wide(q, k, v, cu_seqlens, order, has_order, max_seqlen, pk, pq, table, bounds, scale, c2p, p2c,
                store_lse, o, lse_arg, tiles: DebertaTiles) -> None:
    """`forward.launch_fwd` on (wide_m, wide_n) band tiles, writing o (and the lse through lse_arg,
    any pointer without store_lse)."""
    T, H, Kd = q.shape
    for cu, n_seq in tiles.chunks(cu_seqlens):
        launch(_fwd_wide_kernel, (cdiv(max_seqlen, tiles.wide_m), H, n_seq),
            q, k, v, pk, pq, table[0], cu, order, o, lse_arg,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            pk.stride(0), pk.stride(1), pq.stride(0), pq.stride(1), o.stride(0), o.stride(1), H,
            table[1], *bounds, scale * LOG2E,
            HEAD_DIM=Kd, BLOCK_K=max(16, next_pow2(Kd)), BLOCK_M=tiles.wide_m, BLOCK_N=tiles.wide_n,
            NS=tiles.wide_ns, C2P=c2p, P2C=p2c, STORE_LSE=store_lse, PREC=prec(q.dtype),
            LOWP=q.dtype != torch.float32, HAS_ORDER=has_order, **tiles.wide_options(),
        )
