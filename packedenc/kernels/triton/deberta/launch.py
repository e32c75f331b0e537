"""Launch options of the DeBERTa kernels (tile rows, warps, pipeline stages, register caps, grid
limits) and the host-side checks every launcher shares.

Shapes: T packed tokens, S sequences, H heads, K head dim, R position-table rows.

`DebertaTiles` holds every option a launcher reads. The launchers take one as `tiles=` and default
to `TILES`, the values that ship: the measured winners on an H200 with Triton 3.6 (fp16, H = 12,
K = 64; the sweeps are in `benchmarks/results/history/NOTES-diary.md`, the results in `benchmarks/results/deberta_h200.json`).
A test passes smaller tiles (16-row tiles keep the CPU interpreter fast) or a small `max_grid_z` (the
chunked grid of packs with more than 65535 sequences); a benchmark passes the variant it times.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from packedenc.errors import ConfigError
from packedenc.kernels.triton._common import check_float, next_pow2

__all__ = ["DebertaTiles", "TILES", "LOG2E", "register_cap", "prec", "check_inputs"]

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DebertaTiles:
    """Tile shapes and launch options of the DeBERTa kernels; the defaults ship (module docstring).

    Whatever the fields say, 16-row tiles run on 4 warps, and wide heads (K > 64) on larger tiles on
    8 warps without a register cap (with 4 warps they spill; sm_90 ptxas).
    """

    # Query = key rows of a tile of the 32-row forward and of the backward: per batch the smallest
    # power of two >= max_seqlen in [16, block_max]. 64-row tiles spill 100-500 bytes a thread in the
    # band path (the band GEMM outputs and the tl.gather shuffles) and fail to compile with Triton 3.6
    # on sm_90 (TritonGPUPipeline).
    block_max: int = 32
    # CUDA's limit on grid dim 2 (sequences): packs of more sequences launch in chunks.
    max_grid_z: int = 65535
    # 32-row forward, K <= 64: 4 warps run 2x faster than 8; with the register cap 2 stages beat 3.
    # The cap (4-warp launches, K <= 64) fits 3 programs per SM instead of 2 at 84 bytes of spills;
    # 128 (308 bytes) ties on doc packs and loses elsewhere.
    fwd_warps: int = 4
    fwd_stages: int = 2
    fwd_maxnreg: int | None = 168
    # Key rows of a saturated tile in units of the tile rows: 4 pays on long sequences, 2 on document
    # packs (max_seqlen <= short_max_seqlen), whose saturated key ranges are short.
    saturated_blocks: int = 4
    saturated_blocks_short: int = 2
    short_max_seqlen: int = 2048
    # Wide band tiles (`forward_wide.py`), wide_m = 2 * wide_n query rows (one warpgroup's wgmma), for
    # batches whose 32-row tiles would be full (max_seqlen > wide_n) and K <= 64: 1.5x faster than
    # 32 x 32 tiles on doc packs and long sequences. Saturated tiles of wide_ns keys (32: slower on
    # long sequences, 128: slower on packs); 1 stage (2 lose everywhere); the 168 cap fits 3 programs
    # per SM instead of 2 (128 / 144 / 184 lose).
    wide_m: int = 64
    wide_n: int = 32
    wide_ns: int = 64
    wide_warps: int = 4
    wide_stages: int = 1
    wide_maxnreg: int | None = 168
    # One-pass backward, K <= 64: 4 warps (8: 1.5x slower) and 1 stage although it spills ~360 bytes
    # a thread (the pipelined loads compete with the spills); a 168 cap wins on one 8192-token
    # sequence but loses on the doc1k batches that training runs, so none.
    bwd_warps: int = 4
    bwd_stages: int = 1
    bwd_maxnreg: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_max", "wide_n", "wide_ns"):
            _check(self, name, lambda v: v >= 16 and v == next_pow2(v), "a power of two >= 16 (tl.dot, tl.arange)")
        _check(self, "wide_m", lambda v: v == 2 * self.wide_n, f"2 * wide_n = {2 * self.wide_n}")
        _check(self, "wide_ns", lambda v: v % self.wide_n == 0, f"a multiple of wide_n = {self.wide_n}")
        for name in ("max_grid_z", "saturated_blocks", "saturated_blocks_short", "short_max_seqlen",
                     "fwd_stages", "wide_stages", "bwd_stages"):
            _check(self, name, lambda v: v >= 1, "an int >= 1")
        for name in ("saturated_blocks", "saturated_blocks_short"):
            _check(self, name, lambda v: v == next_pow2(v), "a power of two (tl.arange)")
        for name in ("fwd_warps", "wide_warps", "bwd_warps"):
            _check(self, name, lambda v: v in (1, 2, 4, 8, 16), "one of 1, 2, 4, 8, 16")
        for name in ("fwd_maxnreg", "wide_maxnreg", "bwd_maxnreg"):
            _check(self, name, lambda v: 24 <= v <= 255, "None or a register count in [24, 255]", optional=True)

    def block(self, max_seqlen: int) -> int:
        """Rows of a tile for a batch (forward and backward): short batches waste no band work on
        empty rows; 16 is tl.dot's minimum."""
        return max(16, min(self.block_max, next_pow2(max(int(max_seqlen), 1))))

    def takes_wide(self, block: int, max_seqlen: int, block_k: int) -> bool:
        """Whether the forward of a batch runs on wide tiles (`forward_wide.py`)."""
        return block == self.wide_n and max_seqlen > self.wide_n and block_k <= 64

    def saturated_rows(self, block: int, max_seqlen: int) -> int:
        """Key rows of a saturated tile of the 32-row forward."""
        return (self.saturated_blocks_short if max_seqlen <= self.short_max_seqlen else self.saturated_blocks) * block

    def fwd_options(self, block: int, head_dim: int) -> dict:
        """Launch options of the 32-row forward."""
        warps = 4 if block <= 16 else self.fwd_warps if head_dim <= 64 else 8
        capped = warps == 4 and head_dim <= 64  # the measured shape; wide heads are not capped
        return dict(num_warps=warps, num_stages=self.fwd_stages, **register_cap(self.fwd_maxnreg if capped else None))

    def wide_options(self) -> dict:
        """Launch options of the wide forward."""
        return dict(num_warps=self.wide_warps, num_stages=self.wide_stages, **register_cap(self.wide_maxnreg))

    def bwd_options(self, block: int, head_dim: int) -> dict:
        """Launch options of the one-pass backward."""
        warps = 4 if block <= 16 else self.bwd_warps if head_dim <= 64 else 8
        return dict(num_warps=warps, num_stages=self.bwd_stages, **register_cap(self.bwd_maxnreg))

    def chunks(self, cu_seqlens: Tensor):
        """(cu_seqlens view, number of sequences) per launch; the kernels read absolute offsets."""
        S = cu_seqlens.numel() - 1
        if S <= self.max_grid_z:  # the usual case: no slice (a tensor view costs host time)
            yield cu_seqlens, S
            return
        for c in range(0, S, self.max_grid_z):
            yield cu_seqlens[c:], min(self.max_grid_z, S - c)


def _check(tiles: DebertaTiles, name: str, ok, want: str, optional: bool = False) -> None:
    v = getattr(tiles, name)
    if v is None and optional:
        return
    if isinstance(v, bool) or not isinstance(v, int) or not ok(v):
        raise ConfigError(f"DebertaTiles({name}={v!r}): must be {want}")


TILES = DebertaTiles()


def register_cap(maxnreg: int | None) -> dict:
    """The `maxnreg` launch option when a cap is set (the CPU interpreter accepts and ignores it)."""
    return {"maxnreg": maxnreg} if maxnreg else {}


def prec(dtype: torch.dtype) -> str:
    """tl.dot's input precision: fp32 inputs multiply in full fp32, not TF32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, pk: Tensor | None,
                 pq: Tensor | None) -> None:
    """Layout asserts of a launch: (T, H, K) q / k / v of one float dtype with the head dim contiguous,
    int32 cu_seqlens, (R, H, K) tables with the head dim contiguous."""
    check_float("deberta_attention", q, k, v)
    assert q.dim() == 3 and q.shape == k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q.dtype == k.dtype == v.dtype, "deberta_attention: q, k, v must share a dtype"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "head dim must be contiguous"
    assert cu_seqlens.dtype == torch.int32 and cu_seqlens.is_contiguous()
    for t in (pk, pq):
        if t is not None:
            assert t.dim() == 3 and t.shape[1:] == q.shape[1:] and t.stride(-1) == 1, (t.shape, q.shape)
