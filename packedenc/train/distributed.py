"""Data parallelism on torch.distributed (launched with `torchrun`), for the params pytree.

Training: `wrap(params)` puts the tree's leaves into a thin `nn.Module` and hands it to
`DistributedDataParallel` (bucketed gradient all-reduce overlapped with the backward pass) or,
with `fsdp=True`, to FSDP2's `fully_shard` (params, grads and optimizer state sharded as DTensors).
The module's forward takes the loss function, so the whole step stays a function of the tree:

    model = pdist.wrap(params)                         # DDP; identical params on every rank
    opt = torch.optim.AdamW(model.parameters())
    loss = model(loss_fn, batch)                       # loss_fn(params_tree, batch)
    loss.backward(); opt.step()
    ...
    pdist.finish()                                     # once the model is gone (after main returns)

Data: `rank_range(n)` gives this rank's contiguous share of n items; each rank packs its own
token-budget batches. Embedding shards with a resumable manifest live in `packedenc.text.sharded`.
"""

from __future__ import annotations

import datetime

import gc
import os
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["init", "finish", "rank", "world_size", "rank_range", "ParamsModule", "wrap", "is_initialized"]


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def init(backend: str | None = None) -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...) and return
    this rank's device. NCCL with one GPU per local rank when CUDA is present, else gloo on CPU.
    A plain single process (no torchrun variables) is fine: nothing is initialised."""
    cuda = torch.cuda.is_available()
    device = torch.device("cpu")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not is_initialized():
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
    return device


def finish() -> None:
    """Leave the process group (nothing to do without one). Call it once the wrapped model is gone,
    e.g. after `main()` returns. DDP and FSDP2 modules sit in reference cycles (their hooks), so
    without a collection here they are freed after the group is destroyed or at interpreter
    shutdown, where a DDP reducer can hang and freeing gloo work handles aborts the process
    ("terminate called without an active exception": 1 run in 12 of a loaded 2-core CPU machine
    in tests/distributed/dp_step.py's FSDP step, 0 in 48 with this collection)."""
    if is_initialized():
        gc.collect()
        dist.destroy_process_group()


def rank_range(n: int, r: int | None = None, world: int | None = None) -> range:
    """This rank's contiguous slice of `n` items; sizes differ by at most one across ranks."""
    r = rank() if r is None else r
    world = world_size() if world is None else world
    base, extra = divmod(n, world)
    start = r * base + min(r, extra)
    return range(start, start + base + (r < extra))


class ParamsModule(nn.Module):
    """An `nn.Module` view of a params tree: each leaf is an `nn.Parameter` (same storage), and
    `.params` rebuilds the tree (config included) from the current parameters.

    `forward(fn, *args, **kwargs)` returns `fn(self.params, *args, **kwargs)`, so DDP / FSDP hooks
    see one forward per step whatever the loss does with the tree (encode, heads, losses).
    """

    def __init__(self, params: Any):
        super().__init__()
        leaves, self._treedef = pytree.tree_flatten(params)
        self._names = [f"p{i}" for i in range(len(leaves))]
        for name, leaf in zip(self._names, leaves):
            self.register_parameter(name, nn.Parameter(leaf.detach(), requires_grad=leaf.is_floating_point()))

    @property
    def params(self) -> Any:
        return pytree.tree_unflatten([getattr(self, n) for n in self._names], self._treedef)

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return fn(self.params, *args, **kwargs)


def wrap(params: Any, *, fsdp: bool = False, device: torch.device | None = None, **kwargs: Any) -> nn.Module:
    """Wrap a params tree for data-parallel training.

    Arguments:
        params: the tree (fp32 master weights recommended; pass compute_dtype to encode for bf16).
        fsdp: shard params / grads / optimizer state with FSDP2 instead of replicating with DDP.
        device: where the parameters live (default: the tree's device).
        kwargs: passed to DistributedDataParallel (e.g. bucket_cap_mb) or fully_shard.
    Return:
        a module whose `.module.params` (DDP) or `.params` (FSDP2) is the current tree. With a
        single process (no process group) the plain `ParamsModule` is returned.
    """
    module = ParamsModule(params)
    if device is not None:
        module = module.to(device)
    if not is_initialized():
        return module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module, **kwargs)
    dev = next(module.parameters()).device
    ids = [dev.index] if dev.type == "cuda" else None
    # Rank 0's initial params win (DDP broadcasts them), so every rank starts identical.
    return nn.parallel.DistributedDataParallel(module, device_ids=ids, **kwargs)


def unwrap(model: nn.Module) -> Any:
    """The current params tree of a module returned by `wrap` (full tensors for DDP; for FSDP2,
    DTensor leaves: call `.full_tensor()` on each to gather)."""
    inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    return inner.params


# ---- host objects between ranks (small, on a long-timeout gloo group) ---------------------------

_GROUPS: dict[int, Any] = {}


def host_group() -> Any:
    """A gloo group with a long timeout: ranks wait for each other at the end of a long job (an
    NCCL barrier would time out after 10 minutes), and only small host objects travel."""
    import torch.distributed as dist

    world = dist.group.WORLD
    if id(world) not in _GROUPS:  # the cache keeps `world` alive, so its id is never reused
        _GROUPS[id(world)] = (world, dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7)))
    return _GROUPS[id(world)][1]


def broadcast_object(obj: Any) -> Any:
    """`obj` from rank 0 on every rank (host objects, over `host_group`)."""
    if world_size() == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=host_group())
    return box[0]


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (host objects, over `host_group`)."""
    if world_size() == 1:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj, group=host_group())
    return out


def host_barrier() -> None:
    """Wait for every rank, on `host_group` (no timeout for a long job's end)."""
    if world_size() > 1:
        import torch.distributed as dist

        dist.barrier(group=host_group())
