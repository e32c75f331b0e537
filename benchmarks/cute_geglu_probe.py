"""Check and time Tile configurations of the CuteDSL GeGLU GEMM at ModernBERT-base's 64k shape (H200).

    python3 -m benchmarks.cute_geglu_probe --out gpu_out/geglu_probe.json
    python3 -m benchmarks.cute_geglu_probe --tiles 128,128,4,1,1 128,64,6,1,1   # m,n,stages,cluster_m,cluster_n

x (65536, 768) bf16, weight (2304, 768), out (65536, 1152). Each tile is checked before it is timed:
the 2x rule against the fp32 reference on the first 8192 rows of the 64k output and on a ragged
T = 4097 (error <= 2 x that of the plain bf16 two-step + 1e-5 x scale). Time: CUDA events, median of
20 after 5 warm-up calls (the first compiles), one call (`ms`) and 40 queued (`stream_ms`), in
`--rounds` rounds over every system that checked out, the order reversed each round: the GPU's
clocks settle during a process, and in a single fixed-order pass the first system read 5-10% fast
(history/geglu_probe_h200_5217dc2_fused_ab.json); records keep each round and the medians. Rivals: `cublas-gemm` (F.linear alone, the floor of a
fused kernel), `torch` (F.linear, then F.gelu(a) * g) and `packedenc[triton]` (the op table's triton
entry: cuBLAS, then the Triton gate in place). Needs the cute extra and an sm90 GPU. A tile that
crashes the kernel leaves the CUDA context unusable: rerun without it (--tiles).
Shapes: T packed tokens, D hidden, F mlp width.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import median_ms
from benchmarks.records import git_commit, gpu_name, replace_text

T64K, D, FM = 65536, 768, 1152
# The default (persistent, clusters of 2 M tiles sharing the weight slabs); the same with one CTA a
# tile (`,0`: no cross-tile prefetch); no cluster; fewer stages; weight slabs multicast along N; narrow
# N tiles (two CTAs an SM fit: 264); wide N (255 registers, a few spilled bytes); one warp group.
TILES = ("128,128,4,2,1", "128,128,4,2,1,0", "128,128,4,1,1", "128,128,3,2,1", "128,128,4,1,2", "128,64,3,1,1,264",
         "128,192,3,1,1", "64,128,4,1,1")


def _err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[float, float, bool]:
    """(error, plain bf16 error, 2x rule holds) against the fp32 reference."""
    from packedenc.kernels import reference

    want = reference.linear_glu(x.float(), w.float(), None, "gelu")
    e = (out.float() - want).abs().max().item()
    base = (reference.linear_glu(x, w, None, "gelu").float() - want).abs().max().item()
    return e, base, e <= 2 * base + 1e-5 * max(1.0, want.abs().max().item())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m benchmarks.cute_geglu_probe", description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", nargs="+", default=list(TILES),
                    help="m,n,stages,cluster_m,cluster_n[,max_ctas] each; max_ctas: the persistent grid (default "
                         "one CTA an SM; 0: one CTA a tile, no cross-tile prefetch)")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds over every system, in alternating order")
    ap.add_argument("--out", type=Path, help="write the records here as JSON")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: the probe needs an sm90 GPU")
        return 2
    from packedenc.kernels import get_ops
    from packedenc.kernels.cute import geglu_gemm as G

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T64K, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(2 * FM, D, device="cuda", generator=g) * D**-0.5).to(torch.bfloat16)
    rows = slice(0, 8192)
    x_ragged = x[:4097]
    head = dict(workload="geglu-64k", shape=f"{T64K} x {D} -> 2 x {FM}", gpu=gpu_name(torch.device("cuda")),
                commit=git_commit(), command=" ".join([sys.argv[0].rsplit("/", 1)[-1], *(argv or sys.argv[1:])]))

    def plain() -> torch.Tensor:
        u_a, u_g = F.linear(x, w).chunk(2, -1)
        return F.gelu(u_a) * u_g

    tri = get_ops("triton", "cuda").linear_glu
    records, fns = [], []  # fns: (record, callable) of every system that checked out
    with torch.no_grad():
        for name, fn in (("cublas-gemm", lambda: F.linear(x, w)), ("torch", plain),
                         ("packedenc[triton]", lambda: tri(x, w, None, "gelu"))):
            records.append({**head, "system": name, "status": "ok"})
            fns.append((records[-1], fn))
        for spec in a.tiles:
            vals = [int(v) for v in spec.split(",")]
            m, n, stages, cm, cn = vals[:5]
            ctas = None if len(vals) < 6 else (vals[5] or 1 << 30)
            rec = {**head, "system": "packedenc[cute]", "tile": [m, n, stages, cm, cn], "max_ctas": ctas}
            try:
                tile = G.Tile(m, n, stages, (cm, cn))
                run = lambda tile=tile, ctas=ctas: G.geglu(x, w, tile, ctas)  # noqa: E731
                e, base, ok = _err(run()[rows], x[rows], w)
                e_r, base_r, ok_r = _err(G.geglu(x_ragged, w, tile, ctas), x_ragged, w)
                rec.update(status="ok" if ok and ok_r else "wrong", err=e, err_plain=base, err_ragged=e_r,
                           err_plain_ragged=base_r, smem_bytes=G.smem_bytes(tile))
                torch.cuda.synchronize()  # a faulting kernel fails here, inside its own record
                if ok and ok_r:
                    fns.append((rec, run))
            except Exception as ex:  # noqa: BLE001 - a failing tile is a record, not the end of the probe
                traceback.print_exc()
                rec.update(status="failed", error=f"{type(ex).__name__}: {ex}"[:300])
            records.append(rec)
        # Rounds over every system, the order reversed each round: the GPU's clocks settle during a
        # process (the first system timed read 5-10% fast), so one pass in a fixed order favours
        # whatever comes first. A record keeps each round's figures and their medians.
        for k in range(a.rounds):
            for rec, fn in (fns if k % 2 == 0 else fns[::-1]):
                rec.setdefault("ms_rounds", []).append(median_ms(fn, reps=20, warmup=5))
                rec.setdefault("stream_ms_rounds", []).append(median_ms(fn, reps=5, warmup=1, calls=40))  # queued
        for rec, _ in fns:
            rec["ms"], rec["stream_ms"] = statistics.median(rec["ms_rounds"]), statistics.median(rec["stream_ms_rounds"])
    gemm_ms = records[0]["ms"]
    print(f"\ngeglu-64k on {head['gpu']} (commit {head['commit']}): cuBLAS GEMM alone {gemm_ms:.3f} ms")
    print(f"{'system':18s} {'tile m,n,st,cm,cn':18s} {'ms':>7s} {'vs gemm':>8s} {'TFLOP/s':>8s}  check")
    flops = 2 * T64K * D * 2 * FM
    for r in records:
        tile = ",".join(map(str, r.get("tile", []))) or "-"
        tile += "" if r.get("max_ctas") is None else f" x{r['max_ctas'] if r['max_ctas'] < 1 << 30 else 'all'}"
        ms = r.get("ms")
        cells = f"{ms:7.3f} {ms / gemm_ms:8.2f} {flops / ms / 1e9:8.0f}" if ms else f"{'-':>7s} {'-':>8s} {'-':>8s}"
        check = "" if "err" not in r else (f"err {r['err']:.2e} (plain {r['err_plain']:.2e}), "
                                           f"ragged {r['err_ragged']:.2e}")
        stream = f" stream {r['stream_ms']:.3f}" if r.get("stream_ms") else ""
        stream += f" (rounds {' '.join(f'{v:.3f}' for v in r['stream_ms_rounds'])})" if r.get("stream_ms_rounds") else ""
        print(f"{r['system']:18s} {tile:18s} {cells}{stream}  {r['status']} {check} {r.get('error', '')}")
    if a.out:
        replace_text(a.out, json.dumps(records, indent=1))
        print(f"records: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
