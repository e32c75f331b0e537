"""The attention backward's two plans side by side, on the GPU: split (dQ pass, then dK/dV pass) vs
reduce (one dK/dV pass that also adds dq into an fp32 buffer, by TMA bulk reductions or by element
atomics), each over candidate dK/dV tiles.

    PYTHONPATH=. python -m benchmarks.attention_plans --out DIR          # H200: ~2-3 min

bf16, H=12, K=64, the attention family's seeded workloads (`benchmarks.attention.WORKLOADS`) and
two training batches: `doc-b32` (32 `doc` sequences, the train family's `doc` batch, ~15k tokens)
and `doc-b8`; each global and with the (64, 64) window.
1. Check: on a sub-pack of <= 4096 tokens, every plan's dq, dk, dv against the fp32 reference by
   the 2x rule (`attention.check`'s): a plan that fails is reported and not timed.
2. Time: the backward alone (`attention_bwd` after one forward), `calls` = 10 back to back between
   two CUDA events, median of 15 reps: device time per call, the host running ahead.
Writes DIR/attention_plans_<gpu>.json (records: workload, plan, tile, bwd_ms, default) and prints
the best tile of each plan against the split plan's default.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import attention as att
from benchmarks import common
from benchmarks.records import replace_text

PLANS = {"split": 0, "reduce-atomic": 1, "reduce-tma": 2}
TILES = {1: ((64, 64, 4, 2), (128, 64, 8, 2)),  # element atomics: lost before (attention_sweep_h200.json)
         2: ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 2), (128, 64, 8, 2), (128, 64, 8, 3),
             (128, 32, 4, 3), (128, 128, 8, 2))}
EXTRA = {"doc-b32": (32, 350, 0.7, 32, 2048)}
WORKLOADS = ("query-64k", "doc-64k", "long", "doc-b32", "doc-b8")


def _inputs(lens: list[int], seed: int = 1):
    T = sum(lens)
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(T, att.H, att.K, device="cuda", generator=g).to(att.BF16) for _ in range(4)]


def _bwd(plan: int, tiles, q, k, v, do, cu, L, window):
    from packedenc.kernels.triton import attention as A
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    scale = att.K**-0.5
    out, lse = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True)
    return out, lse, (lambda: attention_bwd(do, q, k, v, out, lse, cu, L, window, scale, tiles=tiles, reduce=plan))


def check(plan: int, tiles, lens: list[int], window) -> dict[str, Any]:
    from packedenc.kernels import reference
    from packedenc.kernels.reference import backward as reference_bwd

    sub = att.prefix_within(lens, 4096) or lens[:1]
    cu, L = att._cu(sub), max(sub)
    q, k, v, do = _inputs(sub)
    out, _, run = _bwd(plan, tiles, q, k, v, do, cu, L, window)
    got = run().unbind(0)
    f = [t.float() for t in (q, k, v, do)]
    ref = reference_bwd.varlen_attention_bwd(f[3], *f[:3], cu, window)
    plain = att._plain_bf16(q, k, v, do, cu, window)[1:]
    res: dict[str, Any] = {"check_ok": True}
    for name, a, r, b in zip(("dq", "dk", "dv"), got, ref, plain):
        e, base = (a.float() - r).abs().max().item(), (b.float() - r).abs().max().item()
        res[f"err_{name}"], res[f"err_plain_{name}"] = e, base
        res["check_ok"] &= math.isfinite(e) and e <= 2 * base + 1e-3 * max(1.0, r.abs().max().item())
    return res


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="")
    a = ap.parse_args(argv)
    import triton

    from packedenc.kernels.triton import attention as A

    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "commit": att.commit(), "torch": torch.__version__, "triton": triton.__version__,
            "command": " ".join(["python -m benchmarks.attention_plans", *(argv if argv is not None else sys.argv[1:])])}
    print(f"# attention_plans on {gpu}; torch {torch.__version__}, triton {triton.__version__}; {meta['commit']}", flush=True)
    recs: list[dict[str, Any]] = []
    names = [f"{w}{s}" for w in WORKLOADS for s in ("", "-window")]
    names = [n for n in names if not a.only or n in a.only.split(",")]
    for wl in names:
        base_name = wl.removesuffix("-window")
        lens = att.lengths(base_name, spec=EXTRA.get(base_name))
        window = att.WINDOW if wl.endswith("-window") else (-1, -1)
        T, cu, L = sum(lens), att._cu(lens), max(lens)
        dq_tile, kv_tile = A.bwd_tiles(T, L, window, att.K)
        q, k, v, do = _inputs(lens)
        for plan_name, plan in PLANS.items():
            for tile in ((kv_tile,) if plan == 0 else TILES[plan]):
                tiles = (dq_tile, tile)
                rec = {"workload": wl, "tokens": T, "sequences": len(lens), "plan": plan_name, "tile": list(tile),
                       "default": plan == 0, **meta}
                try:
                    rec.update(check(plan, tiles, lens, window))
                    if rec["check_ok"]:
                        _, _, run = _bwd(plan, tiles, q, k, v, do, cu, L, window)
                        rec["bwd_ms"] = common.median_ms(run, reps=15, warmup=3, calls=10)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is a record
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc(limit=2)
                recs.append(rec)
                ms = f"{rec['bwd_ms']:.3f} ms" if "bwd_ms" in rec else rec.get("error", "check FAILED")[:90]
                print(f"{wl:18s} {plan_name:14s} {str(tile):18s} {ms}", flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"attention_plans_{re.sub(r'[^a-z0-9]+', '-', re.sub(r'^nvidia ', '', gpu.lower())).strip('-')}.json"
    replace_text(path, json.dumps(recs, indent=1) + "\n")
    print("\n## best tile per plan, backward device ms (split = the table's default)")
    for wl in names:
        row = [wl]
        for plan_name in PLANS:
            rs = [r for r in recs if r["workload"] == wl and r["plan"] == plan_name and "bwd_ms" in r]
            if rs:
                b = min(rs, key=lambda r: r["bwd_ms"])
                row.append(f"{plan_name} {b['bwd_ms']:.3f} {tuple(b['tile'])}")
        print("  ".join(row))
    return recs


if __name__ == "__main__":
    main()
