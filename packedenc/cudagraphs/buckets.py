"""Buckets of the CUDA-graphed encode: which static shape a batch is padded to, and the padding.

A batch of T tokens in S sequences is mapped to a bucket (T_b, S_b, L_b): S_b >= S from the
sequence buckets, T_b >= T + (S_b + 1 - S) from the token buckets, L_b a power of two >= every
length. `fill_padded` writes the real sequences first, then the token tail [T, T_b) as
S_b + 1 - S dummy sequences of at least one token each, *outside* the real cu_seqlens, with
device ops only (no host sync). Used by `packedenc.cudagraphs`; pure host arithmetic + copies.

Shapes: T real tokens, S real sequences, T_b / S_b / L_b the bucket's tokens, sequences and
longest sequence.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
from torch import Tensor

from packedenc.errors import ConfigError, InputError

__all__ = ["Bucket", "budget_buckets", "plan_bucket", "pad_batch", "fill_padded", "default_token_buckets", "default_seq_buckets",
           "checked_buckets"]


@dataclasses.dataclass(frozen=True, order=True)
class Bucket:
    """The static shape of one captured graph.

    Fields:
        tokens: T_b, rows of the padded token buffer.
        seqs: S_b, real-sequence slots; cu_seqlens has S_b + 2 entries (one more dummy slot, so
            the token tail always has a sequence to live in).
        max_seqlen: L_b, the host int the graph passes as `max_seqlen` (>= every real and dummy length).
        positions: whether the caller's `positions` are copied in (else the encode derives them).
    """

    tokens: int
    seqs: int
    max_seqlen: int
    positions: bool = False


def default_token_buckets(cap: int, granularity: int = 64, steps_per_octave: int = 16) -> tuple[int, ...]:
    """Multiples of `granularity`, about `steps_per_octave` per doubling (waste <= ~1/16), up to >= cap.

    16 per doubling: the doc1k DeBERTa batches (4-8k tokens in 16 sequences) pad 2.4% of their
    tokens and add 1.0% dummy attention pairs (the tail is one dummy sequence), against 4.2% and
    3.0% at 8 per doubling, for 15 graphs instead of 10."""
    out, b = [], granularity
    while True:
        out.append(b)
        if b >= cap:
            return tuple(out)
        octave = 1 << (b.bit_length() - 1)  # largest power of two <= b
        b += max(granularity, (octave // steps_per_octave) // granularity * granularity)


def default_seq_buckets(max_seqs: int) -> tuple[int, ...]:
    """Powers of two below `max_seqs`, then `max_seqs` itself."""
    out = [1 << i for i in range(max(1, max_seqs).bit_length()) if (1 << i) < max_seqs]
    return tuple(out + [max_seqs])


def _smallest_at_least(buckets: Sequence[int], n: int) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


def plan_bucket(num_tokens: int, num_seqs: int, max_seqlen: int, *, token_buckets: Sequence[int],
                seq_buckets: Sequence[int], positions: bool = False, max_len: int | None = None) -> Bucket:
    """The bucket a batch of `num_tokens` tokens in `num_seqs` sequences is padded to.

    `max_len`: the model's longest sequence (its position table), or None. Dummy sequences then
    stay within it: the smallest sequence bucket whose dummy slots split the token tail into
    sequences of at most `max_len` tokens, and `L_b` never above it.
    Raises InputError when no bucket is large enough (the caller checks the budget first, so this
    means the bucket lists are too short, or too few dummy slots for the tail under `max_len`).
    """
    if _smallest_at_least(seq_buckets, num_seqs) is None:
        raise InputError(f"{num_seqs} sequences exceed the largest sequence bucket {max(seq_buckets)}")
    for S_b in (b for b in seq_buckets if b >= num_seqs):
        n_dummy = S_b + 1 - num_seqs  # >= 1: the tail slot is always there
        T_b = _smallest_at_least(token_buckets, num_tokens + n_dummy)  # every dummy gets >= 1 token
        if T_b is None:
            raise InputError(f"{num_tokens} tokens + {n_dummy} dummy sequences exceed the largest token "
                             f"bucket {max(token_buckets)}")
        longest_dummy = -(-(T_b - num_tokens) // n_dummy)
        if max_len is None or longest_dummy <= max_len:
            need = max(max_seqlen, longest_dummy, 1)
            L_b = min(1 << (need - 1).bit_length(), T_b)  # next power of two, never above the buffer
            if max_len is not None and need <= max_len:
                L_b = min(L_b, max_len)
            return Bucket(T_b, S_b, L_b, positions)
    raise InputError(f"the token tail of {num_tokens} tokens in {num_seqs} sequences does not fit the dummy "
                     f"slots of any sequence bucket within {max_len} tokens a sequence")


def _tail_split(num_tokens: int, num_seqs: int, bucket: Bucket) -> tuple[int, int, int]:
    """(n_dummy, q, r): the tail's n_dummy sequences, the first r of length q + 1, the rest q."""
    n_dummy = bucket.seqs + 1 - num_seqs
    q, r = divmod(bucket.tokens - num_tokens, n_dummy)
    assert q >= 1, "plan_bucket guarantees at least one token per dummy sequence"
    return n_dummy, q, r


def fill_padded(bucket: Bucket, ids: Tensor, cu_seqlens: Tensor, positions: Tensor | None,
                ids_buf: Tensor, cu_buf: Tensor, pos_buf: Tensor | None, pad_id: int = 0) -> None:
    """Write a batch into a bucket's static buffers, with the token tail as dummy sequences.

    Arguments:
        bucket: from `plan_bucket` for this batch's (T, S, max_seqlen).
        ids: (T,) int ids. cu_seqlens: (S+1,) int boundaries. positions: (T,) or None.
        ids_buf: (T_b,) int64. cu_buf: (S_b + 2,) int32. pos_buf: (T_b,) int64 when
            `bucket.positions`, else None. Written in place with device ops only (no host sync).
        pad_id: token id of the dummy tokens (any id inside the vocabulary).
    """
    T, S = ids.numel(), cu_seqlens.numel() - 1
    n_dummy, q, r = _tail_split(T, S, bucket)
    ids_buf[:T].copy_(ids)
    ids_buf[T:].fill_(pad_id)
    cu_buf[: S + 1].copy_(cu_seqlens)
    # boundary j (1..n_dummy) of the tail: T + j*q + min(j, r), from host ints only
    j = torch.arange(1, n_dummy + 1, device=cu_buf.device, dtype=torch.int32)
    cu_buf[S + 1:].copy_(j * q + j.clamp(max=r) + T)
    if pos_buf is None:
        return
    assert positions is not None
    pos_buf[:T].copy_(positions)
    # position of tail token t: t mod (q + 1) inside the first r dummies, then (t - r(q+1)) mod q
    t = torch.arange(bucket.tokens - T, device=pos_buf.device, dtype=torch.int64)
    head = r * (q + 1)
    pos_buf[T:].copy_(torch.where(t < head, t % (q + 1), (t - head) % q))


def pad_batch(ids: Tensor, cu_seqlens: Tensor, bucket: Bucket, positions: Tensor | None = None,
              pad_id: int = 0) -> tuple[Tensor, Tensor, Tensor | None]:
    """Allocating `fill_padded`: (ids (T_b,), cu_seqlens (S_b + 2,), positions (T_b,) or None)."""
    dev = ids.device
    ids_buf = torch.empty(bucket.tokens, dtype=torch.int64, device=dev)
    cu_buf = torch.empty(bucket.seqs + 2, dtype=torch.int32, device=dev)
    pos_buf = torch.empty(bucket.tokens, dtype=torch.int64, device=dev) if bucket.positions else None
    fill_padded(bucket, ids, cu_seqlens, positions, ids_buf, cu_buf, pos_buf, pad_id)
    return ids_buf, cu_buf, pos_buf


def budget_buckets(max_tokens: int, max_seqs: int, token_buckets: Sequence[int] | None = None,
                   seq_buckets: Sequence[int] | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(token buckets, sequence buckets) that cover a budget: the given lists (checked) or the
    defaults, each extended to the budget. Tokens go up to max_tokens + the largest sequence
    bucket: the tail needs up to S_b + 1 - S dummy tokens on top of the real ones."""
    seqs = checked_buckets("seq_buckets", seq_buckets or default_seq_buckets(max_seqs))
    if seqs[-1] < max_seqs:
        seqs += (max_seqs,)
    cap = max_tokens + seqs[-1]
    tokens = checked_buckets("token_buckets", token_buckets or default_token_buckets(cap))
    if tokens[-1] < cap:
        tokens += (cap,)
    return tokens, seqs


def checked_buckets(name: str, buckets: Sequence[int]) -> tuple[int, ...]:
    out = tuple(buckets)
    if not out or any(not isinstance(b, int) or b < 1 for b in out) or list(out) != sorted(set(out)):
        raise ConfigError(f"{name} must be strictly increasing positive ints, got {list(out)}")
    return out
