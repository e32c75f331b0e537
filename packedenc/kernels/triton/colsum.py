"""Column sums of the (P, ...) fp32 partial rows that backward kernels write (one per program).

The LayerNorm and bias-activation backwards reduce their parameter gradients in two steps: each of
P programs writes one fp32 partial row, then `colsum` adds the P rows. Why a kernel rather than
torch's `part.sum(0)`: for a (1024, 768) buffer torch launches a reduction that splits the rows
across blocks, ~17 us on the H200 (46 of them in a ModernBERT-base training step), longer than
the LayerNorm backward kernel itself. Here a program owns BLOCK_C columns and walks the rows in a
fixed order, so the sums are deterministic.

Shapes: P partial rows, C = the product of the other dims.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from packedenc.kernels.triton._common import cdiv, launch

__all__ = ["colsum"]

# (BLOCK_P, BLOCK_C, num_warps): 48 programs of 4 row chunks for (1024, 768). The best of 8 tiles
# at P = 1024 and 256 (benchmarks/results/norm_probe_h200.json, `colsum`): 4.1 / 2.3 us, against
# torch's sum(0) 7.4 / 5.5 us when replayed alone (~17 us inside a training step's profile).
TILE = (256, 16, 4)


@triton.jit
def _colsum_kernel(PART, OUT, P, C, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """OUT[c] = sum over p of PART[p, c] for this program's BLOCK_C columns; PART (P, C) fp32 contiguous."""
    col = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = col < C
    acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        row = p0 + tl.arange(0, BLOCK_P)
        acc += tl.load(PART + row.to(tl.int64)[:, None] * C + col[None, :], mask=(row < P)[:, None] & cmask[None, :],
                       other=0.0)
    tl.store(OUT + col, tl.sum(acc, axis=0), mask=cmask)


def colsum(part: Tensor, tile: tuple[int, int, int] | None = None) -> Tensor:
    """(P, *rest) contiguous fp32 -> (*rest) fp32: the sum over the first dim (zeros when P = 0).
    `tile` (BLOCK_P, BLOCK_C, num_warps) overrides TILE (benchmarks.norm_probe's sweep)."""
    P, rest = part.shape[0], part.shape[1:]
    C = math.prod(rest)
    out = torch.empty(rest, dtype=torch.float32, device=part.device)
    if P == 0 or C == 0:
        return out.zero_()
    BP, BC, warps = tile or TILE
    launch(_colsum_kernel, (cdiv(C, BC),), part, out, P, C, BLOCK_P=BP, BLOCK_C=BC, num_warps=warps)
    return out
