"""Opt-in CUDA-graph replay of a packed encode, for bounded token budgets (short-query traffic).

    g = graphed(params, max_tokens=8192, max_seqs=256)          # nothing is captured yet
    hidden_TD = g(batch.ids, batch.cu_seqlens, batch.max_seqlen)  # = pe.encode(...), within bf16 noise

Each batch is padded to a bucket (`packedenc/buckets.py`: token / sequence / max-length
buckets, the token tail as dummy sequences outside the real cu_seqlens, so every op sees a valid
varlen batch and no real token attends to a dummy). One graph per bucket is captured on first use
(after an eager warm-up), kept in an LRU, and replayed; `out[:T].clone()` is returned.

The replay path does not synchronise with the host: the bucket is a function of the tensors'
shapes and the host int `max_seqlen` (pass it: leaving it None costs one sync), and the padding is
written by a handful of small device kernels. Inputs already on the graph's device avoid the
synchronous copy that a pageable CPU tensor would need.

Params are captured by reference: the graphs read the very tensors the params tree held at capture
time. Updating them in place (`p.copy_(...)`) is seen by later replays; a *new* params tree (a
reload, `tree_cast`, `tree_to`) needs a new graphed object. Replays are inference only (no
autograd) and must not run concurrently on two streams: all graphs of one object share one memory
pool (sized by one eager batch of the whole budget, run at the first capture) and one output
buffer, so intermediates of one bucket reuse memory of another.

Shapes: T real tokens, S real sequences, T_b / S_b / L_b the bucket's tokens, sequences and
longest sequence, D hidden.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from packedenc.checks import (
    as_device, check_cu_seqlens, check_ids, check_max_seqlen, check_positions, host_values,
)
from packedenc.cudagraphs.buckets import (
    Bucket, budget_buckets, default_seq_buckets, default_token_buckets, fill_padded, pad_batch, plan_bucket,
)
from packedenc.errors import ConfigError, InputError
from packedenc.kernels import get_ops

__all__ = ["graphed", "GraphedEncode", "Bucket", "plan_bucket", "pad_batch", "fill_padded",
           "default_token_buckets", "default_seq_buckets"]

EncodeFn = Callable[[Tensor, Tensor, int, "Tensor | None"], Tensor]


# ---- the graphed encode -----------------------------------------------------------------------


@dataclasses.dataclass
class _Entry:
    ids: Tensor
    cu: Tensor
    pos: Tensor | None
    graph: Any = None  # torch.cuda.CUDAGraph, None when capture=False (or not captured yet)
    out: Tensor | None = None  # the graph's static output
    uses: int = 0


class GraphedEncode:
    """A packed encode replayed from per-bucket CUDA graphs. Build it with `graphed(...)`."""

    def __init__(self, fn: EncodeFn, *, device: torch.device, max_tokens: int, max_seqs: int,
                 token_buckets: Sequence[int] | None = None, seq_buckets: Sequence[int] | None = None,
                 max_graphs: int = 32, warmup: int = 2, pad_id: int = 0, capture: bool = True, lazy: bool = False,
                 max_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        for name, v in (("max_tokens", max_tokens), ("max_seqs", max_seqs), ("max_graphs", max_graphs)):
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        if capture and device.type != "cuda":
            raise ConfigError(
                f"CUDA graphs need a CUDA device, got {device}; use capture=False to run the same "
                "bucketed padding eagerly (for tests), or plain packedenc.encode"
            )
        self.fn, self.device, self.capture = fn, device, capture
        self.max_tokens, self.max_seqs, self.max_graphs = max_tokens, max_seqs, max_graphs
        self.warmup, self.pad_id, self.vocab_size, self.lazy = warmup, pad_id, vocab_size, lazy
        self.max_len = max_len  # the model's longest sequence: dummy sequences stay within it
        self.token_buckets, self.seq_buckets = budget_buckets(max_tokens, max_seqs, token_buckets, seq_buckets)
        self._entries: collections.OrderedDict[Bucket, _Entry] = collections.OrderedDict()
        self._pool: Any = None  # the memory every graph (and its warm-up) allocates from
        self._out: Tensor | None = None  # (max tokens, ...) one output buffer all graphs write
        self._stream = torch.cuda.Stream(device) if capture else None

    # -- introspection ------------------------------------------------------------------------

    @property
    def buckets(self) -> tuple[Bucket, ...]:
        """Buckets held now (captured graphs when capture=True), least recently used first."""
        return tuple(self._entries)

    @property
    def num_graphs(self) -> int:
        return len(self._entries)

    def fits(self, num_tokens: int, num_seqs: int, max_seqlen: int | None = None) -> bool:
        """Whether a batch of this size is within the budget (else `__call__` raises). With
        `max_seqlen`, also whether its padding fits the model's position limit (`max_len`)."""
        if num_tokens > self.max_tokens or num_seqs > self.max_seqs:
            return False
        if max_seqlen is None or self.max_len is None:
            return True
        try:
            self.bucket_for(num_tokens, num_seqs, max_seqlen)
        except InputError:
            return False
        return True

    def bucket_for(self, num_tokens: int, num_seqs: int, max_seqlen: int, positions: bool = False) -> Bucket:
        return plan_bucket(num_tokens, num_seqs, max_seqlen, token_buckets=self.token_buckets,
                           seq_buckets=self.seq_buckets, positions=positions, max_len=self.max_len)

    def clear(self) -> None:
        """Drop every captured graph and its buffers (later captures go to a fresh memory pool)."""
        self._entries.clear()
        self._out = None  # before the pool it lives in
        self._pool = None

    # -- the call -----------------------------------------------------------------------------

    def __call__(self, ids: Tensor, cu_seqlens: Tensor, max_seqlen: int | None = None,
                 positions: Tensor | None = None, *, validate: bool = False) -> Tensor:
        """Encode one packed batch through the graph of its bucket.

        Arguments:
            ids: (T,) int token ids; cu_seqlens: (S+1,) int boundaries (as for `packedenc.encode`).
            max_seqlen: host int, the longest sequence; None costs one host sync.
            positions: (T,) positions, or None to let the encode derive them from cu_seqlens.
            validate: check values of ids / cu_seqlens (syncs once), as `encode(validate=True)`.
        Return:
            (T, ...) the encode's output for the real tokens (a fresh tensor, not a view of a buffer).
        """
        max_seqlen = self._check_call(ids, cu_seqlens, max_seqlen, positions, validate)
        T, S = ids.numel(), cu_seqlens.numel() - 1
        bucket = self.bucket_for(T, S, max_seqlen, positions is not None)
        # Buffers are ordinary tensors even when the caller is in inference mode, so a later
        # call outside it can still write them; grad is off because replays are inference only.
        with torch.inference_mode(False), torch.no_grad():
            entry = self._entries.get(bucket)
            if entry is None:
                entry = self._entries[bucket] = self._new_entry(bucket)
                while len(self._entries) > self.max_graphs:
                    self._entries.popitem(last=False)
            self._entries.move_to_end(bucket)
            fill_padded(bucket, ids, cu_seqlens, positions, entry.ids, entry.cu, entry.pos, self.pad_id)
            entry.uses += 1
            if not self.capture or (self.lazy and entry.uses == 1):  # lazy: a bucket met once runs eagerly
                return self._run(bucket, entry)[:T].clone()
            if entry.graph is None:
                self._capture(bucket, entry)
            entry.graph.replay()
            return entry.out[:T].clone()

    # -- internals ----------------------------------------------------------------------------

    def _check_call(self, ids: Tensor, cu_seqlens: Tensor, max_seqlen: int | None, positions: Tensor | None,
                    validate: bool) -> int:
        """The call's checks, once, at entry: metadata always; values of host tensors always, of
        device tensors with validate=True (one sync). Return: max_seqlen (None costs one sync)."""
        check_ids(ids, values=False)
        check_cu_seqlens(cu_seqlens, values=False)
        if cu_seqlens.device != ids.device:
            raise InputError(f"cu_seqlens is on {cu_seqlens.device} but ids on {ids.device}; move both")
        T, S = ids.numel(), cu_seqlens.numel() - 1
        if not self.fits(T, S):
            raise InputError(
                f"batch of {T} tokens in {S} sequences exceeds this graphed encode's budget "
                f"(max_tokens={self.max_tokens}, max_seqs={self.max_seqs}); split it with "
                "packedenc.token_budget_batches(lengths, max_tokens, max_seqs), build a graphed "
                "encode with a larger budget, or call packedenc.encode for big batches"
            )
        values = host_values(ids, validate)
        if positions is not None:
            check_positions(positions, ids, values=values)
        if values:
            check_cu_seqlens(cu_seqlens, T)
            check_ids(ids, self.vocab_size)
        check_max_seqlen(max_seqlen, cu_seqlens if values else None)
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # the one sync
        return max_seqlen

    def _new_entry(self, bucket: Bucket) -> _Entry:
        dev = self.device
        pos = torch.zeros(bucket.tokens, dtype=torch.int64, device=dev) if bucket.positions else None
        return _Entry(
            ids=torch.zeros(bucket.tokens, dtype=torch.int64, device=dev),
            cu=torch.zeros(bucket.seqs + 2, dtype=torch.int32, device=dev),
            pos=pos,
        )

    def _run(self, bucket: Bucket, entry: _Entry) -> Tensor:
        out = self.fn(entry.ids, entry.cu, bucket.max_seqlen, entry.pos)
        if not isinstance(out, Tensor) or out.dim() < 1 or out.shape[0] != bucket.tokens:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise TypeError(
                f"the graphed function must return one tensor with a row per packed token "
                f"({bucket.tokens} rows here), got {got}"
            )
        return out

    def _capture(self, bucket: Bucket, entry: _Entry) -> None:
        # Memory: the eager warm-ups, the captures and the shared output buffer all allocate from
        # one private pool on one stream. The first capture of a pool first runs one eager batch
        # of the full budget in it, so the pool's segments are budget-sized from the start and
        # every later bucket splits them: the graphs together hold about one budget-sized batch
        # of activations. (Without that, buckets arriving in growing sizes would each add new,
        # larger segments that graphs captured earlier keep pinned.)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if self._pool is None:
                self._pool = _new_pool()
                with _allocating_from(self._pool, self.device):
                    self._run_budget_batch()
            # Eager warm-up (as torch's docs do): lazy initialisation, cuBLAS workspaces, Triton
            # compilation and table building for these shapes must not happen inside the capture.
            with _allocating_from(self._pool, self.device):
                for _ in range(max(1, self.warmup)):
                    out = self._run(bucket, entry)
                if self._out is None or self._out.shape[1:] != out.shape[1:] or self._out.dtype != out.dtype:
                    self._out = out.new_empty((self.token_buckets[-1], *out.shape[1:]))
                del out
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=_pool_id(self._pool), stream=stream):
                self._out[: bucket.tokens].copy_(self._run(bucket, entry))
        except RuntimeError as e:
            raise RuntimeError(
                f"capturing the encode for {bucket} failed: {e}. Some op in the forward synchronises "
                "with the host or is not capturable; use packedenc.encode without graphs and report it"
            ) from e
        torch.cuda.current_stream(self.device).wait_stream(stream)
        entry.graph, entry.out = graph, self._out[: bucket.tokens]

    def budget_bucket(self) -> Bucket:
        """The bucket of the pool-sizing batch: the largest token bucket as dummy sequences of at
        most 128 tokens (any model's position limit allows them; activation memory depends on
        the token count, not on how the tokens are split)."""
        T_b = self.token_buckets[-1]
        n = max(self.seq_buckets[-1] + 1, -(-T_b // 128))  # dummy sequences
        longest = -(-T_b // n)
        return Bucket(T_b, n - 1, min(1 << (longest - 1).bit_length(), T_b))

    def _run_budget_batch(self) -> None:
        """One eager encode of `budget_bucket()`, all dummy tokens."""
        bucket = self.budget_bucket()
        entry = self._new_entry(bucket)
        empty = torch.zeros(0, dtype=torch.int64, device=self.device)
        fill_padded(bucket, empty, torch.zeros(1, dtype=torch.int32, device=self.device), None, entry.ids, entry.cu,
                    None, self.pad_id)
        self._run(bucket, entry)


def _new_pool() -> Any:
    """A torch.cuda.MemPool (eager allocations can be routed to it), else a plain graph pool handle."""
    if hasattr(torch.cuda, "MemPool") and hasattr(torch.cuda, "use_mem_pool"):
        return torch.cuda.MemPool()
    return torch.cuda.graph_pool_handle()


def _pool_id(pool: Any) -> Any:
    return pool.id if hasattr(pool, "id") else pool


def _allocating_from(pool: Any, device: torch.device) -> Any:
    if hasattr(pool, "id"):
        return torch.cuda.use_mem_pool(pool, device)
    return contextlib.nullcontext()  # old torch: the warm-up uses the ordinary cache


def graphed(target: Any, *, max_tokens: int, max_seqs: int, backend: str = "auto",
            device: torch.device | str | None = None, token_buckets: Sequence[int] | None = None,
            seq_buckets: Sequence[int] | None = None, max_graphs: int = 32, warmup: int = 2,
            pad_id: int = 0, capture: bool = True, lazy: bool = False) -> GraphedEncode:
    """An opt-in CUDA-graphed encode for batches of at most `max_tokens` tokens in `max_seqs` sequences.

    Arguments:
        target: a params tree (any family: the graphs replay `packedenc.encode(params, ids,
            cu_seqlens, max_seqlen, positions, backend=backend)`), or a callable
            `fn(ids, cu_seqlens, max_seqlen, positions) -> (T, ...)`, e.g.
            `functools.partial(my_family.encode, params)`. Params are captured by reference:
            a new params tree needs a new graphed object.
        max_tokens, max_seqs: the budget; a bigger batch raises InputError. The graphs hold
            about one eager batch of max_tokens tokens of activations (the first capture runs
            one to size their memory pool), so pick a budget near your largest batch.
        backend: op backend for a params target (ignored for callables: bind it yourself).
        device: where the graphs live; default the params' device (or the current CUDA device).
        token_buckets, seq_buckets: increasing ints; default ~16 token buckets per doubling from
            64 and powers of two for sequences. More buckets waste less padding, capture more graphs.
        max_graphs: LRU size; warmup: eager runs before each capture.
        pad_id: token id of the padding tokens (must be inside the vocabulary).
        capture: False runs the same bucketed, padded buffers eagerly (CPU tests, debugging).
        lazy: capture a bucket at its second use; its first runs eagerly. For streams of batches
            whose buckets may not repeat (`embed`'s token-budget batches): a bucket met once then
            costs no warm-up and no capture.
    Return:
        a `GraphedEncode`; call it like `encode(ids, cu_seqlens, max_seqlen, positions)`.
    """
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ConfigError(f"warmup must be an int >= 0, got {warmup!r}")
    if not isinstance(pad_id, int) or isinstance(pad_id, bool):
        raise ConfigError(f"pad_id must be an int token id, got {pad_id!r}")
    device = as_device(device)
    vocab_size = max_len = None
    if callable(target):
        if backend != "auto":
            raise ConfigError("backend= applies to a params target; bind it inside your function instead")
        fn = target
    else:
        from packedenc.models import family_of, max_seqlen_limit

        family = family_of(target)  # a ConfigError naming the type when it is not a params tree
        max_len = max_seqlen_limit(target)
        params = target
        fn = lambda ids, cu, L, pos: family.encode(params, ids, cu, L, pos, backend=backend)  # noqa: E731
        vocab_size = getattr(getattr(target, "config", None), "vocab_size", None)
        if device is None:
            leaf = next((t for t in torch.utils._pytree.tree_leaves(target) if isinstance(t, Tensor)), None)
            device = None if leaf is None else leaf.device
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if capture else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if vocab_size is not None and not 0 <= pad_id < vocab_size:
        raise ConfigError(f"pad_id {pad_id} is outside the vocabulary [0, {vocab_size})")
    if not callable(target):
        get_ops(backend, device)  # an unknown backend, or one that cannot run on this device, fails now
    return GraphedEncode(fn, device=device, max_tokens=max_tokens, max_seqs=max_seqs,
                         token_buckets=token_buckets, seq_buckets=seq_buckets, max_graphs=max_graphs,
                         warmup=warmup, pad_id=pad_id, capture=capture, vocab_size=vocab_size, lazy=bool(lazy),
                         max_len=max_len)
