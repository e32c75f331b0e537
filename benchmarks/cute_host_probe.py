"""The host cost of one CuteDSL GeGLU GEMM call, layer by layer, against the Triton entry (H200).

    python3 -m benchmarks.cute_host_probe --out gpu_out/cute_host_probe.json

Host us a call: `calls` back-to-back calls at T = 64 tokens (the kernel's device time is a few us,
so the loop's wall time is the host's), one sync at the end, median of 5 loops. Rows, from the
outside in: the op table's `linear_glu` (auto, cute, triton); the custom op (what a trace calls);
`geglu_gemm.geglu`; the compiled function alone (TVM-FFI: torch tensors in, torch's current stream)
with its output preallocated; `torch.empty` of the output. Then one call's time (host launch
included: `geglu-64k`'s metric) at 64k rows, and one call and queued calls at 4k and 16k through
the op table's cute and triton entries (where a short batch's host launch decides).
The first version of this probe (`history/cute_host_probe_h200_4eb58ae.json`) also timed the
pointer ABI the kernel had then (make_ptr objects and a stream object built per call).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks.records import git_commit, gpu_name, replace_text

D, FM = 768, 1152


def host_us(fn: Callable[[], Any], calls: int = 300, loops: int = 5) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(per)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.cute_host_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 2
    import packedenc as pe
    from benchmarks import common
    from benchmarks.cute_common import time_ms
    from packedenc.kernels.cute import geglu_gemm as G

    torch.manual_seed(0)
    w = torch.randn(2 * FM, D, device="cuda", dtype=torch.bfloat16) * 0.03
    xs = {T: torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for T in (64, 4096, 4097, 16384, 65536)}
    rows: list[dict[str, Any]] = []

    def row(name: str, value: float | None, unit: str = "host_us", **extra: Any) -> None:
        rows.append(dict(system=name, **{unit: value}, **extra))
        print(f"{name:44s} {unit} {value if value is None else round(value, 3)} {extra or ''}", flush=True)

    def guarded(name: str, fn: Callable[[], float], unit: str = "host_us") -> None:
        try:
            row(name, fn(), unit)
        except Exception as e:  # noqa: BLE001 - one failing variant leaves the others
            traceback.print_exc()
            row(name, None, unit, error=f"{type(e).__name__}: {e}"[:300])

    x = xs[64]
    with torch.no_grad():
        for backend in ("auto", "cute", "triton"):
            ops = pe.get_ops(backend, "cuda")
            guarded(f"ops[{backend}].linear_glu", lambda ops=ops: host_us(lambda: ops.linear_glu(x, w, None, "gelu")))
        guarded("torch.ops.packedenc.cute_linear_glu",
                lambda: host_us(lambda: torch.ops.packedenc.cute_linear_glu(x, w, "gelu")))
        guarded("geglu_gemm.geglu", lambda: host_us(lambda: G.geglu(x, w)))
        fn = G.compiled(torch.bfloat16, D, FM)
        out = torch.empty(64, FM, device="cuda", dtype=torch.bfloat16)
        ctas = torch.cuda.get_device_properties(x.device).multi_processor_count
        guarded("compiled fn, out preallocated", lambda: host_us(lambda: fn(x, w, out, ctas)))
        guarded("torch.empty (T, F)", lambda: host_us(lambda: torch.empty(64, FM, device="cuda", dtype=torch.bfloat16)))
        x64 = xs[65536]
        guarded("geglu-64k geglu_gemm.geglu one call", lambda: time_ms(lambda: G.geglu(x64, w)), "ms")
        guarded("geglu-64k ops[cute] one call", lambda: time_ms(
            lambda: pe.get_ops("cute", "cuda").linear_glu(x64, w, None, "gelu")), "ms")
        guarded("geglu-64k ops[triton] one call", lambda: time_ms(
            lambda: pe.get_ops("triton", "cuda").linear_glu(x64, w, None, "gelu")), "ms")
        for T in (4096, 16384):  # where auto's choice between them turns (host-bound small packs)
            for backend in ("cute", "triton"):
                ops = pe.get_ops(backend, "cuda")
                guarded(f"geglu-{T // 1024}k ops[{backend}] one call", lambda ops=ops, T=T: time_ms(
                    lambda: ops.linear_glu(xs[T], w, None, "gelu")), "ms")
                guarded(f"geglu-{T // 1024}k ops[{backend}] queued", lambda ops=ops, T=T: common.median_ms(
                    lambda: ops.linear_glu(xs[T], w, None, "gelu"), reps=5, warmup=1, calls=40), "ms")
    if a.out:
        doc = dict(gpu=gpu_name(torch.device("cuda")), commit=git_commit(),
                   command="python3 -m benchmarks.cute_host_probe", rows=rows)
        replace_text(a.out, json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
