"""Per-op GPU check and timing: packedenc's Triton fused ops and flash backends vs plain torch.

    python -m benchmarks.bench_ops            # H200: ~2-3 min, prints tables
    python -m benchmarks.bench_ops --sweep    # also try other tile sizes for LN / GLU

For each op (bf16, ModernBERT-base shapes: D=768, H=12, K=64, F=1152) and token count T it
prints the max error of the kernel and of plain torch in bf16 against the fp32 reference (the
2x rule), then two times per call:
  gpu us     pure device time: median CUDA-graph replay (triton.testing.do_bench_cudagraph), so
             host overhead is excluded; achieved GB/s = bytes that must move / this time
             (H200 copy bandwidth ~4.3 TB/s)
  call us    eager cost: back-to-back calls then one sync, host overhead included
of: triton (the Ops-table function: direct launch in eager inference), op (the registered custom
op, torch.ops.packedenc.*), eager (what a careful PyTorch user writes: F.layer_norm on bf16,
x + r then LN, ...), compiled (torch.compile of that plain-torch function).
Then forward+backward per op, the varlen attention implementations, and a whole ModernBERT-base
encode on a doc-like pack.

Shapes: T packed tokens, D hidden, H heads, K head dim, F mlp width, V vocab.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
import traceback

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

import packedenc as pe
from packedenc.kernels import flash, get_ops, reference
from packedenc.kernels.triton import glu as G
from packedenc.kernels.triton import layer_norm as L

D, H, K, FF, V, EPS = 768, 12, 64, 1152, 50368, 1e-5
BF16 = torch.bfloat16


def _ms(fn) -> float:
    """Device time of one call in ms (CUDA-graph replay: no host overhead)."""
    return do_bench_cudagraph(fn, rep=20, return_mode="median")


def _call_ms(fn, n: int = 30) -> float:
    """Eager time of one call in ms, host overhead included (n calls back to back, one sync)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def _err(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


def _rotate(x, cos, sin):  # the plain-torch RoPE (bf16 tables gathered by position)
    x1, x2 = x[..., : K // 2], x[..., K // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def _rope_tables(theta, P, dev):
    inv = reference.rope_inv_freq(K, theta, dev)
    f = torch.arange(P, device=dev).float()[:, None] * inv[None, :]
    e = torch.cat((f, f), -1)
    return e.cos().to(BF16), e.sin().to(BF16)


def _cases(T: int):
    """(name, triton fn, plain fn, fp32 reference fn, bytes moved) for each fused op at T tokens."""
    dev = "cuda"
    ops = get_ops("triton", dev)
    x, r = torch.randn(T, D, device=dev).to(BF16), torch.randn(T, D, device=dev).to(BF16)
    w = (1 + 0.1 * torch.randn(D, device=dev)).to(BF16)
    table = torch.randn(V, D, device=dev).to(BF16)
    ids = torch.randint(0, V, (T,), device=dev)
    qkv = torch.randn(T, 3, H, K, device=dev).to(BF16)
    pos = torch.randint(0, 2048, (T,), device=dev)
    u = torch.randn(T, 2 * FF, device=dev).to(BF16)
    cos, sin = _rope_tables(10000.0, 8192, dev)
    f32 = lambda *ts: [t.float() for t in ts]  # noqa: E731

    def plain_rotary(qkv, pos):
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        return _rotate(qkv[:, 0], c, s), _rotate(qkv[:, 1], c, s)

    def plain_add_ln(x, r):
        s = x + r
        return F.layer_norm(s, (D,), w, None, EPS), s

    def plain_glu(u):
        a, g = u.chunk(2, -1)
        return F.gelu(a) * g

    b2 = 2  # bytes per bf16 element
    P = torch.ops.packedenc
    opcall = {
        "layer_norm": lambda: P.layer_norm(x, w, None, EPS),
        "add_layer_norm": lambda: P.add_layer_norm(x, r, w, None, EPS)[0],
        "embed_layer_norm": lambda: P.embed_layer_norm(ids, table, w, None, EPS),
        "rotary": lambda: P.rotary(qkv, pos, 10000.0)[0],
        "glu": lambda: P.glu(u, "gelu"),
    }
    return [
        ("layer_norm", lambda: ops.layer_norm(x, w, None, EPS), lambda: F.layer_norm(x, (D,), w, None, EPS),
         lambda: reference.layer_norm(*f32(x, w), None, EPS), 2 * T * D * b2,
         lambda: reference.layer_norm(x, w, None, EPS)),
        ("add_layer_norm", lambda: ops.add_layer_norm(x, r, w, None, EPS)[0], lambda: plain_add_ln(x, r)[0],
         lambda: reference.layer_norm((x + r).float(), w.float(), None, EPS), 4 * T * D * b2,
         lambda: reference.add_layer_norm(x, r, w, None, EPS)[0]),
        ("embed_layer_norm", lambda: ops.embed_layer_norm(ids, table, w, None, EPS),
         lambda: F.layer_norm(F.embedding(ids, table), (D,), w, None, EPS),
         lambda: reference.embed_layer_norm(ids, *f32(table, w), None, EPS), 2 * T * D * b2,
         lambda: reference.embed_layer_norm(ids, table, w, None, EPS)),
        ("rotary", lambda: ops.rotary(qkv, pos, 10000.0)[0], lambda: plain_rotary(qkv, pos)[0],
         lambda: reference.rotary(qkv.float(), pos, 10000.0)[0], 4 * T * H * K * b2,
         lambda: reference.rotary(qkv, pos, 10000.0)[0]),
        ("glu", lambda: ops.glu(u, "gelu"), lambda: plain_glu(u), lambda: reference.glu(u.float(), "gelu"),
         3 * T * FF * b2, lambda: reference.glu(u, "gelu")),
    ], dict(x=x, r=r, w=w, table=table, ids=ids, qkv=qkv, pos=pos, u=u, plain_rotary=plain_rotary, opcall=opcall,
            plain_add_ln=plain_add_ln, plain_glu=plain_glu)


def forward_table(Ts) -> None:
    print("\n## forward, bf16 (err: max abs vs fp32 reference; kernel must be <= 2x plain bf16 + atol)")
    print(f"{'op':17s} {'T':>6s} {'err kern':>9s} {'err ref':>9s} | gpu us: {'triton':>7s} {'eager':>7s} "
          f"{'compiled':>8s} {'GB/s':>6s} | call us: {'triton':>7s} {'op':>7s} {'eager':>7s}")
    for T in Ts:
        cases, d = _cases(T)
        for name, tri, plain, ref32, nbytes, reflow in cases:
            try:
                e_k, e_r = _err(tri(), ref32()), _err(reflow(), ref32())
                g_t, g_e = _ms(tri), _ms(plain)
                g_c = _ms(torch.compile(plain, dynamic=False)) if T == max(Ts) else float("nan")  # compile once
                c_t, c_o, c_e = _call_ms(tri), _call_ms(d["opcall"][name]), _call_ms(plain)
                print(f"{name:17s} {T:6d} {e_k:9.2e} {e_r:9.2e} |         {g_t*1e3:7.1f} {g_e*1e3:7.1f} "
                      f"{g_c*1e3:8.1f} {nbytes / g_t / 1e6:6.0f} |          {c_t*1e3:7.1f} {c_o*1e3:7.1f} {c_e*1e3:7.1f}")
            except Exception:
                print(f"{name} T={T} FAILED\n{traceback.format_exc()}")


def backward_table(T: int) -> None:
    print(f"\n## forward + backward, bf16, T={T} (grad err vs fp32 autograd of the reference)")
    print(f"{'op':17s} {'err kern':>9s} {'err ref':>9s} | gpu us: {'triton':>7s} {'eager':>7s} {'x':>5s} | call us: {'triton':>7s} {'eager':>7s}")
    _, d = _cases(T)
    ops = get_ops("triton", "cuda")
    w = d["w"]

    def run(fn, leaves, cot):
        leaves = [t.detach().requires_grad_() for t in leaves]
        out = fn(*leaves)
        return torch.autograd.grad(out, leaves, cot)

    gD = torch.randn(T, D, device="cuda").to(BF16)
    gQ = torch.randn(T, H, K, device="cuda").to(BF16)
    gF = torch.randn(T, FF, device="cuda").to(BF16)
    rows = [
        ("layer_norm", lambda x, w: ops.layer_norm(x, w, None, EPS), lambda x, w: F.layer_norm(x, (D,), w, None, EPS),
         lambda x, w: reference.layer_norm(x, w, None, EPS), (d["x"], w), gD),
        ("add_layer_norm", lambda x, r, w: ops.add_layer_norm(x, r, w, None, EPS),
         lambda x, r, w: (lambda s: (F.layer_norm(s, (D,), w, None, EPS), s))(x + r),
         lambda x, r, w: reference.add_layer_norm(x, r, w, None, EPS), (d["x"], d["r"], w), (gD, gD)),
        ("embed_layer_norm", lambda t, w: ops.embed_layer_norm(d["ids"], t, w, None, EPS),
         lambda t, w: F.layer_norm(F.embedding(d["ids"], t), (D,), w, None, EPS),
         lambda t, w: reference.embed_layer_norm(d["ids"], t, w, None, EPS), (d["table"], w), gD),
        ("rotary", lambda q: ops.rotary(q, d["pos"], 10000.0), lambda q: d["plain_rotary"](q, d["pos"]),
         lambda q: reference.rotary(q, d["pos"], 10000.0), (d["qkv"],), (gQ, gQ)),
        ("glu", lambda u: ops.glu(u, "gelu"), d["plain_glu"], lambda u: reference.glu(u, "gelu"), (d["u"],), gF),
    ]
    for name, tri, plain, ref, leaves, cot in rows:
        try:
            cot32 = tuple(c.float() for c in cot) if isinstance(cot, tuple) else cot.float()
            g32 = run(ref, [t.float() for t in leaves], cot32)
            e_k = max(_err(a, b) for a, b in zip(run(tri, leaves, cot), g32))
            e_r = max(_err(a, b) for a, b in zip(run(ref, leaves, cot), g32))
            ft, fe = (lambda: run(tri, leaves, cot)), (lambda: run(plain, leaves, cot))
            t_t, t_e = _ms(ft), _ms(fe)
            print(f"{name:17s} {e_k:9.2e} {e_r:9.2e} |         {t_t*1e3:7.1f} {t_e*1e3:7.1f} {t_e / t_t:5.2f} |"
                  f"          {_call_ms(ft)*1e3:7.1f} {_call_ms(fe)*1e3:7.1f}")
        except Exception:
            print(f"{name} FAILED\n{traceback.format_exc()}")


def _lengths(n, median, sigma, lo, hi, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median) + sigma * torch.randn(n, generator=g)).round().clamp(lo, hi).long()
    return x.tolist()


def attention_table() -> None:
    print("\n## varlen attention, bf16, H=12 K=64 (gpu us / call us; err vs the first impl)")
    packs = {"query 128x~24": _lengths(128, 24, 0.5, 4, 128), "doc 32x~350": _lengths(32, 350, 0.7, 32, 2048),
             "doc 64k budget": _lengths(180, 350, 0.7, 32, 2048), "long 8x~4096": _lengths(8, 4096, 0.4, 1024, 8192)}
    for pname, lengths in packs.items():
        T, Lmax = sum(lengths), max(lengths)
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
        cu = cu.cuda()
        q, k, v = (torch.randn(T, H, K, device="cuda").to(BF16) for _ in range(3))
        for window in ((-1, -1), (64, 64)):
            first, cells = None, []
            for name, fn in flash.IMPLS.items():
                try:
                    out = fn(q, k, v, cu, Lmax, window)
                    first = out if first is None else first
                    f = lambda: fn(q, k, v, cu, Lmax, window)  # noqa: E731
                    cells.append(f"{name}={_ms(f)*1e3:.1f}/{_call_ms(f)*1e3:.1f} (err {_err(out, first):.1e})")
                except Exception as e:
                    cells.append(f"{name}=FAILED {type(e).__name__}: {e}")
            print(f"{pname:15s} T={T:6d} window={window}: " + ", ".join(cells))


def encode_add_ln(params, ids, cu_seqlens, max_seqlen, positions, ops):
    """ModernBERT encode with the residual adds fused into the next LayerNorm (proposed change to
    models/modernbert.py: each layer returns the pending MLP output instead of adding it)."""
    cfg = params.config
    T, Hh, Kk = ids.numel(), cfg.num_attention_heads, cfg.head_dim
    e, n = params.embeddings, params.embeddings.norm
    x = ops.embed_layer_norm(ids, e.tok_embeddings.weight, n.weight, n.bias, cfg.norm_eps)
    pending = None
    for i, p in enumerate(params.layers):
        g = cfg.is_global_layer(i)
        window = (-1, -1) if g else (cfg.local_attention // 2,) * 2
        theta = cfg.global_rope_theta if g else cfg.local_rope_theta
        if pending is None:
            h = x if p.attn_norm is None else ops.layer_norm(x, p.attn_norm.weight, p.attn_norm.bias, cfg.norm_eps)
        else:
            h, x = ops.add_layer_norm(pending, x, p.attn_norm.weight, p.attn_norm.bias, cfg.norm_eps)
        qkv = ops.linear(h, p.attn.wqkv.weight, p.attn.wqkv.bias).view(T, 3, Hh, Kk)
        q, k = ops.rotary(qkv, positions, theta)
        o = ops.varlen_attention(q, k, qkv[:, 2], cu_seqlens, max_seqlen, window=window)
        a = ops.linear(o.reshape(T, Hh * Kk), p.attn.wo.weight, p.attn.wo.bias)
        h, x = ops.add_layer_norm(a, x, p.mlp_norm.weight, p.mlp_norm.bias, cfg.norm_eps)
        u = ops.linear(h, p.mlp.wi.weight, p.mlp.wi.bias)
        pending = ops.linear(ops.glu(u, cfg.hidden_activation), p.mlp.wo.weight, p.mlp.wo.bias)
    f = params.final_norm
    return ops.add_layer_norm(pending, x, f.weight, f.bias, cfg.norm_eps)[0]


def encode_table() -> None:
    from benchmarks import baseline_modernbert as B
    from packedenc.models.modernbert import ModernBertConfig, init

    print("\n## ModernBERT-base encode, bf16, random weights: gpu = CUDA-graph replay, call = eager")
    params = pe.tree_to(init(ModernBertConfig(), torch.Generator().manual_seed(0), dtype=BF16), "cuda")
    state = B.prepare(params)
    for pname, lengths in {"query 128x~24": _lengths(128, 24, 0.5, 4, 128),
                           "doc 64k budget": _lengths(180, 350, 0.7, 32, 2048)}.items():
        b = pe.pack([torch.randint(5, 50000, (n,)) for n in lengths], device="cuda")
        T = b.ids.numel()
        ref_fused = dataclasses.replace(get_ops("reference", "cuda"), varlen_attention=flash.varlen_attention)
        systems = {
            "plain-torch baseline": lambda: B.encode(state, b.ids, b.cu_seqlens, b.max_seqlen, b.positions),
            "pe reference ops + flash": lambda: pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, b.positions, backend=ref_fused),
            "pe auto (triton + flash)": lambda: pe.encode(params, b.ids, b.cu_seqlens, b.max_seqlen, b.positions),
        }
        auto = get_ops("auto", "cuda")
        systems["pe auto + add_layer_norm (proposed)"] = lambda: encode_add_ln(params, b.ids, b.cu_seqlens, b.max_seqlen, b.positions, auto)
        compiled = torch.compile(pe.encode, fullgraph=True, dynamic=False)
        systems["pe auto, torch.compile fullgraph"] = lambda: compiled(params, b.ids, b.cu_seqlens, b.max_seqlen, b.positions)
        base = systems["plain-torch baseline"]()
        for name, fn in systems.items():
            try:
                with torch.no_grad():
                    out = fn()
                    cos = F.cosine_similarity(out.float(), base.float(), dim=-1).min().item()
                    g, c = _ms(fn), _call_ms(fn, 5)
                print(f"{pname:15s} T={T:6d} {name:36s} gpu {g:7.2f} ms {T / g:7.0f}k tok/s | call {c:7.2f} ms "
                      f"{T / c:7.0f}k tok/s | min cos vs baseline {cos:.5f}")
            except Exception:
                print(f"{pname} {name} FAILED\n{traceback.format_exc()}")


def sweep(T: int) -> None:
    print(f"\n## tile sweep, T={T}")
    _, d = _cases(T)
    x, w, u = d["x"], d["w"], d["u"]
    from packedenc.kernels.triton import rotary as RO

    orig_row_tile, orig_glu_tile = L.row_tile, G._tile
    try:
        for target in (1024, 2048, 4096, 8192):
            L.row_tile = lambda width, target=target: orig_row_tile(width, target)
            print(f"layer_norm target={target:5d} {orig_row_tile(D, target)}: {_ms(lambda: L.ln_fwd(x, w, None, EPS))*1e3:7.1f} us"
                  f"  bwd {_ms(lambda: L.ln_bwd(x, x, w, EPS))*1e3:7.1f} us")
        for bf, bt, nw in ((256, 8, 4), (128, 16, 4), (128, 8, 4), (64, 32, 4), (128, 32, 8)):
            G._tile = lambda T_, F_, bf=bf, bt=bt, nw=nw: ((math.ceil(T_ / bt), math.ceil(F_ / bf)), bt, bf, nw)
            print(f"glu BLOCK_F={bf:4d} BLOCK_T={bt:2d} warps={nw}: {_ms(lambda: G.glu_fwd(u))*1e3:7.1f} us")
        for elems in (1024, 2048, 4096, 8192):
            RO.TILE_ELEMS = elems
            print(f"rotary TILE_ELEMS={elems:5d}: {_ms(lambda: RO.rotary_fwd(d['qkv'], d['pos'], 1e4))*1e3:7.1f} us")
    finally:
        L.row_tile, G._tile = orig_row_tile, orig_glu_tile
        RO.TILE_ELEMS = 2048


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", default="fwd,bwd,attn,encode")
    a = ap.parse_args()
    print(f"# bench_ops on {torch.cuda.get_device_name()}; torch {torch.__version__}; commit {pe_commit()}")
    print(f"flash impls: {list(flash.IMPLS)}; best: {flash.BEST}")
    only = a.only.split(",")
    for key, fn in (("fwd", lambda: forward_table((4096, 32768))), ("bwd", lambda: backward_table(32768)),
                    ("attn", attention_table), ("encode", encode_table)):
        if key in only:
            try:
                fn()
            except Exception:
                traceback.print_exc()
    if a.sweep:
        sweep(32768)


def pe_commit() -> str:
    import subprocess

    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


if __name__ == "__main__":
    main()
