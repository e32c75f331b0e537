"""The cute backend (CuteDSL / FlashAttention-4) against packedenc's Triton kernels, on the GPU: the `cute` family.

    python -m benchmarks cute                            # H200, after the gpu-stack: < ~4 min
    python -m benchmarks cute --only attention geglu     # parts: attention, geglu, norms, model

Everything in bf16, ModernBERT-base shapes, seeded inputs; each part checks before it times.
1. attention: varlen attention (H=12, K=64) on benchmarks/attention.py's workloads `query-64k`,
   `doc-64k`, `long`, each also with the (64, 64) window (`-window`): `packedenc[cute]` (FA4,
   `kernels/cute/attention.py`) and `packedenc[triton]` (the op table's "triton" entry). Check:
   output and dq, dk, dv on the workload's first <= 8192 tokens against the fp32 reference, 2x
   rule (error <= 2 x that of the plain bf16 attention + 1e-3 x scale), and FA4 at K=128 (H=6)
   on doc-64k; then global layers of 64k packs with mean lengths between mid-64k's and doc-64k's
   (`CROSSOVER`: doc200-64k, doc250-64k, doc300-64k), where auto's mean-length row for FA4 is
   placed; one long sequence among shorter ones (`MIXED`); packs the size of training batches
   (`TRAIN`: ~16k and ~4k tokens, means 197-448), where auto's training row is placed. Time: `fwd_ms` (no grad), `fwd_bwd_ms` (forward + autograd.grad of q, k, v),
   CUDA events, median of 15 after warm-up (FA4 compiles in the warm-up).
2. geglu: the MLP input projection at 65,536 x 768 -> 2 x 1152 (`geglu-64k`; and at 4,096 rows,
   `geglu-4k`, a short batch where the host launch decides): every backend that
   registers `linear_glu` (`packedenc[<backend>]`), plus `torch` (F.linear, then F.gelu(a) * g) and
   `cublas-gemm` (the GEMM alone: the floor of a fused kernel); `ms`, forward, no grad, one call with
   its host launch, and `stream_ms`, calls queued back to back (the device's time).
3. norms (`cute_norms.py`): LayerNorm and add + LayerNorm at 65,536 x 768 (`layer_norm-64k`,
   `add_layer_norm-64k`): `packedenc[cute]` (quack through the op table) and `packedenc[triton]`,
   plus quack's kernels called directly (`quack`, `quack[fused-add]`); `fwd_ms`, `fwd_bwd_ms`, their
   queued-call `*_stream_ms`, errors; the forwards again at 4,096 rows (`-4k`).
4. model: ModernBERT-base (random weights) `encode` on the first batches of `long`, `doc-64k` and
   `query` (`modernbert-long`, `modernbert-doc-64k`, `modernbert-query`: the last host-bound, where
   a choice of `auto` can lose by its launches): backend "triton" vs "cute" vs "auto", "auto" as it
   is without the extra (`packedenc[auto,no-cute]`: what the cute rows replace), and "auto"
   replayed from CUDA graphs (`packedenc+graphs`, budget: the workload's largest batch, every bucket
   captured before timing); `tokens_per_s` (the best of two passes, the systems in alternating
   order), and the minimum per-token cosine against triton's output.

Records: `geglu-64k` and `geglu-4k` in `results/ops_<gpu>.json` (beside the `ops` family's rows), the rest in
`results/cute_<gpu>.json`; every record has system, workload, status, gpu, commit, command.
A part whose packages are missing writes `absent` records with the import error.
Shapes: T packed tokens, H heads, K head dim, D hidden, F mlp width.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from benchmarks import attention as A
from benchmarks.cute_common import BF16, D, FM, T64K, auto_without_cute, cute_error, line, stream_ms, time_ms
from benchmarks.records import RESULTS_DIR, Run, write_records

PARTS = ("attention", "geglu", "norms", "model")


# ---- 1. attention ------------------------------------------------------------------------------------


def _check(fn: Callable, lens: list[int], window: tuple[int, int], H: int, K: int) -> dict[str, Any]:
    """2x-rule errors of fn's output and gradients on the first sequences of `lens` (<= 8192 tokens)."""
    from packedenc.kernels import reference
    from packedenc.kernels.reference import backward as reference_bwd
    from packedenc.packing import segment_ids

    sub = []
    for n in lens:
        if sub and sum(sub) + n > 8192:
            break
        sub.append(n)
    T, cu, L = sum(sub), A._cu(sub), max(sub)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(T, H, K, device="cuda", generator=g).to(BF16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, cu, L, window)
    got = (out.detach(), *torch.autograd.grad(out, leaves, do))
    f = [t.float() for t in (q, k, v, do)]
    ref = (reference.varlen_attention(*f[:3], cu, L, window),
           *reference_bwd.varlen_attention_bwd(f[3], *f[:3], cu, window))
    seq, i = segment_ids(cu, T), torch.arange(T, device="cuda")  # the plain bf16 attention, autograd
    keep = (seq[:, None] == seq[None, :]) & ((i[None, :] >= i[:, None] - window[0]) | (window[0] < 0))
    keep &= (i[None, :] <= i[:, None] + window[1]) | (window[1] < 0)
    pl = [t.clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(0, 1) for t in pl)
    p = torch.softmax(((qh @ kh.transpose(1, 2)) * K**-0.5).float().masked_fill(~keep, float("-inf")), -1)
    po = (p.to(BF16) @ vh).transpose(0, 1)
    plain = (po.detach(), *torch.autograd.grad(po, pl, do))
    res: dict[str, Any] = {"check_tokens": T, "check_ok": True}
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), got, ref, plain):
        e, base = (a.float() - r).abs().max().item(), (b.float() - r).abs().max().item()
        res[f"err_{name}"], res[f"err_plain_{name}"] = e, base
        res["check_ok"] &= math.isfinite(e) and e <= 2 * base + 1e-3 * max(1.0, r.abs().max().item())
    del ref, plain, p
    torch.cuda.empty_cache()
    return res


# 64k packs of `doc`-like lengths (sigma 0.7, clip [32, 2048]) with smaller medians: mean lengths
# 258 / 310 / 390 (the seeded draws) between mid-64k's 189 and doc-64k's 505, global layers only (FA4 takes no
# windowed layer), to place auto's mean-length row for FA4 (`auto.MEAN_SEQLEN`)
CROSSOVER = {"doc200-64k": (None, 200, 0.7, 32, 2048), "doc250-64k": (None, 250, 0.7, 32, 2048),
             "doc300-64k": (None, 300, 0.7, 32, 2048)}


# Packs that auto's long-global row sends to FA4 whole (a sequence of LONG_SEQLEN or more) while
# the rest is short: (the long sequence, the workload whose lengths fill the pack, the pack's tokens)
MIXED = {"mixed-query-16k": (2048, "query-64k", 16384), "mixed-doc-16k": (4096, "doc-64k", 16384),
         "mixed-doc-64k": (2048, "doc-64k", 65536)}


def mixed_lengths(name: str) -> list[int]:
    """One long sequence, then the filling workload's lengths while they fit the pack's tokens."""
    long, fill, budget = MIXED[name]
    return [long, *A.prefix_within(A.lengths(fill), budget - long)]


# Packs the size of training batches (the train family's `doc`, ~16k tokens, and `doc-b8`, ~4k), global
# layers, for auto's training row (`auto.train_global`, which asks for a mean of TRAIN_MEAN_SEQLEN at
# any size): (the workload whose lengths fill the pack, its spec or None, the pack's tokens). Means
# (the seeded draws): doc-16k 432, doc-4k 448, doc250-16k 322, doc200-16k 264, doc200-4k 253,
# mid-16k 197, mid-4k 212.
TRAIN = {"doc-16k": ("doc-64k", None, 16384), "doc-4k": ("doc-64k", None, 4096),
         "doc250-16k": ("doc250-64k", CROSSOVER["doc250-64k"], 16384),
         "doc200-16k": ("doc200-64k", CROSSOVER["doc200-64k"], 16384),
         "doc200-4k": ("doc200-64k", CROSSOVER["doc200-64k"], 4096),
         "mid-16k": ("mid-64k", None, 16384), "mid-4k": ("mid-64k", None, 4096)}


def train_lengths(name: str) -> list[int]:
    fill, spec, budget = TRAIN[name]
    return A.prefix_within(A.lengths(fill, spec=spec), budget)


def part_attention(run: Run) -> list[dict[str, Any]]:
    from packedenc.kernels import get_ops

    systems = {"packedenc[triton]": get_ops("triton", "cuda").varlen_attention}
    err = cute_error()
    if err is None:
        from packedenc.kernels.cute import attention as fa4

        systems["packedenc[cute]"] = fa4.varlen_attention
    # the workloads with and without the window, then (global only) the crossover packs where FA4's
    # mean-length row is placed: global layers of 64k packs between mid-64k and doc-64k
    cases = [(f"{w}{s}", A.lengths(w), A.WINDOW if s else (-1, -1)) for w in A.WORKLOADS for s in ("", "-window")]
    cases += [(wl, A.lengths(wl, spec=spec), (-1, -1)) for wl, spec in CROSSOVER.items()]
    cases += [(wl, mixed_lengths(wl), (-1, -1)) for wl in MIXED]
    cases += [(wl, train_lengths(wl), (-1, -1)) for wl in TRAIN]
    records = []
    for wl, lens, window in cases:
        base = dict(workload=wl, tokens=sum(lens), sequences=len(lens), max_seqlen=max(lens),
                    mean_seqlen=sum(lens) / len(lens), window=list(window), heads=A.H, head_dim=A.K)
        if err is not None:
            records.append(run.record("packedenc[cute]", status="absent", error=err, **base))
        for name, fn in systems.items():
            try:
                rec = run.record(name, **base, **_check(fn, lens, window, A.H, A.K), **A.time_system(fn, lens, window))
            except Exception as e:  # noqa: BLE001 - a failing system is a record, not the end of the run
                traceback.print_exc()
                rec = run.record(name, status="failed", error=f"{type(e).__name__}: {e}"[:300], **base)
            records.append(rec)
            print(line(rec), flush=True)
    if "packedenc[cute]" in systems:  # FA4's other head dim
        lens = A.lengths("doc-64k")
        for window in ((-1, -1), A.WINDOW):
            wl = "doc-64k-k128" + ("-window" if window != (-1, -1) else "")
            rec = run.record("packedenc[cute]", workload=wl, heads=6, head_dim=128, window=list(window),
                             **_check(systems["packedenc[cute]"], lens, window, 6, 128))
            records.append(rec)
            print(line(rec), flush=True)
    return records


# ---- 2. geglu, 3. norms ------------------------------------------------------------------------------


def part_geglu(run: Run) -> list[dict[str, Any]]:
    from packedenc import kernels
    from packedenc.kernels import reference

    kernels._load_backend("triton")
    kernels._load_backend("cute")
    records = []
    for tokens, workload in ((T64K, "geglu-64k"), (4096, "geglu-4k")):  # 4k: a short batch, host-bound
        records += _geglu_at(run, tokens, workload, kernels._IMPLS, reference)
    return records


def _geglu_at(run: Run, tokens: int, workload: str, impls_by_backend: dict, reference: Any) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, D, device="cuda", generator=g).to(BF16)
    w = (torch.randn(2 * FM, D, device="cuda", generator=g) * D**-0.5).to(BF16)

    def plain() -> torch.Tensor:
        a, b = F.linear(x, w).chunk(2, -1)
        return F.gelu(a) * b

    systems: dict[str, Callable[[], Any]] = {
        f"packedenc[{b}]": (lambda f=impls["linear_glu"]: f(x, w, None, "gelu"))
        for b, impls in impls_by_backend.items() if b != "reference" and "linear_glu" in impls
    }
    systems |= {"torch": plain, "cublas-gemm": lambda: F.linear(x, w)}
    rows = slice(0, 8192)  # the fp32 check on the first rows (the whole fp32 GEMM would be 0.6 GB more)
    want = reference.linear_glu(x[rows].float(), w.float(), None, "gelu")
    base_err = (reference.linear_glu(x[rows], w, None, "gelu").float() - want).abs().max().item()
    fields = dict(workload=workload, tokens=tokens, shape=f"{tokens} x {D} -> 2 x {FM}", op="linear_glu")
    records = []
    for name, fn in systems.items():
        try:
            with torch.no_grad():
                extra = {}
                if name != "cublas-gemm":
                    e = (fn()[rows].float() - want).abs().max().item()
                    extra = dict(err=e, err_ratio=e / base_err if base_err else None)
                rec = run.record(name, ms=time_ms(fn), stream_ms=stream_ms(fn), **fields, **extra)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rec = run.record(name, status="failed", error=f"{type(e).__name__}: {e}"[:300], **fields)
        records.append(rec)
        print(line(rec), flush=True)
    return records


def part_norms(run: Run) -> list[dict[str, Any]]:
    from benchmarks.cute_norms import part_norms as norms  # its own file: layer_norm-64k, add_layer_norm-64k

    return norms(run)


# ---- 4. model ------------------------------------------------------------------------------------------


MODEL_WORKLOADS = ("long", "doc-64k", "query")  # query: eager short batches, where the host decides


def part_model(run: Run, batches: int = 3, passes: int = 2, names: tuple[str, ...] = MODEL_WORKLOADS) -> list[dict[str, Any]]:
    import packedenc as pe
    from benchmarks.workloads import MODERNBERT_WORKLOADS, workload_named
    from packedenc.models.modernbert import ModernBertConfig, init

    params = pe.tree_to(init(ModernBertConfig(), torch.Generator().manual_seed(0), dtype=BF16), "cuda")
    err = cute_error()
    records = []
    # auto: what the op table picks from the records; graphs: auto replayed from CUDA graphs;
    # auto,no-cute: the table auto builds without the extra (what its cute rows replace: its
    # routed entries, e.g. rotary_attention's `uncaptured` row, cost host time that the forced
    # "triton" table does not pay)
    systems = ("packedenc[triton]", "packedenc[cute]", "packedenc", "packedenc+graphs", "packedenc[auto,no-cute]")
    for name in names:
        wl = workload_named(name, MODERNBERT_WORKLOADS, params.config.vocab_size)
        packs = [wl.batch(i) for i in range(min(batches, len(wl.batches)))]
        inputs = [(b.ids.to("cuda"), b.cu_seqlens.to("cuda"), b.max_seqlen) for b in packs]
        fields = dict(workload=f"modernbert-{name}", model="modernbert-base", batches=len(inputs),
                      tokens=sum(int(i[0].numel()) for i in inputs))
        fns: dict[str, Callable] = {}
        outs: dict[str, torch.Tensor] = {}
        failed: dict[str, str] = {}
        best: dict[str, float] = {}
        with torch.no_grad():
            for system in systems:
                backend = {"packedenc[triton]": "triton", "packedenc[cute]": "cute"}.get(system, "auto")
                if backend == "cute" and err is not None:
                    failed[system] = "absent"
                    continue
                try:
                    if system == "packedenc[auto,no-cute]":
                        backend = auto_without_cute()
                    fn = functools.partial(pe.encode, params, backend=backend)
                    if system.endswith("+graphs"):  # the budget: this workload's largest batch
                        fn = pe.graphed(params, max_tokens=max(int(i[0].numel()) for i in inputs),
                                        max_seqs=max(int(i[1].numel()) - 1 for i in inputs))
                        for i in inputs:  # capture every bucket before timing
                            fn(*i)
                    outs[system], fns[system] = fn(*inputs[0]), fn
                except Exception as e:  # noqa: BLE001
                    traceback.print_exc()
                    failed[system] = f"{type(e).__name__}: {e}"[:300]
            # passes in alternating order, the best of each: the host-bound query batches drift
            # between systems by more than auto's choice moves them
            for k in range(passes):
                for system in (list(fns) if k % 2 == 0 else list(fns)[::-1]):
                    ms = sum(A.median_ms(lambda i=i: fns[system](*i), reps=5, warmup=2) for i in inputs)
                    best[system] = min(ms, best.get(system, math.inf))
        for system in systems:
            if system in failed:
                status = "absent" if failed[system] == "absent" else "failed"
                rec = run.record(system, status=status, error=err if status == "absent" else failed[system], **fields)
            else:
                extra = {}
                if system != "packedenc[triton]" and "packedenc[triton]" in outs:
                    cos = F.cosine_similarity(outs[system].float(), outs["packedenc[triton]"].float(), dim=-1)
                    table = (auto_without_cute() if system == "packedenc[auto,no-cute]"
                             else pe.get_ops("cute" if system == "packedenc[cute]" else "auto", "cuda"))
                    extra = dict(min_cos_vs_triton=cos.min().item(),
                                 ops=",".join(f"{o}={b}" for o, b in table.chosen))
                ms = best[system]
                rec = run.record(system, tokens_per_s=fields["tokens"] / ms * 1e3, ms=ms, passes=passes,
                                 **fields, **extra)
            records.append(rec)
            print(line(rec), flush=True)
        for fn in fns.values():
            if hasattr(fn, "clear"):
                fn.clear()  # the graphs' memory pool
    return records


# ---- records and table ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks cute", description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", choices=PARTS, help="default: every part")
    ap.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--model-workloads", nargs="*", choices=MODEL_WORKLOADS, default=MODEL_WORKLOADS,
                    help="the model part's workloads (default: all)")
    ap.add_argument("--passes", type=int, default=2, help="the model part's passes (alternating order)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (sm90+ for the cute backend)")
        return 2
    device = torch.device("cuda")
    run = Run.start("cute", device, argv or [])
    print(f"cute backend: {cute_error() or 'loads'}", flush=True)
    t0, records = time.perf_counter(), []
    parts = {"attention": part_attention, "geglu": part_geglu, "norms": part_norms,
             "model": functools.partial(part_model, names=tuple(a.model_workloads), passes=a.passes)}
    for name in a.only or PARTS:
        print(f"\n## {name} ({time.perf_counter() - t0:.0f}s)", flush=True)
        records += parts[name](run)
    print(f"\n## cute vs triton, bf16 on {run.gpu} ({time.perf_counter() - t0:.0f}s, commit {run.commit})")
    print("\n".join(line(r) for r in records))
    from benchmarks import targets

    geglu = [r for r in records if r["workload"].startswith("geglu-")]
    for target_line in targets.report("cute", records) + targets.report("ops", geglu):
        print(target_line)
    if not a.no_write:
        ops_run = dataclasses.replace(run, family="ops")  # geglu-64k lives beside the ops family's rows
        geglu = [{**r, "family": "ops"} for r in records if r["workload"].startswith("geglu-")]
        rest = [r for r in records if not r["workload"].startswith("geglu-")]
        for recs, path in ((geglu, ops_run.path(a.out_dir)), (rest, run.path(a.out_dir))):
            if recs:
                write_records(recs, path)
                print(f"records: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
