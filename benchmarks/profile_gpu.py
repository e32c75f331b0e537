"""Where the time goes (H200 triage): host enqueue vs device time of one DeBERTa eager batch (host),
the forward kernel over 16 doc1k batches in grid order vs longest first and 16 eager encodes'
host vs wall time (batches), the disentangled-attention kernel alone on doc1k / long shapes
(kernel), and the top CUDA kernels of one training step of each model (train).
`python -m benchmarks.profile_gpu [--parts host batches kernel train]`."""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import packedenc as pe
from benchmarks import common


def _top(prof, key, n=18):
    print(prof.key_averages().table(sort_by=key, row_limit=n, max_name_column_width=60), flush=True)


def deberta_host(dev):
    from benchmarks.encode import MODELS

    params = pe.tree_to(MODELS["deberta-v3-base"].make_params(torch.float16), dev)
    cfg = params.config
    for wname in ("mnli", "doc1k"):
        w = common.make_workload(common.DEBERTA_WORKLOADS[wname], cfg.vocab_size)
        b = w.batch(0)
        ids, cu = b.ids.to(dev), b.cu_seqlens.to(dev)
        run = lambda: pe.encode(params, ids, cu, b.max_seqlen)  # noqa: E731
        with torch.inference_mode():
            enq, tot = common.host_ms(run)
            print(f"deberta {wname} batch0 T={ids.numel()} L={b.max_seqlen}: enqueue {enq:.2f} ms, total {tot:.2f} ms",
                  flush=True)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            _top(prof, "self_cpu_time_total", 14)
            _top(prof, "self_cuda_time_total", 10)


def deberta_batches(dev, n=16):
    """doc1k batches 0..n-1: the forward kernel alone in grid order vs longest first (sum of device
    ms), then whole eager encodes of the n batches: host enqueue vs wall (is the batch host-bound?)."""
    import time

    from benchmarks.encode import MODELS
    from packedenc.kernels.triton import deberta_attention as da
    from packedenc.packing import longest_first

    params = pe.tree_to(MODELS["deberta-v3-base"].make_params(torch.float16), dev)
    cfg = params.config
    H, K, R = cfg.num_attention_heads, cfg.head_dim, 2 * cfg.att_span
    w = common.make_workload(common.DEBERTA_WORKLOADS["doc1k"], cfg.vocab_size)
    g = torch.Generator(device=dev).manual_seed(0)
    pk, pq = (torch.randn(R, H, K, device=dev, dtype=torch.float16, generator=g) for _ in range(2))
    total = {"grid order": 0.0, "longest first": 0.0}
    ins = [(b.ids.to(dev), b.cu_seqlens.to(dev), b.max_seqlen) for b in (w.batch(i) for i in range(n))]
    for _, cu, L in ins:
        qkv = torch.randn(int(cu[-1]), 3, H, K, device=dev, dtype=torch.float16, generator=g)
        for label, order in (("grid order", None), ("longest first", longest_first(cu))):
            f = lambda: da.deberta_attention_fwd(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu, L, pk, pq,  # noqa: E731
                                                 cfg.position_buckets, cfg.max_relative, cfg.scale,
                                                 store_lse=False, seq_order=order)
            f()
            total[label] += common.median_ms(lambda: [f() for _ in range(10)]) / 10  # launches overlap
    print(f"deberta fwd kernel, doc1k batches 0-{n - 1}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in total.items()))
    with torch.inference_mode():
        for a in ins:
            pe.encode(params, *a)
        for rep in range(3):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for a in ins:
                pe.encode(params, *a)
            t1 = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
            tokens = sum(int(a[1][-1]) for a in ins)
            print(f"deberta eager, {n} doc1k batches: host enqueue {1e3 * (t1 - t0):.1f} ms, wall {ms:.1f} ms, "
                  f"{tokens / ms:.0f}k tokens/s", flush=True)


def deberta_kernel(dev):
    from packedenc.kernels.triton import deberta_attention as da
    from packedenc.kernels.triton import deberta_attention_bwd as db
    from packedenc.kernels import get_ops
    from benchmarks.encode import MODELS

    cfg = MODELS["deberta-v3-base"].make_params(torch.float16).config
    H, K, R = cfg.num_attention_heads, cfg.head_dim, 2 * cfg.att_span
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    doc = common.make_workload(common.DEBERTA_WORKLOADS["doc1k"], 100)
    pack = common.make_workload(common.DEBERTA_WORKLOADS["doc1k"], 100, budget_tokens=65536)
    cases = {"doc1k-b0": doc.batch(0).cu_seqlens, "doc1k-64k": pack.batch(0).cu_seqlens,
             "long8192": torch.tensor([0, 8192], dtype=torch.int32)}
    ops = get_ops("flash", dev)
    for name, cu in cases.items():
        cu = cu.to(dev)
        T, L = int(cu[-1]), int((cu[1:] - cu[:-1]).max())
        qkv = torch.randn(T, 3, H, K, device=dev, dtype=torch.float16, generator=g)
        pk = torch.randn(R, H, K, device=dev, dtype=torch.float16, generator=g)
        pq = torch.randn(R, H, K, device=dev, dtype=torch.float16, generator=g)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        flops = 4 * H * K * float(((cu[1:] - cu[:-1]).double() ** 2).sum())
        args = (q, k, v, cu, L, pk, pq, cfg.position_buckets, cfg.max_relative, cfg.scale)

        def timed(label, f, mult=1.0):
            ms = common.median_ms(f)
            rows.append((name, label, ms, mult * flops / ms / 1e9))

        for lowp in (False, True):  # band scores gathered in fp32 vs fp16 (`LOWP_GATHER`; True ships)
            with common.module_switches({"LOWP_GATHER": da}, {"LOWP_GATHER": lowp}):
                f = lambda: da.deberta_attention_fwd(*args, store_lse=False)  # noqa: E731
                f()
                timed(f"fwd lowp={int(lowp)}", f)
                o, lse = da.deberta_attention_fwd(*args)
                do = torch.randn_like(o)
                f = lambda: db.deberta_attention_bwd(do, q, k, v, o, lse, *args[3:])  # noqa: E731
                f()
                timed(f"bwd lowp={int(lowp)}", f, 2.5)
        # forward: the shipped wide tiles (64 x 32, `deberta_fwd_wide.py`) vs the 32 x 32 ones (with
        # the carried c2p half band, and with the whole band per tile); the wide tiles uncapped (168
        # ships: 3 programs per SM), with 2 pipeline stages (1 ships), with p2c as three (32, 32)
        # mma.sync chunks instead of two (64, 32) wgmma ones, with c2p + p2c summed in fp32 (fp16 ships)
        fwd_variants = {"fwd 32-row tiles": {"WIDE_TILES": False},
                        "fwd 32-row full c2p band": {"WIDE_TILES": False, "C2P_REUSE": False},
                        "fwd wide uncapped": {"WIDE_MAXNREG": None}, "fwd wide 2 stages": {"WIDE_STAGES": 2},
                        "fwd wide p2c 3 chunks": {"WIDE_P2C": False},
                        "fwd wide fp32 position sum": {"WIDE_POS_LOWP": False}}
        for label, sw in fwd_variants.items():
            with common.module_switches(dict.fromkeys(sw, da), sw):
                f = lambda: da.deberta_attention_fwd(*args, store_lse=False)  # noqa: E731
                try:
                    f()
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                    print(f"{label} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                timed(label, f)
        # backward variants vs the shipped one (one kernel recomputing each tile once, dq by atomics):
        # the dq + dk/dv pair, stages, register caps (16-row tiles: 2.1x slower, 582806b; 8 warps uncapped:
        # 15.6 vs 11.7 ms on the 64k pack, a800e20)
        want = db.deberta_attention_bwd(do, q, k, v, o, lse, *args[3:])
        variants = {"pair": {"ONE_PASS": False}, "pair st1": {"ONE_PASS": False, "NUM_STAGES_BWD": 1},
                    "one-pass st2": {"NUM_STAGES_ONEPASS": 2}, "one-pass maxnreg 168": {"MAXNREG_ONEPASS": 168},
                    "one-pass w8 maxnreg 128": {"NUM_WARPS_ONEPASS": 8, "MAXNREG_ONEPASS": 128}}
        for label, sw in variants.items():
            with common.module_switches(dict.fromkeys(sw, db), sw):
                f = lambda: db.deberta_attention_bwd(do, q, k, v, o, lse, *args[3:])  # noqa: E731
                try:
                    got = f()
                except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                    print(f"bwd {label} failed: {type(e).__name__}: {str(e)[:120]}")
                    continue
                rel = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
                          for a, b in zip(got, want))
                timed(f"bwd {label} (rel {rel:.0e})", f, 2.5)
        # Which position term costs what: c2p gathers along the tile's rows, p2c along its columns.
        for terms, (tk, tq) in {"c2p": (pk, None), "p2c": (None, pq), "none": (None, None)}.items():
            a2 = (q, k, v, cu, L, tk, tq, *args[7:])
            f = lambda: da.deberta_attention_fwd(*a2, store_lse=False)  # noqa: E731
            f()
            timed(f"fwd {terms} only", f)
            o2, lse2 = da.deberta_attention_fwd(*a2)
            f = lambda: db.deberta_attention_bwd(do, q, k, v, o2, lse2, *a2[3:])  # noqa: E731
            f()
            timed(f"bwd {terms} only", f, 2.5)
        fa = lambda: ops.varlen_attention(q, k, v, cu, L, scale=cfg.scale)  # noqa: E731
        try:
            fa()
            ms = common.median_ms(fa)
            rows.append((name, "flash content-only fwd", ms, flops / ms / 1e9))
        except Exception as e:  # noqa: BLE001
            print("flash failed", e)
    print(f"{'case':10s} {'variant':24s} {'ms':>8s} {'TFLOP/s (content)':>18s}")
    for r in rows:
        print(f"{r[0]:10s} {r[1]:24s} {r[2]:8.3f} {r[3]:18.1f}", flush=True)


TRAIN_CASES = (("modernbert-base", "packedenc", "doc-64k"), ("modernbert-base", "torch-packed", "doc-64k"),
               ("deberta-v3-base", "packedenc", "doc1k-64k"))


def train_profile(dev, models=None):
    from benchmarks import train as tr

    for model, sysname, wname in TRAIN_CASES:
        if models and model not in models:
            continue
        bench = tr.benches(False)[model]
        host = bench.make_params()
        vocab = host.config.vocab_size
        systems = {s.name: s for s in bench.make_systems(host, dev, torch.bfloat16)}
        system = systems[sysname]
        system.setup()
        w = [x for x in tr.workloads(bench, vocab, 65536) if x.name == wname][0]
        x = system.prepare(tr._batch(bench, w, 0, vocab))
        for _ in range(2):
            system.step(x)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            system.step(x)
            torch.cuda.synchronize()
        print(f"== {model} {sysname} {wname}: tokens {x[0].numel() if isinstance(x, tuple) else '?'}, "
              f"peak alloc {torch.cuda.max_memory_allocated()/2**30:.1f} GiB", flush=True)
        _top(prof, "self_cuda_time_total", 22)
        system.close()
        del system, systems, x
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", nargs="*", default=["host", "batches", "kernel", "train"])
    ap.add_argument("--models", nargs="*", help="train part: only these models (default: all)")
    a = ap.parse_args()
    dev = torch.device("cuda")
    for p in a.parts:
        try:
            if p == "train":
                train_profile(dev, a.models)
            else:
                {"host": deberta_host, "batches": deberta_batches, "kernel": deberta_kernel}[p](dev)
        except Exception:  # noqa: BLE001
            import traceback

            traceback.print_exc()


if __name__ == "__main__":
    main()
