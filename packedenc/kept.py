"""Values made from weights once and handed back while those weights do not change.

Short eager batches are host-bound: work that depends on the weights only (DeBERTa's relative-
position tables, the column sums of a LayerNorm folded into a GEMM) costs launches on every call
unless it is kept. A `Kept` store holds such values, each under the tensors it was made from, and
hands one back while every one of them is the same tensor (checked by identity through weak
references) at the same version: an in-place update (an optimizer step, `copy_`) bumps the version
and the value is made again. An entry goes when its first tensor is freed, or past `max_entries`,
oldest first.

`keepable` says when a value may be kept at all; the caller adds what else its value depends on
(gradients, dropout) and passes anything else it depends on as `extra` (an op table's choices).
"""

from __future__ import annotations

import weakref
from typing import Any, Hashable, Sequence

import torch
from torch import Tensor

__all__ = ["Kept", "keepable"]


def keepable(leaves: Sequence[Tensor]) -> bool:
    """Whether a value made from `leaves` may be kept: outside a trace, never from inference tensors
    (made under `torch.inference_mode`, they keep no version), and for CUDA tensors only on the
    device's default stream: a CUDA-graph capture and its warm-up run on a side stream and allocate
    from the graph's memory pool, which a kept value must not hold, and a value made on one stream
    would be read unsynchronised on another."""
    if not leaves or torch.compiler.is_compiling() or any(t.is_inference() for t in leaves):
        return False
    d = leaves[0].device
    if d.type != "cuda":
        return True
    default = _DEFAULT_STREAMS.get(d.index)
    if default is None:
        default = _DEFAULT_STREAMS[d.index] = torch.cuda.default_stream(d)
    return torch.cuda.current_stream(d) == default


_DEFAULT_STREAMS: dict[int | None, torch.cuda.Stream] = {}  # per device: an eager call asks once per layer


class Kept:
    """Values keyed by the tensors they were made from (see the module docstring)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        # id(first leaf) -> (weak references to the leaves, their versions, extra, value)
        self._entries: dict[int, tuple[tuple[weakref.ref, ...], tuple[int, ...], Hashable, Any]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, leaves: Sequence[Tensor], extra: Hashable = None, default: Any = None) -> Any:
        """The value kept for `leaves` and `extra`, or `default` when there is none or it is stale."""
        hit = self._entries.get(id(leaves[0]))
        if hit is None:
            return default
        refs, versions, kept_extra, value = hit
        if (len(refs) != len(leaves) or kept_extra != extra or any(r() is not t for r, t in zip(refs, leaves))
                or versions != tuple(t._version for t in leaves)):
            return default
        return value

    def put(self, leaves: Sequence[Tensor], extra: Hashable, value: Any) -> Any:
        """Keep `value` for `leaves` (replacing what was kept for them) and return it."""
        key = id(leaves[0])
        self._entries.pop(key, None)
        while len(self._entries) >= self.max_entries:
            del self._entries[next(iter(self._entries))]
        first = weakref.ref(leaves[0], self._forget)  # the entry goes with its tensors
        refs = (first, *(weakref.ref(t) for t in leaves[1:]))
        self._entries[key] = (refs, tuple(t._version for t in leaves), extra, value)
        return value

    def clear(self) -> None:
        """Drop every entry (a test starting from an empty store; a user freeing kept values)."""
        self._entries.clear()

    def holds(self, t: Tensor) -> bool:
        """Whether an entry was made from `t` as its first tensor (alive)."""
        return any(e[0][0]() is t for e in self._entries.values())

    def _forget(self, ref: weakref.ref) -> None:
        for k, entry in list(self._entries.items()):
            if entry[0][0] is ref:
                del self._entries[k]
