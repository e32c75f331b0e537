"""Seeded workloads: log-normal sequence lengths, random tokens, batches or token-budget packs.

Every family draws its sequences here, so a workload name means the same data everywhere: the
seed depends on the spec's name (and the run's `--seed`), never on which other workloads exist.

Shapes: T packed tokens, S sequences, L padded length, F features.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from typing import Sequence

import torch
from torch import Tensor

BUDGET_TOKENS = 65536  # token-budget mode: packs of about 64k tokens


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Log-normal lengths (median, sigma), rounded and clipped to [lo, hi]; batches of `batch_size`."""

    name: str
    num_seqs: int
    median: float
    sigma: float
    lo: int
    hi: int
    batch_size: int


MODERNBERT_WORKLOADS = {
    "query": WorkloadSpec("query", 4096, 24, 0.5, 4, 128, 128),
    "doc": WorkloadSpec("doc", 1024, 350, 0.7, 32, 2048, 32),
    "long": WorkloadSpec("long", 64, 4096, 0.4, 1024, 8192, 8),
}
DEBERTA_WORKLOADS = {  # "long": one 8192-token sequence, for latency and memory
    "mnli": WorkloadSpec("mnli", 4096, 36, 0.45, 8, 512, 16),
    "doc1k": WorkloadSpec("doc1k", 1024, 300, 0.7, 32, 1024, 16),
    "long": WorkloadSpec("long", 1, 8192, 0.0, 8192, 8192, 1),
}
BERT_WORKLOADS = {  # BERT reads at most 512 positions: ModernBERT's doc lengths, cut there
    "query": MODERNBERT_WORKLOADS["query"],
    "doc512": WorkloadSpec("doc512", 1024, 350, 0.7, 32, 512, 32),
}


def _seed_for(spec: WorkloadSpec, seed: int) -> int:
    # stable per workload name, so adding a workload never changes another one's data
    return seed * 1_000_003 + zlib.crc32(spec.name.encode())


def sample_lengths(spec: WorkloadSpec, seed: int = 0) -> Tensor:
    """(num_seqs,) int64 lengths: exp(log(median) + sigma * N(0, 1)), rounded, clipped."""
    g = torch.Generator().manual_seed(_seed_for(spec, seed))
    z = torch.randn(spec.num_seqs, generator=g, dtype=torch.float64)
    return torch.exp(math.log(spec.median) + spec.sigma * z).round().clamp(spec.lo, spec.hi).long()


@dataclasses.dataclass
class Batch:
    """One batch on the host: packed tokens + boundaries; `padded()` gives the HF layout."""

    ids: Tensor  # (T,) int64 token ids, or (T, F) float node features (graph family)
    cu_seqlens: Tensor  # (S+1,) int32
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def padded(self, pad_id: int = 0) -> tuple[Tensor, Tensor]:
        """(input_ids (S, L), attention_mask (S, L)) right-padded to this batch's longest sequence."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        mask_SL = torch.arange(self.max_seqlen)[None, :] < lengths[:, None]
        ids_SL = torch.full((self.num_seqs, self.max_seqlen), pad_id, dtype=torch.int64)
        ids_SL[mask_SL] = self.ids
        return ids_SL, mask_SL.long()


@dataclasses.dataclass
class Workload:
    """A seeded workload: sequences back to back in `tokens`, grouped into batches."""

    name: str
    lengths: list[int]
    tokens: Tensor  # (sum(lengths), ...) every sequence back to back, generation order
    batches: list[list[int]]  # sequence indices of each batch
    budget: bool = False  # token-budget packs instead of fixed-size batches

    def __post_init__(self) -> None:
        self._starts = [0]
        for n in self.lengths:
            self._starts.append(self._starts[-1] + n)

    def batch(self, i: int) -> Batch:
        return self.batch_of(self.batches[i])

    def batch_of(self, idx: Sequence[int]) -> Batch:
        """The sequences `idx` (indices into `lengths`) as one batch."""
        parts = [self.tokens[self._starts[j]: self._starts[j + 1]] for j in idx]
        lens = torch.tensor([self.lengths[j] for j in idx], dtype=torch.int32)
        cu = torch.zeros(len(idx) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        return Batch(torch.cat(parts), cu, int(lens.max()))

    def batch_tokens(self, i: int) -> int:
        return sum(self.lengths[j] for j in self.batches[i])

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def make_workload(spec: WorkloadSpec, vocab_size: int, seed: int = 0, *, budget_tokens: int | None = None,
                  batch_size: int | None = None, features: int | None = None) -> Workload:
    """Lengths from `sample_lengths`, ids uniform in [0, vocab_size) (or N(0, 1) features of
    width `features`), batches of the spec's size in generation order.

    `budget_tokens`: packs of about that many tokens instead, named "<name>-<budget/1024>k".
    `batch_size`: the same sequences in batches of that size, named "<name>-b<size>".
    """
    lengths = sample_lengths(spec, seed).tolist()
    g = torch.Generator().manual_seed(_seed_for(spec, seed) + 1)
    n = sum(lengths)
    tokens = (torch.randint(0, vocab_size, (n,), generator=g) if features is None
              else torch.randn(n, features, generator=g))
    if budget_tokens is not None:
        from packedenc.packing import token_budget_batches

        return Workload(f"{spec.name}-{budget_tokens // 1024}k", lengths, tokens,
                        token_budget_batches(lengths, budget_tokens), budget=True)
    b = batch_size or spec.batch_size
    name = spec.name if batch_size is None else f"{spec.name}-b{batch_size}"
    batches = [list(range(i, min(i + b, len(lengths)))) for i in range(0, len(lengths), b)]
    return Workload(name, lengths, tokens, batches)


def workload_named(name: str, specs: dict[str, WorkloadSpec], vocab_size: int, seed: int = 0, *,
                   features: int | None = None, budget_scale: int = 1) -> Workload:
    """'doc' (the spec's batches), 'doc-64k' (token-budget packs), 'doc-b8' (batches of 8).

    `budget_scale` divides the budget (tiny CPU runs pack '-64k' workloads to 64k / scale tokens,
    keeping the name so every family's workload names are the same at every size)."""
    m = re.fullmatch(r"(.+?)(?:-(\d+)k|-b(\d+))?", name)
    if m is None or m.group(1) not in specs:
        raise ValueError(f"unknown workload {name!r}; names are {sorted(specs)} with an optional "
                         "'-<n>k' (token-budget packs) or '-b<n>' (batches of n) suffix")
    spec = specs[m.group(1)]
    if m.group(2):
        w = make_workload(spec, vocab_size, seed, budget_tokens=int(m.group(2)) * 1024 // budget_scale,
                          features=features)
        return dataclasses.replace(w, name=name)
    return make_workload(spec, vocab_size, seed, batch_size=int(m.group(3)) if m.group(3) else None,
                         features=features)
