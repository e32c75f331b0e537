"""A training step as a pure function of (state, batch): loss and gradients, clipping, AdamW.

    opt = AdamW(lr=2e-5, weight_decay=0.01)
    state = TrainState.create(params, opt)                 # fp32 master params + AdamW moments
    step = make_step(loss_fn, opt, clip_norm=1.0,          # loss_fn(params, batch) -> scalar
                     compute_dtype=torch.bfloat16)         # the loss sees bf16 casts of the params
    loss, state = step(state, batch)                       # pure: the old state is left alone
    loss = step.update_(state, [batch_a, batch_b])         # in place (state donated), 2 micro-batches

`packedenc.cudagraphs.graphed_step(step, state, ...)` replays the same phases as CUDA graphs.

The step runs in two phases, the seam where gradient accumulation and CUDA graphs cut it:
1. `grads`: loss and gradients of one micro-batch (`torch.autograd.grad` over the params leaves,
   or over their casts to `compute_dtype`, run on the calling thread: `backward_grads`), summed
   into fp32 accumulators;
2. `apply_`: mean over the micro-batches, data-parallel all-reduce when a process group is up,
   global-norm clipping, AdamW. Every scalar (learning rate, step count, bias corrections, clip
   coefficient) is a device tensor: no host sync, and a graph captured once serves every step.

AdamW is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments, eps outside the
square root), through torch's fused multi-tensor kernel (`torch._fused_adamw_`, the one behind
`torch.optim.AdamW(fused=True)`, on CPU and CUDA), with the learning rate and the step count as
device tensors. The micro-batch mean and the clipping coefficient reach it as one device divisor
(`grad_scale`), so the gradients are read once: the update moves ~28 bytes a parameter, where the
chain of `_foreach_*` ops it replaced moved ~100 (benchmarks/NOTES.md, "Kept").

Shapes: P the number of params leaves, N their total elements.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from packedenc.errors import ConfigError
from packedenc.pytree import pytree_dataclass

__all__ = ["AdamW", "AdamWState", "TrainState", "Step", "make_step", "clip_by_global_norm"]

LossFn = Callable[[Any, Any], Tensor]


@pytree_dataclass
class AdamWState:
    step: Tensor  # () fp32, steps taken
    lr: Tensor  # () fp32, the learning rate of the next step (set it with `TrainState.set_lr`)
    exp_avg: tuple[Tensor, ...]  # one per params leaf, fp32
    exp_avg_sq: tuple[Tensor, ...]


@dataclasses.dataclass(frozen=True)
class AdamW:
    """torch.optim.AdamW's update as a pure description; the state lives in `AdamWState`."""

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if not (self.lr >= 0 and self.eps > 0 and self.weight_decay >= 0 and 0 <= b1 < 1 and 0 <= b2 < 1):
            raise ConfigError(f"AdamW needs lr >= 0, eps > 0, weight_decay >= 0, betas in [0, 1): got {self}")

    def init(self, leaves: Sequence[Tensor]) -> AdamWState:
        dev = leaves[0].device
        return AdamWState(
            step=torch.zeros((), device=dev), lr=torch.full((), float(self.lr), device=dev),
            exp_avg=tuple(torch.zeros_like(t, dtype=torch.float32) for t in leaves),
            exp_avg_sq=tuple(torch.zeros_like(t, dtype=torch.float32) for t in leaves),
        )

    def update_(self, leaves: list[Tensor], grads: list[Tensor], s: AdamWState,
                grad_divisor: Tensor | None = None) -> None:
        """One AdamW step, in place on `leaves` and `s` (and on `grads`, which end up divided by
        `grad_divisor`, a device scalar, when one is given). Device scalars only: capturable."""
        b1, b2 = self.betas
        s.step.add_(1)
        # one fused kernel over every leaf; it reads the step count of each leaf from a tensor
        # (all of them share the state's one count) and the learning rate from `s.lr`
        torch._fused_adamw_(leaves, grads, list(s.exp_avg), list(s.exp_avg_sq), [], [s.step] * len(leaves),
                            lr=s.lr, beta1=b1, beta2=b2, weight_decay=self.weight_decay, eps=self.eps,
                            amsgrad=False, maximize=False, grad_scale=grad_divisor)


@pytree_dataclass
class TrainState:
    """What a training step reads and writes: the params tree (fp32 master weights) and the
    optimizer state. A pytree: `tree_map`, `torch.save` of its leaves and `tree_to` apply."""

    params: Any
    opt: AdamWState

    @staticmethod
    def create(params: Any, optimizer: AdamW) -> "TrainState":
        leaves = _float_leaves(params)
        return TrainState(params=params, opt=optimizer.init(leaves))

    def set_lr(self, lr: float) -> None:
        """Set the learning rate of the next steps (a device fill: no sync, graphs keep working)."""
        self.opt.lr.fill_(float(lr))

    def clone(self) -> "TrainState":
        return pytree.tree_map_only(Tensor, lambda t: t.clone(), self)


def _float_leaves(params: Any) -> list[Tensor]:
    leaves = [t for t in pytree.tree_leaves(params) if isinstance(t, Tensor)]
    if not leaves:
        raise ConfigError("the params tree has no tensor leaves to train")
    bad = sorted({str(t.dtype) for t in leaves if t.dtype != torch.float32})
    if bad:
        raise ConfigError(f"params leaves must be fp32 master weights to train (cast with "
                          f"packedenc.tree_cast(params, torch.float32)), found {bad}")
    return leaves


def clip_by_global_norm(grads: list[Tensor], max_norm: float) -> Tensor:
    """Scale `grads` in place so their global L2 norm is at most `max_norm`; return the norm
    before clipping (a device scalar). torch.nn.utils.clip_grad_norm_'s rule, without a sync."""
    total = _global_norm(grads)
    torch._foreach_mul_(grads, _clip_coef(total, max_norm))
    return total


def _global_norm(grads: list[Tensor]) -> Tensor:
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())


def _clip_coef(norm: Tensor, max_norm: float) -> Tensor:
    """clip_grad_norm_'s rule: the factor that brings a global norm down to at most `max_norm`."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def backward_grads(loss: Tensor, inputs: Sequence[Tensor]) -> tuple[Tensor | None, ...]:
    """`torch.autograd.grad(loss, inputs, allow_unused=True)` with the backward on the calling thread.

    By default the autograd engine hands a CUDA backward to its device thread and the caller
    sleeps until it is done: a wake-up each way, and every Python backward node (ours are
    autograd.Functions) then runs on that thread. An eager step is host-bound, so that hand-off
    is paid in wall time: the ModernBERT-base step on `query` batches runs ~1.6x faster on the
    calling thread (benchmarks/NOTES.md, "Kept"). The thread mode is thread-local and restored
    on return. A loss spread over several devices loses the engine's per-device parallelism,
    which the pytree of one model on one device never has."""
    with torch.autograd.set_multithreading_enabled(False):
        return torch.autograd.grad(loss, inputs, allow_unused=True)


@dataclasses.dataclass(frozen=True)
class Step:
    """The training step `(state, batch) -> (loss, new state)`; build it with `make_step`."""

    loss_fn: LossFn
    optimizer: AdamW
    clip_norm: float | None = None
    compute_dtype: torch.dtype | None = None

    # -- phase 1: one micro-batch -----------------------------------------------------------

    def grads(self, params: Any, batch: Any) -> tuple[Tensor, list[Tensor]]:
        """(loss, gradient of every params leaf) of one micro-batch; nothing is mutated. With a
        `compute_dtype` the loss sees the leaves cast to it and the gradients are in that dtype
        (the values a cast's backward would widen to fp32: the accumulator widens them instead)."""
        leaves, spec = pytree.tree_flatten(params)
        ts = [t for t in leaves if isinstance(t, Tensor)]
        if self.compute_dtype is not None:
            work = _flat_like(ts, self.compute_dtype)
            with torch.no_grad():
                torch._foreach_copy_(work, ts)  # one multi-tensor cast, outside autograd
            it = iter(work)
            leaves = [next(it) if isinstance(t, Tensor) else t for t in leaves]
        xs = [t.detach().requires_grad_(True) if isinstance(t, Tensor) else t for t in leaves]
        ts = [x for x in xs if isinstance(x, Tensor)]
        with torch.enable_grad():
            loss = self.loss_fn(pytree.tree_unflatten(xs, spec), batch)
        if not isinstance(loss, Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            raise TypeError(f"the loss function must return a scalar float tensor, got {_describe(loss)}")
        gs = backward_grads(loss.reshape(()), ts)
        return loss.detach().reshape(()).float(), [torch.zeros_like(t) if g is None else g for t, g in zip(ts, gs)]

    # -- phase 2: the update, in place -------------------------------------------------------

    def apply_(self, state: TrainState, grads: list[Tensor], scale: Tensor | float = 1.0) -> Tensor:
        """Scale the summed gradients (1 / micro-batches), all-reduce them over a process group
        when one is up, clip, and take the AdamW step in place. Return the gradient norm (of the
        scaled gradients, before clipping). The scale and the clip coefficient are not applied by
        passes of their own: the fused update divides each gradient by their one device divisor."""
        _all_reduce_mean(grads)
        factor = None if isinstance(scale, float) and scale == 1.0 else scale
        norm = _global_norm(grads) if factor is None else _global_norm(grads) * factor
        if self.clip_norm is not None:
            coef = _clip_coef(norm, self.clip_norm)
            factor = coef if factor is None else coef * factor
        if isinstance(factor, Tensor):
            divisor = torch.reciprocal(factor.float())
        elif factor is not None:  # a host float: a device fill, not a host-to-device copy
            divisor = torch.full((), 1.0 / factor, dtype=torch.float32, device=grads[0].device)
        else:
            divisor = None
        self.optimizer.update_(_float_leaves(state.params), grads, state.opt, divisor)
        return norm

    # -- the whole step ----------------------------------------------------------------------

    def update_(self, state: TrainState, batches: Any) -> Tensor:
        """One step in place on `state` (donated). `batches`: one batch or a list of micro-batches
        (gradient accumulation: their mean loss and mean gradient). Return the loss."""
        micro = list(batches) if isinstance(batches, list) else [batches]
        if not micro:
            raise ConfigError("a training step needs at least one batch")
        acc, total = None, None
        for b in micro:
            loss, gs = self.grads(state.params, b)
            if acc is None:
                acc, total = _widened(gs), loss
            else:
                torch._foreach_add_(acc, gs)
                total = total + loss
        self.apply_(state, acc, 1.0 / len(micro))
        return total / len(micro)

    def __call__(self, state: TrainState, batches: Any) -> tuple[Tensor, TrainState]:
        """Pure: `(loss, new_state)`; `state` is left as it was (its tensors are copied first)."""
        new = state.clone()
        return self.update_(new, batches), new


def make_step(loss_fn: LossFn, optimizer: AdamW, *, clip_norm: float | None = None,
              compute_dtype: torch.dtype | None = None) -> Step:
    """The training step of `loss_fn(params, batch) -> scalar loss` with `optimizer`.

    Arguments:
        loss_fn: pure function of a params tree and a batch (anything: a `Packed`, a dict of
            them and tensors); e.g. encode + `packedenc.train.losses.mlm_loss`. For mixed
            precision pass `compute_dtype` rather than casting inside it.
        optimizer: `AdamW(lr=..., weight_decay=...)`.
        clip_norm: clip the global gradient norm to this (None: no clipping).
        compute_dtype: mixed precision, e.g. torch.bfloat16: the loss sees the fp32 master
            weights cast to it (one multi-tensor cast a micro-batch), their gradients come back in
            it and are summed in fp32. The same numbers as casting inside `loss_fn`
            (`packedenc.tree_cast`), without a cast kernel and its backward per params leaf.
    Return:
        a `Step`: `step(state, batch) -> (loss, new_state)` (pure), `step.update_(state, batch)`
        (in place), and the phases `graphed_step` captures.
    """
    if not callable(loss_fn):
        raise ConfigError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, AdamW):
        raise ConfigError(f"optimizer must be packedenc.train.AdamW, got {type(optimizer).__name__}")
    if clip_norm is not None and not clip_norm > 0:
        raise ConfigError(f"clip_norm must be > 0 or None, got {clip_norm!r}")
    if compute_dtype is not None and not (isinstance(compute_dtype, torch.dtype) and compute_dtype.is_floating_point):
        raise ConfigError(f"compute_dtype must be a floating torch.dtype or None, got {compute_dtype!r}")
    return Step(loss_fn, optimizer, None if clip_norm is None else float(clip_norm), compute_dtype)


def _widened(grads: list[Tensor]) -> list[Tensor]:
    """fp32 contiguous gradients (what the fused AdamW takes): those that already are, as they are;
    otherwise fp32 copies, views of one flat buffer written by one multi-tensor copy (not a cast
    kernel and a tensor per leaf). autograd.grad may return a transposed gradient."""
    if all(g.dtype == torch.float32 and g.is_contiguous() for g in grads):
        return list(grads)
    out = _flat_like(grads, torch.float32)
    torch._foreach_copy_(out, grads)
    return out


def _flat_like(ts: list[Tensor], dtype: torch.dtype) -> list[Tensor]:
    """Uninitialised tensors shaped like `ts`, in `dtype`: views of one flat buffer (one allocation
    rather than one per leaf; the host time of an eager step)."""
    sizes = [t.numel() for t in ts]
    flat = torch.empty(sum(sizes), dtype=dtype, device=ts[0].device)
    return [v.view(t.shape) for v, t in zip(flat.split(sizes), ts)]


def _all_reduce_mean(grads: list[Tensor]) -> None:
    """Mean of the gradients over the default process group, if there is one with > 1 rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)  # SUM: gloo has no AVG
    flat /= dist.get_world_size()
    pieces = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [p.view_as(g) for p, g in zip(pieces, grads)])


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__
