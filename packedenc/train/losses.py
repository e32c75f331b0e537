"""Packed losses as pure functions: MLM, in-batch contrastive (InfoNCE), ColBERT MaxSim, classification.

Shapes: T packed tokens, S sequences, D hidden, M masked tokens, V vocab, Q queries, P passages.
Nothing here pads: scores over packed token buffers use segment reductions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from packedenc.errors import InputError
from packedenc.packing import segment_ids

__all__ = ["mlm_loss", "mlm_token_losses", "info_nce", "maxsim_scores", "colbert_loss", "classification_loss",
           "mask_tokens"]


def mask_tokens(
    ids_T: Tensor,
    *,
    mask_token_id: int,
    vocab_size: int,
    special_ids: Tensor | None = None,
    prob: float = 0.3,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """BERT-style masking of a packed batch (80% [MASK], 10% random, 10% unchanged).

    Return:
        masked_ids (T,), positions (M,) of the tokens to predict, targets (M,) their original ids.
        Decided on the host side of a data loader, so the loss needs no device sync.
    """
    g = generator
    candidates = torch.ones_like(ids_T, dtype=torch.bool)
    if special_ids is not None:
        candidates &= ~torch.isin(ids_T, special_ids.to(ids_T.device))
    chosen = candidates & (torch.rand(ids_T.shape, generator=g, device=ids_T.device) < prob)
    positions = torch.nonzero(chosen).flatten()
    targets = ids_T[positions]
    r = torch.rand(positions.shape, generator=g, device=ids_T.device)
    masked = ids_T.clone()
    masked[positions[r < 0.8]] = mask_token_id
    rand_pos = positions[(r >= 0.8) & (r < 0.9)]
    masked[rand_pos] = torch.randint(vocab_size, rand_pos.shape, generator=g, device=ids_T.device)
    return masked, positions, targets


def mlm_token_losses(params, hidden_TD: Tensor, positions_M: Tensor, targets_M: Tensor, *,
                     backend="auto") -> Tensor:
    """(M,) fp32 cross-entropy of the MLM head at each masked position (never scored on all T).

    Families whose module has `mlm_head` (features, decoder weight, bias) go through
    `ops.linear_cross_entropy`: with the Triton backend the (M, V) logits are never kept in fp32
    (nor at all: their gradient overwrites them). Others take `mlm_logits` and F.cross_entropy.
    Targets of -100 are ignored (loss 0), as in F.cross_entropy.
    """
    from packedenc.kernels import get_ops
    from packedenc.models import family_of

    if positions_M.shape != targets_M.shape:
        raise InputError(f"positions {tuple(positions_M.shape)} and targets {tuple(targets_M.shape)} differ")
    family = family_of(params)
    ops = get_ops(backend, hidden_TD.device)
    h_MD = hidden_TD.index_select(0, positions_M)
    if hasattr(family, "mlm_head"):
        return ops.linear_cross_entropy(*family.mlm_head(params, h_MD, backend=ops), targets_M)
    logits_MV = family.mlm_logits(params, h_MD, backend=ops)
    return F.cross_entropy(logits_MV.float(), targets_M, reduction="none")


def mlm_loss(params, hidden_TD: Tensor, positions_M: Tensor, targets_M: Tensor, *, backend="auto") -> Tensor:
    """Mean cross-entropy of the MLM head, computed only on the M masked positions (never on all T).

    Arguments:
        params: a params tree with an MLM head (ModernBERT, DeBERTa, BERT checkpoints with one).
        hidden_TD: (T, D) output of `encode`. positions_M: (M,) int, rows of hidden_TD to score.
        targets_M: (M,) int, the original token ids there (-100: ignored, as in F.cross_entropy).
    Return:
        scalar fp32: the mean over the rows not ignored (`mlm_token_losses`).
    """
    losses_M = mlm_token_losses(params, hidden_TD, positions_M, targets_M, backend=backend)
    return losses_M.sum() / (targets_M != -100).sum()


def info_nce(q_QD: Tensor, p_PD: Tensor, *, temperature: float = 0.05, normalize: bool = True,
             q_valid: Tensor | None = None, p_valid: Tensor | None = None) -> Tensor:
    """In-batch contrastive loss: query i's positive is passage i; every other passage (including
    extra hard negatives after the first Q) is a negative.

    Arguments:
        q_QD: (Q, D) pooled query embeddings. p_PD: (P, D), P >= the real queries, passages
            [positives | negatives].
        q_valid, p_valid: (Q,) / (P,) masks of real rows (nonzero = real), e.g. the per-sequence
            weight fields of a graphed step, whose padded batches end in dummy sequences: a dummy
            query adds no loss, a dummy passage is no negative. None: every row is real.
    """
    Q, P = q_QD.shape[0], p_PD.shape[0]
    if q_valid is None and P < Q:
        raise InputError(f"info_nce needs at least one passage per query, got {Q} queries and {P} passages")
    q, p = q_QD.float(), p_PD.float()
    if normalize:
        q, p = F.normalize(q, dim=-1), F.normalize(p, dim=-1)
    scores_QP = q @ p.T / temperature
    target = torch.arange(Q, device=q.device)
    if p_valid is not None:
        scores_QP = scores_QP.masked_fill(p_valid.reshape(1, P) == 0, float("-inf"))
    if q_valid is not None:
        target = torch.where((q_valid.reshape(Q) != 0) & (target < P), target, -100)
    return F.cross_entropy(scores_QP, target)


def maxsim_scores(q_TD: Tensor, q_cu: Tensor, d_TD: Tensor, d_cu: Tensor) -> Tensor:
    """ColBERT late interaction over packed token embeddings.

    score[i, j] = sum over query i's tokens of the max similarity to any token of document j.
    Arguments:
        q_TD: (Tq, D) query token embeddings, packed by q_cu (Q+1,). d_TD: (Td, D) by d_cu (P+1,).
    Return:
        (Q, P) fp32 scores. Cost: one (Tq, Td) similarity matrix, then segment reductions.
    """
    Q, P = q_cu.numel() - 1, d_cu.numel() - 1
    Tq, Td = q_TD.shape[0], d_TD.shape[0]
    sim_TqTd = q_TD.float() @ d_TD.float().T
    doc_of = segment_ids(d_cu, Td).unsqueeze(0).expand(Tq, Td)
    best_TqP = sim_TqTd.new_full((Tq, P), float("-inf")).scatter_reduce(
        1, doc_of, sim_TqTd, reduce="amax", include_self=False
    )
    return sim_TqTd.new_zeros(Q, P).index_add(0, segment_ids(q_cu, Tq), best_TqP)


def colbert_loss(q_TD: Tensor, q_cu: Tensor, d_TD: Tensor, d_cu: Tensor, *, temperature: float = 1.0) -> Tensor:
    """In-batch cross-entropy over MaxSim scores (query i's positive is document i)."""
    scores_QP = maxsim_scores(q_TD, q_cu, d_TD, d_cu) / temperature
    Q = scores_QP.shape[0]
    if scores_QP.shape[1] < Q:
        raise InputError(f"colbert_loss needs a document per query, got {Q} queries, {scores_QP.shape[1]} docs")
    return F.cross_entropy(scores_QP, torch.arange(Q, device=scores_QP.device))


def classification_loss(logits_SC: Tensor, labels_S: Tensor) -> Tensor:
    """Cross-entropy of (S, C) logits against (S,) integer labels, in fp32."""
    if logits_SC.shape[0] != labels_S.shape[0]:
        raise InputError(f"{logits_SC.shape[0]} logits rows but {labels_S.shape[0]} labels")
    return F.cross_entropy(logits_SC.float(), labels_S)
