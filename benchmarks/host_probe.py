"""Where eager host time goes: microseconds of host per call of each op ModernBERT's layer runs.

    python3 -m benchmarks.host_probe --out gpu_out/host_probe.json      # CUDA: the figures
    TRITON_INTERPRET=1 python3 -m benchmarks.host_probe --device cpu    # a CPU smoke run (meaningless times)

A short batch is host-bound: the GPU waits for the Python that launches its kernels. This probe
times that Python, op by op, at ModernBERT-base's widths on a tiny pack (64 tokens: the kernels
finish before the next call is made, so the time per call is the host's): `host_us` is the median
over rounds of (perf_counter around `calls` back-to-back calls) / calls, with no sync inside a
round. Rows:
- `triton-launch[n args]`: a Triton kernel that does nothing, called with 3 / 12 / 24 arguments:
  the cost of `JITFunction.run` alone (binding, specialisation key, launch); `triton-compiled[n
  args]` the compiled kernel's own launcher, `packedenc-launch[n args]` `kernels.triton._common.launch`
  (what every packedenc kernel goes through);
- `torch.*`: one plain torch op of the same kind (its dispatcher cost, the yardstick), and the
  CUDA-graph capture query `auto.uncaptured` asks (the one difference between the `auto` and
  forced `triton` tables without the cute extra);
- `ops.<op>[<backend>]`: each Ops-table entry of a ModernBERT layer as `encode` calls it, no grad;
  `...+grad`: the same with inputs that require grad (the eager autograd path; forward only);
- `layer[<backend>]`: one whole encoder layer (`models.modernbert` internals), and `encode` one
  pack through ModernBERT-base (22 layers) with `host_ms`.
Shapes: T tokens, D hidden, H heads, K head dim, F MLP width.
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
import torch.nn.functional as F

try:  # the nop kernels below resolve `tl` from this module's globals (Triton reads fn.__globals__)
    import triton.language as tl
except ImportError:  # the probe then fails its Triton rows with a clear message
    tl = None

D, H, K, F_MLP, T = 768, 12, 64, 1152, 64
EPS = 1e-5


def host_us(fn: Callable[[], Any], calls: int = 50, rounds: int = 7, sync: Callable[[], None] = lambda: None) -> float:
    """Median host microseconds per call of `fn` (see the module docstring)."""
    for _ in range(3):
        fn()
    sync()
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return statistics.median(out)


def _triton_rows(dev: torch.device) -> dict[str, Callable[[], Any]]:
    import triton

    @triton.jit
    def nop3(a, b, n, BLOCK: tl.constexpr):
        pass

    @triton.jit
    def nop12(a, b, c, d, e, f, n0, n1, n2, n3, n4, n5, BLOCK: tl.constexpr):
        pass

    @triton.jit
    def nop24(a, b, c, d, e, f, g, h, i, j, k, l, n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11,
              BLOCK: tl.constexpr):
        pass

    x = torch.empty(1024, device=dev)
    t, n = [x] * 12, [1024] * 12
    from packedenc.kernels.triton._common import launch

    rows = {
        "triton-launch[3 args]": lambda: nop3[(1,)](x, x, 1024, BLOCK=16),
        "triton-launch[12 args]": lambda: nop12[(1,)](*t[:6], *n[:6], BLOCK=16),
        "triton-launch[24 args]": lambda: nop24[(1,)](*t, *n, BLOCK=16),
    }
    if dev.type == "cuda":  # the compiled kernel launched by itself: what JITFunction.run adds on top
        c3, c24 = nop3[(1,)](x, x, 1024, BLOCK=16), nop24[(1,)](*t, *n, BLOCK=16)
        rows |= {
            "triton-compiled[3 args]": lambda: c3[(1, 1, 1)](x, x, 1024, 16),
            "triton-compiled[24 args]": lambda: c24[(1, 1, 1)](*t, *n, 16),
            "packedenc-launch[3 args]": lambda: launch(nop3, (1,), x, x, 1024, BLOCK=16),
            "packedenc-launch[24 args]": lambda: launch(nop24, (1,), *t, *n, BLOCK=16),
        }
    return rows


def _query_lengths() -> list[int]:
    """128 sequences of 12..36 tokens: the shape of the `query` workload (~3.1k tokens)."""
    return [int(n) for n in torch.randint(12, 37, (128,), generator=torch.Generator().manual_seed(0))]


def _op_rows(dev: torch.device, backend: str, dtype: torch.dtype, lengths: list[int] | None = None) -> dict[str, Callable[[], Any]]:
    """The ops of a layer on the tiny pack (default) or on a pack of `lengths` (rows named "@query")."""
    from packedenc.kernels import get_ops

    ops = get_ops(backend, dev)
    lens = lengths or [20, 30, T - 50]
    n_tok = sum(lens)
    g = torch.Generator(device=dev).manual_seed(0)
    r = lambda *s: torch.randn(*s, device=dev, generator=g).to(dtype)  # noqa: E731
    x, res, w = r(n_tok, D), r(n_tok, D), r(D)
    wqkv, wi = r(3 * D, D) * D**-0.5, r(2 * F_MLP, D) * D**-0.5
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    qkv = r(n_tok, 3, H, K)
    q, k, v = r(n_tok, H, K), r(n_tok, H, K), r(n_tok, H, K)
    u = r(n_tok, 2 * F_MLP)
    name = f"[{backend}]" + ("@query" if lengths else "")
    rows = {
        "ops.add_layer_norm" + name: lambda: ops.add_layer_norm(x, res, w, None, EPS),
        "ops.linear(Wqkv)" + name: lambda: ops.linear(x, wqkv, None),
        "ops.rotary" + name: lambda: ops.rotary(qkv, pos, 160000.0, with_v=True),
        "ops.rotary(overwrite)" + name: lambda: ops.rotary(qkv, pos, 160000.0, with_v=True, overwrite_input=True),
        "ops.rotary_attention" + name: lambda: ops.rotary_attention(qkv, pos, 160000.0, cu, max(lens)),
        "ops.varlen_attention" + name: lambda: ops.varlen_attention(q, k, v, cu, max(lens)),
        "ops.varlen_attention(window)" + name: lambda: ops.varlen_attention(q, k, v, cu, max(lens), window=(64, 64)),
        "ops.glu" + name: lambda: ops.glu(u, "gelu"),
        "ops.linear_glu" + name: lambda: ops.linear_glu(x, wi, None, "gelu"),
    }
    if lengths:
        rows["ops.linear(Wo)" + name] = lambda: ops.linear(x, wqkv[:D], None)
        return rows
    xg, resg, wg = (t.clone().requires_grad_() for t in (x, res, w))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    rows |= {
        "ops.add_layer_norm+grad" + name: lambda: ops.add_layer_norm(xg, resg, wg, None, EPS),
        "ops.varlen_attention+grad" + name: lambda: ops.varlen_attention(qg, kg, vg, cu, max(lens)),
    }
    return rows


def _torch_rows(dev: torch.device, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    x, w = torch.randn(T, D, device=dev, dtype=dtype), torch.randn(D, device=dev, dtype=dtype)
    wqkv = torch.randn(3 * D, D, device=dev, dtype=dtype)
    bqkv, out = torch.randn(3 * D, device=dev, dtype=dtype), torch.empty(T, 3 * D, device=dev, dtype=dtype)
    rows = {}
    if dev.type == "cuda":  # what auto's `uncaptured` shape class asks on every rotary_attention call
        from packedenc.kernels import auto

        rows = {"torch.cuda.is_current_stream_capturing": torch.cuda.is_current_stream_capturing,
                "auto.uncaptured": lambda: auto.uncaptured(x, x)}
    return rows | {
        "torch.empty": lambda: torch.empty(T, D, device=dev, dtype=dtype),
        "torch.add": lambda: x + x,
        "torch.layer_norm": lambda: F.layer_norm(x, (D,), w, None, EPS),
        "torch.linear(Wqkv)": lambda: F.linear(x, wqkv),
        # DeBERTa's and BERT's GEMMs carry a bias: what the bias and the output's allocation cost the
        # host (cuBLASLt's bias epilogue vs a plain GEMM; a preallocated output)
        "torch.linear(Wqkv, bias)": lambda: F.linear(x, wqkv, bqkv),
        "torch.addmm(bias, out=)": lambda: torch.addmm(bqkv, x, wqkv.t(), out=out),
        "torch.mm(out=)": lambda: torch.mm(x, wqkv.t(), out=out),
    }


def _model_rows(dev: torch.device, dtype: torch.dtype, backend: str, layers: int) -> dict[str, tuple[Callable, int]]:
    import packedenc as pe
    from packedenc.models import modernbert

    cfg = modernbert.ModernBertConfig(num_hidden_layers=layers)
    params = pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), dtype=dtype), dev)
    b = pe.pack([list(range(5, 5 + n)) for n in (20, 30, T - 50)], device=dev)
    query = pe.pack([list(range(5, 5 + n)) for n in _query_lengths()], device=dev)
    one = pe.tree_to(pe.init(modernbert.ModernBertConfig(num_hidden_layers=1), torch.Generator().manual_seed(0),
                             dtype=dtype), dev)
    return {
        f"encode(1 layer)[{backend}]": (
            lambda: pe.encode(one, b.ids, b.cu_seqlens, b.max_seqlen, b.positions, backend=backend), 1),
        f"encode({layers} layers)[{backend}]": (
            lambda: pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, b.positions, backend=backend), layers),
        f"encode(query 128 seqs, {layers} layers)[{backend}]": (
            lambda: pe.encode(params, query.ids, query.cu_seqlens, query.max_seqlen, query.positions, backend=backend),
            layers),
    }


def _trace(dev: torch.device, dtype: torch.dtype, backend: str, layers: int) -> str:
    """torch.profiler's table (host self time per op and CUDA API call) of 5 query encodes: which
    calls the host time of a short batch goes to."""
    from torch.profiler import ProfilerActivity, profile

    fn = next(f for n, (f, _) in _model_rows(dev, dtype, backend, layers).items() if n.startswith("encode(query"))
    with torch.no_grad():
        for _ in range(3):
            fn()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(5):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.host_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--backends", nargs="+", help="default: triton and reference on CUDA, auto on the CPU")
    ap.add_argument("--layers", type=int, default=22, help="ModernBERT layers for the encode row (22: base)")
    ap.add_argument("--out", type=Path, help="write the records here as JSON")
    ap.add_argument("--trace", type=Path, help="write torch.profiler's host table of one query encode here")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the probe's figures need one (`--device cpu` under TRITON_INTERPRET=1 smoke-tests it)")
        return 2
    from benchmarks.records import git_commit, gpu_name, replace_text

    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    calls, rounds = (50, 7) if dev.type == "cuda" else (2, 1)
    head = dict(family="host_probe", gpu=gpu_name(dev) if dev.type == "cuda" else "cpu", commit=git_commit(),
                device=str(dev), dtype=str(dtype).removeprefix("torch."), tokens=T,
                command=" ".join(["python3 -m benchmarks.host_probe", *(argv if argv is not None else sys.argv[1:])]))
    rows: dict[str, tuple[Callable, int]] = {}
    rows |= {n: (f, 1) for n, f in _triton_rows(dev).items()}
    rows |= {n: (f, 1) for n, f in _torch_rows(dev, dtype).items()}
    for backend in a.backends or (["triton", "reference"] if dev.type == "cuda" else ["auto"]):
        rows |= {n: (f, 1) for n, f in _op_rows(dev, backend, dtype).items()}
        rows |= {n: (f, 1) for n, f in _op_rows(dev, backend, dtype, _query_lengths()).items()}
        rows |= _model_rows(dev, dtype, backend, a.layers if dev.type == "cuda" else 1)
    records = []
    for name, (fn, per) in rows.items():
        try:
            with torch.no_grad() if "+grad" not in name else torch.enable_grad():
                us = host_us(fn, calls, rounds, sync)
            rec = {**head, "system": name, "status": "ok", "host_us": us, **({"host_us_per_layer": us / per} if per > 1 else {})}
        except Exception as e:  # noqa: BLE001 - one failing row is a record, not the end of the probe
            rec = {**head, "system": name, "status": "failed", "error": f"{type(e).__name__}: {e}"[:300]}
        records.append(rec)
        tail = f"{rec['host_us']:9.1f} us" if rec["status"] == "ok" else f"FAILED {rec['error'][:80]}"
        if rec.get("host_us_per_layer"):
            tail += f"  ({rec['host_us_per_layer']:.1f} us a layer)"
        print(f"{name:42s} {tail}", flush=True)
    if a.out:
        replace_text(a.out, json.dumps(records, indent=1))
    if a.trace:
        replace_text(a.trace, _trace(dev, dtype, (a.backends or ["triton" if dev.type == "cuda" else "auto"])[0],
                                     a.layers if dev.type == "cuda" else 1))
        print(a.trace.read_text()[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
