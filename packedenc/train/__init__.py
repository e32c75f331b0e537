"""Training: losses over packed batches (`losses.py`), the pure training step and AdamW
(`optim.py`; replayed as CUDA graphs by `packedenc.cudagraphs.graphed_step`) and data
parallelism (`distributed.py`)."""

from packedenc.train.optim import AdamW, AdamWState, Step, TrainState, clip_by_global_norm, make_step

__all__ = ["AdamW", "AdamWState", "TrainState", "Step", "make_step", "clip_by_global_norm"]
