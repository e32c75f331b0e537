"""DeBERTa's packed disentangled attention in Triton: forward, backward and the registered op.

The modules import each other as a tree, from the leaves up (none imports this package's names):
  slots.py         the relative-position slot table (HF's log buckets, looked up, never computed)
  scores.py        a tile's c2p / p2c terms (rank-1, band, carried half band)
  tiles.py         sequence span, row loads, online softmax, key ranges and saturated tiles
  launch.py        `DebertaTiles`: tile rows, warps, stages, register caps (the shipped `TILES`)
  forward_wide.py  the forward on (64, 32) wgmma band tiles (batches longer than 32, K <= 64)
  forward.py       the 32-row forward and the forward launcher (which picks the wide tiles)
  backward.py      the one-pass backward (each tile recomputed once, dq by fp32 atomics)
  op.py            the custom ops, autograd, and `deberta_attention`, the Ops-table entry
"""

from packedenc.kernels.triton.deberta.launch import TILES, DebertaTiles
from packedenc.kernels.triton.deberta.op import deberta_attention

__all__ = ["deberta_attention", "DebertaTiles", "TILES"]
