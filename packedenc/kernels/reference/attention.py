"""Plain-torch varlen attention and the graph transformer's attention: the references every
attention kernel is tested against, and the CPU's attention (`backend="auto"` runs the reference
there). DeBERTa's disentangled attention is in `deberta.py` and groups with `by_length` too.

The spec: each packed sequence attends to itself only, within an optional FA window, softmax in
fp32, one rounding to q's dtype. It is computed on a padded (S, H, L, L) grid by torch's
`scaled_dot_product_attention` with a boolean mask (padded query rows see every key, so no row is
all -inf: a NaN there would poison the gradients). On the CPU in eager mode the sequences are
first ordered by length and run in groups padded to each group's longest (`by_length`), so a
pack of many short texts and a few long ones does not pay L^2 for every sequence; under torch.compile and on
other devices it is one grid (no host values: compile traces it, CUDA graphs capture it). With
dropout the scores go through an explicit softmax, so that the mask comes from a generator
seeded by `dropout_seed`, reproducibly.

Shapes: T packed tokens, S sequences, L longest, H heads, K head dim, G sequences of one group.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["varlen_attention", "graph_attention", "by_length", "grouping"]

# A group holds sequences no shorter than half its longest, at most this many padded rows (or one
# sequence when that is longer). Measured on the CPU (2 cores): 512 rows ran DeBERTa-v3-base on 64
# mixed-length sequences in 7.0 s (8.7 at 2048, 25.7 as one grid) and 500 short texts' attention
# in 30-37 ms (642 as one grid); smaller groups cost more calls than they save padding.
GROUP_ROWS = 512


def varlen_attention(
    q_THK: Tensor,
    k_THK: Tensor,
    v_THK: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    window: tuple[int, int] = (-1, -1),
    scale: float | None = None,
    dropout_p: float = 0.0,
    dropout_seed: int | None = None,
) -> Tensor:
    """Non-causal attention inside each packed sequence, with an optional FA-style window.

    Arguments:
        q_THK, k_THK, v_THK: (T, H, K) packed, no padding.
        cu_seqlens: (S+1,) int32. max_seqlen: host int >= the longest sequence.
        window: (left, right) like flash-attn: query i sees keys j with i - left <= j <= i + right,
            -1 meaning unbounded. ModernBERT local layers use (64, 64).
        scale: softmax scale, default K ** -0.5.
        dropout_p, dropout_seed: dropout on the attention probabilities (training), with a mask
            drawn from a generator seeded by `dropout_seed` (reference backend only).
    Return:
        (T, H, K) in q's dtype. fp32 softmax; tokens never see another sequence.
    """
    scale = q_THK.shape[-1] ** -0.5 if scale is None else scale
    dropout = dropout_p > 0.0 and dropout_seed is not None
    if not dropout and grouping(cu_seqlens):
        return _grouped(q_THK, k_THK, v_THK, cu_seqlens, window, scale)
    return _grid(q_THK, k_THK, v_THK, cu_seqlens, max_seqlen, window, scale, dropout_p if dropout else 0.0,
                 dropout_seed)


def _grid(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, L: int, window: tuple[int, int],
          scale: float, dropout_p: float = 0.0, dropout_seed: int | None = None) -> Tensor:
    """Every sequence on one padded (S, H, L, L) grid."""
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    T, H, K = q_THK.shape
    S = cu_seqlens.numel() - 1
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
    mask_S1LL = ((keep_LL[None] & key_ok_SL[:, None, :]) | ~key_ok_SL[:, :, None])[:, None]
    q_SHLK, k_SHLK, v_SHLK = grid(q_THK), grid(k_THK), grid(v_THK)
    if dropout_p > 0.0:
        scores = torch.einsum("shik,shjk->shij", q_SHLK, k_SHLK) * scale
        probs = torch.softmax(scores.masked_fill(~mask_S1LL, float("-inf")), dim=-1)
        g = torch.Generator(device=probs.device)
        g.manual_seed(dropout_seed)
        keep = torch.rand(probs.shape, generator=g, device=probs.device) >= dropout_p
        o_SHLK = torch.einsum("shij,shjk->shik", probs * keep / (1.0 - dropout_p), v_SHLK)
    else:
        o_SHLK = F.scaled_dot_product_attention(q_SHLK, k_SHLK, v_SHLK, attn_mask=mask_S1LL, scale=scale)
    return o_SHLK.transpose(1, 2)[seq_T, pos_T].to(q_THK.dtype)


def _grouped(q_THK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens: Tensor, window: tuple[int, int],
             scale: float) -> Tensor:
    """`_grid` over groups of sequences of similar length (CPU: the lengths are host values)."""
    return by_length(lambda q, k, v, cu, L: _grid(q, k, v, cu, L, window, scale), q_THK, k_THK, v_THK, cu_seqlens)


def grouping(cu_seqlens: Tensor) -> bool:
    """Whether a reference attention should run `by_length`: eager CPU calls (host lengths for free),
    not a trace (fake or functional tensors have no host lengths)."""
    return cu_seqlens.device.type == "cpu" and type(cu_seqlens) is Tensor and not torch.compiler.is_compiling()


def by_length(fn: Callable[[Tensor, Tensor, Tensor, Tensor, int], Tensor], q_THK: Tensor, k_THK: Tensor,
              v_THK: Tensor, cu_seqlens: Tensor) -> Tensor:
    """`fn(q, k, v, cu_seqlens, L)` -> (rows, H, K) run on groups of sequences ordered longest first,
    each padded to its own longest L, the results put back in the input's order. Attention never
    crosses a sequence, so any grouping gives the same rows; this one bounds the padding."""
    cu = cu_seqlens.tolist()
    lengths = [cu[s + 1] - cu[s] for s in range(len(cu) - 1)]
    order, groups = _length_groups(lengths)
    perm_T = _rows_in(cu, order)
    if perm_T is not None:
        q_THK, k_THK, v_THK = q_THK[perm_T], k_THK[perm_T], v_THK[perm_T]
    outs, row = [], 0  # built by cat, not written in place: torch.func transforms trace it too
    for group in groups:
        n = sum(lengths[s] for s in group)
        if lengths[group[0]] > 0:
            rows = slice(row, row + n)
            outs.append(fn(q_THK[rows], k_THK[rows], v_THK[rows], _cu(lengths, group), lengths[group[0]]))
        row += n
    out_THK = torch.cat(outs) if outs else q_THK.new_empty(q_THK.shape)
    return out_THK if perm_T is None else out_THK[torch.argsort(perm_T)]


def _length_groups(lengths: list[int]) -> tuple[list[int], list[list[int]]]:
    """(the sequences longest first, and that order cut into groups): a group holds sequences no
    shorter than half its first (its longest) and at most GROUP_ROWS padded rows, or one sequence."""
    S = len(lengths)
    order = sorted(range(S), key=lambda s: -lengths[s])
    groups, a = [], 0
    while a < S:
        L, z = lengths[order[a]], a + 1
        while z < S and (z + 1 - a) * L <= max(GROUP_ROWS, L) and 2 * lengths[order[z]] >= L:
            z += 1
        groups.append(order[a:z])
        a = z
    return order, groups


def _rows_in(cu: list[int], order: list[int]) -> Tensor | None:
    """The packed rows of the sequences in `order`, or None when that is the packed order already."""
    if order == list(range(len(order))):
        return None
    return torch.cat([torch.arange(cu[s], cu[s + 1]) for s in order])


def _cu(lengths: list[int], group: list[int]) -> Tensor:
    """(len(group) + 1,) int32 boundaries of the group's sequences, back to back from 0."""
    return torch.tensor([0] + [lengths[s] for s in group], dtype=torch.int64).cumsum(0).to(torch.int32)


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
) -> Tensor:
    """Non-causal packed attention with separate query / key boundaries and a per-key head bias.

    What the graph transformer needs beyond `varlen_attention`: in the anchor-only last layer
    only the first token of each sequence is a query (`cu_seqlens_q = arange(S + 1)`, keys over
    the whole sequence), and GiGL's anchor-relative attention bias adds the same scalar
    `key_bias[k, h]` to the score of key k for every query of head h.

    Arguments:
        q_QHK: (Q, H, K) packed queries; sequence s owns rows cu_seqlens_q[s]:cu_seqlens_q[s+1].
            Or, with k_THK = v_THK = None, the fused (T, 3, H, K) q / k / v buffer of a full layer
            (cu_seqlens_q = cu_seqlens_k), which lets kernels keep its gradient one tensor.
        k_THK, v_THK: (T, H, K) packed keys / values; sequence s owns cu_seqlens_k[s]:cu_seqlens_k[s+1].
        cu_seqlens_q, cu_seqlens_k: (S+1,) int32, same S. Every sequence needs at least one key.
        max_seqlen_q, max_seqlen_k: host ints >= the longest query / key run.
        key_bias_TH: (T, H) additive score bias per key and head, or None.
        scale: softmax scale, default K ** -0.5 (SDPA's default, which GiGL uses).
    Return:
        (Q, H, K) in q's dtype; fp32 scores and softmax, one rounding.

    Scatters into padded (S, H, Lq, Lk) grids (on the CPU in eager mode one per group of
    sequences of similar key length, as `varlen_attention`).
    """
    if k_THK is None and v_THK is None:
        q_QHK, k_THK, v_THK = q_QHK.unbind(1)
    scale = q_QHK.shape[-1] ** -0.5 if scale is None else scale
    if grouping(cu_seqlens_k):
        return _graph_by_length(q_QHK, k_THK, v_THK, cu_seqlens_q, cu_seqlens_k, key_bias_TH, scale)
    return _graph_grid(q_QHK, k_THK, v_THK, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, key_bias_TH,
                       scale)


def _graph_grid(q_QHK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                max_seqlen_q: int, max_seqlen_k: int, key_bias_TH: Tensor | None, scale: float) -> Tensor:
    """`graph_attention` on one padded (S, H, Lq, Lk) grid."""
    from packedenc.packing import positions_from_cu_seqlens, segment_ids

    Q, H, K = q_QHK.shape
    T = k_THK.shape[0]
    S = cu_seqlens_q.numel() - 1
    sq, pq = segment_ids(cu_seqlens_q, Q), positions_from_cu_seqlens(cu_seqlens_q, Q)
    sk, pk = segment_ids(cu_seqlens_k, T), positions_from_cu_seqlens(cu_seqlens_k, T)

    def grid(x: Tensor, seg: Tensor, pos: Tensor, L: int) -> Tensor:  # (N, H, ...) -> (S, H, L, ...)
        g = x.new_zeros((S, L, *x.shape[1:]), dtype=torch.float32)
        return g.index_put((seg, pos), x.float()).transpose(1, 2)

    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    key_ok_SL = torch.arange(max_seqlen_k, device=q_QHK.device)[None, :] < lengths_k[:, None]
    scores = torch.einsum(
        "shik,shjk->shij", grid(q_QHK, sq, pq, max_seqlen_q), grid(k_THK, sk, pk, max_seqlen_k)
    ) * scale
    if key_bias_TH is not None:
        scores = scores + grid(key_bias_TH, sk, pk, max_seqlen_k)[:, :, None, :]
    # Only keys are masked: padded query rows then see real keys (never an all -inf row, whose
    # NaN would leak into the gradients) and are dropped by the final gather.
    scores = scores.masked_fill(~key_ok_SL[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o_SHLK = torch.einsum("shij,shjk->shik", probs, grid(v_THK, sk, pk, max_seqlen_k))
    return o_SHLK.transpose(1, 2)[sq, pq].to(q_QHK.dtype)


def _graph_by_length(q_QHK: Tensor, k_THK: Tensor, v_THK: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                     key_bias_TH: Tensor | None, scale: float) -> Tensor:
    """`_graph_grid` per group of sequences of similar key length (`by_length` with two boundaries)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    S = len(ck) - 1
    lq = [cq[s + 1] - cq[s] for s in range(S)]
    lk = [ck[s + 1] - ck[s] for s in range(S)]
    order, groups = _length_groups(lk)
    perm_q = _rows_in(cq, order)
    if perm_q is not None:
        perm_k = _rows_in(ck, order)
        q_QHK, k_THK, v_THK = q_QHK[perm_q], k_THK[perm_k], v_THK[perm_k]
        key_bias_TH = None if key_bias_TH is None else key_bias_TH[perm_k]
    outs, rq, rk = [], 0, 0
    for group in groups:
        nq, nk = sum(lq[s] for s in group), sum(lk[s] for s in group)
        if nq > 0:
            bias = None if key_bias_TH is None else key_bias_TH[rk:rk + nk]
            outs.append(_graph_grid(q_QHK[rq:rq + nq], k_THK[rk:rk + nk], v_THK[rk:rk + nk], _cu(lq, group),
                                    _cu(lk, group), max(lq[s] for s in group), lk[group[0]], bias, scale))
        rq, rk = rq + nq, rk + nk
    out = torch.cat(outs) if outs else q_QHK.new_empty(q_QHK.shape)
    return out if perm_q is None else out[torch.argsort(perm_q)]
