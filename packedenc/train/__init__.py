"""Training: losses over packed batches (`losses.py`) and data parallelism (`distributed.py`)."""
