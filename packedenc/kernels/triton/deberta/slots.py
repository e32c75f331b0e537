"""The relative-position slot table of the DeBERTa kernels: HF's log buckets, looked up, never computed.

SLOT[d + half] = clamp(bucket(d) + R // 2, 0, R - 1) for every distance |d| <= half, built once per
(buckets, max_relative_positions, R, half, device) on the CPU with `reference.log_bucket_position`
(op for op HF's `make_log_bucket_position`, float32 CPU math, so the exact float ties land where
HF's CPU build puts them) and copied to the device once. `saturation` gives the distances beyond
which every pair of a tile shares one slot (the forward's folded fast path). The root of the
sub-package's imports: every kernel module looks slots up through `_slot`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels.reference.deberta import log_bucket_position
from packedenc.kernels.triton._common import cdiv, launch, next_pow2

__all__ = ["slot_table", "saturation", "launch_tables", "table_slots", "NO_SATURATION", "MIN_TABLE_HALF"]

MIN_TABLE_HALF = 8192  # one table serves every max_seqlen <= 8192 (built once, before any graph capture)


# ---- the slot table ----------------------------------------------------------------------------


def _build_slots(position_buckets: int, max_relative_positions: int, R: int, half: int) -> Tensor:
    """(2 * half + 1,) int32 CPU: SLOT[d + half] = clamp(r(d) + R // 2, 0, R - 1), HF's r, for |d| <= half."""
    d = torch.arange(-half, half + 1, dtype=torch.long)
    if position_buckets > 0 and max_relative_positions > 0:
        d = log_bucket_position(d, position_buckets, max_relative_positions).long()
    slots = torch.clamp(d + R // 2, 0, R - 1).to(torch.int32)
    # The kernel's rank-1 shortcut needs slots non-decreasing in d (true of HF's buckets).
    assert bool((slots[1:] >= slots[:-1]).all()), (position_buckets, max_relative_positions)
    return slots


_TABLES: dict[tuple, Tensor] = {}


def slot_table(position_buckets: int, max_relative_positions: int, R: int, max_seqlen: int,
               device: torch.device) -> tuple[Tensor, int]:
    """(table, half): the int32 slot of every distance |d| <= half on `device`, cached.

    half = max(8192, next_pow2(max_seqlen)) >= max_seqlen - 1, so every pair of a sequence is in
    range (the kernel clamps only distances of masked tile tails). Built on the CPU (the float ties
    of the log buckets then match HF's CPU build exactly) and copied once, so it must exist before
    a CUDA-graph capture (a host copy cannot be captured): the eager warm-up builds it.
    """
    half = max(MIN_TABLE_HALF, next_pow2(max(int(max_seqlen), 1)))
    key = (int(position_buckets), int(max_relative_positions), int(R), half, device)
    table = _TABLES.get(key)
    if table is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "deberta_attention: the relative-position slot table for "
                f"(position_buckets={position_buckets}, max_relative_positions={max_relative_positions}, "
                f"max_seqlen<={half}) is built on the first eager call; run one eager forward (warm-up) "
                "before capturing a CUDA graph"
            )
        table = _TABLES[key] = _build_slots(position_buckets, max_relative_positions, R, half).to(device)
    return table, half


_BOUNDS: dict[tuple, tuple[int, int, int, int]] = {}
NO_SATURATION = 1 << 29  # |d| bound that no packed pair reaches: the "no position terms" bounds


def saturation(position_buckets: int, max_relative_positions: int, R: int, max_seqlen: int,
               device: torch.device) -> tuple[int, int, int, int]:
    """(d_lo, d_hi, slot_min, slot_max): every d <= d_lo has slot_min and every d >= d_hi slot_max.

    Slots are non-decreasing in d, so beyond those distances the c2p / p2c terms of a tile are
    one table row each, and the forward folds them into q and k (see `_fwd_kernel`).
    """
    table, half = slot_table(position_buckets, max_relative_positions, R, max_seqlen, device)
    key = (int(position_buckets), int(max_relative_positions), int(R), half)
    out = _BOUNDS.get(key)
    if out is None:
        cpu = _build_slots(position_buckets, max_relative_positions, R, half)
        lo, hi = int(cpu[0]), int(cpu[-1])
        d_lo = int((cpu == lo).nonzero().max()) - half
        d_hi = int((cpu == hi).nonzero().min()) - half
        out = _BOUNDS[key] = (d_lo, d_hi, lo, hi)
    return out


_LAUNCH: dict[tuple, tuple[Tensor, int, tuple[int, int, int, int]]] = {}


def launch_tables(position_buckets: int, max_relative_positions: int, R: int, max_seqlen: int,
                  device: torch.device) -> tuple[Tensor, int, tuple[int, int, int, int]]:
    """(table, half, saturation bounds) in one cached lookup: what every forward launch needs
    (`slot_table` and `saturation` each hash their key again; eager batches are host-bound)."""
    half = MIN_TABLE_HALF if max_seqlen <= MIN_TABLE_HALF else next_pow2(int(max_seqlen))
    key = (position_buckets, max_relative_positions, R, half, device)
    out = _LAUNCH.get(key)
    if out is None:
        table, half = slot_table(position_buckets, max_relative_positions, R, max_seqlen, device)
        out = _LAUNCH[key] = (table, half, saturation(position_buckets, max_relative_positions, R, max_seqlen, device))
    return out


@triton.jit
def _slot(SLOT, d, half):
    """Slot of distance(s) d: the table lookup every kernel uses (d clamped to the table)."""
    return tl.load(SLOT + (tl.minimum(tl.maximum(d, -half), half) + half))


@triton.jit
def _slots_kernel(SLOT, D, OUT, n, half, BLOCK: tl.constexpr):
    """Test hook: OUT[t] = _slot(D[t]), the same lookup as the attention kernels."""
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    d = tl.load(D + t, mask=t < n, other=0)
    tl.store(OUT + t, _slot(SLOT, d, half), mask=t < n)


def table_slots(d: Tensor, position_buckets: int, max_relative_positions: int, R: int) -> Tensor:
    """Slots of the int32 distances `d` as the kernels see them (through `_slot`), for tests."""
    table, half = slot_table(position_buckets, max_relative_positions, R, int(d.abs().max()) + 1, d.device)
    d = d.to(torch.int32).contiguous()
    out = torch.empty_like(d)
    launch(_slots_kernel, (cdiv(d.numel(), 1024),), table, d, out, d.numel(), half, BLOCK=1024)
    return out
