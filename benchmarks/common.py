"""The benchmark harness every model shares: seeded workloads, timing, memory, records, chart.

Method (shared/DESIGN.md, "Performance method"): every system runs in one process on the same
seeded workload; timing uses CUDA events after a warm-up that runs every timed input once (so
compilation, autotuning and graph capture are never timed); each repetition covers different
batches (rotating inputs) and the median repetition is reported as real (unpadded) tokens/s;
peak reserved memory is reset before every (system, workload) and read after it.

Shapes: T packed tokens, S sequences, B padded batch, L padded length.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import statistics
import time
import traceback
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from benchmarks.report import (  # noqa: F401 - re-exported: one import for scripts
    environment,
    format_table,
    git_commit,
    gpu_name,
    gpu_slug,
    make_record,
    plot,
    write_records,
)

RESULTS_DIR = Path(__file__).resolve().parent / "results"
BUDGET_TOKENS = 65536  # token-budget mode: packs of about 64k tokens


# ---- workloads ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    """Log-normal lengths (median, sigma), rounded and clipped to [lo, hi]; batches of `batch_size`."""

    name: str
    num_seqs: int
    median: float
    sigma: float
    lo: int
    hi: int
    batch_size: int


MODERNBERT_WORKLOADS = {  # issue 3
    "query": WorkloadSpec("query", 4096, 24, 0.5, 4, 128, 128),
    "doc": WorkloadSpec("doc", 1024, 350, 0.7, 32, 2048, 32),
    "long": WorkloadSpec("long", 64, 4096, 0.4, 1024, 8192, 8),
}
DEBERTA_WORKLOADS = {  # issue 5 ("long": one 8192-token sequence; report latency and memory)
    "mnli": WorkloadSpec("mnli", 4096, 36, 0.45, 8, 512, 16),
    "doc1k": WorkloadSpec("doc1k", 1024, 300, 0.7, 32, 1024, 16),
    "long": WorkloadSpec("long", 1, 8192, 0.0, 8192, 8192, 1),
}


def _seed_for(spec: WorkloadSpec, seed: int) -> int:
    # stable per workload name, so adding a workload never changes another one's data
    return seed * 1_000_003 + zlib.crc32(spec.name.encode())


def sample_lengths(spec: WorkloadSpec, seed: int = 0) -> Tensor:
    """(num_seqs,) int64 lengths: exp(log(median) + sigma * N(0, 1)), rounded, clipped."""
    g = torch.Generator().manual_seed(_seed_for(spec, seed))
    z = torch.randn(spec.num_seqs, generator=g, dtype=torch.float64)
    lengths = torch.exp(math.log(spec.median) + spec.sigma * z).round()
    return lengths.clamp(spec.lo, spec.hi).long()


@dataclasses.dataclass
class Batch:
    """One batch on the host: packed ids + boundaries; `padded()` gives the HF layout."""

    ids: Tensor  # (T,) int64
    cu_seqlens: Tensor  # (S+1,) int32
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return self.ids.numel()

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.numel() - 1

    def padded(self, pad_id: int = 0) -> tuple[Tensor, Tensor]:
        """(input_ids (S, L), attention_mask (S, L)) right-padded to this batch's longest sequence."""
        lengths = (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).long()
        S, L = self.num_seqs, self.max_seqlen
        mask_SL = torch.arange(L)[None, :] < lengths[:, None]
        ids_SL = torch.full((S, L), pad_id, dtype=torch.int64)
        ids_SL[mask_SL] = self.ids
        return ids_SL, mask_SL.long()


@dataclasses.dataclass
class Workload:
    """A seeded workload: sequences of uniform random ids, grouped into batches."""

    name: str
    lengths: list[int]
    ids: Tensor  # (sum(lengths),) every sequence back to back, generation order
    batches: list[list[int]]  # sequence indices of each batch
    budget: bool = False  # token-budget packs instead of fixed-size batches

    def __post_init__(self) -> None:
        self._starts = [0]
        for n in self.lengths:
            self._starts.append(self._starts[-1] + n)

    def batch(self, i: int) -> Batch:
        return self.batch_of(self.batches[i])

    def batch_of(self, idx: Sequence[int]) -> Batch:
        """The sequences `idx` (indices into `lengths`) as one batch."""
        parts = [self.ids[self._starts[j]: self._starts[j + 1]] for j in idx]
        lens = torch.tensor([self.lengths[j] for j in idx], dtype=torch.int32)
        cu = torch.zeros(len(idx) + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        return Batch(torch.cat(parts), cu, int(lens.max()))

    def batch_tokens(self, i: int) -> int:
        return sum(self.lengths[j] for j in self.batches[i])

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def budget_packs(lengths: Sequence[int], budget: int = BUDGET_TOKENS) -> list[list[int]]:
    """Consecutive sequences in packs of at most `budget` tokens (a longer one gets its own pack)."""
    from packedenc.packing import token_budget_batches

    return token_budget_batches(lengths, budget)


def make_workload(spec: WorkloadSpec, vocab_size: int, seed: int = 0, *,
                  budget_tokens: int | None = None) -> Workload:
    """Lengths from `sample_lengths`, ids uniform in [0, vocab_size), batches in generation order.

    `budget_tokens` switches to token-budget mode: packs of about that many tokens, named
    "<name>-<budget/1024>k".
    """
    lengths = sample_lengths(spec, seed).tolist()
    g = torch.Generator().manual_seed(_seed_for(spec, seed) + 1)
    ids = torch.randint(0, vocab_size, (sum(lengths),), generator=g)
    if budget_tokens is None:
        n, b = spec.num_seqs, spec.batch_size
        return Workload(spec.name, lengths, ids, [list(range(i, min(i + b, n))) for i in range(0, n, b)])
    name = f"{spec.name}-{budget_tokens // 1024}k"
    return Workload(name, lengths, ids, budget_packs(lengths, budget_tokens), budget=True)


# ---- timing and memory --------------------------------------------------------------------------


def rotation(workload: Workload, reps: int, target_tokens: int) -> list[list[int]]:
    """Batch indices of each repetition: consecutive batches worth >= target_tokens, rotating on."""
    n = len(workload.batches)
    per_batch = workload.num_tokens / n
    k = min(n, max(1, math.ceil(target_tokens / per_batch)))
    return [[(r * k + j) % n for j in range(k)] for r in range(reps)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_reps(run: Callable[[Any], Any], inputs: dict[int, Any], reps: list[list[int]],
              device: torch.device, time_budget_s: float = 30.0, min_reps: int = 2) -> list[float]:
    """Milliseconds of each repetition (CUDA events on a GPU, perf_counter on the CPU).

    Stops early, after `min_reps`, once the timed total passes `time_budget_s`.
    """
    out: list[float] = []
    spent = 0.0
    for r, idx in enumerate(reps):
        if r >= min_reps and spent > time_budget_s:
            break
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in idx:
                run(inputs[i])
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            for i in idx:
                run(inputs[i])
            ms = (time.perf_counter() - t0) * 1e3
        out.append(ms)
        spent += ms / 1e3
    return out


def median_ms(fn: Callable[[], Any], reps: int = 10, warmup: int = 3) -> float:
    """Median device time of one `fn()` call in ms (CUDA events, after `warmup` untimed calls)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def host_ms(fn: Callable[[], Any], reps: int = 10, warmup: int = 3) -> tuple[float, float]:
    """(median host enqueue ms, median enqueue + sync ms) of one eager `fn()` call: where the host
    time exceeds the device time, a batch is host bound."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    enq, tot = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        enq.append(t1 - t0)
        tot.append(time.perf_counter() - t0)
    return statistics.median(enq) * 1e3, statistics.median(tot) * 1e3


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()  # drop the previous system's tensors before releasing the cache
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> tuple[float | None, float | None]:
    """(peak reserved, peak allocated) in GiB since the last `reset_memory` (None on the CPU)."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_reserved(device) / 2**30, torch.cuda.max_memory_allocated(device) / 2**30


@contextmanager
def module_switches(where: dict[str, Any], switches: dict[str, Any]):
    """Set module-level kernel choices (`where[name]` is the module holding `name`) for the block,
    restored after it: how a benchmark variant of a system differs from the default."""
    old = {k: getattr(where[k], k) for k in switches}
    try:
        for k, v in switches.items():
            setattr(where[k], k, v)
        yield
    finally:
        for k, v in old.items():
            setattr(where[k], k, v)


# ---- systems and the runner ---------------------------------------------------------------------


class System:
    """One contender. Subclasses set `name` and implement setup / prepare / run / hidden."""

    name = "system"

    def setup(self) -> None:
        """Put weights on the device (not timed, not counted before the memory reset)."""

    def skip_reason(self, workload: Workload) -> str | None:
        """Why this system does not run `workload` (None: it runs)."""
        return None

    def prepare(self, batch: Batch) -> Any:
        """Host batch -> device inputs for `run` (outside the timed region)."""
        raise NotImplementedError

    def run(self, inputs: Any) -> Any:
        raise NotImplementedError

    def hidden(self, inputs: Any, out: Any) -> Tensor:
        """`run`'s output as (T, D) packed real tokens (for the parity probe)."""
        return out

    def info(self) -> dict[str, Any]:
        """Extras for the records (chosen kernels, compile mode, ...)."""
        return {}

    def close(self) -> None:
        """Drop device state."""


@dataclasses.dataclass
class BenchConfig:
    reps: int = 5
    target_tokens: int = 65536  # real tokens per timed repetition (at least one batch)
    time_budget_s: float = 20.0  # per (system, workload) timing; warm-up is extra
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cuda"))


def _short_error(e: BaseException) -> str:
    msg = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
    return msg[:300]


def run_system(system: System, workloads: list[Workload], cfg: BenchConfig, meta: dict[str, Any],
               probe: Batch | None = None) -> tuple[list[dict[str, Any]], Tensor | None]:
    """Time one system on every workload. A failure is recorded, never raised.

    Return: (records, probe hidden states (T, D) fp32 on the CPU or None).
    """
    dev = cfg.device
    records: list[dict[str, Any]] = []
    try:
        reset_memory(dev)
        t0 = time.perf_counter()
        system.setup()
        meta = {**meta, **system.info()}  # chosen kernels etc. go into every record of the system
        print(f"[{system.name}] setup {time.perf_counter() - t0:.1f}s {system.info() or ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - one broken system must not end the run
        traceback.print_exc()
        err = _short_error(e)
        print(f"[{system.name}] FAILED in setup: {err}", flush=True)
        system.close()
        return [make_record(system.name, w.name, None, None, status="failed", error=err, **meta)
                for w in workloads], None
    probe_out = None
    if probe is not None:
        try:
            with torch.inference_mode():
                inp = system.prepare(probe)
                probe_out = system.hidden(inp, system.run(inp)).float().cpu()
        except Exception as e:  # noqa: BLE001
            print(f"[{system.name}] probe failed: {_short_error(e)}", flush=True)
    for w in workloads:
        records.append(_run_one(system, w, cfg, meta))
    system.close()
    reset_memory(dev)
    return records, probe_out


def _run_one(system: System, w: Workload, cfg: BenchConfig, meta: dict[str, Any]) -> dict[str, Any]:
    dev = cfg.device
    reason = system.skip_reason(w)
    if reason:
        print(f"[{system.name}] {w.name}: skipped ({reason})", flush=True)
        return make_record(system.name, w.name, None, None, status="skipped", error=reason, **meta)
    inputs: dict[int, Any] = {}
    try:
        reset_memory(dev)
        reps = rotation(w, cfg.reps, cfg.target_tokens)
        with torch.inference_mode():
            inputs = {i: system.prepare(w.batch(i)) for i in sorted({i for r in reps for i in r})}
            t0 = time.perf_counter()
            for i in inputs:  # warm-up: every timed input once (compile, autotune, capture)
                system.run(inputs[i])
            _sync(dev)
            warm_s = time.perf_counter() - t0
            ms = time_reps(system.run, inputs, reps, dev, cfg.time_budget_s)
        reserved, allocated = peak_memory_gb(dev)
        rates = [sum(w.batch_tokens(i) for i in idx) / (t / 1e3) for idx, t in zip(reps, ms)]
        tps = statistics.median(rates)
        per_batch_ms = statistics.median(t / len(idx) for idx, t in zip(reps, ms))
        mem = "" if reserved is None else f", peak reserved {reserved:.2f} GB"
        print(f"[{system.name}] {w.name}: {tps / 1e3:,.0f}k tokens/s (median of {len(ms)}, "
              f"{per_batch_ms:.2f} ms/batch{mem}; warm-up {warm_s:.1f}s)", flush=True)
        return make_record(system.name, w.name, tps, reserved, status="ok", peak_allocated_gb=allocated,
                           ms_per_batch=per_batch_ms, reps=len(ms), warmup_s=warm_s,
                           batches_per_rep=len(reps[0]), **meta)
    except Exception as e:  # noqa: BLE001 - OOM, unsupported shape, compile failure ...
        traceback.print_exc()
        err = _short_error(e)
        print(f"[{system.name}] {w.name}: FAILED {err}", flush=True)
        return make_record(system.name, w.name, None, None, status="failed", error=err, **meta)
    finally:
        inputs.clear()
        reset_memory(dev)


def probe_report(probes: dict[str, Tensor | None], reference: str) -> dict[str, float | None]:
    """Min per-token cosine of each system's probe output against `reference`'s."""
    ref = probes.get(reference)
    out: dict[str, float | None] = {}
    for name, h in probes.items():
        if ref is None or h is None or h.shape != ref.shape:
            out[name] = None
        else:
            out[name] = float(torch.nn.functional.cosine_similarity(h, ref, dim=-1).min())
    return out
