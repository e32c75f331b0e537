"""Token ids of many texts as two flat host arrays, and the packed batches cut from them.

The tokenizers library hands back one `Encoding` per text; reading them into one flat id array
at once (and doing every later step, the vocabulary check, the length sort, ColBERT's prefix and
[MASK] expansion, the cutting into token-budget batches, as numpy ops over that array) keeps the
per-token work out of Python: `embed` runs it on a background thread, where every Python-level
step holds the GIL the device loop on the caller's thread needs.

Shapes: N texts, T tokens of all texts back to back, B texts of one batch.
"""

from __future__ import annotations

import dataclasses
from itertools import chain
from operator import attrgetter
from typing import Any, Sequence

import numpy as np
import torch

from packedenc.packing import Packed

__all__ = ["TokenIds", "encodings"]


def encodings(backend: Any, texts: list[str]) -> list[Any]:
    """A `tokenizers.Tokenizer`'s encodings of a batch, without the character offsets where the
    library can skip them (`encode_batch_fast`, tokenizers >= 0.21)."""
    return (backend.encode_batch_fast if hasattr(backend, "encode_batch_fast") else backend.encode_batch)(texts)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenIds:
    """Token ids of N texts on the host: text i is `ids_T[cu_N1[i]:cu_N1[i + 1]]`.

    Fields:
        ids_T: (T,) int64 numpy, the texts back to back. cu_N1: (N + 1,) int64 numpy, from 0.
    """

    ids_T: np.ndarray
    cu_N1: np.ndarray

    @staticmethod
    def from_lengths(ids_T: np.ndarray, lengths_N: np.ndarray) -> "TokenIds":
        cu_N1 = np.zeros(len(lengths_N) + 1, dtype=np.int64)
        np.cumsum(lengths_N, out=cu_N1[1:])
        assert cu_N1[-1] == len(ids_T), (cu_N1[-1], len(ids_T))
        return TokenIds(ids_T, cu_N1)

    @staticmethod
    def from_encodings(enc: Sequence[Any]) -> "TokenIds":
        """The tokenizers library's batch output, read straight into the flat array (no list of
        lists kept: each `Encoding.ids` is consumed as it is made)."""
        lengths_N = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
        ids_T = np.fromiter(chain.from_iterable(map(attrgetter("ids"), enc)), dtype=np.int64,
                            count=int(lengths_N.sum()))
        return TokenIds.from_lengths(ids_T, lengths_N)

    @staticmethod
    def from_lists(ids: Sequence[Sequence[int]]) -> "TokenIds":
        lengths_N = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        return TokenIds.from_lengths(np.fromiter(chain.from_iterable(ids), dtype=np.int64,
                                                 count=int(lengths_N.sum())), lengths_N)

    def __len__(self) -> int:
        return len(self.cu_N1) - 1

    @staticmethod
    def interleave(parts: Sequence[tuple[np.ndarray, "TokenIds"]], n: int) -> "TokenIds":
        """N texts from parts (caller indices (B,), their ids): text idx[b] is part text b. Every
        index 0..n-1 appears in exactly one part."""
        lengths_N = np.zeros(n, dtype=np.int64)
        for idx, t in parts:
            lengths_N[idx] = t.lengths_N
        out = TokenIds.from_lengths(np.empty(int(lengths_N.sum()), dtype=np.int64), lengths_N)
        for idx, t in parts:
            out.ids_T[np.repeat(out.cu_N1[idx], t.lengths_N) + t.positions_T()] = t.ids_T
        return out

    def wrapped(self, prefix: Sequence[int], suffix: Sequence[int], keep: int | None = None
                ) -> tuple["TokenIds", np.ndarray]:
        """`prefix + x[:keep] + suffix` for every text (all of x when keep is None): a
        post-processor's special tokens and right truncation. Return: (the ids, (C,) indices of
        the texts that lost ids)."""
        lengths_N = self.lengths_N
        kept_N = lengths_N if keep is None else np.minimum(lengths_N, keep)
        P, S, N = len(prefix), len(suffix), len(self)
        out = TokenIds.from_lengths(np.empty(int(kept_N.sum()) + (P + S) * N, dtype=np.int64), kept_N + P + S)
        start_N = out.cu_N1[:-1]
        if P:
            out.ids_T[(start_N[:, None] + np.arange(P)).ravel()] = np.tile(np.asarray(prefix, dtype=np.int64), N)
        if S:
            out.ids_T[(start_N[:, None] + P + kept_N[:, None] + np.arange(S)).ravel()] = np.tile(
                np.asarray(suffix, dtype=np.int64), N)
        kept_T = self.ids_T if keep is None else self.ids_T[self.positions_T() < np.repeat(kept_N, lengths_N)]
        first_N = np.cumsum(kept_N) - kept_N  # each text's first kept id in kept_T
        out.ids_T[np.repeat(start_N + P - first_N, kept_N) + np.arange(len(kept_T))] = kept_T
        return out, np.flatnonzero(lengths_N > kept_N)

    @property
    def lengths_N(self) -> np.ndarray:
        return np.diff(self.cu_N1)

    def tolist(self) -> list[list[int]]:
        if len(self) == 0:  # np.split of an empty array gives one empty piece, not none
            return []
        return [x.tolist() for x in np.split(self.ids_T, self.cu_N1[1:-1])]

    def positions_T(self) -> np.ndarray:
        """(T,) int64 position of every token inside its own text."""
        return np.arange(len(self.ids_T), dtype=np.int64) - np.repeat(self.cu_N1[:-1], self.lengths_N)

    def max_id(self) -> int:
        return int(self.ids_T.max()) if len(self.ids_T) else -1

    def with_token_after_first(self, token: int) -> "TokenIds":
        """`x[:1] + [token] + x[1:]` for every text (PyLate's [Q]/[D] prefix after [CLS])."""
        assert (self.lengths_N > 0).all()
        return TokenIds.from_lengths(np.insert(self.ids_T, self.cu_N1[:-1] + 1, token), self.lengths_N + 1)

    def padded_to(self, length: int, token: int) -> "TokenIds":
        """`x + [token] * (length - len(x))` for every text (ColBERT's query [MASK] expansion)."""
        lengths_N = self.lengths_N
        assert len(self) == 0 or lengths_N.max() <= length, (lengths_N.max(), length)
        out_NL = np.full((len(self), length), token, dtype=np.int64)
        out_NL[np.repeat(np.arange(len(self)), lengths_N), self.positions_T()] = self.ids_T
        return TokenIds.from_lengths(out_NL.reshape(-1), np.full(len(self), length, dtype=np.int64))

    def longest_first(self) -> tuple[np.ndarray, "TokenIds"]:
        """(order_N, the texts in that order): longest first, ties in the given order."""
        lengths_N = self.lengths_N
        order_N = np.argsort(-lengths_N, kind="stable")
        sorted_N = lengths_N[order_N]
        cu_N1 = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(sorted_N, out=cu_N1[1:])
        # token t of the sorted text k comes from its old start + (t - its new start)
        src_T = np.repeat(self.cu_N1[:-1][order_N] - cu_N1[:-1], sorted_N) + np.arange(cu_N1[-1])
        return order_N, TokenIds(self.ids_T[src_T], cu_N1)

    def budget_runs(self, max_tokens: int) -> list[tuple[int, int]]:
        """`packing.token_budget_batches(lengths, max_tokens)` as (first, end) text ranges: the same
        greedy cut, a binary search per batch instead of a Python step per text."""
        cu_N1, runs, a = self.cu_N1, [], 0
        ends = np.searchsorted(cu_N1, cu_N1 + max_tokens, side="right") - 1  # furthest end from each start
        while a < len(self):
            z = max(int(ends[a]), a + 1)  # a text over the budget gets a batch of its own
            runs.append((a, z))
            a = z
        return runs

    def packed(self, first: int = 0, end: int | None = None, positions_T: np.ndarray | None = None) -> Packed:
        """Texts first..end-1 as a `Packed` batch on the host (ids share this array's memory).
        `positions_T`: `self.positions_T()`, when the caller cuts many batches from one array."""
        end = len(self) if end is None else end
        lo, hi = int(self.cu_N1[first]), int(self.cu_N1[end])
        pos_T = self.positions_T() if positions_T is None else positions_T
        cu_B1 = self.cu_N1[first:end + 1] - lo
        longest = int(np.diff(cu_B1).max()) if end > first else 0
        cu_B1 = torch.from_numpy(cu_B1.astype(np.int32))
        return Packed(ids=torch.from_numpy(self.ids_T[lo:hi]), cu_seqlens=cu_B1,
                      positions=torch.from_numpy(pos_T[lo:hi]), max_seqlen=longest)
