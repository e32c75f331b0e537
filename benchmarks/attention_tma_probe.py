"""Do TMA loads of the attention loops' tiles pay? Pointer loads (the default) vs the same kernels
with their loop tiles (forward: k, v; dQ pass: k, v; dK/dV pass: q, dO) read whole through TMA
descriptors, over a few tiles and pipeline depths each.

    PYTHONPATH=. python -m benchmarks.attention_tma_probe --out DIR     # H100 / H200: ~2 min
    PYTHONPATH=. python -m benchmarks.attention_tma_probe --out DIR --ab --rounds 4   # whole tile sets

bf16, H=12, K=64, the attention family's big packs (`long`, `doc-64k`, `mid-64k`, `doc-64k-window`)
and one short (`query-64k`). Every variant is first checked against the default tile (forward
output, LSE and the three gradients, max abs difference: TMA changes which masked elements are
loaded, never what they contribute, so 0 is expected), then each pass is timed alone (forward
without LSE; dQ pass varied with the default dK/dV tile and the other way round), variants
alternated over `--rounds` rounds, CUDA events around 10 queued calls (device time), median.
Writes DIR/attention_tma_<gpu>.json and prints one row per (workload, pass, tile).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import attention as AB
from benchmarks import common, records

FWD = ((128, 64, 8, 3), (128, 64, 8, 3, True), (128, 64, 8, 4, True), (128, 128, 8, 2, True),
       (128, 128, 8, 3, True), (64, 64, 4, 3, True), (128, 64, 4, 3, True))
DQ = ((64, 64, 4, 2), (64, 64, 4, 2, True), (64, 64, 4, 3, True), (64, 64, 4, 4, True),
      (128, 64, 8, 2, True), (128, 64, 8, 3, True), (64, 32, 4, 3, True), (128, 32, 8, 3, True))
DKDV = ((64, 32, 4, 2), (64, 32, 4, 2, True), (64, 32, 4, 3, True), (64, 32, 4, 4, True),
        (64, 64, 4, 2, True), (64, 64, 4, 3, True), (128, 32, 8, 3, True), (128, 64, 8, 2, True),
        (128, 32, 4, 3, True), (128, 32, 4, 5, True))
WORKLOADS = ("long", "doc-64k", "mid-64k", "doc-64k-window", "query-64k")
# --ab: whole tile sets (forward, dQ, dK/dV) on the global big packs, forward + backward alternated
PLANS = {"pointer": ((128, 64, 8, 3), (64, 64, 4, 2), (64, 32, 4, 2)),
         "pointer-fwd64": ((64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 2)),
         "tma": ((64, 64, 4, 3, True), (64, 64, 4, 3, True), (64, 32, 4, 2, True)),
         "tma-kv128": ((64, 64, 4, 3, True), (64, 64, 4, 3, True), (128, 32, 4, 3, True))}


def ab(rounds: int, meta: dict) -> list[dict]:
    """Each plan's forward (with LSE) + backward, device ms of 10 queued calls, plans alternated."""
    from packedenc.kernels.triton import attention as A
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    rows = []
    for wl in ("long", "doc-64k", "mid-64k"):
        q, k, v, do, cu, L, _, scale = AB.probe_case(wl)
        T, n_seqs = q.shape[0], cu.numel() - 1

        def step(plan):
            f, dq, kv = PLANS[plan]
            o, lse = A.attention_fwd(q, k, v, cu, L, (-1, -1), scale, lse=True, tile=f)
            return o, lse, attention_bwd(do, q, k, v, o, lse, cu, L, (-1, -1), scale, tiles=(dq, kv))

        ref = step("pointer")
        diffs = {p: max((a.float() - b.float()).abs().max().item() for a, b in zip(step(p), ref)) for p in PLANS}
        ms = {p: [] for p in PLANS}
        for _ in range(rounds):
            for p in PLANS:
                ms[p].append(common.median_ms(lambda p=p: step(p), reps=7, warmup=2, calls=10))
        base = statistics.median(ms["pointer"])
        for p in PLANS:
            m = statistics.median(ms[p])
            rows.append({"workload": wl, "pass": "fwd+bwd", "plan": p, "tiles": [list(t) for t in PLANS[p]], "ms": m,
                         "rounds_ms": ms[p], "max_diff_vs_pointer": diffs[p], "tokens": T, "sequences": n_seqs, **meta})
            print(f"{wl:10s} fwd+bwd {p:14s} {m:7.3f} ms  {m / base:5.3f}x  diff {diffs[p]:.2e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--ab", action="store_true", help="only the whole-plan A/B (PLANS)")
    a = ap.parse_args(argv)
    from packedenc.kernels.triton import attention as A
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "commit": AB.commit(), "torch": torch.__version__,
            "command": " ".join(["python -m benchmarks.attention_tma_probe", *(argv if argv is not None else sys.argv[1:])])}
    print(f"# {meta['command']} on {gpu}, commit {meta['commit']}", flush=True)
    rows = ab(a.rounds, meta) if a.ab else []
    for wl in [] if a.ab else a.only.split(","):
        q, k, v, do, cu, L, window, scale = AB.probe_case(wl)
        T, n_seqs = q.shape[0], cu.numel() - 1
        o, lse = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True)
        g = attention_bwd(do, q, k, v, o, lse, cu, L, window, scale)
        dq_t, kv_t = A.bwd_tiles(T, L, window, AB.K)
        fwd_t = A.tiles(T, L, window, AB.K)
        windowed = window[0] >= 0
        cases = {"fwd": [fwd_t, *FWD], "dq": [dq_t, *DQ], "dkdv": [kv_t, *DKDV]}
        for p, tiles in cases.items():
            fns, diffs = {}, {}
            for t in dict.fromkeys(tiles):  # the default first, once
                if windowed and t[1] > 64:
                    continue
                try:
                    if p == "fwd":
                        o2, l2 = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True, tile=t)
                        diffs[t] = max((o2.float() - o.float()).abs().max().item(), (l2 - lse).abs().max().item())
                        fns[t] = lambda t=t: A.attention_fwd(q, k, v, cu, L, window, scale, lse=False, tile=t)
                    else:
                        ts = (t, kv_t) if p == "dq" else (dq_t, t)
                        g2 = attention_bwd(do, q, k, v, o, lse, cu, L, window, scale, tiles=ts)
                        diffs[t] = (g2.float() - g.float()).abs().max().item()
                        fns[t] = lambda ts=ts: attention_bwd(do, q, k, v, o, lse, cu, L, window, scale, tiles=ts)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile: printed, the probe goes on
                    print(f"  {wl} {p} {t}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            ms = {t: [] for t in fns}
            for _ in range(a.rounds):
                for t, fn in fns.items():
                    ms[t].append(common.median_ms(fn, reps=7, warmup=2, calls=10))
            base = statistics.median(ms[tiles[0]])
            for t in fns:
                m = statistics.median(ms[t])
                rows.append({"workload": wl, "pass": p, "tile": list(t), "tma": len(t) > 4 and bool(t[4]),
                             "default": t == tiles[0], "ms": m, "rounds_ms": ms[t], "max_diff_vs_default": diffs[t],
                             "tokens": T, "sequences": n_seqs, **meta})
                print(f"{wl:15s} {p:4s} {str(t):26s} {m:7.3f} ms  {m / base:5.3f}x  diff {diffs[t]:.2e}", flush=True)
    records.replace_text(Path(a.out) / f"attention_tma_{records.gpu_slug(gpu)}.json", json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
