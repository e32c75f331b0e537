"""Backward of the packed DeBERTa disentangled attention: one kernel that recomputes each tile once.

Shapes: T packed tokens, S sequences, H heads, K head dim, R position-table rows, M = N = BLOCK tile
rows, W = 2 * BLOCK band distances (see `forward.py`).

With P the softmax, G = P * (dO V^T - rowsum(dO * O)) * scale the gradient of the unscaled score
q_i.k_j + q_i.PK[slot(i - j)] + k_j.PQ[slot(i - j)]:
    dq_i = sum_j G_ij (k_j + PK[slot])         dk_j = sum_i G_ij (q_i + PQ[slot])       dv = P^T dO
    dPK[r] = sum_{slot(i - j) = r} G_ij q_i    dPQ[r] = sum_{slot(i - j) = r} G_ij k_j
(`reference.deberta.deberta_attention_bwd` writes the same out in plain torch.)

`_bwd_onepass_kernel`: one program per key block loops over the query blocks of its sequence,
recomputes each tile's scores exactly as the forward (same band GEMMs, same slot lookups),
re-exponentiates with the forward's log-sum-exp and produces every gradient from the tile: dk, dv
in registers; dq as fp32 atomics into a (T, H, K) buffer (every key block of the sequence adds to a
query block's rows); dPK / dPQ as fp32 atomics per band distance. The band terms are the transposes
of the forward's picks: a `tl.gather` scatters G into (M, W) / (W, N) band layout, one GEMM with the
gathered table rows gives the dq / dk part, another the per-distance table gradient, added to the
fp32 dPK / dPQ at its slot with `tl.atomic_add` (several distances share a slot, programs share
slots; `sem="relaxed"`: the adds need no ordering with other memory, and Triton's default acq_rel
fences each one). Rank-1 tiles (one slot) add a row sum of G times the table row; their table
gradient is summed in registers over a run of tiles with the same slot and added once per run.

FA2's split (a dq kernel and a dk / dv kernel) recomputes every tile twice; for DeBERTa that
recompute is the expensive part (a band tile's c2p and p2c each cost a band GEMM and a gather), and
the one-pass kernel is 1.5x faster on an H200 (benchmarks/results/history/NOTES-diary.md). The price: dq and the table
gradients are summed in the order the programs finish, so they vary in the last bits from run to
run, and one (T, H, K) fp32 buffer. Under `torch.use_deterministic_algorithms(True)` the backward
raises (warns with warn_only=True), as torch's own atomic kernels do.
"""

from __future__ import annotations

import warnings

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels.triton._common import cdiv, launch, next_pow2
from packedenc.kernels.triton.deberta.launch import LOG2E, TILES, DebertaTiles, check_inputs, prec
from packedenc.kernels.triton.deberta.scores import _pos_scores
from packedenc.kernels.triton.deberta.slots import _slot, slot_table
from packedenc.kernels.triton.deberta.tiles import _key_block, _query_rows, _sequence_span

__all__ = ["deberta_attention_bwd"]


# ---- kernel ------------------------------------------------------------------------------------


@triton.jit
def _query_block(Q, DO, LSE, DELTA, start, i0, L, hh, s_q_t, s_q_h, s_do_t, s_do_h, s_lse_t, offs, offs_k, kmask):
    """Rows i0 .. i0 + B - 1 of a sequence at `start`: (token rows, row mask, (B, K) mask, q, dO, LSE, delta)."""
    rows, mmask, q = _query_rows(Q, start, i0, L, hh, s_q_t, s_q_h, offs, offs_k, kmask)
    qmask = mmask[:, None] & kmask[None, :]
    do = tl.load(DO + rows[:, None] * s_do_t + hh * s_do_h + offs_k[None, :], mask=qmask, other=0.0)
    lse = tl.load(LSE + rows * s_lse_t + hh, mask=mmask, other=0.0)
    delta = tl.load(DELTA + rows * s_lse_t + hh, mask=mmask, other=0.0)
    return rows, mmask, qmask, q, do, lse, delta


@triton.jit
def _probs_and_grad(q, k, v, do, lse, delta, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r,
                    offs_k, kmask, idx, valid, qk_scale, scale,
                    C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr,
                    LOWP: tl.constexpr):
    """(P, G) of a tile in fp32: the forward's probabilities and the score gradient, 0 off `valid`."""
    s = tl.dot(q, tl.trans(k), input_precision=PREC)
    if C2P or P2C:
        s = _pos_scores(s, q, k, PKh, PQh, SLOT, i0, j0, half, hh, s_pk_r, s_pq_r, offs_k, kmask, idx,
                        C2P, P2C, BLOCK, PREC, LOWP)
    p = tl.where(valid, tl.exp2(s * qk_scale - lse[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PREC)
    return p, p * (dp - delta[:, None]) * scale


@triton.jit
def _bwd_onepass_kernel(
    Q, K, V, PK, PQ, SLOT, CU,  # as in the forward
    DO, LSE, DELTA,  # (T, H, K) output gradient; (T, H) fp32 forward LSE; (T, H) fp32 rowsum(dO * O)
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
                dq, dk, run_slot, run_pk, run_gn = _rank1_grads(
                    g, q, k, dq, dk, slot_lo, run_slot, run_pk, run_gn, PKh, PQh, DPKh, DPQh,
                    s_pk_r, s_pq_r, s_dpk_r, s_dpq_r, offs_k, kmask, C2P, P2C, BLOCK, BLOCK_K)
            else:
                dq, dk = _band_grads(g16, q, k, dq, dk, SLOT, d0, half, w, offs, PKh, PQh, DPKh, DPQh,
                                     s_pk_r, s_pq_r, s_dpk_r, s_dpq_r, offs_k, kmask, C2P, P2C, BLOCK, PREC)
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


@triton.jit
def _rank1_grads(g, q, k, dq, dk, slot, run_slot, run_pk, run_gn, PKh, PQh, DPKh, DPQh,
                 s_pk_r, s_pq_r, s_dpk_r, s_dpq_r, offs_k, kmask,
                 C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    """A tile whose pairs all read table row `slot`: its dq / dk terms are a row / column sum of G
    times the row; its table gradients join the current run (a new slot flushes the finished run).
    Return (dq, dk, run_slot, run_pk, run_gn)."""
    if slot != run_slot:
        if run_slot >= 0:
            _flush_run(DPKh, DPQh, run_slot, run_pk, run_gn, k, s_dpk_r, s_dpq_r, offs_k, kmask, C2P, P2C)
        run_pk = tl.zeros([BLOCK_K], tl.float32)
        run_gn = tl.zeros([BLOCK], tl.float32)
        run_slot = slot
    if C2P:
        g_m = tl.sum(g, 1)
        pk = tl.load(PKh + slot.to(tl.int64) * s_pk_r + offs_k, mask=kmask, other=0.0)
        dq += g_m[:, None] * pk.to(tl.float32)[None, :]
        run_pk += tl.sum(q.to(tl.float32) * g_m[:, None], 0)
    if P2C:
        g_n = tl.sum(g, 0)
        pq = tl.load(PQh + slot.to(tl.int64) * s_pq_r + offs_k, mask=kmask, other=0.0)
        dk += g_n[:, None] * pq.to(tl.float32)[None, :]
        run_gn += g_n
    return dq, dk, run_slot, run_pk, run_gn


@triton.jit
def _band_grads(g16, q, k, dq, dk, SLOT, d0, half, w, offs, PKh, PQh, DPKh, DPQh,
                s_pk_r, s_pq_r, s_dpk_r, s_dpq_r, offs_k, kmask,
                C2P: tl.constexpr, P2C: tl.constexpr, BLOCK: tl.constexpr, PREC: tl.constexpr):
    """A band tile (distances d0 + w, w < 2 * BLOCK): G scattered into (M, W) / (W, N) band layout by a
    `tl.gather`, one GEMM with the slot rows for the dq / dk part, one for the per-distance table
    gradient, added at its slot by fp32 atomics. Return (dq, dk)."""
    slot_w = _slot(SLOT, d0 + w, half).to(tl.int64)
    # The band index tensors are formed here, per tile, not once before the loop: held across it
    # they cost ~60 registers a thread and the kernel spills (sm_90 ptxas, 4 warps).
    if C2P:
        band_n = offs[:, None] - w[None, :] + (BLOCK - 1)  # (M, W): key column of (m, w)
        n_ok = (band_n >= 0) & (band_n < BLOCK)
        band_n = tl.minimum(tl.maximum(band_n, 0), BLOCK - 1)
        pkw = tl.load(PKh + slot_w[:, None] * s_pk_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
        gc = tl.where(n_ok, tl.gather(g16, band_n, axis=1), 0.0)  # (M, W)
        dq += tl.dot(gc, pkw.to(q.dtype), input_precision=PREC)
        dpkw = tl.dot(tl.trans(gc), q, input_precision=PREC)  # (W, K)
        tl.atomic_add(DPKh + slot_w[:, None] * s_dpk_r + offs_k[None, :], dpkw, mask=kmask[None, :], sem="relaxed")
    if P2C:
        band_m = w[:, None] + offs[None, :] - (BLOCK - 1)  # (W, N): query row of (w, n)
        m_ok = (band_m >= 0) & (band_m < BLOCK)
        band_m = tl.minimum(tl.maximum(band_m, 0), BLOCK - 1)
        pqw = tl.load(PQh + slot_w[:, None] * s_pq_r + offs_k[None, :], mask=kmask[None, :], other=0.0)
        gp = tl.where(m_ok, tl.gather(g16, band_m, axis=0), 0.0)  # (W, N)
        dk += tl.dot(tl.trans(gp), pqw.to(k.dtype), input_precision=PREC)
        dpqw = tl.dot(gp, k, input_precision=PREC)  # (W, K)
        tl.atomic_add(DPQh + slot_w[:, None] * s_dpq_r + offs_k[None, :], dpqw, mask=kmask[None, :], sem="relaxed")
    return dq, dk


# ---- launcher ----------------------------------------------------------------------------------


def _alert_not_deterministic() -> None:
    """fp32 atomic sums (module docstring): an error under torch.use_deterministic_algorithms(True),
    a warning with warn_only=True, as torch's own atomic-based CUDA kernels do."""
    if torch.are_deterministic_algorithms_enabled():
        msg = ("packedenc DeBERTa attention backward sums dq and the position-table gradients with fp32 "
               "atomics and is not deterministic; torch.use_deterministic_algorithms(True, warn_only=True) "
               "runs it with a warning")
        if not torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(msg)
        warnings.warn(msg, stacklevel=3)


def deberta_attention_bwd(
    do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, cu_seqlens: Tensor, max_seqlen: int,
    pos_key: Tensor | None, pos_query: Tensor | None, position_buckets: int, max_relative_positions: int,
    scale: float, *, tiles: DebertaTiles = TILES,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
    """Launch the backward. Return (dq, dk, dv) contiguous in q's dtype, dpk / dpq in the tables' dtypes.

    `o` and `lse` are the forward's outputs (lse from `forward.deberta_attention_fwd(store_lse=True)`).
    `tiles`: the launch options (`launch.DebertaTiles`; the default ships).
    """
    check_inputs(q, k, v, cu_seqlens, pos_key, pos_query)
    _alert_not_deterministic()
    T, H, Kd = q.shape
    S = cu_seqlens.numel() - 1
    do = do if do.stride(-1) == 1 else do.contiguous()
    dq, dk, dv = (torch.empty((T, H, Kd), dtype=q.dtype, device=q.device) for _ in range(3))
    dpk = torch.zeros(pos_key.shape, dtype=torch.float32, device=q.device) if pos_key is not None else None
    dpq = torch.zeros(pos_query.shape, dtype=torch.float32, device=q.device) if pos_query is not None else None
    if T and S and max_seqlen > 0:
        delta = (do.float() * o.float()).sum(-1)  # (T, H): rowsum(dO * O), FA's preprocessing
        lse = lse.contiguous()
        pos = pos_key if pos_key is not None else pos_query
        R = pos.shape[0] if pos is not None else 2  # any table when there is no position term
        table, half = slot_table(position_buckets, max_relative_positions, R, max_seqlen, q.device)
        pk = pos_key if pos_key is not None else q
        pq = pos_query if pos_query is not None else q
        BLOCK = tiles.block(max_seqlen)
        dpk_ = dpk if dpk is not None else delta  # any fp32 pointer when the table is absent
        dpq_ = dpq if dpq is not None else delta
        dq32 = torch.zeros((T, H, Kd), dtype=torch.float32, device=q.device)
        for cu, n_seq in tiles.chunks(cu_seqlens):
            launch(_bwd_onepass_kernel, (cdiv(max_seqlen, BLOCK), H, n_seq),
                q, k, v, pk, pq, table, cu, do, lse, delta, dq32, dk, dv, dpk_, dpq_,
                q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                pk.stride(0), pk.stride(1), pq.stride(0), pq.stride(1), do.stride(0), do.stride(1),
                dq32.stride(0), dq32.stride(1), dk.stride(0), dk.stride(1), lse.stride(0),
                dpk_.stride(0), dpk_.stride(-2), dpq_.stride(0), dpq_.stride(-2),
                half, scale * LOG2E, scale,
                HEAD_DIM=Kd, BLOCK_K=max(16, next_pow2(Kd)), BLOCK=BLOCK, C2P=pos_key is not None,
                P2C=pos_query is not None, PREC=prec(q.dtype), LOWP=q.dtype != torch.float32,
                **tiles.bwd_options(BLOCK, Kd),
            )
        dq.copy_(dq32)
    else:
        for t in (dq, dk, dv):
            t.zero_()
    dpk = dpk.to(pos_key.dtype) if dpk is not None else None
    dpq = dpq.to(pos_query.dtype) if dpq is not None else None
    return dq, dk, dv, dpk, dpq
