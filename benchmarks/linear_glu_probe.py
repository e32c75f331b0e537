"""Does the GeGLU gate in the GEMM's epilogue pay? `linear_glu` as its parts (cuBLAS writes u, the
Triton gate reads it back: `reference.compose_linear_glu` over the "auto" table's `linear` and `glu`)
vs one Triton GEMM (`kernels/triton/linear_glu.py`), alone and in whole ModernBERT-base forwards.

    PYTHONPATH=. python -m benchmarks.linear_glu_probe --out DIR      # H100 / H200: ~1.5 min

Alone (bf16, ModernBERT-base's Wi: D = 768, F = 1152; T = 3,584, a `query` batch, and 11,264, a
`doc` batch): each tile of `TILES` is checked against the parts (max abs difference), then
`host_us` is the enqueue time of one call behind a GPU sleep (what a host-bound batch pays) and
`device_us` the CUDA-event time of 20 calls queued behind a sleep, / 20 (medians of 7).
The same for mlp_norm + Wi + gate (`norm-wi-<T>`): the LayerNorm kernel then the fused GEMM vs the
GEMM normalising x on its way in, three tiles, each's error against the fp32 reference; and for
attn_norm + Wqkv (`norm-wqkv-<T>`, N = 3D): the op's parts (the LayerNorm kernel, then cuBLAS) vs
the ungated GEMM normalising x (`layer_norm_linear`) at `QKV_TILES`, and that GEMM without the norm
after the LayerNorm kernel (`ln+gemm`: what the plain projection costs on our GEMM).

Whole forwards (random bf16 weights, the "auto" table with `linear_glu` as its parts, or that table
with the fused GEMM wherever it covers the call, at its default tile, alternated over
`--rounds` rounds): eager on `query` batches, on `doc` sequences in batches of 8, 16 and 32 (`doc-b8`,
`doc-b16`, `doc`: where an eager batch turns from host-bound to device-bound), and `graphed` on `query`
batches: tokens/s over 12 batches x 3, host / device ms of one batch (`common.host_device_ms`), max
difference of the outputs. Systems `packedenc[glu-parts]` / `packedenc[glu-gemm]` /
`packedenc[glu-norm]` (the mlp norm inside the fused GEMM as well: `layer_norm_linear_glu`),
`packedenc[glu-norm+qkv]` (and the attention norm inside the Wqkv GEMM: `layer_norm_linear`) (eager),
`packedenc+graphs[...]` the same; the table's own choice (`auto`: the fused GEMM on small eager
packs only) is not one of them. Writes DIR/linear_glu_probe_<gpu>.json. (At 5346266 a third system,
`glu-gemm-n128`, ran the tile (128, 128, 64, 8, 3), since the default.)
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

D, F = 768, 1152
TILES = ((128, 128, 64, 8, 3), (128, 64, 64, 8, 3), (128, 64, 64, 8, 4), (64, 64, 64, 4, 4), (128, 64, 64, 4, 4))
QKV_TILES = ((128, 256, 64, 8, 3), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (64, 128, 64, 4, 4))


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


def _tables() -> dict[str, Any]:
    """The "auto" table with `linear_glu` as its parts (`glu-parts`); with the fused GEMM (at its
    default tile) wherever that covers the call, whatever the table's own rule (`glu-gemm`); and
    that with the mlp norm inside the fused GEMM too (`glu-norm`), and with the attention norm inside
    the Wqkv GEMM as well (`glu-norm+qkv`). `layer_norm_linear_glu` is the table's layer_norm then
    its linear_glu in the first two, `layer_norm_linear` the table's own entry but in the last."""
    from packedenc.kernels import get_ops, reference
    from packedenc.kernels.triton import glu
    from packedenc.kernels.triton import layer_norm_linear as LL
    from packedenc.kernels.triton import linear_glu as LG

    base = get_ops("auto", "cuda")
    qkv_parts = reference.compose_layer_norm_linear(base.layer_norm, base.linear)
    parts = reference.compose_linear_glu(base.linear, base.glu)

    def fused(tile: tuple[int, ...]) -> Callable:
        def linear_glu(x: Any, w: Any, b: Any = None, act: str = "gelu", **k: Any) -> Any:
            if LG.covers_linear_glu(x, w, b, act):
                return LG.linear_glu_fwd(x, w, b, glu._code(act), tile=tile)
            return parts(x, w, b, act, **k)
        return linear_glu

    gemm = fused(LG.TILE)
    norm_parts = reference.compose_layer_norm_linear_glu(base.layer_norm, gemm)

    def norm_fused(x: Any, nw: Any, nb: Any, eps: float, w: Any, b: Any = None, act: str = "gelu") -> Any:
        if LG.covers_layer_norm_linear_glu(x, nw, nb, eps, w, b, act):
            return LG.covered_layer_norm_linear_glu(x, nw, nb, eps, w, b, act)
        return norm_parts(x, nw, nb, eps, w, b, act)

    def qkv_fused(x: Any, nw: Any, nb: Any, eps: float, w: Any, b: Any = None) -> Any:
        if LL.covers_layer_norm_linear(x, nw, nb, eps, w, b):
            return LL.covered_layer_norm_linear(x, nw, nb, eps, w, b)
        return qkv_parts(x, nw, nb, eps, w, b)

    unfused = {"layer_norm_linear": qkv_parts}
    return {"glu-parts": dataclasses.replace(base, linear_glu=parts, layer_norm_linear_glu=(
                reference.compose_layer_norm_linear_glu(base.layer_norm, parts)), **unfused),
            "glu-gemm": dataclasses.replace(base, linear_glu=gemm, layer_norm_linear_glu=norm_parts, **unfused),
            "glu-norm": dataclasses.replace(base, linear_glu=gemm, layer_norm_linear_glu=norm_fused, **unfused),
            "glu-norm+qkv": dataclasses.replace(base, linear_glu=gemm, layer_norm_linear_glu=norm_fused,
                                                layer_norm_linear=qkv_fused)}


def alone(run: dict[str, Any]) -> list[dict[str, Any]]:
    from packedenc.kernels.triton import glu
    from packedenc.kernels.triton import linear_glu as LG

    parts = _tables()["glu-parts"].linear_glu
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for T in (3584, 11264):
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        w = (torch.randn(2 * F, D, device="cuda", generator=g) / D**0.5).bfloat16()
        flop = 2 * T * D * 2 * F
        with torch.inference_mode():
            base = parts(x, w, None, "gelu")
            h, d = _host_device_us(lambda: parts(x, w, None, "gelu"))
            out.append({**run, "workload": f"wi-{T}", "system": "glu-parts", "host_us": h, "device_us": d,
                        "tflops": flop / d / 1e6})
            print(f"Wi T={T:6d} parts             host {h:6.1f} us  device {d:7.2f} us  {flop / d / 1e6:5.0f} TF/s",
                  flush=True)
            for t in TILES:
                def fused(t: tuple = t) -> torch.Tensor:
                    return LG.linear_glu_fwd(x, w, None, glu._code("gelu"), tile=t)
                try:
                    y = fused()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory)
                    print(f"Wi T={T:6d} {t}: failed {type(e).__name__}", flush=True)
                    continue
                h, d = _host_device_us(fused)
                rec = {**run, "workload": f"wi-{T}", "system": "glu-gemm", "tile": list(t), "default": t == LG.TILE,
                       "host_us": h, "device_us": d, "tflops": flop / d / 1e6,
                       "max_diff_vs_parts": (y.float() - base.float()).abs().max().item()}
                out.append(rec)
                print(f"Wi T={T:6d} {str(t):18s} host {h:6.1f} us  device {d:7.2f} us  {rec['tflops']:5.0f} TF/s  "
                      f"diff {rec['max_diff_vs_parts']:.3g}{'  default' if rec['default'] else ''}", flush=True)
            out += _alone_norm(run, T, x, w, flop)
            out += _alone_qkv(run, T, x)
    return out


def _alone_qkv(run: dict[str, Any], T: int, x: torch.Tensor) -> list[dict[str, Any]]:
    """attn_norm + Wqkv (N = 3D): the op's parts (the table's LayerNorm, then cuBLAS), the LayerNorm
    then our ungated GEMM (`ln+gemm`), and that GEMM normalising x itself (`norm-gemm`) at each of
    `QKV_TILES`; max error of each against the fp32 reference."""
    from packedenc.kernels import get_ops, reference
    from packedenc.kernels.triton import linear_glu as LG

    base = get_ops("auto", "cuda")
    ln = base.layer_norm
    parts = reference.compose_layer_norm_linear(ln, base.linear)
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(3 * D, D, device="cuda", generator=g) / D**0.5).bfloat16()
    nw = (torch.rand(D, device="cuda", generator=g) + 0.5).bfloat16()
    xs = (x.float() * 2 + 0.5).bfloat16()
    flop = 2 * T * D * 3 * D
    want = reference.layer_norm_linear(xs.float(), nw.float(), None, 1e-5, w.float(), None)
    calls: list[tuple[str, Any, Callable[[], torch.Tensor]]] = [("parts", None, lambda: parts(xs, nw, None, 1e-5, w))]
    for t in QKV_TILES:
        calls.append(("ln+gemm", t, lambda t=t: LG.linear_glu_fwd(ln(xs, nw, None, 1e-5), w, None, None, tile=t)))
        calls.append(("norm-gemm", t, lambda t=t: LG.linear_glu_fwd(xs, w, None, None, tile=t, norm_weight=nw)))
    out = []
    for name, t, call in calls:
        try:
            y = call()
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory)
            print(f"norm+Wqkv T={T:6d} {name} {t}: failed {type(e).__name__}", flush=True)
            continue
        h, d = _host_device_us(call)
        rec = {**run, "workload": f"norm-wqkv-{T}", "system": name, "tile": None if t is None else list(t),
               "default": t == LG.TILE_LINEAR, "host_us": h, "device_us": d, "tflops": flop / d / 1e6,
               "max_err_vs_fp32": (y.float() - want).abs().max().item()}
        out.append(rec)
        print(f"norm+Wqkv T={T:6d} {name:10s} {str(t):18s} host {h:6.1f} us  device {d:7.2f} us  "
              f"{rec['tflops']:5.0f} TF/s  err {rec['max_err_vs_fp32']:.3g}", flush=True)
    return out


def _alone_norm(run: dict[str, Any], T: int, x: torch.Tensor, w: torch.Tensor, flop: float) -> list[dict[str, Any]]:
    """mlp_norm + Wi + gate: the table's LayerNorm then the fused GEMM, vs the GEMM normalising x
    itself (`glu-norm`), at the default tile and the next two of `TILES`; max difference of each
    against the fp32 reference (the parts' rounding of the normalised rows is in the first)."""
    from packedenc.kernels import get_ops, reference
    from packedenc.kernels.triton import glu
    from packedenc.kernels.triton import linear_glu as LG

    ln = get_ops("auto", "cuda").layer_norm
    nw = (torch.rand(D, device="cuda") + 0.5).bfloat16()
    xs = (x.float() * 2 + 0.5).bfloat16()  # a mean off zero, as a residual stream has
    want = reference.layer_norm_linear_glu(xs.float(), nw.float(), None, 1e-5, w.float(), None, "gelu")
    calls = {"ln+glu-gemm": lambda t: LG.linear_glu_fwd(ln(xs, nw, None, 1e-5), w, None, glu._code("gelu"), tile=t),
             "glu-norm": lambda t: LG.linear_glu_fwd(xs, w, None, glu._code("gelu"), tile=t, norm_weight=nw)}
    out = []
    for t in TILES[:3]:
        for name, call in calls.items():
            y = call(t)
            h, d = _host_device_us(lambda call=call, t=t: call(t))
            rec = {**run, "workload": f"norm-wi-{T}", "system": name, "tile": list(t), "default": t == LG.TILE,
                   "host_us": h, "device_us": d, "tflops": flop / d / 1e6,
                   "max_err_vs_fp32": (y.float() - want).abs().max().item()}
            out.append(rec)
            print(f"norm+Wi T={T:6d} {name:12s} {str(t):18s} host {h:6.1f} us  device {d:7.2f} us  "
                  f"err {rec['max_err_vs_fp32']:.3g}", flush=True)
    return out


def _mid() -> dict[str, Any]:
    """`doc` sequences in batches of 8 and 16 (~3.4k, ~6.7k tokens): where eager batches turn from
    host-bound to device-bound."""
    import dataclasses as dc

    from benchmarks.workloads import MODERNBERT_WORKLOADS
    return {f"doc-b{n}": dc.replace(MODERNBERT_WORKLOADS["doc"], name=f"doc-b{n}", batch_size=n) for n in (8, 16)}


def whole(run: dict[str, Any], rounds: int) -> list[dict[str, Any]]:
    import packedenc as pe
    from packedenc.cudagraphs import graphed
    from packedenc.models import modernbert

    from benchmarks.workloads import MODERNBERT_WORKLOADS, make_workload

    dev = torch.device("cuda")
    cfg = modernbert.ModernBertConfig()
    params = pe.tree_to(pe.init(cfg, torch.Generator().manual_seed(0), dtype=torch.bfloat16), dev)
    tables = _tables()
    MID = _mid()
    out = []
    specs = {**MODERNBERT_WORKLOADS, **MID}
    for workload, graphs in (("query", False), ("doc-b8", False), ("doc-b16", False), ("doc", False),
                             ("query", True)):
        w = make_workload(specs[workload], cfg.vocab_size)
        batches = [w.batch(i) for i in range(12)]
        inputs = [(b.ids.to(dev), b.cu_seqlens.to(dev), b.max_seqlen) for b in batches]
        tokens = sum(b.num_tokens for b in batches)
        prefix = "packedenc+graphs" if graphs else "packedenc"
        runs: dict[str, Callable] = {}
        for name, ops in tables.items():
            if graphs:
                ge = graphed(params, max_tokens=16384, max_seqs=256, backend=ops, max_graphs=64)
                runs[f"{prefix}[{name}]"] = lambda x, ge=ge: ge(*x)
            else:
                runs[f"{prefix}[{name}]"] = lambda x, ops=ops: pe.encode(params, *x, backend=ops)
        res = {k: {"tps": [], "host": [], "dev": []} for k in runs}
        outs = {}
        with torch.inference_mode():
            for name, fn in runs.items():
                for x in [*inputs, *inputs, *inputs]:  # warm-up: compile, capture
                    fn(x)
                outs[name] = fn(inputs[0]).float()
            for rnd in range(rounds):
                for name in (list(runs) if rnd % 2 == 0 else list(runs)[::-1]):
                    fn = runs[name]
                    torch.cuda.synchronize()
                    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    a.record()
                    for _ in range(3):
                        for x in inputs:
                            fn(x)
                    b.record()
                    b.synchronize()
                    res[name]["tps"].append(3 * tokens / (a.elapsed_time(b) / 1e3))
                    hd = common.host_device_ms([lambda x=x, fn=fn: fn(x) for x in inputs[:3]], dev)
                    res[name]["host"].append(hd["host_ms"])
                    res[name]["dev"].append(hd["device_ms"])
        first = next(iter(outs.values()))
        for name, r in res.items():
            rec = {**run, "workload": workload, "system": name, "tokens_per_s": statistics.median(r["tps"]),
                   "tokens_per_s_rounds": r["tps"], "host_ms": statistics.median(r["host"]),
                   "device_ms": statistics.median(r["dev"]), "tokens_per_batch": tokens / len(inputs),
                   "max_diff_vs_parts": (outs[name] - first).abs().max().item()}
            out.append(rec)
            print(f"{workload:6s} {name:30s} {rec['tokens_per_s'] / 1e3:8.1f}k tok/s  host {rec['host_ms']:.2f} ms  "
                  f"device {rec['device_ms']:.2f} ms  diff {rec['max_diff_vs_parts']:.3g}  "
                  f"(rounds {', '.join(f'{v / 1e3:.0f}k' for v in r['tps'])})", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=".")
    ap.add_argument("--rounds", type=int, default=8)
    a = ap.parse_args(argv)
    gpu = records.gpu_name(torch.device("cuda"))
    run = {"gpu": gpu, "commit": records.git_commit(), "torch": torch.__version__,
           "command": "python -m benchmarks.linear_glu_probe " + " ".join(argv if argv is not None else sys.argv[1:])}
    recs = alone(run) + whole(run, a.rounds)
    path = Path(a.out) / f"linear_glu_probe_{records.gpu_slug(gpu)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    records.replace_text(path, json.dumps(recs, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
