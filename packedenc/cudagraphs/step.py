"""`graphed_step`: a training step replayed as CUDA graphs, one per padded bucket (the pair of `graphed`).

    step = packedenc.train.make_step(loss_fn, AdamW(lr=2e-5), clip_norm=1.0)
    state = packedenc.train.TrainState.create(params, step.optimizer)
    jstep = graphed_step(step, state, max_tokens=16384, max_seqs=128,
                         pad={"labels": Pad("text.seqs", -100)})
    loss = jstep({"text": packed, "labels": labels_S})      # state updated in place; loss on the device

JAX users know this as `jit(step, donate_argnums=0)`: the state is donated (its tensors are
updated in place by every call; `jstep.state` is the same object), and the step is the same
computation as `step.update_(state, batch)` on the padded batch.

A batch is a dict: `Packed` values are token streams, tensor values are fields padded along the
axis `pad` names for them: "<stream>.tokens" (T), "<stream>.seqs" (S) or a free axis of its own
(e.g. "masked" for an MLM's masked positions), with a value the loss ignores (-100 targets, 0
weights). Each stream is padded to a bucket as in `graphed` (dummy sequences outside the real
ones, in `buckets.py`): the loss sees S_b + 1 sequences, so a per-sequence field gets S_b + 1
rows; a per-sequence weight field (ones, padded 0) masks dummies in losses over pooled rows.

Two graphs make a step, the seam of gradient accumulation: per bucket, loss + gradients of one
micro-batch written (the step's first micro-batch) or added (later ones: a second graph of the
bucket) into fp32 accumulators (`Step.grads`); once per step, the update (`Step.apply_`: mean,
all-reduce under a process group, clipping, AdamW). A new bucket runs `warmup` discarded
forward + backward passes on a side stream (lazy initialisation, compilation) and is captured at
its first use; the first update runs eagerly (a real one, its warm-up) and the second is captured.
Replays do not synchronise with the host. Batches over the budget run eagerly, unpadded, into the
same accumulators, with a one-time warning. On a CPU (`capture=False`) the same padded phases run
eagerly: what CI tests.

Shapes: T tokens, S sequences; T_b / S_b / L_b a bucket's tokens, sequences, longest sequence.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any, Sequence

import torch
from torch import Tensor

from packedenc.cudagraphs.buckets import Bucket, budget_buckets, fill_padded, plan_bucket
from packedenc.cudagraphs.encode import _new_pool, _pool_id
from packedenc.errors import ConfigError, InputError
from packedenc.packing import Packed
from packedenc.train.optim import Step, TrainState

__all__ = ["graphed_step", "GraphedStep", "Pad"]


@dataclasses.dataclass(frozen=True)
class Pad:
    """How a batch field is padded: along `axis` ("<stream>.tokens", "<stream>.seqs" or a free
    axis name) with `value`, which the loss must ignore (e.g. -100 targets, 0 weights)."""

    axis: str
    value: float = 0


@dataclasses.dataclass
class _Entry:
    """One bucket: static input buffers, the padded batch the loss sees, its graph."""

    batch: dict[str, Any]
    uses: int = 0
    graphs: dict[bool, Any] = dataclasses.field(default_factory=dict)  # first micro-batch of a step or not


class GraphedStep:
    """A training step replayed from per-bucket CUDA graphs. Build it with `graphed_step(...)`."""

    def __init__(self, step: Step, state: TrainState, *, max_tokens: int, max_seqs: int,
                 pad: dict[str, Pad], device: torch.device, capture: bool, warmup: int,
                 max_graphs: int, pad_id: int, token_buckets: Sequence[int] | None,
                 seq_buckets: Sequence[int] | None) -> None:
        self.step, self.state, self.pad, self.device, self.capture = step, state, dict(pad), device, capture
        self.max_tokens, self.max_seqs, self.warmup, self.max_graphs = max_tokens, max_seqs, warmup, max_graphs
        self.pad_id = pad_id
        self.max_len = _position_limit(state.params)  # dummy sequences stay within the position table
        self.token_buckets, self.seq_buckets = budget_buckets(max_tokens, max_seqs, token_buckets, seq_buckets)
        leaves = [t for t in torch.utils._pytree.tree_leaves(state.params) if isinstance(t, Tensor)]
        # accumulators outside any graph pool: they live across replays of every graph
        self._acc = [torch.zeros_like(t, dtype=torch.float32) for t in leaves]
        z = lambda: torch.zeros((), device=device)  # noqa: E731
        self._loss_acc, self._loss_out, self._norm_out, self._inv_n = z(), z(), z(), z()
        self._entries: collections.OrderedDict[tuple, _Entry] = collections.OrderedDict()
        self._updates = 0
        self._update_graph: Any = None
        self._pool: Any = None
        self._stream = torch.cuda.Stream(device) if capture else None
        self._warned = False

    # -- introspection ------------------------------------------------------------------------

    @property
    def num_graphs(self) -> int:
        return sum(len(e.graphs) for e in self._entries.values()) + (self._update_graph is not None)

    @property
    def grad_norm(self) -> Tensor:
        """The global gradient norm of the last step (before clipping), a device scalar."""
        return self._norm_out

    def bucket_for(self, batch: dict[str, Any]) -> tuple | None:
        """The bucket key of a batch, or None when it is over the budget (it then runs eagerly)."""
        key = []
        free: dict[str, int] = {}
        for name, v in sorted(batch.items()):
            if isinstance(v, Packed):
                if v.num_tokens > self.max_tokens or v.num_seqs > self.max_seqs:
                    return None
                try:
                    key.append((name, plan_bucket(v.num_tokens, v.num_seqs, v.max_seqlen,
                                                  token_buckets=self.token_buckets, seq_buckets=self.seq_buckets,
                                                  positions=True, max_len=self.max_len)))
                except InputError:  # its dummy sequences would not fit the position table: eager
                    return None
            else:
                axis = self.pad[name].axis
                if "." not in axis:
                    free[axis] = max(free.get(axis, 0), v.shape[0])
        for axis, n in sorted(free.items()):
            size = next((b for b in self.token_buckets if b >= n), None)
            if size is None:
                return None
            key.append((axis, size))
        return tuple(key)

    # -- the call -----------------------------------------------------------------------------

    def __call__(self, batches: Any) -> Tensor:
        """One training step on a batch or a list of micro-batches; return the mean loss (device)."""
        micro = list(batches) if isinstance(batches, list) else [batches]
        if not micro:
            raise InputError("a training step needs at least one batch")
        with torch.inference_mode(False):
            for i, b in enumerate(micro):
                self._accumulate(self._checked(b), first=i == 0)
            self._inv_n.fill_(1.0 / len(micro))
            self._run_update()
        return self._loss_out.clone()

    def _checked(self, batch: Any) -> dict[str, Any]:
        if not isinstance(batch, dict) or not any(isinstance(v, Packed) for v in batch.values()):
            raise InputError("a graphed step's batch is a dict with at least one packedenc.Packed stream; "
                             f"got {type(batch).__name__}")
        streams = {k for k, v in batch.items() if isinstance(v, Packed)}
        for k, v in batch.items():
            if isinstance(v, Packed):
                if v.ids.device != self.device:
                    raise InputError(f"stream {k!r} is on {v.ids.device}, the step's state on {self.device}")
                continue
            if not isinstance(v, Tensor):
                raise InputError(f"batch field {k!r} must be a tensor or a Packed, got {type(v).__name__}")
            if k not in self.pad:
                raise InputError(f"batch field {k!r} has no padding rule: pass pad={{{k!r}: Pad(axis, value)}}")
            axis = self.pad[k].axis
            if "." in axis:
                stream, kind = axis.split(".", 1)
                if stream not in streams or kind not in ("tokens", "seqs"):
                    raise InputError(f"field {k!r}: axis {axis!r} must be '<stream>.tokens' or '<stream>.seqs' "
                                     f"of a stream in the batch ({sorted(streams)})")
                want = batch[stream].num_tokens if kind == "tokens" else batch[stream].num_seqs
                if v.dim() == 0 or v.shape[0] != want:
                    raise InputError(f"field {k!r} has {tuple(v.shape)} rows; {axis} needs {want}")
        return batch

    # -- phase 1: a micro-batch ---------------------------------------------------------------

    def _accumulate(self, batch: dict[str, Any], first: bool) -> None:
        key = self.bucket_for(batch)
        if key is None:
            if not self._warned:
                warnings.warn(f"a batch over the graphed step's budget (max_tokens={self.max_tokens}, "
                              f"max_seqs={self.max_seqs}) runs eagerly; later ones will too, without a warning",
                              stacklevel=3)
                self._warned = True
            self._grads_into_acc(batch, first)
            return
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(self._new_buffers(key, batch))
            while len(self._entries) > self.max_graphs:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        self._fill(key, batch, entry.batch)
        entry.uses += 1
        if not self.capture:
            self._grads_into_acc(entry.batch, first)
            return
        graph = entry.graphs.get(first)
        if graph is None:
            self._warm_up(entry.batch)
            graph = entry.graphs[first] = self._capture(lambda: self._grads_into_acc(entry.batch, first))
        graph.replay()

    def _warm_up(self, batch: dict[str, Any]) -> None:
        """Forward + backward passes whose results are dropped, on the capture stream: what a
        capture needs first (cuBLAS workspaces, Triton compilation, tables built on first use)."""
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(self.warmup):
                self.step.grads(self.state.params, batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)

    def _grads_into_acc(self, batch: dict[str, Any], first: bool) -> None:
        """The first micro-batch of a step writes the accumulators (no zeroing pass, no read of
        the old sums), later ones add to them; gradients in a compute dtype are widened here."""
        loss, grads = self.step.grads(self.state.params, batch)
        if first:
            torch._foreach_copy_(self._acc, grads)
            self._loss_acc.copy_(loss)
        else:
            torch._foreach_add_(self._acc, grads)
            self._loss_acc.add_(loss)

    # -- phase 2: the update ------------------------------------------------------------------

    def _run_update(self) -> None:
        self._updates += 1
        if not self.capture or self._updates == 1:  # the first update is eager: the capture's warm-up
            self._update()
            return
        if self._update_graph is None:
            self._update_graph = self._capture(self._update)
        self._update_graph.replay()

    def _update(self) -> None:
        torch.mul(self._loss_acc, self._inv_n, out=self._loss_out)
        self._norm_out.copy_(self.step.apply_(self.state, self._acc, self._inv_n))

    # -- buffers and capture ------------------------------------------------------------------

    def _new_buffers(self, key: tuple, batch: dict[str, Any]) -> dict[str, Any]:
        sizes = dict(key)
        out: dict[str, Any] = {}
        for name, v in batch.items():
            if isinstance(v, Packed):
                b: Bucket = sizes[name]
                out[name] = Packed(ids=torch.zeros(b.tokens, dtype=torch.int64, device=self.device),
                                   cu_seqlens=torch.zeros(b.seqs + 2, dtype=torch.int32, device=self.device),
                                   positions=torch.zeros(b.tokens, dtype=torch.int64, device=self.device),
                                   max_seqlen=b.max_seqlen)
        for name, v in batch.items():
            if not isinstance(v, Packed):
                out[name] = v.new_empty((self._rows(self.pad[name].axis, sizes), *v.shape[1:]))
        return out

    @staticmethod
    def _rows(axis: str, sizes: dict[str, Any]) -> int:
        if "." not in axis:
            return sizes[axis]
        stream, kind = axis.split(".", 1)
        b: Bucket = sizes[stream]
        return b.tokens if kind == "tokens" else b.seqs + 1  # S_b + 1 sequences with the dummies

    def _fill(self, key: tuple, batch: dict[str, Any], bufs: dict[str, Any]) -> None:
        sizes = dict(key)
        with torch.no_grad():
            for name, v in batch.items():
                buf = bufs[name]
                if isinstance(v, Packed):
                    fill_padded(sizes[name], v.ids, v.cu_seqlens, v.positions, buf.ids, buf.cu_seqlens,
                                buf.positions, self.pad_id)
                else:
                    n = v.shape[0]
                    buf[:n].copy_(v)
                    buf[n:].fill_(self.pad[name].value)

    def _capture(self, fn: Any) -> Any:
        if self._pool is None:
            self._pool = _new_pool()
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=_pool_id(self._pool), stream=stream):
                fn()
        except RuntimeError as e:
            raise RuntimeError(f"capturing the training step failed: {e}. Some op in the loss or the model "
                               "synchronises with the host or is not capturable; use step.update_ eagerly "
                               "and report it") from e
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return graph


def _position_limit(params: Any) -> int | None:
    from packedenc.models import max_seqlen_limit

    try:
        return max_seqlen_limit(params)
    except ConfigError:  # not a packedenc params tree (a user's own module tree): no known limit
        return None


def graphed_step(step: Step, state: TrainState, *, max_tokens: int, max_seqs: int,
                 pad: dict[str, Pad] | None = None, capture: bool | None = None, warmup: int = 1,
                 max_graphs: int = 256, pad_id: int = 0, token_buckets: Sequence[int] | None = None,
                 seq_buckets: Sequence[int] | None = None) -> GraphedStep:
    """A training step replayed as CUDA graphs, bucketed by tokens and sequences (see the module doc).

    Arguments:
        step: from `packedenc.train.make_step(loss_fn, AdamW(...), clip_norm=...)`.
        state: `TrainState.create(params, step.optimizer)`, donated: updated in place by each call.
        max_tokens, max_seqs: the budget of each stream; bigger batches run eagerly (one warning).
        pad: the padding rule of every tensor field of the batches (`Pad(axis, value)`).
        capture: replay CUDA graphs; default True on a CUDA state, False (eager, padded) on a CPU.
        warmup: discarded forward + backward passes before a bucket's capture (>= 1).
        max_graphs: LRU size of the per-bucket graphs. They share one memory pool (replays never
            overlap), so a graph costs little memory but a capture costs a warm-up pass: a training
            run meets many buckets (tokens x sequences x longest length), keep them. pad_id: token
            id of dummy tokens.
        token_buckets, seq_buckets: as in `graphed`.
    Return:
        a `GraphedStep`: `loss = jstep(batch)` or `jstep([micro_batch, ...])`; `jstep.state`,
        `jstep.grad_norm`.
    """
    if not isinstance(step, Step):
        raise ConfigError(f"step must come from packedenc.train.make_step, got {type(step).__name__}")
    if not isinstance(state, TrainState):
        raise ConfigError(f"state must be a packedenc.train.TrainState, got {type(state).__name__}")
    for name, v in (("max_tokens", max_tokens), ("max_seqs", max_seqs), ("max_graphs", max_graphs)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be a positive int, got {v!r}")
    if not isinstance(warmup, int) or warmup < 1:
        raise ConfigError(f"warmup must be an int >= 1 (a capture needs an eager run first), got {warmup!r}")
    pad = dict(pad or {})
    for k, v in pad.items():
        if not isinstance(v, Pad):
            raise ConfigError(f"pad[{k!r}] must be a packedenc.cudagraphs.Pad, got {type(v).__name__}")
    device = state.opt.step.device
    capture = device.type == "cuda" if capture is None else bool(capture)
    if capture and device.type != "cuda":
        raise ConfigError(f"CUDA graphs need a CUDA state, got {device}; use capture=False to run eagerly")
    return GraphedStep(step, state, max_tokens=max_tokens, max_seqs=max_seqs, pad=pad, device=device,
                       capture=capture, warmup=warmup, max_graphs=max_graphs, pad_id=pad_id,
                       token_buckets=token_buckets, seq_buckets=seq_buckets)
