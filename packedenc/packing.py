"""Packed (padding-free) batches: build them, check them, take them apart, pool over them.

Shapes: T packed tokens, S sequences, D hidden, L longest sequence.
A packed batch is the flash-attention varlen layout: all sequences back to back in `ids [T]`,
sequence `s` occupying `ids[cu_seqlens[s]:cu_seqlens[s + 1]]`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import torch
from torch import Tensor

from packedenc.errors import InputError
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
    if len(sequences) == 0:
        raise InputError("pack() got an empty batch: pass at least one sequence")
    parts = []
    for i, s in enumerate(sequences):
        try:
            t = s if isinstance(s, Tensor) else torch.as_tensor(list(s))
        except (TypeError, ValueError, RuntimeError) as e:
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
    """Split a packed (T, ...) tensor into a list of per-sequence views (syncs once for lengths)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    return list(torch.split(x, lengths, dim=0))


def pad(
    x: Tensor, cu_seqlens: Tensor, max_seqlen: int | None = None, value: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Scatter a packed (T, ...) tensor into (S, L, ...) plus a (S, L) bool mask of real tokens."""
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


# ---- checks (host side; sync when the tensors live on a GPU) ----------------------------------


def check_cu_seqlens(cu_seqlens: Tensor, total: int | None = None, *, values: bool = True) -> None:
    """Raise InputError unless cu_seqlens is a valid (S+1,) integer boundary vector over `total` tokens.

    `values=False` checks dtype and shape only (no device sync).
    """
    if not isinstance(cu_seqlens, Tensor):
        raise InputError(f"cu_seqlens must be a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise InputError(
            f"cu_seqlens must be a 1-D int32 tensor, got shape {tuple(cu_seqlens.shape)} and "
            f"dtype {cu_seqlens.dtype}; build it with packedenc.pack(...)"
        )
    if cu_seqlens.numel() < 2:
        raise InputError("empty batch: cu_seqlens needs at least 2 entries ([0, T] for one sequence)")
    if not values:
        return
    cu = cu_seqlens.detach().cpu()
    if int(cu[0]) != 0:
        raise InputError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    diffs = cu[1:] - cu[:-1]
    if bool((diffs < 0).any()):
        i = int(torch.nonzero(diffs < 0)[0])
        raise InputError(
            f"cu_seqlens must be non-decreasing, but cu_seqlens[{i + 1}]={int(cu[i + 1])} < "
            f"cu_seqlens[{i}]={int(cu[i])}"
        )
    if bool((diffs == 0).any()):
        i = int(torch.nonzero(diffs == 0)[0])
        raise InputError(f"sequence {i} is empty (cu_seqlens[{i}] == cu_seqlens[{i + 1}])")
    if total is not None and int(cu[-1]) != total:
        raise InputError(
            f"cu_seqlens must end at the number of packed tokens ({total}), got {int(cu[-1])}"
        )


def check_ids(ids: Tensor, vocab_size: int | None = None, *, values: bool = True) -> None:
    """Raise InputError unless ids is a 1-D integer tensor with every id in [0, vocab_size)."""
    if not isinstance(ids, Tensor):
        raise InputError(f"ids must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dim() != 1:
        raise InputError(
            f"ids must be 1-D (packed, no padding), got shape {tuple(ids.shape)}; "
            "use packedenc.pack_padded(ids, attention_mask) for a padded batch"
        )
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise InputError(f"ids must be an integer tensor, got {ids.dtype}")
    if ids.numel() == 0:
        raise InputError("empty batch: ids has no tokens")
    if values and vocab_size is not None:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise InputError(
                f"token id {bad} is outside the vocabulary [0, {vocab_size}); was the batch "
                "tokenized for another model?"
            )


# ---- pooling (no Python loop over sequences) --------------------------------------------------


def pool_first(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """(T, D) -> (S, D): each sequence's first token (CLS pooling)."""
    return x.index_select(0, cu_seqlens[:-1].long())


def pool_last(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """(T, D) -> (S, D): each sequence's last token."""
    return x.index_select(0, cu_seqlens[1:].long() - 1)


def pool_mean(x: Tensor, cu_seqlens: Tensor, weights: Tensor | None = None) -> Tensor:
    """(T, D) -> (S, D): mean over each sequence's tokens, in fp32, returned in x's dtype.

    `weights` (T,) turns it into a weighted mean (sentence-transformers' weighted-mean pooling).
    """
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


def pool_max(x: Tensor, cu_seqlens: Tensor) -> Tensor:
    """(T, D) -> (S, D): elementwise max over each sequence's tokens."""
    S, T = cu_seqlens.numel() - 1, x.shape[0]
    seq = segment_ids(cu_seqlens, T).view(-1, *([1] * (x.dim() - 1))).expand_as(x)
    out = x.new_full((S, *x.shape[1:]), float("-inf"))
    return out.scatter_reduce(0, seq, x, reduce="amax", include_self=False)


_POOLERS = {"first": pool_first, "cls": pool_first, "mean": pool_mean, "max": pool_max, "last": pool_last}


def pool(x: Tensor, cu_seqlens: Tensor, mode: str = "mean") -> Tensor:
    """Per-sequence pooling by name: "cls"/"first", "mean", "max" or "last"."""
    try:
        return _POOLERS[mode](x, cu_seqlens)
    except KeyError:
        raise InputError(f"unknown pooling {mode!r}; choose one of {sorted(_POOLERS)}") from None


# ---- token-budget batching --------------------------------------------------------------------


def token_budget_batches(
    lengths: Iterable[int], max_tokens: int, max_seqs: int | None = None
) -> list[list[int]]:
    """Group sequence indices, in the given order, into batches of at most `max_tokens` tokens.

    A sequence longer than `max_tokens` gets a batch of its own. Sort by length first to waste
    nothing on imbalance (packed batches have no padding, so the order only matters for caching).
    """
    if max_tokens <= 0:
        raise InputError(f"max_tokens must be positive, got {max_tokens}")
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

