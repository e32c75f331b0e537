"""The harness every benchmark family uses: seeded workloads, systems, timing, the runner.

Method (shared/DESIGN.md, "Performance method"):
- every system runs in one process on the same seeded workload and the same weights;
- a warm-up runs every timed input once, so compilation, autotuning and graph capture are never timed;
- throughput: each repetition runs consecutive batches worth >= `target_tokens` real tokens,
  rotating through the workload, between two CUDA events; the median repetition gives real
  (unpadded) `tokens_per_s` and wall `ms_per_batch`;
- host vs device (`host_device_ms`): the GPU is first kept busy (`torch.cuda._sleep`) so that the
  host enqueues a batch ahead of it (after one untimed call of the same batch, so the host is warm);
  the enqueue time is `host_ms`, the CUDA-event time of the batch's own work `device_ms`.
  host_ms > device_ms: the batch is host-bound;
- peak reserved memory is reset before each (system, workload) and read after its timing.

Workloads: `benchmarks/workloads.py`; records: `benchmarks/records.py`; the options every family
takes: `benchmarks/cli.py`.

Shapes: T packed tokens, S sequences, L padded length, F features.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import statistics
import time
import traceback
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from benchmarks.records import Run
from benchmarks.workloads import (  # noqa: F401 - one import for a family: the harness and its workloads
    BUDGET_TOKENS, DEBERTA_WORKLOADS, MODERNBERT_WORKLOADS, Batch, Workload, WorkloadSpec, make_workload,
    sample_lengths, workload_named,
)


# ---- timing and memory --------------------------------------------------------------------------


def rotation(workload: Workload, reps: int, target_tokens: int) -> list[list[int]]:
    """Batch indices of each repetition: consecutive batches worth >= target_tokens, rotating on."""
    n = len(workload.batches)
    k = min(n, max(1, math.ceil(target_tokens / (workload.num_tokens / n))))
    return [[(r * k + j) % n for j in range(k)] for r in range(reps)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_reps(run: Callable[[Any], Any], inputs: dict[int, Any], reps: list[list[int]],
              device: torch.device, time_budget_s: float = 30.0, min_reps: int = 2) -> list[float]:
    """Milliseconds of each repetition (CUDA events on a GPU, perf_counter on the CPU); stops
    after `min_reps` once the timed total passes `time_budget_s`."""
    out: list[float] = []
    for r, idx in enumerate(reps):
        if r >= min_reps and sum(out) / 1e3 > time_budget_s:
            break
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in idx:
                run(inputs[i])
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            for i in idx:
                run(inputs[i])
            out.append((time.perf_counter() - t0) * 1e3)
    return out


_CYCLES_PER_MS: list[float] = []  # torch.cuda._sleep's rate, measured once per process


def _sleep_cycles(ms: float) -> int:
    if not _CYCLES_PER_MS:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES_PER_MS.append(10_000_000 / max(start.elapsed_time(end), 1e-3))
    return int(ms * _CYCLES_PER_MS[0])


def host_device_ms(calls: Sequence[Callable[[], Any]], device: torch.device) -> dict[str, Any]:
    """Median host enqueue ms and device ms of one call of each of `calls` (one batch each).

    On a GPU each call starts behind a `torch.cuda._sleep` longer than its host time, so the CUDA
    events around it time its own kernels, not the host's gaps. The same call runs once just before,
    untimed, behind the same sleep: a call timed first after the wait ran on a cold host, up to 40%
    slower than in a loop (train doc-b8: 105 ms of host against 75.6 ms a batch). A call that waits
    for the GPU itself (a host sync inside) cannot get ahead: `host_syncs` is then True and its
    `host_ms` is the wall time of the call from an idle GPU. On the CPU `device_ms` is None.
    """
    host: list[float] = []
    dev: list[float] = []
    syncs = False
    for fn in calls:
        if device.type != "cuda":
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            continue
        sleep_ms, h, d = 20.0, 0.0, 0.0
        for _ in range(3):
            torch.cuda.synchronize(device)
            torch.cuda._sleep(_sleep_cycles(sleep_ms))
            t_warm = time.perf_counter()
            fn()  # warm: the host's caches and clocks as in a loop
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            fn()
            h = (time.perf_counter() - t0) * 1e3
            end.record()
            both = (time.perf_counter() - t_warm) * 1e3
            end.synchronize()
            d = start.elapsed_time(end)
            if both < 0.8 * sleep_ms:
                break
            sleep_ms = min(4 * both, 5000.0)  # the host caught up with the sleep: sleep longer
        else:
            syncs = True
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(device)
            h = (time.perf_counter() - t0) * 1e3
        host.append(h)
        dev.append(d)
    return {"host_ms": statistics.median(host) if host else None,
            "device_ms": statistics.median(dev) if dev else None, "host_syncs": syncs}


def median_ms(fn: Callable[[], Any], reps: int = 10, warmup: int = 3, calls: int = 1) -> float:
    """Median CUDA-event time in ms of one `fn()` call, after `warmup` untimed calls. With `calls`
    > 1 a rep queues that many calls back to back and counts its time per call (the device's
    time when the host runs ahead)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(calls):
            fn()
        e.record()
        torch.cuda.synchronize()
        ts.append(s.elapsed_time(e) / calls)
    return statistics.median(ts)


def reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()  # drop the previous system's tensors before releasing the cache
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> dict[str, float | None]:
    """Peak reserved and allocated GiB since the last `reset_memory` (None on the CPU)."""
    if device.type != "cuda":
        return {"peak_reserved_gb": None, "peak_allocated_gb": None}
    return {"peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30,
            "peak_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30}


# ---- systems and the runner ---------------------------------------------------------------------


class System:
    """One contender. Subclasses set `name` and implement setup / prepare / run (and `probe`)."""

    name = "system"
    optional = False  # run only when named in --systems
    grad = False  # runs autograd (training): no inference_mode around it
    warmup_passes = 1  # untimed runs of every timed input (more where a graph is captured on a later use)
    absent: str | None = None  # why it cannot run here (an optional package is not installed)

    def setup(self) -> None:
        """Put weights on the device (not timed, before the memory counters reset)."""

    def skip_reason(self, workload: Workload) -> str | None:
        """Why this system does not run `workload` (None: it runs)."""
        return None

    def prepare(self, batch: Batch) -> Any:
        """Host batch -> device inputs for `run` (outside the timed region)."""
        raise NotImplementedError

    def run(self, inputs: Any) -> Any:
        raise NotImplementedError

    def probe(self, inputs: Any) -> Tensor:
        """What the families compare across systems on one batch (default: `run`'s output)."""
        return self.run(inputs)

    def info(self) -> dict[str, Any]:
        """Extras for every record of the system (chosen kernels, compile mode, ...)."""
        return {}

    def extras(self) -> dict[str, Any]:
        """Extras for a workload's record, read after its timing (raising marks it failed)."""
        return {}

    def close(self) -> None:
        """Drop device state."""


class AbsentSystem(System):
    """A system whose package is not installed here: every workload is recorded 'absent'."""

    def __init__(self, name: str, reason: str) -> None:
        self.name, self.absent = name, reason


@dataclasses.dataclass
class BenchConfig:
    device: torch.device
    reps: int = 5
    target_tokens: int = 65536  # real tokens per timed repetition (at least one batch)
    time_budget_s: float = 20.0  # per (system, workload) timing; warm-up is extra
    host_batches: int = 5  # batches timed for host_ms / device_ms
    profile: bool = False  # print torch.profiler's top ops of one batch per (system, workload)


def _short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".strip().replace("\n", " ")[:300]


def _mode(system: System) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if system.grad else torch.inference_mode()


def run_system(system: System, workloads: list[Workload], cfg: BenchConfig, run: Run,
               probe: Batch | None = None, **fields: Any) -> tuple[list[dict[str, Any]], Tensor | None]:
    """Records of one system on every workload (failures recorded, never raised) and its probe
    output (fp32, CPU) on the `probe` batch. `fields` go into every record."""
    tag = f"[{fields.get('model', run.family)} {system.name}]"
    if system.absent:
        print(f"{tag} absent: {system.absent}", flush=True)
        return [run.record(system.name, w.name, "absent", error=system.absent, **fields) for w in workloads], None
    try:
        reset_memory(cfg.device)
        t0 = time.perf_counter()
        system.setup()
        fields = {**fields, **system.info()}
        print(f"{tag} setup {time.perf_counter() - t0:.1f}s {system.info() or ''}", flush=True)
    except Exception as e:  # noqa: BLE001 - one broken system must not end the run
        traceback.print_exc()
        print(f"{tag} FAILED in setup: {_short_error(e)}", flush=True)
        system.close()
        return [run.record(system.name, w.name, "failed", error=_short_error(e), **fields) for w in workloads], None
    probe_out = None
    if probe is not None:
        try:
            with torch.no_grad() if system.grad else torch.inference_mode():
                probe_out = system.probe(system.prepare(probe)).float().cpu()
        except Exception as e:  # noqa: BLE001
            print(f"{tag} probe failed: {_short_error(e)}", flush=True)
    records = [_run_one(system, w, cfg, run, tag, fields) for w in workloads]
    system.close()
    reset_memory(cfg.device)
    return records, probe_out


def _run_one(system: System, w: Workload, cfg: BenchConfig, run: Run, tag: str,
             fields: dict[str, Any]) -> dict[str, Any]:
    reason = system.skip_reason(w)
    if reason:
        print(f"{tag} {w.name}: skipped ({reason})", flush=True)
        return run.record(system.name, w.name, "skipped", error=reason, **fields)
    dev, inputs = cfg.device, {}
    try:
        reset_memory(dev)
        reps = rotation(w, cfg.reps, cfg.target_tokens)
        with _mode(system):
            inputs = {i: system.prepare(w.batch(i)) for i in sorted({i for r in reps for i in r})}
            t0 = time.perf_counter()
            for x in [*inputs.values()] * system.warmup_passes:  # warm-up: compile, autotune, capture
                system.run(x)
            sync(dev)
            warm_s = time.perf_counter() - t0
            ms = time_reps(system.run, inputs, reps, dev, cfg.time_budget_s)
            mem = peak_memory_gb(dev)
            firsts = list(dict.fromkeys(reps[0]))[: cfg.host_batches]
            hd = host_device_ms([lambda x=inputs[i]: system.run(x) for i in firsts], dev)
            if cfg.profile:
                profile_call(lambda: system.run(inputs[firsts[0]]), dev, f"{tag} {w.name}")
        extras = system.extras()
        tps = statistics.median(sum(w.batch_tokens(i) for i in idx) / (t / 1e3) for idx, t in zip(reps, ms))
        per_batch = statistics.median(t / len(idx) for idx, t in zip(reps, ms))
        gb = "" if mem["peak_reserved_gb"] is None else f", peak reserved {mem['peak_reserved_gb']:.2f} GB"
        dms = "" if hd["device_ms"] is None else f" / device {hd['device_ms']:.2f}"
        print(f"{tag} {w.name}: {tps / 1e3:,.1f}k tokens/s, {per_batch:.2f} ms/batch (host {hd['host_ms']:.2f}"
              f"{dms} ms{gb}; median of {len(ms)}; warm-up {warm_s:.1f}s)", flush=True)
        return run.record(system.name, w.name, tokens_per_s=tps, ms_per_batch=per_batch, **hd, **mem, reps=len(ms),
                          batches_per_rep=len(reps[0]), warmup_s=warm_s, **fields, **extras)
    except Exception as e:  # noqa: BLE001 - OOM, unsupported shape, compile failure ...
        traceback.print_exc()
        print(f"{tag} {w.name}: FAILED {_short_error(e)}", flush=True)
        return run.record(system.name, w.name, "failed", error=_short_error(e), **fields)
    finally:
        inputs.clear()
        reset_memory(dev)


# Per-pass figures: the median over passes is recorded, each pass's value in `<field>_passes`
_PASS_MEDIANS = ("tokens_per_s", "ms_per_batch", "host_ms", "device_ms")
_PASS_MAXIMA = ("peak_reserved_gb", "peak_allocated_gb")


def run_passes(systems: Sequence[System], passes: int, run_one: Callable[[System], tuple[list[dict[str, Any]], Any]]
               ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`run_one(system)` -> (records, probe) for every system, `passes` times, every other pass in
    reverse order; returns (one record per (system, workload), each system's first probe).

    A record's timings are the median over the passes (`<field>_passes` lists them in pass order),
    its peak memory the largest; a (system, workload) that did not run ok in every pass keeps the
    first such record (failed or skipped), never a figure from the passes that worked."""
    by_key: dict[tuple[str, str], list[dict[str, Any]]] = {}
    probes: dict[str, Any] = {}
    for p in range(passes):
        for system in (systems if p % 2 == 0 else list(reversed(systems))):
            if passes > 1:
                print(f"--- pass {p + 1}/{passes}: {system.name}", flush=True)
            recs, probe = run_one(system)
            probes.setdefault(system.name, probe)
            for r in recs:
                by_key.setdefault((r["system"], r["workload"]), []).append(r)
    order = {s.name: i for i, s in enumerate(systems)}
    merged = [_merge_passes(rs) for _, rs in sorted(by_key.items(), key=lambda kv: order.get(kv[0][0], len(order)))]
    return merged, probes


def _merge_passes(recs: list[dict[str, Any]]) -> dict[str, Any]:
    if len(recs) == 1:
        return recs[0]
    bad = [r for r in recs if r.get("status", "ok") != "ok"]
    if bad:
        return {**bad[0], "passes": len(recs)}
    out = {**recs[0], "passes": len(recs)}
    for f in _PASS_MEDIANS:
        vals = [r.get(f) for r in recs]
        if all(isinstance(v, (int, float)) for v in vals):
            out[f], out[f"{f}_passes"] = statistics.median(vals), vals
    for f in _PASS_MAXIMA:
        vals = [r.get(f) for r in recs if isinstance(r.get(f), (int, float))]
        if vals:
            out[f] = max(vals)
    return out


def profile_call(fn: Callable[[], Any], device: torch.device, title: str, top: int = 15) -> None:
    """torch.profiler's top ops of one `fn()` call: by self device time, then by self host time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        fn()
        sync(device)
    print(f"\n# profile: {title}")
    for key in (["self_cuda_time_total"] if device.type == "cuda" else []) + ["self_cpu_time_total"]:
        print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60), flush=True)


def probe_min_cos(probes: dict[str, Tensor | None], reference: str) -> dict[str, float | None]:
    """Min per-token cosine of each system's probe output against `reference`'s."""
    ref = probes.get(reference)
    out: dict[str, float | None] = {}
    for name, h in probes.items():
        ok = ref is not None and h is not None and h.shape == ref.shape
        out[name] = float(torch.nn.functional.cosine_similarity(h, ref, dim=-1).min()) if ok else None
    return out
