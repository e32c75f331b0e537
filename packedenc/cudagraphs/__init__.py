"""CUDA-graph replay, the pair to JAX's `jit` for CUDA: `graphed` (an encode) and its buckets.

`buckets.py` decides which static shape a batch is padded to and writes the padding (dummy
sequences outside the real `cu_seqlens`); `encode.py` captures and replays one graph per bucket.
"""

from packedenc.cudagraphs.buckets import (
    Bucket, default_seq_buckets, default_token_buckets, fill_padded, pad_batch, plan_bucket,
)
from packedenc.cudagraphs.encode import GraphedEncode, graphed

__all__ = ["graphed", "GraphedEncode", "Bucket", "plan_bucket", "pad_batch", "fill_padded",
           "default_token_buckets", "default_seq_buckets"]
