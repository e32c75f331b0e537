"""Argument checks every public entry point shares: packed boundaries, token ids, positions,
max_seqlen, dtypes and devices. Each raises an `InputError` that names the argument and shows the
bad value.

Type, shape, dtype and device checks read only tensor metadata: they are free and always run.
Value checks read the data: free for host (CPU) tensors, a device sync for GPU ones, so callers run
them on the CPU always and on a GPU only when asked (`validate=True`). Under `torch.compile` the
value checks would be data-dependent branches; `host_values` says when they are safe to run.

Shapes: T packed tokens, S sequences.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from packedenc.errors import InputError, InputTypeError

__all__ = ["check_cu_seqlens", "check_ids", "check_positions", "check_max_seqlen", "host_values",
           "as_device", "float_dtype"]


_INDEX_DTYPES = (torch.int64, torch.int32)


def host_values(t: Tensor, validate: bool = False) -> bool:
    """Whether value checks on `t` should run: on the CPU always (no sync), on a GPU when asked;
    never while torch.compile traces (they already ran eagerly at pack time)."""
    if torch.compiler.is_compiling():
        return False
    return validate or t.device.type == "cpu"


def _describe(t: Any) -> str:
    if isinstance(t, Tensor):
        return f"a {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"
    return f"a {type(t).__name__}"


def check_cu_seqlens(cu_seqlens: Any, total: int | None = None, *, values: bool = True) -> None:
    """Raise InputError unless cu_seqlens is a valid (S+1,) integer boundary vector over `total` tokens.

    `values=False` checks type, dtype and shape only (no device sync).
    """
    if not isinstance(cu_seqlens, Tensor):
        raise InputTypeError(f"cu_seqlens must be a torch.Tensor, got {_describe(cu_seqlens)}")
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise InputError(
            f"cu_seqlens must be a 1-D int32 tensor, got shape {tuple(cu_seqlens.shape)} and "
            f"dtype {cu_seqlens.dtype}; build it with packedenc.pack(...)"
        )
    if cu_seqlens.numel() < 2:
        raise InputError("empty batch: cu_seqlens needs at least 2 entries ([0, T] for one sequence)")
    if not values:
        return
    cu = cu_seqlens.detach().cpu().long()
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
        raise InputError(f"sequence {i} is empty (cu_seqlens[{i}] == cu_seqlens[{i + 1}] == {int(cu[i])})")
    if total is not None and int(cu[-1]) != total:
        raise InputError(
            f"cu_seqlens must end at the number of packed tokens ({total}), got {int(cu[-1])}"
        )


def check_ids(ids: Any, vocab_size: int | None = None, *, values: bool = True) -> None:
    """Raise InputError unless ids is a 1-D integer tensor with every id in [0, vocab_size)."""
    if not isinstance(ids, Tensor):
        raise InputTypeError(f"ids must be a torch.Tensor, got {_describe(ids)}")
    if ids.dim() != 1:
        raise InputError(
            f"ids must be 1-D (packed, no padding), got shape {tuple(ids.shape)}; "
            "use packedenc.pack_padded(ids, attention_mask) for a padded batch"
        )
    if ids.dtype not in _INDEX_DTYPES:  # what embedding lookups take (int16 / uint8 fail inside torch)
        raise InputError(f"ids must be an int64 or int32 tensor, got {ids.dtype}")
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


def check_positions(positions: Any, ids: Tensor, limit: int | None = None, *, values: bool = True) -> None:
    """Raise InputError unless positions is an integer tensor shaped like ids, on ids' device, with
    every value in [0, limit) (`limit`: the model's position table, None when it has none)."""
    if not isinstance(positions, Tensor):
        raise InputTypeError(f"positions must be a torch.Tensor or None, got {_describe(positions)}")
    if positions.dtype not in _INDEX_DTYPES:
        raise InputError(f"positions must be an int64 or int32 tensor, got {positions.dtype}")
    if positions.shape != ids.shape:
        raise InputError(f"positions shape {tuple(positions.shape)} must equal ids shape {tuple(ids.shape)}")
    if positions.device != ids.device:
        raise InputError(f"positions is on {positions.device} but ids on {ids.device}; move both")
    if not values or positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())
    if lo < 0 or (limit is not None and hi >= limit):
        bound = f"[0, {limit})" if limit is not None else "[0, inf)"
        raise InputError(
            f"position {lo if lo < 0 else hi} is outside {bound}"
            + (" (the model's position table)" if limit is not None else "")
            + "; positions count from 0 inside each sequence (leave positions=None to derive them)"
        )


def check_max_seqlen(max_seqlen: Any, cu_seqlens: Tensor | None = None) -> None:
    """Raise InputError unless max_seqlen is None or a positive host int; with `cu_seqlens` (host
    values), also unless it is at least the longest sequence."""
    if max_seqlen is None:
        return
    if not isinstance(max_seqlen, int) or isinstance(max_seqlen, bool):
        raise InputTypeError(
            f"max_seqlen must be a host int (or None), got {_describe(max_seqlen)}; a tensor would "
            "need a device sync: use the Packed batch's max_seqlen"
        )
    if max_seqlen < 1:
        raise InputError(f"max_seqlen must be at least 1, got {max_seqlen}")
    if cu_seqlens is None:
        return
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).cpu()
    longest = int(lengths.max())
    if max_seqlen < longest:
        i = int(torch.argmax(lengths))
        raise InputError(
            f"max_seqlen={max_seqlen} is smaller than the longest sequence ({longest} tokens, "
            f"sequence {i}); pass max_seqlen >= {longest}, or None to compute it"
        )


# float8 and the like hold no weights that the ops can multiply; complex is not a weight dtype
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def as_device(device: Any, name: str = "device") -> torch.device | None:
    """`torch.device(device)` for a public argument, or None; a CUDA device needs a GPU here."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InputError(f"{name}={device!r} is not a device ('cpu', 'cuda', 'cuda:1', ...): {e}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{name}={device!r}: no CUDA GPU is available here (use 'cpu')")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise InputError(f"{name}={device!r}: there are only {torch.cuda.device_count()} CUDA device(s)")
    return dev


def float_dtype(dtype: Any, name: str = "dtype") -> torch.dtype | None:
    """`dtype` if it is None or a floating torch.dtype (what weights and activations can hold)."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise InputTypeError(f"{name} must be a torch.dtype such as torch.bfloat16, got {dtype!r}")
    if dtype not in FLOAT_DTYPES:
        raise InputError(
            f"{name}={dtype} cannot hold weights or activations; use a floating dtype "
            "(torch.float32, torch.bfloat16 or torch.float16)"
        )
    return dtype
