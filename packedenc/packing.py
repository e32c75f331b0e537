"""Packed (padding-free) batches: build them, check them, take them apart, pool over them.

Shapes: T packed tokens, S sequences, D hidden, L longest sequence.
A packed batch is the flash-attention varlen layout: all sequences back to back in `ids [T]`,
sequence `s` occupying `ids[cu_seqlens[s]:cu_seqlens[s + 1]]`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

from packedenc.checks import as_device, check_cu_seqlens, check_ids, check_max_seqlen, host_values
from packedenc.errors import InputError, InputTypeError
from packedenc.pytree import pytree_dataclass, static

__all__ = [
    "Packed",
    "pack",
    "pack_padded",
    "unpack",
    "pad",
    "positions_from_cu_seqlens",
    "segment_ids",
    "longest_first",
    "check_seq_order",
    "check_cu_seqlens",
    "check_ids",
    "pool",
    "pool_first",
    "pool_mean",
    "pool_max",
    "token_budget_batches",
]


@pytree_dataclass
class Packed:
    """A padding-free batch. Frozen; move it with `.to(device)`.

    Fields:
        ids: (T,), int64 token ids, sequences back to back.
        cu_seqlens: (S + 1,), int32, cumulative lengths starting at 0.
        positions: (T,), int64, position within its own sequence (restarts at 0).
        max_seqlen: host int, the longest sequence (what flash kernels need without a sync).
    """

    ids: Tensor
    cu_seqlens: Tensor
    positions: Tensor
    max_seqlen: int = static(0)

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()

    @property
    def lengths(self) -> Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def to(self, device: torch.device | str) -> "Packed":
        return dataclasses.replace(
            self,
            ids=self.ids.to(device, non_blocking=True),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
            positions=self.positions.to(device, non_blocking=True),
        )


# ---- building ---------------------------------------------------------------------------------


def segment_ids(cu_seqlens: Tensor, total: int) -> Tensor:
    """(T,) int64 sequence index of every packed token. No host sync (`output_size` is given)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    seq = torch.arange(lengths.numel(), device=cu_seqlens.device)
    return torch.repeat_interleave(seq, lengths, output_size=total)


def positions_from_cu_seqlens(cu_seqlens: Tensor, total: int) -> Tensor:
    """(T,) int64 position of every token inside its own sequence. No host sync."""
    starts = cu_seqlens[:-1].long()
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    offset = torch.repeat_interleave(starts, lengths, output_size=total)
    return torch.arange(total, device=cu_seqlens.device) - offset


def longest_first(cu_seqlens: Tensor) -> Tensor:
    """(S,) int32 sequence indices, longest first (ties in index order). No host sync.

    A scheduling hint for kernels that give each sequence its own programs (the DeBERTa attention):
    started longest first, the short sequences fill the last wave (`check_seq_order`).
    """
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.argsort(lengths, descending=True, stable=True).to(torch.int32)


def check_seq_order(seq_order: Tensor | None, cu_seqlens: Tensor) -> None:
    """Raise InputError unless `seq_order` is None or a (S,) int32 tensor on cu_seqlens' device.

    Its values must be a permutation of 0..S-1 (as `longest_first` returns): checked on the CPU,
    not on a GPU (that would sync with the device, as for cu_seqlens' values).
    """
    if seq_order is None:
        return
    S = cu_seqlens.numel() - 1
    if not isinstance(seq_order, Tensor) or seq_order.dtype != torch.int32 or seq_order.shape != (S,):
        got = f"{seq_order.dtype} {tuple(seq_order.shape)}" if isinstance(seq_order, Tensor) else type(seq_order).__name__
        raise InputError(f"seq_order must be an int32 ({S},) permutation of the sequences "
                         f"(packedenc.packing.longest_first(cu_seqlens)), got {got}")
    if seq_order.device != cu_seqlens.device or not seq_order.is_contiguous():
        raise InputError(f"seq_order must be contiguous and on {cu_seqlens.device}, like cu_seqlens; "
                         f"got {seq_order.device}{'' if seq_order.is_contiguous() else ', strided'}")
    if seq_order.device.type == "cpu" and not torch.equal(torch.sort(seq_order).values,
                                                          torch.arange(S, dtype=torch.int32)):
        raise InputError(f"seq_order must hold each sequence index 0..{S - 1} exactly once")


def _cu_from_lengths(lengths: Tensor) -> Tensor:
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    torch.cumsum(lengths, 0, out=cu[1:])
    return cu


def pack(
    sequences: Sequence[Sequence[int] | Tensor], *, device: torch.device | str | None = None
) -> Packed:
    """Pack a list of token-id sequences into one padding-free batch.

    Arguments:
        sequences: S non-empty sequences of ints (lists or 1-D integer tensors).
        device: where the packed tensors go (default CPU).
    Return:
        `Packed` with ids (T,), int32 cu_seqlens (S+1,), positions (T,) and host-int max_seqlen.
    """
    if isinstance(sequences, Tensor):
        raise InputError(
            "pack() takes a list of sequences; for a padded (batch, length) tensor use "
            "pack_padded(ids, attention_mask)"
        )
    if isinstance(sequences, (str, bytes)) or not hasattr(sequences, "__len__"):
        raise InputTypeError(f"pack() takes a list of token-id sequences, got {type(sequences).__name__}")
    device = as_device(device)
    if len(sequences) == 0:
        raise InputError("pack() got an empty batch: pass at least one sequence")
    parts = []
    for i, s in enumerate(sequences):
        try:
            if isinstance(s, (str, bytes)):
                raise TypeError(f"got a {type(s).__name__}; tokenize texts with packedenc.pack_texts")
            t = s if isinstance(s, Tensor) else torch.as_tensor(list(s))
        except (TypeError, ValueError, RuntimeError, OverflowError) as e:
            raise InputError(f"sequence {i} is not a list of integer token ids: {e}") from None
        if t.numel() == 0:
            raise InputError(f"sequence {i} is empty: every packed sequence needs at least one token")
        if t.dim() != 1:
            raise InputError(f"sequence {i} must be 1-D, got shape {tuple(t.shape)}")
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise InputError(f"sequence {i} must hold integer token ids, got {t.dtype}")
        parts.append(t.long())
    lengths = torch.tensor([p.numel() for p in parts], dtype=torch.int32)
    ids = torch.cat(parts)
    cu = _cu_from_lengths(lengths)
    batch = Packed(
        ids=ids,
        cu_seqlens=cu,
        positions=positions_from_cu_seqlens(cu, ids.numel()),
        max_seqlen=int(lengths.max()),
    )
    return batch if device is None else batch.to(device)


def pack_padded(ids: Tensor, attention_mask: Tensor | None = None) -> Packed:
    """Pack a padded (S, L) batch, keeping the tokens where `attention_mask` is 1 (any side)."""
    if not isinstance(ids, Tensor) or (attention_mask is not None and not isinstance(attention_mask, Tensor)):
        raise InputTypeError("pack_padded(ids, attention_mask) takes tensors; for lists of ids use pack()")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"pack_padded: ids must be an integer tensor, got {ids.dtype}")
    if ids.dim() != 2:
        raise InputError(f"pack_padded expects ids of shape (batch, length), got {tuple(ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(ids, dtype=torch.bool)
    if attention_mask.shape != ids.shape:
        raise InputError(
            f"attention_mask shape {tuple(attention_mask.shape)} differs from ids {tuple(ids.shape)}"
        )
    mask = attention_mask.bool()
    lengths = mask.sum(1, dtype=torch.int32)
    if ids.shape[0] == 0:
        raise InputError("pack_padded() got an empty batch")
    if bool((lengths == 0).any()):
        raise InputError(f"rows {torch.nonzero(lengths == 0).flatten().tolist()} have no real token")
    cu = _cu_from_lengths(lengths)
    flat = ids[mask].long()
    return Packed(
        ids=flat,
        cu_seqlens=cu,
        positions=positions_from_cu_seqlens(cu, flat.numel()),
        max_seqlen=int(lengths.max()),
    )


def unpack(x: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """Split a packed (T, ...) tensor into a list of per-sequence views (syncs once for lengths,
    and checks cu_seqlens on those host values)."""
    _check_packed(x, cu_seqlens, False, "unpack")
    cu = cu_seqlens.tolist()
    if cu_seqlens.device.type != "cpu":  # the values are on the host now: checking them is free
        check_cu_seqlens(torch.tensor(cu), x.shape[0])
    return list(torch.split(x, [b - a for a, b in zip(cu[:-1], cu[1:])], dim=0))


def pad(
    x: Tensor, cu_seqlens: Tensor, max_seqlen: int | None = None, value: float = 0.0, *, validate: bool = False
) -> tuple[Tensor, Tensor]:
    """Scatter a packed (T, ...) tensor into (S, L, ...) plus a (S, L) bool mask of real tokens.

    GPU boundaries are checked when max_seqlen is None (its computation syncs anyway) or with
    validate=True; CPU ones always.
    """
    validate = validate or max_seqlen is None
    _check_packed(x, cu_seqlens, validate, "pad")
    check_max_seqlen(max_seqlen, cu_seqlens if host_values(cu_seqlens, validate) else None)
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    S, T = cu_seqlens.numel() - 1, x.shape[0]
    seq = segment_ids(cu_seqlens, T)
    pos = positions_from_cu_seqlens(cu_seqlens, T)
    out = x.new_full((S, max_seqlen, *x.shape[1:]), value)
    out = out.index_put((seq, pos), x)
    mask = torch.zeros(S, max_seqlen, dtype=torch.bool, device=x.device)
    mask = mask.index_put((seq, pos), torch.ones_like(pos, dtype=torch.bool))
    return out, mask


# ---- checks: `packedenc.checks` (re-exported here, where callers have always found them) ------


def _check_packed(x: Any, cu_seqlens: Any, validate: bool, what: str) -> None:
    """Entry check of the functions below: x a tensor with a row per token, cu_seqlens valid over
    them (values read on the CPU always, on a GPU only with validate=True)."""
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise InputTypeError(f"{what}: x must be a (T, ...) tensor with one row per packed token, got "
                             f"{type(x).__name__ if not isinstance(x, Tensor) else tuple(x.shape)}")
    check_cu_seqlens(cu_seqlens, values=False)
    if cu_seqlens.device != x.device:
        raise InputError(f"{what}: cu_seqlens is on {cu_seqlens.device} but x on {x.device}; move both")
    if host_values(cu_seqlens, validate):
        check_cu_seqlens(cu_seqlens, x.shape[0])


# ---- pooling (no Python loop over sequences) --------------------------------------------------


def pool_first(x: Tensor, cu_seqlens: Tensor, *, validate: bool = False) -> Tensor:
    """(T, D) -> (S, D): each sequence's first token (CLS pooling)."""
    _check_packed(x, cu_seqlens, validate, "pool_first")
    return first_rows(x, cu_seqlens)


def pool_last(x: Tensor, cu_seqlens: Tensor, *, validate: bool = False) -> Tensor:
    """(T, D) -> (S, D): each sequence's last token."""
    _check_packed(x, cu_seqlens, validate, "pool_last")
    return last_rows(x, cu_seqlens)


def pool_mean(x: Tensor, cu_seqlens: Tensor, weights: Tensor | None = None, *, validate: bool = False) -> Tensor:
    """(T, D) -> (S, D): mean over each sequence's tokens, in fp32, returned in x's dtype.

    `weights` (T,) turns it into a weighted mean (sentence-transformers' weighted-mean pooling).
    """
    _check_packed(x, cu_seqlens, validate, "pool_mean")
    if weights is not None and (not isinstance(weights, Tensor) or weights.shape != x.shape[:1]
                                or weights.device != x.device):
        raise InputError(f"pool_mean: weights must be a ({x.shape[0]},) tensor on {x.device}, got "
                         f"{tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__}")
    return mean_rows(x, cu_seqlens, weights)


def pool_max(x: Tensor, cu_seqlens: Tensor, *, validate: bool = False) -> Tensor:
    """(T, D) -> (S, D): elementwise max over each sequence's tokens."""
    _check_packed(x, cu_seqlens, validate, "pool_max")
    return max_rows(x, cu_seqlens)


_POOLERS = {"first": pool_first, "cls": pool_first, "mean": pool_mean, "max": pool_max, "last": pool_last}


def pool(x: Tensor, cu_seqlens: Tensor, mode: str = "mean", *, validate: bool = False) -> Tensor:
    """Per-sequence pooling by name: "cls"/"first", "mean", "max" or "last".

    cu_seqlens' values are checked when it is on the CPU; on a GPU only with `validate=True`
    (a device sync), as for `encode`.
    """
    if not isinstance(mode, str) or mode not in _POOLERS:
        raise InputError(f"unknown pooling {mode!r}; choose one of {sorted(_POOLERS)}")
    return _POOLERS[mode](x, cu_seqlens, validate=validate)


# The unchecked bodies, for callers whose boundaries are already valid (or, after dropping prompt
# tokens, may hold empty sequences: their mean is 0, as sentence-transformers gives).


def first_rows(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    return x.index_select(0, cu_seqlens[:-1].long())


def last_rows(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    return x.index_select(0, cu_seqlens[1:].long() - 1)


def mean_rows(x: Tensor, cu_seqlens: Tensor, weights: Tensor | None = None) -> Tensor:
    S, T = cu_seqlens.numel() - 1, x.shape[0]
    seq = segment_ids(cu_seqlens, T)
    xf = x.float()
    if weights is None:
        w = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.float32)
    else:
        xf = xf * weights.float().unsqueeze(-1)
        w = torch.zeros(S, device=x.device).index_add(0, seq, weights.float())
    total = torch.zeros(S, *x.shape[1:], device=x.device).index_add(0, seq, xf)
    w = w.clamp_min(torch.finfo(torch.float32).tiny).reshape(S, *([1] * (x.dim() - 1)))
    return (total / w).to(x.dtype)


def max_rows(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    S, T = cu_seqlens.numel() - 1, x.shape[0]
    seq = segment_ids(cu_seqlens, T).view(-1, *([1] * (x.dim() - 1))).expand_as(x)
    out = x.new_full((S, *x.shape[1:]), float("-inf"))
    return out.scatter_reduce(0, seq, x, reduce="amax", include_self=False)


# ---- token-budget batching --------------------------------------------------------------------


def token_budget_batches(
    lengths: Iterable[int], max_tokens: int, max_seqs: int | None = None
) -> list[list[int]]:
    """Group sequence indices, in the given order, into batches of at most `max_tokens` tokens.

    A sequence longer than `max_tokens` gets a batch of its own. Sort by length first to waste
    nothing on imbalance (packed batches have no padding, so the order only matters for caching).
    """
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise InputError(f"max_tokens must be a positive int, got {max_tokens!r}")
    if max_seqs is not None and (not isinstance(max_seqs, int) or isinstance(max_seqs, bool) or max_seqs <= 0):
        raise InputError(f"max_seqs must be a positive int or None, got {max_seqs!r}")
    batches: list[list[int]] = []
    cur: list[int] = []
    used = 0
    for i, n in enumerate(lengths):
        full = max_seqs is not None and len(cur) >= max_seqs
        if cur and (used + n > max_tokens or full):
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
    if cur:
        batches.append(cur)
    return batches

