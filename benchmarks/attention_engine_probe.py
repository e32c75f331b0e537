"""Where the one-call attention forward + backward loses time against its kernels' device time.

    PYTHONPATH=. python3 -m benchmarks.attention_engine_probe --out DIR      # H200: ~1 min

`benchmarks.attention` times `autograd.grad(attention(q, k, v))` as one call between two CUDA
events, from an idle GPU; on short and windowed packs that call reads 0.2-0.35 ms more than its
kernels' device time (query-64k 1.09 vs 0.75 ms at f9e1be1). The kernels start late: the backward's
first launch waits for the host. This probe splits the call, per workload and system:

- `autograd`: the benchmark's call; `autograd[calling-thread]`: the same under
  `torch.autograd.set_multithreading_enabled(False)` (the engine runs the backward on the thread
  that asked for it instead of handing it to its CUDA device thread and waiting);
- `direct` (packedenc only): the forward and backward launchers called in a row, no autograd:
  the one-call time of the kernels with no framework in between;
- host stamps of the autograd call from its start (ms): the forward's return, the backward's entry
  into our launcher (on the engine's thread), the launcher's return and autograd.grad's return;
- `engine`: host latency of `autograd.grad` of a one-op CUDA graph (y = 2 x), both thread modes;
- `--train`: the eager ModernBERT-base training step (`make_step`, the train family's `packedenc`)
  on `doc-b8` and `query` batches, both thread modes alternated, wall ms a step.

Writes DIR/attention_engine_<gpu>.json (records: workload, system, variant, one_call_ms, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import attention as A
from benchmarks import common
from benchmarks.records import gpu_slug, replace_text

WORKLOADS = ("query-64k", "doc-64k-window", "doc-b8", "doc-64k")


def _inputs(wl: str):
    lens = A.lengths(wl.removesuffix("-window"))
    window = A.WINDOW if wl.endswith("-window") else (-1, -1)
    T, cu, L = sum(lens), A._cu(lens), max(lens)
    q, k, v, do = (torch.randn(T, A.H, A.K, device="cuda").to(A.BF16) for _ in range(4))
    return lens, window, cu, L, (q, k, v, do)


def _stamps(fn: Callable, leaves, do, cu, L, window, reps: int = 15) -> dict[str, float]:
    """Median host ms from the call's start to each point, with our backward launcher wrapped."""
    from packedenc.kernels.triton import attention_op

    marks: dict[str, float] = {}
    orig = attention_op._bwd_cuda

    def wrapped(*a):
        marks["bwd_enter"] = time.perf_counter()
        r = orig(*a)
        marks["bwd_return"] = time.perf_counter()
        return r

    attention_op._bwd_cuda = wrapped
    rows: dict[str, list[float]] = {}
    try:
        for i in range(reps + 3):
            marks.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*leaves, cu, L, window)
            t_f = time.perf_counter()
            torch.autograd.grad(out, leaves, do)
            t_g = time.perf_counter()
            torch.cuda.synchronize()
            if i < 3 or "bwd_enter" not in marks:
                continue
            for name, t in (("fwd_return", t_f), ("bwd_enter", marks["bwd_enter"]),
                            ("bwd_return", marks["bwd_return"]), ("grad_return", t_g)):
                rows.setdefault(name, []).append((t - t0) * 1e3)
    finally:
        attention_op._bwd_cuda = orig
    return {f"host_{k}_ms": statistics.median(v) for k, v in rows.items()}


def _engine_ms(threads: bool, reps: int = 50) -> float:
    x = torch.randn(1024, device="cuda", requires_grad=True)
    g = torch.ones(1024, device="cuda")
    ts = []
    with torch.autograd.set_multithreading_enabled(threads):
        for i in range(reps + 5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            torch.autograd.grad(x * 2, x, g)
            t = time.perf_counter() - t0
            if i >= 5:
                ts.append(t * 1e3)
    return statistics.median(ts)


def _train(rounds: int = 3, steps: int = 8, device: str = "cuda", tiny: bool = False) -> list[dict[str, Any]]:
    """Wall ms a step of the eager ModernBERT-base step, the thread modes alternated `rounds` times."""
    import types

    from benchmarks import train
    from benchmarks.train_systems import PackedencTrain

    bench = train.benches()["modernbert-base"]
    host = bench.make_params(tiny)
    ws = train.workloads(bench, ["doc-b8", "query"], host.config.vocab_size, types.SimpleNamespace(tiny=tiny, seed=0))
    system = PackedencTrain("packedenc", host, torch.device(device), torch.bfloat16 if device == "cuda" else None)
    system.setup()
    out = []
    for w in ws:
        batches = [system.prepare(w.batch(i)) for i in range(min(steps, len(w.batches)))]
        for b in batches[:3]:
            system.run(b)
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for threads in (True, False):
                with torch.autograd.set_multithreading_enabled(threads):
                    common.sync(system.device)
                    t0 = time.perf_counter()
                    for b in batches:
                        system.run(b)
                    common.sync(system.device)
                times[threads].append((time.perf_counter() - t0) * 1e3 / len(batches))
        for threads, ts in times.items():
            out.append({"workload": f"train-{w.name}", "system": "packedenc",
                        "variant": "step" + ("" if threads else "[calling-thread]"), "step_ms": statistics.median(ts),
                        "step_ms_rounds": ts, "tokens": sum(w.lengths[i] for b in w.batches[:len(batches)] for i in b) / len(batches)})
    system.close()
    return out


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    ap.add_argument("--train", action="store_true")
    a = ap.parse_args(argv)
    from packedenc.kernels.triton.attention import attention_fwd
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "commit": A.commit(), "torch": torch.__version__,
            "command": " ".join(["python3 -m benchmarks.attention_engine_probe", *(argv if argv is not None else sys.argv[1:])])}
    records: list[dict[str, Any]] = []
    for threads in (True, False):
        records.append({"workload": "y=2x", "system": "torch", "variant": "engine" + ("" if threads else "[calling-thread]"),
                        "host_ms": _engine_ms(threads), **meta})
    for wl in [w for w in WORKLOADS if not a.only or w in a.only.split(",")]:
        lens, window, cu, L, (q, k, v, do) = _inputs(wl)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        base = {"workload": wl, "tokens": sum(lens), "sequences": len(lens), **meta}
        for name, fn in A.systems().items():
            def call():
                torch.autograd.grad(fn(*leaves, cu, L, window), leaves, do)

            for threads in (True, False):
                variant = "autograd" + ("" if threads else "[calling-thread]")
                with torch.autograd.set_multithreading_enabled(threads):
                    rec = {"system": name, "variant": variant, **base, "one_call_ms": common.median_ms(call, 15, 3),
                           "queued_ms": common.median_ms(call, 5, 3, calls=5)}
                    rec.update(common.host_device_ms([call] * 3, torch.device("cuda")))
                    if name == "packedenc":
                        rec.update(_stamps(fn, leaves, do, cu, L, window))
                records.append(rec)
        scale = A.K ** -0.5

        def direct():
            o, lse = attention_fwd(q, k, v, cu, L, window, scale, lse=True)
            attention_bwd(do, q, k, v, o, lse, cu, L, window, scale)

        rec = {"system": "packedenc", "variant": "direct", **base, "one_call_ms": common.median_ms(direct, 15, 3),
               "queued_ms": common.median_ms(direct, 5, 3, calls=5)}
        rec.update(common.host_device_ms([direct] * 3, torch.device("cuda")))
        records.append(rec)
    records += [{**r, **meta} for r in (_train() if a.train else [])]
    cols = ("one_call_ms", "queued_ms", "step_ms", "host_ms", "device_ms", "host_fwd_return_ms", "host_bwd_enter_ms",
            "host_bwd_return_ms", "host_grad_return_ms")
    print(f"# {gpu}, commit {meta['commit']}")
    print(f"{'workload':15s} {'system':12s} {'variant':26s} " + " ".join(f"{c.removesuffix('_ms').removeprefix('host_'):>11s}" for c in cols))
    for r in records:
        print(f"{r['workload']:15s} {r['system']:12s} {r['variant']:26s} "
              + " ".join(f"{r[c]:11.3f}" if isinstance(r.get(c), float) else f"{'':11s}" for c in cols))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    replace_text(out / f"attention_engine_{gpu_slug(gpu)}.json", json.dumps(records, indent=1) + "\n")
    return records


if __name__ == "__main__":
    main()
