"""Varlen attention on the GPU: the Triton token-block kernel vs torch's FA2 varlen, then the encode.

    PYTHONPATH=. python -m benchmarks.bench_attention            # H200: ~1-2 min
    PYTHONPATH=. python -m benchmarks.bench_attention --sweep    # also every candidate tile

bf16, ModernBERT-base attention (H=12, K=64) on the packs of `benchmarks/bench_ops.py`: query
128 x ~24, doc 32 x ~350, doc 64k budget (180 doc sequences, T ~81k), long 8 x ~4096, each with the
(64, 64) window and global; with --sweep also global packs of equal lengths 256 .. 4096 (~64k
tokens) to place the crossover of the auto rule. `us` = device time per call (median CUDA-graph
replay, no host overhead). Errors: max abs against FA2's output (and, on the small packs, of both
against the fp32 reference). Then whole ModernBERT-base encodes (random weights) with attention
from: FA2 only (auto before this kernel), the auto rule (`attention.varlen_attention`), the kernel
everywhere, and `get_ops("auto")` as registered; graph replay and eager.

Shapes: T packed tokens, S sequences, H heads, K head dim.
"""

from __future__ import annotations

import argparse
import dataclasses
import traceback

import torch
import torch.nn.functional as F

import packedenc as pe
from benchmarks.bench_ops import _call_ms, _err, _lengths, _ms, pe_commit
from packedenc.kernels import flash, get_ops, reference
from packedenc.kernels.triton import attention as A

H, K = 12, 64
BF16 = torch.bfloat16
WINDOWS = ((64, 64), (-1, -1))
SWEEP_TILES = ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (32, 32, 4, 2), (128, 64, 8, 2),
               (128, 64, 8, 3), (128, 64, 4, 2), (128, 128, 8, 2), (64, 128, 4, 2))


def packs(sweep: bool) -> dict[str, list[int]]:
    p = {"query 128x~24": _lengths(128, 24, 0.5, 4, 128), "doc 32x~350": _lengths(32, 350, 0.7, 32, 2048),
         "doc 64k budget": _lengths(180, 350, 0.7, 32, 2048), "long 8x~4096": _lengths(8, 4096, 0.4, 1024, 8192)}
    if sweep:
        for n in (256, 512, 1024, 2048, 4096):
            p[f"equal {n}"] = [n] * (65536 // n)
    return p


def _cu(lengths):
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.cuda()


def attention_table(sweep: bool) -> None:
    print("\n## varlen attention, bf16, H=12 K=64: device us per call (CUDA-graph replay)")
    print(f"{'pack':16s} {'T':>6s} {'S':>4s} {'Lmax':>5s} {'window':9s} {'FA2 us':>7s} {'triton us':>9s} {'x':>5s} "
          f"{'tile':16s} {'auto':6s} {'err vs FA2':>10s} {'err tri/FA2 vs fp32':>19s}")
    for pname, lengths in packs(sweep).items():
        T, S, L = sum(lengths), len(lengths), max(lengths)
        cu = _cu(lengths)
        q, k, v = (torch.randn(T, H, K, device="cuda").to(BF16) for _ in range(3))
        for window in WINDOWS:
            if pname.startswith("equal") and window != (-1, -1):
                continue
            try:
                fa = flash.varlen_attention(q, k, v, cu, L, window)
                t_fa = _ms(lambda: flash.varlen_attention(q, k, v, cu, L, window))
                tiles = [None] + ([t for t in SWEEP_TILES if not (window[0] >= 0 and t[1] > 64)] if sweep else [])
                for tile in tiles:
                    out = A.varlen_attention_fwd(q, k, v, cu, L, window, tile=tile)
                    t_tr = _ms(lambda: A.varlen_attention_fwd(q, k, v, cu, L, window, tile=tile))
                    e_ref = ""
                    if tile is None and S * H * L * L * 4 <= 8e9:  # the dense (S, H, L, L) reference fits
                        ref = reference.varlen_attention(q.float(), k.float(), v.float(), cu, L, window)
                        e_ref = f"{_err(out, ref):.1e}/{_err(fa, ref):.1e}"
                    name = "default " + str(A.tiles(T, L, window, K)) if tile is None else str(tile)
                    auto = "triton" if A.prefer_triton(window, K) else "FA2"
                    print(f"{pname:16s} {T:6d} {S:4d} {L:5d} {str(window):9s} {t_fa*1e3:7.1f} {t_tr*1e3:9.1f} "
                          f"{t_fa / t_tr:5.2f} {name:16s} {auto:6s} {_err(out, fa):10.1e} {e_ref:>19s}")
            except Exception:
                print(f"{pname} {window} FAILED\n{traceback.format_exc()}")


def eager_call_table() -> None:
    print("\n## eager call us (host overhead included): FA2 / triton direct launch / triton custom op")
    for pname, lengths in list(packs(False).items())[:2]:
        T, L = sum(lengths), max(lengths)
        cu = _cu(lengths)
        q, k, v = (torch.randn(T, H, K, device="cuda").to(BF16) for _ in range(3))
        for window in WINDOWS:
            c_fa = _call_ms(lambda: flash.varlen_attention(q, k, v, cu, L, window))
            c_tr = _call_ms(lambda: A.triton_varlen_attention(q, k, v, cu, L, window))
            c_op = _call_ms(lambda: torch.ops.packedenc.triton_varlen_attention(q, k, v, cu, L, *window, None))
            print(f"{pname:16s} {str(window):9s} {c_fa*1e3:7.1f} / {c_tr*1e3:7.1f} / {c_op*1e3:7.1f}")


def encode_table() -> None:
    from packedenc.models.modernbert import ModernBertConfig, init

    print("\n## ModernBERT-base encode, bf16, random weights: gpu = CUDA-graph replay, call = eager")
    params = pe.tree_to(init(ModernBertConfig(), torch.Generator().manual_seed(0), dtype=BF16), "cuda")
    auto = get_ops("auto", "cuda")
    print(f"get_ops('auto') varlen_attention = {dict(auto.chosen)['varlen_attention']}")
    tables = {
        "auto, FA2 attention (before)": dataclasses.replace(auto, varlen_attention=flash.varlen_attention),
        "auto rule (triton/FA2)": dataclasses.replace(auto, varlen_attention=A.varlen_attention),
        "triton kernel everywhere": dataclasses.replace(auto, varlen_attention=A.triton_varlen_attention),
        "get_ops('auto') as registered": auto,
    }
    for pname, lengths in {"query 128x~24": _lengths(128, 24, 0.5, 4, 128),
                           "doc 64k budget": _lengths(180, 350, 0.7, 32, 2048)}.items():
        b = pe.pack([torch.randint(5, 50000, (n,)) for n in lengths], device="cuda")
        T = b.ids.numel()
        base = None
        for name, ops in tables.items():
            fn = lambda ops=ops: pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, b.positions, backend=ops)  # noqa: E731
            try:
                with torch.no_grad():
                    out = fn()
                    base = out if base is None else base
                    cos = F.cosine_similarity(out.float(), base.float(), dim=-1).min().item()
                    g, c = _ms(fn), _call_ms(fn, 20 if T < 16384 else 5)
                print(f"{pname:15s} T={T:6d} {name:30s} gpu {g:7.2f} ms {T / g:7.0f}k tok/s | call {c:7.2f} ms "
                      f"{T / c:7.0f}k tok/s | min cos vs before {cos:.5f}")
            except Exception:
                print(f"{pname} {name} FAILED\n{traceback.format_exc()}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="attn,call,encode")
    a = ap.parse_args()
    print(f"# bench_attention on {torch.cuda.get_device_name()}; torch {torch.__version__}; commit {pe_commit()}")
    print(f"flash impls: {list(flash.IMPLS)}; best: {flash.BEST}")
    only = a.only.split(",")
    for key, fn in (("attn", lambda: attention_table(a.sweep)), ("call", eager_call_table), ("encode", encode_table)):
        if key in only:
            try:
                fn()
            except Exception:
                traceback.print_exc()


if __name__ == "__main__":
    main()
