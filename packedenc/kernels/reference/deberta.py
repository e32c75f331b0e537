"""Plain-torch reference of the DeBERTa-v2/v3 ops (disentangled attention, the conv layer's
varlen conv1d) and HF's log-bucketed relative positions: part of `packedenc.kernels.reference`,
which re-exports the ops. Same rules: fp32 math, one rounding, the executable spec.

`deberta_attention_bwd` (and `deberta_attention_lse`, the forward kernel's second output) spell out
the attention's gradient with explicit formulas: the CPU implementation of the registered
`packedenc::deberta_attention*` ops and the spec the Triton backward is tested against.

Shapes: T packed tokens, S sequences, D hidden, H heads, K head dim, L max_seqlen,
R = 2 * att_span rows of the relative-position tables, C = D / groups conv input channels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.kernels.reference.attention import by_length, grouping

__all__ = ["log_bucket_position", "relative_positions", "deberta_attention", "varlen_conv1d",
           "deberta_attention_lse", "deberta_attention_bwd"]

LOG2E = 1.4426950408889634


def log_bucket_position(rel: Tensor, bucket_size: int, max_position: int) -> Tensor:
    """HF's `make_log_bucket_position` (transformers 5.24 modeling_deberta_v2.py), op for op.

    |d| <= bucket_size // 2 stays d; beyond, sign(d) * (ceil(log(|d| / mid) / log((max_position - 1)
    / mid) * (mid - 1)) + mid). The dtypes are pinned to HF's: the ratio is float32 on `rel`'s device,
    the denominator a float32 CPU scalar. |d| = max_position - 1 is an exact float tie (x / x * (mid - 1)),
    so any other formula (float64, a precomputed constant, fused multiply) may land one bucket off.

    Arguments:
        rel: integer tensor of relative distances i - j (any shape).
    Return:
        float32 tensor of the same shape holding integral bucket values (HF casts to long after).
    """
    sign = torch.sign(rel)
    mid = bucket_size // 2
    abs_pos = torch.where((rel < mid) & (rel > -mid), torch.tensor(mid - 1).type_as(rel), torch.abs(rel))
    denom = torch.log(torch.tensor((max_position - 1) / mid, dtype=torch.float32))
    log_pos = torch.ceil(torch.log(abs_pos.to(torch.float32) / mid) / denom * (mid - 1)) + mid
    return torch.where(abs_pos <= mid, rel.type_as(log_pos), log_pos * sign)


def relative_positions(
    max_seqlen: int, position_buckets: int, max_relative_positions: int, device: torch.device | str | None = None
) -> Tensor:
    """(L, L) int64 HF relative position of query i to key j: bucket(i - j), or plain i - j without buckets.

    The disentangled attention reads table row clamp(r[i, j] + att_span, 0, 2 * att_span - 1) for c2p
    and clamp(-r[j, i] + att_span, ...) for p2c. Distances only ever pair tokens of one sequence.
    """
    idx = torch.arange(max_seqlen, dtype=torch.long, device=device)
    rel = idx[:, None] - idx[None, :]
    if position_buckets > 0 and max_relative_positions > 0:
        rel = log_bucket_position(rel, position_buckets, max_relative_positions)
    return rel.to(torch.long)


def _grid(x_TX: Tensor, seq_T: Tensor, pos_T: Tensor, S: int, L: int) -> Tensor:
    """(T, ...) packed -> (S, L, ...) fp32 grid with zeros at the pads."""
    g = x_TX.new_zeros((S, L, *x_TX.shape[1:]), dtype=torch.float32)
    return g.index_put((seq_T, pos_T), x_TX.float())


def deberta_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    pos_key_RHK: Tensor | None = None,
    pos_query_RHK: Tensor | None = None,
    *,
    pos_att_type: tuple[str, ...] = (),
    position_buckets: int = -1,
    max_relative_positions: int = -1,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
    seq_order: Tensor | None = None,
) -> Tensor:
    """DeBERTa-v2 disentangled attention (content + c2p + p2c) inside each packed sequence.

    logit[i, j] = scale * (q_i . k_j + q_i . PK[c(i, j)] + k_j . PQ[p(i, j)]), with
    c(i, j) = clamp(r(i - j) + span, 0, 2 span - 1), p(i, j) = clamp(-r(j - i) + span, 0, 2 span - 1),
    r the (log-bucketed) relative position and span = R / 2. Tokens never see another sequence.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed projections, no padding.
        cu_seqlens: (S+1,) int32. max_seqlen: host int >= the longest sequence.
        pos_key_RHK: (R, H, K) projected relative embeddings for c2p (key_proj or pos_key_proj of the
            normed `rel_embeddings`, bias included), computed once per forward. Required iff "c2p".
        pos_query_RHK: (R, H, K) the same for p2c (query_proj or pos_query_proj). Required iff "p2c".
        pos_att_type: subset of ("c2p", "p2c"); () is plain attention (relative_attention=False).
        position_buckets: > 0 turns on log buckets (span = position_buckets); <= 0: span =
            max_relative_positions and r(d) = d. max_relative_positions: resolved value (>= 1).
        scale: multiplier of every term, 1 / sqrt(K * (1 + len(config pos_att_type))).
        dropout_p, dropout_seed: dropout on the attention probabilities (training), with a mask
            drawn from a generator seeded by `dropout_seed` (reference backend only).
        seq_order: (S,) int32 launch order of the sequences for the kernels
            (`packing.longest_first`); checked, and without effect here.
    Return:
        (T, H, K) in q's dtype. fp32 scores and softmax.

    The reference uses a padded (S, H, L, L) grid and HF's bmm + gather over (S, H, L, R) tables
    (on the CPU in eager mode, one per group of sequences of similar length: `attention.by_length`);
    a kernel implements the same contract without either.
    """
    from packedenc.packing import check_seq_order

    check_seq_order(seq_order, cu_seqlens)
    c2p, p2c = "c2p" in pos_att_type, "p2c" in pos_att_type
    assert (pos_key_RHK is not None) == c2p and (pos_query_RHK is not None) == p2c, pos_att_type
    args = (pos_key_RHK, pos_query_RHK, pos_att_type, position_buckets, max_relative_positions, scale)
    if not (dropout_p > 0.0 and dropout_seed is not None) and grouping(cu_seqlens):  # CPU: pad per group
        return by_length(lambda q, k, v, cu, L: _grid_attention(q, k, v, cu, L, *args), q_THK, k_THK, v_THK,
                         cu_seqlens)
    return _grid_attention(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, *args, dropout_p, dropout_seed)


def _grid_attention(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                    pos_key_RHK: Tensor | None, pos_query_RHK: Tensor | None, pos_att_type: tuple[str, ...],
                    position_buckets: int, max_relative_positions: int, scale: float, dropout_p: float = 0.0,
                    dropout_seed: int | None = None) -> Tensor:
    """`deberta_attention` on one padded (S, H, L, L) grid."""
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    c2p, p2c = "c2p" in pos_att_type, "p2c" in pos_att_type
    T, H, K = q_THK.shape
    S, L = cu_seqlens.numel() - 1, max_seqlen
    seq_T = segment_ids(cu_seqlens, T)
    pos_T = positions_from_cu_seqlens(cu_seqlens, T)
    q = _grid(q_THK, seq_T, pos_T, S, L).transpose(1, 2)  # (S, H, L, K)
    k = _grid(k_THK, seq_T, pos_T, S, L).transpose(1, 2)
    v = _grid(v_THK, seq_T, pos_T, S, L).transpose(1, 2)

    scores = torch.einsum("shik,shjk->shij", q, k) * scale
    if c2p or p2c:
        R = (pos_key_RHK if c2p else pos_query_RHK).shape[0]
        span = position_buckets if position_buckets > 0 else max_relative_positions
        assert R == 2 * span, (R, span)
        rel_LL = relative_positions(L, position_buckets, max_relative_positions, q.device)
        if c2p:  # query i reads the key-side table at its distance to key j
            c2p_SHLR = torch.einsum("shik,rhk->shir", q, pos_key_RHK.float())
            idx = torch.clamp(rel_LL + span, 0, R - 1).expand(S, H, L, L)
            scores = scores + torch.gather(c2p_SHLR, -1, idx) * scale
        if p2c:  # key j reads the query-side table; HF gathers [key, query] then transposes
            p2c_SHLR = torch.einsum("shjk,rhk->shjr", k, pos_query_RHK.float())
            idx = torch.clamp(-rel_LL + span, 0, R - 1).expand(S, H, L, L)
            scores = scores + torch.gather(p2c_SHLR, -1, idx).transpose(-1, -2) * scale

    lengths_S = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    key_ok_SL = torch.arange(L, device=q.device)[None, :] < lengths_S[:, None]
    # Padded query rows see every column so no row is all -inf (NaN would poison gradients).
    mask_SLL = key_ok_SL[:, None, :] | ~key_ok_SL[:, :, None]
    scores = scores.masked_fill(~mask_SLL[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0 and dropout_seed is not None:  # HF: dropout on the probabilities, before @ V
        g = torch.Generator(device=probs.device)
        g.manual_seed(dropout_seed)
        keep = torch.rand(probs.shape, generator=g, device=probs.device) >= dropout_p
        probs = probs * keep / (1.0 - dropout_p)
    o_SHLK = torch.einsum("shij,shjk->shik", probs, v)
    return o_SHLK.transpose(1, 2)[seq_T, pos_T].to(q_THK.dtype)


def varlen_conv1d(
    x_TD: Tensor, weight: Tensor, bias: Tensor | None, cu_seqlens: Tensor, max_seqlen: int, groups: int = 1
) -> Tensor:
    """Conv1d along each packed sequence with zero padding (k - 1) // 2 at both of its ends.

    This is `nn.Conv1d(D, D, k, padding=(k - 1) // 2, groups)` on a padded batch whose pads are zero
    (DeBERTa-v2's ConvLayer): no token sees a neighbouring sequence.

    Arguments:
        x_TD: (T, D) packed. weight: (D, C, k) with C = D / groups and k odd. bias: (D,) or None.
        cu_seqlens: (S+1,) int32. max_seqlen: host int >= the longest sequence.
    Return:
        (T, D) in x's dtype, fp32 math.
    """
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    T, k = x_TD.shape[0], weight.shape[-1]
    assert k % 2 == 1, "even kernel sizes change the output length"
    seq_T = segment_ids(cu_seqlens, T)
    pos_T = positions_from_cu_seqlens(cu_seqlens, T)
    g_SDL = _grid(x_TD, seq_T, pos_T, cu_seqlens.numel() - 1, max_seqlen).transpose(1, 2)
    b = None if bias is None else bias.float()
    out_SDL = F.conv1d(g_SDL, weight.float(), b, padding=(k - 1) // 2, groups=groups)
    return out_SDL.transpose(1, 2)[seq_T, pos_T].to(x_TD.dtype)


# ---- the attention's gradient, written out -----------------------------------------------------


def _grids(cu_seqlens: Tensor, T: int, L: int):
    """(to_grid, to_packed, key_ok_SL): (T, H, K) <-> (S, H, L, K) fp32 with zeros at the pads."""
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    seq_T, pos_T = segment_ids(cu_seqlens, T), positions_from_cu_seqlens(cu_seqlens, T)
    S = cu_seqlens.numel() - 1

    def grid(x_THK: Tensor) -> Tensor:
        return _grid(x_THK, seq_T, pos_T, S, L).transpose(1, 2)

    def packed(x_SHLK: Tensor) -> Tensor:
        return x_SHLK.transpose(1, 2)[seq_T, pos_T]

    lengths_S = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    key_ok_SL = torch.arange(L, device=cu_seqlens.device)[None, :] < lengths_S[:, None]
    return grid, packed, key_ok_SL


def _scores(q, k, cu_seqlens, max_seqlen, pk, pq, position_buckets, max_relative_positions):
    """(S, H, L, L) fp32 unscaled scores on the padded grid, key pads -inf, and the (L, L) slots."""
    T, L = q.shape[0], max_seqlen
    grid, _, key_ok = _grids(cu_seqlens, T, L)
    qg, kg = grid(q), grid(k)
    s = qg @ kg.transpose(-1, -2)
    slot = None
    if pk is not None or pq is not None:
        R = (pk if pk is not None else pq).shape[0]
        rel = relative_positions(L, position_buckets, max_relative_positions, q.device)
        slot = torch.clamp(rel + R // 2, 0, R - 1)
        idx = slot.expand(*s.shape)
        if pk is not None:
            s = s + torch.gather(torch.einsum("shik,rhk->shir", qg, pk.float()), -1, idx)
        if pq is not None:  # key j reads PQ at slot(i - j): gather along j's rows, then transpose
            s = s + torch.gather(torch.einsum("shjk,rhk->shjr", kg, pq.float()), -1, idx.transpose(-1, -2)
                                 ).transpose(-1, -2)
    # Padded query rows see every column (no all -inf row); their gradient is zero anyway.
    ok = key_ok[:, None, :] | ~key_ok[:, :, None]
    return s.masked_fill(~ok[:, None], float("-inf")), slot


def deberta_attention_lse(q_THK: Tensor, k_THK: Tensor, cu_seqlens: Tensor, max_seqlen: int,
                          pos_key_RHK: Tensor | None, pos_query_RHK: Tensor | None, position_buckets: int,
                          max_relative_positions: int, scale: float) -> Tensor:
    """(T, H) fp32 log2-sum-exp2 of scale * log2(e) * scores: the forward kernel's LSE output (the
    log-sum-exp of the scaled scores in log2 units, what the backward re-exponentiates)."""
    s, _ = _scores(q_THK, k_THK, cu_seqlens, max_seqlen, pos_key_RHK, pos_query_RHK, position_buckets,
                   max_relative_positions)
    lse = torch.logsumexp(s * scale, -1) * LOG2E  # (S, H, L)
    return _grids(cu_seqlens, q_THK.shape[0], max_seqlen)[1](lse[..., None])[..., 0].contiguous()


def deberta_attention_bwd(do_THK: Tensor, q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor,
                          max_seqlen: int, pos_key_RHK: Tensor | None, pos_query_RHK: Tensor | None,
                          position_buckets: int, max_relative_positions: int, scale: float):
    """(dq, dk, dv, dpk, dpq) of `deberta_attention` (None for an absent table), without dropout.

    Explicit formulas, fp32, on the padded (S, H, L, L) grid: O(S L^2) memory, for CPU and tests.
    With P the softmax and G = P * (dO V^T - rowsum(P * dO V^T)) * scale the gradient of the unscaled
    scores, dq = G (k + PK[slot]), dk = G^T (q + PQ[slot]), dv = P^T dO, and dPK / dPQ sum G q / G^T k
    over the pairs that read each table row.
    """
    q, k, pk, pq = q_THK, k_THK, pos_key_RHK, pos_query_RHK
    T, L = q.shape[0], max_seqlen
    grid, packed, _ = _grids(cu_seqlens, T, L)
    s, slot = _scores(q, k, cu_seqlens, max_seqlen, pk, pq, position_buckets, max_relative_positions)
    p = torch.softmax(s * scale, -1)
    qg, kg, vg, dog = grid(q), grid(k), grid(v_THK), grid(do_THK)
    dp = dog @ vg.transpose(-1, -2)
    g = p * (dp - (p * dp).sum(-1, keepdim=True)) * scale
    dq, dk, dv = g @ kg, g.transpose(-1, -2) @ qg, p.transpose(-1, -2) @ dog
    dpk = dpq = None
    if pk is not None:  # per query row, G summed over the keys sharing a slot
        gc = torch.zeros(*g.shape[:-1], pk.shape[0], dtype=g.dtype, device=g.device)
        gc.scatter_add_(-1, slot.expand(*g.shape), g)
        dq = dq + torch.einsum("shir,rhk->shik", gc, pk.float())
        dpk = torch.einsum("shir,shik->rhk", gc, qg).to(pk.dtype)
    if pq is not None:  # per key row j, G summed over the queries sharing a slot
        gp = torch.zeros(*g.shape[:-1], pq.shape[0], dtype=g.dtype, device=g.device)
        gp.scatter_add_(-1, slot.transpose(-1, -2).expand(*g.shape), g.transpose(-1, -2))
        dk = dk + torch.einsum("shjr,rhk->shjk", gp, pq.float())
        dpq = torch.einsum("shjr,shjk->rhk", gp, kg).to(pq.dtype)
    dq, dk, dv = (packed(t).to(q.dtype).contiguous() for t in (dq, dk, dv))
    return dq, dk, dv, dpk, dpq
