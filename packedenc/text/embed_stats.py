"""Where one `embed` call spends its time: `embed(model, texts, stats=EmbedStats())`.

On a small model the GPU work of a batch is short and the host's (tokenizing, packing, launching,
reading back) decides the speed; this makes the split visible without a profiler. The fields are
summed over the call's batches; recording them costs two CUDA events per batch, nothing else.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["EmbedStats"]


@dataclasses.dataclass
class EmbedStats:
    """A breakdown of one `embed` call, filled in by it (a call resets every field first).

    Fields:
        wall_s: the whole call, as the caller waits for it.
        batches: packed batches run. texts / tokens: texts embedded and tokens in their batches.
        tokenize_s: time the background thread spent in the tokenizer (prompts and ColBERT
            prefixes included), summed over its chunks.
        pack_s: time the background thread spent checking ids, sorting and cutting batches.
        wait_s: time the caller's thread waited for the background thread's next batch (the
            device loop starved by tokenization).
        device_ms: CUDA models: summed CUDA-event time from each batch's first backbone kernel to
            its last module's end. It includes any gap in which the GPU waited for the host to
            launch more work, so it is the device's share only when the host runs ahead. None
            on other devices.
    """

    wall_s: float = 0.0
    batches: int = 0
    texts: int = 0
    tokens: int = 0
    tokenize_s: float = 0.0
    pack_s: float = 0.0
    wait_s: float = 0.0
    device_ms: float | None = None
    _events: list = dataclasses.field(default_factory=list, repr=False)

    def reset(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, f.default_factory() if f.default is dataclasses.MISSING else f.default)

    def start_batch(self, device: torch.device) -> Any:
        """A CUDA event recorded before a batch's backbone on `device`'s stream (None elsewhere)."""
        if device.type != "cuda":
            return None
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        return start

    def end_batch(self, start: Any, num_texts: int, num_tokens: int) -> None:
        self.batches += 1
        self.texts += num_texts
        self.tokens += num_tokens
        if start is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((start, end))

    def finish(self, wall_s: float) -> None:
        """Sum the device time (every batch's events have completed: its results were read back)."""
        self.wall_s = wall_s
        if self._events:
            self.device_ms = sum(a.elapsed_time(b) for a, b in self._events)
        self._events = []

    def as_record(self) -> dict[str, Any]:
        """The public fields, for a benchmark record."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
