"""Which attention plan on which pack. Backward: the two-pass split on token blocks (dQ, then dK/dV)
vs one launch of sequence-aligned programs (`attention.Aligned`: each program owns whole sequences,
so both passes run in it without atomics and no tile mixes rows of sequences another program owns).

    PYTHONPATH=. python -m benchmarks.attention_plan_probe --out DIR     # H100 / H200: ~2-3 min

bf16, H=12, K=64, the attention family's workloads (short ones first: the aligned plan serialises
a sequence's blocks in one program, so long sequences are there to show where it stops paying).
Each plan: its gradients against the split plan's (max abs difference over the gradients' max),
then the backward's device time (CUDA events around 10 queued calls, median of 7, plans
alternated over `--rounds` rounds) and one call's time from an idle GPU (host launch included).
The forward likewise: token blocks vs sequence-aligned programs (not on doc-64k).
Writes DIR/attention_plans_<gpu>.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

import torch

from benchmarks import attention as AB
from benchmarks import common

WORKLOADS = ("query-64k", "query-64k-window", "doc-b8", "doc-b8-window", "mid-64k", "mid-64k-window",
             "doc-64k-window", "doc-64k")


def plans() -> dict[str, object]:
    from packedenc.kernels.triton.attention import Aligned

    out: dict[str, object] = {"split": None}
    for starts in (32, 64, 128):
        for own, inner in ((64, 32), (64, 64), (32, 32)):
            for stages in (1, 2):
                out[f"aligned-{starts}-{own}x{inner}-s{stages}"] = Aligned(starts, own, inner, 4, stages)
    return out


def fwd_plans() -> dict[str, object]:
    from packedenc.kernels.triton.attention import Aligned

    out: dict[str, object] = {"split": None}
    for starts in (32, 64, 128):
        for own, inner in ((64, 32), (64, 64)):
            out[f"aligned-{starts}-{own}x{inner}-s2"] = Aligned(starts, own, inner, 4, 2)
    return out


def _forward(wl, q, k, v, cu, L, window, scale, rounds, meta, A) -> list[dict]:
    """The forward's plans on one workload: output against the split plan's, device and one-call ms."""
    ref = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True)[0].float()
    ps, rows, dev, one = fwd_plans(), [], {}, {}
    for name, plan in ps.items():
        try:
            err = ((A.attention_fwd(q, k, v, cu, L, window, scale, lse=True, tile=plan)[0].float() - ref).abs().max()
                   / ref.abs().max()).item()
        except Exception as e:  # noqa: BLE001 - printed, the probe goes on
            print(f"  {wl} forward {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        dev[name], one[name] = [], []
        rows.append({"workload": wl, "pass": "forward", "plan": name, "tiles": list(plan) if plan else
                     list(A.tiles(q.shape[0], L, window, q.shape[-1])), "rel_err_vs_split": err, **meta})
    for _ in range(rounds):
        for r in rows:
            fn = (lambda p=ps[r["plan"]]: A.attention_fwd(q, k, v, cu, L, window, scale, lse=True, tile=p))
            dev[r["plan"]].append(common.median_ms(fn, reps=7, warmup=2, calls=10))
            one[r["plan"]].append(common.median_ms(fn, reps=7, warmup=2, calls=1))
    base = statistics.median(dev["split"])
    for r in rows:
        r["fwd_device_ms"], r["fwd_one_call_ms"] = statistics.median(dev[r["plan"]]), statistics.median(one[r["plan"]])
        print(f"{wl:18s} fwd {r['plan']:20s} device {r['fwd_device_ms']:7.3f} ms ({r['fwd_device_ms'] / base:5.2f}x split)"
              f"  one call {r['fwd_one_call_ms']:7.3f}  err {r['rel_err_vs_split']:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    a = ap.parse_args(argv)
    from packedenc.kernels.triton import attention as A
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "commit": AB.commit(), "torch": torch.__version__,
            "command": " ".join(["python -m benchmarks.attention_plan_probe", *(argv if argv is not None else sys.argv[1:])])}
    print(f"# {meta['command']} on {gpu}, commit {meta['commit']}", flush=True)
    rows = []
    for wl in a.only.split(","):
        lens = AB.lengths(wl.removesuffix("-window"))
        window = AB.WINDOW if wl.endswith("-window") else (-1, -1)
        T, cu, L = sum(lens), AB._cu(lens), max(lens)
        q, k, v, do = (torch.randn(T, AB.H, AB.K, device="cuda").to(AB.BF16) for _ in range(4))
        scale = AB.K**-0.5
        if not wl.startswith("doc-64k"):  # the aligned forward serialises long sequences' blocks
            rows += _forward(wl, q, k, v, cu, L, window, scale, a.rounds, meta, A)
        o, lse = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True)
        default = A.bwd_tiles(T, L, window, AB.K)
        ref = attention_bwd(do, q, k, v, o, lse, cu, L, window, scale, tiles=None).float()
        ps = plans()
        if wl.startswith("doc-64k") or wl.startswith("mid-64k"):  # long sequences: a few plans only
            ps = {n: p for n, p in ps.items() if n == "split" or (n.endswith("-s2") and "-64x" in n)}
        err, dev, one = {}, {n: [] for n in ps}, {n: [] for n in ps}
        for name, plan in ps.items():
            try:
                g = attention_bwd(do, q, k, v, o, lse, cu, L, window, scale, tiles=plan).float()
                err[name] = ((g - ref).abs().max() / ref.abs().max()).item()
            except Exception as e:  # noqa: BLE001 - a plan that does not compile: printed, the probe goes on
                print(f"  {wl} {name}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                err[name] = None
        live = [n for n in ps if err[n] is not None]
        for _ in range(a.rounds):
            for name in live:
                fn = (lambda p=ps[name]: attention_bwd(do, q, k, v, o, lse, cu, L, window, scale, tiles=p))
                dev[name].append(common.median_ms(fn, reps=7, warmup=2, calls=10))
                one[name].append(common.median_ms(fn, reps=7, warmup=2, calls=1))
        base = statistics.median(dev["split"])
        for name in live:
            rec = {"workload": wl, "pass": "backward", "plan": name, "tiles": list(ps[name]) if ps[name] else [list(t) for t in default],
                   "tokens": T, "sequences": len(lens), "max_seqlen": L, "rel_err_vs_split": err[name],
                   "bwd_device_ms": statistics.median(dev[name]), "bwd_one_call_ms": statistics.median(one[name]),
                   "rounds_device_ms": dev[name], **meta}
            rows.append(rec)
            print(f"{wl:18s} {name:24s} device {rec['bwd_device_ms']:7.3f} ms ({rec['bwd_device_ms'] / base:5.2f}x split)"
                  f"  one call {rec['bwd_one_call_ms']:7.3f}  err {err[name]:.1e}", flush=True)
        del q, k, v, do, o, lse, ref
        torch.cuda.empty_cache()
    print("\n## fastest plan per workload (device ms)")
    for pass_, key in (("forward", "fwd_device_ms"), ("backward", "bwd_device_ms")):
        for wl in dict.fromkeys(r["workload"] for r in rows if r["pass"] == pass_):
            rs = sorted((r for r in rows if r["workload"] == wl and r["pass"] == pass_), key=lambda r: r[key])
            split = next(r for r in rs if r["plan"] == "split")
            print(f"{pass_:8s} {wl:18s} split {split[key]:7.3f}  best {rs[0]['plan']:24s} {rs[0][key]:7.3f}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tag = re.sub(r"[^a-z0-9]+", "-", re.sub(r"^nvidia ", "", gpu.lower())).strip("-")
    (out / f"attention_plans_{tag}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
