"""Graph transformer benchmark (issue 6): padded SDPA vs a packed aten-efficient path vs packedenc.

    python -m benchmarks.graph [--reps 5] [--batch 1024] [--readout anchor_neighbor_attention] [--profile]

Model: GiGL's GraphTransformerEncoder math, 3 layers, width 512, 8 heads, GELU FFN (ratio 4), one
node type with 128 input features. Workload: 4096 anchor sequences, lengths log-normal (median 90,
sigma 0.6) rounded and clipped to [1, 256], seeded; batches of `--batch` sequences.

Systems (same params, same batches, one process):
- padded-sdpa: GiGL's layout: (B, L, D) grid, SDPA with an additive float mask (finfo.min / 2 on
  padded keys), padded rows zeroed after each block; inputs arrive padded (padding not timed).
- packed-aten-efficient: packed tokens, plain torch ops, `aten._efficient_attention_forward` with
  cu_seqlens (the packed-attention design of the reference note).
- packedenc: `packedenc.encode(params, x, cu_seqlens, max_seqlen)` with backend="auto".
- packedenc[...] (bf16 workloads only): the same with one choice switched, to see what it is
  worth: `attn=efficient` / `attn=flash` (the graph_attention core of bf16 full layers, default
  "triton"), `recompute-ffn-act` (the FFN keeps only u for the backward and recomputes act(u)).
Workloads: fwd-fp32, fwd-bf16, train-fp32, train-bf16 (forward + backward to every params leaf).
Params and inputs are cast to the workload dtype (no autocast), as GiGL users run fp32.
Then (unless --no-parts) each attention core and the readout alone on the first batch (device
ms, TFLOP/s of real attention work), the target verdicts (ok / MISSED), and with --profile the
top CUDA kernels of one train-bf16 pass of packedenc and of the aten-efficient path.

Method: CUDA events around each repetition (one pass over every batch), after a warm-up pass;
the median repetition gives real (unpadded) tokens/s; peak reserved memory is reset (after
emptying the cache) before each (system, workload). Batches wait on the CPU; only the measured
system's own inputs are on the GPU while it runs (padded-sdpa: the padded grid and mask;
the packed systems: packed features and cu_seqlens), so a peak counts what that system needs
and not the other systems' inputs (the first run at b5894d0 kept every format resident: ~0.75 GB
of padded fp32 grids in every system's peak). Records go to
benchmarks/results/graph_<gpu>.json with system, workload, tokens_per_s, peak_reserved_gb, gpu,
commit, plus extras. Its own workload and systems; commit and GPU names come from benchmarks.report.

Shapes: T packed tokens, S sequences, B padded batch, L padded length, D width, H heads, K head dim.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import packedenc as pe
from packedenc.models.graph_transformer import GraphTransformerConfig, init
from packedenc.pytree import tree_cast, tree_leaves, tree_map

from benchmarks import graph_ops
from benchmarks.common import module_switches
from benchmarks.report import git_commit, gpu_slug

RESULTS = Path(__file__).resolve().parent / "results"
WORKLOADS = ("fwd-fp32", "fwd-bf16", "train-fp32", "train-bf16")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FEATS = 128


# ---- workload ---------------------------------------------------------------------------------


def lengths(num_seqs: int = 4096, median: float = 90, sigma: float = 0.6, lo: int = 1, hi: int = 256,
            seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ln = torch.exp(math.log(median) + sigma * torch.randn(num_seqs, generator=g))
    return ln.round().clamp(lo, hi).long().tolist()


PADDED_INPUTS = ("xp", "valid")  # what padded-sdpa reads
PACKED_INPUTS = ("x", "cu")  # what the packed systems read


def on_device(batches: list[dict[str, Any]], keys: tuple[str, ...], device: torch.device) -> list[dict[str, Any]]:
    """The batches with `keys` moved to `device` (the rest stays where it is)."""
    return [{**b, **{k: b[k].to(device) for k in keys}} for b in batches]


def inputs_of(name: str) -> tuple[str, ...]:
    return PADDED_INPUTS if name == "padded-sdpa" else PACKED_INPUTS


def make_batches(lens: list[int], batch: int, device: torch.device, seed: int = 1) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(0, len(lens), batch):
        ls = torch.tensor(lens[i:i + batch])
        cu = torch.zeros(ls.numel() + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(ls, 0)
        x = torch.randn(int(cu[-1]), FEATS, generator=g)
        xp, valid = pe.pad(x, cu)
        out.append(dict(x=x.to(device), cu=cu.to(device), max_seqlen=int(ls.max()), xp=xp.to(device),
                        valid=valid.to(device), tokens=int(cu[-1]), padded=xp.shape[0] * xp.shape[1]))
    return out


# ---- systems ----------------------------------------------------------------------------------


def _ffn(p, h: Tensor) -> Tensor:
    return F.linear(F.gelu(F.linear(h, p.ffn.linear_in.weight, p.ffn.linear_in.bias)),
                    p.ffn.linear_out.weight, p.ffn.linear_out.bias)


def _ln(n, h: Tensor, eps: float) -> Tensor:
    return F.layer_norm(h, (h.shape[-1],), n.weight, n.bias, eps)


def padded_sdpa(params, b: dict[str, Any]) -> Tensor:
    """GiGL's padded forward (eval): float-mask SDPA on a (B, L, D) grid."""
    cfg = params.config
    x, valid = b["xp"].to(params.final_norm.weight.dtype), b["valid"]
    B, L, _ = x.shape
    H, K, D = cfg.num_heads, cfg.head_dim, cfg.hid_dim
    vm = valid[..., None].to(x.dtype)
    lin = params.node_projection_dict[cfg.node_types[0]]
    h = F.linear(x, lin.weight, lin.bias) * vm
    bias = torch.zeros(B, 1, 1, L, dtype=x.dtype, device=x.device)
    bias = bias.masked_fill(~valid[:, None, None, :], torch.finfo(x.dtype).min / 2)
    n = len(params.encoder_layers)
    for i, p in enumerate(params.encoder_layers):
        Lq = 1 if (i == n - 1 and cfg.readout_mode == "anchor_only") else L
        hn = _ln(p.attention_norm, h, cfg.norm_eps)
        q = F.linear(hn[:, :Lq], p.query_projection.weight, p.query_projection.bias).view(B, Lq, H, K).transpose(1, 2)
        k = F.linear(hn, p.key_projection.weight, p.key_projection.bias).view(B, L, H, K).transpose(1, 2)
        v = F.linear(hn, p.value_projection.weight, p.value_projection.bias).view(B, L, H, K).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(B, Lq, D)
        h = (h[:, :Lq] + F.linear(o, p.output_projection.weight, p.output_projection.bias)) * vm[:, :Lq]
        h = (h + _ffn(p, _ln(p.ffn_norm, h, cfg.norm_eps))) * vm[:, :Lq]
    z = _ln(params.final_norm, h, cfg.norm_eps) * vm[:, : h.shape[1]]
    anchor = z[:, 0]
    if cfg.readout_mode == "anchor_neighbor_attention":
        nb, ok = z[:, 1:], valid[:, 1:, None]
        r = params.readout_attention
        s = F.linear(torch.cat([anchor[:, None].expand_as(nb), nb], -1), r.weight, r.bias)
        w = torch.nan_to_num(torch.softmax(s.masked_fill(~ok, torch.finfo(s.dtype).min), 1), nan=0.0) * ok
        anchor = anchor + (nb * w).sum(1)
    o = params.output_projection
    return F.linear(anchor, o.weight, o.bias)


def _segment_readout(params, z: Tensor, cu: Tensor) -> Tensor:
    T, D = z.shape
    S = cu.numel() - 1
    seg = pe.packing.segment_ids(cu, T)
    first = pe.packing.positions_from_cu_seqlens(cu, T) == 0
    w = params.readout_attention.weight.reshape(2, D)
    anchor = z[cu[:-1].long()]
    s = (z @ w[1] + (anchor @ w[0])[seg] + params.readout_attention.bias).float().masked_fill(first, -math.inf)
    m = torch.full((S,), -math.inf, device=z.device).scatter_reduce(0, seg, s.detach(), "amax")
    e = torch.exp(s - torch.where(m.isfinite(), m, 0)[seg])
    den = torch.zeros(S, device=z.device).index_add(0, seg, e).clamp_min(1e-30)
    return anchor + torch.zeros(S, D, device=z.device, dtype=z.dtype).index_add(0, seg, ((e / den[seg])[:, None] * z).to(z.dtype))


def packed_aten_efficient(params, b: dict[str, Any]) -> Tensor:
    """Packed tokens through plain torch ops and aten's memory-efficient varlen attention."""
    cfg = params.config
    x, cu, M = b["x"].to(params.final_norm.weight.dtype), b["cu"], b["max_seqlen"]
    T, H, K, D = x.shape[0], cfg.num_heads, cfg.head_dim, cfg.hid_dim
    lin = params.node_projection_dict[cfg.node_types[0]]
    h = F.linear(x, lin.weight, lin.bias)
    lse = torch.is_grad_enabled()
    for p in params.encoder_layers:
        hn = _ln(p.attention_norm, h, cfg.norm_eps)
        q, k, v = (F.linear(hn, w.weight, w.bias).view(1, T, H, K)
                   for w in (p.query_projection, p.key_projection, p.value_projection))
        o = torch.ops.aten._efficient_attention_forward(q, k, v, None, cu, cu, M, M, 0.0, 0, lse, scale=K**-0.5)[0]
        h = h + F.linear(o.reshape(T, D), p.output_projection.weight, p.output_projection.bias)
        h = h + _ffn(p, _ln(p.ffn_norm, h, cfg.norm_eps))
    z = _ln(params.final_norm, h, cfg.norm_eps)
    out = _segment_readout(params, z, cu) if cfg.readout_mode == "anchor_neighbor_attention" else z[cu[:-1].long()]
    o = params.output_projection
    return F.linear(out, o.weight, o.bias)


def packedenc_encode(params, b: dict[str, Any]) -> Tensor:
    return pe.encode(params, b["x"], b["cu"], b["max_seqlen"])


def packedenc_variant(**switches: Any) -> Callable[[Any, dict[str, Any]], Tensor]:
    """packedenc with module-level choices switched for the call (restored after it)."""
    from packedenc.kernels import graph_attention as ga
    from packedenc.models.graph_transformer import forward as fw

    where = {"LOWP_CORE": ga, "RECOMPUTE_FFN_ACTIVATION": fw}

    def run(params, b: dict[str, Any]) -> Tensor:
        with module_switches(where, switches):
            return packedenc_encode(params, b)

    return run


SYSTEMS: dict[str, Callable[[Any, dict[str, Any]], Tensor]] = {
    "padded-sdpa": padded_sdpa,
    "packed-aten-efficient": packed_aten_efficient,
    "packedenc": packedenc_encode,
    "packedenc[attn=efficient]": packedenc_variant(LOWP_CORE="efficient"),
    "packedenc[attn=flash]": packedenc_variant(LOWP_CORE="flash"),
    "packedenc[recompute-ffn-act]": packedenc_variant(RECOMPUTE_FFN_ACTIVATION=True),
}
LOWP_ONLY = {name for name in SYSTEMS if name.startswith("packedenc[")}  # bf16 workloads only


# ---- timing -----------------------------------------------------------------------------------


def run_pass(fn, params, batches, train: bool) -> None:
    for b in batches:
        if train:
            out = fn(params, b)
            torch.autograd.grad(out.float().square().mean(), tree_leaves(params), allow_unused=True)
        else:
            with torch.no_grad():
                fn(params, b)


def measure(fn, params, batches, train: bool, reps: int) -> tuple[float, float]:
    """(median seconds per pass, peak reserved GB)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run_pass(fn, params, batches, train)  # warm-up: kernels, autotune, allocator
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run_pass(fn, params, batches, train)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_reserved() / 2**30


# ---- main -------------------------------------------------------------------------------------


def check_agreement(params, b: dict[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, float]:
    """Max |diff| of each system's output in `dtype` against padded-sdpa in fp32 on batch `b`
    (bf16: the padded system's own error is the yardstick, as in the 2x rule of the GPU tests)."""
    with torch.no_grad():
        ref = padded_sdpa(params, b).float()
        p = tree_cast(params, dtype)
        return {n: float((fn(p, b).float() - ref).abs().max()) for n, fn in SYSTEMS.items()
                if dtype != torch.float32 or n not in LOWP_ONLY}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=1024, help="sequences per batch")
    ap.add_argument("--readout", default="anchor_neighbor_attention", choices=("anchor_neighbor_attention", "anchor_only"))
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--out", default=None, help="results file (default benchmarks/results/graph_<gpu>.json)")
    ap.add_argument("--no-parts", action="store_true", help="skip timing the attention cores / readout alone")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one train-bf16 pass")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.graph needs a CUDA GPU")
    dev = torch.device("cuda")
    gpu, commit = torch.cuda.get_device_name(dev), git_commit()
    cfg = GraphTransformerConfig(node_type_to_feat_dim_map={"node": FEATS}, hid_dim=512, num_heads=8,
                                 num_layers=3, out_dim=128, readout_mode=args.readout)
    params32 = pe.tree_to(init(cfg, torch.Generator().manual_seed(0)), dev)
    lens = lengths()
    batches = make_batches(lens, args.batch, torch.device("cpu"))  # on the GPU per system: on_device
    first = on_device(batches[:1], PADDED_INPUTS + PACKED_INPUTS, dev)[0]
    tokens, padded = sum(b["tokens"] for b in batches), sum(b["padded"] for b in batches)
    print(f"# graph transformer | {gpu} | torch {torch.__version__} | commit {commit}")
    print(f"# {len(lens)} seqs, {tokens} tokens ({padded} padded, {tokens / padded:.0%} real), "
          f"batch {args.batch}, readout {args.readout}")
    for dt in (torch.float32, torch.bfloat16):
        diffs = check_agreement(params32, first, dt)
        print(f"# {dt} max|diff| vs padded-sdpa fp32:", {k: f"{v:.2e}" for k, v in diffs.items()})
    first = None  # not resident while the systems are measured
    pe.get_ops("auto", dev)  # logs the op choice once
    print("# packedenc ops:", dict(pe.get_ops("auto", dev).chosen))

    records = []
    for wl in args.workloads.split(","):
        mode, dt = wl.split("-")
        params = tree_cast(params32, DTYPES[dt])
        if mode == "train":
            params = tree_map(lambda t: t.detach().requires_grad_(), params)
        for name in args.systems.split(","):
            if name in LOWP_ONLY and dt == "fp32":
                continue
            if name not in SYSTEMS:
                print(f"# unknown system {name!r}; known: {list(SYSTEMS)}")
                continue
            rec: dict[str, Any] = dict(system=name, workload=wl, tokens_per_s=None, peak_reserved_gb=None,
                                       gpu=gpu, commit=commit)
            try:
                torch.cuda.empty_cache()
                mine = on_device(batches, inputs_of(name), dev)
                sec, mem = measure(SYSTEMS[name], params, mine, mode == "train", args.reps)
                rec.update(tokens_per_s=tokens / sec, peak_reserved_gb=mem, median_pass_ms=sec * 1e3)
            except torch.OutOfMemoryError as e:
                rec.update(status="oom", error=str(e).splitlines()[0])
            except Exception as e:  # noqa: BLE001 - a failing system is recorded, not fatal
                rec.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
            rec.update(num_seqs=len(lens), num_tokens=tokens, padded_tokens=padded, batch=args.batch,
                       readout=args.readout, torch=torch.__version__,
                       model="3 layers, width 512, 8 heads, gelu ffn x4, 128 input features")
            mine = None  # this system's inputs leave the GPU before the next one runs
            records.append(rec)
            print(f"{wl:11s} {name:26s} " + (f"{rec['tokens_per_s'] / 1e6:7.3f} M tok/s  {rec['peak_reserved_gb']:6.2f} GB"
                                             if rec["tokens_per_s"] else rec.get("error", "")), flush=True)
            torch.cuda.empty_cache()

    out = Path(args.out) if args.out else RESULTS / f"graph_{gpu_slug(gpu)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(records, indent=1) + "\n")
    print_table(records)
    print(f"# wrote {out}")
    if not args.no_parts:
        first = on_device(batches[:1], PACKED_INPUTS, dev)[0]
        graph_ops.print_parts(graph_ops.attention_and_readout(first, cfg.num_heads, cfg.head_dim), first["tokens"])
    if args.profile:
        p16 = tree_map(lambda t: t.detach().requires_grad_(), tree_cast(params32, torch.bfloat16))
        for name in ("packedenc", "packed-aten-efficient"):
            mine = on_device(batches, inputs_of(name), dev)
            graph_ops.profile_pass(name, lambda fn=SYSTEMS[name], bs=mine: run_pass(fn, p16, bs, True))
    graph_ops.print_verdicts({(r["system"], r["workload"]): r for r in records})
    return records


def print_table(records: list[dict[str, Any]]) -> None:
    by = {(r["system"], r["workload"]): r for r in records}
    print("\nworkload     system                       M tok/s   x padded   peak GB   x padded mem")
    for wl in WORKLOADS:
        base = by.get(("padded-sdpa", wl))
        for name in SYSTEMS:
            r = by.get((name, wl))
            if r is None:
                continue
            if not r["tokens_per_s"]:
                print(f"{wl:12s} {name:26s}  {r.get('status', 'failed')}")
                continue
            ok = base is not None and base["tokens_per_s"]
            sp = f"{r['tokens_per_s'] / base['tokens_per_s']:7.2f}x" if ok else "      -"
            mm = f"{r['peak_reserved_gb'] / base['peak_reserved_gb']:7.2f}x" if ok else "      -"
            print(f"{wl:12s} {name:26s} {r['tokens_per_s'] / 1e6:8.3f}  {sp}  {r['peak_reserved_gb']:8.2f}  {mm}")


if __name__ == "__main__":
    main()
