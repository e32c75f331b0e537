"""CUDA-graph replay, packedenc's `jit`: `graphed` (an encode) and `graphed_step` (a training step).

`buckets.py` decides which static shape a batch is padded to and writes the padding (dummy
sequences outside the real `cu_seqlens`); `encode.py` captures and replays one encode graph per
bucket; `step.py` one forward + backward graph per bucket and one optimizer-update graph.
"""

from packedenc.cudagraphs.buckets import (
    Bucket, default_seq_buckets, default_token_buckets, fill_padded, pad_batch, plan_bucket,
)
from packedenc.cudagraphs.encode import GraphedEncode, graphed
from packedenc.cudagraphs.step import GraphedStep, Pad, graphed_step

__all__ = ["graphed", "GraphedEncode", "graphed_step", "GraphedStep", "Pad", "Bucket", "plan_bucket", "pad_batch", "fill_padded",
           "default_token_buckets", "default_seq_buckets"]
