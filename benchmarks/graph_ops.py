"""Parts of the graph transformer benchmark (benchmarks/graph.py): attention cores and readout
timed alone on a real batch, and a kernel profile of one training pass.

Shapes: T packed tokens, S sequences, H heads, K head dim, D width.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from benchmarks.common import median_ms
from packedenc.kernels import graph_attention as GA
from packedenc.kernels import reference


def attention_and_readout(b: dict[str, Any], H: int, K: int, dtype: torch.dtype = torch.bfloat16) -> list[dict[str, Any]]:
    """Device ms per call of each graph_attention core (forward; forward + backward) and of the
    readout (reference vs Triton) on batch `b`'s boundaries, plus attention TFLOP/s of real work."""
    dev, cu, M = b["cu"].device, b["cu"], b["max_seqlen"]
    T, D = b["tokens"], H * K
    lens = (cu[1:] - cu[:-1]).double()
    flops_fwd = 4.0 * float((lens**2).sum()) * H * K  # QK^T and PV over real (query, key) pairs
    g = torch.Generator(device=dev).manual_seed(0)
    qkv = torch.randn(T, 3, H, K, device=dev, dtype=dtype, generator=g).requires_grad_()
    do = torch.randn(T, H, K, device=dev, dtype=dtype, generator=g)
    rows: list[dict[str, Any]] = []

    def fwd(core: str) -> Callable[[], Any]:
        def run():
            with torch.no_grad():
                GA.graph_attention(qkv, None, None, cu, cu, M, M, core=core)
        return run

    def train(core: str) -> Callable[[], Any]:
        def run():
            o = GA.graph_attention(qkv, None, None, cu, cu, M, M, core=core)
            torch.autograd.grad(o, qkv, do)
        return run

    for core in GA.CORES:
        try:
            f, t = median_ms(fwd(core)), median_ms(train(core))
            rows.append(dict(part="attention", impl=core, fwd_ms=f, train_ms=t,
                             fwd_tflops=flops_fwd / f / 1e9, train_tflops=3.5 * flops_fwd / t / 1e9))
        except Exception as e:  # noqa: BLE001 - a core that fails here is reported, not fatal
            rows.append(dict(part="attention", impl=core, error=f"{type(e).__name__}: {e}"[:200]))

    # the token-block kernels' tiles (module constants), fwd alone and fwd + bwd
    from packedenc.kernels.triton import packed_attention as PA

    fwd_tiles = ((64, 32, 4, 2), (64, 64, 4, 3), (32, 32, 4, 2), (128, 64, 8, 3))
    bwd_tiles = ((64, 32, 8, 2), (64, 32, 4, 2), (32, 32, 4, 2), (64, 64, 8, 2), (128, 32, 8, 2))
    default = (PA.TILE_FWD, PA.TILE_BWD)
    try:
        for tf in fwd_tiles:
            PA.TILE_FWD = tf
            rows.append(dict(part="tile-fwd", impl=str(tf), fwd_ms=median_ms(fwd("triton")), train_ms=float("nan")))
        PA.TILE_FWD = default[0]
        for tb in bwd_tiles:
            PA.TILE_BWD = tb
            rows.append(dict(part="tile-bwd", impl=str(tb), fwd_ms=float("nan"), train_ms=median_ms(train("triton"))))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(part="tiles", impl="triton", error=f"{type(e).__name__}: {e}"[:200]))
    finally:
        PA.TILE_FWD, PA.TILE_BWD = default

    from packedenc.kernels.triton.graph_readout import graph_readout as triton_readout

    z = torch.randn(T, D, device=dev, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(1, 2 * D, device=dev, generator=g) / D**0.5).to(dtype).requires_grad_()
    bias = torch.zeros(1, device=dev, dtype=dtype).requires_grad_()
    gout = torch.randn(cu.numel() - 1, D, device=dev, dtype=dtype, generator=g)
    for name, fn in (("reference", reference.graph_readout), ("triton", triton_readout)):
        def rf(fn=fn):
            with torch.no_grad():
                fn(z, w, bias, cu, M)

        def rt(fn=fn):
            torch.autograd.grad(fn(z, w, bias, cu, M), (z, w, bias), gout)

        rows.append(dict(part="readout", impl=name, fwd_ms=median_ms(rf), train_ms=median_ms(rt)))
    return rows


def print_parts(rows: list[dict[str, Any]], T: int) -> None:
    print(f"\n# one batch alone (T={T}), bf16, device ms per call (median of 10)")
    print("part       impl                fwd ms   fwd TFLOP/s   fwd+bwd ms   fwd+bwd TFLOP/s")
    for r in rows:
        if "error" in r:
            print(f"{r['part']:10s} {r['impl']:18s}  {r['error']}")
            continue
        tf = lambda k: f"{r[k]:11.1f}" if k in r else "          -"  # noqa: E731
        print(f"{r['part']:10s} {r['impl']:18s} {r['fwd_ms']:7.3f}  {tf('fwd_tflops')}   {r['train_ms']:10.3f}"
              f"   {tf('train_tflops')}")
    att = [r for r in rows if r["part"] == "attention" and "error" not in r]
    if att:
        best = min(att, key=lambda r: r["train_ms"])
        print(f"# fastest attention core for training here: {best['impl']} (packedenc's default for "
              f"bf16 full layers: graph_attention.LOWP_CORE = {GA.LOWP_CORE!r}); token-block tiles: "
              f"TILE_FWD / TILE_BWD in kernels/triton/packed_attention.py")


def profile_pass(name: str, fn: Callable[[], None], top: int = 22) -> None:
    """Top CUDA kernels of one call of `fn` (a training pass), by self device time."""
    from torch.profiler import ProfilerActivity, profile

    fn()  # warm
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    print(f"\n# profile: {name}, one train-bf16 pass")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=70),
          flush=True)


def verdicts(by: dict[tuple[str, str], dict[str, Any]]) -> list[tuple[str, float, str, float, bool]]:
    """(target, value, comparison, bound, met) for the issue-6 targets; NaN where a record is missing."""

    def ratio(a: str, b: str, wl: str, key: str = "tokens_per_s") -> float:
        ra, rb = by.get((a, wl)), by.get((b, wl))
        if not ra or not rb or not ra.get(key) or not rb.get(key):
            return float("nan")
        return ra[key] / rb[key]

    pk, pad, at = "packedenc", "padded-sdpa", "packed-aten-efficient"
    rows = [
        ("train-bf16 packedenc / padded tok/s", ratio(pk, pad, "train-bf16"), ">=", 3.0),
        ("train-bf16 packedenc / aten-efficient tok/s", ratio(pk, at, "train-bf16"), ">=", 1.3),
        ("train-fp32 packedenc / padded tok/s", ratio(pk, pad, "train-fp32"), ">=", 2.0),
    ]
    for wl in ("fwd-fp32", "fwd-bf16", "train-fp32", "train-bf16"):
        rows.append((f"{wl} peak memory packedenc / padded", ratio(pk, pad, wl, "peak_reserved_gb"), "<=", 0.5))
    out = []
    for name, v, op, bound in rows:
        met = (v >= bound) if op == ">=" else (v <= bound)
        out.append((name, v, op, bound, bool(met) and v == v))
    return out


def print_verdicts(by: dict[tuple[str, str], dict[str, Any]]) -> None:
    print("\n# issue-6 targets")
    for name, v, op, bound, met in verdicts(by):
        print(f"{'ok    ' if met else 'MISSED'} {name:46s} {v:6.2f} ({op} {bound:g})")
