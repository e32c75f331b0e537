"""Do Triton GEMMs pay in host-bound eager inference? cuBLAS (the table's `linear`, `linear_add`,
`linear_glu` today) vs `kernels/triton/gemm.py`, per GEMM and in whole eager forwards.

    PYTHONPATH=. python -m benchmarks.gemm_probe --out DIR      # H100 / H200: ~2 min

Per GEMM (bf16; ModernBERT-base `query` batches, T = 3,584: Wqkv, Wo + residual, Wi + GeGLU,
mlp Wo + residual; DeBERTa-v3-base `mnli`, T = 576, with biases: qkv, dense + residual, intermediate):
each Triton tile is first checked against the cuBLAS path (max abs difference, and the fp32
reference's error of both), then `host_us` is the median enqueue time of one call behind a GPU
sleep (what a host-bound batch pays) and `device_us` the CUDA-event time of 20 queued calls / 20.

Whole forwards (`--rounds` rounds alternating the tables): eager ModernBERT-base on `query`
batches and DeBERTa-v3-base on `mnli` batches, random bf16 weights, with the "auto" table and the
same table whose `linear` / `linear_add` / `linear_glu` take the Triton GEMM where it covers the
call (cuBLAS otherwise): tokens/s over the first batches and host / device ms of one batch
(`common.host_device_ms`), and the max difference of the outputs. Writes DIR/gemm_probe_<gpu>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from benchmarks import common, records

MB = dict(T=3584, D=768, F=1152)
DEB = dict(T=576, D=768, F=3072)
TILES = ((128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
         (64, 64, 64, 4, 4), (128, 256, 64, 8, 3))
GLU_TILES = ((128, 64, 64, 8, 3), (128, 64, 64, 4, 4), (64, 64, 64, 4, 4), (128, 128, 64, 8, 3),
             (64, 128, 64, 4, 3))


def _host_device_us(fn: Callable[[], Any], calls: int = 20, reps: int = 7) -> tuple[float, float]:
    host, dev = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        torch.cuda._sleep(common._sleep_cycles(5.0))
        fn()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        torch.cuda._sleep(common._sleep_cycles(1.0 + 2 * calls * host[-1] / 1e3))  # longer than the enqueue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()  # behind the sleep: the calls are queued before the GPU reaches them
        for _ in range(calls):
            fn()
        b.record()
        b.synchronize()
        dev.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(host), statistics.median(dev)


def _cases() -> list[tuple[str, int, int, int, bool, int]]:
    """(name, T, K, N, bias, epilogue)."""
    from packedenc.kernels.triton import gemm as G

    m, d = MB, DEB
    return [("mb-wqkv", m["T"], m["D"], 3 * m["D"], False, G.LINEAR),
            ("mb-wo+res", m["T"], m["D"], m["D"], False, G.ADD),
            ("mb-wi-glu", m["T"], m["D"], m["F"], False, G.GLU),
            ("mb-mlp-wo+res", m["T"], m["F"], m["D"], False, G.ADD),
            ("deb-qkv", d["T"], d["D"], 3 * d["D"], True, G.LINEAR),
            ("deb-dense+res", d["T"], d["D"], d["D"], True, G.ADD),
            ("deb-inter", d["T"], d["D"], d["F"], True, G.LINEAR),
            ("deb-out", d["T"], d["F"], d["D"], True, G.LINEAR)]


def per_gemm(run: dict[str, Any]) -> list[dict[str, Any]]:
    from packedenc.kernels import reference as R
    from packedenc.kernels.triton import gemm as G

    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for name, T, K, N, has_bias, ep in _cases():
        rows = 2 * N if ep == G.GLU else N
        x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
        w = (torch.randn(rows, K, device="cuda", generator=g) / K**0.5).bfloat16()
        b = torch.randn(rows, device="cuda", generator=g).bfloat16() if has_bias else None
        r = torch.randn(T, N, device="cuda", generator=g).bfloat16()
        f32 = [x.float(), w.float(), None if b is None else b.float()]
        if ep == G.LINEAR:
            cublas, want = (lambda: R.linear(x, w, b)), R.linear(*f32)
        elif ep == G.ADD:
            cublas, want = (lambda: R.linear_add(x, w, b, r)), R.linear_add(*f32, r.float())
        else:
            from packedenc.kernels.triton import linear_glu as LG  # today's entry: cuBLAS, then the gate kernel

            cublas, want = (lambda: LG.linear_glu(x, w, b, "gelu")), R.linear_glu(*f32, "gelu")
        base = cublas()
        h, d = _host_device_us(cublas)
        flop = 2 * T * K * rows
        out.append({**run, "case": name, "system": "cublas", "T": T, "K": K, "N": N, "host_us": h, "device_us": d,
                    "tflops": flop / d / 1e6, "err_vs_fp32": (base.float() - want).abs().max().item()})
        print(f"{name:14s} cublas          host {h:6.1f} us  device {d:7.2f} us  {flop / d / 1e6:6.0f} TF/s", flush=True)
        for t in GLU_TILES if ep == G.GLU else TILES:
            def tri(t=t):
                return G.gemm(x, w, b, ep, residual=r if ep == G.ADD else None, tile_=t)
            try:
                y = tri()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a tile that does not compile (shared memory)
                print(f"{name:14s} {t}: failed {type(e).__name__}", flush=True)
                continue
            h, d = _host_device_us(tri)
            rec = {**run, "case": name, "system": "triton", "tile": list(t), "default": tuple(t) == G.tile(T, N, K, ep),
                   "T": T, "K": K, "N": N, "host_us": h, "device_us": d, "tflops": flop / d / 1e6,
                   "err_vs_fp32": (y.float() - want).abs().max().item(),
                   "diff_vs_cublas": (y.float() - base.float()).abs().max().item()}
            out.append(rec)
            print(f"{name:14s} {str(t):22s} host {h:6.1f} us  device {d:7.2f} us  {rec['tflops']:6.0f} TF/s  "
                  f"err {rec['err_vs_fp32']:.3g} vs cublas {rec['diff_vs_cublas']:.3g}"
                  f"{' default' if rec['default'] else ''}", flush=True)
    return out


def _gemm_table(ops: Any, names: tuple[str, ...] = ("linear", "linear_add", "linear_glu")) -> Any:
    """`ops` whose GEMM ops `names` take the Triton kernel where it covers the call."""
    from packedenc.kernels.triton import gemm as G

    def routed(fast: Callable, covers: Callable, rest: Callable) -> Callable:
        return lambda *a, **k: fast(*a, **k) if covers(*a, **k) else rest(*a, **k)

    return dataclasses.replace(ops, **{n: routed(getattr(G, n), getattr(G, "covers_" + n), getattr(ops, n))
                                       for n in names})


def whole(run: dict[str, Any], rounds: int, only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    import packedenc as pe
    from packedenc.kernels import get_ops
    from packedenc.models import deberta, modernbert

    from benchmarks.workloads import DEBERTA_WORKLOADS, MODERNBERT_WORKLOADS, make_workload

    dev = torch.device("cuda")
    models = {
        "modernbert-query": (modernbert.ModernBertConfig(), MODERNBERT_WORKLOADS["query"]),
        "deberta-mnli": (deberta.PRESETS["v3-base"], DEBERTA_WORKLOADS["mnli"]),
    }
    out = []
    for name, (cfg, spec) in models.items():
        if only and name not in only:
            continue
        params = pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), dtype=torch.bfloat16), dev)
        w = make_workload(spec, cfg.vocab_size)
        batches = [w.batch(i) for i in range(12)]
        inputs = [(b.ids.to(dev), b.cu_seqlens.to(dev), b.max_seqlen) for b in batches]
        tokens = sum(b.num_tokens for b in batches)
        base = get_ops("auto", dev)
        tables = {"packedenc": base, "packedenc[triton-gemm]": _gemm_table(base),
                  "packedenc[triton-glu]": _gemm_table(base, ("linear_glu",))}
        res: dict[str, dict[str, list[float]]] = {k: {"tps": [], "host": [], "dev": []} for k in tables}
        outs = {}
        with torch.inference_mode():
            for sys_name, ops in tables.items():
                for x in inputs:
                    pe.encode(params, *x, backend=ops)
                outs[sys_name] = pe.encode(params, *inputs[0], backend=ops).float()
            for rnd in range(rounds):
                order = list(tables) if rnd % 2 == 0 else list(tables)[::-1]
                for sys_name in order:
                    ops = tables[sys_name]
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(3):
                        for x in inputs:
                            pe.encode(params, *x, backend=ops)
                    b.record()
                    b.synchronize()
                    res[sys_name]["tps"].append(3 * tokens / (a.elapsed_time(b) / 1e3))
                    hd = common.host_device_ms([lambda x=x: pe.encode(params, *x, backend=ops) for x in inputs[:3]], dev)
                    res[sys_name]["host"].append(hd["host_ms"])
                    res[sys_name]["dev"].append(hd["device_ms"])
        for sys_name, r in res.items():
            diff = (outs["packedenc"] - outs[sys_name]).abs().max().item()
            rec = {**run, "case": name, "system": sys_name, "tokens_per_s": statistics.median(r["tps"]),
                   "tokens_per_s_rounds": r["tps"], "host_ms": statistics.median(r["host"]),
                   "device_ms": statistics.median(r["dev"]), "max_diff_vs_packedenc": diff,
                   "tokens_per_batch": tokens / len(inputs)}
            out.append(rec)
            print(f"{name:17s} {sys_name:24s} {rec['tokens_per_s'] / 1e3:8.1f}k tok/s  host {rec['host_ms']:.2f} ms  "
                  f"device {rec['device_ms']:.2f} ms  diff {diff:.3g}  (rounds {', '.join(f'{v / 1e3:.0f}k' for v in r['tps'])})",
                  flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--skip-gemms", action="store_true")
    ap.add_argument("--models", nargs="*", default=(), help="modernbert-query, deberta-mnli (default both)")
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    gpu = records.gpu_name(dev)
    run = {"gpu": gpu, "commit": records.git_commit(), "torch": torch.__version__,
           "command": "python -m benchmarks.gemm_probe " + " ".join(argv if argv is not None else sys.argv[1:])}
    recs = [] if a.skip_gemms else per_gemm(run)
    recs += whole(run, a.rounds, tuple(a.models))
    path = Path(a.out) / f"gemm_probe_{records.gpu_slug(gpu)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    records.replace_text(path, json.dumps(recs, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
