"""Where a DeBERTa band tile's time goes (H200 triage): the forward kernel launched directly with
each position term switched on or off, through the band loop (per-tile slots) or the saturated loop
(one slot per key range, NS-key tiles), with the shipped wide tiles (64 query x 32 key rows,
`deberta_fwd_wide.py`) or the 32 x 32 tiles, at the shipped launch options and a few others.
`python -m benchmarks.deberta_band_split` prints device ms and content TFLOP/s.

"none, band loop" is content-only attention run through the band loop (the position-term bounds
are kept, the terms are off), so the rows below it show what each term adds to a band tile.
"""

from __future__ import annotations

import torch

from benchmarks import common
from benchmarks.encode import MODELS
from packedenc.kernels.triton import deberta_attention as da
from packedenc.kernels.triton.deberta_slots import NO_SATURATION, saturation, slot_table

NARROW = dict(wide=False)  # the 32 x 32 tiles (`deberta_attention._fwd_kernel`)
VARIANTS = {
    "none, saturated loop": dict(c2p=False, p2c=False, band=False),
    "none, band loop": dict(c2p=False, p2c=False, band=True),
    "c2p": dict(c2p=True, p2c=False, band=True),
    "p2c": dict(c2p=False, p2c=True, band=True),
    "both (ships)": dict(c2p=True, p2c=True, band=True),
    "both, uncapped": dict(c2p=True, p2c=True, band=True, WIDE_MAXNREG=None),
    "both, p2c in 3 chunks": dict(c2p=True, p2c=True, band=True, WIDE_P2C=False),
    "both, fp32 position sum": dict(c2p=True, p2c=True, band=True, WIDE_POS_LOWP=False),
    "32x32: none, band loop": dict(c2p=False, p2c=False, band=True, **NARROW),
    "32x32: c2p": dict(c2p=True, p2c=False, band=True, **NARROW),
    "32x32: p2c": dict(c2p=False, p2c=True, band=True, **NARROW),
    "32x32: both": dict(c2p=True, p2c=True, band=True, **NARROW),
    "32x32: both, full c2p band": dict(c2p=True, p2c=True, band=True, reuse=False, **NARROW),
}


def launch(cfg, q, k, v, cu, L, pk, pq, c2p, p2c, band, block=32, wide=True, lowp=True, reuse=True, **options):
    """The shipped forward launcher (`deberta_attention.launch_fwd`, no lse) with each term switched on
    its own and this variant's launch options (`options`: module attributes of `deberta_attention`,
    e.g. WIDE_MAXNREG=None) set on the module; returns the output."""
    R = pk.shape[0]
    bounds = (saturation(cfg.position_buckets, cfg.max_relative, R, L, q.device) if band
              else (NO_SATURATION, -NO_SATURATION, 0, 0))
    switches = {"BLOCK_MAX": block, "WIDE_TILES": wide, "LOWP_GATHER": lowp, "C2P_REUSE": reuse, **options}
    with common.module_switches(dict.fromkeys(switches, da), switches):
        table = slot_table(cfg.position_buckets, cfg.max_relative, R, L, q.device)
        return da.launch_fwd(q, k, v, cu, L, pk, pq, table, bounds, cfg.scale, c2p=c2p, p2c=p2c,
                             store_lse=False)[0]


def main():
    dev = torch.device("cuda")
    cfg = MODELS["deberta-v3-base"].make_params(torch.float16).config
    H, K, R = cfg.num_attention_heads, cfg.head_dim, 2 * cfg.att_span
    g = torch.Generator(device=dev).manual_seed(0)
    doc = common.make_workload(common.DEBERTA_WORKLOADS["doc1k"], 100)
    pack = common.make_workload(common.DEBERTA_WORKLOADS["doc1k"], 100, budget_tokens=65536)
    cases = {"doc1k-b0": doc.batch(0).cu_seqlens, "doc1k-64k": pack.batch(0).cu_seqlens,
             "long8192": torch.tensor([0, 8192], dtype=torch.int32)}
    rows = []
    for name, cu in cases.items():
        cu = cu.to(dev)
        T, L = int(cu[-1]), int((cu[1:] - cu[:-1]).max())
        qkv = torch.randn(T, 3, H, K, device=dev, dtype=torch.float16, generator=g)
        pk, pq = (torch.randn(R, H, K, device=dev, dtype=torch.float16, generator=g) for _ in range(2))
        flops = 4 * H * K * float(((cu[1:] - cu[:-1]).double() ** 2).sum())
        for label, kw in VARIANTS.items():
            f = lambda: launch(cfg, qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, L, pk, pq, **kw)  # noqa: E731
            try:
                f()
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                print(f"{name} {label} failed: {type(e).__name__}: {str(e)[:160]}")
                continue
            ms = common.median_ms(f, reps=20)
            rows.append((name, label, ms, flops / ms / 1e9))
    print(f"{'case':10} {'variant':28} {'ms':>8} {'TFLOP/s (content)':>18}")
    for r in rows:
        print(f"{r[0]:10} {r[1]:28} {r[2]:8.3f} {r[3]:18.1f}", flush=True)


if __name__ == "__main__":
    main()
