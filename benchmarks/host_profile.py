"""Where the host time of one eager call goes, function by function (cProfile), for the calls issue
19 measures host-bound: DeBERTa-v3-base inference on `mnli` batches, ModernBERT-base inference on
`query` batches and a ModernBERT-base MLM training step on `doc-b8` and `doc` batches (packedenc's
eager step and the plain-torch one, `torch-packed`, side by side; the graphed step on `doc-b8`, whose
kernel table shows where its device time goes).

    python3 -m benchmarks.host_profile --out gpu_out/host_profile.txt        # H200: ~1 min
    python3 -m benchmarks.host_profile --tiny --device cpu                   # a CPU smoke run

For each case: the wall ms of one call in a loop (`loop_ms`: `calls` back-to-back calls of the
workload's batches, one sync at the end, so a host-bound loop reads its host time), then cProfile
over the same loop: the functions with the most own time (`tottime`) and the most time below them
(`cumtime`), both in microseconds per call of the case. Under cProfile the backward runs on the
calling thread (`set_multithreading_enabled(False)`), so its Python shows too. Each case also
reports the cyclic garbage collector's passes in the loop, the caching allocator's device allocations, frees and retries over the loop (each cudaFree
waits for the GPU) and the calls that made the host wait for the GPU in one call (torch's sync
debug mode), with the frames of ours that led there, and on a GPU torch.profiler's table of the
kernels of one pass over the batches (where the device time goes). The systems and batches are the benchmark
families' own (`benchmarks.encode`, `benchmarks.train`), with random weights.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common


class _GcTimer:
    """Collections by the cyclic garbage collector while active, and the ms they took."""

    def __init__(self) -> None:
        self.count, self.ms, self._t0 = [0, 0, 0], 0.0, 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count[info["generation"]] += 1
            self.ms += (time.perf_counter() - self._t0) * 1e3

    def __enter__(self) -> "_GcTimer":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)


def _loop(run: Callable[[Any], Any], inputs: list[Any], calls: int, device: torch.device) -> float:
    common.sync(device)
    t0 = time.perf_counter()
    for i in range(calls):
        run(inputs[i % len(inputs)])
    common.sync(device)
    return (time.perf_counter() - t0) / calls * 1e3


def _table(prof: cProfile.Profile, calls: int, key: str, top: int) -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    rows = []
    for (file, line, fn), (cc, nc, tt, ct, _) in st.stats.items():
        where = fn if file == "~" else f"{Path(file).parent.name}/{Path(file).name}:{line}({fn})"
        rows.append((tt if key == "tottime" else ct, nc, where))
    rows.sort(reverse=True)
    lines = [f"  {'us/call':>9}  {'n/call':>7}  function ({key})"]
    lines += [f"  {v / calls * 1e6:9.1f}  {n / calls:7.1f}  {w}" for v, n, w in rows[:top]]
    return "\n".join(lines)


_ALLOC_STATS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def _syncs(run: Callable[[Any], Any], x: Any, device: torch.device) -> list[str]:
    """Where one call makes the host wait for the GPU: torch's sync debug mode, each warning with
    the innermost frames of ours (packedenc, benchmarks) that led to it."""
    if device.type != "cuda":
        return []
    found: list[str] = []

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        text = str(message).splitlines()[0]
        if text.startswith("Synchronization debug mode is a prototype"):  # the mode's own notice, not a sync
            return
        ours = [f"{Path(f.filename).name}:{f.lineno}({f.name})" for f in traceback.extract_stack()
                if "packedenc" in f.filename or "benchmarks" in f.filename][-4:]
        found.append(f"{text[:90]} <- {' < '.join(reversed(ours))}")

    with warnings.catch_warnings():  # restores showwarning and the filters on exit
        warnings.simplefilter("always")
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(x)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return found


def _kernel_table(run: Callable[[Any], Any], inputs: list[Any], device: torch.device, top: int) -> str:
    """torch.profiler's table of the GPU work of one pass over the inputs, by self CUDA time: which
    kernels a call's device time goes to (the fixed cost of a training step, for one)."""
    from torch.profiler import ProfilerActivity, profile

    common.sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        for x in inputs:
            run(x)
        common.sync(device)
    table = p.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60)
    return f"  GPU work of {len(inputs)} calls, by self CUDA time:\n{table}"


def profile_case(name: str, system: Any, batches: list[Any], calls: int, device: torch.device, top: int,
                 workload: Any = None) -> str:
    system.setup()
    if workload is not None:  # a graphed system builds its graphs for the workload here
        system.skip_reason(workload)
    inputs = [system.prepare(b) for b in batches]
    grad = getattr(system, "grad", False)
    ctx = torch.enable_grad if grad else torch.inference_mode
    with ctx():
        for x in inputs:  # warm-up: compile, caches, allocator, graph capture (graphed: the 3rd use)
            for _ in range(getattr(system, "warmup_passes", 1) + 1):
                system.run(x)
        stats0 = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        with _GcTimer() as gct:
            loop_ms = _loop(system.run, inputs, calls, device)
        stats1 = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
        syncs = _syncs(system.run, inputs[0], device)
        kernels = _kernel_table(system.run, inputs, device, top) if device.type == "cuda" else ""
        prof = cProfile.Profile()
        common.sync(device)
        # the backward of CUDA tensors runs on autograd's device thread, which cProfile does not
        # see: run it on this one
        with torch.autograd.set_multithreading_enabled(False):
            prof.enable()
            prof_ms = _loop(system.run, inputs, calls, device)
            prof.disable()
    system.close()
    head = f"== {name}: loop {loop_ms:.3f} ms a call ({calls} calls), under cProfile {prof_ms:.3f} ms"
    alloc = "  allocator over the loop: " + ", ".join(f"{k} +{stats1.get(k, 0) - stats0.get(k, 0)}" for k in _ALLOC_STATS)
    alloc += f"; gc collections by generation {gct.count}, {gct.ms / calls:.3f} ms a call"
    sync = f"  host syncs in one call: {len(syncs)}" + "".join(f"\n    {w}" for w in syncs[:12])
    return "\n".join([head, alloc, sync, _table(prof, calls, "tottime", top), _table(prof, calls, "cumtime", top),
                      kernels, ""])


def cases(tiny: bool, device: torch.device, only: list[str] | None) -> list[tuple[str, Any, list[Any], Any]]:
    """(name, system, batches, workload for a graphed system's buckets or None) of each case."""
    from benchmarks import encode, train

    out = []
    want = lambda n: not only or n in only  # noqa: E731
    if want("deberta-mnli") or want("modernbert-query"):
        benches = encode._benches()
        args = argparse.Namespace(tiny=tiny, seed=0)
        for case, family, workload in (("deberta-mnli", "deberta", "mnli"), ("modernbert-query", "modernbert", "query")):
            if not want(case):
                continue
            bench = benches[family]
            params = bench.make_params(tiny, torch.float32 if tiny else bench.dtype)
            w = encode._workloads(bench, [workload], params.config.vocab_size, args)[0]
            system = next(s for s in bench.make_systems(params, device) if s.name == "packedenc")
            out.append((case, system, [w.batch(i) for i in range(min(8, len(w.batches)))], None))
    train_cases = [(f"{who}-train-{wl}", name, wl) for wl in ("doc-b8", "doc")
                   for who, name in (("modernbert", "packedenc"), ("torch-packed", "torch-packed"))]
    train_cases.append(("graphed-train-doc-b8", "packedenc+graphs", "doc-b8"))  # its kernels: the fixed cost
    if any(want(c) for c, _, _ in train_cases):
        bench = train.benches()["modernbert-base"]
        host = bench.make_params(tiny)
        args = argparse.Namespace(tiny=tiny, seed=0)
        dt = None if tiny else torch.bfloat16
        for case, name, wl in train_cases:
            if want(case):
                w = train.workloads(bench, [wl], host.config.vocab_size, args)[0]
                batches = [w.batch(i) for i in range(min(8, len(w.batches)))]
                system = next(s for s in bench.make_systems(host, device, dt) if s.name == name)
                out.append((case, system, batches, w if name == "packedenc+graphs" else None))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny models and batches (a CPU smoke run)")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--only", nargs="*", help="case names (default: all)")
    ap.add_argument("--out", help="also write the report to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    parts = [f"host_profile: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
             f"torch {torch.__version__}, commit {common_commit()}"]
    print(parts[0], flush=True)
    for name, system, batches, workload in cases(args.tiny, device, args.only):
        text = profile_case(name, system, batches, args.calls, device, args.top, workload)
        print(text, flush=True)
        parts.append(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(parts) + "\n")
    return 0


def common_commit() -> str:
    from benchmarks.records import git_commit

    return git_commit()


if __name__ == "__main__":
    sys.exit(main())
