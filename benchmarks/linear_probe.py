"""Does a direct cuBLASLt call (`kernels/cublaslt.py`) take host time off eager short batches?

    python3 -m benchmarks.linear_probe --out gpu_out/linear_probe_h200.json     # CUDA only

Issue 19: eager DeBERTa `mnli` and ModernBERT `query` batches are host-bound, and a third of
DeBERTa's host time is its 49 `F.linear` calls (`history/host_profile_h200_*.txt`). Two parts:
1. op: at each GEMM shape of the two models' short batches (`mnli`: 640 rows, `query`: 3,600),
   host microseconds per call (`benchmarks.host_probe.host_us`: back-to-back calls, no sync) of
   `F.linear`, `cublaslt.linear` alone (`lt`), and through its covers rule (`lt+covers`, what the
   op table would run); the device time of each (CUDA events over queued calls) and whether the
   outputs are bit-identical to `F.linear`'s.
2. model: `encode` of DeBERTa-v3-base `mnli` and ModernBERT-base `query` (random weights, bf16,
   first batches of the workloads, eager, no grad): the auto table as it is (`packedenc`) vs the
   same table with `linear` served by cuBLASLt where `covers_linear` takes the call
   (`packedenc[linear=cublaslt]`); tokens/s as the best of `--passes` alternating passes (the
   host-bound batches drift between passes), host and device ms a batch (`common.host_device_ms`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks import common
from benchmarks.host_probe import host_us
from benchmarks.records import Run

BF16 = torch.bfloat16
SHAPES = {  # name: (rows, in, out, bias)
    "deberta-qkv-640": (640, 768, 2304, True), "deberta-o-640": (640, 768, 768, True),
    "deberta-up-640": (640, 768, 3072, True), "deberta-down-640": (640, 3072, 768, True),
    "modernbert-qkv-3600": (3600, 768, 2304, False), "modernbert-wi-3600": (3600, 768, 2304, False),
    "modernbert-qkv-64": (64, 768, 2304, False),
}


def _device_us(fn: Callable[[], Any], calls: int = 50) -> float:
    for _ in range(3):
        fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the calls queue behind it: their own time, not the host's
    s.record()
    for _ in range(calls):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / calls * 1e3


def part_op(run: Run) -> list[dict[str, Any]]:
    from packedenc.kernels import cublaslt

    records = []
    for name, (M, K, N, has_bias) in SHAPES.items():
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(M, K, device="cuda", generator=g).to(BF16)
        w = (torch.randn(N, K, device="cuda", generator=g) / math.sqrt(K)).to(BF16)
        b = torch.randn(N, device="cuda", generator=g).to(BF16) if has_bias else None
        with torch.inference_mode():
            ref = F.linear(x, w, b)
            assert cublaslt.covers_linear(x, w, b), name
            got = cublaslt.linear(x, w, b)
            fns = {"F.linear": lambda: F.linear(x, w, b), "lt": lambda: cublaslt.linear(x, w, b),
                   "lt+covers": lambda: cublaslt.linear(x, w, b) if cublaslt.covers_linear(x, w, b) else None}
            rec = dict(workload=name, rows=M, k=K, n=N, bias=has_bias, bit_identical=bool(torch.equal(ref, got)),
                       max_abs_diff=(ref.float() - got.float()).abs().max().item())
            for sys_name, fn in fns.items():
                rec[f"{sys_name}_host_us"] = host_us(fn, calls=200, rounds=9)
                rec[f"{sys_name}_device_us"] = _device_us(fn)
        records.append(run.record("probe", **rec))
        print(f"{name:22s} " + " ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in rec.items() if k.endswith(("_us", "identical"))), flush=True)
    return records


def _with_lt_linear(ops):
    from packedenc.kernels import cublaslt

    def linear(x, w, b=None):
        return cublaslt.linear(x, w, b) if cublaslt.covers_linear(x, w, b) else F.linear(x, w, b)

    return dataclasses.replace(ops, linear=linear)


def part_model(run: Run, passes: int = 3, batches: int = 4) -> list[dict[str, Any]]:
    import packedenc as pe
    from benchmarks.workloads import DEBERTA_WORKLOADS, MODERNBERT_WORKLOADS, workload_named
    from packedenc.models import deberta, modernbert
    from packedenc.models.deberta.config import PRESETS

    cases = {
        "deberta-mnli": (deberta.init(PRESETS["v3-base"], torch.Generator().manual_seed(0), dtype=BF16),
                         DEBERTA_WORKLOADS, "mnli"),
        "modernbert-query": (modernbert.init(modernbert.ModernBertConfig(), torch.Generator().manual_seed(0), dtype=BF16),
                             MODERNBERT_WORKLOADS, "query"),
    }
    records = []
    for case, (params, specs, wl_name) in cases.items():
        params = pe.tree_to(params, "cuda")
        wl = workload_named(wl_name, specs, params.config.vocab_size)
        inputs = [(b.ids.to("cuda"), b.cu_seqlens.to("cuda"), b.max_seqlen)
                  for b in (wl.batch(i) for i in range(min(batches, len(wl.batches))))]
        tokens = sum(int(i[0].numel()) for i in inputs)
        auto = pe.get_ops("auto", "cuda")
        tables = {"packedenc": auto, "packedenc[linear=cublaslt]": _with_lt_linear(auto)}
        fns = {s: functools.partial(pe.encode, params, backend=t) for s, t in tables.items()}
        best: dict[str, float] = {}
        hd: dict[str, dict] = {}
        with torch.inference_mode():
            outs = {s: fn(*inputs[0]) for s, fn in fns.items()}
            same = bool(torch.equal(*outs.values()))
            for k in range(passes):
                for s in (list(fns) if k % 2 == 0 else list(fns)[::-1]):
                    ms = sum(common.median_ms(lambda i=i: fns[s](*i), 7, 2) for i in inputs)
                    best[s] = min(ms, best.get(s, math.inf))
            for s, fn in fns.items():
                hd[s] = common.host_device_ms([functools.partial(fn, *i) for i in inputs], torch.device("cuda"))
        for s in fns:
            rec = dict(workload=case, batches=len(inputs), tokens=tokens, ms=best[s], tokens_per_s=tokens / best[s] * 1e3,
                       host_ms=hd[s]["host_ms"], device_ms=hd[s]["device_ms"],
                       passes=passes, bit_identical_to_auto=same)
            records.append(run.record(s, **rec))
            print(f"{case:18s} {s:28s} {rec['tokens_per_s'] / 1e3:8.1f}k tok/s  host {rec['host_ms']:.2f} ms  "
                  f"device {rec['device_ms']:.2f} ms a batch  identical {same}", flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.linear_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--passes", type=int, default=3)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    run = Run.start("linear_probe", torch.device("cuda"), argv or [])
    t0 = time.perf_counter()
    records = part_op(run)
    records += part_model(run, passes=a.passes)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(records, indent=1))
    print(f"{len(records)} records in {time.perf_counter() - t0:.0f}s -> {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
