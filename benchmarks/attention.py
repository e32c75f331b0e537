"""Varlen attention on the GPU, forward and forward + backward: packedenc's Triton kernels vs torch's flash.

    PYTHONPATH=. python -m benchmarks.attention --out benchmarks/results           # H200: ~1-2 min
    PYTHONPATH=. python -m benchmarks.attention --out DIR --sweep                  # + tile sweep, ~4 min

bf16, ModernBERT-base attention (H=12, K=64), issue 20's workloads: `query-64k` (median 24, sigma
0.5, clip [4, 128]) and `doc-64k` (median 350, sigma 0.7, clip [32, 2048]) packed to at most 65,536
tokens, `long` (8 sequences, median 4096, sigma 0.4, clip [1024, 8192]), `doc-b8` (8 `doc`
sequences: a training batch of the train family's `doc-b8`, a few thousand tokens, where a long
sequence's blocks are the critical path rather than the pack's size); each also with the (64, 64)
window (`-window`), and `mid-64k` (median 160, clip [32, 1024]: a big pack of mid-length sequences,
between query and doc, where the cute backend's FA4 threshold is placed). Lengths are seeded log-normal draws, as benchmarks/common.py's workloads.

1. Check: on a sub-pack of each workload (its first sequences, <= 8192 tokens, so the dense fp32
   reference fits), the kernels' output and dq, dk, dv against the fp32 reference, with the 2x rule
   (error <= 2 x that of the plain bf16 attention + 1e-3 x the reference's scale).
2. Time (CUDA events, warm-up, median of 15): `fwd_ms` under no_grad, `fwd_bwd_ms` = forward with
   inputs that require grad + autograd.grad of q, k, v (one call between two events: a host
   prologue longer than the GPU's idle start counts) with the backward on the calling thread, as
   `packedenc.train`'s step runs it (`backward_grads`; every system alike), and
   `fwd_bwd_engine_thread_ms` the same call with the engine's default hand-off of the backward to
   its CUDA device thread (what a bare `autograd.grad` does); each also as `*_host_ms` (host enqueue) and
   `*_device_ms` (its kernels alone, queued behind a sleep: `common.host_device_ms`), for the
   systems `packedenc` (the op table's
   "triton" varlen_attention) and `torch-flash` (torch's varlen attention through kernels/flash.py);
   FlashAttention-4 (the "cute" backend) is timed by `python -m benchmarks cute`.
3. `--profile`: torch.profiler's table of 5 forward + backward calls per system, by self CPU time
   (where `fwd_bwd_host_ms` goes).
4. `--sweep`: the forward, the dQ and the dK/dV kernels alone with candidate tiles (the other
   backward pass at its default), to place the rows of `attention.TILE_*`; the 32-row tiles (and
   16-row inner tiles) ask whether short sequences gain from more, smaller programs. A one-pass
   backward (both blocks per program) is not swept: it lost to the two-launch split on every
   workload (benchmarks/results/history/attention_h200_b4119ba.json).
Writes `--out DIR/attention_h200.json` (records: system, workload, fwd_ms, fwd_bwd_ms, gpu, commit,
command, versions) and prints a short table with issue 20's targets.

Shapes: T packed tokens, S sequences, H heads, K head dim.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
import zlib
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from benchmarks import common
from benchmarks.records import git_commit, gpu_slug, replace_text

H, K = 12, 64
BF16 = torch.bfloat16
BUDGET = 65536
WINDOW = (64, 64)
# name: (count or None for a 64k pack, median, sigma, lo, hi)
WORKLOADS = {"query-64k": (None, 24, 0.5, 4, 128), "doc-64k": (None, 350, 0.7, 32, 2048),
             "long": (8, 4096, 0.4, 1024, 8192), "doc-b8": (8, 350, 0.7, 32, 2048),
             "mid-64k": (None, 160, 0.7, 32, 1024)}
TARGETS = {"query-64k": 1.0, "doc-64k": 1.7, "doc-64k-window": 1.0, "long": 3.2}  # fwd+bwd ms, issue 20
FWD_SWEEP = ((64, 32, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 32, 8, 2), (128, 128, 8, 2),
             (32, 32, 2, 2), (32, 32, 4, 2), (32, 16, 2, 2))
BWD_SWEEP = ((64, 32, 4, 2), (64, 64, 4, 2), (64, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3),
             (64, 64, 4, 3), (32, 64, 4, 2), (32, 32, 2, 2), (32, 32, 4, 2), (32, 16, 2, 2), (64, 16, 4, 2))


def lengths(name: str, seed: int = 0, spec: tuple | None = None) -> list[int]:
    """The seeded lengths of workload `name` (`spec`: its (count, median, sigma, lo, hi) when it is
    not one of WORKLOADS; the name still seeds the draw)."""
    count, median, sigma, lo, hi = spec or WORKLOADS[name]
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    n = count or BUDGET // lo + 1
    z = torch.randn(n, generator=g, dtype=torch.float64)
    lens = torch.exp(math.log(median) + sigma * z).round().clamp(lo, hi).long().tolist()
    return lens if count else prefix_within(lens, BUDGET)  # the 64k pack


def prefix_within(lens: list[int], budget: int) -> list[int]:
    """The longest prefix of `lens` whose sum fits `budget` tokens."""
    out, total = [], 0
    for n in lens:
        if total + n > budget:
            break
        out.append(n)
        total += n
    return out


def _cu(lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return cu.cuda()


class Case(NamedTuple):
    """One workload's pack for the attention probes: bf16 (T, H, K) q, k, v and an upstream dO."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    do: torch.Tensor
    cu: torch.Tensor
    max_seqlen: int
    window: tuple[int, int]
    scale: float


def probe_case(name: str) -> Case:
    """`name` ("doc-64k", "doc-64k-window", ...): its seeded lengths, the (64, 64) window for a
    "-window" suffix, random inputs on the GPU."""
    lens = lengths(name.removesuffix("-window"))
    window = WINDOW if name.endswith("-window") else (-1, -1)
    q, k, v, do = (torch.randn(sum(lens), H, K, device="cuda").to(BF16) for _ in range(4))
    return Case(q, k, v, do, _cu(lens), max(lens), window, K**-0.5)


def median_ms(fn: Callable[[], Any], reps: int = 15, warmup: int = 3) -> float:
    return common.median_ms(fn, reps, warmup)  # the harness's CUDA-event median, 15 reps here


def systems() -> dict[str, Callable]:
    from packedenc.kernels import flash, get_ops

    out = {"packedenc": get_ops("triton", "cuda").varlen_attention}
    torch_impl = flash.IMPLS.get("torch") or flash.IMPLS.get("aten")
    if torch_impl is not None:
        out["torch-flash"] = torch_impl
    return out


# ---- 1. check ------------------------------------------------------------------------------------


def _plain_bf16(q, k, v, do, cu, window):
    """(out, dq, dk, dv) of the plain bf16 attention (bf16 products, fp32 softmax rounded), autograd."""
    from packedenc.packing import segment_ids

    T = q.shape[0]
    seq, i = segment_ids(cu, T), torch.arange(T, device=q.device)
    keep = seq[:, None] == seq[None, :]
    if window[0] >= 0:
        keep &= i[None, :] >= i[:, None] - window[0]
    if window[1] >= 0:
        keep &= i[None, :] <= i[:, None] + window[1]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    qh, kh, vh = (t.transpose(0, 1) for t in leaves)
    p = torch.softmax(((qh @ kh.transpose(1, 2)) * K**-0.5).float().masked_fill(~keep, float("-inf")), -1)
    out = (p.to(q.dtype) @ vh).transpose(0, 1)
    return (out.detach(), *torch.autograd.grad(out, leaves, do))


def check(fn: Callable, lens: list[int], window: tuple[int, int]) -> dict[str, Any]:
    """2x-rule errors of fn's output and gradients on the first sequences of `lens` (<= 8192 tokens)."""
    from packedenc.kernels import reference
    from packedenc.kernels.reference import backward as reference_bwd

    sub, total = [], 0
    for n in lens:
        if sub and total + n > 8192:
            break
        sub.append(n)
        total += n
    cu, L = _cu(sub), max(sub)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(total, H, K, device="cuda", generator=g).to(BF16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves, cu, L, window)
    got = (out.detach(), *torch.autograd.grad(out, leaves, do))
    f = [t.float() for t in (q, k, v, do)]
    ref = (reference.varlen_attention(*f[:3], cu, L, window),
           *reference_bwd.varlen_attention_bwd(f[3], *f[:3], cu, window))
    plain = _plain_bf16(q, k, v, do, cu, window)
    res: dict[str, Any] = {"check_tokens": total, "check_ok": True}
    for name, a, r, b in zip(("out", "dq", "dk", "dv"), got, ref, plain):
        e, base = (a.float() - r).abs().max().item(), (b.float() - r).abs().max().item()
        ok = math.isfinite(e) and e <= 2 * base + 1e-3 * max(1.0, r.abs().max().item())
        res[f"err_{name}"], res[f"err_plain_{name}"] = e, base
        res["check_ok"] &= ok
    del ref, plain
    torch.cuda.empty_cache()
    return res


# ---- 2. time -------------------------------------------------------------------------------------


def time_system(fn: Callable, lens: list[int], window: tuple[int, int]) -> dict[str, float]:
    T, cu, L = sum(lens), _cu(lens), max(lens)
    q, k, v, do = (torch.randn(T, H, K, device="cuda").to(BF16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def fwd():
        with torch.no_grad():
            fn(q, k, v, cu, L, window)

    def engine_thread():  # the autograd engine's default: the backward on its CUDA device thread
        torch.autograd.grad(fn(*leaves, cu, L, window), leaves, do)

    def fwd_bwd():  # the backward on the calling thread, as the library's training step runs it
        with torch.autograd.set_multithreading_enabled(False):
            torch.autograd.grad(fn(*leaves, cu, L, window), leaves, do)

    out = {"fwd_ms": median_ms(fwd), "fwd_bwd_ms": median_ms(fwd_bwd),
           "fwd_bwd_engine_thread_ms": median_ms(engine_thread), "backward_thread": "calling"}
    # the same calls split into host enqueue time and the device time of their own kernels
    for name, f in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        hd = common.host_device_ms([f] * 3, torch.device("cuda"))
        out.update({f"{name}_host_ms": hd["host_ms"], f"{name}_device_ms": hd["device_ms"]})
    return out


def profile_host(fn: Callable, lens: list[int], window: tuple[int, int], rows: int = 15) -> str:
    """torch.profiler's table of 5 forward + backward calls (after warm-up), by self CPU time: where
    the host time of `fwd_bwd` goes (the autograd engine, allocations, our launchers)."""
    from torch.profiler import ProfilerActivity, profile

    T, cu, L = sum(lens), _cu(lens), max(lens)
    q, k, v, do = (torch.randn(T, H, K, device="cuda").to(BF16) for _ in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    for _ in range(3):
        torch.autograd.grad(fn(*leaves, cu, L, window), leaves, do)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            torch.autograd.grad(fn(*leaves, cu, L, window), leaves, do)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows)


def sweep(lens: list[int], window: tuple[int, int]) -> list[dict[str, Any]]:
    """Each pass alone over candidate tiles: forward (no LSE), backward with one kernel's tile varied."""
    from packedenc.kernels.triton import attention as A
    from packedenc.kernels.triton.attention_bwd import attention_bwd

    T, cu, L = sum(lens), _cu(lens), max(lens)
    q, k, v, do = (torch.randn(T, H, K, device="cuda").to(BF16) for _ in range(4))
    scale = K**-0.5
    out, lse = A.attention_fwd(q, k, v, cu, L, window, scale, lse=True)
    dq_tile, kv_tile = A.bwd_tiles(T, L, window, K)
    rows = []
    for tile in FWD_SWEEP:
        try:
            ms = median_ms(lambda: A.attention_fwd(q, k, v, cu, L, window, scale, lse=False, tile=tile))
        except Exception as e:  # noqa: BLE001 - a tile that does not compile: printed, the sweep goes on
            print(f"  sweep fwd {tile}: {type(e).__name__}: {str(e)[:120]}")
            continue
        rows.append({"pass": "fwd", "tile": list(tile), "ms": ms, "default": tile == A.tiles(T, L, window, K)})
    for name in ("dq", "dkdv"):
        for tile in BWD_SWEEP:
            tiles = (tile, kv_tile) if name == "dq" else (dq_tile, tile)
            try:
                ms = median_ms(lambda: attention_bwd(do, q, k, v, out, lse, cu, L, window, scale, tiles=tiles))
            except Exception as e:  # a tile that does not compile (registers, shared memory): recorded
                print(f"  sweep {name} {tile}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows.append({"pass": f"bwd, {name} tile varied", "tile": list(tile), "ms": ms, "default": tiles == (dq_tile, kv_tile)})
    return rows


# ---- records and table -----------------------------------------------------------------------------


def commit() -> str:
    return git_commit()  # GIT_COMMIT when set, '-dirty' for an uncommitted tree


def table(records: list[dict[str, Any]]) -> str:
    lines = [f"{'workload':20s} {'system':12s} {'T':>6s} {'S':>5s} {'fwd ms':>7s} {'fwd+bwd ms':>10s} "
             f"{'target':>7s} {'check (max err / 2x plain)':>28s}"]
    for r in records:
        if "fwd_ms" not in r:
            lines.append(f"{r['workload']:20s} {r['system']:12s} FAILED: {r.get('error', '')[:80]}")
            continue
        tgt = TARGETS.get(r["workload"]) if r["system"] == "packedenc" else None
        met = "" if tgt is None else f"{tgt:5.1f} {'ok' if r['fwd_bwd_ms'] <= tgt else 'NO'}"
        chk = ""
        if "check_ok" in r:
            worst = max(("out", "dq", "dk", "dv"), key=lambda n: r[f"err_{n}"] / max(r[f"err_plain_{n}"], 1e-9))
            e, bound = r[f"err_{worst}"], 2 * r[f"err_plain_{worst}"]
            chk = f"{'ok' if r['check_ok'] else 'FAIL'} {worst} {e:.1e}/{bound:.1e}"
        lines.append(f"{r['workload']:20s} {r['system']:12s} {r['tokens']:6d} {r['sequences']:5d} "
                     f"{r['fwd_ms']:7.3f} {r['fwd_bwd_ms']:10.3f} {met:>7s} {chk:>28s}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="folder for attention_<gpu>.json")
    ap.add_argument("--sweep", action="store_true", help="also time candidate tiles of each pass")
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all eight)")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--profile", action="store_true",
                    help="also print torch.profiler's table of 5 forward + backward calls per system (host time)")
    a = ap.parse_args(argv)
    import triton

    gpu = torch.cuda.get_device_name()
    meta = {"gpu": gpu, "commit": commit(), "command": " ".join(["python -m benchmarks attention", *(argv if argv is not None else sys.argv[1:])]),
            "torch": torch.__version__, "triton": triton.__version__, "dtype": "bfloat16", "heads": H, "head_dim": K}
    print(f"# benchmarks.attention on {gpu}; torch {torch.__version__}, triton {triton.__version__}; "
          f"commit {meta['commit']}", flush=True)
    names = [f"{w}{s}" for w in WORKLOADS for s in ("", "-window")]
    names = [n for n in names if not a.only or n in a.only.split(",")]
    records, sweeps = [], []
    for wl in names:
        lens = lengths(wl.removesuffix("-window"))
        window = WINDOW if wl.endswith("-window") else (-1, -1)
        base = {"workload": wl, "tokens": sum(lens), "sequences": len(lens), "max_seqlen": max(lens),
                "window": list(window), **meta}
        for name, fn in systems().items():
            rec = {"system": name, **base}
            try:
                if name == "packedenc" and not a.no_check:
                    rec.update(check(fn, lens, window))
                rec.update(time_system(fn, lens, window))
            except Exception as e:  # noqa: BLE001 - a failing system is a record, not the end of the run
                rec["error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
            records.append(rec)
            print(table([rec]).splitlines()[1], flush=True)
            if a.profile:
                try:
                    print(f"\n## profile: {name} {wl}, 5 x forward + backward\n{profile_host(fn, lens, window)}",
                          flush=True)
                except Exception:  # noqa: BLE001 - a profile is a diagnostic, not the run
                    traceback.print_exc()
        if a.sweep:
            try:
                for row in sweep(lens, window):
                    sweeps.append({"workload": wl, **row})
                    print(f"  sweep {wl:16s} {row['pass']:24s} {str(row['tile']):18s} {row['ms']:7.3f} ms"
                          f"{'  (default)' if row['default'] else ''}", flush=True)
            except Exception:  # noqa: BLE001
                traceback.print_exc()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"attention_{gpu_slug(gpu)}.json"
    replace_text(path, json.dumps({"records": records, "sweep": sweeps, **meta}, indent=1) + "\n")
    print(f"\n## issue 20 (bf16, H={H}, K={K}); records in {path}\n{table(records)}")
    if sweeps:
        print("\n## fastest tile per pass (sweep)")
        for wl in names:
            for p in ("fwd", "bwd, dq tile varied", "bwd, dkdv tile varied"):
                rows = [r for r in sweeps if r["workload"] == wl and r["pass"] == p]
                if rows:
                    best, dflt = min(rows, key=lambda r: r["ms"]), next((r for r in rows if r["default"]), None)
                    d = f"{dflt['ms']:.3f}" if dflt else "n/a"
                    print(f"{wl:16s} {p:24s} best {str(best['tile']):18s} {best['ms']:.3f} ms (default {d})")
    return records


if __name__ == "__main__":
    main()
