"""DeBERTa-v2/v3 disentangled attention (content + c2p + p2c) over cu_seqlens: the packed flash forward.

Shapes: T packed tokens, S sequences, H heads, K head dim, R = 2 * span position-table rows,
M = N = BLOCK query / key rows of a tile, W = 2 * BLOCK distances of a tile's band.

The score of query i and key j of one sequence (see `reference.deberta_attention`) is
    scale * (q_i . k_j + q_i . PK[slot(i - j)] + k_j . PQ[slot(i - j)]),
slot(d) = clamp(bucket(d) + span, 0, R - 1); c2p and p2c read the same slot (bucket is odd).

`_fwd_kernel`: one program per (query block, head, sequence), looping over the key blocks of its
own sequence with an online softmax (exp2, fp32 statistics), so no (L, L) or (L, R) tensor ever
exists in device memory. Slots are non-decreasing in d and constant beyond the bucket range
(`slots.saturation`: d >= D_HI has SLOT_MAX, d <= D_LO has SLOT_MIN), so a query block's keys fall
in three ranges, in sequence order (`tiles._key_ranges`):
  - far behind (every d >= D_HI) and far ahead (every d <= D_LO): one slot for every pair, so
    q.k + q.PK[s] + k.PQ[s] = (q + PQ[s]) . (k + PK[s]) - PQ[s].PK[s]: q + PQ[s] is formed once
    per program, k + PK[s] is one add per key tile, and the tile is a plain flash tile of NS keys.
    Most tiles of a long sequence are such tiles.
  - the band in between, in (BLOCK, BLOCK) tiles: i - j takes the M + N - 1 values d0 + u,
    u = m - n + N - 1 in [0, W - 1), d0 = i0 - j0 - (N - 1); the kernel reads the slots of those
    distances from the table, gathers the rows of PK and PQ at those slots (L2-resident), computes
    the band GEMMs C = q @ PK_w^T and P = PQ_w @ k^T (W, N) in fp32 and picks C[m, m - n + N - 1]
    and P[m - n + N - 1, n] with `tl.gather` (`scores.py`). Key tile j0 + N's upper half of C is
    tile j0's lower half, so C is held as two (M, N) halves and only the lower one is computed per
    tile. Cost of a band tile (M = N = B): 2B^2K (q k^T) + 2B^2K (C) + 4B^2K (P) + 2B^2K (p V)
    FLOPs, 2.5x a flash tile; sequences of <= ~2 x max_relative_positions tokens are all band.
On the GPU, batches longer than 32 tokens with head dims <= 64 take `forward_wide.py` instead: the
same ranges and math on (64, 32) band tiles, whose GEMMs are wgmma (`DebertaTiles.takes_wide`).
The fold rounds q + PQ and k + PK to the input dtype once: the same order of error as storing q
and k in that dtype.

The slot table (`slots.py`) is built once per (buckets, max_relative_positions, R, device) on the
CPU, op for op HF's `make_log_bucket_position`, for every |d| <= max(8192, next_pow2(max_seqlen));
the kernels only ever look slots up. The backward (`backward.py`) recomputes the tiles with the
same helpers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels.triton._common import cdiv, launch, next_pow2
from packedenc.kernels.triton.deberta.forward_wide import launch_wide
from packedenc.kernels.triton.deberta.launch import LOG2E, TILES, DebertaTiles, check_inputs, prec
from packedenc.kernels.triton.deberta.scores import _c2p_half, _c2p_pick, _pos_scores
from packedenc.kernels.triton.deberta.slots import NO_SATURATION, launch_tables
from packedenc.kernels.triton.deberta.tiles import (
    _fold, _key_block, _key_ranges, _query_rows, _saturated_range, _sequence_span, _softmax_step, _store_rows,
)

__all__ = ["deberta_attention_fwd", "launch_fwd"]


# ---- kernel ------------------------------------------------------------------------------------


@triton.jit
def _fwd_kernel(
    Q, K, V,  # (T, H, K) views, head dim contiguous (slices of the fused qkv output)
    PK, PQ,  # (R, H, K) position tables for c2p / p2c (any valid pointer when the term is off)
    SLOT,  # (2 * half + 1,) int32 slot of each distance
    CU,  # (S + 1,) int32 cu_seqlens
    ORDER,  # (S,) int32 permutation of the sequences, grid z -> sequence (HAS_ORDER)
    O,  # (T, H, K) out, q's dtype
    LSE,  # (T, H) fp32 out: log2-sum-exp2 of the scores times log2(e) (STORE_LSE)
    s_q_t, s_q_h, s_k_t, s_k_h, s_v_t, s_v_h,  # strides in elements
    s_pk_r, s_pk_h, s_pq_r, s_pq_h, s_o_t, s_o_h, s_lse_t,
    half,  # table half width
    D_LO, D_HI, SLOT_MIN, SLOT_MAX,  # `saturation`: d <= D_LO has SLOT_MIN, d >= D_HI has SLOT_MAX
    qk_scale,  # scale * log2(e)
    HEAD_DIM: tl.constexpr, BLOCK_K: tl.constexpr,  # head dim, its power-of-two block (>= 16)
    BLOCK: tl.constexpr,  # query rows = key rows of a banded tile (>= 16 for tl.dot)
    NS: tl.constexpr,  # key rows of a saturated tile (a multiple of BLOCK)
    C2P: tl.constexpr, P2C: tl.constexpr, STORE_LSE: tl.constexpr,
    PREC: tl.constexpr,  # tl.dot input_precision ("ieee" for fp32 inputs)
    LOWP: tl.constexpr,  # band scores gathered in the input dtype (`_pos_scores`)
    HAS_ORDER: tl.constexpr = False,
):
    pid_m, h = tl.program_id(0), tl.program_id(1)
    start, L = _sequence_span(CU, ORDER, HAS_ORDER)
    i0 = pid_m * BLOCK
    if i0 >= L:  # this sequence is shorter than the grid's max_seqlen
        return
    hh = h.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_k = tl.arange(0, BLOCK_K)
    kmask = offs_k < HEAD_DIM
    rows, mmask, q = _query_rows(Q, start, i0, L, hh, s_q_t, s_q_h, offs, offs_k, kmask)
    idx = offs[:, None] - offs[None, :] + (BLOCK - 1)  # band column of pair (m, n)
    PKh = PK + hh * s_pk_h
    PQh = PQ + hh * s_pq_h

    m_i = tl.full([BLOCK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK], tl.float32)
    acc = tl.zeros([BLOCK, BLOCK_K], tl.float32)
    e1, s3 = _key_ranges(i0, L, D_LO, D_HI, NS, BLOCK, BLOCK)
    qf, pk_row, cst = _fold(q, PKh, PQh, SLOT_MAX, s_pk_r, s_pq_r, offs_k, kmask, C2P, P2C)
    m_i, l_i, acc = _saturated_range(qf, pk_row, cst, K, V, start, L, 0, e1, hh, s_k_t, s_k_h, s_v_t, s_v_h,
                                     offs_k, kmask, m_i, l_i, acc, qk_scale, NS, C2P, PREC)
    if C2P:  # the upper half of the first band tile's c2p band: distances d0(e1) + BLOCK ..
        c_hi = _c2p_half(q, PKh, SLOT, i0 - e1 + 1, half, s_pk_r, offs_k, kmask, BLOCK, PREC, LOWP)
    for j0 in range(e1, s3, BLOCK):
        _, nmask, _, k, v = _key_block(K, V, start, j0, L, hh, s_k_t, s_k_h, s_v_t, s_v_h, offs, offs_k, kmask)
        s = tl.dot(q, tl.trans(k), input_precision=PREC)
        if C2P:  # lower half fresh (distances d0 ..), upper half = the previous tile's lower half
            c_lo = _c2p_half(q, PKh, SLOT, i0 - j0 - (BLOCK - 1), half, s_pk_r, offs_k, kmask, BLOCK, PREC, LOWP)
            s = _c2p_pick(s, c_lo, c_hi, idx, BLOCK)
            c_hi = c_lo
        if P2C:
            s = _pos_scores(s, q, k, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r, offs_k, kmask, idx,
                            False, P2C, BLOCK, PREC, LOWP)
        s = tl.where(nmask[None, :], s * qk_scale, float("-inf"))
        m_i, l_i, acc = _softmax_step(s, v, m_i, l_i, acc, PREC)
    qf, pk_row, cst = _fold(q, PKh, PQh, SLOT_MIN, s_pk_r, s_pq_r, offs_k, kmask, C2P, P2C)
    m_i, l_i, acc = _saturated_range(qf, pk_row, cst, K, V, start, L, s3, L, hh, s_k_t, s_k_h, s_v_t, s_v_h,
                                     offs_k, kmask, m_i, l_i, acc, qk_scale, NS, C2P, PREC)
    _store_rows(O, LSE, acc, m_i, l_i, rows, hh, s_o_t, s_o_h, s_lse_t, offs_k, mmask, kmask, STORE_LSE)


# ---- launchers ---------------------------------------------------------------------------------


def deberta_attention_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    pos_key: Tensor | None, pos_query: Tensor | None, position_buckets: int, max_relative_positions: int,
    scale: float, store_lse: bool = True, seq_order: Tensor | None = None, *, tiles: DebertaTiles = TILES,
) -> tuple[Tensor, Tensor | None]:
    """Launch the forward on (T, H, K) q / k / v. Return (o (T, H, K) contiguous, lse (T, H) fp32).
    `seq_order` (S,) int32: the sequences' launch order (`packing.longest_first`), or None.
    `tiles`: the launch options (`launch.DebertaTiles`; the default ships).

    lse is in log2 units of the scores times log2(e) (what the backward re-exponentiates); it is
    None when store_lse is False (eager inference: one allocation less per layer). CUDA tensors,
    or CPU tensors under TRITON_INTERPRET=1.
    """
    check_inputs(q, k, v, cu_seqlens, pos_key, pos_query)
    T, H, Kd = q.shape
    S = cu_seqlens.numel() - 1
    if T == 0 or S == 0 or max_seqlen <= 0:
        return q.new_empty((T, H, Kd)), q.new_empty((T, H), dtype=torch.float32) if store_lse else None
    pos = pos_key if pos_key is not None else pos_query
    R = pos.shape[0] if pos is not None else 2
    table, half, bounds = launch_tables(position_buckets, max_relative_positions, R, max_seqlen, q.device)
    if pos is None:  # no position terms: every key block takes the plain (saturated) path
        bounds = (NO_SATURATION, -NO_SATURATION, 0, 0)
    return launch_fwd(q, k, v, cu_seqlens, max_seqlen, pos_key, pos_query, (table, half), bounds, scale,
                      c2p=pos_key is not None, p2c=pos_query is not None, store_lse=store_lse, seq_order=seq_order,
                      tiles=tiles)


def launch_fwd(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, pos_key: Tensor | None,
               pos_query: Tensor | None, table: tuple[Tensor, int], bounds: tuple[int, int, int, int],
               scale: float, *, c2p: bool, p2c: bool, store_lse: bool, seq_order: Tensor | None = None,
               tiles: DebertaTiles = TILES) -> tuple[Tensor, Tensor | None]:
    """`deberta_attention_fwd` past its checks: the slot table and saturation bounds given, each term
    switched on its own (with both off the band loop still runs: a benchmark's content-only band);
    lse is None without store_lse. `seq_order`: the order the programs take the sequences in."""
    T, H, Kd = q.shape
    has_order = seq_order is not None and cu_seqlens.numel() - 1 <= tiles.max_grid_z  # one launch
    order = seq_order if has_order else cu_seqlens  # an unused pointer without an order
    o = torch.empty((T, H, Kd), dtype=q.dtype, device=q.device)
    # without STORE_LSE the kernel never touches its LSE pointer: o stands in for it
    lse = torch.empty((T, H), dtype=torch.float32, device=q.device) if store_lse else None
    lse_arg = lse if store_lse else o
    pk = pos_key if pos_key is not None else q
    pq = pos_query if pos_query is not None else q
    BLOCK = tiles.block(max_seqlen)
    BLOCK_K = max(16, next_pow2(Kd))
    if tiles.takes_wide(BLOCK, max_seqlen, BLOCK_K):
        launch_wide(q, k, v, cu_seqlens, order, has_order, max_seqlen, pk, pq, table, bounds, scale, c2p, p2c,
                    store_lse, o, lse_arg, tiles)
        return o, lse
    for cu, n_seq in tiles.chunks(cu_seqlens):
        launch(_fwd_kernel, (cdiv(max_seqlen, BLOCK), H, n_seq),
            q, k, v, pk, pq, table[0], cu, order, o, lse_arg,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            pk.stride(0), pk.stride(1), pq.stride(0), pq.stride(1), o.stride(0), o.stride(1), H,
            table[1], *bounds, scale * LOG2E,
            HEAD_DIM=Kd, BLOCK_K=BLOCK_K, BLOCK=BLOCK, NS=tiles.saturated_rows(BLOCK, max_seqlen),
            C2P=c2p, P2C=p2c, STORE_LSE=store_lse, PREC=prec(q.dtype), LOWP=q.dtype != torch.float32,
            HAS_ORDER=has_order, **tiles.fwd_options(BLOCK, Kd),
        )
    return o, lse
